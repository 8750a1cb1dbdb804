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
/// The largest record: the header and every field of the seed's (plus the wall clock).
pub const MAX_RECORD: usize = 72;

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
    // Offsets from the record start (0 for an absent field).
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
    /// [`groups`](Self::groups).
    groups: u8,
}

/// A record offset or size as a byte: with only the seed's fields (masked in `Layout::new`)
/// a record is at most [`MAX_RECORD`] bytes.
const fn small(v: usize) -> u8 {
    debug_assert!(v <= MAX_RECORD);
    v as u8
}

// `Layout::groups` bits: the record has 64-, 32-, 16- or 8-bit fields.
pub(crate) const GROUP_64: u8 = 1;
pub(crate) const GROUP_32: u8 = 1 << 1;
pub(crate) const GROUP_16: u8 = 1 << 2;
pub(crate) const GROUP_8: u8 = 1 << 3;
pub(crate) const GROUPS_ALL: u8 = 0xf;

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
        let layout = Layout {
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
            groups: [
                (FIELDS_64, GROUP_64),
                (FIELDS_32, GROUP_32),
                (FIELDS_16, GROUP_16),
                (FIELDS_8, GROUP_8),
            ]
            .iter()
            .filter(|(fields, _)| f & fields != 0)
            .fold(0, |g, (_, bit)| g | bit),
        };
        // `fill_groups` stores without bounds checks on the strength of this.
        assert!(layout.fits(), "compact layout of {f:#x} outside its record");
        layout
    }

    /// Every store `fill_groups` makes for this layout ends within the record.
    fn fits(&self) -> bool {
        let size = usize::from(self.size);
        let block32 = if self.all32 { 16 } else { 4 };
        let fields = [
            (self.ts, 8),
            (self.wall, 8),
            (self.byte_len, block32),
            (self.imm, 4),
            (self.qp_num, 4),
            (self.src_qp, 4),
            (self.pkey_index, 2),
            (self.slid, 2),
            (self.sl, 1),
            (self.dlid_path_bits, 1),
        ];
        (HEADER_LEN..=MAX_RECORD).contains(&size)
            && size % 8 == 0
            && fields.iter().all(|&(off, n)| usize::from(off) + n <= size)
    }

    /// The CQ creation flags this layout is for.
    pub fn flags(&self) -> SeedWcFlags {
        SeedWcFlags::from_bits_retain(self.flags)
    }

    /// Bytes per record.
    pub fn size(&self) -> usize {
        usize::from(self.size)
    }

    /// The layout has field `flag`.
    #[inline(always)]
    fn has(&self, flag: SeedWcFlags) -> bool {
        self.flags & flag.bits() != 0
    }

    /// Which field classes the records have (`GROUP_*` bits).
    pub(crate) fn groups(&self) -> u8 {
        self.groups
    }

    /// Writes `cqe` as one record at the start of `rec` (which must hold
    /// [`size`](Self::size) bytes). `wall` converts the timestamp when the layout has the
    /// wall-clock field.
    #[inline]
    pub fn fill(&self, rec: &mut [u8], cqe: &Cqe, wall: Option<&WallClock>) {
        self.fill_groups::<GROUPS_ALL>(rec, cqe, wall);
    }

    /// [`fill`](Self::fill) for a layout whose [`groups`](Self::groups) are among `G`: the
    /// code for the classes outside `G` is left out (a poll picks the variant once, so a CQ
    /// with few fields pays only for those). `G` must cover the layout's groups.
    #[inline(always)]
    pub(crate) fn fill_groups<const G: u8>(
        &self,
        rec: &mut [u8],
        cqe: &Cqe,
        wall: Option<&WallClock>,
    ) {
        debug_assert_eq!(self.groups() & !G, 0, "fill variant misses field classes");
        use SeedWcFlags as S;
        let size = usize::from(self.size);
        let Some(rec) = rec.get_mut(..size) else {
            return; // too short: nothing written (poll_compact never passes one)
        };
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
        // Field `$f` at the layout's offset `$off`, if the layout has it.
        macro_rules! field {
            ($f:ident, $off:ident, $bytes:expr) => {
                put_field(rec, self.has(S::$f), self.$off, $bytes)
            };
        }
        // SAFETY: `rec` is exactly `size` bytes, and `Layout::new` checked (`fits`) that
        // every store below ends within `size` bytes: the header at 0, the padding word at
        // `size - 8` (`size` >= HEADER_LEN), and each present field at its offset.
        unsafe {
            // Padding up to the 8-byte boundary: zero, so records never leak older bytes. One
            // 8-byte store over the record's last word (fields written below overwrite their
            // part of it), not a variable-length fill; a header-only record has none.
            if G != 0 {
                put(rec, size - 8, [0; 8]);
            }
            // Within a class, an absent field is skipped by a branch that goes the same way
            // for every record of the CQ.
            if G & GROUP_64 != 0 {
                field!(WITH_COMPLETION_TIMESTAMP, ts, cqe.timestamp.to_ne_bytes());
                if self.has(S::WITH_COMPLETION_TIMESTAMP_WALLCLOCK) {
                    let wall_ns = wall.map_or(0, |w| w.ns(cqe.timestamp));
                    put(rec, usize::from(self.wall), wall_ns.to_ne_bytes());
                }
            }
            if G & GROUP_32 == 0 {
            } else if self.all32 {
                // The four 32-bit fields lie in the completion in the record's order: one
                // 16-byte store.
                let mut block = [0u8; 16];
                block[0..4].copy_from_slice(&cqe.byte_len.to_ne_bytes());
                block[4..8].copy_from_slice(&cqe.imm_data.to_ne_bytes());
                block[8..12].copy_from_slice(&cqe.qp_num.to_ne_bytes());
                block[12..16].copy_from_slice(&cqe.src_qp.to_ne_bytes());
                put(rec, usize::from(self.byte_len), block);
            } else {
                field!(WITH_BYTE_LEN, byte_len, cqe.byte_len.to_ne_bytes());
                field!(WITH_IMM, imm, cqe.imm_data.to_ne_bytes());
                field!(WITH_QP_NUM, qp_num, cqe.qp_num.to_ne_bytes());
                field!(WITH_SRC_QP, src_qp, cqe.src_qp.to_ne_bytes());
            }
            if G & GROUP_16 != 0 {
                field!(WITH_PKEY_INDEX, pkey_index, cqe.pkey_index.to_ne_bytes());
                field!(WITH_SLID, slid, cqe.slid.to_ne_bytes());
            }
            if G & GROUP_8 != 0 {
                field!(WITH_SL, sl, [cqe.sl]);
                field!(WITH_DLID_PATH_BITS, dlid_path_bits, [cqe.dlid_path_bits]);
            }
            put(rec, 0, h);
        }
    }
}

/// Two 32-bit words side by side, as one 8-byte store (the header is four stores, not six).
#[inline(always)]
fn pair(a: u32, b: u32) -> [u8; 8] {
    let (a, b) = (a.to_ne_bytes(), b.to_ne_bytes());
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// Stores field `bytes` at layout offset `off` if the field is `present`.
///
/// # Safety
/// As [`put`].
#[inline(always)]
unsafe fn put_field<const N: usize>(rec: &mut [u8], present: bool, off: u8, bytes: [u8; N]) {
    if present {
        // SAFETY: the caller's, as for `put`.
        unsafe { put(rec, usize::from(off), bytes) }
    }
}

/// Stores `bytes` at `off` of `rec`, without a bounds check (a record's stores, from its
/// layout's offsets, are its fill's hot path).
///
/// # Safety
/// `off + N <= rec.len()`.
#[inline(always)]
unsafe fn put<const N: usize>(rec: &mut [u8], off: usize, bytes: [u8; N]) {
    debug_assert!(off + N <= rec.len());
    // SAFETY: the caller's: the `N` bytes at `off` lie within `rec`, which we borrow mutably;
    // an unaligned write of a byte array needs no alignment.
    unsafe {
        rec.as_mut_ptr()
            .add(off)
            .cast::<[u8; N]>()
            .write_unaligned(bytes)
    }
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

    /// Every combination of fields, filled into a buffer exactly one record long (so Miri
    /// sees any store outside it) through the generic fill and through the variant a poll
    /// picks for the layout's field classes: the same bytes, and a header that says so.
    #[test]
    fn every_layout_fills_within_its_record_and_every_variant_agrees() {
        let cqes = [(0u8, 0u8), (0x80, 0), (0x81, 0), (2, 5)].map(|(opcode, status)| Cqe {
            wr_id: 0x0102_0304_0506_0708,
            timestamp: 0x1111_2222_3333_4444,
            byte_len: 0x5555_6666,
            imm_data: 0x7777_8888,
            qp_num: 0x99,
            src_qp: 0xaa,
            vendor_err: 0xbb,
            slid: 0xcccc,
            pkey_index: 0xdddd,
            status,
            opcode,
            wc_flags: 0xf,
            sl: 0xe,
            dlid_path_bits: 0x7f,
            ..Default::default()
        });
        let wall = WallClock::default();
        // Miri runs a sample; natively, all 1024.
        let step = if cfg!(miri) { 5 } else { 1 };
        for combo in (0u64..1 << 10).step_by(step) {
            let l = Layout::new(SeedWcFlags::from_bits_retain(combo << 4));
            assert!(l.fits());
            for cqe in &cqes {
                let mut generic = vec![0xa5u8; l.size()];
                l.fill(&mut generic, cqe, Some(&wall));
                let mut picked = vec![0x5au8; l.size()];
                macro_rules! by_groups {
                    ($($g:literal)*) => {
                        match l.groups() {
                            $($g => l.fill_groups::<$g>(&mut picked, cqe, Some(&wall)),)*
                            _ => unreachable!(),
                        }
                    };
                }
                by_groups!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
                assert_eq!(generic, picked, "flags {:#x}, {cqe:?}", combo << 4);
                assert_eq!(header(&generic).wr_id, cqe.wr_id);
            }
        }
    }
}
