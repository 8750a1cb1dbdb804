//! Scenarios of two endpoints through the simulator: each operation, each error and its
//! status, and targeted faults (a dropped packet, a partition, a missing receive).

use softverbs_roce::Time;
use softverbs_roce::endpoint::Endpoint;
use softverbs_roce::sim::{Faults, HostId, LinkConfig, Network, ScheduledFault};
use softverbs_roce::transport::*;
use softverbs_roce::wire::{Bth, Headers, IpRepr, Op, Opcode, Psn, Transport, emit_datagram};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

const QA: u32 = 0x11;
const QB: u32 = 0x22;
/// Each host's memory: key 1 is a 64 KiB region at `BUF`, key 2 a 64 KiB one at `RECV`.
const BUF: u64 = 0x1_0000;
const RECV: u64 = 0x10_0000;
const LEN: usize = 64 * 1024;

fn ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))
}

struct Pair {
    net: Network<Endpoint<MemoryModel>>,
    a: HostId,
    b: HostId,
    events: Vec<(HostId, u32, Event)>,
}

fn memory() -> MemoryModel {
    let mut m = MemoryModel::default();
    m.add(Region::new(1, 1, BUF, LEN));
    m.add(Region::new(1, 2, RECV, LEN));
    m
}

/// Two hosts with one QP each of `qp_type`, configured by `tweak`.
fn pair(qp_type: QpType, tweak: impl Fn(&mut QpConfig)) -> Pair {
    let mut net = Network::new(1);
    net.set_default_link(LinkConfig {
        latency: Duration::from_micros(2),
        bandwidth: Some(1_250_000_000),
        ..LinkConfig::default()
    });
    let mut ea = Endpoint::new(ip(1), memory());
    let mut eb = Endpoint::new(ip(2), memory());
    for (e, me, them, peer_ip) in [(&mut ea, QA, QB, ip(2)), (&mut eb, QB, QA, ip(1))] {
        let mut cfg = QpConfig::rc(me, (peer_ip, them));
        cfg.qp_type = qp_type;
        cfg.qkey = 0x1111_1111;
        tweak(&mut cfg);
        e.add_qp(cfg).unwrap();
    }
    let a = net.add_host(ip(1), ea);
    let b = net.add_host(ip(2), eb);
    Pair {
        net,
        a,
        b,
        events: Vec::new(),
    }
}

impl Pair {
    fn ep(&mut self, h: HostId) -> &mut Endpoint<MemoryModel> {
        self.net.host_mut(h)
    }

    fn send(&mut self, h: HostId, wr: SendWr) {
        let qpn = if h == self.a { QA } else { QB };
        let now = self.net.now();
        self.ep(h)
            .with_qp(qpn, |qp| qp.post_send(now, wr))
            .unwrap()
            .unwrap();
    }

    fn try_send(&mut self, h: HostId, wr: SendWr) -> Result<(), PostError> {
        let qpn = if h == self.a { QA } else { QB };
        let now = self.net.now();
        self.ep(h).with_qp(qpn, |qp| qp.post_send(now, wr)).unwrap()
    }

    fn recv(&mut self, h: HostId, wr_id: u64, at: u64, len: u32) {
        let qpn = if h == self.a { QA } else { QB };
        self.ep(h).with_qp(qpn, |qp| {
            qp.post_recv(RecvWr {
                srq: 0,
                wr_id,
                sges: vec![Sge {
                    addr: RECV + at,
                    len,
                    lkey: 2,
                }],
            })
        });
    }

    /// Runs until nothing moves (or 10 s of virtual time); collects events.
    fn run(&mut self) {
        let limit = self.net.now().after(Duration::from_secs(10));
        self.net.run_until_idle(limit).unwrap();
        for h in [self.a, self.b] {
            while let Some((qpn, e)) = self.net.host_mut(h).poll_event() {
                self.events.push((h, qpn, e));
            }
        }
    }

    fn completions(&self, h: HostId, recv: bool) -> Vec<Completion> {
        self.events
            .iter()
            .filter(|(hh, _, _)| *hh == h)
            .filter_map(|(_, _, e)| match e {
                Event::Completion(c) if c.is_recv == recv => Some(*c),
                _ => None,
            })
            .collect()
    }

    fn bytes(&mut self, h: HostId, region: usize, at: usize, n: usize) -> Vec<u8> {
        self.ep(h).mem.regions[region].bytes[at..at + n].to_vec()
    }

    fn fill(&mut self, h: HostId, region: usize, at: usize, data: &[u8]) {
        self.ep(h).mem.regions[region].bytes[at..at + data.len()].copy_from_slice(data);
    }

    fn state(&self, h: HostId) -> QpState {
        let qpn = if h == self.a { QA } else { QB };
        self.net.host(h).qp(qpn).unwrap().state()
    }

    fn counters(&self, h: HostId) -> QpCounters {
        let qpn = if h == self.a { QA } else { QB };
        *self.net.host(h).qp(qpn).unwrap().counters()
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn local(at: u64, len: u32) -> Vec<Sge> {
    vec![Sge {
        addr: BUF + at,
        len,
        lkey: 1,
    }]
}

/// A signaled request `op` whose data is `len` bytes at `BUF + at`.
fn op_wr(id: u64, op: SendOp, at: u64, len: u32) -> SendWr {
    let mut wr = SendWr::new(id, op);
    wr.sges = local(at, len);
    wr
}

fn send_wr(id: u64, at: u64, len: u32) -> SendWr {
    let op = SendOp::Send {
        imm: None,
        invalidate: None,
    };
    op_wr(id, op, at, len)
}

#[test]
fn sends_of_every_size_arrive_whole_and_complete_both_sides() {
    let mut p = pair(QpType::Rc, |_| {});
    let sizes = [0u32, 1, 1023, 1024, 1025, 4 * 1024 + 1, 8192];
    let data = pattern(16 * 1024, 3);
    p.fill(p.a, 0, 0, &data);
    for i in 0..sizes.len() {
        p.recv(p.b, 100 + i as u64, i as u64 * 8192, 8192);
    }
    for (i, &n) in sizes.iter().enumerate() {
        p.send(p.a, send_wr(i as u64, 0, n));
    }
    p.run();
    let recvs = p.completions(p.b, true);
    let sends = p.completions(p.a, false);
    assert_eq!(recvs.len(), sizes.len(), "{recvs:?}");
    for (i, (&n, c)) in sizes.iter().zip(&recvs).enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (100 + i as u64, WcStatus::Success, WcOpcode::Recv, n)
        );
        // RC packets carry no source QP; the receiver's completion names its peer.
        assert_eq!(c.src_qp, QA, "the sender's QP");
        assert_eq!(p.bytes(p.b, 1, i * 8192, n as usize), data[..n as usize]);
    }
    assert_eq!(
        sends
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect::<Vec<_>>(),
        (0..sizes.len() as u64)
            .map(|i| (i, WcStatus::Success))
            .collect::<Vec<_>>()
    );
    assert_eq!(p.counters(p.a).retransmitted, 0);
}

#[test]
fn writes_reads_and_atomics_do_what_they_say() {
    let mut p = pair(QpType::Rc, |_| {});
    let data = pattern(5000, 7);
    p.fill(p.a, 0, 0, &data);
    p.fill(p.b, 0, 20_000, &pattern(3000, 9));
    p.fill(p.b, 0, 40_000, &100u64.to_le_bytes());
    let w = op_wr(
        1,
        SendOp::Write {
            va: BUF + 10_000,
            rkey: 1,
            imm: None,
        },
        0,
        5000,
    );
    p.send(p.a, w);
    let wi = op_wr(
        2,
        SendOp::Write {
            va: BUF + 30_000,
            rkey: 1,
            imm: Some(0xfeed),
        },
        0,
        10,
    );
    p.recv(p.b, 50, 0, 64);
    p.send(p.a, wi);
    let r = op_wr(
        3,
        SendOp::Read {
            va: BUF + 20_000,
            rkey: 1,
        },
        8_000,
        3000,
    );
    p.send(p.a, r);
    let cas = op_wr(
        4,
        SendOp::CompareSwap {
            va: BUF + 40_000,
            rkey: 1,
            compare: 100,
            swap: 7,
        },
        12_000,
        8,
    );
    p.send(p.a, cas);
    let faa = op_wr(
        5,
        SendOp::FetchAdd {
            va: BUF + 40_000,
            rkey: 1,
            add: 5,
        },
        12_008,
        8,
    );
    p.send(p.a, faa);
    p.run();
    assert_eq!(p.bytes(p.b, 0, 10_000, 5000), data);
    assert_eq!(p.bytes(p.a, 0, 8_000, 3000), pattern(3000, 9));
    assert_eq!(p.bytes(p.b, 0, 40_000, 8), 12u64.to_le_bytes());
    assert_eq!(p.bytes(p.a, 0, 12_000, 8), 100u64.to_le_bytes());
    assert_eq!(p.bytes(p.a, 0, 12_008, 8), 7u64.to_le_bytes());
    let sends: Vec<_> = p
        .completions(p.a, false)
        .iter()
        .map(|c| (c.wr_id, c.status, c.opcode))
        .collect();
    assert_eq!(
        sends,
        vec![
            (1, WcStatus::Success, WcOpcode::RdmaWrite),
            (2, WcStatus::Success, WcOpcode::RdmaWrite),
            (3, WcStatus::Success, WcOpcode::RdmaRead),
            (4, WcStatus::Success, WcOpcode::CompSwap),
            (5, WcStatus::Success, WcOpcode::FetchAdd),
        ]
    );
    let recvs = p.completions(p.b, true);
    assert_eq!(recvs.len(), 1);
    assert_eq!(
        (
            recvs[0].wr_id,
            recvs[0].opcode,
            recvs[0].imm,
            recvs[0].byte_len
        ),
        (50, WcOpcode::RecvRdmaWithImm, Some(0xfeed), 10)
    );
    assert_eq!(p.ep(p.b).mem.atomics, 2);
}

/// Every single datagram of an exchange lost in turn, either way: the result is the same.
#[test]
fn any_one_lost_datagram_is_recovered() {
    let data = pattern(6000, 1);
    let run = |drop: Option<(bool, u64)>| {
        let mut p = pair(QpType::Rc, |c| c.timeout = 8);
        if let Some((forward, k)) = drop {
            let (from, to) = if forward { (p.a, p.b) } else { (p.b, p.a) };
            p.net.add_fault(from, to, ScheduledFault::DropNth(k));
        }
        p.fill(p.a, 0, 0, &data);
        p.fill(p.b, 0, 30_000, &pattern(2500, 4));
        p.recv(p.b, 1, 0, 8192);
        p.send(p.a, send_wr(10, 0, 6000));
        let r = op_wr(
            11,
            SendOp::Read {
                va: BUF + 30_000,
                rkey: 1,
            },
            20_000,
            2500,
        );
        p.send(p.a, r);
        let f = op_wr(
            12,
            SendOp::FetchAdd {
                va: BUF + 50_000,
                rkey: 1,
                add: 3,
            },
            40_000,
            8,
        );
        p.send(p.a, f);
        p.run();
        let sent = p.net.link_counters(p.a, p.b).sent.datagrams;
        let result = (
            p.completions(p.a, false)
                .iter()
                .map(|c| (c.wr_id, c.status))
                .collect::<Vec<_>>(),
            p.completions(p.b, true)
                .iter()
                .map(|c| (c.wr_id, c.status, c.byte_len))
                .collect::<Vec<_>>(),
            p.bytes(p.b, 1, 0, 6000),
            p.bytes(p.a, 0, 20_000, 2500),
            p.bytes(p.b, 0, 50_000, 8),
            p.bytes(p.a, 0, 40_000, 8),
            p.ep(p.b).mem.atomics,
        );
        (result, sent)
    };
    let (clean, sent) = run(None);
    assert_eq!(clean.0.len(), 3);
    assert_eq!(clean.6, 1);
    for forward in [true, false] {
        for k in 0..sent + 4 {
            let (got, _) = run(Some((forward, k)));
            assert_eq!(
                got,
                clean,
                "datagram {k} {} lost",
                if forward { "A->B" } else { "B->A" }
            );
        }
    }
}

#[test]
fn a_partition_fails_the_request_after_exactly_retry_cnt_retransmissions() {
    for retry_cnt in [0u8, 1, 3, 6] {
        let mut p = pair(QpType::Rc, |c| {
            c.retry_cnt = retry_cnt;
            c.timeout = 4;
        });
        p.net.partition(p.a, p.b, Time(0), Time(u64::MAX));
        p.recv(p.b, 1, 0, 64);
        p.send(p.a, send_wr(7, 0, 16));
        p.send(p.a, send_wr(8, 0, 16));
        p.run();
        let sends: Vec<_> = p
            .completions(p.a, false)
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(
            sends,
            vec![(7, WcStatus::RetryExcErr), (8, WcStatus::WrFlushErr)]
        );
        assert_eq!(p.state(p.a), QpState::Err);
        // The first transmission and `retry_cnt` more, each of both messages.
        assert_eq!(
            p.net.link_counters(p.a, p.b).sent.datagrams,
            2 * (1 + u64::from(retry_cnt))
        );
        assert_eq!(p.counters(p.a).timeouts, 1 + u64::from(retry_cnt));
    }
}

#[test]
fn rnr_naks_wait_for_a_receive_and_run_out_as_configured() {
    // No receive at first: RNR NAKs, then the receive is posted and the SEND lands.
    let mut p = pair(QpType::Rc, |c| c.min_rnr_timer = 1);
    p.send(p.a, send_wr(1, 0, 100));
    let t = p.net.now().after(Duration::from_micros(200));
    p.net.run_until(t).unwrap();
    assert!(p.counters(p.b).rnr_naks_sent > 0);
    p.recv(p.b, 9, 0, 128);
    p.run();
    assert_eq!(p.completions(p.b, true)[0].status, WcStatus::Success);
    assert_eq!(p.completions(p.a, false)[0].status, WcStatus::Success);
    // rnr_retry 2: the third RNR NAK ends it.
    let mut p = pair(QpType::Rc, |c| {
        c.min_rnr_timer = 1;
        c.rnr_retry = 2;
    });
    p.send(p.a, send_wr(1, 0, 100));
    p.run();
    assert_eq!(
        p.completions(p.a, false)[0].status,
        WcStatus::RnrRetryExcErr
    );
    assert_eq!(p.counters(p.b).rnr_naks_sent, 3);
    assert_eq!(p.state(p.a), QpState::Err);
}

#[test]
fn remote_errors_have_their_statuses_and_fail_both_qps() {
    type Case = (SendOp, WcStatus);
    let cases: [Case; 4] = [
        (
            SendOp::Write {
                va: BUF,
                rkey: 99,
                imm: None,
            },
            WcStatus::RemAccessErr,
        ),
        (
            SendOp::Write {
                va: BUF + LEN as u64 - 4,
                rkey: 1,
                imm: None,
            },
            WcStatus::RemAccessErr,
        ),
        (SendOp::Read { va: BUF, rkey: 42 }, WcStatus::RemAccessErr),
        (
            SendOp::FetchAdd {
                va: BUF + 4,
                rkey: 1,
                add: 1,
            },
            WcStatus::RemInvReqErr,
        ),
    ];
    for (op, status) in cases {
        let mut p = pair(QpType::Rc, |_| {});
        p.recv(p.b, 5, 0, 64);
        let mut wr = SendWr::new(1, op);
        wr.sges = local(0, 8);
        p.send(p.a, wr);
        p.send(p.a, send_wr(2, 0, 8));
        p.run();
        let sends: Vec<_> = p
            .completions(p.a, false)
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(
            sends,
            vec![(1, status), (2, WcStatus::WrFlushErr)],
            "{op:?}"
        );
        assert_eq!(
            (p.state(p.a), p.state(p.b)),
            (QpState::Err, QpState::Err),
            "{op:?}"
        );
        let recvs: Vec<_> = p
            .completions(p.b, true)
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(recvs, vec![(5, WcStatus::WrFlushErr)], "{op:?}");
    }
    // A SEND longer than the receive: local length error there, invalid request here.
    let mut p = pair(QpType::Rc, |_| {});
    p.recv(p.b, 5, 0, 10);
    p.send(p.a, send_wr(1, 0, 11));
    p.run();
    assert_eq!(p.completions(p.b, true)[0].status, WcStatus::LocLenErr);
    assert_eq!(p.completions(p.a, false)[0].status, WcStatus::RemInvReqErr);
    // Rights the QP does not grant: invalid request.
    let mut p = pair(QpType::Rc, |c| c.access = QpAccess::REMOTE_WRITE);
    let r = op_wr(1, SendOp::Read { va: BUF, rkey: 1 }, 0, 8);
    p.send(p.a, r);
    p.run();
    assert_eq!(p.completions(p.a, false)[0].status, WcStatus::RemInvReqErr);
}

#[test]
fn an_atomic_whose_ack_is_lost_is_executed_once() {
    let mut p = pair(QpType::Rc, |c| c.timeout = 6);
    p.fill(p.b, 0, 0, &40u64.to_le_bytes());
    p.net.add_fault(p.b, p.a, ScheduledFault::DropNth(0));
    let f = op_wr(
        1,
        SendOp::FetchAdd {
            va: BUF,
            rkey: 1,
            add: 2,
        },
        100,
        8,
    );
    p.send(p.a, f);
    p.run();
    assert_eq!(p.completions(p.a, false)[0].status, WcStatus::Success);
    assert_eq!(p.bytes(p.a, 0, 100, 8), 40u64.to_le_bytes());
    assert_eq!(p.bytes(p.b, 0, 0, 8), 42u64.to_le_bytes());
    assert_eq!(p.ep(p.b).mem.atomics, 1);
    assert_eq!(p.counters(p.b).duplicates, 1);
}

#[test]
fn uc_drops_a_message_that_lost_a_packet_and_takes_the_next() {
    let mut p = pair(QpType::Uc, |_| {});
    // The second datagram is the middle of the first (3-packet) message.
    p.net.add_fault(p.a, p.b, ScheduledFault::DropNth(1));
    p.recv(p.b, 1, 0, 4096);
    p.recv(p.b, 2, 4096, 4096);
    p.fill(p.a, 0, 0, &pattern(3000, 2));
    p.send(p.a, send_wr(10, 0, 3000));
    p.send(p.a, send_wr(11, 0, 500));
    p.run();
    let recvs: Vec<_> = p
        .completions(p.b, true)
        .iter()
        .map(|c| (c.wr_id, c.byte_len))
        .collect();
    // The receive the broken message had taken is used by the next one.
    assert_eq!(recvs, vec![(1, 500)]);
    assert_eq!(p.bytes(p.b, 1, 0, 500), pattern(500, 2));
    let sends: Vec<_> = p
        .completions(p.a, false)
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        sends,
        vec![(10, WcStatus::Success), (11, WcStatus::Success)]
    );
}

#[test]
fn ud_places_the_grh_and_checks_the_qkey() {
    let mut p = pair(QpType::Ud, |c| c.peer = None);
    p.recv(p.b, 1, 0, 40 + 100);
    p.recv(p.b, 2, 200, 40 + 100);
    p.fill(p.a, 0, 0, &pattern(100, 5));
    let dest = |qkey| UdDest {
        addr: ip(2),
        qpn: QB,
        qkey,
    };
    let mut wr = send_wr(1, 0, 100);
    wr.ud = Some(dest(0x1111_1111));
    wr.op = SendOp::Send {
        imm: Some(77),
        invalidate: None,
    };
    p.send(p.a, wr);
    let mut bad = send_wr(2, 0, 100);
    bad.ud = Some(dest(0x2222));
    p.send(p.a, bad);
    // Top bit set: the sender's own Q_Key (the same here) goes out.
    let mut own = send_wr(3, 0, 50);
    own.ud = Some(dest(0x8000_0000));
    p.send(p.a, own);
    p.run();
    let recvs = p.completions(p.b, true);
    assert_eq!(recvs.len(), 2, "{recvs:?}");
    assert_eq!(
        (
            recvs[0].byte_len,
            recvs[0].imm,
            recvs[0].src_qp,
            recvs[0].grh
        ),
        (140, Some(77), QA, Some(NetworkHeader::Ipv4))
    );
    assert_eq!(recvs[1].byte_len, 90);
    let grh = p.bytes(p.b, 1, 0, 40);
    assert_eq!(grh[..20], [0; 20]);
    assert_eq!(grh[20] >> 4, 4, "the IPv4 header in the second half");
    assert_eq!(grh[32..36], [10, 0, 0, 1]);
    assert_eq!(p.bytes(p.b, 1, 40, 100), pattern(100, 5));
    assert_eq!(p.counters(p.b).dropped, 1);
    // Longer than the MTU: refused when posted.
    let mut big = send_wr(4, 0, 2000);
    big.ud = Some(dest(1));
    let now = p.net.now();
    let r = p.ep(p.a).with_qp(QA, |qp| qp.post_send(now, big)).unwrap();
    assert!(matches!(r, Err(PostError::TooLong { .. })));
}

#[test]
fn posting_to_a_failed_qp_flushes_at_once() {
    let mut p = pair(QpType::Rc, |_| {});
    p.ep(p.a).with_qp(QA, |qp| qp.set_error());
    p.send(p.a, send_wr(1, 0, 8));
    p.recv(p.a, 2, 0, 8);
    p.run();
    let all: Vec<_> = p.events.iter().map(|(_, _, e)| *e).collect();
    assert!(matches!(all[0], Event::Error(QpError::Modified)), "{all:?}");
    let c: Vec<_> = p
        .completions(p.a, false)
        .iter()
        .chain(p.completions(p.a, true).iter())
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        c,
        vec![(1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)]
    );
}

#[test]
fn reads_and_atomics_in_flight_are_limited_by_max_rd_atomic() {
    for limit in [1u8, 2, 4] {
        let mut p = pair(QpType::Rc, |c| c.max_rd_atomic = limit);
        for i in 0..4 {
            let r = op_wr(i, SendOp::Read { va: BUF, rkey: 1 }, i * 100, 64);
            p.send(p.a, r);
        }
        // Before any response can be back (2 µs each way): only `limit` requests left.
        p.net.run_until(Time(3_000)).unwrap();
        assert_eq!(
            p.net.link_counters(p.a, p.b).sent.datagrams,
            u64::from(limit)
        );
        p.run();
        assert_eq!(p.completions(p.a, false).len(), 4);
    }
}

#[test]
fn retry_cnt_7_is_seven_retries_not_forever() {
    // IBTA and ConnectX: only rnr_retry 7 means forever (soft-RoCE alone retries forever).
    let mut p = pair(QpType::Rc, |c| {
        c.retry_cnt = 7;
        c.timeout = 2;
    });
    p.net.partition(p.a, p.b, Time(0), Time(u64::MAX));
    p.recv(p.b, 1, 0, 64);
    p.send(p.a, send_wr(1, 0, 16));
    p.run();
    assert_eq!(p.completions(p.a, false)[0].status, WcStatus::RetryExcErr);
    assert_eq!(p.counters(p.a).timeouts, 8, "{:?}", p.counters(p.a));
    assert_eq!(p.net.link_counters(p.a, p.b).sent.datagrams, 8);
}

/// A sends one SEND to B, B's ACK of it is lost, and B's QP goes (`retire`: destroyed as
/// `ibv_destroy_qp` does; else only removed) before A retransmits. Returns A's completions.
fn ack_lost_then_destroyed(retire: bool) -> (Pair, Vec<Completion>) {
    let mut p = pair(QpType::Rc, |c| {
        c.timeout = 4;
        c.retry_cnt = 3;
    });
    p.net.add_fault(p.b, p.a, ScheduledFault::DropNth(0));
    p.recv(p.b, 1, 0, 64);
    p.send(p.a, send_wr(9, 0, 16));
    // The SEND arrives after 2 µs; A's first timeout is at 65 µs.
    p.net.run_until(Time(20_000)).unwrap();
    assert_eq!(p.ep(p.b).qp(QB).unwrap().expected_psn(), Psn::new(1));
    let now = p.net.now();
    if retire {
        p.ep(p.b).retire_qp(now, QB).unwrap();
    } else {
        p.ep(p.b).remove_qp(QB).unwrap();
    }
    p.run();
    let c = p.completions(p.a, false);
    (p, c)
}

#[test]
fn a_destroyed_qp_acknowledges_again_what_it_had_received() {
    let (mut p, c) = ack_lost_then_destroyed(true);
    assert_eq!((c[0].wr_id, c[0].status), (9, WcStatus::Success));
    assert_eq!(p.counters(p.a).timeouts, 1);
    assert_eq!(p.ep(p.b).counters().lingering_acks, 1);
    assert_eq!(p.ep(p.b).lingering(), 1);
    // What the QP never received is not acknowledged: a new SEND fails as to a QP that is
    // gone, after its retries.
    p.send(p.a, send_wr(10, 0, 16));
    p.run();
    let c = p.completions(p.a, false);
    assert_eq!((c[1].wr_id, c[1].status), (10, WcStatus::RetryExcErr));
    assert_eq!(p.ep(p.b).counters().lingering_acks, 1);
    assert_eq!(p.ep(p.b).counters().unknown_qp, 4);
}

#[test]
fn a_qp_only_removed_leaves_its_peer_retrying_to_failure() {
    // The same run with the QP removed, not destroyed: what lingering changes.
    let (mut p, c) = ack_lost_then_destroyed(false);
    assert_eq!((c[0].wr_id, c[0].status), (9, WcStatus::RetryExcErr));
    assert_eq!(p.ep(p.b).counters().lingering_acks, 0);
    assert_eq!(p.ep(p.b).lingering(), 0);
}

#[test]
fn a_lingering_qp_answers_its_peer_only_and_not_for_long() {
    let (mut p, _) = ack_lost_then_destroyed(true);
    let now = p.net.now();
    let dup = |src: IpAddr| {
        let opcode = Opcode::new(Transport::Rc, Op::SendOnly).unwrap();
        let mut bth = Bth::new(opcode, QB, Psn::new(0));
        bth.ack_req = true;
        let h = Headers::new(bth);
        let ip = IpRepr::between(src, ip(2)).unwrap();
        let mut buf = vec![0; 256];
        let n = emit_datagram(&ip, 0xc001, &h, &[0; 16], &mut buf).unwrap();
        buf.truncate(n);
        buf
    };
    let b = p.ep(p.b);
    let before = *b.counters();
    // A third host's copy of the peer's duplicate: dropped, nothing to send.
    b.handle_datagram(now, &dup(ip(9)));
    assert_eq!(b.counters().unknown_qp, before.unknown_qp + 1);
    assert_eq!(b.poll_transmit(now, &mut [0; 4096]), None);
    // The peer's own: answered.
    b.handle_datagram(now, &dup(ip(1)));
    assert_eq!(b.counters().lingering_acks, before.lingering_acks + 1);
    assert!(b.poll_transmit(now, &mut [0; 4096]).is_some());
    // Twice the retry budget (4 timeouts of 65 µs) is under a second: it lasts 1 s.
    let later = now.after(Duration::from_millis(1001));
    b.handle_datagram(later, &dup(ip(1)));
    assert_eq!(b.counters().lingering_acks, before.lingering_acks + 1);
    assert_eq!(b.poll_transmit(later, &mut [0; 4096]), None);
}

#[test]
fn a_receive_that_cannot_be_written_is_a_remote_operational_error() {
    let mut p = pair(QpType::Rc, |_| {});
    p.ep(p.b).with_qp(QB, |qp| {
        qp.post_recv(RecvWr {
            srq: 0,
            wr_id: 3,
            sges: vec![Sge {
                addr: RECV,
                len: 64,
                lkey: 77,
            }],
        })
    });
    p.send(p.a, send_wr(1, 0, 8));
    p.run();
    assert_eq!(p.completions(p.b, true)[0].status, WcStatus::LocProtErr);
    assert_eq!(p.completions(p.a, false)[0].status, WcStatus::RemOpErr);
    assert_eq!((p.state(p.a), p.state(p.b)), (QpState::Err, QpState::Err));
}

#[test]
fn packets_of_another_partition_are_dropped() {
    let mut p = pair(QpType::Rc, |c| c.timeout = 4);
    // B is in partition 0x1234; A sends with the default P_Key, so B drops every request.
    let now = p.net.now();
    let mut cfg = p.net.host(p.b).qp(QB).unwrap().config().clone();
    cfg.pkey = 0x9234;
    cfg.qpn = 0x33;
    p.ep(p.b).add_qp(cfg).unwrap();
    p.recv(p.b, 1, 0, 64);
    let mut wr = send_wr(1, 0, 8);
    wr.signaled = true;
    let mut cfg_a = p.net.host(p.a).qp(QA).unwrap().config().clone();
    cfg_a.qpn = 0x44;
    cfg_a.peer = Some((ip(2), 0x33));
    cfg_a.retry_cnt = 1;
    p.ep(p.a).add_qp(cfg_a).unwrap();
    p.ep(p.a)
        .with_qp(0x44, |q| q.post_send(now, wr))
        .unwrap()
        .unwrap();
    p.run();
    let dropped = p.net.host(p.b).qp(0x33).unwrap().counters().dropped;
    assert_eq!(dropped, 2, "the first transmission and its retry");
    let c: Vec<_> = p
        .events
        .iter()
        .filter_map(|(_, q, e)| match e {
            Event::Completion(c) if *q == 0x44 => Some(c.status),
            _ => None,
        })
        .collect();
    assert_eq!(c, vec![WcStatus::RetryExcErr]);
}

/// A message of many windows: partial ACKs move the window along it, with and without loss.
#[test]
fn a_message_longer_than_the_window_goes_through() {
    for (window, loss) in [(16, 0.0), (16, 0.02), (3, 0.0), (3, 0.02)] {
        let mut p = pair(QpType::Rc, |c| {
            c.window = window;
            c.pmtu = 256;
            c.timeout = 6;
        });
        p.net.set_default_link(LinkConfig {
            latency: Duration::from_micros(2),
            faults: Faults {
                loss,
                ..Default::default()
            },
            ..LinkConfig::default()
        });
        let data = pattern(LEN, 9);
        p.fill(p.a, 0, 0, &data);
        let w = op_wr(
            1,
            SendOp::Write {
                va: BUF,
                rkey: 1,
                imm: None,
            },
            0,
            LEN as u32,
        );
        p.send(p.a, w);
        p.run();
        assert_eq!(
            p.completions(p.a, false)[0].status,
            WcStatus::Success,
            "loss {loss}"
        );
        assert_eq!(p.bytes(p.b, 0, 0, LEN), data, "loss {loss}");
    }
}

/// RDMA ATOMIC WRITE: the word lands and the completion is `AtomicWrite`; when its
/// zero-length READ response is lost, the retried request is a duplicate, answered from the
/// responder's resource (the requester still completes once, with success).
#[test]
fn an_atomic_write_whose_response_is_lost_is_answered_again() {
    let mut p = pair(QpType::Rc, |c| c.timeout = 6);
    p.fill(p.b, 0, 0, &[0xaa; 8]);
    p.net.add_fault(p.b, p.a, ScheduledFault::DropNth(0));
    let aw = SendWr::new(
        1,
        SendOp::AtomicWrite {
            va: BUF,
            rkey: 1,
            value: u64::from_ne_bytes(*b"atomicwr"),
        },
    );
    p.send(p.a, aw);
    p.run();
    let c = p.completions(p.a, false);
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!(
        (c[0].status, c[0].opcode),
        (WcStatus::Success, WcOpcode::AtomicWrite)
    );
    assert_eq!(p.bytes(p.b, 0, 0, 8), b"atomicwr");
    assert_eq!(
        p.counters(p.b).duplicates,
        1,
        "the retried request is a duplicate"
    );
    assert_eq!(p.counters(p.a).retransmitted, 1);
}

/// ATOMIC WRITE needs the QP's and the region's write right, an aligned address, and RC.
#[test]
fn atomic_write_errors_have_their_statuses() {
    // The QP grants no remote write: invalid request.
    let mut p = pair(QpType::Rc, |c| c.access = QpAccess::REMOTE_READ);
    let aw = |va| {
        SendWr::new(
            1,
            SendOp::AtomicWrite {
                va,
                rkey: 1,
                value: 7,
            },
        )
    };
    p.send(p.a, aw(BUF));
    p.run();
    assert_eq!(p.completions(p.a, false)[0].status, WcStatus::RemInvReqErr);
    // A key that is not the region's: remote access error.
    let mut p = pair(QpType::Rc, |_| {});
    let mut bad = aw(BUF);
    bad.op = SendOp::AtomicWrite {
        va: BUF,
        rkey: 77,
        value: 7,
    };
    p.send(p.a, bad);
    p.run();
    assert_eq!(p.completions(p.a, false)[0].status, WcStatus::RemAccessErr);
    assert_eq!(p.bytes(p.b, 0, 0, 8), [0; 8]);
    // Misaligned, or on UC: refused at post.
    let mut p = pair(QpType::Rc, |_| {});
    assert!(p.try_send(p.a, aw(BUF + 4)).is_err());
    let mut u = pair(QpType::Uc, |_| {});
    assert!(u.try_send(u.a, aw(BUF)).is_err());
}

#[test]
fn a_flush_follows_the_writes_before_it_and_checks_its_key() {
    let mut p = pair(QpType::Rc, |_| {});
    p.fill(p.a, 0, 0, &pattern(64, 8));
    let flush = |wr_id, rkey, va, len, whole_region| {
        SendWr::new(
            wr_id,
            SendOp::Flush {
                va,
                rkey,
                len,
                whole_region,
            },
        )
    };
    let mut w = send_wr(1, 0, 64);
    w.op = SendOp::Write {
        va: BUF + 128,
        rkey: 1,
        imm: None,
    };
    p.send(p.a, w);
    p.send(p.a, flush(2, 1, BUF + 128, 64, false));
    p.send(p.a, flush(3, 1, 0, 0, true));
    p.run();
    let done: Vec<_> = p
        .completions(p.a, false)
        .iter()
        .map(|c| (c.wr_id, c.status, c.opcode))
        .collect();
    assert_eq!(
        done,
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite),
            (2, WcStatus::Success, WcOpcode::Flush),
            (3, WcStatus::Success, WcOpcode::Flush),
        ]
    );
    assert_eq!(p.bytes(p.b, 0, 128, 64), pattern(64, 8));
    // A range past the region, or a key that is not the region's: remote access error.
    for bad in [
        flush(4, 1, BUF + LEN as u64 - 8, 64, false),
        flush(5, 77, BUF, 8, false),
    ] {
        let mut q = pair(QpType::Rc, |_| {});
        q.send(q.a, bad);
        q.run();
        assert_eq!(q.completions(q.a, false)[0].status, WcStatus::RemAccessErr);
    }
    // With data, or on UC: refused at post.
    let mut with_data = flush(6, 1, BUF, 8, false);
    with_data.sges = send_wr(0, 0, 8).sges;
    assert!(p.try_send(p.a, with_data).is_err());
    let mut u = pair(QpType::Uc, |_| {});
    assert!(u.try_send(u.a, flush(7, 1, BUF, 8, false)).is_err());
}

#[test]
fn what_the_responder_executed_before_an_error_is_still_answered() {
    // A READ and a FLUSH, then a WRITE with a bad key: the first two complete, the WRITE
    // fails with the responder's NAK, in order. (The simulator answers each request before
    // the next arrives; `multiprocess/flush.rs` between hosts, where the engine reads a burst
    // at once, is the case of replies still queued when the error comes.)
    let mut p = pair(QpType::Rc, |_| {});
    p.fill(p.b, 0, 0, &pattern(64, 3));
    let mut read = send_wr(1, 0, 64);
    read.op = SendOp::Read { va: BUF, rkey: 1 };
    p.send(p.a, read);
    p.send(
        p.a,
        SendWr::new(
            2,
            SendOp::Flush {
                va: BUF,
                rkey: 1,
                len: 64,
                whole_region: false,
            },
        ),
    );
    let mut bad = send_wr(3, 0, 8);
    bad.op = SendOp::Write {
        va: BUF,
        rkey: 77,
        imm: None,
    };
    p.send(p.a, bad);
    p.run();
    let done: Vec<_> = p
        .completions(p.a, false)
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        done,
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::RemAccessErr)
        ]
    );
    assert_eq!(p.bytes(p.a, 0, 0, 64), pattern(64, 3));
}
