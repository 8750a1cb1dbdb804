//! The capture checker (`softverbs_cli::capture`) on a capture of a real RC exchange: the
//! simulator of `softverbs-roce` runs SENDs (one packet and many), RDMA WRITEs (with and
//! without immediate data), an RDMA READ, both atomics, a lost packet (a PSN sequence error
//! NAK and the retransmission), a missing receive (RNR NAKs) and a bad R_Key (a remote
//! access error NAK), and writes every datagram to a pcap file; tshark must dissect each as
//! RoCEv2 without a complaint, and scapy's ICRC must match each packet's. A flipped byte
//! must fail the ICRC check.
//!
//! Without tshark or python3-scapy the test is skipped with a message, except under
//! `CI=true`, where it fails.

use softverbs_cli::capture::{self, CaptureError, Verdict};
use softverbs_roce::endpoint::Endpoint;
use softverbs_roce::sim::{LinkConfig, Network, ScheduledFault};
use softverbs_roce::transport::*;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

const QA: u32 = 0x11;
const QB: u32 = 0x22;
const BUF: u64 = 0x1_0000;
const RECV: u64 = 0x10_0000;
const LEN: usize = 64 * 1024;

fn ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))
}

fn memory() -> MemoryModel {
    let mut m = MemoryModel::default();
    m.add(Region::new(1, 1, BUF, LEN));
    m.add(Region::new(1, 2, RECV, LEN));
    m
}

fn wr(id: u64, op: SendOp, len: u32) -> SendWr {
    let mut wr = SendWr::new(id, op);
    wr.sges = vec![Sge {
        addr: BUF,
        len,
        lkey: 1,
    }];
    wr
}

fn send(id: u64, len: u32) -> SendWr {
    wr(
        id,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        len,
    )
}

fn recv(id: u64) -> RecvWr {
    RecvWr {
        srq: 0,
        wr_id: id,
        sges: vec![Sge {
            addr: RECV,
            len: 8192,
            lkey: 2,
        }],
    }
}

/// The capture of an RC exchange with every kind of packet, as pcap bytes.
fn rc_exchange() -> Vec<u8> {
    let mut net = Network::new(3);
    net.set_default_link(LinkConfig {
        latency: Duration::from_micros(2),
        bandwidth: Some(1_250_000_000),
        ..LinkConfig::default()
    });
    let mut ea = Endpoint::new(ip(1), memory());
    let mut eb = Endpoint::new(ip(2), memory());
    for (e, me, them, peer) in [(&mut ea, QA, QB, ip(2)), (&mut eb, QB, QA, ip(1))] {
        let mut cfg = QpConfig::rc(me, (peer, them));
        cfg.min_rnr_timer = 1;
        cfg.timeout = 8;
        e.add_qp(cfg).expect("add QP");
    }
    let a = net.add_host(ip(1), ea);
    let b = net.add_host(ip(2), eb);
    net.capture(Vec::<u8>::new()).expect("start the capture");
    // The third datagram A sends (the middle of the 5000-byte SEND) is lost: B NAKs the
    // next one with a PSN sequence error and A goes back.
    net.add_fault(a, b, ScheduledFault::DropNth(2));
    let post = |net: &mut Network<Endpoint<MemoryModel>>, w: SendWr| {
        let now = net.now();
        net.host_mut(a)
            .with_qp(QA, |qp| qp.post_send(now, w))
            .expect("QP A")
            .expect("post");
    };
    let run = |net: &mut Network<Endpoint<MemoryModel>>| {
        let limit = net.now().after(Duration::from_secs(5));
        net.run_until_idle(limit).expect("run");
    };
    for i in 0..3 {
        net.host_mut(b).with_qp(QB, |qp| qp.post_recv(recv(i)));
    }
    post(&mut net, send(1, 100));
    post(&mut net, send(2, 5000));
    let write = |imm| SendOp::Write {
        va: BUF + 8192,
        rkey: 1,
        imm,
    };
    post(&mut net, wr(3, write(None), 5000));
    post(&mut net, wr(4, write(Some(0xfeed)), 16));
    let read = SendOp::Read {
        va: BUF + 20_000,
        rkey: 1,
    };
    post(&mut net, wr(5, read, 3000));
    let cas = SendOp::CompareSwap {
        va: BUF + 40_000,
        rkey: 1,
        compare: 0,
        swap: 7,
    };
    post(&mut net, wr(6, cas, 8));
    let faa = SendOp::FetchAdd {
        va: BUF + 40_000,
        rkey: 1,
        add: 5,
    };
    post(&mut net, wr(7, faa, 8));
    run(&mut net);
    // No receive posted: RNR NAKs until there is one.
    post(&mut net, send(8, 64));
    let t = net.now().after(Duration::from_micros(100));
    net.run_until(t).expect("run");
    net.host_mut(b).with_qp(QB, |qp| qp.post_recv(recv(9)));
    run(&mut net);
    // A bad R_Key: a remote access error NAK (and both QPs end in error).
    let bad = SendOp::Write {
        va: BUF,
        rkey: 99,
        imm: None,
    };
    post(&mut net, wr(10, bad, 64));
    run(&mut net);
    net.take_capture::<Vec<u8>>().expect("the capture")
}

fn write_temp(name: &str, bytes: &[u8]) -> PathBuf {
    let path = std::env::temp_dir().join(format!("softverbs-{name}-{}.pcap", std::process::id()));
    std::fs::write(&path, bytes).expect("write the capture");
    path
}

/// Offset of the first record's data in a classic pcap file.
const FIRST_RECORD: usize = 24 + 16;

#[test]
fn a_simulated_rc_exchange_dissects_cleanly_and_every_icrc_matches() {
    let Some(tools) = capture::tools_for_test("capture checker") else {
        return;
    };
    let pcap = rc_exchange();
    let path = write_temp("rc-exchange", &pcap);
    let summary = capture::dissect(&tools, &path).expect("tshark");
    let by = |name: &str| summary.opcodes.get(name).copied().unwrap_or(0);
    // Every kind of packet the exchange should have produced is there.
    for op in [
        "RC Send Only",
        "RC Send First",
        "RC Send Middle",
        "RC Send Last",
        "RC RDMA Write First",
        "RC RDMA Write Last",
        "RC RDMA Write Only Immediate",
        "RC RDMA Read Request",
        "RC RDMA Read Response First",
        "RC RDMA Read Response Last",
        "RC Compare Swap",
        "RC Fetch Add",
        "RC Acknowledge",
        "RC Atomic Acknowledge",
        "RC RDMA Write Only",
    ] {
        assert!(by(op) > 0, "no {op} in {summary:?}");
    }
    assert_eq!(summary.packets, summary.opcodes.values().sum::<u64>());
    // NAKs are Acknowledge packets whose AETH says so.
    for (syndrome, what) in [("rnr", "RNR NAK"), ("psn_seq", "PSN sequence error NAK")] {
        assert!(
            summary.naks.get(syndrome).copied().unwrap_or(0) > 0,
            "no {what} in {summary:?}"
        );
    }
    assert!(
        summary.naks.get("remote_access").copied().unwrap_or(0) > 0,
        "no remote access error NAK in {summary:?}"
    );
    let icrc = capture::check_icrc(&tools, &path).expect("scapy");
    assert_eq!(icrc.len() as u64, summary.packets);
    assert!(icrc.iter().all(|p| p.verdict == Verdict::Match), "{icrc:?}");
    capture::check(&tools, &path).expect("the whole check");
    let _ = std::fs::remove_file(&path);
}

/// The capture of one RDMA ATOMIC WRITE and its answer, as pcap bytes.
fn atomic_write_exchange() -> Vec<u8> {
    let mut net = Network::new(5);
    let mut ea = Endpoint::new(ip(1), memory());
    let mut eb = Endpoint::new(ip(2), memory());
    for (e, me, them, peer) in [(&mut ea, QA, QB, ip(2)), (&mut eb, QB, QA, ip(1))] {
        e.add_qp(QpConfig::rc(me, (peer, them))).expect("add QP");
    }
    let a = net.add_host(ip(1), ea);
    net.add_host(ip(2), eb);
    net.capture(Vec::<u8>::new()).expect("start the capture");
    let aw = SendOp::AtomicWrite {
        va: BUF + 48_000,
        rkey: 1,
        value: 0x0102_0304_0506_0708,
    };
    let now = net.now();
    net.host_mut(a)
        .with_qp(QA, |qp| qp.post_send(now, SendWr::new(1, aw)))
        .expect("QP A")
        .expect("post");
    let limit = net.now().after(Duration::from_secs(1));
    net.run_until_idle(limit).expect("run");
    net.take_capture::<Vec<u8>>().expect("the capture")
}

/// RDMA ATOMIC WRITE on the wire: BTH opcode 0x1d with a RETH and 8 bytes, answered by an
/// RDMA READ Response Only without payload; scapy's ICRC matches both. Debian's Wireshark
/// (4.0) predates the opcode and reports it unknown, which is the only problem allowed.
#[test]
fn an_atomic_write_is_opcode_0x1d_answered_by_an_empty_read_response_and_its_icrc_matches() {
    let Some(tools) = capture::tools_for_test("capture checker") else {
        return;
    };
    let path = write_temp("atomic-write", &atomic_write_exchange());
    let summary = capture::dissect(&tools, &path).expect("tshark");
    assert_eq!(summary.packets, 2, "{summary:?}");
    // The request: BTH opcode 29 (0x1d), which this Wireshark names no further.
    let unknown: Vec<_> = summary
        .problems
        .iter()
        .map(|p| (p.frame, &p.what))
        .collect();
    assert!(
        unknown.len() == 1 && unknown[0].0 == 1 && unknown[0].1.starts_with("unknown opcode 29"),
        "{summary:?}"
    );
    // The answer: a READ Response Only carrying an ACK and no payload.
    assert_eq!(
        summary.opcodes.get("RC RDMA Read Response Only"),
        Some(&1),
        "{summary:?}"
    );
    assert_eq!(summary.naks.get("ack"), Some(&1), "{summary:?}");
    let icrc = capture::check_icrc(&tools, &path).expect("scapy");
    assert_eq!(icrc.len(), 2);
    assert!(icrc.iter().all(|p| p.verdict == Verdict::Match), "{icrc:?}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_corrupted_byte_fails_the_icrc_check_and_garbage_fails_the_dissection() {
    let Some(tools) = capture::tools_for_test("capture checker") else {
        return;
    };
    let mut pcap = rc_exchange();
    // A byte of the first packet's payload (IPv4 20 + UDP 8 + BTH 12 = 40 bytes of headers,
    // all of them but the variant fields covered by the ICRC as well).
    pcap[FIRST_RECORD + 50] ^= 0x01;
    let path = write_temp("rc-corrupt", &pcap);
    let icrc = capture::check_icrc(&tools, &path).expect("scapy");
    assert!(
        matches!(icrc[0].verdict, Verdict::Mismatch { .. }),
        "{:?}",
        icrc[0]
    );
    assert!(icrc[1..].iter().all(|p| p.verdict == Verdict::Match));
    let err = capture::check(&tools, &path).expect_err("a bad ICRC");
    assert!(
        matches!(err, CaptureError::Icrc { ref bad, .. } if bad.len() == 1 && bad[0].frame == 1),
        "{err}"
    );
    let _ = std::fs::remove_file(&path);

    // A UDP 4791 datagram that is not RoCE at all: an unknown opcode, a malformed packet.
    let mut bytes = pcap[..24].to_vec();
    let junk = junk_datagram();
    let len = (junk.len() as u32).to_le_bytes();
    bytes.extend_from_slice(&[0; 8]);
    bytes.extend_from_slice(&len);
    bytes.extend_from_slice(&len);
    bytes.extend_from_slice(&junk);
    let path = write_temp("rc-junk", &bytes);
    let err = capture::check(&tools, &path).expect_err("junk");
    assert!(matches!(err, CaptureError::Dissection { .. }), "{err}");
    let _ = std::fs::remove_file(&path);
    assert!(matches!(
        capture::dissect(&tools, Path::new("/nonexistent.pcap")),
        Err(CaptureError::Tool { .. })
    ));
}

/// An IPv4/UDP datagram to port 4791 whose "BTH" has opcode 0xff and is cut short.
fn junk_datagram() -> Vec<u8> {
    let payload = [0xffu8, 0, 0, 0, 0, 0];
    let total = 20 + 8 + payload.len();
    let mut d = vec![
        0x45,
        0,
        0,
        total as u8,
        0,
        0,
        0x40,
        0,
        64,
        17,
        0,
        0,
        10,
        0,
        0,
        1,
        10,
        0,
        0,
        2,
    ];
    let sum = !d
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum::<u32>()
        .to_be_bytes()
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum::<u32>() as u16;
    d[10..12].copy_from_slice(&sum.to_be_bytes());
    d.extend_from_slice(&0xc000u16.to_be_bytes());
    d.extend_from_slice(&4791u16.to_be_bytes());
    d.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    d.extend_from_slice(&[0, 0]);
    d.extend_from_slice(&payload);
    d
}

/// Writes the exchange's capture to the file named by `SOFTVERBS_CAPTURE_OUT`, to open it
/// in Wireshark (`SOFTVERBS_CAPTURE_OUT=/tmp/rc.pcap cargo test -p softverbs-cli --test
/// capture -- --ignored`).
#[test]
#[ignore = "writes a file for a human to look at"]
fn write_the_rc_exchange_capture() {
    let out = std::env::var("SOFTVERBS_CAPTURE_OUT").unwrap_or_else(|_| "rc.pcap".into());
    std::fs::write(&out, rc_exchange()).expect("write");
    eprintln!("wrote {out}");
}
