//! A bounded multi-producer multi-consumer ring of fixed-size slots in a shared segment.
//!
//! This is the one queue shape the NIC uses (CQ rings, receive queues, SRQs): each slot starts
//! with a sequence word, so producers and consumers in different processes need no lock, only
//! atomics on the ring's own memory (Vyukov's bounded queue). A producer that dies between
//! claiming a slot and publishing it stalls consumers at that slot; it can never make them read
//! half-written data. A ring whose consumers all live in one process and take a lock there (a
//! CQ's) is consumed with plain stores (`*_exclusive`): no compare-and-swap per entry.
//!
//! Layout (offsets in bytes): `0` header (magic, version, capacity, stride, then 48 bytes for
//! the owner's fields), `64` consumer index, `128` producer index, `192` slots.

use crate::device_memory::prefetch;
use crate::device_memory::segment::Segment;
use crate::error::Result;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

const MAGIC: u32 = 0x5249_4e47; // "RING"
/// 2: sequence words are stored relative to their slot's index (all zero = an empty ring).
/// 3: a CQ ring's header says whether producers stamp completions (`cq::W_STAMP`).
const VERSION: u32 = 3;
const HEAD: usize = 64;
const TAIL: usize = 128;
const SLOTS: usize = 192;
/// Bytes of header the ring's owner may use for its own atomics (offsets 16..64).
pub const USER_WORDS: usize = 12;

/// Marker for slot payloads: plain `Copy` data written whole by a producer and read whole by a
/// consumer.
///
/// # Safety
/// `#[repr(C)]`, no pointers, valid for any bit pattern a producer wrote.
pub unsafe trait SlotPayload: Copy {}

/// The ring had no free slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

/// A ring of `capacity` slots, each `8 + payload` bytes rounded up to 8.
pub struct Ring {
    seg: Segment,
    mask: u64,
    stride: usize,
}

impl Ring {
    /// Creates an empty ring; `capacity` is rounded up to a power of two.
    pub fn new(name: &str, capacity: u32, payload_bytes: usize) -> Result<Ring> {
        // Vyukov sequence numbers need at least two slots to tell "published" from "free".
        let capacity = capacity.max(2).next_power_of_two();
        let stride = (8 + payload_bytes).next_multiple_of(8);
        let seg = Segment::create(name, SLOTS + capacity as usize * stride)?;
        // `Slots` relies on it (segments start on a page).
        assert_eq!(seg.as_ptr() as usize % 8, 0, "misaligned ring segment");
        let header: &[AtomicU32] = seg.slice(0, 4);
        header[0].store(MAGIC, Ordering::Relaxed);
        header[1].store(VERSION, Ordering::Relaxed);
        header[2].store(capacity, Ordering::Relaxed);
        header[3].store(stride as u32, Ordering::Relaxed);
        let ring = Ring {
            seg,
            mask: u64::from(capacity) - 1,
            stride,
        };
        // A new segment reads zero, which is every slot free for the first lap (see
        // `Slots::seq_load`): no slot is written, so the pages of slots never used are never
        // faulted in.
        std::sync::atomic::fence(Ordering::Release);
        Ok(ring)
    }

    /// Maps a ring that another process (or this one) created, checking its header: the
    /// header is peer-written data, so a bad one is an error, never a panic.
    pub fn open(seg: Segment) -> Result<Ring> {
        let bad = |what: &str| crate::Error::InvalidArgument(format!("shared ring: {what}"));
        if seg.len() < SLOTS {
            return Err(bad("segment too small"));
        }
        let header: &[AtomicU32] = seg.slice(0, 4);
        if header[0].load(Ordering::Acquire) != MAGIC
            || header[1].load(Ordering::Acquire) != VERSION
        {
            return Err(bad("bad magic or version"));
        }
        let capacity = header[2].load(Ordering::Acquire);
        let stride = header[3].load(Ordering::Acquire) as usize;
        let fits = (capacity as usize)
            .checked_mul(stride)
            .and_then(|b| b.checked_add(SLOTS))
            .is_some_and(|end| end <= seg.len());
        if capacity < 2 || !capacity.is_power_of_two() || stride < 16 || stride % 8 != 0 || !fits {
            return Err(bad("bad geometry"));
        }
        if seg.as_ptr() as usize % 8 != 0 {
            return Err(bad("misaligned segment"));
        }
        Ok(Ring {
            seg,
            mask: u64::from(capacity) - 1,
            stride,
        })
    }

    /// The segment holding the ring.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Number of slots.
    pub fn capacity(&self) -> u32 {
        (self.mask + 1) as u32
    }

    /// Payload bytes available in a slot.
    pub fn payload_bytes(&self) -> usize {
        self.stride - 8
    }

    /// The owner's header words (12 × `AtomicU32`).
    pub fn user_words(&self) -> &[AtomicU32] {
        self.seg.slice(16, USER_WORDS)
    }

    #[inline(always)]
    fn head(&self) -> &AtomicU64 {
        self.seg.at(HEAD)
    }

    #[inline(always)]
    fn tail(&self) -> &AtomicU64 {
        self.seg.at(TAIL)
    }

    /// The sequence word of slot `pos`, for prefetches (its value: [`Slots::seq_load`]).
    #[inline(always)]
    fn seq(&self, pos: u64) -> &AtomicU64 {
        self.slots().seq(pos)
    }

    #[inline(always)]
    fn seq_load(&self, pos: u64, order: Ordering) -> u64 {
        self.slots().seq_load(pos, order)
    }

    #[inline(always)]
    fn seq_store(&self, pos: u64, value: u64, order: Ordering) {
        self.slots().seq_store(pos, value, order)
    }

    #[inline(always)]
    fn payload_ptr(&self, pos: u64) -> *mut u8 {
        self.slots().payload(pos).cast_mut()
    }

    /// Entries currently queued (a snapshot).
    pub fn len(&self) -> u32 {
        let tail = self.tail().load(Ordering::Acquire);
        let head = self.head().load(Ordering::Acquire);
        tail.saturating_sub(head) as u32
    }

    /// The consumer and producer indices (a snapshot): entries taken so far, and slots claimed
    /// so far (published or not).
    pub fn indices(&self) -> (u64, u64) {
        (
            self.head().load(Ordering::Acquire),
            self.tail().load(Ordering::Acquire),
        )
    }

    /// Entries ready to be taken from the head, up to `max` (a snapshot). Each is looked at
    /// with acquire ordering, so whatever their producers wrote before them is visible after.
    pub fn ready(&self, max: usize) -> usize {
        let head = self.head().load(Ordering::Acquire);
        (0..max as u64)
            .take_while(|&i| self.seq_load(head + i, Ordering::Acquire) == head + i + 1)
            .count()
    }

    /// True when nothing is queued (a snapshot).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the oldest slot holds no published entry, read with no lock (a hint for
    /// consumers: see `Cq::looks_empty`). A head read stale names a slot consumed already,
    /// whose sequence has moved past it, so that reads false too.
    #[inline(always)]
    pub fn head_unpublished(&self) -> bool {
        let slots = self.slots();
        let head = slots.head.load(Ordering::Relaxed);
        slots.seq_load(head, Ordering::Acquire) == head
    }

    /// Claims the next free slot for writing; `None` when the ring is full.
    fn claim_push(&self) -> Option<u64> {
        let tail = self.tail();
        let mut pos = tail.load(Ordering::Relaxed);
        // The slot was last written by its consumer (on another core, as a rule): fetching
        // it for writing at once saves a second transfer, the upgrade of a shared copy, when
        // the payload and sequence stores follow.
        prefetch::write(self.seq(pos));
        loop {
            let seq = self.seq_load(pos, Ordering::Acquire);
            match seq.cmp(&pos) {
                std::cmp::Ordering::Equal => {
                    match tail.compare_exchange_weak(
                        pos,
                        pos + 1,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => return Some(pos),
                        Err(now) => pos = now,
                    }
                }
                std::cmp::Ordering::Less => return None,
                std::cmp::Ordering::Greater => pos = tail.load(Ordering::Relaxed),
            }
        }
    }

    /// Asks for the oldest slot's line with write intent, for a consumer about to take it
    /// and release it (a store): one transfer instead of a read and then an upgrade. Not for
    /// consumers that poll an empty ring, whose producer would lose the line to each poll.
    #[inline]
    pub fn prefetch_head(&self) {
        prefetch::write(self.seq(self.head().load(Ordering::Relaxed)));
    }

    /// Takes the oldest published slot for reading, for the ring's only consumer of the
    /// moment: a plain store moves the head, where [`claim_pop`](Self::claim_pop) needs a
    /// compare-and-swap per entry against other consumers. The slot stays the caller's until
    /// it is [released](Self::release).
    ///
    /// # Safety
    /// No other consumer takes from this ring until the slot is released (its owner holds a
    /// lock that every consumer takes).
    #[inline(always)]
    unsafe fn take_exclusive(&self) -> Option<u64> {
        let slots = self.slots();
        let pos = slots.head.load(Ordering::Relaxed);
        // SAFETY: the caller's; `pos` is the head.
        unsafe { slots.take_at(pos) }.then_some(pos)
    }

    /// The slot array, its geometry copied out of `self` (see [`Slots`]).
    #[inline(always)]
    fn slots(&self) -> Slots<'_> {
        Slots {
            base: self.seg.as_ptr().wrapping_add(SLOTS),
            mask: self.mask,
            stride: self.stride,
            head: self.head(),
        }
    }

    /// Claims the oldest published slot for reading; `None` when the ring is empty.
    #[inline]
    fn claim_pop(&self) -> Option<u64> {
        let head = self.head();
        let mut pos = head.load(Ordering::Relaxed);
        loop {
            let seq = self.seq_load(pos, Ordering::Acquire);
            match seq.cmp(&(pos + 1)) {
                std::cmp::Ordering::Equal => {
                    match head.compare_exchange_weak(
                        pos,
                        pos + 1,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => return Some(pos),
                        Err(now) => pos = now,
                    }
                }
                std::cmp::Ordering::Less => return None,
                std::cmp::Ordering::Greater => pos = head.load(Ordering::Relaxed),
            }
        }
    }

    /// Appends a header and `items` after it; the position it took, or `Err` if the ring is
    /// full.
    pub fn push_slice<H: SlotPayload, T: SlotPayload>(
        &self,
        header: &H,
        items: &[T],
    ) -> Result<u64, Full> {
        let hsize = std::mem::size_of::<H>().next_multiple_of(8);
        assert!(hsize + std::mem::size_of_val(items) <= self.payload_bytes());
        let pos = self.claim_push().ok_or(Full)?;
        let p = self.payload_ptr(pos);
        // SAFETY: slot `pos` is ours until its sequence is published; header and items fit in
        // the payload area (asserted), which lies inside the segment.
        unsafe {
            p.cast::<H>().write_unaligned(*header);
            let dst = p.add(hsize).cast::<T>();
            for (i, item) in items.iter().enumerate() {
                dst.add(i).write_unaligned(*item);
            }
        }
        self.seq_store(pos, pos + 1, Ordering::Release);
        Ok(pos)
    }

    /// Asks for every line of slot `pos` with write intent, for a producer that will fill it
    /// later: the transfer from the consumer that freed it overlaps the producer's other work.
    /// A hint: it changes nothing a program can observe, wherever the slot stands.
    #[inline]
    pub fn prefetch_slot(&self, pos: u64) {
        let first = self.seq(pos);
        prefetch::write(first);
        let last = (first as *const AtomicU64 as *const AtomicU8).wrapping_add(self.stride - 1);
        // SAFETY: the slot's last byte lies inside the slot, which lies inside the segment
        // (`Ring::new` and `Ring::open` checked the geometry), mapped while `self` lives; an
        // atomic byte may be written by another process meanwhile.
        prefetch::write(unsafe { &*last });
    }

    /// Removes the oldest entry: its header, and `count(&header)` items (clamped to what fits)
    /// appended to `items`.
    pub fn pop_slice<H: SlotPayload, T: SlotPayload>(
        &self,
        items: &mut impl Extend<T>,
        count: impl Fn(&H) -> usize,
    ) -> Option<H> {
        let hsize = std::mem::size_of::<H>().next_multiple_of(8);
        assert!(hsize <= self.payload_bytes());
        let pos = self.claim_pop()?;
        let p = self.payload_ptr(pos);
        // SAFETY: slot `pos` was published and is ours until released below; reads stay in
        // the payload area because `n` is clamped to what fits after the header.
        let header = unsafe {
            let header = p.cast::<H>().read_unaligned();
            let room = (self.payload_bytes() - hsize) / std::mem::size_of::<T>().max(1);
            let n = count(&header).min(room);
            let src = p.add(hsize).cast::<T>();
            items.extend((0..n).map(|i| src.add(i).read_unaligned()));
            header
        };
        self.release(pos);
        Some(header)
    }

    /// Appends `value`; `Err` if the ring is full.
    pub fn push<T: SlotPayload>(&self, value: &T) -> Result<(), Full> {
        let pos = self.claim_push().ok_or(Full)?;
        self.publish(pos, value);
        Ok(())
    }

    /// Writes `value` into slot `pos`, claimed by `claim_push`, and publishes it.
    fn publish<T: SlotPayload>(&self, pos: u64, value: &T) {
        assert!(std::mem::size_of::<T>() <= self.payload_bytes());
        // SAFETY: we own slot `pos` until we publish its sequence; the payload area is in
        // bounds, and `T` fits (asserted).
        unsafe { self.payload_ptr(pos).cast::<T>().write_unaligned(*value) };
        self.seq_store(pos, pos + 1, Ordering::Release);
    }

    /// A producer stopped between claiming a slot and publishing it (tests of consumers):
    /// the slot, to publish later with [`publish_claimed`](Self::publish_claimed).
    #[cfg(test)]
    pub(crate) fn claim_only(&self) -> Option<u64> {
        self.claim_push()
    }

    /// Publishes `value` in a slot from [`claim_only`](Self::claim_only).
    #[cfg(test)]
    pub(crate) fn publish_claimed<T: SlotPayload>(&self, pos: u64, value: &T) {
        self.publish(pos, value);
    }

    /// Frees claimed slot `pos` for producers.
    #[inline]
    fn release(&self, pos: u64) {
        self.slots().release(pos);
    }

    /// Removes up to `max` entries, oldest first, handing `f` a reference to each where it
    /// lies in the ring (no copy through the stack), for the ring's only consumer of the
    /// moment; returns how many.
    ///
    /// # Safety
    /// No other consumer takes from this ring until this returns.
    #[inline(always)]
    pub(crate) unsafe fn pop_many_exclusive<T: SlotPayload>(
        &self,
        max: usize,
        mut f: impl FnMut(&T),
    ) -> usize {
        assert!(std::mem::size_of::<T>() <= self.payload_bytes());
        assert!(std::mem::align_of::<T>() <= 8);
        let slots = self.slots();
        let first = slots.head.load(Ordering::Relaxed);
        let mut pos = first;
        // SAFETY: the caller's; `pos` is the head, moved on by each take.
        while pos - first < max as u64 && unsafe { slots.take_at(pos) } {
            // SAFETY: slot `pos` was published and is ours; no producer writes it until we
            // release it below. The payload is in bounds and 8-byte aligned (slots are 8-byte
            // multiples in an 8-byte-aligned segment, payloads start 8 bytes in).
            f(unsafe { &*slots.payload(pos).cast::<T>() });
            slots.release(pos);
            pos += 1;
        }
        (pos - first) as usize
    }

    /// Removes the oldest entry.
    pub fn pop<T: SlotPayload>(&self) -> Option<T> {
        assert!(std::mem::size_of::<T>() <= self.payload_bytes());
        let pos = self.claim_pop()?;
        // SAFETY: slot `pos` was published (seq == pos + 1) and we claimed it; no producer
        // writes it until we release it below.
        let v = unsafe { self.payload_ptr(pos).cast::<T>().read_unaligned() };
        self.release(pos);
        Some(v)
    }
}

/// A ring's slot array with its geometry in locals (every slot access goes through it): to
/// the compiler a store into the ring might change the `Ring` itself, so geometry read through
/// `&Ring` is loaded again (and bounds-checked again) after every store, where a copy stays in
/// registers. The bounds every slot meets were checked once, when the ring was made or opened.
#[derive(Clone, Copy)]
struct Slots<'a> {
    /// The first slot.
    base: *const u8,
    mask: u64,
    stride: usize,
    head: &'a AtomicU64,
}

impl<'a> Slots<'a> {
    #[inline(always)]
    fn slot(&self, pos: u64) -> *const u8 {
        self.base
            .wrapping_add((pos & self.mask) as usize * self.stride)
    }

    /// The sequence word of slot `pos` as stored (see [`seq_load`](Self::seq_load)).
    #[inline(always)]
    fn seq(&self, pos: u64) -> &'a AtomicU64 {
        // SAFETY: `Ring::new` and `Ring::open` made sure that `SLOTS + capacity * stride`
        // bytes lie in the segment, whose start is 8-byte aligned, with `stride` a multiple of
        // 8: every slot's first word is in bounds and aligned, and the segment, which the
        // `Ring` behind `'a` holds, stays mapped while the reference lives.
        unsafe { &*self.slot(pos).cast::<AtomicU64>() }
    }

    /// The sequence of slot `pos`: what its word holds plus the slot's index, so that the
    /// zeros of a new segment are Vyukov's initial sequences (slot `i` free at `i`).
    #[inline(always)]
    fn seq_load(&self, pos: u64, order: Ordering) -> u64 {
        self.seq(pos).load(order).wrapping_add(pos & self.mask)
    }

    /// Stores sequence `value` into slot `pos`'s word (relative to the slot's index).
    #[inline(always)]
    fn seq_store(&self, pos: u64, value: u64, order: Ordering) {
        self.seq(pos)
            .store(value.wrapping_sub(pos & self.mask), order);
    }

    /// The payload of slot `pos` (8 bytes in: in bounds, 8-byte aligned, as for `seq`).
    #[inline(always)]
    fn payload(&self, pos: u64) -> *const u8 {
        self.slot(pos).wrapping_add(8)
    }

    /// [`Ring::release`].
    #[inline(always)]
    fn release(&self, pos: u64) {
        self.seq_store(pos, pos + self.mask + 1, Ordering::Release);
    }

    /// Takes slot `pos`, the head, if it was published: [`Ring::take_exclusive`] for a
    /// consumer that knows the head (it moved it there last). Not loading the head back keeps
    /// a store-to-load round trip out of each step of a polling loop.
    ///
    /// # Safety
    /// As for `take_exclusive`, and `pos` is the head.
    #[inline(always)]
    unsafe fn take_at(&self, pos: u64) -> bool {
        if self.seq_load(pos, Ordering::Acquire) != pos + 1 {
            return false;
        }
        // Nobody else moves the head meanwhile (the caller's promise), so this is the
        // compare-and-swap's effect without its cost.
        self.head.store(pos + 1, Ordering::Relaxed);
        true
    }
}

/// The oldest entry of a ring, read where it lies instead of copied out.
///
/// The slot stays claimed (producers cannot reuse it) until the next entry is taken or the
/// `InPlace` is dropped, so a reader can look at single fields as often as it likes. It always
/// holds an entry: when the ring runs dry, [`advance`](Self::advance) keeps the last one, which
/// costs the ring one slot of room until the reader is done.
///
/// `G` is whatever keeps the ring alive and in place while entries are held: an `Arc<Ring>`,
/// or a guard of the lock its owner swaps rings under (so no reference count is touched). The
/// reader is the ring's only consumer while it lives (see [`start`](Self::start)), so taking
/// an entry costs no read-modify-write.
pub struct InPlace<T: SlotPayload, G: std::ops::Deref>
where
    G::Target: std::borrow::Borrow<Ring>,
{
    /// Keeps the ring alive and in place (`at` is used to reach it).
    _ring: G,
    /// The ring the held entry is in: the one `_ring` reaches, or one it keeps alive (see
    /// `start_at`), kept so each step does not walk the guard to it again.
    at: *const Ring,
    pos: u64,
    ptr: *const T,
}

impl<T: SlotPayload, G: std::ops::Deref> InPlace<T, G>
where
    G::Target: std::borrow::Borrow<Ring>,
{
    #[inline(always)]
    fn ring(&self) -> &Ring {
        // SAFETY: the ring at `at` stays there while `_ring` lives (the precondition of
        // `start`, `start_at` and `hop`).
        unsafe { &*self.at }
    }

    /// Takes the oldest entry of the ring `ring` holds; `None` when it is empty.
    ///
    /// # Safety
    /// `ring` reaches the same ring, at the same address, for as long as it lives, even when
    /// moved (true of an `Arc` and of a lock guard over one: the ring lies in the `Arc`'s
    /// allocation); and no other consumer takes from that ring while the `InPlace` lives.
    #[inline(always)]
    pub(crate) unsafe fn start(ring: G) -> Option<Self> {
        let at: *const Ring = std::borrow::Borrow::borrow(&*ring);
        // SAFETY: `at` is the ring `ring` reaches; the rest is the caller's.
        unsafe { Self::start_at(ring, at) }
    }

    /// [`start`](Self::start) on the ring at `at`, which `keep` keeps alive.
    ///
    /// # Safety
    /// The ring at `at` stays valid and in place for as long as `keep` lives, and no other
    /// consumer takes from it (nor from a ring later [hopped](Self::hop) to) while the
    /// `InPlace` lives.
    #[inline(always)]
    pub(crate) unsafe fn start_at(keep: G, at: *const Ring) -> Option<Self> {
        // SAFETY: the caller's.
        let r = unsafe { &*at };
        assert!(std::mem::size_of::<T>() <= r.payload_bytes());
        // Payloads start 8 bytes into 8-byte-multiple slots of a page-aligned segment.
        assert!(std::mem::align_of::<T>() <= 8);
        // SAFETY: the only consumer (the caller's promise).
        let pos = unsafe { r.take_exclusive() }?;
        let ptr = r.payload_ptr(pos).cast::<T>();
        Some(InPlace {
            _ring: keep,
            at,
            pos,
            ptr,
        })
    }

    /// What keeps the ring alive (the lock guard or `Arc` `start` was given).
    pub(crate) fn keeper(&self) -> &G {
        &self._ring
    }

    /// The ring the held entry is in.
    pub(crate) fn at(&self) -> *const Ring {
        self.at
    }

    /// Takes the oldest entry of the ring at `to` instead of the next of this ring, releasing
    /// the held one; false (holding the old entry still) when that ring is empty.
    ///
    /// # Safety
    /// The ring at `to` stays valid and in place for as long as the keeper lives, and no
    /// other consumer takes from it while the `InPlace` lives.
    pub(crate) unsafe fn hop(&mut self, to: *const Ring) -> bool {
        // SAFETY: the caller's.
        let r = unsafe { &*to };
        if std::mem::size_of::<T>() > r.payload_bytes() {
            return false;
        }
        // SAFETY: the only consumer of `to` (the caller's promise).
        let Some(next) = (unsafe { r.take_exclusive() }) else {
            return false;
        };
        self.ring().release(self.pos);
        self.at = to;
        self.pos = next;
        self.ptr = r.payload_ptr(next).cast::<T>();
        true
    }

    /// The entry held.
    #[inline(always)]
    pub fn get(&self) -> &T {
        // SAFETY: slot `pos` was published and claimed by us; no producer writes it until we
        // release it (in `advance` or `drop`), and `ptr` is in bounds and aligned (asserted
        // in `start`). `_ring` keeps the segment mapped for the borrow's lifetime.
        unsafe { &*self.ptr }
    }

    /// Releases the held entry and takes the next one; false (still holding the old entry)
    /// when the ring is empty.
    #[inline(always)]
    pub fn advance(&mut self) -> bool {
        let next = self.pos + 1;
        let ptr = {
            let slots = self.ring().slots();
            // SAFETY: the only consumer while `self` lives (the precondition of `start_at`),
            // so the head is where taking `pos` left it.
            if !unsafe { slots.take_at(next) } {
                return false;
            }
            slots.release(self.pos);
            slots.payload(next).cast::<T>()
        };
        self.pos = next;
        self.ptr = ptr;
        true
    }
}

impl<T: SlotPayload, G: std::ops::Deref> Drop for InPlace<T, G>
where
    G::Target: std::borrow::Borrow<Ring>,
{
    #[inline(always)]
    fn drop(&mut self) {
        self.ring().release(self.pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    // SAFETY: plain integers.
    unsafe impl SlotPayload for [u64; 3] {}

    #[test]
    fn fifo_and_full() {
        let r = Ring::new("t", 3, 24).unwrap();
        assert_eq!(r.capacity(), 4);
        for i in 0..4u64 {
            r.push(&[i, i, i]).unwrap();
        }
        assert!(r.push(&[9u64; 3]).is_err());
        assert_eq!(r.len(), 4);
        for i in 0..4u64 {
            assert_eq!(r.pop::<[u64; 3]>(), Some([i, i, i]));
        }
        assert_eq!(r.pop::<[u64; 3]>(), None);
    }

    #[test]
    fn in_place_holds_its_slot_until_it_moves_on() {
        let r = std::sync::Arc::new(Ring::new("t", 2, 24).unwrap());
        // SAFETY (both): an `Arc` keeps the ring in place; the test is its only consumer.
        assert!(unsafe { InPlace::<[u64; 3], _>::start(r.clone()) }.is_none());
        r.push(&[1u64; 3]).unwrap();
        r.push(&[2u64; 3]).unwrap();
        let mut c = unsafe { InPlace::<[u64; 3], _>::start(r.clone()) }.unwrap();
        assert_eq!(c.get(), &[1; 3]);
        // The held slot is not free yet: the ring (capacity 2) is still full.
        assert!(r.push(&[3u64; 3]).is_err());
        assert!(c.advance());
        assert_eq!(c.get(), &[2; 3]);
        r.push(&[3u64; 3]).unwrap();
        assert!(c.advance());
        // Empty: advance fails and keeps the last entry readable.
        assert!(!c.advance());
        assert_eq!(c.get(), &[3; 3]);
        drop(c);
        for i in 4..6u64 {
            r.push(&[i; 3]).unwrap();
        }
        assert_eq!(r.pop::<[u64; 3]>(), Some([4; 3]));
    }

    #[test]
    fn in_place_readers_and_producers_lose_nothing() {
        let r = std::sync::Arc::new(Ring::new("t", 8, 24).unwrap());
        const N: u64 = 20_000;
        let prod = {
            let r = r.clone();
            std::thread::spawn(move || {
                for i in 0..N {
                    while r.push(&[i, i * 2, i * 3]).is_err() {
                        std::hint::spin_loop();
                    }
                }
            })
        };
        let mut next = 0u64;
        while next < N {
            // SAFETY: an `Arc` keeps the ring in place; this thread is its only consumer.
            let Some(mut c) = (unsafe { InPlace::<[u64; 3], _>::start(r.clone()) }) else {
                continue;
            };
            loop {
                let v = *c.get();
                assert_eq!(v, [next, next * 2, next * 3]);
                next += 1;
                if next % 7 == 0 || !c.advance() {
                    break;
                }
            }
        }
        prod.join().unwrap();
        assert!(r.is_empty());
    }

    #[test]
    fn header_and_items() {
        let r = Ring::new("t", 2, 8 + 3 * 24).unwrap();
        r.push_slice(&[2u64, 0, 0], &[[1u64, 2, 3], [4, 5, 6]])
            .unwrap();
        let mut items = Vec::new();
        let h = r.pop_slice::<[u64; 3], [u64; 3]>(&mut items, |h| h[0] as usize);
        assert_eq!(h, Some([2, 0, 0]));
        assert_eq!(items, vec![[1, 2, 3], [4, 5, 6]]);
        // A lying count is clamped to the slot.
        r.push_slice(&[99u64, 0, 0], &[[7u64, 7, 7]]).unwrap();
        items.clear();
        r.pop_slice::<[u64; 3], [u64; 3]>(&mut items, |h| h[0] as usize);
        assert!(items.len() <= 3);
    }

    #[test]
    fn concurrent_producers_lose_nothing() {
        let r = std::sync::Arc::new(Ring::new("t", 1024, 24).unwrap());
        let mut handles = vec![];
        for t in 0..4u64 {
            let r = r.clone();
            handles.push(std::thread::spawn(move || {
                for i in 0..10_000u64 {
                    while r.push(&[t, i, t ^ i]).is_err() {
                        std::thread::yield_now();
                    }
                }
            }));
        }
        let mut next = [0u64; 4];
        let mut got = 0;
        while got < 40_000 {
            if let Some([t, i, x]) = r.pop::<[u64; 3]>() {
                assert_eq!(x, t ^ i, "torn slot");
                assert_eq!(next[t as usize], i, "per-producer order kept");
                next[t as usize] += 1;
                got += 1;
            }
        }
        for h in handles {
            h.join().unwrap();
        }
    }

    proptest! {
        #[test]
        fn matches_a_vecdeque(ops in proptest::collection::vec(any::<bool>(), 0..500), cap in 1u32..40) {
            let r = Ring::new("t", cap, 24).unwrap();
            let mut model = VecDeque::new();
            let capacity = r.capacity() as usize;
            for (n, push) in ops.into_iter().enumerate() {
                let n = n as u64;
                if push {
                    let ok = r.push(&[n, 0, 0]).is_ok();
                    prop_assert_eq!(ok, model.len() < capacity);
                    if ok { model.push_back(n); }
                } else {
                    prop_assert_eq!(r.pop::<[u64; 3]>().map(|v| v[0]), model.pop_front());
                }
                prop_assert_eq!(r.len() as usize, model.len());
            }
        }
    }
}
