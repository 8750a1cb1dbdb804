//! Model-based test of the RC data path.
//!
//! A property test runs thousands of random work requests (SEND, SEND_WITH_IMM, RDMA WRITE,
//! RDMA WRITE_WITH_IMM, RDMA READ, ATOMIC CMP_AND_SWP / FETCH_AND_ADD) between two connected
//! RC QPs and checks every completion and every byte of every memory region against a plain
//! `Vec<u8>` model. Sizes (0 included), offsets, SGE splits (1..=4, over different regions),
//! inline payloads and receive layouts are random; a small fraction of the requests are
//! invalid, either rejected by `post_send` (no effect) or failing at run time (the failing
//! request's error completion, the QPs in ERR, every later request and every posted receive
//! flushed, memory untouched).
//!
//! A few deterministic tests pin down the behaviour the model relies on.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use softverbs::*;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Fixed layout
// ---------------------------------------------------------------------------------------------

/// Lengths of the memory regions of side A (0) and side B (1). All multiples of 8.
const MR_LENS: [[usize; 3]; 2] = [[4096, 2048, 1032], [4096, 1536, 520]];
const NMR: usize = 3;
/// Scatter lists (receives, READ and atomic destinations) put their i-th SGE in lane i of its
/// region, so their SGEs never overlap (placement into overlapping SGEs is not specified).
const LANES: usize = 4;
/// Longest SGE of a scatter list.
const MAX_SCATTER_PIECE: usize = 512;
/// Length of the extra regions used as invalid targets (other PD, no remote access).
const SPECIAL_LEN: usize = 4096;
const MAX_INLINE: usize = 64;
const MAX_SGE: usize = 4;
const MAX_OPS: usize = 40;
const RECV_WR_BASE: u64 = 0x5245_4356_0000_0000; // "RECV"
const SEND_WR_BASE: u64 = 0x5345_4e44_0000_0000; // "SEND"

fn full_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC
}

fn lane_len(side: usize, mr: usize) -> usize {
    MR_LENS[side][mr] / LANES
}

/// splitmix64: deterministic filler bytes.
fn prng_bytes(mut seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(len);
    out
}

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

/// One SGE: `len` bytes at `off` in region `mr` of the side that owns the list.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Piece {
    mr: usize,
    off: usize,
    len: usize,
    /// Use a key that names no region (a stale generation of the region's key).
    bad_key: bool,
}

impl std::fmt::Debug for Piece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "mr{}[{}..{}]", self.mr, self.off, self.off + self.len)?;
        if self.bad_key {
            f.write_str("(bad lkey)")?;
        }
        Ok(())
    }
}

#[derive(Clone, PartialEq, Eq)]
enum Local {
    Sges(Vec<Piece>),
    Inline(Vec<u8>),
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Local::Sges(p) => write!(f, "Sges{p:?}"),
            Local::Inline(b) => write!(f, "Inline({} bytes)", b.len()),
        }
    }
}

impl Local {
    fn len(&self) -> usize {
        match self {
            Local::Sges(p) => p.iter().map(|p| p.len).sum(),
            Local::Inline(b) => b.len(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    /// A region of the responder (full access, same PD).
    Mr(usize),
    /// A region in another protection domain.
    OtherPd,
    /// A region registered without remote access.
    NoAccess,
}

/// The remote side of an RDMA operation: `remote_addr = iova(target) + off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Remote {
    target: Target,
    off: i64,
    /// Use a key with a stale generation.
    stale_key: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Send {
        imm: Option<u32>,
    },
    Write {
        imm: Option<u32>,
    },
    Read,
    /// `compare: None` means "the target word's current value" (so the swap happens).
    CmpSwap {
        compare: Option<u64>,
        swap: u64,
    },
    FetchAdd {
        add: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Op {
    /// The issuing side (0 = A, 1 = B); the other side responds.
    side: usize,
    kind: Kind,
    local: Local,
    remote: Option<Remote>,
    /// The receive this op consumes on the responder (SEND, WRITE_WITH_IMM), pre-posted in
    /// op order at the start of the case.
    recv: Option<Vec<Piece>>,
    /// Posted in the same `post_send` call as the previous op (if that one is by the same side).
    join: bool,
}

impl Op {
    fn consumes_recv(&self) -> bool {
        matches!(self.kind, Kind::Send { .. } | Kind::Write { imm: Some(_) })
    }
    fn is_atomic(&self) -> bool {
        matches!(self.kind, Kind::CmpSwap { .. } | Kind::FetchAdd { .. })
    }
    fn writes_local(&self) -> bool {
        self.is_atomic() || self.kind == Kind::Read
    }
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Send { imm: None } => "SEND",
            Kind::Send { imm: Some(_) } => "SEND_WITH_IMM",
            Kind::Write { imm: None } => "RDMA_WRITE",
            Kind::Write { imm: Some(_) } => "RDMA_WRITE_WITH_IMM",
            Kind::Read => "RDMA_READ",
            Kind::CmpSwap { .. } => "ATOMIC_CMP_AND_SWP",
            Kind::FetchAdd { .. } => "ATOMIC_FETCH_AND_ADD",
        }
    }
    fn kind_index(&self) -> usize {
        match self.kind {
            Kind::Send { imm: None } => 0,
            Kind::Send { imm: Some(_) } => 1,
            Kind::Write { imm: None } => 2,
            Kind::Write { imm: Some(_) } => 3,
            Kind::Read => 4,
            Kind::CmpSwap { .. } => 5,
            Kind::FetchAdd { .. } => 6,
        }
    }

    /// What `post_send` must reject (the model of the post-time checks).
    fn rejected_at_post(&self) -> bool {
        match &self.local {
            Local::Sges(p) if p.len() > MAX_SGE => return true,
            Local::Inline(b) if self.writes_local() || b.len() > MAX_INLINE => return true,
            _ => {}
        }
        if self.is_atomic() {
            let r = self.remote.expect("atomics have a remote");
            // Every region starts page-aligned, so the address is aligned iff the offset is.
            return self.local.len() != 8 || r.off.rem_euclid(8) != 0;
        }
        false
    }
}

// ---------------------------------------------------------------------------------------------
// Generation: raw random numbers, turned into a concrete op by `build_op`
// ---------------------------------------------------------------------------------------------

/// (length, region, offset, size class) of one SGE.
type PieceRaw = (u16, u8, u16, u8);

#[derive(Clone, Debug)]
struct RawOp {
    side: u8,
    join: u8,
    kind: u8,
    fault: u8,
    k: u8,
    pieces: Vec<PieceRaw>,
    rk: u8,
    rpieces: Vec<PieceRaw>,
    size: (u8, u16),
    inline: u8,
    remote: (u8, u16),
    imm: u32,
    a: u64,
    b: u64,
}

fn raw_op() -> impl Strategy<Value = RawOp> {
    let piece = || (any::<u16>(), any::<u8>(), any::<u16>(), any::<u8>());
    (
        (0u8..4, 0u8..100, any::<u8>(), 0u8..4),
        (0u8..=4, vec(piece(), 4), 0u8..=4, vec(piece(), 4)),
        (
            (any::<u8>(), any::<u16>()),
            0u8..10,
            (any::<u8>(), any::<u16>()),
        ),
        (any::<u32>(), any::<u64>(), any::<u64>()),
    )
        .prop_map(
            |(
                (side, kind, fault, join),
                (k, pieces, rk, rpieces),
                (size, inline, remote),
                (imm, a, b),
            )| {
                RawOp {
                    side,
                    join,
                    kind,
                    fault,
                    k,
                    pieces,
                    rk,
                    rpieces,
                    size,
                    inline,
                    remote,
                    imm,
                    a,
                    b,
                }
            },
        )
}

/// Splits `total` into 1..=k positive lengths.
fn split(total: usize, k: u8, raws: &[PieceRaw]) -> Vec<usize> {
    if total == 0 {
        return Vec::new();
    }
    let k = usize::from(k).clamp(1, MAX_SGE).min(total);
    let mut cuts: Vec<usize> = raws[..k - 1]
        .iter()
        .map(|r| 1 + usize::from(r.0) % (total - 1))
        .collect();
    cuts.push(0);
    cuts.push(total);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|w| w[1] - w[0]).collect()
}

/// A gather list of exactly `total` bytes anywhere in `side`'s regions (SGEs may overlap).
fn gather(side: usize, total: usize, k: u8, raws: &[PieceRaw]) -> Vec<Piece> {
    split(total, k, raws)
        .into_iter()
        .zip(raws)
        .map(|(len, r)| {
            let fits: Vec<usize> = (0..NMR).filter(|&m| MR_LENS[side][m] >= len).collect();
            let mr = fits[usize::from(r.1) % fits.len()];
            let slots = MR_LENS[side][mr] - len + 1;
            let off = match r.3 % 8 {
                0 => 0,
                1 => slots - 1,
                _ => usize::from(r.2) % slots,
            };
            Piece {
                mr,
                off,
                len,
                bad_key: false,
            }
        })
        .collect()
}

/// Places piece `i` of a scatter list in lane `i` of its region.
fn in_lane(side: usize, i: usize, len: usize, r: &PieceRaw) -> Piece {
    let mr = usize::from(r.1) % NMR;
    let lane = lane_len(side, mr);
    let slots = lane - len + 1;
    let off = match r.3 % 8 {
        0 => 0,
        1 => slots - 1,
        _ => usize::from(r.2) % slots,
    };
    Piece {
        mr,
        off: i * lane + off,
        len,
        bad_key: false,
    }
}

/// A scatter list of k (0..=4) SGEs of random lengths.
fn scatter_free(side: usize, k: u8, raws: &[PieceRaw]) -> Vec<Piece> {
    (0..usize::from(k).min(MAX_SGE))
        .map(|i| {
            let r = &raws[i];
            let lane = lane_len(side, usize::from(r.1) % NMR);
            let max = [8, 64, MAX_SCATTER_PIECE, lane][usize::from(r.3 >> 3) % 4]
                .min(lane)
                .min(MAX_SCATTER_PIECE);
            in_lane(side, i, 1 + usize::from(r.0) % max, r)
        })
        .collect()
}

/// A scatter list of exactly `total` bytes (small totals: the atomics' 8 bytes).
fn scatter_exact(side: usize, total: usize, k: u8, raws: &[PieceRaw]) -> Vec<Piece> {
    split(total, k, raws)
        .into_iter()
        .enumerate()
        .map(|(i, len)| in_lane(side, i, len, &raws[i]))
        .collect()
}

/// A message length in 0..=cap, biased towards small sizes and `cap` itself.
fn sized((class, v): (u8, u16), cap: usize) -> usize {
    let v = usize::from(v);
    match class % 8 {
        0 => 0,
        1 => v % (8.min(cap) + 1),
        2 => v % (64.min(cap) + 1),
        3 => v % (512.min(cap) + 1),
        4 | 5 => v % (cap + 1),
        6 => cap,
        _ => cap.saturating_sub(v % 8),
    }
}

/// A valid placement of `len` bytes (aligned to `align`) in one of `side`'s regions.
fn place(side: usize, len: usize, align: usize, (m, v): (u8, u16)) -> Remote {
    let fits: Vec<usize> = (0..NMR).filter(|&i| MR_LENS[side][i] >= len).collect();
    let mr = fits[usize::from(m) % fits.len()];
    Remote {
        target: Target::Mr(mr),
        off: place_off(MR_LENS[side][mr], len, align, (m, v)),
        stale_key: false,
    }
}

fn place_off(mr_len: usize, len: usize, align: usize, (m, v): (u8, u16)) -> i64 {
    let slots = (mr_len - len) / align + 1;
    let slot = match (m >> 4) % 4 {
        0 => 0,
        1 => slots - 1,
        _ => usize::from(v) % slots,
    };
    (slot * align) as i64
}

/// Payload of `len` bytes: inline (if allowed and chosen) or a gather list.
fn payload(side: usize, len: usize, r: &RawOp, allow_inline: bool) -> Local {
    if allow_inline && len <= MAX_INLINE && r.inline < 3 {
        Local::Inline(prng_bytes(r.a, len))
    } else {
        Local::Sges(gather(side, len, r.k, &r.pieces))
    }
}

/// Makes the remote of a RDMA op invalid (`which` in 0..6).
fn break_remote(rem: &mut Remote, peer: usize, len: usize, align: usize, which: u8, v: u16) {
    let v = i64::from(v);
    let align_i = align as i64;
    match which {
        // Past the end: straddling it or entirely beyond.
        0 | 1 => {
            let Target::Mr(m) = rem.target else {
                unreachable!()
            };
            let end = (MR_LENS[peer][m] - len) as i64;
            rem.off = end + align_i * (1 + v % 8);
            if align == 1 {
                rem.off = end + 1 + v % 16;
            }
        }
        // Before the start.
        2 => rem.off = -(align_i * (1 + v % 8)),
        3 => rem.stale_key = true,
        4 | 5 => {
            rem.target = if which == 4 {
                Target::OtherPd
            } else {
                Target::NoAccess
            };
            rem.off = place_off(SPECIAL_LEN, len, align, (v as u8, v as u16));
        }
        _ => unreachable!(),
    }
}

fn build_op(r: RawOp) -> Op {
    let side = usize::from(r.side == 3);
    let peer = 1 - side;
    // fault: 0..240 valid; 240..248 rejected by post_send; 248..=255 fail at run time.
    let reject = r.fault.checked_sub(240).filter(|s| *s < 8);
    let runtime = r.fault.checked_sub(248);
    let imm = r.imm;
    let kind = match r.kind {
        0..20 => Kind::Send { imm: None },
        20..30 => Kind::Send { imm: Some(imm) },
        30..50 => Kind::Write { imm: None },
        50..60 => Kind::Write { imm: Some(imm) },
        60..80 => Kind::Read,
        80..90 => Kind::CmpSwap {
            // Random memory never matches a random compare: half of the compares use the
            // word's current value (resolved from the model when the op runs).
            compare: (r.a & 1 == 1).then_some(r.a),
            swap: r.b,
        },
        _ => Kind::FetchAdd { add: r.a },
    };
    let mut op = Op {
        side,
        kind,
        local: Local::Sges(Vec::new()),
        remote: None,
        recv: None,
        join: r.join == 0,
    };
    match kind {
        Kind::Send { .. } => {
            let mut recv = scatter_free(peer, r.rk, &r.rpieces);
            let mut len = sized(r.size, recv.iter().map(|p| p.len).sum());
            let mut allow_inline = true;
            match runtime {
                // Longer than the receive.
                Some(0..=2) => {
                    len = recv.iter().map(|p| p.len).sum::<usize>() + 1 + usize::from(r.size.1 % 64)
                }
                // The receive's first SGE has a bad key.
                Some(3..=5) => {
                    if recv.is_empty() {
                        recv = scatter_free(peer, 1, &r.rpieces);
                    }
                    recv[0].bad_key = true;
                    len = len.max(1);
                }
                // The local first SGE has a bad key.
                Some(_) => {
                    len = len.max(1);
                    allow_inline = false;
                }
                None => {}
            }
            op.local = payload(side, len, &r, allow_inline);
            if runtime.is_some_and(|f| f >= 6) {
                let Local::Sges(p) = &mut op.local else {
                    unreachable!()
                };
                p[0].bad_key = true;
            }
            op.recv = Some(recv);
        }
        Kind::Write { .. } | Kind::Read => {
            let is_read = kind == Kind::Read;
            let mut len;
            if is_read {
                let mut p = scatter_free(side, r.k, &r.pieces);
                if runtime.is_some() && p.is_empty() {
                    p = scatter_free(side, 1, &r.pieces);
                }
                len = p.iter().map(|p| p.len).sum();
                op.local = Local::Sges(p);
            } else {
                len = sized(r.size, MR_LENS[peer][0]);
                if runtime.is_some() {
                    len = len.max(1);
                }
                op.local = payload(side, len, &r, runtime.is_none_or(|f| f < 6));
                if let Kind::Write { imm: Some(_) } = kind {
                    op.recv = Some(scatter_free(peer, r.rk, &r.rpieces));
                }
            }
            let mut rem = place(peer, len, 1, r.remote);
            match runtime {
                Some(f @ 0..=5) => break_remote(&mut rem, peer, len, 1, f, r.remote.1),
                Some(_) => {
                    let Local::Sges(p) = &mut op.local else {
                        unreachable!()
                    };
                    p[0].bad_key = true;
                }
                None => {}
            }
            op.remote = Some(rem);
        }
        Kind::CmpSwap { .. } | Kind::FetchAdd { .. } => {
            op.local = Local::Sges(scatter_exact(side, 8, r.k, &r.pieces));
            let mut rem = place(peer, 8, 8, r.remote);
            match runtime {
                Some(f @ 0..=5) => break_remote(&mut rem, peer, 8, 8, f, r.remote.1),
                Some(_) => {
                    let Local::Sges(p) = &mut op.local else {
                        unreachable!()
                    };
                    p[0].bad_key = true;
                }
                None => {}
            }
            op.remote = Some(rem);
        }
    }
    // Requests post_send must refuse.
    if let Some(f) = reject {
        let len = op.local.len();
        match kind {
            Kind::Send { .. } | Kind::Write { .. } => {
                if f < 4 {
                    op.local = Local::Inline(prng_bytes(r.a, MAX_INLINE + 1 + usize::from(f) * 17));
                } else {
                    op.local = Local::Sges(gather(side, len.max(MAX_SGE + 1), 4, &r.pieces));
                    let Local::Sges(p) = &mut op.local else {
                        unreachable!()
                    };
                    while p.len() <= MAX_SGE {
                        p.push(p[0]);
                    }
                }
            }
            Kind::Read => {
                if f < 4 {
                    op.local = Local::Inline(prng_bytes(r.a, len.min(MAX_INLINE)));
                } else {
                    let Local::Sges(p) = &mut op.local else {
                        unreachable!()
                    };
                    if p.is_empty() {
                        *p = scatter_free(side, 1, &r.pieces);
                    }
                    while p.len() <= MAX_SGE {
                        p.push(p[0]);
                    }
                }
            }
            Kind::CmpSwap { .. } | Kind::FetchAdd { .. } => match f {
                0..=2 => {
                    let rem = op.remote.as_mut().unwrap();
                    rem.off += [4, 1, 7][usize::from(f)];
                }
                3 | 4 => op.local = Local::Sges(scatter_exact(side, 4, r.k, &r.pieces)),
                5 | 6 => op.local = Local::Sges(scatter_exact(side, 12, r.k, &r.pieces)),
                _ => op.local = Local::Inline(prng_bytes(r.a, 8)),
            },
        }
        debug_assert!(op.rejected_at_post(), "{op:?}");
    }
    op
}

#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    ops: Vec<Op>,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (any::<u64>(), vec(raw_op().prop_map(build_op), 1..=MAX_OPS))
        .prop_map(|(seed, ops)| Case { seed, ops })
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

/// One expected completion.
#[derive(Clone, Debug, PartialEq)]
struct Exp {
    wr_id: u64,
    status: WcStatus,
    qp_num: u32,
    /// Checked for successful completions only (verbs defines only wr_id, status and qp_num
    /// for failed ones).
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
    src_qp: Option<u32>,
}

impl Exp {
    fn err(wr_id: u64, status: WcStatus, qp_num: u32) -> Exp {
        Exp {
            wr_id,
            status,
            qp_num,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm: None,
            src_qp: None,
        }
    }
}

/// CQ indices: send CQ of side s is `s`, receive CQ of side s is `2 + s`.
const CQ_NAMES: [&str; 4] = ["A.send_cq", "B.send_cq", "A.recv_cq", "B.recv_cq"];

#[derive(Default, Debug)]
struct Expect {
    post_ok: bool,
    cqs: [Vec<Exp>; 4],
    /// Affiliated async events (the responder of an RDMA access violation gets
    /// `QP_ACCESS_ERR`; errors reported by a receive completion raise none).
    events: Vec<AsyncEvent>,
    /// For the log: what the model decided.
    outcome: String,
}

struct Model {
    mem: [Vec<Vec<u8>>; 2],
    recvq: [VecDeque<(u64, Vec<Piece>)>; 2],
    err: [bool; 2],
    qpn: [u32; 2],
}

fn send_wr_id(i: usize) -> u64 {
    SEND_WR_BASE | i as u64
}
fn recv_wr_id(i: usize) -> u64 {
    RECV_WR_BASE | i as u64
}

impl Model {
    fn gather(&self, side: usize, pieces: &[Piece]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in pieces {
            out.extend_from_slice(&self.mem[side][p.mr][p.off..p.off + p.len]);
        }
        out
    }

    /// Scatters `data` over `pieces` in order (the lists are long enough by construction).
    fn scatter(&mut self, side: usize, pieces: &[Piece], mut data: &[u8]) {
        for p in pieces {
            let n = p.len.min(data.len());
            self.mem[side][p.mr][p.off..p.off + n].copy_from_slice(&data[..n]);
            data = &data[n..];
        }
        assert!(data.is_empty(), "model: scatter list too short");
    }

    fn payload(&self, side: usize, local: &Local) -> Vec<u8> {
        match local {
            Local::Sges(p) => self.gather(side, p),
            Local::Inline(b) => b.clone(),
        }
    }

    /// The byte range a valid remote names in the responder's region, if any.
    fn remote_range(&self, peer: usize, r: &Remote, len: usize) -> Option<(usize, usize)> {
        let Target::Mr(m) = r.target else {
            return None;
        };
        if r.stale_key || r.off < 0 {
            return None;
        }
        let off = r.off as usize;
        (off + len <= MR_LENS[peer][m]).then_some((m, off))
    }

    /// Fills in a CMP_AND_SWP's "current value" compare.
    fn resolve(&self, op: &Op) -> Op {
        let mut op = op.clone();
        if let Kind::CmpSwap {
            compare: c @ None, ..
        } = &mut op.kind
        {
            let r = op.remote.unwrap();
            *c = Some(match self.remote_range(1 - op.side, &r, 8) {
                Some((m, off)) => {
                    u64::from_ne_bytes(self.mem[1 - op.side][m][off..off + 8].try_into().unwrap())
                }
                None => 0,
            });
        }
        op
    }

    /// Moves `side` to ERR: its posted receives are flushed, oldest first.
    fn go_err(&mut self, side: usize, e: &mut Expect) {
        if self.err[side] {
            return;
        }
        self.err[side] = true;
        while let Some((wr_id, _)) = self.recvq[side].pop_front() {
            e.cqs[2 + side].push(Exp::err(wr_id, WcStatus::WrFlushErr, self.qpn[side]));
        }
    }

    /// Applies op `i` and says what the NIC must report.
    fn step(&mut self, i: usize, op: &Op) -> Expect {
        let (s, p) = (op.side, 1 - op.side);
        let mut e = Expect::default();
        if op.rejected_at_post() {
            e.outcome = "rejected by post_send".into();
            return e;
        }
        e.post_ok = true;
        let wr_id = send_wr_id(i);
        let (qs, qp) = (self.qpn[s], self.qpn[p]);
        if self.err[s] {
            e.cqs[s].push(Exp::err(wr_id, WcStatus::WrFlushErr, qs));
            e.outcome = "flushed".into();
            return e;
        }
        assert!(
            !self.err[p],
            "model: a live QP issuing to a dead one (test bug)"
        );
        let ok = |opcode, byte_len: usize| Exp {
            wr_id,
            status: WcStatus::Success,
            qp_num: qs,
            opcode,
            byte_len: byte_len as u32,
            imm: None,
            src_qp: None,
        };
        // 1. The requester's own SGEs.
        if let Local::Sges(pieces) = &op.local {
            if pieces.iter().any(|p| p.bad_key && p.len > 0) {
                e.cqs[s].push(Exp::err(wr_id, WcStatus::LocProtErr, qs));
                self.go_err(s, &mut e);
                e.outcome = "LOC_PROT_ERR (requester ERR)".into();
                return e;
            }
        }
        let len = op.local.len();
        let remote_fail = |m: &mut Model, e: &mut Expect, status: WcStatus| {
            e.cqs[s].push(Exp::err(wr_id, status, qs));
            if status == WcStatus::RemAccessErr {
                e.events.push(AsyncEvent {
                    kind: AsyncEventType::QpAccessErr,
                    element: EventElement::Qp(qp),
                });
            }
            m.go_err(s, e);
            m.go_err(p, e);
            e.outcome = format!("{status:?} (both QPs ERR)");
        };
        match op.kind {
            Kind::Send { imm } => {
                let data = self.payload(s, &op.local);
                let (rid, rpieces) = self.recvq[p]
                    .pop_front()
                    .expect("model: a receive is pre-posted for every SEND");
                let cap: usize = rpieces.iter().map(|p| p.len).sum();
                if rpieces.iter().any(|p| p.bad_key) {
                    e.cqs[2 + p].push(Exp::err(rid, WcStatus::LocProtErr, qp));
                    remote_fail(self, &mut e, WcStatus::RemOpErr);
                } else if cap < len {
                    e.cqs[2 + p].push(Exp::err(rid, WcStatus::LocLenErr, qp));
                    remote_fail(self, &mut e, WcStatus::RemInvReqErr);
                } else {
                    self.scatter(p, &rpieces, &data);
                    e.cqs[2 + p].push(Exp {
                        wr_id: rid,
                        status: WcStatus::Success,
                        qp_num: qp,
                        opcode: WcOpcode::Recv,
                        byte_len: len as u32,
                        imm,
                        src_qp: Some(qs),
                    });
                    e.cqs[s].push(ok(WcOpcode::Send, len));
                    e.outcome = "ok".into();
                }
            }
            Kind::Write { imm } => {
                let r = op.remote.unwrap();
                let range = self.remote_range(p, &r, len);
                if len > 0 && range.is_none() {
                    remote_fail(self, &mut e, WcStatus::RemAccessErr);
                    return e;
                }
                let data = self.payload(s, &op.local);
                if let Some((m, off)) = range {
                    self.mem[p][m][off..off + len].copy_from_slice(&data);
                }
                if let Some(imm) = imm {
                    let (rid, _) = self.recvq[p]
                        .pop_front()
                        .expect("model: a receive is pre-posted for every WRITE_WITH_IMM");
                    e.cqs[2 + p].push(Exp {
                        wr_id: rid,
                        status: WcStatus::Success,
                        qp_num: qp,
                        opcode: WcOpcode::RecvRdmaWithImm,
                        byte_len: len as u32,
                        imm: Some(imm),
                        src_qp: Some(qs),
                    });
                }
                e.cqs[s].push(ok(WcOpcode::RdmaWrite, len));
                e.outcome = "ok".into();
            }
            Kind::Read => {
                let r = op.remote.unwrap();
                let range = self.remote_range(p, &r, len);
                if len > 0 && range.is_none() {
                    remote_fail(self, &mut e, WcStatus::RemAccessErr);
                    return e;
                }
                if let Some((m, off)) = range {
                    let data = self.mem[p][m][off..off + len].to_vec();
                    let Local::Sges(pieces) = &op.local else {
                        unreachable!()
                    };
                    self.scatter(s, pieces, &data);
                }
                e.cqs[s].push(ok(WcOpcode::RdmaRead, len));
                e.outcome = "ok".into();
            }
            Kind::CmpSwap { .. } | Kind::FetchAdd { .. } => {
                let r = op.remote.unwrap();
                let Some((m, off)) = self.remote_range(p, &r, 8) else {
                    remote_fail(self, &mut e, WcStatus::RemAccessErr);
                    return e;
                };
                let word = &mut self.mem[p][m][off..off + 8];
                let orig = u64::from_ne_bytes(word.try_into().unwrap());
                let (new, opcode) = match op.kind {
                    Kind::CmpSwap { compare, swap } => {
                        let compare = compare.expect("resolved before the model runs");
                        (
                            if orig == compare { swap } else { orig },
                            WcOpcode::CompSwap,
                        )
                    }
                    Kind::FetchAdd { add } => (orig.wrapping_add(add), WcOpcode::FetchAdd),
                    _ => unreachable!(),
                };
                word.copy_from_slice(&new.to_ne_bytes());
                let Local::Sges(pieces) = &op.local else {
                    unreachable!()
                };
                self.scatter(s, pieces, &orig.to_ne_bytes());
                e.cqs[s].push(ok(opcode, 8));
                e.outcome = format!("ok (original {orig:#x}, new {new:#x})");
            }
        }
        e
    }
}

// ---------------------------------------------------------------------------------------------
// The real thing
// ---------------------------------------------------------------------------------------------

struct Fixture {
    ctx: Context,
    pd: ProtectionDomain,
    mrs: [Vec<MemoryRegion<'static>>; 2],
    other_pd: MemoryRegion<'static>,
    no_access: MemoryRegion<'static>,
    _pd2: ProtectionDomain,
}

impl Fixture {
    fn new() -> Fixture {
        let ctx = softverbs::devices().unwrap()[0].open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let pd2 = ctx.alloc_pd().unwrap();
        let mrs = MR_LENS.map(|lens| {
            lens.iter()
                .map(|&l| pd.alloc_mr(l, full_access()).unwrap())
                .collect()
        });
        let other_pd = pd2.alloc_mr(SPECIAL_LEN, full_access()).unwrap();
        let no_access = pd.alloc_mr(SPECIAL_LEN, AccessFlags::LOCAL_WRITE).unwrap();
        Fixture {
            ctx,
            pd,
            mrs,
            other_pd,
            no_access,
            _pd2: pd2,
        }
    }

    fn sges(&self, side: usize, pieces: &[Piece]) -> Vec<Sge> {
        pieces
            .iter()
            .map(|p| {
                let mut s = self.mrs[side][p.mr].sge(p.off..p.off + p.len);
                if p.bad_key {
                    s.lkey ^= 0x80; // same slot, another generation: names no region
                }
                s
            })
            .collect()
    }

    fn remote(&self, peer: usize, r: &Remote) -> (u64, u32) {
        let mr = match r.target {
            Target::Mr(m) => &self.mrs[peer][m],
            Target::OtherPd => &self.other_pd,
            Target::NoAccess => &self.no_access,
        };
        let rkey = if r.stale_key {
            mr.rkey() ^ 0x80
        } else {
            mr.rkey()
        };
        (mr.iova().wrapping_add_signed(r.off), rkey)
    }
}

/// Two RC QPs connected to each other, each with its own send and receive CQ.
struct Pair {
    qps: [QueuePair; 2],
    /// send A, send B, recv A, recv B.
    cqs: [CompletionQueue; 4],
}

fn connect_pair(ctx: &Context, pd: &ProtectionDomain) -> Pair {
    let cqs: [CompletionQueue; 4] = std::array::from_fn(|_| ctx.create_cq(256, None).unwrap());
    let qps = [0, 1].map(|s| pd.create_qp(&QpInitAttr::rc(&cqs[s], &cqs[2 + s])).unwrap());
    let access = full_access();
    qps[0]
        .connect(&qps[1].endpoint(0).unwrap(), 0, access)
        .unwrap();
    qps[1]
        .connect(&qps[0].endpoint(0).unwrap(), 0, access)
        .unwrap();
    Pair { qps, cqs }
}

/// Polls until `n` completions arrived (or five seconds passed), then once more for extras.
fn collect(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::default(); 16];
    while out.len() < n && Instant::now() < deadline {
        let k = cq.poll(&mut buf);
        out.extend_from_slice(&buf[..k]);
        if k == 0 {
            std::thread::yield_now();
        }
    }
    let k = cq.poll(&mut buf);
    out.extend_from_slice(&buf[..k]);
    out
}

fn check_wc(wc: &WorkCompletion, e: &Exp) -> Result<(), String> {
    let mut bad = Vec::new();
    if wc.wr_id() != e.wr_id {
        bad.push(format!("wr_id {:#x} != {:#x}", wc.wr_id(), e.wr_id));
    }
    if wc.status() != e.status {
        bad.push(format!("status {:?} != {:?}", wc.status(), e.status));
    }
    if wc.qp_num() != e.qp_num {
        bad.push(format!("qp_num {} != {}", wc.qp_num(), e.qp_num));
    }
    if e.status == WcStatus::Success {
        if wc.opcode() != e.opcode {
            bad.push(format!("opcode {:?} != {:?}", wc.opcode(), e.opcode));
        }
        if wc.byte_len() != e.byte_len {
            bad.push(format!("byte_len {} != {}", wc.byte_len(), e.byte_len));
        }
        if wc.imm_data() != e.imm {
            bad.push(format!("imm_data {:?} != {:?}", wc.imm_data(), e.imm));
        }
        let flags = if e.imm.is_some() {
            WcFlags::WITH_IMM
        } else {
            WcFlags::empty()
        };
        if wc.wc_flags() != flags {
            bad.push(format!("wc_flags {:?} != {flags:?}", wc.wc_flags()));
        }
        if let Some(src) = e.src_qp {
            if wc.src_qp() != src {
                bad.push(format!("src_qp {} != {}", wc.src_qp(), src));
            }
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join(", "))
    }
}

/// The work request of op `i` (its SGEs already built), aimed at side `peer`.
fn make_wr<'a>(fx: &Fixture, i: usize, op: &'a Op, sges: &'a [Sge], peer: usize) -> SendWr<'a> {
    let (remote_addr, rkey) = op.remote.map_or((0, 0), |r| fx.remote(peer, &r));
    let sop = match op.kind {
        Kind::Send { imm: None } => SendOp::Send,
        Kind::Send { imm: Some(imm) } => SendOp::SendWithImm { imm },
        Kind::Write { imm: None } => SendOp::RdmaWrite { remote_addr, rkey },
        Kind::Write { imm: Some(imm) } => SendOp::RdmaWriteWithImm {
            remote_addr,
            rkey,
            imm,
        },
        Kind::Read => SendOp::RdmaRead { remote_addr, rkey },
        Kind::CmpSwap { compare, swap } => SendOp::CmpSwap {
            remote_addr,
            rkey,
            compare: compare.expect("resolved from the model"),
            swap,
        },
        Kind::FetchAdd { add } => SendOp::FetchAdd {
            remote_addr,
            rkey,
            add,
        },
    };
    match &op.local {
        Local::Sges(_) => SendWr::new(send_wr_id(i), sop, sges),
        Local::Inline(b) => SendWr::inline(send_wr_id(i), sop, b),
    }
    .flags(SendFlags::SIGNALED)
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[derive(Default)]
struct Stats {
    cases: usize,
    ops: usize,
    batches: usize,
    unposted: usize,
    succeeded: usize,
    per_kind: [usize; 7],
    rejected: usize,
    failed: usize,
    flushed: usize,
    skipped: usize,
    bytes: usize,
    inline: usize,
    multi_sge: usize,
}

fn run_case(fx: &Fixture, case: &Case, stats: &RefCell<Stats>) -> Result<(), TestCaseError> {
    let mut log = String::new();
    let fail = |log: &str, msg: String| TestCaseError::fail(format!("{msg}\n--- log ---\n{log}"));

    // Fresh random memory, mirrored by the model.
    let mem: [Vec<Vec<u8>>; 2] = std::array::from_fn(|side| {
        fx.mrs[side]
            .iter()
            .enumerate()
            .map(|(m, mr)| {
                let bytes = prng_bytes(case.seed ^ ((side * NMR + m) as u64) << 56, mr.len());
                mr.write_at(0, &bytes).unwrap();
                bytes
            })
            .collect()
    });
    let special = prng_bytes(!case.seed, SPECIAL_LEN);
    fx.other_pd.write_at(0, &special).unwrap();
    fx.no_access.write_at(0, &special).unwrap();

    let pair = connect_pair(&fx.ctx, &fx.pd);
    let cap = pair.qps[0].cap();
    assert!(cap.max_inline_data as usize >= MAX_INLINE && cap.max_send_sge as usize == MAX_SGE);
    let mut model = Model {
        mem,
        recvq: Default::default(),
        err: [false; 2],
        qpn: [pair.qps[0].qp_num(), pair.qps[1].qp_num()],
    };

    // Pre-post, in op order, the receive each SEND / WRITE_WITH_IMM will consume.
    for (i, op) in case.ops.iter().enumerate() {
        if op.consumes_recv() && !op.rejected_at_post() {
            let peer = 1 - op.side;
            let pieces = op.recv.clone().unwrap();
            let sges = fx.sges(peer, &pieces);
            pair.qps[peer]
                .post_recv([RecvWr::new(recv_wr_id(i), &sges)])
                .map_err(|e| fail(&log, format!("post_recv for op {i}: {e}")))?;
            model.recvq[peer].push_back((recv_wr_id(i), pieces));
        }
    }

    let mut st = stats.borrow_mut();
    st.cases += 1;
    let mut next = 0;
    while next < case.ops.len() {
        // A batch: consecutive ops of one side posted with one post_send call.
        let s = case.ops[next].side;
        let p = 1 - s;
        let first = next;
        next += 1;
        while next < case.ops.len() && case.ops[next].join && case.ops[next].side == s {
            next += 1;
        }
        let batch = first..next;
        let side_name = "AB".as_bytes()[s] as char;
        // After a failure only the QPs in ERR keep posting (a live QP talking to a dead one
        // would wait out its retry timers).
        if (model.err[0] || model.err[1]) && !model.err[s] {
            st.skipped += batch.len();
            let _ = writeln!(log, "ops {batch:?} by {side_name}: skipped");
            continue;
        }
        st.batches += 1;
        let _ = writeln!(log, "post_send by {side_name} of ops {batch:?}:");
        // Step the model through the batch; post_send stops at the first request it rejects.
        let mut ops = Vec::new();
        let mut want: [Vec<Exp>; 4] = Default::default();
        let mut want_events = Vec::new();
        let mut reject_at = None;
        for i in batch.clone() {
            let op = model.resolve(&case.ops[i]);
            let was_err = model.err[s];
            let exp = model.step(i, &op);
            let _ = writeln!(
                log,
                "  op {i}: {} len {} local {:?} remote {:?} recv {:?} -> {}",
                op.name(),
                op.local.len(),
                op.local,
                op.remote,
                op.recv,
                exp.outcome
            );
            st.ops += 1;
            if !exp.post_ok {
                st.rejected += 1;
            } else if was_err {
                st.flushed += 1;
            } else if exp.outcome.starts_with("ok") {
                st.succeeded += 1;
                st.per_kind[op.kind_index()] += 1;
                st.bytes += op.local.len();
                st.inline += usize::from(matches!(op.local, Local::Inline(_)));
                st.multi_sge += usize::from(matches!(&op.local, Local::Sges(p) if p.len() > 1));
            } else {
                st.failed += 1;
            }
            for (w, e) in want.iter_mut().zip(exp.cqs) {
                w.extend(e);
            }
            want_events.extend(exp.events);
            ops.push((i, op));
            if !exp.post_ok {
                reject_at = Some(ops.len() - 1);
                break;
            }
        }
        let unposted = batch.end - first - ops.len();
        if unposted > 0 {
            st.unposted += unposted;
            let _ = writeln!(
                log,
                "  ops {}..{}: not posted",
                first + ops.len(),
                batch.end
            );
        }

        let sges: Vec<Vec<Sge>> = ops
            .iter()
            .map(|(_, op)| match &op.local {
                Local::Sges(pieces) => fx.sges(s, pieces),
                Local::Inline(_) => Vec::new(),
            })
            .collect();
        let wrs: Vec<SendWr<'_>> = ops
            .iter()
            .zip(&sges)
            .map(|((i, op), sges)| make_wr(fx, *i, op, sges, p))
            .collect();
        let posted = pair.qps[s].post_send(wrs);
        match (&posted, reject_at) {
            (Ok(()), None) => {}
            (Err(e), Some(k)) if e.index == k && matches!(e.error, Error::InvalidArgument(_)) => {}
            _ => {
                return Err(fail(
                    &log,
                    format!(
                        "ops {batch:?}: post_send returned {posted:?}, expected {}",
                        match reject_at {
                            None => "Ok".to_string(),
                            Some(k) => format!("EINVAL for WR {k}"),
                        }
                    ),
                ));
            }
        }
        let at = format!("after ops {first}..{}", first + ops.len());

        for (c, want) in want.iter().enumerate() {
            let got = collect(&pair.cqs[c], want.len());
            if got.len() != want.len() {
                return Err(fail(
                    &log,
                    format!(
                        "{at}: {} has {} completions, expected {}:\n got {got:#?}\n want {want:#?}",
                        CQ_NAMES[c],
                        got.len(),
                        want.len()
                    ),
                ));
            }
            for (g, w) in got.iter().zip(want) {
                check_wc(g, w).map_err(|m| {
                    fail(
                        &log,
                        format!("{at}: {}: {m}\n got {g:?}\n want {w:?}", CQ_NAMES[c]),
                    )
                })?;
            }
        }

        let mut events = Vec::new();
        while let Ok(ev) = fx.ctx.try_get_async_event() {
            events.push(ev);
        }
        if events != want_events {
            return Err(fail(
                &log,
                format!("{at}: async events {events:?}, expected {want_events:?}"),
            ));
        }

        // Scattered receive bytes, READ/atomic results and everything else: all of memory.
        for side in 0..2 {
            for (m, mr) in fx.mrs[side].iter().enumerate() {
                let real = mr.to_vec();
                if let Some(d) = first_diff(&real, &model.mem[side][m]) {
                    let end = (d + 16).min(real.len());
                    return Err(fail(
                        &log,
                        format!(
                            "{at}: side {} mr{m} differs from the model at byte {d}: \
                             real {:02x?} model {:02x?}",
                            "AB".as_bytes()[side] as char,
                            &real[d..end],
                            &model.mem[side][m][d..end]
                        ),
                    ));
                }
            }
        }
        for side in 0..2 {
            let want = if model.err[side] {
                QpState::Err
            } else {
                QpState::Rts
            };
            let got = pair.qps[side].state();
            if got != want {
                return Err(fail(
                    &log,
                    format!(
                        "{at}: QP {} is {got:?}, expected {want:?}",
                        "AB".as_bytes()[side] as char
                    ),
                ));
            }
        }
    }
    drop(st);

    // Nothing left over anywhere, and the invalid targets were never written.
    for (c, cq) in pair.cqs.iter().enumerate() {
        let extra = collect(cq, 0);
        if !extra.is_empty() {
            return Err(fail(
                &log,
                format!("{} has unexpected completions: {extra:#?}", CQ_NAMES[c]),
            ));
        }
    }
    for (name, mr) in [
        ("other-PD region", &fx.other_pd),
        ("no-access region", &fx.no_access),
    ] {
        if mr.to_vec() != special {
            return Err(fail(&log, format!("the {name} was modified")));
        }
    }
    Ok(())
}

#[test]
fn random_op_sequences_match_the_memory_model() {
    let fx = Fixture::new();
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    });
    let stats = RefCell::new(Stats::default());
    let started = Instant::now();
    let result = runner.run(&case_strategy(), |case| run_case(&fx, &case, &stats));
    let st = stats.into_inner();
    eprintln!(
        "model test: {} cases ({} incl. shrinking), {} WRs in {} post_send calls ({} more not \
         posted after a rejected one) in {:.1?}: {} succeeded \
         (SEND {}, SEND_IMM {}, WRITE {}, WRITE_IMM {}, READ {}, CAS {}, FAA {}; {} bytes, {} \
         inline, {} multi-SGE), {} failed as the model said, {} flushed, {} rejected at post, {} \
         skipped",
        cases,
        st.cases,
        st.ops,
        st.batches,
        st.unposted,
        started.elapsed(),
        st.succeeded,
        st.per_kind[0],
        st.per_kind[1],
        st.per_kind[2],
        st.per_kind[3],
        st.per_kind[4],
        st.per_kind[5],
        st.per_kind[6],
        st.bytes,
        st.inline,
        st.multi_sge,
        st.failed,
        st.flushed,
        st.rejected,
        st.skipped
    );
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, case)) => {
            panic!("{reason}\nminimal failing case: {case:#?}")
        }
        Err(TestError::Abort(reason)) => panic!("aborted: {reason}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic tests of what the model relies on
// ---------------------------------------------------------------------------------------------

/// A context with one PD, two connected QPs and their CQs.
fn setup() -> (Context, ProtectionDomain, Pair) {
    let ctx = softverbs::devices().unwrap()[0].open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let pair = connect_pair(&ctx, &pd);
    (ctx, pd, pair)
}

fn pattern(len: usize, base: u8) -> Vec<u8> {
    (0..len).map(|i| base.wrapping_add(i as u8)).collect()
}

#[test]
fn send_scatters_over_three_receive_sges() {
    let (_ctx, pd, pair) = setup();
    let src = pd.alloc_mr(256, full_access()).unwrap();
    let dst1 = pd.alloc_mr(256, full_access()).unwrap();
    let dst2 = pd.alloc_mr(256, full_access()).unwrap();
    src.write_at(0, &pattern(256, 1)).unwrap();
    dst1.fill(0xEE);
    dst2.fill(0xEE);
    // Receive: 30 bytes in dst1, 50 in dst2, 40 in dst1 again (120 bytes of room).
    let rsges = [dst1.sge(10..40), dst2.sge(100..150), dst1.sge(200..240)];
    pair.qps[1].post_recv([RecvWr::new(77, &rsges)]).unwrap();
    // Send 100 bytes gathered from two SGEs of the source.
    let ssges = [src.sge(0..60), src.sge(150..190)];
    pair.qps[0]
        .post_send([
            SendWr::new(5, SendOp::SendWithImm { imm: 0xabcd }, &ssges).flags(SendFlags::SIGNALED)
        ])
        .unwrap();
    let wc = pair.cqs[0].wait_one().unwrap();
    assert_eq!(
        (wc.wr_id(), wc.status(), wc.opcode()),
        (5, WcStatus::Success, WcOpcode::Send)
    );
    let wc = pair.cqs[3].wait_one().unwrap();
    assert_eq!(
        (wc.wr_id(), wc.status(), wc.opcode()),
        (77, WcStatus::Success, WcOpcode::Recv)
    );
    assert_eq!(wc.byte_len(), 100);
    assert_eq!(wc.imm_data(), Some(0xabcd));
    assert_eq!(wc.src_qp(), pair.qps[0].qp_num());

    let mut sent = pattern(256, 1)[0..60].to_vec();
    sent.extend_from_slice(&pattern(256, 1)[150..190]);
    let (d1, d2) = (dst1.to_vec(), dst2.to_vec());
    assert_eq!(&d1[10..40], &sent[0..30]);
    assert_eq!(&d2[100..150], &sent[30..80]);
    assert_eq!(&d1[200..220], &sent[80..100]);
    // Everything else, including the unused tail of the third SGE, is untouched.
    assert!(
        d1[..10]
            .iter()
            .chain(&d1[40..200])
            .chain(&d1[220..])
            .all(|&b| b == 0xEE)
    );
    assert!(d2[..100].iter().chain(&d2[150..]).all(|&b| b == 0xEE));
}

#[test]
fn read_gathers_into_three_local_sges() {
    let (_ctx, pd, pair) = setup();
    let remote = pd.alloc_mr(512, full_access()).unwrap();
    let l1 = pd.alloc_mr(128, full_access()).unwrap();
    let l2 = pd.alloc_mr(128, full_access()).unwrap();
    remote.write_at(0, &pattern(512, 7)).unwrap();
    l1.fill(0);
    l2.fill(0);
    let sges = [l1.sge(5..25), l2.sge(0..64), l1.sge(100..106)];
    pair.qps[0]
        .post_send([SendWr::new(
            9,
            SendOp::RdmaRead {
                remote_addr: remote.iova() + 300,
                rkey: remote.rkey(),
            },
            &sges,
        )
        .flags(SendFlags::SIGNALED)])
        .unwrap();
    let wc = pair.cqs[0].wait_one().unwrap();
    assert_eq!(
        (wc.wr_id(), wc.status(), wc.opcode()),
        (9, WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert_eq!(wc.byte_len(), 90);
    let want = &pattern(512, 7)[300..390];
    let (a, b) = (l1.to_vec(), l2.to_vec());
    assert_eq!(&a[5..25], &want[0..20]);
    assert_eq!(&b[0..64], &want[20..84]);
    assert_eq!(&a[100..106], &want[84..90]);
    assert!(
        a[..5]
            .iter()
            .chain(&a[25..100])
            .chain(&a[106..])
            .all(|&x| x == 0)
    );
    assert!(b[64..].iter().all(|&x| x == 0));
}

#[test]
fn atomic_result_scatters_over_two_sges() {
    let (_ctx, pd, pair) = setup();
    let remote = pd.alloc_mr(64, full_access()).unwrap();
    let local = pd.alloc_mr(64, full_access()).unwrap();
    remote.store_u64(16, 0x1122_3344_5566_7788).unwrap();
    local.fill(0);
    let sges = [local.sge(3..6), local.sge(40..45)];
    pair.qps[0]
        .post_send([SendWr::new(
            1,
            SendOp::FetchAdd {
                remote_addr: remote.iova() + 16,
                rkey: remote.rkey(),
                add: 0x10,
            },
            &sges,
        )
        .flags(SendFlags::SIGNALED)])
        .unwrap();
    let wc = pair.cqs[0].wait_one().unwrap();
    assert_eq!(
        (wc.status(), wc.opcode(), wc.byte_len()),
        (WcStatus::Success, WcOpcode::FetchAdd, 8)
    );
    assert_eq!(remote.load_u64(16).unwrap(), 0x1122_3344_5566_7798);
    let orig = 0x1122_3344_5566_7788u64.to_ne_bytes();
    let l = local.to_vec();
    assert_eq!(&l[3..6], &orig[0..3]);
    assert_eq!(&l[40..45], &orig[3..8]);
}

#[test]
fn remote_access_error_moves_both_qps_to_err_and_flushes() {
    let (_ctx, pd, pair) = setup();
    let src = pd.alloc_mr(64, full_access()).unwrap();
    let dst = pd.alloc_mr(64, full_access()).unwrap();
    dst.fill(0x55);
    let rsge = [dst.sge(0..64)];
    pair.qps[1]
        .post_recv([RecvWr::new(100, &rsge), RecvWr::new(101, &rsge)])
        .unwrap();
    let sge = [src.sge(0..16)];
    let bad = SendOp::RdmaWrite {
        remote_addr: dst.iova() + 56,
        rkey: dst.rkey(),
    };
    let good = SendOp::RdmaWrite {
        remote_addr: dst.iova(),
        rkey: dst.rkey(),
    };
    pair.qps[0]
        .post_send([
            SendWr::new(1, bad, &sge).flags(SendFlags::SIGNALED),
            SendWr::new(2, good, &sge).flags(SendFlags::SIGNALED),
        ])
        .unwrap();
    let wc = pair.cqs[0].wait_one().unwrap();
    assert_eq!((wc.wr_id(), wc.status()), (1, WcStatus::RemAccessErr));
    let wc = pair.cqs[0].wait_one().unwrap();
    assert_eq!((wc.wr_id(), wc.status()), (2, WcStatus::WrFlushErr));
    assert_eq!(pair.qps[0].state(), QpState::Err);
    assert_eq!(pair.qps[1].state(), QpState::Err);
    // The responder's receives are flushed (by its progress thread), oldest first.
    for id in [100, 101] {
        let wc = pair.cqs[3].wait_one().unwrap();
        assert_eq!((wc.wr_id(), wc.status()), (id, WcStatus::WrFlushErr));
    }
    assert!(dst.to_vec().iter().all(|&b| b == 0x55));
}

#[test]
fn send_without_a_receive_waits_and_later_wrs_wait_behind_it() {
    // The model pre-posts every receive; this checks what happens when one is missing: the
    // SEND is retried after the RNR timer, and a WRITE posted behind it stays queued.
    let (_ctx, pd, pair) = setup();
    let src = pd.alloc_mr(64, full_access()).unwrap();
    let dst = pd.alloc_mr(64, full_access()).unwrap();
    src.write_at(0, &pattern(64, 3)).unwrap();
    dst.fill(0);
    let sge = [src.sge(0..16)];
    let write = SendOp::RdmaWrite {
        remote_addr: dst.iova() + 32,
        rkey: dst.rkey(),
    };
    pair.qps[0]
        .post_send([
            SendWr::new(1, SendOp::Send, &sge).flags(SendFlags::SIGNALED),
            SendWr::new(2, write, &sge).flags(SendFlags::SIGNALED),
        ])
        .unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let mut wc = [WorkCompletion::default(); 4];
    assert_eq!(
        pair.cqs[0].poll(&mut wc),
        0,
        "nothing completes without a receive"
    );
    assert!(
        dst.to_vec().iter().all(|&b| b == 0),
        "the WRITE waits behind the SEND"
    );
    let rsge = [dst.sge(0..16)];
    pair.qps[1].post_recv([RecvWr::new(50, &rsge)]).unwrap();
    for id in [1, 2] {
        let wc = pair.cqs[0].wait_one().unwrap();
        assert_eq!((wc.wr_id(), wc.status()), (id, WcStatus::Success));
    }
    let wc = pair.cqs[3].wait_one().unwrap();
    assert_eq!(
        (wc.wr_id(), wc.status(), wc.byte_len()),
        (50, WcStatus::Success, 16)
    );
    let d = dst.to_vec();
    assert_eq!(&d[0..16], &pattern(64, 3)[0..16]);
    assert_eq!(&d[32..48], &pattern(64, 3)[0..16]);
    assert_eq!(pair.qps[0].state(), QpState::Rts);
}
