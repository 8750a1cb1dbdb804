//! Async events (`ibv_get_async_event`): what they are about, and a context's queue of them.
//!
//! The queue is a [`Ring`] of records in shared memory with a [`Doorbell`], so a peer process
//! can post an event without the owner's help (a responder error it caused, an SRQ limit it
//! crossed, a CQ it overran): it writes the record, then rings.

use crate::device_memory::doorbell::{Doorbell, ring_fd};
use crate::device_memory::ring::{Ring, SlotPayload};
use crate::error::{Error, Result};
use crate::types::AsyncEventType;
use rustix::fd::BorrowedFd;
use std::sync::Mutex;

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

/// An async event as stored in shared memory.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct EventRecord {
    kind: u32,
    tag: u32,
    id: u32,
    _reserved: u32,
}

// SAFETY: repr(C) integers.
unsafe impl SlotPayload for EventRecord {}

impl From<AsyncEvent> for EventRecord {
    fn from(e: AsyncEvent) -> Self {
        let (tag, id) = match e.element {
            EventElement::Qp(n) => (1, n),
            EventElement::Cq(n) => (2, n),
            EventElement::Srq(n) => (3, n),
            EventElement::Port(n) => (4, u32::from(n)),
            EventElement::Device => (5, 0),
        };
        EventRecord {
            kind: e.kind as u32,
            tag,
            id,
            _reserved: 0,
        }
    }
}

impl EventRecord {
    /// The event, if the record (possibly written by a peer) is well formed.
    fn decode(self) -> Option<AsyncEvent> {
        let element = match self.tag {
            1 => EventElement::Qp(self.id),
            2 => EventElement::Cq(self.id),
            3 => EventElement::Srq(self.id),
            4 => EventElement::Port(u8::try_from(self.id).ok()?),
            5 => EventElement::Device,
            _ => return None,
        };
        Some(AsyncEvent {
            kind: AsyncEventType::from_raw(self.kind)?,
            element,
        })
    }
}

/// Posts async events into a queue: the owner's or, through mapped memory, a peer's.
pub(crate) fn post_event(ring: &Ring, bell: BorrowedFd<'_>, ev: AsyncEvent) {
    // A full queue loses the event, as a hardware event queue overflow would.
    let _ = ring.push(&EventRecord::from(ev));
    ring_fd(bell);
}

/// A context's async event queue; its descriptor is readable while events wait.
pub struct AsyncQueue {
    ring: Ring,
    bell: Doorbell,
    lock: Mutex<()>,
}

impl AsyncQueue {
    /// An empty queue.
    pub fn new() -> Result<Self> {
        Ok(AsyncQueue {
            ring: Ring::new("softverbs-events", 1024, std::mem::size_of::<EventRecord>())?,
            bell: Doorbell::new()?,
            lock: Mutex::new(()),
        })
    }

    /// The descriptor to wait on (`context->async_fd`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.bell.fd()
    }

    /// The shared ring, for peers.
    pub(crate) fn ring(&self) -> &Ring {
        &self.ring
    }

    /// The doorbell, for peers.
    pub(crate) fn bell(&self) -> &Doorbell {
        &self.bell
    }

    /// Queues an event and wakes waiters.
    pub fn push(&self, ev: AsyncEvent) {
        post_event(&self.ring, self.bell.write_fd(), ev);
    }

    /// Takes the oldest event; with `blocking`, waits for one.
    pub fn pop(&self, blocking: bool) -> Result<AsyncEvent> {
        loop {
            {
                let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                while let Some(rec) = self.ring.pop::<EventRecord>() {
                    let Some(ev) = rec.decode() else { continue };
                    self.settle();
                    return Ok(ev);
                }
                self.settle();
            }
            if !blocking {
                return Err(Error::WouldBlock);
            }
            self.bell.wait()?;
        }
    }

    /// Keeps "readable" and "non-empty" in step: drain, then re-ring if a peer raced us.
    fn settle(&self) {
        if self.ring.is_empty() {
            self.bell.drain();
            if !self.ring.is_empty() {
                self.bell.ring();
            }
        }
    }

    /// Number of queued events.
    pub fn len(&self) -> usize {
        self.ring.len() as usize
    }

    /// True when no event is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::event::{PollFd, PollFlags, poll};

    fn readable(fd: BorrowedFd<'_>) -> bool {
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        poll(&mut fds, Some(&rustix::time::Timespec::default())).unwrap() == 1
    }

    fn ev(n: u32) -> AsyncEvent {
        AsyncEvent {
            kind: AsyncEventType::QpFatal,
            element: EventElement::Qp(n),
        }
    }

    #[test]
    fn fd_tracks_queue() {
        let q = AsyncQueue::new().unwrap();
        assert!(!readable(q.fd()));
        assert_eq!(q.pop(false).err(), Some(Error::WouldBlock));
        q.push(ev(1));
        q.push(ev(2));
        assert!(readable(q.fd()));
        assert_eq!(q.pop(false).unwrap(), ev(1));
        assert!(readable(q.fd()));
        assert_eq!(q.pop(true).unwrap(), ev(2));
        assert!(!readable(q.fd()));
    }

    #[test]
    fn blocking_pop_wakes() {
        let q = std::sync::Arc::new(AsyncQueue::new().unwrap());
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.pop(true).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.push(ev(7));
        assert_eq!(t.join().unwrap(), ev(7));
    }

    #[test]
    fn malformed_records_are_skipped() {
        let q = AsyncQueue::new().unwrap();
        q.ring()
            .push(&EventRecord {
                kind: 999,
                tag: 1,
                id: 0,
                _reserved: 0,
            })
            .unwrap();
        q.push(ev(3));
        assert_eq!(q.pop(false).unwrap(), ev(3));
    }
}
