//! `rsetsockopt`, `rgetsockopt` and `rfcntl`.
//!
//! Options that shape the connection (`SO_SNDBUF`/`SO_RCVBUF`, `RDMA_SQSIZE`/`RDMA_RQSIZE`)
//! take effect at the next connect or accept; the rest are kept and read back as sockets
//! do, without changing what the transport does (RC is reliable and has no Nagle, so
//! `TCP_NODELAY` and keepalive have nothing to change). Unknown options fail with
//! `ENOPROTOOPT`, unknown levels too, as a TCP socket's.

use super::conn::{SLOT_SIZE, St};
use super::{ret, table};
use crate::abi::{RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, RDMA_OPTION_ID_REUSEADDR};
use core::ffi::{c_int, c_void};

/// `SOL_RDMA` of `<rdma/rsocket.h>` and its options.
pub const SOL_RDMA: c_int = 0x10000;
/// Send slots (messages in flight).
pub const RDMA_SQSIZE: c_int = 0;
/// Receive slots (the window offered to the peer).
pub const RDMA_RQSIZE: c_int = 1;
/// Inline size (kept; softverbs copies every message into a slot anyway).
pub const RDMA_INLINE: c_int = 2;
/// Most iomapped windows (kept).
pub const RDMA_IOMAPSIZE: c_int = 3;
/// A path record for the route (ignored: RoCE routes by GID).
pub const RDMA_ROUTE: c_int = 4;

/// `rsetsockopt`.
///
/// # Safety
/// `optval` is NULL or `optlen` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rsetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *const c_void,
    optlen: libc::socklen_t,
) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        if optval.is_null() && optlen > 0 {
            return Err(libc::EFAULT);
        }
        let int = || -> Result<c_int, c_int> {
            if optval.is_null() || (optlen as usize) < std::mem::size_of::<c_int>() {
                return Err(libc::EINVAL);
            }
            // SAFETY: an int's worth of readable bytes (checked).
            Ok(unsafe { std::ptr::read_unaligned(optval.cast::<c_int>()) })
        };
        let mut g = s.lock();
        let o = &mut g.opts;
        match (level, optname) {
            (libc::SOL_SOCKET, libc::SO_REUSEADDR) => {
                o.reuseaddr = int()? != 0;
                let v: c_int = c_int::from(o.reuseaddr);
                if g.st == St::Init {
                    // SAFETY: our live id and an int option value.
                    unsafe {
                        crate::api::id::sv_rdma_set_option(
                            g.id,
                            RDMA_OPTION_ID,
                            RDMA_OPTION_ID_REUSEADDR,
                            (&v as *const c_int).cast_mut().cast(),
                            std::mem::size_of::<c_int>(),
                        )
                    };
                }
            }
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => o.keepalive = int()? != 0,
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => o.sndbuf = int()?.max(0),
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => o.rcvbuf = int()?.max(0),
            (libc::SOL_SOCKET, libc::SO_LINGER) => {
                if optval.is_null() || (optlen as usize) < std::mem::size_of::<libc::linger>() {
                    return Err(libc::EINVAL);
                }
                // SAFETY: a linger's worth of readable bytes (checked).
                o.linger = unsafe { std::ptr::read_unaligned(optval.cast::<libc::linger>()) };
            }
            (libc::IPPROTO_TCP, libc::TCP_NODELAY) => o.nodelay = int()? != 0,
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => {
                let v = int()?;
                if v <= 0 {
                    return Err(libc::EINVAL);
                }
                o.maxseg = v.min(SLOT_SIZE as c_int);
            }
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => {
                let v = int()?;
                if v <= 0 {
                    return Err(libc::EINVAL);
                }
                o.keepidle = v;
            }
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => {
                o.v6only = int()? != 0;
                let v: c_int = c_int::from(o.v6only);
                if g.st != St::Init {
                    return Err(libc::EINVAL);
                }
                // SAFETY: our live id and an int option value.
                unsafe {
                    crate::api::id::sv_rdma_set_option(
                        g.id,
                        RDMA_OPTION_ID,
                        RDMA_OPTION_ID_AFONLY,
                        (&v as *const c_int).cast_mut().cast(),
                        std::mem::size_of::<c_int>(),
                    )
                };
            }
            (SOL_RDMA, RDMA_SQSIZE) => o.sqsize = int()?.max(0) as u32,
            (SOL_RDMA, RDMA_RQSIZE) => o.rqsize = int()?.max(0) as u32,
            (SOL_RDMA, RDMA_INLINE) => o.inline = int()?.max(0) as u32,
            (SOL_RDMA, RDMA_IOMAPSIZE) => o.iomapsize = int()?.max(0) as u32,
            // Paths do not matter to softverbs devices (RoCE routes by GID), as in
            // `rdma_set_option(RDMA_OPTION_IB_PATH)`; accepted and ignored.
            (SOL_RDMA, RDMA_ROUTE) => {}
            (libc::SOL_SOCKET | libc::IPPROTO_TCP | libc::IPPROTO_IPV6 | SOL_RDMA, _) => {
                return Err(libc::ENOPROTOOPT);
            }
            _ => return Err(libc::ENOPROTOOPT),
        }
        Ok(0)
    })())
}

/// `rgetsockopt`: the values set, `SO_ERROR` (read once), `SO_TYPE`, and the sizes in use.
///
/// # Safety
/// `optval` is `*optlen` writable bytes; `optlen` readable and writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rgetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: *mut libc::socklen_t,
) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        if optval.is_null() || optlen.is_null() {
            return Err(libc::EFAULT);
        }
        // SAFETY: the caller's contract.
        let room = unsafe { *optlen } as usize;
        let mut g = s.lock();
        g.progress();
        let o = g.opts;
        let v: c_int = match (level, optname) {
            (libc::SOL_SOCKET, libc::SO_REUSEADDR) => c_int::from(o.reuseaddr),
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => c_int::from(o.keepalive),
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => o.sndbuf,
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => o.rcvbuf,
            (libc::SOL_SOCKET, libc::SO_ERROR) => std::mem::take(&mut g.so_error),
            (libc::SOL_SOCKET, libc::SO_TYPE) => libc::SOCK_STREAM,
            (libc::SOL_SOCKET, libc::SO_LINGER) => {
                if room < std::mem::size_of::<libc::linger>() {
                    return Err(libc::EINVAL);
                }
                // SAFETY: a linger's worth of writable bytes (checked), and the length.
                unsafe {
                    std::ptr::write_unaligned(optval.cast::<libc::linger>(), o.linger);
                    *optlen = std::mem::size_of::<libc::linger>() as libc::socklen_t;
                }
                return Ok(0);
            }
            (libc::IPPROTO_TCP, libc::TCP_NODELAY) => c_int::from(o.nodelay),
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => o.maxseg,
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => o.keepidle,
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => c_int::from(o.v6only),
            (SOL_RDMA, RDMA_SQSIZE) => o.sqsize as c_int,
            (SOL_RDMA, RDMA_RQSIZE) => o.rqsize as c_int,
            (SOL_RDMA, RDMA_INLINE) => o.inline as c_int,
            (SOL_RDMA, RDMA_IOMAPSIZE) => o.iomapsize as c_int,
            _ => return Err(libc::ENOPROTOOPT),
        };
        if room < std::mem::size_of::<c_int>() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an int's worth of writable bytes (checked), and the length.
        unsafe {
            std::ptr::write_unaligned(optval.cast::<c_int>(), v);
            *optlen = std::mem::size_of::<c_int>() as libc::socklen_t;
        }
        Ok(0)
    })())
}

/// `rfcntl`: `F_GETFL` / `F_SETFL` (`O_NONBLOCK`), `F_GETFD` / `F_SETFD` on the socket's
/// number; other commands are `EINVAL`.
///
/// The C prototype is variadic (`int rfcntl(int, int, ...)`); on the Linux ABIs softverbs
/// builds for (x86-64 System V, AArch64), the first variadic integer argument travels where
/// a third named one would, so this reads it as `arg`.
#[unsafe(no_mangle)]
pub extern "C" fn sv_rfcntl(socket: c_int, cmd: c_int, arg: usize) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        match cmd {
            libc::F_GETFL => Ok(libc::O_RDWR
                | if s.lock().nonblock {
                    libc::O_NONBLOCK
                } else {
                    0
                }),
            libc::F_SETFL => {
                s.lock().nonblock = (arg as c_int) & libc::O_NONBLOCK != 0;
                Ok(0)
            }
            libc::F_GETFD | libc::F_SETFD => {
                // SAFETY: fcntl on the socket's own descriptor.
                let r = unsafe { libc::fcntl(s.fd, cmd, arg as c_int) };
                if r < 0 {
                    Err(std::io::Error::last_os_error()
                        .raw_os_error()
                        .unwrap_or(libc::EIO))
                } else {
                    Ok(r)
                }
            }
            _ => Err(libc::EINVAL),
        }
    })())
}
