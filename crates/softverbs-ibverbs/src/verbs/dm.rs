//! Device memory (`ibv_alloc_dm`, `ibv_memcpy_to_dm`/`_from_dm`, `ibv_reg_dm_mr`): memory
//! "on the device" that the program reaches only through copies and zero-based regions. A
//! software NIC's device memory is a shared-memory segment, so peers in other processes (and
//! the host engine) map it as they map any shared region.

use super::*;
use softverbs_nic::device_memory::segment::Segment;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `max_dm_size`: the device memory a process may hold at once (ConnectX-5's on-chip memory
/// is of this order; a software device could offer more, but programs size to it).
pub(super) const MAX_DM_SIZE: usize = 256 * 1024;

/// Device memory allocated and not yet freed in this process.
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

#[repr(C)]
struct SvDm {
    dm: ibv_dm,
    seg: Arc<Segment>,
}

impl Drop for SvDm {
    fn drop(&mut self) {
        ALLOCATED.fetch_sub(self.seg.len(), Ordering::AcqRel);
    }
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
    let page = softverbs_nic::device_memory::segment::page_size();
    if a.comp_mask != 0 || a.length == 0 || a.log_align_req >= usize::BITS {
        return inval();
    }
    if 1usize << a.log_align_req > page {
        return inval(); // segments are page-aligned; nothing coarser is offered
    }
    let len = a.length;
    let taken = ALLOCATED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        n.checked_add(len).filter(|&t| t <= MAX_DM_SIZE)
    });
    if taken.is_err() {
        return null(Error::NoResources(format!(
            "{len} bytes of device memory: {MAX_DM_SIZE} in all"
        )));
    }
    let seg = match Segment::create("softverbs-dm", len) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            ALLOCATED.fetch_sub(len, Ordering::AcqRel);
            return null(e);
        }
    };
    let b = Box::new(SvDm {
        dm: ibv_dm {
            context: ctx,
            memcpy_to_dm: Some(memcpy_to_dm),
            memcpy_from_dm: Some(memcpy_from_dm),
            comp_mask: 0,
            handle: seg.inode() as u32,
        },
        seg,
    });
    Box::into_raw(b) as *mut ibv_dm
}

/// `dm_offset..dm_offset + length` inside `dm`'s bytes, as a pointer, or None.
///
/// # Safety
/// `dm` is a live device memory of ours.
unsafe fn at(dm: *mut ibv_dm, dm_offset: u64, length: usize) -> Option<*mut u8> {
    // SAFETY: as documented.
    let sv = unsafe { &*(dm as *const SvDm) };
    let off = usize::try_from(dm_offset).ok()?;
    (off.checked_add(length)? <= sv.seg.len()).then(|| {
        // SAFETY: in bounds of the segment, checked just above.
        unsafe { sv.seg.as_ptr().add(off) }
    })
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
    // SAFETY: a device memory of ours.
    let Some(dst) = (unsafe { at(dm, dm_offset, length) }) else {
        return EINVAL;
    };
    // SAFETY: the caller's `length` readable bytes; the destination is inside the segment.
    unsafe { std::ptr::copy(host as *const u8, dst, length) };
    0
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
    // SAFETY: a device memory of ours.
    let Some(src) = (unsafe { at(dm, dm_offset, length) }) else {
        return EINVAL;
    };
    // SAFETY: inside the segment; the caller's `length` writable bytes.
    unsafe { std::ptr::copy(src, host as *mut u8, length) };
    0
}

/// `verbs_context::free_dm`: EBUSY while a region lies in it.
pub(super) unsafe extern "C" fn free_dm(dm: *mut ibv_dm) -> c_int {
    if dm.is_null() {
        return EINVAL;
    }
    // SAFETY: a device memory of ours.
    if Arc::strong_count(&unsafe { &*(dm as *const SvDm) }.seg) > 1 {
        return libc::EBUSY;
    }
    // SAFETY: `dm` came from `alloc_dm` (Box::into_raw of an SvDm).
    drop(unsafe { Box::from_raw(dm as *mut SvDm) });
    0
}

/// `verbs_context::reg_dm_mr`: a zero-based region (`IBV_ACCESS_ZERO_BASED` is required, as
/// the man page says) over `length` bytes of `dm` from `dm_offset`. Peers map the device
/// memory's segment, so it takes remote atomics too.
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
    if dm.is_null() || access & AccessFlags::ZERO_BASED.bits() == 0 || length == 0 {
        return inval();
    }
    // SAFETY: a device memory of ours.
    let Some(host) = (unsafe { at(dm, dm_offset, length) }) else {
        return inval();
    };
    // SAFETY: as above.
    let seg = unsafe { &*(dm as *const SvDm) }.seg.clone();
    let backing = softverbs_nic::mr::keys::Backing {
        fd: std::os::fd::AsRawFd::as_raw_fd(&seg.fd()),
        ino: seg.inode(),
        offset: dm_offset,
    };
    // SAFETY: the bytes are the segment's, which the region keeps mapped (`SvMr::dm`).
    match unsafe { nic_pd.reg_mr(host as usize, length, 0, access, Some(backing)) } {
        Ok(nic) => {
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
            unsafe { (*(mr as *mut SvMr)).dm = Some(seg) };
            mr
        }
        Err(e) => null(e),
    }
}
