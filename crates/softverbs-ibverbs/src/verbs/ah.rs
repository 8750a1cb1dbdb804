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
        let Some((sgid, dgid, flow_label, traffic_class)) = grh_addresses(g) else {
            return fail(libc::EPROTONOSUPPORT);
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
            flow_label,
            sgid_index: index,
            hop_limit: 0xff,
            traffic_class,
        };
    }
    // SAFETY: the caller's writable attributes.
    unsafe { ah_attr.write(a) };
    0
}

/// The source and destination GIDs, flow label and traffic class of the 40 bytes before a UD
/// receive: a GRH, or, for RoCEv2 over IPv4, the IPv4 header in its last 20 bytes (as a
/// RoCE NIC and soft-RoCE write it). As rdma-core decides: IP version 6 in the first word is
/// a GRH unless bytes 20..40 are an IPv4 header with a valid checksum; anything else is none.
fn grh_addresses(g: &[u8; 40]) -> Option<([u8; 16], [u8; 16], u32, u8)> {
    let word0 = u32::from_be_bytes([g[0], g[1], g[2], g[3]]);
    let ip4 = &g[20..40];
    let ipv4_ok = ip4[0] == 0x45 && {
        let sum: u32 = ip4
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum();
        let folded = (sum & 0xffff) + (sum >> 16);
        (folded & 0xffff) + (folded >> 16) == 0xffff
    };
    if word0 >> 28 != 6 || ipv4_ok {
        if ip4[0] >> 4 != 4 {
            return None;
        }
        let mapped = |a: &[u8]| {
            let mut gid = [0u8; 16];
            gid[10] = 0xff;
            gid[11] = 0xff;
            gid[12..].copy_from_slice(a);
            gid
        };
        return Some((mapped(&ip4[12..16]), mapped(&ip4[16..20]), 0, ip4[1]));
    }
    let sgid = g[8..24].try_into().ok()?;
    let dgid = g[24..40].try_into().ok()?;
    Some((sgid, dgid, word0 & 0xf_ffff, (word0 >> 20) as u8))
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

#[cfg(test)]
mod tests {
    use super::grh_addresses;

    #[test]
    fn a_grh_and_an_ipv4_header_give_the_sender() {
        // A GRH: version 6, traffic class 0x12, flow label 0x34567.
        let mut g = [0u8; 40];
        g[..4].copy_from_slice(&(6u32 << 28 | 0x12 << 20 | 0x34567).to_be_bytes());
        g[8..24].copy_from_slice(&[1; 16]);
        g[24..40].copy_from_slice(&[2; 16]);
        assert_eq!(grh_addresses(&g), Some(([1; 16], [2; 16], 0x34567, 0x12)));
        // RoCEv2 over IPv4: 20 unused bytes, then 10.0.0.1 -> 10.0.0.2, TOS 0x20.
        let mut v4 = [0u8; 40];
        v4[20..40].copy_from_slice(&[
            0x45, 0x20, 0, 40, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ]);
        let sum: u32 = v4[20..40]
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum();
        let csum = !(((sum & 0xffff) + (sum >> 16)) as u16);
        v4[30..32].copy_from_slice(&csum.to_be_bytes());
        let (s, d, fl, tc) = grh_addresses(&v4).expect("an IPv4 header");
        assert_eq!(
            (&s[10..], &d[12..], fl, tc),
            (&[0xff, 0xff, 10, 0, 0, 1][..], &[10, 0, 0, 2][..], 0, 0x20)
        );
        // Neither: refused.
        assert_eq!(grh_addresses(&[0u8; 40]), None);
    }
}
