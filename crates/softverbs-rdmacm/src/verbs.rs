//! The libibverbs entry points the CM calls, looked up at run time in the `libibverbs.so.1`
//! the program loaded (the drop-in, under `softverbs run`), as the real librdmacm calls the
//! real libibverbs. Nothing links this library to a libibverbs at build time.

use crate::ibv::*;
use core::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

/// The functions, resolved once.
pub struct Verbs {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub get_device_guid: unsafe extern "C" fn(*mut ibv_device) -> u64,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub attach_mcast: unsafe extern "C" fn(*mut ibv_qp, *const ibv_gid, u16) -> c_int,
    pub detach_mcast: unsafe extern "C" fn(*mut ibv_qp, *const ibv_gid, u16) -> c_int,
    pub create_srq: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq,
    pub destroy_srq: unsafe extern "C" fn(*mut ibv_srq) -> c_int,
    /// softverbs' own `softverbs_inplace_exclusive` (`None` under another libibverbs).
    pub inplace_exclusive: Option<InplaceExclusive>,
    /// For rsockets: their buffers and iomapped windows.
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    /// For rsockets: waking on completions.
    pub get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, core::ffi::c_uint),
}

/// `softverbs_inplace_exclusive(cb, arg)` of the drop-in libibverbs.
pub type InplaceExclusive =
    unsafe extern "C" fn(Option<unsafe extern "C" fn(*mut c_void)>, *mut c_void);

/// Runs `f` while the drop-in libibverbs moves no memory into a memfd (see its `inplace`
/// module): the CM agent's allocations must not land on heap pages a registration on the
/// program's thread is copying, or the program's heap is corrupted.
pub fn without_moves(f: &mut dyn FnMut()) {
    unsafe extern "C" fn call(arg: *mut c_void) {
        // SAFETY: `arg` is the `&mut &mut dyn FnMut()` below, alive for this call.
        let f = unsafe { &mut *(arg as *mut &mut dyn FnMut()) };
        f();
    }
    match verbs().and_then(|v| v.inplace_exclusive) {
        Some(ex) => {
            let mut f = f;
            // SAFETY: `call` is given the pointer to `f`, which outlives the call.
            unsafe { ex(Some(call), (&mut f as *mut &mut dyn FnMut()).cast()) }
        }
        None => f(),
    }
}

static VERBS: OnceLock<Option<Verbs>> = OnceLock::new();

/// The program's libibverbs, or `None` (with the reason on stderr once) if it has none.
pub fn verbs() -> Option<&'static Verbs> {
    VERBS.get_or_init(load).as_ref()
}

// Each transmute's target is the type of the field it fills, spelled once in `Verbs`.
#[allow(clippy::missing_transmute_annotations)]
fn load() -> Option<Verbs> {
    // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life.
    let h = unsafe {
        libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_GLOBAL,
        )
    };
    if h.is_null() {
        eprintln!("librdmacm (softverbs): cannot load libibverbs.so.1");
        return None;
    }
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: `h` is a live handle and the name is NUL-terminated.
            let p = unsafe { libc::dlsym(h, concat!($name, "\0").as_ptr().cast()) };
            if p.is_null() {
                eprintln!("librdmacm (softverbs): libibverbs.so.1 has no {}", $name);
                return None;
            }
            // SAFETY: the symbol is the libibverbs function of that name, whose C signature
            // (from <infiniband/verbs.h>) the field's type spells.
            unsafe { std::mem::transmute::<*mut c_void, _>(p) }
        }};
    }
    Some(Verbs {
        get_device_list: sym!("ibv_get_device_list"),
        free_device_list: sym!("ibv_free_device_list"),
        get_device_name: sym!("ibv_get_device_name"),
        get_device_guid: sym!("ibv_get_device_guid"),
        open_device: sym!("ibv_open_device"),
        close_device: sym!("ibv_close_device"),
        query_gid: sym!("ibv_query_gid"),
        query_port: sym!("ibv_query_port"),
        alloc_pd: sym!("ibv_alloc_pd"),
        dealloc_pd: sym!("ibv_dealloc_pd"),
        create_comp_channel: sym!("ibv_create_comp_channel"),
        destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
        create_cq: sym!("ibv_create_cq"),
        destroy_cq: sym!("ibv_destroy_cq"),
        create_qp: sym!("ibv_create_qp"),
        destroy_qp: sym!("ibv_destroy_qp"),
        modify_qp: sym!("ibv_modify_qp"),
        attach_mcast: sym!("ibv_attach_mcast"),
        detach_mcast: sym!("ibv_detach_mcast"),
        create_srq: sym!("ibv_create_srq"),
        destroy_srq: sym!("ibv_destroy_srq"),
        reg_mr: sym!("ibv_reg_mr"),
        dereg_mr: sym!("ibv_dereg_mr"),
        get_cq_event: sym!("ibv_get_cq_event"),
        ack_cq_events: sym!("ibv_ack_cq_events"),
        inplace_exclusive: {
            // SAFETY: as above; absent from another libibverbs, which is fine.
            let p = unsafe { libc::dlsym(h, c"softverbs_inplace_exclusive".as_ptr()) };
            // SAFETY: the drop-in's function of that name has this signature.
            (!p.is_null())
                .then(|| unsafe { std::mem::transmute::<*mut c_void, InplaceExclusive>(p) })
        },
    })
}
