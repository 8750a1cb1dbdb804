//! `#[repr(C)]` mirrors of the `<infiniband/verbs.h>` structs (rdma-core 44) this library
//! reads or writes. `tests/layout.rs` compares every size and field offset with the C header.

#![allow(non_camel_case_types, non_snake_case, dead_code)]

use core::ffi::{c_char, c_int, c_uint, c_void};

/// `pthread_mutex_t` on x86_64 glibc (all-zero is `PTHREAD_MUTEX_INITIALIZER`).
pub type pthread_mutex_t = [u64; 5];
/// `pthread_cond_t` on x86_64 glibc (all-zero is `PTHREAD_COND_INITIALIZER`).
pub type pthread_cond_t = [u64; 6];

/// Any function pointer slot this library leaves NULL.
pub type Slot = Option<unsafe extern "C" fn()>;

#[repr(C)]
pub struct _ibv_device_ops {
    pub _dummy1: Slot,
    pub _dummy2: Slot,
}

#[repr(C)]
pub struct ibv_device {
    pub _ops: _ibv_device_ops,
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; 64],
    pub dev_name: [c_char; 64],
    pub dev_path: [c_char; 256],
    pub ibdev_path: [c_char; 256],
}

pub type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyCq = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSrqRecv =
    unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PostSend =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecv =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type CreateQpEx =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_init_attr_ex) -> *mut ibv_qp;
pub type OpenQp = unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_open_attr) -> *mut ibv_qp;
pub type GetSrqNum = unsafe extern "C" fn(*mut ibv_srq, *mut u32) -> c_int;
pub type CreateSrqEx =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_srq_init_attr_ex) -> *mut ibv_srq;
pub type OpenXrcd =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_xrcd_init_attr) -> *mut ibv_xrcd;
pub type CloseXrcd = unsafe extern "C" fn(*mut ibv_xrcd) -> c_int;
pub type AllocMw = unsafe extern "C" fn(*mut ibv_pd, c_int) -> *mut ibv_mw;
pub type BindMw = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_mw, *mut ibv_mw_bind) -> c_int;
pub type DeallocMw = unsafe extern "C" fn(*mut ibv_mw) -> c_int;
pub type AdviseMr = unsafe extern "C" fn(*mut ibv_pd, c_int, u32, *mut ibv_sge, u32) -> c_int;
pub type QueryPort = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int;

/// `struct ibv_context_ops`: 32 pointers; only the data-path and memory-window ones are
/// filled.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat0: [Slot; 7],
    pub alloc_mw: Option<AllocMw>,
    pub bind_mw: Option<BindMw>,
    pub dealloc_mw: Option<DeallocMw>,
    pub _compat0b: Slot,
    pub poll_cq: Option<PollCq>,
    pub req_notify_cq: Option<ReqNotifyCq>,
    pub _compat1: [Slot; 7],
    pub post_srq_recv: Option<PostSrqRecv>,
    pub _compat2: [Slot; 4],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    pub _compat3: [Slot; 5],
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// `__VERBS_ABI_IS_EXTENDED`: `abi_compat` of a context embedded in a `verbs_context`.
pub const VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

/// `struct verbs_context`: the extended ops "grow up" in front of `context`.
#[repr(C)]
pub struct verbs_context {
    pub query_port: Option<QueryPort>,
    pub advise_mr: Option<AdviseMr>,
    /// `alloc_null_mr` … `destroy_counters`.
    pub _ex0a: [Slot; 5],
    pub reg_dm_mr: Option<RegDmMr>,
    pub alloc_dm: Option<AllocDm>,
    pub free_dm: Option<FreeDm>,
    /// `modify_flow_action_esp` … `modify_qp_rate_limit`.
    pub _ex0b: [Slot; 4],
    pub alloc_parent_domain: Option<AllocParentDomain>,
    pub dealloc_td: Option<DeallocTd>,
    pub alloc_td: Option<AllocTd>,
    /// `modify_cq` … `create_wq`.
    pub _ex0: [Slot; 7],
    pub query_rt_values: Option<QueryRtValues>,
    pub create_cq_ex: Option<CreateCqEx>,
    pub priv_: *mut c_void,
    pub query_device_ex: Option<QueryDeviceEx>,
    /// `ibv_destroy_flow` … `ABI_placeholder1`.
    pub _ex1: [Slot; 4],
    pub open_qp: Option<OpenQp>,
    pub create_qp_ex: Option<CreateQpEx>,
    pub get_srq_num: Option<GetSrqNum>,
    pub create_srq_ex: Option<CreateSrqEx>,
    pub open_xrcd: Option<OpenXrcd>,
    pub close_xrcd: Option<CloseXrcd>,
    pub _ABI_placeholder3: u64,
    pub sz: usize,
    pub context: ibv_context,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_mw {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub rkey: u32,
    pub handle: u32,
    /// `enum ibv_mw_type`.
    pub type_: c_int,
}

#[repr(C)]
pub struct ibv_mw_bind_info {
    pub mr: *mut ibv_mr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: c_uint,
}

#[repr(C)]
pub struct ibv_mw_bind {
    pub wr_id: u64,
    pub send_flags: c_uint,
    pub bind_info: ibv_mw_bind_info,
}

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `union ibv_gid`: 16 bytes, 8-aligned (it has a `__be64` pair member).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid(pub [u8; 16]);

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network order) or `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `wr.rdma` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// `wr.atomic` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `wr.ud` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct wr_ud {
    pub ah: *mut c_void,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// The `wr` union of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union wr_union {
    pub rdma: wr_rdma,
    pub atomic: wr_atomic,
    pub ud: wr_ud,
}

#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    /// `imm_data` (network order) or `invalidate_rkey`.
    pub imm_data: u32,
    pub wr: wr_union,
    /// `qp_type.xrc.remote_srqn`.
    pub qp_type: u32,
    /// The `bind_mw` / `tso` union (48 bytes).
    pub _tail: [u64; 6],
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

impl Default for ibv_device_attr {
    fn default() -> Self {
        // SAFETY: integers and a char array only; all-zero is a valid value.
        unsafe { core::mem::zeroed() }
    }
}

#[repr(C)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

/// `struct ibv_xrcd`.
#[repr(C)]
pub struct ibv_xrcd {
    pub context: *mut ibv_context,
}

/// `struct ibv_xrcd_init_attr`.
#[repr(C)]
pub struct ibv_xrcd_init_attr {
    pub comp_mask: u32,
    pub fd: c_int,
    pub oflags: c_int,
}

/// `struct ibv_srq_init_attr_ex`.
#[repr(C)]
pub struct ibv_srq_init_attr_ex {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
    pub comp_mask: u32,
    pub srq_type: c_int,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut ibv_xrcd,
    pub cq: *mut ibv_cq,
    /// `struct ibv_tm_cap`: `max_num_tags`, `max_ops`.
    pub tm_cap: [u32; 2],
}

/// `struct ibv_qp_open_attr`.
#[repr(C)]
pub struct ibv_qp_open_attr {
    pub comp_mask: u32,
    pub qp_num: u32,
    pub xrcd: *mut ibv_xrcd,
    pub qp_context: *mut c_void,
    pub qp_type: c_int,
}

/// `struct ibv_rx_hash_conf`.
#[repr(C)]
pub struct ibv_rx_hash_conf {
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
}

#[repr(C)]
pub struct ibv_qp_init_attr_ex {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut ibv_xrcd,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_conf: ibv_rx_hash_conf,
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

/// `struct ibv_data_buf`.
#[repr(C)]
pub struct ibv_data_buf {
    pub addr: *mut c_void,
    pub length: usize,
}

type Qx = *mut ibv_qp_ex;

/// `struct ibv_qp_ex`: the QP plus the new post-send API's entry points.
#[repr(C)]
pub struct ibv_qp_ex {
    pub qp_base: ibv_qp,
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: c_uint,
    pub wr_atomic_cmp_swp: Option<unsafe extern "C" fn(Qx, u32, u64, u64, u64)>,
    pub wr_atomic_fetch_add: Option<unsafe extern "C" fn(Qx, u32, u64, u64)>,
    pub wr_bind_mw: Option<unsafe extern "C" fn(Qx, *mut ibv_mw, u32, *const ibv_mw_bind_info)>,
    pub wr_local_inv: Option<unsafe extern "C" fn(Qx, u32)>,
    pub wr_rdma_read: Option<unsafe extern "C" fn(Qx, u32, u64)>,
    pub wr_rdma_write: Option<unsafe extern "C" fn(Qx, u32, u64)>,
    pub wr_rdma_write_imm: Option<unsafe extern "C" fn(Qx, u32, u64, u32)>,
    pub wr_send: Option<unsafe extern "C" fn(Qx)>,
    pub wr_send_imm: Option<unsafe extern "C" fn(Qx, u32)>,
    pub wr_send_inv: Option<unsafe extern "C" fn(Qx, u32)>,
    pub wr_send_tso: Slot,
    pub wr_set_ud_addr: Option<unsafe extern "C" fn(Qx, *mut ibv_ah, u32, u32)>,
    pub wr_set_xrc_srqn: Option<unsafe extern "C" fn(Qx, u32)>,
    pub wr_set_inline_data: Option<unsafe extern "C" fn(Qx, *mut c_void, usize)>,
    pub wr_set_inline_data_list: Option<unsafe extern "C" fn(Qx, usize, *const ibv_data_buf)>,
    pub wr_set_sge: Option<unsafe extern "C" fn(Qx, u32, u64, u32)>,
    pub wr_set_sge_list: Option<unsafe extern "C" fn(Qx, usize, *const ibv_sge)>,
    pub wr_start: Option<unsafe extern "C" fn(Qx)>,
    pub wr_complete: Option<unsafe extern "C" fn(Qx) -> c_int>,
    pub wr_abort: Option<unsafe extern "C" fn(Qx)>,
    pub wr_atomic_write: Option<unsafe extern "C" fn(Qx, u32, u64, *const c_void)>,
}

/// rdma-core 45's `wr_flush(qp, rkey, remote_addr, len, type, level)`.
pub type WrFlush = unsafe extern "C" fn(Qx, u32, u64, usize, u8, u8);

type Cx = *mut ibv_cq_ex;

/// `struct ibv_poll_cq_attr`.
#[repr(C)]
pub struct ibv_poll_cq_attr {
    pub comp_mask: u32,
}

/// `struct ibv_cq_ex`: the CQ plus the extended polling API's entry points.
#[repr(C)]
pub struct ibv_cq_ex {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
    pub comp_mask: u32,
    pub status: c_int,
    pub wr_id: u64,
    pub start_poll: Option<unsafe extern "C" fn(Cx, *mut ibv_poll_cq_attr) -> c_int>,
    pub next_poll: Option<unsafe extern "C" fn(Cx) -> c_int>,
    pub end_poll: Option<unsafe extern "C" fn(Cx)>,
    pub read_opcode: Option<unsafe extern "C" fn(Cx) -> c_int>,
    pub read_vendor_err: Option<unsafe extern "C" fn(Cx) -> u32>,
    pub read_byte_len: Option<unsafe extern "C" fn(Cx) -> u32>,
    pub read_imm_data: Option<unsafe extern "C" fn(Cx) -> u32>,
    pub read_qp_num: Option<unsafe extern "C" fn(Cx) -> u32>,
    pub read_src_qp: Option<unsafe extern "C" fn(Cx) -> u32>,
    pub read_wc_flags: Option<unsafe extern "C" fn(Cx) -> c_uint>,
    pub read_slid: Option<unsafe extern "C" fn(Cx) -> u32>,
    pub read_sl: Option<unsafe extern "C" fn(Cx) -> u8>,
    pub read_dlid_path_bits: Option<unsafe extern "C" fn(Cx) -> u8>,
    pub read_completion_ts: Option<unsafe extern "C" fn(Cx) -> u64>,
    pub read_cvlan: Slot,
    pub read_flow_tag: Slot,
    pub read_tm_info: Slot,
    pub read_completion_wallclock_ns: Option<unsafe extern "C" fn(Cx) -> u64>,
}

/// `struct ibv_cq_init_attr_ex`.
#[repr(C)]
pub struct ibv_cq_init_attr_ex {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut ibv_comp_channel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut ibv_pd,
}

/// `struct ibv_odp_caps`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_odp_caps {
    pub general_caps: u64,
    pub rc_odp_caps: u32,
    pub uc_odp_caps: u32,
    pub ud_odp_caps: u32,
}

/// `struct ibv_device_attr_ex`, up to `device_cap_flags_ex`; the rest is left zero.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr_ex {
    pub orig_attr: ibv_device_attr,
    pub comp_mask: u32,
    pub odp_caps: ibv_odp_caps,
    pub completion_timestamp_mask: u64,
    pub hca_core_clock: u64,
    pub device_cap_flags_ex: u64,
    /// `tso_caps` … `cq_mod_caps`.
    pub _rest: [u64; 11],
    pub max_dm_size: u64,
    /// `pci_atomic_caps` … `phys_port_cnt_ex`.
    pub _tail: [u64; 2],
}

/// `struct ibv_alloc_dm_attr`.
#[repr(C)]
pub struct ibv_alloc_dm_attr {
    pub length: usize,
    pub log_align_req: u32,
    pub comp_mask: u32,
}

/// `struct ibv_dm`.
#[repr(C)]
pub struct ibv_dm {
    pub context: *mut ibv_context,
    pub memcpy_to_dm: Option<unsafe extern "C" fn(*mut ibv_dm, u64, *const c_void, usize) -> c_int>,
    pub memcpy_from_dm: Option<unsafe extern "C" fn(*mut c_void, *mut ibv_dm, u64, usize) -> c_int>,
    pub comp_mask: u32,
    pub handle: u32,
}

pub type RegDmMr =
    unsafe extern "C" fn(*mut ibv_pd, *mut ibv_dm, u64, usize, c_uint) -> *mut ibv_mr;
pub type AllocDm = unsafe extern "C" fn(*mut ibv_context, *mut ibv_alloc_dm_attr) -> *mut ibv_dm;
pub type FreeDm = unsafe extern "C" fn(*mut ibv_dm) -> c_int;
pub type AllocParentDomain =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_parent_domain_init_attr) -> *mut ibv_pd;
pub type DeallocTd = unsafe extern "C" fn(*mut ibv_td) -> c_int;
pub type AllocTd = unsafe extern "C" fn(*mut ibv_context, *mut ibv_td_init_attr) -> *mut ibv_td;

/// `struct ibv_td_init_attr`.
#[repr(C)]
pub struct ibv_td_init_attr {
    pub comp_mask: u32,
}

/// `struct ibv_td`.
#[repr(C)]
pub struct ibv_td {
    pub context: *mut ibv_context,
}

/// `struct ibv_parent_domain_init_attr`.
#[repr(C)]
pub struct ibv_parent_domain_init_attr {
    pub pd: *mut ibv_pd,
    pub td: *mut ibv_td,
    pub comp_mask: u32,
    pub alloc: Slot,
    pub free: Slot,
    pub pd_context: *mut c_void,
}

/// `struct ibv_query_device_ex_input`.
#[repr(C)]
pub struct ibv_query_device_ex_input {
    pub comp_mask: u32,
}

/// `struct ibv_values_ex`.
#[repr(C)]
pub struct ibv_values_ex {
    pub comp_mask: u32,
    pub raw_clock: libc::timespec,
}

/// `struct ibv_async_event`: the element union is one pointer (or `int port_num`).
#[repr(C)]
pub struct ibv_async_event {
    pub element: *mut c_void,
    pub event_type: c_int,
}

/// `struct ibv_gid_entry`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

pub type CreateCqEx =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex;
pub type QueryDeviceEx = unsafe extern "C" fn(
    *mut ibv_context,
    *const ibv_query_device_ex_input,
    *mut ibv_device_attr_ex,
    usize,
) -> c_int;
pub type QueryRtValues = unsafe extern "C" fn(*mut ibv_context, *mut ibv_values_ex) -> c_int;
