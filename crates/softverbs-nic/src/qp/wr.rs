//! Send work requests as the NIC executes them.

use crate::pd::Ah;
use crate::types::{AccessFlags, SendFlags, Sge, WcOpcode, WrOpcode};
use std::borrow::Cow;
use std::sync::Arc;

/// What a send work request does, with its opcode-specific fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    Send,
    SendWithImm {
        imm: u32,
    },
    RdmaWrite {
        remote_addr: u64,
        rkey: u32,
    },
    RdmaWriteWithImm {
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    },
    RdmaRead {
        remote_addr: u64,
        rkey: u32,
    },
    CmpSwap {
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
    /// RDMA ATOMIC WRITE (IBTA 1.5, `IBV_WR_ATOMIC_WRITE`): `value` stored into the 8 aligned
    /// bytes at `remote_addr` in one piece, so a reader never sees part of it; takes no SGEs
    /// (the value is in the request) and needs `REMOTE_WRITE`. RC only.
    AtomicWrite {
        remote_addr: u64,
        rkey: u32,
        value: u64,
    },
    /// RDMA FLUSH (IBTA 1.5, `ibv_wr_flush`, RC): once it completes, every RDMA WRITE and
    /// ATOMIC WRITE before it on the QP is globally visible in the responder's region `rkey`
    /// (global placement). `whole_region` flushes the whole region (`IBV_FLUSH_MR`), else
    /// `len` bytes at `remote_addr` (`IBV_FLUSH_RANGE`); the region needs `FLUSH_GLOBAL`.
    /// Persistent placement needs persistent memory, which a software NIC has not: such a
    /// request is `Unsupported` at post. Takes no SGEs; completes with [`WcOpcode::Flush`].
    Flush {
        remote_addr: u64,
        rkey: u32,
        len: u32,
        whole_region: bool,
        persistent: bool,
    },
    /// SEND with Invalidate (`IBV_WR_SEND_WITH_INV`, RC): a SEND that, once its data is
    /// placed, invalidates the responder's type-2 memory window `rkey` (of the responder QP's
    /// PD); its receive completion carries `WITH_INV` and the rkey. A key that cannot be
    /// invalidated fails the receive and the request with `REM_INV_REQ_ERR`.
    SendWithInv {
        rkey: u32,
    },
    /// `IBV_WR_BIND_MW` (and `ibv_bind_mw` for a type-1 window): binds memory window
    /// `window` (any key it has had) to `length` bytes at IOVA `addr` of region `mr` (an
    /// lkey of this QP's PD, with `MW_BIND`) with rights `access`; the window's rkey is
    /// `rkey` from then on. Takes no SGEs; RC and UC. Completes with [`WcOpcode::BindMw`], or
    /// `MW_BIND_ERR` when the rules of [`crate::mr::window`] are broken.
    BindMw {
        window: u32,
        rkey: u32,
        mr: u32,
        addr: u64,
        length: u64,
        access: AccessFlags,
    },
    /// `IBV_WR_LOCAL_INV`: invalidates this PD's type-2 window `rkey` in the QP's program
    /// order. Takes no SGEs; RC and UC. Completes with [`WcOpcode::LocalInv`], or
    /// `LOC_QP_OP_ERR` for a key that cannot be invalidated.
    LocalInv {
        rkey: u32,
    },
    /// The seed's `IBV_WR_BIND_MR` for a layout set with `WITH_POST_WR`: the staged layout of
    /// layout container `key` (of this QP's PD) takes effect when this request executes, so
    /// later requests on the QP see it (program order). Takes no SGEs. Completes with
    /// [`WcOpcode::BindMw`]; no staged layout, or a container of another PD, completes with
    /// `MW_BIND_ERR`.
    BindLayout {
        key: u32,
    },
}

impl SendOp {
    /// The verbs opcode.
    pub fn opcode(&self) -> WrOpcode {
        match self {
            SendOp::Send => WrOpcode::Send,
            SendOp::SendWithImm { .. } => WrOpcode::SendWithImm,
            SendOp::RdmaWrite { .. } => WrOpcode::RdmaWrite,
            SendOp::RdmaWriteWithImm { .. } => WrOpcode::RdmaWriteWithImm,
            SendOp::RdmaRead { .. } => WrOpcode::RdmaRead,
            SendOp::CmpSwap { .. } => WrOpcode::AtomicCmpAndSwp,
            SendOp::FetchAdd { .. } => WrOpcode::AtomicFetchAndAdd,
            SendOp::AtomicWrite { .. } => WrOpcode::AtomicWrite,
            SendOp::Flush { .. } => WrOpcode::Flush,
            SendOp::SendWithInv { .. } => WrOpcode::SendWithInv,
            SendOp::BindMw { .. } => WrOpcode::BindMw,
            SendOp::LocalInv { .. } => WrOpcode::LocalInv,
            SendOp::BindLayout { .. } => WrOpcode::Driver1,
        }
    }

    /// The opcode its send completion reports.
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => {
                WcOpcode::Send
            }
            SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
            SendOp::CmpSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::AtomicWrite { .. } => WcOpcode::AtomicWrite,
            SendOp::Flush { .. } => WcOpcode::Flush,
            SendOp::BindMw { .. } | SendOp::BindLayout { .. } => WcOpcode::BindMw,
            SendOp::LocalInv { .. } => WcOpcode::LocalInv,
        }
    }

    /// True for operations whose local buffer is written (READ, atomics).
    pub fn writes_local(&self) -> bool {
        matches!(
            self,
            SendOp::RdmaRead { .. } | SendOp::CmpSwap { .. } | SendOp::FetchAdd { .. }
        )
    }

    /// True for the work requests that act on this device's keys and reach no responder
    /// (binds and local invalidation).
    pub fn is_local(&self) -> bool {
        matches!(
            self,
            SendOp::BindMw { .. } | SendOp::LocalInv { .. } | SendOp::BindLayout { .. }
        )
    }

    /// True for the atomics.
    pub fn is_atomic(&self) -> bool {
        matches!(self, SendOp::CmpSwap { .. } | SendOp::FetchAdd { .. })
    }

    /// Immediate data, for the `*_WITH_IMM` opcodes.
    pub fn imm(&self) -> Option<u32> {
        match *self {
            SendOp::SendWithImm { imm } | SendOp::RdmaWriteWithImm { imm, .. } => Some(imm),
            _ => None,
        }
    }
}

/// Where the local bytes of a work request are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload<'a> {
    /// Registered memory, checked against each SGE's `lkey` when the request executes.
    Sges(Cow<'a, [Sge]>),
    /// Bytes copied at post time (`IBV_SEND_INLINE`); no key is involved.
    Inline(Cow<'a, [u8]>),
}

impl Payload<'_> {
    /// Total bytes.
    pub fn len(&self) -> u64 {
        match self {
            Payload::Sges(s) => s.iter().map(|s| u64::from(s.length)).sum(),
            Payload::Inline(b) => b.len() as u64,
        }
    }

    /// True when there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn to_owned_payload(&self) -> Payload<'static> {
        match self {
            Payload::Sges(s) => Payload::Sges(Cow::Owned(s.to_vec())),
            Payload::Inline(b) => Payload::Inline(Cow::Owned(b.to_vec())),
        }
    }
}

/// Destination of a UD send.
#[derive(Clone)]
pub struct UdDest {
    pub ah: Arc<Ah>,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

impl std::fmt::Debug for UdDest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdDest")
            .field("ah", self.ah.attr())
            .field("remote_qpn", &self.remote_qpn)
            .field("remote_qkey", &self.remote_qkey)
            .finish()
    }
}

/// One send work request.
#[derive(Debug, Clone)]
pub struct SendWqe<'a> {
    pub wr_id: u64,
    pub op: SendOp,
    pub flags: SendFlags,
    pub payload: Payload<'a>,
    pub ud: Option<UdDest>,
    /// XRC initiators: the number of the XRC SRQ that receives the message
    /// (`qp_type.xrc.remote_srqn`); 0 elsewhere.
    pub xrc_srqn: u32,
}

impl SendWqe<'_> {
    /// A copy that owns its SGE list or inline bytes, for queueing past the post call.
    pub fn to_owned_wqe(&self) -> SendWqe<'static> {
        SendWqe {
            wr_id: self.wr_id,
            op: self.op,
            flags: self.flags,
            payload: self.payload.to_owned_payload(),
            ud: self.ud.clone(),
            xrc_srqn: self.xrc_srqn,
        }
    }
}
