//! A completion channel in the target process, woken by a SEND from another process.

use crate::common::*;
use crate::harness::{Peer, msg, peer};
use softverbs::*;
use std::time::Duration;

const WAKE: &[u8] = b"wake up, target";

peer!(peer_channel_target, |p| {
    let n = node();
    let ch = n.ctx.create_comp_channel().unwrap();
    let cq = n.ctx.create_cq(16, Some(&ch)).unwrap();
    let qp = n.pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let buf = n.mr(64);
    p.send(msg!("target", qp.endpoint(0).unwrap()));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.post_recv([RecvWr::new(1, &[buf.sge(0..64)])]).unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    cq.req_notify(false).unwrap();
    p.send("armed");
    // Blocks until the other process's SEND completes here (the peer's lifetime bounds it).
    let got = ch.get_cq_event().unwrap();
    assert!(got.same_as(&cq), "the event names our CQ");
    got.ack_events(1);
    let wc = poll_n(&cq, 1, "channel target: the receive")[0];
    assert_eq!(
        (
            wc.wr_id(),
            wc.status(),
            wc.opcode(),
            wc.byte_len(),
            wc.src_qp()
        ),
        (
            1,
            WcStatus::Success,
            WcOpcode::Recv,
            WAKE.len() as u32,
            them.qpn
        ),
        "{wc:?}"
    );
    assert_eq!(
        compare(&buf.to_vec()[..WAKE.len()], WAKE),
        "ok",
        "the message"
    );
    assert!(
        matches!(ch.try_get_cq_event(), Err(Error::WouldBlock)),
        "one event per arming"
    );
    p.send("woken");
});

#[test]
fn completion_channel_in_the_target_process_wakes_get_cq_event_on_a_send_from_another_process() {
    let mut t = Peer::spawn("channel::peer_channel_target");
    let tep: Endpoint = t.expect("target").get(0);
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "armed");

    // The target must be asleep in get_cq_event, not spinning: at some moment within a second,
    // none of its threads is running.
    let mut states = Vec::new();
    let asleep = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        states = thread_states(t.pid());
        !states.is_empty() && states.iter().all(|(_, _, s)| *s != 'R')
    });
    assert!(
        asleep,
        "the target never had all threads asleep while it waited in get_cq_event: {states:?}"
    );

    qp.post_send([signaled(SendWr::inline(1, SendOp::Send, WAKE))])
        .unwrap();
    let sc = poll_n(&n.cq, 1, "initiator: the SEND's completion")[0];
    assert_eq!(
        (sc.status(), sc.opcode()),
        (WcStatus::Success, WcOpcode::Send),
        "{sc:?}"
    );
    t.expect("woken");
    t.finish();
}
