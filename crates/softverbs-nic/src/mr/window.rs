//! Memory windows in the key table: allocation, bind, invalidation.
//!
//! A window is a key table entry of its own whose rkey reaches a part of a region with
//! rights of its own. Binding copies the chosen range of the region (its owner address,
//! backing and placement) into the window's entry, so a pin reads one entry whichever kind
//! of key a request names, and counts the window on the region, which cannot be deregistered
//! while a window is bound to it.
//!
//! **Keys.** As on real HCAs, a window's rkey is `index << 8 | key`: the upper 24 bits name
//! the window for its lifetime and the consumer picks the low 8 bits at each type-2 bind
//! (`ibv_inc_rkey`). On a device with secret keys the index is the slot through a 24-bit
//! keyed permutation, so it is no more guessable than the slot behind a region's key. Region
//! keys and window keys are looked up in the same table, so they must never collide: a
//! region is never given a key whose upper 24 bits name a live window, and a window never
//! takes a slot whose 256 keys include the key held by the entry that key's region decoding
//! names, live or stale (both checked under the table's allocation lock), so a lookup takes
//! the first entry holding its key.
//!
//! **Rules** (IBTA 10.6.7, as soft-RoCE applies them): a bind needs a region of the QP's PD
//! with `MW_BIND`, the range inside it, and `LOCAL_WRITE` on the region for a window that
//! grants remote write or atomics; a type-1 window is bound by any QP of its PD, rebinds in
//! place and unbinds with length 0, and cannot be invalidated; a type-2 window is bound by a
//! QP of its PD only while it is free, is reached only through the QP that bound it, and is
//! freed again by a local or remote invalidation of its current rkey. Zero-based windows are
//! not offered.
//!
//! A bind or invalidation moves the entry through [`CHANGING`] (pins fail meanwhile) and
//! waits for the pins of its old range to drain, as a deregistration does.

use crate::error::{Error, Result};
use crate::mr::keys::{
    CHANGING, FREE, KIND_MR, KIND_MW1, KIND_MW2, KeyEntry, KeyTable, PinBy, VALID,
};
use crate::types::AccessFlags;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A bind, as a bind work request (`IBV_WR_BIND_MW`, `ibv_bind_mw`) asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowBind {
    /// Any key the window has had (its upper 24 bits name it).
    pub window: u32,
    /// The rkey the window has once bound: its upper 24 bits the window's.
    pub rkey: u32,
    /// The binding QP: its PD and number.
    pub pd: u32,
    pub qpn: u32,
    /// The region (`lkey`), and the range of it, by IOVA (length 0: unbind a type-1 window).
    pub mr: u32,
    pub addr: u64,
    pub length: u64,
    /// The window's rights: `REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`.
    pub access: AccessFlags,
}

/// Rights a window may grant.
const WINDOW_RIGHTS: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);

/// How long a bind waits for a concurrent bind or invalidation of the same window, or for
/// the pins of its old range (a peer that died holding one must not hang it).
const WAIT: Duration = Duration::from_secs(1);

/// Returns the entry to valid when a change is over (or abandoned).
struct Changing<'a>(&'a KeyEntry);

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        self.0.state.store(VALID, Ordering::Release);
    }
}

impl KeyTable {
    /// 24-bit keyed permutation of a window's slot (identity without secret keys).
    fn window_index(&self, slot: u32) -> u32 {
        if self.mix == [0; 4] {
            return slot;
        }
        let (mut l, mut r) = ((slot >> 12) & 0xfff, slot & 0xfff);
        for &rk in &self.mix {
            (l, r) = (
                r,
                l ^ (u32::from(Self::round(r as u16, rk ^ 0x5bd1_e995)) & 0xfff),
            );
        }
        l << 12 | r
    }

    /// The slot a window key names (inverse of `window_index` on its upper 24 bits).
    pub(crate) fn window_slot(&self, key: u32) -> u32 {
        let index = key >> 8;
        if self.mix == [0; 4] {
            return index;
        }
        let (mut l, mut r) = ((index >> 12) & 0xfff, index & 0xfff);
        for &rk in self.mix.iter().rev() {
            (l, r) = (
                r ^ (u32::from(Self::round(l as u16, rk ^ 0x5bd1_e995)) & 0xfff),
                l,
            );
        }
        l << 12 | r
    }

    /// True if `key`'s upper 24 bits name a live window in a slot other than `own`.
    pub(crate) fn names_live_window(&self, key: u32, own: u32) -> bool {
        let slot = self.window_slot(key);
        slot != own
            && self.entry(slot).is_some_and(|e| {
                e.kind.load(Ordering::Relaxed) != KIND_MR && e.state.load(Ordering::Acquire) != FREE
            })
    }

    /// True if one of the 256 keys of window slot `slot` is in the entry a region's key
    /// names (live or stale: a lookup takes that entry first).
    fn shadows_a_region(&self, slot: u32) -> bool {
        let index = self.window_index(slot);
        (0..=0xffu32).any(|tag| {
            let key = index << 8 | tag;
            let s = self.slot(key);
            s != slot
                && self
                    .entry(s)
                    .is_some_and(|e| e.key.load(Ordering::Relaxed) == key)
        })
    }

    /// `ibv_alloc_mw`: a window of PD `pd`, type 2 if `type2`, unbound. Returns its rkey.
    pub fn alloc_window(&self, pd: u32, type2: bool) -> Result<u32> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let full = || Error::NoResources("memory key table is full (max_mr, max_mw)".into());
        // A slot whose keys would shadow a region's goes back (1 in 2^16 per region).
        let mut skipped = Vec::new();
        let slot = loop {
            let s = free.pop().ok_or_else(full)?;
            if !self.shadows_a_region(s) {
                break Some(s);
            }
            skipped.push(s);
            if skipped.len() > 64 {
                break None;
            }
        };
        free.extend(skipped);
        let slot = slot.ok_or_else(full)?;
        let e = self.entry(slot).expect("free list holds valid indices");
        let tag = (e.generation.load(Ordering::Relaxed).wrapping_add(1)) & 0xff;
        e.generation.store(tag, Ordering::Relaxed);
        let key = self.window_index(slot) << 8 | tag;
        e.key.store(key, Ordering::Relaxed);
        e.pd.store(pd, Ordering::Relaxed);
        e.kind
            .store(if type2 { KIND_MW2 } else { KIND_MW1 }, Ordering::Relaxed);
        Self::clear_range(e);
        e.owner_pid.store(std::process::id(), Ordering::Relaxed);
        e.state.store(VALID, Ordering::Release);
        Ok(key)
    }

    /// `ibv_dealloc_mw`: unbinds the window (any key it has had names it) and frees it.
    pub fn dealloc_window(&self, window: u32) -> Result<()> {
        let slot = self.window_slot(window);
        let e = self
            .window_entry(window)
            .ok_or_else(|| Error::NotFound(format!("memory window {window:#x}")))?;
        let guard = self
            .acquire(e)
            .ok_or_else(|| Error::Busy(format!("memory window {window:#x} is changing")))?;
        self.unbind(e);
        std::mem::forget(guard);
        e.state.store(FREE, Ordering::Release);
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(slot);
        Ok(())
    }

    /// A bind work request, executed: the window's new rkey, or `Err` for the
    /// `IBV_WC_MW_BIND_ERR` completion (the reason, for logs).
    pub fn bind_window(&self, b: &WindowBind) -> std::result::Result<u32, &'static str> {
        let e = self.window_entry(b.window).ok_or("no such window")?;
        let kind = e.kind.load(Ordering::Relaxed);
        if e.pd.load(Ordering::Relaxed) != b.pd {
            return Err("the window is in another PD than the QP");
        }
        if b.rkey >> 8 != e.key.load(Ordering::Relaxed) >> 8 {
            return Err("the new rkey's index is not the window's");
        }
        if !(b.access - WINDOW_RIGHTS).is_empty() {
            return Err(
                "window rights other than remote read, write, atomic (zero-based windows are not offered)",
            );
        }
        if kind == KIND_MW2 && b.length == 0 {
            return Err("a type-2 window is freed by invalidation, not a zero-length bind");
        }
        let _changing = self.acquire(e).ok_or("the window is being changed")?;
        if kind == KIND_MW2 && e.window_of.load(Ordering::Relaxed) != 0 {
            return Err("a bound type-2 window must be invalidated before it is bound again");
        }
        if b.length == 0 {
            self.unbind(e);
            e.key.store(b.rkey, Ordering::Release);
            return Ok(b.rkey);
        }
        let (mr, m) = self
            .pin_checked(
                b.mr,
                b.pd,
                None,
                b.addr,
                b.length,
                AccessFlags::MW_BIND,
                PinBy::Count,
            )
            .map_err(
                |_| "the region is not a region of the QP's PD with MW_BIND covering the range",
            )?;
        let mr_access = AccessFlags::from_bits_retain(m.access.load(Ordering::Relaxed));
        if m.layout_gen.load(Ordering::Acquire) != 0 || mr_access.contains(AccessFlags::ZERO_BASED)
        {
            return Err("windows over zero-based or non-contiguous regions are not offered");
        }
        if b.access
            .intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !mr_access.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err("a writable window needs LOCAL_WRITE on its region");
        }
        self.unbind(e);
        let backing = mr.backing();
        e.owner_pid
            .store(m.owner_pid.load(Ordering::Relaxed), Ordering::Relaxed);
        e.addr.store(mr.host as u64, Ordering::Relaxed);
        e.length.store(b.length, Ordering::Relaxed);
        e.iova.store(b.addr, Ordering::Relaxed);
        e.access.store(
            (b.access | (mr_access & AccessFlags::ON_DEMAND)).bits(),
            Ordering::Relaxed,
        );
        e.placement
            .store(m.placement.load(Ordering::Relaxed), Ordering::Relaxed);
        e.mem_fd
            .store(backing.map_or(0, |k| k.fd as u32 + 1), Ordering::Relaxed);
        e.mem_ino
            .store(backing.map_or(0, |k| k.ino), Ordering::Relaxed);
        e.mem_off
            .store(backing.map_or(0, |k| k.offset), Ordering::Relaxed);
        e.bound_qp
            .store(if kind == KIND_MW2 { b.qpn } else { 0 }, Ordering::Relaxed);
        // Counted while the region is pinned, so its deregistration sees the window.
        m.windows.fetch_add(1, Ordering::SeqCst);
        e.window_of.store(b.mr, Ordering::Relaxed);
        e.key.store(b.rkey, Ordering::Release);
        Ok(b.rkey)
    }

    /// Invalidates type-2 window `rkey` of PD `pd` (`IBV_WR_LOCAL_INV`, or a SEND with
    /// Invalidate arriving at a QP of `pd`): it is free again and `rkey` reaches nothing.
    /// `Err` when `rkey` is not the current key of a bound type-2 window of `pd` (a region's
    /// key included: softverbs has no fast-register regions).
    pub fn invalidate_window(&self, rkey: u32, pd: u32) -> std::result::Result<(), &'static str> {
        let e = self.find(rkey).ok_or("no window has this rkey")?;
        match e.kind.load(Ordering::Relaxed) {
            KIND_MW2 => {}
            KIND_MW1 => return Err("a type-1 window cannot be invalidated"),
            _ => return Err("a region's key cannot be invalidated"),
        }
        if e.pd.load(Ordering::Relaxed) != pd {
            return Err("the window is in another PD");
        }
        let _changing = self.acquire(e).ok_or("the window is being changed")?;
        if e.key.load(Ordering::Relaxed) != rkey || e.window_of.load(Ordering::Relaxed) == 0 {
            return Err("the window is not bound with this rkey");
        }
        self.unbind(e);
        Ok(())
    }

    /// Unbinds every window bound to region `mr` (being deregistered regardless of them).
    pub(crate) fn unbind_windows_of(&self, mr: u32) {
        for slot in 1..=self.capacity() {
            let Some(e) = self.entry(slot) else { continue };
            if e.kind.load(Ordering::Relaxed) != KIND_MR
                && e.state.load(Ordering::Acquire) != FREE
                && e.window_of.load(Ordering::Acquire) == mr
                && let Some(_changing) = self.acquire(e)
            {
                self.unbind(e);
            }
        }
    }

    /// The live window entry `window` (any of its keys) names.
    fn window_entry(&self, window: u32) -> Option<&KeyEntry> {
        self.entry(self.window_slot(window)).filter(|e| {
            e.kind.load(Ordering::Relaxed) != KIND_MR
                && e.state.load(Ordering::Acquire) != FREE
                && e.key.load(Ordering::Relaxed) >> 8 == window >> 8
        })
    }

    /// Takes the window for a change (valid → changing), waiting out another change.
    fn acquire<'e>(&self, e: &'e KeyEntry) -> Option<Changing<'e>> {
        let deadline = Instant::now() + WAIT;
        loop {
            match e
                .state
                .compare_exchange(VALID, CHANGING, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Some(Changing(e)),
                Err(CHANGING) if Instant::now() < deadline => std::thread::yield_now(),
                Err(_) => return None,
            }
        }
    }

    /// Detaches a window (taken for a change) from its region: waits for the pins of its
    /// range to drain, uncounts it on the region, and leaves it reaching nothing.
    fn unbind(&self, e: &KeyEntry) {
        let deadline = Instant::now() + WAIT;
        self.await_hazards(e.key.load(Ordering::Acquire), deadline);
        e.wait_unpinned(deadline);
        let mr = e.window_of.swap(0, Ordering::SeqCst);
        if mr != 0
            && let Some(m) = self.entry(self.slot(mr)).filter(|m| {
                m.kind.load(Ordering::Relaxed) == KIND_MR && m.key.load(Ordering::Relaxed) == mr
            })
        {
            let _ = m
                .windows
                .fetch_update(Ordering::SeqCst, Ordering::Relaxed, |n| n.checked_sub(1));
        }
        Self::clear_range(e);
    }

    fn clear_range(e: &KeyEntry) {
        for w in [&e.addr, &e.length, &e.iova, &e.mem_ino, &e.mem_off] {
            w.store(0, Ordering::Relaxed);
        }
        for w in [
            &e.access,
            &e.mem_fd,
            &e.placement,
            &e.layout_fd,
            &e.layout_gen,
            &e.bound_qp,
            &e.window_of,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        e.layout_ino.store(0, Ordering::Relaxed);
    }

    /// How many windows are bound to region `mr` now.
    pub fn windows_on(&self, mr: u32) -> u32 {
        self.entry(self.slot(mr))
            .filter(|m| {
                m.kind.load(Ordering::Relaxed) == KIND_MR && m.key.load(Ordering::Relaxed) == mr
            })
            .map_or(0, |m| m.windows.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mr::keys::KeyError;

    const RIGHTS: AccessFlags = AccessFlags::REMOTE_WRITE;

    fn table(secret: bool) -> KeyTable {
        let t = KeyTable::new(256).unwrap();
        if secret { t.with_secret_keys() } else { t }
    }

    fn region(t: &KeyTable) -> u32 {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND;
        t.register(1, 0x10_0000, 4096, 0x10_0000, access, None)
            .unwrap()
    }

    fn bind(t: &KeyTable, window: u32, mr: u32, qpn: u32) -> std::result::Result<u32, &str> {
        t.bind_window(&WindowBind {
            window,
            rkey: crate::pd::inc_rkey(window),
            pd: 1,
            qpn,
            mr,
            addr: 0x10_0100,
            length: 256,
            access: RIGHTS,
        })
    }

    #[test]
    fn the_window_index_permutation_is_one_and_hides_the_slot() {
        let t = table(true);
        for slot in (0..1u32 << 24).step_by(4099) {
            assert_eq!(t.window_slot(t.window_index(slot) << 8 | 0x5a), slot);
        }
        let moved = (1..200).filter(|&s| t.window_index(s) != s).count();
        assert!(moved > 190, "the index is not the slot: {moved}");
    }

    #[test]
    fn a_bound_window_reaches_its_range_only_from_its_qp_in_secret_and_plain_tables() {
        for secret in [false, true] {
            let t = table(secret);
            let mr = region(&t);
            let w = t.alloc_window(1, true).unwrap();
            assert_ne!(w >> 8, mr >> 8);
            assert_eq!(
                t.pin_remote(w, 1, 9, 0x10_0100, 8, RIGHTS).err(),
                Some(KeyError::Invalid),
                "unbound"
            );
            let rkey = bind(&t, w, mr, 9).unwrap();
            let pin = t.pin_remote(rkey, 1, 9, 0x10_0100, 256, RIGHTS).unwrap();
            assert_eq!(pin.host, 0x10_0100);
            drop(pin);
            assert_eq!(
                t.pin_remote(rkey, 1, 9, 0x10_00ff, 8, RIGHTS).err(),
                Some(KeyError::Bounds)
            );
            assert_eq!(
                t.pin_remote(rkey, 1, 8, 0x10_0100, 8, RIGHTS).err(),
                Some(KeyError::Invalid),
                "another QP"
            );
            assert_eq!(
                t.pin(rkey, 1, 0x10_0100, 8, AccessFlags::empty()).err(),
                Some(KeyError::Invalid),
                "no lkey"
            );
            assert!(
                t.pin_remote(w, 1, 9, 0x10_0100, 8, RIGHTS).is_err(),
                "old key"
            );
            assert_eq!(t.windows_on(mr), 1);
            assert!(bind(&t, rkey, mr, 9).is_err(), "bound type 2");
            t.invalidate_window(rkey, 1).unwrap();
            assert!(t.invalidate_window(rkey, 1).is_err(), "twice");
            assert_eq!(t.windows_on(mr), 0);
            assert!(t.pin_remote(rkey, 1, 9, 0x10_0100, 8, RIGHTS).is_err());
            t.dealloc_window(rkey).unwrap();
            t.deregister(mr, &|_| {}).unwrap();
        }
    }

    #[test]
    fn deregistering_a_region_unbinds_its_windows() {
        let t = table(true);
        let mr = region(&t);
        let w = t.alloc_window(1, false).unwrap();
        let rkey = bind(&t, w, mr, 3).unwrap();
        assert!(
            t.pin_remote(rkey, 1, 4, 0x10_0100, 8, RIGHTS).is_ok(),
            "type 1: any QP"
        );
        t.deregister(mr, &|_| {}).unwrap();
        assert!(t.pin_remote(rkey, 1, 4, 0x10_0100, 8, RIGHTS).is_err());
        assert!(t.invalidate_window(rkey, 1).is_err(), "type 1");
    }

    #[test]
    fn region_keys_never_shadow_live_windows() {
        // Many regions and windows in a small secret table: every key names its own entry.
        let t = table(true);
        let mut regions = Vec::new();
        let mut windows = Vec::new();
        for i in 0..120 {
            if i % 2 == 0 {
                regions.push(region(&t));
            } else {
                windows.push(t.alloc_window(1, true).unwrap());
            }
        }
        for &w in &windows {
            for tag in 0..=0xffu32 {
                let k = (w & !0xff) | tag;
                assert!(!regions.contains(&k), "window {w:#x} shadows region {k:#x}");
            }
        }
        for &r in &regions {
            assert!(t.info(r).is_some());
        }
    }
}
