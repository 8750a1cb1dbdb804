//! A target process that dies mid-stream: the initiator gets an error completion within its
//! QP's timeout × retries, and neither hangs nor crashes; and what the dead process leaves
//! behind (its QP number) does not let the old connection reach anyone else.
//!
//! Both tests run alone among this binary's multi-process tests ([`exclusive`]): a fresh
//! process's first QP number is the dead target's. The second test needs exactly that (its
//! new process must get the number); in the first, another test's peer taking the number
//! while the initiator still retries would mix the two tests up if the second test's bug came
//! back, so it is kept out of the way (the second test pins that bug deterministically).

use crate::common::*;
use crate::harness::{PEER_LIFETIME, Peer, RemoteMr, exclusive, msg, peer};
use softverbs::*;
use std::time::{Duration, Instant};

/// QP timeout attribute: 4.096 µs × 2^12 ≈ 16.8 ms per try.
const TIMEOUT: u8 = 12;
const RETRY_CNT: u8 = 3;
/// Time allowed on top of timeout × (retries + 1) to notice the loss (scheduling on a busy
/// machine).
const SLACK: Duration = Duration::from_secs(2);
/// Successful completions to see before the kill.
const BEFORE_KILL: usize = 200;
const WINDOW: usize = 32;
const SEND_RECVS: usize = 128;

// Sets up and waits to be killed.
peer!(peer_doomed_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let mem = n.mr(64 * 1024);
    let rbuf = n.mr(SEND_RECVS * 1024);
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mem)));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    let sges: Vec<[Sge; 1]> = (0..SEND_RECVS)
        .map(|i| [rbuf.sge(i * 1024..(i + 1) * 1024)])
        .collect();
    qp.post_recv(
        sges.iter()
            .enumerate()
            .map(|(i, s)| RecvWr::new(i as u64, s)),
    )
    .unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");
    p.recv_within(PEER_LIFETIME);
});

#[test]
fn target_killed_mid_stream_makes_the_initiator_fail_within_timeout_times_retries() {
    let _alone = exclusive();
    let mut t = Peer::spawn("failure::peer_doomed_target");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.qp(QpType::Rc);
    qp.connect(&tep, 0, ALL_REMOTE).unwrap();
    set_timeout_and_retries(&qp, TIMEOUT, RETRY_CNT);
    let a = qp.query();
    assert_eq!((a.timeout, a.retry_cnt), (TIMEOUT, RETRY_CNT));
    let bound = ack_timeout(TIMEOUT) * (u32::from(RETRY_CNT) + 1);
    t.send(msg!("initiator", qp.endpoint(0).unwrap()));
    t.expect("ready");

    let src = n.mr(8 * 1024);
    src.write_at(0, &pattern(8 * 1024, 4)).unwrap();
    let wsge = [src.sge(0..8 * 1024)];
    let ssge = [src.sge(0..1024)];
    let start = Instant::now();
    let hard_deadline = start + Duration::from_secs(20);
    let (mut posted, mut outstanding, mut ok, mut sends) = (0u64, 0usize, 0usize, 0usize);
    let mut ok_after_kill = 0usize;
    let mut killed_at: Option<Instant> = None;
    let mut first_err: Option<(WorkCompletion, Instant)> = None;
    let mut behind = Vec::new(); // completions after the first error
    let mut buf = [WorkCompletion::default(); 16];
    while first_err.is_none() {
        // Keep the send queue busy with WRITEs, with a SEND now and then.
        while outstanding < WINDOW {
            let send = posted % 8 == 7 && sends < SEND_RECVS;
            let wr = if send {
                sends += 1;
                SendWr::new(posted, SendOp::Send, &ssge)
            } else {
                SendWr::new(
                    posted,
                    SendOp::RdmaWrite {
                        remote_addr: mem.iova + (posted % 8) * 8 * 1024,
                        rkey: mem.rkey,
                    },
                    &wsge,
                )
            };
            if let Err(e) = qp.post_send([signaled(wr)]) {
                panic!("post_send #{posted} failed ({e:?}) with {outstanding} outstanding");
            }
            posted += 1;
            outstanding += 1;
        }
        let k = n.cq.poll(&mut buf);
        outstanding -= k;
        for wc in &buf[..k] {
            if wc.is_ok() {
                ok += 1;
                if killed_at.is_some() {
                    ok_after_kill += 1;
                }
            } else if first_err.is_none() {
                first_err = Some((*wc, Instant::now()));
            } else {
                behind.push(*wc);
            }
        }
        if killed_at.is_none() && ok >= BEFORE_KILL {
            t.kill();
            killed_at = Some(Instant::now());
        }
        assert!(
            Instant::now() < hard_deadline,
            "no error completion within {:?} of the kill ({ok} completions ok, {ok_after_kill} \
             of them after the kill, {outstanding} outstanding)",
            killed_at.map(|k| k.elapsed())
        );
        if k == 0 {
            std::thread::yield_now();
        }
    }
    let (err, err_at) = first_err.unwrap();
    let Some(killed_at) = killed_at else {
        panic!(
            "the stream failed before the target was killed, after {ok} good completions \
             ({:?} after the start): {err:?}",
            err_at - start
        );
    };
    let took = err_at.saturating_duration_since(killed_at);
    eprintln!(
        "killed target: first error {:?} {took:?} after the kill (bound {bound:?} + {SLACK:?}); \
         {ok} completions ok, {ok_after_kill} after the kill",
        err.status()
    );
    assert!(
        matches!(
            err.status(),
            WcStatus::RetryExcErr
                | WcStatus::RnrRetryExcErr
                | WcStatus::RespTimeoutErr
                | WcStatus::RemAbortErr
                | WcStatus::RemOpErr
                | WcStatus::FatalErr
                | WcStatus::GeneralErr
        ),
        "the first error is a transport error (RETRY_EXC_ERR or similar): {err:?}"
    );
    assert!(
        took <= bound + SLACK,
        "the error came {took:?} after the kill; timeout × (retries + 1) is {bound:?}"
    );

    // The rest of the send queue is flushed, the QP is in ERR, and posting still completes.
    behind.extend(poll_n(&n.cq, outstanding, "initiator: the flushed rest"));
    assert!(
        behind.iter().all(|w| w.status() == WcStatus::WrFlushErr),
        "everything behind the error is flushed: {behind:?}"
    );
    assert_eq!(qp.state(), QpState::Err);
    qp.post_send([signaled(SendWr::new(u64::MAX, SendOp::Send, &ssge))])
        .unwrap();
    assert_eq!(
        poll_n(&n.cq, 1, "initiator: post in ERR")[0].status(),
        WcStatus::WrFlushErr
    );
    drop(qp);

    // The initiator process is fine: a loopback pair still works.
    let a = n.qp(QpType::Rc);
    let b = n.qp(QpType::Rc);
    a.connect(&b.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    b.connect(&a.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    let dst = n.mr(64);
    b.post_recv([RecvWr::new(1, &[dst.sge(0..64)])]).unwrap();
    a.post_send([signaled(SendWr::inline(2, SendOp::Send, b"still alive"))])
        .unwrap();
    let wc = poll_n(&n.cq, 2, "loopback after the peer died");
    assert_all_ok(&wc, "loopback after the peer died");
    assert_eq!(&dst.to_vec()[..11], b"still alive");
}

/// One token: `what` without spaces.
fn token(what: impl std::fmt::Debug) -> String {
    format!("{what:?}").replace(char::is_whitespace, "")
}

// Takes QP number `take` (a fresh process hands out numbers in the same order as the dead
// one did), connects it to a QP of its own, posts a receive on it, and reports whether
// anything from outside reached it.
peer!(peer_qpn_taker, |p| {
    let want: u32 = p.expect("take").get(0);
    let n = node();
    let mut spare = Vec::new();
    let x = loop {
        let q = n.qp(QpType::Rc);
        if q.qp_num() == want {
            break Some(q);
        }
        if spare.len() >= 256 {
            break None;
        }
        spare.push(q);
    };
    let Some(x) = x else {
        p.send(msg!("taken", false));
        p.recv();
        return;
    };
    drop(spare);
    let y = n.qp(QpType::Rc);
    x.connect(&y.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    y.connect(&x.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    let buf = n.mr(64);
    x.post_recv([RecvWr::new(1, &[buf.sge(0..64)])]).unwrap();
    p.send(msg!("taken", true));

    p.expect("check");
    let mut wc = [WorkCompletion::default(); 4];
    let k = n.cq.poll(&mut wc);
    let verdict = |ok: bool, what: String| if ok { "ok".to_string() } else { what };
    p.send(msg!(
        "check",
        "no-completion",
        verdict(k == 0, token(&wc[..k]))
    ));
    p.send(msg!(
        "check",
        "state-rts",
        verdict(x.state() == QpState::Rts, token(x.state()))
    ));
    p.send(msg!(
        "check",
        "buffer-untouched",
        compare(&buf.to_vec(), &[0; 64])
    ));
    if k == 0 {
        // Its own connection still works.
        y.post_send([SendWr::inline(2, SendOp::Send, b"own")])
            .unwrap();
        let w = poll_n(&n.cq, 1, "QP-number taker: its own SEND")[0];
        let ok = w.is_ok() && w.src_qp() == y.qp_num() && w.byte_len() == 3;
        p.send(msg!("check", "own-connection", verdict(ok, token(w))));
    }
    p.send("checked");
});

#[test]
fn connection_to_a_dead_process_never_reaches_a_new_process_that_took_its_qp_number() {
    if crate::harness::between_hosts() {
        eprintln!(
            "skipped between hosts: QP numbers of networked devices are random, so no process can take a given one"
        );
        return;
    }
    let _alone = exclusive();
    let mut a = Peer::spawn("failure::peer_doomed_target");
    let aep: Endpoint = a.expect("target").get(0);
    let n = node();
    let qp = n.qp(QpType::Rc);
    qp.connect(&aep, 0, ALL_REMOTE).unwrap();
    set_timeout_and_retries(&qp, TIMEOUT, RETRY_CNT);
    a.send(msg!("initiator", qp.endpoint(0).unwrap()));
    a.expect("ready");
    qp.post_send([signaled(SendWr::inline(1, SendOp::Send, b"to a"))])
        .unwrap();
    assert_all_ok(
        &poll_n(&n.cq, 1, "SEND to the live target"),
        "SEND to the live target",
    );
    a.kill();

    // A process gets the number only if nobody else on the host holds it just then (another
    // test run may): try a few fresh processes.
    let mut tries = 0;
    let mut b = loop {
        let mut b = Peer::spawn("failure::peer_qpn_taker");
        b.send(msg!("take", aep.qpn));
        tries += 1;
        if b.expect("taken").get::<bool>(0) {
            break b;
        }
        b.send("bye");
        b.finish();
        assert!(
            tries < 10,
            "{tries} new processes could not get QP number {:#x} (other processes hold it?): \
             nothing was checked",
            aep.qpn
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    qp.post_send([signaled(SendWr::inline(2, SendOp::Send, b"stale"))])
        .unwrap();
    let wc = poll_n(&n.cq, 1, "SEND on the connection to the dead process")[0];
    b.send("check");
    b.expect_checks(&format!(
        "the new process's QP {:#x}, after a SEND on the old connection to that number \
         completed with {:?}",
        aep.qpn,
        wc.status()
    ));
    assert_eq!(
        wc.status(),
        WcStatus::RetryExcErr,
        "a SEND to a dead process's QP number: {wc:?}"
    );
    b.finish();
}
