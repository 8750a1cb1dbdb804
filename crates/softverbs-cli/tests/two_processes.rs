//! `softverbs pingpong` as a server and a client process, and `softverbs perf` (which starts
//! its own second process): what a user runs on one host.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_softverbs");
/// No run here should take nearly this long; past it the test fails instead of hanging. The
/// margin is for a shared CI machine: beside two CPU-bound processes a debug `perf --quick`
/// (whose two pinned processes then wait a time slice for each other at every hand-over)
/// took 19 s alone and over 60 s beside this binary's other tests.
const LIMIT: Duration = Duration::from_secs(240);

/// The tests here run one at a time: each starts two processes that busy-poll, and several
/// such pairs at once on a small machine only measure the scheduler.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A finished process.
struct Outcome {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Waits for `child` for at most LIMIT (then kills it and panics), collecting its output;
/// `stderr` is its standard error if already taken.
fn finish(mut child: Child, stderr: Option<BufReader<ChildStderr>>, what: &str) -> Outcome {
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        out.read_to_string(&mut stdout).unwrap();
    }
    let mut err = String::new();
    match stderr {
        Some(mut e) => e.read_to_string(&mut err).map(drop).unwrap(),
        None => {
            if let Some(mut e) = child.stderr.take() {
                e.read_to_string(&mut err).unwrap();
            }
        }
    }
    Outcome {
        status,
        stdout,
        stderr: err,
        took: t0.elapsed(),
    }
}

fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env_remove("SOFTVERBS_DEVICES")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// A pingpong server on a port the kernel picks (read from its first line on stderr).
struct Server {
    child: Child,
    stderr: BufReader<ChildStderr>,
    port: u16,
}

fn start_server(args: &[&str]) -> Server {
    let mut child = command(&[&["pingpong", "-p", "0"], args].concat())
        .spawn()
        .expect("start the server");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let port = line
        .split("TCP port ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in the server's first line: {line:?}"));
    Server {
        child,
        stderr,
        port,
    }
}

/// Runs a server with `server_args` and a client with `client_args` against it.
fn pingpong_pair(server_args: &[&str], client_args: &[&str]) -> (Outcome, Outcome) {
    let server = start_server(server_args);
    let port = server.port.to_string();
    let client = command(&[&["pingpong", "-p", &port], client_args, &["127.0.0.1"]].concat())
        .spawn()
        .expect("start the client");
    let client = finish(client, None, "the client");
    let server = finish(server.child, Some(server.stderr), "the server");
    (server, client)
}

#[test]
fn pingpong_server_and_client_in_two_processes() {
    let _serial = serial();
    for t in ["rc", "uc", "ud"] {
        let opts = ["--transport", t, "-n", "1000", "--timeout", "20"];
        let (server, client) = pingpong_pair(&opts, &[&opts[..], &["--json"]].concat());
        assert!(
            server.status.success() && client.status.success(),
            "{t}: server {}: {}{}\nclient {}: {}",
            server.status,
            server.stdout,
            server.stderr,
            client.status,
            client.stderr
        );
        let v: serde_json::Value = serde_json::from_str(&client.stdout).expect("one JSON object");
        assert_eq!(v["mode"], "client", "{v}");
        assert_eq!(v["iterations"], 1000, "{v}");
        assert!(v["rtt_p50_us"].as_f64().unwrap() > 0.0, "{v}");
        assert!(server.stdout.contains("served 1000"), "{}", server.stdout);
    }
}

#[test]
fn pingpong_ends_with_different_settings_both_refuse() {
    let _serial = serial();
    for (server_opts, client_opts) in [
        (&["--transport", "rc"][..], &["--transport", "uc"][..]),
        (&["-s", "64"][..], &["-s", "128"][..]),
        (&["-n", "10"][..], &["-n", "11"][..]),
    ] {
        let (server, client) = pingpong_pair(server_opts, client_opts);
        for (who, o) in [("server", &server), ("client", &client)] {
            assert_eq!(o.status.code(), Some(1), "{who}: {}", o.stderr);
            assert!(
                o.stderr
                    .contains("softverbs: the two ends run different tests"),
                "{who}: {}",
                o.stderr
            );
            // Well under the 30 s link timeout: the refusal came from the check, not a time-out.
            assert!(o.took < Duration::from_secs(25), "{who} took {:?}", o.took);
        }
    }
}

#[test]
fn pingpong_server_without_a_client_gives_up() {
    let _serial = serial();
    let server = start_server(&["--timeout", "1"]);
    let o = finish(server.child, Some(server.stderr), "the server");
    assert_eq!(o.status.code(), Some(1), "{}", o.stderr);
    assert!(
        o.stderr.contains("softverbs: no peer connected on port"),
        "{}",
        o.stderr
    );
    // It gave up after its 1 s --timeout, not the 30 s default.
    assert!(o.took < Duration::from_secs(25), "took {:?}", o.took);
}

/// `perf --quick --json` with `devices` as SOFTVERBS_DEVICES: one JSON object on standard
/// output, with the baselines.
fn perf_quick(devices: Option<&str>) -> (Outcome, serde_json::Value) {
    let mut cmd = command(&["perf", "--quick", "--json"]);
    if let Some(d) = devices {
        cmd.env("SOFTVERBS_DEVICES", d);
    }
    // `finish` bounds the run (a hang fails the test); how fast it is, is not a test matter.
    let o = finish(cmd.spawn().expect("start perf"), None, "perf --quick");
    let v: serde_json::Value = serde_json::from_str(&o.stdout)
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {}\n{}", o.stdout, o.stderr));
    let cl = &v["baselines"]["cacheline_pingpong"];
    assert!(cl["p50_ns"].as_f64().unwrap() > 0.0, "{v}");
    let memcpy = v["baselines"]["memcpy"].as_array().unwrap();
    assert_eq!(memcpy.len(), 2, "{v}");
    assert!(
        memcpy.iter().all(|m| m["gb_s"].as_f64().unwrap() > 0.0),
        "{v}"
    );
    (o, v)
}

#[test]
fn perf_that_cannot_finish_says_why_and_keeps_what_it_measured() {
    let _serial = serial();
    // Regions of at most 64 KiB: the 1 MiB bandwidth test cannot register its buffer.
    let (o, v) = perf_quick(Some("max_mr_size=65536"));
    assert_eq!(o.status.code(), Some(1), "{}", o.stderr);
    assert_eq!(v["ok"], false, "{v}");
    let err = v["error"].as_str().unwrap();
    assert!(
        err.starts_with("RDMA WRITE bandwidth (1 MiB): registering 1048576 bytes"),
        "{err}"
    );
    assert!(
        o.stderr.starts_with(&format!("softverbs: {err}")),
        "{}",
        o.stderr
    );
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    // What came before is there.
    assert!(
        v["rdma_write_latency"]["p50_ns"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    assert_eq!(
        v["rdma_write_bandwidth"].as_array().unwrap().len(),
        1,
        "{v}"
    );
}

#[test]
fn perf_quick_measures_rdma_between_two_processes() {
    let _serial = serial();
    let (o, v) = perf_quick(None);
    assert!(o.status.success(), "{}", o.stderr);
    assert_eq!(v["ok"], true, "{v}");
    // Each process has a CPU of its own (or both share the only one): both spin, or both
    // yield. The second process inherits the first one's pinning, so it cannot tell by
    // counting CPUs; a peer that yielded on every look doubled the latencies measured.
    let pair = v["cpu_pair"].as_array().unwrap();
    let want = if pair[0] != pair[1] { "spin" } else { "yield" };
    assert_eq!(v["waits"], serde_json::json!([want, want]), "{v}");
    for key in ["rdma_write_latency", "send_latency"] {
        let f = &v[key];
        assert_eq!(f["size"], 64, "{v}");
        assert!(f["p50_ns"].as_f64().unwrap() > 0.0, "{key}: {v}");
        assert!(f["ratio"].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    let bw = v["rdma_write_bandwidth"].as_array().unwrap();
    let sizes: Vec<u64> = bw.iter().map(|f| f["size"].as_u64().unwrap()).collect();
    assert_eq!(sizes, [65536, 1 << 20], "{v}");
    assert!(bw.iter().all(|f| f["gb_s"].as_f64().unwrap() > 0.0), "{v}");
    // Message rates beside the raw ring, and round robin over 1 and 64 QPs (each QP's
    // WRITEs checked by the peer, else the run fails) against the one-QP run.
    let rates = &v["message_rates"];
    assert!(
        rates["raw_ring_msgs_per_sec"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    let ops: Vec<&str> = rates["figures"].as_array().unwrap()[..3]
        .iter()
        .map(|f| f["op"].as_str().unwrap())
        .collect();
    assert_eq!(ops, ["RDMA WRITE", "SEND", "RDMA READ"], "{v}");
    let fan = rates["round_robin"].as_array().unwrap();
    let counts: Vec<u64> = fan.iter().map(|f| f["qps"].as_u64().unwrap()).collect();
    assert_eq!(counts, [1, 64], "{v}");
    assert_eq!(fan[0]["ratio_to_one_qp"].as_f64(), Some(1.0), "{v}");
    assert!(
        fan.iter()
            .all(|f| f["messages"].as_u64().unwrap() >= 100 * f["qps"].as_u64().unwrap()),
        "{v}"
    );
    // The text form says the same, with each figure's baseline and ratio.
    let child = command(&["perf", "--quick"]).spawn().unwrap();
    let o = finish(child, None, "perf --quick");
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        o.stdout.contains("RDMA WRITE 64 B latency: ")
            && o.stdout.contains("(cache-line ping-pong ")
            && o.stdout.contains("RDMA WRITE 1 MiB bandwidth: ")
            && o.stdout.contains("(memcpy ")
            && o.stdout
                .contains("RDMA WRITE 64 B round robin over 64 QPs: "),
        "{}",
        o.stdout
    );
}
