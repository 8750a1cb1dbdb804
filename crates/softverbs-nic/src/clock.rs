//! The device clock: a free-running counter every completion is stamped with.
//!
//! It ticks in nanoseconds of `CLOCK_MONOTONIC` (so `hca_core_clock` is 1,000,000 kHz) and is
//! truncated to `completion_timestamp_mask`, whose width is a device option so wrap-around can
//! be produced on purpose.

use rustix::time::{ClockId, clock_gettime};

/// A device clock of a given width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock {
    mask: u64,
}

impl Clock {
    /// Ticks per millisecond (`hca_core_clock` is in kHz).
    pub const KHZ: u64 = 1_000_000;

    /// A clock whose raw value has `bits` bits (1..=64).
    pub fn new(bits: u32) -> Clock {
        let bits = bits.clamp(1, 64);
        Clock {
            mask: if bits == 64 {
                u64::MAX
            } else {
                (1u64 << bits) - 1
            },
        }
    }

    /// `completion_timestamp_mask`.
    pub fn mask(&self) -> u64 {
        self.mask
    }

    /// Monotonic nanoseconds, untruncated.
    pub fn now_ns(&self) -> u64 {
        let t = clock_gettime(ClockId::Monotonic);
        (t.tv_sec as u64)
            .wrapping_mul(1_000_000_000)
            .wrapping_add(t.tv_nsec as u64)
    }

    /// The raw clock value now.
    pub fn now_raw(&self) -> u64 {
        self.now_ns() & self.mask
    }

    /// Ticks from `earlier` to `later`, correct across one wrap of the mask.
    pub fn delta(&self, earlier: u64, later: u64) -> u64 {
        later.wrapping_sub(earlier) & self.mask
    }
}

/// A reading of the wall clock and the device clock taken together, to turn raw completion
/// timestamps near it into `CLOCK_REALTIME` nanoseconds with two instructions each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WallClock {
    real_ns: u64,
    raw: u64,
    mask: u64,
}

impl WallClock {
    /// Realtime nanoseconds of the raw device-clock value `ts`, which may lie before or after
    /// the reading (by less than half the clock's range).
    #[inline]
    pub fn ns(&self, ts: u64) -> u64 {
        let d = ts.wrapping_sub(self.raw) & self.mask;
        // Differences in the upper half of the mask are negative.
        if d > self.mask >> 1 {
            self.real_ns.wrapping_sub((self.mask - d).wrapping_add(1))
        } else {
            self.real_ns.wrapping_add(d)
        }
    }
}

impl Clock {
    /// Reads the wall clock and this clock together.
    pub fn wall(&self) -> WallClock {
        let raw = self.now_raw();
        let t = clock_gettime(ClockId::Realtime);
        WallClock {
            real_ns: (t.tv_sec as u64)
                .wrapping_mul(1_000_000_000)
                .wrapping_add(t.tv_nsec as u64),
            raw,
            mask: self.mask,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_handles_wrap() {
        let c = Clock::new(16);
        assert_eq!(c.mask(), 0xffff);
        assert_eq!(c.delta(0xfff0, 0x0010), 0x20);
        assert!(c.now_raw() <= 0xffff);
        let c = Clock::new(64);
        assert_eq!(c.delta(5, 9), 4);
    }

    #[test]
    fn wall_clock_of_stamps_before_and_after_the_reading() {
        let w = WallClock {
            real_ns: 1_000_000,
            raw: 0x0008,
            mask: 0xffff,
        };
        assert_eq!(w.ns(0x0008), 1_000_000);
        assert_eq!(w.ns(0x0010), 1_000_008);
        // Before the reading, across the wrap.
        assert_eq!(w.ns(0xfff8), 1_000_000 - 16);
        let c = Clock::new(64);
        let w = c.wall();
        let now = c.now_raw();
        let real = w.ns(now);
        assert!(real >= w.real_ns && real - w.real_ns < 1_000_000_000);
        assert_eq!(w.ns(now.wrapping_sub(1000)), real - 1000);
    }
}
