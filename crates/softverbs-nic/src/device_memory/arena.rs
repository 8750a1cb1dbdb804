//! The process's device-memory arena: the small segments of every QP, CQ and SRQ carved out of
//! a few large `memfd`s, so that objects cost no file descriptor each (a program under the
//! default `ulimit -n` of 1024 holds tens of thousands of QPs) and a peer maps each arena file
//! once, however many of our objects it reaches.
//!
//! An arena file ("chunk") is a sparse `memfd` of [`CHUNK`] bytes mapped whole: only pages an
//! object touches use memory. Blocks come in power-of-two size classes from [`UNIT`] to
//! [`LARGEST`] bytes; a freed block is first held back for [`QUARANTINE`] (a peer that looked
//! the object up just before it was destroyed may still be finishing an operation on it), then
//! its pages are released to the kernel (`fallocate` punching a hole, which also makes it read
//! as zeros again) and it serves the next object of its class.
//!
//! The first [`MAP_BYTES`] of each chunk are a tag per unit, so that a process inspecting us
//! from outside (`softverbs inspect`) can tell which blocks are CQ rings without our help.

use crate::error::{Error, Result};
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{FallocateFlags, MemfdFlags, fallocate, ftruncate, memfd_create};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Bytes of one arena file (virtual: the file is sparse).
pub const CHUNK: usize = 256 << 20;
/// The smallest block, and the alignment of every block.
pub const UNIT: usize = 256;
/// The largest block; larger segments get a `memfd` of their own.
pub const LARGEST: usize = 1 << 20;
/// The tag map at the start of every chunk: one byte per unit.
pub const MAP_BYTES: usize = CHUNK / UNIT;
/// How long a freed block waits before it is reused.
pub const QUARANTINE: Duration = Duration::from_secs(1);

const CLASSES: usize = (LARGEST / UNIT).trailing_zeros() as usize + 1;

/// What a block holds, as its tag says (the tag's upper three bits; the lower five are the
/// size class + 1, so a zero byte is a unit no block starts at).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    CqRing = 1,
    Other = 2,
}

impl Kind {
    fn of_name(name: &str) -> Kind {
        if name.starts_with("softverbs-cq") {
            Kind::CqRing
        } else {
            Kind::Other
        }
    }
}

/// A tag byte read from a chunk's map: the kind and byte length of the block starting there.
pub fn decode_tag(tag: u8) -> Option<(Kind, usize)> {
    let class = usize::from(tag & 0x1f).checked_sub(1)?;
    let kind = match tag >> 5 {
        1 => Kind::CqRing,
        2 => Kind::Other,
        _ => return None,
    };
    (class < CLASSES).then_some((kind, UNIT << class))
}

/// A shared mapping of a whole `memfd`: an arena chunk, a large segment's own file, or a
/// peer's file mapped here.
pub(crate) struct Chunk {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
    ino: u64,
}

// SAFETY: the mapping is plain shared memory; typed access goes through `ShmPlain` types,
// which synchronise through atomics.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

impl Chunk {
    /// A new zero-filled `memfd` of `len` bytes (a page multiple), mapped.
    pub(crate) fn create(name: &str, len: usize) -> Result<Chunk> {
        let fd = memfd_create(name, MemfdFlags::CLOEXEC).map_err(Error::os("memfd_create"))?;
        ftruncate(&fd, len as u64).map_err(Error::os("ftruncate"))?;
        Chunk::map(fd)
    }

    /// Maps all of `fd`.
    pub(crate) fn map(fd: OwnedFd) -> Result<Chunk> {
        let st = rustix::fs::fstat(&fd).map_err(Error::os("fstat"))?;
        let len = usize::try_from(st.st_size)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| Error::InvalidArgument("shared segment is empty".into()))?;
        let ptr = map_shared(&fd, len)?;
        Ok(Chunk {
            ptr,
            len,
            fd,
            ino: st.st_ino,
        })
    }

    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The descriptor (for a peer's file, ours of it: a third process opens it through us).
    pub(crate) fn fd(&self) -> rustix::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn ino(&self) -> u64 {
        self.ino
    }

    fn tag(&self, offset: usize) -> &std::sync::atomic::AtomicU8 {
        assert!(self.len == CHUNK && offset % UNIT == 0 && offset < CHUNK);
        // SAFETY: in bounds of the mapping (checked: the map is the chunk's first MAP_BYTES,
        // one byte per unit of CHUNK); an AtomicU8 has no alignment need and every byte value
        // is valid; the reference lives no longer than `self`.
        unsafe { &*self.ptr.as_ptr().add(offset / UNIT).cast() }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range and hand out no references that outlive the
        // chunk (segments hold it through an `Arc`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Maps `len` bytes of `fd` shared, read-write, at an address the kernel picks.
fn map_shared(fd: &OwnedFd, len: usize) -> Result<NonNull<u8>> {
    use rustix::mm::{MapFlags, ProtFlags, mmap};
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

/// A block handed out by the arena: where it is, and its class (for giving it back).
pub(crate) struct Block {
    pub(crate) chunk: Arc<Chunk>,
    pub(crate) offset: usize,
    class: usize,
}

impl Drop for Block {
    fn drop(&mut self) {
        arena().free(self);
    }
}

struct Freed {
    chunk: Arc<Chunk>,
    offset: usize,
    class: usize,
    at: Instant,
}

#[derive(Default)]
struct State {
    chunks: Vec<Arc<Chunk>>,
    /// Next never-used byte of the last chunk.
    bump: usize,
    free: [Vec<(Arc<Chunk>, usize)>; CLASSES],
    quarantine: VecDeque<Freed>,
    /// Bytes in live blocks, for the memory figures.
    live: usize,
}

/// Bytes the arena holds in live blocks, and how many chunks it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub live_bytes: usize,
    pub chunks: usize,
}

struct Arena {
    state: Mutex<State>,
}

fn arena() -> &'static Arena {
    static ARENA: OnceLock<Arena> = OnceLock::new();
    ARENA.get_or_init(|| Arena {
        state: Mutex::new(State::default()),
    })
}

/// The arena's usage now.
pub fn usage() -> Usage {
    let s = arena().state.lock().unwrap_or_else(|e| e.into_inner());
    Usage {
        live_bytes: s.live,
        chunks: s.chunks.len(),
    }
}

/// A zero-filled block of at least `len` bytes (at most [`LARGEST`]), tagged as `name` says.
pub(crate) fn alloc(name: &str, len: usize) -> Result<Block> {
    let class = class_of(len);
    let a = arena();
    let mut s = a.state.lock().unwrap_or_else(|e| e.into_inner());
    if s.free[class].is_empty() {
        s.reclaim(Instant::now());
    }
    let (chunk, offset) = match s.free[class].pop() {
        Some(b) => b,
        None => s.carve(class)?,
    };
    s.live += UNIT << class;
    drop(s);
    chunk.tag(offset).store(
        ((Kind::of_name(name) as u8) << 5) | (class as u8 + 1),
        std::sync::atomic::Ordering::Release,
    );
    Ok(Block {
        chunk,
        offset,
        class,
    })
}

fn class_of(len: usize) -> usize {
    let units = len.max(1).div_ceil(UNIT).next_power_of_two();
    units.trailing_zeros() as usize
}

impl State {
    /// Never-used space for a block of `class`, in the last chunk or a new one. Blocks of a
    /// page or more start on a page, so releasing one releases whole pages.
    fn carve(&mut self, class: usize) -> Result<(Arc<Chunk>, usize)> {
        let size = UNIT << class;
        let align = size.min(crate::device_memory::segment::page_size());
        let at = self.bump.next_multiple_of(align);
        if self.chunks.is_empty() || at + size > CHUNK {
            let chunk = Chunk::create("softverbs-arena", CHUNK)?;
            self.chunks.push(Arc::new(chunk));
            self.bump = MAP_BYTES;
            return self.carve(class);
        }
        self.bump = at + size;
        let chunk = self.chunks.last().expect("a chunk exists").clone();
        Ok((chunk, at))
    }

    /// Makes the blocks whose quarantine is over free again, zeroed.
    fn reclaim(&mut self, now: Instant) {
        while self
            .quarantine
            .front()
            .is_some_and(|f| now.duration_since(f.at) >= QUARANTINE)
        {
            let f = self.quarantine.pop_front().expect("front exists");
            let size = UNIT << f.class;
            // Punching a hole frees the pages and makes the range read as zeros: a block is
            // handed out zero-filled, as a new memfd would be. Should the kernel refuse, the
            // block is not reused (it was not zeroed).
            let punched = fallocate(
                f.chunk.fd(),
                FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
                f.offset as u64,
                size as u64,
            );
            if punched.is_ok() {
                self.free[f.class].push((f.chunk, f.offset));
            }
        }
    }
}

impl Arena {
    fn free(&self, b: &Block) {
        b.chunk
            .tag(b.offset)
            .store(0, std::sync::atomic::Ordering::Release);
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.live -= UNIT << b.class;
        s.quarantine.push_back(Freed {
            chunk: b.chunk.clone(),
            offset: b.offset,
            class: b.class,
            at: Instant::now(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_to_powers_of_two_units() {
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(UNIT), 0);
        assert_eq!(class_of(UNIT + 1), 1);
        assert_eq!(class_of(LARGEST), CLASSES - 1);
        assert_eq!(decode_tag((2 << 5) | 3), Some((Kind::Other, UNIT * 4)));
        assert_eq!(decode_tag(0), None);
    }

    #[test]
    fn blocks_share_one_descriptor_and_come_back_zeroed_after_quarantine() {
        let a = alloc("softverbs-test", 300).unwrap();
        let b = alloc("softverbs-cq-test", 300).unwrap();
        assert!(Arc::ptr_eq(&a.chunk, &b.chunk), "one chunk serves both");
        assert_ne!(a.offset, b.offset);
        assert_eq!(a.offset % 512, 0);
        assert_eq!(
            decode_tag(
                b.chunk
                    .tag(b.offset)
                    .load(std::sync::atomic::Ordering::Acquire)
            ),
            Some((Kind::CqRing, 512))
        );
        // SAFETY: the block is ours, in bounds, and nothing else uses it.
        unsafe { a.chunk.ptr().as_ptr().add(a.offset).write_bytes(0xab, 300) };
        let (chunk, offset) = (a.chunk.clone(), a.offset);
        drop(a);
        let mut s = arena().state.lock().unwrap();
        s.reclaim(Instant::now() + QUARANTINE);
        assert!(
            s.free[1]
                .iter()
                .any(|(c, o)| Arc::ptr_eq(c, &chunk) && *o == offset)
        );
        // SAFETY: in bounds of the chunk; read only, under the lock, so nobody was handed
        // the block since it was reclaimed.
        let byte = unsafe { chunk.ptr().as_ptr().add(offset).read_volatile() };
        assert_eq!(byte, 0, "a reclaimed block reads as zeros");
        drop(s);
    }
}
