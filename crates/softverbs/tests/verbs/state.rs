//! The QP state machine and its attribute masks.

use crate::common::*;
use softverbs::*;

fn fresh(qp_type: QpType) -> (Context, ProtectionDomain, CompletionQueue, QueuePair) {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let qp = pd.create_qp(&QpInitAttr::new(qp_type, &cq, &cq)).unwrap();
    (ctx, pd, cq, qp)
}

fn to(state: QpState) -> QpAttr {
    QpAttr {
        qp_state: state,
        port_num: 1,
        ..QpAttr::default()
    }
}

#[test]
fn skipping_states_is_einval() {
    let (_c, _p, _q, qp) = fresh(QpType::Rc);
    for s in [QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe] {
        let e = qp.modify(&to(s), QpAttrMask::STATE).unwrap_err();
        assert_eq!(e.errno(), 22, "RESET -> {s:?}");
        assert_eq!(qp.state(), QpState::Reset);
    }
}

#[test]
fn missing_required_attributes_are_einval() {
    let (_c, _p, _q, qp) = fresh(QpType::Rc);
    let init =
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
    for missing in [
        QpAttrMask::PKEY_INDEX,
        QpAttrMask::PORT,
        QpAttrMask::ACCESS_FLAGS,
    ] {
        assert!(
            qp.modify(&to(QpState::Init), init - missing).is_err(),
            "without {missing:?}"
        );
    }
    qp.modify(&to(QpState::Init), init).unwrap();
    let ep = qp.endpoint(0).unwrap();
    let mut rtr = to(QpState::Rtr);
    rtr.ah_attr = address_vector(LinkLayer::Ethernet, &ep);
    rtr.dest_qp_num = ep.qpn;
    let full = QpAttrMask::STATE
        | QpAttrMask::AV
        | QpAttrMask::PATH_MTU
        | QpAttrMask::DEST_QPN
        | QpAttrMask::RQ_PSN
        | QpAttrMask::MAX_DEST_RD_ATOMIC
        | QpAttrMask::MIN_RNR_TIMER;
    for m in [
        QpAttrMask::AV,
        QpAttrMask::DEST_QPN,
        QpAttrMask::MIN_RNR_TIMER,
        QpAttrMask::MAX_DEST_RD_ATOMIC,
    ] {
        assert!(
            qp.modify(&rtr, full - m).is_err(),
            "INIT->RTR without {m:?}"
        );
    }
    // An attribute the transition does not take is rejected too.
    assert!(qp.modify(&rtr, full | QpAttrMask::SQ_PSN).is_err());
    assert_eq!(qp.state(), QpState::Init);
    qp.modify(&rtr, full).unwrap();
    let rts = QpAttrMask::STATE
        | QpAttrMask::SQ_PSN
        | QpAttrMask::TIMEOUT
        | QpAttrMask::RETRY_CNT
        | QpAttrMask::RNR_RETRY
        | QpAttrMask::MAX_QP_RD_ATOMIC;
    assert!(
        qp.modify(&to(QpState::Rts), rts - QpAttrMask::TIMEOUT)
            .is_err()
    );
    qp.modify(&to(QpState::Rts), rts).unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    let q = qp.query();
    assert_eq!((q.qp_state, q.dest_qp_num), (QpState::Rts, ep.qpn));
}

#[test]
fn bad_attribute_values_are_einval() {
    let (_c, _p, _q, qp) = fresh(QpType::Rc);
    let init =
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
    assert!(
        qp.modify(
            &QpAttr {
                port_num: 2,
                ..to(QpState::Init)
            },
            init
        )
        .is_err()
    );
    assert!(
        qp.modify(
            &QpAttr {
                pkey_index: 1,
                ..to(QpState::Init)
            },
            init
        )
        .is_err()
    );
    assert!(
        qp.modify(
            &QpAttr {
                qp_access_flags: AccessFlags::MW_BIND,
                ..to(QpState::Init)
            },
            init
        )
        .is_err()
    );
    qp.modify(&to(QpState::Init), init).unwrap();
    let ep = qp.endpoint(0).unwrap();
    let rtr = |f: &dyn Fn(&mut QpAttr)| {
        let mut a = to(QpState::Rtr);
        a.ah_attr = address_vector(LinkLayer::Ethernet, &ep);
        f(&mut a);
        qp.modify(
            &a,
            QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
        )
    };
    assert!(rtr(&|a| a.dest_qp_num = 1 << 24).is_err());
    assert!(rtr(&|a| a.rq_psn = 1 << 24).is_err());
    assert!(rtr(&|a| a.min_rnr_timer = 32).is_err());
    assert!(rtr(&|a| a.max_dest_rd_atomic = 255).is_err());
    assert!(rtr(&|a| a.ah_attr.grh = None).is_err(), "RoCE needs a GRH");
    assert!(rtr(&|a| a.ah_attr.grh.as_mut().unwrap().sgid_index = 3).is_err());
    rtr(&|_| {}).unwrap();
}

#[test]
fn cur_state_must_match() {
    let (_c, _p, _q, qp) = fresh(QpType::Ud);
    let mut a = to(QpState::Init);
    a.cur_qp_state = QpState::Rts;
    let e = qp.modify(
        &a,
        QpAttrMask::STATE
            | QpAttrMask::CUR_STATE
            | QpAttrMask::PKEY_INDEX
            | QpAttrMask::PORT
            | QpAttrMask::QKEY,
    );
    assert!(e.is_err());
}

#[test]
fn any_state_can_go_to_err_and_reset() {
    let p = pair(QpType::Rc);
    p.a.modify(&to(QpState::Err), QpAttrMask::STATE).unwrap();
    assert_eq!(p.a.state(), QpState::Err);
    // ERR -> RTS is not a transition.
    assert!(p.a.modify(&to(QpState::Rts), QpAttrMask::STATE).is_err());
    p.a.modify(&to(QpState::Reset), QpAttrMask::STATE).unwrap();
    assert_eq!(p.a.state(), QpState::Reset);
    // RESET forgets the connection; the QP can be reconnected.
    p.a.connect(&p.b.endpoint(0).unwrap(), 0, ALL_REMOTE)
        .unwrap();
    p.a.post_send([signaled(SendWr::inline(1, SendOp::Send, b"")).flags(SendFlags::empty())])
        .unwrap();
    assert_eq!(poll_n(&p.cq_a, 0).len(), 0);
}

#[test]
fn posting_in_the_wrong_state_is_einval() {
    let (_c, _p, _q, qp) = fresh(QpType::Rc);
    let e = qp
        .post_send([SendWr::inline(1, SendOp::Send, b"x")])
        .unwrap_err();
    assert_eq!((e.index, e.error.errno()), (0, 22));
    let e = qp.post_recv([RecvWr::new(1, &[])]).unwrap_err();
    assert_eq!(e.error.errno(), 22, "no receives in RESET");
}

#[test]
fn moving_to_err_flushes_posted_receives() {
    let p = pair(QpType::Rc);
    p.b.post_recv([RecvWr::new(1, &[]), RecvWr::new(2, &[])])
        .unwrap();
    p.b.modify(&to(QpState::Err), QpAttrMask::STATE).unwrap();
    let wc = poll_n(&p.cq_b, 2);
    assert!(wc.iter().all(|w| w.status() == WcStatus::WrFlushErr));
    assert_eq!(wc.iter().map(|w| w.wr_id()).collect::<Vec<_>>(), vec![1, 2]);
    p.b.post_recv([RecvWr::new(3, &[])]).unwrap();
    assert_eq!(poll_n(&p.cq_b, 1)[0].wr_id(), 3);
}

#[test]
fn sqd_holds_new_sends_until_rts_and_reports_drained() {
    let p = pair(QpType::Rc);
    let mut a = to(QpState::Sqd);
    a.en_sqd_async_notify = true;
    p.a.modify(&a, QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY)
        .unwrap();
    assert_eq!(
        p.ctx.get_async_event().unwrap().kind,
        AsyncEventType::SqDrained
    );
    p.b.post_recv([RecvWr::new(1, &[])]).unwrap();
    p.a.post_send([signaled(SendWr::inline(1, SendOp::Send, b""))])
        .unwrap();
    assert_empty(&p.cq_a);
    p.a.modify(&to(QpState::Rts), QpAttrMask::STATE).unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
}

#[test]
fn creation_caps_are_checked_and_rounded_up() {
    let ctx = ctx();
    let attr = ctx.query_device();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let mut init = QpInitAttr::rc(&cq, &cq);
    init.cap = QpCap {
        max_send_wr: 5,
        max_recv_wr: 9,
        max_send_sge: 3,
        max_recv_sge: 2,
        max_inline_data: 100,
    };
    let qp = pd.create_qp(&init).unwrap();
    let c = qp.cap();
    assert!(
        c.max_send_wr >= 5
            && c.max_recv_wr >= 9
            && c.max_send_sge >= 3
            && c.max_recv_sge >= 2
            && c.max_inline_data >= 100
    );
    for bad in [
        QpCap {
            max_send_wr: attr.max_qp_wr + 1,
            ..init.cap
        },
        QpCap {
            max_recv_wr: attr.max_qp_wr + 1,
            ..init.cap
        },
        QpCap {
            max_send_sge: attr.max_sge + 1,
            ..init.cap
        },
        QpCap {
            max_inline_data: attr.max_inline_data + 1,
            ..init.cap
        },
    ] {
        init.cap = bad;
        assert_eq!(
            pd.create_qp(&init).err().map(|e| e.errno()),
            Some(22),
            "{bad:?}"
        );
    }
    assert!(ctx.create_cq(0, None).is_err());
    assert!(ctx.create_cq(attr.max_cqe + 1, None).is_err());
}

#[test]
fn receives_posted_in_init_are_kept() {
    let p = pair(QpType::Uc);
    let buf = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let x =
        p.pd.create_qp(&QpInitAttr::new(QpType::Uc, &p.cq_b, &p.cq_b))
            .unwrap();
    let y =
        p.pd.create_qp(&QpInitAttr::new(QpType::Uc, &p.cq_a, &p.cq_a))
            .unwrap();
    x.to_init(ALL_REMOTE).unwrap();
    x.post_recv([RecvWr::new(9, &[buf.sge(0..64)])]).unwrap();
    x.to_rtr(&y.endpoint(0).unwrap()).unwrap();
    x.to_rts(0).unwrap();
    y.connect(&x.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    // UC drops a message that finds no receive: this one arrives because the receive was
    // posted in INIT.
    y.post_send([SendWr::inline(1, SendOp::Send, b"early")])
        .unwrap();
    let wc = poll_n(&p.cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id(), wc.status(), wc.byte_len()),
        (9, WcStatus::Success, 5)
    );
    assert_eq!(&buf.to_vec()[..5], b"early");
}
