//! Software devices and the in-process fabric that finds them by address.
//!
//! A device owns what every object opened on it shares: its configuration and limits
//! (`resource`), its key table and layout containers, its clock, its QP numbers and table of
//! live QPs (`qpn`, with the host-wide `directory`), the host's multicast groups
//! ([`multicast`]), its port and the contexts told about
//! it ([`Context`], [`event`]), and the timer thread for deferred work (`progress`). What
//! the query verbs report is in `attr`; how a context's PDs are shared with other processes
//! (its command descriptor, the importer's view) is `shared`.

mod attr;
mod context;
pub(crate) mod directory;
pub mod event;
pub mod multicast;
pub(crate) mod progress;
mod qpn;
pub(crate) use qpn::retire_sq;
mod resource;
pub(crate) mod shared;

pub use attr::{
    DEFAULT_PKEY, DeviceAttr, MAX_DM_SIZE, MAX_MSG_SIZE, OdpCaps, PORT_NUM, PortAttr, cap_flags,
    cap_flags_ex,
};
pub use context::Context;
pub(crate) use qpn::QpHandle;
use qpn::QpNumbers;
pub use resource::InUse;
pub(crate) use resource::{Counted, Resource, Users};

use crate::clock::Clock;
use crate::config::{DeviceConfig, ENV_DEVICES};
use crate::device::event::{AsyncEvent, AsyncQueue, EventElement};
use crate::device::progress::Progress;
use crate::error::{Error, Result, inval};
use crate::mr::container::Layouts;
use crate::mr::keys::KeyTable;
use crate::types::{AhAttr, AsyncEventType, Gid, LinkLayer, PortState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

/// A software RDMA device (one port).
pub struct Device {
    pub(crate) config: DeviceConfig,
    pub(crate) keys: KeyTable,
    pub(crate) clock: Clock,
    pub(crate) progress: Progress,
    /// The live QPs of this device by number, where transports find responders. The device
    /// sits below the QP layer, so it keeps them type-erased ([`Device::find_qp`]).
    qps: RwLock<HashMap<u32, Weak<dyn QpHandle>>>,
    qp_index: Mutex<QpNumbers>,
    /// Per QP-number index: send-queue slots freed by polled completions.
    pub(crate) sq_retired: Arc<[AtomicU32]>,
    counts: [AtomicU32; 7],
    next_id: AtomicU32,
    port_state: AtomicU32,
    contexts: Mutex<Vec<Weak<AsyncQueue>>>,
    /// Called for each scrambled piece this device places (the ordering check).
    ordering_observer: Mutex<Option<crate::mr::ordering::OrderingObserver>>,
    /// Layout containers of this process by key, and the keys their layouts use.
    pub(crate) layouts: Layouts,
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
        let numbers = QpNumbers::new();
        Ok(Arc::new(Device {
            keys: {
                let k =
                    KeyTable::new(config.limits.max_mr)?.with_ordering_check(config.ordering_check);
                // Keys of a networked device travel where attackers can send packets.
                if config.net.is_some() {
                    k.with_secret_keys()
                } else {
                    k
                }
            },
            clock: Clock::new(config.timestamp_bits),
            progress: Progress::default(),
            qps: RwLock::new(HashMap::new()),
            qp_index: Mutex::new(numbers),
            sq_retired: (0..qpn::SLOTS).map(|_| AtomicU32::new(0)).collect(),
            counts: Default::default(),
            next_id: AtomicU32::new(1),
            port_state: AtomicU32::new(PortState::Active as u32),
            contexts: Mutex::new(Vec::new()),
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

    /// Validates an address vector for this device's link layer.
    pub(crate) fn check_av(&self, attr: &AhAttr) -> Result<()> {
        if attr.port_num != 0 && attr.port_num != PORT_NUM {
            return Err(inval(format!(
                "port {} (the device has port 1)",
                attr.port_num
            )));
        }
        match (self.config.link_layer, &attr.grh) {
            (LinkLayer::Ethernet, None) => Err(inval(
                "RoCE address vectors need a GRH (is_global with a destination GID)",
            )),
            (_, Some(g)) if u32::from(g.sgid_index) >= self.config.gid_count() => {
                Err(inval(format!(
                    "sgid_index {} (the GID table has {} entries)",
                    g.sgid_index,
                    self.config.gid_count()
                )))
            }
            (LinkLayer::InfiniBand, None) if attr.dlid == 0 => {
                Err(inval("destination LID 0 without a GRH"))
            }
            _ => Ok(()),
        }
    }

    /// The device an address vector of this device points at, if it is on this host.
    pub(crate) fn resolve(&self, attr: &AhAttr) -> Weak<Device> {
        let found = match (self.config.link_layer, &attr.grh) {
            (_, Some(g)) => Device::find_by_gid(g.dgid),
            (LinkLayer::InfiniBand, None) => Device::find_by_lid(attr.dlid),
            (LinkLayer::Ethernet, None) => None,
        };
        found.as_ref().map(Arc::downgrade).unwrap_or_default()
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
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.config.name)
            .finish()
    }
}
