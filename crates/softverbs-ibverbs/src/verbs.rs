//! The implemented verbs. Each `sv_<name>` is bound to `<name>@@IBVERBS_<v>` by `build.rs`.

use crate::abi::*;
use crate::set_errno;
use core::ffi::{c_char, c_int, c_uint, c_void};
use softverbs_nic::cq::{Channel, Cq, Cqe};
use softverbs_nic::device::Context;
use softverbs_nic::device::Device;
use softverbs_nic::device::event::EventElement;
use softverbs_nic::pd::{Mr, Pd};
use softverbs_nic::qp::wr::{Payload, SendOp, SendWqe, UdDest};
use softverbs_nic::qp::{Qp, QpAttr, QpCap, QpInit};
use softverbs_nic::types::{
    AccessFlags, AhAttr, GlobalRoute, LinkLayer, Mtu, QpAttrMask, QpState, QpType, SendFlags, Sge,
    WrOpcode,
};
use softverbs_nic::{Error, Result};
use std::borrow::Cow;
use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::collections::HashSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::null_mut;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

const EINVAL: c_int = libc::EINVAL;

/// One software device, at a stable address for the life of the process.
#[repr(C)]
struct SvDevice {
    dev: ibv_device,
    nic: Arc<Device>,
    index: c_int,
}

#[repr(C)]
struct SvContext {
    vctx: verbs_context,
    nic: Arc<Context>,
    /// The C objects of this context, so an async event names the pointer the program holds.
    reg: Arc<Registry>,
    /// `async_fd`: the event doorbell reopened as its own open file description (see
    /// [`reopen_blocking`]); None if that failed and `async_fd` is the NIC's.
    async_own_fd: Option<OwnedFd>,
}

/// The C objects of a context by NIC id (QP number, CQ id, SRQ id). Each object holds the
/// registry too, so destroying it after its context was closed is still safe.
#[derive(Default)]
struct Registry {
    qps: Mutex<HashMap<u32, usize>>,
    cqs: Mutex<HashMap<u32, usize>>,
    srqs: Mutex<HashMap<u32, usize>>,
}

impl Registry {
    /// Records `obj` under `id` in `map` (or forgets `id` when `obj` is 0).
    fn set(map: &Mutex<HashMap<u32, usize>>, id: u32, obj: usize) {
        let mut m = map.lock().unwrap_or_else(|e| e.into_inner());
        if obj == 0 {
            m.remove(&id);
        } else {
            m.insert(id, obj);
        }
    }
}

/// Opens the pipe behind `fd` again through `/proc/self/fd`, which makes a new open file
/// description: blocking, whatever the NIC set on its own, so that `fcntl(F_SETFL,
/// O_NONBLOCK)` by the program says whether the `ibv_get_*_event` calls on it wait.
fn reopen_blocking(fd: c_int) -> Option<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).ok()?;
    // SAFETY: a NUL-terminated path; O_NONBLOCK so opening a pipe end cannot wait.
    let raw = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if raw < 0 {
        return None;
    }
    // SAFETY: `raw` is a descriptor we just opened and own.
    let own = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: fcntl on our descriptor.
    let fl = unsafe { libc::fcntl(raw, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(raw, libc::F_SETFL, fl & !libc::O_NONBLOCK) } < 0 {
        return None;
    }
    Some(own)
}

/// False if the program set `O_NONBLOCK` on `fd`.
fn blocking(fd: c_int) -> bool {
    // SAFETY: fcntl F_GETFL on a descriptor number; a bad one just fails.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl < 0 || fl & libc::O_NONBLOCK == 0
}

#[repr(C)]
struct SvPd {
    pd: ibv_pd,
    nic: Arc<Pd>,
}

#[repr(C)]
struct SvMr {
    mr: ibv_mr,
    nic: Option<Mr>,
    backing: Option<softverbs_nic::mr::keys::Backing>,
}

impl Drop for SvMr {
    fn drop(&mut self) {
        // Deregister the key first, then let go of the memfd it names.
        drop(self.nic.take());
        if let Some(b) = &self.backing {
            crate::inplace::release(b);
        }
    }
}

#[repr(C)]
struct SvChannel {
    ch: ibv_comp_channel,
    nic: Arc<Channel>,
    /// `ch.fd`: the doorbell reopened as its own open file description, so the program's
    /// `O_NONBLOCK` on it is its own (None if reopening failed and `ch.fd` is the NIC's).
    own_fd: Option<OwnedFd>,
}

/// Every CQ is an `ibv_cq_ex` (its first fields are those of `ibv_cq`), so the plain and the
/// extended API both work on any CQ.
#[repr(C)]
struct SvCq {
    cqx: ibv_cq_ex,
    /// The completion `start_poll`/`next_poll` took last, for the `read_*` entry points. The
    /// caller owns the CQ between `start_poll` and `end_poll`, so no lock is needed.
    cur: UnsafeCell<Cqe>,
    nic: Arc<Cq>,
    reg: Arc<Registry>,
}

#[repr(C)]
struct SvAh {
    ah: ibv_ah,
    nic: Arc<softverbs_nic::pd::Ah>,
}

#[repr(C)]
struct SvSrq {
    srq: ibv_srq,
    nic: Arc<softverbs_nic::qp::rq::Srq>,
    reg: Arc<Registry>,
}

#[repr(C)]
struct SvQp {
    /// `qp_base` first, so the `ibv_qp *` and the `ibv_qp_ex *` are the same address.
    qpx: ibv_qp_ex,
    /// Work requests built by the `ibv_wr_*` API between `wr_start` and `wr_complete`.
    batch: Mutex<Batch>,
    nic: Arc<Qp>,
    reg: Arc<Registry>,
}

impl SvContext {
    /// Whether `ibv_get_async_event` waits: unless the program set `O_NONBLOCK` on
    /// `async_fd`.
    fn async_blocking(&self) -> bool {
        self.async_own_fd.is_none() || blocking(self.vctx.context.async_fd)
    }
}

/// Built once and never changed, so each `ibv_device` keeps its address for the process's life.
static DEVICES: OnceLock<std::result::Result<Vec<SvDevice>, Error>> = OnceLock::new();

fn devices() -> Result<&'static [SvDevice]> {
    let list = DEVICES.get_or_init(|| {
        let mut out = Vec::new();
        for (i, nic) in Device::list()?.into_iter().enumerate() {
            let mut dev = ibv_device {
                _ops: _ibv_device_ops {
                    _dummy1: None,
                    _dummy2: None,
                },
                node_type: 1,      // IBV_NODE_CA
                transport_type: 0, // IBV_TRANSPORT_IB
                name: [0; 64],
                dev_name: [0; 64],
                dev_path: [0; 256],
                ibdev_path: [0; 256],
            };
            copy_str(&mut dev.name, nic.name());
            copy_str(&mut dev.dev_name, &format!("uverbs{i}"));
            copy_str(
                &mut dev.dev_path,
                &format!("/sys/class/infiniband_verbs/uverbs{i}"),
            );
            copy_str(
                &mut dev.ibdev_path,
                &format!("/sys/class/infiniband/{}", nic.name()),
            );
            out.push(SvDevice {
                dev,
                nic,
                index: i as c_int,
            });
        }
        Ok(out)
    });
    list.as_deref().map_err(Clone::clone)
}

/// Copies `s` into a NUL-terminated C string buffer, truncating if needed.
fn copy_str(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len() - 1);
    for (d, b) in dst.iter_mut().zip(&s.as_bytes()[..n]) {
        *d = *b as c_char;
    }
    dst[n] = 0;
}

fn find_device(device: *const ibv_device) -> Option<&'static SvDevice> {
    devices()
        .ok()?
        .iter()
        .find(|d| std::ptr::eq(&d.dev, device))
}

/// The wrapper of a context this library opened.
///
/// # Safety
/// `ctx` must come from [`sv_ibv_open_device`] and not be closed.
unsafe fn ctx_of<'a>(ctx: *mut ibv_context) -> &'a SvContext {
    let off = std::mem::offset_of!(verbs_context, context);
    // SAFETY: the context is the `context` field of the `verbs_context` that starts an
    // `SvContext` (repr(C), first field), so stepping back `off` bytes reaches it.
    unsafe { &*((ctx as *mut u8).sub(off) as *const SvContext) }
}

/// Reports `e` the verbs way for calls that return the errno.
fn rc(r: Result<()>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

/// Reports `e` the verbs way for calls that return NULL and set errno.
pub(crate) fn null<T>(e: Error) -> *mut T {
    set_errno(e.errno());
    null_mut()
}

pub(crate) fn inval<T>() -> *mut T {
    set_errno(EINVAL);
    null_mut()
}

// ---- Devices -------------------------------------------------------------------------------

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
    let nic = match Context::open(d.nic.clone()) {
        Ok(c) => c,
        Err(e) => return null(e),
    };
    let ops = ibv_context_ops {
        _compat0: [None; 11],
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
        _ex0: [None; 23],
        query_rt_values: Some(query_rt_values),
        create_cq_ex: Some(create_cq_ex),
        priv_: null_mut(),
        query_device_ex: Some(query_device_ex),
        _ex1: [None; 5],
        _ex2: [None; 4],
        _ABI_placeholder3: 0,
        sz: size_of::<verbs_context>(),
        context: ibv_context {
            device,
            ops,
            cmd_fd: -1,
            async_fd: async_own
                .as_ref()
                .map_or(nic.events().fd().as_raw_fd(), |f| f.as_raw_fd()),
            num_comp_vectors: 1,
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
        max_pd: i(a.max_pd),
        max_qp_rd_atom: i(a.max_qp_rd_atom),
        max_res_rd_atom: i(a.max_res_rd_atom),
        max_qp_init_rd_atom: i(a.max_qp_init_rd_atom),
        atomic_cap: a.atomic_cap as c_int,
        max_ah: i(a.max_ah),
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
        odp_caps: Default::default(),
        completion_timestamp_mask: a.completion_timestamp_mask,
        hca_core_clock: a.hca_core_clock,
        device_cap_flags_ex: u64::from(a.device_cap_flags),
        _rest: [0; 14],
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

// ---- Fork support: nothing to do (MRs are plain memory) -------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_fork_init() -> c_int {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_is_fork_initialized() -> c_int {
    0 // IBV_FORK_DISABLED
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

// ---- PDs and MRs ---------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    if ctx.is_null() {
        return inval();
    }
    // SAFETY: a context of ours.
    match unsafe { ctx_of(ctx) }.nic.alloc_pd() {
        Ok(nic) => {
            let b = Box::new(SvPd {
                pd: ibv_pd {
                    context: ctx,
                    handle: nic.id(),
                },
                nic,
            });
            Box::into_raw(b) as *mut ibv_pd
        }
        Err(e) => null(e),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    if pd.is_null() {
        return EINVAL;
    }
    // SAFETY: `pd` came from `sv_ibv_alloc_pd` (Box::into_raw of an SvPd).
    drop(unsafe { Box::from_raw(pd as *mut SvPd) });
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    if pd.is_null() {
        return inval();
    }
    // SAFETY: `pd` came from `sv_ibv_alloc_pd`.
    let sv = unsafe { &*(pd as *const SvPd) };
    // Bad flags fail before any memory is moved.
    if let Err(e) = Pd::effective_access(access) {
        return null(e);
    }
    // Seed 002: `ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED | ...)` makes the container a
    // non-contiguous layout is given to (`ibv_mr_set_layout_sg` / `_interleaved`).
    if length == 0 && access & AccessFlags::ZERO_BASED.bits() != 0 {
        return match sv.nic.create_layout_mr(access) {
            // SAFETY: a PD of ours.
            Ok(nic) => new_mr(unsafe { (*pd).context }, pd, addr, 0, nic, None),
            Err(e) => null(e),
        };
    }
    // SAFETY: the caller's buffer (verbs' contract, as for any registration).
    match unsafe { register(&sv.nic, addr, length, iova, access) } {
        // SAFETY: a PD of ours.
        Ok((nic, backing)) => new_mr(unsafe { (*pd).context }, pd, addr, length, nic, backing),
        Err(e) => null(e),
    }
}

/// Registers `addr..addr + length` at `iova` with the NIC, moving plain memory into a memfd
/// first (see `inplace`); on failure nothing stays moved for it.
///
/// # Safety
/// The buffer stays valid until the region is deregistered.
unsafe fn register(
    pd: &Arc<Pd>,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> softverbs_nic::Result<(Mr, Option<softverbs_nic::mr::keys::Backing>)> {
    let backing = crate::inplace::acquire(addr as usize, length);
    // SAFETY: verbs requires the buffer to stay valid until `ibv_dereg_mr`; the NIC reaches
    // it through this process's address space, and peers through the memfd it was moved into
    // (or by cross-memory attach when it was not).
    let r = unsafe { pd.reg_mr(addr as usize, length, iova, access, backing) };
    if r.is_err()
        && let Some(b) = &backing
    {
        crate::inplace::release(b);
    }
    r.map(|nic| (nic, backing))
}

/// `IBV_REREG_MR_CHANGE_TRANSLATION`, `_CHANGE_PD`, `_CHANGE_ACCESS`.
const REREG_TRANSLATION: c_int = 1;
const REREG_PD: c_int = 1 << 1;
const REREG_ACCESS: c_int = 1 << 2;

/// `ibv_rereg_mr`: a new registration with the changed parts (`addr`/`length`, `pd`,
/// `access`) and the others as they were, which replaces the old one only once it exists, so
/// a failure (`IBV_REREG_MR_ERR_INPUT`, errno set) leaves the region as it was. The key may
/// change (`mr->lkey`/`rkey` say). Layout containers and page lists cannot be re-registered
/// (EINVAL); a region a layout uses is EBUSY.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    /// `IBV_REREG_MR_ERR_INPUT`: the old region is still valid.
    const ERR_INPUT: c_int = -1;
    let fail = |errno: c_int| {
        set_errno(errno);
        ERR_INPUT
    };
    if flags == 0 || flags & !(REREG_TRANSLATION | REREG_PD | REREG_ACCESS) != 0 {
        return fail(EINVAL);
    }
    if flags & REREG_PD != 0 && pd.is_null() {
        return fail(EINVAL);
    }
    // Exclusive: no other call uses or deregisters this MR meanwhile.
    let live = live_mrs().write().unwrap_or_else(|e| e.into_inner());
    if mr.is_null() || !live.contains(&(mr as usize)) {
        return fail(EINVAL);
    }
    // SAFETY: a live SvMr of ours, and we hold the write lock over live MRs.
    let sv = unsafe { &mut *(mr as *mut SvMr) };
    let Some(old) = &sv.nic else {
        return fail(EINVAL);
    };
    if old.is_layout() || sv.mr.addr as usize != old.addr() {
        return fail(EINVAL); // a container, or a page list (its addr is an IOVA)
    }
    if let Err(e) = old.check_dereg() {
        return fail(e.errno());
    }
    let new_pd = if flags & REREG_PD != 0 { pd } else { sv.mr.pd };
    let (new_addr, new_len, iova) = if flags & REREG_TRANSLATION != 0 {
        (addr, length, addr as u64)
    } else {
        (sv.mr.addr, sv.mr.length, old.iova())
    };
    let new_access = if flags & REREG_ACCESS != 0 {
        access as c_uint
    } else {
        old.access().bits()
    };
    if let Err(e) = Pd::effective_access(new_access) {
        return fail(e.errno());
    }
    // SAFETY: `new_pd` is the MR's PD or the caller's (a PD of ours, non-NULL); the buffer is
    // the caller's to keep valid, as for any registration.
    let r = unsafe {
        register(
            &(*(new_pd as *const SvPd)).nic,
            new_addr,
            new_len,
            iova,
            new_access,
        )
    };
    match r {
        Ok((nic, backing)) => {
            let old_backing = std::mem::replace(&mut sv.backing, backing);
            // The old key goes first, then the memfd it named (as in deregistration).
            drop(sv.nic.replace(nic));
            if let Some(b) = &old_backing {
                crate::inplace::release(b);
            }
            let key = sv.nic.as_ref().map_or(0, Mr::key);
            sv.mr.pd = new_pd;
            sv.mr.addr = new_addr;
            sv.mr.length = new_len;
            sv.mr.handle = key;
            sv.mr.lkey = key;
            sv.mr.rkey = key;
            0
        }
        Err(e) => fail(e.errno()),
    }
}

/// The NIC PD of `pd`, a PD of this library (None for NULL).
///
/// # Safety
/// `pd` is NULL or came from `sv_ibv_alloc_pd` and is not deallocated.
pub(crate) unsafe fn nic_pd<'a>(pd: *mut ibv_pd) -> Option<&'a Arc<Pd>> {
    // SAFETY: the caller's.
    (!pd.is_null()).then(|| &unsafe { &*(pd as *const SvPd) }.nic)
}

/// Hands a registered MR to C and records it as live.
pub(crate) fn new_mr(
    context: *mut ibv_context,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    nic: Mr,
    backing: Option<softverbs_nic::mr::keys::Backing>,
) -> *mut ibv_mr {
    let mr = ibv_mr {
        context,
        pd,
        addr,
        length,
        handle: nic.key(),
        lkey: nic.key(),
        rkey: nic.key(),
    };
    let p = Box::into_raw(Box::new(SvMr {
        mr,
        nic: Some(nic),
        backing,
    })) as *mut ibv_mr;
    live_mrs()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(p as usize);
    p
}

/// The `ibv_mr` pointers handed out and not yet deregistered, so `ibv_dereg_mr`, softverbs'
/// layout calls and the layout bind work request answer EINVAL for a pointer that is not a
/// live MR of this library instead of reading it.
fn live_mrs() -> &'static RwLock<HashSet<usize>> {
    static LIVE: OnceLock<RwLock<HashSet<usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Runs `f` on `mr` (the C struct, which `f` may update) and its NIC MR when `mr` is a live
/// MR of ours; None otherwise. The MR cannot be deregistered while `f` runs.
pub(crate) fn with_live_mr<R>(mr: *mut ibv_mr, f: impl FnOnce(*mut ibv_mr, &Mr) -> R) -> Option<R> {
    let live = live_mrs().read().unwrap_or_else(|e| e.into_inner());
    if mr.is_null() || !live.contains(&(mr as usize)) {
        return None;
    }
    // SAFETY: a live SvMr of ours; deregistering it needs the write lock we keep it from.
    let nic = unsafe { &*(mr as *const SvMr) }.nic.as_ref()?;
    Some(f(mr, nic))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded caller arguments.
    unsafe { sv_ibv_reg_mr_iova2(pd, addr, length, addr as u64, access as c_uint) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded caller arguments.
    unsafe { sv_ibv_reg_mr_iova2(pd, addr, length, iova, access as c_uint) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    let mut live = live_mrs().write().unwrap_or_else(|e| e.into_inner());
    // NULL, already deregistered or not ours: EINVAL rather than freeing what we never made.
    if mr.is_null() || !live.contains(&(mr as usize)) {
        return EINVAL;
    }
    // SAFETY: a live SvMr of ours (we hold the write lock).
    if let Some(nic) = &unsafe { &*(mr as *const SvMr) }.nic
        && let Err(e) = nic.check_dereg()
    {
        // Seed 002: a region a non-contiguous layout uses stays registered (EBUSY).
        return e.errno();
    }
    live.remove(&(mr as usize));
    drop(live);
    // SAFETY: `mr` came from `new_mr` (Box::into_raw of an SvMr) and was live until now.
    drop(unsafe { Box::from_raw(mr as *mut SvMr) });
    0
}

// ---- Completion channels and CQs -----------------------------------------------------------

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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
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
unsafe extern "C" fn create_cq_ex(
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
        || (a.comp_mask & CQ_INIT_PD != 0 && !a.parent_domain.is_null())
    {
        set_errno(libc::EOPNOTSUPP);
        return null_mut();
    }
    let Ok(cqe) = c_int::try_from(a.cqe) else {
        return inval();
    };
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
    // NULL, already destroyed or not ours: EINVAL rather than freeing what we never made.
    let ours = live_cqs()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(cq as usize));
    if !ours {
        return EINVAL;
    }
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
    let nic_cq = match sv.nic.get_event(wait) {
        Ok(c) => c,
        Err(e) => {
            set_errno(e.errno());
            return -1;
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

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
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

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    if cq.is_null() {
        return EINVAL;
    }
    // SAFETY: a CQ of ours.
    rc(unsafe { &*(cq as *const SvCq) }
        .nic
        .req_notify(solicited_only != 0))
}

// ---- QPs -----------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_create_qp(
    pd: *mut ibv_pd,
    init: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    if pd.is_null() || init.is_null() {
        return inval();
    }
    // SAFETY: caller's attributes.
    let ia = unsafe { &mut *init };
    let Some(qp_type) = QpType::from_raw(ia.qp_type as u32) else {
        set_errno(libc::EOPNOTSUPP);
        return null_mut();
    };
    if ia.send_cq.is_null() || ia.recv_cq.is_null() {
        return inval();
    }
    // SAFETY: PD and CQs of ours.
    let (sv_pd, scq, rcq) = unsafe {
        (
            &*(pd as *const SvPd),
            &*(ia.send_cq as *const SvCq),
            &*(ia.recv_cq as *const SvCq),
        )
    };
    let c = ia.cap;
    let nic = match sv_pd.nic.create_qp(QpInit {
        qp_type,
        send_cq: scq.nic.clone(),
        recv_cq: rcq.nic.clone(),
        srq: (!ia.srq.is_null())
            // SAFETY: an SRQ of ours.
            .then(|| unsafe { &*(ia.srq as *const SvSrq) }.nic.clone()),
        cap: QpCap {
            max_send_wr: c.max_send_wr,
            max_recv_wr: c.max_recv_wr,
            max_send_sge: c.max_send_sge,
            max_recv_sge: c.max_recv_sge,
            max_inline_data: c.max_inline_data,
        },
        sq_sig_all: ia.sq_sig_all != 0,
    }) {
        Ok(q) => q,
        Err(e) => return null(e),
    };
    ia.cap = cap_out(nic.cap());
    let qp = ibv_qp {
        // SAFETY: a PD of ours.
        context: unsafe { (*pd).context },
        qp_context: ia.qp_context,
        pd,
        send_cq: ia.send_cq,
        recv_cq: ia.recv_cq,
        srq: ia.srq,
        handle: nic.qpn(),
        qp_num: nic.qpn(),
        state: QpState::Reset as c_int,
        qp_type: ia.qp_type,
        mutex: Default::default(),
        cond: Default::default(),
        events_completed: 0,
    };
    let qpn = nic.qpn();
    // SAFETY: a PD of ours, whose context is open.
    let reg = unsafe { ctx_of((*pd).context) }.reg.clone();
    let b = Box::into_raw(Box::new(SvQp {
        qpx: qp_ex(qp),
        batch: Mutex::new(Batch::default()),
        nic,
        reg: reg.clone(),
    }));
    Registry::set(&reg.qps, qpn, b as usize);
    b as *mut ibv_qp
}

fn cap_out(c: QpCap) -> ibv_qp_cap {
    ibv_qp_cap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    if qp.is_null() {
        return EINVAL;
    }
    // SAFETY: `qp` came from `sv_ibv_create_qp` (Box::into_raw of an SvQp).
    let b = unsafe { Box::from_raw(qp as *mut SvQp) };
    Registry::set(&b.reg.qps, b.nic.qpn(), 0);
    0
}

fn ah_in(a: &ibv_ah_attr) -> AhAttr {
    AhAttr {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        port_num: a.port_num,
        grh: (a.is_global != 0).then_some(GlobalRoute {
            dgid: softverbs_nic::types::Gid(a.grh.dgid.0),
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        }),
    }
}

fn ah_out(a: &AhAttr) -> ibv_ah_attr {
    let g = a.grh.unwrap_or_default();
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid(g.dgid.0),
            flow_label: g.flow_label,
            sgid_index: g.sgid_index,
            hop_limit: g.hop_limit,
            traffic_class: g.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: u8::from(a.grh.is_some()),
        port_num: a.port_num,
    }
}

fn attr_in(a: &ibv_qp_attr, mask: QpAttrMask) -> Result<QpAttr> {
    let bad = |what: &str| Error::InvalidArgument(what.to_string());
    let state = |v: c_int| QpState::from_raw(v as u32);
    let mut out = QpAttr::default();
    if mask.contains(QpAttrMask::STATE) {
        out.qp_state = state(a.qp_state).ok_or_else(|| bad("qp_state"))?;
    }
    if mask.contains(QpAttrMask::CUR_STATE) {
        out.cur_qp_state = state(a.cur_qp_state).ok_or_else(|| bad("cur_qp_state"))?;
    }
    if mask.contains(QpAttrMask::PATH_MTU) {
        out.path_mtu = Mtu::from_raw(a.path_mtu as u32).ok_or_else(|| bad("path_mtu"))?;
    }
    out.path_mig_state = a.path_mig_state as u32;
    out.qkey = a.qkey;
    out.rq_psn = a.rq_psn;
    out.sq_psn = a.sq_psn;
    out.dest_qp_num = a.dest_qp_num;
    out.qp_access_flags = AccessFlags::from_bits_retain(a.qp_access_flags);
    out.cap = QpCap {
        max_send_wr: a.cap.max_send_wr,
        max_recv_wr: a.cap.max_recv_wr,
        max_send_sge: a.cap.max_send_sge,
        max_recv_sge: a.cap.max_recv_sge,
        max_inline_data: a.cap.max_inline_data,
    };
    out.ah_attr = ah_in(&a.ah_attr);
    out.alt_ah_attr = ah_in(&a.alt_ah_attr);
    out.pkey_index = a.pkey_index;
    out.alt_pkey_index = a.alt_pkey_index;
    out.en_sqd_async_notify = a.en_sqd_async_notify != 0;
    out.max_rd_atomic = a.max_rd_atomic;
    out.max_dest_rd_atomic = a.max_dest_rd_atomic;
    out.min_rnr_timer = a.min_rnr_timer;
    out.port_num = a.port_num;
    out.timeout = a.timeout;
    out.retry_cnt = a.retry_cnt;
    out.rnr_retry = a.rnr_retry;
    out.alt_port_num = a.alt_port_num;
    out.alt_timeout = a.alt_timeout;
    out.rate_limit = a.rate_limit;
    Ok(out)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    if qp.is_null() || attr.is_null() {
        return EINVAL;
    }
    // SAFETY: a QP of ours, and the caller's attributes.
    let (sv, a) = unsafe { (&mut *(qp as *mut SvQp), &*attr) };
    let mask = QpAttrMask::from_bits_retain(mask as u32);
    let r = attr_in(a, mask).and_then(|na| sv.nic.modify(&na, mask));
    sv.qpx.qp_base.state = sv.nic.state() as c_int;
    rc(r)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    if qp.is_null() || attr.is_null() || init.is_null() {
        return EINVAL;
    }
    // SAFETY: a QP of ours.
    let sv = unsafe { &mut *(qp as *mut SvQp) };
    let a = sv.nic.query();
    sv.qpx.qp_base.state = a.qp_state as c_int;
    let out = ibv_qp_attr {
        qp_state: a.qp_state as c_int,
        cur_qp_state: a.cur_qp_state as c_int,
        path_mtu: a.path_mtu as c_int,
        path_mig_state: a.path_mig_state as c_int,
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: a.qp_access_flags.bits(),
        cap: cap_out(a.cap),
        ah_attr: ah_out(&a.ah_attr),
        alt_ah_attr: ah_out(&a.alt_ah_attr),
        pkey_index: a.pkey_index,
        alt_pkey_index: a.alt_pkey_index,
        en_sqd_async_notify: u8::from(a.en_sqd_async_notify),
        sq_draining: u8::from(a.sq_draining),
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
        rate_limit: a.rate_limit,
    };
    let init_out = ibv_qp_init_attr {
        qp_context: sv.qpx.qp_base.qp_context,
        send_cq: sv.qpx.qp_base.send_cq,
        recv_cq: sv.qpx.qp_base.recv_cq,
        srq: sv.qpx.qp_base.srq,
        cap: cap_out(a.cap),
        qp_type: sv.qpx.qp_base.qp_type,
        sq_sig_all: c_int::from(sv.nic.sq_sig_all()),
    };
    // SAFETY: the caller's writable out-structs.
    unsafe {
        attr.write(out);
        init.write(init_out);
    }
    0
}

// ---- Data path (through `ibv_context::ops`) ------------------------------------------------

/// The SGE list of a work request.
///
/// # Safety
/// `list` must point to `n` SGEs (or `n` is 0).
unsafe fn sges(list: *const ibv_sge, n: c_int) -> Result<Vec<Sge>> {
    if n < 0 || (n > 0 && list.is_null()) {
        return Err(Error::InvalidArgument("num_sge/sg_list".into()));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the caller's list has `n` entries.
    let s = unsafe { std::slice::from_raw_parts(list, n as usize) };
    Ok(s.iter()
        .map(|g| Sge {
            addr: g.addr,
            length: g.length,
            lkey: g.lkey,
        })
        .collect())
}

/// Converts one `ibv_send_wr`.
///
/// # Safety
/// `w` must be a valid send WR whose SGE list (and, for INLINE, the bytes it points at) is
/// readable.
unsafe fn send_wqe(w: &ibv_send_wr) -> Result<SendWqe<'static>> {
    let bad = |m: &str| Error::InvalidArgument(m.to_string());
    let op = WrOpcode::from_raw(w.opcode as u32).ok_or_else(|| bad("unsupported opcode"))?;
    // SAFETY: reading the union member the opcode selects.
    let op = unsafe {
        match op {
            WrOpcode::Send => SendOp::Send,
            WrOpcode::SendWithImm => SendOp::SendWithImm { imm: w.imm_data },
            WrOpcode::RdmaWrite => SendOp::RdmaWrite {
                remote_addr: w.wr.rdma.remote_addr,
                rkey: w.wr.rdma.rkey,
            },
            WrOpcode::RdmaWriteWithImm => SendOp::RdmaWriteWithImm {
                remote_addr: w.wr.rdma.remote_addr,
                rkey: w.wr.rdma.rkey,
                imm: w.imm_data,
            },
            WrOpcode::RdmaRead => SendOp::RdmaRead {
                remote_addr: w.wr.rdma.remote_addr,
                rkey: w.wr.rdma.rkey,
            },
            WrOpcode::AtomicCmpAndSwp => SendOp::CmpSwap {
                remote_addr: w.wr.atomic.remote_addr,
                rkey: w.wr.atomic.rkey,
                compare: w.wr.atomic.compare_add,
                swap: w.wr.atomic.swap,
            },
            WrOpcode::AtomicFetchAndAdd => SendOp::FetchAdd {
                remote_addr: w.wr.atomic.remote_addr,
                rkey: w.wr.atomic.rkey,
                add: w.wr.atomic.compare_add,
            },
            // Memory windows are not implemented. Seed 002's IBV_WR_BIND_MR is
            // IBV_WR_BIND_MW whose `bind_mw.mw` (where the seed's `mr_set_layout.mr` lies)
            // is a layout container of ours (`ibv_wr_bind_mr` in softverbs/verbs_ext.h).
            WrOpcode::BindMw => {
                let mr = w._tail[0] as usize as *mut ibv_mr;
                match with_live_mr(mr, |_, m| m.is_layout().then(|| m.key())) {
                    Some(Some(key)) => SendOp::BindLayout { key },
                    _ => return Err(bad("IBV_WR_BIND_MW without a layout container")),
                }
            }
        }
    };
    let flags = SendFlags::from_bits_retain(w.send_flags);
    // SAFETY: the caller's SGE list.
    let list = unsafe { sges(w.sg_list, w.num_sge) }?;
    let payload = if flags.contains(SendFlags::INLINE) {
        let mut bytes = Vec::with_capacity(list.iter().map(|s| s.length as usize).sum());
        for s in &list {
            if s.length > 0 {
                // SAFETY: with IBV_SEND_INLINE the SGE addresses are the caller's own
                // readable buffers (no key involved), valid for the duration of the call.
                bytes.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize)
                });
            }
        }
        Payload::Inline(Cow::Owned(bytes))
    } else {
        Payload::Sges(Cow::Owned(list))
    };
    Ok(SendWqe {
        wr_id: w.wr_id,
        op,
        flags,
        payload,
        ud: None,
    })
}

unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    if qp.is_null() {
        return EINVAL;
    }
    // SAFETY: a QP of ours.
    let sv = unsafe { &*(qp as *const SvQp) };
    let mut ptrs = Vec::new();
    let mut wqes = Vec::new();
    let mut failed: Option<(usize, c_int)> = None;
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the caller's linked list of valid WRs.
        let w = unsafe { &*cur };
        // SAFETY: as above.
        let conv = unsafe { send_wqe(w) }.and_then(|mut q| {
            if sv.nic.qp_type() == QpType::Ud {
                // SAFETY: a UD WR's `wr.ud` names an address handle of ours (or NULL).
                let ud = unsafe { w.wr.ud };
                if ud.ah.is_null() {
                    return Err(Error::InvalidArgument("UD send without an AH".into()));
                }
                q.ud = Some(UdDest {
                    // SAFETY: as above.
                    ah: unsafe { &*(ud.ah as *const SvAh) }.nic.clone(),
                    remote_qpn: ud.remote_qpn,
                    remote_qkey: ud.remote_qkey,
                });
            }
            Ok(q)
        });
        match conv {
            Ok(q) => {
                ptrs.push(cur);
                wqes.push(q);
            }
            Err(e) => {
                ptrs.push(cur);
                failed = Some((ptrs.len() - 1, e.errno()));
                break;
            }
        }
        cur = w.next;
    }
    let result = match sv.nic.post_send(wqes) {
        Ok(()) => failed,
        Err(e) => Some((e.index, e.error.errno())),
    };
    match result {
        None => 0,
        Some((i, errno)) => {
            if !bad_wr.is_null() {
                // SAFETY: the caller's out-pointer.
                unsafe { *bad_wr = ptrs[i] };
            }
            errno
        }
    }
}

unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    if qp.is_null() {
        return EINVAL;
    }
    // SAFETY: a QP of ours.
    let sv = unsafe { &*(qp as *const SvQp) };
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the caller's linked list of valid WRs and their SGE lists.
        let w = unsafe { &*cur };
        // SAFETY: as above.
        let r = unsafe { sges(w.sg_list, w.num_sge) }.and_then(|s| sv.nic.post_recv(w.wr_id, &s));
        if let Err(e) = r {
            if !bad_wr.is_null() {
                // SAFETY: the caller's out-pointer.
                unsafe { *bad_wr = cur };
            }
            return e.errno();
        }
        cur = w.next;
    }
    0
}

unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    if srq.is_null() {
        return EINVAL;
    }
    // SAFETY: an SRQ of ours.
    let sv = unsafe { &*(srq as *const SvSrq) };
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the caller's linked list of valid WRs and their SGE lists.
        let w = unsafe { &*cur };
        // SAFETY: as above.
        let r = unsafe { sges(w.sg_list, w.num_sge) }.and_then(|s| sv.nic.post(w.wr_id, &s));
        if let Err(e) = r {
            if !bad_wr.is_null() {
                // SAFETY: the caller's out-pointer.
                unsafe { *bad_wr = cur };
            }
            return e.errno();
        }
        cur = w.next;
    }
    0
}

// ---- Address handles and SRQs --------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    if pd.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: a PD of ours and the caller's attributes.
    let (sv, a) = unsafe { (&*(pd as *const SvPd), &*attr) };
    match sv.nic.create_ah(&ah_in(a)) {
        Ok(nic) => {
            let ah = ibv_ah {
                // SAFETY: a PD of ours.
                context: unsafe { (*pd).context },
                pd,
                handle: 0,
            };
            Box::into_raw(Box::new(SvAh { ah, nic })) as *mut ibv_ah
        }
        Err(e) => null(e),
    }
}

/// `IBV_WC_GRH`: the receive buffer starts with the sender's GRH.
const WC_GRH: c_uint = 1;

/// `ibv_init_ah_from_wc`: the address vector that answers the sender of a received `wc`, as
/// rdma-core builds it: LID, SL and path bits from the completion; with a GRH (always on a
/// RoCE port), `dgid` = the GRH's source GID, `sgid_index` = our GID the GRH was sent to,
/// flow label and traffic class from the GRH, hop limit 255. EINVAL (returned, errno set too)
/// for NULL arguments or a GRH sent to a GID this port does not have.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_init_ah_from_wc(
    ctx: *mut ibv_context,
    port_num: u8,
    wc: *const ibv_wc,
    grh: *const [u8; 40],
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    let fail = |errno: c_int| {
        set_errno(errno);
        errno
    };
    if ctx.is_null() || wc.is_null() || ah_attr.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: the caller's completion.
    let wc = unsafe { &*wc };
    let mut a = ibv_ah_attr {
        dlid: wc.slid,
        sl: wc.sl,
        src_path_bits: wc.dlid_path_bits,
        port_num,
        ..Default::default()
    };
    if wc.wc_flags & WC_GRH != 0 {
        if grh.is_null() {
            return fail(EINVAL);
        }
        // SAFETY: the caller's GRH (the first 40 bytes of the receive buffer).
        let g = unsafe { &*grh };
        let word0 = u32::from_be_bytes([g[0], g[1], g[2], g[3]]);
        let (sgid, dgid): ([u8; 16], [u8; 16]) = match (g[8..24].try_into(), g[24..40].try_into()) {
            (Ok(s), Ok(d)) => (s, d),
            _ => return fail(EINVAL),
        };
        // SAFETY: a context of ours.
        let dev = unsafe { ctx_of(ctx) }.nic.device();
        // The GID index on this port the GRH was addressed to.
        let Some(index) =
            (0..16u8).find(|&i| dev.gid(port_num, u32::from(i)).is_ok_and(|g| g.0 == dgid))
        else {
            return fail(EINVAL);
        };
        a.is_global = 1;
        a.grh = ibv_global_route {
            dgid: ibv_gid(sgid),
            flow_label: word0 & 0xf_ffff,
            sgid_index: index,
            hop_limit: 0xff,
            traffic_class: (word0 >> 20) as u8,
        };
    }
    // SAFETY: the caller's writable attributes.
    unsafe { ah_attr.write(a) };
    0
}

/// `ibv_create_ah_from_wc`: [`sv_ibv_init_ah_from_wc`], then `ibv_create_ah`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *const ibv_wc,
    grh: *const [u8; 40],
    port_num: u8,
) -> *mut ibv_ah {
    if pd.is_null() {
        return inval();
    }
    let mut attr = ibv_ah_attr::default();
    // SAFETY: a PD of ours; the caller's completion and GRH.
    if unsafe { sv_ibv_init_ah_from_wc((*pd).context, port_num, wc, grh, &mut attr) } != 0 {
        return null_mut();
    }
    // SAFETY: a PD of ours and the attributes just made.
    unsafe { sv_ibv_create_ah(pd, &mut attr) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    if ah.is_null() {
        return EINVAL;
    }
    // SAFETY: `ah` came from `sv_ibv_create_ah` (Box::into_raw of an SvAh).
    drop(unsafe { Box::from_raw(ah as *mut SvAh) });
    0
}

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
            let (max_wr, max_sge, srq_limit) = nic.attr();
            ia.attr = ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit,
            };
            let srq = ibv_srq {
                // SAFETY: a PD of ours.
                context: unsafe { (*pd).context },
                srq_context: ia.srq_context,
                pd,
                handle: nic.id(),
                mutex: Default::default(),
                cond: Default::default(),
                events_completed: 0,
            };
            let id = nic.id();
            // SAFETY: a PD of ours, whose context is open.
            let reg = unsafe { ctx_of((*pd).context) }.reg.clone();
            let b = Box::into_raw(Box::new(SvSrq {
                srq,
                nic,
                reg: reg.clone(),
            }));
            Registry::set(&reg.srqs, id, b as usize);
            b as *mut ibv_srq
        }
        Err(e) => null(e),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    if srq.is_null() || attr.is_null() {
        return EINVAL;
    }
    // SAFETY: an SRQ of ours.
    let (max_wr, max_sge, srq_limit) = unsafe { &*(srq as *const SvSrq) }.nic.attr();
    // SAFETY: the caller's writable struct.
    unsafe {
        attr.write(ibv_srq_attr {
            max_wr,
            max_sge,
            srq_limit,
        })
    };
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
    // SAFETY: `srq` came from `sv_ibv_create_srq` (Box::into_raw of an SvSrq).
    let b = unsafe { Box::from_raw(srq as *mut SvSrq) };
    Registry::set(&b.reg.srqs, b.nic.id(), 0);
    0
}

// ---- Async events --------------------------------------------------------------------------

/// The C object registered under `id`, if it still exists.
fn lookup(map: &Mutex<HashMap<u32, usize>>, id: u32) -> Option<usize> {
    map.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .copied()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_get_async_event(
    ctx: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    if ctx.is_null() || event.is_null() {
        set_errno(EINVAL);
        return -1;
    }
    // SAFETY: a context of ours.
    let sv = unsafe { ctx_of(ctx) };
    let blocking = sv.async_blocking();
    loop {
        let ev = match sv.nic.events().pop(blocking) {
            Ok(ev) => ev,
            Err(e) => {
                set_errno(e.errno());
                return -1;
            }
        };
        let element = match ev.element {
            EventElement::Qp(n) => lookup(&sv.reg.qps, n),
            EventElement::Cq(n) => lookup(&sv.reg.cqs, n),
            EventElement::Srq(n) => lookup(&sv.reg.srqs, n),
            // The union's `int port_num`: the low bytes of the pointer-sized slot.
            EventElement::Port(p) => Some(usize::from(p)),
            EventElement::Device => Some(0),
        };
        // An event about an object the program already destroyed has no one to go to.
        let Some(element) = element else { continue };
        // SAFETY: the caller's writable event.
        unsafe {
            event.write(ibv_async_event {
                element: element as *mut c_void,
                event_type: ev.kind as c_int,
            })
        };
        return 0;
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_ack_async_event(event: *mut ibv_async_event) {
    if event.is_null() {
        return;
    }
    // SAFETY: an event `ibv_get_async_event` filled; its object is live until acknowledged.
    let (el, ty) = unsafe { ((*event).element, (*event).event_type) };
    if el.is_null() {
        return;
    }
    // SAFETY: the element is the C object the event type names.
    unsafe {
        match ty {
            // IBV_EVENT_CQ_ERR
            0 => {
                let cq = el as *mut ibv_cq;
                (*cq).async_events_completed = (*cq).async_events_completed.wrapping_add(1);
            }
            // QP events: FATAL … PATH_MIG_ERR, QP_LAST_WQE_REACHED.
            1..=7 | 16 => {
                let qp = el as *mut ibv_qp;
                (*qp).events_completed = (*qp).events_completed.wrapping_add(1);
            }
            // IBV_EVENT_SRQ_ERR, IBV_EVENT_SRQ_LIMIT_REACHED
            14 | 15 => {
                let srq = el as *mut ibv_srq;
                (*srq).events_completed = (*srq).events_completed.wrapping_add(1);
            }
            _ => {}
        }
    }
}

// ---- Strings -------------------------------------------------------------------------------

fn pick(table: &[&'static core::ffi::CStr], i: c_int) -> *const c_char {
    usize::try_from(i)
        .ok()
        .and_then(|i| table.get(i))
        .map_or(c"unknown".as_ptr(), |s| s.as_ptr())
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_wc_status_str(status: c_int) -> *const c_char {
    pick(
        &[
            c"success",
            c"local length error",
            c"local QP operation error",
            c"local EE context operation error",
            c"local protection error",
            c"Work Request Flushed Error",
            c"memory management operation error",
            c"bad response error",
            c"local access error",
            c"remote invalid request error",
            c"remote access error",
            c"remote operation error",
            c"transport retry counter exceeded",
            c"RNR retry counter exceeded",
            c"local RDD violation error",
            c"remote invalid RD request",
            c"aborted error",
            c"invalid EE context number",
            c"invalid EE context state",
            c"fatal error",
            c"response timeout error",
            c"general error",
            c"TM error",
            c"TM Rendezvous error",
        ],
        status,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_node_type_str(t: c_int) -> *const c_char {
    pick(
        &[
            c"unknown",
            c"InfiniBand channel adapter",
            c"InfiniBand switch",
            c"InfiniBand router",
            c"iWARP NIC",
            c"usNIC",
            c"usNIC UDP",
            c"unspecified",
        ],
        t,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_port_state_str(s: c_int) -> *const c_char {
    pick(
        &[
            c"PORT_NOP",
            c"PORT_DOWN",
            c"PORT_INIT",
            c"PORT_ARMED",
            c"PORT_ACTIVE",
            c"PORT_ACTIVE_DEFER",
        ],
        s,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_event_type_str(e: c_int) -> *const c_char {
    pick(
        &[
            c"CQ error",
            c"local work queue catastrophic error",
            c"invalid request local work queue error",
            c"local access violation work queue error",
            c"communication established",
            c"send queue drained",
            c"path migrated",
            c"path migration request error",
            c"local catastrophic error",
            c"port active",
            c"port error",
            c"LID change",
            c"P_Key change",
            c"SM change",
            c"SRQ catastrophic error",
            c"SRQ limit reached",
            c"last WQE reached",
            c"client reregistration",
            c"GID table change",
            c"WQ fatal",
        ],
        e,
    )
}

// ---- The new post-send API (`ibv_qp_ex`, `ibv_wr_*`) ---------------------------------------

/// `IBV_QP_INIT_ATTR_PD`, `..._CREATE_FLAGS` and `..._SEND_OPS_FLAGS`.
const QP_INIT_PD: u32 = 1;
const QP_INIT_CREATE_FLAGS: u32 = 1 << 2;
const QP_INIT_SEND_OPS_FLAGS: u32 = 1 << 6;
/// `IBV_QP_EX_WITH_RDMA_WRITE` … `IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD`: the opcodes the
/// `ibv_wr_*` API supports here.
const SEND_OPS_SUPPORTED: u64 = (1 << 7) - 1;

#[derive(Default)]
struct Batch {
    wqes: Vec<SendWqe<'static>>,
    /// First error of the batch (an `ibv_wr_*` call out of order); `wr_complete` returns it.
    error: Option<c_int>,
}

fn qp_ex(qp_base: ibv_qp) -> ibv_qp_ex {
    ibv_qp_ex {
        qp_base,
        comp_mask: 0,
        wr_id: 0,
        wr_flags: 0,
        wr_atomic_cmp_swp: Some(wr_atomic_cmp_swp),
        wr_atomic_fetch_add: Some(wr_atomic_fetch_add),
        wr_bind_mw: None,
        wr_local_inv: None,
        wr_rdma_read: Some(wr_rdma_read),
        wr_rdma_write: Some(wr_rdma_write),
        wr_rdma_write_imm: Some(wr_rdma_write_imm),
        wr_send: Some(wr_send),
        wr_send_imm: Some(wr_send_imm),
        wr_send_inv: None,
        wr_send_tso: None,
        wr_set_ud_addr: Some(wr_set_ud_addr),
        wr_set_xrc_srqn: None,
        wr_set_inline_data: Some(wr_set_inline_data),
        wr_set_inline_data_list: Some(wr_set_inline_data_list),
        wr_set_sge: Some(wr_set_sge),
        wr_set_sge_list: Some(wr_set_sge_list),
        wr_start: Some(wr_start),
        wr_complete: Some(wr_complete),
        wr_abort: Some(wr_abort),
        wr_atomic_write: None,
    }
}

/// `verbs_context::create_qp_ex`, reached by the header's inline `ibv_create_qp_ex`.
unsafe extern "C" fn create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    if ctx.is_null() || attr.is_null() {
        return inval();
    }
    // SAFETY: the caller's attributes.
    let a = unsafe { &mut *attr };
    let known = QP_INIT_PD | QP_INIT_CREATE_FLAGS | QP_INIT_SEND_OPS_FLAGS;
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
    };
    b.wqes.push(wqe);
}

/// Applies `f` to the work request being built; records EINVAL if there is none.
///
/// # Safety
/// `qp` must be a live QP of this library.
unsafe fn last(qp: *mut ibv_qp_ex, f: impl FnOnce(&mut SendWqe<'static>)) {
    // SAFETY: forwarded.
    let (_, mut b) = unsafe { batch(qp) };
    match b.wqes.last_mut() {
        Some(w) => f(w),
        None => {
            b.error.get_or_insert(EINVAL);
        }
    }
}

unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    // SAFETY: the caller's QP.
    let (_, mut b) = unsafe { batch(qp) };
    *b = Batch::default();
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    // SAFETY: the caller's QP.
    let (_, mut b) = unsafe { batch(qp) };
    *b = Batch::default();
}

unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
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
    // SAFETY: the caller's list of `n` SGEs.
    match unsafe { sges(list, n) } {
        // SAFETY: the caller's QP.
        Ok(s) => unsafe { last(qp, |w| w.payload = Payload::Sges(Cow::Owned(s))) },
        Err(_) => {
            // SAFETY: the caller's QP.
            let (_, mut b) = unsafe { batch(qp) };
            b.error.get_or_insert(EINVAL);
        }
    }
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
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
    let mut bytes = Vec::new();
    if n > 0 && !list.is_null() {
        // SAFETY: the caller's list of `n` buffers.
        for b in unsafe { std::slice::from_raw_parts(list, n) } {
            if b.length > 0 && !b.addr.is_null() {
                // SAFETY: each buffer is readable for its length during the call.
                bytes.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(b.addr as *const u8, b.length)
                });
            }
        }
    }
    // SAFETY: the caller's QP.
    unsafe { last(qp, |w| w.payload = Payload::Inline(Cow::Owned(bytes))) }
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
