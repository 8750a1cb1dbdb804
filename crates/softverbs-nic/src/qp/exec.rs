//! Requester and responder logic: one work request executed against its target QP.
//!
//! The initiator runs both halves. It checks its own SGEs, finds the responder QP (in this
//! process, or mapped from another through `peer`), checks the responder's rules (state, QP
//! access rights, key, PD, bounds, posted receive) and only then moves bytes, through `mem`.
//! Every failure becomes a completion status on the side that the verbs specification charges
//! with it, and the responder side of an RC error also moves the responder QP to ERR with its
//! async event.

use crate::cq::Cqe;
use crate::device::{Device, MAX_MSG_SIZE};
use crate::mr::access::{self, AtomicOp, Span};
use crate::mr::keys::{KeyTable, Pin};
use crate::mr::ordering::Placement;
use crate::mr::resolve::{self, Pinned, Spans, pin_sges};
use crate::qp::rq::RecvWqe;
use crate::qp::wr::{Payload, SendOp, SendWqe};
use crate::qp::{Outcome, Qp, SendState};
use crate::transport::same_host::RemoteQp;
use crate::types::{
    AccessFlags, AsyncEventType, Gid, LinkLayer, QpState, QpType, SendFlags, WcFlags, WcOpcode,
    WcStatus, rnr_timer_micros,
};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Bytes reserved at the start of every UD receive buffer for the GRH.
pub const GRH_LEN: usize = 40;

/// A responder QP: in this process, or another process's mapped here.
pub(crate) enum Target {
    Local(Arc<Qp>),
    Remote(Arc<RemoteQp>),
}

/// What a requester remembers of its connected responder.
pub(crate) enum CachedPeer {
    Local(Weak<Qp>),
    Remote(Arc<RemoteQp>),
}

/// Finds QP `qpn` of `dev`: here, or in another process on this host.
pub(crate) fn find_target(dev: &Device, qpn: u32) -> Option<Target> {
    if let Some(q) = dev.find_qp::<Qp>(qpn) {
        return Some(Target::Local(q));
    }
    crate::transport::same_host::peers()
        .get(dev.config.gid, qpn, dev.clock)
        .map(Target::Remote)
}

impl Target {
    fn qpn(&self) -> u32 {
        match self {
            Target::Local(q) => q.qpn,
            Target::Remote(r) => r.qpn(),
        }
    }
    fn qp_type(&self) -> QpType {
        match self {
            Target::Local(q) => q.qp_type,
            Target::Remote(r) => r.qp_type(),
        }
    }
    fn receiving(&self) -> bool {
        match self {
            Target::Local(q) => q.receiving(),
            Target::Remote(r) => {
                let s = r.state();
                r.alive()
                    && [QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe]
                        .iter()
                        .any(|&ok| ok as u32 == s)
            }
        }
    }
    fn access(&self) -> AccessFlags {
        match self {
            Target::Local(q) => q.access(),
            Target::Remote(r) => r.access(),
        }
    }
    fn qkey(&self) -> u32 {
        match self {
            Target::Local(q) => q.qkey(),
            Target::Remote(r) => r.qkey(),
        }
    }
    fn rnr_delay(&self) -> Duration {
        match self {
            Target::Local(q) => q.rnr_delay(),
            Target::Remote(r) => Duration::from_micros(rnr_timer_micros(r.min_rnr_timer())),
        }
    }
    fn take_recv(&self) -> Option<RecvWqe> {
        match self {
            Target::Local(q) => q.take_recv(),
            Target::Remote(r) => r.take_recv(),
        }
    }
    fn pd(&self) -> u32 {
        match self {
            Target::Local(q) => q.pd.id,
            Target::Remote(r) => r.pd(),
        }
    }
    fn recv_pd(&self) -> u32 {
        match self {
            Target::Local(q) => q.recv_pd(),
            Target::Remote(r) => r.recv_pd(),
        }
    }
    fn keys(&self) -> &KeyTable {
        match self {
            Target::Local(q) => &q.dev.keys,
            Target::Remote(r) => r.keys(),
        }
    }
    fn push_recv(&self, cqe: Cqe) {
        match self {
            Target::Local(q) => q.push_recv(cqe),
            Target::Remote(r) => r.push_recv(cqe),
        }
    }
    fn responder_error(&self, event: Option<AsyncEventType>) {
        match self {
            Target::Local(q) => q.responder_error(event),
            Target::Remote(r) => r.responder_error(event),
        }
    }
    fn gid(&self) -> Gid {
        match self {
            Target::Local(q) => q.dev.config.gid,
            Target::Remote(r) => r.gid(),
        }
    }
    /// Where `len` pinned bytes at owner address `host` (inside `pin`'s registration, or
    /// a plain buffer of a layout `pin` holds) are, as this process reaches them.
    fn place(&self, pin: &Pin<'_>, host: usize, len: usize) -> Option<Span> {
        match self {
            Target::Local(_) => Some(Span::local(host, len)),
            Target::Remote(r) => r.place(pin, host, len).ok(),
        }
    }
}

impl Qp {
    fn local<'a>(
        &'a self,
        payload: &'a Payload<'_>,
        need: AccessFlags,
    ) -> Result<Spans<'a>, WcStatus> {
        match payload {
            Payload::Inline(bytes) => Ok(Spans {
                spans: vec![Span::of(bytes)],
                pins: Vec::new(),
                len: bytes.len() as u64,
            }),
            Payload::Sges(sges) => pin_sges(&self.dev.keys, self.pd.id, sges, need, |_, h, n| {
                Some(Span::local(h, n))
            })
            .map_err(|_| WcStatus::LocProtErr),
        }
    }

    /// The connected responder, if it is on this host and accepting messages.
    ///
    /// Once found, the responder is remembered until the QP is reconnected: if it goes away,
    /// a QP that later takes its number (here or in another process) is a stranger whose
    /// PSNs would not match, so nothing is delivered to it and the requester times out.
    fn peer(&self, st: &mut SendState) -> Option<Target> {
        let peer = match &st.peer {
            Some(CachedPeer::Local(w)) => Target::Local(w.upgrade()?),
            Some(CachedPeer::Remote(r)) => Target::Remote(r.clone()),
            None => {
                let p = find_target(&*st.peer_dev.upgrade()?, st.attr.dest_qp_num)?;
                st.peer = Some(match &p {
                    Target::Local(q) => CachedPeer::Local(Arc::downgrade(q)),
                    Target::Remote(r) => CachedPeer::Remote(r.clone()),
                });
                p
            }
        };
        (peer.qp_type() == self.qp_type && peer.receiving() && self.dev.port_active())
            .then_some(peer)
    }

    /// A message that reached no one: RC waits for an ACK that never comes; UC and UD
    /// complete successfully, as their packets are simply lost.
    fn lost(&self, len: u64) -> Outcome {
        match self.qp_type {
            QpType::Rc => Outcome::NoAck,
            _ => Outcome::Done(WcStatus::Success, len as u32),
        }
    }

    /// Responder-side error: RC reports `status` to the requester and moves the responder to
    /// ERR; UC drops the message silently.
    fn remote_error(
        &self,
        target: &Target,
        status: WcStatus,
        event: Option<AsyncEventType>,
        len: u64,
    ) -> Outcome {
        if self.qp_type == QpType::Rc {
            target.responder_error(event);
            Outcome::Done(status, 0)
        } else {
            Outcome::Done(WcStatus::Success, len as u32)
        }
    }

    /// Pins `len` bytes of the responder's region `rkey` at `addr` with `need`, and places
    /// them; `None` is a remote access error. A layout key resolves to its pieces.
    fn remote_range<'t>(
        target: &'t Target,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Option<Pinned<'t>> {
        resolve::pin_range(
            target.keys(),
            target.pd(),
            rkey,
            addr,
            len,
            need,
            |p, h, n| target.place(p, h, n),
        )
    }

    pub(crate) fn execute(&self, st: &mut SendState, w: &SendWqe<'_>) -> Outcome {
        if let SendOp::BindLayout { key } = w.op {
            return self.bind_layout(key);
        }
        let need = if w.op.writes_local() {
            AccessFlags::LOCAL_WRITE
        } else {
            AccessFlags::empty()
        };
        let local = match self.local(&w.payload, need) {
            Ok(l) => l,
            Err(status) => return Outcome::Done(status, 0),
        };
        if local.len > u64::from(MAX_MSG_SIZE) {
            return Outcome::Done(WcStatus::LocLenErr, 0);
        }
        if self.qp_type == QpType::Ud {
            return self.execute_ud(st, w, &local);
        }
        let Some(target) = self.peer(st) else {
            return self.lost(local.len);
        };
        let len = local.len;
        let access = target.access();
        let req_err = Some(AsyncEventType::QpReqErr);
        let acc_err = Some(AsyncEventType::QpAccessErr);
        match w.op {
            SendOp::Send | SendOp::SendWithImm { .. } => {
                self.deliver_send(&target, w, &local.spans, len, None, st.attr.ah_attr.sl)
            }
            SendOp::RdmaWrite { remote_addr, rkey }
            | SendOp::RdmaWriteWithImm {
                remote_addr, rkey, ..
            } => {
                if !access.contains(AccessFlags::REMOTE_WRITE) {
                    return self.remote_error(&target, WcStatus::RemInvReqErr, req_err, len);
                }
                // A zero-length WRITE checks no key (IBA 9.4.4).
                let remote = if len > 0 {
                    match Self::remote_range(
                        &target,
                        rkey,
                        remote_addr,
                        len,
                        AccessFlags::REMOTE_WRITE,
                    ) {
                        Some(r) => Some(r),
                        None => {
                            return self.remote_error(
                                &target,
                                WcStatus::RemAccessErr,
                                acc_err,
                                len,
                            );
                        }
                    }
                } else {
                    None
                };
                let wqe = match w.op.imm() {
                    Some(_) => match target.take_recv() {
                        Some(r) => Some(r),
                        None => return self.no_receive(&target, len),
                    },
                    None => None,
                };
                if let Some(dst) = &remote {
                    // SAFETY: local sources are pinned registrations or inline bytes we own;
                    // the destination was checked against the responder's key table and is
                    // pinned (and, for a peer, mapped or reached by cross-memory attach).
                    if unsafe { self.place(&local.spans, dst.spans(), dst.placement()) }.is_err() {
                        return self.remote_error(&target, WcStatus::RemOpErr, None, len);
                    }
                }
                if let (Some(r), Some(imm)) = (wqe, w.op.imm()) {
                    target.push_recv(Cqe {
                        wr_id: r.wr_id,
                        status: WcStatus::Success as u8,
                        opcode: WcOpcode::RecvRdmaWithImm as u8,
                        byte_len: len as u32,
                        imm_data: imm,
                        wc_flags: WcFlags::WITH_IMM.bits() as u8,
                        ..self.recv_cqe_base(&target, w, st.attr.ah_attr.sl)
                    });
                }
                Outcome::Done(WcStatus::Success, len as u32)
            }
            SendOp::RdmaRead { remote_addr, rkey } => {
                if !access.contains(AccessFlags::REMOTE_READ) {
                    return self.remote_error(&target, WcStatus::RemInvReqErr, req_err, len);
                }
                if len > 0 {
                    let Some(src) = Self::remote_range(
                        &target,
                        rkey,
                        remote_addr,
                        len,
                        AccessFlags::REMOTE_READ,
                    ) else {
                        return self.remote_error(&target, WcStatus::RemAccessErr, acc_err, len);
                    };
                    // SAFETY: the source is pinned in the responder's registration with
                    // REMOTE_READ; the destinations are pinned local registrations with
                    // LOCAL_WRITE.
                    if unsafe { self.place(src.spans(), &local.spans, local.placement()) }.is_err()
                    {
                        return self.remote_error(&target, WcStatus::RemOpErr, None, len);
                    }
                }
                Outcome::Done(WcStatus::Success, len as u32)
            }
            SendOp::CmpSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => self.atomic(
                &target,
                remote_addr,
                rkey,
                AtomicOp::CmpSwap { compare, swap },
                &local,
            ),
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => self.atomic(
                &target,
                remote_addr,
                rkey,
                AtomicOp::FetchAdd { add },
                &local,
            ),
            SendOp::BindLayout { key } => self.bind_layout(key), // handled above
        }
    }

    /// A layout bind: the staged layout of container `key` takes effect now, in the QP's
    /// program order.
    fn bind_layout(&self, key: u32) -> Outcome {
        let bound = self
            .dev
            .layouts
            .find(key)
            .is_some_and(|mr| mr.bind(&self.dev.keys, &self.dev.layouts, self.pd.id));
        if bound {
            Outcome::Done(WcStatus::Success, 0)
        } else {
            Outcome::Done(WcStatus::MwBindErr, 0)
        }
    }

    fn atomic(
        &self,
        target: &Target,
        remote_addr: u64,
        rkey: u32,
        op: AtomicOp,
        local: &Spans<'_>,
    ) -> Outcome {
        let len = local.len;
        if !target.access().contains(AccessFlags::REMOTE_ATOMIC) {
            return self.remote_error(
                target,
                WcStatus::RemInvReqErr,
                Some(AsyncEventType::QpReqErr),
                len,
            );
        }
        let Some(remote) =
            Self::remote_range(target, rkey, remote_addr, 8, AccessFlags::REMOTE_ATOMIC)
        else {
            return self.remote_error(
                target,
                WcStatus::RemAccessErr,
                Some(AsyncEventType::QpAccessErr),
                len,
            );
        };
        // post_send rejects unaligned remote IOVAs, but a region registered at an IOVA with a
        // different alignment than its address could still map to an unaligned address, and
        // a layout may put the 8 bytes across two data (more than one span) or at an
        // unaligned datum. A peer's plain (unmapped) memory cannot be updated atomically.
        let word = match remote.spans() {
            [w] => *w,
            _ => Span::local(1, 0), // refused just below
        };
        if word.addr % 8 != 0 || word.pid != 0 || word.len != 8 || word.count != 1 {
            return self.remote_error(
                target,
                WcStatus::RemInvReqErr,
                Some(AsyncEventType::QpReqErr),
                len,
            );
        }
        // SAFETY: 8 aligned bytes inside a pinned REMOTE_ATOMIC registration, mapped here.
        let original = unsafe { access::atomic(word.addr, op) };
        let bytes = original.to_ne_bytes();
        // SAFETY: the destination spans are pinned local LOCAL_WRITE registrations totalling
        // 8 bytes (checked at post); all local, so the copy cannot fail.
        let _ = unsafe { access::copy_ordered(&[Span::of(&bytes)], &local.spans) };
        Outcome::Done(WcStatus::Success, 8)
    }

    /// Copies a message the way its destination asks (strict, relaxed or scrambled by the
    /// ordering check, which reports each piece to this device's observer). All of it is
    /// placed on return, before the work request completes and before the QP's next work
    /// request executes: relaxed data never passes a later atomic or completion.
    ///
    /// # Safety
    /// As for `access::copy_ordered`.
    #[inline]
    unsafe fn place(&self, src: &[Span], dst: &[Span], placement: Placement) -> Result<usize, i32> {
        let observer = match placement {
            Placement::Scrambled => self.dev.ordering_observer(),
            _ => None,
        };
        // SAFETY: forwarded from the caller.
        unsafe { access::copy_placed(src, dst, placement, observer.as_deref()) }
    }

    /// RC: no receive posted means an RNR NAK; UC: the message is dropped.
    fn no_receive(&self, target: &Target, len: u64) -> Outcome {
        match self.qp_type {
            QpType::Rc => Outcome::Rnr(target.rnr_delay()),
            _ => Outcome::Done(WcStatus::Success, len as u32),
        }
    }

    /// What every receive completion of `w` carries; `sl` is the service level the message
    /// travelled on (the QP's path for RC/UC, the address handle's for UD).
    fn recv_cqe_base(&self, target: &Target, w: &SendWqe<'_>, sl: u8) -> Cqe {
        let lid = match self.dev.config.link_layer {
            LinkLayer::InfiniBand => self.dev.config.lid,
            LinkLayer::Ethernet => 0,
        };
        Cqe {
            qp_num: target.qpn(),
            src_qp: self.qpn,
            slid: lid,
            sl,
            solicited: u8::from(w.flags.contains(SendFlags::SOLICITED)),
            ..Cqe::default()
        }
    }

    /// Delivers a SEND into the target's next receive. `grh` is prepended for UD.
    fn deliver_send(
        &self,
        target: &Target,
        w: &SendWqe<'_>,
        src: &[Span],
        len: u64,
        grh: Option<(&[u8; GRH_LEN], bool)>,
        sl: u8,
    ) -> Outcome {
        let Some(r) = target.take_recv() else {
            return self.no_receive(target, len);
        };
        let (mut flags, imm) = match w.op.imm() {
            Some(imm) => (WcFlags::WITH_IMM, imm),
            None => (WcFlags::empty(), 0),
        };
        let base = self.recv_cqe_base(target, w, sl);
        // The receiver's failure: its receive completes in error; RC and UC responders go to
        // ERR (UD ones do not), and an RC requester learns `status`.
        let fail = |recv_status: WcStatus, status: WcStatus| {
            target.push_recv(Cqe {
                wr_id: r.wr_id,
                status: recv_status as u8,
                opcode: WcOpcode::Recv as u8,
                ..base
            });
            match self.qp_type {
                QpType::Ud => Outcome::Done(WcStatus::Success, len as u32),
                QpType::Uc => {
                    target.responder_error(None);
                    Outcome::Done(WcStatus::Success, len as u32)
                }
                QpType::Rc => {
                    target.responder_error(None);
                    Outcome::Done(status, 0)
                }
            }
        };
        let dst = match pin_sges(
            target.keys(),
            target.recv_pd(),
            &r.sges,
            AccessFlags::LOCAL_WRITE,
            |p, h, n| target.place(p, h, n),
        ) {
            Ok(d) => d,
            Err(_) => return fail(WcStatus::LocProtErr, WcStatus::RemOpErr),
        };
        let mut sources: Vec<Span> = Vec::with_capacity(src.len() + 1);
        let mut total = len;
        if let Some((g, present)) = grh {
            sources.push(Span::of(g));
            total += GRH_LEN as u64;
            if present {
                flags |= WcFlags::GRH;
            }
        }
        sources.extend_from_slice(src);
        if dst.len < total {
            return fail(WcStatus::LocLenErr, WcStatus::RemInvReqErr);
        }
        // SAFETY: sources are pinned local registrations, inline bytes or the GRH buffer; the
        // destinations are the receiver's registrations, checked with LOCAL_WRITE and pinned.
        if unsafe { self.place(&sources, &dst.spans, dst.placement()) }.is_err() {
            return fail(WcStatus::LocAccessErr, WcStatus::RemOpErr);
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
        Outcome::Done(WcStatus::Success, len as u32)
    }

    fn execute_ud(&self, st: &SendState, w: &SendWqe<'_>, local: &Spans<'_>) -> Outcome {
        let Some(ud) = &w.ud else {
            return Outcome::Done(WcStatus::LocQpOpErr, 0);
        };
        let len = local.len;
        // UD messages are single packets: at most the port's MTU (UD has no path MTU).
        if len > u64::from(self.dev.config.active_mtu.bytes()) {
            return Outcome::Done(WcStatus::LocLenErr, 0);
        }
        let delivered = Outcome::Done(WcStatus::Success, len as u32);
        if !self.dev.port_active() {
            return delivered;
        }
        let Some(target) = ud
            .ah
            .target
            .upgrade()
            .and_then(|d| find_target(&d, ud.remote_qpn))
            .filter(|t| t.qp_type() == QpType::Ud && t.receiving())
        else {
            return delivered;
        };
        // A Q_Key with the high bit set means "use the QP's own Q_Key" (IBA 10.2.5).
        let qkey = if ud.remote_qkey & 0x8000_0000 != 0 {
            st.attr.qkey
        } else {
            ud.remote_qkey
        };
        if qkey != target.qkey() {
            return delivered;
        }
        let present = ud.ah.attr.grh.is_some() || self.dev.config.link_layer == LinkLayer::Ethernet;
        let grh = build_grh(self.dev.config.gid, target.gid(), &ud.ah.attr, len);
        self.deliver_send(
            &target,
            w,
            &local.spans,
            len,
            Some((&grh, present)),
            ud.ah.attr.sl,
        )
    }
}

/// The 40-byte IBA global route header a UD receiver finds before the payload.
fn build_grh(sgid: Gid, dgid: Gid, av: &crate::types::AhAttr, len: u64) -> [u8; GRH_LEN] {
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
