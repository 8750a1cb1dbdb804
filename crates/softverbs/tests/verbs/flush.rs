//! RDMA FLUSH through the Rust API: the cap, global placement of a range and of a whole
//! region after WRITEs, and the errors (no flush right, persistent placement, UC).

use crate::common::*;
use softverbs::*;

const FLUSHABLE: AccessFlags = ALL_REMOTE.union(AccessFlags::FLUSH_GLOBAL);

fn flush(remote_addr: u64, rkey: u32, len: u32, whole_region: bool) -> SendOp {
    SendOp::Flush {
        remote_addr,
        rkey,
        len,
        whole_region,
        persistent: false,
    }
}

#[test]
fn the_device_offers_global_flush_only() {
    let ctx = ctx();
    let x = ctx.query_device().device_cap_flags_ex;
    assert_ne!(x & cap_flags_ex::FLUSH_GLOBAL, 0);
    assert_eq!(
        x & (1 << 39),
        0,
        "no persistent flush: no persistent memory"
    );
    let pd = ctx.alloc_pd().unwrap();
    assert!(matches!(
        pd.alloc_mr(64, ALL_REMOTE | AccessFlags::FLUSH_PERSISTENT),
        Err(Error::Unsupported(_))
    ));
}

#[test]
fn a_flush_completes_after_the_writes_before_it_for_a_range_and_a_whole_region() {
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(256, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(4096, FLUSHABLE).unwrap();
    src.write_at(0, &pattern(256, 2)).unwrap();
    let s = [src.sge(0..256)];
    let write = SendOp::RdmaWrite {
        remote_addr: dst.iova() + 512,
        rkey: dst.rkey(),
    };
    p.a.post_send([
        signaled(SendWr::new(1, write, &s)),
        signaled(SendWr::new(
            2,
            flush(dst.iova() + 512, dst.rkey(), 256, false),
            &[],
        )),
        signaled(SendWr::new(3, flush(0, dst.rkey(), 0, true), &[])),
    ])
    .unwrap();
    let wcs = poll_n(&p.cq_a, 3);
    let got: Vec<_> = wcs
        .iter()
        .map(|c| (c.wr_id(), c.status(), c.opcode()))
        .collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite),
            (2, WcStatus::Success, WcOpcode::Flush),
            (3, WcStatus::Success, WcOpcode::Flush),
        ]
    );
    assert_eq!(&dst.to_vec()[512..768], &pattern(256, 2)[..]);
}

#[test]
fn flush_errors_have_their_statuses() {
    // A region without FLUSH_GLOBAL, and a range past the region: remote access errors.
    for (access, at, len) in [(ALL_REMOTE, 0, 8), (FLUSHABLE, 4090, 8)] {
        let p = pair(QpType::Rc);
        let dst = p.pd.alloc_mr(4096, access).unwrap();
        let op = flush(dst.iova() + at, dst.rkey(), len, false);
        p.a.post_send([signaled(SendWr::new(1, op, &[]))]).unwrap();
        assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::RemAccessErr);
    }
    // Persistent placement, data, or UC: refused at post.
    let p = pair(QpType::Rc);
    let persistent = SendOp::Flush {
        remote_addr: 0,
        rkey: 1,
        len: 0,
        whole_region: true,
        persistent: true,
    };
    let e =
        p.a.post_send([SendWr::new(1, persistent, &[])])
            .unwrap_err();
    assert!(matches!(e.error, Error::Unsupported(_)), "{e:?}");
    let src = p.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    let s = [src.sge(0..8)];
    let e =
        p.a.post_send([SendWr::new(1, flush(0, 1, 8, false), &s)])
            .unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument(_)), "{e:?}");
    let u = pair(QpType::Uc);
    let e =
        u.a.post_send([SendWr::new(1, flush(0, 1, 8, false), &[])])
            .unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument(_)), "{e:?}");
}
