//! IPv4 and IPv6 headers, as RoCEv2 uses them: UDP inside, never fragmented.

use super::{WireError, be16, inet_checksum, room, take};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The IP protocol number of UDP.
const UDP: u8 = 17;

/// An IPv4 header without options (options are accepted when parsing and skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Repr {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// DSCP and ECN (the former TOS byte).
    pub tos: u8,
    pub ttl: u8,
    pub ident: u16,
    /// Don't-fragment, which RoCE senders set.
    pub dont_frag: bool,
}

impl Ipv4Repr {
    pub const LEN: usize = 20;

    /// A header from `src` to `dst` with TTL 64, DF set, TOS 0.
    pub fn new(src: Ipv4Addr, dst: Ipv4Addr) -> Ipv4Repr {
        Ipv4Repr {
            src,
            dst,
            tos: 0,
            ttl: 64,
            ident: 0,
            dont_frag: true,
        }
    }

    /// The header and the bytes it carries (its total length says how many; bytes after that,
    /// such as link-layer padding, are ignored).
    fn parse(bytes: &[u8]) -> Result<(Ipv4Repr, &[u8], &[u8]), WireError> {
        let b = take(bytes, 0, Ipv4Repr::LEN, "IPv4 header")?;
        let ihl = usize::from(b[0] & 0x0f) * 4;
        if ihl < Ipv4Repr::LEN {
            return Err(WireError::Ipv4HeaderLength(ihl));
        }
        let header = take(bytes, 0, ihl, "IPv4 header")?;
        let total = usize::from(be16(&b[2..4]));
        if total < ihl || total > bytes.len() {
            return Err(WireError::IpLength {
                field: total,
                actual: bytes.len(),
            });
        }
        if inet_checksum(&[header]) != 0 {
            return Err(WireError::Ipv4Checksum);
        }
        let frag = be16(&b[6..8]);
        if frag & 0x3fff != 0 {
            return Err(WireError::Fragment);
        }
        if b[9] != UDP {
            return Err(WireError::NotUdp(b[9]));
        }
        let repr = Ipv4Repr {
            src: Ipv4Addr::new(b[12], b[13], b[14], b[15]),
            dst: Ipv4Addr::new(b[16], b[17], b[18], b[19]),
            tos: b[1],
            ttl: b[8],
            ident: be16(&b[4..6]),
            dont_frag: frag & 0x4000 != 0,
        };
        Ok((repr, header, &bytes[ihl..total]))
    }

    /// Rewrites the identification of the IPv4 header at the start of `header` (and its
    /// checksum); false if `header` holds no IPv4 header.
    pub fn set_ident(header: &mut [u8], ident: u16) -> bool {
        let ihl = match header.first() {
            Some(&b) if b >> 4 == 4 => usize::from(b & 0x0f) * 4,
            _ => return false,
        };
        let Some(h) = header.get_mut(..ihl).filter(|h| h.len() >= Ipv4Repr::LEN) else {
            return false;
        };
        h[4..6].copy_from_slice(&ident.to_be_bytes());
        h[10..12].fill(0);
        let sum = inet_checksum(&[h]);
        h[10..12].copy_from_slice(&sum.to_be_bytes());
        true
    }

    fn emit(&self, payload_len: usize, buf: &mut [u8]) -> Result<usize, WireError> {
        let total = Ipv4Repr::LEN + payload_len;
        let total16 = u16::try_from(total).map_err(|_| WireError::Range {
            what: "IPv4 total length",
            value: total as u64,
        })?;
        let b = room(buf, 0, Ipv4Repr::LEN)?;
        b[0] = 0x45;
        b[1] = self.tos;
        b[2..4].copy_from_slice(&total16.to_be_bytes());
        b[4..6].copy_from_slice(&self.ident.to_be_bytes());
        b[6..8].copy_from_slice(&(u16::from(self.dont_frag) << 14).to_be_bytes());
        b[8] = self.ttl;
        b[9] = UDP;
        b[10..12].fill(0);
        b[12..16].copy_from_slice(&self.src.octets());
        b[16..20].copy_from_slice(&self.dst.octets());
        let sum = inet_checksum(&[b]);
        b[10..12].copy_from_slice(&sum.to_be_bytes());
        Ok(Ipv4Repr::LEN)
    }
}

/// An IPv6 header with UDP as its next header (no extension headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Repr {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub traffic_class: u8,
    /// 20 bits.
    pub flow_label: u32,
    pub hop_limit: u8,
}

impl Ipv6Repr {
    pub const LEN: usize = 40;

    /// A header from `src` to `dst` with hop limit 64, traffic class and flow label 0.
    pub fn new(src: Ipv6Addr, dst: Ipv6Addr) -> Ipv6Repr {
        Ipv6Repr {
            src,
            dst,
            traffic_class: 0,
            flow_label: 0,
            hop_limit: 64,
        }
    }

    fn parse(bytes: &[u8]) -> Result<(Ipv6Repr, &[u8], &[u8]), WireError> {
        let b = take(bytes, 0, Ipv6Repr::LEN, "IPv6 header")?;
        let len = usize::from(be16(&b[4..6]));
        let end = Ipv6Repr::LEN + len;
        if end > bytes.len() {
            return Err(WireError::IpLength {
                field: end,
                actual: bytes.len(),
            });
        }
        if b[6] != UDP {
            return Err(WireError::NotUdp(b[6]));
        }
        let word = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let addr = |at: usize| {
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[at..at + 16]);
            Ipv6Addr::from(a)
        };
        let repr = Ipv6Repr {
            src: addr(8),
            dst: addr(24),
            traffic_class: (word >> 20) as u8,
            flow_label: word & 0xf_ffff,
            hop_limit: b[7],
        };
        Ok((repr, b, &bytes[Ipv6Repr::LEN..end]))
    }

    fn emit(&self, payload_len: usize, buf: &mut [u8]) -> Result<usize, WireError> {
        let len16 = u16::try_from(payload_len).map_err(|_| WireError::Range {
            what: "IPv6 payload length",
            value: payload_len as u64,
        })?;
        super::bits("IPv6 flow label", u64::from(self.flow_label), 20)?;
        let b = room(buf, 0, Ipv6Repr::LEN)?;
        let word = (6u32 << 28) | (u32::from(self.traffic_class) << 20) | self.flow_label;
        b[0..4].copy_from_slice(&word.to_be_bytes());
        b[4..6].copy_from_slice(&len16.to_be_bytes());
        b[6] = UDP;
        b[7] = self.hop_limit;
        b[8..24].copy_from_slice(&self.src.octets());
        b[24..40].copy_from_slice(&self.dst.octets());
        Ok(Ipv6Repr::LEN)
    }
}

/// An IPv4 or IPv6 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpRepr {
    V4(Ipv4Repr),
    V6(Ipv6Repr),
}

impl IpRepr {
    /// The header from `src` to `dst` (both of one family) with default fields.
    pub fn between(src: IpAddr, dst: IpAddr) -> Option<IpRepr> {
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => Some(IpRepr::V4(Ipv4Repr::new(s, d))),
            (IpAddr::V6(s), IpAddr::V6(d)) => Some(IpRepr::V6(Ipv6Repr::new(s, d))),
            _ => None,
        }
    }

    pub fn src(&self) -> IpAddr {
        match self {
            IpRepr::V4(h) => h.src.into(),
            IpRepr::V6(h) => h.src.into(),
        }
    }

    pub fn dst(&self) -> IpAddr {
        match self {
            IpRepr::V4(h) => h.dst.into(),
            IpRepr::V6(h) => h.dst.into(),
        }
    }

    /// Header bytes emitted.
    pub fn len(&self) -> usize {
        match self {
            IpRepr::V4(_) => Ipv4Repr::LEN,
            IpRepr::V6(_) => Ipv6Repr::LEN,
        }
    }

    /// Always false: a header has bytes.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Parses the IP header of a datagram: the header, its raw bytes, and the payload it
    /// carries.
    pub fn parse(bytes: &[u8]) -> Result<(IpRepr, &[u8], &[u8]), WireError> {
        match bytes.first().map(|b| b >> 4) {
            Some(4) => Ipv4Repr::parse(bytes).map(|(r, h, p)| (IpRepr::V4(r), h, p)),
            Some(6) => Ipv6Repr::parse(bytes).map(|(r, h, p)| (IpRepr::V6(r), h, p)),
            Some(v) => Err(WireError::IpVersion(v)),
            None => Err(WireError::Truncated {
                what: "IP header",
                need: 1,
                have: 0,
            }),
        }
    }

    /// Emits the header for `payload_len` bytes of payload; returns the header's length.
    pub fn emit(&self, payload_len: usize, buf: &mut [u8]) -> Result<usize, WireError> {
        match self {
            IpRepr::V4(h) => h.emit(payload_len, buf),
            IpRepr::V6(h) => h.emit(payload_len, buf),
        }
    }

    /// The pseudo-header the UDP checksum covers, for `udp_len` bytes of UDP.
    pub(super) fn pseudo_header(&self, udp_len: usize) -> ([u8; 40], usize) {
        let mut p = [0u8; 40];
        match self {
            IpRepr::V4(h) => {
                p[0..4].copy_from_slice(&h.src.octets());
                p[4..8].copy_from_slice(&h.dst.octets());
                p[9] = UDP;
                p[10..12].copy_from_slice(&(udp_len as u16).to_be_bytes());
                (p, 12)
            }
            IpRepr::V6(h) => {
                p[0..16].copy_from_slice(&h.src.octets());
                p[16..32].copy_from_slice(&h.dst.octets());
                p[32..36].copy_from_slice(&(udp_len as u32).to_be_bytes());
                p[39] = UDP;
                (p, 40)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4() -> IpRepr {
        let mut h = Ipv4Repr::new(Ipv4Addr::new(192, 168, 1, 2), Ipv4Addr::new(10, 0, 0, 1));
        h.tos = 0x02;
        h.ident = 0x1234;
        IpRepr::V4(h)
    }

    #[test]
    fn ipv4_round_trips_with_its_checksum() {
        let mut buf = [0u8; 28];
        assert_eq!(v4().emit(8, &mut buf), Ok(20));
        // The checksum of these fields, computed separately (RFC 1071, in Python).
        assert_eq!(&buf[10..12], &[0x5c, 0xf0]);
        let (repr, header, payload) = IpRepr::parse(&buf).unwrap();
        assert_eq!((repr, header.len(), payload.len()), (v4(), 20, 8));
        let mut bad = buf;
        bad[8] ^= 1;
        assert_eq!(IpRepr::parse(&bad).err(), Some(WireError::Ipv4Checksum));
    }

    #[test]
    fn ipv4_malformations_are_errors() {
        let mut buf = [0u8; 28];
        v4().emit(8, &mut buf).unwrap();
        let with = |f: &dyn Fn(&mut [u8; 28])| {
            let mut b = buf;
            f(&mut b);
            b[10] = 0;
            b[11] = 0;
            let sum = inet_checksum(&[&b[..20]]);
            b[10..12].copy_from_slice(&sum.to_be_bytes());
            IpRepr::parse(&b).err()
        };
        assert_eq!(
            with(&|b| b[0] = 0x44),
            Some(WireError::Ipv4HeaderLength(16))
        );
        assert_eq!(with(&|b| b[9] = 6), Some(WireError::NotUdp(6)));
        assert_eq!(with(&|b| b[6] = 0x20), Some(WireError::Fragment));
        assert_eq!(with(&|b| b[7] = 1), Some(WireError::Fragment));
        assert!(matches!(
            with(&|b| b[3] = 29),
            Some(WireError::IpLength { field: 29, .. })
        ));
        assert!(matches!(
            with(&|b| b[3] = 19),
            Some(WireError::IpLength { field: 19, .. })
        ));
        assert_eq!(IpRepr::parse(&[0x55]).err(), Some(WireError::IpVersion(5)));
        assert!(IpRepr::parse(&[]).is_err());
        for n in 0..20 {
            assert!(IpRepr::parse(&buf[..n]).is_err());
        }
    }

    #[test]
    fn ipv6_round_trips() {
        let mut h = Ipv6Repr::new("fe80::1".parse().unwrap(), "2001:db8::2".parse().unwrap());
        h.traffic_class = 0xa5;
        h.flow_label = 0xb_cdef;
        let ip = IpRepr::V6(h);
        let mut buf = [0u8; 48];
        assert_eq!(ip.emit(8, &mut buf), Ok(40));
        assert_eq!(&buf[0..4], &[0x6a, 0x5b, 0xcd, 0xef]);
        let (repr, header, payload) = IpRepr::parse(&buf).unwrap();
        assert_eq!((repr, header.len(), payload.len()), (ip, 40, 8));
        buf[6] = 0;
        assert_eq!(IpRepr::parse(&buf).err(), Some(WireError::NotUdp(0)));
        h.flow_label = 1 << 20;
        assert!(IpRepr::V6(h).emit(8, &mut buf).is_err());
    }
}
