//! The simulator's only source of randomness.
//!
//! A run must replay bit for bit from its seed on every platform and every Rust release, so
//! the generator is written out here (SplitMix64, Steele, Lea and Flood, "Fast splittable
//! pseudorandom number generators", 2014) rather than taken from a crate whose stream might
//! change between versions. It uses only wrapping 64-bit integer arithmetic; the one floating
//! point step ([`SplitMix64::chance`]) is an exact integer-to-`f64` conversion and a
//! comparison, both fully specified by IEEE 754.

/// A small, fast, seeded pseudorandom generator whose output is fixed by its seed alone.
///
/// Public so that tests driving the simulator can draw their workloads (sizes, operation mixes)
/// from the same seed that drives the network, keeping one number enough to replay a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose whole output stream is determined by `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        finalize(self.state)
    }

    /// A value uniform in `0..n` (0 when `n` is 0).
    ///
    /// Multiply-and-shift rather than `%`: no division, and a bias below 2^-64 · n, far under
    /// anything a test could observe.
    pub fn below(&mut self, n: u64) -> u64 {
        scale(self.next_u64(), n)
    }

    /// `true` with probability `p` (never for `p <= 0`, always for `p >= 1`).
    pub fn chance(&mut self, p: f64) -> bool {
        unit(self.next_u64()) < p
    }
}

/// SplitMix64's output function: a bijective mix of 64 bits.
fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Combines two values into a seed for an independent stream; used to give every link, and
/// every datagram on a link, its own stream, so that one datagram's fate does not depend on
/// how many random draws earlier datagrams needed.
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    finalize(a ^ finalize(b.wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

/// `x` (uniform over u64) mapped to `0..n`.
pub(crate) fn scale(x: u64, n: u64) -> u64 {
    ((u128::from(x) * u128::from(n)) >> 64) as u64
}

/// `x` (uniform over u64) mapped to `[0, 1)` with 53 bits of precision, exactly.
pub(crate) fn unit(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_reference_stream() {
        // The reference implementation (prng.di.unimi.it/splitmix64.c) from seed 0.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn below_and_chance_bounds() {
        let mut r = SplitMix64::new(1);
        assert_eq!(r.below(0), 0);
        for _ in 0..1000 {
            assert!(r.below(7) < 7);
            assert!(!r.chance(0.0));
            assert!(r.chance(1.0));
        }
        assert_eq!(scale(u64::MAX, 10), 9);
        assert_eq!(scale(0, 10), 0);
        assert!(unit(u64::MAX) < 1.0);
    }

    #[test]
    fn mix_separates_streams() {
        assert_ne!(mix(1, 2), mix(2, 1));
        assert_ne!(mix(0, 0), mix(0, 1));
    }
}
