//! One queue pair: the requester and the responder side by side, the state they share, and
//! the sans-IO surface the caller drives.

use super::linger::Linger;
use super::requester::Requester;
use super::responder::Responder;
use super::{
    Completion, Event, Memory, PostError, QpAccess, QpConfig, QpCounters, QpError, QpState, QpType,
    RecvWr, SendWr, WcOpcode, WcStatus,
};
use crate::Time;
use crate::wire::{Datagram, Headers, Psn};
use std::collections::VecDeque;
use std::net::IpAddr;

/// A packet for the caller to send: its headers, and `payload_len` bytes of payload written
/// at the start of the buffer `poll_transmit` was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    pub dst: IpAddr,
    /// The UDP source port: this QP's flow entropy, the same for all its packets.
    pub src_port: u16,
    pub headers: Headers,
    pub payload_len: usize,
}

/// What both sides of a QP share: its configuration, state, events and counters.
pub(super) struct Shared {
    pub cfg: QpConfig,
    pub state: QpState,
    pub events: VecDeque<Event>,
    pub counters: QpCounters,
}

impl Shared {
    pub fn complete(&mut self, c: Completion) {
        self.events.push_back(Event::Completion(c));
    }

    /// A completion of this QP with every optional field empty.
    pub fn completion(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        is_recv: bool,
    ) -> Completion {
        Completion {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            imm: None,
            invalidated: None,
            qpn: self.cfg.qpn,
            // RC and UC packets carry no source QP: a connected QP's messages are from its
            // peer (UD's come with a DETH, which the responder copies in).
            src_qp: match (is_recv, self.cfg.peer) {
                (true, Some((_, peer))) => peer,
                _ => 0,
            },
            is_recv,
            grh: None,
            solicited: false,
            srq: 0,
        }
    }

    /// Moves the QP to the error state (once), reporting why.
    pub fn fail(&mut self, why: QpError) {
        if self.state != QpState::Err {
            self.state = QpState::Err;
            self.events.push_back(Event::Error(why));
        }
    }

    /// The UDP source port of this QP's packets (flow entropy from its number, in the
    /// dynamic range, as soft-RoCE does).
    pub fn src_port(&self) -> u16 {
        0xc000 | (self.cfg.qpn ^ (self.cfg.qpn >> 14)) as u16 & 0x3fff
    }

    /// The P_Key check: the partitions match and one side is a full member.
    pub fn pkey_ok(&self, pkey: u16) -> bool {
        pkey & 0x7fff == self.cfg.pkey & 0x7fff && (pkey | self.cfg.pkey) & 0x8000 != 0
    }
}

/// A queue pair's transport.
pub struct Qp {
    shared: Shared,
    req: Requester,
    resp: Responder,
}

impl Qp {
    /// A QP in the ready-to-send state with configuration `cfg`.
    pub fn new(cfg: QpConfig) -> Qp {
        let req = Requester::new(&cfg);
        let resp = Responder::new(&cfg);
        Qp {
            shared: Shared {
                cfg,
                state: QpState::Rts,
                events: VecDeque::new(),
                counters: QpCounters::default(),
            },
            req,
            resp,
        }
    }

    /// The requester's half of `ibv_modify_qp` to RTS, for a QP that was receiving since RTR
    /// (created with placeholder send attributes): its first PSN, timeouts and limits. Only
    /// before anything was posted; later calls change nothing and return false.
    pub fn ready_to_send(
        &mut self,
        sq_psn: Psn,
        timeout: u8,
        retry_cnt: u8,
        rnr_retry: u8,
        max_rd_atomic: u8,
    ) -> bool {
        if !self.req.is_idle() {
            return false;
        }
        let c = &mut self.shared.cfg;
        c.sq_psn = sq_psn;
        c.timeout = timeout;
        c.retry_cnt = retry_cnt;
        c.rnr_retry = rnr_retry;
        c.max_rd_atomic = max_rd_atomic;
        self.req = Requester::new(c);
        true
    }

    /// `ibv_modify_qp` of an established QP (SQD or SQE back to RTS, or RTS to RTS): new
    /// timeout, retry counts and remote rights take effect from the next retry on.
    pub fn update_limits(&mut self, timeout: u8, retry_cnt: u8, rnr_retry: u8, access: QpAccess) {
        let c = &mut self.shared.cfg;
        c.timeout = timeout;
        c.retry_cnt = retry_cnt;
        c.rnr_retry = rnr_retry;
        c.access = access;
        self.req.set_limits(c);
    }

    pub fn config(&self) -> &QpConfig {
        &self.shared.cfg
    }

    pub fn qpn(&self) -> u32 {
        self.shared.cfg.qpn
    }

    pub fn state(&self) -> QpState {
        self.shared.state
    }

    pub fn counters(&self) -> &QpCounters {
        &self.shared.counters
    }

    /// The PSN the responder expects next (`rq_psn` as `ibv_query_qp` reports it).
    pub fn expected_psn(&self) -> Psn {
        self.resp.expected_psn()
    }

    /// What this QP, destroyed at `now`, leaves to answer its peer's retransmissions of what
    /// it had received: `None` unless it is a connected RC or XRC QP not in the error state.
    pub fn linger(&self, now: Time) -> Option<Linger> {
        if self.shared.state == QpState::Err {
            return None;
        }
        Linger::new(
            &self.shared.cfg,
            self.shared.src_port(),
            self.resp.expected_psn(),
            self.resp.msn(),
            self.resp.ack_queued(),
            now,
        )
    }

    /// The oldest PSN the requester has not had acknowledged, and one past the newest it
    /// sent: responses outside this window are not for anything it asked.
    pub fn unacked_psns(&self) -> (Psn, Psn) {
        self.req.unacked()
    }

    /// Receive WQEs posted and not yet used.
    pub fn posted_recvs(&self) -> usize {
        self.resp.posted()
    }

    /// Receives posted that came from XRC SRQ `srq` (0: the QP's own).
    pub fn posted_recvs_for(&self, srq: u32) -> usize {
        self.resp.posted_for(srq)
    }

    /// Posts a send work request; in the error state it is flushed at once.
    pub fn post_send(&mut self, now: Time, wr: SendWr) -> Result<(), PostError> {
        self.req.post(&mut self.shared, now, wr)?;
        self.flush_if_failed();
        Ok(())
    }

    /// Posts a receive work request; in the error state it is flushed at once.
    pub fn post_recv(&mut self, wr: RecvWr) {
        self.resp.post(wr);
        self.flush_if_failed();
    }

    /// Moves the QP to the error state, as `ibv_modify_qp(IBV_QPS_ERR)` does: every
    /// outstanding work request completes with `WR_FLUSH_ERR`.
    pub fn set_error(&mut self) {
        self.shared.fail(QpError::Modified);
        self.flush_if_failed();
    }

    /// A packet for this QP arrived (the endpoint matched its destination QP number).
    pub fn handle_packet<M: Memory>(&mut self, now: Time, mem: &mut M, d: &Datagram<'_>) {
        let s = &mut self.shared;
        s.counters.packets_received += 1;
        if s.state == QpState::Err || !s.pkey_ok(d.headers.bth.pkey) {
            s.counters.dropped += 1;
            return;
        }
        let op = d.headers.bth.opcode;
        if op.transport != s.cfg.qp_type.transport() {
            s.counters.dropped += 1;
            return;
        }
        // A connected QP takes packets from its peer only.
        if let Some((peer, _)) = s.cfg.peer
            && s.cfg.qp_type != QpType::Ud
            && d.ip.src() != peer
        {
            s.counters.dropped += 1;
            return;
        }
        if op.op.is_request() {
            self.resp.handle(&mut self.shared, mem, d);
        } else {
            self.req.handle_response(&mut self.shared, now, mem, d);
        }
        self.flush_if_failed();
    }

    /// The next packet to send, its payload written into `buf` (which must hold a path MTU).
    pub fn poll_transmit<M: Memory>(
        &mut self,
        now: Time,
        mem: &M,
        buf: &mut [u8],
    ) -> Option<Transmit> {
        // Responses first: they let the peer's requests complete.
        let t = self
            .resp
            .poll_transmit(&mut self.shared, mem, buf)
            .or_else(|| self.req.poll_transmit(&mut self.shared, now, mem, buf));
        if t.is_some() {
            self.shared.counters.packets_sent += 1;
        }
        self.flush_if_failed();
        t
    }

    /// A deadline from [`poll_timeout`](Self::poll_timeout) passed.
    pub fn handle_timeout(&mut self, now: Time) {
        self.req.handle_timeout(&mut self.shared, now);
        self.flush_if_failed();
    }

    /// When this QP next needs [`handle_timeout`](Self::handle_timeout).
    pub fn poll_timeout(&self) -> Option<Time> {
        if self.shared.state == QpState::Err {
            return None;
        }
        self.req.poll_timeout()
    }

    /// The next completion or error.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.shared.events.pop_front()
    }

    /// In the error state, every outstanding request on both queues completes with a flush.
    fn flush_if_failed(&mut self) {
        if self.shared.state == QpState::Err {
            self.req.flush(&mut self.shared);
            self.resp.flush(&mut self.shared);
        }
    }
}
