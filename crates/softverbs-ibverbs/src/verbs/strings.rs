//! The `*_str` calls.

use super::*;

pub(super) fn pick(table: &[&'static core::ffi::CStr], i: c_int) -> *const c_char {
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
