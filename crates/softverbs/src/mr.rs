//! Protection domains and memory regions.
//!
//! A safe registration borrows its buffer mutably for as long as the region lives, so Rust code
//! cannot touch the bytes behind the NIC's back; it reads and writes them through the region's
//! methods, which copy with the same ordering guarantees the NIC gives (data placed by a SEND
//! or WRITE is complete once its last byte is seen, or once its completion is polled).

use crate::qp::{AddressHandle, QpInitAttr, QueuePair, SharedReceiveQueue, SrqAttr};
use crate::{
    AccessFlags, AhAttr, Datum, Error, InterleavedEntry, Layout, Result, SendOp, SetLayoutFlags,
    Sge,
};
use softverbs_nic::device_memory::segment::Segment;
use softverbs_nic::mr::store::LayoutSource;
use softverbs_nic::pd::{DeviceMemory as NicDm, DmHold, Mr, Mw, MwType, Pd, Prefetch, inc_rkey};
use softverbs_nic::qp::QpInit;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// A protection domain. Clones are handles to the same PD.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<Pd>,
    /// A parent domain's thread domain and its hold on the PD it is.
    pub(crate) parent: Option<Arc<crate::parent_domain::Parent>>,
}

impl ProtectionDomain {
    /// `ibv_reg_mr` over `buf`, which stays borrowed until the region is dropped.
    ///
    /// Access rules: unknown bits and `REMOTE_WRITE`/`REMOTE_ATOMIC` without `LOCAL_WRITE` are
    /// `Error::InvalidArgument` (EINVAL); known bits the device lacks (`FLUSH_PERSISTENT`: no
    /// persistent memory) are `Error::Unsupported`; optional bits 20..=29 the device lacks are
    /// dropped — [`MemoryRegion::access`] tells which bits took effect. `ON_DEMAND` regions
    /// are reached through cross-memory attach, so pages that are not mapped when the NIC
    /// needs them give error completions rather than faults (see
    /// [`reg_mr_raw`](Self::reg_mr_raw) for memory that need not be mapped at all).
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
        Ok(MemoryRegion::unbacked(mr))
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
    /// the completion, not by polling its last byte (see [`softverbs::nic::mr::ordering`](crate::nic::mr::ordering)).
    pub fn reg_mr_iova2<'a>(
        &self,
        buf: &'a mut [u8],
        iova: u64,
        access: u32,
    ) -> Result<MemoryRegion<'a>> {
        self.reg_mr_iova(buf, iova, AccessFlags::from_bits_retain(access))
    }

    /// Registers raw memory, as C programs do. With `ON_DEMAND` the memory need not be
    /// mapped (a page that is not, when an operation reaches it, is an error completion), and
    /// `addr` NULL with `len` `usize::MAX` is an implicit region over the whole address
    /// space, addressed by virtual address.
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
        Ok(MemoryRegion::unbacked(mr))
    }

    /// `ibv_advise_mr`: faults in the pages of on-demand regions of this PD that `sges`
    /// name (lkey, address, length), before traffic needs them. `InvalidArgument` for a key
    /// that is not an on-demand region of this PD (or `Write` without `LOCAL_WRITE`),
    /// `BadAddress` for memory that is not mapped.
    pub fn advise_mr(&self, advice: Prefetch, sges: &[Sge]) -> Result<()> {
        self.inner.prefetch(advice, sges)
    }

    /// Allocates `len` zeroed, page-aligned bytes in shared memory and registers them: the
    /// region owns its buffer.
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion<'static>> {
        // A file of its own: the buffer is the program's, page-aligned, and peers map it alone.
        let seg = Segment::create_file("softverbs-mr", len)?;
        // SAFETY: the segment is owned by the region and unmapped only after the key is
        // deregistered (fields drop in declaration order: `mr` before `_backing`).
        let mr = unsafe {
            self.inner.reg_mr(
                seg.as_ptr() as usize,
                len,
                seg.as_ptr() as u64,
                access.bits(),
                // Peer processes map the memfd and place data with plain stores.
                Some(softverbs_nic::mr::keys::Backing {
                    fd: std::os::fd::AsRawFd::as_raw_fd(&seg.fd()),
                    ino: seg.inode(),
                    offset: 0,
                }),
            )?
        };
        Ok(MemoryRegion {
            mr,
            _backing: Keep::Own(seg),
            _buf: PhantomData,
        })
    }

    /// `ibv_reg_dm_mr`: a zero-based region over `range` of device memory `dm` (its IOVA 0
    /// is the range's first byte; `ZERO_BASED` is implied). RDMA reaches it like any region,
    /// from other processes and hosts too; the program reaches its bytes through `dm`. The
    /// region keeps them until it goes, even if `dm` is freed first.
    ///
    /// ```
    /// use softverbs::*;
    /// let ctx = softverbs::devices()?[0].open()?;
    /// let pd = ctx.alloc_pd()?;
    /// let dm = ctx.alloc_dm(4096)?;
    /// let mr = pd.reg_dm_mr(&dm, 1024..2048, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    /// assert_eq!((mr.iova(), mr.len()), (0, 1024));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reg_dm_mr(
        &self,
        dm: &DeviceMemory,
        range: Range<usize>,
        access: AccessFlags,
    ) -> Result<MemoryRegion<'static>> {
        let len = range.end.saturating_sub(range.start);
        let (mr, hold) = self.inner.reg_dm_mr(
            &dm.inner,
            range.start as u64,
            len,
            (access | AccessFlags::ZERO_BASED).bits(),
        )?;
        Ok(MemoryRegion {
            mr,
            _backing: Keep::Dm(hold),
            _buf: PhantomData,
        })
    }

    /// A layout container (seed 002's `ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED)`): a
    /// zero-length, zero-based region to give a non-contiguous layout with
    /// [`MemoryRegion::set_layout_sg`] or [`MemoryRegion::set_layout_interleaved`]. After
    /// that its length is the layout's, its IOVAs run from 0, and its key works wherever a key
    /// does. `ZERO_BASED` is added to `access` if missing; `access` is what every access
    /// through the layout needs (each piece's own region is checked too).
    pub fn create_layout_mr(&self, access: AccessFlags) -> Result<MemoryRegion<'static>> {
        Ok(MemoryRegion::unbacked(
            self.inner.create_layout_mr(access.bits())?,
        ))
    }

    /// A page-list registration: `length` bytes starting `first_offset` bytes into
    /// `pages[0]` and continuing through `pages[1]`, `pages[2]`, ... — pages that need not be
    /// contiguous or in order in this process — seen by peers (and SGEs) at IOVA `iova`, or
    /// at 0 with `ZERO_BASED`. Each page is a `page_size`-aligned address (`page_size` a power
    /// of two); pages that follow each other in memory are merged. Errors: malformed lists are
    /// `InvalidArgument`.
    ///
    /// # Safety
    /// Every page the registration reaches must stay valid for reads and writes until the
    /// region is dropped, and the caller must not hold Rust references to those bytes that
    /// the NIC's writes would race with.
    pub unsafe fn reg_mr_pages(
        &self,
        pages: &[*const u8],
        page_size: usize,
        first_offset: usize,
        length: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion<'static>> {
        let pages: Vec<u64> = pages.iter().map(|p| *p as usize as u64).collect();
        // SAFETY: forwarded to the caller.
        let mr = unsafe {
            self.inner.reg_mr_pages(
                &pages,
                page_size as u64,
                first_offset as u64,
                length as u64,
                iova,
                access.bits(),
            )?
        };
        Ok(MemoryRegion::unbacked(mr))
    }

    /// A bitmap page registration for huge sparse ranges: page `i`, at `base + i *
    /// page_size`, belongs to the region when bit `i % 64` of `bitmap[i / 64]` is set (least
    /// significant bit first); the region is the selected pages in increasing order, seen at
    /// IOVA `iova` (0 with `ZERO_BASED`). `base` must be `page_size`-aligned.
    ///
    /// # Safety
    /// Every selected page must stay valid for reads and writes until the region is dropped
    /// (as for [`reg_mr_pages`](Self::reg_mr_pages)).
    pub unsafe fn reg_mr_bitmap(
        &self,
        base: *const u8,
        page_size: usize,
        bitmap: &[u64],
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion<'static>> {
        // SAFETY: forwarded to the caller.
        let mr = unsafe {
            self.inner.reg_mr_bitmap(
                base as usize as u64,
                page_size as u64,
                bitmap,
                iova,
                access.bits(),
            )?
        };
        Ok(MemoryRegion::unbacked(mr))
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
            _xrc: None,
        })
    }

    /// `ibv_alloc_mw`: an unbound memory window of this PD. Bind it with
    /// [`MemoryWindow::bind`] (posted as [`SendOp::BindMw`](crate::SendOp::BindMw)); its
    /// rkey then reaches the bound part of the region with the window's own rights.
    ///
    /// ```
    /// use softverbs::*;
    /// let ctx = softverbs::devices()?[0].open()?;
    /// let pd = ctx.alloc_pd()?;
    /// let cq = ctx.create_cq(8, None)?;
    /// let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
    /// let mw = pd.alloc_mw(MwType::Type2)?;
    /// let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq))?;
    /// qp.connect(&qp.endpoint(0)?, 0, AccessFlags::REMOTE_WRITE)?;
    /// // Remote write into bytes 1024..2048 only, through this QP only.
    /// let bind = mw.bind(&mr, 1024..2048, AccessFlags::REMOTE_WRITE);
    /// qp.post_send([SendWr::new(1, bind, &[]).flags(SendFlags::SIGNALED)])?;
    /// assert!(cq.wait_one()?.is_ok());
    /// assert_eq!(mw.rkey() & 0xff, 2); // the consumer key went up by one
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_mw(&self, kind: MwType) -> Result<MemoryWindow> {
        Ok(MemoryWindow {
            inner: self.inner.alloc_mw(kind)?,
        })
    }

    /// `ibv_create_ah`.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        Ok(AddressHandle {
            inner: self.inner.create_ah(attr)?,
        })
    }
}

/// Device memory (`struct ibv_dm`, [`Context::alloc_dm`](crate::Context::alloc_dm)): bytes
/// the program reaches through copies and RDMA through zero-based regions
/// ([`ProtectionDomain::reg_dm_mr`]). Dropping it frees it.
pub struct DeviceMemory {
    pub(crate) inner: NicDm,
}

impl DeviceMemory {
    /// Its length.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Never true: device memory has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// `ibv_memcpy_to_dm`: `InvalidArgument` past its end.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.inner.copy_to(offset as u64, data)
    }

    /// `ibv_memcpy_from_dm`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.inner.copy_from(offset as u64, out)
    }

    /// `ibv_free_dm` with its result: [`Error::Busy`] (EBUSY) while a region lies in it, and
    /// the memory is handed back. (Dropping it frees it regardless; its regions keep the
    /// bytes until they go.)
    #[allow(clippy::result_large_err)]
    pub fn free(self) -> std::result::Result<(), (DeviceMemory, Error)> {
        if self.inner.in_use() {
            return Err((
                self,
                Error::Busy("a region lies in this device memory".into()),
            ));
        }
        Ok(())
    }
}

/// A memory window (`struct ibv_mw`). Dropping it unbinds and frees it.
pub struct MemoryWindow {
    inner: Mw,
}

impl MemoryWindow {
    /// The window's rkey: the one the last bind made for it ([`bind`](Self::bind)), which
    /// reaches the bound range once that bind has executed.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey()
    }

    /// Type 1 or 2.
    pub fn kind(&self) -> MwType {
        self.inner.kind()
    }

    /// The bind work request for `range` (byte offsets) of `mr` with rights `access`
    /// (`REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`), with the next rkey
    /// (`ibv_inc_rkey`), which [`rkey`](Self::rkey) reports from now on. Post it on a QP of
    /// the window's PD; an empty range unbinds a type-1 window. A bind that breaks the rules
    /// completes with `MW_BIND_ERR` (the region needs `MW_BIND`, and `LOCAL_WRITE` for a
    /// writable window; a type-2 window must be free).
    pub fn bind(&self, mr: &MemoryRegion<'_>, range: Range<usize>, access: AccessFlags) -> SendOp {
        let rkey = inc_rkey(self.inner.rkey());
        self.inner.set_rkey(rkey);
        let length = range.end.saturating_sub(range.start) as u64;
        SendOp::BindMw {
            window: self.inner.handle(),
            rkey,
            mr: mr.lkey(),
            addr: if length == 0 {
                0
            } else {
                mr.iova().wrapping_add(range.start as u64)
            },
            length,
            access,
        }
    }
}

impl std::fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("kind", &self.kind())
            .finish()
    }
}

/// What a region keeps alive beside its key: the segment it owns (`alloc_mr`), or the
/// device memory it lies in.
enum Keep {
    Nothing,
    Own(#[allow(dead_code)] Segment),
    Dm(#[allow(dead_code)] DmHold),
}

/// A registered memory region. Dropping it deregisters it (after any in-flight access).
pub struct MemoryRegion<'a> {
    mr: Mr,
    _backing: Keep,
    _buf: PhantomData<&'a mut [u8]>,
}

impl<'a> MemoryRegion<'a> {
    /// A region over memory it does not own (a caller's buffer, pages, or a layout's).
    fn unbacked(mr: Mr) -> MemoryRegion<'a> {
        MemoryRegion {
            mr,
            _backing: Keep::Nothing,
            _buf: PhantomData,
        }
    }

    /// `ibv_dereg_mr` with its result: [`Error::Busy`] (EBUSY) while a memory window is bound
    /// to this region or a non-contiguous layout uses it — unbind, invalidate or free the
    /// window, or deregister or re-lay-out that layout's region first — and the region is
    /// handed back unchanged. (Dropping a region deregisters it regardless; its windows are
    /// unbound, and layouts that still name it fail their accesses with protection or
    /// remote-access errors.)
    #[allow(clippy::result_large_err)]
    pub fn dereg(self) -> std::result::Result<(), (MemoryRegion<'a>, Error)> {
        match self.mr.check_dereg() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }
}

/// `REGISTER_BUFFERS` is for the unsafe `raw` variant only: `InvalidArgument`
/// (`IBV_MR_SET_LAYOUT_ERR_INPUT`) from the safe calls.
fn refuse_register_buffers(flags: SetLayoutFlags, raw: &str) -> Result<()> {
    if flags.contains(SetLayoutFlags::REGISTER_BUFFERS) {
        return Err(Error::InvalidArgument(format!(
            "REGISTER_BUFFERS takes raw buffers: use the unsafe {raw} \
             (IBV_MR_SET_LAYOUT_ERR_INPUT, -1)"
        )));
    }
    Ok(())
}

impl MemoryRegion<'_> {
    /// True for a layout container ([`ProtectionDomain::create_layout_mr`], page lists and
    /// bitmaps): its bytes live in other regions, so the byte accessors (`read_at`,
    /// `write_at`, `fill`, `load_*`, `store_u64`) refuse it or do nothing.
    #[inline]
    pub fn is_layout(&self) -> bool {
        self.mr.is_layout()
    }

    /// `ibv_mr_set_layout_sg` (seed 002): this layout container becomes the data of `sges`
    /// back to back. Each SGE is `(addr, length, lkey)` of a region of the same PD (`addr`
    /// in that region's IOVAs, or an offset for zero-based and layout regions, which nest up
    /// to [`LayoutCaps::max_nesting_level`](crate::LayoutCaps)). Flags:
    /// `AVOID_INVALIDATION` (fail instead of changing the keys), `WITH_POST_WR` (the layout
    /// takes effect at a [`SendOp::BindLayout`](crate::SendOp::BindLayout) work request);
    /// `REGISTER_BUFFERS` needs [`set_layout_sg_raw`](Self::set_layout_sg_raw).
    ///
    /// Errors, with the old layout still in force: `InvalidArgument`
    /// (`IBV_MR_SET_LAYOUT_ERR_INPUT`: malformed input, unknown key, another PD, data outside
    /// its region, not a layout container), `Busy` (`IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE`)
    /// and `Unsupported` (`IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED`: beyond the device's
    /// [`LayoutCaps`](crate::LayoutCaps), or flag bits this library does not know);
    /// [`set_layout_code`](crate::set_layout_code) gives
    /// the seed's code.
    ///
    /// Keys: a layout with at most `max_inline_num_sg` SGEs (or no more than the region had
    /// room for before) keeps [`lkey`](Self::lkey)/[`rkey`](Self::rkey); a larger one changes
    /// them (the old ones stop working at once) unless `AVOID_INVALIDATION` makes it fail.
    pub fn set_layout_sg(&self, flags: SetLayoutFlags, sges: &[Sge]) -> Result<()> {
        refuse_register_buffers(flags, "set_layout_sg_raw")?;
        // SAFETY: without REGISTER_BUFFERS every datum is checked against the key table.
        unsafe { self.set_layout_sg_raw(flags, sges) }
    }

    /// [`set_layout_sg`](Self::set_layout_sg), also accepting `REGISTER_BUFFERS`: SGEs with
    /// lkey [`PLAIN_KEY`](crate::PLAIN_KEY) (0) are plain buffers of this process (`addr` a
    /// host address), registered with this container's access rights for as long as the
    /// layout uses them.
    ///
    /// # Safety
    /// With `REGISTER_BUFFERS`, each plain buffer must stay valid for reads and writes until
    /// this region is dropped or given another layout.
    pub unsafe fn set_layout_sg_raw(&self, flags: SetLayoutFlags, sges: &[Sge]) -> Result<()> {
        let data = sges
            .iter()
            .map(|s| Datum::new(s.lkey, s.addr, u64::from(s.length)))
            .collect();
        // SAFETY: passed on from the caller.
        unsafe { self.install_layout(flags, Layout::Sg(data)) }
    }

    /// `ibv_mr_set_layout_interleaved` (seed 002): this layout container becomes the
    /// round-robin of `entries`, each a first datum, `num_repeated` and dimensions of
    /// (`offset_stride`, `datum_count`) — see [`crate::nic::mr::layout`] for the exact reading of
    /// the seed's pseudo-code. Flags, errors and keys as for
    /// [`set_layout_sg`](Self::set_layout_sg) (`max_inline_num_interleaved` entries fit without
    /// changing the keys).
    pub fn set_layout_interleaved(
        &self,
        flags: SetLayoutFlags,
        entries: &[InterleavedEntry],
    ) -> Result<()> {
        refuse_register_buffers(flags, "set_layout_interleaved_raw")?;
        // SAFETY: without REGISTER_BUFFERS every datum is checked against the key table.
        unsafe { self.set_layout_interleaved_raw(flags, entries) }
    }

    /// [`set_layout_interleaved`](Self::set_layout_interleaved), also accepting
    /// `REGISTER_BUFFERS` (entries whose first datum has key [`PLAIN_KEY`](crate::PLAIN_KEY)
    /// stride over a plain buffer of this process).
    ///
    /// # Safety
    /// As for [`set_layout_sg_raw`](Self::set_layout_sg_raw): every byte a plain entry reaches
    /// must stay valid while the layout is in force.
    pub unsafe fn set_layout_interleaved_raw(
        &self,
        flags: SetLayoutFlags,
        entries: &[InterleavedEntry],
    ) -> Result<()> {
        // SAFETY: passed on from the caller.
        unsafe { self.install_layout(flags, Layout::Interleaved(entries.to_vec())) }
    }

    /// The common tail of the `set_layout_*_raw` calls.
    ///
    /// # Safety
    /// As for [`set_layout_sg_raw`](Self::set_layout_sg_raw).
    unsafe fn install_layout(&self, flags: SetLayoutFlags, layout: Layout) -> Result<()> {
        self.mr
            .set_layout(flags, LayoutSource::Layout { flags, layout })
    }

    /// The local key, for SGEs.
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.mr.key()
    }
    /// The remote key, for peers' RDMA operations.
    #[inline]
    pub fn rkey(&self) -> u32 {
        self.mr.key()
    }
    /// IOVA of the first byte: what SGEs and peers use as its address.
    #[inline]
    pub fn iova(&self) -> u64 {
        self.mr.iova()
    }
    /// Host address of the first byte.
    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        self.mr.addr() as *mut u8
    }
    /// Length in bytes.
    #[inline]
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
    #[inline]
    pub fn sge(&self, range: Range<usize>) -> Sge {
        Sge {
            addr: self.iova() + range.start as u64,
            length: range.len() as u32,
            lkey: self.lkey(),
        }
    }

    // Inlined (the refusals are out of line): a program spinning on `load_u8` runs it on
    // every look, and each look's cost delays seeing the byte land.
    #[inline]
    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if self.is_layout() || offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(self.refusal(offset, len));
        }
        Ok(())
    }

    #[cold]
    fn refusal(&self, offset: usize, len: usize) -> Error {
        if self.is_layout() {
            return Error::InvalidArgument(
                "a layout region has no bytes of its own: access the regions it uses".into(),
            );
        }
        Error::InvalidArgument(format!(
            "bytes {offset}..{} outside a {}-byte region",
            offset.saturating_add(len),
            self.len()
        ))
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
        if self.is_layout() {
            return; // its bytes are other regions'
        }
        // SAFETY: the whole registration, borrowed exclusively by the region.
        unsafe { std::ptr::write_bytes(self.as_ptr(), byte, self.len()) };
        std::sync::atomic::fence(Ordering::Release);
    }

    /// Reads one byte with acquire ordering: spin on the last byte of a buffer to learn that
    /// a SEND or RDMA WRITE has landed whole. That holds for strict regions only: a
    /// `RELAXED_ORDERING` region's last byte may land first, so wait for the completion.
    #[inline]
    pub fn load_u8(&self, offset: usize) -> Result<u8> {
        self.check(offset, 1)?;
        // SAFETY: in bounds; the NIC stores final bytes atomically.
        Ok(unsafe { AtomicU8::from_ptr(self.as_ptr().add(offset)) }.load(Ordering::Acquire))
    }

    /// Reads an aligned 8-byte word atomically (the target of RDMA atomics).
    #[inline]
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

    /// Copies the whole region into a vector (empty for a layout region).
    pub fn to_vec(&self) -> Vec<u8> {
        if self.is_layout() {
            return Vec::new();
        }
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
