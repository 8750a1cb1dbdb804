//! Descriptors another process can open: how device memory is handed from its owner to a peer.
//!
//! The owner names a descriptor in shared memory ([`Export`]: its number and inode); a peer
//! opens it through `/proc/<pid>/fd/<n>` ([`open_peer_fd`]) and checks the inode, so a
//! descriptor number the owner closed and reused is never mistaken for the one it named.

use super::segment::ShmPlain;
use crate::error::{Error, Result};
use rustix::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A descriptor a peer can open: the owner's fd number + 1 (0: none) and its inode.
#[repr(C)]
#[derive(Default)]
pub(crate) struct Export {
    fd: AtomicU32,
    _pad: AtomicU32,
    ino: AtomicU64,
}

// SAFETY: repr(C), atomics only, valid when zero (no descriptor named).
unsafe impl ShmPlain for Export {}

impl Export {
    pub(crate) fn set(&self, fd: i32, ino: u64) {
        self.ino.store(ino, Ordering::Relaxed);
        self.fd.store(fd as u32 + 1, Ordering::Release);
    }

    fn get(&self) -> Option<(i32, u64)> {
        let fd = self.fd.load(Ordering::Acquire);
        (fd != 0).then(|| (fd as i32 - 1, self.ino.load(Ordering::Relaxed)))
    }

    /// Opens the descriptor named here by process `pid`; `None` if it names none.
    pub(crate) fn open(&self, pid: u32, write_only: bool) -> Result<Option<OwnedFd>> {
        self.get()
            .map(|(fd, ino)| open_peer_fd(pid, fd, ino, write_only))
            .transpose()
    }
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
