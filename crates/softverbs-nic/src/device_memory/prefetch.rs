//! Cache hints for the data path: start moving a line toward this core before the code that
//! needs it runs, so the transfer overlaps other work. A line another process's core wrote
//! last (a ring slot, a peer QP's state) or one evicted among thousands of QPs costs a
//! transfer on every request otherwise. Hints only: a prefetch never faults and changes
//! nothing a program can observe; off x86-64 they do nothing.

/// Starts fetching the cache line of `at` with intent to write it (`PREFETCHW`): one transfer
/// where a read followed by a store would take two (the read's shared copy, then its
/// upgrade).
#[inline(always)]
pub(crate) fn write<T>(at: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads and writes nothing the program can observe, never faults, and
    // leaves registers and flags alone.
    unsafe {
        std::arch::asm!(
            "prefetchw [{0}]",
            in(reg) at as *const T,
            options(nostack, preserves_flags, readonly)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// Starts fetching every cache line of `*at` for reading.
#[inline(always)]
pub(crate) fn read<T>(at: &T) {
    let p = at as *const T as *const u8;
    #[cfg(target_arch = "x86_64")]
    for off in (0..std::mem::size_of::<T>()).step_by(64) {
        // SAFETY: as for `write`; the addresses lie inside `*at`.
        unsafe {
            std::arch::asm!(
                "prefetcht0 [{0}]",
                in(reg) p.wrapping_add(off),
                options(nostack, preserves_flags, readonly)
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
