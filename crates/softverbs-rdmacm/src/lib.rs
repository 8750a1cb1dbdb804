//! A drop-in `librdmacm.so.1`: rdma-core's connection manager (Debian bookworm, rdma-core
//! 44) over softverbs devices, so unmodified programs that connect with `rdma_cm` (rping,
//! perftest's `-R`, qperf's `-cm1`, UCX, libfabric) run with no RDMA hardware.
//!
//! - `symbols.txt` lists every entry point of the real library with its version;
//!   `build.rs` makes the linker version script and `ENOSYS` stubs for what is not here.
//! - [`abi`] mirrors `<rdma/rdma_cma.h>`; the verbs structs are the drop-in libibverbs' own
//!   (`ibv`). The verbs themselves are called through the program's `libibverbs.so.1`,
//!   looked up at run time ([`verbs`]).
//! - [`device`] maps IP addresses to devices by their GID tables, [`cm`] holds every id and
//!   runs the IBTA CM protocol ([`mad`]) through the sockets of [`wire`], and [`api`] and
//!   [`channel`] are the exported calls.
//! - [`rsocket`] is the rsocket API (`<rdma/rsocket.h>`): stream sockets over RC
//!   connections of this CM.
//!
//! Every `unsafe` block dereferences pointers that the C caller passed and the API requires
//! to be valid, or calls libibverbs or libc; each says which in its `// SAFETY:` line.

#![allow(clippy::missing_safety_doc)]

pub mod abi;
pub mod addr;
pub mod api;
pub mod channel;
pub mod cm;
pub mod device;
#[path = "../../softverbs-ibverbs/src/abi.rs"]
pub mod ibv;
pub mod mad;
pub mod rsocket;
pub mod verbs;
pub mod wire;

include!(concat!(env!("OUT_DIR"), "/stubs.rs"));

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: core::ffi::c_int) {
    // SAFETY: `__errno_location` returns this thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e }
}
