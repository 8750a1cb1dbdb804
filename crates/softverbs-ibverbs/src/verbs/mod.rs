//! The implemented verbs. Each `sv_<name>` is bound to `<name>@@IBVERBS_<v>` by `build.rs`.
//!
//! This module holds the C objects' wrappers and the registries every area shares; the
//! calls are in one file per area: `device` (listing, opening, queries, GIDs), `mr`, `mw`, `cq`,
//! `qp`, `post` (the data path of `ibv_context::ops`), `qp_ex` (the `ibv_wr_*` API), `ah`,
//! `srq`, `xrc` (XRC domains, XRC SRQs and target QPs), `import` (shared PDs), `events`
//! (asynchronous events) and `strings`.

use crate::abi::*;
use crate::set_errno;
use core::ffi::{c_char, c_int, c_uint, c_void};
use softverbs_nic::cq::{Channel, Cq, Cqe};
use softverbs_nic::device::Context;
use softverbs_nic::device::Device;
use softverbs_nic::device::event::EventElement;
use softverbs_nic::pd::{Mr, Pd, Prefetch};
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

/// Sleeps until the doorbell pipe `fd` is rung, as rdma-core's `ibv_get_cq_event` and
/// `ibv_get_async_event` sleep in `read(2)` of the channel: a caught signal ends the sleep
/// with `EINTR` (Err), unless its handler has `SA_RESTART`. Programs such as qperf stop
/// their test loop from a `SIGALRM` handler that way, so retrying here would hang them.
/// A blocking descriptor is read (one wake-up byte; the events themselves are in the NIC's
/// rings), which the kernel restarts for `SA_RESTART` handlers exactly as it does for
/// rdma-core; any other is polled, which no handler restarts.
fn wait_rung(fd: c_int) -> std::result::Result<(), c_int> {
    let errno = || {
        // SAFETY: this thread's errno slot.
        unsafe { *libc::__errno_location() }
    };
    if blocking(fd) {
        let mut b = 0u8;
        // SAFETY: reads at most one byte into a local.
        let n = unsafe { libc::read(fd, &mut b as *mut u8 as *mut c_void, 1) };
        return if n >= 0 { Ok(()) } else { Err(errno()) };
    }
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd on the stack.
    if unsafe { libc::poll(&mut p, 1, -1) } < 0 {
        return Err(errno());
    }
    Ok(())
}

#[repr(C)]
struct SvPd {
    pd: ibv_pd,
    nic: Arc<Pd>,
    /// For a parent domain (`ibv_alloc_parent_domain`): what it was made of.
    parent: Option<domain::Parent>,
}

#[repr(C)]
struct SvMr {
    mr: ibv_mr,
    nic: Option<Mr>,
    backing: Option<softverbs_nic::mr::keys::Backing>,
    /// The device memory a region of `ibv_reg_dm_mr` lies in (kept mapped while it lives).
    dm: Option<softverbs_nic::pd::DmHold>,
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
    /// rdma-core 45's `ibv_qp_ex::wr_flush`, the member after `wr_atomic_write` (the last
    /// of rdma-core 44's struct, which `qpx` is): a program built against newer headers
    /// finds it here.
    wr_flush: Option<WrFlush>,
    /// Work requests built by the `ibv_wr_*` API between `wr_start` and `wr_complete`.
    batch: Mutex<Batch>,
    nic: Arc<Qp>,
    reg: Arc<Registry>,
    /// A second handle to an XRC target QP (`ibv_open_qp`): destroying it lets go of the
    /// handle only; the QP is its creator's.
    opened: bool,
}

// rdma-core 45's `wr_flush` member is where a program built against it looks.
const _: () = assert!(std::mem::offset_of!(SvQp, wr_flush) == std::mem::size_of::<ibv_qp_ex>());

impl SvContext {
    /// Whether `ibv_get_async_event` waits: unless the program set `O_NONBLOCK` on
    /// `async_fd`.
    fn async_blocking(&self) -> bool {
        self.async_own_fd.is_none() || blocking(self.vctx.context.async_fd)
    }
}

/// Built once and never changed, so each `ibv_device` keeps its address for the process's life.
static DEVICES: OnceLock<std::result::Result<Vec<SvDevice>, Error>> = OnceLock::new();

/// The root of the devices' sysfs tree (`crate::sysfs`), set with [`DEVICES`]; "/sys", as
/// rdma-core says without devices, when the tree could not be written.
pub(crate) static SYSFS_ROOT: OnceLock<std::ffi::CString> = OnceLock::new();

/// Writes the sysfs tree of `nics` and returns its root, or None (with one line on stderr)
/// when there is no room for it: then the paths name the kernel's tree, as rdma-core's do,
/// and a program looking there finds nothing of ours (Open MPI's openib then skips the
/// device) rather than a path that cannot be opened at all.
fn sysfs_root(nics: &[Arc<Device>]) -> Option<String> {
    let refs: Vec<&Device> = nics.iter().map(|n| &**n).collect();
    let err = match crate::sysfs::publish(&refs) {
        // The longest path (`/class/infiniband/` and a 63-byte name) must fit
        // `ibv_device::ibdev_path` (IBV_SYSFS_PATH_MAX) whole.
        Ok(root) => match root.into_os_string().into_string() {
            Ok(r) if r.len() + "/class/infiniband/".len() + 63 < 256 => return Some(r),
            Ok(r) => format!("{r}: too long for ibv_device's 256-byte paths"),
            Err(r) => format!("{}: not UTF-8", r.to_string_lossy()),
        },
        Err(e) => e.to_string(),
    };
    eprintln!("libibverbs (softverbs): no sysfs tree for the devices: {err}");
    None
}

fn devices() -> Result<&'static [SvDevice]> {
    let list = DEVICES.get_or_init(|| {
        let mut out = Vec::new();
        let nics = Device::list()?;
        let root = sysfs_root(&nics);
        let base = root.as_deref().unwrap_or("/sys");
        let _ = SYSFS_ROOT.set(std::ffi::CString::new(base).unwrap_or_else(|_| c"/sys".into()));
        for (i, nic) in nics.into_iter().enumerate() {
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
                &format!("{base}/class/infiniband_verbs/uverbs{i}"),
            );
            copy_str(
                &mut dev.ibdev_path,
                &format!("{base}/class/infiniband/{}", nic.name()),
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

/// What `ibv_get_sysfs_path` returns: the devices' tree, listing them first if no call has.
pub(crate) fn sysfs_path() -> &'static std::ffi::CStr {
    let _ = devices();
    SYSFS_ROOT.get().map_or(c"/sys", |c| c.as_c_str())
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

mod ah;
mod cq;
mod device;
mod dm;
mod domain;
mod events;
mod import;
mod mr;
mod mw;
mod post;
mod qp;
mod qp_ex;
mod srq;
mod strings;
mod xrc;

use cq::*;
use post::*;
use qp::*;
use qp_ex::*;

pub(crate) use cq::with_live_cq;
pub(crate) use device::with_live_ctx;
pub(crate) use mr::{new_mr, nic_pd, with_live_mr};
