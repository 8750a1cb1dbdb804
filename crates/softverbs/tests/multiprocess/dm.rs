//! Device memory between processes (and, run by `between_hosts`, between hosts): a peer's
//! zero-based region in its device memory takes RDMA WRITE, READ and an atomic, and the peer
//! reads what landed through its copies.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;

const LEN: usize = 4096;

// 8 KiB of device memory, a region over its second half; on `check` it reports that half.
peer!(peer_dm_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let dm = n.ctx.alloc_dm(2 * LEN).expect("alloc_dm");
    dm.write_at(0, &pattern(2 * LEN, 4)).unwrap();
    let mr =
        n.pd.reg_dm_mr(&dm, LEN..2 * LEN, ALL_REMOTE)
            .expect("reg_dm_mr");
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mr)));
    accept_rc(p, &qp);
    p.send("ready");
    p.expect("check");
    let mut got = vec![0u8; 2 * LEN];
    dm.read_at(0, &mut got).unwrap();
    let mut want = pattern(2 * LEN, 4);
    want[LEN + 64..LEN + 128].copy_from_slice(&pattern(64, 9));
    let word = u64::from_ne_bytes(want[LEN..LEN + 8].try_into().unwrap()) + 3;
    want[LEN..LEN + 8].copy_from_slice(&word.to_ne_bytes());
    p.send(msg!("memory", compare(&got, &want)));
    p.expect("done");
    drop(mr);
});

#[test]
fn a_peers_device_memory_region_takes_write_read_and_an_atomic() {
    let mut t = Peer::spawn("dm::peer_dm_target");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    assert_eq!((mem.iova, mem.len), (0, LEN), "zero-based");
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let local = n.mr(LEN);
    local.write_at(0, &pattern(64, 9)).unwrap();
    let run = |op: SendOp, sge: Sge| {
        qp.post_send([signaled(SendWr::new(1, op, &[sge]))])
            .unwrap();
        poll_n(&n.cq, 1, "initiator")[0].status()
    };
    let write = SendOp::RdmaWrite {
        remote_addr: 64,
        rkey: mem.rkey,
    };
    assert_eq!(run(write, local.sge(0..64)), WcStatus::Success);
    let read = SendOp::RdmaRead {
        remote_addr: 128,
        rkey: mem.rkey,
    };
    assert_eq!(run(read, local.sge(1024..1088)), WcStatus::Success);
    assert_eq!(
        compare(
            &local.to_vec()[1024..1088],
            &pattern(2 * LEN, 4)[LEN + 128..LEN + 192]
        ),
        "ok",
        "READ of the peer's device memory"
    );
    let add = SendOp::FetchAdd {
        remote_addr: 0,
        rkey: mem.rkey,
        add: 3,
    };
    assert_eq!(run(add, local.sge(2048..2056)), WcStatus::Success);
    t.send("check");
    assert_eq!(t.expect("memory").get::<String>(0), "ok", "what landed");
    t.send("done");
    t.finish();
}
