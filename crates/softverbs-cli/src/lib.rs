//! Test infrastructure the `softverbs` binary shares with the tests of this crate (and of
//! anything else that depends on it): network namespaces to put two RoCE hosts on one
//! machine, and a checker for pcap captures of RoCEv2 traffic.
//!
//! A library target and not copies in each test: the binary's `perf --net` and the tests
//! must make namespaces the same way, and clean them up the same way.

pub mod capture;
pub mod netns;
