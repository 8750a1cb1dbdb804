//! Socket addresses between C (`struct sockaddr*`) and Rust, and GIDs of IP addresses.

use crate::abi::sockaddr_storage;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

/// The address at `sa`, if it is IPv4 or IPv6.
///
/// # Safety
/// `sa` is NULL or points to a socket address whose family field says how long it is.
pub unsafe fn from_c(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller's contract: a readable sockaddr, at least its family.
    let family = c_int_family(unsafe { (*sa).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let s = unsafe { &*(sa as *const libc::sockaddr_in) };
            Some(SocketAddr::from((
                Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr)),
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a sockaddr_in6.
            let s = unsafe { &*(sa as *const libc::sockaddr_in6) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(s.sin6_addr.s6_addr),
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn c_int_family(f: libc::sa_family_t) -> libc::c_int {
    libc::c_int::from(f)
}

/// `a` as a `sockaddr_storage`, and its length.
pub fn to_c(a: SocketAddr) -> (sockaddr_storage, u32) {
    let mut st = sockaddr_storage { bytes: [0; 128] };
    let len = match a {
        SocketAddr::V4(v4) => {
            let s = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in is plain bytes and smaller than the storage.
            unsafe { std::ptr::write_unaligned(st.bytes.as_mut_ptr().cast(), s) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let s = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write_unaligned(st.bytes.as_mut_ptr().cast(), s) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (st, len as u32)
}

/// The address in a `sockaddr_storage` this library wrote (or zeroed: `None`).
pub fn from_storage(st: &sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: the storage is 128 readable bytes, enough for any family.
    unsafe { from_c(st.bytes.as_ptr().cast()) }
}

/// The RoCEv2 GID of `ip`: IPv4-mapped for IPv4.
pub fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The IP address a RoCEv2 GID stands for.
pub fn ip_of(gid: &[u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(*gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// IPv4-mapped IPv6 addresses as IPv4, so one host has one spelling.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_through_c() {
        for a in ["10.1.2.3:4791", "[fe80::1%2]:20000", "[2001:db8::1]:1"] {
            let a: SocketAddr = a.parse().unwrap();
            let (st, len) = to_c(a);
            assert!(len == 16 || len == 28);
            assert_eq!(from_storage(&st), Some(a));
        }
        assert_eq!(from_storage(&sockaddr_storage { bytes: [0; 128] }), None);
    }

    #[test]
    fn gids_of_ipv4_are_mapped() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(ip_of(&gid_of(ip)), ip);
        assert_eq!(canonical("::ffff:10.0.0.1".parse().unwrap()), ip);
    }
}
