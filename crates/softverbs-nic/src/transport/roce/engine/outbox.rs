//! Datagrams on their way out, back to back in one buffer, and how they leave: runs of
//! datagrams to one destination with one length go as one UDP GSO send.
//!
//! The transport core writes each packet straight into the outbox (no allocation per
//! packet); the fault injector may drop, copy, corrupt or hold back the last one. When the
//! engine sends, consecutive datagrams with the same source socket, destination and length
//! (the last of a run may be shorter) are handed to the kernel in one `sendmsg` with
//! `UDP_SEGMENT`, which cuts them apart again: one system call and one pass through the
//! stack for up to [`MAX_SEGMENTS`] packets, instead of one each.
//!
//! The kernel numbers the IPv4 identification of a GSO send's segments 0, 1, 2, … (see
//! [`IdentDeltas`]); the ICRC covers it, so before a run leaves, segment `k`'s ICRC is
//! patched for identification `k` (and, for the capture, its IP header too).

use super::io::{Capture, Socket};
use softverbs_roce::wire::icrc::IdentDeltas;
use softverbs_roce::wire::{ICRC_LEN, Ipv4Repr, UdpRepr};
use std::net::IpAddr;

/// Bytes of datagrams the outbox holds before it must be sent: room for a burst of full
/// packets of the largest MTU.
const CAPACITY: usize = 512 << 10;
/// The room the core needs to write a datagram in place: the largest datagram (IPv6, UDP,
/// 4096 bytes of payload and the headers around it) after the headroom it leaves in front
/// of a payload ([`Endpoint::poll_transmit_at`]).
///
/// [`Endpoint::poll_transmit_at`]: softverbs_roce::endpoint::Endpoint::poll_transmit_at
pub(crate) const MAX_DATAGRAM: usize = 4096 + 256 + 256;
/// Segments in one GSO send at most (the kernel allows 64, or 128 from Linux 5.x on).
pub(crate) const MAX_SEGMENTS: usize = 64;
/// UDP payload bytes of one GSO send at most: an IP datagram's 65,535 less the IPv4 and UDP
/// headers (IPv6's payload length does not count its header, but one limit keeps it
/// simple).
const MAX_GSO_PAYLOAD: usize = 65_535 - 20 - UdpRepr::LEN;

/// A datagram in the outbox.
#[derive(Debug, Clone, Copy)]
struct Item {
    dst: IpAddr,
    at: usize,
    len: usize,
}

/// Datagrams waiting to leave, whole (IP and UDP headers included, as the core emits them;
/// the kernel writes them again).
pub(crate) struct Outbox {
    buf: Vec<u8>,
    used: usize,
    items: Vec<Item>,
    idents: IdentDeltas,
}

/// What a send did, for the counters.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Sent {
    pub(crate) failures: u64,
    /// System calls that carried more than one datagram, and the datagrams they carried.
    pub(crate) gso_sends: u64,
    pub(crate) gso_datagrams: u64,
}

impl Outbox {
    pub(crate) fn new() -> Outbox {
        Outbox {
            buf: vec![0; CAPACITY],
            used: 0,
            items: Vec::with_capacity(CAPACITY / 1024),
            idents: IdentDeltas::default(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// True if a datagram of [`MAX_DATAGRAM`] bytes still fits.
    pub(crate) fn has_room(&self) -> bool {
        CAPACITY - self.used >= MAX_DATAGRAM
    }

    /// Where the next datagram is written (at least [`MAX_DATAGRAM`] bytes when
    /// [`has_room`](Self::has_room)); [`commit`](Self::commit) it then.
    pub(crate) fn spare(&mut self) -> &mut [u8] {
        &mut self.buf[self.used..]
    }

    /// The `len` bytes written at [`spare`](Self::spare) are a datagram to `dst`.
    pub(crate) fn commit(&mut self, dst: IpAddr, len: usize) {
        self.commit_range(dst, 0..len);
    }

    /// The bytes `r` of [`spare`](Self::spare) are a datagram to `dst` (those before it are
    /// left unused).
    pub(crate) fn commit_range(&mut self, dst: IpAddr, r: std::ops::Range<usize>) {
        let end = r.end.min(CAPACITY - self.used);
        let start = r.start.min(end);
        self.items.push(Item {
            dst,
            at: self.used + start,
            len: end - start,
        });
        self.used += end;
    }

    /// Adds a copy of `datagram`; false if it does not fit (send first).
    pub(crate) fn push(&mut self, dst: IpAddr, datagram: &[u8]) -> bool {
        let Some(room) = self.buf.get_mut(self.used..self.used + datagram.len()) else {
            return false;
        };
        room.copy_from_slice(datagram);
        self.commit(dst, datagram.len());
        true
    }

    /// The last datagram added.
    pub(crate) fn last_mut(&mut self) -> Option<(IpAddr, &mut [u8])> {
        let it = *self.items.last()?;
        Some((it.dst, &mut self.buf[it.at..it.at + it.len]))
    }

    /// Takes the last datagram added out (to hold it back).
    pub(crate) fn pop(&mut self) -> Option<(IpAddr, Vec<u8>)> {
        let it = self.items.pop()?;
        let bytes = self.buf[it.at..it.at + it.len].to_vec();
        self.used = self.items.last().map_or(0, |p| p.at + p.len);
        Some((it.dst, bytes))
    }

    /// Datagrams waiting.
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    /// Sends every datagram, in order, each from the socket of the address it says it is from
    /// (the ICRC covers it, and a link-local socket must not send what a global address
    /// signed), runs as GSO sends where the socket can; records each in `capture` as it
    /// leaves. The outbox is empty afterwards.
    pub(crate) fn send(
        &mut self,
        socks: &mut [Socket],
        ifindex: u32,
        mut capture: Option<&mut Capture>,
    ) -> Sent {
        let mut sent = Sent::default();
        let mut i = 0;
        while i < self.items.len() {
            let first = self.items[i];
            let d = &self.buf[first.at..first.at + first.len];
            let src = datagram_source(d);
            let Some(s) = socks.iter().position(|s| Some(s.addr) == src).or_else(|| {
                socks
                    .iter()
                    .position(|s| s.addr.is_ipv4() == first.dst.is_ipv4())
            }) else {
                sent.failures += 1;
                i += 1;
                continue;
            };
            let run = if socks[s].gso() {
                self.run_from(i, src)
            } else {
                1
            };
            if run > 1 {
                self.sign_segments(i, run);
            }
            if let Some(c) = capture.as_deref_mut() {
                for it in &self.items[i..i + run] {
                    c.record(&self.buf[it.at..it.at + it.len]);
                }
            }
            let mut datagrams: [&[u8]; MAX_SEGMENTS] = [&[]; MAX_SEGMENTS];
            for (d, it) in datagrams.iter_mut().zip(&self.items[i..i + run]) {
                *d = &self.buf[it.at..it.at + it.len];
            }
            match socks[s].send(first.dst, ifindex, &datagrams[..run]) {
                Ok(()) if run > 1 => {
                    sent.gso_sends += 1;
                    sent.gso_datagrams += run as u64;
                }
                Ok(()) => {}
                Err(_) if run > 1 && !socks[s].gso() => {
                    // The path cannot segment (the socket turned GSO off): each alone, with
                    // the ICRC of identification 0 again.
                    self.sign_segments(i, run);
                    for it in &self.items[i..i + run] {
                        let d = &self.buf[it.at..it.at + it.len];
                        if socks[s].send(it.dst, ifindex, &[d]).is_err() {
                            sent.failures += 1;
                        }
                    }
                }
                Err(_) => sent.failures += run as u64,
            }
            i += run;
        }
        self.items.clear();
        self.used = 0;
        sent
    }

    /// How many datagrams from `i` on can leave in one GSO send: same source, destination and
    /// length, the last possibly shorter, within the kernel's limits.
    fn run_from(&self, i: usize, src: Option<IpAddr>) -> usize {
        let first = self.items[i];
        let size = first.len;
        // The kernel writes the IP and UDP headers again: they count once.
        let headers = if first.dst.is_ipv4() { 20 } else { 40 } + UdpRepr::LEN;
        let mut payload = 0;
        let mut n = 0;
        for it in &self.items[i..] {
            let d = &self.buf[it.at..it.at + it.len];
            if n == MAX_SEGMENTS
                || it.dst != first.dst
                || it.len > size
                || payload + it.len.saturating_sub(headers) > MAX_GSO_PAYLOAD
                || datagram_source(d) != src
            {
                break;
            }
            payload += it.len.saturating_sub(headers);
            n += 1;
            if it.len < size {
                break;
            }
        }
        n.max(1)
    }

    /// Signs segment `k` of the run of `n` datagrams from `i` for the IPv4 identification `k`
    /// the kernel gives it, from that of identification 0 the core signed (applied twice, it
    /// undoes itself). IPv6 has no identification.
    fn sign_segments(&mut self, i: usize, n: usize) {
        for k in 1..n {
            let it = self.items[i + k];
            let d = &mut self.buf[it.at..it.at + it.len];
            if d.first().map(|b| b >> 4) != Some(4) || d.len() < ICRC_LEN {
                continue;
            }
            let ident = u16::from_be_bytes([d[4], d[5]]) ^ k as u16;
            Ipv4Repr::set_ident(d, ident);
            let at = d.len() - ICRC_LEN;
            let icrc = u32::from_le_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
                ^ self.idents.delta(it.len, k as u16);
            d[at..].copy_from_slice(&icrc.to_le_bytes());
        }
    }
}

/// The source address in the IP header at the start of `d`.
fn datagram_source(d: &[u8]) -> Option<IpAddr> {
    match d.first()? >> 4 {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(d.get(12..16)?).ok()?)),
        6 => Some(IpAddr::from(<[u8; 16]>::try_from(d.get(8..24)?).ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use softverbs_roce::wire::{Bth, Headers, IpRepr, Opcode, Psn, emit_datagram};

    const A: [u8; 4] = [10, 0, 0, 1];
    const B: [u8; 4] = [10, 0, 0, 2];
    const C: [u8; 4] = [10, 0, 0, 3];

    /// An IPv4 datagram from A to `dst` with `payload` bytes, signed with `ident`.
    fn datagram(dst: [u8; 4], payload: usize, ident: u16) -> Vec<u8> {
        let mut ip = Ipv4Repr::new(A.into(), dst.into());
        ip.ident = ident;
        let h = Headers::new(Bth::new(Opcode::RC_SEND_MIDDLE, 9, Psn::new(1)));
        let mut b = vec![0u8; payload + 128];
        let n = emit_datagram(&IpRepr::V4(ip), 4791, &h, &vec![7u8; payload], &mut b).unwrap();
        b.truncate(n);
        b
    }

    fn outbox(items: &[([u8; 4], usize)]) -> Outbox {
        let mut o = Outbox::new();
        for &(dst, len) in items {
            assert!(o.push(IpAddr::from(dst), &datagram(dst, len, 0)));
        }
        o
    }

    fn runs(o: &Outbox) -> Vec<usize> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < o.items.len() {
            let it = o.items[i];
            let n = o.run_from(i, datagram_source(&o.buf[it.at..it.at + it.len]));
            out.push(n);
            i += n;
        }
        out
    }

    #[test]
    fn runs_are_one_destination_and_one_length_with_a_shorter_last() {
        let o = outbox(&[
            (B, 1024),
            (B, 1024),
            (B, 1024),
            (B, 100),
            (B, 1024),
            (C, 1024),
            (C, 2048),
            (C, 2048),
        ]);
        assert_eq!(runs(&o), [4, 1, 1, 2]);
    }

    #[test]
    fn runs_stop_at_the_kernels_limits() {
        let o = outbox(&[(B, 64); 150]);
        assert_eq!(
            runs(&o),
            [MAX_SEGMENTS, MAX_SEGMENTS, 150 - 2 * MAX_SEGMENTS]
        );
        // 1,024 bytes of data: 1,040 bytes of UDP payload each, of which 62 fit in 65,507.
        let o = outbox(&[(B, 1024); 70]);
        assert_eq!(datagram(B, 1024, 0).len(), 1068);
        assert_eq!(runs(&o), [62, 8]);
    }

    #[test]
    fn segments_are_signed_with_the_identification_the_kernel_gives_them() {
        let mut o = outbox(&[(B, 1024); 5]);
        o.sign_segments(0, 5);
        for k in 0..5 {
            let it = o.items[k];
            assert_eq!(
                o.buf[it.at..it.at + it.len],
                datagram(B, 1024, k as u16)[..],
                "segment {k}"
            );
        }
        // Signing again undoes it (a run the kernel refused leaves one by one).
        o.sign_segments(0, 5);
        let zero = datagram(B, 1024, 0);
        assert!(
            o.items
                .iter()
                .all(|it| o.buf[it.at..it.at + it.len] == zero[..])
        );
    }

    #[test]
    fn the_fault_injector_can_take_back_the_last_datagram() {
        let mut o = outbox(&[(B, 10), (C, 20)]);
        let (dst, d) = o.pop().unwrap();
        assert_eq!((dst, d), (IpAddr::from(C), datagram(C, 20, 0)));
        assert_eq!(o.len(), 1);
        assert!(o.push(dst, &datagram(C, 30, 0)));
        assert_eq!(o.last_mut().unwrap().1, &datagram(C, 30, 0)[..]);
    }
}
