//! The host's directory of QPs: which process has QP `qpn` of the device with GID `gid`, and
//! where its context is.
//!
//! QP numbers are `generation << INDEX_BITS | index`, and the indices of a device come in
//! blocks of [`BLOCK_LEN`]: a process claims a whole block host-wide before it numbers QPs in
//! it, and lists each QP in the block's table, an array in its device memory. A block is
//! claimed by binding two abstract Unix socket names, which the kernel removes when the owner
//! dies: `softverbs/<gid>/b<block>` (bound first: it makes the block the claimer's) and
//! `softverbs/<gid>/b<block>/<pid>/<fd>/<inode>/<offset>` (found by a requester in
//! `/proc/net/unix`), naming the table. So a process pays two descriptors per thousand QPs,
//! not per QP, and a requester reads `/proc/net/unix` once per block it meets, not per QP.
//! Every softverbs process of the host (and network namespace, which scopes abstract names)
//! shares the directory: a device is its GID, whichever process opened it.

use crate::device_memory::export::Export;
use crate::device_memory::segment::{Segment, ShmPlain};
use crate::error::{Error, Result};
use crate::types::Gid;
use rustix::fd::OwnedFd;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType, bind, socket_with};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Bits of a QP number that are its index; the rest are the generation.
pub(crate) const INDEX_BITS: u32 = 18;
/// Bits of an index that are its place in its block.
const BLOCK_BITS: u32 = 10;
/// QP numbers per block.
pub(crate) const BLOCK_LEN: u32 = 1 << BLOCK_BITS;
/// Blocks per device.
pub(crate) const BLOCKS: u32 = 1 << (INDEX_BITS - BLOCK_BITS);

/// The index of QP number `qpn`.
pub(crate) fn index_of(qpn: u32) -> u32 {
    qpn & ((1 << INDEX_BITS) - 1)
}

/// The block an index is in.
pub(crate) fn block_of(index: u32) -> u32 {
    index >> BLOCK_BITS
}

/// One QP of a block's table: its number (0: none) and its context.
#[repr(C)]
struct Entry {
    qpn: AtomicU32,
    _pad: AtomicU32,
    ctx: Export,
}

// SAFETY: repr(C), atomics only, valid when zero (no QP).
unsafe impl ShmPlain for Entry {}

const TABLE_BYTES: usize = BLOCK_LEN as usize * std::mem::size_of::<Entry>();

/// A block this process holds: its table, and the names that make it ours (none when abstract
/// sockets are unavailable, in unusual sandboxes: the QPs then work in this process only).
pub(crate) struct BlockClaim {
    table: Arc<Segment>,
    _names: Option<(OwnedFd, OwnedFd)>,
}

/// A QP's listing: holding it keeps the QP findable.
pub(crate) struct Listing {
    table: Arc<Segment>,
    at: usize,
    qpn: u32,
}

impl Drop for Listing {
    fn drop(&mut self) {
        let e: &Entry = self.table.at(self.at);
        let _ = e
            .qpn
            .compare_exchange(self.qpn, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

pub(super) fn gid_hex(gid: Gid) -> String {
    gid.0.iter().map(|b| format!("{b:02x}")).collect()
}

/// A socket bound to the abstract name `name`; `None` if another holds it.
pub(super) fn bind_abstract(name: &str) -> Result<Option<OwnedFd>> {
    // Close-on-exec: a child process must not keep our QP numbers taken after we exit.
    let sock = socket_with(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(Error::os("socket"))?;
    let addr =
        SocketAddrUnix::new_abstract_name(name.as_bytes()).map_err(Error::os("socket name"))?;
    match bind(&sock, &addr) {
        Ok(()) => Ok(Some(sock)),
        Err(rustix::io::Errno::ADDRINUSE) => Ok(None),
        Err(e) => Err(Error::os("bind")(e)),
    }
}

fn block_name(gid: Gid, block: u32) -> String {
    format!("softverbs/{}/b{block:02x}", gid_hex(gid))
}

/// Claims `block` of the device with `gid` for this process; `None` if another process has
/// it.
pub(crate) fn claim(gid: Gid, block: u32) -> Result<Option<BlockClaim>> {
    let base = block_name(gid, block);
    // The name first: a process meets many blocks other processes hold, and a table made
    // for each would only wait out its quarantine.
    let lock = match bind_abstract(&base) {
        Ok(Some(l)) => l,
        Ok(None) => return Ok(None),
        Err(_) => {
            return Ok(Some(BlockClaim {
                table: Arc::new(Segment::create("softverbs-qp-table", TABLE_BYTES)?),
                _names: None,
            }));
        }
    };
    let table = Arc::new(Segment::create("softverbs-qp-table", TABLE_BYTES)?);
    let fd = std::os::fd::AsRawFd::as_raw_fd(&table.fd());
    let info = format!(
        "{base}/{}/{fd}/{}/{:x}",
        std::process::id(),
        table.inode(),
        table.offset()
    );
    let info = bind_abstract(&info)?.ok_or_else(|| Error::Busy("QP block name taken".into()))?;
    Ok(Some(BlockClaim {
        table,
        _names: Some((lock, info)),
    }))
}

impl BlockClaim {
    /// Lists QP `qpn` (of this block) with its context.
    pub(crate) fn publish(&self, qpn: u32, ctx: &Segment) -> Listing {
        let at = (index_of(qpn) % BLOCK_LEN) as usize * std::mem::size_of::<Entry>();
        let e: &Entry = self.table.at(at);
        e.ctx.set_segment(ctx);
        e.qpn.store(qpn, Ordering::Release);
        Listing {
            table: self.table.clone(),
            at,
            qpn,
        }
    }
}

/// Tables of other processes' blocks mapped, by (GID, block): (owner pid, table), while a
/// QP found through them holds them (a table held by nobody is not kept mapped: a peer's
/// memory goes when the last connection to it does).
type Tables = HashMap<(Gid, u32), (u32, Weak<Segment>)>;

/// A QP of another process, found: its owner, its context, and the table that lists it (for
/// the finder to hold while it uses the QP, so the next lookups in the block are cheap).
pub(crate) struct Found {
    pub(crate) pid: u32,
    pub(crate) ctx: Segment,
    pub(crate) table: Arc<Segment>,
}

/// Finds the process that has QP `qpn` of the device with `gid`, when it is another than this
/// one (this process's QPs are found in-process).
pub(crate) fn lookup(gid: Gid, qpn: u32) -> Option<Found> {
    static TABLES: Mutex<Option<Tables>> = Mutex::new(None);
    let block = block_of(index_of(qpn));
    let at = (index_of(qpn) % BLOCK_LEN) as usize * std::mem::size_of::<Entry>();
    let find = |table: &Segment, pid: u32| -> Option<Segment> {
        let e: &Entry = table.at(at);
        if e.qpn.load(Ordering::Acquire) != qpn {
            return None;
        }
        e.ctx.open_segment(pid).ok().flatten()
    };
    let cached = {
        let t = TABLES.lock().unwrap_or_else(|e| e.into_inner());
        t.as_ref()
            .and_then(|t| t.get(&(gid, block)))
            .and_then(|(pid, w)| Some((*pid, w.upgrade()?)))
    };
    // A block a process let go of may be someone else's now: a miss in a mapped table is
    // looked up afresh.
    if let Some((pid, table)) = cached
        && let Some(ctx) = find(&table, pid)
    {
        return Some(Found { pid, ctx, table });
    }
    let (pid, table) = open_table(gid, block)?;
    let mut t = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    let t = t.get_or_insert_with(HashMap::new);
    t.retain(|_, (_, w)| w.strong_count() > 0);
    t.insert((gid, block), (pid, Arc::downgrade(&table)));
    let ctx = find(&table, pid)?;
    Some(Found { pid, ctx, table })
}

/// Maps the table of `block` from the name its claimer bound.
fn open_table(gid: Gid, block: u32) -> Option<(u32, Arc<Segment>)> {
    let prefix = format!("@{}/", block_name(gid, block));
    let list = std::fs::read_to_string("/proc/net/unix").ok()?;
    let (pid, fd, ino, offset) = list.lines().find_map(|line| {
        let name = line.split_whitespace().last()?;
        let mut it = name.strip_prefix(&prefix)?.split('/');
        Some((
            it.next()?.parse::<u32>().ok()?,
            it.next()?.parse::<i32>().ok()?,
            it.next()?.parse::<u64>().ok()?,
            usize::from_str_radix(it.next()?, 16).ok()?,
        ))
    })?;
    if pid == std::process::id() {
        return None;
    }
    let table = Segment::open_peer(pid, fd, ino, offset, TABLE_BYTES).ok()?;
    Some((pid, Arc::new(table)))
}
