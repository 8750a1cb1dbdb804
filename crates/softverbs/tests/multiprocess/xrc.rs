//! XRC across processes: one connection, the target QP in this process, and the SRQ it
//! delivers to in another process that opened the same XRC domain by its file.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;
use std::os::fd::AsFd;

// Opens the parent's domain (it must exist: no O_CREAT), makes an XRC SRQ in it and a
// region, and checks what the parent's initiator sends there.
peer!(peer_xrc_receiver, |p| {
    let path: String = p.expect("domain").get(0);
    let n = node();
    let file = std::fs::File::open(&path).unwrap();
    let xrcd = n
        .ctx
        .open_xrcd(Some(file.as_fd()), XrcdOpen::default())
        .expect("the parent's domain exists");
    let srq =
        n.pd.create_xrc_srq(
            &xrcd,
            &n.cq,
            SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    let bufs = n.mr(128);
    let target = n.mr(64);
    srq.post_recv([RecvWr::new(7, &[bufs.sge(0..128)])])
        .unwrap();
    p.send(msg!("srq", srq.srq_num().unwrap(), RemoteMr::of(&target)));
    let m = p.expect("sent");
    let (tgt_qpn, ini_qpn): (u32, u32) = (m.get(0), m.get(1));
    let wc = poll_n(&n.cq, 1, "XRC receiver: the receive")[0];
    assert_eq!(
        (wc.status(), wc.wr_id(), wc.byte_len()),
        (WcStatus::Success, 7, 11),
        "{wc:?}"
    );
    assert_eq!((wc.qp_num(), wc.src_qp()), (tgt_qpn, ini_qpn), "{wc:?}");
    assert_eq!(&bufs.to_vec()[..11], b"hello, xrc!");
    assert_eq!(compare(&target.to_vec(), &pattern(64, 5)), "ok");
    p.send("checked");
});

#[test]
fn an_xrc_target_delivers_into_an_srq_of_another_process_in_its_domain() {
    let path = std::env::temp_dir().join(format!("softverbs-xrc-mp-{}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    if crate::harness::between_hosts() {
        eprintln!(
            "skipped between hosts: a target and its SRQs share a host (the next test puts \
             the initiator on the other one)"
        );
        let _ = std::fs::remove_file(&path);
        return;
    }
    let n = node();
    let xrcd = n
        .ctx
        .open_xrcd(
            Some(file.as_fd()),
            XrcdOpen {
                create: true,
                exclusive: true,
            },
        )
        .unwrap();
    let tgt = xrcd.create_target_qp().unwrap();
    let ini =
        n.pd.create_qp(&QpInitAttr::new(QpType::XrcSend, &n.cq, &n.cq))
            .unwrap();
    tgt.connect(&ini.endpoint(1).unwrap(), 2, ALL_REMOTE)
        .unwrap();
    ini.connect(&tgt.endpoint(2).unwrap(), 1, ALL_REMOTE)
        .unwrap();

    let mut r = Peer::spawn("xrc::peer_xrc_receiver");
    r.send(msg!("domain", path.to_str().unwrap()));
    let m = r.expect("srq");
    let (srqn, dst): (u32, RemoteMr) = (m.get(0), m.get(1));
    let src = n.mr(64);
    src.write_at(0, &pattern(64, 5)).unwrap();
    let write = SendOp::RdmaWrite {
        remote_addr: dst.iova,
        rkey: dst.rkey,
    };
    ini.post_send([
        signaled(SendWr::new(1, write, &[src.sge(0..64)]).xrc(srqn)),
        signaled(SendWr::inline(2, SendOp::Send, b"hello, xrc!").xrc(srqn)),
    ])
    .unwrap();
    assert_all_ok(&poll_n(&n.cq, 2, "XRC initiator"), "XRC initiator");
    r.send(msg!("sent", tgt.qp_num(), ini.qp_num()));
    r.expect("checked");
    r.finish();
    let _ = std::fs::remove_file(&path);
}

// The receiving side: a domain of its own, two XRC SRQs and a target QP.
peer!(peer_xrc_target, |p| {
    let n = node();
    let xrcd = n.ctx.open_xrcd(None, XrcdOpen::default()).unwrap();
    let attr = SrqAttr {
        max_wr: 8,
        max_sge: 1,
        srq_limit: 0,
    };
    let cq2 = n.ctx.create_cq(8, None).unwrap();
    let (s1, s2) = (
        n.pd.create_xrc_srq(&xrcd, &n.cq, attr).unwrap(),
        n.pd.create_xrc_srq(&xrcd, &cq2, attr).unwrap(),
    );
    let bufs = n.mr(256);
    s1.post_recv([RecvWr::new(1, &[bufs.sge(0..128)])]).unwrap();
    s2.post_recv([RecvWr::new(2, &[bufs.sge(128..256)])])
        .unwrap();
    let target = n.mr(64);
    let tgt = xrcd.create_target_qp().unwrap();
    p.send(msg!(
        "target",
        tgt.endpoint(4).unwrap(),
        s1.srq_num().unwrap(),
        s2.srq_num().unwrap(),
        RemoteMr::of(&target)
    ));
    let ini: Endpoint = p.expect("initiator").get(0);
    tgt.connect(&ini, 4, ALL_REMOTE).unwrap();
    p.send("ready");
    p.expect("sent");
    let (a, b) = (
        poll_n(&n.cq, 1, "XRC target: SRQ 1")[0],
        poll_n(&cq2, 1, "XRC target: SRQ 2")[0],
    );
    for (w, id, len) in [(a, 1, 5), (b, 2, 3)] {
        assert_eq!(
            (w.status(), w.wr_id(), w.byte_len(), w.qp_num(), w.src_qp()),
            (WcStatus::Success, id, len, tgt.qp_num(), ini.qpn),
            "{w:?}"
        );
    }
    let got = bufs.to_vec();
    assert_eq!((&got[..5], &got[128..131]), (&b"first"[..], &b"two"[..]));
    assert_eq!(compare(&target.to_vec(), &pattern(64, 9)), "ok");
    p.send("checked");
});

#[test]
fn an_initiator_reaches_two_srqs_through_one_target_in_another_process_or_host() {
    let mut t = Peer::spawn("xrc::peer_xrc_target");
    let m = t.expect("target");
    let (tep, n1, n2, dst): (Endpoint, u32, u32, RemoteMr) =
        (m.get(0), m.get(1), m.get(2), m.get(3));
    let n = node();
    let ini =
        n.pd.create_qp(&QpInitAttr::new(QpType::XrcSend, &n.cq, &n.cq))
            .unwrap();
    ini.connect(&tep, 4, ALL_REMOTE).unwrap();
    t.send(msg!("initiator", ini.endpoint(4).unwrap()));
    t.expect("ready");
    let src = n.mr(64);
    src.write_at(0, &pattern(64, 9)).unwrap();
    let write = SendOp::RdmaWrite {
        remote_addr: dst.iova,
        rkey: dst.rkey,
    };
    ini.post_send([
        signaled(SendWr::new(1, write, &[src.sge(0..64)]).xrc(n2)),
        signaled(SendWr::inline(2, SendOp::Send, b"two").xrc(n2)),
        signaled(SendWr::inline(3, SendOp::Send, b"first").xrc(n1)),
    ])
    .unwrap();
    assert_all_ok(&poll_n(&n.cq, 3, "XRC initiator"), "XRC initiator");
    t.send("sent");
    t.expect("checked");
    t.finish();
}
