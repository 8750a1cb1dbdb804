//! Arming a CQ and raising its completion event: the protocol between whoever adds completions
//! to a CQ ring (this process, or a peer process that mapped the ring) and the program that
//! arms the CQ, waits on its channel and polls.
//!
//! The contract (`ibv_req_notify_cq`): once the CQ is armed, the next completion added to it
//! (with `solicited_only`, the next solicited or error completion) raises one event, whichever
//! process adds it; and the channel hands the program an event only when a completion is
//! there for it to poll.
//!
//! Each party writes one word, then reads the other's, with a sequentially consistent fence
//! between the two:
//! - a producer publishes its completion (the slot's sequence word), then reads the arm;
//! - the program arms (writes the arm word), then polls (reads sequence words);
//! - the channel, when it withholds an event for completions already polled, re-arms, then
//!   looks for a completion again.
//!
//! Without the fences each pair is the store-buffering pattern, in which both sides may read
//! the old value: on x86 the producer's store to the slot waits in its store buffer for the
//! slot's cache line (the consumer's core had it last) while its load of the arm, a line it
//! has, completes at once. The producer then sees no arm and the program no completion, and
//! both wait: `ibv_rc_pingpong -e -t` hung that way about once in 300 runs of 2000 round
//! trips. With the fences, one of them sees the other's write.
//!
//! The protocol is written once over [`ArmRing`]. The NIC runs it on a [`Ring`] in shared
//! memory with std's atomics; the model tests below run the same functions on loom's atomics,
//! which explore every interleaving of the parties and every value the memory model lets each
//! load return, and report a lost event as a deadlock.

use crate::device_memory::doorbell::Doorbell;
use crate::device_memory::ring::Ring;
use crate::error::Result;
use std::sync::atomic::{AtomicU32, Ordering};

/// Not armed.
pub(crate) const ARM_NONE: u32 = 0;
/// Armed for the next completion.
pub(crate) const ARM_NEXT: u32 = 1;
/// Armed for the next solicited or error completion.
pub(crate) const ARM_SOLICITED: u32 = 2;

/// The atomic operations the protocol uses on a 32-bit word.
pub(crate) trait Word {
    fn load(&self, order: Ordering) -> u32;
    fn swap(&self, value: u32, order: Ordering) -> u32;
    fn compare_exchange(&self, current: u32, new: u32, success: Ordering) -> Result<u32, u32>;
}

/// Implements [`Word`] for an atomic type with std's method signatures.
macro_rules! word_for {
    ($t:ty) => {
        impl Word for $t {
            #[inline(always)]
            fn load(&self, order: Ordering) -> u32 {
                <$t>::load(self, order)
            }
            #[inline(always)]
            fn swap(&self, value: u32, order: Ordering) -> u32 {
                <$t>::swap(self, value, order)
            }
            #[inline(always)]
            fn compare_exchange(
                &self,
                current: u32,
                new: u32,
                success: Ordering,
            ) -> Result<u32, u32> {
                <$t>::compare_exchange(self, current, new, success, Ordering::Acquire)
            }
        }
    };
}
word_for!(AtomicU32);

/// What the protocol needs of one CQ ring.
pub(crate) trait ArmRing {
    type Word: Word;
    /// The arm: `ARM_NONE`, `ARM_NEXT` or `ARM_SOLICITED`.
    fn arm(&self) -> &Self::Word;
    /// Set to the arm mode that fired by the producer that fired it; taken by the channel.
    fn event(&self) -> &Self::Word;
    /// True when a published completion waits at the ring's head (read with acquire).
    fn has_completion(&self) -> bool;
    /// A sequentially consistent fence.
    fn fence();
}

impl ArmRing for Ring {
    type Word = AtomicU32;
    #[inline(always)]
    fn arm(&self) -> &AtomicU32 {
        &self.user_words()[super::W_ARM]
    }
    #[inline(always)]
    fn event(&self) -> &AtomicU32 {
        &self.user_words()[super::W_EVENT]
    }
    fn has_completion(&self) -> bool {
        self.ready(1) > 0
    }
    #[inline(always)]
    fn fence() {
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

/// Called by a producer after publishing a completion into `ring`: true if the completion
/// fired the arm, and then the producer rings the channel's doorbell. `solicited`: the
/// completion satisfies a solicited-only arm (it was solicited, or is an error).
#[inline]
pub(crate) fn fire<R: ArmRing>(ring: &R, solicited: bool) -> bool {
    R::fence();
    let arm = ring.arm();
    let mut armed = arm.load(Ordering::Relaxed);
    loop {
        if armed != ARM_NEXT && !(armed == ARM_SOLICITED && solicited) {
            return false;
        }
        // One producer takes the arm; it must still be the mode this completion satisfies.
        match arm.compare_exchange(armed, ARM_NONE, Ordering::AcqRel) {
            Ok(_) => break,
            Err(now) => armed = now,
        }
    }
    // Release: whoever takes the flag sees the completion published before it. A swap, not a
    // store: the channel takes the flag with a swap, and loom (which checks this protocol)
    // lets a plain store slip between the read and the write of a racing swap
    // (tokio-rs/loom#254), which would report events lost that are not.
    ring.event().swap(armed, Ordering::Release);
    true
}

/// `ibv_req_notify_cq` over every ring of a CQ (peers push into old rings too). Arming for the
/// next completion overrides a solicited-only arm, never the reverse. The program polls next.
pub(crate) fn arm<'a, R: ArmRing + 'a>(rings: impl Iterator<Item = &'a R>, solicited_only: bool) {
    for ring in rings {
        let arm = ring.arm();
        // Read-modify-writes, so the arm is judged by its newest value, never a stale one.
        if solicited_only {
            let _ = arm.compare_exchange(ARM_NONE, ARM_SOLICITED, Ordering::AcqRel);
        } else {
            arm.swap(ARM_NEXT, Ordering::AcqRel);
        }
    }
    R::fence();
}

/// Whether the channel hands the program an event for the CQ whose rings `rings` yields, now;
/// takes every ring's event flag.
///
/// A CQ whose completions were all polled before its event is collected (the program
/// re-armed, then drained a completion that had already fired the arm) gets no event: it is
/// armed again as it was, so the event the program waits for is one with news. On hardware
/// such stale events are rare; here a completion lands within nanoseconds of its send, so
/// programs like `ibv_rc_pingpong -e -t`, which treat an empty CQ after an event as fatal,
/// would meet them every time.
///
/// "Nothing to poll" means no *published* completion in any ring: a producer between claiming
/// a slot and publishing it (a peer descheduled mid-push, say) must not make the CQ look
/// non-empty, or the program is woken to an empty poll. That producer reads the arm after
/// publishing, so the re-arm catches it.
pub(crate) fn take_event<'a, R, I>(rings: impl Fn() -> I) -> bool
where
    R: ArmRing + 'a,
    I: Iterator<Item = &'a R>,
{
    let mode = rings()
        .map(|r| r.event().swap(0, Ordering::AcqRel))
        .fold(0, |m, w| if w != 0 { w } else { m });
    if mode == 0 {
        return false;
    }
    let nothing = || rings().all(|r| !r.has_completion());
    if !nothing() {
        return true;
    }
    for r in rings() {
        let _ = r.arm().compare_exchange(ARM_NONE, mode, Ordering::AcqRel);
    }
    R::fence();
    if nothing() {
        // Armed again: a later completion fires.
        return false;
    }
    // A completion slipped in before the re-arm and did not fire it: deliver now, taking the
    // arms back as firing would have. If every arm has fired meanwhile, those events are
    // coming.
    rings()
        .filter(|r| r.arm().swap(ARM_NONE, Ordering::AcqRel) != ARM_NONE)
        .count()
        > 0
}

/// A channel's doorbell as the wait needs it.
pub(crate) trait Bell {
    /// Forgets the rings so far.
    fn drain(&self);
    /// Sleeps until rung (or interrupted).
    fn wait(&self) -> Result<()>;
}

impl Bell for Doorbell {
    fn drain(&self) {
        Doorbell::drain(self);
    }
    fn wait(&self) -> Result<()> {
        Doorbell::wait(self)
    }
}

/// `ibv_get_cq_event`'s wait: what `take` finds, looking again after draining the doorbell
/// (an event flagged before a ring that was drained is seen then) and, when `blocking`,
/// sleeping until rung between tries; `None` when not blocking and nothing is there.
///
/// Producers flag the event, then ring; so an event flagged after the second look rings the
/// doorbell after the drain, and the sleep ends.
pub(crate) fn wait_for<T>(
    bell: &impl Bell,
    blocking: bool,
    mut take: impl FnMut() -> Option<T>,
) -> Result<Option<T>> {
    loop {
        if let Some(t) = take() {
            return Ok(Some(t));
        }
        bell.drain();
        if let Some(t) = take() {
            return Ok(Some(t));
        }
        if !blocking {
            return Ok(None);
        }
        bell.wait()?;
    }
}

#[cfg(test)]
mod model;
