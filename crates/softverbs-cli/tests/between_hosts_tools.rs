//! Unmodified rdma-core programs (`ibverbs-utils`, `perftest`) between two hosts: two
//! network namespaces joined by a veth (`softverbs_cli::netns`), the server in A and the
//! client in B, each under `softverbs run --netdev <its veth>` (the networked device
//! `roce0`, RoCEv2 over UDP 4791, executed by one host engine per namespace).
//!
//! - every tool of `ibverbs_tools.rs` that speaks RC or UD: it exits 0 and prints its result
//!   line, which is parsed (iterations, message size; no timing thresholds);
//! - two pairs at once on the same two hosts;
//! - 1% injected loss on each side: the runs still complete (`softverbs pingpong` checks
//!   every byte), and each engine's counters show the drops and the retransmissions;
//! - captures of the runs (`SOFTVERBS_PCAP`): tshark dissects every packet as RoCEv2 and
//!   scapy's ICRC matches every packet (`softverbs_cli::capture::check`), with the opcodes
//!   each tool must produce.
//!
//! The namespaces have IPv6 on, so the GID table is link-local, IPv4-mapped, global IPv6:
//! the tools are given the index of the IPv4-mapped GID, read from `softverbs devinfo -v`.
//!
//! Needs root, the tools and the drop-in library (`cargo build --workspace` first); without
//! them each test is skipped with a message, except under `CI=true`, where it fails. Every
//! wait is bounded; a failure prints both sides' output and `softverbs nic` of both hosts.
//! The tests take turns (the tools busy-poll; two cores do not run several pairs well).

mod support;

use softverbs_cli::capture::{self, Dissection};
use softverbs_cli::netns::{HostNs, NetConfig, NetPair, available_for_test};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use support::{finish, have_tools, kill, show, spawn};

const SOFTVERBS: &str = env!("CARGO_BIN_EXE_softverbs");
/// The longest any one tool may run.
const RUN_LIMIT: Duration = Duration::from_secs(60);
/// How long a server may take to listen.
const LISTEN_LIMIT: Duration = Duration::from_secs(10);
/// Latency and bandwidth iterations of perftest: enough for a result line, few enough to
/// keep each run around a second.
const PERFTEST_ITERS: &str = "200";

/// One test at a time (see the module docs), and its two hosts.
struct Setup {
    _turn: MutexGuard<'static, ()>,
    net: NetPair,
    /// The index of each host's IPv4-mapped GID (A, B).
    gid: [String; 2],
}

fn setup(test: &str, tools: &[&str]) -> Option<Setup> {
    if !available_for_test(test) || !have_tools(test, tools) {
        return None;
    }
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let net = NetPair::new(&NetConfig::default()).expect("make the namespaces");
    let gid = [ipv4_gid_index(net.a()), ipv4_gid_index(net.b())];
    Some(Setup {
        _turn: turn,
        net,
        gid,
    })
}

/// The device entry of `roce0` on `h`'s veth, with `opts` (`",drop=1%"`, or empty).
fn device_entry(h: &HostNs, opts: &str) -> String {
    format!("name=roce0,netdev={}{opts}", h.ifname)
}

/// The index of the IPv4-mapped GID in `roce0`'s table on `h`, from `softverbs devinfo -v`
/// (lines like `GID[  1]:  0000:0000:0000:0000:0000:ffff:0a4d:0001`).
fn ipv4_gid_index(h: &HostNs) -> String {
    let out = finish(
        vec![(
            "devinfo",
            spawn(
                h.command(SOFTVERBS)
                    .args(["devinfo", "-v", "-d", "roce0"])
                    .env("SOFTVERBS_DEVICES", device_entry(h, "")),
            ),
        )],
        Duration::from_secs(10),
    );
    let text = show(&out[0]);
    let mapped = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("GID["))
        .find(|l| l.contains("0000:0000:0000:0000:0000:ffff:"))
        .and_then(|l| l.split(']').next())
        .map(|i| i.trim().to_owned());
    mapped.unwrap_or_else(|| panic!("no IPv4-mapped GID on {}: {text}", h.ifname))
}

/// `softverbs nic` of `roce0` on `h`: the engine's report, or why there is none.
fn nic(h: &HostNs) -> String {
    let out = finish(
        vec![(
            "nic",
            spawn(
                h.command(SOFTVERBS)
                    .args(["nic", "-d", "roce0"])
                    .env("SOFTVERBS_DEVICES", device_entry(h, "")),
            ),
        )],
        Duration::from_secs(10),
    );
    format!(
        "{}{}",
        String::from_utf8_lossy(&out[0].stdout),
        String::from_utf8_lossy(&out[0].stderr)
    )
}

/// Both hosts' engine reports, for a failure message.
fn nics(net: &NetPair) -> String {
    format!(
        "=== softverbs nic on A ({})\n{}=== softverbs nic on B ({})\n{}",
        net.a().netns,
        nic(net.a()),
        net.b().netns,
        nic(net.b())
    )
}

/// A counter of a `softverbs nic` report (`  name: value`).
fn counter(report: &str, name: &str) -> Option<u64> {
    report
        .lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
}

/// True once a TCP socket listens on `port` in the namespace of process `pid` (read from
/// its /proc/PID/net, so the server's one accept is not used up by a probe).
fn listening(pid: u32, port: u16) -> bool {
    let hex = format!(":{port:04X}");
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[1].ends_with(&hex) && cols[3] == "0A"
            })
        })
    })
}

/// Waits for `child` to listen on `port`; false if it exited or the time ran out.
fn wait_listening(child: &mut Child, port: u16) -> bool {
    let end = Instant::now() + LISTEN_LIMIT;
    while Instant::now() < end {
        if listening(child.id(), port) {
            return true;
        }
        if child.try_wait().expect("try_wait").is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// How a tool is started on each side.
#[derive(Clone, Default)]
struct Sides<'a> {
    /// Options joined to each side's device entry (A, B): `",drop=1%,fault_seed=7"`.
    faults: [&'a str; 2],
    /// A capture of B's engine (`SOFTVERBS_PCAP`), if it is started by this run.
    pcap: Option<&'a Path>,
}

/// `softverbs run --netdev IF<opts> -- ARGS` on `h`.
fn run_on(h: &HostNs, opts: &str, args: &[&str]) -> Command {
    let mut cmd = h.command(SOFTVERBS);
    cmd.arg("run")
        .arg("--netdev")
        .arg(format!("{}{opts}", h.ifname))
        .arg("--")
        .args(args)
        .env_remove("SOFTVERBS_DEVICES")
        .env_remove("SOFTVERBS_PCAP");
    cmd
}

/// A tool's server started on A, listening.
struct Started<'a> {
    what: String,
    server: Child,
    client: Command,
    net: &'a NetPair,
}

/// Starts `args` as the server on A (on TCP `port`) and makes the client's command for B
/// (the same arguments and A's address); panics with the server's output if it does not
/// listen.
fn start<'a>(net: &'a NetPair, sides: &Sides<'_>, port: u16, args: &[&str]) -> Started<'a> {
    let port_s = port.to_string();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["-p", &port_s]);
    let mut server = spawn(&mut run_on(net.a(), sides.faults[0], &all));
    if !wait_listening(&mut server, port) {
        let nics = nics(net);
        let out = finish(vec![("server", server)], Duration::ZERO);
        panic!(
            "{args:?}: the server did not listen on {port}\n=== server\n{}\n{nics}",
            show(&out[0])
        );
    }
    let a_ip = net.a().ipv4.to_string();
    all.push(&a_ip);
    let mut client = run_on(net.b(), sides.faults[1], &all);
    if let Some(p) = sides.pcap {
        client.env("SOFTVERBS_PCAP", p);
    }
    Started {
        what: args.join(" "),
        server,
        client,
        net,
    }
}

/// What a pair printed: (client, server) standard output.
struct Ran {
    client: String,
    server: String,
}

/// Runs started pairs at once to their end; each side must exit 0, else the panic shows
/// every side's output and both engines' reports (read before anything is killed).
fn run_all(pairs: Vec<Started<'_>>) -> Vec<Ran> {
    let Some(net) = pairs.first().map(|p| p.net) else {
        return Vec::new();
    };
    let mut children = Vec::new();
    let mut what = Vec::new();
    for mut p in pairs {
        children.push(("server", p.server));
        children.push(("client", spawn(&mut p.client)));
        what.push(p.what);
    }
    // Wait here rather than in `finish`, so a hang is reported with the engines' state.
    let end = Instant::now() + RUN_LIMIT;
    while Instant::now() < end
        && children
            .iter_mut()
            .any(|(_, c)| c.try_wait().expect("try_wait").is_none())
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let hung = children
        .iter_mut()
        .any(|(_, c)| c.try_wait().expect("try_wait").is_none());
    let report = if hung { nics(net) } else { String::new() };
    let outs = finish(children, Duration::ZERO);
    let failed = hung || outs.iter().any(|o| !o.status.success());
    if failed {
        let report = if hung { report } else { nics(net) };
        let mut msg = String::new();
        for (i, w) in what.iter().enumerate() {
            msg += &format!(
                "##### {w}\n=== server (A)\n{}\n=== client (B)\n{}\n",
                show(&outs[2 * i]),
                show(&outs[2 * i + 1])
            );
        }
        panic!(
            "{}\n{msg}{report}",
            if hung {
                "a run did not finish within its time"
            } else {
                "a side failed"
            }
        );
    }
    outs.chunks(2)
        .map(|o| Ran {
            server: String::from_utf8_lossy(&o[0].stdout).into_owned(),
            client: String::from_utf8_lossy(&o[1].stdout).into_owned(),
        })
        .collect()
}

/// Runs `args` as server on A and client on B; both must exit 0.
fn run_pair(s: &Setup, sides: &Sides<'_>, port: u16, args: &[&str]) -> Ran {
    let started = start(&s.net, sides, port, args);
    run_all(vec![started]).pop().expect("one pair")
}

/// The `N iters in T seconds = X usec/iter` line of an `ibv_*_pingpong` end: N.
fn pingpong_iters(out: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| l.contains(" iters in ") && l.ends_with("usec/iter"))
        .unwrap_or_else(|| panic!("no `iters in` line: {out}"));
    let mut words = line.split_whitespace();
    let iters = words.next().and_then(|w| w.parse().ok());
    let secs: Option<f64> = words.nth(2).and_then(|w| w.parse().ok());
    assert!(secs.is_some_and(|t| t >= 0.0), "{line}");
    iters.unwrap_or_else(|| panic!("{line}"))
}

/// An `ibv_*_pingpong` tool between the hosts, with the IPv4-mapped GID; both ends must
/// report `iters` iterations.
fn pingpong(s: &Setup, sides: &Sides<'_>, port: u16, tool: &str, extra: &[&str], iters: u64) {
    assert_eq!(s.gid[0], s.gid[1], "both hosts have the same GID layout");
    let mut args = vec![tool, "-g", &s.gid[0]];
    args.extend_from_slice(extra);
    let ran = run_pair(s, sides, port, &args);
    assert_eq!(pingpong_iters(&ran.client), iters, "{}", ran.client);
    assert_eq!(pingpong_iters(&ran.server), iters, "{}", ran.server);
    println!("{args:?} client:\n{}", ran.client);
}

/// A perftest result row: the line after the `#bytes` header, as numbers.
fn perftest_row(out: &str) -> Vec<f64> {
    let mut lines = out
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("#bytes"));
    let header = lines
        .next()
        .unwrap_or_else(|| panic!("no #bytes header: {out}"));
    let row = lines
        .find(|l| !l.trim().is_empty())
        .unwrap_or_else(|| panic!("no result row after `{header}`: {out}"));
    let cols: Vec<f64> = row
        .split_whitespace()
        .map(|c| {
            c.parse()
                .unwrap_or_else(|_| panic!("`{c}` in `{row}`: {out}"))
        })
        .collect();
    assert_eq!(
        cols.len(),
        // `#bytes #iterations BW peak[MB/sec] ...`: the names hold spaces, the units not.
        header
            .split_whitespace()
            .filter(|w| w.starts_with('#'))
            .count()
            + header.matches('[').count(),
        "`{header}` / `{row}`"
    );
    cols
}

/// A perftest tool between the hosts (`-x` the IPv4-mapped GID, `-n` iterations); the
/// client's row must be for `bytes` and the iterations asked for.
fn perftest(s: &Setup, sides: &Sides<'_>, port: u16, tool: &str, extra: &[&str], bytes: u64) {
    let mut args = vec![tool, "-x", &s.gid[0], "-n", PERFTEST_ITERS];
    args.extend_from_slice(extra);
    let ran = run_pair(s, sides, port, &args);
    let row = perftest_row(&ran.client);
    assert_eq!(row[0], bytes as f64, "message size: {}", ran.client);
    assert_eq!(
        row[1],
        PERFTEST_ITERS.parse::<f64>().unwrap(),
        "iterations: {}",
        ran.client
    );
    assert!(row.iter().all(|x| *x >= 0.0), "{}", ran.client);
    println!("{args:?} client:\n{}", ran.client);
}

const PP: &[&str] = &[
    "ibv_rc_pingpong",
    "ibv_ud_pingpong",
    "ibv_srq_pingpong",
    "ibv_xsrq_pingpong",
];

#[test]
fn ibv_rc_pingpong_between_hosts() {
    let Some(s) = setup("ibv_rc_pingpong between hosts", &["ibv_rc_pingpong"]) else {
        return;
    };
    let sides = Sides::default();
    pingpong(&s, &sides, 18515, "ibv_rc_pingpong", &[], 1000);
    pingpong(
        &s,
        &sides,
        18516,
        "ibv_rc_pingpong",
        &["-s", "1", "-n", "2000"],
        2000,
    );
    pingpong(
        &s,
        &sides,
        18517,
        "ibv_rc_pingpong",
        &["-s", "65536", "-n", "200"],
        200,
    );
    pingpong(
        &s,
        &sides,
        18518,
        "ibv_rc_pingpong",
        &["-e", "-n", "500"],
        500,
    );
}

#[test]
fn ibv_ud_and_srq_pingpong_between_hosts() {
    let Some(s) = setup("ibv_ud/srq_pingpong between hosts", PP) else {
        return;
    };
    let sides = Sides::default();
    pingpong(&s, &sides, 18515, "ibv_ud_pingpong", &[], 1000);
    pingpong(&s, &sides, 18516, "ibv_srq_pingpong", &["-n", "500"], 500);
}

/// XRC between hosts: the server's targets and XRC SRQs, the client's initiators naming an
/// SRQ in every message's XRCETH. Both ends print `success` (the tool prints no counts).
#[test]
fn ibv_xsrq_pingpong_between_hosts() {
    let Some(s) = setup("ibv_xsrq_pingpong between hosts", PP) else {
        return;
    };
    let args = ["ibv_xsrq_pingpong", "-g", &s.gid[0], "-n", "50"];
    let ran = run_pair(&s, &Sides::default(), 18517, &args);
    for (side, out) in [("client", &ran.client), ("server", &ran.server)] {
        assert!(out.lines().any(|l| l.trim() == "success"), "{side}: {out}");
    }
}

const LAT: &[&str] = &[
    "ib_send_lat",
    "ib_write_lat",
    "ib_read_lat",
    "ib_atomic_lat",
];
const BW: &[&str] = &["ib_send_bw", "ib_write_bw", "ib_read_bw", "ib_atomic_bw"];

#[test]
fn perftest_latency_between_hosts() {
    let Some(s) = setup("perftest latency between hosts", LAT) else {
        return;
    };
    let sides = Sides::default();
    // perftest's default sizes: 2 bytes for latency, 8 for atomics.
    for (i, (tool, bytes)) in LAT.iter().zip([2, 2, 2, 8]).enumerate() {
        perftest(&s, &sides, 18515 + i as u16, tool, &[], bytes);
    }
}

#[test]
fn perftest_bandwidth_between_hosts() {
    let Some(s) = setup("perftest bandwidth between hosts", BW) else {
        return;
    };
    let sides = Sides::default();
    // 64 KiB for bandwidth, 8 bytes for atomics.
    for (i, (tool, bytes)) in BW.iter().zip([65536, 65536, 65536, 8]).enumerate() {
        perftest(&s, &sides, 18515 + i as u16, tool, &[], bytes);
    }
}

/// Two `ibv_rc_pingpong` pairs at once on the same two hosts (so on the same two engines),
/// on different TCP ports; both complete.
#[test]
fn two_pairs_at_once_between_the_same_hosts() {
    let Some(s) = setup("two pairs at once", &["ibv_rc_pingpong"]) else {
        return;
    };
    let sides = Sides::default();
    let args = ["ibv_rc_pingpong", "-g", &s.gid[0], "-n", "500"];
    let first = start(&s.net, &sides, 18515, &args);
    let second = start(
        &s.net,
        &sides,
        18516,
        &[&args[..], &["-s", "65536"]].concat(),
    );
    let ran = run_all(vec![first, second]);
    assert_eq!(ran.len(), 2);
    for r in &ran {
        assert_eq!(pingpong_iters(&r.client), 500, "{}", r.client);
        assert_eq!(pingpong_iters(&r.server), 500, "{}", r.server);
    }
}

/// Holds `roce0` open on `h` (so its engine, started with these options, stays up between
/// runs and its counters can be read at the end): an `ibv_rc_pingpong` server that waits
/// for a client that never comes. Its QP, and so the engine, exists once it listens.
fn hold_engine(h: &HostNs, opts: &str, gid: &str, pcap: Option<&Path>) -> Child {
    const PORT: u16 = 18600;
    let mut cmd = run_on(h, opts, &["ibv_rc_pingpong", "-g", gid, "-p", "18600"]);
    if let Some(p) = pcap {
        cmd.env("SOFTVERBS_PCAP", p);
    }
    let mut holder = spawn(&mut cmd);
    if !wait_listening(&mut holder, PORT) {
        let out = finish(vec![("holder", holder)], Duration::ZERO);
        panic!("the holder on {} did not start: {}", h.netns, show(&out[0]));
    }
    holder
}

/// Waits (bounded) until `h` has no engine running (it has written its capture and left):
/// until nothing in its namespace holds UDP port 4791. Read from /proc/net/udp* in the
/// namespace rather than asked of the engine, as `softverbs nic` would be: a client
/// connecting would keep the engine up a little longer every time.
fn wait_engine_gone(h: &HostNs) {
    let bound = || {
        let out = h
            .command("cat")
            .args(["/proc/net/udp", "/proc/net/udp6"])
            .output()
            .expect("cat");
        String::from_utf8_lossy(&out.stdout).lines().any(|l| {
            l.split_whitespace()
                .nth(1)
                .is_some_and(|a| a.ends_with(":12B7"))
        })
    };
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        if !bound() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the engine on {} did not stop: {}", h.netns, nic(h));
}

fn pcap_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "softverbs-between-hosts-{}-{name}.pcap",
        std::process::id()
    ))
}

/// 1% of the packets dropped on each side, by each engine's fault injector: an
/// `ibv_rc_pingpong -s 65536` and an `ib_write_bw` still complete, and each engine counts
/// `fault_dropped` > 0 and `retransmitted_pkts` > 0 (read from `softverbs nic` while a
/// holder keeps the engines up). The capture of B's engine over both runs is clean RoCEv2
/// and shows PSN sequence NAKs. Then a `softverbs pingpong` under the same loss (every byte
/// of every message checked by both ends; it addresses the peer by GID 0, the link-local
/// one) completes too.
#[test]
fn one_percent_loss_each_way_is_recovered() {
    let Some(s) = setup("1% loss", &["ibv_rc_pingpong", "ib_write_bw"]) else {
        return;
    };
    let tools = capture::tools_for_test("1% loss capture");
    let pcap = pcap_path("loss");
    let _ = std::fs::remove_file(&pcap);
    let faults = [",drop=1%,fault_seed=7", ",drop=1%,fault_seed=11"];
    let mut holders = vec![
        hold_engine(s.net.a(), faults[0], &s.gid[0], None),
        hold_engine(s.net.b(), faults[1], &s.gid[1], Some(&pcap)),
    ];
    let sides = Sides { faults, pcap: None };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pingpong(
            &s,
            &sides,
            18515,
            "ibv_rc_pingpong",
            &["-s", "65536", "-n", "50"],
            50,
        );
        perftest(&s, &sides, 18516, "ib_write_bw", &[], 65536);
        // The counters, while the holders keep both engines up.
        for h in [s.net.a(), s.net.b()] {
            let report = nic(h);
            println!("softverbs nic on {} after the runs:\n{report}", h.netns);
            for c in ["fault_dropped", "retransmitted_pkts"] {
                let n = counter(&report, c);
                assert!(n.is_some_and(|n| n > 0), "{c} on {}: {report}", h.netns);
            }
        }
    }));
    for h in &mut holders {
        kill(h);
        let _ = h.wait();
    }
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    if let Some(tools) = tools {
        wait_engine_gone(s.net.b());
        let d = check_capture(&tools, &pcap);
        for op in ["RC Send First", "RC RDMA Write First", "RC Acknowledge"] {
            assert!(count(&d, op) > 0, "{op}: {d:?}");
        }
        assert!(
            d.naks.get("psn_seq").copied().unwrap_or(0) > 0,
            "PSN sequence NAKs: {d:?}"
        );
        let _ = std::fs::remove_file(&pcap);
    }
    // softverbs pingpong: the client connects (retrying) to the server; both check every
    // byte of every message.
    let pp = |h: &HostNs, opts: &str, peer: Option<String>| {
        let mut cmd = h.command(SOFTVERBS);
        cmd.args(["pingpong", "-p", "18517", "-n", "100", "--timeout", "30"])
            .args(peer)
            .env_remove("SOFTVERBS_PCAP")
            .env("SOFTVERBS_DEVICES", device_entry(h, opts));
        spawn(&mut cmd)
    };
    let server = pp(s.net.a(), faults[0], None);
    let client = pp(s.net.b(), faults[1], Some(s.net.a().ipv4.to_string()));
    let children = vec![("server", server), ("client", client)];
    let outs = finish(children, RUN_LIMIT);
    assert!(
        outs.iter().all(|o| o.status.success()),
        "softverbs pingpong under 1% loss\n=== server\n{}\n=== client\n{}\n{}",
        show(&outs[0]),
        show(&outs[1]),
        nics(&s.net)
    );
    let served = show(&outs[0]);
    assert!(served.contains("(data checked"), "{served}");
    let client = show(&outs[1]);
    assert!(client.contains("round trip"), "{client}");
    println!("softverbs pingpong under 1% loss, client:\n{client}");
}

/// Bulk traffic is batched: 64 KiB messages each way (`ibv_rc_pingpong -s 65536 -c`, which
/// checks every byte it receives) leave each engine in GSO sends and arrive in GRO reads
/// (`gso_sends`, `gro_reads`), with no ICRC error although segment `k` of a GSO send
/// carries IPv4 identification `k`. Then A's veth takes at most one segment per packet
/// (`gso_max_segs 1`), so the kernel cuts A's GSO sends into datagrams before the wire and
/// B receives them one by one, their identifications unseen: B recovers each from its ICRC
/// and still counts no ICRC error.
#[test]
fn bulk_traffic_is_batched_and_segments_keep_their_icrc() {
    let Some(s) = setup("GSO and GRO between hosts", &["ibv_rc_pingpong"]) else {
        return;
    };
    let mut holders = vec![
        hold_engine(s.net.a(), "", &s.gid[0], None),
        hold_engine(s.net.b(), "", &s.gid[1], None),
    ];
    let sides = Sides::default();
    let big = ["-s", "65536", "-n", "100", "-c"];
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pingpong(&s, &sides, 18515, "ibv_rc_pingpong", &big, 100);
        let mut before = Vec::new();
        for h in [s.net.a(), s.net.b()] {
            let report = nic(h);
            let c =
                |name: &str| counter(&report, name).unwrap_or_else(|| panic!("{name}: {report}"));
            println!("softverbs nic on {}:\n{report}", h.netns);
            assert!(c("gso_sends") > 0, "{report}");
            assert!(c("gso_datagrams") > 10 * c("gso_sends"), "{report}");
            assert!(c("gro_reads") > 0, "{report}");
            assert_eq!(c("icrc_errors"), 0, "{report}");
            before.push((c("rcvd_pkts"), c("gro_datagrams")));
        }
        s.net
            .a()
            .ip(&["link", "set", "dev", &s.net.a().ifname, "gso_max_segs", "1"])
            .expect("gso_max_segs");
        pingpong(&s, &sides, 18516, "ibv_rc_pingpong", &big, 100);
        let report = nic(s.net.b());
        println!("softverbs nic on B, A's sends cut by the kernel:\n{report}");
        let c = |name: &str| counter(&report, name).unwrap_or_else(|| panic!("{name}: {report}"));
        // 100 messages of 64 packets from A at least, none of them read in a batch.
        assert!(c("rcvd_pkts") >= before[1].0 + 6400, "{report}");
        assert_eq!(c("gro_datagrams"), before[1].1, "{report}");
        assert_eq!(c("icrc_errors"), 0, "{report}");
    }));
    for h in &mut holders {
        kill(h);
        let _ = h.wait();
    }
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// `SOFTVERBS_ENGINE_CPUS` places the engine a program starts (`perf --net` puts two
/// namespaces' engines on one CPU for its latency tests that way): the engine runs on the
/// CPUs listed, not on its program's; a list the system cannot take fails the program's
/// device with an error naming the variable, and leaves no engine behind.
#[test]
fn the_engine_runs_on_the_cpus_it_is_given() {
    let Some(s) = setup("engine CPUs", &["ibv_rc_pingpong"]) else {
        return;
    };
    let h = s.net.a();
    let mut cmd = run_on(h, "", &["ibv_rc_pingpong", "-g", &s.gid[0], "-p", "18601"]);
    cmd.env("SOFTVERBS_ENGINE_CPUS", "0");
    let mut holder = spawn(&mut cmd);
    if !wait_listening(&mut holder, 18601) {
        let out = finish(vec![("holder", holder)], Duration::ZERO);
        panic!("the holder did not start: {}", show(&out[0]));
    }
    let report = nic(h);
    let pid: u32 = report
        .lines()
        .find_map(|l| l.strip_prefix("engine: pid "))
        .and_then(|l| l.split(',').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no engine pid in: {report}"));
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("engine status");
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(str::trim);
    kill(&mut holder);
    let _ = holder.wait();
    assert_eq!(allowed, Some("0"), "{status}");
    wait_engine_gone(h);

    for bad in ["1-0", "x", "4096"] {
        let mut cmd = h.command(SOFTVERBS);
        cmd.args(["pingpong", "--loopback", "-d", "roce0", "-n", "10"])
            .env("SOFTVERBS_DEVICES", device_entry(h, ""))
            .env("SOFTVERBS_ENGINE_CPUS", bad);
        let out = finish(vec![("pingpong", spawn(&mut cmd))], RUN_LIMIT);
        let err = String::from_utf8_lossy(&out[0].stderr);
        assert_eq!(out[0].status.code(), Some(1), "{}", show(&out[0]));
        assert!(
            err.contains(&format!("SOFTVERBS_ENGINE_CPUS={bad}")),
            "{}",
            show(&out[0])
        );
        wait_engine_gone(h);
    }
}

/// The engine's capture of an `ibv_rc_pingpong` over the link-local IPv6 GIDs (index 0):
/// clean RoCEv2, like the IPv4 ones (packets it received included: IPv6 forbids a zero UDP
/// checksum, so the engine computes the one the wire carried when it captures).
#[test]
fn capture_over_link_local_ipv6_is_clean_roce() {
    let Some(s) = setup("link-local capture", &["ibv_rc_pingpong"]) else {
        return;
    };
    let Some(d) = captured(&s, "link_local", |sides| {
        let args = ["ibv_rc_pingpong", "-g", "0", "-n", "50"];
        let ran = run_pair(&s, sides, 18515, &args);
        assert_eq!(pingpong_iters(&ran.client), 50, "{}", ran.client);
    }) else {
        return;
    };
    assert!(count(&d, "RC Send First") > 0, "{d:?}");
}

fn count(d: &Dissection, op: &str) -> u64 {
    d.opcodes.get(op).copied().unwrap_or(0)
}

/// `capture::check` of `pcap`, which must hold packets; the dissection.
fn check_capture(tools: &capture::Tools, pcap: &Path) -> Dissection {
    let d =
        capture::check(tools, pcap).unwrap_or_else(|e| panic!("capture {}: {e}", pcap.display()));
    assert!(d.packets > 0, "{}: empty", pcap.display());
    println!(
        "{}: {} packets, {:?}, {:?}",
        pcap.display(),
        d.packets,
        d.opcodes,
        d.naks
    );
    d
}

/// Runs `run` with B's engine capturing to a fresh file, waits for the engine to leave,
/// and checks the capture; the dissection.
fn captured(s: &Setup, name: &str, run: impl FnOnce(&Sides<'_>)) -> Option<Dissection> {
    let tools = capture::tools_for_test(name)?;
    let pcap = pcap_path(name);
    let _ = std::fs::remove_file(&pcap);
    run(&Sides {
        faults: ["", ""],
        pcap: Some(&pcap),
    });
    wait_engine_gone(s.net.b());
    let d = check_capture(&tools, &pcap);
    let _ = std::fs::remove_file(&pcap);
    Some(d)
}

/// Captures of `ib_write_bw`, `ib_read_bw`, `ib_atomic_bw` (fetch-and-add and
/// compare-and-swap), `ibv_rc_pingpong` and `ibv_ud_pingpong` between the hosts, one
/// engine start each: clean RoCEv2 (tshark, scapy's ICRC), with the packets each tool
/// makes: WRITE first/middle/last and ACKs; READ requests and responses; atomics and their
/// atomic ACKs; RC SENDs and ACKs; UD SENDs.
#[test]
fn captures_of_the_tools_are_clean_roce() {
    let tools = [
        "ib_write_bw",
        "ib_read_bw",
        "ib_atomic_bw",
        "ibv_rc_pingpong",
        "ibv_ud_pingpong",
    ];
    let Some(s) = setup("captures of the tools", &tools) else {
        return;
    };
    let mut port = 18515;
    let mut next = || {
        port += 1;
        port
    };
    let mut expect = |name: &str, run: &dyn Fn(&Sides<'_>, u16), want: &[&str]| {
        let p = next();
        let Some(d) = captured(&s, name, |sides| run(sides, p)) else {
            return;
        };
        for op in want {
            assert!(count(&d, op) > 0, "{name}: no `{op}` in {:?}", d.opcodes);
        }
    };
    expect(
        "ib_write_bw",
        &|sides, p| perftest(&s, sides, p, "ib_write_bw", &[], 65536),
        &[
            "RC RDMA Write First",
            "RC RDMA Write Middle",
            "RC RDMA Write Last",
            "RC Acknowledge",
        ],
    );
    expect(
        "ib_read_bw",
        &|sides, p| perftest(&s, sides, p, "ib_read_bw", &[], 65536),
        &[
            "RC RDMA Read Request",
            "RC RDMA Read Response First",
            "RC RDMA Read Response Middle",
            "RC RDMA Read Response Last",
        ],
    );
    expect(
        "ib_atomic_bw_fetch_add",
        &|sides, p| perftest(&s, sides, p, "ib_atomic_bw", &["-A", "FETCH_AND_ADD"], 8),
        &["RC Fetch Add", "RC Atomic Acknowledge"],
    );
    expect(
        "ib_atomic_bw_cmp_swap",
        &|sides, p| perftest(&s, sides, p, "ib_atomic_bw", &["-A", "CMP_AND_SWAP"], 8),
        &["RC Compare Swap", "RC Atomic Acknowledge"],
    );
    expect(
        "ibv_rc_pingpong",
        &|sides, p| pingpong(&s, sides, p, "ibv_rc_pingpong", &["-n", "200"], 200),
        &[
            "RC Send First",
            "RC Send Middle",
            "RC Send Last",
            "RC Acknowledge",
        ],
    );
    expect(
        "ibv_rc_pingpong_small",
        &|sides, p| {
            pingpong(
                &s,
                sides,
                p,
                "ibv_rc_pingpong",
                &["-s", "1", "-n", "200"],
                200,
            )
        },
        &["RC Send Only", "RC Acknowledge"],
    );
    expect(
        "ibv_ud_pingpong",
        &|sides, p| pingpong(&s, sides, p, "ibv_ud_pingpong", &["-n", "200"], 200),
        &["UD Send Only"],
    );
}
