//! Memory windows as verbs objects (`ibv_alloc_mw`); their keys and rules are in
//! [`crate::mr::window`].

use super::Pd;
use crate::device::{Counted, InUse, Resource};
use crate::error::Result;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// `enum ibv_mw_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MwType {
    /// Bound with `ibv_bind_mw` by any QP of its PD; rebinds in place.
    Type1 = 1,
    /// Bound by a bind work request, reached only through the QP that bound it, freed by
    /// invalidation (type 2B).
    Type2 = 2,
}

impl Pd {
    /// `ibv_alloc_mw`: an unbound window of this PD.
    pub fn alloc_mw(self: &Arc<Self>, kind: MwType) -> Result<Mw> {
        self.own_keys()?;
        let dev = &self.ctx.dev;
        let count = dev.acquire(Resource::Mw)?;
        let key = dev.keys.alloc_window(self.id, kind == MwType::Type2)?;
        Ok(Mw {
            pd: self.clone(),
            handle: key,
            rkey: AtomicU32::new(key),
            kind,
            _pd_use: self.users.add(),
            _count: count,
        })
    }
}

/// A memory window. Dropping it unbinds and frees it.
pub struct Mw {
    pd: Arc<Pd>,
    /// The key it was allocated with: its upper 24 bits name it for its lifetime.
    handle: u32,
    rkey: AtomicU32,
    kind: MwType,
    _pd_use: InUse,
    _count: Counted,
}

impl Mw {
    /// What a bind work request names the window by ([`SendOp::BindMw`]'s `window`).
    ///
    /// [`SendOp::BindMw`]: crate::qp::wr::SendOp::BindMw
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// The rkey of the last bind posted for it (its allocation key before any).
    pub fn rkey(&self) -> u32 {
        self.rkey.load(Ordering::Acquire)
    }

    /// Records the rkey a posted bind gives it.
    pub fn set_rkey(&self, rkey: u32) {
        self.rkey.store(rkey, Ordering::Release);
    }

    /// Its type.
    pub fn kind(&self) -> MwType {
        self.kind
    }

    /// Its protection domain.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        let _ = self.pd.ctx.dev.keys.dealloc_window(self.handle);
    }
}

/// `ibv_inc_rkey`: the next rkey of a window (its low 8 bits, the consumer's key, plus one).
pub fn inc_rkey(rkey: u32) -> u32 {
    (rkey & 0xffff_ff00) | (rkey.wrapping_add(1) & 0xff)
}
