//! A CQ that another process completes into, resized after that process mapped it.
//!
//! That process keeps completing into the ring it mapped, which the resize keeps (with its
//! old capacity: 16 here, so fewer than 16 completions are outstanding at a time).

use crate::common::*;
use crate::harness::{Peer, msg, peer};
use softverbs::*;

/// Messages before and after the target resizes its CQ.
const BEFORE: u64 = 4;
const AFTER: u64 = 12;

peer!(peer_resize_target, |p| {
    let n = node();
    let ch = n.ctx.create_comp_channel().unwrap();
    let cq = n.ctx.create_cq(16, Some(&ch)).unwrap();
    let qp = n.pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let buf = n.mr(64);
    p.send(msg!("target", qp.endpoint(0).unwrap()));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    let sge = [buf.sge(0..64)];
    qp.post_recv((0..BEFORE + AFTER).map(|i| RecvWr::new(i, &sge)))
        .unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");
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
