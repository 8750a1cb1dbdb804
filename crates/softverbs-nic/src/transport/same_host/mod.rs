//! The same-host transport: the initiator executes a request itself, in its own thread,
//! against the responder's device memory.
//!
//! The responder is a QP of this process ([`Target::Local`]) or of another process on this
//! host, whose context and segments are mapped here ([`RemoteQp`], found through the host's
//! directory and kept in [`peers()`]). Either way the responder's semantics run here and the
//! target runs no code: a peer that spins on its own memory, as `ib_write_lat` does, sees the
//! bytes land. Bytes of a peer's plain (not `memfd`) memory are reached by cross-memory
//! attach (the spans [`RemoteQp`] places carry the owner's pid).

pub(crate) mod peers;
pub(crate) mod remote;

pub(crate) use peers::peers;
pub(crate) use remote::RemoteQp;

use super::Transport;
use crate::cq::Cqe;
use crate::device::{Device, multicast};
use crate::mr::access::Span;
use crate::mr::keys::{KeyTable, Pin};
use crate::pd::Ah;
use crate::qp::Qp;
use crate::qp::context::{QpCtx, XrcRole};
use crate::qp::request::{Request, Response};
use crate::qp::responder::{Responder, invalid_request, respond};
use crate::qp::rq::RecvWqe;
use crate::types::{AccessFlags, AhAttr, AsyncEventType, Gid, QpType};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// The same-host transport.
pub(crate) struct SameHost;

/// A responder QP: in this process, or another process's mapped here; or for XRC, a target
/// QP with the SRQ a message names.
pub(crate) enum Target {
    Local(Arc<Qp>),
    Remote(Arc<RemoteQp>),
    Xrc(Box<XrcTarget>),
}

/// An XRC message's responder: the target QP's state, rights and connection, and the SRQ's
/// PD, keys, receives and CQ (IBA 14.2.4: keys are checked in the SRQ's PD).
pub(crate) struct XrcTarget {
    tgt: Target,
    srq: Target,
}

impl Target {
    /// The QP context it acts on.
    fn ctx(&self) -> &QpCtx {
        match self {
            Target::Local(q) => q.ctx(),
            Target::Remote(r) => r.ctx(),
            Target::Xrc(x) => x.tgt.ctx(),
        }
    }
}

/// What a requester remembers of its connected responder. A QP of this process is held
/// weakly: a requester does not keep its responder alive.
pub(crate) enum CachedPeer {
    Local(Weak<Qp>),
    Remote(Arc<RemoteQp>),
}

/// Finds QP `qpn` of `dev`: here, or in another process on this host.
fn find_target(dev: &Device, qpn: u32) -> Option<Target> {
    if let Some(q) = dev.find_qp::<Qp>(qpn) {
        return Some(Target::Local(q));
    }
    peers()
        .get(dev.config.gid, qpn, dev.clock)
        .map(Target::Remote)
}

impl Transport for SameHost {
    type Peer = CachedPeer;
    type Target = Target;

    #[inline]
    fn responder(
        &self,
        peer: &mut Option<CachedPeer>,
        _: &AhAttr,
        dev: &Weak<Device>,
        qpn: u32,
    ) -> Option<Target> {
        match peer {
            Some(CachedPeer::Local(w)) => Some(Target::Local(w.upgrade()?)),
            Some(CachedPeer::Remote(r)) => Some(Target::Remote(r.clone())),
            None => {
                let found = find_target(&*dev.upgrade()?, qpn)?;
                *peer = Some(match &found {
                    Target::Local(q) => CachedPeer::Local(Arc::downgrade(q)),
                    Target::Remote(r) => CachedPeer::Remote(r.clone()),
                    Target::Xrc(_) => return None,
                });
                Some(found)
            }
        }
    }

    #[inline]
    fn ud_responder(&self, ah: &Ah, qpn: u32) -> Option<Target> {
        find_target(&*ah.target.upgrade()?, qpn)
    }

    fn ud_group(&self, dev: &Arc<Device>, ah: &Ah) -> Vec<Target> {
        let a = &ah.attr;
        let group = match a.grh {
            Some(g) if multicast::is_multicast(&g.dgid) => multicast::Group::Gid(g.dgid),
            _ if a.dlid >= multicast::MIN_MLID && a.dlid != 0xffff => multicast::Group::Lid(a.dlid),
            _ => return Vec::new(),
        };
        multicast::members(dev.config.gid, group)
            .into_iter()
            .filter_map(|qpn| find_target(dev, qpn))
            .collect()
    }

    #[inline]
    fn deliver(&self, to: &Target, req: &Request<'_>) -> Response {
        respond(to, req)
    }

    fn deliver_xrc(
        &self,
        tgt: &Target,
        dev: &Weak<Device>,
        srqn: u32,
        req: &Request<'_>,
    ) -> Response {
        let Some(domain) = tgt.ctx().xrc_domain(XrcRole::Target) else {
            return Response::Dropped;
        };
        let srq = dev
            .upgrade()
            .and_then(|d| find_target(&d, srqn))
            .filter(|s| s.ctx().is_xrc(XrcRole::Srq, domain));
        let Some(srq) = srq else {
            return invalid_request(tgt, req);
        };
        let tgt = match tgt {
            Target::Local(q) => Target::Local(q.clone()),
            Target::Remote(r) => Target::Remote(r.clone()),
            Target::Xrc(_) => return Response::Dropped,
        };
        respond(&Target::Xrc(Box::new(XrcTarget { tgt, srq })), req)
    }

    fn release(&self, dev: &Device) {
        peers().prune(dev.config.gid);
    }
}

/// `$body` with `$t` bound to the responder of each kind of [`Target`].
macro_rules! each_target {
    ($self:expr, $t:ident => $body:expr) => {
        match $self {
            Target::Local($t) => {
                let $t: &Qp = $t;
                $body
            }
            Target::Remote($t) => {
                let $t: &RemoteQp = $t;
                $body
            }
            Target::Xrc($t) => {
                let $t: &XrcTarget = $t;
                $body
            }
        }
    };
}

impl Responder for Target {
    #[inline]
    fn qpn(&self) -> u32 {
        each_target!(self, t => Responder::qpn(t))
    }
    #[inline]
    fn qp_type(&self) -> QpType {
        each_target!(self, t => Responder::qp_type(t))
    }
    #[inline]
    fn receiving(&self) -> bool {
        each_target!(self, t => Responder::receiving(t))
    }
    #[inline]
    fn access(&self) -> AccessFlags {
        each_target!(self, t => Responder::access(t))
    }
    #[inline]
    fn qkey(&self) -> u32 {
        each_target!(self, t => Responder::qkey(t))
    }
    #[inline]
    fn rnr_delay(&self) -> Duration {
        each_target!(self, t => Responder::rnr_delay(t))
    }
    #[inline]
    fn pd_id(&self) -> u32 {
        each_target!(self, t => Responder::pd_id(t))
    }
    #[inline]
    fn recv_pd(&self) -> u32 {
        each_target!(self, t => Responder::recv_pd(t))
    }
    #[inline]
    fn keys(&self) -> &KeyTable {
        each_target!(self, t => Responder::keys(t))
    }
    #[inline]
    fn gid(&self) -> Gid {
        each_target!(self, t => Responder::gid(t))
    }
    #[inline]
    fn take_recv(&self) -> Option<RecvWqe> {
        each_target!(self, t => Responder::take_recv(t))
    }
    #[inline]
    fn push_recv(&self, cqe: Cqe) {
        each_target!(self, t => Responder::push_recv(t, cqe))
    }
    #[inline]
    fn responder_error(&self, event: Option<AsyncEventType>) {
        each_target!(self, t => Responder::responder_error(t, event))
    }
    #[inline]
    fn place(&self, pin: &Pin<'_>, host: usize, len: usize) -> Option<Span> {
        each_target!(self, t => Responder::place(t, pin, host, len))
    }
}

/// The target's connection, the SRQ's memory and receives.
impl Responder for XrcTarget {
    fn qpn(&self) -> u32 {
        self.tgt.qpn()
    }
    fn qp_type(&self) -> QpType {
        self.tgt.qp_type()
    }
    fn receiving(&self) -> bool {
        self.tgt.receiving() && self.srq.receiving()
    }
    fn access(&self) -> AccessFlags {
        self.tgt.access()
    }
    fn qkey(&self) -> u32 {
        self.tgt.qkey()
    }
    fn rnr_delay(&self) -> Duration {
        self.tgt.rnr_delay()
    }
    fn pd_id(&self) -> u32 {
        self.srq.pd_id()
    }
    fn recv_pd(&self) -> u32 {
        self.srq.recv_pd()
    }
    fn keys(&self) -> &KeyTable {
        self.srq.keys()
    }
    fn gid(&self) -> Gid {
        self.tgt.gid()
    }
    fn take_recv(&self) -> Option<RecvWqe> {
        self.srq.take_recv()
    }
    fn push_recv(&self, cqe: Cqe) {
        self.srq.push_recv(cqe)
    }
    fn responder_error(&self, event: Option<AsyncEventType>) {
        self.tgt.responder_error(event)
    }
    fn place(&self, pin: &Pin<'_>, host: usize, len: usize) -> Option<Span> {
        self.srq.place(pin, host, len)
    }
}
