//! Hazard records: how a requester pins another process's regions with plain stores.
//!
//! A request executed into a peer's memory pins the peer's key for the copy, so that the
//! owner's deregistration waits for it. Counting the pin in the key's entry takes a locked
//! instruction to count and another to uncount, and the second waits for the copy's stores
//! into the peer's memory to drain: measured on a 64-byte WRITE, the two were a fifth of its
//! time (message rate 20.7 -> 25.6 M msg/s without them, SEND 6.0 -> 7.6).
//!
//! Instead a requester QP leases a record in the table of the peer it is connected to
//! ([`Lease`]) and, per request, writes the key into a slot of the record (a plain store)
//! before it checks the key, and clears the slot (a plain store, after the copy's) when the
//! pin is dropped. A deregistration (`KeyTable::await_hazards`) moves the key to DYING, then
//! has every running thread of every process that leases records execute a full memory
//! barrier (`membarrier(2)`, `GLOBAL_EXPEDITED`: those processes registered for it before
//! leasing), then waits until no record holds the key. A requester's slot store and its check
//! of the key are thus ordered against the owner's DYING store and its look at the records,
//! as two fences would order them: either the owner sees the slot (and waits for it to clear,
//! which follows the copy), or the requester sees DYING (and touches nothing). The barrier's
//! price (a few µs) is paid by deregistrations of tables that ever leased a record, the rare
//! operation, instead of by every request.
//!
//! One record serves one requester QP, which writes it only under its send lock, so a slot
//! needs no compare-and-swap. Past [`RECORDS`] leases in one table, or where `membarrier` is
//! missing, pins count themselves as before.

use crate::device_memory::segment::ShmPlain;
use crate::sync::{self, Reach};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

/// Records in each key table: one per requester QP of any process connected to a QP of the
/// table's owner; requesters beyond them count their pins. Not one for every QP a device may
/// have: over thousands of QPs taking turns, a record line per QP cost more than the counts
/// (65,536 records: round robin over 4,096 QPs 13.3 -> 12.2 M msg/s, over 65,536 5.4 -> 5.1).
pub(crate) const RECORDS: usize = 256;
/// Keys one record holds at once: a request pins one key of the peer per SGE it lands in.
const SLOTS: usize = 8;

/// One requester QP's published keys, on a cache line of its own (the requester writes it on
/// every request; only a deregistration reads it).
#[repr(C, align(64))]
pub(crate) struct HazardRecord {
    /// 0 while free; else the leaseholder: its pid in the upper half, a number unique in that
    /// process in the lower.
    owner: AtomicU64,
    /// Keys pinned now (0: a free slot).
    keys: [AtomicU32; SLOTS],
}

// SAFETY: repr(C), atomics only, valid when zero (a free record).
unsafe impl ShmPlain for HazardRecord {}

/// A table with hazard records (the key table; a trait so that this module needs nothing
/// of the table's).
pub(crate) trait Published {
    /// The owner can fence leaseholders: requesters may lease.
    fn hazards_allowed(&self) -> bool;
    /// How many records (from the first) may have been leased (it only grows).
    fn hazard_mark(&self) -> &AtomicU32;
    /// How many records are leased now (by live processes or, until reclaimed, dead ones).
    fn hazard_leased(&self) -> &AtomicU32;
    /// The records, [`RECORDS`] of them.
    fn hazard_records(&self) -> &[HazardRecord];
}

/// The table's owner can make every leaseholder's threads fence: it may let requesters lease.
pub(crate) fn owner_can_fence() -> bool {
    sync::offered(Reach::Host)
}

/// A record of a peer's key table held by one requester QP, given back when dropped (the QP
/// is reconnected or destroyed).
pub(crate) struct Lease<T: Published> {
    table: Arc<T>,
    index: usize,
}

impl<T: Published> Lease<T> {
    /// Leases a free record of `table` (or one a dead process held); `None` when the table's
    /// owner cannot fence leaseholders, this process cannot be fenced, or none is free.
    pub(crate) fn take(table: &Arc<T>) -> Option<Lease<T>> {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        // Once the records run out, connections go on counting: looking through all of them
        // for a dead holder costs a system call per holder, so it is done for one attempt in
        // this many (thousands of QPs connect to one peer's table, each in its first request).
        const RECLAIM_EVERY: u32 = 1024;
        static FULL: AtomicU32 = AtomicU32::new(0);
        if !table.hazards_allowed() || !sync::registered(Reach::Host) {
            return None;
        }
        let full = table.hazard_leased().load(Ordering::Relaxed) as usize >= RECORDS;
        if full && FULL.fetch_add(1, Ordering::Relaxed) % RECLAIM_EVERY != 0 {
            return None;
        }
        let token = u64::from(std::process::id()) << 32
            | u64::from(NEXT.fetch_add(1, Ordering::Relaxed).max(1));
        let records = table.hazard_records();
        let claim = |index: usize, from: u64| {
            let rec = &records[index];
            if rec
                .owner
                .compare_exchange(from, token, Ordering::SeqCst, Ordering::Relaxed)
                .is_err()
            {
                return None;
            }
            // A dead holder's keys are nobody's now.
            for slot in &rec.keys {
                slot.store(0, Ordering::Relaxed);
            }
            // Sequentially consistent, as the owner's DYING store and its read of this mark
            // are: an owner that reads a mark below this record has stored DYING before any
            // pin through it checks a key (see `await_released`).
            table
                .hazard_mark()
                .fetch_max(index as u32 + 1, Ordering::SeqCst);
            Some(Lease {
                table: table.clone(),
                index,
            })
        };
        // Records never leased first (from the mark up: a connection costs a look or two, not
        // one per QP connected before it), then those given back.
        let mark = (table.hazard_mark().load(Ordering::Relaxed) as usize).min(RECORDS);
        let free = (!full).then(|| {
            (mark..RECORDS).chain(0..mark).find_map(|i| {
                (records[i].owner.load(Ordering::Relaxed) == 0)
                    .then(|| claim(i, 0))
                    .flatten()
            })
        });
        if let Some(lease) = free.flatten() {
            table.hazard_leased().fetch_add(1, Ordering::Relaxed);
            return Some(lease);
        }
        // A dead process's record passes to us as it is (the count of leased ones stays).
        let me = std::process::id();
        let mut known = (0, false); // the last pid looked at, and whether it lives
        (0..RECORDS).find_map(|i| {
            let held = records[i].owner.load(Ordering::Relaxed);
            let pid = (held >> 32) as u32;
            if held == 0 || pid == me {
                return None;
            }
            if known.0 != pid {
                known = (pid, sync::process_exists(pid));
            }
            (!known.1).then(|| claim(i, held)).flatten()
        })
    }

    /// A free slot of this record, if `table` is the table it was leased in.
    #[inline(always)]
    pub(crate) fn free_slot<'t>(&self, table: &'t T) -> Option<&'t AtomicU32> {
        if !std::ptr::eq(Arc::as_ptr(&self.table), table) {
            return None;
        }
        // Only this lease's QP, under its send lock, puts keys in; a pin dropped elsewhere
        // only clears its own slot.
        table.hazard_records()[self.index]
            .keys
            .iter()
            .find(|s| s.load(Ordering::Relaxed) == 0)
    }
}

impl<T: Published> Drop for Lease<T> {
    fn drop(&mut self) {
        let rec = &self.table.hazard_records()[self.index];
        for slot in &rec.keys {
            slot.store(0, Ordering::Release);
        }
        rec.owner.store(0, Ordering::Release);
        self.table.hazard_leased().fetch_sub(1, Ordering::Relaxed);
    }
}

/// The owner's half: after `key` left VALID, waits (until `deadline`, for a holder that
/// died) until no record of `records[..mark]` holds it.
pub(crate) fn await_released(records: &[HazardRecord], mark: usize, key: u32, deadline: Instant) {
    if mark == 0 {
        return;
    }
    // Every leaseholder's thread fences now: a slot stored before is visible below, a key
    // checked after finds the key no longer VALID.
    sync::barrier(Reach::Host);
    for rec in &records[..mark.min(records.len())] {
        for slot in &rec.keys {
            // Acquire: the copy that preceded the clearing store is visible after.
            while slot.load(Ordering::Acquire) == key {
                if Instant::now() >= deadline {
                    // A holder that died mid-copy: forget its pin, as counts are forgotten.
                    let _ = slot.compare_exchange(key, 0, Ordering::SeqCst, Ordering::Relaxed);
                    break;
                }
                std::thread::yield_now();
            }
        }
    }
}

/// Whether the lease's record holds `key` now (tests).
#[cfg(test)]
pub(crate) fn holds<T: Published>(lease: &Lease<T>, key: u32) -> bool {
    lease.table.hazard_records()[lease.index]
        .keys
        .iter()
        .any(|s| s.load(Ordering::Relaxed) == key)
}
