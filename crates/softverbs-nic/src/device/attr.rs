//! What `ibv_query_device`, `ibv_query_port`, `ibv_query_gid` and `ibv_query_pkey` report.

use super::{Device, multicast};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::types::{AtomicCap, Gid, LinkLayer, Mtu, PortState};
use std::sync::atomic::Ordering;

/// `struct ibv_device_attr` plus the extended fields softverbs reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub device_cap_flags: u32,
    pub max_sge: u32,
    pub max_sge_rd: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    /// Memory windows share the key table with regions: `max_mr` entries in all.
    pub max_mw: u32,
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_res_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub atomic_cap: AtomicCap,
    pub max_ah: u32,
    /// UD multicast: groups (on one host: of the host; on a networked device the host
    /// engine's), QPs per group, attachments in all.
    pub max_mcast_grp: u32,
    pub max_mcast_qp_attach: u32,
    pub max_total_mcast_qp_attach: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_srq_sge: u32,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
    /// Largest inline payload a QP may request.
    pub max_inline_data: u32,
    /// `completion_timestamp_mask` of `ibv_query_device_ex`.
    pub completion_timestamp_mask: u64,
    /// `hca_core_clock` of `ibv_query_device_ex`, in kHz.
    pub hca_core_clock: u64,
    /// `mr_layout_caps` of `ibv_query_device_ex` (seed 002): what non-contiguous layouts
    /// the device supports.
    pub mr_layout_caps: crate::mr::layout::LayoutCaps,
    /// `odp_caps` of `ibv_query_device_ex`.
    pub odp_caps: OdpCaps,
    /// `max_dm_size` of `ibv_query_device_ex`: device memory a process may hold.
    pub max_dm_size: u64,
    /// The extended capability bits of `ibv_query_device_ex` above the 32 of
    /// `device_cap_flags` ([`cap_flags_ex`]).
    pub device_cap_flags_ex: u64,
}

/// `device_cap_flags_ex` bits above 31 (the kernel's `ib_uverbs_device_cap_flags`).
pub mod cap_flags_ex {
    /// RDMA FLUSH with global placement (`IB_UVERBS_DEVICE_FLUSH_GLOBAL`).
    pub const FLUSH_GLOBAL: u64 = 1 << 38;
    /// RDMA ATOMIC WRITE (`IB_UVERBS_DEVICE_ATOMIC_WRITE`).
    pub const ATOMIC_WRITE: u64 = 1 << 40;
}

/// On-demand paging support (`struct ibv_odp_caps`): every device has it, explicit and
/// implicit, for every operation its transports carry but atomics. A software NIC touches
/// memory only when it moves bytes, so a page that is not mapped yet is faulted in then, and
/// one that is gone is an error completion. An on-demand region is plain process memory that
/// other processes reach by cross-memory attach, which cannot be atomic (an atomic into it
/// from the owner's own process works, but is not promised).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OdpCaps {
    /// `IBV_ODP_SUPPORT` | `IBV_ODP_SUPPORT_IMPLICIT`.
    pub general_caps: u64,
    /// `IBV_ODP_SUPPORT_*` per transport: SEND 1, RECV 2, WRITE 4, READ 8, ATOMIC 16,
    /// SRQ_RECV 32.
    pub rc_odp_caps: u32,
    pub uc_odp_caps: u32,
    pub ud_odp_caps: u32,
}

impl OdpCaps {
    pub const SUPPORTED: OdpCaps = OdpCaps {
        general_caps: 1 | 2,
        rc_odp_caps: 1 | 2 | 4 | 8 | 32,
        uc_odp_caps: 1 | 2 | 4 | 32,
        ud_odp_caps: 1 | 2 | 32,
    };
}

/// `max_dm_size`: the device memory a process may hold at once (ConnectX-5's on-chip memory
/// is of this order; a software device could offer more, but programs size to it).
pub const MAX_DM_SIZE: usize = 256 * 1024;

/// `vendor_id`: a software device has no IEEE OUI; soft-RoCE reports the same value.
pub const VENDOR_ID: u32 = 0xff_ffff;
/// `vendor_part_id`: "SV", so programs that tell devices apart by id see a non-zero one.
pub const VENDOR_PART_ID: u32 = 0x5356;

/// `ibv_port_attr::port_cap_flags` bits.
pub mod port_cap_flags {
    /// The connection manager is supported (librdmacm runs over the port).
    pub const CM_SUP: u32 = 1 << 16;
    /// The GIDs are IP addresses (every RoCE port; the kernel's `ip_gids`).
    pub const IP_BASED_GIDS: u32 = 1 << 26;
}

/// `IBV_DEVICE_*` capability bits softverbs sets.
pub mod cap_flags {
    pub const CURR_QP_STATE_MOD: u32 = 1 << 7;
    pub const PORT_ACTIVE_EVENT: u32 = 1 << 10;
    pub const SYS_IMAGE_GUID: u32 = 1 << 11;
    pub const RC_RNR_NAK_GEN: u32 = 1 << 12;
    /// Memory windows (type 1).
    pub const MEM_WINDOW: u32 = 1 << 17;
    /// Type-2B memory windows (bound to the QP that binds them).
    pub const MEM_WINDOW_TYPE_2B: u32 = 1 << 24;
    /// XRC domains, SRQs and QPs (`IBV_DEVICE_XRC`).
    pub const XRC: u32 = 1 << 20;
}

/// `struct ibv_port_attr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    pub state: PortState,
    pub max_mtu: Mtu,
    pub active_mtu: Mtu,
    pub gid_tbl_len: i32,
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
    pub link_layer: LinkLayer,
}

/// Largest message a port carries (`max_msg_sz`).
pub const MAX_MSG_SIZE: u32 = 1 << 31;
/// The only port of a software device.
pub const PORT_NUM: u8 = 1;
/// The one P_Key in the table: the default full-membership key.
pub const DEFAULT_PKEY: u16 = 0xffff;

impl Device {
    /// `ibv_query_device` (and the extended fields).
    pub fn attr(&self) -> DeviceAttr {
        let l = &self.config.limits;
        DeviceAttr {
            fw_ver: concat!("softverbs ", env!("CARGO_PKG_VERSION")).into(),
            node_guid: self.config.node_guid,
            sys_image_guid: self.config.node_guid,
            max_mr_size: l.max_mr_size,
            page_size_cap: crate::device_memory::segment::page_size() as u64,
            vendor_id: VENDOR_ID,
            vendor_part_id: VENDOR_PART_ID,
            hw_ver: 1,
            max_qp: l.max_qp,
            max_qp_wr: l.max_qp_wr,
            device_cap_flags: cap_flags::CURR_QP_STATE_MOD
                | cap_flags::PORT_ACTIVE_EVENT
                | cap_flags::SYS_IMAGE_GUID
                | cap_flags::RC_RNR_NAK_GEN
                | cap_flags::MEM_WINDOW
                | cap_flags::MEM_WINDOW_TYPE_2B
                | cap_flags::XRC,
            max_sge: l.max_sge,
            max_sge_rd: l.max_sge,
            max_cq: l.max_cq,
            max_cqe: l.max_cqe,
            max_mr: l.max_mr,
            max_mw: l.max_mr,
            max_pd: l.max_pd,
            max_qp_rd_atom: l.max_qp_rd_atom,
            max_res_rd_atom: l.max_qp_rd_atom.saturating_mul(l.max_qp),
            max_qp_init_rd_atom: l.max_qp_rd_atom,
            atomic_cap: AtomicCap::Hca,
            max_ah: l.max_ah,
            max_mcast_grp: multicast::MAX_GROUPS,
            max_mcast_qp_attach: multicast::MAX_QPS_PER_GROUP,
            max_total_mcast_qp_attach: multicast::MAX_GROUPS * multicast::MAX_QPS_PER_GROUP,
            max_srq: l.max_srq,
            max_srq_wr: l.max_srq_wr,
            max_srq_sge: l.max_srq_sge,
            max_pkeys: 1,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            max_inline_data: l.max_inline_data,
            completion_timestamp_mask: self.clock.mask(),
            hca_core_clock: Clock::KHZ,
            mr_layout_caps: self.layout_caps(),
            odp_caps: OdpCaps::SUPPORTED,
            max_dm_size: MAX_DM_SIZE as u64,
            device_cap_flags_ex: cap_flags_ex::ATOMIC_WRITE | cap_flags_ex::FLUSH_GLOBAL,
        }
    }

    /// `ibv_query_port`.
    pub fn port_attr(&self, port: u8) -> Result<PortAttr> {
        self.check_port(port)?;
        let eth = self.config.link_layer == LinkLayer::Ethernet;
        let state =
            PortState::from_raw(self.port_state.load(Ordering::Acquire)).unwrap_or(PortState::Down);
        Ok(PortAttr {
            state,
            max_mtu: Mtu::Mtu4096,
            active_mtu: self.config.active_mtu,
            gid_tbl_len: self.config.gid_count() as i32,
            // Of the IB port capabilities only the CM's applies (librdmacm works over every
            // softverbs port), plus IP-based GIDs on RoCE, as the kernel reports them.
            port_cap_flags: port_cap_flags::CM_SUP
                | if eth {
                    port_cap_flags::IP_BASED_GIDS
                } else {
                    0
                },
            max_msg_sz: MAX_MSG_SIZE,
            bad_pkey_cntr: 0,
            qkey_viol_cntr: 0,
            pkey_tbl_len: 1,
            lid: if eth { 0 } else { self.config.lid },
            sm_lid: if eth { 0 } else { self.config.lid },
            lmc: 0,
            max_vl_num: 1,
            sm_sl: 0,
            subnet_timeout: 18,
            init_type_reply: 0,
            active_width: 2,                                            // 4X
            active_speed: 32,                                           // 25 Gb/s lane (EDR)
            phys_state: if state == PortState::Active { 5 } else { 3 }, // LinkUp / Disabled
            link_layer: self.config.link_layer,
        })
    }

    /// `ibv_query_gid`.
    pub fn gid(&self, port: u8, index: u32) -> Result<Gid> {
        self.check_port(port)?;
        self.config.gid_at(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "GID index {index} (the table has {} entries)",
                self.config.gid_count()
            ))
        })
    }

    /// `ibv_query_pkey`.
    pub fn pkey(&self, port: u8, index: u16) -> Result<u16> {
        self.check_port(port)?;
        if index != 0 {
            return Err(Error::InvalidArgument(format!(
                "P_Key index {index} (the table has 1 entry)"
            )));
        }
        Ok(DEFAULT_PKEY)
    }

    pub(crate) fn check_port(&self, port: u8) -> Result<()> {
        if port != PORT_NUM {
            return Err(Error::InvalidArgument(format!(
                "port {port} (the device has port 1 only)"
            )));
        }
        Ok(())
    }
}
