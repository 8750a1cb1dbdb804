//! QPs and SRQs on ids: `rdma_create_qp`, `rdma_create_qp_ex`, `rdma_destroy_qp`,
//! `rdma_create_srq`, `rdma_create_srq_ex`, `rdma_destroy_srq`.

use super::rc;
use crate::abi::*;
use crate::cm::{self, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPT_UD, with_id};
use crate::device;
use crate::ibv::*;
use crate::verbs::verbs;
use core::ffi::c_int;

/// The id's device PD for calls that pass none (one per device, as librdmacm keeps).
fn device_pd(ctx: *mut ibv_context) -> Result<*mut ibv_pd, c_int> {
    let d = device::index_of_ctx(ctx).ok_or(libc::EINVAL)?;
    let dev = &device::devices()[d];
    let mut pd = dev.pd.lock().unwrap_or_else(|p| p.into_inner());
    if *pd == 0 {
        let v = verbs().ok_or(libc::ENOSYS)?;
        // SAFETY: an open context.
        let p = unsafe { (v.alloc_pd)(ctx) };
        if p.is_null() {
            return Err(libc::ENOMEM);
        }
        *pd = p as usize;
    }
    Ok(*pd as *mut ibv_pd)
}

/// The PD for an object on `cid`'s device: `pd`, or the device's own when the program
/// passes none; EINVAL while the id has no device yet.
fn pd_for(cid: &rdma_cm_id, pd: *mut ibv_pd) -> Result<*mut ibv_pd, c_int> {
    if cid.verbs.is_null() {
        return Err(libc::EINVAL);
    }
    if pd.is_null() {
        device_pd(cid.verbs)
    } else {
        Ok(pd)
    }
}

/// `rdma_create_qp`: a QP on the id's device (with CQs and completion channels of its own
/// when `qp_init_attr` names none), moved to INIT, or to RTS for UD, as librdmacm does.
///
/// # Safety
/// `id` is a live id with a device; `pd` NULL or a PD of that device; `qp_init_attr`
/// readable and writable (the caps are written back).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    if qp_init_attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    rc(with_id(id, |cm, i| {
        let v = verbs().ok_or(libc::ENOSYS)?;
        // SAFETY: the id is live (in the table).
        let cid = unsafe { &mut (*cm.conns[&i].id).c };
        if !cid.qp.is_null() {
            return Err(libc::EEXIST);
        }
        let pd = pd_for(cid, pd)?;
        // SAFETY: the caller's contract.
        let attr = unsafe { &mut *qp_init_attr };
        let mut made = Vec::new();
        if attr.send_cq.is_null() || attr.recv_cq.is_null() {
            // SAFETY: verbs calls on the id's open context; what is made is recorded on the
            // id and destroyed by rdma_destroy_qp.
            unsafe {
                for (send, depth) in [(true, attr.cap.max_send_wr), (false, attr.cap.max_recv_wr)] {
                    let ch = (v.create_comp_channel)(cid.verbs);
                    let cq = if ch.is_null() {
                        std::ptr::null_mut()
                    } else {
                        (v.create_cq)(
                            cid.verbs,
                            depth.max(1) as c_int,
                            cid as *mut _ as *mut _,
                            ch,
                            0,
                        )
                    };
                    if cq.is_null() {
                        if !ch.is_null() {
                            (v.destroy_comp_channel)(ch);
                        }
                        for (ch, cq) in made {
                            (v.destroy_cq)(cq);
                            (v.destroy_comp_channel)(ch);
                        }
                        return Err(libc::ENOMEM);
                    }
                    made.push((ch, cq));
                    if send {
                        cid.send_cq_channel = ch;
                        cid.send_cq = cq;
                    } else {
                        cid.recv_cq_channel = ch;
                        cid.recv_cq = cq;
                    }
                }
            }
            attr.send_cq = cid.send_cq;
            attr.recv_cq = cid.recv_cq;
            cm.conns.get_mut(&i).ok_or(libc::EINVAL)?.own_cqs = true;
        }
        // SAFETY: the program's attributes and a PD of the device.
        let qp = unsafe { (v.create_qp)(pd, attr) };
        if qp.is_null() {
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL);
            cm::log(format_args!(
                "rdma_create_qp: ibv_create_qp failed, errno {e} (send_cq {:p}, recv_cq {:p})",
                attr.send_cq, attr.recv_cq
            ));
            for (ch, cq) in made {
                // SAFETY: what was made above.
                unsafe {
                    (v.destroy_cq)(cq);
                    (v.destroy_comp_channel)(ch);
                }
            }
            if cm.conns.get(&i).is_some_and(|c| c.own_cqs) {
                cid.send_cq = std::ptr::null_mut();
                cid.recv_cq = std::ptr::null_mut();
                cid.send_cq_channel = std::ptr::null_mut();
                cid.recv_cq_channel = std::ptr::null_mut();
                cm.conns.get_mut(&i).ok_or(libc::EINVAL)?.own_cqs = false;
            }
            return Err(e);
        }
        cid.qp = qp;
        cid.pd = pd;
        cid.srq = attr.srq;
        cid.qp_type = attr.qp_type;
        let states: &[c_int] = if attr.qp_type == IBV_QPT_UD {
            &[IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS]
        } else {
            &[IBV_QPS_INIT]
        };
        for &s in states {
            let (mut a, mask) = cm.qp_attr(i, s)?;
            // SAFETY: our new QP and a full attribute set.
            if unsafe { (v.modify_qp)(qp, &mut a, mask) } != 0 {
                // SAFETY: as above.
                unsafe { (v.destroy_qp)(qp) };
                cid.qp = std::ptr::null_mut();
                return Err(libc::EINVAL);
            }
        }
        Ok(())
    }))
}

/// `rdma_create_qp_ex`: as `rdma_create_qp` with the PD of `qp_init_attr` (the extended
/// creation flags that need more are refused with EOPNOTSUPP).
///
/// # Safety
/// As [`rdma_create_qp`], with an `ibv_qp_init_attr_ex`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_init_attr_ex,
) -> c_int {
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's contract.
    let a = unsafe { &mut *attr };
    /// `IBV_QP_INIT_ATTR_PD`.
    const MASK_PD: u32 = 1;
    if a.comp_mask & !MASK_PD != 0 || a.create_flags != 0 {
        return rc(Err(libc::EOPNOTSUPP));
    }
    let mut basic = ibv_qp_init_attr {
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
    };
    let pd = if a.comp_mask & MASK_PD != 0 {
        a.pd
    } else {
        std::ptr::null_mut()
    };
    // SAFETY: as above.
    let r = unsafe { sv_rdma_create_qp(id, pd, &mut basic) };
    a.cap = basic.cap;
    a.send_cq = basic.send_cq;
    a.recv_cq = basic.recv_cq;
    r
}

/// `rdma_destroy_qp`: the id's QP, and the CQs `rdma_create_qp` made for it.
///
/// # Safety
/// `id` is a live id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_destroy_qp(id: *mut rdma_cm_id) {
    let _ = with_id(id, |cm, i| {
        let v = verbs().ok_or(libc::ENOSYS)?;
        // The groups this library attached the QP to let it go first (an attached QP cannot
        // be destroyed: EBUSY); the id stays joined.
        cm.detach_qp(i);
        let own = std::mem::replace(
            &mut cm.conns.get_mut(&i).ok_or(libc::EINVAL)?.own_cqs,
            false,
        );
        // SAFETY: the id is live; its QP and CQs are the ones made for it.
        unsafe {
            let cid = &mut (*cm.conns[&i].id).c;
            if !cid.qp.is_null() {
                (v.destroy_qp)(cid.qp);
                cid.qp = std::ptr::null_mut();
            }
            if own {
                for (cq, ch) in [
                    (&mut cid.send_cq, &mut cid.send_cq_channel),
                    (&mut cid.recv_cq, &mut cid.recv_cq_channel),
                ] {
                    if !cq.is_null() {
                        (v.destroy_cq)(*cq);
                        *cq = std::ptr::null_mut();
                    }
                    if !ch.is_null() {
                        (v.destroy_comp_channel)(*ch);
                        *ch = std::ptr::null_mut();
                    }
                }
            }
        }
        Ok(())
    });
}

/// `rdma_create_srq`: an SRQ on the id's device, used by its next QP.
///
/// # Safety
/// `id` is a live id with a device; `pd` NULL or a PD of it; `attr` readable and writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_create_srq(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> c_int {
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    rc(with_id(id, |cm, i| {
        let v = verbs().ok_or(libc::ENOSYS)?;
        // SAFETY: the id is live.
        let cid = unsafe { &mut (*cm.conns[&i].id).c };
        let pd = pd_for(cid, pd)?;
        // SAFETY: the program's attributes and a PD of the device.
        let srq = unsafe { (v.create_srq)(pd, attr) };
        if srq.is_null() {
            return Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL));
        }
        cid.srq = srq;
        cid.pd = pd;
        Ok(())
    }))
}

/// `rdma_create_srq_ex`: only plain SRQs (`IBV_SRQT_BASIC` with a PD); XRC SRQs and the
/// rest are EOPNOTSUPP.
///
/// # Safety
/// `id` is a live id; `attr` an `ibv_srq_init_attr_ex`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_create_srq_ex(
    id: *mut rdma_cm_id,
    attr: *mut SrqInitAttrEx,
) -> c_int {
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's contract.
    let a = unsafe { &mut *attr };
    const MASK_TYPE: u32 = 1;
    const MASK_PD: u32 = 2;
    if a.comp_mask & !(MASK_TYPE | MASK_PD) != 0
        || (a.comp_mask & MASK_TYPE != 0 && a.srq_type != 0)
    {
        return rc(Err(libc::EOPNOTSUPP));
    }
    let mut basic = ibv_srq_init_attr {
        srq_context: a.srq_context,
        attr: a.attr,
    };
    let pd = if a.comp_mask & MASK_PD != 0 {
        a.pd
    } else {
        std::ptr::null_mut()
    };
    // SAFETY: as above.
    let r = unsafe { sv_rdma_create_srq(id, pd, &mut basic) };
    a.attr = basic.attr;
    r
}

/// The head of `struct ibv_srq_init_attr_ex` that `rdma_create_srq_ex` reads.
#[repr(C)]
pub struct SrqInitAttrEx {
    pub srq_context: *mut core::ffi::c_void,
    pub attr: ibv_srq_attr,
    pub comp_mask: u32,
    pub srq_type: c_int,
    pub pd: *mut ibv_pd,
}

/// `rdma_destroy_srq`.
///
/// # Safety
/// `id` is a live id whose QP is gone.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_destroy_srq(id: *mut rdma_cm_id) {
    let _ = with_id(id, |cm, i| {
        let v = verbs().ok_or(libc::ENOSYS)?;
        // SAFETY: the id is live; its SRQ was made by rdma_create_srq.
        unsafe {
            let cid = &mut (*cm.conns[&i].id).c;
            if !cid.srq.is_null() {
                (v.destroy_srq)(cid.srq);
                cid.srq = std::ptr::null_mut();
            }
        }
        Ok(())
    });
}
