//! On-demand paging between processes (and, run by `between_hosts`, between hosts): RDMA
//! into a peer's on-demand region lands in pages it never touched, a READ of untouched pages
//! reads zeros, and a page the peer unmapped after registering is REM_ACCESS_ERR.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous, munmap};
use softverbs::*;

const BIG: usize = 1 << 20;
const PAGE: usize = 4096;
/// Pages at the end of the region the target unmaps after registering it.
const GONE: usize = 16;

// A 1 MiB on-demand region over fresh memory whose last GONE pages are unmapped once it is
// registered. On `check` it compares the half-way 4 KiB with the initiator's pattern.
peer!(peer_odp_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    // SAFETY: a new private anonymous mapping at an address of the kernel's choosing.
    let at = unsafe {
        mmap_anonymous(
            std::ptr::null_mut(),
            BIG,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }
    .expect("mmap") as *mut u8;
    let access = ALL_REMOTE | AccessFlags::ON_DEMAND;
    // SAFETY: the mapping lives until the process ends (the tail is unmapped on purpose, an
    // on-demand region may lose pages); no Rust reference to it exists while the NIC writes.
    let mr = unsafe { n.pd.reg_mr_raw(at, BIG, at as u64, access) }.expect("reg_mr ON_DEMAND");
    let tail = BIG - GONE * PAGE;
    // SAFETY: the tail of our own mapping, referred to by nothing but the region.
    unsafe { munmap(at.add(tail) as *mut _, GONE * PAGE) }.expect("munmap");
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mr)));
    accept_rc(p, &qp);
    p.send("ready");
    p.expect("check");
    // SAFETY: 4 KiB of the mapped part, written by the initiator's completed WRITE.
    let got = unsafe { std::slice::from_raw_parts(at.add(BIG / 2), PAGE) };
    p.send(msg!("memory", compare(got, &pattern(PAGE, 5))));
    p.expect("done");
    drop(mr);
});

fn op(n: &Node, qp: &QueuePair, op: SendOp, local: &MemoryRegion<'_>) -> WcStatus {
    let s = [local.sge(0..PAGE)];
    qp.post_send([signaled(SendWr::new(1, op, &s))]).unwrap();
    poll_n(&n.cq, 1, "initiator: completion")[0].status()
}

#[test]
fn rdma_into_a_peers_on_demand_region_faults_its_pages_in_and_an_unmapped_page_is_rem_access_err() {
    let mut t = Peer::spawn("odp::peer_odp_target");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let local = n.mr(PAGE);
    local.write_at(0, &pattern(PAGE, 5)).unwrap();
    let write = |remote_addr: u64| SendOp::RdmaWrite {
        remote_addr,
        rkey: mem.rkey,
    };
    let half = mem.iova + (BIG / 2) as u64;
    assert_eq!(
        op(&n, &qp, write(half), &local),
        WcStatus::Success,
        "WRITE into untouched pages"
    );
    let zeros = n.mr(PAGE);
    zeros.fill(0xee);
    let read = SendOp::RdmaRead {
        remote_addr: mem.iova + 3 * PAGE as u64,
        rkey: mem.rkey,
    };
    assert_eq!(
        op(&n, &qp, read, &zeros),
        WcStatus::Success,
        "READ of untouched pages"
    );
    assert_eq!(
        compare(&zeros.to_vec(), &[0; PAGE]),
        "ok",
        "untouched pages read as zeros"
    );
    t.send("check");
    assert_eq!(
        t.expect("memory").get::<String>(0),
        "ok",
        "the WRITE landed in the target"
    );
    let gone = mem.iova + (BIG - GONE * PAGE / 2) as u64;
    assert_eq!(
        op(&n, &qp, write(gone), &local),
        WcStatus::RemAccessErr,
        "WRITE into a page the target unmapped after registering it"
    );
    t.send("done");
    t.finish();
}
