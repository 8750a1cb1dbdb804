//! Device memory: the NIC's queues, rings and tables are plain `#[repr(C)]` data in shared
//! `memfd` segments, so that any process that maps a segment can act on it.
//!
//! - [`segment`]: a range of a mapped `memfd` and the types that may live in one.
//! - [`arena`]: the few `memfd`s the small segments of a process are carved from.
//! - [`ring`]: the bounded lock-free ring of fixed-size slots every queue is built on.
//! - [`doorbell`]: how a waiting program learns that something arrived in shared memory.
//! - `prefetch`: cache hints that start a line's transfer before the data path needs it.
//! - `export`: naming a descriptor in shared memory, and opening another process's.

pub mod arena;
pub mod doorbell;
pub(crate) mod export;
pub(crate) mod prefetch;
pub mod ring;
pub mod segment;
