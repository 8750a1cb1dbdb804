//! The UDP header.

use super::{IpRepr, WireError, be16, inet_checksum, room, take};

/// A UDP header. RoCEv2 sends to port 4791; the source port is the sender's flow entropy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpRepr {
    pub src_port: u16,
    pub dst_port: u16,
}

impl UdpRepr {
    pub const LEN: usize = 8;

    /// Parses the UDP datagram that is `ip`'s payload: the header and the UDP payload. A
    /// non-zero checksum is verified (zero means "none", which RoCEv2 senders use over IPv4).
    pub fn parse<'a>(ip: &IpRepr, bytes: &'a [u8]) -> Result<(UdpRepr, &'a [u8]), WireError> {
        let b = take(bytes, 0, UdpRepr::LEN, "UDP header")?;
        let len = usize::from(be16(&b[4..6]));
        if len != bytes.len() {
            return Err(WireError::UdpLength {
                field: len,
                actual: bytes.len(),
            });
        }
        if be16(&b[6..8]) != 0 {
            let (pseudo, n) = ip.pseudo_header(len);
            if inet_checksum(&[&pseudo[..n], bytes]) != 0 {
                return Err(WireError::UdpChecksum);
            }
        }
        let repr = UdpRepr {
            src_port: be16(&b[0..2]),
            dst_port: be16(&b[2..4]),
        };
        Ok((repr, &bytes[UdpRepr::LEN..]))
    }

    /// Emits the header in front of the `payload_len` bytes that follow it in `buf`
    /// (already written); with `checksum`, computes the checksum over them, else leaves 0.
    pub fn emit(
        &self,
        ip: &IpRepr,
        payload_len: usize,
        checksum: bool,
        buf: &mut [u8],
    ) -> Result<usize, WireError> {
        let len = UdpRepr::LEN + payload_len;
        let len16 = u16::try_from(len).map_err(|_| WireError::Range {
            what: "UDP length",
            value: len as u64,
        })?;
        let b = room(buf, 0, len)?;
        b[0..2].copy_from_slice(&self.src_port.to_be_bytes());
        b[2..4].copy_from_slice(&self.dst_port.to_be_bytes());
        b[4..6].copy_from_slice(&len16.to_be_bytes());
        b[6..8].fill(0);
        if checksum {
            let (pseudo, n) = ip.pseudo_header(len);
            // 0 means "no checksum", so a computed 0 is sent as its other form, 0xffff.
            let sum = match inet_checksum(&[&pseudo[..n], b]) {
                0 => 0xffff,
                s => s,
            };
            b[6..8].copy_from_slice(&sum.to_be_bytes());
        }
        Ok(UdpRepr::LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Ipv6Repr;

    #[test]
    fn checksummed_and_unchecksummed_datagrams_round_trip() {
        let ip = IpRepr::V6(Ipv6Repr::new(
            "2001:db8::1".parse().unwrap(),
            "2001:db8::2".parse().unwrap(),
        ));
        let udp = UdpRepr {
            src_port: 0xc001,
            dst_port: 4791,
        };
        for checksum in [false, true] {
            let mut b = [0u8; 13];
            b[8..].copy_from_slice(b"hello");
            assert_eq!(udp.emit(&ip, 5, checksum, &mut b), Ok(8));
            assert_eq!(b[6..8] != [0, 0], checksum);
            let (got, payload) = UdpRepr::parse(&ip, &b).unwrap();
            assert_eq!((got, payload), (udp, &b"hello"[..]));
            b[9] ^= 0x10;
            let corrupted = UdpRepr::parse(&ip, &b);
            if checksum {
                assert_eq!(corrupted.err(), Some(WireError::UdpChecksum));
            } else {
                assert!(corrupted.is_ok());
            }
        }
        let mut b = [0u8; 13];
        udp.emit(&ip, 5, false, &mut b).unwrap();
        assert!(matches!(
            UdpRepr::parse(&ip, &b[..12]),
            Err(WireError::UdpLength {
                field: 13,
                actual: 12
            })
        ));
    }
}
