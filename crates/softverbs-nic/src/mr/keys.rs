//! The memory-key table: one entry per registered memory region, in a shared segment.
//!
//! A key is `index << 8 | generation`, so a stale key (the slot was reused) never matches.
//! Readers pin an entry (count themselves in one of its two pin counts) before touching its
//! memory, and deregistration waits until no one is pinned, so the bytes behind a key stay
//! valid for the whole access even if the owner deregisters concurrently. A requester's own
//! keys, checked under its QP's send lock, count themselves nowhere: deregistration takes
//! each such lock of the region's PD once instead ([`KeyTable::pin_key`]).
//!
//! Memory windows live in the same table (see [`crate::mr::window`]): an entry of kind
//! window carries a copy of the range of the region it is bound to, so a pin reads one entry
//! whichever kind of key it was given.

use crate::device_memory::segment::{Segment, ShmPlain};
use crate::error::{Error, Result};
use crate::mr::hazard::{self, HazardRecord, Lease, Published, RECORDS};
use crate::mr::ordering::Placement;
use crate::types::AccessFlags;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

pub(crate) const FREE: u32 = 0;
pub(crate) const VALID: u32 = 1;
const DYING: u32 = 2;
/// A window being bound or invalidated: pins fail until it is valid again.
pub(crate) const CHANGING: u32 = 3;
const HEADER: usize = 64;
const MAGIC: u32 = 0x4b45_5953; // "KEYS"
/// 2: entries grew the layout fields (`layout_fd`, `layout_gen`, `layout_ino`); 4: the
/// window fields (`kind`, `bound_qp`, `windows`, `window_of`); 6: two pin counts, each on a
/// line of its own; 7: the hazard records after the entries ([`crate::mr::hazard`]).
const VERSION: u32 = 7;
/// Header word (byte offset): nonzero when the owner can fence leaseholders, so requesters
/// may pin through hazard records.
const HAZARDS_ALLOWED: usize = 32;
/// Header word: records below this index may have been leased (it only grows).
const HAZARD_MARK: usize = 36;
/// Header word: records leased now.
const HAZARD_LEASED: usize = 40;

/// What an entry is: a memory region, or a memory window of type 1 or 2.
pub(crate) const KIND_MR: u32 = 0;
pub(crate) const KIND_MW1: u32 = 1;
pub(crate) const KIND_MW2: u32 = 2;

/// One registered region, as any process mapping the table sees it: three cache lines, laid
/// out by who reads and writes them on the data path. Entries start on lines of their own:
/// entries sharing a line made two QPs on two CPUs, each using its own region, bounce that
/// line on every operation. And a pin count is never on a line the other side reads: with one
/// count beside the fields, a ping-pong over one region (each side writing the other's half,
/// as `ib_write_lat` does) moved the entry between the two processes twice a message, once
/// for the owner's own (local) pin and once for the peer's (remote) one.
///
/// - line 0: what every pin checks (read by all, written at registration only);
/// - line 1: what only peers read on the data path (where to map the bytes), their pin
///   count, and fields read off the data path (window and layout bookkeeping);
/// - line 2: the pin count of the table's owner.
#[repr(C, align(64))]
pub struct KeyEntry {
    // Line 0.
    pub(crate) state: AtomicU32,
    pub(crate) key: AtomicU32,
    /// [`KIND_MR`], [`KIND_MW1`] or [`KIND_MW2`].
    pub(crate) kind: AtomicU32,
    pub(crate) pd: AtomicU32,
    pub(crate) access: AtomicU32,
    /// Non-zero when the region is a layout: the generation of the published layout, bumped
    /// (to a process-unique value) every time the owner sets a new one, so peers can cache
    /// the decoded form keyed by (owner pid, key, generation, inode).
    pub(crate) layout_gen: AtomicU32,
    /// How peers place data into the region ([`Placement`] as a number; 0 is strict, so a
    /// table written before this field existed reads as all-strict).
    pub(crate) placement: AtomicU32,
    /// Where a peer process can map the bytes: the owner's `memfd` descriptor + 1 (0: the
    /// bytes are in plain process memory); its inode and the offset of `addr` in it are on
    /// line 1.
    pub(crate) mem_fd: AtomicU32,
    pub(crate) owner_pid: AtomicU32,
    pub(crate) _spare: AtomicU32,
    /// Address of the first byte in the owner's address space.
    pub(crate) addr: AtomicU64,
    pub(crate) length: AtomicU64,
    /// IOVA of the first byte (0 for zero-based regions).
    pub(crate) iova: AtomicU64,
    // Line 1.
    pub(crate) mem_ino: AtomicU64,
    pub(crate) mem_off: AtomicU64,
    /// Inode of the layout `memfd`, so a recycled descriptor number is never mistaken for it.
    pub(crate) layout_ino: AtomicU64,
    /// For a region carrying a non-contiguous layout: the owner's descriptor + 1 of the
    /// `memfd` holding the encoded layout (see [`crate::mr::store`]), 0 for none.
    pub(crate) layout_fd: AtomicU32,
    /// The slot's generation, bumped at each registration (the low 8 bits of the key before
    /// [`KeyTable::hide`]).
    pub(crate) generation: AtomicU32,
    /// A bound type-2 window: the only QP (number) whose incoming requests may use it.
    pub(crate) bound_qp: AtomicU32,
    /// A region: how many windows are bound to it (it cannot be deregistered meanwhile).
    pub(crate) windows: AtomicU32,
    /// A window: the key of the region it is bound to (0: not bound, no access).
    pub(crate) window_of: AtomicU32,
    /// Pins taken by everyone but the table's owner (views: peers, the host engine,
    /// importers).
    pub(crate) peer_pins: AtomicU32,
    // Line 2.
    /// Pins taken through the table's owner (the process that created it, see
    /// [`KeyTable::new`]).
    pub(crate) owner_pins: PinCount,
}

/// A pin count on a cache line of its own.
#[repr(C, align(64))]
pub(crate) struct PinCount(AtomicU32);

impl KeyEntry {
    /// Pins in either count; read after the state was moved away from VALID (both
    /// sequentially consistent, as the pin's count-then-state is), so no new pin passes.
    pub(crate) fn pinned(&self) -> bool {
        self.owner_pins.0.load(Ordering::SeqCst) != 0 || self.peer_pins.load(Ordering::SeqCst) != 0
    }

    /// Forgets pins a dead peer may have left, once waiting for them timed out.
    pub(crate) fn reset_pins(&self) {
        self.owner_pins.0.store(0, Ordering::SeqCst);
        self.peer_pins.store(0, Ordering::SeqCst);
    }

    /// Waits (bounded by `deadline`) until no pin is held, then clears the counts.
    pub(crate) fn wait_unpinned(&self, deadline: std::time::Instant) {
        while self.pinned() && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        self.reset_pins();
    }
}

// SAFETY: repr(C), atomics only, valid when zero (state FREE).
unsafe impl ShmPlain for KeyEntry {}

/// Why a key check failed; the caller maps it to the completion status of its side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    /// No region has this key (never registered, deregistered, or stale).
    Invalid,
    /// The region belongs to another protection domain.
    WrongPd,
    /// The region does not grant the access needed.
    Access,
    /// The range is not inside the region.
    Bounds,
    /// The region is a non-contiguous layout: every check passed, but its bytes must be
    /// resolved through the layout (`mr::resolve`), not addressed directly.
    Layout,
}

/// Where a layout region's description is, as the key entry records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutRef {
    /// The owner's descriptor of the layout `memfd`.
    pub fd: i32,
    /// Its inode.
    pub ino: u64,
    /// The layout's generation (non-zero).
    pub generation: u32,
    /// The owning process.
    pub owner_pid: u32,
    /// Offset of the pinned range in the layout (the IOVA minus the region's base IOVA).
    pub offset: u64,
}

/// A registered region's attributes, as registration recorded them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyInfo {
    pub key: u32,
    pub pd: u32,
    pub access: AccessFlags,
    pub addr: u64,
    pub length: u64,
    pub iova: u64,
}

/// Where a registration's bytes live, for peers in other processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backing {
    /// The owner's descriptor of the `memfd` holding the bytes.
    pub fd: i32,
    /// Its inode, so a reused descriptor number is never mistaken for it.
    pub ino: u64,
    /// Offset of the region's first byte in the `memfd`.
    pub offset: u64,
}

/// The slots of a key table no key names: the freed ones, then those never used (counted,
/// not listed, so a table of a million keys costs nothing until they are used).
#[derive(Default)]
pub(crate) struct FreeSlots {
    next: u32,
    last: u32,
    freed: Vec<u32>,
}

impl FreeSlots {
    pub(crate) fn pop(&mut self) -> Option<u32> {
        self.freed.pop().or_else(|| {
            (self.next != 0 && self.next <= self.last).then(|| {
                self.next += 1;
                self.next - 1
            })
        })
    }

    pub(crate) fn push(&mut self, slot: u32) {
        self.freed.push(slot);
    }
}

impl Extend<u32> for FreeSlots {
    fn extend<I: IntoIterator<Item = u32>>(&mut self, slots: I) {
        self.freed.extend(slots);
    }
}

/// The device's key table (this process's, or a view of a peer's).
pub struct KeyTable {
    seg: Segment,
    capacity: u32,
    /// Round keys of the permutation that hides slot numbers in the keys of a networked
    /// device (the last one zero: keys are plain `slot << 8 | generation`).
    pub(crate) mix: [u32; 4],
    pub(crate) free: Mutex<FreeSlots>,
    /// The device's ordering check: relaxed regions registered here are scrambled.
    ordering_check: bool,
    /// Created here (pins count in `owner_pins`), not opened (`peer_pins`).
    owner: bool,
}

/// A pinned range of a region: its bytes stay registered until this is dropped.
pub struct Pin<'a> {
    entry: &'a KeyEntry,
    /// The count this pin is in.
    count: &'a AtomicU32,
    /// Host address (in the owner's address space) of the first byte of the checked range.
    pub host: usize,
    /// [`PIN_ON_DEMAND`] and [`PIN_SWEPT`]. Not `bool`s: a bool's spare values became the tag
    /// of the lists that hold pins, and moving such a list copied the seven bytes after it in
    /// unaligned pieces that stalled store forwarding (a tenth of a 64-byte WRITE's time on
    /// AMD Zen).
    bits: u32,
}

/// [`Pin::bits`]: the region is on-demand (read with its rights at pin time).
const PIN_ON_DEMAND: u32 = 1;
/// [`Pin::bits`]: counted nowhere (see [`KeyTable::pin_key`]); dropping it does nothing.
const PIN_SWEPT: u32 = 2;
/// [`Pin::bits`]: published in a hazard record's slot (`count`), which dropping clears.
const PIN_HAZARD: u32 = 4;

/// How a pin keeps its region's deregistration waiting until it is dropped.
#[derive(Clone, Copy)]
pub(crate) enum PinBy<'h> {
    /// It counts itself in the key's entry.
    Count,
    /// A requester's pin of its own region under its send lock: counted nowhere in a table
    /// of this process, which the deregistration's sweep covers (see
    /// [`KeyTable::pin_key`]); counted in a table opened from another process.
    Sweep,
    /// A requester's pin of its peer's region: published in the requester's lease of the
    /// peer's table (see [`crate::mr::hazard`]); counted if the lease is of another table
    /// or all its slots are taken.
    Hazard(&'h Lease<KeyTable>),
}

impl Pin<'_> {
    /// The process whose memory the region is.
    pub(crate) fn owner_pid(&self) -> u32 {
        self.entry.owner_pid.load(Ordering::Relaxed)
    }

    /// Where a peer can map the pinned bytes: the backing and the offset of `host` in it.
    pub fn backing(&self) -> Option<Backing> {
        self.backing_at(self.host)
    }

    /// Like [`backing`](Self::backing), for host address `host` of the same registration
    /// (one the caller got from [`rebase`](Self::rebase) or the pin itself).
    #[inline]
    pub fn backing_at(&self, host: usize) -> Option<Backing> {
        let e = self.entry;
        let fd = e.mem_fd.load(Ordering::Relaxed);
        let base = e.addr.load(Ordering::Relaxed);
        (fd != 0).then(|| Backing {
            fd: fd as i32 - 1,
            ino: e.mem_ino.load(Ordering::Relaxed),
            offset: e.mem_off.load(Ordering::Relaxed) + (host as u64).wrapping_sub(base),
        })
    }

    /// The key this pin holds.
    pub fn key(&self) -> u32 {
        self.entry.key.load(Ordering::Relaxed)
    }

    /// The host address of `[iova, iova + len)` of the same (already checked and pinned)
    /// registration, if the range lies inside it: lets a layout walk reuse one pin for many
    /// pieces of one region.
    pub fn rebase(&self, iova: u64, len: u64) -> Option<usize> {
        let e = self.entry;
        let offset = iova.checked_sub(e.iova.load(Ordering::Relaxed))?;
        if offset.checked_add(len)? > e.length.load(Ordering::Relaxed) {
            return None;
        }
        usize::try_from(e.addr.load(Ordering::Relaxed).checked_add(offset)?).ok()
    }

    /// An on-demand-paging region (`ON_DEMAND`): its pages need not be mapped, so the owner
    /// reaches them too through cross-memory attach, which reports an unmapped page as
    /// EFAULT (an error completion) where a plain access would fault.
    #[inline]
    pub fn on_demand(&self) -> bool {
        self.bits & PIN_ON_DEMAND != 0
    }

    /// Where the owner process itself reaches `len` bytes at `host` of this region: directly,
    /// or for an on-demand region through cross-memory attach to itself (see
    /// [`on_demand`](Self::on_demand)).
    #[inline]
    pub(crate) fn owner_span(&self, host: usize, len: usize) -> crate::mr::access::Span {
        if self.on_demand() {
            crate::mr::access::Span::at(host, len, std::process::id())
        } else {
            crate::mr::access::Span::local(host, len)
        }
    }

    /// How data is to be placed into the pinned region.
    #[inline]
    pub fn placement(&self) -> Placement {
        Placement::from_raw(self.entry.placement.load(Ordering::Relaxed))
    }
}

impl Drop for Pin<'_> {
    #[inline]
    fn drop(&mut self) {
        if self.bits & (PIN_SWEPT | PIN_HAZARD) != 0 {
            if self.bits & PIN_HAZARD != 0 {
                // Release: the copy's stores are visible to a deregistration that sees 0.
                self.count.store(0, Ordering::Release);
            }
            return;
        }
        // Saturating: a deregistration that gave up waiting for a dead peer reset the count.
        let _ = self
            .count
            .fetch_update(Ordering::Release, Ordering::Relaxed, |u| u.checked_sub(1));
    }
}

impl Published for KeyTable {
    fn hazards_allowed(&self) -> bool {
        self.seg
            .at::<AtomicU32>(HAZARDS_ALLOWED)
            .load(Ordering::Acquire)
            != 0
    }

    fn hazard_mark(&self) -> &AtomicU32 {
        self.seg.at(HAZARD_MARK)
    }

    fn hazard_leased(&self) -> &AtomicU32 {
        self.seg.at(HAZARD_LEASED)
    }

    #[inline(always)]
    fn hazard_records(&self) -> &[HazardRecord] {
        self.seg.slice(records_at(self.capacity).0, RECORDS)
    }
}

/// Where the hazard records of a table of `capacity` regions start, and where they end.
fn records_at(capacity: u32) -> (usize, usize) {
    let start = (HEADER + (capacity as usize + 1) * std::mem::size_of::<KeyEntry>())
        .next_multiple_of(std::mem::align_of::<HazardRecord>());
    (start, start + RECORDS * std::mem::size_of::<HazardRecord>())
}

impl KeyTable {
    /// A table for `capacity` regions.
    pub fn new(capacity: u32) -> Result<KeyTable> {
        let capacity = capacity.clamp(1, (1 << 24) - 1);
        let seg = Segment::create("softverbs-keys", records_at(capacity).1)?;
        let header: &[AtomicU32] = seg.slice(0, 3);
        header[0].store(MAGIC, Ordering::Relaxed);
        header[1].store(VERSION, Ordering::Relaxed);
        header[2].store(capacity, Ordering::Relaxed);
        seg.at::<AtomicU32>(HAZARDS_ALLOWED)
            .store(u32::from(hazard::owner_can_fence()), Ordering::Relaxed);
        // Index 0 is never handed out, so no key is 0.
        let free = FreeSlots {
            next: 1,
            last: capacity,
            freed: Vec::new(),
        };
        Ok(KeyTable {
            seg,
            capacity,
            mix: [0; 4],
            free: Mutex::new(free),
            ordering_check: false,
            owner: true,
        })
    }

    /// A view of a table another process created (`free` is unused: only the owner
    /// registers).
    pub fn open(seg: Segment) -> Result<KeyTable> {
        let bad = || Error::InvalidArgument("shared key table: bad header".into());
        if seg.len() < HEADER {
            return Err(bad());
        }
        let header: &[AtomicU32] = seg.slice(0, 3);
        let capacity = header[2].load(Ordering::Acquire);
        // Bounded first, so the layout's sums cannot overflow.
        let fits = capacity < 1 << 24 && records_at(capacity).1 <= seg.len();
        if header[0].load(Ordering::Acquire) != MAGIC
            || header[1].load(Ordering::Acquire) != VERSION
            || !fits
        {
            return Err(bad());
        }
        let mix: &[AtomicU32] = seg.slice(16, 4);
        Ok(KeyTable {
            mix: std::array::from_fn(|i| mix[i].load(Ordering::Acquire)),
            seg,
            capacity,
            free: Mutex::new(FreeSlots::default()),
            ordering_check: false,
            owner: false,
        })
    }

    /// True if both view the same table: the same bytes of the same file, opened with the
    /// same header.
    pub(crate) fn same_view(&self, other: &KeyTable) -> bool {
        self.seg.inode() == other.seg.inode()
            && self.seg.offset() == other.seg.offset()
            && self.seg.len() == other.seg.len()
            && self.capacity == other.capacity
            && self.mix == other.mix
            && self.owner == other.owner
    }

    /// Turns the ordering check on or off for regions registered from now on: relaxed
    /// regions are then marked for scrambled placement, which every peer placing into them
    /// reads from the shared entry.
    pub fn with_ordering_check(mut self, on: bool) -> KeyTable {
        self.ordering_check = on;
        self
    }

    /// Makes the keys unpredictable, for a device whose keys travel over a network an
    /// attacker can send to: each key is its slot and generation through a 32-bit keyed
    /// permutation (a 4-round Feistel network with random round keys, kept in the table's
    /// header for the peers that map it), so without the round keys every key looks like 32
    /// random bits, and a guessed one names a live region with odds of live regions / 2^32.
    pub fn with_secret_keys(mut self) -> KeyTable {
        let (a, b) = (crate::random::random_u64(), crate::random::random_u64());
        self.mix = [a as u32, (a >> 32) as u32, b as u32, (b >> 32) as u32 | 1];
        let mix: &[AtomicU32] = self.seg.slice(16, 4);
        for (w, v) in mix.iter().zip(self.mix) {
            w.store(v, Ordering::Release);
        }
        self
    }

    /// Keys are permuted ([`with_secret_keys`](Self::with_secret_keys) makes the last round
    /// key odd): one compare on every lookup, where comparing all four cost ten instructions.
    #[inline]
    fn is_secret(&self) -> bool {
        self.mix[3] != 0
    }

    pub(crate) fn round(x: u16, k: u32) -> u16 {
        let h = (u32::from(x) ^ k).wrapping_mul(0x9e37_79b1);
        ((h ^ (h >> 15)).wrapping_mul(0x85eb_ca77) >> 16) as u16
    }

    /// The key a program sees for internal key `k` (`slot << 8 | generation`).
    #[inline]
    pub(crate) fn hide(&self, k: u32) -> u32 {
        if !self.is_secret() {
            return k;
        }
        let (mut l, mut r) = ((k >> 16) as u16, k as u16);
        for &rk in &self.mix {
            (l, r) = (r, l ^ Self::round(r, rk));
        }
        u32::from(l) << 16 | u32::from(r)
    }

    /// The slot a program's key names (the inverse of [`hide`](Self::hide), then the slot).
    #[inline]
    pub(crate) fn slot(&self, key: u32) -> u32 {
        if !self.is_secret() {
            return key >> 8;
        }
        let (mut l, mut r) = ((key >> 16) as u16, key as u16);
        for &rk in self.mix.iter().rev() {
            (l, r) = (r ^ Self::round(l, rk), l);
        }
        (u32::from(l) << 16 | u32::from(r)) >> 8
    }

    /// The segment holding the table.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// After `key` left VALID: waits until no hazard record holds it (see
    /// [`crate::mr::hazard`]), until `deadline` for a holder that died.
    pub(crate) fn await_hazards(&self, key: u32, deadline: std::time::Instant) {
        let mark = self.hazard_mark().load(Ordering::SeqCst) as usize;
        hazard::await_released(self.hazard_records(), mark, key, deadline);
    }

    pub(crate) fn entry(&self, index: u32) -> Option<&KeyEntry> {
        if index == 0 || index > self.capacity {
            return None;
        }
        Some(
            self.seg
                .at(HEADER + index as usize * std::mem::size_of::<KeyEntry>()),
        )
    }

    /// Records a region and returns its key.
    pub fn register(
        &self,
        pd: u32,
        addr: u64,
        length: u64,
        iova: u64,
        access: AccessFlags,
        backing: Option<Backing>,
    ) -> Result<u32> {
        // Held until the entry is published, so a window allocated meanwhile sees it (and
        // this registration sees the window): see `alloc_window`.
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let index = free
            .pop()
            .ok_or_else(|| Error::NoResources("memory-region table is full (max_mr)".into()))?;
        let e = self.entry(index).expect("free list holds valid indices");
        let mut generation = e.generation.load(Ordering::Relaxed);
        let mut key;
        // A key whose upper 24 bits name a live window would shadow that window's keys:
        // take the next generation (a handful of tries at most; 1 in 2^24 per try).
        loop {
            generation = generation.wrapping_add(1) & 0xff;
            key = self.hide(index << 8 | generation);
            if !self.names_live_window(key, index) {
                break;
            }
        }
        e.generation.store(generation, Ordering::Relaxed);
        e.kind.store(KIND_MR, Ordering::Relaxed);
        e.windows.store(0, Ordering::Relaxed);
        e.window_of.store(0, Ordering::Relaxed);
        e.bound_qp.store(0, Ordering::Relaxed);
        e.key.store(key, Ordering::Relaxed);
        e.pd.store(pd, Ordering::Relaxed);
        e.access.store(access.bits(), Ordering::Relaxed);
        e.owner_pid.store(std::process::id(), Ordering::Relaxed);
        e.addr.store(addr, Ordering::Relaxed);
        e.length.store(length, Ordering::Relaxed);
        e.iova.store(iova, Ordering::Relaxed);
        let b = backing.filter(|b| b.fd >= 0);
        e.mem_fd
            .store(b.map_or(0, |b| b.fd as u32 + 1), Ordering::Relaxed);
        e.mem_ino.store(b.map_or(0, |b| b.ino), Ordering::Relaxed);
        e.mem_off
            .store(b.map_or(0, |b| b.offset), Ordering::Relaxed);
        let placement = match access.contains(AccessFlags::RELAXED_ORDERING) {
            false => Placement::Strict,
            true if self.ordering_check => Placement::Scrambled,
            true => Placement::Relaxed,
        };
        e.placement.store(placement.to_raw(), Ordering::Relaxed);
        e.layout_fd.store(0, Ordering::Relaxed);
        e.layout_ino.store(0, Ordering::Relaxed);
        e.layout_gen.store(0, Ordering::Relaxed);
        e.state.store(VALID, Ordering::Release);
        drop(free);
        Ok(key)
    }

    /// Invalidates `key`, waiting for in-flight accesses through it to finish: those that
    /// counted themselves, those published in hazard records, and, through `sweep` (called
    /// with the region's PD once it can no longer be pinned, returning once each reader that
    /// pinned with [`PinBy::Sweep`] in that PD is past what it began), those that did not.
    pub fn deregister(&self, key: u32, sweep: &dyn Fn(u32)) -> Result<()> {
        let e = self
            .entry(self.slot(key))
            .filter(|e| {
                e.key.load(Ordering::Acquire) == key && e.kind.load(Ordering::Relaxed) == KIND_MR
            })
            .ok_or_else(|| Error::NotFound(format!("memory key {key:#x}")))?;
        if e.state
            .compare_exchange(VALID, DYING, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(Error::NotFound(format!("memory key {key:#x}")));
        }
        // Readers that did not count themselves are past their accesses once the sweep
        // returns: none passes the check now that the region is DYING.
        sweep(e.pd.load(Ordering::Relaxed));
        // Pins are held only for the duration of one copy, so these waits are short; a peer
        // process that died holding a pin must not hang us, hence the bound.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        self.await_hazards(key, deadline);
        e.wait_unpinned(deadline);
        // Binds pin the region while they count themselves, so the count is final now.
        // `ibv_dereg_mr` refuses a region with windows (`Mr::check_dereg`); a region dropped
        // regardless takes its windows down with it, never leaving them on freed memory.
        if e.windows.load(Ordering::SeqCst) != 0 {
            self.unbind_windows_of(key);
        }
        e.state.store(FREE, Ordering::Release);
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.slot(key));
        Ok(())
    }

    /// What registration recorded for `key`, if it is valid.
    pub fn info(&self, key: u32) -> Option<KeyInfo> {
        let e = self.entry(self.slot(key))?;
        if e.state.load(Ordering::Acquire) != VALID
            || e.key.load(Ordering::Relaxed) != key
            || e.kind.load(Ordering::Relaxed) != KIND_MR
        {
            return None;
        }
        Some(KeyInfo {
            key,
            pd: e.pd.load(Ordering::Relaxed),
            access: AccessFlags::from_bits_retain(e.access.load(Ordering::Relaxed)),
            addr: e.addr.load(Ordering::Relaxed),
            length: e.length.load(Ordering::Relaxed),
            iova: e.iova.load(Ordering::Relaxed),
        })
    }

    /// Checks that `[iova, iova + len)` lies in the region of local key `key`, owned by
    /// `pd`, granting `need`, and pins it (a window's key is no local key). A region
    /// carrying a layout passes every check but answers [`KeyError::Layout`]: its bytes are
    /// reached through [`pin_layout`](Self::pin_layout).
    // Always inlined: its result returned through memory and read back wider stalled store
    // forwarding (about a tenth of a 64-byte WRITE's time on AMD Zen).
    #[inline(always)]
    pub fn pin(
        &self,
        key: u32,
        pd: u32,
        iova: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<Pin<'_>, KeyError> {
        self.pin_key(key, pd, None, iova, len, need, PinBy::Count)
    }

    /// Like [`pin`](Self::pin) for an rkey a request brought to QP `qpn`: a region's key, or
    /// a bound memory window's (a type-2 window only if `qpn` bound it).
    #[inline(always)]
    pub fn pin_remote(
        &self,
        key: u32,
        pd: u32,
        qpn: u32,
        iova: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<Pin<'_>, KeyError> {
        self.pin_key(key, pd, Some(qpn), iova, len, need, PinBy::Count)
    }

    /// The responder's side of an RDMA FLUSH with global placement, for a request that
    /// reached QP `qpn`: `len` bytes at `iova` of rkey `key` (with `whole_region`, all of its
    /// region: `IBV_FLUSH_MR` names no range) must grant `FLUSH_GLOBAL`. A software NIC has
    /// placed every byte before it answered the request that carried it, so what is left is
    /// to order those stores before the FLUSH's answer for every CPU: a full fence.
    pub fn flush(
        &self,
        key: u32,
        pd: u32,
        qpn: u32,
        iova: u64,
        len: u64,
        whole_region: bool,
    ) -> Result<(), KeyError> {
        let (iova, len) = if whole_region {
            // Read before the pin, which checks them again under it.
            let e = self.find(key).ok_or(KeyError::Invalid)?;
            (
                e.iova.load(Ordering::Relaxed),
                e.length.load(Ordering::Relaxed),
            )
        } else {
            (iova, len)
        };
        self.pin_key(
            key,
            pd,
            Some(qpn),
            iova,
            len,
            AccessFlags::FLUSH_GLOBAL,
            PinBy::Count,
        )?;
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(())
    }

    /// The pins of [`pin`](Self::pin), [`pin_remote`](Self::pin_remote) (`remote_qp`) and
    /// FLUSH; `by` says how the pin holds deregistration off. [`PinBy::Sweep`]: the pin
    /// counts itself nowhere (no locked instruction to take it or let it go), for a reader
    /// that [`deregister`](Self::deregister)'s `sweep` covers: a request executing under the
    /// send lock of a QP of this table's device in PD `pd` (not of an imported PD).
    /// `deregister` moves the region out of VALID, then the sweep takes every such send lock
    /// once, so an access that passed the check ends before the region goes, and one that
    /// starts after finds it gone. In a table opened from another process such a pin counts.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // the pins' shared body, as `pin_checked`
    pub(crate) fn pin_key(
        &self,
        key: u32,
        pd: u32,
        remote_qp: Option<u32>,
        iova: u64,
        len: u64,
        need: AccessFlags,
        by: PinBy<'_>,
    ) -> Result<Pin<'_>, KeyError> {
        let (pin, e) = self.pin_checked(key, pd, remote_qp, iova, len, need, by)?;
        // The one extra branch ordinary keys pay for layouts.
        if e.layout_gen.load(Ordering::Acquire) != 0 {
            return Err(KeyError::Layout);
        }
        Ok(pin)
    }

    /// Like [`pin`](Self::pin) for a layout region: pins the region itself (its rights, PD
    /// and bounds checked) and says where its layout is. A region without a layout is
    /// [`KeyError::Invalid`] here.
    pub fn pin_layout(
        &self,
        key: u32,
        pd: u32,
        iova: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<(Pin<'_>, LayoutRef), KeyError> {
        let (pin, e) = self.pin_checked(key, pd, None, iova, len, need, PinBy::Count)?;
        let generation = e.layout_gen.load(Ordering::Acquire);
        let fd = e.layout_fd.load(Ordering::Relaxed);
        if generation == 0 || fd == 0 {
            return Err(KeyError::Invalid);
        }
        let r = LayoutRef {
            fd: fd as i32 - 1,
            ino: e.layout_ino.load(Ordering::Relaxed),
            generation,
            owner_pid: e.owner_pid.load(Ordering::Relaxed),
            offset: iova - e.iova.load(Ordering::Relaxed),
        };
        Ok((pin, r))
    }

    /// The entry whose key is `key` (valid or not): the region its slot names, else the
    /// window its upper 24 bits name. No region's key, live or stale, is ever a live
    /// window's (see [`crate::mr::window`]), so the first entry holding `key` is the one.
    #[inline]
    pub(crate) fn find(&self, key: u32) -> Option<&KeyEntry> {
        let named = |e: &&KeyEntry| e.key.load(Ordering::Acquire) == key;
        match self.entry(self.slot(key)).filter(named) {
            Some(e) => Some(e),
            None => self.entry(self.window_slot(key)).filter(named),
        }
    }

    /// The checks of every pin; `by`: how it holds deregistration off (see
    /// [`pin_key`](Self::pin_key)).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // the pins' one shared body
    pub(crate) fn pin_checked(
        &self,
        key: u32,
        pd: u32,
        remote_qp: Option<u32>,
        iova: u64,
        len: u64,
        need: AccessFlags,
        by: PinBy<'_>,
    ) -> Result<(Pin<'_>, &KeyEntry), KeyError> {
        let e = self.find(key).ok_or(KeyError::Invalid)?;
        let counter = match self.owner {
            true => &e.owner_pins.0,
            false => &e.peer_pins,
        };
        let counted = || {
            counter.fetch_add(1, Ordering::SeqCst);
            (counter, 0)
        };
        let (count, bits) = match by {
            PinBy::Sweep if self.owner => (counter, PIN_SWEPT),
            PinBy::Hazard(lease) => match lease.free_slot(self) {
                Some(slot) => {
                    slot.store(key, Ordering::Relaxed);
                    // Only the compiler is kept from moving the check above the store: the
                    // processor's reordering is what the owner's barrier undoes.
                    std::sync::atomic::compiler_fence(Ordering::SeqCst);
                    (slot, PIN_HAZARD)
                }
                None => counted(),
            },
            _ => counted(),
        };
        let mut pin = Pin {
            entry: e,
            count,
            host: 0,
            bits,
        };
        if e.state.load(Ordering::SeqCst) != VALID || e.key.load(Ordering::Relaxed) != key {
            return Err(KeyError::Invalid);
        }
        let kind = e.kind.load(Ordering::Relaxed);
        if kind != KIND_MR {
            // A window is an rkey only, reaches nothing unbound, and a type-2 one only
            // through the QP that bound it.
            let Some(qpn) = remote_qp else {
                return Err(KeyError::Invalid);
            };
            if e.window_of.load(Ordering::Relaxed) == 0
                || (kind == KIND_MW2 && e.bound_qp.load(Ordering::Relaxed) != qpn)
            {
                return Err(KeyError::Invalid);
            }
        }
        if e.pd.load(Ordering::Relaxed) != pd {
            return Err(KeyError::WrongPd);
        }
        let access = AccessFlags::from_bits_retain(e.access.load(Ordering::Relaxed));
        if !access.contains(need) {
            return Err(KeyError::Access);
        }
        if access.contains(AccessFlags::ON_DEMAND) {
            pin.bits |= PIN_ON_DEMAND;
        }
        let base = e.iova.load(Ordering::Relaxed);
        let length = e.length.load(Ordering::Relaxed);
        let offset = iova.checked_sub(base).ok_or(KeyError::Bounds)?;
        let end = offset.checked_add(len).ok_or(KeyError::Bounds)?;
        if end > length {
            return Err(KeyError::Bounds);
        }
        let host = e.addr.load(Ordering::Relaxed).wrapping_add(offset);
        pin.host = usize::try_from(host).map_err(|_| KeyError::Bounds)?;
        Ok((pin, e))
    }

    /// Publishes a layout for `key` (owner only): the region becomes `length` bytes long and
    /// its bytes are resolved through the layout in `memfd` descriptor `fd` (inode `ino`),
    /// generation `generation` (non-zero). Readers that pinned the old layout finish with it.
    pub fn set_layout(
        &self,
        key: u32,
        length: u64,
        fd: i32,
        ino: u64,
        generation: u32,
    ) -> Result<()> {
        let e = self
            .entry(self.slot(key))
            .filter(|e| {
                e.key.load(Ordering::Acquire) == key && e.state.load(Ordering::Acquire) == VALID
            })
            .ok_or_else(|| Error::NotFound(format!("memory key {key:#x}")))?;
        // Order matters for readers without the owner's lock: a reader that sees the new
        // generation (acquire) sees the new descriptor; one that sees the new length with the
        // old layout fails the layout's own bounds check, never reads out of it.
        e.layout_fd.store(fd as u32 + 1, Ordering::Relaxed);
        e.layout_ino.store(ino, Ordering::Relaxed);
        e.layout_gen.store(generation, Ordering::Release);
        e.length.store(length, Ordering::Release);
        Ok(())
    }

    /// The layout generation of `key` (0: not a layout, or not a valid key).
    pub fn layout_generation(&self, key: u32) -> u32 {
        self.entry(self.slot(key))
            .filter(|e| {
                e.key.load(Ordering::Acquire) == key && e.state.load(Ordering::Acquire) == VALID
            })
            .map_or(0, |e| e.layout_gen.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn secret_keys_hide_the_slot_and_still_name_their_region() {
        let plain = KeyTable::new(64).unwrap();
        let a = KeyTable::new(64).unwrap().with_secret_keys();
        let b = KeyTable::new(64).unwrap().with_secret_keys();
        // The permutation is one: every 32-bit key comes back to its slot.
        for k in (0..1u32 << 20).map(|i| i.wrapping_mul(0x9e37_79b9)) {
            assert_eq!(a.slot(a.hide(k)), k >> 8);
        }
        let reg = |t: &KeyTable| {
            t.register(1, 0x1000, 64, 0x1000, AccessFlags::REMOTE_WRITE, None)
                .unwrap()
        };
        let (kp, ka, kb) = (reg(&plain), reg(&a), reg(&b));
        // Plain keys are slot and generation; secret ones differ from table to table.
        assert_eq!(kp & 0xff, 1);
        assert_ne!(ka, kb);
        assert_ne!(ka >> 8, kp >> 8);
        assert!(a.pin(ka, 1, 0x1000, 64, AccessFlags::REMOTE_WRITE).is_ok());
        assert!(
            a.pin(ka ^ 1, 1, 0x1000, 64, AccessFlags::REMOTE_WRITE)
                .is_err()
        );
        // A peer's view of the table reads the same round keys.
        let view = KeyTable::open(a.segment().reopen().unwrap()).unwrap();
        assert!(
            view.pin(ka, 1, 0x1000, 64, AccessFlags::REMOTE_WRITE)
                .is_ok()
        );
        a.deregister(ka, &|_| {}).unwrap();
        assert!(a.pin(ka, 1, 0x1000, 64, AccessFlags::REMOTE_WRITE).is_err());
        let again = reg(&a);
        assert_ne!(again, ka, "the slot's next key differs");
    }

    #[test]
    fn register_pin_deregister() {
        let t = KeyTable::new(4).unwrap();
        let acc = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        let k = t.register(7, 0x1000, 100, 0x5000, acc, None).unwrap();
        assert_ne!(k, 0);
        let p = t.pin(k, 7, 0x5010, 84, AccessFlags::REMOTE_READ).unwrap();
        assert_eq!(p.host, 0x1010);
        drop(p);
        assert!(!t.entry(k >> 8).unwrap().pinned());
        assert_eq!(
            t.pin(k, 7, 0x5010, 85, AccessFlags::empty()).err(),
            Some(KeyError::Bounds)
        );
        assert_eq!(
            t.pin(k, 7, 0x4fff, 1, AccessFlags::empty()).err(),
            Some(KeyError::Bounds)
        );
        assert_eq!(
            t.pin(k, 8, 0x5000, 1, AccessFlags::empty()).err(),
            Some(KeyError::WrongPd)
        );
        assert_eq!(
            t.pin(k, 7, 0x5000, 1, AccessFlags::REMOTE_WRITE).err(),
            Some(KeyError::Access)
        );
        assert_eq!(
            t.pin(k, 7, u64::MAX, 2, AccessFlags::empty()).err(),
            Some(KeyError::Bounds)
        );
        t.deregister(k, &|_| {}).unwrap();
        assert_eq!(
            t.pin(k, 7, 0x5000, 1, AccessFlags::empty()).err(),
            Some(KeyError::Invalid)
        );
        assert!(t.deregister(k, &|_| {}).is_err());
        // The slot is reused with a new generation; the old key stays dead.
        let k2 = t.register(7, 0x1000, 100, 0x5000, acc, None).unwrap();
        assert_ne!(k, k2);
        assert!(t.pin(k, 7, 0x5000, 1, AccessFlags::empty()).is_err());
        assert!(t.pin(k2, 7, 0x5000, 1, AccessFlags::empty()).is_ok());
    }

    #[test]
    fn each_pin_count_sits_on_a_line_the_other_side_does_not_read() {
        use std::mem::offset_of;
        let line = |offset: usize| offset / 64;
        // What every pin reads: line 0.
        for f in [
            offset_of!(KeyEntry, state),
            offset_of!(KeyEntry, key),
            offset_of!(KeyEntry, kind),
            offset_of!(KeyEntry, pd),
            offset_of!(KeyEntry, access),
            offset_of!(KeyEntry, layout_gen),
            offset_of!(KeyEntry, placement),
            offset_of!(KeyEntry, mem_fd),
            offset_of!(KeyEntry, owner_pid),
            offset_of!(KeyEntry, addr),
            offset_of!(KeyEntry, length),
            offset_of!(KeyEntry, iova),
        ] {
            assert_eq!(line(f), 0, "field at {f}");
        }
        // Where peers map the bytes, beside their count; the owner's count alone.
        for f in [
            offset_of!(KeyEntry, mem_ino),
            offset_of!(KeyEntry, mem_off),
            offset_of!(KeyEntry, peer_pins),
        ] {
            assert_eq!(line(f), 1, "field at {f}");
        }
        assert_eq!(offset_of!(KeyEntry, owner_pins), 128);
        assert_eq!(std::mem::size_of::<KeyEntry>(), 192);
    }

    /// Deregisters `k` of `t` on another thread while `pin` is held: it must not return
    /// before `pin` is dropped, and meanwhile a new pin (`pin_again`) must fail.
    fn deregistration_waits_for(
        t: &KeyTable,
        k: u32,
        pin: Pin<'_>,
        what: &str,
        pin_again: impl Fn() -> Option<KeyError>,
    ) {
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let dereg = s.spawn(|| {
                t.deregister(k, &|_| {}).unwrap();
                done.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(!done.load(Ordering::SeqCst), "deregistered under {what}");
            assert_eq!(pin_again(), Some(KeyError::Invalid), "pinned while dying");
            drop(pin);
            dereg.join().unwrap();
        });
    }

    #[test]
    fn the_owner_and_a_view_pin_in_their_own_counts_and_deregistration_waits_for_both() {
        let t = KeyTable::new(4).unwrap();
        let view = KeyTable::open(t.segment().reopen().unwrap()).unwrap();
        let acc = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let k = t.register(7, 0x1000, 100, 0x1000, acc, None).unwrap();
        let e = t.entry(k >> 8).unwrap();
        let counts = |e: &KeyEntry| {
            (
                e.owner_pins.0.load(Ordering::Relaxed),
                e.peer_pins.load(Ordering::Relaxed),
            )
        };
        let mine = t.pin(k, 7, 0x1000, 8, AccessFlags::LOCAL_WRITE).unwrap();
        assert_eq!(counts(e), (1, 0));
        let theirs = view
            .pin_remote(k, 7, 3, 0x1008, 8, AccessFlags::REMOTE_WRITE)
            .unwrap();
        assert_eq!(counts(e), (1, 1));
        drop(mine);
        assert_eq!(counts(e), (0, 1));
        deregistration_waits_for(&t, k, theirs, "a view's pin", || {
            t.pin(k, 7, 0x1000, 1, AccessFlags::empty()).err()
        });
        assert_eq!(counts(e), (0, 0));
        assert_eq!(
            view.pin_remote(k, 7, 3, 0x1000, 1, AccessFlags::REMOTE_WRITE)
                .err(),
            Some(KeyError::Invalid)
        );
    }

    #[test]
    fn a_hazard_pin_counts_nowhere_and_deregistration_waits_for_it() {
        let t = KeyTable::new(4).unwrap();
        let view = Arc::new(KeyTable::open(t.segment().reopen().unwrap()).unwrap());
        assert!(view.hazards_allowed(), "this kernel offers membarrier");
        let lease = Lease::take(&view).expect("a free record");
        let acc = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let k = t.register(7, 0x1000, 100, 0x1000, acc, None).unwrap();
        let e = t.entry(k >> 8).unwrap();
        let by = PinBy::Hazard(&lease);
        // Refused pins leave nothing behind.
        assert!(view.pin_key(k, 8, Some(3), 0x1000, 8, acc, by).is_err());
        assert!(!hazard::holds(&lease, k));
        let theirs = view.pin_key(k, 7, Some(3), 0x1008, 8, acc, by).unwrap();
        assert!(hazard::holds(&lease, k));
        assert_eq!(
            e.peer_pins.load(Ordering::Relaxed),
            0,
            "a hazard pin counted"
        );
        // A lease is of one table: in another the pin counts.
        let other = KeyTable::new(4).unwrap();
        let k2 = other.register(7, 0x1000, 100, 0x1000, acc, None).unwrap();
        let counted = other.pin_key(k2, 7, Some(3), 0x1000, 8, acc, by).unwrap();
        assert_eq!(
            other
                .entry(k2 >> 8)
                .unwrap()
                .owner_pins
                .0
                .load(Ordering::Relaxed),
            1
        );
        drop(counted);
        deregistration_waits_for(&t, k, theirs, "a hazard pin", || {
            view.pin_key(k, 7, Some(3), 0x1000, 1, acc, by).err()
        });
        assert!(!hazard::holds(&lease, k));
        assert_eq!(
            view.pin_key(k, 7, Some(3), 0x1000, 1, acc, by).err(),
            Some(KeyError::Invalid)
        );
    }

    #[test]
    fn hazard_records_run_out_and_come_back() {
        let t = KeyTable::new(1).unwrap();
        let view = Arc::new(KeyTable::open(t.segment().reopen().unwrap()).unwrap());
        let mut leases: Vec<_> = (0..hazard::RECORDS)
            .map(|_| Lease::take(&view).expect("a free record"))
            .collect();
        assert!(Lease::take(&view).is_none(), "more leases than records");
        leases.pop();
        assert!(
            Lease::take(&view).is_some(),
            "a returned record is leased again"
        );
        // A full record's pins count.
        let acc = AccessFlags::REMOTE_WRITE;
        let k = t.register(7, 0x1000, 100, 0x1000, acc, None).unwrap();
        let by = PinBy::Hazard(&leases[0]);
        let pins: Vec<_> = (0..9)
            .map(|_| view.pin_key(k, 7, Some(3), 0x1000, 8, acc, by).unwrap())
            .collect();
        assert_eq!(
            t.entry(k >> 8).unwrap().peer_pins.load(Ordering::Relaxed),
            1
        );
        drop(pins);
        assert_eq!(
            t.entry(k >> 8).unwrap().peer_pins.load(Ordering::Relaxed),
            0
        );
        assert!(!hazard::holds(&leases[0], k));
    }

    #[test]
    fn table_full_is_an_error() {
        let t = KeyTable::new(2).unwrap();
        t.register(1, 0, 1, 0, AccessFlags::empty(), None).unwrap();
        t.register(1, 0, 1, 0, AccessFlags::empty(), None).unwrap();
        assert!(matches!(
            t.register(1, 0, 1, 0, AccessFlags::empty(), None),
            Err(Error::NoResources(_))
        ));
    }

    #[test]
    fn garbage_keys_are_invalid() {
        let t = KeyTable::new(2).unwrap();
        for k in [0, 1, 0xffff_ffff, 3 << 8] {
            assert_eq!(
                t.pin(k, 0, 0, 0, AccessFlags::empty()).err(),
                Some(KeyError::Invalid)
            );
        }
    }
}
