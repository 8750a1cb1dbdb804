//! What the CLI's integration tests share: whether the real clients they run are installed
//! (skip with a message, or fail under `CI=true`), how their processes are started, bounded
//! and killed, and how a finished process is shown.

#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `CI=true`: whatever a test needs must be there.
pub fn ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

pub fn find_in_path(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// True if `tools` and the drop-in `libibverbs.so` beside the `softverbs` binary are there;
/// otherwise says why test `test` is skipped, or panics under `CI=true`.
pub fn have_tools(test: &str, tools: &[&str]) -> bool {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_softverbs"));
    let lib = exe.with_file_name("libibverbs.so");
    let in_deps = exe.with_file_name("deps").join("libibverbs.so");
    let mut missing: Vec<String> = tools
        .iter()
        .filter(|t| find_in_path(t).is_none())
        .map(|t| format!("`{t}` (apt-get install {})", package_of(t)))
        .collect();
    if !lib.is_file() && !in_deps.is_file() && std::env::var_os("SOFTVERBS_IBVERBS_LIB").is_none() {
        missing.push(format!("{} (cargo build --workspace)", lib.display()));
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("{test}: missing {}", missing.join(", "));
    assert!(!ci(), "{msg} (CI=true: not skipping)");
    eprintln!("SKIPPED: {msg}");
    false
}

/// The Debian packages that bring `tool`.
fn package_of(tool: &str) -> &'static str {
    match tool {
        "ucx_info" | "ucx_perftest" => "ucx-utils",
        "mpicc" | "mpirun" => "openmpi-bin libopenmpi-dev",
        "qperf" => "qperf",
        "valgrind" => "valgrind",
        _ => "ibverbs-utils perftest",
    }
}

/// A TCP port nothing listens on now.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// True once some socket listens on `port` (IPv4 or IPv6), read from /proc so that a
/// server's single accept is not used up by a probe.
pub fn listening(port: u16) -> bool {
    listening_under("/proc/net", port)
}

/// [`listening`] in the network namespace of process `pid` (which may not be ours).
pub fn listening_in(pid: u32, port: u16) -> bool {
    listening_under(&format!("/proc/{pid}/net"), port)
}

fn listening_under(net: &str, port: u16) -> bool {
    let hex = format!(":{port:04X} ");
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("{net}/{f}")).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && format!("{} ", cols[1]).ends_with(&hex) && cols[3] == "0A"
            })
        })
    })
}

/// A finished process: its status and both outputs.
pub fn show(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Starts `cmd` with piped output, in a process group of its own.
pub fn spawn(cmd: &mut Command) -> Child {
    // Its own process group: a child that hangs is killed with everything it started
    // (but not the engine, which is in a group of its own and leaves with its clients).
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn")
}

pub fn kill(child: &mut Child) {
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    let _ = child.kill();
}

/// Waits for every child until `limit` has passed; those still running then are killed.
/// Their outputs, in order (a killed one's status says so).
pub fn finish(mut children: Vec<(&str, Child)>, limit: Duration) -> Vec<Output> {
    let end = Instant::now() + limit;
    while Instant::now() < end
        && children
            .iter_mut()
            .any(|(_, c)| c.try_wait().expect("try_wait").is_none())
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .map(|(_, mut c)| {
            if c.try_wait().expect("try_wait").is_none() {
                kill(&mut c);
            }
            c.wait_with_output().expect("output")
        })
        .collect()
}

/// Waits for `child` up to `limit`: its output once it exits, or the child still running.
pub fn wait(mut child: Child, limit: Duration) -> Result<Output, Child> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if child.try_wait().expect("try_wait").is_some() {
            return Ok(child.wait_with_output().expect("output"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(child)
}

/// Kills `child` and what it started (see [`kill`]), and collects its output.
pub fn kill_and_collect(mut child: Child) -> Output {
    // The tool runs under `softverbs run` in the child's own process group (see `pair`):
    // kill the group, or the tool would live on holding the output pipes, and reading them
    // would never end.
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    let _ = child.kill();
    child.wait_with_output().expect("output")
}
