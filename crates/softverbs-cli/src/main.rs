//! `softverbs`: the command line of the softverbs RDMA stack.
//!
//! Each subcommand lives in its own module; this file only parses the command line, finds
//! devices and turns errors into `softverbs: <error>` and exit status 1.

mod devinfo;
mod inspect;
mod nic;
mod oob;
mod perf;
mod perf_cq;
mod perf_fan;
mod perf_net;
mod perf_noncontig;
mod perf_objects;
mod perf_rate;
mod pingpong;
mod report;
mod run;

use clap::{Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;

/// The error type of every subcommand: anything printable.
pub type Error = Box<dyn std::error::Error + Send + Sync>;
/// `Result` with the CLI [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Parser)]
#[command(
    name = "softverbs",
    version,
    about = "RDMA verbs tools for softverbs devices (the built-in software NIC needs no set-up)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print device and port attributes, like `ibv_devinfo`.
    Devinfo(devinfo::Args),
    /// SEND/RECV ping-pong: round-trip latency and bandwidth between two QPs (two threads
    /// with --loopback; else a server and a client process, like `ibv_rc_pingpong`).
    Pingpong(pingpong::Args),
    /// RDMA latency and bandwidth between two processes, beside a cache-line ping-pong and
    /// memcpy as baselines.
    Perf(perf::Args),
    /// The second process of `perf` (started by it).
    #[command(name = "perf-peer", hide = true)]
    PerfPeer(perf::PeerArgs),
    /// An end of `perf --net` (started by it, in a network namespace).
    #[command(name = "perf-net-peer", hide = true)]
    PerfNetPeer(perf_net::NetPeerArgs),
    /// Run an unmodified libibverbs program (`softverbs run -- ibv_devinfo -v`) over the
    /// softverbs drop-in `libibverbs.so.1`; exits with the program's status.
    Run(run::Args),
    /// Show what running softverbs programs wait for: their threads, and each CQ ring's arm,
    /// pending event and waiting completions (read through /proc; the program keeps running).
    Inspect(inspect::Args),
    /// The RoCE host engine of a networked device (started by the library when a program
    /// opens the device; not for running by hand).
    #[command(name = "engine", hide = true)]
    Engine {
        #[arg(long)]
        spec: String,
    },
    /// Show the host engines of networked devices (RoCEv2 between hosts): state, counters,
    /// clients and queue pairs; `--capture FILE` starts a pcap capture.
    Nic(nic::Args),
}

fn main() -> ExitCode {
    // This binary is the RoCE engine's executable. The library, looking for it, skips the
    // running program itself (it looks next to it, above it and on PATH), so a networked
    // device opened by `softverbs pingpong`, `perf --net` or `nic` found no engine to start
    // unless SOFTVERBS_ENGINE_EXE was set; name ourselves, as `softverbs run` does for C
    // programs.
    if std::env::var_os(softverbs::nic::engine::ENV_ENGINE_EXE).is_none_or(|v| v.is_empty()) {
        if let Ok(me) = std::env::current_exe() {
            // SAFETY: the first thing main does, before any thread exists.
            unsafe { std::env::set_var(softverbs::nic::engine::ENV_ENGINE_EXE, me) };
        }
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            // --help and --version are not errors.
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // No subcommand: the help text, unprefixed.
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return ExitCode::FAILURE;
            }
            let text = e.render().to_string();
            let text = text.strip_prefix("error: ").unwrap_or(&text);
            eprint!("softverbs: {text}");
            return ExitCode::FAILURE;
        }
    };
    if let Command::Run(args) = &cli.command {
        return run::run(args);
    }
    match dispatch(&cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softverbs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(command: &Command) -> Result<()> {
    match command {
        Command::Devinfo(args) => devinfo::run(args),
        Command::Pingpong(args) => pingpong::run(args),
        Command::Perf(args) if args.is_net() => perf_net::run(args),
        Command::Perf(args) => perf::run(args),
        Command::PerfPeer(args) => perf::run_peer(args),
        Command::PerfNetPeer(args) => perf_net::run_peer(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Nic(args) => nic::run(args),
        Command::Engine { spec } => Ok(softverbs::nic::engine::serve(spec)?),
        Command::Run(_) => Err("`run` is handled before dispatch".into()),
    }
}

/// The device named `name`, or the first device when `name` is `None`.
pub fn find_device(name: Option<&str>) -> Result<softverbs::Device> {
    let devices = softverbs::devices()?;
    match name {
        None => devices
            .into_iter()
            .next()
            .ok_or_else(|| "no RDMA devices found".into()),
        Some(name) => {
            let names: Vec<&str> = devices.iter().map(|d| d.name()).collect();
            let list = names.join(", ");
            devices
                .iter()
                .find(|d| d.name() == name)
                .cloned()
                .ok_or_else(|| format!("no device named `{name}` (devices: {list})").into())
        }
    }
}

/// Writes `text` to standard output, reporting (instead of panicking on) a closed pipe.
pub fn write_stdout(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing to standard output: {e}").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses and runs a command line that must fail; returns the error text.
    fn fails(args: &[&str]) -> String {
        let argv = std::iter::once("softverbs").chain(args.iter().copied());
        match Cli::try_parse_from(argv) {
            Err(e) => e.to_string(),
            Ok(cli) => dispatch(&cli.command)
                .expect_err("the command should fail")
                .to_string(),
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        let cases: &[(&[&str], &str)] = &[
            // Server and client mode check their options before listening or connecting.
            (&["pingpong", "-n", "0"], "at least 1"),
            (&["pingpong", "--timeout", "0"], "--timeout"),
            (&["pingpong", "-p", "0", "localhost"], "-p 0"),
            (
                &["pingpong", "--timeout", "1", "-p", "1", "127.0.0.1"],
                "cannot connect to 127.0.0.1 port 1 within 1 s",
            ),
            (&["perf", "--iters", "0"], "at least 1"),
            (&["perf", "-d", "nope"], "no device named"),
            (&["pingpong", "--loopback", "-n", "0"], "at least 1"),
            (
                &["pingpong", "--loopback", "--transport", "ud", "-s", "4097"],
                "use -s",
            ),
            (
                &["pingpong", "--loopback", "-s", "4294967296"],
                "max_msg_sz",
            ),
            (&["pingpong", "--loopback", "-d", "nope"], "no device named"),
            (&["devinfo", "-d", "nope"], "no device named"),
            (
                &["pingpong", "--loopback", "--transport", "xrc"],
                "invalid value",
            ),
            (&["pingpong", "--loopback", "-s", "big"], "invalid value"),
            (
                &["pingpong", "--loopback", "somehost"],
                "cannot be used with",
            ),
        ];
        for (args, want) in cases {
            let got = fails(args);
            assert!(got.contains(want), "{args:?}: {got}");
        }
    }
}
