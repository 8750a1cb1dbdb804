//! The host's multicast groups: which QPs of the device with GID `gid` are attached to the
//! group with GID `mgid`.
//!
//! One abstract Unix socket name per attachment, `softverbs/<gid>/mc/<mgid>/<mlid>/<qpn>`, bound by
//! the attaching process and removed by the kernel when it closes the socket (detach, QP
//! destroyed, process gone), like the QP directory ([`super::directory`]). A sender to a
//! group reads the members from `/proc/net/unix`: a few tens of µs a message, which is what
//! multicast costs here (it is for discovery and control traffic, not the data path).

use super::directory::{bind_abstract, gid_hex};
use crate::error::{Error, Result};
use crate::types::Gid;
use rustix::fd::OwnedFd;

/// Most groups one device serves, QPs one group holds, and groups one QP joins (soft-RoCE's
/// figures for the first two).
pub const MAX_GROUPS: u32 = 8192;
pub const MAX_QPS_PER_GROUP: u32 = 56;
pub const MAX_GROUPS_PER_QP: usize = 56;

/// The QP number a UD send names for a group (IBA 10.8.2: the multicast QPN).
pub const MULTICAST_QPN: u32 = 0xff_ffff;

/// The first multicast LID (IBA 4.1.1: 0xC000..=0xFFFE; 0xFFFF is the permissive LID).
pub const MIN_MLID: u16 = 0xc000;

/// What a sender names a group by: its GID (a GRH's), or on InfiniBand its LID alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Group {
    Gid(Gid),
    Lid(u16),
}

/// True for a multicast GID: first byte 0xff (IBA 4.1.1), or on RoCEv2 an IPv4-mapped
/// IPv4 multicast address (`::ffff:224.0.0.0/100`, as rdma_cm maps IPv4 groups and the
/// kernel's `rdma_is_multicast_addr` accepts).
pub fn is_multicast(gid: &Gid) -> bool {
    let g = &gid.0;
    g[0] == 0xff || (g[..10] == [0; 10] && g[10..12] == [0xff, 0xff] && g[12] & 0xf0 == 0xe0)
}

fn hex(gid: &Gid) -> String {
    gid_hex(*gid)
}

/// Holding it keeps QP `qpn` attached to the group (on a networked device the host engine
/// keeps the membership: no name here).
pub(crate) struct Membership {
    pub(crate) mgid: Gid,
    pub(crate) mlid: u16,
    pub(crate) _name: Option<OwnedFd>,
}

/// Every attachment of the device with `gid`: (group GID in hex, LID, QP number).
fn attachments(gid: Gid) -> Vec<(String, u16, u32)> {
    let prefix = format!("@softverbs/{}/mc/", hex(&gid));
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return Vec::new();
    };
    table
        .lines()
        .filter_map(|line| {
            let rest = line.split_whitespace().last()?.strip_prefix(&prefix)?;
            let mut it = rest.split('/');
            let group = it.next()?.to_string();
            let lid = u16::from_str_radix(it.next()?, 16).ok()?;
            let qpn = u32::from_str_radix(it.next()?, 16).ok()?;
            Some((group, lid, qpn))
        })
        .collect()
}

/// The QPs of the device with `gid` attached to `group`.
pub(crate) fn members(gid: Gid, group: Group) -> Vec<u32> {
    let all = attachments(gid);
    let mut qpns: Vec<u32> = match group {
        Group::Gid(mgid) => {
            let g = hex(&mgid);
            all.into_iter()
                .filter_map(|(h, _, q)| (h == g).then_some(q))
                .collect()
        }
        Group::Lid(lid) => all
            .into_iter()
            .filter_map(|(_, l, q)| (l == lid).then_some(q))
            .collect(),
    };
    qpns.sort_unstable();
    qpns.dedup();
    qpns
}

/// Attaches QP `qpn` of the device with `gid` to group `mgid`; `None` if it already is.
pub(crate) fn attach(gid: Gid, mgid: Gid, mlid: u16, qpn: u32) -> Result<Option<Membership>> {
    let all = attachments(gid);
    let group = hex(&mgid);
    let in_group = all.iter().filter(|(g, ..)| *g == group).count() as u32;
    if in_group >= MAX_QPS_PER_GROUP {
        return Err(Error::NoResources(format!(
            "multicast group {group} has {MAX_QPS_PER_GROUP} QPs (max_mcast_qp_attach)"
        )));
    }
    if in_group == 0 {
        let mut groups: Vec<&String> = all.iter().map(|(g, ..)| g).collect();
        groups.sort();
        groups.dedup();
        if groups.len() as u32 >= MAX_GROUPS {
            return Err(Error::NoResources(format!(
                "{MAX_GROUPS} multicast groups (max_mcast_grp)"
            )));
        }
    }
    let name = format!("softverbs/{}/mc/{group}/{mlid:04x}/{qpn:06x}", hex(&gid));
    Ok(bind_abstract(&name)?.map(|sock| Membership {
        mgid,
        mlid,
        _name: Some(sock),
    }))
}
