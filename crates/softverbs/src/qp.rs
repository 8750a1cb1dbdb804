//! Queue pairs, work requests, shared receive queues and address handles.

use crate::cq::CompletionQueue;
use crate::{
    AccessFlags, AhAttr, Gid, GlobalRoute, LinkLayer, PostError, QpAttr, QpAttrMask, QpCap,
    QpState, QpType, Result, SendFlags, SendOp, Sge,
};
use softverbs_nic::pd::Ah;
use softverbs_nic::qp::Qp;
use softverbs_nic::qp::rq::Srq;
use softverbs_nic::qp::wr::{Payload, SendWqe, UdDest};
use std::borrow::Cow;
use std::sync::Arc;

/// What [`ProtectionDomain::create_qp`](crate::ProtectionDomain::create_qp) needs.
#[derive(Clone, Copy)]
pub struct QpInitAttr<'a> {
    pub qp_type: QpType,
    pub send_cq: &'a CompletionQueue,
    pub recv_cq: &'a CompletionQueue,
    /// Take receives from this SRQ instead of the QP's own receive queue.
    pub srq: Option<&'a SharedReceiveQueue>,
    pub cap: QpCap,
    /// Every send generates a completion, signaled or not.
    pub sq_sig_all: bool,
}

impl<'a> QpInitAttr<'a> {
    /// Defaults for `qp_type`: 128 send and receive WRs, 4 SGEs each, 64 inline bytes (an
    /// XRC initiator has no receive queue: 0 receive WRs and SGEs; it ignores `recv_cq`).
    pub fn new(
        qp_type: QpType,
        send_cq: &'a CompletionQueue,
        recv_cq: &'a CompletionQueue,
    ) -> Self {
        let recv = if qp_type == QpType::XrcSend { 0 } else { 128 };
        QpInitAttr {
            qp_type,
            send_cq,
            recv_cq,
            srq: None,
            cap: QpCap {
                max_send_wr: 128,
                max_recv_wr: recv,
                max_send_sge: 4,
                max_recv_sge: recv.min(4),
                max_inline_data: 64,
            },
            sq_sig_all: false,
        }
    }
    /// An RC QP with default sizes.
    pub fn rc(send_cq: &'a CompletionQueue, recv_cq: &'a CompletionQueue) -> Self {
        Self::new(QpType::Rc, send_cq, recv_cq)
    }
}

/// The local bytes of a send work request.
#[derive(Debug, Clone, Copy)]
pub enum WrData<'a> {
    /// SGEs in registered memory.
    Sges(&'a [Sge]),
    /// Bytes copied at post time (`IBV_SEND_INLINE`), at most the QP's `max_inline_data`.
    Inline(&'a [u8]),
}

/// Where a UD send goes.
#[derive(Clone, Copy)]
pub struct UdTarget<'a> {
    pub ah: &'a AddressHandle,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// A send work request (`struct ibv_send_wr`).
///
/// ```
/// # use softverbs::*;
/// # let sges = [Sge::default()];
/// let wr = SendWr::new(7, SendOp::Send, &sges).flags(SendFlags::SIGNALED | SendFlags::SOLICITED);
/// let inline = SendWr::inline(8, SendOp::SendWithImm { imm: 42 }, b"hi");
/// ```
#[derive(Clone, Copy)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub op: SendOp,
    pub flags: SendFlags,
    pub data: WrData<'a>,
    pub ud: Option<UdTarget<'a>>,
    /// XRC initiators: the number of the XRC SRQ that receives the message
    /// ([`SharedReceiveQueue::srq_num`]; `qp_type.xrc.remote_srqn`).
    pub xrc_srqn: u32,
}

impl<'a> SendWr<'a> {
    /// A request over registered SGEs.
    pub fn new(wr_id: u64, op: SendOp, sges: &'a [Sge]) -> Self {
        SendWr {
            wr_id,
            op,
            flags: SendFlags::empty(),
            data: WrData::Sges(sges),
            ud: None,
            xrc_srqn: 0,
        }
    }
    /// A request whose payload is copied at post time.
    pub fn inline(wr_id: u64, op: SendOp, bytes: &'a [u8]) -> Self {
        SendWr {
            wr_id,
            op,
            flags: SendFlags::INLINE,
            data: WrData::Inline(bytes),
            ud: None,
            xrc_srqn: 0,
        }
    }
    /// Adds send flags.
    pub fn flags(mut self, f: SendFlags) -> Self {
        self.flags |= f;
        self
    }
    /// Sets the UD destination.
    pub fn ud(mut self, ah: &'a AddressHandle, remote_qpn: u32, remote_qkey: u32) -> Self {
        self.ud = Some(UdTarget {
            ah,
            remote_qpn,
            remote_qkey,
        });
        self
    }

    /// XRC: the message goes to XRC SRQ `srqn` of the target's domain.
    pub fn xrc(mut self, srqn: u32) -> Self {
        self.xrc_srqn = srqn;
        self
    }

    #[inline(always)]
    fn to_wqe(self) -> SendWqe<'a> {
        SendWqe {
            wr_id: self.wr_id,
            op: self.op,
            flags: self.flags,
            payload: match self.data {
                WrData::Sges(s) => Payload::Sges(Cow::Borrowed(s)),
                WrData::Inline(b) => Payload::Inline(Cow::Borrowed(b)),
            },
            ud: self.ud.map(|u| UdDest {
                ah: u.ah.inner.clone(),
                remote_qpn: u.remote_qpn,
                remote_qkey: u.remote_qkey,
            }),
            xrc_srqn: self.xrc_srqn,
        }
    }
}

/// A receive work request (`struct ibv_recv_wr`).
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sg_list: &'a [Sge],
}

impl<'a> RecvWr<'a> {
    /// A receive into `sg_list`.
    pub fn new(wr_id: u64, sg_list: &'a [Sge]) -> Self {
        RecvWr { wr_id, sg_list }
    }
}

/// What a peer needs to connect to a QP: the verbs way is to swap these out of band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: Gid,
}

/// A queue pair.
pub struct QueuePair {
    pub(crate) inner: Arc<Qp>,
}

impl QueuePair {
    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.inner.qpn()
    }
    /// The transport type.
    pub fn qp_type(&self) -> QpType {
        self.inner.qp_type()
    }
    /// The queue sizes granted at creation (requested values rounded up).
    pub fn cap(&self) -> QpCap {
        self.inner.cap()
    }
    /// The current state.
    pub fn state(&self) -> QpState {
        self.inner.state()
    }
    /// `ibv_query_qp`.
    pub fn query(&self) -> QpAttr {
        self.inner.query()
    }
    /// `ibv_modify_qp`: applies the attributes named by `mask`. Invalid transitions and
    /// missing or disallowed attributes fail with `Error::InvalidArgument`.
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.inner.modify(attr, mask)
    }

    /// `ibv_post_send`. On error, `PostError::index` is the first request not posted.
    //
    // Always inlined into the caller, so that a request built there is converted in
    // registers: passed through memory, its fields were read back before the stores that
    // wrote them could forward (7% of a 64-byte WRITE's time on AMD Zen).
    #[inline(always)]
    pub fn post_send<'a>(
        &self,
        wrs: impl IntoIterator<Item = SendWr<'a>>,
    ) -> Result<(), PostError> {
        let mut wrs = wrs.into_iter();
        let Some(first) = wrs.next() else {
            return Ok(());
        };
        let mut rest = wrs.peekable();
        if rest.peek().is_none() {
            // The usual single request, posted where it is converted (see `post_one`).
            return self
                .inner
                .post_one(&first.to_wqe())
                .map_err(|error| PostError { index: 0, error });
        }
        self.post_many(first, rest)
    }

    #[inline(never)]
    fn post_many<'a>(
        &self,
        first: SendWr<'a>,
        rest: impl Iterator<Item = SendWr<'a>>,
    ) -> Result<(), PostError> {
        self.inner
            .post_send(std::iter::once(first).chain(rest).map(SendWr::to_wqe))
    }

    /// `ibv_attach_mcast`: attaches this UD QP to the multicast group `mgid` (`mlid`: the
    /// group's multicast LID on InfiniBand ports, ignored on RoCE). A UD send to
    /// [`MULTICAST_QPN`](crate::MULTICAST_QPN)
    /// through an address handle whose GRH names the group (or, on InfiniBand, whose `dlid`
    /// is its LID) reaches every attached QP on the host, the sender's own included.
    /// Dropping the QP detaches it.
    pub fn attach_mcast(&self, mgid: Gid, mlid: u16) -> Result<()> {
        self.inner.attach_mcast(mgid, mlid)
    }

    /// `ibv_detach_mcast`: `InvalidArgument` if the QP is not attached to the group.
    pub fn detach_mcast(&self, mgid: Gid, mlid: u16) -> Result<()> {
        self.inner.detach_mcast(mgid, mlid)
    }

    /// `ibv_post_recv`.
    pub fn post_recv<'a>(
        &self,
        wrs: impl IntoIterator<Item = RecvWr<'a>>,
    ) -> Result<(), PostError> {
        for (index, wr) in wrs.into_iter().enumerate() {
            self.inner
                .post_recv(wr.wr_id, wr.sg_list)
                .map_err(|error| PostError { index, error })?;
        }
        Ok(())
    }

    /// This QP's address for a peer: QP number, `psn`, and port 1's LID and GID 0.
    pub fn endpoint(&self, psn: u32) -> Result<Endpoint> {
        let dev = self.inner_device();
        let port = dev.port_attr(1)?;
        Ok(Endpoint {
            qpn: self.qp_num(),
            psn,
            lid: port.lid,
            gid: dev.gid(1, 0)?,
        })
    }

    fn inner_device(&self) -> &Arc<softverbs_nic::device::Device> {
        self.inner_pd().context().device()
    }

    fn inner_pd(&self) -> &Arc<softverbs_nic::pd::Pd> {
        self.inner.pd()
    }

    /// Takes an RC, UC or XRC QP from RESET to RTS connected to `remote`, with the settings
    /// `ibv_rc_pingpong` uses (path MTU = port MTU, timeout 14, 7 retries, RNR timer 12):
    /// [`to_init`](Self::to_init), [`to_rtr`](Self::to_rtr), [`to_rts`](Self::to_rts) in a
    /// row. Call those one by one to post receives in INIT, before the peer can send.
    pub fn connect(&self, remote: &Endpoint, local_psn: u32, access: AccessFlags) -> Result<()> {
        self.to_init(access)?;
        self.to_rtr(remote)?;
        self.to_rts(local_psn)
    }

    /// RESET → INIT on port 1, P_Key index 0, granting peers the remote rights in `access`.
    pub fn to_init(&self, access: AccessFlags) -> Result<()> {
        let a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            pkey_index: 0,
            qp_access_flags: access & AccessFlags::QP_REMOTE,
            ..QpAttr::default()
        };
        self.modify(
            &a,
            QpAttrMask::STATE
                | QpAttrMask::PKEY_INDEX
                | QpAttrMask::PORT
                | QpAttrMask::ACCESS_FLAGS,
        )
    }

    /// INIT → RTR: receive from `remote` (path MTU = port MTU; RC: 16 incoming reads and
    /// atomics, RNR timer 12 = 0.64 ms).
    pub fn to_rtr(&self, remote: &Endpoint) -> Result<()> {
        let dev = self.inner_device();
        let port = dev.port_attr(1)?;
        let a = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: port.active_mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            ah_attr: address_vector(port.link_layer, remote),
            max_dest_rd_atomic: 16.min(dev.attr().max_qp_rd_atom as u8),
            min_rnr_timer: 12,
            ..QpAttr::default()
        };
        let mut mask = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN;
        if matches!(self.qp_type(), QpType::Rc | QpType::XrcRecv) {
            mask |= QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
        }
        self.modify(&a, mask)
    }

    /// RTR → RTS starting at `psn` (RC: timeout 14 ≈ 67 ms, 7 retries, RNR retry forever,
    /// 16 outstanding reads and atomics).
    pub fn to_rts(&self, psn: u32) -> Result<()> {
        let a = QpAttr {
            qp_state: QpState::Rts,
            sq_psn: psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16.min(self.inner_device().attr().max_qp_init_rd_atom as u8),
            ..QpAttr::default()
        };
        let mut mask = QpAttrMask::STATE | QpAttrMask::SQ_PSN;
        match self.qp_type() {
            QpType::Rc | QpType::XrcSend => {
                mask |= QpAttrMask::TIMEOUT
                    | QpAttrMask::RETRY_CNT
                    | QpAttrMask::RNR_RETRY
                    | QpAttrMask::MAX_QP_RD_ATOMIC
            }
            QpType::XrcRecv => mask |= QpAttrMask::TIMEOUT,
            _ => {}
        }
        self.modify(&a, mask)
    }

    /// Takes a UD QP from RESET to RTS with Q_Key `qkey`.
    pub fn ready_ud(&self, qkey: u32, psn: u32) -> Result<()> {
        let mut a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qkey,
            ..QpAttr::default()
        };
        self.modify(
            &a,
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY,
        )?;
        a.qp_state = QpState::Rtr;
        self.modify(&a, QpAttrMask::STATE)?;
        a.qp_state = QpState::Rts;
        a.sq_psn = psn;
        self.modify(&a, QpAttrMask::STATE | QpAttrMask::SQ_PSN)
    }
}

/// The address vector for reaching `remote` on this link layer: GRH with its GID on RoCE,
/// its LID on InfiniBand.
pub fn address_vector(link: LinkLayer, remote: &Endpoint) -> AhAttr {
    AhAttr {
        dlid: remote.lid,
        port_num: 1,
        grh: (link == LinkLayer::Ethernet || remote.lid == 0).then_some(GlobalRoute {
            dgid: remote.gid,
            hop_limit: 1,
            ..GlobalRoute::default()
        }),
        ..AhAttr::default()
    }
}

/// Sizes of a shared receive queue (`struct ibv_srq_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    /// Fire `SRQ_LIMIT_REACHED` once when fewer than this many WQEs remain (0: disarmed).
    pub srq_limit: u32,
}

/// A shared receive queue. Clones are handles to the same SRQ.
#[derive(Clone)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<Srq>,
    /// An XRC SRQ's hold on its receive point, let go with the last handle.
    pub(crate) _xrc: Option<Arc<XrcSrqHold>>,
}

/// Lets an XRC SRQ's receive point go when the program's last handle to the SRQ goes
/// (the point holds the SRQ, so it would outlive every handle otherwise).
pub(crate) struct XrcSrqHold(pub(crate) Arc<Srq>);

impl Drop for XrcSrqHold {
    fn drop(&mut self) {
        self.0.release_uses();
    }
}

impl SharedReceiveQueue {
    /// `ibv_post_srq_recv`.
    pub fn post_recv<'a>(
        &self,
        wrs: impl IntoIterator<Item = RecvWr<'a>>,
    ) -> Result<(), PostError> {
        for (index, wr) in wrs.into_iter().enumerate() {
            self.inner
                .post(wr.wr_id, wr.sg_list)
                .map_err(|error| PostError { index, error })?;
        }
        Ok(())
    }
    /// `ibv_modify_srq` with `IBV_SRQ_LIMIT`: arms the limit event.
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        self.inner.set_limit(limit)
    }
    /// `ibv_query_srq`.
    pub fn query(&self) -> SrqAttr {
        let (max_wr, max_sge, srq_limit) = self.inner.attr();
        SrqAttr {
            max_wr,
            max_sge,
            srq_limit,
        }
    }
    /// The id async events name this SRQ by.
    pub fn id(&self) -> u32 {
        self.inner.id()
    }
    /// `ibv_get_srq_num`: the number XRC initiators name an XRC SRQ by
    /// ([`SendWr::xrc`]); `None` for an SRQ that is not XRC.
    pub fn srq_num(&self) -> Option<u32> {
        self.inner.srq_num()
    }
}

/// An address handle for UD sends.
#[derive(Clone)]
pub struct AddressHandle {
    pub(crate) inner: Arc<Ah>,
}

impl AddressHandle {
    /// The address vector.
    pub fn attr(&self) -> AhAttr {
        *self.inner.attr()
    }
}
