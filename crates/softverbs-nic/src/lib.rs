//! The softverbs software RDMA NIC.
//!
//! Think of it as a NIC whose firmware is a Rust library: device memory (queues, CQ rings, the
//! key table, QP contexts) is plain `#[repr(C)]` data in shared `memfd` segments, and
//! requester/responder logic is a set of functions run against the target's device memory. It
//! knows nothing of the public `softverbs` API, which wraps it.
//!
//! Module map, lowest layer first; a module imports only from the layers before it, and
//! nothing but `transport` knows a transport:
//! - [`types`], [`error`], [`config`], [`clock`]: verbs vocabulary, errors, device
//!   configuration, the device clock; `sync`: a thread's identity and the memory barriers
//!   the kernel sends to other threads (`membarrier(2)`), for the lock-free protocols.
//! - [`device_memory`]: shared `memfd` segments, the lock-free slot ring every queue is built
//!   on, doorbells, and descriptors handed to other processes.
//! - [`mr`]: memory regions on the data path: the key table, the memory accessor (the one
//!   place bytes move), strict and relaxed placement, and non-contiguous layouts (the engine,
//!   their store in shared memory, resolution into spans, the containers' registry).
//! - [`device`]: devices, their attributes and limits, QP numbers and the host's directory of
//!   QPs, async events, contexts, the timer thread for deferred work.
//! - [`cq`]: completion queues (rings, channels, the arm/event protocol in `cq::notify`, the
//!   seed's compact records, cursors).
//! - [`pd`]: protection domains, memory regions (and their layouts), address handles.
//! - [`qp`]: queue pairs: the QP context in device memory, the state machine, receive queues
//!   and SRQs, work requests, the send-queue driver, and the requester's and responder's
//!   semantics of every work request.
//! - `transport`: how a request reaches its responder: the boundary, and the same-host
//!   transport (the initiator executes against a QP of this process, or of another process of
//!   this host mapped here), and RoCEv2 between hosts (a networked device's QPs executed by
//!   the host engine that owns UDP port 4791).
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
pub mod random;
pub(crate) mod sync;
pub(crate) mod transport;
pub mod types;

/// The host engine of networked devices, as programs and the CLI see it.
pub mod engine {
    pub use crate::transport::roce::engine::io::{
        ENV_ENGINE_BATCH, UDP_GRO, UDP_SEGMENT, set_udp_option,
    };
    pub use crate::transport::roce::engine::{
        ENV_ENGINE_CPUS, ENV_ENGINE_EXE, ENV_ENGINE_LOG, ENV_ENGINE_SPIN, serve,
    };
    pub use crate::transport::roce::{
        ENV_PCAP, EngineHold, engine_capture, engine_report, hold_engine,
    };
}

pub use error::{Error, Result};
pub use types::GRH_LEN;
