//! Registered memory of another process on this host, reached from this one: a region in a
//! `memfd` is mapped (once per descriptor), plain process memory is read and written by
//! cross-memory attach. The process is the region's owner as its key entry names it, so a
//! table that holds the regions of several processes (a shared PD's) is placed right.

use crate::device_memory::segment::Segment;
use crate::error::{Error, Result};
use crate::mr::access::Span;
use crate::mr::keys::Pin;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

/// The other processes' `memfd`s mapped so far, by (owner pid, descriptor, inode).
#[derive(Default)]
pub(crate) struct PeerMemory {
    /// The first files mapped, found without a lock: the QPs of a peer process mostly reach
    /// a few of its files (a lock and a hash per operation were 7% of a 64-byte WRITE).
    first: [std::sync::OnceLock<(FileId, Arc<Segment>)>; LOCK_FREE_FILES],
    /// All of them; read-locked, so that the threads of a process whose QPs reach more
    /// files than `first` holds do not queue behind each other.
    maps: RwLock<HashMap<FileId, Arc<Segment>>>,
}

/// A process's file: its pid, the descriptor number there, the inode.
type FileId = (u32, i32, u64);

/// Files of a [`PeerMemory`] found without its lock (one is the common case: a scan stops
/// at the first slot that matches or is empty).
const LOCK_FREE_FILES: usize = 16;

impl PeerMemory {
    /// Where `len` bytes at the owner's address `host` of the pinned region are for this
    /// process: a mapping of the owner's `memfd`, or (plain process memory) the owner's
    /// address, reached with cross-memory attach. `host` is inside `pin`'s registration (or,
    /// for a layout container's pin, a plain buffer of its layout, which has no backing).
    ///
    /// Inlined, with the first files' scan only: returned through memory, its `Span` was read
    /// back before the stores that wrote it could forward (a tenth of a 64-byte WRITE's time
    /// on AMD Zen); mapping a file is [`locate_slow`](Self::locate_slow)'s.
    #[inline(always)]
    pub(crate) fn locate(&self, pin: &Pin<'_>, host: usize, len: usize) -> Result<Span> {
        let pid = pin.owner_pid();
        let Some(b) = pin.backing_at(host) else {
            return Ok(Span::at(host, len, pid));
        };
        let key = (pid, b.fd, b.ino);
        for slot in &self.first {
            match slot.get() {
                Some((k, seg)) if *k == key => return within(seg, b.offset, len),
                Some(_) => {}
                None => break,
            }
        }
        self.locate_slow(key, b.offset, len)
    }

    /// The rest of [`locate`](Self::locate): the files past the lock-free ones, and mapping
    /// a file seen for the first time.
    #[cold]
    #[inline(never)]
    fn locate_slow(&self, key: FileId, offset: u64, len: usize) -> Result<Span> {
        if let Some(seg) = self
            .maps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return within(seg, offset, len);
        }
        let mut maps = self.maps.write().unwrap_or_else(|e| e.into_inner());
        if let Some(seg) = maps.get(&key) {
            return within(seg, offset, len);
        }
        let (pid, fd, ino) = key;
        let seg = Arc::new(Segment::open_peer_file(pid, fd, ino)?);
        maps.insert(key, seg.clone());
        // Under the lock, so each file takes one slot at most.
        if let Some(slot) = self.first.iter().find(|s| s.get().is_none()) {
            let _ = slot.set((key, seg.clone()));
        }
        within(&seg, offset, len)
    }
}

/// `len` bytes at `offset` of the mapped file `seg`, if the file holds them.
#[inline(always)]
fn within(seg: &Segment, offset: u64, len: usize) -> Result<Span> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= seg.len() as u64 => {
            Ok(Span::local(seg.as_ptr() as usize + offset as usize, len))
        }
        _ => Err(outside_memfd()),
    }
}

#[cold]
fn outside_memfd() -> Error {
    Error::InvalidArgument("peer registration outside its memfd".into())
}
