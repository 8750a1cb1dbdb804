//! A host's RoCEv2 endpoint without I/O: the QPs behind one IP address, the datagrams they
//! exchange, and what is dropped on the way in.
//!
//! Everything that arrives is parsed and its ICRC checked before any QP sees it; it then goes
//! to the QP its BTH names, which takes it only from its peer and within its PSN window.
//! Whatever is refused is counted by reason. The caller moves datagrams and time: a UDP
//! socket and a clock in the NIC, the simulator in tests.

use crate::Time;
use crate::transport::Transmit;
use crate::transport::{Event, Linger, Memory, Qp, QpConfig};
use crate::wire::icrc::IdentDeltas;
use crate::wire::{
    Datagram, Headers, IpRepr, UdpRepr, WireError, emit_datagram, emit_datagram_around,
};
use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;

/// Why datagrams were dropped before reaching a QP, and how much went each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointCounters {
    pub datagrams_received: u64,
    pub datagrams_sent: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    /// The invariant CRC did not match (corrupted on the way, or forged).
    pub icrc_errors: u64,
    /// Not a well-formed RoCEv2 packet (any other parse error).
    pub malformed: u64,
    /// Addressed to another host.
    pub not_ours: u64,
    /// For a QP number this endpoint does not have.
    pub unknown_qp: u64,
    /// Retransmissions to a QP destroyed a moment ago, of messages it had received, that
    /// were acknowledged again (see [`Linger`]).
    pub lingering_acks: u64,
}

/// Destroyed QPs remembered at most: beyond it the oldest are forgotten, so that a program
/// destroying QPs in a loop costs bounded memory.
const MAX_LINGERING: usize = 4096;

/// Adding a QP failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("QP number {0:#x} is taken")]
    QpnTaken(u32),
    #[error("QP number {0:#x} does not fit 24 bits")]
    BadQpn(u32),
}

/// The QPs of one host address, over memory `M`.
pub struct Endpoint<M: Memory> {
    addr: IpAddr,
    /// More addresses of the same host (a RoCE port answers on every address of its GID
    /// table).
    more: Vec<IpAddr>,
    /// Set when the IP and UDP headers are made by a kernel UDP socket bound to this port:
    /// the ICRC must then cover what the kernel sends (this source port, and IPv4
    /// identification 0, which Linux gives don't-fragment datagrams of unconnected sockets).
    kernel_port: Option<u16>,
    qps: BTreeMap<u32, Qp>,
    /// QPs destroyed lately, by number, and their numbers oldest first.
    lingering: BTreeMap<u32, Linger>,
    lingering_order: VecDeque<(u32, Time)>,
    /// Those with an ACK to send.
    lingering_due: VecDeque<u32>,
    /// The host's registered memory, which its QPs reach.
    pub mem: M,
    counters: EndpointCounters,
    /// QP numbers in the order `poll_transmit` asks them next (round robin).
    turn: VecDeque<u32>,
    payload: Vec<u8>,
    events: VecDeque<(u32, Event)>,
    ident: u16,
    /// The ICRC differences of IPv4 identifications a kernel socket hides.
    idents: IdentDeltas,
    /// UD multicast: the IP multicast groups this host joined, and their QPs.
    groups: BTreeMap<IpAddr, Vec<u32>>,
}

/// The destination QP of a UD datagram to a multicast group (IBA 10.8.2).
pub const MULTICAST_QPN: u32 = 0xff_ffff;

impl<M: Memory> Endpoint<M> {
    /// An endpoint at `addr` with no QPs.
    pub fn new(addr: IpAddr, mem: M) -> Endpoint<M> {
        Endpoint {
            addr,
            more: Vec::new(),
            kernel_port: None,
            qps: BTreeMap::new(),
            lingering: BTreeMap::new(),
            lingering_order: VecDeque::new(),
            lingering_due: VecDeque::new(),
            mem,
            counters: EndpointCounters::default(),
            turn: VecDeque::new(),
            payload: vec![0; 4096],
            events: VecDeque::new(),
            ident: 0,
            idents: IdentDeltas::default(),
            groups: BTreeMap::new(),
        }
    }

    /// Attaches UD QP `qpn` to the IP multicast group `group`: datagrams to the group with
    /// the multicast QPN reach it. True if the group had no member here before (the host
    /// must join it on the network).
    pub fn join(&mut self, qpn: u32, group: IpAddr) -> bool {
        let members = self.groups.entry(group).or_default();
        let first = members.is_empty();
        if !members.contains(&qpn) {
            members.push(qpn);
        }
        first
    }

    /// Detaches `qpn` from `group`. True if the group has no member here any more (the host
    /// may leave it).
    pub fn leave(&mut self, qpn: u32, group: IpAddr) -> bool {
        let Some(members) = self.groups.get_mut(&group) else {
            return false;
        };
        members.retain(|&q| q != qpn);
        let last = members.is_empty();
        if last {
            self.groups.remove(&group);
        }
        last
    }

    /// Detaches `qpn` from every group (it is going away); the groups left without a member
    /// here.
    pub fn leave_all(&mut self, qpn: u32) -> Vec<IpAddr> {
        let groups: Vec<IpAddr> = self
            .groups
            .iter()
            .filter(|(_, m)| m.contains(&qpn))
            .map(|(g, _)| *g)
            .collect();
        groups.into_iter().filter(|&g| self.leave(qpn, g)).collect()
    }

    /// The QPs attached to `group` here.
    pub fn members(&self, group: IpAddr) -> &[u32] {
        self.groups.get(&group).map_or(&[], |m| m.as_slice())
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// Makes `addr` an address of this host too.
    pub fn add_addr(&mut self, addr: IpAddr) {
        if addr != self.addr && !self.more.contains(&addr) {
            self.more.push(addr);
        }
    }

    /// Datagrams from now on are sent through a kernel UDP socket bound to `port`, which
    /// writes the IP and UDP headers itself: see the field's doc.
    pub fn use_kernel_headers(&mut self, port: u16) {
        self.kernel_port = Some(port);
    }

    fn is_ours(&self, a: IpAddr) -> bool {
        a == self.addr || self.more.contains(&a)
    }

    /// The address packets to `dst` leave from: of its family, link-local for link-local.
    fn source_for(&self, dst: IpAddr) -> IpAddr {
        let link_local =
            |a: &IpAddr| matches!(a, IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80);
        std::iter::once(self.addr)
            .chain(self.more.iter().copied())
            .filter(|a| a.is_ipv4() == dst.is_ipv4())
            .min_by_key(|a| link_local(a) != link_local(&dst))
            .unwrap_or(self.addr)
    }

    pub fn counters(&self) -> &EndpointCounters {
        &self.counters
    }

    /// Adds a QP in the ready-to-send state.
    pub fn add_qp(&mut self, cfg: QpConfig) -> Result<(), EndpointError> {
        let qpn = cfg.qpn;
        if qpn >> 24 != 0 {
            return Err(EndpointError::BadQpn(qpn));
        }
        if self.qps.contains_key(&qpn) {
            return Err(EndpointError::QpnTaken(qpn));
        }
        self.lingering.remove(&qpn);
        self.qps.insert(qpn, Qp::new(cfg));
        self.turn.push_back(qpn);
        Ok(())
    }

    /// Removes QP `qpn` (destroyed or reset); what it had queued is forgotten.
    pub fn remove_qp(&mut self, qpn: u32) -> Option<Qp> {
        self.turn.retain(|&q| q != qpn);
        self.events.retain(|(q, _)| *q != qpn);
        self.qps.remove(&qpn)
    }

    /// Removes QP `qpn` as `ibv_destroy_qp` does: it goes, and for a while its peer's
    /// retransmissions of what it had received are still acknowledged ([`Linger`]).
    pub fn retire_qp(&mut self, now: Time, qpn: u32) -> Option<Qp> {
        let qp = self.remove_qp(qpn)?;
        while let Some(&(old, until)) = self.lingering_order.front() {
            // An entry of a number that lingers again since is stale: only the newest counts.
            let current = self.lingering.get(&old).is_some_and(|l| l.until() == until);
            let room = self.lingering.len() < MAX_LINGERING
                && self.lingering_order.len() < 2 * MAX_LINGERING;
            if current && until > now && room {
                break;
            }
            self.lingering_order.pop_front();
            if current {
                self.lingering.remove(&old);
            }
        }
        if let Some(l) = qp.linger(now) {
            if l.ack_due() {
                self.lingering_due.push_back(qpn);
            }
            self.lingering_order.push_back((qpn, l.until()));
            self.lingering.insert(qpn, l);
        }
        Some(qp)
    }

    /// Destroyed QPs whose peers' retransmissions are still answered.
    pub fn lingering(&self) -> usize {
        self.lingering.len()
    }

    pub fn qp(&self, qpn: u32) -> Option<&Qp> {
        self.qps.get(&qpn)
    }

    pub fn qp_mut(&mut self, qpn: u32) -> Option<&mut Qp> {
        self.qps.get_mut(&qpn)
    }

    /// Every QP, by number.
    pub fn qps(&self) -> impl Iterator<Item = &Qp> {
        self.qps.values()
    }

    /// A datagram arrived.
    pub fn handle_datagram(&mut self, now: Time, bytes: &[u8]) {
        self.counters.datagrams_received += 1;
        self.counters.bytes_received += bytes.len() as u64;
        match Datagram::parse(bytes) {
            Ok(d) => self.dispatch(now, &d),
            Err(e) => self.count_error(e),
        }
    }

    /// A datagram arrived through a kernel UDP socket, its IP and UDP headers made again by
    /// the receiver ([`use_kernel_headers`](Self::use_kernel_headers)) with IPv4
    /// identification 0, which the socket does not show: the identification that explains
    /// the ICRC, if one of a GSO send's ([`crate::wire::icrc::SEGMENT_IDENTS`]), is written
    /// into `bytes` (so a capture of them afterwards shows the packet as it was sent).
    pub fn handle_received(&mut self, now: Time, bytes: &mut [u8]) {
        self.counters.datagrams_received += 1;
        self.counters.bytes_received += bytes.len() as u64;
        match Datagram::parse_received(bytes, &mut self.idents) {
            Ok(d) => self.dispatch(now, &d),
            Err(e) => self.count_error(e),
        }
    }

    fn count_error(&mut self, e: WireError) {
        match e {
            WireError::Icrc { .. } => self.counters.icrc_errors += 1,
            _ => self.counters.malformed += 1,
        }
    }

    fn dispatch(&mut self, now: Time, d: &Datagram<'_>) {
        if let Some(members) = self.groups.get(&d.ip.dst()) {
            // A group's datagram is a copy for each member (a UD QP checks its Q_Key).
            if d.headers.bth.dest_qp != MULTICAST_QPN {
                self.counters.not_ours += 1;
                return;
            }
            for qpn in members.clone() {
                if let Some(qp) = self
                    .qps
                    .get_mut(&qpn)
                    .filter(|q| q.config().qp_type == crate::transport::QpType::Ud)
                {
                    qp.handle_packet(now, &mut self.mem, d);
                    Self::drain_events(qp, &mut self.events);
                }
            }
            return;
        }
        if !self.is_ours(d.ip.dst()) {
            self.counters.not_ours += 1;
            return;
        }
        let Some(qp) = self.qps.get_mut(&d.headers.bth.dest_qp) else {
            let qpn = d.headers.bth.dest_qp;
            match self.lingering.get_mut(&qpn) {
                Some(l) => {
                    let was_due = l.ack_due();
                    if l.handle_packet(now, d) {
                        self.counters.lingering_acks += 1;
                        if !was_due {
                            self.lingering_due.push_back(qpn);
                        }
                    } else {
                        self.counters.unknown_qp += 1;
                    }
                }
                None => self.counters.unknown_qp += 1,
            }
            return;
        };
        qp.handle_packet(now, &mut self.mem, d);
        Self::drain_events(qp, &mut self.events);
    }

    /// The next datagram to send, written into `buf`: its destination and length.
    pub fn poll_transmit(&mut self, now: Time, buf: &mut [u8]) -> Option<(IpAddr, usize)> {
        let mut payload = std::mem::take(&mut self.payload);
        let mut sent = None;
        while let Some(t) = self.next_transmit(now, &mut payload) {
            let Some(ip) = self.ip_for(t.dst) else {
                continue;
            };
            let port = self.kernel_port.unwrap_or(t.src_port);
            // A buffer that cannot hold a packet of our MTU is a bug of the caller's: the
            // packet is lost and retransmission covers it.
            if let Ok(n) = emit_datagram(&ip, port, &t.headers, &payload[..t.payload_len], buf) {
                sent = Some((t.dst, 0..n));
                break;
            }
        }
        self.payload = payload;
        self.count_sent(sent).map(|(dst, r)| (dst, r.end))
    }

    /// Room [`poll_transmit_at`](Self::poll_transmit_at) leaves in front of a payload for the
    /// headers: an IPv6 header, UDP and the longest transport headers.
    pub const HEADROOM: usize = 40 + UdpRepr::LEN + Headers::MAX_LEN;

    /// As [`poll_transmit`](Self::poll_transmit), with the payload gathered straight into
    /// `buf` (at [`HEADROOM`](Self::HEADROOM)) and the headers written in front of it: the
    /// datagram's destination and where it lies in `buf`, which must hold `HEADROOM` bytes
    /// and the largest packet.
    pub fn poll_transmit_at(
        &mut self,
        now: Time,
        buf: &mut [u8],
    ) -> Option<(IpAddr, std::ops::Range<usize>)> {
        let mut sent = None;
        while buf.len() > Self::HEADROOM {
            let Some(t) = self.next_transmit(now, &mut buf[Self::HEADROOM..]) else {
                break;
            };
            let Some(ip) = self.ip_for(t.dst) else {
                continue;
            };
            let port = self.kernel_port.unwrap_or(t.src_port);
            if let Ok(r) =
                emit_datagram_around(&ip, port, &t.headers, buf, Self::HEADROOM, t.payload_len)
            {
                sent = Some((t.dst, r));
                break;
            }
        }
        self.count_sent(sent)
    }

    fn count_sent(
        &mut self,
        sent: Option<(IpAddr, std::ops::Range<usize>)>,
    ) -> Option<(IpAddr, std::ops::Range<usize>)> {
        if let Some((_, r)) = &sent {
            self.counters.datagrams_sent += 1;
            self.counters.bytes_sent += r.len() as u64;
        }
        sent
    }

    /// The IP header of a datagram to `dst` (from an address of its family: see
    /// `next_transmit`).
    fn ip_for(&mut self, dst: IpAddr) -> Option<IpRepr> {
        let mut ip = IpRepr::between(self.source_for(dst), dst)?;
        self.ident = self.ident.wrapping_add(1);
        if let IpRepr::V4(h) = &mut ip {
            h.ident = if self.kernel_port.is_some() {
                0
            } else {
                self.ident
            };
        }
        Some(ip)
    }

    /// The next packet of a QP's (or of a lingering QP's), its payload written into `payload`.
    fn next_transmit(&mut self, now: Time, payload: &mut [u8]) -> Option<Transmit> {
        while let Some(q) = self.lingering_due.pop_front() {
            if let Some(t) = self.lingering.get_mut(&q).and_then(Linger::poll_transmit) {
                return Some(t);
            }
        }
        for _ in 0..self.turn.len() {
            let qpn = self.turn.pop_front()?;
            self.turn.push_back(qpn);
            let Some(qp) = self.qps.get_mut(&qpn) else {
                continue;
            };
            let t = qp.poll_transmit(now, &self.mem, payload);
            Self::drain_events(qp, &mut self.events);
            if let Some(t) = t {
                return Some(t);
            }
        }
        None
    }

    pub fn handle_timeout(&mut self, now: Time) {
        for qp in self.qps.values_mut() {
            if qp.poll_timeout().is_some_and(|t| t <= now) {
                qp.handle_timeout(now);
                Self::drain_events(qp, &mut self.events);
            }
        }
    }

    pub fn poll_timeout(&self) -> Option<Time> {
        self.qps.values().filter_map(Qp::poll_timeout).min()
    }

    /// Completions and errors queued and not yet taken with [`poll_event`](Self::poll_event).
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    /// The next completion or error of any QP, with the QP's number.
    pub fn poll_event(&mut self) -> Option<(u32, Event)> {
        self.events.pop_front()
    }

    /// Posts to QP `qpn` (events it raises at once, such as flushes, are queued).
    pub fn with_qp<R>(&mut self, qpn: u32, f: impl FnOnce(&mut Qp) -> R) -> Option<R> {
        let qp = self.qps.get_mut(&qpn)?;
        let r = f(qp);
        Self::drain_events(qp, &mut self.events);
        Some(r)
    }

    fn drain_events(qp: &mut Qp, out: &mut VecDeque<(u32, Event)>) {
        let qpn = qp.qpn();
        while let Some(e) = qp.poll_event() {
            out.push_back((qpn, e));
        }
    }
}

/// An endpoint is a host of the simulator.
impl<M: Memory> crate::sim::Node for Endpoint<M> {
    fn handle_datagram(&mut self, now: Time, datagram: &[u8]) {
        Endpoint::handle_datagram(self, now, datagram);
    }
    /// Through [`Endpoint::poll_transmit_at`], the engine's way (the payload gathered in
    /// place), so that every simulated run checks it.
    fn poll_transmit(&mut self, now: Time, buf: &mut [u8]) -> Option<crate::sim::Transmit> {
        let (dst, r) = Endpoint::poll_transmit_at(self, now, buf)?;
        let len = r.len();
        buf.copy_within(r, 0);
        Some(crate::sim::Transmit { len, dst })
    }
    fn handle_timeout(&mut self, now: Time) {
        Endpoint::handle_timeout(self, now);
    }
    fn poll_timeout(&self) -> Option<Time> {
        Endpoint::poll_timeout(self)
    }
}
