//! `softverbs perf`: RDMA latency and bandwidth between two processes of one host, each
//! figure beside the baseline it cannot beat.
//!
//! The process started by the user (A) re-executes itself as a second process (B, the hidden
//! `perf-peer` subcommand); the two swap endpoints over a TCP connection on 127.0.0.1 and then:
//!
//! - **RDMA WRITE latency** (64 B), as perftest's `ib_write_lat` measures it: A writes into
//!   B's buffer; B spins on the last byte of its buffer until it changes, then writes back
//!   into A's buffer, where A spins likewise. Half the round trip is the latency.
//! - **SEND latency** (64 B): a ping-pong of SENDs into pre-posted receives, both ends polling
//!   their CQs.
//! - **RDMA WRITE bandwidth** (64 KiB and 1 MiB): A keeps a queue of writes outstanding for a
//!   fixed total; B does nothing until it checks the bytes at the end.
//!
//! and the baselines: a **cache-line ping-pong** through shared memory between the same two
//! processes (the floor of any cross-process latency on this machine) and single-thread
//! **memcpy** bandwidth (the ceiling of any copy). Every wait has a time limit, the peer's
//! failures are reported by the peer over the link, and a watchdog ends the run (and the peer)
//! if this process stops making progress.

use crate::Result;
use crate::oob::{OobLink, PeerError, PeerFailed, TcpLink, watch_for_failure};
use crate::perf_rate::{
    CQ_MOD as RATE_CQ_MOD, MSG_SIZE as RATE_MSG, RX_DEPTH as RATE_RX_DEPTH,
    TX_DEPTH as RATE_TX_DEPTH,
};
use crate::report::{count_arg, cpus, print_report};
use serde::{Deserialize, Serialize};
use softverbs::{
    AccessFlags, AhAttr, CompletionChannel, CompletionQueue, Context, Device, Endpoint, Gid,
    GlobalRoute, MemoryRegion, PortAttr, ProtectionDomain, QpAttr, QpAttrMask, QpCap, QpInitAttr,
    QpState, QpType, QueuePair, RecvWr, SendFlags, SendOp, SendWr, WorkCompletion,
};
use std::hash::BuildHasher;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Message size of the latency tests.
pub(crate) const LAT_SIZE: usize = 64;
/// Message sizes of the bandwidth tests.
pub(crate) const BW_SIZES: [usize; 2] = [64 << 10, 1 << 20];
/// Round trips of each latency test, normally and with `--quick`.
const DEFAULT_ITERS: u64 = 10_000;
const QUICK_ITERS: u64 = 1_000;
/// Bytes each bandwidth figure (and its memcpy baseline) moves, normally and with `--quick`.
pub(crate) const BW_TOTAL: u64 = 1 << 30;
pub(crate) const QUICK_BW_TOTAL: u64 = 64 << 20;
/// Runs of the memcpy baseline (the best counts).
const MEMCPY_TRIALS: u64 = 5;
/// A bandwidth test stops early (and reports what it moved) after this long.
pub(crate) const BW_TIME_CAP: Duration = Duration::from_secs(10);
/// The cache-line ping-pong runs this many times the round trips of the RDMA tests...
const CACHELINE_FACTOR: u64 = 100;
/// ... timed in batches of this many (reading the clock every round would double the figure).
const CACHELINE_BATCH: u64 = 64;
/// Writes the bandwidth test keeps outstanding (perftest's default `--tx-depth`).
const TX_DEPTH: u64 = 128;
/// Every CQ_MOD-th bandwidth write is signaled.
const CQ_MOD: u64 = 16;
/// Every SIGNAL_EVERY-th latency message is signaled (and so frees the send queue).
const SIGNAL_EVERY: u64 = 32;
/// Receives each end of the SEND latency test keeps posted.
const RX_DEPTH: usize = 16;
/// Send queue depth of the latency tests (at most 2 × SIGNAL_EVERY are ever outstanding).
const LAT_SQ_DEPTH: u32 = 128;
/// How long a spin may wait for the peer's next message or completion.
pub(crate) const SPIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for a message on the link (the peer starts, or finishes a step).
pub(crate) const LINK_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the peer process may take to start and connect.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(10);
/// The watchdog ends the run when this process makes no progress for this long.
const STALL_LIMIT: Duration = Duration::from_secs(25);
/// Spins of a wait before it starts to yield the CPU (and to check its limits); with a single
/// CPU to run on, spinning only delays the peer, so waits yield almost at once.
const PURE_SPINS: u32 = 1 << 14;
const PURE_SPINS_ONE_CPU: u32 = 4;
/// After that, checks of the time limit happen every this many spins.
const CHECK_EVERY: u32 = 256;
/// How often the link is looked at for a failed peer.
pub(crate) const WATCH_EVERY: Duration = Duration::from_millis(20);
/// Direction tags in latency payloads.
const PING: u8 = 0x50;
const PONG: u8 = 0x51;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Option<PerfCommand>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// Round trips of each latency test [default: 10000; with --quick 1000]; the cache-line
    /// baseline runs 100 times as many.
    #[arg(short = 'n', long, value_name = "N")]
    pub(crate) iters: Option<u64>,
    /// Small counts, for smoke checks (a few seconds): 1000 round trips, and 64 MiB instead
    /// of 1 GiB per bandwidth figure.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Device to use (default: the first device; with --net, `roce0`).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    pub(crate) device: Option<String>,
    /// RoCE between two hosts: two network namespaces joined by a veth pair (made by this
    /// command, which needs root), one end in each, beside raw UDP baselines on that path.
    #[arg(long)]
    pub(crate) net: bool,
    /// With --net: the MTU of the veth pair [default: 1500; at most 9000].
    #[arg(long, requires = "net", value_name = "BYTES")]
    pub(crate) mtu: Option<u32>,
    /// With --net: both ends in this namespace over 127.0.0.1 (to check the logic on any
    /// device, e.g. -d softverbs0, without root).
    #[arg(long, requires = "net", hide = true)]
    pub(crate) same_host: bool,
    /// With --net: the UDP baselines only.
    #[arg(long, requires = "net", hide = true)]
    pub(crate) baselines_only: bool,
    /// The two CPUs the two processes run on (same host), this one's first [default: the first two this
    /// process may use]: baselines and RDMA figures are measured on the same pair. With
    /// --net, host A's CPU and host B's (each end and the RoCE engine it starts).
    #[arg(long, value_name = "A,B")]
    pub(crate) cpus: Option<String>,
}

/// Measurements other than the two-process RDMA figures.
#[derive(clap::Subcommand)]
pub enum PerfCommand {
    /// Nanoseconds per completion polled through each of the four CQ polling APIs (classic,
    /// compact poll_ex, cursor, typed cursor), beside classic poll; and compact records read
    /// at offsets known only at run time.
    CqPoll(crate::perf_cq::Args),
    /// Messages per second and descriptor bytes per message for one matrix column sent
    /// three ways: one SGE per cell, a CPU copy to a bounce buffer, one SGE over an
    /// interleaved layout.
    Noncontig(crate::perf_noncontig::Args),
    /// Microseconds to create and destroy each of 10,000 QPs, the memory and descriptors an
    /// idle QP holds, and the time to register each of max_mr memory regions.
    Objects(crate::perf_objects::Args),
}

/// The arguments of the second process, which `perf` starts itself.
#[derive(clap::Args)]
pub struct PeerArgs {
    /// TCP port on 127.0.0.1 to connect to.
    #[arg(long)]
    port: u16,
    /// File descriptor of the shared page (inherited from the parent).
    #[arg(long)]
    shm_fd: u32,
    /// Process id of the parent (the peer exits if it is gone).
    #[arg(long)]
    parent: i32,
    /// Device to use.
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    device: Option<String>,
    /// The CPU to run on.
    #[arg(long)]
    cpu: Option<usize>,
    /// Busy-wait: the parent runs on another CPU. Told by the parent, which knows both CPUs:
    /// this process inherits the parent's pinning, so it would count one CPU and yield on
    /// every look (which had made each of its waits a system call).
    #[arg(long)]
    spin: bool,
}

/// What to run: the same numbers on both ends.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// Measured round trips of each latency test.
    pub(crate) iters: u64,
    /// Round trips run first and not measured.
    pub(crate) warmup: u64,
    /// Bytes per bandwidth figure.
    pub(crate) bw_total: u64,
    /// Messages per message-rate figure.
    pub(crate) messages: u64,
    /// QP counts of the round-robin rate.
    pub(crate) fan_counts: &'static [usize],
}

impl Plan {
    fn new(args: &Args) -> Result<Plan> {
        Plan::from_counts(args.iters, args.quick)
    }

    /// The plan for `--iters` `iters` and `--quick` `quick`.
    pub(crate) fn from_counts(iters: Option<u64>, quick: bool) -> Result<Plan> {
        let iters = count_arg(
            "--iters",
            iters,
            quick,
            (DEFAULT_ITERS, QUICK_ITERS),
            u64::MAX / (2 * CACHELINE_FACTOR),
        )?;
        Ok(Plan {
            iters,
            warmup: (iters / 10).clamp(1, 10_000),
            bw_total: if quick { QUICK_BW_TOTAL } else { BW_TOTAL },
            messages: if quick {
                crate::perf_rate::QUICK_MESSAGES
            } else {
                crate::perf_rate::MESSAGES
            },
            fan_counts: if quick {
                &crate::perf_fan::QUICK_COUNTS
            } else {
                &crate::perf_fan::COUNTS
            },
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The protocol between the two processes (JSON, one message per line).

/// A QP's address plus the buffer peers may write into.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireEp {
    qpn: u32,
    psn: u32,
    lid: u16,
    gid: String,
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
}

impl WireEp {
    fn endpoint(&self) -> Result<Endpoint> {
        Ok(Endpoint {
            qpn: self.qpn,
            psn: self.psn,
            lid: self.lid,
            gid: self
                .gid
                .parse()
                .map_err(|_| format!("the peer sent a bad GID `{}`", self.gid))?,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Test {
    WriteLat,
    SendLat,
    WriteBw,
    /// B only holds a connected QP and its region (READ and atomic latency, WRITE and READ
    /// message rates) until A says `check`; `size` is the region's length.
    Passive,
    /// B receives `rounds` SENDs (message rate), reposting its receives.
    SendRate,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub(crate) enum Msg {
    /// The first message each way; `spins`: the sender's waits busy-wait (else they yield
    /// the CPU on every look).
    Hello {
        pid: u32,
        #[serde(default)]
        spins: bool,
    },
    /// A → B: play the cache-line ping-pong for `rounds` round trips, from value `base`.
    CacheLine { rounds: u64, base: u64 },
    /// A → B: set up for `test` (`rounds` round trips, or a `size`-byte target) and connect
    /// to A's endpoint.
    Rdma {
        test: Test,
        rounds: u64,
        size: u64,
        ep: WireEp,
    },
    /// B → A: B's endpoint; B is connected and its receives are posted.
    Endpoint { ep: WireEp },
    /// B → A: ready to start (cache line).
    Ready,
    /// A → B: the bandwidth writes are done: check your buffer (or, after passive tests:
    /// they are over).
    Check,
    /// A → B: consume `messages` descriptors of the raw shared-memory ring of run `run`.
    RawRing { messages: u64, run: usize },
    /// A → B: make `ep.qps` QPs for `per_qp` round-robin WRITEs each and connect them to
    /// A's (whose numbers follow in `qpns` messages); answered by `fan_endpoint`.
    Fan {
        ep: crate::perf_fan::FanEp,
        per_qp: u64,
    },
    /// B → A: B's fan is connected; its QP numbers follow in `qpns` messages.
    FanEndpoint { ep: crate::perf_fan::FanEp },
    /// Either way: the next QP numbers of a fan.
    Qpns { qpns: Vec<u32> },
    /// B → A: the test is over on this side.
    Done,
    /// A → B: exit.
    Quit,
    /// A → B (`perf --net`): bind a UDP socket and echo `rounds` datagrams.
    UdpPing { rounds: u64 },
    /// A → B (`perf --net`): bind a UDP socket and count what arrives until `udp_end`.
    UdpSink,
    /// B → A: the UDP socket is bound to this port and waits.
    UdpReady { port: u16 },
    /// A → B: the stream is over; `sent` bytes were sent.
    UdpEnd { sent: u64 },
    /// B → A: what arrived: bytes, datagrams, and the time from the first to the last.
    UdpCounted {
        bytes: u64,
        datagrams: u64,
        nanos: u64,
    },
    /// Either way: "I stop because of this".
    Error { error: String },
}

pub(crate) fn send(link: &mut TcpLink, msg: &Msg) -> Result<()> {
    link.send(serde_json::to_string(msg)?)
}

pub(crate) fn recv(link: &mut TcpLink) -> Result<Msg> {
    let text = link.recv()?;
    match serde_json::from_str(&text) {
        Ok(Msg::Error { error }) => Err(PeerError(error).into()),
        Ok(m) => Ok(m),
        Err(e) => Err(format!("bad message from the peer process ({e}): {text}").into()),
    }
}

/// Receives the message `want` names, or fails.
pub(crate) fn expect(
    link: &mut TcpLink,
    want: &str,
    pick: impl FnOnce(Msg) -> Option<Msg>,
) -> Result<Msg> {
    let got = recv(link)?;
    let shown = format!("{got:?}");
    pick(got).ok_or_else(|| format!("expected `{want}` from the peer process, got {shown}").into())
}

// ---------------------------------------------------------------------------------------------
// Waiting: spins that yield when slow, and give up.

/// What every wait checks: the peer's failure (set by the link watcher) and, through the
/// heartbeat, the watchdog.
pub(crate) struct Guard {
    pub(crate) abort: AtomicBool,
    beats: AtomicU64,
    pure_spins: u32,
}

impl Guard {
    /// A guard for a process that may run on any of its CPUs: waits spin when there are
    /// several (the peer runs meanwhile elsewhere), and yield at once on one.
    pub(crate) fn new() -> Guard {
        Guard::spinning(cpus() > 1)
    }

    /// A guard whose waits spin (`spin`: the peer has a CPU of its own, as when the two
    /// processes are pinned to two CPUs) or yield at once (the peer needs this CPU). The
    /// choice is made before pinning: a pinned process sees one CPU, and a guard that yielded
    /// on every look made each wait a system call (it doubled `perf`'s WRITE latency).
    pub(crate) fn spinning(spin: bool) -> Guard {
        Guard {
            abort: AtomicBool::new(false),
            beats: AtomicU64::new(0),
            pure_spins: if spin { PURE_SPINS } else { PURE_SPINS_ONE_CPU },
        }
    }

    /// Whether the waits busy-wait (see [`spinning`](Self::spinning)).
    pub(crate) fn spins(&self) -> bool {
        self.pure_spins >= PURE_SPINS
    }

    pub(crate) fn beat(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    /// Waits until `done` holds: the [`crate::perf_rate::Wait`] the loops outside this
    /// module are given.
    pub(crate) fn until(&self, what: &dyn Fn() -> String, done: &dyn Fn() -> bool) -> Result<()> {
        self.spin(what, |_| Ok(done().then_some(())))
    }

    /// Calls `attempt(slow)` until it yields a value. The first spins are tight; after that
    /// the wait yields the CPU now and then (the peer may share this CPU), `slow` is true
    /// every few hundred calls (for costlier checks, such as polling for error completions),
    /// and after SPIN_TIMEOUT, or when the peer has failed, the wait is an error.
    #[inline]
    pub(crate) fn spin<T>(
        &self,
        what: &dyn Fn() -> String,
        mut attempt: impl FnMut(bool) -> Result<Option<T>>,
    ) -> Result<T> {
        for _ in 0..self.pure_spins {
            if let Some(v) = attempt(false)? {
                return Ok(v);
            }
            std::hint::spin_loop();
        }
        let start = Instant::now();
        let mut n = 0u32;
        loop {
            n = n.wrapping_add(1);
            let slow = n % CHECK_EVERY == 0;
            if let Some(v) = attempt(slow)? {
                return Ok(v);
            }
            if n % 16 == 0 || self.pure_spins < PURE_SPINS {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            if slow {
                self.beat();
                if self.abort.load(Ordering::Relaxed) {
                    return Err(PeerFailed.into());
                }
                if start.elapsed() > SPIN_TIMEOUT {
                    return Err(
                        format!("{}: nothing for {} s", what(), SPIN_TIMEOUT.as_secs()).into(),
                    );
                }
            }
        }
    }
}

/// Ends the run if this process makes no progress (heartbeats) for STALL_LIMIT: kills the
/// peer process and exits with status 1. It guards against a call that never returns, which
/// no time limit of ours could interrupt.
pub(crate) struct Watchdog {
    stop: Arc<AtomicBool>,
    phase: Arc<std::sync::Mutex<String>>,
}

impl Watchdog {
    /// Starts watching; `peer_pid` (if not 0) is killed when the run is stopped.
    pub(crate) fn start(guard: Arc<Guard>, peer_pid: u32) -> Watchdog {
        let stop = Arc::new(AtomicBool::new(false));
        let phase = Arc::new(std::sync::Mutex::new(String::from("starting")));
        let (stop2, phase2) = (stop.clone(), phase.clone());
        let body = move || {
            let mut last = guard.beats.load(Ordering::Relaxed);
            let mut since = Instant::now();
            while !stop2.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let now = guard.beats.load(Ordering::Relaxed);
                if now != last {
                    (last, since) = (now, Instant::now());
                } else if since.elapsed() > STALL_LIMIT {
                    let phase = phase2.lock().map(|p| p.clone()).unwrap_or_default();
                    if let Some(pid) = rustix::process::Pid::from_raw(peer_pid as i32) {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    }
                    eprintln!(
                        "softverbs: perf: {phase}: no progress for {} s; stopped (and killed \
                         the peer process {peer_pid})",
                        STALL_LIMIT.as_secs()
                    );
                    std::process::exit(1);
                }
            }
        };
        // Without a watchdog the other time limits still hold; only a stuck call is unguarded.
        let _ = std::thread::Builder::new()
            .name("perf-watchdog".into())
            .spawn(body);
        Watchdog { stop, phase }
    }

    pub(crate) fn current_phase(&self) -> String {
        self.phase.lock().map(|p| p.clone()).unwrap_or_default()
    }

    pub(crate) fn phase(&self, guard: &Guard, phase: &str) {
        guard.beat();
        if let Ok(mut p) = self.phase.lock() {
            phase.clone_into(&mut p);
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------------------------
// The cache-line baseline: one shared page, one counter bounced between two processes.

/// Bytes of the shared file: the cache-line page, then the raw ring's words.
fn shared_len() -> usize {
    rustix::param::page_size() + crate::perf_rate::RAW_RING_RUNS * ring_area()
}

/// Bytes of each run's raw ring: whole pages, so that each run's ring lies in pages of its own.
fn ring_area() -> usize {
    (crate::perf_rate::RING_WORDS * 8).next_multiple_of(rustix::param::page_size())
}

/// A shared mapping of a file (a memfd) that both processes map: the cache-line baseline's
/// page, and after it the raw ring's memory for each of its runs.
struct SharedPage {
    ptr: NonNull<u8>,
    len: usize,
}

impl SharedPage {
    /// Maps `file`, which must be [`shared_len`] bytes at least.
    fn map(file: &std::fs::File) -> Result<SharedPage> {
        let len = shared_len();
        let size = file.metadata()?.len();
        if size < len as u64 {
            return Err(format!("the shared file is {size} bytes, expected {len}").into());
        }
        // SAFETY: a new shared mapping at an address the kernel picks, so it aliases no Rust
        // object; the file is at least `len` bytes (checked above), so no access faults.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                file,
                0,
            )
        }
        .map_err(|e| format!("mapping the shared page: {e}"))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or("mmap returned null")?;
        Ok(SharedPage { ptr, len })
    }

    /// The counter, alone in the page's first cache line.
    fn ball(&self) -> &AtomicU64 {
        // SAFETY: the mapping is page-aligned (so 8-aligned), at least 8 bytes, and lives as
        // long as `&self`; every access to it, in either process, is atomic, and all-zero
        // (a fresh memfd) is a valid `AtomicU64`.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().cast::<u64>()) }
    }

    /// The raw ring's words for run `run` (clamped to the last), after the first page.
    fn ring_words(&self, run: usize) -> &[AtomicU64] {
        let run = run.min(crate::perf_rate::RAW_RING_RUNS - 1);
        let at = rustix::param::page_size() + run * ring_area();
        // SAFETY: the words lie inside the mapping (`shared_len` holds the page and one
        // `ring_area` of at least RING_WORDS words per run; `run` is clamped), start
        // page-aligned, live as long as `&self`, and are only ever accessed atomically, in
        // either process; all-zero is a valid `AtomicU64`.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.as_ptr().add(at).cast::<AtomicU64>(),
                crate::perf_rate::RING_WORDS,
            )
        }
    }
}

impl Drop for SharedPage {
    fn drop(&mut self) {
        // SAFETY: exactly the range `map` mapped; no reference from `ball` outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A memfd of one page, to be inherited by the peer process.
fn create_shared_page() -> Result<std::fs::File> {
    let fd = rustix::fs::memfd_create("softverbs-perf", rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(|e| format!("memfd_create: {e}"))?;
    rustix::fs::ftruncate(&fd, shared_len() as u64)
        .map_err(|e| format!("sizing the shared page: {e}"))?;
    Ok(std::fs::File::from(fd))
}

/// A side's part of the cache-line ping-pong: A (`serve == false`) stores odd values and
/// waits for the next even one; B stores the even ones. Returns A's samples: the time of a
/// round trip, averaged over each batch of CACHELINE_BATCH, in ns.
fn cacheline(
    ball: &AtomicU64,
    base: u64,
    rounds: u64,
    warmup: u64,
    serve: bool,
    guard: &Guard,
) -> Result<Vec<f64>> {
    let what = || "cache-line ping-pong: the peer process stopped answering".to_string();
    let mut samples = Vec::with_capacity((rounds / CACHELINE_BATCH) as usize + 1);
    let mut t0 = Instant::now();
    for k in 0..warmup + rounds {
        let (ping, pong) = (base + 2 * k + 1, base + 2 * k + 2);
        if serve {
            guard.spin(&what, |_| {
                Ok((ball.load(Ordering::Acquire) == ping).then_some(()))
            })?;
            ball.store(pong, Ordering::Release);
            continue;
        }
        let m = k.wrapping_sub(warmup);
        if k >= warmup && m % CACHELINE_BATCH == 0 {
            let now = Instant::now();
            if m > 0 {
                samples.push(ns(now - t0) / CACHELINE_BATCH as f64);
            }
            t0 = now;
            guard.beat();
        }
        ball.store(ping, Ordering::Release);
        guard.spin(&what, |_| {
            Ok((ball.load(Ordering::Acquire) == pong).then_some(()))
        })?;
    }
    if !serve {
        let tail = rounds % CACHELINE_BATCH;
        let last = if tail == 0 { CACHELINE_BATCH } else { tail };
        samples.push(ns(t0.elapsed()) / last as f64);
    }
    Ok(samples)
}

pub(crate) fn ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

// ---------------------------------------------------------------------------------------------
// The memcpy baseline.

/// Single-thread copy bandwidth of `size`-byte buffers, in 10^9 bytes/s, and the way of
/// copying that gave it: the best of MEMCPY_TRIALS runs that copy `total` bytes between them,
/// for each of the C library's `memcpy` and a plain loop of 64-byte moves (the best, because
/// what a copy can do is the question: other processes on the machine only ever slow it
/// down, and on some CPUs and VMs the library's `rep movsb` path runs at a tenth of what
/// plain vector moves do).
fn memcpy_gb_s(size: usize, total: u64, guard: &Guard) -> (f64, &'static str) {
    let src: Vec<u8> = (0..size).map(|j| pattern_byte(j, size)).collect();
    let mut dst = vec![0u8; size];
    let reps = (total / size as u64 / MEMCPY_TRIALS / 2).max(1);
    dst.copy_from_slice(&src); // fault the pages in
    type Copy = fn(&mut [u8], &[u8]);
    let ways: [(&'static str, Copy); 2] = [
        ("memcpy", |d, s| d.copy_from_slice(s)),
        ("64-byte moves", copy_in_blocks),
    ];
    let mut best = (0.0f64, ways[0].0);
    for _ in 0..MEMCPY_TRIALS {
        for (name, copy) in ways {
            let t0 = Instant::now();
            for r in 0..reps {
                copy(&mut dst, std::hint::black_box(&src));
                std::hint::black_box(&mut dst);
                if r % 256 == 0 {
                    guard.beat();
                }
            }
            let gb_s = (reps * size as u64) as f64 / t0.elapsed().as_secs_f64().max(1e-9) / 1e9;
            if gb_s > best.0 {
                best = (gb_s, name);
            }
        }
    }
    best
}

/// Copies `src` into `dst` (the same length) 64 bytes at a time: fixed-size moves the
/// compiler turns into vector loads and stores, never a call into the C library.
fn copy_in_blocks(dst: &mut [u8], src: &[u8]) {
    let mut d = dst.chunks_exact_mut(64);
    let mut s = src.chunks_exact(64);
    for (d, s) in (&mut d).zip(&mut s) {
        let s: &[u8; 64] = s.try_into().expect("64-byte chunk");
        let d: &mut [u8; 64] = d.try_into().expect("64-byte chunk");
        *d = *s;
    }
    d.into_remainder().copy_from_slice(s.remainder());
}

/// The bytes of a bandwidth test's message.
fn pattern_byte(j: usize, size: usize) -> u8 {
    ((j as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ (size.trailing_zeros() as u8)
}

// ---------------------------------------------------------------------------------------------
// RDMA: one side's verbs objects.

/// How a QP addresses its peer across an IP network (`perf --net`): the GRH's source GID
/// index and the GID the peer is to address (this side's RoCEv2 GID of its IPv4 address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    pub(crate) sgid_index: u8,
    pub(crate) gid: Gid,
}

/// True if the writer of `perf --net`'s bandwidth test sleeps on a completion channel: the
/// engines move the bytes there, and on a small machine a writer spinning on its CQ takes
/// their CPU (64 KiB on 2 cores: 0.18 GB/s spinning, 0.34 sleeping).
pub(crate) fn net_writer_sleeps() -> bool {
    cpus() <= 4
}

/// How a side waits for its completions.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Waits {
    /// Busy-polls the CQ, as perftest does.
    Spin,
    /// Sleeps on a completion channel, as `ib_write_bw -e` does.
    Sleep,
}

/// What a side's peer may do to its QP and region: write, read and atomics.
const REMOTE_ACCESS: AccessFlags = AccessFlags::REMOTE_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// One side of an RDMA test: an RC QP with its own send and receive CQs, and one memory
/// region that peers may write, read and update atomically.
pub(crate) struct Side {
    // Dropped in this order: QP, memory, CQs, PD, context.
    pub(crate) qp: QueuePair,
    pub(crate) mr: MemoryRegion<'static>,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    _pd: ProtectionDomain,
    _ctx: Context,
    psn: u32,
    /// Signaled sends posted and not yet polled.
    signaled: u64,
    /// The GRH route (`perf --net`); `None`: GID 0 and the library's address vector.
    route: Option<Route>,
    /// The send CQ's channel when waits sleep on it rather than spin (see [`Side::waiting`]).
    channel: Option<CompletionChannel>,
}

impl Side {
    fn new(device: &Device, mr_len: usize, sq: u32, rq: u32) -> Result<Side> {
        Side::with_waits(device, mr_len, sq, rq, Waits::Spin)
    }

    fn with_waits(device: &Device, mr_len: usize, sq: u32, rq: u32, waits: Waits) -> Result<Side> {
        let ctx = device.open()?;
        let pd = ctx.alloc_pd()?;
        let channel = match waits {
            Waits::Spin => None,
            Waits::Sleep => Some(ctx.create_comp_channel()?),
        };
        let send_cq = ctx.create_cq(sq, channel.as_ref())?;
        let recv_cq = ctx.create_cq(rq.max(1), None)?;
        let qp = pd.create_qp(&QpInitAttr {
            cap: QpCap {
                max_send_wr: sq,
                max_recv_wr: rq.max(1),
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            ..QpInitAttr::new(QpType::Rc, &send_cq, &recv_cq)
        })?;
        let access = AccessFlags::LOCAL_WRITE | REMOTE_ACCESS;
        let mr = pd
            .alloc_mr(mr_len, access)
            .map_err(|e| format!("registering {mr_len} bytes: {e}"))?;
        // A random 24-bit starting PSN, as perftest picks one.
        let psn = (std::collections::hash_map::RandomState::new().hash_one(qp.qp_num()) & 0xff_ffff)
            as u32;
        Ok(Side {
            qp,
            mr,
            send_cq,
            recv_cq,
            _pd: pd,
            _ctx: ctx,
            psn,
            signaled: 0,
            route: None,
            channel,
        })
    }

    /// Polls the send CQ; with a channel and nothing there, sleeps until the CQ reports (or
    /// a few milliseconds pass, so the caller's watchdog keeps running) and returns 0.
    fn poll_or_sleep(&self, wcs: &mut [WorkCompletion]) -> Result<usize> {
        let k = self.send_cq.poll(wcs);
        let Some(ch) = self.channel.as_ref().filter(|_| k == 0) else {
            return Ok(k);
        };
        self.send_cq.req_notify(false)?;
        // A completion between the empty poll and the request raised no event: look again.
        let k = self.send_cq.poll(wcs);
        if k > 0 {
            return Ok(k);
        }
        let mut fds = [rustix::event::PollFd::new(ch, rustix::event::PollFlags::IN)];
        let ts = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 5_000_000,
        };
        let _ = rustix::event::poll(&mut fds, Some(&ts));
        if ch.try_get_cq_event().is_ok() {
            self.send_cq.ack_events(1);
        }
        Ok(0)
    }

    fn with_route(mut self, route: Option<Route>) -> Side {
        self.route = route;
        self
    }

    fn endpoint(&self) -> Result<WireEp> {
        let ep = self.qp.endpoint(self.psn)?;
        Ok(WireEp {
            qpn: ep.qpn,
            psn: ep.psn,
            lid: ep.lid,
            gid: self.route.map_or(ep.gid, |r| r.gid).to_string(),
            addr: self.mr.iova(),
            rkey: self.mr.rkey(),
        })
    }

    fn connect(&self, remote: &WireEp) -> Result<()> {
        let Some(route) = self.route else {
            return self
                .qp
                .connect(&remote.endpoint()?, self.psn, REMOTE_ACCESS)
                .map_err(|e| format!("connecting the QP: {e}").into());
        };
        // As `QueuePair::connect`, but the GRH names this side's GID of the route (the
        // library's own address vector always uses GID index 0, the link-local one on a
        // networked device).
        let remote = remote.endpoint()?;
        let port = self.qp_port()?;
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: port.active_mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            ah_attr: AhAttr {
                dlid: remote.lid,
                port_num: 1,
                grh: Some(GlobalRoute {
                    dgid: remote.gid,
                    sgid_index: route.sgid_index,
                    hop_limit: 1,
                    ..GlobalRoute::default()
                }),
                ..AhAttr::default()
            },
            max_dest_rd_atomic: 16.min(self._ctx.query_device().max_qp_rd_atom as u8),
            min_rnr_timer: 12,
            ..QpAttr::default()
        };
        let mask = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER;
        self.qp
            .to_init(REMOTE_ACCESS)
            .and_then(|()| self.qp.modify(&rtr, mask))
            .and_then(|()| self.qp.to_rts(self.psn))
            .map_err(|e| format!("connecting the QP (GID index {}): {e}", route.sgid_index).into())
    }

    fn qp_port(&self) -> Result<PortAttr> {
        Ok(self._ctx.query_port(1)?)
    }

    /// Polls the send CQ: counts signaled completions, and turns error completions (which
    /// unsignaled requests produce too) into errors.
    fn reap(&mut self, what: &str) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 8];
        loop {
            let n = self.send_cq.poll(&mut wcs);
            for wc in &wcs[..n] {
                check_wc(wc, what)?;
                self.signaled = self.signaled.saturating_sub(1);
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Waits until every signaled send has completed.
    fn drain(&mut self, guard: &Guard, what: &str) -> Result<()> {
        let wait = || format!("{what}: waiting for send completions");
        while self.signaled > 0 {
            let before = self.signaled;
            guard.spin(&wait, |_| {
                self.reap(what)?;
                Ok((self.signaled < before).then_some(()))
            })?;
        }
        Ok(())
    }

    /// Posts one latency-test message (`op`) of LAT_SIZE bytes from offset 0; every
    /// SIGNAL_EVERY-th (and the `last`) is signaled, after the previous signaled one is
    /// polled, so the send queue never fills.
    fn post_lat(
        &mut self,
        round: u64,
        op: SendOp,
        last: bool,
        guard: &Guard,
        what: &str,
    ) -> Result<()> {
        let signaled = last || (round + 1) % SIGNAL_EVERY == 0;
        if signaled {
            self.drain(guard, what)?;
        }
        self.post_one(round, op, LAT_SIZE, signaled)
            .map_err(|e| format!("{what}: posting round {round}: {e}"))?;
        if signaled {
            self.signaled += 1;
        }
        Ok(())
    }

    /// Posts one request of `op` with the first `len` bytes of the region as its data.
    fn post_one(
        &self,
        wr_id: u64,
        op: SendOp,
        len: usize,
        signaled: bool,
    ) -> std::result::Result<(), softverbs::PostError> {
        let sge = [self.mr.sge(0..len)];
        let flags = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        };
        self.qp
            .post_send([SendWr::new(wr_id, op, &sge).flags(flags)])
    }
}

fn check_wc(wc: &WorkCompletion, what: &str) -> Result<()> {
    if wc.is_ok() {
        return Ok(());
    }
    Err(format!(
        "{what}: work request {} completed with {:?} (vendor_err {})",
        wc.wr_id(),
        wc.status(),
        wc.vendor_err()
    )
    .into())
}

/// Writes the header of a latency message: the round, then the direction.
fn put_header(mr: &MemoryRegion<'_>, at: usize, round: u64, dir: u8) -> Result<()> {
    let mut h = [0u8; 9];
    h[..8].copy_from_slice(&round.to_le_bytes());
    h[8] = dir;
    mr.write_at(at, &h)?;
    Ok(())
}

/// Checks the header of a received latency message.
fn check_header(mr: &MemoryRegion<'_>, at: usize, round: u64, dir: u8, what: &str) -> Result<()> {
    let mut h = [0u8; 9];
    mr.read_at(at, &mut h)?;
    let got = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
    if (got, h[8]) == (round, dir) {
        return Ok(());
    }
    let name = |d: u8| match d {
        PING => "ping",
        PONG => "pong",
        _ => "garbage",
    };
    let mut msg = format!(
        "{what}, round {round}: received {} {got}, expected {} {round}",
        name(h[8]),
        name(dir)
    );
    if h[8] == dir ^ PING ^ PONG {
        msg.push_str(
            " (this process's own message came back: the NIC delivered it to a QP of this \
             process, not the peer's)",
        );
    }
    Err(msg.into())
}

/// The non-zero byte that marks round `round` in the last byte of a latency message.
fn tag(round: u64) -> u8 {
    (round % 255) as u8 + 1
}

/// Offset of the incoming half of a write-latency region.
const IN: usize = LAT_SIZE;

/// One side of the RDMA WRITE latency ping-pong: A (`serve == false`) writes first and
/// records the round trips (ns); B answers.
fn write_lat(
    side: &mut Side,
    peer: &WireEp,
    plan: &Plan,
    serve: bool,
    guard: &Guard,
) -> Result<Vec<f64>> {
    const WHAT: &str = "RDMA WRITE latency";
    let total = plan.warmup + plan.iters;
    let op = SendOp::RdmaWrite {
        remote_addr: peer.addr + IN as u64,
        rkey: peer.rkey,
    };
    let (mine, theirs) = if serve { (PONG, PING) } else { (PING, PONG) };
    let mut clock = RoundClock::new(plan);
    for r in 0..total {
        let last = r + 1 == total;
        if serve {
            wait_write(side, r, theirs, guard, WHAT)?;
        }
        put_header(&side.mr, 0, r, mine)?;
        side.mr.write_at(LAT_SIZE - 1, &[tag(r)])?;
        side.post_lat(r, op, last, guard, WHAT)?;
        if !serve {
            clock.posted(r, guard);
            wait_write(side, r, theirs, guard, WHAT)?;
        }
    }
    side.drain(guard, WHAT)?;
    Ok(clock.round_trips())
}

/// A's round trips in a latency ping-pong, stamped right after each post: the clock read
/// (49 ns on this VM, where a cache-line hop is 100) then overlaps the wait for the answer
/// instead of delaying the next post, as it did stamped before the post. Stamp to stamp is
/// still one whole round: the wait, the answer's checks, the next post.
struct RoundClock {
    warmup: u64,
    stamps: Vec<Instant>,
}

impl RoundClock {
    fn new(plan: &Plan) -> RoundClock {
        RoundClock {
            warmup: plan.warmup,
            stamps: Vec::with_capacity(plan.iters as usize + 1),
        }
    }

    /// Round `r` was posted: the last warm-up round starts the first measured one.
    fn posted(&mut self, r: u64, guard: &Guard) {
        if r + 1 >= self.warmup {
            self.stamps.push(Instant::now());
            guard.beat();
        }
    }

    /// Each round trip, ns.
    fn round_trips(self) -> Vec<f64> {
        self.stamps.windows(2).map(|w| ns(w[1] - w[0])).collect()
    }
}

/// Spins on the last byte of the incoming buffer until round `r` has landed whole, then
/// checks its header.
fn wait_write(side: &mut Side, r: u64, dir: u8, guard: &Guard, what: &str) -> Result<()> {
    let want = tag(r);
    let last = IN + LAT_SIZE - 1;
    let wait = || format!("{what}, round {r}: no RDMA WRITE from the peer process");
    guard.spin(&wait, |slow| {
        if side.mr.load_u8(last)? == want {
            return Ok(Some(()));
        }
        if slow {
            // Our own writes fail with error completions, signaled or not.
            side.reap(what)?;
        }
        Ok(None)
    })?;
    check_header(&side.mr, IN, r, dir, what)
}

/// Posts the receive of slot `slot` (each LAT_SIZE bytes, after the send buffer).
fn post_slot(side: &Side, slot: usize) -> Result<()> {
    let at = LAT_SIZE * (1 + slot);
    side.qp
        .post_recv([RecvWr::new(slot as u64, &[side.mr.sge(at..at + LAT_SIZE)])])
        .map_err(|e| format!("posting a receive: {e}"))?;
    Ok(())
}

/// One side of the SEND latency ping-pong: A sends first and records round trips (ns).
fn send_lat(side: &mut Side, plan: &Plan, serve: bool, guard: &Guard) -> Result<Vec<f64>> {
    const WHAT: &str = "SEND latency";
    let total = plan.warmup + plan.iters;
    let (mine, theirs) = if serve { (PONG, PING) } else { (PING, PONG) };
    let mut clock = RoundClock::new(plan);
    // As perftest's `ib_send_lat`, each side posts a receive, then answers: the receive is
    // on the round trip, as it is there. It posts the buffer of the message before (checked
    // already: RX_DEPTH buffers are posted ahead, so the next message lands in another one),
    // and checks the message just received after answering, off the round trip; every
    // message is still checked.
    let mut received: Option<(u64, WorkCompletion)> = None;
    let mut checked: Option<usize> = None;
    for r in 0..total {
        let last = r + 1 == total;
        if serve {
            received = Some((r, wait_send(side, r, guard, WHAT)?));
        }
        if let Some(slot) = checked.take() {
            post_slot(side, slot)?;
        }
        put_header(&side.mr, 0, r, mine)?;
        side.post_lat(r, SendOp::Send, last, guard, WHAT)?;
        if !serve {
            clock.posted(r, guard);
        }
        if let Some((round, wc)) = received.take() {
            checked = Some(check_send(side, &wc, round, theirs, WHAT)?);
        }
        if !serve {
            received = Some((r, wait_send(side, r, guard, WHAT)?));
        }
    }
    if let Some((round, wc)) = received.take() {
        check_send(side, &wc, round, theirs, WHAT)?;
    }
    side.drain(guard, WHAT)?;
    Ok(clock.round_trips())
}

/// Polls the receive CQ for message `r`.
fn wait_send(side: &mut Side, r: u64, guard: &Guard, what: &str) -> Result<WorkCompletion> {
    let wait = || format!("{what}, round {r}: no SEND from the peer process");
    let mut wc = [WorkCompletion::default()];
    guard.spin(&wait, |slow| {
        if side.recv_cq.poll(&mut wc) == 1 {
            return Ok(Some(wc[0]));
        }
        if slow {
            side.reap(what)?;
        }
        Ok(None)
    })
}

/// Checks received message `r` (its completion `wc`, its header); the receive slot it used.
fn check_send(side: &Side, wc: &WorkCompletion, r: u64, dir: u8, what: &str) -> Result<usize> {
    check_wc(wc, what)?;
    if wc.byte_len() as usize != LAT_SIZE {
        return Err(format!(
            "{what}, round {r}: received {} bytes, expected {LAT_SIZE}",
            wc.byte_len()
        )
        .into());
    }
    let slot = usize::try_from(wc.wr_id())
        .ok()
        .filter(|&s| s < RX_DEPTH)
        .ok_or_else(|| {
            format!(
                "{what}: receive completion with unknown wr_id {}",
                wc.wr_id()
            )
        })?;
    check_header(&side.mr, LAT_SIZE * (1 + slot), r, dir, what)?;
    Ok(slot)
}

/// A's RDMA WRITE bandwidth run: `size`-byte writes into the peer's buffer for `total`
/// bytes (or BW_TIME_CAP); returns (bytes, writes, seconds).
fn write_bw(
    side: &mut Side,
    peer: &WireEp,
    size: usize,
    total: u64,
    guard: &Guard,
) -> Result<(u64, u64, f64)> {
    const WHAT: &str = "RDMA WRITE bandwidth";
    let fill: Vec<u8> = (0..size).map(|j| pattern_byte(j, size)).collect();
    side.mr.write_at(0, &fill)?;
    let sge = [side.mr.sge(0..size)];
    let op = SendOp::RdmaWrite {
        remote_addr: peer.addr,
        rkey: peer.rkey,
    };
    let mut count = (total / size as u64).max(1);
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wcs = [WorkCompletion::default(); 16];
    let t0 = Instant::now();
    while done < count {
        let room = TX_DEPTH - (posted - done);
        let n = room.min(count - posted);
        if n > 0 {
            let wrs = (posted..posted + n).map(|i| {
                let signaled = (i + 1) % CQ_MOD == 0 || i + 1 == count;
                let flags = if signaled {
                    SendFlags::SIGNALED
                } else {
                    SendFlags::empty()
                };
                SendWr::new(i, op, &sge).flags(flags)
            });
            side.qp
                .post_send(wrs)
                .map_err(|e| format!("{WHAT}: posting writes {posted}..{}: {e}", posted + n))?;
            posted += n;
            guard.beat();
        }
        let wait = || format!("{WHAT}: no completion after {done} of {count} writes");
        let got = guard.spin(&wait, |_| {
            let k = side.poll_or_sleep(&mut wcs)?;
            Ok((k > 0).then_some(k))
        })?;
        for wc in &wcs[..got] {
            check_wc(wc, WHAT)?;
            done = done.max(wc.wr_id() + 1);
        }
        // Stop early when slow, after a signaled write (so the last one posted is signaled).
        if posted % CQ_MOD == 0 && posted < count && t0.elapsed() > BW_TIME_CAP {
            count = posted;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok((count * size as u64, count, secs))
}

/// B's check after the bandwidth run: its buffer holds A's pattern.
fn check_bw_target(side: &Side, size: usize) -> Result<()> {
    let got = side.mr.to_vec();
    match (0..size).find(|&j| got[j] != pattern_byte(j, size)) {
        None => Ok(()),
        Some(j) => Err(format!(
            "RDMA WRITE bandwidth ({size} B): byte {j} of the target is {:#04x}, expected {:#04x}",
            got[j],
            pattern_byte(j, size)
        )
        .into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Results.

/// Half-round-trip latency statistics, in ns.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Latency {
    pub(crate) p50_ns: f64,
    pub(crate) p99_ns: f64,
    pub(crate) mean_ns: f64,
    pub(crate) round_trips: u64,
}

impl Latency {
    /// From round-trip samples in ns: the latency is half a round trip.
    pub(crate) fn from_rtts(rtts: Vec<f64>, round_trips: u64) -> Latency {
        Latency::from_samples(rtts, round_trips, 2.0)
    }

    /// From samples of whole operations in ns (a READ or an atomic: request and response),
    /// which perftest's `ib_read_lat` and `ib_atomic_lat` report as they are.
    pub(crate) fn from_ops(ops: Vec<f64>, round_trips: u64) -> Latency {
        Latency::from_samples(ops, round_trips, 1.0)
    }

    fn from_samples(mut rtts: Vec<f64>, round_trips: u64, per: f64) -> Latency {
        rtts.sort_by(f64::total_cmp);
        let q = |p: f64| {
            if rtts.is_empty() {
                return 0.0;
            }
            let i = ((rtts.len() as f64 * p).ceil() as usize).clamp(1, rtts.len()) - 1;
            rtts[i] / per
        };
        let mean = rtts.iter().sum::<f64>() / rtts.len().max(1) as f64 / per;
        Latency {
            p50_ns: q(0.50),
            p99_ns: q(0.99),
            mean_ns: mean,
            round_trips,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct LatencyFigure {
    pub(crate) size: usize,
    #[serde(flatten)]
    pub(crate) latency: Latency,
    /// The cache-line ping-pong's p50.
    pub(crate) baseline_ns: f64,
    /// p50 / baseline.
    pub(crate) ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct BandwidthFigure {
    pub(crate) size: usize,
    /// 10^9 bytes per second.
    pub(crate) gb_s: f64,
    pub(crate) bytes: u64,
    pub(crate) writes: u64,
    pub(crate) seconds: f64,
    /// memcpy of the same size.
    pub(crate) baseline_gb_s: f64,
    /// gb_s / baseline.
    pub(crate) ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
struct MemcpyFigure {
    size: usize,
    gb_s: f64,
    bytes: u64,
    /// The way of copying that was fastest ("memcpy" or "64-byte moves").
    way: &'static str,
}

#[derive(Debug, Default, Serialize)]
struct Baselines {
    /// Two processes bouncing a counter through one cache line of shared memory (half round
    /// trips; each sample is the mean of 64 round trips).
    cacheline_pingpong: Option<Latency>,
    /// One thread copying a buffer of `size` bytes (the best of 5 runs of each way).
    memcpy: Vec<MemcpyFigure>,
}

/// Everything `perf` measured, as `--json` prints it.
#[derive(Debug, Default, Serialize)]
struct Report {
    device: String,
    quick: bool,
    /// CPUs of the machine this process may use.
    cpus: usize,
    /// The CPUs the two processes were pinned to (this one first).
    cpu_pair: [usize; 2],
    /// The CPUs this process may use (one QP per CPU in the message rates).
    cpus_allowed: Vec<usize>,
    cpu_model: String,
    /// Both processes' ids (this one first).
    pids: [u32; 2],
    /// How each process waits (this one first): "spin" when the two have a CPU each,
    /// "yield" when they share one.
    waits: [&'static str; 2],
    ok: bool,
    /// Why the run stopped early (with `ok: false`).
    error: Option<String>,
    baselines: Baselines,
    rdma_write_latency: Option<LatencyFigure>,
    send_latency: Option<LatencyFigure>,
    /// A whole READ of 64 B, post to completion (as `ib_read_lat` reports it).
    read_latency: Option<LatencyFigure>,
    /// A whole fetch-and-add, post to completion (as `ib_atomic_lat` reports it).
    fetch_add_latency: Option<LatencyFigure>,
    rdma_write_bandwidth: Vec<BandwidthFigure>,
    message_rates: Option<crate::perf_rate::Rates>,
}

fn wait_mode(spins: bool) -> &'static str {
    if spins { "spin" } else { "yield" }
}

pub(crate) fn size_text(size: usize) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

impl Report {
    fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "perf: {}, two processes on one host (pids {} and {} on CPUs {} and {} of {}; {}); \
             latency = half a round trip (p50)",
            self.device,
            self.pids[0],
            self.pids[1],
            self.cpu_pair[0],
            self.cpu_pair[1],
            self.cpus,
            self.cpu_model
        );
        let cl = self.baselines.cacheline_pingpong.as_ref();
        // WRITE and SEND are ping-pongs (half a round trip); READ and atomics are timed whole.
        for (name, fig, how, unit) in [
            ("RDMA WRITE", &self.rdma_write_latency, "", "round trips"),
            ("SEND", &self.send_latency, "", "round trips"),
            (
                "RDMA READ",
                &self.read_latency,
                " post to completion",
                "operations",
            ),
            (
                "fetch-and-add",
                &self.fetch_add_latency,
                " post to completion",
                "operations",
            ),
        ] {
            if let Some(f) = fig {
                let _ = writeln!(
                    t,
                    "  {name} {} latency: {:.0} ns{how} (cache-line ping-pong {:.0} ns, {:.1}x); \
                     p99 {:.0} ns, mean {:.0} ns, {} {unit}",
                    size_text(f.size),
                    f.latency.p50_ns,
                    f.baseline_ns,
                    f.ratio,
                    f.latency.p99_ns,
                    f.latency.mean_ns,
                    f.latency.round_trips
                );
            }
        }
        for f in &self.rdma_write_bandwidth {
            let _ = writeln!(
                t,
                "  RDMA WRITE {} bandwidth: {:.2} GB/s (memcpy {:.2} GB/s, {:.2}x); {} writes in \
                 {:.3} s",
                size_text(f.size),
                f.gb_s,
                f.baseline_gb_s,
                f.ratio,
                f.writes,
                f.seconds
            );
        }
        if let Some(r) = &self.message_rates {
            t.push_str(&r.text());
        }
        if !self.ok {
            let _ = writeln!(
                t,
                "  (RDMA figures missing: the run stopped, see the error)"
            );
        }
        let _ = writeln!(t, "baselines:");
        if let Some(c) = cl {
            let _ = writeln!(
                t,
                "  cache-line ping-pong: {:.0} ns (p99 {:.0} ns, mean {:.0} ns; {} round trips \
                 through shared memory)",
                c.p50_ns, c.p99_ns, c.mean_ns, c.round_trips
            );
        }
        for m in &self.baselines.memcpy {
            let _ = writeln!(
                t,
                "  memcpy {}: {:.2} GB/s (one thread, best of {MEMCPY_TRIALS} runs each of \
                 memcpy and 64-byte moves: {})",
                size_text(m.size),
                m.gb_s,
                m.way
            );
        }
        t
    }
}

// ---------------------------------------------------------------------------------------------
// A: the measuring process.

/// The peer process: killed (and reaped) when dropped, unless it has exited.
struct PeerProcess {
    child: Child,
}

impl PeerProcess {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// An error if the process has exited.
    fn check_running(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!(
                "the peer process exited early ({status}){}",
                self.stderr_tail()
            )
            .into()),
            Err(e) => Err(format!("checking on the peer process: {e}").into()),
        }
    }

    /// Waits (briefly) for the process to exit after `quit`; an error unless it exits 0.
    fn finish(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.child.try_wait()? {
                Some(status) if status.success() => return Ok(()),
                Some(status) => {
                    return Err(format!(
                        "the peer process failed ({status}){}",
                        self.stderr_tail()
                    )
                    .into());
                }
                None if Instant::now() > deadline => {
                    return Err("the peer process did not exit when told to".into());
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Kills the process (if running); returns how it had ended if it had, and what it wrote
    /// on standard error, for an error message.
    fn kill(&mut self) -> String {
        let ended = match self.child.try_wait() {
            Ok(Some(status)) => format!("; the peer process had exited ({status})"),
            _ => String::new(),
        };
        let _ = self.child.kill();
        let _ = self.child.wait();
        ended + &self.stderr_tail()
    }

    fn stderr_tail(&mut self) -> String {
        stderr_tail(&mut self.child, "the peer process")
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Starts the peer process: this executable, `perf-peer`, with the shared page's descriptor
/// inheritable for the moment of the spawn.
fn spawn_peer(
    port: u16,
    page: &std::fs::File,
    device: Option<&str>,
    cpu: usize,
    spin: bool,
) -> Result<PeerProcess> {
    use std::os::fd::AsRawFd;
    let exe = std::env::current_exe().map_err(|e| format!("finding this executable: {e}"))?;
    let mut cmd = Command::new(&exe);
    cmd.arg("perf-peer")
        .arg("--port")
        .arg(port.to_string())
        .arg("--shm-fd")
        .arg(page.as_raw_fd().to_string())
        .arg("--parent")
        .arg(std::process::id().to_string())
        .arg("--cpu")
        .arg(cpu.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(d) = device {
        cmd.arg("--ib-dev").arg(d);
    }
    if spin {
        cmd.arg("--spin");
    }
    // Only this child inherits the page: the flag is cleared just for the spawn (this process
    // starts no other children meanwhile).
    rustix::io::fcntl_setfd(page, rustix::io::FdFlags::empty())
        .map_err(|e| format!("sharing the page: {e}"))?;
    let child = cmd.spawn();
    rustix::io::fcntl_setfd(page, rustix::io::FdFlags::CLOEXEC)
        .map_err(|e| format!("sharing the page: {e}"))?;
    let child = child.map_err(|e| format!("starting {}: {e}", exe.display()))?;
    Ok(PeerProcess { child })
}

impl Args {
    /// `perf --net` (RoCE between two network namespaces; `perf_net` runs it).
    pub fn is_net(&self) -> bool {
        self.net && self.command.is_none()
    }
}

pub fn run(args: &Args) -> Result<()> {
    match &args.command {
        Some(PerfCommand::CqPoll(args)) => return crate::perf_cq::run(args),
        Some(PerfCommand::Noncontig(args)) => return crate::perf_noncontig::run(args),
        Some(PerfCommand::Objects(args)) => return crate::perf_objects::run(args),
        None => {}
    }
    let plan = Plan::new(args)?;
    let pair = crate::report::cpu_pair(args.cpus.as_deref())?;
    let all_cpus = cpus();
    let allowed = crate::report::allowed_cpus();
    // Before any thread starts, so that they all stay on this CPU too.
    crate::report::pin_to(pair[0])?;
    let device = crate::find_device(args.device.as_deref())?;
    device.open()?; // fail early on a device that cannot be opened
    let mut report = Report {
        device: device.name().into(),
        quick: args.quick,
        cpus: all_cpus,
        cpu_pair: pair,
        cpus_allowed: allowed,
        cpu_model: crate::report::cpu_model(),
        ..Report::default()
    };
    let page_file = create_shared_page()?;
    let page = SharedPage::map(&page_file)?;
    let listener = TcpLink::listen(([127, 0, 0, 1], 0).into())?;
    let port = listener.local_addr()?.port();
    let spin = pair[0] != pair[1];
    let mut peer = spawn_peer(port, &page_file, args.device.as_deref(), pair[1], spin)?;
    report.pids = [std::process::id(), peer.pid()];
    let guard = Arc::new(Guard::spinning(spin));
    let watchdog = Watchdog::start(guard.clone(), peer.pid());

    let result = TcpLink::accept(&listener, START_TIMEOUT, LINK_TIMEOUT, || {
        peer.check_running()
    })
    .map_err(|e| -> crate::Error { format!("starting the peer process: {e}").into() })
    .and_then(|mut link| {
        drop(listener);
        let watch = link.stream_clone()?;
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let _ = std::thread::Builder::new()
                .name("perf-watch".into())
                .spawn_scoped(s, || {
                    watch_for_failure(&watch, &guard.abort, &done, WATCH_EVERY)
                });
            let r = measure(
                &mut link,
                &device,
                &plan,
                &page,
                &guard,
                &watchdog,
                &mut report,
            );
            done.store(true, Ordering::Relaxed);
            r
        })
        .map_err(|e| explain(e, &mut link, "the peer process"))
        .and_then(|()| {
            send(&mut link, &Msg::Quit)?;
            peer.finish()
        })
    });
    let phase = watchdog.current_phase();
    drop(watchdog);
    if let Err(e) = &result {
        // Whatever happened, the peer process goes now.
        let tail = peer.kill();
        let mut msg = e.to_string();
        if !msg.starts_with(&phase) {
            msg = format!("{phase}: {msg}");
        }
        if !msg.contains("the peer process failed: ") && !msg.contains("the peer process said") {
            msg.push_str(&tail);
        }
        report.error = Some(msg);
    }
    report.ok = result.is_ok();
    print_report(&report, args.json, Report::text)?;
    match report.error {
        None => Ok(()),
        Some(mut e) => {
            if !report.baselines.memcpy.is_empty() && report.rdma_write_bandwidth.len() < 2 {
                e.push_str(
                    "\n(the run stopped here; the baselines and the figures measured before are \
                     on standard output)",
                );
            }
            Err(e.into())
        }
    }
}

/// Turns "the peer stopped" into the peer's own reason when it gave one.
/// The last lines of `child`'s standard error (once it has exited), as "; WHO said: ...", or
/// nothing.
pub(crate) fn stderr_tail(child: &mut Child, who: &str) -> String {
    let mut text = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut text);
    }
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    let tail = lines[lines.len().saturating_sub(6)..].join(" | ");
    format!("; {who} said: {tail}")
}

/// Tells the other end why this one failed, unless the failure came from the other end.
pub(crate) fn tell_peer<T>(link: &mut TcpLink, result: &Result<T>) {
    if let Err(e) = result
        && !e.is::<PeerError>()
        && !e.is::<PeerFailed>()
    {
        let _ = send(
            link,
            &Msg::Error {
                error: e.to_string(),
            },
        );
    }
}

pub(crate) fn explain(err: crate::Error, link: &mut TcpLink, who: &str) -> crate::Error {
    if err.is::<PeerError>() {
        return format!("{who} failed: {err}").into();
    }
    if !err.is::<PeerFailed>() {
        return err;
    }
    for _ in 0..4 {
        match recv(link) {
            Ok(_) => continue,
            Err(e) if e.is::<PeerError>() => return format!("{who} failed: {e}").into(),
            Err(_) => break,
        }
    }
    format!("{who} closed the connection without saying why (did it crash?)").into()
}

/// Runs every measurement in order, filling `report` as figures come in.
fn measure(
    link: &mut TcpLink,
    device: &Device,
    plan: &Plan,
    page: &SharedPage,
    guard: &Guard,
    watchdog: &Watchdog,
    report: &mut Report,
) -> Result<()> {
    send(
        link,
        &Msg::Hello {
            pid: std::process::id(),
            spins: guard.spins(),
        },
    )?;
    let peer_spins = match expect(link, "hello", |m| {
        matches!(m, Msg::Hello { .. }).then_some(m)
    })? {
        Msg::Hello { spins, .. } => spins,
        _ => false,
    };
    report.waits = [wait_mode(guard.spins()), wait_mode(peer_spins)];

    // Baselines first: they need no RDMA.
    watchdog.phase(guard, "cache-line ping-pong");
    let rounds = plan.iters * CACHELINE_FACTOR;
    let warmup = plan.warmup * CACHELINE_FACTOR;
    let base = page.ball().load(Ordering::Acquire);
    send(
        link,
        &Msg::CacheLine {
            rounds: warmup + rounds,
            base,
        },
    )?;
    expect(link, "ready", |m| (m == Msg::Ready).then_some(m))?;
    // B serves all rounds; A counts the first `warmup` as warm-up.
    let samples = cacheline(page.ball(), base, rounds, warmup, false, guard)?;
    expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
    // Each sample is a batch's mean round trip: half of it is the latency.
    let cl = Latency::from_rtts(samples, rounds);
    report.baselines.cacheline_pingpong = Some(cl.clone());

    watchdog.phase(guard, "memcpy");
    for size in BW_SIZES {
        let (gb_s, way) = memcpy_gb_s(size, plan.bw_total, guard);
        report.baselines.memcpy.push(MemcpyFigure {
            size,
            gb_s,
            bytes: plan.bw_total,
            way,
        });
    }

    // RDMA.
    let lat = |latency: Latency| LatencyFigure {
        size: LAT_SIZE,
        baseline_ns: cl.p50_ns,
        ratio: latency.p50_ns / cl.p50_ns.max(1e-9),
        latency,
    };
    let mut figs = RdmaFigures::default();
    let result = measure_rdma(link, device, None, plan, guard, watchdog, &mut figs);
    report.rdma_write_latency = figs.write_lat.map(lat);
    report.send_latency = figs.send_lat.map(lat);
    for (i, run) in figs.write_bw.into_iter().enumerate() {
        let baseline = report.baselines.memcpy[i].gb_s;
        report.rdma_write_bandwidth.push(run.figure(baseline));
    }
    result?;

    use crate::perf_rate::MSG_SIZE;
    let ops: [(&str, OpAt); 2] = [("RDMA READ", read_op), ("fetch-and-add", fetch_add_op)];
    for (name, op) in ops {
        watchdog.phase(guard, &format!("{name} latency"));
        let mut side = Side::new(device, MSG_SIZE, LAT_SQ_DEPTH, 1)?;
        let theirs = start_rdma(link, &side, Test::Passive, 0, MSG_SIZE as u64)?;
        let l = one_at_a_time(&mut side, op(&theirs), plan.warmup, plan.iters, guard)?;
        send(link, &Msg::Check)?;
        expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
        let fig = Some(LatencyFigure {
            size: if name == "RDMA READ" { MSG_SIZE } else { 8 },
            baseline_ns: cl.p50_ns,
            ratio: l.p50_ns / cl.p50_ns.max(1e-9),
            latency: l,
        });
        if name == "RDMA READ" {
            report.read_latency = fig;
        } else {
            report.fetch_add_latency = fig;
        }
    }
    let allowed = report.cpus_allowed.clone();
    report.message_rates = Some(measure_rates(
        link, device, plan, page, guard, watchdog, &allowed,
    )?);
    Ok(())
}

/// The message rates and the raw ring (see [`crate::perf_rate`]).
fn measure_rates(
    link: &mut TcpLink,
    device: &Device,
    plan: &Plan,
    page: &SharedPage,
    guard: &Guard,
    watchdog: &Watchdog,
    allowed: &[usize],
) -> Result<crate::perf_rate::Rates> {
    use crate::perf_rate::{MSG_SIZE, RateFigure, Rates};
    let messages = plan.messages;
    let mut rates = Rates::default();

    watchdog.phase(guard, "raw ring");
    // The best of several runs, each through pages of its own. One ring's figure is a
    // property of its pages: ten runs of `perf` in a row read 19 to 61 M msg/s (the RDMA
    // WRITE rate beside it 22.6 to 25.2), and five runs of one ring in one process agreed
    // within 15% (13-16 in a slow process, 49-60 in a fast one). On a VM the lines of a page
    // move between cores through the page's home in the host, near or far: the ring's figure
    // then said more about where its pages fell than about the path.
    let mut best = f64::INFINITY;
    for run in 0..crate::perf_rate::RAW_RING_RUNS {
        let words = page.ring_words(run);
        for w in words {
            w.store(0, Ordering::Relaxed);
        }
        send(link, &Msg::RawRing { messages, run })?;
        expect(link, "ready", |m| (m == Msg::Ready).then_some(m))?;
        let what = || "raw ring: the peer process stopped consuming".to_string();
        let wait = |done: &dyn Fn() -> bool| guard.until(&what, done);
        let seconds = crate::perf_rate::raw_ring_producer(words, messages, &wait)?;
        expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
        best = best.min(seconds);
    }
    rates.raw_ring_msgs_per_sec = messages as f64 / best.max(1e-9);
    let figure = |op, qps: usize, seconds: f64, raw: f64| {
        let total = messages * qps as u64;
        let msgs_per_sec = total as f64 / seconds.max(1e-9);
        RateFigure {
            op,
            qps,
            messages: total,
            seconds,
            msgs_per_sec,
            ratio_to_raw_ring: msgs_per_sec / raw.max(1e-9),
        }
    };
    let raw = rates.raw_ring_msgs_per_sec;

    let ops: [(&'static str, Test, OpAt); 3] = [
        ("RDMA WRITE", Test::Passive, write_op),
        ("SEND", Test::SendRate, |_| SendOp::Send),
        ("RDMA READ", Test::Passive, read_op),
    ];
    for (name, test, op) in ops {
        watchdog.phase(guard, &format!("{name} message rate"));
        let mut side = Side::new(device, MSG_SIZE, crate::perf_rate::TX_DEPTH as u32, 1)?;
        let theirs = start_rdma(link, &side, test, messages, MSG_SIZE as u64)?;
        let seconds = rate(&mut side, op(&theirs), messages, guard)?;
        if test == Test::Passive {
            send(link, &Msg::Check)?;
        }
        expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
        rates.figures.push(figure(name, 1, seconds, raw));
    }

    // One QP per CPU, each driven by a thread on its CPU.
    if allowed.len() > 1 {
        watchdog.phase(guard, "RDMA WRITE message rate, one QP per CPU");
        let mut sides = Vec::new();
        for _ in allowed {
            let side = Side::new(device, MSG_SIZE, crate::perf_rate::TX_DEPTH as u32, 1)?;
            let theirs = start_rdma(link, &side, Test::Passive, messages, MSG_SIZE as u64)?;
            sides.push((side, theirs));
        }
        let start = std::sync::Barrier::new(sides.len());
        let times: Vec<Result<f64>> = std::thread::scope(|s| {
            let runs: Vec<_> = sides
                .iter_mut()
                .zip(allowed)
                .map(|((side, theirs), &cpu)| {
                    let start = &start;
                    s.spawn(move || {
                        crate::report::pin_to(cpu)?;
                        start.wait();
                        rate(side, write_op(theirs), messages, guard)
                    })
                })
                .collect();
            runs.into_iter()
                .map(|r| {
                    r.join()
                        .unwrap_or_else(|_| Err("a rate thread panicked".into()))
                })
                .collect()
        });
        let mut slowest = 0.0f64;
        for t in times {
            slowest = slowest.max(t?);
        }
        send(link, &Msg::Check)?;
        expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
        let f = figure("RDMA WRITE", sides.len(), slowest, raw);
        let one = rates.figures[0].msgs_per_sec;
        rates.per_cpu_scaling = Some(f.msgs_per_sec / (one * sides.len() as f64).max(1e-9));
        rates.figures.push(f);
    }

    let max_qp = device.open()?.query_device().max_qp as usize;
    for &qps in plan.fan_counts.iter().filter(|&&n| n <= max_qp) {
        watchdog.phase(guard, &format!("RDMA WRITE round robin over {qps} QPs"));
        let per_qp = crate::perf_fan::per_qp(messages, qps);
        let seconds = round_robin(link, device, qps, per_qp, guard)?;
        let total = per_qp * qps as u64;
        let msgs_per_sec = total as f64 / seconds.max(1e-9);
        let one = rates
            .round_robin
            .first()
            .map_or(msgs_per_sec, |f| f.msgs_per_sec);
        rates.round_robin.push(crate::perf_rate::FanFigure {
            qps,
            messages: total,
            seconds,
            msgs_per_sec,
            ratio_to_one_qp: msgs_per_sec / one.max(1e-9),
        });
    }
    Ok(rates)
}

/// A's half of one round-robin rate (see [`crate::perf_fan`]): `qps` QPs here connected to
/// as many in B, `per_qp` WRITEs through each, B's check of its slots; the seconds.
fn round_robin(
    link: &mut TcpLink,
    device: &Device,
    qps: usize,
    per_qp: u64,
    guard: &Guard,
) -> Result<f64> {
    let beat = || guard.beat();
    let fan = crate::perf_fan::Fan::new(device, qps, per_qp, &beat)?;
    fan.fill()?;
    send(
        link,
        &Msg::Fan {
            ep: fan.endpoint()?,
            per_qp,
        },
    )?;
    send_qpns(link, &fan.qpns())?;
    let Msg::FanEndpoint { ep } = expect(link, "fan_endpoint", |m| {
        matches!(m, Msg::FanEndpoint { .. }).then_some(m)
    })?
    else {
        unreachable!("checked by expect")
    };
    let theirs = recv_qpns(link, ep.qps as usize)?;
    fan.connect(&ep, &theirs, &beat)?;
    let what = || format!("round robin over {qps} QPs: waiting for completions");
    let wait = |done: &dyn Fn() -> bool| guard.until(&what, done);
    let seconds = fan.round_robin(&ep, per_qp, &wait)?;
    send(link, &Msg::Check)?;
    expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
    Ok(seconds)
}

/// Sends a fan's QP numbers, as many messages as they need.
fn send_qpns(link: &mut TcpLink, qpns: &[u32]) -> Result<()> {
    for chunk in qpns.chunks(crate::perf_fan::QPNS_PER_MESSAGE) {
        send(
            link,
            &Msg::Qpns {
                qpns: chunk.to_vec(),
            },
        )?;
    }
    Ok(())
}

/// Receives `count` QP numbers of the peer's fan.
fn recv_qpns(link: &mut TcpLink, count: usize) -> Result<Vec<u32>> {
    let mut all = Vec::new();
    while all.len() < count {
        let Msg::Qpns { qpns } =
            expect(link, "qpns", |m| matches!(m, Msg::Qpns { .. }).then_some(m))?
        else {
            unreachable!("checked by expect")
        };
        if qpns.is_empty() || all.len() + qpns.len() > count {
            return Err(format!(
                "the peer sent {} QP numbers after {}, of {count}",
                qpns.len(),
                all.len()
            )
            .into());
        }
        all.extend(qpns);
    }
    Ok(all)
}

/// One RDMA WRITE bandwidth run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BwRun {
    pub(crate) size: usize,
    pub(crate) bytes: u64,
    pub(crate) writes: u64,
    pub(crate) seconds: f64,
}

impl BwRun {
    pub(crate) fn gb_s(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e9
    }

    /// The figure beside a baseline of `baseline` GB/s.
    pub(crate) fn figure(&self, baseline: f64) -> BandwidthFigure {
        let gb_s = self.gb_s();
        BandwidthFigure {
            size: self.size,
            gb_s,
            bytes: self.bytes,
            writes: self.writes,
            seconds: self.seconds,
            baseline_gb_s: baseline,
            ratio: gb_s / baseline.max(1e-9),
        }
    }
}

/// The RDMA figures of a run, filled as they come in (a run that fails keeps the ones
/// measured before).
#[derive(Debug, Default)]
pub(crate) struct RdmaFigures {
    pub(crate) write_lat: Option<Latency>,
    pub(crate) send_lat: Option<Latency>,
    pub(crate) write_bw: Vec<BwRun>,
}

/// A's RDMA tests, in order: WRITE latency, SEND latency, WRITE bandwidth at each of
/// BW_SIZES, with B (the other end of `link`) serving each; QPs address B over `route`.
pub(crate) fn measure_rdma(
    link: &mut TcpLink,
    device: &Device,
    route: Option<Route>,
    plan: &Plan,
    guard: &Guard,
    watchdog: &Watchdog,
    figs: &mut RdmaFigures,
) -> Result<()> {
    let (msg_len, rounds) = (LAT_SIZE as u64, plan.warmup + plan.iters);

    watchdog.phase(guard, "RDMA WRITE latency");
    let mut side = Side::new(device, 2 * LAT_SIZE, LAT_SQ_DEPTH, 1)?.with_route(route);
    let theirs = start_rdma(link, &side, Test::WriteLat, rounds, msg_len)?;
    let rtts = write_lat(&mut side, &theirs, plan, false, guard)?;
    expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
    drop(side);
    figs.write_lat = Some(Latency::from_rtts(rtts, plan.iters));

    watchdog.phase(guard, "SEND latency");
    let mut side = Side::new(
        device,
        LAT_SIZE * (1 + RX_DEPTH),
        LAT_SQ_DEPTH,
        RX_DEPTH as u32,
    )?
    .with_route(route);
    // B answers only after A's first SEND, so A may post its receives after connecting.
    start_rdma(link, &side, Test::SendLat, rounds, msg_len)?;
    for slot in 0..RX_DEPTH {
        post_slot(&side, slot)?;
    }
    let rtts = send_lat(&mut side, plan, false, guard)?;
    expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
    drop(side);
    figs.send_lat = Some(Latency::from_rtts(rtts, plan.iters));

    for size in BW_SIZES {
        watchdog.phase(
            guard,
            &format!("RDMA WRITE bandwidth ({})", size_text(size)),
        );
        let waits = if net_writer_sleeps() {
            Waits::Sleep
        } else {
            Waits::Spin
        };
        let mut side = Side::with_waits(device, size, TX_DEPTH as u32, 1, waits)?.with_route(route);
        let theirs = start_rdma(link, &side, Test::WriteBw, 0, size as u64)?;
        let (bytes, writes, seconds) = write_bw(&mut side, &theirs, size, plan.bw_total, guard)?;
        send(link, &Msg::Check)?;
        expect(link, "done", |m| (m == Msg::Done).then_some(m))?;
        drop(side);
        figs.write_bw.push(BwRun {
            size,
            bytes,
            writes,
            seconds,
        });
    }
    Ok(())
}

/// A's half of an RDMA test's set-up: sends its endpoint, learns B's (B is connected by
/// then), and connects.
fn start_rdma(
    link: &mut TcpLink,
    side: &Side,
    test: Test,
    rounds: u64,
    size: u64,
) -> Result<WireEp> {
    send(
        link,
        &Msg::Rdma {
            test,
            rounds,
            size,
            ep: side.endpoint()?,
        },
    )?;
    let Msg::Endpoint { ep } = expect(link, "endpoint", |m| {
        matches!(m, Msg::Endpoint { .. }).then_some(m)
    })?
    else {
        unreachable!("checked by expect")
    };
    side.connect(&ep)?;
    Ok(ep)
}

// ---------------------------------------------------------------------------------------------
// READ and atomic latency, message rates (see `crate::perf_rate` for what they are).

/// Posts the SEND target's receives, one RATE_MSG slot each.
pub(crate) fn post_receives(side: &Side) -> Result<()> {
    for slot in 0..RATE_RX_DEPTH {
        post_receive(side, slot)?;
    }
    Ok(())
}

fn post_receive(side: &Side, slot: usize) -> Result<()> {
    let sge = [side.mr.sge(slot * RATE_MSG..(slot + 1) * RATE_MSG)];
    side.qp
        .post_recv([RecvWr::new(slot as u64, &sge)])
        .map_err(|e| format!("SEND rate: posting receive {slot}: {e}").into())
}

/// The SEND target: takes `rounds` receive completions, reposting each receive.
pub(crate) fn receive(side: &mut Side, rounds: u64, guard: &Guard) -> Result<()> {
    let mut got = 0u64;
    let mut wcs = [WorkCompletion::default(); 32];
    let what = || "SEND rate: waiting for SENDs".to_string();
    while got < rounds {
        let polled = poll_some(&side.recv_cq, &mut wcs, guard, &what)?;
        for wc in polled {
            post_receive(side, wc.wr_id() as usize)?;
        }
        got += polled.len() as u64;
    }
    Ok(())
}

/// Waits until `cq` gives completions; all of them must be successes.
fn poll_some<'w>(
    cq: &softverbs::CompletionQueue,
    wcs: &'w mut [WorkCompletion],
    guard: &Guard,
    what: &dyn Fn() -> String,
) -> Result<&'w [WorkCompletion]> {
    let n = guard.spin(what, |_| {
        let n = cq.poll(wcs);
        Ok((n > 0).then_some(n))
    })?;
    match wcs[..n].iter().find(|wc| !wc.is_ok()) {
        Some(wc) => Err(format!("{}: completion {wc:?}", what()).into()),
        None => Ok(&wcs[..n]),
    }
}

/// Sends `total` RATE_MSG-byte work requests of `op` from `side`, perftest's way; returns
/// the seconds from the first post to the last completion.
pub(crate) fn rate(side: &mut Side, op: SendOp, total: u64, guard: &Guard) -> Result<f64> {
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wcs = [WorkCompletion::default(); 16];
    let what = || format!("{op:?} rate: waiting for completions");
    let t0 = Instant::now();
    while done < total {
        while posted < total && posted - done < RATE_TX_DEPTH {
            let signaled = (posted + 1) % RATE_CQ_MOD == 0 || posted + 1 == total;
            side.post_one(posted, op, RATE_MSG, signaled)
                .map_err(|e| format!("{op:?} rate: posting {posted}: {e}"))?;
            posted += 1;
        }
        for wc in poll_some(&side.send_cq, &mut wcs, guard, &what)? {
            // A signaled completion stands for every request before it.
            done = done.max(wc.wr_id() + 1);
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// One READ or fetch-and-add (`op`) at a time, `warmup + iters` of them; the times of the
/// last `iters`, in ns.
pub(crate) fn one_at_a_time(
    side: &mut Side,
    op: SendOp,
    warmup: u64,
    iters: u64,
    guard: &Guard,
) -> Result<Latency> {
    let len = if op.is_atomic() { 8 } else { RATE_MSG };
    let mut samples = Vec::with_capacity(iters as usize);
    let mut wc = [WorkCompletion::default()];
    let what = || format!("{op:?} latency: waiting for the completion");
    for r in 0..warmup + iters {
        let t0 = Instant::now();
        side.post_one(r, op, len, true)
            .map_err(|e| format!("{op:?} latency: posting {r}: {e}"))?;
        guard.spin(&what, |_| {
            Ok((side.send_cq.poll(&mut wc) == 1).then_some(()))
        })?;
        let took = t0.elapsed();
        if !wc[0].is_ok() {
            return Err(format!("{op:?} latency: completion {:?}", wc[0]).into());
        }
        if r >= warmup {
            samples.push(ns(took));
        }
        if r % 256 == 0 {
            guard.beat();
        }
    }
    Ok(Latency::from_ops(samples, iters))
}

/// An operation aimed at the peer's region.
pub(crate) type OpAt = fn(&WireEp) -> SendOp;

/// The operation of each one-sided figure, aimed at the peer's region.
pub(crate) fn write_op(peer: &WireEp) -> SendOp {
    SendOp::RdmaWrite {
        remote_addr: peer.addr,
        rkey: peer.rkey,
    }
}

pub(crate) fn read_op(peer: &WireEp) -> SendOp {
    SendOp::RdmaRead {
        remote_addr: peer.addr,
        rkey: peer.rkey,
    }
}

pub(crate) fn fetch_add_op(peer: &WireEp) -> SendOp {
    SendOp::FetchAdd {
        remote_addr: peer.addr,
        rkey: peer.rkey,
        add: 1,
    }
}

// ---------------------------------------------------------------------------------------------
// B: the peer process.

/// `softverbs perf-peer`: the second process of `perf`, run by it.
pub fn run_peer(args: &PeerArgs) -> Result<()> {
    // Die with the parent; and if it is already gone, stop now.
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .map_err(|e| format!("prctl(PR_SET_PDEATHSIG): {e}"))?;
    if rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(args.parent) {
        return Err("perf-peer is run by `softverbs perf`, and its parent is gone".into());
    }
    // The parent says, as this process was started pinned to the parent's CPU (see
    // `Guard::spinning`).
    let spin = args.spin;
    if let Some(cpu) = args.cpu {
        crate::report::pin_to(cpu)?;
    }
    let device = crate::find_device(args.device.as_deref())?;
    // The inherited memfd, opened again through /proc (no raw descriptor handling needed).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", args.shm_fd))
        .map_err(|e| format!("opening the shared page (fd {}): {e}", args.shm_fd))?;
    let page = SharedPage::map(&file)?;
    let mut link = TcpLink::connect("127.0.0.1", args.port, START_TIMEOUT, LINK_TIMEOUT)?;
    let guard = Guard::spinning(spin);
    let watch = link.stream_clone()?;
    let done = AtomicBool::new(false);
    let result = std::thread::scope(|s| {
        let _ = std::thread::Builder::new()
            .name("perf-watch".into())
            .spawn_scoped(s, || {
                watch_for_failure(&watch, &guard.abort, &done, WATCH_EVERY)
            });
        let r = serve(&mut link, &device, &page, &guard);
        done.store(true, Ordering::Relaxed);
        r
    });
    tell_peer(&mut link, &result);
    result
}

/// B's loop: does what A asks until `quit`.
fn serve(link: &mut TcpLink, device: &Device, page: &SharedPage, guard: &Guard) -> Result<()> {
    // Passive sides A set up and has not finished with (`check` ends them).
    let mut held: Vec<Side> = Vec::new();
    let mut held_fan: Option<crate::perf_fan::Fan> = None;
    loop {
        match recv(link)? {
            Msg::Hello { .. } => send(
                link,
                &Msg::Hello {
                    pid: std::process::id(),
                    spins: guard.spins(),
                },
            )?,
            Msg::CacheLine { rounds, base } => {
                send(link, &Msg::Ready)?;
                cacheline(page.ball(), base, rounds, 0, true, guard)?;
                send(link, &Msg::Done)?;
            }
            Msg::Rdma {
                test,
                rounds,
                size,
                ep,
            } => held.extend(serve_rdma(
                link, device, None, test, rounds, size, &ep, guard,
            )?),
            Msg::Check => {
                held.clear();
                if let Some(fan) = held_fan.take() {
                    fan.check()?;
                }
                send(link, &Msg::Done)?;
            }
            Msg::Fan { ep, per_qp } => {
                let theirs = recv_qpns(link, ep.qps as usize)?;
                let beat = || guard.beat();
                let fan = crate::perf_fan::Fan::new(device, ep.qps as usize, per_qp, &beat)?;
                fan.connect(&ep, &theirs, &beat)?;
                send(
                    link,
                    &Msg::FanEndpoint {
                        ep: fan.endpoint()?,
                    },
                )?;
                send_qpns(link, &fan.qpns())?;
                held_fan = Some(fan);
            }
            Msg::RawRing { messages, run } => {
                send(link, &Msg::Ready)?;
                let what = || "raw ring: the peer process stopped producing".to_string();
                let wait = |done: &dyn Fn() -> bool| guard.until(&what, done);
                crate::perf_rate::raw_ring_consumer(page.ring_words(run), messages, &wait)?;
                send(link, &Msg::Done)?;
            }
            Msg::Quit => return Ok(()),
            other => return Err(format!("unexpected message from perf: {other:?}").into()),
        }
    }
}

/// B's part of one RDMA test A asked for (`Msg::Rdma`): its QP, connected to A's `ep`
/// over `route`, then the test. A passive test's side is returned for the caller to hold
/// until A says `check` (A may set up several at once: one QP per core).
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve_rdma(
    link: &mut TcpLink,
    device: &Device,
    route: Option<Route>,
    test: Test,
    rounds: u64,
    size: u64,
    ep: &WireEp,
    guard: &Guard,
) -> Result<Option<Side>> {
    let plan = Plan {
        iters: rounds,
        warmup: 0,
        bw_total: 0,
        messages: 0,
        fan_counts: &[],
    };
    match test {
        Test::WriteLat => {
            let mut side = Side::new(device, 2 * LAT_SIZE, LAT_SQ_DEPTH, 1)?.with_route(route);
            side.connect(ep)?;
            tell_endpoint(link, &side)?;
            write_lat(&mut side, ep, &plan, true, guard)?;
            send(link, &Msg::Done)
        }
        Test::SendLat => {
            let mut side = Side::new(
                device,
                LAT_SIZE * (1 + RX_DEPTH),
                LAT_SQ_DEPTH,
                RX_DEPTH as u32,
            )?
            .with_route(route);
            side.connect(ep)?;
            for slot in 0..RX_DEPTH {
                post_slot(&side, slot)?;
            }
            tell_endpoint(link, &side)?;
            send_lat(&mut side, &plan, true, guard)?;
            send(link, &Msg::Done)
        }
        Test::WriteBw => {
            let side = region_side(link, device, route, size, ep)?;
            expect(link, "check", |m| (m == Msg::Check).then_some(m))?;
            check_bw_target(&side, size as usize)?;
            send(link, &Msg::Done)
        }
        Test::Passive => return Ok(Some(region_side(link, device, route, size, ep)?)),
        Test::SendRate => {
            let mut side = Side::new(device, RATE_MSG * RATE_RX_DEPTH, 1, RATE_RX_DEPTH as u32)?
                .with_route(route);
            side.connect(ep)?;
            post_receives(&side)?;
            tell_endpoint(link, &side)?;
            receive(&mut side, rounds, guard)?;
            send(link, &Msg::Done)
        }
    }
    .map(|()| None)
}

/// B → A: B's endpoint (B is connected and its receives are posted).
fn tell_endpoint(link: &mut TcpLink, side: &Side) -> Result<()> {
    send(
        link,
        &Msg::Endpoint {
            ep: side.endpoint()?,
        },
    )
}

/// B's side of a test that only needs its region and a connected QP: a region of `size`
/// bytes (A's word, so checked), connected to A's `ep`, its endpoint sent back.
fn region_side(
    link: &mut TcpLink,
    device: &Device,
    route: Option<Route>,
    size: u64,
    ep: &WireEp,
) -> Result<Side> {
    let size = usize::try_from(size)
        .ok()
        .filter(|&s| s > 0 && s <= 1 << 30)
        .ok_or_else(|| format!("bad region size {size}"))?;
    let side = Side::new(device, size, 1, 1)?.with_route(route);
    side.connect(ep)?;
    tell_endpoint(link, &side)?;
    Ok(side)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cacheline_pingpong_between_two_mappings() {
        let file = create_shared_page().unwrap();
        let file2 = file.try_clone().unwrap();
        let guard = Guard::new();
        let (rounds, warmup) = (10_000, 100);
        let samples = std::thread::scope(|s| {
            let g = &guard;
            s.spawn(move || {
                // A second mapping of the same page, as the peer process makes.
                let page = SharedPage::map(&file2).unwrap();
                cacheline(page.ball(), 0, rounds + warmup, 0, true, g).unwrap();
            });
            let page = SharedPage::map(&file).unwrap();
            let samples = cacheline(page.ball(), 0, rounds, warmup, false, g).unwrap();
            assert_eq!(page.ball().load(Ordering::Relaxed), 2 * (rounds + warmup));
            samples
        });
        assert_eq!(samples.len() as u64, rounds / CACHELINE_BATCH + 1);
        let l = Latency::from_rtts(samples, rounds);
        assert!(l.p50_ns > 0.0 && l.p50_ns <= l.p99_ns, "{l:?}");
    }

    #[test]
    fn a_silent_peer_is_an_error_not_a_hang() {
        let file = create_shared_page().unwrap();
        let page = SharedPage::map(&file).unwrap();
        let guard = Guard::new();
        guard.abort.store(true, Ordering::Relaxed);
        let err = cacheline(page.ball(), 0, 10, 0, false, &guard).unwrap_err();
        assert!(err.is::<PeerFailed>(), "{err}");
    }

    #[test]
    fn latency_statistics_are_half_round_trips() {
        let l = Latency::from_rtts((1..=100).map(|v| v as f64 * 2.0).collect(), 100);
        assert_eq!((l.p50_ns, l.p99_ns), (50.0, 99.0));
        assert!((l.mean_ns - 50.5).abs() < 1e-9);
    }

    #[test]
    fn memcpy_baseline_is_positive() {
        assert!(memcpy_gb_s(64 << 10, 4 << 20, &Guard::new()).0 > 0.0);
    }

    #[test]
    fn block_copy_copies_every_byte_including_the_tail() {
        let src: Vec<u8> = (0..1000).map(|j| pattern_byte(j, 1000)).collect();
        let mut dst = vec![0u8; 1000];
        copy_in_blocks(&mut dst, &src);
        assert_eq!(dst, src);
    }

    /// READ and fetch-and-add one at a time, and a WRITE message rate, between two QPs of
    /// this process: each moves what it should.
    #[test]
    fn one_sided_latencies_and_message_rates_move_the_bytes() {
        use crate::perf_rate::{MSG_SIZE, TX_DEPTH};
        let dev = crate::find_device(None).unwrap();
        let guard = Guard::new();
        let mut a = Side::new(&dev, MSG_SIZE, TX_DEPTH as u32, 1).unwrap();
        let b = Side::new(&dev, MSG_SIZE, 1, 1).unwrap();
        let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
        a.connect(&eb).unwrap();
        b.connect(&ea).unwrap();
        b.mr.write_at(0, &[7u8; MSG_SIZE]).unwrap();
        let l = one_at_a_time(&mut a, read_op(&eb), 5, 50, &guard).unwrap();
        assert!(l.p50_ns > 0.0 && l.round_trips == 50, "{l:?}");
        assert_eq!(
            a.mr.to_vec()[..MSG_SIZE],
            [7u8; MSG_SIZE],
            "the READ brought B's bytes"
        );
        b.mr.store_u64(0, 0).unwrap();
        one_at_a_time(&mut a, fetch_add_op(&eb), 5, 50, &guard).unwrap();
        assert_eq!(b.mr.load_u64(0).unwrap(), 55, "one add per fetch-and-add");
        a.mr.write_at(0, &[9u8; MSG_SIZE]).unwrap();
        assert!(rate(&mut a, write_op(&eb), 1000, &guard).unwrap() > 0.0);
        assert_eq!(
            b.mr.to_vec()[..MSG_SIZE],
            [9u8; MSG_SIZE],
            "the WRITEs landed"
        );
    }

    /// The RDMA tests, with both sides in this process (two threads): the same code the two
    /// processes run, on the same-process data path.
    #[test]
    fn rdma_tests_run_between_two_threads() {
        let dev = crate::find_device(None).unwrap();
        let plan = Plan {
            iters: 300,
            warmup: 10,
            bw_total: 4 << 20,
            messages: 0,
            fan_counts: &[],
        };
        let guard = Guard::new();
        let total = plan.warmup + plan.iters;
        let b_plan = Plan {
            iters: total,
            warmup: 0,
            bw_total: 0,
            messages: 0,
            fan_counts: &[],
        };
        // RDMA WRITE latency.
        let mut a = Side::new(&dev, 2 * LAT_SIZE, LAT_SQ_DEPTH, 1).unwrap();
        let mut b = Side::new(&dev, 2 * LAT_SIZE, LAT_SQ_DEPTH, 1).unwrap();
        let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
        a.connect(&eb).unwrap();
        b.connect(&ea).unwrap();
        let rtts = std::thread::scope(|s| {
            s.spawn(|| write_lat(&mut b, &ea, &b_plan, true, &guard).unwrap());
            write_lat(&mut a, &eb, &plan, false, &guard).unwrap()
        });
        assert_eq!(rtts.len() as u64, plan.iters);
        // SEND latency.
        let mut a = Side::new(
            &dev,
            LAT_SIZE * (1 + RX_DEPTH),
            LAT_SQ_DEPTH,
            RX_DEPTH as u32,
        )
        .unwrap();
        let mut b = Side::new(
            &dev,
            LAT_SIZE * (1 + RX_DEPTH),
            LAT_SQ_DEPTH,
            RX_DEPTH as u32,
        )
        .unwrap();
        let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
        a.connect(&eb).unwrap();
        b.connect(&ea).unwrap();
        for slot in 0..RX_DEPTH {
            post_slot(&a, slot).unwrap();
            post_slot(&b, slot).unwrap();
        }
        let rtts = std::thread::scope(|s| {
            s.spawn(|| send_lat(&mut b, &b_plan, true, &guard).unwrap());
            send_lat(&mut a, &plan, false, &guard).unwrap()
        });
        assert_eq!(rtts.len() as u64, plan.iters);
        // RDMA WRITE bandwidth, and B's check of the bytes.
        let size = 64 << 10;
        let mut a = Side::new(&dev, size, TX_DEPTH as u32, 1).unwrap();
        let b = Side::new(&dev, size, 1, 1).unwrap();
        let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
        a.connect(&eb).unwrap();
        b.connect(&ea).unwrap();
        assert!(check_bw_target(&b, size).is_err());
        let (bytes, writes, secs) = write_bw(&mut a, &eb, size, plan.bw_total, &guard).unwrap();
        assert_eq!((bytes, writes), (plan.bw_total, 64));
        assert!(secs > 0.0);
        check_bw_target(&b, size).unwrap();
    }

    #[test]
    fn a_message_from_this_process_is_named_as_such() {
        let dev = crate::find_device(None).unwrap();
        let side = Side::new(&dev, 2 * LAT_SIZE, 4, 1).unwrap();
        put_header(&side.mr, IN, 0, PING).unwrap();
        let err = check_header(&side.mr, IN, 0, PONG, "X")
            .unwrap_err()
            .to_string();
        assert!(err.contains("received ping 0, expected pong 0"), "{err}");
        assert!(err.contains("own message came back"), "{err}");
    }
}
