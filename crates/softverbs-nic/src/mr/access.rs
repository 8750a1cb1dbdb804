//! The memory accessor: the only place the NIC reads or writes registered memory.
//!
//! Callers check keys, bounds and rights (and pin the regions) before they build the spans
//! handed to these functions; a span therefore always lies inside memory its owner registered
//! and cannot deregister until the pin is dropped.
//!
//! Two accessors: plain pointers (this process's memory, or a peer's `memfd` mapped here), and
//! cross-memory attach (`process_vm_readv`/`writev`) for a peer's plain process memory. One
//! system call costs about as much as a whole same-host operation through a mapping, so
//! mapped memory is the fast path and cross-memory attach the fallback.

use crate::mr::ordering::{self, Placement, ScrambledPiece};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};

/// A range of bytes: in this process (`pid` 0), or in process `pid`'s address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub addr: usize,
    pub len: usize,
    pub pid: u32,
    /// Pieces in the span: `count` of `len` bytes, piece `i` at `addr + i * stride` (a layout's
    /// strided data, kept whole so a matrix column costs one span, not one per cell); 1 for a
    /// plain range.
    pub count: usize,
    pub stride: usize,
}

impl Span {
    pub(crate) fn of(bytes: &[u8]) -> Span {
        Span::local(bytes.as_ptr() as usize, bytes.len())
    }

    pub(crate) fn local(addr: usize, len: usize) -> Span {
        Span::at(addr, len, 0)
    }

    /// `len` bytes at `addr` of process `pid` (0: this one).
    pub(crate) fn at(addr: usize, len: usize, pid: u32) -> Span {
        Span {
            addr,
            len,
            pid,
            count: 1,
            stride: 0,
        }
    }

    /// Bytes in the span.
    pub(crate) fn bytes(&self) -> usize {
        self.len * self.count
    }
}

/// `spans` with every strided span split into its pieces: the shape the general copy walks.
#[inline]
fn flat(spans: &[Span]) -> std::borrow::Cow<'_, [Span]> {
    if spans.iter().all(|s| s.count == 1) {
        return std::borrow::Cow::Borrowed(spans);
    }
    let mut out = Vec::with_capacity(spans.iter().map(|s| s.count).sum());
    for s in spans {
        out.extend((0..s.count).map(|i| Span::at(s.addr + i * s.stride, s.len, s.pid)));
    }
    std::borrow::Cow::Owned(out)
}

/// Bytes of `src` and `dst` that a copy moves: as many as both hold.
fn common_bytes(src: &[Span], dst: &[Span]) -> usize {
    let bytes = |v: &[Span]| v.iter().map(Span::bytes).sum::<usize>();
    bytes(src).min(bytes(dst))
}

/// Copies one piece between this process and `pid` with cross-memory attach.
fn pvm_piece(local: usize, remote: usize, n: usize, pid: u32, to_remote: bool) -> Result<(), i32> {
    let l = libc::iovec {
        iov_base: local as *mut libc::c_void,
        iov_len: n,
    };
    let r = libc::iovec {
        iov_base: remote as *mut libc::c_void,
        iov_len: n,
    };
    // SAFETY: the local iovec lies in memory the caller vouched for; the kernel checks the
    // remote one against the peer's mappings and reports EFAULT instead of faulting.
    let done = unsafe {
        if to_remote {
            libc::process_vm_writev(pid as libc::pid_t, &l, 1, &r, 1, 0)
        } else {
            libc::process_vm_readv(pid as libc::pid_t, &l, 1, &r, 1, 0)
        }
    };
    if done == n as isize {
        return Ok(());
    }
    let errno = std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EFAULT);
    if errno == libc::EPERM {
        explain_eperm(pid);
    }
    Err(errno)
}

/// The data path has no caller to return this to, so it says it once on stderr; the
/// operation itself fails with an error completion.
fn explain_eperm(pid: u32) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!(
            "softverbs: the system refused cross-memory attach to process {pid} (EPERM), so \
             RDMA into its plain (non-softverbs) memory fails. Either register memory from \
             `alloc_mr` (shared memory, mapped instead of attached), run both processes as \
             the same user, or relax the ptrace policy: sysctl kernel.yama.ptrace_scope=0."
        );
    }
}

/// Copies from the gathered `src` spans into the scattered `dst` spans, as many bytes as both
/// hold, and returns that count. The final byte is stored last, with release ordering, so a
/// reader that acquires it sees every earlier byte: the strict placement order of RDMA WRITE
/// and SEND that programs polling the last byte of a buffer depend on.
///
/// Spans of another process are reached with cross-memory attach; its failure (the peer is
/// gone, or the system forbids attaching to it) is returned as the errno.
///
/// # Safety
/// Every local `src` span must be valid for reads and every local `dst` span valid for writes
/// for the duration of the call. Spans may overlap (each piece is copied with `memmove`
/// semantics).
pub(crate) unsafe fn copy_ordered(src: &[Span], dst: &[Span]) -> Result<usize, i32> {
    // The common message: one local range to one local range. Copied directly, without the
    // walk's bookkeeping, which cost as much as the copy for a 64-byte WRITE.
    if let ([s], [d]) = (src, dst)
        && (s.pid | d.pid) == 0
        && s.count == 1
        && d.count == 1
    {
        let n = s.len.min(d.len);
        if n > 0 {
            let (from, to, body) = (s.addr as *const u8, d.addr as *mut u8, n - 1);
            // SAFETY: forwarded from the caller: both ranges are valid for `n` bytes.
            unsafe {
                if body <= 64 {
                    copy_small(from, to, body);
                } else {
                    std::ptr::copy(from, to, body);
                }
                fence(Ordering::Release);
                let b = from.add(body).read();
                AtomicU8::from_ptr(to.add(body)).store(b, Ordering::Release);
            }
        }
        return Ok(n);
    }
    let total = common_bytes(src, dst);
    if total == 0 {
        return Ok(0);
    }
    // SAFETY: forwarded from the caller.
    if unsafe { gather_or_scatter(src, dst, total) } {
        return Ok(total);
    }
    let (src, dst) = (flat(src), flat(dst));
    let (src, dst) = (&*src, &*dst);
    let mut walk = Walk::default();
    // SAFETY (both calls): forwarded from the caller.
    walk.run(src, dst, total - 1, |s, d, n| unsafe {
        piece(s, d, n, false)
    })?;
    fence(Ordering::Release);
    walk.run(src, dst, 1, |s, d, n| unsafe { piece(s, d, n, true) })?;
    Ok(total)
}

/// The strict copy of `total` bytes when one side is a single local span and the other a list
/// of local spans (a layout's data gathered into, or scattered from, a plain buffer): one
/// tight loop over the list instead of walking both sides piece by piece. False (nothing
/// copied) for any other shape.
///
/// # Safety
/// As for [`copy_ordered`]; `total` is at most the bytes of each side and at least 1.
unsafe fn gather_or_scatter(src: &[Span], dst: &[Span], total: usize) -> bool {
    let (one, many, gather) = match (src, dst) {
        ([s], [d]) if d.count == 1 && s.count > 1 => (*d, src, true),
        ([s], [d]) if s.count == 1 && d.count > 1 => (*s, dst, false),
        (_, [d]) if src.len() > 1 && d.count == 1 => (*d, src, true),
        ([s], _) if dst.len() > 1 && s.count == 1 => (*s, dst, false),
        _ => return false,
    };
    if one.pid != 0 || many.iter().any(|s| s.pid != 0) {
        return false;
    }
    let mut at = one.addr;
    let mut left = total;
    'spans: for s in many {
        for i in 0..s.count {
            if left == 0 {
                break 'spans;
            }
            let n = s.len.min(left);
            // The final byte goes last, with release ordering, as in `copy_ordered`.
            let body = if n == left { n - 1 } else { n };
            let piece = s.addr + i * s.stride;
            let (from, to) = if gather { (piece, at) } else { (at, piece) };
            // SAFETY: both ranges lie in the caller's valid spans (`n` is within both sides).
            unsafe {
                if body <= 16 {
                    copy_small(from as *const u8, to as *mut u8, body);
                } else {
                    std::ptr::copy(from as *const u8, to as *mut u8, body);
                }
            }
            if body < n {
                fence(Ordering::Release);
                // SAFETY: one valid byte on each side.
                unsafe {
                    let b = ((from + body) as *const u8).read();
                    AtomicU8::from_ptr((to + body) as *mut u8).store(b, Ordering::Release);
                }
            }
            at += n;
            left -= n;
        }
    }
    true
}

/// Copies like [`copy_ordered`], in the order `placement` asks for: strict (final byte last),
/// relaxed (one plain copy, any order) or scrambled (the ordering check: pieces in a scrambled
/// order, final piece first, `observer` called after each piece). Whatever the order, every
/// byte is placed when this returns, so the completion that follows covers all of them.
///
/// # Safety
/// As for [`copy_ordered`].
#[inline]
pub(crate) unsafe fn copy_placed(
    src: &[Span],
    dst: &[Span],
    placement: Placement,
    observer: Option<&(dyn Fn(&ScrambledPiece) + Send + Sync)>,
) -> Result<usize, i32> {
    // Strict order is one of the orders relaxed allows, and the fastest for one range to one
    // range (perftest registers its buffers relaxed) and for a gather.
    let one_to_one = src.len() == 1 && dst.len() == 1;
    if placement == Placement::Strict || (placement == Placement::Relaxed && one_to_one) {
        // SAFETY: forwarded from the caller.
        return unsafe { copy_ordered(src, dst) };
    }
    let total = common_bytes(src, dst);
    match placement {
        // SAFETY: forwarded from the caller.
        Placement::Strict => unsafe { copy_ordered(src, dst) },
        // SAFETY: forwarded from the caller.
        Placement::Relaxed if total > 0 && unsafe { gather_or_scatter(src, dst, total) } => {
            Ok(total)
        }
        Placement::Relaxed => {
            let (src, dst) = (flat(src), flat(dst));
            let (src, dst) = (&*src, &*dst);
            // SAFETY: forwarded from the caller.
            Walk::default().run(src, dst, total, |s, d, n| unsafe { piece(s, d, n, false) })?;
            Ok(total)
        }
        Placement::Scrambled => {
            let (src, dst) = (flat(src), flat(dst));
            let (src, dst) = (&*src, &*dst);
            let len = ordering::piece_len(total);
            let pieces = total.div_ceil(len);
            for (step, index) in ordering::scrambled_order(pieces, ordering::next_seed())
                .into_iter()
                .enumerate()
            {
                let offset = index * len;
                let n = len.min(total - offset);
                let mut walk = Walk::default();
                walk.run(src, dst, offset, |_, _, _| Ok(()))?;
                if offset + n == total {
                    // The final piece still publishes its last byte with release ordering, so
                    // a poller that acquires it sees exactly this piece: torn, as intended,
                    // but never a data race on the byte it polls.
                    // SAFETY: forwarded from the caller.
                    walk.run(src, dst, n - 1, |s, d, k| unsafe { piece(s, d, k, false) })?;
                    fence(Ordering::Release);
                    // SAFETY: forwarded from the caller.
                    walk.run(src, dst, 1, |s, d, k| unsafe { piece(s, d, k, true) })?;
                } else {
                    // SAFETY: forwarded from the caller.
                    walk.run(src, dst, n, |s, d, k| unsafe { piece(s, d, k, false) })?;
                }
                if let Some(observe) = observer {
                    observe(&ScrambledPiece {
                        step,
                        pieces,
                        offset,
                        len: n,
                        message_len: total,
                    });
                }
            }
            Ok(total)
        }
    }
}

/// Position in a gather list and a scatter list walked in step.
#[derive(Default)]
struct Walk {
    si: usize,
    so: usize,
    di: usize,
    d_off: usize,
}

impl Walk {
    /// Hands the next `count` bytes to `f` as pieces contiguous on both sides.
    fn run(
        &mut self,
        src: &[Span],
        dst: &[Span],
        mut count: usize,
        mut f: impl FnMut(Span, Span, usize) -> Result<(), i32>,
    ) -> Result<(), i32> {
        while count > 0 {
            while src[self.si].len == self.so {
                self.si += 1;
                self.so = 0;
            }
            while dst[self.di].len == self.d_off {
                self.di += 1;
                self.d_off = 0;
            }
            let (s, d) = (src[self.si], dst[self.di]);
            let n = (s.len - self.so).min(d.len - self.d_off).min(count);
            f(
                Span {
                    addr: s.addr + self.so,
                    ..s
                },
                Span {
                    addr: d.addr + self.d_off,
                    ..d
                },
                n,
            )?;
            self.so += n;
            self.d_off += n;
            count -= n;
        }
        Ok(())
    }
}

/// Copies `n` bytes from `s.addr` to `d.addr`; `last` marks the final byte of a message,
/// which a local copy publishes with a release store.
///
/// # Safety
/// Local sides must be valid for `n` bytes (reads for `s`, writes for `d`).
#[inline(always)]
unsafe fn piece(s: Span, d: Span, n: usize, last: bool) -> Result<(), i32> {
    // The datum of a layout (a matrix cell) is a small local piece, one per datum: copied
    // here without a call, the rest below.
    if (s.pid | d.pid) == 0 && !last && n <= 16 {
        // SAFETY: both ranges are valid per the caller.
        unsafe { copy_small(s.addr as *const u8, d.addr as *mut u8, n) };
        return Ok(());
    }
    // SAFETY: forwarded from the caller.
    unsafe { piece_other(s, d, n, last) }
}

/// [`piece`] for everything but small local pieces.
///
/// # Safety
/// As for [`piece`].
#[inline(never)]
unsafe fn piece_other(s: Span, d: Span, n: usize, last: bool) -> Result<(), i32> {
    match (s.pid, d.pid) {
        (0, 0) if last => {
            // SAFETY: one valid byte on each side.
            unsafe {
                let b = (s.addr as *const u8).read();
                AtomicU8::from_ptr(d.addr as *mut u8).store(b, Ordering::Release);
            }
            Ok(())
        }
        (0, 0) if n <= 16 => {
            // SAFETY: both ranges are valid per the caller.
            unsafe { copy_small(s.addr as *const u8, d.addr as *mut u8, n) };
            Ok(())
        }
        (0, 0) => {
            // SAFETY: both ranges are valid per the caller.
            unsafe { std::ptr::copy(s.addr as *const u8, d.addr as *mut u8, n) };
            Ok(())
        }
        (0, pid) => pvm_piece(s.addr, d.addr, n, pid, true),
        (pid, 0) => pvm_piece(d.addr, s.addr, n, pid, false),
        // Both sides reached by cross-memory attach (on-demand regions of this process, or
        // of two peers): through a bounce buffer.
        (from, to) => {
            let mut bounce = vec![0u8; n];
            let b = bounce.as_mut_ptr() as usize;
            pvm_piece(b, s.addr, n, from, false)?;
            pvm_piece(b, d.addr, n, to, true)
        }
    }
}

/// Stores `value` into the 8 aligned bytes at `addr` in one piece (RDMA ATOMIC WRITE), with
/// release ordering so the message's earlier bytes are visible first.
///
/// # Safety
/// `addr` must be 8-byte aligned and valid for writes of 8 bytes.
pub(crate) unsafe fn store_u64(addr: usize, value: u64) {
    // SAFETY: as documented.
    unsafe { AtomicU64::from_ptr(addr as *mut u64) }.store(value, Ordering::Release);
}

/// True if `len` bytes at `addr` of this process can be read now (an on-demand page that is
/// mapped, or can be faulted in), probed with cross-memory attach, which answers EFAULT
/// instead of faulting.
pub(crate) fn mapped(addr: usize, len: usize) -> bool {
    let mut probe = [0u8; 8];
    let n = len.min(probe.len());
    pvm_piece(
        probe.as_mut_ptr() as usize,
        addr,
        n,
        std::process::id(),
        false,
    )
    .is_ok()
}

/// `memmove` of at most 64 bytes without a call: layouts of small data (a matrix column of
/// 8-byte cells) copy one such piece per datum, and a 64-byte message one, where the call to
/// `memmove` would cost more than the copy. Every byte is read before any is written, so
/// overlapping ranges are fine.
///
/// # Safety
/// `s` valid for reads and `d` valid for writes of `n <= 64` bytes.
#[inline(always)]
unsafe fn copy_small(s: *const u8, d: *mut u8, n: usize) {
    // SAFETY (every arm): the reads and writes stay inside the `n` bytes at `s` and `d`.
    unsafe {
        match n {
            33..=64 => {
                let (a, b, c, e) = (
                    s.cast::<u128>().read_unaligned(),
                    s.add(16).cast::<u128>().read_unaligned(),
                    s.add(n - 32).cast::<u128>().read_unaligned(),
                    s.add(n - 16).cast::<u128>().read_unaligned(),
                );
                d.cast::<u128>().write_unaligned(a);
                d.add(16).cast::<u128>().write_unaligned(b);
                d.add(n - 32).cast::<u128>().write_unaligned(c);
                d.add(n - 16).cast::<u128>().write_unaligned(e);
            }
            17..=32 => {
                let (a, b) = (
                    s.cast::<u128>().read_unaligned(),
                    s.add(n - 16).cast::<u128>().read_unaligned(),
                );
                d.cast::<u128>().write_unaligned(a);
                d.add(n - 16).cast::<u128>().write_unaligned(b);
            }
            8..=16 => {
                let (a, b) = (
                    s.cast::<u64>().read_unaligned(),
                    s.add(n - 8).cast::<u64>().read_unaligned(),
                );
                d.cast::<u64>().write_unaligned(a);
                d.add(n - 8).cast::<u64>().write_unaligned(b);
            }
            4..=7 => {
                let (a, b) = (
                    s.cast::<u32>().read_unaligned(),
                    s.add(n - 4).cast::<u32>().read_unaligned(),
                );
                d.cast::<u32>().write_unaligned(a);
                d.add(n - 4).cast::<u32>().write_unaligned(b);
            }
            _ => {
                let mut tmp = [0u8; 4];
                std::ptr::copy_nonoverlapping(s, tmp.as_mut_ptr(), n);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), d, n);
            }
        }
    }
}

/// The 64-bit atomic operations of RDMA.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AtomicOp {
    CmpSwap { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
}

/// Performs `op` on the 8 bytes at `addr` and returns their original value. Hardware atomics
/// make it atomic with every other RDMA atomic and with CPU atomics on the same word.
///
/// # Safety
/// `addr` must be 8-byte aligned and valid for reads and writes of 8 bytes.
pub(crate) unsafe fn atomic(addr: usize, op: AtomicOp) -> u64 {
    // SAFETY: aligned and valid per the caller; all concurrent RDMA access to it is atomic.
    let word = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
    match op {
        AtomicOp::CmpSwap { compare, swap } => {
            match word.compare_exchange(compare, swap, Ordering::AcqRel, Ordering::Acquire) {
                Ok(v) | Err(v) => v,
            }
        }
        AtomicOp::FetchAdd { add } => word.fetch_add(add, Ordering::AcqRel),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spans(buf: &mut [u8], cuts: &[usize]) -> Vec<Span> {
        let mut out = Vec::new();
        let mut start = 0;
        let base = buf.as_mut_ptr() as usize;
        for &c in cuts.iter().chain(std::iter::once(&buf.len())) {
            let c = c.clamp(start, buf.len());
            out.push(Span::local(base + start, c - start));
            start = c;
        }
        out
    }

    /// `copy` from `data` cut at `src_cuts` (sorted) into `dst_len` bytes cut at `dst_cuts`
    /// (sorted) must act as a plain copy of the shorter length.
    fn check_plain_copy(
        data: &[u8],
        dst_len: usize,
        src_cuts: &[usize],
        dst_cuts: &[usize],
        copy: impl Fn(&[Span], &[Span]) -> Result<usize, i32>,
    ) -> Result<(), TestCaseError> {
        let mut src = data.to_vec();
        let mut dst = vec![0xAAu8; dst_len];
        let s = spans(&mut src, src_cuts);
        let d = spans(&mut dst, dst_cuts);
        let n = copy(&s, &d).unwrap();
        let expect = data.len().min(dst_len);
        prop_assert_eq!(n, expect);
        prop_assert_eq!(&dst[..n], &data[..n]);
        prop_assert!(dst[n..].iter().all(|&b| b == 0xAA));
        Ok(())
    }

    proptest! {
        #[test]
        fn gather_scatter_is_a_plain_copy(
            data in proptest::collection::vec(any::<u8>(), 0..300),
            dst_len in 0usize..300,
            mut src_cuts in proptest::collection::vec(0usize..300, 0..5),
            mut dst_cuts in proptest::collection::vec(0usize..300, 0..5),
        ) {
            src_cuts.sort();
            dst_cuts.sort();
            // SAFETY: the spans cover live local vectors.
            check_plain_copy(&data, dst_len, &src_cuts, &dst_cuts, |s, d| unsafe {
                copy_ordered(s, d)
            })?;
        }
    }

    proptest! {
        #[test]
        fn every_placement_copies_the_same_bytes(
            data in proptest::collection::vec(any::<u8>(), 0..300),
            dst_len in 0usize..300,
            mut src_cuts in proptest::collection::vec(0usize..300, 0..5),
            mut dst_cuts in proptest::collection::vec(0usize..300, 0..5),
        ) {
            src_cuts.sort();
            dst_cuts.sort();
            for placement in [Placement::Strict, Placement::Relaxed, Placement::Scrambled] {
                // SAFETY: the spans cover live local vectors.
                check_plain_copy(&data, dst_len, &src_cuts, &dst_cuts, |s, d| unsafe {
                    copy_placed(s, d, placement, None)
                })?;
            }
        }
    }

    #[test]
    fn small_copies_are_memmove_at_every_length_and_overlap() {
        for n in 0..=64 {
            for shift in [-9isize, -1, 0, 1, 17] {
                let mut buf = pattern_bytes(200);
                let mut want = buf.clone();
                let (from, to) = (64, (64 + shift) as usize);
                want.copy_within(from..from + n, to);
                let p = buf.as_mut_ptr();
                // SAFETY: both ranges lie inside `buf`.
                unsafe { copy_small(p.add(from), p.add(to), n) };
                assert_eq!(buf, want, "{n} bytes shifted by {shift}");
            }
        }
    }

    #[test]
    fn scrambled_placement_lands_the_final_piece_first() {
        let data = pattern_bytes(1000);
        let mut dst = vec![0u8; 1000];
        let base = dst.as_mut_ptr() as usize;
        let seen = std::sync::Mutex::new(Vec::new());
        let observe = |p: &ScrambledPiece| {
            // SAFETY: the copy is paused in this callback; `dst` is live and only read here.
            let now = unsafe { std::slice::from_raw_parts(base as *const u8, 1000) }.to_vec();
            seen.lock().unwrap().push((*p, now));
        };
        let src = [Span::of(&data)];
        let to = [Span::local(base, 400), Span::local(base + 400, 600)];
        // SAFETY: spans cover live local vectors.
        let n = unsafe { copy_placed(&src, &to, Placement::Scrambled, Some(&observe)) };
        assert_eq!(n, Ok(1000));
        assert_eq!(dst, data);
        let seen = seen.into_inner().unwrap();
        let (first, after_first) = &seen[0];
        assert_eq!(first.step, 0);
        assert_eq!(first.offset + first.len, 1000, "final piece placed first");
        assert_eq!(after_first[999], data[999]);
        assert!(
            after_first[..first.offset].iter().all(|&b| b == 0),
            "rest not yet placed"
        );
        let mut offsets: Vec<usize> = seen.iter().map(|(p, _)| p.offset).collect();
        assert_ne!(
            offsets.windows(2).filter(|w| w[0] < w[1]).count(),
            offsets.len() - 1
        );
        offsets.sort_unstable();
        assert_eq!(offsets.len(), first.pieces);
        let piece = ordering::piece_len(1000);
        assert!(offsets.windows(2).all(|w| w[1] - w[0] == piece));
    }

    #[test]
    fn cross_memory_attach_copies_like_a_local_copy() {
        // Our own pid exercises the process_vm_readv/writev path end to end.
        let me = std::process::id();
        let data = pattern_bytes(300);
        let mut dst = vec![0u8; 300];
        let src = [
            Span::local(data.as_ptr() as usize, 100),
            Span::local(data.as_ptr() as usize + 100, 200),
        ];
        let remote = [
            Span::at(dst.as_mut_ptr() as usize, 250, me),
            Span::at(dst.as_mut_ptr() as usize + 250, 50, me),
        ];
        // SAFETY: all spans cover live local vectors.
        assert_eq!(unsafe { copy_ordered(&src, &remote) }, Ok(300));
        assert_eq!(dst, data);
        let mut back = vec![0u8; 300];
        let local = [Span::local(back.as_mut_ptr() as usize, 300)];
        let from = [Span::at(dst.as_ptr() as usize, 300, me)];
        // SAFETY: as above.
        assert_eq!(unsafe { copy_ordered(&from, &local) }, Ok(300));
        assert_eq!(back, data);
        // An address the peer does not map is an error, not a fault.
        let bad = [Span::at(8, 16, me)];
        // SAFETY: the local side is valid; the bad side is only touched by the kernel.
        assert!(unsafe { copy_ordered(&src, &bad) }.is_err());
    }

    #[test]
    fn strided_spans_gather_and_scatter_in_every_placement() {
        // A 10-row "column" of 3-byte data, 16 bytes apart, in a 160-byte matrix.
        let matrix = pattern_bytes(160);
        let column: Vec<u8> = (0..10)
            .flat_map(|r| matrix[r * 16..][..3].to_vec())
            .collect();
        let strided = |addr: usize, pid: u32| Span {
            count: 10,
            stride: 16,
            ..Span::at(addr, 3, pid)
        };
        let me = std::process::id();
        for placement in [Placement::Strict, Placement::Relaxed, Placement::Scrambled] {
            for pid in [0, me] {
                // Gather: the column into a contiguous buffer (and 2 bytes short of it).
                for want in [30usize, 28] {
                    let mut out = vec![0u8; want];
                    let src = [strided(matrix.as_ptr() as usize, pid)];
                    let dst = [Span::local(out.as_mut_ptr() as usize, want)];
                    // SAFETY: the spans cover live local vectors.
                    let n = unsafe { copy_placed(&src, &dst, placement, None) };
                    assert_eq!(n, Ok(want), "{placement:?} pid {pid}");
                    assert_eq!(out, column[..want], "{placement:?} pid {pid}");
                }
                // Scatter: contiguous bytes into the column; the rest of the matrix untouched.
                let mut m = matrix.clone();
                let fresh = vec![0xeeu8; 30];
                let src = [Span::of(&fresh)];
                let dst = [strided(m.as_mut_ptr() as usize, pid)];
                // SAFETY: as above.
                assert_eq!(unsafe { copy_placed(&src, &dst, placement, None) }, Ok(30));
                for (i, b) in m.iter().enumerate() {
                    let in_column = i % 16 < 3 && i < 160;
                    assert_eq!(*b, if in_column { 0xee } else { matrix[i] }, "byte {i}");
                }
            }
        }
    }

    fn pattern_bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn atomics_return_the_original() {
        let mut w = 5u64;
        let a = &mut w as *mut u64 as usize;
        // SAFETY: a live aligned local.
        unsafe {
            assert_eq!(atomic(a, AtomicOp::FetchAdd { add: 3 }), 5);
            assert_eq!(
                atomic(
                    a,
                    AtomicOp::CmpSwap {
                        compare: 8,
                        swap: 1
                    }
                ),
                8
            );
            assert_eq!(
                atomic(
                    a,
                    AtomicOp::CmpSwap {
                        compare: 8,
                        swap: 2
                    }
                ),
                1
            );
        }
        assert_eq!(w, 1);
    }
}
