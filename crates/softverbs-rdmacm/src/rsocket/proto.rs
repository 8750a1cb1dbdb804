//! The stream protocol between two softverbs rsockets, as pure logic (no verbs), so that it
//! can be tested on its own.
//!
//! Every message is a SEND with immediate data into one of the receive buffers ("slots")
//! the peer posted. The immediate says what the message is ([`Kind`]) and returns credits:
//! how many of the sender's own slots it has reposted since it last said so. A slot that
//! holds stream data is reposted only once the program has read all of it, so the credits
//! are the flow control; a control message's slot is reposted at once.
//!
//! [`Flow`] keeps the counts and the rules that keep both sides from stalling:
//! - data (and the FIN, and an iomap announcement) needs two credits: the last one is kept
//!   for a credit-only message, so a side can always hand back what it owes;
//! - a credit-only message goes out when half the peer's window is owed (or when the peer
//!   may be stuck on its reserve), never for a single control message, so two sides never
//!   trade credit-only messages forever.

/// What a message carries, in the top four bits of its immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Stream bytes (the message's length).
    Data,
    /// Credits only (length 0).
    Credit,
    /// The sender shut down writing: end of stream after what came before.
    Fin,
    /// An iomap announcement ([`IomapMsg`]).
    Iomap,
}

/// The most credits one immediate can return.
pub const MAX_CREDITS: u32 = (1 << 28) - 1;

/// The immediate (host order) of a message of `kind` returning `credits`.
pub fn encode(kind: Kind, credits: u32) -> u32 {
    let k = match kind {
        Kind::Data => 0,
        Kind::Credit => 1,
        Kind::Fin => 2,
        Kind::Iomap => 3,
    };
    (k << 28) | credits.min(MAX_CREDITS)
}

/// The kind and returned credits of an immediate (host order); `None` for a kind this
/// protocol does not know (a peer that is not a softverbs rsocket).
pub fn decode(imm: u32) -> Option<(Kind, u32)> {
    let kind = match imm >> 28 {
        0 => Kind::Data,
        1 => Kind::Credit,
        2 => Kind::Fin,
        3 => Kind::Iomap,
        _ => return None,
    };
    Some((kind, imm & MAX_CREDITS))
}

/// The connection's private data: which protocol, and the receive window the side offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Receive slots posted for the peer (its initial credits).
    pub slots: u32,
    /// Bytes per slot: the most one message carries.
    pub slot_size: u32,
}

/// The smallest window a side may offer.
pub const MIN_SLOTS: u32 = 4;

/// "SVRS": marks a softverbs rsocket's private data.
pub const MAGIC: u32 = 0x5356_5253;
/// Protocol version.
pub const VERSION: u32 = 1;
/// Bytes of a [`Hello`] on the wire.
pub const HELLO_LEN: usize = 16;

impl Hello {
    /// Wire form: magic, version, slots, slot size, each big-endian u32.
    pub fn to_bytes(self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&VERSION.to_be_bytes());
        b[8..12].copy_from_slice(&self.slots.to_be_bytes());
        b[12..16].copy_from_slice(&self.slot_size.to_be_bytes());
        b
    }

    /// Parses a peer's private data; `None` if it is not ours or makes no sense.
    pub fn parse(b: &[u8]) -> Option<Hello> {
        let word = |k: usize| -> Option<u32> {
            Some(u32::from_be_bytes(b.get(k..k + 4)?.try_into().ok()?))
        };
        if word(0)? != MAGIC || word(4)? != VERSION {
            return None;
        }
        let h = Hello {
            slots: word(8)?,
            slot_size: word(12)?,
        };
        (h.slots >= MIN_SLOTS && h.slots <= MAX_CREDITS && h.slot_size >= 64).then_some(h)
    }
}

/// An iomap announcement: the peer may RDMA WRITE `len` bytes at `addr` (rkey `rkey`) and
/// calls that window's start `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IomapMsg {
    pub offset: u64,
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

/// Bytes of an [`IomapMsg`] on the wire.
pub const IOMAP_LEN: usize = 28;

impl IomapMsg {
    /// Wire form: offset, address, length (big-endian u64s), rkey (big-endian u32).
    pub fn to_bytes(self) -> [u8; IOMAP_LEN] {
        let mut b = [0u8; IOMAP_LEN];
        b[0..8].copy_from_slice(&self.offset.to_be_bytes());
        b[8..16].copy_from_slice(&self.addr.to_be_bytes());
        b[16..24].copy_from_slice(&self.len.to_be_bytes());
        b[24..28].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// Parses an announcement; `None` if it is short.
    pub fn parse(b: &[u8]) -> Option<IomapMsg> {
        if b.len() < IOMAP_LEN {
            return None;
        }
        let q = |k: usize| u64::from_be_bytes(b[k..k + 8].try_into().unwrap_or_default());
        Some(IomapMsg {
            offset: q(0),
            addr: q(8),
            len: q(16),
            rkey: u32::from_be_bytes(b[24..28].try_into().unwrap_or_default()),
        })
    }
}

/// Credit accounting of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flow {
    /// Slots of the peer we may still fill.
    pub credits: u32,
    /// Our slots reposted and not yet reported to the peer.
    pub owed: u32,
    /// The peer's window (its slots), for the credit-only threshold.
    pub peer_window: u32,
    /// Our window (what the peer starts with).
    pub window: u32,
}

impl Flow {
    /// A new connection: the peer offered `peer_window` slots, we `window`.
    pub fn new(window: u32, peer_window: u32) -> Flow {
        Flow {
            credits: peer_window,
            owed: 0,
            peer_window,
            window,
        }
    }

    /// Whether a data message (or FIN, or iomap announcement) may go now.
    pub fn can_send_data(&self) -> bool {
        self.credits >= 2
    }

    /// Takes a credit for a data message; returns the immediate's credit field.
    pub fn take_data(&mut self) -> Option<u32> {
        if !self.can_send_data() {
            return None;
        }
        self.credits -= 1;
        Some(std::mem::take(&mut self.owed))
    }

    /// Whether a credit-only message should go now: half our window is owed. (With a
    /// window of at least [`MIN_SLOTS`], the peer then holds at most half of it, and a
    /// credit-only message it receives makes it owe one slot, below its own threshold.)
    pub fn want_credit_msg(&self) -> bool {
        self.credits >= 1 && self.owed > 0 && self.owed >= self.window.div_ceil(2)
    }

    /// Takes the reserved credit for a credit-only message; returns the credits it returns.
    pub fn take_credit_msg(&mut self) -> Option<u32> {
        if !self.want_credit_msg() {
            return None;
        }
        self.credits -= 1;
        Some(std::mem::take(&mut self.owed))
    }

    /// A message from the peer returned `n` credits.
    pub fn returned(&mut self, n: u32) {
        self.credits = self.credits.saturating_add(n).min(self.peer_window);
    }

    /// We reposted one of our slots.
    pub fn reposted(&mut self) {
        self.owed = (self.owed + 1).min(self.window);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediates_round_trip() {
        for kind in [Kind::Data, Kind::Credit, Kind::Fin, Kind::Iomap] {
            for n in [0, 1, 31, MAX_CREDITS] {
                assert_eq!(decode(encode(kind, n)), Some((kind, n)));
            }
        }
        assert_eq!(
            decode(encode(Kind::Fin, u32::MAX)),
            Some((Kind::Fin, MAX_CREDITS))
        );
        assert_eq!(decode(0xf000_0000), None);
    }

    #[test]
    fn hello_and_iomap_round_trip_and_reject_garbage() {
        let h = Hello {
            slots: 32,
            slot_size: 32768,
        };
        let mut pd = h.to_bytes().to_vec();
        pd.extend([0u8; 180]); // REP private data is padded
        assert_eq!(Hello::parse(&pd), Some(h));
        assert_eq!(Hello::parse(&pd[..10]), None);
        assert_eq!(Hello::parse(&[0u8; 56]), None);
        let mut bad = h.to_bytes();
        bad[11] = 1; // one slot: no reserve, no threshold
        bad[10] = 0;
        bad[8] = 0;
        bad[9] = 0;
        assert_eq!(Hello::parse(&bad), None);
        let m = IomapMsg {
            offset: 7,
            addr: 0xdead_beef_0000,
            len: 4096,
            rkey: 0x1234,
        };
        assert_eq!(IomapMsg::parse(&m.to_bytes()), Some(m));
        assert_eq!(IomapMsg::parse(&m.to_bytes()[..27]), None);
    }

    #[test]
    fn data_keeps_one_credit_in_reserve() {
        let mut f = Flow::new(4, 4);
        assert_eq!(f.take_data(), Some(0));
        assert_eq!(f.take_data(), Some(0));
        assert_eq!(f.take_data(), Some(0));
        assert_eq!(f.credits, 1);
        assert!(!f.can_send_data());
        assert_eq!(f.take_data(), None);
        // The reserve still lets us hand back what we owe.
        f.reposted();
        f.reposted();
        assert!(f.want_credit_msg());
        assert_eq!(f.take_credit_msg(), Some(2));
        assert_eq!((f.credits, f.owed), (0, 0));
        assert_eq!(f.take_credit_msg(), None);
        f.returned(3);
        assert_eq!(f.credits, 3);
        f.returned(100);
        assert_eq!(f.credits, 4, "never more than the peer's window");
    }

    #[test]
    fn data_piggybacks_owed_credits() {
        let mut f = Flow::new(8, 8);
        f.reposted();
        assert!(!f.want_credit_msg(), "one slot is not worth a message");
        assert_eq!(f.take_data(), Some(1));
        assert_eq!(f.owed, 0);
    }

    /// Two sides, one streaming data, the other reading it, exchange messages through
    /// queues; neither may stall and the sender's credits never exceed the window.
    #[test]
    fn a_one_way_stream_never_stalls() {
        for window in [MIN_SLOTS, 5, 8, 33] {
            let (mut a, mut b) = (Flow::new(window, window), Flow::new(window, window));
            let mut to_b: std::collections::VecDeque<(Kind, u32)> = Default::default();
            let mut to_a: std::collections::VecDeque<(Kind, u32)> = Default::default();
            let mut b_unread = 0u32; // data slots B holds unread
            let (mut sent, mut read) = (0u32, 0u32);
            let mut idle = 0;
            while read < 1000 {
                let mut moved = false;
                if sent < 1000 {
                    if let Some(c) = a.take_data() {
                        to_b.push_back((Kind::Data, c));
                        sent += 1;
                        moved = true;
                    }
                }
                if let Some(c) = a.take_credit_msg() {
                    to_b.push_back((Kind::Credit, c));
                    moved = true;
                }
                if let Some((k, c)) = to_b.pop_front() {
                    b.returned(c);
                    match k {
                        Kind::Data => b_unread += 1,
                        _ => b.reposted(),
                    }
                    moved = true;
                }
                if b_unread > 0 {
                    b_unread -= 1;
                    read += 1;
                    b.reposted();
                    moved = true;
                }
                if let Some(c) = b.take_credit_msg() {
                    to_a.push_back((Kind::Credit, c));
                    moved = true;
                }
                if let Some((_, c)) = to_a.pop_front() {
                    a.returned(c);
                    a.reposted();
                    moved = true;
                }
                assert!(a.credits <= window && b.credits <= window);
                idle = if moved { 0 } else { idle + 1 };
                assert!(
                    idle < 3,
                    "window {window}: stalled at {read} read, {a:?} {b:?}"
                );
            }
        }
    }
}
