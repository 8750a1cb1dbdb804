//! Whole packets: the transport headers one opcode calls for, and the IP/UDP datagram around
//! them with its ICRC.

use super::{
    Aeth, AtomicAckEth, AtomicEth, Bth, Deth, ICRC_LEN, IpRepr, Ipv4Repr, ROCE_PORT, Reth,
    Transport, UdpRepr, WireError, be32, icrc, room, take,
};

/// The transport headers of one packet: the BTH and the extension headers its opcode calls
/// for (exactly those: [`check`](Self::check)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers {
    pub bth: Bth,
    pub deth: Option<Deth>,
    pub reth: Option<Reth>,
    pub atomic_eth: Option<AtomicEth>,
    pub aeth: Option<Aeth>,
    pub atomic_ack_eth: Option<AtomicAckEth>,
    /// Immediate data (ImmDt), as the sender gave it.
    pub imm: Option<u32>,
    /// The R_Key to invalidate (IETH).
    pub ieth: Option<u32>,
    /// A FLUSH's FETH: placement type in bits 3..0, selectivity in bits 5..4.
    pub feth: Option<u32>,
    /// An XRC request's XRCETH: the XRC SRQ number (24 bits).
    pub xrceth: Option<u32>,
}

impl Headers {
    /// Just the BTH; add the extension headers its opcode needs.
    pub fn new(bth: Bth) -> Headers {
        Headers {
            bth,
            deth: None,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            imm: None,
            ieth: None,
            feth: None,
            xrceth: None,
        }
    }

    /// Bytes of headers (BTH and extensions).
    pub fn len(&self) -> usize {
        Bth::LEN
            + self.deth.map_or(0, |_| Deth::LEN)
            + self.reth.map_or(0, |_| Reth::LEN)
            + self.atomic_eth.map_or(0, |_| AtomicEth::LEN)
            + self.aeth.map_or(0, |_| Aeth::LEN)
            + self.atomic_ack_eth.map_or(0, |_| AtomicAckEth::LEN)
            + self.imm.map_or(0, |_| 4)
            + self.ieth.map_or(0, |_| 4)
            + self.feth.map_or(0, |_| 4)
            + self.xrceth.map_or(0, |_| 4)
    }

    /// Always false: there is a BTH.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// True for an XRC request, which names its SRQ in an XRCETH right after the BTH.
    fn needs_xrceth(&self) -> bool {
        self.bth.opcode.transport == Transport::Xrc && self.bth.opcode.op.is_request()
    }

    /// Checks that exactly the extension headers the opcode calls for are present.
    pub fn check(&self) -> Result<(), WireError> {
        let op = self.bth.opcode.op;
        let ud = self.bth.opcode.transport == Transport::Ud;
        let want = [
            (self.deth.is_some(), ud, "DETH"),
            (self.reth.is_some(), op.has_reth(), "RETH"),
            (self.atomic_eth.is_some(), op.is_atomic(), "AtomicETH"),
            (self.aeth.is_some(), op.has_aeth(), "AETH"),
            (
                self.atomic_ack_eth.is_some(),
                op == super::Op::AtomicAck,
                "AtomicAckETH",
            ),
            (self.imm.is_some(), op.has_imm(), "ImmDt"),
            (self.ieth.is_some(), op.has_ieth(), "IETH"),
            (self.feth.is_some(), op.has_feth(), "FETH"),
            (self.xrceth.is_some(), self.needs_xrceth(), "XRCETH"),
        ];
        match want.iter().find(|(have, need, _)| have != need) {
            Some((_, _, name)) => Err(WireError::HeaderMismatch(name)),
            None => Ok(()),
        }
    }

    /// Parses the transport part of a packet, BTH to the end of the pad (the ICRC already
    /// taken off): the headers and the payload without its pad.
    pub fn parse(bytes: &[u8]) -> Result<(Headers, &[u8]), WireError> {
        let bth = Bth::parse(bytes)?;
        let op = bth.opcode.op;
        let mut h = Headers::new(bth);
        let mut at = Bth::LEN;
        let mut next = |n: usize, what: &'static str| -> Result<&[u8], WireError> {
            let b = take(bytes, at, n, what)?;
            at += n;
            Ok(b)
        };
        if bth.opcode.transport == Transport::Ud {
            h.deth = Some(Deth::parse(next(Deth::LEN, "DETH")?)?);
        }
        if h.needs_xrceth() {
            h.xrceth = Some(be32(next(4, "XRCETH")?) & 0xff_ffff);
        }
        // A FLUSH's FETH comes before its RETH (IBTA 1.5, soft-RoCE's header offsets).
        if op.has_feth() {
            h.feth = Some(be32(next(4, "FETH")?));
        }
        if op.has_reth() {
            h.reth = Some(Reth::parse(next(Reth::LEN, "RETH")?)?);
        }
        if op.is_atomic() {
            h.atomic_eth = Some(AtomicEth::parse(next(AtomicEth::LEN, "AtomicETH")?)?);
        }
        if op.has_aeth() {
            h.aeth = Some(Aeth::parse(next(Aeth::LEN, "AETH")?)?);
        }
        if op == super::Op::AtomicAck {
            h.atomic_ack_eth = Some(AtomicAckEth::parse(next(
                AtomicAckEth::LEN,
                "AtomicAckETH",
            )?)?);
        }
        if op.has_imm() {
            h.imm = Some(be32(next(4, "ImmDt")?));
        }
        if op.has_ieth() {
            h.ieth = Some(be32(next(4, "IETH")?));
        }
        let rest = &bytes[at..];
        if rest.len() % 4 != 0 {
            return Err(WireError::Unaligned(rest.len()));
        }
        let pad = usize::from(bth.pad);
        if !op.has_payload() && (!rest.is_empty() || pad != 0) {
            return Err(WireError::UnexpectedPayload {
                opcode: bth.opcode.to_u8(),
                len: rest.len(),
            });
        }
        if pad > rest.len() {
            return Err(WireError::Pad {
                pad: bth.pad,
                len: rest.len(),
            });
        }
        Ok((h, &rest[..rest.len() - pad]))
    }

    /// The most bytes of headers any opcode has (a bound, for room left in front of a
    /// payload written before its headers: see [`emit_datagram_around`]).
    pub const MAX_LEN: usize = 128;

    /// Emits the headers, `payload` and its pad into `buf` (the BTH's pad count is set from
    /// the payload's length); returns the bytes written.
    pub fn emit(&self, payload: &[u8], buf: &mut [u8]) -> Result<usize, WireError> {
        let at = self.emit_head(payload.len(), buf)?;
        let pad = (4 - payload.len() % 4) % 4;
        let b = room(buf, at, payload.len() + pad)?;
        b[..payload.len()].copy_from_slice(payload);
        b[payload.len()..].fill(0);
        Ok(at + payload.len() + pad)
    }

    /// Emits the headers alone, for `payload_len` bytes of payload to follow them (the
    /// BTH's pad count is set from it); returns the bytes written.
    pub fn emit_head(&self, payload_len: usize, buf: &mut [u8]) -> Result<usize, WireError> {
        self.check()?;
        if !self.bth.opcode.op.has_payload() && payload_len != 0 {
            return Err(WireError::UnexpectedPayload {
                opcode: self.bth.opcode.to_u8(),
                len: payload_len,
            });
        }
        let pad = (4 - payload_len % 4) % 4;
        let b = room(buf, 0, self.len())?;
        let mut bth = self.bth;
        bth.pad = pad as u8;
        let mut at = bth.emit(b)?;
        if let Some(x) = self.deth {
            at += x.emit(&mut b[at..])?;
        }
        if let Some(x) = self.xrceth {
            b[at..at + 4].copy_from_slice(&(x & 0xff_ffff).to_be_bytes());
            at += 4;
        }
        if let Some(x) = self.feth {
            b[at..at + 4].copy_from_slice(&x.to_be_bytes());
            at += 4;
        }
        if let Some(x) = self.reth {
            at += x.emit(&mut b[at..])?;
        }
        if let Some(x) = self.atomic_eth {
            at += x.emit(&mut b[at..])?;
        }
        if let Some(x) = self.aeth {
            at += x.emit(&mut b[at..])?;
        }
        if let Some(x) = self.atomic_ack_eth {
            at += x.emit(&mut b[at..])?;
        }
        for word in [self.imm, self.ieth].into_iter().flatten() {
            b[at..at + 4].copy_from_slice(&word.to_be_bytes());
            at += 4;
        }
        Ok(at)
    }
}

/// A whole RoCEv2 packet, parsed: IP header to ICRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Datagram<'a> {
    pub ip: IpRepr,
    /// The IP header's bytes as they arrived (a UD receive places them in its GRH room).
    pub ip_header: &'a [u8],
    pub udp: UdpRepr,
    pub headers: Headers,
    /// The payload, without its pad.
    pub payload: &'a [u8],
}

/// A datagram cut at its parts: IP header, UDP, transport (BTH to pad), and the ICRC that
/// arrived.
struct Parts<'a> {
    ip: IpRepr,
    ip_header: &'a [u8],
    udp: UdpRepr,
    udp_header: &'a [u8],
    transport: &'a [u8],
    icrc: u32,
}

impl<'a> Parts<'a> {
    fn cut(bytes: &'a [u8]) -> Result<Parts<'a>, WireError> {
        let (ip, ip_header, ip_payload) = IpRepr::parse(bytes)?;
        let (udp, udp_payload) = UdpRepr::parse(&ip, ip_payload)?;
        if udp.dst_port != ROCE_PORT {
            return Err(WireError::NotRoce(udp.dst_port));
        }
        let n = udp_payload.len();
        if n < Bth::LEN + ICRC_LEN {
            return Err(WireError::Truncated {
                what: "BTH and ICRC",
                need: Bth::LEN + ICRC_LEN,
                have: n,
            });
        }
        let (transport, crc) = udp_payload.split_at(n - ICRC_LEN);
        Ok(Parts {
            ip,
            ip_header,
            udp,
            udp_header: &ip_payload[..UdpRepr::LEN],
            transport,
            icrc: u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]),
        })
    }

    fn computed_icrc(&self) -> u32 {
        icrc::compute(self.ip_header, self.udp_header, self.transport)
    }

    /// The datagram, its ICRC taken as checked.
    fn datagram(self) -> Result<Datagram<'a>, WireError> {
        let (headers, payload) = Headers::parse(self.transport)?;
        Ok(Datagram {
            ip: self.ip,
            ip_header: self.ip_header,
            udp: self.udp,
            headers,
            payload,
        })
    }
}

impl<'a> Datagram<'a> {
    /// Parses and checks a datagram: IP and UDP (to port 4791), the transport headers, and
    /// the ICRC.
    pub fn parse(bytes: &'a [u8]) -> Result<Datagram<'a>, WireError> {
        let parts = Parts::cut(bytes)?;
        let computed = parts.computed_icrc();
        if parts.icrc != computed {
            return Err(WireError::Icrc {
                got: parts.icrc,
                computed,
            });
        }
        parts.datagram()
    }

    /// Parses a datagram whose IPv4 identification its receiver could not see, written as
    /// 0 (a kernel UDP socket shows neither it nor the rest of the IP header): as
    /// [`parse`](Self::parse), except that an identification below
    /// [`icrc::SEGMENT_IDENTS`] that explains the ICRC is written into the header (the
    /// segments of a GSO send carry 0, 1, 2, …). IPv6 datagrams have no identification.
    pub fn parse_received(
        bytes: &'a mut [u8],
        deltas: &mut icrc::IdentDeltas,
    ) -> Result<Datagram<'a>, WireError> {
        // Cut and checked through a short borrow; the datagram is then made from where the
        // parts lie (whether or not an identification was written in between).
        let (mut ip, ip_len, udp, transport_len) = {
            let parts = Parts::cut(bytes)?;
            let computed = parts.computed_icrc();
            let mut ip = parts.ip;
            if parts.icrc != computed {
                let len = parts.ip_header.len() + UdpRepr::LEN + parts.transport.len() + ICRC_LEN;
                let recovered = match &mut ip {
                    IpRepr::V4(h) if h.ident == 0 => deltas
                        .recover(len, parts.icrc ^ computed)
                        .inspect(|&i| h.ident = i),
                    _ => None,
                };
                if recovered.is_none() {
                    return Err(WireError::Icrc {
                        got: parts.icrc,
                        computed,
                    });
                }
            }
            (ip, parts.ip_header.len(), parts.udp, parts.transport.len())
        };
        if let IpRepr::V4(h) = &mut ip
            && h.ident != 0
        {
            Ipv4Repr::set_ident(bytes, h.ident);
        }
        let at = ip_len + UdpRepr::LEN;
        let (headers, payload) = Headers::parse(&bytes[at..at + transport_len])?;
        Ok(Datagram {
            ip,
            ip_header: &bytes[..ip_len],
            udp,
            headers,
            payload,
        })
    }
}

/// Emits a whole packet into `buf`: `ip` (its lengths and checksum filled in), UDP from
/// `src_port` to 4791 (checksummed over IPv6, where a zero checksum is not allowed; zero over
/// IPv4, as RoCEv2 senders do), `headers`, `payload` with its pad, and the ICRC. Returns the
/// datagram's length.
pub fn emit_datagram(
    ip: &IpRepr,
    src_port: u16,
    headers: &Headers,
    payload: &[u8],
    buf: &mut [u8],
) -> Result<usize, WireError> {
    let at = ip.len() + UdpRepr::LEN + headers.len();
    room(buf, at, payload.len())?.copy_from_slice(payload);
    let r = emit_datagram_around(ip, src_port, headers, buf, at, payload.len())?;
    debug_assert_eq!(r.start, 0);
    Ok(r.end)
}

/// Emits a whole packet around the `payload_len` bytes of payload already at
/// `buf[payload_at..]` (so a payload gathered in place is not copied again): the IP, UDP and
/// transport headers end at `payload_at`, the pad and the ICRC follow the payload, as
/// [`emit_datagram`] writes them. Returns where the datagram lies in `buf`.
pub fn emit_datagram_around(
    ip: &IpRepr,
    src_port: u16,
    headers: &Headers,
    buf: &mut [u8],
    payload_at: usize,
    payload_len: usize,
) -> Result<std::ops::Range<usize>, WireError> {
    let ip_len = ip.len();
    let start = payload_at
        .checked_sub(ip_len + UdpRepr::LEN + headers.len())
        .ok_or(WireError::Truncated {
            what: "room before the payload",
            need: ip_len + UdpRepr::LEN + headers.len(),
            have: payload_at,
        })?;
    let pad = (4 - payload_len % 4) % 4;
    let transport_len = headers.len() + payload_len + pad;
    let udp_len = UdpRepr::LEN + transport_len + ICRC_LEN;
    let b = room(buf, start, ip_len + udp_len)?;
    ip.emit(udp_len, b)?;
    let at = ip_len + UdpRepr::LEN;
    headers.emit_head(payload_len, &mut b[at..])?;
    b[at + headers.len() + payload_len..at + transport_len].fill(0);
    let udp = UdpRepr {
        src_port,
        dst_port: ROCE_PORT,
    };
    let (head, rest) = b.split_at_mut(ip_len);
    udp.emit(ip, udp_len - UdpRepr::LEN, false, rest)?;
    let crc = icrc::compute(
        head,
        &rest[..UdpRepr::LEN],
        &rest[UdpRepr::LEN..UdpRepr::LEN + transport_len],
    );
    rest[udp_len - ICRC_LEN..udp_len].copy_from_slice(&crc.to_le_bytes());
    if matches!(ip, IpRepr::V6(_)) {
        udp.emit(ip, udp_len - UdpRepr::LEN, true, rest)?;
    }
    Ok(start..start + ip_len + udp_len)
}

#[cfg(test)]
mod tests;
