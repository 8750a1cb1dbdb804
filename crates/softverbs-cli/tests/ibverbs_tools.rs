//! Unmodified rdma-core programs (`ibverbs-utils`, `perftest`) over the drop-in
//! `libibverbs.so.1`, through `softverbs run`. The device is RoCE, so the tools get a GID
//! index: `-g 0` for the `ibv_*_pingpong` tools, `-x 0` for perftest.
//!
//! A missing tool or a missing drop-in library (`cargo build -p softverbs-ibverbs`) skips a
//! test with a printed reason, except under `CI=true`, where it fails.

mod support;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use support::{
    find_in_path, free_port, have_tools, kill_and_collect as kill, listening, show, wait,
};

fn softverbs_run(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_softverbs"));
    cmd.arg("run").arg("--").args(args);
    cmd.env_remove("SOFTVERBS_DEVICES");
    cmd
}

fn output(mut cmd: Command) -> Output {
    cmd.output().expect("run softverbs")
}

#[test]
fn run_exits_with_the_command_status() {
    if !have_tools(module_path!(), &["sh"]) {
        return;
    }
    let o = output(softverbs_run(&["sh", "-c", "exit 7"]));
    assert_eq!(o.status.code(), Some(7), "{}", show(&o));
    let o = output(softverbs_run(&["sh", "-c", "echo \"$LD_LIBRARY_PATH\""]));
    let out = String::from_utf8_lossy(&o.stdout);
    let first = out.split(':').next().unwrap_or_default().trim();
    assert!(
        Path::new(first).join("libibverbs.so.1").exists(),
        "LD_LIBRARY_PATH starts with the drop-in's directory: {out}"
    );
}

#[test]
fn ibv_devices_lists_the_software_device() {
    if !have_tools(module_path!(), &["ibv_devices"]) {
        return;
    }
    let o = output(softverbs_run(&["ibv_devices"]));
    let t = show(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("softverbs0") && t.contains("025056fffe000001"),
        "{t}"
    );
}

#[test]
fn ibv_devinfo_shows_the_port_active() {
    if !have_tools(module_path!(), &["ibv_devinfo"]) {
        return;
    }
    let mut cmd = softverbs_run(&["ibv_devinfo", "-v"]);
    // Every symbol the tool imports must resolve at load time.
    cmd.env("LD_BIND_NOW", "1");
    let o = output(cmd);
    let t = show(&o);
    assert!(o.status.success(), "{t}");
    for want in [
        "hca_id:\tsoftverbs0",
        "PORT_ACTIVE (4)",
        "link_layer:\t\tEthernet",
        "::ffff:127.0.0.1, RoCE v2",
        // The device clock: 48 bits of nanoseconds by default.
        "completion timestamp_mask:\t\t\t0x0000ffffffffffff",
        "hca_core_clock:\t\t\t1000000kHZ",
    ] {
        assert!(t.contains(want), "`{want}` in {t}");
    }
    // Memory windows and multicast, as the drop-in reports them and as `softverbs devinfo`
    // prints them: the same lines.
    let ours = output({
        let mut c = Command::new(env!("CARGO_BIN_EXE_softverbs"));
        c.args(["devinfo", "-v"]);
        c
    });
    let ours = show(&ours);
    for want in [
        "\t\t\t\t\tMEM_WINDOW\n",
        "\t\t\t\t\tMEM_WINDOW_TYPE_2B\n",
        "\tmax_mw:\t\t\t\t1048576\n",
        "\tmax_mcast_grp:\t\t\t8192\n",
        "\tmax_mcast_qp_attach:\t\t56\n",
        "\tmax_total_mcast_qp_attach:\t458752\n",
    ] {
        assert!(t.contains(want), "`{want}` in ibv_devinfo: {t}");
        assert!(ours.contains(want), "`{want}` in softverbs devinfo: {ours}");
    }
}

#[test]
fn ibv_devices_follows_softverbs_devices() {
    if !have_tools(module_path!(), &["ibv_devices"]) {
        return;
    }
    let mut cmd = softverbs_run(&["ibv_devices"]);
    cmd.env("SOFTVERBS_DEVICES", "name=first;name=second,link=ib");
    let o = output(cmd);
    let t = show(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("first") && t.contains("second"), "{t}");
}

/// The processes of process group `pgid`.
fn group(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|pid| {
            // `pid (comm) state ppid pgrp ...`: the name may hold spaces, so count from the
            // last ')'.
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
                st.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(2)?.parse::<u32>().ok())
                    == Some(pgid)
            })
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// What every process of `children`'s groups is doing, for the report of a hung pair: its
/// threads' wait channels and CQ rings (`softverbs inspect`) and, where gdb is installed,
/// every thread's stack.
fn diagnose(children: &[(&str, &Child)]) -> String {
    let mut out = String::new();
    for (role, child) in children {
        for pid in group(child.id()) {
            let pid = pid.to_string();
            let shown = |o: std::io::Result<Output>| match o {
                Ok(o) => format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => format!("(could not run: {e})\n"),
            };
            out += &format!("--- {role}: process {pid}\n");
            out += &shown(
                Command::new(env!("CARGO_BIN_EXE_softverbs"))
                    .args(["inspect", &pid])
                    .output(),
            );
            if find_in_path("gdb").is_some() {
                let stacks = shown(
                    Command::new("timeout")
                        .args(["30", "gdb", "-batch", "-nx", "-p", &pid])
                        .args(["-ex", "thread apply all bt"])
                        .output(),
                );
                // The frames, not gdb's chatter about loading symbols.
                for line in stacks.lines().filter(|l| {
                    l.starts_with('#') || l.starts_with("Thread ") || l.contains("ptrace")
                }) {
                    out += line;
                    out.push('\n');
                }
            } else {
                out += "(no gdb here for the stacks: apt-get install gdb)\n";
            }
        }
    }
    out
}

/// Runs `tool` as server and client (two processes) on 127.0.0.1; both must exit 0.
fn pingpong(tool: &str, extra: &[&str]) {
    pair(tool, "-g", extra, "iters in");
}

/// Runs a perftest tool as server and client; both must exit 0 and print a result table.
fn perftest(tool: &str) {
    if find_in_path(tool).is_none() {
        eprintln!("(`{tool}` comes with `apt-get install perftest`)");
    }
    pair(tool, "-x", &[], "#bytes");
}

/// Runs a perftest tool with `-a` (every message size, 2 B to 8 MiB) as server and client;
/// both must exit 0 and the client's table must reach the last size. `-n 100` keeps each
/// pair near 10 s on 2 cores (the default 1000 latency iterations take about a minute). The
/// budget is for a shared CI machine: two busy-polling processes beside two CPU-bound ones
/// get a quarter of the time each, and every round trip of a latency tool may wait for a
/// time slice.
/// The atomic tools have no such test: perftest refuses `-a` for them ("Message size
/// cannot be changed for Atomic tests").
fn perftest_all_sizes(tool: &str) {
    if find_in_path(tool).is_none() {
        eprintln!("(`{tool}` comes with `apt-get install perftest`)");
    }
    pair_within(
        tool,
        "-x",
        &["-a", "-n", "100"],
        "8388608",
        Duration::from_secs(300),
    );
}

/// Server and client of `tool` with GID index 0 (`gid_flag 0`: RoCE needs a GRH), on a free
/// TCP port; both must exit 0 and the client's output must contain `expect`.
fn pair(tool: &str, gid_flag: &str, extra: &[&str], expect: &str) {
    pair_within(tool, gid_flag, extra, expect, Duration::from_secs(60));
}

/// [`pair`], the client given `limit` to finish.
fn pair_within(tool: &str, gid_flag: &str, extra: &[&str], expect: &str, limit: Duration) {
    pair_under(&[], tool, gid_flag, extra, expect, limit);
}

/// [`pair_within`], both sides run by the command line `wrapper` (a tool under valgrind).
fn pair_under(
    wrapper: &[&str],
    tool: &str,
    gid_flag: &str,
    extra: &[&str],
    expect: &str,
    limit: Duration,
) {
    let needed: Vec<&str> = wrapper.iter().take(1).copied().chain([tool]).collect();
    if !have_tools(module_path!(), &needed) {
        return;
    }
    // One pair at a time: the tools busy-poll, and several pairs on a small machine starve
    // each other into multi-second runs.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let port = free_port().to_string();
    let mut args = wrapper.to_vec();
    args.extend_from_slice(&[tool, gid_flag, "0", "-p", &port]);
    args.extend_from_slice(extra);
    let spawn = |args: &[&str]| {
        softverbs_run(args)
            .process_group(0)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn")
    };
    let server = spawn(&args);
    let start = Instant::now();
    while !listening(port.parse().unwrap()) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client_args = args.clone();
    client_args.push("127.0.0.1");
    // A pair that hangs explains itself: both processes are inspected before they are killed.
    let mut hung = String::new();
    let client = match wait(spawn(&client_args), limit) {
        Ok(out) => out,
        Err(client) => {
            hung = diagnose(&[("client", &client), ("server", &server)]);
            kill(client)
        }
    };
    let server = match wait(server, Duration::from_secs(10)) {
        Ok(out) => out,
        Err(server) => {
            if hung.is_empty() {
                hung = diagnose(&[("server", &server)]);
            }
            kill(server)
        }
    };
    let (c, s) = (show(&client), show(&server));
    if !hung.is_empty() {
        hung = format!("\n=== the pair hung; what its processes were doing:\n{hung}");
    }
    assert!(
        client.status.success() && server.status.success(),
        "{tool} {extra:?}\n=== client\n{c}\n=== server\n{s}{hung}"
    );
    assert!(c.contains(expect), "{c}");
    println!("{tool} {extra:?} client:\n{c}");
}

#[test]
fn ibv_rc_pingpong_default() {
    pingpong("ibv_rc_pingpong", &[]);
}

/// C developers run their RDMA programs under valgrind: through the drop-in, a pingpong
/// runs to the end under memcheck with no error reported on either side (the library's
/// start-up once crashed there, reading the auxiliary vector valgrind rewrites).
#[test]
fn ibv_rc_pingpong_is_clean_under_valgrind() {
    pair_under(
        &["valgrind", "-q", "--error-exitcode=9"],
        "ibv_rc_pingpong",
        "-g",
        &["-n", "200"],
        "iters in",
        Duration::from_secs(120),
    );
}

#[test]
fn ibv_rc_pingpong_events() {
    pingpong("ibv_rc_pingpong", &["-e"]);
}

#[test]
fn ibv_rc_pingpong_validates_the_buffer() {
    pingpong("ibv_rc_pingpong", &["-c"]);
}

#[test]
fn ibv_rc_pingpong_small_many() {
    pingpong("ibv_rc_pingpong", &["-s", "1", "-n", "10000"]);
}

#[test]
fn ibv_rc_pingpong_64k() {
    pingpong("ibv_rc_pingpong", &["-s", "65536"]);
}

#[test]
fn ibv_uc_pingpong_default() {
    pingpong("ibv_uc_pingpong", &[]);
}

#[test]
fn perftest_loads_with_every_symbol_bound() {
    // perftest links libmlx5/libefa, which import IBVERBS_PRIVATE_34 symbols.
    if !have_tools(module_path!(), &["ib_write_lat"]) {
        eprintln!("(ib_write_lat comes with `apt-get install perftest`)");
        return;
    }
    let mut cmd = softverbs_run(&["ib_write_lat", "--help"]);
    cmd.env("LD_BIND_NOW", "1");
    // The exit status of `--help` varies between perftest versions; loading is the point.
    let o = output(cmd);
    let t = show(&o);
    assert!(t.contains("Usage:"), "{t}");
    assert!(!t.contains("symbol lookup error"), "{t}");
}

#[test]
fn ib_send_lat() {
    perftest("ib_send_lat");
}

#[test]
fn ib_send_bw() {
    perftest("ib_send_bw");
}

#[test]
fn ib_write_lat() {
    perftest("ib_write_lat");
}

#[test]
fn ib_write_bw() {
    perftest("ib_write_bw");
}

#[test]
fn ib_read_lat() {
    perftest("ib_read_lat");
}

#[test]
fn ib_read_bw() {
    perftest("ib_read_bw");
}

#[test]
fn ib_atomic_lat() {
    perftest("ib_atomic_lat");
}

#[test]
fn ib_atomic_bw() {
    perftest("ib_atomic_bw");
}

#[test]
fn ibv_ud_pingpong_default() {
    pingpong("ibv_ud_pingpong", &[]);
}

#[test]
fn ibv_srq_pingpong_default() {
    pingpong("ibv_srq_pingpong", &[]);
}

/// XRC: the server's receive QPs in an XRC domain, with XRC SRQs its client's initiator
/// names in every message (on one host: XRC is not offered on networked devices).
#[test]
fn ibv_xsrq_pingpong_default() {
    pair("ibv_xsrq_pingpong", "-g", &["-n", "50"], "success");
}

#[test]
fn ibv_rc_pingpong_new_send_api() {
    pingpong("ibv_rc_pingpong", &["-N"]);
}

#[test]
fn ib_send_lat_all_sizes() {
    perftest_all_sizes("ib_send_lat");
}

#[test]
fn ib_send_bw_all_sizes() {
    perftest_all_sizes("ib_send_bw");
}

#[test]
fn ib_write_lat_all_sizes() {
    perftest_all_sizes("ib_write_lat");
}

#[test]
fn ib_write_bw_all_sizes() {
    perftest_all_sizes("ib_write_bw");
}

#[test]
fn ib_read_lat_all_sizes() {
    perftest_all_sizes("ib_read_lat");
}

#[test]
fn ib_read_bw_all_sizes() {
    perftest_all_sizes("ib_read_bw");
}

/// `-t`: receive completions polled through `ibv_create_cq_ex`/`ibv_start_poll`, with the
/// completion-timestamp statistics the seed's `rc_pingpong --ts` prints.
#[test]
fn ibv_rc_pingpong_timestamps() {
    pair(
        "ibv_rc_pingpong",
        "-g",
        &["-t"],
        "Average receive completion clock cycles",
    );
}

/// `-e -t`: completion events, then `ibv_start_poll`, which the tool requires to find a
/// completion after every event (an event for already-polled completions would fail it).
#[test]
fn ibv_rc_pingpong_events_and_timestamps() {
    pair(
        "ibv_rc_pingpong",
        "-g",
        &["-e", "-t", "-n", "2000"],
        "Average receive completion clock cycles",
    );
}

/// What a hung pair prints: an `ibv_rc_pingpong` server waiting for its client is inspected
/// as a hung tool would be, and shows its threads, its CQ ring (armed with `-e`) and, where
/// gdb is installed, its stack.
#[test]
fn a_waiting_tool_is_reported_with_its_threads_cq_and_stack() {
    if !have_tools(module_path!(), &["ibv_rc_pingpong"]) {
        return;
    }
    let port = free_port().to_string();
    let server = softverbs_run(&["ibv_rc_pingpong", "-g", "0", "-e", "-p", &port])
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    while !listening(port.parse().unwrap()) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    // The port may be another test's for a moment (ports are picked free, then bound): look
    // until the tool itself shows up in the report, for as long as it may take to start.
    let tool_waits = || {
        group(server.id()).into_iter().any(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
            comm.trim() == "ibv_rc_pingpong" && wchan.contains("accept")
        })
    };
    while !tool_waits() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let report = diagnose(&[("server", &server)]);
    let out = show(&kill(server));
    assert!(report.contains("--- server: process"), "{report}\n{out}");
    // The tool itself (under `softverbs run`), asleep in accept(2), holding its CQ.
    assert!(
        report.contains("(ibv_rc_pingpong): state S"),
        "{report}\n{out}"
    );
    assert!(report.contains(" ring: "), "{report}\n{out}");
    if find_in_path("gdb").is_some() {
        assert!(
            report.lines().any(|l| l.starts_with("#0")),
            "a stack: {report}"
        );
    }
}
