//! Registered memory of another process on this host, reached from this one: a region in a
//! `memfd` is mapped (once per descriptor), plain process memory is read and written by
//! cross-memory attach. The process is the region's owner as its key entry names it, so a
//! table that holds the regions of several processes (a shared PD's) is placed right.

use crate::device_memory::segment::Segment;
use crate::error::{Error, Result};
use crate::mr::access::Span;
use crate::mr::keys::Pin;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The other processes' `memfd`s mapped so far, by (owner pid, descriptor, inode).
#[derive(Default)]
pub(crate) struct PeerMemory {
    /// The first file mapped, found without a lock: a connection mostly reaches one region
    /// (a lock and a hash per operation were 7% of a 64-byte WRITE).
    first: std::sync::OnceLock<((u32, i32, u64), Arc<Segment>)>,
    maps: Mutex<HashMap<(u32, i32, u64), Arc<Segment>>>,
}

impl PeerMemory {
    /// Where `len` bytes at the owner's address `host` of the pinned region are for this
    /// process: a mapping of the owner's `memfd`, or (plain process memory) the owner's
    /// address, reached with cross-memory attach. `host` is inside `pin`'s registration (or,
    /// for a layout container's pin, a plain buffer of its layout, which has no backing).
    pub(crate) fn locate(&self, pin: &Pin<'_>, host: usize, len: usize) -> Result<Span> {
        let pid = pin.owner_pid();
        let Some(b) = pin.backing_at(host) else {
            return Ok(Span::at(host, len, pid));
        };
        let key = (pid, b.fd, b.ino);
        let within = |seg: &Segment| {
            let end = b.offset.checked_add(len as u64);
            if end.is_none_or(|e| e > seg.len() as u64) {
                return Err(Error::InvalidArgument(
                    "peer registration outside its memfd".into(),
                ));
            }
            Ok(Span::local(seg.as_ptr() as usize + b.offset as usize, len))
        };
        if let Some((k, seg)) = self.first.get()
            && *k == key
        {
            return within(seg);
        }
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(seg) = maps.get(&key) {
            return within(seg);
        }
        let seg = Arc::new(Segment::open_peer_file(pid, b.fd, b.ino)?);
        maps.insert(key, seg.clone());
        let _ = self.first.set((key, seg.clone()));
        within(&seg)
    }
}
