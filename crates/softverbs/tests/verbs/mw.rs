//! Memory windows through the Rust API: type 1 and type 2, bind, local and remote
//! invalidation, and the rules whose breach is an error completion.

use crate::common::*;
use softverbs::*;

const WINDOW_RIGHTS: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ);
/// A region peers reach only through windows: no remote rights of its own.
const BINDABLE: AccessFlags = AccessFlags::LOCAL_WRITE.union(AccessFlags::MW_BIND);

/// Two connected RC QPs in `pd`, each with its own CQ.
struct Link {
    cq_a: CompletionQueue,
    cq_b: CompletionQueue,
    a: QueuePair,
    b: QueuePair,
}

fn link(ctx: &Context, pd: &ProtectionDomain) -> Link {
    let cq_a = ctx.create_cq(64, None).unwrap();
    let cq_b = ctx.create_cq(64, None).unwrap();
    let a = pd.create_qp(&QpInitAttr::rc(&cq_a, &cq_a)).unwrap();
    let b = pd.create_qp(&QpInitAttr::rc(&cq_b, &cq_b)).unwrap();
    a.connect(&b.endpoint(1).unwrap(), 2, ALL_REMOTE).unwrap();
    b.connect(&a.endpoint(2).unwrap(), 1, ALL_REMOTE).unwrap();
    Link { cq_a, cq_b, a, b }
}

/// Posts `op` (signaled, no data) on `qp` and returns its completion status.
fn run(qp: &QueuePair, cq: &CompletionQueue, op: SendOp) -> WcStatus {
    qp.post_send([signaled(SendWr::new(7, op, &[]))]).unwrap();
    let wc = poll_n(cq, 1)[0];
    assert_eq!(wc.wr_id(), 7);
    wc.status()
}

fn write(l: &Link, src: &MemoryRegion<'_>, len: usize, remote_addr: u64, rkey: u32) -> WcStatus {
    let sge = [src.sge(0..len)];
    let op = SendOp::RdmaWrite { remote_addr, rkey };
    l.a.post_send([signaled(SendWr::new(1, op, &sge))]).unwrap();
    poll_n(&l.cq_a, 1)[0].status()
}

#[test]
fn the_device_offers_type_1_and_type_2b_windows() {
    let attr = ctx().query_device();
    let want = cap_flags::MEM_WINDOW | cap_flags::MEM_WINDOW_TYPE_2B;
    assert_eq!(attr.device_cap_flags & want, want, "{attr:?}");
    assert_eq!(attr.max_mw, attr.max_mr, "windows share the key table");
}

#[test]
fn a_type2_window_over_part_of_a_region_is_the_only_rkey_that_reaches_that_part() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let l = link(&ctx, &pd);
    let other = link(&ctx, &pd);
    let dst = pd.alloc_mr(4096, BINDABLE).unwrap();
    let src = pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    src.write_at(0, &pattern(4096, 9)).unwrap();
    let mw = pd.alloc_mw(MwType::Type2).unwrap();
    let before = mw.rkey();
    // Bound by the responder QP b: requests arriving at b may use it.
    let bind = mw.bind(&dst, 1024..2048, WINDOW_RIGHTS);
    assert_eq!(run(&l.b, &l.cq_b, bind), WcStatus::Success);
    let rkey = mw.rkey();
    assert_eq!(rkey, inc_rkey(before));
    assert_ne!(rkey, dst.rkey());

    let base = dst.iova() + 1024;
    assert_eq!(write(&l, &src, 1024, base, rkey), WcStatus::Success);
    let mut got = vec![0u8; 4096];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got[1024..2048], &pattern(4096, 9)[..1024]);
    assert!(got[..1024].iter().chain(&got[2048..]).all(|&b| b == 0));

    // One byte before the window, one past it, and the region's own rkey: all refused.
    for (addr, key, len) in [
        (base - 1, rkey, 8),
        (base + 1024 - 4, rkey, 8),
        (dst.iova(), dst.rkey(), 8),
    ] {
        let l = link(&ctx, &pd);
        assert_eq!(write(&l, &src, len, addr, key), WcStatus::RemAccessErr);
    }
    // Through a QP of the same PD that did not bind it: refused too (type 2B).
    let sge = [src.sge(0..8)];
    let op = SendOp::RdmaWrite {
        remote_addr: base,
        rkey,
    };
    other
        .a
        .post_send([signaled(SendWr::new(1, op, &sge))])
        .unwrap();
    assert_eq!(poll_n(&other.cq_a, 1)[0].status(), WcStatus::RemAccessErr);
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(
        &got[1024..2048],
        &pattern(4096, 9)[..1024],
        "nothing refused landed"
    );
    assert!(got[..1024].iter().chain(&got[2048..]).all(|&b| b == 0));
}

#[test]
fn remote_invalidation_revokes_the_window_at_its_exact_point_in_the_stream() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let l = link(&ctx, &pd);
    let dst = pd.alloc_mr(4096, BINDABLE).unwrap();
    let src = pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    src.fill(0xab);
    let recv = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    l.b.post_recv([RecvWr::new(50, &[recv.sge(0..64)])])
        .unwrap();
    let mw = pd.alloc_mw(MwType::Type2).unwrap();
    let bind = mw.bind(&dst, 0..4096, WINDOW_RIGHTS);
    assert_eq!(run(&l.b, &l.cq_b, bind), WcStatus::Success);
    let rkey = mw.rkey();
    // WRITE, SEND with Invalidate, WRITE: posted together, so only their order separates
    // them.
    let (first, second) = ([src.sge(0..16)], [src.sge(16..32)]);
    let msg = [src.sge(0..4)];
    let w = |sge, at| {
        let op = SendOp::RdmaWrite {
            remote_addr: dst.iova() + at,
            rkey,
        };
        signaled(SendWr::new(at, op, sge))
    };
    l.a.post_send([
        w(&first, 0),
        signaled(SendWr::new(100, SendOp::SendWithInv { rkey }, &msg)),
        w(&second, 16),
    ])
    .unwrap();
    let wcs = poll_n(&l.cq_a, 3);
    let statuses: Vec<_> = wcs.iter().map(|c| (c.wr_id(), c.status())).collect();
    assert_eq!(
        statuses,
        [
            (0, WcStatus::Success),
            (100, WcStatus::Success),
            (16, WcStatus::RemAccessErr)
        ]
    );
    let r = poll_n(&l.cq_b, 1)[0];
    assert_eq!((r.wr_id(), r.status()), (50, WcStatus::Success));
    assert!(r.wc_flags().contains(WcFlags::WITH_INV));
    assert_eq!(r.invalidated_rkey(), Some(rkey));
    assert_eq!(r.imm_data(), None);
    let got = dst.to_vec();
    assert!(
        got[..16].iter().all(|&b| b == 0xab),
        "the first WRITE landed"
    );
    assert!(got[16..32].iter().all(|&b| b == 0), "the one after did not");
    // Invalidated, the region is free to go.
    assert!(dst.dereg().is_ok());
}

#[test]
fn a_bind_by_a_qp_of_another_pd_fails_with_mw_bind_err() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let other_pd = ctx.alloc_pd().unwrap();
    let theirs = link(&ctx, &other_pd);
    let mr = pd.alloc_mr(4096, BINDABLE).unwrap();
    let mw = pd.alloc_mw(MwType::Type2).unwrap();
    let bind = mw.bind(&mr, 0..64, WINDOW_RIGHTS);
    assert_eq!(run(&theirs.a, &theirs.cq_a, bind), WcStatus::MwBindErr);
    assert_eq!(
        theirs.a.state(),
        QpState::Err,
        "a failed bind moves the QP to ERR"
    );
    // The region was never bound, so it deregisters.
    assert!(mr.dereg().is_ok());
}

#[test]
fn binds_that_break_the_rules_complete_with_mw_bind_err() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let no_bind = pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    let read_only = pd.alloc_mr(4096, AccessFlags::MW_BIND).unwrap();
    let mr = pd.alloc_mr(4096, BINDABLE).unwrap();
    let bound = pd.alloc_mw(MwType::Type2).unwrap();
    let l = link(&ctx, &pd);
    assert_eq!(
        run(&l.a, &l.cq_a, bound.bind(&mr, 0..64, WINDOW_RIGHTS)),
        WcStatus::Success
    );
    type Bind<'a> = Box<dyn Fn(&MemoryWindow) -> SendOp + 'a>;
    let cases: Vec<(&str, Bind<'_>)> = vec![
        (
            "region without MW_BIND",
            Box::new(|w| w.bind(&no_bind, 0..64, WINDOW_RIGHTS)),
        ),
        (
            "writable window over a region without LOCAL_WRITE",
            Box::new(|w| w.bind(&read_only, 0..64, AccessFlags::REMOTE_WRITE)),
        ),
        (
            "range past the region",
            Box::new(|w| w.bind(&mr, 4000..4100, WINDOW_RIGHTS)),
        ),
        (
            "zero-length bind of a type-2 window",
            Box::new(|w| w.bind(&mr, 0..0, WINDOW_RIGHTS)),
        ),
        (
            "zero-based window",
            Box::new(|w| w.bind(&mr, 0..64, AccessFlags::ZERO_BASED)),
        ),
        (
            "rkey of another window",
            Box::new(|w| match w.bind(&mr, 0..64, WINDOW_RIGHTS) {
                SendOp::BindMw {
                    window,
                    mr,
                    addr,
                    length,
                    access,
                    ..
                } => SendOp::BindMw {
                    window,
                    rkey: bound.rkey(),
                    mr,
                    addr,
                    length,
                    access,
                },
                op => op,
            }),
        ),
    ];
    for (what, make) in &cases {
        let mw = pd.alloc_mw(MwType::Type2).unwrap();
        let l = link(&ctx, &pd);
        assert_eq!(run(&l.a, &l.cq_a, make(&mw)), WcStatus::MwBindErr, "{what}");
    }
    // A bound type-2 window must be invalidated before it is bound again.
    let l = link(&ctx, &pd);
    assert_eq!(
        run(&l.a, &l.cq_a, bound.bind(&mr, 0..64, WINDOW_RIGHTS)),
        WcStatus::MwBindErr
    );
}

#[test]
fn local_invalidation_frees_a_type2_window_and_a_new_bind_gives_it_a_new_rkey() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let l = link(&ctx, &pd);
    let dst = pd.alloc_mr(4096, BINDABLE).unwrap();
    let src = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let mw = pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(
        run(&l.b, &l.cq_b, mw.bind(&dst, 0..4096, WINDOW_RIGHTS)),
        WcStatus::Success
    );
    let old = mw.rkey();
    let (dst, err) = dst.dereg().unwrap_err();
    assert!(matches!(err, Error::Busy(_)), "{err}");
    assert_eq!(
        run(&l.b, &l.cq_b, SendOp::LocalInv { rkey: old }),
        WcStatus::Success
    );
    let wc_opcode = {
        // The LOCAL_INV completion's opcode, from a second one on a fresh link.
        let m = link(&ctx, &pd);
        assert_eq!(
            run(&m.b, &m.cq_b, mw.bind(&dst, 0..64, WINDOW_RIGHTS)),
            WcStatus::Success
        );
        m.b.post_send([signaled(SendWr::new(
            8,
            SendOp::LocalInv { rkey: mw.rkey() },
            &[],
        ))])
        .unwrap();
        poll_n(&m.cq_b, 1)[0].opcode()
    };
    assert_eq!(wc_opcode, WcOpcode::LocalInv);
    assert_eq!(write(&l, &src, 8, dst.iova(), old), WcStatus::RemAccessErr);
    // Invalidating a key that is not a bound type-2 window's is a local QP operation error.
    let m = link(&ctx, &pd);
    assert_eq!(
        run(&m.b, &m.cq_b, SendOp::LocalInv { rkey: dst.rkey() }),
        WcStatus::LocQpOpErr
    );
    let m = link(&ctx, &pd);
    assert_eq!(
        run(&m.b, &m.cq_b, mw.bind(&dst, 0..4096, WINDOW_RIGHTS)),
        WcStatus::Success
    );
    assert_ne!(mw.rkey(), old);
    assert_eq!(
        mw.rkey() >> 8,
        old >> 8,
        "the index is the window's for life"
    );
    assert_eq!(write_on(&m, &src, dst.iova(), mw.rkey()), WcStatus::Success);
}

fn write_on(l: &Link, src: &MemoryRegion<'_>, remote_addr: u64, rkey: u32) -> WcStatus {
    let sge = [src.sge(0..8)];
    let op = SendOp::RdmaWrite { remote_addr, rkey };
    l.a.post_send([signaled(SendWr::new(1, op, &sge))]).unwrap();
    poll_n(&l.cq_a, 1)[0].status()
}

#[test]
fn type1_windows_rebind_in_place_unbind_with_length_zero_and_cannot_be_invalidated() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let l = link(&ctx, &pd);
    let dst = pd.alloc_mr(4096, BINDABLE).unwrap();
    let src = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    src.fill(7);
    let mw = pd.alloc_mw(MwType::Type1).unwrap();
    // Bound by a (not the responder): a type-1 window is the PD's, reached through any QP.
    assert_eq!(
        run(
            &l.a,
            &l.cq_a,
            mw.bind(&dst, 0..64, AccessFlags::REMOTE_WRITE)
        ),
        WcStatus::Success
    );
    let first = mw.rkey();
    assert_eq!(write(&l, &src, 8, dst.iova(), first), WcStatus::Success);
    assert_eq!(
        run(
            &l.a,
            &l.cq_a,
            mw.bind(&dst, 64..128, AccessFlags::REMOTE_WRITE)
        ),
        WcStatus::Success
    );
    let second = mw.rkey();
    assert_eq!(
        write(&l, &src, 8, dst.iova() + 64, second),
        WcStatus::Success
    );
    assert_eq!(dst.load_u8(64).unwrap(), 7);
    assert_eq!(
        write(&l, &src, 8, dst.iova(), first),
        WcStatus::RemAccessErr,
        "the rebind revoked the old rkey"
    );
    let l = link(&ctx, &pd);
    assert_eq!(
        run(&l.a, &l.cq_a, SendOp::LocalInv { rkey: second }),
        WcStatus::LocQpOpErr,
        "type-1 windows are not invalidated"
    );
    let l = link(&ctx, &pd);
    assert_eq!(
        run(
            &l.a,
            &l.cq_a,
            mw.bind(&dst, 0..0, AccessFlags::REMOTE_WRITE)
        ),
        WcStatus::Success
    );
    assert!(dst.dereg().is_ok(), "unbound, the region deregisters");
}

#[test]
fn a_window_rkey_is_no_lkey_and_a_freed_window_reaches_nothing() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let l = link(&ctx, &pd);
    let dst = pd.alloc_mr(4096, BINDABLE).unwrap();
    let mw = pd.alloc_mw(MwType::Type1).unwrap();
    assert_eq!(
        run(&l.a, &l.cq_a, mw.bind(&dst, 0..4096, WINDOW_RIGHTS)),
        WcStatus::Success
    );
    let rkey = mw.rkey();
    let sge = [Sge {
        addr: dst.iova(),
        length: 8,
        lkey: rkey,
    }];
    let op = SendOp::RdmaWrite {
        remote_addr: dst.iova(),
        rkey: dst.rkey(),
    };
    l.a.post_send([signaled(SendWr::new(1, op, &sge))]).unwrap();
    assert_eq!(poll_n(&l.cq_a, 1)[0].status(), WcStatus::LocProtErr);
    drop(mw);
    let l = link(&ctx, &pd);
    let src = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    assert_eq!(write(&l, &src, 8, dst.iova(), rkey), WcStatus::RemAccessErr);
    assert!(dst.dereg().is_ok(), "freeing the window unbound it");
}

#[test]
fn dropping_a_region_with_a_bound_window_revokes_the_window() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let l = link(&ctx, &pd);
    let src = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let mw = pd.alloc_mw(MwType::Type1).unwrap();
    {
        let dst = pd.alloc_mr(4096, BINDABLE).unwrap();
        assert_eq!(
            run(&l.a, &l.cq_a, mw.bind(&dst, 0..4096, WINDOW_RIGHTS)),
            WcStatus::Success
        );
        let iova = dst.iova();
        drop(dst);
        assert_eq!(write(&l, &src, 8, iova, mw.rkey()), WcStatus::RemAccessErr);
    }
}
