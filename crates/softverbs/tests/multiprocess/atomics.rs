//! Atomics from two initiator processes on one counter in a third (target) process.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;
use std::time::Duration;

/// Successful increments per initiator.
const N: u64 = 2_000;

// Holds the counter and one QP per initiator; touches nothing during the run.
peer!(peer_counter_target, |p| {
    let n = node();
    let counter = n.mr(64);
    let q1 = n.qp(QpType::Rc);
    let q2 = n.qp(QpType::Rc);
    p.send(msg!(
        "target",
        q1.endpoint(0).unwrap(),
        q2.endpoint(0).unwrap(),
        RemoteMr::of(&counter)
    ));
    let m = p.expect("initiators");
    q1.connect(&m.get(0), 0, ALL_REMOTE).unwrap();
    q2.connect(&m.get(1), 0, ALL_REMOTE).unwrap();
    p.send("ready");
    p.expect("read");
    p.send(msg!("counter", counter.load_u64(0).unwrap()));
    assert_no_completion(&n.cq, "counter target: atomics make no target completion");
});

// Adds 1 to the counter N times, with FETCH_AND_ADD or with a CMP_AND_SWP loop.
peer!(peer_atomic_initiator, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    p.send(msg!("initiator", qp.endpoint(0).unwrap()));
    let m = p.expect("target");
    let (tep, counter, kind): (Endpoint, RemoteMr, String) = (m.get(0), m.get(1), m.get(2));
    qp.connect(&tep, 0, ALL_REMOTE).unwrap();
    p.send("connected");
    p.expect("go");
    let local = n.mr(8);
    let s = [local.sge(0..8)];
    let (mut guess, mut done, mut attempts) = (0u64, 0u64, 0u64);
    while done < N {
        let op = match kind.as_str() {
            "fetch-add" => SendOp::FetchAdd {
                remote_addr: counter.iova,
                rkey: counter.rkey,
                add: 1,
            },
            _ => SendOp::CmpSwap {
                remote_addr: counter.iova,
                rkey: counter.rkey,
                compare: guess,
                swap: guess + 1,
            },
        };
        qp.post_send([signaled(SendWr::new(attempts, op, &s))])
            .unwrap();
        let wc = poll_n(&n.cq, 1, "atomic initiator: completion")[0];
        assert!(wc.is_ok(), "{kind} #{attempts} ({done} done): {wc:?}");
        let old = local.load_u64(0).unwrap();
        attempts += 1;
        if kind == "fetch-add" || old == guess {
            done += 1;
            guess = old + 1;
        } else {
            guess = old;
        }
    }
    p.send(msg!("done", attempts));
});

#[test]
fn fetch_add_and_cmp_swap_from_two_initiator_processes_on_a_counter_in_a_third_end_exact() {
    let mut target = Peer::spawn("atomics::peer_counter_target");
    let mut fadd = Peer::spawn("atomics::peer_atomic_initiator");
    let mut cas = Peer::spawn("atomics::peer_atomic_initiator");
    let m = target.expect("target");
    let (t1, t2, counter): (Endpoint, Endpoint, RemoteMr) = (m.get(0), m.get(1), m.get(2));
    let e1: Endpoint = fadd.expect("initiator").get(0);
    let e2: Endpoint = cas.expect("initiator").get(0);
    target.send(msg!("initiators", e1, e2));
    target.expect("ready");
    fadd.send(msg!("target", t1, counter, "fetch-add"));
    cas.send(msg!("target", t2, counter, "cmp-swap"));
    fadd.expect("connected");
    cas.expect("connected");
    fadd.send("go");
    cas.send("go");
    let long = Duration::from_secs(60);
    let fadd_attempts: u64 = fadd.expect_within("done", long).get(0);
    let cas_attempts: u64 = cas.expect_within("done", long).get(0);
    assert_eq!(fadd_attempts, N);
    target.send("read");
    assert_eq!(
        target.expect("counter").get::<u64>(0),
        2 * N,
        "every increment counted once ({cas_attempts} CMP_AND_SWP attempts for {N} increments)"
    );
    target.finish();
    fadd.finish();
    cas.finish();
}

// A word in shared memory for ATOMIC WRITE; reports its value on `read`.
peer!(peer_atomic_write_target, |p| {
    let n = node();
    let word = n.mr(64);
    let qp = n.qp(QpType::Rc);
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&word)));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.connect(&them, 0, ALL_REMOTE).unwrap();
    p.send("ready");
    p.expect("read");
    p.send(msg!("word", word.load_u64(8).unwrap()));
});

/// RDMA ATOMIC WRITE into another process's memory stores the word (completion
/// `AtomicWrite`); between hosts it travels as RoCEv2's ATOMIC WRITE, answered by a
/// zero-length READ response. The device advertises it.
#[test]
fn atomic_write_into_another_process_stores_the_word() {
    let mut t = Peer::spawn("atomics::peer_atomic_write_target");
    let m = t.expect("target");
    let (tep, word): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let op = SendOp::AtomicWrite {
        remote_addr: word.iova + 8,
        rkey: word.rkey,
        value: 0x5eed_0000_0000_0001,
    };
    qp.post_send([signaled(SendWr::new(1, op, &[]))]).unwrap();
    let wc = poll_n(&n.cq, 1, "ATOMIC WRITE completion")[0];
    assert_eq!(
        (wc.status(), wc.opcode()),
        (WcStatus::Success, WcOpcode::AtomicWrite)
    );
    let caps = n.ctx.query_device().device_cap_flags_ex;
    assert_ne!(caps & cap_flags_ex::ATOMIC_WRITE, 0, "advertised");
    t.send("read");
    assert_eq!(t.expect("word").get::<u64>(0), 0x5eed_0000_0000_0001);
    t.finish();
}
