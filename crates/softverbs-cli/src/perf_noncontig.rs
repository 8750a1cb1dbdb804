//! `softverbs perf noncontig`: one column of a row-major matrix of 8-byte cells delivered into
//! a contiguous buffer of another QP, three ways (seed 002's motivating example):
//!
//! - **(a) one SGE per cell**: the column as `rows` SGEs of 8 bytes, split into
//!   `ceil(rows / max_sge)` RDMA WRITEs of at most `max_sge` SGEs each (the device's
//!   `max_sge`, which the QP is created with), each writing its cells to consecutive bytes of
//!   the destination;
//! - **(b) bounce buffer**: the CPU copies the column into a registered contiguous buffer
//!   (timed), which goes as one WRITE with one SGE;
//! - **(c) interleaved layout**: one WRITE with one SGE over a layout region whose single
//!   interleaved entry is the column (first cell, one dimension of `rows` cells with the row
//!   pitch as stride). The layout is built once, before the timing, like a registration.
//!
//! **Fair transfer.** Every method delivers a message the same way: RDMA WRITEs into the
//! receiver's contiguous buffer, the last (for (b) and (c) the only) one `WRITE_WITH_IMM` and
//! signaled, so each message costs exactly one receive (posted with no SGEs) and one
//! completion on each side, whatever the number of WRs. That is (a)'s cheapest form: with
//! SENDs it would also need one receive and one receive completion per WR. The SGE list of (a)
//! is built once (the column does not move), so only posting its WRs is timed; a message is
//! complete when both completions are polled. One message = one whole column delivered and
//! both completions polled, timed from the posting of the receive.
//!
//! **Descriptor bytes** per message are the bytes of the work requests and SGEs the
//! application hands to `post_send` / `post_recv` for it: `size_of::<SendWr>()` per send WR,
//! `size_of::<RecvWr>()` per receive WR and `size_of::<Sge>()` (16, as `struct ibv_sge`) per
//! SGE. (b) also needs a staging buffer of the column's size, reported apart; (c) needs the
//! layout, stored once per column shape (one entry, one dimension), not per message.
//!
//! The run is one process (the software NIC carries out an in-process WRITE inside
//! `post_send`, so all of a message's work is on this thread's CPU): a warm-up, then the
//! methods interleaved message by message (the order rotating) for N messages each; the figure
//! is the median time per message. Every delivered column is checked against the matrix (the
//! destination is cleared before each message), outside the timed part; a wrong byte fails
//! the run.

use crate::Result;
use crate::report::{count_arg, median, print_report};
use serde::Serialize;
use softverbs::{
    AccessFlags, CompletionQueue, Context, Datum, Dim, InterleavedEntry, MemoryRegion,
    ProtectionDomain, QpCap, QpInitAttr, QueuePair, RecvWr, SendFlags, SendOp, SendWr,
    SetLayoutFlags, Sge, WcOpcode, WorkCompletion,
};
use std::time::{Duration, Instant};

/// Matrix sizes (rows = columns): the full run measures both, `--quick` the small one.
const BIG_ROWS: usize = 4096;
const SMALL_ROWS: usize = 512;
/// Bytes per cell.
const CELL: usize = 8;
/// The column sent.
const COLUMN: usize = 7;
/// Messages per method and size, normally and with `--quick`.
const DEFAULT_ITERS: usize = 1000;
const QUICK_ITERS: usize = 100;
/// How long to wait for a completion before failing.
const WAIT_LIMIT: Duration = Duration::from_secs(10);

/// The three methods: short name, description.
const METHODS: [(&str, &str); 3] = [
    ("a", "one SGE per cell"),
    ("b", "CPU copy to bounce + 1 SGE"),
    ("c", "interleaved layout, 1 SGE"),
];

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Only a 512x512 matrix and 100 messages per method: a smoke check.
    #[arg(long)]
    quick: bool,
    /// Messages per method and matrix size [default: 1000; with --quick 100].
    #[arg(short = 'n', long, value_name = "N")]
    iters: Option<usize>,
    /// Device to use (default: the first device).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    device: Option<String>,
}

/// Work requests, SGEs and descriptor bytes of one message of `method` for a column of `rows`
/// cells with `max_sge` SGEs per WR: (send WRs, SGEs, descriptor bytes).
fn descriptors(method: usize, rows: usize, max_sge: usize) -> (usize, usize, usize) {
    let (wrs, sges) = match method {
        0 => (rows.div_ceil(max_sge), rows),
        _ => (1, 1),
    };
    // The one receive each message consumes has no SGEs.
    let bytes = wrs * size_of::<SendWr<'_>>() + sges * size_of::<Sge>() + size_of::<RecvWr<'_>>();
    (wrs, sges, bytes)
}

/// Cell (r, c) of the matrix: never 0, so a cleared destination cannot pass for a delivery.
fn cell(r: usize, c: usize) -> u64 {
    (((r as u64) << 32) | (c as u64 + 1)) ^ 0x5a00_0000_00a5_0000
}

/// One matrix size: two connected RC QPs of one PD, the matrix, the layout over its column,
/// the bounce buffer and the destination.
struct Bench {
    // Dropped in this order: QPs, memory (the layout before the matrix it uses), CQs, PD,
    // context.
    a: QueuePair,
    b: QueuePair,
    column: MemoryRegion<'static>,
    bounce: MemoryRegion<'static>,
    dst: MemoryRegion<'static>,
    matrix: MemoryRegion<'static>,
    cq_a: CompletionQueue,
    cq_b: CompletionQueue,
    _pd: ProtectionDomain,
    _ctx: Context,
    rows: usize,
    max_sge: usize,
    /// (a)'s SGEs: one per cell, built once.
    cell_sges: Vec<Sge>,
    /// The column's bytes, as they must arrive.
    want: Vec<u8>,
    /// Scratch for reading the destination back.
    got: Vec<u8>,
    /// Messages sent (their immediate data).
    seq: u32,
}

impl Bench {
    fn new(device: &softverbs::Device, rows: usize) -> Result<Bench> {
        let ctx = device.open()?;
        let max_sge = (ctx.query_device().max_sge as usize).max(1);
        let pd = ctx.alloc_pd()?;
        let (cq_a, cq_b) = (ctx.create_cq(16, None)?, ctx.create_cq(16, None)?);
        let wrs = rows.div_ceil(max_sge);
        let cap = |cq| QpInitAttr {
            cap: QpCap {
                max_send_wr: wrs as u32 + 1,
                max_recv_wr: 4,
                max_send_sge: max_sge as u32,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            ..QpInitAttr::rc(cq, cq)
        };
        let (a, b) = (pd.create_qp(&cap(&cq_a))?, pd.create_qp(&cap(&cq_b))?);
        let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        a.connect(&b.endpoint(0)?, 0, remote)?;
        b.connect(&a.endpoint(0)?, 0, remote)?;

        // The matrix, row-major: every row written (so every page exists, as in a real one).
        let pitch = rows * CELL;
        let matrix = pd
            .alloc_mr(rows * pitch, AccessFlags::LOCAL_WRITE)
            .map_err(|e| format!("allocating the {rows}x{rows} matrix: {e}"))?;
        let mut row = vec![0u8; pitch];
        for r in 0..rows {
            for (c, bytes) in row.chunks_exact_mut(CELL).enumerate() {
                bytes.copy_from_slice(&cell(r, c).to_le_bytes());
            }
            matrix.write_at(r * pitch, &row)?;
        }
        let want: Vec<u8> = (0..rows)
            .flat_map(|r| cell(r, COLUMN).to_le_bytes())
            .collect();
        let len = rows * CELL;
        let first = matrix.iova() + (COLUMN * CELL) as u64;

        // (a): one SGE per cell.
        let cell_sges = (0..rows)
            .map(|r| Sge {
                addr: first + (r * pitch) as u64,
                length: CELL as u32,
                lkey: matrix.lkey(),
            })
            .collect();
        // (b): the staging buffer.
        let bounce = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE)?;
        // (c): the column as a layout: the first cell, then `rows` cells one pitch apart.
        let column = pd.create_layout_mr(AccessFlags::LOCAL_WRITE)?;
        column.set_layout_interleaved(
            SetLayoutFlags::empty(),
            &[InterleavedEntry::new(
                Datum::new(matrix.lkey(), first, CELL as u64),
                vec![Dim::new(pitch as u64, rows as u64)],
            )],
        )?;
        if column.len() != len {
            return Err(format!("the column layout is {} bytes, not {len}", column.len()).into());
        }
        let dst = pd.alloc_mr(len, remote)?;
        Ok(Bench {
            a,
            b,
            column,
            bounce,
            dst,
            matrix,
            cq_a,
            cq_b,
            _pd: pd,
            _ctx: ctx,
            rows,
            max_sge,
            cell_sges,
            want,
            got: vec![0; len],
            seq: 0,
        })
    }

    /// Sends the column once by `method` and waits for both completions: the nanoseconds from
    /// posting the receive to polling the last completion. Then checks what arrived.
    fn message(&mut self, method: usize) -> Result<f64> {
        self.dst.fill(0);
        self.seq = self.seq.wrapping_add(1);
        let imm = self.seq;
        let len = self.rows * CELL;
        let (base, rkey) = (self.dst.iova(), self.dst.rkey());
        let write = |off: usize, last: bool| {
            let remote_addr = base + off as u64;
            if last {
                SendOp::RdmaWriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                }
            } else {
                SendOp::RdmaWrite { remote_addr, rkey }
            }
        };
        let start = Instant::now();
        self.b.post_recv([RecvWr::new(u64::from(imm), &[])])?;
        match method {
            0 => {
                let n = self.rows.div_ceil(self.max_sge);
                let wrs = self
                    .cell_sges
                    .chunks(self.max_sge)
                    .enumerate()
                    .map(|(i, sges)| {
                        let wr =
                            SendWr::new(i as u64, write(i * self.max_sge * CELL, i + 1 == n), sges);
                        if i + 1 == n {
                            wr.flags(SendFlags::SIGNALED)
                        } else {
                            wr
                        }
                    });
                self.a.post_send(wrs)?;
            }
            1 => {
                let pitch = self.rows * CELL;
                let src = self.matrix.as_ptr().cast_const();
                let to = self.bounce.as_ptr();
                for r in 0..self.rows {
                    // SAFETY: both are live registrations of this bench (the matrix
                    // rows * pitch bytes, the bounce buffer rows * CELL), page-aligned, so
                    // every cell is in bounds and 8-byte aligned; nothing writes the matrix
                    // during the run and the bounce buffer is read by the NIC only inside
                    // `post_send` below, on this thread.
                    unsafe {
                        let v = src.add(r * pitch + COLUMN * CELL).cast::<u64>().read();
                        to.add(r * CELL).cast::<u64>().write(v);
                    }
                }
                let sge = [self.bounce.sge(0..len)];
                self.a
                    .post_send([SendWr::new(0, write(0, true), &sge).flags(SendFlags::SIGNALED)])?;
            }
            _ => {
                let sge = [self.column.sge(0..len)];
                self.a
                    .post_send([SendWr::new(0, write(0, true), &sge).flags(SendFlags::SIGNALED)])?;
            }
        }
        let sent = wait(&self.cq_a)?;
        let recv = wait(&self.cq_b)?;
        let ns = start.elapsed().as_nanos() as f64;

        let name = METHODS[method].0;
        if !sent.is_ok() || !recv.is_ok() {
            return Err(
                format!("({name}) {rows} rows: {sent:?}, {recv:?}", rows = self.rows).into(),
            );
        }
        if recv.opcode() != WcOpcode::RecvRdmaWithImm || recv.imm_data() != Some(imm) {
            return Err(format!("({name}): unexpected receive completion {recv:?}").into());
        }
        self.dst.read_at(0, &mut self.got)?;
        if self.got != self.want {
            let bad = self
                .got
                .chunks_exact(CELL)
                .zip(self.want.chunks_exact(CELL))
                .position(|(g, w)| g != w)
                .unwrap_or(0);
            return Err(format!(
                "({name}) {rows} rows: the delivered column is wrong from cell {bad} on (got \
                 {:02x?}, expected {:02x?})",
                &self.got[bad * CELL..][..CELL],
                &self.want[bad * CELL..][..CELL],
                rows = self.rows
            )
            .into());
        }
        Ok(ns)
    }
}

/// Polls `cq` for one completion.
fn wait(cq: &CompletionQueue) -> Result<WorkCompletion> {
    let mut wc = [WorkCompletion::default()];
    let mut spins = 0u32;
    let mut deadline = None;
    while cq.poll(&mut wc) == 0 {
        spins = spins.wrapping_add(1);
        if spins % 1024 == 0 {
            let limit = *deadline.get_or_insert_with(|| Instant::now() + WAIT_LIMIT);
            if Instant::now() > limit {
                return Err("no completion within 10 s".into());
            }
            std::thread::yield_now();
        }
    }
    Ok(wc[0])
}

// ---------------------------------------------------------------------------------------------
// The report.

#[derive(Debug, Clone, Serialize)]
struct Row {
    /// Matrix rows (= columns): the column's cells.
    rows: usize,
    /// a, b or c.
    method: &'static str,
    description: &'static str,
    /// Send WRs and SGEs per message.
    wrs_per_message: usize,
    sges_per_message: usize,
    /// Bytes of WRs and SGEs the application builds per message.
    descriptor_bytes: usize,
    /// Bytes of staging memory the method needs (the bounce buffer of (b)).
    staging_bytes: usize,
    /// Messages timed (each verified).
    messages: usize,
    /// Median over messages: the figure compared.
    ns_per_message: f64,
    mean_ns_per_message: f64,
    /// 1e9 / ns_per_message.
    messages_per_sec: f64,
    /// Column bytes delivered per second at that rate.
    column_mb_per_sec: f64,
    /// messages_per_sec / the better of (a) and (b) at the same size.
    ratio_to_best_ab: f64,
}

/// Descriptor bytes of each method at one column length (computed, not measured).
#[derive(Debug, Clone, Serialize)]
struct Descriptors {
    rows: usize,
    a: usize,
    b: usize,
    c: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    quick: bool,
    cpus: usize,
    /// SGEs per WR of (a): the device's max_sge.
    max_sge: usize,
    column: usize,
    cell_bytes: usize,
    warmup: usize,
    /// How every method delivers a message.
    transfer: &'static str,
    statistic: &'static str,
    /// Sizes of the descriptors counted.
    send_wr_bytes: usize,
    recv_wr_bytes: usize,
    sge_bytes: usize,
    /// Every delivered column matched the matrix.
    verified: bool,
    /// (c) / best of (a) and (b), in messages per second, at the largest size measured.
    ratio_c_to_best_ab: f64,
    /// That ratio >= 1.
    speed_target_met: bool,
    /// (c)'s descriptor bytes are the same at 512 and 4096 rows.
    descriptor_bytes_independent: bool,
    descriptors: Vec<Descriptors>,
    rows: Vec<Row>,
}

impl Report {
    fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "perf noncontig: {}, one process ({} CPU{}); column {} of an NxN row-major matrix of \
             {}-byte cells into a contiguous buffer",
            self.device,
            self.cpus,
            if self.cpus == 1 { "" } else { "s" },
            self.column,
            self.cell_bytes
        );
        let _ = writeln!(
            t,
            "each message: RDMA WRITEs into the peer's buffer, the last WRITE_WITH_IMM (1 receive \
             and 1 completion per side); max_sge {}; median of {} messages per method after {} \
             warm-up, methods interleaved; every column verified",
            self.max_sge,
            self.rows.first().map_or(0, |r| r.messages),
            self.warmup
        );
        let _ = writeln!(
            t,
            "  {:>5}  {:<32} {:>4} {:>5} {:>7} {:>9} {:>10} {:>10}  {:>7}",
            "rows", "method", "WRs", "SGEs", "desc B", "ns/msg", "msgs/s", "MB/s", "vs a|b"
        );
        for r in &self.rows {
            let _ = writeln!(
                t,
                "  {:>5}  ({}) {:<28} {:>4} {:>5} {:>7} {:>9.0} {:>10.0} {:>10.1}  {:>6.2}x",
                r.rows,
                r.method,
                r.description,
                r.wrs_per_message,
                r.sges_per_message,
                r.descriptor_bytes,
                r.ns_per_message,
                r.messages_per_sec,
                r.column_mb_per_sec,
                r.ratio_to_best_ab
            );
        }
        let _ = writeln!(
            t,
            "  (c) / better of (a), (b): {:.2}x at {} rows: target >= 1.00x {}",
            self.ratio_c_to_best_ab,
            self.rows.first().map_or(0, |r| r.rows),
            if self.speed_target_met {
                "met"
            } else {
                "MISSED"
            }
        );
        let mut line = String::from("  descriptor bytes per message (a / b / c):");
        for d in &self.descriptors {
            let _ = write!(line, " {} rows {} / {} / {};", d.rows, d.a, d.b, d.c);
        }
        let _ = writeln!(
            t,
            "{} (c) {} of the column length",
            line,
            if self.descriptor_bytes_independent {
                "independent"
            } else {
                "NOT independent"
            }
        );
        let _ = writeln!(
            t,
            "  (SendWr {} B, RecvWr {} B, Sge {} B; (b) also stages the column in rows x {} B; \
             (c)'s layout, 1 entry of 1 dimension, is built once)",
            self.send_wr_bytes, self.recv_wr_bytes, self.sge_bytes, self.cell_bytes
        );
        t
    }
}

pub fn run(args: &Args) -> Result<()> {
    let iters = count_arg(
        "--iters",
        args.iters,
        args.quick,
        (DEFAULT_ITERS, QUICK_ITERS),
        100_000_000,
    )?;
    let warmup = (iters / 10).clamp(3, 200);
    let device = crate::find_device(args.device.as_deref())?;
    let sizes: &[usize] = if args.quick {
        &[SMALL_ROWS]
    } else {
        &[BIG_ROWS, SMALL_ROWS]
    };

    let mut rows = Vec::new();
    let mut max_sge = 0;
    for &n in sizes {
        let mut bench = Bench::new(&device, n)?;
        max_sge = bench.max_sge;
        let mut samples: [Vec<f64>; 3] = Default::default();
        for i in 0..warmup + iters {
            for k in 0..METHODS.len() {
                // Rotate the order, so no method always follows the same one.
                let m = (i + k) % METHODS.len();
                let ns = bench.message(m)?;
                if i >= warmup {
                    samples[m].push(ns);
                }
            }
        }
        let mut size_rows: Vec<Row> = (0..METHODS.len())
            .map(|m| {
                let mean = samples[m].iter().sum::<f64>() / samples[m].len() as f64;
                let ns = median(&mut samples[m]).max(1e-9);
                let (wrs, sges, bytes) = descriptors(m, n, bench.max_sge);
                Row {
                    rows: n,
                    method: METHODS[m].0,
                    description: METHODS[m].1,
                    wrs_per_message: wrs,
                    sges_per_message: sges,
                    descriptor_bytes: bytes,
                    staging_bytes: if m == 1 { n * CELL } else { 0 },
                    messages: iters,
                    ns_per_message: ns,
                    mean_ns_per_message: mean,
                    messages_per_sec: 1e9 / ns,
                    column_mb_per_sec: (n * CELL) as f64 * 1e3 / ns,
                    ratio_to_best_ab: 0.0,
                }
            })
            .collect();
        let best_ab = size_rows[0]
            .messages_per_sec
            .max(size_rows[1].messages_per_sec);
        for r in &mut size_rows {
            r.ratio_to_best_ab = r.messages_per_sec / best_ab;
        }
        rows.extend(size_rows);
    }

    let descriptors_at = |n: usize| Descriptors {
        rows: n,
        a: descriptors(0, n, max_sge).2,
        b: descriptors(1, n, max_sge).2,
        c: descriptors(2, n, max_sge).2,
    };
    let descriptors = vec![descriptors_at(SMALL_ROWS), descriptors_at(BIG_ROWS)];
    let ratio = rows[2].ratio_to_best_ab;
    let report = Report {
        device: device.name().into(),
        quick: args.quick,
        cpus: crate::report::cpus(),
        max_sge,
        column: COLUMN,
        cell_bytes: CELL,
        warmup,
        transfer: "RDMA WRITEs into the receiver's contiguous buffer, the last one WRITE_WITH_IMM \
                   and signaled: one receive (no SGEs) and one completion per side per message",
        statistic: "median over messages of the time from posting the receive to polling both \
                    completions",
        send_wr_bytes: size_of::<SendWr<'_>>(),
        recv_wr_bytes: size_of::<RecvWr<'_>>(),
        sge_bytes: size_of::<Sge>(),
        verified: true,
        ratio_c_to_best_ab: ratio,
        speed_target_met: ratio >= 1.0,
        descriptor_bytes_independent: descriptors.iter().all(|d| d.c == descriptors[0].c),
        descriptors,
        rows,
    };
    print_report(&report, args.json, Report::text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_delivers_the_column() {
        let dev = crate::find_device(None).unwrap();
        let mut b = Bench::new(&dev, 100).unwrap();
        for m in 0..METHODS.len() {
            b.message(m).unwrap();
        }
    }

    #[test]
    fn layout_descriptors_do_not_grow_with_the_column() {
        assert_eq!(descriptors(2, 512, 32), descriptors(2, 4096, 32));
        assert_eq!(descriptors(0, 4096, 32).0, 128);
        assert_eq!(descriptors(0, 4096, 32).1, 4096);
    }
}
