//! Device contexts, protection domains, memory regions and address handles.

use crate::cq::{Channel, Cq};
use crate::device::{Counted, Device, PORT_NUM, Resource};
use crate::error::{Error, Result, inval};
use crate::event::AsyncQueue;
use crate::qp::{Qp, QpInit};
use crate::rq::Srq;
use crate::types::{AccessFlags, AhAttr, LinkLayer, WcExFlags};
use std::sync::{Arc, Weak};

/// An open device (`struct ibv_context`): owns the async event queue.
pub struct Context {
    pub(crate) dev: Arc<Device>,
    pub(crate) events: Arc<AsyncQueue>,
}

impl Context {
    /// Opens `dev`.
    pub fn open(dev: Arc<Device>) -> Result<Arc<Context>> {
        let events = Arc::new(AsyncQueue::new()?);
        dev.attach_context(&events);
        Ok(Arc::new(Context { dev, events }))
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The async event queue (its fd is readable while events wait).
    pub fn events(&self) -> &AsyncQueue {
        &self.events
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<Pd>> {
        let count = self.dev.acquire(Resource::Pd)?;
        Ok(Arc::new(Pd {
            id: self.dev.next_id(),
            ctx: self.clone(),
            _count: count,
        }))
    }

    /// Creates a completion queue of at least `cqe` entries.
    pub fn create_cq(self: &Arc<Self>, cqe: u32, channel: Option<Arc<Channel>>) -> Result<Arc<Cq>> {
        self.create_cq_ex(cqe, channel, WcExFlags::STANDARD)
    }

    /// Creates a CQ that returns the fields in `wc_flags` (checked by the caller against
    /// [`WcExFlags::SUPPORTED`]).
    pub fn create_cq_ex(
        self: &Arc<Self>,
        cqe: u32,
        channel: Option<Arc<Channel>>,
        wc_flags: WcExFlags,
    ) -> Result<Arc<Cq>> {
        let max = self.dev.config.limits.max_cqe;
        if cqe == 0 || cqe > max {
            return Err(inval(format!("cqe {cqe} (1..={max})")));
        }
        let count = self.dev.acquire(Resource::Cq)?;
        let dev = self.dev.clone();
        let retire = Arc::new(move |qpn: u32, seq: u32| dev.retire_sq(qpn, seq));
        let cq = Cq::new(
            self.dev.next_id(),
            cqe,
            channel,
            self.events.clone(),
            retire,
            self.dev.clock,
            Some(count),
            wc_flags,
        )?;
        Ok(cq)
    }
}

/// A protection domain.
pub struct Pd {
    pub(crate) id: u32,
    pub(crate) ctx: Arc<Context>,
    _count: Counted,
}

impl Pd {
    /// Device-wide id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The context the PD belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Checks `access` the way `ibv_reg_mr` does and returns the flags that take effect.
    ///
    /// Unknown mandatory bits and remote write/atomic without local write are invalid;
    /// known mandatory bits this device lacks are unsupported; optional bits (20..=29) the
    /// device implements ([`AccessFlags::SUPPORTED_OPTIONAL`]) are kept and the others
    /// dropped.
    pub fn effective_access(raw: u32) -> Result<AccessFlags> {
        let optional = raw & AccessFlags::OPTIONAL_RANGE;
        let mandatory = raw & !AccessFlags::OPTIONAL_RANGE;
        let known = AccessFlags::all().bits() & !AccessFlags::OPTIONAL_RANGE;
        if mandatory & !known != 0 {
            return Err(inval(format!(
                "unknown access bits {:#x}",
                mandatory & !known
            )));
        }
        let flags = AccessFlags::from_bits_retain(mandatory);
        if flags.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !flags.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(inval("REMOTE_WRITE or REMOTE_ATOMIC requires LOCAL_WRITE"));
        }
        let missing = flags - AccessFlags::SUPPORTED_MR;
        if !missing.is_empty() {
            return Err(Error::Unsupported(format!(
                "access flags {missing:?} are not implemented by softverbs"
            )));
        }
        // Optional bits are hints a device may ignore (rdma-core's `ibv_reg_mr_iova2`
        // contract), so the ones softverbs lacks vanish instead of failing; the MR reports
        // what is left, which is what its placement follows.
        let kept = AccessFlags::from_bits_retain(optional) & AccessFlags::SUPPORTED_OPTIONAL;
        Ok(flags | kept)
    }

    /// Registers `len` bytes at `addr`, addressed by the peer as `iova` (ignored for
    /// `ZERO_BASED`, whose IOVAs start at 0).
    ///
    /// # Safety
    /// `addr..addr + len` must stay valid for reads and writes, and not be freed or remapped,
    /// until the returned `Mr` is dropped; the NIC writes it whenever a peer's operation
    /// targets it.
    pub unsafe fn reg_mr(
        self: &Arc<Self>,
        addr: usize,
        len: usize,
        iova: u64,
        access: u32,
        backing: Option<crate::keys::Backing>,
    ) -> Result<Mr> {
        let effective = Self::effective_access(access)?;
        let dev = &self.ctx.dev;
        if len as u64 > dev.config.limits.max_mr_size {
            return Err(inval(format!(
                "length {len} exceeds max_mr_size {}",
                dev.config.limits.max_mr_size
            )));
        }
        if addr.checked_add(len).is_none() {
            return Err(inval("address range wraps"));
        }
        let iova = if effective.contains(AccessFlags::ZERO_BASED) {
            0
        } else {
            iova
        };
        if iova.checked_add(len as u64).is_none() {
            return Err(inval("IOVA range wraps"));
        }
        let count = dev.acquire(Resource::Mr)?;
        let key = dev
            .keys
            .register(self.id, addr as u64, len as u64, iova, effective, backing)?;
        Ok(Mr {
            key,
            pd: self.clone(),
            addr,
            len,
            iova,
            access: effective,
            _count: count,
        })
    }

    /// Creates an address handle for UD sends.
    pub fn create_ah(self: &Arc<Self>, attr: &AhAttr) -> Result<Arc<Ah>> {
        let dev = &self.ctx.dev;
        check_av(dev, attr)?;
        let count = dev.acquire(Resource::Ah)?;
        Ok(Arc::new(Ah {
            attr: *attr,
            pd: self.id,
            target: resolve(dev, attr),
            _count: count,
        }))
    }

    /// Creates a shared receive queue.
    pub fn create_srq(self: &Arc<Self>, max_wr: u32, max_sge: u32, limit: u32) -> Result<Arc<Srq>> {
        Srq::new(
            &self.ctx.dev,
            self.id,
            self.ctx.events.clone(),
            max_wr,
            max_sge,
            limit,
        )
    }

    /// Creates a queue pair.
    pub fn create_qp(self: &Arc<Self>, init: QpInit) -> Result<Arc<Qp>> {
        Qp::new(self, init)
    }
}

/// Validates an address vector for this device's link layer.
pub(crate) fn check_av(dev: &Device, attr: &AhAttr) -> Result<()> {
    if attr.port_num != 0 && attr.port_num != PORT_NUM {
        return Err(inval(format!(
            "port {} (the device has port 1)",
            attr.port_num
        )));
    }
    match (dev.config.link_layer, &attr.grh) {
        (LinkLayer::Ethernet, None) => Err(inval(
            "RoCE address vectors need a GRH (is_global with a destination GID)",
        )),
        (_, Some(g)) if g.sgid_index != 0 => Err(inval(format!(
            "sgid_index {} (the GID table has 1 entry)",
            g.sgid_index
        ))),
        (LinkLayer::InfiniBand, None) if attr.dlid == 0 => {
            Err(inval("destination LID 0 without a GRH"))
        }
        _ => Ok(()),
    }
}

/// Finds the device an address vector points at, if it is on this host.
pub(crate) fn resolve(dev: &Device, attr: &AhAttr) -> Weak<Device> {
    let found = match (dev.config.link_layer, &attr.grh) {
        (_, Some(g)) => Device::find_by_gid(g.dgid),
        (LinkLayer::InfiniBand, None) => Device::find_by_lid(attr.dlid),
        (LinkLayer::Ethernet, None) => None,
    };
    found.as_ref().map(Arc::downgrade).unwrap_or_default()
}

/// A registered memory region. Dropping it deregisters the key, waiting for any access in
/// flight to finish.
pub struct Mr {
    key: u32,
    pd: Arc<Pd>,
    addr: usize,
    len: usize,
    iova: u64,
    access: AccessFlags,
    _count: Counted,
}

impl Mr {
    /// The key (`lkey` and `rkey` are the same value).
    pub fn key(&self) -> u32 {
        self.key
    }
    /// Start address in this process.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// IOVA of the first byte.
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// The access rights that took effect.
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// The protection domain.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        let _ = self.pd.ctx.dev.keys.deregister(self.key);
    }
}

/// An address handle: where UD sends go.
pub struct Ah {
    pub(crate) attr: AhAttr,
    pub(crate) pd: u32,
    pub(crate) target: Weak<Device>,
    _count: Counted,
}

impl Ah {
    /// The address vector.
    pub fn attr(&self) -> &AhAttr {
        &self.attr
    }
    /// The PD the handle was created in.
    pub fn pd_id(&self) -> u32 {
        self.pd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_rules() {
        let ok = |raw| Pd::effective_access(raw).unwrap();
        assert_eq!(ok(0), AccessFlags::empty());
        assert_eq!(
            ok(1 | 2 | 4 | 8),
            AccessFlags::LOCAL_WRITE | AccessFlags::QP_REMOTE
        );
        // Unsupported optional bits are dropped, not rejected; supported ones stay.
        assert_eq!(ok(1 | (1 << 21) | (1 << 29)), AccessFlags::LOCAL_WRITE);
        assert_eq!(
            ok(1 | (1 << 20) | (1 << 29)),
            AccessFlags::LOCAL_WRITE | AccessFlags::RELAXED_ORDERING
        );
        assert!(matches!(
            Pd::effective_access(2),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Pd::effective_access(8),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Pd::effective_access(1 << 15),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Pd::effective_access(1 << 30),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Pd::effective_access(1 << 4),
            Err(Error::Unsupported(_))
        ));
    }
}
