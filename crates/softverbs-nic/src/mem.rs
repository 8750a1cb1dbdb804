//! The memory accessor: the only place the NIC reads or writes registered memory.
//!
//! Callers check keys, bounds and rights (and pin the regions) before they build the spans
//! handed to these functions; a span therefore always lies inside memory its owner registered
//! and cannot deregister until the pin is dropped.
//!
//! This is the same-process accessor (plain pointers). Other accessors (shared mappings,
//! cross-memory attach) take the same spans once peers live in other processes.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};

/// A range of bytes in this process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub addr: usize,
    pub len: usize,
}

impl Span {
    pub(crate) fn of(bytes: &[u8]) -> Span {
        Span {
            addr: bytes.as_ptr() as usize,
            len: bytes.len(),
        }
    }
}

/// Copies from the gathered `src` spans into the scattered `dst` spans, as many bytes as both
/// hold, and returns that count. The final byte is stored last, with release ordering, so a
/// reader that acquires it sees every earlier byte: the strict placement order of RDMA WRITE
/// and SEND that programs polling the last byte of a buffer depend on.
///
/// # Safety
/// Every `src` span must be valid for reads and every `dst` span valid for writes for the
/// duration of the call. Spans may overlap (each piece is copied with `memmove` semantics).
pub(crate) unsafe fn copy_ordered(src: &[Span], dst: &[Span]) -> usize {
    let total = src
        .iter()
        .map(|s| s.len)
        .sum::<usize>()
        .min(dst.iter().map(|s| s.len).sum());
    if total == 0 {
        return 0;
    }
    let body = total - 1;
    let (mut si, mut so, mut di, mut d_off) = (0usize, 0usize, 0usize, 0usize);
    let mut done = 0usize;
    while done < body {
        // Skip exhausted (or empty) spans.
        while src[si].len == so {
            si += 1;
            so = 0;
        }
        while dst[di].len == d_off {
            di += 1;
            d_off = 0;
        }
        let n = (src[si].len - so).min(dst[di].len - d_off).min(body - done);
        // SAFETY: both ranges lie inside spans the caller vouched for.
        unsafe {
            std::ptr::copy(
                (src[si].addr + so) as *const u8,
                (dst[di].addr + d_off) as *mut u8,
                n,
            );
        }
        so += n;
        d_off += n;
        done += n;
    }
    while src[si].len == so {
        si += 1;
        so = 0;
    }
    while dst[di].len == d_off {
        di += 1;
        d_off = 0;
    }
    // SAFETY: in bounds of the current spans (there is exactly one byte left in each walk).
    unsafe {
        let last = ((src[si].addr + so) as *const u8).read();
        fence(Ordering::Release);
        AtomicU8::from_ptr((dst[di].addr + d_off) as *mut u8).store(last, Ordering::Release);
    }
    total
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
            out.push(Span {
                addr: base + start,
                len: c - start,
            });
            start = c;
        }
        out
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
            let mut src = data.clone();
            let mut dst = vec![0xAAu8; dst_len];
            let s = spans(&mut src, &src_cuts);
            let d = spans(&mut dst, &dst_cuts);
            // SAFETY: spans cover live local vectors.
            let n = unsafe { copy_ordered(&s, &d) };
            let expect = data.len().min(dst_len);
            prop_assert_eq!(n, expect);
            prop_assert_eq!(&dst[..n], &data[..n]);
            prop_assert!(dst[n..].iter().all(|&b| b == 0xAA));
        }
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
