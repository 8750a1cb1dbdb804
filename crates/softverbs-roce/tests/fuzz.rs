//! Fuzzing the parser and the QPs with what an attacker on the network could send.
//!
//! Cases are arbitrary bytes, and valid packets (every kind a requester or responder sends,
//! taken from a real exchange) mutated: bits flipped, bytes replaced, truncated, extended, or
//! their header fields rewritten and the packet re-emitted with a correct ICRC so that it
//! reaches the QP's logic. Each goes to the parser and to a host with an RC responder, an RC
//! requester with requests outstanding, a UC and a UD QP. Checked for every case:
//! - nothing panics;
//! - every memory access that happens lies inside a valid key's region and rights (a guard
//!   around the memory checks each one itself);
//! - a packet outside an RC QP's PSN window changes nothing: for the responder, any PSN but
//!   the expected one leaves memory, completions and the expected PSN as they were; for the
//!   requester, a response outside its unacknowledged window leaves them too.
//!
//! `SOFTVERBS_FUZZ_CASES=N` sets the number of cases (default 5000; the note reports a run of
//! 1,000,000); a failure names its case seed.

use softverbs_roce::Time;
use softverbs_roce::endpoint::Endpoint;
use softverbs_roce::sim::SplitMix64;
use softverbs_roce::transport::*;
use softverbs_roce::wire::*;
use std::net::{IpAddr, Ipv4Addr};

const A: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 9, 0, 1));
const B: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 9, 0, 2));
const RC_REQ: u32 = 0x11; // on A
const RC_RESP: u32 = 0x21; // on B
const UC: u32 = 0x22;
const UD: u32 = 0x23;
const BASE: u64 = 0x4000;
const LEN: usize = 16 * 1024;

/// Memory that checks each access itself, independently of the model it wraps.
struct Guard {
    inner: MemoryModel,
    violations: Vec<String>,
}

impl Guard {
    fn within(&mut self, what: &str, rkey: u32, va: u64, len: u64, ok: fn(&Region) -> bool) {
        let inside = self.inner.regions.iter().any(|r| {
            r.rkey == rkey
                && r.valid
                && ok(r)
                && va >= r.va
                && va
                    .checked_add(len)
                    .is_some_and(|end| end <= r.va + r.bytes.len() as u64)
        });
        if !inside {
            self.violations
                .push(format!("{what} of {len} bytes at {va:#x} by key {rkey:#x}"));
        }
    }
}

impl Memory for Guard {
    fn check(&self, pd: u32, rkey: u32, va: u64, len: u64, access: Access) -> Result<(), MemError> {
        self.inner.check(pd, rkey, va, len, access)
    }
    fn write(&mut self, pd: u32, rkey: u32, va: u64, data: &[u8]) -> Result<(), MemError> {
        let r = self.inner.write(pd, rkey, va, data);
        if r.is_ok() {
            self.within("write", rkey, va, data.len() as u64, |r| r.remote_write);
        }
        r
    }
    fn read(&self, pd: u32, rkey: u32, va: u64, out: &mut [u8]) -> Result<(), MemError> {
        // Reads cannot record (shared borrow); the model's result is checked against the
        // regions here instead.
        let r = self.inner.read(pd, rkey, va, out);
        if r.is_ok() {
            let inside = self.inner.regions.iter().any(|g| {
                g.rkey == rkey
                    && g.valid
                    && g.remote_read
                    && va >= g.va
                    && va
                        .checked_add(out.len() as u64)
                        .is_some_and(|e| e <= g.va + g.bytes.len() as u64)
            });
            assert!(
                inside,
                "read of {} bytes at {va:#x} by key {rkey:#x} outside",
                out.len()
            );
        }
        r
    }
    fn atomic(&mut self, pd: u32, rkey: u32, va: u64, op: AtomicOp) -> Result<u64, MemError> {
        let r = self.inner.atomic(pd, rkey, va, op);
        if r.is_ok() {
            self.within("atomic", rkey, va, 8, |r| r.remote_atomic);
        }
        r
    }
    fn atomic_write(
        &mut self,
        pd: u32,
        rkey: u32,
        va: u64,
        bytes: [u8; 8],
    ) -> Result<(), MemError> {
        let r = self.inner.atomic_write(pd, rkey, va, bytes);
        if r.is_ok() {
            self.within("atomic write", rkey, va, 8, |r| r.remote_write);
        }
        r
    }
    fn gather(&self, pd: u32, sges: &[Sge], offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.inner.gather(pd, sges, offset, out)
    }
    fn scatter(&mut self, pd: u32, sges: &[Sge], offset: u64, data: &[u8]) -> Result<(), MemError> {
        self.inner.scatter(pd, sges, offset, data)
    }
    fn invalidate(&mut self, pd: u32, rkey: u32) -> Result<(), MemError> {
        self.inner.invalidate(pd, rkey)
    }
    fn flush(
        &mut self,
        pd: u32,
        rkey: u32,
        va: u64,
        len: u64,
        whole_region: bool,
    ) -> Result<(), MemError> {
        self.inner.flush(pd, rkey, va, len, whole_region)
    }
}

fn memory() -> Guard {
    let mut m = MemoryModel::default();
    m.add(Region::new(1, 1, BASE, LEN));
    let mut ro = Region::new(1, 2, BASE + 0x10_0000, 4096);
    ro.remote_write = false;
    ro.remote_atomic = false;
    m.add(ro);
    m.add(Region::new(2, 3, BASE + 0x20_0000, 4096)); // another PD
    Guard {
        inner: m,
        violations: Vec::new(),
    }
}

fn qp(qp_type: QpType, qpn: u32, peer: (IpAddr, u32)) -> QpConfig {
    let mut c = QpConfig::rc(qpn, peer);
    c.qp_type = qp_type;
    c.pmtu = 256;
    c.qkey = 0x1111_1111;
    c.timeout = 10;
    c.sq_psn = Psn::new(0xff_fff8);
    c.rq_psn = Psn::new(0xff_fff8);
    if qp_type == QpType::Ud {
        c.peer = None;
    }
    c
}

/// The two hosts: A with an RC requester (and UC/UD senders), B with the responders.
fn hosts() -> (Endpoint<Guard>, Endpoint<Guard>) {
    let mut a = Endpoint::new(A, memory());
    let mut b = Endpoint::new(B, memory());
    a.add_qp(qp(QpType::Rc, RC_REQ, (B, RC_RESP))).unwrap();
    a.add_qp(qp(QpType::Uc, UC + 0x100, (B, UC))).unwrap();
    a.add_qp(qp(QpType::Ud, UD + 0x100, (B, UD))).unwrap();
    b.add_qp(qp(QpType::Rc, RC_RESP, (A, RC_REQ))).unwrap();
    b.add_qp(qp(QpType::Uc, UC, (A, UC + 0x100))).unwrap();
    b.add_qp(qp(QpType::Ud, UD, (A, UD + 0x100))).unwrap();
    for (qpn, n) in [(RC_RESP, 8u64), (UC, 8), (UD, 8)] {
        for i in 0..n {
            b.with_qp(qpn, |q| {
                q.post_recv(RecvWr {
                    srq: 0,
                    wr_id: i,
                    sges: vec![Sge {
                        addr: BASE + 8192 + i * 512,
                        len: 512,
                        lkey: 1,
                    }],
                })
            });
        }
    }
    (a, b)
}

/// Requests of every kind from A, and the valid packets they and their answers make.
fn corpus() -> Vec<Vec<u8>> {
    let (mut a, mut b) = hosts();
    let local = |at: u64, len: u32| {
        vec![Sge {
            addr: BASE + at,
            len,
            lkey: 1,
        }]
    };
    let mut wrs = Vec::new();
    for (i, len) in [0u32, 7, 256, 700].into_iter().enumerate() {
        let i = i as u64;
        let mut s = SendWr::new(
            i,
            SendOp::Send {
                imm: (i % 2 == 0).then_some(5),
                invalidate: None,
            },
        );
        s.sges = local(0, len);
        wrs.push((RC_REQ, s.clone()));
        wrs.push((UC + 0x100, s.clone()));
        let mut w = SendWr::new(
            10 + i,
            SendOp::Write {
                va: BASE + 1024,
                rkey: 1,
                imm: (i == 1).then_some(9),
            },
        );
        w.sges = local(0, len);
        wrs.push((RC_REQ, w));
        let mut r = SendWr::new(
            20 + i,
            SendOp::Read {
                va: BASE + 2048,
                rkey: 1,
            },
        );
        r.sges = local(4096, len);
        wrs.push((RC_REQ, r));
    }
    let mut cas = SendWr::new(
        30,
        SendOp::CompareSwap {
            va: BASE + 64,
            rkey: 1,
            compare: 0,
            swap: 1,
        },
    );
    cas.sges = local(6000, 8);
    wrs.push((RC_REQ, cas));
    let mut faa = SendWr::new(
        31,
        SendOp::FetchAdd {
            va: BASE + 72,
            rkey: 1,
            add: 1,
        },
    );
    faa.sges = local(6008, 8);
    wrs.push((RC_REQ, faa));
    let mut inv = SendWr::new(
        32,
        SendOp::Send {
            imm: None,
            invalidate: Some(1),
        },
    );
    inv.sges = local(0, 4);
    wrs.push((RC_REQ, inv));
    let mut ud = SendWr::new(
        33,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
    );
    ud.sges = local(0, 100);
    ud.ud = Some(UdDest {
        addr: B,
        qpn: UD,
        qkey: 0x1111_1111,
    });
    wrs.push((UD + 0x100, ud));
    for (qpn, wr) in wrs {
        a.with_qp(qpn, |q| q.post_send(Time(0), wr))
            .unwrap()
            .unwrap();
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 9000];
    for _ in 0..1000 {
        let mut moved = false;
        while let Some((_, n)) = a.poll_transmit(Time(0), &mut buf) {
            out.push(buf[..n].to_vec());
            b.handle_datagram(Time(0), &buf[..n]);
            moved = true;
        }
        while let Some((_, n)) = b.poll_transmit(Time(0), &mut buf) {
            out.push(buf[..n].to_vec());
            a.handle_datagram(Time(0), &buf[..n]);
            moved = true;
        }
        if !moved {
            break;
        }
    }
    out
}

/// Rewrites one header field of a parsed packet and emits it again with a valid ICRC.
fn rewrite(p: &[u8], r: &mut SplitMix64) -> Option<Vec<u8>> {
    let d = Datagram::parse(p).ok()?;
    let mut h = d.headers;
    let mut payload = d.payload.to_vec();
    let any = |r: &mut SplitMix64| r.next_u64();
    match r.below(12) {
        0 => h.bth.psn = Psn::new(any(r) as u32),
        1 => h.bth.psn = h.bth.psn.add(r.below(5) as u32).sub(2),
        2 => {
            let ops: Vec<Opcode> = Opcode::all().collect();
            h.bth.opcode = ops[r.below(ops.len() as u64) as usize];
        }
        3 => {
            h.bth.dest_qp =
                [RC_REQ, RC_RESP, UC, UD, any(r) as u32 & 0xff_ffff][r.below(5) as usize]
        }
        4 => h.bth.pkey = any(r) as u16,
        5 => {
            if let Some(reth) = &mut h.reth {
                match r.below(3) {
                    0 => reth.va = any(r),
                    1 => reth.len = any(r) as u32,
                    _ => reth.rkey = r.below(5) as u32,
                }
            }
        }
        6 => {
            if let Some(a) = &mut h.atomic_eth {
                a.va = if r.below(2) == 0 {
                    any(r)
                } else {
                    BASE + r.below(64)
                };
                a.rkey = r.below(4) as u32;
            }
        }
        7 => {
            if let Some(a) = &mut h.aeth {
                a.kind = match r.below(3) {
                    0 => AethKind::Ack { credits: 31 },
                    1 => AethKind::RnrNak {
                        timer: r.below(32) as u8,
                    },
                    _ => AethKind::Nak(NakCode::InvalidRequest),
                };
                a.msn = any(r) as u32 & 0xff_ffff;
            }
        }
        8 => payload.resize(r.below(600) as usize, 0xee),
        9 => {
            if let Some(d) = &mut h.deth {
                d.qkey = if r.below(2) == 0 {
                    0x1111_1111
                } else {
                    any(r) as u32
                };
            }
        }
        10 => h.ieth = h.ieth.map(|_| r.below(4) as u32),
        _ => h.bth.ack_req = !h.bth.ack_req,
    }
    // Make the headers fit the (maybe new) opcode, with plausible values.
    let op = h.bth.opcode.op;
    let ud = h.bth.opcode.transport == Transport::Ud;
    h.deth = if ud {
        h.deth.or(Some(Deth {
            qkey: 0x1111_1111,
            src_qp: UD + 0x100,
        }))
    } else {
        None
    };
    h.reth = if op.has_reth() {
        h.reth.or(Some(Reth {
            va: BASE,
            rkey: 1,
            len: payload.len() as u32,
        }))
    } else {
        None
    };
    h.atomic_eth = if op.is_atomic() {
        h.atomic_eth.or(Some(AtomicEth {
            va: BASE,
            rkey: 1,
            swap_add: 1,
            compare: 0,
        }))
    } else {
        None
    };
    h.aeth = if op.has_aeth() {
        h.aeth.or(Some(Aeth::ack(0)))
    } else {
        None
    };
    h.atomic_ack_eth = if op == Op::AtomicAck {
        h.atomic_ack_eth.or(Some(AtomicAckEth { original: 3 }))
    } else {
        None
    };
    h.imm = if op.has_imm() {
        h.imm.or(Some(1))
    } else {
        None
    };
    h.ieth = if op.has_ieth() {
        h.ieth.or(Some(2))
    } else {
        None
    };
    if !op.has_payload() {
        payload.clear();
    }
    let mut out = vec![0u8; 9000];
    let n = emit_datagram(&d.ip, d.udp.src_port, &h, &payload, &mut out).ok()?;
    out.truncate(n);
    Some(out)
}

fn mutate(corpus: &[Vec<u8>], r: &mut SplitMix64) -> Vec<u8> {
    match r.below(5) {
        0 => (0..r.below(300)).map(|_| r.next_u64() as u8).collect(),
        1 | 2 => {
            let p = &corpus[r.below(corpus.len() as u64) as usize];
            rewrite(p, r).unwrap_or_else(|| p.clone())
        }
        _ => {
            let mut p = corpus[r.below(corpus.len() as u64) as usize].clone();
            for _ in 0..1 + r.below(4) {
                match r.below(4) {
                    0 if !p.is_empty() => {
                        let i = r.below(p.len() as u64) as usize;
                        p[i] ^= 1 << r.below(8);
                    }
                    1 if !p.is_empty() => {
                        let i = r.below(p.len() as u64) as usize;
                        p[i] = r.next_u64() as u8;
                    }
                    2 => p.truncate(r.below(p.len() as u64 + 1) as usize),
                    _ => p.extend((0..r.below(16)).map(|_| r.next_u64() as u8)),
                }
            }
            p
        }
    }
}

/// What must not change when a packet outside a QP's window arrives.
#[derive(Debug, PartialEq)]
struct Snapshot {
    memory: Vec<Vec<u8>>,
    expected: Psn,
    unacked: (Psn, Psn),
    posted: usize,
}

fn snapshot(e: &Endpoint<Guard>, qpn: u32) -> Snapshot {
    let q = e.qp(qpn).unwrap();
    Snapshot {
        memory: e
            .mem
            .inner
            .regions
            .iter()
            .map(|r| r.bytes.clone())
            .collect(),
        expected: q.expected_psn(),
        unacked: q.unacked_psns(),
        posted: q.posted_recvs(),
    }
}

#[test]
fn forged_and_mangled_packets_never_panic_stray_or_move_a_window() {
    let cases: u64 = std::env::var("SOFTVERBS_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5000);
    let corpus = corpus();
    assert!(corpus.len() > 30, "{} packets", corpus.len());
    let mut reached = [0u64; 3];
    let mut r = SplitMix64::new(0xf022);
    // Fresh hosts now and then, so that QPs a case moved to the error state do not make the
    // rest of the run trivial.
    let (mut a, mut b) = hosts();
    let mut buf = vec![0u8; 9000];
    for case in 0..cases {
        if case % 200 == 0 {
            (a, b) = hosts();
            // A has requests outstanding, for responses to land on.
            for (i, op) in [
                SendOp::Read { va: BASE, rkey: 1 },
                SendOp::FetchAdd {
                    va: BASE + 64,
                    rkey: 1,
                    add: 1,
                },
                SendOp::Send {
                    imm: None,
                    invalidate: None,
                },
            ]
            .into_iter()
            .enumerate()
            {
                let mut wr = SendWr::new(i as u64, op);
                wr.sges = vec![Sge {
                    addr: BASE + 4096,
                    len: if i == 1 { 8 } else { 600 },
                    lkey: 1,
                }];
                a.with_qp(RC_REQ, |q| q.post_send(Time(0), wr))
                    .unwrap()
                    .unwrap();
            }
            while a.poll_transmit(Time(0), &mut buf).is_some() {}
        }
        let mut packet = mutate(&corpus, &mut r);
        // Half the valid ones are aimed at the live window, where the QPs act.
        if r.below(2) == 0 {
            let live = |e: &Endpoint<Guard>, q: u32, request: bool| {
                e.qp(q).map(|q| {
                    if request {
                        q.expected_psn()
                    } else {
                        q.unacked_psns().0
                    }
                })
            };
            let aimed = Datagram::parse(&packet).ok().and_then(|d| {
                let request = d.headers.bth.opcode.op.is_request();
                let psn = if request {
                    live(&b, RC_RESP, true)
                } else {
                    live(&a, RC_REQ, false)
                }?;
                let mut h = d.headers;
                h.bth.psn = psn.add(r.below(3) as u32);
                h.bth.dest_qp = if request { RC_RESP } else { RC_REQ };
                let mut out = vec![0u8; 9000];
                let n = emit_datagram(&d.ip, d.udp.src_port, &h, d.payload, &mut out).ok()?;
                out.truncate(n);
                Some(out)
            });
            if let Some(p) = aimed {
                packet = p;
            }
        }
        let parsed = Datagram::parse(&packet).ok();
        for (host, is_b) in [(&mut a, false), (&mut b, true)] {
            let target = parsed.as_ref().map(|d| d.headers.bth.dest_qp);
            let watched = match (is_b, target) {
                (true, Some(RC_RESP)) | (false, Some(RC_REQ)) => target,
                _ => None,
            };
            let before = watched.and_then(|q| host.qp(q).map(|_| snapshot(host, q)));
            let events_before = count_events(host);
            host.handle_datagram(Time(case), &packet);
            while host.poll_transmit(Time(case), &mut buf).is_some() {}
            host.handle_timeout(Time(case));
            assert!(
                host.mem.violations.is_empty(),
                "case {case}: {:?}",
                host.mem.violations
            );
            let (Some(q), Some(before), Some(d)) = (watched, before, parsed.as_ref()) else {
                continue;
            };
            let after = snapshot(host, q);
            let psn = d.headers.bth.psn;
            let is_request = d.headers.bth.opcode.op.is_request();
            let from_peer = d.ip.src() == if is_b { A } else { B };
            let outside = if is_b {
                is_request && psn != before.expected
            } else {
                !is_request && (psn.diff(before.unacked.0) < -1 || psn.diff(before.unacked.1) >= 0)
            };
            if outside || !from_peer {
                reached[0] += 1;
                if after != before {
                    let changed: Vec<String> = after
                        .memory
                        .iter()
                        .zip(&before.memory)
                        .enumerate()
                        .filter(|(_, (a, b))| a != b)
                        .map(|(i, (a, b))| {
                            let at = a.iter().zip(b.iter()).position(|(x, y)| x != y);
                            format!("region {i} from byte {at:?}")
                        })
                        .collect();
                    panic!(
                        "case {case}: a packet outside the window changed the QP (memory: {changed:?}; \
                         expected PSN {} -> {}, unacked {:?} -> {:?}, receives {} -> {}): {d:?}",
                        before.expected,
                        after.expected,
                        before.unacked,
                        after.unacked,
                        before.posted,
                        after.posted
                    );
                }
                assert_eq!(
                    count_events(host),
                    events_before,
                    "case {case}: completions from {d:?}"
                );
            } else {
                reached[1 + usize::from(is_b)] += 1;
            }
        }
    }
    eprintln!(
        "{cases} cases: {} outside a window (nothing changed), {} inside the requester's, {} at the responder's expected PSN",
        reached[0], reached[1], reached[2]
    );
    assert!(reached.iter().all(|&n| n > 0), "{reached:?}");
}

/// Events queued so far (the endpoint keeps them until polled; these tests never poll).
fn count_events(e: &Endpoint<Guard>) -> usize {
    e.pending_events()
}
