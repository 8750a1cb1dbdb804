//! Unmodified connection-manager programs through the drop-in `librdmacm.so.1` (crate
//! `softverbs-rdmacm`), which `softverbs run` loads beside the drop-in `libibverbs.so.1`:
//!
//! - rdmacm-utils: `rping`, `ucmatose` (four connections), `udaddy` (UD, SIDR),
//!   `rdma_server`/`rdma_client` (synchronous ids, `rdma_create_ep`), `cmtime`, `mckey`
//!   (multicast joins: an IP multicast group between hosts);
//! - perftest with `-R`: `ib_send_lat`, `ib_write_bw`, `ib_read_lat`; qperf's RC tests
//!   with `-cm1`;
//! - libfabric's verbs provider: `fi_info` lists MSG endpoints, `fi_pingpong` over `msg`
//!   and over `verbs;ofi_rxm` `rdm`;
//! - `tests/c/cm_events.c`, for what goes wrong: a reject with private data, a connect to
//!   a port nobody listens on, a peer killed mid-connection, a peer that never answers, and
//!   the rules of multicast joins.
//!
//! Each runs on one host (`softverbs0`, 127.0.0.1) and between two network namespaces over a
//! veth (`roce0` on each side, the CM's MADs on QP1 through each host's engine). libfabric
//! skips loopback interfaces, so its one-host runs use `roce0` inside one namespace.
//! Results are read from what the programs print (counts, statuses, private data), with
//! generous bounds only where the behaviour is a time (the CM timeout).
//!
//! Needs the tools (and gcc with librdmacm-dev for `cm_events`), and root for the
//! namespaces; without them a test is skipped with a message, except under `CI=true`.
//! The tests take turns: the tools busy-poll, and two cores do not run two pairs well.

mod support;

use softverbs_cli::netns::{HostNs, NetConfig, NetPair, available_for_test};
use std::path::PathBuf;
use std::process::{Child, Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use support::{finish, have_tools, kill, show, spawn};

const SOFTVERBS: &str = env!("CARGO_BIN_EXE_softverbs");
/// The longest a pair may run.
const RUN_LIMIT: Duration = Duration::from_secs(60);

fn turn() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where a program runs: this host (`softverbs0`), or a namespace with `roce0` on its veth.
#[derive(Clone, Copy)]
enum On<'a> {
    Here,
    Host(&'a HostNs),
}

impl On<'_> {
    /// `softverbs run [--netdev IF] -- args`.
    fn run(&self, args: &[&str]) -> Command {
        let mut cmd = match self {
            On::Here => Command::new(SOFTVERBS),
            On::Host(h) => h.command(SOFTVERBS),
        };
        cmd.arg("run");
        if let On::Host(h) = self {
            cmd.arg("--netdev").arg(&h.ifname);
        }
        cmd.arg("--").args(args).env_remove("SOFTVERBS_DEVICES");
        cmd
    }

    /// The address a peer connects to.
    fn addr(&self) -> String {
        match self {
            On::Here => "127.0.0.1".into(),
            On::Host(h) => h.ipv4.to_string(),
        }
    }
}

/// True once the process `pid`'s namespace has the CM listener of `port` in the TCP, UDP or
/// IB port space (the abstract socket `softverbs-cm/svc/<service id>` the drop-in binds), or
/// a TCP listener on it (for tools with a TCP control connection).
fn listening(pid: u32, port: u16) -> bool {
    let unix = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
    for ps in [0x0106u64, 0x0111, 0x013f] {
        let svc = format!("@softverbs-cm/svc/{:016x}", (ps << 16) | u64::from(port));
        if unix.lines().any(|l| l.ends_with(&svc)) {
            return true;
        }
    }
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

/// Waits until `server` listens on `port`; panics with its output if it exits or is slow.
fn wait_listening(server: &mut Child, port: u16, what: &str) {
    let end = Instant::now() + Duration::from_secs(15);
    while Instant::now() < end {
        if listening(server.id(), port) {
            return;
        }
        if server.try_wait().expect("try_wait").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    kill(server);
    let out = server_output(server);
    panic!(
        "{what}: the server did not listen on {port}\n{}",
        show(&out)
    );
}

fn server_output(server: &mut Child) -> Output {
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    use std::io::Read;
    if let Some(o) = server.stdout.as_mut() {
        let _ = o.read_to_end(&mut stdout);
    }
    if let Some(e) = server.stderr.as_mut() {
        let _ = e.read_to_end(&mut stderr);
    }
    Output {
        status: server.wait().expect("wait"),
        stdout,
        stderr,
    }
}

/// Runs `server` on `s` (listening on `port`), then `client` on `c`; both outputs. The
/// server gets a few seconds to finish after the client.
fn pair(s: On<'_>, server: &[&str], port: u16, c: On<'_>, client: &[&str]) -> [Output; 2] {
    pair_with(s, server, port, c, client, Duration::from_secs(10))
}

/// As [`pair`], with `linger` for the server after the client (zero: a server that never
/// ends by itself, killed when the client is done).
fn pair_with(
    s: On<'_>,
    server: &[&str],
    port: u16,
    c: On<'_>,
    client: &[&str],
    linger: Duration,
) -> [Output; 2] {
    let what = format!("{} / {}", server.join(" "), client.join(" "));
    let mut srv = spawn(&mut s.run(server));
    wait_listening(&mut srv, port, &what);
    let cli = spawn(&mut c.run(client));
    let client = finish(vec![("client", cli)], RUN_LIMIT)
        .pop()
        .expect("client");
    let server = finish(vec![("server", srv)], linger).pop().expect("server");
    [server, client]
}

fn both(out: &[Output; 2]) -> String {
    format!(
        "=== server\n{}\n=== client\n{}",
        show(&out[0]),
        show(&out[1])
    )
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

fn assert_ok(out: &[Output; 2]) {
    assert!(
        out[0].status.success() && out[1].status.success(),
        "a side failed\n{}",
        both(out)
    );
}

/// The namespaces of the between-hosts runs, if this machine can make them.
fn hosts(test: &str) -> Option<NetPair> {
    available_for_test(test).then(|| NetPair::new(&NetConfig::default()).expect("namespaces"))
}

// ---- rdmacm-utils --------------------------------------------------------------------------

fn rping(s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    let out = pair(
        s,
        &["rping", "-s", "-v", "-C", "10", "-a", &addr, "-p", "7480"],
        7480,
        c,
        &["rping", "-c", "-v", "-C", "10", "-a", &addr, "-p", "7480"],
    );
    assert_ok(&out);
    let count =
        |o: &Output, prefix: &str| text(o).lines().filter(|l| l.starts_with(prefix)).count();
    assert_eq!(
        count(&out[1], "ping data: rdma-ping-"),
        10,
        "{}",
        both(&out)
    );
    assert_eq!(
        count(&out[0], "server ping data: rdma-ping-"),
        10,
        "{}",
        both(&out)
    );
}

fn ucmatose(s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    let out = pair(
        s,
        &["ucmatose", "-c", "4", "-C", "10"],
        7471,
        c,
        &["ucmatose", "-s", &addr, "-c", "4", "-C", "10"],
    );
    assert_ok(&out);
    for o in &out {
        let t = text(o);
        assert!(
            t.contains("data transfers complete") && t.contains("return status 0"),
            "{}",
            both(&out)
        );
    }
}

fn udaddy(s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    let out = pair(s, &["udaddy"], 7174, c, &["udaddy", "-s", &addr]);
    assert_ok(&out);
    for o in &out {
        assert!(text(o).contains("return status 0"), "{}", both(&out));
    }
}

/// `mckey`: a receiver joins group `group` on `s`, a sender joins on `c` and sends 10
/// datagrams to it (each waits 3 s after joining, as mckey does for a subnet manager); the
/// receiver returns only once all 10 arrived.
fn mckey(s: On<'_>, c: On<'_>, group: &str) {
    let (sa, ca) = (s.addr(), c.addr());
    let rcv = spawn(&mut s.run(&["mckey", "-m", group, "-b", &sa, "-C", "10"]));
    // The receiver's join comes well inside the 3 s the sender waits after its own.
    std::thread::sleep(Duration::from_millis(500));
    let snd = spawn(&mut c.run(&["mckey", "-m", group, "-b", &ca, "-s", "-C", "10"]));
    let mut out = finish(vec![("sender", snd), ("receiver", rcv)], RUN_LIMIT).into_iter();
    let out = [out.next().expect("sender"), out.next().expect("receiver")];
    assert_ok(&out);
    for o in &out {
        let t = text(o);
        assert!(
            t.contains(&format!("joined dgid: ::ffff:{group}"))
                && t.contains("data transfers complete")
                && t.contains("return status 0"),
            "{}",
            both(&out)
        );
    }
}

fn rdma_server_client(s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    let out = pair(
        s,
        &["rdma_server", "-p", "7481"],
        7481,
        c,
        &["rdma_client", "-s", &addr, "-p", "7481"],
    );
    assert_ok(&out);
    assert!(
        text(&out[0]).contains("rdma_server: end 0"),
        "{}",
        both(&out)
    );
    assert!(
        text(&out[1]).contains("rdma_client: end 0"),
        "{}",
        both(&out)
    );
}

/// `cmtime`'s row for `step`: total ms, max ms, min µs, µs a connection.
fn cmtime_row(t: &str, step: &str) -> Option<[f64; 4]> {
    let line = t.lines().find(|l| {
        l.split_once(':')
            .is_some_and(|(name, _)| name.trim() == step)
    })?;
    let nums: Vec<f64> = line
        .split(':')
        .nth(1)?
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    nums.try_into().ok()
}

fn cmtime(s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    let out = pair_with(
        s,
        &["cmtime", "-p", "7482", "-c", "20"],
        7482,
        c,
        &["cmtime", "-s", &addr, "-p", "7482", "-c", "20"],
        Duration::ZERO,
    );
    let t = text(&out[1]);
    assert!(out[1].status.success(), "{}", both(&out));
    assert!(
        !t.contains("REJECTED") && !t.contains("UNREACHABLE"),
        "{}",
        both(&out)
    );
    for step in [
        "create id",
        "resolve addr",
        "resolve route",
        "create qp",
        "connect",
        "disconnect",
    ] {
        let row = cmtime_row(&t, step).unwrap_or_else(|| panic!("no `{step}` row\n{}", both(&out)));
        assert!(
            row[0] >= 0.0 && row[3] >= 0.0,
            "{step}: {row:?}\n{}",
            both(&out)
        );
    }
}

// ---- perftest -R ---------------------------------------------------------------------------

fn perftest_r(s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    // A port each: a server that has just ended may still hold the last one.
    for (tool, port) in [
        ("ib_send_lat", 7483),
        ("ib_write_bw", 7490),
        ("ib_read_lat", 7491),
    ] {
        let p = port.to_string();
        let run = || {
            pair(
                s,
                &[tool, "-R", "-n", "200", "-p", &p],
                port,
                c,
                &[tool, "-R", "-n", "200", "-p", &p, &addr],
            )
        };
        let mut out = run();
        // perftest's own race: after the handshake on its first connection the client
        // connects the test connection at once, while the server only then creates and
        // binds its listener. A REQ that wins finds no listener and is rejected with
        // "invalid service ID" (8), as the kernel's CM rejects it. Only that is retried (on
        // a fast machine the client wins often: 3 runs in a row once lost it).
        for _ in 0..5 {
            if !text(&out[1]).contains("RDMA_CM_EVENT_REJECTED; error: 8") {
                break;
            }
            eprintln!("{tool} -R: perftest's listener race (REJECTED, 8); running it again");
            out = run();
        }
        assert_ok(&out);
        // The result line: message size, then the iteration count.
        let t = text(&out[1]);
        let row = t.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && f[0].parse::<u64>().is_ok() && f[1] == "200").then(|| f[2].to_owned())
        });
        let figure: f64 = row
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{tool} -R: no result line\n{}", both(&out)));
        assert!(figure > 0.0, "{tool} -R: {figure}\n{}", both(&out));
    }
}

// ---- qperf -cm1 ----------------------------------------------------------------------------

/// qperf's RC tests with its connections made by the CM (`-cm1`; qperf's `ud_lat` ignores
/// `-cm1` and addresses without a GRH, which a RoCE port refuses: qperf's, not ours). Each
/// figure parsed and positive.
fn qperf_cm(s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    let tests = ["rc_lat", "rc_bw", "rc_rdma_write_lat", "rc_rdma_read_bw"];
    // A listen port of its own: another test's qperf server may still be leaving.
    let mut client = vec!["qperf", "-lp", "19800", "-cm1", &addr, "-t", "1"];
    client.extend(tests);
    let out = pair_with(
        s,
        &["qperf", "-lp", "19800"],
        19800,
        c,
        &client,
        Duration::ZERO,
    );
    assert!(out[1].status.success(), "{}", both(&out));
    let t = text(&out[1]);
    for test in tests {
        let value = t
            .split(&format!("{test}:"))
            .nth(1)
            .and_then(|rest| rest.split('=').nth(1))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok());
        assert!(
            value.is_some_and(|v| v > 0.0),
            "qperf -cm1 {test}: {value:?}\n{}",
            both(&out)
        );
    }
}

// ---- cm_events.c ---------------------------------------------------------------------------

/// The `cm_events` program, compiled once against the system's librdmacm headers.
fn cm_events(test: &str) -> Option<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/c/cm_events.c");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cm_events");
        let o = Command::new("cc")
            .arg("-O1")
            .arg("-o")
            .arg(&out)
            .arg(&src)
            .args(["-lrdmacm", "-libverbs"])
            .output()
            .map_err(|e| format!("cc: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "cc failed (apt-get install librdmacm-dev): {}",
                show(&o)
            ));
        }
        Ok(out)
    });
    match built {
        Ok(p) => Some(p.clone()),
        Err(e) => {
            assert!(!support::ci(), "{test}: {e} (CI=true: not skipping)");
            eprintln!("SKIPPED: {test}: {e}");
            None
        }
    }
}

/// One event line of `cm_events`: name, status, private data, milliseconds.
#[derive(Debug)]
struct Ev {
    name: String,
    status: i32,
    private: String,
    ms: f64,
}

fn events(o: &Output) -> Vec<Ev> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("event ")?;
            let (name, rest) = rest.split_once(" status ")?;
            let (status, rest) = rest.split_once(" private '")?;
            let (private, rest) = rest.rsplit_once("' after ")?;
            let ms = rest.strip_suffix(" ms")?.parse().ok()?;
            Some(Ev {
                name: name.into(),
                status: status.parse().ok()?,
                private: private.into(),
                ms,
            })
        })
        .collect()
}

/// The client's event after connecting (and the one after, if it was ESTABLISHED).
fn outcome(o: &Output) -> Vec<Ev> {
    events(o)
        .into_iter()
        .filter(|e| !e.name.ends_with("_RESOLVED"))
        .collect()
}

fn reject_with_private_data(exe: &str, s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    let out = pair(
        s,
        &[exe, "server", "7484", "reject"],
        7484,
        c,
        &[exe, "client", &addr, "7484"],
    );
    let ev = outcome(&out[1]);
    assert_eq!(ev.len(), 1, "{}", both(&out));
    assert_eq!(
        (ev[0].name.as_str(), ev[0].status, ev[0].private.as_str()),
        ("RDMA_CM_EVENT_REJECTED", 28, "no thanks"),
        "consumer reject with the server's private data\n{}",
        both(&out)
    );
    let req = events(&out[0]);
    assert!(
        req.iter()
            .any(|e| e.name == "RDMA_CM_EVENT_CONNECT_REQUEST" && e.private == "hello"),
        "the server saw the client's private data\n{}",
        both(&out)
    );
}

fn no_listener(exe: &str, s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    // Something on the server's host must keep its engine running to answer for it.
    let mut keeper = spawn(&mut s.run(&[exe, "server", "7485", "accept"]));
    wait_listening(&mut keeper, 7485, "keeper");
    let out = finish(
        vec![("client", spawn(&mut c.run(&[exe, "client", &addr, "7486"])))],
        RUN_LIMIT,
    );
    kill(&mut keeper);
    let ev = outcome(&out[0]);
    assert_eq!(ev.len(), 1, "{}", show(&out[0]));
    assert_eq!(
        (ev[0].name.as_str(), ev[0].status),
        ("RDMA_CM_EVENT_REJECTED", 8),
        "{}",
        show(&out[0])
    );
    assert!(
        ev[0].ms < 3000.0,
        "the host's CM answers at once: {} ms",
        ev[0].ms
    );
}

fn peer_killed(exe: &str, s: On<'_>, c: On<'_>) {
    let addr = s.addr();
    let mut srv = spawn(&mut s.run(&[exe, "server", "7487", "hold"]));
    wait_listening(&mut srv, 7487, "hold");
    let cli = spawn(&mut c.run(&[exe, "client", &addr, "7487"]));
    std::thread::sleep(Duration::from_millis(1500));
    kill(&mut srv);
    let out = finish(vec![("client", cli)], RUN_LIMIT);
    let ev = outcome(&out[0]);
    assert_eq!(
        ev.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
        ["RDMA_CM_EVENT_ESTABLISHED", "RDMA_CM_EVENT_DISCONNECTED"],
        "{}",
        show(&out[0])
    );
    // Established about 1.5 s before the kill; the DISCONNECTED comes within the CM's
    // check interval after it, far inside the CM timeout.
    assert!(
        ev[1].ms < 1500.0 + 3000.0,
        "DISCONNECTED after {} ms",
        ev[1].ms
    );
    let _ = srv.wait();
}

/// A peer that never answers: UNREACHABLE (-ETIMEDOUT) after the CM's tries (5 × 1.07 s).
/// `cm_events mcast`: the rules of `rdma_join_multicast` and `rdma_leave_multicast`.
fn join_rules(exe: &str, on: On<'_>) {
    let addr = on.addr();
    let out = finish(
        vec![(
            "mcast",
            spawn(&mut on.run(&[exe, "mcast", &addr, "239.1.1.3"])),
        )],
        RUN_LIMIT,
    );
    assert!(
        out[0].status.success() && text(&out[0]).contains("mcast ok"),
        "{}",
        show(&out[0])
    );
}

fn check_unreachable(out: &Output) {
    let ev = outcome(out);
    assert_eq!(ev.len(), 1, "{}", show(out));
    assert_eq!(
        (ev[0].name.as_str(), ev[0].status),
        ("RDMA_CM_EVENT_UNREACHABLE", -ETIMEDOUT),
        "{}",
        show(out)
    );
    assert!(
        (4000.0..12000.0).contains(&ev[0].ms),
        "UNREACHABLE after {} ms",
        ev[0].ms
    );
}

/// Linux's ETIMEDOUT.
const ETIMEDOUT: i32 = 110;

/// Waits (up to 5 s) until no host engine runs on `h` (it leaves 0.5 s after its last
/// client), so that nothing there answers.
fn wait_engine_gone(h: &HostNs) {
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        let unix = h
            .command("cat")
            .arg("/proc/net/unix")
            .output()
            .expect("cat");
        if !String::from_utf8_lossy(&unix.stdout).contains("@softverbs-engine/") {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the engine on {} did not leave", h.netns);
}

// ---- libfabric -----------------------------------------------------------------------------

fn fi_pingpong(s: On<'_>, c: On<'_>, provider: &str, ep: &str) {
    let addr = s.addr();
    let args = [
        "fi_pingpong",
        "-p",
        provider,
        "-e",
        ep,
        "-I",
        "100",
        "-S",
        "64",
    ];
    let mut client: Vec<&str> = args.to_vec();
    client.push(&addr);
    let out = pair(s, &args, 47592, c, &client);
    assert_ok(&out);
    for o in &out {
        // bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
        let row = text(o).lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 8 && f[0] == "64")
                .then(|| (f[1].to_owned(), f[2].to_owned(), f[6].to_owned()))
        });
        let (sent, ack, usec) = row.unwrap_or_else(|| panic!("no result row\n{}", both(&out)));
        assert_eq!(
            (sent.as_str(), ack.as_str()),
            ("100", "=100"),
            "{}",
            both(&out)
        );
        assert!(usec.parse::<f64>().is_ok_and(|u| u > 0.0), "{}", both(&out));
    }
}

// ---- The tests -----------------------------------------------------------------------------

const UTILS: &[&str] = &[
    "rping",
    "ucmatose",
    "udaddy",
    "rdma_server",
    "rdma_client",
    "cmtime",
    "mckey",
];

#[test]
fn rdmacm_utils_on_one_host() {
    if !have_tools("rdmacm_utils_on_one_host", UTILS) {
        return;
    }
    let _t = turn();
    rping(On::Here, On::Here);
    ucmatose(On::Here, On::Here);
    udaddy(On::Here, On::Here);
    rdma_server_client(On::Here, On::Here);
    cmtime(On::Here, On::Here);
    mckey(On::Here, On::Here, "239.1.1.1");
}

#[test]
fn rdmacm_utils_between_hosts() {
    let test = "rdmacm_utils_between_hosts";
    if !have_tools(test, UTILS) {
        return;
    }
    let _t = turn();
    let Some(net) = hosts(test) else { return };
    let (a, b) = (On::Host(net.a()), On::Host(net.b()));
    rping(a, b);
    ucmatose(a, b);
    udaddy(a, b);
    rdma_server_client(a, b);
    cmtime(a, b);
    mckey(a, b, "239.1.1.2");
}

#[test]
fn perftest_over_the_cm_on_one_host_and_between_hosts() {
    let test = "perftest_over_the_cm_on_one_host_and_between_hosts";
    if !have_tools(test, &["ib_send_lat", "ib_write_bw", "ib_read_lat"]) {
        return;
    }
    let _t = turn();
    perftest_r(On::Here, On::Here);
    let Some(net) = hosts(test) else { return };
    perftest_r(On::Host(net.a()), On::Host(net.b()));
}

#[test]
fn qperf_over_the_cm_on_one_host_and_between_hosts() {
    let test = "qperf_over_the_cm_on_one_host_and_between_hosts";
    if !have_tools(test, &["qperf"]) {
        return;
    }
    let _t = turn();
    qperf_cm(On::Here, On::Here);
    let Some(net) = hosts(test) else { return };
    qperf_cm(On::Host(net.a()), On::Host(net.b()));
}

#[test]
fn what_goes_wrong_gives_the_event_programs_expect_on_one_host() {
    let test = "what_goes_wrong_gives_the_event_programs_expect_on_one_host";
    let Some(exe) = cm_events(test) else { return };
    if !have_tools(test, &[]) {
        return;
    }
    let _t = turn();
    let exe = exe.to_str().expect("utf-8 path");
    reject_with_private_data(exe, On::Here, On::Here);
    no_listener(exe, On::Here, On::Here);
    peer_killed(exe, On::Here, On::Here);
    join_rules(exe, On::Here);
    // A listener that never answers: stopped, so its CM agent reads nothing.
    let mut srv = spawn(&mut On::Here.run(&[exe, "server", "7488", "accept"]));
    wait_listening(&mut srv, 7488, "stopped server");
    let pid = rustix::process::Pid::from_raw(srv.id() as i32).expect("pid");
    // The listener is the program under `softverbs run`: stop the whole group.
    let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::STOP);
    let out = finish(
        vec![(
            "client",
            spawn(&mut On::Here.run(&[exe, "client", "127.0.0.1", "7488"])),
        )],
        RUN_LIMIT,
    );
    kill(&mut srv);
    let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::CONT);
    let _ = srv.wait();
    check_unreachable(&out[0]);
}

#[test]
fn what_goes_wrong_gives_the_event_programs_expect_between_hosts() {
    let test = "what_goes_wrong_gives_the_event_programs_expect_between_hosts";
    let Some(exe) = cm_events(test) else { return };
    if !have_tools(test, &[]) {
        return;
    }
    let _t = turn();
    let Some(net) = hosts(test) else { return };
    let exe = exe.to_str().expect("utf-8 path");
    let (a, b) = (On::Host(net.a()), On::Host(net.b()));
    reject_with_private_data(exe, a, b);
    no_listener(exe, a, b);
    peer_killed(exe, a, b);
    join_rules(exe, a);
    // A host where nothing runs: no engine owns its UDP 4791, nothing answers.
    wait_engine_gone(net.a());
    let out = finish(
        vec![(
            "client",
            spawn(&mut b.run(&[exe, "client", &net.a().ipv4.to_string(), "7489"])),
        )],
        RUN_LIMIT,
    );
    check_unreachable(&out[0]);
}

#[test]
fn libfabric_verbs_msg_and_rdm_endpoints() {
    let test = "libfabric_verbs_msg_and_rdm_endpoints";
    if !have_tools(test, &["fi_info", "fi_pingpong"]) {
        return;
    }
    let _t = turn();
    let Some(net) = hosts(test) else { return };
    let (a, b) = (On::Host(net.a()), On::Host(net.b()));
    let info = finish(
        vec![("fi_info", spawn(&mut a.run(&["fi_info", "-p", "verbs"])))],
        RUN_LIMIT,
    );
    let t = text(&info[0]);
    let msg_on_roce0 = t
        .split("provider:")
        .any(|entry| entry.contains("domain: roce0\n") && entry.contains("type: FI_EP_MSG"));
    assert!(
        msg_on_roce0,
        "fi_info lists no MSG endpoint on roce0\n{}",
        show(&info[0])
    );
    // One host (both ends on A's roce0), then between hosts.
    fi_pingpong(a, a, "verbs", "msg");
    fi_pingpong(a, b, "verbs", "msg");
    fi_pingpong(a, b, "verbs;ofi_rxm", "rdm");
}
