//! Moving plain caller memory into a `memfd` in place at registration, so that peers in other
//! processes map it and place bytes with plain stores (and atomics work across processes),
//! instead of going through cross-memory attach.
//!
//! How: the page-rounded range is copied into a new `memfd`, which is then mapped
//! `MAP_SHARED | MAP_FIXED` over the same addresses. Only private anonymous read-write memory
//! (`malloc`/`memalign` heap or anonymous mappings, per `/proc/self/maps`) is moved; anything
//! else keeps no backing and peers reach it by cross-memory attach.
//!
//! Hazards, accepted for now:
//! - a thread that writes the range (or a neighbouring heap object in the same pages) between
//!   the copy and the remap loses that write (softverbs' own threads avoid this through
//!   [`sv_softverbs_inplace_exclusive`]; the program's threads are the program's);
//! - after the last registration of a range is gone its memfd is closed; the mapping stays
//!   (the program's memory is intact) but a later registration of it falls back to
//!   cross-memory attach.
//!
//! A child made by `fork` gets its own private copy of every moved range (a `pthread_atfork`
//! handler remaps them in the child), as the kernel copies pinned pages into a child since
//! Linux 5.13: the parent's registrations keep working, the child's writes stay its own, and
//! `ibv_is_fork_initialized` truthfully answers `IBV_FORK_UNNEEDED`.
//!
//! `SOFTVERBS_IBVERBS_INPLACE=0` turns this off.

use crate::maps::Mappings;
use softverbs_nic::mr::keys::Backing;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

struct Moved {
    start: usize,
    len: usize,
    fd: OwnedFd,
    ino: u64,
    refs: usize,
}

static MOVED: Mutex<Vec<Moved>> = Mutex::new(Vec::new());

std::thread_local! {
    /// The lock on [`MOVED`] held by the forking thread from `prepare_fork` until the parent
    /// or the child handler drops it, so no registration is half done in the child.
    static HELD_FOR_FORK: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Vec<Moved>>>> =
        const { std::cell::RefCell::new(None) };
}

extern "C" fn prepare_fork() {
    let held = MOVED.lock().unwrap_or_else(|e| e.into_inner());
    HELD_FOR_FORK.with(|h| *h.borrow_mut() = Some(held));
}

extern "C" fn parent_after_fork() {
    HELD_FOR_FORK.with(|h| drop(h.borrow_mut().take()));
}

/// In the child: each moved range becomes private anonymous memory holding the same bytes,
/// and the child forgets the memfds (it has no registrations of its own).
extern "C" fn child_after_fork() {
    HELD_FOR_FORK.with(|h| {
        if let Some(mut moved) = h.borrow_mut().take() {
            for m in moved.iter() {
                privatize(m.start, m.len);
            }
            moved.clear();
        }
    });
}

/// Replaces the shared mapping at `start..start + len` with a private copy of its bytes.
fn privatize(start: usize, len: usize) {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    // SAFETY: a new private mapping at an address of the kernel's choosing.
    let tmp = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
    if tmp == libc::MAP_FAILED {
        return; // the child keeps sharing the pages, as before this handler existed
    }
    // SAFETY: `start..start + len` is a moved range, mapped read-write; `tmp` has `len`
    // bytes. mremap then moves the copy over the range in one step, replacing the shared
    // mapping.
    unsafe {
        std::ptr::copy_nonoverlapping(start as *const u8, tmp as *mut u8, len);
        let fixed = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
        if libc::mremap(tmp, len, len, fixed, start as *mut libc::c_void) == libc::MAP_FAILED {
            libc::munmap(tmp, len);
        }
    }
}

/// Installs the fork handlers once, before the first range is moved.
fn handle_fork() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are `extern "C"` functions with no arguments that live for
        // the whole process.
        unsafe {
            libc::pthread_atfork(
                Some(prepare_fork),
                Some(parent_after_fork),
                Some(child_after_fork),
            )
        };
    });
}

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

/// `softverbs_inplace_exclusive(cb, arg)`: runs `cb(arg)` while no registration is moving
/// memory. A library thread of softverbs itself (the CM agent of the drop-in librdmacm)
/// runs its work inside it, so that it is never the other thread of the first hazard above:
/// its allocations and frees touch heap pages that a registration on the program's thread
/// may be copying. `cb` must not register memory.
///
/// # Safety
/// `cb` is NULL or a function that may be called with `arg`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_softverbs_inplace_exclusive(
    cb: Option<unsafe extern "C" fn(*mut core::ffi::c_void)>,
    arg: *mut core::ffi::c_void,
) {
    let _held = MOVED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cb) = cb {
        // SAFETY: the caller's contract.
        unsafe { cb(arg) };
    }
}

/// Moves `addr..addr + len` into a memfd (or reuses the one it is already in) and returns the
/// backing to register with; `None` leaves the memory as it is. `maps` is the process's
/// mappings, read by the caller.
pub fn acquire(addr: usize, len: usize, maps: Option<&Mappings>) -> Option<Backing> {
    if len == 0 || std::env::var("SOFTVERBS_IBVERBS_INPLACE").as_deref() == Ok("0") {
        return None;
    }
    let pg = page();
    let start = addr & !(pg - 1);
    let end = addr.checked_add(len)?.checked_add(pg - 1)? & !(pg - 1);
    let mut moved = MOVED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(m) = moved
        .iter_mut()
        .find(|m| m.start <= start && end <= m.start + m.len)
    {
        m.refs += 1;
        return Some(Backing {
            fd: m.fd.as_raw_fd(),
            ino: m.ino,
            offset: (addr - m.start) as u64,
        });
    }
    if moved
        .iter()
        .any(|m| m.start < end && start < m.start + m.len)
    {
        return None; // overlaps a moved range only in part
    }
    if !maps.is_some_and(|m| m.private_anon(start, end)) {
        return None;
    }
    handle_fork();
    let size = end - start;
    // SAFETY: memfd_create with a NUL-terminated name.
    let raw = unsafe { libc::memfd_create(c"softverbs-mr".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain syscalls on our own descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` is writable.
    if unsafe { libc::ftruncate(raw, size as libc::off_t) } != 0
        || unsafe { libc::fstat(raw, &mut st) } != 0
    {
        return None;
    }
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: a new shared mapping of the memfd at an address of the kernel's choosing.
    let tmp = unsafe { libc::mmap(std::ptr::null_mut(), size, prot, libc::MAP_SHARED, raw, 0) };
    if tmp == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: `start..end` is mapped read-write (checked above) and `tmp` has `size` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(start as *const u8, tmp as *mut u8, size);
        libc::munmap(tmp, size);
    }
    // SAFETY: replaces the caller's pages with the memfd holding the same bytes; the module
    // docs list the hazards.
    let at = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            size,
            prot,
            libc::MAP_SHARED | libc::MAP_FIXED,
            raw,
            0,
        )
    };
    if at as usize != start {
        return None;
    }
    let backing = Backing {
        fd: raw,
        ino: st.st_ino,
        offset: (addr - start) as u64,
    };
    moved.push(Moved {
        start,
        len: size,
        fd,
        ino: st.st_ino,
        refs: 1,
    });
    Some(backing)
}

/// Drops one registration of the moved range with this backing.
pub fn release(b: &Backing) {
    let mut moved = MOVED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = moved
        .iter()
        .position(|m| m.fd.as_raw_fd() == b.fd && m.ino == b.ino)
    {
        moved[i].refs -= 1;
        if moved[i].refs == 0 {
            moved.swap_remove(i);
        }
    }
}
