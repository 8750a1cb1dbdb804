//! QP numbers of a device: allocation, the send-queue slots each number has freed, and the
//! live QPs by number.
//!
//! A number is `generation << bits | index`; indices 0 and 1 are QP0/QP1, and a freed index
//! comes back with the next generation, so a stale number does not name its successor. The
//! number is also claimed host-wide in the directory ([`super::directory`]) when the QP is
//! published.

use super::Device;
use crate::error::{Error, Result};
use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

pub(super) struct QpNumbers {
    free: Vec<u32>,
    generation: Vec<u32>,
    bits: u32,
}

impl QpNumbers {
    /// Numbers for up to `max_qp` QPs (plus QP0 and QP1).
    pub(super) fn new(max_qp: u32) -> QpNumbers {
        let bits = (max_qp + 2).next_power_of_two().trailing_zeros();
        let slots = 1usize << bits;
        QpNumbers {
            free: (2..slots as u32).rev().collect(),
            generation: vec![0; slots],
            bits,
        }
    }

    /// How many indices there are.
    pub(super) fn slots(&self) -> usize {
        self.generation.len()
    }
}

impl Device {
    /// How many QP numbers (indices) the device has.
    pub(crate) fn qpn_slots(&self) -> usize {
        self.qp_index
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .slots()
    }

    pub(crate) fn alloc_qpn(&self) -> Result<u32> {
        let mut n = self.qp_index.lock().unwrap_or_else(|e| e.into_inner());
        let index = n
            .free
            .pop()
            .ok_or_else(|| Error::NoResources("no free QP numbers".into()))?;
        let bits = n.bits;
        let mask = (1 << (24 - bits)) - 1;
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
        self.sq_retired[index as usize].store(0, Ordering::Release);
        Ok(*g << bits | index)
    }

    pub(crate) fn qpn_index(&self, qpn: u32) -> usize {
        let bits = (self.config.limits.max_qp + 2)
            .next_power_of_two()
            .trailing_zeros();
        (qpn & ((1 << bits) - 1)) as usize
    }

    /// Frees the send-queue slots of `qpn` up to and including the WQE numbered `seq`.
    pub(crate) fn retire_sq(&self, qpn: u32, seq: u32) {
        let slot = &self.sq_retired[self.qpn_index(qpn)];
        let next = seq.wrapping_add(1);
        let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
            // Wrapping comparison: only move forward.
            ((next.wrapping_sub(cur) as i32) > 0).then_some(next)
        });
    }

    /// Makes `qp` findable as QP `qpn` of this device ([`Device::find_qp`]).
    pub(crate) fn register_qp(&self, qpn: u32, qp: Weak<dyn Any + Send + Sync>) {
        self.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qpn, qp);
    }

    pub(crate) fn unregister_qp(&self, qpn: u32) {
        self.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qpn);
        let index = self.qpn_index(qpn) as u32;
        self.qp_index
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free
            .insert(0, index);
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
        qp.downcast().ok()
    }
}
