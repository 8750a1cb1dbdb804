//! A simulated scale run: N endpoints, each with an RC QP to every other (all-to-all), every
//! QP writing, sending and reading at once over links that lose 1% of datagrams. Every
//! request must complete successfully with the right bytes in place; the run prints, per
//! scale, the goodput, the retransmitted packets and the virtual time, so that growth with
//! scale is visible (`cargo test -p softverbs-roce --test scale -- --nocapture`).

use softverbs_roce::Time;
use softverbs_roce::endpoint::Endpoint;
use softverbs_roce::sim::{Faults, LinkConfig, Network};
use softverbs_roce::transport::*;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

const SRC: u64 = 0x10_0000;
const TGT: u64 = 0x100_0000;
const RECV: u64 = 0x200_0000;
const RDST: u64 = 0x300_0000;
const SLOT: u64 = 64 * 1024;
const ROUNDS: u64 = 4;
/// Per round and QP: a WRITE, a SEND and a READ of these sizes.
const SIZES: [u32; 3] = [4096, 1024, 2048];

fn addr(h: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 2, (h >> 8) as u8, h as u8 + 1))
}

fn pattern(h: usize, i: usize) -> u8 {
    (i as u8).wrapping_mul(29) ^ (h as u8).wrapping_mul(77)
}

/// Figures of one run.
struct Figures {
    qps: usize,
    payload: u64,
    virtual_time: Duration,
    retransmitted: u64,
    datagrams: u64,
    lost: u64,
}

fn run(n: usize, seed: u64) -> Figures {
    let mut net = Network::new(seed);
    net.set_default_link(LinkConfig {
        latency: Duration::from_micros(5),
        bandwidth: Some(1_250_000_000),
        queue_limit: Some(1024),
        faults: Faults {
            loss: 0.01,
            ..Faults::default()
        },
    });
    let qpn = |peer: usize| 0x1000 + peer as u32;
    let mut ids = Vec::new();
    for h in 0..n {
        let mut mem = MemoryModel::default();
        let mut src = Region::new(1, 1, SRC, SLOT as usize);
        for (i, b) in src.bytes.iter_mut().enumerate() {
            *b = pattern(h, i);
        }
        mem.add(src);
        for (key, va) in [(2, TGT), (3, RECV), (4, RDST)] {
            mem.add(Region::new(1, key, va, n * SLOT as usize));
        }
        let mut ep = Endpoint::new(addr(h), mem);
        for peer in (0..n).filter(|&p| p != h) {
            let mut cfg = QpConfig::rc(qpn(peer), (addr(peer), qpn(h)));
            cfg.pmtu = 1024;
            cfg.timeout = 10; // about 4 ms
            ep.add_qp(cfg).unwrap();
        }
        ids.push(net.add_host(addr(h), ep));
    }
    let mut payload = 0;
    for (h, &id) in ids.iter().enumerate() {
        for peer in (0..n).filter(|&p| p != h) {
            let ep = net.host_mut(id);
            // Receives for the peer's SENDs, each round in its own part of the peer's slot.
            for round in 0..ROUNDS {
                let at = RECV + peer as u64 * SLOT + round * 4096;
                ep.with_qp(qpn(peer), |q| {
                    q.post_recv(RecvWr {
                        srq: 0,
                        wr_id: round,
                        sges: vec![Sge {
                            addr: at,
                            len: 4096,
                            lkey: 3,
                        }],
                    })
                });
            }
            for round in 0..ROUNDS {
                let slot = h as u64 * SLOT + round * 8192;
                let ops = [
                    SendOp::Write {
                        va: TGT + slot,
                        rkey: 2,
                        imm: None,
                    },
                    SendOp::Send {
                        imm: Some(round as u32),
                        invalidate: None,
                    },
                    SendOp::Read {
                        va: SRC + round * 4096,
                        rkey: 1,
                    },
                ];
                for (k, (op, len)) in ops.into_iter().zip(SIZES).enumerate() {
                    let mut wr = SendWr::new(round * 3 + k as u64, op);
                    wr.sges = match op {
                        SendOp::Read { .. } => {
                            vec![Sge {
                                addr: RDST + peer as u64 * SLOT + round * 4096,
                                len,
                                lkey: 4,
                            }]
                        }
                        _ => vec![Sge {
                            addr: SRC,
                            len,
                            lkey: 1,
                        }],
                    };
                    payload += u64::from(len);
                    ep.with_qp(qpn(peer), |q| q.post_send(Time(0), wr))
                        .unwrap()
                        .unwrap();
                }
            }
        }
    }
    assert!(
        net.run_until_idle(Time(600_000_000_000)).unwrap(),
        "went idle"
    );
    let virtual_time = net.now().since(Time(0));
    let mut retransmitted = 0;
    for (h, &id) in ids.iter().enumerate() {
        let ep = net.host_mut(id);
        let mut done = 0;
        while let Some((q, e)) = ep.poll_event() {
            match e {
                Event::Completion(c) => {
                    assert_eq!(c.status, WcStatus::Success, "host {h} qp {q:#x}: {c:?}");
                    done += 1;
                }
                Event::Error(e) => panic!("host {h} qp {q:#x}: {e:?}"),
            }
        }
        // Three requests and one receive per round and peer.
        assert_eq!(done, (n - 1) as u64 * ROUNDS * 4, "host {h}");
        retransmitted += ep.qps().map(|q| q.counters().retransmitted).sum::<u64>();
        let mem = &ep.mem.regions;
        for peer in (0..n).filter(|&p| p != h) {
            for round in 0..ROUNDS {
                let wrote = (peer as u64 * SLOT + round * 8192) as usize;
                let got = &mem[1].bytes[wrote..wrote + SIZES[0] as usize];
                assert!(
                    got.iter().enumerate().all(|(i, &b)| b == pattern(peer, i)),
                    "write from {peer}"
                );
                let sent = (peer as u64 * SLOT + round * 4096) as usize;
                let got = &mem[2].bytes[sent..sent + SIZES[1] as usize];
                assert!(
                    got.iter().enumerate().all(|(i, &b)| b == pattern(peer, i)),
                    "send from {peer}"
                );
                let read = (peer as u64 * SLOT + round * 4096) as usize;
                let got = &mem[3].bytes[read..read + SIZES[2] as usize];
                let off = (round * 4096) as usize;
                assert!(
                    got.iter()
                        .enumerate()
                        .all(|(i, &b)| b == pattern(peer, off + i)),
                    "read from {peer}"
                );
            }
        }
    }
    let c = net.counters();
    Figures {
        qps: n * (n - 1),
        payload,
        virtual_time,
        retransmitted,
        datagrams: c.sent.datagrams,
        lost: c.lost.datagrams,
    }
}

#[test]
fn all_to_all_with_one_percent_loss_completes_everything() {
    println!(
        "endpoints  QPs  payload MB  virtual ms  goodput Gbit/s  datagrams  lost  retransmitted"
    );
    for n in [2, 4, 8, 17] {
        let f = run(n, 42 + n as u64);
        let secs = f.virtual_time.as_secs_f64();
        println!(
            "{n:>9}  {:>3}  {:>10.2}  {:>10.3}  {:>14.2}  {:>9}  {:>4}  {:>13}",
            f.qps,
            f.payload as f64 / 1e6,
            secs * 1e3,
            f.payload as f64 * 8.0 / secs / 1e9,
            f.datagrams,
            f.lost,
            f.retransmitted
        );
        assert!(f.lost > 0 || n == 2, "1% loss happened");
    }
}
