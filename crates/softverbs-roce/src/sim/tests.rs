//! The simulator against toy hosts that send numbered IPv4/UDP datagrams and log arrivals.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use super::*;
use crate::Time;

const A: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
const B: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
const C: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 3));
const NOBODY: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 99));

/// IPv4 + UDP headers.
const HEADERS: usize = 28;
/// Headers, the sequence number, the CRC trailer.
const MIN_LEN: usize = HEADERS + 8 + 4;

/// An IPv4/UDP datagram to port 4791 of `len` bytes (at least [`MIN_LEN`]): `seq` in the
/// IP identification field and, in full, as the first 8 payload bytes; a pattern; a CRC-32
/// of everything before it as the last 4 bytes, so a receiver can tell a corrupted one.
fn datagram(src: IpAddr, dst: IpAddr, seq: u64, len: usize) -> Vec<u8> {
    let len = len.max(MIN_LEN);
    let mut d = vec![0u8; len];
    d[0] = 0x45;
    d[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    d[4..6].copy_from_slice(&(seq as u16).to_be_bytes());
    d[6] = 0x40; // don't fragment
    d[8] = 64; // TTL
    d[9] = 17; // UDP
    if let (IpAddr::V4(s), IpAddr::V4(t)) = (src, dst) {
        d[12..16].copy_from_slice(&s.octets());
        d[16..20].copy_from_slice(&t.octets());
    }
    let sum = ipv4_checksum(&d[..20]);
    d[10..12].copy_from_slice(&sum.to_be_bytes());
    d[20..22].copy_from_slice(&49152u16.to_be_bytes());
    d[22..24].copy_from_slice(&4791u16.to_be_bytes());
    d[24..26].copy_from_slice(&((len - 20) as u16).to_be_bytes());
    d[28..36].copy_from_slice(&seq.to_be_bytes());
    for (i, b) in d[36..len - 4].iter_mut().enumerate() {
        *b = i as u8;
    }
    let crc = crc32fast::hash(&d[..len - 4]);
    d[len - 4..].copy_from_slice(&crc.to_be_bytes());
    d
}

fn ipv4_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn seq_of(d: &[u8]) -> u64 {
    u64::from_be_bytes(d[28..36].try_into().unwrap())
}

fn intact(d: &[u8]) -> bool {
    let n = d.len();
    n >= 4 && crc32fast::hash(&d[..n - 4]).to_be_bytes() == d[n - 4..]
}

/// Sends `count` datagrams to `dst`, the first at `next`, then one every `every`.
struct Pace {
    dst: IpAddr,
    next: Time,
    every: Duration,
    left: u64,
    len: usize,
}

/// A toy host: sends what is queued and what its pacer produces, logs what arrives.
struct Toy {
    addr: IpAddr,
    outbox: VecDeque<(IpAddr, Vec<u8>)>,
    pace: Option<Pace>,
    next_seq: u64,
    received: Vec<(Time, Vec<u8>)>,
    /// A broken timer: always due.
    spin_timer: bool,
    /// A broken sender: never done.
    spin_transmit: bool,
}

impl Toy {
    fn new(addr: IpAddr) -> Toy {
        Toy {
            addr,
            outbox: VecDeque::new(),
            pace: None,
            next_seq: 0,
            received: Vec::new(),
            spin_timer: false,
            spin_transmit: false,
        }
    }

    /// Queues `n` numbered datagrams of `len` bytes to `dst`, sent at the next transmit.
    fn queue(&mut self, dst: IpAddr, n: u64, len: usize) {
        for _ in 0..n {
            let d = datagram(self.addr, dst, self.next_seq, len);
            self.next_seq += 1;
            self.outbox.push_back((dst, d));
        }
    }

    fn pace(&mut self, dst: IpAddr, start: Time, every: Duration, count: u64, len: usize) {
        self.pace = Some(Pace {
            dst,
            next: start,
            every,
            left: count,
            len,
        });
    }

    fn seqs(&self) -> Vec<u64> {
        self.received.iter().map(|(_, d)| seq_of(d)).collect()
    }

    fn times(&self) -> Vec<Time> {
        self.received.iter().map(|&(t, _)| t).collect()
    }
}

impl Node for Toy {
    fn handle_datagram(&mut self, now: Time, datagram: &[u8]) {
        self.received.push((now, datagram.to_vec()));
    }

    fn poll_transmit(&mut self, _now: Time, buf: &mut [u8]) -> Option<Transmit> {
        if self.spin_transmit {
            return Some(Transmit { len: 1, dst: B });
        }
        let (dst, d) = self.outbox.pop_front()?;
        buf[..d.len()].copy_from_slice(&d);
        Some(Transmit { len: d.len(), dst })
    }

    fn handle_timeout(&mut self, now: Time) {
        let Some(p) = &mut self.pace else { return };
        if p.left > 0 && now >= p.next {
            let (dst, len) = (p.dst, p.len);
            p.left -= 1;
            p.next = p.next.after(p.every);
            self.queue(dst, 1, len);
        }
    }

    fn poll_timeout(&self) -> Option<Time> {
        if self.spin_timer {
            return Some(Time(0));
        }
        self.pace.as_ref().filter(|p| p.left > 0).map(|p| p.next)
    }
}

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

fn t_us(n: u64) -> Time {
    Time(n * 1000)
}

/// Two hosts, A and B, joined by `cfg` both ways.
fn pair(seed: u64, cfg: LinkConfig) -> (Network<Toy>, HostId, HostId) {
    let mut net = Network::new(seed);
    net.set_default_link(cfg);
    let a = net.add_host(A, Toy::new(A));
    let b = net.add_host(B, Toy::new(B));
    (net, a, b)
}

fn with_faults(faults: Faults) -> LinkConfig {
    LinkConfig {
        latency: us(10),
        faults,
        ..LinkConfig::default()
    }
}

fn settle(net: &mut Network<Toy>) {
    assert!(net.run_until_idle(Time(u64::MAX)).unwrap(), "not idle");
}

/// The books balance once nothing is in flight.
fn assert_balanced(c: &Counters) {
    assert_eq!(
        c.sent.datagrams + c.duplicated.datagrams,
        c.delivered.datagrams
            + c.lost.datagrams
            + c.tail_dropped.datagrams
            + c.unroutable.datagrams
            + c.invalid.datagrams,
        "{c}"
    );
    assert_eq!(c.in_flight(), 0);
}

#[test]
fn latency_is_exact() {
    let (mut net, a, b) = pair(
        1,
        LinkConfig {
            latency: us(5),
            ..LinkConfig::default()
        },
    );
    net.host_mut(a).queue(B, 1, 100);
    net.host_mut(a).pace(B, Time(1_000), us(1), 1, 100);
    settle(&mut net);
    assert_eq!(net.host(b).times(), [Time(5_000), Time(6_000)]);
    assert_eq!(net.host(b).seqs(), [0, 1]);
    assert_eq!(net.now(), Time(6_000));
    assert!(net.host(a).received.is_empty());
}

#[test]
fn bandwidth_serializes_and_queues() {
    let mut net = Network::new(1);
    net.set_default_link(LinkConfig {
        latency: us(2),
        bandwidth: Some(1_000_000_000), // 1 ns per byte
        ..LinkConfig::default()
    });
    let a = net.add_host(A, Toy::new(A));
    let b = net.add_host(B, Toy::new(B));
    let c = net.add_host(C, Toy::new(C));
    net.host_mut(a).queue(B, 3, 1000);
    net.host_mut(a).queue(C, 1, 1000);
    settle(&mut net);
    // Each waits for the one before it on A -> B; A -> C is a link of its own.
    assert_eq!(net.host(b).times(), [Time(3_000), Time(4_000), Time(5_000)]);
    assert_eq!(net.host(c).times(), [Time(3_000)]);

    // An idle link starts serializing at once.
    net.run_until(Time(10_000)).unwrap();
    assert_eq!(net.now(), Time(10_000));
    net.host_mut(a).queue(B, 1, 500);
    settle(&mut net);
    assert_eq!(net.host(b).times()[3], Time(12_500));

    // A slow link rounds the serialization time up to the nanosecond.
    net.set_link(
        a,
        b,
        LinkConfig {
            latency: Duration::ZERO,
            bandwidth: Some(7),
            ..LinkConfig::default()
        },
    );
    net.host_mut(a).queue(B, 1, 100);
    settle(&mut net);
    assert_eq!(net.host(b).times()[4], Time(12_500 + 14_285_714_286));
}

#[test]
fn a_link_is_fifo_even_with_jitter() {
    let (mut net, a, b) = pair(
        5,
        LinkConfig {
            latency: us(3),
            bandwidth: Some(100_000_000),
            faults: Faults {
                jitter: 0.5,
                jitter_delay: us(20),
                ..Faults::default()
            },
            ..LinkConfig::default()
        },
    );
    let mut rng = SplitMix64::new(9);
    for _ in 0..300 {
        let len = MIN_LEN + rng.below(1400) as usize;
        net.host_mut(a).queue(B, 1, len);
    }
    net.host_mut(a)
        .pace(B, Time(0), Duration::from_nanos(700), 300, 64);
    settle(&mut net);
    let seqs = net.host(b).seqs();
    assert_eq!(seqs, (0..600).collect::<Vec<_>>());
    assert!(net.host(b).times().is_sorted());
    assert_eq!(net.counters().reordered.datagrams, 0);
}

#[test]
fn a_full_queue_tail_drops() {
    let (mut net, a, b) = pair(
        1,
        LinkConfig {
            latency: us(1),
            bandwidth: Some(1_000_000_000),
            queue_limit: Some(2),
            ..LinkConfig::default()
        },
    );
    net.host_mut(a).queue(B, 5, 1000);
    settle(&mut net);
    assert_eq!(net.host(b).seqs(), [0, 1]);
    assert_eq!(net.host(b).times(), [Time(2_000), Time(3_000)]);
    let c = net.link_counters(a, b);
    assert_eq!(c.tail_dropped.datagrams, 3);
    assert_eq!(c.tail_dropped.bytes, 3000);
    assert_eq!(c.delivered.datagrams, 2);
    assert_balanced(&c);

    // Once drained, the queue takes datagrams again.
    net.host_mut(a).queue(B, 2, 1000);
    settle(&mut net);
    assert_eq!(net.host(b).seqs(), [0, 1, 5, 6]);
}

#[test]
fn loss_rate() {
    let (mut net, a, b) = pair(
        11,
        with_faults(Faults {
            loss: 0.1,
            ..Faults::default()
        }),
    );
    net.host_mut(a).queue(B, 10_000, 64);
    settle(&mut net);
    let c = net.link_counters(a, b);
    assert!((900..=1100).contains(&c.lost.datagrams), "{c}");
    let got: BTreeSet<u64> = net.host(b).seqs().into_iter().collect();
    assert_eq!(got.len() as u64, 10_000 - c.lost.datagrams);
    assert_eq!(c.lost.bytes, 64 * c.lost.datagrams);
    assert_balanced(&c);
    assert_eq!(c, net.counters());
}

#[test]
fn duplication_rate() {
    let (mut net, a, b) = pair(
        12,
        with_faults(Faults {
            duplicate: 0.05,
            duplicate_delay: us(3),
            ..Faults::default()
        }),
    );
    net.host_mut(a).queue(B, 10_000, 64);
    settle(&mut net);
    let c = net.link_counters(a, b);
    assert!((400..=600).contains(&c.duplicated.datagrams), "{c}");
    let mut seen = BTreeMap::<u64, u32>::new();
    for s in net.host(b).seqs() {
        *seen.entry(s).or_default() += 1;
    }
    assert_eq!(seen.len(), 10_000);
    let twice = seen.values().filter(|&&n| n == 2).count() as u64;
    assert_eq!(twice, c.duplicated.datagrams);
    assert!(seen.values().all(|&n| n <= 2));
    assert_eq!(c.delivered.datagrams, 10_000 + twice);
    assert_balanced(&c);
}

#[test]
fn reordering_rate() {
    let (mut net, a, b) = pair(
        13,
        with_faults(Faults {
            reorder: 0.1,
            reorder_delay: us(50),
            ..Faults::default()
        }),
    );
    net.host_mut(a).pace(B, Time(0), us(1), 5_000, 64);
    settle(&mut net);
    let c = net.link_counters(a, b);
    assert!((400..=600).contains(&c.reordered.datagrams), "{c}");
    let seqs = net.host(b).seqs();
    assert_eq!(
        seqs.iter().copied().collect::<BTreeSet<_>>().len(),
        5_000,
        "reordering neither loses nor duplicates"
    );
    // Arrivals after a later-sent datagram had already arrived.
    let mut highest = None;
    let mut late = 0;
    for &s in &seqs {
        if highest.is_some_and(|h| s < h) {
            late += 1;
        }
        highest = highest.max(Some(s));
    }
    // Held back by up to 50 µs with one datagram per µs: nearly every held one is overtaken.
    assert!(late as u64 <= c.reordered.datagrams);
    assert!(
        late as u64 >= c.reordered.datagrams * 9 / 10,
        "{late} late, {c}"
    );
    assert!(net.host(b).times().is_sorted());
}

#[test]
fn corruption_rate_and_offset() {
    let (mut net, a, b) = pair(
        14,
        with_faults(Faults {
            corrupt: 0.05,
            corrupt_max_bits: 3,
            corrupt_offset: HEADERS,
            ..Faults::default()
        }),
    );
    net.host_mut(a).queue(B, 10_000, 100);
    settle(&mut net);
    let c = net.link_counters(a, b);
    assert!((400..=600).contains(&c.corrupted.datagrams), "{c}");
    let received = &net.host(b).received;
    assert_eq!(received.len(), 10_000);
    let bad = received.iter().filter(|(_, d)| !intact(d)).count() as u64;
    assert_eq!(bad, c.corrupted.datagrams);
    // The headers before the offset are untouched.
    for (_, d) in received {
        let id = u64::from(u16::from_be_bytes([d[4], d[5]]));
        assert_eq!(d[..HEADERS], datagram(A, B, id, 100)[..HEADERS]);
    }

    // Offset 0: anything may be hit, and the CRC still sees every corruption.
    let (mut net, a, b) = pair(
        15,
        with_faults(Faults {
            corrupt: 0.5,
            corrupt_max_bits: 64,
            ..Faults::default()
        }),
    );
    net.host_mut(a).queue(B, 2_000, 40);
    settle(&mut net);
    let bad = net.host(b).received.iter().filter(|(_, d)| !intact(d));
    assert_eq!(
        bad.count() as u64,
        net.link_counters(a, b).corrupted.datagrams
    );
}

/// Every fault at once, both ways, over a slow queued link: the books still balance.
#[test]
fn all_faults_at_once_balance() {
    let cfg = LinkConfig {
        latency: us(4),
        bandwidth: Some(500_000_000),
        queue_limit: Some(8),
        faults: Faults {
            loss: 0.05,
            duplicate: 0.05,
            duplicate_delay: us(10),
            reorder: 0.05,
            reorder_delay: us(30),
            corrupt: 0.05,
            corrupt_max_bits: 2,
            corrupt_offset: 0,
            jitter: 0.3,
            jitter_delay: us(5),
        },
    };
    let (mut net, a, b) = pair(16, cfg);
    net.host_mut(a).queue(B, 50, 1000);
    net.host_mut(a).pace(B, Time(0), us(1), 2_000, 600);
    net.host_mut(b).pace(A, Time(500), us(2), 1_000, 300);
    settle(&mut net);
    let ab = net.link_counters(a, b);
    let ba = net.link_counters(b, a);
    assert_balanced(&ab);
    assert_balanced(&ba);
    assert_balanced(&net.counters());
    assert!(ab.tail_dropped.datagrams > 0, "{ab}");
    assert_eq!(net.in_flight(), 0);
    assert_eq!(
        net.host(b).received.len() as u64,
        ab.delivered.datagrams,
        "{ab}"
    );
    let links: Vec<_> = net.links().map(|(f, t, _)| (f, t)).collect();
    assert_eq!(links, [(a, b), (b, a)]);
}

/// A fault's choices do not move when another fault is turned up: for the datagrams both
/// runs deliver, corruption hits the same ones.
#[test]
fn faults_are_independent_of_each_other() {
    let run = |loss: f64| {
        let (mut net, a, b) = pair(
            17,
            with_faults(Faults {
                loss,
                corrupt: 0.1,
                corrupt_offset: HEADERS + 8,
                ..Faults::default()
            }),
        );
        net.host_mut(a).queue(B, 2_000, 64);
        settle(&mut net);
        net.host(b)
            .received
            .iter()
            .map(|(_, d)| (seq_of(d), intact(d)))
            .collect::<BTreeMap<_, _>>()
    };
    let clean = run(0.0);
    let lossy = run(0.3);
    assert!(lossy.len() < 1_600);
    for (seq, ok) in &lossy {
        assert_eq!(clean.get(seq), Some(ok), "datagram {seq}");
    }
}

#[test]
fn scheduled_faults_hit_exactly_their_datagram() {
    // Flips spare the headers and the sequence number, so the corrupted one stays nameable.
    let (mut net, a, b) = pair(
        18,
        with_faults(Faults {
            corrupt_offset: HEADERS + 8,
            ..Faults::default()
        }),
    );
    net.add_fault(a, b, ScheduledFault::DropNth(3));
    net.add_fault(a, b, ScheduledFault::CorruptNth(5));
    net.add_fault(a, b, ScheduledFault::DuplicateNth(6));
    net.add_fault(
        a,
        b,
        ScheduledFault::DelayNth {
            index: 7,
            delay: us(100),
        },
    );
    net.host_mut(a).pace(B, Time(0), us(1), 10, 64);
    net.host_mut(b).pace(A, Time(0), us(1), 10, 64);
    settle(&mut net);
    let got = &net.host(b).received;
    let seqs: Vec<u64> = got.iter().map(|(_, d)| seq_of(d)).collect();
    assert_eq!(seqs, [0, 1, 2, 4, 5, 6, 6, 8, 9, 7]);
    let corrupted: Vec<u64> = got
        .iter()
        .filter(|(_, d)| !intact(d))
        .map(|(_, d)| seq_of(d))
        .collect();
    assert_eq!(corrupted, [5]);
    // Seq 7 sent at 7 µs, 10 µs latency, held back 100 µs.
    assert_eq!(got[9].0, t_us(117));
    let c = net.link_counters(a, b);
    assert_eq!(
        (
            c.lost.datagrams,
            c.corrupted.datagrams,
            c.duplicated.datagrams,
            c.reordered.datagrams
        ),
        (1, 1, 1, 1)
    );
    // The other direction is untouched.
    assert_eq!(net.host(a).seqs(), (0..10).collect::<Vec<_>>());

    // Cleared faults stop applying.
    net.clear_faults(a, b);
    net.host_mut(a).queue(B, 10, 64);
    settle(&mut net);
    assert_eq!(net.link_counters(a, b).lost.datagrams, 1);
}

#[test]
fn a_partition_drops_exactly_its_window() {
    let (mut net, a, b) = pair(
        19,
        LinkConfig {
            latency: us(5),
            ..LinkConfig::default()
        },
    );
    net.partition(a, b, t_us(20), t_us(40));
    net.host_mut(a).pace(B, Time(0), us(1), 100, 64);
    net.host_mut(b).pace(A, Time(0), us(1), 100, 64);
    // A datagram in flight when the partition starts still arrives: sent at 19 µs.
    settle(&mut net);
    let expect: Vec<u64> = (0..20).chain(40..100).collect();
    assert_eq!(net.host(b).seqs(), expect);
    assert_eq!(net.host(a).seqs(), expect);
    assert_eq!(net.link_counters(a, b).lost.datagrams, 20);
    assert_eq!(net.link_counters(b, a).lost.datagrams, 20);
    assert_eq!(net.host(b).times()[19], t_us(24));
    assert_eq!(net.host(b).times()[20], t_us(45));
}

/// (receiving host's index, arrival time, datagram), in host order then arrival order.
type Arrivals = Vec<(usize, Time, Vec<u8>)>;

/// Three hosts talking at once through every fault; returns every arrival, the counters and
/// the capture.
fn busy_run(seed: u64) -> (Arrivals, Counters, Vec<u8>) {
    let mut net = Network::new(seed);
    net.set_default_link(LinkConfig {
        latency: us(3),
        bandwidth: Some(1_000_000_000),
        queue_limit: Some(16),
        faults: Faults {
            loss: 0.05,
            duplicate: 0.05,
            duplicate_delay: us(2),
            reorder: 0.1,
            reorder_delay: us(10),
            corrupt: 0.05,
            corrupt_max_bits: 4,
            corrupt_offset: 0,
            jitter: 0.5,
            jitter_delay: us(2),
        },
    });
    let hosts: Vec<HostId> = [A, B, C]
        .iter()
        .map(|&addr| net.add_host(addr, Toy::new(addr)))
        .collect();
    net.capture(Vec::<u8>::new()).unwrap();
    net.host_mut(hosts[0]).queue(B, 100, 1500);
    net.host_mut(hosts[0])
        .pace(C, Time(0), Duration::from_nanos(700), 300, 200);
    net.host_mut(hosts[1])
        .pace(A, Time(300), Duration::from_nanos(900), 300, 1000);
    net.host_mut(hosts[2])
        .pace(B, Time(100), Duration::from_nanos(500), 300, 64);
    settle(&mut net);
    let mut log = Vec::new();
    for (i, &h) in hosts.iter().enumerate() {
        log.extend(net.host(h).received.iter().map(|(t, d)| (i, *t, d.clone())));
    }
    let pcap = net.take_capture::<Vec<u8>>().unwrap();
    (log, net.counters(), pcap)
}

#[test]
fn same_seed_same_run_other_seed_other_run() {
    let first = busy_run(42);
    let again = busy_run(42);
    assert!(first == again, "seed 42 gave two different runs");
    let other = busy_run(43);
    assert_ne!(first.0, other.0);
    assert_ne!(first.2, other.2);
    assert!(first.1.lost.datagrams > 0 && first.1.corrupted.datagrams > 0);
    assert_balanced(&first.1);
}

#[test]
fn unroutable_datagrams_are_counted() {
    let (mut net, a, b) = pair(20, LinkConfig::default());
    net.host_mut(a).queue(NOBODY, 2, 64);
    net.host_mut(a).queue(B, 1, 64);
    net.inject(a, IpAddr::V6(Ipv6Addr::LOCALHOST), b"not even IP");
    settle(&mut net);
    let c = net.counters();
    assert_eq!(c.unroutable.datagrams, 3);
    assert_eq!(c.unroutable.bytes, 64 * 2 + 11);
    assert_eq!(c.sent.datagrams, 4);
    assert_eq!(c.delivered.datagrams, 1);
    assert_eq!(net.link_counters(a, b).sent.datagrams, 1);
    assert_eq!(net.link_counters(a, b).unroutable.datagrams, 0);
    assert_balanced(&c);
    let line = c.to_string();
    assert!(line.contains("unroutable 3"), "{line}");
    assert!(line.starts_with("sent 4 ("), "{line}");
}

/// A host that sends garbage of every length, including an impossible one.
struct Garbage {
    rng: SplitMix64,
    left: u32,
    received: usize,
}

impl Node for Garbage {
    fn handle_datagram(&mut self, _now: Time, _datagram: &[u8]) {
        self.received += 1;
    }
    fn poll_transmit(&mut self, _now: Time, buf: &mut [u8]) -> Option<Transmit> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        if self.left == 0 {
            // Claims more than the buffer holds.
            return Some(Transmit {
                len: buf.len() + 1,
                dst: B,
            });
        }
        let len = self.rng.below(100) as usize;
        for b in &mut buf[..len] {
            *b = self.rng.next_u64() as u8;
        }
        let dst = [A, B, NOBODY][self.rng.below(3) as usize];
        Some(Transmit { len, dst })
    }
    fn handle_timeout(&mut self, _now: Time) {}
    fn poll_timeout(&self) -> Option<Time> {
        None
    }
}

#[test]
fn garbage_and_impossible_transmits_do_not_panic() {
    let mut net: Network<Box<dyn Node>> = Network::new(21);
    net.set_default_link(with_faults(Faults {
        corrupt: 0.5,
        corrupt_max_bits: 64,
        duplicate: 0.2,
        ..Faults::default()
    }));
    let garbage = || Garbage {
        rng: SplitMix64::new(5),
        left: 500,
        received: 0,
    };
    net.add_host(A, Box::new(garbage()));
    net.add_host(B, Box::new(garbage()));
    net.add_host(IpAddr::V6(Ipv6Addr::LOCALHOST), Box::new(Toy::new(C)));
    net.capture(Vec::<u8>::new()).unwrap();
    net.capture_deliveries(true);
    assert!(net.run_until_idle(Time(u64::MAX)).unwrap());
    let c = net.counters();
    assert_eq!(c.invalid.datagrams, 2);
    assert_eq!(c.sent.datagrams, 1000);
    assert_balanced(&c);
    let pcap = net.take_capture::<Vec<u8>>().unwrap();
    let records = parse_pcap(&pcap);
    assert_eq!(
        records.len() as u64,
        c.sent.datagrams - c.invalid.datagrams + c.delivered.datagrams
    );
}

/// A pcap file's records: (seconds, fraction, data), checking each header's lengths.
fn parse_pcap(bytes: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap());
    let mut records = Vec::new();
    let mut at = 24;
    while at < bytes.len() {
        let (incl, orig) = (u32_at(at + 8) as usize, u32_at(at + 12) as usize);
        assert_eq!(incl, orig);
        records.push((
            u32_at(at),
            u32_at(at + 4),
            bytes[at + 16..at + 16 + incl].to_vec(),
        ));
        at += 16 + incl;
    }
    assert_eq!(at, bytes.len());
    records
}

#[test]
fn capture_records_every_datagram_as_sent() {
    let (mut net, a, b) = pair(
        22,
        LinkConfig {
            latency: us(1),
            ..LinkConfig::default()
        },
    );
    net.capture(Vec::<u8>::new()).unwrap();
    net.host_mut(a).queue(B, 2, 40);
    net.host_mut(a).pace(B, Time(1_500_000_007), us(1), 1, 60);
    net.add_fault(a, b, ScheduledFault::DropNth(1));
    settle(&mut net);
    let pcap = net.take_capture::<Vec<u8>>().unwrap();

    assert_eq!(
        pcap[..24],
        [
            0x4d, 0x3c, 0xb2, 0xa1, // magic: nanosecond timestamps, little-endian
            2, 0, 4, 0, // version 2.4
            0, 0, 0, 0, // thiszone
            0, 0, 0, 0, // sigfigs
            0, 0, 4, 0, // snaplen 262144
            101, 0, 0, 0, // LINKTYPE_RAW
        ]
    );
    // First record: seq 0, sent at 0, 40 bytes.
    assert_eq!(
        pcap[24..40],
        [0, 0, 0, 0, 0, 0, 0, 0, 40, 0, 0, 0, 40, 0, 0, 0]
    );
    assert_eq!(pcap[40..80], datagram(A, B, 0, 40));
    // Second: seq 1, dropped by the network but captured as sent.
    assert_eq!(
        pcap[80..96],
        [0, 0, 0, 0, 0, 0, 0, 0, 40, 0, 0, 0, 40, 0, 0, 0]
    );
    assert_eq!(pcap[96..136], datagram(A, B, 1, 40));
    // Third: 1.500000007 s.
    let ns = 500_000_007u32.to_le_bytes();
    assert_eq!(
        pcap[136..152],
        [
            1, 0, 0, 0, ns[0], ns[1], ns[2], ns[3], 60, 0, 0, 0, 60, 0, 0, 0
        ]
    );
    assert_eq!(pcap[152..], datagram(A, B, 2, 60));

    // With deliveries: each also appears when it arrives, 1 µs later.
    let (mut net, a, _) = pair(
        22,
        LinkConfig {
            latency: us(1),
            ..LinkConfig::default()
        },
    );
    net.capture(Vec::<u8>::new()).unwrap();
    net.capture_deliveries(true);
    net.host_mut(a).queue(B, 2, 40);
    settle(&mut net);
    let records = parse_pcap(&net.take_capture::<Vec<u8>>().unwrap());
    let times: Vec<(u32, u32)> = records.iter().map(|&(s, f, _)| (s, f)).collect();
    assert_eq!(times, [(0, 0), (0, 0), (0, 1000), (0, 1000)]);
    assert_eq!(records[2].2, datagram(A, B, 0, 40));
}

#[test]
fn capture_shows_corruption_as_the_receiver_saw_it() {
    let (mut net, a, b) = pair(
        23,
        with_faults(Faults {
            corrupt: 1.0,
            ..Faults::default()
        }),
    );
    net.capture(Vec::<u8>::new()).unwrap();
    net.host_mut(a).queue(B, 5, 80);
    settle(&mut net);
    let records = parse_pcap(&net.take_capture::<Vec<u8>>().unwrap());
    assert_eq!(records.len(), 5);
    for ((_, _, captured), (_, delivered)) in records.iter().zip(&net.host(b).received) {
        assert_eq!(captured, delivered);
        assert!(!intact(captured));
    }
}

#[test]
fn capture_errors_and_wrong_types_are_reported() {
    let (mut net, a, _) = pair(24, LinkConfig::default());
    let e = net.take_capture::<Vec<u8>>().unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::NotFound);
    net.capture(Vec::<u8>::new()).unwrap();
    let e = net.take_capture::<io::Sink>().unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);

    /// Accepts the global header, then fails.
    struct FailsLater(usize);
    impl io::Write for FailsLater {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.0 == 0 {
                return Err(io::Error::other("disk full"));
            }
            self.0 -= 1;
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    net.capture(FailsLater(1)).unwrap();
    net.host_mut(a).queue(B, 3, 64);
    settle(&mut net);
    assert_eq!(net.counters().delivered.datagrams, 3, "the run goes on");
    assert_eq!(net.finish_capture().unwrap_err().to_string(), "disk full");
    assert!(net.finish_capture().is_ok(), "nothing left to finish");
}

#[test]
fn a_timer_that_never_moves_hits_the_cap() {
    let (mut net, a, _) = pair(25, LinkConfig::default());
    net.set_event_cap(1_000);
    net.host_mut(a).spin_timer = true;
    let err = net.run_until(t_us(1_000)).unwrap_err();
    assert_eq!(err.cap, 1_000);
    assert_eq!(err.now, Time(0));
    assert_eq!(err.hosts[0].timeouts, 1_000);
    assert_eq!(err.hosts[1].timeouts, 0);
    let text = err.to_string();
    assert!(
        text.contains("livelock") && text.contains("10.0.0.1 0/0/1000"),
        "{text}"
    );
    assert!(net.run_until_idle(t_us(1_000)).is_err());
    assert!(net.step(), "one step still fires one timeout");
}

#[test]
fn a_host_that_never_stops_sending_hits_the_cap() {
    let (mut net, a, b) = pair(26, LinkConfig::default());
    net.set_event_cap(500);
    net.host_mut(a).spin_transmit = true;
    assert!(net.step(), "step returns rather than spinning");
    let err = net.run_until(t_us(10)).unwrap_err();
    assert_eq!(err.hosts[a.index()].transmits, 500);
    assert!(err.in_flight > 0);
    // Once fixed, the network drains.
    net.host_mut(a).spin_transmit = false;
    net.set_event_cap(DEFAULT_EVENT_CAP);
    settle(&mut net);
    assert_eq!(
        net.host(b).received.len() as u64,
        net.counters().delivered.datagrams
    );
}

#[test]
fn run_until_idle_and_step() {
    let (mut net, a, b) = pair(
        27,
        LinkConfig {
            latency: Duration::from_millis(5),
            ..LinkConfig::default()
        },
    );
    assert!(!net.step(), "nothing to do");
    assert!(net.run_until_idle(Time(1)).unwrap());

    // A timer at or after the limit does not count as busy.
    net.host_mut(a).pace(B, Time(10_000_000), us(1), 1, 64);
    assert!(net.run_until_idle(Time(10_000_000)).unwrap());
    assert_eq!(net.now(), Time(0));

    // A datagram still in flight at the limit does.
    net.run_until(Time(10_000_000)).unwrap();
    assert_eq!(net.in_flight(), 1);
    assert!(!net.run_until_idle(Time(12_000_000)).unwrap());
    assert_eq!(net.now(), Time(12_000_000));
    assert!(net.step());
    assert_eq!(net.now(), Time(15_000_000));
    assert_eq!(net.host(b).received.len(), 1);
    assert!(!net.step());

    // The clock never goes back.
    net.run_until(Time(1)).unwrap();
    assert_eq!(net.now(), Time(15_000_000));
}

#[test]
fn same_instant_events_have_a_fixed_order() {
    // Zero latency: A's datagrams and B's timer are all due at 0; deliveries go first, in
    // the order they were sent.
    let (mut net, a, b) = pair(
        28,
        LinkConfig {
            latency: Duration::ZERO,
            ..LinkConfig::default()
        },
    );
    net.host_mut(a).queue(B, 3, 64);
    net.host_mut(b).pace(A, Time(0), us(1), 1, 64);
    assert!(net.step());
    assert!(net.step());
    assert!(net.step());
    assert_eq!(net.host(b).seqs(), [0, 1, 2]);
    assert!(net.host(b).outbox.is_empty(), "B's timer has not fired yet");
    assert!(net.step());
    assert_eq!(net.host(b).outbox.len(), 1);
}

#[test]
fn ipv6_hosts_and_mixed_kinds() {
    let v6 = |n: u16| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, n));
    let mut net: Network<Box<dyn Node>> = Network::new(29);
    let mut sender = Toy::new(v6(1));
    sender.queue(v6(2), 4, 64);
    let s = net.add_host(v6(1), Box::new(sender));
    let r = net.add_host(v6(2), Box::new(Toy::new(v6(2))));
    assert_eq!(net.host_id(v6(2)), Some(r));
    assert_eq!(net.addr(s), v6(1));
    assert_eq!(net.host_ids().collect::<Vec<_>>(), [s, r]);
    assert!(net.run_until_idle(Time(u64::MAX)).unwrap());
    assert_eq!(net.link_counters(s, r).delivered.datagrams, 4);
}

#[test]
#[should_panic(expected = "loss probability 2 is not in [0, 1]")]
fn invalid_link_config_panics() {
    let (mut net, a, b) = pair(30, LinkConfig::default());
    net.set_link(
        a,
        b,
        with_faults(Faults {
            loss: 2.0,
            ..Faults::default()
        }),
    );
}

#[test]
#[should_panic(expected = "already belongs to host 0")]
fn duplicate_addresses_panic() {
    let mut net = Network::new(31);
    net.add_host(A, Toy::new(A));
    net.add_host(A, Toy::new(A));
}

#[test]
fn link_config_lookup() {
    let (mut net, a, b) = pair(32, LinkConfig::default());
    let special = LinkConfig {
        latency: us(77),
        ..LinkConfig::default()
    };
    net.set_link(a, b, special.clone());
    assert_eq!(net.link_config(a, b), &special);
    assert_eq!(net.link_config(b, a), &LinkConfig::default());
    assert_eq!(net.seed(), 32);
}

#[test]
fn for_each_seed_drives_the_simulator() {
    let mut runs = Vec::new();
    for_each_seed(0..3, |seed| {
        runs.push(busy_run(seed).1);
    });
    // Unless SOFTVERBS_SIM_SEED restricts the run to one seed.
    if std::env::var(SEED_ENV).is_err() {
        assert_eq!(runs.len(), 3);
        assert_ne!(runs[0], runs[1]);
    }
}

/// Wireshark's command-line reader accepts the capture and decodes IPv4/UDP to port 4791.
/// Skipped where tshark is not installed.
#[test]
fn tshark_reads_the_capture() {
    use std::process::Command;
    if Command::new("tshark").arg("-v").output().is_err() {
        eprintln!("tshark not found; skipping");
        return;
    }
    let (mut net, a, _) = pair(33, LinkConfig::default());
    net.capture(Vec::<u8>::new()).unwrap();
    net.host_mut(a).queue(B, 3, 100);
    settle(&mut net);
    let pcap = net.take_capture::<Vec<u8>>().unwrap();
    let path = std::env::temp_dir().join(format!("softverbs-sim-{}.pcap", std::process::id()));
    std::fs::write(&path, pcap).unwrap();
    let out = Command::new("tshark")
        .arg("-r")
        .arg(&path)
        .args([
            "-T",
            "fields",
            "-e",
            "ip.src",
            "-e",
            "ip.dst",
            "-e",
            "udp.dstport",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines, ["10.0.0.1\t10.0.0.2\t4791"; 3], "{text}");
}
