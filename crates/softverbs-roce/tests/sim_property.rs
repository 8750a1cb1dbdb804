//! The transport under random faults, against itself without them.
//!
//! Each case draws from its seed a network of 2 to 4 hosts, an MTU, several RC connections
//! (either direction, several between the same hosts) and a workload for each: SENDs and
//! WRITEs with and without immediate data, READs, compare-and-swaps and fetch-and-adds, of
//! 0 to 4×MTU+1 bytes; some targets post their receives late, so requesters meet RNR NAKs.
//! Every operation has memory of its own at the target, so the final
//! memory does not depend on how connections interleave. The case runs once on perfect links
//! and once with random loss, duplication, reordering, corruption and jitter (255 retries,
//! as good as unlimited), and the two must end alike: byte-identical memory on every host, the same
//! receive completions in the same order on every QP, the same requester completions, and
//! each atomic executed once.
//!
//! A second property cuts the network for good at a random moment, with a random retry
//! budget: the oldest request then fails with `RETRY_EXC_ERR` after exactly `1 + retry_cnt`
//! transmissions of its oldest unacknowledged packet, and the rest are flushed.
//!
//! `SOFTVERBS_SIM_CASES=N` runs N cases (default 2000); a failing case
//! prints its seed, and `SOFTVERBS_SIM_SEED=S` runs that one alone.

use softverbs_roce::Time;
use softverbs_roce::endpoint::Endpoint;
use softverbs_roce::sim::{
    Faults, HostId, LinkConfig, Network, Node, ScheduledFault, SplitMix64, Transmit, for_each_seed,
};
use softverbs_roce::transport::*;
use softverbs_roce::wire::Datagram;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

const SRC: u64 = 0x10_0000; // key 1: data to send, a pattern
const TGT: u64 = 0x100_0000; // key 2: where WRITEs and atomics land
const RECV: u64 = 0x200_0000; // key 3: receive buffers
const RDST: u64 = 0x300_0000; // key 4: READ and atomic results, locally
const SLOT: u64 = 4 * 4096 + 8;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Send,
    SendImm,
    Write,
    WriteImm,
    Read,
    Cas,
    Faa,
}

#[derive(Debug, Clone)]
struct Conn {
    from: usize,
    to: usize,
    ops: Vec<(Kind, u32)>,
    /// The target posts its receives only this long after the start (the requester meets
    /// RNR NAKs until then); zero for before.
    late_recvs: Duration,
}

#[derive(Debug, Clone)]
struct Case {
    hosts: usize,
    mtu: u32,
    conns: Vec<Conn>,
}

fn cases() -> u64 {
    std::env::var("SOFTVERBS_SIM_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
}

fn draw(seed: u64) -> Case {
    let mut r = SplitMix64::new(seed);
    let hosts = 2 + r.below(3) as usize;
    let mtu = [256, 512, 1024, 4096][r.below(4) as usize];
    let nconns = 1 + r.below(4) as usize;
    let kinds = [
        Kind::Send,
        Kind::SendImm,
        Kind::Write,
        Kind::WriteImm,
        Kind::Read,
        Kind::Cas,
        Kind::Faa,
    ];
    let conns = (0..nconns)
        .map(|_| {
            let from = r.below(hosts as u64) as usize;
            let to = (from + 1 + r.below(hosts as u64 - 1) as usize) % hosts;
            let nops = 1 + r.below(8) as usize;
            let ops = (0..nops)
                .map(|_| {
                    let kind = kinds[r.below(kinds.len() as u64) as usize];
                    // Sizes around the packet boundaries are the interesting ones.
                    let len = match r.below(4) {
                        0 => r.below(3) as u32,
                        1 => {
                            let whole = mtu * r.below(5) as u32;
                            match r.below(3) {
                                0 => whole,
                                1 => whole + 1,
                                _ => whole.saturating_sub(1),
                            }
                        }
                        _ => r.below(u64::from(4 * mtu + 2)) as u32,
                    }
                    .min(4 * mtu + 1);
                    (kind, len)
                })
                .collect();
            let late_recvs = if r.below(4) == 0 {
                Duration::from_micros(r.below(300))
            } else {
                Duration::ZERO
            };
            Conn {
                from,
                to,
                ops,
                late_recvs,
            }
        })
        .collect();
    Case { hosts, mtu, conns }
}

fn addr(h: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 1, 0, 1 + h as u8))
}

/// A host, with every datagram it sends logged as (destination QP, PSN).
struct Logged {
    ep: Endpoint<MemoryModel>,
    log: Vec<(u32, u32)>,
}

impl Node for Logged {
    fn handle_datagram(&mut self, now: Time, d: &[u8]) {
        self.ep.handle_datagram(now, d);
    }
    fn poll_transmit(&mut self, now: Time, buf: &mut [u8]) -> Option<Transmit> {
        let (dst, len) = self.ep.poll_transmit(now, buf)?;
        if let Ok(d) = Datagram::parse(&buf[..len]) {
            self.log
                .push((d.headers.bth.dest_qp, d.headers.bth.psn.value()));
        }
        Some(Transmit { len, dst })
    }
    fn handle_timeout(&mut self, now: Time) {
        self.ep.handle_timeout(now);
    }
    fn poll_timeout(&self) -> Option<Time> {
        self.ep.poll_timeout()
    }
}

fn requester_qpn(c: usize) -> u32 {
    0x100 + c as u32
}
fn responder_qpn(c: usize) -> u32 {
    0x200 + c as u32
}

/// Builds the network for `case` (each host's memory, both QPs of each connection, the
/// receives) and posts the workload.
/// A receive to post later: when, on which host and QP.
type LateRecv = (Duration, HostId, u32, RecvWr);

fn build(
    case: &Case,
    seed: u64,
    tweak: &dyn Fn(&mut QpConfig),
) -> (Network<Logged>, Vec<HostId>, Vec<LateRecv>) {
    let mut net = Network::new(seed);
    net.set_default_link(LinkConfig {
        latency: Duration::from_micros(3),
        bandwidth: Some(1_250_000_000),
        ..LinkConfig::default()
    });
    let n_ops: usize = case.conns.iter().map(|c| c.ops.len()).sum();
    // A slot per operation, then a cell per connection for its atomics.
    let room = n_ops as u64 * SLOT + case.conns.len() as u64 * 8;
    let mut ids = Vec::new();
    for h in 0..case.hosts {
        let mut mem = MemoryModel::default();
        let mut src = Region::new(1, 1, SRC, SLOT as usize);
        for (i, b) in src.bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(13).wrapping_add(h as u8 * 31 + 1);
        }
        mem.add(src);
        let mut tgt = Region::new(1, 2, TGT, room as usize);
        for (i, b) in tgt.bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(7) ^ h as u8;
        }
        mem.add(tgt);
        mem.add(Region::new(1, 3, RECV, room as usize));
        mem.add(Region::new(1, 4, RDST, room as usize));
        let mut ep = Endpoint::new(addr(h), mem);
        for (c, conn) in case.conns.iter().enumerate() {
            let cfg = |me: u32, peer: usize, them: u32| {
                let mut q = QpConfig::rc(me, (addr(peer), them));
                q.pmtu = case.mtu;
                q.timeout = 8; // about 1 ms
                q.sq_psn = softverbs_roce::wire::Psn::new(0xff_fff0 + c as u32); // wraps soon
                q.rq_psn = q.sq_psn;
                tweak(&mut q);
                q
            };
            if conn.from == h {
                ep.add_qp(cfg(requester_qpn(c), conn.to, responder_qpn(c)))
                    .unwrap();
            }
            if conn.to == h {
                ep.add_qp(cfg(responder_qpn(c), conn.from, requester_qpn(c)))
                    .unwrap();
            }
        }
        ids.push(net.add_host(
            addr(h),
            Logged {
                ep,
                log: Vec::new(),
            },
        ));
    }
    // Memory slots: op `k` (numbered across all connections) owns slot `k` of each region.
    let mut k = 0u64;
    let mut late = Vec::new();
    for (c, conn) in case.conns.iter().enumerate() {
        let slot_base = k;
        for (j, &(kind, len)) in conn.ops.iter().enumerate() {
            let slot = (slot_base + j as u64) * SLOT;
            let wr_id = (c as u64) << 32 | j as u64;
            let needs_recv = matches!(kind, Kind::Send | Kind::SendImm | Kind::WriteImm);
            if needs_recv {
                let wr = RecvWr {
                    srq: 0,
                    wr_id,
                    sges: vec![Sge {
                        addr: RECV + slot,
                        len: SLOT as u32,
                        lkey: 3,
                    }],
                };
                if conn.late_recvs.is_zero() {
                    net.host_mut(ids[conn.to])
                        .ep
                        .with_qp(responder_qpn(c), |qp| qp.post_recv(wr));
                } else {
                    late.push((conn.late_recvs, ids[conn.to], responder_qpn(c), wr));
                }
            }
            let imm = Some(0xa000_0000 | wr_id as u32);
            // Each connection's atomics share one cell, after every op's slot.
            let cell = TGT + n_ops as u64 * SLOT + c as u64 * 8;
            let op = match kind {
                Kind::Send => SendOp::Send {
                    imm: None,
                    invalidate: None,
                },
                Kind::SendImm => SendOp::Send {
                    imm,
                    invalidate: None,
                },
                Kind::Write => SendOp::Write {
                    va: TGT + slot,
                    rkey: 2,
                    imm: None,
                },
                Kind::WriteImm => SendOp::Write {
                    va: TGT + slot,
                    rkey: 2,
                    imm,
                },
                Kind::Read => SendOp::Read {
                    va: TGT + slot,
                    rkey: 2,
                },
                Kind::Cas => SendOp::CompareSwap {
                    va: cell,
                    rkey: 2,
                    compare: j as u64,
                    swap: wr_id,
                },
                Kind::Faa => SendOp::FetchAdd {
                    va: cell,
                    rkey: 2,
                    add: j as u64 + 1,
                },
            };
            let mut wr = SendWr::new(wr_id, op);
            wr.signaled = j % 3 != 1 || matches!(kind, Kind::Read | Kind::Cas | Kind::Faa);
            wr.sges = match kind {
                Kind::Read => vec![Sge {
                    addr: RDST + slot,
                    len,
                    lkey: 4,
                }],
                Kind::Cas | Kind::Faa => vec![Sge {
                    addr: RDST + slot,
                    len: 8,
                    lkey: 4,
                }],
                _ => vec![Sge {
                    addr: SRC,
                    len,
                    lkey: 1,
                }],
            };
            if len == 0 && !matches!(kind, Kind::Cas | Kind::Faa) {
                wr.sges.clear();
            }
            let now = net.now();
            net.host_mut(ids[conn.from])
                .ep
                .with_qp(requester_qpn(c), |qp| qp.post_send(now, wr))
                .unwrap()
                .unwrap();
        }
        k += conn.ops.len() as u64;
    }
    late.sort_by_key(|l| l.0);
    (net, ids, late)
}

/// Runs until idle, posting the late receives when their time comes.
fn run_all(net: &mut Network<Logged>, late: Vec<LateRecv>, limit: Time) -> bool {
    for (at, host, qpn, wr) in late {
        net.run_until(Time(0).after(at)).expect("no livelock");
        net.host_mut(host).ep.with_qp(qpn, |qp| qp.post_recv(wr));
    }
    net.run_until_idle(limit).expect("no livelock")
}

/// What a completion says that must not depend on the faults.
type Seen = (u64, WcStatus, WcOpcode, u32, Option<u32>);

#[derive(Debug, PartialEq)]
struct Outcome {
    /// By (host, QP number), in the order they came.
    completions: BTreeMap<(usize, u32), Vec<Seen>>,
    memory: Vec<Vec<Vec<u8>>>,
    atomics: Vec<u64>,
}

fn outcome(net: &mut Network<Logged>, ids: &[HostId]) -> Outcome {
    let mut completions: BTreeMap<_, Vec<_>> = BTreeMap::new();
    for (h, &id) in ids.iter().enumerate() {
        while let Some((qpn, e)) = net.host_mut(id).ep.poll_event() {
            if let Event::Completion(c) = e {
                completions
                    .entry((h, qpn))
                    .or_default()
                    .push((c.wr_id, c.status, c.opcode, c.byte_len, c.imm));
            }
        }
    }
    let memory = ids
        .iter()
        .map(|&id| {
            net.host(id)
                .ep
                .mem
                .regions
                .iter()
                .map(|r| r.bytes.clone())
                .collect()
        })
        .collect();
    let atomics = ids.iter().map(|&id| net.host(id).ep.mem.atomics).collect();
    Outcome {
        completions,
        memory,
        atomics,
    }
}

/// What the faults did in a run: datagrams lost, duplicated, reordered, corrupted, request
/// packets sent again, and RNR NAKs.
type Damage = [u64; 6];

fn run(case: &Case, seed: u64, faults: Option<Faults>) -> (Outcome, Damage) {
    // Retries as good as unlimited: the core takes budgets past the verbs' 3 bits.
    let (mut net, ids, late) = build(case, seed, &|q| q.retry_cnt = u8::MAX);
    if let Some(f) = faults {
        net.set_default_link(LinkConfig {
            latency: Duration::from_micros(3),
            bandwidth: Some(1_250_000_000),
            faults: f,
            ..LinkConfig::default()
        });
    }
    let idle = run_all(&mut net, late, Time(60_000_000_000));
    assert!(
        idle,
        "still busy after 60 s of virtual time: {}",
        net.counters()
    );
    let c = net.counters();
    let qp_sum = |f: fn(&QpCounters) -> u64| -> u64 {
        ids.iter()
            .flat_map(|&id| {
                net.host(id)
                    .ep
                    .qps()
                    .map(|q| f(q.counters()))
                    .collect::<Vec<_>>()
            })
            .sum()
    };
    let retransmitted = ids
        .iter()
        .flat_map(|&id| {
            net.host(id)
                .ep
                .qps()
                .map(|q| q.counters().retransmitted)
                .collect::<Vec<_>>()
        })
        .sum();
    let damage = [
        c.lost.datagrams,
        c.duplicated.datagrams,
        c.reordered.datagrams,
        c.corrupted.datagrams,
        retransmitted,
        qp_sum(|c| c.rnr_naks_received),
    ];
    (outcome(&mut net, &ids), damage)
}

fn random_faults(r: &mut SplitMix64) -> Faults {
    let p = |r: &mut SplitMix64, max: f64| (r.below(1001) as f64 / 1000.0) * max;
    Faults {
        loss: p(r, 0.15),
        duplicate: p(r, 0.1),
        duplicate_delay: Duration::from_micros(r.below(50)),
        reorder: p(r, 0.1),
        reorder_delay: Duration::from_micros(1 + r.below(100)),
        corrupt: p(r, 0.1),
        corrupt_max_bits: 1 + r.below(8) as u32,
        jitter: p(r, 0.2),
        jitter_delay: Duration::from_micros(r.below(20)),
        ..Faults::default()
    }
}

#[test]
fn random_workloads_under_random_faults_end_as_without_them() {
    let mut stats = [0u64; 3];
    let mut damage = [0u64; 6];
    for_each_seed(0..cases(), |seed| {
        let case = draw(seed);
        let (clean, _) = run(&case, seed, None);
        // Every request completed successfully without faults.
        for ((h, qpn), cs) in &clean.completions {
            for c in cs {
                assert_eq!(
                    c.1,
                    WcStatus::Success,
                    "host {h} qp {qpn:#x}: {c:?} in {case:?}"
                );
            }
        }
        let mut r = SplitMix64::new(seed ^ 0x5eed);
        let faults = random_faults(&mut r);
        let (faulty, d) = run(&case, seed, Some(faults.clone()));
        for (t, x) in damage.iter_mut().zip(d) {
            *t += x;
        }
        assert_eq!(
            faulty.atomics, clean.atomics,
            "atomics executed once: {faults:?} {case:?}"
        );
        assert_eq!(faulty.completions, clean.completions, "{faults:?} {case:?}");
        assert!(
            faulty.memory == clean.memory,
            "memory differs: {faults:?} {case:?}"
        );
        stats[0] += 1;
        stats[1] += case.conns.iter().map(|c| c.ops.len() as u64).sum::<u64>();
        stats[2] += clean.atomics.iter().sum::<u64>();
    });
    eprintln!(
        "{} cases, {} operations, {} atomics: all alike; the faults lost {}, duplicated {}, \
         reordered {} and corrupted {} datagrams, {} request packets were sent again, \
         {} RNR NAKs came back",
        stats[0],
        stats[1],
        stats[2],
        damage[0],
        damage[1],
        damage[2],
        damage[3],
        damage[4],
        damage[5]
    );
    assert!(
        damage.iter().all(|&d| d > 0),
        "every kind of fault happened: {damage:?}"
    );
}

#[test]
fn a_permanent_cut_fails_the_oldest_request_after_exactly_its_retries() {
    for_each_seed(0..cases() / 4, |seed| {
        let mut r = SplitMix64::new(seed);
        let mut case = draw(seed);
        // One connection, host 0 to host 1, so the cut is between the two.
        case.hosts = 2;
        case.conns.truncate(1);
        case.conns[0].from = 0;
        case.conns[0].to = 1;
        let retry_cnt = r.below(7) as u8;
        for conn in &mut case.conns {
            conn.late_recvs = Duration::ZERO;
        }
        let (mut net, ids, _) = build(&case, seed, &|q| q.retry_cnt = retry_cnt);
        let cut_after = r.below(6);
        // Everything from the `cut_after`-th datagram on host 0's way out is lost, and
        // nothing comes back after it either.
        for k in cut_after..cut_after + 4096 {
            net.add_fault(ids[0], ids[1], ScheduledFault::DropNth(k));
        }
        net.run_until(Time(1)).unwrap();
        let mut steps = 0;
        while net.link_counters(ids[0], ids[1]).sent.datagrams <= cut_after && steps < 100_000 {
            if !net.step() {
                break;
            }
            steps += 1;
        }
        net.partition(ids[1], ids[0], net.now(), Time(u64::MAX));
        assert!(net.run_until_idle(Time(600_000_000_000)).unwrap());
        let out = outcome(&mut net, &ids);
        let mine = out
            .completions
            .get(&(0, requester_qpn(0)))
            .cloned()
            .unwrap_or_default();
        let failed: Vec<_> = mine.iter().filter(|c| c.1 != WcStatus::Success).collect();
        if failed.is_empty() {
            // Everything was acknowledged before the cut.
            assert_eq!(
                mine.len(),
                case.conns[0]
                    .ops
                    .iter()
                    .enumerate()
                    .filter(
                        |(j, (k, _))| j % 3 != 1 || matches!(k, Kind::Read | Kind::Cas | Kind::Faa)
                    )
                    .count()
            );
            return;
        }
        assert_eq!(failed[0].1, WcStatus::RetryExcErr, "{mine:?}");
        assert!(
            failed[1..].iter().all(|c| c.1 == WcStatus::WrFlushErr),
            "{mine:?}"
        );
        // The packet the requester was stuck on went out once, then `retry_cnt` times more.
        let log = &net.host(ids[0]).log;
        let stuck = net
            .host(ids[0])
            .ep
            .qp(requester_qpn(0))
            .map(|q| q.counters().timeouts)
            .unwrap();
        assert_eq!(stuck, u64::from(retry_cnt) + 1, "timeouts");
        let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
        for (_, psn) in log.iter().filter(|(q, _)| *q == responder_qpn(0)) {
            *counts.entry(*psn).or_default() += 1;
        }
        let most = counts.values().max().copied().unwrap_or(0);
        assert_eq!(
            most,
            1 + u64::from(retry_cnt),
            "transmissions of the stuck packet: {counts:?}"
        );
    });
}
