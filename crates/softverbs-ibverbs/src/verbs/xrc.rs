//! XRC through `verbs_context`: `ibv_open_xrcd`/`ibv_close_xrcd`, XRC SRQs
//! (`ibv_create_srq_ex`, `ibv_get_srq_num`), target QPs (`ibv_create_qp_ex` with
//! `IBV_QP_INIT_ATTR_XRCD`) and `ibv_open_qp`. The model is `softverbs_nic::qp::xrc`.

use super::srq::{attr_out, wrap_srq};
use super::*;
use softverbs_nic::qp::xrc::{Xrcd, XrcdOpen};

/// `IBV_XRCD_INIT_ATTR_FD`, `..._OFLAGS`.
const XRCD_FD: u32 = 1;
const XRCD_OFLAGS: u32 = 1 << 1;
/// `IBV_SRQ_INIT_ATTR_TYPE`, `_PD`, `_XRCD`, `_CQ` (`_TM` is not offered).
const SRQ_TYPE: u32 = 1;
const SRQ_PD: u32 = 1 << 1;
const SRQ_XRCD: u32 = 1 << 2;
const SRQ_CQ: u32 = 1 << 3;
/// `IBV_SRQT_BASIC`, `IBV_SRQT_XRC`.
const SRQT_BASIC: c_int = 0;
const SRQT_XRC: c_int = 1;
/// `IBV_QP_OPEN_ATTR_NUM`, `_XRCD`, `_CONTEXT`, `_TYPE`.
const OPEN_NUM: u32 = 1;
const OPEN_XRCD: u32 = 1 << 1;
const OPEN_CONTEXT: u32 = 1 << 2;
const OPEN_TYPE: u32 = 1 << 3;

#[repr(C)]
struct SvXrcd {
    xrcd: ibv_xrcd,
    nic: Arc<Xrcd>,
}

/// The domain behind an `ibv_xrcd` of ours.
///
/// # Safety
/// `x` must be NULL or a live domain of this library.
unsafe fn nic_xrcd<'a>(x: *mut ibv_xrcd) -> Option<&'a Arc<Xrcd>> {
    // SAFETY: the caller's.
    (!x.is_null()).then(|| &unsafe { &*(x as *const SvXrcd) }.nic)
}

pub(super) unsafe extern "C" fn open_xrcd(
    ctx: *mut ibv_context,
    attr: *mut ibv_xrcd_init_attr,
) -> *mut ibv_xrcd {
    if ctx.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &*attr };
    // As the kernel's: the mask must say both, and only the two flags are meaningful.
    if a.comp_mask & !(XRCD_FD | XRCD_OFLAGS) != 0 || a.comp_mask & XRCD_OFLAGS == 0 {
        return inval();
    }
    if a.oflags & !(libc::O_CREAT | libc::O_EXCL) != 0 {
        return inval();
    }
    let how = XrcdOpen {
        create: a.oflags & libc::O_CREAT != 0,
        exclusive: a.oflags & libc::O_EXCL != 0,
    };
    let fd = (a.comp_mask & XRCD_FD != 0 && a.fd != -1).then_some(a.fd);
    if fd.is_some_and(|f| f < 0) {
        return inval();
    }
    // SAFETY: the caller's open descriptor, borrowed for the call.
    let file = fd.map(|f| unsafe { std::os::fd::BorrowedFd::borrow_raw(f) });
    // SAFETY: a context of ours, open.
    match unsafe { ctx_of(ctx) }.nic.open_xrcd(file, how) {
        Ok(nic) => Box::into_raw(Box::new(SvXrcd {
            xrcd: ibv_xrcd { context: ctx },
            nic,
        })) as *mut ibv_xrcd,
        Err(e) => null(e),
    }
}

pub(super) unsafe extern "C" fn close_xrcd(xrcd: *mut ibv_xrcd) -> c_int {
    // SAFETY: a domain of ours, or NULL.
    let Some(nic) = (unsafe { nic_xrcd(xrcd) }) else {
        return EINVAL;
    };
    if nic.in_use() {
        return libc::EBUSY;
    }
    // SAFETY: `xrcd` came from `open_xrcd` (Box::into_raw of an SvXrcd).
    drop(unsafe { Box::from_raw(xrcd as *mut SvXrcd) });
    0
}

pub(super) unsafe extern "C" fn create_srq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_srq_init_attr_ex,
) -> *mut ibv_srq {
    if ctx.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &mut *attr };
    if a.comp_mask & !(SRQ_TYPE | SRQ_PD | SRQ_XRCD | SRQ_CQ) != 0 {
        // Tag matching (`IBV_SRQ_INIT_ATTR_TM`) and unknown bits.
        set_errno(libc::EOPNOTSUPP);
        return null_mut();
    }
    let srq_type = if a.comp_mask & SRQ_TYPE != 0 {
        a.srq_type
    } else {
        SRQT_BASIC
    };
    // SAFETY: a PD of ours (or a parent domain), or NULL.
    let Some(pd) = (a.comp_mask & SRQ_PD != 0)
        .then(|| unsafe { nic_pd(a.pd) })
        .flatten()
    else {
        return inval();
    };
    let r = &a.attr;
    let nic = match srq_type {
        SRQT_BASIC => pd.create_srq(r.max_wr, r.max_sge, r.srq_limit),
        SRQT_XRC => {
            if a.comp_mask & (SRQ_XRCD | SRQ_CQ) != SRQ_XRCD | SRQ_CQ || a.cq.is_null() {
                return inval();
            }
            // SAFETY: a domain of ours, or NULL.
            let Some(xrcd) = (unsafe { nic_xrcd(a.xrcd) }) else {
                return inval();
            };
            // SAFETY: a CQ of ours.
            let cq = unsafe { &(*(a.cq as *const SvCq)).nic };
            pd.create_xrc_srq(xrcd, cq, r.max_wr, r.max_sge, r.srq_limit)
        }
        // IBV_SRQT_TM and anything else.
        _ => {
            set_errno(libc::EOPNOTSUPP);
            return null_mut();
        }
    };
    match nic {
        Ok(nic) => {
            a.attr = attr_out(&nic);
            // SAFETY: a context of ours, open.
            unsafe { wrap_srq(ctx, a.pd, a.srq_context, nic) }
        }
        Err(e) => null(e),
    }
}

pub(super) unsafe extern "C" fn get_srq_num(srq: *mut ibv_srq, srq_num: *mut u32) -> c_int {
    if srq.is_null() || srq_num.is_null() {
        return EINVAL;
    }
    // SAFETY: an SRQ of ours.
    match unsafe { &*(srq as *const SvSrq) }.nic.srq_num() {
        Some(n) => {
            // SAFETY: the caller's writable word.
            unsafe { srq_num.write(n) };
            0
        }
        // Not an XRC SRQ: it has no number.
        None => EINVAL,
    }
}

/// `ibv_create_qp_ex` of an `IBV_QPT_XRC_RECV` QP. A target QP has no queues: the caps the
/// program asked for are ignored (as the kernel does) and reported as zero.
///
/// # Safety
/// `ctx` must be an open context of ours, `a` the caller's attributes naming a domain.
pub(super) unsafe fn create_target_qp(
    ctx: *mut ibv_context,
    a: &mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    // SAFETY: the caller's domain.
    let Some(xrcd) = (unsafe { nic_xrcd(a.xrcd) }) else {
        return inval();
    };
    match xrcd.create_qp(QpCap::default()) {
        Ok(nic) => {
            a.cap = ibv_qp_cap::default();
            // SAFETY: the caller's open context.
            unsafe { wrap_qp(ctx, QpPtrs::NONE, a.qp_context, nic, false) }
        }
        Err(e) => null(e),
    }
}

pub(super) unsafe extern "C" fn open_qp(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_open_attr,
) -> *mut ibv_qp {
    if ctx.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &*attr };
    let need = OPEN_NUM | OPEN_XRCD | OPEN_TYPE;
    if a.comp_mask & need != need || a.comp_mask & !(need | OPEN_CONTEXT) != 0 {
        return inval();
    }
    if a.qp_type != QpType::XrcRecv as c_int {
        return inval();
    }
    // SAFETY: the caller's domain.
    let Some(xrcd) = (unsafe { nic_xrcd(a.xrcd) }) else {
        return inval();
    };
    let qp_context = if a.comp_mask & OPEN_CONTEXT != 0 {
        a.qp_context
    } else {
        null_mut()
    };
    match xrcd.open_qp(a.qp_num) {
        Ok(nic) => {
            // SAFETY: the caller's open context.
            unsafe { wrap_qp(ctx, QpPtrs::NONE, qp_context, nic, true) }
        }
        Err(e) => null(e),
    }
}
