//! UD through address handles made from the peer's endpoint, and UC, between two processes.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;

const TARGET_QKEY: u32 = 0x2222;
const INITIATOR_QKEY: u32 = 0x1111;

/// Checks a UD receive's GRH area: IPv6, source `sgid`, destination `dgid`. Between hosts,
/// a message between IPv4-mapped GIDs arrives as RoCEv2 over IPv4, and the 40 bytes hold what
/// soft-RoCE and RoCE NICs put there: 20 unused bytes, then the IPv4 header; and the
/// completion's `sl` says which (a ConnectX's RoCE packet type: 0x8 | 2 for IPv4, 0x8 | 1
/// for IPv6), which UCX reads to find the destination address.
fn check_grh(buf: &[u8], wc: &WorkCompletion, sgid: Gid, dgid: Gid, who: &str) {
    let v4 = |g: Gid| g.to_ipv6().to_ipv4_mapped();
    let between = crate::harness::between_hosts();
    if between && let (Some(s), Some(d)) = (v4(sgid), v4(dgid)) {
        assert_eq!(wc.sl(), 0xa, "{who}: RoCEv2 over IPv4 in the sl: {wc:?}");
        assert_eq!(
            buf[20] >> 4,
            4,
            "{who}: IPv4 header: {:02x?}",
            &buf[..GRH_LEN]
        );
        assert_eq!(&buf[32..36], &s.octets(), "{who}: IPv4 source");
        assert_eq!(&buf[36..40], &d.octets(), "{who}: IPv4 destination");
        return;
    }
    if between {
        assert_eq!(wc.sl(), 0x9, "{who}: RoCEv2 over IPv6 in the sl: {wc:?}");
    }
    assert_eq!(
        buf[0] >> 4,
        6,
        "{who}: GRH IP version: {:02x?}",
        &buf[..GRH_LEN]
    );
    assert_eq!(&buf[8..24], &sgid.0, "{who}: GRH source GID");
    assert_eq!(&buf[24..40], &dgid.0, "{who}: GRH destination GID");
}

peer!(peer_ud_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Ud);
    qp.ready_ud(TARGET_QKEY, 0).unwrap();
    let buf = n.mr(GRH_LEN + 256);
    qp.post_recv([RecvWr::new(9, &[buf.sge(0..GRH_LEN + 256)])])
        .unwrap();
    let me = qp.endpoint(0).unwrap();
    p.send(msg!("target", me, TARGET_QKEY));
    let m = p.expect("sent");
    let (them, their_qkey): (Endpoint, u32) = (m.get(0), m.get(1));

    let wc = poll_n(&n.cq, 1, "UD target: the receive")[0];
    assert_eq!(
        (
            wc.wr_id(),
            wc.status(),
            wc.opcode(),
            wc.byte_len(),
            wc.imm_data()
        ),
        (
            9,
            WcStatus::Success,
            WcOpcode::Recv,
            GRH_LEN as u32 + 200,
            Some(5)
        ),
        "UD target: (wr_id, status, opcode, byte_len, imm): {wc:?}"
    );
    assert_eq!(
        (wc.src_qp(), wc.qp_num()),
        (them.qpn, me.qpn),
        "UD target: src_qp, qp_num"
    );
    let got = buf.to_vec();
    if n.is_roce() {
        assert!(wc.wc_flags().contains(WcFlags::GRH), "UD target: {wc:?}");
        check_grh(&got, &wc, them.gid, me.gid, "UD target");
    }
    assert_eq!(
        compare(&got[GRH_LEN..GRH_LEN + 200], &pattern(256, 5)[..200]),
        "ok",
        "UD target: payload after the 40-byte GRH area"
    );

    // Reply the same way, to the initiator's endpoint.
    let ah = n.pd.create_ah(&n.av(&them)).unwrap();
    let src = n.mr(128);
    src.write_at(0, &pattern(128, 6)).unwrap();
    let s = [src.sge(0..100)];
    qp.post_send([signaled(
        SendWr::new(1, SendOp::Send, &s).ud(&ah, them.qpn, their_qkey),
    )])
    .unwrap();
    let sc = poll_n(&n.cq, 1, "UD target: the reply's send completion")[0];
    assert_eq!(
        (sc.status(), sc.opcode()),
        (WcStatus::Success, WcOpcode::Send),
        "{sc:?}"
    );
    p.send("replied");
});

#[test]
fn ud_send_between_processes_through_an_address_handle_lands_after_a_grh_both_ways() {
    let mut t = Peer::spawn("ud_uc::peer_ud_target");
    let m = t.expect("target");
    let (them, their_qkey): (Endpoint, u32) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.qp(QpType::Ud);
    qp.ready_ud(INITIATOR_QKEY, 0).unwrap();
    let me = qp.endpoint(0).unwrap();
    let back = n.mr(GRH_LEN + 128);
    qp.post_recv([RecvWr::new(7, &[back.sge(0..GRH_LEN + 128)])])
        .unwrap();
    let ah = n.pd.create_ah(&n.av(&them)).unwrap();
    let src = n.mr(256);
    src.write_at(0, &pattern(256, 5)).unwrap();
    let s = [src.sge(0..200)];
    qp.post_send([signaled(
        SendWr::new(1, SendOp::SendWithImm { imm: 5 }, &s).ud(&ah, them.qpn, their_qkey),
    )])
    .unwrap();
    let sc = poll_n(&n.cq, 1, "UD initiator: send completion")[0];
    assert_eq!(
        (sc.wr_id(), sc.status(), sc.opcode()),
        (1, WcStatus::Success, WcOpcode::Send)
    );
    t.send(msg!("sent", me, INITIATOR_QKEY));
    t.expect("replied");

    let wc = poll_n(&n.cq, 1, "UD initiator: the reply")[0];
    assert_eq!(
        (
            wc.wr_id(),
            wc.status(),
            wc.opcode(),
            wc.byte_len(),
            wc.imm_data()
        ),
        (
            7,
            WcStatus::Success,
            WcOpcode::Recv,
            GRH_LEN as u32 + 100,
            None
        ),
        "UD initiator: the reply: {wc:?}"
    );
    assert_eq!(
        (wc.src_qp(), wc.qp_num()),
        (them.qpn, me.qpn),
        "src_qp, qp_num"
    );
    let got = back.to_vec();
    if n.is_roce() {
        assert!(wc.wc_flags().contains(WcFlags::GRH), "{wc:?}");
        check_grh(&got, &wc, them.gid, me.gid, "UD initiator");
    }
    assert_eq!(
        compare(&got[GRH_LEN..GRH_LEN + 100], &pattern(128, 6)[..100]),
        "ok",
        "UD initiator: reply payload"
    );
    t.finish();
}

peer!(peer_uc_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Uc);
    let dst = n.mr(4096);
    let rbuf = n.mr(1024);
    p.send(msg!(
        "target",
        qp.endpoint(300).unwrap(),
        RemoteMr::of(&dst)
    ));
    let init: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.post_recv([RecvWr::new(21, &[]), RecvWr::new(22, &[rbuf.sge(0..1024)])])
        .unwrap();
    qp.to_rtr(&init).unwrap();
    qp.to_rts(300).unwrap();
    p.send("ready");

    let wc = poll_n(&n.cq, 2, "UC target: receive completions");
    assert_all_ok(&wc, "UC target: receive completions");
    let got = recv_summary(&wc);
    assert_eq!(
        got,
        vec![
            (21, WcOpcode::RecvRdmaWithImm, 10, Some(1), init.qpn),
            (22, WcOpcode::Recv, 300, None, init.qpn),
        ],
        "UC target: (wr_id, opcode, byte_len, imm, src_qp)"
    );
    let data = pattern(1024, 11);
    let d = dst.to_vec();
    p.send(msg!("check", "write", compare(&d[..1024], &data)));
    p.send(msg!(
        "check",
        "untouched",
        compare(&d[1024..2048], &[0; 1024])
    ));
    p.send(msg!(
        "check",
        "write-with-imm",
        compare(&d[2048..2058], &data[..10])
    ));
    p.send(msg!(
        "check",
        "send",
        compare(&rbuf.to_vec()[..300], &data[100..400])
    ));
    p.send("checked");
});

#[test]
fn uc_write_write_with_imm_and_send_between_processes() {
    let mut t = Peer::spawn("ud_uc::peer_uc_target");
    let m = t.expect("target");
    let (tep, dst): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.qp(QpType::Uc);
    qp.connect(&tep, 400, ALL_REMOTE).unwrap();
    t.send(msg!("initiator", qp.endpoint(400).unwrap()));
    t.expect("ready");
    let src = n.mr(1024);
    src.write_at(0, &pattern(1024, 11)).unwrap();
    let all = [src.sge(0..1024)];
    let ten = [src.sge(0..10)];
    let mid = [src.sge(100..400)];
    qp.post_send([
        signaled(SendWr::new(
            1,
            SendOp::RdmaWrite {
                remote_addr: dst.iova,
                rkey: dst.rkey,
            },
            &all,
        )),
        signaled(SendWr::new(
            2,
            SendOp::RdmaWriteWithImm {
                remote_addr: dst.iova + 2048,
                rkey: dst.rkey,
                imm: 1,
            },
            &ten,
        )),
        signaled(SendWr::new(3, SendOp::Send, &mid)),
    ])
    .unwrap();
    let wc = poll_n(&n.cq, 3, "UC initiator: send completions");
    let got: Vec<_> = wc
        .iter()
        .map(|w| (w.wr_id(), w.status(), w.opcode()))
        .collect();
    let ok = WcStatus::Success;
    assert_eq!(
        got,
        vec![
            (1, ok, WcOpcode::RdmaWrite),
            (2, ok, WcOpcode::RdmaWrite),
            (3, ok, WcOpcode::Send)
        ]
    );
    t.expect_checks("UC target memory");
    t.finish();
}
