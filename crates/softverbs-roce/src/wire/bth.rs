//! The base transport header (12 bytes) and 24-bit packet sequence numbers.

use super::{Opcode, WireError, be16, be24, bits, room, take};

/// A 24-bit packet sequence number. Arithmetic wraps at 2^24; two PSNs compare by which is
/// ahead within half the space (2^23), as the spec's PSN windows do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// The number of distinct PSNs.
    pub const MODULUS: u32 = 1 << 24;

    /// `v` modulo 2^24.
    pub const fn new(v: u32) -> Psn {
        Psn(v & (Psn::MODULUS - 1))
    }

    /// The 24-bit value.
    pub const fn value(self) -> u32 {
        self.0
    }

    /// `self + n`, wrapping.
    pub const fn add(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_add(n))
    }

    /// `self - n`, wrapping.
    pub const fn sub(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_sub(n))
    }

    /// The signed distance from `other` to `self`: positive when `self` is ahead, in
    /// `-2^23..2^23`.
    pub const fn diff(self, other: Psn) -> i32 {
        // Shift the 24-bit difference into the top of an i32 and back: sign-extends it.
        ((self.0.wrapping_sub(other.0) << 8) as i32) >> 8
    }

    /// True when `self` comes after `other`.
    pub const fn after(self, other: Psn) -> bool {
        self.diff(other) > 0
    }
}

impl std::fmt::Display for Psn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

/// The base transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bth {
    pub opcode: Opcode,
    /// Solicited event: the receiver's CQ event fires for a solicited-only arm.
    pub solicited: bool,
    /// Migration state (APM; always false here).
    pub migreq: bool,
    /// Pad bytes after the payload (0..=3); [`Headers::emit`](super::Headers::emit) sets it
    /// from the payload length.
    pub pad: u8,
    pub pkey: u16,
    /// Congestion notification (forward/backward); not covered by the ICRC.
    pub fecn: bool,
    pub becn: bool,
    /// The destination QP number (24 bits).
    pub dest_qp: u32,
    /// Asks the responder to acknowledge this packet.
    pub ack_req: bool,
    pub psn: Psn,
}

impl Bth {
    /// Bytes on the wire.
    pub const LEN: usize = 12;

    /// A header for `opcode` to `dest_qp` with the default P_Key and every flag clear.
    pub fn new(opcode: Opcode, dest_qp: u32, psn: Psn) -> Bth {
        Bth {
            opcode,
            solicited: false,
            migreq: false,
            pad: 0,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp,
            ack_req: false,
            psn,
        }
    }

    pub fn parse(bytes: &[u8]) -> Result<Bth, WireError> {
        let b = take(bytes, 0, Bth::LEN, "BTH")?;
        let opcode = Opcode::from_u8(b[0])?;
        let version = b[1] & 0x0f;
        if version != 0 {
            return Err(WireError::Version(version));
        }
        Ok(Bth {
            opcode,
            solicited: b[1] & 0x80 != 0,
            migreq: b[1] & 0x40 != 0,
            pad: (b[1] >> 4) & 0x3,
            pkey: be16(&b[2..4]),
            fecn: b[4] & 0x80 != 0,
            becn: b[4] & 0x40 != 0,
            dest_qp: be24(&b[5..8]),
            ack_req: b[8] & 0x80 != 0,
            psn: Psn::new(be24(&b[9..12])),
        })
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        bits("destination QP", u64::from(self.dest_qp), 24)?;
        bits("pad count", u64::from(self.pad), 2)?;
        let b = room(buf, 0, Bth::LEN)?;
        b[0] = self.opcode.to_u8();
        b[1] = (u8::from(self.solicited) << 7) | (u8::from(self.migreq) << 6) | (self.pad << 4);
        b[2..4].copy_from_slice(&self.pkey.to_be_bytes());
        b[4] = (u8::from(self.fecn) << 7) | (u8::from(self.becn) << 6);
        b[5..8].copy_from_slice(&self.dest_qp.to_be_bytes()[1..]);
        b[8] = u8::from(self.ack_req) << 7;
        b[9..12].copy_from_slice(&self.psn.value().to_be_bytes()[1..]);
        Ok(Bth::LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn psn_wraps_and_compares_within_half_the_space() {
        let top = Psn::new(0xff_ffff);
        assert_eq!(top.add(1), Psn::new(0));
        assert_eq!(Psn::new(0).sub(1), top);
        assert!(Psn::new(2).after(top));
        assert_eq!(Psn::new(2).diff(top), 3);
        assert_eq!(top.diff(Psn::new(2)), -3);
        assert!(!Psn::new(5).after(Psn::new(5)));
        // Exactly half the space away is "behind" (the window is 2^23 - 1 ahead).
        assert_eq!(Psn::new(1 << 23).diff(Psn::new(0)), -(1 << 23));
        assert_eq!(Psn::new((1 << 23) - 1).diff(Psn::new(0)), (1 << 23) - 1);
        assert_eq!(Psn::new(0x1_000_005).value(), 5);
    }

    #[test]
    fn bth_bytes_are_the_specs() {
        let mut bth = Bth::new(Opcode::RC_SEND_ONLY, 0x12_3456, Psn::new(0xab_cdef));
        bth.solicited = true;
        bth.pad = 3;
        bth.pkey = 0x8001;
        bth.becn = true;
        bth.ack_req = true;
        let mut b = [0u8; 12];
        assert_eq!(bth.emit(&mut b), Ok(12));
        assert_eq!(
            b,
            [
                0x04, 0xb0, 0x80, 0x01, 0x40, 0x12, 0x34, 0x56, 0x80, 0xab, 0xcd, 0xef
            ]
        );
        assert_eq!(Bth::parse(&b), Ok(bth));
        b[1] |= 0x01;
        assert_eq!(Bth::parse(&b), Err(WireError::Version(1)));
        for n in 0..12 {
            assert!(matches!(
                Bth::parse(&b[..n]),
                Err(WireError::Truncated { .. })
            ));
        }
        bth.dest_qp = 1 << 24;
        assert!(matches!(bth.emit(&mut b), Err(WireError::Range { .. })));
    }

    proptest! {
        #[test]
        fn psn_diff_agrees_with_add(a in 0u32..(1 << 24), d in -(1i32 << 23) + 1..(1 << 23)) {
            let p = Psn::new(a);
            prop_assert_eq!(p.add(d as u32).diff(p), d);
        }

        #[test]
        fn bth_round_trips(op in 0usize..37, qp in 0u32..(1 << 24), psn in 0u32..(1 << 24),
                           pkey: u16, flags in 0u8..32, pad in 0u8..4) {
            let opcode = Opcode::all().nth(op).unwrap();
            let bth = Bth {
                opcode, solicited: flags & 1 != 0, migreq: flags & 2 != 0, pad, pkey,
                fecn: flags & 4 != 0, becn: flags & 8 != 0, dest_qp: qp,
                ack_req: flags & 16 != 0, psn: Psn::new(psn),
            };
            let mut b = [0u8; 12];
            bth.emit(&mut b).unwrap();
            prop_assert_eq!(Bth::parse(&b), Ok(bth));
        }
    }
}
