//! A CQ that another process completes into, resized after that process mapped it: that
//! process moves to the new, larger ring (more completions outstanding than the old one
//! held), and nothing is lost or reordered.

use crate::common::*;
use crate::harness::{Parent, Peer, msg, peer};
use softverbs::*;

/// The target's side of the connection: an RC QP on `cq` with `recvs` receives of `sge`
/// posted (`wr_id`s from 0), connected to the initiator, which is then told "ready".
fn target_qp(p: &Parent, n: &Node, cq: &CompletionQueue, recvs: u64, sge: &[Sge]) -> QueuePair {
    let attr = QpInitAttr {
        cap: QpCap {
            max_recv_wr: recvs as u32,
            ..QpInitAttr::rc(cq, cq).cap
        },
        ..QpInitAttr::rc(cq, cq)
    };
    let qp = n.pd.create_qp(&attr).unwrap();
    p.send(msg!("target", qp.endpoint(0).unwrap()));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.post_recv((0..recvs).map(|i| RecvWr::new(i, sge)))
        .unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");
    qp
}

/// Messages before and after the target resizes its CQ.
const BEFORE: u64 = 4;
const AFTER: u64 = 40;

peer!(peer_resize_target, |p| {
    let n = node();
    let ch = n.ctx.create_comp_channel().unwrap();
    let cq = n.ctx.create_cq(16, Some(&ch)).unwrap();
    let buf = n.mr(64);
    let _qp = target_qp(p, &n, &cq, BEFORE + AFTER, &[buf.sge(0..64)]);
    let mut got = poll_n(&cq, BEFORE as usize, "target: receives before the resize");
    // The initiator's process has our CQ's ring mapped, and keeps completing into it.
    assert!(cq.resize(256).unwrap() >= 256);
    cq.req_notify(false).unwrap();
    p.send("resized");
    let ev = ch.get_cq_event().unwrap();
    assert!(ev.same_as(&cq), "the event names our CQ");
    ev.ack_events(1);
    got.extend(poll_n(
        &cq,
        AFTER as usize,
        "target: receives after the resize",
    ));
    let ids: Vec<u64> = got.iter().map(|wc| wc.wr_id()).collect();
    assert_eq!(
        ids,
        (0..BEFORE + AFTER).collect::<Vec<_>>(),
        "every receive, in order"
    );
    assert!(
        got.iter()
            .all(|wc| wc.status() == WcStatus::Success && wc.byte_len() == 8)
    );
    let mut more = [WorkCompletion::default(); 4];
    assert_eq!(cq.poll(&mut more), 0, "nothing more");
    p.send("done");
});

#[test]
fn resizing_a_cq_another_process_completes_into_loses_nothing_and_keeps_order() {
    let mut t = Peer::spawn("cq::peer_resize_target");
    let tep: Endpoint = t.expect("target").get(0);
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let send = |i: u64| {
        qp.post_send([signaled(SendWr::inline(i, SendOp::Send, &i.to_le_bytes()))])
            .unwrap();
        let wc = poll_n(&n.cq, 1, "initiator: a SEND's completion")[0];
        assert_eq!((wc.wr_id(), wc.status()), (i, WcStatus::Success), "{wc:?}");
    };
    (0..BEFORE).for_each(send);
    t.expect("resized");
    (BEFORE..BEFORE + AFTER).for_each(send);
    t.expect("done");
    t.finish();
}

/// Receives in the stream, and after how many of them the target resizes (while the other
/// process is in the middle of a block).
const STREAM: u64 = 320;
const RESIZE_AT: [usize; 2] = [45, 170];
/// The initiator sends a block, then waits for the target to have taken it: at most one block
/// is outstanding in the target's CQ (whose first ring holds 32).
const BLOCK: usize = 32;

peer!(peer_stream_target, |p| {
    let n = node();
    let cq = n.ctx.create_cq(BLOCK as u32, None).unwrap();
    let buf = n.mr(64);
    let _qp = target_qp(p, &n, &cq, STREAM, &[buf.sge(0..64)]);
    // Poll while the other process streams SENDs, resizing twice on the way.
    let mut got = Vec::new();
    let mut sizes = vec![64, 256].into_iter();
    while got.len() < STREAM as usize {
        let before = got.len();
        got.extend(poll_n(&cq, 1, "target: the stream"));
        if RESIZE_AT.iter().any(|&at| before < at && got.len() >= at) {
            let size = sizes.next().unwrap();
            assert!(cq.resize(size).unwrap() >= size);
        }
        if got.len() % BLOCK == 0 {
            p.send("taken");
        }
    }
    let ids: Vec<u64> = got.iter().map(|wc| wc.wr_id()).collect();
    assert_eq!(
        ids,
        (0..STREAM).collect::<Vec<_>>(),
        "every receive, in order"
    );
    p.send("done");
});

#[test]
fn resizing_a_cq_while_another_process_streams_into_it_keeps_every_completion_in_order() {
    let mut t = Peer::spawn("cq::peer_stream_target");
    let tep: Endpoint = t.expect("target").get(0);
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    for block in (0..STREAM).collect::<Vec<_>>().chunks(BLOCK) {
        for chunk in block.chunks(8) {
            qp.post_send(
                chunk
                    .iter()
                    .map(|&i| signaled(SendWr::inline(i, SendOp::Send, &[1; 8]))),
            )
            .unwrap();
            for wc in poll_n(&n.cq, chunk.len(), "initiator: SEND completions") {
                assert_eq!(wc.status(), WcStatus::Success, "{wc:?}");
            }
        }
        t.expect("taken");
    }
    t.expect("done");
    t.finish();
}
