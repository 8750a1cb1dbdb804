//! Address handles: where UD sends go.

use super::Pd;
use crate::device::{Counted, Device, InUse, Resource};
use crate::error::Result;
use crate::types::AhAttr;
use std::sync::{Arc, Weak};

impl Pd {
    /// Creates an address handle for UD sends.
    pub fn create_ah(self: &Arc<Self>, attr: &AhAttr) -> Result<Arc<Ah>> {
        let dev = &self.ctx.dev;
        dev.check_av(attr)?;
        let count = dev.acquire(Resource::Ah)?;
        Ok(Arc::new(Ah {
            attr: *attr,
            pd: self.id,
            target: dev.resolve(attr),
            _pd_use: self.users.add(),
            _count: count,
        }))
    }
}

/// An address handle: where UD sends go.
pub struct Ah {
    pub(crate) attr: AhAttr,
    pub(crate) pd: u32,
    pub(crate) target: Weak<Device>,
    _pd_use: InUse,
    _count: Counted,
}

impl Ah {
    /// The address vector.
    pub fn attr(&self) -> &AhAttr {
        &self.attr
    }
    /// The PD the handle was created in.
    pub fn pd_id(&self) -> u32 {
        self.pd
    }
}
