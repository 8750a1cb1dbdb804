//! Verbs semantics of the software NIC inside one process, through the public API.

mod common;

mod access;
mod atomics;
mod channel;
mod device;
mod dm;
mod errors;
mod flush;
mod multicast;
mod mw;
mod noncontig;
mod odp;
mod ordering;
mod parent_domain;
mod rc;
mod relaxed;
mod srq;
mod state;
mod ud_uc;
mod xrc;
