//! A lock over a value whose release is a plain store and which the thread it is *biased* to
//! takes with plain stores alone: a QP's send lock (taken by every post, and by the device's
//! progress thread) and a CQ's consumer lock (taken by every poll and polling section).
//!
//! A `std::sync::Mutex` releases with an exchange (a locked instruction, which waits for the
//! stores before it to drain: after a request's copy into a peer's memory, that is the wait
//! for the peer's lines) because it must learn whether to wake a sleeper. This lock has no
//! sleepers: a contender spins briefly, then yields (the lock is held for one request's
//! execution, or one poll), so the release is a plain store.
//!
//! Nearly every QP is posted to, and every CQ polled, by one thread, and the
//! compare-and-swap that takes the lock was then the last locked instruction of a request (an
//! experiment without it: WRITE rate 22.3 -> 24.3 M msg/s). So the lock is *biased* to the
//! first thread that takes it with [`BiasedLock::lock`]: that thread takes it with plain
//! stores (it marks itself inside, then checks that no other thread is asking for the lock).
//! Another thread takes `held` (the compare-and-swap), marks that it is asking, has the kernel
//! run a memory barrier on every thread of the process (`membarrier(2)`, private expedited)
//! and waits for the owner to be outside. The barrier orders the owner's mark before its check
//! as a fence in the owner would: either the asker sees the owner inside, or the owner sees
//! the asking and waits for `held`.
//!
//! A second thread that takes the lock with [`BiasedLock::lock`] ends the bias for good (the
//! QP or CQ is shared; a barrier per post would cost microseconds). The other users
//! ([`BiasedLock::lock_aside`]: the device's progress thread retrying sends after an RNR wait,
//! modify, query, a deregistration's quiesce, a CQ's resize) only borrow it: they clear their
//! mark as they let go, and the bias holds again (the progress thread once took SEND's gain
//! away for good that way); after [`BORROWS_AT_MOST`] of them it ends too. Where the kernel
//! has no such barrier the lock is never biased.

use crate::sync::{self, Reach, thread_token};
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering, compiler_fence};

/// [`BiasedLock::biased_to`] before the first user.
const UNCLAIMED: usize = 0;
/// [`BiasedLock::biased_to`] once the bias ended, or where it cannot be had.
const UNBIASED: usize = 1;
/// Times the biased owner may be asked out by [`BiasedLock::lock_aside`] before the bias ends.
const BORROWS_AT_MOST: u32 = 1024;

/// A lock over `T` whose release is a store, taken with stores alone by the thread it is
/// biased to.
pub(crate) struct BiasedLock<T> {
    /// The lock of every thread but the biased one (and of that one while it is asked out).
    held: AtomicBool,
    /// The thread the lock is biased to ([`thread_token`]), or [`UNCLAIMED`], or
    /// [`UNBIASED`]; claimed holding `held`.
    biased_to: AtomicUsize,
    /// The biased thread is inside.
    owner_in: AtomicBool,
    /// A holder of `held` keeps the biased thread out (for good once unbiased).
    asking: AtomicBool,
    /// How many times the biased thread was asked out by borrowers.
    borrows: AtomicU32,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and one guard at a time exists: a guard
// of the biased thread, taken with `owner_in` while `asking` was clear, or a guard of `held`
// (an acquiring compare-and-swap, a releasing store), whose holder, if the lock is biased to
// another thread, set `asking` and saw `owner_in` clear after the barrier (see the module).
// The bias is claimed holding `held`, so no holder of `held` finds it claimed under it.
unsafe impl<T: Send> Sync for BiasedLock<T> {}

impl<T> BiasedLock<T> {
    pub(crate) fn new(value: T) -> BiasedLock<T> {
        BiasedLock {
            held: AtomicBool::new(false),
            biased_to: AtomicUsize::new(UNCLAIMED),
            owner_in: AtomicBool::new(false),
            asking: AtomicBool::new(false),
            borrows: AtomicU32::new(0),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock as one of its users (a post, a poll), waiting for it; the first thread
    /// that takes it so gets the bias, a second ends it.
    #[inline]
    pub(crate) fn lock(&self) -> BiasedGuard<'_, T> {
        match self.biased() {
            Some(g) => g,
            None => self.lock_slow(true),
        }
    }

    /// Takes the lock for anything but its users' work, waiting for it: borrowed from the
    /// biased thread, if another, without ending its bias.
    pub(crate) fn lock_aside(&self) -> BiasedGuard<'_, T> {
        match self.biased() {
            Some(g) => g,
            None => self.lock_slow(false),
        }
    }

    /// The lock through the bias, if it is the calling thread's and nobody asks for it (and
    /// the thread is not inside already): never waits.
    #[inline(always)]
    pub(crate) fn biased(&self) -> Option<BiasedGuard<'_, T>> {
        // A thread already inside that locks again is not let in twice: the other path
        // waits for ever, as any lock taken again by its holder does.
        if self.biased_to.load(Ordering::Relaxed) != thread_token()
            || self.owner_in.load(Ordering::Relaxed)
        {
            return None;
        }
        self.owner_in.store(true, Ordering::Relaxed);
        // Only the compiler is kept from moving the check above the mark: the processor's
        // reordering is what the asker's barrier undoes.
        compiler_fence(Ordering::SeqCst);
        if !self.asking.load(Ordering::Relaxed) {
            return Some(BiasedGuard {
                lock: self,
                how: Held::Biased,
            });
        }
        self.owner_in.store(false, Ordering::Release);
        None
    }

    /// Takes `held`; a first post claims the bias, a post from another thread than the
    /// owner ends it, anything else borrows it.
    #[cold]
    #[inline(never)]
    fn lock_slow(&self, posting: bool) -> BiasedGuard<'_, T> {
        if self
            .held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.contended();
        }
        let me = thread_token();
        let how = match self.biased_to.load(Ordering::Relaxed) {
            UNCLAIMED if posting && sync::registered(Reach::Process) => {
                self.biased_to.store(me, Ordering::Relaxed);
                self.owner_in.store(true, Ordering::Relaxed);
                Held::Owner
            }
            UNCLAIMED if posting => {
                self.biased_to.store(UNBIASED, Ordering::Relaxed);
                Held::Unbiased
            }
            UNCLAIMED | UNBIASED => Held::Unbiased,
            owner if owner == me => {
                // Here while inside (a second lock: waits for ever) or after a borrower let
                // go; marked inside, so that a second lock of its own waits too.
                self.wait_owner_out();
                self.owner_in.store(true, Ordering::Relaxed);
                Held::Owner
            }
            _ => {
                self.asking.store(true, Ordering::SeqCst);
                // The owner's `owner_in` store, if it came before its check of `asking`, is
                // visible now; if it came after, its check sees `asking`.
                sync::barrier(Reach::Process);
                self.wait_owner_out();
                if posting || self.borrows.fetch_add(1, Ordering::Relaxed) + 1 >= BORROWS_AT_MOST {
                    // `asking` stays set: an owner that read the old `biased_to` is kept out.
                    self.biased_to.store(UNBIASED, Ordering::Relaxed);
                    Held::Unbiased
                } else {
                    Held::Asking
                }
            }
        };
        BiasedGuard { lock: self, how }
    }

    fn wait_owner_out(&self) {
        // Acquire: what the owner did inside is visible once it is out.
        while self.owner_in.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
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

/// How a guard holds its lock.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Held {
    /// Through the bias (`owner_in`).
    Biased,
    /// Through `held`, having asked the biased owner out (`asking`, cleared on release).
    Asking,
    /// Through `held` alone.
    Unbiased,
    /// Through `held`, by the biased thread (after an asker let go), marked inside too.
    Owner,
}

/// The lock held; released when dropped.
pub(crate) struct BiasedGuard<'a, T> {
    lock: &'a BiasedLock<T>,
    how: Held,
}

impl<T> Deref for BiasedGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock, so no `&mut` to the value exists elsewhere.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for BiasedGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the lock and is borrowed mutably: the only access.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for BiasedGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        match self.how {
            Held::Biased => self.lock.owner_in.store(false, Ordering::Release),
            Held::Asking => {
                self.lock.asking.store(false, Ordering::Release);
                self.lock.held.store(false, Ordering::Release);
            }
            Held::Unbiased => self.lock.held.store(false, Ordering::Release),
            Held::Owner => {
                self.lock.owner_in.store(false, Ordering::Release);
                self.lock.held.store(false, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    /// Threads taking turns through the lock lose no update, and a guard's view is its own:
    /// each increments a plain (non-atomic) pair under it, which a torn or doubled hold would
    /// leave unequal or short. The first thread posts; the others post too (`aside` false:
    /// the bias ends at once) or borrow it (until it ends after `BORROWS_AT_MOST`).
    fn turns_lose_no_update(aside: bool) {
        const EACH: u64 = 200_000;
        let lock = Arc::new(BiasedLock::new((0u64, 0u64)));
        let threads: Vec<_> = (0..3)
            .map(|t| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..EACH {
                        let mut g = if aside && t > 0 {
                            lock.lock_aside()
                        } else {
                            lock.lock()
                        };
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

    #[test]
    fn posting_threads_lose_no_update() {
        turns_lose_no_update(false);
    }

    #[test]
    fn a_poster_and_borrowers_lose_no_update() {
        turns_lose_no_update(true);
    }

    fn skip_without_barrier() -> bool {
        let no = !sync::registered(Reach::Process);
        if no {
            eprintln!("skipped: this kernel has no private expedited membarrier");
        }
        no
    }

    /// The thread that posts first holds the lock through the bias; a borrower waits until
    /// the holder lets go and sees what it did inside; once the borrower lets go, the bias
    /// holds again.
    #[test]
    fn a_borrower_waits_for_the_biased_holder_and_the_bias_comes_back() {
        if skip_without_barrier() {
            return;
        }
        let lock = Arc::new(BiasedLock::new(0u64));
        assert_eq!(lock.lock_aside().how, Held::Unbiased, "claimed by no post");
        let g = lock.lock();
        assert_eq!(g.how, Held::Owner, "the first post claims the bias");
        drop(g);
        let g = lock.lock();
        assert_eq!(g.how, Held::Biased);
        let got = Arc::new(AtomicBool::new(false));
        let asker = {
            let (lock, got) = (lock.clone(), got.clone());
            std::thread::spawn(move || {
                let g = lock.lock_aside();
                assert_eq!(g.how, Held::Asking);
                got.store(true, Ordering::SeqCst);
                *g
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !got.load(Ordering::SeqCst),
            "taken while the biased holder had it"
        );
        let mut g = g;
        *g = 7;
        drop(g);
        assert_eq!(
            asker.join().unwrap(),
            7,
            "the borrower saw the holder's write"
        );
        assert_eq!(lock.lock().how, Held::Biased, "the bias did not come back");
    }

    /// A post from a second thread ends the bias for good.
    #[test]
    fn a_second_poster_ends_the_bias() {
        if skip_without_barrier() {
            return;
        }
        let lock = BiasedLock::new(0u32);
        drop(lock.lock());
        assert_eq!(lock.lock().how, Held::Biased);
        std::thread::scope(|s| {
            s.spawn(|| assert_eq!(lock.lock().how, Held::Unbiased));
        });
        assert_eq!(lock.lock().how, Held::Unbiased);
        assert_eq!(lock.lock_aside().how, Held::Unbiased);
    }

    /// A lock borrowed too often stops being biased, for good.
    #[test]
    fn a_lock_borrowed_too_often_stays_unbiased() {
        if skip_without_barrier() {
            return;
        }
        let lock = BiasedLock::new(0u32);
        *lock.lock() += 1;
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 1..BORROWS_AT_MOST {
                    let mut g = lock.lock_aside();
                    assert_eq!(g.how, Held::Asking, "borrow {i}");
                    *g += 1;
                }
                assert_eq!(lock.lock_aside().how, Held::Unbiased);
            });
        });
        let g = lock.lock();
        assert_eq!(g.how, Held::Unbiased);
        assert_eq!(*g, BORROWS_AT_MOST, "an update was lost");
    }
}
