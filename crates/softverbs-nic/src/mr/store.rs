//! Non-contiguous memory regions in the NIC: storing layouts where every process can read
//! them, and reading them back on the data path.
//!
//! The pure engine ([`crate::mr::layout`]) validates and resolves layouts; this module and
//! `mr::resolve` connect it to the key table and to memory:
//!
//! - **Storage.** Each layout the owner sets is encoded (as the caller described it, not
//!   expanded) into its own small `memfd` segment of `u64` words. The container's key entry
//!   records that segment's descriptor, inode and a *generation* (`KeyTable::set_layout`).
//!   The owner process keeps the segment open for as long as the layout is in force.
//! - **Reading.** Whoever executes an access (the initiator, in any process) pins the
//!   container, reads the generation, and looks the compiled layout up in a process-wide cache
//!   keyed by (owner pid, key) and checked against (generation, inode). On a miss it opens the
//!   owner's segment through `/proc/<pid>/fd/<n>` (as requesters do for every shared segment),
//!   decodes it as **untrusted input** (every count bounded by the segment, the result
//!   validated by `Layout::compile`, nothing can panic) and caches the result. A segment whose
//!   header generation differs from the entry's (the owner replaced the layout meanwhile) is
//!   refused, so a reader never mixes two layouts.
//! - **Resolving** (`mr::resolve`). A range of the container becomes pieces of other
//!   regions; each piece is pinned in the key table with the same PD and rights the access
//!   needs (a piece of a region that is itself a layout recurses, up to the nesting limit), so
//!   every byte is checked for bounds and rights exactly like an ordinary SGE, and stays
//!   registered until the access ends. Pieces of plain buffers ([`PLAIN_KEY`], from
//!   `REGISTER_BUFFERS` or page lists) are owner addresses covered by the container's own pin
//!   and rights.
//!
//! Replacing a layout while an access that already resolved the old one is in flight is safe
//! (the old pieces stay pinned) but racy as in verbs: the access uses whichever layout it saw.

use crate::device_memory::segment::Segment;
use crate::error::{Error, Result};
use crate::mr::keys::{KeyTable, LayoutRef};
use crate::mr::layout::{
    Compiled, Datum, Dim, InterleavedEntry, Layout, LayoutCaps, LayoutError, PLAIN_KEY,
    SetLayoutFlags,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// A layout as its owner gave it: what a layout segment encodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutSource {
    /// `mr_set_layout_sg` / `mr_set_layout_interleaved`, with the set-layout flags that
    /// matter to decoding (`REGISTER_BUFFERS` allows [`PLAIN_KEY`] data).
    Layout {
        flags: SetLayoutFlags,
        layout: Layout,
    },
    /// A page-list registration ([`Compiled::from_pages`]).
    Pages {
        pages: Vec<u64>,
        page_size: u64,
        first_offset: u64,
        length: u64,
    },
    /// A bitmap page registration ([`Compiled::from_bitmap`]).
    Bitmap {
        base: u64,
        page_size: u64,
        bitmap: Vec<u64>,
    },
}

impl LayoutSource {
    /// Validates and compiles; `lookup` gives the current layout of a key that is itself a
    /// layout container (for nesting), as in [`Layout::compile_nested`].
    pub(crate) fn compile<L, R>(
        &self,
        caps: &LayoutCaps,
        lookup: L,
    ) -> std::result::Result<Compiled, LayoutError>
    where
        L: Fn(u32) -> Option<R>,
        R: std::ops::Deref<Target = Compiled>,
    {
        match self {
            LayoutSource::Layout { flags, layout } => layout.compile_nested(*flags, caps, lookup),
            LayoutSource::Pages {
                pages,
                page_size,
                first_offset,
                length,
            } => Compiled::from_pages(pages, *page_size, *first_offset, *length),
            LayoutSource::Bitmap {
                base,
                page_size,
                bitmap,
            } => Compiled::from_bitmap(*base, *page_size, bitmap),
        }
    }
}

const MAGIC: u64 = 0x534c_4159_4f55_5431; // "SLAYOUT1"
const KIND_SG: u64 = 1;
const KIND_INTERLEAVED: u64 = 2;
const KIND_PAGES: u64 = 3;
const KIND_BITMAP: u64 = 4;
/// Word 1 of a segment: the generation, written when the layout is published.
const W_GENERATION: usize = 1;

/// Words: magic, generation, kind, flags, then the kind's payload.
fn encode(src: &LayoutSource) -> Vec<u64> {
    let mut w = vec![MAGIC, 0];
    match src {
        LayoutSource::Layout { flags, layout } => match layout {
            Layout::Sg(list) => {
                w.extend([KIND_SG, u64::from(flags.bits()), list.len() as u64]);
                for d in list {
                    w.extend([u64::from(d.key), d.addr, d.len]);
                }
            }
            Layout::Interleaved(list) => {
                w.extend([KIND_INTERLEAVED, u64::from(flags.bits()), list.len() as u64]);
                for e in list {
                    w.extend([
                        u64::from(e.first.key),
                        e.first.addr,
                        e.first.len,
                        u64::from(e.num_repeated),
                        e.dims.len() as u64,
                    ]);
                    for d in &e.dims {
                        w.extend([d.offset_stride, d.datum_count]);
                    }
                }
            }
        },
        LayoutSource::Pages {
            pages,
            page_size,
            first_offset,
            length,
        } => {
            w.extend([
                KIND_PAGES,
                0,
                *page_size,
                *first_offset,
                *length,
                pages.len() as u64,
            ]);
            w.extend_from_slice(pages);
        }
        LayoutSource::Bitmap {
            base,
            page_size,
            bitmap,
        } => {
            w.extend([KIND_BITMAP, 0, *base, *page_size, bitmap.len() as u64]);
            w.extend_from_slice(bitmap);
        }
    }
    w
}

/// Reads words of a segment another process may scribble on: every read is bounds-checked.
struct Reader<'a> {
    words: &'a [AtomicU64],
    pos: usize,
}

impl Reader<'_> {
    fn next(&mut self) -> std::result::Result<u64, String> {
        let w = self
            .words
            .get(self.pos)
            .ok_or_else(|| "layout segment truncated".to_string())?;
        self.pos += 1;
        Ok(w.load(Ordering::Relaxed))
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        u32::try_from(self.next()?).map_err(|_| "layout field out of range".to_string())
    }
    /// A count of items of `per` words each, bounded by the words left.
    fn count(&mut self, per: usize) -> std::result::Result<usize, String> {
        let n = self.next()?;
        let left = (self.words.len() - self.pos.min(self.words.len())) as u64;
        if n.checked_mul(per as u64).is_none_or(|need| need > left) {
            return Err("layout count exceeds its segment".into());
        }
        Ok(n as usize)
    }
}

/// Decodes a layout segment: its generation and what it describes. Untrusted input.
fn decode(words: &[AtomicU64]) -> std::result::Result<(u32, LayoutSource), String> {
    let mut r = Reader { words, pos: 0 };
    if r.next()? != MAGIC {
        return Err("not a layout segment".into());
    }
    let generation = r.u32()?;
    let kind = r.next()?;
    let flags = SetLayoutFlags::from_bits(r.u32()?).ok_or("unknown set-layout flags")?;
    let src = match kind {
        KIND_SG => {
            let n = r.count(3)?;
            let mut list = Vec::with_capacity(n);
            for _ in 0..n {
                list.push(Datum::new(r.u32()?, r.next()?, r.next()?));
            }
            LayoutSource::Layout {
                flags,
                layout: Layout::Sg(list),
            }
        }
        KIND_INTERLEAVED => {
            let n = r.count(5)?;
            let mut list = Vec::with_capacity(n);
            for _ in 0..n {
                let first = Datum::new(r.u32()?, r.next()?, r.next()?);
                let num_repeated = r.u32()?;
                let nd = r.count(2)?;
                let mut dims = Vec::with_capacity(nd);
                for _ in 0..nd {
                    dims.push(Dim::new(r.next()?, r.next()?));
                }
                list.push(InterleavedEntry::new(first, dims).repeated(num_repeated));
            }
            LayoutSource::Layout {
                flags,
                layout: Layout::Interleaved(list),
            }
        }
        KIND_PAGES => {
            let (page_size, first_offset, length) = (r.next()?, r.next()?, r.next()?);
            let n = r.count(1)?;
            let pages = (0..n)
                .map(|_| r.next())
                .collect::<std::result::Result<_, _>>()?;
            LayoutSource::Pages {
                pages,
                page_size,
                first_offset,
                length,
            }
        }
        KIND_BITMAP => {
            let (base, page_size) = (r.next()?, r.next()?);
            let n = r.count(1)?;
            let bitmap = (0..n)
                .map(|_| r.next())
                .collect::<std::result::Result<_, _>>()?;
            LayoutSource::Bitmap {
                base,
                page_size,
                bitmap,
            }
        }
        k => return Err(format!("unknown layout kind {k}")),
    };
    Ok((generation, src))
}

/// A layout ready to publish: its segment (written except for the generation), the compiled
/// form, and the keys it uses (counted busy while it exists).
pub(crate) struct Prepared {
    seg: Segment,
    pub(crate) compiled: Arc<Compiled>,
    pub(crate) refs: Vec<u32>,
}

impl Prepared {
    /// Encodes `src` (already compiled into `compiled`) into a fresh segment.
    pub(crate) fn new(src: &LayoutSource, compiled: Compiled) -> Result<Prepared> {
        let words = encode(src);
        // A file of its own: peers find the layout by descriptor alone and read all of it.
        let seg = Segment::create_file("softverbs-layout", words.len() * 8)?;
        for (slot, w) in seg.slice::<AtomicU64>(0, words.len()).iter().zip(&words) {
            slot.store(*w, Ordering::Relaxed);
        }
        let mut refs: Vec<u32> = compiled
            .spans()
            .iter()
            .map(|d| d.key)
            .filter(|&k| k != PLAIN_KEY)
            .collect();
        refs.sort_unstable();
        refs.dedup();
        Ok(Prepared {
            seg,
            compiled: Arc::new(compiled),
            refs,
        })
    }

    /// Makes this the layout of `key` in `keys` (owner side), with a fresh generation.
    pub(crate) fn publish(&self, keys: &KeyTable, key: u32) -> Result<()> {
        let generation = next_generation();
        self.seg
            .at::<AtomicU64>(W_GENERATION * 8)
            .store(u64::from(generation), Ordering::Release);
        self.publish_as(keys, key, generation)
    }

    /// Records this layout (already stamped with `generation`) for `key`: used again when a
    /// re-key moves the layout to a new key.
    pub(crate) fn publish_as(&self, keys: &KeyTable, key: u32, generation: u32) -> Result<()> {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.seg.fd());
        let ino = self.seg.inode();
        cache_insert(
            std::process::id(),
            key,
            generation,
            ino,
            self.compiled.clone(),
        );
        keys.set_layout(key, self.compiled.len(), fd, ino, generation)
    }

    /// The generation it was published with (0 before).
    pub(crate) fn generation(&self) -> u32 {
        self.seg
            .at::<AtomicU64>(W_GENERATION * 8)
            .load(Ordering::Acquire) as u32
    }
}

/// Generations are unique within a process and start at a time-derived value, so a reused pid
/// with a reused key is very unlikely to repeat (generation, inode) as well.
fn next_generation() -> u32 {
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let next = NEXT.get_or_init(|| {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.subsec_nanos() ^ (d.as_secs() as u32));
        AtomicU32::new(seed)
    });
    loop {
        let g = next.fetch_add(1, Ordering::Relaxed);
        if g != 0 {
            return g;
        }
    }
}

struct CacheEntry {
    generation: u32,
    ino: u64,
    compiled: Arc<Compiled>,
}

/// Entries beyond this are dropped wholesale (they are re-read on demand).
const CACHE_MAX: usize = 4096;

fn cache() -> &'static Mutex<HashMap<(u32, u32), CacheEntry>> {
    static CACHE: OnceLock<Mutex<HashMap<(u32, u32), CacheEntry>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn cache_insert(pid: u32, key: u32, generation: u32, ino: u64, compiled: Arc<Compiled>) {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    if c.len() >= CACHE_MAX {
        c.clear();
    }
    c.insert(
        (pid, key),
        CacheEntry {
            generation,
            ino,
            compiled,
        },
    );
}

/// The compiled layout `r` points at (for `key`): cached, or read from the owner's segment.
pub(crate) fn compiled(r: &LayoutRef, key: u32) -> Option<Arc<Compiled>> {
    {
        let c = cache().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = c.get(&(r.owner_pid, key))
            && e.generation == r.generation
            && e.ino == r.ino
        {
            return Some(e.compiled.clone());
        }
    }
    let fd = crate::device_memory::export::open_peer_fd(r.owner_pid, r.fd, r.ino, false).ok()?;
    let seg = Segment::open(fd).ok()?;
    let (generation, src) = decode(seg.slice::<AtomicU64>(0, seg.len() / 8)).ok()?;
    if generation != r.generation {
        return None; // replaced meanwhile: the access fails rather than mixing layouts
    }
    // Nesting is bounded on the data path (`MAX_LEVEL`), so inner keys count as plain here.
    let compiled = Arc::new(
        src.compile(&LayoutCaps::DEFAULT, |_| None::<&Compiled>)
            .ok()?,
    );
    cache_insert(r.owner_pid, key, r.generation, r.ino, compiled.clone());
    Some(compiled)
}

/// Maps a set-layout failure to the verbs error, naming the seed's result code.
pub(crate) fn set_layout_error(e: LayoutError) -> Error {
    let code = e.code();
    let name = match code {
        LayoutError::ERR_WOULD_INVALIDATE => "IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE",
        LayoutError::ERR_UNSUPPORTED => "IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED",
        _ => "IBV_MR_SET_LAYOUT_ERR_INPUT",
    };
    let msg = format!("{e} ({name}, {code})");
    match e {
        LayoutError::WouldInvalidate => Error::Busy(msg),
        LayoutError::Unsupported(_) => Error::Unsupported(msg),
        _ => Error::InvalidArgument(msg),
    }
}

/// The seed's `enum ibv_mr_set_layout_err_code` for an error of a set-layout call:
/// `InvalidArgument` is `IBV_MR_SET_LAYOUT_ERR_INPUT` (-1), `Busy` is
/// `IBV_MR_SET_LAYOUT_ERR_WOULD_INVALIDATE` (-2), `Unsupported` is
/// `IBV_MR_SET_LAYOUT_ERR_UNSUPPORTED` (-3); other errors (no resources, OS errors) have no
/// seed code.
pub fn set_layout_code(e: &Error) -> Option<i32> {
    match e {
        Error::InvalidArgument(_) => Some(LayoutError::ERR_INPUT),
        Error::Busy(_) => Some(LayoutError::ERR_WOULD_INVALIDATE),
        Error::Unsupported(_) => Some(LayoutError::ERR_UNSUPPORTED),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(src: LayoutSource) {
        let words = encode(&src);
        let atomics: Vec<AtomicU64> = words.iter().map(|&w| AtomicU64::new(w)).collect();
        let (_, back) = decode(&atomics).unwrap();
        assert_eq!(back, src);
        // Every truncation and every single-word corruption decodes to an error or to some
        // layout, never a panic; compiling the result never panics either.
        for cut in 0..atomics.len() {
            let _ = decode(&atomics[..cut]);
        }
        for i in 0..words.len() {
            for bad in [0, 1, u64::MAX, u64::from(u32::MAX), 1 << 40] {
                let a: Vec<AtomicU64> = words.iter().map(|&w| AtomicU64::new(w)).collect();
                a[i].store(bad, Ordering::Relaxed);
                if let Ok((_, s)) = decode(&a) {
                    let _ = s.compile(&LayoutCaps::DEFAULT, |_| None::<&Compiled>);
                }
            }
        }
    }

    #[test]
    fn encode_decode_roundtrip_and_garbage() {
        roundtrip(LayoutSource::Layout {
            flags: SetLayoutFlags::REGISTER_BUFFERS,
            layout: Layout::Sg(vec![Datum::new(0x100, 8, 16), Datum::new(0, 0x5000, 4)]),
        });
        roundtrip(LayoutSource::Layout {
            flags: SetLayoutFlags::empty(),
            layout: Layout::Interleaved(vec![
                InterleavedEntry::new(
                    Datum::new(0x200, 8, 8),
                    vec![Dim::new(64, 8), Dim::new(4096, 3)],
                )
                .repeated(2),
                InterleavedEntry::new(Datum::new(0x300, 0, 4), vec![Dim::new(4, 6)]),
            ]),
        });
        roundtrip(LayoutSource::Pages {
            pages: vec![0x1000, 0x3000, 0x2000],
            page_size: 4096,
            first_offset: 12,
            length: 9000,
        });
        roundtrip(LayoutSource::Bitmap {
            base: 0x10000,
            page_size: 4096,
            bitmap: vec![0b1011, 0, 1],
        });
    }

    #[test]
    fn huge_counts_are_refused_without_allocating() {
        let words = [MAGIC, 1, KIND_SG, 0, u64::MAX];
        let a: Vec<AtomicU64> = words.iter().map(|&w| AtomicU64::new(w)).collect();
        assert!(decode(&a).is_err());
    }
}
