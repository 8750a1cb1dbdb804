//! Device memory: shared mappings holding `#[repr(C)]` plain data.
//!
//! Every ring and table the NIC keeps (CQ rings, receive queues, the key table) lives in a
//! segment, addressed by offsets, so that another process that maps the same `memfd` can act
//! on it. A segment is a range of a `memfd`: a block of the process's arena
//! ([`super::arena`]) for the small ones, which share a few files, or a file of its own for
//! the large ones. Types placed here implement [`ShmPlain`]: valid when all-zero, no
//! pointers, and mutated only through atomics once shared.

use super::arena::{self, Block, Chunk};
use super::export::PeerCache;
use crate::error::{Error, Result};
use rustix::fd::{BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

/// Marker for types that may live in a shared segment.
///
/// # Safety
/// The type must be `#[repr(C)]`, valid for the all-zero bit pattern, contain no pointers or
/// references, and have interior mutability only through atomics or `UnsafeCell` fields whose
/// accesses are ordered by atomics.
pub unsafe trait ShmPlain: Sync {}

/// A shared, zero-initialised range of a mapped `memfd`.
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    offset: usize,
    chunk: Arc<Chunk>,
    /// The arena block this segment is, given back when it drops (`None`: a file of its
    /// own, or another process's memory).
    _block: Option<Block>,
}

// SAFETY: the mapping is plain shared memory; all typed access goes through `ShmPlain` types,
// which synchronise through atomics.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates a segment of at least `len` bytes, filled with zeros: an arena block, or for
    /// more than [`arena::LARGEST`] bytes a `memfd` of its own (rounded up to a page).
    pub fn create(name: &str, len: usize) -> Result<Segment> {
        if len <= arena::LARGEST {
            let block = arena::alloc(name, len)?;
            let chunk = block.chunk.clone();
            let offset = block.offset;
            return Ok(Segment::view(chunk, offset, len.max(1), Some(block)));
        }
        Segment::create_file(name, len)
    }

    /// Creates a segment that is a `memfd` of its own, at least `len` bytes (a page
    /// multiple): for memory handed over as a descriptor alone (a context's command
    /// descriptor, the host engine's state).
    pub fn create_file(name: &str, len: usize) -> Result<Segment> {
        let len = len.max(1).next_multiple_of(page_size());
        let chunk = Arc::new(Chunk::create(name, len)?);
        Ok(Segment::view(chunk, 0, len, None))
    }

    fn view(chunk: Arc<Chunk>, offset: usize, len: usize, block: Option<Block>) -> Segment {
        debug_assert!(offset + len <= chunk.len());
        // SAFETY: offset + len is within the chunk's mapping (callers check it).
        let ptr = unsafe { NonNull::new_unchecked(chunk.ptr().as_ptr().add(offset)) };
        Segment {
            ptr,
            len,
            offset,
            chunk,
            _block: block,
        }
    }

    /// Maps an existing `memfd` (ours, or a peer's opened through `/proc/<pid>/fd/<n>`),
    /// all of it.
    pub fn open(fd: OwnedFd) -> Result<Segment> {
        let chunk = Arc::new(Chunk::map(fd)?);
        let len = chunk.len();
        Ok(Segment::view(chunk, 0, len, None))
    }

    /// The `len` bytes at `offset` of descriptor `fd` of process `pid` (which must still be
    /// the file with inode `ino`): each such file is mapped once in this process, however
    /// many segments of it are opened.
    pub(crate) fn open_peer(
        pid: u32,
        fd: i32,
        ino: u64,
        offset: usize,
        len: usize,
    ) -> Result<Segment> {
        let chunk = Segment::peer_file(pid, fd, ino)?;
        let fits = offset
            .checked_add(len)
            .is_some_and(|end| len > 0 && end <= chunk.len());
        if !fits {
            return Err(Error::InvalidArgument(
                "peer segment outside its file".into(),
            ));
        }
        // Every segment starts on an arena unit; one that does not is the peer's garbage,
        // and the typed views of it (`at`, `slice`) would panic on its misalignment.
        if offset % arena::UNIT != 0 {
            return Err(Error::InvalidArgument("peer segment misaligned".into()));
        }
        Ok(Segment::view(chunk, offset, len, None))
    }

    /// All of descriptor `fd` of process `pid` (still the file with inode `ino`), mapped once
    /// in this process as [`open_peer`](Self::open_peer) maps it.
    pub(crate) fn open_peer_file(pid: u32, fd: i32, ino: u64) -> Result<Segment> {
        let chunk = Segment::peer_file(pid, fd, ino)?;
        let len = chunk.len();
        Ok(Segment::view(chunk, 0, len, None))
    }

    /// The mapping of a peer's file, shared by every segment of it in this process: a peer
    /// costs a descriptor per file of its, not per object in them.
    fn peer_file(pid: u32, fd: i32, ino: u64) -> Result<Arc<Chunk>> {
        static MAPPED: PeerCache<Chunk> = PeerCache::new();
        MAPPED.get_or_open((pid, fd, ino), || {
            Chunk::map(super::export::open_peer_fd(pid, fd, ino, false)?)
        })
    }

    /// This segment mapped again, as a peer would map it.
    #[cfg(test)]
    pub(crate) fn reopen(&self) -> Result<Segment> {
        use std::os::fd::AsRawFd;
        let fd = self.fd().as_raw_fd();
        Segment::open_peer(std::process::id(), fd, self.inode(), self.offset, self.len)
    }

    /// The inode of the `memfd`: with the owner's pid and descriptor number it identifies the
    /// file, so a peer never mistakes a recycled descriptor for it.
    pub fn inode(&self) -> u64 {
        self.chunk.ino()
    }

    /// Where the segment starts in its `memfd`.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length of the segment in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: segments have at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Start of the segment.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The `memfd` the segment is in, for handing it to another process (with
    /// [`offset`](Self::offset) and [`len`](Self::len)).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.chunk.fd()
    }

    /// A reference to the `T` at `offset`.
    ///
    /// Offsets are computed by the NIC from its own layouts, so a bad one is a bug and panics.
    #[inline(always)]
    pub fn at<T: ShmPlain>(&self, offset: usize) -> &T {
        // The checks of `slice` for one item, in the fewest instructions: every ring slot,
        // key entry and QP context a request touches comes through here.
        let fits = offset <= self.len.wrapping_sub(std::mem::size_of::<T>())
            && std::mem::size_of::<T>() <= self.len;
        assert!(fits, "segment layout out of bounds");
        let p = self.ptr.as_ptr().wrapping_add(offset);
        assert!(
            (p as usize) & (std::mem::align_of::<T>() - 1) == 0,
            "misaligned layout"
        );
        // SAFETY: in bounds and aligned (checked above), initialised and valid as for
        // `slice`; the reference lives no longer than `self`, which keeps the mapping alive.
        unsafe { &*p.cast::<T>() }
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
        assert_eq!(
            (self.ptr.as_ptr() as usize + offset) % std::mem::align_of::<T>(),
            0,
            "misaligned layout"
        );
        // SAFETY: in bounds and aligned (checked above); the memory is initialised (zero pages
        // at creation, then only written through `ShmPlain` types' atomics), and `ShmPlain`
        // says all-zero is a valid `T`. The reference lives no longer than `self`, which keeps
        // the mapping alive.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset).cast::<T>(), count) }
    }
}

/// A segment that holds one `T` at its start, reached in one load: a requester among
/// thousands of connections reads each QP's context through one of these, and the
/// segment's own fields (behind an `Arc`, for the CQs that name the context) were one more
/// cache miss per request.
pub(crate) struct Head<T: ShmPlain> {
    at: NonNull<T>,
    /// Keeps the mapping `at` points into.
    _seg: Arc<Segment>,
}

// SAFETY: a shared `&T` is all it hands out, and `T: ShmPlain` is `Sync`.
unsafe impl<T: ShmPlain> Send for Head<T> {}
// SAFETY: as above.
unsafe impl<T: ShmPlain> Sync for Head<T> {}

impl<T: ShmPlain> Head<T> {
    /// The `T` at the start of `seg` (which must hold one: bounds and alignment are checked
    /// here, once).
    pub(crate) fn new(seg: Arc<Segment>) -> Head<T> {
        let at = NonNull::from(seg.at::<T>(0));
        Head { at, _seg: seg }
    }

    #[inline]
    pub(crate) fn get(&self) -> &T {
        // SAFETY: `at` is what `Segment::at` returned for this mapping (in bounds, aligned,
        // valid), and the mapping lives as long as `_seg`, which `self` holds.
        unsafe { self.at.as_ref() }
    }
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
        assert_eq!(seg.len(), 100);
        let words: &[AtomicU64] = seg.slice(0, 4);
        assert!(words.iter().all(|w| w.load(Ordering::Relaxed) == 0));
        words[3].store(42, Ordering::Relaxed);
        // A second mapping of the same memfd sees the write: the layout is shareable.
        let mut buf = [0u8; 8];
        rustix::io::pread(seg.fd(), &mut buf, seg.offset() as u64 + 24).unwrap();
        assert_eq!(u64::from_ne_bytes(buf), 42);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_layout_is_caught() {
        let seg = Segment::create("test", 64).unwrap();
        let _ = seg.slice::<AtomicU64>(seg.len() - 8, 2);
    }

    /// A peer that names a segment off an arena unit gets an error, not a panic in this
    /// process's first typed read of it.
    #[test]
    fn a_misaligned_peer_segment_is_refused() {
        use std::os::fd::AsRawFd;
        let seg = Segment::create("test", 1024).unwrap();
        let (me, fd, ino) = (std::process::id(), seg.fd().as_raw_fd(), seg.inode());
        let at = seg.offset();
        assert!(Segment::open_peer(me, fd, ino, at, 512).is_ok());
        match Segment::open_peer(me, fd, ino, at + 4, 64) {
            Err(e) => assert!(e.to_string().contains("misaligned"), "{e}"),
            Ok(_) => panic!("a segment 4 bytes off its unit was opened"),
        }
    }

    #[test]
    fn a_head_reads_the_start_of_its_segment_and_checks_it_fits() {
        let seg = Arc::new(Segment::create("test", 64).unwrap());
        let head: Head<AtomicU64> = Head::new(seg.clone());
        head.get().store(9, Ordering::Relaxed);
        assert_eq!(seg.at::<AtomicU64>(0).load(Ordering::Relaxed), 9);
        // It keeps the mapping: the value is still there once it alone holds the segment.
        drop(seg);
        assert_eq!(head.get().load(Ordering::Relaxed), 9);
        let tiny = Arc::new(Segment::create("test", 4).unwrap());
        assert!(std::panic::catch_unwind(|| Head::<AtomicU64>::new(tiny)).is_err());
    }

    #[test]
    fn one_item_is_reached_to_the_last_byte_and_no_further() {
        let seg = Segment::create("test", 64).unwrap();
        let last: &AtomicU64 = seg.at(seg.len() - 8);
        last.store(7, Ordering::Relaxed);
        assert_eq!(
            seg.slice::<AtomicU64>(seg.len() - 8, 1)[0].load(Ordering::Relaxed),
            7
        );
        for (offset, why) in [
            (seg.len() - 7, "out of bounds"),
            (seg.len(), "out of bounds"),
            (usize::MAX - 3, "out of bounds"),
            (4, "misaligned"),
        ] {
            let caught = std::panic::catch_unwind(|| {
                let _: &AtomicU64 = seg.at(offset);
            });
            let msg = caught.expect_err("must panic");
            let msg = msg.downcast_ref::<&str>().copied().unwrap_or_default();
            assert!(msg.contains(why), "offset {offset}: {msg}");
        }
    }
}
