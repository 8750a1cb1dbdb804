//! Connections: `rdma_connect`, `rdma_get_request`, `rdma_accept`, `rdma_reject`,
//! `rdma_disconnect`, `rdma_establish`, `rdma_notify`, `rdma_init_qp_attr`; multicast and
//! ECE, which softverbs devices do not offer.

use super::rc;
use crate::abi::*;
use crate::cm::{self, with_id};
use crate::ibv::ibv_qp_attr;
use core::ffi::{c_int, c_void};

/// The most RDMA READs and atomics in flight a connection gets when the program asks for
/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH` or passes no parameters (the device's
/// `max_qp_rd_atom`).
const MAX_RD_ATOMIC: u8 = 16;

fn default_param() -> rdma_conn_param {
    rdma_conn_param {
        private_data: std::ptr::null(),
        private_data_len: 0,
        responder_resources: MAX_RD_ATOMIC,
        initiator_depth: MAX_RD_ATOMIC,
        flow_control: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        srq: 0,
        qp_num: 0,
    }
}

/// The program's parameters (or the defaults), clamped to the device, and its private data.
///
/// # Safety
/// `p` is NULL or readable, and its private data `private_data_len` readable bytes.
unsafe fn param_of<'a>(p: *const rdma_conn_param) -> (rdma_conn_param, &'a [u8]) {
    if p.is_null() {
        return (default_param(), &[]);
    }
    // SAFETY: the caller's contract.
    let mut q = unsafe { *p };
    q.responder_resources = q.responder_resources.min(MAX_RD_ATOMIC);
    q.initiator_depth = q.initiator_depth.min(MAX_RD_ATOMIC);
    let data = if q.private_data.is_null() || q.private_data_len == 0 {
        &[][..]
    } else {
        // SAFETY: the caller's contract.
        unsafe {
            std::slice::from_raw_parts(q.private_data as *const u8, q.private_data_len as usize)
        }
    };
    (q, data)
}

/// `rdma_connect`: sends the REQ (SIDR_REQ for UD); ESTABLISHED (or REJECTED, UNREACHABLE)
/// follows. A synchronous id waits for it.
///
/// # Safety
/// `id` is a live id; `conn_param` NULL or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_connect(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> c_int {
    // SAFETY: the caller's contract.
    let (p, data) = unsafe { param_of(conn_param) };
    match with_id(id, |cm, i| cm.connect(i, &p, data).map(|()| i)) {
        Ok(i) => rc(cm::wait_sync(i, RDMA_CM_EVENT_ESTABLISHED)),
        Err(e) => rc(Err(e)),
    }
}

/// `rdma_get_request`: on a synchronous listener, waits for the next connection request and
/// returns its new id (with a QP if `rdma_create_ep` was given QP attributes).
///
/// # Safety
/// `listen` is a live listening id; `id` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_get_request(
    listen: *mut rdma_cm_id,
    id: *mut *mut rdma_cm_id,
) -> c_int {
    if id.is_null() {
        return rc(Err(libc::EINVAL));
    }
    let got = with_id(listen, |cm, i| {
        let c = &cm.conns[&i];
        if !c.sync || c.state != cm::State::Listen {
            return Err(libc::EINVAL);
        }
        Ok((c.channel, c.ep_qp_attr, c.ep_pd))
    });
    let (ch, qp_attr, pd) = match got {
        Ok(x) => x,
        Err(e) => return rc(Err(e)),
    };
    loop {
        // SAFETY: the listener's own channel, alive while it is.
        let Some(e) = (unsafe { (*ch).pop() }) else {
            return -1;
        };
        if e.ev.event != RDMA_CM_EVENT_CONNECT_REQUEST {
            continue;
        }
        let new = e.ev.id;
        let e = Box::into_raw(e);
        let kept = with_id(new, |cm, i| {
            let c = cm.conns.get_mut(&i).ok_or(libc::EINVAL)?;
            c.held_event = e.cast();
            // SAFETY: the new id is live.
            unsafe { (*c.id).c.event = e.cast() };
            Ok(())
        });
        if kept.is_err() {
            // SAFETY: ours, not handed out.
            drop(unsafe { Box::from_raw(e) });
            continue;
        }
        if let Some(mut a) = qp_attr {
            // SAFETY: the new id is live, the attributes a copy of the program's.
            if unsafe { crate::api::qp::sv_rdma_create_qp(new, pd, &mut a) } != 0 {
                // SAFETY: as above.
                unsafe { sv_rdma_reject(new, std::ptr::null(), 0) };
                return -1;
            }
        }
        // SAFETY: `id` is writable (the caller's contract).
        unsafe { *id = new };
        return 0;
    }
}

/// Frees the request event `rdma_get_request` kept on `i`.
fn release_held(cm: &mut cm::Cm, i: u32) {
    if let Some(c) = cm.conns.get_mut(&i) {
        let held = std::mem::replace(&mut c.held_event, std::ptr::null_mut());
        if !held.is_null() {
            // SAFETY: the id is live; the event was ours.
            unsafe {
                (*c.id).c.event = std::ptr::null_mut();
                crate::channel::sv_rdma_ack_cm_event(held);
            }
        }
    }
}

/// `rdma_accept`: moves the id's QP to RTS and sends the REP (SIDR_REP for UD); ESTABLISHED
/// follows when the RTU arrives. A synchronous id waits for it.
///
/// # Safety
/// `id` is a live id with a connection request; `conn_param` NULL or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_accept(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> c_int {
    let p = (!conn_param.is_null()).then(|| {
        // SAFETY: the caller's contract.
        unsafe { param_of(conn_param) }
    });
    let (param, data) = match &p {
        Some((q, d)) => (Some(q), *d),
        None => (None, &[][..]),
    };
    let r = with_id(id, |cm, i| {
        let ud = cm.conns[&i].state == cm::State::SidrReqRcvd;
        cm.accept(i, param, data)?;
        release_held(cm, i);
        Ok((i, ud))
    });
    match r {
        Ok((_, true)) => 0,
        Ok((i, false)) => rc(cm::wait_sync(i, RDMA_CM_EVENT_ESTABLISHED)),
        Err(e) => rc(Err(e)),
    }
}

/// `rdma_reject`: a REJ with reason "consumer reject" and the private data (SIDR_REP
/// "rejected" for UD).
///
/// # Safety
/// `id` is a live id with a connection request; `private_data` `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_reject(
    id: *mut rdma_cm_id,
    private_data: *const c_void,
    len: u8,
) -> c_int {
    let data = if private_data.is_null() || len == 0 {
        &[][..]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(private_data as *const u8, len as usize) }
    };
    rc(with_id(id, |cm, i| {
        cm.reject(i, data)?;
        release_held(cm, i);
        Ok(())
    }))
}

/// `rdma_reject_ece`: as `rdma_reject` (softverbs offers no ECE).
///
/// # Safety
/// As [`rdma_reject`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_reject_ece(
    id: *mut rdma_cm_id,
    private_data: *const c_void,
    len: u8,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { sv_rdma_reject(id, private_data, len) }
}

/// `rdma_disconnect`: the QP to ERR, then a DREQ (a DREP if the peer's came first);
/// DISCONNECTED follows.
///
/// # Safety
/// `id` is a live id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    rc(with_id(id, |cm, i| cm.disconnect(i)))
}

/// `rdma_establish`: after CONNECT_RESPONSE on an id without a QP, sends the RTU.
///
/// # Safety
/// `id` is a live id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_establish(id: *mut rdma_cm_id) -> c_int {
    rc(with_id(id, |cm, i| cm.establish(i)))
}

/// `IBV_EVENT_COMM_EST`.
const IBV_EVENT_COMM_EST: c_int = 4;

/// `rdma_notify`: `IBV_EVENT_COMM_EST` (data before the RTU) establishes the connection;
/// other events need nothing.
///
/// # Safety
/// `id` is a live id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_notify(id: *mut rdma_cm_id, event: c_int) -> c_int {
    rc(with_id(id, |cm, i| {
        if event == IBV_EVENT_COMM_EST {
            let s = cm.conns[&i].state;
            if s == cm::State::RepSent {
                return cm.establish(i);
            }
        }
        Ok(())
    }))
}

/// `rdma_init_qp_attr`: the attributes and mask that move a QP to `qp_attr->qp_state` for
/// this connection.
///
/// # Safety
/// `id` is a live id; `qp_attr` and `qp_attr_mask` writable, `qp_attr->qp_state` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    qp_attr: *mut ibv_qp_attr,
    qp_attr_mask: *mut c_int,
) -> c_int {
    if qp_attr.is_null() || qp_attr_mask.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's contract.
    let want = unsafe { (*qp_attr).qp_state };
    rc(with_id(id, |cm, i| {
        let (a, m) = cm.qp_attr(i, want)?;
        // SAFETY: the caller's contract.
        unsafe {
            *qp_attr = a;
            *qp_attr_mask = m;
        }
        Ok(())
    }))
}

/// Joins `id` to the group of `addr`, synchronously on an id without a channel.
///
/// # Safety
/// `addr` is NULL or a readable sockaddr.
unsafe fn join(
    id: *mut rdma_cm_id,
    addr: *const libc::sockaddr,
    ctx: *mut c_void,
    send_only: bool,
) -> c_int {
    // SAFETY: the caller's.
    let Some(a) = (unsafe { crate::addr::from_c(addr) }) else {
        return rc(Err(libc::EINVAL));
    };
    match with_id(id, |cm, i| cm.join(i, a.ip(), ctx, send_only).map(|()| i)) {
        Ok(i) => rc(cm::wait_sync(i, RDMA_CM_EVENT_MULTICAST_JOIN)),
        Err(e) => rc(Err(e)),
    }
}

/// `rdma_join_multicast`: see `cm::multicast`; MULTICAST_JOIN follows.
///
/// # Safety
/// `id` is a live id and `addr` a readable sockaddr.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_join_multicast(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
    ctx: *mut c_void,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { join(id, addr, ctx, false) }
}

/// `struct rdma_cm_join_mc_attr_ex`.
#[repr(C)]
pub struct rdma_cm_join_mc_attr_ex {
    pub comp_mask: u32,
    pub join_flags: u32,
    pub addr: *mut libc::sockaddr,
}

/// `RDMA_CM_JOIN_MC_ATTR_ADDRESS`, `_JOIN_FLAGS`; `RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER`.
const MC_ATTR_ADDRESS: u32 = 1;
const MC_ATTR_JOIN_FLAGS: u32 = 2;
const MC_FULLMEMBER: u32 = 0;
const MC_SENDONLY_FULLMEMBER: u32 = 1;

/// `rdma_join_multicast_ex`: the address and a full-member or send-only full-member join (a
/// send-only member's QP is not attached: it sends to the group and receives nothing).
///
/// # Safety
/// `id` is a live id and `attr` readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_join_multicast_ex(
    id: *mut rdma_cm_id,
    attr: *mut rdma_cm_join_mc_attr_ex,
    ctx: *mut c_void,
) -> c_int {
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's contract.
    let a = unsafe { &*attr };
    let known = MC_ATTR_ADDRESS | MC_ATTR_JOIN_FLAGS;
    if a.comp_mask & MC_ATTR_ADDRESS == 0 || a.comp_mask & !known != 0 {
        return rc(Err(libc::EINVAL));
    }
    let flags = if a.comp_mask & MC_ATTR_JOIN_FLAGS != 0 {
        a.join_flags
    } else {
        MC_FULLMEMBER
    };
    if flags > MC_SENDONLY_FULLMEMBER {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: as above.
    unsafe { join(id, a.addr, ctx, flags == MC_SENDONLY_FULLMEMBER) }
}

/// `rdma_leave_multicast`: EADDRNOTAVAIL for a group the id has not joined.
///
/// # Safety
/// `id` is a live id and `addr` a readable sockaddr.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_leave_multicast(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(a) = (unsafe { crate::addr::from_c(addr) }) else {
        return rc(Err(libc::EINVAL));
    };
    rc(with_id(id, |cm, i| cm.leave(i, a.ip())))
}

/// `rdma_set_local_ece`: EOPNOTSUPP (no enhanced connection establishment).
#[unsafe(no_mangle)]
pub extern "C" fn sv_rdma_set_local_ece(_id: *mut rdma_cm_id, _ece: *mut c_void) -> c_int {
    rc(Err(libc::EOPNOTSUPP))
}

/// `rdma_get_remote_ece`: EOPNOTSUPP.
#[unsafe(no_mangle)]
pub extern "C" fn sv_rdma_get_remote_ece(_id: *mut rdma_cm_id, _ece: *mut c_void) -> c_int {
    rc(Err(libc::EOPNOTSUPP))
}
