//! Software devices, the in-process fabric that finds them by address, and their attributes.

pub(crate) mod directory;
pub mod event;
pub(crate) mod progress;

use crate::clock::Clock;
use crate::config::{DeviceConfig, ENV_DEVICES};
use crate::device::event::{AsyncEvent, AsyncQueue, EventElement};
use crate::device::progress::Progress;
use crate::error::{Error, Result};
use crate::mr::container::Layouts;
use crate::mr::keys::KeyTable;
use crate::qp::Qp;
use crate::types::{AsyncEventType, AtomicCap, Gid, LinkLayer, Mtu, PortState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

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
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_res_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub atomic_cap: AtomicCap,
    pub max_ah: u32,
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
}

/// `IBV_DEVICE_*` capability bits softverbs sets.
pub mod cap_flags {
    pub const CURR_QP_STATE_MOD: u32 = 1 << 7;
    pub const PORT_ACTIVE_EVENT: u32 = 1 << 10;
    pub const SYS_IMAGE_GUID: u32 = 1 << 11;
    pub const RC_RNR_NAK_GEN: u32 = 1 << 12;
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

/// Kinds of objects a device counts against its limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resource {
    Pd,
    Cq,
    Qp,
    Srq,
    Ah,
    Mr,
}

/// A slot counted against a device limit; released on drop.
pub(crate) struct Counted {
    dev: Arc<Device>,
    kind: Resource,
}

impl Counted {
    /// True if the counted object belongs to `dev`.
    pub(crate) fn on(&self, dev: &Arc<Device>) -> bool {
        Arc::ptr_eq(&self.dev, dev)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.dev.count(self.kind).fetch_sub(1, Ordering::AcqRel);
    }
}

/// A software RDMA device (one port).
pub struct Device {
    pub(crate) config: DeviceConfig,
    pub(crate) keys: KeyTable,
    pub(crate) clock: Clock,
    pub(crate) progress: Progress,
    qps: RwLock<HashMap<u32, Weak<Qp>>>,
    qp_index: Mutex<QpNumbers>,
    /// Per QP-number index: send-queue slots freed by polled completions.
    pub(crate) sq_retired: Arc<[AtomicU32]>,
    counts: [AtomicU32; 6],
    next_id: AtomicU32,
    port_state: AtomicU32,
    contexts: Mutex<Vec<Weak<AsyncQueue>>>,
    /// QPs of other processes this process has mapped.
    pub(crate) peers: crate::transport::same_host::Peers,
    /// Called for each scrambled piece this device places (the ordering check).
    ordering_observer: Mutex<Option<crate::mr::ordering::OrderingObserver>>,
    /// Layout containers of this process by key, and the keys their layouts use.
    pub(crate) layouts: Layouts,
}

struct QpNumbers {
    free: Vec<u32>,
    generation: Vec<u32>,
    bits: u32,
}

static FABRIC: OnceLock<Mutex<Vec<Arc<Device>>>> = OnceLock::new();

fn fabric() -> Result<&'static Mutex<Vec<Arc<Device>>>> {
    if let Some(f) = FABRIC.get() {
        return Ok(f);
    }
    let text = std::env::var(ENV_DEVICES).unwrap_or_default();
    let configs = DeviceConfig::parse_list(&text).map_err(|e| match e {
        Error::Config(m) => Error::Config(format!("{ENV_DEVICES}: {m}")),
        other => other,
    })?;
    let mut devices = Vec::new();
    for c in configs {
        devices.push(Device::new(c)?);
    }
    Ok(FABRIC.get_or_init(|| Mutex::new(devices)))
}

impl Device {
    fn new(config: DeviceConfig) -> Result<Arc<Device>> {
        config.validate()?;
        // QP numbers are `generation << bits | index`; indices 0 and 1 are QP0/QP1.
        let bits = (config.limits.max_qp + 2)
            .next_power_of_two()
            .trailing_zeros();
        let slots = 1usize << bits;
        Ok(Arc::new(Device {
            keys: KeyTable::new(config.limits.max_mr)?.with_ordering_check(config.ordering_check),
            clock: Clock::new(config.timestamp_bits),
            progress: Progress::default(),
            qps: RwLock::new(HashMap::new()),
            qp_index: Mutex::new(QpNumbers {
                free: (2..slots as u32).rev().collect(),
                generation: vec![0; slots],
                bits,
            }),
            sq_retired: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            counts: Default::default(),
            next_id: AtomicU32::new(1),
            port_state: AtomicU32::new(PortState::Active as u32),
            contexts: Mutex::new(Vec::new()),
            peers: Default::default(),
            ordering_observer: Mutex::new(None),
            layouts: Layouts::default(),
            config,
        }))
    }

    /// All software devices of this process: those from `SOFTVERBS_DEVICES` (or the default
    /// `softverbs0`), then those added with [`Device::add`].
    pub fn list() -> Result<Vec<Arc<Device>>> {
        Ok(fabric()?.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Adds a device to this process's fabric.
    pub fn add(config: DeviceConfig) -> Result<Arc<Device>> {
        let fab = fabric()?;
        let mut list = fab.lock().unwrap_or_else(|e| e.into_inner());
        if list.iter().any(|d| d.config.name == config.name) {
            return Err(Error::InvalidArgument(format!(
                "a device named {} exists",
                config.name
            )));
        }
        if list.iter().any(|d| d.config.gid == config.gid) {
            return Err(Error::InvalidArgument(format!(
                "GID {} is taken by another device",
                config.gid
            )));
        }
        if config.lid != 0 && list.iter().any(|d| d.config.lid == config.lid) {
            return Err(Error::InvalidArgument(format!(
                "LID {} is taken by another device",
                config.lid
            )));
        }
        let dev = Device::new(config)?;
        list.push(dev.clone());
        Ok(dev)
    }

    /// The device that owns `gid` on this host's fabric.
    pub fn find_by_gid(gid: Gid) -> Option<Arc<Device>> {
        let list = fabric().ok()?.lock().unwrap_or_else(|e| e.into_inner());
        list.iter().find(|d| d.config.gid == gid).cloned()
    }

    /// The device whose port has `lid`.
    pub fn find_by_lid(lid: u16) -> Option<Arc<Device>> {
        let list = fabric().ok()?.lock().unwrap_or_else(|e| e.into_inner());
        list.iter()
            .find(|d| d.config.lid == lid && d.config.link_layer == LinkLayer::InfiniBand)
            .cloned()
    }

    /// The configuration this device was made from.
    pub fn config(&self) -> &DeviceConfig {
        &self.config
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The device clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The non-contiguous layout capabilities (`mr_layout_caps`).
    pub fn layout_caps(&self) -> crate::mr::layout::LayoutCaps {
        crate::mr::layout::LayoutCaps::DEFAULT
    }

    /// `ibv_query_device` (and the extended fields).
    pub fn attr(&self) -> DeviceAttr {
        let l = &self.config.limits;
        DeviceAttr {
            fw_ver: concat!("softverbs ", env!("CARGO_PKG_VERSION")).into(),
            node_guid: self.config.node_guid,
            sys_image_guid: self.config.node_guid,
            max_mr_size: l.max_mr_size,
            page_size_cap: crate::device_memory::segment::page_size() as u64,
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 1,
            max_qp: l.max_qp,
            max_qp_wr: l.max_qp_wr,
            device_cap_flags: cap_flags::CURR_QP_STATE_MOD
                | cap_flags::PORT_ACTIVE_EVENT
                | cap_flags::SYS_IMAGE_GUID
                | cap_flags::RC_RNR_NAK_GEN,
            max_sge: l.max_sge,
            max_sge_rd: l.max_sge,
            max_cq: l.max_cq,
            max_cqe: l.max_cqe,
            max_mr: l.max_mr,
            max_pd: l.max_pd,
            max_qp_rd_atom: l.max_qp_rd_atom,
            max_res_rd_atom: l.max_qp_rd_atom.saturating_mul(l.max_qp),
            max_qp_init_rd_atom: l.max_qp_rd_atom,
            atomic_cap: AtomicCap::Hca,
            max_ah: l.max_ah,
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
            gid_tbl_len: 1,
            // IsSMDisabled-style bits do not apply; report none.
            port_cap_flags: 0,
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
        if index != 0 {
            return Err(Error::InvalidArgument(format!(
                "GID index {index} (the table has 1 entry)"
            )));
        }
        Ok(self.config.gid)
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

    /// True while the port is ACTIVE.
    pub fn port_active(&self) -> bool {
        self.port_state.load(Ordering::Acquire) == PortState::Active as u32
    }

    /// Sets (or with `None` clears) the observer of the ordering check: it is called after
    /// each scrambled piece this device places (into relaxed MRs of devices with
    /// `ordering_check` on), before the next piece, on the placing thread. Meant for tests
    /// that look at a relaxed MR's torn state deterministically; a slow observer slows the
    /// data path.
    pub fn set_ordering_observer(&self, observer: Option<crate::mr::ordering::OrderingObserver>) {
        *self
            .ordering_observer
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = observer;
    }

    /// The observer of scrambled placement, if one is set.
    pub(crate) fn ordering_observer(&self) -> Option<crate::mr::ordering::OrderingObserver> {
        self.ordering_observer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Takes the port down or brings it up, telling every open context (`PORT_ERR` /
    /// `PORT_ACTIVE`). While down, nothing is delivered to or from this device.
    pub fn set_port_state(&self, up: bool) {
        let new = if up {
            PortState::Active
        } else {
            PortState::Down
        };
        if self.port_state.swap(new as u32, Ordering::AcqRel) == new as u32 {
            return;
        }
        let kind = if up {
            AsyncEventType::PortActive
        } else {
            AsyncEventType::PortErr
        };
        let mut contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        contexts.retain(|c| c.strong_count() > 0);
        for c in contexts.iter().filter_map(Weak::upgrade) {
            c.push(AsyncEvent {
                kind,
                element: EventElement::Port(PORT_NUM),
            });
        }
    }

    /// Registers a context's async event queue for device-wide events.
    pub(crate) fn attach_context(&self, q: &Arc<AsyncQueue>) {
        let mut contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        contexts.retain(|c| c.strong_count() > 0);
        contexts.push(Arc::downgrade(q));
    }

    fn count(&self, kind: Resource) -> &AtomicU32 {
        &self.counts[kind as usize]
    }

    /// Counts one more object of `kind`, failing with ENOMEM at the device limit.
    pub(crate) fn acquire(self: &Arc<Self>, kind: Resource) -> Result<Counted> {
        let l = &self.config.limits;
        let limit = match kind {
            Resource::Pd => l.max_pd,
            Resource::Cq => l.max_cq,
            Resource::Qp => l.max_qp,
            Resource::Srq => l.max_srq,
            Resource::Ah => l.max_ah,
            Resource::Mr => l.max_mr,
        };
        self.count(kind)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| {
                Error::NoResources(format!("device limit of {limit} {kind:?}s reached"))
            })?;
        Ok(Counted {
            dev: self.clone(),
            kind,
        })
    }

    /// A fresh device-wide id for PDs, CQs and SRQs.
    pub(crate) fn next_id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn alloc_qpn(&self) -> Result<u32> {
        let mut n = self.qp_index.lock().unwrap_or_else(|e| e.into_inner());
        let index = n
            .free
            .pop()
            .ok_or_else(|| Error::NoResources("no free QP numbers".into()))?;
        let bits = n.bits;
        let g = &mut n.generation[index as usize];
        *g = (*g + 1) & ((1 << (24 - bits)) - 1);
        self.sq_retired[index as usize].store(0, Ordering::Release);
        Ok(*g << bits | index)
    }

    pub(crate) fn qpn_index(&self, qpn: u32) -> usize {
        let bits = (self.config.limits.max_qp + 2)
            .next_power_of_two()
            .trailing_zeros();
        (qpn & ((1 << bits) - 1)) as usize
    }

    /// Frees the send-queue slots of `qpn` up to and including the WQE numbered `seq`.
    pub(crate) fn retire_sq(&self, qpn: u32, seq: u32) {
        let slot = &self.sq_retired[self.qpn_index(qpn)];
        let next = seq.wrapping_add(1);
        let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
            // Wrapping comparison: only move forward.
            ((next.wrapping_sub(cur) as i32) > 0).then_some(next)
        });
    }

    pub(crate) fn register_qp(&self, qp: &Arc<Qp>) {
        self.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qp.qpn, Arc::downgrade(qp));
    }

    pub(crate) fn unregister_qp(&self, qpn: u32) {
        self.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qpn);
        let index = self.qpn_index(qpn) as u32;
        self.qp_index
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free
            .insert(0, index);
    }

    /// The live QP with number `qpn` on this device.
    pub(crate) fn find_qp(&self, qpn: u32) -> Option<Arc<Qp>> {
        self.qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)
            .and_then(Weak::upgrade)
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.config.name)
            .finish()
    }
}
