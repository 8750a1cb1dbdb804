//! Connection-manager MADs between two hosts through their engines' GSI (QP1).
//!
//! A process on each host keeps its engine running (a QP of `roce0` on A; on B only a hold
//! on the engine, as a listener with no QP yet has) and plays a CM agent or listener on the
//! abstract Unix datagram sockets of the engine's contract (written out here from the
//! contract, not from the engine's code): host B listens for a service, A's agent sends a
//! REQ for it, B answers with a REP, A's agent gets it. A REQ and a SIDR_REQ for services
//! nobody has come back as a REJ (invalid service ID) and a SIDR_REP (not supported), and
//! the engines' captures must dissect in tshark as InfiniBand CM.
//!
//! Leases: a process on A leaves a DREQ with A's engine (a LEASE envelope) and is killed; A's
//! engine sends the DREQ, and B's agent gets it, as a kernel CM's host would send it for a
//! dead process. A process that cancelled its lease before it was killed sends nothing.

use super::{engine_counter, hosts_test, netns};
use crate::common::node;
use crate::harness::{Peer, msg, peer};
use softverbs::*;
use std::net::IpAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

const MAD_LEN: usize = 256;
const ENVELOPE_LEN: usize = 48 + MAD_LEN;

/// The CM attribute IDs used here.
const REQ: u16 = 0x10;
const REJ: u16 = 0x12;
const REP: u16 = 0x13;
const SIDR_REQ: u16 = 0x17;
const DREQ: u16 = 0x15;
/// Envelope flags of the contract: keep this DREQ and send it if I die; forget that lease.
const LEASE: u8 = 0x02;
const CANCEL: u8 = 0x04;
const SIDR_REP: u16 = 0x18;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

fn gid(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// A CM MAD: header (base version 1, class 0x07, class version 2, method Send), transaction
/// ID, attribute, and CM data written at `fields` (offsets into the CM data).
fn mad(attr: u16, tid: u64, fields: &[(usize, &[u8])]) -> [u8; MAD_LEN] {
    let mut m = [0u8; MAD_LEN];
    m[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
    m[8..16].copy_from_slice(&tid.to_be_bytes());
    m[16..18].copy_from_slice(&attr.to_be_bytes());
    for (at, bytes) in fields {
        m[24 + at..24 + at + bytes.len()].copy_from_slice(bytes);
    }
    m
}

fn be32(m: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(m[at..at + 4].try_into().expect("4 bytes"))
}

fn envelope(src: IpAddr, dst: IpAddr, m: &[u8]) -> Vec<u8> {
    let mut e = vec![0u8; ENVELOPE_LEN];
    e[..4].copy_from_slice(b"SVCM");
    e[4] = 1;
    e[8..24].copy_from_slice(&gid(src));
    e[24..40].copy_from_slice(&gid(dst));
    e[40..44].copy_from_slice(&1u32.to_be_bytes());
    e[48..].copy_from_slice(m);
    e
}

fn abstract_addr(name: &str) -> SocketAddr {
    SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract name")
}

// One host's CM end: an engine kept running by a UD QP, and the agent and listener sockets
// the parent asks for.
peer!(peer_cm, |p| {
    let n = node();
    let dev = devices().unwrap()[0].clone();
    let m = p.expect("engine");
    let engine: String = m.get(0);
    // The engine runs for a QP, or for a hold on it (a listener with no QP yet); with
    // `none` this process is no client of the engine at all (another keeps it running).
    let (_qp, _hold) = match m.get::<String>(1).as_str() {
        "qp" => (Some(n.qp(QpType::Ud)), None),
        "none" => (None, None),
        _ => (None, Some(dev.hold_engine().expect("hold the engine"))),
    };
    let engine = abstract_addr(&format!("softverbs-engine/{engine}/cm"));
    let mut socks: Vec<(String, UnixDatagram)> = Vec::new();
    p.send("ready");
    loop {
        let m = p.recv();
        match m.tag() {
            "capture" => {
                let path: String = m.get(0);
                let path = if path == "-" { String::new() } else { path };
                let said = dev.engine_capture(&path).expect("engine capture");
                p.send(msg!("capture", said.replace(' ', "_")));
            }
            // Binds `softverbs-cm/<kind>/<id>` (kind agent or svc).
            "bind" => {
                let name: String = m.get(0);
                let s = UnixDatagram::bind_addr(&abstract_addr(&name)).expect("bind");
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                socks.push((name, s));
                p.send("bound");
            }
            // Sends an envelope from socket `name` to the engine.
            "send" => {
                let (name, envelope): (String, String) = (m.get(0), m.get(1));
                let s = &socks.iter().find(|(n, _)| *n == name).expect("bound").1;
                let sent = s.send_to_addr(&unhex(&envelope), &engine).expect("send");
                p.send(msg!("sent", sent));
            }
            // `recv name [ms]`: waits 5 s, or `ms`.
            "recv" => {
                let name: String = m.get(0);
                let s = &socks.iter().find(|(n, _)| *n == name).expect("bound").1;
                let within = if m.len() > 1 {
                    Duration::from_millis(m.get(1))
                } else {
                    Duration::from_secs(5)
                };
                s.set_read_timeout(Some(within)).unwrap();
                let mut b = [0u8; 1024];
                match s.recv(&mut b) {
                    Ok(len) => p.send(msg!("got", hex(&b[..len]))),
                    Err(_) => p.send("got none"),
                }
            }
            "counters" => {
                let report = dev.engine_report().unwrap();
                let values: Vec<String> = (0..m.len())
                    .map(|i| engine_counter(&report, &m.get::<String>(i)).to_string())
                    .collect();
                p.send(format!("counters {}", values.join(" ")));
            }
            _ => break,
        }
    }
});

/// What a peer's socket received: (flags, source GID, destination GID, source QP, MAD).
fn received(p: &mut Peer, sock: &str) -> (u8, [u8; 16], [u8; 16], u32, Vec<u8>) {
    p.send(msg!("recv", sock.to_string()));
    let h: String = p.expect("got").get(0);
    assert_ne!(h, "none", "nothing reached {sock} within 5 s");
    let e = unhex(&h);
    assert_eq!(e.len(), ENVELOPE_LEN, "one envelope");
    assert_eq!(
        &e[..8],
        b"SVCM\x01\x01\0\0",
        "magic, version 1, from the network"
    );
    assert_eq!(&e[44..48], &[0; 4]);
    (
        e[5],
        e[8..24].try_into().unwrap(),
        e[24..40].try_into().unwrap(),
        be32(&e, 40),
        e[48..].to_vec(),
    )
}

fn send(p: &mut Peer, sock: &str, e: &[u8]) {
    p.send(msg!("send", sock.to_string(), hex(e)));
    assert_eq!(p.expect("sent").get::<usize>(0), e.len());
}

fn counters(p: &mut Peer, names: &[&str]) -> Vec<u64> {
    p.send(format!("counters {}", names.join(" ")));
    let m = p.expect("counters");
    (0..names.len()).map(|i| m.get(i)).collect()
}

/// tshark's verbose dissection of `pcap`.
fn dissect(pcap: &std::path::Path) -> String {
    let out = std::process::Command::new("tshark")
        .arg("-r")
        .arg(pcap)
        .arg("-V")
        .output()
        .expect("run tshark (install it: apt-get install tshark)");
    assert!(
        out.status.success(),
        "tshark -r {}: {}",
        pcap.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn cm_mads_travel_between_hosts_on_qp1_and_a_request_for_no_service_is_rejected() {
    const T: &str = "CM MADs between hosts";
    let Some(_alone) = hosts_test(T) else {
        return;
    };
    let net = netns::NetPair::new(&netns::NetConfig::default()).expect("make the namespaces");
    let (a, b) = (net.a(), net.b());
    let dev = |h: &netns::HostNs| format!("name=roce0,netdev={}", h.ifname);
    let mut pa = Peer::spawn_in("between_hosts::cm::peer_cm", &a.netns, &dev(a));
    let mut pb = Peer::spawn_in("between_hosts::cm::peer_cm", &b.netns, &dev(b));
    // The engines are named by the device's primary address: its IPv4 one.
    // A's engine runs for a QP, B's for a hold only.
    pa.send(msg!("engine", a.ipv4.to_string(), "qp".to_string()));
    pb.send(msg!("engine", b.ipv4.to_string(), "hold".to_string()));
    pa.expect("ready");
    pb.expect("ready");
    let dir = std::env::temp_dir().join(format!("softverbs-cm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cap_a, cap_b) = (dir.join("a.pcap"), dir.join("b.pcap"));
    for (p, f) in [(&mut pa, &cap_a), (&mut pb, &cap_b)] {
        p.send(msg!("capture", f.display().to_string()));
        assert!(
            p.expect("capture")
                .get::<String>(0)
                .starts_with("capturing")
        );
    }

    let (a4, b4) = (IpAddr::V4(a.ipv4), IpAddr::V4(b.ipv4));
    let (a6, b6) = (IpAddr::V6(a.ipv6), IpAddr::V6(b.ipv6));
    let pid = std::process::id();
    let agent_id = 0x10000 | (pid & 0xffff);
    let agent = format!("softverbs-cm/agent/{agent_id:05x}");
    let sid: u64 = 0x0106_0000_0000_0000 | u64::from(pid & 0xffff);
    let listener = format!("softverbs-cm/svc/{sid:016x}");
    pb.send(msg!("bind", listener.clone()));
    pb.expect("bound");
    pa.send(msg!("bind", agent.clone()));
    pa.expect("bound");

    // A's REQ reaches B's listener, from A, on QP1.
    let a_comm = (agent_id << 12) | 0x001;
    let req = mad(
        REQ,
        0x1111,
        &[(0, &a_comm.to_be_bytes()), (8, &sid.to_be_bytes())],
    );
    send(&mut pa, &agent, &envelope(a4, b4, &req));
    let (flags, src, dst, qpn, got) = received(&mut pb, &listener);
    assert_eq!(flags & 1, 1, "marked as from the network");
    assert_eq!((src, dst, qpn), (gid(a4), gid(b4), 1), "from A's QP1 to B");
    assert_eq!(got, req, "the REQ as A's agent wrote it");

    // B's REP, through B's engine, reaches A's agent.
    let b_comm = 0xbbbb_b001u32;
    let rep = mad(
        REP,
        0x1111,
        &[(0, &b_comm.to_be_bytes()), (4, &a_comm.to_be_bytes())],
    );
    send(&mut pb, &listener, &envelope(b4, a4, &rep));
    let (flags, src, dst, qpn, got) = received(&mut pa, &agent);
    assert_eq!((flags & 1, src, dst, qpn), (1, gid(b4), gid(a4), 1));
    assert_eq!(got, rep, "the REP as B wrote it");

    // The same over IPv6.
    let req6 = mad(
        REQ,
        0x2222,
        &[(0, &(a_comm + 1).to_be_bytes()), (8, &sid.to_be_bytes())],
    );
    send(&mut pa, &agent, &envelope(a6, b6, &req6));
    let (_, src, dst, _, got) = received(&mut pb, &listener);
    assert_eq!((src, dst), (gid(a6), gid(b6)), "IPv6 GIDs");
    assert_eq!(got, req6);

    // A REQ for a service nobody listens on: B's engine answers with a REJ, reason 8.
    let lonely = mad(
        REQ,
        0x3333,
        &[
            (0, &(a_comm + 2).to_be_bytes()),
            (8, &(sid ^ 0xff00).to_be_bytes()),
        ],
    );
    send(&mut pa, &agent, &envelope(a4, b4, &lonely));
    let (_, src, _, _, rej) = received(&mut pa, &agent);
    assert_eq!(src, gid(b4), "the REJ comes from B");
    assert_eq!(u16::from_be_bytes([rej[16], rej[17]]), REJ, "a REJ");
    assert_eq!(&rej[..4], &[1, 7, 2, 3]);
    assert_eq!(&rej[8..16], &lonely[8..16], "same transaction ID");
    assert_eq!(be32(&rej, 24), 0, "local comm ID");
    assert_eq!(
        be32(&rej, 28),
        a_comm + 2,
        "remote comm ID: the REQ's local one"
    );
    assert_eq!(rej[32] >> 6, 0, "message rejected: REQ");
    assert_eq!(
        u16::from_be_bytes([rej[34], rej[35]]),
        8,
        "invalid service ID"
    );

    // A SIDR_REQ likewise: a SIDR_REP with status 1.
    let request_id = (agent_id << 12) | 0x777;
    let sidr = mad(
        SIDR_REQ,
        0x4444,
        &[
            (0, &request_id.to_be_bytes()),
            (4, &[0xff, 0xff]),
            (8, &(sid ^ 0xff).to_be_bytes()),
        ],
    );
    send(&mut pa, &agent, &envelope(a4, b4, &sidr));
    let (_, _, _, _, srep) = received(&mut pa, &agent);
    assert_eq!(u16::from_be_bytes([srep[16], srep[17]]), SIDR_REP);
    assert_eq!(be32(&srep, 24), request_id, "the request ID");
    assert_eq!(srep[28], 1, "status: service ID not supported");
    assert_eq!(&srep[36..44], &(sid ^ 0xff).to_be_bytes(), "the service ID");

    // Refused locally: a source address that is not A's, and garbage.
    let mut forged = envelope(b4, a4, &req);
    send(&mut pa, &agent, &forged);
    forged.truncate(100);
    send(&mut pa, &agent, &forged);

    let names = [
        "cm_mads_sent",
        "cm_mads_received",
        "cm_mads_delivered",
        "cm_rejected_no_listener",
        "cm_foreign_source",
        "cm_bad_envelopes",
        "cm_mads_dropped",
    ];
    // The refused envelopes were read by A's engine (within its next control turn).
    std::thread::sleep(Duration::from_millis(100));
    let (ca, cb) = (counters(&mut pa, &names), counters(&mut pb, &names));
    eprintln!("{T}: A {names:?} = {ca:?}; B = {cb:?}");
    // A sent the two REQs that arrived, the REQ and SIDR_REQ nobody took, and got the REP,
    // the REJ and the SIDR_REP; it refused the forged and the malformed envelope.
    assert_eq!(ca, [4, 3, 3, 0, 1, 1, 2], "host A's counters");
    // B got four requests, gave two to its listener and answered two itself (the REP it
    // sent is the third MAD out).
    assert_eq!(cb, [3, 4, 2, 2, 0, 0, 0], "host B's counters");

    for p in [&mut pa, &mut pb] {
        p.send(msg!("capture", "-".to_string()));
        p.expect("capture");
    }
    // Each capture holds the seven MADs (REQ, REP, REQ over IPv6, REQ, REJ, SIDR_REQ,
    // SIDR_REP), each dissected by tshark as a CM MAD on QP1.
    for (host, f) in [("A", &cap_a), ("B", &cap_b)] {
        let text = dissect(f);
        let lines = |s: &str| text.lines().filter(|l| l.trim() == s).count();
        let frames = text.lines().filter(|l| l.starts_with("Frame ")).count();
        let at = f.display();
        eprintln!(
            "{T}: host {host}'s capture: {frames} frames; CM ConnectRequest {}, ConnectReply {}, \
             ConnectReject {}, ServiceIDResReq {}, ServiceIDResReqResp {}",
            lines("CM ConnectRequest"),
            lines("CM ConnectReply"),
            lines("CM ConnectReject"),
            lines("CM ServiceIDResReq (Dissector Not Implemented)"),
            lines("CM ServiceIDResReqResp (Dissector Not Implemented)"),
        );
        assert!(
            !text.contains("Malformed"),
            "{host}: malformed packet in {at}"
        );
        assert_eq!(frames, 7, "{host}: every MAD in {at}");
        for each in [
            "InfiniBand",
            "Opcode: Unreliable Datagram (UD) - SEND only (100)",
            "Destination Queue Pair: 0x000001",
            "Queue Key: 0x0000000080010000",
            "Source Queue Pair: 0x00000001",
            "MAD Header - Common Management Datagram",
            "Management Class: 0x07",
        ] {
            assert_eq!(
                lines(each),
                frames,
                "{host}: `{each}` in every frame of {at}"
            );
        }
        assert_eq!(lines("CM ConnectRequest"), 3, "{host}: the REQs in {at}");
        assert_eq!(lines("CM ConnectReply"), 1, "{host}: the REP in {at}");
        assert_eq!(lines("CM ConnectReject"), 1, "{host}: the REJ in {at}");
        assert_eq!(
            lines("Reason: 0x0008"),
            1,
            "{host}: invalid service ID in {at}"
        );
        assert_eq!(
            lines("CM ServiceIDResReq (Dissector Not Implemented)"),
            1,
            "{host}: the SIDR_REQ in {at}"
        );
        assert_eq!(
            lines("CM ServiceIDResReqResp (Dissector Not Implemented)"),
            1,
            "{host}: the SIDR_REP in {at}"
        );
    }
    // Kept when an assertion fails, for a look.
    let _ = std::fs::remove_dir_all(&dir);
    for p in [&mut pa, &mut pb] {
        p.send("done");
    }
    pa.finish();
    pb.finish();
}

fn flagged(flags: u8, src: IpAddr, dst: IpAddr, m: &[u8]) -> Vec<u8> {
    let mut e = envelope(src, dst, m);
    e[5] = flags;
    e
}

/// A counter of A's engine, once it equals `want` (the engine reads envelopes in its next
/// control turn), or its value after 2 s.
fn counter_becomes(p: &mut Peer, name: &str, want: u64) -> u64 {
    let t0 = std::time::Instant::now();
    loop {
        let v = counters(p, &[name])[0];
        if v == want || t0.elapsed() > Duration::from_secs(2) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn the_engine_sends_the_leased_dreq_of_a_process_that_dies() {
    const T: &str = "leased DREQs between hosts";
    let Some(_alone) = hosts_test(T) else {
        return;
    };
    let net = netns::NetPair::new(&netns::NetConfig::default()).expect("make the namespaces");
    let (a, b) = (net.a(), net.b());
    let dev = |h: &netns::HostNs| format!("name=roce0,netdev={}", h.ifname);
    let (a4, b4) = (IpAddr::V4(a.ipv4), IpAddr::V4(b.ipv4));
    // A's engine runs for a QP of a process that lives throughout; B's for a hold.
    let mut pa = Peer::spawn_in("between_hosts::cm::peer_cm", &a.netns, &dev(a));
    let mut pb = Peer::spawn_in("between_hosts::cm::peer_cm", &b.netns, &dev(b));
    pa.send(msg!("engine", a.ipv4.to_string(), "qp".to_string()));
    pb.send(msg!("engine", b.ipv4.to_string(), "hold".to_string()));
    pa.expect("ready");
    pb.expect("ready");
    let pid = std::process::id();
    let b_agent_id = 0x30000 | (pid & 0xffff);
    let b_agent = format!("softverbs-cm/agent/{b_agent_id:05x}");
    pb.send(msg!("bind", b_agent.clone()));
    pb.expect("bound");
    let names = ["cm_leases", "cm_leases_fired", "cm_mads_sent"];
    let before = counters(&mut pa, &names);
    assert_eq!(before, [0, 0, 0], "A's engine starts with nothing");

    // A process on A with an established connection to B leases its DREQ, then dies. It is
    // not one of the engine's clients (it only talks to the CM socket): the engine's
    // periodic look finds it gone.
    let a_agent_id = 0x40000 | (pid & 0xffff);
    let a_comm = (a_agent_id << 12) | 0x001;
    let b_comm = (b_agent_id << 12) | 0x00b;
    let dreq = mad(
        DREQ,
        0x5555,
        &[(0, &a_comm.to_be_bytes()), (4, &b_comm.to_be_bytes())],
    );
    let mut dying = Peer::spawn_in("between_hosts::cm::peer_cm", &a.netns, &dev(a));
    dying.send(msg!("engine", a.ipv4.to_string(), "none".to_string()));
    dying.expect("ready");
    let a_agent = format!("softverbs-cm/agent/{a_agent_id:05x}");
    dying.send(msg!("bind", a_agent.clone()));
    dying.expect("bound");
    send(&mut dying, &a_agent, &flagged(LEASE, a4, b4, &dreq));
    assert_eq!(
        counter_becomes(&mut pa, "cm_leases", 1),
        1,
        "A holds the lease"
    );
    // Not sent on arrival.
    pb.send(msg!("recv", b_agent.clone(), 300u64));
    assert_eq!(
        pb.expect("got").get::<String>(0),
        "none",
        "a lease is not sent"
    );
    let t0 = std::time::Instant::now();
    dying.kill();
    let (flags, src, dst, qpn, got) = received(&mut pb, &b_agent);
    let took = t0.elapsed();
    eprintln!("{T}: B's agent got the dead process's DREQ {took:?} after the SIGKILL");
    assert_eq!(flags, 1, "from the network");
    assert_eq!((src, dst, qpn), (gid(a4), gid(b4), 1), "from A's QP1 to B");
    assert_eq!(got, dreq, "the DREQ as the process leased it");
    assert!(
        took < Duration::from_millis(1500),
        "within about a second: {took:?}"
    );
    assert_eq!(
        counter_becomes(&mut pa, "cm_leases", 0),
        0,
        "forgotten once sent"
    );

    // A process that leases and then cancels (its connection ended) and is killed: nothing.
    // This one holds the engine, so the engine also sees it go as a client.
    let mut done = Peer::spawn_in("between_hosts::cm::peer_cm", &a.netns, &dev(a));
    done.send(msg!("engine", a.ipv4.to_string(), "hold".to_string()));
    done.expect("ready");
    let a_agent2 = format!("softverbs-cm/agent/{:05x}", a_agent_id + 1);
    done.send(msg!("bind", a_agent2.clone()));
    done.expect("bound");
    let dreq2 = mad(
        DREQ,
        0x6666,
        &[
            (0, &(((a_agent_id + 1) << 12) | 1).to_be_bytes()),
            (4, &b_comm.to_be_bytes()),
        ],
    );
    send(&mut done, &a_agent2, &flagged(LEASE, a4, b4, &dreq2));
    assert_eq!(counter_becomes(&mut pa, "cm_leases", 1), 1);
    send(&mut done, &a_agent2, &flagged(CANCEL, a4, b4, &dreq2));
    assert_eq!(counter_becomes(&mut pa, "cm_leases", 0), 0, "cancelled");
    done.kill();
    pb.send(msg!("recv", b_agent.clone(), 1000u64));
    assert_eq!(
        pb.expect("got").get::<String>(0),
        "none",
        "a cancelled lease is never sent"
    );

    let after = counters(&mut pa, &names);
    eprintln!("{T}: A {names:?} = {after:?}");
    assert_eq!(after, [0, 1, 1], "one lease fired: the one DREQ A sent");
    for p in [&mut pa, &mut pb] {
        p.send("done");
    }
    pa.finish();
    pb.finish();
}
