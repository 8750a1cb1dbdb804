//! Device memory: `memfd` segments mapped shared, holding `#[repr(C)]` plain data.
//!
//! Every ring and table the NIC keeps (CQ rings, receive queues, the key table) lives in one of
//! these, addressed by offsets, so that another process that maps the same `memfd` can act on
//! it. Types placed here implement [`ShmPlain`]: valid when all-zero, no pointers, and mutated
//! only through atomics once shared.

use crate::error::{Error, Result};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{MemfdFlags, ftruncate, memfd_create};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};
use std::ptr::NonNull;

/// Marker for types that may live in a shared segment.
///
/// # Safety
/// The type must be `#[repr(C)]`, valid for the all-zero bit pattern, contain no pointers or
/// references, and have interior mutability only through atomics or `UnsafeCell` fields whose
/// accesses are ordered by atomics.
pub unsafe trait ShmPlain: Sync {}

/// A shared, zero-initialised mapping of a `memfd`.
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory; all typed access goes through `ShmPlain` types,
// which synchronise through atomics.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates a segment of at least `len` bytes (rounded up to a page), filled with zeros.
    pub fn create(name: &str, len: usize) -> Result<Segment> {
        let len = len.max(1).next_multiple_of(page_size());
        let fd = memfd_create(name, MemfdFlags::CLOEXEC).map_err(Error::os("memfd_create"))?;
        ftruncate(&fd, len as u64).map_err(Error::os("ftruncate"))?;
        let ptr = map_shared(&fd, len)?;
        Ok(Segment { ptr, len, fd })
    }

    /// Maps an existing `memfd` (ours, or a peer's opened through `/proc/<pid>/fd/<n>`),
    /// all of it.
    pub fn open(fd: OwnedFd) -> Result<Segment> {
        let st = rustix::fs::fstat(&fd).map_err(Error::os("fstat"))?;
        let len = usize::try_from(st.st_size)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| Error::InvalidArgument("shared segment is empty".into()))?;
        let ptr = map_shared(&fd, len)?;
        Ok(Segment { ptr, len, fd })
    }

    /// The inode of the `memfd`: with the owner's pid and descriptor number it identifies the
    /// segment, so a peer never mistakes a recycled descriptor for it.
    pub fn inode(&self) -> u64 {
        rustix::fs::fstat(&self.fd).map_or(0, |s| s.st_ino)
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: segments have at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The `memfd`, for handing the segment to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A reference to the `T` at `offset`.
    ///
    /// Offsets are computed by the NIC from its own layouts, so a bad one is a bug and panics.
    pub fn at<T: ShmPlain>(&self, offset: usize) -> &T {
        self.slice::<T>(offset, 1).first().expect("count is 1")
    }

    /// `count` consecutive `T`s starting at `offset`.
    pub fn slice<T: ShmPlain>(&self, offset: usize, count: usize) -> &[T] {
        let size = std::mem::size_of::<T>()
            .checked_mul(count)
            .and_then(|s| s.checked_add(offset));
        assert!(
            size.is_some_and(|end| end <= self.len),
            "segment layout out of bounds"
        );
        assert_eq!(offset % std::mem::align_of::<T>(), 0, "misaligned layout");
        // SAFETY: in bounds and aligned (checked above); the memory is initialised (zero pages
        // at creation, then only written through `ShmPlain` types' atomics), and `ShmPlain`
        // says all-zero is a valid `T`. The reference lives no longer than `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset).cast::<T>(), count) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range in `create` and hand out no references that
        // outlive `self`.
        let _ = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Maps `len` bytes of `fd` shared, read-write, at an address the kernel picks.
fn map_shared(fd: &OwnedFd, len: usize) -> Result<NonNull<u8>> {
    // SAFETY: a fresh mapping aliases nothing in this process; all typed access to it goes
    // through `ShmPlain` types.
    let ptr = unsafe {
        mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .map_err(Error::os("mmap"))?;
    NonNull::new(ptr.cast::<u8>()).ok_or(Error::Os {
        what: "mmap",
        errno: rustix::io::Errno::NOMEM,
    })
}

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

// SAFETY: atomics are valid when zero and carry their own synchronisation.
unsafe impl ShmPlain for std::sync::atomic::AtomicU64 {}
// SAFETY: as above.
unsafe impl ShmPlain for std::sync::atomic::AtomicU32 {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn segment_is_zeroed_and_shared_through_fd() {
        let seg = Segment::create("test", 100).unwrap();
        assert_eq!(seg.len(), page_size());
        let words: &[AtomicU64] = seg.slice(0, 4);
        assert!(words.iter().all(|w| w.load(Ordering::Relaxed) == 0));
        words[3].store(42, Ordering::Relaxed);
        // A second mapping of the same memfd sees the write: the layout is shareable.
        let mut buf = [0u8; 8];
        rustix::io::pread(seg.fd(), &mut buf, 24).unwrap();
        assert_eq!(u64::from_ne_bytes(buf), 42);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_layout_is_caught() {
        let seg = Segment::create("test", 64).unwrap();
        let _ = seg.slice::<AtomicU64>(seg.len() - 8, 2);
    }
}
