//! RoCEv2 between hosts: the transport of networked devices.
//!
//! A networked device's QPs are executed by the host engine ([`engine`]), one process per
//! device address that owns UDP port 4791 there and acts as the host's NIC. A QP of a program
//! is an [`Offload`]: [`NetQp`] hands each work request to the engine through a send ring in
//! device memory (and rings the engine's doorbell only while it sleeps), tells it of every
//! state change over the engine's Unix socket ([`client`]), and gets its completions in its
//! CQs, pushed by the engine as a peer process pushes them on the same host. Receives stay in
//! the QP's receive queue (or SRQ) in device memory; the engine takes one when a message
//! needs it.

pub(crate) mod client;
pub mod engine;
pub(crate) mod protocol;

use crate::config::net::ip_of;
use crate::device::Device;
use crate::device_memory::ring::Ring;
use crate::device_memory::segment::Segment;
use crate::error::{Error, Result};
use crate::qp::context::QpCtx;
use crate::qp::request::Offload;
use crate::qp::wr::{Payload, SendOp, SendWqe};
use crate::qp::{Qp, QpAttr, QpCap};
use crate::types::{AccessFlags, QpState, QpType, SendFlags, WcOpcode};
use client::Link;
use protocol::{
    Chunk, Ctl, NetWqe, Rtr, Rts, WQE_FENCE, WQE_INLINE, WQE_SIGNALED, WQE_SOLICITED, slot_bytes,
};
use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, Weak};

pub use client::ENV_PCAP;

/// A QP of a networked device, as its process holds it.
pub(crate) struct NetQp {
    qpn: u32,
    sq: Ring,
    link: Arc<Link>,
    dev: Arc<Device>,
    /// Requests handed to the engine and maybe not completed: (number, wr_id, opcode).
    handed: Mutex<VecDeque<(u32, u64, WcOpcode)>>,
}

fn seq_before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

impl NetQp {
    /// Makes the send ring of QP `qpn`, names it in its context, and connects to the engine
    /// (starting it if it is not running).
    pub(crate) fn new(dev: &Arc<Device>, qpn: u32, ctx: &Segment, cap: &QpCap) -> Result<NetQp> {
        let link = Link::get(&dev.config)?;
        let sq = Ring::new(
            "softverbs-sq",
            cap.max_send_wr.max(1),
            slot_bytes(cap.max_send_sge, cap.max_inline_data),
        )?;
        let c: &QpCtx = ctx.at(0);
        c.sq.set_segment(sq.segment());
        Ok(NetQp {
            qpn,
            sq,
            link,
            dev: dev.clone(),
            handed: Mutex::new(VecDeque::new()),
        })
    }

    fn gid_ip(&self, index: u8) -> Option<IpAddr> {
        self.dev.config.gid_at(u32::from(index)).map(ip_of)
    }
}

impl Drop for NetQp {
    fn drop(&mut self) {
        let _ = self.link.send(&Ctl::Close { qpn: self.qpn });
    }
}

/// The roce core's `QpAccess` bits for the QP's remote rights.
fn access_bits(a: AccessFlags) -> u8 {
    u8::from(a.contains(AccessFlags::REMOTE_WRITE))
        | u8::from(a.contains(AccessFlags::REMOTE_READ)) << 1
        | u8::from(a.contains(AccessFlags::REMOTE_ATOMIC)) << 2
}

impl Offload for NetQp {
    fn bind(&self, qp: Weak<Qp>) {
        self.link.add(qp);
    }

    fn post(&self, seq: u32, w: &SendWqe<'_>, _attr: &QpAttr) -> Result<()> {
        let mut h = NetWqe {
            wr_id: w.wr_id,
            seq,
            opcode: w.op.opcode() as u8,
            xrc_srqn: w.xrc_srqn,
            ..NetWqe::default()
        };
        let f = |flag: SendFlags, bit: u8| if w.flags.contains(flag) { bit } else { 0 };
        h.flags = f(SendFlags::SIGNALED, WQE_SIGNALED)
            | f(SendFlags::SOLICITED, WQE_SOLICITED)
            | f(SendFlags::FENCE, WQE_FENCE);
        if let Some(imm) = w.op.imm() {
            h.imm = imm;
        }
        match w.op {
            SendOp::RdmaWrite { remote_addr, rkey }
            | SendOp::RdmaWriteWithImm {
                remote_addr, rkey, ..
            }
            | SendOp::RdmaRead { remote_addr, rkey } => {
                h.remote_addr = remote_addr;
                h.rkey = rkey;
            }
            SendOp::CmpSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                h.remote_addr = remote_addr;
                h.rkey = rkey;
                h.compare_add = compare;
                h.swap = swap;
            }
            // The engine carries the operand (the add, the word to store) in `compare_add`.
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add: operand,
            }
            | SendOp::AtomicWrite {
                remote_addr,
                rkey,
                value: operand,
            } => {
                h.remote_addr = remote_addr;
                h.rkey = rkey;
                h.compare_add = operand;
            }
            SendOp::Send | SendOp::SendWithImm { .. } => {}
            SendOp::SendWithInv { rkey } | SendOp::LocalInv { rkey } => h.rkey = rkey,
            SendOp::Flush {
                remote_addr,
                rkey,
                len,
                whole_region,
                ..
            } => {
                h.remote_addr = remote_addr;
                h.rkey = rkey;
                h.compare_add = u64::from(len);
                h.swap = u64::from(whole_region);
            }
            SendOp::BindMw {
                window,
                rkey,
                mr,
                addr,
                length,
                access,
            } => {
                h.remote_addr = addr;
                h.compare_add = length;
                h.rkey = rkey;
                h.imm = mr;
                h.swap = u64::from(window) << 32 | u64::from(access.bits());
            }
            SendOp::BindLayout { .. } => {
                return Err(Error::Unsupported(
                    "layout binds on networked devices".into(),
                ));
            }
        }
        if let Some(ud) = &w.ud {
            let g = ud.ah.attr.grh.map(|g| g.dgid).unwrap_or_default();
            h.ud_dst = g.0;
            h.ud_qpn = ud.remote_qpn;
            h.ud_qkey = ud.remote_qkey;
        }
        let pushed = match &w.payload {
            Payload::Sges(s) => {
                h.count = s.len() as u32;
                self.sq.push_slice(&h, s)
            }
            Payload::Inline(b) => {
                h.flags |= WQE_INLINE;
                h.count = b.len() as u32;
                let chunks: Vec<Chunk> = b
                    .chunks(16)
                    .map(|c| {
                        let mut x = [0u8; 16];
                        x[..c.len()].copy_from_slice(c);
                        Chunk(x)
                    })
                    .collect();
                self.sq.push_slice(&h, &chunks)
            }
        };
        pushed.map_err(|_| Error::NoResources("send ring full".into()))?;
        {
            // No more than a send queue's worth can be outstanding: older ones completed.
            let mut handed = self.handed.lock().unwrap_or_else(|e| e.into_inner());
            while handed.len() >= self.sq.capacity() as usize {
                handed.pop_front();
            }
            handed.push_back((seq, w.wr_id, w.op.wc_opcode()));
        }
        self.link.ring();
        Ok(())
    }

    fn receive_only(&self) -> Result<()> {
        self.link.send(&Ctl::Open { qpn: self.qpn })
    }

    fn settle(&self, done: &std::sync::atomic::AtomicU32, within: std::time::Duration) {
        let deadline = std::time::Instant::now() + within;
        while !self
            .unfinished(done.load(std::sync::atomic::Ordering::Acquire))
            .is_empty()
            && std::time::Instant::now() < deadline
        {
            self.link.ring();
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Asked on a connection of its own, so the call returns once the engine has joined (or
    /// left) the group: a datagram sent to the group after `ibv_attach_mcast` returns reaches
    /// this QP.
    fn group(&self, mgid: crate::types::Gid, join: bool) -> Result<()> {
        let m = Ctl::Group {
            qpn: self.qpn,
            group: ip_of(mgid),
            join,
        };
        match client::request(ip_of(self.dev.config.gid), &m)?.as_str() {
            "ok" => Ok(()),
            why => Err(Error::NoResources(format!("multicast group: {why}"))),
        }
    }

    fn moved(&self, qp: &Qp, from: QpState, to: QpState, attr: &QpAttr) -> Result<()> {
        let qpn = self.qpn;
        match to {
            QpState::Rtr if from == QpState::Init => {
                let (src, peer) = match (qp.qp_type(), attr.ah_attr.grh) {
                    (QpType::Ud, _) => (ip_of(self.dev.config.gid), ip_of(self.dev.config.gid)),
                    (_, Some(g)) => (
                        self.gid_ip(g.sgid_index)
                            .ok_or_else(|| Error::InvalidArgument("sgid_index".into()))?,
                        ip_of(g.dgid),
                    ),
                    (_, None) => {
                        return Err(Error::InvalidArgument(
                            "a networked device's QP needs a GRH (destination GID)".into(),
                        ));
                    }
                };
                let pmtu = attr
                    .path_mtu
                    .bytes()
                    .min(self.dev.config.active_mtu.bytes());
                self.link.send(&Ctl::Open { qpn })?;
                self.link.send(&Ctl::Rtr {
                    qpn,
                    rtr: Rtr {
                        qp_type: qp.qp_type() as u8,
                        src,
                        peer,
                        dest_qpn: attr.dest_qp_num,
                        rq_psn: attr.rq_psn,
                        pmtu,
                        min_rnr_timer: attr.min_rnr_timer,
                        max_dest_rd_atomic: attr.max_dest_rd_atomic,
                        access: access_bits(attr.qp_access_flags),
                        qkey: attr.qkey,
                        pkey: crate::device::DEFAULT_PKEY,
                        sq_sig_all: qp.sq_sig_all(),
                    },
                })
            }
            // RTR -> RTS starts the requester; back to RTS from SQD or SQE (or RTS -> RTS)
            // updates its limits and the QP's rights.
            QpState::Rts => self.link.send(&Ctl::Rts {
                qpn,
                rts: Rts {
                    sq_psn: attr.sq_psn,
                    access: access_bits(attr.qp_access_flags),
                    timeout: attr.timeout,
                    retry_cnt: attr.retry_cnt,
                    rnr_retry: attr.rnr_retry,
                    max_rd_atomic: attr.max_rd_atomic,
                },
            }),
            QpState::Err => self.link.send(&Ctl::Error { qpn }),
            QpState::Reset => {
                self.handed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clear();
                self.link.send(&Ctl::Close { qpn })
            }
            // SQD: the send-queue driver holds back what is posted from now on; what the engine
            // has drains.
            _ => {
                if self.link.is_dead() {
                    return Err(Error::NotFound("the RoCE engine is gone".into()));
                }
                Ok(())
            }
        }
    }

    fn unfinished(&self, done: u32) -> Vec<(u32, u64, WcOpcode)> {
        let handed = self.handed.lock().unwrap_or_else(|e| e.into_inner());
        handed
            .iter()
            .filter(|(seq, ..)| !seq_before(*seq, done))
            .copied()
            .collect()
    }
}

/// The report of the engine serving `dev`, if one runs (it is not started for this).
pub fn engine_report(dev: &Device) -> Result<String> {
    if dev.config.net.is_none() {
        return Err(Error::InvalidArgument(format!(
            "{} is not networked",
            dev.config.name
        )));
    }
    client::request(ip_of(dev.config.gid), &Ctl::Status)
}

/// Starts (or, with an empty path, stops) a capture by the engine serving `dev`.
pub fn engine_capture(dev: &Device, path: &str) -> Result<String> {
    if dev.config.net.is_none() {
        return Err(Error::InvalidArgument(format!(
            "{} is not networked",
            dev.config.name
        )));
    }
    client::request(ip_of(dev.config.gid), &Ctl::Capture { path: path.into() })
}

/// While alive, the host engine serving a networked device keeps running, as if a QP of
/// this process used it: what a CM agent holds so that its host answers CM MADs on QP1
/// before the program has made any QP (an engine stops soon after its last client).
pub struct EngineHold {
    link: Arc<Link>,
}

impl std::fmt::Debug for EngineHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineHold")
    }
}

impl EngineHold {
    /// The process id of the engine held.
    pub fn engine_pid(&self) -> u32 {
        self.link.engine_pid
    }

    /// Lets the engine held run on `cpus` only (it moves there when it next runs), as
    /// `SOFTVERBS_ENGINE_CPUS` does for an engine as it starts.
    pub fn place_on(&self, cpus: &[usize]) -> Result<()> {
        engine::put_on_cpus(self.link.engine_pid, cpus).map_err(Error::InvalidArgument)
    }
}

/// Connects to the engine serving `dev`, starting it if none runs, and keeps it running
/// while the returned value lives.
pub fn hold_engine(dev: &Device) -> Result<EngineHold> {
    if dev.config.net.is_none() {
        return Err(Error::InvalidArgument(format!(
            "{} is not networked",
            dev.config.name
        )));
    }
    Ok(EngineHold {
        link: Link::get(&dev.config)?,
    })
}
