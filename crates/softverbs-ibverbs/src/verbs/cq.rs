//! Completion channels and CQs, classic and extended (`ibv_cq_ex`), and polling.

use super::*;

/// Maps a NIC CQ (by `Arc` address) to the `ibv_cq` handed to C, for `ibv_get_cq_event`.
fn cq_map() -> &'static Mutex<HashMap<usize, usize>> {
    static MAP: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    MAP.get_or_init(Default::default)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_create_comp_channel(
    ctx: *mut ibv_context,
) -> *mut ibv_comp_channel {
    if ctx.is_null() {
        return inval();
    }
    match Channel::new() {
        Ok(nic) => {
            let own = reopen_blocking(nic.fd().as_raw_fd());
            let ch = ibv_comp_channel {
                context: ctx,
                fd: own.as_ref().map_or(nic.fd().as_raw_fd(), |f| f.as_raw_fd()),
                refcnt: 0,
            };
            Box::into_raw(Box::new(SvChannel {
                ch,
                nic,
                own_fd: own,
            })) as *mut ibv_comp_channel
        }
        Err(e) => null(e),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    if ch.is_null() {
        return EINVAL;
    }
    // SAFETY: `ch` came from `sv_ibv_create_comp_channel`.
    if unsafe { (*ch).refcnt } > 0 {
        return libc::EBUSY;
    }
    // SAFETY: as above; Box::into_raw of an SvChannel.
    drop(unsafe { Box::from_raw(ch as *mut SvChannel) });
    0
}

/// The `ibv_cq` pointers handed out and not yet destroyed, so the softverbs extensions (and
/// `ibv_destroy_cq`) answer EINVAL for a pointer that is not a live CQ instead of reading it.
fn live_cqs() -> &'static std::sync::RwLock<std::collections::HashSet<usize>> {
    static LIVE: OnceLock<std::sync::RwLock<std::collections::HashSet<usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Runs `f` on the NIC CQ behind `cq` when `cq` is a live CQ of ours; None otherwise (NULL,
/// destroyed, or not from this library). The CQ cannot be destroyed while `f` runs.
pub(crate) fn with_live_cq<R>(cq: *mut ibv_cq, f: impl FnOnce(&Cq) -> R) -> Option<R> {
    let live = live_cqs().read().unwrap_or_else(|e| e.into_inner());
    if cq.is_null() || !live.contains(&(cq as usize)) {
        return None;
    }
    // SAFETY: a live SvCq of ours; destroying it needs the write lock we keep it from.
    Some(f(&unsafe { &*(cq as *const SvCq) }.nic))
}

/// `IBV_CQ_INIT_ATTR_MASK_FLAGS` and `IBV_CQ_INIT_ATTR_MASK_PD`.
const CQ_INIT_FLAGS: u32 = 1;
const CQ_INIT_PD: u32 = 1 << 1;
/// `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`: a hint; every CQ here is safe either way.
const CQ_ATTR_SINGLE_THREADED: u32 = 1;

/// Creates a CQ (plain or extended) and records it for events.
///
/// The NIC CQ returns the fields in `wc_flags` (already checked against
/// `WcExFlags::SUPPORTED`), which also fix its compact-record layout for `ibv_poll_cq_ex`.
///
/// # Safety
/// `ctx` must be a context of ours and `channel` NULL or a channel of ours.
unsafe fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    wc_flags: softverbs_nic::types::WcExFlags,
) -> *mut SvCq {
    if ctx.is_null() || cqe < 1 {
        return inval();
    }
    let nic_ch = if channel.is_null() {
        None
    } else {
        // SAFETY: `channel` came from `sv_ibv_create_comp_channel`.
        Some(unsafe { &*(channel as *const SvChannel) }.nic.clone())
    };
    // SAFETY: a context of ours.
    let sv_ctx = unsafe { ctx_of(ctx) };
    let nic = match sv_ctx.nic.create_cq_ex(cqe as u32, nic_ch, wc_flags) {
        Ok(c) => c,
        Err(e) => return null(e),
    };
    let cqx = ibv_cq_ex {
        context: ctx,
        channel,
        cq_context,
        handle: nic.id(),
        cqe: nic.capacity().min(i32::MAX as u32) as c_int,
        mutex: Default::default(),
        cond: Default::default(),
        comp_events_completed: 0,
        async_events_completed: 0,
        comp_mask: 0,
        status: 0,
        wr_id: 0,
        start_poll: Some(cqx_start_poll),
        next_poll: Some(cqx_next_poll),
        end_poll: Some(cqx_end_poll),
        read_opcode: Some(cqx_read_opcode),
        read_vendor_err: Some(cqx_read_vendor_err),
        read_byte_len: Some(cqx_read_byte_len),
        read_imm_data: Some(cqx_read_imm_data),
        read_qp_num: Some(cqx_read_qp_num),
        read_src_qp: Some(cqx_read_src_qp),
        read_wc_flags: Some(cqx_read_wc_flags),
        read_slid: Some(cqx_read_slid),
        read_sl: Some(cqx_read_sl),
        read_dlid_path_bits: Some(cqx_read_dlid_path_bits),
        read_completion_ts: Some(cqx_read_completion_ts),
        read_cvlan: None,
        read_flow_tag: None,
        read_tm_info: None,
        read_completion_wallclock_ns: Some(cqx_read_completion_wallclock_ns),
    };
    let key = Arc::as_ptr(&nic) as usize;
    let id = nic.id();
    let b = Box::into_raw(Box::new(SvCq {
        cqx,
        cur: UnsafeCell::new(Cqe::default()),
        nic,
        reg: sv_ctx.reg.clone(),
    }));
    cq_map()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, b as usize);
    Registry::set(&sv_ctx.reg.cqs, id, b as usize);
    live_cqs()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(b as usize);
    if !channel.is_null() {
        // SAFETY: a channel of ours.
        unsafe { (*channel).refcnt += 1 };
    }
    b
}

/// True if `ctx` has completion vector `v` (`0..num_comp_vectors`); the kernel refuses
/// others with EINVAL.
///
/// # Safety
/// `ctx` is NULL or a context of ours.
unsafe fn comp_vector_exists(ctx: *mut ibv_context, v: i64) -> bool {
    // SAFETY: as documented.
    !ctx.is_null() && (0..i64::from(unsafe { (*ctx).num_comp_vectors })).contains(&v)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    // SAFETY: a context of ours, or NULL.
    if !unsafe { comp_vector_exists(ctx, i64::from(comp_vector)) } {
        return inval();
    }
    // SAFETY: forwarded caller arguments.
    unsafe {
        create_cq(
            ctx,
            cqe,
            cq_context,
            channel,
            softverbs_nic::types::WcExFlags::STANDARD,
        ) as *mut ibv_cq
    }
}

/// `verbs_context::create_cq_ex`, reached by the header's inline `ibv_create_cq_ex`.
pub(super) unsafe extern "C" fn create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    if ctx.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &*attr };
    if a.comp_mask & !(CQ_INIT_FLAGS | CQ_INIT_PD) != 0 {
        return inval();
    }
    let supported = softverbs_nic::types::WcExFlags::SUPPORTED;
    if a.wc_flags & !supported.bits() != 0
        || (a.comp_mask & CQ_INIT_FLAGS != 0 && a.flags & !CQ_ATTR_SINGLE_THREADED != 0)
    {
        set_errno(libc::EOPNOTSUPP);
        return null_mut();
    }
    // A CQ may name a parent domain (for its thread domain and allocators, neither of which
    // changes a softverbs CQ); anything else there is EINVAL.
    // SAFETY: a PD of ours, or NULL.
    if a.comp_mask & CQ_INIT_PD != 0
        && !unsafe { super::domain::is_parent_of(a.parent_domain, ctx) }
    {
        return inval();
    }
    let Ok(cqe) = c_int::try_from(a.cqe) else {
        return inval();
    };
    // SAFETY: a context of ours.
    if !unsafe { comp_vector_exists(ctx, i64::from(a.comp_vector)) } {
        return inval();
    }
    let wc_flags = softverbs_nic::types::WcExFlags::from_bits_truncate(a.wc_flags);
    // SAFETY: a context of ours; the channel is the caller's (NULL or ours).
    unsafe { create_cq(ctx, cqe, a.cq_context, a.channel, wc_flags) as *mut ibv_cq_ex }
}

/// Takes the next completion into the CQ's cursor and its `status` / `wr_id` fields.
///
/// # Safety
/// `cq` must be a CQ of ours, polled by this thread between `start_poll` and `end_poll`.
unsafe fn cqx_take(cq: *mut ibv_cq_ex) -> c_int {
    let sv = cq as *mut SvCq;
    let mut got = None;
    // SAFETY: a CQ of ours; only `nic` is borrowed shared.
    unsafe { &(*sv).nic }.poll_with(1, |c| got = Some(*c));
    let Some(c) = got else {
        return libc::ENOENT;
    };
    // SAFETY: the caller owns the polling cursor and the `status`/`wr_id` fields now.
    unsafe {
        *(*sv).cur.get() = c;
        (*cq).status = c_int::from(c.status);
        (*cq).wr_id = c.wr_id;
    }
    0
}

/// The completion the cursor holds.
///
/// # Safety
/// `cq` must be a CQ of ours inside a `start_poll` … `end_poll` section.
unsafe fn cqx_cur(cq: *mut ibv_cq_ex) -> Cqe {
    // SAFETY: as documented.
    unsafe { *(*(cq as *const SvCq)).cur.get() }
}

unsafe extern "C" fn cqx_start_poll(cq: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    // SAFETY: the caller's attribute struct (NULL tolerated).
    if cq.is_null() || (!attr.is_null() && unsafe { (*attr).comp_mask } != 0) {
        return EINVAL;
    }
    // SAFETY: a CQ of ours.
    unsafe { cqx_take(cq) }
}

unsafe extern "C" fn cqx_next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_take(cq) }
}

unsafe extern "C" fn cqx_end_poll(_cq: *mut ibv_cq_ex) {}

unsafe extern "C" fn cqx_read_opcode(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: a CQ of ours inside a polling section.
    c_int::from(unsafe { cqx_cur(cq) }.opcode)
}

unsafe extern "C" fn cqx_read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_cur(cq) }.vendor_err
}

unsafe extern "C" fn cqx_read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_cur(cq) }.byte_len
}

unsafe extern "C" fn cqx_read_imm_data(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_cur(cq) }.imm_data
}

unsafe extern "C" fn cqx_read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_cur(cq) }.qp_num
}

unsafe extern "C" fn cqx_read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_cur(cq) }.src_qp
}

unsafe extern "C" fn cqx_read_wc_flags(cq: *mut ibv_cq_ex) -> c_uint {
    // SAFETY: a CQ of ours inside a polling section.
    c_uint::from(unsafe { cqx_cur(cq) }.wc_flags)
}

unsafe extern "C" fn cqx_read_slid(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: a CQ of ours inside a polling section.
    u32::from(unsafe { cqx_cur(cq) }.slid)
}

unsafe extern "C" fn cqx_read_sl(cq: *mut ibv_cq_ex) -> u8 {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_cur(cq) }.sl
}

unsafe extern "C" fn cqx_read_dlid_path_bits(cq: *mut ibv_cq_ex) -> u8 {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_cur(cq) }.dlid_path_bits
}

unsafe extern "C" fn cqx_read_completion_ts(cq: *mut ibv_cq_ex) -> u64 {
    // SAFETY: a CQ of ours inside a polling section.
    unsafe { cqx_cur(cq) }.timestamp
}

/// The completion's time in `CLOCK_REALTIME` nanoseconds, converted by the device clock's
/// wall-clock reading (the same conversion the Rust cursors and `poll_ex` use).
unsafe extern "C" fn cqx_read_completion_wallclock_ns(cq: *mut ibv_cq_ex) -> u64 {
    // SAFETY: a CQ of ours inside a polling section.
    let (ts, clock) = unsafe { (cqx_cur(cq).timestamp, *(*(cq as *const SvCq)).nic.clock()) };
    clock.wall().ns(ts)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    let mut live = live_cqs().write().unwrap_or_else(|e| e.into_inner());
    // NULL, already destroyed or not ours: EINVAL rather than freeing what we never made.
    if !live.contains(&(cq as usize)) {
        return EINVAL;
    }
    // A QP still completes into it: EBUSY, and it stays usable.
    // SAFETY: a live CQ of ours (the write lock keeps it so).
    if unsafe { &*(cq as *const SvCq) }.nic.in_use() {
        return libc::EBUSY;
    }
    live.remove(&(cq as usize));
    drop(live);
    // SAFETY: `cq` came from `create_cq` (Box::into_raw of an SvCq) and was live until now.
    let b = unsafe { Box::from_raw(cq as *mut SvCq) };
    Registry::set(&b.reg.cqs, b.nic.id(), 0);
    cq_map()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(Arc::as_ptr(&b.nic) as usize));
    if !b.cqx.channel.is_null() {
        // SAFETY: the CQ's channel outlives it (destroying it first fails with EBUSY).
        unsafe { (*b.cqx.channel).refcnt -= 1 };
    }
    0
}

/// `ibv_resize_cq`: at least `cqe` entries, the new size in `cq->cqe`. Completions already
/// queued are kept; peers in other processes move to the new ring (see the NIC's `Cq::resize`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    let Ok(cqe) = u32::try_from(cqe) else {
        return EINVAL;
    };
    with_live_cq(cq, |nic| match nic.resize(cqe) {
        Ok(n) => {
            // SAFETY: a live CQ of ours (with_live_cq checked); no other field is touched.
            unsafe { (*cq).cqe = c_int::try_from(n).unwrap_or(c_int::MAX) };
            0
        }
        Err(e) => e.errno(),
    })
    .unwrap_or(EINVAL)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_get_cq_event(
    ch: *mut ibv_comp_channel,
    cq_out: *mut *mut ibv_cq,
    ctx_out: *mut *mut c_void,
) -> c_int {
    if ch.is_null() || cq_out.is_null() || ctx_out.is_null() {
        set_errno(EINVAL);
        return -1;
    }
    // SAFETY: a channel of ours.
    let sv = unsafe { &*(ch as *const SvChannel) };
    // Waits unless the program made the channel's descriptor non-blocking.
    let wait = sv.own_fd.is_none() || blocking(sv.ch.fd);
    let nic_cq = loop {
        match sv.nic.get_event(false) {
            Ok(c) => break c,
            Err(Error::WouldBlock) if wait => {
                if let Err(e) = wait_rung(sv.ch.fd) {
                    set_errno(e);
                    return -1;
                }
            }
            Err(e) => {
                set_errno(e.errno());
                return -1;
            }
        }
    };
    let map = cq_map().lock().unwrap_or_else(|e| e.into_inner());
    let Some(&p) = map.get(&(Arc::as_ptr(&nic_cq) as usize)) else {
        set_errno(libc::ENOENT);
        return -1;
    };
    let cq = p as *mut ibv_cq;
    // SAFETY: caller's out-pointers; `cq` is live while it is in the map.
    unsafe {
        *cq_out = cq;
        *ctx_out = (*cq).cq_context;
    }
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_ack_cq_events(cq: *mut ibv_cq, n: c_uint) {
    if cq.is_null() {
        return;
    }
    // SAFETY: a CQ of ours.
    let sv = unsafe { &mut *(cq as *mut SvCq) };
    sv.nic.ack_events(n);
    sv.cqx.comp_events_completed = sv.cqx.comp_events_completed.wrapping_add(n);
}

pub(super) unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    if cq.is_null() || n < 0 || (wc.is_null() && n > 0) {
        return -EINVAL;
    }
    // SAFETY: a CQ of ours.
    let sv = unsafe { &*(cq as *const SvCq) };
    let mut i = 0usize;
    sv.nic.poll_with(n as usize, |c: &Cqe| {
        let out = ibv_wc {
            wr_id: c.wr_id,
            status: c_int::from(c.status),
            opcode: c_int::from(c.opcode),
            vendor_err: c.vendor_err,
            byte_len: c.byte_len,
            imm_data: c.imm_data,
            qp_num: c.qp_num,
            src_qp: c.src_qp,
            wc_flags: c_uint::from(c.wc_flags),
            pkey_index: c.pkey_index,
            slid: c.slid,
            sl: c.sl,
            dlid_path_bits: c.dlid_path_bits,
        };
        // SAFETY: the caller's array has `n` entries and i < n.
        unsafe { wc.add(i).write(out) };
        i += 1;
    });
    i as c_int
}

pub(super) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    if cq.is_null() {
        return EINVAL;
    }
    // SAFETY: a CQ of ours.
    rc(unsafe { &*(cq as *const SvCq) }
        .nic
        .req_notify(solicited_only != 0))
}
