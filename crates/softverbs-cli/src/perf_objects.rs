//! `softverbs perf objects`: what verbs objects cost in numbers real applications use: the
//! time to create and destroy each of N QPs (with the default queue sizes, and with the small
//! ones an application with a QP per peer picks), the memory each idle QP holds (device
//! memory the NIC allocated for it, and the growth of the process's resident set), the file
//! descriptors the process holds before and after; the time to deregister a memory region of
//! their PD while they exist (deregistration waits for each QP of the PD to be outside any
//! request, see `KeyTable::pin_key`); and the time to register and deregister each of M
//! memory regions (the device's `max_mr` by default, so that the limit is shown to be real).
//!
//! One process, one device; nothing else is timed. The QPs stay in RESET: an idle QP of an
//! application is connected, but connecting adds no memory (the peer's QP context is mapped,
//! not copied) and is not what this measures.

use crate::Result;
use crate::report::{count_arg, print_report};
use serde::Serialize;
use softverbs::{AccessFlags, CompletionQueue, ProtectionDomain, QpInitAttr, QpType, QueuePair};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// QPs to create in each case [default: 10000; with --quick 1000].
    #[arg(short = 'n', long, value_name = "N")]
    qps: Option<u32>,
    /// Memory regions to register [default: the device's max_mr; with --quick 10000].
    #[arg(long, value_name = "M")]
    mrs: Option<u32>,
    /// Small counts, for smoke checks.
    #[arg(long)]
    quick: bool,
    /// Device to use (default: the first device).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    device: Option<String>,
}

/// One case of QPs: how they were sized, and what N of them cost.
#[derive(Debug, Serialize)]
struct QpCase {
    case: &'static str,
    max_send_wr: u32,
    max_recv_wr: u32,
    qps: u32,
    create_us: f64,
    destroy_us: f64,
    /// Device memory (the NIC's arena) per QP, bytes.
    device_memory_bytes: f64,
    /// Growth of the resident set per QP, bytes (everything the process touched for them).
    resident_bytes: f64,
    fds_before: usize,
    fds_with_qps: usize,
    /// Deregistering a region of the QPs' PD while they exist, µs a region.
    deregister_beside_us: f64,
}

#[derive(Debug, Serialize)]
struct MrCase {
    mrs: u32,
    max_mr: u32,
    register_us: f64,
    deregister_us: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    cpu_model: String,
    max_qp: u32,
    qp_cases: Vec<QpCase>,
    mr: Option<MrCase>,
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// The resident set, in bytes.
fn resident() -> f64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .unwrap_or(0.0);
    pages * rustix::param::page_size() as f64
}

fn qp_case(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    case: &'static str,
    small: bool,
    n: u32,
) -> Result<QpCase> {
    let mut attr = QpInitAttr::new(QpType::Rc, cq, cq);
    if small {
        attr.cap.max_send_wr = 4;
        attr.cap.max_recv_wr = 1;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        attr.cap.max_inline_data = 16;
    }
    let fds_before = open_fds();
    let mem0 = softverbs::nic::device_memory::arena::usage().live_bytes as f64;
    let rss0 = resident();
    let t = Instant::now();
    let qps = (0..n)
        .map(|_| pd.create_qp(&attr))
        .collect::<std::result::Result<Vec<QueuePair>, _>>()
        .map_err(|e| format!("creating {n} QPs ({case}): {e}"))?;
    let create = t.elapsed();
    let mem1 = softverbs::nic::device_memory::arena::usage().live_bytes as f64;
    let rss1 = resident();
    let fds_with_qps = open_fds();
    let beside = mr_case(pd, DEREG_BESIDE, DEREG_BESIDE)?;
    let t = Instant::now();
    drop(qps);
    let destroy = t.elapsed();
    let per = |d: std::time::Duration| d.as_secs_f64() * 1e6 / f64::from(n);
    Ok(QpCase {
        case,
        max_send_wr: attr.cap.max_send_wr,
        max_recv_wr: attr.cap.max_recv_wr,
        qps: n,
        create_us: per(create),
        destroy_us: per(destroy),
        device_memory_bytes: (mem1 - mem0) / f64::from(n),
        resident_bytes: (rss1 - rss0) / f64::from(n),
        fds_before,
        fds_with_qps,
        deregister_beside_us: beside.deregister_us,
    })
}

/// Regions registered and deregistered beside each case's QPs.
const DEREG_BESIDE: u32 = 256;

fn mr_case(pd: &ProtectionDomain, m: u32, max_mr: u32) -> Result<MrCase> {
    let mut buf = vec![0u8; 4096];
    let t = Instant::now();
    let mut mrs = Vec::with_capacity(m as usize);
    for i in 0..m {
        // SAFETY: `buf` outlives every region (they are dropped below, before it), and
        // nothing accesses the regions' memory.
        let mr = unsafe {
            pd.reg_mr_raw(
                buf.as_mut_ptr(),
                buf.len(),
                buf.as_ptr() as u64,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
        }
        .map_err(|e| format!("registering memory region {} of {m}: {e}", i + 1))?;
        mrs.push(mr);
    }
    let register = t.elapsed();
    let t = Instant::now();
    drop(mrs);
    let deregister = t.elapsed();
    let per = |d: std::time::Duration| d.as_secs_f64() * 1e6 / f64::from(m);
    Ok(MrCase {
        mrs: m,
        max_mr,
        register_us: per(register),
        deregister_us: per(deregister),
    })
}

pub fn run(args: &Args) -> Result<()> {
    let n = count_arg("--qps", args.qps, args.quick, (10_000, 1_000), 1 << 18)?;
    let device = crate::find_device(args.device.as_deref())?;
    let ctx = device.open()?;
    let attr = ctx.query_device();
    let m = count_arg(
        "--mrs",
        args.mrs,
        args.quick,
        (attr.max_mr, 10_000.min(attr.max_mr)),
        attr.max_mr,
    )?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16, None)?;
    let qp_cases = vec![
        qp_case(&pd, &cq, "default queues", false, n)?,
        qp_case(&pd, &cq, "small queues", true, n)?,
    ];
    let mr = Some(mr_case(&pd, m, attr.max_mr)?);
    let report = Report {
        device: device.name().into(),
        cpu_model: crate::report::cpu_model(),
        max_qp: attr.max_qp,
        qp_cases,
        mr,
    };
    print_report(&report, args.json, Report::text)
}

impl Report {
    fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "perf objects: {} (max_qp {}), one process ({})",
            self.device, self.max_qp, self.cpu_model
        );
        for c in &self.qp_cases {
            let _ = writeln!(
                t,
                "  {} RC QPs, {} ({} send / {} receive WRs): create {:.1} µs, destroy {:.1} µs \
                 a QP; {:.0} B of device memory and {:.0} B resident a QP; descriptors {} \
                 before, {} with them; deregistering a region of their PD {:.1} µs",
                c.qps,
                c.case,
                c.max_send_wr,
                c.max_recv_wr,
                c.create_us,
                c.destroy_us,
                c.device_memory_bytes,
                c.resident_bytes,
                c.fds_before,
                c.fds_with_qps,
                c.deregister_beside_us
            );
        }
        if let Some(m) = &self.mr {
            let _ = writeln!(
                t,
                "  {} memory regions (max_mr {}): register {:.2} µs, deregister {:.2} µs a region",
                m.mrs, m.max_mr, m.register_us, m.deregister_us
            );
        }
        t
    }
}
