//! Remote access errors between processes: a wrong rkey or an address outside the region
//! fails on the initiator with REM_ACCESS_ERR and leaves the target's memory untouched.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;
use std::time::{Duration, Instant};

const FILL: u8 = 0x5a;

// A 64-byte region filled with FILL, and a posted receive. On `check` it reports whether the
// region is untouched; on `responder` it reports how its QP took the error.
peer!(peer_access_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let mem = n.mr(64);
    mem.fill(FILL);
    let rbuf = n.mr(64);
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mem)));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.post_recv([RecvWr::new(50, &[rbuf.sge(0..64)])]).unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");

    let what = p.recv();
    p.send(msg!("memory", compare(&mem.to_vec(), &[FILL; 64])));
    if what.tag() == "responder" {
        // The responder side of an access error: its QP goes to ERR with QP_ACCESS_ERR, and
        // its posted receive is flushed.
        let deadline = Instant::now() + Duration::from_secs(2);
        while qp.state() != QpState::Err && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let ev = loop {
            match n.ctx.try_get_async_event() {
                Ok(ev) => break format!("{:?}/{:?}", ev.kind, ev.element),
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                Err(_) => break "none".into(),
            }
        };
        let mut wc = [WorkCompletion::default()];
        let flushed = match n.cq.poll(&mut wc) {
            1 => format!("{}/{:?}", wc[0].wr_id(), wc[0].status()),
            _ => "none".into(),
        };
        p.send(msg!(
            "responder",
            format!("{:?}", qp.state()),
            ev.replace(' ', ""),
            flushed,
            qp.qp_num()
        ));
    }
});

/// A good READ of the whole target region first, so that an error later cannot come from
/// reaching the wrong QP (or none).
fn probe(n: &Node, qp: &QueuePair, mem: &RemoteMr, local: &MemoryRegion<'_>) {
    let s = [local.sge(0..64)];
    qp.post_send([signaled(SendWr::new(
        100,
        SendOp::RdmaRead {
            remote_addr: mem.iova,
            rkey: mem.rkey,
        },
        &s,
    ))])
    .unwrap();
    let wc = poll_n(&n.cq, 1, "initiator: a good READ of the target region")[0];
    assert_eq!(
        wc.status(),
        WcStatus::Success,
        "a good READ of the target region, before the bad request: {wc:?}"
    );
    assert_eq!(compare(&local.to_vec(), &[FILL; 64]), "ok", "the good READ");
}

/// Runs `bad` (built from the target's region) and two good WRITEs behind it against a target
/// process; checks the initiator's completions, then that the target memory is untouched.
fn bad_remote_op(make: impl Fn(&RemoteMr) -> SendOp) {
    let mut t = Peer::spawn("access::peer_access_target");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");

    let local = n.mr(64);
    probe(&n, &qp, &mem, &local);
    local.fill(0x11);
    let s8 = [local.sge(0..8)];
    let good = [local.sge(0..16)];
    let write = SendOp::RdmaWrite {
        remote_addr: mem.iova,
        rkey: mem.rkey,
    };
    let bad = make(&mem);
    qp.post_send([
        signaled(SendWr::new(1, bad, &s8)),
        SendWr::new(2, write, &good),
        signaled(SendWr::new(3, write, &good)),
    ])
    .unwrap();
    let wc = poll_n(&n.cq, 3, "initiator: completions");
    let got: Vec<_> = wc.iter().map(|w| (w.wr_id(), w.status())).collect();
    assert_eq!(
        got,
        vec![
            (1, WcStatus::RemAccessErr),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr)
        ],
        "initiator: {bad:?} fails with REM_ACCESS_ERR and flushes what follows: {wc:?}"
    );
    assert_eq!(qp.state(), QpState::Err, "the initiator's QP is in ERR");
    t.send("check");
    assert_eq!(
        t.expect("memory").get::<String>(0),
        "ok",
        "target memory after {bad:?} (filled with {FILL:#x} before)"
    );
    t.finish();
}

#[test]
fn write_with_a_wrong_rkey_is_rem_access_err_and_leaves_target_memory_untouched() {
    bad_remote_op(|r| SendOp::RdmaWrite {
        remote_addr: r.iova,
        rkey: r.rkey ^ 0x100,
    });
}

#[test]
fn write_past_the_end_of_the_region_is_rem_access_err_and_leaves_target_memory_untouched() {
    // Straddles the end: the 4 bytes inside must not be written either.
    bad_remote_op(|r| SendOp::RdmaWrite {
        remote_addr: r.iova + r.len as u64 - 4,
        rkey: r.rkey,
    });
}

#[test]
fn read_with_a_wrong_rkey_is_rem_access_err_and_leaves_target_memory_untouched() {
    bad_remote_op(|r| SendOp::RdmaRead {
        remote_addr: r.iova,
        rkey: r.rkey ^ 0x100,
    });
}

#[test]
fn read_before_the_start_of_the_region_is_rem_access_err_and_leaves_target_memory_untouched() {
    bad_remote_op(|r| SendOp::RdmaRead {
        remote_addr: r.iova - 8,
        rkey: r.rkey,
    });
}

#[test]
fn atomic_past_the_end_of_the_region_is_rem_access_err_and_leaves_target_memory_untouched() {
    bad_remote_op(|r| SendOp::FetchAdd {
        remote_addr: r.iova + r.len as u64,
        rkey: r.rkey,
        add: 1,
    });
}

#[test]
fn responder_qp_in_the_target_process_goes_to_err_with_an_access_event_and_flushes_its_receive() {
    let mut t = Peer::spawn("access::peer_access_target");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let local = n.mr(64);
    probe(&n, &qp, &mem, &local);
    let s = [local.sge(0..8)];
    qp.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: mem.iova,
            rkey: mem.rkey ^ 0x100,
        },
        &s,
    ))])
    .unwrap();
    let wc = poll_n(&n.cq, 1, "initiator: completion")[0];
    assert_eq!(wc.status(), WcStatus::RemAccessErr, "{wc:?}");
    t.send("responder");
    assert_eq!(t.expect("memory").get::<String>(0), "ok", "target memory");
    let r = t.expect("responder");
    let target_qpn: u32 = r.get(3);
    assert_eq!(
        (r.get::<String>(0), r.get::<String>(1), r.get::<String>(2)),
        (
            "Err".to_string(),
            format!("QpAccessErr/Qp({target_qpn})"),
            "50/WrFlushErr".to_string()
        ),
        "target QP (state, async event, flushed receive) after the initiator's access error"
    );
    t.finish();
}

// Streams 64-byte WRITEs of a nonzero pattern into the parent's region, one in eight
// signaled, until one fails; reports how many signaled batches succeeded and the status of
// the first failure.
peer!(peer_writer_until_refused, |p| {
    let n = node();
    let m = p.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let qp = n.qp(QpType::Rc);
    qp.connect(&tep, 0, ALL_REMOTE).unwrap();
    p.send(msg!("initiator", qp.endpoint(0).unwrap()));
    p.expect("ready");
    let src = n.mr(64);
    src.fill(0xc3);
    let s = [src.sge(0..64)];
    let write = SendOp::RdmaWrite {
        remote_addr: mem.iova,
        rkey: mem.rkey,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut ok, mut failed) = (0u64, None);
    let mut wcs = [WorkCompletion::default(); 8];
    while failed.is_none() && Instant::now() < deadline {
        let wrs: Vec<_> = (0..8)
            .map(|i| {
                let wr = SendWr::new(i, write, &s);
                if i == 7 { signaled(wr) } else { wr }
            })
            .collect();
        qp.post_send(wrs).unwrap();
        for wc in poll_n(&n.cq, 1, "writer: a signaled WRITE") {
            match wc.status() {
                WcStatus::Success => ok += 8,
                st => failed = Some(st),
            }
        }
        // Flushed ones, if any, after the failure.
        while n.cq.poll(&mut wcs) > 0 {}
    }
    p.send(msg!("stopped", ok, format!("{failed:?}")));
});

/// A region another process is writing into is deregistered: from the moment `ibv_dereg_mr`
/// returns, no byte of it changes, and the writer's next WRITE fails with REM_ACCESS_ERR.
/// (The writer pins the parent's key through its hazard record, see `mr::hazard`: the
/// deregistration must wait out the copy in flight.)
#[test]
fn a_region_deregistered_under_another_process_writes_is_never_written_after() {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let mut buf = vec![0u8; 4096];
    let mr = n.pd.reg_mr(&mut buf, ALL_REMOTE).unwrap();
    let mut w = Peer::spawn("access::peer_writer_until_refused");
    w.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mr)));
    let them: Endpoint = w.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    w.send("ready");
    // Writes are landing.
    assert!(
        spin_until(Duration::from_secs(10), || mr.to_vec()[..64] == [0xc3; 64]),
        "the writer's WRITEs never arrived"
    );
    drop(mr);
    let after = buf.clone();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        compare(&buf, &after),
        "ok",
        "bytes written after deregistration"
    );
    let m = w.expect("stopped");
    assert_eq!(
        m.get::<String>(1),
        "Some(RemAccessErr)",
        "the writer's first failure"
    );
    w.finish();
}
