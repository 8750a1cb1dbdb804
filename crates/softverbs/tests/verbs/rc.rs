//! Every opcode on an RC QP.

use crate::common::*;
use softverbs::*;

#[test]
fn send_and_send_with_imm_land_in_posted_receives() {
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    let data = pattern(4096, 7);
    src.write_at(0, &data).unwrap();
    p.b.post_recv([
        RecvWr::new(10, &[dst.sge(0..2048)]),
        RecvWr::new(11, &[dst.sge(2048..4096)]),
    ])
    .unwrap();
    let s1 = [src.sge(0..1000)];
    let s2 = [src.sge(1000..3000)];
    p.a.post_send([
        signaled(SendWr::new(1, SendOp::Send, &s1).flags(SendFlags::SOLICITED)),
        signaled(SendWr::new(
            2,
            SendOp::SendWithImm { imm: 0xdead_beef },
            &s2,
        )),
    ])
    .unwrap();
    let sc = poll_n(&p.cq_a, 2);
    assert_eq!(
        (sc[0].wr_id(), sc[0].status(), sc[0].opcode()),
        (1, WcStatus::Success, WcOpcode::Send)
    );
    assert_eq!((sc[1].wr_id(), sc[1].opcode()), (2, WcOpcode::Send));
    let rc = poll_n(&p.cq_b, 2);
    assert_eq!(
        (rc[0].wr_id(), rc[0].opcode(), rc[0].byte_len()),
        (10, WcOpcode::Recv, 1000)
    );
    assert_eq!(rc[0].imm_data(), None);
    assert_eq!(rc[0].src_qp(), p.a.qp_num());
    assert_eq!(rc[0].qp_num(), p.b.qp_num());
    assert_eq!((rc[1].wr_id(), rc[1].byte_len()), (11, 2000));
    assert_eq!(rc[1].imm_data(), Some(0xdead_beef));
    assert!(rc[1].wc_flags().contains(WcFlags::WITH_IMM));
    let got = dst.to_vec();
    assert_eq!(&got[..1000], &data[..1000]);
    assert_eq!(&got[2048..4048], &data[1000..3000]);
    assert!(
        got[1000..2048].iter().all(|&b| b == 0),
        "bytes past the message untouched"
    );
}

#[test]
fn send_gathers_sges_and_scatters_into_receive_sges() {
    let p = pair(QpType::Rc);
    let a1 = p.pd.alloc_mr(100, ALL_REMOTE).unwrap();
    let a2 = p.pd.alloc_mr(100, ALL_REMOTE).unwrap();
    let b1 = p.pd.alloc_mr(100, ALL_REMOTE).unwrap();
    let b2 = p.pd.alloc_mr(100, ALL_REMOTE).unwrap();
    a1.write_at(0, &pattern(100, 1)).unwrap();
    a2.write_at(0, &pattern(100, 2)).unwrap();
    p.b.post_recv([RecvWr::new(
        1,
        &[b1.sge(0..30), b2.sge(50..100), b1.sge(60..100)],
    )])
    .unwrap();
    let sges = [a1.sge(10..50), a2.sge(0..60)];
    p.a.post_send([signaled(SendWr::new(1, SendOp::Send, &sges))])
        .unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    let wc = poll_n(&p.cq_b, 1)[0];
    assert_eq!(wc.byte_len(), 100);
    let mut msg = pattern(100, 1)[10..50].to_vec();
    msg.extend_from_slice(&pattern(100, 2)[..60]);
    let (b1v, b2v) = (b1.to_vec(), b2.to_vec());
    assert_eq!(&b1v[..30], &msg[..30]);
    assert_eq!(&b2v[50..100], &msg[30..80]);
    assert_eq!(&b1v[60..80], &msg[80..100]);
    assert!(b1v[80..].iter().all(|&b| b == 0));
}

#[test]
fn inline_send_copies_at_post_time() {
    let p = pair(QpType::Rc);
    let dst = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    p.b.post_recv([RecvWr::new(1, &[dst.sge(0..64)])]).unwrap();
    let mut payload = *b"inline bytes";
    p.a.post_send([signaled(SendWr::inline(5, SendOp::Send, &payload))])
        .unwrap();
    payload.fill(0);
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    assert_eq!(poll_n(&p.cq_b, 1)[0].byte_len(), 12);
    assert_eq!(&dst.to_vec()[..12], b"inline bytes");
    // Longer than the QP's max_inline_data is rejected at post.
    let big = vec![0u8; p.a.cap().max_inline_data as usize + 1];
    let err =
        p.a.post_send([SendWr::inline(6, SendOp::Send, &big)])
            .unwrap_err();
    assert_eq!((err.index, err.error.errno()), (0, 22));
}

#[test]
fn rdma_write_and_write_with_imm() {
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(8192, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(8192, ALL_REMOTE).unwrap();
    let data = pattern(8192, 3);
    src.write_at(0, &data).unwrap();
    let s = [src.sge(0..5000)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: dst.iova() + 100,
            rkey: dst.rkey(),
        },
        &s,
    ))])
    .unwrap();
    let wc = poll_n(&p.cq_a, 1)[0];
    assert_eq!(
        (wc.status(), wc.opcode()),
        (WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert_eq!(&dst.to_vec()[100..5100], &data[..5000]);
    // A plain WRITE consumes no receive and makes no receive completion.
    assert_empty(&p.cq_b);

    p.b.post_recv([RecvWr::new(77, &[])]).unwrap();
    let s = [src.sge(5000..8192)];
    p.a.post_send([signaled(SendWr::new(
        2,
        SendOp::RdmaWriteWithImm {
            remote_addr: dst.iova(),
            rkey: dst.rkey(),
            imm: 99,
        },
        &s,
    ))])
    .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].opcode(), WcOpcode::RdmaWrite);
    let rc = poll_n(&p.cq_b, 1)[0];
    assert_eq!(
        (rc.wr_id(), rc.opcode(), rc.byte_len(), rc.imm_data()),
        (77, WcOpcode::RecvRdmaWithImm, 3192, Some(99))
    );
    assert_eq!(&dst.to_vec()[..3192], &data[5000..]);
}

#[test]
fn rdma_read_into_local_sges() {
    let p = pair(QpType::Rc);
    let remote = p.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    let local = p.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    let data = pattern(4096, 9);
    remote.write_at(0, &data).unwrap();
    let s = [local.sge(0..100), local.sge(1000..1900)];
    p.a.post_send([signaled(SendWr::new(
        4,
        SendOp::RdmaRead {
            remote_addr: remote.iova() + 10,
            rkey: remote.rkey(),
        },
        &s,
    ))])
    .unwrap();
    let wc = poll_n(&p.cq_a, 1)[0];
    assert_eq!(
        (wc.status(), wc.opcode(), wc.byte_len()),
        (WcStatus::Success, WcOpcode::RdmaRead, 1000)
    );
    let l = local.to_vec();
    assert_eq!(&l[..100], &data[10..110]);
    assert_eq!(&l[1000..1900], &data[110..1010]);
}

#[test]
fn atomics_return_the_original_value() {
    let p = pair(QpType::Rc);
    let remote = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let local = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    remote.store_u64(8, 40).unwrap();
    let s = [local.sge(0..8)];
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::FetchAdd {
            remote_addr: remote.iova() + 8,
            rkey: remote.rkey(),
            add: 2,
        },
        &s,
    ))])
    .unwrap();
    let wc = poll_n(&p.cq_a, 1)[0];
    assert_eq!((wc.opcode(), wc.byte_len()), (WcOpcode::FetchAdd, 8));
    assert_eq!(local.load_u64(0).unwrap(), 40);
    assert_eq!(remote.load_u64(8).unwrap(), 42);

    let cas = |id, compare, swap| {
        SendWr::new(
            id,
            SendOp::CmpSwap {
                remote_addr: remote.iova() + 8,
                rkey: remote.rkey(),
                compare,
                swap,
            },
            &s,
        )
    };
    p.a.post_send([signaled(cas(2, 41, 7))]).unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].opcode(), WcOpcode::CompSwap);
    assert_eq!(
        local.load_u64(0).unwrap(),
        42,
        "failed compare returns the current value"
    );
    assert_eq!(remote.load_u64(8).unwrap(), 42);
    p.a.post_send([signaled(cas(3, 42, 7))]).unwrap();
    poll_n(&p.cq_a, 1);
    assert_eq!(local.load_u64(0).unwrap(), 42);
    assert_eq!(remote.load_u64(8).unwrap(), 7);

    // Atomics need 8 local bytes and an aligned remote address.
    let short = [local.sge(0..4)];
    let e = p.a.post_send([SendWr::new(
        4,
        SendOp::FetchAdd {
            remote_addr: remote.iova(),
            rkey: remote.rkey(),
            add: 1,
        },
        &short,
    )]);
    assert_eq!(e.unwrap_err().error.errno(), 22);
    let e = p.a.post_send([SendWr::new(
        4,
        SendOp::FetchAdd {
            remote_addr: remote.iova() + 4,
            rkey: remote.rkey(),
            add: 1,
        },
        &s,
    )]);
    assert_eq!(e.unwrap_err().error.errno(), 22);
}

#[test]
fn unsignaled_requests_complete_silently_and_sq_sig_all_signals_everything() {
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let s = [src.sge(0..8)];
    let w = |id| {
        SendWr::new(
            id,
            SendOp::RdmaWrite {
                remote_addr: dst.iova(),
                rkey: dst.rkey(),
            },
            &s,
        )
    };
    p.a.post_send([w(1), w(2), signaled(w(3))]).unwrap();
    let wc = poll_n(&p.cq_a, 1);
    assert_eq!(wc[0].wr_id(), 3);
    assert_empty(&p.cq_a);

    let cq = p.ctx.create_cq(16, None).unwrap();
    let mut init = QpInitAttr::rc(&cq, &cq);
    init.sq_sig_all = true;
    let x = p.pd.create_qp(&init).unwrap();
    let y = p.pd.create_qp(&init).unwrap();
    x.connect(&y.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    y.connect(&x.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    x.post_send([w(1), w(2)]).unwrap();
    let wc = poll_n(&cq, 2);
    assert_eq!((wc[0].wr_id(), wc[1].wr_id()), (1, 2));
}

#[test]
fn send_queue_slots_free_when_completions_are_polled() {
    let p = pair_with(QpType::Rc, |c| c.max_send_wr = 4);
    assert_eq!(p.a.cap().max_send_wr, 4);
    let src = p.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    let s = [src.sge(0..8)];
    let w = |id| {
        signaled(SendWr::new(
            id,
            SendOp::RdmaWrite {
                remote_addr: dst.iova(),
                rkey: dst.rkey(),
            },
            &s,
        ))
    };
    p.a.post_send((0..4).map(w)).unwrap();
    let err = p.a.post_send([w(4), w(5)]).unwrap_err();
    assert_eq!(
        (err.index, err.error.errno()),
        (0, 12),
        "ENOMEM while 4 are outstanding"
    );
    poll_n(&p.cq_a, 2);
    p.a.post_send([w(4), w(5)]).unwrap();
    let err = p.a.post_send([w(6)]).unwrap_err();
    assert_eq!(err.error.errno(), 12);
    poll_n(&p.cq_a, 4);
    p.a.post_send([w(6)]).unwrap();
}

#[test]
fn fence_and_ordering_of_a_mixed_batch() {
    // READ then a fenced WRITE of what was read: executes in order on the same QP.
    let p = pair(QpType::Rc);
    let remote = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let local = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    remote.write_at(0, b"0123456789abcdef").unwrap();
    let rd = [local.sge(0..16)];
    p.a.post_send([
        SendWr::new(
            1,
            SendOp::RdmaRead {
                remote_addr: remote.iova(),
                rkey: remote.rkey(),
            },
            &rd,
        ),
        signaled(SendWr::new(
            2,
            SendOp::RdmaWrite {
                remote_addr: remote.iova() + 32,
                rkey: remote.rkey(),
            },
            &rd,
        ))
        .flags(SendFlags::FENCE),
    ])
    .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].wr_id(), 2);
    assert_eq!(&remote.to_vec()[32..48], b"0123456789abcdef");
}
