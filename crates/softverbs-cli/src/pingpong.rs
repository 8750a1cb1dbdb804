//! `softverbs pingpong`: SEND/RECV ping-pong between two queue pairs, measuring round-trip
//! latency and bandwidth, and checking every byte.
//!
//! The two ends are written as they would be in two processes: each opens its own context,
//! creates its PD, CQ, QP and memory region, and learns its peer's address ([`Endpoint`]) only
//! through an out-of-band [`OobLink`] that carries one JSON message at a time. `--loopback`
//! runs both ends in this process, one thread each, joined by an in-memory link. Without it
//! the ends are two processes joined by TCP, as with `ibv_rc_pingpong`: the server (no host
//! argument) waits for one client and echoes; the client connects, measures and reports.

use crate::Result;
use crate::oob::{ChannelLink, OobLink, PeerError, PeerFailed, TcpLink, watch_for_failure};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use softverbs::{
    AccessFlags, AddressHandle, CompletionQueue, Context, CqInitAttrEx, Device, DeviceClock,
    Endpoint, GRH_LEN, MemoryRegion, QpCap, QpInitAttr, QpType, QueuePair, RecvWr, SendFlags,
    SendOp, SendWr, WcExFlags, WorkCompletion, address_vector,
};
use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Q_Key both UD ends use (the one `ibv_ud_pingpong` uses).
const QKEY: u32 = 0x1111_1111;
/// Send queue depth: one send is in flight at a time, so this is generous.
const SQ_DEPTH: u32 = 16;
/// `wr_id` bit that marks send work requests (receives carry their buffer slot).
const SEND_TAG: u64 = 1 << 63;
/// How long to wait for a completion before deciding the peer is gone.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(10);
/// Empty CQ polls between yields of the CPU, and between abort/timeout checks.
const YIELD_EVERY: u32 = 4;
const CHECK_EVERY: u32 = 256;
/// How long the loopback ends wait for a message from each other on the out-of-band link.
const LINK_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `--timeout` of the TCP modes, in seconds.
const DEFAULT_TIMEOUT_S: u64 = 30;
/// How often the TCP modes look at the link for a failed peer while the RDMA traffic runs.
const WATCH_EVERY: Duration = Duration::from_millis(20);
/// Default message size.
const DEFAULT_SIZE: u64 = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Reliable connected.
    Rc,
    /// Unreliable connected.
    Uc,
    /// Unreliable datagram (messages up to the MTU).
    Ud,
}

impl Transport {
    fn qp_type(self) -> QpType {
        match self {
            Transport::Rc => QpType::Rc,
            Transport::Uc => QpType::Uc,
            Transport::Ud => QpType::Ud,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Transport::Rc => "RC",
            Transport::Uc => "UC",
            Transport::Ud => "UD",
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// Run both ends in this process, one thread each (no server, no client).
    #[arg(long)]
    loopback: bool,
    /// Transport of the queue pairs.
    #[arg(long, value_enum, default_value_t = Transport::Rc)]
    transport: Transport,
    /// Message size in bytes [default: 4096, or for UD the largest UD payload if smaller].
    #[arg(short = 's', long, value_name = "SIZE")]
    size: Option<u64>,
    /// Number of exchanges (round trips).
    #[arg(
        short = 'n',
        long = "iters",
        value_name = "ITERS",
        default_value_t = 10_000
    )]
    iters: u64,
    /// Device to use (default: the first device).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    device: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Server to connect to (client mode). Without it (and without --loopback) this end is
    /// the server: it waits for one client on the TCP port.
    #[arg(value_name = "SERVER", conflicts_with = "loopback")]
    server: Option<String>,
    /// TCP port of the address exchange (server: 0 picks a free port and prints it).
    #[arg(short = 'p', long, default_value_t = 18515)]
    port: u16,
    /// Seconds to wait for the other end: for a client to connect (server), for the server
    /// to accept (client), and for each message of the address exchange.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_TIMEOUT_S)]
    timeout: u64,
    /// Also report, like `ibv_rc_pingpong -t`, the max, min and average time between
    /// consecutive receive completions of the measuring end (the client), from the completions'
    /// device-clock timestamps: in clock cycles (wrap-around handled with the clock's mask) and
    /// in nanoseconds.
    #[arg(short = 't', long = "ts")]
    ts: bool,
}

/// The validated parameters of a run.
#[derive(Debug, Clone)]
struct Config {
    transport: Transport,
    size: usize,
    iters: u64,
    /// Receive buffers each end keeps posted.
    rx_depth: usize,
    /// Collect receive-completion timestamp statistics (`--ts`).
    ts: bool,
}

impl Config {
    fn new(args: &Args, device: &Device) -> Result<Config> {
        if args.iters == 0 {
            return Err("-n/--iters must be at least 1".into());
        }
        let ctx = device.open()?;
        let port = ctx.query_port(1)?;
        let mtu = u64::from(port.active_mtu.bytes());
        let size = match args.transport {
            Transport::Ud => {
                let size = args.size.unwrap_or(DEFAULT_SIZE.min(mtu));
                if size > mtu {
                    return Err(format!(
                        "-s {size}: a UD message must fit in one packet: at most the port MTU \
                         of {} ({mtu} bytes); use -s {mtu} or less",
                        device.name()
                    )
                    .into());
                }
                size
            }
            Transport::Rc | Transport::Uc => {
                let size = args.size.unwrap_or(DEFAULT_SIZE);
                let max = u64::from(port.max_msg_sz);
                if size > max {
                    return Err(format!(
                        "-s {size}: larger than the port's max_msg_sz of {max} bytes"
                    )
                    .into());
                }
                size
            }
        };
        let size = usize::try_from(size).map_err(|_| format!("-s {size}: too large"))?;
        if args.timeout == 0 {
            return Err("--timeout must be at least 1 second".into());
        }
        Ok(Config {
            transport: args.transport,
            size,
            iters: args.iters,
            // Two posted receives are enough for a strict ping-pong (the next message can
            // arrive while the last one is still being checked); keep a few more when cheap.
            rx_depth: if size <= 1 << 20 { 4 } else { 2 },
            ts: args.ts,
        })
    }
}

pub fn run(args: &Args) -> Result<()> {
    if args.server.is_some() && args.port == 0 {
        return Err("-p 0: give the port the server listens on".into());
    }
    let device = crate::find_device(args.device.as_deref())?;
    let cfg = Config::new(args, &device)?;
    let timeout = Duration::from_secs(args.timeout);
    let report = match &args.server {
        _ if args.loopback => {
            let stats = loopback(&device, &cfg)?;
            Report::new(&cfg, device.name(), Mode::Loopback, &stats)
        }
        Some(host) => {
            let mut link = TcpLink::connect(host, args.port, timeout, timeout)?;
            let peer = format!("{host} port {}", args.port);
            let stats = over_tcp(Role::Client, &device, &cfg, &mut link)?
                .ok_or("the client produced no measurements")?;
            Report::new(&cfg, device.name(), Mode::Client(peer), &stats)
        }
        None => {
            let listener = TcpLink::listen(([0, 0, 0, 0], args.port).into())?;
            let port = listener.local_addr()?.port();
            // On standard error, so that --json output stays one object; a script that
            // passes -p 0 reads the port from here.
            eprintln!(
                "pingpong: waiting for a client on TCP port {port} (for {} s)",
                args.timeout
            );
            let mut link = TcpLink::accept(&listener, timeout, timeout, || Ok(()))?;
            drop(listener);
            over_tcp(Role::Server, &device, &cfg, &mut link)?;
            let served = Served {
                mode: "server",
                transport: cfg.transport,
                device: device.name().into(),
                size: cfg.size as u64,
                iterations: cfg.iters,
                peer: link.peer().to_string(),
            };
            let text = if args.json {
                format!("{}\n", serde_json::to_string(&served)?)
            } else {
                served.text()
            };
            return crate::write_stdout(&text);
        }
    };
    let text = if args.json {
        let mut s = serde_json::to_string(&report)?;
        s.push('\n');
        s
    } else {
        report.text()
    };
    crate::write_stdout(&text)
}

// ---------------------------------------------------------------------------------------------
// The out-of-band protocol: how the two ends swap addresses and synchronise.

/// What one end tells the other: its QP address and the run parameters (to catch two ends
/// started with different options).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct WireEndpoint {
    qpn: u32,
    psn: u32,
    lid: u16,
    /// GID in rdma-core's text form (also valid IPv6 text).
    gid: String,
    transport: Transport,
    size: u64,
    iters: u64,
}

/// The messages of the out-of-band protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
enum Wire {
    /// "This is my QP."
    Endpoint(WireEndpoint),
    /// "My receives are posted" (before the first message) / "I am done" (after the last).
    Ready,
    /// "I stop because of this" (TCP modes: sent by an end that fails, so the other end can
    /// report the cause).
    Error { error: String },
}

fn send_wire(link: &mut dyn OobLink, msg: &Wire) -> Result<()> {
    link.send(serde_json::to_string(msg)?)
}

fn recv_wire(link: &mut dyn OobLink) -> Result<Wire> {
    let text = link.recv()?;
    match serde_json::from_str(&text) {
        Ok(Wire::Error { error }) => Err(PeerError(error).into()),
        Ok(w) => Ok(w),
        Err(e) => Err(format!("bad message from the peer ({e}): {text}").into()),
    }
}

/// Swaps endpoints with the peer and checks that both ends run the same test.
fn exchange(link: &mut dyn OobLink, cfg: &Config, local: &Endpoint) -> Result<Endpoint> {
    let mine = WireEndpoint {
        qpn: local.qpn,
        psn: local.psn,
        lid: local.lid,
        gid: local.gid.to_string(),
        transport: cfg.transport,
        size: cfg.size as u64,
        iters: cfg.iters,
    };
    send_wire(link, &Wire::Endpoint(mine))?;
    let Wire::Endpoint(theirs) = recv_wire(link)? else {
        return Err("the peer sent `ready` before its address".into());
    };
    let settings = |t: Transport, size: u64, iters: u64| {
        format!(
            "--transport {} -s {size} -n {iters}",
            t.label().to_lowercase()
        )
    };
    let (ours, peers) = (
        settings(cfg.transport, cfg.size as u64, cfg.iters),
        settings(theirs.transport, theirs.size, theirs.iters),
    );
    if ours != peers {
        return Err(format!(
            "the two ends run different tests: this end {ours}, the other end {peers}; \
             start both with the same --transport, -s and -n"
        )
        .into());
    }
    let gid = theirs
        .gid
        .parse()
        .map_err(|_| format!("the peer sent a bad GID `{}`", theirs.gid))?;
    Ok(Endpoint {
        qpn: theirs.qpn,
        psn: theirs.psn,
        lid: theirs.lid,
        gid,
    })
}

/// Waits until the peer reaches the same point.
fn barrier(link: &mut dyn OobLink) -> Result<()> {
    send_wire(link, &Wire::Ready)?;
    match recv_wire(link)? {
        Wire::Ready => Ok(()),
        other => Err(format!("expected `ready` from the peer, got {other:?}").into()),
    }
}

// ---------------------------------------------------------------------------------------------
// One end of the ping-pong.

/// Who starts each exchange (and measures it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Sends a ping, waits for the pong.
    Client,
    /// Waits for a ping, answers with a pong.
    Server,
}

/// Direction tags of the payload pattern.
const PING: u8 = 0;
const PONG: u8 = 1;

/// What the client measured.
struct Stats {
    rtt_ns: Histogram<u64>,
    elapsed: Duration,
    /// Receive-completion timestamp deltas (`--ts`).
    recv_ts: Option<TsDeltas>,
}

/// Deltas between the timestamps of consecutive receive completions, as `ibv_rc_pingpong -t`
/// gathers them.
#[derive(Debug, Clone)]
struct TsDeltas {
    clock: DeviceClock,
    prev: Option<u64>,
    min: u64,
    max: u64,
    total: u128,
    count: u64,
}

impl TsDeltas {
    fn new(clock: DeviceClock) -> TsDeltas {
        TsDeltas {
            clock,
            prev: None,
            min: u64::MAX,
            max: 0,
            total: 0,
            count: 0,
        }
    }

    /// Adds the raw timestamp of the next receive completion.
    fn record(&mut self, ts: u64) {
        if let Some(prev) = self.prev {
            // Wrap-aware: the clock counts up to its mask, then starts again at 0.
            let delta = self.clock.delta(prev, ts);
            self.min = self.min.min(delta);
            self.max = self.max.max(delta);
            self.total += u128::from(delta);
            self.count += 1;
        }
        self.prev = Some(ts);
    }

    /// The figures, or `None` before two receive completions.
    fn summary(&self) -> Option<TsSummary> {
        if self.count == 0 {
            return None;
        }
        let avg = self.total as f64 / self.count as f64;
        let ns = |cycles: f64| {
            if self.clock.khz == 0 {
                0.0
            } else {
                cycles * 1e6 / self.clock.khz as f64
            }
        };
        Some(TsSummary {
            deltas: self.count,
            completion_timestamp_mask: self.clock.mask,
            hca_core_clock_khz: self.clock.khz,
            max_cycles: self.max,
            min_cycles: self.min,
            avg_cycles: avg,
            max_ns: ns(self.max as f64),
            min_ns: ns(self.min as f64),
            avg_ns: ns(avg),
        })
    }
}

/// Receive-completion timestamp statistics, as `--json` prints them.
#[derive(Debug, Clone, Serialize)]
struct TsSummary {
    /// Deltas measured (receive completions - 1).
    deltas: u64,
    completion_timestamp_mask: u64,
    hca_core_clock_khz: u64,
    max_cycles: u64,
    min_cycles: u64,
    avg_cycles: f64,
    max_ns: f64,
    min_ns: f64,
    avg_ns: f64,
}

/// One end: its verbs objects and buffer layout. The memory region holds the send buffer
/// at offset 0, then `rx_depth` receive slots of `slot_len` bytes (on UD each slot starts
/// with the 40-byte GRH area).
struct End<'a> {
    cfg: &'a Config,
    abort: &'a AtomicBool,
    // Declared (and so dropped) QP first, then the AH, the memory, the CQ and the context.
    qp: QueuePair,
    ah: Option<AddressHandle>,
    remote_qpn: u32,
    psn: u32,
    mr: MemoryRegion<'static>,
    pd: softverbs::ProtectionDomain,
    cq: CompletionQueue,
    ctx: Context,
    slot_len: usize,
    grh: usize,
    sends_in_flight: u32,
    /// Receive completions polled while waiting for send completions.
    early: VecDeque<WorkCompletion>,
    got: Vec<u8>,
    want: Vec<u8>,
    /// Receive-completion timestamps (`--ts`).
    recv_ts: Option<TsDeltas>,
}

impl<'a> End<'a> {
    fn new(device: &Device, cfg: &'a Config, abort: &'a AtomicBool) -> Result<End<'a>> {
        let ctx = device.open()?;
        let recv_ts = if cfg.ts {
            let clock = ctx.clock();
            if clock.mask == 0 {
                return Err(
                    format!("--ts: {} isn't completion timestamp capable", device.name()).into(),
                );
            }
            Some(TsDeltas::new(clock))
        } else {
            None
        };
        let pd = ctx.alloc_pd()?;
        let depth = SQ_DEPTH + cfg.rx_depth as u32;
        // As ibv_rc_pingpong --ts does: only a CQ with the timestamp field is stamped.
        let cq = if cfg.ts {
            let flags = WcExFlags::STANDARD | WcExFlags::COMPLETION_TIMESTAMP;
            ctx.create_cq_ex(&CqInitAttrEx::new(depth).wc_flags(flags))?
        } else {
            ctx.create_cq(depth, None)?
        };
        let qp = pd.create_qp(&QpInitAttr {
            cap: QpCap {
                max_send_wr: SQ_DEPTH,
                max_recv_wr: cfg.rx_depth as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            ..QpInitAttr::new(cfg.transport.qp_type(), &cq, &cq)
        })?;
        let grh = if cfg.transport == Transport::Ud {
            GRH_LEN
        } else {
            0
        };
        let slot_len = grh + cfg.size;
        let total = slot_len
            .checked_mul(cfg.rx_depth)
            .and_then(|r| r.checked_add(cfg.size))
            .ok_or("message size too large")?;
        let mr = pd
            .alloc_mr(total.max(1), AccessFlags::LOCAL_WRITE)
            .map_err(|e| format!("registering {total} bytes: {e}"))?;
        // A random 24-bit starting PSN, as ibv_rc_pingpong picks one.
        let psn = (std::collections::hash_map::RandomState::new().hash_one(qp.qp_num()) & 0xff_ffff)
            as u32;
        if cfg.transport == Transport::Ud {
            qp.ready_ud(QKEY, psn)?;
        }
        Ok(End {
            cfg,
            abort,
            qp,
            ah: None,
            remote_qpn: 0,
            psn,
            mr,
            pd,
            cq,
            ctx,
            slot_len,
            grh,
            sends_in_flight: 0,
            early: VecDeque::new(),
            got: vec![0; cfg.size],
            want: vec![0; cfg.size],
            recv_ts,
        })
    }

    fn endpoint(&self) -> Result<Endpoint> {
        Ok(self.qp.endpoint(self.psn)?)
    }

    /// Connects to the peer (RC/UC: RESET to RTS; UD: an address handle) and posts the
    /// receive buffers.
    fn connect(&mut self, remote: &Endpoint) -> Result<()> {
        match self.cfg.transport {
            Transport::Rc | Transport::Uc => {
                self.qp.connect(remote, self.psn, AccessFlags::empty())?;
            }
            Transport::Ud => {
                let link = self.ctx.query_port(1)?.link_layer;
                self.ah = Some(self.pd.create_ah(&address_vector(link, remote))?);
            }
        }
        self.remote_qpn = remote.qpn;
        for slot in 0..self.cfg.rx_depth {
            self.post_recv(slot)?;
        }
        Ok(())
    }

    fn post_recv(&self, slot: usize) -> Result<()> {
        let start = self.cfg.size + slot * self.slot_len;
        let sge = [self.mr.sge(start..start + self.slot_len)];
        self.qp
            .post_recv([RecvWr::new(slot as u64, &sge)])
            .map_err(|e| format!("posting a receive: {e}"))?;
        Ok(())
    }

    /// Puts the payload of exchange `iter` in the send buffer (whose last send has completed).
    fn fill_send(&mut self, iter: u64, dir: u8) -> Result<()> {
        pattern(&mut self.want, iter, dir);
        self.mr.write_at(0, &self.want)?;
        Ok(())
    }

    fn post_send(&mut self, iter: u64) -> Result<()> {
        let sge = [self.mr.sge(0..self.cfg.size)];
        let mut wr = SendWr::new(SEND_TAG | iter, SendOp::Send, &sge).flags(SendFlags::SIGNALED);
        if let Some(ah) = &self.ah {
            wr = wr.ud(ah, self.remote_qpn, QKEY);
        }
        self.qp
            .post_send([wr])
            .map_err(|e| format!("posting send {iter}: {e}"))?;
        self.sends_in_flight += 1;
        Ok(())
    }

    /// Busy-polls the CQ for one successful completion.
    fn next_completion(&mut self) -> Result<WorkCompletion> {
        let mut wc = [WorkCompletion::default()];
        let mut spins = 0u32;
        let mut idle_since = None;
        loop {
            if self.cq.poll(&mut wc) == 1 {
                let wc = wc[0];
                if !wc.is_ok() {
                    let what = if wc.wr_id() & SEND_TAG != 0 {
                        format!("send {}", wc.wr_id() & !SEND_TAG)
                    } else {
                        format!("receive (slot {})", wc.wr_id())
                    };
                    return Err(format!(
                        "{} {what} completed with {:?} (vendor_err {})",
                        self.cfg.transport.label(),
                        wc.status(),
                        wc.vendor_err()
                    )
                    .into());
                }
                return Ok(wc);
            }
            spins = spins.wrapping_add(1);
            if spins % YIELD_EVERY != 0 {
                std::hint::spin_loop();
                continue;
            }
            // Let the peer's thread run if the CPUs are oversubscribed (when they are not,
            // sched_yield returns at once).
            std::thread::yield_now();
            if spins % CHECK_EVERY != 0 {
                continue;
            }
            if self.abort.load(Ordering::Relaxed) {
                return Err(PeerFailed.into());
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() > COMPLETION_TIMEOUT {
                return Err(format!(
                    "no completion for {} s ({} message lost?)",
                    COMPLETION_TIMEOUT.as_secs(),
                    self.cfg.transport.label()
                )
                .into());
            }
        }
    }

    /// Waits until every posted send has completed, so the send buffer may be rewritten.
    fn drain_sends(&mut self) -> Result<()> {
        while self.sends_in_flight > 0 {
            let wc = self.next_completion()?;
            if wc.wr_id() & SEND_TAG != 0 {
                self.sends_in_flight -= 1;
            } else {
                self.early.push_back(wc);
            }
        }
        Ok(())
    }

    /// The next receive completion.
    fn wait_recv(&mut self) -> Result<WorkCompletion> {
        if let Some(wc) = self.early.pop_front() {
            return Ok(wc);
        }
        loop {
            let wc = self.next_completion()?;
            if wc.wr_id() & SEND_TAG != 0 {
                self.sends_in_flight = self.sends_in_flight.saturating_sub(1);
            } else {
                return Ok(wc);
            }
        }
    }

    /// Checks a received message against the payload of exchange `iter`, then posts its
    /// buffer again.
    fn check_recv(&mut self, wc: &WorkCompletion, iter: u64, dir: u8) -> Result<()> {
        let name = if dir == PING { "ping" } else { "pong" };
        let slot = usize::try_from(wc.wr_id())
            .ok()
            .filter(|&s| s < self.cfg.rx_depth)
            .ok_or_else(|| format!("receive completion with unknown wr_id {:#x}", wc.wr_id()))?;
        let expected_len = self.grh + self.cfg.size;
        if wc.byte_len() as usize != expected_len {
            return Err(format!(
                "{name} {iter}: received {} bytes, expected {expected_len}",
                wc.byte_len()
            )
            .into());
        }
        if self.cfg.transport == Transport::Ud && wc.src_qp() != self.remote_qpn {
            return Err(format!(
                "{name} {iter}: came from QP {:#x}, expected {:#x}",
                wc.src_qp(),
                self.remote_qpn
            )
            .into());
        }
        let start = self.cfg.size + slot * self.slot_len + self.grh;
        self.mr.read_at(start, &mut self.got)?;
        pattern(&mut self.want, iter, dir);
        if self.got != self.want {
            let at = self
                .got
                .iter()
                .zip(&self.want)
                .position(|(g, w)| g != w)
                .unwrap_or(0);
            let mut msg = format!(
                "data mismatch in {name} {iter} at byte {at}: expected {:#04x}, got {:#04x}",
                self.want[at], self.got[at]
            );
            // A message in the other direction is this end's own: it was delivered back here.
            pattern(&mut self.want, iter, PING + PONG - dir);
            if self.cfg.size > 8 && self.got == self.want {
                msg.push_str(
                    " (this end's own message came back: the NIC delivered it to a QP of this \
                     process, not to the peer's)",
                );
            }
            return Err(msg.into());
        }
        self.post_recv(slot)
    }

    fn run_client(&mut self) -> Result<Stats> {
        // 1 ns .. 1 hour, 3 significant digits.
        let mut rtt_ns = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
            .map_err(|e| format!("histogram: {e}"))?;
        let start = Instant::now();
        for iter in 0..self.cfg.iters {
            self.drain_sends()?;
            self.fill_send(iter, PING)?;
            let t0 = Instant::now();
            self.post_send(iter)?;
            let wc = self.wait_recv()?;
            let rtt = t0.elapsed();
            if let Some(ts) = &mut self.recv_ts {
                ts.record(wc.timestamp());
            }
            rtt_ns.saturating_record(u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX).max(1));
            self.check_recv(&wc, iter, PONG)?;
        }
        self.drain_sends()?;
        Ok(Stats {
            rtt_ns,
            elapsed: start.elapsed(),
            recv_ts: self.recv_ts.clone(),
        })
    }

    fn run_server(&mut self) -> Result<()> {
        for iter in 0..self.cfg.iters {
            // Prepare the pong while the ping is on its way; check the ping after answering.
            self.drain_sends()?;
            self.fill_send(iter, PONG)?;
            let wc = self.wait_recv()?;
            self.post_send(iter)?;
            self.check_recv(&wc, iter, PING)?;
        }
        self.drain_sends()
    }
}

/// Fills `buf` with the payload of exchange `iter` in direction `dir`: the iteration number
/// (little-endian, as much of it as fits), then bytes that change with offset, iteration and
/// direction.
fn pattern(buf: &mut [u8], iter: u64, dir: u8) {
    let base = (iter as u8)
        .wrapping_mul(31)
        .wrapping_add(dir.wrapping_mul(101));
    for (j, b) in buf.iter_mut().enumerate() {
        *b = base.wrapping_add(j as u8).wrapping_add((j >> 8) as u8);
    }
    let header = iter.to_le_bytes();
    let n = buf.len().min(header.len());
    buf[..n].copy_from_slice(&header[..n]);
}

/// Everything one end does, from opening the device to the last exchange.
fn run_end(
    role: Role,
    device: &Device,
    cfg: &Config,
    link: &mut dyn OobLink,
    abort: &AtomicBool,
) -> Result<Option<Stats>> {
    let mut end = End::new(device, cfg, abort)?;
    let remote = exchange(link, cfg, &end.endpoint()?)?;
    end.connect(&remote)?;
    // Receives are posted on both ends before the first message (UC and UD drop messages
    // that find no receive).
    barrier(link)?;
    let stats = match role {
        Role::Client => Some(end.run_client()?),
        Role::Server => {
            end.run_server()?;
            None
        }
    };
    // Neither end tears down while the other may still be using its QP.
    barrier(link)?;
    Ok(stats)
}

/// A thread's outcome: the client's measurements, or `None` from the server.
type EndResult = Result<Option<Stats>>;

/// Starts one end on its own thread.
fn spawn_end<'scope, 'env>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    role: Role,
    device: &'env Device,
    cfg: &'env Config,
    mut link: ChannelLink,
    abort: &'env AtomicBool,
) -> std::io::Result<std::thread::ScopedJoinHandle<'scope, EndResult>> {
    let name = match role {
        Role::Client => "pingpong-client",
        Role::Server => "pingpong-server",
    };
    let body = move || {
        let r = run_end(role, device, cfg, &mut link, abort);
        if r.is_err() {
            abort.store(true, Ordering::Relaxed);
        }
        // Dropping the link tells a peer blocked on it that this end is gone.
        drop(link);
        r
    };
    // If the thread cannot start, `body` (and with it the link) is dropped, so the peer
    // stops too.
    std::thread::Builder::new()
        .name(name.into())
        .spawn_scoped(s, body)
}

/// Runs both ends in this process, each on its own thread.
fn loopback(device: &Device, cfg: &Config) -> Result<Stats> {
    let abort = AtomicBool::new(false);
    let (client_link, server_link) = ChannelLink::pair(LINK_TIMEOUT);
    let (client, server) = std::thread::scope(|s| {
        let server = spawn_end(s, Role::Server, device, cfg, server_link, &abort);
        let client = spawn_end(s, Role::Client, device, cfg, client_link, &abort);
        let join = |h: std::io::Result<std::thread::ScopedJoinHandle<'_, EndResult>>,
                    who: &str|
         -> EndResult {
            match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(format!("the {who} thread panicked").into())),
                Err(e) => Err(format!("cannot start the {who} thread: {e}").into()),
            }
        };
        (join(client, "client"), join(server, "server"))
    });
    match (client, server) {
        (Ok(Some(stats)), Ok(_)) => Ok(stats),
        (Ok(None), Ok(_)) => Err("the client produced no measurements".into()),
        // Report the end that failed first, not the one that stopped because of it.
        (Err(c), Err(s)) if c.is::<PeerFailed>() => Err(format!("server: {s}").into()),
        (Err(c), _) => Err(format!("client: {c}").into()),
        (Ok(_), Err(s)) => Err(format!("server: {s}").into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Two processes, joined by TCP.

/// Runs one end against a peer in another process (or host), joined by `link`. An end that
/// fails tells its peer why before it closes the link; the peer stops within moments (it
/// watches the link while the RDMA traffic runs) and reports that cause.
fn over_tcp(
    role: Role,
    device: &Device,
    cfg: &Config,
    link: &mut TcpLink,
) -> Result<Option<Stats>> {
    let peer = match role {
        Role::Client => "the server",
        Role::Server => "the client",
    };
    let watch = link.stream_clone()?;
    let abort = AtomicBool::new(false);
    let done = AtomicBool::new(false);
    let result = std::thread::scope(|s| {
        let watcher = std::thread::Builder::new()
            .name("pingpong-watch".into())
            .spawn_scoped(s, || watch_for_failure(&watch, &abort, &done, WATCH_EVERY));
        let r = run_end(role, device, cfg, link, &abort);
        done.store(true, Ordering::Relaxed);
        if let Ok(w) = watcher {
            let _ = w.join();
        }
        r
    });
    let err = match result {
        Ok(stats) => return Ok(stats),
        Err(e) => e,
    };
    if err.is::<PeerError>() {
        return Err(format!("{peer} failed: {err}").into());
    }
    if !err.is::<PeerFailed>() {
        // Our own failure: tell the peer (best effort; it may be gone already).
        let _ = send_wire(
            link,
            &Wire::Error {
                error: err.to_string(),
            },
        );
        return Err(err);
    }
    // The peer stopped first: find out why, if it said (skipping messages that were
    // already on their way, such as its `ready`).
    for _ in 0..4 {
        match recv_wire(link) {
            Ok(_) => continue,
            Err(e) if e.is::<PeerError>() => return Err(format!("{peer} failed: {e}").into()),
            Err(_) => break,
        }
    }
    Err(format!("{peer} closed the connection without saying why (did it crash?)").into())
}

/// What the server prints: the client's end has the measurements.
#[derive(Debug, Serialize)]
struct Served {
    mode: &'static str,
    transport: Transport,
    device: String,
    size: u64,
    iterations: u64,
    /// The client's address.
    peer: String,
}

impl Served {
    fn text(&self) -> String {
        format!(
            "pingpong: served {iters} {transport} SEND/RECV round trips of {size} bytes on \
             {device} to {peer} (data checked; the client reports the figures)\n",
            iters = self.iterations,
            transport = self.transport.label(),
            size = self.size,
            device = self.device,
            peer = self.peer,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Results.

/// Where the two ends ran.
enum Mode {
    /// Two threads of this process.
    Loopback,
    /// This process is the client of the server at the given place.
    Client(String),
}

/// The results, as `--json` prints them.
#[derive(Debug, Serialize)]
struct Report {
    transport: Transport,
    device: String,
    mode: &'static str,
    /// The server (client mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    server: Option<String>,
    size: u64,
    iterations: u64,
    /// Payload bytes moved in both directions.
    bytes: u64,
    elapsed_s: f64,
    /// 10^6 bytes per second.
    bandwidth_mb_s: f64,
    /// 10^9 bits per second.
    bandwidth_gb_s: f64,
    rtt_min_us: f64,
    rtt_mean_us: f64,
    rtt_p50_us: f64,
    rtt_p99_us: f64,
    rtt_max_us: f64,
    half_rtt_p50_us: f64,
    half_rtt_p99_us: f64,
    half_rtt_max_us: f64,
    /// Receive-completion timestamp deltas (`--ts`, from the second receive on).
    #[serde(skip_serializing_if = "Option::is_none")]
    recv_completion_ts: Option<TsSummary>,
    /// `--ts` was given.
    #[serde(skip)]
    ts: bool,
}

impl Report {
    fn new(cfg: &Config, device: &str, mode: Mode, stats: &Stats) -> Report {
        let bytes = 2 * cfg.size as u64 * cfg.iters;
        let secs = stats.elapsed.as_secs_f64().max(1e-9);
        let us = |ns: u64| ns as f64 / 1000.0;
        let h = &stats.rtt_ns;
        let p50 = us(h.value_at_quantile(0.50));
        let p99 = us(h.value_at_quantile(0.99));
        let max = us(h.max());
        Report {
            transport: cfg.transport,
            device: device.into(),
            mode: match mode {
                Mode::Loopback => "loopback",
                Mode::Client(_) => "client",
            },
            server: match mode {
                Mode::Loopback => None,
                Mode::Client(server) => Some(server),
            },
            size: cfg.size as u64,
            iterations: cfg.iters,
            bytes,
            elapsed_s: secs,
            bandwidth_mb_s: bytes as f64 / secs / 1e6,
            bandwidth_gb_s: bytes as f64 * 8.0 / secs / 1e9,
            rtt_min_us: us(h.min()),
            rtt_mean_us: h.mean() / 1000.0,
            rtt_p50_us: p50,
            rtt_p99_us: p99,
            rtt_max_us: max,
            half_rtt_p50_us: p50 / 2.0,
            half_rtt_p99_us: p99 / 2.0,
            half_rtt_max_us: max / 2.0,
            recv_completion_ts: stats.recv_ts.as_ref().and_then(TsDeltas::summary),
            ts: cfg.ts,
        }
    }

    fn text(&self) -> String {
        let mut text = format!(
            "pingpong: {transport} SEND/RECV on {device}, {mode}\n\
             \x20 transport:   {transport}\n\
             \x20 size:        {size} bytes\n\
             \x20 iterations:  {iters} round trips, {bytes} bytes in {elapsed} (data checked)\n\
             \x20 bandwidth:   {mbs:.2} MB/s = {gbs:.3} Gb/s (both directions)\n\
             \x20 round trip:  p50 {p50:.2} µs   p99 {p99:.2} µs   max {max:.2} µs\n\
             \x20 half RTT:    p50 {hp50:.2} µs   p99 {hp99:.2} µs   max {hmax:.2} µs\n",
            transport = self.transport.label(),
            device = self.device,
            mode = match &self.server {
                None => "loopback (two threads)".to_string(),
                Some(server) => format!("client of {server} (two processes)"),
            },
            size = self.size,
            iters = self.iterations,
            bytes = self.bytes,
            elapsed = if self.elapsed_s < 1.0 {
                format!("{:.3} ms", self.elapsed_s * 1e3)
            } else {
                format!("{:.3} s", self.elapsed_s)
            },
            mbs = self.bandwidth_mb_s,
            gbs = self.bandwidth_gb_s,
            p50 = self.rtt_p50_us,
            p99 = self.rtt_p99_us,
            max = self.rtt_max_us,
            hp50 = self.half_rtt_p50_us,
            hp99 = self.half_rtt_p99_us,
            hmax = self.half_rtt_max_us,
        );
        match &self.recv_completion_ts {
            Some(ts) => text.push_str(&format!(
                "\x20 receive completion deltas ({n}, clock {khz} kHz, mask {mask:#x}):\n\
                 \x20   Max receive completion clock cycles = {max} ({max_ns:.0} ns)\n\
                 \x20   Min receive completion clock cycles = {min} ({min_ns:.0} ns)\n\
                 \x20   Average receive completion clock cycles = {avg:.2} ({avg_ns:.1} ns)\n",
                n = ts.deltas,
                khz = ts.hca_core_clock_khz,
                mask = ts.completion_timestamp_mask,
                max = ts.max_cycles,
                max_ns = ts.max_ns,
                min = ts.min_cycles,
                min_ns = ts.min_ns,
                avg = ts.avg_cycles,
                avg_ns = ts.avg_ns,
            )),
            None if self.ts => text.push_str(
                "\x20 receive completion deltas: none (fewer than two receive completions)\n",
            ),
            None => {}
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(transport: Transport, size: usize) -> Config {
        Config {
            transport,
            size,
            iters: 200,
            rx_depth: 4,
            ts: false,
        }
    }

    #[test]
    fn every_transport_round_trips() {
        let dev = crate::find_device(None).unwrap();
        for (t, size) in [
            (Transport::Rc, 4096),
            (Transport::Uc, 100),
            (Transport::Ud, 4096),
            (Transport::Rc, 0),
            (Transport::Rc, 3),
        ] {
            let stats = loopback(&dev, &cfg(t, size)).unwrap();
            assert_eq!(stats.rtt_ns.len(), 200, "{t:?}");
        }
    }

    /// Two ends connected directly, without the link or threads.
    fn pair<'a>(ca: &'a Config, cb: &'a Config, abort: &'a AtomicBool) -> (End<'a>, End<'a>) {
        let dev = crate::find_device(None).unwrap();
        let mut a = End::new(&dev, ca, abort).unwrap();
        let mut b = End::new(&dev, cb, abort).unwrap();
        let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
        a.connect(&eb).unwrap();
        b.connect(&ea).unwrap();
        (a, b)
    }

    #[test]
    fn corrupted_payload_is_detected() {
        let abort = AtomicBool::new(false);
        let c = cfg(Transport::Rc, 64);
        let (mut a, mut b) = pair(&c, &c, &abort);
        a.fill_send(0, PING).unwrap();
        a.post_send(0).unwrap();
        let wc = b.wait_recv().unwrap();
        // The payload of exchange 0 checked as exchange 1.
        let err = b.check_recv(&wc, 1, PING).unwrap_err().to_string();
        assert!(err.contains("data mismatch in ping 1 at byte 0"), "{err}");
        assert!(!err.contains("own message"), "{err}");
        // A ping where a pong is due: named as this end's own message.
        a.fill_send(1, PING).unwrap();
        a.post_send(1).unwrap();
        let wc = b.wait_recv().unwrap();
        let err = b.check_recv(&wc, 1, PONG).unwrap_err().to_string();
        assert!(err.contains("own message came back"), "{err}");
    }

    #[test]
    fn error_completions_are_errors() {
        let abort = AtomicBool::new(false);
        let (big, small) = (cfg(Transport::Rc, 64), cfg(Transport::Rc, 32));
        let (mut a, mut b) = pair(&big, &small, &abort);
        a.fill_send(0, PING).unwrap();
        a.post_send(0).unwrap();
        let err = a.drain_sends().unwrap_err().to_string();
        assert!(err.contains("send 0 completed with RemInvReqErr"), "{err}");
        let err = b.wait_recv().unwrap_err().to_string();
        assert!(err.contains("LocLenErr"), "{err}");
    }

    #[test]
    fn a_stopped_peer_stops_the_wait() {
        let abort = AtomicBool::new(false);
        let c = cfg(Transport::Uc, 8);
        let (_a, mut b) = pair(&c, &c, &abort);
        abort.store(true, Ordering::Relaxed);
        assert!(b.wait_recv().unwrap_err().is::<PeerFailed>());
    }

    #[test]
    fn patterns_differ_by_iteration_and_direction() {
        let (mut a, mut b, mut c) = (vec![0; 300], vec![0; 300], vec![0; 300]);
        pattern(&mut a, 5, PING);
        pattern(&mut b, 6, PING);
        pattern(&mut c, 5, PONG);
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_ne!(a[8..], b[8..]);
    }

    #[test]
    fn wire_messages_round_trip() {
        let (mut x, mut y) = ChannelLink::pair(LINK_TIMEOUT);
        let c = cfg(Transport::Ud, 64);
        let ep = Endpoint {
            qpn: 0x42,
            psn: 7,
            lid: 0,
            gid: "::ffff:127.0.0.1".parse().unwrap(),
        };
        let t = std::thread::spawn(move || exchange(&mut y, &c, &ep).unwrap());
        let got = exchange(&mut x, &cfg(Transport::Ud, 64), &ep).unwrap();
        assert_eq!(got, ep);
        assert_eq!(t.join().unwrap(), ep);
    }

    #[test]
    fn mismatched_ends_are_refused() {
        let (mut x, mut y) = ChannelLink::pair(LINK_TIMEOUT);
        let ep = Endpoint {
            qpn: 1,
            psn: 0,
            lid: 0,
            gid: Default::default(),
        };
        let t = std::thread::spawn(move || exchange(&mut y, &cfg(Transport::Rc, 8), &ep));
        assert!(exchange(&mut x, &cfg(Transport::Rc, 16), &ep).is_err());
        assert!(t.join().unwrap().is_err());
    }

    /// A server and a client link over TCP on 127.0.0.1 (an ephemeral port), one per thread.
    fn tcp_pair() -> (TcpLink, TcpLink) {
        let t = Duration::from_secs(10);
        let listener = TcpLink::listen(([127, 0, 0, 1], 0).into()).unwrap();
        let port = listener.local_addr().unwrap().port();
        let client = std::thread::spawn(move || TcpLink::connect("127.0.0.1", port, t, t));
        let server = TcpLink::accept(&listener, t, t, || Ok(())).unwrap();
        (server, client.join().unwrap().unwrap())
    }

    #[test]
    fn tcp_link_exchanges_endpoints_and_refuses_mismatches() {
        let ep = |qpn| Endpoint {
            qpn,
            psn: 0x123456,
            lid: 3,
            gid: "::ffff:127.0.0.1".parse().unwrap(),
        };
        // Same settings: each end learns the other's endpoint.
        let (mut s, mut c) = tcp_pair();
        let t = std::thread::spawn(move || exchange(&mut c, &cfg(Transport::Uc, 64), &ep(2)));
        assert_eq!(
            exchange(&mut s, &cfg(Transport::Uc, 64), &ep(1)).unwrap(),
            ep(2)
        );
        assert_eq!(t.join().unwrap().unwrap(), ep(1));

        // Different transport, size or iterations: both ends refuse, naming both settings.
        let mut other_iters = cfg(Transport::Rc, 64);
        other_iters.iters = 7;
        for theirs in [cfg(Transport::Ud, 64), cfg(Transport::Rc, 32), other_iters] {
            let (mut s, mut c) = tcp_pair();
            let t = std::thread::spawn(move || exchange(&mut c, &theirs, &ep(2)));
            let mine = exchange(&mut s, &cfg(Transport::Rc, 64), &ep(1));
            let theirs = t.join().unwrap();
            for err in [mine.unwrap_err(), theirs.unwrap_err()] {
                let err = err.to_string();
                assert!(err.contains("the two ends run different tests"), "{err}");
                assert!(err.contains("--transport rc -s 64 -n 200"), "{err}");
            }
        }
    }

    #[test]
    fn ts_deltas_handle_wrap_around() {
        let mut d = TsDeltas::new(DeviceClock {
            mask: 0xffff,
            khz: 500_000,
        });
        assert!(d.summary().is_none());
        for ts in [0xfff0, 0x0010, 0x0050, 0x0058] {
            d.record(ts);
        }
        let s = d.summary().unwrap();
        assert_eq!((s.deltas, s.min_cycles, s.max_cycles), (3, 8, 0x40));
        assert_eq!(s.avg_cycles, (0x20 + 0x40 + 8) as f64 / 3.0);
        // 500,000 kHz: two nanoseconds per cycle.
        assert_eq!((s.min_ns, s.max_ns), (16.0, 128.0));
    }

    #[test]
    fn ts_over_tcp_reports_the_clients_receive_deltas() {
        let dev = crate::find_device(None).unwrap();
        let c = Config {
            ts: true,
            ..cfg(Transport::Rc, 64)
        };
        let (mut s, mut cl) = tcp_pair();
        let stats = std::thread::scope(|sc| {
            let server = sc.spawn(|| over_tcp(Role::Server, &dev, &c, &mut s));
            let stats = over_tcp(Role::Client, &dev, &c, &mut cl);
            server.join().unwrap().unwrap();
            stats.unwrap().unwrap()
        });
        let ts = stats.recv_ts.unwrap().summary().unwrap();
        assert_eq!(ts.deltas, 199);
        assert!(0 < ts.min_cycles && ts.min_cycles <= ts.max_cycles);
    }

    #[test]
    fn whole_runs_over_tcp() {
        let dev = crate::find_device(None).unwrap();
        for t in [Transport::Rc, Transport::Uc, Transport::Ud] {
            let c = cfg(t, 256);
            let (mut s, mut cl) = tcp_pair();
            let (stats, served) = std::thread::scope(|sc| {
                let server = sc.spawn(|| over_tcp(Role::Server, &dev, &c, &mut s));
                let stats = over_tcp(Role::Client, &dev, &c, &mut cl);
                (stats, server.join().unwrap())
            });
            assert_eq!(stats.unwrap().unwrap().rtt_ns.len(), 200, "{t:?}");
            assert!(served.unwrap().is_none());
        }
    }

    #[test]
    fn a_failing_peer_stops_the_run_with_its_reason() {
        let dev = crate::find_device(None).unwrap();
        let c = cfg(Transport::Rc, 64);
        for say_why in [true, false] {
            let (mut s, mut cl) = tcp_pair();
            let t0 = Instant::now();
            let client = std::thread::scope(|sc| {
                // A server that connects, then fails instead of answering the first ping.
                sc.spawn(|| {
                    let abort = AtomicBool::new(false);
                    let mut end = End::new(&dev, &c, &abort).unwrap();
                    let remote = exchange(&mut s, &c, &end.endpoint().unwrap()).unwrap();
                    end.connect(&remote).unwrap();
                    barrier(&mut s).unwrap();
                    end.wait_recv().unwrap();
                    if say_why {
                        let error = "injected failure".to_string();
                        send_wire(&mut s, &Wire::Error { error }).unwrap();
                    }
                    drop(s);
                });
                over_tcp(Role::Client, &dev, &c, &mut cl)
            });
            let err = client.err().unwrap().to_string();
            let want = if say_why {
                "the server failed: injected failure"
            } else {
                "the server closed the connection without saying why"
            };
            assert_eq!(
                err,
                if say_why {
                    want.to_string()
                } else {
                    format!("{want} (did it crash?)")
                }
            );
            // The watcher noticed at once, not after the completion time-out.
            assert!(
                t0.elapsed() < COMPLETION_TIMEOUT / 2,
                "took {:?}",
                t0.elapsed()
            );
        }
    }
}
