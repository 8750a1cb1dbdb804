//! What a destroyed RC QP leaves behind for a short while: enough to acknowledge again the
//! messages it had already received, when their ACK was lost on the way.
//!
//! A program that exchanges its last messages and destroys its QP (`ibv_rc_pingpong` does)
//! leaves its peer waiting on the ACK of the last one. If that ACK is lost, the peer
//! retransmits to a QP number nobody answers, and its send fails with `RETRY_EXC_ERR` though
//! the message was delivered. A NIC drops such packets too; like TCP's TIME-WAIT, softverbs
//! instead answers duplicates of what the QP had executed, for a few of the peer's timeouts.
//! Nothing is executed and no memory is reached: only a PSN already behind the QP's
//! expected PSN, from its peer's address, is acknowledged, with the MSN the QP last sent.

use super::QpConfig;
use super::qp::Transmit;
use super::responder::with_aeth;
use super::timers::transport_timeout;
use crate::Time;
use crate::wire::{Aeth, Datagram, Op, Opcode, Psn, Transport};
use std::net::IpAddr;
use std::time::Duration;

/// The shortest and longest a destroyed QP's duplicates are answered.
const SHORTEST: Duration = Duration::from_secs(1);
const LONGEST: Duration = Duration::from_secs(10);

/// A destroyed RC QP's memory of its peer and of how far it had received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Linger {
    peer: IpAddr,
    dest_qp: u32,
    transport: Transport,
    pkey: u16,
    src_port: u16,
    /// The PSN the responder expected next: everything before it was executed.
    epsn: Psn,
    msn: u32,
    until: Time,
    ack_due: bool,
}

impl Linger {
    /// What QP `cfg`, expecting `epsn` with `msn` messages done, leaves at `now`: `None`
    /// unless it is a connected reliable QP. `ack_due`: it had an ACK queued that never went
    /// out. Lasts twice the peer's retry budget if the peer is configured like this QP
    /// (`retry_cnt + 1` timeouts), within 1 to 10 s.
    pub(super) fn new(
        cfg: &QpConfig,
        src_port: u16,
        epsn: Psn,
        msn: u32,
        ack_due: bool,
        now: Time,
    ) -> Option<Linger> {
        let (peer, dest_qp) = cfg.peer?;
        if !cfg.qp_type.is_reliable() {
            return None;
        }
        let span = transport_timeout(cfg.timeout)
            .map_or(LONGEST, |t| t * (2 * (u32::from(cfg.retry_cnt) + 1)))
            .clamp(SHORTEST, LONGEST);
        Some(Linger {
            peer,
            dest_qp,
            transport: cfg.qp_type.transport(),
            pkey: cfg.pkey,
            src_port,
            epsn,
            msn,
            until: now.after(span),
            ack_due,
        })
    }

    /// Until when duplicates are answered.
    pub fn until(&self) -> Time {
        self.until
    }

    /// An ACK waits for [`poll_transmit`](Self::poll_transmit).
    pub fn ack_due(&self) -> bool {
        self.ack_due
    }

    /// A packet for the destroyed QP: true if it is a duplicate from its peer that asks for
    /// an ACK, which [`poll_transmit`](Self::poll_transmit) then sends. READs and atomics
    /// are not answered (what they read is gone).
    pub fn handle_packet(&mut self, now: Time, d: &Datagram<'_>) -> bool {
        let bth = &d.headers.bth;
        let op = bth.opcode.op;
        let answer = now < self.until
            && d.ip.src() == self.peer
            && bth.opcode.transport == self.transport
            && bth.pkey & 0x7fff == self.pkey & 0x7fff
            && op.is_request()
            && !op.is_read_like()
            && !op.is_atomic()
            && bth.psn.diff(self.epsn) < 0
            && (bth.ack_req || op.ends_message());
        self.ack_due |= answer;
        answer
    }

    /// The ACK due, if one is.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        if !std::mem::take(&mut self.ack_due) {
            return None;
        }
        let opcode = Opcode::new(self.transport, Op::Ack)?;
        let mut h = with_aeth(opcode, self.dest_qp, self.epsn.sub(1), Aeth::ack(self.msn));
        h.bth.pkey = self.pkey;
        Some(Transmit {
            dst: self.peer,
            src_port: self.src_port,
            headers: h,
            payload_len: 0,
        })
    }
}
