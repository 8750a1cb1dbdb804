//! The exported `rdma_*` calls, by area: ids and addresses (`id`), connections (`conn`), QPs
//! and SRQs on ids (`qp`), and the `rdma_getaddrinfo` / endpoint helpers (`ep`).

pub mod conn;
pub mod ep;
pub mod id;
pub mod qp;

use crate::set_errno;
use core::ffi::c_int;

/// The verbs way to report a result: 0, or -1 with errno.
pub(crate) fn rc(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}
