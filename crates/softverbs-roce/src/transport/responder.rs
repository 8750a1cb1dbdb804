//! The receive side of a QP: the responder. It checks each request packet's PSN against the
//! one it expects, executes new requests (placing data, consuming receive WQEs, reading,
//! executing atomics), answers duplicates without executing them again, and queues its
//! answers (ACKs, NAKs, READ responses, atomic ACKs) in PSN order.

use super::qp::{Shared, Transmit};
use super::{
    Access, AtomicOp, MemError, Memory, NetworkHeader, QpAccess, QpConfig, QpError, QpType, RecvWr,
    WcOpcode, WcStatus,
};
use crate::wire::{
    Aeth, AethKind, AtomicAckEth, Bth, Datagram, GRH_LEN, Headers, IpRepr, NakCode, Op, Opcode, Psn,
};
use std::collections::VecDeque;

/// Answers waiting to be sent, at most: each READ or atomic is answered in turn, so a few per
/// responder resource is already more than a peer that follows the protocol needs.
const MAX_REPLIES: usize = 1024;

/// A multi-packet message the responder is in the middle of.
enum InMessage {
    Send {
        wqe: RecvWr,
        offset: u64,
    },
    Write {
        va: u64,
        rkey: u32,
        len: u64,
        offset: u64,
    },
}

/// What a READ or an atomic left behind, to answer its duplicates.
#[derive(Clone, Copy)]
struct Resource {
    first: Psn,
    npkts: u32,
    kind: ResourceKind,
}

#[derive(Clone, Copy)]
enum ResourceKind {
    /// `pd`: the memory it read (the QP's, or for XRC the SRQ's the request named).
    Read {
        pd: u32,
        va: u64,
        rkey: u32,
        len: u64,
    },
    Atomic {
        original: u64,
    },
}

/// An answer waiting to be sent, in PSN order.
enum Reply {
    /// Acknowledges everything up to `psn` (consecutive ACKs coalesce into the newest).
    Ack {
        psn: Psn,
    },
    Nak {
        psn: Psn,
        code: NakCode,
    },
    Rnr {
        psn: Psn,
    },
    AtomicAck {
        psn: Psn,
        original: u64,
    },
    /// READ response packets `next..first + npkts` of a READ of `len` bytes from `va`.
    Read {
        first: Psn,
        npkts: u32,
        next: Psn,
        pd: u32,
        va: u64,
        rkey: u32,
        len: u64,
        /// Answers a duplicate request: a failure then refuses the duplicate only, and the
        /// QP stays as it is (a replayed old packet must not be able to break it).
        replay: bool,
    },
}

pub(super) struct Responder {
    epsn: Psn,
    /// Messages completed (24 bits), sent in every AETH.
    msn: u32,
    rq: VecDeque<RecvWr>,
    cur: Option<InMessage>,
    /// A NAK (sequence error or RNR) went out for `epsn`: later packets past it are dropped
    /// without another, until `epsn` arrives.
    nak_sent: bool,
    replies: VecDeque<Reply>,
    resources: VecDeque<Resource>,
}

impl Responder {
    pub fn new(cfg: &QpConfig) -> Responder {
        Responder {
            epsn: cfg.rq_psn,
            msn: 0,
            rq: VecDeque::new(),
            cur: None,
            nak_sent: false,
            replies: VecDeque::new(),
            resources: VecDeque::new(),
        }
    }

    pub fn expected_psn(&self) -> Psn {
        self.epsn
    }

    /// Messages completed, as the next AETH carries them.
    pub fn msn(&self) -> u32 {
        self.msn
    }

    /// An ACK is waiting to be sent.
    pub fn ack_queued(&self) -> bool {
        self.replies.iter().any(|r| matches!(r, Reply::Ack { .. }))
    }

    pub fn posted(&self) -> usize {
        self.rq.len()
    }

    pub fn post(&mut self, wr: RecvWr) {
        self.rq.push_back(wr);
    }

    /// Receives posted for SRQ `srq` (XRC; 0: the QP's own).
    pub fn posted_for(&self, srq: u32) -> usize {
        self.rq.iter().filter(|w| w.srq == srq).count()
    }

    /// The oldest receive of SRQ `srq` (0: the QP's own queue).
    fn take_recv(&mut self, srq: u32) -> Option<RecvWr> {
        let i = self.rq.iter().position(|w| w.srq == srq)?;
        self.rq.remove(i)
    }

    /// Every posted receive completes with `WR_FLUSH_ERR`, and nothing but a NAK already
    /// queued is sent (the QP is in the error state).
    pub fn flush(&mut self, s: &mut Shared) {
        if let Some(InMessage::Send { wqe, .. }) = self.cur.take() {
            self.rq.push_front(wqe);
        }
        for wr in self.rq.drain(..) {
            let c = recv_done(s, &wr, WcStatus::WrFlushErr, WcOpcode::Recv);
            s.complete(c);
        }
        // What the responder executed before the error is answered before its NAK, as on the
        // wire of a NIC that processes requests in order (a READ or FLUSH that succeeded
        // completes though a later request failed); nothing after the NAK is.
        match self
            .replies
            .iter()
            .position(|r| matches!(r, Reply::Nak { .. }))
        {
            Some(i) => self.replies.truncate(i + 1),
            None => self.replies.clear(),
        }
    }

    pub fn handle<M: Memory>(&mut self, s: &mut Shared, mem: &mut M, d: &Datagram<'_>) {
        match s.cfg.qp_type {
            QpType::Rc | QpType::Xrc => self.handle_rc(s, mem, d),
            QpType::Uc => self.handle_uc(s, mem, d),
            QpType::Ud => self.handle_ud(s, mem, d),
        }
    }

    fn handle_rc<M: Memory>(&mut self, s: &mut Shared, mem: &mut M, d: &Datagram<'_>) {
        let bth = d.headers.bth;
        let p = bth.psn;
        let ahead = p.diff(self.epsn);
        if ahead > 0 {
            s.counters.out_of_sequence += 1;
            if !self.nak_sent {
                self.nak_sent = true;
                s.counters.seq_naks_sent += 1;
                self.replies.push_back(Reply::Nak {
                    psn: self.epsn,
                    code: NakCode::PsnSequenceError,
                });
            }
            return;
        }
        if ahead < 0 {
            self.duplicate(s, d);
            return;
        }
        match self.execute(s, mem, d) {
            Ok(()) => {}
            Err(Refusal::Rnr) => {
                s.counters.rnr_naks_sent += 1;
                self.nak_sent = true;
                self.replies.push_back(Reply::Rnr { psn: p });
            }
            Err(Refusal::Nak(code, why)) => {
                s.counters.error_naks_sent += 1;
                self.replies.push_back(Reply::Nak { psn: p, code });
                s.fail(why.unwrap_or(QpError::Responder(code)));
            }
        }
    }

    /// A request PSN already executed: answered from what it left, never executed again.
    fn duplicate(&mut self, s: &mut Shared, d: &Datagram<'_>) {
        s.counters.duplicates += 1;
        let h = &d.headers;
        let p = h.bth.psn;
        let op = h.bth.opcode.op;
        if op.is_read_like() || op.is_atomic() {
            // A replayed request already waiting to be answered needs no second answer; and
            // however many duplicates arrive (a peer retrying, or someone replaying packets),
            // the answers waiting stay bounded.
            let queued = self.replies.iter().any(|q| match q {
                Reply::Read {
                    first, next, npkts, ..
                } => p.diff(*next) >= 0 && (p.diff(*first) as u32) < *npkts,
                Reply::AtomicAck { psn, .. } => *psn == p,
                _ => false,
            });
            if queued || self.replies.len() >= MAX_REPLIES {
                s.counters.dropped += 1;
                return;
            }
            let Some(r) = self
                .resources
                .iter()
                .find(|r| p.diff(r.first) >= 0 && (p.diff(r.first) as u32) < r.npkts)
                .copied()
            else {
                // Too old to answer (its resource was reused): the requester times out.
                s.counters.dropped += 1;
                return;
            };
            match (r.kind, op) {
                (ResourceKind::Read { pd, va, rkey, len }, op) if op.is_read_like() => {
                    self.replies.push_back(Reply::Read {
                        first: r.first,
                        npkts: r.npkts,
                        next: p,
                        pd,
                        va,
                        rkey,
                        len,
                        replay: true,
                    });
                }
                (ResourceKind::Atomic { original }, _) if op.is_atomic() && p == r.first => {
                    self.replies
                        .push_back(Reply::AtomicAck { psn: p, original });
                }
                _ => s.counters.dropped += 1,
            }
        } else if h.bth.ack_req || op.ends_message() {
            self.ack(self.epsn.sub(1));
        }
    }

    /// Queues an ACK through `psn`, merging it into an ACK queued last.
    fn ack(&mut self, psn: Psn) {
        match self.replies.back_mut() {
            Some(Reply::Ack { psn: q }) => *q = psn,
            _ => self.replies.push_back(Reply::Ack { psn }),
        }
    }

    /// A READ of `len` bytes at `va` (or an ATOMIC WRITE, `len` 0) taking PSNs
    /// `first..first + npkts` was executed: keep its resource for duplicates, queue its
    /// response and expect the PSN after it.
    #[allow(clippy::too_many_arguments)]
    fn answer_like_read(
        &mut self,
        s: &mut Shared,
        first: Psn,
        npkts: u32,
        pd: u32,
        va: u64,
        rkey: u32,
        len: u64,
    ) {
        self.remember(
            s,
            Resource {
                first,
                npkts,
                kind: ResourceKind::Read { pd, va, rkey, len },
            },
        );
        self.msn = (self.msn + 1) & 0xff_ffff;
        self.replies.push_back(Reply::Read {
            first,
            npkts,
            next: first,
            pd,
            va,
            rkey,
            len,
            replay: false,
        });
        self.epsn = self.epsn.add(npkts);
    }

    /// Executes the request packet at the expected PSN.
    fn execute<M: Memory>(
        &mut self,
        s: &mut Shared,
        mem: &mut M,
        d: &Datagram<'_>,
    ) -> Result<(), Refusal> {
        let h = &d.headers;
        let bth = h.bth;
        let op = bth.opcode.op;
        let pmtu = u64::from(s.cfg.pmtu);
        let n = d.payload.len() as u64;
        let invalid = || Refusal::Nak(NakCode::InvalidRequest, None);
        // The packet must continue the message in progress, or start one.
        let continues = match &self.cur {
            Some(InMessage::Send { .. }) => op.is_send() && !op.starts_message(),
            Some(InMessage::Write { .. }) => op.is_write() && !op.starts_message(),
            None => op.starts_message(),
        };
        if !continues {
            return Err(invalid());
        }
        // Every packet of a message but its last is a full MTU; none is longer.
        if n > pmtu || ((op.is_first() || op.is_middle()) && n != pmtu) || (op.is_last() && n == 0)
        {
            return Err(invalid());
        }
        // XRC: every request names its SRQ, whose memory (and receive) it uses, if that SRQ
        // is in the target's domain; RC: the QP's own.
        let (pd, srq) = match (s.cfg.qp_type, h.xrceth) {
            (QpType::Xrc, Some(srqn)) => match mem.xrc_srq(s.cfg.pd, srqn) {
                Some(pd) => (pd, srqn),
                None => return Err(invalid()),
            },
            (QpType::Xrc, None) => return Err(invalid()),
            _ => (s.cfg.pd, 0),
        };
        self.nak_sent = false;
        if op.is_send() {
            let (wqe, offset) = match self.cur.take() {
                Some(InMessage::Send { wqe, offset }) => (wqe, offset),
                _ => match self.take_recv(srq) {
                    Some(wqe) => (wqe, 0),
                    None => return Err(Refusal::Rnr),
                },
            };
            if let Err(e) = mem.scatter(pd, &wqe.sges, offset, d.payload) {
                let status = match e {
                    MemError::OutOfBounds => WcStatus::LocLenErr,
                    _ => WcStatus::LocProtErr,
                };
                let c = recv_done(s, &wqe, status, WcOpcode::Recv);
                s.complete(c);
                let code = if status == WcStatus::LocLenErr {
                    NakCode::InvalidRequest
                } else {
                    NakCode::RemoteOperationalError
                };
                return Err(Refusal::Nak(code, Some(QpError::Receive(status))));
            }
            let total = offset + n;
            if op.ends_message() {
                let mut c = recv_done(s, &wqe, WcStatus::Success, WcOpcode::Recv);
                c.byte_len = total as u32;
                c.imm = h.imm;
                c.solicited = bth.solicited;
                if let Some(rkey) = h.ieth {
                    if mem.invalidate(pd, rkey).is_err() {
                        let c = recv_done(s, &wqe, WcStatus::RemInvReqErr, WcOpcode::Recv);
                        s.complete(c);
                        return Err(invalid());
                    }
                    c.invalidated = Some(rkey);
                }
                s.complete(c);
                self.msn = (self.msn + 1) & 0xff_ffff;
            } else {
                self.cur = Some(InMessage::Send { wqe, offset: total });
            }
        } else if op.is_write() {
            let (va, rkey, len, offset) = match self.cur.take() {
                Some(InMessage::Write {
                    va,
                    rkey,
                    len,
                    offset,
                }) => (va, rkey, len, offset),
                _ => {
                    if !s.cfg.access.contains(QpAccess::REMOTE_WRITE) {
                        return Err(invalid());
                    }
                    let Some(reth) = h.reth else {
                        return Err(invalid());
                    };
                    let len = u64::from(reth.len);
                    if len > super::MAX_MSG
                        || (op.is_only() && n != len)
                        || (op.is_first() && len <= pmtu)
                    {
                        return Err(invalid());
                    }
                    // A zero-length WRITE touches no memory, so its key is not checked.
                    if len > 0
                        && mem
                            .check(pd, reth.rkey, reth.va, len, Access::Write)
                            .is_err()
                    {
                        return Err(Refusal::Nak(NakCode::RemoteAccessError, None));
                    }
                    (reth.va, reth.rkey, len, 0)
                }
            };
            let total = offset + n;
            if total > len || (op.ends_message() && total != len) {
                return Err(invalid());
            }
            // WRITE with immediate needs its receive before any byte lands, so that the
            // packet an RNR NAK turns back is executed whole when it comes again.
            let wqe = if op.has_imm() {
                match self.take_recv(srq) {
                    Some(w) => Some(w),
                    None => {
                        if !op.starts_message() {
                            self.cur = Some(InMessage::Write {
                                va,
                                rkey,
                                len,
                                offset,
                            });
                        }
                        return Err(Refusal::Rnr);
                    }
                }
            } else {
                None
            };
            if n > 0
                && mem
                    .write(pd, rkey, va.wrapping_add(offset), d.payload)
                    .is_err()
            {
                return Err(Refusal::Nak(NakCode::RemoteAccessError, None));
            }
            if op.ends_message() {
                if let Some(wqe) = wqe {
                    let mut c = recv_done(s, &wqe, WcStatus::Success, WcOpcode::RecvRdmaWithImm);
                    c.byte_len = len as u32;
                    c.imm = h.imm;
                    c.solicited = bth.solicited;
                    s.complete(c);
                }
                self.msn = (self.msn + 1) & 0xff_ffff;
            } else {
                self.cur = Some(InMessage::Write {
                    va,
                    rkey,
                    len,
                    offset: total,
                });
            }
        } else if op == Op::ReadRequest {
            let Some(reth) = h.reth else {
                return Err(invalid());
            };
            if !s.cfg.access.contains(QpAccess::REMOTE_READ) || s.cfg.max_dest_rd_atomic == 0 {
                return Err(invalid());
            }
            let len = u64::from(reth.len);
            if len > super::MAX_MSG {
                return Err(invalid());
            }
            if len > 0
                && mem
                    .check(pd, reth.rkey, reth.va, len, Access::Read)
                    .is_err()
            {
                return Err(Refusal::Nak(NakCode::RemoteAccessError, None));
            }
            let npkts = len.div_ceil(pmtu).max(1) as u32;
            self.answer_like_read(s, bth.psn, npkts, pd, reth.va, reth.rkey, len);
            return Ok(());
        } else if op == Op::Flush {
            let (Some(feth), Some(reth)) = (h.feth, h.reth) else {
                return Err(invalid());
            };
            // Global placement only (persistent needs persistent memory); selectivity 0 is a
            // range, 1 the whole region.
            let whole = match (feth & 0xf, (feth >> 4) & 0x3) {
                (super::requester::FLUSH_GLOBAL, sel @ (0 | 1)) => sel == 1,
                _ => return Err(invalid()),
            };
            if s.cfg.max_dest_rd_atomic == 0 {
                return Err(invalid());
            }
            if mem
                .flush(pd, reth.rkey, reth.va, u64::from(reth.len), whole)
                .is_err()
            {
                return Err(Refusal::Nak(NakCode::RemoteAccessError, None));
            }
            self.answer_like_read(s, bth.psn, 1, pd, reth.va, reth.rkey, 0);
            return Ok(());
        } else if op == Op::AtomicWrite {
            let Some(reth) = h.reth else {
                return Err(invalid());
            };
            if !s.cfg.access.contains(QpAccess::REMOTE_WRITE)
                || s.cfg.max_dest_rd_atomic == 0
                || reth.len != 8
            {
                return Err(invalid());
            }
            let Ok(bytes) = <[u8; 8]>::try_from(d.payload) else {
                return Err(invalid());
            };
            match mem.atomic_write(pd, reth.rkey, reth.va, bytes) {
                Ok(()) => {}
                Err(MemError::Misaligned) => return Err(invalid()),
                Err(_) => return Err(Refusal::Nak(NakCode::RemoteAccessError, None)),
            }
            // Answered and replayed like a READ of no bytes.
            self.answer_like_read(s, bth.psn, 1, pd, reth.va, reth.rkey, 0);
            return Ok(());
        } else if op.is_atomic() {
            let Some(a) = h.atomic_eth else {
                return Err(invalid());
            };
            if !s.cfg.access.contains(QpAccess::REMOTE_ATOMIC) || s.cfg.max_dest_rd_atomic == 0 {
                return Err(invalid());
            }
            let atomic = if op == Op::CompareSwap {
                AtomicOp::CompareSwap {
                    compare: a.compare,
                    swap: a.swap_add,
                }
            } else {
                AtomicOp::FetchAdd { add: a.swap_add }
            };
            let original = match mem.atomic(pd, a.rkey, a.va, atomic) {
                Ok(v) => v,
                Err(MemError::Misaligned) => return Err(invalid()),
                Err(_) => return Err(Refusal::Nak(NakCode::RemoteAccessError, None)),
            };
            self.remember(
                s,
                Resource {
                    first: bth.psn,
                    npkts: 1,
                    kind: ResourceKind::Atomic { original },
                },
            );
            self.msn = (self.msn + 1) & 0xff_ffff;
            // The atomic ACK is the acknowledgement.
            self.replies.push_back(Reply::AtomicAck {
                psn: bth.psn,
                original,
            });
            self.epsn = self.epsn.add(1);
            return Ok(());
        } else {
            return Err(invalid());
        }
        if bth.ack_req {
            self.ack(bth.psn);
        }
        self.epsn = self.epsn.add(1);
        Ok(())
    }

    /// Keeps a READ's or an atomic's resource, the oldest giving way past
    /// `max_dest_rd_atomic`.
    fn remember(&mut self, s: &Shared, r: Resource) {
        while self.resources.len() >= usize::from(s.cfg.max_dest_rd_atomic.max(1)) {
            self.resources.pop_front();
        }
        self.resources.push_back(r);
    }

    /// UC: a packet out of sequence drops the message in progress, and the responder waits
    /// for the next first or only packet; errors drop the message without a word.
    fn handle_uc<M: Memory>(&mut self, s: &mut Shared, mem: &mut M, d: &Datagram<'_>) {
        let bth = d.headers.bth;
        let op = bth.opcode.op;
        if bth.psn != self.epsn {
            s.counters.out_of_sequence += 1;
            self.abandon();
            if !op.starts_message() {
                s.counters.dropped += 1;
                return;
            }
            self.epsn = bth.psn;
        }
        match self.execute(s, mem, d) {
            Ok(()) => {}
            Err(_) => {
                // No NAKs on UC, and the QP lives on: the message is lost.
                s.counters.dropped += 1;
                self.abandon();
                self.epsn = bth.psn.add(1);
            }
        }
        // UC sends no ACKs.
        self.replies.retain(|r| !matches!(r, Reply::Ack { .. }));
    }

    /// Drops the message in progress; a receive it had taken waits for the next message.
    fn abandon(&mut self) {
        if let Some(InMessage::Send { wqe, .. }) = self.cur.take() {
            self.rq.push_front(wqe);
        }
    }

    /// UD: the Q_Key must match; the receive buffer gets the 40-byte GRH, then the payload.
    fn handle_ud<M: Memory>(&mut self, s: &mut Shared, mem: &mut M, d: &Datagram<'_>) {
        let h = &d.headers;
        let Some(deth) = h.deth else {
            s.counters.dropped += 1;
            return;
        };
        if deth.qkey != s.cfg.qkey || d.payload.len() > s.cfg.pmtu as usize {
            s.counters.dropped += 1;
            return;
        }
        let Some(wqe) = self.rq.pop_front() else {
            // No receive posted: a datagram is simply lost.
            s.counters.dropped += 1;
            return;
        };
        let mut grh = [0u8; GRH_LEN];
        let network = match d.ip {
            IpRepr::V4(_) => {
                let n = d.ip_header.len().min(20);
                grh[20..20 + n].copy_from_slice(&d.ip_header[..n]);
                NetworkHeader::Ipv4
            }
            IpRepr::V6(_) => {
                let n = d.ip_header.len().min(GRH_LEN);
                grh[..n].copy_from_slice(&d.ip_header[..n]);
                NetworkHeader::Ipv6
            }
        };
        let pd = s.cfg.pd;
        let placed = mem
            .scatter(pd, &wqe.sges, 0, &grh)
            .and_then(|()| mem.scatter(pd, &wqe.sges, GRH_LEN as u64, d.payload));
        let mut c = recv_done(s, &wqe, WcStatus::Success, WcOpcode::Recv);
        match placed {
            Ok(()) => {
                c.byte_len = (GRH_LEN + d.payload.len()) as u32;
                c.imm = h.imm;
                c.src_qp = deth.src_qp;
                c.grh = Some(network);
                c.solicited = h.bth.solicited;
            }
            Err(MemError::OutOfBounds) => c.status = WcStatus::LocLenErr,
            Err(_) => c.status = WcStatus::LocProtErr,
        }
        s.complete(c);
    }

    /// The next answer to send, its payload (a READ response's) in `buf`.
    pub fn poll_transmit<M: Memory>(
        &mut self,
        s: &mut Shared,
        mem: &M,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        let (peer, dest_qp) = s.cfg.peer?;
        if !s.cfg.qp_type.is_reliable() {
            return None;
        }
        let front = self.replies.front_mut()?;
        let pmtu = u64::from(s.cfg.pmtu);
        let msn = self.msn;
        let transport = s.cfg.qp_type.transport();
        let opcode = |op| Opcode::new(transport, op).expect("every RC operation exists");
        let mut payload_len = 0;
        let h = match front {
            Reply::Ack { psn } => with_aeth(opcode(Op::Ack), dest_qp, *psn, Aeth::ack(msn)),
            Reply::Nak { psn, code } => with_aeth(
                opcode(Op::Ack),
                dest_qp,
                *psn,
                Aeth {
                    kind: AethKind::Nak(*code),
                    msn,
                },
            ),
            Reply::Rnr { psn } => with_aeth(
                opcode(Op::Ack),
                dest_qp,
                *psn,
                Aeth {
                    kind: AethKind::RnrNak {
                        timer: s.cfg.min_rnr_timer & 0x1f,
                    },
                    msn,
                },
            ),
            Reply::AtomicAck { psn, original } => {
                let mut h = with_aeth(opcode(Op::AtomicAck), dest_qp, *psn, Aeth::ack(msn));
                h.atomic_ack_eth = Some(AtomicAckEth {
                    original: *original,
                });
                h
            }
            Reply::Read {
                first,
                npkts,
                next,
                pd,
                va,
                rkey,
                len,
                replay,
            } => {
                let k = next.diff(*first) as u32;
                let op = match (*npkts, k) {
                    (1, _) => Op::ReadResponseOnly,
                    (_, 0) => Op::ReadResponseFirst,
                    (n, k) if k + 1 == n => Op::ReadResponseLast,
                    _ => Op::ReadResponseMiddle,
                };
                let offset = u64::from(k) * pmtu;
                let n = (*len - offset.min(*len)).min(pmtu) as usize;
                let out = buf.get_mut(..n)?;
                if n > 0 && mem.read(*pd, *rkey, va.wrapping_add(offset), out).is_err() {
                    // The region went away since the request was checked.
                    let psn = *next;
                    let replay = *replay;
                    *front = Reply::Nak {
                        psn,
                        code: NakCode::RemoteAccessError,
                    };
                    s.counters.error_naks_sent += 1;
                    if !replay {
                        s.fail(QpError::Responder(NakCode::RemoteAccessError));
                    }
                    return self.poll_transmit(s, mem, buf);
                }
                payload_len = n;
                let mut h = Headers::new(Bth::new(opcode(op), dest_qp, *next));
                if op.has_aeth() {
                    h.aeth = Some(Aeth::ack(msn));
                }
                *next = next.add(1);
                h
            }
        };
        let done = match front {
            Reply::Read {
                first, npkts, next, ..
            } => next.diff(*first) as u32 >= *npkts,
            _ => true,
        };
        if done {
            self.replies.pop_front();
        }
        let mut h = h;
        h.bth.pkey = s.cfg.pkey;
        Some(Transmit {
            dst: peer,
            src_port: s.src_port(),
            headers: h,
            payload_len,
        })
    }
}

/// The completion of receive `wqe`, in the CQ of the SRQ it came from (XRC).
fn recv_done(s: &Shared, wqe: &RecvWr, status: WcStatus, opcode: WcOpcode) -> super::Completion {
    let mut c = s.completion(wqe.wr_id, status, opcode, true);
    c.srq = wqe.srq;
    c
}

pub(super) fn with_aeth(opcode: Opcode, dest_qp: u32, psn: Psn, aeth: Aeth) -> Headers {
    let mut h = Headers::new(Bth::new(opcode, dest_qp, psn));
    h.aeth = Some(aeth);
    h
}

/// Why the responder turned a request back.
enum Refusal {
    /// No receive WQE: RNR NAK, the requester retries.
    Rnr,
    /// A NAK that fails both QPs (with the cause to report, if not the NAK itself).
    Nak(NakCode, Option<QpError>),
}
