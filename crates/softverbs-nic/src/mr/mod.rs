//! Memory regions as the data path sees them: checked, pinned, and placed into.
//!
//! - [`keys`]: the key table, one entry per registered region, in a shared segment.
//! - `hazard`: the records through which a requester pins a peer's regions with plain
//!   stores, and the barrier a deregistration sends them.
//! - `access`: the memory accessor, the one place the NIC reads or writes registered memory.
//! - [`ordering`]: strict and relaxed placement, and the ordering check.
//! - [`layout`]: non-contiguous layouts (seed 002), the pure engine: SG, interleaved, page
//!   lists, nesting.
//! - [`store`]: layouts in shared memory, where every process can read them.
//! - `peer`: another process's registered memory, mapped or reached by cross-memory attach.
//! - `resolve`: a work request's SGEs and remote ranges checked, pinned and turned into spans.
//! - `container`: the state a layout container shares, and the device's registry of them.
//! - [`window`]: memory windows (type 1 and 2) in the key table: bind, invalidate.
//!
//! The verbs objects (`Pd::reg_mr`, [`Mr`](crate::pd::Mr)) are in [`crate::pd`].

pub(crate) mod access;
pub(crate) mod container;
pub(crate) mod hazard;
pub mod keys;
pub mod layout;
pub mod ordering;
pub(crate) mod peer;
pub(crate) mod resolve;
pub mod store;
pub mod window;
