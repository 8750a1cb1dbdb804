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
    let n = node();
    if crate::harness::between_hosts() {
        // A networked device has no XRC (README, Status): it says so.
        let r = n.ctx.open_xrcd(Some(file.as_fd()), XrcdOpen::default());
        assert!(matches!(r, Err(Error::Unsupported(_))), "{:?}", r.err());
        assert_eq!(n.ctx.query_device().device_cap_flags & cap_flags::XRC, 0);
        let _ = std::fs::remove_file(&path);
        return;
    }
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
