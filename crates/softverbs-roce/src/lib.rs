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
//!   and UD paths; memory and receive queues through a narrow interface.
//! - [`sim`]: a virtual clock, links with latency, bandwidth and seeded faults, and a pcap
//!   writer, for tests.

#![forbid(unsafe_code)]

pub mod sim;
pub mod transport;
pub mod wire;
