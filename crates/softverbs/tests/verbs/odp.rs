//! On-demand paging through the Rust API: regions over memory that is not mapped yet (or no
//! longer), explicit and implicit, and the caps that say so.

use crate::common::*;
use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous, munmap};
use softverbs::*;

const ODP: AccessFlags = ALL_REMOTE.union(AccessFlags::ON_DEMAND);
const BIG: usize = 1 << 20;

/// `len` bytes of fresh anonymous memory, never touched.
fn fresh(len: usize) -> *mut u8 {
    // SAFETY: a new private anonymous mapping at an address of the kernel's choosing.
    unsafe {
        mmap_anonymous(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }
    .expect("mmap") as *mut u8
}

fn write(p: &Pair, src: &MemoryRegion<'_>, len: usize, remote_addr: u64, rkey: u32) -> WcStatus {
    let sge = [src.sge(0..len)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite { remote_addr, rkey },
        &sge,
    ))])
    .unwrap();
    poll_n(&p.cq_a, 1)[0].status()
}

#[test]
fn the_device_offers_explicit_and_implicit_odp_for_rc_operations_but_atomics() {
    let caps = ctx().query_device().odp_caps;
    assert_eq!(caps.general_caps & 3, 3, "ODP and implicit ODP: {caps:?}");
    assert_eq!(
        caps.rc_odp_caps & 0xf,
        0xf,
        "SEND RECV WRITE READ: {caps:?}"
    );
    assert_eq!(
        caps.rc_odp_caps & 0x10,
        0,
        "no ATOMIC across processes: {caps:?}"
    );
}

#[test]
fn rdma_lands_in_memory_never_touched_and_an_unmapped_page_is_a_remote_access_error() {
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    let data = pattern(4096, 3);
    src.write_at(0, &data).unwrap();
    let at = fresh(BIG);
    // SAFETY: the mapping outlives the region (unmapped only after it is dropped, below),
    // and no Rust reference to it exists while the NIC writes.
    let mr = unsafe { p.pd.reg_mr_raw(at, BIG, at as u64, ODP) }.unwrap();
    let mid = at as u64 + (BIG / 2) as u64;
    assert_eq!(write(&p, &src, 4096, mid, mr.rkey()), WcStatus::Success);
    // SAFETY: 4096 bytes inside the mapping, written by the completed WRITE.
    let landed = unsafe { std::slice::from_raw_parts(at.add(BIG / 2), 4096) };
    assert_eq!(landed, &data[..]);
    // The last 16 pages go away while registered.
    let tail = BIG - 16 * 4096;
    // SAFETY: the tail of our own mapping; nothing refers to it.
    unsafe { munmap(at.add(tail) as *mut _, BIG - tail) }.unwrap();
    let gone = at as u64 + tail as u64 + 8 * 4096;
    assert_eq!(write(&p, &src, 64, gone, mr.rkey()), WcStatus::RemAccessErr);
    drop(mr);
    // SAFETY: the rest of the mapping, no longer registered.
    unsafe { munmap(at as *mut _, tail) }.unwrap();
}

#[test]
fn an_implicit_region_reaches_any_address_and_refuses_unmapped_ones() {
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    src.write_at(0, &pattern(4096, 9)).unwrap();
    // SAFETY: an implicit region touches memory only through cross-memory attach, and the
    // only memory written below is `target`, which no reference aliases meanwhile.
    let all = unsafe { p.pd.reg_mr_raw(std::ptr::null_mut(), usize::MAX, 0, ODP) }.unwrap();
    let target = Box::into_raw(vec![0u8; 8192].into_boxed_slice()) as *mut u8;
    let addr = target as u64 + 100;
    assert_eq!(write(&p, &src, 4096, addr, all.rkey()), WcStatus::Success);
    // SAFETY: `target` is ours again (the WRITE completed); rebuilt once to free it.
    let back = unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(target, 8192)) };
    assert_eq!(&back[100..4196], &pattern(4096, 9)[..]);
    assert!(back[..100].iter().chain(&back[4196..]).all(|&b| b == 0));
    assert_eq!(
        write(&p, &src, 64, 0x1000, all.rkey()),
        WcStatus::RemAccessErr
    );
}

/// `advise_mr` prefetches an on-demand region's pages, and refuses a plain region and
/// memory that is not mapped.
#[test]
fn advise_mr_prefetches_on_demand_pages_only() {
    let p = pair(QpType::Rc);
    let at = fresh(BIG);
    // SAFETY: the mapping outlives the region; nothing else refers to it.
    let mr = unsafe { p.pd.reg_mr_raw(at, BIG, at as u64, ODP) }.unwrap();
    let all = Sge {
        addr: at as u64,
        length: BIG as u32,
        lkey: mr.lkey(),
    };
    p.pd.advise_mr(Prefetch::Write, &[all]).unwrap();
    p.pd.advise_mr(Prefetch::Read, &[all]).unwrap();
    let plain = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let e =
        p.pd.advise_mr(Prefetch::Read, &[plain.sge(0..64)])
            .unwrap_err();
    assert_eq!(e.errno(), 22, "{e}");
    // SAFETY: the last page of our own mapping; the region may lose pages.
    unsafe { munmap(at.add(BIG - 4096) as *mut _, 4096) }.unwrap();
    let gone = Sge {
        addr: at as u64 + (BIG - 4096) as u64,
        length: 4096,
        lkey: mr.lkey(),
    };
    let e = p.pd.advise_mr(Prefetch::Write, &[gone]).unwrap_err();
    assert_eq!(e.errno(), 14, "{e}");
    drop(mr);
    // SAFETY: the rest of the mapping, no longer registered.
    unsafe { munmap(at as *mut _, BIG - 4096) }.unwrap();
}
