//! RDMA FLUSH into another process (and, run by `between_hosts`, another host: RoCEv2's
//! FLUSH with its FETH, answered by a zero-length READ response): WRITEs, then a FLUSH of
//! their range and of the whole region, then one past the region.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;

// A 4 KiB region with the global-flush right; on `check` it compares what landed.
peer!(peer_flush_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let mr =
        n.pd.alloc_mr(4096, ALL_REMOTE | AccessFlags::FLUSH_GLOBAL)
            .expect("alloc_mr FLUSH_GLOBAL");
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mr)));
    accept_rc(p, &qp);
    p.send("ready");
    p.expect("check");
    p.send(msg!(
        "memory",
        compare(&mr.to_vec()[1024..2048], &pattern(1024, 6))
    ));
    p.expect("done");
});

#[test]
fn a_flush_into_a_peers_region_completes_after_the_writes_before_it() {
    let mut t = Peer::spawn("flush::peer_flush_target");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let src = n.mr(1024);
    src.write_at(0, &pattern(1024, 6)).unwrap();
    let s = [src.sge(0..1024)];
    let flush = |remote_addr, len, whole_region| SendOp::Flush {
        remote_addr,
        rkey: mem.rkey,
        len,
        whole_region,
        persistent: false,
    };
    let write = SendOp::RdmaWrite {
        remote_addr: mem.iova + 1024,
        rkey: mem.rkey,
    };
    qp.post_send([
        signaled(SendWr::new(1, write, &s)),
        signaled(SendWr::new(2, flush(mem.iova + 1024, 1024, false), &[])),
        signaled(SendWr::new(3, flush(0, 0, true), &[])),
        signaled(SendWr::new(4, flush(mem.iova + 4000, 200, false), &[])),
    ])
    .unwrap();
    let got: Vec<_> = poll_n(&n.cq, 4, "initiator: completions")
        .iter()
        .map(|c| (c.wr_id(), c.status(), c.opcode()))
        .collect();
    assert_eq!(
        got[..3],
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite),
            (2, WcStatus::Success, WcOpcode::Flush),
            (3, WcStatus::Success, WcOpcode::Flush),
        ]
    );
    assert_eq!(
        (got[3].0, got[3].1),
        (4, WcStatus::RemAccessErr),
        "a FLUSH past the region"
    );
    t.send("check");
    assert_eq!(t.expect("memory").get::<String>(0), "ok");
    t.send("done");
    t.finish();
}
