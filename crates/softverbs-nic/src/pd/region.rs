//! Memory regions: registration, layout containers and page-list registrations, and setting
//! a non-contiguous layout on a container.

use super::Pd;
use crate::device::{Counted, InUse, Resource};
use crate::error::{Error, Result, inval};
use crate::mr::container::{LayoutState, MrShared};
use crate::mr::layout::{Layout, LayoutCaps, LayoutError, Replacement, SetLayoutFlags};
use crate::mr::store::{LayoutSource, Prepared, set_layout_error};
use crate::types::AccessFlags;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

impl Pd {
    /// Registers `len` bytes at `addr`, addressed by the peer as `iova` (ignored for
    /// `ZERO_BASED`, whose IOVAs start at 0). With `ON_DEMAND` the pages need not be mapped
    /// (an access to one that is not is an error completion); `addr` 0 and `len`
    /// `usize::MAX` with `ON_DEMAND` is an implicit on-demand region over the whole address
    /// space (IOVA = address).
    ///
    /// # Safety
    /// `addr..addr + len` must stay valid for reads and writes, and not be freed or remapped,
    /// until the returned `Mr` is dropped; the NIC writes it whenever a peer's operation
    /// targets it.
    pub unsafe fn reg_mr(
        self: &Arc<Self>,
        addr: usize,
        len: usize,
        iova: u64,
        access: u32,
        backing: Option<crate::mr::keys::Backing>,
    ) -> Result<Mr> {
        self.own_keys()?;
        let effective = Self::effective_access(access)?;
        let dev = &self.ctx.dev;
        let implicit = effective.contains(AccessFlags::ON_DEMAND) && addr == 0 && len == usize::MAX;
        if implicit && effective.contains(AccessFlags::ZERO_BASED) {
            return Err(inval("an implicit on-demand region cannot be zero-based"));
        }
        if !implicit && len as u64 > dev.config.limits.max_mr_size {
            return Err(inval(format!(
                "length {len} exceeds max_mr_size {}",
                dev.config.limits.max_mr_size
            )));
        }
        if addr.checked_add(len).is_none() {
            return Err(inval("address range wraps"));
        }
        let iova = if effective.contains(AccessFlags::ZERO_BASED) {
            0
        } else {
            iova
        };
        if iova.checked_add(len as u64).is_none() {
            return Err(inval("IOVA range wraps"));
        }
        let count = dev.acquire(Resource::Mr)?;
        let key = dev
            .keys
            .register(self.id, addr as u64, len as u64, iova, effective, backing)?;
        Ok(Mr {
            shared: Arc::new(MrShared {
                key: AtomicU32::new(key),
                len: AtomicU64::new(len as u64),
                pd: self.id,
                layout: None,
            }),
            pd: self.clone(),
            addr,
            iova,
            access: effective,
            _pd_use: self.users.add(),
            _count: count,
        })
    }

    /// Creates a layout container: a zero-length `ZERO_BASED` region (the flag is added if
    /// missing) to give a non-contiguous layout with [`Mr::set_layout`]. Its rights are the
    /// ones every access through it needs (on top of the rights of the regions its layout
    /// uses), and the ones plain buffers of `REGISTER_BUFFERS` layouts are registered with.
    pub fn create_layout_mr(self: &Arc<Self>, access: u32) -> Result<Mr> {
        self.layout_container(0, access | AccessFlags::ZERO_BASED.bits())
    }

    fn layout_container(self: &Arc<Self>, iova: u64, access: u32) -> Result<Mr> {
        // SAFETY: a zero-length registration covers no memory.
        let mut mr = unsafe { self.reg_mr(0, 0, iova, access, None)? };
        let shared = Arc::new(MrShared {
            key: AtomicU32::new(mr.key()),
            len: AtomicU64::new(0),
            pd: self.id,
            layout: Some(Mutex::new(LayoutState::default())),
        });
        mr.shared = shared.clone();
        self.ctx.dev.layouts.register(mr.key(), &shared);
        Ok(mr)
    }

    /// A page-list registration (the seed thread's paravirtual case): `length` bytes starting
    /// `first_offset` into `pages[0]` and continuing through `pages[1]`, ... (each a
    /// `page_size`-aligned host address, `page_size` a power of two), seen by peers at `iova`
    /// (0 with `ZERO_BASED`). The pages need not be contiguous or in order.
    ///
    /// # Safety
    /// Every page the registration reaches must stay valid for reads and writes until the
    /// returned `Mr` is dropped.
    pub unsafe fn reg_mr_pages(
        self: &Arc<Self>,
        pages: &[u64],
        page_size: u64,
        first_offset: u64,
        length: u64,
        iova: u64,
        access: u32,
    ) -> Result<Mr> {
        self.reg_pages_layout(
            LayoutSource::Pages {
                pages: pages.to_vec(),
                page_size,
                first_offset,
                length,
            },
            iova,
            access,
        )
    }

    /// A bitmap page registration: page `i` (at `base + i * page_size`) is in the region when
    /// bit `i % 64` of `bitmap[i / 64]` is set; the region is the set pages in order, seen by
    /// peers at `iova` (0 with `ZERO_BASED`).
    ///
    /// # Safety
    /// Every selected page must stay valid for reads and writes until the returned `Mr` is
    /// dropped.
    pub unsafe fn reg_mr_bitmap(
        self: &Arc<Self>,
        base: u64,
        page_size: u64,
        bitmap: &[u64],
        iova: u64,
        access: u32,
    ) -> Result<Mr> {
        self.reg_pages_layout(
            LayoutSource::Bitmap {
                base,
                page_size,
                bitmap: bitmap.to_vec(),
            },
            iova,
            access,
        )
    }

    fn reg_pages_layout(self: &Arc<Self>, src: LayoutSource, iova: u64, access: u32) -> Result<Mr> {
        let compiled = src
            .compile(
                &LayoutCaps::DEFAULT,
                |_| None::<&crate::mr::layout::Compiled>,
            )
            .map_err(set_layout_error)?;
        let max = self.ctx.dev.config.limits.max_mr_size;
        if compiled.len() > max {
            return Err(inval(format!(
                "length {} exceeds max_mr_size {max}",
                compiled.len()
            )));
        }
        if iova.checked_add(compiled.len()).is_none() {
            return Err(inval("IOVA range wraps"));
        }
        let mr = self.layout_container(iova, access)?;
        mr.install(&src, compiled, true, SetLayoutFlags::empty())?;
        Ok(mr)
    }
}

/// A registered memory region. Dropping it deregisters the key, waiting for any access in
/// flight to finish.
pub struct Mr {
    shared: Arc<MrShared>,
    pd: Arc<Pd>,
    addr: usize,
    iova: u64,
    access: AccessFlags,
    _pd_use: InUse,
    _count: Counted,
}

impl Mr {
    /// The key (`lkey` and `rkey` are the same value). A layout container's key changes
    /// when a new layout needs more room (see [`Mr::set_layout`]).
    #[inline]
    pub fn key(&self) -> u32 {
        self.shared.key.load(Ordering::Acquire)
    }
    /// Start address in this process (0 for layout containers, whose bytes are elsewhere).
    #[inline]
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Length in bytes (a layout container's: its layout's length, 0 before any).
    #[inline]
    pub fn len(&self) -> usize {
        self.shared.len.load(Ordering::Acquire) as usize
    }
    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// IOVA of the first byte.
    #[inline]
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// The access rights that took effect.
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// The protection domain.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }
    /// True for a layout container ([`Pd::create_layout_mr`], page-list registrations).
    #[inline]
    pub fn is_layout(&self) -> bool {
        self.shared.layout.is_some()
    }

    /// `ibv_dereg_mr`'s check: [`Error::Busy`] (EBUSY) while a layout of this device uses
    /// the region (deregister or re-lay-out that container first). Dropping the `Mr`
    /// deregisters regardless; a layout that still names the key then fails its accesses
    /// with protection/remote-access errors instead of touching freed memory.
    pub fn check_dereg(&self) -> Result<()> {
        let dev = &self.pd.ctx.dev;
        let windows = dev.keys.windows_on(self.key());
        if windows > 0 {
            return Err(Error::Busy(format!(
                "memory region {:#x} has {windows} memory window(s) bound to it",
                self.key()
            )));
        }
        let users = dev.layouts.users(self.key());
        if users > 0 {
            return Err(Error::Busy(format!(
                "memory region {:#x} is used by {users} non-contiguous layout(s)",
                self.key()
            )));
        }
        Ok(())
    }
}

impl Mr {
    /// `ibv_mr_set_layout_sg` / `ibv_mr_set_layout_interleaved` on a layout container.
    ///
    /// Every datum's key must be a region of this PD (or, with `REGISTER_BUFFERS`,
    /// [`PLAIN_KEY`](crate::mr::layout::PLAIN_KEY) for a plain buffer of this process, which the
    /// caller keeps valid while the layout uses it) and the datum inside it; a key that is
    /// itself a layout container nests, up to `max_nesting_level`. Errors (the old layout
    /// stays in force): `InvalidArgument` (`IBV_MR_SET_LAYOUT_ERR_INPUT`), `Busy` (the layout
    /// needs more room and `AVOID_INVALIDATION` was given:
    /// `IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE`), `Unsupported`
    /// (`IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED`); see [`crate::mr::store::set_layout_code`].
    ///
    /// Without `AVOID_INVALIDATION` a layout that needs more room than the key entry has
    /// gets a new key: [`Mr::key`] changes and the old key stops working at once. With
    /// `WITH_POST_WR` the layout is only staged; it takes effect when a
    /// [`SendOp::BindLayout`](crate::qp::wr::SendOp::BindLayout) for this key executes (a re-key
    /// still happens in this call, the new key carrying the old layout until then).
    pub fn set_layout(&self, flags: SetLayoutFlags, src: LayoutSource) -> Result<()> {
        let input = |m: String| set_layout_error(LayoutError::Input(m));
        if self.shared.layout.is_none() {
            return Err(input(
                "not a layout container (create one with create_layout_mr)".into(),
            ));
        }
        let LayoutSource::Layout { layout, .. } = &src else {
            return Err(input("page layouts are given at registration".into()));
        };
        let key = self.key();
        let data: Vec<u32> = match layout {
            Layout::Sg(list) => list.iter().map(|d| d.key).collect(),
            Layout::Interleaved(list) => list.iter().map(|e| e.first.key).collect(),
        };
        if data.contains(&key) {
            return Err(input(format!("the layout of {key:#x} refers to itself")));
        }
        let dev = &self.pd.ctx.dev;
        let caps = dev.layout_caps();
        // Compiled without holding this MR's lock: nested lookups lock other containers.
        let compiled = layout
            .compile_nested(flags, &caps, |k| dev.layouts.current(k))
            .map_err(set_layout_error)?;
        for d in compiled.spans() {
            if d.key == crate::mr::layout::PLAIN_KEY {
                continue;
            }
            let info = dev.keys.info(d.key).ok_or_else(|| {
                input(format!(
                    "key {:#x} is not a registered memory region",
                    d.key
                ))
            })?;
            if info.pd != self.pd.id {
                return Err(input(format!(
                    "key {:#x} belongs to another protection domain",
                    d.key
                )));
            }
            // Nested layouts were bounds-checked by the compiler; plain regions here.
            if dev.layouts.current(d.key).is_none() {
                let inside = d
                    .addr
                    .checked_sub(info.iova)
                    .and_then(|o| o.checked_add(d.len))
                    .is_some_and(|end| end <= info.length);
                if !inside {
                    return Err(input(format!(
                        "bytes {:#x}+{} are outside key {:#x} ({} bytes at {:#x})",
                        d.addr, d.len, d.key, info.length, info.iova
                    )));
                }
            }
        }
        let max = dev.config.limits.max_mr_size;
        if compiled.len() > max {
            return Err(set_layout_error(LayoutError::Unsupported(format!(
                "layout of {} bytes exceeds max_mr_size {max}",
                compiled.len()
            ))));
        }
        let stored = LayoutSource::Layout {
            flags: flags & SetLayoutFlags::REGISTER_BUFFERS,
            layout: layout.clone(),
        };
        self.install(&stored, compiled, false, flags)
    }

    /// Stores a validated layout: staged (`WITH_POST_WR`) or published now. `fresh` skips
    /// the room check (a container being created has no key anyone knows yet).
    fn install(
        &self,
        src: &LayoutSource,
        compiled: crate::mr::layout::Compiled,
        fresh: bool,
        flags: SetLayoutFlags,
    ) -> Result<()> {
        let dev = &self.pd.ctx.dev;
        let state = self
            .shared
            .layout
            .as_ref()
            .ok_or_else(|| inval("not a layout container"))?;
        let prepared = Prepared::new(src, compiled)?;
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        let rep = if fresh {
            Replacement {
                invalidates: false,
                room: prepared.compiled.slots(),
            }
        } else {
            dev.layout_caps()
                .check_replace(flags, st.room, &prepared.compiled)
                .map_err(set_layout_error)?
        };
        if rep.invalidates {
            self.rekey(&st)?;
        }
        st.room = rep.room;
        dev.layouts.acquire(&prepared.refs);
        if flags.contains(SetLayoutFlags::WITH_POST_WR) {
            if let Some(old) = st.staged.replace(prepared) {
                dev.layouts.release(&old.refs);
            }
            return Ok(());
        }
        if let Err(e) = prepared.publish(&dev.keys, self.key()) {
            dev.layouts.release(&prepared.refs);
            return Err(e);
        }
        self.shared
            .len
            .store(prepared.compiled.len(), Ordering::Release);
        if let Some(old) = st.current.replace(prepared) {
            dev.layouts.release(&old.refs);
        }
        Ok(())
    }

    /// Moves the container to a new key (the old one stops working), keeping its layout.
    fn rekey(&self, st: &LayoutState) -> Result<()> {
        let dev = &self.pd.ctx.dev;
        let old = self.key();
        let info = dev
            .keys
            .info(old)
            .ok_or_else(|| Error::NotFound(format!("memory key {old:#x}")))?;
        let new = dev.keys.register(
            info.pd,
            info.addr,
            info.length,
            info.iova,
            info.access,
            None,
        )?;
        // No sweep of the senders (see `KeyTable::pin_key`) for a container's keys: `old`
        // carries a layout, so a request's own pin of it answers `Layout` and reads nothing
        // (the layout's pieces are counted pins), and `new` was never handed out. The sweep,
        // under this layout lock, could wait for a QP whose bind of this container waits for
        // the lock.
        let unswept = &|_| {};
        if let Some(cur) = &st.current
            && let Err(e) = cur.publish_as(&dev.keys, new, cur.generation())
        {
            let _ = dev.keys.deregister(new, unswept);
            return Err(e);
        }
        self.shared.key.store(new, Ordering::Release);
        dev.layouts.rekey(old, new, &self.shared);
        let _ = dev.keys.deregister(old, unswept);
        Ok(())
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        let dev = &self.pd.ctx.dev;
        let key = self.key();
        if let Some(state) = &self.shared.layout {
            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
            for p in [st.current.take(), st.staged.take()].into_iter().flatten() {
                dev.layouts.release(&p.refs);
            }
            dev.layouts.forget(key);
        }
        let _ = dev.keys.deregister(key, &|pd| dev.quiesce_senders(pd));
    }
}

/// What [`Pd::prefetch`] makes ready (`enum ibv_advise_mr_advice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    /// `IBV_ADVISE_MR_ADVICE_PREFETCH`: the pages, for reading.
    Read,
    /// `IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE`: the pages, writable.
    Write,
    /// `IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT`: only pages already present, which a
    /// software NIC reaches as they are: nothing to do.
    NoFault,
}

impl Pd {
    /// `ibv_advise_mr`: faults in the pages of on-demand regions of this PD that `sges`
    /// (lkeys, addresses, lengths) name, before traffic needs them.
    ///
    /// # Errors
    ///
    /// `InvalidArgument` for a key that is not an on-demand region of this PD, a range outside
    /// it, or `Write` into a region without `LOCAL_WRITE`; `BadAddress` when a page cannot be
    /// faulted in (nothing is mapped there).
    pub fn prefetch(&self, advice: Prefetch, sges: &[crate::types::Sge]) -> Result<()> {
        let need = match advice {
            Prefetch::Write => AccessFlags::LOCAL_WRITE,
            Prefetch::Read | Prefetch::NoFault => AccessFlags::empty(),
        };
        for s in sges {
            let pin = self
                .ctx
                .dev
                .keys
                .pin(s.lkey, self.id, s.addr, u64::from(s.length), need)
                .map_err(|e| inval(format!("ibv_advise_mr: lkey {:#x}: {e:?}", s.lkey)))?;
            if !pin.on_demand() {
                return Err(inval("ibv_advise_mr: not an on-demand region"));
            }
            if advice != Prefetch::NoFault && s.length > 0 {
                populate(pin.host, s.length as usize, advice == Prefetch::Write)?;
            }
        }
        Ok(())
    }
}

/// Faults in the pages under `addr..addr + len` (writable with `write`).
fn populate(addr: usize, len: usize, write: bool) -> Result<()> {
    let page = crate::device_memory::segment::page_size();
    let start = addr & !(page - 1);
    let end = addr.saturating_add(len).next_multiple_of(page);
    let advice = if write {
        libc::MADV_POPULATE_WRITE
    } else {
        libc::MADV_POPULATE_READ
    };
    // SAFETY: MADV_POPULATE_* only faults pages in; the kernel checks the range and answers
    // ENOMEM for what is not mapped instead of touching it.
    if unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) } == 0 {
        return Ok(());
    }
    match std::io::Error::last_os_error().raw_os_error() {
        // Kernels before 5.14 lack the advice: faulting the pages in for reading is what
        // cross-memory attach does anyway, page by page.
        Some(libc::EINVAL) => (start..end).step_by(page).try_for_each(|p| {
            if crate::mr::access::mapped(p, 1) {
                Ok(())
            } else {
                Err(Error::BadAddress(format!("ibv_advise_mr: page {p:#x}")))
            }
        }),
        _ => Err(Error::BadAddress(format!(
            "ibv_advise_mr: {len} bytes at {addr:#x} are not mapped"
        ))),
    }
}
