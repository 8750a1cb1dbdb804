//! The two timer encodings of the verbs.

use std::time::Duration;

/// The RNR NAK timer: microseconds for each 5-bit code (IBTA table 45; code 0 is the
/// longest, 655.36 ms).
const RNR_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
    5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
    245_760, 327_680, 491_520,
];

/// How long a requester waits after an RNR NAK carrying timer `code` (its low five bits).
pub fn rnr_timer(code: u8) -> Duration {
    Duration::from_micros(u64::from(RNR_US[usize::from(code & 0x1f)]))
}

/// The local ACK timeout for the QP attribute `timeout`: 4.096 µs × 2^timeout, `None` (wait
/// forever) for 0. Exponents above 31 are taken as 31.
pub fn transport_timeout(timeout: u8) -> Option<Duration> {
    (timeout != 0).then(|| Duration::from_nanos(4096u64 << timeout.min(31)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_are_the_specs() {
        assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
        assert_eq!(rnr_timer(1), Duration::from_micros(10));
        assert_eq!(rnr_timer(12), Duration::from_micros(640));
        assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
        assert_eq!(rnr_timer(0xff), rnr_timer(31));
        assert_eq!(transport_timeout(0), None);
        assert_eq!(transport_timeout(1), Some(Duration::from_nanos(8192)));
        assert_eq!(
            transport_timeout(14),
            Some(Duration::from_nanos(67_108_864))
        );
        assert_eq!(transport_timeout(200), transport_timeout(31));
    }
}
