//! Devices: the list, opening, the port and device queries (classic and extended), GIDs and P_Keys, fork support.

use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    let list = match devices() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("libibverbs (softverbs): {e}");
            return null(e);
        }
    };
    // SAFETY: calloc of (n + 1) pointers; checked for NULL below.
    let arr = unsafe { libc::calloc(list.len() + 1, size_of::<*mut ibv_device>()) }
        as *mut *mut ibv_device;
    if arr.is_null() {
        set_errno(libc::ENOMEM);
        return null_mut();
    }
    for (i, d) in list.iter().enumerate() {
        // SAFETY: `arr` has room for list.len() + 1 entries.
        unsafe { *arr.add(i) = &d.dev as *const ibv_device as *mut ibv_device };
    }
    if !num.is_null() {
        // SAFETY: the caller passes a valid `int *` or NULL.
        unsafe { *num = list.len() as c_int };
    }
    arr
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: `list` came from `sv_ibv_get_device_list` (calloc) or is NULL.
    unsafe { libc::free(list as *mut c_void) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    match find_device(device) {
        Some(d) => d.dev.name.as_ptr(),
        None => {
            set_errno(EINVAL);
            std::ptr::null()
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_get_device_guid(device: *mut ibv_device) -> u64 {
    find_device(device).map_or(0, |d| d.nic.config().node_guid.to_be())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_get_device_index(device: *mut ibv_device) -> c_int {
    find_device(device).map_or(-1, |d| d.index)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    let Some(d) = find_device(device) else {
        return inval();
    };
    match Context::open(d.nic.clone()) {
        // SAFETY: one of our devices, and a context opened on it.
        Ok(nic) => unsafe { wrap_context(device, nic) },
        Err(e) => null(e),
    }
}

/// `ibv_import_device`: the context of our command descriptor `cmd_fd` (which this context
/// then owns, as rdma-core's does: it is closed here once imported, the context keeping a
/// descriptor of its own as `cmd_fd`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_import_device(cmd_fd: c_int) -> *mut ibv_context {
    if cmd_fd < 0 {
        return inval();
    }
    // SAFETY: the caller's descriptor, borrowed for the call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(cmd_fd) };
    let nic = match Context::import(fd) {
        Ok(c) => c,
        Err(e) => return null(e),
    };
    let Some(d) = devices()
        .ok()
        .and_then(|l| l.iter().find(|d| Arc::ptr_eq(&d.nic, nic.device())))
    else {
        return inval();
    };
    // SAFETY: the caller handed the descriptor over; our context holds its own.
    unsafe { libc::close(cmd_fd) };
    // SAFETY: one of our devices, and a context on it.
    unsafe { wrap_context(&d.dev as *const ibv_device as *mut ibv_device, nic) }
}

/// Hands context `nic` of `device` to C.
///
/// # Safety
/// `device` must be one of ours, the device `nic` is open on.
unsafe fn wrap_context(device: *mut ibv_device, nic: Arc<Context>) -> *mut ibv_context {
    let ops = ibv_context_ops {
        _compat0: [None; 7],
        alloc_mw: Some(mw::alloc_mw),
        bind_mw: Some(mw::bind_mw),
        dealloc_mw: Some(mw::dealloc_mw),
        _compat0b: None,
        poll_cq: Some(poll_cq),
        req_notify_cq: Some(req_notify_cq),
        _compat1: [None; 7],
        post_srq_recv: Some(post_srq_recv),
        _compat2: [None; 4],
        post_send: Some(post_send),
        post_recv: Some(post_recv),
        _compat3: [None; 5],
    };
    let async_own = reopen_blocking(nic.events().fd().as_raw_fd());
    let vctx = verbs_context {
        create_qp_ex: Some(create_qp_ex),
        query_port: Some(vctx_query_port),
        advise_mr: Some(super::mr::advise_mr),
        _ex0a: [None; 5],
        reg_dm_mr: Some(super::dm::reg_dm_mr),
        alloc_dm: Some(super::dm::alloc_dm),
        free_dm: Some(super::dm::free_dm),
        _ex0b: [None; 4],
        alloc_parent_domain: Some(super::domain::alloc_parent_domain),
        dealloc_td: Some(super::domain::dealloc_td),
        alloc_td: Some(super::domain::alloc_td),
        _ex0: [None; 7],
        query_rt_values: Some(query_rt_values),
        create_cq_ex: Some(create_cq_ex),
        priv_: null_mut(),
        query_device_ex: Some(query_device_ex),
        _ex1: [None; 4],
        open_qp: Some(super::xrc::open_qp),
        get_srq_num: Some(super::xrc::get_srq_num),
        create_srq_ex: Some(super::xrc::create_srq_ex),
        open_xrcd: Some(super::xrc::open_xrcd),
        close_xrcd: Some(super::xrc::close_xrcd),
        _ABI_placeholder3: 0,
        sz: size_of::<verbs_context>(),
        context: ibv_context {
            device,
            ops,
            cmd_fd: nic.cmd_fd().as_raw_fd(),
            async_fd: async_own
                .as_ref()
                .map_or(nic.events().fd().as_raw_fd(), |f| f.as_raw_fd()),
            num_comp_vectors: comp_vectors(),
            mutex: Default::default(),
            abi_compat: VERBS_ABI_IS_EXTENDED,
        },
    };
    let b = Box::into_raw(Box::new(SvContext {
        vctx,
        nic,
        reg: Default::default(),
        async_own_fd: async_own,
    }));
    // SAFETY: `b` is a fresh, valid allocation.
    let ctx = unsafe { &mut (*b).vctx.context };
    live_ctxs()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(ctx as *mut ibv_context as usize);
    ctx
}

/// The `ibv_context` pointers handed out and not yet closed, so softverbs' extensions answer
/// EINVAL for a pointer that is not a live context of this library instead of reading it.
fn live_ctxs() -> &'static RwLock<HashSet<usize>> {
    static LIVE: OnceLock<RwLock<HashSet<usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Runs `f` on the NIC context behind `ctx` when `ctx` is a live context of ours; None
/// otherwise (NULL, closed, or not from this library). It cannot be closed while `f` runs.
pub(crate) fn with_live_ctx<R>(ctx: *mut ibv_context, f: impl FnOnce(&Context) -> R) -> Option<R> {
    let live = live_ctxs().read().unwrap_or_else(|e| e.into_inner());
    if ctx.is_null() || !live.contains(&(ctx as usize)) {
        return None;
    }
    // SAFETY: a live context of ours; closing it needs the write lock we keep it from.
    Some(f(&unsafe { ctx_of(ctx) }.nic))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_close_device(ctx: *mut ibv_context) -> c_int {
    // NULL, already closed or not ours: EINVAL rather than freeing what we never made.
    let ours = live_ctxs()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(ctx as usize));
    if !ours {
        return EINVAL;
    }
    // SAFETY: `ctx` came from `sv_ibv_open_device`; the wrapper was made by Box::into_raw.
    drop(unsafe { Box::from_raw(ctx_of(ctx) as *const SvContext as *mut SvContext) });
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    if ctx.is_null() || attr.is_null() {
        return EINVAL;
    }
    // SAFETY: a context of ours.
    let a = unsafe { ctx_of(ctx) }.nic.device().attr();
    let i = |v: u32| v.min(i32::MAX as u32) as c_int;
    let mut out = ibv_device_attr {
        node_guid: a.node_guid.to_be(),
        sys_image_guid: a.sys_image_guid.to_be(),
        max_mr_size: a.max_mr_size,
        page_size_cap: a.page_size_cap,
        vendor_id: a.vendor_id,
        vendor_part_id: a.vendor_part_id,
        hw_ver: a.hw_ver,
        max_qp: i(a.max_qp),
        max_qp_wr: i(a.max_qp_wr),
        device_cap_flags: a.device_cap_flags,
        max_sge: i(a.max_sge),
        max_sge_rd: i(a.max_sge_rd),
        max_cq: i(a.max_cq),
        max_cqe: i(a.max_cqe),
        max_mr: i(a.max_mr),
        max_mw: i(a.max_mw),
        max_pd: i(a.max_pd),
        max_qp_rd_atom: i(a.max_qp_rd_atom),
        max_res_rd_atom: i(a.max_res_rd_atom),
        max_qp_init_rd_atom: i(a.max_qp_init_rd_atom),
        atomic_cap: a.atomic_cap as c_int,
        max_ah: i(a.max_ah),
        max_mcast_grp: i(a.max_mcast_grp),
        max_mcast_qp_attach: i(a.max_mcast_qp_attach),
        max_total_mcast_qp_attach: i(a.max_total_mcast_qp_attach),
        max_srq: i(a.max_srq),
        max_srq_wr: i(a.max_srq_wr),
        max_srq_sge: i(a.max_srq_sge),
        max_pkeys: a.max_pkeys,
        local_ca_ack_delay: a.local_ca_ack_delay,
        phys_port_cnt: a.phys_port_cnt,
        ..Default::default()
    };
    copy_str(&mut out.fw_ver, &a.fw_ver);
    // SAFETY: the caller passes a writable `struct ibv_device_attr`.
    unsafe { attr.write(out) };
    0
}

fn port_attr(ctx: &SvContext, port: u8) -> Result<ibv_port_attr> {
    let p = ctx.nic.device().port_attr(port)?;
    Ok(ibv_port_attr {
        state: p.state as c_int,
        max_mtu: p.max_mtu as c_int,
        active_mtu: p.active_mtu as c_int,
        gid_tbl_len: p.gid_tbl_len,
        port_cap_flags: p.port_cap_flags,
        max_msg_sz: p.max_msg_sz,
        bad_pkey_cntr: p.bad_pkey_cntr,
        qkey_viol_cntr: p.qkey_viol_cntr,
        pkey_tbl_len: p.pkey_tbl_len,
        lid: p.lid,
        sm_lid: p.sm_lid,
        lmc: p.lmc,
        max_vl_num: p.max_vl_num,
        sm_sl: p.sm_sl,
        subnet_timeout: p.subnet_timeout,
        init_type_reply: p.init_type_reply,
        active_width: p.active_width,
        active_speed: p.active_speed,
        phys_state: p.phys_state,
        link_layer: p.link_layer as u8,
        flags: 0,
        port_cap_flags2: 0,
    })
}

/// `verbs_context::query_port`, which the header's inline `ibv_query_port` calls.
unsafe extern "C" fn vctx_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    if ctx.is_null() || attr.is_null() {
        return EINVAL;
    }
    // SAFETY: a context of ours.
    match port_attr(unsafe { ctx_of(ctx) }, port) {
        Ok(a) => {
            let n = len.min(size_of::<ibv_port_attr>());
            // SAFETY: the caller's struct has `len` writable bytes; we copy at most that.
            unsafe {
                std::ptr::copy_nonoverlapping(&a as *const _ as *const u8, attr as *mut u8, n)
            };
            0
        }
        Err(e) => e.errno(),
    }
}

/// The exported `ibv_query_port` (the inline's fallback, and old binaries): fills the
/// classic struct, up to `flags`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: forwarded caller pointers.
    unsafe {
        vctx_query_port(
            ctx,
            port,
            attr,
            std::mem::offset_of!(ibv_port_attr, port_cap_flags2),
        )
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut [u8; 16],
) -> c_int {
    if ctx.is_null() || gid.is_null() || index < 0 {
        set_errno(EINVAL);
        return -1;
    }
    // SAFETY: a context of ours.
    match unsafe { ctx_of(ctx) }.nic.device().gid(port, index as u32) {
        Ok(g) => {
            // SAFETY: the caller passes a writable `union ibv_gid`.
            unsafe { gid.write(g.0) };
            0
        }
        Err(e) => {
            set_errno(e.errno());
            -1
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    ty: *mut c_int,
) -> c_int {
    if ctx.is_null() || ty.is_null() {
        return EINVAL;
    }
    // SAFETY: a context of ours.
    let dev = unsafe { ctx_of(ctx) }.nic.device();
    if let Err(e) = dev.gid(port, index) {
        return e.errno();
    }
    // IBV_GID_TYPE_SYSFS_IB_ROCE_V1 (0) for InfiniBand, ..._ROCE_V2 (1) for RoCE.
    let v = c_int::from(dev.config().link_layer == LinkLayer::Ethernet);
    // SAFETY: the caller passes a writable enum.
    unsafe { ty.write(v) };
    0
}

/// `ibv_get_pkey_index`: the index of P_Key `pkey` (network order) in the port's table, or -1
/// with errno (EINVAL: no such port; ENOENT: not in the table).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_get_pkey_index(
    ctx: *mut ibv_context,
    port: u8,
    pkey: u16,
) -> c_int {
    if ctx.is_null() {
        set_errno(EINVAL);
        return -1;
    }
    // SAFETY: a context of ours.
    let dev = unsafe { ctx_of(ctx) }.nic.device();
    // Index 0 always exists: an error there is the port's.
    if let Err(e) = dev.pkey(port, 0) {
        set_errno(e.errno());
        return -1;
    }
    // The table ends at the first index the device refuses.
    match (0..=u16::MAX)
        .map_while(|i| dev.pkey(port, i).ok().map(|k| (i, k)))
        .find(|&(_, k)| k.to_be() == pkey)
    {
        Some((i, _)) => c_int::from(i),
        None => {
            set_errno(libc::ENOENT);
            -1
        }
    }
}

/// `ibv_query_qp_data_in_order`: 0, no promise. A message's bytes are placed with the CPU's
/// memory copy, whose store order is its own, and relaxed-ordering regions may be placed in
/// any order (see the ordering check); a program must wait for the completion.
#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_query_qp_data_in_order(
    _qp: *mut ibv_qp,
    _op: c_int,
    _flags: u32,
) -> c_int {
    0
}

/// `ibv_query_ece`: EOPNOTSUPP, as the man page says for a device without ECE.
#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_query_ece(_qp: *mut ibv_qp, _ece: *mut c_void) -> c_int {
    libc::EOPNOTSUPP
}

/// `ibv_set_ece`: EOPNOTSUPP (no ECE).
#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_set_ece(_qp: *mut ibv_qp, _ece: *mut c_void) -> c_int {
    libc::EOPNOTSUPP
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    if ctx.is_null() || pkey.is_null() || !(0..=0xffff).contains(&index) {
        set_errno(EINVAL);
        return -1;
    }
    // SAFETY: a context of ours.
    match unsafe { ctx_of(ctx) }.nic.device().pkey(port, index as u16) {
        Ok(k) => {
            // SAFETY: the caller passes a writable `__be16`.
            unsafe { pkey.write(k.to_be()) };
            0
        }
        Err(e) => {
            set_errno(e.errno());
            -1
        }
    }
}

// ---- Extended queries (`verbs_context` slots and the `_ex` entry points) --------------------

/// `IBV_VALUES_MASK_RAW_CLOCK`.
const VALUES_MASK_RAW_CLOCK: u32 = 1;

/// `verbs_context::query_device_ex`, reached by the header's inline `ibv_query_device_ex`:
/// the classic attributes plus the device clock's `completion_timestamp_mask` and
/// `hca_core_clock` (kHz); everything softverbs lacks (ODP, TSO, RSS, …) reads zero. Fills
/// at most `attr_size` bytes, so programs built against older headers work.
unsafe extern "C" fn query_device_ex(
    ctx: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    if ctx.is_null() || attr.is_null() || attr_size < size_of::<ibv_device_attr>() {
        return EINVAL;
    }
    // SAFETY: the caller's input struct, or NULL.
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return EINVAL;
    }
    let mut orig = ibv_device_attr::default();
    // SAFETY: a context of ours and a writable local.
    let r = unsafe { sv_ibv_query_device(ctx, &mut orig) };
    if r != 0 {
        return r;
    }
    // SAFETY: a context of ours.
    let a = unsafe { ctx_of(ctx) }.nic.device().attr();
    let out = ibv_device_attr_ex {
        orig_attr: orig,
        comp_mask: 0,
        odp_caps: ibv_odp_caps {
            general_caps: a.odp_caps.general_caps,
            rc_odp_caps: a.odp_caps.rc_odp_caps,
            uc_odp_caps: a.odp_caps.uc_odp_caps,
            ud_odp_caps: a.odp_caps.ud_odp_caps,
        },
        completion_timestamp_mask: a.completion_timestamp_mask,
        hca_core_clock: a.hca_core_clock,
        device_cap_flags_ex: u64::from(a.device_cap_flags) | a.device_cap_flags_ex,
        _rest: [0; 11],
        max_dm_size: a.max_dm_size,
        _tail: [0; 2],
    };
    let n = attr_size.min(size_of::<ibv_device_attr_ex>());
    // SAFETY: the caller's struct has `attr_size` writable bytes; we copy at most that.
    unsafe { std::ptr::copy_nonoverlapping(&out as *const _ as *const u8, attr as *mut u8, n) };
    0
}

/// `verbs_context::query_rt_values`, reached by the header's inline `ibv_query_rt_values_ex`.
/// `raw_clock` carries the device clock's raw value in `tv_nsec` (`tv_sec` 0), as mlx5 does,
/// so it compares directly with `ibv_wc_read_completion_ts`.
unsafe extern "C" fn query_rt_values(ctx: *mut ibv_context, values: *mut ibv_values_ex) -> c_int {
    if ctx.is_null() || values.is_null() {
        return EINVAL;
    }
    // SAFETY: the caller's struct.
    let v = unsafe { &mut *values };
    if v.comp_mask & !VALUES_MASK_RAW_CLOCK != 0 {
        return EINVAL;
    }
    if v.comp_mask & VALUES_MASK_RAW_CLOCK != 0 {
        // SAFETY: a context of ours.
        let raw = unsafe { ctx_of(ctx) }.nic.device().clock().now_raw();
        v.raw_clock = libc::timespec {
            tv_sec: 0,
            tv_nsec: raw as libc::c_long,
        };
    }
    0
}

/// One GID table entry.
fn gid_entry(ctx: &SvContext, port: u32, index: u32) -> Result<ibv_gid_entry> {
    let dev = ctx.nic.device();
    let port = u8::try_from(port).map_err(|_| Error::InvalidArgument("port".into()))?;
    let g = dev.gid(port, index)?;
    // IBV_GID_TYPE_ROCE_V2 for RoCE, IBV_GID_TYPE_IB for InfiniBand.
    let gid_type = if dev.config().link_layer == LinkLayer::Ethernet {
        2
    } else {
        0
    };
    Ok(ibv_gid_entry {
        gid: ibv_gid(g.0),
        gid_index: index,
        port_num: u32::from(port),
        gid_type,
        ndev_ifindex: dev.config().net.as_ref().map_or(0, |n| n.ifindex),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv__ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    if ctx.is_null() || entry.is_null() || flags != 0 || entry_size < size_of::<ibv_gid_entry>() {
        return EINVAL;
    }
    // SAFETY: a context of ours.
    match gid_entry(unsafe { ctx_of(ctx) }, port_num, gid_index) {
        Ok(e) => {
            // SAFETY: the caller's writable entry.
            unsafe { entry.write(e) };
            0
        }
        Err(e) => e.errno(),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv__ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    if ctx.is_null() || flags != 0 || entry_size < size_of::<ibv_gid_entry>() {
        return -(EINVAL as isize);
    }
    // SAFETY: a context of ours.
    let sv = unsafe { ctx_of(ctx) };
    let ports = sv.nic.device().attr().phys_port_cnt;
    let mut n = 0usize;
    for port in 1..=ports {
        let len = match sv.nic.device().port_attr(port) {
            Ok(p) => p.gid_tbl_len.max(0) as u32,
            Err(e) => return -(e.errno() as isize),
        };
        for index in 0..len {
            let Ok(e) = gid_entry(sv, u32::from(port), index) else {
                continue;
            };
            if n == max_entries || entries.is_null() {
                return -(EINVAL as isize);
            }
            // SAFETY: the caller's array has `max_entries` entries of `entry_size` bytes.
            unsafe { ((entries as *mut u8).add(n * entry_size) as *mut ibv_gid_entry).write(e) };
            n += 1;
        }
    }
    n as isize
}

// ---- Fork support: a child gets copies of registered memory (see `inplace`) -----------------

/// Nothing to set up: registered memory is copied into a child at `fork` anyway (the
/// kernel's copy-on-fork of pinned pages), so, as rdma-core on such a kernel, success.
#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_fork_init() -> c_int {
    0
}

/// `IBV_FORK_UNNEEDED`: a child made by `fork` has its own copy of every registered page
/// and the parent's registrations keep working (see `inplace`).
#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_is_fork_initialized() -> c_int {
    2
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_get_sysfs_path`: the root of the devices' tree (see the module doc), where rdma-core
/// returns "/sys" (or `$SYSFS_PATH`, which softverbs does not follow: its devices are in
/// its own tree wherever that variable points).
#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_get_sysfs_path() -> *const libc::c_char {
    sysfs_path().as_ptr()
}

/// One completion vector per CPU, as soft-RoCE offers (`num_possible_cpus`): programs pass
/// their CPU as the vector (UCX does), and a CQ's events go to its channel whatever the
/// vector, since there are no interrupts to steer.
fn comp_vectors() -> c_int {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    c_int::try_from(n).unwrap_or(1).max(1)
}
