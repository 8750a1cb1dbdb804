//! The arm/fire/collect protocol under loom: every interleaving of the parties, and every
//! value the memory model lets each load return (loom keeps each atomic's store history, so a
//! load may read a store that another thread has made but not yet made visible to it: the
//! store buffering that lost events on x86).
//!
//! The functions under test are the NIC's own ([`fire`], [`arm`], [`take_event`],
//! [`wait_for`]); only the ring and the doorbell are models:
//! - [`ModelRing`]: a CQ ring's sequence words as [`Ring`] uses them (a producer claims a slot,
//!   writes it, publishes it with a release store; a consumer checks a slot with an acquire
//!   load and takes it by moving the head, under the CQ's consumer lock), the arm and the
//!   event flag.
//!   A peer process completing into a CQ it mapped does exactly what a thread does here, on
//!   the same shared memory, so the cross-process case is the threaded one.
//! - [`ModelBell`]: a pipe's readability (ringing writes a byte, draining reads them all,
//!   waiting sleeps until a byte is there); the kernel's pipe lock orders it like a mutex.
//!
//! A lost event leaves the program asleep on the bell with every producer done, which loom
//! reports as a deadlock; an event with nothing to poll fails an assertion.

use super::*;
use loom::sync::atomic::{AtomicU32 as LoomU32, AtomicU64 as LoomU64};
use loom::sync::{Condvar, Mutex};
// std's Arc: loom's would run model code in its destructor while a failed execution unwinds.
use loom::thread;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

word_for!(LoomU32);

/// More slots than any model pushes, so producers never meet a full ring.
const SLOTS: usize = 4;

/// A CQ ring: Vyukov sequence words, one payload word per slot (1: a solicited completion),
/// the arm and the event flag. `FENCED = false` is the protocol as it was before the fences.
struct ModelRing<const FENCED: bool> {
    seq: [LoomU64; SLOTS],
    payload: [LoomU32; SLOTS],
    head: LoomU64,
    tail: LoomU64,
    arm: LoomU32,
    event: LoomU32,
}

impl<const FENCED: bool> ModelRing<FENCED> {
    fn new() -> Self {
        ModelRing {
            seq: std::array::from_fn(|i| LoomU64::new(i as u64)),
            payload: std::array::from_fn(|_| LoomU32::new(0)),
            head: LoomU64::new(0),
            tail: LoomU64::new(0),
            arm: LoomU32::new(ARM_NONE),
            event: LoomU32::new(0),
        }
    }

    /// `push_ring`: publish, then [`fire`]; true if the producer must ring the bell.
    fn push(&self, solicited: bool) -> bool {
        let pos = self.tail.fetch_add(1, Ordering::Relaxed);
        let slot = pos as usize % SLOTS;
        self.payload[slot].store(u32::from(solicited), Ordering::Relaxed);
        self.seq[slot].store(pos + 1, Ordering::Release);
        fire(self, solicited)
    }

    /// `Ring::pop_with_exclusive`: the oldest published completion (is it solicited?), if
    /// any. The model has one consumer, as the CQ's consumer lock makes it.
    fn pop(&self) -> Option<bool> {
        let pos = self.head.load(Ordering::Relaxed);
        let slot = pos as usize % SLOTS;
        if self.seq[slot].load(Ordering::Acquire) != pos + 1 {
            return None;
        }
        self.head.store(pos + 1, Ordering::Relaxed);
        let solicited = self.payload[slot].load(Ordering::Relaxed) != 0;
        self.seq[slot].store(pos + SLOTS as u64, Ordering::Release);
        Some(solicited)
    }
}

impl<const FENCED: bool> ArmRing for ModelRing<FENCED> {
    type Word = LoomU32;
    fn arm(&self) -> &LoomU32 {
        &self.arm
    }
    fn event(&self) -> &LoomU32 {
        &self.event
    }
    fn has_completion(&self) -> bool {
        let pos = self.head.load(Ordering::Acquire);
        self.seq[pos as usize % SLOTS].load(Ordering::Acquire) == pos + 1
    }
    fn fence() {
        if FENCED {
            loom::sync::atomic::fence(Ordering::SeqCst);
        }
    }
}

/// A pipe used as a doorbell: readable while rung.
struct ModelBell {
    rung: Mutex<bool>,
    cv: Condvar,
}

impl ModelBell {
    fn new() -> Self {
        ModelBell {
            rung: Mutex::new(false),
            cv: Condvar::new(),
        }
    }
}

impl ModelBell {
    /// A producer writes a byte into the pipe.
    fn ring(&self) {
        *self.rung.lock().unwrap() = true;
        self.cv.notify_all();
    }
}

impl Bell for ModelBell {
    fn drain(&self) {
        *self.rung.lock().unwrap() = false;
    }
    fn wait(&self) -> Result<()> {
        let mut rung = self.rung.lock().unwrap();
        while !*rung {
            rung = self.cv.wait(rung).unwrap();
        }
        Ok(())
    }
}

/// One CQ (its rings, oldest first) on one channel, shared by the program and its producers.
struct Cq<const FENCED: bool> {
    rings: Vec<ModelRing<FENCED>>,
    bell: ModelBell,
}

impl<const FENCED: bool> Cq<FENCED> {
    fn new(rings: usize) -> Arc<Self> {
        Arc::new(Cq {
            rings: (0..rings).map(|_| ModelRing::new()).collect(),
            bell: ModelBell::new(),
        })
    }

    /// A producer (a thread here, or a peer process) adds a completion to ring `ring`.
    fn complete(&self, ring: usize, solicited: bool) {
        if self.rings[ring].push(solicited) {
            self.bell.ring();
        }
    }

    /// `ibv_req_notify_cq`.
    fn arm(&self, solicited_only: bool) {
        arm(self.rings.iter(), solicited_only);
    }

    /// `ibv_get_cq_event`, blocking.
    fn get_event(&self) {
        let got = wait_for(&self.bell, true, || {
            take_event(|| self.rings.iter()).then_some(())
        });
        assert!(matches!(got, Ok(Some(()))));
    }

    /// `ibv_poll_cq` until empty, oldest ring first: the completions taken (solicited or not).
    fn poll(&self) -> Vec<bool> {
        let mut got = Vec::new();
        for r in &self.rings {
            while let Some(s) = r.pop() {
                got.push(s);
            }
        }
        got
    }
}

/// Runs `f` under loom with at most `preemptions` forced switches per execution (the bound
/// keeps the bigger models to seconds; every race here needs fewer); returns how many
/// executions were explored.
fn check(preemptions: usize, f: impl Fn() + Sync + Send + 'static) -> usize {
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(preemptions);
    model.check(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        f();
    });
    let n = runs.load(Ordering::Relaxed);
    eprintln!("loom explored {n} executions");
    n
}

/// The program arms, then polls; if the poll finds nothing it waits for the event, which
/// must come, and then finds the completion. One producer adds one completion meanwhile.
fn arm_poll_then_wait<const FENCED: bool>() {
    let cq = Cq::<FENCED>::new(1);
    let producer = {
        let cq = cq.clone();
        thread::spawn(move || cq.complete(0, false))
    };
    cq.arm(false);
    if cq.poll().is_empty() {
        cq.get_event();
        assert_eq!(cq.poll().len(), 1, "an event with nothing to poll");
    }
    producer.join().unwrap();
}

#[test]
fn the_next_completion_after_arming_raises_the_event_or_is_seen_by_the_poll() {
    assert!(check(9, arm_poll_then_wait::<true>) > 1);
}

/// The protocol without the fences (as before them) loses the event: the producer reads the
/// arm before the program's arm reaches it, the program's poll reads the slot before the
/// producer's publish reaches it, and the program sleeps for good. The checker must find
/// that, or it would not find the next race of this kind either.
#[test]
fn without_the_fences_the_checker_finds_the_lost_event() {
    let lost = std::panic::catch_unwind(|| check(3, arm_poll_then_wait::<false>));
    let msg = lost.expect_err("loom found no lost event without the fences");
    let msg = msg
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| msg.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains("deadlock"), "{msg}");
}

/// `ibv_rc_pingpong -e`: arm before anything can complete, then per event re-arm and poll,
/// and every event must find a completion. Two producers (the program's own send completing,
/// and the peer process's SEND arriving) add three completions between them, so events for
/// completions already polled are met (and withheld, the CQ armed again) along the way.
#[test]
fn event_driven_ping_pong_never_loses_an_event_nor_wakes_to_an_empty_cq() {
    let n = check(4, || {
        let cq = Cq::<true>::new(1);
        cq.arm(false);
        let local = {
            let cq = cq.clone();
            thread::spawn(move || {
                cq.complete(0, false);
                cq.complete(0, false);
            })
        };
        let peer = {
            let cq = cq.clone();
            thread::spawn(move || cq.complete(0, false))
        };
        let mut got = 0;
        while got < 3 {
            cq.get_event();
            cq.arm(false);
            let n = cq.poll().len();
            assert!(n > 0, "an event with nothing to poll");
            got += n;
        }
        local.join().unwrap();
        peer.join().unwrap();
    });
    assert!(n > 1);
}

/// The channel holds a fired event whose completion was polled already (stale), while a
/// producer adds a completion: the event is withheld and the CQ re-armed, and either the new
/// completion fires the re-armed CQ or the channel sees it slip in; the program wakes, and
/// finds it.
#[test]
fn a_withheld_stale_event_races_a_new_completion() {
    let n = check(9, || {
        let cq = Cq::<true>::new(1);
        cq.rings[0].event.store(ARM_NEXT, Ordering::Relaxed);
        let producer = {
            let cq = cq.clone();
            thread::spawn(move || cq.complete(0, false))
        };
        cq.get_event();
        assert_eq!(cq.poll().len(), 1, "an event with nothing to poll");
        producer.join().unwrap();
    });
    assert!(n > 1);
}

/// Solicited-only: an unsolicited completion does not fire the arm; the solicited one that
/// follows does, and is visible once the event is.
#[test]
fn a_solicited_only_arm_fires_on_the_solicited_completion() {
    let n = check(9, || {
        let cq = Cq::<true>::new(1);
        cq.arm(true);
        let producer = {
            let cq = cq.clone();
            thread::spawn(move || {
                cq.complete(0, false);
                cq.complete(0, true);
            })
        };
        let mut got = Vec::new();
        while !got.contains(&true) {
            cq.get_event();
            let polled = cq.poll();
            assert!(
                polled.contains(&true),
                "woken without the solicited completion"
            );
            got.extend(polled);
        }
        producer.join().unwrap();
    });
    assert!(n > 1);
}

/// After a resize kept the old ring, a peer that has not moved yet completes into the old ring
/// while this process completes into the new one: arming covers both, and the event comes.
#[test]
fn a_resized_cqs_old_ring_still_raises_the_event() {
    let n = check(4, || {
        let cq = Cq::<true>::new(2);
        let peer = {
            let cq = cq.clone();
            thread::spawn(move || cq.complete(0, false))
        };
        let local = {
            let cq = cq.clone();
            thread::spawn(move || cq.complete(1, false))
        };
        cq.arm(false);
        let mut got = cq.poll().len();
        while got < 2 {
            cq.get_event();
            cq.arm(false);
            got += cq.poll().len();
        }
        peer.join().unwrap();
        local.join().unwrap();
    });
    assert!(n > 1);
}
