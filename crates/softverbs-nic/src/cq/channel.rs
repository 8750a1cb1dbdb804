//! Completion channels (`ibv_comp_channel`): the CQs armed on one flag themselves and ring its
//! doorbell, whichever process added the completion.

use super::{Cq, notify};
use crate::device_memory::doorbell::Doorbell;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

/// A completion channel: the CQs armed on it flag themselves and ring its doorbell.
pub struct Channel {
    bell: Doorbell,
    cqs: Mutex<Vec<Weak<Cq>>>,
    ready: Mutex<VecDeque<Arc<Cq>>>,
}

impl Channel {
    /// A new channel.
    pub fn new() -> Result<Arc<Channel>> {
        Ok(Arc::new(Channel {
            bell: Doorbell::new()?,
            cqs: Mutex::new(Vec::new()),
            ready: Mutex::new(VecDeque::new()),
        }))
    }

    /// The channel's file descriptor: readable while an event is waiting.
    pub fn fd(&self) -> rustix::fd::BorrowedFd<'_> {
        self.bell.fd()
    }

    /// The doorbell, for peers that complete into CQs of this channel.
    pub(crate) fn bell(&self) -> &Doorbell {
        &self.bell
    }

    pub(super) fn attach(&self, cq: &Arc<Cq>) {
        let mut cqs = self.cqs.lock().unwrap_or_else(|e| e.into_inner());
        cqs.retain(|w| w.strong_count() > 0);
        cqs.push(Arc::downgrade(cq));
    }

    /// Moves the CQs that raised an event into `ready` ([`notify::take_event`]).
    fn collect(&self, ready: &mut VecDeque<Arc<Cq>>) {
        let cqs = self.cqs.lock().unwrap_or_else(|e| e.into_inner());
        for cq in cqs.iter().filter_map(Weak::upgrade) {
            let rings = cq.read_ring();
            // Any ring can have fired (peers push into the old ones).
            if notify::take_event(|| rings.all()) {
                drop(rings);
                ready.push_back(cq);
            }
        }
    }

    /// The next CQ that raised an event; with `blocking`, waits for one.
    pub fn get_event(&self, blocking: bool) -> Result<Arc<Cq>> {
        let got = notify::wait_for(&self.bell, blocking, || {
            let mut ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
            self.collect(&mut ready);
            let cq = ready.pop_front()?;
            if ready.is_empty() {
                // Readable only while an event waits: the ring that announced this one goes
                // (programs such as Open MPI's openib wait for readability in an event loop,
                // then call ibv_get_cq_event, which must not find nothing and block). Looked
                // for again after the drain, an event raised meanwhile rings anew below.
                self.bell.drain();
                self.collect(&mut ready);
            }
            if !ready.is_empty() {
                self.bell.ring();
            }
            Some(cq)
        })?;
        let cq = got.ok_or(Error::WouldBlock)?;
        cq.events_delivered.fetch_add(1, Ordering::Relaxed);
        Ok(cq)
    }
}
