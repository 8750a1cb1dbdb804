//! Queue pairs: creation, the verbs state machine, posting and executing work requests.
//!
//! Everything here is transport-independent. What a work request means, which checks apply
//! and which status each failure gives is `requester` and `responder`; how a request reaches
//! its responder is a transport's job (`crate::transport`, which sits above this module and
//! provides `request::Deliver` for [`Qp`]).

mod attr;
pub(crate) mod context;
mod multicast;
pub(crate) mod request;
pub(crate) mod requester;
pub(crate) mod responder;
pub mod rq;
mod send;
mod state;
pub mod wr;
pub mod xrc;

pub use attr::{QpAttr, QpCap, QpInit};
pub use send::PostError;
pub(crate) use send::{Outcome, SendState};

use crate::cq::{Cq, Cqe};
use crate::device::directory::Listing;
use crate::device::event::{AsyncEvent, AsyncQueue, EventElement};
use crate::device::progress::Timer;
use crate::device::{Counted, Device, PORT_NUM, Resource};
use crate::device_memory::export::Export;
use crate::device_memory::segment::{Head, Segment};
use crate::error::{Error, Result, inval};
use crate::pd::Pd;
use crate::qp::rq::{RecvQueue, RecvWqe, Srq};
use crate::sync::biased_lock::BiasedLock;
use crate::types::{
    AccessFlags, AsyncEventType, QpAttrMask as M, QpState, QpType, Sge, WcStatus, rnr_timer_micros,
};
use context::{DESTROYED, QpCtx};
use request::{Deliver, Offload};
use send::seq_before;
use state::{apply, transition};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// A queue pair.
///
/// What posting a send reads comes first, the send state right behind it: a process that
/// round-robins over tens of thousands of QPs finds few of them in cache, and each further
/// line was a miss per request (`perf`'s round robin over 65,536 QPs). Not aligned to a
/// line: that saved 0.85 misses a request there but cost 400 bytes a QP in the allocator.
/// The fields drop in this order (after [`Drop`]), the PD before the device, the context
/// before its listing.
#[repr(C)]
pub struct Qp {
    pub(crate) qpn: u32,
    pub(crate) qp_type: QpType,
    sq_sig_all: bool,
    cap: QpCap,
    pub(crate) pd: Arc<Pd>,
    pub(crate) dev: Arc<Device>,
    // Responder-visible copies of attributes, readable by initiators without the send lock.
    /// State, rights and exports that requesters in any process read: see [`QpCtx`].
    ctx: Head<QpCtx>,
    /// Its PD's view of an exporter, if the PD is imported: kept here, next to `dev`, so
    /// that finding the key table costs the data path one test of a field it already reads.
    import: Option<Arc<crate::device::shared::Import>>,
    /// Set when a transport executes this QP's requests (a networked device's engine);
    /// boxed, so that telling whether it is set reads a line the request reads anyway.
    pub(crate) offload: Option<Box<<Qp as Deliver>::Offloaded>>,
    send: BiasedLock<SendState>,
    pub(crate) send_cq: Arc<Cq>,
    events: Arc<AsyncQueue>,
    pub(crate) recv_cq: Arc<Cq>,
    pub(crate) srq: Option<Arc<Srq>>,
    pub(crate) rq: Option<RecvQueue>,
    _listing: Listing,
    me: Weak<Qp>,
    /// Its PD, CQs and SRQ are in use until it is destroyed (see [`Qp::release_uses`]).
    uses: Mutex<Vec<crate::device::InUse>>,
    /// The multicast groups it is attached to (UD).
    mcast: Mutex<Vec<crate::device::multicast::Membership>>,
    _count: Counted,
}

impl Pd {
    /// Creates a queue pair.
    pub fn create_qp(self: &Arc<Self>, init: QpInit) -> Result<Arc<Qp>> {
        Qp::new(self, init)
    }
}

impl Qp {
    pub(crate) fn new(pd: &Arc<Pd>, init: QpInit) -> Result<Arc<Qp>> {
        match init.qp_type {
            QpType::XrcRecv => {
                return Err(inval(
                    "an XRC target QP is created in an XRC domain (Xrcd::create_qp)",
                ));
            }
            QpType::XrcSend if init.srq.is_some() || init.cap.max_recv_wr > 0 => {
                return Err(inval("an XRC initiator QP has no receive queue"));
            }
            _ => {}
        }
        Qp::create(pd, init, None)
    }

    /// Creates a QP; `xrc`: an XRC target or SRQ receive point of that domain.
    pub(crate) fn create(
        pd: &Arc<Pd>,
        init: QpInit,
        xrc: Option<(context::XrcRole, [u32; 4])>,
    ) -> Result<Arc<Qp>> {
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
        if init
            .srq
            .as_ref()
            .is_some_and(|s| s.table != pd.keys() as *const _ as usize)
        {
            return Err(inval(
                "an SRQ of an imported PD serves QPs of imported PDs of the same exporter only",
            ));
        }
        check("max_send_wr", c.max_send_wr, l.max_qp_wr)?;
        check("max_send_sge", c.max_send_sge, l.max_sge)?;
        check("max_inline_data", c.max_inline_data, l.max_inline_data)?;
        if init.srq.is_none() {
            check("max_recv_wr", c.max_recv_wr, l.max_qp_wr)?;
            check("max_recv_sge", c.max_recv_sge, l.max_sge)?;
        }
        let count = dev.acquire(Resource::Qp)?;
        let uses = [&pd.users, &init.send_cq.users, &init.recv_cq.users]
            .into_iter()
            .chain(init.srq.as_ref().map(|s| &s.users))
            .map(crate::device::Users::add)
            .collect();
        // Sizes are rounded up the way hardware rounds them, and the rounded values reported.
        let rq = match init.srq {
            Some(_) => None,
            None => Some(RecvQueue::new(c.max_recv_wr.max(1), c.max_recv_sge.max(1))?),
        };
        // XRC QPs receive into SRQs alone (a target keeps a one-slot queue nobody posts to, as
        // every published context names one), and a target sends nothing.
        let own_rq = rq
            .as_ref()
            .filter(|_| !matches!(init.qp_type, QpType::XrcSend | QpType::XrcRecv));
        let cap = if init.qp_type == QpType::XrcRecv {
            QpCap::default()
        } else {
            QpCap {
                max_send_wr: c.max_send_wr.max(1).next_power_of_two(),
                max_recv_wr: own_rq.map_or(0, RecvQueue::capacity),
                max_send_sge: c.max_send_sge.max(1),
                max_recv_sge: own_rq.map_or(0, RecvQueue::max_sge),
                max_inline_data: c.max_inline_data,
            }
        };
        let ctx = Arc::new(Segment::create(
            "softverbs-qp",
            std::mem::size_of::<QpCtx>(),
        )?);
        let (qpn, listing) = dev.alloc_qpn(&ctx)?;
        // Until the QP exists, a failure gives its number back (its block may go with it).
        let number = NumberGuard {
            dev: &dev,
            qpn: Some(qpn),
        };
        let c: &QpCtx = ctx.at(0);
        let recv_pd = init.srq.as_ref().map_or(pd.id, |s| s.pd);
        c.init(qpn, init.qp_type, pd.id, recv_pd);
        if let Some((role, id)) = xrc {
            c.set_xrc(role, id);
        }
        let export = |e: &Export, seg: &Segment| e.set_segment(seg);
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
        export(&c.keys, pd.keys().segment());
        let offload = <Qp as Deliver>::offload(&dev, qpn, &ctx, &cap)?;
        if offload.is_some() {
            init.send_cq
                .export_into(&ctx, std::mem::offset_of!(QpCtx, send_cq));
            if let Some(ch) = init.send_cq.channel() {
                c.send_chan
                    .set(ch.bell().write_fd_num(), ch.bell().write_ino());
            }
        }
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
            ctx: Head::new(ctx),
            _listing: listing,
            send: BiasedLock::new(SendState {
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
            offload: offload.map(Box::new),
            me: me.clone(),
            dev: dev.clone(),
            uses: Mutex::new(uses),
            mcast: Mutex::new(Vec::new()),
            import: pd.import.clone(),
            _count: count,
        });
        number.keep();
        dev.register_qp(qpn, Arc::downgrade(&qp) as Weak<_>);
        if let Some(o) = &qp.offload {
            o.bind(Arc::downgrade(&qp));
        }
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

    /// The program destroyed the QP (`ibv_destroy_qp`): its PD, CQs and SRQ stop counting it
    /// as a user now, although the device's progress thread may still hold it for a moment.
    pub fn release_uses(&self) {
        self.uses.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// The key table its keys are in: the device's, or its imported PD's exporter's.
    #[inline]
    pub(crate) fn keys(&self) -> &crate::mr::keys::KeyTable {
        match &self.import {
            None => &self.dev.keys,
            Some(i) => &i.keys,
        }
    }

    /// Where `len` bytes at `host` of a region pinned in [`Qp::keys`] are for this process.
    #[inline(always)]
    pub(crate) fn place_local(
        &self,
        pin: &crate::mr::keys::Pin<'_>,
        host: usize,
        len: usize,
    ) -> Option<crate::mr::access::Span> {
        match &self.import {
            None => Some(pin.owner_span(host, len)),
            Some(i) => i.memory.locate(pin, host, len).ok(),
        }
    }

    /// Counts `u` as held by the QP until it is destroyed.
    pub(crate) fn hold(&self, u: crate::device::InUse) {
        self.uses.lock().unwrap_or_else(|e| e.into_inner()).push(u);
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
        self.ctx.get()
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
        let st = self.send.lock_aside();
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
        let mut st = self.send.lock_aside();
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
        if let Some(o) = &self.offload {
            o.moved(self, cur, next, &a)?;
        }
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
        if self.ctx().move_to_err() {
            if let Some(k) = kind {
                self.event(k);
            }
            self.dev.progress.schedule(Instant::now(), self.me.clone());
        }
    }

    /// The transport that executes this QP's requests is gone (its host engine died): the QP
    /// goes to ERR, and everything it had handed over or posted completes with a flush.
    pub(crate) fn offload_lost(&self) {
        let mut st = self.send.lock_aside();
        if !self.ctx().move_to_err() {
            return;
        }
        if let Some(o) = &self.offload {
            for (seq, wr_id, opcode) in o.unfinished(self.ctx().sq_done.load(Ordering::Acquire)) {
                // The QP is in ERR already: a flush lost to overrun changes nothing more.
                let _ = self.send_cq.push(Cqe {
                    wr_id,
                    status: WcStatus::WrFlushErr as u8,
                    opcode: opcode as u8,
                    qp_num: self.qpn,
                    wqe_seq: seq,
                    ..Cqe::default()
                });
            }
        }
        self.flush(&mut st);
        self.event(AsyncEventType::QpFatal);
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
        if matches!(self.qp_type, QpType::XrcSend | QpType::XrcRecv) {
            return Err(inval("an XRC QP has no receive queue; post to an XRC SRQ"));
        }
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
                    sges: crate::mr::resolve::Few::new(),
                });
                Ok(())
            }
            _ => rq.post(wr_id, sges),
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
        let mut st = self.send.lock_aside();
        if self.state() == QpState::Err {
            self.flush(&mut st);
        }
        self.drive(&mut st);
    }
}

/// A QP number allocated for a QP still being created: freed if creation fails.
struct NumberGuard<'d> {
    dev: &'d Device,
    qpn: Option<u32>,
}

impl NumberGuard<'_> {
    /// The QP exists: it frees the number when it goes.
    fn keep(mut self) {
        self.qpn = None;
    }
}

impl Drop for NumberGuard<'_> {
    fn drop(&mut self) {
        if let Some(qpn) = self.qpn {
            self.dev.unregister_qp(qpn);
        }
    }
}

impl crate::device::QpHandle for Qp {
    /// The send lock taken once: a requester's own regions' pins, taken under it, count
    /// themselves nowhere (`KeyTable::pin_key`). No deregistration happens under a send
    /// lock (work requests name keys, they hold no regions), so this never waits on the
    /// calling thread itself.
    fn quiesce_sends(&self, pd: u32) {
        if self.pd.id == pd && self.import.is_none() {
            drop(self.send.lock_aside());
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // The datagrams a UD QP posted leave before it goes, as from a NIC, which sends them
        // in microseconds: a sender that destroys its QP and deregisters its buffers right
        // after posting (rdmacm-utils' mckey does) must not lose them to the host engine
        // reading them later. Bounded, for an engine that is gone.
        if let (Some(o), QpType::Ud) = (&self.offload, self.qp_type) {
            o.settle(&self.ctx().sq_done, Duration::from_millis(100));
        }
        // Peers that mapped the context stop at once; the listing goes with `self`.
        self.ctx().state.store(DESTROYED, Ordering::Release);
        self.dev.unregister_qp(self.qpn);
        // Our connection may have been the last user of what the transport keeps for it.
        self.send.lock_aside().peer = None;
        self.release();
    }
}
