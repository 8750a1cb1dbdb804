//! Device memory (`ibv_alloc_dm`, `ibv_memcpy_to_dm`/`_from_dm`, `ibv_reg_dm_mr`) over the
//! NIC's ([`softverbs_nic::pd::DeviceMemory`]): the C objects and their checks.

use super::*;
use softverbs_nic::pd::DeviceMemory;

#[repr(C)]
struct SvDm {
    dm: ibv_dm,
    nic: DeviceMemory,
}

/// `verbs_context::alloc_dm`: `length` bytes (1..=`max_dm_size` in all), aligned to
/// `2^log_align_req` up to a page.
pub(super) unsafe extern "C" fn alloc_dm(
    ctx: *mut ibv_context,
    attr: *mut ibv_alloc_dm_attr,
) -> *mut ibv_dm {
    if ctx.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &*attr };
    if a.comp_mask != 0 {
        return inval();
    }
    // SAFETY: a context of ours.
    let nic = match unsafe { ctx_of(ctx) }
        .nic
        .alloc_dm(a.length, a.log_align_req)
    {
        Ok(d) => d,
        Err(e) => return null(e),
    };
    let b = Box::new(SvDm {
        dm: ibv_dm {
            context: ctx,
            memcpy_to_dm: Some(memcpy_to_dm),
            memcpy_from_dm: Some(memcpy_from_dm),
            comp_mask: 0,
            handle: nic.handle(),
        },
        nic,
    });
    Box::into_raw(b) as *mut ibv_dm
}

/// The NIC's device memory of `dm`.
///
/// # Safety
/// `dm` is a live device memory of ours.
unsafe fn nic_dm<'a>(dm: *mut ibv_dm) -> &'a DeviceMemory {
    // SAFETY: as documented.
    &unsafe { &*(dm as *const SvDm) }.nic
}

unsafe extern "C" fn memcpy_to_dm(
    dm: *mut ibv_dm,
    dm_offset: u64,
    host: *const c_void,
    length: usize,
) -> c_int {
    if dm.is_null() || (host.is_null() && length > 0) {
        return EINVAL;
    }
    let data = match length {
        0 => &[][..],
        // SAFETY: the caller's `length` readable bytes.
        n => unsafe { std::slice::from_raw_parts(host as *const u8, n) },
    };
    // SAFETY: a device memory of ours.
    rc(unsafe { nic_dm(dm) }.copy_to(dm_offset, data))
}

unsafe extern "C" fn memcpy_from_dm(
    host: *mut c_void,
    dm: *mut ibv_dm,
    dm_offset: u64,
    length: usize,
) -> c_int {
    if dm.is_null() || (host.is_null() && length > 0) {
        return EINVAL;
    }
    let out = match length {
        0 => &mut [][..],
        // SAFETY: the caller's `length` writable bytes.
        n => unsafe { std::slice::from_raw_parts_mut(host as *mut u8, n) },
    };
    // SAFETY: a device memory of ours.
    rc(unsafe { nic_dm(dm) }.copy_from(dm_offset, out))
}

/// `verbs_context::free_dm`: EBUSY while a region lies in it.
pub(super) unsafe extern "C" fn free_dm(dm: *mut ibv_dm) -> c_int {
    if dm.is_null() {
        return EINVAL;
    }
    // SAFETY: a device memory of ours.
    if unsafe { nic_dm(dm) }.in_use() {
        return libc::EBUSY;
    }
    // SAFETY: `dm` came from `alloc_dm` (Box::into_raw of an SvDm).
    drop(unsafe { Box::from_raw(dm as *mut SvDm) });
    0
}

/// `verbs_context::reg_dm_mr`: a zero-based region over `length` bytes of `dm` from
/// `dm_offset` (see `Pd::reg_dm_mr`).
pub(super) unsafe extern "C" fn reg_dm_mr(
    pd: *mut ibv_pd,
    dm: *mut ibv_dm,
    dm_offset: u64,
    length: usize,
    access: c_uint,
) -> *mut ibv_mr {
    // SAFETY: the caller's PD (NULL or ours).
    let Some(nic_pd) = (unsafe { nic_pd(pd) }) else {
        return inval();
    };
    if dm.is_null() {
        return inval();
    }
    // SAFETY: a device memory of ours.
    match nic_pd.reg_dm_mr(unsafe { nic_dm(dm) }, dm_offset, length, access) {
        Ok((nic, hold)) => {
            // SAFETY: a PD of ours. The MR's address is the offset in the device memory, as
            // rdma-core's `ibv_cmd_reg_dm_mr` sets it.
            let mr = new_mr(
                unsafe { (*pd).context },
                pd,
                dm_offset as usize as *mut c_void,
                length,
                nic,
                None,
            );
            // SAFETY: the SvMr `new_mr` just made.
            unsafe { (*(mr as *mut SvMr)).dm = Some(hold) };
            mr
        }
        Err(e) => null(e),
    }
}
