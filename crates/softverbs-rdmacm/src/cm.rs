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
}

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
    };
    std::thread::Builder::new()
        .name("rdmacm-agent".into())
        .spawn(agent_loop)
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
        let (port, sock) = wire::bind_port(ps, addr.port())?;
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

    fn wake_agent(&self) {
        let b = 1u8;
        // SAFETY: a one-byte write to our non-blocking pipe.
        let _ = unsafe { libc::write(self.wake.1, (&b as *const u8).cast(), 1) };
    }

    /// Sends `mad` from id `i` to `dest`. False if it could not leave (no such socket here:
    /// nobody listens or the peer is gone).
    fn send(&mut self, i: u32, dest: Dest, m: &[u8; mad::MAD_LEN]) -> bool {
        let Some(c) = self.conns.get(&i) else {
            return false;
        };
        let (sgid, dgid) = (c.sgid, c.dgid);
        self.send_from(sgid, dgid, dest, m)
    }

    fn send_from(
        &mut self,
        sgid: [u8; 16],
        dgid: [u8; 16],
        dest: Dest,
        m: &[u8; mad::MAD_LEN],
    ) -> bool {
        self.send_flagged(0, sgid, dgid, dest, m)
    }

    /// As [`Self::send_from`], with envelope `flags` ([`wire::LEASE`] and [`wire::CANCEL`]
    /// go to the host engine whatever the destination).
    fn send_flagged(
        &mut self,
        flags: u8,
        sgid: [u8; 16],
        dgid: [u8; 16],
        dest: Dest,
        m: &[u8; mad::MAD_LEN],
    ) -> bool {
        let env = Envelope {
            flags,
            sgid,
            dgid,
            src_qpn: 1,
            mad: *m,
        };
        let name = if flags == 0 && device::is_local_gid(&dgid) {
            wire::local_name(dest)
        } else {
            // Another host: its CM is reached through our host engine, which puts the MAD on
            // the wire from QP1.
            wire::engine_name(self.engine_addr(&sgid))
        };
        let bytes = env.emit().to_vec();
        let sent = if self.outbox.is_empty() {
            wire::send_named(&self.sock, &name, &bytes)
        } else {
            Sent::Busy
        };
        log(format_args!(
            "send {} flags {flags} to {name} {sent:?}",
            describe(m)
        ));
        match sent {
            Sent::Done => true,
            Sent::Busy => {
                // Kept in order and sent by the agent as room appears, never waited for
                // under the lock (two agents could wait on each other).
                self.outbox.push_back((name, bytes));
                self.wake_agent();
                true
            }
            Sent::Nobody => false,
        }
    }

    /// The address whose engine carries MADs from GID `sgid`: the engine of a device is
    /// named by the device's first IPv4 address (else its first GID).
    fn engine_addr(&self, sgid: &[u8; 16]) -> IpAddr {
        let devs = device::devices();
        let dev = devs.iter().find(|d| d.gids.contains(sgid));
        dev.and_then(|d| {
            d.gids
                .iter()
                .map(addr::ip_of)
                .find(IpAddr::is_ipv4)
                .or_else(|| d.gids.first().map(addr::ip_of))
        })
        .unwrap_or_else(|| addr::ip_of(sgid))
    }

    /// Sends what waited for room; true if the outbox is empty.
    fn flush(&mut self) -> bool {
        while let Some((name, bytes)) = self.outbox.front() {
            match wire::send_named(&self.sock, name, bytes) {
                Sent::Busy => return false,
                // Done, or the receiver went away meanwhile (its peer's timers tell).
                _ => {
                    self.outbox.pop_front();
                }
            }
        }
        true
    }

    /// Sends `mad` and keeps it to send again until answered.
    fn send_reliable(&mut self, i: u32, dest: Dest, m: [u8; mad::MAD_LEN]) -> bool {
        let sent = self.send(i, dest, &m);
        let every = cm_timeout(CM_RESPONSE_TIMEOUT);
        if let Some(c) = self.conns.get_mut(&i) {
            c.pending = Some(Pending {
                mad: m,
                dest,
                tries_left: MAX_CM_RETRIES,
                every,
                due: Instant::now() + every,
            });
        }
        self.wake_agent();
        sent
    }

    fn path_of(&self, c: &Conn) -> mad::Path {
        mad::Path {
            local_gid: c.sgid,
            remote_gid: c.dgid,
            flow_label: 0,
            packet_rate: 3,
            traffic_class: c.tos,
            hop_limit: 64,
            sl: 0,
            local_ack_timeout: c.ack_timeout.unwrap_or(DEFAULT_ACK_TIMEOUT),
        }
    }

    fn service_id(ps: c_int, port: u16) -> u64 {
        (u64::from(ps as u32 & 0xffff) << 16) | u64::from(port)
    }

    /// The private data a REQ or SIDR_REQ carries: rdma_cm's IP header, then the program's.
    fn ip_private(c: &Conn, user: &[u8]) -> Vec<u8> {
        let src = c
            .src
            .map_or(IpAddr::from([0, 0, 0, 0]), |s| addr::canonical(s.ip()));
        let dst = c
            .dst
            .map_or(IpAddr::from([0, 0, 0, 0]), |s| addr::canonical(s.ip()));
        let (src, dst) = match (src, dst) {
            (IpAddr::V4(_), IpAddr::V6(d)) => {
                (src, d.to_ipv4_mapped().map_or(IpAddr::V6(d), IpAddr::V4))
            }
            x => x,
        };
        let h = IpHeader {
            src,
            dst,
            src_port: c.src.map_or(0, |s| s.port()),
        };
        let mut p = h.emit().to_vec();
        p.extend_from_slice(user);
        p
    }

    /// `rdma_connect`: a REQ (RC/UC) or SIDR_REQ (UD).
    pub fn connect(&mut self, i: u32, p: &rdma_conn_param, user: &[u8]) -> Result<(), c_int> {
        let tid = self.new_tid();
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        if c.state != State::RouteResolved {
            return Err(libc::EINVAL);
        }
        let dst_port = c.dst.map_or(0, |d| d.port());
        let service_id = Self::service_id(c.ps, dst_port);
        // SAFETY: the id is live.
        let id = unsafe { &*c.id };
        let qp_type = if id.c.qp.is_null() {
            id.c.qp_type
        } else {
            // SAFETY: the program's QP, created on this id.
            unsafe { (*id.c.qp).qp_type }
        };
        c.tid = tid;
        if qp_type == IBV_QPT_UD || c.ps == RDMA_PS_UDP {
            if user.len() > mad::SIDR_REQ_PRIVATE - IpHeader::LEN {
                return Err(libc::EINVAL);
            }
            let private_data = Self::ip_private(c, user);
            let m = Mad {
                tid,
                msg: Msg::SidrReq(mad::SidrReq {
                    request_id: c.comm_id,
                    pkey: 0xffff,
                    service_id,
                    private_data,
                }),
            }
            .emit();
            c.state = State::SidrReqSent;
            if !self.send_reliable(i, Dest::Service(service_id), m) {
                self.no_listener(i);
            }
            return Ok(());
        }
        if user.len() > mad::REQ_PRIVATE - IpHeader::LEN {
            return Err(libc::EINVAL);
        }
        let qpn = if id.c.qp.is_null() {
            p.qp_num
        } else {
            // SAFETY: as above.
            unsafe { (*id.c.qp).qp_num }
        };
        c.responder_resources = p.responder_resources;
        c.initiator_depth = p.initiator_depth;
        c.retry_count = p.retry_count.min(7);
        c.rnr_retry_count = p.rnr_retry_count.min(7);
        c.srq = p.srq != 0 || !id.c.srq.is_null();
        let private_data = Self::ip_private(c, user);
        let req = mad::Req {
            local_comm_id: c.comm_id,
            service_id,
            local_ca_guid: device::devices()
                .get(c.dev.unwrap_or(0))
                .map_or(0, |d| d.guid),
            local_qkey: 0,
            local_qpn: qpn & 0xff_ffff,
            responder_resources: c.responder_resources,
            initiator_depth: c.initiator_depth,
            remote_cm_response_timeout: CM_RESPONSE_TIMEOUT,
            transport: if qp_type == IBV_QPT_UC {
                mad::Transport::Uc
            } else {
                mad::Transport::Rc
            },
            flow_control: p.flow_control != 0,
            starting_psn: c.psn,
            local_cm_response_timeout: CM_RESPONSE_TIMEOUT,
            retry_count: c.retry_count,
            pkey: 0xffff,
            mtu: c.mtu as u8,
            rnr_retry_count: c.rnr_retry_count,
            max_cm_retries: MAX_CM_RETRIES,
            srq: c.srq,
            primary: self.path_of(self.conns.get(&i).ok_or(libc::EINVAL)?),
            private_data,
        };
        let m = Mad {
            tid,
            msg: Msg::Req(req),
        }
        .emit();
        self.conns.get_mut(&i).ok_or(libc::EINVAL)?.state = State::ReqSent;
        if !self.send_reliable(i, Dest::Service(service_id), m) {
            self.no_listener(i);
        }
        Ok(())
    }

    /// A REQ or SIDR_REQ to a service nobody on this host listens on: what the host's CM
    /// would have answered (REJ "invalid service ID", SIDR_REP "not supported").
    fn no_listener(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        if !device::is_local_gid(&c.dgid) {
            // Across the wire the peer host's engine answers, or the timer gives up.
            return;
        }
        c.pending = None;
        let id = c.id;
        if c.state == State::SidrReqSent {
            c.state = State::RouteResolved;
            self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, 1));
        } else {
            c.state = State::Rejected;
            self.qp_to_err(i);
            let conn = rdma_conn_param {
                private_data: std::ptr::null(),
                private_data_len: 0,
                responder_resources: 0,
                initiator_depth: 0,
                flow_control: 0,
                retry_count: 0,
                rnr_retry_count: 0,
                srq: 0,
                qp_num: 0,
            };
            let e = Event::new(
                id.cast(),
                RDMA_CM_EVENT_REJECTED,
                i32::from(mad::reason::INVALID_SERVICE_ID),
            )
            .with_conn(conn, &[0; mad::REJ_PRIVATE]);
            self.post(i, e);
        }
    }

    /// Moves id `i`'s QP to ERR (flushing its work), if it has one.
    pub fn qp_to_err(&self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        // SAFETY: the id is live; its QP, if any, is the program's and still exists (the
        // program destroys it through rdma_destroy_qp, which clears the field first).
        let qp = unsafe { (*c.id).c.qp };
        if qp.is_null() {
            return;
        }
        let Some(v) = verbs() else { return };
        // SAFETY: a zeroed attr with the state set is a valid modify request.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = IBV_QPS_ERR;
        // SAFETY: as above.
        unsafe { (v.modify_qp)(qp, &mut a, QP_STATE) };
    }

    /// The attributes to move id `i`'s QP to `state` (`rdma_init_qp_attr`).
    pub fn qp_attr(&self, i: u32, state: c_int) -> Result<(ibv_qp_attr, c_int), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        // SAFETY: zeroed attrs are a valid start.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = state;
        // SAFETY: the id is live.
        let id = unsafe { &*c.id };
        let qp_type = if id.c.qp.is_null() {
            id.c.qp_type
        } else {
            // SAFETY: the program's QP on this id.
            unsafe { (*id.c.qp).qp_type }
        };
        let ud = qp_type == IBV_QPT_UD;
        let mask = match state {
            IBV_QPS_INIT => {
                a.pkey_index = 0;
                a.port_num = 1;
                if ud {
                    a.qkey = RDMA_UDP_QKEY;
                    QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_QKEY
                } else {
                    a.qp_access_flags = ACCESS_REMOTE_WRITE;
                    if c.responder_resources > 0 {
                        a.qp_access_flags |= ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC;
                    }
                    QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS
                }
            }
            IBV_QPS_RTR if ud => QP_STATE,
            IBV_QPS_RTR => {
                if !matches!(
                    c.state,
                    State::ReqRcvd
                        | State::RepRcvd
                        | State::ReqSent
                        | State::Established
                        | State::RepSent
                ) {
                    return Err(libc::EINVAL);
                }
                a.path_mtu = c.mtu;
                a.dest_qp_num = c.remote_qpn;
                a.rq_psn = c.remote_psn;
                a.ah_attr = self.ah_of(c);
                let mut m = QP_STATE | QP_AV | QP_PATH_MTU | QP_DEST_QPN | QP_RQ_PSN;
                if qp_type == IBV_QPT_RC {
                    a.max_dest_rd_atomic = c.responder_resources;
                    a.min_rnr_timer = 0;
                    a.qp_access_flags = ACCESS_REMOTE_WRITE;
                    if c.responder_resources > 0 {
                        a.qp_access_flags |= ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC;
                    }
                    m |= QP_MAX_DEST_RD_ATOMIC | QP_MIN_RNR_TIMER | QP_ACCESS_FLAGS;
                }
                m
            }
            IBV_QPS_RTS => {
                a.sq_psn = if ud { 0 } else { c.psn };
                let mut m = QP_STATE | QP_SQ_PSN;
                if qp_type == IBV_QPT_RC {
                    a.timeout = c.ack_timeout.unwrap_or(DEFAULT_ACK_TIMEOUT);
                    a.retry_cnt = c.retry_count;
                    a.rnr_retry = c.peer_rnr_retry;
                    a.max_rd_atomic = c.initiator_depth;
                    m |= QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_MAX_QP_RD_ATOMIC;
                }
                m
            }
            _ => return Err(libc::EINVAL),
        };
        Ok((a, mask))
    }

    /// The address vector from id `i` to its peer.
    pub fn ah_of(&self, c: &Conn) -> ibv_ah_attr {
        ibv_ah_attr {
            grh: ibv_global_route {
                dgid: ibv_gid(c.dgid),
                flow_label: 0,
                sgid_index: c.gid_index as u8,
                hop_limit: 64,
                traffic_class: c.tos,
            },
            dlid: 0,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: 1,
            port_num: 1,
        }
    }

    /// Moves id `i`'s QP (if any) through `states`.
    fn modify_qp(&self, i: u32, states: &[c_int]) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        // SAFETY: the id is live.
        let qp = unsafe { (*c.id).c.qp };
        if qp.is_null() {
            return Ok(());
        }
        let v = verbs().ok_or(libc::ENOSYS)?;
        for &s in states {
            let (mut a, mask) = self.qp_attr(i, s)?;
            // SAFETY: the program's QP and a full attribute set for this transition.
            let r = unsafe { (v.modify_qp)(qp, &mut a, mask) };
            if r != 0 {
                return Err(if r > 0 { r } else { libc::EINVAL });
            }
        }
        Ok(())
    }

    /// `rdma_accept`.
    pub fn accept(
        &mut self,
        i: u32,
        p: Option<&rdma_conn_param>,
        user: &[u8],
    ) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        match c.state {
            State::SidrReqRcvd => return self.sidr_answer(i, 0, user),
            State::ReqRcvd => {}
            _ => return Err(libc::EINVAL),
        }
        if user.len() > mad::REP_PRIVATE {
            return Err(libc::EINVAL);
        }
        // SAFETY: the id is live.
        let qp = unsafe { (*c.id).c.qp };
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        if let Some(p) = p {
            // The REQ's offer bounds what we take.
            c.responder_resources = c.responder_resources.min(p.responder_resources);
            c.initiator_depth = c.initiator_depth.min(p.initiator_depth);
            c.rnr_retry_count = p.rnr_retry_count.min(7);
            if p.srq != 0 {
                c.srq = true;
            }
        }
        let qpn = if qp.is_null() {
            p.map_or(0, |p| p.qp_num)
        } else {
            // SAFETY: the program's QP on this id.
            unsafe { (*qp).qp_num }
        };
        self.modify_qp(i, &[IBV_QPS_RTR, IBV_QPS_RTS])?;
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        let rep = mad::Rep {
            local_comm_id: c.comm_id,
            remote_comm_id: c.remote_comm_id,
            local_qkey: 0,
            local_qpn: qpn & 0xff_ffff,
            starting_psn: c.psn,
            responder_resources: c.responder_resources,
            initiator_depth: c.initiator_depth,
            target_ack_delay: 0,
            flow_control: true,
            rnr_retry_count: c.rnr_retry_count,
            srq: c.srq,
            local_ca_guid: device::devices()
                .get(c.dev.unwrap_or(0))
                .map_or(0, |d| d.guid),
            private_data: user.to_vec(),
        };
        let m = Mad {
            tid: c.tid,
            msg: Msg::Rep(rep),
        }
        .emit();
        let dest = Dest::Agent(c.remote_comm_id >> 12);
        self.conns.get_mut(&i).ok_or(libc::EINVAL)?.state = State::RepSent;
        if !self.send_reliable(i, dest, m) {
            self.peer_gone(i);
        }
        Ok(())
    }

    /// `rdma_reject`.
    pub fn reject(&mut self, i: u32, user: &[u8]) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        match c.state {
            State::SidrReqRcvd => return self.sidr_answer(i, 2, user),
            State::ReqRcvd | State::RepRcvd => {}
            _ => return Err(libc::EINVAL),
        }
        if user.len() > mad::REJ_PRIVATE {
            return Err(libc::EINVAL);
        }
        let m = Mad {
            tid: c.tid,
            msg: Msg::Rej(mad::Rej {
                local_comm_id: c.comm_id,
                remote_comm_id: c.remote_comm_id,
                message_rejected: if c.state == State::RepRcvd { 1 } else { 0 },
                reason: mad::reason::CONSUMER,
                private_data: user.to_vec(),
            }),
        }
        .emit();
        let dest = Dest::Agent(c.remote_comm_id >> 12);
        self.send(i, dest, &m);
        if let Some(c) = self.conns.get_mut(&i) {
            c.state = State::Rejected;
        }
        Ok(())
    }

    fn sidr_answer(&mut self, i: u32, status: u8, user: &[u8]) -> Result<(), c_int> {
        if user.len() > mad::SIDR_REP_PRIVATE {
            return Err(libc::EINVAL);
        }
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        // SAFETY: the id is live.
        let qp = unsafe { (*c.id).c.qp };
        let qpn = if qp.is_null() {
            0
        } else {
            // SAFETY: the program's QP on this id.
            unsafe { (*qp).qp_num }
        };
        let m = Mad {
            tid: c.tid,
            msg: Msg::SidrRep(mad::SidrRep {
                request_id: c.remote_comm_id,
                status,
                qpn,
                service_id: Self::service_id(c.ps, c.src.map_or(0, |s| s.port())),
                qkey: RDMA_UDP_QKEY,
                private_data: user.to_vec(),
            }),
        }
        .emit();
        let dest = Dest::Agent(c.remote_comm_id >> 12);
        self.send(i, dest, &m);
        if let Some(c) = self.conns.get_mut(&i) {
            c.state = if status == 0 {
                State::Established
            } else {
                State::Rejected
            };
        }
        Ok(())
    }

    /// `rdma_establish` (after CONNECT_RESPONSE on an id without a QP) and `rdma_notify`.
    pub fn establish(&mut self, i: u32) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        match c.state {
            State::RepRcvd => {
                self.send_rtu(i);
                if let Some(c) = self.conns.get_mut(&i) {
                    c.state = State::Established;
                }
                self.lease(i);
                Ok(())
            }
            State::RepSent => {
                // Traffic came before the RTU: the connection is up (IBV_EVENT_COMM_EST).
                self.rtu_received(i);
                Ok(())
            }
            State::Established => Ok(()),
            _ => Err(libc::EINVAL),
        }
    }

    /// The DREQ of connection `i`.
    fn dreq_of(&self, i: u32) -> Option<[u8; mad::MAD_LEN]> {
        let c = self.conns.get(&i)?;
        Some(
            Mad {
                tid: c.tid,
                msg: Msg::Dreq(mad::Dreq {
                    local_comm_id: c.comm_id,
                    remote_comm_id: c.remote_comm_id,
                    remote_qpn: c.remote_qpn,
                    private_data: Vec::new(),
                }),
            }
            .emit(),
        )
    }

    /// Connection `i` is up with a peer on another host: its host engine keeps the DREQ,
    /// to send should this process die (see [`wire::LEASE`]).
    fn lease(&mut self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        if c.leased || device::is_local_gid(&c.dgid) {
            return;
        }
        let (sgid, dgid, dest) = (c.sgid, c.dgid, Dest::Agent(c.remote_comm_id >> 12));
        if let Some(m) = self.dreq_of(i) {
            if self.send_flagged(wire::LEASE, sgid, dgid, dest, &m) {
                if let Some(c) = self.conns.get_mut(&i) {
                    c.leased = true;
                }
            }
        }
    }

    /// Connection `i` is going down by the book: the engine forgets its lease.
    fn unlease(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        if !std::mem::replace(&mut c.leased, false) {
            return;
        }
        let (sgid, dgid, dest) = (c.sgid, c.dgid, Dest::Agent(c.remote_comm_id >> 12));
        if let Some(m) = self.dreq_of(i) {
            self.send_flagged(wire::CANCEL, sgid, dgid, dest, &m);
        }
    }

    fn send_rtu(&mut self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        let m = Mad {
            tid: c.tid,
            msg: Msg::Rtu(mad::Ids {
                local_comm_id: c.comm_id,
                remote_comm_id: c.remote_comm_id,
                private_data: Vec::new(),
            }),
        }
        .emit();
        let dest = Dest::Agent(c.remote_comm_id >> 12);
        self.send(i, dest, &m);
    }

    /// `rdma_disconnect`: QP to ERR, then DREQ (or DREP if the peer's DREQ came first).
    pub fn disconnect(&mut self, i: u32) -> Result<(), c_int> {
        let state = self.conns.get(&i).ok_or(libc::EINVAL)?.state;
        self.unlease(i);
        match state {
            State::Established | State::RepSent | State::RepRcvd => {
                self.qp_to_err(i);
                let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
                // SAFETY: the id is live.
                let qp = unsafe { (*c.id).c.qp };
                let _ = qp;
                let m = Mad {
                    tid: c.tid,
                    msg: Msg::Dreq(mad::Dreq {
                        local_comm_id: c.comm_id,
                        remote_comm_id: c.remote_comm_id,
                        remote_qpn: c.remote_qpn,
                        private_data: Vec::new(),
                    }),
                }
                .emit();
                let dest = Dest::Agent(c.remote_comm_id >> 12);
                self.conns.get_mut(&i).ok_or(libc::EINVAL)?.state = State::DreqSent;
                if !self.send_reliable(i, dest, m) {
                    self.peer_gone(i);
                }
                Ok(())
            }
            State::DreqRcvd => {
                self.qp_to_err(i);
                self.send_drep(i);
                self.enter_timewait(i);
                Ok(())
            }
            State::DreqSent | State::TimeWait => Ok(()),
            _ => Err(libc::EINVAL),
        }
    }

    fn send_drep(&mut self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        let m = Mad {
            tid: c.tid,
            msg: Msg::Drep(mad::Ids {
                local_comm_id: c.comm_id,
                remote_comm_id: c.remote_comm_id,
                private_data: Vec::new(),
            }),
        }
        .emit();
        self.send(i, Dest::Agent(c.remote_comm_id >> 12), &m);
    }

    fn enter_timewait(&mut self, i: u32) {
        if let Some(c) = self.conns.get_mut(&i) {
            c.state = State::TimeWait;
            c.pending = None;
            c.timewait_until = Some(Instant::now() + TIMEWAIT);
        }
        self.wake_agent();
    }

    /// The peer of id `i` can no longer be reached (its socket is gone): as if it had
    /// disconnected, or never answered.
    fn peer_gone(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        let id = c.id;
        c.pending = None;
        match c.state {
            State::Established | State::DreqSent | State::RepRcvd => {
                self.qp_to_err(i);
                self.enter_timewait(i);
                self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, 0));
            }
            State::RepSent => {
                if let Some(c) = self.conns.get_mut(&i) {
                    c.state = State::Rejected;
                }
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT),
                );
            }
            _ => {}
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

    // ---- Receiving -------------------------------------------------------------------------

    /// One envelope that came to socket `on` (the agent's, or listener `Some(i)`'s).
    fn handle(&mut self, listener: Option<u32>, env: Envelope) {
        log(format_args!("recv {} on {listener:?}", describe(&env.mad)));
        if env.flags & !wire::FROM_NETWORK != 0 {
            return;
        }
        let Ok(m) = Mad::parse(&env.mad) else { return };
        match m.msg {
            Msg::Req(r) => self.on_req(listener, &env, m.tid, r),
            Msg::SidrReq(r) => self.on_sidr_req(listener, &env, m.tid, r),
            Msg::Rep(r) => self.on_rep(r),
            Msg::Rtu(r) => {
                if let Some(i) = self
                    .by_comm_id(r.remote_comm_id)
                    .filter(|i| self.conns[i].remote_comm_id == r.local_comm_id)
                {
                    if self.conns[&i].state == State::RepSent {
                        self.rtu_received(i);
                    }
                }
            }
            Msg::Rej(r) => self.on_rej(r),
            Msg::Mra(r) => {
                if let Some(i) = self.by_comm_id(r.remote_comm_id) {
                    if let Some(p) = self.conns.get_mut(&i).and_then(|c| c.pending.as_mut()) {
                        p.due = Instant::now() + cm_timeout(r.service_timeout) + p.every;
                    }
                }
            }
            Msg::Dreq(r) => self.on_dreq(&env, m.tid, r),
            Msg::Drep(r) => {
                if let Some(i) = self.by_comm_id(r.remote_comm_id) {
                    if self.conns[&i].state == State::DreqSent {
                        let id = self.conns[&i].id;
                        self.enter_timewait(i);
                        self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, 0));
                    }
                }
            }
            Msg::SidrRep(r) => self.on_sidr_rep(r),
        }
    }

    fn listener_for(&self, on: Option<u32>) -> Option<u32> {
        let i = on?;
        (self.conns.get(&i)?.state == State::Listen).then_some(i)
    }

    /// A new id for a request to listener `l`, on the device the request came in on.
    fn child(&mut self, l: u32, env: &Envelope, hdr: Option<IpHeader>) -> Option<u32> {
        let lc = self.conns.get(&l)?;
        // As the kernel's rdma_cm: a backlog of 0 or less is its maximum, 1024.
        let backlog = if lc.backlog <= 0 {
            1024
        } else {
            lc.backlog.min(1024)
        } as usize;
        let waiting = self
            .conns
            .values()
            .filter(|c| {
                c.listener == Some(l) && matches!(c.state, State::ReqRcvd | State::SidrReqRcvd)
            })
            .count();
        if waiting >= backlog {
            return None;
        }
        let (channel, ps, context, sync) = {
            // SAFETY: the listener is live.
            let ctx = unsafe { (*lc.id).c.context };
            (lc.channel, lc.ps, ctx, lc.sync)
        };
        // SAFETY: the listener's id is live.
        let qp_type = unsafe { (*lc.id).c.qp_type };
        let port = lc.src.map_or(0, |s| s.port());
        let id = self.create_id(
            if sync { std::ptr::null() } else { channel },
            context,
            ps,
            qp_type,
        )?;
        // SAFETY: just made.
        let i = unsafe { (*id).index };
        if sync {
            // The request itself is reported on the listener's channel (rdma_get_request).
            if let Some(c) = self.conns.get_mut(&i) {
                let _ = c;
            }
        }
        let place = device::place_of(addr::ip_of(&env.dgid)).or_else(|| {
            let dev = self.conns.get(&l)?.dev?;
            Some(Place { dev, gid_index: 0 })
        })?;
        self.set_place(i, place);
        let c = self.conns.get_mut(&i)?;
        c.listener = Some(l);
        c.dgid = env.sgid;
        let (src_ip, dst) = match hdr {
            Some(h) => (h.dst, SocketAddr::new(h.src, h.src_port)),
            None => (
                addr::ip_of(&env.dgid),
                SocketAddr::new(addr::ip_of(&env.sgid), 0),
            ),
        };
        c.src = Some(SocketAddr::new(src_ip, port));
        c.dst = Some(dst);
        Some(i)
    }

    fn on_req(&mut self, on: Option<u32>, env: &Envelope, tid: u64, r: mad::Req) {
        // A REQ sent again: answer again what was answered.
        if let Some((&i, c)) = self.conns.iter().find(|(_, c)| {
            c.remote_comm_id == r.local_comm_id && c.dgid == env.sgid && c.listener.is_some()
        }) {
            if c.state == State::RepSent {
                if let Some(p) = &c.pending {
                    let (mad, dest) = (p.mad, p.dest);
                    self.send(i, dest, &mad);
                }
            }
            return;
        }
        let Some(l) = self.listener_for(on) else {
            self.reject_req(env, tid, &r, mad::reason::INVALID_SERVICE_ID);
            return;
        };
        let hdr = IpHeader::parse(&r.private_data);
        let Some(i) = self.child(l, env, hdr) else {
            // Over the backlog: the kernel's CM destroys the new id, which rejects the REQ.
            self.reject_req(env, tid, &r, mad::reason::CONSUMER);
            return;
        };
        let c = self.conns.get_mut(&i).expect("just made");
        c.remote_comm_id = r.local_comm_id;
        c.remote_qpn = r.local_qpn;
        c.remote_psn = r.starting_psn;
        // Our responder resources answer their initiator depth, and the other way round.
        c.responder_resources = r.initiator_depth;
        c.initiator_depth = r.responder_resources;
        c.retry_count = r.retry_count;
        c.peer_rnr_retry = r.rnr_retry_count;
        c.srq = r.srq;
        c.mtu = c.mtu.min(i32::from(r.mtu)).max(1);
        c.ack_timeout = Some(r.primary.local_ack_timeout);
        c.tid = tid;
        c.state = State::ReqRcvd;
        let id = c.id;
        let conn = rdma_conn_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            responder_resources: r.initiator_depth,
            initiator_depth: r.responder_resources,
            flow_control: u8::from(r.flow_control),
            retry_count: r.retry_count,
            rnr_retry_count: r.rnr_retry_count,
            srq: u8::from(r.srq),
            qp_num: r.local_qpn,
        };
        self.write_route_resolved(i);
        let skip = if hdr.is_some() { IpHeader::LEN } else { 0 };
        let mut e = Event::new(id.cast(), RDMA_CM_EVENT_CONNECT_REQUEST, 0)
            .with_conn(conn, &r.private_data[skip..]);
        e.ev.listen_id = self.conns[&l].id.cast();
        self.post(l, e);
    }

    fn write_route_resolved(&mut self, i: u32) {
        if let Some(c) = self.conns.get_mut(&i) {
            let s = c.state;
            c.state = State::RouteResolved;
            self.write_route(i);
            if let Some(c) = self.conns.get_mut(&i) {
                c.state = s;
            }
        }
    }

    /// The REJ a host's CM sends for a REQ that no listener takes.
    fn reject_req(&mut self, env: &Envelope, tid: u64, r: &mad::Req, reason: u16) {
        let m = Mad {
            tid,
            msg: Msg::Rej(mad::Rej {
                local_comm_id: 0,
                remote_comm_id: r.local_comm_id,
                message_rejected: 0,
                reason,
                private_data: Vec::new(),
            }),
        }
        .emit();
        self.send_from(env.dgid, env.sgid, Dest::Agent(r.local_comm_id >> 12), &m);
    }

    fn on_sidr_req(&mut self, on: Option<u32>, env: &Envelope, tid: u64, r: mad::SidrReq) {
        let refuse = |cm: &mut Cm, status: u8| {
            let m = Mad {
                tid,
                msg: Msg::SidrRep(mad::SidrRep {
                    request_id: r.request_id,
                    status,
                    qpn: 0,
                    service_id: r.service_id,
                    qkey: 0,
                    private_data: Vec::new(),
                }),
            }
            .emit();
            cm.send_from(env.dgid, env.sgid, Dest::Agent(r.request_id >> 12), &m);
        };
        let Some(l) = self.listener_for(on) else {
            refuse(self, 1);
            return;
        };
        let hdr = IpHeader::parse(&r.private_data);
        let Some(i) = self.child(l, env, hdr) else {
            refuse(self, 2);
            return;
        };
        let c = self.conns.get_mut(&i).expect("just made");
        c.remote_comm_id = r.request_id;
        c.tid = tid;
        c.state = State::SidrReqRcvd;
        let id = c.id;
        self.write_route_resolved(i);
        let c = &self.conns[&i];
        let ud = rdma_ud_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            ah_attr: self.ah_of(c),
            qp_num: 0,
            qkey: RDMA_UDP_QKEY,
        };
        let skip = if hdr.is_some() { IpHeader::LEN } else { 0 };
        let mut e = Event::new(id.cast(), RDMA_CM_EVENT_CONNECT_REQUEST, 0)
            .with_ud(ud, &r.private_data[skip..]);
        e.ev.listen_id = self.conns[&l].id.cast();
        self.post(l, e);
    }

    fn on_rep(&mut self, r: mad::Rep) {
        let Some(i) = self.by_comm_id(r.remote_comm_id) else {
            return;
        };
        let c = &self.conns[&i];
        match c.state {
            State::ReqSent => {}
            State::Established | State::RepRcvd if c.remote_comm_id == r.local_comm_id => {
                // Our RTU was lost: send it again.
                if c.state == State::Established {
                    self.send_rtu(i);
                }
                return;
            }
            _ => return,
        }
        let c = self.conns.get_mut(&i).expect("found");
        c.pending = None;
        c.remote_comm_id = r.local_comm_id;
        c.remote_qpn = r.local_qpn;
        c.remote_psn = r.starting_psn;
        c.initiator_depth = c.initiator_depth.min(r.responder_resources);
        c.peer_rnr_retry = r.rnr_retry_count;
        let id = c.id;
        // SAFETY: the id is live.
        let has_qp = unsafe { !(*id).c.qp.is_null() };
        let conn = rdma_conn_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            responder_resources: r.initiator_depth,
            initiator_depth: r.responder_resources,
            flow_control: u8::from(r.flow_control),
            retry_count: 0,
            rnr_retry_count: r.rnr_retry_count,
            srq: u8::from(r.srq),
            qp_num: r.local_qpn,
        };
        if !has_qp {
            c.state = State::RepRcvd;
            let e = Event::new(id.cast(), RDMA_CM_EVENT_CONNECT_RESPONSE, 0)
                .with_conn(conn, &r.private_data);
            self.post(i, e);
            return;
        }
        match self.modify_qp(i, &[IBV_QPS_RTR, IBV_QPS_RTS]) {
            Ok(()) => {
                self.send_rtu(i);
                self.conns.get_mut(&i).expect("found").state = State::Established;
                self.lease(i);
                let e = Event::new(id.cast(), RDMA_CM_EVENT_ESTABLISHED, 0)
                    .with_conn(conn, &r.private_data);
                self.post(i, e);
            }
            Err(errno) => {
                // Tell the peer, as librdmacm does when its QP cannot follow the REP.
                let c = &self.conns[&i];
                let m = Mad {
                    tid: c.tid,
                    msg: Msg::Rej(mad::Rej {
                        local_comm_id: c.comm_id,
                        remote_comm_id: c.remote_comm_id,
                        message_rejected: 1,
                        reason: mad::reason::CONSUMER,
                        private_data: Vec::new(),
                    }),
                }
                .emit();
                self.send(i, Dest::Agent(r.local_comm_id >> 12), &m);
                self.conns.get_mut(&i).expect("found").state = State::Rejected;
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_CONNECT_ERROR, -errno),
                );
            }
        }
    }

    fn rtu_received(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        c.pending = None;
        c.state = State::Established;
        let id = c.id;
        self.lease(i);
        self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_ESTABLISHED, 0));
    }

    fn on_rej(&mut self, r: mad::Rej) {
        let Some(i) = self.by_comm_id(r.remote_comm_id) else {
            return;
        };
        let c = self.conns.get_mut(&i).expect("found");
        if !matches!(c.state, State::ReqSent | State::RepSent | State::RepRcvd) {
            return;
        }
        c.pending = None;
        c.state = State::Rejected;
        let id = c.id;
        self.qp_to_err(i);
        let conn = rdma_conn_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            responder_resources: 0,
            initiator_depth: 0,
            flow_control: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            srq: 0,
            qp_num: 0,
        };
        let e = Event::new(id.cast(), RDMA_CM_EVENT_REJECTED, i32::from(r.reason))
            .with_conn(conn, &r.private_data);
        self.post(i, e);
    }

    fn on_dreq(&mut self, env: &Envelope, tid: u64, r: mad::Dreq) {
        let found = self
            .by_comm_id(r.remote_comm_id)
            .filter(|i| self.conns[i].remote_comm_id == r.local_comm_id);
        let Some(i) = found else {
            // No such connection (any more): the DREP the spec asks for all the same.
            let m = Mad {
                tid,
                msg: Msg::Drep(mad::Ids {
                    local_comm_id: r.remote_comm_id,
                    remote_comm_id: r.local_comm_id,
                    private_data: Vec::new(),
                }),
            }
            .emit();
            self.send_from(env.dgid, env.sgid, Dest::Agent(r.local_comm_id >> 12), &m);
            return;
        };
        let id = self.conns[&i].id;
        self.unlease(i);
        match self.conns[&i].state {
            State::Established | State::RepSent | State::RepRcvd => {
                let c = self.conns.get_mut(&i).expect("found");
                c.state = State::DreqRcvd;
                c.pending = None;
                self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, 0));
            }
            State::DreqSent => {
                // Both ends disconnected at once: each answers the other.
                self.send_drep(i);
                self.enter_timewait(i);
                self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, 0));
            }
            State::TimeWait => self.send_drep(i),
            _ => {}
        }
    }

    fn on_sidr_rep(&mut self, r: mad::SidrRep) {
        let Some(i) = self.by_comm_id(r.request_id) else {
            return;
        };
        let c = self.conns.get_mut(&i).expect("found");
        if c.state != State::SidrReqSent {
            return;
        }
        c.pending = None;
        let id = c.id;
        if r.status != 0 {
            c.state = State::RouteResolved;
            self.post(
                i,
                Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, i32::from(r.status)),
            );
            return;
        }
        c.state = State::Established;
        c.remote_qpn = r.qpn;
        c.remote_qkey = r.qkey;
        let c = &self.conns[&i];
        let ud = rdma_ud_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            ah_attr: self.ah_of(c),
            qp_num: r.qpn,
            qkey: r.qkey,
        };
        let e = Event::new(id.cast(), RDMA_CM_EVENT_ESTABLISHED, 0).with_ud(ud, &r.private_data);
        self.post(i, e);
    }

    // ---- Timers ----------------------------------------------------------------------------

    /// Runs what is due; returns when to look again.
    fn tick(&mut self) -> Duration {
        let now = Instant::now();
        let mut next = Duration::from_millis(500);
        if !self.flush() {
            next = Duration::from_millis(1);
        }
        let ids: Vec<u32> = self.conns.keys().copied().collect();
        for i in ids {
            let Some(c) = self.conns.get_mut(&i) else {
                continue;
            };
            if let Some(t) = c.timewait_until {
                if t <= now {
                    c.timewait_until = None;
                    let id = c.id;
                    self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_TIMEWAIT_EXIT, 0));
                    continue;
                }
                next = next.min(t - now);
            }
            let Some(c) = self.conns.get_mut(&i) else {
                continue;
            };
            let Some(p) = c.pending.as_mut() else {
                continue;
            };
            if p.due > now {
                next = next.min(p.due - now);
                continue;
            }
            if p.tries_left == 0 {
                c.pending = None;
                self.timed_out(i);
                continue;
            }
            p.tries_left -= 1;
            p.due = now + p.every;
            next = next.min(p.every);
            let (mad, dest) = (p.mad, p.dest);
            self.send(i, dest, &mad);
        }
        if now.duration_since(self.last_peer_check) >= PEER_CHECK {
            self.last_peer_check = now;
            self.check_local_peers();
        }
        next.min(PEER_CHECK)
    }

    fn timed_out(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        let id = c.id;
        match c.state {
            State::ReqSent | State::SidrReqSent => {
                c.state = State::RouteResolved;
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT),
                );
            }
            State::RepSent => {
                c.state = State::Rejected;
                self.qp_to_err(i);
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT),
                );
            }
            State::DreqSent => {
                self.enter_timewait(i);
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, -libc::ETIMEDOUT),
                );
            }
            _ => {}
        }
    }

    /// Connected peers on this host whose agent socket is gone died without a DREQ.
    fn check_local_peers(&mut self) {
        let gone: Vec<u32> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                matches!(
                    c.state,
                    State::Established | State::DreqSent | State::RepSent
                ) && device::is_local_gid(&c.dgid)
                    && c.remote_comm_id >> 12 != self.agent
                    && !wire::agent_alive(&self.sock, c.remote_comm_id >> 12)
            })
            .map(|(i, _)| *i)
            .collect();
        for i in gone {
            self.peer_gone(i);
        }
    }

    /// The sockets the agent thread waits on: its own, then each bound id's port socket.
    fn sockets(&self) -> Vec<(Option<u32>, c_int)> {
        use std::os::fd::AsRawFd;
        let mut v = vec![(None, self.sock.as_raw_fd())];
        for (i, c) in &self.conns {
            if let Some(s) = &c.port {
                v.push((Some(*i), s.as_raw_fd()));
            }
        }
        v
    }
}

fn agent_loop() {
    let mut buf = [0u8; 512];
    let mut wait: Option<(Vec<(Option<u32>, c_int)>, c_int, Duration)> = None;
    loop {
        // Everything but the wait runs where no registration moves heap pages (see
        // `verbs::without_moves`): this thread allocates and frees.
        let mut alive = true;
        crate::verbs::without_moves(&mut || {
            if let Some((socks, wake, _)) = &wait {
                alive = serve(socks, *wake, &mut buf);
            }
            wait = cm().map(|mut cm| {
                let t = cm.tick();
                (cm.sockets(), cm.wake.0, t)
            });
        });
        let Some((socks, wake, timeout)) = wait.as_ref().filter(|_| alive) else {
            return;
        };
        let mut fds: Vec<libc::pollfd> = socks
            .iter()
            .map(|(_, fd)| libc::pollfd {
                fd: *fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .chain([libc::pollfd {
                fd: *wake,
                events: libc::POLLIN,
                revents: 0,
            }])
            .collect();
        let ms = timeout.as_millis().clamp(1, 1000) as c_int;
        // SAFETY: a valid pollfd array of the length passed.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        // Which sockets to read is decided again under the lock: `serve` reads them all,
        // non-blocking, so the poll only paces the loop.
        drop(fds);
    }
}

/// Reads and handles what came to the agent's sockets; false when the CM is gone.
fn serve(socks: &[(Option<u32>, c_int)], wake: c_int, buf: &mut [u8; 512]) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: draining our own non-blocking pipe into a live buffer.
    while unsafe { libc::read(wake, buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
    let Some(mut cm) = cm() else { return false };
    for (listener, _) in socks {
        // The socket may have closed since: find it again.
        let sock = match listener {
            None => Some(cm.sock.as_raw_fd()),
            Some(i) => cm
                .conns
                .get(i)
                .and_then(|c| c.port.as_ref())
                .map(|s| s.as_raw_fd()),
        };
        let Some(fd) = sock else { continue };
        for _ in 0..64 {
            // SAFETY: a non-blocking receive into a live buffer.
            let n =
                unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            if n <= 0 {
                break;
            }
            if let Some(env) = Envelope::parse(&buf[..n as usize]) {
                cm.handle(*listener, env);
            }
        }
    }
    true
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
