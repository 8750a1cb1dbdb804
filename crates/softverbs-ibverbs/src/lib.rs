//! A drop-in `libibverbs.so.1`: rdma-core's C ABI (Debian bookworm, rdma-core 44) over the
//! softverbs software NIC, so unmodified C RDMA programs run with no RDMA hardware.
//!
//! - `symbols.txt` lists every entry point of the real library with its symbol version;
//!   `build.rs` turns it into the linker version script, stubs for what is not implemented
//!   (they fail with `ENOSYS`, or return NULL with `errno` set) and the `.symver` bindings.
//! - [`abi`] mirrors the header's structs; each object this library hands out is a
//!   `#[repr(C)]` wrapper whose first field is the C struct, so a C pointer converts back.
//! - The data path (`post_send`, `post_recv`, `poll_cq`, `req_notify_cq`) is reached through
//!   `ibv_context::ops`, and `ibv_query_port`, `ibv_query_device_ex`, `ibv_query_rt_values_ex`,
//!   `ibv_create_cq_ex` and `ibv_create_qp_ex` through `verbs_context`, as the header's static
//!   inline functions expect. Every CQ is an `ibv_cq_ex` and every QP an `ibv_qp_ex`.
//! - Completion channels and `async_fd` are the NIC's doorbell pipes reopened through
//!   `/proc/self/fd` (a new open file description), so `O_NONBLOCK` set by the program
//!   decides whether `ibv_get_cq_event` / `ibv_get_async_event` wait or fail with `EAGAIN`.
//! - softverbs' own extensions (`include/softverbs/verbs_ext.h`: the seed's `ibv_poll_cq_ex`
//!   and its compact records) are in `ext`, and seed 002's non-contiguous memory regions
//!   (`ibv_mr_set_layout_sg`, `ibv_mr_set_layout_interleaved`, `ibv_query_mr_layout_caps`)
//!   in `mrlayout`, all exported under the `SOFTVERBS_1.0` version. rdma-core's pure rate
//!   conversions are in `rates`.
//!
//! Every `unsafe` block dereferences pointers that the C caller passed and the verbs API
//! requires to be valid; each says so in its `// SAFETY:` line.

#![allow(clippy::missing_safety_doc, non_snake_case)]

mod abi;
mod ext;
mod inplace;
mod maps;
mod mrlayout;
mod rates;
mod sysfs;
mod verbs;

include!(concat!(env!("OUT_DIR"), "/stubs.rs"));

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: core::ffi::c_int) {
    // SAFETY: `__errno_location` returns this thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e }
}
