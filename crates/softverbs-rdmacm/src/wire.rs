//! How CM agents, listeners and host engines meet: abstract unix datagram sockets of the
//! network namespace (so each namespace is a host, as for the engine), and the envelope a
//! MAD travels in between them.
//!
//! - `softverbs-cm/agent/<id>`: a process's agent; `<id>` (5 hex digits) is the upper 20
//!   bits of every communication ID it hands out, so a reply finds its way by comm ID.
//! - `softverbs-cm/svc/<service id>` (16 hex digits): a bound or listening id's port; REQ
//!   and SIDR_REQ go there. Binding it is what makes a port busy host-wide.
//! - `softverbs-engine/<ip>/cm`: the host engine of address `<ip>`, which sends MADs for
//!   other hosts from QP1 and delivers the ones that arrive to the sockets above.
//!
//! The envelope: `b"SVCM"`, version 1, flags (bit 0: came from the network), two zero
//! bytes, the source GID, the destination GID, the source QPN (big-endian), four zero bytes,
//! then the 256-byte MAD.

use crate::mad::MAD_LEN;
use core::ffi::c_int;
use std::io::ErrorKind;
use std::net::IpAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

pub const ENVELOPE_LEN: usize = 48 + MAD_LEN;

/// Where a MAD goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// The listener of a service ID.
    Service(u64),
    /// The agent whose comm IDs carry these upper 20 bits.
    Agent(u32),
}

impl Dest {
    fn name(self) -> String {
        match self {
            Dest::Service(s) => format!("softverbs-cm/svc/{s:016x}"),
            Dest::Agent(a) => format!("softverbs-cm/agent/{a:05x}"),
        }
    }
}

/// Envelope flag: the MAD came from the network (set by an engine only).
pub const FROM_NETWORK: u8 = 0x01;
/// Envelope flag, to an engine: keep this DREQ and send it if the sending process dies
/// (the kernel's CM sends one when a process dies; ours dies with the process).
pub const LEASE: u8 = 0x02;
/// Envelope flag, to an engine: forget the lease with this DREQ's local comm ID.
pub const CANCEL: u8 = 0x04;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope {
    /// [`FROM_NETWORK`], [`LEASE`], [`CANCEL`].
    pub flags: u8,
    pub sgid: [u8; 16],
    pub dgid: [u8; 16],
    pub src_qpn: u32,
    pub mad: [u8; MAD_LEN],
}

impl Envelope {
    pub fn emit(&self) -> [u8; ENVELOPE_LEN] {
        let mut b = [0u8; ENVELOPE_LEN];
        b[..4].copy_from_slice(b"SVCM");
        b[4] = 1;
        b[5] = self.flags;
        b[8..24].copy_from_slice(&self.sgid);
        b[24..40].copy_from_slice(&self.dgid);
        b[40..44].copy_from_slice(&self.src_qpn.to_be_bytes());
        b[48..].copy_from_slice(&self.mad);
        b
    }

    pub fn parse(b: &[u8]) -> Option<Envelope> {
        if b.len() != ENVELOPE_LEN || &b[..4] != b"SVCM" || b[4] != 1 {
            return None;
        }
        Some(Envelope {
            flags: b[5],
            sgid: b[8..24].try_into().ok()?,
            dgid: b[24..40].try_into().ok()?,
            src_qpn: u32::from_be_bytes(b[40..44].try_into().ok()?),
            mad: b[48..].try_into().ok()?,
        })
    }
}

fn abstract_addr(name: &str) -> Option<SocketAddr> {
    SocketAddr::from_abstract_name(name.as_bytes()).ok()
}

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom into a 4-byte buffer.
    let _ = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    u32::from_ne_bytes(b)
}

fn bound(name: &str) -> std::io::Result<UnixDatagram> {
    let addr = abstract_addr(name).ok_or(ErrorKind::InvalidInput)?;
    let s = UnixDatagram::bind_addr(&addr)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// This process's agent socket, under a random free agent ID (non-blocking).
pub fn bind_agent() -> Option<(u32, UnixDatagram)> {
    for _ in 0..64 {
        // Agent 0 is never used, so a zero comm ID (an unanswered REJ's) names no agent.
        let a = (random_u32() & 0xf_ffff).max(1);
        if let Ok(s) = bound(&Dest::Agent(a).name()) {
            return Some((a, s));
        }
    }
    None
}

/// Binds port `port` of port space `ps` host-wide (0: a free one); the port and its socket.
pub fn bind_port(ps: c_int, port: u16) -> Result<(u16, UnixDatagram), c_int> {
    let sid = |p: u16| (u64::from(ps as u32 & 0xffff) << 16) | u64::from(p);
    if port != 0 {
        return match bound(&Dest::Service(sid(port)).name()) {
            Ok(s) => Ok((port, s)),
            Err(e) if e.kind() == ErrorKind::AddrInUse => Err(libc::EADDRINUSE),
            Err(e) => Err(e.raw_os_error().unwrap_or(libc::EINVAL)),
        };
    }
    for _ in 0..256 {
        let p = 32768 + (random_u32() % 28232) as u16;
        if let Ok(s) = bound(&Dest::Service(sid(p)).name()) {
            return Ok((p, s));
        }
    }
    Err(libc::EADDRINUSE)
}

/// What became of a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    Done,
    /// The receiver's queue is full (a unix datagram queue holds only
    /// `net.unix.max_dgram_qlen`, 10, datagrams): try again soon.
    Busy,
    /// Nobody is bound there.
    Nobody,
}

fn send_to(sock: &UnixDatagram, name: &str, bytes: &[u8]) -> Sent {
    let Some(addr) = abstract_addr(name) else {
        return Sent::Nobody;
    };
    match sock.send_to_addr(bytes, &addr) {
        Ok(_) => Sent::Done,
        Err(e) if e.kind() == ErrorKind::WouldBlock => Sent::Busy,
        Err(_) => Sent::Nobody,
    }
}

/// The socket name of `dest` on this host.
pub fn local_name(dest: Dest) -> String {
    dest.name()
}

/// The socket name of the host engine of `src`, which carries MADs to other hosts.
pub fn engine_name(src: IpAddr) -> String {
    format!("softverbs-engine/{src}/cm")
}

/// Sends `bytes` to socket `name`.
pub fn send_named(sock: &UnixDatagram, name: &str, bytes: &[u8]) -> Sent {
    send_to(sock, name, bytes)
}

/// True while agent `a` of this host still has its socket (an empty datagram, ignored).
pub fn agent_alive(sock: &UnixDatagram, a: u32) -> bool {
    send_to(sock, &Dest::Agent(a).name(), &[]) != Sent::Nobody
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_refuse_garbage() {
        let e = Envelope {
            flags: FROM_NETWORK,
            sgid: [1; 16],
            dgid: [2; 16],
            src_qpn: 1,
            mad: [3; MAD_LEN],
        };
        let b = e.emit();
        assert_eq!(&b[..6], b"SVCM\x01\x01");
        assert_eq!(Envelope::parse(&b), Some(e));
        assert_eq!(Envelope::parse(&b[..100]), None);
        let mut bad = b;
        bad[4] = 2;
        assert_eq!(Envelope::parse(&bad), None);
    }

    #[test]
    fn a_port_is_busy_until_its_socket_closes() {
        let (p, s) = bind_port(0x0106, 0).unwrap();
        assert_eq!(bind_port(0x0106, p).err(), Some(libc::EADDRINUSE));
        // Another port space is another port.
        let other = bind_port(0x0111, p).unwrap();
        drop(s);
        let again = bind_port(0x0106, p).unwrap();
        drop((other, again));
    }

    #[test]
    fn agents_are_seen_alive_and_gone() {
        let (a, s) = bind_agent().unwrap();
        let (_b, me) = bind_agent().unwrap();
        assert!(agent_alive(&me, a));
        drop(s);
        assert!(!agent_alive(&me, a));
    }
}
