//! The processes that own the peer QPs this process has mapped, and whether each is still
//! alive. One record per process, not per QP: a process connected to 65,536 QPs of one peer
//! and sending to each in turn would otherwise ask the kernel on every operation.
//!
//! A process's death is told by the kernel: the *undertaker*, one thread of this process,
//! waits on a pidfd of every peer process (one descriptor each) and marks the record dead the
//! moment the process exits, so a request posted after that never lands in the dead
//! process's memory (which stays mapped here), and the hot path reads one flag. Where pidfds
//! are unavailable (old kernels, sandboxes, a child forked without the thread), the record
//! asks the kernel itself, at most every millisecond of the coarse clock.

use crate::mr::keys::KeyTable;
use crate::mr::peer::PeerMemory;
use rustix::fd::OwnedFd;
use rustix::process::{Pid, PidfdFlags, pidfd_open};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

/// Without the undertaker: how often a requester checks that a peer process is still alive
/// (at most; the coarse clock ticks every few milliseconds).
const LIVENESS_INTERVAL: Duration = Duration::from_millis(1);

/// Records of gone processes the table keeps before it forgets those no QP holds.
const KEEP_UNUSED: usize = 64;

/// A process owning QPs mapped here.
pub(crate) struct Owner {
    pid: u32,
    /// Its key with the undertaker, which marks it dead; `None`: it asks the kernel itself.
    watch: Option<u64>,
    /// When it was last seen alive, on the coarse monotonic clock (ns).
    checked: AtomicU64,
    dead: AtomicBool,
    /// Its files mapped here, shared by all its QPs: among thousands of connections to one
    /// process, a record per QP was two more cache misses per operation.
    pub(crate) memory: PeerMemory,
    /// Its key tables mapped here, each shared by the QPs that name it (as `memory` is).
    keys: Mutex<Vec<Weak<KeyTable>>>,
}

/// The thread that learns of peer processes' deaths, and what it watches.
struct Undertaker {
    epoll: OwnedFd,
    /// Key → the pidfd and the record it marks.
    watched: Mutex<HashMap<u64, (OwnedFd, Weak<Owner>)>>,
    next: AtomicU64,
    /// The process that has the thread (a forked child does not).
    pid: Pid,
}

static UNDERTAKER: LazyLock<Option<Arc<Undertaker>>> = LazyLock::new(Undertaker::start);

impl Undertaker {
    fn start() -> Option<Arc<Undertaker>> {
        use rustix::event::epoll;
        let u = Arc::new(Undertaker {
            epoll: epoll::create(epoll::CreateFlags::CLOEXEC).ok()?,
            watched: Mutex::default(),
            next: AtomicU64::new(0),
            pid: rustix::process::getpid(),
        });
        let run = u.clone();
        std::thread::Builder::new()
            .name("softverbs-undertaker".into())
            .spawn(move || run.serve())
            .ok()?;
        Some(u)
    }

    /// This process's undertaker, if it has one.
    fn get() -> Option<&'static Undertaker> {
        UNDERTAKER
            .as_deref()
            .filter(|u| u.pid == rustix::process::getpid())
    }

    fn serve(&self) {
        use rustix::event::epoll;
        let mut events = Vec::with_capacity(16);
        loop {
            events.clear();
            if epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                None,
            )
            .is_err()
            {
                // EINTR; anything else cannot happen on a valid epoll descriptor.
                continue;
            }
            for e in &events {
                let gone = self.lock().remove(&e.data.u64());
                // Marked (and the pidfd closed) with the table unlocked: the record may
                // go with it, and its drop takes the table.
                if let Some(owner) = gone.and_then(|(_, w)| w.upgrade()) {
                    owner.dead.store(true, Ordering::Release);
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (OwnedFd, Weak<Owner>)>> {
        self.watched.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watches `pid` for `owner` under `key`; false if it cannot (no pidfd).
    fn watch(&self, key: u64, pid: u32, owner: &Arc<Owner>) -> bool {
        use rustix::event::epoll;
        let Some(p) = Pid::from_raw(pid as i32) else {
            return false;
        };
        let fd = match pidfd_open(p, PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::SRCH) => {
                owner.dead.store(true, Ordering::Release);
                return true;
            }
            Err(_) => return false,
        };
        let mut watched = self.lock();
        if epoll::add(
            &self.epoll,
            &fd,
            epoll::EventData::new_u64(key),
            epoll::EventFlags::IN,
        )
        .is_err()
        {
            return false;
        }
        watched.insert(key, (fd, Arc::downgrade(owner)));
        true
    }
}

/// The owners of mapped QPs, by pid.
static OWNERS: LazyLock<Mutex<HashMap<u32, Weak<Owner>>>> = LazyLock::new(Default::default);

/// The coarse monotonic clock in ns: read from memory the kernel updates every tick, where
/// the precise one costs a clock read on every operation (this is asked on each).
fn coarse_now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

impl Owner {
    /// The record of process `pid`, shared by every QP of it mapped here; a new one if the
    /// last was found dead (the pid was reused).
    pub(crate) fn of(pid: u32) -> Arc<Owner> {
        let mut owners = OWNERS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = owners
            .get(&pid)
            .and_then(Weak::upgrade)
            .filter(|o| !o.dead.load(Ordering::Relaxed))
        {
            return o;
        }
        let undertaker = Undertaker::get();
        let key = undertaker.map(|u| u.next.fetch_add(1, Ordering::Relaxed));
        let mut o = Arc::new(Owner {
            pid,
            watch: key,
            checked: AtomicU64::new(coarse_now_ns()),
            dead: AtomicBool::new(false),
            memory: PeerMemory::default(),
            keys: Mutex::default(),
        });
        if let (Some(u), Some(key)) = (undertaker, key)
            && !u.watch(key, pid, &o)
        {
            // Nobody else holds it yet.
            if let Some(own) = Arc::get_mut(&mut o) {
                own.watch = None;
            }
        }
        owners.insert(pid, Arc::downgrade(&o));
        if owners.len() > KEEP_UNUSED {
            owners.retain(|_, w| w.strong_count() > 0);
        }
        o
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The view of `table` another QP of this process already holds (the same bytes of the
    /// same file, the same header), or `table` itself, kept for the next QP that names it.
    pub(crate) fn share_keys(&self, table: KeyTable) -> Arc<KeyTable> {
        let mut held = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|w| w.strong_count() > 0);
        if let Some(t) = held
            .iter()
            .filter_map(Weak::upgrade)
            .find(|t| t.same_view(&table))
        {
            return t;
        }
        let table = Arc::new(table);
        held.push(Arc::downgrade(&table));
        table
    }

    /// False once the process is gone.
    #[inline]
    pub(crate) fn alive(&self) -> bool {
        if self.dead.load(Ordering::Acquire) {
            return false;
        }
        self.watch.is_some() || self.ask()
    }

    /// Without the undertaker: asks the kernel, at most every LIVENESS_INTERVAL.
    fn ask(&self) -> bool {
        let now = coarse_now_ns();
        let last = self.checked.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= LIVENESS_INTERVAL.as_nanos() as u64
            && self
                .checked
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            // A zombie has no descriptors left to look at.
            let alive = crate::sync::process_exists(self.pid)
                && std::fs::metadata(format!("/proc/{}/fd", self.pid)).is_ok();
            if !alive {
                self.dead.store(true, Ordering::Relaxed);
                return false;
            }
        }
        true
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(key) = self.watch
            && let Some(u) = Undertaker::get()
        {
            // Closing the pidfd takes it out of the epoll set.
            let fd = u.lock().remove(&key);
            drop(fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// QPs of one process that name the same key table share one view of it (its lines stay
    /// in cache across thousands of connections); another table gets its own.
    #[test]
    fn views_of_one_key_table_are_shared_and_of_another_are_not() {
        let owner = Owner::of(std::process::id());
        let (t1, t2) = (KeyTable::new(64).unwrap(), KeyTable::new(64).unwrap());
        let view = |t: &KeyTable| KeyTable::open(t.segment().reopen().unwrap()).unwrap();
        let a = owner.share_keys(view(&t1));
        let b = owner.share_keys(view(&t1));
        let c = owner.share_keys(view(&t2));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        // The owner keeps no view alive by itself: once no QP holds one, the next maps anew.
        drop(c);
        assert_eq!(Arc::strong_count(&owner.share_keys(view(&t2))), 1);
    }

    #[test]
    fn the_qps_of_one_process_share_its_record() {
        let me = std::process::id();
        let (a, b) = (Owner::of(me), Owner::of(me));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(a.alive());
    }

    #[test]
    fn a_gone_process_is_dead_and_its_pid_gets_a_new_record() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let o = Owner::of(pid);
        assert!(
            o.watch.is_some(),
            "this kernel has pidfds: the undertaker watches"
        );
        child.wait().unwrap();
        // The undertaker runs as soon as the child exits; wait for it a little.
        let t = std::time::Instant::now();
        while o.alive() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!o.alive(), "the reaped child is gone");
        assert!(
            !Arc::ptr_eq(&o, &Owner::of(pid)),
            "a dead record is not reused"
        );
    }
}
