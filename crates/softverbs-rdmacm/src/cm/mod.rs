//! The connection manager: every `rdma_cm_id` of the process, its state, the CM MADs it
//! sends and receives, and the timers that retry them.
//!
//! Each process runs a *CM agent*: a thread that receives the MADs addressed to it on
//! abstract unix datagram sockets of the network namespace (the socket contract is in
//! [`crate::wire`]) and runs the retransmission timers. A MAD to a peer on this host goes
//! straight to the peer's socket; a MAD to another host goes to the host engine of the
//! source address, which sends it on QP1 as a RoCEv2 UD packet, as a kernel's CM would. All
//! state sits behind one mutex: connection set-up is not a hot path.

use crate::abi::*;
use crate::addr;
use crate::channel::{Channel, Event};
use crate::device::{self, Place};
use crate::ibv::*;
use crate::mad::{self, IpHeader, Mad, Msg};
use crate::verbs::verbs;
use crate::wire::{self, Dest, Envelope, Sent};
use core::ffi::c_int;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::net::UnixDatagram;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub const IBV_QPT_RC: c_int = 2;
pub const IBV_QPT_UC: c_int = 3;
pub const IBV_QPT_UD: c_int = 4;
pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;
pub const IBV_QPS_ERR: c_int = 6;
pub const QP_STATE: c_int = 1;
pub const QP_ACCESS_FLAGS: c_int = 8;
pub const QP_PKEY_INDEX: c_int = 16;
pub const QP_PORT: c_int = 32;
pub const QP_QKEY: c_int = 64;
pub const QP_AV: c_int = 128;
pub const QP_PATH_MTU: c_int = 256;
pub const QP_TIMEOUT: c_int = 512;
pub const QP_RETRY_CNT: c_int = 1024;
pub const QP_RNR_RETRY: c_int = 2048;
pub const QP_RQ_PSN: c_int = 4096;
pub const QP_MAX_QP_RD_ATOMIC: c_int = 8192;
pub const QP_MIN_RNR_TIMER: c_int = 32768;
pub const QP_SQ_PSN: c_int = 65536;
pub const QP_MAX_DEST_RD_ATOMIC: c_int = 131072;
pub const QP_DEST_QPN: c_int = 1 << 20;
const ACCESS_REMOTE_WRITE: u32 = 2;
const ACCESS_REMOTE_READ: u32 = 4;
const ACCESS_REMOTE_ATOMIC: u32 = 8;

/// CM response timeout of our REQs and REPs (4.096 µs × 2^18 ≈ 1.07 s a try) and the tries
/// after the first: a peer that never answers is UNREACHABLE after about 5.4 s.
pub const CM_RESPONSE_TIMEOUT: u8 = 18;
pub const MAX_CM_RETRIES: u8 = 4;
/// Local ACK timeout of connected QPs (4.096 µs × 2^14 ≈ 67 ms), unless the program sets
/// `RDMA_OPTION_ID_ACK_TIMEOUT`.
const DEFAULT_ACK_TIMEOUT: u8 = 14;
/// How long a disconnected id stays in timewait before `RDMA_CM_EVENT_TIMEWAIT_EXIT`.
const TIMEWAIT: Duration = Duration::from_millis(300);
/// How often the liveness of peers on this host is checked (their agent socket vanishes
/// when they die, and a dead peer sends no DREQ).
const PEER_CHECK: Duration = Duration::from_millis(200);

/// `SOFTVERBS_CM_LOG=FILE`: every MAD this process's CM sends and receives, one line each.
pub const ENV_LOG: &str = "SOFTVERBS_CM_LOG";

pub fn log(what: std::fmt::Arguments<'_>) {
    static FILE: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
    let f = FILE.get_or_init(|| {
        let path = std::env::var_os(ENV_LOG)?;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .ok()?;
        Some(Mutex::new(f))
    });
    if let Some(f) = f {
        use std::io::Write as _;
        let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(f, "{} {what}", std::process::id());
    }
}

/// A MAD's name and comm IDs, for the log.
fn describe(m: &[u8; mad::MAD_LEN]) -> String {
    match Mad::parse(m) {
        Ok(m) => {
            let msg = format!("{:?}", m.msg);
            msg.split_once(" {").map_or(msg.clone(), |(name, rest)| {
                let ids: String = rest.split(", ").take(2).collect::<Vec<_>>().join(" ");
                format!("{name} {ids}")
            })
        }
        Err(e) => format!("{e:?}"),
    }
}

fn cm_timeout(v: u8) -> Duration {
    Duration::from_nanos(4096u64 << v.min(31))
}

/// The program's handle: the C struct first, then what the library keeps beside it.
#[repr(C)]
pub struct SvId {
    pub c: rdma_cm_id,
    pub index: u32,
    path: ibv_sa_path_rec,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Idle,
    AddrBound,
    AddrResolved,
    RouteResolved,
    Listen,
    ReqSent,
    ReqRcvd,
    RepSent,
    /// REP received on an id without a QP: waiting for `rdma_establish`.
    RepRcvd,
    Established,
    DreqSent,
    DreqRcvd,
    TimeWait,
    SidrReqSent,
    SidrReqRcvd,
    Rejected,
}

/// A message to send again until answered.
struct Pending {
    mad: [u8; mad::MAD_LEN],
    dest: Dest,
    tries_left: u8,
    every: Duration,
    due: Instant,
}

/// What the library knows of one id.
pub struct Conn {
    pub id: *mut SvId,
    pub channel: *const Channel,
    /// Created with no channel: calls wait for their own events.
    pub sync: bool,
    pub state: State,
    pub ps: c_int,
    pub dev: Option<usize>,
    pub gid_index: usize,
    pub src: Option<SocketAddr>,
    pub dst: Option<SocketAddr>,
    pub sgid: [u8; 16],
    pub dgid: [u8; 16],
    /// The `svc/` socket that holds this id's port (bound and listening ids).
    port: Option<UnixDatagram>,
    pub backlog: i32,
    pub comm_id: u32,
    pub remote_comm_id: u32,
    pub remote_qpn: u32,
    pub remote_psn: u32,
    pub remote_qkey: u32,
    pub psn: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub peer_rnr_retry: u8,
    pub srq: bool,
    pub mtu: c_int,
    pub tos: u8,
    pub reuseaddr: bool,
    pub afonly: bool,
    pub ack_timeout: Option<u8>,
    pub listener: Option<u32>,
    pub tid: u64,
    pending: Option<Pending>,
    timewait_until: Option<Instant>,
    /// The QP attributes of `rdma_create_ep` on a passive id, for each request's new id.
    pub ep_qp_attr: Option<ibv_qp_init_attr>,
    pub ep_pd: *mut ibv_pd,
    /// `rdma_get_request`'s event, acked at accept or reject.
    pub held_event: *mut rdma_cm_event,
    /// CQs and channels this library made for the id's QP.
    pub own_cqs: bool,
    pub private_channel: Option<Box<Channel>>,
    /// The host engine holds this connection's DREQ, to send if the process dies.
    leased: bool,
    /// The multicast groups joined on this id.
    pub groups: Vec<multicast::Joined>,
}

// SAFETY: the raw pointers are the program's objects and ours, used under the CM lock.
unsafe impl Send for Conn {}

pub struct Cm {
    pub agent: u32,
    sock: UnixDatagram,
    pub conns: HashMap<u32, Conn>,
    next_index: u32,
    next_tid: u64,
    /// Devices whose host engine this process keeps running (a UD QP on each).
    keepers: HashMap<usize, usize>,
    wake: (c_int, c_int),
    last_peer_check: Instant,
    /// Envelopes whose receiver was busy, in order, with their socket names.
    outbox: std::collections::VecDeque<(String, Vec<u8>)>,
    /// Requests that came to a port bound but not yet listening, with when they came: kept
    /// for [`EARLY_HOLD`] for the `rdma_listen` that usually follows at once. Programs that
    /// send their port to the peer before listening (Debian's qperf 0.4.11 does; qperf fixed
    /// it later) race their own listen, a race the kernel's fast path almost always wins.
    early: Vec<(u32, Envelope, Instant)>,
}

/// How long a request waits for its port's `rdma_listen`.
const EARLY_HOLD: Duration = Duration::from_millis(200);

mod agent;
mod connection;
mod multicast;
mod qp;
mod receive;
mod send;

static CM: OnceLock<Option<Mutex<Cm>>> = OnceLock::new();

/// The CM, started on first use; `None` (errno ENODEV) if no agent socket could be made.
pub fn cm() -> Option<MutexGuard<'static, Cm>> {
    let m = CM.get_or_init(start).as_ref()?;
    Some(m.lock().unwrap_or_else(|p| p.into_inner()))
}

fn start() -> Option<Mutex<Cm>> {
    let (agent, sock) = wire::bind_agent()?;
    let mut fds = [0 as c_int; 2];
    // SAFETY: pipe2 fills the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return None;
    }
    let cm = Cm {
        agent,
        sock,
        conns: HashMap::new(),
        next_index: 0,
        next_tid: u64::from(agent) << 40,
        keepers: HashMap::new(),
        wake: (fds[0], fds[1]),
        last_peer_check: Instant::now(),
        outbox: std::collections::VecDeque::new(),
        early: Vec::new(),
    };
    std::thread::Builder::new()
        .name("rdmacm-agent".into())
        .spawn(agent::agent_loop)
        .ok()?;
    Some(Mutex::new(cm))
}

/// The random starting PSN of a connection.
fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom into a 4-byte buffer.
    let _ = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    u32::from_ne_bytes(b) & 0xff_ffff
}

impl Cm {
    /// Makes a new id on `channel` (NULL: a synchronous id with a channel of its own).
    pub fn create_id(
        &mut self,
        channel: *const Channel,
        context: *mut core::ffi::c_void,
        ps: c_int,
        qp_type: c_int,
    ) -> Option<*mut SvId> {
        let (channel, private, sync) = if channel.is_null() {
            let c = Channel::new()?;
            let p: *const Channel = &*c;
            (p, Some(c), true)
        } else {
            (channel, None, false)
        };
        let index = self.free_index()?;
        // SAFETY: rdma_cm_id and the path record are plain C data; all-zero is their
        // initial state.
        let mut id: Box<SvId> = Box::new(SvId {
            c: unsafe { std::mem::zeroed() },
            index,
            path: unsafe { std::mem::zeroed() },
        });
        id.c.channel = channel as *mut rdma_event_channel;
        id.c.context = context;
        id.c.ps = ps;
        id.c.qp_type = qp_type;
        let id = Box::into_raw(id);
        self.conns.insert(
            index,
            Conn {
                id,
                channel,
                sync,
                state: State::Idle,
                ps,
                dev: None,
                gid_index: 0,
                src: None,
                dst: None,
                sgid: [0; 16],
                dgid: [0; 16],
                port: None,
                backlog: 0,
                comm_id: (self.agent << 12) | index,
                remote_comm_id: 0,
                remote_qpn: 0,
                remote_psn: 0,
                remote_qkey: 0,
                psn: random_psn(),
                responder_resources: 0,
                initiator_depth: 0,
                retry_count: 7,
                rnr_retry_count: 7,
                peer_rnr_retry: 7,
                srq: false,
                mtu: 3,
                tos: 0,
                reuseaddr: false,
                afonly: false,
                ack_timeout: None,
                listener: None,
                tid: 0,
                pending: None,
                timewait_until: None,
                ep_qp_attr: None,
                ep_pd: std::ptr::null_mut(),
                held_event: std::ptr::null_mut(),
                own_cqs: false,
                private_channel: private,
                leased: false,
                groups: Vec::new(),
            },
        );
        Some(id)
    }

    fn free_index(&mut self) -> Option<u32> {
        for _ in 0..4096 {
            let i = self.next_index;
            self.next_index = (self.next_index + 1) & 0xfff;
            if !self.conns.contains_key(&i) {
                return Some(i);
            }
        }
        None
    }

    fn new_tid(&mut self) -> u64 {
        self.next_tid += 1;
        self.next_tid
    }

    /// The conn of a program's id pointer, if it is a live id of ours.
    pub fn conn_of(&mut self, id: *mut rdma_cm_id) -> Option<&mut Conn> {
        if id.is_null() {
            return None;
        }
        let found = self
            .conns
            .values_mut()
            .find(|c| c.id as *mut rdma_cm_id == id)?;
        Some(found)
    }

    pub fn index_of(&self, id: *mut rdma_cm_id) -> Option<u32> {
        self.conns
            .iter()
            .find(|(_, c)| c.id as *mut rdma_cm_id == id)
            .map(|(i, _)| *i)
    }

    fn by_comm_id(&mut self, comm_id: u32) -> Option<u32> {
        if comm_id >> 12 != self.agent {
            return None;
        }
        let i = comm_id & 0xfff;
        self.conns
            .get(&i)
            .filter(|c| c.comm_id == comm_id)
            .map(|_| i)
    }

    /// Puts `e` on the channel of id `i`.
    fn post(&self, i: u32, e: Box<Event>) {
        if let Some(c) = self.conns.get(&i) {
            // SAFETY: the channel outlives its ids (the program destroys ids first; a
            // private channel lives in the conn).
            unsafe { (*c.channel).push(e) };
        }
    }

    /// Posts a plain event of `kind` with `status` to id `i`.
    pub fn post_simple(&self, i: u32, kind: c_int, status: c_int) {
        if let Some(c) = self.conns.get(&i) {
            self.post(i, Event::new(c.id.cast(), kind, status));
        }
    }

    /// Binds id `i` to `addr` (port 0: any free port); errno on failure.
    pub fn bind(&mut self, i: u32, addr: SocketAddr) -> Result<(), c_int> {
        let ip = addr::canonical(addr.ip());
        // A loopback address is bound to no device yet, like the wildcard: requests to it
        // come on whichever device, and connecting from it takes the first device (the
        // kernel's `cma_resolve_loopback`). libfabric relies on this: it binds `localhost`
        // and, finding no device on the id, lists the devices' own addresses.
        let place = if ip.is_unspecified() || ip.is_loopback() {
            None
        } else {
            Some(device::place_of(ip).ok_or(libc::EADDRNOTAVAIL)?)
        };
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        if c.state != State::Idle {
            return Err(libc::EINVAL);
        }
        let ps = c.ps;
        let (port, sock) = self.bind_port(ps, addr.port())?;
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        c.port = Some(sock);
        let mut bound = addr;
        bound.set_port(port);
        c.src = Some(bound);
        c.state = State::AddrBound;
        if let Some(p) = place {
            self.set_place(i, p);
        }
        self.write_route(i);
        Ok(())
    }

    /// Binds `port` of port space `ps`. A port this process's id just gave up can still be
    /// bound for a moment: the agent thread's `poll` holds the closed socket (and so its
    /// name) until it returns. So a busy port is tried again, with the agent woken, for up
    /// to 100 ms before it is EADDRINUSE (perftest's `-R` server binds its port again right
    /// after destroying the id that had it).
    fn bind_port(
        &self,
        ps: c_int,
        port: u16,
    ) -> Result<(u16, std::os::unix::net::UnixDatagram), c_int> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
        loop {
            match wire::bind_port(ps, port) {
                Err(libc::EADDRINUSE) if port != 0 && std::time::Instant::now() < deadline => {
                    self.wake_agent();
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                r => return r,
            }
        }
    }

    /// Records that id `i` is on device `p.dev` with GID `p.gid_index`.
    fn set_place(&mut self, i: u32, p: Place) {
        let devs = device::devices();
        let Some(d) = devs.get(p.dev) else { return };
        if let Some(c) = self.conns.get_mut(&i) {
            c.dev = Some(p.dev);
            c.gid_index = p.gid_index;
            c.sgid = d.gids.get(p.gid_index).copied().unwrap_or([0; 16]);
            c.mtu = d.mtu;
            // SAFETY: the id is live (it is in the table).
            unsafe {
                (*c.id).c.verbs = d.ctx;
                (*c.id).c.port_num = 1;
            }
        }
    }

    /// Writes id `i`'s addresses, GIDs and path into its C struct.
    fn write_route(&mut self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        // SAFETY: the id is live; the program reads these fields, we alone write them.
        let id = unsafe { &mut *c.id };
        if let Some(s) = c.src {
            id.c.route.addr.src = addr::to_c(s).0;
        }
        if let Some(d) = c.dst {
            id.c.route.addr.dst = addr::to_c(d).0;
        }
        id.c.route.addr.ibaddr.sgid = ibv_gid(c.sgid);
        id.c.route.addr.ibaddr.dgid = ibv_gid(c.dgid);
        id.c.route.addr.ibaddr.pkey = 0xffff;
        if matches!(
            c.state,
            State::AddrResolved | State::AddrBound | State::Listen | State::Idle
        ) {
            return;
        }
        id.path = ibv_sa_path_rec {
            dgid: ibv_gid(c.dgid),
            sgid: ibv_gid(c.sgid),
            dlid: 0,
            slid: 0,
            raw_traffic: 0,
            flow_label: 0,
            hop_limit: 64,
            traffic_class: c.tos,
            reversible: 1,
            numb_path: 1,
            pkey: 0xffff_u16.to_be(),
            sl: 0,
            mtu_selector: 2,
            mtu: c.mtu as u8,
            rate_selector: 2,
            rate: 3,
            packet_life_time_selector: 2,
            packet_life_time: DEFAULT_ACK_TIMEOUT - 1,
            preference: 0,
        };
        id.c.route.path_rec = &mut id.path;
        id.c.route.num_paths = 1;
    }

    /// `rdma_resolve_addr`: finds the device of the source for `dst` and queues
    /// ADDR_RESOLVED (or fails with errno at once, as the kernel's CM does for no device).
    pub fn resolve_addr(
        &mut self,
        i: u32,
        src: Option<SocketAddr>,
        dst: SocketAddr,
    ) -> Result<(), c_int> {
        let dst_ip = addr::canonical(dst.ip());
        let state = self.conns.get(&i).ok_or(libc::EINVAL)?.state;
        if let Some(s) = src.filter(|s| !s.ip().is_unspecified()) {
            if state == State::Idle {
                self.bind(i, s)?;
            }
        }
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        let src_ip = match c.src.map(|s| addr::canonical(s.ip())) {
            Some(ip) if !ip.is_unspecified() => ip,
            _ => device::source_for(dst_ip).ok_or(libc::ENETUNREACH)?,
        };
        let place = device::place_of(src_ip).ok_or(libc::ENODEV)?;
        if self.conns.get(&i).ok_or(libc::EINVAL)?.state == State::Idle {
            self.bind(i, SocketAddr::new(src_ip, 0))?;
        }
        self.set_place(i, place);
        let dgid = if dst_ip.is_loopback() {
            device::devices()[place.dev].gids[place.gid_index]
        } else if device::place_of(dst_ip).is_some() {
            // An address of this host: the device that holds it.
            let p = device::place_of(dst_ip).ok_or(libc::ENODEV)?;
            device::devices()[p.dev].gids[p.gid_index]
        } else {
            addr::gid_of(dst_ip)
        };
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        let mut s = c.src.unwrap_or(SocketAddr::new(src_ip, 0));
        if s.ip().is_unspecified() {
            s.set_ip(src_ip);
        }
        c.src = Some(s);
        c.dst = Some(dst);
        c.dgid = dgid;
        c.state = State::AddrResolved;
        self.write_route(i);
        self.post_simple(i, RDMA_CM_EVENT_ADDR_RESOLVED, 0);
        Ok(())
    }

    /// `rdma_resolve_route`: one path, from the GIDs (RoCE needs no path query).
    pub fn resolve_route(&mut self, i: u32) -> Result<(), c_int> {
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        if c.state != State::AddrResolved {
            return Err(libc::EINVAL);
        }
        c.state = State::RouteResolved;
        self.write_route(i);
        self.post_simple(i, RDMA_CM_EVENT_ROUTE_RESOLVED, 0);
        Ok(())
    }

    /// `rdma_listen`.
    pub fn listen(&mut self, i: u32, backlog: i32) -> Result<(), c_int> {
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        match c.state {
            State::AddrBound => {}
            State::Listen => {
                c.backlog = backlog;
                return Ok(());
            }
            _ => return Err(libc::EINVAL),
        }
        c.state = State::Listen;
        c.backlog = backlog;
        let dev = c.dev;
        // A listener on a networked device needs its host engine running to hear REQs from
        // other hosts; on the wildcard address, every device's.
        match dev {
            Some(d) => self.keep_engine(d),
            None => {
                for d in 0..device::devices().len() {
                    self.keep_engine(d);
                }
            }
        }
        // The requests that came before the listen.
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.early)
            .into_iter()
            .partition(|(l, _, _)| *l == i);
        self.early = others;
        for (l, env, _) in mine {
            self.handle(Some(l), env);
        }
        self.wake_agent();
        Ok(())
    }

    /// Keeps device `d`'s host engine (if it has one) running while this process lives: a
    /// UD QP on it, which is what starts a networked device's engine.
    fn keep_engine(&mut self, d: usize) {
        let devs = device::devices();
        let Some(dev) = devs.get(d) else { return };
        if self.keepers.contains_key(&d) || dev.gids.iter().all(device::is_loopback_gid) {
            return;
        }
        let Some(v) = verbs() else { return };
        // SAFETY: plain verbs calls on an open context; the objects live for the process.
        unsafe {
            let pd = (v.alloc_pd)(dev.ctx);
            if pd.is_null() {
                return;
            }
            let cq = (v.create_cq)(dev.ctx, 1, std::ptr::null_mut(), std::ptr::null_mut(), 0);
            if cq.is_null() {
                return;
            }
            let mut attr: ibv_qp_init_attr = std::mem::zeroed();
            attr.send_cq = cq;
            attr.recv_cq = cq;
            attr.cap.max_send_wr = 1;
            attr.cap.max_recv_wr = 1;
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            attr.qp_type = IBV_QPT_UD;
            let qp = (v.create_qp)(pd, &mut attr);
            if !qp.is_null() {
                self.keepers.insert(d, qp as usize);
            }
        }
    }

    /// Forgets id `i` (`rdma_destroy_id`), telling the peer as a host's CM would.
    pub fn destroy(&mut self, i: u32) {
        let state = match self.conns.get(&i) {
            Some(c) => c.state,
            None => return,
        };
        match state {
            State::Established | State::RepSent | State::RepRcvd => {
                let _ = self.disconnect(i);
            }
            State::DreqRcvd => self.send_drep(i),
            State::ReqRcvd => {
                let _ = self.reject(i, &[]);
            }
            _ => {}
        }
        self.unlease(i);
        self.leave_all(i);
        if let Some(c) = self.conns.remove(&i) {
            // SAFETY: the channel outlives its ids.
            unsafe { (*c.channel).forget(c.id.cast()) };
            // Children of a listener lose it.
            for other in self.conns.values_mut() {
                if other.listener == Some(i) {
                    other.listener = None;
                }
            }
            // SAFETY: the id came from Box::into_raw in create_id and is no longer in the
            // table, so nothing else reaches it.
            drop(unsafe { Box::from_raw(c.id) });
        }
        self.wake_agent();
    }
}

/// Runs `f` with the CM and id `id`'s index; errno EINVAL for an unknown id, ENODEV when
/// there is no CM.
pub fn with_id<T>(
    id: *mut rdma_cm_id,
    f: impl FnOnce(&mut Cm, u32) -> Result<T, c_int>,
) -> Result<T, c_int> {
    let mut cm = cm().ok_or(libc::ENODEV)?;
    let i = cm.index_of(id).ok_or(libc::EINVAL)?;
    f(&mut cm, i)
}

/// For a synchronous id: waits for its next event, which must be `want`; the event is
/// acked. Errno otherwise (ECONNREFUSED for a rejection, ETIMEDOUT for no answer).
pub fn wait_sync(i: u32, want: c_int) -> Result<(), c_int> {
    let ch = {
        let cm = cm().ok_or(libc::ENODEV)?;
        let c = cm.conns.get(&i).ok_or(libc::EINVAL)?;
        if !c.sync {
            return Ok(());
        }
        c.channel
    };
    // SAFETY: a synchronous id's channel lives in its conn until rdma_destroy_id, which the
    // program does not call while this call runs.
    let e = unsafe { (*ch).pop() }.ok_or(libc::EIO)?;
    let (kind, status) = (e.ev.event, e.ev.status);
    drop(e);
    if kind == want {
        return Ok(());
    }
    Err(match kind {
        RDMA_CM_EVENT_REJECTED => libc::ECONNREFUSED,
        RDMA_CM_EVENT_UNREACHABLE if status == -libc::ETIMEDOUT => libc::ETIMEDOUT,
        RDMA_CM_EVENT_UNREACHABLE => libc::EHOSTUNREACH,
        _ if status < 0 => -status,
        _ => libc::EINVAL,
    })
}
