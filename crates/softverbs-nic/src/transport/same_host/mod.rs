//! The same-host transport: the initiator executes a request itself, in its own thread,
//! against the responder's device memory.
//!
//! The responder is a QP of this process ([`Target::Local`]) or of another process on this
//! host, whose context and segments are mapped here ([`RemoteQp`], found through the host's
//! directory and kept in [`peers()`]). Either way the responder's semantics run here and the
//! target runs no code: a peer that spins on its own memory, as `ib_write_lat` does, sees the
//! bytes land. Bytes of a peer's plain (not `memfd`) memory are reached by cross-memory
//! attach (the spans [`RemoteQp`] places carry the owner's pid).

mod owner;
pub(crate) mod peers;
pub(crate) mod remote;

pub(crate) use peers::peers;
pub(crate) use remote::RemoteQp;

use super::Transport;
use crate::cq::Cqe;
use crate::device::{Device, multicast};
use crate::mr::access::Span;
use crate::mr::hazard::Lease;
use crate::mr::keys::{KeyTable, Pin};
use crate::pd::Ah;
use crate::qp::Qp;
use crate::qp::context::{QpCtx, XrcRole};
use crate::qp::request::{Leased, Reached, Request, Response};
use crate::qp::responder::{Responder, invalid_request, respond};
use crate::qp::rq::RecvWqe;
use crate::types::{AccessFlags, AhAttr, AsyncEventType, Gid, QpType};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// The same-host transport.
pub(crate) struct SameHost;

/// A responder QP: in this process, or another process's mapped here.
pub(crate) enum Target {
    Local(Arc<Qp>),
    Remote(Arc<RemoteQp>),
}

/// An XRC message's responder: the target QP's state, rights and connection, and the SRQ's
/// PD, keys, receives and CQ (IBA 14.2.4: keys are checked in the SRQ's PD).
pub(crate) struct XrcTarget<'t> {
    tgt: &'t Target,
    srq: Target,
}

impl Target {
    /// The QP context it acts on.
    fn ctx(&self) -> &QpCtx {
        match self {
            Target::Local(q) => q.ctx(),
            Target::Remote(r) => r.ctx(),
        }
    }
}

/// What a requester remembers of its connected responder. A QP of this process is held
/// weakly: a requester does not keep its responder alive. Another process's is kept as the
/// target it is (always [`Target::Remote`]), lent to each request, with the requester's
/// lease of a hazard record in that process's key table (its pins of the peer's keys are
/// published there, see [`crate::mr::hazard`]); the lease goes back with the connection.
pub(crate) enum CachedPeer {
    Local(Weak<Qp>),
    Remote(Leased<Target>),
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
    fn responder<'p>(
        &self,
        peer: &'p mut Option<CachedPeer>,
        _: &AhAttr,
        dev: &Weak<Device>,
        qpn: u32,
    ) -> Option<Reached<'p, Target>> {
        if peer.is_none() {
            *peer = Some(match find_target(&*dev.upgrade()?, qpn)? {
                Target::Local(q) => CachedPeer::Local(Arc::downgrade(&q)),
                Target::Remote(r) => {
                    let lease = Lease::take(r.key_table());
                    CachedPeer::Remote(Leased {
                        target: Target::Remote(r),
                        lease,
                    })
                }
            });
        }
        match peer.as_ref()? {
            CachedPeer::Local(w) => Some(Reached::Found(Target::Local(w.upgrade()?))),
            CachedPeer::Remote(l) => Some(Reached::Lent(l)),
        }
    }

    #[inline]
    fn warm(&self, peer: &CachedPeer) {
        // Among thousands of connections its lines are rarely in cache: the Arc clone that
        // lending replaced fetched the first one early, and without that 65,536 QPs
        // round-robin ran 20% slower. Warmed as the send lock is taken, the fetch overlaps
        // the checks of the request and of its local side.
        if let CachedPeer::Remote(Leased {
            target: Target::Remote(r),
            ..
        }) = peer
        {
            r.prefetch();
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
        respond(&XrcTarget { tgt, srq }, req)
    }

    fn release(&self, dev: &Device) {
        peers().prune(dev.config.gid);
    }
}

impl Responder for Target {
    #[inline]
    fn qpn(&self) -> u32 {
        match self {
            Target::Local(q) => q.qpn(),
            Target::Remote(r) => r.qpn(),
        }
    }
    #[inline]
    fn qp_type(&self) -> QpType {
        match self {
            Target::Local(q) => Responder::qp_type(&**q),
            Target::Remote(r) => r.qp_type(),
        }
    }
    #[inline]
    fn receiving(&self) -> bool {
        match self {
            Target::Local(q) => Responder::receiving(&**q),
            Target::Remote(r) => r.receiving(),
        }
    }
    #[inline]
    fn access(&self) -> AccessFlags {
        match self {
            Target::Local(q) => Responder::access(&**q),
            Target::Remote(r) => r.access(),
        }
    }
    #[inline]
    fn qkey(&self) -> u32 {
        match self {
            Target::Local(q) => Responder::qkey(&**q),
            Target::Remote(r) => r.qkey(),
        }
    }
    #[inline]
    fn rnr_delay(&self) -> Duration {
        match self {
            Target::Local(q) => Responder::rnr_delay(&**q),
            Target::Remote(r) => r.rnr_delay(),
        }
    }
    #[inline]
    fn pd_id(&self) -> u32 {
        match self {
            Target::Local(q) => q.pd_id(),
            Target::Remote(r) => r.pd_id(),
        }
    }
    #[inline]
    fn recv_pd(&self) -> u32 {
        match self {
            Target::Local(q) => Responder::recv_pd(&**q),
            Target::Remote(r) => r.recv_pd(),
        }
    }
    #[inline]
    fn keys(&self) -> &KeyTable {
        match self {
            Target::Local(q) => Responder::keys(&**q),
            Target::Remote(r) => r.keys(),
        }
    }
    #[inline]
    fn gid(&self) -> Gid {
        match self {
            Target::Local(q) => Responder::gid(&**q),
            Target::Remote(r) => r.gid(),
        }
    }
    #[inline]
    fn take_recv(&self) -> Option<RecvWqe> {
        match self {
            Target::Local(q) => Responder::take_recv(&**q),
            Target::Remote(r) => r.take_recv(),
        }
    }
    #[inline]
    fn push_recv(&self, cqe: Cqe) {
        match self {
            Target::Local(q) => Responder::push_recv(&**q, cqe),
            Target::Remote(r) => r.push_recv(cqe),
        }
    }
    #[inline]
    fn responder_error(&self, event: Option<AsyncEventType>) {
        match self {
            Target::Local(q) => Responder::responder_error(&**q, event),
            Target::Remote(r) => r.responder_error(event),
        }
    }
    // Always inlined, as the key checks are (see `KeyTable::pin`).
    #[inline(always)]
    fn place(&self, pin: &Pin<'_>, host: usize, len: usize) -> Option<Span> {
        match self {
            Target::Local(q) => Responder::place(&**q, pin, host, len),
            Target::Remote(r) => Responder::place(&**r, pin, host, len),
        }
    }
}

/// The target's connection, the SRQ's memory and receives.
impl Responder for XrcTarget<'_> {
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
