//! `perf`'s round-robin message rate: 64-byte RDMA WRITEs spread over many RC QPs, as an MPI
//! or UCX job with a QP per peer spreads its traffic, against the same loop over one QP.
//!
//! A holds `n` QPs, each connected to its own QP in B. Message `i` goes out on QP `i % n`;
//! each QP has at most [`TX_DEPTH`] requests outstanding and signals one in [`CQ_MOD`] (and
//! its last), as `ib_write_bw -q n` runs. With `n` = 1 this is the one-QP message rate.
//! QP `q` writes slot `q` of A's region (a pattern naming `q`) into slot `q` of B's, and B
//! checks every slot afterwards: each QP carried its WRITEs to the right place.

use crate::Result;
use crate::perf_rate::{CQ_MOD, MSG_SIZE, TX_DEPTH, Wait};
use serde::{Deserialize, Serialize};
use softverbs::{
    AccessFlags, CompletionQueue, Context, Device, Endpoint, MemoryRegion, ProtectionDomain, QpCap,
    QpInitAttr, QpType, QueuePair, SendFlags, SendOp, SendWr, WorkCompletion,
};
use std::cell::{Cell, RefCell};
use std::time::Instant;

/// QP counts of the figure, normally and with `--quick`.
pub(crate) const COUNTS: [usize; 4] = [1, 64, 4096, 65536];
pub(crate) const QUICK_COUNTS: [usize; 2] = [1, 64];
/// QP numbers per message on the link (a message holds at most 64 KiB).
pub(crate) const QPNS_PER_MESSAGE: usize = 4096;

/// What the fan's peer may do to its QPs and region.
const ACCESS: AccessFlags = AccessFlags::REMOTE_WRITE;

/// One side's QPs (their numbers travel separately, [`QPNS_PER_MESSAGE`] at a time) and the
/// region the peer's QP `q` writes slot `q` of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FanEp {
    pub(crate) qps: u32,
    psn: u32,
    lid: u16,
    gid: String,
    addr: u64,
    rkey: u32,
}

/// Messages each of `qps` QPs sends when the figure is about `messages` in all: at least one
/// signaled batch each.
pub(crate) fn per_qp(messages: u64, qps: usize) -> u64 {
    (messages / qps as u64).max(CQ_MOD)
}

/// `qps` RC QPs of one side, on one send CQ, and a region of one slot per QP.
pub(crate) struct Fan {
    // Dropped in this order: QPs, memory, CQs, PD, context.
    pub(crate) qps: Vec<QueuePair>,
    mr: MemoryRegion<'static>,
    send_cq: CompletionQueue,
    _recv_cq: CompletionQueue,
    _pd: ProtectionDomain,
    _ctx: Context,
    psn: u32,
    /// Requests a QP may have outstanding.
    window: u64,
}

impl Fan {
    /// The QPs, sized for `per_qp` messages each; `beat` is called as creation goes (it takes
    /// a while for tens of thousands).
    pub(crate) fn new(device: &Device, qps: usize, per_qp: u64, beat: &dyn Fn()) -> Result<Fan> {
        let ctx = device.open()?;
        let max_qp = ctx.query_device().max_qp as usize;
        if qps == 0 || qps > max_qp {
            return Err(format!("a fan of {qps} QPs (the device has {max_qp} at most)").into());
        }
        if per_qp == 0 {
            return Err("a fan that sends nothing".into());
        }
        let pd = ctx.alloc_pd()?;
        let window = TX_DEPTH.min(per_qp);
        // Each QP has at most two signaled requests outstanding (window ≤ 2 × CQ_MOD).
        let depth = u32::try_from(2 * qps + 16)
            .map_err(|_| format!("{qps} QPs are too many"))?
            .min(ctx.query_device().max_cqe);
        let send_cq = ctx.create_cq(depth, None)?;
        let recv_cq = ctx.create_cq(1, None)?;
        let len = qps * MSG_SIZE;
        let mr = pd
            .alloc_mr(len, AccessFlags::LOCAL_WRITE | ACCESS)
            .map_err(|e| format!("registering {len} bytes: {e}"))?;
        let mut all = Vec::with_capacity(qps);
        for q in 0..qps {
            let qp = pd
                .create_qp(&QpInitAttr {
                    cap: QpCap {
                        max_send_wr: window as u32,
                        max_recv_wr: 1,
                        max_send_sge: 1,
                        max_recv_sge: 1,
                        max_inline_data: 0,
                    },
                    ..QpInitAttr::new(QpType::Rc, &send_cq, &recv_cq)
                })
                .map_err(|e| format!("creating QP {q} of {qps}: {e}"))?;
            all.push(qp);
            if q % 1024 == 1023 {
                beat();
            }
        }
        let psn = std::process::id() & 0xff_ffff;
        Ok(Fan {
            qps: all,
            mr,
            send_cq,
            _recv_cq: recv_cq,
            _pd: pd,
            _ctx: ctx,
            psn,
            window,
        })
    }

    /// This side's address (the QP numbers are [`Fan::qpns`]).
    pub(crate) fn endpoint(&self) -> Result<FanEp> {
        let first = self.qps.first().ok_or("a fan of no QPs")?;
        let ep = first.endpoint(self.psn)?;
        Ok(FanEp {
            qps: self.qps.len() as u32,
            psn: ep.psn,
            lid: ep.lid,
            gid: ep.gid.to_string(),
            addr: self.mr.iova(),
            rkey: self.mr.rkey(),
        })
    }

    pub(crate) fn qpns(&self) -> Vec<u32> {
        self.qps.iter().map(QueuePair::qp_num).collect()
    }

    /// Connects QP `q` to the peer's QP `qpns[q]`.
    pub(crate) fn connect(&self, peer: &FanEp, qpns: &[u32], beat: &dyn Fn()) -> Result<()> {
        if qpns.len() != self.qps.len() || peer.qps as usize != self.qps.len() {
            return Err(format!(
                "the peer has {} QPs ({} numbers sent), this side {}",
                peer.qps,
                qpns.len(),
                self.qps.len()
            )
            .into());
        }
        let gid = peer
            .gid
            .parse()
            .map_err(|_| format!("the peer sent a bad GID `{}`", peer.gid))?;
        for (q, (qp, &qpn)) in self.qps.iter().zip(qpns).enumerate() {
            let to = Endpoint {
                qpn,
                psn: peer.psn,
                lid: peer.lid,
                gid,
            };
            qp.connect(&to, self.psn, ACCESS)
                .map_err(|e| format!("connecting QP {q} to the peer's {qpn:#x}: {e}"))?;
            if q % 1024 == 1023 {
                beat();
            }
        }
        Ok(())
    }

    /// Fills slot `q` with the pattern of QP `q` (the sender's data).
    pub(crate) fn fill(&self) -> Result<()> {
        for q in 0..self.qps.len() {
            self.mr.write_at(q * MSG_SIZE, &pattern(q))?;
        }
        Ok(())
    }

    /// Every slot holds its QP's pattern: each QP's WRITEs landed, in its own slot.
    pub(crate) fn check(&self) -> Result<()> {
        let mut got = [0u8; MSG_SIZE];
        let mut wrong = Vec::new();
        for q in 0..self.qps.len() {
            self.mr.read_at(q * MSG_SIZE, &mut got)?;
            if got != pattern(q) {
                wrong.push(q);
            }
        }
        match wrong.first() {
            None => Ok(()),
            Some(q) => Err(format!(
                "round-robin WRITEs over {} QPs: {} slots not written, the first of QP {q}",
                self.qps.len(),
                wrong.len()
            )
            .into()),
        }
    }

    /// Sends `per_qp` 64-byte WRITEs on each QP, round robin; returns the seconds from the
    /// first post to the last completion.
    pub(crate) fn round_robin(&self, peer: &FanEp, per_qp: u64, wait: Wait<'_>) -> Result<f64> {
        let n = self.qps.len();
        let total = per_qp * n as u64;
        // Requests of each QP known complete.
        let mut retired = vec![0u64; n];
        let (mut next, mut done) = (0u64, 0u64);
        let wcs = RefCell::new([WorkCompletion::default(); 16]);
        let got = Cell::new(0usize);
        let t0 = Instant::now();
        while done < total {
            while next < total {
                let (q, k) = ((next % n as u64) as usize, next / n as u64);
                if k - retired[q] >= self.window {
                    break;
                }
                let signaled = (k + 1) % CQ_MOD == 0 || k + 1 == per_qp;
                let flags = if signaled {
                    SendFlags::SIGNALED
                } else {
                    SendFlags::empty()
                };
                let at = q * MSG_SIZE;
                let sge = [self.mr.sge(at..at + MSG_SIZE)];
                let op = SendOp::RdmaWrite {
                    remote_addr: peer.addr + at as u64,
                    rkey: peer.rkey,
                };
                self.qps[q]
                    .post_send([SendWr::new((q as u64) << 32 | k, op, &sge).flags(flags)])
                    .map_err(|e| format!("round robin: posting {k} on QP {q} of {n}: {e}"))?;
                next += 1;
            }
            got.set(self.send_cq.poll(&mut *wcs.borrow_mut()));
            if got.get() == 0 {
                wait(&|| {
                    got.set(self.send_cq.poll(&mut *wcs.borrow_mut()));
                    got.get() > 0
                })?;
            }
            for wc in &wcs.borrow()[..got.get()] {
                if !wc.is_ok() {
                    return Err(format!("round robin over {n} QPs: completion {wc:?}").into());
                }
                // A signaled completion stands for every request of its QP before it.
                let (q, k) = ((wc.wr_id() >> 32) as usize, wc.wr_id() & 0xffff_ffff);
                let r = retired
                    .get_mut(q)
                    .ok_or("round robin: a completion of no QP")?;
                done += (k + 1).saturating_sub(*r);
                *r = (*r).max(k + 1);
            }
        }
        Ok(t0.elapsed().as_secs_f64())
    }
}

/// Slot `q`'s bytes: QP `q`'s number in every word, each word told apart.
fn pattern(q: usize) -> [u8; MSG_SIZE] {
    let mut p = [0u8; MSG_SIZE];
    for (w, chunk) in p.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&(0xfa00_0000_0000_0000 | (w as u64) << 32 | q as u64).to_le_bytes());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(done: &dyn Fn() -> bool) -> Result<()> {
        let t = Instant::now();
        while !done() {
            if t.elapsed().as_secs() > 30 {
                return Err("no completion in 30 s".into());
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Two fans in this process, pairwise connected: every QP's WRITEs land in its slot, and
    /// none before the run.
    #[test]
    fn round_robin_writes_reach_every_qps_slot() {
        let dev = crate::find_device(None).unwrap();
        let (n, per) = (64, per_qp(6400, 64));
        let a = Fan::new(&dev, n, per, &|| ()).unwrap();
        let b = Fan::new(&dev, n, per, &|| ()).unwrap();
        let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
        a.connect(&eb, &b.qpns(), &|| ()).unwrap();
        b.connect(&ea, &a.qpns(), &|| ()).unwrap();
        a.fill().unwrap();
        assert!(b.check().is_err(), "nothing written yet");
        let secs = a.round_robin(&eb, per, &spin).unwrap();
        assert!(secs > 0.0);
        b.check().unwrap();
    }

    #[test]
    fn a_peer_with_other_qp_counts_is_refused() {
        let dev = crate::find_device(None).unwrap();
        let a = Fan::new(&dev, 2, CQ_MOD, &|| ()).unwrap();
        let b = Fan::new(&dev, 3, CQ_MOD, &|| ()).unwrap();
        let err = a
            .connect(&b.endpoint().unwrap(), &b.qpns(), &|| ())
            .unwrap_err();
        assert!(err.to_string().contains("3 QPs"), "{err}");
    }

    #[test]
    fn each_qp_sends_at_least_one_signaled_batch() {
        assert_eq!(per_qp(1_000_000, 1), 1_000_000);
        assert_eq!(per_qp(1_000_000, 64), 15_625);
        assert_eq!(per_qp(1_000_000, 65536), CQ_MOD);
    }
}
