//! Memory regions as the data path sees them.

pub(crate) mod access;
pub mod keys;
pub mod layout;
pub mod ordering;
pub mod store;
