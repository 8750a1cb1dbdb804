//! The send lock: a QP's posting state, taken by every post and by the device's progress
//! thread.
//!
//! A `std::sync::Mutex` releases with an exchange (a locked instruction, which waits for the
//! stores before it to drain: after a request's copy into a peer's memory, that is the wait
//! for the peer's lines) because it must learn whether to wake a sleeper. This lock has no
//! sleepers: a contender spins briefly, then yields (the lock is held for one request's
//! execution), so the release is a plain store.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// A lock over `T` whose release is a store.
pub(crate) struct SendLock<T> {
    held: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and one guard at a time exists (the
// `held` flag, taken with an acquiring compare-and-swap, released with a releasing store).
unsafe impl<T: Send> Sync for SendLock<T> {}

impl<T> SendLock<T> {
    pub(crate) fn new(value: T) -> SendLock<T> {
        SendLock {
            held: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting for it.
    #[inline]
    pub(crate) fn lock(&self) -> SendGuard<'_, T> {
        if self
            .held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.contended();
        }
        SendGuard { lock: self }
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
        self.lock.held.store(false, Ordering::Release);
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
}
