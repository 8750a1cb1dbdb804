//! Queue pairs: creation, the verbs state machine, posting, and the send-queue driver.
//!
//! Same-host sends execute in the caller's thread at post time (see `exec`): nothing waits
//! for the target. Only a request that cannot finish now (the responder has no receive posted,
//! or no responder answers) is queued; the device's progress thread retries it when its RNR
//! or ACK timer expires, and everything posted behind it waits in order.

pub(crate) mod context;
pub(crate) mod exec;
pub mod rq;
pub mod wr;

use crate::cq::{Cq, Cqe};
use crate::device::directory::{Listing, publish};
use crate::device::event::{AsyncEvent, AsyncQueue, EventElement};
use crate::device::progress::Timer;
use crate::device::{Counted, Device, PORT_NUM, Resource};
use crate::device_memory::export::Export;
use crate::device_memory::segment::Segment;
use crate::error::{Error, Result, inval};
use crate::pd::Pd;
use crate::qp::rq::{RecvQueue, RecvWqe, Srq};
use crate::qp::wr::{Payload, SendWqe};
use crate::types::{
    AccessFlags, AhAttr, AsyncEventType, Mtu, QpAttrMask as M, QpState, QpType, SendFlags, Sge,
    WcStatus, ack_timeout, rnr_timer_micros,
};
use context::{DESTROYED, QpCtx};
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// Queue sizes of a QP (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// What `create_qp` needs (`struct ibv_qp_init_attr`).
pub struct QpInit {
    pub qp_type: QpType,
    pub send_cq: Arc<Cq>,
    pub recv_cq: Arc<Cq>,
    pub srq: Option<Arc<Srq>>,
    pub cap: QpCap,
    pub sq_sig_all: bool,
}

/// QP attributes (`struct ibv_qp_attr`); which ones matter is said by a [`M`] mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpAttr {
    pub qp_state: QpState,
    pub cur_qp_state: QpState,
    pub path_mtu: Mtu,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: AccessFlags,
    pub cap: QpCap,
    pub ah_attr: AhAttr,
    pub alt_ah_attr: AhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: bool,
    pub sq_draining: bool,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            qp_state: QpState::Reset,
            cur_qp_state: QpState::Reset,
            path_mtu: Mtu::Mtu1024,
            path_mig_state: 0,
            qkey: 0,
            rq_psn: 0,
            sq_psn: 0,
            dest_qp_num: 0,
            qp_access_flags: AccessFlags::empty(),
            cap: QpCap::default(),
            ah_attr: AhAttr::default(),
            alt_ah_attr: AhAttr::default(),
            pkey_index: 0,
            alt_pkey_index: 0,
            en_sqd_async_notify: false,
            sq_draining: false,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            port_num: PORT_NUM,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            alt_port_num: 0,
            alt_timeout: 0,
            rate_limit: 0,
        }
    }
}

/// A rejected work request: which one (`bad_wr`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("work request {index}: {error}")]
pub struct PostError {
    /// Position of the first request not posted; the ones before it were posted.
    pub index: usize,
    pub error: Error,
}

struct Pending {
    seq: u32,
    wqe: SendWqe<'static>,
}

/// Requester state, guarded by the QP's send lock.
pub(crate) struct SendState {
    pub(crate) attr: QpAttr,
    pending: VecDeque<Pending>,
    posted: u32,
    /// Cached responder of an RC/UC QP.
    pub(crate) peer: Option<crate::qp::exec::CachedPeer>,
    /// The device the address vector points at.
    pub(crate) peer_dev: Weak<Device>,
    retries: u8,
    rnr_retries: u8,
    next_try: Option<Instant>,
    sqd_barrier: u32,
    notify_drained: bool,
    last_wqe_reported: bool,
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

/// A queue pair.
pub struct Qp {
    pub(crate) qpn: u32,
    pub(crate) qp_type: QpType,
    pub(crate) pd: Arc<Pd>,
    pub(crate) dev: Arc<Device>,
    events: Arc<AsyncQueue>,
    pub(crate) send_cq: Arc<Cq>,
    pub(crate) recv_cq: Arc<Cq>,
    pub(crate) srq: Option<Arc<Srq>>,
    pub(crate) rq: Option<RecvQueue>,
    cap: QpCap,
    sq_sig_all: bool,
    // Responder-visible copies of attributes, readable by initiators without the send lock.
    /// State, rights and exports that requesters in any process read: see [`QpCtx`].
    ctx: Arc<Segment>,
    _listing: Option<Listing>,
    send: Mutex<SendState>,
    me: Weak<Qp>,
    _count: Counted,
}

/// Required and optional attributes of a transition (IBA 11.2.4.2 / the kernel's
/// `qp_state_table`); `None` for a transition verbs does not allow.
fn transition(cur: QpState, next: QpState, t: QpType) -> Option<(M, M)> {
    use QpState::*;
    let by_type = |rc: M, uc: M, ud: M| match t {
        QpType::Rc => rc,
        QpType::Uc => uc,
        QpType::Ud => ud,
    };
    let e = M::empty();
    Some(match (cur, next) {
        (_, Reset) | (_, Err) => (e, e),
        (Reset, Init) => (
            M::PKEY_INDEX | M::PORT | by_type(M::ACCESS_FLAGS, M::ACCESS_FLAGS, M::QKEY),
            e,
        ),
        (Init, Init) => (
            e,
            M::PKEY_INDEX | M::PORT | by_type(M::ACCESS_FLAGS, M::ACCESS_FLAGS, M::QKEY),
        ),
        (Init, Rtr) => (
            by_type(
                M::AV
                    | M::PATH_MTU
                    | M::DEST_QPN
                    | M::RQ_PSN
                    | M::MAX_DEST_RD_ATOMIC
                    | M::MIN_RNR_TIMER,
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                e,
            ),
            by_type(
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
                M::PKEY_INDEX | M::QKEY,
            ),
        ),
        (Rtr, Rts) => (
            by_type(
                M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
                M::SQ_PSN,
                M::SQ_PSN,
            ),
            by_type(
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
                M::CUR_STATE | M::QKEY,
            ),
        ),
        (Rts, Rts) | (Sqd, Rts) => (
            e,
            by_type(
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE,
                M::CUR_STATE | M::QKEY,
            ),
        ),
        (Rts, Sqd) => (e, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (
            e,
            by_type(
                M::PORT
                    | M::AV
                    | M::TIMEOUT
                    | M::RETRY_CNT
                    | M::RNR_RETRY
                    | M::MAX_QP_RD_ATOMIC
                    | M::MAX_DEST_RD_ATOMIC
                    | M::ALT_PATH
                    | M::ACCESS_FLAGS
                    | M::PKEY_INDEX
                    | M::MIN_RNR_TIMER
                    | M::PATH_MIG_STATE,
                M::AV | M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX | M::PATH_MIG_STATE,
                M::PKEY_INDEX | M::QKEY,
            ),
        ),
        (Sqe, Rts) if t != QpType::Rc => (
            e,
            by_type(e, M::CUR_STATE | M::ACCESS_FLAGS, M::CUR_STATE | M::QKEY),
        ),
        _ => return None,
    })
}

fn lock(m: &Mutex<SendState>) -> MutexGuard<'_, SendState> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Pd {
    /// Creates a queue pair.
    pub fn create_qp(self: &Arc<Self>, init: QpInit) -> Result<Arc<Qp>> {
        Qp::new(self, init)
    }
}

impl Qp {
    pub(crate) fn new(pd: &Arc<Pd>, init: QpInit) -> Result<Arc<Qp>> {
        let dev = pd.ctx.dev.clone();
        let l = &dev.config.limits;
        let c = init.cap;
        let check = |what: &str, v: u32, max: u32| {
            if v > max {
                Err(inval(format!(
                    "{what} {v} exceeds the device maximum {max}"
                )))
            } else {
                Ok(())
            }
        };
        if !init.send_cq.on(&dev)
            || !init.recv_cq.on(&dev)
            || init.srq.as_ref().is_some_and(|s| !s.on(&dev))
        {
            return Err(inval("CQs and SRQ must belong to the QP's device"));
        }
        check("max_send_wr", c.max_send_wr, l.max_qp_wr)?;
        check("max_send_sge", c.max_send_sge, l.max_sge)?;
        check("max_inline_data", c.max_inline_data, l.max_inline_data)?;
        if init.srq.is_none() {
            check("max_recv_wr", c.max_recv_wr, l.max_qp_wr)?;
            check("max_recv_sge", c.max_recv_sge, l.max_sge)?;
        }
        let count = dev.acquire(Resource::Qp)?;
        // Sizes are rounded up the way hardware rounds them, and the rounded values reported.
        let rq = match init.srq {
            Some(_) => None,
            None => Some(RecvQueue::new(c.max_recv_wr.max(1), c.max_recv_sge.max(1))?),
        };
        let cap = QpCap {
            max_send_wr: c.max_send_wr.max(1).next_power_of_two(),
            max_recv_wr: rq.as_ref().map_or(0, RecvQueue::capacity),
            max_send_sge: c.max_send_sge.max(1),
            max_recv_sge: rq.as_ref().map_or(0, RecvQueue::max_sge),
            max_inline_data: c.max_inline_data,
        };
        let ctx = Arc::new(Segment::create(
            "softverbs-qp",
            std::mem::size_of::<QpCtx>(),
        )?);
        let (qpn, listing) = publish_qpn(&dev, &ctx)?;
        let c: &QpCtx = ctx.at(0);
        let recv_pd = init.srq.as_ref().map_or(pd.id, |s| s.pd);
        c.init(qpn, init.qp_type, pd.id, recv_pd);
        let export = |e: &Export, seg: &Segment| e.set(seg.fd().as_raw_fd(), seg.inode());
        match (&init.srq, &rq) {
            (Some(srq), _) => {
                export(&c.rq, srq.rq.ring().segment());
                c.srq.store(srq.id + 1, Ordering::Release);
            }
            (None, Some(rq)) => export(&c.rq, rq.ring().segment()),
            (None, None) => {}
        }
        init.recv_cq
            .export_into(&ctx, std::mem::offset_of!(QpCtx, cq));
        if let Some(ch) = init.recv_cq.channel() {
            c.chan.set(ch.bell().write_fd_num(), ch.bell().write_ino());
        }
        export(&c.keys, dev.keys.segment());
        export(&c.events, pd.ctx.events.ring().segment());
        let bell = pd.ctx.events.bell();
        c.events_bell.set(bell.write_fd_num(), bell.write_ino());
        let qp = Arc::new_cyclic(|me| Qp {
            qpn,
            qp_type: init.qp_type,
            pd: pd.clone(),
            events: pd.ctx.events.clone(),
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            srq: init.srq,
            rq,
            cap,
            sq_sig_all: init.sq_sig_all,
            ctx,
            _listing: listing,
            send: Mutex::new(SendState {
                attr: QpAttr {
                    cap,
                    path_mtu: dev.config.active_mtu,
                    ..QpAttr::default()
                },
                pending: VecDeque::new(),
                posted: 0,
                peer: None,
                peer_dev: Weak::new(),
                retries: 0,
                rnr_retries: 0,
                next_try: None,
                sqd_barrier: 0,
                notify_drained: false,
                last_wqe_reported: false,
            }),
            me: me.clone(),
            dev: dev.clone(),
            _count: count,
        });
        dev.register_qp(qpn, Arc::downgrade(&qp) as Weak<_>);
        Ok(qp)
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// The transport type.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The queue sizes as created (rounded up).
    pub fn cap(&self) -> QpCap {
        self.cap
    }

    /// Whether every send generates a completion.
    pub fn sq_sig_all(&self) -> bool {
        self.sq_sig_all
    }

    pub(crate) fn ctx(&self) -> &QpCtx {
        self.ctx.at(0)
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        QpState::from_raw(self.ctx().state.load(Ordering::Acquire)).unwrap_or(QpState::Err)
    }

    pub(crate) fn access(&self) -> AccessFlags {
        AccessFlags::from_bits_retain(self.ctx().access.load(Ordering::Acquire))
    }

    pub(crate) fn qkey(&self) -> u32 {
        self.ctx().qkey.load(Ordering::Acquire)
    }

    /// The RNR delay this responder asks requesters to wait.
    pub(crate) fn rnr_delay(&self) -> Duration {
        Duration::from_micros(rnr_timer_micros(
            self.ctx().min_rnr_timer.load(Ordering::Acquire) as u8,
        ))
    }

    /// True while this QP accepts incoming messages.
    pub(crate) fn receiving(&self) -> bool {
        matches!(
            self.state(),
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) && self.dev.port_active()
    }

    /// `ibv_query_qp`: the current attributes.
    pub fn query(&self) -> QpAttr {
        let st = lock(&self.send);
        let mut a = st.attr.clone();
        a.qp_state = self.state();
        a.cur_qp_state = a.qp_state;
        a.sq_draining = a.qp_state == QpState::Sqd
            && st
                .pending
                .front()
                .is_some_and(|p| seq_before(p.seq, st.sqd_barrier));
        a
    }

    /// `ibv_modify_qp`.
    pub fn modify(&self, attr: &QpAttr, mask: M) -> Result<()> {
        let mut st = lock(&self.send);
        let cur = self.state();
        if mask.contains(M::CUR_STATE) && attr.cur_qp_state != cur {
            return Err(inval(format!(
                "cur_qp_state is {:?} but the QP is in {cur:?}",
                attr.cur_qp_state
            )));
        }
        let next = if mask.contains(M::STATE) {
            attr.qp_state
        } else {
            cur
        };
        let (required, optional) = transition(cur, next, self.qp_type).ok_or_else(|| {
            inval(format!(
                "{:?} QP cannot go from {cur:?} to {next:?}",
                self.qp_type
            ))
        })?;
        let given = mask - M::STATE;
        let missing = required - given;
        if !missing.is_empty() {
            return Err(inval(format!(
                "{cur:?}->{next:?} on a {:?} QP requires {missing:?}",
                self.qp_type
            )));
        }
        let extra = given - required - optional - M::CUR_STATE;
        if !extra.is_empty() {
            return Err(inval(format!(
                "{cur:?}->{next:?} on a {:?} QP does not take {extra:?}",
                self.qp_type
            )));
        }
        self.check_values(attr, given)?;
        let mut a = st.attr.clone();
        apply(&mut a, attr, given);
        if self
            .ctx()
            .state
            .compare_exchange(cur as u32, next as u32, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(inval(format!(
                "the QP left {cur:?} during the call (now {:?})",
                self.state()
            )));
        }
        st.attr = a;
        self.ctx()
            .access
            .store(st.attr.qp_access_flags.bits(), Ordering::Release);
        self.ctx().qkey.store(st.attr.qkey, Ordering::Release);
        self.ctx()
            .min_rnr_timer
            .store(u32::from(st.attr.min_rnr_timer), Ordering::Release);
        match next {
            QpState::Reset => self.reset(&mut st),
            QpState::Err => self.flush(&mut st),
            QpState::Rtr if cur == QpState::Init && self.qp_type != QpType::Ud => {
                st.peer_dev = self.dev.resolve(&st.attr.ah_attr);
                st.peer = None;
            }
            QpState::Sqd if cur == QpState::Rts => {
                st.sqd_barrier = st.posted;
                st.notify_drained =
                    mask.contains(M::EN_SQD_ASYNC_NOTIFY) && attr.en_sqd_async_notify;
            }
            _ => {}
        }
        if mask.contains(M::AV) && next != QpState::Rtr && self.qp_type != QpType::Ud {
            st.peer_dev = self.dev.resolve(&st.attr.ah_attr);
            st.peer = None;
        }
        self.drive(&mut st);
        Ok(())
    }

    fn check_values(&self, a: &QpAttr, given: M) -> Result<()> {
        let l = &self.dev.config.limits;
        let bad = |what: String| Err(inval(what));
        if given.contains(M::PORT) && a.port_num != PORT_NUM {
            return bad(format!("port {} (the device has port 1)", a.port_num));
        }
        if given.contains(M::PKEY_INDEX) && a.pkey_index != 0 {
            return bad(format!(
                "pkey_index {} (the table has 1 entry)",
                a.pkey_index
            ));
        }
        if given.contains(M::ACCESS_FLAGS)
            && !(AccessFlags::QP_REMOTE | AccessFlags::LOCAL_WRITE).contains(a.qp_access_flags)
        {
            return bad(format!("qp_access_flags {:?}", a.qp_access_flags));
        }
        if given.contains(M::AV) {
            self.dev.check_av(&a.ah_attr)?;
        }
        if given.contains(M::ALT_PATH) {
            return Err(Error::Unsupported("alternate paths (APM)".into()));
        }
        if given.contains(M::TIMEOUT) && a.timeout > 31 {
            return bad(format!("timeout {} (0..=31)", a.timeout));
        }
        if given.contains(M::RETRY_CNT) && a.retry_cnt > 7 {
            return bad(format!("retry_cnt {} (0..=7)", a.retry_cnt));
        }
        if given.contains(M::RNR_RETRY) && a.rnr_retry > 7 {
            return bad(format!("rnr_retry {} (0..=7)", a.rnr_retry));
        }
        if given.contains(M::MIN_RNR_TIMER) && a.min_rnr_timer > 31 {
            return bad(format!("min_rnr_timer {} (0..=31)", a.min_rnr_timer));
        }
        if given.contains(M::MAX_QP_RD_ATOMIC) && u32::from(a.max_rd_atomic) > l.max_qp_rd_atom {
            return bad(format!(
                "max_rd_atomic {} exceeds max_qp_init_rd_atom {}",
                a.max_rd_atomic, l.max_qp_rd_atom
            ));
        }
        if given.contains(M::MAX_DEST_RD_ATOMIC)
            && u32::from(a.max_dest_rd_atomic) > l.max_qp_rd_atom
        {
            return bad(format!(
                "max_dest_rd_atomic {} exceeds max_qp_rd_atom {}",
                a.max_dest_rd_atomic, l.max_qp_rd_atom
            ));
        }
        for (m, v, name) in [
            (M::DEST_QPN, a.dest_qp_num, "dest_qp_num"),
            (M::RQ_PSN, a.rq_psn, "rq_psn"),
            (M::SQ_PSN, a.sq_psn, "sq_psn"),
        ] {
            if given.contains(m) && v > 0xff_ffff {
                return bad(format!("{name} {v:#x} is wider than 24 bits"));
            }
        }
        if given.contains(M::PATH_MIG_STATE) && a.path_mig_state > 2 {
            return bad(format!("path_mig_state {}", a.path_mig_state));
        }
        Ok(())
    }

    fn reset(&self, st: &mut SendState) {
        st.pending.clear();
        if let Some(rq) = &self.rq {
            while rq.take().is_some() {}
        }
        st.attr = QpAttr {
            cap: self.cap,
            path_mtu: self.dev.config.active_mtu,
            ..QpAttr::default()
        };
        st.posted = 0;
        self.dev.sq_retired[self.dev.qpn_index(self.qpn)].store(0, Ordering::Release);
        st.peer = None;
        st.peer_dev = Weak::new();
        st.retries = 0;
        st.rnr_retries = 0;
        st.next_try = None;
        st.notify_drained = false;
        st.last_wqe_reported = false;
        self.ctx().access.store(0, Ordering::Release);
        self.ctx().qkey.store(0, Ordering::Release);
        self.ctx().min_rnr_timer.store(0, Ordering::Release);
    }

    /// Completes every queued send (and, in ERR, every posted receive) with `WR_FLUSH_ERR`.
    fn flush(&self, st: &mut SendState) {
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

    fn flush_recv(&self, w: &RecvWqe) {
        self.push_recv(Cqe {
            wr_id: w.wr_id,
            status: WcStatus::WrFlushErr as u8,
            opcode: crate::types::WcOpcode::Recv as u8,
            qp_num: self.qpn,
            ..Cqe::default()
        });
    }

    pub(crate) fn event(&self, kind: AsyncEventType) {
        self.events.push(AsyncEvent {
            kind,
            element: EventElement::Qp(self.qpn),
        });
    }

    /// Moves this QP to ERR from outside its own send path: the responder side of a remote
    /// access or invalid-request error, or a completion lost to CQ overrun. Safe to call
    /// with or without the send lock; the flush runs on the progress thread.
    pub(crate) fn responder_error(&self, kind: Option<AsyncEventType>) {
        let moved = self
            .ctx()
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s != QpState::Err as u32 && s != QpState::Reset as u32)
                    .then_some(QpState::Err as u32)
            })
            .is_ok();
        if moved {
            if let Some(k) = kind {
                self.event(k);
            }
            self.dev.progress.schedule(Instant::now(), self.me.clone());
        }
    }

    /// Takes a receive WQE for an arriving message, from the SRQ or the QP's own queue.
    pub(crate) fn take_recv(&self) -> Option<RecvWqe> {
        match &self.srq {
            Some(srq) => srq.take(),
            None => self.rq.as_ref()?.take(),
        }
    }

    /// The PD that receive SGEs are checked against.
    pub(crate) fn recv_pd(&self) -> u32 {
        self.srq.as_ref().map_or(self.pd.id, |s| s.pd)
    }

    /// `ibv_post_recv` for one WR.
    pub fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        let rq = self
            .rq
            .as_ref()
            .ok_or_else(|| inval("the QP uses an SRQ; post receives to the SRQ"))?;
        if sges.len() > self.cap.max_recv_sge as usize {
            return Err(inval(format!(
                "{} SGEs but max_recv_sge is {}",
                sges.len(),
                self.cap.max_recv_sge
            )));
        }
        match self.state() {
            QpState::Reset => Err(inval("cannot post receives in RESET")),
            QpState::Err => {
                self.flush_recv(&RecvWqe {
                    wr_id,
                    sges: Vec::new(),
                });
                Ok(())
            }
            _ => rq.post(wr_id, sges),
        }
    }

    fn check_wqe(&self, w: &SendWqe<'_>) -> Result<()> {
        use crate::qp::wr::SendOp::*;
        let ok_op = match self.qp_type {
            QpType::Rc => true,
            QpType::Uc => matches!(
                w.op,
                Send | SendWithImm { .. }
                    | RdmaWrite { .. }
                    | RdmaWriteWithImm { .. }
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
        if matches!(w.op, BindLayout { .. }) && !w.payload.is_empty() {
            return Err(inval("a layout bind takes no data"));
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
        let mut st = lock(&self.send);
        for (index, w) in wqes.into_iter().enumerate() {
            let fail = |error| PostError { index, error };
            self.check_wqe(&w).map_err(fail)?;
            let state = self.state();
            if matches!(state, QpState::Reset | QpState::Init | QpState::Rtr) {
                return Err(fail(inval(format!("cannot post sends in {state:?}"))));
            }
            let retired = self.dev.sq_retired[self.dev.qpn_index(self.qpn)].load(Ordering::Acquire);
            if st.posted.wrapping_sub(retired) >= self.cap.max_send_wr {
                return Err(fail(Error::NoResources(format!(
                    "send queue full ({} outstanding; completions free slots when polled)",
                    self.cap.max_send_wr
                ))));
            }
            let seq = st.posted;
            st.posted = seq.wrapping_add(1);
            match state {
                QpState::Err | QpState::Sqe => {
                    self.complete_send(seq, &w, WcStatus::WrFlushErr, 0);
                }
                QpState::Rts if st.pending.is_empty() => {
                    if self.step(&mut st, seq, &w) {
                        st.pending.push_back(Pending {
                            seq,
                            wqe: w.into_owned(),
                        });
                    }
                }
                _ => st.pending.push_back(Pending {
                    seq,
                    wqe: w.into_owned(),
                }),
            }
        }
        Ok(())
    }

    /// Runs queued requests for as long as they can finish now.
    fn drive(&self, st: &mut SendState) {
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
        let next = if self.qp_type == QpType::Rc {
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

    /// Queues a receive completion; a completion lost to CQ overrun is fatal to the QP, as
    /// on hardware.
    pub(crate) fn push_recv(&self, cqe: Cqe) {
        if !self.recv_cq.push(cqe) {
            self.responder_error(Some(AsyncEventType::QpFatal));
        }
    }
}

impl Timer for Qp {
    /// A timer of this QP expired: an RNR or ACK wait ended, or a responder error wants the
    /// QP flushed.
    fn on_timer(&self) {
        let mut st = lock(&self.send);
        if self.state() == QpState::Err {
            self.flush(&mut st);
        }
        self.drive(&mut st);
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // Peers that mapped the context stop at once; the listing goes with `self`.
        self.ctx().state.store(DESTROYED, Ordering::Release);
        self.dev.unregister_qp(self.qpn);
        // Our connection may have been the last user of a peer's mappings.
        if let Ok(mut st) = self.send.lock() {
            st.peer = None;
        }
        crate::transport::same_host::peers().prune(self.dev.config.gid);
    }
}

/// Picks a QP number no QP of this device on the host has, and publishes it.
fn publish_qpn(dev: &Arc<Device>, ctx: &Segment) -> Result<(u32, Option<Listing>)> {
    let mut taken = Vec::new();
    let result = loop {
        let qpn = match dev.alloc_qpn() {
            Ok(q) => q,
            Err(e) => break Err(e),
        };
        match publish(dev.config.gid, qpn, ctx) {
            Ok(Some(listing)) => break Ok((qpn, Some(listing))),
            Ok(None) => taken.push(qpn),
            // Without abstract sockets (unusual sandboxes) the QP still works in-process.
            Err(_) => break Ok((qpn, None)),
        }
        if taken.len() > 64 {
            break Err(Error::NoResources("no free QP number on this host".into()));
        }
    };
    for qpn in taken {
        dev.unregister_qp(qpn);
    }
    result
}

fn seq_before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

fn apply(a: &mut QpAttr, n: &QpAttr, m: M) {
    if m.contains(M::ACCESS_FLAGS) {
        a.qp_access_flags = n.qp_access_flags;
    }
    if m.contains(M::PKEY_INDEX) {
        a.pkey_index = n.pkey_index;
    }
    if m.contains(M::PORT) {
        a.port_num = n.port_num;
    }
    if m.contains(M::QKEY) {
        a.qkey = n.qkey;
    }
    if m.contains(M::AV) {
        a.ah_attr = n.ah_attr;
    }
    if m.contains(M::PATH_MTU) {
        a.path_mtu = n.path_mtu;
    }
    if m.contains(M::TIMEOUT) {
        a.timeout = n.timeout;
    }
    if m.contains(M::RETRY_CNT) {
        a.retry_cnt = n.retry_cnt;
    }
    if m.contains(M::RNR_RETRY) {
        a.rnr_retry = n.rnr_retry;
    }
    if m.contains(M::RQ_PSN) {
        a.rq_psn = n.rq_psn;
    }
    if m.contains(M::MAX_QP_RD_ATOMIC) {
        a.max_rd_atomic = n.max_rd_atomic;
    }
    if m.contains(M::MIN_RNR_TIMER) {
        a.min_rnr_timer = n.min_rnr_timer;
    }
    if m.contains(M::SQ_PSN) {
        a.sq_psn = n.sq_psn;
    }
    if m.contains(M::MAX_DEST_RD_ATOMIC) {
        a.max_dest_rd_atomic = n.max_dest_rd_atomic;
    }
    if m.contains(M::PATH_MIG_STATE) {
        a.path_mig_state = n.path_mig_state;
    }
    if m.contains(M::DEST_QPN) {
        a.dest_qp_num = n.dest_qp_num;
    }
    if m.contains(M::EN_SQD_ASYNC_NOTIFY) {
        a.en_sqd_async_notify = n.en_sqd_async_notify;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_table_spot_checks() {
        use QpState::*;
        assert!(transition(Reset, Rtr, QpType::Rc).is_none());
        assert!(transition(Init, Rts, QpType::Ud).is_none());
        assert!(transition(Sqe, Rts, QpType::Rc).is_none());
        assert!(transition(Sqe, Rts, QpType::Ud).is_some());
        let (req, _) = transition(Init, Rtr, QpType::Rc).unwrap();
        assert!(req.contains(M::DEST_QPN | M::AV | M::MIN_RNR_TIMER));
        let (req, _) = transition(Init, Rtr, QpType::Ud).unwrap();
        assert!(req.is_empty());
        for s in [Reset, Init, Rtr, Rts, Sqd, Sqe, Err] {
            assert!(transition(s, Err, QpType::Uc).is_some());
            assert!(transition(s, Reset, QpType::Uc).is_some());
        }
    }
}
