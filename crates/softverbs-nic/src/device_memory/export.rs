//! Descriptors another process can open: how device memory is handed from its owner to a peer.
//!
//! The owner names a descriptor in shared memory ([`Export`]: its number and inode, and for
//! a segment the range of the file it is); a peer opens it through `/proc/<pid>/fd/<n>`
//! ([`open_peer_fd`]) and checks the inode, so a descriptor number the owner closed and
//! reused is never mistaken for the one it named.

use super::segment::{Segment, ShmPlain};
use crate::error::{Error, Result};
use rustix::fd::OwnedFd;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// A descriptor a peer can open: the owner's fd number + 1 (0: none), its inode, and for a
/// segment where in the file it is.
#[repr(C)]
#[derive(Default)]
pub(crate) struct Export {
    fd: AtomicU32,
    _pad: AtomicU32,
    ino: AtomicU64,
    offset: AtomicU64,
    len: AtomicU64,
}

// SAFETY: repr(C), atomics only, valid when zero (no descriptor named).
unsafe impl ShmPlain for Export {}

impl Export {
    /// Names a descriptor (a doorbell): the whole file.
    pub(crate) fn set(&self, fd: i32, ino: u64) {
        self.ino.store(ino, Ordering::Relaxed);
        self.offset.store(0, Ordering::Relaxed);
        self.len.store(0, Ordering::Relaxed);
        self.fd.store(fd as u32 + 1, Ordering::Release);
    }

    /// Names a segment: its file and range.
    pub(crate) fn set_segment(&self, seg: &Segment) {
        use std::os::fd::AsRawFd;
        self.ino.store(seg.inode(), Ordering::Relaxed);
        self.offset.store(seg.offset() as u64, Ordering::Relaxed);
        self.len.store(seg.len() as u64, Ordering::Relaxed);
        self.fd
            .store(seg.fd().as_raw_fd() as u32 + 1, Ordering::Release);
    }

    fn get(&self) -> Option<(i32, u64)> {
        let fd = self.fd.load(Ordering::Acquire);
        (fd != 0).then(|| (fd as i32 - 1, self.ino.load(Ordering::Relaxed)))
    }

    /// Opens the doorbell named here by process `pid` for writing, shared with every other
    /// user of it in this process (a peer reaching thousands of our QPs rings one channel's
    /// doorbell through one descriptor); `None` if it names none.
    pub(crate) fn open_bell(&self, pid: u32) -> Result<Option<Arc<OwnedFd>>> {
        static OPEN: PeerCache<OwnedFd> = PeerCache::new();
        let Some((fd, ino)) = self.get() else {
            return Ok(None);
        };
        OPEN.get_or_open((pid, fd, ino), || open_peer_fd(pid, fd, ino, true))
            .map(Some)
    }

    /// Maps the segment named here by process `pid`; `None` if it names none. A name without
    /// a range (an older peer's, or a whole file) maps the whole file.
    pub(crate) fn open_segment(&self, pid: u32) -> Result<Option<Segment>> {
        let Some((fd, ino)) = self.get() else {
            return Ok(None);
        };
        let len = self.len.load(Ordering::Relaxed);
        if len == 0 {
            return Segment::open(open_peer_fd(pid, fd, ino, false)?).map(Some);
        }
        let offset = self.offset.load(Ordering::Relaxed);
        let as_usize = |v: u64| usize::try_from(v).map_err(|_| bad_range());
        Segment::open_peer(pid, fd, ino, as_usize(offset)?, as_usize(len)?).map(Some)
    }
}

/// What this process opened of other processes' descriptors, by (owner pid, descriptor,
/// inode), shared while anything here holds it: a peer reached through thousands of objects
/// costs one descriptor or mapping per file of its, not one per object.
pub(crate) struct PeerCache<T>(Mutex<Option<PeerMap<T>>>);

/// (owner pid, descriptor, inode) → what was opened of it.
type PeerMap<T> = HashMap<(u32, i32, u64), Weak<T>>;

impl<T> PeerCache<T> {
    pub(crate) const fn new() -> PeerCache<T> {
        PeerCache(Mutex::new(None))
    }

    /// The open `key`, or a new one from `open`.
    pub(crate) fn get_or_open(
        &self,
        key: (u32, i32, u64),
        open: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let map = map.get_or_insert_with(HashMap::new);
        if let Some(t) = map.get(&key).and_then(Weak::upgrade) {
            return Ok(t);
        }
        let t = Arc::new(open()?);
        // Forget what nobody holds any more before it piles up.
        if map.len() >= 64 && map.len().is_power_of_two() {
            map.retain(|_, w| w.strong_count() > 0);
        }
        map.insert(key, Arc::downgrade(&t));
        Ok(t)
    }
}

fn bad_range() -> Error {
    Error::InvalidArgument("peer segment: range out of reach".into())
}

/// Opens descriptor `fd` of process `pid`, checking that it is still the object with `ino`.
pub(crate) fn open_peer_fd(pid: u32, fd: i32, ino: u64, write_only: bool) -> Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let flags = if write_only {
        OFlags::WRONLY | OFlags::NONBLOCK | OFlags::CLOEXEC
    } else {
        OFlags::RDWR | OFlags::CLOEXEC
    };
    let path = format!("/proc/{pid}/fd/{fd}");
    let f = rustix::fs::open(path.as_str(), flags, Mode::empty()).map_err(|e| match e {
        rustix::io::Errno::ACCESS | rustix::io::Errno::PERM => Error::Os {
            what: "opening a peer's device memory through /proc/<pid>/fd \
                   (peers must run as the same user; check the ptrace/hidepid settings)",
            errno: e,
        },
        e => Error::os("open /proc/<pid>/fd")(e),
    })?;
    let st = rustix::fs::fstat(&f).map_err(Error::os("fstat"))?;
    if st.st_ino != ino {
        return Err(Error::NotFound(format!(
            "peer descriptor {pid}/{fd} was replaced"
        )));
    }
    Ok(f)
}
