//! A deterministic network simulator for testing sans-IO endpoints: hosts exchange IP
//! datagrams over links with latency, bandwidth, queues and seeded faults, on a virtual clock.
//!
//! Transport bugs hide in the rare orders of events: the retransmission that crosses a late
//! acknowledgement, the duplicate that arrives after the connection moved on, the corrupted
//! packet that must be dropped and not acknowledged. A real network produces those orders by
//! chance and never twice the same way; this one produces them on purpose, as often as a test
//! likes, and exactly again from the same seed. In the style of quinn-proto's test `Pair` and
//! smoltcp's fault-injecting devices, but for any number of hosts and with the network, not
//! the test, deciding what happens to each datagram.
//!
//! # Model
//!
//! - A host is anything implementing [`Node`]: it takes datagrams and the time, and gives
//!   datagrams and its next deadline. The simulator knows nothing about what the datagrams
//!   contain (an IPv4 or IPv6 header, UDP, RoCEv2 for the transport, but any bytes will do):
//!   it routes by [`Transmit::dst`] only and never parses a datagram, so a host may send
//!   garbage.
//! - Every ordered pair of hosts has a link ([`LinkConfig`]: the network's default unless set
//!   per pair). A datagram first waits for the datagrams ahead of it on the link, then takes
//!   its serialization time (`len / bandwidth`), then the latency. A full queue tail-drops.
//! - Faults ([`Faults`]) are probabilities per datagram: loss, duplication, reordering (the
//!   datagram is held back so later ones overtake it), corruption (bit flips the receiver's
//!   checksum must catch), and jitter (extra delay that keeps the link FIFO).
//!   [`ScheduledFault`]s hit one chosen datagram or a time window, for targeted tests.
//! - The fate of a datagram is decided when it is sent, from a random stream of its own
//!   seeded by (network seed, link, index on the link): changing one fault's probability does
//!   not change which datagrams the other faults hit.
//! - The loop ([`Network::run_until`], [`Network::run_until_idle`], [`Network::step`]) lets
//!   every host transmit all it has, then jumps the clock to the earliest delivery or host
//!   timeout and processes it, and again. A cap on events per run turns a livelock into a
//!   [`Livelock`] error instead of a hung test.
//! - [`Counters`] count every outcome per link and in total; [`Network::capture`] writes a
//!   pcap file Wireshark decodes as RoCEv2; [`for_each_seed`] runs a test over many seeds
//!   and names the one to replay when it fails.
//!
//! Determinism: one `u64` seed, the configuration and the hosts' behaviour fix the whole run
//! (delivery order and times, every counter, the capture's bytes) on every platform. There is
//! no real clock, no thread, no hash-ordered iteration; ties are broken by a fixed order.
//!
//! # Example
//!
//! ```
//! use std::net::{IpAddr, Ipv4Addr};
//! use std::time::Duration;
//!
//! use softverbs_roce::Time;
//! use softverbs_roce::sim::{Faults, LinkConfig, Network, Node, Transmit};
//!
//! /// Sends its greeting to `peer` once; keeps what arrives.
//! struct Host {
//!     peer: IpAddr,
//!     greeting: Option<Vec<u8>>,
//!     inbox: Vec<(Time, Vec<u8>)>,
//! }
//!
//! impl Node for Host {
//!     fn handle_datagram(&mut self, now: Time, datagram: &[u8]) {
//!         self.inbox.push((now, datagram.to_vec()));
//!     }
//!     fn poll_transmit(&mut self, _now: Time, buf: &mut [u8]) -> Option<Transmit> {
//!         let greeting = self.greeting.take()?;
//!         buf[..greeting.len()].copy_from_slice(&greeting);
//!         Some(Transmit { len: greeting.len(), dst: self.peer })
//!     }
//!     fn handle_timeout(&mut self, _now: Time) {}
//!     fn poll_timeout(&self) -> Option<Time> {
//!         None
//!     }
//! }
//!
//! let (a_addr, b_addr) = (
//!     IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
//!     IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
//! );
//! let mut net = Network::new(7);
//! net.set_default_link(LinkConfig {
//!     latency: Duration::from_micros(5),
//!     bandwidth: Some(1_250_000_000), // 10 Gbit/s
//!     ..LinkConfig::default()
//! });
//! let greeting = Some(vec![0x45; 100]);
//! let a = net.add_host(a_addr, Host { peer: b_addr, greeting, inbox: vec![] });
//! let b = net.add_host(b_addr, Host { peer: a_addr, greeting: None, inbox: vec![] });
//! // Make the way back lossy; the way there stays perfect.
//! net.set_link(b, a, LinkConfig {
//!     faults: Faults { loss: 0.5, ..Faults::default() },
//!     ..LinkConfig::default()
//! });
//!
//! assert!(net.run_until_idle(Time(1_000_000)).unwrap());
//! // 100 bytes take 80 ns to serialize at 10 Gbit/s, then 5 µs to propagate.
//! assert_eq!(net.host(b).inbox[0].0, Time(5_080));
//! assert_eq!(net.link_counters(a, b).delivered.datagrams, 1);
//! println!("{}", net.counters()); // sent 1 (100 B), delivered 1 (100 B), lost 0, ...
//! ```

use std::net::IpAddr;

use crate::Time;

mod counters;
mod link;
mod network;
pub mod pcap;
mod rng;
mod seed;

pub use counters::{Counters, Tally};
pub use link::{Faults, LinkConfig, ScheduledFault};
pub use network::{
    DEFAULT_EVENT_CAP, HostActivity, HostId, Livelock, Network, TRANSMIT_BUFFER_LEN,
};
pub use rng::SplitMix64;
pub use seed::{SEED_ENV, for_each_seed};

/// A simulated host: a sans-IO endpoint driven by the simulator.
pub trait Node {
    /// A datagram (an IP packet) arrived at `now`.
    fn handle_datagram(&mut self, now: Time, datagram: &[u8]);
    /// The next datagram this host sends, written into `buf` (at most `buf.len()` bytes, the
    /// simulator gives at least 9000); `None` when it has nothing to send now.
    fn poll_transmit(&mut self, now: Time, buf: &mut [u8]) -> Option<Transmit>;
    /// The deadline returned by `poll_timeout` passed.
    fn handle_timeout(&mut self, now: Time);
    /// The next time this host wants `handle_timeout`, if any.
    fn poll_timeout(&self) -> Option<Time>;
}

/// A datagram to send: its length in the buffer and its destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// How many bytes of the buffer the datagram takes, from its start.
    pub len: usize,
    /// Where the network routes it (the simulator does not read the IP header).
    pub dst: IpAddr,
}

/// Lets a network mix kinds of hosts: `Network<Box<dyn Node>>`.
impl<T: Node + ?Sized> Node for Box<T> {
    fn handle_datagram(&mut self, now: Time, datagram: &[u8]) {
        (**self).handle_datagram(now, datagram)
    }
    fn poll_transmit(&mut self, now: Time, buf: &mut [u8]) -> Option<Transmit> {
        (**self).poll_transmit(now, buf)
    }
    fn handle_timeout(&mut self, now: Time) {
        (**self).handle_timeout(now)
    }
    fn poll_timeout(&self) -> Option<Time> {
        (**self).poll_timeout()
    }
}

#[cfg(test)]
mod tests;
