//! A shared receive queue in the target process, fed by initiators in other processes.

use crate::common::*;
use crate::harness::{Peer, msg, peer};
use softverbs::*;
use std::time::{Duration, Instant};

const PER_SENDER: usize = 3;

fn message(sender: u32, k: usize) -> Vec<u8> {
    format!("message {k} from initiator {sender}").into_bytes()
}

fn srq_attr(max_wr: u32) -> SrqAttr {
    SrqAttr {
        max_wr,
        max_sge: 1,
        srq_limit: 0,
    }
}

// Two QPs on one SRQ; each QP is connected to an initiator in another process.
peer!(peer_srq_target, |p| {
    let n = node();
    let srq = n.pd.create_srq(srq_attr(16)).unwrap();
    let mut init = QpInitAttr::rc(&n.cq, &n.cq);
    init.srq = Some(&srq);
    let r1 = n.pd.create_qp(&init).unwrap();
    let r2 = n.pd.create_qp(&init).unwrap();
    p.send(msg!(
        "target",
        r1.endpoint(500).unwrap(),
        r2.endpoint(600).unwrap()
    ));
    let m = p.expect("initiators");
    let (s1, s2): (Endpoint, Endpoint) = (m.get(0), m.get(1));
    let bufs = n.mr(16 * 64);
    let sges: Vec<[Sge; 1]> = (0..8).map(|i| [bufs.sge(i * 64..i * 64 + 64)]).collect();
    srq.post_recv(
        sges.iter()
            .enumerate()
            .map(|(i, s)| RecvWr::new(100 + i as u64, s)),
    )
    .unwrap();
    r1.connect(&s1, 500, ALL_REMOTE).unwrap();
    r2.connect(&s2, 600, ALL_REMOTE).unwrap();
    p.send("ready");

    let wc = poll_n(&n.cq, 2 * PER_SENDER, "SRQ target: receive completions");
    assert_all_ok(&wc, "SRQ target: receive completions");
    let data = bufs.to_vec();
    let mut seen = Vec::new();
    let mut next = [0usize; 2];
    let mut last_wr = [0u64; 2];
    for w in &wc {
        let (who, sender) = match w.qp_num() {
            q if q == r1.qp_num() => (0, s1),
            q if q == r2.qp_num() => (1, s2),
            q => panic!("SRQ target: completion for QP {q}, not one of ours: {w:?}"),
        };
        assert_eq!(w.opcode(), WcOpcode::Recv, "{w:?}");
        assert_eq!(w.src_qp(), sender.qpn, "SRQ target: src_qp of {w:?}");
        assert!(
            (100..108).contains(&w.wr_id()),
            "SRQ target: wr_id of {w:?}"
        );
        assert!(
            !seen.contains(&w.wr_id()),
            "SRQ target: WQE used twice: {wc:?}"
        );
        seen.push(w.wr_id());
        // One QP's messages arrive in order, so they take the SRQ's WQEs in order.
        assert!(w.wr_id() > last_wr[who], "SRQ target: QP order: {wc:?}");
        last_wr[who] = w.wr_id();
        let want = message(who as u32 + 1, next[who]);
        next[who] += 1;
        assert_eq!(w.byte_len() as usize, want.len(), "{w:?}");
        let at = (w.wr_id() - 100) as usize * 64;
        assert_eq!(
            compare(&data[at..at + want.len()], &want),
            "ok",
            "SRQ target: WQE {} holds {:?}",
            w.wr_id(),
            String::from_utf8_lossy(&want)
        );
    }
    assert_eq!(next, [PER_SENDER; 2], "SRQ target: messages per QP: {wc:?}");
    p.send(msg!("received", wc.len()));
});

peer!(peer_srq_initiator, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    p.send(msg!("initiator", qp.endpoint(700).unwrap()));
    let r: Endpoint = p.expect("target").get(0);
    qp.connect(&r, 700, ALL_REMOTE).unwrap();
    p.send("connected");
    p.expect("go");
    let msgs: Vec<Vec<u8>> = (0..PER_SENDER).map(|k| message(2, k)).collect();
    qp.post_send(
        msgs.iter()
            .enumerate()
            .map(|(k, m)| signaled(SendWr::inline(k as u64, SendOp::Send, m))),
    )
    .unwrap();
    let wc = poll_n(&n.cq, PER_SENDER, "SRQ initiator 2: send completions");
    assert_all_ok(&wc, "SRQ initiator 2: send completions");
    p.send("sent");
});

#[test]
fn srq_in_the_target_process_feeds_two_qps_connected_to_two_initiator_processes() {
    let mut target = Peer::spawn("srq::peer_srq_target");
    let mut other = Peer::spawn("srq::peer_srq_initiator");
    let m = target.expect("target");
    let (r1, r2): (Endpoint, Endpoint) = (m.get(0), m.get(1));
    let s2: Endpoint = other.expect("initiator").get(0);
    let n = node();
    let s1 = n.qp(QpType::Rc);
    target.send(msg!("initiators", s1.endpoint(800).unwrap(), s2));
    target.expect("ready");
    s1.connect(&r1, 800, ALL_REMOTE).unwrap();
    other.send(msg!("target", r2));
    other.expect("connected");

    other.send("go");
    let msgs: Vec<Vec<u8>> = (0..PER_SENDER).map(|k| message(1, k)).collect();
    s1.post_send(
        msgs.iter()
            .enumerate()
            .map(|(k, m)| signaled(SendWr::inline(k as u64, SendOp::Send, m))),
    )
    .unwrap();
    let wc = poll_n(
        &n.cq,
        PER_SENDER,
        "SRQ initiator 1 (parent): send completions",
    );
    assert_all_ok(&wc, "SRQ initiator 1 (parent): send completions");
    other.expect("sent");
    assert_eq!(target.expect("received").get::<usize>(0), 2 * PER_SENDER);
    target.finish();
    other.finish();
}

// An SRQ with 4 WQEs and its limit armed at 3, drained by a sender in another process.
peer!(peer_srq_limit_target, |p| {
    let n = node();
    let srq = n.pd.create_srq(srq_attr(8)).unwrap();
    let mut init = QpInitAttr::rc(&n.cq, &n.cq);
    init.srq = Some(&srq);
    let qp = n.pd.create_qp(&init).unwrap();
    let bufs = n.mr(4 * 64);
    let sges: Vec<[Sge; 1]> = (0..4).map(|i| [bufs.sge(i * 64..i * 64 + 64)]).collect();
    srq.post_recv(
        sges.iter()
            .enumerate()
            .map(|(i, s)| RecvWr::new(i as u64, s)),
    )
    .unwrap();
    srq.arm_limit(3).unwrap();
    p.send(msg!("target", qp.endpoint(0).unwrap()));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.connect(&them, 0, ALL_REMOTE).unwrap();
    p.send("ready");
    let wc = poll_n(&n.cq, 2, "SRQ limit target: receive completions");
    assert_all_ok(&wc, "SRQ limit target: receive completions");
    let deadline = Instant::now() + Duration::from_secs(2);
    let ev = loop {
        match n.ctx.try_get_async_event() {
            Ok(ev) => break Some(ev),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => break None,
        }
    };
    let ev = ev.expect("SRQ_LIMIT_REACHED in the target process within 2 s of the receives");
    assert_eq!(
        (ev.kind, ev.element),
        (AsyncEventType::SrqLimitReached, EventElement::Srq(srq.id())),
        "the async event"
    );
    assert_eq!(srq.query().srq_limit, 0, "the limit disarms after firing");
    p.send("event");
});

#[test]
fn srq_limit_event_fires_in_the_target_process_when_a_remote_sender_drains_it() {
    let mut t = Peer::spawn("srq::peer_srq_limit_target");
    let tep: Endpoint = t.expect("target").get(0);
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    qp.post_send([
        SendWr::inline(1, SendOp::Send, b"one"),
        signaled(SendWr::inline(2, SendOp::Send, b"two")),
    ])
    .unwrap();
    assert_all_ok(&poll_n(&n.cq, 1, "send completion"), "send completion");
    t.expect("event");
    t.finish();
}
