//! The registered memory of every process the engine serves, as the RoCE transport core
//! reaches it ([`softverbs_roce::transport::Memory`]).
//!
//! Each engine QP gets a tag that stands for its protection domain in the core; the tag leads
//! to the QP's owner, mapped here ([`RemoteQp`]): its key table, and its memory (a mapping of
//! its `memfd`, or cross-memory attach). Every access is checked against that key table for
//! the owner's PD, the range and the right before a byte moves, exactly as the same-host
//! responder checks it, so a packet with a guessed or stale key moves nothing.

use crate::mr::access::{self, AtomicOp as NicAtomic, Span};
use crate::mr::keys::PinBy;
use crate::mr::resolve::{Few, pin_range, pin_sges};
use crate::qp::context::XrcRole;
use crate::qp::responder::Responder;
use crate::transport::same_host::RemoteQp;
use crate::types::{AccessFlags, Sge as NicSge};
use rustc_hash::FxHashMap;
use softverbs_roce::transport::{Access, AtomicOp, MemError, Memory, Sge};
use std::sync::Arc;

/// The memory of the engine's QPs, by tag.
#[derive(Default)]
pub(crate) struct HostMemory {
    pub(crate) by_tag: FxHashMap<u32, Arc<RemoteQp>>,
    /// The XRC SRQ receive points it serves, by SRQ number: their tags.
    pub(crate) xrc_points: FxHashMap<u32, u32>,
}

fn need(access: Access) -> AccessFlags {
    match access {
        Access::Write => AccessFlags::REMOTE_WRITE,
        Access::Read => AccessFlags::REMOTE_READ,
        Access::Atomic => AccessFlags::REMOTE_ATOMIC,
    }
}

/// The part `[offset, offset + len)` of the message `spans` hold, as spans (one, not
/// allocated, when a packet lies in one piece, as nearly every packet does).
fn window(spans: &[Span], offset: u64, len: usize) -> Option<Few<Span>> {
    if let Some(s) = spans.first()
        && s.count <= 1
        && offset as usize + len <= s.len
    {
        return Some(Few::Inline(Some(Span::at(
            s.addr + offset as usize,
            len,
            s.pid,
        ))));
    }
    let mut out = Few::new();
    let mut skip = offset as usize;
    let mut left = len;
    let pieces = spans.iter().flat_map(|s| {
        (0..s.count.max(1)).map(move |i| Span::at(s.addr + i * s.stride, s.len, s.pid))
    });
    for p in pieces {
        if left == 0 {
            break;
        }
        if skip >= p.len {
            skip -= p.len;
            continue;
        }
        let n = (p.len - skip).min(left);
        out.push(Span::at(p.addr + skip, n, p.pid));
        left -= n;
        skip = 0;
    }
    (left == 0).then_some(out)
}

/// `f` of `sges` as the NIC's SGEs (converted on the stack for the usual few).
fn with_nic_sges<T>(sges: &[Sge], f: impl FnOnce(&[NicSge]) -> T) -> T {
    let nic = |s: &Sge| NicSge {
        addr: s.addr,
        length: s.len,
        lkey: s.lkey,
    };
    let mut few = [NicSge::default(); 4];
    if sges.len() <= few.len() {
        for (d, s) in few.iter_mut().zip(sges) {
            *d = nic(s);
        }
        f(&few[..sges.len()])
    } else {
        f(&sges.iter().map(nic).collect::<Vec<_>>())
    }
}

impl HostMemory {
    fn qp(&self, tag: u32) -> Result<&RemoteQp, MemError> {
        self.by_tag
            .get(&tag)
            .map(|q| &**q)
            .ok_or(MemError::UnknownKey)
    }

    /// Copies between `src` and `dst` spans.
    /// Runs `f` on the address of the 8-byte word at `va` of `rkey`, pinned with `need`,
    /// while the pin holds. Only a word mapped here can be updated in one piece (a peer's
    /// plain memory, reached by cross-memory attach, cannot), and it must be one aligned
    /// piece.
    fn with_word<T>(
        &self,
        pd: u32,
        rkey: u32,
        va: u64,
        need: AccessFlags,
        f: impl FnOnce(usize) -> T,
    ) -> Result<T, MemError> {
        let q = self.qp(pd)?;
        if va % 8 != 0 {
            return Err(MemError::Misaligned);
        }
        let cell = pin_range(
            q.keys(),
            q.pd_id(),
            q.qpn(),
            rkey,
            va,
            8,
            need,
            PinBy::Count,
            |p, h, n| q.place(p, h, n),
        )
        .ok_or(MemError::NoRights)?;
        match cell.spans() {
            [w] if w.pid == 0 && w.len == 8 && w.count == 1 && w.addr % 8 == 0 => Ok(f(w.addr)),
            _ => Err(MemError::Misaligned),
        }
    }

    fn copy(src: &[Span], dst: &[Span]) -> Result<(), MemError> {
        // SAFETY: every span of registered memory was pinned by the caller (checked against
        // its owner's key table with the right it needs) and the others are the caller's own
        // buffers; mapped spans lie in this process, the others are reached by cross-memory
        // attach, which fails cleanly when the owner is gone.
        match unsafe { access::copy_ordered(src, dst) } {
            Ok(_) => Ok(()),
            Err(_) => Err(MemError::OutOfBounds),
        }
    }
}

impl Memory for HostMemory {
    fn xrc_srq(&self, target: u32, srqn: u32) -> Option<u32> {
        let domain = self.qp(target).ok()?.ctx().xrc_domain(XrcRole::Target)?;
        let tag = *self.xrc_points.get(&srqn)?;
        let point = self.qp(tag).ok()?;
        point.ctx().is_xrc(XrcRole::Srq, domain).then_some(tag)
    }

    fn check(&self, pd: u32, rkey: u32, va: u64, len: u64, access: Access) -> Result<(), MemError> {
        let q = self.qp(pd)?;
        if access == Access::Atomic && va % 8 != 0 {
            return Err(MemError::Misaligned);
        }
        if len == 0 {
            return Ok(());
        }
        pin_range(
            q.keys(),
            q.pd_id(),
            q.qpn(),
            rkey,
            va,
            len,
            need(access),
            PinBy::Count,
            |p, h, n| q.place(p, h, n),
        )
        .map(|_| ())
        .ok_or(MemError::NoRights)
    }

    fn write(&mut self, pd: u32, rkey: u32, va: u64, data: &[u8]) -> Result<(), MemError> {
        if data.is_empty() {
            return Ok(());
        }
        let q = self.qp(pd)?;
        let dst = pin_range(
            q.keys(),
            q.pd_id(),
            q.qpn(),
            rkey,
            va,
            data.len() as u64,
            AccessFlags::REMOTE_WRITE,
            PinBy::Count,
            |p, h, n| q.place(p, h, n),
        )
        .ok_or(MemError::NoRights)?;
        Self::copy(&[Span::of(data)], dst.spans())
    }

    fn read(&self, pd: u32, rkey: u32, va: u64, out: &mut [u8]) -> Result<(), MemError> {
        if out.is_empty() {
            return Ok(());
        }
        let q = self.qp(pd)?;
        let src = pin_range(
            q.keys(),
            q.pd_id(),
            q.qpn(),
            rkey,
            va,
            out.len() as u64,
            AccessFlags::REMOTE_READ,
            PinBy::Count,
            |p, h, n| q.place(p, h, n),
        )
        .ok_or(MemError::NoRights)?;
        Self::copy(
            src.spans(),
            &[Span::local(out.as_mut_ptr() as usize, out.len())],
        )
    }

    fn atomic(&mut self, pd: u32, rkey: u32, va: u64, op: AtomicOp) -> Result<u64, MemError> {
        let op = match op {
            AtomicOp::CompareSwap { compare, swap } => NicAtomic::CmpSwap { compare, swap },
            AtomicOp::FetchAdd { add } => NicAtomic::FetchAdd { add },
        };
        // SAFETY: 8 aligned bytes inside a pinned REMOTE_ATOMIC registration, mapped here.
        self.with_word(pd, rkey, va, AccessFlags::REMOTE_ATOMIC, |w| unsafe {
            access::atomic(w, op)
        })
    }

    fn atomic_write(
        &mut self,
        pd: u32,
        rkey: u32,
        va: u64,
        bytes: [u8; 8],
    ) -> Result<(), MemError> {
        // SAFETY: 8 aligned bytes inside a pinned REMOTE_WRITE registration, mapped here.
        self.with_word(pd, rkey, va, AccessFlags::REMOTE_WRITE, |w| unsafe {
            access::store_u64(w, u64::from_ne_bytes(bytes))
        })
    }

    fn gather(&self, pd: u32, sges: &[Sge], offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        if out.is_empty() {
            return Ok(());
        }
        let q = self.qp(pd)?;
        let spans = with_nic_sges(sges, |sges| {
            pin_sges(
                q.keys(),
                q.pd_id(),
                sges,
                AccessFlags::empty(),
                PinBy::Count,
                |p, h, n| q.place(p, h, n),
            )
        })
        .map_err(|_| MemError::UnknownKey)?;
        let src = window(&spans.spans, offset, out.len()).ok_or(MemError::OutOfBounds)?;
        Self::copy(&src, &[Span::local(out.as_mut_ptr() as usize, out.len())])
    }

    fn scatter(&mut self, pd: u32, sges: &[Sge], offset: u64, data: &[u8]) -> Result<(), MemError> {
        if data.is_empty() {
            return Ok(());
        }
        let q = self.qp(pd)?;
        let spans = with_nic_sges(sges, |sges| {
            pin_sges(
                q.keys(),
                q.recv_pd(),
                sges,
                AccessFlags::LOCAL_WRITE,
                PinBy::Count,
                |p, h, n| q.place(p, h, n),
            )
        })
        .map_err(|_| MemError::NoRights)?;
        let dst = window(&spans.spans, offset, data.len()).ok_or(MemError::OutOfBounds)?;
        Self::copy(&[Span::of(data)], &dst)
    }

    /// An RDMA FLUSH with global placement: see [`KeyTable::flush`](crate::mr::keys::KeyTable::flush).
    fn flush(
        &mut self,
        pd: u32,
        rkey: u32,
        va: u64,
        len: u64,
        whole_region: bool,
    ) -> Result<(), MemError> {
        let q = self.qp(pd)?;
        q.keys()
            .flush(rkey, q.pd_id(), q.qpn(), va, len, whole_region)
            .map_err(|_| MemError::NoRights)
    }

    /// A SEND with Invalidate: the type-2 window `rkey` of the QP's PD is freed.
    fn invalidate(&mut self, pd: u32, rkey: u32) -> Result<(), MemError> {
        let q = self.qp(pd)?;
        q.keys()
            .invalidate_window(rkey, q.pd_id())
            .map_err(|_| MemError::UnknownKey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_cuts_the_message_where_asked() {
        let spans = [Span::local(100, 10), Span::local(200, 5)];
        let w = window(&spans, 8, 4).unwrap();
        assert_eq!(w[..], [Span::local(108, 2), Span::local(200, 2)]);
        // Within the first piece: that piece, cut.
        assert_eq!(window(&spans, 2, 5).unwrap()[..], [Span::local(102, 5)]);
        assert_eq!(window(&spans, 0, 15).unwrap().len(), 2);
        assert!(window(&spans, 10, 6).is_none());
        let strided = [Span {
            addr: 0x1000,
            len: 4,
            pid: 0,
            count: 3,
            stride: 16,
        }];
        let w = window(&strided, 2, 6).unwrap();
        assert_eq!(w[..], [Span::local(0x1002, 2), Span::local(0x1010, 4)]);
    }
}
