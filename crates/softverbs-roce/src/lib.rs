//! RoCEv2 (IBTA Annex A17) with no I/O: the packets, the reliable and unreliable transports
//! as state machines, and a deterministic network simulator that drives them.
//!
//! Nothing here opens a socket, starts a thread or reads a clock: callers hand in packets and
//! the current time, and take out packets to send, the next deadline and completions
//! (quinn-proto's shape). Everything that arrives is treated as input from an attacker:
//! parsing never panics and every malformation is a typed error.
//!
//! - [`wire`]: IPv4/IPv6, UDP, the base transport header and its extension headers, the
//!   invariant CRC; parse and emit on byte slices.
//! - [`transport`]: per queue pair, the RC requester, completer and responder, and the UC
//!   and UD paths; memory through a narrow interface.
//! - [`endpoint`]: a host's QPs behind one address: datagrams in and out, demultiplexed by
//!   destination QP, with every refused datagram counted.
//! - [`sim`]: a virtual clock, links with latency, bandwidth and seeded faults, and a pcap
//!   writer, for tests.

#![forbid(unsafe_code)]

pub mod endpoint;
pub mod sim;
pub mod transport;
pub mod wire;

/// A point in time as the caller's clock gives it: nanoseconds since an epoch of the caller's
/// choice (a real clock's, or a simulator's virtual one). The core never reads a clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(pub u64);

impl Time {
    /// `self` plus `d`, saturating at the end of time.
    pub fn after(self, d: std::time::Duration) -> Time {
        Time(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }

    /// How long after `earlier` this is (zero if it is not after).
    pub fn since(self, earlier: Time) -> std::time::Duration {
        std::time::Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}
