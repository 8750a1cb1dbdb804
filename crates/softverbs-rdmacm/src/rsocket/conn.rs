//! One rsocket: its CM id and event channel, the verbs resources of its connection, and the
//! stream of [`proto`] over them.
//!
//! A connection has one CQ (send and receive) on a completion channel of its own, one
//! registered buffer cut into `nsend` send slots and `nrecv` receive slots, and an RC QP
//! made through `rdma_create_qp` on the id. Nothing runs in the background: every call on
//! the socket first polls the CQ and the CM channel ([`Inner::progress`]), and a call that
//! must wait arms the CQ, looks once more, and sleeps in `poll(2)` on the two channel fds.

use super::proto::{self, Flow, Hello, IomapMsg, Kind};
use crate::abi::*;
use crate::ibv::*;
use crate::verbs::verbs;
use core::ffi::{c_int, c_uint, c_void};
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const IBV_WR_RDMA_WRITE: c_int = 0;
const IBV_WR_SEND_WITH_IMM: c_int = 3;
const IBV_SEND_SIGNALED: c_uint = 2;
const IBV_WC_SUCCESS: c_int = 0;
const IBV_WC_WR_FLUSH_ERR: c_int = 5;
const IBV_WC_WITH_IMM: c_uint = 2;
const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
const IBV_QPT_RC: c_int = 2;

/// Bytes per slot: the most one message carries.
pub const SLOT_SIZE: usize = 32 * 1024;
/// Send-queue entries kept for control messages (credits, FIN) beyond the send slots.
const CTRL_SQ: u32 = 8;
/// The longest one wait sleeps before looking again. Threads blocked in calls on one socket
/// wake each other (see [`Socket::run`]); this bounds what is left: a thread in `rpoll` and
/// one in a blocking call on the same socket can take each other's completion event.
pub const WAIT_SLICE_MS: c_int = 50;

/// A yield that took longer than this gave the CPU to some other program for a time slice,
/// not to a peer that answers and retries at once.
const LONG_YIELD: Duration = Duration::from_micros(200);
/// The score of long yields (each adds [`LONG_WEIGHT`], each short one takes 1 away) that
/// shows another program, not the peer, shares this core.
const LONG_WEIGHT: u32 = 4;
const LONG_SCORE: u32 = 8;
/// How long EAGAIN then stops yielding.
const YIELD_BACKOFF: Duration = Duration::from_millis(20);

thread_local! {
    /// This thread's score of long yields, and until when its EAGAINs do not yield (see
    /// [`yield_to_peer`]).
    static LONG_SCORE_NOW: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    static NO_YIELD_UNTIL: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Called before EAGAIN: programs retry it at once (rstream, riostream), so this gives the
/// CPU to the peer process in case it shares this core and waits for it (two spinning
/// processes on one core otherwise move only at the scheduler's tick: 3.7 ms a transfer
/// instead of 3.8 µs). But when another busy program shares the core, each yield hands it a
/// time slice while the peer, on the other core, is ready: beside two CPU hogs on two cores,
/// rstream's default 100,000 round trips took 29 s and more instead of 0.65 s. So yields
/// that keep coming back late turn yielding off for a while, and the retries spin instead.
fn yield_to_peer() {
    let now = Instant::now();
    if NO_YIELD_UNTIL.get().is_some_and(|t| now < t) {
        return;
    }
    std::thread::yield_now();
    let back = Instant::now();
    let score = LONG_SCORE_NOW.get();
    if back - now <= LONG_YIELD {
        LONG_SCORE_NOW.set(score.saturating_sub(1));
        return;
    }
    // A peer sharing the core hands it back within microseconds; now and then the
    // scheduler's tick or a daemon makes one yield long, but another busy program makes
    // many of them long.
    let score = score + LONG_WEIGHT;
    if score >= LONG_SCORE {
        LONG_SCORE_NOW.set(0);
        NO_YIELD_UNTIL.set(Some(back + YIELD_BACKOFF));
    } else {
        LONG_SCORE_NOW.set(score);
    }
}

/// How long connection set-up steps that softverbs answers locally may take.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// `wr_id` tags: what a work request was.
const WR_RECV: u64 = 0;
const WR_SEND_SLOT: u64 = 1;
const WR_CTRL: u64 = 2;

/// Where a socket is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum St {
    Init,
    Bound,
    Listen,
    /// `rconnect` sent the REQ, or `raccept` the REP: waiting for ESTABLISHED.
    Connecting,
    Connected,
    /// The connection attempt failed (`SO_ERROR` says why).
    Failed,
}

/// Socket options, as set by the program.
#[derive(Debug, Clone, Copy)]
pub struct Opts {
    pub sndbuf: c_int,
    pub rcvbuf: c_int,
    pub reuseaddr: bool,
    pub keepalive: bool,
    pub keepidle: c_int,
    pub linger: libc::linger,
    pub nodelay: bool,
    pub maxseg: c_int,
    /// `RDMA_SQSIZE` / `RDMA_RQSIZE`: slots; 0 derives them from `SO_SNDBUF` / `SO_RCVBUF`.
    pub sqsize: u32,
    pub rqsize: u32,
    pub inline: u32,
    pub iomapsize: u32,
    pub v6only: bool,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            sndbuf: 1 << 20,
            rcvbuf: 1 << 20,
            reuseaddr: false,
            keepalive: false,
            keepidle: 7200,
            linger: libc::linger {
                l_onoff: 0,
                l_linger: 0,
            },
            nodelay: false,
            maxseg: SLOT_SIZE as c_int,
            sqsize: 0,
            rqsize: 0,
            inline: 64,
            iomapsize: 0,
            v6only: false,
        }
    }
}

impl Opts {
    /// Send and receive slots for a new connection.
    fn slots(&self) -> (u32, u32) {
        let of = |explicit: u32, bytes: c_int| {
            let n = if explicit > 0 {
                explicit
            } else {
                (bytes.max(0) as usize / SLOT_SIZE) as u32
            };
            n.clamp(proto::MIN_SLOTS, 256)
        };
        (of(self.sqsize, self.sndbuf), of(self.rqsize, self.rcvbuf))
    }
}

/// An rsocket. Its number is its event channel's fd.
pub struct Socket {
    /// The rsocket number the program holds.
    pub fd: c_int,
    inner: Mutex<Inner>,
    /// Threads waiting in a call while another one sleeps in `poll(2)` for the socket wait
    /// here; whoever sees something happen wakes them.
    cv: Condvar,
}

/// What the socket's lock guards.
pub struct Inner {
    pub st: St,
    /// `AF_INET` or `AF_INET6`, from `rsocket`.
    pub family: c_int,
    /// The socket's own CM event channel (its fd is the socket's number).
    pub channel: *mut rdma_event_channel,
    /// The socket's CM id, on `channel`.
    pub id: *mut rdma_cm_id,
    /// `O_NONBLOCK` set with `rfcntl`.
    pub nonblock: bool,
    /// What `rsetsockopt` set.
    pub opts: Opts,
    /// `SO_ERROR`: the error of a failed non-blocking connect, read once.
    pub so_error: c_int,
    /// The connection, from `rconnect` or `raccept` on.
    pub conn: Option<Box<Conn>>,
    /// `SHUT_RD`: reads return end of stream.
    pub shut_rd: bool,
    /// A thread of a blocking call sleeps in `poll(2)` on the socket's channels.
    poller: bool,
}

// SAFETY: the raw pointers are this socket's own CM and verbs objects, used under its lock.
unsafe impl Send for Inner {}

/// A received data message not yet read in full.
#[derive(Debug, Clone, Copy)]
struct Rx {
    slot: u32,
    len: u32,
    off: u32,
}

/// A window of the program's memory this side offered with `riomap`.
pub struct LocalMap {
    pub offset: u64,
    pub addr: usize,
    pub len: usize,
    pub mr: *mut ibv_mr,
}

/// The verbs resources and stream state of a connection.
pub struct Conn {
    pd: *mut ibv_pd,
    cc: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    mr: *mut ibv_mr,
    buf: *mut u8,
    buf_len: usize,
    nsend: u32,
    /// Receive slots: our window.
    pub nrecv: u32,
    free_send: Vec<u32>,
    sq_out: u32,
    sq_max: u32,
    rx: VecDeque<Rx>,
    /// Credits.
    pub flow: Flow,
    /// The peer's FIN arrived: after `rx`, the stream ends.
    pub peer_fin: bool,
    /// `SHUT_WR`: a FIN is to go (or went).
    pub fin_pending: bool,
    /// The FIN is posted.
    pub fin_sent: bool,
    /// Disconnected, or the QP failed: nothing more goes out or comes in.
    pub gone: bool,
    /// Why, if it was not an orderly disconnect.
    pub err: c_int,
    /// Windows this side `riomap`ped.
    pub local_maps: Vec<LocalMap>,
    /// Windows the peer announced, newest last.
    pub remote_maps: Vec<IomapMsg>,
}

fn last_errno() -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Makes `fd` non-blocking (the library waits with `poll`, never in a read).
pub fn set_nonblock(fd: c_int) {
    // SAFETY: fcntl on a descriptor this library owns.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
}

impl Conn {
    /// The resources for a connection on `id` (which has a device), with a QP on it.
    ///
    /// # Safety
    /// `id` is a live id of this library without a QP.
    pub unsafe fn new(id: *mut rdma_cm_id, opts: &Opts) -> Result<Box<Conn>, c_int> {
        let v = verbs().ok_or(libc::ENOSYS)?;
        // SAFETY: `id` is this socket's live id.
        let ctx = unsafe { (*id).verbs };
        if ctx.is_null() {
            return Err(libc::ENODEV);
        }
        let (nsend, nrecv) = opts.slots();
        let mut c = Box::new(Conn {
            pd: std::ptr::null_mut(),
            cc: std::ptr::null_mut(),
            cq: std::ptr::null_mut(),
            qp: std::ptr::null_mut(),
            mr: std::ptr::null_mut(),
            buf: std::ptr::null_mut(),
            buf_len: (nsend + nrecv) as usize * SLOT_SIZE,
            nsend,
            nrecv,
            free_send: (0..nsend).rev().collect(),
            sq_out: 0,
            sq_max: nsend + CTRL_SQ,
            rx: VecDeque::new(),
            flow: Flow::new(nrecv, 0),
            peer_fin: false,
            fin_pending: false,
            fin_sent: false,
            gone: false,
            err: 0,
            local_maps: Vec::new(),
            remote_maps: Vec::new(),
        });
        let r = (|| {
            // SAFETY: verbs calls on the id's open context; each object made is recorded in
            // `c` and freed by `free` on failure.
            unsafe {
                c.pd = (v.alloc_pd)(ctx);
                if c.pd.is_null() {
                    return Err(libc::ENOMEM);
                }
                c.cc = (v.create_comp_channel)(ctx);
                if c.cc.is_null() {
                    return Err(libc::ENOMEM);
                }
                set_nonblock((*c.cc).fd);
                c.cq = (v.create_cq)(
                    ctx,
                    (c.sq_max + nrecv) as c_int,
                    std::ptr::null_mut(),
                    c.cc,
                    0,
                );
                if c.cq.is_null() {
                    return Err(libc::ENOMEM);
                }
                c.buf = libc::calloc(c.buf_len, 1).cast();
                if c.buf.is_null() {
                    return Err(libc::ENOMEM);
                }
                c.mr = (v.reg_mr)(c.pd, c.buf.cast(), c.buf_len, IBV_ACCESS_LOCAL_WRITE);
                if c.mr.is_null() {
                    return Err(libc::ENOMEM);
                }
                let mut attr = ibv_qp_init_attr {
                    qp_context: std::ptr::null_mut(),
                    send_cq: c.cq,
                    recv_cq: c.cq,
                    srq: std::ptr::null_mut(),
                    cap: ibv_qp_cap {
                        max_send_wr: c.sq_max,
                        max_recv_wr: nrecv,
                        max_send_sge: 1,
                        max_recv_sge: 1,
                        max_inline_data: 0,
                    },
                    qp_type: IBV_QPT_RC,
                    sq_sig_all: 0,
                };
                if crate::api::qp::sv_rdma_create_qp(id, c.pd, &mut attr) != 0 {
                    return Err(last_errno());
                }
                c.qp = (*id).qp;
            }
            for j in 0..nrecv {
                c.post_recv(j)?;
            }
            Ok(())
        })();
        match r {
            Ok(()) => Ok(c),
            Err(e) => {
                // SAFETY: the caller's id, which the QP (if any) was made on.
                unsafe { c.free(id) };
                Err(e)
            }
        }
    }

    /// Frees everything (the QP through the id it was made on).
    ///
    /// # Safety
    /// `id` is the live id the connection was made on.
    pub unsafe fn free(&mut self, id: *mut rdma_cm_id) {
        let Some(v) = verbs() else { return };
        // SAFETY: the objects are this connection's, each freed once and nulled.
        unsafe {
            if !self.qp.is_null() {
                crate::api::qp::sv_rdma_destroy_qp(id);
                self.qp = std::ptr::null_mut();
            }
            for m in self.local_maps.drain(..) {
                (v.dereg_mr)(m.mr);
            }
            if !self.mr.is_null() {
                (v.dereg_mr)(self.mr);
                self.mr = std::ptr::null_mut();
            }
            if !self.cq.is_null() {
                self.drain_events();
                (v.destroy_cq)(self.cq);
                self.cq = std::ptr::null_mut();
            }
            if !self.cc.is_null() {
                (v.destroy_comp_channel)(self.cc);
                self.cc = std::ptr::null_mut();
            }
            if !self.pd.is_null() {
                (v.dealloc_pd)(self.pd);
                self.pd = std::ptr::null_mut();
            }
            if !self.buf.is_null() {
                libc::free(self.buf.cast());
                self.buf = std::ptr::null_mut();
            }
        }
    }

    /// The connection's PD (for `riomap`'s registrations).
    pub fn pd(&self) -> *mut ibv_pd {
        self.pd
    }

    /// The completion channel's fd, to sleep on.
    pub fn event_fd(&self) -> c_int {
        // SAFETY: our live channel.
        unsafe { (*self.cc).fd }
    }

    fn slot_ptr(&self, send: bool, j: u32) -> *mut u8 {
        let k = if send { j } else { self.nsend + j } as usize;
        // SAFETY: `k < nsend + nrecv`, inside the buffer.
        unsafe { self.buf.add(k * SLOT_SIZE) }
    }

    fn lkey(&self) -> u32 {
        // SAFETY: our live MR.
        unsafe { (*self.mr).lkey }
    }

    fn post_recv(&mut self, j: u32) -> Result<(), c_int> {
        let mut sge = ibv_sge {
            addr: self.slot_ptr(false, j) as u64,
            length: SLOT_SIZE as u32,
            lkey: self.lkey(),
        };
        let mut wr = ibv_recv_wr {
            wr_id: (WR_RECV << 32) | u64::from(j),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: our QP; its context's ops are the drop-in's, as `ibv_post_recv` inlines.
        let r = unsafe {
            let f = (*(*self.qp).context).ops.post_recv.ok_or(libc::ENOSYS)?;
            f(self.qp, &mut wr, &mut bad)
        };
        if r != 0 { Err(r) } else { Ok(()) }
    }

    /// Posts a signaled send-queue work request.
    fn post_send(
        &mut self,
        wr_id: u64,
        opcode: c_int,
        imm: u32,
        sge: Option<ibv_sge>,
        remote: (u64, u32),
    ) -> Result<(), c_int> {
        let mut sge = sge;
        let mut wr = ibv_send_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: sge
                .as_mut()
                .map_or(std::ptr::null_mut(), |s| s as *mut ibv_sge),
            num_sge: c_int::from(sge.is_some()),
            opcode,
            send_flags: IBV_SEND_SIGNALED,
            imm_data: imm.to_be(),
            wr: wr_union {
                rdma: wr_rdma {
                    remote_addr: remote.0,
                    rkey: remote.1,
                },
            },
            qp_type: 0,
            _tail: [0; 6],
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: our QP, as `ibv_post_send` inlines; the SGE names our registered buffer.
        let r = unsafe {
            let f = (*(*self.qp).context).ops.post_send.ok_or(libc::ENOSYS)?;
            f(self.qp, &mut wr, &mut bad)
        };
        if r != 0 {
            return Err(r);
        }
        self.sq_out += 1;
        Ok(())
    }

    /// Gives receive slot `j` back to the peer.
    fn repost(&mut self, j: u32) {
        match self.post_recv(j) {
            Ok(()) => self.flow.reposted(),
            Err(_) => self.gone = true,
        }
    }

    /// Polls the CQ dry, then sends the control messages that are due; whether anything
    /// completed.
    pub fn poll(&mut self) -> bool {
        if self.cq.is_null() {
            return false;
        }
        let mut any = false;
        loop {
            let mut wc = [ibv_wc::default(); 16];
            // SAFETY: our CQ and room for 16 completions, as `ibv_poll_cq` inlines.
            let n = unsafe {
                match (*(*self.cq).context).ops.poll_cq {
                    Some(f) => f(self.cq, 16, wc.as_mut_ptr()),
                    None => -1,
                }
            };
            if n <= 0 {
                break;
            }
            any = true;
            for w in &wc[..n as usize] {
                self.on_completion(w);
            }
            if n < 16 {
                break;
            }
        }
        self.send_ctrl();
        any
    }

    fn on_completion(&mut self, w: &ibv_wc) {
        let tag = w.wr_id >> 32;
        let j = w.wr_id as u32;
        if tag != WR_RECV {
            self.sq_out = self.sq_out.saturating_sub(1);
            if tag == WR_SEND_SLOT {
                self.free_send.push(j);
            }
        }
        if w.status != IBV_WC_SUCCESS {
            if !self.gone && w.status != IBV_WC_WR_FLUSH_ERR && self.err == 0 {
                self.err = libc::ECONNRESET;
            }
            self.gone = true;
            return;
        }
        if tag != WR_RECV {
            return;
        }
        let decoded = (w.wc_flags & IBV_WC_WITH_IMM != 0)
            .then(|| proto::decode(u32::from_be(w.imm_data)))
            .flatten();
        let Some((kind, credits)) = decoded else {
            // Not a softverbs rsocket on the other end.
            self.err = libc::EPROTO;
            self.gone = true;
            return;
        };
        self.flow.returned(credits);
        let len = w.byte_len.min(SLOT_SIZE as u32);
        match kind {
            Kind::Data if len > 0 => self.rx.push_back(Rx {
                slot: j,
                len,
                off: 0,
            }),
            Kind::Data | Kind::Credit => self.repost(j),
            Kind::Fin => {
                self.peer_fin = true;
                self.repost(j);
            }
            Kind::Iomap => {
                // SAFETY: `len` bytes of our receive slot `j`, which the NIC has filled.
                let b =
                    unsafe { std::slice::from_raw_parts(self.slot_ptr(false, j), len as usize) };
                if let Some(m) = IomapMsg::parse(b) {
                    self.remote_maps.retain(|x| x.offset != m.offset);
                    self.remote_maps.push(m);
                }
                self.repost(j);
            }
        }
    }

    /// Sends a pending FIN, and credits when half the window is owed.
    fn send_ctrl(&mut self) {
        if self.gone {
            return;
        }
        if self.fin_pending && !self.fin_sent && self.sq_out < self.sq_max {
            if let Some(cr) = self.flow.take_data() {
                let imm = proto::encode(Kind::Fin, cr);
                match self.post_send(WR_CTRL << 32, IBV_WR_SEND_WITH_IMM, imm, None, (0, 0)) {
                    Ok(()) => self.fin_sent = true,
                    Err(_) => self.gone = true,
                }
            }
        }
        if self.sq_out < self.sq_max {
            if let Some(cr) = self.flow.take_credit_msg() {
                let imm = proto::encode(Kind::Credit, cr);
                if self
                    .post_send(WR_CTRL << 32, IBV_WR_SEND_WITH_IMM, imm, None, (0, 0))
                    .is_err()
                {
                    self.gone = true;
                }
            }
        }
    }

    /// Whether a data message could go now.
    pub fn writable(&self) -> bool {
        !self.gone
            && !self.fin_pending
            && self.flow.can_send_data()
            && !self.free_send.is_empty()
            && self.sq_out < self.sq_max
    }

    /// Whether a read would return at once (data, or the end of the stream).
    pub fn readable(&self) -> bool {
        !self.rx.is_empty() || self.peer_fin || self.gone
    }

    /// Bytes waiting to be read.
    pub fn pending(&self) -> usize {
        self.rx.iter().map(|r| (r.len - r.off) as usize).sum()
    }

    /// Sends what fits of `data` now; the bytes taken.
    pub fn send(&mut self, data: &[u8]) -> Result<usize, c_int> {
        let mut sent = 0;
        while sent < data.len() && self.writable() {
            let n = (data.len() - sent).min(SLOT_SIZE);
            let Some(j) = self.free_send.pop() else { break };
            // SAFETY: `n` bytes into our send slot `j` from the program's buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(data[sent..].as_ptr(), self.slot_ptr(true, j), n)
            };
            let Some(cr) = self.flow.take_data() else {
                self.free_send.push(j);
                break;
            };
            let sge = ibv_sge {
                addr: self.slot_ptr(true, j) as u64,
                length: n as u32,
                lkey: self.lkey(),
            };
            let imm = proto::encode(Kind::Data, cr);
            let wr_id = (WR_SEND_SLOT << 32) | u64::from(j);
            if let Err(e) = self.post_send(wr_id, IBV_WR_SEND_WITH_IMM, imm, Some(sge), (0, 0)) {
                self.free_send.push(j);
                self.gone = true;
                return if sent > 0 { Ok(sent) } else { Err(e) };
            }
            sent += n;
        }
        Ok(sent)
    }

    /// Sends an iomap announcement if it can go now.
    pub fn send_iomap(&mut self, m: IomapMsg) -> Result<bool, c_int> {
        if !self.writable() {
            return Ok(false);
        }
        let Some(j) = self.free_send.pop() else {
            return Ok(false);
        };
        let b = m.to_bytes();
        // SAFETY: the message into our send slot `j` (a slot holds far more).
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.slot_ptr(true, j), b.len()) };
        let Some(cr) = self.flow.take_data() else {
            self.free_send.push(j);
            return Ok(false);
        };
        let sge = ibv_sge {
            addr: self.slot_ptr(true, j) as u64,
            length: b.len() as u32,
            lkey: self.lkey(),
        };
        let imm = proto::encode(Kind::Iomap, cr);
        let wr_id = (WR_SEND_SLOT << 32) | u64::from(j);
        self.post_send(wr_id, IBV_WR_SEND_WITH_IMM, imm, Some(sge), (0, 0))
            .inspect_err(|_| self.free_send.push(j))?;
        Ok(true)
    }

    /// RDMA WRITEs what fits of `data` now to the peer's `remote_addr` (rkey `rkey`).
    pub fn write_remote(
        &mut self,
        data: &[u8],
        remote_addr: u64,
        rkey: u32,
    ) -> Result<usize, c_int> {
        let mut done = 0;
        while done < data.len() && !self.gone && self.sq_out < self.sq_max {
            let Some(j) = self.free_send.pop() else { break };
            let n = (data.len() - done).min(SLOT_SIZE);
            // SAFETY: `n` bytes into our send slot `j` from the program's buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(data[done..].as_ptr(), self.slot_ptr(true, j), n)
            };
            let sge = ibv_sge {
                addr: self.slot_ptr(true, j) as u64,
                length: n as u32,
                lkey: self.lkey(),
            };
            let wr_id = (WR_SEND_SLOT << 32) | u64::from(j);
            let at = (remote_addr + done as u64, rkey);
            if let Err(e) = self.post_send(wr_id, IBV_WR_RDMA_WRITE, 0, Some(sge), at) {
                self.free_send.push(j);
                return if done > 0 { Ok(done) } else { Err(e) };
            }
            done += n;
        }
        Ok(done)
    }

    /// Copies up to `out.len()` received bytes out (leaving them with `peek`), reposting the
    /// slots read in full.
    pub fn recv(&mut self, out: &mut [u8], peek: bool) -> usize {
        let mut got = 0;
        let mut k = 0;
        while got < out.len() && k < self.rx.len() {
            let r = self.rx[k];
            let n = ((r.len - r.off) as usize).min(out.len() - got);
            // SAFETY: bytes `off..off+n` of our receive slot, which the NIC filled.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.slot_ptr(false, r.slot).add(r.off as usize),
                    out[got..].as_mut_ptr(),
                    n,
                )
            };
            got += n;
            if peek {
                k += 1;
                continue;
            }
            if r.off as usize + n == r.len as usize {
                self.rx.pop_front();
                self.repost(r.slot);
            } else {
                self.rx[0].off += n as u32;
            }
        }
        if !peek {
            self.send_ctrl();
        }
        got
    }

    /// Arms the CQ for the next completion.
    pub fn arm(&self) {
        // SAFETY: our CQ, as `ibv_req_notify_cq` inlines.
        unsafe {
            if let Some(f) = (*(*self.cq).context).ops.req_notify_cq {
                f(self.cq, 0);
            }
        }
    }

    /// Takes and acknowledges the completion events waiting on the channel.
    pub fn drain_events(&self) {
        let Some(v) = verbs() else { return };
        let mut n = 0;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut::<c_void>();
            // SAFETY: our channel, non-blocking: EAGAIN when empty.
            if unsafe { (v.get_cq_event)(self.cc, &mut cq, &mut ctx) } != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: events of our CQ, taken above.
            unsafe { (v.ack_cq_events)(self.cq, n) };
        }
    }

    /// Whether every posted send has completed.
    pub fn sends_done(&self) -> bool {
        self.sq_out == 0
    }
}

impl Socket {
    /// A socket on `channel` with `id`, numbered by the channel's fd.
    ///
    /// # Safety
    /// `channel` is a live event channel of this library and `id` a live id on it, both
    /// owned by the socket from now on.
    pub unsafe fn new(
        channel: *mut rdma_event_channel,
        id: *mut rdma_cm_id,
        family: c_int,
    ) -> Socket {
        // SAFETY: a live channel of ours.
        let fd = unsafe { (*channel).fd };
        set_nonblock(fd);
        Socket {
            fd,
            inner: Mutex::new(Inner {
                st: St::Init,
                family,
                channel,
                id,
                nonblock: false,
                opts: Opts::default(),
                so_error: 0,
                conn: None,
                shut_rd: false,
                poller: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// The socket's state, locked (a poisoned lock is taken over: the state stays usable).
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` until it gives an answer, waiting for completions and CM events between
    /// tries: `EAGAIN` at once if the socket (or the call, `dontwait`) is non-blocking,
    /// unless `always` (teardown waits whatever the mode), and `ETIMEDOUT` after `limit`.
    ///
    /// One waiting thread at a time sleeps in `poll(2)` on the channels (it takes the
    /// completion events); the others wait on the socket's condition variable, woken by any
    /// thread that sees a completion or CM event, or by the poller when it wakes. A sleep
    /// lasts at most [`WAIT_SLICE_MS`] either way.
    pub fn run<T>(
        &self,
        dontwait: bool,
        always: bool,
        limit: Option<Duration>,
        mut f: impl FnMut(&mut Inner) -> Option<Result<T, c_int>>,
    ) -> Result<T, c_int> {
        let end = limit.map(|l| Instant::now() + l);
        let mut g = self.lock();
        loop {
            if g.progress() {
                self.cv.notify_all();
            }
            if let Some(r) = f(&mut g) {
                return r;
            }
            if (g.nonblock || dontwait) && !always {
                drop(g);
                yield_to_peer();
                return Err(libc::EAGAIN);
            }
            let mut ms = WAIT_SLICE_MS;
            if let Some(end) = end {
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(libc::ETIMEDOUT);
                }
                ms = ms.min(left.as_millis() as c_int + 1);
            }
            if g.poller {
                g = self
                    .cv
                    .wait_timeout(g, Duration::from_millis(ms as u64))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                continue;
            }
            g.arm();
            if g.progress() {
                self.cv.notify_all();
            }
            if let Some(r) = f(&mut g) {
                return r;
            }
            let mut fds = g.wait_fds();
            g.poller = true;
            drop(g);
            // SAFETY: poll on our own descriptors, in a live array.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            g = self.lock();
            g.poller = false;
            if let Some(c) = &g.conn {
                c.drain_events();
            }
            self.cv.notify_all();
        }
    }

    /// Wakes every thread waiting in a call on the socket (it is being closed).
    pub fn wake_all(&self) {
        self.cv.notify_all();
    }
}

impl Inner {
    /// Polls the CQ and takes the CM events of a connecting or connected socket; whether
    /// anything happened.
    pub fn progress(&mut self) -> bool {
        let mut any = false;
        if matches!(self.st, St::Connecting | St::Connected) {
            any |= self.cm_events();
        }
        if let Some(c) = &mut self.conn {
            any |= c.poll();
        }
        any
    }

    /// Arms what a wait sleeps on.
    pub fn arm(&self) {
        if let Some(c) = &self.conn {
            c.arm();
        }
    }

    /// The descriptors a wait sleeps on: the CM channel, and the completion channel.
    pub fn wait_fds(&self) -> Vec<libc::pollfd> {
        let mut v = Vec::new();
        if !self.channel.is_null() {
            v.push(libc::pollfd {
                // SAFETY: our live event channel.
                fd: unsafe { (*self.channel).fd },
                events: libc::POLLIN,
                revents: 0,
            });
        }
        if let Some(c) = &self.conn {
            v.push(libc::pollfd {
                fd: c.event_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        v
    }

    fn cm_events(&mut self) -> bool {
        if self.channel.is_null() {
            return false;
        }
        // SAFETY: every socket's channel is one of ours (`sv_rdma_create_event_channel`
        // hands out a `Channel`, whose C struct comes first).
        let ch = unsafe { &*(self.channel as *const crate::channel::Channel) };
        // Most calls find no event: look at the queue before paying for a read(2).
        if ch.pending() == 0 {
            return false;
        }
        let mut any = false;
        loop {
            let mut ev = std::ptr::null_mut();
            // SAFETY: our channel (non-blocking) and a writable out-pointer.
            if unsafe { crate::channel::sv_rdma_get_cm_event(self.channel, &mut ev) } != 0 {
                break;
            }
            // SAFETY: a live event until acked below.
            let (kind, status, data) = unsafe {
                let e = &*ev;
                let p = e.param.conn;
                let data = if p.private_data.is_null() {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(
                        p.private_data as *const u8,
                        p.private_data_len as usize,
                    )
                    .to_vec()
                };
                (e.event, e.status, data)
            };
            // SAFETY: the event taken above, acked once.
            unsafe { crate::channel::sv_rdma_ack_cm_event(ev) };
            self.on_cm_event(kind, status, &data);
            any = true;
        }
        any
    }

    fn on_cm_event(&mut self, kind: c_int, status: c_int, data: &[u8]) {
        match (self.st, kind) {
            (St::Connecting, RDMA_CM_EVENT_ESTABLISHED) => {
                let Some(c) = &mut self.conn else { return };
                if c.flow.peer_window == 0 {
                    // The active side learns the peer's window from the REP.
                    match Hello::parse(data) {
                        Some(h) if h.slot_size as usize == SLOT_SIZE => {
                            c.flow = Flow::new(c.nrecv, h.slots);
                        }
                        _ => {
                            self.fail(libc::EPROTO);
                            return;
                        }
                    }
                }
                self.st = St::Connected;
            }
            (St::Connecting, RDMA_CM_EVENT_REJECTED) => self.fail(libc::ECONNREFUSED),
            (
                St::Connecting,
                RDMA_CM_EVENT_UNREACHABLE
                | RDMA_CM_EVENT_CONNECT_ERROR
                | RDMA_CM_EVENT_ADDR_ERROR
                | RDMA_CM_EVENT_ROUTE_ERROR,
            ) => self.fail(
                if status == -libc::ETIMEDOUT || kind == RDMA_CM_EVENT_UNREACHABLE {
                    libc::ETIMEDOUT
                } else {
                    libc::ECONNREFUSED
                },
            ),
            (St::Connecting | St::Connected, RDMA_CM_EVENT_DISCONNECTED) => {
                if self.st == St::Connecting {
                    self.fail(libc::ECONNRESET);
                } else if let Some(c) = &mut self.conn {
                    c.gone = true;
                }
            }
            _ => {}
        }
    }

    fn fail(&mut self, e: c_int) {
        self.st = St::Failed;
        self.so_error = e;
        if let Some(c) = &mut self.conn {
            c.gone = true;
        }
    }

    /// The connection, if the socket is connected.
    pub fn connected(&mut self) -> Result<&mut Conn, c_int> {
        match (self.st, self.conn.as_deref_mut()) {
            (St::Connected, Some(c)) => Ok(c),
            (St::Connecting, _) => Err(libc::EAGAIN),
            _ => Err(libc::ENOTCONN),
        }
    }

    /// Frees the connection and the id (the socket is being closed). A thread of the
    /// program still waiting in a call on the socket finds it failed (`ENOTCONN`).
    pub fn teardown(&mut self) {
        self.st = St::Failed;
        if let Some(mut c) = self.conn.take() {
            // SAFETY: the socket's id, which the connection was made on.
            unsafe { c.free(self.id) };
        }
        if !self.id.is_null() {
            // SAFETY: our id, destroyed once (this also disconnects it).
            unsafe { crate::api::id::sv_rdma_destroy_id(self.id) };
            self.id = std::ptr::null_mut();
        }
    }
}

/// Waits (up to `limit`) for a CM event of `want` on `channel`; another kind fails with
/// `ECONNREFUSED` (reject) or `ETIMEDOUT`.
///
/// # Safety
/// `channel` is a live, non-blocking event channel of this library.
pub unsafe fn wait_cm(
    channel: *mut rdma_event_channel,
    want: c_int,
    limit: Duration,
) -> Result<Vec<u8>, c_int> {
    let end = Instant::now() + limit;
    loop {
        let mut ev = std::ptr::null_mut();
        // SAFETY: our channel (non-blocking) and a writable out-pointer.
        if unsafe { crate::channel::sv_rdma_get_cm_event(channel, &mut ev) } == 0 {
            // SAFETY: a live event until acked.
            let (kind, data) = unsafe {
                let e = &*ev;
                let p = e.param.conn;
                let data = if p.private_data.is_null() {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(
                        p.private_data as *const u8,
                        p.private_data_len as usize,
                    )
                    .to_vec()
                };
                (e.event, data)
            };
            // SAFETY: acked once.
            unsafe { crate::channel::sv_rdma_ack_cm_event(ev) };
            if kind == want {
                return Ok(data);
            }
            return Err(match kind {
                RDMA_CM_EVENT_REJECTED => libc::ECONNREFUSED,
                RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR => libc::EHOSTUNREACH,
                _ => libc::ETIMEDOUT,
            });
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(libc::ETIMEDOUT);
        }
        let mut p = libc::pollfd {
            // SAFETY: our live channel.
            fd: unsafe { (*channel).fd },
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        unsafe { libc::poll(&mut p, 1, left.as_millis().min(1000) as c_int + 1) };
    }
}

/// The connection's private data for the peer.
pub fn hello(c: &Conn) -> [u8; proto::HELLO_LEN] {
    Hello {
        slots: c.nrecv,
        slot_size: SLOT_SIZE as u32,
    }
    .to_bytes()
}

/// `IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE`, for iomapped windows.
pub const IOMAP_ACCESS: c_int = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
