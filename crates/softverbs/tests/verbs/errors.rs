//! Run-time failures: error completions, QP state, flushing, RNR.

use crate::common::*;
use softverbs::*;
use std::time::{Duration, Instant};

/// Posts `bad` followed by two good WRITEs and checks the verbs outcome.
fn bad_remote_op(make: impl Fn(&MemoryRegion<'_>, &[Sge]) -> SendOp, expect: WcStatus) {
    let p = pair(QpType::Rc);
    let local = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let remote = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    remote.fill(0x5a);
    local.fill(0x11);
    let s8 = [local.sge(0..8)];
    let good = [local.sge(0..16)];
    p.b.post_recv([RecvWr::new(50, &[])]).unwrap();
    p.a.post_send([
        signaled(SendWr::new(1, make(&remote, &s8), &s8)),
        SendWr::new(
            2,
            SendOp::RdmaWrite {
                remote_addr: remote.iova(),
                rkey: remote.rkey(),
            },
            &good,
        ),
        signaled(SendWr::new(
            3,
            SendOp::RdmaWrite {
                remote_addr: remote.iova(),
                rkey: remote.rkey(),
            },
            &good,
        )),
    ])
    .unwrap();
    let wc = poll_n(&p.cq_a, 3);
    assert_eq!((wc[0].wr_id(), wc[0].status()), (1, expect));
    // Every later WR is flushed, signaled or not.
    assert_eq!((wc[1].wr_id(), wc[1].status()), (2, WcStatus::WrFlushErr));
    assert_eq!((wc[2].wr_id(), wc[2].status()), (3, WcStatus::WrFlushErr));
    assert_eq!(p.a.state(), QpState::Err);
    assert!(
        remote.to_vec().iter().all(|&b| b == 0x5a),
        "target memory untouched"
    );
    // Posting in ERR completes at once with a flush error.
    p.a.post_send([SendWr::new(4, SendOp::Send, &good)])
        .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::WrFlushErr);
    // The responder side of an access error goes to ERR too, with an async event, and its
    // posted receive is flushed.
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.b.state() != QpState::Err {
        assert!(
            Instant::now() < deadline,
            "responder stayed in {:?}",
            p.b.state()
        );
        std::thread::yield_now();
    }
    let rc = poll_n(&p.cq_b, 1)[0];
    assert_eq!((rc.wr_id(), rc.status()), (50, WcStatus::WrFlushErr));
    let ev = p.ctx.get_async_event().unwrap();
    assert_eq!(ev.element, EventElement::Qp(p.b.qp_num()));
    assert_eq!(ev.kind, AsyncEventType::QpAccessErr);
}

#[test]
fn write_out_of_bounds() {
    bad_remote_op(
        |r, _| SendOp::RdmaWrite {
            remote_addr: r.iova() + 60,
            rkey: r.rkey(),
        },
        WcStatus::RemAccessErr,
    );
}

#[test]
fn write_wrong_key() {
    bad_remote_op(
        |r, _| SendOp::RdmaWrite {
            remote_addr: r.iova(),
            rkey: r.rkey() ^ 0x100,
        },
        WcStatus::RemAccessErr,
    );
}

#[test]
fn read_out_of_bounds() {
    bad_remote_op(
        |r, _| SendOp::RdmaRead {
            remote_addr: r.iova() - 8,
            rkey: r.rkey(),
        },
        WcStatus::RemAccessErr,
    );
}

#[test]
fn read_wrong_key() {
    bad_remote_op(
        |_, _| SendOp::RdmaRead {
            remote_addr: 0,
            rkey: 0xffff_ff00,
        },
        WcStatus::RemAccessErr,
    );
}

#[test]
fn atomic_out_of_bounds() {
    bad_remote_op(
        |r, _| SendOp::FetchAdd {
            remote_addr: r.iova() + 64,
            rkey: r.rkey(),
            add: 1,
        },
        WcStatus::RemAccessErr,
    );
}

#[test]
fn atomic_wrong_key() {
    bad_remote_op(
        |r, _| SendOp::CmpSwap {
            remote_addr: r.iova(),
            rkey: r.rkey() + 1,
            compare: 0,
            swap: 1,
        },
        WcStatus::RemAccessErr,
    );
}

#[test]
fn region_without_the_right_is_a_remote_access_error() {
    let p = pair(QpType::Rc);
    let local = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let ro =
        p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
            .unwrap();
    let s = [local.sge(0..8)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: ro.iova(),
            rkey: ro.rkey(),
        },
        &s,
    ))])
    .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::RemAccessErr);
}

#[test]
fn region_of_another_pd_is_a_remote_access_error() {
    let p = pair(QpType::Rc);
    let other_pd = p.ctx.alloc_pd().unwrap();
    let local = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let foreign = other_pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let s = [local.sge(0..8)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: foreign.iova(),
            rkey: foreign.rkey(),
        },
        &s,
    ))])
    .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::RemAccessErr);
}

#[test]
fn bad_local_key_is_a_local_protection_error() {
    let p = pair(QpType::Rc);
    let local = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let remote = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let mut s = [local.sge(0..8)];
    s[0].lkey ^= 0x100;
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: remote.iova(),
            rkey: remote.rkey(),
        },
        &s,
    ))])
    .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::LocProtErr);
    assert_eq!(p.a.state(), QpState::Err);
    // A READ into a region without LOCAL_WRITE is a local protection error too.
    let p = pair(QpType::Rc);
    let ro = p.pd.alloc_mr(64, AccessFlags::REMOTE_READ).unwrap();
    let remote = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let s = [ro.sge(0..8)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaRead {
            remote_addr: remote.iova(),
            rkey: remote.rkey(),
        },
        &s,
    ))])
    .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::LocProtErr);
}

#[test]
fn deregistered_region_fails_like_a_wrong_key() {
    let p = pair(QpType::Rc);
    let local = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let remote = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let (iova, rkey) = (remote.iova(), remote.rkey());
    drop(remote);
    let s = [local.sge(0..8)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: iova,
            rkey,
        },
        &s,
    ))])
    .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::RemAccessErr);
}

#[test]
fn receive_too_small_fails_both_sides() {
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    p.b.post_recv([RecvWr::new(7, &[dst.sge(0..16)])]).unwrap();
    let s = [src.sge(0..32)];
    p.a.post_send([signaled(SendWr::new(1, SendOp::Send, &s))])
        .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::RemInvReqErr);
    let rc = poll_n(&p.cq_b, 1)[0];
    assert_eq!((rc.wr_id(), rc.status()), (7, WcStatus::LocLenErr));
}

#[test]
fn rnr_retry_exceeded() {
    let p = pair(QpType::Rc);
    // Few retries with a short RNR timer on the responder.
    let mut a = p.a.query();
    a.rnr_retry = 2;
    p.a.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            ..a.clone()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
    let mut set = QpAttr {
        rnr_retry: 2,
        ..QpAttr::default()
    };
    // rnr_retry cannot change in RTS; go through SQD.
    assert!(p.a.modify(&set, QpAttrMask::RNR_RETRY).is_err());
    set.qp_state = QpState::Sqd;
    p.a.modify(&set, QpAttrMask::STATE).unwrap();
    p.a.modify(&set, QpAttrMask::RNR_RETRY).unwrap();
    set.qp_state = QpState::Rts;
    p.a.modify(&set, QpAttrMask::STATE).unwrap();
    let b = QpAttr {
        qp_state: QpState::Rts,
        min_rnr_timer: 1,
        ..QpAttr::default()
    };
    p.b.modify(&b, QpAttrMask::STATE | QpAttrMask::MIN_RNR_TIMER)
        .unwrap();

    let start = Instant::now();
    p.a.post_send([
        signaled(SendWr::inline(1, SendOp::Send, b"nobody listens")),
        signaled(SendWr::inline(2, SendOp::Send, b"x")),
    ])
    .unwrap();
    let wc = poll_n(&p.cq_a, 2);
    assert_eq!(
        (wc[0].wr_id(), wc[0].status()),
        (1, WcStatus::RnrRetryExcErr)
    );
    assert_eq!(wc[1].status(), WcStatus::WrFlushErr);
    assert_eq!(p.a.state(), QpState::Err);
    assert!(
        start.elapsed() >= Duration::from_micros(20),
        "two retries of 10 µs waited"
    );
}

#[test]
fn rnr_retry_succeeds_once_a_receive_is_posted() {
    let p = pair(QpType::Rc);
    p.a.post_send([
        signaled(SendWr::inline(1, SendOp::Send, b"late")),
        signaled(SendWr::inline(2, SendOp::Send, b"later")),
    ])
    .unwrap();
    // The first send waits for a receive (rnr_retry 7: forever); the second waits behind it.
    assert_empty(&p.cq_a);
    let buf = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    p.b.post_recv([
        RecvWr::new(1, &[buf.sge(0..32)]),
        RecvWr::new(2, &[buf.sge(32..64)]),
    ])
    .unwrap();
    let wc = poll_n(&p.cq_a, 2);
    assert!(wc.iter().all(|w| w.is_ok()));
    assert_eq!(wc.iter().map(|w| w.wr_id()).collect::<Vec<_>>(), vec![1, 2]);
    let rc = poll_n(&p.cq_b, 2);
    assert_eq!((rc[0].byte_len(), rc[1].byte_len()), (4, 5));
}

#[test]
fn unreachable_peer_exhausts_transport_retries() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let a = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let mut ep = a.endpoint(0).unwrap();
    ep.qpn = 0xfffff0; // nobody has this QP number
    a.connect(&ep, 0, ALL_REMOTE).unwrap();
    let mut set = QpAttr {
        qp_state: QpState::Sqd,
        ..QpAttr::default()
    };
    a.modify(&set, QpAttrMask::STATE).unwrap();
    set.timeout = 1; // 8 µs
    set.retry_cnt = 2;
    a.modify(&set, QpAttrMask::TIMEOUT | QpAttrMask::RETRY_CNT)
        .unwrap();
    set.qp_state = QpState::Rts;
    a.modify(&set, QpAttrMask::STATE).unwrap();
    a.post_send([signaled(SendWr::inline(1, SendOp::Send, b"hello?"))])
        .unwrap();
    assert_eq!(poll_n(&cq, 1)[0].status(), WcStatus::RetryExcErr);
}

#[test]
fn port_down_raises_events_and_blocks_traffic() {
    let dev = Device::builder()
        .name("port-flap")
        .gid("fe80::f1a9".parse().unwrap())
        .build()
        .unwrap();
    let ctx = dev.open().unwrap();
    dev.set_port_state(false);
    assert_eq!(ctx.get_async_event().unwrap().kind, AsyncEventType::PortErr);
    assert_eq!(ctx.query_port(1).unwrap().state, PortState::Down);
    dev.set_port_state(true);
    let ev = ctx.get_async_event().unwrap();
    assert_eq!(
        (ev.kind, ev.element),
        (AsyncEventType::PortActive, EventElement::Port(1))
    );
}
