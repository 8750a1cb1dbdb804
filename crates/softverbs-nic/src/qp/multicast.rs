//! UD multicast: `ibv_attach_mcast` / `ibv_detach_mcast`. On one host membership is
//! host-wide (see [`crate::device::multicast`]); a UD send to the multicast QPN reaches every
//! QP attached to the group its address handle names, the sender's own included (no
//! loopback block). On a networked device the group is an IP multicast group: the host
//! engine joins it on the interface with its first member and delivers each datagram to it
//! to every member it serves.

use super::Qp;
use super::request::Offload;
use crate::device::multicast::{self, MAX_GROUPS_PER_QP, MIN_MLID, Membership};
use crate::error::{Error, Result, inval};
use crate::types::{Gid, LinkLayer, QpType};

impl Qp {
    /// `ibv_attach_mcast`: attaches this UD QP to group `mgid` (a multicast GID; on an
    /// InfiniBand port `mlid` must be a multicast LID, on RoCE it is ignored). Attaching again
    /// to a group it is in does nothing, as the kernel's uverbs does.
    pub fn attach_mcast(&self, mgid: Gid, mlid: u16) -> Result<()> {
        self.check_group(mgid, mlid)?;
        let mut m = self.mcast.lock().unwrap_or_else(|e| e.into_inner());
        if m.iter().any(|x| x.mgid == mgid && x.mlid == mlid) {
            return Ok(());
        }
        if m.len() >= MAX_GROUPS_PER_QP {
            return Err(Error::NoResources(format!(
                "a QP joins at most {MAX_GROUPS_PER_QP} groups"
            )));
        }
        if let Some(o) = &self.offload {
            if !m.iter().any(|x| x.mgid == mgid) {
                o.group(mgid, true)?;
            }
            m.push(Membership {
                mgid,
                mlid,
                _name: None,
            });
        } else if let Some(x) = multicast::attach(self.dev.config.gid, mgid, mlid, self.qpn)? {
            m.push(x);
        }
        Ok(())
    }

    /// `ibv_detach_mcast`: EINVAL if the QP is not attached to (`mgid`, `mlid`).
    pub fn detach_mcast(&self, mgid: Gid, mlid: u16) -> Result<()> {
        self.check_group(mgid, mlid)?;
        let mut m = self.mcast.lock().unwrap_or_else(|e| e.into_inner());
        let at = m
            .iter()
            .position(|x| x.mgid == mgid && x.mlid == mlid)
            .ok_or_else(|| inval("the QP is not attached to this group"))?;
        m.remove(at);
        if let Some(o) = &self.offload
            && !m.iter().any(|x| x.mgid == mgid)
        {
            o.group(mgid, false)?;
        }
        Ok(())
    }

    /// How many groups it is attached to (`ibv_destroy_qp` is EBUSY while any).
    pub fn attached_groups(&self) -> usize {
        self.mcast.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn check_group(&self, mgid: Gid, mlid: u16) -> Result<()> {
        if self.qp_type != QpType::Ud {
            return Err(inval("only UD QPs join multicast groups"));
        }
        if !multicast::is_multicast(&mgid) {
            return Err(inval("not a multicast GID (first byte 0xff)"));
        }
        if self.dev.config.link_layer == LinkLayer::InfiniBand
            && !(MIN_MLID..0xffff).contains(&mlid)
        {
            return Err(inval(format!("{mlid:#x} is not a multicast LID")));
        }
        Ok(())
    }
}
