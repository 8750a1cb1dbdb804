//! A request on its way from a requester to its responder, the answer that comes back, and
//! what carries them ([`Deliver`]).
//!
//! This is what a transport carries. The spans in a request are reachable by whoever runs the
//! responder's semantics: on the same host that is the initiator itself, so they are the
//! requester's own buffers; a transport whose responder runs elsewhere (RoCE: the host engine
//! on the target's host) moves the bytes in packets and hands the responder the spans of what
//! arrived.

use super::Qp;
use super::attr::{QpAttr, QpCap};
use super::wr::{SendOp, SendWqe};
use crate::device::Device;
use crate::device_memory::segment::Segment;
use crate::error::Result;
use crate::mr::hazard::Lease;
use crate::mr::keys::{KeyTable, PinBy};
use crate::mr::resolve::Spans;
use crate::pd::Ah;
use crate::types::{AhAttr, Gid, QpState, QpType, WcOpcode, WcStatus};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// A request as its responder receives it.
pub(crate) struct Request<'a> {
    /// The requester's QP number and type (the responder's type must be the same).
    pub(crate) src_qpn: u32,
    pub(crate) qp_type: QpType,
    /// What to do, with the responder's address and key, immediate data, atomic operands.
    pub(crate) op: SendOp,
    /// The message length: bytes sent (SEND, WRITE) or asked for (READ; 8 for atomics).
    pub(crate) len: u64,
    /// The requester's buffers: where a SEND's or WRITE's bytes come from, and where a READ's
    /// go.
    pub(crate) local: &'a Spans<'a>,
    /// The SEND carries the solicited-event bit.
    pub(crate) solicited: bool,
    /// The service level the message travels on, and the sender's port LID (0 on RoCE).
    pub(crate) sl: u8,
    pub(crate) slid: u16,
    /// UD: what the datagram's headers say.
    pub(crate) datagram: Option<Datagram<'a>>,
    /// The device that moves the bytes; its ordering observer sees scrambled placements.
    pub(crate) placer: &'a Device,
    /// The requester's lease of a hazard record in its connected responder's key table:
    /// pins of that table's keys are published there instead of counted.
    pub(crate) hazard: Option<&'a Lease<KeyTable>>,
}

impl Request<'_> {
    /// How the responder's pins for this request hold deregistration off.
    #[inline(always)]
    pub(crate) fn pin_by(&self) -> PinBy<'_> {
        match self.hazard {
            Some(lease) => PinBy::Hazard(lease),
            None => PinBy::Count,
        }
    }
}

/// The headers of a UD message that its receiver checks and sees.
pub(crate) struct Datagram<'a> {
    /// The Q_Key the message carries (already the sender's own when it asked for that).
    pub(crate) qkey: u32,
    /// The sender's GID and the address vector it sent with: the receiver's GRH.
    pub(crate) sgid: Gid,
    pub(crate) av: &'a AhAttr,
    /// The receiver's completion says a GRH is present.
    pub(crate) grh: bool,
}

/// What the requester learns of its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Response {
    /// Done.
    Ack,
    /// An atomic was done; this was the original value.
    Atomic(u64),
    /// RC: the responder refused the request; the requester completes with this status.
    Nak(WcStatus),
    /// RC: the responder had no receive posted; try again after this delay.
    Rnr(Duration),
    /// Nothing came back: no responder accepted the message (UC and UD responders drop what
    /// they refuse, without a word).
    Dropped,
}

/// A connected responder as the requester reaches it for one request: lent from what the QP
/// remembers of its connection (the send lock is held meanwhile), so a request touches no
/// reference count (two locked instructions of a 64-byte WRITE), or found for this request.
pub(crate) enum Reached<'p, T> {
    /// The remembered responder, with the requester's hazard lease in its key table. One
    /// pointer to both: a wider `Reached`, built in memory and copied, stalled store
    /// forwarding on every request.
    Lent(&'p Leased<T>),
    Found(T),
}

/// A remembered responder and the requester's lease of a hazard record in its key table
/// (see [`crate::mr::hazard`]), which goes back when the connection is forgotten.
pub(crate) struct Leased<T> {
    pub(crate) target: T,
    pub(crate) lease: Option<Lease<KeyTable>>,
}

impl<T> Reached<'_, T> {
    /// The requester's hazard lease in the responder's key table, if it holds one.
    #[inline(always)]
    pub(crate) fn hazard(&self) -> Option<&Lease<KeyTable>> {
        match self {
            Reached::Lent(l) => l.lease.as_ref(),
            Reached::Found(_) => None,
        }
    }
}

impl<T> std::ops::Deref for Reached<'_, T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        match self {
            Reached::Lent(l) => &l.target,
            Reached::Found(t) => t,
        }
    }
}

/// How a request reaches its responder. That is a transport's job, and the transports sit
/// above this layer (`crate::transport` implements this for [`Qp`](super::Qp)), so the
/// requester calls them through this trait without naming one, and statically.
pub(crate) trait Deliver {
    /// What an RC/UC QP remembers of its connected responder, until it is reconnected.
    type Peer;
    /// A responder, reached for one request.
    type Target;

    /// The responder an RC/UC QP is connected to: QP `qpn` at the end of its path `av`
    /// (`dev`: the device of this host `av` names, found when the QP was connected, if any).
    /// Once found it is remembered in `peer`: a QP that later takes its number is a stranger
    /// whose PSNs would not match, so it is never delivered to. `None`: nothing answers there.
    fn responder<'p>(
        &self,
        peer: &'p mut Option<Self::Peer>,
        av: &AhAttr,
        dev: &Weak<Device>,
        qpn: u32,
    ) -> Option<Reached<'p, Self::Target>>;

    /// A request to the remembered responder `peer` is coming: start fetching what reaching
    /// it reads (among thousands of connections it is rarely in cache).
    fn warm(&self, peer: &Self::Peer);

    /// UD: QP `qpn` where address handle `ah` leads, found anew for each message.
    fn ud_responder(&self, ah: &Ah, qpn: u32) -> Option<Self::Target>;

    /// UD to the multicast QPN: every QP attached to the group `ah` names, found anew for
    /// each message.
    fn ud_group(&self, ah: &Ah) -> Vec<Self::Target>;

    /// Carries `req` to `to` and brings back the answer.
    fn deliver(&self, to: &Self::Target, req: &Request<'_>) -> Response;

    /// XRC: carries `req` through target QP `tgt` (what [`responder`](Self::responder) found,
    /// on `dev`) to the XRC SRQ `srqn` of the target's domain, and brings back the answer. No
    /// such SRQ in that domain is the target's invalid request; a `tgt` that is no XRC
    /// target answers nothing ([`Response::Dropped`]).
    fn deliver_xrc(
        &self,
        tgt: &Self::Target,
        dev: &Weak<Device>,
        srqn: u32,
        req: &Request<'_>,
    ) -> Response;

    /// The QP is going away: the transport may let go of what it kept for its connections.
    fn release(&self);

    /// What a transport that executes a QP's work requests itself keeps per QP (see
    /// [`Offload`]).
    type Offloaded: Offload;

    /// For a QP being created on `dev` with context `ctx`: the transport's handle if it
    /// executes the QP's requests away from the poster, as a NIC does (a networked device's
    /// host engine); `None` when they execute at post time.
    fn offload(
        dev: &Arc<Device>,
        qpn: u32,
        ctx: &Segment,
        cap: &QpCap,
    ) -> Result<Option<Self::Offloaded>>;
}

/// A QP whose work requests a transport executes (the host engine of a networked device): the
/// send-queue driver hands it each request in order, the state machine tells it of each
/// move, and completions come back through the QP's CQs in device memory.
pub(crate) trait Offload: Send + Sync {
    /// The QP exists: the transport may tell it when the executor is lost
    /// ([`Qp::offload_lost`]).
    fn bind(&self, qp: Weak<Qp>);
    /// Hands work request number `seq` to the executor.
    fn post(&self, seq: u32, w: &SendWqe<'_>, attr: &QpAttr) -> Result<()>;
    /// The QP moves from `from` to `to` with attributes `attr` (refused: the QP stays).
    fn moved(&self, qp: &Qp, from: QpState, to: QpState, attr: &QpAttr) -> Result<()>;
    /// The QP receives without ever being connected (an XRC SRQ's receive point): the
    /// executor is to know it from now on.
    fn receive_only(&self) -> Result<()>;
    /// Waits (at most `within`) until the executor has finished every request handed to it,
    /// `done` being the number of the first it has not (which the executor advances).
    fn settle(&self, done: &std::sync::atomic::AtomicU32, within: Duration);
    /// UD multicast: the executor delivers the group `mgid`'s datagrams to the QP (or, with
    /// `join` false, no longer).
    fn group(&self, mgid: Gid, join: bool) -> Result<()>;
    /// Requests handed over and not completed (number, `wr_id`, opcode), oldest first, of
    /// those numbered from `done` on: what to flush if the executor is lost.
    fn unfinished(&self, done: u32) -> Vec<(u32, u64, WcOpcode)>;
}
