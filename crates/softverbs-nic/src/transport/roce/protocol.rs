//! What a process and its host engine say to each other: control messages on the engine's
//! Unix socket, and send WQEs in a QP's send ring in device memory.
//!
//! Every message is checked by whoever reads it: the engine serves any process of its user,
//! and a process that scribbles on its own send ring must not crash the engine.

use crate::device_memory::ring::SlotPayload;
use crate::types::Sge;
use std::net::{IpAddr, Ipv6Addr};

/// The abstract socket name of the engine serving address `ip` (per network namespace: the
/// kernel keeps abstract names apart by namespace, so each namespace is a host).
pub(crate) fn engine_name(ip: IpAddr) -> String {
    format!("softverbs-engine/{ip}")
}

/// The engine's shared word: non-zero while it sleeps (clients then ring its doorbell).
#[repr(C)]
pub(crate) struct EngineState {
    pub(crate) sleeping: std::sync::atomic::AtomicU32,
}

// SAFETY: repr(C), atomics only, valid when zero.
unsafe impl crate::device_memory::segment::ShmPlain for EngineState {}

/// An engine's reply to [`Ctl::Hello`]: where its doorbell is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Welcome {
    pub pid: u32,
    /// The write end of the engine's doorbell and the word that says it sleeps.
    pub bell_fd: i32,
    pub bell_ino: u64,
    pub state_fd: i32,
    pub state_ino: u64,
}

/// How an RC/UC QP is connected, and a UD QP's receive side (what RTR sets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rtr {
    pub qp_type: u8,
    /// The local address the QP's packets leave from (its `sgid_index`).
    pub src: IpAddr,
    /// RC/UC: the peer's address and QP.
    pub peer: IpAddr,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub pmtu: u32,
    pub min_rnr_timer: u8,
    pub max_dest_rd_atomic: u8,
    /// `QpAccess` bits of the roce core: write 1, read 2, atomic 4.
    pub access: u8,
    pub qkey: u32,
    pub pkey: u16,
    pub sq_sig_all: bool,
}

/// What RTS adds (the requester's side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rts {
    pub sq_psn: u32,
    /// `QpAccess` bits, as in [`Rtr`] (they may change while established).
    pub access: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub max_rd_atomic: u8,
}

/// A message from a process to its engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ctl {
    /// The first message of a connection.
    Hello {
        pid: u32,
    },
    /// Serve QP `qpn` of this process (found in the host's directory); its send ring is
    /// named in its context.
    Open {
        qpn: u32,
    },
    Rtr {
        qpn: u32,
        rtr: Rtr,
    },
    Rts {
        qpn: u32,
        rts: Rts,
    },
    /// The program moved the QP to ERR: flush what the engine holds.
    Error {
        qpn: u32,
    },
    /// The QP is destroyed (or reset).
    Close {
        qpn: u32,
    },
    /// UD multicast: attach QP `qpn` to (or, `join` false, detach it from) the IP multicast
    /// group `group`.
    Group {
        qpn: u32,
        group: IpAddr,
        join: bool,
    },
    /// `softverbs nic`: the engine answers with its report, in text.
    Status,
    /// `softverbs nic --capture FILE`: start (or, with an empty path, stop) a capture.
    Capture {
        path: String,
    },
}

/// A message from the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    Welcome(Welcome),
    Text(String),
}

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn ip(&mut self, a: IpAddr) -> &mut Self {
        let (v4, bytes) = match a {
            IpAddr::V4(v) => (1, v.to_ipv6_mapped().octets()),
            IpAddr::V6(v) => (0, v.octets()),
        };
        self.u8(v4);
        self.0.extend_from_slice(&bytes);
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
}

struct R<'a>(&'a [u8]);

impl R<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (a, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    fn ip(&mut self) -> Option<IpAddr> {
        let v4 = self.u8()?;
        let a = Ipv6Addr::from(self.take::<16>()?);
        match v4 {
            1 => a.to_ipv4_mapped().map(IpAddr::V4),
            0 => Some(IpAddr::V6(a)),
            _ => None,
        }
    }
    fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        if n > self.0.len() {
            return None;
        }
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8(s.to_vec()).ok()
    }
    fn done(&self) -> bool {
        self.0.is_empty()
    }
}

impl Ctl {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::with_capacity(64));
        match self {
            Ctl::Hello { pid } => w.u8(1).u32(*pid),
            Ctl::Open { qpn } => w.u8(2).u32(*qpn),
            Ctl::Rtr { qpn, rtr: r } => w
                .u8(3)
                .u32(*qpn)
                .u8(r.qp_type)
                .ip(r.src)
                .ip(r.peer)
                .u32(r.dest_qpn)
                .u32(r.rq_psn)
                .u32(r.pmtu)
                .u8(r.min_rnr_timer)
                .u8(r.max_dest_rd_atomic)
                .u8(r.access)
                .u32(r.qkey)
                .u16(r.pkey)
                .u8(u8::from(r.sq_sig_all)),
            Ctl::Rts { qpn, rts: r } => w
                .u8(4)
                .u32(*qpn)
                .u32(r.sq_psn)
                .u8(r.access)
                .u8(r.timeout)
                .u8(r.retry_cnt)
                .u8(r.rnr_retry)
                .u8(r.max_rd_atomic),
            Ctl::Error { qpn } => w.u8(5).u32(*qpn),
            Ctl::Close { qpn } => w.u8(6).u32(*qpn),
            Ctl::Status => w.u8(7),
            Ctl::Capture { path } => w.u8(8).bytes(path.as_bytes()),
            Ctl::Group { qpn, group, join } => w.u8(9).u32(*qpn).ip(*group).u8(u8::from(*join)),
        };
        w.0
    }

    /// `None` for anything malformed.
    pub(crate) fn decode(b: &[u8]) -> Option<Ctl> {
        let mut r = R(b);
        let m = match r.u8()? {
            1 => Ctl::Hello { pid: r.u32()? },
            2 => Ctl::Open { qpn: r.u32()? },
            3 => Ctl::Rtr {
                qpn: r.u32()?,
                rtr: Rtr {
                    qp_type: r.u8()?,
                    src: r.ip()?,
                    peer: r.ip()?,
                    dest_qpn: r.u32()?,
                    rq_psn: r.u32()?,
                    pmtu: r.u32()?,
                    min_rnr_timer: r.u8()?,
                    max_dest_rd_atomic: r.u8()?,
                    access: r.u8()?,
                    qkey: r.u32()?,
                    pkey: r.u16()?,
                    sq_sig_all: r.u8()? != 0,
                },
            },
            4 => Ctl::Rts {
                qpn: r.u32()?,
                rts: Rts {
                    sq_psn: r.u32()?,
                    access: r.u8()?,
                    timeout: r.u8()?,
                    retry_cnt: r.u8()?,
                    rnr_retry: r.u8()?,
                    max_rd_atomic: r.u8()?,
                },
            },
            5 => Ctl::Error { qpn: r.u32()? },
            6 => Ctl::Close { qpn: r.u32()? },
            7 => Ctl::Status,
            8 => Ctl::Capture { path: r.string()? },
            9 => Ctl::Group {
                qpn: r.u32()?,
                group: r.ip()?,
                join: r.u8()? != 0,
            },
            _ => return None,
        };
        r.done().then_some(m)
    }
}

impl Reply {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::new());
        match self {
            Reply::Welcome(x) => w
                .u8(0x81)
                .u32(x.pid)
                .u32(x.bell_fd as u32)
                .u64(x.bell_ino)
                .u32(x.state_fd as u32)
                .u64(x.state_ino),
            Reply::Text(t) => w.u8(0x82).bytes(t.as_bytes()),
        };
        w.0
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Reply> {
        let mut r = R(b);
        let m = match r.u8()? {
            0x81 => Reply::Welcome(Welcome {
                pid: r.u32()?,
                bell_fd: r.u32()? as i32,
                bell_ino: r.u64()?,
                state_fd: r.u32()? as i32,
                state_ino: r.u64()?,
            }),
            0x82 => Reply::Text(r.string()?),
            _ => return None,
        };
        r.done().then_some(m)
    }
}

/// `NetWqe::flags` bits.
pub(crate) const WQE_SIGNALED: u8 = 1;
pub(crate) const WQE_SOLICITED: u8 = 2;
pub(crate) const WQE_FENCE: u8 = 4;
pub(crate) const WQE_INLINE: u8 = 8;

/// A send WQE in a networked QP's send ring, followed by `count` SGEs or, with
/// [`WQE_INLINE`], `len` bytes of inline data in 16-byte chunks.
///
/// A memory-window bind (`IBV_WR_BIND_MW`, which the engine executes against the owner's key
/// table) carries the range in `remote_addr` and `compare_add` (length), the new rkey in
/// `rkey`, the region's lkey in `imm`, and the window and its rights in `swap` (window
/// `<< 32 | access`); a local invalidation (and a SEND with Invalidate) its rkey in `rkey`;
/// a FLUSH its length in `compare_add` and its whole-region flag in `swap`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct NetWqe {
    pub wr_id: u64,
    pub remote_addr: u64,
    /// Compare (CmpSwap) or add (FetchAdd) operand.
    pub compare_add: u64,
    pub swap: u64,
    /// The WQE's number in its send queue (what its completion frees).
    pub seq: u32,
    pub rkey: u32,
    pub imm: u32,
    /// UD: the destination QP, Q_Key and address.
    pub ud_qpn: u32,
    pub ud_qkey: u32,
    /// SGEs, or inline bytes.
    pub count: u32,
    pub ud_dst: [u8; 16],
    /// `WrOpcode` value.
    pub opcode: u8,
    pub flags: u8,
    pub _pad: [u8; 2],
    /// XRC initiators: the SRQ the message is for.
    pub xrc_srqn: u32,
}

// SAFETY: repr(C) integers and byte arrays; any bit pattern is a value.
unsafe impl SlotPayload for NetWqe {}

/// 16 bytes of inline data, the size of an SGE, so a slot holds either.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Chunk(pub [u8; 16]);

// SAFETY: a byte array.
unsafe impl SlotPayload for Chunk {}

const _: () = assert!(std::mem::size_of::<Chunk>() == std::mem::size_of::<Sge>());

/// Slot bytes a send ring needs for WQEs of up to `max_sge` SGEs or `max_inline` bytes.
pub(crate) fn slot_bytes(max_sge: u32, max_inline: u32) -> usize {
    let items = (max_sge as usize)
        .max((max_inline as usize).div_ceil(16))
        .max(1);
    std::mem::size_of::<NetWqe>().next_multiple_of(8) + items * 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_survive_the_trip_and_garbage_is_refused() {
        let msgs = [
            Ctl::Hello { pid: 7 },
            Ctl::Open { qpn: 0x12345 },
            Ctl::Rtr {
                qpn: 3,
                rtr: Rtr {
                    qp_type: 2,
                    src: "10.0.0.1".parse().unwrap(),
                    peer: "fd00::2".parse().unwrap(),
                    dest_qpn: 9,
                    rq_psn: 0xabcdef,
                    pmtu: 1024,
                    min_rnr_timer: 12,
                    max_dest_rd_atomic: 16,
                    access: 7,
                    qkey: 0x1111,
                    pkey: 0xffff,
                    sq_sig_all: true,
                },
            },
            Ctl::Rts {
                qpn: 3,
                rts: Rts {
                    sq_psn: 5,
                    access: 3,
                    timeout: 14,
                    retry_cnt: 7,
                    rnr_retry: 7,
                    max_rd_atomic: 16,
                },
            },
            Ctl::Error { qpn: 1 },
            Ctl::Close { qpn: 1 },
            Ctl::Status,
            Ctl::Capture {
                path: "/tmp/x.pcap".into(),
            },
            Ctl::Group {
                qpn: 4,
                group: "239.1.2.3".parse().unwrap(),
                join: true,
            },
        ];
        for m in msgs {
            let b = m.encode();
            assert_eq!(Ctl::decode(&b), Some(m.clone()));
            for cut in 0..b.len() {
                assert_eq!(Ctl::decode(&b[..cut]), None, "{m:?} cut at {cut}");
            }
            let mut long = b.clone();
            long.push(0);
            assert_eq!(Ctl::decode(&long), None);
        }
        assert_eq!(Ctl::decode(&[99]), None);
        let w = Reply::Welcome(Welcome {
            pid: 1,
            bell_fd: 4,
            bell_ino: 5,
            state_fd: 6,
            state_ino: 7,
        });
        assert_eq!(Reply::decode(&w.encode()), Some(w));
        let t = Reply::Text("hi".into());
        assert_eq!(Reply::decode(&t.encode()), Some(t));
    }
}
