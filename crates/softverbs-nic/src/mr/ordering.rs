//! Relaxed ordering: how the NIC places a message into memory, and the ordering check.
//!
//! A strict region (the default) receives a message's bytes with the final byte stored last,
//! with release ordering, so a program that spins on the last byte of a buffer sees the whole
//! message (what `ib_write_lat` relies on). A region registered with
//! [`AccessFlags::RELAXED_ORDERING`](crate::types::AccessFlags::RELAXED_ORDERING) promises
//! that its owner waits for the completion instead, so its bytes may land in any order.
//!
//! The *ordering check* (device option `ordering_check`) makes that promise testable: each
//! message into a relaxed region of such a device is split into pieces placed in a scrambled
//! order, final piece first, so a program that polls the last byte reads torn data. An
//! observer ([`Device::set_ordering_observer`](crate::device::Device::set_ordering_observer))
//! is called after every scrambled piece, while the rest of the message is not yet placed,
//! which lets a test look at the torn state deterministically.
//!
//! What never changes: a completion means every byte of its message, and of all earlier
//! messages of the same queue pair, is in place; and a relaxed message is fully placed before
//! any later work request of its queue pair (an atomic included) executes, so relaxed writes
//! never pass atomics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// How a message is placed into its destination registration(s).
///
/// Ordered from most to least constrained: a message that lands in several registrations is
/// placed the way the most constrained of them needs (the minimum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Placement {
    /// Final byte last, published with release ordering.
    Strict = 0,
    /// Any order (one plain copy).
    Relaxed = 1,
    /// The ordering check: pieces in a scrambled order, final piece first.
    Scrambled = 2,
}

impl Placement {
    /// The value stored in the shared key table.
    pub(crate) fn to_raw(self) -> u32 {
        self as u32
    }

    /// Reads a stored value; anything unknown (a corrupt or newer table) is strict, which is
    /// always a correct placement.
    pub(crate) fn from_raw(raw: u32) -> Placement {
        match raw {
            1 => Placement::Relaxed,
            2 => Placement::Scrambled,
            _ => Placement::Strict,
        }
    }
}

/// At most this many pieces per scrambled message (fewer for messages shorter than this).
pub const MAX_SCRAMBLED_PIECES: usize = 64;

/// One piece of a scrambled placement, as the ordering observer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrambledPiece {
    /// Position in placement order: 0 is the first piece placed (always the final piece of
    /// the message).
    pub step: usize,
    /// How many pieces the message has.
    pub pieces: usize,
    /// Byte offset of the piece in the message.
    pub offset: usize,
    /// Length of the piece.
    pub len: usize,
    /// Length of the whole message.
    pub message_len: usize,
}

/// Called on the placing thread after each scrambled piece has been stored, before the next
/// one; placement waits while it runs.
pub type OrderingObserver = Arc<dyn Fn(&ScrambledPiece) + Send + Sync>;

/// Length of each piece (the last may be shorter) when `total` bytes are scrambled.
pub(crate) fn piece_len(total: usize) -> usize {
    total.div_ceil(MAX_SCRAMBLED_PIECES).max(1)
}

/// The order in which the `pieces` pieces of a message are placed: the final piece first,
/// then the others shuffled by `seed`, never in ascending order when there are at least
/// three (so the scramble is visible to any reader, not only to one polling the last byte).
pub(crate) fn scrambled_order(pieces: usize, seed: u64) -> Vec<usize> {
    if pieces == 0 {
        return Vec::new();
    }
    let mut rest: Vec<usize> = (0..pieces - 1).collect();
    // xorshift64*: a deterministic shuffle, so a given seed always gives the same order.
    let mut x = seed | 1;
    for i in (1..rest.len()).rev() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
        rest.swap(i, (r % (i as u64 + 1)) as usize);
    }
    if rest.windows(2).all(|w| w[0] < w[1]) {
        rest.reverse();
    }
    let mut order = Vec::with_capacity(pieces);
    order.push(pieces - 1);
    order.extend(rest);
    order
}

/// A fresh seed for each scrambled message, so repeated messages are scrambled differently.
pub(crate) fn next_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn scrambled_order_is_a_permutation_with_the_final_piece_first(
            pieces in 1usize..=MAX_SCRAMBLED_PIECES,
            seed in any::<u64>(),
        ) {
            let order = scrambled_order(pieces, seed);
            prop_assert_eq!(order[0], pieces - 1);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..pieces).collect::<Vec<_>>());
            if pieces >= 4 {
                prop_assert!(!order[1..].windows(2).all(|w| w[0] < w[1]));
            }
        }
    }

    #[test]
    fn pieces_cover_every_message_length() {
        for total in [1, 2, 63, 64, 65, 4096, 1 << 20] {
            let len = piece_len(total);
            let pieces = total.div_ceil(len);
            assert!(pieces <= MAX_SCRAMBLED_PIECES, "{total}");
            // Anything longer than a byte is split, so the final piece is never the whole.
            assert!(pieces >= total.min(2), "{total}");
        }
    }

    #[test]
    fn unknown_raw_placement_is_strict() {
        for p in [Placement::Strict, Placement::Relaxed, Placement::Scrambled] {
            assert_eq!(Placement::from_raw(p.to_raw()), p);
        }
        assert_eq!(Placement::from_raw(77), Placement::Strict);
    }
}
