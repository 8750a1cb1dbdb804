//! Non-contiguous memory layouts (seed 002 and its replies): the pure engine.
//!
//! A layout turns a zero-based memory region (the "container", a zero-length `ZERO_BASED` MR
//! in the seed's examples) into a sequence of bytes scattered across other regions. This
//! module knows nothing of keys, protection domains or memory: it works on abstract
//! [`Datum`]s (`key`, `addr`, `len`) and maps a byte range of the layout to [`Piece`]s of the
//! underlying regions. The NIC checks every piece's key, bounds and rights, and moves the
//! bytes.
//!
//! Three forms, each compiled once into a [`Compiled`] descriptor whose size never depends on
//! how many data it describes:
//!
//! - **Scatter-gather** ([`Layout::Sg`], `ibv_mr_set_layout_sg`): the data one after another.
//!   Stored as the list plus prefix sums; a range is found by binary search.
//! - **Interleaved** ([`Layout::Interleaved`], `ibv_mr_set_layout_interleaved`): repeating
//!   strided patterns taken round-robin. Stored as the pattern (entries, dimensions, and at
//!   most `2n + 1` "phases"), never expanded; a range is found with `O(log n + n + dims)`
//!   arithmetic and every further datum costs `O(dims)`.
//! - **Page lists** ([`Compiled::from_pages`], [`Compiled::from_bitmap`]): the reply thread's
//!   paravirtual registration of pages that are not contiguous in the process. A page list is
//!   stored as runs of contiguous pages; a bitmap is stored as itself plus a rank table (one
//!   `u64` per 64 pages), never as a list of pages.
//!
//! # Reading of the seed's interleaved pseudo-code
//!
//! The man page gives, for one dimension:
//!
//! ```text
//! foreach(entry in interleaved_list):
//!         foreach(i from 0 to num_repeated):
//!                 Read from entry.first_datum.addr (entry.first_datum.length Bytes)
//!                 entry.first_datum.addr += entry.dims[0].offset_stride
//! ```
//!
//! repeated until the data run out. This module reads it as follows.
//!
//! - **Round-robin cycles.** The layout is a sequence of *cycles*. In each cycle the entries
//!   are visited in list order, and entry `j` yields `num_repeated[j]` consecutive data ("this
//!   entry would be visited this amount of times consecutively on each round-robin cycle").
//!   `num_repeated = r` is therefore the same as writing the entry `r` times in a row, except
//!   that the copies share one cursor.
//! - **Dimensions.** `dims[0]` is the innermost. Entry `j`'s datum number `k` (counting from
//!   0) has the mixed-radix digits `k_0 = k % count_0`, `k_1 = (k / count_0) % count_1`, ...
//!   and starts at `first.addr + k_0 * stride_0 + k_1 * stride_1 + ...`. So after each datum the
//!   address moves by `stride_0`, `count_0` times; then `dims[1]` moves the *base* (the start
//!   of the first datum of the run) by `stride_1` and the inner run starts again, and so on.
//!   Strides are distances between base pointers (as the man page says), not increments on
//!   top of where the inner dimension ended. An entry holds `count_0 * count_1 * ...` data of
//!   `first.len` bytes each.
//! - **Different totals.** When entries run out at different cycles (the seed's cap flag
//!   `INTERLEAVED_NONUNIFORM_DATUM_TOTAL`), an exhausted entry simply drops out of the
//!   round-robin: a cycle visits only the entries that still have data, an entry with fewer
//!   than `num_repeated` data left yields what it has, and **the layout ends when every entry
//!   is exhausted**. Every datum of every entry is in the layout exactly once, and the
//!   layout's length is the sum over entries of `data * first.len`. A shape is *uniform* when
//!   all entries last the same whole number of cycles (`total_j = C * num_repeated_j` for one
//!   `C`); any other shape needs that cap flag, else the call fails with
//!   [`LayoutError::Unsupported`] (the software NIC advertises it, so by default it is
//!   accepted).
//! - **Overlap.** Data may overlap each other (the swap example reads odd and even items
//!   through two entries over the same buffer) and a stride may be smaller than the datum,
//!   or 0 (the same datum repeated). The engine allows all of it; what overlapping writes
//!   leave behind is the writer's business, as for overlapping SGEs.
//!
//! # Nesting
//!
//! A datum's key may itself carry a layout; its `addr` is then an offset into that layout
//! (layout containers are zero-based). The *nesting level* of a layout is 1 plus the highest
//! level among the layouts its data refer to (a plain MR counts 0), so a layout over plain MRs
//! is level 1 and an SG of interleaved layouts is level 2. A device allows levels up to
//! [`LayoutCaps::max_nesting_level`]; at set-layout time a deeper layout is
//! [`LayoutError::Unsupported`], and at resolve time (the inner layout may have been replaced
//! since, even by one that loops back) [`Compiled::resolve_nested`] fails with
//! [`LayoutError::TooDeep`] instead of looping.
//!
//! # Results and errno
//!
//! The seed's `enum ibv_mr_set_layout_err_code` is [`LayoutError::code`]: `Input` (-1; the old
//! layout remains valid: compiling is pure, so a failed call never touches the MR),
//! `WouldInvalidate` (-2) and `Unsupported` (-3). [`LayoutError::errno`] maps them to EINVAL,
//! EBUSY and EOPNOTSUPP; the two data-path errors ([`LayoutError::OutOfBounds`],
//! [`LayoutError::TooDeep`]) map to EFAULT and ELOOP (the NIC turns them into a protection or
//! remote-access completion status instead).
//!
//! All arithmetic on caller input is checked: an overflow is an input error, never a panic.

use bitflags::bitflags;
use std::ops::Deref;

/// The key of a datum that is a plain buffer of the container's owner, not part of another
/// MR (the thread's "SGEs without keys", registered with the container's access rights when
/// [`SetLayoutFlags::REGISTER_BUFFERS`] is given; page-list layouts use it for every piece).
/// Key-table index 0 is never allocated, so no real key equals it.
pub const PLAIN_KEY: u32 = 0;

/// Nesting beyond this is refused whatever the caps say, so a resolve never recurses deeper.
pub const HARD_MAX_NESTING: u32 = 64;

/// One contiguous datum: `len` bytes at `addr` of the region with key `key` (an `ibv_sge`).
/// For a key that is itself a layout, `addr` is a zero-based offset into that layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Datum {
    pub key: u32,
    pub addr: u64,
    pub len: u64,
}

impl Datum {
    pub const fn new(key: u32, addr: u64, len: u64) -> Datum {
        Datum { key, addr, len }
    }
}

/// One dimension of an interleaved entry (`struct ibv_mr_layout_interleved_dimensions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Dim {
    /// Distance between the starts of two consecutive items of this dimension.
    pub offset_stride: u64,
    /// Number of items in this dimension (never 0).
    pub datum_count: u64,
}

impl Dim {
    pub const fn new(offset_stride: u64, datum_count: u64) -> Dim {
        Dim {
            offset_stride,
            datum_count,
        }
    }
}

/// One entry of an interleaved layout (`struct ibv_mr_layout_interleaved`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InterleavedEntry {
    /// The first datum: its key, start and length (the length of every datum of the entry).
    pub first: Datum,
    /// Data taken consecutively from this entry in each round-robin cycle (at least 1).
    pub num_repeated: u32,
    /// Dimensions, innermost first (at least one).
    pub dims: Vec<Dim>,
}

impl InterleavedEntry {
    /// An entry visited once per cycle.
    pub fn new(first: Datum, dims: Vec<Dim>) -> InterleavedEntry {
        InterleavedEntry {
            first,
            num_repeated: 1,
            dims,
        }
    }

    /// The same entry, visited `n` times consecutively per cycle.
    pub fn repeated(mut self, n: u32) -> InterleavedEntry {
        self.num_repeated = n;
        self
    }
}

/// A layout as the caller describes it, before validation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `ibv_mr_set_layout_sg`: the data back to back, in order.
    Sg(Vec<Datum>),
    /// `ibv_mr_set_layout_interleaved`: round-robin over strided entries.
    Interleaved(Vec<InterleavedEntry>),
}

/// A contiguous piece of an underlying region that a layout range maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Piece {
    pub key: u32,
    pub addr: u64,
    pub len: u64,
}

/// `count` pieces of `len` bytes of one region, piece `i` at `addr + i * stride`: a column of
/// a matrix is one run, however many rows it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Run {
    pub key: u32,
    pub addr: u64,
    pub len: u64,
    pub stride: u64,
    pub count: u64,
}

impl Run {
    /// One piece as a run.
    pub fn one(p: Piece) -> Run {
        Run {
            key: p.key,
            addr: p.addr,
            len: p.len,
            stride: 0,
            count: 1,
        }
    }
}

bitflags! {
    /// `enum ibv_mr_layout_cap_flags` (bits 0..=4 are the seed's), plus the reply thread's
    /// extensions.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct LayoutCapFlags: u64 {
        const SG = 1 << 0;
        const INTERLEAVED = 1 << 1;
        /// `num_repeated > 1`.
        const INTERLEAVED_REPEAT = 1 << 2;
        /// `num_repeated` differing between entries.
        const INTERLEAVED_NONUNIFORM_REPEAT = 1 << 3;
        /// Entries lasting different numbers of cycles (see the module docs).
        const INTERLEAVED_NONUNIFORM_DATUM_TOTAL = 1 << 4;
        /// Data without keys, registered inside the call ([`SetLayoutFlags::REGISTER_BUFFERS`]).
        const INTERNAL_REGISTRATION = 1 << 5;
        /// Page-list registration ([`Compiled::from_pages`]).
        const PAGE_LIST = 1 << 6;
        /// Bitmap page registration ([`Compiled::from_bitmap`]).
        const PAGE_BITMAP = 1 << 7;
    }

    /// `enum ibv_mr_set_layout_flags` (bits 0..=1 are the seed's), plus the reply thread's
    /// `REGISTER_BUFFERS`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SetLayoutFlags: u32 {
        /// The layout takes effect at a bind work request on a QP (the engine ignores it).
        const WITH_POST_WR = 1 << 0;
        /// Fail with [`LayoutError::WouldInvalidate`] instead of changing the keys.
        const AVOID_INVALIDATION = 1 << 1;
        /// Data whose key is [`PLAIN_KEY`] are plain buffers, registered with the container's
        /// access rights.
        const REGISTER_BUFFERS = 1 << 2;
    }
}

/// `struct ibv_mr_layout_caps`, what a device supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutCaps {
    pub cap_flags: LayoutCapFlags,
    /// Most data in an SG layout.
    pub max_sg: u32,
    /// SG layouts up to this many data fit in the key entry itself (never change the keys).
    pub max_inline_sg: u32,
    /// Most entries in an interleaved layout.
    pub max_interleaved: u32,
    /// Interleaved layouts up to this many entries fit in the key entry itself.
    pub max_inline_interleaved: u32,
    /// Most dimensions per interleaved entry (`max_mr_stride_dimenson`).
    pub max_dims: u32,
    /// Deepest nesting level (a layout over plain MRs is level 1).
    pub max_nesting_level: u32,
    /// Largest `num_repeated`.
    pub max_repeat: u32,
}

impl LayoutCaps {
    pub const DEFAULT_MAX_SG: u32 = 4096;
    pub const DEFAULT_MAX_INLINE_SG: u32 = 16;
    pub const DEFAULT_MAX_INTERLEAVED: u32 = 256;
    pub const DEFAULT_MAX_INLINE_INTERLEAVED: u32 = 4;
    pub const DEFAULT_MAX_DIMS: u32 = 8;
    pub const DEFAULT_MAX_NESTING_LEVEL: u32 = 4;
    pub const DEFAULT_MAX_REPEAT: u32 = 1 << 16;

    /// The software NIC's caps: every flag, the default limits.
    pub const DEFAULT: LayoutCaps = LayoutCaps {
        cap_flags: LayoutCapFlags::all(),
        max_sg: Self::DEFAULT_MAX_SG,
        max_inline_sg: Self::DEFAULT_MAX_INLINE_SG,
        max_interleaved: Self::DEFAULT_MAX_INTERLEAVED,
        max_inline_interleaved: Self::DEFAULT_MAX_INLINE_INTERLEAVED,
        max_dims: Self::DEFAULT_MAX_DIMS,
        max_nesting_level: Self::DEFAULT_MAX_NESTING_LEVEL,
        max_repeat: Self::DEFAULT_MAX_REPEAT,
    };

    /// Whether setting `new` on an MR whose key entry has `room` slots allotted (0 for a
    /// fresh MR) keeps its keys, and the room afterwards.
    ///
    /// The seed: "storing the layout may require additional space, causing ... the
    /// invalidation of previous local and remote keys". Here a layout needs
    /// [`Compiled::slots`] slots; up to `max_inline_sg` / `max_inline_interleaved` of them fit
    /// in the key entry itself, more need an allotment, and an allotment only grows. A layout
    /// that fits in `max(room, inline)` keeps the keys; otherwise the keys change and the room
    /// becomes `new.slots()` — unless `flags` has `AVOID_INVALIDATION`, which makes this
    /// [`LayoutError::WouldInvalidate`]. (So the seed's promise holds: setting a layout with the
    /// same counts as before never invalidates. Unlike the seed's hardware, `num_repeated` and
    /// `datum_count` never need room: the pattern is stored, not expanded.)
    pub fn check_replace(
        &self,
        flags: SetLayoutFlags,
        room: u64,
        new: &Compiled,
    ) -> Result<Replacement, LayoutError> {
        let inline = match new.kind {
            Kind::Sg { .. } if !new.pages => u64::from(self.max_inline_sg),
            Kind::Interleaved { .. } => u64::from(self.max_inline_interleaved),
            _ => 0,
        };
        if new.slots <= room.max(inline) {
            return Ok(Replacement {
                invalidates: false,
                room,
            });
        }
        if flags.contains(SetLayoutFlags::AVOID_INVALIDATION) {
            return Err(LayoutError::WouldInvalidate);
        }
        Ok(Replacement {
            invalidates: true,
            room: new.slots,
        })
    }
}

impl Default for LayoutCaps {
    fn default() -> LayoutCaps {
        LayoutCaps::DEFAULT
    }
}

/// What [`LayoutCaps::check_replace`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replacement {
    /// The MR's keys change (the old lkey/rkey stop working).
    pub invalidates: bool,
    /// The room allotted to the MR's key entry afterwards.
    pub room: u64,
}

/// Why a layout could not be set, or a range could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// `IBV_MR_SET_LAYOUT_ERR_INPUT`: the input is malformed; the old layout remains valid.
    #[error("invalid layout: {0}")]
    Input(String),
    /// `IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE`: the layout needs more room, which changes the
    /// keys, and `AVOID_INVALIDATION` was given. The old layout remains valid.
    #[error("the layout needs more room, which would change the keys (AVOID_INVALIDATION)")]
    WouldInvalidate,
    /// `IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED`: the input is valid but needs a capability or a
    /// limit the device does not have (see [`LayoutCaps`]). The old layout remains valid.
    #[error("unsupported layout: {0}")]
    Unsupported(String),
    /// Data path: the range is not inside the layout.
    #[error("range {offset}+{len} is outside the layout's {size} bytes")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    /// Data path: layouts nest deeper than `limit` (or loop).
    #[error("layouts nest deeper than {limit} levels")]
    TooDeep { limit: u32 },
}

impl LayoutError {
    /// `IBV_MR_SET_LAYOUT_ERR_INPUT`.
    pub const ERR_INPUT: i32 = -1;
    /// `IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE`.
    pub const ERR_WOULD_INVALIDATE: i32 = -2;
    /// `IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED`.
    pub const ERR_UNSUPPORTED: i32 = -3;

    /// The seed's `enum ibv_mr_set_layout_err_code` value (data-path errors count as input).
    pub fn code(&self) -> i32 {
        match self {
            LayoutError::WouldInvalidate => Self::ERR_WOULD_INVALIDATE,
            LayoutError::Unsupported(_) => Self::ERR_UNSUPPORTED,
            _ => Self::ERR_INPUT,
        }
    }

    /// The errno: EINVAL, EBUSY, EOPNOTSUPP, EFAULT (out of bounds), ELOOP (too deep).
    pub fn errno(&self) -> i32 {
        match self {
            LayoutError::Input(_) => libc::EINVAL,
            LayoutError::WouldInvalidate => libc::EBUSY,
            LayoutError::Unsupported(_) => libc::EOPNOTSUPP,
            LayoutError::OutOfBounds { .. } => libc::EFAULT,
            LayoutError::TooDeep { .. } => libc::ELOOP,
        }
    }
}

impl From<LayoutError> for crate::Error {
    fn from(e: LayoutError) -> crate::Error {
        match e {
            LayoutError::WouldInvalidate => crate::Error::Busy(e.to_string()),
            LayoutError::Unsupported(m) => crate::Error::Unsupported(m),
            e => crate::Error::InvalidArgument(e.to_string()),
        }
    }
}

fn input(msg: String) -> LayoutError {
    LayoutError::Input(msg)
}

fn unsupported(msg: String) -> LayoutError {
    LayoutError::Unsupported(msg)
}

/// A validated layout, ready to resolve. Its size depends on the number of SGEs, entries,
/// dimensions, page runs or bitmap words — never on `datum_count` or `num_repeated`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    size: u64,
    level: u32,
    slots: u64,
    /// Built by `from_pages` / `from_bitmap` (no inline room).
    pages: bool,
    kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    /// `starts[i]` is the layout offset of `data[i]`.
    Sg { data: Vec<Datum>, starts: Vec<u64> },
    Interleaved {
        entries: Vec<Entry>,
        phases: Vec<Phase>,
    },
    /// Bit `i % 64` of `words[i / 64]` set: page `i` (at `base + i * page_size`) is in the
    /// layout; `rank[w]` counts the set bits in `words[..w]`.
    Bitmap {
        base: u64,
        page_size: u64,
        words: Vec<u64>,
        rank: Vec<u64>,
    },
}

/// A compiled interleaved entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    key: u32,
    addr: u64,
    len: u64,
    /// Data per full cycle.
    repeat: u64,
    /// Data in all.
    total: u64,
    /// Cycles in which the entry yields `repeat` data (`total / repeat`)...
    full: u64,
    /// ...and what it yields in cycle `full` (`total % repeat`); nothing after that.
    part: u64,
    /// `dims[0].offset_stride == len`: consecutive data of the innermost run are contiguous.
    contig: bool,
    dims: Box<[Dim]>,
}

impl Entry {
    /// Data this entry yields in cycle `c`.
    fn contrib(&self, c: u64) -> u64 {
        match c.cmp(&self.full) {
            std::cmp::Ordering::Less => self.repeat,
            std::cmp::Ordering::Equal => self.part,
            std::cmp::Ordering::Greater => 0,
        }
    }

    /// Start of datum `k < total` (compilation checked that the last datum's end fits in
    /// `u64`, so nothing here can overflow).
    fn datum_addr(&self, k: u64) -> u64 {
        if let [d] = &*self.dims {
            return self.addr + k * d.offset_stride;
        }
        let mut a = self.addr;
        let mut k = k;
        for d in self.dims.iter() {
            a += (k % d.datum_count) * d.offset_stride;
            k /= d.datum_count;
        }
        a
    }

    /// Data from datum `k` on that are contiguous with it (the rest of its innermost run).
    fn contig_run(&self, k: u64) -> u64 {
        if self.contig {
            let d0 = self.dims[0].datum_count;
            d0 - k % d0
        } else {
            1
        }
    }
}

/// Cycles `start_cycle..end_cycle`, in which every entry yields the same number of data each
/// cycle; they cover layout bytes `start_off..end_off`, `cycle_bytes` per cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Phase {
    start_off: u64,
    end_off: u64,
    start_cycle: u64,
    end_cycle: u64,
    cycle_bytes: u64,
}

/// Validation context shared by both layout kinds.
struct Check<'c, L> {
    flags: SetLayoutFlags,
    caps: &'c LayoutCaps,
    lookup: L,
    level: u32,
}

impl<L, R> Check<'_, L>
where
    L: Fn(u32) -> Option<R>,
    R: Deref<Target = Compiled>,
{
    /// Checks a datum's key and the span `addr..end` it covers; tracks the nesting level.
    fn key_span(&mut self, what: &str, key: u32, addr: u64, end: u64) -> Result<(), LayoutError> {
        if key == PLAIN_KEY {
            if !self.flags.contains(SetLayoutFlags::REGISTER_BUFFERS) {
                return Err(input(format!(
                    "{what} has no key (give REGISTER_BUFFERS to register plain buffers)"
                )));
            }
            return Ok(());
        }
        if let Some(inner) = (self.lookup)(key) {
            if end > inner.size {
                return Err(input(format!(
                    "{what} covers {addr}..{end} of key {key:#x}, a layout of {} bytes",
                    inner.size
                )));
            }
            self.level = self.level.max(inner.level.saturating_add(1));
        }
        Ok(())
    }

    fn finish(&self) -> Result<u32, LayoutError> {
        let max = self.caps.max_nesting_level.min(HARD_MAX_NESTING);
        if self.level > max {
            return Err(unsupported(format!(
                "nesting level {} exceeds max_mr_nesting_level {max}",
                self.level
            )));
        }
        Ok(self.level)
    }
}

fn check_flags(flags: SetLayoutFlags, caps: &LayoutCaps) -> Result<(), LayoutError> {
    let unknown = flags.bits() & !SetLayoutFlags::all().bits();
    if unknown != 0 {
        // A flag this library does not know asks for a capability it does not have (the
        // seed's ERR_UNSUPPORTED), as the C calls answer too.
        return Err(unsupported(format!(
            "unknown set-layout flags {unknown:#x}"
        )));
    }
    if flags.contains(SetLayoutFlags::REGISTER_BUFFERS)
        && !caps
            .cap_flags
            .contains(LayoutCapFlags::INTERNAL_REGISTRATION)
    {
        return Err(unsupported(
            "REGISTER_BUFFERS needs INTERNAL_REGISTRATION".into(),
        ));
    }
    Ok(())
}

impl Layout {
    /// Validates the layout against `flags` and `caps`, treating every key as a plain MR.
    pub fn compile(
        &self,
        flags: SetLayoutFlags,
        caps: &LayoutCaps,
    ) -> Result<Compiled, LayoutError> {
        self.compile_nested(flags, caps, |_| None::<&Compiled>)
    }

    /// Validates the layout; `lookup(key)` gives the layout a key carries, if any, to check
    /// nesting depth and that data stay inside nested layouts. Whether plain keys exist and
    /// cover their data is the caller's check (see [`Compiled::spans`]).
    pub fn compile_nested<L, R>(
        &self,
        flags: SetLayoutFlags,
        caps: &LayoutCaps,
        lookup: L,
    ) -> Result<Compiled, LayoutError>
    where
        L: Fn(u32) -> Option<R>,
        R: Deref<Target = Compiled>,
    {
        check_flags(flags, caps)?;
        let mut ck = Check {
            flags,
            caps,
            lookup,
            level: 1,
        };
        match self {
            Layout::Sg(list) => compile_sg(list, &mut ck),
            Layout::Interleaved(list) => compile_interleaved(list, &mut ck),
        }
    }
}

fn compile_sg<L, R>(list: &[Datum], ck: &mut Check<'_, L>) -> Result<Compiled, LayoutError>
where
    L: Fn(u32) -> Option<R>,
    R: Deref<Target = Compiled>,
{
    if !ck.caps.cap_flags.contains(LayoutCapFlags::SG) {
        return Err(unsupported("SG layouts".into()));
    }
    if list.is_empty() {
        return Err(input("SG layout with no data".into()));
    }
    if list.len() > ck.caps.max_sg as usize {
        return Err(unsupported(format!(
            "{} SG entries exceed max_num_sg {}",
            list.len(),
            ck.caps.max_sg
        )));
    }
    let mut starts = Vec::with_capacity(list.len());
    let mut size = 0u64;
    for (i, d) in list.iter().enumerate() {
        let what = format!("SG entry {i}");
        if d.len == 0 {
            return Err(input(format!("{what} has length 0")));
        }
        let end = d
            .addr
            .checked_add(d.len)
            .ok_or_else(|| input(format!("{what}: address + length overflows")))?;
        ck.key_span(&what, d.key, d.addr, end)?;
        starts.push(size);
        size = size
            .checked_add(d.len)
            .ok_or_else(|| input("SG layout longer than 2^64 bytes".into()))?;
    }
    let level = ck.finish()?;
    Ok(Compiled {
        size,
        level,
        slots: list.len() as u64,
        pages: false,
        kind: Kind::Sg {
            data: list.to_vec(),
            starts,
        },
    })
}

fn compile_interleaved<L, R>(
    list: &[InterleavedEntry],
    ck: &mut Check<'_, L>,
) -> Result<Compiled, LayoutError>
where
    L: Fn(u32) -> Option<R>,
    R: Deref<Target = Compiled>,
{
    let caps = ck.caps;
    let has = |f| caps.cap_flags.contains(f);
    if !has(LayoutCapFlags::INTERLEAVED) {
        return Err(unsupported("interleaved layouts".into()));
    }
    if list.is_empty() {
        return Err(input("interleaved layout with no entries".into()));
    }
    if list.len() > caps.max_interleaved as usize {
        return Err(unsupported(format!(
            "{} interleaved entries exceed max_num_interleaved {}",
            list.len(),
            caps.max_interleaved
        )));
    }
    let mut entries = Vec::with_capacity(list.len());
    let mut size = 0u64;
    for (i, e) in list.iter().enumerate() {
        let what = format!("interleaved entry {i}");
        let d = e.first;
        if d.len == 0 {
            return Err(input(format!("{what} has datum length 0")));
        }
        if e.num_repeated == 0 {
            return Err(input(format!("{what} has num_repeated 0")));
        }
        if e.dims.is_empty() {
            return Err(input(format!("{what} has no dimensions")));
        }
        let mut total = 1u64;
        let mut span = 0u64;
        for (n, dim) in e.dims.iter().enumerate() {
            if dim.datum_count == 0 {
                return Err(input(format!("{what}: dimension {n} has datum_count 0")));
            }
            total = total
                .checked_mul(dim.datum_count)
                .ok_or_else(|| input(format!("{what}: datum count overflows")))?;
            span = (dim.datum_count - 1)
                .checked_mul(dim.offset_stride)
                .and_then(|s| s.checked_add(span))
                .ok_or_else(|| input(format!("{what}: strides overflow")))?;
        }
        let end = d
            .addr
            .checked_add(span)
            .and_then(|a| a.checked_add(d.len))
            .ok_or_else(|| input(format!("{what}: the last datum's end overflows")))?;
        size = total
            .checked_mul(d.len)
            .and_then(|b| b.checked_add(size))
            .ok_or_else(|| input("interleaved layout longer than 2^64 bytes".into()))?;
        if e.dims.len() > caps.max_dims as usize {
            return Err(unsupported(format!(
                "{what}: {} dimensions exceed max_mr_stride_dimension {}",
                e.dims.len(),
                caps.max_dims
            )));
        }
        if e.num_repeated > 1 && !has(LayoutCapFlags::INTERLEAVED_REPEAT) {
            return Err(unsupported(format!("{what}: num_repeated > 1")));
        }
        if e.num_repeated > caps.max_repeat {
            return Err(unsupported(format!(
                "{what}: num_repeated {} exceeds {}",
                e.num_repeated, caps.max_repeat
            )));
        }
        ck.key_span(&what, d.key, d.addr, end)?;
        let repeat = u64::from(e.num_repeated);
        entries.push(Entry {
            key: d.key,
            addr: d.addr,
            len: d.len,
            repeat,
            total,
            full: total / repeat,
            part: total % repeat,
            contig: e.dims[0].offset_stride == d.len,
            dims: e.dims.clone().into_boxed_slice(),
        });
    }
    if entries.iter().any(|e| e.repeat != entries[0].repeat)
        && !has(LayoutCapFlags::INTERLEAVED_NONUNIFORM_REPEAT)
    {
        return Err(unsupported("num_repeated differs between entries".into()));
    }
    let uniform = entries
        .iter()
        .all(|e| e.part == 0 && e.full == entries[0].full);
    if !uniform && !has(LayoutCapFlags::INTERLEAVED_NONUNIFORM_DATUM_TOTAL) {
        return Err(unsupported(
            "entries last different numbers of cycles (NONUNIFORM_DATUM_TOTAL)".into(),
        ));
    }
    let level = ck.finish()?;
    let slots = entries.len() as u64;
    if let [e] = entries.as_mut_slice() {
        // One entry: the round-robin never leaves it, so all its data are one cycle.
        e.repeat = e.total;
        e.full = 1;
        e.part = 0;
    }
    let phases = phases(&entries, size)?;
    Ok(Compiled {
        size,
        level,
        slots,
        pages: false,
        kind: Kind::Interleaved { entries, phases },
    })
}

/// Splits the cycles where some entry's yield changes: at most `2n + 1` phases.
fn phases(entries: &[Entry], size: u64) -> Result<Vec<Phase>, LayoutError> {
    let overflow = || input("interleaved layout too long".into());
    let mut bounds = vec![0u64];
    for e in entries {
        bounds.push(e.full);
        if e.part > 0 {
            bounds.push(e.full.checked_add(1).ok_or_else(overflow)?);
        }
    }
    bounds.sort_unstable();
    bounds.dedup();
    let mut out = Vec::with_capacity(bounds.len());
    let mut off = 0u64;
    for w in bounds.windows(2) {
        let (start, end) = (w[0], w[1]);
        let mut cycle_bytes = 0u64;
        for e in entries {
            cycle_bytes = e
                .contrib(start)
                .checked_mul(e.len)
                .and_then(|b| b.checked_add(cycle_bytes))
                .ok_or_else(overflow)?;
        }
        if cycle_bytes == 0 {
            continue; // cannot happen before the last entry runs out; keeps seek division-safe
        }
        let bytes = (end - start)
            .checked_mul(cycle_bytes)
            .ok_or_else(overflow)?;
        let end_off = off.checked_add(bytes).ok_or_else(overflow)?;
        out.push(Phase {
            start_off: off,
            end_off,
            start_cycle: start,
            end_cycle: end,
            cycle_bytes,
        });
        off = end_off;
    }
    if off != size {
        return Err(input("interleaved layout: inconsistent totals".into()));
    }
    Ok(out)
}

fn check_page_size(page_size: u64) -> Result<(), LayoutError> {
    if !page_size.is_power_of_two() {
        return Err(input(format!(
            "page size {page_size} is not a power of two"
        )));
    }
    Ok(())
}

impl Compiled {
    /// A page-list registration (Jason Gunthorpe's `ib_reg_mr_sg(pages, num_pages, mr_addr,
    /// mr_offset, mr_length)` in the thread): byte 0 of the layout is `pages[0] + first_offset`
    /// and it is `length` bytes long, continuing through `pages[1]`, `pages[2]`, ... Every page
    /// must be `page_size`-aligned (a power of two). The IOVA the region is seen at
    /// (`mr_addr`) is the MR's business: this layout is zero-based. Pieces carry
    /// [`PLAIN_KEY`]. Stored as runs of contiguous pages (pages that follow each other in
    /// memory merge), only for the pages `length` reaches.
    pub fn from_pages(
        pages: &[u64],
        page_size: u64,
        first_offset: u64,
        length: u64,
    ) -> Result<Compiled, LayoutError> {
        check_page_size(page_size)?;
        if length == 0 {
            return Err(input("page list of length 0".into()));
        }
        if first_offset >= page_size {
            return Err(input(format!(
                "first offset {first_offset} is not inside the first page ({page_size} bytes)"
            )));
        }
        let need = first_offset
            .checked_add(length)
            .map(|e| e.div_ceil(page_size))
            .ok_or_else(|| input("page list length overflows".into()))?;
        if need > pages.len() as u64 {
            return Err(input(format!(
                "{length} bytes from offset {first_offset} need {need} pages, {} given",
                pages.len()
            )));
        }
        let used = &pages[..need as usize];
        let mut runs: Vec<Datum> = Vec::new();
        let mut left = length;
        for (i, &p) in used.iter().enumerate() {
            if p % page_size != 0 {
                return Err(input(format!(
                    "page {i} at {p:#x} is not aligned to {page_size}"
                )));
            }
            let skip = if i == 0 { first_offset } else { 0 };
            let len = (page_size - skip).min(left);
            let addr = p + skip;
            addr.checked_add(len)
                .ok_or_else(|| input(format!("page {i} at {p:#x} ends past 2^64")))?;
            left -= len;
            match runs.last_mut() {
                Some(r) if r.addr + r.len == addr => r.len += len,
                _ => runs.push(Datum::new(PLAIN_KEY, addr, len)),
            }
        }
        let mut starts = Vec::with_capacity(runs.len());
        let mut off = 0;
        for r in &runs {
            starts.push(off);
            off += r.len;
        }
        Ok(Compiled {
            size: length,
            level: 1,
            slots: runs.len() as u64,
            pages: true,
            kind: Kind::Sg { data: runs, starts },
        })
    }

    /// A bitmap page registration (Yuval Shaia's "huge range plus a bitmap" in the thread):
    /// page `i` is at `base + i * page_size` and is in the layout when bit `i % 64` of
    /// `bitmap[i / 64]` is set (least significant bit first); the layout is the set pages in
    /// increasing order, `page_size` bytes each. `base` must be `page_size`-aligned (a power of
    /// two). Stored as the bitmap plus one rank word per 64 pages, so a range is found by
    /// binary search and each run of contiguous pages costs one step.
    pub fn from_bitmap(base: u64, page_size: u64, bitmap: &[u64]) -> Result<Compiled, LayoutError> {
        check_page_size(page_size)?;
        if base % page_size != 0 {
            return Err(input(format!(
                "base {base:#x} is not aligned to {page_size}"
            )));
        }
        let Some(last_word) = bitmap.iter().rposition(|&w| w != 0) else {
            return Err(input("bitmap selects no page".into()));
        };
        let words = bitmap[..=last_word].to_vec();
        let last_page = (last_word as u64)
            .checked_mul(64)
            .map(|p| p + 63 - u64::from(words[last_word].leading_zeros()));
        last_page
            .and_then(|p| p.checked_add(1))
            .and_then(|n| n.checked_mul(page_size))
            .and_then(|b| b.checked_add(base))
            .ok_or_else(|| input("bitmap reaches past 2^64".into()))?;
        let mut rank = Vec::with_capacity(words.len());
        let mut count = 0u64;
        for w in &words {
            rank.push(count);
            count += u64::from(w.count_ones());
        }
        let size = count
            .checked_mul(page_size)
            .ok_or_else(|| input("bitmap layout longer than 2^64 bytes".into()))?;
        Ok(Compiled {
            size,
            level: 1,
            slots: words.len() as u64,
            pages: true,
            kind: Kind::Bitmap {
                base,
                page_size,
                words,
                rank,
            },
        })
    }

    /// Bytes in the layout: the length of the container MR once the layout is set.
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Never true (every layout has at least one byte); here for clippy's sake.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The nesting level (1: over plain MRs only).
    pub fn level(&self) -> u32 {
        self.level
    }

    /// Descriptor slots the layout takes in the key entry: SGEs, interleaved entries, page
    /// runs or bitmap words (see [`LayoutCaps::check_replace`]).
    pub fn slots(&self) -> u64 {
        self.slots
    }

    /// Bytes the descriptor occupies (struct plus heap), for the perf report.
    pub fn descriptor_bytes(&self) -> usize {
        use std::mem::size_of;
        size_of::<Compiled>()
            + match &self.kind {
                Kind::Sg { data, starts } => {
                    data.capacity() * size_of::<Datum>() + starts.capacity() * 8
                }
                Kind::Interleaved { entries, phases } => {
                    entries.capacity() * size_of::<Entry>()
                        + entries
                            .iter()
                            .map(|e| e.dims.len() * size_of::<Dim>())
                            .sum::<usize>()
                        + phases.capacity() * size_of::<Phase>()
                }
                Kind::Bitmap { words, rank, .. } => (words.capacity() + rank.capacity()) * 8,
            }
    }

    /// Every region the layout touches: one datum per SGE, per interleaved entry (from its
    /// first datum's start to its last datum's end), per page run, or one for a whole bitmap.
    /// The NIC checks these against the key table at set-layout time (key exists, same PD,
    /// in bounds) and marks those MRs busy.
    pub fn spans(&self) -> Vec<Datum> {
        match &self.kind {
            Kind::Sg { data, .. } => data.clone(),
            Kind::Interleaved { entries, .. } => entries
                .iter()
                .map(|e| {
                    let span: u64 = e
                        .dims
                        .iter()
                        .map(|d| (d.datum_count - 1) * d.offset_stride)
                        .sum();
                    Datum::new(e.key, e.addr, span + e.len)
                })
                .collect(),
            Kind::Bitmap {
                base,
                page_size,
                words,
                ..
            } => {
                let first = words.iter().position(|&w| w != 0).unwrap_or(0);
                let last = words.len() - 1;
                let lo = first as u64 * 64 + u64::from(words[first].trailing_zeros());
                let hi = last as u64 * 64 + 64 - u64::from(words[last].leading_zeros());
                vec![Datum::new(
                    PLAIN_KEY,
                    base + lo * page_size,
                    (hi - lo) * page_size,
                )]
            }
        }
    }

    /// An upper bound on the number of pieces [`pieces`](Self::pieces) yields for `len`
    /// bytes, for reserving room before a walk (one pass instead of repeated growth). Every
    /// piece but a partial first and last one holds at least one whole datum (or page), so
    /// the bound is `len / shortest + 2`, and never more than an SG list's data.
    pub fn max_pieces(&self, len: u64) -> u64 {
        let shortest = match &self.kind {
            Kind::Sg { data, .. } => return (data.len() as u64).min(len),
            Kind::Interleaved { entries, .. } => entries.iter().map(|e| e.len).min(),
            Kind::Bitmap { page_size, .. } => Some(*page_size),
        };
        (len / shortest.unwrap_or(1).max(1))
            .saturating_add(2)
            .min(len)
    }

    /// The pieces of layout bytes `offset..offset + len`, in order, adjacent contiguous pieces
    /// of one key merged. Lazy: nothing is walked beyond what the caller takes.
    pub fn pieces(&self, offset: u64, len: u64) -> Result<Pieces<'_>, LayoutError> {
        let oob = LayoutError::OutOfBounds {
            offset,
            len,
            size: self.size,
        };
        match offset.checked_add(len) {
            Some(end) if end <= self.size => {}
            _ => return Err(oob),
        }
        let cur = if len == 0 {
            Cursor::Done
        } else {
            self.seek(offset)
        };
        Ok(Pieces {
            layout: self,
            remaining: len,
            cur,
            pending: None,
        })
    }

    /// Calls `f` with each piece of layout bytes `offset..offset + len`, in order, stopping at
    /// `f`'s first error. Unlike [`pieces`](Self::pieces) adjacent pieces are not merged (a
    /// piece is a datum, or a contiguous run of one entry), and the walk's state stays in
    /// registers across the loop: the data path's per-datum cost.
    #[inline]
    pub fn try_for_each_piece<E>(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(Piece) -> Result<(), E>,
    ) -> Result<Result<(), E>, LayoutError> {
        let mut it = self.pieces(offset, len)?;
        while let Some(p) = it.raw() {
            if let Err(e) = f(p) {
                return Ok(Err(e));
            }
        }
        Ok(Ok(()))
    }

    /// Calls `f` with the runs of layout bytes `offset..offset + len`, in order: the same
    /// bytes as [`try_for_each_piece`](Self::try_for_each_piece), but a layout of one strided
    /// entry (a matrix column) comes as one run of its whole data (plus partial data at either
    /// end), found in constant time, so its cost does not grow with the column.
    pub fn try_for_each_run<E>(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(Run) -> Result<(), E>,
    ) -> Result<Result<(), E>, LayoutError> {
        if let Kind::Interleaved { entries, .. } = &self.kind
            && let [e] = entries.as_slice()
            && let [d] = &*e.dims
            && !e.contig
        {
            match offset.checked_add(len) {
                Some(end) if end <= self.size => {}
                _ => {
                    return Err(LayoutError::OutOfBounds {
                        offset,
                        len,
                        size: self.size,
                    });
                }
            }
            // One entry: data follow each other in order, datum `k` at layout offset
            // `k * e.len`; compilation checked every datum's end fits in `u64`.
            let stride = d.offset_stride;
            let (mut k, intra) = (offset / e.len, offset % e.len);
            let mut left = len;
            let piece = |k: u64, intra: u64, n: u64| Run {
                key: e.key,
                addr: e.addr + k * stride + intra,
                len: n,
                stride: 0,
                count: 1,
            };
            if intra > 0 && left > 0 {
                let n = (e.len - intra).min(left);
                if let Err(x) = f(piece(k, intra, n)) {
                    return Ok(Err(x));
                }
                left -= n;
                k += 1;
            }
            let whole = left / e.len;
            if whole > 0 {
                let run = Run {
                    key: e.key,
                    addr: e.addr + k * stride,
                    len: e.len,
                    stride,
                    count: whole,
                };
                if let Err(x) = f(run) {
                    return Ok(Err(x));
                }
                left -= whole * e.len;
                k += whole;
            }
            if left > 0
                && let Err(x) = f(piece(k, 0, left))
            {
                return Ok(Err(x));
            }
            return Ok(Ok(()));
        }
        self.try_for_each_piece(offset, len, |p| f(Run::one(p)))
    }

    /// Appends to `out` the pieces of layout bytes `offset..offset + len` (see
    /// [`pieces`](Self::pieces)); merges with `out`'s last piece when contiguous.
    pub fn resolve(&self, offset: u64, len: u64, out: &mut Vec<Piece>) -> Result<(), LayoutError> {
        for p in self.pieces(offset, len)? {
            push_merged(out, p);
        }
        Ok(())
    }

    /// Like [`resolve`](Self::resolve), but a piece whose key carries a layout (`lookup`) is
    /// replaced, recursively, by that layout's pieces. This layout is level 1; needing a level
    /// beyond `max_level` (at most [`HARD_MAX_NESTING`]) fails with
    /// [`LayoutError::TooDeep`], which also stops layouts that refer to each other in a loop.
    /// On error `out` may hold the pieces resolved so far.
    pub fn resolve_nested<R: Deref<Target = Compiled>>(
        &self,
        offset: u64,
        len: u64,
        lookup: &dyn Fn(u32) -> Option<R>,
        max_level: u32,
        out: &mut Vec<Piece>,
    ) -> Result<(), LayoutError> {
        let max_level = max_level.min(HARD_MAX_NESTING);
        self.nested(offset, len, lookup, 1, max_level, out)
    }

    fn nested<R: Deref<Target = Compiled>>(
        &self,
        offset: u64,
        len: u64,
        lookup: &dyn Fn(u32) -> Option<R>,
        level: u32,
        max_level: u32,
        out: &mut Vec<Piece>,
    ) -> Result<(), LayoutError> {
        if level > max_level {
            return Err(LayoutError::TooDeep { limit: max_level });
        }
        for p in self.pieces(offset, len)? {
            match lookup(p.key) {
                Some(inner) => inner.nested(p.addr, p.len, lookup, level + 1, max_level, out)?,
                None => push_merged(out, p),
            }
        }
        Ok(())
    }

    /// The cursor at layout byte `offset < size`.
    fn seek(&self, offset: u64) -> Cursor {
        match &self.kind {
            Kind::Sg { starts, .. } => {
                let idx = starts.partition_point(|&s| s <= offset) - 1;
                Cursor::Sg {
                    idx,
                    intra: offset - starts[idx],
                }
            }
            Kind::Interleaved { entries, phases } => {
                let phase = phases.partition_point(|p| p.end_off <= offset);
                let p = &phases[phase];
                let within = offset - p.start_off;
                let cycle = p.start_cycle + within / p.cycle_bytes;
                let mut rem = within % p.cycle_bytes;
                for (entry, e) in entries.iter().enumerate() {
                    let bytes = e.contrib(cycle) * e.len;
                    if rem < bytes {
                        return Cursor::Il {
                            phase,
                            cycle,
                            entry,
                            rep: rem / e.len,
                            intra: rem % e.len,
                        };
                    }
                    rem -= bytes;
                }
                Cursor::Done // unreachable: the phase's cycle covers `offset`
            }
            Kind::Bitmap { page_size, .. } => Cursor::Bm {
                ordinal: offset / page_size,
                intra: offset % page_size,
            },
        }
    }
}

fn push_merged(out: &mut Vec<Piece>, p: Piece) {
    match out.last_mut() {
        Some(q) if q.key == p.key && q.addr.checked_add(q.len) == Some(p.addr) => q.len += p.len,
        _ => out.push(p),
    }
}

/// Where a [`Pieces`] walk stands.
#[derive(Debug, Clone, Copy)]
enum Cursor {
    Done,
    Sg {
        idx: usize,
        intra: u64,
    },
    Il {
        phase: usize,
        cycle: u64,
        entry: usize,
        rep: u64,
        intra: u64,
    },
    Bm {
        ordinal: u64,
        intra: u64,
    },
}

/// The pieces of a layout range, merged ([`Compiled::pieces`]).
#[derive(Debug, Clone)]
pub struct Pieces<'a> {
    layout: &'a Compiled,
    remaining: u64,
    cur: Cursor,
    pending: Option<Piece>,
}

impl Pieces<'_> {
    /// The next unmerged piece (one datum, or one contiguous run of data or pages). Inlined
    /// into [`next`](Iterator::next): returned through memory, the piece's fields were
    /// reloaded whole before their stores had landed (a store-forwarding stall per datum).
    #[inline(always)]
    fn raw(&mut self) -> Option<Piece> {
        if self.remaining == 0 {
            return None;
        }
        let piece = match (&mut self.cur, &self.layout.kind) {
            (Cursor::Sg { idx, intra }, Kind::Sg { data, .. }) => {
                let d = data[*idx];
                let take = (d.len - *intra).min(self.remaining);
                let p = Piece {
                    key: d.key,
                    addr: d.addr + *intra,
                    len: take,
                };
                *intra += take;
                if *intra == d.len {
                    *idx += 1;
                    *intra = 0;
                }
                p
            }
            (
                Cursor::Il {
                    phase,
                    cycle,
                    entry,
                    rep,
                    intra,
                },
                Kind::Interleaved { entries, phases },
            ) => {
                let e = &entries[*entry];
                let contrib = e.contrib(*cycle);
                let k = *cycle * e.repeat + *rep;
                let run = (contrib - *rep).min(e.contig_run(k));
                let take = (run * e.len - *intra).min(self.remaining);
                let p = Piece {
                    key: e.key,
                    addr: e.datum_addr(k) + *intra,
                    len: take,
                };
                let pos = *intra + take;
                if pos == run * e.len {
                    // Whole data taken (the usual case): no division, which would cost more
                    // than the rest of the step.
                    *rep += run;
                    *intra = 0;
                } else {
                    *rep += pos / e.len;
                    *intra = pos % e.len;
                }
                if *rep == contrib && self.remaining > take {
                    // Next entry with data in this cycle, else the next cycle (and phase).
                    *rep = 0;
                    loop {
                        *entry += 1;
                        if *entry == entries.len() {
                            *entry = 0;
                            *cycle += 1;
                            if *cycle == phases[*phase].end_cycle {
                                *phase += 1;
                                if *phase == phases.len() {
                                    // Unreachable (the range was bounds-checked); end the walk.
                                    self.remaining = take;
                                    break;
                                }
                            }
                        }
                        if entries[*entry].contrib(*cycle) > 0 {
                            break;
                        }
                    }
                }
                p
            }
            (
                Cursor::Bm { ordinal, intra },
                Kind::Bitmap {
                    base,
                    page_size,
                    words,
                    rank,
                },
            ) => {
                let w = rank.partition_point(|&r| r <= *ordinal) - 1;
                let mut word = words[w];
                for _ in 0..*ordinal - rank[w] {
                    word &= word.wrapping_sub(1); // drop the lowest set bit
                }
                let bit = word.trailing_zeros();
                let ones = u64::from((words[w] >> bit).trailing_ones());
                let page = w as u64 * 64 + u64::from(bit);
                let take = (ones * *page_size - *intra).min(self.remaining);
                let p = Piece {
                    key: PLAIN_KEY,
                    addr: base + page * *page_size + *intra,
                    len: take,
                };
                let pos = *intra + take;
                *ordinal += pos / *page_size;
                *intra = pos % *page_size;
                p
            }
            _ => {
                self.remaining = 0;
                return None;
            }
        };
        self.remaining -= piece.len;
        Some(piece)
    }
}

impl Iterator for Pieces<'_> {
    type Item = Piece;

    #[inline]
    fn next(&mut self) -> Option<Piece> {
        loop {
            let Some(p) = self.raw() else {
                return self.pending.take();
            };
            match &mut self.pending {
                Some(q) if q.key == p.key && q.addr.checked_add(q.len) == Some(p.addr) => {
                    q.len += p.len;
                }
                Some(_) => return self.pending.replace(p),
                None => self.pending = Some(p),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;
    use std::time::Instant;

    const NONE: SetLayoutFlags = SetLayoutFlags::empty();
    const CAPS: LayoutCaps = LayoutCaps::DEFAULT;

    fn il(list: Vec<InterleavedEntry>) -> Compiled {
        Layout::Interleaved(list).compile(NONE, &CAPS).unwrap()
    }

    /// The bytes (region address order of the layout) of a range, through runs.
    fn run_bytes(c: &Compiled, off: u64, len: u64) -> Vec<(u32, u64)> {
        let mut v = Vec::new();
        c.try_for_each_run(off, len, |r| {
            for i in 0..r.count {
                let a = r.addr + i * r.stride;
                v.extend((a..a + r.len).map(|b| (r.key, b)));
            }
            Ok::<(), ()>(())
        })
        .unwrap()
        .unwrap();
        v
    }

    fn piece_bytes(c: &Compiled, off: u64, len: u64) -> Vec<(u32, u64)> {
        let mut v = Vec::new();
        for p in c.pieces(off, len).unwrap() {
            v.extend((p.addr..p.addr + p.len).map(|b| (p.key, b)));
        }
        v
    }

    #[test]
    fn runs_cover_the_same_bytes_as_pieces() {
        let column = il(vec![InterleavedEntry::new(
            Datum::new(7, 0x1000, 8),
            vec![Dim::new(4096 * 8, 64)],
        )]);
        let odd = il(vec![InterleavedEntry::new(
            Datum::new(7, 0x1000, 5),
            vec![Dim::new(13, 9)],
        )]);
        let block = il(vec![InterleavedEntry::new(
            Datum::new(7, 0x1000, 8),
            vec![Dim::new(8, 3), Dim::new(128, 4)],
        )]);
        let two = il(vec![
            InterleavedEntry::new(Datum::new(7, 0x1000, 4), vec![Dim::new(16, 6)]),
            InterleavedEntry::new(Datum::new(8, 0x9000, 4), vec![Dim::new(16, 6)]),
        ]);
        for c in [&column, &odd, &block, &two] {
            for off in 0..c.len() {
                for len in [0, 1, 3, 5, 8, 9, 17, c.len() - off] {
                    let len = len.min(c.len() - off);
                    assert_eq!(
                        run_bytes(c, off, len),
                        piece_bytes(c, off, len),
                        "{off}+{len}"
                    );
                }
            }
        }
        // The column is one run, whatever its length.
        let mut runs = 0;
        column
            .try_for_each_run(0, column.len(), |_| {
                runs += 1;
                Ok::<(), ()>(())
            })
            .unwrap()
            .unwrap();
        assert_eq!(runs, 1);
        assert!(
            column
                .try_for_each_run(8, column.len(), |_| Ok::<(), ()>(()))
                .is_err()
        );
    }

    fn sg(list: Vec<Datum>) -> Compiled {
        Layout::Sg(list).compile(NONE, &CAPS).unwrap()
    }

    fn all(c: &Compiled) -> Vec<Piece> {
        let mut out = Vec::new();
        c.resolve(0, c.len(), &mut out).unwrap();
        out
    }

    fn pc(key: u32, addr: u64, len: u64) -> Piece {
        Piece { key, addr, len }
    }

    /// Naive model: the layout as one `(key, byte address)` per byte, by running the seed's
    /// pseudo-code literally (per-entry cursors, nested-loop dimension counters).
    fn model(layout: &Layout) -> Vec<(u32, u64)> {
        let mut bytes = Vec::new();
        let mut datum = |key: u32, a: u64, len: u64| {
            for b in 0..len {
                bytes.push((key, a + b));
            }
        };
        match layout {
            Layout::Sg(list) => list.iter().for_each(|d| datum(d.key, d.addr, d.len)),
            Layout::Interleaved(list) => {
                let lists: Vec<Vec<u64>> = list
                    .iter()
                    .map(|e| {
                        let mut idx = vec![0u64; e.dims.len()];
                        let mut v = Vec::new();
                        loop {
                            let off: u64 = idx
                                .iter()
                                .zip(&e.dims)
                                .map(|(i, d)| i * d.offset_stride)
                                .sum();
                            v.push(e.first.addr + off);
                            let mut n = 0;
                            loop {
                                if n == idx.len() {
                                    return v;
                                }
                                idx[n] += 1;
                                if idx[n] < e.dims[n].datum_count {
                                    break;
                                }
                                idx[n] = 0;
                                n += 1;
                            }
                        }
                    })
                    .collect();
                let mut pos = vec![0usize; list.len()];
                loop {
                    let mut any = false;
                    for (j, e) in list.iter().enumerate() {
                        for _ in 0..e.num_repeated {
                            if pos[j] < lists[j].len() {
                                datum(e.first.key, lists[j][pos[j]], e.first.len);
                                pos[j] += 1;
                                any = true;
                            }
                        }
                    }
                    if !any {
                        break;
                    }
                }
            }
        }
        bytes
    }

    fn expand(pieces: &[Piece]) -> Vec<(u32, u64)> {
        pieces
            .iter()
            .flat_map(|p| (p.addr..p.addr + p.len).map(move |a| (p.key, a)))
            .collect()
    }

    /// Checks merged-ness: no empty piece, no two neighbours that could merge.
    fn assert_merged(pieces: &[Piece]) {
        for p in pieces {
            assert!(p.len > 0, "empty piece in {pieces:?}");
        }
        for w in pieces.windows(2) {
            assert!(
                !(w[0].key == w[1].key && w[0].addr + w[0].len == w[1].addr),
                "unmerged neighbours {w:?}"
            );
        }
    }

    // --- the seed's two man-page examples ---------------------------------------------------

    #[test]
    fn seed_swap_odd_and_even_items() {
        let (key, item) = (0x100, 24u64);
        let dim = vec![Dim::new(2 * item, 50)];
        let layout = Layout::Interleaved(vec![
            InterleavedEntry::new(Datum::new(key, item, item), dim.clone()), // item[1] first
            InterleavedEntry::new(Datum::new(key, 0, item), dim),            // then item[0]
        ]);
        let c = layout.compile(NONE, &CAPS).unwrap();
        assert_eq!(c.len(), 100 * item);
        let pieces = all(&c);
        assert_eq!(pieces.len(), 100);
        for (i, p) in pieces.iter().enumerate() {
            let swapped = (i ^ 1) as u64;
            assert_eq!(*p, pc(key, swapped * item, item));
        }
        assert_eq!(expand(&pieces), model(&layout));
        // A range across items 3..5, starting mid-item.
        let mut out = Vec::new();
        c.resolve(3 * item + 5, 2 * item, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                pc(key, 2 * item + 5, item - 5),
                pc(key, 5 * item, item),
                pc(key, 4 * item, 5)
            ]
        );
    }

    #[test]
    fn seed_composite_sg_of_two_buffers() {
        let (mr1, mr2) = (0x200, 0x300);
        let c = sg(vec![
            Datum::new(mr1, 0x1000, 100),
            Datum::new(mr2, 0x9000, 50),
        ]);
        assert_eq!(c.len(), 150);
        assert_eq!(all(&c), vec![pc(mr1, 0x1000, 100), pc(mr2, 0x9000, 50)]);
        let mut out = Vec::new();
        c.resolve(90, 20, &mut out).unwrap();
        assert_eq!(out, vec![pc(mr1, 0x1000 + 90, 10), pc(mr2, 0x9000, 10)]);
        out.clear();
        c.resolve(120, 30, &mut out).unwrap();
        assert_eq!(out, vec![pc(mr2, 0x9000 + 20, 30)]);
        // Contiguous SGEs of one key merge at resolve time.
        let c = sg(vec![
            Datum::new(mr1, 0, 10),
            Datum::new(mr1, 10, 10),
            Datum::new(mr1, 30, 5),
        ]);
        assert_eq!(all(&c), vec![pc(mr1, 0, 20), pc(mr1, 30, 5)]);
    }

    // --- matrices -----------------------------------------------------------------------------

    /// Column `col` of an `n x n` row-major matrix of 8-byte cells.
    fn column(key: u32, n: u64, col: u64) -> Layout {
        Layout::Interleaved(vec![InterleavedEntry::new(
            Datum::new(key, col * 8, 8),
            vec![Dim::new(n * 8, n)],
        )])
    }

    #[test]
    fn matrix_column_4096() {
        let (key, n) = (0x400, 4096u64);
        let c = column(key, n, 7).compile(NONE, &CAPS).unwrap();
        assert_eq!(c.len(), n * 8);
        let pieces = all(&c);
        assert_eq!(pieces.len(), n as usize);
        for (i, p) in pieces.iter().enumerate() {
            assert_eq!(*p, pc(key, 7 * 8 + i as u64 * n * 8, 8));
        }
        let mut out = Vec::new();
        c.resolve(4000 * 8 + 4, 12, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                pc(key, 56 + 4000 * n * 8 + 4, 4),
                pc(key, 56 + 4001 * n * 8, 8)
            ]
        );
    }

    #[test]
    fn descriptor_size_is_independent_of_datum_count() {
        let small = column(1, 4096, 0).compile(NONE, &CAPS).unwrap();
        let huge = column(1, 1 << 24, 0).compile(NONE, &CAPS).unwrap();
        assert_eq!(small.descriptor_bytes(), huge.descriptor_bytes());
        let rep = |t| {
            il(vec![
                InterleavedEntry::new(Datum::new(1, 0, 8), vec![Dim::new(16, t)]).repeated(3),
                InterleavedEntry::new(Datum::new(2, 0, 8), vec![Dim::new(16, 2 * t)]).repeated(5),
            ])
        };
        // (The phase count, at most 2n + 1, depends on the shape: keep the same one.)
        assert_eq!(rep(15).descriptor_bytes(), rep(15 << 36).descriptor_bytes());
        // A trillion data, resolved at the very end without walking them.
        let c = rep(1 << 40);
        let mut out = Vec::new();
        let t0 = Instant::now();
        c.resolve(c.len() - 20, 20, &mut out).unwrap();
        assert!(t0.elapsed().as_millis() < 50);
        assert_eq!(out.iter().map(|p| p.len).sum::<u64>(), 20);
    }

    #[test]
    fn column_timing_and_descriptor_bytes() {
        let c = column(1, 4096, 4095).compile(NONE, &CAPS).unwrap();
        let mut out = Vec::with_capacity(4096);
        let iters = 200;
        let t0 = Instant::now();
        for _ in 0..iters {
            out.clear();
            c.resolve(0, c.len(), &mut out).unwrap();
        }
        let whole = t0.elapsed() / iters;
        let t0 = Instant::now();
        let small_iters = 10_000u32;
        for i in 0..small_iters {
            out.clear();
            let off = (4096 - 64 + u64::from(i % 60)) * 8;
            c.resolve(off, 32, &mut out).unwrap();
        }
        let small = t0.elapsed() / small_iters;
        eprintln!(
            "4096x4096 column: whole column ({} pieces) {whole:?}, 32 B at the end {small:?}, \
             descriptor {} bytes",
            4096,
            c.descriptor_bytes()
        );
        // Loose bounds for a shared, unoptimised build: microseconds, not milliseconds.
        assert!(whole.as_micros() < 5_000, "{whole:?}");
        assert!(small.as_micros() < 100, "{small:?}");
    }

    #[test]
    fn two_dimensional_sub_block() {
        // 8x8 matrix of 8-byte cells; rows 2..6, columns 3..7, one cell per datum.
        let key = 0x500;
        let layout = Layout::Interleaved(vec![InterleavedEntry::new(
            Datum::new(key, (2 * 8 + 3) * 8, 8),
            vec![Dim::new(8, 4), Dim::new(64, 4)],
        )]);
        let c = layout.compile(NONE, &CAPS).unwrap();
        assert_eq!(c.len(), 16 * 8);
        let rows: Vec<Piece> = (2..6).map(|r| pc(key, (r * 8 + 3) * 8, 32)).collect();
        assert_eq!(all(&c), rows);
        assert_eq!(expand(&all(&c)), model(&layout));
        // Mid-row start and end.
        let mut out = Vec::new();
        c.resolve(20, 40, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                pc(key, (2 * 8 + 3) * 8 + 20, 12),
                pc(key, (3 * 8 + 3) * 8, 28)
            ]
        );
        // A column of a 3-D array: dims (row stride, plane stride) with a non-contiguous inner.
        let cube = Layout::Interleaved(vec![InterleavedEntry::new(
            Datum::new(key, 5 * 8, 8),
            vec![Dim::new(64, 8), Dim::new(512, 3)],
        )]);
        let c = cube.compile(NONE, &CAPS).unwrap();
        assert_eq!(expand(&all(&c)), model(&cube));
        assert_eq!(all(&c).len(), 24);
    }

    // --- repeated patterns ----------------------------------------------------------------

    #[test]
    fn uniform_repeat() {
        // A, A, B, A, A, B, ... : both entries last 3 cycles.
        let a = InterleavedEntry::new(Datum::new(1, 0, 4), vec![Dim::new(10, 6)]).repeated(2);
        let b = InterleavedEntry::new(Datum::new(2, 0, 4), vec![Dim::new(10, 3)]).repeated(1);
        let layout = Layout::Interleaved(vec![a, b]);
        let c = layout.compile(NONE, &CAPS).unwrap();
        let want = vec![
            pc(1, 0, 4),
            pc(1, 10, 4),
            pc(2, 0, 4),
            pc(1, 20, 4),
            pc(1, 30, 4),
            pc(2, 10, 4),
            pc(1, 40, 4),
            pc(1, 50, 4),
            pc(2, 20, 4),
        ];
        assert_eq!(all(&c), want);
        assert_eq!(expand(&want), model(&layout));
        // Repeats with contiguous data merge into one piece per visit.
        let a = InterleavedEntry::new(Datum::new(1, 0, 4), vec![Dim::new(4, 6)]).repeated(3);
        let b = InterleavedEntry::new(Datum::new(2, 0, 4), vec![Dim::new(4, 2)]);
        let c = il(vec![a, b]);
        assert_eq!(
            all(&c),
            vec![pc(1, 0, 12), pc(2, 0, 4), pc(1, 12, 12), pc(2, 4, 4)]
        );
        // One entry: repetition changes nothing.
        let one = |r| {
            il(vec![
                InterleavedEntry::new(Datum::new(1, 0, 4), vec![Dim::new(9, 7)]).repeated(r),
            ])
        };
        assert_eq!(all(&one(1)), all(&one(3)));
    }

    #[test]
    fn nonuniform_repeat_and_totals() {
        // A: r=2, 5 data; B: r=1, 4 data; C: r=3, 1 datum.
        let a = InterleavedEntry::new(Datum::new(1, 0, 1), vec![Dim::new(10, 5)]).repeated(2);
        let b = InterleavedEntry::new(Datum::new(2, 0, 1), vec![Dim::new(10, 4)]);
        let cc = InterleavedEntry::new(Datum::new(3, 0, 1), vec![Dim::new(10, 1)]).repeated(3);
        let layout = Layout::Interleaved(vec![a, b, cc]);
        let c = layout.compile(NONE, &CAPS).unwrap();
        let want = vec![
            pc(1, 0, 1),
            pc(1, 10, 1),
            pc(2, 0, 1),
            pc(3, 0, 1), // cycle 0
            pc(1, 20, 1),
            pc(1, 30, 1),
            pc(2, 10, 1), // cycle 1: C ran out
            pc(1, 40, 1),
            pc(2, 20, 1), // cycle 2: A has one left
            pc(2, 30, 1), // cycle 3: only B
        ];
        assert_eq!(all(&c), want);
        assert_eq!(expand(&want), model(&layout));
        for off in 0..c.len() {
            for len in 0..=c.len() - off {
                let mut out = Vec::new();
                c.resolve(off, len, &mut out).unwrap();
                assert_eq!(out, want[off as usize..(off + len) as usize].to_vec());
            }
        }
    }

    // --- nesting --------------------------------------------------------------------------

    #[test]
    fn nested_sg_of_interleaved() {
        let (plain, inner_key) = (0x600, 0x700);
        let inner = column(plain, 16, 2).compile(NONE, &CAPS).unwrap(); // 16 cells of col 2
        let table: HashMap<u32, Compiled> = [(inner_key, inner)].into();
        let lookup = |k: u32| table.get(&k);
        let outer = Layout::Sg(vec![
            Datum::new(inner_key, 8, 20), // cells 1, 2, half of 3
            Datum::new(0x800, 1000, 4),
        ])
        .compile_nested(NONE, &CAPS, lookup)
        .unwrap();
        assert_eq!(outer.level(), 2);
        assert_eq!(outer.len(), 24);
        let mut out = Vec::new();
        outer
            .resolve_nested(0, 24, &lookup, CAPS.max_nesting_level, &mut out)
            .unwrap();
        assert_eq!(
            out,
            vec![
                pc(plain, 16 + 128, 8),
                pc(plain, 16 + 256, 8),
                pc(plain, 16 + 384, 4),
                pc(0x800, 1000, 4)
            ]
        );
        // Without expanding, the nested key is a piece like any other.
        assert_eq!(all(&outer), vec![pc(inner_key, 8, 20), pc(0x800, 1000, 4)]);
        // A datum reaching past the nested layout is an input error.
        let err = Layout::Sg(vec![Datum::new(inner_key, 100, 100)])
            .compile_nested(NONE, &CAPS, lookup)
            .unwrap_err();
        assert_eq!(err.code(), LayoutError::ERR_INPUT);
    }

    #[test]
    fn nesting_limits() {
        // A chain of SG layouts, each over the previous one.
        let mut table: HashMap<u32, Compiled> = HashMap::new();
        let caps = LayoutCaps {
            max_nesting_level: 3,
            ..CAPS
        };
        table.insert(
            0x100,
            Layout::Sg(vec![Datum::new(0x50, 0, 8)])
                .compile(NONE, &caps)
                .unwrap(),
        );
        for k in [0x200, 0x300] {
            let c = Layout::Sg(vec![Datum::new(k - 0x100, 0, 8)])
                .compile_nested(NONE, &caps, |k| table.get(&k))
                .unwrap();
            table.insert(k, c);
        }
        assert_eq!(table[&0x300].level(), 3);
        let err = Layout::Sg(vec![Datum::new(0x300, 0, 8)])
            .compile_nested(NONE, &caps, |k| table.get(&k))
            .unwrap_err();
        assert!(matches!(err, LayoutError::Unsupported(_)), "{err}");
        let mut out = Vec::new();
        table[&0x300]
            .resolve_nested(0, 8, &|k| table.get(&k), 3, &mut out)
            .unwrap();
        assert_eq!(out, vec![pc(0x50, 0, 8)]);
        out.clear();
        let err = table[&0x300]
            .resolve_nested(0, 8, &|k| table.get(&k), 2, &mut out)
            .unwrap_err();
        assert_eq!(err, LayoutError::TooDeep { limit: 2 });
        assert_eq!(err.errno(), libc::ELOOP);
        // A loop (0x100 replaced by a layout over 0x300) stops at the limit.
        table.insert(
            0x100,
            Layout::Sg(vec![Datum::new(0x300, 0, 8)])
                .compile(NONE, &caps)
                .unwrap(),
        );
        let err = table[&0x300].resolve_nested(0, 8, &|k| table.get(&k), u32::MAX, &mut out);
        assert_eq!(
            err,
            Err(LayoutError::TooDeep {
                limit: HARD_MAX_NESTING
            })
        );
    }

    // --- errors ---------------------------------------------------------------------------

    fn e1(addr: u64, len: u64, dims: Vec<Dim>) -> InterleavedEntry {
        InterleavedEntry::new(Datum::new(1, addr, len), dims)
    }

    fn compile_err(layout: Layout, flags: SetLayoutFlags, caps: &LayoutCaps) -> LayoutError {
        layout.compile(flags, caps).unwrap_err()
    }

    #[test]
    fn input_errors() {
        let d = Datum::new(1, 0, 8);
        let dim = vec![Dim::new(8, 4)];
        let cases: Vec<(&str, Layout, SetLayoutFlags)> = vec![
            ("empty sg", Layout::Sg(vec![]), NONE),
            (
                "zero-length sge",
                Layout::Sg(vec![d, Datum::new(1, 0, 0)]),
                NONE,
            ),
            (
                "sge overflow",
                Layout::Sg(vec![Datum::new(1, u64::MAX - 3, 8)]),
                NONE,
            ),
            (
                "sg size overflow",
                Layout::Sg(vec![Datum::new(1, 0, u64::MAX), Datum::new(1, 0, 1)]),
                NONE,
            ),
            (
                "plain key without flag",
                Layout::Sg(vec![Datum::new(PLAIN_KEY, 0, 8)]),
                NONE,
            ),
            ("no entries", Layout::Interleaved(vec![]), NONE),
            (
                "zero datum length",
                Layout::Interleaved(vec![e1(0, 0, dim.clone())]),
                NONE,
            ),
            (
                "num_repeated 0",
                Layout::Interleaved(vec![e1(0, 8, dim.clone()).repeated(0)]),
                NONE,
            ),
            (
                "no dimensions",
                Layout::Interleaved(vec![e1(0, 8, vec![])]),
                NONE,
            ),
            (
                "datum_count 0",
                Layout::Interleaved(vec![e1(0, 8, vec![Dim::new(8, 0)])]),
                NONE,
            ),
            (
                "count product overflow",
                Layout::Interleaved(vec![e1(
                    0,
                    1,
                    vec![Dim::new(0, 1 << 40), Dim::new(0, 1 << 40)],
                )]),
                NONE,
            ),
            (
                "stride overflow",
                Layout::Interleaved(vec![e1(0, 8, vec![Dim::new(u64::MAX / 2, 3)])]),
                NONE,
            ),
            (
                "extent overflow",
                Layout::Interleaved(vec![e1(u64::MAX - 100, 8, vec![Dim::new(50, 3)])]),
                NONE,
            ),
            (
                "size overflow",
                Layout::Interleaved(vec![e1(0, 1 << 40, vec![Dim::new(0, 1 << 30)])]),
                NONE,
            ),
        ];
        for (name, layout, flags) in cases {
            let err = compile_err(layout, flags, &CAPS);
            assert!(matches!(err, LayoutError::Input(_)), "{name}: {err:?}");
            assert_eq!(err.code(), -1, "{name}");
            assert_eq!(err.errno(), libc::EINVAL, "{name}");
        }
        // With the flag, a plain buffer is fine.
        let c = Layout::Sg(vec![Datum::new(PLAIN_KEY, 0, 8)])
            .compile(SetLayoutFlags::REGISTER_BUFFERS, &CAPS)
            .unwrap();
        assert_eq!(all(&c), vec![pc(PLAIN_KEY, 0, 8)]);
        // Overlapping and zero strides are allowed.
        let c = il(vec![
            e1(0, 8, vec![Dim::new(4, 3)]),
            e1(0, 8, vec![Dim::new(0, 3)]),
        ]);
        assert_eq!(c.len(), 48);
    }

    #[test]
    fn unsupported_errors() {
        let d = Datum::new(1, 0, 8);
        let dim = vec![Dim::new(8, 4)];
        let without = |f: LayoutCapFlags| LayoutCaps {
            cap_flags: LayoutCapFlags::all() - f,
            ..CAPS
        };
        let small = LayoutCaps {
            max_sg: 2,
            max_interleaved: 1,
            max_dims: 1,
            max_repeat: 2,
            ..CAPS
        };
        let cases: Vec<(&str, Layout, SetLayoutFlags, LayoutCaps)> = vec![
            (
                "no sg cap",
                Layout::Sg(vec![d]),
                NONE,
                without(LayoutCapFlags::SG),
            ),
            ("too many sges", Layout::Sg(vec![d; 3]), NONE, small),
            (
                "unknown flag",
                Layout::Sg(vec![d]),
                SetLayoutFlags::from_bits_retain(1 << 9),
                CAPS,
            ),
            (
                "no interleaved cap",
                Layout::Interleaved(vec![e1(0, 8, dim.clone())]),
                NONE,
                without(LayoutCapFlags::INTERLEAVED),
            ),
            (
                "too many entries",
                Layout::Interleaved(vec![e1(0, 8, dim.clone()), e1(0, 8, dim.clone())]),
                NONE,
                small,
            ),
            (
                "too many dims",
                Layout::Interleaved(vec![e1(0, 8, vec![Dim::new(8, 2), Dim::new(16, 2)])]),
                NONE,
                small,
            ),
            (
                "repeat > max",
                Layout::Interleaved(vec![e1(0, 8, dim.clone()).repeated(3)]),
                NONE,
                small,
            ),
            (
                "no repeat cap",
                Layout::Interleaved(vec![e1(0, 8, dim.clone()).repeated(2)]),
                NONE,
                without(LayoutCapFlags::INTERLEAVED_REPEAT),
            ),
            (
                "no nonuniform repeat cap",
                Layout::Interleaved(vec![
                    e1(0, 8, vec![Dim::new(8, 4)]).repeated(2),
                    e1(0, 8, vec![Dim::new(8, 2)]),
                ]),
                NONE,
                without(LayoutCapFlags::INTERLEAVED_NONUNIFORM_REPEAT),
            ),
            (
                "no nonuniform total cap",
                Layout::Interleaved(vec![
                    e1(0, 8, vec![Dim::new(8, 4)]),
                    e1(0, 8, vec![Dim::new(8, 3)]),
                ]),
                NONE,
                without(LayoutCapFlags::INTERLEAVED_NONUNIFORM_DATUM_TOTAL),
            ),
            (
                "no internal registration cap",
                Layout::Sg(vec![Datum::new(PLAIN_KEY, 0, 8)]),
                SetLayoutFlags::REGISTER_BUFFERS,
                without(LayoutCapFlags::INTERNAL_REGISTRATION),
            ),
            (
                "nesting level 0",
                Layout::Sg(vec![d]),
                NONE,
                LayoutCaps {
                    max_nesting_level: 0,
                    ..CAPS
                },
            ),
        ];
        for (name, layout, flags, caps) in cases {
            let err = compile_err(layout, flags, &caps);
            assert!(
                matches!(err, LayoutError::Unsupported(_)),
                "{name}: {err:?}"
            );
            assert_eq!((err.code(), err.errno()), (-3, libc::EOPNOTSUPP), "{name}");
        }
        // A uniform shape with non-uniform repeats needs only the repeat caps.
        let ok = Layout::Interleaved(vec![
            e1(0, 8, vec![Dim::new(8, 4)]).repeated(2),
            e1(0, 8, vec![Dim::new(8, 2)]),
        ]);
        ok.compile(
            NONE,
            &without(LayoutCapFlags::INTERLEAVED_NONUNIFORM_DATUM_TOTAL),
        )
        .unwrap();
    }

    #[test]
    fn would_invalidate_and_room() {
        let avoid = SetLayoutFlags::AVOID_INVALIDATION;
        let two = sg(vec![Datum::new(1, 0, 8); 2]);
        let many = sg(vec![Datum::new(1, 0, 8); 40]);
        let ilv = il(vec![e1(0, 8, vec![Dim::new(8, 4)]); 6]);
        // Inline-sized layouts never change keys, even on a fresh MR.
        assert_eq!(
            CAPS.check_replace(avoid, 0, &two),
            Ok(Replacement {
                invalidates: false,
                room: 0
            })
        );
        // Growing past the inline room changes keys, or fails with AVOID_INVALIDATION.
        assert_eq!(
            CAPS.check_replace(NONE, 0, &many),
            Ok(Replacement {
                invalidates: true,
                room: 40
            })
        );
        let err = CAPS.check_replace(avoid, 0, &many).unwrap_err();
        assert_eq!((err.code(), err.errno()), (-2, libc::EBUSY));
        // The same counts again, or fewer, keep the keys.
        assert_eq!(
            CAPS.check_replace(avoid, 40, &many),
            Ok(Replacement {
                invalidates: false,
                room: 40
            })
        );
        assert_eq!(
            CAPS.check_replace(avoid, 40, &ilv),
            Ok(Replacement {
                invalidates: false,
                room: 40
            })
        );
        assert_eq!(
            CAPS.check_replace(avoid, 0, &ilv),
            Err(LayoutError::WouldInvalidate)
        );
        // Page layouts have no inline room.
        let pages = Compiled::from_pages(&[0x1000], 4096, 0, 10).unwrap();
        assert_eq!(
            CAPS.check_replace(avoid, 0, &pages),
            Err(LayoutError::WouldInvalidate)
        );
        let e: crate::Error = LayoutError::WouldInvalidate.into();
        assert_eq!(e.errno(), libc::EBUSY);
    }

    #[test]
    fn out_of_bounds_ranges() {
        let c = sg(vec![Datum::new(1, 0, 8)]);
        let mut out = Vec::new();
        for (off, len) in [(0, 9), (8, 1), (9, 0), (u64::MAX, 2), (1, u64::MAX)] {
            let err = c.resolve(off, len, &mut out).unwrap_err();
            assert_eq!(
                err,
                LayoutError::OutOfBounds {
                    offset: off,
                    len,
                    size: 8
                }
            );
            assert_eq!(err.errno(), libc::EFAULT);
        }
        c.resolve(8, 0, &mut out).unwrap();
        c.resolve(3, 0, &mut out).unwrap();
        assert!(out.is_empty());
    }

    // --- page lists -----------------------------------------------------------------------

    #[test]
    fn page_list() {
        let ps = 4096;
        let pages = [0x10000, 0x11000, 0x40000, 0x8000, 0x9000, 0x77000];
        let c = Compiled::from_pages(&pages, ps, 100, 4 * ps).unwrap();
        assert_eq!(c.len(), 4 * ps);
        assert_eq!(c.slots(), 3); // 0x10000-0x12000, 0x40000, 0x8000-0x9100
        assert_eq!(
            all(&c),
            vec![
                pc(0, 0x10000 + 100, 2 * ps - 100),
                pc(0, 0x40000, ps),
                pc(0, 0x8000, ps + 100)
            ]
        );
        let mut out = Vec::new();
        c.resolve(2 * ps - 100 - 1, 2, &mut out).unwrap();
        assert_eq!(out, vec![pc(0, 0x11fff, 1), pc(0, 0x40000, 1)]);
        for (name, r) in [
            ("page size", Compiled::from_pages(&pages, 3000, 0, 10)),
            (
                "unaligned page",
                Compiled::from_pages(&[0x10001], ps, 0, 10),
            ),
            ("offset", Compiled::from_pages(&pages, ps, ps, 10)),
            ("too long", Compiled::from_pages(&pages, ps, 1, 6 * ps)),
            ("zero length", Compiled::from_pages(&pages, ps, 0, 0)),
            (
                "end overflow",
                Compiled::from_pages(&[u64::MAX - ps + 1], ps, 0, ps),
            ),
            (
                "length overflow",
                Compiled::from_pages(&pages, ps, 1, u64::MAX),
            ),
        ] {
            assert!(matches!(r, Err(LayoutError::Input(_))), "{name}: {r:?}");
        }
    }

    #[test]
    fn page_bitmap() {
        let ps = 4096;
        // Pages 0, 1, 2, 5, 63, 64 and 130.
        let bm = [0b100111 | 1 << 63, 1, 1 << 2, 0, 0];
        let c = Compiled::from_bitmap(0x100000, ps, &bm).unwrap();
        assert_eq!(c.len(), 7 * ps);
        assert_eq!(c.slots(), 3); // trailing empty words dropped
        let at = |p: u64| 0x100000 + p * ps;
        assert_eq!(
            all(&c),
            vec![
                pc(0, at(0), 3 * ps),
                pc(0, at(5), ps),
                pc(0, at(63), 2 * ps),
                pc(0, at(130), ps)
            ]
        );
        let mut out = Vec::new();
        c.resolve(4 * ps + 10, ps, &mut out).unwrap();
        assert_eq!(out, vec![pc(0, at(63) + 10, ps)]);
        assert_eq!(c.spans(), vec![Datum::new(0, at(0), 131 * ps)]);
        // Yuval's case: 4 GiB of 4 KiB pages, every other page present: 1 MiB pages, 128 KiB
        // of bitmap, no page list built.
        let sparse = vec![0x5555_5555_5555_5555u64; (1 << 20) / 64];
        let c = Compiled::from_bitmap(0, ps, &sparse).unwrap();
        assert_eq!(c.len(), (1 << 19) * ps);
        assert!(
            c.descriptor_bytes() < 300 * 1024,
            "{}",
            c.descriptor_bytes()
        );
        out.clear();
        c.resolve(c.len() - ps - 1, 2, &mut out).unwrap();
        let last = (1u64 << 20) - 2;
        assert_eq!(
            out,
            vec![pc(0, (last - 2) * ps + ps - 1, 1), pc(0, last * ps, 1)]
        );
        for (name, r) in [
            ("page size", Compiled::from_bitmap(0, 0, &[1])),
            ("unaligned base", Compiled::from_bitmap(100, ps, &[1])),
            ("empty", Compiled::from_bitmap(0, ps, &[0, 0])),
            ("no words", Compiled::from_bitmap(0, ps, &[])),
            (
                "overflow",
                Compiled::from_bitmap(u64::MAX - ps + 1, ps, &[2]),
            ),
        ] {
            assert!(matches!(r, Err(LayoutError::Input(_))), "{name}: {r:?}");
        }
    }

    #[test]
    fn spans_cover_each_entry() {
        let c = il(vec![
            e1(100, 8, vec![Dim::new(16, 4), Dim::new(1000, 2)]),
            InterleavedEntry::new(Datum::new(2, 0, 4), vec![Dim::new(4, 16)]),
        ]);
        assert_eq!(
            c.spans(),
            vec![Datum::new(1, 100, 48 + 1000 + 8), Datum::new(2, 0, 64)]
        );
    }

    // --- property tests against the naive model ---------------------------------------------

    fn datum_strategy() -> impl Strategy<Value = Datum> {
        (1u32..4, 0u64..200, 1u64..20).prop_map(|(k, a, l)| Datum::new(k, a, l))
    }

    fn entry_strategy() -> impl Strategy<Value = InterleavedEntry> {
        (
            (1u32..4, 0u64..100, 1u64..7).prop_map(|(k, a, l)| Datum::new(k, a, l)),
            1u32..4,
            prop::collection::vec((0u64..30, 1u64..5).prop_map(|(s, c)| Dim::new(s, c)), 1..4),
            any::<bool>(),
        )
            .prop_map(|(first, r, mut dims, contig)| {
                if contig {
                    dims[0].offset_stride = first.len; // exercise the contiguous-run path
                }
                InterleavedEntry {
                    first,
                    num_repeated: r,
                    dims,
                }
            })
    }

    fn layout_strategy() -> impl Strategy<Value = Layout> {
        prop_oneof![
            prop::collection::vec(datum_strategy(), 1..7).prop_map(Layout::Sg),
            prop::collection::vec(entry_strategy(), 1..5).prop_map(Layout::Interleaved),
        ]
    }

    fn check_ranges(
        c: &Compiled,
        want: &[(u32, u64)],
        ranges: &[(u64, u64)],
    ) -> Result<(), TestCaseError> {
        prop_assert_eq!(c.len(), want.len() as u64);
        for &(a, b) in ranges {
            let off = a % (c.len() + 1);
            let len = b % (c.len() - off + 1);
            let mut out = Vec::new();
            c.resolve(off, len, &mut out).unwrap();
            assert_merged(&out);
            prop_assert_eq!(&expand(&out)[..], &want[off as usize..(off + len) as usize]);
            let lazy: Vec<Piece> = c.pieces(off, len).unwrap().collect();
            prop_assert_eq!(lazy, out);
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn resolve_matches_model(
            layout in layout_strategy(),
            ranges in prop::collection::vec((0u64..10_000, 0u64..10_000), 1..12),
        ) {
            let c = layout.compile(NONE, &CAPS).unwrap();
            check_ranges(&c, &model(&layout), &ranges)?;
        }

        #[test]
        fn nested_resolve_matches_model(
            inner in prop::collection::vec(entry_strategy(), 1..4),
            outer in prop::collection::vec((any::<bool>(), 0u64..10_000, 1u64..30, 0u64..200), 1..5),
            ranges in prop::collection::vec((0u64..10_000, 0u64..10_000), 1..8),
        ) {
            const INNER: u32 = 0x900;
            let inner_layout = Layout::Interleaved(inner);
            let ic = inner_layout.compile(NONE, &CAPS).unwrap();
            let inner_bytes = model(&inner_layout);
            let outer: Vec<Datum> = outer
                .into_iter()
                .map(|(nested, a, l, plain_addr)| {
                    if nested {
                        let a = a % ic.len();
                        Datum::new(INNER, a, 1 + (l - 1) % (ic.len() - a))
                    } else {
                        Datum::new(1, plain_addr, l)
                    }
                })
                .collect();
            let table: HashMap<u32, Compiled> = [(INNER, ic)].into();
            let lookup = |k: u32| table.get(&k);
            let outer_layout = Layout::Sg(outer);
            let oc = outer_layout.compile_nested(NONE, &CAPS, lookup).unwrap();
            let want: Vec<(u32, u64)> = model(&outer_layout)
                .into_iter()
                .map(|(k, a)| if k == INNER { inner_bytes[a as usize] } else { (k, a) })
                .collect();
            prop_assert_eq!(oc.len(), want.len() as u64);
            for (a, b) in ranges {
                let off = a % (oc.len() + 1);
                let len = b % (oc.len() - off + 1);
                let mut out = Vec::new();
                oc.resolve_nested(off, len, &lookup, 2, &mut out).unwrap();
                assert_merged(&out);
                prop_assert_eq!(&expand(&out)[..], &want[off as usize..(off + len) as usize]);
            }
        }

        #[test]
        fn pages_match_model(
            words in prop::collection::vec(any::<u64>(), 1..4),
            shift in 0u32..4,
            base_pages in 0u64..8,
            ranges in prop::collection::vec((0u64..100_000, 0u64..100_000), 1..8),
        ) {
            let ps = 1u64 << shift;
            let base = base_pages * ps;
            let set: Vec<u64> = (0..words.len() as u64 * 64)
                .filter(|i| words[(i / 64) as usize] >> (i % 64) & 1 == 1)
                .collect();
            let bm = Compiled::from_bitmap(base, ps, &words);
            if set.is_empty() {
                prop_assert!(bm.is_err());
                return Ok(());
            }
            let bm = bm.unwrap();
            let want: Vec<(u32, u64)> = set
                .iter()
                .flat_map(|p| (0..ps).map(move |b| (PLAIN_KEY, base + p * ps + b)))
                .collect();
            check_ranges(&bm, &want, &ranges)?;
            // The same pages as a page list, from an offset inside the first page.
            let pages: Vec<u64> = set.iter().map(|p| base + p * ps).collect();
            let first = base_pages % ps;
            let length = set.len() as u64 * ps - first;
            let pl = Compiled::from_pages(&pages, ps, first, length).unwrap();
            check_ranges(&pl, &want[first as usize..], &ranges)?;
        }
    }
}
