//! XRC through the Rust API: domains (private and by file), XRC SRQs chosen per message by
//! their number, keys checked in the SRQ's PD, and the errors the spec names.

use crate::common::*;
use softverbs::*;
use std::os::fd::AsFd;

fn srq_attr() -> SrqAttr {
    SrqAttr {
        max_wr: 16,
        max_sge: 1,
        srq_limit: 0,
    }
}

/// An initiator in `pd` connected to a target of `xrcd`.
struct Xlink {
    cq: CompletionQueue,
    ini: QueuePair,
    tgt: QueuePair,
}

fn xlink(ctx: &Context, pd: &ProtectionDomain, xrcd: &XrcDomain, access: AccessFlags) -> Xlink {
    let cq = ctx.create_cq(64, None).unwrap();
    let ini = pd
        .create_qp(&QpInitAttr::new(QpType::XrcSend, &cq, &cq))
        .unwrap();
    let tgt = xrcd.create_target_qp().unwrap();
    tgt.connect(&ini.endpoint(10).unwrap(), 20, access).unwrap();
    ini.connect(&tgt.endpoint(20).unwrap(), 10, access).unwrap();
    Xlink { cq, ini, tgt }
}

#[test]
fn the_device_offers_xrc() {
    let attr = ctx().query_device();
    assert_ne!(attr.device_cap_flags & cap_flags::XRC, 0, "{attr:?}");
}

#[test]
fn each_message_lands_in_the_srq_it_names_with_the_target_qp_in_its_completion() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let xrcd = ctx.open_xrcd(None, XrcdOpen::default()).unwrap();
    let (cq1, cq2) = (
        ctx.create_cq(16, None).unwrap(),
        ctx.create_cq(16, None).unwrap(),
    );
    let s1 = pd.create_xrc_srq(&xrcd, &cq1, srq_attr()).unwrap();
    let s2 = pd.create_xrc_srq(&xrcd, &cq2, srq_attr()).unwrap();
    let (n1, n2) = (s1.srq_num().unwrap(), s2.srq_num().unwrap());
    assert_ne!(n1, n2);
    let plain = pd.create_srq(srq_attr()).unwrap();
    assert_eq!(plain.srq_num(), None, "a basic SRQ has no number");
    let buf = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    s1.post_recv([RecvWr::new(1, &[buf.sge(0..128)])]).unwrap();
    s2.post_recv([RecvWr::new(2, &[buf.sge(128..256)])])
        .unwrap();
    let l = xlink(&ctx, &pd, &xrcd, AccessFlags::empty());
    assert_eq!(l.tgt.qp_type(), QpType::XrcRecv);
    assert_eq!(
        l.tgt.query().cap,
        QpCap::default(),
        "a target has no queues"
    );

    l.ini
        .post_send([
            signaled(SendWr::inline(10, SendOp::Send, b"to two").xrc(n2)),
            signaled(SendWr::inline(11, SendOp::SendWithImm { imm: 5 }, b"to one").xrc(n1)),
        ])
        .unwrap();
    let sent = poll_n(&l.cq, 2);
    assert!(sent.iter().all(|w| w.is_ok()), "{sent:?}");
    let (r1, r2) = (poll_n(&cq1, 1)[0], poll_n(&cq2, 1)[0]);
    for (r, wr_id, len) in [(r1, 1, 6), (r2, 2, 6)] {
        assert_eq!(
            (r.status(), r.opcode(), r.wr_id(), r.byte_len()),
            (WcStatus::Success, WcOpcode::Recv, wr_id, len),
            "{r:?}"
        );
        assert_eq!(
            r.qp_num(),
            l.tgt.qp_num(),
            "the completion names the target QP"
        );
        assert_eq!(r.src_qp(), l.ini.qp_num());
    }
    assert_eq!(r1.imm_data(), Some(5));
    let got = buf.to_vec();
    assert_eq!(&got[..6], b"to one");
    assert_eq!(&got[128..134], b"to two");
}

#[test]
fn rdma_through_an_xrc_target_checks_keys_in_the_srqs_pd() {
    let ctx = ctx();
    let (pd, other_pd) = (ctx.alloc_pd().unwrap(), ctx.alloc_pd().unwrap());
    let xrcd = ctx.open_xrcd(None, XrcdOpen::default()).unwrap();
    let rcq = ctx.create_cq(16, None).unwrap();
    let srq = pd.create_xrc_srq(&xrcd, &rcq, srq_attr()).unwrap();
    let n = srq.srq_num().unwrap();
    let dst = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let elsewhere = other_pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let src = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    src.write_at(0, &pattern(64, 3)).unwrap();
    let l = xlink(&ctx, &pd, &xrcd, ALL_REMOTE);
    let sge = [src.sge(0..64)];
    let write = |rkey, addr| SendOp::RdmaWrite {
        remote_addr: addr,
        rkey,
    };
    l.ini
        .post_send([signaled(
            SendWr::new(1, write(dst.rkey(), dst.iova()), &sge).xrc(n),
        )])
        .unwrap();
    assert_eq!(poll_n(&l.cq, 1)[0].status(), WcStatus::Success);
    assert_eq!(dst.to_vec(), pattern(64, 3));
    let read = SendOp::RdmaRead {
        remote_addr: dst.iova(),
        rkey: dst.rkey(),
    };
    let back = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    l.ini
        .post_send([signaled(SendWr::new(2, read, &[back.sge(0..64)]).xrc(n))])
        .unwrap();
    assert_eq!(poll_n(&l.cq, 1)[0].status(), WcStatus::Success);
    assert_eq!(back.to_vec(), pattern(64, 3));
    // A region of another PD is out of the SRQ's reach: a remote access error, and the
    // target goes to ERR.
    l.ini
        .post_send([signaled(
            SendWr::new(3, write(elsewhere.rkey(), elsewhere.iova()), &sge).xrc(n),
        )])
        .unwrap();
    assert_eq!(poll_n(&l.cq, 1)[0].status(), WcStatus::RemAccessErr);
    assert_eq!(l.tgt.query().qp_state, QpState::Err);
    assert_empty(&rcq);
}

#[test]
fn an_srq_of_another_domain_is_an_invalid_request() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let (x1, x2) = (
        ctx.open_xrcd(None, XrcdOpen::default()).unwrap(),
        ctx.open_xrcd(None, XrcdOpen::default()).unwrap(),
    );
    assert!(!x1.same_domain(&x2));
    let rcq = ctx.create_cq(16, None).unwrap();
    let foreign = pd.create_xrc_srq(&x2, &rcq, srq_attr()).unwrap();
    let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    foreign
        .post_recv([RecvWr::new(1, &[buf.sge(0..64)])])
        .unwrap();
    let l = xlink(&ctx, &pd, &x1, AccessFlags::empty());
    l.ini
        .post_send([signaled(
            SendWr::inline(1, SendOp::Send, b"x").xrc(foreign.srq_num().unwrap()),
        )])
        .unwrap();
    assert_eq!(poll_n(&l.cq, 1)[0].status(), WcStatus::RemInvReqErr);
    assert_eq!(l.tgt.query().qp_state, QpState::Err);
    assert_empty(&rcq);
}

#[test]
fn a_message_to_an_srq_destroyed_mid_stream_stops_there() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let xrcd = ctx.open_xrcd(None, XrcdOpen::default()).unwrap();
    let rcq = ctx.create_cq(16, None).unwrap();
    let srq = pd.create_xrc_srq(&xrcd, &rcq, srq_attr()).unwrap();
    let n = srq.srq_num().unwrap();
    let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    srq.post_recv([RecvWr::new(1, &[buf.sge(0..64)])]).unwrap();
    let l = xlink(&ctx, &pd, &xrcd, AccessFlags::empty());
    l.ini
        .post_send([signaled(SendWr::inline(1, SendOp::Send, b"a").xrc(n))])
        .unwrap();
    assert!(poll_n(&l.cq, 1)[0].is_ok());
    drop(srq);
    l.ini
        .post_send([signaled(SendWr::inline(2, SendOp::Send, b"b").xrc(n))])
        .unwrap();
    assert_eq!(poll_n(&l.cq, 1)[0].status(), WcStatus::RemInvReqErr);
}

#[test]
fn xrc_qps_refuse_what_they_do_not_have() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let xrcd = ctx.open_xrcd(None, XrcdOpen::default()).unwrap();
    // A target is made in a domain, not a PD.
    let r = pd.create_qp(&QpInitAttr::new(QpType::XrcRecv, &cq, &cq));
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{:?}", r.err());
    // An initiator has no receive queue.
    let mut ia = QpInitAttr::new(QpType::XrcSend, &cq, &cq);
    assert_eq!(ia.cap.max_recv_wr, 0);
    ia.cap.max_recv_wr = 4;
    assert!(matches!(pd.create_qp(&ia), Err(Error::InvalidArgument(_))));
    let ini = pd
        .create_qp(&QpInitAttr::new(QpType::XrcSend, &cq, &cq))
        .unwrap();
    let tgt = xrcd.create_target_qp().unwrap();
    let buf = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    for qp in [&ini, &tgt] {
        let r = qp.post_recv([RecvWr::new(1, &[buf.sge(0..8)])]);
        assert!(r.is_err(), "post_recv on {:?}", qp.qp_type());
    }
    tgt.connect(&ini.endpoint(0).unwrap(), 0, AccessFlags::empty())
        .unwrap();
    // A target sends nothing.
    let r = tgt.post_send([SendWr::inline(1, SendOp::Send, b"x")]);
    assert!(r.is_err());
    // ibv_open_qp: the same target, by number, in its domain only.
    let again = xrcd.open_qp(tgt.qp_num()).unwrap();
    assert_eq!(again.qp_num(), tgt.qp_num());
    assert_eq!(again.query().qp_state, tgt.query().qp_state);
    let other = ctx.open_xrcd(None, XrcdOpen::default()).unwrap();
    assert!(other.open_qp(tgt.qp_num()).is_err());
    assert!(
        xrcd.open_qp(ini.qp_num()).is_err(),
        "an initiator is no target"
    );
}

#[test]
fn a_domain_opened_by_file_is_shared_and_follows_o_creat_and_o_excl() {
    let ctx = ctx();
    let dir = std::env::temp_dir().join(format!("softverbs-xrcd-{}", std::process::id()));
    let file = std::fs::File::create(&dir).unwrap();
    let create = XrcdOpen {
        create: true,
        exclusive: false,
    };
    let excl = XrcdOpen {
        create: true,
        exclusive: true,
    };
    // Nobody has it: without O_CREAT it does not exist.
    assert!(
        ctx.open_xrcd(Some(file.as_fd()), XrcdOpen::default())
            .is_err()
    );
    let a = ctx.open_xrcd(Some(file.as_fd()), excl).unwrap();
    assert!(
        ctx.open_xrcd(Some(file.as_fd()), excl).is_err(),
        "O_EXCL on an existing domain"
    );
    let reopened = std::fs::File::open(&dir).unwrap();
    let b = ctx
        .open_xrcd(Some(reopened.as_fd()), XrcdOpen::default())
        .unwrap();
    let c = ctx.open_xrcd(Some(file.as_fd()), create).unwrap();
    assert!(a.same_domain(&b) && b.same_domain(&c));
    // A target in one handle's domain delivers to an SRQ made through another handle.
    let pd = ctx.alloc_pd().unwrap();
    let rcq = ctx.create_cq(8, None).unwrap();
    let srq = pd.create_xrc_srq(&b, &rcq, srq_attr()).unwrap();
    let buf = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    srq.post_recv([RecvWr::new(9, &[buf.sge(0..8)])]).unwrap();
    let l = xlink(&ctx, &pd, &a, AccessFlags::empty());
    l.ini
        .post_send([signaled(
            SendWr::inline(1, SendOp::Send, b"shared").xrc(srq.srq_num().unwrap()),
        )])
        .unwrap();
    assert!(poll_n(&l.cq, 1)[0].is_ok());
    assert_eq!(poll_n(&rcq, 1)[0].wr_id(), 9);
    drop((l, srq, a, b, c));
    // Every handle closed: the domain is gone again.
    assert!(
        ctx.open_xrcd(Some(file.as_fd()), XrcdOpen::default())
            .is_err()
    );
    let _ = std::fs::remove_file(&dir);
}
