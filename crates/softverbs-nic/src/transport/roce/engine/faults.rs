//! Seeded faults on the real path: each datagram leaving the engine may be dropped,
//! duplicated, held back behind the next one, or have a byte flipped, at the rates the
//! device was configured with; a delay holds every datagram.

use super::outbox::Outbox;
use crate::config::Faults;
use softverbs_roce::Time;
use softverbs_roce::sim::SplitMix64;
use std::collections::VecDeque;
use std::net::IpAddr;

/// What the fault injector did, for the counters.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FaultCounts {
    pub(crate) dropped: u64,
    pub(crate) duplicated: u64,
    pub(crate) reordered: u64,
    pub(crate) corrupted: u64,
    pub(crate) delayed: u64,
}

pub(crate) struct FaultInjector {
    cfg: Faults,
    rng: SplitMix64,
    held: Option<(IpAddr, Vec<u8>)>,
    delayed: VecDeque<(Time, IpAddr, Vec<u8>)>,
    pub(crate) counts: FaultCounts,
}

impl FaultInjector {
    pub(crate) fn new(cfg: Faults) -> FaultInjector {
        FaultInjector {
            cfg,
            rng: SplitMix64::new(cfg.seed ^ 0x005e_ed0f_fa17),
            held: None,
            delayed: VecDeque::new(),
            counts: FaultCounts::default(),
        }
    }

    pub(crate) fn active(&self) -> bool {
        self.cfg.any()
    }

    /// Applies the faults to the datagram just added to `out` (its last): it stays, goes,
    /// is joined by a copy or by the datagram held back before it, or waits.
    pub(crate) fn apply_last(&mut self, now: Time, out: &mut Outbox) {
        let before = out.len().saturating_sub(1);
        if self.rng.chance(self.cfg.drop) {
            self.counts.dropped += 1;
            out.pop();
            return;
        }
        if self.rng.chance(self.cfg.corrupt)
            && let Some((dst, d)) = out.last_mut()
            && d.len() > 48
        {
            // A byte of the transport headers or payload (the kernel remakes IP and UDP).
            let skip = if dst.is_ipv4() { 28 } else { 48 };
            let at = skip + self.rng.below((d.len() - skip) as u64) as usize;
            d[at] ^= 1 << self.rng.below(8);
            self.counts.corrupted += 1;
        }
        if self.rng.chance(self.cfg.duplicate)
            && let Some((dst, d)) = out.last_mut()
        {
            let copy = d.to_vec();
            self.counts.duplicated += 1;
            out.push(dst, &copy);
        }
        if self.held.is_none() && self.rng.chance(self.cfg.reorder) {
            self.counts.reordered += 1;
            self.held = out.pop();
        } else if let Some((dst, d)) = self.held.take() {
            out.push(dst, &d);
        }
        if self.cfg.delay_us > 0 {
            let at = now.after(std::time::Duration::from_micros(self.cfg.delay_us));
            let mut now_out = Vec::new();
            while out.len() > before {
                now_out.extend(out.pop());
            }
            for (dst, d) in now_out.into_iter().rev() {
                self.counts.delayed += 1;
                self.delayed.push_back((at, dst, d));
            }
        }
    }

    /// Delayed datagrams whose time came, into `out` while it has room.
    pub(crate) fn due(&mut self, now: Time, out: &mut Outbox) {
        while self.delayed.front().is_some_and(|(t, ..)| *t <= now) && out.has_room() {
            if let Some((_, dst, d)) = self.delayed.pop_front() {
                out.push(dst, &d);
            }
        }
    }

    /// When the next delayed datagram is due.
    pub(crate) fn next_due(&self) -> Option<Time> {
        self.delayed.front().map(|(t, ..)| *t)
    }

    /// The datagram held back for reordering (it goes with the next one, or on its own
    /// when the engine would otherwise go to sleep).
    pub(crate) fn release_held(&mut self, out: &mut Outbox) {
        if let Some((dst, d)) = self.held.take() {
            out.push(dst, &d);
        }
    }
}
