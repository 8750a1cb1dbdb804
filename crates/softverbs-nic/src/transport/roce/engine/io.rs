//! The engine's real path: UDP sockets on port 4791 of the device's addresses, the seeded
//! faults a device may ask for, and the capture file.
//!
//! A kernel UDP socket gives the payload without the IP and UDP headers, and writes them
//! itself when sending; the transport core parses and emits whole datagrams (the ICRC covers
//! parts of both headers). So a received datagram gets the headers the kernel removed put
//! back in front of it ([`Socket::recv`]), and a datagram to send leaves without them.

use crate::config::Faults;
use softverbs_roce::Time;
use softverbs_roce::sim::SplitMix64;
use softverbs_roce::sim::pcap::{PcapWriter, Resolution};
use softverbs_roce::wire::{IpRepr, UdpRepr};
use std::collections::VecDeque;
use std::io::{BufWriter, ErrorKind};
use std::net::{IpAddr, SocketAddr, SocketAddrV6, UdpSocket};
use std::os::fd::AsRawFd;

/// The RoCEv2 UDP port.
pub(crate) const ROCE_PORT: u16 = 4791;

/// Room in front of a received payload for the headers put back: IPv6 and UDP.
pub(crate) const HEADROOM: usize = 48;

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
}

impl Socket {
    /// Binds UDP port 4791 of `addr` (link-local IPv6 addresses on interface `ifindex`).
    pub(crate) fn bind(addr: IpAddr, ifindex: u32) -> std::io::Result<Socket> {
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
        Ok(Socket { addr, sock })
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
        })
    }

    /// Receives one datagram into `buf[HEADROOM..]` and puts back the headers before it;
    /// returns the datagram's start and end in `buf`. `None` when nothing is waiting. With
    /// `checksummed`, an IPv6 datagram's UDP checksum is computed too (IPv6 forbids a zero
    /// one, and a capture must show what was on the wire; the ICRC does not cover it).
    pub(crate) fn recv(&self, buf: &mut [u8], checksummed: bool) -> Option<(usize, usize)> {
        loop {
            let (n, from) = match self.sock.recv_from(&mut buf[HEADROOM..]) {
                Ok(x) => x,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return None,
            };
            let src = match from {
                SocketAddr::V4(a) => IpAddr::V4(*a.ip()),
                SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
                    Some(v4) => IpAddr::V4(v4),
                    None => IpAddr::V6(*a.ip()),
                },
            };
            let Some(mut ip) = IpRepr::between(src, self.addr) else {
                continue;
            };
            if let IpRepr::V4(h) = &mut ip {
                h.ident = 0;
            }
            let start = HEADROOM - ip.len() - UdpRepr::LEN;
            let udp = UdpRepr {
                src_port: from.port(),
                dst_port: ROCE_PORT,
            };
            let (head, rest) = buf[start..].split_at_mut(ip.len());
            if ip.emit(UdpRepr::LEN + n, head).is_err()
                || udp
                    .emit(&ip, n, checksummed && ip.len() == 40, rest)
                    .is_err()
            {
                continue;
            }
            return Some((start, HEADROOM + n));
        }
    }

    /// Sends `datagram` (whole, headers included) to port 4791 of `dst`; the kernel makes the
    /// headers again. False if the socket's buffer is full (the packet is lost, and the
    /// transport's retransmission recovers it, as on a congested link).
    pub(crate) fn send(&self, dst: IpAddr, ifindex: u32, datagram: &[u8]) -> bool {
        let skip = match dst {
            IpAddr::V4(_) => 20,
            IpAddr::V6(_) => 40,
        } + UdpRepr::LEN;
        let Some(payload) = datagram.get(skip..) else {
            return false;
        };
        let to = roce_addr(dst, ifindex);
        loop {
            match self.sock.send_to(payload, to) {
                Ok(_) => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
    }
}

/// What the fault injector did, for the counters.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FaultCounts {
    pub(crate) dropped: u64,
    pub(crate) duplicated: u64,
    pub(crate) reordered: u64,
    pub(crate) corrupted: u64,
    pub(crate) delayed: u64,
}

/// Seeded faults on the way out: each datagram is dropped, duplicated, held back behind the
/// next one, or has a byte flipped, at the configured rates; a delay holds every datagram.
pub(crate) struct FaultInjector {
    cfg: Faults,
    rng: SplitMix64,
    held: Option<(IpAddr, Vec<u8>)>,
    delayed: VecDeque<(Time, IpAddr, Vec<u8>)>,
    pub(crate) counts: FaultCounts,
}

impl FaultInjector {
    pub(crate) fn new(cfg: Faults) -> FaultInjector {
        FaultInjector {
            cfg,
            rng: SplitMix64::new(cfg.seed ^ 0x005e_ed0f_fa17),
            held: None,
            delayed: VecDeque::new(),
            counts: FaultCounts::default(),
        }
    }

    pub(crate) fn active(&self) -> bool {
        self.cfg.any()
    }

    /// What leaves now for `datagram` to `dst`: none, one or more datagrams.
    pub(crate) fn apply(
        &mut self,
        now: Time,
        dst: IpAddr,
        datagram: &[u8],
        out: &mut Vec<(IpAddr, Vec<u8>)>,
    ) {
        if self.rng.chance(self.cfg.drop) {
            self.counts.dropped += 1;
            return;
        }
        let mut d = datagram.to_vec();
        if self.rng.chance(self.cfg.corrupt) && d.len() > 48 {
            // A byte of the transport headers or payload (the kernel remakes IP and UDP).
            let skip = if dst.is_ipv4() { 28 } else { 48 };
            let at = skip + self.rng.below((d.len() - skip) as u64) as usize;
            d[at] ^= 1 << self.rng.below(8);
            self.counts.corrupted += 1;
        }
        let mut now_out = Vec::new();
        if self.rng.chance(self.cfg.duplicate) {
            self.counts.duplicated += 1;
            now_out.push((dst, d.clone()));
        }
        if self.held.is_none() && self.rng.chance(self.cfg.reorder) {
            self.counts.reordered += 1;
            self.held = Some((dst, d));
        } else {
            now_out.push((dst, d));
            if let Some(h) = self.held.take() {
                now_out.push(h);
            }
        }
        if self.cfg.delay_us > 0 {
            let at = now.after(std::time::Duration::from_micros(self.cfg.delay_us));
            for (dst, d) in now_out {
                self.counts.delayed += 1;
                self.delayed.push_back((at, dst, d));
            }
        } else {
            out.extend(now_out);
        }
    }

    /// Delayed datagrams whose time came.
    pub(crate) fn due(&mut self, now: Time, out: &mut Vec<(IpAddr, Vec<u8>)>) {
        while self.delayed.front().is_some_and(|(t, ..)| *t <= now) {
            if let Some((_, dst, d)) = self.delayed.pop_front() {
                out.push((dst, d));
            }
        }
    }

    /// When the next delayed datagram is due.
    pub(crate) fn next_due(&self) -> Option<Time> {
        self.delayed.front().map(|(t, ..)| *t)
    }

    /// Whether a datagram is held back for reordering (sent with the next one, or on its
    /// own when the engine would otherwise go to sleep).
    pub(crate) fn release_held(&mut self, out: &mut Vec<(IpAddr, Vec<u8>)>) {
        if let Some(h) = self.held.take() {
            out.push(h);
        }
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
