//! The send side of a QP: the requester (segmentation, PSNs, retransmission) and the
//! completer (ACKs, NAKs, READ responses and atomic ACKs complete the send queue in order).
//!
//! Every WQE, when the requester first reaches it, takes a range of PSNs: one per packet of
//! a SEND or WRITE, one per response packet of a READ (whose request is one packet), one for
//! an atomic. `una` is the oldest PSN not yet acknowledged, `cursor` the next PSN to send and
//! `frontier` one past the highest sent; going back (a timeout, a NAK, a response that shows
//! earlier ones were lost) moves `cursor` back to `una` and the packets are sent again, as
//! go-back-N does.

use super::qp::{Shared, Transmit};
use super::{
    MAX_MSG, Memory, PostError, QpConfig, QpError, QpState, QpType, SendOp, SendWr, WcOpcode,
    WcStatus, timers,
};
use crate::Time;
use crate::wire::{
    AethKind, AtomicEth, Bth, Datagram, Deth, Headers, NakCode, Op, Opcode, Psn, Reth,
};
use std::collections::VecDeque;
use std::time::Duration;

/// Besides the last packet of each message, every this many packets asks for an ACK, so a
/// long message is acknowledged as it goes.
const ACK_REQ_EVERY: u32 = 16;

/// FETH placement type: global (IBTA 1.5; persistent, 2, needs persistent memory).
pub(crate) const FLUSH_GLOBAL: u32 = 1;

struct Wqe {
    wr: SendWr,
    len: u64,
    /// Its first PSN, once the requester reached it.
    first: Option<Psn>,
    /// PSNs it takes.
    npkts: u32,
    /// Packets acknowledged so far (SEND, WRITE), or READ response packets placed.
    got: u32,
}

impl Wqe {
    fn is_read_or_atomic(&self) -> bool {
        matches!(
            self.wr.op,
            SendOp::Read { .. }
                | SendOp::CompareSwap { .. }
                | SendOp::FetchAdd { .. }
                | SendOp::AtomicWrite { .. }
                | SendOp::Flush { .. }
        )
    }

    /// Whether PSN `p` is one of this WQE's.
    fn holds(&self, p: Psn) -> bool {
        self.first
            .is_some_and(|f| p.diff(f) >= 0 && (p.diff(f) as u32) < self.npkts)
    }

    fn wc_opcode(&self) -> WcOpcode {
        match self.wr.op {
            SendOp::Send { .. } => WcOpcode::Send,
            SendOp::Write { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::AtomicWrite { .. } => WcOpcode::AtomicWrite,
            SendOp::Flush { .. } => WcOpcode::Flush,
        }
    }
}

pub(super) struct Requester {
    wqes: VecDeque<Wqe>,
    /// The PSN after the last one given to a WQE.
    assigned: Psn,
    cursor: Psn,
    frontier: Psn,
    una: Psn,
    retry_left: u8,
    rnr_left: u8,
    /// The retransmit deadline, while packets are unacknowledged.
    deadline: Option<Time>,
    /// Sending paused until then by an RNR NAK.
    rnr_until: Option<Time>,
    /// Already went back to this PSN (for a NAK or a lost response); until progress, the
    /// same cause does not send everything again.
    went_back_to: Option<Psn>,
    timeout: Option<Duration>,
    /// Where in `wqes` the WQE holding `cursor` was last found: the next packet is nearly
    /// always of the same WQE or the next one (a deep queue is not searched per packet).
    at: usize,
}

impl Requester {
    pub fn new(cfg: &QpConfig) -> Requester {
        Requester {
            wqes: VecDeque::new(),
            assigned: cfg.sq_psn,
            cursor: cfg.sq_psn,
            frontier: cfg.sq_psn,
            una: cfg.sq_psn,
            retry_left: cfg.retry_cnt,
            rnr_left: cfg.rnr_retry,
            deadline: None,
            rnr_until: None,
            went_back_to: None,
            at: 0,
            timeout: timers::transport_timeout(cfg.timeout),
        }
    }

    /// New timeout and retry counts (the QP was modified while established).
    pub fn set_limits(&mut self, cfg: &QpConfig) {
        self.timeout = timers::transport_timeout(cfg.timeout);
        self.retry_left = cfg.retry_cnt;
        self.rnr_left = cfg.rnr_retry;
    }

    /// Nothing was ever posted.
    pub fn is_idle(&self) -> bool {
        self.wqes.is_empty() && self.assigned == self.una
    }

    pub fn post(&mut self, s: &mut Shared, _now: Time, wr: SendWr) -> Result<(), PostError> {
        let cfg = &s.cfg;
        let len = wr.len();
        let ok = match (cfg.qp_type, &wr.op) {
            (QpType::Rc | QpType::Xrc, _) => true,
            (QpType::Uc, SendOp::Send { invalidate, .. }) => invalidate.is_none(),
            (QpType::Uc, SendOp::Write { .. }) => true,
            (
                QpType::Ud,
                SendOp::Send {
                    invalidate: None, ..
                },
            ) => true,
            _ => false,
        };
        if !ok {
            return Err(PostError::Unsupported(match wr.op {
                SendOp::Send { .. } => "SEND with invalidate",
                SendOp::Write { .. } => "RDMA WRITE",
                SendOp::Read { .. } => "RDMA READ",
                SendOp::CompareSwap { .. } => "compare-and-swap",
                SendOp::FetchAdd { .. } => "fetch-and-add",
                SendOp::AtomicWrite { .. } => "ATOMIC WRITE",
                SendOp::Flush { .. } => "FLUSH",
            }));
        }
        let max = if cfg.qp_type == QpType::Ud {
            if wr.ud.is_none() {
                return Err(PostError::NoDestination);
            }
            u64::from(cfg.pmtu)
        } else {
            MAX_MSG
        };
        if len > max {
            return Err(PostError::TooLong { len, max });
        }
        let atomic = matches!(wr.op, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. });
        if atomic && (wr.inline.is_some() || wr.sges.len() != 1 || len != 8) {
            return Err(PostError::AtomicSge);
        }
        if let SendOp::AtomicWrite { va, .. } = wr.op
            && (wr.inline.is_some() || !wr.sges.is_empty() || va % 8 != 0)
        {
            return Err(PostError::AtomicSge);
        }
        if matches!(wr.op, SendOp::Flush { .. }) && (wr.inline.is_some() || !wr.sges.is_empty()) {
            return Err(PostError::Unsupported("FLUSH with data"));
        }
        if wr.inline.is_some() && !matches!(wr.op, SendOp::Send { .. } | SendOp::Write { .. }) {
            return Err(PostError::Unsupported("inline data on a READ"));
        }
        let npkts = if atomic {
            1
        } else {
            len.div_ceil(u64::from(cfg.pmtu)).max(1) as u32
        };
        let wqe = Wqe {
            wr,
            len,
            first: None,
            npkts,
            got: 0,
        };
        if s.state == QpState::Err {
            let c = s.completion(wqe.wr.wr_id, WcStatus::WrFlushErr, wqe.wc_opcode(), false);
            s.complete(c);
            return Ok(());
        }
        self.wqes.push_back(wqe);
        Ok(())
    }

    /// Every WQE left completes with `WR_FLUSH_ERR` (the QP is in the error state).
    pub fn flush(&mut self, s: &mut Shared) {
        for w in self.wqes.drain(..) {
            let c = s.completion(w.wr.wr_id, WcStatus::WrFlushErr, w.wc_opcode(), false);
            s.complete(c);
        }
        self.deadline = None;
        self.rnr_until = None;
    }

    pub fn unacked(&self) -> (Psn, Psn) {
        (self.una, self.frontier)
    }

    pub fn poll_timeout(&self) -> Option<Time> {
        match (self.deadline, self.rnr_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn handle_timeout(&mut self, s: &mut Shared, now: Time) {
        if s.state == QpState::Err {
            return;
        }
        if self.rnr_until.is_some_and(|t| t <= now) {
            self.rnr_until = None;
        }
        if self.deadline.is_none_or(|t| t > now) {
            return;
        }
        self.deadline = None;
        if self.una == self.frontier {
            return;
        }
        s.counters.timeouts += 1;
        if !self.use_retry() {
            self.fail_front(s, WcStatus::RetryExcErr);
            return;
        }
        self.cursor = self.una;
        self.went_back_to = None;
    }

    /// Takes one retry of the budget; false when it is spent.
    fn use_retry(&mut self) -> bool {
        if self.retry_left == 0 {
            return false;
        }
        self.retry_left -= 1;
        true
    }

    /// The oldest WQE fails with `status`, and the QP with it.
    fn fail_front(&mut self, s: &mut Shared, status: WcStatus) {
        if let Some(w) = self.wqes.pop_front() {
            let c = s.completion(w.wr.wr_id, status, w.wc_opcode(), false);
            s.complete(c);
        }
        s.fail(QpError::Requester(status));
    }

    /// Completes the oldest WQE successfully.
    fn complete_front(&mut self, s: &mut Shared, now: Time) {
        let Some(w) = self.wqes.pop_front() else {
            return;
        };
        if w.wr.signaled {
            let mut c = s.completion(w.wr.wr_id, WcStatus::Success, w.wc_opcode(), false);
            c.byte_len = w.len as u32;
            s.complete(c);
        }
        self.progress(s, now);
    }

    /// Something was acknowledged: the retry budgets are whole again and the timer restarts.
    fn progress(&mut self, s: &Shared, now: Time) {
        self.una = match self.wqes.front() {
            Some(w) => match w.first {
                Some(f) => f.add(w.got),
                None => self.assigned,
            },
            None => self.assigned,
        };
        if self.cursor.diff(self.una) < 0 {
            self.cursor = self.una;
        }
        self.retry_left = s.cfg.retry_cnt;
        self.rnr_left = s.cfg.rnr_retry;
        self.went_back_to = None;
        self.deadline = match self.timeout {
            Some(t) if self.una != self.frontier && s.cfg.qp_type.is_reliable() => {
                Some(now.after(t))
            }
            _ => None,
        };
    }

    /// Sends again from `psn` (a response showed that what follows it was lost), once per
    /// cause until progress; a retry of the budget is spent.
    fn go_back(&mut self, s: &mut Shared, psn: Psn) {
        if self.went_back_to == Some(psn) {
            return;
        }
        if !self.use_retry() {
            self.fail_front(s, WcStatus::RetryExcErr);
            return;
        }
        self.went_back_to = Some(psn);
        self.cursor = psn;
    }

    /// Completes the SENDs and WRITEs acknowledged up to and including `p`. A READ or an
    /// atomic in the way means its response was lost (the responder answers in order): sends
    /// again from there.
    fn ack_through(&mut self, s: &mut Shared, now: Time, p: Psn) {
        while let Some(w) = self.wqes.front() {
            let Some(first) = w.first else { break };
            if p.diff(first) < 0 {
                break;
            }
            if w.is_read_or_atomic() {
                let expected = first.add(w.got);
                self.go_back(s, expected);
                break;
            }
            let last = first.add(w.npkts - 1);
            if p.diff(last) < 0 {
                // Part of a long message is acknowledged: the window moves on without it.
                let acked = (p.diff(first) + 1) as u32;
                if acked > w.got {
                    if let Some(w) = self.wqes.front_mut() {
                        w.got = acked;
                    }
                    self.progress(s, now);
                }
                break;
            }
            self.complete_front(s, now);
        }
    }

    pub fn handle_response<M: Memory>(
        &mut self,
        s: &mut Shared,
        now: Time,
        mem: &mut M,
        d: &Datagram<'_>,
    ) {
        let h = &d.headers;
        let p = h.bth.psn;
        // Only responses to what was sent count: anything else is a stale duplicate or forged.
        if !s.cfg.qp_type.is_reliable() || p.diff(self.una) < -1 || p.diff(self.frontier) >= 0 {
            s.counters.dropped += 1;
            return;
        }
        let Some(aeth) = h.aeth else {
            // A READ response middle packet: no AETH.
            if h.bth.opcode.op == Op::ReadResponseMiddle {
                self.read_response(s, now, mem, d);
            } else {
                s.counters.dropped += 1;
            }
            return;
        };
        match h.bth.opcode.op {
            Op::Ack => match aeth.kind {
                AethKind::Ack { .. } => self.ack_through(s, now, p),
                AethKind::RnrNak { timer } => {
                    s.counters.rnr_naks_received += 1;
                    self.ack_through(s, now, p.sub(1));
                    if p != self.una {
                        return;
                    }
                    if s.cfg.rnr_retry < 7 {
                        if self.rnr_left == 0 {
                            self.fail_front(s, WcStatus::RnrRetryExcErr);
                            return;
                        }
                        self.rnr_left -= 1;
                    }
                    self.rnr_until = Some(now.after(timers::rnr_timer(timer)));
                    self.cursor = p;
                    self.deadline = None;
                }
                AethKind::Nak(NakCode::PsnSequenceError) => {
                    s.counters.seq_naks_received += 1;
                    self.ack_through(s, now, p.sub(1));
                    if p == self.una {
                        self.go_back(s, p);
                    }
                }
                AethKind::Nak(code) => {
                    s.counters.error_naks_received += 1;
                    self.ack_through(s, now, p.sub(1));
                    if self.wqes.front().is_some_and(|w| w.holds(p)) {
                        self.fail_front(
                            s,
                            match code {
                                NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                                NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                                _ => WcStatus::RemInvReqErr,
                            },
                        );
                    }
                }
            },
            Op::AtomicAck => {
                let Some(ack) = h.atomic_ack_eth else {
                    return;
                };
                self.ack_through_implicit(s, now, p);
                let Some(w) = self.wqes.front() else { return };
                if !w.holds(p)
                    || !matches!(
                        w.wr.op,
                        SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
                    )
                {
                    s.counters.dropped += 1;
                    return;
                }
                // The original value lands in the local buffer in host order.
                let bytes = ack.original.to_le_bytes();
                if mem.scatter(s.cfg.pd, &w.wr.sges, 0, &bytes).is_err() {
                    self.fail_front(s, WcStatus::LocProtErr);
                    return;
                }
                self.complete_front(s, now);
            }
            op if op.is_read_response() => self.read_response(s, now, mem, d),
            _ => s.counters.dropped += 1,
        }
    }

    /// A response for PSN `p` also acknowledges everything before the WQE holding `p`.
    fn ack_through_implicit(&mut self, s: &mut Shared, now: Time, p: Psn) {
        let before = self
            .wqes
            .iter()
            .find(|w| w.holds(p))
            .and_then(|w| w.first)
            .map(|f| f.sub(1));
        if let Some(before) = before {
            self.ack_through(s, now, before);
        }
    }

    fn read_response<M: Memory>(
        &mut self,
        s: &mut Shared,
        now: Time,
        mem: &mut M,
        d: &Datagram<'_>,
    ) {
        let p = d.headers.bth.psn;
        self.ack_through_implicit(s, now, p);
        let pmtu = u64::from(s.cfg.pmtu);
        let Some(w) = self.wqes.front() else { return };
        // An ATOMIC WRITE or a FLUSH is answered by a zero-length READ response (its `len`
        // is 0).
        let (SendOp::Read { .. } | SendOp::AtomicWrite { .. } | SendOp::Flush { .. }, true) =
            (w.wr.op, w.holds(p))
        else {
            s.counters.dropped += 1;
            return;
        };
        let Some(first) = w.first else { return };
        let expected = first.add(w.got);
        if p != expected {
            if p.after(expected) {
                self.go_back(s, expected);
            } else {
                s.counters.duplicates += 1;
            }
            return;
        }
        let k = w.got;
        let op = d.headers.bth.opcode.op;
        let want = match (w.npkts, k) {
            (1, _) => Op::ReadResponseOnly,
            (_, 0) => Op::ReadResponseFirst,
            (n, k) if k + 1 == n => Op::ReadResponseLast,
            _ => Op::ReadResponseMiddle,
        };
        let offset = u64::from(k) * pmtu;
        let want_len = (w.len - offset).min(pmtu);
        if op != want || d.payload.len() as u64 != want_len {
            self.fail_front(s, WcStatus::BadRespErr);
            return;
        }
        if mem
            .scatter(s.cfg.pd, &w.wr.sges, offset, d.payload)
            .is_err()
        {
            self.fail_front(s, WcStatus::LocProtErr);
            return;
        }
        let done = {
            let w = self.wqes.front_mut().expect("checked above");
            w.got += 1;
            w.got == w.npkts
        };
        if done {
            self.complete_front(s, now);
        } else {
            self.progress(s, now);
        }
    }

    pub fn poll_transmit<M: Memory>(
        &mut self,
        s: &mut Shared,
        now: Time,
        mem: &M,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        if s.state == QpState::Err || self.rnr_until.is_some_and(|t| now < t) {
            return None;
        }
        if s.cfg.qp_type.is_reliable() && self.cursor.diff(self.una) >= s.cfg.window as i32 {
            return None;
        }
        if self.cursor == self.assigned && !self.assign_next(s) {
            return None;
        }
        let cursor = self.cursor;
        let near = [self.at, self.at + 1, self.at.wrapping_sub(1)];
        let i = near
            .into_iter()
            .find(|&i| self.wqes.get(i).is_some_and(|w| w.holds(cursor)))
            .or_else(|| self.wqes.iter().position(|w| w.holds(cursor)))?;
        self.at = i;
        let psn = self.cursor;
        let pmtu = s.cfg.pmtu;
        let w = &self.wqes[i];
        let first = w.first?;
        let k = psn.diff(first) as u32;
        let offset = u64::from(k) * u64::from(pmtu);
        let transport = s.cfg.qp_type.transport();
        let (dst, dest_qp) = match (s.cfg.qp_type, w.wr.ud, s.cfg.peer) {
            (QpType::Ud, Some(ud), _) => (ud.addr, ud.qpn),
            (_, _, Some(peer)) => peer,
            _ => return None,
        };
        let last_pkt = k + 1 == w.npkts;
        let op = match w.wr.op {
            SendOp::Send { imm, invalidate } => segment(
                w.npkts,
                k,
                [Op::SendFirst, Op::SendMiddle, Op::SendLast, Op::SendOnly],
                imm.map(|_| [Op::SendLastImm, Op::SendOnlyImm])
                    .or(invalidate.map(|_| [Op::SendLastInv, Op::SendOnlyInv])),
            ),
            SendOp::Write { imm, .. } => segment(
                w.npkts,
                k,
                [
                    Op::WriteFirst,
                    Op::WriteMiddle,
                    Op::WriteLast,
                    Op::WriteOnly,
                ],
                imm.map(|_| [Op::WriteLastImm, Op::WriteOnlyImm]),
            ),
            SendOp::Read { .. } => Op::ReadRequest,
            SendOp::CompareSwap { .. } => Op::CompareSwap,
            SendOp::FetchAdd { .. } => Op::FetchAdd,
            SendOp::AtomicWrite { .. } => Op::AtomicWrite,
            SendOp::Flush { .. } => Op::Flush,
        };
        let opcode = Opcode::new(transport, op)?;
        let mut bth = Bth::new(opcode, dest_qp, psn);
        bth.pkey = s.cfg.pkey;
        let mut h = Headers::new(bth);
        let mut payload_len = 0usize;
        match w.wr.op {
            SendOp::Send { imm, invalidate } => {
                if op.ends_message() {
                    h.imm = imm.filter(|_| op.has_imm());
                    h.ieth = invalidate.filter(|_| op.has_ieth());
                    h.bth.solicited = w.wr.solicited;
                }
            }
            SendOp::Write { va, rkey, imm } => {
                if op.has_reth() {
                    h.reth = Some(Reth {
                        va,
                        rkey,
                        len: w.len as u32,
                    });
                }
                h.imm = imm.filter(|_| op.has_imm());
                if op.has_imm() {
                    h.bth.solicited = w.wr.solicited;
                }
            }
            SendOp::Read { va, rkey } => {
                // From the middle of a READ (responses after `k` lost): ask for the rest.
                h.reth = Some(Reth {
                    va: va.wrapping_add(offset),
                    rkey,
                    len: (w.len - offset.min(w.len)) as u32,
                });
            }
            SendOp::CompareSwap {
                va,
                rkey,
                compare,
                swap,
            } => {
                h.atomic_eth = Some(AtomicEth {
                    va,
                    rkey,
                    swap_add: swap,
                    compare,
                });
            }
            SendOp::FetchAdd { va, rkey, add } => {
                h.atomic_eth = Some(AtomicEth {
                    va,
                    rkey,
                    swap_add: add,
                    compare: 0,
                });
            }
            SendOp::AtomicWrite { va, rkey, .. } => {
                h.reth = Some(Reth { va, rkey, len: 8 });
            }
            SendOp::Flush {
                va,
                rkey,
                len,
                whole_region,
            } => {
                // Global placement; selectivity 1 is the whole region.
                h.feth = Some(FLUSH_GLOBAL | u32::from(whole_region) << 4);
                h.reth = Some(Reth { va, rkey, len });
            }
        }
        if let SendOp::AtomicWrite { value, .. } = w.wr.op {
            buf.get_mut(..8)?.copy_from_slice(&value.to_ne_bytes());
            payload_len = 8;
        } else if op.has_payload() {
            let n = (w.len - offset).min(u64::from(pmtu)) as usize;
            let out = buf.get_mut(..n)?;
            let gathered = match &w.wr.inline {
                Some(data) => {
                    out.copy_from_slice(&data[offset as usize..offset as usize + n]);
                    Ok(())
                }
                None => mem.gather(s.cfg.pd, &w.wr.sges, offset, out),
            };
            if gathered.is_err() {
                // Only the oldest WQE can fail in order; a later one fails when it is.
                self.fail_at(s, i, WcStatus::LocProtErr);
                return None;
            }
            payload_len = n;
        }
        if s.cfg.qp_type == QpType::Xrc {
            h.xrceth = Some(w.wr.xrc_srqn);
        }
        if s.cfg.qp_type == QpType::Ud {
            let ud = w.wr.ud?;
            h.deth = Some(Deth {
                qkey: if ud.qkey & 0x8000_0000 != 0 {
                    s.cfg.qkey
                } else {
                    ud.qkey
                },
                src_qp: s.cfg.qpn,
            });
        }
        // A READ request takes its whole range of PSNs.
        let next = if op == Op::ReadRequest {
            first.add(w.npkts)
        } else {
            psn.add(1)
        };
        // An ACK is asked for at the end of each message, every few packets, and when this
        // packet fills the window (nothing more goes out until one comes).
        h.bth.ack_req = s.cfg.qp_type.is_reliable()
            && (op.ends_message()
                || psn.value() % ACK_REQ_EVERY == ACK_REQ_EVERY - 1
                || next.diff(self.una) >= s.cfg.window as i32);
        if psn.diff(self.frontier) < 0 {
            s.counters.retransmitted += 1;
        }
        self.cursor = next;
        if next.diff(self.frontier) > 0 {
            self.frontier = next;
        }
        match s.cfg.qp_type {
            QpType::Rc | QpType::Xrc => {
                if self.deadline.is_none()
                    && let Some(t) = self.timeout
                {
                    self.deadline = Some(now.after(t));
                }
            }
            // Unreliable: sent is done.
            QpType::Uc | QpType::Ud => {
                if last_pkt || op == Op::SendOnly || op == Op::SendOnlyImm {
                    self.una = next;
                    self.complete_front(s, now);
                }
            }
        }
        Some(Transmit {
            dst,
            src_port: s.src_port(),
            headers: h,
            payload_len,
        })
    }

    /// Gives the next waiting WQE its PSNs, if the window, the READ/atomic limit and a fence
    /// allow; false when nothing can start now.
    fn assign_next(&mut self, s: &Shared) -> bool {
        let Some(i) = self.wqes.iter().position(|w| w.first.is_none()) else {
            return false;
        };
        if s.cfg.qp_type.is_reliable() {
            if self.assigned.diff(self.una) >= s.cfg.window as i32 {
                return false;
            }
            let busy = self
                .wqes
                .iter()
                .take(i)
                .filter(|w| w.is_read_or_atomic())
                .count();
            let w = &self.wqes[i];
            if (w.is_read_or_atomic() && busy >= usize::from(s.cfg.max_rd_atomic.max(1)))
                || (w.wr.fence && busy > 0)
            {
                return false;
            }
        }
        let w = &mut self.wqes[i];
        w.first = Some(self.assigned);
        self.assigned = self.assigned.add(w.npkts);
        true
    }

    /// WQE `i` failed locally: those before it are flushed, it completes with `status`, and
    /// the QP fails (flushing the rest).
    fn fail_at(&mut self, s: &mut Shared, i: usize, status: WcStatus) {
        for w in self.wqes.drain(..i) {
            let c = s.completion(w.wr.wr_id, WcStatus::WrFlushErr, w.wc_opcode(), false);
            s.complete(c);
        }
        self.fail_front(s, status);
    }
}

/// The opcode of packet `k` of `n` of a message: first, middle, last or only, the last and
/// only ones replaced by `ending` (with immediate or invalidate) when given.
fn segment(n: u32, k: u32, plain: [Op; 4], ending: Option<[Op; 2]>) -> Op {
    let [first, middle, last, only] = plain;
    let (last, only) = ending.map_or((last, only), |[l, o]| (l, o));
    match (n, k) {
        (1, _) => only,
        (_, 0) => first,
        (n, k) if k + 1 == n => last,
        _ => middle,
    }
}
