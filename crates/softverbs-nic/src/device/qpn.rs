//! QP numbers of a device: allocation, the send-queue slots each number has freed, and the
//! live QPs by number.
//!
//! A number is `generation << INDEX_BITS | index`; indices 0 and 1 are QP0/QP1, and a freed
//! index comes back with the next generation, so a stale number does not name its successor.
//! Indices are handed out from blocks this process claimed host-wide in the directory
//! ([`super::directory`]), where each QP is listed when it is created; a block goes back when
//! its last QP does.

use super::Device;
use super::directory::{self, BLOCK_LEN, BLOCKS, BlockClaim, INDEX_BITS, Listing};
use crate::device_memory::segment::Segment;
use crate::error::{Error, Result};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

/// What the device needs of its QPs, which live in the layer above it: found by number (as
/// [`Any`], downcast by that layer), and waited for when a region goes.
pub(crate) trait QpHandle: Any + Send + Sync {
    /// Returns once no request of this QP that runs under its send lock, if the QP is in PD
    /// `pd` and uses this device's key table, is still inside its execution (the lock taken
    /// once). Such requests pin their own regions uncounted (`KeyTable::pin_key`).
    fn quiesce_sends(&self, pd: u32);
}

pub(super) struct QpNumbers {
    /// Free indices of the blocks held, oldest freed first.
    free: VecDeque<u32>,
    generation: Vec<u32>,
    /// The blocks held, with how many of their indices are in use.
    blocks: HashMap<u32, (BlockClaim, u32)>,
}

/// Indices a device has (host-wide).
pub(super) const SLOTS: usize = 1 << INDEX_BITS;

impl QpNumbers {
    pub(super) fn new() -> QpNumbers {
        QpNumbers {
            free: VecDeque::new(),
            generation: vec![0; SLOTS],
            blocks: HashMap::new(),
        }
    }
}

impl Device {
    /// A QP number no QP of this device on the host has, listed with context `ctx`.
    pub(crate) fn alloc_qpn(&self, ctx: &Segment) -> Result<(u32, Listing)> {
        let mut n = self.qp_index.lock().unwrap_or_else(|e| e.into_inner());
        if n.free.is_empty() {
            self.claim_block(&mut n)?;
        }
        let index = n
            .free
            .pop_front()
            .expect("a block with free indices was claimed");
        let mask = (1 << (24 - INDEX_BITS)) - 1;
        let g = &mut n.generation[index as usize];
        // An attacker on the network must not guess a networked device's QP numbers; the
        // generation bits are random there (and never repeat the previous one).
        *g = match &self.config.net {
            Some(_) => {
                let r = crate::random::random_u64() as u32 & mask;
                if r == *g { (r + 1) & mask } else { r }
            }
            None => (*g + 1) & mask,
        };
        let qpn = *g << INDEX_BITS | index;
        let (claim, used) = n
            .blocks
            .get_mut(&directory::block_of(index))
            .expect("free indices are of held blocks");
        *used += 1;
        let listing = claim.publish(qpn, ctx);
        self.sq_retired[index as usize].store(0, Ordering::Release);
        Ok((qpn, listing))
    }

    /// Claims the first block no process of the host has. Every process tries the blocks in
    /// the same order (a taken one costs one failed `bind`), so a number freed by a process
    /// that died is soon someone else's: generations, not luck, keep stale numbers apart.
    fn claim_block(&self, n: &mut QpNumbers) -> Result<()> {
        for block in 0..BLOCKS {
            if n.blocks.contains_key(&block) {
                continue;
            }
            let Some(claim) = directory::claim(self.config.gid, block)? else {
                continue;
            };
            let first = block * BLOCK_LEN;
            // Indices 0 and 1 are QP0 and QP1.
            n.free
                .extend((first..first + BLOCK_LEN).filter(|&i| i >= 2));
            n.blocks.insert(block, (claim, 0));
            return Ok(());
        }
        Err(Error::NoResources("no free QP number on this host".into()))
    }

    pub(crate) fn qpn_index(&self, qpn: u32) -> usize {
        directory::index_of(qpn) as usize
    }

    /// Makes `qp` findable as QP `qpn` of this device ([`Device::find_qp`]).
    pub(crate) fn register_qp(&self, qpn: u32, qp: Weak<dyn QpHandle>) {
        self.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qpn, qp);
    }

    /// Forgets QP `qpn` and frees its index; the block goes back to the host with its last
    /// QP, so a process keeps no names for QPs it no longer has.
    pub(crate) fn unregister_qp(&self, qpn: u32) {
        self.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qpn);
        let index = directory::index_of(qpn);
        let block = directory::block_of(index);
        let mut n = self.qp_index.lock().unwrap_or_else(|e| e.into_inner());
        let Some((_, used)) = n.blocks.get_mut(&block) else {
            return;
        };
        *used -= 1;
        if *used == 0 {
            n.blocks.remove(&block);
            n.free.retain(|&i| directory::block_of(i) != block);
        } else {
            n.free.push_back(index);
        }
    }

    /// The live QP with number `qpn` on this device, as the type it was registered with (the
    /// QP layer registers its `Qp`s, and only those).
    pub(crate) fn find_qp<Q: Any + Send + Sync>(&self, qpn: u32) -> Option<Arc<Q>> {
        let qp = self
            .qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)?
            .upgrade()?;
        (qp as Arc<dyn Any + Send + Sync>).downcast().ok()
    }

    /// Returns once no QP of PD `pd` on this device is inside a request's execution (see
    /// [`QpHandle::quiesce_sends`]): what deregistering a region of `pd` waits for.
    pub(crate) fn quiesce_senders(&self, pd: u32) {
        // Collected first: a QP's send lock is taken without the registry's held (posts look
        // QPs up in the registry while holding theirs).
        let qps: Vec<Arc<dyn QpHandle>> = {
            let qps = self.qps.read().unwrap_or_else(|e| e.into_inner());
            qps.values().filter_map(Weak::upgrade).collect()
        };
        for qp in qps {
            qp.quiesce_sends(pd);
        }
    }
}

/// Frees the send-queue slots of `qpn` up to and including the WQE numbered `seq`, in a
/// device's `sq_retired` table (an unknown `qpn` changes nothing).
///
/// Called by the poller of the QP's send CQ under that CQ's consumer lock, in the order the
/// completions are polled: one writer at a time, so a load and a store do what a
/// compare-and-swap would, for a fraction of its cost per completion.
#[inline(always)]
pub(crate) fn retire_sq(sq_retired: &[AtomicU32], qpn: u32, seq: u32) {
    let Some(slot) = sq_retired.get(directory::index_of(qpn) as usize) else {
        return;
    };
    let next = seq.wrapping_add(1);
    // Wrapping comparison: only move forward.
    if (next.wrapping_sub(slot.load(Ordering::Relaxed)) as i32) > 0 {
        slot.store(next, Ordering::Release);
    }
}
