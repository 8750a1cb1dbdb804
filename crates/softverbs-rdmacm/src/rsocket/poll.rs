//! `rpoll` and `rselect` over rsockets and ordinary descriptors together.
//!
//! A poll first looks at every entry without waiting (an rsocket's state after polling its
//! CQ and CM channel; ordinary fds with a zero-timeout `poll(2)`), then arms the rsockets'
//! CQs, looks once more, and sleeps in one `poll(2)` on the ordinary fds and each rsocket's
//! completion and CM channel fds, so it never spins. A sleep lasts at most
//! [`WAIT_SLICE_MS`](super::conn::WAIT_SLICE_MS) before it looks again, for events another
//! thread of the program took.

use super::conn::{Socket, St, WAIT_SLICE_MS};
use super::{ret, table};
use core::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an rsocket reports for `events` now.
fn revents(s: &Socket, events: i16) -> i16 {
    let mut g = s.lock();
    if g.progress() {
        // A thread blocked in a call on this socket may wait for what was just polled.
        s.wake_all();
    }
    let always = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;
    let r = match g.st {
        St::Listen if !g.channel.is_null() => {
            let mut p = libc::pollfd {
                // SAFETY: the listener's live channel.
                fd: unsafe { (*g.channel).fd },
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd, no wait.
            unsafe { libc::poll(&mut p, 1, 0) };
            p.revents & libc::POLLIN
        }
        St::Listen | St::Connecting => 0,
        St::Connected => match &g.conn {
            Some(c) => {
                let mut r = 0;
                if c.readable() || g.shut_rd {
                    r |= libc::POLLIN;
                }
                if c.writable() {
                    r |= libc::POLLOUT;
                }
                // Hung up once what came before the disconnect has been read: rstream
                // treats POLLHUP as fatal, and the peer's last data may still wait here.
                if c.gone && (c.pending() == 0 || events & libc::POLLIN == 0) {
                    r |= libc::POLLHUP;
                }
                if c.err != 0 {
                    r |= libc::POLLERR;
                }
                r
            }
            None => libc::POLLHUP,
        },
        St::Failed => libc::POLLOUT | libc::POLLERR | libc::POLLHUP,
        St::Init | St::Bound => libc::POLLOUT | libc::POLLHUP,
    };
    r & (events | always)
}

/// Fills every entry's `revents` without waiting; the number of ready entries.
fn check(fds: &mut [libc::pollfd], socks: &[Option<Arc<Socket>>]) -> c_int {
    let mut real: Vec<libc::pollfd> = Vec::new();
    let mut at = Vec::new();
    for (k, p) in fds.iter_mut().enumerate() {
        p.revents = 0;
        if p.fd < 0 {
            continue;
        }
        match &socks[k] {
            Some(s) => p.revents = revents(s, p.events),
            None => {
                real.push(libc::pollfd {
                    fd: p.fd,
                    events: p.events,
                    revents: 0,
                });
                at.push(k);
            }
        }
    }
    if !real.is_empty() {
        // SAFETY: a live array of pollfds, no wait.
        unsafe { libc::poll(real.as_mut_ptr(), real.len() as libc::nfds_t, 0) };
        for (p, &k) in real.iter().zip(&at) {
            fds[k].revents = p.revents;
        }
    }
    fds.iter().filter(|p| p.revents != 0).count() as c_int
}

/// `rpoll`: as `poll(2)`, over rsockets and other descriptors alike.
///
/// # Safety
/// `fds` is `nfds` readable and writable pollfds.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rpoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
) -> c_int {
    if nfds > 0 && fds.is_null() {
        return ret(Err(libc::EFAULT));
    }
    if nfds > 1 << 20 {
        return ret(Err(libc::EINVAL));
    }
    let fds: &mut [libc::pollfd] = if nfds == 0 {
        &mut []
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(fds, nfds as usize) }
    };
    let socks: Vec<Option<Arc<Socket>>> = fds
        .iter()
        .map(|p| (p.fd >= 0).then(|| table::get(p.fd).ok()).flatten())
        .collect();
    let end = (timeout >= 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
    loop {
        let n = check(fds, &socks);
        if n > 0 || timeout == 0 {
            return n;
        }
        for s in socks.iter().flatten() {
            s.lock().arm();
        }
        let n = check(fds, &socks);
        if n > 0 {
            return n;
        }
        let mut ms = WAIT_SLICE_MS;
        if let Some(end) = end {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return 0;
            }
            ms = ms.min(left.as_millis() as c_int + 1);
        }
        let mut wait: Vec<libc::pollfd> = Vec::new();
        for (p, s) in fds.iter().zip(&socks) {
            match s {
                Some(s) => wait.extend(s.lock().wait_fds()),
                None if p.fd >= 0 => wait.push(libc::pollfd {
                    fd: p.fd,
                    events: p.events,
                    revents: 0,
                }),
                None => {}
            }
        }
        // SAFETY: a live array of pollfds.
        let r = unsafe { libc::poll(wait.as_mut_ptr(), wait.len() as libc::nfds_t, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            return ret(Err(e));
        }
        for s in socks.iter().flatten() {
            if let Some(c) = &s.lock().conn {
                c.drain_events();
            }
        }
    }
}

/// `rselect`: as `select(2)`, through `rpoll`.
///
/// # Safety
/// Each set is NULL or a readable and writable `fd_set`; `timeout` NULL or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    if !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        return ret(Err(libc::EINVAL));
    }
    // SAFETY: the caller's sets, NULL or valid.
    let isset =
        |set: *mut libc::fd_set, fd: c_int| !set.is_null() && unsafe { libc::FD_ISSET(fd, set) };
    let mut pfds = Vec::new();
    for fd in 0..nfds {
        let mut events = 0;
        if isset(readfds, fd) {
            events |= libc::POLLIN;
        }
        if isset(writefds, fd) {
            events |= libc::POLLOUT;
        }
        if isset(exceptfds, fd) {
            events |= libc::POLLPRI;
        }
        if events != 0 {
            pfds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    let ms = if timeout.is_null() {
        -1
    } else {
        // SAFETY: the caller's timeval.
        let t = unsafe { *timeout };
        if t.tv_sec < 0 || t.tv_usec < 0 {
            return ret(Err(libc::EINVAL));
        }
        (t.tv_sec.saturating_mul(1000) + (t.tv_usec + 999) / 1000).min(c_int::MAX as i64) as c_int
    };
    // SAFETY: a live array.
    let n = unsafe { sv_rpoll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if n < 0 {
        return n;
    }
    // SAFETY: the caller's sets, cleared and refilled.
    unsafe {
        for set in [readfds, writefds, exceptfds] {
            if !set.is_null() {
                libc::FD_ZERO(set);
            }
        }
    }
    let mut count = 0;
    for p in &pfds {
        let mut mark = |set: *mut libc::fd_set, on: bool| {
            if on && !set.is_null() {
                // SAFETY: a caller's set and an fd below FD_SETSIZE.
                unsafe { libc::FD_SET(p.fd, set) };
                count += 1;
            }
        };
        let err = p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
        mark(
            readfds,
            p.events & libc::POLLIN != 0 && (p.revents & libc::POLLIN != 0 || err),
        );
        mark(
            writefds,
            p.events & libc::POLLOUT != 0 && (p.revents & libc::POLLOUT != 0 || err),
        );
        mark(
            exceptfds,
            p.events & libc::POLLPRI != 0 && p.revents & libc::POLLPRI != 0,
        );
    }
    count
}
