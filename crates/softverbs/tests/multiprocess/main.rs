//! Verbs between processes: two (or three) processes open the same default device
//! `softverbs0`, swap endpoints, keys and addresses over a side channel, and talk RDMA.
//!
//! The test binary is its own peer: a parent test starts `current_exe()` again to run one
//! `peer_*` function (see [`harness`]). In a normal run the `peer_*` tests do nothing and pass.
//! Every wait has a deadline, and a peer that fails or hangs is killed and reported with its
//! stderr, so no test can hang.

mod common;
mod harness;

mod access;
mod atomics;
mod between_hosts;
mod channel;
mod cleanup;
mod cq;
mod dm;
mod events;
mod failure;
mod flush;
mod multicast;
mod mw;
mod noncontig;
mod odp;
mod one_sided;
mod rc;
mod relaxed;
mod scale;
mod selftest;
mod shared_pd;
mod srq;
mod ud_uc;
mod xrc;
