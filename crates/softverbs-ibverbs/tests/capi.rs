//! A C program compiled against Debian's `<infiniband/verbs.h>` and linked to the system's
//! `libibverbs.so.1`, then run with the softverbs drop-in found first: device and port
//! queries (including the header's static-inline `ibv_query_port`, `ibv_query_device_ex` with
//! the completion clock, `ibv_query_rt_values_ex`, `ibv_query_gid_ex`/`ibv_query_gid_table`),
//! RC traffic with SEND, WRITE, READ and both atomics between two QPs, a CQ made with
//! `ibv_create_cq_ex` and polled with `ibv_start_poll`/`ibv_next_poll`/`ibv_end_poll` and the
//! `ibv_wc_read_*` readers (its creation errors too), completion events with `O_NONBLOCK` on
//! the channel fd (not readable once its event is taken; a blocking wait a signal ends with
//! `EINTR`), async events (a responder's QP_ACCESS_ERR, an SRQ limit), and bad input
//! (bad access flags → NULL with EINVAL; a wrong QP transition → EINVAL).
//!
//! A second C program, `tests/c/poll_cq_ex.c`, uses softverbs' own header
//! `include/softverbs/verbs_ext.h` and is linked to the drop-in itself (its `ibv_poll_cq_ex`
//! and `ibv_wc_ex_cq_flags` exist only there): the seed's compact records and layout helpers
//! over RC SEND, SEND_WITH_IMM, RDMA_WRITE_WITH_IMM and READ for several CQ field sets.
//!
//! A third, `tests/c/noncontig.c`, also linked to the drop-in: seed 002's non-contiguous memory
//! regions (`ibv_mr_set_layout_sg` / `ibv_mr_set_layout_interleaved`, the caps query, the two
//! man-page examples over RC, the bind work request, every result code, key changes, dereg
//! busy).
//!
//! A fourth, `tests/c/conformance.c`, checks calls against the man pages and the kernel's
//! answers, one call family per test (see the file's head).
//!
//! The four share their set-up and polling helpers through `tests/c/common.h` (found beside
//! each source by `#include "common.h"`, so no `-I` is needed for it).
//!
//! Needs `cc` and `libibverbs-dev`; without them the tests are skipped with a message, except
//! under `CI=true`, where they fail.

use std::path::{Path, PathBuf};
use std::process::Command;

fn missing(what: &str) {
    let msg = format!("C API test needs {what}");
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{msg} (CI=true: not skipping)");
    }
    eprintln!("SKIPPED: {msg}");
}

/// The drop-in built by this `cargo test` (the cdylib lands beside the test binaries).
fn dropin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    [
        deps.join("libibverbs.so"),
        deps.parent()?.join("libibverbs.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max()
    .map(|(_, p)| p)
}

/// Compiles `tests/c/<name>.c` and runs it with the drop-in found first; it must exit 0 and
/// print "ok". With `link_dropin` the program is linked to the drop-in and compiled with
/// softverbs' `include/` directory; otherwise to the system's `libibverbs.so`.
/// Compiles `tests/c/<name>.c` into a fresh directory that also holds `libibverbs.so.1` (the
/// drop-in), linked against the system's libibverbs or, with `link_dropin`, the drop-in (for
/// softverbs' own exported calls). None when something needed is missing (`missing` says so).
fn compile_c(name: &str, link_dropin: bool) -> Option<(PathBuf, PathBuf)> {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() {
        missing("/usr/include/infiniband/verbs.h (apt-get install libibverbs-dev)");
        return None;
    }
    let Some(lib) = dropin() else {
        missing("the drop-in libibverbs.so (cargo build -p softverbs-ibverbs)");
        return None;
    };
    // A directory per compilation: tests of one program run in parallel.
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("softverbs-{name}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = manifest.join(format!("tests/c/{name}.c"));
    let exe = dir.join(name);
    std::os::unix::fs::symlink(&lib, dir.join("libibverbs.so.1")).unwrap();
    let mut cc = Command::new("cc");
    cc.args(["-O1", "-Wall", "-o"]).arg(&exe).arg(&src);
    if link_dropin {
        std::os::unix::fs::symlink(&lib, dir.join("libibverbs.so")).unwrap();
        cc.arg("-Wextra")
            .arg("-Werror")
            .arg(format!("-I{}", manifest.join("include").display()))
            .arg(format!("-L{}", dir.display()));
    }
    let cc = match cc.arg("-libverbs").output() {
        Ok(o) => o,
        Err(e) => {
            missing(&format!("a C compiler `cc` ({e})"));
            return None;
        }
    };
    assert!(
        cc.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    Some((dir, exe))
}

fn run_c_program(name: &str, link_dropin: bool) {
    run_c_program_with(name, link_dropin, &[]);
}

/// [`run_c_program`] with command-line arguments.
fn run_c_program_with(name: &str, link_dropin: bool, args: &[&str]) {
    let Some((dir, exe)) = compile_c(name, link_dropin) else {
        return;
    };
    let out = Command::new(&exe)
        .args(args)
        .env("LD_LIBRARY_PATH", &dir)
        .env("LD_BIND_NOW", "1")
        .env_remove("SOFTVERBS_DEVICES")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn c_program_over_the_drop_in() {
    run_c_program("capi", false);
}

#[test]
fn c_poll_cq_ex_compact_records() {
    run_c_program("poll_cq_ex", true);
}

#[test]
fn c_noncontiguous_memory_regions() {
    run_c_program("noncontig", true);
}

/// `tests/c/conformance.c mr`: registrations of unmapped, partly mapped, PROT_NONE and
/// read-only memory (with a writing right) fail with EFAULT, as the kernel's pinning of the
/// pages answers; a failed `ibv_rereg_mr` leaves the region as it was.
#[test]
fn c_conformance_memory_registration() {
    run_c_program_with("conformance", false, &["mr"]);
}

/// `conformance busy`: destroying a PD, CQ or SRQ still in use is EBUSY and leaves it usable.
#[test]
fn c_conformance_destroying_objects_in_use() {
    run_c_program_with("conformance", false, &["busy"]);
}

/// `conformance post`: SGE counts over the queue's limits and inline data over
/// `max_inline_data` are EINVAL with `bad_wr`, checked before the caller's array or bytes are
/// read (they end at a guard page).
#[test]
fn c_conformance_post_limits() {
    run_c_program_with("conformance", false, &["post"]);
}

/// `conformance cq`: completion vectors `0..num_comp_vectors` work, others and out-of-range
/// sizes are EINVAL.
#[test]
fn c_conformance_cq_creation() {
    run_c_program_with("conformance", false, &["cq"]);
}

/// `conformance query`: what the queries report is what a RoCE device would (non-zero ids,
/// the `_ex` call agreeing with the plain one, nothing advertised that is not implemented).
#[test]
fn c_conformance_queries() {
    run_c_program_with("conformance", false, &["query"]);
}

/// `conformance qp`: `ibv_create_qp` refuses every capacity over the device's limits, a
/// missing CQ and an unknown type with EINVAL, and works at the limits.
#[test]
fn c_conformance_qp_creation() {
    run_c_program_with("conformance", false, &["qp"]);
}

/// `conformance modify`: `ibv_modify_qp` per transition refuses a missing required
/// attribute, one the transition does not take and out-of-range values with EINVAL, leaving
/// the QP in its state.
#[test]
fn c_conformance_qp_state_transitions() {
    run_c_program_with("conformance", false, &["modify"]);
}

/// `conformance fork`: `ibv_is_fork_initialized` says `IBV_FORK_UNNEEDED`, and it is true: a
/// child's writes to registered memory stay in the child, and the parent's registrations
/// keep working after the fork.
#[test]
fn c_conformance_fork() {
    run_c_program_with("conformance", false, &["fork"]);
}

/// `conformance rereg`: each of `ibv_rereg_mr`'s seven flag combinations, followed by
/// traffic with the keys it returns (the new translation, PD and rights take effect).
/// `conformance dereg`: `ibv_dereg_mr` of a region another thread is sending from returns
/// only once no access through it is under way; the memory is unmapped right after, so an
/// access past the return would kill the program.
#[test]
fn c_conformance_dereg_mr_racing_a_sender() {
    run_c_program_with("conformance", false, &["dereg"]);
}

#[test]
fn c_conformance_rereg_mr() {
    run_c_program_with("conformance", false, &["rereg"]);
}

/// `conformance odp`: on-demand paging, explicit and implicit (see the file's head).
#[test]
fn c_on_demand_paging() {
    run_c_program_with("conformance", false, &["odp"]);
}

/// `conformance mw`: memory windows of type 1 and 2 through `ibv_post_send`, `ibv_bind_mw`
/// and the `ibv_wr_*` API, remote and local invalidation, and the bind errors.
#[test]
fn c_memory_windows() {
    run_c_program_with("conformance", false, &["mw"]);
}

/// `conformance mcast`: UD multicast through `ibv_attach_mcast`/`ibv_detach_mcast`.
#[test]
fn c_ud_multicast() {
    run_c_program_with("conformance", false, &["mcast"]);
}

/// `conformance xrc`: XRC domains, XRC SRQs, initiator and target QPs, `ibv_open_qp`, and
/// their errors.
#[test]
fn c_xrc() {
    run_c_program_with("conformance", false, &["xrc"]);
}

/// `conformance import`: shared PDs between two processes (`ibv_import_device`, `_pd`,
/// `_mr`), and their errors.
#[test]
fn c_shared_pds() {
    run_c_program_with("conformance", false, &["import"]);
}

/// `conformance flush`: RDMA FLUSH through rdma-core 45's `ibv_wr_flush` slot, its cap, and
/// its errors.
#[test]
fn c_rdma_flush() {
    run_c_program_with("conformance", false, &["flush"]);
}

/// `conformance awrite`: RDMA ATOMIC WRITE through `ibv_wr_atomic_write` and `ibv_post_send`,
/// its cap, and its errors.
#[test]
fn c_rdma_atomic_write() {
    run_c_program_with("conformance", false, &["awrite"]);
}

/// `conformance events`: QP_REQ_ERR, QP_LAST_WQE_REACHED and CQ_ERR, each on its object.
#[test]
fn c_conformance_async_events() {
    run_c_program_with("conformance", false, &["events"]);
}

/// `conformance dm`: device memory, its zero-based regions and their errors.
#[test]
fn c_device_memory() {
    run_c_program_with("conformance", false, &["dm"]);
}

/// `conformance domain`: thread and parent domains.
#[test]
fn c_thread_and_parent_domains() {
    run_c_program_with("conformance", false, &["domain"]);
}

/// `conformance srq_ah`: SRQ and AH creation limits, and the queries giving back what was set.
#[test]
fn c_conformance_srq_ah_and_queries() {
    run_c_program_with("conformance", false, &["srq_ah"]);
}

/// The rate conversions are pure functions of rdma-core: `rates.c` prints them over a range of
/// inputs, run once over the system's libibverbs and once over the drop-in; the two outputs
/// must be the same.
#[test]
fn rate_conversions_answer_as_rdma_core_does() {
    let Some((dir, exe)) = compile_c("rates", false) else {
        return;
    };
    let run = |dropin: bool| {
        let mut c = Command::new(&exe);
        c.env_remove("LD_LIBRARY_PATH").env_remove("LD_PRELOAD");
        if dropin {
            c.env("LD_LIBRARY_PATH", &dir);
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let (rdma_core, ours) = (run(false), run(true));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        rdma_core.ends_with("ok\n") && rdma_core.lines().count() > 100,
        "{rdma_core}"
    );
    assert_eq!(ours, rdma_core);
}
