//! softverbs' own C extensions, declared in `include/softverbs/verbs_ext.h` and exported under
//! the `SOFTVERBS_1.0` symbol version: the seed's `ibv_poll_cq_ex` (compact records laid out
//! from the CQ's creation flags, see `softverbs_nic::cq::compact`) and the CQ's creation flags in
//! the seed's numbering, which the header's `ibv_wc_ex_get*` helpers take.

use crate::abi::ibv_cq;
use crate::set_errno;
use crate::verbs::with_live_cq;
use core::ffi::{c_int, c_uint, c_void};

/// The seed's `struct ibv_poll_cq_ex_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct ibv_poll_cq_ex_attr {
    pub max_entries: c_uint,
    pub comp_mask: u32,
}

/// `ibv_poll_cq_ex`: up to `attr->max_entries` completions written to `wc` back to back, each
/// `ibv_wc_ex_get_size(flags)` bytes. Returns how many, or `-EINVAL` for a NULL or unknown CQ,
/// a NULL `attr`, unknown `attr->comp_mask` bits, or a NULL `wc` with room asked for.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_poll_cq_ex(
    cq: *mut ibv_cq,
    wc: *mut c_void,
    attr: *mut ibv_poll_cq_ex_attr,
) -> c_int {
    const EINVAL: c_int = -libc::EINVAL;
    if attr.is_null() {
        return EINVAL;
    }
    // SAFETY: the caller's attribute struct, not NULL.
    let a = unsafe { attr.read() };
    if a.comp_mask != 0 {
        return EINVAL;
    }
    with_live_cq(cq, |nic| {
        // The count must fit the return value.
        let max = (a.max_entries as usize).min(c_int::MAX as usize);
        if max == 0 {
            return 0;
        }
        if wc.is_null() {
            return EINVAL;
        }
        let Some(len) = max
            .checked_mul(nic.layout().size())
            .filter(|&l| l <= isize::MAX as usize)
        else {
            return EINVAL;
        };
        // SAFETY: the caller provides room for `max_entries` records of the CQ's size; only
        // whole records are written, and never read.
        let buf = unsafe { core::slice::from_raw_parts_mut(wc as *mut u8, len) };
        nic.poll_compact(buf, max) as c_int
    })
    .unwrap_or(EINVAL)
}

/// `ibv_wc_ex_cq_flags`: the `IBV_WC_EX_SEED_WITH_*` bits of the fields `cq` returns (the seed's
/// `cq_creation_wc_flags`); 0 with `errno` EINVAL for a NULL or unknown CQ.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_wc_ex_cq_flags(cq: *mut ibv_cq) -> u64 {
    with_live_cq(cq, |nic| nic.layout().flags().bits()).unwrap_or_else(|| {
        set_errno(libc::EINVAL);
        0
    })
}
