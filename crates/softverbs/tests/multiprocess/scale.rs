//! The object counts real applications use: thousands of RC QPs in one process under the
//! default descriptor limit (`ulimit -n` 1024), each connected to its own QP in a second
//! process (which holds as many under the same limit), and a WRITE through every one of them
//! landing where it should.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, exclusive, msg, peer};
use softverbs::*;
use std::time::{Duration, Instant};

/// QPs on each side in the suite; [`sixty_five_thousand_qps_each_carry_a_write`] runs the
/// full count.
const SUITE_QPS: usize = 4096;

/// The soft limit a login shell gives: what a program that does not raise it lives with.
fn limit_descriptors_to_1024() {
    let mut lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    lim.current = Some(1024);
    rustix::process::setrlimit(rustix::process::Resource::Nofile, lim)
        .expect("setrlimit(RLIMIT_NOFILE, 1024)");
}

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Small queues, as an application with a QP per peer sizes them.
fn small_qp(pd: &ProtectionDomain, cq: &CompletionQueue) -> QueuePair {
    let mut attr = QpInitAttr::new(QpType::Rc, cq, cq);
    attr.cap.max_send_wr = 4;
    attr.cap.max_recv_wr = 1;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    attr.cap.max_inline_data = 16;
    pd.create_qp(&attr).expect("create_qp")
}

/// The value the WRITE through QP pair `i` carries.
fn marker(i: usize) -> u64 {
    0x5ca1_e000_0000_0000 | i as u64
}

fn qpns(qps: &[QueuePair]) -> String {
    qps.iter()
        .map(|q| format!("{:x}", q.qp_num()))
        .collect::<Vec<_>>()
        .join(",")
}

fn parse_qpns(s: &str) -> Vec<u32> {
    s.split(',')
        .map(|t| u32::from_str_radix(t, 16).expect("QP number"))
        .collect()
}

/// The QPs of one side, created and timed; `(qps, µs per QP)`.
fn create(n: &Node, cq: &CompletionQueue, count: usize) -> (Vec<QueuePair>, f64) {
    let t = Instant::now();
    let qps: Vec<QueuePair> = (0..count).map(|_| small_qp(&n.pd, cq)).collect();
    let us = t.elapsed().as_secs_f64() * 1e6 / count as f64;
    (qps, us)
}

fn connect_all(qps: &[QueuePair], to: &Endpoint, qpns: &[u32]) {
    assert_eq!(qps.len(), qpns.len(), "one peer QP per QP");
    for (q, &qpn) in qps.iter().zip(qpns) {
        q.connect(&Endpoint { qpn, ..*to }, 0, ALL_REMOTE)
            .expect("connect");
    }
}

peer!(peer_many_targets, |p| {
    limit_descriptors_to_1024();
    let count: usize = p.expect("count").get(0);
    let n = node();
    let cq = n.ctx.create_cq(16, None).expect("create_cq");
    let (qps, _) = create(&n, &cq, count);
    let buf = n.mr(count * 8);
    p.send(msg!(
        "targets",
        qps[0].endpoint(0).unwrap(),
        RemoteMr::of(&buf),
        qpns(&qps)
    ));
    let m = p.expect("initiators");
    connect_all(&qps, &m.get(0), &parse_qpns(&m.get::<String>(1)));
    p.send(msg!("ready", open_descriptors()));

    p.expect("check");
    let wrong: Vec<usize> = (0..count)
        .filter(|&i| buf.load_u64(i * 8).unwrap() != marker(i))
        .collect();
    let verdict = match wrong.first() {
        None => "ok".to_string(),
        Some(&i) => format!(
            "{}-slots-wrong-first-{i}-holds-{:#x}",
            wrong.len(),
            buf.load_u64(i * 8).unwrap()
        ),
    };
    p.send(msg!("checked", verdict, open_descriptors()));
    p.expect("bye");
});

/// `count` QPs here and `count` in a peer process, both under `ulimit -n` 1024, pairwise
/// connected; a WRITE through every one lands in its own slot of the peer's buffer.
fn qps_each_carry_a_write(count: usize) {
    let _alone = exclusive();
    let mut t = Peer::spawn("scale::peer_many_targets");
    t.send(msg!("count", count));
    let m = t.expect_within("targets", Duration::from_secs(600));
    let (tep, buf, their): (Endpoint, RemoteMr, String) = (m.get(0), m.get(1), m.get(2));
    let their = parse_qpns(&their);

    // This process too lives with the default limit from here on.
    limit_descriptors_to_1024();
    let n = node();
    let cq = n.ctx.create_cq(count as u32, None).expect("create_cq");
    let (qps, us_per_qp) = create(&n, &cq, count);
    connect_all(&qps, &tep, &their);
    t.send(msg!("initiators", qps[0].endpoint(0).unwrap(), qpns(&qps)));
    let their_fds: usize = t.expect_within("ready", Duration::from_secs(600)).get(0);

    let values: Vec<[u8; 8]> = (0..count).map(|i| marker(i).to_ne_bytes()).collect();
    let started = Instant::now();
    for (i, q) in qps.iter().enumerate() {
        let op = SendOp::RdmaWrite {
            remote_addr: buf.iova + i as u64 * 8,
            rkey: buf.rkey,
        };
        q.post_send([signaled(SendWr::inline(i as u64, op, &values[i]))])
            .unwrap();
    }
    let wcs = poll_n_within(
        &cq,
        count,
        "a WRITE completion from every QP",
        Duration::from_secs(120),
    );
    let writes = started.elapsed();
    let failed: Vec<&WorkCompletion> = wcs.iter().filter(|w| !w.is_ok()).collect();
    assert!(
        failed.is_empty(),
        "{} WRITEs failed, the first: {:?}",
        failed.len(),
        failed.iter().take(4).collect::<Vec<_>>()
    );
    let mut done = vec![false; count];
    for w in &wcs {
        done[w.wr_id() as usize] = true;
    }
    assert!(done.iter().all(|&d| d), "every QP completed its WRITE");
    t.send("check");
    let m = t.expect_within("checked", Duration::from_secs(120));
    let (verdict, their_fds_after): (String, usize) = (m.get(0), m.get(1));
    assert_eq!(verdict, "ok", "the peer's buffer after one WRITE per QP");
    let ours = open_descriptors();
    eprintln!(
        "{count} QPs a side: creation {us_per_qp:.1} µs/QP here; {:.2} µs/WRITE over all \
         QPs; descriptors open: {ours} here, {their_fds}/{their_fds_after} in the peer",
        writes.as_secs_f64() * 1e6 / count as f64
    );
    assert!(
        ours < 1024 && their_fds < 1024,
        "both sides fit the default limit"
    );
    t.send("bye");
    t.finish();
}

#[test]
fn four_thousand_qps_under_the_default_descriptor_limit_each_carry_a_write() {
    qps_each_carry_a_write(SUITE_QPS);
}

/// The full count (65,536 QPs a side, the device's `max_qp`); run by hand:
/// `cargo test --test multiprocess -- --ignored sixty_five`.
#[test]
#[ignore = "65,536 QPs a side: about 10 s and 300 MB a process"]
fn sixty_five_thousand_qps_each_carry_a_write() {
    qps_each_carry_a_write(65536);
}
