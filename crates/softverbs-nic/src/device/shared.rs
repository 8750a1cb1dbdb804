//! Shared PDs across processes (`ibv_import_device`, `ibv_import_pd`, `ibv_import_mr`): what
//! a context's command descriptor holds, and the importer's view of the exporter.
//!
//! A context's command descriptor (`cmd_fd`) is a small segment of its own: the exporting
//! process, the device's GID, its key table (as a descriptor a peer opens through
//! `/proc/<pid>/fd`), and the PDs allocated in the context. A program passes it to another
//! process (`SCM_RIGHTS`, or inheritance); that process's [`Context::import`] maps the
//! exporter's key table, and its imported PDs check every key there, so a work request of
//! the importer's QPs reaches the exporter's regions (mapped, or by cross-memory attach: the
//! key entry names each region's owner), and peers of those QPs reach them too.

use super::{Context, Device};
use crate::device_memory::export::Export;
use crate::device_memory::segment::{Segment, ShmPlain};
use crate::error::{Error, Result, inval};
use crate::mr::keys::KeyTable;
use crate::mr::peer::PeerMemory;
use rustix::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

const MAGIC: u32 = 0x5843_5653; // "SVCX"
const VERSION: u32 = 1;
/// PDs of a context that another process can import (more are allocated, but not
/// importable: `ibv_import_pd` of one is `ENOENT`).
pub(crate) const MAX_SHARED_PDS: usize = 4096;

/// The command segment's contents.
#[repr(C)]
pub(crate) struct CtxShared {
    magic: AtomicU32,
    version: AtomicU32,
    owner_pid: AtomicU32,
    _pad: AtomicU32,
    gid: [AtomicU32; 4],
    keys: Export,
    /// The importable PDs' ids (0: a free slot).
    pds: [AtomicU32; MAX_SHARED_PDS],
}

// SAFETY: repr(C), atomics only, valid when zero.
unsafe impl ShmPlain for CtxShared {}

/// A context's command segment: created with the context, or (imported) the exporter's.
pub(crate) struct CommandSegment {
    seg: Segment,
}

impl CommandSegment {
    /// The segment of a new context on `dev`, naming this process and its key table.
    pub(crate) fn new(dev: &Device) -> Result<CommandSegment> {
        // A file of its own: programs hand `cmd_fd` to other processes as a descriptor.
        let seg = Segment::create_file("softverbs-context", std::mem::size_of::<CtxShared>())?;
        let s: &CtxShared = seg.at(0);
        s.owner_pid.store(std::process::id(), Ordering::Relaxed);
        for (w, b) in s.gid.iter().zip(dev.config.gid.0.chunks(4)) {
            w.store(
                u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
                Ordering::Relaxed,
            );
        }
        let k = dev.keys.segment();
        s.keys.set_segment(k);
        s.version.store(VERSION, Ordering::Relaxed);
        s.magic.store(MAGIC, Ordering::Release);
        Ok(CommandSegment { seg })
    }

    fn shared(&self) -> &CtxShared {
        self.seg.at(0)
    }

    /// The descriptor programs see as `cmd_fd`.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.seg.fd()
    }

    /// Records PD `id` as importable (false: no slot left).
    pub(crate) fn add_pd(&self, id: u32) -> bool {
        self.shared().pds.iter().any(|w| {
            w.compare_exchange(0, id, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })
    }

    /// PD `id` is gone.
    pub(crate) fn remove_pd(&self, id: u32) {
        if let Some(w) = self
            .shared()
            .pds
            .iter()
            .find(|w| w.load(Ordering::Acquire) == id)
        {
            w.store(0, Ordering::Release);
        }
    }

    fn has_pd(&self, id: u32) -> bool {
        id != 0
            && self
                .shared()
                .pds
                .iter()
                .any(|w| w.load(Ordering::Acquire) == id)
    }
}

/// An imported context's view of the exporting process: its key table and its memory.
pub(crate) struct Import {
    pub(crate) keys: KeyTable,
    pub(crate) memory: PeerMemory,
}

impl Context {
    /// The command descriptor (`ibv_context::cmd_fd`): pass it to another process, which
    /// imports this context with [`Context::import`] and then its PDs and regions.
    pub fn cmd_fd(&self) -> BorrowedFd<'_> {
        self.command.fd()
    }

    /// `ibv_import_device`: a context of this process on the device `cmd_fd` (another
    /// context's [`cmd_fd`](Self::cmd_fd), of this process or another on this host) was
    /// opened on, sharing that context's PDs ([`Context::import_pd`]). It has queues of its
    /// own (CQs, QPs, events); PDs it allocates are its own, not the exporter's.
    pub fn import(cmd_fd: BorrowedFd<'_>) -> Result<Arc<Context>> {
        let not_ours = || inval("cmd_fd is not the command descriptor of a softverbs context");
        let fd = rustix::io::fcntl_dupfd_cloexec(cmd_fd, 0).map_err(Error::os("dup of cmd_fd"))?;
        let seg = Segment::open(fd)?;
        if seg.len() < std::mem::size_of::<CtxShared>() {
            return Err(not_ours());
        }
        let command = CommandSegment { seg };
        let s = command.shared();
        if s.magic.load(Ordering::Acquire) != MAGIC || s.version.load(Ordering::Acquire) != VERSION
        {
            return Err(not_ours());
        }
        let mut gid = [0u8; 16];
        for (b, w) in gid.chunks_mut(4).zip(&s.gid) {
            b.copy_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes());
        }
        let dev = Device::list()?
            .into_iter()
            .find(|d| d.config.gid.0 == gid)
            .ok_or_else(|| {
                Error::NotFound("the exporter's device is not one of this process's".into())
            })?;
        let pid = s.owner_pid.load(Ordering::Relaxed);
        let table = s
            .keys
            .open_segment(pid)?
            .ok_or_else(|| inval("the exporter names no key table"))?;
        let import = Import {
            keys: KeyTable::open(table)?,
            memory: PeerMemory::default(),
        };
        Context::with(dev, command, Some(Arc::new(import)))
    }

    /// True if `pd` is a PD of the context this one was imported from, importable.
    pub(crate) fn exports_pd(&self, pd: u32) -> bool {
        self.import.is_some() && self.command.has_pd(pd)
    }
}
