//! Device memory: what the NIC keeps in shared `memfd` segments, so that any process that maps
//! a segment can act on it.

pub mod doorbell;
pub(crate) mod export;
pub mod ring;
pub mod segment;
