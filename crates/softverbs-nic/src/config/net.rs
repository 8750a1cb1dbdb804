//! Networked devices: which interface or address a device speaks RoCEv2 on, its GID table
//! and MTU as the interface gives them, and the fault injection of its real path.
//!
//! A device with `netdev=IFNAME` or `ip=ADDR` in `SOFTVERBS_DEVICES` is networked: its
//! traffic leaves through the host engine on UDP port 4791 of the interface's addresses. The
//! GID table is built the way the kernel's GID cache orders a RoCE port's entries: the IPv6
//! link-local address first, then the IPv4 addresses (IPv4-mapped), then the other IPv6
//! addresses; all RoCEv2.

use crate::error::{Error, Result};
use crate::types::{Gid, Mtu};
use std::net::{IpAddr, Ipv6Addr};

/// Headers a RoCEv2 packet carries beyond its payload at most (IPv6 40, UDP 8, BTH 12, RETH
/// 16, ICRC 4): what the interface MTU must hold besides the path MTU, as soft-RoCE counts.
pub const ROCE_HEADROOM: u32 = 80;

/// Seeded faults the engine injects on a device's real path (rates are per packet, 0..=1).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    /// Packets dropped, each way.
    pub drop: f64,
    /// Packets sent twice.
    pub duplicate: f64,
    /// Packets held back and sent after the next one.
    pub reorder: f64,
    /// Packets with one byte flipped (the receiver's ICRC check drops them).
    pub corrupt: f64,
    /// Extra delay before each packet leaves, in microseconds.
    pub delay_us: u64,
    /// The seed of the fault generator (the same seed, the same decisions).
    pub seed: u64,
}

impl Faults {
    /// True when any fault is configured.
    pub fn any(&self) -> bool {
        self.drop > 0.0
            || self.duplicate > 0.0
            || self.reorder > 0.0
            || self.corrupt > 0.0
            || self.delay_us > 0
    }
}

impl Eq for Faults {}

/// What makes a device networked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NetConfig {
    /// The interface (`netdev=`), or the one holding `ip`.
    pub netdev: Option<String>,
    /// The address asked for (`ip=`): the device's primary address.
    pub ip: Option<IpAddr>,
    /// The interface's index (`ndev_ifindex` of its GID entries), once resolved.
    pub ifindex: u32,
    pub faults: Faults,
}

/// An interface as the device uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    /// The interface's MTU in bytes.
    pub mtu: u32,
    /// Its addresses in GID-table order.
    pub addrs: Vec<IpAddr>,
}

impl Interface {
    /// The interface named `name`, or the one holding `ip`.
    pub fn find(name: Option<&str>, ip: Option<IpAddr>) -> Result<Interface> {
        let all = interfaces()?;
        let found = all
            .into_iter()
            .find(|i| name.is_none_or(|n| i.name == n) && ip.is_none_or(|a| i.addrs.contains(&a)));
        found.ok_or_else(|| {
            Error::Config(match (name, ip) {
                (Some(n), Some(a)) => format!("interface {n} has no address {a}"),
                (Some(n), None) => format!("no interface {n} with an address"),
                (None, Some(a)) => format!("no interface has address {a}"),
                (None, None) => "netdev= or ip= names the interface".into(),
            })
        })
    }

    /// The RoCE path MTU the interface carries: the largest IB MTU that fits with the headers.
    pub fn roce_mtu(&self) -> Option<Mtu> {
        let room = self.mtu.checked_sub(ROCE_HEADROOM)?;
        [
            Mtu::Mtu4096,
            Mtu::Mtu2048,
            Mtu::Mtu1024,
            Mtu::Mtu512,
            Mtu::Mtu256,
        ]
        .into_iter()
        .find(|m| m.bytes() <= room)
    }
}

/// A GID for an address: IPv4 addresses map into `::ffff:0:0/96`.
pub fn gid_of(ip: IpAddr) -> Gid {
    match ip {
        IpAddr::V4(a) => Gid::from(a.to_ipv6_mapped()),
        IpAddr::V6(a) => Gid::from(a),
    }
}

/// The address a GID stands for (an IPv4-mapped GID is the IPv4 address).
pub fn ip_of(gid: Gid) -> IpAddr {
    let v6 = gid.to_ipv6();
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

fn is_link_local(a: &Ipv6Addr) -> bool {
    a.segments()[0] & 0xffc0 == 0xfe80
}

/// Addresses in the order a RoCE port's GID table lists them.
fn gid_order(addrs: &mut [IpAddr]) {
    addrs.sort_by_key(|a| match a {
        IpAddr::V6(v6) if is_link_local(v6) => 0,
        IpAddr::V4(_) => 1,
        IpAddr::V6(_) => 2,
    });
}

/// Every interface that has an address (loopback excluded), from `getifaddrs`.
pub fn interfaces() -> Result<Vec<Interface>> {
    let mut list: Vec<Interface> = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::Os {
            what: "getifaddrs",
            errno: rustix::io::Errno::from_io_error(&std::io::Error::last_os_error())
                .unwrap_or(rustix::io::Errno::INVAL),
        });
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string of the node.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and its family says which sockaddr it is.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::from(sin6.sin6_addr.s6_addr)
                }
                _ => continue,
            }
        };
        match list.iter_mut().find(|i| i.name == name) {
            Some(i) => i.addrs.push(addr),
            None => list.push(Interface {
                index: if_index(&name),
                mtu: if_mtu(&name),
                name,
                addrs: vec![addr],
            }),
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    for i in &mut list {
        gid_order(&mut i.addrs);
    }
    Ok(list)
}

fn sys_net(name: &str, what: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/{what}"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn if_index(name: &str) -> u32 {
    sys_net(name, "ifindex").unwrap_or(0)
}

fn if_mtu(name: &str) -> u32 {
    sys_net(name, "mtu").unwrap_or(1500)
}

/// Whether the interface is up (operstate `up`, or `unknown` as loopback-like links say).
pub fn link_up(name: &str) -> bool {
    std::fs::read_to_string(format!("/sys/class/net/{name}/operstate"))
        .map(|s| matches!(s.trim(), "up" | "unknown"))
        .unwrap_or(false)
}

/// Parses a fault rate: a fraction (`0.01`) or a percentage (`1%`).
pub(super) fn parse_rate(v: &str) -> Option<f64> {
    let r = match v.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().ok()? / 100.0,
        None => v.parse::<f64>().ok()?,
    };
    (0.0..=1.0).contains(&r).then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gids_are_ordered_as_a_roce_port_lists_them() {
        let mut a: Vec<IpAddr> = ["fd00::1", "10.0.0.1", "fe80::1", "10.0.0.2"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        gid_order(&mut a);
        let text: Vec<String> = a.iter().map(ToString::to_string).collect();
        assert_eq!(text, ["fe80::1", "10.0.0.1", "10.0.0.2", "fd00::1"]);
        let g = gid_of("10.0.0.1".parse().unwrap());
        assert_eq!(g.to_ipv6().to_string(), "::ffff:10.0.0.1");
        assert_eq!(ip_of(g), "10.0.0.1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn the_path_mtu_fits_the_interface_with_the_headers() {
        let i = |mtu| Interface {
            name: "x".into(),
            index: 1,
            mtu,
            addrs: vec![],
        };
        assert_eq!(i(1500).roce_mtu(), Some(Mtu::Mtu1024));
        assert_eq!(i(9000).roce_mtu(), Some(Mtu::Mtu4096));
        assert_eq!(i(4176).roce_mtu(), Some(Mtu::Mtu4096));
        assert_eq!(i(4175).roce_mtu(), Some(Mtu::Mtu2048));
        assert_eq!(i(300).roce_mtu(), None);
    }

    #[test]
    fn rates_are_fractions_or_percentages() {
        assert_eq!(parse_rate("0.01"), Some(0.01));
        assert_eq!(parse_rate("1%"), Some(0.01));
        assert_eq!(parse_rate("2"), None);
        assert_eq!(parse_rate("-0.1"), None);
        assert_eq!(parse_rate("x"), None);
    }
}
