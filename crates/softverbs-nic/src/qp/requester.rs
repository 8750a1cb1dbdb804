//! The requester's semantics: one attempt at a work request, from the poster's side.
//!
//! The requester checks what is its own to check (its SGEs against its key table, the
//! message length, a UD request's destination and MTU, its port), builds the [`Request`],
//! has it carried to the responder ([`Deliver`]: a transport's job) and turns the
//! [`Response`] into the outcome the send-queue driver completes, retries or fails the QP
//! with. Binds (of layouts and memory windows) and local invalidation touch no responder and
//! execute here.

use super::request::{Datagram, Deliver, Request, Response};
use super::wr::{Payload, SendOp, SendWqe};
use super::{Outcome, Qp, SendState};
use crate::device::MAX_MSG_SIZE;
use crate::device::multicast::MULTICAST_QPN;
use crate::mr::access::{self, Span};
use crate::mr::keys::PinBy;
use crate::mr::resolve::{Spans, pin_sges};
use crate::types::{AccessFlags, LinkLayer, QpType, SendFlags, WcStatus};

/// Proof that the caller holds the send lock: made only from the state it guards.
#[derive(Clone, Copy)]
struct SendLocked(());

impl SendLocked {
    fn of(_: &SendState) -> SendLocked {
        SendLocked(())
    }
}

impl Qp {
    pub(crate) fn execute(&self, st: &mut SendState, w: &SendWqe<'_>) -> Outcome {
        if w.op.is_local() {
            return self.local_op(w.op);
        }
        let need = if w.op.writes_local() {
            AccessFlags::LOCAL_WRITE
        } else {
            AccessFlags::empty()
        };
        let held = SendLocked::of(st);
        // The connected responder first, so that the lines its lookup prefetches are on their
        // way while the local side is checked; its absence still ranks after a local error.
        let target = match self.qp_type {
            QpType::Ud => None,
            _ => {
                let (av, qpn) = (&st.attr.ah_attr, st.attr.dest_qp_num);
                self.responder(&mut st.peer, av, &st.peer_dev, qpn)
            }
        };
        let local = match self.local(held, &w.payload, need) {
            Ok(l) => l,
            Err(status) => return Outcome::Done(status, 0),
        };
        if local.len > u64::from(MAX_MSG_SIZE) {
            return Outcome::Done(WcStatus::LocLenErr, 0);
        }
        if self.qp_type == QpType::Ud {
            return self.execute_ud(st, w, &local);
        }
        // Borrowed, not moved: moving it out copied it through memory in one piece just
        // after it was stored in two, a store-forwarding stall on every request.
        let Some(target) = target.as_ref() else {
            return self.lost(local.len);
        };
        if !self.dev.port_active() {
            return self.lost(local.len);
        }
        let mut req = self.request(w, &local, st.attr.ah_attr.sl, None);
        req.hazard = target.hazard();
        let response = match self.qp_type {
            QpType::XrcSend => self.deliver_xrc(target, &st.peer_dev, w.xrc_srqn, &req),
            _ => self.deliver(target, &req),
        };
        self.outcome(response, &local)
    }

    fn execute_ud(&self, st: &SendState, w: &SendWqe<'_>, local: &Spans<'_>) -> Outcome {
        let Some(ud) = &w.ud else {
            return Outcome::Done(WcStatus::LocQpOpErr, 0);
        };
        let len = local.len;
        // UD messages are single packets: at most the port's MTU (UD has no path MTU).
        if len > u64::from(self.dev.config.active_mtu.bytes()) {
            return Outcome::Done(WcStatus::LocLenErr, 0);
        }
        if !self.dev.port_active() {
            return self.lost(len);
        }
        let group = ud.remote_qpn == MULTICAST_QPN;
        let target = if group {
            None
        } else {
            match self.ud_responder(&ud.ah, ud.remote_qpn) {
                Some(t) => Some(t),
                None => return self.lost(len),
            }
        };
        // A Q_Key with the high bit set means "use the QP's own Q_Key" (IBA 10.2.5).
        let qkey = if ud.remote_qkey & 0x8000_0000 != 0 {
            st.attr.qkey
        } else {
            ud.remote_qkey
        };
        let datagram = Datagram {
            qkey,
            sgid: self.dev.config.gid,
            av: &ud.ah.attr,
            grh: ud.ah.attr.grh.is_some() || self.dev.config.link_layer == LinkLayer::Ethernet,
        };
        let req = self.request(w, local, ud.ah.attr.sl, Some(datagram));
        match target {
            Some(t) => {
                let response = self.deliver(&t, &req);
                self.outcome(response, local)
            }
            // Each member takes its copy or drops it (Q_Key, no receive); the sender never
            // learns which, as on a fabric.
            None => {
                for t in self.ud_group(&ud.ah) {
                    let _ = self.deliver(&t, &req);
                }
                self.lost(len)
            }
        }
    }

    /// Checks and pins the local side of a work request. `_held`: the send lock is held, so
    /// the region's own pins need not count themselves ([`KeyTable::pin_key`]: the
    /// owner's deregistration takes this lock before the region goes).
    fn local<'a>(
        &'a self,
        _held: SendLocked,
        payload: &'a Payload<'_>,
        need: AccessFlags,
    ) -> Result<Spans<'a>, WcStatus> {
        match payload {
            Payload::Inline(bytes) => Ok(Spans {
                spans: crate::mr::resolve::Few::Inline(Some(Span::of(bytes))),
                pins: crate::mr::resolve::Few::new(),
                len: bytes.len() as u64,
            }),
            Payload::Sges(sges) => pin_sges(
                self.keys(),
                self.pd.id,
                sges,
                need,
                if self.import.is_none() {
                    PinBy::Sweep
                } else {
                    PinBy::Count
                },
                // Inlined, as the key checks are (see `KeyTable::pin`).
                #[inline(always)]
                |p, h, n| self.place_local(p, h, n),
            )
            .map_err(|_| WcStatus::LocProtErr),
        }
    }

    /// `w` as its responder receives it; `sl` is the service level it travels on (the QP's
    /// path for RC/UC, the address handle's for UD).
    fn request<'a>(
        &'a self,
        w: &SendWqe<'_>,
        local: &'a Spans<'a>,
        sl: u8,
        datagram: Option<Datagram<'a>>,
    ) -> Request<'a> {
        let slid = match self.dev.config.link_layer {
            LinkLayer::InfiniBand => self.dev.config.lid,
            LinkLayer::Ethernet => 0,
        };
        Request {
            src_qpn: self.qpn,
            qp_type: self.qp_type,
            op: w.op,
            len: local.len,
            local,
            solicited: w.flags.contains(SendFlags::SOLICITED),
            sl,
            slid,
            datagram,
            placer: &self.dev,
            hazard: None,
        }
    }

    /// What the responder's answer means for the work request.
    fn outcome(&self, response: Response, local: &Spans<'_>) -> Outcome {
        match response {
            Response::Ack => Outcome::Done(WcStatus::Success, local.len as u32),
            Response::Atomic(original) => {
                let bytes = original.to_ne_bytes();
                // SAFETY: the destination spans are pinned local LOCAL_WRITE registrations
                // totalling 8 bytes (checked at post); all local, so the copy cannot fail.
                let _ = unsafe { access::copy_ordered(&[Span::of(&bytes)], &local.spans) };
                Outcome::Done(WcStatus::Success, 8)
            }
            Response::Nak(status) => Outcome::Done(status, 0),
            Response::Rnr(delay) => Outcome::Rnr(delay),
            Response::Dropped => self.lost(local.len),
        }
    }

    /// A message that reached no one: RC waits for an ACK that never comes; UC and UD
    /// complete successfully, as their packets are simply lost.
    fn lost(&self, len: u64) -> Outcome {
        match self.qp_type {
            t if t.is_reliable() => Outcome::NoAck,
            _ => Outcome::Done(WcStatus::Success, len as u32),
        }
    }

    /// A bind or local invalidation, in the QP's program order: a layout bind makes the
    /// staged layout of container `key` take effect; a window bind or invalidation changes
    /// the window's entry in this device's key table.
    fn local_op(&self, op: SendOp) -> Outcome {
        // An imported PD's windows are its exporter's to bind and invalidate: their table's
        // allocation lock is the exporter's, which this process cannot take.
        if self.import.is_some() {
            let status = match op {
                SendOp::LocalInv { .. } => WcStatus::LocQpOpErr,
                _ => WcStatus::MwBindErr,
            };
            return Outcome::Done(status, 0);
        }
        let keys = self.keys();
        let (ok, failed) = match op {
            SendOp::BindLayout { key } => (
                self.dev
                    .layouts
                    .find(key)
                    .is_some_and(|mr| mr.bind(keys, &self.dev.layouts, self.pd.id)),
                WcStatus::MwBindErr,
            ),
            SendOp::BindMw {
                window,
                rkey,
                mr,
                addr,
                length,
                access,
            } => (
                keys.bind_window(&crate::mr::window::WindowBind {
                    window,
                    rkey,
                    pd: self.pd.id,
                    qpn: self.qpn,
                    mr,
                    addr,
                    length,
                    access,
                })
                .is_ok(),
                WcStatus::MwBindErr,
            ),
            SendOp::LocalInv { rkey } => (
                keys.invalidate_window(rkey, self.pd.id).is_ok(),
                WcStatus::LocQpOpErr,
            ),
            _ => (false, WcStatus::LocQpOpErr),
        };
        Outcome::Done(if ok { WcStatus::Success } else { failed }, 0)
    }
}
