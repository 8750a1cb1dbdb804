//! The data path reached through `ibv_context::ops`: posting sends and receives.

use super::*;

/// The SGE list of a work request, of at most `max` entries (the queue's SGE limit): a
/// longer count is refused before the list is read, as providers do, since the caller's
/// array need not hold more than the QP allows.
///
/// # Safety
/// `list` must point to `n` SGEs (or `n` is 0, or `n` exceeds `max`).
pub(super) unsafe fn sges<'a>(list: *const ibv_sge, n: c_int, max: u32) -> Result<&'a [Sge]> {
    if n < 0 || (n > 0 && list.is_null()) {
        return Err(Error::InvalidArgument("num_sge/sg_list".into()));
    }
    if n as u32 > max {
        return Err(Error::InvalidArgument(format!(
            "{n} SGEs but the queue allows {max}"
        )));
    }
    if n == 0 {
        return Ok(&[]);
    }
    // SAFETY: the caller's list has `n` entries, valid for the call; `ibv_sge` and `Sge` are
    // the same `repr(C)` layout (asserted below), so the list is read in place, not copied.
    Ok(unsafe { std::slice::from_raw_parts(list.cast::<Sge>(), n as usize) })
}

const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<ibv_sge>() == size_of::<Sge>() && align_of::<ibv_sge>() == align_of::<Sge>());
    assert!(offset_of!(ibv_sge, addr) == offset_of!(Sge, addr));
    assert!(offset_of!(ibv_sge, length) == offset_of!(Sge, length));
    assert!(offset_of!(ibv_sge, lkey) == offset_of!(Sge, lkey));
};

/// Converts one `ibv_send_wr` for a QP with `cap`: an SGE count or an inline length over the
/// QP's limits is refused before the list or the bytes are read.
///
/// # Safety
/// `w` must be a valid send WR whose SGE list (and, for INLINE, the bytes it points at) is
/// readable.
pub(super) unsafe fn send_wqe(w: &ibv_send_wr, cap: &QpCap) -> Result<SendWqe<'static>> {
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
            // As soft-RoCE's provider takes it: the 8 bytes the one SGE points at, read now
            // (like inline data; `ibv_wr_atomic_write` passes them directly).
            WrOpcode::AtomicWrite => {
                if w.num_sge != 1 || w.sg_list.is_null() || (*w.sg_list).length != 8 {
                    return Err(bad("IBV_WR_ATOMIC_WRITE takes one SGE of 8 bytes"));
                }
                SendOp::AtomicWrite {
                    remote_addr: w.wr.rdma.remote_addr,
                    rkey: w.wr.rdma.rkey,
                    value: ((*w.sg_list).addr as usize as *const u64).read_unaligned(),
                }
            }
            // rdma-core 44's ABI reaches FLUSH only through an `ibv_wr_flush` it does not
            // have; `ibv_post_send` has no FLUSH fields (rdma-core 45 has none either).
            WrOpcode::Flush => {
                return Err(bad(
                    "RDMA FLUSH is not in rdma-core 44's ABI (ibv_wr_flush); use the Rust API",
                ));
            }
            WrOpcode::SendWithInv => SendOp::SendWithInv { rkey: w.imm_data },
            WrOpcode::LocalInv => SendOp::LocalInv { rkey: w.imm_data },
            // `bind_mw`: the window, the new rkey, then `struct ibv_mw_bind_info`.
            WrOpcode::BindMw => {
                let info = std::ptr::addr_of!(w._tail[2]) as *const ibv_mw_bind_info;
                mw::bind_op(w._tail[0] as usize as *mut ibv_mw, w._tail[1] as u32, info)?
            }
            // Seed 002's IBV_WR_BIND_MR (softverbs/verbs_ext.h): the provider's own opcode,
            // naming a layout container of ours where `bind_mw.mw` lies.
            WrOpcode::Driver1 => {
                let mr = w._tail[0] as usize as *mut ibv_mr;
                match with_live_mr(mr, |_, m| m.is_layout().then(|| m.key())) {
                    Some(Some(key)) => SendOp::BindLayout { key },
                    _ => return Err(bad("IBV_WR_BIND_MR without a layout container")),
                }
            }
        }
    };
    let flags = SendFlags::from_bits_retain(w.send_flags);
    if matches!(op, SendOp::AtomicWrite { .. }) || op.is_local() {
        return Ok(SendWqe {
            wr_id: w.wr_id,
            op,
            flags,
            payload: Payload::Sges(Cow::Owned(Vec::new())),
            ud: None,
            xrc_srqn: 0,
        });
    }
    // SAFETY: the caller's SGE list.
    let list = unsafe { sges(w.sg_list, w.num_sge, cap.max_send_sge) }?;
    let payload = if flags.contains(SendFlags::INLINE) {
        let total: u64 = list.iter().map(|s| u64::from(s.length)).sum();
        if total > u64::from(cap.max_inline_data) {
            return Err(Error::InvalidArgument(format!(
                "{total} inline bytes but max_inline_data is {}",
                cap.max_inline_data
            )));
        }
        if let [one] = list {
            // SAFETY: with IBV_SEND_INLINE the SGE addresses are the caller's own readable
            // buffers (no key involved), valid for the duration of the call, which is as long
            // as this borrow lives (a request queued past the call is copied then).
            let bytes = unsafe {
                std::slice::from_raw_parts(one.addr as usize as *const u8, one.length as usize)
            };
            return Ok(SendWqe {
                wr_id: w.wr_id,
                op,
                flags,
                payload: Payload::Inline(Cow::Borrowed(bytes)),
                ud: None,
                xrc_srqn: 0,
            });
        }
        let mut bytes = Vec::with_capacity(total as usize);
        for s in list {
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
        Payload::Sges(Cow::Borrowed(list))
    };
    Ok(SendWqe {
        wr_id: w.wr_id,
        op,
        flags,
        payload,
        ud: None,
        xrc_srqn: 0,
    })
}

/// Where `q` (converted from `w`) goes beyond the QP's connection: an XRC initiator's SRQ
/// number, a UD request's address handle.
///
/// # Safety
/// `w` is a valid WR for QP `sv`.
unsafe fn address(sv: &SvQp, w: &ibv_send_wr, q: &mut SendWqe<'_>) -> Result<()> {
    match sv.nic.qp_type() {
        QpType::XrcSend => q.xrc_srqn = w.qp_type,
        QpType::Ud => {
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
        _ => {}
    }
    Ok(())
}

pub(super) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    if qp.is_null() {
        return EINVAL;
    }
    // SAFETY: a QP of ours.
    let sv = unsafe { &*(qp as *const SvQp) };
    let cap = sv.nic.cap();
    let mut cur = wr;
    // Each request is posted as soon as it is read, so the common single request allocates
    // nothing; on a bad one, those before it are posted and `bad_wr` names it (the verbs'
    // contract).
    while !cur.is_null() {
        // SAFETY: the caller's linked list of valid WRs.
        let w = unsafe { &*cur };
        // SAFETY: as above.
        let mut conv = unsafe { send_wqe(w, &cap) };
        // Bound in place: the request is posted where it was built (see `Qp::post_one`).
        let posted = match conv {
            // SAFETY: as above.
            Ok(ref mut q) => unsafe { address(sv, w, q) }.and_then(|()| sv.nic.post_one(q)),
            Err(e) => Err(e),
        };
        if let Err(e) = posted {
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

pub(super) unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    if qp.is_null() {
        return EINVAL;
    }
    // SAFETY: a QP of ours.
    let sv = unsafe { &*(qp as *const SvQp) };
    let max = sv.nic.cap().max_recv_sge;
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the caller's linked list of valid WRs and their SGE lists.
        let w = unsafe { &*cur };
        // SAFETY: as above.
        let r =
            unsafe { sges(w.sg_list, w.num_sge, max) }.and_then(|s| sv.nic.post_recv(w.wr_id, s));
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

pub(super) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    if srq.is_null() {
        return EINVAL;
    }
    // SAFETY: an SRQ of ours.
    let sv = unsafe { &*(srq as *const SvSrq) };
    let max = sv.nic.max_sge();
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the caller's linked list of valid WRs and their SGE lists.
        let w = unsafe { &*cur };
        // SAFETY: as above.
        let r = unsafe { sges(w.sg_list, w.num_sge, max) }.and_then(|s| sv.nic.post(w.wr_id, s));
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
