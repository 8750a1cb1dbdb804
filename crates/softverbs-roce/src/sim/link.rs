//! One directed link: its configuration, its scheduled faults, and the state that makes
//! datagrams queue behind each other.
//!
//! A datagram's whole fate (dropped or not, corrupted or not, when it arrives, whether a copy
//! follows) is decided the moment it is sent. The random choices for the `k`-th datagram on a
//! link come from a stream seeded by (network seed, link, `k`) and are always drawn in the
//! same order and number, so turning one fault up or down leaves every other fault's choices
//! unchanged: a test that adds 1% loss to a run still sees the same datagrams corrupted.

use std::collections::VecDeque;
use std::time::Duration;

use super::counters::Counters;
use super::rng::{SplitMix64, mix, scale, unit};
use crate::Time;

/// How one directed link behaves: a fixed delay, a serialization rate, a queue, and faults.
///
/// The defaults are a perfect link with 1 µs of latency (not zero, so that two hosts that
/// answer each other at once still make the clock move) and no bandwidth limit.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkConfig {
    /// One-way propagation delay, added to every datagram after it is serialized.
    pub latency: Duration,
    /// Serialization rate in bytes per second; `None` for infinitely fast. A datagram of
    /// `len` bytes occupies the link for `ceil(len * 1e9 / bandwidth)` ns, and datagrams wait
    /// for the ones before them (FIFO). Must not be `Some(0)`.
    pub bandwidth: Option<u64>,
    /// The most datagrams the link holds at once, counting the one being serialized; a
    /// datagram arriving at a full queue is tail-dropped. `None` for unbounded. Only matters
    /// with a finite `bandwidth` (otherwise nothing ever waits).
    pub queue_limit: Option<usize>,
    /// Random faults, each a probability per datagram.
    pub faults: Faults,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            latency: Duration::from_micros(1),
            bandwidth: None,
            queue_limit: None,
            faults: Faults::default(),
        }
    }
}

/// Seeded random faults. Each probability is per datagram, in `[0, 1]`; all default to 0.
///
/// They are decided in this order: loss (a lost datagram suffers nothing else), corruption,
/// jitter, reordering, duplication. A duplicate is a copy of the datagram as delivered,
/// corruption included, as a switch copying a damaged frame would make.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// Probability that a datagram is lost (after occupying the link: it still delays the
    /// datagrams behind it).
    pub loss: f64,
    /// Probability that a datagram is delivered twice.
    pub duplicate: f64,
    /// The copy arrives up to this much after the original (uniform, inclusive); zero for the
    /// same instant, right after the original.
    pub duplicate_delay: Duration,
    /// Probability that a datagram is held back so that later ones overtake it.
    pub reorder: f64,
    /// A held-back datagram is delayed by a uniform amount in `(0, reorder_delay]` on top of
    /// its normal arrival time. Zero makes reordering a no-op.
    pub reorder_delay: Duration,
    /// Probability that a datagram arrives with bits flipped. Nothing repairs it: catching it
    /// (the RoCE ICRC, the IPv4 header checksum) is the receiver's job.
    pub corrupt: f64,
    /// A corrupted datagram has between 1 and this many distinct bits flipped (uniform),
    /// in `1..=64`.
    pub corrupt_max_bits: u32,
    /// Flips land only in bytes from this offset on, e.g. 28 to spare an IPv4 and UDP header
    /// and hit only what the ICRC alone protects. A datagram no longer than this is not
    /// corrupted.
    pub corrupt_offset: usize,
    /// Probability that a datagram is delayed by jitter.
    pub jitter: f64,
    /// Jitter adds a uniform delay in `[0, jitter_delay]`. Unlike reordering it keeps the
    /// link FIFO: a jittered datagram delays the ones behind it rather than being overtaken,
    /// as queueing in a switch would.
    pub jitter_delay: Duration,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            loss: 0.0,
            duplicate: 0.0,
            duplicate_delay: Duration::ZERO,
            reorder: 0.0,
            reorder_delay: Duration::ZERO,
            corrupt: 0.0,
            corrupt_max_bits: 1,
            corrupt_offset: 0,
            jitter: 0.0,
            jitter_delay: Duration::ZERO,
        }
    }
}

impl LinkConfig {
    /// Why this configuration cannot be used, if it cannot.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.bandwidth == Some(0) {
            return Err("bandwidth must be positive (None for unlimited)".into());
        }
        let f = &self.faults;
        for (name, p) in [
            ("loss", f.loss),
            ("duplicate", f.duplicate),
            ("reorder", f.reorder),
            ("corrupt", f.corrupt),
            ("jitter", f.jitter),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("{name} probability {p} is not in [0, 1]"));
            }
        }
        if !(1..=64).contains(&f.corrupt_max_bits) {
            return Err(format!(
                "corrupt_max_bits {} is not in 1..=64",
                f.corrupt_max_bits
            ));
        }
        Ok(())
    }
}

/// A fault at a chosen datagram or time, for tests that need one exact event (lose the
/// third request, cut the link while a message is in flight) rather than a rate.
///
/// Datagram indexes count every datagram offered to the link, from 0, including ones later
/// dropped; the link's `sent` counter before the datagram is its index. Times are send times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduledFault {
    /// Drop the datagram with this index.
    DropNth(u64),
    /// Drop every datagram sent at or after `start` and before `end`: the link is down.
    /// Judged at send time, so datagrams already on their way when it starts still arrive.
    Partition {
        /// First instant of the outage.
        start: Time,
        /// First instant after it.
        end: Time,
    },
    /// Corrupt the datagram with this index (as the random fault would).
    CorruptNth(u64),
    /// Deliver the datagram with this index twice.
    DuplicateNth(u64),
    /// Hold the datagram with this index back by `delay` on top of its arrival time, so that
    /// later ones overtake it (counted as reordered).
    DelayNth {
        /// Which datagram.
        index: u64,
        /// How much later it arrives.
        delay: Duration,
    },
}

/// What the scheduled faults say about one datagram.
#[derive(Default)]
struct Forced {
    drop: bool,
    corrupt: bool,
    duplicate: bool,
    delay: u64,
    delayed: bool,
}

impl ScheduledFault {
    fn apply(&self, index: u64, now: Time, forced: &mut Forced) {
        match *self {
            ScheduledFault::DropNth(k) => forced.drop |= k == index,
            ScheduledFault::Partition { start, end } => forced.drop |= start <= now && now < end,
            ScheduledFault::CorruptNth(k) => forced.corrupt |= k == index,
            ScheduledFault::DuplicateNth(k) => forced.duplicate |= k == index,
            ScheduledFault::DelayNth { index: k, delay } => {
                if k == index {
                    forced.delayed = true;
                    forced.delay = forced.delay.saturating_add(nanos(delay));
                }
            }
        }
    }
}

/// What happens to a datagram, decided when it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// The queue was full.
    TailDropped,
    /// Lost on the wire or to a scheduled fault.
    Lost,
    /// Delivered at `at`; a copy at `copy_at` if duplicated.
    Delivered {
        at: Time,
        copy_at: Option<Time>,
        corrupted: bool,
        reordered: bool,
    },
}

/// A directed link's state.
#[derive(Debug)]
pub(crate) struct Link {
    /// `None`: the network's default.
    pub(crate) config: Option<LinkConfig>,
    pub(crate) scheduled: Vec<ScheduledFault>,
    pub(crate) counters: Counters,
    seed: u64,
    next_index: u64,
    /// When the link finishes serializing what it already holds.
    busy_until: Time,
    /// When each datagram the link holds finishes serializing, oldest first.
    queue: VecDeque<Time>,
    /// The latest arrival of a datagram that was not held back: in-order datagrams arrive no
    /// earlier than this, which keeps the link FIFO under jitter and latency changes.
    last_arrival: Time,
}

impl Link {
    pub(crate) fn new(network_seed: u64, from: usize, to: usize) -> Link {
        Link {
            config: None,
            scheduled: Vec::new(),
            counters: Counters::default(),
            seed: mix(mix(network_seed, from as u64), to as u64),
            next_index: 0,
            busy_until: Time(0),
            queue: VecDeque::new(),
            last_arrival: Time(0),
        }
    }

    /// Decides the fate of `datagram`, offered at `now`, and flips its bits if it is to be
    /// corrupted.
    pub(crate) fn offer(&mut self, default: &LinkConfig, now: Time, datagram: &mut [u8]) -> Fate {
        let cfg = self.config.as_ref().unwrap_or(default);
        let f = &cfg.faults;
        let index = self.next_index;
        self.next_index += 1;

        // A fixed number of draws in a fixed order, whatever the configuration (see the
        // module documentation).
        let mut rng = SplitMix64::new(mix(self.seed, index));
        let loss = unit(rng.next_u64()) < f.loss;
        let corrupt = unit(rng.next_u64()) < f.corrupt;
        let jitter = unit(rng.next_u64()) < f.jitter;
        let jitter_ns = uniform_inclusive(rng.next_u64(), nanos(f.jitter_delay));
        let reorder = unit(rng.next_u64()) < f.reorder;
        let reorder_draw = rng.next_u64();
        let reorder_ns = match nanos(f.reorder_delay) {
            0 => 0,
            max => 1 + scale(reorder_draw, max),
        };
        let duplicate = unit(rng.next_u64()) < f.duplicate;
        let duplicate_ns = uniform_inclusive(rng.next_u64(), nanos(f.duplicate_delay));

        let mut forced = Forced::default();
        for fault in &self.scheduled {
            fault.apply(index, now, &mut forced);
        }
        if forced.drop {
            // The link is down or the test wants this one gone: it never occupies the wire.
            return Fate::Lost;
        }

        while self.queue.front().is_some_and(|&done| done <= now) {
            self.queue.pop_front();
        }
        if cfg
            .queue_limit
            .is_some_and(|limit| self.queue.len() >= limit)
        {
            return Fate::TailDropped;
        }
        let finish = add_ns(
            self.busy_until.max(now),
            serialization_ns(datagram.len(), cfg.bandwidth),
        );
        self.busy_until = finish;
        self.queue.push_back(finish);

        if loss {
            return Fate::Lost;
        }
        let corrupted = (corrupt || forced.corrupt)
            && flip_bits(datagram, f.corrupt_offset, f.corrupt_max_bits, &mut rng);

        let mut at = arrival_time(finish, cfg.latency, if jitter { jitter_ns } else { 0 });
        let reordered = reorder || forced.delayed;
        if reordered {
            at = add_ns(at, if reorder { reorder_ns } else { 0 });
            at = add_ns(at, forced.delay);
        } else {
            at = at.max(self.last_arrival);
            self.last_arrival = at;
        }
        let copy_at = (duplicate || forced.duplicate).then(|| add_ns(at, duplicate_ns));
        Fate::Delivered {
            at,
            copy_at,
            corrupted,
            reordered,
        }
    }
}

fn arrival_time(finish: Time, latency: Duration, jitter_ns: u64) -> Time {
    add_ns(add_ns(finish, nanos(latency)), jitter_ns)
}

/// Flips between 1 and `max_bits` distinct bits of `datagram[offset..]`; whether any were.
fn flip_bits(datagram: &mut [u8], offset: usize, max_bits: u32, rng: &mut SplitMix64) -> bool {
    let Some(region) = datagram.get_mut(offset..) else {
        return false;
    };
    let bits = (region.len() as u64).saturating_mul(8);
    if bits == 0 {
        return false;
    }
    let want = (1 + rng.below(u64::from(max_bits.max(1)))).min(bits);
    // Distinct positions: two flips of the same bit would cancel and leave the datagram
    // intact while the counters call it corrupted. `want` is at most 64.
    let mut chosen: Vec<u64> = Vec::with_capacity(want as usize);
    while (chosen.len() as u64) < want {
        let bit = rng.below(bits);
        if !chosen.contains(&bit) {
            chosen.push(bit);
        }
    }
    for bit in chosen {
        if let Some(byte) = region.get_mut((bit / 8) as usize) {
            *byte ^= 1 << (bit % 8);
        }
    }
    true
}

/// `x` mapped uniformly to `0..=max`.
fn uniform_inclusive(x: u64, max: u64) -> u64 {
    match max.checked_add(1) {
        Some(n) => scale(x, n),
        None => x,
    }
}

/// How long `len` bytes occupy a link of `bandwidth` bytes per second, rounded up.
pub(crate) fn serialization_ns(len: usize, bandwidth: Option<u64>) -> u64 {
    match bandwidth {
        None | Some(0) => 0,
        Some(bw) => {
            let ns = (len as u128 * 1_000_000_000).div_ceil(u128::from(bw));
            u64::try_from(ns).unwrap_or(u64::MAX)
        }
    }
}

pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub(crate) fn add_ns(t: Time, ns: u64) -> Time {
    Time(t.0.saturating_add(ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialization_rounds_up() {
        assert_eq!(serialization_ns(1000, None), 0);
        assert_eq!(serialization_ns(1000, Some(1_000_000_000)), 1000);
        // 100 bytes at 7 B/s: 14.285714285714... s.
        assert_eq!(serialization_ns(100, Some(7)), 14_285_714_286);
        assert_eq!(serialization_ns(usize::MAX, Some(1)), u64::MAX);
    }

    #[test]
    fn flips_are_distinct_and_bounded() {
        let mut rng = SplitMix64::new(3);
        for len in 0..40usize {
            for max_bits in [1u32, 3, 64] {
                let mut d = vec![0u8; len];
                let changed = flip_bits(&mut d, 4, max_bits, &mut rng);
                let ones: u32 = d.iter().map(|b| b.count_ones()).sum();
                assert_eq!(changed, len > 4);
                assert_eq!(changed, ones > 0);
                assert!(ones <= max_bits);
                assert!(d[..len.min(4)].iter().all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn config_checks() {
        assert!(LinkConfig::default().check().is_ok());
        let bad = |f: fn(&mut LinkConfig)| {
            let mut c = LinkConfig::default();
            f(&mut c);
            c.check().is_err()
        };
        assert!(bad(|c| c.bandwidth = Some(0)));
        assert!(bad(|c| c.faults.loss = 1.5));
        assert!(bad(|c| c.faults.jitter = f64::NAN));
        assert!(bad(|c| c.faults.corrupt_max_bits = 0));
        assert!(bad(|c| c.faults.corrupt_max_bits = 65));
    }
}
