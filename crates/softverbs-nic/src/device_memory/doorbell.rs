//! Doorbells: how a waiting program learns that something arrived in shared memory.
//!
//! A doorbell is a non-blocking pipe: its read end is the pollable descriptor a program waits
//! on (epoll, mio, `poll(2)`), and any process may ring it by opening the write end through
//! `/proc/<pid>/fd/<n>` (an eventfd cannot be reopened that way; a pipe can). What arrived
//! lives in shared memory (a ring or a flag word) and is written before the ring.

use crate::error::{Error, Result};
use rustix::event::{PollFd, PollFlags, poll};
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::pipe::{PipeFlags, pipe_with};

/// A pipe used as a wake-up signal.
pub struct Doorbell {
    rd: OwnedFd,
    wr: OwnedFd,
}

impl Doorbell {
    /// A silent doorbell.
    pub fn new() -> Result<Doorbell> {
        let (rd, wr) =
            pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK).map_err(Error::os("pipe2"))?;
        Ok(Doorbell { rd, wr })
    }

    /// The descriptor to wait on: readable once rung, until drained.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.rd.as_fd()
    }

    /// The write end's descriptor number, for peers that open it through `/proc`.
    pub fn write_fd_num(&self) -> i32 {
        self.wr.as_raw_fd()
    }

    /// The write end, for posting into a queue this doorbell wakes.
    pub(crate) fn write_fd(&self) -> BorrowedFd<'_> {
        self.wr.as_fd()
    }

    /// The write end's inode, so peers can tell it from a recycled descriptor.
    pub fn write_ino(&self) -> u64 {
        rustix::fs::fstat(&self.wr).map_or(0, |s| s.st_ino)
    }

    /// Wakes waiters.
    pub fn ring(&self) {
        ring_fd(self.wr.as_fd());
    }

    /// Forgets all rings so far.
    pub fn drain(&self) {
        let mut buf = [0u8; 64];
        // A short read took all there was: no second system call to learn it is empty.
        while matches!(rustix::io::read(&self.rd, &mut buf), Ok(n) if n == buf.len()) {}
    }

    /// Waits until rung (or interrupted).
    pub fn wait(&self) -> Result<()> {
        let mut fds = [PollFd::new(&self.rd, PollFlags::IN)];
        match poll(&mut fds, None) {
            Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
            Err(e) => Err(Error::os("poll")(e)),
        }
    }
}

/// Rings a doorbell through its write end (ours or a peer's). A full pipe is already rung.
pub fn ring_fd(fd: BorrowedFd<'_>) {
    let _ = rustix::io::write(fd, &[1u8]);
}
