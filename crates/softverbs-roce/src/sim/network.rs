//! The network: hosts, the links between them, the virtual clock and the event loop.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write};
use std::net::IpAddr;

use super::Node;
use super::counters::Counters;
use super::link::{Fate, Link, LinkConfig, ScheduledFault};
use super::pcap::{PcapWriter, Resolution};
use crate::Time;

/// The size of the buffer hosts write each datagram into: the largest IPv4 datagram plus
/// one, well above the 9000-byte jumbo frames RoCE uses.
pub const TRANSMIT_BUFFER_LEN: usize = 65_536;

/// The default cap on events in one run (see [`Network::set_event_cap`]).
pub const DEFAULT_EVENT_CAP: u64 = 1_000_000;

/// Names a host in the [`Network`] that added it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostId(usize);

impl HostId {
    /// The host's position in the order hosts were added, from 0.
    pub fn index(self) -> usize {
        self.0
    }
}

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host {}", self.0)
    }
}

/// A run stopped because it hit the event cap: something (usually a host whose timer never
/// moves forward, or two hosts answering each other forever) keeps generating events.
///
/// Carries what each host did during the run, which usually points at the culprit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Livelock {
    /// The cap that was reached.
    pub cap: u64,
    /// The virtual time when the run stopped.
    pub now: Time,
    /// Datagrams still in flight.
    pub in_flight: usize,
    /// Every host's activity during the run, in host order.
    pub hosts: Vec<HostActivity>,
}

/// One host's share of the events in a run that hit the cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostActivity {
    /// Which host.
    pub host: HostId,
    /// Its address.
    pub addr: IpAddr,
    /// Datagrams it transmitted.
    pub transmits: u64,
    /// Datagrams delivered to it.
    pub deliveries: u64,
    /// Times its timeout fired.
    pub timeouts: u64,
}

impl fmt::Display for Livelock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "simulator livelock: {} events (the cap) at t={} ns with {} datagrams in flight; \
             per host transmits/deliveries/timeouts:",
            self.cap, self.now.0, self.in_flight
        )?;
        for h in &self.hosts {
            write!(
                f,
                " {} {}/{}/{}",
                h.addr, h.transmits, h.deliveries, h.timeouts
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for Livelock {}

/// A datagram on its way.
struct InFlight {
    from: HostId,
    to: HostId,
    datagram: Vec<u8>,
}

struct Host<N> {
    addr: IpAddr,
    node: N,
}

/// A capture's writer, type-erased but recoverable by [`Network::take_capture`].
trait Sink: Write {
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<W: Write + 'static> Sink for W {
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

struct Capture {
    pcap: PcapWriter<Box<dyn Sink>>,
    /// The first write error; once set, nothing more is written.
    error: Option<io::Error>,
}

/// The events a run may still spend, and who spent the others.
struct Budget {
    cap: u64,
    used: u64,
    /// Per host: transmits, deliveries, timeouts.
    per_host: Vec<[u64; 3]>,
}

const TRANSMIT: usize = 0;
const DELIVERY: usize = 1;
const TIMEOUT: usize = 2;

/// The budget ran out.
struct Exhausted;

impl Budget {
    fn check(&self) -> Result<(), Exhausted> {
        if self.used >= self.cap {
            Err(Exhausted)
        } else {
            Ok(())
        }
    }

    fn spend(&mut self, host: HostId, kind: usize) -> Result<(), Exhausted> {
        self.check()?;
        self.used += 1;
        if let Some(counts) = self.per_host.get_mut(host.0) {
            counts[kind] += 1;
        }
        Ok(())
    }
}

/// The next thing to happen.
#[derive(Clone, Copy)]
enum Next {
    Deliver(Time),
    Timeout(Time, HostId),
}

impl Next {
    fn time(self) -> Time {
        match self {
            Next::Deliver(t) | Next::Timeout(t, _) => t,
        }
    }
}

/// Simulated hosts joined by simulated links, on a virtual clock.
///
/// All hosts are of one type `N` (use `Box<dyn Node>` to mix kinds). Every behaviour is a
/// function of the seed, the configuration and what the hosts do: events at the same instant
/// happen in a fixed order (deliveries before timeouts, deliveries in the order they were
/// scheduled, timeouts and transmissions by host order), and nothing reads a real clock.
pub struct Network<N> {
    seed: u64,
    now: Time,
    hosts: Vec<Host<N>>,
    by_addr: BTreeMap<IpAddr, HostId>,
    default_link: LinkConfig,
    links: BTreeMap<(HostId, HostId), Link>,
    /// Keyed by arrival time, then by scheduling order.
    in_flight: BTreeMap<(Time, u64), InFlight>,
    next_seq: u64,
    totals: Counters,
    buf: Vec<u8>,
    capture: Option<Capture>,
    capture_deliveries: bool,
    event_cap: u64,
}

/// The network's state without its hosts' (which need not be `Debug`).
impl<N> fmt::Debug for Network<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Network")
            .field("seed", &self.seed)
            .field("now", &self.now)
            .field("hosts", &self.by_addr)
            .field("in_flight", &self.in_flight.len())
            .field("counters", &self.totals)
            .finish_non_exhaustive()
    }
}

impl<N: Node> Network<N> {
    /// An empty network whose every random choice derives from `seed`, with the default
    /// [`LinkConfig`] between every pair of hosts, at virtual time 0.
    pub fn new(seed: u64) -> Network<N> {
        Network {
            seed,
            now: Time(0),
            hosts: Vec::new(),
            by_addr: BTreeMap::new(),
            default_link: LinkConfig::default(),
            links: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            next_seq: 0,
            totals: Counters::default(),
            buf: vec![0; TRANSMIT_BUFFER_LEN],
            capture: None,
            capture_deliveries: false,
            event_cap: DEFAULT_EVENT_CAP,
        }
    }

    /// The seed the network was made with.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The virtual time.
    pub fn now(&self) -> Time {
        self.now
    }

    /// Adds a host that receives datagrams sent to `addr`.
    ///
    /// # Panics
    ///
    /// If another host already has `addr`.
    pub fn add_host(&mut self, addr: IpAddr, node: N) -> HostId {
        let id = HostId(self.hosts.len());
        if let Some(other) = self.by_addr.insert(addr, id) {
            panic!("simulator: {addr} already belongs to {other}");
        }
        self.hosts.push(Host { addr, node });
        id
    }

    /// A host.
    ///
    /// # Panics
    ///
    /// If `id` is not from this network (as for the other methods taking a `HostId`).
    pub fn host(&self, id: HostId) -> &N {
        &self.hosts[id.0].node
    }

    /// A host, to act on it between steps (post a send, check its state).
    pub fn host_mut(&mut self, id: HostId) -> &mut N {
        &mut self.hosts[id.0].node
    }

    /// A host's address.
    pub fn addr(&self, id: HostId) -> IpAddr {
        self.hosts[id.0].addr
    }

    /// The host with address `addr`, if any.
    pub fn host_id(&self, addr: IpAddr) -> Option<HostId> {
        self.by_addr.get(&addr).copied()
    }

    /// Every host, in the order they were added.
    pub fn host_ids(&self) -> impl Iterator<Item = HostId> + use<N> {
        (0..self.hosts.len()).map(HostId)
    }

    /// Sets the configuration of every link that has no configuration of its own.
    ///
    /// # Panics
    ///
    /// If `config` is invalid: a probability outside `[0, 1]`, a bandwidth of 0,
    /// `corrupt_max_bits` outside `1..=64`.
    pub fn set_default_link(&mut self, config: LinkConfig) {
        if let Err(why) = config.check() {
            panic!("simulator: invalid default link: {why}");
        }
        self.default_link = config;
    }

    /// Sets the configuration of the link from `from` to `to` only (the reverse direction is
    /// a separate link). Takes effect for datagrams sent from now on; those already queued
    /// keep their schedule, and FIFO order is kept across the change.
    ///
    /// # Panics
    ///
    /// If `config` is invalid (see [`set_default_link`](Self::set_default_link)).
    pub fn set_link(&mut self, from: HostId, to: HostId, config: LinkConfig) {
        if let Err(why) = config.check() {
            panic!("simulator: invalid link {from} -> {to}: {why}");
        }
        self.link(from, to).config = Some(config);
    }

    /// The configuration in force on the link from `from` to `to`.
    pub fn link_config(&self, from: HostId, to: HostId) -> &LinkConfig {
        self.links
            .get(&(from, to))
            .and_then(|l| l.config.as_ref())
            .unwrap_or(&self.default_link)
    }

    /// Schedules a fault on the link from `from` to `to`.
    pub fn add_fault(&mut self, from: HostId, to: HostId, fault: ScheduledFault) {
        self.link(from, to).scheduled.push(fault);
    }

    /// Cuts the links between `a` and `b`, both ways, for datagrams sent in `[start, end)`.
    pub fn partition(&mut self, a: HostId, b: HostId, start: Time, end: Time) {
        self.add_fault(a, b, ScheduledFault::Partition { start, end });
        self.add_fault(b, a, ScheduledFault::Partition { start, end });
    }

    /// Removes the scheduled faults on the link from `from` to `to`.
    pub fn clear_faults(&mut self, from: HostId, to: HostId) {
        self.link(from, to).scheduled.clear();
    }

    /// The whole network's counters.
    pub fn counters(&self) -> Counters {
        self.totals
    }

    /// The counters of the link from `from` to `to` (zero if it never carried anything).
    pub fn link_counters(&self, from: HostId, to: HostId) -> Counters {
        self.links
            .get(&(from, to))
            .map(|l| l.counters)
            .unwrap_or_default()
    }

    /// Every link that was used or configured, with its counters, ordered by (from, to).
    pub fn links(&self) -> impl Iterator<Item = (HostId, HostId, &Counters)> {
        self.links
            .iter()
            .map(|(&(from, to), link)| (from, to, &link.counters))
    }

    /// How many datagrams are on their way.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Caps the events (transmissions, deliveries, timeouts) one call to
    /// [`run_until`](Self::run_until), [`run_until_idle`](Self::run_until_idle) or
    /// [`step`](Self::step) may process, so that a livelocked test fails with a report
    /// instead of hanging. Default [`DEFAULT_EVENT_CAP`].
    pub fn set_event_cap(&mut self, cap: u64) {
        self.event_cap = cap;
    }

    /// Starts writing a pcap file (nanosecond timestamps, `LINKTYPE_RAW`) of every datagram
    /// hosts send, at its send time, including those the network then drops; a datagram the
    /// network corrupts is recorded corrupted, as its receiver will see it. Replaces (and
    /// drops) any capture already running.
    ///
    /// Write errors during the run do not stop it: the first is kept and returned by
    /// [`take_capture`](Self::take_capture) or [`finish_capture`](Self::finish_capture).
    pub fn capture(&mut self, writer: impl Write + 'static) -> io::Result<()> {
        let sink: Box<dyn Sink> = Box::new(writer);
        self.capture = Some(Capture {
            pcap: PcapWriter::new(sink, Resolution::Nanos)?,
            error: None,
        });
        Ok(())
    }

    /// Also records each delivery, at its delivery time (duplicates twice). Off by default:
    /// it doubles every datagram in the file, which reads as retransmissions in Wireshark.
    pub fn capture_deliveries(&mut self, on: bool) {
        self.capture_deliveries = on;
    }

    /// Stops the capture and returns its writer, flushed, e.g. the `Vec<u8>` it was given.
    ///
    /// # Errors
    ///
    /// The first write error of the capture; `NotFound` if none is running; `InvalidInput`
    /// if the writer is not a `W` (the capture is gone either way).
    pub fn take_capture<W: Write + 'static>(&mut self) -> io::Result<W> {
        let capture = self
            .capture
            .take()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no capture running"))?;
        if let Some(error) = capture.error {
            return Err(error);
        }
        let mut sink = capture.pcap.into_inner();
        sink.flush()?;
        sink.into_any().downcast::<W>().map(|w| *w).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "the capture's writer is of another type",
            )
        })
    }

    /// Stops the capture, flushing and dropping its writer (a file, say).
    ///
    /// # Errors
    ///
    /// The first write error of the capture, or the flush's.
    pub fn finish_capture(&mut self) -> io::Result<()> {
        match self.capture.take() {
            None => Ok(()),
            Some(Capture {
                error: Some(error), ..
            }) => Err(error),
            Some(capture) => capture.pcap.into_inner().flush(),
        }
    }

    /// Sends `datagram` to `dst` as if host `from` had transmitted it now: for tests that
    /// forge packets (garbage, replays) without teaching a host to.
    pub fn inject(&mut self, from: HostId, dst: IpAddr, datagram: &[u8]) {
        let _ = self.addr(from); // a foreign id panics here, not later
        self.dispatch(from, dst, datagram.to_vec());
    }

    /// Lets every host transmit, then processes the earliest pending event (a delivery or a
    /// timeout), advancing the clock to it. Returns `false` when there was none: nothing in
    /// flight and no host waiting for a timeout.
    ///
    /// The event cap bounds the transmissions; a host that never stops transmitting makes
    /// `step` return `true` after the cap is reached, having processed no event.
    pub fn step(&mut self) -> bool {
        let mut budget = self.budget();
        if self.transmit_all(&mut budget).is_err() {
            return true;
        }
        match self.next_event() {
            None => false,
            Some(next) => {
                // The transmissions left room for this one event (see `transmit_all`).
                let _ = self.fire(next, &mut budget);
                true
            }
        }
    }

    /// Processes every event up to and including `deadline`, then sets the clock to
    /// `deadline` (it never goes back).
    ///
    /// # Errors
    ///
    /// [`Livelock`] if the run hit the event cap; the clock stays where the run stopped.
    pub fn run_until(&mut self, deadline: Time) -> Result<(), Livelock> {
        let mut budget = self.budget();
        match self.run_until_inner(deadline, &mut budget) {
            Ok(()) => Ok(()),
            Err(Exhausted) => Err(self.livelock(&budget)),
        }
    }

    /// Runs until the network is idle: nothing in flight, and no host's timeout before
    /// `limit`, returning `true`, with the clock at the last event. Returns `false` if events
    /// before `limit` would not settle; the clock is then `limit`.
    ///
    /// A host's far-off timer (a keepalive, say) does not keep the network busy as long as it
    /// is at or after `limit`.
    ///
    /// # Errors
    ///
    /// [`Livelock`] if the run hit the event cap.
    pub fn run_until_idle(&mut self, limit: Time) -> Result<bool, Livelock> {
        let mut budget = self.budget();
        match self.run_until_idle_inner(limit, &mut budget) {
            Ok(idle) => Ok(idle),
            Err(Exhausted) => Err(self.livelock(&budget)),
        }
    }

    fn run_until_inner(&mut self, deadline: Time, budget: &mut Budget) -> Result<(), Exhausted> {
        loop {
            self.transmit_all(budget)?;
            match self.next_event() {
                Some(next) if next.time().max(self.now) <= deadline => self.fire(next, budget)?,
                _ => break,
            }
        }
        self.now = self.now.max(deadline);
        Ok(())
    }

    fn run_until_idle_inner(
        &mut self,
        limit: Time,
        budget: &mut Budget,
    ) -> Result<bool, Exhausted> {
        loop {
            self.transmit_all(budget)?;
            let now = self.now;
            let timer_busy = self.next_timeout().is_some_and(|(t, _)| t.max(now) < limit);
            if self.in_flight.is_empty() && !timer_busy {
                return Ok(true);
            }
            match self.next_event() {
                Some(next) if next.time().max(now) < limit => self.fire(next, budget)?,
                _ => {
                    self.now = now.max(limit);
                    return Ok(false);
                }
            }
        }
    }

    fn budget(&self) -> Budget {
        Budget {
            cap: self.event_cap,
            used: 0,
            per_host: vec![[0; 3]; self.hosts.len()],
        }
    }

    fn livelock(&self, budget: &Budget) -> Livelock {
        Livelock {
            cap: budget.cap,
            now: self.now,
            in_flight: self.in_flight.len(),
            hosts: self
                .hosts
                .iter()
                .zip(&budget.per_host)
                .enumerate()
                .map(|(i, (host, counts))| HostActivity {
                    host: HostId(i),
                    addr: host.addr,
                    transmits: counts[TRANSMIT],
                    deliveries: counts[DELIVERY],
                    timeouts: counts[TIMEOUT],
                })
                .collect(),
        }
    }

    /// Polls every host, in order, until it has nothing more to send. Returns `Ok` only if
    /// the budget has room for at least one more event.
    fn transmit_all(&mut self, budget: &mut Budget) -> Result<(), Exhausted> {
        for i in 0..self.hosts.len() {
            let from = HostId(i);
            loop {
                budget.check()?;
                let Some(transmit) = self.hosts[i].node.poll_transmit(self.now, &mut self.buf)
                else {
                    break;
                };
                budget.spend(from, TRANSMIT)?;
                match self.buf.get(..transmit.len) {
                    Some(bytes) => {
                        let datagram = bytes.to_vec();
                        self.dispatch(from, transmit.dst, datagram);
                    }
                    None => {
                        // The host claims more than it was given room for.
                        self.totals.sent.datagrams += 1;
                        self.totals.invalid.datagrams += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Routes a datagram sent now, decides its fate and schedules its delivery.
    fn dispatch(&mut self, from: HostId, dst: IpAddr, mut datagram: Vec<u8>) {
        let now = self.now;
        let len = datagram.len();
        self.totals.sent.add(len);
        let Some(&to) = self.by_addr.get(&dst) else {
            self.totals.unroutable.add(len);
            self.record(now, &datagram);
            return;
        };
        let seed = self.seed;
        let link = self
            .links
            .entry((from, to))
            .or_insert_with(|| Link::new(seed, from.0, to.0));
        link.counters.sent.add(len);
        let fate = link.offer(&self.default_link, now, &mut datagram);
        // What this datagram adds to the link's counters and the network's alike.
        let mut outcome = Counters::default();
        match fate {
            Fate::TailDropped => outcome.tail_dropped.add(len),
            Fate::Lost => outcome.lost.add(len),
            Fate::Delivered {
                corrupted,
                reordered,
                copy_at,
                ..
            } => {
                if corrupted {
                    outcome.corrupted.add(len);
                }
                if reordered {
                    outcome.reordered.add(len);
                }
                if copy_at.is_some() {
                    outcome.duplicated.add(len);
                }
            }
        }
        link.counters.absorb(&outcome);
        self.totals.absorb(&outcome);
        self.record(now, &datagram);
        if let Fate::Delivered { at, copy_at, .. } = fate {
            if let Some(copy_at) = copy_at {
                self.schedule(copy_at, from, to, datagram.clone());
            }
            self.schedule(at, from, to, datagram);
        }
    }

    fn schedule(&mut self, at: Time, from: HostId, to: HostId, datagram: Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.in_flight
            .insert((at, seq), InFlight { from, to, datagram });
    }

    fn record(&mut self, at: Time, datagram: &[u8]) {
        if let Some(capture) = &mut self.capture {
            if capture.error.is_none() {
                if let Err(e) = capture.pcap.write_record(at, datagram) {
                    capture.error = Some(e);
                }
            }
        }
    }

    /// The earliest timeout any host wants, and whose (the first host on a tie).
    fn next_timeout(&self) -> Option<(Time, HostId)> {
        self.hosts
            .iter()
            .enumerate()
            .filter_map(|(i, h)| h.node.poll_timeout().map(|t| (t, HostId(i))))
            .min()
    }

    fn next_event(&self) -> Option<Next> {
        let delivery = self.in_flight.keys().next().map(|&(t, _)| t);
        match (delivery, self.next_timeout()) {
            (Some(d), Some((t, host))) if t < d => Some(Next::Timeout(t, host)),
            (Some(d), _) => Some(Next::Deliver(d)),
            (None, Some((t, host))) => Some(Next::Timeout(t, host)),
            (None, None) => None,
        }
    }

    fn fire(&mut self, next: Next, budget: &mut Budget) -> Result<(), Exhausted> {
        match next {
            Next::Timeout(at, host) => {
                budget.spend(host, TIMEOUT)?;
                self.now = self.now.max(at);
                self.hosts[host.0].node.handle_timeout(self.now);
            }
            Next::Deliver(_) => {
                let Some(entry) = self.in_flight.first_entry() else {
                    return Ok(());
                };
                budget.spend(entry.get().to, DELIVERY)?;
                let ((at, _), InFlight { from, to, datagram }) = entry.remove_entry();
                self.now = self.now.max(at);
                let len = datagram.len();
                if let Some(link) = self.links.get_mut(&(from, to)) {
                    link.counters.delivered.add(len);
                }
                self.totals.delivered.add(len);
                if self.capture_deliveries {
                    self.record(self.now, &datagram);
                }
                self.hosts[to.0].node.handle_datagram(self.now, &datagram);
            }
        }
        Ok(())
    }

    fn link(&mut self, from: HostId, to: HostId) -> &mut Link {
        let seed = self.seed;
        let _ = (self.addr(from), self.addr(to)); // foreign ids panic here
        self.links
            .entry((from, to))
            .or_insert_with(|| Link::new(seed, from.0, to.0))
    }
}
