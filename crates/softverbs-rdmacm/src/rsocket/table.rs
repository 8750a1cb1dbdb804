//! The rsocket table: rsocket numbers are real file descriptors (each rsocket's own CM event
//! channel, as rdma-core's are), so they never collide with the program's other files,
//! `rpoll` can mix them with ordinary fds, and a stray `close()` of one hits no other file.

use super::conn::Socket;
use core::ffi::c_int;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

fn table() -> MutexGuard<'static, HashMap<c_int, Arc<Socket>>> {
    static T: OnceLock<Mutex<HashMap<c_int, Arc<Socket>>>> = OnceLock::new();
    T.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The rsocket numbered `fd`, or `EBADF`.
pub fn get(fd: c_int) -> Result<Arc<Socket>, c_int> {
    table().get(&fd).cloned().ok_or(libc::EBADF)
}

/// Whether `fd` is an rsocket.
pub fn is_rsocket(fd: c_int) -> bool {
    table().contains_key(&fd)
}

/// Adds `s` under its number.
pub fn insert(s: Arc<Socket>) {
    table().insert(s.fd, s);
}

/// Takes rsocket `fd` out of the table (its number stays open until the socket is freed).
pub fn remove(fd: c_int) -> Option<Arc<Socket>> {
    table().remove(&fd)
}
