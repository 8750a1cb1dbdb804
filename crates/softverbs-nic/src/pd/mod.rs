//! Protection domains and the objects in them that need no queue: memory regions (with their
//! non-contiguous layouts), memory windows, device memory and address handles; PDs and
//! regions imported from another process (`import`). SRQs and QPs, also created in a PD, are made
//! by the QP layer (`Pd::create_srq`, `Pd::create_qp`).

mod ah;
mod device_memory;
mod import;
mod region;
mod window;

pub use ah::Ah;
pub use device_memory::{DeviceMemory, DmHold, MAX_DM_SIZE};
pub use region::{Mr, Prefetch};
pub use window::{Mw, MwType, inc_rkey};

use crate::device::{Context, Counted, Resource, Users};
use crate::error::{Error, Result, inval};
use crate::types::AccessFlags;
use std::sync::Arc;

impl Context {
    /// Allocates a protection domain.
    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<Pd>> {
        let count = self.dev.acquire(Resource::Pd)?;
        let id = self.dev.next_id();
        // Importable by another process through this context's command descriptor (a PD of
        // an imported context is its own process's and is not).
        let exported = self.import.is_none() && self.command.add_pd(id);
        Ok(Arc::new(Pd {
            id,
            ctx: self.clone(),
            users: Users::default(),
            import: None,
            exported,
            _count: count,
        }))
    }
}

/// A protection domain.
pub struct Pd {
    pub(crate) id: u32,
    pub(crate) ctx: Arc<Context>,
    pub(crate) users: Users,
    /// An imported PD's view of its exporter (`import`).
    pub(crate) import: Option<Arc<crate::device::shared::Import>>,
    /// Listed in its context's command segment, for other processes to import.
    exported: bool,
    _count: Counted,
}

impl Drop for Pd {
    fn drop(&mut self) {
        if self.exported {
            self.ctx.command.remove_pd(self.id);
        }
    }
}

impl Pd {
    /// Device-wide id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// True while a memory region, QP, SRQ or address handle lives in this PD
    /// (`ibv_dealloc_pd` is EBUSY then).
    pub fn in_use(&self) -> bool {
        self.users.any()
    }

    /// How many objects use the PD now.
    pub fn users(&self) -> usize {
        self.users.count()
    }

    /// Counts the caller as a user of the PD until the guard is dropped (a parent domain
    /// over it: the PD cannot be deallocated under it).
    pub fn hold(&self) -> crate::device::InUse {
        self.users.add()
    }

    /// The context the PD belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Checks `access` the way `ibv_reg_mr` does and returns the flags that take effect.
    ///
    /// Unknown mandatory bits and remote write/atomic without local write are invalid;
    /// known mandatory bits this device lacks are unsupported; optional bits (20..=29) the
    /// device implements ([`AccessFlags::SUPPORTED_OPTIONAL`]) are kept and the others
    /// dropped.
    pub fn effective_access(raw: u32) -> Result<AccessFlags> {
        let optional = raw & AccessFlags::OPTIONAL_RANGE;
        let mandatory = raw & !AccessFlags::OPTIONAL_RANGE;
        let known = AccessFlags::all().bits() & !AccessFlags::OPTIONAL_RANGE;
        if mandatory & !known != 0 {
            return Err(inval(format!(
                "unknown access bits {:#x}",
                mandatory & !known
            )));
        }
        let flags = AccessFlags::from_bits_retain(mandatory);
        if flags.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !flags.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(inval("REMOTE_WRITE or REMOTE_ATOMIC requires LOCAL_WRITE"));
        }
        let missing = flags - AccessFlags::SUPPORTED_MR;
        if !missing.is_empty() {
            return Err(Error::Unsupported(format!(
                "access flags {missing:?} are not implemented by softverbs"
            )));
        }
        // Optional bits are hints a device may ignore (rdma-core's `ibv_reg_mr_iova2`
        // contract), so the ones softverbs lacks vanish instead of failing; the MR reports
        // what is left, which is what its placement follows.
        let kept = AccessFlags::from_bits_retain(optional) & AccessFlags::SUPPORTED_OPTIONAL;
        Ok(flags | kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_rules() {
        let ok = |raw| Pd::effective_access(raw).unwrap();
        assert_eq!(ok(0), AccessFlags::empty());
        assert_eq!(
            ok(1 | 2 | 4 | 8),
            AccessFlags::LOCAL_WRITE | AccessFlags::QP_REMOTE
        );
        // Unsupported optional bits are dropped, not rejected; supported ones stay.
        assert_eq!(ok(1 | (1 << 21) | (1 << 29)), AccessFlags::LOCAL_WRITE);
        assert_eq!(
            ok(1 | (1 << 20) | (1 << 29)),
            AccessFlags::LOCAL_WRITE | AccessFlags::RELAXED_ORDERING
        );
        assert!(matches!(
            Pd::effective_access(2),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Pd::effective_access(8),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Pd::effective_access(1 << 15),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Pd::effective_access(1 << 30),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(ok(1 << 4), AccessFlags::MW_BIND);
        assert_eq!(ok(1 << 8), AccessFlags::FLUSH_GLOBAL);
        assert!(matches!(
            Pd::effective_access(1 << 9),
            Err(Error::Unsupported(_))
        ));
    }
}
