//! Devices, the builder for software devices, and open contexts.

use crate::cq::{CompletionChannel, CompletionQueue};
use crate::mr::ProtectionDomain;
use crate::{AsyncEvent, DeviceAttr, DeviceConfig, Gid, Limits, LinkLayer, Mtu, PortAttr, Result};
use rustix::fd::BorrowedFd;
use softverbs_nic::device::Context as NicContext;
use softverbs_nic::device::Device as NicDevice;
use std::sync::Arc;

/// The RDMA devices of this process (`ibv_get_device_list`).
///
/// Without configuration there is one software device, `softverbs0` (RoCE link layer, GID
/// `::ffff:127.0.0.1`). The `SOFTVERBS_DEVICES` environment variable replaces that default
/// (see [`DeviceConfig`] for its syntax), and [`Device::builder`] adds more at run time.
pub fn devices() -> Result<Vec<Device>> {
    Ok(NicDevice::list()?
        .into_iter()
        .map(|inner| Device { inner })
        .collect())
}

/// An RDMA device.
#[derive(Clone, Debug)]
pub struct Device {
    inner: Arc<NicDevice>,
}

impl Device {
    /// For a networked device (RoCEv2 between hosts): the report of the host engine that
    /// serves it, as `softverbs nic` prints it (its state, counters, clients and QPs). Fails
    /// with [`Error::NotFound`](crate::Error) when no engine runs (no program has the device
    /// open), and for devices that are not networked.
    pub fn engine_report(&self) -> Result<String> {
        softverbs_nic::engine::engine_report(&self.inner)
    }

    /// For a networked device: makes its host engine write every packet it sends and
    /// receives to the pcap file `path` (an empty path stops the capture). Returns what the
    /// engine said.
    pub fn engine_capture(&self, path: &str) -> Result<String> {
        softverbs_nic::engine::engine_capture(&self.inner, path)
    }

    /// For a networked device: starts its host engine if none runs and keeps it running
    /// while the returned value lives (an engine stops soon after its last QP is gone), so
    /// that the host carries CM MADs on QP1 for a listener that has no QP yet.
    pub fn hold_engine(&self) -> Result<softverbs_nic::engine::EngineHold> {
        softverbs_nic::engine::hold_engine(&self.inner)
    }

    /// True for a networked device: RoCEv2 between hosts through the host engine.
    pub fn is_networked(&self) -> bool {
        self.inner.config().net.is_some()
    }

    /// The device name (`ibv_get_device_name`).
    pub fn name(&self) -> &str {
        self.inner.name()
    }

    /// The node GUID (`ibv_get_device_guid`).
    pub fn guid(&self) -> u64 {
        self.inner.config().node_guid
    }

    /// Opens the device (`ibv_open_device`).
    pub fn open(&self) -> Result<Context> {
        Ok(Context {
            inner: NicContext::open(self.inner.clone())?,
        })
    }

    /// Starts describing a new software device.
    pub fn builder() -> DeviceBuilder {
        DeviceBuilder {
            config: DeviceConfig {
                name: String::new(),
                ..DeviceConfig::default()
            },
        }
    }

    /// Sets (or with `None` clears) the ordering-check observer: called after each piece
    /// this device places in scrambled order into a relaxed-ordering region (of a device
    /// built with [`DeviceBuilder::ordering_check`]), on the placing thread, before the next
    /// piece. Tests use it to look at (or let another thread look at) the torn state a
    /// last-byte poller would see; see [`crate::nic::mr::ordering`].
    pub fn set_ordering_observer(&self, observer: Option<crate::OrderingObserver>) {
        self.inner.set_ordering_observer(observer);
    }

    /// Takes the port down (`false`) or up (`true`); every open context receives
    /// `PORT_ERR` or `PORT_ACTIVE`. While the port is down nothing is delivered.
    pub fn set_port_state(&self, up: bool) {
        self.inner.set_port_state(up);
    }
}

/// Builds a software device with chosen name, addressing and limits, and adds it to the
/// process's fabric, where other devices can reach it by GID or LID.
///
/// ```
/// use softverbs::{Device, LinkLayer, Mtu};
/// let dev = Device::builder()
///     .name("doc-ib0")
///     .link_layer(LinkLayer::InfiniBand)
///     .lid(0x42)
///     .mtu(Mtu::Mtu2048)
///     .gid("fe80::42".parse().unwrap())
///     .build()?;
/// let port = dev.open()?.query_port(1)?;
/// assert_eq!((port.lid, port.active_mtu), (0x42, Mtu::Mtu2048));
/// # Ok::<(), softverbs::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct DeviceBuilder {
    config: DeviceConfig,
}

impl DeviceBuilder {
    /// The device name (required; unique in the process).
    pub fn name(mut self, name: &str) -> Self {
        self.config.name = name.into();
        self
    }
    /// Ethernet (RoCE) or InfiniBand addressing.
    pub fn link_layer(mut self, l: LinkLayer) -> Self {
        self.config.link_layer = l;
        self
    }
    /// The port's active MTU.
    pub fn mtu(mut self, m: Mtu) -> Self {
        self.config.active_mtu = m;
        self
    }
    /// GID table entry 0.
    pub fn gid(mut self, g: Gid) -> Self {
        self.config.gid = g;
        self
    }
    /// The port LID (InfiniBand).
    pub fn lid(mut self, lid: u16) -> Self {
        self.config.lid = lid;
        self
    }
    /// Node GUID.
    pub fn guid(mut self, guid: u64) -> Self {
        self.config.node_guid = guid;
        self
    }
    /// Width of the completion timestamp clock in bits.
    pub fn timestamp_bits(mut self, bits: u32) -> Self {
        self.config.timestamp_bits = bits;
        self
    }
    /// The ordering check (`ordering_check=1` in `SOFTVERBS_DEVICES`): writes into this
    /// device's relaxed-ordering regions are placed in pieces in a scrambled order, final
    /// piece first, so a program that polls the last byte instead of waiting for the
    /// completion sees torn data. Strict regions are never scrambled.
    pub fn ordering_check(mut self, on: bool) -> Self {
        self.config.ordering_check = on;
        self
    }
    /// Resource limits.
    pub fn limits(mut self, l: Limits) -> Self {
        self.config.limits = l;
        self
    }
    /// Sets a key in the `SOFTVERBS_DEVICES` syntax (`"max_qp"`, `"mtu"`, …).
    pub fn set(mut self, key: &str, value: &str) -> Result<Self> {
        self.config.set(key, value)?;
        Ok(self)
    }
    /// Creates the device.
    pub fn build(self) -> Result<Device> {
        if self.config.name.is_empty() {
            return Err(crate::Error::Config("a device needs a name".into()));
        }
        Ok(Device {
            inner: NicDevice::add(self.config)?,
        })
    }
}

/// An open device (`struct ibv_context`).
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<NicContext>,
}

impl Context {
    /// The device this context is open on.
    pub fn device(&self) -> Device {
        Device {
            inner: self.inner.device().clone(),
        }
    }

    /// `ibv_query_device` (with the extended fields of `ibv_query_device_ex`).
    pub fn query_device(&self) -> DeviceAttr {
        self.inner.device().attr()
    }

    /// `ibv_query_rt_values_ex`: the raw device-clock value now, truncated to
    /// `completion_timestamp_mask`. It is the same clock every completion is stamped with
    /// ([`WorkCompletion::timestamp`](crate::WorkCompletion::timestamp)), so a value read
    /// between two completions lies between their timestamps; use [`Context::clock`] to
    /// subtract values and convert them to nanoseconds.
    pub fn query_rt_values(&self) -> u64 {
        self.inner.device().clock().now_raw()
    }

    /// The device clock's width and frequency, for turning raw timestamps into time.
    pub fn clock(&self) -> DeviceClock {
        DeviceClock::from_attr(&self.query_device())
    }

    /// `ibv_query_port`.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.inner.device().port_attr(port)
    }

    /// `ibv_query_gid`.
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        self.inner.device().gid(port, index)
    }

    /// `ibv_query_pkey`.
    pub fn query_pkey(&self, port: u8, index: u16) -> Result<u16> {
        self.inner.device().pkey(port, index)
    }

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain {
            inner: self.inner.alloc_pd()?,
            parent: None,
        })
    }

    /// `ibv_alloc_dm`: `len` bytes of device memory (at most
    /// [`nic::pd::MAX_DM_SIZE`](crate::nic::pd::MAX_DM_SIZE) held by a process at once; past
    /// that `NoResources`). Page-aligned.
    pub fn alloc_dm(&self, len: usize) -> Result<crate::DeviceMemory> {
        Ok(crate::DeviceMemory {
            inner: self.inner.alloc_dm(len, 0)?,
        })
    }

    /// `ibv_create_comp_channel`.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new()
    }

    /// `ibv_create_cq`: a CQ with room for at least `cqe` completions, optionally reporting
    /// to `channel`.
    pub fn create_cq(
        &self,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        let cq = self
            .inner
            .create_cq(cqe, channel.map(|c| c.inner.clone()))?;
        Ok(CompletionQueue { inner: cq })
    }

    /// `ibv_get_async_event`: waits for the next asynchronous event.
    pub fn get_async_event(&self) -> Result<AsyncEvent> {
        self.inner.events().pop(true)
    }

    /// The next asynchronous event, or `Error::WouldBlock`.
    pub fn try_get_async_event(&self) -> Result<AsyncEvent> {
        self.inner.events().pop(false)
    }

    /// The async event file descriptor: readable while an event waits (`context->async_fd`).
    pub fn async_fd(&self) -> BorrowedFd<'_> {
        self.inner.events().fd()
    }
}

/// The facts needed to turn raw device-clock values (completion timestamps and
/// [`Context::query_rt_values`]) into time: the clock's `completion_timestamp_mask` and its
/// frequency `hca_core_clock` in kHz, both from `ibv_query_device_ex`.
///
/// Raw values wrap around at the mask, so subtract them with [`delta`](Self::delta), which
/// is right as long as the two values are less than one wrap apart.
///
/// ```
/// use softverbs::*;
///
/// let ctx = softverbs::devices()?[0].open()?;
/// let clock = ctx.clock();
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq_ex(&CqInitAttrEx::new(4).wc_flags(WcExFlags::COMPLETION_TIMESTAMP))?;
/// let mr = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
/// let qp = pd.create_qp(&QpInitAttr::rc(&cq, &cq))?;
/// qp.connect(&qp.endpoint(0)?, 0, AccessFlags::empty())?;
///
/// let before = ctx.query_rt_values();
/// qp.post_recv([RecvWr::new(1, &[mr.sge(0..8)])])?;
/// qp.post_send([SendWr::new(2, SendOp::Send, &[mr.sge(0..8)]).flags(SendFlags::SIGNALED)])?;
/// let (a, b) = (cq.wait_one()?, cq.wait_one()?);
/// // Both completions happened after `before`, in the order the CQ returned them.
/// assert!(clock.delta(before, a.timestamp()) <= clock.delta(before, b.timestamp()));
/// let ns = clock.ticks_to_ns(clock.delta(before, b.timestamp()));
/// assert!(ns < 10_000_000_000);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceClock {
    /// `completion_timestamp_mask`: the raw clock counts from 0 to this value, then wraps.
    pub mask: u64,
    /// `hca_core_clock`: ticks per millisecond.
    pub khz: u64,
}

impl DeviceClock {
    /// The clock a device reports in its attributes.
    pub fn from_attr(attr: &DeviceAttr) -> DeviceClock {
        DeviceClock {
            mask: attr.completion_timestamp_mask,
            khz: attr.hca_core_clock,
        }
    }

    /// Ticks from the raw value `earlier` to the raw value `later`, correct across one
    /// wrap-around of the mask (the two must be less than `mask + 1` ticks apart).
    pub fn delta(&self, earlier: u64, later: u64) -> u64 {
        later.wrapping_sub(earlier) & self.mask
    }

    /// `ticks` of this clock in nanoseconds (rounded down; 0 if the clock reports no
    /// frequency).
    pub fn ticks_to_ns(&self, ticks: u64) -> u64 {
        if self.khz == 0 {
            return 0;
        }
        let ns = u128::from(ticks) * 1_000_000 / u128::from(self.khz);
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// Nanoseconds from the raw value `earlier` to the raw value `later` (see
    /// [`delta`](Self::delta)).
    pub fn delta_ns(&self, earlier: u64, later: u64) -> u64 {
        self.ticks_to_ns(self.delta(earlier, later))
    }
}
