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
//! - RoCEv2 (`transport/roce/`, from the sans-IO protocol core in `softverbs-roce`): its
//!   [`Transport::responder`] and [`Transport::ud_responder`] take the path's address (the
//!   GID of another host) where the same-host transport takes the device of this host it
//!   names; [`Transport::deliver`] hands the request to the protocol core, which reads
//!   the requester's spans into packets; on the target's host the host engine, which maps
//!   the QP contexts of the processes it serves (demultiplexed by QPN through
//!   [`crate::device::directory`]), runs [`crate::qp::responder::respond`] against a
//!   `Responder` over that mapping, with the packets' payload as the request's spans, and
//!   sends the answer back as an ACK, NAK or READ/atomic response. A response comes back
//!   later than the call, so that transport will answer "in flight" and complete the work
//!   request when the ACK arrives, the way the driver already keeps a request queued through
//!   an RNR wait. Nothing in this boundary requires the requester to map the responder's
//!   memory: a request's spans are read where the request is executed, whoever that is.

pub(crate) mod same_host;

use crate::device::Device;
use crate::pd::Ah;
use crate::qp::Qp;
use crate::qp::request::{Deliver, Request, Response};
use crate::types::AhAttr;
use same_host::SameHost;
use std::sync::Weak;

/// What a transport provides to the core.
pub(crate) trait Transport {
    /// What an RC/UC requester remembers of its connected responder, until it is reconnected.
    type Peer;
    /// A responder, reached for one request.
    type Target;

    /// The responder an RC/UC QP is connected to: QP `qpn` at the end of path `av` (`dev`: the
    /// device of this host `av` names, if any), remembered in `peer` once found.
    fn responder(
        &self,
        peer: &mut Option<Self::Peer>,
        av: &AhAttr,
        dev: &Weak<Device>,
        qpn: u32,
    ) -> Option<Self::Target>;

    /// UD: QP `qpn` where `ah` leads, found for one message.
    fn ud_responder(&self, ah: &Ah, qpn: u32) -> Option<Self::Target>;

    /// Carries `req` to `to`'s side, has the responder's semantics run there, and brings the
    /// answer back.
    fn deliver(&self, to: &Self::Target, req: &Request<'_>) -> Response;

    /// A QP of `dev` is going away: let go of what was kept for its connections.
    fn release(&self, dev: &Device);
}

/// Every QP's requests travel over the same host for now; RoCE devices will be told apart
/// here, by the QP's device, with an enum over the two transports' peers and targets.
impl Deliver for Qp {
    type Peer = <SameHost as Transport>::Peer;
    type Target = <SameHost as Transport>::Target;

    #[inline]
    fn responder(
        &self,
        peer: &mut Option<Self::Peer>,
        av: &AhAttr,
        dev: &Weak<Device>,
        qpn: u32,
    ) -> Option<Self::Target> {
        SameHost.responder(peer, av, dev, qpn)
    }

    #[inline]
    fn ud_responder(&self, ah: &Ah, qpn: u32) -> Option<Self::Target> {
        SameHost.ud_responder(ah, qpn)
    }

    #[inline]
    fn deliver(&self, to: &Self::Target, req: &Request<'_>) -> Response {
        SameHost.deliver(to, req)
    }

    fn release(&self) {
        SameHost.release(&self.dev)
    }
}
