//! The extension transport headers: RETH, AETH, AtomicETH, AtomicAckETH, DETH. (Immediate
//! data and the invalidated key are single big-endian words, kept as `u32`.)

use super::{WireError, be24, be32, be64, bits, room, take};

/// RDMA extended transport header: where a WRITE or READ goes (16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reth {
    pub va: u64,
    pub rkey: u32,
    /// The whole message's length (DMA length).
    pub len: u32,
}

impl Reth {
    pub const LEN: usize = 16;

    pub fn parse(bytes: &[u8]) -> Result<Reth, WireError> {
        let b = take(bytes, 0, Reth::LEN, "RETH")?;
        Ok(Reth {
            va: be64(&b[0..8]),
            rkey: be32(&b[8..12]),
            len: be32(&b[12..16]),
        })
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let b = room(buf, 0, Reth::LEN)?;
        b[0..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..16].copy_from_slice(&self.len.to_be_bytes());
        Ok(Reth::LEN)
    }
}

/// Why a responder refused a request (the NAK codes of the AETH syndrome).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// A packet arrived ahead of the expected PSN: resend from the PSN in the NAK.
    PsnSequenceError,
    InvalidRequest,
    RemoteAccessError,
    RemoteOperationalError,
    InvalidRdRequest,
}

impl NakCode {
    fn bits(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
        }
    }
}

/// What an AETH says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AethKind {
    /// Positive acknowledgement; `credits` is the end-to-end flow-control credit code (31:
    /// invalid, flow control unused).
    Ack {
        credits: u8,
    },
    /// Receiver not ready: retry after the time `timer` encodes (the `min_rnr_timer` table).
    RnrNak {
        timer: u8,
    },
    Nak(NakCode),
}

/// ACK extended transport header: the syndrome and the responder's message sequence number
/// (4 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aeth {
    pub kind: AethKind,
    /// Messages the responder has completed (24 bits).
    pub msn: u32,
}

impl Aeth {
    pub const LEN: usize = 4;
    /// The credit code that says "no end-to-end flow control".
    pub const NO_CREDITS: u8 = 0x1f;

    /// A positive ACK without credits.
    pub fn ack(msn: u32) -> Aeth {
        Aeth {
            kind: AethKind::Ack {
                credits: Aeth::NO_CREDITS,
            },
            msn: msn & 0xff_ffff,
        }
    }

    pub fn parse(bytes: &[u8]) -> Result<Aeth, WireError> {
        let b = take(bytes, 0, Aeth::LEN, "AETH")?;
        let low = b[0] & 0x1f;
        let kind = match b[0] >> 5 {
            0b000 => AethKind::Ack { credits: low },
            0b001 => AethKind::RnrNak { timer: low },
            0b011 => AethKind::Nak(match low {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                4 => NakCode::InvalidRdRequest,
                _ => {
                    return Err(WireError::Range {
                        what: "AETH NAK code",
                        value: u64::from(low),
                    });
                }
            }),
            other => {
                return Err(WireError::Range {
                    what: "AETH syndrome",
                    value: u64::from(other),
                });
            }
        };
        Ok(Aeth {
            kind,
            msn: be24(&b[1..4]),
        })
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let syndrome = match self.kind {
            AethKind::Ack { credits } => {
                bits("AETH credit code", u64::from(credits), 5)?;
                credits
            }
            AethKind::RnrNak { timer } => {
                bits("RNR timer", u64::from(timer), 5)?;
                0x20 | timer
            }
            AethKind::Nak(code) => 0x60 | code.bits(),
        };
        bits("MSN", u64::from(self.msn), 24)?;
        let b = room(buf, 0, Aeth::LEN)?;
        b[0] = syndrome;
        b[1..4].copy_from_slice(&self.msn.to_be_bytes()[1..]);
        Ok(Aeth::LEN)
    }
}

/// Atomic extended transport header (28 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicEth {
    pub va: u64,
    pub rkey: u32,
    /// The value to store (compare-and-swap) or to add (fetch-and-add).
    pub swap_add: u64,
    /// The value to compare with (compare-and-swap only).
    pub compare: u64,
}

impl AtomicEth {
    pub const LEN: usize = 28;

    pub fn parse(bytes: &[u8]) -> Result<AtomicEth, WireError> {
        let b = take(bytes, 0, AtomicEth::LEN, "AtomicETH")?;
        Ok(AtomicEth {
            va: be64(&b[0..8]),
            rkey: be32(&b[8..12]),
            swap_add: be64(&b[12..20]),
            compare: be64(&b[20..28]),
        })
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let b = room(buf, 0, AtomicEth::LEN)?;
        b[0..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..20].copy_from_slice(&self.swap_add.to_be_bytes());
        b[20..28].copy_from_slice(&self.compare.to_be_bytes());
        Ok(AtomicEth::LEN)
    }
}

/// Atomic acknowledge extended transport header: the value before the atomic (8 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicAckEth {
    pub original: u64,
}

impl AtomicAckEth {
    pub const LEN: usize = 8;

    pub fn parse(bytes: &[u8]) -> Result<AtomicAckEth, WireError> {
        let b = take(bytes, 0, AtomicAckEth::LEN, "AtomicAckETH")?;
        Ok(AtomicAckEth {
            original: be64(&b[0..8]),
        })
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        room(buf, 0, AtomicAckEth::LEN)?.copy_from_slice(&self.original.to_be_bytes());
        Ok(AtomicAckEth::LEN)
    }
}

/// Datagram extended transport header: the Q_Key and the sender's QP (8 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Deth {
    pub qkey: u32,
    /// The source QP number (24 bits).
    pub src_qp: u32,
}

impl Deth {
    pub const LEN: usize = 8;

    pub fn parse(bytes: &[u8]) -> Result<Deth, WireError> {
        let b = take(bytes, 0, Deth::LEN, "DETH")?;
        Ok(Deth {
            qkey: be32(&b[0..4]),
            src_qp: be24(&b[5..8]),
        })
    }

    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        bits("source QP", u64::from(self.src_qp), 24)?;
        let b = room(buf, 0, Deth::LEN)?;
        b[0..4].copy_from_slice(&self.qkey.to_be_bytes());
        b[4] = 0;
        b[5..8].copy_from_slice(&self.src_qp.to_be_bytes()[1..]);
        Ok(Deth::LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Parses `bytes` with `parse`, checks it gives `want`, emits it back to `bytes`, and
    /// checks every shorter input is a truncation.
    fn round_trip<T: PartialEq + std::fmt::Debug>(
        bytes: &[u8],
        want: T,
        parse: fn(&[u8]) -> Result<T, WireError>,
        emit: impl Fn(&T, &mut [u8]) -> Result<usize, WireError>,
    ) {
        assert_eq!(parse(bytes).as_ref(), Ok(&want));
        let mut out = vec![0u8; bytes.len()];
        assert_eq!(emit(&want, &mut out), Ok(bytes.len()));
        assert_eq!(out, bytes);
        for n in 0..bytes.len() {
            assert!(matches!(
                parse(&bytes[..n]),
                Err(WireError::Truncated { .. })
            ));
            assert!(matches!(
                emit(&want, &mut out[..n]),
                Err(WireError::BufferTooSmall { .. })
            ));
        }
    }

    #[test]
    fn headers_are_the_specs_bytes() {
        round_trip(
            &[
                1, 2, 3, 4, 5, 6, 7, 8, 0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 0x10, 0,
            ],
            Reth {
                va: 0x0102_0304_0506_0708,
                rkey: 0xaabb_ccdd,
                len: 4096,
            },
            Reth::parse,
            Reth::emit,
        );
        round_trip(&[0x1f, 0, 0, 9], Aeth::ack(9), Aeth::parse, Aeth::emit);
        round_trip(
            &[0x2e, 0x12, 0x34, 0x56],
            Aeth {
                kind: AethKind::RnrNak { timer: 14 },
                msn: 0x12_3456,
            },
            Aeth::parse,
            Aeth::emit,
        );
        round_trip(
            &[0x62, 0, 0, 1],
            Aeth {
                kind: AethKind::Nak(NakCode::RemoteAccessError),
                msn: 1,
            },
            Aeth::parse,
            Aeth::emit,
        );
        let mut atomic = vec![0u8; 28];
        atomic[7] = 8;
        atomic[11] = 0x42;
        atomic[19] = 1;
        atomic[27] = 2;
        round_trip(
            &atomic,
            AtomicEth {
                va: 8,
                rkey: 0x42,
                swap_add: 1,
                compare: 2,
            },
            AtomicEth::parse,
            AtomicEth::emit,
        );
        round_trip(
            &[0, 0, 0, 0, 0, 0, 1, 0],
            AtomicAckEth { original: 256 },
            AtomicAckEth::parse,
            AtomicAckEth::emit,
        );
        round_trip(
            &[0x11, 0x11, 0x11, 0x11, 0, 0, 0, 1],
            Deth {
                qkey: 0x1111_1111,
                src_qp: 1,
            },
            Deth::parse,
            Deth::emit,
        );
    }

    #[test]
    fn reserved_syndromes_are_errors() {
        for b0 in [0x40u8, 0x5f, 0x80, 0xff, 0x65, 0x7f] {
            assert!(matches!(
                Aeth::parse(&[b0, 0, 0, 0]),
                Err(WireError::Range { .. })
            ));
        }
    }

    proptest! {
        #[test]
        fn any_aeth_bytes_parse_or_fail_cleanly_and_round_trip(b: [u8; 4]) {
            if let Ok(a) = Aeth::parse(&b) {
                let mut out = [0u8; 4];
                a.emit(&mut out).unwrap();
                prop_assert_eq!(out, b);
            }
        }
    }
}
