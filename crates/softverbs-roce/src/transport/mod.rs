//! The transports of one queue pair as state machines: the RC requester, completer and
//! responder, and the UC and UD paths.
//!
//! A [`Qp`] takes packets and the time ([`Qp::handle_packet`], [`Qp::handle_timeout`]) and
//! gives back packets to send ([`Qp::poll_transmit`]), the next deadline
//! ([`Qp::poll_timeout`]) and completions ([`Qp::poll_event`]); work requests come in through
//! [`Qp::post_send`] and [`Qp::post_recv`]. Registered memory is reached only through the
//! [`Memory`] trait (key, rights, PD and bounds checked there), so the same core runs over the
//! NIC's key table and over the plain [`MemoryModel`] tests use. The core reads no clock and
//! does no I/O; the crate's `endpoint` module wraps many QPs into a host's RoCEv2 endpoint.
//!
//! What the IBTA specification (and the kernel's soft-RoCE, which peers expect) asks, each
//! with its completion status: segmentation at the path MTU; ACK requests on the last packet
//! of a message and every few packets; ACK coalescing; go-back-N on a PSN sequence error NAK
//! and on the retransmit timeout (4.096 µs × 2^`timeout`, `retry_cnt` retries: 7 is seven, as
//! on a ConnectX; soft-RoCE alone reads it as forever);
//! duplicate detection on the responder, with a fresh ACK; RDMA READ responses replayed from
//! `max_dest_rd_atomic` responder resources, READs and atomics limited to `max_rd_atomic` in
//! flight; atomics executed once, a duplicate answered from the saved original value; RNR NAK
//! with the `min_rnr_timer` encoding and `rnr_retry` (7 = forever); remote access, invalid
//! request and remote operation errors to the verbs statuses, both QPs to the error state;
//! UC dropping to the next first/only packet; UD checking the Q_Key and placing the GRH.

mod linger;
mod memory;
mod qp;
mod requester;
mod responder;
mod timers;

pub use linger::Linger;
pub use memory::{Access, AtomicOp, MemError, Memory, MemoryModel, Region};
pub use qp::{Qp, Transmit};
pub use timers::{rnr_timer, transport_timeout};

use crate::wire::Psn;
use std::net::IpAddr;

/// The longest message (2^31 bytes, the `max_msg_sz` RoCE devices report).
pub const MAX_MSG: u64 = 1 << 31;

/// The transport service of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    Rc,
    Uc,
    Ud,
    /// XRC (either half): RC's protocol with XRC opcodes; an initiator names each message's
    /// SRQ ([`SendWr::xrc_srqn`]), a target takes each message's receive and memory from the
    /// SRQ it names ([`Memory::xrc_srq`]).
    Xrc,
}

impl QpType {
    /// RC and XRC: acknowledged, retried, errors reported to the requester.
    pub fn is_reliable(self) -> bool {
        matches!(self, QpType::Rc | QpType::Xrc)
    }

    /// The transport of its packets.
    pub fn transport(self) -> crate::wire::Transport {
        match self {
            QpType::Rc => crate::wire::Transport::Rc,
            QpType::Uc => crate::wire::Transport::Uc,
            QpType::Ud => crate::wire::Transport::Ud,
            QpType::Xrc => crate::wire::Transport::Xrc,
        }
    }
}

bitflags::bitflags! {
    /// What remote peers may do to memory through this QP (`qp_access_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct QpAccess: u8 {
        const REMOTE_WRITE = 1;
        const REMOTE_READ = 2;
        const REMOTE_ATOMIC = 4;
    }
}

/// A QP's configuration: what `ibv_modify_qp` to RTS sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpConfig {
    pub qp_type: QpType,
    pub qpn: u32,
    /// The protection domain memory keys must belong to.
    pub pd: u32,
    /// The peer (RC, UC): its address and QP number.
    pub peer: Option<(IpAddr, u32)>,
    /// The first PSN this QP sends (`sq_psn`).
    pub sq_psn: Psn,
    /// The first PSN it expects (`rq_psn`).
    pub rq_psn: Psn,
    /// Path MTU in bytes: 256, 512, 1024, 2048 or 4096.
    pub pmtu: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout; 0 waits forever.
    pub timeout: u8,
    /// Retransmissions after a timeout or a sequence error NAK: IBTA gives 7 no special
    /// meaning, unlike `rnr_retry`'s. The verbs take 0 to 7; the core takes any count.
    pub retry_cnt: u8,
    /// Retries after RNR NAKs (7: forever).
    pub rnr_retry: u8,
    /// The RNR timer code this QP's responder asks peers to wait.
    pub min_rnr_timer: u8,
    /// RDMA READs and atomics this requester keeps in flight.
    pub max_rd_atomic: u8,
    /// RDMA READs and atomics this responder keeps for replay.
    pub max_dest_rd_atomic: u8,
    pub pkey: u16,
    /// The Q_Key (UD).
    pub qkey: u32,
    pub access: QpAccess,
    /// Unacknowledged packets the requester sends before it waits for an ACK.
    pub window: u32,
}

impl QpConfig {
    /// An RC QP `qpn` connected to `peer`, with the defaults of `ibv_rc_pingpong` (MTU 1024,
    /// timeout 14, 7 retries, every remote right).
    pub fn rc(qpn: u32, peer: (IpAddr, u32)) -> QpConfig {
        QpConfig {
            qp_type: QpType::Rc,
            qpn,
            pd: 1,
            peer: Some(peer),
            sq_psn: Psn::new(0),
            rq_psn: Psn::new(0),
            pmtu: 1024,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            pkey: 0xffff,
            qkey: 0,
            access: QpAccess::all(),
            window: 128,
        }
    }
}

/// A local scatter/gather element: `len` bytes at `addr` of the region `lkey` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// Where a UD message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest {
    pub addr: IpAddr,
    pub qpn: u32,
    /// The Q_Key; with its top bit set, the QP's own Q_Key is sent instead (verbs' rule).
    pub qkey: u32,
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    Send {
        imm: Option<u32>,
        /// Send with invalidate: the R_Key the responder invalidates.
        invalidate: Option<u32>,
    },
    Write {
        va: u64,
        rkey: u32,
        imm: Option<u32>,
    },
    Read {
        va: u64,
        rkey: u32,
    },
    CompareSwap {
        va: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        va: u64,
        rkey: u32,
        add: u64,
    },
    /// RDMA ATOMIC WRITE: `value` (its bytes in memory order) stored into the 8 aligned
    /// bytes at `va` in one piece; no SGEs. RC only.
    AtomicWrite {
        va: u64,
        rkey: u32,
        value: u64,
    },
    /// RDMA FLUSH with global placement: the WRITEs before it are visible in region `rkey`
    /// (its `len` bytes at `va`, or with `whole_region` all of it) once it completes; no
    /// SGEs. RC only.
    Flush {
        va: u64,
        rkey: u32,
        len: u32,
        whole_region: bool,
    },
}

/// A send work request (`struct ibv_send_wr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: SendOp,
    /// Where the data comes from (SEND, WRITE) or goes (READ, atomics: 8 bytes).
    pub sges: Vec<Sge>,
    /// Data carried in the request instead of `sges` (SEND and WRITE only).
    pub inline: Option<Vec<u8>>,
    pub signaled: bool,
    pub solicited: bool,
    /// Wait for earlier READs and atomics to complete first.
    pub fence: bool,
    /// The destination of a UD message.
    pub ud: Option<UdDest>,
    /// XRC: the SRQ that receives the message (in every packet's XRCETH).
    pub xrc_srqn: u32,
}

impl SendWr {
    /// A signaled request with no data, to fill in.
    pub fn new(wr_id: u64, op: SendOp) -> SendWr {
        SendWr {
            wr_id,
            op,
            sges: Vec::new(),
            inline: None,
            signaled: true,
            solicited: false,
            fence: false,
            ud: None,
            xrc_srqn: 0,
        }
    }

    /// Bytes of the message (the SGEs' total, or the inline data's).
    pub fn len(&self) -> u64 {
        match &self.inline {
            Some(d) => d.len() as u64,
            None => self.sges.iter().map(|s| u64::from(s.len)).sum(),
        }
    }

    /// True for a message of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sges: Vec<Sge>,
    /// XRC targets: the SRQ it was taken from, which only messages naming that SRQ use
    /// (0 elsewhere).
    pub srq: u32,
}

/// A work completion's status (the verbs' `enum ibv_wc_status`, as far as a transport can
/// give them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    Success,
    LocLenErr,
    LocQpOpErr,
    LocProtErr,
    WrFlushErr,
    BadRespErr,
    LocAccessErr,
    RemInvReqErr,
    RemAccessErr,
    RemOpErr,
    RetryExcErr,
    RnrRetryExcErr,
}

/// What a completion reports (the verbs' `enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    Send,
    RdmaWrite,
    RdmaRead,
    CompSwap,
    FetchAdd,
    AtomicWrite,
    Flush,
    Recv,
    RecvRdmaWithImm,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    /// Bytes received (receive side; for UD including the 40-byte GRH), or read.
    pub byte_len: u32,
    pub imm: Option<u32>,
    /// The R_Key a SEND with invalidate invalidated.
    pub invalidated: Option<u32>,
    /// The QP the completion belongs to.
    pub qpn: u32,
    /// The sender's QP (receive side).
    pub src_qp: u32,
    /// A receive completion (else a send queue one).
    pub is_recv: bool,
    /// UD: the receive buffer starts with the GRH room, holding this IP header (an IPv4
    /// header in its last 20 bytes, as Annex 17 places it).
    pub grh: Option<NetworkHeader>,
    /// Solicited event requested by the sender (receive side).
    pub solicited: bool,
    /// XRC targets: the SRQ the receive was taken from, whose CQ it belongs in (0
    /// elsewhere).
    pub srq: u32,
}

/// The IP version of a received datagram (the kernel's `rdma_network_type`): a UD receiver
/// needs it to read its GRH room, where an IPv4 header fills only the second half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkHeader {
    Ipv4,
    Ipv6,
}

/// Why a QP entered the error state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpError {
    /// A request of ours failed with this status.
    Requester(WcStatus),
    /// The responder refused a request from the peer (it sent this NAK).
    Responder(crate::wire::NakCode),
    /// A receive could not take a message (length, protection).
    Receive(WcStatus),
    /// The program moved it there.
    Modified,
}

/// What a QP reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Completion(Completion),
    /// The QP entered the error state (the async event `IBV_EVENT_QP_FATAL` and friends).
    Error(QpError),
}

/// A QP's state, as far as the transport moves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    Rts,
    Err,
}

/// Why a work request was refused when posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    #[error("{0} is not an operation of this QP's transport")]
    Unsupported(&'static str),
    #[error("a UD send needs a destination")]
    NoDestination,
    #[error("message of {len} bytes, the most is {max}")]
    TooLong { len: u64, max: u64 },
    #[error("atomics take exactly one 8-byte SGE")]
    AtomicSge,
}

/// Per-QP counters of what the transport did, in the style of soft-RoCE's hardware counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpCounters {
    pub packets_sent: u64,
    pub packets_received: u64,
    /// Request packets sent again (timeouts, NAKs, RNR).
    pub retransmitted: u64,
    pub timeouts: u64,
    pub seq_naks_sent: u64,
    pub seq_naks_received: u64,
    pub rnr_naks_sent: u64,
    pub rnr_naks_received: u64,
    pub error_naks_sent: u64,
    pub error_naks_received: u64,
    /// Requests that arrived again and were answered without executing them again.
    pub duplicates: u64,
    /// Request packets ahead of the expected PSN (dropped).
    pub out_of_sequence: u64,
    /// Packets dropped for another reason (a bad P_Key or Q_Key, the wrong source, a
    /// response nothing waits for, a UD message without a receive).
    pub dropped: u64,
}
