//! The host's directory of QPs: which process has QP `qpn` of the device with GID `gid`, and
//! where its context is.
//!
//! Two abstract Unix socket names per QP, which the kernel removes when the owner dies:
//! `softverbs/<gid>/<qpn>` (bound first: it makes the QP number unique on the host) and
//! `softverbs/<gid>/<qpn>/<pid>/<fd>/<inode>` (found by a requester in `/proc/net/unix`),
//! naming the descriptor of the QP's context segment. Every softverbs process of the host
//! shares the directory (a device is its GID, whichever process opened it), so QP numbers are
//! claimed here when a QP is created, and anyone that must reach a QP by number looks here.

use crate::device_memory::segment::Segment;
use crate::error::{Error, Result};
use crate::types::Gid;
use rustix::fd::OwnedFd;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType, bind, socket_with};

/// A QP's listing: holding it keeps the QP number taken and findable.
pub(crate) struct Listing {
    _lock: OwnedFd,
    _info: OwnedFd,
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

/// Publishes QP `qpn` of the device with `gid`; `None` if another process has that number.
pub(crate) fn publish(gid: Gid, qpn: u32, ctx: &Segment) -> Result<Option<Listing>> {
    let base = format!("softverbs/{}/{qpn:06x}", gid_hex(gid));
    let Some(lock) = bind_abstract(&base)? else {
        return Ok(None);
    };
    let fd = std::os::fd::AsRawFd::as_raw_fd(&ctx.fd());
    let info = format!("{base}/{}/{fd}/{}", std::process::id(), ctx.inode());
    let info = bind_abstract(&info)?.ok_or_else(|| Error::Busy("QP listing name taken".into()))?;
    Ok(Some(Listing {
        _lock: lock,
        _info: info,
    }))
}

/// Finds the owner of QP `qpn` on the device with `gid`: (pid, context fd, inode).
pub(crate) fn lookup(gid: Gid, qpn: u32) -> Option<(u32, i32, u64)> {
    let prefix = format!("@softverbs/{}/{qpn:06x}/", gid_hex(gid));
    let table = std::fs::read_to_string("/proc/net/unix").ok()?;
    table.lines().find_map(|line| {
        let name = line.split_whitespace().last()?;
        let mut it = name.strip_prefix(&prefix)?.split('/');
        Some((
            it.next()?.parse().ok()?,
            it.next()?.parse().ok()?,
            it.next()?.parse().ok()?,
        ))
    })
}
