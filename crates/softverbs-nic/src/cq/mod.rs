//! Completion queues: a [`Ring`] of [`Cqe`]s (two or more after a resize that peers had
//! mapped), the completion channels CQs report to (`channel`), and the protocol by which
//! arming, completing and collecting events agree across processes (`notify`).

mod channel;
pub mod compact;
mod notify;

pub use channel::Channel;

use crate::cq::compact::Layout;
use crate::device::event::{AsyncEvent, AsyncQueue, EventElement};
use crate::device::{Context, Resource};
use crate::device_memory::export::Export;
use crate::device_memory::ring::{InPlace, Ring, SlotPayload};
use crate::device_memory::segment::Segment;
use crate::error::{Error, Result, inval};
use crate::sync::biased_lock::{BiasedGuard, BiasedLock};
use crate::sync::thread_token;
use crate::types::{AsyncEventType, WcExFlags, WcFlags, WcOpcode, WcStatus};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, RwLock, Weak};

/// One completion as stored in a CQ ring (56 bytes; 64 with the slot's sequence word).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cqe {
    pub wr_id: u64,
    /// Raw device-clock value when the completion happened; 0 in a CQ created without a
    /// completion-timestamp field (see `W_STAMP`).
    pub timestamp: u64,
    pub byte_len: u32,
    /// Immediate data exactly as the sender passed it (verbs treats it as opaque `__be32`).
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub vendor_err: u32,
    /// Send side: low 32 bits of the work request's sequence number, used to free SQ slots.
    pub wqe_seq: u32,
    pub slid: u16,
    pub pkey_index: u16,
    /// [`WcStatus`] value.
    pub status: u8,
    /// [`WcOpcode`] value (only the low byte of RECV's 128/129 matters: they fit).
    pub opcode: u8,
    /// [`WcFlags`] bits.
    pub wc_flags: u8,
    pub sl: u8,
    pub dlid_path_bits: u8,
    /// Receive side: the message was sent with the solicited-event bit.
    pub solicited: u8,
    pub _reserved: [u8; 6],
}

// SAFETY: repr(C) integers only.
unsafe impl SlotPayload for Cqe {}

/// `table[raw]`: the enum value of each byte a `Cqe` field may hold, `default` for the
/// numbers verbs does not define. Every poll converts the status and the opcode of every
/// completion, and one load from a table costs less than the match (a jump table) they compile to.
macro_rules! byte_table {
    ($ty:ty, $default:expr) => {{
        let mut table = [$default; 256];
        let mut raw = 0;
        while raw < 256 {
            if let Some(v) = <$ty>::from_raw(raw as u32) {
                table[raw] = v;
            }
            raw += 1;
        }
        table
    }};
}
static STATUS_OF: [WcStatus; 256] = byte_table!(WcStatus, WcStatus::GeneralErr);
static OPCODE_OF: [WcOpcode; 256] = byte_table!(WcOpcode, WcOpcode::Send);

impl Cqe {
    /// The status as an enum (unknown values read as a general error).
    #[inline]
    pub fn status(&self) -> WcStatus {
        STATUS_OF[usize::from(self.status)]
    }
    /// The opcode as an enum (unknown values read as SEND).
    #[inline]
    pub fn opcode(&self) -> WcOpcode {
        OPCODE_OF[usize::from(self.opcode)]
    }
    /// The completion flags.
    #[inline]
    pub fn flags(&self) -> WcFlags {
        WcFlags::from_bits_retain(u32::from(self.wc_flags))
    }
    /// True for completions of the receive side.
    #[inline]
    pub fn is_recv(&self) -> bool {
        self.opcode & 0x80 != 0
    }
}

// Header words of the ring that belong to the CQ; peers that push completions use them too.
/// The arm (`notify::ARM_*`).
const W_ARM: usize = 0;
const W_OVERRUN: usize = 1;
/// Set (to the arm mode that fired) when an armed CQ fired; the channel's owner collects it.
const W_EVENT: usize = 2;
/// The CQ's device-wide id, for the events a peer raises about it.
pub(crate) const W_ID: usize = 3;
/// Set when a resize replaced this ring: peers then look up the CQ's current ring in the QP
/// context and complete there (see [`Rings`]).
pub(crate) const W_MOVED: usize = 4;
/// 1 when the CQ has a completion channel. It is set at creation and never changes, and a CQ
/// without a channel cannot be armed, so producers into such a CQ (busy-polled ones) skip the
/// arm check and its fence.
const W_CHANNEL: usize = 5;
/// 1 when the CQ's completions carry their time (created with a completion-timestamp field).
/// Set at creation and never changed. Reading the clock is the costliest step of a
/// completion (`clock_gettime` fences, so it waits for the misses before it): a SEND's
/// receive completion took 24 ns longer with it on this VM's `tsc` clock, so a CQ that never
/// reads the time is not given it, as a hardware CQ created without the field is not.
const W_STAMP: usize = 6;

/// What pushing a completion into a CQ ring asks of the pusher.
pub(crate) enum Pushed {
    /// Queued; ring the CQ's channel if `notify`.
    Queued { notify: bool },
    /// Lost to overrun; raise `IBV_EVENT_CQ_ERR` if `first`.
    Lost { first: bool },
}

/// Pushes `cqe` into a CQ ring, ours or a peer's, following the arming rules
/// ([`notify`]); stamps it with `clock` first if the CQ's completions carry their time.
pub(crate) fn push_ring(ring: &Ring, mut cqe: Cqe, clock: &crate::clock::Clock) -> Pushed {
    let words = ring.user_words();
    if words[W_STAMP].load(Ordering::Relaxed) != 0 {
        cqe.timestamp = clock.now_raw();
    }
    if ring.push(&cqe).is_err() {
        return Pushed::Lost {
            first: words[W_OVERRUN].swap(1, Ordering::AcqRel) == 0,
        };
    }
    let notify = words[W_CHANNEL].load(Ordering::Relaxed) != 0
        && notify::fire(
            ring,
            cqe.solicited != 0 || cqe.status != WcStatus::Success as u8,
        );
    Pushed::Queued { notify }
}

/// What a CQ ring's header says, for explaining a hang (see [`crate::inspect`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingState {
    /// The CQ's device-wide id.
    pub cq_id: u32,
    pub capacity: u32,
    /// Completions taken so far.
    pub head: u64,
    /// Slots claimed so far by producers (published or still being written).
    pub tail: u64,
    /// Published completions waiting at the head (up to the capacity).
    pub ready: usize,
    /// `"none"`, `"next"` or `"solicited"` (or the raw value, if the word holds another).
    pub arm: String,
    /// An armed CQ fired and the channel has not taken the event yet.
    pub event_pending: bool,
    /// The CQ has a completion channel.
    pub has_channel: bool,
    /// A completion was lost to overrun.
    pub overrun: bool,
    /// A resize replaced this ring.
    pub moved: bool,
}

impl RingState {
    /// Reads `ring`'s header and indices (each word a snapshot of its own).
    pub fn of(ring: &Ring) -> RingState {
        let w = |i: usize| ring.user_words()[i].load(Ordering::Acquire);
        let (head, tail) = ring.indices();
        RingState {
            cq_id: w(W_ID),
            capacity: ring.capacity(),
            head,
            tail,
            ready: ring.ready(ring.capacity() as usize),
            arm: match w(W_ARM) {
                notify::ARM_NONE => "none".into(),
                notify::ARM_NEXT => "next".into(),
                notify::ARM_SOLICITED => "solicited".into(),
                other => other.to_string(),
            },
            event_pending: w(W_EVENT) != 0,
            has_channel: w(W_CHANNEL) != 0,
            overrun: w(W_OVERRUN) != 0,
            moved: w(W_MOVED) != 0,
        }
    }
}

impl std::fmt::Display for RingState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cq {} ring: {} slots, head {} tail {} ({} published at the head), arm {}, event {}{}{}{}",
            self.cq_id,
            self.capacity,
            self.head,
            self.tail,
            self.ready,
            self.arm,
            if self.event_pending {
                "pending"
            } else {
                "none"
            },
            if self.has_channel { "" } else { ", no channel" },
            if self.overrun { ", OVERRUN" } else { "" },
            if self.moved { ", moved (resized)" } else { "" },
        )
    }
}

/// A CQ's rings. Completions are pushed into `cur`, by this process and by peers that mapped it.
/// A resize replaces `cur`; when the old ring had been handed to peers (who keep pushing into
/// the mapping they have), it stays in `old` for good, and every poll takes from the old rings
/// first, oldest first: each producer keeps to one ring, so the completions of one queue pair
/// still come out in order.
#[derive(Clone)]
pub(crate) struct Rings {
    cur: Arc<Ring>,
    old: Vec<Arc<Ring>>,
}

impl Rings {
    /// Every ring, in polling order.
    fn all(&self) -> impl Iterator<Item = &Ring> {
        self.old
            .iter()
            .chain(std::iter::once(&self.cur))
            .map(|r| &**r)
    }

    /// How many completions each ring may give now (in polling order, each at most `max`),
    /// looked at newest ring first: a peer that moved to a newer ring pushed its earlier
    /// completions into an older one before, so once its newer ones are seen (acquire), the
    /// older ones are too, and taking rings oldest first within these limits keeps its order.
    fn snapshot(&self, max: usize) -> Vec<usize> {
        let rings: Vec<&Ring> = self.all().collect();
        let mut shown: Vec<usize> = rings.iter().rev().map(|r| r.ready(max)).collect();
        shown.reverse();
        shown
    }
}

impl std::ops::Deref for Rings {
    type Target = Ring;
    fn deref(&self) -> &Ring {
        &self.cur
    }
}

impl std::borrow::Borrow<Ring> for Rings {
    fn borrow(&self) -> &Ring {
        &self.cur
    }
}

/// A completion queue.
pub struct Cq {
    id: u32,
    /// The rings as producers of this process (and arming, counting) see them.
    ring: RwLock<Rings>,
    /// The consumer lock, over the same rings: polls and polling sections take it (providers
    /// hold a per-CQ lock the same way), so each completion is taken with plain stores, not a
    /// compare-and-swap against other consumers. Biased to the first thread that polls, which
    /// takes and releases it with plain stores too (`std::sync::Mutex` cost a polling section
    /// a compare-and-swap and an exchange: `perf cq-poll`'s cursor read 1.10-1.14x of classic
    /// poll at 16 completions a section, 1.00-1.04x with the bias). A resize takes it aside,
    /// without ending the bias, before `ring`'s write lock
    /// and replaces both. The rings live in `Arc`s, so a polling cursor can keep the one it
    /// reads in place at a fixed address while it holds the guard.
    consumer: BiasedLock<Rings>,
    /// The CQ's first ring until its first resize, then null: polls look at it without the
    /// consumer lock to find the CQ empty ([`Cq::looks_empty`]). A busy-polling program polls
    /// an empty CQ far more often than a full one, and the lock's two locked instructions were
    /// most of such a poll (in `ib_send_lat`, the poll loop's time sat on them). A resized
    /// CQ's polls always take the lock, so the only ring a look may hold is this first one,
    /// kept while the CQ lives (`retired`) once a resize drained it.
    bare: AtomicPtr<Ring>,
    /// The first ring, once a resize drained it into the next: kept for `bare`'s readers.
    retired: Mutex<Option<Arc<Ring>>>,
    /// The thread whose polling section holds `consumer` ([`thread_token`]; 0 when none): a
    /// poll that thread makes meanwhile finds the CQ empty instead of waiting on itself.
    section: std::sync::atomic::AtomicUsize,
    /// `ring.cur` has been handed out for peers to map (see `Cq::export_into`).
    exported: std::sync::atomic::AtomicBool,
    /// Where `ring.cur` is named for peers (a segment, and the offset of an [`Export`] in it:
    /// the context of each QP that completes receives here): a resize names the new ring there.
    named_in: Mutex<Vec<(Weak<Segment>, usize)>>,
    /// The device's `max_cqe`: the most a resize may ask for.
    max_cqe: u32,
    /// The fields the CQ was created to return, and their compact-record layout.
    wc_flags: WcExFlags,
    layout: Layout,
    /// The program's `cq_context`.
    user_context: AtomicU64,
    channel: Option<Arc<Channel>>,
    async_events: Arc<AsyncQueue>,
    /// The device's send-queue retirement table (see [`Cq::new`]): a direct store, not a
    /// call through a pointer, for each send completion polled.
    sq_retired: Arc<[AtomicU32]>,
    clock: crate::clock::Clock,
    events_delivered: AtomicU32,
    events_acked: AtomicU32,
    pub(crate) users: crate::device::Users,
    _count: Option<crate::device::Counted>,
}

impl Context {
    /// Creates a completion queue of at least `cqe` entries.
    pub fn create_cq(self: &Arc<Self>, cqe: u32, channel: Option<Arc<Channel>>) -> Result<Arc<Cq>> {
        self.create_cq_ex(cqe, channel, WcExFlags::STANDARD)
    }

    /// Creates a CQ that returns the fields in `wc_flags` (checked by the caller against
    /// [`WcExFlags::SUPPORTED`]).
    pub fn create_cq_ex(
        self: &Arc<Self>,
        cqe: u32,
        channel: Option<Arc<Channel>>,
        wc_flags: WcExFlags,
    ) -> Result<Arc<Cq>> {
        let max = self.dev.config.limits.max_cqe;
        if cqe == 0 || cqe > max {
            return Err(inval(format!("cqe {cqe} (1..={max})")));
        }
        let count = self.dev.acquire(Resource::Cq)?;
        let cq = Cq::new(
            self.dev.next_id(),
            (cqe, max),
            channel,
            self.events.clone(),
            self.dev.sq_retired.clone(),
            self.dev.clock,
            Some(count),
            wc_flags,
        )?;
        Ok(cq)
    }
}

impl Cq {
    /// Creates a CQ with room for at least `cqe` completions.
    ///
    /// Every send-side completion polled moves its QP's entry of `sq_retired` (the device's
    /// table, by QP index) past its WQE, so the QP frees its send-queue slots the way hardware
    /// does: when the completion is consumed.
    #[allow(clippy::too_many_arguments)] // one call site, each argument a different part
    pub(crate) fn new(
        id: u32,
        (cqe, max_cqe): (u32, u32),
        channel: Option<Arc<Channel>>,
        async_events: Arc<AsyncQueue>,
        sq_retired: Arc<[AtomicU32]>,
        clock: crate::clock::Clock,
        count: Option<crate::device::Counted>,
        wc_flags: WcExFlags,
    ) -> Result<Arc<Cq>> {
        let ring = Ring::new("softverbs-cq", cqe, std::mem::size_of::<Cqe>())?;
        ring.user_words()[W_ID].store(id, Ordering::Release);
        ring.user_words()[W_CHANNEL].store(u32::from(channel.is_some()), Ordering::Release);
        let stamped = wc_flags.intersects(
            WcExFlags::COMPLETION_TIMESTAMP | WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK,
        );
        ring.user_words()[W_STAMP].store(u32::from(stamped), Ordering::Release);
        let rings = Rings {
            cur: Arc::new(ring),
            old: Vec::new(),
        };
        let cq = Arc::new(Cq {
            id,
            bare: AtomicPtr::new(Arc::as_ptr(&rings.cur).cast_mut()),
            retired: Mutex::new(None),
            consumer: BiasedLock::new(rings.clone()),
            section: std::sync::atomic::AtomicUsize::new(0),
            ring: RwLock::new(rings),
            exported: std::sync::atomic::AtomicBool::new(false),
            named_in: Mutex::new(Vec::new()),
            max_cqe,
            wc_flags,
            layout: Layout::new(crate::cq::compact::seed_flags(wc_flags)),
            user_context: AtomicU64::new(0),
            channel,
            async_events,
            sq_retired,
            clock,
            events_delivered: AtomicU32::new(0),
            events_acked: AtomicU32::new(0),
            users: crate::device::Users::default(),
            _count: count,
        });
        if let Some(ch) = &cq.channel {
            ch.attach(&cq);
        }
        Ok(cq)
    }

    /// True if the CQ was created on `dev`.
    pub(crate) fn on(&self, dev: &Arc<crate::device::Device>) -> bool {
        self._count.as_ref().is_some_and(|c| c.on(dev))
    }

    /// Device-wide id of this CQ.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// True while a QP completes into it (`ibv_destroy_cq` is EBUSY then).
    pub fn in_use(&self) -> bool {
        self.users.any()
    }

    /// Completions the CQ can hold.
    pub fn capacity(&self) -> u32 {
        self.read_ring().capacity()
    }

    #[inline]
    fn read_ring(&self) -> std::sync::RwLockReadGuard<'_, Rings> {
        self.ring.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The consumer lock: `None` only when this thread's own polling section holds it (what
    /// it polls meanwhile is none: the section holds the queue). The thread the lock is
    /// biased to (the first that polled) takes it with plain stores.
    #[inline(always)]
    fn consume(&self) -> Option<BiasedGuard<'_, Rings>> {
        if self.looks_empty() {
            return None;
        }
        match self.consumer.biased() {
            Some(g) => Some(g),
            None => self.consume_contended(),
        }
    }

    /// True when the CQ was seen empty without the consumer lock: its only ring's oldest slot
    /// held nothing published. False says nothing (take the lock and look).
    ///
    /// A head read stale (another poller moved it) names a slot taken already, whose sequence
    /// is then not the head's, so only a slot no producer had published yet says empty: what
    /// a locked poll at that moment would have found. A resize nulls `bare` (for good) before
    /// it moves anything (then a release fence): a look that read any head the resize wrote
    /// sees the null on its second read of `bare` and takes the lock.
    #[inline(always)]
    fn looks_empty(&self) -> bool {
        let p = self.bare.load(Ordering::Acquire);
        if p.is_null() {
            return false;
        }
        // SAFETY: the one ring `bare` ever names is kept alive while the CQ is (`consumer`,
        // `ring`, or once drained `retired`, hold it), and `&self` is.
        let ring = unsafe { &*p };
        #[cfg(test)]
        tests::AFTER_BARE_LOAD.with(|hook| {
            if let Some(f) = hook.borrow_mut().take() {
                f();
            }
        });
        if !ring.head_unpublished() {
            return false;
        }
        fence(Ordering::Acquire);
        self.bare.load(Ordering::Relaxed) == p
    }

    /// The consumer lock not through the bias (not this thread's, or asked for, or this
    /// thread is inside): waits for it, unless this thread's own section holds it (which would
    /// wait for ever). The first poll claims the bias; a poll from a second thread ends it.
    #[cold]
    #[inline(never)]
    fn consume_contended(&self) -> Option<BiasedGuard<'_, Rings>> {
        if self.section.load(Ordering::Relaxed) == thread_token() {
            return None;
        }
        Some(self.consumer.lock())
    }

    /// The device clock this CQ stamps completions with (when it has a timestamp field).
    pub fn clock(&self) -> &crate::clock::Clock {
        &self.clock
    }

    /// Adds a completion, stamping it with the device clock. On overrun the completion is
    /// lost, the CQ reports an `IBV_EVENT_CQ_ERR` async event (once), and this returns false
    /// so the caller can fail the QP whose completion was lost.
    #[must_use = "a lost completion must fail its QP"]
    pub fn push(&self, cqe: Cqe) -> bool {
        let pushed = push_ring(&self.read_ring(), cqe, &self.clock);
        match pushed {
            Pushed::Queued { notify } => {
                if notify && let Some(ch) = &self.channel {
                    ch.bell().ring();
                }
                true
            }
            Pushed::Lost { first } => {
                if first {
                    self.async_events.push(AsyncEvent {
                        kind: AsyncEventType::CqErr,
                        element: EventElement::Cq(self.id),
                    });
                }
                false
            }
        }
    }

    /// The channel this CQ reports to.
    pub(crate) fn channel(&self) -> Option<&Arc<Channel>> {
        self.channel.as_ref()
    }

    /// Names the current ring in the [`Export`] at offset `at` of `seg` (a QP context's
    /// `cq`), where peers find it, and keeps that place to name the new ring after a resize.
    pub(crate) fn export_into(&self, seg: &Arc<Segment>, at: usize) {
        let rings = self.read_ring();
        let ring = rings.cur.segment();
        seg.at::<Export>(at).set_segment(ring);
        self.exported.store(true, Ordering::Release);
        let mut named = self.named_in.lock().unwrap_or_else(|e| e.into_inner());
        // Forgetting the contexts of destroyed QPs only when the list has doubled keeps
        // creating thousands of QPs on one CQ linear.
        if named.len() == named.capacity() {
            named.retain(|(w, _)| w.strong_count() > 0);
        }
        named.push((Arc::downgrade(seg), at));
    }

    /// The ring, for tests that play a peer.
    #[cfg(test)]
    pub(crate) fn ring(&self) -> std::sync::RwLockReadGuard<'_, Rings> {
        let rings = self.read_ring();
        self.exported.store(true, Ordering::Release);
        rings
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut [Cqe]) -> usize {
        let mut n = 0;
        self.poll_with(out.len(), |c| {
            out[n] = *c;
            n += 1;
        });
        n
    }

    /// Hands up to `max` completions, oldest first, to `f` (each read where it lies in the
    /// ring); returns how many.
    #[inline]
    pub fn poll_with(&self, max: usize, mut f: impl FnMut(&Cqe)) -> usize {
        let Some(rings) = self.consume() else {
            return 0;
        };
        if !rings.old.is_empty() {
            return self.poll_old_first(&rings, max, &mut f);
        }
        // SAFETY: `rings` is the consumer lock's guard.
        unsafe { self.poll_ring(&rings.cur, max, f) }
    }

    /// A poll of a CQ that kept old rings (see [`Rings`]): theirs first, oldest first. Out of
    /// line, so the usual poll carries one loop. `rings`: the consumer lock's guarded rings.
    #[cold]
    #[inline(never)]
    fn poll_old_first(
        &self,
        rings: &BiasedGuard<'_, Rings>,
        max: usize,
        f: &mut dyn FnMut(&Cqe),
    ) -> usize {
        rings
            .all()
            .zip(rings.snapshot(max))
            .fold(0, |n, (ring, shown)| {
                // SAFETY: a ring of the consumer lock's guard.
                n + unsafe { self.poll_ring(ring, shown.min(max - n), &mut *f) }
            })
    }

    /// The ring a cursor takes its next completion from when old rings exist: the oldest
    /// with one, by [`Rings::snapshot`].
    fn pick(rings: &Rings) -> Option<*const Ring> {
        rings
            .all()
            .zip(rings.snapshot(1))
            .find(|(_, shown)| *shown > 0)
            .map(|(ring, _)| ring as *const Ring)
    }

    /// [`poll_with`](Self::poll_with) on the ring already in hand.
    ///
    /// # Safety
    /// The caller holds the consumer lock, and `ring` is one of the rings it guards.
    #[inline(always)]
    unsafe fn poll_ring(&self, ring: &Ring, max: usize, mut f: impl FnMut(&Cqe)) -> usize {
        // SAFETY: consumers of this CQ's rings take the consumer lock, which the caller holds.
        unsafe {
            ring.pop_many_exclusive(max, |c: &Cqe| {
                self.retire_if_send(c);
                f(c);
            })
        }
    }

    /// The fields this CQ returns.
    pub fn wc_flags(&self) -> WcExFlags {
        self.wc_flags
    }

    /// The layout of this CQ's compact records.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The program's `cq_context` value.
    pub fn user_context(&self) -> u64 {
        self.user_context.load(Ordering::Relaxed)
    }

    /// Sets the program's `cq_context` value.
    pub fn set_user_context(&self, v: u64) {
        self.user_context.store(v, Ordering::Relaxed);
    }

    /// Starts polling in place: the cursor holds the oldest completion; `None` when the CQ is
    /// empty (`ibv_start_poll`'s `ENOENT`). With `wall`, the section reads the wall clock
    /// once, for [`Cursor::wall`].
    #[inline(always)]
    pub fn start_poll(&self, wall: bool) -> Option<Cursor<'_>> {
        let rings = self.consume()?;
        let held = if rings.old.is_empty() {
            // SAFETY: the guard reaches `cur` in its `Arc`, in place while the guard lives,
            // and makes this the rings' only consumer.
            unsafe { InPlace::start(rings) }?
        } else {
            let at = Self::pick(&rings)?;
            // SAFETY: a ring of the `Rings` the guard holds, in an `Arc` it keeps (old rings
            // are never dropped), so it stays in place while the guard lives; the guard makes
            // this the rings' only consumer.
            unsafe { InPlace::start_at(rings, at) }?
        };
        self.section.store(thread_token(), Ordering::Relaxed);
        self.retire_if_send(held.get());
        let wall = if wall {
            self.clock.wall()
        } else {
            crate::clock::WallClock::default()
        };
        Some(Cursor {
            cq: self,
            held,
            wall,
        })
    }

    #[inline(always)]
    fn retire_if_send(&self, c: &Cqe) {
        if !c.is_recv() {
            crate::device::retire_sq(&self.sq_retired, c.qp_num, c.wqe_seq);
        }
    }

    /// `poll_ex` of seed 000: writes up to `max` completions as compact records
    /// ([`Layout`]) into `buf`, back to back; returns how many. `buf` shorter than `max`
    /// records limits `max`.
    #[inline]
    pub fn poll_compact(&self, buf: &mut [u8], max: usize) -> usize {
        let size = self.layout.size();
        // Divisions cost as much as a completion's worth of work on a 16-completion poll, so
        // the usual case (the buffer holds `max` records) is checked with a multiplication.
        let max = match max.checked_mul(size) {
            Some(bytes) if bytes <= buf.len() => max,
            _ => buf.len() / size,
        };
        let wall = self
            .wc_flags
            .contains(WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK);
        let Some(rings) = self.consume() else {
            return 0;
        };
        if !rings.old.is_empty() {
            return self.fill_old_first(&rings, buf, max, wall);
        }
        let ring = &*rings.cur;
        // One loop per combination of field classes, picked here once per poll, so a CQ with
        // few fields runs no code for the others (as providers pick a poll function per CQ).
        macro_rules! by_groups {
            ($($g:literal)*) => {
                match self.layout.groups() {
                    $($g => self.fill_records::<$g>(ring, buf, max, wall),)*
                    _ => self.fill_records::<{ crate::cq::compact::GROUPS_ALL }>(ring, buf, max, wall),
                }
            };
        }
        by_groups!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14)
    }

    /// `poll_compact`'s loop over `ring` for layouts whose field classes are among `G`;
    /// `want_wall`: the records carry the wall-clock time. `ring`: the current ring, under
    /// the consumer lock.
    #[inline(always)]
    fn fill_records<const G: u8>(
        &self,
        ring: &Ring,
        buf: &mut [u8],
        max: usize,
        want_wall: bool,
    ) -> usize {
        // A copy: stores into the records could alias `self`, so fields read through a
        // reference would be loaded again after each one.
        let layout = self.layout;
        let size = layout.size();
        // A clock reading costs more than an empty poll, which busy-polling programs make far
        // more often than full ones: none when there is nothing to convert.
        let wall = if want_wall && !ring.is_empty() {
            Some(self.clock.wall())
        } else {
            None
        };
        let mut rest = buf;
        // SAFETY: `poll_compact`, the only caller, holds the consumer lock over `ring`.
        unsafe {
            self.poll_ring(ring, max, |c| {
                if let Some((rec, tail)) = std::mem::take(&mut rest).split_at_mut_checked(size) {
                    layout.fill_groups::<G>(rec, c, wall.as_ref());
                    rest = tail;
                }
            })
        }
    }

    /// `poll_compact` for a CQ that kept old rings (see [`Rings`]): the generic fill, old
    /// rings first.
    #[cold]
    #[inline(never)]
    fn fill_old_first(
        &self,
        rings: &BiasedGuard<'_, Rings>,
        buf: &mut [u8],
        max: usize,
        want_wall: bool,
    ) -> usize {
        let size = self.layout.size();
        let wall = want_wall.then(|| self.clock.wall());
        let mut rest = buf;
        self.poll_old_first(rings, max, &mut |c| {
            if let Some((rec, tail)) = std::mem::take(&mut rest).split_at_mut_checked(size) {
                self.layout.fill(rec, c, wall.as_ref());
                rest = tail;
            }
        })
    }

    /// Arms the CQ: the next completion (or, with `solicited_only`, the next solicited or
    /// error completion) queues an event on the channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.channel.is_none() {
            return Err(inval("CQ has no completion channel"));
        }
        // Every ring: peers push into old rings too.
        notify::arm(self.read_ring().all(), solicited_only);
        Ok(())
    }

    /// Acknowledges `n` events taken from the channel.
    pub fn ack_events(&self, n: u32) {
        self.events_acked.fetch_add(n, Ordering::Relaxed);
    }

    /// Events taken from the channel but not yet acknowledged.
    pub fn unacked_events(&self) -> u32 {
        self.events_delivered
            .load(Ordering::Relaxed)
            .wrapping_sub(self.events_acked.load(Ordering::Relaxed))
    }

    /// True once a completion has been lost to overrun.
    pub fn overrun(&self) -> bool {
        self.read_ring()
            .all()
            .any(|r| r.user_words()[W_OVERRUN].load(Ordering::Acquire) != 0)
    }

    /// Completions waiting to be polled.
    pub fn len(&self) -> u32 {
        self.read_ring().all().map(Ring::len).sum()
    }

    /// True when nothing waits to be polled.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Changes the capacity to at least `cqe`, keeping queued completions.
    ///
    /// Peers in other processes that mapped the ring move to the new one at their next
    /// completion (the QP contexts name it, the old ring is flagged as moved); a ring they had
    /// is kept and polled first, so nothing they put there is lost and each QP's completions
    /// stay in order. Sizes outside `1..=max_cqe` are `InvalidArgument`; a resize from inside this
    /// thread's own polling section is `Busy`.
    pub fn resize(&self, cqe: u32) -> Result<u32> {
        if cqe == 0 || cqe > self.max_cqe {
            return Err(inval(format!("resize to {cqe} (1..={})", self.max_cqe)));
        }
        if self.section.load(Ordering::Relaxed) == thread_token() {
            // Waiting for the lock this thread's own section holds would never end.
            return Err(Error::Busy(
                "resize inside this thread's polling section".into(),
            ));
        }
        // Consumer lock first, as polls take it: none polls while the rings change.
        let mut consumer = self.consumer.lock_aside();
        let mut rings = self.ring.write().unwrap_or_else(|e| e.into_inner());
        // Lock-free looks (`looks_empty`) stop, for good, before anything moves.
        let bare = self.bare.swap(std::ptr::null_mut(), Ordering::Relaxed);
        fence(Ordering::Release);
        let queued: u32 = rings.all().map(Ring::len).sum();
        if cqe < queued {
            return Err(inval(format!(
                "resize to {cqe} entries but {queued} completions are queued"
            )));
        }
        let new = Ring::new("softverbs-cq", cqe, std::mem::size_of::<Cqe>())?;
        for (w_new, w_old) in new.user_words().iter().zip(rings.cur.user_words()) {
            w_new.store(w_old.load(Ordering::Acquire), Ordering::Release);
        }
        // The write lock keeps `export_into` (a QP being created) from exporting meanwhile.
        if self.exported.swap(false, Ordering::AcqRel) {
            // Peers mapped the old ring. Its completions stay where they are, to come out
            // before the new ring's; QP contexts now name the new ring, and the old one says
            // it moved (in that order: a peer that sees the flag finds the new name).
            let new = Arc::new(new);
            let seg = new.segment();
            let named = self.named_in.lock().unwrap_or_else(|e| e.into_inner());
            for (ctx, at) in named.iter().filter_map(|(w, at)| Some((w.upgrade()?, *at))) {
                ctx.at::<Export>(at).set_segment(seg);
                self.exported.store(true, Ordering::Release);
            }
            let old = std::mem::replace(&mut rings.cur, new);
            old.user_words()[W_MOVED].store(1, Ordering::Release);
            rings.old.push(old);
        } else {
            while let Some(c) = rings.cur.pop::<Cqe>() {
                if new.push(&c).is_err() {
                    return Err(Error::NoResources("resized CQ is too small".into()));
                }
            }
            let old = std::mem::replace(&mut rings.cur, Arc::new(new));
            if std::ptr::eq(Arc::as_ptr(&old), bare) {
                *self.retired.lock().unwrap_or_else(|e| e.into_inner()) = Some(old);
            }
        }
        *consumer = rings.clone();
        Ok(rings.cur.capacity())
    }
}

/// A polling section over a CQ (`ibv_start_poll` … `ibv_end_poll`): it holds one completion,
/// read in place in the CQ ring, until [`advance`](Self::advance) moves on or it is dropped.
pub struct Cursor<'a> {
    cq: &'a Cq,
    // Holding the consumer lock's guard keeps the ring from being swapped by a resize, and
    // other consumers out, at the cost of the lock only (no reference count), as `poll` pays.
    held: InPlace<Cqe, BiasedGuard<'a, Rings>>,
    /// The section's wall-clock reading (zeros unless asked for). Here rather than beside the
    /// cursor in a wrapper of the API's: adding fields around it copied the cursor, just
    /// stored field by field, in 16-byte pieces, whose loads waited for those stores to reach
    /// the cache (store forwarding fails on a load spanning two stores); a tenth of a polling
    /// section's time at 16 completions.
    wall: crate::clock::WallClock,
}

impl Drop for Cursor<'_> {
    #[inline]
    fn drop(&mut self) {
        // Before `held` lets go of the lock (fields drop after this).
        self.cq.section.store(0, Ordering::Relaxed);
    }
}

impl Cursor<'_> {
    /// The completion held.
    #[inline]
    pub fn cqe(&self) -> &Cqe {
        self.held.get()
    }

    /// The fields the CQ returns.
    #[inline(always)]
    pub fn wc_flags(&self) -> WcExFlags {
        self.cq.wc_flags
    }

    /// The wall-clock reading taken when the section started (zeros unless
    /// [`Cq::start_poll`] was asked for it).
    #[inline(always)]
    pub fn wall(&self) -> &crate::clock::WallClock {
        &self.wall
    }

    /// Moves to the next completion; false (`ENOENT`) when there is none.
    #[inline(always)]
    pub fn advance(&mut self) -> bool {
        if !self.held.advance() && !self.hop() {
            return false;
        }
        self.cq.retire_if_send(self.held.get());
        true
    }

    /// The held ring is empty: moves to the ring [`Cq::pick`] names, if another has a
    /// completion (only after a resize kept old rings).
    #[cold]
    fn hop(&mut self) -> bool {
        let rings: &Rings = self.held.keeper();
        if rings.old.is_empty() {
            return false;
        }
        match Cq::pick(rings) {
            // SAFETY: a ring of the `Rings` the held guard keeps, in an `Arc` it holds.
            Some(at) if at != self.held.at() => unsafe { self.held.hop(at) },
            _ => false,
        }
    }

    /// The CQ polled.
    pub fn cq(&self) -> &Cq {
        self.cq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cq(cqe: u32, ch: Option<Arc<Channel>>) -> (Arc<Cq>, Arc<AsyncQueue>) {
        let ev = Arc::new(AsyncQueue::new().unwrap());
        let c = Cq::new(
            1,
            (cqe, 1 << 20),
            ch,
            ev.clone(),
            (0..4).map(|_| AtomicU32::new(0)).collect(),
            crate::clock::Clock::new(64),
            None,
            WcExFlags::STANDARD,
        )
        .unwrap();
        (c, ev)
    }

    /// Threads that poll one CQ at once, through `poll`, cursors and compact records, while
    /// others complete into it: the consumer lock hands each completion to exactly one of
    /// them (the ring itself no longer arbitrates between consumers).
    #[test]
    fn concurrent_pollers_take_each_completion_once() {
        const PRODUCERS: u64 = 3;
        const EACH: u64 = 20_000;
        let (c, _) = cq(64, None);
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        let cqe = Cqe {
                            wr_id: p * EACH + i,
                            opcode: 0x80,
                            ..Default::default()
                        };
                        // A full ring loses the completion (overrun): wait for room instead,
                        // leaving a slot for each other producer and for a cursor's held one.
                        while c.len() + PRODUCERS as u32 + 1 > c.capacity() {
                            std::thread::yield_now();
                        }
                        assert!(c.push(cqe));
                    }
                })
            })
            .collect();
        let pollers: Vec<_> = (0..3)
            .map(|kind| {
                let (c, done) = (c.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    let size = c.layout().size();
                    let mut buf = vec![0u8; 8 * size];
                    let mut out = [Cqe::default(); 8];
                    while !done.load(Ordering::Acquire) || !c.is_empty() {
                        match kind {
                            0 => {
                                let n = c.poll(&mut out);
                                got.extend(out[..n].iter().map(|c| c.wr_id));
                            }
                            1 => {
                                if let Some(mut cur) = c.start_poll(false) {
                                    got.push(cur.cqe().wr_id);
                                    while got.len() % 5 != 0 && cur.advance() {
                                        got.push(cur.cqe().wr_id);
                                    }
                                }
                            }
                            _ => {
                                let n = c.poll_compact(&mut buf, 8);
                                got.extend(
                                    crate::cq::compact::records(&buf, size, n)
                                        .map(|r| crate::cq::compact::header(r).wr_id),
                                );
                            }
                        }
                        std::thread::yield_now();
                    }
                    got
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        done.store(true, Ordering::Release);
        let mut all: Vec<u64> = pollers
            .into_iter()
            .flat_map(|p| p.join().unwrap())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..PRODUCERS * EACH).collect::<Vec<_>>());
        assert!(!c.overrun());
    }

    thread_local! {
        /// Run once by this thread's next `looks_empty`, between its read of `bare` and its
        /// look at that ring: where a resize may come in between.
        pub(super) static AFTER_BARE_LOAD: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
            std::cell::RefCell::new(None);
    }

    /// Polls look for an empty CQ without the consumer lock (`looks_empty`); a resize moves
    /// the completions into a new ring. A poll that read the old ring's pointer just before a
    /// whole resize ran (its ring drained into the new one) must not find the CQ empty: here
    /// the resize is made to run exactly there.
    #[test]
    fn a_poll_overtaken_by_a_resize_does_not_find_a_full_cq_empty() {
        const HELD: u64 = 100;
        let (c, _) = cq(128, None);
        for wr_id in 0..HELD {
            assert!(c.push(Cqe {
                wr_id,
                opcode: 0x80,
                ..Default::default()
            }));
        }
        let resizer = c.clone();
        AFTER_BARE_LOAD.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                std::thread::spawn(move || resizer.resize(256).unwrap())
                    .join()
                    .unwrap();
            }))
        });
        let mut out = [Cqe::default(); 4];
        assert_eq!(
            c.poll(&mut out),
            4,
            "{HELD} completions queued, the poll found none"
        );
        assert_eq!(out.map(|c| c.wr_id), [0, 1, 2, 3]);
        assert!(
            AFTER_BARE_LOAD.with(|hook| hook.borrow().is_none()),
            "the hook ran"
        );
        assert_eq!(c.capacity(), 256);
        assert_eq!(c.len(), HELD as u32 - 4);
    }

    /// A thread that polls inside its own polling section finds nothing (the section holds
    /// the queue) instead of waiting for ever on itself; once the section ends, it polls the
    /// rest.
    #[test]
    fn a_poll_inside_the_threads_own_section_does_not_hang() {
        let (c, _) = cq(8, None);
        for i in 0..3 {
            assert!(c.push(Cqe {
                wr_id: i,
                opcode: 0x80,
                ..Default::default()
            }));
        }
        let mut out = [Cqe::default(); 4];
        let cur = c.start_poll(false).unwrap();
        assert_eq!(cur.cqe().wr_id, 0);
        assert_eq!(c.poll(&mut out), 0);
        assert!(c.start_poll(false).is_none());
        let mut buf = vec![0u8; 4 * c.layout().size()];
        assert_eq!(c.poll_compact(&mut buf, 4), 0);
        assert!(matches!(c.resize(64), Err(Error::Busy(_))));
        drop(cur);
        assert_eq!(c.poll(&mut out), 2);
        assert_eq!(out[..2].iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn cqe_fits_one_cache_line_with_its_sequence() {
        assert_eq!(std::mem::size_of::<Cqe>(), 56);
    }

    #[test]
    fn overrun_raises_one_async_event() {
        let (c, ev) = cq(2, None);
        for i in 0..5 {
            let kept = c.push(Cqe {
                wr_id: i,
                ..Default::default()
            });
            assert_eq!(kept, i < 2);
        }
        assert!(c.overrun());
        assert_eq!(ev.len(), 1);
        assert_eq!(ev.pop(false).unwrap().kind, AsyncEventType::CqErr);
        let mut out = [Cqe::default(); 8];
        assert_eq!(c.poll(&mut out), 2);
    }

    #[test]
    fn solicited_arm_ignores_unsolicited() {
        let ch = Channel::new().unwrap();
        let (c, _) = cq(16, Some(ch.clone()));
        c.req_notify(true).unwrap();
        assert!(c.push(Cqe::default()));
        assert!(ch.get_event(false).is_err());
        assert!(c.push(Cqe {
            solicited: 1,
            ..Default::default()
        }));
        assert_eq!(ch.get_event(false).unwrap().id(), 1);
        // Disarmed after firing.
        assert!(c.push(Cqe {
            solicited: 1,
            ..Default::default()
        }));
        assert!(ch.get_event(false).is_err());
        assert_eq!(c.unacked_events(), 1);
        c.ack_events(1);
        assert_eq!(c.unacked_events(), 0);
    }

    #[test]
    fn an_event_for_already_polled_completions_is_withheld_and_the_cq_stays_armed() {
        let ch = Channel::new().unwrap();
        let (c, _) = cq(16, Some(ch.clone()));
        c.req_notify(false).unwrap();
        assert!(c.push(Cqe::default()));
        let mut out = [Cqe::default(); 4];
        assert_eq!(c.poll(&mut out), 1);
        assert!(ch.get_event(false).is_err(), "nothing new to report");
        // Still armed: the next completion fires.
        assert!(c.push(Cqe::default()));
        assert_eq!(ch.get_event(false).unwrap().id(), 1);
    }

    #[test]
    fn resize_keeps_completions() {
        let (c, _) = cq(4, None);
        for i in 0..3 {
            assert!(c.push(Cqe {
                wr_id: i,
                ..Default::default()
            }));
        }
        assert!(c.resize(2).is_err());
        assert!(c.resize(100).unwrap() >= 100);
        let mut out = [Cqe::default(); 8];
        assert_eq!(c.poll(&mut out), 3);
        assert_eq!(out[2].wr_id, 2);
    }

    /// A resize after the ring was handed to peers keeps it: what a peer pushes into it later
    /// is polled (before the new ring's completions, and through the cursor too), arming
    /// reaches it, and `len` counts it.
    #[test]
    fn resize_keeps_a_ring_peers_have_mapped() {
        let ch = Channel::new().unwrap();
        let (c, _) = cq(4, Some(ch.clone()));
        let cqe = |i: u64| Cqe {
            wr_id: i,
            opcode: 0x80,
            ..Default::default()
        };
        let peer_ring = c.ring().cur.clone(); // as a QP's creation exports it
        for i in 0..3 {
            assert!(c.push(cqe(i)));
        }
        assert!(c.resize(2).is_err(), "3 queued");
        assert!(c.resize(64).unwrap() >= 64);
        // The peer still pushes into the ring it mapped; this process into the new one.
        assert!(matches!(
            push_ring(&peer_ring, cqe(3), c.clock()),
            Pushed::Queued { .. }
        ));
        assert!(c.push(cqe(100)));
        assert_eq!(c.len(), 5);
        let mut out = [Cqe::default(); 2];
        assert_eq!(c.poll(&mut out), 2);
        assert_eq!(out.map(|c| c.wr_id), [0, 1]);
        // The cursor goes on from the old ring into the new one.
        let mut got = Vec::new();
        let mut cur = c.start_poll(false).unwrap();
        loop {
            got.push(cur.cqe().wr_id);
            if !cur.advance() {
                break;
            }
        }
        drop(cur);
        assert_eq!(got, [2, 3, 100]);
        assert!(c.is_empty());
        // Arming reaches the old ring: a peer's completion there raises the event.
        c.req_notify(false).unwrap();
        assert!(matches!(
            push_ring(&peer_ring, cqe(4), c.clock()),
            Pushed::Queued { notify: true }
        ));
        let got = ch.get_event(false).unwrap();
        assert!(Arc::ptr_eq(&got, &c));
        assert_eq!(c.poll(&mut out), 1);
        assert_eq!(out[0].wr_id, 4);
        // A second resize keeps both old rings only if the new one was exported: it was not.
        assert!(c.resize(128).unwrap() >= 128);
        assert_eq!(c.read_ring().old.len(), 1);
        assert!(matches!(
            push_ring(&peer_ring, cqe(5), c.clock()),
            Pushed::Queued { .. }
        ));
        assert_eq!(c.poll(&mut out), 1);
        assert_eq!(out[0].wr_id, 5);
        // Compact records too: the old ring's first.
        assert!(c.push(cqe(101)));
        assert!(matches!(
            push_ring(&peer_ring, cqe(6), c.clock()),
            Pushed::Queued { .. }
        ));
        let size = c.layout().size();
        let mut buf = vec![0u8; 4 * size];
        assert_eq!(c.poll_compact(&mut buf, 4), 2);
        let ids: Vec<u64> = crate::cq::compact::records(&buf, size, 2)
            .map(|r| crate::cq::compact::header(r).wr_id)
            .collect();
        assert_eq!(ids, [6, 101]);
    }

    /// A fired arm whose completion was already polled is withheld, also while a producer
    /// has claimed a slot but not yet published it (the CQ holds nothing to poll): the
    /// program is never woken to an empty poll, and that producer's completion, published
    /// later, raises the event.
    #[test]
    fn an_event_is_not_delivered_for_a_completion_still_being_written() {
        let ch = Channel::new().unwrap();
        let (c, _) = cq(8, Some(ch.clone()));
        let cqe = |i: u64| Cqe {
            wr_id: i,
            opcode: 0x80,
            ..Default::default()
        };
        c.req_notify(false).unwrap();
        assert!(c.push(cqe(1))); // fires
        let mut out = [Cqe::default(); 4];
        assert_eq!(c.poll(&mut out), 1); // polled before the event is collected
        let ring = c.read_ring().cur.clone();
        let pos = ring.claim_only().unwrap(); // a peer mid-push
        assert!(
            matches!(ch.get_event(false), Err(Error::WouldBlock)),
            "an event with nothing to poll"
        );
        // The peer publishes, then checks the arm as `push_ring` does: re-armed, it fires.
        ring.publish_claimed(pos, &cqe(2));
        assert!(notify::fire(&*ring, false), "re-armed");
        let got = ch.get_event(false).unwrap();
        assert!(Arc::ptr_eq(&got, &c));
        assert_eq!(c.poll(&mut out), 1);
        assert_eq!(out[0].wr_id, 2);
    }
}
