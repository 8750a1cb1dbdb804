//! `softverbs perf cq-poll`: the cost of reading completions through each of the four ways to
//! poll a CQ, beside the classic `poll` of the same run.
//!
//! For each field set ({none}, {byte_len}, {byte_len, timestamp}, {all supported}) one CQ is
//! created with `create_cq_ex` and exactly those `wc_flags`; an RC QP pair of this process
//! fills it with real completions (SENDs, half of them with immediate data, into posted
//! receives: half send completions, half receive completions). Then only the drain of those
//! completions is timed, through one of these APIs:
//!
//! - **classic**: `CompletionQueue::poll` into a `WorkCompletion` array (the wall-clock field,
//!   which `WorkCompletion` lacks, is computed from the timestamp with one wall-clock reading
//!   per batch, as the other APIs do);
//! - **compact**: `poll_ex` into a buffer of the seed's compact records, read at the offsets
//!   the seed's `get_offsetof*` give for the CQ's flags, constants of the program as the
//!   seed's man page advises (a struct of the fields the CQ was created with);
//! - **cursor**: `start_poll` / `next` / `end` with the `Option`-returning readers;
//! - **typed**: the typed cursor, the field set a type parameter;
//! - **compact-rt** (no target, for information): compact records read at offsets worked
//!   out from the CQ's `compact_flags()` when the program runs.
//!
//! A batch is `B` completions per `poll` / `poll_ex` call, or per polling section of a cursor.
//! Every API reads every field of the set of every completion and folds it into checksums; the
//! checksums of the deterministic fields (count, `wr_id`, opcode, byte_len, imm, QP numbers,
//! LID fields) must agree across the APIs, or the run fails. Fills are interleaved round by
//! round over every case and API (the API order rotating), so machine noise hits all alike,
//! and each round runs at another stack depth (see `deeper`), so no API keeps a lucky or
//! unlucky memory layout for the whole run.

use crate::Result;
use crate::report::{count_arg, median, print_report};
use serde::Serialize;
use softverbs::compact::{self, SeedWcFlags as S};
use softverbs::nic::clock::{Clock, WallClock};
use softverbs::{
    AccessFlags, CompletionQueue, Context, CqInitAttrEx, MemoryRegion, PollCqExAttr,
    ProtectionDomain, QpCap, QpInitAttr, QueuePair, RecvWr, SendFlags, SendOp, SendWr, Sge,
    WcExFlags, WcStatus, WorkCompletion, fields,
};
use std::hint::black_box;
use std::time::Instant;

/// Completions polled through each API for each case, normally and with `--quick`.
const DEFAULT_COMPLETIONS: u64 = 1_000_000;
const QUICK_COMPLETIONS: u64 = 20_000;
/// Completions per fill of the CQ: a multiple of every batch, and 1,000,000 / 1600 = 625
/// fills exactly. Half are send completions, half receive completions.
const PER_FILL: usize = 1600;
const HALF: usize = PER_FILL / 2;
/// Completions per `poll` call or polling section.
const BATCHES: [usize; 2] = [16, 64];
/// SEND sizes are 1..=MSG_MAX bytes.
const MSG_MAX: usize = 16;
/// `wr_id`s of receives start here (sends count from 0).
const RECV_WR_ID: u64 = 1 << 32;

/// The field sets measured: their names and `wc_flags` (the typed cursor's type parameter).
const NONE: u64 = fields::NONE;
const BL: u64 = fields::BYTE_LEN;
const BL_TS: u64 = fields::BYTE_LEN | fields::COMPLETION_TIMESTAMP;
const ALL: u64 = fields::ALL;
const FIELD_SETS: [(&str, u64); 4] = [
    ("none", NONE),
    ("byte_len", BL),
    ("byte_len+ts", BL_TS),
    ("all", ALL),
];

/// The APIs, and the target ratio to classic of each (none for classic itself).
const APIS: [(&str, Option<f64>); 5] = [
    ("classic", None),
    ("compact", Some(1.10)),
    ("cursor", Some(1.10)),
    ("typed", Some(1.00)),
    // Informational: what reading compact records costs when the program learns its CQ's
    // flags only at run time.
    ("compact-rt", None),
];

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// 20000 completions per API and case instead of 1000000: a smoke check.
    #[arg(long)]
    quick: bool,
    /// Completions to poll through each API for each field set and batch size (rounded up to
    /// whole fills of 1600) [default: 1000000; with --quick 20000].
    #[arg(short = 'n', long, value_name = "N")]
    completions: Option<u64>,
    /// Device to use (default: the first device).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    device: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Checksums.

/// What a drain read, folded. All but `ts` and `wall` are the same for every API.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Sums {
    count: u64,
    failed: u64,
    wr_id: u64,
    opcode: u64,
    byte_len: u64,
    imm: u64,
    qp_num: u64,
    src_qp: u64,
    slid: u64,
    sl: u64,
    dlid_path_bits: u64,
    /// Raw timestamps and wall-clock nanoseconds: read, but different on every fill.
    ts: u64,
    wall: u64,
}

impl Sums {
    /// The fields every API must agree on.
    fn deterministic(&self) -> Sums {
        Sums {
            ts: 0,
            wall: 0,
            ..*self
        }
    }

    fn add(&mut self, o: &Sums) {
        self.count += o.count;
        self.failed += o.failed;
        self.wr_id = self.wr_id.wrapping_add(o.wr_id);
        self.opcode += o.opcode;
        self.byte_len += o.byte_len;
        self.imm = self.imm.wrapping_add(o.imm);
        self.qp_num += o.qp_num;
        self.src_qp += o.src_qp;
        self.slid += o.slid;
        self.sl += o.sl;
        self.dlid_path_bits += o.dlid_path_bits;
        self.ts = self.ts.wrapping_add(o.ts);
        self.wall = self.wall.wrapping_add(o.wall);
    }
}

/// `x` of field set `F` has `flag`: a compile-time constant in the monomorphised drains.
const fn has(f: u64, flag: u64) -> bool {
    f & flag != 0
}

// ---------------------------------------------------------------------------------------------
// The four drains. Each polls exactly `k` completions (fewer is an error, reported by the
// count), in batches of `batch`, and times only that.

/// Classic `poll` into `wcs` (at least `batch` long).
#[inline(never)]
fn drain_classic<const F: u64>(
    cq: &CompletionQueue,
    clock: &Clock,
    k: usize,
    batch: usize,
    wcs: &mut [WorkCompletion],
) -> (f64, Sums) {
    let mut s = Sums::default();
    let start = Instant::now();
    let mut left = k;
    while left > 0 {
        // As poll_ex and the cursors do: one wall-clock reading per batch.
        let wall = if has(F, fields::COMPLETION_TIMESTAMP_WALLCLOCK) {
            clock.wall()
        } else {
            WallClock::default()
        };
        let n = cq.poll(&mut wcs[..batch.min(left)]);
        if n == 0 {
            break;
        }
        for wc in &wcs[..n] {
            s.count += 1;
            s.failed += u64::from(!wc.is_ok());
            s.wr_id = s.wr_id.wrapping_add(wc.wr_id());
            s.opcode += wc.opcode() as u64;
            if has(F, fields::BYTE_LEN) {
                s.byte_len += u64::from(wc.byte_len());
            }
            if has(F, fields::IMM) {
                s.imm = s.imm.wrapping_add(u64::from(wc.imm_data().unwrap_or(0)));
            }
            if has(F, fields::QP_NUM) {
                s.qp_num += u64::from(wc.qp_num());
            }
            if has(F, fields::SRC_QP) {
                s.src_qp += u64::from(wc.src_qp());
            }
            if has(F, fields::SLID) {
                s.slid += u64::from(wc.slid());
            }
            if has(F, fields::SL) {
                s.sl += u64::from(wc.sl());
            }
            if has(F, fields::DLID_PATH_BITS) {
                s.dlid_path_bits += u64::from(wc.dlid_path_bits());
            }
            if has(F, fields::COMPLETION_TIMESTAMP) {
                s.ts = s.ts.wrapping_add(wc.timestamp());
            }
            if has(F, fields::COMPLETION_TIMESTAMP_WALLCLOCK) {
                s.wall = s.wall.wrapping_add(wall.ns(wc.timestamp()));
            }
        }
        left -= n;
    }
    let ns = start.elapsed().as_nanos() as f64;
    (ns, black_box(s))
}

/// The seed's creation flags of a CQ created with field set `f`.
const fn seed_of(f: u64) -> u64 {
    compact::seed_flags(WcExFlags::from_bits_retain(f)).bits()
}

/// Where each field lies in a compact record of a CQ with seed flags `flags` (from the record
/// start), and the record size: the seed's `get_offsetof*` and `get_size`.
#[derive(Clone, Copy)]
struct Offsets {
    size: usize,
    byte_len: usize,
    imm: usize,
    qp_num: usize,
    src_qp: usize,
    slid: usize,
    sl: usize,
    dlid_path_bits: usize,
    ts: usize,
    wall: usize,
}

impl Offsets {
    const fn of(flags: u64) -> Offsets {
        const H: usize = compact::HEADER_LEN;
        Offsets {
            size: compact::get_size(flags),
            byte_len: H + compact::get_offsetof32(flags, S::WITH_BYTE_LEN.bits()),
            imm: H + compact::get_offsetof32(flags, S::WITH_IMM.bits()),
            qp_num: H + compact::get_offsetof32(flags, S::WITH_QP_NUM.bits()),
            src_qp: H + compact::get_offsetof32(flags, S::WITH_SRC_QP.bits()),
            slid: H + compact::get_offsetof16(flags, S::WITH_SLID.bits()),
            sl: H + compact::get_offsetof8(flags, S::WITH_SL.bits()),
            dlid_path_bits: H + compact::get_offsetof8(flags, S::WITH_DLID_PATH_BITS.bits()),
            ts: H + compact::get_offsetof64(flags, S::WITH_COMPLETION_TIMESTAMP.bits()),
            wall: H + compact::get_offsetof64(flags, S::WITH_COMPLETION_TIMESTAMP_WALLCLOCK.bits()),
        }
    }
}

/// `poll_ex` into `buf` (at least `batch` records long), read with the seed's helpers.
///
/// The seed's man page advises a program to declare a struct of the fields it created its
/// CQ with: the layout is known when the program is compiled, and the seed's static inline
/// `get_offsetof*` / `get_size` fold to constants. That is the `compact` column (the CQ's
/// `compact_flags()` is checked against the constant first). With `RUNTIME`, the offsets are
/// worked out from `compact_flags()` once per drain instead, as for a program that learns its
/// CQ's flags only when it runs (the `compact-rt` column).
#[inline(never)]
fn drain_compact<const F: u64, const RUNTIME: bool>(
    cq: &CompletionQueue,
    k: usize,
    batch: usize,
    buf: &mut [u8],
) -> Result<(f64, Sums)> {
    let flags = cq.compact_flags().bits();
    let o = if RUNTIME {
        Offsets::of(flags)
    } else {
        if flags != seed_of(F) || cq.compact_record_size() != compact::get_size(seed_of(F)) {
            return Err(format!("compact flags {flags:#x}, expected {:#x}", seed_of(F)).into());
        }
        const { Offsets::of(seed_of(F)) }
    };
    let size = o.size;
    let mut s = Sums::default();
    let start = Instant::now();
    let mut left = k;
    while left > 0 {
        let want = batch.min(left);
        let attr = PollCqExAttr {
            max_entries: want,
            comp_mask: 0,
        };
        let n = cq.poll_ex(&mut buf[..want * size], attr)?;
        if n == 0 {
            break;
        }
        for rec in compact::records(buf, size, n) {
            let h = compact::header(rec);
            s.count += 1;
            s.failed += u64::from(h.status != WcStatus::Success as u32);
            s.wr_id = s.wr_id.wrapping_add(h.wr_id);
            s.opcode += u64::from(h.opcode);
            if has(F, fields::BYTE_LEN) {
                s.byte_len += u64::from(compact::read32(rec, o.byte_len));
            }
            if has(F, fields::IMM) && h.wc_flags & S::IMM.bits() != 0 {
                let imm = compact::read32(rec, o.imm);
                s.imm = s.imm.wrapping_add(u64::from(imm));
            }
            if has(F, fields::QP_NUM) {
                s.qp_num += u64::from(compact::read32(rec, o.qp_num));
            }
            if has(F, fields::SRC_QP) {
                s.src_qp += u64::from(compact::read32(rec, o.src_qp));
            }
            if has(F, fields::SLID) {
                s.slid += u64::from(compact::read16(rec, o.slid));
            }
            if has(F, fields::SL) {
                s.sl += u64::from(compact::read8(rec, o.sl));
            }
            if has(F, fields::DLID_PATH_BITS) {
                let bits = compact::read8(rec, o.dlid_path_bits);
                s.dlid_path_bits += u64::from(bits);
            }
            if has(F, fields::COMPLETION_TIMESTAMP) {
                let ts = compact::read64(rec, o.ts);
                s.ts = s.ts.wrapping_add(ts);
            }
            if has(F, fields::COMPLETION_TIMESTAMP_WALLCLOCK) {
                let wall = compact::read64(rec, o.wall);
                s.wall = s.wall.wrapping_add(wall);
            }
        }
        left -= n;
    }
    let ns = start.elapsed().as_nanos() as f64;
    Ok((ns, black_box(s)))
}

/// The cursor: one polling section per batch, `Option`-returning readers.
#[inline(never)]
fn drain_cursor<const F: u64>(cq: &CompletionQueue, k: usize, batch: usize) -> (f64, Sums) {
    let mut s = Sums::default();
    let start = Instant::now();
    let mut left = k;
    'sections: while left > 0 {
        let Some(mut c) = cq.start_poll() else { break };
        let want = batch.min(left);
        let mut n = 0;
        loop {
            s.count += 1;
            s.failed += u64::from(!c.is_ok());
            s.wr_id = s.wr_id.wrapping_add(c.wr_id());
            s.opcode += c.opcode() as u64;
            if has(F, fields::BYTE_LEN) {
                s.byte_len += u64::from(c.byte_len().unwrap_or(0));
            }
            if has(F, fields::IMM) {
                s.imm = s.imm.wrapping_add(u64::from(c.imm_data().unwrap_or(0)));
            }
            if has(F, fields::QP_NUM) {
                s.qp_num += u64::from(c.qp_num().unwrap_or(0));
            }
            if has(F, fields::SRC_QP) {
                s.src_qp += u64::from(c.src_qp().unwrap_or(0));
            }
            if has(F, fields::SLID) {
                s.slid += u64::from(c.slid().unwrap_or(0));
            }
            if has(F, fields::SL) {
                s.sl += u64::from(c.sl().unwrap_or(0));
            }
            if has(F, fields::DLID_PATH_BITS) {
                s.dlid_path_bits += u64::from(c.dlid_path_bits().unwrap_or(0));
            }
            if has(F, fields::COMPLETION_TIMESTAMP) {
                s.ts = s.ts.wrapping_add(c.completion_ts().unwrap_or(0));
            }
            if has(F, fields::COMPLETION_TIMESTAMP_WALLCLOCK) {
                s.wall = s
                    .wall
                    .wrapping_add(c.completion_wallclock_ns().unwrap_or(0));
            }
            n += 1;
            // Ending the section consumes the completion held, so stop before `next` takes
            // one more than the batch.
            if n == want {
                break;
            }
            if !c.next() {
                left -= n;
                break 'sections;
            }
        }
        c.end();
        left -= n;
    }
    let _ = left;
    let ns = start.elapsed().as_nanos() as f64;
    (ns, black_box(s))
}

/// The typed cursor's drain for field set `$f`; `$fold` reads exactly the fields of `$f`
/// (reading any other would not compile).
macro_rules! drain_typed {
    ($name:ident, $f:expr, |$c:ident, $s:ident| $fold:block) => {
        #[inline(never)]
        fn $name(cq: &CompletionQueue, k: usize, batch: usize) -> Result<(f64, Sums)> {
            let typed = cq.typed::<{ $f }>()?;
            let mut $s = Sums::default();
            let start = Instant::now();
            let mut left = k;
            'sections: while left > 0 {
                let Some(mut $c) = typed.start_poll() else {
                    break;
                };
                let want = batch.min(left);
                let mut n = 0;
                loop {
                    $s.count += 1;
                    $s.failed += u64::from(!$c.is_ok());
                    $s.wr_id = $s.wr_id.wrapping_add($c.wr_id());
                    $s.opcode += $c.opcode() as u64;
                    $fold
                    n += 1;
                    if n == want {
                        break;
                    }
                    if !$c.next() {
                        left -= n;
                        break 'sections;
                    }
                }
                $c.end();
                left -= n;
            }
            let _ = left;
            let ns = start.elapsed().as_nanos() as f64;
            Ok((ns, black_box($s)))
        }
    };
}

drain_typed!(drain_typed_none, NONE, |c, s| {});
drain_typed!(drain_typed_bl, BL, |c, s| {
    s.byte_len += u64::from(c.byte_len());
});
drain_typed!(drain_typed_bl_ts, BL_TS, |c, s| {
    s.byte_len += u64::from(c.byte_len());
    s.ts = s.ts.wrapping_add(c.completion_ts());
});
drain_typed!(drain_typed_all, ALL, |c, s| {
    s.byte_len += u64::from(c.byte_len());
    s.imm = s.imm.wrapping_add(u64::from(c.imm_data().unwrap_or(0)));
    s.qp_num += u64::from(c.qp_num());
    s.src_qp += u64::from(c.src_qp());
    s.slid += u64::from(c.slid());
    s.sl += u64::from(c.sl());
    s.dlid_path_bits += u64::from(c.dlid_path_bits());
    s.ts = s.ts.wrapping_add(c.completion_ts());
    s.wall = s.wall.wrapping_add(c.completion_wallclock_ns());
});

// ---------------------------------------------------------------------------------------------
// One field set's CQ and the QP pair that fills it.

struct Bench {
    // Dropped in this order: QPs, memory, CQ, PD, context.
    a: QueuePair,
    b: QueuePair,
    mr: MemoryRegion<'static>,
    cq: CompletionQueue,
    _pd: ProtectionDomain,
    _ctx: Context,
    /// The field set (`wc_flags` bits).
    flags: u64,
    clock: Clock,
    /// SGE of send `i`: 1 + i % MSG_MAX bytes.
    send_sges: Vec<[Sge; 1]>,
    recv_sge: [Sge; 1],
    wcs: Vec<WorkCompletion>,
    buf: Vec<u8>,
}

impl Bench {
    fn new(device: &softverbs::Device, flags: u64) -> Result<Bench> {
        let ctx = device.open()?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq_ex(
            &CqInitAttrEx::new(PER_FILL as u32).wc_flags(WcExFlags::from_bits_retain(flags)),
        )?;
        let attr = QpInitAttr {
            cap: QpCap {
                max_send_wr: HALF as u32,
                max_recv_wr: HALF as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            ..QpInitAttr::rc(&cq, &cq)
        };
        let (a, b) = (pd.create_qp(&attr)?, pd.create_qp(&attr)?);
        let access = AccessFlags::LOCAL_WRITE;
        a.connect(&b.endpoint(0)?, 0, access)?;
        b.connect(&a.endpoint(0)?, 0, access)?;
        let mr = pd.alloc_mr(2 * MSG_MAX, access)?;
        let send_sges = (0..HALF).map(|i| [mr.sge(0..1 + i % MSG_MAX)]).collect();
        let recv_sge = [mr.sge(MSG_MAX..2 * MSG_MAX)];
        // The device clock's width; its value is CLOCK_MONOTONIC nanoseconds under the mask,
        // so a `Clock` of that width gives the wall-clock readings the CQ's own would.
        let mask = ctx.clock().mask;
        let clock = Clock::new(64 - mask.leading_zeros());
        let batch = BATCHES.iter().copied().max().unwrap_or(1);
        Ok(Bench {
            wcs: vec![WorkCompletion::default(); batch],
            buf: vec![0; batch * cq.compact_record_size()],
            a,
            b,
            mr,
            cq,
            _pd: pd,
            _ctx: ctx,
            flags,
            clock,
            send_sges,
            recv_sge,
        })
    }

    /// Puts PER_FILL completions into the CQ: HALF receives posted, then HALF signaled
    /// SENDs (every other one with immediate data), which the software NIC carries out, and
    /// completes on both sides, within `post_send`.
    fn fill(&self) -> Result<()> {
        let _ = &self.mr;
        self.b
            .post_recv((0..HALF).map(|i| RecvWr::new(RECV_WR_ID + i as u64, &self.recv_sge)))?;
        self.a.post_send((0..HALF).map(|i| {
            let op = if i % 2 == 0 {
                SendOp::SendWithImm { imm: i as u32 }
            } else {
                SendOp::Send
            };
            SendWr::new(i as u64, op, &self.send_sges[i]).flags(SendFlags::SIGNALED)
        }))?;
        Ok(())
    }

    /// Fills the CQ and drains it through `api` in batches of `batch`: (ns, sums).
    fn round(&mut self, api: usize, batch: usize) -> Result<(f64, Sums)> {
        self.fill()?;
        let (k, cq) = (PER_FILL, &self.cq);
        let got = match (api, self.flags) {
            (0, NONE) => drain_classic::<NONE>(cq, &self.clock, k, batch, &mut self.wcs),
            (0, BL) => drain_classic::<BL>(cq, &self.clock, k, batch, &mut self.wcs),
            (0, BL_TS) => drain_classic::<BL_TS>(cq, &self.clock, k, batch, &mut self.wcs),
            (0, ALL) => drain_classic::<ALL>(cq, &self.clock, k, batch, &mut self.wcs),
            (1, NONE) => drain_compact::<NONE, false>(cq, k, batch, &mut self.buf)?,
            (1, BL) => drain_compact::<BL, false>(cq, k, batch, &mut self.buf)?,
            (1, BL_TS) => drain_compact::<BL_TS, false>(cq, k, batch, &mut self.buf)?,
            (1, ALL) => drain_compact::<ALL, false>(cq, k, batch, &mut self.buf)?,
            (4, NONE) => drain_compact::<NONE, true>(cq, k, batch, &mut self.buf)?,
            (4, BL) => drain_compact::<BL, true>(cq, k, batch, &mut self.buf)?,
            (4, BL_TS) => drain_compact::<BL_TS, true>(cq, k, batch, &mut self.buf)?,
            (4, ALL) => drain_compact::<ALL, true>(cq, k, batch, &mut self.buf)?,
            (2, NONE) => drain_cursor::<NONE>(cq, k, batch),
            (2, BL) => drain_cursor::<BL>(cq, k, batch),
            (2, BL_TS) => drain_cursor::<BL_TS>(cq, k, batch),
            (2, ALL) => drain_cursor::<ALL>(cq, k, batch),
            (3, NONE) => drain_typed_none(cq, k, batch)?,
            (3, BL) => drain_typed_bl(cq, k, batch)?,
            (3, BL_TS) => drain_typed_bl_ts(cq, k, batch)?,
            (3, ALL) => drain_typed_all(cq, k, batch)?,
            (api, flags) => return Err(format!("no drain for API {api}, fields {flags:#x}").into()),
        };
        let s = &got.1;
        if s.count != k as u64 || s.failed != 0 {
            return Err(format!(
                "{} drain of the {} CQ: {} completions ({} failed), expected {k} successful ones",
                APIS[api].0,
                set_name(self.flags),
                s.count,
                s.failed
            )
            .into());
        }
        Ok(got)
    }
}

/// Stack depths the drains rotate through (see [`deeper`]).
const STACK_DEPTHS: usize = 48;

/// Runs `f` `depth` frames (of 100-odd bytes each) further down the stack.
///
/// Without this, about one run in six had one API in one case ~3% slower or faster than
/// usual for the whole run: where a drain's stack frame lies relative to the CQ ring and the
/// buffers modulo 4 KiB moves with every run of the program (the stack's start is
/// randomised), and some placements make loads wait on unrelated stores (4K aliasing, most
/// likely). Rotating the depth fill by fill averages that out within the run.
#[inline(never)]
fn deeper<R>(depth: usize, f: &mut dyn FnMut() -> R) -> R {
    let pad = black_box([0u8; 64]);
    let r = if depth == 0 {
        f()
    } else {
        deeper(depth - 1, f)
    };
    black_box(&pad);
    r
}

fn set_name(flags: u64) -> &'static str {
    FIELD_SETS
        .iter()
        .find(|(_, f)| *f == flags)
        .map_or("?", |(n, _)| n)
}

// ---------------------------------------------------------------------------------------------
// The report.

#[derive(Debug, Clone, Serialize)]
struct Row {
    /// Field set name: none, byte_len, byte_len+ts, all.
    fields: &'static str,
    /// The CQ's `wc_flags`.
    wc_flags: u64,
    batch: usize,
    /// classic, compact, cursor, typed.
    api: &'static str,
    /// Completions polled (fills × completions per fill).
    completions: u64,
    /// Median over fills of (drain time / completions): the figure compared.
    ns_per_completion: f64,
    /// Total drain time / total completions.
    mean_ns_per_completion: f64,
    /// ns_per_completion / classic's ns_per_completion of the same field set and batch.
    ratio: f64,
    /// The target ratio (none for classic).
    target: Option<f64>,
    /// ratio <= target (none for classic).
    meets_target: Option<bool>,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    quick: bool,
    cpus: usize,
    cpu_model: String,
    /// Completions per fill of the CQ (half send, half receive completions).
    per_fill: usize,
    /// Fills drained through each API for each field set and batch.
    fills: u64,
    /// How `ns_per_completion` is computed.
    statistic: &'static str,
    /// The deterministic checksums agreed across the APIs for every case.
    checksums_agree: bool,
    /// Every target held.
    targets_met: bool,
    rows: Vec<Row>,
}

impl Report {
    fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "perf cq-poll: {}, {} completions per API and case ({} fills of {}: SENDs and their \
             receives), {} CPU{} ({}); only the polling is timed",
            self.device,
            self.fills * self.per_fill as u64,
            self.fills,
            self.per_fill,
            self.cpus,
            if self.cpus == 1 { "" } else { "s" },
            self.cpu_model
        );
        let _ = writeln!(
            t,
            "ns per completion = median over fills; ratio to classic poll of the same run; \
             targets: typed <= 1.00x, cursor and compact <= 1.10x (* = missed)"
        );
        let _ = writeln!(
            t,
            "  {:<12} {:>5}  {:>8}  {:>16}  {:>16}  {:>16}  {:>16}",
            "fields", "batch", "classic", "compact", "cursor", "typed", "compact-rt"
        );
        for chunk in self.rows.chunks(APIS.len()) {
            let mut line = format!(
                "  {:<12} {:>5}  {:>5.2} ns",
                chunk[0].fields, chunk[0].batch, chunk[0].ns_per_completion
            );
            for r in &chunk[1..] {
                let mark = if r.meets_target == Some(false) {
                    '*'
                } else {
                    ' '
                };
                let _ = write!(
                    line,
                    "  {:>5.2} ns {:>4.2}x{mark}",
                    r.ns_per_completion, r.ratio
                );
            }
            let _ = writeln!(t, "{}", line.trim_end());
        }
        for (api, target) in APIS.iter().filter_map(|(a, t)| Some((a, (*t)?))) {
            let rows: Vec<&Row> = self.rows.iter().filter(|r| r.api == *api).collect();
            let met = rows.iter().filter(|r| r.meets_target == Some(true)).count();
            let worst = rows.iter().map(|r| r.ratio).fold(0.0, f64::max);
            let _ = writeln!(
                t,
                "  {api} <= {target:.2}x: {met} of {} cases (worst {worst:.2}x)",
                rows.len()
            );
        }
        let _ = writeln!(
            t,
            "  checksums (count, wr_id, opcode, byte_len, imm, qp_num, src_qp, slid, sl, \
             dlid_path_bits) agree across the APIs"
        );
        t
    }
}

pub fn run(args: &Args) -> Result<()> {
    let n = count_arg(
        "--completions",
        args.completions,
        args.quick,
        (DEFAULT_COMPLETIONS, QUICK_COMPLETIONS),
        1 << 40,
    )?;
    let fills = n.div_ceil(PER_FILL as u64);
    let device = crate::find_device(args.device.as_deref())?;
    let mut benches = FIELD_SETS
        .iter()
        .map(|&(name, flags)| {
            Bench::new(&device, flags)
                .map_err(|e| -> crate::Error { format!("setting up the {name} CQ: {e}").into() })
        })
        .collect::<Result<Vec<_>>>()?;

    // Cases: (field set, batch); per case and API the samples and the sums.
    let cases: Vec<(usize, usize)> = (0..FIELD_SETS.len())
        .flat_map(|f| BATCHES.iter().map(move |&b| (f, b)))
        .collect();
    let mut samples = vec![[const { Vec::<f64>::new() }; APIS.len()]; cases.len()];
    let mut total_ns = vec![[0f64; APIS.len()]; cases.len()];
    let mut sums = vec![[Sums::default(); APIS.len()]; cases.len()];
    // One unmeasured round of everything first (page faults, caches, branch predictors).
    for round in 0..=fills {
        for (ci, &(f, batch)) in cases.iter().enumerate() {
            for i in 0..APIS.len() {
                // Rotate the order, so no API always runs right after a fill of another kind.
                let api = (i + round as usize + ci) % APIS.len();
                // Every API drains at the same rotation of stack depths.
                let depth = round as usize % STACK_DEPTHS;
                let (ns, s) = deeper(depth, &mut || benches[f].round(api, batch))?;
                if round == 0 {
                    continue;
                }
                samples[ci][api].push(ns / PER_FILL as f64);
                total_ns[ci][api] += ns;
                sums[ci][api].add(&s);
            }
        }
    }

    // The checksums of every API against classic's.
    for (ci, &(f, batch)) in cases.iter().enumerate() {
        let want = sums[ci][0].deterministic();
        for (api, got) in sums[ci].iter().enumerate().skip(1) {
            if got.deterministic() != want {
                return Err(format!(
                    "checksums differ: fields {}, batch {batch}: classic read {want:?}, {} read \
                     {:?}",
                    FIELD_SETS[f].0,
                    APIS[api].0,
                    got.deterministic()
                )
                .into());
            }
        }
        // Fields in the set were really read (the software NIC's values are never all 0).
        let flags = FIELD_SETS[f].1;
        let read = [
            (fields::BYTE_LEN, want.byte_len),
            (fields::IMM, want.imm),
            (fields::QP_NUM, want.qp_num),
            (fields::SRC_QP, want.src_qp),
        ];
        for (flag, v) in read {
            if has(flags, flag) && v == 0 {
                return Err(format!(
                    "fields {}: field {:?} read as 0 in every completion",
                    FIELD_SETS[f].0,
                    WcExFlags::from_bits_retain(flag)
                )
                .into());
            }
        }
        for (api, s) in sums[ci].iter().enumerate() {
            let ts_read = has(flags, fields::COMPLETION_TIMESTAMP);
            let wall_read = has(flags, fields::COMPLETION_TIMESTAMP_WALLCLOCK);
            if (ts_read && s.ts == 0) || (wall_read && s.wall == 0) {
                return Err(format!(
                    "fields {}: {} read no timestamps",
                    FIELD_SETS[f].0, APIS[api].0
                )
                .into());
            }
        }
    }

    let polled = fills * PER_FILL as u64;
    let mut rows = Vec::new();
    for (ci, &(f, batch)) in cases.iter().enumerate() {
        let classic = median(&mut samples[ci][0].clone());
        for (api, &(name, target)) in APIS.iter().enumerate() {
            let ns = median(&mut samples[ci][api]);
            let ratio = ns / classic.max(1e-9);
            rows.push(Row {
                fields: FIELD_SETS[f].0,
                wc_flags: FIELD_SETS[f].1,
                batch,
                api: name,
                completions: polled,
                ns_per_completion: ns,
                mean_ns_per_completion: total_ns[ci][api] / polled as f64,
                ratio,
                target,
                meets_target: target.map(|t| ratio <= t),
            });
        }
    }
    let report = Report {
        device: device.name().into(),
        quick: args.quick,
        cpus: crate::report::cpus(),
        cpu_model: crate::report::cpu_model(),
        per_fill: PER_FILL,
        fills,
        statistic: "median over fills of drain time / completions per fill",
        checksums_agree: true,
        targets_met: rows.iter().all(|r| r.meets_target != Some(false)),
        rows,
    };
    print_report(&report, args.json, Report::text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_reads_the_same_completions() {
        let dev = crate::find_device(None).unwrap();
        for &(_, flags) in &FIELD_SETS {
            let mut b = Bench::new(&dev, flags).unwrap();
            for batch in BATCHES {
                let got: Vec<Sums> = (0..APIS.len())
                    .map(|api| b.round(api, batch).unwrap().1.deterministic())
                    .collect();
                assert!(got.iter().all(|s| *s == got[0]), "{flags:#x}: {got:?}");
                assert_eq!(got[0].count, PER_FILL as u64);
            }
        }
    }
}
