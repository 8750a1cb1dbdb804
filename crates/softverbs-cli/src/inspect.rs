//! `softverbs inspect PID...`: what running softverbs programs are waiting for, read from
//! outside them (their threads' kernel wait channels and every CQ ring's arm, pending event
//! and waiting completions), for explaining a hang without stopping the program.

use crate::Result;
use clap::Parser;

#[derive(Parser)]
pub struct Args {
    /// Process ids to inspect.
    #[arg(required = true)]
    pids: Vec<u32>,
}

/// Prints one report per process; fails if a process could not be read at all.
pub fn run(args: &Args) -> Result<()> {
    let mut unreadable = Vec::new();
    for &pid in &args.pids {
        let report = softverbs::inspect::process(pid);
        if report.threads.is_empty() {
            unreadable.push(pid.to_string());
        }
        crate::write_stdout(&report.to_string())?;
    }
    if unreadable.is_empty() {
        Ok(())
    } else {
        Err(format!("cannot read process {}", unreadable.join(", ")).into())
    }
}
