//! XRC (eXtended Reliable Connected): domains, their SRQs and their target QPs.
//!
//! An XRC initiator QP (`XrcSend`) is an RC send queue whose every message names, besides
//! the target QP it is connected to, the XRC SRQ that receives it. The target QP
//! (`XrcRecv`) has no queues of its own: it holds the connection's state and rights, and its
//! messages land in whichever SRQ of its XRC domain they name, in that SRQ's PD (keys and
//! receives) and CQ. One connection so serves every receiving process that shares the domain.
//!
//! The domain's identity is the file it was opened with (`ibv_open_xrcd` with a descriptor:
//! the file's device and inode, so every process that opens the same file shares it), or a
//! number of this process's own for a domain opened without one. A requester finds the SRQ
//! by its number as it finds a QP: an XRC SRQ has a *receive point*, a hidden QP context
//! bound to the SRQ whose QP number is the SRQ number, published like any QP, so an SRQ of
//! another process is mapped the way its QPs are (`transport::same_host`). The requester
//! compares the domain identity in the target's context with the point's before anything
//! lands.
//!
//! Whether a domain exists on the host (`O_CREAT`/`O_EXCL` of `ibv_open_xrcd`) is told by a
//! shared `flock` that every holder keeps on the file: an exclusive probe that fails means
//! another process has the domain open.

use super::context::XrcRole;
use super::request::Offload;
use super::rq::Srq;
use super::{Qp, QpCap, QpInit};
use crate::cq::Cq;
use crate::device::{Context, InUse, Users};
use crate::error::{Error, Result, inval};
use crate::pd::Pd;
use crate::types::{QpState, QpType};
use rustix::fd::{BorrowedFd, OwnedFd};
use rustix::fs::FlockOperation;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// What `ibv_open_xrcd`'s `oflags` ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct XrcdOpen {
    /// `O_CREAT`: create the domain if no process has it open.
    pub create: bool,
    /// `O_EXCL` (with `create`): fail if the domain exists.
    pub exclusive: bool,
}

/// An XRC domain (`struct ibv_xrcd`), as opened by this process.
pub struct Xrcd {
    pub(crate) id: [u32; 4],
    /// What target QPs are created in: they need a PD and CQs to be QPs, but none of the
    /// domain's traffic completes or checks keys there (messages use the SRQ's).
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    pub(crate) users: Users,
    /// The shared lock on the domain's file that tells other processes it exists.
    _file: Option<OwnedFd>,
}

/// The identity of a domain opened without a file: this process's own.
fn private_id() -> [u32; 4] {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    [
        u32::MAX,
        u32::MAX,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
    ]
}

/// The identity of the domain of `file`, with the shared lock that keeps it known.
fn file_id(file: BorrowedFd<'_>, how: XrcdOpen) -> Result<([u32; 4], OwnedFd)> {
    let st = rustix::fs::fstat(file).map_err(Error::os("fstat of the XRC domain's file"))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(inval("xrcd fd is not a regular file"));
    }
    // A description of our own: a lock on the caller's would go with the caller's close.
    let fd = {
        use std::os::fd::AsRawFd;
        let path = format!("/proc/self/fd/{}", file.as_raw_fd());
        rustix::fs::open(
            path.as_str(),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(Error::os("reopening the XRC domain's file"))?
    };
    let exists = match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => false,
        Err(rustix::io::Errno::WOULDBLOCK) => true,
        Err(e) => return Err(Error::os("locking the XRC domain's file")(e)),
    };
    // The kernel's rules: an existing domain is refused with O_EXCL, a missing one without
    // O_CREAT (both EINVAL).
    if exists && how.create && how.exclusive {
        return Err(inval("the XRC domain exists (O_CREAT | O_EXCL)"));
    }
    if !exists && !how.create {
        return Err(inval("no XRC domain for this file, and no O_CREAT"));
    }
    rustix::fs::flock(&fd, FlockOperation::LockShared)
        .map_err(Error::os("locking the XRC domain's file"))?;
    let (dev, ino) = (st.st_dev, st.st_ino);
    Ok((
        [
            dev as u32,
            (dev >> 32) as u32,
            ino as u32,
            (ino >> 32) as u32,
        ],
        fd,
    ))
}

impl Context {
    /// `ibv_open_xrcd`: the XRC domain of `file` (shared with every process that opens the
    /// same file), or, without one, a domain of this process alone.
    pub fn open_xrcd(
        self: &Arc<Self>,
        file: Option<BorrowedFd<'_>>,
        how: XrcdOpen,
    ) -> Result<Arc<Xrcd>> {
        let (id, lock) = match file {
            Some(f) => {
                let (id, lock) = file_id(f, how)?;
                (id, Some(lock))
            }
            None => (private_id(), None),
        };
        let pd = self.alloc_pd()?;
        let cq = self.create_cq(1, None)?;
        Ok(Arc::new(Xrcd {
            id,
            pd,
            cq,
            users: Users::default(),
            _file: lock,
        }))
    }
}

impl Xrcd {
    /// True while an XRC SRQ or target QP lives in the domain (`ibv_close_xrcd` is EBUSY).
    pub fn in_use(&self) -> bool {
        self.users.any()
    }

    /// True if `other` is a handle to the same domain (opened with the same file).
    pub fn same_domain(&self, other: &Xrcd) -> bool {
        self.id == other.id
    }

    /// `ibv_create_qp_ex` of an `IBV_QPT_XRC_RECV` QP: a target QP in this domain. It has
    /// no queues (`cap` must be all zero) and is connected like an RC QP, to INIT and RTR
    /// (RTS is allowed; a target in RTR already answers everything).
    pub fn create_qp(self: &Arc<Self>, cap: QpCap) -> Result<Arc<Qp>> {
        if cap != QpCap::default() {
            return Err(inval("an XRC target QP has no send or receive queue"));
        }
        let qp = Qp::create(
            &self.pd,
            QpInit {
                qp_type: QpType::XrcRecv,
                send_cq: self.cq.clone(),
                recv_cq: self.cq.clone(),
                srq: None,
                cap,
                sq_sig_all: false,
            },
            Some((XrcRole::Target, self.id)),
        )?;
        qp.hold(self.users.add());
        Ok(qp)
    }

    /// `ibv_open_qp`: the target QP `qpn` of this domain, if this process created it.
    ///
    /// Opening another process's target QP is unsupported: its state lives with its
    /// creator.
    pub fn open_qp(&self, qpn: u32) -> Result<Arc<Qp>> {
        let dev = &self.pd.ctx.dev;
        match dev.find_qp::<Qp>(qpn) {
            Some(qp) if qp.ctx().is_xrc(XrcRole::Target, self.id) => Ok(qp),
            Some(_) => Err(inval(format!(
                "QP {qpn} is not an XRC target of this domain"
            ))),
            None if crate::device::directory::lookup(dev.config.gid, qpn).is_some() => {
                Err(Error::Unsupported(format!(
                    "QP {qpn} belongs to another process; opening it there is not implemented"
                )))
            }
            None => Err(inval(format!("no QP {qpn}"))),
        }
    }
}

/// What makes an SRQ an XRC SRQ: its receive point, its domain and its CQ, which it keeps
/// in use while it lives.
pub(crate) struct XrcPoint {
    pub(crate) qp: Arc<Qp>,
    pub(crate) cq: Arc<Cq>,
    pub(crate) xrcd: Arc<Xrcd>,
    _uses: [InUse; 2],
}

impl Pd {
    /// `ibv_create_srq_ex` of an `IBV_SRQT_XRC` SRQ: a shared receive queue of this PD in
    /// domain `xrcd`, completing into `cq`. Its number ([`Srq::srq_num`]) is what an XRC
    /// initiator's work requests name.
    pub fn create_xrc_srq(
        self: &Arc<Self>,
        xrcd: &Arc<Xrcd>,
        cq: &Arc<Cq>,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<Arc<Srq>> {
        if !cq.on(&self.ctx.dev) || !Arc::ptr_eq(&xrcd.pd.ctx.dev, &self.ctx.dev) {
            return Err(inval(
                "the XRC SRQ's CQ and domain must be on its PD's device",
            ));
        }
        let srq = self.create_srq(max_wr, max_sge, limit)?;
        let qp = Qp::create(
            self,
            QpInit {
                qp_type: QpType::XrcRecv,
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                srq: Some(srq.clone()),
                cap: QpCap::default(),
                sq_sig_all: false,
            },
            Some((XrcRole::Srq, xrcd.id)),
        )?;
        // The point is not a QP of the program's: it receives from the moment the SRQ exists
        // and does not count as a user of the PD, CQ or SRQ (the SRQ holds those).
        qp.release_uses();
        qp.ctx().state.store(QpState::Rtr as u32, Ordering::Release);
        // A networked device's engine takes the SRQ's receives for the targets it serves.
        if let Some(o) = &qp.offload {
            o.receive_only()?;
        }
        *srq.xrc.lock().unwrap_or_else(|e| e.into_inner()) = Some(XrcPoint {
            qp,
            cq: cq.clone(),
            xrcd: xrcd.clone(),
            _uses: [xrcd.users.add(), cq.users.add()],
        });
        Ok(srq)
    }
}

impl Srq {
    /// `ibv_get_srq_num`: the number XRC initiators name this SRQ by; `None` for an SRQ
    /// that is not XRC.
    pub fn srq_num(&self) -> Option<u32> {
        self.xrc_lock().as_ref().map(|p| p.qp.qpn())
    }

    /// The XRC domain and CQ of an XRC SRQ.
    pub fn xrc(&self) -> Option<(Arc<Xrcd>, Arc<Cq>)> {
        self.xrc_lock()
            .as_ref()
            .map(|p| (p.xrcd.clone(), p.cq.clone()))
    }

    pub(crate) fn xrc_lock(&self) -> std::sync::MutexGuard<'_, Option<XrcPoint>> {
        self.xrc.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The slot an XRC SRQ keeps its point in (empty for other SRQs, and once destroyed).
pub(crate) type PointSlot = Mutex<Option<XrcPoint>>;
