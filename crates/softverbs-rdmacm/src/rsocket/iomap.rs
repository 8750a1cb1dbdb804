//! `riomap`, `riounmap` and `riowrite`: direct placement into a window of the peer's memory.
//!
//! `riomap` registers the program's buffer for remote writes and announces it (offset,
//! address, length, rkey) in an iomap message, which travels in the stream's order; so once
//! the peer has read anything sent after the `riomap`, its `riowrite`s find the window.
//! `riowrite` copies the data into a send slot and RDMA WRITEs it there; the peer's program
//! sees the bytes in its buffer without a call (the softverbs requester places them).

use super::conn::{IOMAP_ACCESS, LocalMap, SETUP_TIMEOUT};
use super::proto::IomapMsg;
use super::{ret, ret_size, table};
use crate::verbs::verbs;
use core::ffi::{c_int, c_void};

/// `riomap`: maps `len` bytes at `buf` for the peer's `riowrite`s at `offset` (-1: this
/// library picks, the buffer's address); only `PROT_WRITE` is offered.
///
/// # Safety
/// `buf` is `len` bytes of the program's memory that stay valid until `riounmap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_riomap(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    prot: c_int,
    _flags: c_int,
    offset: i64,
) -> i64 {
    let r = (|| {
        let s = table::get(socket)?;
        if buf.is_null() || len == 0 || prot & libc::PROT_WRITE == 0 || offset < -1 {
            return Err(libc::EINVAL);
        }
        let v = verbs().ok_or(libc::ENOSYS)?;
        let offset = if offset == -1 {
            buf as u64
        } else {
            offset as u64
        };
        let m = {
            let mut g = s.lock();
            let c = g
                .connected()
                .map_err(|e| if e == libc::EAGAIN { libc::ENOTCONN } else { e })?;
            // SAFETY: the program's buffer (its contract) on our connection's PD.
            let mr = unsafe { (v.reg_mr)(c.pd(), buf, len, IOMAP_ACCESS) };
            if mr.is_null() {
                return Err(libc::ENOMEM);
            }
            c.local_maps.push(LocalMap {
                offset,
                addr: buf as usize,
                len,
                mr,
            });
            IomapMsg {
                offset,
                addr: buf as u64,
                len: len as u64,
                // SAFETY: the MR registered above.
                rkey: unsafe { (*mr).rkey },
            }
        };
        s.run(false, true, Some(SETUP_TIMEOUT), |g| {
            let c = match g.connected() {
                Ok(c) => c,
                Err(e) => return Some(Err(e)),
            };
            if c.gone {
                return Some(Err(libc::EPIPE));
            }
            match c.send_iomap(m) {
                Ok(true) => Some(Ok(())),
                Ok(false) => None,
                Err(e) => Some(Err(e)),
            }
        })?;
        Ok(offset as i64)
    })();
    match r {
        Ok(o) => o,
        Err(e) => {
            crate::set_errno(e);
            -1
        }
    }
}

/// `riounmap`: ends the mapping of `buf` (the registration goes; the peer's writes to it
/// fail from then on).
///
/// # Safety
/// `buf` was mapped with `riomap` on this socket.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_riounmap(socket: c_int, buf: *mut c_void, len: usize) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        let mut g = s.lock();
        let c = g.conn.as_deref_mut().ok_or(libc::EINVAL)?;
        let k = c
            .local_maps
            .iter()
            .position(|m| m.addr == buf as usize && m.len == len)
            .ok_or(libc::EINVAL)?;
        let m = c.local_maps.remove(k);
        if let Some(v) = verbs() {
            // SAFETY: the MR riomap registered, deregistered once.
            unsafe { (v.dereg_mr)(m.mr) };
        }
        Ok(0)
    })())
}

/// `riowrite`: writes `count` bytes into the peer's window at `offset`; a blocking socket
/// takes all of them, a non-blocking one what fits now. A range outside every window the
/// peer mapped is `EINVAL`.
///
/// # Safety
/// `buf` is `count` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_riowrite(
    socket: c_int,
    buf: *const c_void,
    count: usize,
    offset: i64,
    flags: c_int,
) -> isize {
    ret_size((|| {
        let s = table::get(socket)?;
        if buf.is_null() && count > 0 {
            return Err(libc::EFAULT);
        }
        if offset < 0 {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's contract.
        let data = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), count) };
        let dontwait = flags & libc::MSG_DONTWAIT != 0;
        let mut done = 0usize;
        let r = s.run(dontwait, false, None, |g| {
            let c = match g.connected() {
                Ok(c) => c,
                Err(libc::EAGAIN) => return None,
                Err(e) => return Some(Err(e)),
            };
            if c.gone {
                return Some(Err(if c.err != 0 { c.err } else { libc::EPIPE }));
            }
            let at = offset as u64 + done as u64;
            let end = offset as u64 + count as u64;
            let Some(m) = c
                .remote_maps
                .iter()
                .rev()
                .find(|m| at >= m.offset && end <= m.offset + m.len)
                .copied()
            else {
                return Some(Err(libc::EINVAL));
            };
            match c.write_remote(&data[done..], m.addr + (at - m.offset), m.rkey) {
                Ok(n) => done += n,
                Err(e) => return Some(Err(e)),
            }
            (done == count).then_some(Ok(()))
        });
        match r {
            Ok(()) => Ok(done),
            Err(_) if done > 0 => Ok(done),
            Err(e) => Err(e),
        }
    })())
}
