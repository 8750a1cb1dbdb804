//! What a QP is created with and what `ibv_modify_qp`/`ibv_query_qp` carry.

use crate::cq::Cq;
use crate::device::PORT_NUM;
use crate::qp::rq::Srq;
use crate::types::{AccessFlags, AhAttr, Mtu, QpState, QpType};
use std::sync::Arc;

/// Queue sizes of a QP (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// What `create_qp` needs (`struct ibv_qp_init_attr`).
pub struct QpInit {
    pub qp_type: QpType,
    pub send_cq: Arc<Cq>,
    pub recv_cq: Arc<Cq>,
    pub srq: Option<Arc<Srq>>,
    pub cap: QpCap,
    pub sq_sig_all: bool,
}

/// QP attributes (`struct ibv_qp_attr`); which ones matter is said by a
/// [`QpAttrMask`](crate::types::QpAttrMask).
#[derive(Debug, Clone, PartialEq, Eq)]
#[repr(C)]
pub struct QpAttr {
    // What a request reads first (see `SendState`).
    pub dest_qp_num: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub port_num: u8,
    pub ah_attr: AhAttr,
    pub qp_state: QpState,
    pub cur_qp_state: QpState,
    pub path_mtu: Mtu,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub qp_access_flags: AccessFlags,
    pub cap: QpCap,
    pub alt_ah_attr: AhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: bool,
    pub sq_draining: bool,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            qp_state: QpState::Reset,
            cur_qp_state: QpState::Reset,
            path_mtu: Mtu::Mtu1024,
            path_mig_state: 0,
            qkey: 0,
            rq_psn: 0,
            sq_psn: 0,
            dest_qp_num: 0,
            qp_access_flags: AccessFlags::empty(),
            cap: QpCap::default(),
            ah_attr: AhAttr::default(),
            alt_ah_attr: AhAttr::default(),
            pkey_index: 0,
            alt_pkey_index: 0,
            en_sqd_async_notify: false,
            sq_draining: false,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            port_num: PORT_NUM,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            alt_port_num: 0,
            alt_timeout: 0,
            rate_limit: 0,
        }
    }
}
