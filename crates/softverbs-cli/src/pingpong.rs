//! `softverbs pingpong`: SEND/RECV ping-pong between two queue pairs, measuring round-trip
//! latency and bandwidth, and checking every byte.
//!
//! The two ends are written as they would be in two processes: each opens its own context,
//! creates its PD, CQ, QP and memory region, and learns its peer's address ([`Endpoint`]) only
//! through an out-of-band [`OobLink`] that carries one JSON message at a time. `--loopback`
//! runs both ends in this process, one thread each, joined by an in-memory link. The TCP mode
//! (server and client in different processes or hosts) will implement [`OobLink`] over a
//! socket; nothing else needs to change.

use crate::Result;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use softverbs::{
    AccessFlags, AddressHandle, CompletionQueue, Context, Device, Endpoint, GRH_LEN, MemoryRegion,
    QpCap, QpInitAttr, QpType, QueuePair, RecvWr, SendFlags, SendOp, SendWr, WorkCompletion,
    address_vector,
};
use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
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
/// How long to wait for a message from the peer on the out-of-band link.
const LINK_TIMEOUT: Duration = Duration::from_secs(30);
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
    /// Run both ends in this process, one thread each (the only mode for now).
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
    /// Server to connect to (TCP client mode; not implemented yet).
    #[arg(value_name = "SERVER", conflicts_with = "loopback")]
    server: Option<String>,
    /// TCP port for the address exchange (TCP mode; not implemented yet).
    #[arg(short = 'p', long, default_value_t = 18515)]
    port: u16,
}

/// The validated parameters of a run.
#[derive(Debug, Clone)]
struct Config {
    transport: Transport,
    size: usize,
    iters: u64,
    /// Receive buffers each end keeps posted.
    rx_depth: usize,
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
        Ok(Config {
            transport: args.transport,
            size,
            iters: args.iters,
            // Two posted receives are enough for a strict ping-pong (the next message can
            // arrive while the last one is still being checked); keep a few more when cheap.
            rx_depth: if size <= 1 << 20 { 4 } else { 2 },
        })
    }
}

pub fn run(args: &Args) -> Result<()> {
    if !args.loopback {
        let mode = match &args.server {
            Some(host) => format!(
                "client mode (connecting to {host} on TCP port {})",
                args.port
            ),
            None => format!("server mode (listening on TCP port {})", args.port),
        };
        return Err(format!("pingpong {mode} is not implemented yet: use --loopback").into());
    }
    let device = crate::find_device(args.device.as_deref())?;
    let cfg = Config::new(args, &device)?;
    let stats = loopback(&device, &cfg)?;
    let report = Report::new(&cfg, device.name(), &stats);
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
// The out-of-band link: how the two ends swap addresses and synchronise.

/// Carries whole messages (one JSON document each) between the two ends, in order.
/// Loopback uses [`ChannelLink`]; the TCP mode will send newline-terminated lines.
trait OobLink {
    fn send(&mut self, msg: String) -> Result<()>;
    fn recv(&mut self) -> Result<String>;
}

/// One end of an in-process link.
struct ChannelLink {
    tx: mpsc::Sender<String>,
    rx: mpsc::Receiver<String>,
}

impl ChannelLink {
    fn pair() -> (ChannelLink, ChannelLink) {
        let (a_tx, b_rx) = mpsc::channel();
        let (b_tx, a_rx) = mpsc::channel();
        (
            ChannelLink { tx: a_tx, rx: a_rx },
            ChannelLink { tx: b_tx, rx: b_rx },
        )
    }
}

impl OobLink for ChannelLink {
    fn send(&mut self, msg: String) -> Result<()> {
        self.tx.send(msg).map_err(|_| PeerFailed.into())
    }

    fn recv(&mut self) -> Result<String> {
        match self.rx.recv_timeout(LINK_TIMEOUT) {
            Ok(m) => Ok(m),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(PeerFailed.into()),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(format!("the peer sent nothing for {} s", LINK_TIMEOUT.as_secs()).into())
            }
        }
    }
}

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
}

/// The messages of the out-of-band protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
enum Wire {
    /// "This is my QP."
    Endpoint(WireEndpoint),
    /// "My receives are posted" (before the first message) / "I am done" (after the last).
    Ready,
}

fn send_wire(link: &mut dyn OobLink, msg: &Wire) -> Result<()> {
    link.send(serde_json::to_string(msg)?)
}

fn recv_wire(link: &mut dyn OobLink) -> Result<Wire> {
    let text = link.recv()?;
    serde_json::from_str(&text)
        .map_err(|e| format!("bad message from the peer ({e}): {text}").into())
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
    };
    send_wire(link, &Wire::Endpoint(mine))?;
    let Wire::Endpoint(theirs) = recv_wire(link)? else {
        return Err("the peer sent `ready` before its address".into());
    };
    if theirs.transport != cfg.transport || theirs.size != cfg.size as u64 {
        return Err(format!(
            "the peer runs {} with {} bytes, this end {} with {} bytes",
            theirs.transport.label(),
            theirs.size,
            cfg.transport.label(),
            cfg.size
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

/// The error of an end whose peer failed first: the peer's error is the one to report.
#[derive(Debug)]
struct PeerFailed;

impl std::fmt::Display for PeerFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the other end stopped")
    }
}

impl std::error::Error for PeerFailed {}

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
}

impl<'a> End<'a> {
    fn new(device: &Device, cfg: &'a Config, abort: &'a AtomicBool) -> Result<End<'a>> {
        let ctx = device.open()?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(SQ_DEPTH + cfg.rx_depth as u32, None)?;
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
            return Err(format!(
                "data mismatch in {name} {iter} at byte {at}: expected {:#04x}, got {:#04x}",
                self.want[at], self.got[at]
            )
            .into());
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
            rtt_ns.saturating_record(u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX).max(1));
            self.check_recv(&wc, iter, PONG)?;
        }
        self.drain_sends()?;
        Ok(Stats {
            rtt_ns,
            elapsed: start.elapsed(),
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
    let (client_link, server_link) = ChannelLink::pair();
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
// Results.

/// The results, as `--json` prints them.
#[derive(Debug, Serialize)]
struct Report {
    transport: Transport,
    device: String,
    mode: &'static str,
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
}

impl Report {
    fn new(cfg: &Config, device: &str, stats: &Stats) -> Report {
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
            mode: "loopback",
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
        }
    }

    fn text(&self) -> String {
        format!(
            "pingpong: {transport} SEND/RECV on {device}, loopback (two threads)\n\
             \x20 transport:   {transport}\n\
             \x20 size:        {size} bytes\n\
             \x20 iterations:  {iters} round trips, {bytes} bytes in {elapsed} (data checked)\n\
             \x20 bandwidth:   {mbs:.2} MB/s = {gbs:.3} Gb/s (both directions)\n\
             \x20 round trip:  p50 {p50:.2} µs   p99 {p99:.2} µs   max {max:.2} µs\n\
             \x20 half RTT:    p50 {hp50:.2} µs   p99 {hp99:.2} µs   max {hmax:.2} µs\n",
            transport = self.transport.label(),
            device = self.device,
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
        )
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
        let (mut x, mut y) = ChannelLink::pair();
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
        let (mut x, mut y) = ChannelLink::pair();
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
}
