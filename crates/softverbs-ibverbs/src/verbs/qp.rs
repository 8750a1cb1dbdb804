//! QPs: creation, state changes and queries.

use super::*;

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
    if qp_type == QpType::XrcRecv {
        // A target QP is made in an XRC domain (`ibv_create_qp_ex` with IBV_QP_INIT_ATTR_XRCD).
        return inval();
    }
    // An XRC initiator has no receive side: its receive CQ may be NULL.
    if qp_type == QpType::XrcSend && ia.recv_cq.is_null() {
        ia.recv_cq = ia.send_cq;
    }
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
    // SAFETY: a PD of ours.
    let context = unsafe { (*pd).context };
    let ptrs = QpPtrs {
        pd,
        send_cq: ia.send_cq,
        recv_cq: ia.recv_cq,
        srq: ia.srq,
    };
    // SAFETY: a context of ours, open.
    unsafe { wrap_qp(context, ptrs, ia.qp_context, nic, false) }
}

/// The objects an `ibv_qp` names (NULL where the QP has none: an XRC target's).
pub(super) struct QpPtrs {
    pub(super) pd: *mut ibv_pd,
    pub(super) send_cq: *mut ibv_cq,
    pub(super) recv_cq: *mut ibv_cq,
    pub(super) srq: *mut ibv_srq,
}

impl QpPtrs {
    /// An XRC target's: it has no PD, CQs or SRQ of its own.
    pub(super) const NONE: QpPtrs = QpPtrs {
        pd: null_mut(),
        send_cq: null_mut(),
        recv_cq: null_mut(),
        srq: null_mut(),
    };
}

/// Hands QP `nic` to C as an `ibv_qp` of `context`; `opened`: a second handle
/// (`ibv_open_qp`), which async events do not name.
///
/// # Safety
/// `context` must be an open context of this library.
pub(super) unsafe fn wrap_qp(
    context: *mut ibv_context,
    p: QpPtrs,
    qp_context: *mut c_void,
    nic: Arc<Qp>,
    opened: bool,
) -> *mut ibv_qp {
    let qp = ibv_qp {
        context,
        qp_context,
        pd: p.pd,
        send_cq: p.send_cq,
        recv_cq: p.recv_cq,
        srq: p.srq,
        handle: nic.qpn(),
        qp_num: nic.qpn(),
        state: nic.state() as c_int,
        qp_type: nic.qp_type() as c_int,
        mutex: Default::default(),
        cond: Default::default(),
        events_completed: 0,
    };
    let qpn = nic.qpn();
    // SAFETY: the caller's open context.
    let reg = unsafe { ctx_of(context) }.reg.clone();
    let b = Box::into_raw(Box::new(SvQp {
        qpx: qp_ex(qp),
        wr_flush: Some(wr_flush),
        batch: Mutex::new(Batch::default()),
        nic,
        reg: reg.clone(),
        opened,
    }));
    if !opened {
        Registry::set(&reg.qps, qpn, b as usize);
    }
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
    // SAFETY: a QP of ours, not yet destroyed.
    if unsafe { &*(qp as *const SvQp) }.nic.attached_groups() > 0 {
        // As the kernel's uverbs: detach it from its multicast groups first.
        return libc::EBUSY;
    }
    // SAFETY: `qp` came from `wrap_qp` (Box::into_raw of an SvQp).
    let b = unsafe { Box::from_raw(qp as *mut SvQp) };
    if b.opened {
        return 0;
    }
    Registry::set(&b.reg.qps, b.nic.qpn(), 0);
    // Its CQs, SRQ and PD are free to go now, even if the NIC still holds it a moment.
    b.nic.release_uses();
    0
}

pub(super) fn ah_in(a: &ibv_ah_attr) -> AhAttr {
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

/// The NIC QP and the group of an `ibv_attach_mcast`/`ibv_detach_mcast` call.
///
/// # Safety
/// `qp` must be NULL or a live QP of ours, `gid` NULL or readable.
unsafe fn mcast_args<'a>(
    qp: *mut ibv_qp,
    gid: *const ibv_gid,
) -> Option<(&'a Arc<Qp>, softverbs_nic::types::Gid)> {
    if qp.is_null() || gid.is_null() {
        return None;
    }
    // SAFETY: the caller's.
    let (sv, g) = unsafe { (&*(qp as *const SvQp), *gid) };
    Some((&sv.nic, softverbs_nic::types::Gid(g.0)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_attach_mcast(
    qp: *mut ibv_qp,
    gid: *const ibv_gid,
    lid: u16,
) -> c_int {
    // SAFETY: the caller's.
    match unsafe { mcast_args(qp, gid) } {
        Some((q, g)) => rc(q.attach_mcast(g, lid)),
        None => EINVAL,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_detach_mcast(
    qp: *mut ibv_qp,
    gid: *const ibv_gid,
    lid: u16,
) -> c_int {
    // SAFETY: the caller's.
    match unsafe { mcast_args(qp, gid) } {
        Some((q, g)) => rc(q.detach_mcast(g, lid)),
        None => EINVAL,
    }
}
