//! Shared receive queues.

use crate::common::*;
use softverbs::*;

#[test]
fn one_srq_feeds_two_qps_and_fires_its_limit_event() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq_s = ctx.create_cq(64, None).unwrap();
    let cq_r = ctx.create_cq(64, None).unwrap();
    let srq = pd
        .create_srq(SrqAttr {
            max_wr: 16,
            max_sge: 2,
            srq_limit: 0,
        })
        .unwrap();
    assert!(srq.query().max_wr >= 16);
    let mut init = QpInitAttr::rc(&cq_r, &cq_r);
    init.srq = Some(&srq);
    let r1 = pd.create_qp(&init).unwrap();
    let r2 = pd.create_qp(&init).unwrap();
    assert_eq!(
        r1.cap().max_recv_wr,
        0,
        "an SRQ QP has no receive queue of its own"
    );
    let s1 = pd.create_qp(&QpInitAttr::rc(&cq_s, &cq_s)).unwrap();
    let s2 = pd.create_qp(&QpInitAttr::rc(&cq_s, &cq_s)).unwrap();
    for (s, r) in [(&s1, &r1), (&s2, &r2)] {
        s.connect(&r.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
        r.connect(&s.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    }
    let bufs = pd.alloc_mr(16 * 64, ALL_REMOTE).unwrap();
    let sges: Vec<[Sge; 1]> = (0..6).map(|i| [bufs.sge(i * 64..i * 64 + 64)]).collect();
    srq.post_recv(
        sges.iter()
            .enumerate()
            .map(|(i, s)| RecvWr::new(100 + i as u64, s)),
    )
    .unwrap();
    // Posting to a QP that uses an SRQ is an error.
    assert_eq!(
        r1.post_recv([RecvWr::new(1, &sges[0])])
            .unwrap_err()
            .error
            .errno(),
        22
    );
    srq.arm_limit(3).unwrap();
    assert_eq!(srq.query().srq_limit, 3);

    let src = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    src.write_at(0, b"from s1").unwrap();
    let a = [src.sge(0..7)];
    s1.post_send([SendWr::new(1, SendOp::Send, &a)]).unwrap();
    s2.post_send([
        SendWr::new(2, SendOp::Send, &a),
        SendWr::new(3, SendOp::Send, &a),
    ])
    .unwrap();
    let wc = poll_n(&cq_r, 3);
    assert_eq!(
        wc.iter().map(|w| w.wr_id()).collect::<Vec<_>>(),
        vec![100, 101, 102]
    );
    assert_eq!(wc[0].qp_num(), r1.qp_num());
    assert_eq!(wc[1].qp_num(), r2.qp_num());
    assert_eq!(wc[2].src_qp(), s2.qp_num());
    assert!(
        ctx.try_get_async_event().is_err(),
        "3 WQEs left: not below the limit yet"
    );
    s1.post_send([SendWr::new(4, SendOp::Send, &a)]).unwrap();
    poll_n(&cq_r, 1);
    let ev = ctx.try_get_async_event().unwrap();
    assert_eq!(ev.kind, AsyncEventType::SrqLimitReached);
    assert_eq!(ev.element, EventElement::Srq(srq.id()));
    assert_eq!(srq.query().srq_limit, 0, "the limit disarms after firing");
    assert!(srq.arm_limit(1000).is_err());
}

#[test]
fn srq_qp_in_error_reports_last_wqe_reached() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let srq = pd
        .create_srq(SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        })
        .unwrap();
    let mut init = QpInitAttr::rc(&cq, &cq);
    init.srq = Some(&srq);
    let qp = pd.create_qp(&init).unwrap();
    qp.modify(
        &QpAttr {
            qp_state: QpState::Err,
            ..QpAttr::default()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
    let ev = ctx.try_get_async_event().unwrap();
    assert_eq!(ev.kind, AsyncEventType::QpLastWqeReached);
    assert_eq!(ev.element, EventElement::Qp(qp.qp_num()));
}

#[test]
fn bad_srq_sizes_are_rejected() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let max = ctx.query_device();
    for attr in [
        SrqAttr {
            max_wr: 0,
            max_sge: 1,
            srq_limit: 0,
        },
        SrqAttr {
            max_wr: max.max_srq_wr + 1,
            max_sge: 1,
            srq_limit: 0,
        },
        SrqAttr {
            max_wr: 4,
            max_sge: max.max_srq_sge + 1,
            srq_limit: 0,
        },
        SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 5,
        },
    ] {
        assert!(
            matches!(pd.create_srq(attr), Err(Error::InvalidArgument(_))),
            "{attr:?}"
        );
    }
}
