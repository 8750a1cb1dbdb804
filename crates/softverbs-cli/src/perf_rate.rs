//! `perf`'s message rates and their limit: what the figures are, and the raw ring they are
//! measured against (the RDMA loops themselves are with the other tests, in `perf`).
//!
//! **Message rate** (64-byte RDMA WRITE, SEND and READ): as `ib_write_bw -s 64` does by
//! default, at most [`TX_DEPTH`] work requests outstanding, one in [`CQ_MOD`] signaled; the
//! figure is messages per second from the first post to the last completion. WRITE also runs
//! with one QP per CPU, each driven by a thread pinned to its CPU.
//!
//! **The raw ring**, this path's limit: the same two processes through a ring in shared
//! memory, carrying what the NIC must carry per message and no more: a 64-byte descriptor
//! written by the initiator, its 64-byte payload copied by the target into the target's own
//! buffer, and a completion word written back every [`CQ_MOD`] messages, with at most
//! [`TX_DEPTH`] messages outstanding; the fastest of [`RAW_RING_RUNS`] runs, each through
//! pages of its own.
//!
//! **READ and fetch-and-add latency**: one operation at a time, each signaled, timed from the
//! post to its completion: a whole round trip, which `ib_read_lat` and `ib_atomic_lat` report
//! as it is (the WRITE and SEND ping-pongs report half of theirs).

use crate::Result;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Waits until the condition holds, or fails (the peer process stopped): the caller's
/// busy-wait, with its timeouts and its watch on the peer.
pub(crate) type Wait<'a> = &'a dyn Fn(&dyn Fn() -> bool) -> Result<()>;

/// Bytes of each message.
pub(crate) const MSG_SIZE: usize = 64;
/// Work requests outstanding at most (perftest's default `--tx-depth`).
pub(crate) const TX_DEPTH: u64 = 128;
/// One work request in this many is signaled (perftest's default `--cq-mod`).
pub(crate) const CQ_MOD: u64 = 100;
/// Receives the SEND target keeps posted (perftest's default `--rx-depth`).
pub(crate) const RX_DEPTH: usize = 512;
/// Messages per rate figure.
pub(crate) const MESSAGES: u64 = 1_000_000;
/// Runs of the raw ring; its figure is the fastest.
pub(crate) const RAW_RING_RUNS: usize = 5;
pub(crate) const QUICK_MESSAGES: u64 = 50_000;

/// One rate figure.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RateFigure {
    pub(crate) op: &'static str,
    pub(crate) qps: usize,
    pub(crate) messages: u64,
    pub(crate) seconds: f64,
    pub(crate) msgs_per_sec: f64,
    /// msgs_per_sec / the raw ring's.
    pub(crate) ratio_to_raw_ring: f64,
}

/// One round-robin rate figure (see [`crate::perf_fan`]).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FanFigure {
    pub(crate) qps: usize,
    pub(crate) messages: u64,
    pub(crate) seconds: f64,
    pub(crate) msgs_per_sec: f64,
    /// msgs_per_sec / the same loop's over one QP.
    pub(crate) ratio_to_one_qp: f64,
}

/// The rates of a run and their limit.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Rates {
    pub(crate) raw_ring_msgs_per_sec: f64,
    pub(crate) figures: Vec<RateFigure>,
    /// WRITE with one QP per CPU, against CPUs × one QP's WRITE rate.
    pub(crate) per_cpu_scaling: Option<f64>,
    /// WRITE round robin over 1, 64, ... QPs, each against the one-QP run of the same loop.
    pub(crate) round_robin: Vec<FanFigure>,
}

// ---------------------------------------------------------------------------------------------
// The raw ring.

/// Descriptor slots of the raw ring.
const RING: usize = TX_DEPTH as usize;
/// Words of a descriptor and of a payload.
const WORDS: usize = MSG_SIZE / 8;

/// The raw ring's words in the shared memory: the completion word, then RING descriptors,
/// then RING payloads.
pub(crate) const RING_WORDS: usize = 8 + 2 * RING * WORDS;

struct RawRing<'a> {
    words: &'a [AtomicU64],
}

impl<'a> RawRing<'a> {
    fn new(words: &'a [AtomicU64]) -> RawRing<'a> {
        assert!(
            words.len() >= RING_WORDS,
            "the raw ring's memory is too small"
        );
        RawRing { words }
    }

    fn completed(&self) -> &AtomicU64 {
        &self.words[0]
    }

    fn descriptor(&self, slot: usize) -> &[AtomicU64] {
        let at = 8 + slot * WORDS;
        &self.words[at..at + WORDS]
    }

    fn payload(&self, slot: usize) -> &[AtomicU64] {
        let at = 8 + (RING + slot) * WORDS;
        &self.words[at..at + WORDS]
    }
}

/// The initiator's side of the raw ring: `messages` descriptors with their payloads; returns
/// the seconds from the first to the last completion word. `words` was zeroed by the caller
/// before the consumer started. Never inlined, nor is the consumer: a baseline's code must not
/// depend on where it is called from (inlined by the whole-program optimisation of release
/// builds into its caller, the ring read 54 M msg/s instead of 60-62).
#[inline(never)]
pub(crate) fn raw_ring_producer(words: &[AtomicU64], messages: u64, wait: Wait<'_>) -> Result<f64> {
    let ring = RawRing::new(words);
    let t0 = Instant::now();
    for seq in 0..messages {
        if seq >= TX_DEPTH {
            let need = seq + 1 - TX_DEPTH;
            if ring.completed().load(Ordering::Acquire) < need {
                wait(&|| ring.completed().load(Ordering::Acquire) >= need)?;
            }
        }
        let slot = (seq % TX_DEPTH) as usize;
        for (i, w) in ring.payload(slot).iter().enumerate() {
            w.store(seq ^ i as u64, Ordering::Relaxed);
        }
        let d = ring.descriptor(slot);
        d[1].store(seq, Ordering::Relaxed); // wr_id
        d[2].store((slot * MSG_SIZE) as u64, Ordering::Relaxed); // target offset
        d[3].store(MSG_SIZE as u64, Ordering::Relaxed); // length
        d[0].store(seq + 1, Ordering::Release); // valid
    }
    wait(&|| ring.completed().load(Ordering::Acquire) >= messages)?;
    Ok(t0.elapsed().as_secs_f64())
}

/// The target's side of the raw ring: consumes `messages` descriptors, copying each payload
/// into its own buffer, and writes the completion word every CQ_MOD messages and at the end;
/// checks every payload it copied.
#[inline(never)]
pub(crate) fn raw_ring_consumer(words: &[AtomicU64], messages: u64, wait: Wait<'_>) -> Result<()> {
    let ring = RawRing::new(words);
    let mut buf = vec![0u64; RING * WORDS];
    for seq in 0..messages {
        let slot = (seq % TX_DEPTH) as usize;
        let d = ring.descriptor(slot);
        if d[0].load(Ordering::Acquire) != seq + 1 {
            wait(&|| d[0].load(Ordering::Acquire) == seq + 1)?;
        }
        let at = d[2].load(Ordering::Relaxed) as usize / 8;
        let len = d[3].load(Ordering::Relaxed) as usize / 8;
        let dst = buf
            .get_mut(at..at + len)
            .ok_or("raw ring: a descriptor out of range")?;
        for (b, w) in dst.iter_mut().zip(ring.payload(slot)) {
            *b = w.load(Ordering::Relaxed);
        }
        if dst[WORDS - 1] != seq ^ (WORDS as u64 - 1) {
            return Err(format!("raw ring: message {seq} arrived torn").into());
        }
        if (seq + 1) % CQ_MOD == 0 || seq + 1 == messages {
            ring.completed().store(seq + 1, Ordering::Release);
        }
    }
    Ok(())
}

impl Rates {
    pub(crate) fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        for f in &self.figures {
            let _ = writeln!(
                t,
                "  {} 64 B message rate, {} QP{}: {:.2} M msg/s (raw ring {:.2} M msg/s, {:.2}x); \
                 {} messages in {:.3} s",
                f.op,
                f.qps,
                if f.qps == 1 { "" } else { "s, one per CPU" },
                f.msgs_per_sec / 1e6,
                self.raw_ring_msgs_per_sec / 1e6,
                f.ratio_to_raw_ring,
                f.messages,
                f.seconds
            );
        }
        if let Some(s) = self.per_cpu_scaling {
            let _ = writeln!(
                t,
                "  RDMA WRITE with one QP per CPU: {s:.2}x of CPUs x one QP's rate"
            );
        }
        for f in &self.round_robin {
            let _ = writeln!(
                t,
                "  RDMA WRITE 64 B round robin over {} QP{}: {:.2} M msg/s ({:.2}x of one QP's); \
                 {} messages in {:.3} s",
                f.qps,
                if f.qps == 1 { "" } else { "s" },
                f.msgs_per_sec / 1e6,
                f.ratio_to_one_qp,
                f.messages,
                f.seconds
            );
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_raw_ring_carries_every_message_between_two_threads() {
        let words: Vec<AtomicU64> = (0..RING_WORDS).map(|_| AtomicU64::new(0)).collect();
        let spin = |done: &dyn Fn() -> bool| {
            while !done() {
                std::thread::yield_now();
            }
            Ok(())
        };
        let n = 10_000;
        std::thread::scope(|s| {
            s.spawn(|| raw_ring_consumer(&words, n, &spin).unwrap());
            assert!(raw_ring_producer(&words, n, &spin).unwrap() > 0.0);
        });
        assert_eq!(
            words[0].load(Ordering::Acquire),
            n,
            "every message completed"
        );
    }
}
