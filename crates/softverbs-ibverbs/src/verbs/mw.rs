//! Memory windows: `ibv_alloc_mw`, `ibv_dealloc_mw` and `ibv_bind_mw` (the
//! `ibv_context_ops` slots the header's inlines call), and the conversion of a bind request
//! (`IBV_WR_BIND_MW`, `ibv_wr_bind_mw`) into the NIC's. The rules a bind must follow are
//! checked when it executes (`softverbs_nic::mr::window`): a broken one is an
//! `IBV_WC_MW_BIND_ERR` completion, as on hardware.

use super::*;
use softverbs_nic::pd::{Mw, MwType, inc_rkey};

#[repr(C)]
struct SvMw {
    mw: ibv_mw,
    nic: Mw,
}

/// Addresses of the live `SvMw`s: a bind names its window by a pointer the program passes,
/// which is checked against this set before it is read.
fn live_mws() -> &'static RwLock<HashSet<usize>> {
    static LIVE: OnceLock<RwLock<HashSet<usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Runs `f` on the NIC window of `mw` when it is a live window of ours.
fn with_live_mw<R>(mw: *mut ibv_mw, f: impl FnOnce(&Mw) -> R) -> Option<R> {
    let live = live_mws().read().unwrap_or_else(|e| e.into_inner());
    if mw.is_null() || !live.contains(&(mw as usize)) {
        return None;
    }
    // SAFETY: a live SvMw of ours; freeing it needs the write lock we keep it from.
    Some(f(&unsafe { &*(mw as *const SvMw) }.nic))
}

/// `ops.alloc_mw`.
pub(super) unsafe extern "C" fn alloc_mw(pd: *mut ibv_pd, kind: c_int) -> *mut ibv_mw {
    let kind = match kind {
        1 => MwType::Type1,
        2 => MwType::Type2,
        _ => return inval(),
    };
    // SAFETY: the caller's PD.
    let Some(nic_pd) = (unsafe { nic_pd(pd) }) else {
        return inval();
    };
    let nic = match nic_pd.alloc_mw(kind) {
        Ok(m) => m,
        Err(e) => return null(e),
    };
    let mw = ibv_mw {
        // SAFETY: a PD of ours.
        context: unsafe { (*pd).context },
        pd,
        rkey: nic.rkey(),
        handle: nic.handle(),
        type_: kind as c_int,
    };
    let p = Box::into_raw(Box::new(SvMw { mw, nic }));
    live_mws()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(p as usize);
    p as *mut ibv_mw
}

/// `ops.dealloc_mw`: unbinds and frees the window.
pub(super) unsafe extern "C" fn dealloc_mw(mw: *mut ibv_mw) -> c_int {
    let mut live = live_mws().write().unwrap_or_else(|e| e.into_inner());
    if mw.is_null() || !live.remove(&(mw as usize)) {
        return EINVAL;
    }
    drop(live);
    // SAFETY: `mw` came from `alloc_mw` (Box::into_raw of an SvMw) and was live until now.
    drop(unsafe { Box::from_raw(mw as *mut SvMw) });
    0
}

/// The NIC's bind of window `mw` to `info` with rkey `rkey`, or EINVAL for a window or
/// region that is not ours (`info.mr` NULL with length 0 unbinds a type-1 window).
///
/// # Safety
/// `info` must be a readable `struct ibv_mw_bind_info`.
pub(super) unsafe fn bind_op(
    mw: *mut ibv_mw,
    rkey: u32,
    info: *const ibv_mw_bind_info,
) -> Result<SendOp> {
    let bad = |m: &str| Error::InvalidArgument(m.to_string());
    let window = with_live_mw(mw, |m| m.handle()).ok_or_else(|| bad("not a memory window"))?;
    if info.is_null() {
        return Err(bad("no bind_info"));
    }
    // SAFETY: the caller's.
    let i = unsafe { &*info };
    let mr = if i.mr.is_null() {
        if i.length != 0 {
            return Err(bad("a bind of length > 0 needs a region"));
        }
        0
    } else {
        with_live_mr(i.mr, |_, m| m.key()).ok_or_else(|| bad("not a memory region"))?
    };
    Ok(SendOp::BindMw {
        window,
        rkey,
        mr,
        addr: i.addr,
        length: i.length,
        access: AccessFlags::from_bits_retain(i.mw_access_flags),
    })
}

/// `ops.bind_mw` (`ibv_bind_mw`, type 1): posts the bind on `qp` with the next rkey, which
/// `mw->rkey` holds from now on (the bind takes effect when it executes, in the QP's order).
pub(super) unsafe extern "C" fn bind_mw(
    qp: *mut ibv_qp,
    mw: *mut ibv_mw,
    bind: *mut ibv_mw_bind,
) -> c_int {
    if qp.is_null() || mw.is_null() || bind.is_null() {
        return EINVAL;
    }
    // SAFETY: the caller's window (checked live by `bind_op` before anything else is used).
    let Some(kind) = with_live_mw(mw, |m| m.kind()) else {
        return EINVAL;
    };
    if kind != MwType::Type1 {
        return EINVAL;
    }
    // SAFETY: a live window of ours.
    let rkey = inc_rkey(unsafe { (*mw).rkey });
    // SAFETY: the caller's bind request.
    let b = unsafe { &*bind };
    // SAFETY: as above.
    let op = match unsafe { bind_op(mw, rkey, &b.bind_info) } {
        Ok(op) => op,
        Err(e) => return e.errno(),
    };
    let wqe = SendWqe {
        wr_id: b.wr_id,
        op,
        flags: SendFlags::from_bits_retain(b.send_flags),
        payload: Payload::Sges(Cow::Owned(Vec::new())),
        ud: None,
        xrc_srqn: 0,
    };
    // SAFETY: a QP of ours.
    let sv = unsafe { &*(qp as *const SvQp) };
    match sv.nic.post_send([wqe]) {
        Ok(()) => {
            // SAFETY: a live window of ours.
            unsafe { (*mw).rkey = rkey };
            with_live_mw(mw, |m| m.set_rkey(rkey));
            0
        }
        Err(e) => e.error.errno(),
    }
}
