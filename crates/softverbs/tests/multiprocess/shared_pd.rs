//! Shared PDs: another process imports this one's context through its command descriptor,
//! then a PD and its regions, and its QPs in that PD move this process's bytes.

use crate::common::*;
use crate::harness::{Peer, msg, peer};
use softverbs::*;
use std::os::fd::AsFd;

// Imports the parent's context (its cmd_fd, reopened through /proc as SCM_RIGHTS would pass
// it), PD and two regions (one in a memfd, one plain memory), and sends from them.
peer!(peer_shared_pd_importer, |p| {
    let m = p.expect("export");
    let (pid, fd, handle): (u32, i32, u32) = (m.get(0), m.get(1), m.get(2));
    let (shm_key, plain_key, foreign_key): (u32, u32, u32) = (m.get(3), m.get(4), m.get(5));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/fd/{fd}"))
        .unwrap();
    let ctx = Context::import(file.as_fd()).unwrap();
    assert!(matches!(
        ctx.import_pd(handle + 1000),
        Err(Error::NotFound(_))
    ));
    let pd = ctx.import_pd(handle).unwrap();
    let shm = pd.import_mr(shm_key).unwrap();
    let plain = pd.import_mr(plain_key).unwrap();
    assert_eq!((shm.len(), plain.len()), (4096, 4096));
    assert!(
        matches!(pd.import_mr(foreign_key), Err(Error::NotFound(_))),
        "a region of another PD"
    );
    assert!(
        matches!(
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE),
            Err(Error::Unsupported(_))
        ),
        "registering in an imported PD"
    );
    let cq = ctx.create_cq(16, None).unwrap();
    let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    p.send(msg!("qp", qp.endpoint(3).unwrap()));
    let them: Endpoint = p.expect("connect").get(0);
    qp.connect(&them, 3, ALL_REMOTE).unwrap();
    p.send("ready");
    p.expect("go");
    // A SEND out of the memfd region, a WRITE out of the plain one into the memfd one at 2048.
    let write = SendOp::RdmaWrite {
        remote_addr: shm.iova() + 2048,
        rkey: shm.rkey(),
    };
    qp.post_send([
        signaled(SendWr::new(1, SendOp::Send, &[shm.sge(0..64)])),
        signaled(SendWr::new(2, write, &[plain.sge(0..64)])),
    ])
    .unwrap();
    assert_all_ok(&poll_n(&cq, 2, "importer: sends"), "importer: sends");
    p.send("sent");
    p.expect("done");
});

#[test]
fn another_process_imports_a_pd_and_its_qps_move_this_processs_bytes() {
    if crate::harness::between_hosts() {
        eprintln!(
            "skipped between hosts: a context is imported on its own host (the next test \
             covers an imported PD on a networked device)"
        );
        return;
    }
    let n = node();
    let shm = n.mr(4096);
    shm.write_at(0, &pattern(4096, 1)).unwrap();
    let mut plain_buf = pattern(4096, 2);
    let plain = n.pd.reg_mr(&mut plain_buf, ALL_REMOTE).unwrap();
    let other_pd = n.ctx.alloc_pd().unwrap();
    let foreign = other_pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let inbox = n.mr(4096);
    let qp = n.qp(QpType::Rc);

    let mut peer = Peer::spawn("shared_pd::peer_shared_pd_importer");
    use std::os::fd::AsRawFd;
    peer.send(msg!(
        "export",
        std::process::id(),
        n.ctx.cmd_fd().as_raw_fd(),
        n.pd.handle(),
        shm.lkey(),
        plain.lkey(),
        foreign.lkey()
    ));
    let there: Endpoint = peer.expect("qp").get(0);
    qp.connect(&there, 3, ALL_REMOTE).unwrap();
    qp.post_recv([RecvWr::new(9, &[inbox.sge(0..4096)])])
        .unwrap();
    peer.send(msg!("connect", qp.endpoint(3).unwrap()));
    peer.expect("ready");
    peer.send("go");
    peer.expect("sent");
    let wc = poll_n(&n.cq, 1, "exporter: the receive")[0];
    assert_eq!(
        (wc.status(), wc.byte_len()),
        (WcStatus::Success, 64),
        "{wc:?}"
    );
    assert_eq!(
        compare(&inbox.to_vec()[..64], &pattern(4096, 1)[..64]),
        "ok"
    );
    assert_eq!(
        compare(&shm.to_vec()[2048..2112], &pattern(4096, 2)[..64]),
        "ok",
        "the importer's WRITE from the plain region"
    );
    // And the other way: this process writes through the importer's QP, whose keys are
    // this process's, into its own region.
    let src = n.mr(64);
    src.write_at(0, b"through the importer's QP, into my own region......")
        .unwrap();
    let op = SendOp::RdmaWrite {
        remote_addr: shm.iova() + 3000,
        rkey: shm.rkey(),
    };
    qp.post_send([signaled(SendWr::new(5, op, &[src.sge(0..50)]))])
        .unwrap();
    assert_all_ok(&poll_n(&n.cq, 1, "exporter: write"), "exporter: write");
    assert_eq!(&shm.to_vec()[3000..3050], &src.to_vec()[..50]);
    peer.send("done");
    peer.finish();
    drop(plain);
}

// A plain peer (on this host, or on the other one between hosts): writes into the region
// its target names and receives one message.
peer!(peer_shared_pd_writer, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let inbox = n.mr(64);
    p.send(msg!("qp", qp.endpoint(7).unwrap()));
    let m = p.expect("target");
    let (them, va, rkey): (Endpoint, u64, u32) = (m.get(0), m.get(1), m.get(2));
    qp.connect(&them, 7, ALL_REMOTE).unwrap();
    qp.post_recv([RecvWr::new(1, &[inbox.sge(0..64)])]).unwrap();
    p.send("ready");
    let src = n.mr(64);
    src.write_at(0, &pattern(64, 7)).unwrap();
    let op = SendOp::RdmaWrite {
        remote_addr: va,
        rkey,
    };
    qp.post_send([signaled(SendWr::new(2, op, &[src.sge(0..64)]))])
        .unwrap();
    let wc = poll_n(&n.cq, 2, "writer: its write and the receive");
    assert_all_ok(&wc, "writer: its write and the receive");
    assert_eq!(compare(&inbox.to_vec(), &pattern(64, 3)), "ok");
    p.send("done");
});

#[test]
fn a_qp_in_a_pd_imported_in_this_process_serves_a_peer_with_the_exporters_region() {
    let n = node();
    let shm = n.mr(4096);
    shm.write_at(0, &pattern(64, 3)).unwrap();
    let ctx = Context::import(n.ctx.cmd_fd()).unwrap();
    let pd = ctx.import_pd(n.pd.handle()).unwrap();
    let region = pd.import_mr(shm.lkey()).unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let mut w = Peer::spawn("shared_pd::peer_shared_pd_writer");
    let them: Endpoint = w.expect("qp").get(0);
    qp.connect(&them, 7, ALL_REMOTE).unwrap();
    w.send(msg!(
        "target",
        qp.endpoint(7).unwrap(),
        region.iova() + 1024,
        region.rkey()
    ));
    w.expect("ready");
    qp.post_send([signaled(SendWr::new(1, SendOp::Send, &[region.sge(0..64)]))])
        .unwrap();
    assert_all_ok(
        &poll_n(&cq, 1, "the imported QP's send"),
        "imported QP's send",
    );
    w.expect("done");
    assert_eq!(compare(&shm.to_vec()[1024..1088], &pattern(64, 7)), "ok");
    w.finish();
}
