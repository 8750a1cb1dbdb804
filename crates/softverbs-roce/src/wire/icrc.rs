//! The invariant CRC, as IBTA Annex A17 computes it for RoCEv2.
//!
//! A CRC-32 (the Ethernet polynomial, as zlib's `crc32`) over eight bytes of ones standing in
//! for the InfiniBand local route header, then the IP header, the UDP header, the BTH, the
//! extension headers, the payload and the pad, with every field a router may rewrite set to
//! ones: IPv4 TOS, TTL and header checksum; IPv6 traffic class, flow label and hop limit; the
//! UDP checksum; the BTH byte holding FECN, BECN and six reserved bits. It is sent after the
//! pad, least significant byte first.

use super::{Bth, UdpRepr};

/// The ICRC of a packet: `ip_header` and `udp_header` as they are on the wire, `transport`
/// from the BTH to the end of the pad (the ICRC itself excluded). Inputs shorter than a
/// header are taken as they are (a parser never calls it so).
pub fn compute(ip_header: &[u8], udp_header: &[u8], transport: &[u8]) -> u32 {
    // The masked headers are copied into one block and hashed in one go, then the rest in
    // place: two calls, as a CRC over a few small pieces costs more than its bytes.
    let mut head = [0u8; 8 + 60 + UdpRepr::LEN + Bth::LEN];
    head[..8].fill(0xff);
    let mut at = 8;
    let ip_len = ip_header.len().min(60);
    let ip = &mut head[at..at + ip_len];
    ip.copy_from_slice(&ip_header[..ip_len]);
    match ip.first().map(|b| b >> 4) {
        Some(4) if ip_len >= 20 => {
            ip[1] = 0xff; // TOS (DSCP, ECN)
            ip[8] = 0xff; // TTL
            ip[10] = 0xff; // header checksum
            ip[11] = 0xff;
        }
        Some(6) if ip_len >= 40 => {
            ip[0] |= 0x0f; // traffic class (its high half is in the first byte)...
            ip[1] = 0xff; // ...the rest of it, and the flow label
            ip[2] = 0xff;
            ip[3] = 0xff;
            ip[7] = 0xff; // hop limit
        }
        _ => {}
    }
    at += ip_len;
    let udp_len = udp_header.len().min(UdpRepr::LEN);
    head[at..at + udp_len].copy_from_slice(&udp_header[..udp_len]);
    if udp_len == UdpRepr::LEN {
        head[at + 6] = 0xff; // checksum
        head[at + 7] = 0xff;
    }
    at += udp_len;
    let bth_len = transport.len().min(Bth::LEN);
    head[at..at + bth_len].copy_from_slice(&transport[..bth_len]);
    if bth_len > 4 {
        head[at + 4] = 0xff; // FECN, BECN, reserved
    }
    at += bth_len;
    let mut h = crc32fast::Hasher::new();
    h.update(&head[..at]);
    h.update(&transport[bth_len..]);
    h.finalize()
}

/// IPv4 identifications a receiver accepts without seeing them: 0 to 127.
///
/// A kernel UDP socket neither lets its sender choose a datagram's IPv4 identification nor
/// shows it to the receiver, yet the ICRC covers it. Linux gives a don't-fragment datagram
/// of an unconnected socket identification 0, and the segments of a UDP GSO send 0, 1, 2, …
/// in order (at most 128 segments: `UDP_MAX_SEGMENTS`). So a sender that batches datagrams
/// with GSO signs segment `k` with identification `k` ([`IdentDeltas::delta`]), and a
/// receiver whose datagrams arrive without their IP header finds the identification from
/// the ICRC ([`IdentDeltas::recover`]): the ICRC is linear in those bits. The price is seven
/// bits of the ICRC's 32 (a corrupted packet passes one time in 2^25, not 2^32); the kernel
/// has checked the UDP checksum as well, where the sender set one.
pub const SEGMENT_IDENTS: u16 = 128;

/// Where the IPv4 identification lies in the ICRC's input: after the eight bytes standing
/// for the LRH, at offset 4 of the IP header.
const IDENT_AT: usize = 8 + 4;

/// `state` followed by `n` zero bytes (the CRC's linear part only: see `delta_of`).
fn append_zeros(state: u32, n: u64) -> u32 {
    let mut h = crc32fast::Hasher::new_with_initial_len(state, 0);
    h.combine(&crc32fast::Hasher::new_with_initial_len(0, n));
    h.finalize()
}

/// The ICRC of an IPv4 datagram of `datagram_len` bytes (IP header to ICRC, the ICRC
/// included) with identification `ident`, XOR the same datagram's with identification 0.
/// CRC-32 is linear over GF(2): the difference depends on `ident` and on how many bytes
/// follow it, not on the rest of the datagram.
fn delta_of(ident: u16, datagram_len: usize) -> u32 {
    // CRC input: 8 bytes for the LRH and the datagram without its ICRC.
    let input = 8 + datagram_len.saturating_sub(super::ICRC_LEN);
    let after = input.saturating_sub(IDENT_AT + 2) as u64;
    let two = crc32fast::hash(&ident.to_be_bytes()) ^ crc32fast::hash(&[0, 0]);
    append_zeros(two, after)
}

/// The ICRC differences made by IPv4 identifications 1 to 127 ([`SEGMENT_IDENTS`]), for the
/// few datagram lengths a batch uses: a sender patches the ICRC of a datagram signed with
/// identification 0 to the one its GSO segment will carry, a receiver finds the
/// identification of a datagram that arrived without its IP header.
///
/// ```
/// use softverbs_roce::wire::icrc::IdentDeltas;
/// let mut d = IdentDeltas::default();
/// let x = d.delta(1056, 5);
/// assert_eq!(d.recover(1056, x), Some(5));
/// assert_eq!(d.recover(1056, 0), Some(0));
/// ```
#[derive(Debug, Default, Clone)]
pub struct IdentDeltas {
    /// (datagram length, the delta of each of the seven identification bits), most recent
    /// first.
    cache: Vec<(usize, [u32; 7])>,
    /// The identification recovered last: the segments of a GSO send arrive in order, so
    /// the next one is tried first.
    last: u16,
}

/// Lengths remembered: a stream uses two or three (first, middle and last packets).
const CACHED_LENGTHS: usize = 4;

impl IdentDeltas {
    fn basis(&mut self, datagram_len: usize) -> [u32; 7] {
        if let Some(i) = self.cache.iter().position(|(l, _)| *l == datagram_len) {
            let b = self.cache[i].1;
            if i != 0 {
                let e = self.cache.remove(i);
                self.cache.insert(0, e);
            }
            return b;
        }
        let mut b = [0u32; 7];
        for (i, d) in b.iter_mut().enumerate() {
            *d = delta_of(1 << i, datagram_len);
        }
        self.cache.truncate(CACHED_LENGTHS - 1);
        self.cache.insert(0, (datagram_len, b));
        b
    }

    /// What to XOR into the ICRC of a `datagram_len`-byte IPv4 datagram signed with
    /// identification 0 when it leaves with identification `ident` (below
    /// [`SEGMENT_IDENTS`]; higher bits are ignored).
    pub fn delta(&mut self, datagram_len: usize, ident: u16) -> u32 {
        let b = self.basis(datagram_len);
        (0..7)
            .filter(|i| ident & (1 << i) != 0)
            .fold(0, |x, i| x ^ b[i])
    }

    /// The identification below [`SEGMENT_IDENTS`] that explains `syndrome` (the ICRC that
    /// arrived XOR the one computed with identification 0) for a `datagram_len`-byte IPv4
    /// datagram, or `None` (the packet is corrupt or forged).
    pub fn recover(&mut self, datagram_len: usize, syndrome: u32) -> Option<u16> {
        if syndrome == 0 {
            self.last = 0;
            return Some(0);
        }
        let next = (self.last + 1) % SEGMENT_IDENTS;
        if self.delta(datagram_len, next) == syndrome {
            self.last = next;
            return Some(next);
        }
        let b = self.basis(datagram_len);
        // Gray code: each next identification differs from the last in one bit.
        let mut x = 0u32;
        for g in 1..SEGMENT_IDENTS {
            x ^= b[g.trailing_zeros() as usize];
            if x == syndrome {
                self.last = g ^ (g >> 1);
                return Some(self.last);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Bth, Headers, IpRepr, Ipv4Repr, Opcode, Psn, emit_datagram};

    fn datagram(ident: u16, payload: usize) -> Vec<u8> {
        let mut ip = Ipv4Repr::new([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        ip.ident = ident;
        let h = Headers::new(Bth::new(Opcode::RC_SEND_MIDDLE, 0x12, Psn::new(9)));
        let data: Vec<u8> = (0..payload).map(|i| (i * 7) as u8).collect();
        let mut buf = vec![0u8; payload + 128];
        let n = emit_datagram(&IpRepr::V4(ip), 4791, &h, &data, &mut buf).unwrap();
        buf.truncate(n);
        buf
    }

    fn icrc_of(d: &[u8]) -> u32 {
        u32::from_le_bytes(d[d.len() - 4..].try_into().unwrap())
    }

    #[test]
    fn the_delta_turns_one_identification_into_another() {
        let mut deltas = IdentDeltas::default();
        for payload in [0, 4, 1024, 4096] {
            let zero = datagram(0, payload);
            for ident in [1, 2, 5, 64, 127] {
                let other = datagram(ident, payload);
                assert_eq!(
                    icrc_of(&zero) ^ deltas.delta(zero.len(), ident),
                    icrc_of(&other),
                    "payload {payload}, identification {ident}"
                );
            }
        }
    }

    #[test]
    fn identifications_below_128_are_recovered_and_others_are_not() {
        let mut deltas = IdentDeltas::default();
        let zero = datagram(0, 1024);
        for ident in 0..SEGMENT_IDENTS {
            let s = icrc_of(&datagram(ident, 1024)) ^ icrc_of(&zero);
            assert_eq!(deltas.recover(zero.len(), s), Some(ident));
        }
        for ident in [128, 300, 0xffff] {
            let s = icrc_of(&datagram(ident, 1024)) ^ icrc_of(&zero);
            assert_eq!(
                deltas.recover(zero.len(), s),
                None,
                "identification {ident}"
            );
        }
        // One flipped ICRC bit is no identification.
        for bit in 0..32 {
            assert_eq!(deltas.recover(zero.len(), 1 << bit), None, "bit {bit}");
        }
    }
}
