//! Shared PDs: `ibv_import_pd`/`ibv_unimport_pd` and `ibv_import_mr`/`ibv_unimport_mr` in a
//! context made by `ibv_import_device` (in `device`). The model is the NIC's
//! (`softverbs_nic::device`'s `shared` module): an imported PD checks keys in its exporter's
//! table, so QPs made in it reach the exporter's regions.

use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_import_pd(ctx: *mut ibv_context, pd_handle: u32) -> *mut ibv_pd {
    if ctx.is_null() {
        return inval();
    }
    // SAFETY: a context of ours.
    match unsafe { ctx_of(ctx) }.nic.import_pd(pd_handle) {
        Ok(nic) => Box::into_raw(Box::new(SvPd {
            pd: ibv_pd {
                context: ctx,
                handle: pd_handle,
            },
            nic,
            parent: None,
        })) as *mut ibv_pd,
        Err(e) => null(e),
    }
}

/// `ibv_unimport_pd`: lets go of this process's handle; the exporter's PD is untouched. A
/// PD something still uses here stays (as `ibv_dealloc_pd` would answer EBUSY; the call
/// returns nothing).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_unimport_pd(pd: *mut ibv_pd) {
    // SAFETY: a PD of ours, or NULL.
    let Some(nic) = (unsafe { nic_pd(pd) }) else {
        return;
    };
    if !nic.is_imported() || nic.in_use() {
        return;
    }
    // SAFETY: `pd` came from `sv_ibv_import_pd` (Box::into_raw of an SvPd).
    drop(unsafe { Box::from_raw(pd as *mut SvPd) });
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_import_mr(pd: *mut ibv_pd, mr_handle: u32) -> *mut ibv_mr {
    // SAFETY: a PD of ours, or NULL.
    let Some(nic) = (unsafe { nic_pd(pd) }) else {
        return inval();
    };
    match nic.import_mr(mr_handle) {
        Ok(info) => {
            let mr = ibv_mr {
                // SAFETY: a PD of ours.
                context: unsafe { (*pd).context },
                pd,
                addr: info.addr as usize as *mut c_void,
                length: info.length as usize,
                handle: info.key,
                lkey: info.key,
                rkey: info.key,
            };
            // Not a live registration of this process: `ibv_dereg_mr` of it is EINVAL, and
            // `ibv_unimport_mr` frees it.
            let p = Box::into_raw(Box::new(SvMr {
                mr,
                nic: None,
                backing: None,
                dm: None,
            })) as *mut ibv_mr;
            imported_mrs().insert(p as usize);
            p
        }
        Err(e) => null(e),
    }
}

/// The `ibv_mr` pointers `ibv_import_mr` handed out and not yet unimported.
fn imported_mrs() -> std::sync::MutexGuard<'static, HashSet<usize>> {
    static SET: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    SET.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// `ibv_unimport_mr`: frees this process's description of the region (anything else, such
/// as a registration of this process, is left alone).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_unimport_mr(mr: *mut ibv_mr) {
    if imported_mrs().remove(&(mr as usize)) {
        // SAFETY: `mr` came from `sv_ibv_import_mr` (Box::into_raw of an SvMr), once.
        drop(unsafe { Box::from_raw(mr as *mut SvMr) });
    }
}
