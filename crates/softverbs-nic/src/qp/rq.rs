//! Receive queues (a QP's own, or shared) as rings of receive WQEs in device memory.
//!
//! The owner posts; whoever delivers a message (any initiator) takes the oldest WQE. SGEs are
//! stored as posted and checked against the owner's key table when a message lands, as
//! hardware does.

use crate::device::event::{AsyncEvent, AsyncQueue, EventElement};
use crate::device::{Counted, Device, InUse, Resource, Users};
use crate::device_memory::ring::{Ring, SlotPayload};
use crate::error::{Error, Result, inval};
use crate::mr::keys::KeyTable;
use crate::mr::resolve::Few;
use crate::pd::Pd;
use crate::types::{AsyncEventType, Sge};
use std::sync::Arc;
use std::sync::atomic::Ordering;

#[repr(C)]
#[derive(Clone, Copy)]
struct RecvHeader {
    wr_id: u64,
    num_sge: u32,
    _reserved: u32,
}

// SAFETY: repr(C) integers.
unsafe impl SlotPayload for RecvHeader {}
// SAFETY: repr(C) integers.
unsafe impl SlotPayload for Sge {}

/// A posted receive, as taken off the queue.
#[derive(Debug, Clone, Default)]
pub struct RecvWqe {
    pub wr_id: u64,
    /// Nearly every receive has one SGE: taking it allocates nothing.
    pub(crate) sges: Few<Sge>,
}

/// Slots past the next post whose lines a post asks for ahead ([`RecvQueue::post`]).
const POST_AHEAD: u64 = 4;
/// Slots a queue holds beyond what was asked for: room that keeps the owner's posts behind
/// the requesters' takes even when the program keeps every receive it asked for posted (the
/// slot a post asks for ahead is then free).
const SLACK: u32 = POST_AHEAD as u32 + 1;

/// A ring of receive WQEs with room for `max_sge` SGEs each.
pub struct RecvQueue {
    ring: Ring,
    max_sge: u32,
}

impl RecvQueue {
    /// A queue of at least `max_wr` WQEs of up to `max_sge` SGEs ([`SLACK`] more, rounded
    /// up to a power of two: its capacity says how many).
    ///
    /// Why the slack: a program that keeps all the receives it asked for posted (as
    /// `ib_send_lat` keeps 512 in a queue of 512) reposts each receive into the slot a
    /// requester in another process has just taken and freed: the line is in that core's
    /// cache, and the post waits for it (measured: 107 ns of a 245 ns post, and the
    /// requester's next take waited for the line back). With free slots beyond the posted
    /// ones, a post lands in a slot freed long ago, whose line it asked for
    /// [`POST_AHEAD`] posts before.
    pub fn new(max_wr: u32, max_sge: u32) -> Result<RecvQueue> {
        let max_sge = max_sge.max(1);
        let payload = std::mem::size_of::<RecvHeader>() + max_sge as usize * 16;
        Ok(RecvQueue {
            ring: Ring::new("softverbs-rq", max_wr.saturating_add(SLACK), payload)?,
            max_sge,
        })
    }

    /// A view of a queue another process created; refused when its slots cannot hold a WQE
    /// header (the ring's geometry is the peer's word).
    pub(crate) fn from_ring(ring: Ring) -> Result<RecvQueue> {
        let room = ring
            .payload_bytes()
            .checked_sub(std::mem::size_of::<RecvHeader>())
            .ok_or_else(|| inval("peer receive queue: slots too small"))?;
        let max_sge = u32::try_from(room / 16).unwrap_or(u32::MAX);
        Ok(RecvQueue { ring, max_sge })
    }

    /// The ring, for exporting to peers.
    pub(crate) fn ring(&self) -> &Ring {
        &self.ring
    }

    /// WQEs the queue holds.
    pub fn capacity(&self) -> u32 {
        self.ring.capacity()
    }

    /// SGEs per WQE.
    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// WQEs posted and not yet consumed.
    pub fn len(&self) -> u32 {
        self.ring.len()
    }

    /// True when nothing is posted.
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// Posts one receive.
    pub fn post(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        if sges.len() > self.max_sge as usize {
            return Err(inval(format!(
                "{} SGEs, the queue takes {}",
                sges.len(),
                self.max_sge
            )));
        }
        let h = RecvHeader {
            wr_id,
            num_sge: sges.len() as u32,
            _reserved: 0,
        };
        let pos = self
            .ring
            .push_slice(&h, sges)
            .map_err(|_| Error::NoResources("receive queue is full".into()))?;
        // The slot of a later post: free (with the slack, a requester freed it long ago),
        // or posted and not yet near the requesters' take (a queue kept full) — either way
        // no requester is using its line now.
        self.ring.prefetch_slot(pos + POST_AHEAD);
        Ok(())
    }

    /// Takes the oldest posted receive.
    pub fn take(&self) -> Option<RecvWqe> {
        let mut sges = Few::new();
        let h: RecvHeader = self
            .ring
            .pop_slice(&mut sges, |h: &RecvHeader| h.num_sge as usize)?;
        // Receives are posted ahead: the next one is likely there already, and fetching it
        // now takes its transfer off the next message's path.
        self.ring.prefetch_head();
        Some(RecvWqe {
            wr_id: h.wr_id,
            sges,
        })
    }
}

/// Header word of an SRQ ring holding the armed limit (0: disarmed); in the ring so that
/// requesters in other processes fire the limit event too.
const W_LIMIT: usize = 0;

/// Takes a WQE from SRQ ring `rq` for an arriving message, calling `post` with the limit
/// event when the armed limit is crossed.
pub(crate) fn srq_take(rq: &RecvQueue, id: u32, post: impl FnOnce(AsyncEvent)) -> Option<RecvWqe> {
    let w = rq.take()?;
    let limit = &rq.ring.user_words()[W_LIMIT];
    let armed = limit.load(Ordering::Acquire);
    if armed != 0 && rq.len() < armed && limit.swap(0, Ordering::AcqRel) != 0 {
        post(AsyncEvent {
            kind: AsyncEventType::SrqLimitReached,
            element: EventElement::Srq(id),
        });
    }
    Some(w)
}

impl Pd {
    /// Creates a shared receive queue.
    pub fn create_srq(self: &Arc<Self>, max_wr: u32, max_sge: u32, limit: u32) -> Result<Arc<Srq>> {
        Srq::new(
            self.keys(),
            &self.ctx.dev,
            (self.id, self.users.add()),
            self.ctx.events.clone(),
            max_wr,
            max_sge,
            limit,
        )
    }
}

/// A shared receive queue.
pub struct Srq {
    pub(crate) id: u32,
    pub(crate) pd: u32,
    /// Which key table its PD's keys are in (its address: the device's, or an imported
    /// PD's view of its exporter's), which a QP receiving from it must share.
    pub(crate) table: usize,
    pub(crate) rq: RecvQueue,
    events: Arc<AsyncQueue>,
    pub(crate) users: Users,
    pd_use: std::sync::Mutex<Option<InUse>>,
    /// An XRC SRQ's receive point, domain and CQ ([`crate::qp::xrc`]).
    pub(crate) xrc: crate::qp::xrc::PointSlot,
    _count: Counted,
}

impl Srq {
    /// The most SGEs a receive posted to it may have.
    pub fn max_sge(&self) -> u32 {
        self.rq.max_sge()
    }

    /// True while a QP receives through it (`ibv_destroy_srq` is EBUSY then).
    pub fn in_use(&self) -> bool {
        self.users.any()
    }

    /// The program destroyed the SRQ (`ibv_destroy_srq`): its PD stops counting it as a
    /// user now, although a QP being torn down may still hold it for a moment.
    pub fn release_uses(&self) {
        self.pd_use.lock().unwrap_or_else(|e| e.into_inner()).take();
        // An XRC SRQ's point holds the SRQ: taking it out ends both, and frees the CQ and
        // the domain for their destroy calls.
        let point = self.xrc_lock().take();
        drop(point);
    }

    pub(crate) fn new(
        keys: &KeyTable,
        dev: &Arc<Device>,
        (pd, pd_use): (u32, InUse),
        events: Arc<AsyncQueue>,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<Arc<Srq>> {
        let l = &dev.config.limits;
        if max_wr == 0 || max_wr > l.max_srq_wr {
            return Err(inval(format!("SRQ max_wr {max_wr} (1..={})", l.max_srq_wr)));
        }
        if max_sge > l.max_srq_sge {
            return Err(inval(format!(
                "SRQ max_sge {max_sge} (at most {})",
                l.max_srq_sge
            )));
        }
        if limit > max_wr {
            return Err(inval("srq_limit exceeds max_wr"));
        }
        let count = dev.acquire(Resource::Srq)?;
        let rq = RecvQueue::new(max_wr, max_sge)?;
        rq.ring.user_words()[W_LIMIT].store(limit, Ordering::Release);
        Ok(Arc::new(Srq {
            id: dev.next_id(),
            pd,
            table: keys as *const KeyTable as usize,
            rq,
            events,
            users: Users::default(),
            pd_use: std::sync::Mutex::new(Some(pd_use)),
            xrc: Default::default(),
            _count: count,
        }))
    }

    /// Device-wide id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// True if the SRQ was created on `dev`.
    pub(crate) fn on(&self, dev: &Arc<Device>) -> bool {
        self._count.on(dev)
    }

    /// (max_wr, max_sge, srq_limit) as `ibv_query_srq` reports them.
    pub fn attr(&self) -> (u32, u32, u32) {
        (
            self.rq.capacity(),
            self.rq.max_sge(),
            self.rq.ring.user_words()[W_LIMIT].load(Ordering::Acquire),
        )
    }

    /// Posts a receive.
    pub fn post(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        self.rq.post(wr_id, sges)
    }

    /// Arms the limit event: it fires once when fewer than `limit` WQEs remain (0 disarms).
    pub fn set_limit(&self, limit: u32) -> Result<()> {
        if limit > self.rq.capacity() {
            return Err(inval("srq_limit exceeds max_wr"));
        }
        self.rq.ring.user_words()[W_LIMIT].store(limit, Ordering::Release);
        Ok(())
    }

    /// Takes a WQE for an arriving message, firing the limit event when it is crossed.
    pub(crate) fn take(&self) -> Option<RecvWqe> {
        srq_take(&self.rq, self.id, |ev| self.events.push(ev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's queue whose slots cannot hold a WQE header is refused, not a panic later.
    #[test]
    fn a_peer_queue_with_tiny_slots_is_refused() {
        let tiny = Ring::new("t", 4, 8).unwrap();
        assert!(RecvQueue::from_ring(tiny).is_err());
        let q = RecvQueue::new(4, 3).unwrap();
        let seg = q.ring().segment().reopen().unwrap();
        let view = RecvQueue::from_ring(Ring::open(seg).unwrap()).unwrap();
        assert_eq!(view.max_sge, q.max_sge);
    }

    #[test]
    fn post_take_roundtrip() {
        let q = RecvQueue::new(4, 3).unwrap();
        let s = |a| Sge {
            addr: a,
            length: 1,
            lkey: 2,
        };
        q.post(9, &[s(1), s(2)]).unwrap();
        q.post(10, &[]).unwrap();
        assert!(q.post(11, &[s(1); 4]).is_err());
        let w = q.take().unwrap();
        assert_eq!((w.wr_id, w.sges.len()), (9, 2));
        assert_eq!(w.sges[1].addr, 2);
        assert_eq!(q.take().unwrap().sges.len(), 0);
        assert!(q.take().is_none());
    }

    /// A program that keeps every receive it asked for posted still leaves free slots ahead
    /// of its posts (the slack), and the queue says how many it holds: posting that many
    /// succeeds, one more is refused, and each comes back in order.
    #[test]
    fn a_queue_holds_slack_beyond_what_was_asked_and_reports_it() {
        for asked in [1u32, 16, 500, 512] {
            let q = RecvQueue::new(asked, 1).unwrap();
            let cap = q.capacity();
            assert!(cap >= asked + SLACK, "asked {asked}, holds {cap}");
            let sge = [Sge::default()];
            for i in 0..cap {
                q.post(u64::from(i), &sge).unwrap();
            }
            assert!(matches!(q.post(0, &sge), Err(Error::NoResources(_))));
            // Taking and reposting around the ring several times keeps the order.
            for i in 0..3 * u64::from(cap) {
                assert_eq!(q.take().unwrap().wr_id, i);
                q.post(i + u64::from(cap), &sge).unwrap();
            }
        }
    }
}
