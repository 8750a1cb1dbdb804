//! Protection domains and memory regions.
//!
//! A safe registration borrows its buffer mutably for as long as the region lives, so Rust code
//! cannot touch the bytes behind the NIC's back; it reads and writes them through the region's
//! methods, which copy with the same ordering guarantees the NIC gives (data placed by a SEND
//! or WRITE is complete once its last byte is seen, or once its completion is polled).

use crate::qp::{AddressHandle, QpInitAttr, QueuePair, SharedReceiveQueue, SrqAttr};
use crate::{AccessFlags, AhAttr, Error, Result, Sge};
use softverbs_nic::objects::{Mr, Pd};
use softverbs_nic::qp::QpInit;
use softverbs_nic::shm::Segment;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// A protection domain. Clones are handles to the same PD.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<Pd>,
}

impl ProtectionDomain {
    /// `ibv_reg_mr` over `buf`, which stays borrowed until the region is dropped.
    ///
    /// Access rules: unknown bits and `REMOTE_WRITE`/`REMOTE_ATOMIC` without `LOCAL_WRITE` are
    /// `Error::InvalidArgument` (EINVAL); known bits the device lacks (`MW_BIND`,
    /// `ON_DEMAND`, `FLUSH_*`) are `Error::Unsupported`; optional bits 20..=29 the device
    /// lacks are dropped — [`MemoryRegion::access`] tells which bits took effect.
    pub fn reg_mr<'a>(&self, buf: &'a mut [u8], access: AccessFlags) -> Result<MemoryRegion<'a>> {
        let addr = buf.as_mut_ptr() as usize;
        self.reg_mr_iova(buf, addr as u64, access)
    }

    /// `ibv_reg_mr_iova`: like [`reg_mr`](Self::reg_mr), but peers address the first byte as
    /// `iova` (ignored with `ZERO_BASED`, where it is 0).
    pub fn reg_mr_iova<'a>(
        &self,
        buf: &'a mut [u8],
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion<'a>> {
        // SAFETY: `buf` is borrowed mutably for 'a, the region's lifetime, so the memory stays
        // valid and nothing else in safe Rust touches it while registered.
        let mr = unsafe {
            self.inner.reg_mr(
                buf.as_mut_ptr() as usize,
                buf.len(),
                iova,
                access.bits(),
                None,
            )?
        };
        Ok(MemoryRegion {
            mr,
            _backing: None,
            _buf: PhantomData,
        })
    }

    /// `ibv_reg_mr_iova2`: registers `buf`, addressed by peers as `iova` (ignored with
    /// `ZERO_BASED`), with `access` as the raw `unsigned int` of the C call.
    ///
    /// Optional bits (20..=29, [`AccessFlags::OPTIONAL_RANGE`]) are hints: those the device
    /// implements take effect (softverbs implements
    /// [`RELAXED_ORDERING`](AccessFlags::RELAXED_ORDERING)), the others are dropped silently;
    /// [`MemoryRegion::access`] reports what took effect. Unknown bits outside that range are
    /// `Error::InvalidArgument` (EINVAL), as in [`reg_mr`](Self::reg_mr).
    ///
    /// A relaxed-ordering region may receive a message's bytes in any order: read it after
    /// the completion, not by polling its last byte (see [`softverbs::nic::ordering`](crate::nic::ordering)).
    pub fn reg_mr_iova2<'a>(
        &self,
        buf: &'a mut [u8],
        iova: u64,
        access: u32,
    ) -> Result<MemoryRegion<'a>> {
        self.reg_mr_iova(buf, iova, AccessFlags::from_bits_retain(access))
    }

    /// Registers raw memory, as C programs do.
    ///
    /// # Safety
    /// `addr..addr + len` must stay valid for reads and writes until the returned region is
    /// dropped, and the caller must not create Rust references to it that the NIC's writes
    /// would race with.
    pub unsafe fn reg_mr_raw(
        &self,
        addr: *mut u8,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion<'static>> {
        // SAFETY: forwarded to the caller.
        let mr = unsafe {
            self.inner
                .reg_mr(addr as usize, len, iova, access.bits(), None)?
        };
        Ok(MemoryRegion {
            mr,
            _backing: None,
            _buf: PhantomData,
        })
    }

    /// Allocates `len` zeroed, page-aligned bytes in shared memory and registers them: the
    /// region owns its buffer.
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion<'static>> {
        let seg = Segment::create("softverbs-mr", len)?;
        // SAFETY: the segment is owned by the region and unmapped only after the key is
        // deregistered (fields drop in declaration order: `mr` before `_backing`).
        let mr = unsafe {
            self.inner.reg_mr(
                seg.as_ptr() as usize,
                len,
                seg.as_ptr() as u64,
                access.bits(),
                // Peer processes map the memfd and place data with plain stores.
                Some(softverbs_nic::keys::Backing {
                    fd: std::os::fd::AsRawFd::as_raw_fd(&seg.fd()),
                    ino: seg.inode(),
                    offset: 0,
                }),
            )?
        };
        Ok(MemoryRegion {
            mr,
            _backing: Some(seg),
            _buf: PhantomData,
        })
    }

    /// `ibv_create_qp`.
    pub fn create_qp(&self, attr: &QpInitAttr<'_>) -> Result<QueuePair> {
        let qp = self.inner.create_qp(QpInit {
            qp_type: attr.qp_type,
            send_cq: attr.send_cq.inner.clone(),
            recv_cq: attr.recv_cq.inner.clone(),
            srq: attr.srq.map(|s| s.inner.clone()),
            cap: attr.cap,
            sq_sig_all: attr.sq_sig_all,
        })?;
        Ok(QueuePair { inner: qp })
    }

    /// `ibv_create_srq`.
    pub fn create_srq(&self, attr: SrqAttr) -> Result<SharedReceiveQueue> {
        Ok(SharedReceiveQueue {
            inner: self
                .inner
                .create_srq(attr.max_wr, attr.max_sge, attr.srq_limit)?,
        })
    }

    /// `ibv_create_ah`.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        Ok(AddressHandle {
            inner: self.inner.create_ah(attr)?,
        })
    }
}

/// A registered memory region. Dropping it deregisters it (after any in-flight access).
pub struct MemoryRegion<'a> {
    mr: Mr,
    _backing: Option<Segment>,
    _buf: PhantomData<&'a mut [u8]>,
}

impl MemoryRegion<'_> {
    /// The local key, for SGEs.
    pub fn lkey(&self) -> u32 {
        self.mr.key()
    }
    /// The remote key, for peers' RDMA operations.
    pub fn rkey(&self) -> u32 {
        self.mr.key()
    }
    /// IOVA of the first byte: what SGEs and peers use as its address.
    pub fn iova(&self) -> u64 {
        self.mr.iova()
    }
    /// Host address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mr.addr() as *mut u8
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len()
    }
    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }
    /// The access rights that took effect: the requested ones minus optional bits the
    /// device does not implement (so [`RELAXED_ORDERING`](AccessFlags::RELAXED_ORDERING)
    /// stays when asked for).
    pub fn access(&self) -> AccessFlags {
        self.mr.access()
    }

    /// An SGE covering `range` (byte offsets in the region).
    pub fn sge(&self, range: Range<usize>) -> Sge {
        Sge {
            addr: self.iova() + range.start as u64,
            length: range.len() as u32,
            lkey: self.lkey(),
        }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::InvalidArgument(format!(
                "bytes {offset}..{} outside a {}-byte region",
                offset.saturating_add(len),
                self.len()
            )));
        }
        Ok(())
    }

    /// Copies bytes out of the region.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: in bounds of a live registration; the source is never a Rust reference
        // (the buffer is borrowed by the region), so a concurrent NIC write can only change
        // which bytes are read, which the verbs contract makes the caller's concern.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    /// Copies bytes into the region.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: in bounds of a live registration, which the region borrows exclusively.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len())
        };
        std::sync::atomic::fence(Ordering::Release);
        Ok(())
    }

    /// Fills the region with `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole registration, borrowed exclusively by the region.
        unsafe { std::ptr::write_bytes(self.as_ptr(), byte, self.len()) };
        std::sync::atomic::fence(Ordering::Release);
    }

    /// Reads one byte with acquire ordering: spin on the last byte of a buffer to learn that
    /// a SEND or RDMA WRITE has landed whole. That holds for strict regions only: a
    /// `RELAXED_ORDERING` region's last byte may land first, so wait for the completion.
    pub fn load_u8(&self, offset: usize) -> Result<u8> {
        self.check(offset, 1)?;
        // SAFETY: in bounds; the NIC stores final bytes atomically.
        Ok(unsafe { AtomicU8::from_ptr(self.as_ptr().add(offset)) }.load(Ordering::Acquire))
    }

    /// Reads an aligned 8-byte word atomically (the target of RDMA atomics).
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        self.check(offset, 8)?;
        let p = self.as_ptr().wrapping_add(offset);
        if (p as usize) % 8 != 0 {
            return Err(Error::InvalidArgument("unaligned 8-byte access".into()));
        }
        // SAFETY: aligned, in bounds, and every RDMA access to it is atomic.
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) }.load(Ordering::Acquire))
    }

    /// Writes an aligned 8-byte word atomically.
    pub fn store_u64(&self, offset: usize, v: u64) -> Result<()> {
        self.check(offset, 8)?;
        let p = self.as_ptr().wrapping_add(offset);
        if (p as usize) % 8 != 0 {
            return Err(Error::InvalidArgument("unaligned 8-byte access".into()));
        }
        // SAFETY: as in `load_u64`.
        unsafe { AtomicU64::from_ptr(p.cast()) }.store(v, Ordering::Release);
        Ok(())
    }

    /// Copies the whole region into a vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read_at(0, &mut v).expect("whole region is in bounds");
        v
    }
}

impl std::fmt::Debug for MemoryRegion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("lkey", &self.lkey())
            .field("iova", &self.iova())
            .field("len", &self.len())
            .field("access", &self.access())
            .finish()
    }
}
