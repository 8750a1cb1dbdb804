//! The seed's compact completion records (`struct ibv_wc_ex`, seed 000).
//!
//! A record is a 32-byte header (`wr_id`, `wc_flags`, `status`, `opcode`, `vendor_err`,
//! reserved) followed by exactly the fields the CQ was created with, largest first (64-, then
//! 32-, 16- and 8-bit fields, each class in flag-bit order), the whole rounded up to 8 bytes.
//! The flag values here are the seed's, not rdma-core's shipped `ibv_create_cq_wc_flags`: the
//! layout formula depends on bit order, so it is kept exactly as the seed wrote it.

use crate::clock::WallClock;
use crate::cq::Cqe;
use crate::types::WcExFlags;
use bitflags::bitflags;

bitflags! {
    /// The seed's `enum ibv_wc_flags_ex`: output flags (bits 0..=3) and the fields a record
    /// carries (bits 4 and up).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SeedWcFlags: u64 {
        /// Output: the receive buffer starts with a GRH.
        const GRH = 1;
        /// Output: the message carried immediate data.
        const IMM = 1 << 1;
        /// Output: the IP checksum was verified.
        const CSUM_OK = 1 << 2;
        /// Output: the message invalidated a key.
        const INV = 1 << 3;
        const WITH_BYTE_LEN = 1 << 4;
        const WITH_IMM = 1 << 5;
        const WITH_QP_NUM = 1 << 6;
        const WITH_SRC_QP = 1 << 7;
        const WITH_PKEY_INDEX = 1 << 8;
        const WITH_SLID = 1 << 9;
        const WITH_SL = 1 << 10;
        const WITH_DLID_PATH_BITS = 1 << 11;
        /// The seed's patch 4/8: raw device-clock value.
        const WITH_COMPLETION_TIMESTAMP = 1 << 12;
        /// softverbs' addition, placed after the seed's 64-bit field as its compatibility rule
        /// asks: the completion time in `CLOCK_REALTIME` nanoseconds.
        const WITH_COMPLETION_TIMESTAMP_WALLCLOCK = 1 << 13;
    }
}

/// The seed's `IBV_WC_EX_WITH_64BIT_FIELDS` (plus the wall clock).
pub const FIELDS_64: u64 = SeedWcFlags::WITH_COMPLETION_TIMESTAMP.bits()
    | SeedWcFlags::WITH_COMPLETION_TIMESTAMP_WALLCLOCK.bits();
/// `IBV_WC_EX_WITH_32BIT_FIELDS`.
pub const FIELDS_32: u64 = SeedWcFlags::WITH_BYTE_LEN.bits()
    | SeedWcFlags::WITH_IMM.bits()
    | SeedWcFlags::WITH_QP_NUM.bits()
    | SeedWcFlags::WITH_SRC_QP.bits();
/// `IBV_WC_EX_WITH_16BIT_FIELDS`.
pub const FIELDS_16: u64 = SeedWcFlags::WITH_PKEY_INDEX.bits() | SeedWcFlags::WITH_SLID.bits();
/// `IBV_WC_EX_WITH_8BIT_FIELDS`.
pub const FIELDS_8: u64 = SeedWcFlags::WITH_SL.bits() | SeedWcFlags::WITH_DLID_PATH_BITS.bits();
/// Output-only flags.
pub const OUTPUT_FLAGS: u64 = 0xf;

/// `sizeof(struct ibv_wc_ex)`: the header before the fields.
pub const HEADER_LEN: usize = 32;

/// The fixed part of a record.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WcExHeader {
    pub wr_id: u64,
    /// Output flags, and the `WITH_*` bits of the fields valid in this record.
    pub wc_flags: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub reserved: u32,
}

const fn popcount(x: u64) -> usize {
    x.count_ones() as usize
}

/// `ibv_wc_ex_get_offsetof64`: offset of 64-bit field `flag` after the header.
#[inline]
pub const fn get_offsetof64(cq_flags: u64, flag: u64) -> usize {
    popcount(cq_flags & FIELDS_64 & flag.wrapping_sub(1)) * 8
}

/// `ibv_wc_ex_get_offsetof32`.
#[inline]
pub const fn get_offsetof32(cq_flags: u64, flag: u64) -> usize {
    popcount(cq_flags & FIELDS_64) * 8 + popcount(cq_flags & FIELDS_32 & flag.wrapping_sub(1)) * 4
}

/// `ibv_wc_ex_get_offsetof16`.
#[inline]
pub const fn get_offsetof16(cq_flags: u64, flag: u64) -> usize {
    popcount(cq_flags & FIELDS_64) * 8
        + popcount(cq_flags & FIELDS_32) * 4
        + popcount(cq_flags & FIELDS_16 & flag.wrapping_sub(1)) * 2
}

/// `ibv_wc_ex_get_offsetof8`.
#[inline]
pub const fn get_offsetof8(cq_flags: u64, flag: u64) -> usize {
    popcount(cq_flags & FIELDS_64) * 8
        + popcount(cq_flags & FIELDS_32) * 4
        + popcount(cq_flags & FIELDS_16) * 2
        + popcount(cq_flags & FIELDS_8 & flag.wrapping_sub(1))
}

/// `ibv_wc_ex_get_size`: bytes of one record, header included.
#[inline]
pub const fn get_size(cq_flags: u64) -> usize {
    let fields = popcount(cq_flags & FIELDS_64) * 8
        + popcount(cq_flags & FIELDS_32) * 4
        + popcount(cq_flags & FIELDS_16) * 2
        + popcount(cq_flags & FIELDS_8);
    fields.next_multiple_of(8) + HEADER_LEN
}

/// The seed flags of the fields a CQ created with `wc_flags` returns: what
/// `compact_flags()` of such a CQ says. A `const fn`, so a program that creates its CQ with
/// constant flags gets the seed's offsets as constants, as the seed's C helpers give them.
pub const fn seed_flags(wc_flags: WcExFlags) -> SeedWcFlags {
    const MAP: [(WcExFlags, SeedWcFlags); 9] = [
        (WcExFlags::BYTE_LEN, SeedWcFlags::WITH_BYTE_LEN),
        (WcExFlags::IMM, SeedWcFlags::WITH_IMM),
        (WcExFlags::QP_NUM, SeedWcFlags::WITH_QP_NUM),
        (WcExFlags::SRC_QP, SeedWcFlags::WITH_SRC_QP),
        (WcExFlags::SLID, SeedWcFlags::WITH_SLID),
        (WcExFlags::SL, SeedWcFlags::WITH_SL),
        (WcExFlags::DLID_PATH_BITS, SeedWcFlags::WITH_DLID_PATH_BITS),
        (
            WcExFlags::COMPLETION_TIMESTAMP,
            SeedWcFlags::WITH_COMPLETION_TIMESTAMP,
        ),
        (
            WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK,
            SeedWcFlags::WITH_COMPLETION_TIMESTAMP_WALLCLOCK,
        ),
    ];
    let mut seed = 0;
    let mut i = 0;
    while i < MAP.len() {
        if wc_flags.contains(MAP[i].0) {
            seed |= MAP[i].1.bits();
        }
        i += 1;
    }
    SeedWcFlags::from_bits_retain(seed)
}

/// Where each field of a CQ's records lies: worked out once per CQ so filling a record is
/// straight-line stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    flags: u64,
    // Bytes (a record is at most 72, so a byte each: the whole layout is two words, cheap to
    // keep in registers while filling records).
    size: u8,
    /// Header plus fields: the rest of the record is padding.
    used: u8,
    // Offsets from the record start. An absent field's offset is 0: it is written into the
    // header's place, which the header then overwrites, so filling has no per-field branch.
    ts: u8,
    wall: u8,
    byte_len: u8,
    imm: u8,
    qp_num: u8,
    src_qp: u8,
    pkey_index: u8,
    slid: u8,
    sl: u8,
    dlid_path_bits: u8,
    /// All four 32-bit fields are present.
    all32: bool,
}

/// A record offset or size as a byte: with only the seed's fields (masked in `Layout::new`)
/// a record is at most 72 bytes.
const fn small(v: usize) -> u8 {
    debug_assert!(v <= 72);
    v as u8
}

/// Fields that mean nothing on a send-side completion (verbs fills them for receives only).
const RECV_ONLY: u64 = SeedWcFlags::WITH_IMM.bits()
    | SeedWcFlags::WITH_SRC_QP.bits()
    | SeedWcFlags::WITH_PKEY_INDEX.bits()
    | SeedWcFlags::WITH_SLID.bits()
    | SeedWcFlags::WITH_SL.bits()
    | SeedWcFlags::WITH_DLID_PATH_BITS.bits();
/// Fields valid on a failed completion besides the header.
const ON_ERROR: u64 = SeedWcFlags::WITH_QP_NUM.bits() | FIELDS_64;

impl Layout {
    /// The layout for CQ creation flags `flags` (output-only bits, and bits that name no
    /// field, are ignored: a record's header never claims a field the record lacks).
    pub fn new(flags: SeedWcFlags) -> Layout {
        let f = flags.bits() & (FIELDS_64 | FIELDS_32 | FIELDS_16 | FIELDS_8);
        let at = |present: u64, off: usize| {
            small(if f & present != 0 {
                HEADER_LEN + off
            } else {
                0
            })
        };
        use SeedWcFlags as S;
        Layout {
            flags: f,
            size: small(get_size(f)),
            used: small(
                HEADER_LEN
                    + popcount(f & FIELDS_64) * 8
                    + popcount(f & FIELDS_32) * 4
                    + popcount(f & FIELDS_16) * 2
                    + popcount(f & FIELDS_8),
            ),
            ts: at(
                S::WITH_COMPLETION_TIMESTAMP.bits(),
                get_offsetof64(f, S::WITH_COMPLETION_TIMESTAMP.bits()),
            ),
            wall: at(
                S::WITH_COMPLETION_TIMESTAMP_WALLCLOCK.bits(),
                get_offsetof64(f, S::WITH_COMPLETION_TIMESTAMP_WALLCLOCK.bits()),
            ),
            byte_len: at(
                S::WITH_BYTE_LEN.bits(),
                get_offsetof32(f, S::WITH_BYTE_LEN.bits()),
            ),
            imm: at(S::WITH_IMM.bits(), get_offsetof32(f, S::WITH_IMM.bits())),
            qp_num: at(
                S::WITH_QP_NUM.bits(),
                get_offsetof32(f, S::WITH_QP_NUM.bits()),
            ),
            src_qp: at(
                S::WITH_SRC_QP.bits(),
                get_offsetof32(f, S::WITH_SRC_QP.bits()),
            ),
            pkey_index: at(
                S::WITH_PKEY_INDEX.bits(),
                get_offsetof16(f, S::WITH_PKEY_INDEX.bits()),
            ),
            slid: at(S::WITH_SLID.bits(), get_offsetof16(f, S::WITH_SLID.bits())),
            sl: at(S::WITH_SL.bits(), get_offsetof8(f, S::WITH_SL.bits())),
            dlid_path_bits: at(
                S::WITH_DLID_PATH_BITS.bits(),
                get_offsetof8(f, S::WITH_DLID_PATH_BITS.bits()),
            ),
            all32: f & FIELDS_32 == FIELDS_32,
        }
    }

    /// The CQ creation flags this layout is for.
    pub fn flags(&self) -> SeedWcFlags {
        SeedWcFlags::from_bits_retain(self.flags)
    }

    /// Bytes per record.
    pub fn size(&self) -> usize {
        usize::from(self.size)
    }

    /// Writes `cqe` as one record at the start of `rec` (which must hold
    /// [`size`](Self::size) bytes). `wall` converts the timestamp when the layout has the
    /// wall-clock field.
    #[inline]
    pub fn fill(&self, rec: &mut [u8], cqe: &Cqe, wall: Option<&WallClock>) {
        let size = usize::from(self.size);
        let Some(rec) = rec.get_mut(..size) else {
            return; // too short: nothing written (poll_compact never passes one)
        };
        // Padding up to the 8-byte boundary: zero, so records never leak older bytes. One
        // 8-byte store over the record's last word (fields written below overwrite their
        // part of it; in a header-only record the header does), not a variable-length fill.
        put(rec, size - 8, [0; 8]);
        put(rec, usize::from(self.ts), cqe.timestamp.to_ne_bytes());
        let wall_ns = wall.map_or(0, |w| w.ns(cqe.timestamp));
        put(rec, usize::from(self.wall), wall_ns.to_ne_bytes());
        if self.all32 {
            // The four 32-bit fields lie in the completion in the record's order: one copy.
            let mut block = [0u8; 16];
            block[0..4].copy_from_slice(&cqe.byte_len.to_ne_bytes());
            block[4..8].copy_from_slice(&cqe.imm_data.to_ne_bytes());
            block[8..12].copy_from_slice(&cqe.qp_num.to_ne_bytes());
            block[12..16].copy_from_slice(&cqe.src_qp.to_ne_bytes());
            put(rec, usize::from(self.byte_len), block);
        } else {
            put(rec, usize::from(self.byte_len), cqe.byte_len.to_ne_bytes());
            put(rec, usize::from(self.imm), cqe.imm_data.to_ne_bytes());
            put(rec, usize::from(self.qp_num), cqe.qp_num.to_ne_bytes());
            put(rec, usize::from(self.src_qp), cqe.src_qp.to_ne_bytes());
        }
        if self.pkey_index != 0 {
            put(
                rec,
                usize::from(self.pkey_index),
                cqe.pkey_index.to_ne_bytes(),
            );
        }
        put(rec, usize::from(self.slid), cqe.slid.to_ne_bytes());
        put(rec, usize::from(self.sl), [cqe.sl]);
        put(rec, usize::from(self.dlid_path_bits), [cqe.dlid_path_bits]);
        // The header last: it overwrites whatever absent fields left at offset 0.
        let mut valid = self.flags;
        if cqe.status != 0 {
            valid &= ON_ERROR;
        } else if !cqe.is_recv() {
            valid &= !RECV_ONLY;
        }
        let flags = valid | (u64::from(cqe.wc_flags) & OUTPUT_FLAGS);
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(&cqe.wr_id.to_ne_bytes());
        h[8..16].copy_from_slice(&flags.to_ne_bytes());
        h[16..24].copy_from_slice(&pair(u32::from(cqe.status), u32::from(cqe.opcode)));
        h[24..32].copy_from_slice(&pair(cqe.vendor_err, 0));
        rec[..HEADER_LEN].copy_from_slice(&h);
    }
}

/// Two 32-bit words side by side, as one 8-byte store (the header is four stores, not six).
#[inline(always)]
fn pair(a: u32, b: u32) -> [u8; 8] {
    let (a, b) = (a.to_ne_bytes(), b.to_ne_bytes());
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// Stores `bytes` at `off` (offsets come from the layout, so they always fit the record;
/// out of range would be a layout bug, and is ignored rather than a panic).
#[inline(always)]
fn put<const N: usize>(rec: &mut [u8], off: usize, bytes: [u8; N]) {
    // Clamped rather than checked: a record is at least the header, and the layout's offsets
    // always fit, so the clamp never moves a store; it only lets the compiler drop the bounds
    // check (and its branch) from every store of every record.
    if rec.len() < HEADER_LEN {
        return;
    }
    let at = off.min(rec.len() - N);
    rec[at..at + N].copy_from_slice(&bytes);
}

/// The header of the record at the start of `rec` (zeros where `rec` is short).
#[inline]
pub fn header(rec: &[u8]) -> WcExHeader {
    // One length check for the whole header, then fixed offsets in a fixed-size array.
    let Some(h) = rec.first_chunk::<HEADER_LEN>() else {
        return WcExHeader::default();
    };
    let w64 = |o: usize| u64::from_ne_bytes(read(h, o));
    let w32 = |o: usize| u32::from_ne_bytes(read(h, o));
    WcExHeader {
        wr_id: w64(0),
        wc_flags: w64(8),
        status: w32(16),
        opcode: w32(20),
        vendor_err: w32(24),
        reserved: w32(28),
    }
}

/// `N` bytes at `off` of `rec`: zeros when the record is shorter than `N`; an offset past the
/// end reads the record's last `N` bytes. Clamped rather than checked, so a field read is a
/// load and a cmov, never out of bounds and never a panic (a wrong offset is the caller's
/// bug, and gets wrong bytes either way).
#[inline(always)]
fn read<const N: usize>(rec: &[u8], off: usize) -> [u8; N] {
    let Some(last) = rec.len().checked_sub(N) else {
        return [0; N];
    };
    let at = off.min(last);
    let mut v = [0; N];
    v.copy_from_slice(&rec[at..at + N]);
    v
}

/// The first `n` records of `buf`, each `size` bytes (`get_size` of the CQ's flags): what
/// `poll_ex` returned. Steps by offsets (no division), stopping early if `buf` is short.
#[inline]
pub fn records(buf: &[u8], size: usize, n: usize) -> impl Iterator<Item = &[u8]> {
    let mut rest = buf;
    (0..n).map_while(move |_| {
        let (rec, tail) = rest.split_at_checked(size)?;
        rest = tail;
        Some(rec)
    })
}

/// The 64-bit field at byte `off` of a record, `off` being `HEADER_LEN` plus a
/// `get_offsetof64` result worked out once per CQ: in a polling loop this is one load, where
/// [`get64`] recomputes the offset for every record. Never reads outside `rec` (see `read`).
#[inline(always)]
pub fn read64(rec: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(read(rec, off))
}

/// [`read64`] for a 32-bit field.
#[inline(always)]
pub fn read32(rec: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(read(rec, off))
}

/// [`read64`] for a 16-bit field.
#[inline(always)]
pub fn read16(rec: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes(read(rec, off))
}

/// [`read64`] for an 8-bit field.
#[inline(always)]
pub fn read8(rec: &[u8], off: usize) -> u8 {
    read::<1>(rec, off)[0]
}

/// `ibv_wc_ex_get64`: 64-bit field `flag` of the record `rec` from a CQ created with
/// `cq_flags`.
#[inline]
pub fn get64(rec: &[u8], cq_flags: u64, flag: u64) -> u64 {
    read64(rec, HEADER_LEN + get_offsetof64(cq_flags, flag))
}

/// `ibv_wc_ex_get32`.
#[inline]
pub fn get32(rec: &[u8], cq_flags: u64, flag: u64) -> u32 {
    read32(rec, HEADER_LEN + get_offsetof32(cq_flags, flag))
}

/// `ibv_wc_ex_get16`.
#[inline]
pub fn get16(rec: &[u8], cq_flags: u64, flag: u64) -> u16 {
    read16(rec, HEADER_LEN + get_offsetof16(cq_flags, flag))
}

/// `ibv_wc_ex_get8`.
#[inline]
pub fn get8(rec: &[u8], cq_flags: u64, flag: u64) -> u8 {
    read8(rec, HEADER_LEN + get_offsetof8(cq_flags, flag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_the_seeds_struct() {
        assert_eq!(std::mem::size_of::<WcExHeader>(), HEADER_LEN);
    }

    #[test]
    fn one_of_each_size() {
        use SeedWcFlags as S;
        let f = (S::WITH_SL | S::WITH_SLID | S::WITH_QP_NUM | S::WITH_COMPLETION_TIMESTAMP).bits();
        assert_eq!(get_offsetof64(f, S::WITH_COMPLETION_TIMESTAMP.bits()), 0);
        assert_eq!(get_offsetof32(f, S::WITH_QP_NUM.bits()), 8);
        assert_eq!(get_offsetof16(f, S::WITH_SLID.bits()), 12);
        assert_eq!(get_offsetof8(f, S::WITH_SL.bits()), 14);
        assert_eq!(get_size(f), HEADER_LEN + 16);
        assert_eq!(get_size(0), HEADER_LEN);
    }

    #[test]
    fn fill_places_fields_and_zeroes_padding() {
        use SeedWcFlags as S;
        let l = Layout::new(S::WITH_BYTE_LEN | S::WITH_SL | S::WITH_IMM);
        assert_eq!(l.size(), HEADER_LEN + 16);
        let mut rec = [0xaau8; 64];
        let cqe = Cqe {
            wr_id: 7,
            byte_len: 100,
            imm_data: 0x1234,
            sl: 3,
            opcode: 0x81,
            wc_flags: 2,
            ..Default::default()
        };
        l.fill(&mut rec, &cqe, None);
        let h = header(&rec);
        assert_eq!((h.wr_id, h.opcode, h.status), (7, 0x81, 0));
        assert_eq!(h.wc_flags, l.flags().bits() | S::IMM.bits());
        let f = l.flags().bits();
        assert_eq!(get32(&rec, f, S::WITH_BYTE_LEN.bits()), 100);
        assert_eq!(get32(&rec, f, S::WITH_IMM.bits()), 0x1234);
        assert_eq!(get8(&rec, f, S::WITH_SL.bits()), 3);
        assert!(rec[HEADER_LEN + 9..HEADER_LEN + 16].iter().all(|&b| b == 0));
        assert_eq!(
            rec[HEADER_LEN + 16],
            0xaa,
            "nothing written past the record"
        );
    }
}
