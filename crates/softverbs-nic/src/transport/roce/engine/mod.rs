//! The host engine: the process that owns UDP port 4791 of a networked device's addresses and
//! acts as the host's RoCE NIC for every process that uses the device.
//!
//! RoCEv2 packets reach a host on one port whatever process they are for, and a one-sided
//! operation must land while its target only spins on its memory. So one engine per address
//! (per network namespace: its Unix socket name is abstract, and abstract names are per
//! namespace) serves every QP of the device on the host: it maps each QP's device memory
//! (context, receive queue, CQs, key table; already in shared memory) as the same-host
//! transport maps a peer's ([`RemoteQp`]), runs the RoCE transport core
//! ([`softverbs_roce::endpoint::Endpoint`]) over it, takes send WQEs from each QP's send
//! ring, places arriving data with every key checked ([`memory`]), answers ACKs and READs,
//! and pushes completions into the owners' CQs.
//!
//! It is started by the first process that creates a QP on the device ([`start`]: the
//! `softverbs engine` executable, in a process group of its own; [`serve`] is its body) and
//! stops a moment after its last client leaves. A client's QPs go with its connection (a dead
//! process's QPs are dropped, and their peers' requests go unanswered until they give up with
//! `RETRY_EXC_ERR`); a client whose engine dies sees its connection close and errors out every
//! QP it had on it. The engine sleeps in `poll(2)` when idle, with a doorbell that clients
//! ring only while it sleeps, and spins a while after work only on machines with cores to
//! spare.
//!
//! It is also the host's GSI ([`gsi`]): packets to QP1 never reach the transport core but
//! carry the connection-manager MADs of the host's CM agents, which meet the engine on
//! abstract Unix datagram sockets.

mod faults;
pub(crate) mod gsi;
pub(crate) mod io;
pub(crate) mod lease;
pub(crate) mod memory;
mod outbox;

use super::protocol::{
    Chunk, Ctl, EngineState, NetWqe, Reply, WQE_FENCE, WQE_INLINE, WQE_SIGNALED, WQE_SOLICITED,
    Welcome, engine_name,
};
use crate::config::DeviceConfig;
use crate::config::net::ip_of;
use crate::cq::Cqe;
use crate::device_memory::doorbell::Doorbell;
use crate::device_memory::ring::Ring;
use crate::device_memory::segment::Segment;
use crate::mr::window::WindowBind;
use crate::qp::context::XrcRole;
use crate::qp::responder::Responder;
use crate::transport::same_host::RemoteQp;
use crate::types::{
    AccessFlags, AsyncEventType, Gid, WcFlags, WcOpcode as NicOp, WcStatus as NicStatus,
};
use crate::types::{Sge as NicSge, WrOpcode};
use faults::FaultInjector;
use io::{Capture, HEADROOM, Socket};
use memory::HostMemory;
use outbox::Outbox;
use rustc_hash::FxHashMap;
use rustix::event::{PollFd, PollFlags, poll};
use rustix::fd::{AsRawFd, OwnedFd};
use rustix::net::{
    AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType, accept_with,
    bind, listen, socket_with,
};
use softverbs_roce::Time;
use softverbs_roce::endpoint::Endpoint;
use softverbs_roce::transport::{
    Completion, Event, Memory, NetworkHeader, QpAccess, QpConfig, QpCounters, QpError, QpType,
    RecvWr, SendOp, SendWr, Sge, UdDest, WcOpcode, WcStatus,
};
use softverbs_roce::wire::{NakCode, Opcode, Psn};
use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

/// How long the engine keeps spinning after its last piece of work before it sleeps, unless
/// `SOFTVERBS_ENGINE_SPIN_US` says otherwise: on machines with few cores the programs that
/// use the engine busy-poll their CQs, and an engine spinning beside them takes the cores
/// they need (on 2 cores a 64-byte RC ping-pong between two namespaces took 53 µs a round
/// trip with no spin, 139 µs with 20 µs of spin, 475 µs with 200 µs, 3.2 ms with 1 ms).
fn default_spin() -> Duration {
    match std::thread::available_parallelism().map_or(1, |n| n.get()) {
        0..=4 => Duration::ZERO,
        _ => Duration::from_micros(50),
    }
}

/// How often a busy engine looks for control messages it was not woken for.
const CONTROL_EVERY: Duration = Duration::from_millis(1);

/// When leases are looked at again after a client went whose process still seemed alive
/// (its connection closes as it exits, a moment before it is dead).
const SOON_AFTER_A_CLIENT: Duration = Duration::from_millis(10);

/// The engine's nice value where it may raise its priority.
const ENGINE_NICE: libc::c_int = -10;

/// The environment variable that sets the engine's spin time in microseconds (0: sleep as
/// soon as idle), read by the process that starts the engine.
pub const ENV_ENGINE_SPIN: &str = "SOFTVERBS_ENGINE_SPIN_US";
/// How long it lingers with no client before it exits (a program that reopens the device at
/// once finds it still there).
const LINGER: Duration = Duration::from_millis(500);
/// WQEs taken from one send ring per turn, and datagrams read per socket per turn: enough to
/// batch, few enough that one busy QP does not starve the others.
const BATCH: usize = 64;

struct Client {
    sock: OwnedFd,
    pid: u32,
    qps: Vec<u32>,
}

/// A QP the engine serves.
struct EngineQp {
    remote: Arc<RemoteQp>,
    sq: Ring,
    owner: u32,
    tag: u32,
    sq_sig_all: bool,
    /// Send WQEs handed to the core, oldest first: (number, wr_id, signaled).
    wrs: VecDeque<(u32, u64, bool)>,
    /// Binds and local invalidations executed here, by number: their status and opcode,
    /// completed once every request before them has (completions stay in order).
    local_done: FxHashMap<u32, (NicStatus, NicOp)>,
    /// In the transport core (after RTR).
    live: bool,
    /// Its RTS was seen: the requester has its first PSN.
    ready: bool,
    /// Set when the program moved it to ERR (no async event for that).
    modified: bool,
}

/// Counters of what the engine dropped or injected besides what the endpoint counts.
#[derive(Default)]
struct Totals {
    /// Counters of QPs no longer served.
    gone: QpCounters,
    send_failures: u64,
    /// System calls that sent more than one datagram (GSO), and the datagrams in them.
    gso_sends: u64,
    gso_datagrams: u64,
    /// Reads that gave more than one datagram (GRO), and the datagrams in them.
    gro_reads: u64,
    gro_datagrams: u64,
    bad_wqes: u64,
    /// IP multicast groups the engine could not join.
    group_failures: u64,
    bad_messages: u64,
}

struct Engine {
    cfg: DeviceConfig,
    ifindex: u32,
    ep: Endpoint<HostMemory>,
    socks: Vec<Socket>,
    /// One socket per IP multicast group a QP here is attached to.
    groups: Vec<Socket>,
    listener: OwnedFd,
    clients: Vec<Client>,
    qps: FxHashMap<u32, EngineQp>,
    bell: Doorbell,
    state: Segment,
    faults: FaultInjector,
    capture: Option<Capture>,
    epoch: Instant,
    next_tag: u32,
    totals: Totals,
    /// QP1: the CM MADs of the host's agents ([`gsi`]).
    gsi: gsi::Gsi,
    rx: Vec<u8>,
    out: Outbox,
    items: Vec<NicSge>,
    started: Instant,
    spin: Duration,
    /// poll(2) saw a control message or a connection waiting.
    control_due: bool,
    /// The sockets (unicast, then groups) poll(2) saw readable when the engine woke: the
    /// others are not read on that turn (each empty read is a system call).
    readable: Vec<bool>,
    /// The last turn stopped short of all there was to do (a batch limit).
    more: bool,
    last_control: Instant,
}

/// The environment variable naming a file the engine appends its diagnostics to (it has no
/// terminal: it belongs to no one's session).
pub const ENV_ENGINE_LOG: &str = "SOFTVERBS_ENGINE_LOG";

/// Appends a line to the engine's log, if it has one.
fn log(path: Option<&str>, what: &str) {
    use std::io::Write;
    if let Some(p) = path
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
    {
        let _ = writeln!(f, "softverbs engine {}: {what}", std::process::id());
    }
}

/// The environment variable naming the `softverbs` executable whose hidden `engine`
/// subcommand runs an engine (`softverbs run` sets it for the programs it starts).
pub const ENV_ENGINE_EXE: &str = "SOFTVERBS_ENGINE_EXE";

/// The environment variable listing the CPUs an engine runs on (`0`, `2-3`, `0,2`), read by
/// the process that starts it; by default the engine may use those of that process. Two
/// network namespaces on a machine of two CPUs, say: both engines on one CPU turn two
/// cross-CPU wake-ups of a round trip into local ones (see `perf --net`).
pub const ENV_ENGINE_CPUS: &str = "SOFTVERBS_ENGINE_CPUS";

/// The CPUs of a list such as `0`, `2-3` or `0,2-3` (each below `CPU_SETSIZE`).
fn parse_cpu_list(list: &str) -> Result<Vec<usize>, String> {
    let max = rustix::thread::CpuSet::MAX_CPU;
    let cpu = |t: &str| -> Result<usize, String> {
        let n: usize = t
            .trim()
            .parse()
            .map_err(|_| format!("`{t}` is not a CPU number"))?;
        if n >= max {
            return Err(format!("CPU {n} is past the last one ({})", max - 1));
        }
        Ok(n)
    };
    let mut cpus = Vec::new();
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (cpu(a)?, cpu(b)?);
                if a > b {
                    return Err(format!("`{part}` runs backwards"));
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(cpu(part)?),
        }
    }
    Ok(cpus)
}

/// Puts the engine `pid` on the CPUs `$SOFTVERBS_ENGINE_CPUS` lists, if it lists any.
fn place(pid: u32) -> crate::Result<()> {
    let Some(list) = std::env::var(ENV_ENGINE_CPUS)
        .ok()
        .filter(|l| !l.trim().is_empty())
    else {
        return Ok(());
    };
    let bad = |why: String| crate::Error::Config(format!("{ENV_ENGINE_CPUS}={list}: {why}"));
    put_on_cpus(pid, &parse_cpu_list(&list).map_err(bad)?).map_err(bad)
}

/// Lets process `pid` (an engine) run on `cpus` only; it moves there when it next runs.
pub(crate) fn put_on_cpus(pid: u32, cpus: &[usize]) -> Result<(), String> {
    let mut set = rustix::thread::CpuSet::new();
    for &c in cpus {
        if c >= rustix::thread::CpuSet::MAX_CPU {
            return Err(format!("CPU {c} is past the last one"));
        }
        set.set(c);
    }
    let pid = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or("no engine process")?;
    rustix::thread::sched_setaffinity(Some(pid), &set)
        .map_err(|e| format!("the system refuses those CPUs ({e})"))
}

/// The `softverbs` executable that runs engines: `$SOFTVERBS_ENGINE_EXE`, else a `softverbs`
/// next to this program or up to two directories above it (a cargo target directory holds
/// test binaries in `deps/`), else the first on `PATH`.
fn engine_exe() -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let usable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if let Some(p) = std::env::var_os(ENV_ENGINE_EXE).filter(|p| !p.is_empty()) {
        return Some(p.into());
    }
    let exe = std::env::current_exe().ok()?;
    if exe.file_name().is_some_and(|n| n == "softverbs") {
        return Some(exe);
    }
    let near = exe.ancestors().skip(1).take(3).map(|d| d.join("softverbs"));
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("softverbs"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    near.chain(on_path).find(|p| usable(p))
}

/// Starts an engine for device `cfg`; the caller then connects. The engine is a process of
/// its own (`softverbs engine`, in a process group of its own, so a terminal's Ctrl-C to the
/// program does not stop the engine its peers use), not a fork of the caller: a forked copy
/// would share the caller's registered pages that were moved into shared memory, heap pages
/// among them, and its allocator would write into the caller's heap.
pub(crate) fn start(cfg: &DeviceConfig) -> crate::Result<()> {
    use std::os::unix::process::CommandExt;
    let exe = engine_exe().ok_or_else(|| {
        crate::Error::NotFound(format!(
            "the softverbs executable that runs the RoCE engine (build or install the \
             softverbs CLI, or name it with {ENV_ENGINE_EXE})"
        ))
    })?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("engine")
        .arg("--spec")
        .arg(cfg.to_spec())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0);
    // The clients ask for captures themselves (`Ctl::Capture`), whoever started the engine.
    cmd.env_remove(super::client::ENV_PCAP);
    let mut child = cmd.spawn().map_err(|e| {
        crate::Error::NotFound(format!("cannot run the RoCE engine {}: {e}", exe.display()))
    })?;
    // Placed as it starts (it moves there if it already runs): an engine the program did
    // not ask for is not left running elsewhere.
    if let Err(e) = place(child.id()) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    // Reaped here if it ends before this process does (else init reaps it).
    let _ = std::thread::Builder::new()
        .name("softverbs-engine-reap".into())
        .spawn(move || child.wait());
    Ok(())
}

/// Runs the engine for the networked device described by `spec` (one `SOFTVERBS_DEVICES`
/// entry) until its last client leaves: what `softverbs engine` does.
pub fn serve(spec: &str) -> crate::Result<()> {
    // The engine holds nothing of the process that started it: descriptors it inherited
    // (a program's TCP connection to its peer, say) would stay open as long as it runs.
    // SAFETY: closes descriptor numbers only; nothing in this new process uses them yet.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    let log_path = std::env::var(ENV_ENGINE_LOG).ok();
    let say = |what: &str| log(log_path.as_deref(), what);
    // The engine is the host's NIC: a packet waits for it to be scheduled, and the programs
    // it serves busy-poll. Where the system allows (root, or CAP_SYS_NICE), it runs at a
    // higher priority so that a wake-up preempts a spinning program at once; elsewhere it
    // keeps the default.
    // SAFETY: setpriority on this process; no memory is involved.
    let raised = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, ENGINE_NICE) } == 0;
    let cfg = DeviceConfig::parse_list(spec)?
        .into_iter()
        .next()
        .ok_or_else(|| crate::Error::Config("no device".into()))?;
    let spin = std::env::var(ENV_ENGINE_SPIN)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or_else(default_spin, Duration::from_micros);
    let capture = std::env::var(super::client::ENV_PCAP)
        .ok()
        .filter(|p| !p.is_empty());
    let mut e = match Engine::new(cfg, capture) {
        Ok(e) => e,
        Err(err) => {
            say(&format!("cannot start: {err}"));
            return Err(err);
        }
    };
    e.spin = spin;
    say(if raised {
        "started (nice -10)"
    } else {
        "started"
    });
    e.run();
    say("no client left: stopped");
    Ok(())
}

fn listen_on(ip: IpAddr) -> crate::Result<OwnedFd> {
    let sock = socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(crate::Error::os("socket"))?;
    let addr = SocketAddrUnix::new_abstract_name(engine_name(ip).as_bytes())
        .map_err(crate::Error::os("socket name"))?;
    bind(&sock, &addr).map_err(crate::Error::os("bind (another engine runs)"))?;
    listen(&sock, 64).map_err(crate::Error::os("listen"))?;
    Ok(sock)
}

fn status_of(s: WcStatus) -> NicStatus {
    match s {
        WcStatus::Success => NicStatus::Success,
        WcStatus::LocLenErr => NicStatus::LocLenErr,
        WcStatus::LocQpOpErr => NicStatus::LocQpOpErr,
        WcStatus::LocProtErr => NicStatus::LocProtErr,
        WcStatus::WrFlushErr => NicStatus::WrFlushErr,
        WcStatus::BadRespErr => NicStatus::BadRespErr,
        WcStatus::LocAccessErr => NicStatus::LocAccessErr,
        WcStatus::RemInvReqErr => NicStatus::RemInvReqErr,
        WcStatus::RemAccessErr => NicStatus::RemAccessErr,
        WcStatus::RemOpErr => NicStatus::RemOpErr,
        WcStatus::RetryExcErr => NicStatus::RetryExcErr,
        WcStatus::RnrRetryExcErr => NicStatus::RnrRetryExcErr,
    }
}

fn opcode_of(o: WcOpcode) -> NicOp {
    match o {
        WcOpcode::Send => NicOp::Send,
        WcOpcode::RdmaWrite => NicOp::RdmaWrite,
        WcOpcode::RdmaRead => NicOp::RdmaRead,
        WcOpcode::CompSwap => NicOp::CompSwap,
        WcOpcode::FetchAdd => NicOp::FetchAdd,
        WcOpcode::AtomicWrite => NicOp::AtomicWrite,
        WcOpcode::Flush => NicOp::Flush,
        WcOpcode::Recv => NicOp::Recv,
        WcOpcode::RecvRdmaWithImm => NicOp::RecvRdmaWithImm,
    }
}

/// Immediate data travels as the bytes the program gave (an opaque `__be32`); the core
/// carries it as a number it writes big-endian.
fn imm_to_wire(imm: u32) -> u32 {
    u32::from_be_bytes(imm.to_ne_bytes())
}

fn imm_from_wire(imm: u32) -> u32 {
    u32::from_ne_bytes(imm.to_be_bytes())
}

/// Executes `w` if it is a bind or a local invalidation (which touch the owner's key table
/// and no wire): its completion status and opcode.
fn local_op(w: &NetWqe, owner: &RemoteQp, qpn: u32) -> Option<(NicStatus, NicOp)> {
    let keys = owner.keys();
    let (ok, failed, op) = match WrOpcode::from_raw(u32::from(w.opcode))? {
        WrOpcode::BindMw => (
            keys.bind_window(&WindowBind {
                window: (w.swap >> 32) as u32,
                rkey: w.rkey,
                pd: owner.pd_id(),
                qpn,
                mr: w.imm,
                addr: w.remote_addr,
                length: w.compare_add,
                access: AccessFlags::from_bits_retain(w.swap as u32),
            })
            .is_ok(),
            NicStatus::MwBindErr,
            NicOp::BindMw,
        ),
        WrOpcode::LocalInv => (
            keys.invalidate_window(w.rkey, owner.pd_id()).is_ok(),
            NicStatus::LocQpOpErr,
            NicOp::LocalInv,
        ),
        _ => return None,
    };
    Some((if ok { NicStatus::Success } else { failed }, op))
}

/// The send WQE `w` as the core takes it, or why not.
fn send_wr(w: &NetWqe, items: &[NicSge]) -> Option<SendWr> {
    let imm = |with: bool| with.then_some(imm_to_wire(w.imm));
    let op = match WrOpcode::from_raw(u32::from(w.opcode))? {
        WrOpcode::Send | WrOpcode::SendWithImm => SendOp::Send {
            imm: imm(w.opcode == WrOpcode::SendWithImm as u8),
            invalidate: None,
        },
        WrOpcode::SendWithInv => SendOp::Send {
            imm: None,
            invalidate: Some(w.rkey),
        },
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => SendOp::Write {
            va: w.remote_addr,
            rkey: w.rkey,
            imm: imm(w.opcode == WrOpcode::RdmaWriteWithImm as u8),
        },
        WrOpcode::RdmaRead => SendOp::Read {
            va: w.remote_addr,
            rkey: w.rkey,
        },
        WrOpcode::AtomicCmpAndSwp => SendOp::CompareSwap {
            va: w.remote_addr,
            rkey: w.rkey,
            compare: w.compare_add,
            swap: w.swap,
        },
        WrOpcode::AtomicFetchAndAdd => SendOp::FetchAdd {
            va: w.remote_addr,
            rkey: w.rkey,
            add: w.compare_add,
        },
        WrOpcode::AtomicWrite => SendOp::AtomicWrite {
            va: w.remote_addr,
            rkey: w.rkey,
            value: w.compare_add,
        },
        // The length in `compare_add`, the whole-region flag in `swap` (see `NetQp::post`).
        WrOpcode::Flush => SendOp::Flush {
            va: w.remote_addr,
            rkey: w.rkey,
            len: u32::try_from(w.compare_add).ok()?,
            whole_region: w.swap != 0,
        },
        WrOpcode::BindMw | WrOpcode::LocalInv | WrOpcode::Driver1 => return None,
    };
    let mut wr = SendWr::new(u64::from(w.seq), op);
    wr.signaled = true;
    wr.solicited = w.flags & WQE_SOLICITED != 0;
    wr.fence = w.flags & WQE_FENCE != 0;
    if w.flags & WQE_INLINE != 0 {
        let mut bytes = Vec::with_capacity(w.count as usize);
        for s in items {
            // An inline chunk was stored where an SGE goes: the same 16 bytes.
            let mut c = [0u8; 16];
            c[..8].copy_from_slice(&s.addr.to_ne_bytes());
            c[8..12].copy_from_slice(&s.length.to_ne_bytes());
            c[12..].copy_from_slice(&s.lkey.to_ne_bytes());
            bytes.extend_from_slice(&c);
        }
        if bytes.len() < w.count as usize {
            return None;
        }
        bytes.truncate(w.count as usize);
        wr.inline = Some(bytes);
    } else {
        if items.len() != w.count as usize {
            return None;
        }
        wr.sges = items
            .iter()
            .map(|s| Sge {
                addr: s.addr,
                len: s.length,
                lkey: s.lkey,
            })
            .collect();
    }
    wr.xrc_srqn = w.xrc_srqn;
    if w.ud_qpn != 0 || w.ud_qkey != 0 || w.ud_dst != [0; 16] {
        wr.ud = Some(UdDest {
            addr: ip_of(Gid(w.ud_dst)),
            qpn: w.ud_qpn,
            qkey: w.ud_qkey,
        });
    }
    Some(wr)
}

/// A receive WQE's SGEs as the core takes them.
fn core_sges(sges: &[crate::types::Sge]) -> Vec<Sge> {
    sges.iter()
        .map(|s| Sge {
            addr: s.addr,
            len: s.length,
            lkey: s.lkey,
        })
        .collect()
}

impl Engine {
    fn new(cfg: DeviceConfig, capture: Option<String>) -> crate::Result<Engine> {
        let net = cfg
            .net
            .clone()
            .ok_or_else(|| crate::Error::Config("not a networked device".into()))?;
        let primary = ip_of(cfg.gid);
        let listener = listen_on(primary)?;
        let addrs: Vec<IpAddr> = cfg.gid_table.iter().map(|&g| ip_of(g)).collect();
        let mut socks = Vec::new();
        for &a in &addrs {
            match Socket::bind(a, net.ifindex, io::batching()) {
                Ok(s) => socks.push(s),
                // The primary address must be served; others (say, an IPv6 address still in
                // duplicate address detection) are skipped.
                Err(e) if a == primary => {
                    return Err(crate::Error::Os {
                        what: "binding UDP port 4791",
                        errno: rustix::io::Errno::from_io_error(&e)
                            .unwrap_or(rustix::io::Errno::ADDRINUSE),
                    });
                }
                Err(_) => {}
            }
        }
        let mut ep = Endpoint::new(primary, HostMemory::default());
        for s in &socks {
            ep.add_addr(s.addr);
        }
        ep.use_kernel_headers(io::ROCE_PORT);
        let state = Segment::create_file("softverbs-engine", std::mem::size_of::<EngineState>())?;
        // The control socket's name is ours, so the CM socket's is free unless some other
        // program took it; then the engine serves its QPs without carrying CM MADs.
        let gsi = gsi::Gsi::bind(primary).unwrap_or_else(|_| gsi::Gsi::unbound());
        Ok(Engine {
            ifindex: net.ifindex,
            faults: FaultInjector::new(net.faults),
            capture: capture.and_then(|p| Capture::create(&p).ok()),
            cfg,
            ep,
            socks,
            groups: Vec::new(),
            listener,
            clients: Vec::new(),
            qps: FxHashMap::default(),
            bell: Doorbell::new()?,
            state,
            epoch: Instant::now(),
            next_tag: 1,
            totals: Totals::default(),
            gsi,
            rx: vec![0; 65536 + HEADROOM],
            out: Outbox::new(),
            items: Vec::new(),
            started: Instant::now(),
            spin: Duration::ZERO,
            control_due: true,
            readable: Vec::new(),
            more: false,
            last_control: Instant::now(),
        })
    }

    fn now(&self) -> Time {
        Time(self.epoch.elapsed().as_nanos() as u64)
    }

    fn state(&self) -> &EngineState {
        self.state.at(0)
    }

    fn run(&mut self) {
        let mut last_work = Instant::now();
        let mut alone_since = Some(Instant::now());
        loop {
            // Control messages are read when poll(2) said they came, and every millisecond
            // while busy: each look is a system call per client, too many for every turn.
            let mut busy = false;
            self.more = false;
            if self.control_due || self.last_control.elapsed() >= CONTROL_EVERY {
                busy |= self.accept();
                busy |= self.control();
                busy |= self.cm_outgoing();
                self.control_due = false;
                self.last_control = Instant::now();
            }
            if self
                .gsi
                .lease_check_at()
                .is_some_and(|t| t <= Instant::now())
            {
                self.cm_check_leases(None);
            }
            busy |= self.receive();
            busy |= self.gsi.retry_held();
            busy |= self.take_wqes();
            let now = self.now();
            if self.ep.poll_timeout().is_some_and(|t| t <= now) {
                self.ep.handle_timeout(now);
            }
            busy |= self.transmit();
            busy |= self.deliver_events();
            if busy {
                last_work = Instant::now();
            }
            match (self.clients.is_empty(), alone_since) {
                (true, None) => alone_since = Some(Instant::now()),
                // Leased DREQs keep the engine: it is the one left to send them.
                (true, Some(t)) if t.elapsed() >= LINGER && !self.gsi.has_leases() => break,
                (false, Some(_)) => alone_since = None,
                _ => {}
            }
            // With no spin, a turn that did all there was to do ends in sleep (whose poll
            // returns at once for anything that came meanwhile) rather than in another turn
            // of empty reads.
            let done =
                !busy || (self.spin.is_zero() && !self.more && self.ep.pending_events() == 0);
            if done && last_work.elapsed() >= self.spin {
                self.sleep();
                last_work = Instant::now() - self.spin / 2;
            }
        }
        if let Some(c) = &mut self.capture {
            c.flush();
        }
    }

    /// Sleeps until a packet, a client message, a doorbell or the next deadline.
    fn sleep(&mut self) {
        self.faults.release_held(&mut self.out);
        self.send_all();
        self.state().sleeping.store(1, Ordering::Relaxed);
        // The clients' side of this fence: push the WQE, fence, read `sleeping` (see
        // `client::Link::post`): one of the two sees the other.
        fence(Ordering::SeqCst);
        if self.qps.values().any(|q| !q.sq.is_empty()) {
            self.state().sleeping.store(0, Ordering::Relaxed);
            return;
        }
        let now = self.now();
        let deadline = [self.ep.poll_timeout(), self.faults.next_due()]
            .into_iter()
            .flatten()
            .min();
        let wait = deadline.map_or(Duration::from_secs(1), |t| t.since(now));
        let wait = wait.min(Duration::from_secs(1));
        // Only while leases are held: without them the engine sleeps as long as ever.
        let wait = match self.gsi.lease_check_at() {
            Some(t) => wait.min(t.saturating_duration_since(Instant::now())),
            None => wait,
        };
        // MADs waiting for room at a busy receiver: look again in a millisecond.
        let wait = if self.gsi.holding() {
            wait.min(Duration::from_millis(1))
        } else {
            wait
        };
        let bell = self.bell.fd();
        let mut fds = vec![
            PollFd::new(&self.listener, PollFlags::IN),
            PollFd::new(&bell, PollFlags::IN),
        ];
        fds.extend(
            self.socks
                .iter()
                .chain(&self.groups)
                .map(|s| PollFd::new(&s.sock, PollFlags::IN)),
        );
        fds.extend(
            self.clients
                .iter()
                .map(|c| PollFd::new(&c.sock, PollFlags::IN)),
        );
        // The agents' CM socket counts as control: read with the control messages.
        let gsi = self.gsi.fd();
        fds.extend(gsi.as_ref().map(|s| PollFd::new(s, PollFlags::IN)));
        let ts = rustix::time::Timespec {
            tv_sec: wait.as_secs() as i64,
            tv_nsec: i64::from(wait.subsec_nanos()),
        };
        let _ = poll(&mut fds, Some(&ts));
        let rang = !fds[1].revents().is_empty();
        let socks = self.socks.len() + self.groups.len();
        self.readable.clear();
        self.readable
            .extend(fds[2..2 + socks].iter().map(|f| !f.revents().is_empty()));
        let first_client = 2 + self.socks.len() + self.groups.len();
        let control = !fds[0].revents().is_empty()
            || fds[first_client..].iter().any(|f| !f.revents().is_empty());
        drop(fds);
        self.control_due |= control;
        self.state().sleeping.store(0, Ordering::Relaxed);
        if rang {
            self.bell.drain();
        }
    }

    fn accept(&mut self) -> bool {
        let mut any = false;
        while let Ok(sock) =
            accept_with(&self.listener, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK)
        {
            // The kernel's word for who connected: a client cannot claim another's QPs.
            let pid = rustix::net::sockopt::socket_peercred(&sock)
                .map_or(0, |c| c.pid.as_raw_nonzero().get() as u32);
            self.clients.push(Client {
                sock,
                pid,
                qps: Vec::new(),
            });
            any = true;
        }
        any
    }

    /// Reads every client's messages; drops the QPs of clients that left.
    fn control(&mut self) -> bool {
        let mut any = false;
        let mut buf = [0u8; 4096];
        let mut i = 0;
        while i < self.clients.len() {
            let mut gone = false;
            loop {
                match rustix::net::recv(&self.clients[i].sock, &mut buf[..], RecvFlags::DONTWAIT) {
                    Ok((0, _)) => {
                        gone = true;
                        break;
                    }
                    Ok((n, _)) => {
                        any = true;
                        let n = n.min(buf.len());
                        match Ctl::decode(&buf[..n]) {
                            Some(m) => self.handle(i, m),
                            None => self.totals.bad_messages += 1,
                        }
                    }
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(_) => {
                        gone = true;
                        break;
                    }
                }
            }
            if gone {
                let c = self.clients.swap_remove(i);
                for qpn in c.qps {
                    self.close(qpn);
                }
                // A client that goes may be a process that died: its leases go out now if it
                // is already gone, else at the next look, made soon (its descriptors close
                // before it is seen as dead).
                if self.gsi.has_leases() {
                    self.cm_check_leases(Some(c.pid));
                }
                any = true;
            } else {
                i += 1;
            }
        }
        any
    }

    fn reply(&self, client: usize, r: &Reply) {
        let _ = rustix::net::send(&self.clients[client].sock, &r.encode(), SendFlags::DONTWAIT);
    }

    fn handle(&mut self, client: usize, m: Ctl) {
        let owner = self.clients[client].pid;
        let owns = |e: &Engine, qpn: u32| e.qps.get(&qpn).is_some_and(|q| q.owner == owner);
        match m {
            Ctl::Hello { .. } => {
                let w = Welcome {
                    pid: std::process::id(),
                    bell_fd: self.bell.write_fd_num(),
                    bell_ino: self.bell.write_ino(),
                    state_fd: self.state.fd().as_raw_fd(),
                    state_ino: self.state.inode(),
                };
                self.reply(client, &Reply::Welcome(w));
            }
            Ctl::Open { qpn } => {
                if self.qps.contains_key(&qpn) {
                    if !owns(self, qpn) {
                        self.totals.bad_messages += 1;
                    }
                    return;
                }
                let clock = crate::clock::Clock::new(self.cfg.timestamp_bits);
                let Some(remote) = RemoteQp::open(self.cfg.gid, qpn, clock) else {
                    self.totals.bad_messages += 1;
                    return;
                };
                // Only the QP's owner may hand it to the engine.
                if remote.pid() != owner {
                    self.totals.bad_messages += 1;
                    return;
                }
                let Ok(sq) = remote.send_ring() else {
                    self.totals.bad_messages += 1;
                    return;
                };
                let tag = self.next_tag;
                self.next_tag = self.next_tag.wrapping_add(1).max(1);
                self.ep.mem.by_tag.insert(tag, remote.clone());
                if remote.ctx().xrc_domain(XrcRole::Srq).is_some() {
                    self.ep.mem.xrc_points.insert(qpn, tag);
                }
                self.qps.insert(
                    qpn,
                    EngineQp {
                        remote,
                        sq,
                        owner,
                        tag,
                        sq_sig_all: false,
                        wrs: VecDeque::new(),
                        local_done: FxHashMap::default(),
                        live: false,
                        ready: false,
                        modified: false,
                    },
                );
                self.clients[client].qps.push(qpn);
            }
            Ctl::Rtr { qpn, rtr } if owns(self, qpn) => {
                let Some(q) = self.qps.get_mut(&qpn) else {
                    return;
                };
                let qp_type = match rtr.qp_type {
                    2 => QpType::Rc,
                    3 => QpType::Uc,
                    4 => QpType::Ud,
                    // An XRC initiator (9) or target (10).
                    9 | 10 => QpType::Xrc,
                    _ => {
                        self.totals.bad_messages += 1;
                        return;
                    }
                };
                q.sq_sig_all = rtr.sq_sig_all;
                let cfg = QpConfig {
                    qp_type,
                    qpn,
                    pd: q.tag,
                    peer: (qp_type != QpType::Ud).then_some((rtr.peer, rtr.dest_qpn)),
                    sq_psn: Psn::new(0),
                    rq_psn: Psn::new(rtr.rq_psn),
                    pmtu: rtr.pmtu,
                    timeout: 14,
                    retry_cnt: 7,
                    rnr_retry: 7,
                    min_rnr_timer: rtr.min_rnr_timer,
                    max_rd_atomic: 1,
                    max_dest_rd_atomic: rtr.max_dest_rd_atomic.max(1),
                    pkey: rtr.pkey,
                    qkey: rtr.qkey,
                    access: QpAccess::from_bits_truncate(rtr.access),
                    window: 1024,
                };
                if q.live {
                    self.ep.remove_qp(qpn);
                }
                q.live = self.ep.add_qp(cfg).is_ok();
            }
            Ctl::Rts { qpn, rts } if owns(self, qpn) => {
                if let Some(q) = self.qps.get_mut(&qpn) {
                    q.ready = true;
                }
                // The first RTS starts the requester (nothing posted yet); any later one
                // (from SQD or SQE, or RTS to RTS) changes its limits and rights only.
                if let Some(qp) = self.ep.qp_mut(qpn) {
                    qp.ready_to_send(
                        Psn::new(rts.sq_psn),
                        rts.timeout,
                        rts.retry_cnt,
                        rts.rnr_retry,
                        rts.max_rd_atomic.max(1),
                    );
                    qp.update_limits(
                        rts.timeout,
                        rts.retry_cnt,
                        rts.rnr_retry,
                        QpAccess::from_bits_truncate(rts.access),
                    );
                }
            }
            Ctl::Error { qpn } if owns(self, qpn) => {
                if let Some(q) = self.qps.get_mut(&qpn) {
                    q.modified = true;
                }
                self.ep.with_qp(qpn, |q| q.set_error());
            }
            // Answered: `ibv_attach_mcast` returns once the group is joined, as a NIC's does.
            Ctl::Group { qpn, group, join } => {
                let said = if owns(self, qpn) {
                    self.group(qpn, group, join)
                } else {
                    format!("QP {qpn:#x} is not one of this client's")
                };
                self.reply(client, &Reply::Text(said));
            }
            Ctl::Close { qpn } if owns(self, qpn) => {
                self.close(qpn);
                self.clients[client].qps.retain(|&q| q != qpn);
            }
            Ctl::Status => {
                let text = self.report();
                self.reply(client, &Reply::Text(text));
            }
            Ctl::Capture { path } => {
                if let Some(c) = &mut self.capture {
                    c.flush();
                }
                self.capture = if path.is_empty() {
                    None
                } else {
                    Capture::create(&path).ok()
                };
                let said = match &self.capture {
                    Some(c) => format!("capturing to {}", c.path),
                    None if path.is_empty() => "capture stopped".into(),
                    None => format!("cannot write {path}"),
                };
                self.reply(client, &Reply::Text(said));
            }
            _ => self.totals.bad_messages += 1,
        }
    }

    fn close(&mut self, qpn: u32) {
        let empty = self.ep.leave_all(qpn);
        self.groups.retain(|s| !empty.contains(&s.addr));
        if let Some(q) = self.qps.remove(&qpn) {
            self.ep.mem.by_tag.remove(&q.tag);
            self.ep.mem.xrc_points.remove(&qpn);
            if q.live {
                if let Some(qp) = self.ep.qp(qpn) {
                    add_counters(&mut self.totals.gone, qp.counters());
                }
                let now = self.now();
                self.ep.retire_qp(now, qpn);
            }
        }
    }

    /// Attaches QP `qpn` to IP multicast group `group` (or detaches it), joining the group on
    /// the network with its first member here and leaving it with its last: "ok", or why not.
    fn group(&mut self, qpn: u32, group: IpAddr, join: bool) -> String {
        if !group.is_multicast() {
            return format!("{group} is not a multicast address");
        }
        let ud = self
            .ep
            .qp(qpn)
            .is_none_or(|q| q.config().qp_type == softverbs_roce::transport::QpType::Ud);
        if join && ud {
            if self.ep.join(qpn, group) && !self.groups.iter().any(|s| s.addr == group) {
                match Socket::join(group, self.ifindex) {
                    Ok(s) => self.groups.push(s),
                    Err(e) => {
                        self.totals.group_failures += 1;
                        self.ep.leave(qpn, group);
                        return format!("joining {group}: {e}");
                    }
                }
            }
        } else if !join && self.ep.leave(qpn, group) {
            self.groups.retain(|s| s.addr != group);
        }
        "ok".into()
    }

    /// Reads what arrived; a request that needs a receive gets one from its QP's queue first.
    fn receive(&mut self) -> bool {
        let mut any = false;
        let (unicast, groups) = (self.socks.len(), self.groups.len());
        let readable = std::mem::take(&mut self.readable);
        for s in 0..unicast + groups {
            if readable.get(s) == Some(&false) {
                continue;
            }
            let mut datagrams = 0;
            loop {
                if datagrams >= BATCH {
                    self.more = true;
                    break;
                }
                let sock = match s.checked_sub(unicast) {
                    None => &self.socks[s],
                    Some(g) => &self.groups[g],
                };
                let group = (s >= unicast).then_some(sock.addr);
                let Some(r) = sock.recv(&mut self.rx) else {
                    break;
                };
                any = true;
                let n = r.len.div_ceil(r.segment).max(1);
                datagrams += n;
                if n > 1 {
                    self.totals.gro_reads += 1;
                    self.totals.gro_datagrams += n as u64;
                }
                // Each datagram of a run in turn, its headers written in front of it: over
                // the end of the one before, already handled.
                for k in 0..n {
                    let at = HEADROOM + k * r.segment;
                    let len = r.segment.min(r.len - k * r.segment);
                    let sock = match s.checked_sub(unicast) {
                        None => &self.socks[s],
                        Some(g) => &self.groups[g],
                    };
                    let capturing = self.capture.is_some();
                    let Some(start) = sock.frame(r.from, &mut self.rx, at, len, capturing) else {
                        continue;
                    };
                    self.datagram(start, at + len, group);
                }
            }
        }
        any
    }

    /// The datagram at `self.rx[start..end]`, which arrived at `group` or else at one of the
    /// host's addresses.
    fn datagram(&mut self, start: usize, end: usize, group: Option<IpAddr>) {
        // BTH destination QP: bytes 5..8 of the BTH, after the IP and UDP headers.
        let ip_udp = if self.rx[start] >> 4 == 4 { 28 } else { 48 };
        let bth = start + ip_udp + 5;
        if end >= bth + 3 {
            let qpn = u32::from_be_bytes([0, self.rx[bth], self.rx[bth + 1], self.rx[bth + 2]]);
            // The GSI's packets are the host's CM, never the transport core's.
            if qpn == gsi::GSI_QPN && group.is_none() {
                self.cm_incoming(start, end);
                // Recorded after the GSI saw it, as the others: with its identification.
                if let Some(c) = &mut self.capture {
                    c.record(&self.rx[start..end]);
                }
                return;
            }
            // (`bth` is the BTH's QP number: its opcode is 5 bytes before.)
            let needs_receive =
                Opcode::from_u8(self.rx[bth - 5]).is_ok_and(|o| o.op.takes_receive());
            match group {
                _ if !needs_receive => {}
                // A copy for each member: each needs a receive.
                Some(g) => {
                    for m in self.ep.members(g).to_vec() {
                        self.lend_receive(m);
                    }
                }
                // An XRC request names the SRQ whose receive it needs (XRCETH), 8 bytes
                // after the BTH's QP number.
                None if self.rx[bth - 5] & 0xe0 == 0xa0 && end >= bth + 11 => {
                    let x = bth + 8;
                    let srqn = u32::from_be_bytes([0, self.rx[x], self.rx[x + 1], self.rx[x + 2]]);
                    self.lend_xrc_receive(qpn, srqn);
                }
                None => self.lend_receive(qpn),
            }
        }
        let now = self.now();
        self.ep.handle_received(now, &mut self.rx[start..end]);
        // Recorded after the core saw it: with the IPv4 identification it found.
        if let Some(c) = &mut self.capture {
            c.record(&self.rx[start..end]);
        }
    }

    /// Gives the core one receive WQE of QP `qpn` if it has none: taken from the owner's
    /// queue (or SRQ) only when a message may need it, so an SRQ's WQEs stay shared.
    fn lend_receive(&mut self, qpn: u32) {
        let Some(q) = self.qps.get(&qpn) else { return };
        if !q.live || self.ep.qp(qpn).is_none_or(|c| c.posted_recvs() > 0) {
            return;
        }
        if let Some(w) = q.remote.take_recv() {
            let wr = RecvWr {
                wr_id: w.wr_id,
                sges: core_sges(&w.sges),
                srq: 0,
            };
            self.ep.with_qp(qpn, |c| c.post_recv(wr));
        }
    }

    /// XRC: gives target `qpn`'s core one receive WQE of SRQ `srqn` if it has none of it,
    /// taken from the SRQ's receive point only when the SRQ is in the target's domain (a
    /// message to another one is refused by the core, and must not use up a receive).
    fn lend_xrc_receive(&mut self, qpn: u32, srqn: u32) {
        let Some(q) = self.qps.get(&qpn) else { return };
        if !q.live
            || self.ep.mem.xrc_srq(q.tag, srqn).is_none()
            || self.ep.qp(qpn).is_none_or(|c| c.posted_recvs_for(srqn) > 0)
        {
            return;
        }
        let Some(point) = self.qps.get(&srqn) else {
            return;
        };
        if let Some(w) = point.remote.take_recv() {
            let wr = RecvWr {
                wr_id: w.wr_id,
                sges: core_sges(&w.sges),
                srq: srqn,
            };
            self.ep.with_qp(qpn, |c| c.post_recv(wr));
        }
    }

    /// Moves posted send WQEs from the send rings into the core.
    fn take_wqes(&mut self) -> bool {
        let mut any = false;
        let now = self.now();
        let qpns: Vec<u32> = self.qps.keys().copied().collect();
        let mut looked = false;
        for qpn in qpns {
            // A program moves its QP to RTR and RTS with control messages and then posts to
            // the send ring: a WQE of a QP whose RTS was not read yet waits for the control
            // messages to be read (a busy engine reads them only every millisecond), lest it
            // be refused or sent from the wrong PSN.
            if !looked
                && self
                    .qps
                    .get(&qpn)
                    .is_some_and(|q| !q.ready && !q.sq.is_empty())
            {
                looked = true;
                self.control();
            }
            for _ in 0..BATCH {
                let Some(q) = self.qps.get_mut(&qpn) else {
                    break;
                };
                self.items.clear();
                let Some(w) = q.sq.pop_slice::<NetWqe, NicSge>(&mut self.items, |h| {
                    if h.flags & WQE_INLINE != 0 {
                        (h.count as usize).div_ceil(std::mem::size_of::<Chunk>())
                    } else {
                        h.count as usize
                    }
                }) else {
                    break;
                };
                any = true;
                let signaled = q.sq_sig_all || w.flags & WQE_SIGNALED != 0;
                q.wrs.push_back((w.seq, w.wr_id, signaled));
                if let Some(done) = local_op(&w, &q.remote, qpn) {
                    // Executed now: incoming requests see it from here on, and it depends on
                    // nothing before it in the queue (windows are no lkeys).
                    q.local_done.insert(w.seq, done);
                    self.complete_local(qpn);
                    continue;
                }
                let posted = match (q.live, send_wr(&w, &self.items)) {
                    (true, Some(wr)) => {
                        let r = self.ep.with_qp(qpn, |c| c.post_send(now, wr));
                        r.is_some_and(|r| r.is_ok())
                    }
                    _ => false,
                };
                if !posted {
                    self.totals.bad_wqes += 1;
                    self.complete_send(qpn, w.seq, NicStatus::LocQpOpErr, NicOp::Send, 0);
                }
            }
        }
        any
    }

    fn transmit(&mut self) -> bool {
        let mut any = false;
        let now = self.now();
        self.faults.due(now, &mut self.out);
        let mut sent = 0;
        loop {
            if sent == BATCH * 4 {
                self.more = true;
                break;
            }
            sent += 1;
            if !self.out.has_room() {
                self.send_all();
            }
            let Some((dst, r)) = self.ep.poll_transmit_at(now, self.out.spare()) else {
                break;
            };
            any = true;
            self.out.commit_range(dst, r);
            if self.faults.active() {
                self.faults.apply_last(now, &mut self.out);
            }
        }
        self.send_all();
        any
    }

    /// Sends the agents' CM MADs.
    fn cm_outgoing(&mut self) -> bool {
        let mut out = Vec::new();
        let socks = &self.socks;
        let any = self
            .gsi
            .outgoing(|a| socks.iter().any(|s| s.addr == a), &mut out);
        self.send_gsi(out);
        any
    }

    /// Sends the leased DREQs of processes that are gone ([`gsi::Gsi::check_leases`]): of
    /// `pid` alone (a client that went, looked at again soon), or of the next sweep's.
    fn cm_check_leases(&mut self, pid: Option<u32>) {
        let next = match pid {
            Some(_) => SOON_AFTER_A_CLIENT,
            None => lease::CHECK_EVERY,
        };
        let mut out = Vec::new();
        self.gsi.check_leases(pid, next, &mut out);
        self.send_gsi(out);
    }

    /// A datagram to QP1 in `self.rx[start..end]`: to the local agent it is for, or answered.
    fn cm_incoming(&mut self, start: usize, end: usize) {
        let mut out = Vec::new();
        self.gsi.incoming(&mut self.rx[start..end], &mut out);
        self.send_gsi(out);
    }

    /// GSI datagrams leave as every other packet does: through the fault injector, into the
    /// capture, from the socket of their source address.
    fn send_gsi(&mut self, datagrams: Vec<(IpAddr, Vec<u8>)>) {
        if datagrams.is_empty() {
            return;
        }
        let now = self.now();
        for (dst, d) in datagrams {
            if !self.out.push(dst, &d) {
                self.send_all();
                if !self.out.push(dst, &d) {
                    self.totals.send_failures += 1;
                    continue;
                }
            }
            if self.faults.active() {
                self.faults.apply_last(now, &mut self.out);
            }
        }
        self.send_all();
    }

    /// Sends what the outbox holds.
    fn send_all(&mut self) {
        if self.out.is_empty() {
            return;
        }
        let sent = self
            .out
            .send(&mut self.socks, self.ifindex, self.capture.as_mut());
        self.totals.send_failures += sent.failures;
        self.totals.gso_sends += sent.gso_sends;
        self.totals.gso_datagrams += sent.gso_datagrams;
    }

    fn deliver_events(&mut self) -> bool {
        let mut any = false;
        while let Some((qpn, ev)) = self.ep.poll_event() {
            any = true;
            match ev {
                Event::Completion(c) if c.is_recv => self.complete_recv(qpn, &c),
                Event::Completion(c) => self.complete_send(
                    qpn,
                    c.wr_id as u32,
                    status_of(c.status),
                    opcode_of(c.opcode),
                    c.byte_len,
                ),
                Event::Error(why) => self.qp_failed(qpn, why),
            }
        }
        any
    }

    fn complete_send(&mut self, qpn: u32, seq: u32, status: NicStatus, op: NicOp, len: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(at) = q.wrs.iter().position(|w| w.0 == seq) else {
            return;
        };
        let Some((_, wr_id, signaled)) = q.wrs.remove(at) else {
            return;
        };
        if signaled || status != NicStatus::Success {
            q.remote.push_send(Cqe {
                wr_id,
                status: status as u8,
                opcode: op as u8,
                byte_len: len,
                qp_num: qpn,
                wqe_seq: seq,
                ..Cqe::default()
            });
        }
        let done = q.wrs.front().map_or(seq.wrapping_add(1), |w| w.0);
        q.remote.set_sq_done(done);
        self.complete_local(qpn);
    }

    /// Completes the binds and invalidations at the head of `qpn`'s queue. A failed one
    /// moves the QP to ERR once its error completion is out, as a failed request does.
    fn complete_local(&mut self, qpn: u32) {
        loop {
            let Some(q) = self.qps.get_mut(&qpn) else {
                return;
            };
            let Some(&(seq, ..)) = q.wrs.front() else {
                return;
            };
            let Some((status, op)) = q.local_done.remove(&seq) else {
                return;
            };
            self.complete_send(qpn, seq, status, op, 0);
            if status != NicStatus::Success {
                self.ep.with_qp(qpn, |c| c.set_error());
            }
        }
    }

    fn complete_recv(&mut self, qpn: u32, c: &Completion) {
        // An XRC target's receive belongs in the CQ of the SRQ it came from.
        let at = if c.srq != 0 { c.srq } else { qpn };
        let Some(q) = self.qps.get(&at) else { return };
        let mut flags = WcFlags::empty();
        if c.imm.is_some() {
            flags |= WcFlags::WITH_IMM;
        }
        // The invalidated rkey is a plain number (not wire bytes, as immediate data is).
        let imm_data = match c.invalidated {
            Some(rkey) => {
                flags |= WcFlags::WITH_INV;
                rkey
            }
            None => c.imm.map_or(0, imm_from_wire),
        };
        // A RoCE packet has no service level; like a ConnectX, the work completion's `sl`
        // tells a UD receiver which IP header its GRH room holds (bit 3: a RoCEv2 UDP
        // packet; low bits 1 = IPv6, 2 = IPv4). UCX up to 1.18 reads the GRH room by it.
        let sl = match c.grh {
            Some(ip) => {
                flags |= WcFlags::GRH;
                match ip {
                    NetworkHeader::Ipv4 => 0x8 | 0x2,
                    NetworkHeader::Ipv6 => 0x8 | 0x1,
                }
            }
            None => 0,
        };
        q.remote.push_recv(Cqe {
            wr_id: c.wr_id,
            status: status_of(c.status) as u8,
            opcode: opcode_of(c.opcode) as u8,
            byte_len: c.byte_len,
            imm_data,
            qp_num: qpn,
            src_qp: c.src_qp,
            wc_flags: flags.bits() as u8,
            sl,
            solicited: u8::from(c.solicited),
            ..Cqe::default()
        });
        // The message used the receive it was lent; lend the next before the next message
        // (an XRC target's are lent per message, from the SRQ each names).
        if c.srq == 0 {
            self.lend_receive(qpn);
        }
    }

    fn qp_failed(&mut self, qpn: u32, why: QpError) {
        let Some(q) = self.qps.get(&qpn) else { return };
        let event = match why {
            QpError::Responder(NakCode::RemoteAccessError) => Some(AsyncEventType::QpAccessErr),
            QpError::Responder(NakCode::InvalidRequest) => Some(AsyncEventType::QpReqErr),
            QpError::Responder(_) => Some(AsyncEventType::QpFatal),
            QpError::Modified | QpError::Requester(_) | QpError::Receive(_) => None,
        };
        if !q.modified {
            q.remote.responder_error(event);
        }
    }

    /// What `softverbs nic` prints: the engine, its counters, its clients and QPs.
    fn report(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let c = self.ep.counters();
        let mut qc = self.totals.gone;
        for qp in self.ep.qps() {
            add_counters(&mut qc, qp.counters());
        }
        let f = &self.faults.counts;
        let addrs: Vec<String> = self.socks.iter().map(|s| s.addr.to_string()).collect();
        let _ = writeln!(
            s,
            "engine: pid {}, device {}, up {:.1} s, UDP 4791 on {}",
            std::process::id(),
            self.cfg.name,
            self.started.elapsed().as_secs_f64(),
            addrs.join(", ")
        );
        let _ = writeln!(
            s,
            "state: {}, {} clients, {} QPs, capture {}",
            if self.state().sleeping.load(Ordering::Relaxed) != 0 {
                "sleeping"
            } else {
                "polling"
            },
            self.clients.len(),
            self.qps.len(),
            self.capture.as_ref().map_or("off", |c| c.path.as_str())
        );
        // QP1's packets never reach the endpoint; the totals are the host's all the same.
        let g = &self.gsi.counts;
        let rows: [(&str, u64); 36] = [
            ("sent_pkts", c.datagrams_sent + g.wire_sent),
            ("rcvd_pkts", c.datagrams_received + g.wire_received),
            ("sent_bytes", c.bytes_sent + g.wire_sent_bytes),
            ("rcvd_bytes", c.bytes_received + g.wire_received_bytes),
            ("retransmitted_pkts", qc.retransmitted),
            ("ack_timeouts", qc.timeouts),
            ("seq_naks_sent", qc.seq_naks_sent),
            ("seq_naks_rcvd", qc.seq_naks_received),
            ("rnr_naks_sent", qc.rnr_naks_sent),
            ("rnr_naks_rcvd", qc.rnr_naks_received),
            ("error_naks_sent", qc.error_naks_sent),
            ("error_naks_rcvd", qc.error_naks_received),
            ("duplicate_requests", qc.duplicates),
            ("out_of_sequence", qc.out_of_sequence),
            ("icrc_errors", c.icrc_errors + g.icrc_errors),
            ("dropped_malformed", c.malformed),
            ("dropped_not_ours", c.not_ours),
            ("dropped_unknown_qp", c.unknown_qp),
            ("destroyed_qp_reacks", c.lingering_acks),
            ("dropped_by_qp", qc.dropped),
            ("dropped_send_failed", self.totals.send_failures),
            ("gso_sends", self.totals.gso_sends),
            ("gso_datagrams", self.totals.gso_datagrams),
            ("gro_reads", self.totals.gro_reads),
            ("gro_datagrams", self.totals.gro_datagrams),
            ("bad_wqes", self.totals.bad_wqes),
            ("bad_control_msgs", self.totals.bad_messages),
            ("mcast_groups", self.groups.len() as u64),
            ("mcast_join_failures", self.totals.group_failures),
            ("qp_pkts_sent", qc.packets_sent),
            ("qp_pkts_rcvd", qc.packets_received),
            ("fault_dropped", f.dropped),
            ("fault_duplicated", f.duplicated),
            ("fault_reordered", f.reordered),
            ("fault_corrupted", f.corrupted),
            ("fault_delayed", f.delayed),
        ];
        s.push_str("counters:\n");
        for (k, v) in rows.into_iter().chain(g.rows()) {
            let _ = writeln!(s, "  {k}: {v}");
        }
        s.push_str("clients:\n");
        for cl in &self.clients {
            let _ = writeln!(s, "  pid {}: {} QPs", cl.pid, cl.qps.len());
        }
        s.push_str("qps:\n");
        let mut qpns: Vec<&u32> = self.qps.keys().collect();
        qpns.sort();
        for qpn in qpns {
            let q = &self.qps[qpn];
            let line = match self.ep.qp(*qpn) {
                Some(c) => {
                    let (una, next) = c.unacked_psns();
                    let k = c.counters();
                    format!(
                        "  {qpn:#08x} pid {} {:?} {:?} peer {} rq_psn {:#08x} sq_una {:#08x} sq_next {:#08x} in_flight {} pkts {}/{} retrans {} dropped {}",
                        q.owner,
                        c.config().qp_type,
                        c.state(),
                        c.config()
                            .peer
                            .map_or("-".into(), |(a, n)| format!("{a}/{n:#x}")),
                        c.expected_psn().value(),
                        una.value(),
                        next.value(),
                        q.wrs.len(),
                        k.packets_sent,
                        k.packets_received,
                        k.retransmitted,
                        k.dropped
                    )
                }
                None => format!("  {qpn:#08x} pid {} (not connected yet)", q.owner),
            };
            let _ = writeln!(s, "{line}");
        }
        s
    }
}

fn add_counters(sum: &mut QpCounters, c: &QpCounters) {
    sum.packets_sent += c.packets_sent;
    sum.packets_received += c.packets_received;
    sum.retransmitted += c.retransmitted;
    sum.timeouts += c.timeouts;
    sum.seq_naks_sent += c.seq_naks_sent;
    sum.seq_naks_received += c.seq_naks_received;
    sum.rnr_naks_sent += c.rnr_naks_sent;
    sum.rnr_naks_received += c.rnr_naks_received;
    sum.error_naks_sent += c.error_naks_sent;
    sum.error_naks_received += c.error_naks_received;
    sum.duplicates += c.duplicates;
    sum.out_of_sequence += c.out_of_sequence;
    sum.dropped += c.dropped;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_read_or_refused() {
        assert_eq!(parse_cpu_list("0"), Ok(vec![0]));
        assert_eq!(parse_cpu_list("0, 2-4,7"), Ok(vec![0, 2, 3, 4, 7]));
        for bad in ["", "a", "1-0", "-1", "1-", "99999", "0,,1"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?} taken");
        }
        assert!(put_on_cpus(std::process::id(), &[99_999]).is_err());
    }

    #[test]
    fn immediate_data_keeps_its_bytes_on_the_wire() {
        let imm = u32::from_ne_bytes([1, 2, 3, 4]);
        assert_eq!(imm_to_wire(imm).to_be_bytes(), [1, 2, 3, 4]);
        assert_eq!(imm_from_wire(imm_to_wire(imm)), imm);
    }

    #[test]
    fn malformed_wqes_are_refused() {
        let mut w = NetWqe {
            opcode: 99,
            ..NetWqe::default()
        };
        assert!(send_wr(&w, &[]).is_none());
        w.opcode = WrOpcode::Send as u8;
        w.count = 2;
        assert!(
            send_wr(&w, &[NicSge::default()]).is_none(),
            "SGE count lies"
        );
        w.flags = WQE_INLINE;
        w.count = 40;
        assert!(
            send_wr(&w, &[NicSge::default()]).is_none(),
            "inline too short"
        );
        w.count = 10;
        let wr = send_wr(&w, &[NicSge::default()]).unwrap();
        assert_eq!(wr.inline.map(|b| b.len()), Some(10));
    }
}
