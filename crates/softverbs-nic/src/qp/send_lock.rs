//! The send lock: a QP's posting state, taken by every post and by the device's progress
//! thread.
//!
//! A `std::sync::Mutex` releases with an exchange (a locked instruction, which waits for the
//! stores before it to drain: after a request's copy into a peer's memory, that is the wait
//! for the peer's lines) because it must learn whether to wake a sleeper. This lock has no
//! sleepers: a contender spins briefly, then yields (the lock is held for one request's
//! execution), so the release is a plain store.
//!
//! Nearly every QP is posted to by one thread, and the compare-and-swap that takes the lock
//! was then the last locked instruction of a request (an experiment without it: WRITE rate
//! 22.3 -> 24.3 M msg/s). So the lock is *biased* to the first thread that takes it: that
//! thread takes it with plain stores (it marks itself inside, then checks that no other
//! thread has asked for the lock). Another thread asks once and for good: it marks the lock
//! revoked, has the kernel run a memory barrier on every thread of the process
//! (`membarrier(2)`, private expedited), and waits for the owner to be outside. The barrier
//! orders the owner's mark before its check as a fence in the owner would: either the asker
//! sees the owner inside, or the owner sees the revocation and takes the compare-and-swap
//! path, which everyone uses from then on. Where the kernel has no such barrier the lock is
//! never biased.

use crate::sync::{self, Reach, thread_token};
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, compiler_fence};

/// [`SendLock::biased_to`] before the first lock.
const UNCLAIMED: usize = 0;
/// [`SendLock::biased_to`] once the bias is revoked, or where it cannot be had.
const UNBIASED: usize = 1;

/// A lock over `T` whose release is a store, taken with stores alone by the thread it is
/// biased to.
pub(crate) struct SendLock<T> {
    /// The lock of every thread but the biased one (and of that one once revoked).
    held: AtomicBool,
    /// The thread the lock is biased to ([`thread_token`]), or [`UNCLAIMED`], or
    /// [`UNBIASED`].
    biased_to: AtomicUsize,
    /// The biased thread is inside.
    owner_in: AtomicBool,
    /// Another thread asked: the bias is over (never cleared).
    revoked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and one guard at a time exists: a guard
// of the biased thread, taken with `owner_in` while `revoked` was clear, or a guard of `held`
// (an acquiring compare-and-swap, a releasing store), which is only handed out once the bias
// is revoked and `owner_in` was seen clear after the barrier (see the module).
unsafe impl<T: Send> Sync for SendLock<T> {}

impl<T> SendLock<T> {
    pub(crate) fn new(value: T) -> SendLock<T> {
        SendLock {
            held: AtomicBool::new(false),
            biased_to: AtomicUsize::new(UNCLAIMED),
            owner_in: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting for it.
    #[inline]
    pub(crate) fn lock(&self) -> SendGuard<'_, T> {
        // A thread already inside that locks again is not let in twice: the other path
        // waits for ever, as any lock taken again by its holder does.
        if self.biased_to.load(Ordering::Relaxed) == thread_token()
            && !self.owner_in.load(Ordering::Relaxed)
        {
            self.owner_in.store(true, Ordering::Relaxed);
            // Only the compiler is kept from moving the check above the mark: the
            // processor's reordering is what the asker's barrier undoes.
            compiler_fence(Ordering::SeqCst);
            if !self.revoked.load(Ordering::Relaxed) {
                return SendGuard {
                    lock: self,
                    biased: true,
                };
            }
            self.owner_in.store(false, Ordering::Release);
        }
        self.lock_unbiased()
    }

    /// The lock for a thread it is not biased to: claims the bias if nobody has it yet, else
    /// revokes it (once) and takes `held`.
    #[cold]
    #[inline(never)]
    fn lock_unbiased(&self) -> SendGuard<'_, T> {
        if self.biased_to.load(Ordering::Relaxed) == UNCLAIMED {
            let claim = if sync::registered(Reach::Process) {
                thread_token()
            } else {
                UNBIASED
            };
            // Whoever wins, the lock was free of a biased owner until now; losers go on below.
            if self
                .biased_to
                .compare_exchange(UNCLAIMED, claim, Ordering::SeqCst, Ordering::Relaxed)
                .is_ok()
                && claim != UNBIASED
            {
                return self.lock();
            }
        }
        if self
            .held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.contended();
        }
        if self.biased_to.load(Ordering::Acquire) != UNBIASED {
            self.revoke();
        }
        SendGuard {
            lock: self,
            biased: false,
        }
    }

    /// Ends the bias, holding `held`: from now on every thread takes `held`.
    #[cold]
    fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
        // The owner's `owner_in` store, if it came before its check of `revoked`, is visible
        // now; if it came after, its check sees `revoked`.
        sync::barrier(Reach::Process);
        // Acquire: what the owner did inside is visible once it is out.
        while self.owner_in.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        self.biased_to.store(UNBIASED, Ordering::Release);
    }

    #[cold]
    #[inline(never)]
    fn contended(&self) {
        let mut spins = 0u32;
        loop {
            while self.held.load(Ordering::Relaxed) {
                if spins < 64 {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if self
                .held
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }
}

/// The lock held; released when dropped.
pub(crate) struct SendGuard<'a, T> {
    lock: &'a SendLock<T>,
    /// Held through the bias (`owner_in`), not `held`.
    biased: bool,
}

impl<T> Deref for SendGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock, so no `&mut` to the value exists elsewhere.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SendGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the lock and is borrowed mutably: the only access.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SendGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        if self.biased {
            self.lock.owner_in.store(false, Ordering::Release);
        } else {
            self.lock.held.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Threads taking turns through the lock lose no update, and a guard's view is its own:
    /// each increments a plain (non-atomic) pair under it, which a torn or doubled hold would
    /// leave unequal or short.
    #[test]
    fn contending_threads_lose_no_update() {
        const EACH: u64 = 200_000;
        let lock = Arc::new(SendLock::new((0u64, 0u64)));
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..EACH {
                        let mut g = lock.lock();
                        g.0 += 1;
                        std::hint::black_box(&mut *g);
                        g.1 += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), (3 * EACH, 3 * EACH));
    }

    /// The thread the lock is biased to holds it; another thread that asks waits until the
    /// holder lets go, sees what it did inside, and from then on both take the lock the
    /// unbiased way.
    #[test]
    fn a_second_thread_waits_for_the_biased_holder_and_ends_the_bias() {
        let lock = Arc::new(SendLock::new(0u64));
        let g = lock.lock();
        assert!(g.biased || !sync::registered(Reach::Process), "the first taker is biased");
        let got = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let asker = {
            let (lock, got) = (lock.clone(), got.clone());
            std::thread::spawn(move || {
                let g = lock.lock();
                assert!(!g.biased);
                got.store(true, Ordering::SeqCst);
                *g
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!got.load(Ordering::SeqCst), "taken while the biased holder had it");
        let mut g = g;
        *g = 7;
        drop(g);
        assert_eq!(asker.join().unwrap(), 7, "the asker saw the holder's write");
        assert_eq!(lock.biased_to.load(Ordering::SeqCst), UNBIASED);
        assert!(!lock.lock().biased, "the bias came back");
    }
}
