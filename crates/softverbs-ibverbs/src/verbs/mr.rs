//! Protection domains and memory regions.

use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    if ctx.is_null() {
        return inval();
    }
    // SAFETY: a context of ours.
    match unsafe { ctx_of(ctx) }.nic.alloc_pd() {
        Ok(nic) => {
            let b = Box::new(SvPd {
                pd: ibv_pd {
                    context: ctx,
                    handle: nic.id(),
                },
                nic,
                parent: None,
            });
            Box::into_raw(b) as *mut ibv_pd
        }
        Err(e) => null(e),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    if pd.is_null() {
        return EINVAL;
    }
    // Memory regions, QPs, SRQs or address handles still in it (or, for a protection domain,
    // a parent domain over it): EBUSY, and it stays usable.
    // SAFETY: a PD of ours.
    let sv = unsafe { &*(pd as *const SvPd) };
    let own = usize::from(sv.parent.is_some()); // a parent domain's hold on its PD
    if sv.nic.users() > own {
        return libc::EBUSY;
    }
    // SAFETY: `pd` came from `sv_ibv_alloc_pd` (Box::into_raw of an SvPd).
    drop(unsafe { Box::from_raw(pd as *mut SvPd) });
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    if pd.is_null() {
        return inval();
    }
    // SAFETY: `pd` came from `sv_ibv_alloc_pd`.
    let sv = unsafe { &*(pd as *const SvPd) };
    // Bad flags fail before any memory is moved.
    if let Err(e) = Pd::effective_access(access) {
        return null(e);
    }
    // Seed 002: `ibv_reg_mr(pd, NULL, 0, IBV_ACCESS_ZERO_BASED | ...)` makes the container a
    // non-contiguous layout is given to (`ibv_mr_set_layout_sg` / `_interleaved`).
    if length == 0 && access & AccessFlags::ZERO_BASED.bits() != 0 {
        return match sv.nic.create_layout_mr(access) {
            // SAFETY: a PD of ours.
            Ok(nic) => new_mr(unsafe { (*pd).context }, pd, addr, 0, nic, None),
            Err(e) => null(e),
        };
    }
    // SAFETY: the caller's buffer (verbs' contract, as for any registration).
    match unsafe { register(&sv.nic, addr, length, iova, access) } {
        // SAFETY: a PD of ours.
        Ok((nic, backing)) => new_mr(unsafe { (*pd).context }, pd, addr, length, nic, backing),
        Err(e) => null(e),
    }
}

/// Registers `addr..addr + length` at `iova` with the NIC, moving plain memory into a memfd
/// first (see `inplace`); on failure nothing stays moved for it. Memory that is not mapped,
/// or not writable when the rights need writing, is refused with EFAULT, as the kernel's
/// pinning of the pages refuses it, rather than left for a later operation to fault on.
///
/// # Safety
/// The buffer stays valid until the region is deregistered.
pub(super) unsafe fn register(
    pd: &Arc<Pd>,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> softverbs_nic::Result<(Mr, Option<softverbs_nic::mr::keys::Backing>)> {
    // An on-demand region is neither checked nor moved: its pages need not exist yet (an
    // implicit one covers the whole address space), and the NIC reaches them by
    // cross-memory attach, which reports a missing page as an error completion.
    if access & AccessFlags::ON_DEMAND.bits() != 0 {
        // SAFETY: forwarded; no byte of an on-demand region is touched directly.
        return unsafe { pd.reg_mr(addr as usize, length, iova, access, None) }
            .map(|nic| (nic, None));
    }
    let maps = crate::maps::Mappings::read();
    if length > 0
        && let Some(m) = &maps
    {
        let start = addr as usize;
        let end = start
            .checked_add(length)
            .ok_or_else(|| softverbs_nic::Error::InvalidArgument("address range wraps".into()))?;
        if !m.accessible(start, end, writable(access)) {
            return Err(softverbs_nic::Error::BadAddress(format!(
                "{length} bytes at {addr:p} are not all mapped {}",
                if writable(access) {
                    "writable"
                } else {
                    "readable"
                }
            )));
        }
    }
    let backing = crate::inplace::acquire(addr as usize, length, maps.as_ref());
    // SAFETY: verbs requires the buffer to stay valid until `ibv_dereg_mr`; the NIC reaches
    // it through this process's address space, and peers through the memfd it was moved into
    // (or by cross-memory attach when it was not).
    let r = unsafe { pd.reg_mr(addr as usize, length, iova, access, backing) };
    if r.is_err()
        && let Some(b) = &backing
    {
        crate::inplace::release(b);
    }
    r.map(|nic| (nic, backing))
}

/// The rights the kernel pins pages for writing for (`ib_access_writable`): the NIC or a
/// peer may store into the region.
fn writable(access: c_uint) -> bool {
    let w = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_ATOMIC
        | AccessFlags::MW_BIND;
    AccessFlags::from_bits_retain(access).intersects(w)
}

/// `IBV_REREG_MR_CHANGE_TRANSLATION`, `_CHANGE_PD`, `_CHANGE_ACCESS`.
const REREG_TRANSLATION: c_int = 1;
const REREG_PD: c_int = 1 << 1;
const REREG_ACCESS: c_int = 1 << 2;

/// `ibv_rereg_mr`: a new registration with the changed parts (`addr`/`length`, `pd`,
/// `access`) and the others as they were, which replaces the old one only once it exists, so
/// a failure (`IBV_REREG_MR_ERR_INPUT`, errno set) leaves the region as it was. The key may
/// change (`mr->lkey`/`rkey` say). Layout containers and page lists cannot be re-registered
/// (EINVAL); a region a layout uses is EBUSY.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    /// `IBV_REREG_MR_ERR_INPUT`: the old region is still valid.
    const ERR_INPUT: c_int = -1;
    let fail = |errno: c_int| {
        set_errno(errno);
        ERR_INPUT
    };
    if flags == 0 || flags & !(REREG_TRANSLATION | REREG_PD | REREG_ACCESS) != 0 {
        return fail(EINVAL);
    }
    if flags & REREG_PD != 0 && pd.is_null() {
        return fail(EINVAL);
    }
    // Exclusive: no other call uses or deregisters this MR meanwhile.
    let live = live_mrs().write().unwrap_or_else(|e| e.into_inner());
    if mr.is_null() || !live.contains(&(mr as usize)) {
        return fail(EINVAL);
    }
    // SAFETY: a live SvMr of ours, and we hold the write lock over live MRs.
    let sv = unsafe { &mut *(mr as *mut SvMr) };
    let Some(old) = &sv.nic else {
        return fail(EINVAL);
    };
    if old.is_layout() || sv.mr.addr as usize != old.addr() {
        return fail(EINVAL); // a container, or a page list (its addr is an IOVA)
    }
    if let Err(e) = old.check_dereg() {
        return fail(e.errno());
    }
    let new_pd = if flags & REREG_PD != 0 { pd } else { sv.mr.pd };
    let (new_addr, new_len, iova) = if flags & REREG_TRANSLATION != 0 {
        (addr, length, addr as u64)
    } else {
        (sv.mr.addr, sv.mr.length, old.iova())
    };
    let new_access = if flags & REREG_ACCESS != 0 {
        access as c_uint
    } else {
        old.access().bits()
    };
    if let Err(e) = Pd::effective_access(new_access) {
        return fail(e.errno());
    }
    // SAFETY: `new_pd` is the MR's PD or the caller's (a PD of ours, non-NULL); the buffer is
    // the caller's to keep valid, as for any registration.
    let r = unsafe {
        register(
            &(*(new_pd as *const SvPd)).nic,
            new_addr,
            new_len,
            iova,
            new_access,
        )
    };
    match r {
        Ok((nic, backing)) => {
            let old_backing = std::mem::replace(&mut sv.backing, backing);
            // The old key goes first, then the memfd it named (as in deregistration).
            drop(sv.nic.replace(nic));
            if let Some(b) = &old_backing {
                crate::inplace::release(b);
            }
            let key = sv.nic.as_ref().map_or(0, Mr::key);
            sv.mr.pd = new_pd;
            sv.mr.addr = new_addr;
            sv.mr.length = new_len;
            sv.mr.handle = key;
            sv.mr.lkey = key;
            sv.mr.rkey = key;
            0
        }
        Err(e) => fail(e.errno()),
    }
}

/// The NIC PD of `pd`, a PD of this library (None for NULL).
///
/// # Safety
/// `pd` is NULL or came from `sv_ibv_alloc_pd` and is not deallocated.
pub(crate) unsafe fn nic_pd<'a>(pd: *mut ibv_pd) -> Option<&'a Arc<Pd>> {
    // SAFETY: the caller's.
    (!pd.is_null()).then(|| &unsafe { &*(pd as *const SvPd) }.nic)
}

/// Hands a registered MR to C and records it as live.
pub(crate) fn new_mr(
    context: *mut ibv_context,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    nic: Mr,
    backing: Option<softverbs_nic::mr::keys::Backing>,
) -> *mut ibv_mr {
    let mr = ibv_mr {
        context,
        pd,
        addr,
        length,
        handle: nic.key(),
        lkey: nic.key(),
        rkey: nic.key(),
    };
    let p = Box::into_raw(Box::new(SvMr {
        mr,
        nic: Some(nic),
        backing,
        dm: None,
    })) as *mut ibv_mr;
    live_mrs()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(p as usize);
    p
}

/// The `ibv_mr` pointers handed out and not yet deregistered, so `ibv_dereg_mr`, softverbs'
/// layout calls and the layout bind work request answer EINVAL for a pointer that is not a
/// live MR of this library instead of reading it.
fn live_mrs() -> &'static RwLock<HashSet<usize>> {
    static LIVE: OnceLock<RwLock<HashSet<usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Runs `f` on `mr` (the C struct, which `f` may update) and its NIC MR when `mr` is a live
/// MR of ours; None otherwise. The MR cannot be deregistered while `f` runs.
pub(crate) fn with_live_mr<R>(mr: *mut ibv_mr, f: impl FnOnce(*mut ibv_mr, &Mr) -> R) -> Option<R> {
    let live = live_mrs().read().unwrap_or_else(|e| e.into_inner());
    if mr.is_null() || !live.contains(&(mr as usize)) {
        return None;
    }
    // SAFETY: a live SvMr of ours; deregistering it needs the write lock we keep it from.
    let nic = unsafe { &*(mr as *const SvMr) }.nic.as_ref()?;
    Some(f(mr, nic))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded caller arguments.
    unsafe { sv_ibv_reg_mr_iova2(pd, addr, length, addr as u64, access as c_uint) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded caller arguments.
    unsafe { sv_ibv_reg_mr_iova2(pd, addr, length, iova, access as c_uint) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    let mut live = live_mrs().write().unwrap_or_else(|e| e.into_inner());
    // NULL, already deregistered or not ours: EINVAL rather than freeing what we never made.
    if mr.is_null() || !live.contains(&(mr as usize)) {
        return EINVAL;
    }
    // SAFETY: a live SvMr of ours (we hold the write lock).
    if let Some(nic) = &unsafe { &*(mr as *const SvMr) }.nic
        && let Err(e) = nic.check_dereg()
    {
        // Seed 002: a region a non-contiguous layout uses stays registered (EBUSY).
        return e.errno();
    }
    live.remove(&(mr as usize));
    drop(live);
    // SAFETY: `mr` came from `new_mr` (Box::into_raw of an SvMr) and was live until now.
    drop(unsafe { Box::from_raw(mr as *mut SvMr) });
    0
}

/// `verbs_context::advise_mr`, reached by the header's inline `ibv_advise_mr`: prefetches
/// the pages of on-demand regions (see the NIC's `Pd::prefetch`); always synchronous, so
/// `IBV_ADVISE_MR_FLAG_FLUSH` changes nothing.
pub(super) unsafe extern "C" fn advise_mr(
    pd: *mut ibv_pd,
    advice: c_int,
    flags: u32,
    sg_list: *mut ibv_sge,
    num_sge: u32,
) -> c_int {
    /// `IBV_ADVISE_MR_FLAG_FLUSH`.
    const FLUSH: u32 = 1;
    let advice = match advice {
        0 => Prefetch::Read,
        1 => Prefetch::Write,
        2 => Prefetch::NoFault,
        _ => return EINVAL,
    };
    // SAFETY: the caller's PD (NULL or ours).
    let Some(nic) = (unsafe { nic_pd(pd) }) else {
        return EINVAL;
    };
    if flags & !FLUSH != 0 || num_sge == 0 || sg_list.is_null() {
        return EINVAL;
    }
    // SAFETY: the caller's list of `num_sge` SGEs.
    let list = unsafe { std::slice::from_raw_parts(sg_list, num_sge as usize) };
    let sges: Vec<Sge> = list
        .iter()
        .map(|g| Sge {
            addr: g.addr,
            length: g.length,
            lkey: g.lkey,
        })
        .collect();
    match nic.prefetch(advice, &sges) {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}
