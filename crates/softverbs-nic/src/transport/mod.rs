//! The transport boundary: how a request gets from its requester to its responder.
//!
//! Below this module, everything is transport-independent. The core decides what a work
//! request means: the requester's semantics ([`crate::qp::requester`]: local keys, lengths,
//! the outcome of each answer) and the responder's ([`crate::qp::responder`]: QP state and
//! rights, keys, receives, the status of each failure and the responder's move to ERR). A
//! transport only carries a [`Request`] to the responder's side and a [`Response`] back, and
//! gives the responder's semantics the responder's device memory to run against: its state,
//! key table and receive queue, a way to push a completion into its CQ and to move it to
//! ERR, and whether it is still there at all ([`Responder`](crate::qp::responder::Responder)).
//!
//! The core cannot name this layer (it sits below it), so it declares what it needs as
//! [`Deliver`], and this module implements that for every QP by picking the QP's transport,
//! statically: there is no dynamic dispatch per operation. Each transport implements
//! [`Transport`].
//!
//! - [`same_host`]: the initiator runs the responder's semantics itself, in its own thread,
//!   against the target's device memory: a QP of this process, or one of another process on
//!   this host, mapped here. Nothing runs in the target.
//! - [`roce`]: RoCEv2 between hosts. A networked device's QPs are *offloaded*
//!   ([`crate::qp::request::Offload`]): the host engine, one process per device address that
//!   owns UDP port 4791, executes their requests with the sans-IO transport core of
//!   `softverbs-roce`, as a NIC would, over the QPs' device memory mapped the way the
//!   same-host transport maps a peer's ([`same_host::RemoteQp`]). The request/response
//!   shape of [`Transport`] did not fit (a response comes back much later, in packets, and
//!   the target's side runs in the engine, not in the poster), so the RoCE transport takes
//!   the whole send queue instead: the driver hands it each request and the engine
//!   completes it. The responder's checks are the core's (`softverbs_roce::transport`), its
//!   key checks the NIC's key table (`roce::engine::memory`).

pub(crate) mod roce;
pub(crate) mod same_host;

use crate::device::Device;
use crate::device_memory::segment::Segment;
use crate::pd::Ah;
use crate::qp::request::{Deliver, Reached, Request, Response};
use crate::qp::{Qp, QpCap};
use crate::types::AhAttr;
use roce::NetQp;
use same_host::SameHost;
use std::sync::{Arc, Weak};

/// What a transport provides to the core.
pub(crate) trait Transport {
    /// What an RC/UC requester remembers of its connected responder, until it is reconnected.
    type Peer;
    /// A responder, reached for one request.
    type Target;

    /// The responder an RC/UC QP is connected to: QP `qpn` at the end of path `av` (`dev`: the
    /// device of this host `av` names, if any), remembered in `peer` once found.
    fn responder<'p>(
        &self,
        peer: &'p mut Option<Self::Peer>,
        av: &AhAttr,
        dev: &Weak<Device>,
        qpn: u32,
    ) -> Option<Reached<'p, Self::Target>>;

    /// A request to the remembered responder `peer` is coming: start fetching what reaching
    /// it reads.
    fn warm(&self, peer: &Self::Peer);

    /// UD: QP `qpn` where `ah` leads, found for one message.
    fn ud_responder(&self, ah: &Ah, qpn: u32) -> Option<Self::Target>;

    /// UD to the multicast QPN: the QPs of `dev` (the sender's: its fabric) attached to
    /// the group `ah` names (its GRH's multicast GID, else its multicast LID).
    fn ud_group(&self, dev: &Arc<Device>, ah: &Ah) -> Vec<Self::Target>;

    /// Carries `req` to `to`'s side, has the responder's semantics run there, and brings the
    /// answer back.
    fn deliver(&self, to: &Self::Target, req: &Request<'_>) -> Response;

    /// XRC: carries `req` through target `tgt` of `dev` to the XRC SRQ `srqn` of its domain.
    fn deliver_xrc(
        &self,
        tgt: &Self::Target,
        dev: &Weak<Device>,
        srqn: u32,
        req: &Request<'_>,
    ) -> Response;

    /// A QP of `dev` is going away: let go of what was kept for its connections.
    fn release(&self, dev: &Device);
}

/// A QP of a networked device is offloaded to its host engine ([`roce`]), which executes its
/// requests; every other QP's requests execute at post time over the same host.
impl Deliver for Qp {
    type Peer = <SameHost as Transport>::Peer;
    type Target = <SameHost as Transport>::Target;

    #[inline]
    fn responder<'p>(
        &self,
        peer: &'p mut Option<Self::Peer>,
        av: &AhAttr,
        dev: &Weak<Device>,
        qpn: u32,
    ) -> Option<Reached<'p, Self::Target>> {
        SameHost.responder(peer, av, dev, qpn)
    }

    #[inline]
    fn warm(&self, peer: &Self::Peer) {
        SameHost.warm(peer)
    }

    #[inline]
    fn ud_responder(&self, ah: &Ah, qpn: u32) -> Option<Self::Target> {
        SameHost.ud_responder(ah, qpn)
    }

    fn ud_group(&self, ah: &Ah) -> Vec<Self::Target> {
        SameHost.ud_group(&self.dev, ah)
    }

    #[inline]
    fn deliver(&self, to: &Self::Target, req: &Request<'_>) -> Response {
        SameHost.deliver(to, req)
    }

    fn deliver_xrc(
        &self,
        tgt: &Self::Target,
        dev: &Weak<Device>,
        srqn: u32,
        req: &Request<'_>,
    ) -> Response {
        SameHost.deliver_xrc(tgt, dev, srqn, req)
    }

    fn release(&self) {
        SameHost.release(&self.dev)
    }

    type Offloaded = NetQp;

    fn offload(
        dev: &Arc<Device>,
        qpn: u32,
        ctx: &Segment,
        cap: &QpCap,
    ) -> crate::Result<Option<NetQp>> {
        match dev.config.net {
            Some(_) => NetQp::new(dev, qpn, ctx, cap).map(Some),
            None => Ok(None),
        }
    }
}
