//! Device memory through the Rust API: copies, zero-based regions that RDMA WRITE, READ and
//! atomics reach, the limit, and a free refused while a region lies in it.

use crate::common::*;
use softverbs::*;

#[test]
fn rdma_reaches_device_memory_through_a_zero_based_region() {
    let p = pair(QpType::Rc);
    let dm = p.ctx.alloc_dm(8192).unwrap();
    assert_eq!(dm.len(), 8192);
    dm.write_at(0, &pattern(8192, 1)).unwrap();
    let mr = p.pd.reg_dm_mr(&dm, 4096..8192, ALL_REMOTE).unwrap();
    assert_eq!((mr.iova(), mr.len()), (0, 4096), "zero-based");
    let src = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    src.write_at(0, &[0x5a; 64]).unwrap();
    let op = |wr_id, op, sge: &[Sge]| {
        p.a.post_send([signaled(SendWr::new(wr_id, op, sge))])
            .unwrap();
        poll_n(&p.cq_a, 1)[0].status()
    };
    // WRITE 64 bytes at IOVA 100: device memory offset 4196.
    let s = [src.sge(0..64)];
    let w = SendOp::RdmaWrite {
        remote_addr: 100,
        rkey: mr.rkey(),
    };
    assert_eq!(op(1, w, &s), WcStatus::Success);
    let mut got = vec![0u8; 8192];
    dm.read_at(0, &mut got).unwrap();
    let mut want = pattern(8192, 1);
    want[4196..4260].fill(0x5a);
    assert_eq!(got, want);
    // READ back the first 64 bytes of the region (offset 4096 of the memory).
    let dst = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let r = SendOp::RdmaRead {
        remote_addr: 0,
        rkey: mr.rkey(),
    };
    assert_eq!(op(2, r, &[dst.sge(0..64)]), WcStatus::Success);
    assert_eq!(dst.to_vec(), &pattern(8192, 1)[4096..4160]);
    // An atomic on an aligned word.
    dm.write_at(4096 + 8, &7u64.to_ne_bytes()).unwrap();
    let f = SendOp::FetchAdd {
        remote_addr: 8,
        rkey: mr.rkey(),
        add: 5,
    };
    assert_eq!(op(3, f, &[dst.sge(0..8)]), WcStatus::Success);
    let mut word = [0u8; 8];
    dm.read_at(4096 + 8, &mut word).unwrap();
    assert_eq!(u64::from_ne_bytes(word), 12);
    // Past the region: a remote access error.
    let past = SendOp::RdmaWrite {
        remote_addr: 4090,
        rkey: mr.rkey(),
    };
    assert_eq!(op(4, past, &s), WcStatus::RemAccessErr);
}

#[test]
fn device_memory_refuses_what_the_man_pages_refuse() {
    let ctx = ctx();
    let max = ctx.query_device().max_dm_size as usize;
    assert!(max > 0);
    assert!(matches!(ctx.alloc_dm(0), Err(Error::InvalidArgument(_))));
    assert!(matches!(ctx.alloc_dm(max + 1), Err(Error::NoResources(_))));
    let dm = ctx.alloc_dm(4096).unwrap();
    let mut b = [0u8; 8];
    assert!(matches!(
        dm.read_at(4090, &mut b),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        dm.write_at(4096, &[1]),
        Err(Error::InvalidArgument(_))
    ));
    let pd = ctx.alloc_pd().unwrap();
    assert!(matches!(
        pd.reg_dm_mr(&dm, 0..0, AccessFlags::LOCAL_WRITE),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        pd.reg_dm_mr(&dm, 4000..5000, AccessFlags::LOCAL_WRITE),
        Err(Error::InvalidArgument(_))
    ));
    let mr = pd
        .reg_dm_mr(&dm, 0..4096, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let (dm, e) = dm.free().unwrap_err();
    assert!(matches!(e, Error::Busy(_)), "{e}");
    drop(mr);
    assert!(dm.free().is_ok());
}
