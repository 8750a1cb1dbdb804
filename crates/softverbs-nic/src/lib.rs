//! The softverbs software RDMA NIC.
//!
//! Think of it as a NIC whose firmware is a Rust library: device memory (queues, CQ rings, the
//! key table) is plain `#[repr(C)]` data in shared `memfd` segments, and requester/responder
//! logic is a set of functions the initiator runs against its target's device memory. It knows
//! nothing of the public `softverbs` API, which wraps it.
//!
//! Module map:
//! - [`types`]: verbs vocabulary (flags, opcodes, statuses, states).
//! - [`config`], [`device`]: devices, their limits and attributes, the in-process fabric.
//! - [`shm`], [`ring`]: shared segments and the lock-free slot ring every queue is built on.
//! - [`cq`], [`rq`], [`keys`]: completion queues (rings, channels, the arm/event protocol in
//!   `cq::notify`), receive queues/SRQs, the memory-key table;
//!   [`compact`]: the seed's compact completion records.
//! - [`objects`], [`qp`], [`wr`]: contexts, PDs, MRs, AHs, queue pairs, work requests.
//! - `exec`, `mem`: executing a work request, and the memory accessor that moves bytes.
//! - [`ordering`]: strict and relaxed placement, and the ordering check.
//! - [`layout`]: non-contiguous layouts (seed 002): SG, interleaved, page lists, nesting;
//!   [`mrlayout`]: layouts in the key table, shared with peers, resolved on the data path.
//! - `progress`: the timer thread for RNR and ACK retries.
//! - [`inspect`]: another process's CQ rings and threads, read through `/proc` (hang reports).

pub mod clock;
pub mod config;
pub mod cq;
pub mod device;
pub mod device_memory;
pub mod error;
pub mod inspect;
pub mod mr;
pub mod pd;
pub mod qp;
pub(crate) mod transport;
pub mod types;

pub use error::{Error, Result};
pub use types::GRH_LEN;
