//! Every test of this suite again, between two hosts: two network namespaces joined by a veth
//! pair, each with a networked device (`roce0`, RoCEv2 over UDP through its host engine). The
//! parent runs in one namespace and every peer in the other, so each test's traffic crosses
//! the wire as RoCEv2 packets.
//!
//! Needs root (for the namespaces) and the `softverbs` executable built beside this test (the
//! library starts the engine with it); skipped with a message otherwise, except under
//! `CI=true`, where it fails.

use crate::harness::{PEER_DEVICES_ENV, PEER_NETNS_ENV, ROLE_ENV};
use std::time::{Duration, Instant};

#[path = "../../../softverbs-cli/src/netns.rs"]
#[allow(dead_code)]
mod netns;

/// CM MADs on QP1 between the hosts' engines.
mod cm;

/// Whether test `name` runs here: not inside the run the suite test starts nor in a peer,
/// and only as root (else skipped with a message; a failure under `CI=true`). It then holds
/// the harness alone: these runs busy-poll on both hosts, and no other test may compete.
fn hosts_test(name: &str) -> Option<crate::harness::ExclusivePass> {
    if std::env::var_os(PEER_NETNS_ENV).is_some() || std::env::var_os(ROLE_ENV).is_some() {
        return None;
    }
    netns::available_for_test(name).then(exclusive)
}

/// The whole suite between hosts must end well within this.
const LIMIT: Duration = Duration::from_secs(600);

#[test]
fn every_multiprocess_test_passes_between_two_network_namespaces() {
    const T: &str = "multiprocess between hosts";
    let Some(_alone) = hosts_test(T) else {
        return;
    };
    let net = netns::NetPair::new(&netns::NetConfig::default()).expect("make the namespaces");
    let (a, b) = (net.a(), net.b());
    let exe = std::env::current_exe().expect("current_exe");
    let t0 = Instant::now();
    let mut child = a
        .command(&exe)
        .args(["--test-threads=1", "--skip", "between_hosts::"])
        .env(
            "SOFTVERBS_DEVICES",
            format!("name=roce0,netdev={}", a.ifname),
        )
        .env(PEER_NETNS_ENV, &b.netns)
        .env(PEER_DEVICES_ENV, format!("name=roce0,netdev={}", b.ifname))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the suite in the first namespace");
    let out = loop {
        if let Ok(Some(_)) = child.try_wait() {
            break child.wait_with_output().expect("collect the output");
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect the output");
            panic!(
                "{T}: still running after {LIMIT:?}\n{}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("test result") || l.contains("FAILED") || l.contains("panicked"))
        .collect();
    eprintln!(
        "{T}: {:.1} s: {}",
        t0.elapsed().as_secs_f64(),
        summary.join(" | ")
    );
    assert!(
        out.status.success(),
        "{T}: the suite failed between the namespaces\n--- stdout\n{stdout}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------------------------------------
// The network is untrusted: forged packets from a third host.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, exclusive, msg, peer};
use softverbs::*;
use softverbs_roce::wire::{Bth, Headers, IpRepr, Ipv4Repr, Opcode, Psn, Reth, emit_datagram};
use std::net::Ipv4Addr;

const LEN: usize = 4096;
/// Forged packets of each kind the attacker sends.
const FORGED: usize = 20;
/// The byte every forged payload is made of.
const EVIL: u8 = 0xee;

fn round_data(r: u8) -> Vec<u8> {
    pattern(LEN, r.wrapping_mul(29).wrapping_add(3))
}

/// The counters of the engine serving this process's device, by name.
fn engine_counter(report: &str, name: &str) -> u64 {
    report
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix(name)?
                .strip_prefix(':')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no counter {name} in the engine report:\n{report}"))
}

peer!(peer_victim, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let buf = n.mr(LEN);
    let secret = n.mr(LEN);
    let hidden = pattern(LEN, 0x5e);
    secret.write_at(0, &hidden).unwrap();
    p.send(msg!("victim", qp.endpoint(0).unwrap(), RemoteMr::of(&buf)));
    accept_rc(p, &qp);
    p.send("ready");
    loop {
        let m = p.recv();
        match m.tag() {
            "psn" => p.send(msg!("psn", qp.query().rq_psn)),
            "check" => {
                let r: u8 = m.get(0);
                let report = devices().unwrap()[0].engine_report().unwrap();
                let c = |name| engine_counter(&report, name);
                let got = buf.to_vec();
                p.send(msg!(
                    "checked",
                    compare(&got, &round_data(r)),
                    compare(&secret.to_vec(), &hidden),
                    format!("{:?}", qp.query().qp_state),
                    c("dropped_by_qp"),
                    c("out_of_sequence") + c("duplicate_requests"),
                    c("dropped_malformed"),
                    c("icrc_errors"),
                    c("dropped_unknown_qp")
                ));
            }
            _ => break,
        }
    }
});

peer!(peer_initiator, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let src = n.mr(LEN);
    let m = p.expect("victim");
    let (them, to): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    qp.to_init(ALL_REMOTE).unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send(msg!("initiator", qp.endpoint(0).unwrap()));
    loop {
        let m = p.recv();
        if m.tag() != "write" {
            break;
        }
        let r: u8 = m.get(0);
        src.write_at(0, &round_data(r)).unwrap();
        let s = [src.sge(0..LEN)];
        let op = SendOp::RdmaWrite {
            remote_addr: to.iova,
            rkey: to.rkey,
        };
        qp.post_send([signaled(SendWr::new(u64::from(r), op, &s))])
            .unwrap();
        let wc = poll_n(&n.cq, 1, "initiator: the write")[0];
        p.send(msg!("wrote", wc.status()));
    }
});

/// Turns IPv6 off in `hosts`: their GID 0 is then the IPv4 one (and a link that goes down
/// and up does not lose its link-local address and get it back later).
fn ipv4_only(hosts: &[&netns::HostNs]) {
    for h in hosts {
        let out = h
            .command("sysctl")
            .args(["-qw", "net.ipv6.conf.all.disable_ipv6=1"])
            .output()
            .expect("sysctl");
        assert!(out.status.success(), "disable IPv6 in {}", h.netns);
    }
}

/// One forged RDMA WRITE ONLY of `len` bytes of [`EVIL`], as an IPv4 datagram from `src`.
fn forge(src: Ipv4Addr, dst: Ipv4Addr, qpn: u32, psn: u32, to: RemoteMr, len: usize) -> Vec<u8> {
    let mut h = Headers::new(Bth::new(Opcode::RC_WRITE_ONLY, qpn, Psn::new(psn)));
    h.reth = Some(Reth {
        va: to.iova,
        rkey: to.rkey,
        len: len as u32,
    });
    // Identification 0 with don't-fragment, as Linux sends RoCE datagrams (the ICRC
    // covers it): these packets are well formed unless a test spoils them on purpose.
    let ip = IpRepr::V4(Ipv4Repr::new(src, dst));
    let mut out = vec![0u8; len + 128];
    let n = emit_datagram(&ip, 4791, &h, &vec![EVIL; len], &mut out).expect("emit");
    out.truncate(n);
    out
}

/// A well-formed IPv4/UDP datagram to port 4791 whose RoCE part is only `head` (a BTH cut
/// short): the kernel delivers it, and the engine must refuse it.
fn truncated(src: Ipv4Addr, dst: Ipv4Addr, head: &[u8]) -> Vec<u8> {
    use softverbs_roce::wire::UdpRepr;
    let ip = IpRepr::V4(Ipv4Repr::new(src, dst));
    let mut out = vec![0u8; 28 + head.len()];
    out[28..].copy_from_slice(head);
    ip.emit(8 + head.len(), &mut out).expect("IP header");
    let udp = UdpRepr {
        src_port: 4791,
        dst_port: 4791,
    };
    let (ip_part, rest) = out.split_at_mut(20);
    let _ = ip_part;
    udp.emit(&ip, head.len(), false, rest).expect("UDP header");
    out
}

peer!(peer_attacker, |p| {
    use rustix::net::{AddressFamily, SendFlags, SocketType, ipproto, sendto, socket};
    let m = p.expect("attack");
    let (victim, spoof): (String, String) = (m.get(0), m.get(1));
    let (qpn, psn, to): (u32, u32, RemoteMr) = (m.get(2), m.get(3), m.get(4));
    let victim: Ipv4Addr = victim.parse().unwrap();
    let spoof: Ipv4Addr = spoof.parse().unwrap();
    let me: Ipv4Addr = p.expect("me").get::<String>(0).parse().unwrap();
    // A raw socket writes the whole IP header: any source address, any bytes.
    let raw = socket(AddressFamily::INET, SocketType::RAW, Some(ipproto::RAW)).expect("raw socket");
    let to_victim = std::net::SocketAddrV4::new(victim, 0);
    let send = |d: &[u8]| {
        sendto(&raw, d, SendFlags::empty(), &to_victim).expect("send a forged packet");
    };
    for i in 0..FORGED as u32 {
        // From the attacker's own address, with the right QP, PSN and key.
        send(&forge(me, victim, qpn, psn, to, 64));
        // Guessed keys on top of the wrong source.
        let guess = RemoteMr {
            rkey: 0x1000_0000u32.wrapping_mul(i + 1) ^ 0x00ab_cdef,
            ..to
        };
        send(&forge(me, victim, qpn, psn, guess, 64));
        // The peer's address, but PSNs far outside the window: ahead, and behind.
        send(&forge(
            spoof,
            victim,
            qpn,
            (psn + 0x40_0000 + i) & 0xff_ffff,
            to,
            64,
        ));
        send(&forge(
            spoof,
            victim,
            qpn,
            psn.wrapping_sub(0x40_0000 + i) & 0xff_ffff,
            to,
            64,
        ));
        // The peer's address and the expected PSN, but cut short, or with a bad ICRC.
        let good = forge(spoof, victim, qpn, psn, to, 64);
        send(&truncated(spoof, victim, &good[28..28 + 6]));
        let mut bad = good.clone();
        let at = bad.len() - 10;
        bad[at] ^= 0x40;
        send(&bad);
        // A QP number nobody has.
        send(&forge(spoof, victim, qpn ^ 0x55_5555, psn, to, 64));
    }
    p.send("attacked");
});

#[test]
fn forged_packets_from_a_third_host_are_dropped_and_counted_and_harm_nothing() {
    const T: &str = "spoofed packets";
    let Some(_alone) = hosts_test(T) else {
        return;
    };
    let net = netns::NetPair::new(&netns::NetConfig {
        attacker: true,
        ..netns::NetConfig::default()
    })
    .expect("make the namespaces");
    let (a, b) = (net.a(), net.b());
    let c = net.attacker().expect("the attacker host");
    // IPv4 only, so the victim's peer is the address the attacker forges (GID 0 would
    // otherwise be the IPv6 link-local one).
    ipv4_only(&[a, b, c]);
    let dev = |h: &netns::HostNs| format!("name=roce0,netdev={}", h.ifname);
    let mut victim = Peer::spawn_in("between_hosts::peer_victim", &b.netns, &dev(b));
    let mut init = Peer::spawn_in("between_hosts::peer_initiator", &a.netns, &dev(a));
    let mut evil = Peer::spawn_in("between_hosts::peer_attacker", &c.netns, &dev(c));
    let m = victim.expect("victim");
    let (vep, vbuf): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    init.send(msg!("victim", vep, vbuf));
    let iep: Endpoint = init.expect("initiator").get(0);
    victim.send(msg!("initiator", iep));
    victim.expect("ready");

    init.send(msg!("write", 1u8));
    assert_eq!(init.expect("wrote").get::<WcStatus>(0), WcStatus::Success);
    victim.send("psn");
    let psn: u32 = victim.expect("psn").get(0);
    evil.send(msg!(
        "attack",
        b.ipv4.to_string(),
        a.ipv4.to_string(),
        vep.qpn,
        psn,
        vbuf
    ));
    evil.send(msg!("me", c.ipv4.to_string()));
    evil.expect("attacked");
    // Give the victim's engine a moment to read what was sent; then traffic goes on.
    std::thread::sleep(Duration::from_millis(200));
    init.send(msg!("write", 2u8));
    assert_eq!(
        init.expect("wrote").get::<WcStatus>(0),
        WcStatus::Success,
        "the victim's peer still gets through"
    );
    victim.send(msg!("check", 2u8));
    let m = victim.expect("checked");
    let (buf, secret, state): (String, String, String) = (m.get(0), m.get(1), m.get(2));
    let (wrong_source, out_of_window, malformed, icrc, unknown): (u64, u64, u64, u64, u64) =
        (m.get(3), m.get(4), m.get(5), m.get(6), m.get(7));
    eprintln!(
        "{T}: victim counters: dropped_by_qp {wrong_source}, out of window {out_of_window}, \
         malformed {malformed}, icrc {icrc}, unknown QP {unknown}"
    );
    // Every forged packet carried 64 bytes of EVIL for the buffer's first bytes: the buffer
    // holding exactly its peer's last message means none landed.
    assert_eq!(
        buf, "ok",
        "the victim's buffer holds what its peer wrote, and nothing forged"
    );
    assert_eq!(secret, "ok", "memory no key was given for is untouched");
    assert_eq!(state, "Rts", "the victim's QP did not change state");
    let n = FORGED as u64;
    assert!(
        wrong_source >= 2 * n,
        "wrong-source packets counted: {wrong_source}"
    );
    assert!(
        out_of_window >= 2 * n,
        "out-of-window packets counted: {out_of_window}"
    );
    assert!(malformed >= n, "truncated packets counted: {malformed}");
    assert!(icrc >= n, "bad-ICRC packets counted: {icrc}");
    assert!(unknown >= n, "unknown-QP packets counted: {unknown}");
    for p in [&mut victim, &mut init] {
        p.send("done");
    }
    victim.finish();
    init.finish();
    evil.finish();
}

// ---------------------------------------------------------------------------------------------
// A peer that goes away: its link, or its host's engine.

/// Timeout exponent and retries of the failure tests: 4.096 µs × 2^12 = 16.8 ms, 3 retries.
const TIMEOUT: u8 = 12;
const RETRIES: u8 = 3;

// An end that makes RC QPs on command and writes or reports through the newest one.
peer!(peer_end, |p| {
    let n = node();
    let mut qps: Vec<(QueuePair, MemoryRegion<'static>)> = Vec::new();
    loop {
        let m = p.recv();
        match m.tag() {
            "qp" => {
                let qp = n.qp(QpType::Rc);
                let mr = n.mr(LEN);
                p.send(msg!("qp", qp.endpoint(0).unwrap(), RemoteMr::of(&mr)));
                qps.push((qp, mr));
            }
            "connect" => {
                let them: Endpoint = m.get(0);
                let (qp, _) = qps.last().expect("a QP");
                qp.to_init(ALL_REMOTE).unwrap();
                qp.to_rtr(&them).unwrap();
                qp.to_rts(0).unwrap();
                set_timeout_and_retries(qp, TIMEOUT, RETRIES);
                p.send("connected");
            }
            "write" => {
                let (r, to): (u8, RemoteMr) = (m.get(0), m.get(1));
                let (qp, mr) = qps.last().expect("a QP");
                mr.write_at(0, &round_data(r)).unwrap();
                let s = [mr.sge(0..LEN)];
                let op = SendOp::RdmaWrite {
                    remote_addr: to.iova,
                    rkey: to.rkey,
                };
                let t0 = Instant::now();
                qp.post_send([signaled(SendWr::new(u64::from(r), op, &s))])
                    .unwrap();
                let wc = poll_n_within(&n.cq, 1, "the write", Duration::from_secs(20))[0];
                p.send(msg!("wrote", wc.status(), t0.elapsed().as_millis() as u64));
            }
            "counters" => {
                let report = devices().unwrap()[0].engine_report().unwrap();
                let names: Vec<String> = (0..m.len()).map(|i| m.get(i)).collect();
                let values: Vec<String> = names
                    .iter()
                    .map(|n| engine_counter(&report, n).to_string())
                    .collect();
                p.send(format!("counters {}", values.join(" ")));
            }
            "state" => {
                let (qp, mr) = qps.last().expect("a QP");
                let event = match n.ctx.try_get_async_event() {
                    Ok(e) => format!("{:?}", e.kind),
                    Err(_) => "none".into(),
                };
                let r: u8 = m.get(0);
                p.send(msg!(
                    "state",
                    format!("{:?}", qp.query().qp_state),
                    event,
                    compare(&mr.to_vec(), &round_data(r))
                ));
            }
            _ => break,
        }
    }
});

/// Two ends on the two hosts, connected: (ends, their newest QPs' endpoints and buffers).
fn connect_ends(a: &mut Peer, b: &mut Peer) -> (RemoteMr, RemoteMr) {
    a.send("qp");
    b.send("qp");
    let (ma, mb) = (a.expect("qp"), b.expect("qp"));
    let (aep, abuf): (Endpoint, RemoteMr) = (ma.get(0), ma.get(1));
    let (bep, bbuf): (Endpoint, RemoteMr) = (mb.get(0), mb.get(1));
    a.send(msg!("connect", bep));
    b.send(msg!("connect", aep));
    a.expect("connected");
    b.expect("connected");
    (abuf, bbuf)
}

fn write(from: &mut Peer, r: u8, to: RemoteMr) -> (WcStatus, Duration) {
    from.send(msg!("write", r, to));
    let m = from.expect_within("wrote", Duration::from_secs(30));
    (m.get(0), Duration::from_millis(m.get(1)))
}

/// What RC promises when nothing answers: `RETRY_EXC_ERR` after the ACK timeout and its
/// retries, no sooner than timeout × (retries + 1) and not much later.
fn assert_gave_up_in_time(status: WcStatus, took: Duration, what: &str) {
    let bound = ack_timeout(TIMEOUT) * (u32::from(RETRIES) + 1);
    assert_eq!(status, WcStatus::RetryExcErr, "{what}");
    assert!(
        took >= bound.mul_f64(0.9) && took <= bound * 3 + Duration::from_millis(200),
        "{what}: gave up after {took:?}; timeout × (retries + 1) is {bound:?}"
    );
}

fn engine_pids(h: &netns::HostNs) -> Vec<u32> {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", &h.netns])
        .output()
        .expect("ip netns pids");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p: &u32| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == b"engine"))
        })
        .collect()
}

#[test]
fn a_peer_whose_link_or_engine_goes_away_fails_rc_with_retry_exceeded_in_time_and_a_new_engine_serves_new_qps()
 {
    const T: &str = "link down, engine killed";
    let Some(_alone) = hosts_test(T) else {
        return;
    };
    let net = netns::NetPair::new(&netns::NetConfig::default()).expect("make the namespaces");
    let (a, b) = (net.a(), net.b());
    ipv4_only(&[a, b]);
    let dev = |h: &netns::HostNs| format!("name=roce0,netdev={}", h.ifname);
    let mut ea = Peer::spawn_in("between_hosts::peer_end", &a.netns, &dev(a));
    let mut eb = Peer::spawn_in("between_hosts::peer_end", &b.netns, &dev(b));

    // The peer's link goes down mid-conversation.
    let (_, bbuf) = connect_ends(&mut ea, &mut eb);
    assert_eq!(write(&mut ea, 1, bbuf).0, WcStatus::Success);
    net.set_link(netns::Host::B, false).expect("link down");
    let (status, took) = write(&mut ea, 2, bbuf);
    assert_gave_up_in_time(status, took, "a write to a peer whose link is down");
    net.set_link(netns::Host::B, true).expect("link up");
    let up = spin_until(Duration::from_secs(10), || {
        a.command("ping")
            .args(["-c", "1", "-W", "1", "-n", &b.ipv4.to_string()])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    assert!(up, "the link came back");

    // The peer host's engine is killed: writes to it give up in time, and the QP it served
    // goes to ERR with a fatal event in its own process.
    let (_, bbuf) = connect_ends(&mut ea, &mut eb);
    assert_eq!(write(&mut ea, 3, bbuf).0, WcStatus::Success);
    let engines = engine_pids(b);
    assert_eq!(engines.len(), 1, "one engine serves host B: {engines:?}");
    for &pid in &engines {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid as i32).expect("pid"),
            rustix::process::Signal::KILL,
        );
    }
    let (status, took) = write(&mut ea, 4, bbuf);
    assert_gave_up_in_time(status, took, "a write to a host whose engine was killed");
    eb.send(msg!("state", 3u8));
    let m = eb.expect("state");
    let (state, event, data): (String, String, String) = (m.get(0), m.get(1), m.get(2));
    assert_eq!(state, "Err", "the QP of the dead engine");
    assert_eq!(event, "QpFatal", "the QP of the dead engine reports it");
    assert_eq!(data, "ok", "what landed before the engine died stays");

    // A new engine serves new QPs, in the same processes.
    let (abuf, bbuf) = connect_ends(&mut ea, &mut eb);
    assert_eq!(write(&mut ea, 5, bbuf).0, WcStatus::Success, "A to B anew");
    assert_eq!(write(&mut eb, 6, abuf).0, WcStatus::Success, "B to A anew");
    let now = engine_pids(b);
    assert!(
        now.len() == 1 && now != engines,
        "a new engine serves host B: {now:?}, was {engines:?}"
    );
    for p in [&mut ea, &mut eb] {
        p.send("done");
    }
    ea.finish();
    eb.finish();
}

/// Counters `names` of the engine serving peer `p`'s host.
fn counters(p: &mut Peer, names: &[&str]) -> Vec<u64> {
    let mut line = String::from("counters");
    for n in names {
        line.push(' ');
        line.push_str(n);
    }
    p.send(line);
    let m = p.expect("counters");
    (0..names.len()).map(|i| m.get(i)).collect()
}

#[test]
fn duplicated_reordered_corrupted_and_delayed_packets_are_recovered_from() {
    const T: &str = "faults on the real path";
    let Some(_alone) = hosts_test(T) else {
        return;
    };
    let net = netns::NetPair::new(&netns::NetConfig::default()).expect("make the namespaces");
    let (a, b) = (net.a(), net.b());
    let faults = "dup=5%,reorder=5%,corrupt=5%,delay_us=100";
    let dev = |h: &netns::HostNs, seed: u32| {
        format!("name=roce0,netdev={},{faults},fault_seed={seed}", h.ifname)
    };
    let mut ea = Peer::spawn_in("between_hosts::peer_end", &a.netns, &dev(a, 3));
    let mut eb = Peer::spawn_in("between_hosts::peer_end", &b.netns, &dev(b, 4));
    let (abuf, bbuf) = connect_ends(&mut ea, &mut eb);
    // Strict checks after every message: each WRITE's bytes are all there, in both directions.
    for r in 1..=40u8 {
        let (from, to, buf) = match r % 2 {
            0 => (&mut ea, &mut eb, bbuf),
            _ => (&mut eb, &mut ea, abuf),
        };
        let (status, _) = write(from, r, buf);
        assert_eq!(status, WcStatus::Success, "write {r}");
        to.send(msg!("state", r));
        let m = to.expect("state");
        assert_eq!(m.get::<String>(2), "ok", "the bytes of write {r}");
    }
    let names = [
        "fault_duplicated",
        "fault_reordered",
        "fault_corrupted",
        "fault_delayed",
        "icrc_errors",
        "duplicate_requests",
        "retransmitted_pkts",
    ];
    let (ca, cb) = (counters(&mut ea, &names), counters(&mut eb, &names));
    eprintln!("{T}: A {names:?} = {ca:?}; B = {cb:?}");
    let sum = |i: usize| ca[i] + cb[i];
    for (i, n) in names.iter().enumerate().take(4) {
        assert!(
            ca[i] > 0 && cb[i] > 0,
            "both engines injected {n}: {ca:?} {cb:?}"
        );
    }
    assert!(
        sum(4) > 0,
        "corrupted packets were caught by the ICRC check"
    );
    assert!(
        sum(5) + sum(6) > 0,
        "duplicates and reordering were seen and recovered from: {ca:?} {cb:?}"
    );
    for p in [&mut ea, &mut eb] {
        p.send("done");
    }
    ea.finish();
    eb.finish();
}
