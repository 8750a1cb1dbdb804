//! The responder's semantics: what a request means at the QP it reaches.
//!
//! Which checks apply there (the QP's type and state, its access rights, the key, PD, bounds
//! and rights of the region, a posted receive and its length, the Q_Key), which status each
//! failure gives the requester, and when the responder goes to the error state (with which
//! async event). Written once over [`Responder`], the responder QP's device memory as the
//! party running these functions reaches it: a QP of this process, or one a transport maps
//! from elsewhere. Bytes move only after every check passed, through the memory accessor.

use super::Qp;
use super::request::{Request, Response};
use super::rq::RecvWqe;
use super::wr::SendOp;
use crate::cq::Cqe;
use crate::device::Device;
use crate::mr::access::{self, AtomicOp, Span};
use crate::mr::keys::{KeyTable, Pin};
use crate::mr::ordering::Placement;
use crate::mr::resolve::{Pinned, pin_range, pin_sges};
use crate::types::{
    AccessFlags, AhAttr, AsyncEventType, GRH_LEN, Gid, QpType, WcFlags, WcOpcode, WcStatus,
};
use std::time::Duration;

/// A responder QP as the party executing a request reaches it.
pub(crate) trait Responder {
    fn qpn(&self) -> u32;
    fn qp_type(&self) -> QpType;
    /// True while it accepts messages: in RTR, RTS, SQD or SQE, and there (a peer's process
    /// still runs and the QP still exists).
    fn receiving(&self) -> bool;
    /// Its QP access rights (`qp_access_flags`).
    fn access(&self) -> AccessFlags;
    fn qkey(&self) -> u32;
    /// How long a requester waits after it answered "no receive posted".
    fn rnr_delay(&self) -> Duration;
    /// Its PD, and the PD its receive SGEs are checked against (its SRQ's).
    fn pd_id(&self) -> u32;
    fn recv_pd(&self) -> u32;
    /// The key table of its device.
    fn keys(&self) -> &KeyTable;
    /// The GID of its device.
    fn gid(&self) -> Gid;
    /// Takes its oldest posted receive (from its SRQ, if it has one).
    fn take_recv(&self) -> Option<RecvWqe>;
    /// Pushes a receive completion into its CQ, signalling as its owner would; a completion
    /// lost to overrun is fatal to it.
    fn push_recv(&self, cqe: Cqe);
    /// The responder's side of an error: it goes to ERR, its receives are flushed, and it
    /// gets `event`.
    fn responder_error(&self, event: Option<AsyncEventType>);
    /// Where `len` pinned bytes at owner address `host` (inside `pin`'s registration, or a
    /// plain buffer of a layout `pin` holds) are, as the executing process reaches them.
    fn place(&self, pin: &Pin<'_>, host: usize, len: usize) -> Option<Span>;
}

/// This process's own QP as a responder.
impl Responder for Qp {
    #[inline]
    fn qpn(&self) -> u32 {
        self.qpn
    }
    #[inline]
    fn qp_type(&self) -> QpType {
        self.qp_type
    }
    #[inline]
    fn receiving(&self) -> bool {
        Qp::receiving(self)
    }
    #[inline]
    fn access(&self) -> AccessFlags {
        Qp::access(self)
    }
    #[inline]
    fn qkey(&self) -> u32 {
        Qp::qkey(self)
    }
    #[inline]
    fn rnr_delay(&self) -> Duration {
        Qp::rnr_delay(self)
    }
    #[inline]
    fn pd_id(&self) -> u32 {
        self.pd.id
    }
    #[inline]
    fn recv_pd(&self) -> u32 {
        Qp::recv_pd(self)
    }
    #[inline]
    fn keys(&self) -> &KeyTable {
        Qp::keys(self)
    }
    #[inline]
    fn gid(&self) -> Gid {
        self.dev.config.gid
    }
    #[inline]
    fn take_recv(&self) -> Option<RecvWqe> {
        Qp::take_recv(self)
    }
    #[inline]
    fn push_recv(&self, cqe: Cqe) {
        Qp::push_recv(self, cqe)
    }
    #[inline]
    fn responder_error(&self, event: Option<AsyncEventType>) {
        Qp::responder_error(self, event)
    }
    #[inline]
    fn place(&self, pin: &Pin<'_>, host: usize, len: usize) -> Option<Span> {
        self.place_local(pin, host, len)
    }
}

/// Executes `req` at `target`: the checks, the bytes, the receive completion, the error
/// state. What comes back is all the requester learns.
pub(crate) fn respond<R: Responder>(target: &R, req: &Request<'_>) -> Response {
    if target.qp_type() != req.qp_type.responder_type() || !target.receiving() {
        return Response::Dropped;
    }
    if let Some(ud) = &req.datagram {
        if ud.qkey != target.qkey() {
            return Response::Dropped;
        }
        // A datagram to a group carries the group's GID as its destination.
        let dgid = match ud.av.grh {
            Some(g) if crate::device::multicast::is_multicast(&g.dgid) => g.dgid,
            _ => target.gid(),
        };
        let grh = build_grh(ud.sgid, dgid, ud.av, req.len);
        return deliver_send(target, req, Some((&grh, ud.grh)));
    }
    let access = target.access();
    match req.op {
        SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => {
            deliver_send(target, req, None)
        }
        SendOp::RdmaWrite { remote_addr, rkey }
        | SendOp::RdmaWriteWithImm {
            remote_addr, rkey, ..
        } => write(target, req, access, remote_addr, rkey),
        SendOp::RdmaRead { remote_addr, rkey } => read(target, req, access, remote_addr, rkey),
        SendOp::CmpSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        } => atomic(
            target,
            req,
            access,
            remote_addr,
            rkey,
            AtomicOp::CmpSwap { compare, swap },
        ),
        SendOp::AtomicWrite {
            remote_addr,
            rkey,
            value,
        } => atomic_write(target, req, access, remote_addr, rkey, value),
        SendOp::Flush {
            remote_addr,
            rkey,
            len,
            whole_region,
            ..
        } => flush(target, req, remote_addr, rkey, len, whole_region),
        SendOp::FetchAdd {
            remote_addr,
            rkey,
            add,
        } => atomic(
            target,
            req,
            access,
            remote_addr,
            rkey,
            AtomicOp::FetchAdd { add },
        ),
        // Never sent: binds and local invalidation execute at their requester
        // (`requester::execute`).
        SendOp::BindLayout { .. } | SendOp::BindMw { .. } | SendOp::LocalInv { .. } => {
            Response::Nak(WcStatus::RemInvReqErr)
        }
    }
}

/// XRC: a message naming an SRQ that is not in its target's domain is an invalid request
/// of the target's (which goes to ERR).
pub(crate) fn invalid_request<R: Responder>(target: &R, req: &Request<'_>) -> Response {
    if target.qp_type() != req.qp_type.responder_type() || !target.receiving() {
        return Response::Dropped;
    }
    error(target, req, WcStatus::RemInvReqErr, REQ_ERR)
}

/// An error at the responder: RC reports `status` to the requester and moves the responder
/// to ERR with `event`; UC drops the message silently.
fn error<R: Responder>(
    target: &R,
    req: &Request<'_>,
    status: WcStatus,
    event: Option<AsyncEventType>,
) -> Response {
    if req.qp_type.is_reliable() {
        target.responder_error(event);
        Response::Nak(status)
    } else {
        Response::Dropped
    }
}

/// No receive posted: RC answers with an RNR NAK; UC and UD drop the message.
fn no_receive<R: Responder>(target: &R, req: &Request<'_>) -> Response {
    match req.qp_type {
        t if t.is_reliable() => Response::Rnr(target.rnr_delay()),
        _ => Response::Dropped,
    }
}

/// Pins `len` bytes of the responder's region `rkey` at `addr` with `need` for `req`, placed
/// where the executing process reaches them; `None` is a remote access error. A layout key
/// resolves to its pieces. Always inlined, as [`KeyTable::pin`] is.
#[inline(always)]
fn remote_range<'t, R: Responder>(
    target: &'t R,
    req: &Request<'_>,
    rkey: u32,
    addr: u64,
    len: u64,
    need: AccessFlags,
) -> Option<Pinned<'t>> {
    pin_range(
        target.keys(),
        target.pd_id(),
        target.qpn(),
        rkey,
        addr,
        len,
        need,
        req.pin_by(),
        #[inline(always)]
        |p, h, n| target.place(p, h, n),
    )
}

const REQ_ERR: Option<AsyncEventType> = Some(AsyncEventType::QpReqErr);

/// A transfer whose keys all checked out failed while moving bytes: an unmapped page of an
/// on-demand region (EFAULT) is the remote access error real ODP reports; anything else (a
/// peer that cannot be reached) a remote operational error.
fn placement_failed<R: Responder>(target: &R, req: &Request<'_>, errno: i32) -> Response {
    if errno == libc::EFAULT {
        error(target, req, WcStatus::RemAccessErr, ACCESS_ERR)
    } else {
        error(target, req, WcStatus::RemOpErr, None)
    }
}
const ACCESS_ERR: Option<AsyncEventType> = Some(AsyncEventType::QpAccessErr);

fn write<R: Responder>(
    target: &R,
    req: &Request<'_>,
    access: AccessFlags,
    remote_addr: u64,
    rkey: u32,
) -> Response {
    let len = req.len;
    if !access.contains(AccessFlags::REMOTE_WRITE) {
        return error(target, req, WcStatus::RemInvReqErr, REQ_ERR);
    }
    // A zero-length WRITE checks no key (IBA 9.4.4).
    let remote = if len > 0 {
        match remote_range(
            target,
            req,
            rkey,
            remote_addr,
            len,
            AccessFlags::REMOTE_WRITE,
        ) {
            Some(r) => Some(r),
            None => return error(target, req, WcStatus::RemAccessErr, ACCESS_ERR),
        }
    } else {
        None
    };
    let wqe = match req.op.imm() {
        Some(_) => match target.take_recv() {
            Some(r) => Some(r),
            None => return no_receive(target, req),
        },
        None => None,
    };
    if let Some(dst) = &remote {
        // SAFETY: the sources are the requester's pinned registrations or inline bytes; the
        // destination was checked against the responder's key table and is pinned (and, for
        // a peer, mapped or reached by cross-memory attach).
        if let Err(errno) =
            unsafe { place(req.placer, &req.local.spans, dst.spans(), dst.placement()) }
        {
            return placement_failed(target, req, errno);
        }
    }
    if let (Some(r), Some(imm)) = (wqe, req.op.imm()) {
        target.push_recv(Cqe {
            wr_id: r.wr_id,
            status: WcStatus::Success as u8,
            opcode: WcOpcode::RecvRdmaWithImm as u8,
            byte_len: len as u32,
            imm_data: imm,
            wc_flags: WcFlags::WITH_IMM.bits() as u8,
            ..recv_cqe_base(target, req)
        });
    }
    Response::Ack
}

fn read<R: Responder>(
    target: &R,
    req: &Request<'_>,
    access: AccessFlags,
    remote_addr: u64,
    rkey: u32,
) -> Response {
    let len = req.len;
    if !access.contains(AccessFlags::REMOTE_READ) {
        return error(target, req, WcStatus::RemInvReqErr, REQ_ERR);
    }
    if len > 0 {
        let Some(src) = remote_range(
            target,
            req,
            rkey,
            remote_addr,
            len,
            AccessFlags::REMOTE_READ,
        ) else {
            return error(target, req, WcStatus::RemAccessErr, ACCESS_ERR);
        };
        // SAFETY: the source is pinned in the responder's registration with REMOTE_READ; the
        // destinations are the requester's pinned registrations, checked with LOCAL_WRITE.
        let local = req.local;
        if let Err(errno) =
            unsafe { place(req.placer, src.spans(), &local.spans, local.placement()) }
        {
            return placement_failed(target, req, errno);
        }
    }
    Response::Ack
}

fn atomic<R: Responder>(
    target: &R,
    req: &Request<'_>,
    access: AccessFlags,
    remote_addr: u64,
    rkey: u32,
    op: AtomicOp,
) -> Response {
    match word(
        target,
        req,
        access,
        remote_addr,
        rkey,
        AccessFlags::REMOTE_ATOMIC,
    ) {
        // SAFETY: 8 aligned bytes inside a pinned REMOTE_ATOMIC registration, mapped here.
        Ok((addr, _pin)) => Response::Atomic(unsafe { access::atomic(addr, op) }),
        Err(refused) => refused,
    }
}

/// RDMA FLUSH with global placement: see [`KeyTable::flush`].
fn flush<R: Responder>(
    target: &R,
    req: &Request<'_>,
    remote_addr: u64,
    rkey: u32,
    len: u32,
    whole_region: bool,
) -> Response {
    let (pd, qpn) = (target.pd_id(), target.qpn());
    match target
        .keys()
        .flush(rkey, pd, qpn, remote_addr, u64::from(len), whole_region)
    {
        Ok(()) => Response::Ack,
        Err(_) => error(target, req, WcStatus::RemAccessErr, ACCESS_ERR),
    }
}

/// RDMA ATOMIC WRITE: as an atomic, with the write right.
fn atomic_write<R: Responder>(
    target: &R,
    req: &Request<'_>,
    access: AccessFlags,
    remote_addr: u64,
    rkey: u32,
    value: u64,
) -> Response {
    match word(
        target,
        req,
        access,
        remote_addr,
        rkey,
        AccessFlags::REMOTE_WRITE,
    ) {
        Ok((addr, _pin)) => {
            // SAFETY: 8 aligned bytes inside a pinned REMOTE_WRITE registration, mapped here.
            unsafe { access::store_u64(addr, value) };
            Response::Ack
        }
        Err(refused) => refused,
    }
}

/// The 8-byte word an atomic or an ATOMIC WRITE at `remote_addr` reaches, pinned, when the
/// QP's rights (`access`) and the region's grant `need`; else the error response.
///
/// post_send rejects unaligned remote IOVAs, but a region registered at an IOVA with a
/// different alignment than its address could still map to an unaligned address, and a
/// layout may put the 8 bytes across two data (more than one span) or at an unaligned datum.
/// A peer's plain (unmapped) memory cannot be updated in one piece; an on-demand region of
/// this process is reached as ours, and its page must be mapped.
fn word<'t, R: Responder>(
    target: &'t R,
    req: &Request<'_>,
    access: AccessFlags,
    remote_addr: u64,
    rkey: u32,
    need: AccessFlags,
) -> Result<(usize, Pinned<'t>), Response> {
    if !access.contains(need) {
        return Err(error(target, req, WcStatus::RemInvReqErr, REQ_ERR));
    }
    let Some(remote) = remote_range(target, req, rkey, remote_addr, 8, need) else {
        return Err(error(target, req, WcStatus::RemAccessErr, ACCESS_ERR));
    };
    let w = match remote.spans() {
        [w] => *w,
        _ => Span::local(1, 0), // refused just below
    };
    let mapped_here = w.pid == 0 || w.pid == std::process::id();
    if w.addr % 8 != 0 || !mapped_here || w.len != 8 || w.count != 1 {
        return Err(error(target, req, WcStatus::RemInvReqErr, REQ_ERR));
    }
    if w.pid != 0 && !access::mapped(w.addr, 8) {
        return Err(error(target, req, WcStatus::RemAccessErr, ACCESS_ERR));
    }
    Ok((w.addr, remote))
}

/// What every receive completion of `req` carries.
fn recv_cqe_base<R: Responder>(target: &R, req: &Request<'_>) -> Cqe {
    Cqe {
        qp_num: target.qpn(),
        src_qp: req.src_qpn,
        slid: req.slid,
        sl: req.sl,
        solicited: u8::from(req.solicited),
        ..Cqe::default()
    }
}

/// Delivers a SEND into the target's next receive. `grh` is prepended for UD.
fn deliver_send<R: Responder>(
    target: &R,
    req: &Request<'_>,
    grh: Option<(&[u8; GRH_LEN], bool)>,
) -> Response {
    let Some(r) = target.take_recv() else {
        return no_receive(target, req);
    };
    let (mut flags, imm) = match req.op.imm() {
        Some(imm) => (WcFlags::WITH_IMM, imm),
        None => (WcFlags::empty(), 0),
    };
    let base = recv_cqe_base(target, req);
    // The receiver's failure: its receive completes in error; RC and UC responders go to
    // ERR (UD ones do not), and an RC requester learns `status`.
    let fail = |recv_status: WcStatus, status: WcStatus| {
        target.push_recv(Cqe {
            wr_id: r.wr_id,
            status: recv_status as u8,
            opcode: WcOpcode::Recv as u8,
            ..base
        });
        match req.qp_type {
            QpType::Ud => Response::Dropped,
            QpType::Uc => {
                target.responder_error(None);
                Response::Dropped
            }
            _ => {
                target.responder_error(None);
                Response::Nak(status)
            }
        }
    };
    let dst = match pin_sges(
        target.keys(),
        target.recv_pd(),
        &r.sges,
        AccessFlags::LOCAL_WRITE,
        req.pin_by(),
        #[inline(always)]
        |p, h, n| target.place(p, h, n),
    ) {
        Ok(d) => d,
        Err(_) => return fail(WcStatus::LocProtErr, WcStatus::RemOpErr),
    };
    let src: &[Span] = &req.local.spans;
    let mut total = req.len;
    // Only a datagram's GRH makes a list of its own: an RC or UC SEND allocates nothing here.
    let with_grh: Vec<Span>;
    let sources = match grh {
        Some((g, present)) => {
            total += GRH_LEN as u64;
            if present {
                flags |= WcFlags::GRH;
            }
            with_grh = std::iter::once(Span::of(g))
                .chain(src.iter().copied())
                .collect();
            &with_grh[..]
        }
        None => src,
    };
    if dst.len < total {
        return fail(WcStatus::LocLenErr, WcStatus::RemInvReqErr);
    }
    // SAFETY: sources are the requester's pinned registrations, inline bytes or the GRH
    // buffer; the destinations are the receiver's registrations, checked with LOCAL_WRITE and
    // pinned.
    if unsafe { place(req.placer, sources, &dst.spans, dst.placement()) }.is_err() {
        return fail(WcStatus::LocAccessErr, WcStatus::RemOpErr);
    }
    let mut imm = imm;
    if let SendOp::SendWithInv { rkey } = req.op {
        // After the data, before the completion: the next request already finds the window
        // invalid. A key that cannot be invalidated is an invalid request (IBA 9.4.1.1.1),
        // and soft-RoCE's receive status.
        if target
            .keys()
            .invalidate_window(rkey, target.pd_id())
            .is_err()
        {
            return fail(WcStatus::RemInvReqErr, WcStatus::RemInvReqErr);
        }
        flags |= WcFlags::WITH_INV;
        imm = rkey;
    }
    target.push_recv(Cqe {
        wr_id: r.wr_id,
        status: WcStatus::Success as u8,
        opcode: WcOpcode::Recv as u8,
        byte_len: total as u32,
        imm_data: imm,
        wc_flags: flags.bits() as u8,
        ..base
    });
    Response::Ack
}

/// Copies a message the way its destination asks (strict, relaxed or scrambled by the
/// ordering check, which reports each piece to `placer`'s observer). All of it is placed on
/// return, before the work request completes and before the QP's next work request executes:
/// relaxed data never passes a later atomic or completion.
///
/// # Safety
/// As for `access::copy_ordered`.
#[inline]
unsafe fn place(
    placer: &Device,
    src: &[Span],
    dst: &[Span],
    placement: Placement,
) -> Result<usize, i32> {
    let observer = match placement {
        Placement::Scrambled => placer.ordering_observer(),
        _ => None,
    };
    // SAFETY: forwarded from the caller.
    unsafe { access::copy_placed(src, dst, placement, observer.as_deref()) }
}

/// The 40-byte IBA global route header a UD receiver finds before the payload.
fn build_grh(sgid: Gid, dgid: Gid, av: &AhAttr, len: u64) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    let (tclass, flow, hop) = av
        .grh
        .map_or((0, 0, 64), |r| (r.traffic_class, r.flow_label, r.hop_limit));
    let word0: u32 = 6 << 28 | u32::from(tclass) << 20 | (flow & 0xf_ffff);
    g[0..4].copy_from_slice(&word0.to_be_bytes());
    g[4..6].copy_from_slice(&(len as u16).to_be_bytes());
    g[6] = 0x1b; // next header: IBA transport
    g[7] = hop;
    g[8..24].copy_from_slice(&sgid.0);
    g[24..40].copy_from_slice(&dgid.0);
    g
}
