//! Queue pairs of other processes on this host: how they are found and reached.
//!
//! A requester finds the owner of a QP number in the host's directory
//! ([`crate::device::directory`]), maps the QP's context ([`QpCtx`]) and the segments it names
//! through `/proc/<pid>/fd/<n>`, and from then on acts on the target's device memory directly:
//! the target runs no code for it.

use super::owner::Owner;
use crate::cq::{Cqe, Pushed, W_ID, W_MOVED, push_ring};
use crate::device::directory::lookup;
use crate::device::event::{AsyncEvent, EventElement, post_event};
use crate::device_memory::doorbell::ring_fd;
use crate::device_memory::export::Export;
use crate::device_memory::prefetch;
use crate::device_memory::ring::Ring;
use crate::device_memory::segment::{Head, Segment};
use crate::error::{Error, Result};
use crate::mr::access::Span;
use crate::mr::keys::{KeyTable, Pin};
use crate::qp::context::{DESTROYED, QpCtx};
use crate::qp::responder::Responder;
use crate::qp::rq::{RecvQueue, RecvWqe, srq_take};
use crate::types::{
    AccessFlags, AsyncEventType, Gid, QpState, QpType, WcOpcode, WcStatus, rnr_timer_micros,
};
use rustix::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The owner's CQ ring a remote QP completes into, and the ring it moved to when the owner
/// resized the CQ (found through the QP context, mapped once).
struct CqLink {
    ring: Ring,
    next: std::sync::OnceLock<Box<CqLink>>,
}

impl CqLink {
    fn new(ring: Ring) -> CqLink {
        CqLink {
            ring,
            next: std::sync::OnceLock::new(),
        }
    }
}

/// A peer's CQ ring, refused unless a completion fits a slot (the ring is the peer's word, and
/// pushing into too small slots would be a bug here, not an error there).
fn open_cq_ring(seg: Segment) -> Result<Ring> {
    let ring = Ring::open(seg)?;
    if ring.payload_bytes() < std::mem::size_of::<Cqe>() {
        return Err(Error::InvalidArgument(
            "peer CQ ring: slots too small".into(),
        ));
    }
    Ok(ring)
}

/// Rings a completion follows through resizes before it settles for the one it reached (the
/// owner polls every ring it ever had, so stopping early loses nothing).
const MAX_CQ_MOVES: usize = 8;

/// A QP of another process, mapped into this one.
///
/// What a one-sided request reads of it comes first, in one cache line: a process
/// round-robining over tens of thousands of these finds few of them in cache, and every
/// further line was a miss per operation.
#[repr(C, align(64))]
pub(crate) struct RemoteQp {
    ctx: Head<QpCtx>,
    /// Shared by every QP of the owner that names the same table (see [`Owner::share_keys`]).
    keys: Arc<KeyTable>,
    owner: Arc<Owner>,
    /// Set once the QP or its owner is found gone.
    dead: AtomicBool,
    qp_type: QpType,
    qpn: u32,
    gid: Gid,
    clock: crate::clock::Clock,
    rq: RecvQueue,
    srq_id: Option<u32>,
    cq: CqLink,
    chan: Option<Arc<OwnedFd>>,
    /// The send CQ, mapped when first needed (only the host engine completes sends).
    send_cq: std::sync::OnceLock<Option<(CqLink, Option<Arc<OwnedFd>>)>>,
    events: Ring,
    events_bell: Arc<OwnedFd>,
    /// The directory table the QP was found in, kept mapped for the next lookups.
    _listed_in: Arc<Segment>,
}

impl RemoteQp {
    /// The owner's key table, as this process maps it (shared by the owner's QPs).
    pub(super) fn key_table(&self) -> &Arc<KeyTable> {
        &self.keys
    }

    /// Finds and maps QP `qpn` of the device with `gid`, if another process on this host
    /// has it.
    pub(crate) fn open(gid: Gid, qpn: u32, clock: crate::clock::Clock) -> Option<Arc<RemoteQp>> {
        let found = lookup(gid, qpn)?;
        match Self::map(gid, qpn, found, clock) {
            Ok(q) => Some(Arc::new(q)),
            Err(e) => {
                report_once(&e);
                None
            }
        }
    }

    fn map(
        gid: Gid,
        qpn: u32,
        found: crate::device::directory::Found,
        clock: crate::clock::Clock,
    ) -> Result<RemoteQp> {
        let crate::device::directory::Found { pid, ctx, table } = found;
        let bad = |what: &str| Error::InvalidArgument(format!("peer QP context: {what}"));
        if ctx.len() < std::mem::size_of::<QpCtx>() {
            return Err(bad("too small"));
        }
        let c: &QpCtx = ctx.at(0);
        if !c.published_as(qpn) {
            return Err(bad("bad header"));
        }
        let qp_type =
            QpType::from_raw(c.qp_type.load(Ordering::Acquire)).ok_or_else(|| bad("type"))?;
        let need = |e: &Export| e.open_segment(pid)?.ok_or_else(|| bad("missing segment"));
        let rq = RecvQueue::from_ring(Ring::open(need(&c.rq)?)?)?;
        let cq = open_cq_ring(need(&c.cq)?)?;
        let owner = Owner::of(pid);
        let keys = owner.share_keys(KeyTable::open(need(&c.keys)?)?);
        let events = Ring::open(need(&c.events)?)?;
        if events.payload_bytes() < std::mem::size_of::<crate::device::event::EventRecord>() {
            return Err(bad("event queue slots too small"));
        }
        let events_bell = c
            .events_bell
            .open_bell(pid)?
            .ok_or_else(|| bad("no event bell"))?;
        let chan = c.chan.open_bell(pid)?;
        let srq = c.srq.load(Ordering::Acquire);
        Ok(RemoteQp {
            owner,
            qpn,
            qp_type,
            rq,
            srq_id: srq.checked_sub(1),
            cq: CqLink::new(cq),
            chan,
            send_cq: std::sync::OnceLock::new(),
            keys,
            events,
            events_bell,
            gid,
            dead: AtomicBool::new(false),
            clock,
            ctx: Head::new(Arc::new(ctx)),
            _listed_in: table,
        })
    }

    pub(crate) fn ctx(&self) -> &QpCtx {
        self.ctx.get()
    }

    /// Starts fetching what a request reads of it: its leading line (`ctx` starts it) and
    /// the context's state line; not the rest, which a request does not read.
    #[inline]
    pub(crate) fn prefetch(&self) {
        prefetch::read(&self.ctx);
        prefetch::read(&self.ctx().state);
    }

    /// False once the owner is gone (see [`Owner`]) or the QP destroyed.
    pub(super) fn alive(&self) -> bool {
        if self.dead.load(Ordering::Relaxed) {
            return false;
        }
        if self.ctx().state.load(Ordering::Acquire) == DESTROYED {
            self.dead.store(true, Ordering::Relaxed);
            return false;
        }
        if !self.owner.alive() {
            self.dead.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn state(&self) -> u32 {
        self.ctx().state.load(Ordering::Acquire)
    }

    fn post(&self, ev: AsyncEvent) {
        post_event(&self.events, self.events_bell.as_fd(), ev);
    }

    /// The owner's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.owner.pid()
    }

    /// The QP's send ring (networked QPs), mapped here.
    pub(crate) fn send_ring(&self) -> Result<Ring> {
        let seg = self
            .ctx()
            .sq
            .open_segment(self.owner.pid())?
            .ok_or_else(|| Error::InvalidArgument("peer QP context: no send ring".into()))?;
        Ring::open(seg)
    }

    /// Says that every send WQE before number `seq` has completed.
    pub(crate) fn set_sq_done(&self, seq: u32) {
        self.ctx().sq_done.store(seq, Ordering::Release);
    }

    /// The owner's current CQ ring: the one mapped first, or where resizes moved it.
    fn cq(&self) -> &Ring {
        self.follow(&self.cq, |c| &c.cq)
    }

    /// The CQ ring `first` leads to through resizes; `export` names the CQ in the context.
    fn follow<'a>(&self, first: &'a CqLink, export: fn(&QpCtx) -> &Export) -> &'a Ring {
        let mut link = first;
        for _ in 0..MAX_CQ_MOVES {
            if link.ring.user_words()[W_MOVED].load(Ordering::Acquire) == 0 {
                break;
            }
            if link.next.get().is_none() {
                // The owner named the new ring in the QP context before flagging the old one.
                let opened = export(self.ctx())
                    .open_segment(self.owner.pid())
                    .and_then(|s| s.ok_or_else(|| Error::InvalidArgument("no CQ".into())))
                    .and_then(open_cq_ring);
                match opened {
                    Ok(ring) => {
                        let _ = link.next.set(Box::new(CqLink::new(ring)));
                    }
                    // Completions go on into the old ring, which the owner still polls.
                    Err(e) => {
                        report_once(&e);
                        break;
                    }
                }
            }
            match link.next.get() {
                Some(next) => link = next,
                None => break,
            }
        }
        &link.ring
    }

    /// Pushes a send completion into the owner's send CQ (the host engine completes the
    /// sends of networked QPs).
    pub(crate) fn push_send(&self, cqe: Cqe) {
        let link = self.send_cq.get_or_init(|| {
            let c = self.ctx();
            let ring = c
                .send_cq
                .open_segment(self.owner.pid())
                .ok()
                .flatten()
                .map(open_cq_ring);
            match ring {
                Some(Ok(r)) => Some((
                    CqLink::new(r),
                    c.send_chan.open_bell(self.owner.pid()).ok().flatten(),
                )),
                Some(Err(e)) => {
                    report_once(&e);
                    None
                }
                None => None,
            }
        });
        if let Some((first, chan)) = link {
            let ring = self.follow(first, |c| &c.send_cq);
            self.push_into(ring, chan.as_deref(), cqe);
        }
    }

    /// Pushes `cqe` into `cq`, ringing `chan` as the owner asked (stamping the time if the CQ
    /// wants it); a lost completion is fatal to the QP.
    fn push_into(&self, cq: &Ring, chan: Option<&OwnedFd>, cqe: Cqe) {
        match push_ring(cq, cqe, &self.clock) {
            Pushed::Queued { notify } => {
                if notify && let Some(ch) = chan {
                    ring_fd(ch.as_fd());
                }
            }
            Pushed::Lost { first } => {
                if first {
                    let id = cq.user_words()[W_ID].load(Ordering::Acquire);
                    self.post(AsyncEvent {
                        kind: AsyncEventType::CqErr,
                        element: EventElement::Cq(id),
                    });
                }
                self.responder_error(Some(AsyncEventType::QpFatal));
            }
        }
    }
}

impl Responder for RemoteQp {
    #[inline]
    fn qpn(&self) -> u32 {
        self.qpn
    }
    #[inline]
    fn qp_type(&self) -> QpType {
        self.qp_type
    }
    #[inline]
    fn receiving(&self) -> bool {
        let s = self.state();
        self.alive()
            && [QpState::Rtr, QpState::Rts, QpState::Sqd, QpState::Sqe]
                .iter()
                .any(|&ok| ok as u32 == s)
    }
    #[inline]
    fn access(&self) -> AccessFlags {
        AccessFlags::from_bits_retain(self.ctx().access.load(Ordering::Acquire))
    }
    #[inline]
    fn qkey(&self) -> u32 {
        self.ctx().qkey.load(Ordering::Acquire)
    }
    #[inline]
    fn rnr_delay(&self) -> Duration {
        let code = self.ctx().min_rnr_timer.load(Ordering::Acquire) as u8;
        Duration::from_micros(rnr_timer_micros(code))
    }
    #[inline]
    fn pd_id(&self) -> u32 {
        self.ctx().pd.load(Ordering::Acquire)
    }
    #[inline]
    fn recv_pd(&self) -> u32 {
        self.ctx().recv_pd.load(Ordering::Acquire)
    }
    #[inline]
    fn keys(&self) -> &KeyTable {
        &self.keys
    }
    #[inline]
    fn gid(&self) -> Gid {
        self.gid
    }

    #[inline]
    fn take_recv(&self) -> Option<RecvWqe> {
        match self.srq_id {
            Some(id) => srq_take(&self.rq, id, |ev| self.post(ev)),
            None => self.rq.take(),
        }
    }

    /// Pushes a receive completion into the owner's CQ, signalling as the owner would.
    #[inline]
    fn push_recv(&self, cqe: Cqe) {
        self.push_into(self.cq(), self.chan.as_deref(), cqe);
    }

    /// The responder side of an error: the owner's QP goes to ERR, its posted receives are
    /// flushed (here: nothing in the owner needs to run), and it gets `event`.
    fn responder_error(&self, event: Option<AsyncEventType>) {
        if !self.ctx().move_to_err() {
            return;
        }
        if let Some(kind) = event {
            self.post(AsyncEvent {
                kind,
                element: EventElement::Qp(self.qpn),
            });
        }
        if self.srq_id.is_none() {
            while let Some(w) = self.rq.take() {
                self.push_recv(Cqe {
                    wr_id: w.wr_id,
                    status: WcStatus::WrFlushErr as u8,
                    opcode: WcOpcode::Recv as u8,
                    qp_num: self.qpn,
                    ..Cqe::default()
                });
            }
        }
    }

    #[inline(always)]
    fn place(&self, pin: &Pin<'_>, host: usize, len: usize) -> Option<Span> {
        // Where the bytes of the regions its key table names are: the owner's files, which
        // a region of another process (a shared PD's) names by its own pid.
        self.owner.memory.locate(pin, host, len).ok()
    }
}

/// Says once per process why a peer could not be reached (the data path has no other voice).
fn report_once(e: &Error) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!("softverbs: cannot reach a QP of another process: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's CQ ring whose slots cannot hold a completion is refused at mapping, rather
    /// than failing an assertion at the first completion pushed into it.
    #[test]
    fn a_peer_cq_ring_with_tiny_slots_is_refused() {
        let dup = |r: &Ring| r.segment().reopen().unwrap();
        let tiny = Ring::new("t", 4, 16).unwrap();
        assert!(open_cq_ring(dup(&tiny)).is_err());
        let fits = Ring::new("t", 4, std::mem::size_of::<Cqe>()).unwrap();
        assert!(open_cq_ring(dup(&fits)).is_ok());
    }
}
