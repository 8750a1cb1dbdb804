//! BTH opcodes: the transport service (top three bits) and the operation (low five).

use super::WireError;

/// The transport service an opcode belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Transport {
    /// Reliable connection (`000`).
    Rc,
    /// Unreliable connection (`001`).
    Uc,
    /// Unreliable datagram (`011`).
    Ud,
    /// Extended reliable connected (`101`): RC's operations, every request with an XRCETH
    /// naming the XRC SRQ it is for.
    Xrc,
}

impl Transport {
    fn bits(self) -> u8 {
        match self {
            Transport::Rc => 0x00,
            Transport::Uc => 0x20,
            Transport::Ud => 0x60,
            Transport::Xrc => 0xa0,
        }
    }
}

/// The operation of an opcode (its low five bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    SendFirst,
    SendMiddle,
    SendLast,
    SendLastImm,
    SendOnly,
    SendOnlyImm,
    WriteFirst,
    WriteMiddle,
    WriteLast,
    WriteLastImm,
    WriteOnly,
    WriteOnlyImm,
    ReadRequest,
    ReadResponseFirst,
    ReadResponseMiddle,
    ReadResponseLast,
    ReadResponseOnly,
    Ack,
    AtomicAck,
    CompareSwap,
    FetchAdd,
    SendLastInv,
    SendOnlyInv,
    /// RDMA ATOMIC WRITE (IBTA 1.5): RETH, then the 8 bytes to store; answered with a
    /// zero-length RDMA READ response, like a READ.
    AtomicWrite,
    /// RDMA FLUSH (IBTA 1.5): FETH (placement type, selectivity), then RETH; answered with
    /// a zero-length RDMA READ response.
    Flush,
}

const OPS: [(Op, u8); 25] = [
    (Op::SendFirst, 0x00),
    (Op::SendMiddle, 0x01),
    (Op::SendLast, 0x02),
    (Op::SendLastImm, 0x03),
    (Op::SendOnly, 0x04),
    (Op::SendOnlyImm, 0x05),
    (Op::WriteFirst, 0x06),
    (Op::WriteMiddle, 0x07),
    (Op::WriteLast, 0x08),
    (Op::WriteLastImm, 0x09),
    (Op::WriteOnly, 0x0a),
    (Op::WriteOnlyImm, 0x0b),
    (Op::ReadRequest, 0x0c),
    (Op::ReadResponseFirst, 0x0d),
    (Op::ReadResponseMiddle, 0x0e),
    (Op::ReadResponseLast, 0x0f),
    (Op::ReadResponseOnly, 0x10),
    (Op::Ack, 0x11),
    (Op::AtomicAck, 0x12),
    (Op::CompareSwap, 0x13),
    (Op::FetchAdd, 0x14),
    (Op::SendLastInv, 0x16),
    (Op::SendOnlyInv, 0x17),
    (Op::Flush, 0x1c),
    (Op::AtomicWrite, 0x1d),
];

impl Op {
    fn bits(self) -> u8 {
        OPS.iter().find(|(o, _)| *o == self).map_or(0, |(_, b)| *b)
    }

    /// A SEND packet of any kind.
    pub fn is_send(self) -> bool {
        matches!(
            self,
            Op::SendFirst
                | Op::SendMiddle
                | Op::SendLast
                | Op::SendLastImm
                | Op::SendOnly
                | Op::SendOnlyImm
                | Op::SendLastInv
                | Op::SendOnlyInv
        )
    }

    /// An RDMA WRITE packet of any kind.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            Op::WriteFirst
                | Op::WriteMiddle
                | Op::WriteLast
                | Op::WriteLastImm
                | Op::WriteOnly
                | Op::WriteOnlyImm
        )
    }

    /// An RDMA READ response packet of any kind.
    pub fn is_read_response(self) -> bool {
        matches!(
            self,
            Op::ReadResponseFirst
                | Op::ReadResponseMiddle
                | Op::ReadResponseLast
                | Op::ReadResponseOnly
        )
    }

    /// Compare-and-swap or fetch-and-add.
    pub fn is_atomic(self) -> bool {
        matches!(self, Op::CompareSwap | Op::FetchAdd)
    }

    /// Sent by a requester (the rest are responses: ACKs and READ responses).
    pub fn is_request(self) -> bool {
        self.is_send()
            || self.is_write()
            || self.is_atomic()
            || self == Op::ReadRequest
            || self == Op::AtomicWrite
            || self == Op::Flush
    }

    /// A request answered with RDMA READ response packets (READ, ATOMIC WRITE, FLUSH): it
    /// holds a responder resource, and its duplicates are answered from it.
    pub fn is_read_like(self) -> bool {
        matches!(self, Op::ReadRequest | Op::AtomicWrite | Op::Flush)
    }

    /// Carries a FETH (a FLUSH's placement type and selectivity).
    pub fn has_feth(self) -> bool {
        self == Op::Flush
    }

    /// The first packet of a multi-packet message.
    pub fn is_first(self) -> bool {
        matches!(self, Op::SendFirst | Op::WriteFirst | Op::ReadResponseFirst)
    }

    /// A middle packet of a multi-packet message.
    pub fn is_middle(self) -> bool {
        matches!(
            self,
            Op::SendMiddle | Op::WriteMiddle | Op::ReadResponseMiddle
        )
    }

    /// The last packet of a multi-packet message.
    pub fn is_last(self) -> bool {
        matches!(
            self,
            Op::SendLast
                | Op::SendLastImm
                | Op::SendLastInv
                | Op::WriteLast
                | Op::WriteLastImm
                | Op::ReadResponseLast
        )
    }

    /// A whole message in one packet.
    pub fn is_only(self) -> bool {
        matches!(
            self,
            Op::SendOnly
                | Op::SendOnlyImm
                | Op::SendOnlyInv
                | Op::WriteOnly
                | Op::WriteOnlyImm
                | Op::ReadResponseOnly
        )
    }

    /// Starts a message: first or only (every request that is not a continuation).
    pub fn starts_message(self) -> bool {
        self.is_first() || self.is_only() || self.is_read_like() || self.is_atomic()
    }

    /// Ends a message: last or only.
    pub fn ends_message(self) -> bool {
        self.is_last() || self.is_only() || self.is_read_like() || self.is_atomic()
    }

    /// The packet at which a responder needs a receive WQE: a SEND's first or only one, and
    /// an RDMA WRITE's one with immediate data (its other packets need none).
    pub fn takes_receive(self) -> bool {
        (self.is_send() && self.starts_message())
            || matches!(self, Op::WriteLastImm | Op::WriteOnlyImm)
    }

    /// Carries immediate data (ImmDt).
    pub fn has_imm(self) -> bool {
        matches!(
            self,
            Op::SendLastImm | Op::SendOnlyImm | Op::WriteLastImm | Op::WriteOnlyImm
        )
    }

    /// Carries a key to invalidate (IETH).
    pub fn has_ieth(self) -> bool {
        matches!(self, Op::SendLastInv | Op::SendOnlyInv)
    }

    /// Carries a RETH (virtual address, key, length).
    pub fn has_reth(self) -> bool {
        matches!(
            self,
            Op::WriteFirst
                | Op::WriteOnly
                | Op::WriteOnlyImm
                | Op::ReadRequest
                | Op::AtomicWrite
                | Op::Flush
        )
    }

    /// Carries an AETH (ACK syndrome and MSN).
    pub fn has_aeth(self) -> bool {
        matches!(
            self,
            Op::ReadResponseFirst
                | Op::ReadResponseLast
                | Op::ReadResponseOnly
                | Op::Ack
                | Op::AtomicAck
        )
    }

    /// Carries a payload (possibly empty); the others carry none at all.
    pub fn has_payload(self) -> bool {
        self.is_send() || self.is_write() || self.is_read_response() || self == Op::AtomicWrite
    }
}

/// A BTH opcode the verbs produce: every RC operation, UC SEND and RDMA WRITE, UD SEND.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Opcode {
    pub transport: Transport,
    pub op: Op,
}

impl Opcode {
    pub const RC_SEND_FIRST: Opcode = Opcode::rc(Op::SendFirst);
    pub const RC_SEND_MIDDLE: Opcode = Opcode::rc(Op::SendMiddle);
    pub const RC_SEND_LAST: Opcode = Opcode::rc(Op::SendLast);
    pub const RC_SEND_ONLY: Opcode = Opcode::rc(Op::SendOnly);
    pub const RC_WRITE_ONLY: Opcode = Opcode::rc(Op::WriteOnly);
    pub const RC_READ_REQUEST: Opcode = Opcode::rc(Op::ReadRequest);
    pub const RC_ACK: Opcode = Opcode::rc(Op::Ack);
    pub const UD_SEND_ONLY: Opcode = Opcode {
        transport: Transport::Ud,
        op: Op::SendOnly,
    };

    const fn rc(op: Op) -> Opcode {
        Opcode {
            transport: Transport::Rc,
            op,
        }
    }

    /// `op` on `transport`, if that transport has it.
    pub fn new(transport: Transport, op: Op) -> Option<Opcode> {
        let ok = match transport {
            Transport::Rc | Transport::Xrc => true,
            Transport::Uc => (op.is_send() && !op.has_ieth()) || op.is_write(),
            Transport::Ud => matches!(op, Op::SendOnly | Op::SendOnlyImm),
        };
        ok.then_some(Opcode { transport, op })
    }

    /// Decodes an opcode byte; anything outside RC, UC, UD and XRC's opcodes is an error.
    pub fn from_u8(b: u8) -> Result<Opcode, WireError> {
        let transport = match b & 0xe0 {
            0x00 => Transport::Rc,
            0x20 => Transport::Uc,
            0x60 => Transport::Ud,
            0xa0 => Transport::Xrc,
            _ => return Err(WireError::Opcode(b)),
        };
        let op = OPS
            .iter()
            .find(|(_, bits)| *bits == b & 0x1f)
            .map(|(op, _)| *op)
            .ok_or(WireError::Opcode(b))?;
        Opcode::new(transport, op).ok_or(WireError::Opcode(b))
    }

    /// The opcode byte.
    pub fn to_u8(self) -> u8 {
        self.transport.bits() | self.op.bits()
    }

    /// Every opcode, for tests and tables.
    pub fn all() -> impl Iterator<Item = Opcode> {
        [Transport::Rc, Transport::Uc, Transport::Ud, Transport::Xrc]
            .into_iter()
            .flat_map(|t| OPS.iter().filter_map(move |(op, _)| Opcode::new(t, *op)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_decodes_to_its_opcode_or_an_error() {
        let mut valid = 0;
        for b in 0..=255u8 {
            match Opcode::from_u8(b) {
                Ok(op) => {
                    assert_eq!(op.to_u8(), b);
                    valid += 1;
                }
                Err(e) => assert_eq!(e, WireError::Opcode(b)),
            }
        }
        // RC 25, UC 12 (SEND and WRITE, no invalidate), UD 2, XRC 25 (RC's).
        assert_eq!(valid, 25 + 12 + 2 + 25);
        assert_eq!(Opcode::all().count(), valid);
    }

    #[test]
    fn values_are_the_specs() {
        let rc = |op| Opcode::new(Transport::Rc, op).unwrap().to_u8();
        assert_eq!(rc(Op::SendOnly), 0x04);
        assert_eq!(rc(Op::WriteOnlyImm), 0x0b);
        assert_eq!(rc(Op::ReadRequest), 0x0c);
        assert_eq!(rc(Op::Ack), 0x11);
        assert_eq!(rc(Op::FetchAdd), 0x14);
        assert_eq!(rc(Op::SendOnlyInv), 0x17);
        assert_eq!(rc(Op::AtomicWrite), 0x1d);
        assert_eq!(rc(Op::Flush), 0x1c);
        assert!(Opcode::new(Transport::Uc, Op::AtomicWrite).is_none());
        // XRC is RC's operations at 0xA0 (IBTA 9.2: XRC SEND FIRST 0xA0, ACKNOWLEDGE 0xB1).
        let xrc = |op| Opcode::new(Transport::Xrc, op).unwrap().to_u8();
        assert_eq!((xrc(Op::SendFirst), xrc(Op::Ack)), (0xa0, 0xb1));
        assert_eq!(xrc(Op::FetchAdd), 0xb4);
        assert_eq!(
            Opcode::new(Transport::Uc, Op::WriteLast).unwrap().to_u8(),
            0x28
        );
        assert_eq!(
            Opcode::new(Transport::Ud, Op::SendOnlyImm).unwrap().to_u8(),
            0x65
        );
        assert!(Opcode::new(Transport::Uc, Op::ReadRequest).is_none());
        assert!(Opcode::new(Transport::Ud, Op::SendFirst).is_none());
    }
}
