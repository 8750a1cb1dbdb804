//! Thread domains and parent domains (`ibv_alloc_td`, `ibv_alloc_parent_domain`).
//!
//! A thread domain is the program's promise that one thread uses the objects in it, which
//! lets a provider drop locks; softverbs' queues are safe from any thread, so it is an object
//! to hand around and nothing more. A parent domain is a PD (its protection domain's, to
//! every check) that also names a thread domain and the program's allocators. softverbs never
//! calls the allocators: its queue memory must be shared-memory segments that peer processes
//! and the host engine map, which a program's `alloc` cannot provide (rdma-core lets a
//! provider use its own allocator for any resource).

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS`, `..._PD_CONTEXT`.
const PD_ATTR_ALLOCATORS: u32 = 1;
const PD_ATTR_PD_CONTEXT: u32 = 1 << 1;

#[repr(C)]
struct SvTd {
    td: ibv_td,
    /// Parent domains naming it.
    parents: AtomicUsize,
}

/// What a parent domain was made of.
pub(super) struct Parent {
    td: *mut ibv_td,
    /// Keeps its protection domain from being deallocated under it.
    _hold: softverbs_nic::device::InUse,
}

impl Drop for Parent {
    fn drop(&mut self) {
        if !self.td.is_null() {
            // SAFETY: the thread domain outlives its parent domains (dealloc_td is EBUSY).
            unsafe { &*(self.td as *const SvTd) }
                .parents
                .fetch_sub(1, Ordering::AcqRel);
        }
    }
}

// SAFETY: the raw thread-domain pointer is only used to count its users, atomically.
unsafe impl Send for Parent {}
// SAFETY: as above.
unsafe impl Sync for Parent {}

pub(super) unsafe extern "C" fn alloc_td(
    ctx: *mut ibv_context,
    attr: *mut ibv_td_init_attr,
) -> *mut ibv_td {
    // SAFETY: the caller's attributes, or NULL.
    if ctx.is_null() || attr.is_null() || unsafe { (*attr).comp_mask } != 0 {
        return inval();
    }
    let b = Box::new(SvTd {
        td: ibv_td { context: ctx },
        parents: AtomicUsize::new(0),
    });
    Box::into_raw(b) as *mut ibv_td
}

/// EBUSY while a parent domain names it.
pub(super) unsafe extern "C" fn dealloc_td(td: *mut ibv_td) -> c_int {
    if td.is_null() {
        return EINVAL;
    }
    // SAFETY: a thread domain of ours.
    if unsafe { &*(td as *const SvTd) }
        .parents
        .load(Ordering::Acquire)
        > 0
    {
        return libc::EBUSY;
    }
    // SAFETY: `td` came from `alloc_td` (Box::into_raw of an SvTd).
    drop(unsafe { Box::from_raw(td as *mut SvTd) });
    0
}

/// A parent domain over `attr.pd` (a protection domain, not another parent domain), with
/// `attr.td` or none. It is deallocated with `ibv_dealloc_pd`, EBUSY while anything lives in
/// its protection domain (softverbs counts users per protection domain, not per parent).
pub(super) unsafe extern "C" fn alloc_parent_domain(
    ctx: *mut ibv_context,
    attr: *mut ibv_parent_domain_init_attr,
) -> *mut ibv_pd {
    if ctx.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &*attr };
    if a.pd.is_null() || a.comp_mask & !(PD_ATTR_ALLOCATORS | PD_ATTR_PD_CONTEXT) != 0 {
        return inval();
    }
    if a.comp_mask & PD_ATTR_ALLOCATORS != 0 && (a.alloc.is_none() || a.free.is_none()) {
        return inval();
    }
    // SAFETY: a PD of ours.
    let base = unsafe { &*(a.pd as *const SvPd) };
    if base.parent.is_some() || base.pd.context != ctx {
        return inval();
    }
    if !a.td.is_null() {
        // SAFETY: a thread domain of ours.
        let td = unsafe { &*(a.td as *const SvTd) };
        if td.td.context != ctx {
            return inval();
        }
        td.parents.fetch_add(1, Ordering::AcqRel);
    }
    let b = Box::new(SvPd {
        pd: ibv_pd {
            context: ctx,
            handle: base.pd.handle,
        },
        nic: base.nic.clone(),
        parent: Some(Parent {
            td: a.td,
            _hold: base.nic.hold(),
        }),
    });
    Box::into_raw(b) as *mut ibv_pd
}

/// True if `pd` is a parent domain of `ctx`.
///
/// # Safety
/// `pd` is NULL or a PD of ours.
pub(super) unsafe fn is_parent_of(pd: *mut ibv_pd, ctx: *mut ibv_context) -> bool {
    // SAFETY: as documented.
    !pd.is_null() && {
        let sv = unsafe { &*(pd as *const SvPd) };
        sv.parent.is_some() && sv.pd.context == ctx
    }
}
