//! The QP of a connection: the attributes of each state change (`rdma_init_qp_attr`) and
//! the changes the CM makes itself.

use super::*;

impl Cm {
    /// Moves id `i`'s QP to ERR (flushing its work), if it has one.
    pub fn qp_to_err(&self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        // SAFETY: the id is live; its QP, if any, is the program's and still exists (the
        // program destroys it through rdma_destroy_qp, which clears the field first).
        let qp = unsafe { (*c.id).c.qp };
        if qp.is_null() {
            return;
        }
        let Some(v) = verbs() else { return };
        // SAFETY: a zeroed attr with the state set is a valid modify request.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = IBV_QPS_ERR;
        // SAFETY: as above.
        unsafe { (v.modify_qp)(qp, &mut a, QP_STATE) };
    }

    /// The attributes to move id `i`'s QP to `state` (`rdma_init_qp_attr`).
    pub fn qp_attr(&self, i: u32, state: c_int) -> Result<(ibv_qp_attr, c_int), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        // SAFETY: zeroed attrs are a valid start.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = state;
        // SAFETY: the id is live.
        let id = unsafe { &*c.id };
        let qp_type = if id.c.qp.is_null() {
            id.c.qp_type
        } else {
            // SAFETY: the program's QP on this id.
            unsafe { (*id.c.qp).qp_type }
        };
        let ud = qp_type == IBV_QPT_UD;
        let mask = match state {
            IBV_QPS_INIT => {
                a.pkey_index = 0;
                a.port_num = 1;
                if ud {
                    a.qkey = RDMA_UDP_QKEY;
                    QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_QKEY
                } else {
                    a.qp_access_flags = ACCESS_REMOTE_WRITE;
                    if c.responder_resources > 0 {
                        a.qp_access_flags |= ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC;
                    }
                    QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS
                }
            }
            IBV_QPS_RTR if ud => QP_STATE,
            IBV_QPS_RTR => {
                if !matches!(
                    c.state,
                    State::ReqRcvd
                        | State::RepRcvd
                        | State::ReqSent
                        | State::Established
                        | State::RepSent
                ) {
                    return Err(libc::EINVAL);
                }
                a.path_mtu = c.mtu;
                a.dest_qp_num = c.remote_qpn;
                a.rq_psn = c.remote_psn;
                a.ah_attr = self.ah_of(c);
                let mut m = QP_STATE | QP_AV | QP_PATH_MTU | QP_DEST_QPN | QP_RQ_PSN;
                if qp_type == IBV_QPT_RC {
                    a.max_dest_rd_atomic = c.responder_resources;
                    a.min_rnr_timer = 0;
                    a.qp_access_flags = ACCESS_REMOTE_WRITE;
                    if c.responder_resources > 0 {
                        a.qp_access_flags |= ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC;
                    }
                    m |= QP_MAX_DEST_RD_ATOMIC | QP_MIN_RNR_TIMER | QP_ACCESS_FLAGS;
                }
                m
            }
            IBV_QPS_RTS => {
                a.sq_psn = if ud { 0 } else { c.psn };
                let mut m = QP_STATE | QP_SQ_PSN;
                if qp_type == IBV_QPT_RC {
                    a.timeout = c.ack_timeout.unwrap_or(DEFAULT_ACK_TIMEOUT);
                    a.retry_cnt = c.retry_count;
                    a.rnr_retry = c.peer_rnr_retry;
                    a.max_rd_atomic = c.initiator_depth;
                    m |= QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_MAX_QP_RD_ATOMIC;
                }
                m
            }
            _ => return Err(libc::EINVAL),
        };
        Ok((a, mask))
    }

    /// The address vector from id `i` to its peer.
    pub fn ah_of(&self, c: &Conn) -> ibv_ah_attr {
        ibv_ah_attr {
            grh: ibv_global_route {
                dgid: ibv_gid(c.dgid),
                flow_label: 0,
                sgid_index: c.gid_index as u8,
                hop_limit: 64,
                traffic_class: c.tos,
            },
            dlid: 0,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: 1,
            port_num: 1,
        }
    }

    /// Moves id `i`'s QP (if any) through `states`.
    pub(super) fn modify_qp(&self, i: u32, states: &[c_int]) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        // SAFETY: the id is live.
        let qp = unsafe { (*c.id).c.qp };
        if qp.is_null() {
            return Ok(());
        }
        let v = verbs().ok_or(libc::ENOSYS)?;
        for &s in states {
            let (mut a, mask) = self.qp_attr(i, s)?;
            // SAFETY: the program's QP and a full attribute set for this transition.
            let r = unsafe { (v.modify_qp)(qp, &mut a, mask) };
            if r != 0 {
                return Err(if r > 0 { r } else { libc::EINVAL });
            }
        }
        Ok(())
    }
}
