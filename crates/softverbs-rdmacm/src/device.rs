//! The devices the CM maps addresses to: every device of the program's libibverbs, opened
//! once for the life of the process (as librdmacm keeps one `ibv_context` per device and
//! hands the same one to every `rdma_cm_id` on it), with its GID table.

use crate::addr::{canonical, gid_of};
use crate::ibv::*;
use crate::verbs::verbs;
use std::net::{IpAddr, Ipv4Addr, UdpSocket};
use std::sync::OnceLock;

/// One opened device.
pub struct Dev {
    pub ctx: *mut ibv_context,
    pub name: String,
    pub guid: u64,
    /// Port 1's GIDs by index.
    pub gids: Vec<[u8; 16]>,
    /// Port 1's active MTU (`enum ibv_mtu`).
    pub mtu: i32,
    /// Port 1 is InfiniBand (multicast groups need a multicast LID there).
    pub ib: bool,
    /// A PD for `rdma_create_qp` calls that pass none, made when first needed.
    pub pd: std::sync::Mutex<usize>,
}

// SAFETY: the context pointer is only passed to libibverbs calls, which are thread-safe.
unsafe impl Send for Dev {}
// SAFETY: as above.
unsafe impl Sync for Dev {}

static DEVICES: OnceLock<Vec<Dev>> = OnceLock::new();

/// Every device, opened.
pub fn devices() -> &'static [Dev] {
    DEVICES.get_or_init(open_all)
}

fn open_all() -> Vec<Dev> {
    let Some(v) = verbs() else {
        return Vec::new();
    };
    let mut n = 0;
    // SAFETY: ibv_get_device_list with a valid count pointer.
    let list = unsafe { (v.get_device_list)(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` device pointers.
        let d = unsafe { *list.add(i) };
        // SAFETY: a device of the list, which stays valid while we use it here.
        let ctx = unsafe { (v.open_device)(d) };
        if ctx.is_null() {
            continue;
        }
        // SAFETY: as above; the name is a NUL-terminated string owned by the device.
        let name = unsafe { std::ffi::CStr::from_ptr((v.get_device_name)(d)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: as above.
        let guid = u64::from_be(unsafe { (v.get_device_guid)(d) });
        // SAFETY: a zeroed port_attr is valid output space; ctx is open.
        let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let ok = unsafe { (v.query_port)(ctx, 1, &mut pa) } == 0;
        let mut gids = Vec::new();
        for g in 0..if ok { pa.gid_tbl_len.clamp(0, 256) } else { 0 } {
            let mut gid = ibv_gid([0; 16]);
            // SAFETY: an open context and a writable GID.
            if unsafe { (v.query_gid)(ctx, 1, g, &mut gid) } != 0 {
                break;
            }
            gids.push(gid.0);
        }
        out.push(Dev {
            ctx,
            name,
            guid,
            gids,
            mtu: if ok { pa.active_mtu } else { 3 },
            ib: ok && pa.link_layer == 1,
            pd: std::sync::Mutex::new(0),
        });
    }
    // SAFETY: the list came from ibv_get_device_list; the opened contexts outlive it.
    unsafe { (v.free_device_list)(list) };
    out
}

/// Where an address is: the device index and GID index that hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub dev: usize,
    pub gid_index: usize,
}

/// The device and GID of local address `ip`: the device whose GID table holds it. A
/// loopback address belongs to the first device, as the kernel's CM binds loopback to the
/// first active device (`cma_bind_loopback`): with the default devices that is `softverbs0`,
/// whose GID is 127.0.0.1; under `softverbs run --netdev` it is `roce0`, at its IPv4 GID,
/// so that programs probing `localhost` (libfabric does) find the networked device.
pub fn place_of(ip: IpAddr) -> Option<Place> {
    let ip = canonical(ip);
    if ip.is_loopback() {
        let d = devices().first()?;
        let gid_index = d
            .gids
            .iter()
            .position(is_loopback_gid)
            .or_else(|| d.gids.iter().position(|g| crate::addr::ip_of(g).is_ipv4()))
            .unwrap_or(0);
        return Some(Place { dev: 0, gid_index });
    }
    let want = gid_of(ip);
    devices().iter().enumerate().find_map(|(dev, d)| {
        let gid_index = d.gids.iter().position(|g| *g == want)?;
        Some(Place { dev, gid_index })
    })
}

/// The device holding the context `ctx`.
pub fn index_of_ctx(ctx: *mut ibv_context) -> Option<usize> {
    devices().iter().position(|d| d.ctx == ctx)
}

/// True if `gid` is a GID of a device of this host: a peer there is reached without the wire.
pub fn is_local_gid(gid: &[u8; 16]) -> bool {
    devices().iter().any(|d| d.gids.contains(gid))
}

/// The local source address the kernel would use to reach `dst` (a routing-table lookup:
/// a connected UDP socket sends nothing).
pub fn source_for(dst: IpAddr) -> Option<IpAddr> {
    let dst = canonical(dst);
    if dst.is_loopback() {
        return Some(dst);
    }
    let any: IpAddr = if dst.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let s = UdpSocket::bind((any, 0)).ok()?;
    s.connect((dst, 9)).ok()?;
    Some(canonical(s.local_addr().ok()?.ip()))
}

/// True for the GID of a loopback address (IPv4-mapped 127.0.0.0/8, or ::1).
pub fn is_loopback_gid(gid: &[u8; 16]) -> bool {
    crate::addr::ip_of(gid).is_loopback()
}
