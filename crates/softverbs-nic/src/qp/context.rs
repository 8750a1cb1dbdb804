//! A QP's context in device memory: its state, rights and the segments a requester needs.
//!
//! The context is a segment of its own, so any process that maps it can act on the QP: read
//! its state and rights, move it to ERR, and open (by descriptor number and inode) the
//! segments it names: the receive ring (or SRQ ring), the receive CQ ring and its channel's
//! doorbell, the key table, and the owner's async event queue; for a QP of a networked device
//! also its send ring and send CQ, which the host engine serves. The owner's QP reads its state
//! from here too, so every party sees one state word.

use crate::device_memory::export::Export;
use crate::device_memory::segment::ShmPlain;
use crate::types::{QpState, QpType};
use std::sync::atomic::{AtomicU32, Ordering};

const CTX_MAGIC: u32 = 0x5150_4358; // "QPCX"
const CTX_VERSION: u32 = 3;
/// `state` value of a destroyed QP: peers holding a mapping must stop using it.
pub(crate) const DESTROYED: u32 = 0xdead;

/// The shared part of a QP: what a requester in any process reads and writes.
#[repr(C)]
pub(crate) struct QpCtx {
    magic: AtomicU32,
    version: AtomicU32,
    pub(crate) qpn: AtomicU32,
    pub(crate) qp_type: AtomicU32,
    pub(crate) pd: AtomicU32,
    pub(crate) recv_pd: AtomicU32,
    pub(crate) owner_pid: AtomicU32,
    pub(crate) state: AtomicU32,
    pub(crate) access: AtomicU32,
    pub(crate) qkey: AtomicU32,
    pub(crate) min_rnr_timer: AtomicU32,
    /// SRQ id + 1 when receives come from an SRQ (0: the QP's own queue).
    pub(crate) srq: AtomicU32,
    pub(crate) rq: Export,
    pub(crate) cq: Export,
    pub(crate) chan: Export,
    pub(crate) keys: Export,
    pub(crate) events: Export,
    pub(crate) events_bell: Export,
    /// Networked QPs (their requests are executed by the host engine): the send ring, the
    /// send CQ's ring and its channel's doorbell, and the number of the oldest WQE the engine
    /// has not completed yet.
    pub(crate) sq: Export,
    pub(crate) send_cq: Export,
    pub(crate) send_chan: Export,
    pub(crate) sq_done: AtomicU32,
    /// XRC: what this QP is in its domain ([`XrcRole`] as a number; 0: not XRC), and the
    /// domain's identity ([`crate::qp::xrc::XrcdId`]), which a requester compares between a
    /// target QP and the SRQ a message names.
    pub(crate) xrc_role: AtomicU32,
    pub(crate) xrcd: [AtomicU32; 4],
    _pad: AtomicU32,
}

/// What an XRC QP context stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum XrcRole {
    /// An XRC target QP (`IBV_QPT_XRC_RECV`).
    Target = 1,
    /// The receive point of an XRC SRQ: the SRQ's number is this context's QP number.
    Srq = 2,
}

// SAFETY: repr(C), atomics only, valid when zero.
unsafe impl ShmPlain for QpCtx {}

impl QpCtx {
    pub(crate) fn init(&self, qpn: u32, qp_type: QpType, pd: u32, recv_pd: u32) {
        self.qpn.store(qpn, Ordering::Relaxed);
        self.qp_type.store(qp_type as u32, Ordering::Relaxed);
        self.pd.store(pd, Ordering::Relaxed);
        self.recv_pd.store(recv_pd, Ordering::Relaxed);
        self.owner_pid.store(std::process::id(), Ordering::Relaxed);
        self.version.store(CTX_VERSION, Ordering::Relaxed);
        self.magic.store(CTX_MAGIC, Ordering::Release);
    }

    /// Marks the context as XRC `role` in domain `id`.
    pub(crate) fn set_xrc(&self, role: XrcRole, id: [u32; 4]) {
        for (w, v) in self.xrcd.iter().zip(id) {
            w.store(v, Ordering::Relaxed);
        }
        self.xrc_role.store(role as u32, Ordering::Release);
    }

    /// True if the context is XRC `role` in domain `id`.
    pub(crate) fn is_xrc(&self, role: XrcRole, id: [u32; 4]) -> bool {
        self.xrc_role.load(Ordering::Acquire) == role as u32
            && self
                .xrcd
                .iter()
                .zip(id)
                .all(|(w, v)| w.load(Ordering::Relaxed) == v)
    }

    /// The XRC domain of a context marked `role`.
    pub(crate) fn xrc_domain(&self, role: XrcRole) -> Option<[u32; 4]> {
        (self.xrc_role.load(Ordering::Acquire) == role as u32)
            .then(|| std::array::from_fn(|i| self.xrcd[i].load(Ordering::Relaxed)))
    }

    /// Moves the QP to ERR unless it is in ERR or RESET already, or destroyed: the one state
    /// change that any party (the owner, a peer's requester, the host engine) may make
    /// without the owner's send lock. True if it moved.
    pub(crate) fn move_to_err(&self) -> bool {
        self.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s != QpState::Err as u32 && s != QpState::Reset as u32 && s != DESTROYED)
                    .then_some(QpState::Err as u32)
            })
            .is_ok()
    }

    /// True if this is a context of this format, published for QP `qpn` (read from a peer's
    /// segment, whose header is the peer's word).
    pub(crate) fn published_as(&self, qpn: u32) -> bool {
        self.magic.load(Ordering::Acquire) == CTX_MAGIC
            && self.version.load(Ordering::Acquire) == CTX_VERSION
            && self.qpn.load(Ordering::Acquire) == qpn
    }
}
