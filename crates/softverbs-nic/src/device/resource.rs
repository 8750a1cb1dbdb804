//! Device limits: every object counts against its kind's limit while it lives.

use super::Device;
use crate::error::{Error, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// Kinds of objects a device counts against its limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resource {
    Pd,
    Cq,
    Qp,
    Srq,
    Ah,
    Mr,
    Mw,
}

/// A slot counted against a device limit; released on drop.
pub(crate) struct Counted {
    dev: Arc<Device>,
    kind: Resource,
}

impl Counted {
    /// True if the counted object belongs to `dev`.
    pub(crate) fn on(&self, dev: &Arc<Device>) -> bool {
        Arc::ptr_eq(&self.dev, dev)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.dev.count(self.kind).fetch_sub(1, Ordering::AcqRel);
    }
}

/// How many objects use this one (the MRs, QPs, SRQs and AHs of a PD; the QPs of a CQ or an
/// SRQ). Memory safety does not need it (users hold `Arc`s); the verbs contract does: a
/// destroy call answers EBUSY while the object is used, and the object stays usable.
#[derive(Default)]
pub(crate) struct Users(Arc<AtomicUsize>);

impl Users {
    /// Counts one more user until the returned guard is dropped.
    pub(crate) fn add(&self) -> InUse {
        self.0.fetch_add(1, Ordering::AcqRel);
        InUse(self.0.clone())
    }

    pub(crate) fn any(&self) -> bool {
        self.count() > 0
    }

    pub(crate) fn count(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

/// One user of an object; see [`Users`].
pub struct InUse(Arc<AtomicUsize>);

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Device {
    fn count(&self, kind: Resource) -> &AtomicU32 {
        &self.counts[kind as usize]
    }

    /// Counts one more object of `kind`, failing with ENOMEM at the device limit.
    pub(crate) fn acquire(self: &Arc<Self>, kind: Resource) -> Result<Counted> {
        let l = &self.config.limits;
        let limit = match kind {
            Resource::Pd => l.max_pd,
            Resource::Cq => l.max_cq,
            Resource::Qp => l.max_qp,
            Resource::Srq => l.max_srq,
            Resource::Ah => l.max_ah,
            Resource::Mr | Resource::Mw => l.max_mr,
        };
        self.count(kind)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| {
                Error::NoResources(format!("device limit of {limit} {kind:?}s reached"))
            })?;
        Ok(Counted {
            dev: self.clone(),
            kind,
        })
    }

    /// A fresh device-wide id for PDs, CQs and SRQs.
    pub(crate) fn next_id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}
