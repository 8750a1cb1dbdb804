//! The send-queue driver: posting, executing in order, retrying after RNR and ACK waits, and
//! completing.
//!
//! A request executes in the poster's thread at post time (the requester's semantics in
//! [`super::requester`], the transport behind [`Deliver`]): nothing waits for the target. Only
//! a request that cannot finish now (the responder has no receive posted, or no responder
//! answers) is queued; the device's progress thread retries it when its RNR or ACK timer
//! expires, and everything posted behind it waits in order.

use super::Qp;
use super::attr::QpAttr;
use super::request::{Deliver, Offload};
use crate::cq::Cqe;
use crate::device::Device;
use crate::error::{Error, Result, inval};
use crate::qp::wr::{Payload, SendWqe};
use crate::sync::biased_lock::BiasedGuard;
use crate::types::{AsyncEventType, QpState, QpType, SendFlags, WcStatus, ack_timeout};
use std::collections::VecDeque;
use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A rejected work request: which one (`bad_wr`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("work request {index}: {error}")]
pub struct PostError {
    /// Position of the first request not posted; the ones before it were posted.
    pub index: usize,
    pub error: Error,
}

pub(super) struct Pending {
    pub(super) seq: u32,
    wqe: SendWqe<'static>,
}

/// Requester state, guarded by the QP's send lock. What a request reads and writes comes
/// first (see [`Qp`]'s layout).
#[repr(C)]
pub(crate) struct SendState {
    /// What the transport remembers of an RC/UC QP's responder (see [`Deliver`]).
    pub(super) peer: Option<<Qp as Deliver>::Peer>,
    pub(super) pending: VecDeque<Pending>,
    pub(super) next_try: Option<Instant>,
    /// The device on this host the address vector points at.
    pub(super) peer_dev: Weak<Device>,
    pub(super) posted: u32,
    pub(super) sqd_barrier: u32,
    pub(super) retries: u8,
    pub(super) rnr_retries: u8,
    pub(super) notify_drained: bool,
    pub(super) last_wqe_reported: bool,
    pub(super) attr: QpAttr,
}

/// How one attempt at a work request ended.
pub(crate) enum Outcome {
    /// Finished (successfully or not) with this status and byte count.
    Done(WcStatus, u32),
    /// The responder had no receive posted: retry after its RNR timer.
    Rnr(Duration),
    /// Nothing answered: retry after the ACK timeout.
    NoAck,
}

pub(super) fn seq_before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

impl Qp {
    fn check_wqe(&self, w: &SendWqe<'_>) -> Result<()> {
        use crate::qp::wr::SendOp::*;
        let ok_op = match self.qp_type {
            QpType::Rc | QpType::XrcSend => true,
            // A target has no send queue.
            QpType::XrcRecv => false,
            QpType::Uc => matches!(
                w.op,
                Send | SendWithImm { .. }
                    | RdmaWrite { .. }
                    | RdmaWriteWithImm { .. }
                    | BindMw { .. }
                    | LocalInv { .. }
                    | BindLayout { .. }
            ),
            QpType::Ud => matches!(w.op, Send | SendWithImm { .. } | BindLayout { .. }),
        };
        if !ok_op {
            return Err(inval(format!(
                "{:?} is not valid on a {:?} QP",
                w.op.opcode(),
                self.qp_type
            )));
        }
        match &w.payload {
            Payload::Sges(s) if s.len() > self.cap.max_send_sge as usize => {
                return Err(inval(format!(
                    "{} SGEs but max_send_sge is {}",
                    s.len(),
                    self.cap.max_send_sge
                )));
            }
            Payload::Inline(b) => {
                if w.op.writes_local() {
                    return Err(inval("inline data with RDMA READ or an atomic"));
                }
                if b.len() > self.cap.max_inline_data as usize {
                    return Err(inval(format!(
                        "{} inline bytes but max_inline_data is {}",
                        b.len(),
                        self.cap.max_inline_data
                    )));
                }
            }
            _ => {}
        }
        if matches!(w.op, BindLayout { .. }) && self.offload.is_some() {
            return Err(Error::Unsupported(
                "layout binds in the send queue on networked devices (bind with \
                 ibv_mr_set_layout without WITH_POST_WR)"
                    .into(),
            ));
        }
        if w.op.is_local() && !w.payload.is_empty() {
            return Err(inval("a bind or local invalidation takes no data"));
        }
        if let Flush { persistent, .. } = w.op {
            if self.qp_type != QpType::Rc {
                return Err(inval("RDMA FLUSH is valid on RC QPs only"));
            }
            if persistent {
                return Err(Error::Unsupported(
                    "persistent placement (a software NIC has no persistent memory)".into(),
                ));
            }
            if !w.payload.is_empty() {
                return Err(inval("RDMA FLUSH takes no SGEs"));
            }
        }
        if let AtomicWrite { remote_addr, .. } = w.op {
            if self.qp_type != QpType::Rc {
                return Err(inval("ATOMIC WRITE is valid on RC QPs only"));
            }
            if !w.payload.is_empty() {
                return Err(inval("ATOMIC WRITE carries its value, not SGEs"));
            }
            if remote_addr % 8 != 0 {
                return Err(inval("ATOMIC WRITE remote address is not 8-byte aligned"));
            }
        }
        if let CmpSwap { remote_addr, .. } | FetchAdd { remote_addr, .. } = w.op {
            if w.payload.len() != 8 {
                return Err(inval("atomics take exactly 8 bytes of local buffer"));
            }
            if remote_addr % 8 != 0 {
                return Err(inval("atomic remote address is not 8-byte aligned"));
            }
        }
        if self.qp_type == QpType::Ud {
            let ud =
                w.ud.as_ref()
                    .ok_or_else(|| inval("UD sends need an address handle"))?;
            if ud.ah.pd != self.pd.id {
                return Err(inval("address handle is from another protection domain"));
            }
        }
        Ok(())
    }

    /// `ibv_post_send`: validates and executes (or queues) each request in order.
    pub fn post_send<'a>(
        &self,
        wqes: impl IntoIterator<Item = SendWqe<'a>>,
    ) -> Result<(), PostError> {
        let mut st = self.lock_send();
        for (index, w) in wqes.into_iter().enumerate() {
            self.post_locked(&mut st, &w)
                .map_err(|error| PostError { index, error })?;
        }
        Ok(())
    }

    /// `ibv_post_send` of one request, read where the caller built it: the C ABI's common
    /// single request, which is never moved (a request is over a hundred bytes, and moving it
    /// through an iterator cost a 64-byte WRITE about 8% of its instructions).
    pub fn post_one(&self, w: &SendWqe<'_>) -> Result<()> {
        let mut st = self.lock_send();
        self.post_locked(&mut st, w)
    }

    /// The send lock, for posting: the connected peer's lines are fetched meanwhile.
    fn lock_send(&self) -> BiasedGuard<'_, SendState> {
        // The QP's own state word, read right after: over many QPs it is a miss, which then
        // overlaps the lock instead of following it.
        crate::device_memory::prefetch::read(&self.ctx().state);
        let st = self.send.lock();
        if let Some(peer) = &st.peer {
            self.warm(peer);
        }
        st
    }

    fn post_locked(&self, st: &mut SendState, w: &SendWqe<'_>) -> Result<()> {
        self.check_wqe(w)?;
        let state = self.state();
        if matches!(state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(inval(format!("cannot post sends in {state:?}")));
        }
        let retired = self.dev.sq_retired[self.dev.qpn_index(self.qpn)].load(Ordering::Acquire);
        if st.posted.wrapping_sub(retired) >= self.cap.max_send_wr {
            return Err(Error::NoResources(format!(
                "send queue full ({} outstanding; completions free slots when polled)",
                self.cap.max_send_wr
            )));
        }
        let seq = st.posted;
        st.posted = seq.wrapping_add(1);
        match state {
            QpState::Err | QpState::Sqe => {
                self.complete_send(seq, w, WcStatus::WrFlushErr, 0);
            }
            QpState::Rts if st.pending.is_empty() => {
                if self.step(st, seq, w) {
                    st.pending.push_back(Pending {
                        seq,
                        wqe: w.to_owned_wqe(),
                    });
                }
            }
            _ => st.pending.push_back(Pending {
                seq,
                wqe: w.to_owned_wqe(),
            }),
        }
        Ok(())
    }

    /// Runs queued requests for as long as they can finish now.
    pub(super) fn drive(&self, st: &mut SendState) {
        while let Some(p) = st.pending.pop_front() {
            let state = self.state();
            if matches!(state, QpState::Err | QpState::Sqe) {
                self.complete_send(p.seq, &p.wqe, WcStatus::WrFlushErr, 0);
                continue;
            }
            let runnable = state == QpState::Rts
                || (state == QpState::Sqd && seq_before(p.seq, st.sqd_barrier));
            let waiting = st.next_try.is_some_and(|t| Instant::now() < t);
            if !runnable || waiting || self.step(st, p.seq, &p.wqe) {
                st.pending.push_front(p);
                break;
            }
        }
        if self.state() == QpState::Sqd
            && st.notify_drained
            && !st
                .pending
                .front()
                .is_some_and(|p| seq_before(p.seq, st.sqd_barrier))
        {
            st.notify_drained = false;
            self.event(AsyncEventType::SqDrained);
        }
    }

    /// One attempt at `w`; true if it stalled and must be retried later.
    fn step(&self, st: &mut SendState, seq: u32, w: &SendWqe<'_>) -> bool {
        if let Some(o) = &self.offload {
            // The executor completes it; it cannot refuse what was checked here except by
            // being gone, which fails the QP anyway.
            if o.post(seq, w, &st.attr).is_err() {
                self.complete_send(seq, w, WcStatus::WrFlushErr, 0);
            }
            return false;
        }
        let outcome = self.execute(st, w);
        let (status, len) = match outcome {
            Outcome::Done(status, len) => (status, len),
            Outcome::Rnr(delay) => {
                let rnr_retry = st.attr.rnr_retry;
                // rnr_retry 7 means "retry forever".
                if rnr_retry == 7 || st.rnr_retries < rnr_retry {
                    st.rnr_retries = st.rnr_retries.saturating_add(1);
                    self.retry_at(st, Instant::now() + delay);
                    return true;
                }
                (WcStatus::RnrRetryExcErr, 0)
            }
            Outcome::NoAck => {
                match ack_timeout(st.attr.timeout) {
                    Some(t) if st.retries < st.attr.retry_cnt => {
                        st.retries += 1;
                        self.retry_at(st, Instant::now() + t);
                        return true;
                    }
                    // Timeout 0 means "wait for an ACK forever": keep looking, never fail.
                    None => {
                        self.retry_at(st, Instant::now() + Duration::from_millis(10));
                        return true;
                    }
                    Some(_) => (WcStatus::RetryExcErr, 0),
                }
            }
        };
        st.retries = 0;
        st.rnr_retries = 0;
        st.next_try = None;
        self.complete_send(seq, w, status, len);
        if status != WcStatus::Success {
            self.send_error(st);
        }
        false
    }

    fn retry_at(&self, st: &mut SendState, at: Instant) {
        st.next_try = Some(at);
        self.dev.progress.schedule(at, self.me.clone());
    }

    /// A send failed: RC goes to ERR; UC and UD go to SQE (receives keep working).
    fn send_error(&self, st: &mut SendState) {
        let next = if self.qp_type.is_reliable() {
            QpState::Err
        } else {
            QpState::Sqe
        };
        let _ = self
            .ctx()
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s != QpState::Err as u32).then_some(next as u32)
            });
        self.flush(st);
    }

    fn complete_send(&self, seq: u32, w: &SendWqe<'_>, status: WcStatus, byte_len: u32) {
        let signaled = self.sq_sig_all || w.flags.contains(SendFlags::SIGNALED);
        if status == WcStatus::Success && !signaled {
            return;
        }
        let kept = self.send_cq.push(Cqe {
            wr_id: w.wr_id,
            status: status as u8,
            opcode: w.op.wc_opcode() as u8,
            byte_len,
            qp_num: self.qpn,
            wqe_seq: seq,
            ..Cqe::default()
        });
        if !kept {
            self.responder_error(Some(AsyncEventType::QpFatal));
        }
    }

    /// Completes every queued send (and, in ERR, every posted receive) with `WR_FLUSH_ERR`.
    pub(super) fn flush(&self, st: &mut SendState) {
        while let Some(p) = st.pending.pop_front() {
            self.complete_send(p.seq, &p.wqe, WcStatus::WrFlushErr, 0);
        }
        st.next_try = None;
        if self.state() != QpState::Err {
            return;
        }
        if let Some(rq) = &self.rq {
            while let Some(w) = rq.take() {
                self.flush_recv(&w);
            }
        } else if !st.last_wqe_reported {
            st.last_wqe_reported = true;
            self.event(AsyncEventType::QpLastWqeReached);
        }
    }
}
