//! (transport: in progress)
