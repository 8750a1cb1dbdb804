//! `softverbs nic`: the host engines of this host's networked devices (RoCEv2 between
//! hosts): their state, counters, clients and queue pairs; `--capture FILE` makes one write
//! every packet it sends and receives as a pcap.

use crate::Result;
use clap::Parser;

#[derive(Parser)]
pub struct Args {
    /// The networked device (default: every networked device in `SOFTVERBS_DEVICES`).
    #[arg(short = 'd', long)]
    device: Option<String>,
    /// Capture every packet of the engine to this pcap file (`--capture ''` stops it).
    #[arg(long, value_name = "FILE")]
    capture: Option<String>,
}

/// Prints each engine's report; fails when a named device has no engine running.
pub fn run(args: &Args) -> Result<()> {
    let devices: Vec<softverbs::Device> = softverbs::devices()?
        .into_iter()
        .filter(softverbs::Device::is_networked)
        .filter(|d| args.device.as_deref().is_none_or(|n| d.name() == n))
        .collect();
    if devices.is_empty() {
        return Err(match &args.device {
            Some(n) => format!("no networked device {n} (see SOFTVERBS_DEVICES)").into(),
            None => "no networked device: set SOFTVERBS_DEVICES=name=roce0,netdev=IFNAME".into(),
        });
    }
    let mut failed = Vec::new();
    for d in &devices {
        let answer = match &args.capture {
            Some(path) => d.engine_capture(path),
            None => d.engine_report(),
        };
        match answer {
            Ok(text) => crate::write_stdout(&format!("{}:\n{text}\n", d.name()))?,
            Err(e) => {
                crate::write_stdout(&format!("{}: no engine running ({e})\n", d.name()))?;
                failed.push(d.name().to_string());
            }
        }
    }
    if failed.is_empty() || args.device.is_none() {
        Ok(())
    } else {
        Err(format!("no engine for {}", failed.join(", ")).into())
    }
}
