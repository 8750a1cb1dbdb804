//! The IBTA communication-manager MADs (volume 1, chapter 12) that connections are made
//! with, and rdma_cm's IP header at the start of a REQ's or SIDR_REQ's private data.
//!
//! Pure byte work: [`Mad::parse`] reads any input without panicking and [`Mad::emit`]
//! writes the 256 bytes a host's CM sends. Fields are big-endian and numbered from the most
//! significant bit, as in the spec's tables; offsets below are from the end of the 24-byte
//! MAD header.

use std::net::IpAddr;

/// A MAD is 256 bytes on the GSI.
pub const MAD_LEN: usize = 256;
const HDR: usize = 24;
/// Management class of the communication manager.
pub const CLASS_CM: u8 = 0x07;
const CLASS_VERSION: u8 = 2;
const METHOD_SEND: u8 = 0x03;

/// Attribute IDs of the CM messages.
pub mod attr {
    pub const REQ: u16 = 0x0010;
    pub const MRA: u16 = 0x0011;
    pub const REJ: u16 = 0x0012;
    pub const REP: u16 = 0x0013;
    pub const RTU: u16 = 0x0014;
    pub const DREQ: u16 = 0x0015;
    pub const DREP: u16 = 0x0016;
    pub const SIDR_REQ: u16 = 0x0017;
    pub const SIDR_REP: u16 = 0x0018;
}

/// Private data room of each message.
pub const REQ_PRIVATE: usize = 92;
pub const REP_PRIVATE: usize = 196;
pub const REJ_PRIVATE: usize = 148;
pub const RTU_PRIVATE: usize = 224;
pub const DREQ_PRIVATE: usize = 220;
pub const DREP_PRIVATE: usize = 224;
pub const MRA_PRIVATE: usize = 222;
pub const SIDR_REQ_PRIVATE: usize = 216;
pub const SIDR_REP_PRIVATE: usize = 136;

/// REJ reasons used here (table 109).
pub mod reason {
    /// No listener for the service ID.
    pub const INVALID_SERVICE_ID: u16 = 8;
    /// Stale connection: the REQ's QPN or comm ID is already in use.
    pub const STALE_CONN: u16 = 10;
    /// Timeout (the REP was never answered).
    pub const TIMEOUT: u16 = 1;
    /// The application refused (`rdma_reject`).
    pub const CONSUMER: u16 = 28;
}

/// The transport a REQ asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Rc,
    Uc,
}

/// The primary path of a REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Path {
    pub local_gid: [u8; 16],
    pub remote_gid: [u8; 16],
    pub flow_label: u32,
    pub packet_rate: u8,
    pub traffic_class: u8,
    pub hop_limit: u8,
    pub sl: u8,
    pub local_ack_timeout: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Req {
    pub local_comm_id: u32,
    pub service_id: u64,
    pub local_ca_guid: u64,
    pub local_qkey: u32,
    pub local_qpn: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub remote_cm_response_timeout: u8,
    pub transport: Transport,
    pub flow_control: bool,
    pub starting_psn: u32,
    pub local_cm_response_timeout: u8,
    pub retry_count: u8,
    pub pkey: u16,
    /// IB MTU enum (1 = 256 … 5 = 4096).
    pub mtu: u8,
    pub rnr_retry_count: u8,
    pub max_cm_retries: u8,
    pub srq: bool,
    pub primary: Path,
    pub private_data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rep {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub local_qkey: u32,
    pub local_qpn: u32,
    pub starting_psn: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub target_ack_delay: u8,
    pub flow_control: bool,
    pub rnr_retry_count: u8,
    pub srq: bool,
    pub local_ca_guid: u64,
    pub private_data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rej {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    /// 0: the REQ, 1: the REP, 2: other.
    pub message_rejected: u8,
    pub reason: u16,
    pub private_data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mra {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub message_mraed: u8,
    pub service_timeout: u8,
}

/// RTU, DREP: two comm IDs and private data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub private_data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dreq {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub remote_qpn: u32,
    pub private_data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrReq {
    pub request_id: u32,
    pub pkey: u16,
    pub service_id: u64,
    pub private_data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrRep {
    pub request_id: u32,
    /// 0: QP valid, 1: service ID not supported, 2: rejected by the service.
    pub status: u8,
    pub qpn: u32,
    pub service_id: u64,
    pub qkey: u32,
    pub private_data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Req(Req),
    Mra(Mra),
    Rej(Rej),
    Rep(Rep),
    Rtu(Ids),
    Dreq(Dreq),
    Drep(Ids),
    SidrReq(SidrReq),
    SidrRep(SidrRep),
}

/// One CM MAD: the transaction ID and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mad {
    pub tid: u64,
    pub msg: Msg,
}

/// Why bytes are no CM MAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MadError {
    Short,
    NotCm,
    UnknownAttribute(u16),
}

fn get16(d: &[u8], o: usize) -> u16 {
    u16::from_be_bytes([d[o], d[o + 1]])
}
fn get24(d: &[u8], o: usize) -> u32 {
    u32::from_be_bytes([0, d[o], d[o + 1], d[o + 2]])
}
fn get32(d: &[u8], o: usize) -> u32 {
    u32::from_be_bytes([d[o], d[o + 1], d[o + 2], d[o + 3]])
}
fn get64(d: &[u8], o: usize) -> u64 {
    u64::from_be_bytes(arr(d, o))
}
/// The `N` bytes at `o` (callers stay inside the length-checked MAD).
fn arr<const N: usize>(d: &[u8], o: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&d[o..o + N]);
    a
}
fn put16(d: &mut [u8], o: usize, v: u16) {
    d[o..o + 2].copy_from_slice(&v.to_be_bytes());
}
fn put24(d: &mut [u8], o: usize, v: u32) {
    d[o..o + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}
fn put32(d: &mut [u8], o: usize, v: u32) {
    d[o..o + 4].copy_from_slice(&v.to_be_bytes());
}
fn put64(d: &mut [u8], o: usize, v: u64) {
    d[o..o + 8].copy_from_slice(&v.to_be_bytes());
}
/// Copies `data` into the private-data field at `o` of `room` bytes (the rest stays zero).
fn put_private(d: &mut [u8], o: usize, room: usize, data: &[u8]) {
    let n = data.len().min(room);
    d[o..o + n].copy_from_slice(&data[..n]);
}

impl Mad {
    /// The attribute ID of this message.
    pub fn attr_id(&self) -> u16 {
        match &self.msg {
            Msg::Req(_) => attr::REQ,
            Msg::Mra(_) => attr::MRA,
            Msg::Rej(_) => attr::REJ,
            Msg::Rep(_) => attr::REP,
            Msg::Rtu(_) => attr::RTU,
            Msg::Dreq(_) => attr::DREQ,
            Msg::Drep(_) => attr::DREP,
            Msg::SidrReq(_) => attr::SIDR_REQ,
            Msg::SidrRep(_) => attr::SIDR_REP,
        }
    }

    /// The 256 bytes of this MAD. Private data longer than its field is cut.
    pub fn emit(&self) -> [u8; MAD_LEN] {
        let mut m = [0u8; MAD_LEN];
        m[0] = 1;
        m[1] = CLASS_CM;
        m[2] = CLASS_VERSION;
        m[3] = METHOD_SEND;
        put64(&mut m, 8, self.tid);
        put16(&mut m, 16, self.attr_id());
        let d = &mut m[HDR..];
        match &self.msg {
            Msg::Req(r) => {
                put32(d, 0, r.local_comm_id);
                put64(d, 8, r.service_id);
                put64(d, 16, r.local_ca_guid);
                put32(d, 28, r.local_qkey);
                put24(d, 32, r.local_qpn);
                d[35] = r.responder_resources;
                d[39] = r.initiator_depth;
                let ts = match r.transport {
                    Transport::Rc => 0,
                    Transport::Uc => 1,
                };
                d[43] =
                    (r.remote_cm_response_timeout & 0x1f) << 3 | ts << 1 | u8::from(r.flow_control);
                put24(d, 44, r.starting_psn);
                d[47] = (r.local_cm_response_timeout & 0x1f) << 3 | (r.retry_count & 7);
                put16(d, 48, r.pkey);
                d[50] = (r.mtu & 0xf) << 4 | (r.rnr_retry_count & 7);
                d[51] = (r.max_cm_retries & 0xf) << 4 | u8::from(r.srq) << 3;
                // RoCE: the permissive LID on both ends.
                put16(d, 52, 0xffff);
                put16(d, 54, 0xffff);
                let p = &r.primary;
                d[56..72].copy_from_slice(&p.local_gid);
                d[72..88].copy_from_slice(&p.remote_gid);
                put32(d, 88, (p.flow_label & 0xf_ffff) << 12);
                d[91] = p.packet_rate & 0x3f;
                d[92] = p.traffic_class;
                d[93] = p.hop_limit;
                d[94] = (p.sl & 0xf) << 4;
                d[95] = (p.local_ack_timeout & 0x1f) << 3;
                put_private(d, 140, REQ_PRIVATE, &r.private_data);
            }
            Msg::Mra(r) => {
                put32(d, 0, r.local_comm_id);
                put32(d, 4, r.remote_comm_id);
                d[8] = (r.message_mraed & 3) << 6;
                d[9] = (r.service_timeout & 0x1f) << 3;
            }
            Msg::Rej(r) => {
                put32(d, 0, r.local_comm_id);
                put32(d, 4, r.remote_comm_id);
                d[8] = (r.message_rejected & 3) << 6;
                put16(d, 10, r.reason);
                put_private(d, 84, REJ_PRIVATE, &r.private_data);
            }
            Msg::Rep(r) => {
                put32(d, 0, r.local_comm_id);
                put32(d, 4, r.remote_comm_id);
                put32(d, 8, r.local_qkey);
                put24(d, 12, r.local_qpn);
                put24(d, 20, r.starting_psn);
                d[24] = r.responder_resources;
                d[25] = r.initiator_depth;
                d[26] = (r.target_ack_delay & 0x1f) << 3 | u8::from(r.flow_control);
                d[27] = (r.rnr_retry_count & 7) << 5 | u8::from(r.srq) << 4;
                put64(d, 28, r.local_ca_guid);
                put_private(d, 36, REP_PRIVATE, &r.private_data);
            }
            Msg::Rtu(r) | Msg::Drep(r) => {
                put32(d, 0, r.local_comm_id);
                put32(d, 4, r.remote_comm_id);
                put_private(d, 8, RTU_PRIVATE, &r.private_data);
            }
            Msg::Dreq(r) => {
                put32(d, 0, r.local_comm_id);
                put32(d, 4, r.remote_comm_id);
                put24(d, 8, r.remote_qpn);
                put_private(d, 12, DREQ_PRIVATE, &r.private_data);
            }
            Msg::SidrReq(r) => {
                put32(d, 0, r.request_id);
                put16(d, 4, r.pkey);
                put64(d, 8, r.service_id);
                put_private(d, 16, SIDR_REQ_PRIVATE, &r.private_data);
            }
            Msg::SidrRep(r) => {
                put32(d, 0, r.request_id);
                d[4] = r.status;
                put24(d, 8, r.qpn);
                put64(d, 12, r.service_id);
                put32(d, 20, r.qkey);
                put_private(d, 96, SIDR_REP_PRIVATE, &r.private_data);
            }
        }
        m
    }

    /// Reads a CM MAD; anything else (short, another class, an attribute this CM does not
    /// handle) is an error, never a panic.
    pub fn parse(m: &[u8]) -> Result<Mad, MadError> {
        if m.len() < MAD_LEN {
            return Err(MadError::Short);
        }
        if m[0] != 1 || m[1] != CLASS_CM || m[2] != CLASS_VERSION {
            return Err(MadError::NotCm);
        }
        let tid = get64(m, 8);
        let id = get16(m, 16);
        let d = &m[HDR..MAD_LEN];
        let private = |o: usize, n: usize| d[o..o + n].to_vec();
        let msg = match id {
            attr::REQ => Msg::Req(Req {
                local_comm_id: get32(d, 0),
                service_id: get64(d, 8),
                local_ca_guid: get64(d, 16),
                local_qkey: get32(d, 28),
                local_qpn: get24(d, 32),
                responder_resources: d[35],
                initiator_depth: d[39],
                remote_cm_response_timeout: d[43] >> 3,
                transport: if (d[43] >> 1) & 3 == 1 {
                    Transport::Uc
                } else {
                    Transport::Rc
                },
                flow_control: d[43] & 1 != 0,
                starting_psn: get24(d, 44),
                local_cm_response_timeout: d[47] >> 3,
                retry_count: d[47] & 7,
                pkey: get16(d, 48),
                mtu: d[50] >> 4,
                rnr_retry_count: d[50] & 7,
                max_cm_retries: d[51] >> 4,
                srq: d[51] & 8 != 0,
                primary: Path {
                    local_gid: arr(d, 56),
                    remote_gid: arr(d, 72),
                    flow_label: get32(d, 88) >> 12,
                    packet_rate: d[91] & 0x3f,
                    traffic_class: d[92],
                    hop_limit: d[93],
                    sl: d[94] >> 4,
                    local_ack_timeout: d[95] >> 3,
                },
                private_data: private(140, REQ_PRIVATE),
            }),
            attr::MRA => Msg::Mra(Mra {
                local_comm_id: get32(d, 0),
                remote_comm_id: get32(d, 4),
                message_mraed: d[8] >> 6,
                service_timeout: d[9] >> 3,
            }),
            attr::REJ => Msg::Rej(Rej {
                local_comm_id: get32(d, 0),
                remote_comm_id: get32(d, 4),
                message_rejected: d[8] >> 6,
                reason: get16(d, 10),
                private_data: private(84, REJ_PRIVATE),
            }),
            attr::REP => Msg::Rep(Rep {
                local_comm_id: get32(d, 0),
                remote_comm_id: get32(d, 4),
                local_qkey: get32(d, 8),
                local_qpn: get24(d, 12),
                starting_psn: get24(d, 20),
                responder_resources: d[24],
                initiator_depth: d[25],
                target_ack_delay: d[26] >> 3,
                flow_control: d[26] & 1 != 0,
                rnr_retry_count: d[27] >> 5,
                srq: d[27] & 0x10 != 0,
                local_ca_guid: get64(d, 28),
                private_data: private(36, REP_PRIVATE),
            }),
            attr::RTU | attr::DREP => {
                let ids = Ids {
                    local_comm_id: get32(d, 0),
                    remote_comm_id: get32(d, 4),
                    private_data: private(8, RTU_PRIVATE),
                };
                if id == attr::RTU {
                    Msg::Rtu(ids)
                } else {
                    Msg::Drep(ids)
                }
            }
            attr::DREQ => Msg::Dreq(Dreq {
                local_comm_id: get32(d, 0),
                remote_comm_id: get32(d, 4),
                remote_qpn: get24(d, 8),
                private_data: private(12, DREQ_PRIVATE),
            }),
            attr::SIDR_REQ => Msg::SidrReq(SidrReq {
                request_id: get32(d, 0),
                pkey: get16(d, 4),
                service_id: get64(d, 8),
                private_data: private(16, SIDR_REQ_PRIVATE),
            }),
            attr::SIDR_REP => Msg::SidrRep(SidrRep {
                request_id: get32(d, 0),
                status: d[4],
                qpn: get24(d, 8),
                service_id: get64(d, 12),
                qkey: get32(d, 20),
                private_data: private(96, SIDR_REP_PRIVATE),
            }),
            other => return Err(MadError::UnknownAttribute(other)),
        };
        Ok(Mad { tid, msg })
    }
}

/// rdma_cm's header at the start of a REQ's or SIDR_REQ's private data: the IP addresses
/// and source port of the connection (`struct cma_hdr`, 36 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpHeader {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub src_port: u16,
}

impl IpHeader {
    pub const LEN: usize = 36;

    pub fn emit(&self) -> [u8; IpHeader::LEN] {
        let mut b = [0u8; IpHeader::LEN];
        // cma_version 0; the IP version in the high nibble.
        b[1] = if self.src.is_ipv4() { 4 << 4 } else { 6 << 4 };
        put16(&mut b, 2, self.src_port);
        for (o, a) in [(4, self.src), (20, self.dst)] {
            match a {
                IpAddr::V4(v4) => b[o + 12..o + 16].copy_from_slice(&v4.octets()),
                IpAddr::V6(v6) => b[o..o + 16].copy_from_slice(&v6.octets()),
            }
        }
        b
    }

    /// The header at the start of `p`; `None` if it is not one (another version, too short).
    pub fn parse(p: &[u8]) -> Option<IpHeader> {
        if p.len() < IpHeader::LEN || p[0] != 0 {
            return None;
        }
        let addr = |o: usize| -> Option<IpAddr> {
            let raw: [u8; 16] = p[o..o + 16].try_into().ok()?;
            match p[1] >> 4 {
                4 => Some(IpAddr::from(<[u8; 4]>::try_from(&raw[12..]).ok()?)),
                6 => Some(IpAddr::from(raw)),
                _ => None,
            }
        };
        Some(IpHeader {
            src: addr(4)?,
            dst: addr(20)?,
            src_port: get16(p, 2),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> Req {
        Req {
            local_comm_id: 0x1234_5678,
            service_id: 0x0000_0000_0106_4e20,
            local_ca_guid: 0x0250_56ff_fe00_0001,
            local_qkey: 0,
            local_qpn: 0xab_cdef,
            responder_resources: 4,
            initiator_depth: 3,
            remote_cm_response_timeout: 20,
            transport: Transport::Rc,
            flow_control: true,
            starting_psn: 0x12_3456,
            local_cm_response_timeout: 18,
            retry_count: 7,
            pkey: 0xffff,
            mtu: 3,
            rnr_retry_count: 6,
            max_cm_retries: 15,
            srq: true,
            primary: Path {
                local_gid: [1; 16],
                remote_gid: [2; 16],
                flow_label: 0xf_ffff,
                packet_rate: 0x3f,
                traffic_class: 0x20,
                hop_limit: 64,
                sl: 3,
                local_ack_timeout: 14,
            },
            private_data: vec![7; REQ_PRIVATE],
        }
    }

    #[test]
    fn every_message_survives_emit_and_parse() {
        let msgs = vec![
            Msg::Req(req()),
            Msg::Req(Req {
                transport: Transport::Uc,
                flow_control: false,
                srq: false,
                ..req()
            }),
            Msg::Mra(Mra {
                local_comm_id: 1,
                remote_comm_id: 2,
                message_mraed: 1,
                service_timeout: 31,
            }),
            Msg::Rej(Rej {
                local_comm_id: 3,
                remote_comm_id: 4,
                message_rejected: 0,
                reason: reason::CONSUMER,
                private_data: vec![9; REJ_PRIVATE],
            }),
            Msg::Rep(Rep {
                local_comm_id: 5,
                remote_comm_id: 6,
                local_qkey: 0x0123_4567,
                local_qpn: 0x12_3456,
                starting_psn: 0xff_fffe,
                responder_resources: 1,
                initiator_depth: 2,
                target_ack_delay: 17,
                flow_control: true,
                rnr_retry_count: 7,
                srq: true,
                local_ca_guid: 42,
                private_data: vec![3; REP_PRIVATE],
            }),
            Msg::Rtu(Ids {
                local_comm_id: 7,
                remote_comm_id: 8,
                private_data: vec![4; RTU_PRIVATE],
            }),
            Msg::Dreq(Dreq {
                local_comm_id: 9,
                remote_comm_id: 10,
                remote_qpn: 0x77_7777,
                private_data: vec![5; DREQ_PRIVATE],
            }),
            Msg::Drep(Ids {
                local_comm_id: 11,
                remote_comm_id: 12,
                private_data: vec![6; DREP_PRIVATE],
            }),
            Msg::SidrReq(SidrReq {
                request_id: 13,
                pkey: 0xffff,
                service_id: 0x0111_1234,
                private_data: vec![1; SIDR_REQ_PRIVATE],
            }),
            Msg::SidrRep(SidrRep {
                request_id: 14,
                status: 0,
                qpn: 0x33_3333,
                service_id: 0x0111_1234,
                qkey: 0x0123_4567,
                private_data: vec![2; SIDR_REP_PRIVATE],
            }),
        ];
        for (i, msg) in msgs.into_iter().enumerate() {
            let mad = Mad {
                tid: 0x1000 + i as u64,
                msg,
            };
            let bytes = mad.emit();
            assert_eq!(Mad::parse(&bytes), Ok(mad.clone()), "message {i}");
        }
    }

    #[test]
    fn req_fields_sit_where_the_spec_puts_them() {
        let b = Mad {
            tid: 0x0102_0304_0506_0708,
            msg: Msg::Req(req()),
        }
        .emit();
        assert_eq!(&b[..4], &[1, CLASS_CM, 2, METHOD_SEND]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[16..18], &[0x00, 0x10]);
        let d = &b[HDR..];
        assert_eq!(&d[..4], &[0x12, 0x34, 0x56, 0x78]);
        assert_eq!(
            &d[32..36],
            &[0xab, 0xcd, 0xef, 4],
            "QPN then responder resources"
        );
        assert_eq!(d[43], 20 << 3 | 1, "timeout, RC, flow control");
        assert_eq!(d[47], 18 << 3 | 7, "local timeout, retry count");
        assert_eq!(d[50], 3 << 4 | 6, "MTU, RNR retry count");
        assert_eq!(d[51], 15 << 4 | 8, "max CM retries, SRQ");
        assert_eq!(
            &d[88..92],
            &[0xff, 0xff, 0xf0, 0x3f],
            "flow label, packet rate"
        );
        assert_eq!(d[140], 7, "private data");
    }

    #[test]
    fn short_or_foreign_input_is_an_error() {
        assert_eq!(Mad::parse(&[0; 10]), Err(MadError::Short));
        let mut b = [0u8; MAD_LEN];
        b[0] = 1;
        b[1] = 0x01;
        assert_eq!(Mad::parse(&b), Err(MadError::NotCm));
        b[1] = CLASS_CM;
        b[2] = 2;
        b[17] = 0x19;
        assert_eq!(Mad::parse(&b), Err(MadError::UnknownAttribute(0x19)));
        // Every byte value in every position of a REQ parses without panicking.
        let good = Mad {
            tid: 1,
            msg: Msg::Req(req()),
        }
        .emit();
        for i in 0..MAD_LEN {
            for v in [0u8, 0x55, 0xff] {
                let mut b = good;
                b[i] = v;
                let _ = Mad::parse(&b);
            }
        }
    }

    #[test]
    fn ip_header_round_trips_both_families() {
        for (src, dst) in [
            ("10.0.0.1", "10.0.0.2"),
            ("fe80::1", "2001:db8::5"),
            ("127.0.0.1", "127.0.0.1"),
        ] {
            let h = IpHeader {
                src: src.parse().unwrap(),
                dst: dst.parse().unwrap(),
                src_port: 40000,
            };
            let b = h.emit();
            assert_eq!(IpHeader::parse(&b), Some(h));
        }
        let v4 = IpHeader {
            src: "10.1.2.3".parse().unwrap(),
            dst: "10.1.2.4".parse().unwrap(),
            src_port: 7,
        }
        .emit();
        assert_eq!(v4[1], 0x40);
        assert_eq!(
            &v4[4..20],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10, 1, 2, 3]
        );
        assert_eq!(IpHeader::parse(&[1; 36]), None);
        assert_eq!(IpHeader::parse(&[0; 10]), None);
    }
}
