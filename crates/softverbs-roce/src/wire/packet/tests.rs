use super::*;
use crate::wire::{AethKind, Ipv4Repr, Ipv6Repr, NakCode, Op, Opcode, Psn};
use proptest::prelude::*;
use std::net::{Ipv4Addr, Ipv6Addr};

fn v4() -> IpRepr {
    IpRepr::V4(Ipv4Repr::new(
        Ipv4Addr::new(10, 0, 0, 1),
        Ipv4Addr::new(10, 0, 0, 2),
    ))
}

fn v6() -> IpRepr {
    IpRepr::V6(Ipv6Repr::new(
        Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1),
        Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2),
    ))
}

/// Headers for `opcode` with every extension header it needs, filled from `seed`.
fn headers_for(opcode: Opcode, seed: u64) -> Headers {
    let mut bth = Bth::new(
        opcode,
        (seed as u32) & 0xff_ffff,
        Psn::new((seed >> 24) as u32),
    );
    bth.solicited = seed & 1 != 0;
    bth.ack_req = seed & 2 != 0;
    let mut h = Headers::new(bth);
    let op = opcode.op;
    if opcode.transport == Transport::Ud {
        h.deth = Some(Deth {
            qkey: seed as u32 ^ 0x1111_1111,
            src_qp: (seed as u32 >> 3) & 0xff_ffff,
        });
    }
    if opcode.transport == Transport::Xrc && op.is_request() {
        h.xrceth = Some((seed as u32 >> 5) & 0xff_ffff);
    }
    if op.has_reth() {
        h.reth = Some(Reth {
            va: seed.rotate_left(7),
            rkey: seed as u32 ^ 0xdead,
            len: (seed >> 40) as u32,
        });
    }
    if op.is_atomic() {
        h.atomic_eth = Some(AtomicEth {
            va: seed & !7,
            rkey: 7,
            swap_add: seed.rotate_left(13),
            compare: !seed,
        });
    }
    if op.has_aeth() {
        h.aeth = Some(Aeth {
            kind: match seed % 3 {
                0 => AethKind::Ack { credits: 31 },
                1 => AethKind::RnrNak { timer: 14 },
                _ => AethKind::Nak(NakCode::PsnSequenceError),
            },
            msn: (seed as u32) & 0xff_ffff,
        });
    }
    if op == Op::AtomicAck {
        h.atomic_ack_eth = Some(AtomicAckEth { original: seed });
    }
    if op.has_imm() {
        h.imm = Some(seed as u32 ^ 0x5a5a_5a5a);
    }
    if op.has_ieth() {
        h.ieth = Some(0x1234_5678);
    }
    if op.has_feth() {
        h.feth = Some(1 | (seed as u32 & 1) << 4);
    }
    h
}

#[test]
fn every_opcode_round_trips_over_ipv4_and_ipv6_with_every_pad() {
    let mut buf = [0u8; 256];
    for (i, opcode) in Opcode::all().enumerate() {
        let h = headers_for(opcode, 0x0123_4567_89ab_cdef ^ i as u64);
        let sizes: &[usize] = if opcode.op.has_payload() {
            &[0, 1, 2, 3, 4, 5, 63, 64, 65]
        } else {
            &[0]
        };
        for &n in sizes {
            let payload: Vec<u8> = (0..n as u8).collect();
            for ip in [v4(), v6()] {
                let len = emit_datagram(&ip, 0xd000 + i as u16, &h, &payload, &mut buf)
                    .unwrap_or_else(|e| panic!("{opcode:?} {n}: {e}"));
                assert_eq!(
                    len,
                    ip.len() + 8 + h.len() + n.next_multiple_of(4) + 4,
                    "{opcode:?}"
                );
                let d = Datagram::parse(&buf[..len]).unwrap_or_else(|e| panic!("{opcode:?}: {e}"));
                let mut want = h;
                want.bth.pad = ((4 - n % 4) % 4) as u8;
                assert_eq!(d.headers, want, "{opcode:?}");
                assert_eq!(d.payload, &payload[..], "{opcode:?}");
                assert_eq!(
                    (d.ip, d.udp.dst_port, d.udp.src_port),
                    (ip, 4791, 0xd000 + i as u16)
                );
                assert_eq!(d.ip_header, &buf[..ip.len()]);
            }
        }
    }
}

#[test]
fn missing_or_extra_extension_headers_are_refused_on_emit() {
    let mut buf = [0u8; 128];
    let mut h = headers_for(Opcode::RC_WRITE_ONLY, 1);
    h.reth = None;
    assert_eq!(
        emit_datagram(&v4(), 1, &h, b"x", &mut buf),
        Err(WireError::HeaderMismatch("RETH"))
    );
    let mut h = headers_for(Opcode::RC_SEND_ONLY, 1);
    h.imm = Some(1);
    assert_eq!(h.check(), Err(WireError::HeaderMismatch("ImmDt")));
    let h = headers_for(Opcode::RC_ACK, 1);
    assert!(matches!(
        emit_datagram(&v4(), 1, &h, b"x", &mut buf),
        Err(WireError::UnexpectedPayload { .. })
    ));
    let h = headers_for(Opcode::RC_SEND_ONLY, 1);
    assert!(matches!(
        emit_datagram(&v4(), 1, &h, &[0; 100], &mut buf),
        Err(WireError::BufferTooSmall { .. })
    ));
}

/// Rewrites a datagram's ICRC to match its (edited) contents, as a forger would.
fn reseal(buf: &mut [u8], ip_len: usize) {
    let n = buf.len();
    let crc = icrc::compute(
        &buf[..ip_len],
        &buf[ip_len..ip_len + 8],
        &buf[ip_len + 8..n - 4],
    );
    buf[n - 4..].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn malformed_transport_parts_are_errors_even_with_a_valid_icrc() {
    let mut buf = [0u8; 128];
    let h = headers_for(Opcode::RC_SEND_ONLY, 2);
    let len = emit_datagram(&v4(), 9, &h, b"abcd", &mut buf).unwrap();
    let good = buf[..len].to_vec();
    // Pad count larger than what follows the headers.
    let mut b = good.clone();
    b[28 + 1] |= 0x30;
    reseal(&mut b, 20);
    assert!(Datagram::parse(&b).is_ok(), "pad 3 of 4 bytes is legal");
    let h = headers_for(Opcode::RC_SEND_ONLY, 2);
    let len = emit_datagram(&v4(), 9, &h, b"", &mut buf).unwrap();
    let mut b = buf[..len].to_vec();
    b[28 + 1] |= 0x10;
    reseal(&mut b, 20);
    assert_eq!(
        Datagram::parse(&b).err(),
        Some(WireError::Pad { pad: 1, len: 0 })
    );
    // An unknown opcode.
    let mut b = good.clone();
    b[28] = 0x15;
    reseal(&mut b, 20);
    assert_eq!(Datagram::parse(&b).err(), Some(WireError::Opcode(0x15)));
    // An ACK (its AETH well formed) followed by bytes an ACK does not carry.
    let h = headers_for(Opcode::RC_SEND_ONLY, 2);
    let len = emit_datagram(&v4(), 9, &h, b"\x1f\0\0\x01efgh", &mut buf).unwrap();
    let mut b = buf[..len].to_vec();
    b[28] = Opcode::RC_ACK.to_u8();
    reseal(&mut b, 20);
    assert_eq!(
        Datagram::parse(&b).err(),
        Some(WireError::UnexpectedPayload {
            opcode: 0x11,
            len: 4
        })
    );
    // Not port 4791.
    let mut b = good.clone();
    b[22..24].copy_from_slice(&4792u16.to_be_bytes());
    assert_eq!(Datagram::parse(&b).err(), Some(WireError::NotRoce(4792)));
    // Every truncation.
    for n in 0..good.len() {
        assert!(Datagram::parse(&good[..n]).is_err(), "{n} bytes");
    }
}

#[test]
fn the_icrc_catches_every_single_bit_flip_it_covers() {
    let mut buf = [0u8; 128];
    for ip in [v4(), v6()] {
        let h = headers_for(Opcode::RC_WRITE_ONLY, 3);
        let len = emit_datagram(&ip, 0xc123, &h, b"some payload", &mut buf).unwrap();
        let good = buf[..len].to_vec();
        let ip_len = ip.len();
        for bit in 0..len * 8 {
            let mut b = good.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            let byte = bit / 8;
            // Routers may rewrite these, so the ICRC leaves them out. Over IPv6, nothing else
            // covers the IP fields either, while the UDP checksum covers the BTH's FECN/BECN
            // byte; over IPv4 the header checksum covers the IP fields, and the UDP checksum
            // is zero.
            let uncovered = match ip {
                IpRepr::V6(_) => (byte == 0 && bit % 8 < 4) || (1..4).contains(&byte) || byte == 7,
                IpRepr::V4(_) => byte == ip_len + 8 + 4,
            };
            let r = Datagram::parse(&b);
            if uncovered {
                assert!(r.is_ok(), "bit {bit}: {r:?}");
            } else {
                assert!(r.is_err(), "bit {bit} flipped, still parsed: {r:?}");
            }
        }
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = Datagram::parse(&bytes);
        let _ = Headers::parse(&bytes);
    }

    #[test]
    fn mutated_valid_packets_never_panic_and_corruptions_are_caught(
        op in 0usize..37, seed: u64, n in 0usize..80, flips in proptest::collection::vec((0usize..400, 0u8..8), 1..4),
        v6_: bool,
    ) {
        let opcode = Opcode::all().nth(op).unwrap();
        let h = headers_for(opcode, seed);
        let n = if opcode.op.has_payload() { n } else { 0 };
        let payload = vec![0xa5u8; n];
        let ip = if v6_ { v6() } else { v4() };
        let mut buf = [0u8; 256];
        let len = emit_datagram(&ip, 1, &h, &payload, &mut buf).unwrap();
        let mut b = buf[..len].to_vec();
        for (at, bit) in flips {
            let at = at % len;
            b[at] ^= 1 << bit;
        }
        if let Ok(d) = Datagram::parse(&b) {
            // Only what the ICRC leaves out may differ.
            prop_assert_eq!(d.payload, &payload[..]);
            prop_assert_eq!(d.headers.bth.psn, h.bth.psn);
            prop_assert_eq!(d.headers.bth.dest_qp, h.bth.dest_qp);
        }
    }
}

/// An XRC request carries its SRQ number right after the BTH; an XRC ACK has no XRCETH.
#[test]
fn xrc_requests_carry_an_xrceth_after_the_bth() {
    let send = Opcode::new(Transport::Xrc, Op::SendOnly).unwrap();
    assert_eq!(send.to_u8(), 0xa4);
    let mut h = Headers::new(Bth::new(send, 7, Psn::new(1)));
    assert!(h.check().is_err(), "an XRC request without its XRCETH");
    h.xrceth = Some(0x12_3456);
    let mut buf = [0u8; 64];
    let n = h.emit(b"abcd", &mut buf).unwrap();
    assert_eq!(&buf[12..16], &[0, 0x12, 0x34, 0x56]);
    assert_eq!(&buf[16..20], b"abcd");
    let (back, payload) = Headers::parse(&buf[..n]).unwrap();
    assert_eq!((back, payload), (h, &b"abcd"[..]));
    let ack = Opcode::new(Transport::Xrc, Op::Ack).unwrap();
    assert_eq!(ack.to_u8(), 0xb1);
    let mut a = Headers::new(Bth::new(ack, 7, Psn::new(1)));
    a.aeth = Some(crate::wire::Aeth::ack(3));
    let n = a.emit(&[], &mut buf).unwrap();
    assert_eq!(Headers::parse(&buf[..n]).unwrap().0.xrceth, None);
}

#[test]
fn a_received_datagram_gets_back_the_ipv4_identification_its_icrc_was_signed_with() {
    let h = headers_for(Opcode::RC_SEND_MIDDLE, 42);
    let payload = [0x5au8; 1024];
    let mut deltas = icrc::IdentDeltas::default();
    for ident in [0u16, 1, 7, 61, 127] {
        let IpRepr::V4(mut ip) = v4() else {
            unreachable!()
        };
        ip.ident = ident;
        let mut sent = [0u8; 1200];
        let n = emit_datagram(&IpRepr::V4(ip), 4791, &h, &payload, &mut sent).unwrap();
        // What a receiver behind a UDP socket rebuilds: identification 0.
        let mut got = sent;
        Ipv4Repr::set_ident(&mut got, 0);
        let d = Datagram::parse_received(&mut got[..n], &mut deltas).unwrap();
        assert_eq!((d.headers, d.payload), (h, &payload[..]));
        assert_eq!(got[..n], sent[..n], "identification {ident} written back");
        if ident != 0 {
            assert!(matches!(
                Datagram::parse(
                    &{
                        let mut z = sent;
                        Ipv4Repr::set_ident(&mut z, 0);
                        z
                    }[..n]
                ),
                Err(WireError::Icrc { .. })
            ));
        }
    }
    // Beyond a GSO send's segments, or with a corrupted byte, it stays an ICRC error.
    for (ident, flip) in [(128u16, None), (3, Some(100usize))] {
        let IpRepr::V4(mut ip) = v4() else {
            unreachable!()
        };
        ip.ident = ident;
        let mut b = [0u8; 1200];
        let n = emit_datagram(&IpRepr::V4(ip), 4791, &h, &payload, &mut b).unwrap();
        Ipv4Repr::set_ident(&mut b, 0);
        if let Some(at) = flip {
            b[at] ^= 1;
        }
        assert!(matches!(
            Datagram::parse_received(&mut b[..n], &mut deltas),
            Err(WireError::Icrc { .. })
        ));
    }
}
