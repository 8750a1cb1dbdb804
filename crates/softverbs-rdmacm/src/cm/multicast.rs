//! Multicast joins (`rdma_join_multicast`, `_ex`, `rdma_leave_multicast`), as the kernel's CM
//! and librdmacm do them on RoCE: the group of an IP multicast address is the GID of that
//! address (IPv4-mapped for IPv4, as RoCEv2 maps it), no subnet manager is asked, the id's QP
//! (if it has one) is attached with `ibv_attach_mcast` and MULTICAST_JOIN follows with the
//! address handle, the multicast QPN and the `RDMA_PS_UDP` Q_Key, the program's context as
//! its `private_data`. On an InfiniBand port the group's LID is made from its GID.

use super::{Cm, State};
use crate::abi::*;
use crate::addr;
use crate::channel::Event;
use crate::device;
use crate::ibv::*;
use crate::verbs::verbs;
use core::ffi::{c_int, c_void};
use std::net::IpAddr;

/// A group joined on an id.
pub struct Joined {
    addr: IpAddr,
    mgid: [u8; 16],
    mlid: u16,
    /// The id's QP was attached (not for send-only joins, nor an id without a QP).
    attached: *mut ibv_qp,
}

// SAFETY: the QP pointer is the program's, used under the CM lock.
unsafe impl Send for Joined {}

/// IBA 10.8.2: the destination QP of datagrams to a group.
const MULTICAST_QPN: u32 = 0xff_ffff;

impl Cm {
    /// `rdma_join_multicast`: joins id `i` to the group of `group` (its QP too unless
    /// `send_only`) and queues MULTICAST_JOIN.
    pub fn join(
        &mut self,
        i: u32,
        group: IpAddr,
        context: *mut c_void,
        send_only: bool,
    ) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        let group = addr::canonical(group);
        // The kernel's checks: a datagram port space, a bound or resolved id on a device,
        // a multicast address not joined yet on this id.
        if !matches!(c.ps, RDMA_PS_UDP | RDMA_PS_IPOIB)
            || !matches!(
                c.state,
                State::AddrBound | State::AddrResolved | State::RouteResolved
            )
            || !group.is_multicast()
        {
            return Err(libc::EINVAL);
        }
        let d = c.dev.ok_or(libc::EINVAL)?;
        if c.groups.iter().any(|g| g.addr == group) {
            return Err(libc::EADDRINUSE);
        }
        let mgid = addr::gid_of(group);
        let mlid = if device::devices()[d].ib {
            // A multicast LID (0xC000..=0xFFFE) from the group's GID.
            let h = mgid
                .iter()
                .fold(0u16, |h, &b| h.rotate_left(5) ^ u16::from(b));
            0xc000 | (h % 0x3fff)
        } else {
            0
        };
        // SAFETY: the id is live.
        let qp = unsafe { (*c.id).c.qp };
        let attached = if qp.is_null() || send_only {
            std::ptr::null_mut()
        } else {
            let v = verbs().ok_or(libc::ENOSYS)?;
            // SAFETY: the program's QP of this id, and a GID on the stack.
            let r = unsafe { (v.attach_mcast)(qp, &ibv_gid(mgid), mlid) };
            if r != 0 {
                return Err(r);
            }
            qp
        };
        let (id, gid_index, tos) = (c.id, c.gid_index, c.tos);
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        c.groups.push(Joined {
            addr: group,
            mgid,
            mlid,
            attached,
        });
        let ud = rdma_ud_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            ah_attr: ibv_ah_attr {
                grh: ibv_global_route {
                    dgid: ibv_gid(mgid),
                    flow_label: 0,
                    sgid_index: gid_index as u8,
                    hop_limit: 1,
                    traffic_class: tos,
                },
                dlid: mlid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                is_global: 1,
                port_num: 1,
            },
            qp_num: MULTICAST_QPN,
            qkey: RDMA_UDP_QKEY,
        };
        let e = Event::new(id.cast(), RDMA_CM_EVENT_MULTICAST_JOIN, 0).with_group(ud, context);
        self.post(i, e);
        Ok(())
    }

    /// `rdma_leave_multicast`: EADDRNOTAVAIL for a group not joined on id `i`.
    pub fn leave(&mut self, i: u32, group: IpAddr) -> Result<(), c_int> {
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        let group = addr::canonical(group);
        let at = c
            .groups
            .iter()
            .position(|g| g.addr == group)
            .ok_or(libc::EADDRNOTAVAIL)?;
        let g = c.groups.remove(at);
        detach(&g)
    }

    /// Detaches id `i`'s QP from the groups it was attached to (the QP is being destroyed);
    /// the id stays a member.
    pub fn detach_qp(&mut self, i: u32) {
        if let Some(c) = self.conns.get_mut(&i) {
            for g in &mut c.groups {
                let _ = detach(g);
                g.attached = std::ptr::null_mut();
            }
        }
    }

    /// Leaves every group of id `i` (it is being destroyed), detaching its QP.
    pub(super) fn leave_all(&mut self, i: u32) {
        if let Some(c) = self.conns.get_mut(&i) {
            for g in std::mem::take(&mut c.groups) {
                let _ = detach(&g);
            }
        }
    }
}

fn detach(g: &Joined) -> Result<(), c_int> {
    if g.attached.is_null() {
        return Ok(());
    }
    let v = verbs().ok_or(libc::ENOSYS)?;
    // SAFETY: the QP this library attached (the program destroys its QP only after leaving,
    // or the call fails harmlessly on a QP it no longer has).
    match unsafe { (v.detach_mcast)(g.attached, &ibv_gid(g.mgid), g.mlid) } {
        0 => Ok(()),
        e => Err(e),
    }
}
