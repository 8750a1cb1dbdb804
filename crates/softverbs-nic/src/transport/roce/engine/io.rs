//! The engine's real path: UDP sockets on port 4791 of the device's addresses, and the
//! capture file.
//!
//! A kernel UDP socket gives the payload without the IP and UDP headers, and writes them
//! itself when sending; the transport core parses and emits whole datagrams (the ICRC covers
//! parts of both headers). So a received datagram gets the headers the kernel removed put
//! back in front of it ([`Socket::frame`]), and a datagram to send leaves without them.
//!
//! Both ways batch where the kernel can: a run of datagrams to one peer leaves in one GSO
//! send ([`Socket::send`], `UDP_SEGMENT`), and a run of one peer's datagrams arrives in one
//! GRO read ([`Socket::recv`], `UDP_GRO`), so a 64 KiB message costs a system call or two
//! each way instead of 64. `SOFTVERBS_ENGINE_BATCH=0` turns both off (one datagram per system
//! call), to compare.

use super::outbox::MAX_SEGMENTS;
use softverbs_roce::Time;
use softverbs_roce::sim::pcap::{PcapWriter, Resolution};
use softverbs_roce::wire::{IpRepr, UdpRepr};
use std::io::{BufWriter, ErrorKind};
use std::net::{IpAddr, SocketAddr, SocketAddrV6, UdpSocket};
use std::os::fd::AsRawFd;

/// The RoCEv2 UDP port.
pub(crate) const ROCE_PORT: u16 = 4791;

/// Room in front of a received payload for the headers put back: IPv6 and UDP.
pub(crate) const HEADROOM: usize = 48;

/// `SOL_UDP` options of linux/udp.h (the libc crate lacks them for glibc): GSO's segment
/// size, and GRO on a receiving socket.
pub const UDP_SEGMENT: libc::c_int = 103;
pub const UDP_GRO: libc::c_int = 104;

/// The environment variable that turns GSO sends and GRO reads off when `0`.
pub const ENV_ENGINE_BATCH: &str = "SOFTVERBS_ENGINE_BATCH";

/// Whether the engine batches datagrams through GSO and GRO (see the module's doc).
pub(crate) fn batching() -> bool {
    std::env::var(ENV_ENGINE_BATCH).map_or(true, |v| v != "0")
}

/// Port 4791 of `addr`; a link-local IPv6 address is scoped to interface `ifindex`.
fn roce_addr(addr: IpAddr, ifindex: u32) -> SocketAddr {
    match addr {
        IpAddr::V4(a) => SocketAddr::from((a, ROCE_PORT)),
        IpAddr::V6(a) => {
            let link_local = a.segments()[0] & 0xffc0 == 0xfe80;
            let scope = if link_local { ifindex } else { 0 };
            SocketAddr::V6(SocketAddrV6::new(a, ROCE_PORT, 0, scope))
        }
    }
}

/// One address's socket.
pub(crate) struct Socket {
    pub(crate) addr: IpAddr,
    pub(crate) sock: UdpSocket,
    /// Sends of several datagrams go as one GSO send.
    gso: bool,
}

impl Socket {
    /// Binds UDP port 4791 of `addr` (link-local IPv6 addresses on interface `ifindex`),
    /// batching with GSO and GRO if `batch`.
    pub(crate) fn bind(addr: IpAddr, ifindex: u32, batch: bool) -> std::io::Result<Socket> {
        let sock = UdpSocket::bind(roce_addr(addr, ifindex))?;
        sock.set_nonblocking(true)?;
        if addr.is_ipv4() {
            // Don't fragment: RoCE packets fit the path MTU, and Linux gives such datagrams of
            // an unconnected socket IP identification 0, which the ICRC then covers.
            let on: libc::c_int = libc::IP_PMTUDISC_DO;
            // SAFETY: a valid socket and a c_int option of the size passed.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::IPPROTO_IP,
                    libc::IP_MTU_DISCOVER,
                    (&on as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
        // Bursts of a bandwidth test must not overflow the default buffers.
        for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
            let size: libc::c_int = 4 << 20;
            // SAFETY: as above.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
        // Datagrams to a multicast group leave through the device's interface.
        let _ = match addr {
            IpAddr::V4(a) => rustix::net::sockopt::set_ip_multicast_if_with_ifindex(
                &sock,
                &std::net::Ipv4Addr::UNSPECIFIED,
                &a,
                ifindex,
            ),
            IpAddr::V6(_) => rustix::net::sockopt::set_ipv6_multicast_if(&sock, ifindex),
        };
        // Runs of one sender's datagrams arrive in one read; without it a GSO send that
        // reaches this host whole (as over a veth) is cut apart again before the socket.
        if batch {
            let _ = set_udp_option(&sock, UDP_GRO, 1);
        }
        Ok(Socket {
            addr,
            sock,
            gso: batch,
        })
    }

    /// A socket that receives port 4791 of IP multicast group `group`, joined on interface
    /// `ifindex` (the kernel leaves the group when it is closed). Several engines of a host
    /// may join the same group, hence the shared address.
    pub(crate) fn join(group: IpAddr, ifindex: u32) -> std::io::Result<Socket> {
        use rustix::net::{AddressFamily, SocketFlags, SocketType, bind, socket_with, sockopt};
        let family = match group {
            IpAddr::V4(_) => AddressFamily::INET,
            IpAddr::V6(_) => AddressFamily::INET6,
        };
        let fd = socket_with(
            family,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        sockopt::set_socket_reuseaddr(&fd, true)?;
        bind(&fd, &roce_addr(group, 0))?;
        match group {
            IpAddr::V4(g) => sockopt::set_ip_add_membership_with_ifindex(
                &fd,
                &g,
                &std::net::Ipv4Addr::UNSPECIFIED,
                ifindex,
            )?,
            IpAddr::V6(g) => sockopt::set_ipv6_add_membership(&fd, &g, ifindex)?,
        }
        Ok(Socket {
            addr: group,
            sock: UdpSocket::from(fd),
            gso: false,
        })
    }

    /// Whether sends of several datagrams go as one GSO send (until the kernel refuses one).
    pub(crate) fn gso(&self) -> bool {
        self.gso
    }

    /// Receives what one read gives into `buf[HEADROOM..]`: one datagram, or with GRO a
    /// run of one sender's datagrams back to back, each [`Received::segment`] bytes but
    /// the last. `None` when nothing is waiting.
    pub(crate) fn recv(&self, buf: &mut [u8]) -> Option<Received> {
        let room = buf.get_mut(HEADROOM..)?;
        loop {
            match recv_segments(&self.sock, room) {
                Ok(r) => return Some(r),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return None,
            }
        }
    }

    /// Puts the IP and UDP headers the kernel removed back in front of the `n` bytes of
    /// payload at `buf[at..]` (`at` >= [`HEADROOM`]; what lies before is overwritten),
    /// as the datagram from `from` looked on the wire but for its IPv4 identification,
    /// which the socket does not show (written as 0: see [`Endpoint::handle_received`]).
    /// Returns where the datagram starts. With `checksummed`, an IPv6 datagram's UDP
    /// checksum is computed too (IPv6 forbids a zero one, and a capture must show what was
    /// on the wire; the ICRC does not cover it).
    ///
    /// [`Endpoint::handle_received`]: softverbs_roce::endpoint::Endpoint::handle_received
    pub(crate) fn frame(
        &self,
        from: SocketAddr,
        buf: &mut [u8],
        at: usize,
        n: usize,
        checksummed: bool,
    ) -> Option<usize> {
        let src = match from {
            SocketAddr::V4(a) => IpAddr::V4(*a.ip()),
            SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(*a.ip()),
            },
        };
        let ip = IpRepr::between(src, self.addr)?;
        let start = at.checked_sub(ip.len() + UdpRepr::LEN)?;
        let udp = UdpRepr {
            src_port: from.port(),
            dst_port: ROCE_PORT,
        };
        let (head, rest) = buf.get_mut(start..at + n)?.split_at_mut(ip.len());
        ip.emit(UdpRepr::LEN + n, head).ok()?;
        udp.emit(&ip, n, checksummed && ip.len() == 40, rest).ok()?;
        Some(start)
    }

    /// Sends `datagrams` (whole, headers included) to port 4791 of `dst`; the kernel makes
    /// the headers again. More than one go as one GSO send: all but the last of one
    /// length, the last no longer. An error if the socket's buffer is full (the packets are
    /// lost, and the transport's retransmission recovers them, as on a congested link) or
    /// the kernel cannot segment (then [`gso`](Self::gso) turns false).
    pub(crate) fn send(
        &mut self,
        dst: IpAddr,
        ifindex: u32,
        datagrams: &[&[u8]],
    ) -> std::io::Result<()> {
        let skip = match dst {
            IpAddr::V4(_) => 20,
            IpAddr::V6(_) => 40,
        } + UdpRepr::LEN;
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_SEGMENTS];
        let n = datagrams.len().min(MAX_SEGMENTS);
        for (v, d) in iov.iter_mut().zip(&datagrams[..n]) {
            let payload = d
                .get(skip..)
                .ok_or_else(|| std::io::Error::from(ErrorKind::InvalidInput))?;
            *v = libc::iovec {
                iov_base: payload.as_ptr() as *mut libc::c_void,
                iov_len: payload.len(),
            };
        }
        let segment = (n > 1).then(|| iov[0].iov_len as u16);
        let to = roce_addr(dst, ifindex);
        loop {
            match send_segments(&self.sock, &to, &iov[..n], segment) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    let cannot_segment = matches!(
                        e.raw_os_error(),
                        Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
                    );
                    if segment.is_some() && cannot_segment {
                        self.gso = false;
                    }
                    return Err(e);
                }
            }
        }
    }
}

/// Sets an integer `SOL_UDP` option (also used by `perf --net`'s UDP baselines).
pub fn set_udp_option(
    sock: &UdpSocket,
    opt: libc::c_int,
    value: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: a valid socket and a c_int option of the size passed, which the kernel reads.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_UDP,
            opt,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What one read of a socket gave.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Received {
    pub(crate) from: SocketAddr,
    /// Bytes read (at `HEADROOM` of the buffer).
    pub(crate) len: usize,
    /// Bytes of each datagram of the run but the last (all of them without GRO).
    pub(crate) segment: usize,
}

/// `sendmsg` of the `iov` payloads to `to` as one datagram, or, with `segment`, as
/// datagrams of that many bytes (`UDP_SEGMENT`).
fn send_segments(
    sock: &UdpSocket,
    to: &SocketAddr,
    iov: &[libc::iovec],
    segment: Option<u16>,
) -> std::io::Result<()> {
    // A u64 array keeps the control buffer aligned for `cmsghdr`.
    let mut control = [0u64; 4];
    let cmsg_space = // SAFETY: CMSG_SPACE only computes a size.
        unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) } as usize;
    // SAFETY: `msghdr` is plain data; all-zero is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len();
    if let Some(size) = segment {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = cmsg_space;
        // SAFETY: the control buffer (32 bytes, aligned) holds one cmsghdr and a u16
        // (CMSG_SPACE(2) = 24 on 64-bit Linux), and `msg` points at it with that length, so
        // CMSG_FIRSTHDR is that buffer's start and CMSG_DATA lies inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), size);
        }
    }
    // SAFETY: `to` lends a valid socket address for the closure's duration; `msg` points at
    // it, at `iov` (whose entries point into live datagrams the caller borrows) and at the
    // control buffer, all alive across the call, which only reads them.
    let rc = unsafe {
        rustix::net::addr::SocketAddrArg::with_sockaddr(to, |addr, len| {
            msg.msg_name = addr as *mut libc::c_void;
            msg.msg_namelen = len as libc::socklen_t;
            libc::sendmsg(sock.as_raw_fd(), &msg, 0)
        })
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `recvmsg` into `buf`: the sender, the bytes, and the GRO segment size if the kernel
/// joined datagrams (a read cut short counts as an error: the run is lost).
fn recv_segments(sock: &UdpSocket, buf: &mut [u8]) -> std::io::Result<Received> {
    // SAFETY: plain data; all-zero is a valid (empty) value of each.
    let mut from: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&raw mut from).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: every pointer in `msg` points at a live local or at `buf`, with its length;
    // the kernel writes within those lengths.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let len = n as usize;
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(ErrorKind::InvalidData.into());
    }
    let mut segment = len;
    // SAFETY: the kernel filled `control` up to `msg_controllen`; CMSG_FIRSTHDR/NXTHDR walk
    // only headers inside it, and a UDP_GRO message carries an int.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let size = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                if size > 0 {
                    segment = (size as usize).min(len);
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let from = socket_addr(&from).ok_or(ErrorKind::InvalidData)?;
    Ok(Received {
        from,
        len,
        segment: segment.max(1),
    })
}

/// The address in `s` (AF_INET or AF_INET6).
fn socket_addr(s: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(s.ss_family) {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in, which sockaddr_storage holds.
            let a = unsafe { &*(s as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a sockaddr_in6, which sockaddr_storage holds.
            let a = unsafe { &*(s as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(SocketAddrV6::new(
                a.sin6_addr.s6_addr.into(),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// A capture of everything the engine sends and receives.
pub(crate) struct Capture {
    w: PcapWriter<BufWriter<std::fs::File>>,
    pub(crate) path: String,
}

impl Capture {
    pub(crate) fn create(path: &str) -> std::io::Result<Capture> {
        let f = std::fs::File::create(path)?;
        Ok(Capture {
            w: PcapWriter::new(BufWriter::new(f), Resolution::Nanos)?,
            path: path.into(),
        })
    }

    /// Records one datagram (wall-clock time, so captures of two hosts line up).
    pub(crate) fn record(&mut self, datagram: &[u8]) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let _ = self.w.write_record(Time(now), datagram);
    }

    pub(crate) fn flush(&mut self) {
        let _ = self.w.flush();
    }
}
