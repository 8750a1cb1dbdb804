//! Shared receive queues.

use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_create_srq(
    pd: *mut ibv_pd,
    init: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    if pd.is_null() || init.is_null() {
        return inval();
    }
    // SAFETY: a PD of ours and the caller's attributes.
    let (sv, ia) = unsafe { (&*(pd as *const SvPd), &mut *init) };
    let a = ia.attr;
    match sv.nic.create_srq(a.max_wr, a.max_sge, a.srq_limit) {
        Ok(nic) => {
            ia.attr = attr_out(&nic);
            // SAFETY: a PD of ours, whose context is open.
            unsafe { wrap_srq((*pd).context, pd, ia.srq_context, nic) }
        }
        Err(e) => null(e),
    }
}

/// `ibv_query_srq`'s view of `nic`.
pub(super) fn attr_out(nic: &softverbs_nic::qp::rq::Srq) -> ibv_srq_attr {
    let (max_wr, max_sge, srq_limit) = nic.attr();
    ibv_srq_attr {
        max_wr,
        max_sge,
        srq_limit,
    }
}

/// Hands SRQ `nic` of `pd` to C as an `ibv_srq` of `context`.
///
/// # Safety
/// `context` must be an open context of this library.
pub(super) unsafe fn wrap_srq(
    context: *mut ibv_context,
    pd: *mut ibv_pd,
    srq_context: *mut c_void,
    nic: Arc<softverbs_nic::qp::rq::Srq>,
) -> *mut ibv_srq {
    let id = nic.id();
    let srq = ibv_srq {
        context,
        srq_context,
        pd,
        handle: id,
        mutex: Default::default(),
        cond: Default::default(),
        events_completed: 0,
    };
    // SAFETY: the caller's open context.
    let reg = unsafe { ctx_of(context) }.reg.clone();
    let b = Box::into_raw(Box::new(SvSrq {
        srq,
        nic,
        reg: reg.clone(),
    }));
    Registry::set(&reg.srqs, id, b as usize);
    b as *mut ibv_srq
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    if srq.is_null() || attr.is_null() {
        return EINVAL;
    }
    // SAFETY: an SRQ of ours, and the caller's writable struct.
    unsafe { attr.write(attr_out(&(*(srq as *const SvSrq)).nic)) };
    0
}

/// `ibv_modify_srq`: `IBV_SRQ_LIMIT` arms the limit event (0 disarms); `IBV_SRQ_MAX_WR` (a
/// resize) and unknown bits are EINVAL: an SRQ's size is fixed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_modify_srq(
    srq: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    attr_mask: c_int,
) -> c_int {
    const SRQ_LIMIT: c_int = 1 << 1;
    if srq.is_null() || attr.is_null() || attr_mask != SRQ_LIMIT {
        return EINVAL;
    }
    // SAFETY: an SRQ of ours, and the caller's attribute struct.
    let (nic, limit) = unsafe { (&(*(srq as *const SvSrq)).nic, (*attr).srq_limit) };
    match nic.set_limit(limit) {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    if srq.is_null() {
        return EINVAL;
    }
    // A QP still receives through it: EBUSY, and it stays usable.
    // SAFETY: an SRQ of ours.
    if unsafe { &*(srq as *const SvSrq) }.nic.in_use() {
        return libc::EBUSY;
    }
    // SAFETY: `srq` came from `sv_ibv_create_srq` (Box::into_raw of an SvSrq).
    let b = unsafe { Box::from_raw(srq as *mut SvSrq) };
    Registry::set(&b.reg.srqs, b.nic.id(), 0);
    b.nic.release_uses();
    0
}
