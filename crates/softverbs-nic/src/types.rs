//! Verbs vocabulary: access flags, opcodes, statuses and states.
//!
//! Numeric values are those of rdma-core's `<infiniband/verbs.h>`, so the C ABI layer can pass
//! them through unchanged.

use bitflags::bitflags;

bitflags! {
    /// Memory-region (and QP) access rights, `enum ibv_access_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct AccessFlags: u32 {
        const LOCAL_WRITE = 1;
        const REMOTE_WRITE = 1 << 1;
        const REMOTE_READ = 1 << 2;
        const REMOTE_ATOMIC = 1 << 3;
        const MW_BIND = 1 << 4;
        const ZERO_BASED = 1 << 5;
        const ON_DEMAND = 1 << 6;
        const HUGETLB = 1 << 7;
        const FLUSH_GLOBAL = 1 << 8;
        const FLUSH_PERSISTENT = 1 << 9;
        /// First optional bit (`IBV_ACCESS_OPTIONAL_FIRST`): relaxed placement order.
        const RELAXED_ORDERING = 1 << 20;
    }
}

impl AccessFlags {
    /// Bits 20..=29: the optional range. A device that does not support one of these bits
    /// ignores it instead of failing the registration.
    pub const OPTIONAL_RANGE: u32 = 0x3ff << 20;
    /// Mandatory bits this device implements for memory regions.
    pub const SUPPORTED_MR: AccessFlags = AccessFlags::LOCAL_WRITE
        .union(AccessFlags::REMOTE_WRITE)
        .union(AccessFlags::REMOTE_READ)
        .union(AccessFlags::REMOTE_ATOMIC)
        .union(AccessFlags::MW_BIND)
        .union(AccessFlags::FLUSH_GLOBAL)
        .union(AccessFlags::ZERO_BASED)
        .union(AccessFlags::HUGETLB)
        .union(AccessFlags::ON_DEMAND);
    /// Optional bits (in [`OPTIONAL_RANGE`](Self::OPTIONAL_RANGE)) this device implements:
    /// they take effect; the other optional bits are dropped.
    pub const SUPPORTED_OPTIONAL: AccessFlags = AccessFlags::RELAXED_ORDERING;
    /// Bits that are meaningful in a QP's `qp_access_flags`.
    pub const QP_REMOTE: AccessFlags = AccessFlags::REMOTE_WRITE
        .union(AccessFlags::REMOTE_READ)
        .union(AccessFlags::REMOTE_ATOMIC);
}

bitflags! {
    /// `enum ibv_send_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        const FENCE = 1;
        const SIGNALED = 1 << 1;
        const SOLICITED = 1 << 2;
        const INLINE = 1 << 3;
        const IP_CSUM = 1 << 4;
    }
}

bitflags! {
    /// `enum ibv_wc_flags`: what else a completion carries.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct WcFlags: u32 {
        const GRH = 1;
        const WITH_IMM = 1 << 1;
        const IP_CSUM_OK = 1 << 2;
        const WITH_INV = 1 << 3;
    }
}

bitflags! {
    /// `enum ibv_create_cq_wc_flags`: the fields an extended CQ returns (values as shipped in
    /// rdma-core, so the C ABI passes them through).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct WcExFlags: u64 {
        const BYTE_LEN = 1;
        const IMM = 1 << 1;
        const QP_NUM = 1 << 2;
        const SRC_QP = 1 << 3;
        const SLID = 1 << 4;
        const SL = 1 << 5;
        const DLID_PATH_BITS = 1 << 6;
        /// The raw device-clock value of the completion.
        const COMPLETION_TIMESTAMP = 1 << 7;
        /// VLAN tag (no VLANs on the software NIC: rejected).
        const CVLAN = 1 << 8;
        /// Flow tag (no flow steering on the software NIC: rejected).
        const FLOW_TAG = 1 << 9;
        /// Tag-matching info (no tag matching on the software NIC: rejected).
        const TM_INFO = 1 << 10;
        /// The completion time in `CLOCK_REALTIME` nanoseconds.
        const COMPLETION_TIMESTAMP_WALLCLOCK = 1 << 11;
    }
}

impl WcExFlags {
    /// `IBV_WC_STANDARD_FLAGS`: what a plain `ibv_create_cq` CQ returns.
    pub const STANDARD: WcExFlags = WcExFlags::from_bits_truncate(0x7f);
    /// What a softverbs completion can carry truthfully.
    pub const SUPPORTED: WcExFlags = WcExFlags::STANDARD
        .union(WcExFlags::COMPLETION_TIMESTAMP)
        .union(WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK);
}

bitflags! {
    /// `enum ibv_qp_attr_mask`: which fields of a QP attribute set are meaningful.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct QpAttrMask: u32 {
        const STATE = 1;
        const CUR_STATE = 1 << 1;
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        const ACCESS_FLAGS = 1 << 3;
        const PKEY_INDEX = 1 << 4;
        const PORT = 1 << 5;
        const QKEY = 1 << 6;
        const AV = 1 << 7;
        const PATH_MTU = 1 << 8;
        const TIMEOUT = 1 << 9;
        const RETRY_CNT = 1 << 10;
        const RNR_RETRY = 1 << 11;
        const RQ_PSN = 1 << 12;
        const MAX_QP_RD_ATOMIC = 1 << 13;
        const ALT_PATH = 1 << 14;
        const MIN_RNR_TIMER = 1 << 15;
        const SQ_PSN = 1 << 16;
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        const PATH_MIG_STATE = 1 << 18;
        const CAP = 1 << 19;
        const DEST_QPN = 1 << 20;
        const RATE_LIMIT = 1 << 25;
    }
}

macro_rules! verbs_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $var:ident = $val:expr),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum $name { $($(#[$vm])* $var = $val),+ }
        impl $name {
            /// The value from its C number; `None` for a number verbs does not define.
            #[inline]
            pub const fn from_raw(v: u32) -> Option<Self> {
                match v { $($val => Some(Self::$var),)+ _ => None }
            }
        }
    };
}

verbs_enum!(
    /// `enum ibv_qp_type` (the subset softverbs implements).
    QpType {
        Rc = 2,
        Uc = 3,
        Ud = 4,
        /// XRC initiator (`IBV_QPT_XRC_SEND`): an RC send queue whose every message names
        /// the XRC SRQ that receives it.
        XrcSend = 9,
        /// XRC target (`IBV_QPT_XRC_RECV`): the responder of XRC initiators, in an XRC
        /// domain; it has no queues, its messages land in the domain's XRC SRQs.
        XrcRecv = 10,
    }
);

impl QpType {
    /// True for the transports that acknowledge, retry and report responder errors to the
    /// requester: RC and both halves of XRC (which is RC's protocol).
    pub fn is_reliable(self) -> bool {
        matches!(self, QpType::Rc | QpType::XrcSend | QpType::XrcRecv)
    }

    /// The type a responder of this requester type has: XRC initiators talk to XRC
    /// targets, every other type to its own kind.
    pub fn responder_type(self) -> QpType {
        match self {
            QpType::XrcSend => QpType::XrcRecv,
            t => t,
        }
    }
}

verbs_enum!(
    /// `enum ibv_qp_state`.
    QpState { Reset = 0, Init = 1, Rtr = 2, Rts = 3, Sqd = 4, Sqe = 5, Err = 6 }
);

verbs_enum!(
    /// `enum ibv_wr_opcode` (the subset softverbs implements).
    WrOpcode {
        RdmaWrite = 0,
        RdmaWriteWithImm = 1,
        Send = 2,
        SendWithImm = 3,
        RdmaRead = 4,
        AtomicCmpAndSwp = 5,
        AtomicFetchAndAdd = 6,
        LocalInv = 7,
        BindMw = 8,
        SendWithInv = 9,
        /// `IBV_WR_DRIVER1`, the provider's own opcode: softverbs' layout bind
        /// ([`SendOp::BindLayout`](crate::qp::wr::SendOp::BindLayout), the seed's
        /// `IBV_WR_BIND_MR`).
        Driver1 = 11,
        /// `IBV_WR_FLUSH` (rdma-core 45; Debian's 44 has no `ibv_wr_flush`, so C reaches it
        /// through `ibv_post_send` only with this number).
        Flush = 14,
        AtomicWrite = 15,
    }
);

verbs_enum!(
    /// `enum ibv_wc_opcode`.
    WcOpcode {
        Send = 0,
        RdmaWrite = 1,
        RdmaRead = 2,
        CompSwap = 3,
        FetchAdd = 4,
        BindMw = 5,
        LocalInv = 6,
        Tso = 7,
        Flush = 8,
        AtomicWrite = 9,
        Recv = 128,
        RecvRdmaWithImm = 129,
    }
);

verbs_enum!(
    /// `enum ibv_wc_status`.
    WcStatus {
        Success = 0,
        LocLenErr = 1,
        LocQpOpErr = 2,
        LocEecOpErr = 3,
        LocProtErr = 4,
        WrFlushErr = 5,
        MwBindErr = 6,
        BadRespErr = 7,
        LocAccessErr = 8,
        RemInvReqErr = 9,
        RemAccessErr = 10,
        RemOpErr = 11,
        RetryExcErr = 12,
        RnrRetryExcErr = 13,
        LocRddViolErr = 14,
        RemInvRdReqErr = 15,
        RemAbortErr = 16,
        InvEecnErr = 17,
        InvEecStateErr = 18,
        FatalErr = 19,
        RespTimeoutErr = 20,
        GeneralErr = 21,
    }
);

verbs_enum!(
    /// `enum ibv_mtu`.
    Mtu { Mtu256 = 1, Mtu512 = 2, Mtu1024 = 3, Mtu2048 = 4, Mtu4096 = 5 }
);

impl Mtu {
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
    /// The enum value for a byte count (256..=4096, a power of two).
    pub fn from_bytes(b: u32) -> Option<Mtu> {
        match b {
            256 => Some(Mtu::Mtu256),
            512 => Some(Mtu::Mtu512),
            1024 => Some(Mtu::Mtu1024),
            2048 => Some(Mtu::Mtu2048),
            4096 => Some(Mtu::Mtu4096),
            _ => None,
        }
    }
}

verbs_enum!(
    /// `IBV_LINK_LAYER_*`.
    LinkLayer { InfiniBand = 1, Ethernet = 2 }
);

verbs_enum!(
    /// `enum ibv_port_state`.
    PortState { Nop = 0, Down = 1, Init = 2, Armed = 3, Active = 4, ActiveDefer = 5 }
);

verbs_enum!(
    /// `enum ibv_atomic_cap`.
    AtomicCap { None = 0, Hca = 1, Glob = 2 }
);

verbs_enum!(
    /// `enum ibv_event_type`.
    AsyncEventType {
        CqErr = 0,
        QpFatal = 1,
        QpReqErr = 2,
        QpAccessErr = 3,
        CommEst = 4,
        SqDrained = 5,
        PathMig = 6,
        PathMigErr = 7,
        DeviceFatal = 8,
        PortActive = 9,
        PortErr = 10,
        LidChange = 11,
        PkeyChange = 12,
        SmChange = 13,
        SrqErr = 14,
        SrqLimitReached = 15,
        QpLastWqeReached = 16,
        ClientReregister = 17,
        GidChange = 18,
        WqFatal = 19,
    }
);

/// Bytes reserved at the start of every UD receive buffer for the GRH.
pub const GRH_LEN: usize = 40;

/// A 128-bit global identifier (an IPv6 address for RoCE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(C)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The GID's IPv6 form.
    pub fn to_ipv6(self) -> std::net::Ipv6Addr {
        std::net::Ipv6Addr::from(self.0)
    }
    /// True for the all-zero GID.
    pub fn is_zero(self) -> bool {
        self.0 == [0; 16]
    }
}

impl From<std::net::Ipv6Addr> for Gid {
    fn from(a: std::net::Ipv6Addr) -> Self {
        Gid(a.octets())
    }
}

impl std::str::FromStr for Gid {
    type Err = std::net::AddrParseError;
    /// Parses IPv6 text (`fe80::1`, `::ffff:10.0.0.1`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse::<std::net::Ipv6Addr>().map(Gid::from)
    }
}

impl std::fmt::Display for Gid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // rdma-core prints GIDs as eight colon-separated 16-bit groups, zero-padded.
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

/// One scatter/gather element: `addr` is an IOVA inside the memory region named by `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// Address vector of an address handle or a connected QP (`struct ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct AhAttr {
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub port_num: u8,
    /// Present when the packet carries a GRH (always for RoCE).
    pub grh: Option<GlobalRoute>,
}

/// GRH fields of an address vector (`struct ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GlobalRoute {
    pub dgid: Gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `min_rnr_timer` encoding (IBA table 45) in microseconds.
pub fn rnr_timer_micros(code: u8) -> u64 {
    const TABLE: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    TABLE[(code & 31) as usize]
}

/// Local ACK timeout: 4.096 µs × 2^timeout; `None` for 0, which means "wait forever".
pub fn ack_timeout(code: u8) -> Option<std::time::Duration> {
    if code == 0 {
        return None;
    }
    let nanos = 4096u64 << code.min(31);
    Some(std::time::Duration::from_nanos(nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_round_trips() {
        for b in [256, 512, 1024, 2048, 4096] {
            assert_eq!(Mtu::from_bytes(b).unwrap().bytes(), b);
        }
        assert_eq!(Mtu::from_bytes(1500), None);
    }

    #[test]
    fn gid_prints_like_rdma_core() {
        let g = Gid::from("::ffff:127.0.0.1".parse::<std::net::Ipv6Addr>().unwrap());
        assert_eq!(g.to_string(), "0000:0000:0000:0000:0000:ffff:7f00:0001");
    }

    #[test]
    fn timers() {
        assert_eq!(rnr_timer_micros(12), 640);
        assert_eq!(rnr_timer_micros(0), 655_360);
        assert_eq!(ack_timeout(0), None);
        assert_eq!(ack_timeout(14).unwrap().as_nanos(), 4096 << 14);
    }
}
