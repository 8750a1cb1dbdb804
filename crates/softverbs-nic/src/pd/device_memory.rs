//! Device memory (`ibv_alloc_dm`): memory "on the device" that the program reaches only
//! through copies and zero-based regions (`ibv_reg_dm_mr`). A software NIC's device memory
//! is a shared-memory segment, so peers in other processes (and the host engine) map a
//! region in it as they map any shared region.

use super::{Mr, Pd};
use crate::device::Context;
use crate::device_memory::segment::{Segment, page_size};
use crate::error::{Error, Result, inval};
use crate::mr::keys::Backing;
use crate::types::AccessFlags;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use crate::device::MAX_DM_SIZE;

/// Device memory allocated and not yet freed in this process.
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

/// Device memory. Dropping it frees it (a region in it keeps its bytes until it goes).
pub struct DeviceMemory {
    seg: Arc<Segment>,
    len: usize,
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        ALLOCATED.fetch_sub(self.len, Ordering::AcqRel);
    }
}

impl Context {
    /// `ibv_alloc_dm`: `len` bytes (1..=[`MAX_DM_SIZE`] in all), aligned to `2^log_align`
    /// (up to a page: segments are page-aligned, nothing coarser is offered).
    pub fn alloc_dm(&self, len: usize, log_align: u32) -> Result<DeviceMemory> {
        if len == 0 || log_align >= usize::BITS || 1usize << log_align > page_size() {
            return Err(inval("device memory: length 0, or alignment over a page"));
        }
        ALLOCATED
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                n.checked_add(len).filter(|&t| t <= MAX_DM_SIZE)
            })
            .map_err(|_| {
                Error::NoResources(format!(
                    "{len} bytes of device memory: {MAX_DM_SIZE} in all"
                ))
            })?;
        match Segment::create_file("softverbs-dm", len) {
            Ok(s) => Ok(DeviceMemory {
                seg: Arc::new(s),
                len,
            }),
            Err(e) => {
                ALLOCATED.fetch_sub(len, Ordering::AcqRel);
                Err(e)
            }
        }
    }
}

impl DeviceMemory {
    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: device memory has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A number that names it (`ibv_dm::handle`).
    pub fn handle(&self) -> u32 {
        self.seg.inode() as u32
    }

    /// True while a region lies in it (`ibv_free_dm` is EBUSY then).
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.seg) > 1
    }

    fn at(&self, offset: u64, len: usize) -> Result<*mut u8> {
        let off = usize::try_from(offset).map_err(|_| inval("device memory offset"))?;
        match off.checked_add(len) {
            // SAFETY: in bounds of the segment, checked here.
            Some(end) if end <= self.len => Ok(unsafe { self.seg.as_ptr().add(off) }),
            _ => Err(inval(format!(
                "{len} bytes at {offset} of {} bytes of device memory",
                self.len
            ))),
        }
    }

    /// `ibv_memcpy_to_dm`.
    pub fn copy_to(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.at(offset, data.len())?;
        // SAFETY: inside the segment; RDMA into it may be concurrent, as on hardware, and
        // copies bytes only (no references into the segment exist).
        unsafe { std::ptr::copy(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// `ibv_memcpy_from_dm`.
    pub fn copy_from(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.at(offset, out.len())?;
        // SAFETY: as in `copy_to`.
        unsafe { std::ptr::copy(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

/// What a region in device memory holds so the bytes outlive a free of the memory.
pub struct DmHold(#[allow(dead_code)] Arc<Segment>);

impl Pd {
    /// `ibv_reg_dm_mr`: a zero-based region (`ZERO_BASED` is required, as the man page says)
    /// over `len` bytes of `dm` from `offset`. Peers map the segment, so it takes remote
    /// atomics too. The hold keeps the bytes mapped for as long as the region lives.
    pub fn reg_dm_mr(
        self: &Arc<Self>,
        dm: &DeviceMemory,
        offset: u64,
        len: usize,
        access: u32,
    ) -> Result<(Mr, DmHold)> {
        if access & AccessFlags::ZERO_BASED.bits() == 0 || len == 0 {
            return Err(inval("a device-memory region is zero-based and not empty"));
        }
        let host = dm.at(offset, len)?;
        let backing = Backing {
            fd: std::os::fd::AsRawFd::as_raw_fd(&dm.seg.fd()),
            ino: dm.seg.inode(),
            offset,
        };
        // SAFETY: the bytes are the segment's, which the hold keeps mapped.
        let mr = unsafe { self.reg_mr(host as usize, len, 0, access, Some(backing)) }?;
        Ok((mr, DmHold(dm.seg.clone())))
    }
}
