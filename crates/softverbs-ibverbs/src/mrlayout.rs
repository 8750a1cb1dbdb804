//! Seed 002's non-contiguous memory regions from C, declared in
//! `include/softverbs/verbs_ext.h` and exported under `SOFTVERBS_1.0`:
//! `ibv_mr_set_layout_sg`, `ibv_mr_set_layout_interleaved` (the seed's structs and result
//! codes) and `ibv_query_mr_layout_caps` (the seed's `struct ibv_mr_layout_caps`, which the
//! shipped `struct ibv_device_attr_ex` has no room for); and the page-list and bitmap
//! registrations the seed's thread asks for, `ibv_reg_mr_pages` and `ibv_reg_mr_bitmap`.
//!
//! The container is made by `ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED | ...)` (see
//! `sv_ibv_reg_mr_iova2`), the layout bind work request is `IBV_WR_BIND_MW` naming the
//! container (see `send_wqe`), and `ibv_dereg_mr` answers EBUSY for a region a layout uses.
//! The NIC does the work (`softverbs_nic::pd::Mr::set_layout`); this module converts the
//! C arguments, maps errors to the seed's codes and keeps the C `struct ibv_mr` (keys, length)
//! in step with the NIC's.

use crate::abi::{ibv_context, ibv_mr, ibv_pd, ibv_sge};
use crate::set_errno;
use crate::verbs::{inval, new_mr, nic_pd, null, with_live_ctx, with_live_mr};
use core::ffi::{c_int, c_uint, c_void};
use softverbs_nic::Error;
use softverbs_nic::mr::layout::{Datum, Dim, InterleavedEntry, Layout, LayoutCaps, SetLayoutFlags};
use softverbs_nic::mr::store::{LayoutSource, set_layout_code};
use softverbs_nic::pd::Mr;
use std::sync::Mutex;

/// `IBV_MR_SET_LAYOUT_ERR_INPUT`, also returned (with errno ENOMEM or an OS errno) for
/// failures the seed has no code for; `set_layout_code` gives -2 and -3.
const ERR_INPUT: c_int = -1;

/// The seed's `struct ibv_mr_layout_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(non_camel_case_types)]
pub struct ibv_mr_layout_caps {
    pub cap_flags: u64,
    pub max_num_sg: u32,
    pub max_inline_num_sg: u32,
    pub max_num_interleaved: u32,
    pub max_inline_num_interleaved: u32,
    /// The seed's spelling (`max_mr_stride_dimenson`).
    pub max_mr_stride_dimension: u32,
    pub max_mr_nesting_level: u32,
}

/// The seed's `struct ibv_mr_layout_interleved_dimensions`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct ibv_mr_layout_interleved_dimensions {
    pub offset_stride: u64,
    pub datum_count: u64,
}

/// The seed's `struct ibv_mr_layout_interleaved`.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct ibv_mr_layout_interleaved {
    pub first_datum: ibv_sge,
    pub num_repeated: c_int,
    pub num_dimensions: c_int,
    pub dims: *const ibv_mr_layout_interleved_dimensions,
}

// The sizes `include/softverbs/verbs_ext.h` gives (tests/c/noncontig.c checks the C side).
const _: () = assert!(size_of::<ibv_mr_layout_caps>() == 32);
const _: () = assert!(size_of::<ibv_mr_layout_interleaved>() == 32);
const _: () = assert!(size_of::<ibv_mr_layout_interleved_dimensions>() == 16);

/// Reports a failed call: errno set, the seed's code returned.
fn fail(e: &Error) -> c_int {
    set_errno(e.errno());
    set_layout_code(e).unwrap_or(ERR_INPUT)
}

fn input(msg: &str) -> c_int {
    fail(&Error::InvalidArgument(msg.into()))
}

fn unsupported(msg: String) -> c_int {
    fail(&Error::Unsupported(msg))
}

/// The flags, or the result for unknown bits (a capability this library does not have).
fn flags_of(flags: c_int) -> Result<SetLayoutFlags, c_int> {
    SetLayoutFlags::from_bits(flags as u32)
        .ok_or_else(|| unsupported(format!("unknown set-layout flags {flags:#x}")))
}

/// A count from C: negative is an input error, above `max` needs a capability the device
/// lacks (checked before reading the caller's array). The limits are
/// `LayoutCaps::DEFAULT`, which is what every softverbs device reports
/// (`Device::layout_caps`); the NIC checks again with the device's own.
fn count(n: c_int, max: u32, what: &str) -> Result<usize, c_int> {
    let Ok(n) = u32::try_from(n) else {
        return Err(input(&format!("negative {what}")));
    };
    if n > max {
        return Err(unsupported(format!("{n} {what} exceed the device's {max}")));
    }
    Ok(n as usize)
}

fn datum(s: &ibv_sge) -> Datum {
    Datum::new(s.lkey, s.addr, u64::from(s.length))
}

/// Set-layout calls, one at a time, so their updates of C `struct ibv_mr` fields never race.
static SET_LAYOUT: Mutex<()> = Mutex::new(());

/// Runs the NIC call on a live layout MR and brings the C struct's keys and length up to
/// date (the keys change when the layout needs more room, unless `AVOID_INVALIDATION`).
fn set_layout(mr: *mut ibv_mr, flags: SetLayoutFlags, layout: Layout) -> c_int {
    let _one = SET_LAYOUT.lock().unwrap_or_else(|e| e.into_inner());
    with_live_mr(mr, |c, nic: &Mr| {
        // Length of what was set: with WITH_POST_WR the staged layout's (in force once the
        // bind work request executes), the NIC's only counting layouts in force.
        let staged_len = flags
            .contains(SetLayoutFlags::WITH_POST_WR)
            .then(|| {
                layout
                    .compile(flags, &LayoutCaps::DEFAULT)
                    .ok()
                    .map(|l| l.len())
            })
            .flatten();
        let r = nic.set_layout(flags, LayoutSource::Layout { flags, layout });
        let key = nic.key();
        let len = staged_len.unwrap_or(nic.len() as u64) as usize;
        // SAFETY: a live MR of ours; field writes are serialized by SET_LAYOUT, and a re-key
        // may have happened even when a later step failed, so the keys are refreshed always.
        unsafe {
            (*c).lkey = key;
            (*c).rkey = key;
            (*c).handle = key;
            if r.is_ok() {
                (*c).length = len;
            }
        }
        match r {
            Ok(()) => 0,
            Err(e) => fail(&e),
        }
    })
    .unwrap_or_else(|| input("not a live memory region of this library"))
}

/// `ibv_mr_set_layout_sg` (seed 002): `mr` (a container from
/// `ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED)`) becomes the data of `sg_list`, back to
/// back. Returns 0, or the seed's `IBV_MR_SET_LAYOUT_ERR_*` with errno set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_mr_set_layout_sg(
    mr: *mut ibv_mr,
    flags: c_int,
    num_sges: c_int,
    sg_list: *const ibv_sge,
) -> c_int {
    let flags = match flags_of(flags) {
        Ok(f) => f,
        Err(rc) => return rc,
    };
    let n = match count(num_sges, LayoutCaps::DEFAULT.max_sg, "SGEs") {
        Ok(n) => n,
        Err(rc) => return rc,
    };
    if n > 0 && sg_list.is_null() {
        return input("NULL sg_list");
    }
    let list = if n == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller's array of `num_sges` SGEs, not NULL.
        unsafe { std::slice::from_raw_parts(sg_list, n) }
            .iter()
            .map(datum)
            .collect()
    };
    set_layout(mr, flags, Layout::Sg(list))
}

/// `ibv_mr_set_layout_interleaved` (seed 002): `mr` becomes the round-robin of the entries'
/// strided data. Returns 0, or the seed's `IBV_MR_SET_LAYOUT_ERR_*` with errno set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_mr_set_layout_interleaved(
    mr: *mut ibv_mr,
    flags: c_int,
    num_interleaved: c_int,
    interleaved_list: *const ibv_mr_layout_interleaved,
) -> c_int {
    let caps = LayoutCaps::DEFAULT;
    let flags = match flags_of(flags) {
        Ok(f) => f,
        Err(rc) => return rc,
    };
    let n = match count(num_interleaved, caps.max_interleaved, "interleaved entries") {
        Ok(n) => n,
        Err(rc) => return rc,
    };
    if n > 0 && interleaved_list.is_null() {
        return input("NULL interleaved_list");
    }
    let entries = if n == 0 {
        &[][..]
    } else {
        // SAFETY: the caller's array of `num_interleaved` entries, not NULL.
        unsafe { std::slice::from_raw_parts(interleaved_list, n) }
    };
    let mut list = Vec::with_capacity(n);
    for e in entries {
        let Ok(rep) = u32::try_from(e.num_repeated) else {
            return input("negative num_repeated");
        };
        let nd = match count(e.num_dimensions, caps.max_dims, "dimensions") {
            Ok(nd) => nd,
            Err(rc) => return rc,
        };
        if nd > 0 && e.dims.is_null() {
            return input("NULL dims");
        }
        let dims = if nd == 0 {
            Vec::new()
        } else {
            // SAFETY: the entry's array of `num_dimensions` dimensions, not NULL.
            unsafe { std::slice::from_raw_parts(e.dims, nd) }
                .iter()
                .map(|d| Dim::new(d.offset_stride, d.datum_count))
                .collect()
        };
        list.push(InterleavedEntry::new(datum(&e.first_datum), dims).repeated(rep));
    }
    set_layout(mr, flags, Layout::Interleaved(list))
}

/// `ibv_query_mr_layout_caps`: the seed's `mr_layout_caps` of `ibv_query_device_ex`, which
/// the shipped `struct ibv_device_attr_ex` has no field for. 0, or EINVAL for a NULL or
/// unknown context or a NULL `caps`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_mr_layout_caps(
    ctx: *mut ibv_context,
    caps: *mut ibv_mr_layout_caps,
) -> c_int {
    if caps.is_null() {
        return libc::EINVAL;
    }
    let Some(c) = with_live_ctx(ctx, |c| c.device().attr().mr_layout_caps) else {
        return libc::EINVAL;
    };
    let out = ibv_mr_layout_caps {
        cap_flags: c.cap_flags.bits(),
        max_num_sg: c.max_sg,
        max_inline_num_sg: c.max_inline_sg,
        max_num_interleaved: c.max_interleaved,
        max_inline_num_interleaved: c.max_inline_interleaved,
        max_mr_stride_dimension: c.max_dims,
        max_mr_nesting_level: c.max_nesting_level,
    };
    // SAFETY: the caller's writable struct, not NULL.
    unsafe { caps.write(out) };
    0
}

/// `ibv_reg_mr_pages`: `length` bytes from `first_offset` into `pages[0]` on through
/// `pages[1..num_pages]`, each a `page_size`-aligned page anywhere in this process, seen at
/// IOVA `iova` (0 with `IBV_ACCESS_ZERO_BASED`): the NIC's `Pd::reg_mr_pages`. NULL with
/// errno EINVAL for a NULL `pd` or `pages`, no pages, or a list the NIC refuses.
///
/// # Safety
/// `pd` is a live PD of this library; `pages` holds `num_pages` pointers; every page stays
/// valid until `ibv_dereg_mr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_reg_mr_pages(
    pd: *mut ibv_pd,
    pages: *const *mut c_void,
    num_pages: usize,
    page_size: usize,
    first_offset: usize,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    // SAFETY: the caller's.
    let Some((nic, pages)) = (unsafe { pd_and_array(pd, pages, num_pages) }) else {
        return inval();
    };
    let list: Vec<u64> = pages.iter().map(|&p| p as usize as u64).collect();
    // SAFETY: the pages stay valid until ibv_dereg_mr (the caller's contract, as verbs asks
    // of any registered buffer).
    let r = unsafe {
        nic.reg_mr_pages(
            &list,
            page_size as u64,
            first_offset as u64,
            length as u64,
            iova,
            access,
        )
    };
    region_to_c(pd, r)
}

/// `ibv_reg_mr_bitmap`: page `i` at `base + i * page_size` belongs to the region when bit
/// `i % 64` of `bitmap[i / 64]` is set (`num_words` words); the selected pages in order, seen
/// at IOVA `iova` (0 with `IBV_ACCESS_ZERO_BASED`): the NIC's `Pd::reg_mr_bitmap`. NULL with
/// errno EINVAL for a NULL `pd` or `bitmap`, no words, or a map the NIC refuses.
///
/// # Safety
/// `pd` is a live PD of this library; `bitmap` holds `num_words` words; every selected page
/// stays valid until `ibv_dereg_mr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_reg_mr_bitmap(
    pd: *mut ibv_pd,
    base: *mut c_void,
    page_size: usize,
    bitmap: *const u64,
    num_words: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    // SAFETY: the caller's.
    let Some((nic, words)) = (unsafe { pd_and_array(pd, bitmap, num_words) }) else {
        return inval();
    };
    // SAFETY: the selected pages stay valid until ibv_dereg_mr (the caller's contract).
    let r =
        unsafe { nic.reg_mr_bitmap(base as usize as u64, page_size as u64, words, iova, access) };
    region_to_c(pd, r)
}

/// The NIC PD and the `n`-element array at `ptr` of a registration call; None (EINVAL) for a
/// NULL PD or array, or no elements.
///
/// # Safety
/// `pd` is NULL or a live PD of this library; `ptr` is NULL or holds `n` elements.
unsafe fn pd_and_array<'a, T>(
    pd: *mut ibv_pd,
    ptr: *const T,
    n: usize,
) -> Option<(&'a std::sync::Arc<softverbs_nic::pd::Pd>, &'a [T])> {
    // SAFETY: the caller's.
    let nic = unsafe { nic_pd(pd) }?;
    if ptr.is_null() || n == 0 || n > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return None;
    }
    // SAFETY: the caller's: `n` elements at `ptr`.
    Some((nic, unsafe { core::slice::from_raw_parts(ptr, n) }))
}

/// A page-list or bitmap registration handed to C: `addr` is the IOVA its SGEs use.
fn region_to_c(pd: *mut ibv_pd, r: softverbs_nic::Result<Mr>) -> *mut ibv_mr {
    match r {
        Ok(mr) => {
            let (addr, len) = (mr.iova() as usize as *mut c_void, mr.len());
            // SAFETY: `pd` is a live PD of ours (checked by the callers).
            new_mr(unsafe { (*pd).context }, pd, addr, len, mr, None)
        }
        Err(e) => null(e),
    }
}
