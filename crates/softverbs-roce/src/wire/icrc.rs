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
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xff; 8]);
    let mut ip = [0u8; 60];
    let n = ip_header.len().min(ip.len());
    ip[..n].copy_from_slice(&ip_header[..n]);
    match ip.first().map(|b| b >> 4) {
        Some(4) if n >= 20 => {
            ip[1] = 0xff; // TOS (DSCP, ECN)
            ip[8] = 0xff; // TTL
            ip[10] = 0xff; // header checksum
            ip[11] = 0xff;
        }
        Some(6) if n >= 40 => {
            ip[0] |= 0x0f; // traffic class (its high half is in the first byte)...
            ip[1] = 0xff; // ...the rest of it, and the flow label
            ip[2] = 0xff;
            ip[3] = 0xff;
            ip[7] = 0xff; // hop limit
        }
        _ => {}
    }
    h.update(&ip[..n]);
    let mut udp = [0u8; UdpRepr::LEN];
    let n = udp_header.len().min(udp.len());
    udp[..n].copy_from_slice(&udp_header[..n]);
    udp[6] = 0xff; // checksum
    udp[7] = 0xff;
    h.update(&udp[..n]);
    let mut bth = [0u8; Bth::LEN];
    let n = transport.len().min(bth.len());
    bth[..n].copy_from_slice(&transport[..n]);
    if n > 4 {
        bth[4] = 0xff; // FECN, BECN, reserved
    }
    h.update(&bth[..n]);
    h.update(&transport[n..]);
    h.finalize()
}
