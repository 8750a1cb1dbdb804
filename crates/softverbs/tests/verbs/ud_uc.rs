//! UD with address handles, and UC.

use crate::common::*;
use softverbs::*;

struct Ud {
    ctx: Context,
    pd: ProtectionDomain,
    cq_a: CompletionQueue,
    cq_b: CompletionQueue,
    a: QueuePair,
    b: QueuePair,
}

fn ud_pair() -> Ud {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx.create_cq(64, None).unwrap();
    let cq_b = ctx.create_cq(64, None).unwrap();
    let a = pd
        .create_qp(&QpInitAttr::new(QpType::Ud, &cq_a, &cq_a))
        .unwrap();
    let b = pd
        .create_qp(&QpInitAttr::new(QpType::Ud, &cq_b, &cq_b))
        .unwrap();
    a.ready_ud(0x1111, 0).unwrap();
    b.ready_ud(0x2222, 0).unwrap();
    Ud {
        ctx,
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

#[test]
fn ud_send_through_an_address_handle_carries_a_grh() {
    let u = ud_pair();
    let port = u.ctx.query_port(1).unwrap();
    let ep = u.b.endpoint(0).unwrap();
    let ah =
        u.pd.create_ah(&address_vector(port.link_layer, &ep))
            .unwrap();
    let src = u.pd.alloc_mr(256, ALL_REMOTE).unwrap();
    let dst = u.pd.alloc_mr(GRH_LEN + 256, ALL_REMOTE).unwrap();
    src.write_at(0, &pattern(256, 5)).unwrap();
    u.b.post_recv([RecvWr::new(9, &[dst.sge(0..GRH_LEN + 256)])])
        .unwrap();
    let s = [src.sge(0..200)];
    u.a.post_send([signaled(
        SendWr::new(1, SendOp::SendWithImm { imm: 5 }, &s).ud(&ah, ep.qpn, 0x2222),
    )])
    .unwrap();
    assert!(poll_n(&u.cq_a, 1)[0].is_ok());
    let wc = poll_n(&u.cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id(), wc.byte_len(), wc.imm_data()),
        (9, GRH_LEN as u32 + 200, Some(5))
    );
    assert_eq!(wc.src_qp(), u.a.qp_num());
    assert!(wc.wc_flags().contains(WcFlags::GRH));
    let got = dst.to_vec();
    assert_eq!(&got[GRH_LEN..GRH_LEN + 200], &pattern(256, 5)[..200]);
    // The GRH names the sender's GID as source and ours as destination.
    let gid = u.ctx.query_gid(1, 0).unwrap();
    assert_eq!(&got[8..24], &gid.0);
    assert_eq!(&got[24..40], &gid.0);
    assert_eq!(got[0] >> 4, 6, "IP version 6");
}

#[test]
fn ud_drops_wrong_qkey_and_missing_receives_but_the_sender_succeeds() {
    let u = ud_pair();
    let port = u.ctx.query_port(1).unwrap();
    let ep = u.b.endpoint(0).unwrap();
    let ah =
        u.pd.create_ah(&address_vector(port.link_layer, &ep))
            .unwrap();
    let src = u.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let dst = u.pd.alloc_mr(GRH_LEN + 64, ALL_REMOTE).unwrap();
    let s = [src.sge(0..16)];
    // No receive posted: dropped silently.
    u.a.post_send([signaled(
        SendWr::new(1, SendOp::Send, &s).ud(&ah, ep.qpn, 0x2222),
    )])
    .unwrap();
    assert!(poll_n(&u.cq_a, 1)[0].is_ok());
    u.b.post_recv([RecvWr::new(2, &[dst.sge(0..GRH_LEN + 64)])])
        .unwrap();
    // Wrong Q_Key: dropped silently, the receive stays posted.
    u.a.post_send([signaled(
        SendWr::new(2, SendOp::Send, &s).ud(&ah, ep.qpn, 0x9999),
    )])
    .unwrap();
    assert!(poll_n(&u.cq_a, 1)[0].is_ok());
    assert_empty(&u.cq_b);
    // High Q_Key bit: use the sender QP's own Q_Key (0x1111), which does not match either.
    u.a.post_send([signaled(SendWr::new(3, SendOp::Send, &s).ud(
        &ah,
        ep.qpn,
        0x8000_0000,
    ))])
    .unwrap();
    poll_n(&u.cq_a, 1);
    assert_empty(&u.cq_b);
    // Unknown QPN: dropped.
    u.a.post_send([signaled(
        SendWr::new(4, SendOp::Send, &s).ud(&ah, 0xabcdef, 0x2222),
    )])
    .unwrap();
    poll_n(&u.cq_a, 1);
    assert_empty(&u.cq_b);
    u.a.post_send([signaled(
        SendWr::new(5, SendOp::Send, &s).ud(&ah, ep.qpn, 0x2222),
    )])
    .unwrap();
    poll_n(&u.cq_a, 1);
    assert_eq!(poll_n(&u.cq_b, 1)[0].wr_id(), 2);
}

#[test]
fn ud_rejects_rdma_opcodes_and_oversized_messages() {
    let u = ud_pair();
    let port = u.ctx.query_port(1).unwrap();
    let ep = u.b.endpoint(0).unwrap();
    let ah =
        u.pd.create_ah(&address_vector(port.link_layer, &ep))
            .unwrap();
    let mtu = port.active_mtu.bytes() as usize;
    let src = u.pd.alloc_mr(mtu + 1, ALL_REMOTE).unwrap();
    let s = [src.sge(0..8)];
    let e = u.a.post_send([SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: 0,
            rkey: 0,
        },
        &s,
    )
    .ud(&ah, ep.qpn, 0)]);
    assert_eq!(e.unwrap_err().error.errno(), 22);
    let e = u.a.post_send([SendWr::new(1, SendOp::Send, &s)]);
    assert_eq!(
        e.unwrap_err().error.errno(),
        22,
        "UD sends need an address handle"
    );
    // Larger than the MTU: local length error, the send queue goes to SQE.
    let big = [src.sge(0..mtu + 1)];
    u.a.post_send([signaled(
        SendWr::new(2, SendOp::Send, &big).ud(&ah, ep.qpn, 0x2222),
    )])
    .unwrap();
    assert_eq!(poll_n(&u.cq_a, 1)[0].status(), WcStatus::LocLenErr);
    assert_eq!(u.a.state(), QpState::Sqe);
    u.a.post_send([signaled(
        SendWr::new(3, SendOp::Send, &s).ud(&ah, ep.qpn, 0x2222),
    )])
    .unwrap();
    assert_eq!(poll_n(&u.cq_a, 1)[0].status(), WcStatus::WrFlushErr);
    // SQE -> RTS recovers the send queue.
    u.a.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            ..QpAttr::default()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
    u.a.post_send([signaled(
        SendWr::new(4, SendOp::Send, &s).ud(&ah, ep.qpn, 0x2222),
    )])
    .unwrap();
    assert!(poll_n(&u.cq_a, 1)[0].is_ok());
}

#[test]
fn ud_carries_messages_up_to_the_port_mtu() {
    let u = ud_pair();
    let port = u.ctx.query_port(1).unwrap();
    let mtu = port.active_mtu.bytes() as usize;
    assert_eq!(u.a.query().path_mtu, port.active_mtu);
    let ep = u.b.endpoint(0).unwrap();
    let ah =
        u.pd.create_ah(&address_vector(port.link_layer, &ep))
            .unwrap();
    let src = u.pd.alloc_mr(mtu, ALL_REMOTE).unwrap();
    let dst = u.pd.alloc_mr(GRH_LEN + mtu, ALL_REMOTE).unwrap();
    src.write_at(0, &pattern(mtu, 1)).unwrap();
    u.b.post_recv([RecvWr::new(1, &[dst.sge(0..GRH_LEN + mtu)])])
        .unwrap();
    let s = [src.sge(0..mtu)];
    u.a.post_send([signaled(
        SendWr::new(1, SendOp::Send, &s).ud(&ah, ep.qpn, 0x2222),
    )])
    .unwrap();
    assert!(poll_n(&u.cq_a, 1)[0].is_ok());
    assert_eq!(poll_n(&u.cq_b, 1)[0].byte_len() as usize, GRH_LEN + mtu);
    assert_eq!(&dst.to_vec()[GRH_LEN..], &pattern(mtu, 1)[..]);
}

#[test]
fn roce_address_handles_need_a_grh() {
    let u = ud_pair();
    let e = u.pd.create_ah(&AhAttr {
        dlid: 1,
        port_num: 1,
        ..AhAttr::default()
    });
    assert!(matches!(e, Err(Error::InvalidArgument(_))));
}

#[test]
fn ud_on_an_infiniband_device_uses_lids() {
    let dev = Device::builder()
        .name("ud-ib")
        .link_layer(LinkLayer::InfiniBand)
        .lid(0x77)
        .gid("fe80::77".parse().unwrap())
        .build()
        .unwrap();
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let a = pd
        .create_qp(&QpInitAttr::new(QpType::Ud, &cq, &cq))
        .unwrap();
    let b = pd
        .create_qp(&QpInitAttr::new(QpType::Ud, &cq, &cq))
        .unwrap();
    a.ready_ud(1, 0).unwrap();
    b.ready_ud(1, 0).unwrap();
    let ah = pd
        .create_ah(&AhAttr {
            dlid: 0x77,
            port_num: 1,
            sl: 3,
            ..AhAttr::default()
        })
        .unwrap();
    let buf = pd.alloc_mr(GRH_LEN + 8, ALL_REMOTE).unwrap();
    b.post_recv([RecvWr::new(1, &[buf.sge(0..GRH_LEN + 8)])])
        .unwrap();
    a.post_send([SendWr::inline(2, SendOp::Send, b"ib-ud!").ud(&ah, b.qp_num(), 1)])
        .unwrap();
    let wc = poll_n(&cq, 1)[0];
    assert_eq!(
        (wc.wr_id(), wc.byte_len(), wc.slid()),
        (1, GRH_LEN as u32 + 6, 0x77)
    );
    assert!(
        !wc.wc_flags().contains(WcFlags::GRH),
        "no GRH without is_global on IB"
    );
    assert_eq!(&buf.to_vec()[GRH_LEN..GRH_LEN + 6], b"ib-ud!");
}

#[test]
fn uc_writes_and_sends() {
    let p = pair(QpType::Uc);
    let src = p.pd.alloc_mr(1024, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(1024, ALL_REMOTE).unwrap();
    src.write_at(0, &pattern(1024, 11)).unwrap();
    let s = [src.sge(0..1024)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: dst.iova(),
            rkey: dst.rkey(),
        },
        &s,
    ))])
    .unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    assert_eq!(dst.to_vec(), pattern(1024, 11));
    // WRITE_WITH_IMM consumes a receive.
    p.b.post_recv([RecvWr::new(3, &[])]).unwrap();
    let s2 = [src.sge(0..10)];
    p.a.post_send([SendWr::new(
        2,
        SendOp::RdmaWriteWithImm {
            remote_addr: dst.iova(),
            rkey: dst.rkey(),
            imm: 1,
        },
        &s2,
    )])
    .unwrap();
    assert_eq!(poll_n(&p.cq_b, 1)[0].imm_data(), Some(1));
    // UC has no READ or atomics.
    let e = p.a.post_send([SendWr::new(
        3,
        SendOp::RdmaRead {
            remote_addr: dst.iova(),
            rkey: dst.rkey(),
        },
        &s2,
    )]);
    assert_eq!(e.unwrap_err().error.errno(), 22);
}

#[test]
fn uc_drops_what_rc_would_nak() {
    // UC has no acknowledgements: a bad rkey or a missing receive loses the message, and the
    // requester still completes successfully.
    let p = pair(QpType::Uc);
    let src = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    src.fill(0xee);
    let s = [src.sge(0..64)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: dst.iova(),
            rkey: dst.rkey() ^ 0x100,
        },
        &s,
    ))])
    .unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    p.a.post_send([signaled(SendWr::new(2, SendOp::Send, &s))])
        .unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    assert!(dst.to_vec().iter().all(|&b| b == 0));
    assert_empty(&p.cq_b);
    assert_eq!(p.a.state(), QpState::Rts);
}
