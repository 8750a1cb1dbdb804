//! Deferred work: RNR back-off and ACK time-outs of stalled send queues, and flushing QPs that
//! a peer's error moved to ERR.
//!
//! One thread per device, started the first time something is deferred; it sleeps on a
//! condition variable while nothing is due. The data path never waits for it: it only runs
//! what must happen later than the call that caused it. It knows the QPs it runs only as
//! [`Timer`]s: they are a layer above the device.

use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Instant;

/// Something with deferred work (a QP): [`Progress`] calls `on_timer` when it is due.
pub(crate) trait Timer: Send + Sync {
    fn on_timer(&self);
}

struct Due {
    at: Instant,
    seq: u64,
    who: Weak<dyn Timer>,
}

impl PartialEq for Due {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // Reversed: BinaryHeap is a max-heap and we want the earliest first.
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Default)]
struct State {
    timers: BinaryHeap<Due>,
    seq: u64,
    running: bool,
}

/// The device's timer thread.
#[derive(Default)]
pub(crate) struct Progress {
    shared: Arc<(Mutex<State>, Condvar)>,
}

impl Progress {
    /// Runs `who.on_timer()` at `at` (or soon after) on the progress thread.
    pub(crate) fn schedule(&self, at: Instant, who: Weak<dyn Timer>) {
        let (lock, cv) = &*self.shared;
        let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
        st.seq += 1;
        let seq = st.seq;
        st.timers.push(Due { at, seq, who });
        if !st.running {
            st.running = true;
            let shared = Arc::downgrade(&self.shared);
            let spawned = std::thread::Builder::new()
                .name("softverbs-progress".into())
                .spawn(move || run(shared));
            if spawned.is_err() {
                // Without a thread, deferred work runs on the next call that drives the QP.
                st.running = false;
            }
        }
        cv.notify_one();
    }
}

fn run(shared: Weak<(Mutex<State>, Condvar)>) {
    loop {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let (lock, cv) = &*shared;
        let mut due = Vec::new();
        {
            let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                let now = Instant::now();
                while st.timers.peek().is_some_and(|t| t.at <= now) {
                    if let Some(t) = st.timers.pop() {
                        due.push(t.who);
                    }
                }
                if !due.is_empty() {
                    break;
                }
                st = match st.timers.peek().map(|t| t.at) {
                    Some(at) => {
                        cv.wait_timeout(st, at.saturating_duration_since(now))
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                    None => cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                };
            }
        }
        drop(shared);
        for who in due.into_iter().filter_map(|w| w.upgrade()) {
            who.on_timer();
        }
    }
}
