//! The general services interface (QP1) of the host: communication-manager MADs between the
//! CM agents of this host's processes and the network.
//!
//! A kernel RDMA stack runs the IBTA communication manager on QP1: REQ, REP, RTU, REJ and the
//! rest travel as 256-byte MADs in UD SEND-only packets from QP1 to QP1 with the GSI's
//! Q_Key. Here the CM state machines live in the processes (each `librdmacm` user runs a *CM
//! agent*); the engine only carries their MADs, so that a capture decodes as CM and a peer
//! host sees what a kernel CM sends. Agents and the engine meet on abstract Unix datagram
//! sockets of the network namespace (the host):
//!
//! - the engine of address A binds [`engine_cm_name`] (`softverbs-engine/<A>/cm`) and takes
//!   [`Envelope`]s from agents: each MAD is sent to QP1 of the envelope's destination GID from
//!   the envelope's source address (which must be one of the engine's own);
//! - agents bind [`agent_name`] (`softverbs-cm/agent/<5 hex digits>`: the upper 20 bits of
//!   every communication ID they hand out) and listeners [`service_name`]
//!   (`softverbs-cm/svc/<16 hex digits>`); a CM MAD from the network goes, as an envelope
//!   with [`FROM_NETWORK`] set, to the listener of its service (REQ, SIDR_REQ) or to the
//!   agent that owns the receiver's communication ID (every other CM message, [`route`]);
//! - a REQ or SIDR_REQ nobody listens for is answered as a host's CM answers it: a REJ with
//!   reason 8, invalid service ID ([`reject_for`]), or a SIDR_REP with status 1, service ID
//!   not supported ([`sidr_unsupported_for`]);
//! - an agent may leave a DREQ with the engine ([`LEASE`]) to be sent if its process dies,
//!   and take it back ([`CANCEL`]): the engine does for a dead process what a host's CM does
//!   ([`lease`](super::lease)). The process is the one the kernel names (`SCM_CREDENTIALS`
//!   on every envelope), never one an envelope claims.
//!
//! Everything that comes in, from the network or from a local socket, is checked in constant
//! work and, when refused, dropped and counted ([`GsiCounters`]); nothing here panics on input.

use super::lease::{self, Lease, Leases, Taken};
use crate::config::net::{gid_of, ip_of};
use crate::types::Gid;
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::net::{
    AddressFamily, SendFlags, SocketAddrUnix, SocketFlags, SocketType, bind, sendto, socket_with,
};
use softverbs_roce::wire::icrc::IdentDeltas;
use softverbs_roce::wire::{Bth, Datagram, Deth, Headers, IpRepr, Opcode, Psn, emit_datagram};
use std::collections::VecDeque;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The GSI's QP number.
pub(crate) const GSI_QPN: u32 = 1;
/// The well-known Q_Key of QP1 (IBTA 13.5.3.2).
pub(crate) const GSI_QKEY: u32 = 0x8001_0000;
/// A MAD of the GSI: always 256 bytes.
pub(crate) const MAD_LEN: usize = 256;
/// The common MAD header that every MAD starts with.
pub(crate) const MAD_HEADER_LEN: usize = 24;
/// An envelope: 48 bytes of addressing, then the MAD.
pub(crate) const ENVELOPE_LEN: usize = 48 + MAD_LEN;
/// The first bytes of every envelope.
pub(crate) const MAGIC: [u8; 4] = *b"SVCM";
/// The envelope format's version.
pub(crate) const VERSION: u8 = 1;
/// Envelope flag: the MAD came from the network (set by the engine only).
pub(crate) const FROM_NETWORK: u8 = 1;
/// Envelope flag, from an agent only: keep this DREQ, and send it if my process dies.
pub(crate) const LEASE: u8 = 2;
/// Envelope flag, from an agent only: forget my lease whose DREQ has this local
/// communication ID (nothing is sent).
pub(crate) const CANCEL: u8 = 4;

/// `base_version` of every MAD.
pub(crate) const MAD_BASE_VERSION: u8 = 1;
/// The communication-management class.
pub(crate) const MGMT_CLASS_CM: u8 = 0x07;
/// The CM class version the kernel speaks.
pub(crate) const CM_CLASS_VERSION: u8 = 2;
/// `Send`: the method of every CM message.
pub(crate) const METHOD_SEND: u8 = 0x03;

/// REJ reason 8: invalid service ID.
pub(crate) const REJ_INVALID_SERVICE_ID: u16 = 8;
/// SIDR_REP status 1: service ID not supported.
pub(crate) const SIDR_UNSUPPORTED: u8 = 1;

/// The CM messages the engine carries, by attribute ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CmAttr {
    Req = 0x0010,
    Mra = 0x0011,
    Rej = 0x0012,
    Rep = 0x0013,
    Rtu = 0x0014,
    Dreq = 0x0015,
    Drep = 0x0016,
    SidrReq = 0x0017,
    SidrRep = 0x0018,
}

impl CmAttr {
    fn from_id(id: u16) -> Option<CmAttr> {
        Some(match id {
            0x0010 => CmAttr::Req,
            0x0011 => CmAttr::Mra,
            0x0012 => CmAttr::Rej,
            0x0013 => CmAttr::Rep,
            0x0014 => CmAttr::Rtu,
            0x0015 => CmAttr::Dreq,
            0x0016 => CmAttr::Drep,
            0x0017 => CmAttr::SidrReq,
            0x0018 => CmAttr::SidrRep,
            _ => return None,
        })
    }
}

/// The socket name of the engine serving address `ip`, where agents send their MADs (beside
/// its control socket, [`engine_name`](super::super::protocol::engine_name)).
pub(crate) fn engine_cm_name(ip: IpAddr) -> String {
    format!("{}/cm", super::super::protocol::engine_name(ip))
}

/// The socket name of the agent whose communication IDs have upper 20 bits `id`.
pub(crate) fn agent_name(id: u32) -> String {
    format!("softverbs-cm/agent/{:05x}", id & 0xf_ffff)
}

/// The socket name of the listener of service `sid`.
pub(crate) fn service_name(sid: u64) -> String {
    format!("softverbs-cm/svc/{sid:016x}")
}

/// One MAD with its addressing: one datagram on the sockets between agents and the engine.
///
/// Bytes 0..4 `SVCM`, 4 the version (1), 5 flags (none, or one of [`FROM_NETWORK`],
/// [`LEASE`], [`CANCEL`]), 6..8 zero, 8..24 the
/// source GID, 24..40 the destination GID, 40..44 the source QP (big-endian; 1 for the GSI),
/// 44..48 zero, 48..304 the MAD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Envelope {
    pub flags: u8,
    pub src: Gid,
    pub dst: Gid,
    pub src_qpn: u32,
    pub mad: [u8; MAD_LEN],
}

impl Envelope {
    pub(crate) fn encode(&self) -> [u8; ENVELOPE_LEN] {
        let mut b = [0u8; ENVELOPE_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.flags;
        b[8..24].copy_from_slice(&self.src.0);
        b[24..40].copy_from_slice(&self.dst.0);
        b[40..44].copy_from_slice(&self.src_qpn.to_be_bytes());
        b[48..].copy_from_slice(&self.mad);
        b
    }

    /// `None` unless `b` is exactly one well-formed envelope: its length, magic, version,
    /// at most one flag and a known one, and the reserved bytes zero.
    pub(crate) fn decode(b: &[u8]) -> Option<Envelope> {
        let b: &[u8; ENVELOPE_LEN] = b.try_into().ok()?;
        if b[0..4] != MAGIC
            || b[4] != VERSION
            || !matches!(b[5], 0 | FROM_NETWORK | LEASE | CANCEL)
            || b[6..8] != [0, 0]
            || b[44..48] != [0; 4]
        {
            return None;
        }
        let gid = |at: usize| {
            let mut g = [0u8; 16];
            g.copy_from_slice(&b[at..at + 16]);
            Gid(g)
        };
        let mut mad = [0u8; MAD_LEN];
        mad.copy_from_slice(&b[48..]);
        Some(Envelope {
            flags: b[5],
            src: gid(8),
            dst: gid(24),
            src_qpn: u32::from_be_bytes([b[40], b[41], b[42], b[43]]),
            mad,
        })
    }
}

/// Where a CM MAD from the network goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// The listener of this service ID (REQ, SIDR_REQ).
    Service(u64),
    /// The agent owning the receiver's communication ID (its upper 20 bits).
    Agent(u32),
}

impl Route {
    pub(crate) fn socket_name(self) -> String {
        match self {
            Route::Service(sid) => service_name(sid),
            Route::Agent(id) => agent_name(id),
        }
    }
}

fn be32_at(mad: &[u8; MAD_LEN], at: usize) -> u32 {
    u32::from_be_bytes([mad[at], mad[at + 1], mad[at + 2], mad[at + 3]])
}

fn be64_at(mad: &[u8; MAD_LEN], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&mad[at..at + 8]);
    u64::from_be_bytes(b)
}

/// True if `mad` is a MAD of the CM class (base version 1, class 0x07).
pub(crate) fn is_cm(mad: &[u8; MAD_LEN]) -> bool {
    mad[0] == MAD_BASE_VERSION && mad[1] == MGMT_CLASS_CM
}

/// The CM message `mad` is and where it goes: REQ and SIDR_REQ to their service's listener
/// (the service ID is CM bytes 8..16 of both), MRA, REJ, REP, RTU, DREQ and DREP to the agent
/// of the remote communication ID (CM bytes 4..8: the receiver's own ID), SIDR_REP to the
/// agent of its request ID (CM bytes 0..4). `None` for anything else (another class, or a CM
/// attribute the engine does not carry: LAP, APR, ClassPortInfo).
pub(crate) fn route(mad: &[u8; MAD_LEN]) -> Option<(CmAttr, Route)> {
    if !is_cm(mad) {
        return None;
    }
    let attr = CmAttr::from_id(u16::from_be_bytes([mad[16], mad[17]]))?;
    let cm = MAD_HEADER_LEN;
    let to = match attr {
        CmAttr::Req | CmAttr::SidrReq => Route::Service(be64_at(mad, cm + 8)),
        CmAttr::SidrRep => Route::Agent(be32_at(mad, cm) >> 12),
        CmAttr::Mra | CmAttr::Rej | CmAttr::Rep | CmAttr::Rtu | CmAttr::Dreq | CmAttr::Drep => {
            Route::Agent(be32_at(mad, cm + 4) >> 12)
        }
    };
    Some((attr, to))
}

/// A CM MAD header for `attr` with transaction ID `tid`, as the kernel's CM writes it.
fn cm_header(attr: CmAttr, tid: &[u8]) -> [u8; MAD_LEN] {
    let mut m = [0u8; MAD_LEN];
    m[0] = MAD_BASE_VERSION;
    m[1] = MGMT_CLASS_CM;
    m[2] = CM_CLASS_VERSION;
    m[3] = METHOD_SEND;
    m[8..16].copy_from_slice(tid);
    m[16..18].copy_from_slice(&(attr as u16).to_be_bytes());
    m
}

/// The REJ a host's CM sends for REQ `req` when nothing listens for its service: message
/// rejected 0 (the REQ), reason 8 (invalid service ID), the REQ's local communication ID as
/// the remote one, local communication ID 0, the same transaction ID.
pub(crate) fn reject_for(req: &[u8; MAD_LEN]) -> [u8; MAD_LEN] {
    let mut m = cm_header(CmAttr::Rej, &req[8..16]);
    let cm = MAD_HEADER_LEN;
    // Local comm ID (cm..cm+4) stays 0; message rejected (top 2 bits of cm+8) is 0 = REQ;
    // no additional rejection information (cm+9).
    m[cm + 4..cm + 8].copy_from_slice(&req[cm..cm + 4]);
    m[cm + 10..cm + 12].copy_from_slice(&REJ_INVALID_SERVICE_ID.to_be_bytes());
    m
}

/// The SIDR_REP a host's CM sends for SIDR_REQ `req` when nothing listens for its service:
/// status 1 (service ID not supported), the same request ID, service ID and transaction ID.
pub(crate) fn sidr_unsupported_for(req: &[u8; MAD_LEN]) -> [u8; MAD_LEN] {
    let mut m = cm_header(CmAttr::SidrRep, &req[8..16]);
    let cm = MAD_HEADER_LEN;
    m[cm..cm + 4].copy_from_slice(&req[cm..cm + 4]);
    m[cm + 4] = SIDR_UNSUPPORTED;
    // The SIDR_REP's service ID is at CM bytes 12..20; the SIDR_REQ's at 8..16.
    m[cm + 12..cm + 20].copy_from_slice(&req[cm + 8..cm + 16]);
    m
}

/// The CM MAD in datagram `d`, if `d` is what a CM sends to QP1: a UD SEND-only packet to QP
/// 1 with the GSI's Q_Key, the default partition (full or limited member), and 256 bytes of
/// payload that are a CM-class MAD. The ICRC was checked when `d` was parsed.
pub(crate) fn gsi_mad<'a>(d: &Datagram<'a>) -> Option<&'a [u8; MAD_LEN]> {
    let bth = d.headers.bth;
    let deth = d.headers.deth?;
    if bth.opcode != Opcode::UD_SEND_ONLY
        || bth.dest_qp != GSI_QPN
        || bth.pkey & 0x7fff != 0x7fff
        || deth.qkey != GSI_QKEY
    {
        return None;
    }
    let mad: &[u8; MAD_LEN] = d.payload.try_into().ok()?;
    is_cm(mad).then_some(mad)
}

/// The whole RoCEv2 datagram carrying `mad` from QP1 of `src` to QP1 of `dst`, headers as
/// the kernel's UDP socket on port 4791 makes them (the ICRC covers them). `None` when the
/// two addresses are not of one family.
pub(crate) fn gsi_datagram(
    src: IpAddr,
    dst: IpAddr,
    psn: u32,
    mad: &[u8; MAD_LEN],
) -> Option<Vec<u8>> {
    let ip = IpRepr::between(src, dst)?;
    let mut h = Headers::new(Bth::new(
        Opcode::UD_SEND_ONLY,
        GSI_QPN,
        Psn::new(psn & 0xff_ffff),
    ));
    h.deth = Some(Deth {
        qkey: GSI_QKEY,
        src_qp: GSI_QPN,
    });
    let mut buf = vec![0u8; 40 + 8 + Bth::LEN + Deth::LEN + MAD_LEN + 4];
    let n = emit_datagram(&ip, super::io::ROCE_PORT, &h, mad, &mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

/// What the GSI did, for `softverbs nic`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct GsiCounters {
    /// CM MADs sent from QP1: the agents' and the engine's own answers.
    pub sent: u64,
    /// Valid CM MADs that arrived at QP1.
    pub received: u64,
    /// Of those, handed to a local agent or listener.
    pub delivered: u64,
    /// Every refusal below, summed.
    pub dropped: u64,
    /// REQs answered with a REJ and SIDR_REQs with a SIDR_REP: nobody listened.
    pub rejected_no_listener: u64,
    /// Datagrams from local sockets that are not envelopes (or name no usable destination).
    pub bad_envelopes: u64,
    /// Envelopes whose source GID is none of this engine's addresses, or whose MAD is not CM.
    pub foreign_source: u64,
    /// Packets to QP1 that are not a valid CM MAD (opcode, Q_Key, P_Key, length, class,
    /// attribute, ICRC).
    pub bad_packets: u64,
    /// CM MADs from the network that no local socket took (nobody bound, or its queue full).
    pub no_receiver: u64,
    /// Datagrams and bytes to and from QP1, for the engine's packet totals.
    pub wire_sent: u64,
    pub wire_sent_bytes: u64,
    pub wire_received: u64,
    pub wire_received_bytes: u64,
    /// Of the bad packets, those whose ICRC did not match.
    pub icrc_errors: u64,
    /// Leased DREQs held now.
    pub leases: u64,
    /// Leased DREQs sent because their process died.
    pub leases_fired: u64,
    /// Leases refused because their process or the table held all it may.
    pub leases_dropped: u64,
}

impl GsiCounters {
    /// The rows `softverbs nic` prints.
    pub(crate) fn rows(&self) -> [(&'static str, u64); 12] {
        [
            ("cm_mads_sent", self.sent),
            ("cm_mads_received", self.received),
            ("cm_mads_delivered", self.delivered),
            ("cm_mads_dropped", self.dropped),
            ("cm_rejected_no_listener", self.rejected_no_listener),
            ("cm_bad_envelopes", self.bad_envelopes),
            ("cm_foreign_source", self.foreign_source),
            ("cm_bad_packets", self.bad_packets),
            ("cm_no_receiver", self.no_receiver),
            ("cm_leases", self.leases),
            ("cm_leases_fired", self.leases_fired),
            ("cm_leases_dropped", self.leases_dropped),
        ]
    }
}

/// Envelopes taken from the socket per call: a flood of them must not starve the QPs.
const ENVELOPES_PER_TURN: usize = 64;

/// Receives one datagram from `sock` (without waiting) into `buf`: its real length (longer
/// than `buf` if it was cut, so an oversized one is refused rather than read in part) and the
/// sender's pid as the kernel gives it with `SO_PASSCRED` (`None` without credentials; 0 for
/// a sender whose pid this pid namespace cannot name). Descriptors passed along are closed at
/// once: nobody may fill the engine's descriptor table.
///
/// Written on `libc::recvmsg` because rustix's credentials hold a non-zero pid, which the
/// kernel's 0 would violate.
fn recv_with_pid(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
) -> Result<(usize, Option<u32>), rustix::io::Errno> {
    // Room for the credentials (which the kernel puts first) and a few descriptors; any
    // beyond are discarded by the kernel (MSG_CTRUNC).
    #[repr(C, align(8))]
    struct Control([u8; 64]);
    let mut control = Control([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty one; its pointers are set below to `iov`
    // and `control`, which outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = control.0.len() as _;
    let flags = libc::MSG_DONTWAIT | libc::MSG_TRUNC | libc::MSG_CMSG_CLOEXEC;
    // SAFETY: `msg` points at one iovec over `buf` and at `control`, both live and writable
    // for their stated lengths.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
    if n < 0 {
        return Err(
            rustix::io::Errno::from_io_error(&std::io::Error::last_os_error())
                .unwrap_or(rustix::io::Errno::IO),
        );
    }
    let mut pid = None;
    // SAFETY: `msg` is the header recvmsg filled; CMSG_FIRSTHDR/CMSG_NXTHDR stay within
    // `msg_controllen` of `control` and return null past its end.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !c.is_null() {
        // SAFETY: `c` is a control message header inside `control` (aligned: the buffer is
        // 8-aligned and the kernel aligns each header).
        let h = unsafe { &*c };
        // SAFETY: CMSG_LEN and CMSG_DATA do arithmetic on a header recvmsg wrote.
        let (data, header) = unsafe { (libc::CMSG_DATA(c), libc::CMSG_LEN(0) as usize) };
        let len = (h.cmsg_len as usize).saturating_sub(header);
        // What the kernel wrote of this message, at most (it may have been cut).
        let end = control.0.as_ptr() as usize + (msg.msg_controllen as usize).min(64);
        let len = len.min(end.saturating_sub(data as usize));
        if h.cmsg_level == libc::SOL_SOCKET {
            if h.cmsg_type == libc::SCM_CREDENTIALS && len >= std::mem::size_of::<libc::ucred>() {
                // SAFETY: `len` bytes of a ucred are at `data`, inside `control`.
                let u: libc::ucred = unsafe { std::ptr::read_unaligned(data.cast()) };
                pid = Some(u32::try_from(u.pid).unwrap_or(0));
            } else if h.cmsg_type == libc::SCM_RIGHTS {
                for i in 0..len / std::mem::size_of::<libc::c_int>() {
                    // SAFETY: whole descriptors lie at `data` within `len`.
                    let fd: libc::c_int =
                        unsafe { std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i)) };
                    // SAFETY: the kernel just installed `fd` for this process; nobody else
                    // knows it.
                    unsafe { libc::close(fd) };
                }
            }
        }
        // SAFETY: as for CMSG_FIRSTHDR.
        c = unsafe { libc::CMSG_NXTHDR(&msg, c) };
    }
    Ok((n as usize, pid))
}

/// The engine's GSI: its socket for the agents, the DREQs leased to it, and what it counted.
pub(crate) struct Gsi {
    /// `None` if the name was taken (the engine then serves QPs without CM).
    sock: Option<OwnedFd>,
    pub(crate) counts: GsiCounters,
    psn: u32,
    leases: Leases,
    /// When the holders of leases are looked at next (while there are leases).
    next_check: Instant,
    /// MADs from the network whose receiver's queue was full (a unix datagram queue holds
    /// only `net.unix.max_dgram_qlen`, 10, and a burst of connects brings more), in order,
    /// with when they came; sent again each turn, for at most [`HOLD_FOR`].
    held: VecDeque<(Route, Envelope, Instant)>,
    /// The IPv4 identifications of arriving MADs, which a run of them sent at once carries
    /// (a GSO send: see [`Datagram::parse_received`]).
    idents: IdentDeltas,
}

/// How long a MAD waits for room at its receiver before it is dropped (the CM's own retry,
/// about a second later, then covers it).
const HOLD_FOR: Duration = Duration::from_millis(500);
/// How many MADs wait at most.
const HOLD_MAX: usize = 1024;

impl Gsi {
    /// Binds the engine's CM socket for primary address `ip`.
    pub(crate) fn bind(ip: IpAddr) -> std::io::Result<Gsi> {
        let sock = socket_with(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        // Before the name exists, so that every envelope that can reach the socket carries
        // its sender's credentials.
        rustix::net::sockopt::set_socket_passcred(&sock, true)?;
        let addr = SocketAddrUnix::new_abstract_name(engine_cm_name(ip).as_bytes())?;
        bind(&sock, &addr)?;
        Ok(Gsi {
            sock: Some(sock),
            ..Gsi::unbound()
        })
    }

    /// A GSI without a socket (its name could not be bound): it still answers REQs from the
    /// network with REJs, as a host without listeners does.
    pub(crate) fn unbound() -> Gsi {
        Gsi {
            sock: None,
            counts: GsiCounters::default(),
            psn: 0,
            leases: Leases::default(),
            next_check: Instant::now(),
            held: VecDeque::new(),
            idents: IdentDeltas::default(),
        }
    }

    /// True while MADs wait for room at their receivers: the engine looks again soon.
    pub(crate) fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// Sends again what waited for room; true if any left.
    pub(crate) fn retry_held(&mut self) -> bool {
        while let Some((to, env, since)) = self.held.front() {
            match self.deliver(*to, env) {
                Err(rustix::io::Errno::AGAIN) if since.elapsed() < HOLD_FOR => return true,
                Ok(()) => self.counts.delivered += 1,
                Err(_) => {
                    self.counts.no_receiver += 1;
                    self.counts.dropped += 1;
                }
            }
            self.held.pop_front();
        }
        false
    }

    /// The socket, for the engine's poll set.
    pub(crate) fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.sock.as_ref().map(|s| s.as_fd())
    }

    fn wire(&mut self, src: IpAddr, dst: IpAddr, mad: &[u8; MAD_LEN]) -> Option<Vec<u8>> {
        self.psn = self.psn.wrapping_add(1) & 0xff_ffff;
        let d = gsi_datagram(src, dst, self.psn, mad)?;
        self.counts.sent += 1;
        self.counts.wire_sent += 1;
        self.counts.wire_sent_bytes += d.len() as u64;
        Some(d)
    }

    /// Takes the agents' envelopes waiting on the socket (up to a batch) and appends the
    /// datagrams to send to `out`; `ours` says whether an address is one of the engine's.
    /// True if anything was read.
    pub(crate) fn outgoing(
        &mut self,
        ours: impl Fn(IpAddr) -> bool,
        out: &mut Vec<(IpAddr, Vec<u8>)>,
    ) -> bool {
        let mut buf = [0u8; ENVELOPE_LEN + 1];
        let mut any = false;
        for _ in 0..ENVELOPES_PER_TURN {
            let Some(sock) = &self.sock else { break };
            let (n, pid) = match recv_with_pid(sock.as_fd(), &mut buf) {
                Ok(got) => got,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => break,
            };
            any = true;
            let Some((e, pid)) = buf
                .get(..n)
                .and_then(Envelope::decode)
                .zip(pid.filter(|&p| p != 0))
            else {
                self.counts.bad_envelopes += 1;
                self.counts.dropped += 1;
                continue;
            };
            let (src, dst) = (ip_of(e.src), ip_of(e.dst));
            if !ours(src) || !is_cm(&e.mad) {
                self.counts.foreign_source += 1;
                self.counts.dropped += 1;
                continue;
            }
            if e.flags & (LEASE | CANCEL) != 0 {
                if !self.take_lease(pid, &e, src, dst) {
                    self.counts.bad_envelopes += 1;
                    self.counts.dropped += 1;
                }
                continue;
            }
            match self.wire(src, dst, &e.mad) {
                Some(d) => out.push((dst, d)),
                None => {
                    self.counts.bad_envelopes += 1;
                    self.counts.dropped += 1;
                }
            }
        }
        any
    }

    /// A LEASE or CANCEL envelope `e` from process `pid` (its source address ours, its MAD
    /// CM): false if it is not a DREQ that can be sent from `src` to `dst`. Sends nothing.
    fn take_lease(&mut self, pid: u32, e: &Envelope, src: IpAddr, dst: IpAddr) -> bool {
        if !matches!(route(&e.mad), Some((CmAttr::Dreq, _))) || src.is_ipv4() != dst.is_ipv4() {
            return false;
        }
        let id = be32_at(&e.mad, MAD_HEADER_LEN);
        if e.flags == CANCEL {
            self.leases.cancel(pid, id);
        } else {
            let was_empty = self.leases.is_empty();
            let lease = Lease {
                src,
                dst,
                mad: e.mad,
            };
            if self.leases.lease(pid, id, lease) == Taken::Dropped {
                self.counts.leases_dropped += 1;
            }
            // The first lease starts the looks; with none, the engine wakes for nothing new.
            if was_empty {
                self.next_check = Instant::now() + lease::CHECK_EVERY;
            }
        }
        self.counts.leases = self.leases.len() as u64;
        true
    }

    /// When the holders of leases must be looked at next; `None` without leases (so an idle
    /// engine without them sleeps as long as it did before leases existed).
    pub(crate) fn lease_check_at(&self) -> Option<Instant> {
        (!self.leases.is_empty()).then_some(self.next_check)
    }

    /// True while some process holds leases.
    pub(crate) fn has_leases(&self) -> bool {
        !self.leases.is_empty()
    }

    /// Sends the leased DREQs of processes that are gone: of `pid` alone if given (a client
    /// the engine saw go), else of the holders the next sweep looks at; the next sweep is then
    /// due after `next`. Appends the datagrams to `out`, as for outgoing MADs.
    pub(crate) fn check_leases(
        &mut self,
        pid: Option<u32>,
        next: Duration,
        out: &mut Vec<(IpAddr, Vec<u8>)>,
    ) {
        let mut fired = Vec::new();
        match pid {
            Some(p) => self.leases.fire_if_dead(p, &mut fired),
            None => self.leases.sweep(&mut fired),
        }
        self.next_check = Instant::now() + next;
        for l in fired {
            self.counts.leases_fired += 1;
            match self.wire(l.src, l.dst, &l.mad) {
                Some(d) => out.push((l.dst, d)),
                // Checked when leased: the two addresses are of one family.
                None => {
                    self.counts.bad_envelopes += 1;
                    self.counts.dropped += 1;
                }
            }
        }
        self.counts.leases = self.leases.len() as u64;
    }

    /// A datagram to QP1 arrived (whole, as the engine rebuilt it): delivers its MAD to the
    /// local agent or listener it is for, or appends the answer of a host without listener
    /// to `out`, or drops and counts it.
    pub(crate) fn incoming(&mut self, datagram: &mut [u8], out: &mut Vec<(IpAddr, Vec<u8>)>) {
        self.counts.wire_received += 1;
        self.counts.wire_received_bytes += datagram.len() as u64;
        let d = match Datagram::parse_received(datagram, &mut self.idents) {
            Ok(d) => d,
            Err(e) => {
                if matches!(e, softverbs_roce::wire::WireError::Icrc { .. }) {
                    self.counts.icrc_errors += 1;
                }
                self.counts.bad_packets += 1;
                self.counts.dropped += 1;
                return;
            }
        };
        let Some((mad, (attr, to))) = gsi_mad(&d).and_then(|m| Some((m, route(m)?))) else {
            self.counts.bad_packets += 1;
            self.counts.dropped += 1;
            return;
        };
        self.counts.received += 1;
        let (from, at) = (d.ip.src(), d.ip.dst());
        let env = Envelope {
            flags: FROM_NETWORK,
            src: gid_of(from),
            dst: gid_of(at),
            src_qpn: d.headers.deth.map_or(GSI_QPN, |x| x.src_qp),
            mad: *mad,
        };
        let sent = if self.held.is_empty() {
            self.deliver(to, &env)
        } else {
            Err(rustix::io::Errno::AGAIN)
        };
        match sent {
            Ok(()) => self.counts.delivered += 1,
            // Nobody bound there: a host's CM answers a REQ or SIDR_REQ for a service it
            // does not have.
            Err(rustix::io::Errno::CONNREFUSED | rustix::io::Errno::NOENT)
                if matches!(attr, CmAttr::Req | CmAttr::SidrReq) =>
            {
                let answer = match attr {
                    CmAttr::Req => reject_for(mad),
                    _ => sidr_unsupported_for(mad),
                };
                self.counts.rejected_no_listener += 1;
                if let Some(d) = self.wire(at, from, &answer) {
                    out.push((from, d));
                }
            }
            // A receiver whose queue is full: held, in order, and sent again.
            Err(rustix::io::Errno::AGAIN) if self.held.len() < HOLD_MAX => {
                self.held.push_back((to, env, Instant::now()));
            }
            // Nobody bound (another message), or too much held: the CM retries on its own.
            Err(_) => {
                self.counts.no_receiver += 1;
                self.counts.dropped += 1;
            }
        }
    }

    fn deliver(&self, to: Route, env: &Envelope) -> Result<(), rustix::io::Errno> {
        let addr = SocketAddrUnix::new_abstract_name(to.socket_name().as_bytes())?;
        match &self.sock {
            Some(s) => sendto(s, &env.encode(), SendFlags::DONTWAIT, &addr).map(|_| ()),
            // Without its own socket the engine cannot send from a name; an unnamed socket
            // would do, but a GSI without a name has nothing bound to answer it either.
            None => Err(rustix::io::Errno::NOENT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::RecvFlags;
    use std::net::Ipv4Addr;

    fn mad(attr: u16) -> [u8; MAD_LEN] {
        let mut m = [0u8; MAD_LEN];
        m[0] = 1;
        m[1] = 7;
        m[2] = 2;
        m[3] = 3;
        m[8..16].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        m[16..18].copy_from_slice(&attr.to_be_bytes());
        m
    }

    fn req(local_comm_id: u32, sid: u64) -> [u8; MAD_LEN] {
        let mut m = mad(0x10);
        m[24..28].copy_from_slice(&local_comm_id.to_be_bytes());
        m[32..40].copy_from_slice(&sid.to_be_bytes());
        m
    }

    fn envelope() -> Envelope {
        let mut mad = req(0xabcde123, 0x0106_0000_0000_4e21);
        mad[255] = 0x5a;
        Envelope {
            flags: 0,
            src: gid_of("10.0.0.1".parse().unwrap()),
            dst: gid_of("fd00::2".parse().unwrap()),
            src_qpn: 1,
            mad,
        }
    }

    #[test]
    fn names_follow_the_contract() {
        assert_eq!(agent_name(0xabcde), "softverbs-cm/agent/abcde");
        assert_eq!(agent_name(0x1), "softverbs-cm/agent/00001");
        assert_eq!(
            service_name(0x0106_0000_0000_4e21),
            "softverbs-cm/svc/0106000000004e21"
        );
        assert_eq!(
            engine_cm_name("10.77.0.1".parse().unwrap()),
            "softverbs-engine/10.77.0.1/cm"
        );
        assert_eq!(
            engine_cm_name("fd00::1".parse().unwrap()),
            "softverbs-engine/fd00::1/cm"
        );
    }

    #[test]
    fn an_envelope_has_the_contracts_layout_and_survives_the_trip() {
        let e = envelope();
        let b = e.encode();
        assert_eq!(&b[0..4], b"SVCM");
        assert_eq!(b[4], 1);
        assert_eq!(&b[8..24], &e.src.0);
        assert_eq!(b[8 + 10..8 + 12], [0xff, 0xff], "IPv4-mapped source");
        assert_eq!(&b[24..40], &e.dst.0);
        assert_eq!(&b[40..44], &[0, 0, 0, 1]);
        assert_eq!(&b[48..], &e.mad[..]);
        assert_eq!(Envelope::decode(&b), Some(e.clone()));
        for flags in [FROM_NETWORK, LEASE, CANCEL] {
            let mut flagged = e.clone();
            flagged.flags = flags;
            assert_eq!(flagged.encode()[5], flags);
            assert_eq!(Envelope::decode(&flagged.encode()), Some(flagged));
        }
    }

    #[test]
    fn anything_but_an_envelope_is_refused() {
        let good = envelope().encode();
        for cut in 0..good.len() {
            assert_eq!(Envelope::decode(&good[..cut]), None, "cut at {cut}");
        }
        let mut long = good.to_vec();
        long.push(0);
        assert_eq!(Envelope::decode(&long), None, "one byte too many");
        // Magic, version, unknown or combined flags, reserved bytes.
        for (at, v) in [
            (0, b'X'),
            (3, 0),
            (4, 2),
            (4, 0),
            (5, LEASE | CANCEL),
            (5, FROM_NETWORK | LEASE),
            (5, FROM_NETWORK | CANCEL),
            (5, 7),
            (5, 8),
            (5, 0x80),
            (6, 1),
            (7, 1),
        ]
        .into_iter()
        .chain((44..48).map(|i| (i, 1)))
        {
            let mut b = good;
            b[at] = v;
            assert_eq!(Envelope::decode(&b), None, "byte {at} = {v:#x}");
        }
    }

    #[test]
    fn requests_go_to_their_service_and_the_rest_to_the_receivers_agent() {
        assert_eq!(
            route(&req(0x12345678, 0x0106_0000_0000_4e21)),
            Some((CmAttr::Req, Route::Service(0x0106_0000_0000_4e21)))
        );
        let mut sidr = mad(0x17);
        sidr[24..28].copy_from_slice(&0xfeed_0001u32.to_be_bytes());
        sidr[32..40].copy_from_slice(&0x0111_0000_0000_0007u64.to_be_bytes());
        assert_eq!(
            route(&sidr),
            Some((CmAttr::SidrReq, Route::Service(0x0111_0000_0000_0007)))
        );
        // The receiver's ID is the remote one (CM bytes 4..8), not the sender's (0..4).
        for (attr, want) in [
            (0x11, CmAttr::Mra),
            (0x12, CmAttr::Rej),
            (0x13, CmAttr::Rep),
            (0x14, CmAttr::Rtu),
            (0x15, CmAttr::Dreq),
            (0x16, CmAttr::Drep),
        ] {
            let mut m = mad(attr);
            m[24..28].copy_from_slice(&0x1111_1111u32.to_be_bytes());
            m[28..32].copy_from_slice(&0xabcd_e123u32.to_be_bytes());
            assert_eq!(route(&m), Some((want, Route::Agent(0xabcde))), "{want:?}");
        }
        let mut rep = mad(0x18);
        rep[24..28].copy_from_slice(&0x0000_1fffu32.to_be_bytes());
        rep[28..32].copy_from_slice(&0xffff_ffffu32.to_be_bytes());
        assert_eq!(route(&rep), Some((CmAttr::SidrRep, Route::Agent(0x00001))));
        assert_eq!(
            Route::Agent(0x00001).socket_name(),
            "softverbs-cm/agent/00001"
        );
    }

    #[test]
    fn other_classes_versions_and_attributes_are_not_routed() {
        let good = req(1, 2);
        let mut m = good;
        m[0] = 2;
        assert_eq!(route(&m), None, "base version 2");
        let mut m = good;
        m[1] = 0x01;
        assert_eq!(route(&m), None, "subnet management");
        for attr in [0x0001, 0x000f, 0x0019, 0x001a, 0x0110, 0xffff] {
            assert_eq!(route(&mad(attr)), None, "attribute {attr:#x}");
        }
    }

    #[test]
    fn a_request_for_no_service_gets_the_answer_of_a_host_cm() {
        let r = req(0xabcde123, 0x0106_0000_0000_4e21);
        let rej = reject_for(&r);
        assert_eq!(
            &rej[0..4],
            &[1, 7, 2, 3],
            "base version, CM class, v2, Send"
        );
        assert_eq!(&rej[8..16], &r[8..16], "same transaction ID");
        assert_eq!(u16::from_be_bytes([rej[16], rej[17]]), 0x12, "REJ");
        assert_eq!(be32_at(&rej, 24), 0, "local comm ID");
        assert_eq!(be32_at(&rej, 28), 0xabcde123, "remote comm ID: the REQ's");
        assert_eq!(rej[32] >> 6, 0, "message rejected: REQ");
        assert_eq!(
            u16::from_be_bytes([rej[34], rej[35]]),
            8,
            "invalid service ID"
        );
        assert!(rej[36..].iter().all(|&b| b == 0));
        assert_eq!(route(&rej), Some((CmAttr::Rej, Route::Agent(0xabcde))));

        let mut s = mad(0x17);
        s[24..28].copy_from_slice(&0xabcd_e001u32.to_be_bytes());
        s[32..40].copy_from_slice(&0x0111_0000_0000_0007u64.to_be_bytes());
        let rep = sidr_unsupported_for(&s);
        assert_eq!(&rep[0..4], &[1, 7, 2, 3]);
        assert_eq!(&rep[8..16], &s[8..16]);
        assert_eq!(u16::from_be_bytes([rep[16], rep[17]]), 0x18, "SIDR_REP");
        assert_eq!(be32_at(&rep, 24), 0xabcd_e001, "request ID");
        assert_eq!(rep[28], 1, "status: service ID not supported");
        assert_eq!(be64_at(&rep, 36), 0x0111_0000_0000_0007, "service ID");
        assert_eq!(route(&rep), Some((CmAttr::SidrRep, Route::Agent(0xabcde))));
    }

    #[test]
    fn a_gsi_datagram_is_a_ud_send_from_qp1_to_qp1_that_parses_back() {
        let r = req(7, 9);
        for (src, dst) in [
            (
                IpAddr::from(Ipv4Addr::new(10, 0, 0, 1)),
                "10.0.0.2".parse().unwrap(),
            ),
            ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap()),
        ] {
            let d = gsi_datagram(src, dst, 0x123456, &r).expect("datagram");
            let p = Datagram::parse(&d).expect("parses, ICRC included");
            assert_eq!((p.ip.src(), p.ip.dst()), (src, dst));
            assert_eq!(
                p.udp.src_port, 4791,
                "the engine's socket's port, as the ICRC says"
            );
            assert_eq!(p.headers.bth.opcode.to_u8(), 0x64);
            assert_eq!((p.headers.bth.dest_qp, p.headers.bth.pkey), (1, 0xffff));
            let deth = p.headers.deth.expect("DETH");
            assert_eq!((deth.qkey, deth.src_qp), (0x8001_0000, 1));
            assert_eq!(gsi_mad(&p), Some(&r));
        }
        assert!(
            gsi_datagram(
                "10.0.0.1".parse().unwrap(),
                "fd00::2".parse().unwrap(),
                0,
                &r
            )
            .is_none(),
            "no IPv4 packet to an IPv6 address"
        );
    }

    /// A UD SEND-only datagram to `qpn` with `qkey`, `pkey` and `payload`.
    fn ud(qpn: u32, qkey: u32, pkey: u16, payload: &[u8]) -> Vec<u8> {
        let ip = IpRepr::between("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()).unwrap();
        let mut bth = Bth::new(Opcode::UD_SEND_ONLY, qpn, Psn::new(1));
        bth.pkey = pkey;
        let mut h = Headers::new(bth);
        h.deth = Some(Deth { qkey, src_qp: 1 });
        let mut buf = vec![0u8; 512];
        let n = emit_datagram(&ip, 4791, &h, payload, &mut buf).unwrap();
        buf.truncate(n);
        buf
    }

    #[test]
    fn only_cm_mads_in_gsi_packets_are_taken() {
        let r = req(7, 9);
        let ok = ud(1, GSI_QKEY, 0xffff, &r);
        assert!(gsi_mad(&Datagram::parse(&ok).unwrap()).is_some());
        let limited = ud(1, GSI_QKEY, 0x7fff, &r);
        assert!(gsi_mad(&Datagram::parse(&limited).unwrap()).is_some());
        let mut not_cm = r;
        not_cm[1] = 0x03;
        for (what, d) in [
            ("wrong Q_Key", ud(1, 0x1234, 0xffff, &r)),
            ("another partition", ud(1, GSI_QKEY, 0x8001, &r)),
            ("QP 2", ud(2, GSI_QKEY, 0xffff, &r)),
            ("short", ud(1, GSI_QKEY, 0xffff, &r[..252])),
            ("not CM", ud(1, GSI_QKEY, 0xffff, &not_cm)),
        ] {
            assert_eq!(gsi_mad(&Datagram::parse(&d).unwrap()), None, "{what}");
        }
    }

    fn recv_envelope(s: &OwnedFd) -> Option<Envelope> {
        let mut b = [0u8; 512];
        let (n, _) = rustix::net::recv(s, &mut b[..], RecvFlags::DONTWAIT).ok()?;
        Envelope::decode(&b[..n])
    }

    fn dgram_bound(name: &str) -> OwnedFd {
        let s = socket_with(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        bind(
            &s,
            &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap(),
        )
        .unwrap();
        s
    }

    /// The engine's socket logic end to end on one host, without the network: envelopes in,
    /// datagrams out, datagrams in, envelopes or answers out. Names are unique to this test
    /// process so parallel runs do not meet.
    #[test]
    fn a_burst_for_a_busy_listener_is_held_and_delivered_in_order() {
        let pid = std::process::id();
        let me: IpAddr = Ipv4Addr::new(127, 180 + (pid % 50) as u8, (pid >> 8) as u8, 2).into();
        let peer: IpAddr = "10.9.9.8".parse().unwrap();
        let mut g = Gsi::bind(me).expect("bind the engine's CM socket");
        let sid = 0x0106_0000_0000_0000 | u64::from(pid) | 1 << 40;
        let listener = dgram_bound(&service_name(sid));
        // More REQs than a unix datagram queue holds, as a burst of connects brings.
        let reqs: Vec<[u8; MAD_LEN]> = (0..40).map(|k| req(0x1000 + k, sid)).collect();
        let mut out = Vec::new();
        for (k, r) in reqs.iter().enumerate() {
            g.incoming(&mut gsi_datagram(peer, me, k as u32, r).unwrap(), &mut out);
        }
        assert!(g.holding(), "the queue filled and the rest is held");
        assert_eq!(g.counts.no_receiver, 0, "nothing dropped");
        let mut got = Vec::new();
        while got.len() < reqs.len() {
            while let Some(e) = recv_envelope(&listener) {
                got.push(e.mad);
            }
            g.retry_held();
        }
        assert_eq!(got, reqs, "every REQ, in order");
        assert!(!g.holding());
        assert_eq!(g.counts.delivered, 40);
    }

    #[test]
    fn envelopes_and_packets_are_routed_answered_and_counted() {
        let pid = std::process::id();
        let me: IpAddr = Ipv4Addr::new(127, 80 + (pid % 100) as u8, (pid >> 8) as u8, 1).into();
        let peer: IpAddr = "10.9.9.9".parse().unwrap();
        let mut g = Gsi::bind(me).expect("bind the engine's CM socket");
        let agent_id = 0x80000 | (pid & 0xffff);
        let sid = 0x0106_0000_0000_0000 | u64::from(pid);
        let agent = dgram_bound(&agent_name(agent_id));
        let listener = dgram_bound(&service_name(sid));

        // Out: an agent's REQ from our address; one from a foreign one; garbage.
        let engine = SocketAddrUnix::new_abstract_name(engine_cm_name(me).as_bytes()).unwrap();
        let r = req(agent_id << 12 | 0x123, sid);
        let mut e = Envelope {
            flags: 0,
            src: gid_of(me),
            dst: gid_of(peer),
            src_qpn: 1,
            mad: r,
        };
        sendto(&agent, &e.encode(), SendFlags::empty(), &engine).unwrap();
        e.src = gid_of("10.1.1.1".parse().unwrap());
        sendto(&agent, &e.encode(), SendFlags::empty(), &engine).unwrap();
        sendto(&agent, b"hello", SendFlags::empty(), &engine).unwrap();
        sendto(&agent, &[0u8; 2000], SendFlags::empty(), &engine).unwrap();
        let mut out = Vec::new();
        assert!(g.outgoing(|a| a == me, &mut out));
        assert_eq!(out.len(), 1, "only the good envelope goes out");
        assert_eq!(out[0].0, peer);
        let sent = Datagram::parse(&out[0].1).unwrap();
        assert_eq!((sent.ip.src(), sent.ip.dst()), (me, peer));
        assert_eq!(gsi_mad(&sent), Some(&r));
        assert_eq!(
            (
                g.counts.sent,
                g.counts.foreign_source,
                g.counts.bad_envelopes
            ),
            (1, 1, 2)
        );

        // In: the REQ reaches the listener, marked as from the network.
        let mut wire_req = gsi_datagram(peer, me, 5, &r).unwrap();
        out.clear();
        g.incoming(&mut wire_req, &mut out);
        assert!(out.is_empty());
        let got = recv_envelope(&listener).expect("the listener got the REQ");
        assert_eq!(got.flags, FROM_NETWORK);
        assert_eq!(
            (got.src, got.dst, got.src_qpn),
            (gid_of(peer), gid_of(me), 1)
        );
        assert_eq!(got.mad, r);
        // The same MAD as segment 5 of a GSO send (a burst of connects): signed for IPv4
        // identification 5, which the receiver's socket does not show (it rebuilds 0).
        let mut fifth = gsi_datagram(peer, me, 5, &r).unwrap();
        let n = fifth.len();
        let icrc = u32::from_le_bytes(fifth[n - 4..].try_into().unwrap())
            ^ IdentDeltas::default().delta(n, 5);
        fifth[n - 4..].copy_from_slice(&icrc.to_le_bytes());
        assert!(
            Datagram::parse(&fifth).is_err(),
            "signed for another identification"
        );
        g.incoming(&mut fifth, &mut out);
        assert!(out.is_empty());
        assert_eq!(recv_envelope(&listener).map(|e| e.mad), Some(r));
        assert_eq!(
            fifth[4..6],
            [0, 5],
            "the identification found, written back"
        );

        // A REP for the agent's comm ID reaches the agent.
        let mut rep = mad(0x13);
        rep[24..28].copy_from_slice(&0x7777_7777u32.to_be_bytes());
        rep[28..32].copy_from_slice(&(agent_id << 12 | 0x123).to_be_bytes());
        g.incoming(&mut gsi_datagram(peer, me, 6, &rep).unwrap(), &mut out);
        assert_eq!(recv_envelope(&agent).map(|e| e.mad), Some(rep));

        // A REQ for a service nobody has: a REJ back to the sender.
        let lonely = req(0x4242_4242, sid ^ 0xffff_0000);
        g.incoming(&mut gsi_datagram(peer, me, 7, &lonely).unwrap(), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, peer);
        let back = Datagram::parse(&out[0].1).unwrap();
        assert_eq!((back.ip.src(), back.ip.dst()), (me, peer));
        assert_eq!(gsi_mad(&back), Some(&reject_for(&lonely)));
        // A REP for nobody, a corrupted packet and a non-CM MAD: dropped.
        out.clear();
        let mut orphan = rep;
        orphan[28] ^= 0x40;
        g.incoming(&mut gsi_datagram(peer, me, 8, &orphan).unwrap(), &mut out);
        let mut bad = gsi_datagram(peer, me, 9, &r).unwrap();
        let at = bad.len() - 30;
        bad[at] ^= 1;
        g.incoming(&mut bad.clone(), &mut out);
        g.incoming(&mut bad[..20], &mut out);
        let mut other = r;
        other[1] = 0x04;
        g.incoming(&mut gsi_datagram(peer, me, 10, &other).unwrap(), &mut out);
        assert!(out.is_empty(), "nothing answers those");
        let c = g.counts;
        assert_eq!(
            (
                c.received,
                c.delivered,
                c.rejected_no_listener,
                c.no_receiver
            ),
            (5, 3, 1, 1)
        );
        assert_eq!((c.bad_packets, c.icrc_errors), (3, 1));
        assert_eq!(c.dropped, 3 + 1 + 3, "envelopes, no receiver, bad packets");
        assert_eq!(c.sent, 2, "the agent's REQ and the engine's REJ");
    }

    fn dreq(local: u32, remote: u32) -> [u8; MAD_LEN] {
        let mut m = mad(0x15);
        m[24..28].copy_from_slice(&local.to_be_bytes());
        m[28..32].copy_from_slice(&remote.to_be_bytes());
        m
    }

    /// An address of this test process's own (`tag` tells tests apart), so that parallel
    /// runs do not meet on the engine's socket name.
    fn own_addr(tag: u8) -> IpAddr {
        let pid = std::process::id();
        Ipv4Addr::new(127, 180 + tag, (pid >> 8) as u8, pid as u8).into()
    }

    /// Leases and cancels from this (living) process: held, replaced, cancelled, counted,
    /// never sent; malformed ones refused and counted.
    #[test]
    fn leases_are_held_replaced_and_cancelled_and_never_sent_while_their_process_lives() {
        let me = own_addr(0);
        let peer: IpAddr = "10.9.9.9".parse().unwrap();
        let mut g = Gsi::bind(me).expect("bind the engine's CM socket");
        let agent = dgram_bound(&agent_name(0x90000 | (std::process::id() & 0xffff)));
        let engine = SocketAddrUnix::new_abstract_name(engine_cm_name(me).as_bytes()).unwrap();
        let send = |flags: u8, src: IpAddr, dst: IpAddr, mad: [u8; MAD_LEN]| {
            let e = Envelope {
                flags,
                src: gid_of(src),
                dst: gid_of(dst),
                src_qpn: 1,
                mad,
            };
            sendto(&agent, &e.encode(), SendFlags::empty(), &engine).unwrap();
        };
        let mut out = Vec::new();
        let ours = |a: IpAddr| a == me;

        send(LEASE, me, peer, dreq(0x1000_0001, 0x2000_0001));
        let mut newer = dreq(0x1000_0001, 0x2000_0001);
        newer[255] = 1;
        send(LEASE, me, peer, newer);
        send(LEASE, me, peer, dreq(0x1000_0002, 0x2000_0002));
        assert!(g.outgoing(ours, &mut out));
        assert!(out.is_empty(), "a lease is not sent when it arrives");
        assert_eq!(
            (g.counts.leases, g.counts.sent, g.counts.dropped),
            (2, 0, 0),
            "the second lease of ID 1 replaced the first"
        );
        assert!(g.lease_check_at().is_some(), "looks are due now");

        send(CANCEL, me, peer, dreq(0x1000_0002, 0x2000_0002));
        send(CANCEL, me, peer, dreq(0x1000_0003, 0));
        g.outgoing(ours, &mut out);
        assert!(out.is_empty(), "a cancel sends nothing");
        assert_eq!(g.counts.leases, 1, "ID 2 cancelled, ID 3 was none");

        // Refused: a lease that is not a DREQ, from a foreign address, across families,
        // not CM; both flags at once.
        send(LEASE, me, peer, req(0x1000_0004, 1));
        send(CANCEL, me, peer, mad(0x16));
        send(
            LEASE,
            "10.1.1.1".parse().unwrap(),
            peer,
            dreq(0x1000_0005, 0),
        );
        send(LEASE, me, "fd00::2".parse().unwrap(), dreq(0x1000_0006, 0));
        let mut not_cm = dreq(0x1000_0007, 0);
        not_cm[1] = 0x04;
        send(LEASE, me, peer, not_cm);
        let mut both = Envelope::decode(&envelope().encode()).unwrap().encode();
        both[5] = LEASE | CANCEL;
        sendto(&agent, &both, SendFlags::empty(), &engine).unwrap();
        g.outgoing(ours, &mut out);
        assert!(out.is_empty());
        let c = g.counts;
        assert_eq!(
            (c.leases, c.bad_envelopes, c.foreign_source, c.dropped),
            (1, 4, 2, 6)
        );

        // This process is alive: neither a look at it nor a sweep sends its lease.
        g.check_leases(Some(std::process::id()), lease::CHECK_EVERY, &mut out);
        g.check_leases(None, lease::CHECK_EVERY, &mut out);
        assert!(out.is_empty());
        assert_eq!((g.counts.leases, g.counts.leases_fired), (1, 0));
        send(CANCEL, me, peer, dreq(0x1000_0001, 0));
        g.outgoing(ours, &mut out);
        assert_eq!(g.counts.leases, 0);
        assert_eq!(g.lease_check_at(), None, "no leases: no looks, no wake-ups");
        assert!(!g.has_leases());
    }

    /// The kernel names the sender: a child process leases a DREQ and waits; its lease is
    /// kept under its pid (not ours) while it lives and sent, once, from QP1 when it is gone.
    #[test]
    fn the_lease_of_a_process_that_died_is_sent_once() {
        let me = own_addr(1);
        let peer: IpAddr = "10.9.9.8".parse().unwrap();
        let mut g = Gsi::bind(me).expect("bind the engine's CM socket");
        let engine = SocketAddrUnix::new_abstract_name(engine_cm_name(me).as_bytes()).unwrap();
        let d = dreq(0x1234_5001, 0xabcd_e002);
        let e = Envelope {
            flags: LEASE,
            src: gid_of(me),
            dst: gid_of(peer),
            src_qpn: 1,
            mad: d,
        }
        .encode();
        let sock = socket_with(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::connect(&sock, &engine).unwrap();
        let (hold_r, hold_w) = rustix::pipe::pipe().unwrap();
        // SAFETY: the child calls only async-signal-safe functions (send, read, _exit) on
        // memory prepared before the fork, as a child of a multithreaded process must.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork");
        if child == 0 {
            // SAFETY: the envelope and descriptors were made before the fork and stay valid.
            unsafe {
                libc::send(sock.as_raw_fd(), e.as_ptr().cast(), e.len(), 0);
                // Its copy of the write end, or the read below would never see the end.
                libc::close(hold_w.as_raw_fd());
                let mut b = [0u8; 1];
                // Alive until the parent closes its end of the pipe.
                libc::read(hold_r.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        drop(hold_r);
        let mut out = Vec::new();
        let ours = |a: IpAddr| a == me;
        let t0 = Instant::now();
        while g.counts.leases == 0 && t0.elapsed() < Duration::from_secs(5) {
            g.outgoing(ours, &mut out);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(g.counts.leases, 1, "the child's lease is held");
        g.check_leases(Some(child as u32), lease::CHECK_EVERY, &mut out);
        g.check_leases(None, lease::CHECK_EVERY, &mut out);
        assert!(out.is_empty(), "the child lives: nothing sent");
        // The lease is the child's, not this process's: our cancel does not touch it.
        let mine = SocketAddrUnix::new_abstract_name(engine_cm_name(me).as_bytes()).unwrap();
        let cancel = Envelope {
            flags: CANCEL,
            ..Envelope::decode(&e).unwrap()
        };
        sendto(&sock, &cancel.encode(), SendFlags::empty(), &mine).unwrap();
        g.outgoing(ours, &mut out);
        assert_eq!(g.counts.leases, 1, "another process cannot cancel it");

        drop(hold_w);
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        g.check_leases(None, lease::CHECK_EVERY, &mut out);
        assert_eq!(out.len(), 1, "the dead child's DREQ went out");
        assert_eq!(out[0].0, peer);
        let p = Datagram::parse(&out[0].1).unwrap();
        assert_eq!((p.ip.src(), p.ip.dst()), (me, peer));
        assert_eq!(p.headers.bth.dest_qp, 1);
        assert_eq!(p.headers.deth.map(|x| x.src_qp), Some(1));
        assert_eq!(gsi_mad(&p), Some(&d));
        let c = g.counts;
        assert_eq!(
            (c.leases, c.leases_fired, c.sent, c.wire_sent),
            (0, 1, 1, 1)
        );
        out.clear();
        g.check_leases(Some(child as u32), lease::CHECK_EVERY, &mut out);
        g.check_leases(None, lease::CHECK_EVERY, &mut out);
        assert!(out.is_empty(), "sent once");
        assert_eq!(g.lease_check_at(), None);
    }

    /// An envelope the kernel gives without its sender's credentials (the socket does not ask
    /// for them here) is dropped and counted, a lease as any other.
    #[test]
    fn an_envelope_without_credentials_is_dropped() {
        let me = own_addr(2);
        let name = engine_cm_name(me);
        let plain = dgram_bound(&name);
        let mut g = Gsi {
            sock: Some(plain),
            ..Gsi::unbound()
        };
        let engine = SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap();
        let agent = dgram_bound(&agent_name(0xa0000 | (std::process::id() & 0xffff)));
        let mut e = envelope();
        e.src = gid_of(me);
        e.dst = gid_of("10.9.9.7".parse().unwrap());
        sendto(&agent, &e.encode(), SendFlags::empty(), &engine).unwrap();
        e.flags = LEASE;
        e.mad = dreq(1, 2);
        sendto(&agent, &e.encode(), SendFlags::empty(), &engine).unwrap();
        let mut out = Vec::new();
        assert!(g.outgoing(|a| a == me, &mut out));
        assert!(out.is_empty());
        let c = g.counts;
        assert_eq!((c.bad_envelopes, c.dropped, c.sent, c.leases), (2, 2, 0, 0));
    }

    /// Descriptors sent along with an envelope are closed at once: the write end of a pipe
    /// passed to the engine is gone once the envelope is read (its reader sees the end).
    #[test]
    fn descriptors_passed_along_are_closed() {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, sendmsg_addr};
        let me = own_addr(3);
        let mut g = Gsi::bind(me).expect("bind the engine's CM socket");
        let engine = SocketAddrUnix::new_abstract_name(engine_cm_name(me).as_bytes()).unwrap();
        let agent = dgram_bound(&agent_name(0xb0000 | (std::process::id() & 0xffff)));
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::NONBLOCK).unwrap();
        let mut e = envelope();
        e.src = gid_of(me);
        e.dst = gid_of("10.9.9.6".parse().unwrap());
        let bytes = e.encode();
        let fds = [w.as_fd()];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        sendmsg_addr(
            &agent,
            &engine,
            &[std::io::IoSlice::new(&bytes)],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        drop(w);
        let mut out = Vec::new();
        assert!(g.outgoing(|a| a == me, &mut out));
        assert_eq!(out.len(), 1, "the envelope itself is good");
        let mut b = [0u8; 1];
        assert_eq!(
            rustix::io::read(&r, &mut b),
            Ok(0),
            "the engine kept no copy of the write end"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Arbitrary bytes as envelopes, MADs and packets to QP1 (raw, and as well-formed GSI
        /// packets whose MAD is arbitrary but for a CM header): nothing panics, every packet
        /// is counted once, and only a REQ or SIDR_REQ is ever answered, once.
        #[test]
        fn arbitrary_input_never_panics_and_is_counted(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), MAD_LEN),
            attr in 0x000fu16..0x001b,
        ) {
            let _ = Envelope::decode(&raw);
            let mut m = [0u8; MAD_LEN];
            m.copy_from_slice(&body);
            let _ = route(&m);
            m[0] = MAD_BASE_VERSION;
            m[1] = MGMT_CLASS_CM;
            m[16..18].copy_from_slice(&attr.to_be_bytes());
            let mut g = Gsi::unbound();
            let mut out = Vec::new();
            g.incoming(&mut raw.clone(), &mut out);
            proptest::prop_assert!(out.is_empty());
            let me: IpAddr = "10.0.0.2".parse().unwrap();
            let mut d = gsi_datagram("10.0.0.1".parse().unwrap(), me, 3, &m).unwrap();
            g.incoming(&mut d, &mut out);
            let c = g.counts;
            proptest::prop_assert_eq!(c.wire_received, 2);
            proptest::prop_assert_eq!(c.received + c.bad_packets, 2);
            let answered = matches!(CmAttr::from_id(attr), Some(CmAttr::Req | CmAttr::SidrReq));
            proptest::prop_assert_eq!(out.len(), usize::from(answered));
            proptest::prop_assert_eq!(c.rejected_no_listener, u64::from(answered));
            proptest::prop_assert_eq!(c.sent, u64::from(answered));
        }
    }
}
