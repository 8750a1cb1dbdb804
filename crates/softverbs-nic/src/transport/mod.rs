//! Transports.

pub(crate) mod same_host;
