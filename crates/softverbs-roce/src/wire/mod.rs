//! RoCEv2 on the wire: parse and emit on byte slices.
//!
//! A RoCEv2 packet is an IP datagram (IPv4 or IPv6) carrying UDP to port 4791, whose payload
//! is an InfiniBand transport packet: the base transport header ([`Bth`]), the extension
//! headers its opcode calls for ([`Reth`], [`Aeth`], [`AtomicEth`], [`AtomicAckEth`],
//! [`Deth`], immediate data, the invalidated key), the payload padded to four bytes, and the
//! invariant CRC ([`icrc`]) over all of it with the fields routers may change masked.
//!
//! Each header is a plain representation (`*Repr` or a struct of its fields) with `parse`,
//! which checks lengths and fields and never panics, and `emit` into a caller's buffer.
//! [`Headers`] is everything between UDP and the payload for one opcode; [`Datagram`] is a
//! whole packet, IP header to ICRC:
//!
//! ```
//! use softverbs_roce::wire::*;
//! use std::net::Ipv4Addr;
//!
//! let ip = IpRepr::V4(Ipv4Repr::new(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)));
//! let headers = Headers::new(Bth::new(Opcode::RC_SEND_ONLY, 0x11, Psn::new(7)));
//! let mut buf = [0u8; 128];
//! let n = emit_datagram(&ip, 0xc000, &headers, b"hello", &mut buf)?;
//! let d = Datagram::parse(&buf[..n])?;
//! assert_eq!((d.headers.bth.dest_qp, d.payload), (0x11, &b"hello"[..]));
//! # Ok::<(), WireError>(())
//! ```

mod bth;
mod ext;
pub mod icrc;
mod ip;
mod opcode;
mod packet;
mod udp;

pub use bth::{Bth, Psn};
pub use ext::{Aeth, AethKind, AtomicAckEth, AtomicEth, Deth, NakCode, Reth};
pub use ip::{IpRepr, Ipv4Repr, Ipv6Repr};
pub use opcode::{Op, Opcode, Transport};
pub use packet::{Datagram, Headers, emit_datagram, emit_datagram_around};
pub use udp::UdpRepr;

/// The UDP destination port of RoCEv2.
pub const ROCE_PORT: u16 = 4791;
/// Length of the invariant CRC that ends every packet.
pub const ICRC_LEN: usize = 4;
/// The GRH room at the start of a UD receive buffer (`sizeof(struct ibv_grh)`).
pub const GRH_LEN: usize = 40;

/// What is wrong with a packet (or with a request to emit one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("truncated {what}: {need} bytes needed, {have} there")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("IP version {0} (neither 4 nor 6)")]
    IpVersion(u8),
    #[error("IPv4 header length {0} bytes")]
    Ipv4HeaderLength(usize),
    #[error("IPv4 header checksum does not match")]
    Ipv4Checksum,
    #[error("IPv4 fragment (RoCEv2 packets are never fragmented)")]
    Fragment,
    #[error("IP length field says {field} bytes, the datagram has {actual}")]
    IpLength { field: usize, actual: usize },
    #[error("IP protocol {0}, not UDP")]
    NotUdp(u8),
    #[error("UDP destination port {0}, not 4791")]
    NotRoce(u16),
    #[error("UDP length field says {field} bytes, the IP payload has {actual}")]
    UdpLength { field: usize, actual: usize },
    #[error("UDP checksum does not match")]
    UdpChecksum,
    #[error("opcode {0:#04x} is not one the verbs produce on RC, UC or UD")]
    Opcode(u8),
    #[error("BTH transport header version {0} (only 0 exists)")]
    Version(u8),
    #[error("{0} bytes after the headers: payload and pad must be a multiple of four")]
    Unaligned(usize),
    #[error("pad count {pad} with {len} bytes of payload and pad")]
    Pad { pad: u8, len: usize },
    #[error("opcode {opcode:#04x} carries no payload, the packet has {len} bytes")]
    UnexpectedPayload { opcode: u8, len: usize },
    #[error("invariant CRC {got:#010x}, computed {computed:#010x}")]
    Icrc { got: u32, computed: u32 },
    #[error("{0} does not match the opcode's headers")]
    HeaderMismatch(&'static str),
    #[error("{what} out of range: {value}")]
    Range { what: &'static str, value: u64 },
    #[error("buffer of {have} bytes, {need} needed")]
    BufferTooSmall { need: usize, have: usize },
}

/// `bytes[at..at + n]`, or the truncation error naming `what`.
fn take<'a>(
    bytes: &'a [u8],
    at: usize,
    n: usize,
    what: &'static str,
) -> Result<&'a [u8], WireError> {
    at.checked_add(n)
        .and_then(|end| bytes.get(at..end))
        .ok_or(WireError::Truncated {
            what,
            need: at.saturating_add(n),
            have: bytes.len(),
        })
}

/// `buf[at..at + n]` to write into, or `BufferTooSmall`.
fn room(buf: &mut [u8], at: usize, n: usize) -> Result<&mut [u8], WireError> {
    let have = buf.len();
    at.checked_add(n)
        .and_then(|end| buf.get_mut(at..end))
        .ok_or(WireError::BufferTooSmall {
            need: at.saturating_add(n),
            have,
        })
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// Checks that `value` fits in `bits` bits.
fn bits(what: &'static str, value: u64, bits: u32) -> Result<(), WireError> {
    if bits < 64 && value >> bits != 0 {
        return Err(WireError::Range { what, value });
    }
    Ok(())
}

/// The Internet checksum (RFC 1071) of `parts` taken as one byte string.
///
/// Summed four bytes at a time: the one's complement sum of 16-bit words is the sum of
/// 32-bit words folded (2^16 = 1 modulo 2^16 - 1), and a u64 holds 2^32 of them.
fn inet_checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u64 = 0;
    // The byte left over from a part of odd length: the high half of the next word.
    let mut odd: Option<u8> = None;
    for part in parts {
        let mut p = *part;
        if let Some(hi) = odd.take() {
            match p.split_first() {
                Some((&lo, rest)) => {
                    sum += u64::from(u16::from_be_bytes([hi, lo]));
                    p = rest;
                }
                None => {
                    odd = Some(hi);
                    continue;
                }
            }
        }
        let mut words = p.chunks_exact(4);
        for w in &mut words {
            sum += u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
        }
        match *words.remainder() {
            [a, b, c] => {
                sum += u64::from(u16::from_be_bytes([a, b]));
                odd = Some(c);
            }
            [a, b] => sum += u64::from(u16::from_be_bytes([a, b])),
            [a] => odd = Some(a),
            _ => {}
        }
    }
    if let Some(hi) = odd {
        sum += u64::from(u16::from_be_bytes([hi, 0]));
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod checksum_tests {
    use super::inet_checksum;
    use proptest::prelude::*;

    /// RFC 1071 as written: 16-bit words of the bytes taken as one string.
    fn by_words(parts: &[&[u8]]) -> u16 {
        let all: Vec<u8> = parts.concat();
        let mut sum: u64 = all
            .chunks(2)
            .map(|w| u64::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
            .sum();
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    proptest! {
        #[test]
        fn the_checksum_is_rfc_1071s_however_the_bytes_are_cut(
            a in proptest::collection::vec(any::<u8>(), 0..70),
            b in proptest::collection::vec(any::<u8>(), 0..70),
            c in proptest::collection::vec(any::<u8>(), 0..9),
        ) {
            prop_assert_eq!(inet_checksum(&[&a, &b, &c]), by_words(&[&a, &b, &c]));
            prop_assert_eq!(inet_checksum(&[&a]), by_words(&[&a]));
        }
    }
}
