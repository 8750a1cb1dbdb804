//! Address handles.

use super::*;

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
