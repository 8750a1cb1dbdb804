//! The new post-send API (`ibv_qp_ex`, `ibv_wr_*`).

use super::*;

/// `IBV_QP_INIT_ATTR_PD`, `..._CREATE_FLAGS` and `..._SEND_OPS_FLAGS`.
const QP_INIT_PD: u32 = 1;
/// `IBV_QP_INIT_ATTR_XRCD`.
const QP_INIT_XRCD: u32 = 1 << 1;
const QP_INIT_CREATE_FLAGS: u32 = 1 << 2;
const QP_INIT_SEND_OPS_FLAGS: u32 = 1 << 6;
/// `IBV_QP_EX_WITH_RDMA_WRITE` … `IBV_QP_EX_WITH_SEND_WITH_INV`, `IBV_QP_EX_WITH_FLUSH`
/// (rdma-core 45's bit 11) and `IBV_QP_EX_WITH_ATOMIC_WRITE`: the opcodes the `ibv_wr_*` API
/// supports here (all but TSO).
const SEND_OPS_SUPPORTED: u64 = ((1 << 10) - 1) | (1 << 11) | (1 << 12);

#[derive(Default)]
pub(super) struct Batch {
    wqes: Vec<SendWqe<'static>>,
    /// First error of the batch (an `ibv_wr_*` call out of order); `wr_complete` returns it.
    error: Option<c_int>,
}

pub(super) fn qp_ex(qp_base: ibv_qp) -> ibv_qp_ex {
    ibv_qp_ex {
        qp_base,
        comp_mask: 0,
        wr_id: 0,
        wr_flags: 0,
        wr_atomic_cmp_swp: Some(wr_atomic_cmp_swp),
        wr_atomic_fetch_add: Some(wr_atomic_fetch_add),
        wr_bind_mw: Some(wr_bind_mw),
        wr_local_inv: Some(wr_local_inv),
        wr_rdma_read: Some(wr_rdma_read),
        wr_rdma_write: Some(wr_rdma_write),
        wr_rdma_write_imm: Some(wr_rdma_write_imm),
        wr_send: Some(wr_send),
        wr_send_imm: Some(wr_send_imm),
        wr_send_inv: Some(wr_send_inv),
        wr_send_tso: None,
        wr_set_ud_addr: Some(wr_set_ud_addr),
        wr_set_xrc_srqn: Some(wr_set_xrc_srqn),
        wr_set_inline_data: Some(wr_set_inline_data),
        wr_set_inline_data_list: Some(wr_set_inline_data_list),
        wr_set_sge: Some(wr_set_sge),
        wr_set_sge_list: Some(wr_set_sge_list),
        wr_start: Some(wr_start),
        wr_complete: Some(wr_complete),
        wr_abort: Some(wr_abort),
        wr_atomic_write: Some(wr_atomic_write),
    }
}

/// `verbs_context::create_qp_ex`, reached by the header's inline `ibv_create_qp_ex`.
pub(super) unsafe extern "C" fn create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    if ctx.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &mut *attr };
    let known = QP_INIT_PD | QP_INIT_XRCD | QP_INIT_CREATE_FLAGS | QP_INIT_SEND_OPS_FLAGS;
    if a.qp_type == QpType::XrcRecv as c_int {
        if a.comp_mask & QP_INIT_XRCD == 0 || a.xrcd.is_null() {
            return inval();
        }
        // SAFETY: the caller's attributes, with an XRC domain of ours.
        return unsafe { super::xrc::create_target_qp(ctx, a) };
    }
    if a.comp_mask & QP_INIT_PD == 0 || a.pd.is_null() {
        return inval();
    }
    if a.comp_mask & !known != 0
        || (a.comp_mask & QP_INIT_CREATE_FLAGS != 0 && a.create_flags != 0)
        || (a.comp_mask & QP_INIT_SEND_OPS_FLAGS != 0
            && a.send_ops_flags & !SEND_OPS_SUPPORTED != 0)
    {
        set_errno(libc::EOPNOTSUPP);
        return null_mut();
    }
    // SAFETY: `struct ibv_qp_init_attr_ex` starts with the fields of `struct ibv_qp_init_attr`
    // (checked by tests/layout.rs), and create_qp writes back only `cap`.
    unsafe { sv_ibv_create_qp(a.pd, attr as *mut ibv_qp_init_attr) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    // Every QP of this library is an `ibv_qp_ex` (its first field is the `ibv_qp`).
    qp as *mut ibv_qp_ex
}

/// The wrapper and the batch of an `ibv_qp_ex`.
///
/// # Safety
/// `qp` must be a live QP of this library.
unsafe fn batch<'a>(qp: *mut ibv_qp_ex) -> (&'a SvQp, std::sync::MutexGuard<'a, Batch>) {
    // SAFETY: `qp` is the first field of an `SvQp`.
    let sv = unsafe { &*(qp as *const SvQp) };
    (sv, sv.batch.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Starts a work request with the `wr_id` and `wr_flags` the caller set on the QP.
///
/// # Safety
/// `qp` must be a live QP of this library.
unsafe fn begin(qp: *mut ibv_qp_ex, op: SendOp) {
    // SAFETY: forwarded.
    let (sv, mut b) = unsafe { batch(qp) };
    let wqe = SendWqe {
        wr_id: sv.qpx.wr_id,
        op,
        flags: SendFlags::from_bits_retain(sv.qpx.wr_flags),
        payload: Payload::Sges(Cow::Owned(Vec::new())),
        ud: None,
        xrc_srqn: 0,
    };
    b.wqes.push(wqe);
}

/// Applies `f` to the work request being built; records EINVAL if there is none.
///
/// # Safety
/// `qp` must be a live QP of this library.
pub(super) unsafe fn last(qp: *mut ibv_qp_ex, f: impl FnOnce(&mut SendWqe<'static>)) {
    // SAFETY: forwarded.
    let (_, mut b) = unsafe { batch(qp) };
    match b.wqes.last_mut() {
        Some(w) => f(w),
        None => {
            b.error.get_or_insert(EINVAL);
        }
    }
}

pub(super) unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    // SAFETY: the caller's QP.
    let (_, mut b) = unsafe { batch(qp) };
    *b = Batch::default();
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    // SAFETY: the caller's QP.
    let (_, mut b) = unsafe { batch(qp) };
    *b = Batch::default();
}

pub(super) unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    // SAFETY: the caller's QP.
    let (sv, mut b) = unsafe { batch(qp) };
    let batch = std::mem::take(&mut *b);
    drop(b);
    if let Some(e) = batch.error {
        return e;
    }
    match sv.nic.post_send(batch.wqes) {
        Ok(()) => 0,
        Err(e) => e.error.errno(),
    }
}

unsafe extern "C" fn wr_send(qp: *mut ibv_qp_ex) {
    // SAFETY: the caller's QP.
    unsafe { begin(qp, SendOp::Send) }
}

unsafe extern "C" fn wr_send_imm(qp: *mut ibv_qp_ex, imm: u32) {
    // SAFETY: the caller's QP.
    unsafe { begin(qp, SendOp::SendWithImm { imm }) }
}

unsafe extern "C" fn wr_send_inv(qp: *mut ibv_qp_ex, rkey: u32) {
    // SAFETY: the caller's QP.
    unsafe { begin(qp, SendOp::SendWithInv { rkey }) }
}

unsafe extern "C" fn wr_local_inv(qp: *mut ibv_qp_ex, rkey: u32) {
    // SAFETY: the caller's QP.
    unsafe { begin(qp, SendOp::LocalInv { rkey }) }
}

/// `ibv_wr_bind_mw`: a window or region that is not ours fails the batch (EINVAL at
/// `wr_complete`); the bind's rules are checked when it executes.
unsafe extern "C" fn wr_bind_mw(
    qp: *mut ibv_qp_ex,
    mw: *mut ibv_mw,
    rkey: u32,
    info: *const ibv_mw_bind_info,
) {
    // SAFETY: the caller's bind_info (NULL is refused by `bind_op`).
    match unsafe { super::mw::bind_op(mw, rkey, info) } {
        // SAFETY: the caller's QP.
        Ok(op) => unsafe { begin(qp, op) },
        Err(_) => {
            // SAFETY: as above.
            let (_, mut b) = unsafe { batch(qp) };
            b.error.get_or_insert(EINVAL);
        }
    }
}

unsafe extern "C" fn wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: the caller's QP.
    unsafe { begin(qp, SendOp::RdmaWrite { remote_addr, rkey }) }
}

unsafe extern "C" fn wr_rdma_write_imm(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64, imm: u32) {
    let op = SendOp::RdmaWriteWithImm {
        remote_addr,
        rkey,
        imm,
    };
    // SAFETY: the caller's QP.
    unsafe { begin(qp, op) }
}

unsafe extern "C" fn wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: the caller's QP.
    unsafe { begin(qp, SendOp::RdmaRead { remote_addr, rkey }) }
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    let op = SendOp::CmpSwap {
        remote_addr,
        rkey,
        compare,
        swap,
    };
    // SAFETY: the caller's QP.
    unsafe { begin(qp, op) }
}

unsafe extern "C" fn wr_atomic_fetch_add(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    add: u64,
) {
    let op = SendOp::FetchAdd {
        remote_addr,
        rkey,
        add,
    };
    // SAFETY: the caller's QP.
    unsafe { begin(qp, op) }
}

/// `ibv_wr_atomic_write`: the 8 bytes at `value` are read now.
unsafe extern "C" fn wr_atomic_write(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    value: *const c_void,
) {
    if value.is_null() {
        // SAFETY: the caller's QP.
        let (_, mut b) = unsafe { batch(qp) };
        b.error.get_or_insert(EINVAL);
        return;
    }
    let op = SendOp::AtomicWrite {
        remote_addr,
        rkey,
        // SAFETY: the caller's 8 readable bytes (the verbs contract of `atomic_wr`).
        value: unsafe { (value as *const u64).read_unaligned() },
    };
    // SAFETY: the caller's QP.
    unsafe { begin(qp, op) }
}

/// rdma-core 45's `ibv_wr_flush`: `type` `IBV_FLUSH_GLOBAL` (1) or `_PERSISTENT` (2),
/// `level` `IBV_FLUSH_RANGE` (0: `len` bytes at `remote_addr`) or `IBV_FLUSH_MR` (1: the
/// whole region). Persistent placement is refused at `wr_complete` (no persistent memory).
pub(super) unsafe extern "C" fn wr_flush(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    len: usize,
    kind: u8,
    level: u8,
) {
    let (Ok(len), true, true) = (u32::try_from(len), matches!(kind, 1 | 2), level <= 1) else {
        // SAFETY: the caller's QP.
        let (_, mut b) = unsafe { batch(qp) };
        b.error.get_or_insert(EINVAL);
        return;
    };
    let op = SendOp::Flush {
        remote_addr,
        rkey,
        len,
        whole_region: level == 1,
        persistent: kind == 2,
    };
    // SAFETY: the caller's QP.
    unsafe { begin(qp, op) }
}

unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    let sge = Sge { addr, length, lkey };
    // SAFETY: the caller's QP.
    unsafe { last(qp, |w| w.payload = Payload::Sges(Cow::Owned(vec![sge]))) }
}

unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    let Ok(n) = c_int::try_from(n) else {
        // SAFETY: the caller's QP.
        return unsafe { last(qp, |_| {}) };
    };
    // SAFETY: `qp` is the first field of an `SvQp` (the caller's QP).
    let max = unsafe { &*(qp as *const SvQp) }.nic.cap().max_send_sge;
    // SAFETY: the caller's list of `n` SGEs.
    match unsafe { sges(list, n, max) } {
        // SAFETY: the caller's QP.
        // The list is the caller's only for this call: the batch keeps a copy.
        Ok(s) => unsafe { last(qp, |w| w.payload = Payload::Sges(Cow::Owned(s.to_vec()))) },
        Err(_) => {
            // SAFETY: the caller's QP.
            let (_, mut b) = unsafe { batch(qp) };
            b.error.get_or_insert(EINVAL);
        }
    }
}

/// True if `length` inline bytes fit the QP's `max_inline_data`; if not, the batch fails
/// with EINVAL and the bytes are never read.
///
/// # Safety
/// `qp` must be a live QP of this library.
unsafe fn inline_fits(qp: *mut ibv_qp_ex, length: usize) -> bool {
    // SAFETY: forwarded.
    let (sv, mut b) = unsafe { batch(qp) };
    let fits = length <= sv.nic.cap().max_inline_data as usize;
    if !fits {
        b.error.get_or_insert(EINVAL);
    }
    fits
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    // SAFETY: the caller's QP.
    if !unsafe { inline_fits(qp, length) } {
        return;
    }
    let bytes = if length == 0 || addr.is_null() {
        Vec::new()
    } else {
        // SAFETY: inline data is copied now, from the caller's readable buffer.
        unsafe { std::slice::from_raw_parts(addr as *const u8, length) }.to_vec()
    };
    // SAFETY: the caller's QP.
    unsafe { last(qp, |w| w.payload = Payload::Inline(Cow::Owned(bytes))) }
}

unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut ibv_qp_ex,
    n: usize,
    list: *const ibv_data_buf,
) {
    let bufs = if n > 0 && !list.is_null() {
        // SAFETY: the caller's list of `n` buffers.
        unsafe { std::slice::from_raw_parts(list, n) }
    } else {
        &[]
    };
    let total = bufs.iter().fold(0usize, |t, b| t.saturating_add(b.length));
    // SAFETY: the caller's QP.
    if !unsafe { inline_fits(qp, total) } {
        return;
    }
    let mut bytes = Vec::with_capacity(total);
    for b in bufs {
        if b.length > 0 && !b.addr.is_null() {
            // SAFETY: each buffer is readable for its length during the call.
            bytes.extend_from_slice(unsafe {
                std::slice::from_raw_parts(b.addr as *const u8, b.length)
            });
        }
    }
    // SAFETY: the caller's QP.
    unsafe { last(qp, |w| w.payload = Payload::Inline(Cow::Owned(bytes))) }
}

/// `ibv_wr_set_xrc_srqn`: the XRC SRQ the work request being built goes to.
unsafe extern "C" fn wr_set_xrc_srqn(qp: *mut ibv_qp_ex, remote_srqn: u32) {
    // SAFETY: the caller's QP.
    unsafe { last(qp, |w| w.xrc_srqn = remote_srqn) }
}

unsafe extern "C" fn wr_set_ud_addr(
    qp: *mut ibv_qp_ex,
    ah: *mut ibv_ah,
    remote_qpn: u32,
    remote_qkey: u32,
) {
    if ah.is_null() {
        // SAFETY: the caller's QP.
        let (_, mut b) = unsafe { batch(qp) };
        b.error.get_or_insert(EINVAL);
        return;
    }
    // SAFETY: an address handle of ours.
    let ah = unsafe { &*(ah as *const SvAh) }.nic.clone();
    let dest = UdDest {
        ah,
        remote_qpn,
        remote_qkey,
    };
    // SAFETY: the caller's QP.
    unsafe { last(qp, |w| w.ud = Some(dest)) }
}
