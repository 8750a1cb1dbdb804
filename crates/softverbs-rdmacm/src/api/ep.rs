//! `rdma_getaddrinfo` / `rdma_freeaddrinfo` and the endpoint helpers `rdma_create_ep` /
//! `rdma_destroy_ep` that `rdma_server`, `rdma_client` and `rstream` use.

use super::rc;
use crate::abi::*;
use crate::addr;
use crate::api::{id, qp};
use crate::cm::{IBV_QPT_RC, IBV_QPT_UD, with_id};
use crate::ibv::{ibv_pd, ibv_qp_init_attr};
use core::ffi::{c_char, c_int};
use std::ffi::CStr;
use std::net::SocketAddr;

/// One `rdma_addrinfo` and the addresses it points to, freed together.
#[repr(C)]
struct Info {
    ai: rdma_addrinfo,
    src: sockaddr_storage,
    dst: sockaddr_storage,
}

/// Resolves `node`:`service` with the system resolver (numeric only with `numeric`).
fn lookup(
    node: Option<&CStr>,
    service: Option<&CStr>,
    passive: bool,
    numeric: bool,
    family: c_int,
) -> Result<Vec<SocketAddr>, c_int> {
    // SAFETY: a zeroed addrinfo is a valid empty hints struct.
    let mut hints: libc::addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_family = family;
    hints.ai_socktype = libc::SOCK_STREAM;
    hints.ai_flags =
        if passive { libc::AI_PASSIVE } else { 0 } | if numeric { libc::AI_NUMERICHOST } else { 0 };
    let mut res: *mut libc::addrinfo = std::ptr::null_mut();
    // SAFETY: NUL-terminated strings or NULL, valid hints, a writable result pointer.
    let r = unsafe {
        libc::getaddrinfo(
            node.map_or(std::ptr::null(), CStr::as_ptr),
            service.map_or(std::ptr::null(), CStr::as_ptr),
            &hints,
            &mut res,
        )
    };
    if r != 0 {
        return Err(r);
    }
    let mut out = Vec::new();
    let mut p = res;
    while !p.is_null() {
        // SAFETY: a node of getaddrinfo's list.
        let a = unsafe { &*p };
        // SAFETY: getaddrinfo's addresses are valid for their family.
        if let Some(s) = unsafe { addr::from_c(a.ai_addr) } {
            if !out.contains(&s) {
                out.push(s);
            }
        }
        p = a.ai_next;
    }
    // SAFETY: the list getaddrinfo made.
    unsafe { libc::freeaddrinfo(res) };
    Ok(out)
}

/// `rdma_getaddrinfo`: addresses for `node`/`service` with the port space and QP type of
/// `hints` (RDMA_PS_TCP and RC when none); with `RAI_PASSIVE`, source addresses to bind.
/// Returns 0, or a `getaddrinfo` error code (and -1 with errno for bad arguments).
///
/// # Safety
/// `node`, `service` NULL or NUL-terminated; `hints` NULL or readable; `res` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    // SAFETY: the caller's contract.
    let h = unsafe { hints.as_ref() };
    // With neither node nor service, the hints' addresses are the answer (librdmacm's rule).
    // SAFETY: the hints' addresses, if any, are readable.
    let (hint_src, hint_dst) = h.map_or((None, None), |h| unsafe {
        (addr::from_c(h.ai_src_addr), addr::from_c(h.ai_dst_addr))
    });
    if res.is_null()
        || (node.is_null() && service.is_null() && hint_src.is_none() && hint_dst.is_none())
    {
        return rc(Err(libc::EINVAL));
    }
    let flags = h.map_or(0, |h| h.ai_flags);
    let passive = flags & RAI_PASSIVE != 0;
    let ps = h.map_or(0, |h| h.ai_port_space);
    let ps = if ps == 0 { RDMA_PS_TCP } else { ps };
    let qp_type = match h.map_or(0, |h| h.ai_qp_type) {
        0 if ps == RDMA_PS_UDP => IBV_QPT_UD,
        0 => IBV_QPT_RC,
        t => t,
    };
    let family = h.map_or(0, |h| h.ai_family);
    // SAFETY: the caller's contract.
    let (node, service) = unsafe {
        (
            (!node.is_null()).then(|| CStr::from_ptr(node)),
            (!service.is_null()).then(|| CStr::from_ptr(service)),
        )
    };
    let addrs = if node.is_none() && service.is_none() {
        let a = if passive {
            hint_src
        } else {
            hint_dst.or(hint_src)
        };
        a.into_iter().collect()
    } else {
        match lookup(node, service, passive, flags & RAI_NUMERICHOST != 0, family) {
            Ok(a) => a,
            Err(e) => return e,
        }
    };
    let mut head: *mut rdma_addrinfo = std::ptr::null_mut();
    for a in addrs.into_iter().rev() {
        let (st, len) = addr::to_c(a);
        let mut info = Box::new(Info {
            // SAFETY: all-zero is a valid rdma_addrinfo (NULL pointers).
            ai: unsafe { std::mem::zeroed() },
            src: sockaddr_storage { bytes: [0; 128] },
            dst: sockaddr_storage { bytes: [0; 128] },
        });
        info.ai.ai_flags = flags;
        info.ai.ai_family = if a.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        info.ai.ai_qp_type = qp_type;
        info.ai.ai_port_space = ps;
        if passive || (hint_dst.is_none() && node.is_none() && service.is_none()) {
            info.src = st;
            info.ai.ai_src_len = len;
            info.ai.ai_flags |= RAI_PASSIVE;
        } else {
            info.dst = st;
            info.ai.ai_dst_len = len;
            if let Some(s) = hint_src {
                let (sst, slen) = addr::to_c(s);
                info.src = sst;
                info.ai.ai_src_len = slen;
            }
        }
        info.ai.ai_next = head;
        let p = Box::into_raw(info);
        // SAFETY: `p` is ours and live; the addresses point into the same allocation.
        unsafe {
            if (*p).ai.ai_src_len > 0 {
                (*p).ai.ai_src_addr = (&mut (*p).src as *mut sockaddr_storage).cast();
            }
            if (*p).ai.ai_dst_len > 0 {
                (*p).ai.ai_dst_addr = (&mut (*p).dst as *mut sockaddr_storage).cast();
            }
        }
        head = p.cast();
    }
    if head.is_null() {
        return libc::EAI_NONAME;
    }
    // SAFETY: the caller's contract.
    unsafe { *res = head };
    0
}

/// `rdma_freeaddrinfo`.
///
/// # Safety
/// `res` came from `rdma_getaddrinfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut p = res;
    while !p.is_null() {
        // SAFETY: each node is an Info made by rdma_getaddrinfo.
        let info = unsafe { Box::from_raw(p as *mut Info) };
        p = info.ai.ai_next;
    }
}

/// `rdma_create_ep`: a synchronous id for `res`: bound (passive, with `qp_init_attr` kept
/// for each request's QP) or resolved to its destination (active, with a QP if asked).
///
/// # Safety
/// `id` writable; `res` from `rdma_getaddrinfo`; `pd` NULL or a PD; `qp_init_attr` NULL or
/// readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_create_ep(
    id: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    if id.is_null() || res.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's contract.
    let r = unsafe { &*res };
    let mut new: *mut rdma_cm_id = std::ptr::null_mut();
    // SAFETY: a NULL channel makes a synchronous id; `new` is writable.
    if unsafe {
        id::create_id(
            std::ptr::null_mut(),
            &mut new,
            std::ptr::null_mut(),
            r.ai_port_space,
            r.ai_qp_type,
        )
    } != 0
    {
        return -1;
    }
    let fail = |new: *mut rdma_cm_id| {
        let e = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL);
        // SAFETY: the id just made.
        unsafe { id::sv_rdma_destroy_id(new) };
        rc(Err(e))
    };
    if r.ai_flags & RAI_PASSIVE != 0 {
        // SAFETY: the address rdma_getaddrinfo made.
        if unsafe { id::sv_rdma_bind_addr(new, r.ai_src_addr) } != 0 {
            return fail(new);
        }
        // SAFETY: the caller's contract.
        let attr = unsafe { qp_init_attr.as_ref() }.copied().map(|mut a| {
            a.qp_type = r.ai_qp_type;
            a
        });
        let _ = with_id(new, |cm, i| {
            let c = cm.conns.get_mut(&i).ok_or(libc::EINVAL)?;
            c.ep_qp_attr = attr;
            c.ep_pd = pd;
            Ok(())
        });
    } else {
        // SAFETY: the addresses rdma_getaddrinfo made; a synchronous id waits.
        unsafe {
            if id::sv_rdma_resolve_addr(new, r.ai_src_addr, r.ai_dst_addr, 2000) != 0
                || id::sv_rdma_resolve_route(new, 2000) != 0
            {
                return fail(new);
            }
            if !qp_init_attr.is_null() {
                // As librdmacm: the QP type is the address's.
                (*qp_init_attr).qp_type = r.ai_qp_type;
            }
            if !qp_init_attr.is_null() && qp::sv_rdma_create_qp(new, pd, qp_init_attr) != 0 {
                return fail(new);
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { *id = new };
    0
}

/// `rdma_destroy_ep`: the id's QP and SRQ, then the id.
///
/// # Safety
/// `id` came from `rdma_create_ep` or `rdma_get_request` and is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_destroy_ep(id: *mut rdma_cm_id) {
    // SAFETY: the caller's contract.
    unsafe {
        qp::sv_rdma_destroy_qp(id);
        qp::sv_rdma_destroy_srq(id);
        id::sv_rdma_destroy_id(id);
    }
}
