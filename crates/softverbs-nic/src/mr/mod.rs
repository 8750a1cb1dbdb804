//! Memory regions as the data path sees them.

pub(crate) mod access;
pub(crate) mod container;
pub mod keys;
pub mod layout;
pub mod ordering;
pub(crate) mod resolve;
pub mod store;
