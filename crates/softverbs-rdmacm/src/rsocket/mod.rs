//! rsockets (`<rdma/rsocket.h>`): stream sockets over RC connections that this library's
//! connection manager sets up, with the calls and errors of BSD sockets.
//!
//! - [`table`]: rsocket numbers (real fds: each socket's CM event channel) to sockets.
//! - [`proto`]: the stream protocol between two softverbs rsockets (SEND with immediate
//!   into posted receive slots, with credits); not rdma-core's wire format, so a softverbs
//!   rsocket talks only to another softverbs rsocket.
//! - [`conn`]: a socket, its connection's verbs resources, and waiting.
//! - this module: socket, bind, listen, accept, connect, shutdown, close, the data calls,
//!   and the address calls; [`poll`]: `rpoll` and `rselect`; [`opts`]: `rsetsockopt`,
//!   `rgetsockopt`, `rfcntl`; [`iomap`]: `riomap`, `riounmap`, `riowrite`.
//!
//! Datagram rsockets (`SOCK_DGRAM`) are not offered: `rsocket` fails with `EOPNOTSUPP`.

pub mod conn;
pub mod iomap;
pub mod opts;
pub mod poll;
pub mod proto;
pub mod table;

use crate::abi::*;
use crate::addr;
use crate::set_errno;
use conn::{Conn, SETUP_TIMEOUT, Socket, St, wait_cm};
use core::ffi::{c_int, c_void};
use proto::{Flow, Hello};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// `AF_IB`, which softverbs does not route.
const AF_IB: c_int = 27;

/// An int call's result: the value, or -1 with errno.
fn ret(r: Result<c_int, c_int>) -> c_int {
    r.unwrap_or_else(|e| {
        set_errno(e);
        -1
    })
}

/// A size call's result: the count, or -1 with errno.
fn ret_size(r: Result<usize, c_int>) -> isize {
    match r {
        Ok(n) => n as isize,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

/// A socket address argument, checked as `bind(2)` checks it.
///
/// # Safety
/// `sa` is NULL or `len` readable bytes.
unsafe fn sockaddr_arg(
    sa: *const libc::sockaddr,
    len: libc::socklen_t,
) -> Result<SocketAddr, c_int> {
    if sa.is_null() {
        return Err(libc::EFAULT);
    }
    if (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: at least the family is readable (checked above).
    let family = c_int::from(unsafe { (*sa).sa_family });
    let need = match family {
        libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
        _ => return Err(libc::EAFNOSUPPORT),
    };
    if (len as usize) < need {
        return Err(libc::EINVAL);
    }
    // SAFETY: `need` readable bytes of a known family.
    unsafe { addr::from_c(sa) }.ok_or(libc::EAFNOSUPPORT)
}

/// Writes `a` to a `(addr, addrlen)` out-pair as `getsockname(2)` does (truncating).
///
/// # Safety
/// `sa` is NULL or `*len` writable bytes; `len` NULL or a readable, writable length.
unsafe fn write_sockaddr(
    a: Option<SocketAddr>,
    sa: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> Result<(), c_int> {
    if sa.is_null() || len.is_null() {
        return if sa.is_null() && len.is_null() {
            Ok(())
        } else {
            Err(libc::EFAULT)
        };
    }
    let (st, n) = match a {
        Some(a) => addr::to_c(a),
        None => (sockaddr_storage { bytes: [0; 128] }, 0),
    };
    // SAFETY: the caller's contract.
    unsafe {
        let room = *len as usize;
        std::ptr::copy_nonoverlapping(st.bytes.as_ptr(), sa.cast::<u8>(), room.min(n as usize));
        *len = n;
    }
    Ok(())
}

/// The id's source or destination address.
fn id_addr(id: *mut rdma_cm_id, src: bool) -> Option<SocketAddr> {
    if id.is_null() {
        return None;
    }
    // SAFETY: a live id of a socket, whose route the CM writes under its own calls.
    let st = unsafe {
        if src {
            (*id).route.addr.src
        } else {
            (*id).route.addr.dst
        }
    };
    addr::from_storage(&st)
}

/// `rsocket`: `AF_INET`/`AF_INET6` stream sockets (`SOCK_NONBLOCK` and `SOCK_CLOEXEC`
/// accepted); datagram sockets are `EOPNOTSUPP`.
#[unsafe(no_mangle)]
pub extern "C" fn sv_rsocket(domain: c_int, type_: c_int, protocol: c_int) -> c_int {
    ret((|| {
        match domain {
            libc::AF_INET | libc::AF_INET6 => {}
            AF_IB => return Err(libc::EAFNOSUPPORT),
            _ => return Err(libc::EAFNOSUPPORT),
        }
        let kind = type_ & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
        match kind {
            libc::SOCK_STREAM => {}
            libc::SOCK_DGRAM => return Err(libc::EOPNOTSUPP),
            _ => return Err(libc::ESOCKTNOSUPPORT),
        }
        if protocol != 0 && protocol != libc::IPPROTO_TCP {
            return Err(libc::EPROTONOSUPPORT);
        }
        let ch = crate::channel::sv_rdma_create_event_channel();
        if ch.is_null() {
            return Err(libc::ENOMEM);
        }
        let mut id = std::ptr::null_mut();
        // SAFETY: our new channel and a writable out-pointer.
        if unsafe {
            crate::api::id::sv_rdma_create_id(ch, &mut id, std::ptr::null_mut(), RDMA_PS_TCP)
        } != 0
        {
            let e = last_errno();
            // SAFETY: the channel made above, with no ids.
            unsafe { crate::channel::sv_rdma_destroy_event_channel(ch) };
            return Err(e);
        }
        // SAFETY: the channel and the id on it made above, now the socket's.
        let s = Arc::new(unsafe { Socket::new(ch, id, domain) });
        s.lock().nonblock = type_ & libc::SOCK_NONBLOCK != 0;
        let fd = s.fd;
        table::insert(s);
        Ok(fd)
    })())
}

fn last_errno() -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// `rbind`.
///
/// # Safety
/// `addr` is NULL or `addrlen` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rbind(
    socket: c_int,
    addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        // SAFETY: the caller's contract.
        let a = unsafe { sockaddr_arg(addr, addrlen) }?;
        let mut g = s.lock();
        if g.st != St::Init {
            return Err(libc::EINVAL);
        }
        let (mut st, _) = addr::to_c(a);
        // SAFETY: our live id and an address in a storage of 128 bytes.
        if unsafe { crate::api::id::sv_rdma_bind_addr(g.id, st.bytes.as_mut_ptr().cast()) } != 0 {
            return Err(last_errno());
        }
        g.st = St::Bound;
        Ok(0)
    })())
}

/// `rlisten`: binds to the wildcard address of the socket's family first if unbound.
#[unsafe(no_mangle)]
pub extern "C" fn sv_rlisten(socket: c_int, backlog: c_int) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        let mut g = s.lock();
        match g.st {
            St::Init => {
                let any: SocketAddr = if g.family == libc::AF_INET6 {
                    "[::]:0".parse().map_err(|_| libc::EINVAL)?
                } else {
                    "0.0.0.0:0".parse().map_err(|_| libc::EINVAL)?
                };
                let (mut st, _) = addr::to_c(any);
                // SAFETY: our live id and an address in 128 bytes of storage.
                if unsafe { crate::api::id::sv_rdma_bind_addr(g.id, st.bytes.as_mut_ptr().cast()) }
                    != 0
                {
                    return Err(last_errno());
                }
            }
            St::Bound | St::Listen => {}
            _ => return Err(libc::EINVAL),
        }
        // SAFETY: our live, bound id.
        if unsafe { crate::api::id::sv_rdma_listen(g.id, backlog.max(1)) } != 0 {
            return Err(last_errno());
        }
        g.st = St::Listen;
        Ok(0)
    })())
}

fn conn_param(private: &[u8]) -> rdma_conn_param {
    rdma_conn_param {
        private_data: private.as_ptr().cast(),
        private_data_len: private.len() as u8,
        responder_resources: 1,
        initiator_depth: 1,
        flow_control: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        srq: 0,
        qp_num: 0,
    }
}

/// `raccept`: the next connection request, accepted; the new socket is connected when this
/// returns (it waits for the handshake, which softverbs completes locally). The new socket
/// inherits the listener's options but not `O_NONBLOCK`, as with TCP.
///
/// # Safety
/// `addr` and `addrlen` as for `accept(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_raccept(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        let (family, opts) = {
            let g = s.lock();
            if g.st != St::Listen {
                return Err(libc::EINVAL);
            }
            (g.family, g.opts)
        };
        let (new_id, data) = s.run(false, false, None, |g| {
            if g.st != St::Listen {
                return Some(Err(libc::EINVAL));
            }
            loop {
                let mut ev = std::ptr::null_mut();
                // SAFETY: the listener's channel (non-blocking) and an out-pointer.
                if unsafe { crate::channel::sv_rdma_get_cm_event(g.channel, &mut ev) } != 0 {
                    return None;
                }
                // SAFETY: a live event until acked.
                let got = unsafe {
                    let e = &*ev;
                    (e.event == RDMA_CM_EVENT_CONNECT_REQUEST).then(|| {
                        let p = e.param.conn;
                        let data = if p.private_data.is_null() {
                            Vec::new()
                        } else {
                            std::slice::from_raw_parts(
                                p.private_data as *const u8,
                                p.private_data_len as usize,
                            )
                            .to_vec()
                        };
                        (e.id, data)
                    })
                };
                // SAFETY: acked once.
                unsafe { crate::channel::sv_rdma_ack_cm_event(ev) };
                if let Some(x) = got {
                    return Some(Ok(x));
                }
            }
        })?;
        let reject = |e: c_int| {
            // SAFETY: the request's id, refused and freed once.
            unsafe {
                crate::api::conn::sv_rdma_reject(new_id, std::ptr::null(), 0);
                crate::api::id::sv_rdma_destroy_id(new_id);
            }
            Err(e)
        };
        let peer = match Hello::parse(&data) {
            Some(h) if h.slot_size as usize == conn::SLOT_SIZE => h,
            _ => return reject(libc::ECONNABORTED),
        };
        let ch = crate::channel::sv_rdma_create_event_channel();
        if ch.is_null() {
            return reject(libc::ENOMEM);
        }
        // SAFETY: the request's id and our new channel.
        if unsafe { crate::api::id::sv_rdma_migrate_id(new_id, ch) } != 0 {
            let e = last_errno();
            // SAFETY: the channel made above; the id stays on the listener's.
            unsafe { crate::channel::sv_rdma_destroy_event_channel(ch) };
            return reject(e);
        }
        // SAFETY: the new channel and the request's id, migrated onto it; the socket's now.
        let ns = Arc::new(unsafe { Socket::new(ch, new_id, family) });
        let setup = (|| {
            let mut g = ns.lock();
            g.opts = opts;
            // SAFETY: the request's live id, without a QP.
            let mut c: Box<Conn> = unsafe { Conn::new(new_id, &opts) }?;
            c.flow = Flow::new(c.nrecv, peer.slots);
            let hello = conn::hello(&c);
            let mut p = conn_param(&hello);
            g.conn = Some(c);
            g.st = St::Connecting;
            // SAFETY: the request's id with its QP, and parameters that live across the call.
            if unsafe { crate::api::conn::sv_rdma_accept(new_id, &mut p) } != 0 {
                return Err(last_errno());
            }
            drop(g);
            ns.run(false, true, Some(SETUP_TIMEOUT), |g| match g.st {
                St::Connected => Some(Ok(())),
                St::Failed => Some(Err(std::mem::take(&mut g.so_error))),
                _ => None,
            })
        })();
        if let Err(e) = setup {
            let mut g = ns.lock();
            g.teardown();
            // SAFETY: the socket's channel, with its id gone.
            unsafe { crate::channel::sv_rdma_destroy_event_channel(g.channel) };
            return Err(e);
        }
        let peer_addr = id_addr(new_id, false);
        table::insert(ns.clone());
        // SAFETY: the caller's contract.
        unsafe { write_sockaddr(peer_addr, addr, addrlen) }?;
        Ok(ns.fd)
    })())
}

/// `rconnect`: resolves the address and route, sends the REQ; a blocking socket waits for
/// the connection, a non-blocking one fails with `EINPROGRESS` (`rpoll` for `POLLOUT`,
/// then `SO_ERROR`).
///
/// # Safety
/// `addr` is NULL or `addrlen` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rconnect(
    socket: c_int,
    addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        // SAFETY: the caller's contract.
        let dst = unsafe { sockaddr_arg(addr, addrlen) }?;
        let mut g = s.lock();
        match g.st {
            St::Init | St::Bound => {}
            St::Connecting => return Err(libc::EALREADY),
            St::Connected => return Err(libc::EISCONN),
            St::Listen | St::Failed => return Err(libc::EINVAL),
        }
        let (mut st, _) = addr::to_c(dst);
        // SAFETY: our live id and an address in 128 bytes of storage.
        if unsafe {
            crate::api::id::sv_rdma_resolve_addr(
                g.id,
                std::ptr::null_mut(),
                st.bytes.as_mut_ptr().cast(),
                2000,
            )
        } != 0
        {
            return Err(last_errno());
        }
        // SAFETY: the socket's live, non-blocking channel.
        unsafe { wait_cm(g.channel, RDMA_CM_EVENT_ADDR_RESOLVED, SETUP_TIMEOUT) }?;
        // SAFETY: our live id, its address resolved.
        if unsafe { crate::api::id::sv_rdma_resolve_route(g.id, 2000) } != 0 {
            return Err(last_errno());
        }
        // SAFETY: as above.
        unsafe { wait_cm(g.channel, RDMA_CM_EVENT_ROUTE_RESOLVED, SETUP_TIMEOUT) }?;
        // SAFETY: the socket's live id, without a QP (it is not connected yet).
        let c = unsafe { Conn::new(g.id, &g.opts) }?;
        let hello = conn::hello(&c);
        let mut p = conn_param(&hello);
        g.conn = Some(c);
        // SAFETY: our id with its QP, and parameters that live across the call.
        if unsafe { crate::api::conn::sv_rdma_connect(g.id, &mut p) } != 0 {
            let e = last_errno();
            if let Some(mut c) = g.conn.take() {
                // SAFETY: the socket's id, which the connection was made on.
                unsafe { c.free(g.id) };
            }
            return Err(e);
        }
        g.st = St::Connecting;
        if g.nonblock {
            return Err(libc::EINPROGRESS);
        }
        drop(g);
        s.run(false, false, Some(SETUP_TIMEOUT), |g| match g.st {
            St::Connected => Some(Ok(0)),
            St::Failed => Some(Err(std::mem::take(&mut g.so_error))),
            _ => None,
        })
    })())
}

/// How long shutdown and close wait for the FIN to go out (the peer must hand back a
/// credit if it had none left for it): `SO_LINGER`'s time if set, else this.
const FIN_WAIT: Duration = Duration::from_secs(2);

/// Queues the FIN and waits (bounded) until it and every send before it completed.
fn send_fin(s: &Socket) -> Result<(), c_int> {
    let limit = {
        let mut g = s.lock();
        let l = g.opts.linger;
        let c = g.connected()?;
        c.fin_pending = true;
        if l.l_onoff != 0 {
            Duration::from_secs(l.l_linger.max(0) as u64)
        } else {
            FIN_WAIT
        }
    };
    let r = s.run(false, true, Some(limit), |g| {
        let c = g.conn.as_deref()?;
        (c.gone || (c.fin_sent && c.sends_done())).then_some(Ok(()))
    });
    match r {
        Err(libc::ETIMEDOUT) => Ok(()),
        r => r,
    }
}

/// `rshutdown`: `SHUT_RD` ends reading; `SHUT_WR` (and `SHUT_RDWR`) sends the FIN, after
/// which the peer's reads return 0 once they have taken what came before it.
#[unsafe(no_mangle)]
pub extern "C" fn sv_rshutdown(socket: c_int, how: c_int) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        if !matches!(how, libc::SHUT_RD | libc::SHUT_WR | libc::SHUT_RDWR) {
            return Err(libc::EINVAL);
        }
        s.lock().connected()?;
        if how != libc::SHUT_WR {
            s.lock().shut_rd = true;
        }
        if how != libc::SHUT_RD {
            send_fin(&s)?;
        }
        Ok(0)
    })())
}

/// `rclose`: sends the FIN if it has not gone (bounded wait), disconnects and frees the
/// socket; its number is closed.
#[unsafe(no_mangle)]
pub extern "C" fn sv_rclose(socket: c_int) -> c_int {
    ret((|| {
        let s = table::remove(socket).ok_or(libc::EBADF)?;
        let connected = s.lock().connected().is_ok_and(|c| !c.gone);
        if connected {
            let _ = send_fin(&s);
        }
        let mut g = s.lock();
        if connected {
            // SAFETY: our live, connected id.
            unsafe { crate::api::conn::sv_rdma_disconnect(g.id) };
        }
        g.teardown();
        // SAFETY: the socket's channel, its id destroyed; this closes the socket's number.
        unsafe { crate::channel::sv_rdma_destroy_event_channel(g.channel) };
        g.channel = std::ptr::null_mut();
        s.wake_all();
        Ok(0)
    })())
}

/// Reads into the `bufs`, as `recvmsg(2)` on a stream: blocks (unless non-blocking or
/// `MSG_DONTWAIT`) until some bytes or the end of the stream; `MSG_WAITALL` waits for all;
/// `MSG_PEEK` leaves them.
///
/// # Safety
/// Each `(ptr, len)` is writable.
unsafe fn recv_bufs(
    socket: c_int,
    bufs: &[(*mut u8, usize)],
    flags: c_int,
) -> Result<usize, c_int> {
    let s = table::get(socket)?;
    let total: usize = bufs.iter().map(|b| b.1).sum();
    if bufs.iter().any(|b| b.0.is_null() && b.1 > 0) {
        return Err(libc::EFAULT);
    }
    let peek = flags & libc::MSG_PEEK != 0;
    let waitall = flags & libc::MSG_WAITALL != 0 && !peek;
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let mut got = 0usize;
    let r = s.run(dontwait, false, None, |g| {
        if g.shut_rd {
            return Some(Ok(()));
        }
        let c = match g.connected() {
            Ok(c) => c,
            Err(libc::EAGAIN) => return None,
            Err(e) => return Some(Err(e)),
        };
        if peek {
            // Peeking starts at the front each time: copy what is there, then scatter it.
            let mut tmp = vec![0u8; total.min(c.pending())];
            got = c.recv(&mut tmp, true);
            let mut at = 0;
            for &(p, len) in bufs {
                let n = len.min(got - at);
                // SAFETY: `n` bytes into the caller's writable buffer.
                unsafe { std::ptr::copy_nonoverlapping(tmp[at..].as_ptr(), p, n) };
                at += n;
            }
            if got == 0 && c.gone && c.err != 0 {
                return Some(Err(c.err));
            }
            return (got > 0 || c.peer_fin || c.gone).then_some(Ok(()));
        }
        // Fill the buffers in order from where the last try stopped.
        let mut skip = got;
        for &(p, len) in bufs {
            if skip >= len {
                skip -= len;
                continue;
            }
            // SAFETY: the caller's writable buffer, from `skip` on.
            let out = unsafe { std::slice::from_raw_parts_mut(p.add(skip), len - skip) };
            let n = c.recv(out, peek);
            got += n;
            skip = 0;
            if n < out.len() {
                break;
            }
        }
        if got == total || (got > 0 && !waitall) {
            return Some(Ok(()));
        }
        if c.pending() == 0 && (c.peer_fin || c.gone) {
            return Some(if got > 0 || c.err == 0 {
                Ok(())
            } else {
                Err(c.err)
            });
        }
        None
    });
    match r {
        Ok(()) => Ok(got),
        Err(_) if got > 0 => Ok(got),
        Err(e) => Err(e),
    }
}

/// Writes the `bufs`, as `sendmsg(2)` on a stream: a blocking socket takes all of them, a
/// non-blocking one what fits (`EAGAIN` if nothing does). After `SHUT_WR` or a lost
/// connection, `EPIPE`.
///
/// # Safety
/// Each `(ptr, len)` is readable.
unsafe fn send_bufs(
    socket: c_int,
    bufs: &[(*const u8, usize)],
    flags: c_int,
) -> Result<usize, c_int> {
    let s = table::get(socket)?;
    let total: usize = bufs.iter().map(|b| b.1).sum();
    if bufs.iter().any(|b| b.0.is_null() && b.1 > 0) {
        return Err(libc::EFAULT);
    }
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let mut sent = 0usize;
    let r = s.run(dontwait, false, None, |g| {
        let c = match g.connected() {
            Ok(c) => c,
            Err(libc::EAGAIN) => return None,
            Err(e) => return Some(Err(e)),
        };
        if c.gone || c.fin_pending {
            return Some(Err(if c.err != 0 { c.err } else { libc::EPIPE }));
        }
        let mut skip = sent;
        for &(p, len) in bufs {
            if skip >= len {
                skip -= len;
                continue;
            }
            // SAFETY: the caller's readable buffer, from `skip` on.
            let data = unsafe { std::slice::from_raw_parts(p.add(skip), len - skip) };
            match c.send(data) {
                Ok(n) => {
                    sent += n;
                    if n < data.len() {
                        break;
                    }
                }
                Err(e) => return Some(Err(e)),
            }
            skip = 0;
        }
        (sent == total).then_some(Ok(()))
    });
    match r {
        Ok(()) => Ok(sent),
        Err(_) if sent > 0 => Ok(sent),
        Err(e) => Err(e),
    }
}

/// The `(ptr, len)` pairs of an iovec array.
///
/// # Safety
/// `iov` is NULL or `n` readable iovecs.
unsafe fn iovecs(iov: *const libc::iovec, n: c_int) -> Result<Vec<(*mut u8, usize)>, c_int> {
    if !(0..=libc::UIO_MAXIOV).contains(&n) {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    if iov.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the caller's contract.
    let v = unsafe { std::slice::from_raw_parts(iov, n as usize) };
    Ok(v.iter()
        .map(|i| (i.iov_base.cast::<u8>(), i.iov_len))
        .collect())
}

fn consts(v: Vec<(*mut u8, usize)>) -> Vec<(*const u8, usize)> {
    v.into_iter().map(|(p, l)| (p.cast_const(), l)).collect()
}

/// `rrecv`.
///
/// # Safety
/// `buf` is `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rrecv(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
) -> isize {
    // SAFETY: the caller's contract.
    ret_size(unsafe { recv_bufs(socket, &[(buf.cast(), len)], flags) })
}

/// `rread`.
///
/// # Safety
/// `buf` is `count` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rread(socket: c_int, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: the caller's contract.
    ret_size(unsafe { recv_bufs(socket, &[(buf.cast(), count)], 0) })
}

/// `rreadv`.
///
/// # Safety
/// `iov` is `iovcnt` iovecs of writable buffers.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rreadv(socket: c_int, iov: *const libc::iovec, iovcnt: c_int) -> isize {
    // SAFETY: the caller's contract.
    ret_size(unsafe { iovecs(iov, iovcnt) }.and_then(|b| unsafe { recv_bufs(socket, &b, 0) }))
}

/// `rrecvfrom`: `rrecv`, with the peer's address if asked.
///
/// # Safety
/// `buf` is `len` writable bytes; `src_addr`/`addrlen` as for `recvfrom(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rrecvfrom(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    src_addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> isize {
    // SAFETY: the caller's contract.
    let r = unsafe { recv_bufs(socket, &[(buf.cast(), len)], flags) };
    if r.is_ok() && !src_addr.is_null() {
        let peer = table::get(socket)
            .ok()
            .and_then(|s| id_addr(s.lock().id, false));
        // SAFETY: the caller's contract.
        if let Err(e) = unsafe { write_sockaddr(peer, src_addr, addrlen) } {
            return ret_size(Err(e));
        }
    }
    ret_size(r)
}

/// `rrecvmsg`: the iovecs of `msg`; no ancillary data (`msg_controllen` set to 0).
///
/// # Safety
/// `msg` is a readable and writable `msghdr` with valid iovecs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rrecvmsg(socket: c_int, msg: *mut libc::msghdr, flags: c_int) -> isize {
    if msg.is_null() {
        return ret_size(Err(libc::EFAULT));
    }
    // SAFETY: the caller's contract.
    let m = unsafe { &mut *msg };
    // SAFETY: as above.
    let r = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) }
        .and_then(|b| unsafe { recv_bufs(socket, &b, flags) });
    if r.is_ok() {
        m.msg_controllen = 0;
        m.msg_flags = 0;
        if !m.msg_name.is_null() {
            let peer = table::get(socket)
                .ok()
                .and_then(|s| id_addr(s.lock().id, false));
            // SAFETY: the caller's name buffer of `msg_namelen` bytes.
            let _ = unsafe { write_sockaddr(peer, m.msg_name.cast(), &mut m.msg_namelen) };
        }
    }
    ret_size(r)
}

/// `rsend`.
///
/// # Safety
/// `buf` is `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rsend(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
) -> isize {
    // SAFETY: the caller's contract.
    ret_size(unsafe { send_bufs(socket, &[(buf.cast(), len)], flags) })
}

/// `rwrite`.
///
/// # Safety
/// `buf` is `count` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rwrite(socket: c_int, buf: *const c_void, count: usize) -> isize {
    // SAFETY: the caller's contract.
    ret_size(unsafe { send_bufs(socket, &[(buf.cast(), count)], 0) })
}

/// `rwritev`.
///
/// # Safety
/// `iov` is `iovcnt` iovecs of readable buffers.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rwritev(
    socket: c_int,
    iov: *const libc::iovec,
    iovcnt: c_int,
) -> isize {
    // SAFETY: the caller's contract.
    ret_size(
        unsafe { iovecs(iov, iovcnt) }.and_then(|b| unsafe { send_bufs(socket, &consts(b), 0) }),
    )
}

/// `rsendto`: on a stream socket a destination is `EISCONN`, as rdma-core's.
///
/// # Safety
/// `buf` is `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rsendto(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    dest_addr: *const libc::sockaddr,
    addrlen: libc::socklen_t,
) -> isize {
    if !dest_addr.is_null() || addrlen != 0 {
        if table::get(socket).is_err() {
            return ret_size(Err(libc::EBADF));
        }
        return ret_size(Err(libc::EISCONN));
    }
    // SAFETY: the caller's contract.
    ret_size(unsafe { send_bufs(socket, &[(buf.cast(), len)], flags) })
}

/// `rsendmsg`: the iovecs of `msg` (a name is `EISCONN`; ancillary data is ignored).
///
/// # Safety
/// `msg` is a readable `msghdr` with valid iovecs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rsendmsg(
    socket: c_int,
    msg: *const libc::msghdr,
    flags: c_int,
) -> isize {
    if msg.is_null() {
        return ret_size(Err(libc::EFAULT));
    }
    // SAFETY: the caller's contract.
    let m = unsafe { &*msg };
    if !m.msg_name.is_null() {
        return ret_size(Err(libc::EISCONN));
    }
    // SAFETY: as above.
    ret_size(
        unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) }
            .and_then(|b| unsafe { send_bufs(socket, &consts(b), flags) }),
    )
}

/// `rgetpeername`.
///
/// # Safety
/// `addr`/`addrlen` as for `getpeername(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rgetpeername(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        let peer = {
            let g = s.lock();
            if !matches!(g.st, St::Connected) {
                return Err(libc::ENOTCONN);
            }
            id_addr(g.id, false)
        };
        if addr.is_null() || addrlen.is_null() {
            return Err(libc::EFAULT);
        }
        // SAFETY: the caller's contract.
        unsafe { write_sockaddr(peer, addr, addrlen) }?;
        Ok(0)
    })())
}

/// `rgetsockname`: the bound (or, before bind, the unspecified) address.
///
/// # Safety
/// `addr`/`addrlen` as for `getsockname(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rgetsockname(
    socket: c_int,
    addr: *mut libc::sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    ret((|| {
        let s = table::get(socket)?;
        let (local, family) = {
            let g = s.lock();
            (id_addr(g.id, true), g.family)
        };
        let local = local.or_else(|| {
            if family == libc::AF_INET6 {
                "[::]:0".parse().ok()
            } else {
                "0.0.0.0:0".parse().ok()
            }
        });
        if addr.is_null() || addrlen.is_null() {
            return Err(libc::EFAULT);
        }
        // SAFETY: the caller's contract.
        unsafe { write_sockaddr(local, addr, addrlen) }?;
        Ok(0)
    })())
}

#[cfg(test)]
mod tests {
    //! The calls' argument checks and `rpoll`/`rselect` over ordinary fds; these need no
    //! device. Connections are exercised by rstream and riostream in
    //! `crates/softverbs-cli/tests/rsocket_tools.rs`.

    use super::*;
    use crate::rsocket::opts::{sv_rfcntl, sv_rgetsockopt, sv_rsetsockopt};
    use crate::rsocket::poll::{sv_rpoll, sv_rselect};

    fn errno() -> c_int {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    /// A descriptor that is certainly not an rsocket: a fresh pipe's read end.
    fn pipe() -> (c_int, c_int) {
        let mut fds = [0; 2];
        // SAFETY: pipe fills the array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        (fds[0], fds[1])
    }

    #[test]
    fn unknown_families_and_types_are_refused_before_any_device_is_touched() {
        assert_eq!(sv_rsocket(libc::AF_UNIX, libc::SOCK_STREAM, 0), -1);
        assert_eq!(errno(), libc::EAFNOSUPPORT);
        assert_eq!(sv_rsocket(libc::AF_INET, libc::SOCK_DGRAM, 0), -1);
        assert_eq!(errno(), libc::EOPNOTSUPP);
        assert_eq!(sv_rsocket(libc::AF_INET, libc::SOCK_RAW, 0), -1);
        assert_eq!(errno(), libc::ESOCKTNOSUPPORT);
        assert_eq!(
            sv_rsocket(libc::AF_INET, libc::SOCK_STREAM, libc::IPPROTO_UDP),
            -1
        );
        assert_eq!(errno(), libc::EPROTONOSUPPORT);
    }

    #[test]
    fn calls_on_what_is_not_an_rsocket_are_ebadf() {
        let (r, w) = pipe();
        let mut b = [0u8; 4];
        let mut len: libc::socklen_t = 4;
        // SAFETY: every pointer is to live local memory; the fds are not rsockets.
        unsafe {
            for fd in [-1, r, 12345] {
                assert_eq!(sv_rrecv(fd, b.as_mut_ptr().cast(), 4, 0), -1);
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(sv_rsend(fd, b.as_ptr().cast(), 4, 0), -1);
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(sv_rclose(fd), -1);
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(sv_rshutdown(fd, libc::SHUT_RDWR), -1);
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(sv_rlisten(fd, 1), -1);
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(sv_rfcntl(fd, libc::F_GETFL, 0), -1);
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(
                    sv_rsetsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, b.as_ptr().cast(), 4),
                    -1
                );
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(
                    sv_rgetsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        b.as_mut_ptr().cast(),
                        &mut len
                    ),
                    -1
                );
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(sv_rgetpeername(fd, b.as_mut_ptr().cast(), &mut len), -1);
                assert_eq!(errno(), libc::EBADF);
                assert_eq!(iomap::sv_riowrite(fd, b.as_ptr().cast(), 4, 0, 0), -1);
                assert_eq!(errno(), libc::EBADF);
            }
            // The pipe is untouched by all that.
            assert_eq!(libc::write(w, b"x".as_ptr().cast(), 1), 1);
            assert_eq!(libc::read(r, b.as_mut_ptr().cast(), 4), 1);
            libc::close(r);
            libc::close(w);
        }
    }

    #[test]
    fn bad_addresses_are_efault_or_einval() {
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr { s_addr: 0 },
            sin_zero: [0; 8],
        };
        let unix = libc::sockaddr {
            sa_family: libc::AF_UNIX as libc::sa_family_t,
            sa_data: [0; 14],
        };
        // SAFETY: NULL or live local addresses with the lengths given.
        unsafe {
            assert_eq!(sockaddr_arg(std::ptr::null(), 16), Err(libc::EFAULT));
            let p = (&sin as *const libc::sockaddr_in).cast::<libc::sockaddr>();
            assert_eq!(sockaddr_arg(p, 8), Err(libc::EINVAL));
            assert!(sockaddr_arg(p, 16).is_ok());
            assert_eq!(sockaddr_arg(&unix, 16), Err(libc::EAFNOSUPPORT));
            assert_eq!(iovecs(std::ptr::null(), 2), Err(libc::EFAULT));
            assert_eq!(iovecs(std::ptr::null(), -1), Err(libc::EINVAL));
        }
    }

    #[test]
    fn rpoll_and_rselect_work_on_ordinary_fds_and_time_out() {
        let (r, w) = pipe();
        let mut p = [libc::pollfd {
            fd: r,
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: live pollfds, fd_sets and timevals; our pipe.
        unsafe {
            let t = std::time::Instant::now();
            assert_eq!(sv_rpoll(p.as_mut_ptr(), 1, 120), 0);
            let waited = t.elapsed();
            assert!(waited >= Duration::from_millis(110), "{waited:?}");
            assert_eq!(libc::write(w, b"x".as_ptr().cast(), 1), 1);
            assert_eq!(sv_rpoll(p.as_mut_ptr(), 1, -1), 1);
            assert_eq!(p[0].revents, libc::POLLIN);
            let mut set: libc::fd_set = std::mem::zeroed();
            libc::FD_ZERO(&mut set);
            libc::FD_SET(r, &mut set);
            let mut tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 0,
            };
            assert_eq!(
                sv_rselect(
                    r + 1,
                    &mut set,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    &mut tv
                ),
                1
            );
            assert!(libc::FD_ISSET(r, &set));
            assert_eq!(sv_rpoll(std::ptr::null_mut(), 1, 0), -1);
            assert_eq!(errno(), libc::EFAULT);
            assert_eq!(
                sv_rselect(
                    -1,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    &mut tv
                ),
                -1
            );
            assert_eq!(errno(), libc::EINVAL);
            libc::close(r);
            libc::close(w);
        }
    }
}
