//! Every test of this suite again, between two hosts: two network namespaces joined by a veth
//! pair, each with a networked device (`roce0`, RoCEv2 over UDP through its host engine). The
//! parent runs in one namespace and every peer in the other, so each test's traffic crosses
//! the wire as RoCEv2 packets.
//!
//! Needs root (for the namespaces) and the `softverbs` executable built beside this test (the
//! library starts the engine with it); skipped with a message otherwise, except under
//! `CI=true`, where it fails.

use crate::harness::{PEER_DEVICES_ENV, PEER_NETNS_ENV, ROLE_ENV};
use std::time::{Duration, Instant};

#[path = "../../../softverbs-cli/src/netns.rs"]
#[allow(dead_code)]
mod netns;

/// The whole suite between hosts must end well within this.
const LIMIT: Duration = Duration::from_secs(600);

#[test]
fn every_multiprocess_test_passes_between_two_network_namespaces() {
    const T: &str = "multiprocess between hosts";
    // Not inside the run this test starts, nor in a peer.
    if std::env::var_os(PEER_NETNS_ENV).is_some() || std::env::var_os(ROLE_ENV).is_some() {
        return;
    }
    if !netns::available_for_test(T) {
        return;
    }
    let net = netns::NetPair::new(&netns::NetConfig::default()).expect("make the namespaces");
    let (a, b) = (net.a(), net.b());
    let exe = std::env::current_exe().expect("current_exe");
    let t0 = Instant::now();
    let mut child = a
        .command(&exe)
        .args(["--test-threads=1", "--skip", "between_hosts::"])
        .env(
            "SOFTVERBS_DEVICES",
            format!("name=roce0,netdev={}", a.ifname),
        )
        .env(PEER_NETNS_ENV, &b.netns)
        .env(PEER_DEVICES_ENV, format!("name=roce0,netdev={}", b.ifname))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the suite in the first namespace");
    let out = loop {
        if let Ok(Some(_)) = child.try_wait() {
            break child.wait_with_output().expect("collect the output");
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect the output");
            panic!(
                "{T}: still running after {LIMIT:?}\n{}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("test result") || l.contains("FAILED") || l.contains("panicked"))
        .collect();
    eprintln!(
        "{T}: {:.1} s: {}",
        t0.elapsed().as_secs_f64(),
        summary.join(" | ")
    );
    assert!(
        out.status.success(),
        "{T}: the suite failed between the namespaces\n--- stdout\n{stdout}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
