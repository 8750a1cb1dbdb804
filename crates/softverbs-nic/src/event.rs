//! Event queues with a pollable file descriptor: async events and completion channels.

use crate::error::{Error, Result};
use crate::types::AsyncEventType;
use rustix::event::{EventfdFlags, PollFd, PollFlags, eventfd, poll};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::collections::VecDeque;
use std::sync::Mutex;

/// A FIFO whose `eventfd` is readable exactly while the FIFO is non-empty, so it works with
/// epoll, mio or a plain `poll(2)`.
pub struct EventQueue<T> {
    fd: OwnedFd,
    queue: Mutex<VecDeque<T>>,
}

impl<T> EventQueue<T> {
    /// An empty queue.
    pub fn new() -> Result<Self> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(Error::os("eventfd"))?;
        Ok(EventQueue {
            fd,
            queue: Mutex::new(VecDeque::new()),
        })
    }

    /// The descriptor to wait on: readable while events are queued.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Queues an event and wakes waiters.
    pub fn push(&self, ev: T) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        // The fd state changes under the lock, so "readable" and "non-empty" never disagree.
        if q.is_empty() {
            let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
        }
        q.push_back(ev);
    }

    /// Takes the oldest event; with `blocking`, waits for one.
    pub fn pop(&self, blocking: bool) -> Result<T> {
        loop {
            {
                let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(ev) = q.pop_front() {
                    if q.is_empty() {
                        let mut buf = [0u8; 8];
                        let _ = rustix::io::read(&self.fd, &mut buf);
                    }
                    return Ok(ev);
                }
            }
            if !blocking {
                return Err(Error::WouldBlock);
            }
            let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
            match poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::os("poll")(e)),
            }
        }
    }

    /// Number of queued events.
    pub fn len(&self) -> usize {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when no event is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The object an async event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventElement {
    /// A queue pair, by QP number.
    Qp(u32),
    /// A completion queue, by its device-wide id.
    Cq(u32),
    /// A shared receive queue, by its device-wide id.
    Srq(u32),
    /// A port, by number.
    Port(u8),
    /// The device itself.
    Device,
}

/// An asynchronous event (`struct ibv_async_event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    pub kind: AsyncEventType,
    pub element: EventElement,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: BorrowedFd<'_>) -> bool {
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        poll(&mut fds, Some(&rustix::time::Timespec::default())).unwrap() == 1
    }

    #[test]
    fn fd_tracks_queue() {
        let q = EventQueue::new().unwrap();
        assert!(!readable(q.fd()));
        assert_eq!(q.pop(false).err(), Some(Error::WouldBlock));
        q.push(1);
        q.push(2);
        assert!(readable(q.fd()));
        assert_eq!(q.pop(false).unwrap(), 1);
        assert!(readable(q.fd()));
        assert_eq!(q.pop(true).unwrap(), 2);
        assert!(!readable(q.fd()));
    }

    #[test]
    fn blocking_pop_wakes() {
        let q = std::sync::Arc::new(EventQueue::new().unwrap());
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.pop(true).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.push(7u32);
        assert_eq!(t.join().unwrap(), 7);
    }
}
