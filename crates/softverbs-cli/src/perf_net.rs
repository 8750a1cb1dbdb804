//! `softverbs perf --net`: RoCE between two hosts, each figure beside a raw UDP baseline
//! measured on the same path in the same run.
//!
//! The user's process makes two network namespaces joined by a veth pair (the harness of
//! `softverbs_cli::netns`) and starts one end in each with `ip netns exec` (the hidden
//! `perf-net-peer` subcommand): the measuring end (A) in one, the serving end (B) in the
//! other, each with the networked device `roce0` on its veth. A listens on TCP across the
//! veth; the user's process learns A's port from A's first line of output, starts B to
//! connect to it, and prints the report A writes as its last line. Over that connection the
//! two ends run
//!
//! - the **UDP ping-pong** of 64-byte datagrams, both ends busy-polling non-blocking
//!   sockets: the latency floor of any protocol over UDP on this path;
//! - the **UDP stream** of MTU-sized datagrams three ways (one `sendto` per datagram,
//!   `sendmmsg` batches, UDP GSO where the kernel offers it); B counts what arrives, from
//!   the first datagram to the last, and the best way is the bandwidth baseline;
//! - the RDMA tests of `perf` (WRITE and SEND latency at 64 B, WRITE bandwidth at 64 KiB and
//!   1 MiB) with QPs that address each other by a GRH: `dgid` the peer's IPv4-mapped GID,
//!   `sgid_index` the index of this side's (looked up with `query_gid`).
//!
//! Ratios are RDMA / UDP: latency targets ≤ 1.5×, bandwidth ≥ 0.80× (`*`: missed). When the
//! RDMA device cannot be used, the baselines are still measured and printed, and the report
//! says why the RDMA figures are missing (`"ok": false`).

use crate::Result;
use crate::oob::{PeerFailed, TcpLink, watch_for_failure};
use crate::perf::{
    self, Args, BW_SIZES, BW_TIME_CAP, BwRun, Guard, LAT_SIZE, LINK_TIMEOUT, Latency, Msg, Plan,
    RdmaFigures, Route, START_TIMEOUT, Test, WATCH_EVERY, Watchdog, expect, ns, recv, send,
    size_text,
};
use crate::report::print_report;
use serde::{Deserialize, Serialize};
use softverbs::nic::engine::{EngineHold, UDP_GRO, UDP_SEGMENT, set_udp_option};
use softverbs::{Device, Gid};
use softverbs_cli::netns::{self, HostNs, NetConfig, NetPair};
use std::io::{BufRead, BufReader, ErrorKind, IoSlice};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The networked device each end uses unless `-d` names another.
const NET_DEVICE: &str = "roce0";
/// Latency ratio (RDMA / UDP) to stay under, and bandwidth ratio to reach.
const LAT_TARGET: f64 = 1.5;
const BW_TARGET: f64 = 0.80;
/// Datagrams per `sendmmsg` call.
const MMSG_BATCH: usize = 32;
/// Most segments per GSO send (the kernel's limit, UDP_MAX_SEGMENTS).
const GSO_MAX_SEGMENTS: usize = 64;
/// The receiver's socket buffer: enough to absorb a burst while it is descheduled.
const SINK_RCVBUF: usize = 32 << 20;
/// After the sender says it is done, the receiver drains until nothing came for this long.
const DRAIN_QUIET: Duration = Duration::from_millis(20);
/// The whole run, as the user's process waits for the report.
const RUN_LIMIT: Duration = Duration::from_secs(600);
/// IPv4 and UDP headers: a datagram's payload is the MTU less these.
const IPV4_UDP_HEADERS: usize = 28;

/// The role of a `perf-net-peer` process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// A: listens, measures, prints the report.
    Measure,
    /// B: connects to A and serves its tests.
    Serve,
}

/// The arguments of an end of `perf --net`, which it starts itself.
#[derive(clap::Args)]
pub struct NetPeerArgs {
    #[arg(long, value_enum)]
    role: Role,
    /// This end's IPv4 address (its sockets bind to it; its GID is `::ffff:` it).
    #[arg(long)]
    ip: Ipv4Addr,
    /// Serve: A's TCP address.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Process id of `perf --net` (the end exits if it is gone).
    #[arg(long)]
    parent: i32,
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    device: Option<String>,
    #[arg(short = 'n', long)]
    iters: Option<u64>,
    #[arg(long)]
    quick: bool,
    #[arg(long)]
    mtu: u32,
    #[arg(long)]
    baselines_only: bool,
    /// How the ends run ("network namespaces" or "same host"), for the report.
    #[arg(long)]
    mode: String,
    /// The CPU this end (and the RoCE engine it starts, which inherits it) runs on.
    #[arg(long)]
    cpu: usize,
    /// Serve: the CPU this end's engine runs on during the latency tests (see
    /// [`latency_engines_share`]); on `cpu` for the others.
    #[arg(long)]
    latency_engine_cpu: Option<usize>,
}

/// True if both hosts' engines run on host A's CPU during the latency tests. With four
/// processes that busy-poll or are woken per packet (two ends, two engines) on fewer CPUs, a
/// round trip wakes an engine four times: each engine on its host's CPU makes two of those
/// wake-ups cross-CPU ones (the packet's arrival is handled on the sender's CPU over a veth,
/// as the kernel does for the UDP baseline), which on a 2-core VM cost 11-19 µs each against
/// 3-4 µs on the same CPU. Both engines on one CPU leave one (ib_write_lat between the
/// namespaces: 23.5 -> 11.0 µs). The bandwidth tests keep an engine per CPU: sharing one,
/// 1 MiB WRITEs fell from 2.2 to 1.4 GB/s.
pub(crate) fn latency_engines_share() -> bool {
    crate::report::cpus() < 4
}

// ---------------------------------------------------------------------------------------------
// The report.

/// A host of the run, as the report shows it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct NetHost {
    netns: Option<String>,
    ifname: Option<String>,
    ipv4: String,
}

/// One way of streaming UDP and what arrived.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct UdpStreamFigure {
    /// `sendto`, `sendmmsg` or `gso`.
    method: String,
    /// Datagrams per call.
    batch: usize,
    /// False when the kernel does not offer it (then `note` says why).
    available: bool,
    note: Option<String>,
    /// Bytes of payload sent and received, datagrams received (after GRO: reads).
    sent_bytes: u64,
    bytes: u64,
    datagrams: u64,
    /// From the first arrival to the last.
    seconds: f64,
    /// Received bytes per second, 10^9.
    gb_s: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct NetBaselines {
    /// UDP ping-pong of LAT_SIZE-byte datagrams, half round trips.
    udp_pingpong: Option<Latency>,
    /// Payload of a stream datagram (MTU - 28).
    udp_payload: usize,
    udp_stream: Vec<UdpStreamFigure>,
    /// The best `udp_stream` figure: the bandwidth baseline.
    udp_stream_best_gb_s: Option<f64>,
    /// Set when the best is GSO: why that is no wire-limited figure.
    note: Option<String>,
}

impl NetBaselines {
    /// True if the best stream is the GSO one.
    fn best_is_gso(&self) -> bool {
        let best = self.udp_stream_best_gb_s;
        self.udp_stream
            .iter()
            .any(|s| s.method == "gso" && s.available && Some(s.gb_s) == best)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct NetLatencyFigure {
    size: usize,
    #[serde(flatten)]
    latency: Latency,
    /// The UDP ping-pong's p50.
    baseline_ns: f64,
    /// p50 / baseline; the target is at most `target`.
    ratio: f64,
    target: f64,
    met: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct NetBandwidthFigure {
    size: usize,
    gb_s: f64,
    bytes: u64,
    writes: u64,
    seconds: f64,
    /// The best UDP stream.
    baseline_gb_s: f64,
    /// gb_s / baseline; the target is at least `target`.
    ratio: f64,
    target: f64,
    met: bool,
    /// gb_s over each UDP stream method that ran, in the order of `udp_stream` (the best
    /// one may be GSO, which over a veth is no wire-limited figure: these keep the plain
    /// `sendto` and `sendmmsg` ratios in view).
    vs_streams: Vec<StreamRatio>,
}

/// An RDMA bandwidth figure over one UDP stream method's.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StreamRatio {
    method: String,
    gb_s: f64,
    ratio: f64,
}

/// What GSO's figure is over a veth: the note printed when it is the best baseline.
const GSO_NOTE: &str = "GSO over a veth is not a wire-limited figure: the kernel hands the \
     whole 64 KiB super-datagram to the peer namespace unsegmented (no MTU-sized frames on any \
     wire), so it measures memory copies; the sendto and sendmmsg ratios are the fair ones here";

/// Everything `perf --net` measured, as `--json` prints it.
#[derive(Debug, Default, Serialize, Deserialize)]
struct NetReport {
    device: String,
    mode: String,
    mtu: u32,
    quick: bool,
    cpus: usize,
    /// The CPU each host's processes run on (its end, and the engine it starts): host A's
    /// first.
    cpu_pair: [usize; 2],
    cpu_model: String,
    hosts: [NetHost; 2],
    /// The two ends' process ids (the measuring one first).
    pids: [u32; 2],
    ok: bool,
    error: Option<String>,
    /// Why the RDMA figures are missing, when they are.
    rdma_error: Option<String>,
    baselines: NetBaselines,
    rdma_write_latency: Option<NetLatencyFigure>,
    send_latency: Option<NetLatencyFigure>,
    rdma_write_bandwidth: Vec<NetBandwidthFigure>,
    /// True if the bandwidth test's writer slept on a completion channel rather than
    /// busy-polled its CQ (see `perf::net_writer_sleeps`).
    bandwidth_writer_sleeps: bool,
    /// The CPU both hosts' engines ran on during the latency tests, if they shared one (see
    /// [`latency_engines_share`]).
    latency_engines_cpu: Option<usize>,
}

fn star(met: bool) -> &'static str {
    if met { "" } else { " *" }
}

impl NetReport {
    fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        let host = |h: &NetHost| match (&h.netns, &h.ifname) {
            (Some(n), Some(i)) => format!("{} {} {}", n, i, h.ipv4),
            _ => h.ipv4.clone(),
        };
        let _ = writeln!(
            t,
            "perf --net: {}, {} ({} <-> {}, MTU {}; pids {} and {}, each host on a CPU of its \
             own: {} and {} of {}{}; {}); latency = half a round trip (p50); targets: latency \
             <= {LAT_TARGET:.1}x UDP, bandwidth >= {BW_TARGET:.2}x UDP (* = missed)",
            self.device,
            self.mode,
            host(&self.hosts[0]),
            host(&self.hosts[1]),
            self.mtu,
            self.pids[0],
            self.pids[1],
            self.cpu_pair[0],
            self.cpu_pair[1],
            self.cpus,
            self.latency_engines_cpu
                .map_or_else(String::new, |c| format!(
                    ", both RoCE engines on CPU {c} for the latency tests"
                )),
            self.cpu_model,
        );
        for (name, fig) in [
            ("RDMA WRITE", &self.rdma_write_latency),
            ("SEND", &self.send_latency),
        ] {
            if let Some(f) = fig {
                let _ = writeln!(
                    t,
                    "  {name} {} latency: {:.0} ns (UDP ping-pong {:.0} ns, {:.2}x{}); p99 {:.0} \
                     ns, mean {:.0} ns, {} round trips",
                    size_text(f.size),
                    f.latency.p50_ns,
                    f.baseline_ns,
                    f.ratio,
                    star(f.met),
                    f.latency.p99_ns,
                    f.latency.mean_ns,
                    f.latency.round_trips
                );
            }
        }
        for f in &self.rdma_write_bandwidth {
            let _ = writeln!(
                t,
                "  RDMA WRITE {} bandwidth: {:.3} GB/s (UDP stream {:.3} GB/s, {:.2}x{}); {} \
                 writes in {:.3} s{}",
                size_text(f.size),
                f.gb_s,
                f.baseline_gb_s,
                f.ratio,
                star(f.met),
                f.writes,
                f.seconds,
                if self.bandwidth_writer_sleeps {
                    ", the writer sleeping on a completion channel"
                } else {
                    ""
                }
            );
            let each: Vec<String> = f
                .vs_streams
                .iter()
                .map(|r| format!("{} {:.3} GB/s {:.2}x", r.method, r.gb_s, r.ratio))
                .collect();
            if !each.is_empty() {
                let _ = writeln!(t, "    vs each UDP stream: {}", each.join(", "));
            }
        }
        if let Some(e) = &self.rdma_error {
            let _ = writeln!(t, "  (RDMA figures missing: {e})");
        }
        let _ = writeln!(t, "baselines:");
        if let Some(l) = &self.baselines.udp_pingpong {
            let _ = writeln!(
                t,
                "  UDP ping-pong {LAT_SIZE} B: {:.0} ns (p99 {:.0} ns, mean {:.0} ns; {} round \
                 trips, both ends busy-polling non-blocking sockets)",
                l.p50_ns, l.p99_ns, l.mean_ns, l.round_trips
            );
        }
        for s in &self.baselines.udp_stream {
            if s.available {
                let _ = writeln!(
                    t,
                    "  UDP stream, {} B datagrams, {} ({} a call): {:.3} GB/s received ({:.1} of \
                     {:.1} MiB sent arrived, {:.3} s)",
                    self.baselines.udp_payload,
                    s.method,
                    s.batch,
                    s.gb_s,
                    s.bytes as f64 / f64::from(1 << 20),
                    s.sent_bytes as f64 / f64::from(1 << 20),
                    s.seconds
                );
            } else {
                let _ = writeln!(
                    t,
                    "  UDP stream, {}: not offered ({})",
                    s.method,
                    s.note.as_deref().unwrap_or("?")
                );
            }
        }
        if let Some(b) = self.baselines.udp_stream_best_gb_s {
            let _ = writeln!(t, "  UDP stream baseline (the best): {b:.3} GB/s");
            if self.baselines.best_is_gso() {
                let _ = writeln!(t, "  ({GSO_NOTE})");
            }
        }
        t
    }
}

// ---------------------------------------------------------------------------------------------
// The user's process: namespaces, the two ends, the report.

/// A child end: killed (and reaped) when dropped.
struct End {
    child: Child,
    name: &'static str,
}

impl End {
    fn stderr_tail(&mut self) -> String {
        perf::stderr_tail(&mut self.child, &format!("the {} end", self.name))
    }

    /// Kills it if it runs; how it ended and what it said, for an error message.
    fn kill(&mut self) -> String {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let status = self
            .child
            .wait()
            .map(|s| format!(" ({s})"))
            .unwrap_or_default();
        format!("{status}{}", self.stderr_tail())
    }

    /// Waits briefly for it to exit by itself, then kills it.
    fn finish(&mut self) -> Result<()> {
        let name = self.name;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match self.child.try_wait()? {
                Some(s) if s.success() => return Ok(()),
                Some(s) => {
                    return Err(format!("the {name} end failed ({s}){}", self.kill()).into());
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        Err(format!("the {name} end did not exit{}", self.kill()).into())
    }
}

impl Drop for End {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Reads `child`'s standard output line by line on a thread of its own.
fn lines_of(child: &mut Child) -> Result<mpsc::Receiver<String>> {
    let out = child.stdout.take().ok_or("no standard output to read")?;
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("perf-net-out".into())
        .spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        })?;
    Ok(rx)
}

/// `perf --net` (the user's process).
pub fn run(args: &Args) -> Result<()> {
    Plan::from_counts(args.iters, args.quick)?; // bad counts fail before anything is made
    // Each host on a CPU of its own, baselines and RDMA alike: where the scheduler puts the
    // processes otherwise moves every figure several times over from run to run.
    let pair = crate::report::cpu_pair(args.cpus.as_deref())?;
    let mtu = args.mtu.unwrap_or(1500);
    if !netns::MTU_RANGE.contains(&mtu) {
        return Err(format!(
            "--mtu {mtu}: from {} to {}",
            netns::MTU_RANGE.start(),
            netns::MTU_RANGE.end()
        )
        .into());
    }
    let net = if args.same_host {
        None
    } else {
        let config = NetConfig {
            mtu,
            attacker: false,
        };
        Some(NetPair::new(&config).map_err(|e| format!("perf --net: {e}"))?)
    };
    let hosts: [Option<&HostNs>; 2] = [net.as_ref().map(|n| n.a()), net.as_ref().map(|n| n.b())];
    let ip = |h: Option<&HostNs>| h.map_or(Ipv4Addr::LOCALHOST, |h| h.ipv4);
    let mode = if args.same_host {
        "same host"
    } else {
        "two network namespaces"
    };
    let device_name = match (&args.device, args.same_host) {
        (Some(d), _) => d.clone(),
        (None, true) => crate::find_device(None).map_or_else(|_| "?".into(), |d| d.name().into()),
        (None, false) => NET_DEVICE.into(),
    };
    let exe = std::env::current_exe().map_err(|e| format!("finding this executable: {e}"))?;
    let command = |h: Option<&HostNs>, role: &str, cpu: usize| {
        let mut cmd = match h {
            Some(h) => h.command(&exe),
            None => Command::new(&exe),
        };
        cmd.arg("perf-net-peer")
            .args(["--role", role, "--ip", &ip(h).to_string()])
            .args(["--parent", &std::process::id().to_string()])
            .args(["--mtu", &mtu.to_string(), "--mode", mode])
            .args(["--cpu", &cpu.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if args.device.is_some() || args.same_host {
            if let Some(d) = &args.device {
                cmd.args(["--ib-dev", d]);
            }
        } else if let Some(h) = h {
            // Each end's networked device on its side's veth.
            cmd.env(
                softverbs::ENV_DEVICES,
                format!("name={NET_DEVICE},netdev={}", h.ifname),
            )
            .args(["--ib-dev", NET_DEVICE]);
        }
        if let Some(n) = args.iters {
            cmd.args(["--iters", &n.to_string()]);
        }
        if args.quick {
            cmd.arg("--quick");
        }
        if args.baselines_only {
            cmd.arg("--baselines-only");
        }
        cmd
    };
    let spawn = |mut cmd: Command, name: &'static str| -> Result<End> {
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting the {name} end ({}): {e}", exe.display()))?;
        Ok(End { child, name })
    };

    let mut a = spawn(command(hosts[0], "measure", pair[0]), "measuring")?;
    let out = lines_of(&mut a.child)?;
    let port: u16 = match out.recv_timeout(START_TIMEOUT) {
        Ok(line) => serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v.get("listening")?.as_u64())
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| format!("the measuring end said `{line}`, not its port"))?,
        Err(_) => {
            return Err(format!("the measuring end did not start{}", a.kill()).into());
        }
    };
    let mut b_cmd = command(hosts[1], "serve", pair[1]);
    let engines_share = hosts[1].is_some() && pair[0] != pair[1] && latency_engines_share();
    if engines_share {
        b_cmd.args(["--latency-engine-cpu", &pair[0].to_string()]);
    }
    b_cmd.args([
        "--connect",
        &SocketAddr::from((ip(hosts[0]), port)).to_string(),
    ]);
    b_cmd.stdout(Stdio::null());
    let mut b = spawn(b_cmd, "serving")?;

    let started = Instant::now();
    let line = loop {
        match out.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => break line,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(
                    format!("the measuring end stopped without a report{}", a.kill()).into(),
                );
            }
            Err(mpsc::RecvTimeoutError::Timeout) if started.elapsed() > RUN_LIMIT => {
                return Err(format!(
                    "no report after {} s; stopped both ends{}",
                    RUN_LIMIT.as_secs(),
                    a.kill()
                )
                .into());
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    };
    let mut report: NetReport = serde_json::from_str(&line)
        .map_err(|e| format!("bad report from the measuring end ({e}): {line}"))?;
    for (slot, h) in report.hosts.iter_mut().zip(hosts) {
        *slot = NetHost {
            netns: h.map(|h| h.netns.clone()),
            ifname: h.map(|h| h.ifname.clone()),
            ipv4: ip(h).to_string(),
        };
    }
    report.device = device_name;
    report.cpu_pair = pair;
    let latency_ran = report.rdma_write_latency.is_some() || report.send_latency.is_some();
    report.latency_engines_cpu = (engines_share && latency_ran).then_some(pair[0]);
    // The ends count only their own CPU, to which they are pinned.
    report.cpus = crate::report::cpus();
    let a_done = a.finish();
    let b_done = b.finish();
    if report.error.is_none() {
        if let Err(e) = a_done.and(b_done) {
            report.ok = false;
            report.error = Some(e.to_string());
        }
    }
    drop((a, b));
    drop(net);
    print_report(&report, args.json, NetReport::text)?;
    match report.error {
        None => Ok(()),
        Some(e) => Err(e.into()),
    }
}

// ---------------------------------------------------------------------------------------------
// The two ends.

/// `softverbs perf-net-peer`: one end of `perf --net`.
pub fn run_peer(args: &NetPeerArgs) -> Result<()> {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .map_err(|e| format!("prctl(PR_SET_PDEATHSIG): {e}"))?;
    if rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(args.parent) {
        return Err(
            "perf-net-peer is run by `softverbs perf --net`, and its parent is gone".into(),
        );
    }
    let plan = Plan::from_counts(args.iters, args.quick)?;
    // Before any thread starts (and before the engine, which inherits it).
    crate::report::pin_to(args.cpu)?;
    match args.role {
        Role::Measure => measure_end(args, &plan),
        Role::Serve => serve_end(args),
    }
}

/// Runs `body` with a thread watching `link` for the peer's failure (so spins stop at once).
fn watched<T>(
    link: &mut TcpLink,
    guard: &Guard,
    body: impl FnOnce(&mut TcpLink) -> Result<T>,
) -> Result<T> {
    let watch = link.stream_clone()?;
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let _ = std::thread::Builder::new()
            .name("perf-watch".into())
            .spawn_scoped(s, || {
                watch_for_failure(&watch, &guard.abort, &done, WATCH_EVERY)
            });
        let r = body(link);
        done.store(true, Ordering::Relaxed);
        r
    })
}

/// A: listens, measures, prints the report as its last line (exit status 0 whenever it
/// could print one: the report says what failed).
fn measure_end(args: &NetPeerArgs, plan: &Plan) -> Result<()> {
    let listener = TcpLink::listen((args.ip, 0).into())?;
    let port = listener.local_addr()?.port();
    crate::write_stdout(&format!("{{\"listening\": {port}}}\n"))?;
    let mut link = TcpLink::accept(&listener, START_TIMEOUT, LINK_TIMEOUT, || Ok(()))
        .map_err(|e| format!("waiting for the serving end: {e}"))?;
    drop(listener);
    let guard = Arc::new(Guard::new());
    let watchdog = Watchdog::start(guard.clone(), 0);
    let mut report = NetReport {
        mode: args.mode.clone(),
        mtu: args.mtu,
        quick: args.quick,
        cpus: crate::report::cpus(),
        cpu_model: crate::report::cpu_model(),
        pids: [std::process::id(), 0],
        bandwidth_writer_sleeps: crate::perf::net_writer_sleeps(),
        ..NetReport::default()
    };
    let result = watched(&mut link, &guard, |link| {
        measure(link, args, plan, &guard, &watchdog, &mut report)
    })
    .map_err(|e| perf::explain(e, &mut link, "the serving end"));
    if let Err(e) = &result {
        let phase = watchdog.current_phase();
        let msg = e.to_string();
        report.error = Some(if msg.starts_with(&phase) {
            msg
        } else {
            format!("{phase}: {msg}")
        });
        if report.rdma_error.is_none() && report.rdma_write_bandwidth.len() < BW_SIZES.len() {
            report.rdma_error = Some("the run stopped (see the error)".into());
        }
    }
    drop(watchdog);
    report.ok = result.is_ok();
    let _ = send(&mut link, &Msg::Quit);
    crate::write_stdout(&(serde_json::to_string(&report)? + "\n"))
}

/// The device named on the command line (else the first) and this end's route: the index
/// of its GID `::ffff:<ip>`.
fn rdma_device(device: Option<&str>, ip: Ipv4Addr) -> Result<(Device, Route)> {
    let name = device.unwrap_or("the first device");
    let dev = crate::find_device(device).map_err(|e| format!("RDMA device {name}: {e}"))?;
    let ctx = dev
        .open()
        .map_err(|e| format!("RDMA device {}: cannot be opened: {e}", dev.name()))?;
    let port = ctx.query_port(1)?;
    let want = Gid::from(ip.to_ipv6_mapped());
    let mut seen = Vec::new();
    for i in 0..u32::try_from(port.gid_tbl_len).unwrap_or(0) {
        let gid = ctx.query_gid(1, i)?;
        if gid == want {
            let sgid_index =
                u8::try_from(i).map_err(|_| format!("GID index {i} does not fit a GRH"))?;
            return Ok((
                dev,
                Route {
                    sgid_index,
                    gid: want,
                },
            ));
        }
        if !gid.is_zero() {
            seen.push(format!("{i}: {}", gid.to_ipv6()));
        }
    }
    Err(format!(
        "RDMA device {}: no GID {} on port 1 (GIDs: {})",
        dev.name(),
        want.to_ipv6(),
        seen.join(", ")
    )
    .into())
}

/// A's measurements, in order; figures go into `report` as they come.
fn measure(
    link: &mut TcpLink,
    args: &NetPeerArgs,
    plan: &Plan,
    guard: &Guard,
    watchdog: &Watchdog,
    report: &mut NetReport,
) -> Result<()> {
    send(
        link,
        &Msg::Hello {
            pid: std::process::id(),
            spins: guard.spins(),
        },
    )?;
    if let Msg::Hello { pid, .. } = expect(link, "hello", |m| {
        matches!(m, Msg::Hello { .. }).then_some(m)
    })? {
        report.pids[1] = pid;
    }

    watchdog.phase(guard, "UDP ping-pong");
    let rounds = plan.warmup + plan.iters;
    send(link, &Msg::UdpPing { rounds })?;
    let port = udp_ready(link)?;
    let sock = UdpSocket::bind((args.ip, 0))?;
    let peer = SocketAddr::from((link.peer().ip(), port));
    let rtts = udp_pingpong(&sock, peer, plan, guard)?;
    expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
    let udp_lat = Latency::from_rtts(rtts, plan.iters);
    report.baselines.udp_pingpong = Some(udp_lat.clone());

    let payload = (args.mtu as usize).saturating_sub(IPV4_UDP_HEADERS).max(1);
    report.baselines.udp_payload = payload;
    for method in [Method::Sendto, Method::Sendmmsg, Method::Gso] {
        watchdog.phase(guard, &format!("UDP stream ({})", method.name()));
        send(link, &Msg::UdpSink)?;
        let port = udp_ready(link)?;
        let sock = UdpSocket::bind((args.ip, 0))?;
        sock.connect((link.peer().ip(), port))?;
        let sent = udp_stream(&sock, method, payload, plan.bw_total, guard);
        send(
            link,
            &Msg::UdpEnd {
                sent: *sent.as_ref().unwrap_or(&0),
            },
        )?;
        let Msg::UdpCounted {
            bytes,
            datagrams,
            nanos,
        } = expect(link, "udp_counted", |m| {
            matches!(m, Msg::UdpCounted { .. }).then_some(m)
        })?
        else {
            unreachable!("checked by expect")
        };
        let seconds = nanos as f64 / 1e9;
        let (available, note, sent_bytes) = match sent {
            Ok(n) => (true, None, n),
            Err(StreamError::NotOffered(why)) => (false, Some(why), 0),
            Err(StreamError::Failed(e)) => return Err(e),
        };
        report.baselines.udp_stream.push(UdpStreamFigure {
            method: method.name().into(),
            batch: method.batch(payload),
            available,
            note,
            sent_bytes,
            bytes,
            datagrams,
            seconds,
            gb_s: if seconds > 0.0 {
                bytes as f64 / seconds / 1e9
            } else {
                0.0
            },
        });
    }
    let best = report
        .baselines
        .udp_stream
        .iter()
        .filter(|s| s.available)
        .map(|s| s.gb_s)
        .fold(0.0f64, f64::max);
    report.baselines.udp_stream_best_gb_s = Some(best);
    if report.baselines.best_is_gso() {
        report.baselines.note = Some(GSO_NOTE.into());
    }
    if args.baselines_only {
        return Ok(());
    }

    watchdog.phase(guard, "opening the RDMA device");
    let (device, route) = match rdma_device(args.device.as_deref(), args.ip) {
        Ok(d) => d,
        Err(e) => {
            report.rdma_error = Some(e.to_string());
            return Err(e);
        }
    };
    let mut figs = RdmaFigures::default();
    let result = perf::measure_rdma(link, &device, Some(route), plan, guard, watchdog, &mut figs);
    let lat = |latency: Latency| {
        let ratio = latency.p50_ns / udp_lat.p50_ns.max(1e-9);
        NetLatencyFigure {
            size: LAT_SIZE,
            baseline_ns: udp_lat.p50_ns,
            ratio,
            target: LAT_TARGET,
            met: ratio <= LAT_TARGET,
            latency,
        }
    };
    report.rdma_write_latency = figs.write_lat.map(lat);
    report.send_latency = figs.send_lat.map(lat);
    for run in figs.write_bw {
        let f = BwRun::figure(&run, best);
        report.rdma_write_bandwidth.push(NetBandwidthFigure {
            size: f.size,
            gb_s: f.gb_s,
            bytes: f.bytes,
            writes: f.writes,
            seconds: f.seconds,
            baseline_gb_s: best,
            ratio: f.ratio,
            target: BW_TARGET,
            met: f.ratio >= BW_TARGET,
            vs_streams: report
                .baselines
                .udp_stream
                .iter()
                .filter(|s| s.available && s.gb_s > 0.0)
                .map(|s| StreamRatio {
                    method: s.method.clone(),
                    gb_s: s.gb_s,
                    ratio: f.gb_s / s.gb_s,
                })
                .collect(),
        });
    }
    if let Err(e) = &result {
        report.rdma_error = Some(e.to_string());
    }
    result
}

fn udp_ready(link: &mut TcpLink) -> Result<u16> {
    match expect(link, "udp_ready", |m| {
        matches!(m, Msg::UdpReady { .. }).then_some(m)
    })? {
        Msg::UdpReady { port } => Ok(port),
        _ => unreachable!("checked by expect"),
    }
}

/// B: connects to A and does what it asks until `quit`.
fn serve_end(args: &NetPeerArgs) -> Result<()> {
    let to = args.connect.ok_or("the serving end needs --connect")?;
    let mut link = TcpLink::connect(&to.ip().to_string(), to.port(), START_TIMEOUT, LINK_TIMEOUT)?;
    let guard = Guard::new();
    let mut device: Option<(Device, Route, Option<EngineHold>)> = None;
    let result = watched(&mut link, &guard, |link| {
        loop {
            match recv(link)? {
                Msg::Hello { .. } => send(
                    link,
                    &Msg::Hello {
                        pid: std::process::id(),
                        spins: guard.spins(),
                    },
                )?,
                Msg::UdpPing { rounds } => {
                    let sock = UdpSocket::bind((args.ip, 0))?;
                    send(
                        link,
                        &Msg::UdpReady {
                            port: sock.local_addr()?.port(),
                        },
                    )?;
                    udp_echo(&sock, rounds, &guard)?;
                    send(link, &Msg::Done)?;
                }
                Msg::UdpSink => {
                    let sock = UdpSocket::bind((args.ip, 0))?;
                    tune_sink(&sock);
                    send(
                        link,
                        &Msg::UdpReady {
                            port: sock.local_addr()?.port(),
                        },
                    )?;
                    let (bytes, datagrams, span) = udp_sink(&sock, link, &guard)?;
                    let nanos = u64::try_from(span.as_nanos()).unwrap_or(u64::MAX);
                    send(
                        link,
                        &Msg::UdpCounted {
                            bytes,
                            datagrams,
                            nanos,
                        },
                    )?;
                }
                Msg::Rdma {
                    test,
                    rounds,
                    size,
                    ep,
                } => {
                    if device.is_none() {
                        let (dev, route) = rdma_device(args.device.as_deref(), args.ip)?;
                        // Held, so that it is the same engine whatever the tests open.
                        let hold = match args.latency_engine_cpu {
                            Some(_) if dev.is_networked() => Some(dev.hold_engine()?),
                            _ => None,
                        };
                        device = Some((dev, route, hold));
                    }
                    let (dev, route, hold) = device.as_ref().ok_or("no device")?;
                    if let (Some(hold), Some(shared)) = (hold, args.latency_engine_cpu) {
                        let latency = matches!(test, Test::WriteLat | Test::SendLat);
                        let cpu = if latency { shared } else { args.cpu };
                        hold.place_on(&[cpu]).map_err(|e| {
                            format!(
                                "placing the engine (pid {}) on CPU {cpu}: {e}",
                                hold.engine_pid()
                            )
                        })?;
                    }
                    let _passive =
                        perf::serve_rdma(link, dev, Some(*route), test, rounds, size, &ep, &guard)?;
                }
                Msg::Quit => return Ok(()),
                other => {
                    return Err(format!("unexpected message from perf --net: {other:?}").into());
                }
            }
        }
    });
    perf::tell_peer(&mut link, &result);
    result
}

// ---------------------------------------------------------------------------------------------
// UDP baselines.

/// A non-blocking `recv`: `None` when nothing is there.
fn try_recv(sock: &UdpSocket, buf: &mut [u8]) -> Result<Option<(usize, SocketAddr)>> {
    match sock.recv_from(buf) {
        Ok(got) => Ok(Some(got)),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(format!("UDP receive: {e}").into()),
    }
}

/// A non-blocking `send_to` that waits (spinning) while the socket buffer is full.
fn spin_send(sock: &UdpSocket, buf: &[u8], to: SocketAddr, guard: &Guard) -> Result<()> {
    let what = || "UDP send: the socket stayed full".to_string();
    guard.spin(&what, |_| match sock.send_to(buf, to) {
        Ok(_) => Ok(Some(())),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(format!("UDP send: {e}").into()),
    })
}

/// A's side of the UDP ping-pong: round trips (ns) of LAT_SIZE-byte datagrams carrying
/// their round number, both ends spinning on non-blocking sockets.
fn udp_pingpong(
    sock: &UdpSocket,
    peer: SocketAddr,
    plan: &Plan,
    guard: &Guard,
) -> Result<Vec<f64>> {
    sock.set_nonblocking(true)?;
    let total = plan.warmup + plan.iters;
    let mut out = [0u8; LAT_SIZE];
    let mut buf = [0u8; 2048];
    let mut stamps = Vec::with_capacity(plan.iters as usize + 1);
    for r in 0..total {
        if r >= plan.warmup {
            stamps.push(Instant::now());
            guard.beat();
        }
        out[..8].copy_from_slice(&r.to_le_bytes());
        spin_send(sock, &out, peer, guard)?;
        let what = || format!("UDP ping-pong, round {r}: no answer from the serving end");
        guard.spin(&what, |_| {
            Ok(try_recv(sock, &mut buf)?
                .filter(|&(n, _)| n == LAT_SIZE && buf[..8] == r.to_le_bytes())
                .map(drop))
        })?;
    }
    stamps.push(Instant::now());
    Ok(stamps.windows(2).map(|w| ns(w[1] - w[0])).collect())
}

/// B's side of the UDP ping-pong: sends each of `rounds` datagrams back where it came from.
fn udp_echo(sock: &UdpSocket, rounds: u64, guard: &Guard) -> Result<()> {
    sock.set_nonblocking(true)?;
    let mut buf = [0u8; 2048];
    for r in 0..rounds {
        let what = || format!("UDP ping-pong, round {r}: no datagram from the measuring end");
        let (n, from) = guard.spin(&what, |_| try_recv(sock, &mut buf))?;
        spin_send(sock, &buf[..n], from, guard)?;
    }
    Ok(())
}

/// The ways to stream UDP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    /// One `send` per datagram.
    Sendto,
    /// `sendmmsg` of MMSG_BATCH datagrams.
    Sendmmsg,
    /// One `send` of many datagrams' bytes, cut into datagrams by the kernel (UDP_SEGMENT).
    Gso,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Sendto => "sendto",
            Method::Sendmmsg => "sendmmsg",
            Method::Gso => "gso",
        }
    }

    /// Datagrams per call.
    fn batch(self, payload: usize) -> usize {
        match self {
            Method::Sendto => 1,
            Method::Sendmmsg => MMSG_BATCH,
            // A GSO send is one UDP datagram's worth before segmentation: under 64 KiB.
            Method::Gso => (65_000 / payload).clamp(1, GSO_MAX_SEGMENTS),
        }
    }
}

enum StreamError {
    /// The kernel does not offer the method (why).
    NotOffered(String),
    Failed(crate::Error),
}

/// A's stream to the connected `sock`: `payload`-byte datagrams, `method`'s way, for
/// `total` bytes (or BW_TIME_CAP); the bytes sent.
fn udp_stream(
    sock: &UdpSocket,
    method: Method,
    payload: usize,
    total: u64,
    guard: &Guard,
) -> std::result::Result<u64, StreamError> {
    let failed = |what: &str, e: std::io::Error| {
        StreamError::Failed(format!("UDP stream ({}): {what}: {e}", method.name()).into())
    };
    let batch = method.batch(payload);
    let buf: Vec<u8> = (0..payload * batch).map(|j| j as u8).collect();
    if method == Method::Gso {
        set_udp_option(sock, UDP_SEGMENT, payload as libc::c_int)
            .map_err(|e| StreamError::NotOffered(format!("setsockopt(UDP_SEGMENT): {e}")))?;
    }
    let t0 = Instant::now();
    let mut sent = 0u64;
    let mut calls = 0u64;
    while sent < total {
        let n = match method {
            Method::Sendto => sock.send(&buf[..payload]).map_err(|e| failed("send", e))?,
            Method::Gso => match sock.send(&buf) {
                Ok(n) => n,
                // The first send shows whether the path can segment (EIO without checksum
                // offload, for one).
                Err(e) if calls == 0 => {
                    return Err(StreamError::NotOffered(format!(
                        "send with UDP_SEGMENT: {e}"
                    )));
                }
                Err(e) => return Err(failed("send", e)),
            },
            Method::Sendmmsg => {
                let iovs: Vec<[IoSlice<'_>; 1]> =
                    buf.chunks(payload).map(|c| [IoSlice::new(c)]).collect();
                let mut controls: Vec<rustix::net::SendAncillaryBuffer<'_, '_, '_>> =
                    (0..iovs.len()).map(|_| Default::default()).collect();
                let mut msgs: Vec<rustix::net::MMsgHdr<'_>> = iovs
                    .iter()
                    .zip(controls.iter_mut())
                    .map(|(iov, c)| rustix::net::MMsgHdr::new(iov, c))
                    .collect();
                let mut done = 0;
                while done < msgs.len() {
                    done += rustix::net::sendmmsg(
                        sock,
                        &mut msgs[done..],
                        rustix::net::SendFlags::empty(),
                    )
                    .map_err(|e| failed("sendmmsg", e.into()))?;
                }
                done * payload
            }
        };
        sent += n as u64;
        calls += 1;
        if calls % 64 == 0 {
            guard.beat();
            if t0.elapsed() > BW_TIME_CAP {
                break;
            }
        }
    }
    Ok(sent)
}

/// B's socket for a stream: a large buffer (forced, as root), and GRO so coalesced
/// segments arrive as one read where the kernel offers it.
fn tune_sink(sock: &UdpSocket) {
    if rustix::net::sockopt::set_socket_recv_buffer_size_force(sock, SINK_RCVBUF).is_err() {
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(sock, SINK_RCVBUF);
    }
    let _ = set_udp_option(sock, UDP_GRO, 1);
}

/// B's side of a stream: counts what arrives until A's `udp_end` and a quiet moment after
/// it; (bytes, datagrams, the time from the first arrival to the last).
fn udp_sink(sock: &UdpSocket, link: &mut TcpLink, guard: &Guard) -> Result<(u64, u64, Duration)> {
    sock.set_nonblocking(true)?;
    let tcp = link.stream_clone()?;
    let mut buf = vec![0u8; 1 << 16];
    let (mut bytes, mut datagrams) = (0u64, 0u64);
    let (mut first, mut last) = (None::<Instant>, Instant::now());
    let mut ended: Option<Instant> = None;
    let start = Instant::now();
    let mut idle = 0u32;
    loop {
        match try_recv(sock, &mut buf)? {
            Some((n, _)) => {
                let now = Instant::now();
                first.get_or_insert(now);
                last = now;
                bytes += n as u64;
                datagrams += 1;
                idle = 0;
            }
            None => {
                idle = idle.wrapping_add(1);
                if idle % 256 != 0 {
                    std::hint::spin_loop();
                    continue;
                }
                guard.beat();
                if guard.abort.load(Ordering::Relaxed) {
                    return Err(PeerFailed.into());
                }
                match ended {
                    None => {
                        let zero = rustix::event::Timespec {
                            tv_sec: 0,
                            tv_nsec: 0,
                        };
                        let mut fds = [rustix::event::PollFd::new(
                            &tcp,
                            rustix::event::PollFlags::IN,
                        )];
                        if rustix::event::poll(&mut fds, Some(&zero)).unwrap_or(0) > 0 {
                            ended = Some(Instant::now());
                        } else if start.elapsed() > 3 * BW_TIME_CAP {
                            return Err(
                                "UDP stream: the measuring end never said it was done".into()
                            );
                        }
                    }
                    Some(at) => {
                        let quiet = at.max(last);
                        if quiet.elapsed() > DRAIN_QUIET {
                            break;
                        }
                    }
                }
            }
        }
    }
    expect(link, "udp_end", |m| {
        matches!(m, Msg::UdpEnd { .. }).then_some(m)
    })?;
    let span = first.map_or(Duration::ZERO, |f| last - f);
    Ok((bytes, datagrams, span))
}
