//! What the CLI's integration tests share: whether the real clients they run are installed
//! (skip with a message, or fail under `CI=true`), and how a finished process is shown.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Output;

/// `CI=true`: whatever a test needs must be there.
pub fn ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

pub fn find_in_path(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// True if `tools` and the drop-in `libibverbs.so` beside the `softverbs` binary are there;
/// otherwise says why test `test` is skipped, or panics under `CI=true`.
pub fn have_tools(test: &str, tools: &[&str]) -> bool {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_softverbs"));
    let lib = exe.with_file_name("libibverbs.so");
    let in_deps = exe.with_file_name("deps").join("libibverbs.so");
    let mut missing: Vec<String> = tools
        .iter()
        .filter(|t| find_in_path(t).is_none())
        .map(|t| format!("`{t}` (apt-get install ibverbs-utils perftest)"))
        .collect();
    if !lib.is_file() && !in_deps.is_file() && std::env::var_os("SOFTVERBS_IBVERBS_LIB").is_none() {
        missing.push(format!("{} (cargo build --workspace)", lib.display()));
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("{test}: missing {}", missing.join(", "));
    assert!(!ci(), "{msg} (CI=true: not skipping)");
    eprintln!("SKIPPED: {msg}");
    false
}

/// A finished process: its status and both outputs.
pub fn show(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
