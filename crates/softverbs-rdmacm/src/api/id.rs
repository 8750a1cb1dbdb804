//! Ids, their addresses and options: `rdma_create_id` … `rdma_get_devices`.

use super::rc;
use crate::abi::*;
use crate::addr;
use crate::channel::Channel;
use crate::cm::{self, IBV_QPT_RC, IBV_QPT_UD, State, with_id};
use crate::device;
use crate::ibv::ibv_context;
use crate::set_errno;
use core::ffi::{c_int, c_void};

/// `rdma_create_id`. A NULL `channel` makes a synchronous id: its calls wait for their
/// results.
///
/// # Safety
/// `channel` is NULL or a live channel of ours; `id` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: c_int,
) -> c_int {
    let qp_type = match ps {
        RDMA_PS_TCP | RDMA_PS_IB => IBV_QPT_RC,
        RDMA_PS_UDP | RDMA_PS_IPOIB => IBV_QPT_UD,
        _ => return rc(Err(libc::EINVAL)),
    };
    // SAFETY: as above.
    unsafe { create_id(channel, id, context, ps, qp_type) }
}

/// # Safety
/// As [`rdma_create_id`].
pub(crate) unsafe fn create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: c_int,
    qp_type: c_int,
) -> c_int {
    if id.is_null() {
        return rc(Err(libc::EINVAL));
    }
    let Some(mut cm) = cm::cm() else {
        return rc(Err(libc::ENODEV));
    };
    match cm.create_id(channel as *const Channel, context, ps, qp_type) {
        Some(new) => {
            // SAFETY: `id` is writable (the caller's contract).
            unsafe { *id = new.cast() };
            0
        }
        None => rc(Err(libc::ENOMEM)),
    }
}

/// `rdma_destroy_id`: disconnects (or rejects) what is still up, and frees the id.
///
/// # Safety
/// `id` is a live id of ours, not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    rc(with_id(id, |cm, i| {
        let held = cm.conns[&i].held_event;
        if !held.is_null() {
            // SAFETY: the event rdma_get_request kept for this id.
            unsafe { crate::channel::sv_rdma_ack_cm_event(held) };
        }
        cm.destroy(i);
        Ok(())
    }))
}

/// `rdma_bind_addr`.
///
/// # Safety
/// `id` is a live id; `addr` a readable socket address.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_bind_addr(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(a) = (unsafe { addr::from_c(addr) }) else {
        return rc(Err(libc::EAFNOSUPPORT));
    };
    rc(with_id(id, |cm, i| cm.bind(i, a)))
}

/// `rdma_resolve_addr`: ADDR_RESOLVED follows (at once: addresses map to devices locally).
///
/// # Safety
/// `id` is a live id; `src` NULL or readable; `dst` readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    // SAFETY: the caller's contract.
    let (s, d) = unsafe { (addr::from_c(src), addr::from_c(dst)) };
    let Some(d) = d else {
        return rc(Err(libc::EAFNOSUPPORT));
    };
    let r = with_id(id, |cm, i| cm.resolve_addr(i, s, d).map(|()| i));
    match r {
        Ok(i) => rc(cm::wait_sync(i, RDMA_CM_EVENT_ADDR_RESOLVED)),
        Err(e) => rc(Err(e)),
    }
}

/// `rdma_resolve_route`: ROUTE_RESOLVED follows.
///
/// # Safety
/// `id` is a live id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
    match with_id(id, |cm, i| cm.resolve_route(i).map(|()| i)) {
        Ok(i) => rc(cm::wait_sync(i, RDMA_CM_EVENT_ROUTE_RESOLVED)),
        Err(e) => rc(Err(e)),
    }
}

/// `rdma_listen`.
///
/// # Safety
/// `id` is a live id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    rc(with_id(id, |cm, i| cm.listen(i, backlog)))
}

/// `rdma_migrate_id`: the id's events go to `channel` from now on (NULL: the id becomes
/// synchronous).
///
/// # Safety
/// `id` is a live id; `channel` NULL or a live channel of ours.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_migrate_id(
    id: *mut rdma_cm_id,
    channel: *mut rdma_event_channel,
) -> c_int {
    rc(with_id(id, |cm, i| {
        let c = cm.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        if channel.is_null() {
            if c.private_channel.is_none() {
                c.private_channel = Some(Channel::new().ok_or(libc::ENOMEM)?);
            }
            c.channel = c
                .private_channel
                .as_deref()
                .map_or(std::ptr::null(), |p| p as *const _);
            c.sync = true;
        } else {
            c.channel = channel as *const Channel;
            c.sync = false;
        }
        // SAFETY: the id is live.
        unsafe { (*c.id).c.channel = c.channel as *mut rdma_event_channel };
        Ok(())
    }))
}

/// `rdma_set_option`: TOS, REUSEADDR, AFONLY and ACK_TIMEOUT of `RDMA_OPTION_ID`; paths
/// (`RDMA_OPTION_IB_PATH`) are ignored, as RoCE routes by GID.
///
/// # Safety
/// `id` is a live id; `optval` points to `optlen` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    if optval.is_null() {
        return rc(Err(libc::EINVAL));
    }
    let read_u8 = || -> Result<u8, c_int> {
        if optlen < 1 {
            return Err(libc::EINVAL);
        }
        // SAFETY: at least one readable byte.
        Ok(unsafe { *(optval as *const u8) })
    };
    let read_int = || -> Result<c_int, c_int> {
        if optlen < std::mem::size_of::<c_int>() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an int's worth of readable bytes.
        Ok(unsafe { std::ptr::read_unaligned(optval as *const c_int) })
    };
    rc(with_id(id, |cm, i| {
        let c = cm.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        match (level, optname) {
            (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS) => c.tos = read_u8()?,
            (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR) => {
                if c.state != State::Idle {
                    return Err(libc::EINVAL);
                }
                c.reuseaddr = read_int()? != 0;
            }
            (RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY) => {
                if c.state != State::Idle {
                    return Err(libc::EINVAL);
                }
                c.afonly = read_int()? != 0;
            }
            (RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT) => {
                c.ack_timeout = Some(read_u8()?.min(31))
            }
            (RDMA_OPTION_IB, RDMA_OPTION_IB_PATH) => {}
            _ => return Err(libc::ENOSYS),
        }
        Ok(())
    }))
}

fn port_of(id: *mut rdma_cm_id, src: bool) -> u16 {
    with_id(id, |cm, i| {
        let c = &cm.conns[&i];
        Ok(if src { c.src } else { c.dst }.map_or(0, |a| a.port()))
    })
    .unwrap_or(0)
}

/// `rdma_get_src_port`: the local port, in network byte order.
///
/// # Safety
/// `id` is a live id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    port_of(id, true).to_be()
}

/// `rdma_get_dst_port`: the peer's port, in network byte order.
///
/// # Safety
/// `id` is a live id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    port_of(id, false).to_be()
}

/// `rdma_get_devices`: the opened contexts of every device, NULL-terminated.
///
/// # Safety
/// `num` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context {
    let devs = device::devices();
    // SAFETY: calloc of n+1 pointers, freed by rdma_free_devices.
    let list = unsafe { libc::calloc(devs.len() + 1, std::mem::size_of::<usize>()) }
        as *mut *mut ibv_context;
    if list.is_null() {
        set_errno(libc::ENOMEM);
        return list;
    }
    for (k, d) in devs.iter().enumerate() {
        // SAFETY: within the n+1 slots.
        unsafe { *list.add(k) = d.ctx };
    }
    if !num.is_null() {
        // SAFETY: the caller's contract.
        unsafe { *num = devs.len() as c_int };
    }
    list
}

/// `rdma_free_devices`.
///
/// # Safety
/// `list` came from `rdma_get_devices`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: calloc'd by rdma_get_devices.
    unsafe { libc::free(list.cast()) };
}
