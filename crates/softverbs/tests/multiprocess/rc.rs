//! Every RC opcode between two processes, with data and completions checked on both sides.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;

const IMM_SEND: u32 = 0xdead_beef;
const IMM_WRITE: u32 = 99;
const SWAPPED: u64 = 0x1234_5678_9abc;

// The target: receives two SENDs and a WRITE_WITH_IMM, is written, read and updated by
// atomics, and checks everything itself once the initiator says it is done.
peer!(peer_rc_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let recv = n.mr(4096);
    let wdst = n.mr(8192);
    let rsrc = n.mr(4096);
    let atom = n.mr(64);
    rsrc.write_at(0, &pattern(4096, 9)).unwrap();
    atom.store_u64(0, 40).unwrap();
    atom.store_u64(8, 7).unwrap();
    p.send(msg!(
        "target",
        qp.endpoint(100).unwrap(),
        RemoteMr::of(&wdst),
        RemoteMr::of(&rsrc),
        RemoteMr::of(&atom)
    ));
    let init: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.post_recv([
        RecvWr::new(10, &[recv.sge(0..2048)]),
        RecvWr::new(11, &[recv.sge(2048..4096)]),
        RecvWr::new(12, &[]),
    ])
    .unwrap();
    qp.to_rtr(&init).unwrap();
    qp.to_rts(100).unwrap();
    p.send("ready");

    let wc = poll_n(&n.cq, 3, "target: receive completions");
    assert_all_ok(&wc, "target: receive completions");
    let got: Vec<_> = wc
        .iter()
        .map(|w| {
            (
                w.wr_id(),
                w.opcode(),
                w.byte_len(),
                w.imm_data(),
                w.src_qp(),
                w.qp_num(),
            )
        })
        .collect();
    let (me, them) = (qp.qp_num(), init.qpn);
    assert_eq!(
        got,
        vec![
            (10, WcOpcode::Recv, 1000, None, them, me),
            (11, WcOpcode::Recv, 2000, Some(IMM_SEND), them, me),
            (
                12,
                WcOpcode::RecvRdmaWithImm,
                3000,
                Some(IMM_WRITE),
                them,
                me
            ),
        ],
        "target: (wr_id, opcode, byte_len, imm, src_qp, qp_num) of the receives"
    );
    assert!(wc[1].wc_flags().contains(WcFlags::WITH_IMM), "{:?}", wc[1]);
    assert!(wc[2].wc_flags().contains(WcFlags::WITH_IMM), "{:?}", wc[2]);

    p.expect("done");
    let data = pattern(8192, 3);
    let r = recv.to_vec();
    let w = wdst.to_vec();
    let checks = [
        ("send", compare(&r[..1000], &data[..1000])),
        ("send-tail-untouched", compare(&r[1000..2048], &[0; 1048])),
        ("send-with-imm", compare(&r[2048..4048], &data[1000..3000])),
        ("write-head-untouched", compare(&w[..100], &[0; 100])),
        ("write", compare(&w[100..5100], &data[..5000])),
        ("gap-untouched", compare(&w[5100..5192], &[0; 92])),
        ("write-with-imm", compare(&w[5192..], &data[5000..8000])),
        (
            "read-source-unchanged",
            compare(&rsrc.to_vec(), &pattern(4096, 9)),
        ),
        (
            "fetch-add",
            compare(
                &atom.load_u64(0).unwrap().to_le_bytes(),
                &42u64.to_le_bytes(),
            ),
        ),
        (
            "cmp-swap",
            compare(
                &atom.load_u64(8).unwrap().to_le_bytes(),
                &SWAPPED.to_le_bytes(),
            ),
        ),
    ];
    for (what, verdict) in checks {
        p.send(msg!("check", what, verdict));
    }
    assert_no_completion(&n.cq, "target: WRITE, READ and atomics");
    p.send("checked");
});

#[test]
fn rc_every_opcode_between_two_processes_moves_the_data_and_completes_on_both_sides() {
    let mut t = Peer::spawn("rc::peer_rc_target");
    let m = t.expect("target");
    let (tep, wdst, rsrc, atom): (Endpoint, RemoteMr, RemoteMr, RemoteMr) =
        (m.get(0), m.get(1), m.get(2), m.get(3));
    let n = node();
    let qp = n.qp(QpType::Rc);
    qp.connect(&tep, 200, ALL_REMOTE).unwrap();
    t.send(msg!("initiator", qp.endpoint(200).unwrap()));
    t.expect("ready");

    let src = n.mr(8192);
    let data = pattern(8192, 3);
    src.write_at(0, &data).unwrap();
    let local = n.mr(4096);
    let s_send = [src.sge(0..1000)];
    let s_imm = [src.sge(1000..3000)];
    let s_write = [src.sge(0..5000)];
    let s_wimm = [src.sge(5000..8000)];
    let s_read = [local.sge(0..100), local.sge(1000..1900)];
    let s_fadd = [local.sge(2048..2056)];
    let s_cas = [local.sge(2056..2064)];
    let s_cas2 = [local.sge(2064..2072)];
    qp.post_send([
        signaled(SendWr::new(1, SendOp::Send, &s_send).flags(SendFlags::SOLICITED)),
        signaled(SendWr::new(
            2,
            SendOp::SendWithImm { imm: IMM_SEND },
            &s_imm,
        )),
        signaled(SendWr::new(
            3,
            SendOp::RdmaWrite {
                remote_addr: wdst.iova + 100,
                rkey: wdst.rkey,
            },
            &s_write,
        )),
        signaled(SendWr::new(
            4,
            SendOp::RdmaWriteWithImm {
                remote_addr: wdst.iova + 5192,
                rkey: wdst.rkey,
                imm: IMM_WRITE,
            },
            &s_wimm,
        )),
        signaled(SendWr::new(
            5,
            SendOp::RdmaRead {
                remote_addr: rsrc.iova + 10,
                rkey: rsrc.rkey,
            },
            &s_read,
        )),
        signaled(SendWr::new(
            6,
            SendOp::FetchAdd {
                remote_addr: atom.iova,
                rkey: atom.rkey,
                add: 2,
            },
            &s_fadd,
        )),
        signaled(SendWr::new(
            7,
            SendOp::CmpSwap {
                remote_addr: atom.iova + 8,
                rkey: atom.rkey,
                compare: 7,
                swap: SWAPPED,
            },
            &s_cas,
        )),
        // Fails to compare (the word is SWAPPED by now): returns the current value.
        signaled(SendWr::new(
            8,
            SendOp::CmpSwap {
                remote_addr: atom.iova + 8,
                rkey: atom.rkey,
                compare: 7,
                swap: 1,
            },
            &s_cas2,
        )),
    ])
    .unwrap();
    let wc = poll_n(&n.cq, 8, "initiator: send completions");
    let got: Vec<_> = wc
        .iter()
        .map(|w| (w.wr_id(), w.status(), w.opcode(), w.qp_num()))
        .collect();
    let q = qp.qp_num();
    let ok = WcStatus::Success;
    assert_eq!(
        got,
        vec![
            (1, ok, WcOpcode::Send, q),
            (2, ok, WcOpcode::Send, q),
            (3, ok, WcOpcode::RdmaWrite, q),
            (4, ok, WcOpcode::RdmaWrite, q),
            (5, ok, WcOpcode::RdmaRead, q),
            (6, ok, WcOpcode::FetchAdd, q),
            (7, ok, WcOpcode::CompSwap, q),
            (8, ok, WcOpcode::CompSwap, q),
        ],
        "initiator: (wr_id, status, opcode, qp_num) of the sends:\n{wc:?}"
    );
    assert_eq!(wc[4].byte_len(), 1000, "READ byte_len");
    assert_eq!(
        (wc[5].byte_len(), wc[6].byte_len(), wc[7].byte_len()),
        (8, 8, 8),
        "atomics byte_len"
    );
    let l = local.to_vec();
    let remote = pattern(4096, 9);
    assert_eq!(
        compare(&l[..100], &remote[10..110]),
        "ok",
        "READ, first SGE"
    );
    assert_eq!(
        compare(&l[1000..1900], &remote[110..1010]),
        "ok",
        "READ, second SGE"
    );
    assert_eq!(
        local.load_u64(2048).unwrap(),
        40,
        "FETCH_AND_ADD returns the old value"
    );
    assert_eq!(
        local.load_u64(2056).unwrap(),
        7,
        "CMP_AND_SWP returns the old value"
    );
    assert_eq!(
        local.load_u64(2064).unwrap(),
        SWAPPED,
        "a failed CMP_AND_SWP returns the current value"
    );
    assert_no_completion(&n.cq, "initiator: nothing more");

    t.send("done");
    t.expect_checks("target memory");
    t.finish();
}

// Plain process memory (a Vec registered with reg_mr, not alloc_mr's shared memory): the
// initiator reaches it another way (cross-memory attach), and must still place the bytes.
peer!(peer_plain_memory_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let mut buf = vec![0u8; 8192];
    buf[4096..].copy_from_slice(&pattern(4096, 13));
    let mr = n.pd.reg_mr(&mut buf, ALL_REMOTE).unwrap();
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mr)));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.connect(&them, 0, ALL_REMOTE).unwrap();
    p.send("ready");
    p.expect("check");
    let got = mr.to_vec();
    p.send(msg!(
        "check",
        "write",
        compare(&got[..4096], &pattern(4096, 14))
    ));
    p.send(msg!(
        "check",
        "read-source-unchanged",
        compare(&got[4096..], &pattern(4096, 13))
    ));
    p.send("checked");
});

#[test]
fn rc_write_and_read_reach_plain_memory_registered_with_reg_mr_in_the_target_process() {
    let mut t = Peer::spawn("rc::peer_plain_memory_target");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let local = n.mr(8192);
    local.write_at(0, &pattern(4096, 14)).unwrap();
    let (w, r) = ([local.sge(0..4096)], [local.sge(4096..8192)]);
    qp.post_send([
        signaled(SendWr::new(
            1,
            SendOp::RdmaWrite {
                remote_addr: mem.iova,
                rkey: mem.rkey,
            },
            &w,
        )),
        signaled(SendWr::new(
            2,
            SendOp::RdmaRead {
                remote_addr: mem.iova + 4096,
                rkey: mem.rkey,
            },
            &r,
        )),
    ])
    .unwrap();
    let wc = poll_n(&n.cq, 2, "WRITE and READ on plain memory");
    assert_all_ok(&wc, "WRITE and READ on plain memory");
    assert_eq!(
        compare(&local.to_vec()[4096..], &pattern(4096, 13)),
        "ok",
        "READ from plain memory"
    );
    t.send("check");
    t.expect_checks("the target's plain memory");
    t.finish();
}
