//! What the network did with the datagrams it was given, per directed link and in total.

use std::fmt;

/// A number of datagrams and their total size in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tally {
    /// How many datagrams.
    pub datagrams: u64,
    /// Their lengths summed (IP header included).
    pub bytes: u64,
}

impl Tally {
    pub(crate) fn add(&mut self, len: usize) {
        self.datagrams += 1;
        self.bytes = self.bytes.saturating_add(len as u64);
    }
}

/// The fate of every datagram, counted.
///
/// Tests assert on these instead of re-deriving them from host logs: that a retransmission
/// really followed a loss, that a checksum failure really came from a corruption, that a
/// queue really overflowed. Once the network is idle (nothing in flight) the books balance:
///
/// `sent + duplicated = delivered + lost + tail_dropped + unroutable + invalid`
///
/// (in datagrams; `invalid` datagrams have no bytes). Corrupted, reordered and duplicated
/// datagrams are delivered too: those three count a property of delivered datagrams, not an
/// outcome. The same struct serves a single directed link (where `unroutable` and `invalid`
/// are always zero, because such datagrams never reach a link) and the whole network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Datagrams hosts handed to the network (for a link: that were routed onto it).
    pub sent: Tally,
    /// Datagrams handed to the destination host, duplicates included.
    pub delivered: Tally,
    /// Dropped by random loss or by a scheduled drop or partition.
    pub lost: Tally,
    /// Extra copies the network made (each copy is also counted in `delivered`).
    pub duplicated: Tally,
    /// Held back by the reordering fault (or a scheduled delay) so that later datagrams could
    /// overtake them; counted whether or not any did.
    pub reordered: Tally,
    /// Delivered with at least one bit flipped.
    pub corrupted: Tally,
    /// Refused because the link's queue was full.
    pub tail_dropped: Tally,
    /// Addressed to an IP address no host has.
    pub unroutable: Tally,
    /// Transmits claiming more bytes than the buffer the host was given; dropped unread, so
    /// their `bytes` is 0. A host bug, counted rather than panicked on.
    pub invalid: Tally,
}

impl Tally {
    fn absorb(&mut self, other: Tally) {
        self.datagrams += other.datagrams;
        self.bytes = self.bytes.saturating_add(other.bytes);
    }
}

impl Counters {
    /// Adds `other`'s counts to these.
    pub(crate) fn absorb(&mut self, other: &Counters) {
        self.sent.absorb(other.sent);
        self.delivered.absorb(other.delivered);
        self.lost.absorb(other.lost);
        self.duplicated.absorb(other.duplicated);
        self.reordered.absorb(other.reordered);
        self.corrupted.absorb(other.corrupted);
        self.tail_dropped.absorb(other.tail_dropped);
        self.unroutable.absorb(other.unroutable);
        self.invalid.absorb(other.invalid);
    }

    /// Datagrams accepted but not yet delivered or dropped, from the counts alone.
    pub fn in_flight(&self) -> u64 {
        (self.sent.datagrams + self.duplicated.datagrams).saturating_sub(
            self.delivered.datagrams
                + self.lost.datagrams
                + self.tail_dropped.datagrams
                + self.unroutable.datagrams
                + self.invalid.datagrams,
        )
    }
}

impl fmt::Display for Counters {
    /// One line, for a test's failure message or a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sent {} ({} B), delivered {} ({} B), lost {}, duplicated {}, reordered {}, \
             corrupted {}, tail-dropped {}, unroutable {}",
            self.sent.datagrams,
            self.sent.bytes,
            self.delivered.datagrams,
            self.delivered.bytes,
            self.lost.datagrams,
            self.duplicated.datagrams,
            self.reordered.datagrams,
            self.corrupted.datagrams,
            self.tail_dropped.datagrams,
            self.unroutable.datagrams,
        )?;
        if self.invalid.datagrams != 0 {
            write!(f, ", invalid {}", self.invalid.datagrams)?;
        }
        Ok(())
    }
}
