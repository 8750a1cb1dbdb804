//! XRC: domains, XRC SRQs and target QPs (see `softverbs_nic::qp::xrc` for the model).

use crate::cq::CompletionQueue;
use crate::qp::{QueuePair, SharedReceiveQueue, SrqAttr, XrcSrqHold};
use crate::{Context, ProtectionDomain, Result, XrcdOpen};
use softverbs_nic::qp::QpCap;
use softverbs_nic::qp::xrc::Xrcd;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

/// An XRC domain (`struct ibv_xrcd`). Clones are handles to the same domain.
///
/// A receiving process creates XRC SRQs in the domain and a target QP that an initiator
/// connects to; every message names the SRQ it lands in. Processes that open the domain
/// with the same file share its SRQs.
///
/// ```
/// use softverbs::*;
/// let ctx = softverbs::devices()?[0].open()?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(8, None)?;
/// let xrcd = ctx.open_xrcd(None, XrcdOpen::default())?;
/// let srq = pd.create_xrc_srq(&xrcd, &cq, SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 0 })?;
/// let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
/// srq.post_recv([RecvWr::new(1, &[mr.sge(0..64)])])?;
///
/// let tgt = xrcd.create_target_qp()?;
/// let ini = pd.create_qp(&QpInitAttr::new(QpType::XrcSend, &cq, &cq))?;
/// tgt.connect(&ini.endpoint(0)?, 0, AccessFlags::empty())?;
/// ini.connect(&tgt.endpoint(0)?, 0, AccessFlags::empty())?;
///
/// let srqn = srq.srq_num().unwrap();
/// ini.post_send([SendWr::inline(2, SendOp::Send, b"hi").xrc(srqn).flags(SendFlags::SIGNALED)])?;
/// let (a, b) = (cq.wait_one()?, cq.wait_one()?);
/// let recv = if a.opcode() == WcOpcode::Recv { a } else { b };
/// assert_eq!((recv.byte_len(), recv.qp_num()), (2, tgt.qp_num()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct XrcDomain {
    pub(crate) inner: Arc<Xrcd>,
}

impl Context {
    /// `ibv_open_xrcd`: the domain of `file` (shared with every process that opens the same
    /// file; `how` says whether it may or must be created), or without a file a domain of
    /// this process alone.
    pub fn open_xrcd(&self, file: Option<BorrowedFd<'_>>, how: XrcdOpen) -> Result<XrcDomain> {
        Ok(XrcDomain {
            inner: self.inner.open_xrcd(file, how)?,
        })
    }
}

impl XrcDomain {
    /// `ibv_create_qp_ex` with `IBV_QPT_XRC_RECV`: a target QP of this domain, connected
    /// with [`QueuePair::connect`] like an RC QP.
    pub fn create_target_qp(&self) -> Result<QueuePair> {
        Ok(QueuePair {
            inner: self.inner.create_qp(QpCap::default())?,
        })
    }

    /// `ibv_open_qp`: another handle to target QP `qpn` of this domain (created by this
    /// process).
    pub fn open_qp(&self, qpn: u32) -> Result<QueuePair> {
        Ok(QueuePair {
            inner: self.inner.open_qp(qpn)?,
        })
    }

    /// True if `other` is the same domain (opened with the same file).
    pub fn same_domain(&self, other: &XrcDomain) -> bool {
        self.inner.same_domain(&other.inner)
    }
}

impl ProtectionDomain {
    /// `ibv_create_srq_ex` with `IBV_SRQT_XRC`: an SRQ of this PD in `xrcd`, completing into
    /// `cq`.
    pub fn create_xrc_srq(
        &self,
        xrcd: &XrcDomain,
        cq: &CompletionQueue,
        attr: SrqAttr,
    ) -> Result<SharedReceiveQueue> {
        let srq = self.inner.create_xrc_srq(
            &xrcd.inner,
            &cq.inner,
            attr.max_wr,
            attr.max_sge,
            attr.srq_limit,
        )?;
        Ok(SharedReceiveQueue {
            inner: srq.clone(),
            _xrc: Some(Arc::new(XrcSrqHold(srq))),
        })
    }
}
