//! A sysfs tree for softverbs devices, for the programs that read sysfs beside the verbs
//! calls (Open MPI, UCX, `ibv_devinfo`'s `board_id`).
//!
//! The kernel's `/sys/class/infiniband` cannot hold devices it does not have, so the tree is
//! written under the user's runtime directory: `$XDG_RUNTIME_DIR/softverbs/sysfs/<key>`, or
//! `$TMPDIR/softverbs-<uid>/sysfs/<key>` (`/tmp` without `TMPDIR`). `ibv_get_sysfs_path()`
//! returns `.../<key>`, and each device's `ibdev_path` and `dev_path` point into it:
//!
//! ```text
//! class/infiniband/<dev>/{node_type, node_guid, sys_image_guid, fw_ver, hca_type, hw_rev,
//!     board_id, node_desc, device/numa_node, ports/1/{state, phys_state, rate, lid, sm_lid,
//!     sm_sl, lmc, cap_mask, link_layer, gids/N, gid_attrs/types/N, gid_attrs/ndevs/N,
//!     pkeys/0}}
//! class/infiniband_verbs/{abi_version, uverbsN/{ibdev, abi_version, dev}}
//! ```
//!
//! Each file holds what the kernel's would, in its format (`drivers/infiniband/core/sysfs.c`,
//! `uverbs_main.c`), taken from the device's own queries. `<key>` is a hash of every file's
//! path and contents, so processes with the same devices share one tree and processes with
//! other devices (another `SOFTVERBS_DEVICES`) get their own; a tree is written to a private
//! temporary directory and renamed into place whole, so a reader never sees half of one.
//! The tree is a snapshot taken when the process first lists its devices: a port state that
//! changes later (a networked device's link going down) is not rewritten.
//!
//! softverbs devices have no character device: `uverbsN/dev` is `1:3`, /dev/null's number,
//! the node `/dev/infiniband/uverbsN` must be for UCX, which lists only devices whose node
//! exists (see the README).

use softverbs_nic::device::Device;
use softverbs_nic::types::{LinkLayer, PortState};
use std::io;
use std::path::{Path, PathBuf};

/// The uverbs ABI version the kernel reports (`IB_USER_VERBS_ABI_VERSION`).
const ABI_VERSION: u32 = 6;
/// What `uverbsN/dev` holds: /dev/null's `major:minor` (see the module doc).
const CDEV: &str = "1:3";

/// One file of the tree: its path below the root and its contents.
pub(crate) type File = (String, String);

/// The files describing `devs` (the process's device list, in `ibv_get_device_list` order:
/// device `i` is `uverbs<i>`).
pub(crate) fn render(devs: &[&Device]) -> Vec<File> {
    let mut out = vec![(
        "class/infiniband_verbs/abi_version".to_string(),
        format!("{ABI_VERSION}\n"),
    )];
    for (i, dev) in devs.iter().enumerate() {
        render_device(&mut out, i, dev);
    }
    out
}

fn render_device(out: &mut Vec<File>, index: usize, dev: &Device) {
    let name = dev.name();
    // A name that is not one path component (`SOFTVERBS_DEVICES` allows any ASCII) would
    // write outside the tree: such a device has no directory.
    if name.contains('/') || name == "." || name == ".." {
        return;
    }
    let a = dev.attr();
    let cfg = dev.config();
    let d = format!("class/infiniband/{name}");
    let mut put = |path: String, text: String| out.push((path, text));
    let uv = format!("class/infiniband_verbs/uverbs{index}");
    put(format!("{uv}/ibdev"), format!("{name}\n"));
    put(format!("{uv}/abi_version"), format!("{ABI_VERSION}\n"));
    put(format!("{uv}/dev"), format!("{CDEV}\n"));
    put(format!("{d}/node_type"), "1: CA\n".into());
    put(format!("{d}/node_guid"), guid(a.node_guid));
    put(format!("{d}/sys_image_guid"), guid(a.sys_image_guid));
    put(format!("{d}/fw_ver"), format!("{}\n", a.fw_ver));
    put(format!("{d}/hca_type"), "softverbs\n".into());
    put(format!("{d}/hw_rev"), format!("0x{:x}\n", a.hw_ver));
    put(format!("{d}/board_id"), "SOFTVERBS\n".into());
    put(format!("{d}/node_desc"), format!("{} {name}\n", hostname()));
    let netdev = cfg.net.as_ref().and_then(|n| n.netdev.clone());
    put(
        format!("{d}/device/numa_node"),
        format!("{}\n", numa_node(netdev.as_deref())),
    );
    let port = softverbs_nic::device::PORT_NUM;
    let Ok(p) = dev.port_attr(port) else {
        return;
    };
    let pd = format!("{d}/ports/{port}");
    put(format!("{pd}/state"), port_state(p.state));
    put(format!("{pd}/phys_state"), phys_state(p.phys_state));
    put(format!("{pd}/rate"), rate(p.active_speed, p.active_width));
    put(format!("{pd}/lid"), format!("0x{:x}\n", p.lid));
    put(format!("{pd}/sm_lid"), format!("0x{:x}\n", p.sm_lid));
    put(format!("{pd}/sm_sl"), format!("{}\n", p.sm_sl));
    put(format!("{pd}/lmc"), format!("{}\n", p.lmc));
    put(
        format!("{pd}/cap_mask"),
        format!("0x{:08x}\n", p.port_cap_flags),
    );
    let ll = match p.link_layer {
        LinkLayer::Ethernet => "Ethernet",
        _ => "InfiniBand",
    };
    put(format!("{pd}/link_layer"), format!("{ll}\n"));
    let gid_type = match p.link_layer {
        LinkLayer::Ethernet => "RoCE v2",
        _ => "IB/RoCE v1",
    };
    for i in 0..p.gid_tbl_len.max(0) as u32 {
        let Ok(g) = dev.gid(port, i) else {
            continue;
        };
        put(format!("{pd}/gids/{i}"), gid(&g.0));
        put(format!("{pd}/gid_attrs/types/{i}"), format!("{gid_type}\n"));
        // The kernel's file exists for every GID but reading it fails when no netdev is
        // behind the GID; a regular file cannot fail a read, so there is none then.
        if let Some(n) = &netdev {
            put(format!("{pd}/gid_attrs/ndevs/{i}"), format!("{n}\n"));
        }
    }
    for i in 0..p.pkey_tbl_len {
        if let Ok(k) = dev.pkey(port, i) {
            put(format!("{pd}/pkeys/{i}"), format!("0x{k:04x}\n"));
        }
    }
}

/// A GUID as `node_guid_show` prints it: four groups of 16 bits.
fn guid(g: u64) -> String {
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}\n",
        (g >> 48) & 0xffff,
        (g >> 32) & 0xffff,
        (g >> 16) & 0xffff,
        g & 0xffff
    )
}

/// A GID as `%pI6` prints it: eight groups of four hex digits, nothing elided.
fn gid(g: &[u8; 16]) -> String {
    let groups: Vec<String> = g
        .chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect();
    format!("{}\n", groups.join(":"))
}

fn port_state(s: PortState) -> String {
    let name = match s {
        PortState::Nop => "NOP",
        PortState::Down => "DOWN",
        PortState::Init => "INIT",
        PortState::Armed => "ARMED",
        PortState::Active => "ACTIVE",
        PortState::ActiveDefer => "ACTIVE_DEFER",
    };
    format!("{}: {name}\n", s as u32)
}

fn phys_state(s: u8) -> String {
    let name = match s {
        1 => "Sleep",
        2 => "Polling",
        3 => "Disabled",
        4 => "PortConfigurationTraining",
        5 => "LinkUp",
        6 => "LinkErrorRecovery",
        7 => "Phy Test",
        _ => "<unknown>",
    };
    format!("{s}: {name}\n")
}

/// `rate_show`: the lane speed times the width, in Gb/s.
fn rate(speed: u8, width: u8) -> String {
    // (rate in 100 Mb/s units per lane, the speed's name)
    let (per_lane, name) = match speed {
        2 => (50, " DDR"),
        4 => (100, " QDR"),
        8 => (100, " FDR10"),
        16 => (140, " FDR"),
        32 => (250, " EDR"),
        64 => (500, " HDR"),
        128 => (1000, " NDR"),
        _ => (25, ""),
    };
    let lanes = match width {
        1 => 1,
        2 => 4,
        4 => 8,
        8 => 12,
        16 => 2,
        _ => 0,
    };
    let r = per_lane * lanes;
    let half = if r % 10 != 0 { ".5" } else { "" };
    format!("{}{half} Gb/sec ({lanes}X{name})\n", r / 10)
}

/// The NUMA node of the interface behind a networked device, -1 when there is none or the
/// kernel does not say (as for a device not on a PCI bus).
fn numa_node(netdev: Option<&str>) -> i32 {
    netdev
        .and_then(|n| std::fs::read_to_string(format!("/sys/class/net/{n}/device/numa_node")).ok())
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(-1)
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into our buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if r != 0 || end == 0 {
        return "localhost".into();
    }
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// FNV-1a over every path and contents: the tree's name.
fn key(files: &[File]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (p, t) in files {
        for b in p.bytes().chain([0]).chain(t.bytes()).chain([0]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// This user's directory for the trees: `$XDG_RUNTIME_DIR/softverbs/sysfs`, else
/// `$TMPDIR/softverbs-<uid>/sysfs`. Each level we make is mode 0700 and must be a directory
/// of ours, not a link: in a shared `/tmp`, another user could have made it first.
fn base() -> io::Result<PathBuf> {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let top = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| Path::new(d).is_dir()) {
        Some(run) => PathBuf::from(run).join("softverbs"),
        None => std::env::temp_dir().join(format!("softverbs-{uid}")),
    };
    let dir = top.join("sysfs");
    for d in [&top, &dir] {
        private_dir(d, uid)?;
    }
    Ok(dir)
}

/// Makes `d` (mode 0700) unless it exists, then checks it is a real directory owned by `uid`.
fn private_dir(d: &Path, uid: u32) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(d) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", d.display()))),
    }
    let m = std::fs::symlink_metadata(d)?;
    if !m.is_dir() || m.uid() != uid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{}: not a directory of uid {uid}", d.display()),
        ));
    }
    Ok(())
}

/// Writes `files` as a tree under `base` (unless the same tree is there already) and returns
/// its root. The tree is built in a temporary directory and renamed into place, so readers
/// in other processes see all of it or none; when two processes race, the second rename
/// fails and its copy, identical by construction, is removed.
pub(crate) fn publish_in(base: &Path, files: &[File]) -> io::Result<PathBuf> {
    let root = base.join(key(files));
    if root.is_dir() {
        return Ok(root);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = base.join(format!(".tmp-{}-{nanos}", std::process::id()));
    let write = || -> io::Result<()> {
        std::fs::create_dir(&tmp)?;
        for (path, text) in files {
            let p = tmp.join(path);
            if let Some(dir) = p.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&p, text)?;
        }
        Ok(())
    };
    let made = write().and_then(|()| std::fs::rename(&tmp, &root));
    if made.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    match made {
        Ok(()) => Ok(root),
        // Another process renamed the same tree into place first.
        Err(_) if root.is_dir() => Ok(root),
        Err(e) => Err(e),
    }
}

/// Writes the tree for `devs` in this user's runtime directory; returns its root.
pub(crate) fn publish(devs: &[&Device]) -> io::Result<PathBuf> {
    publish_in(&base()?, &render(devs))
}

/// `ibv_read_sysfs_file`: reads `dir/file` into `buf` as rdma-core does: a final newline
/// becomes the terminating NUL; the length read is returned, or -1 with errno (also when the
/// contents fill `buf` with no room for the NUL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_read_sysfs_file(
    dir: *const libc::c_char,
    file: *const libc::c_char,
    buf: *mut libc::c_char,
    size: usize,
) -> libc::c_int {
    if dir.is_null() || file.is_null() || (buf.is_null() && size > 0) {
        crate::set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller passes NUL-terminated strings.
    let (d, f) = unsafe {
        (
            std::ffi::CStr::from_ptr(dir),
            std::ffi::CStr::from_ptr(file),
        )
    };
    let mut path = d.to_bytes().to_vec();
    path.push(b'/');
    path.extend_from_slice(f.to_bytes());
    let Ok(path) = std::ffi::CString::new(path) else {
        crate::set_errno(libc::EINVAL);
        return -1;
    };
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return -1;
    }
    // SAFETY: `buf` has `size` writable bytes (the caller's contract); `fd` is ours.
    let len = unsafe { libc::read(fd, buf as *mut libc::c_void, size) };
    // SAFETY: this thread's errno slot, read before close can change it.
    let err = unsafe { *libc::__errno_location() };
    // SAFETY: our descriptor.
    unsafe { libc::close(fd) };
    if len <= 0 {
        crate::set_errno(err);
        return len as libc::c_int;
    }
    let mut len = len as usize;
    // SAFETY: indices below `len` <= `size`, inside the caller's buffer.
    unsafe {
        if *buf.add(len - 1) == b'\n' as libc::c_char {
            len -= 1;
            *buf.add(len) = 0;
        } else if len < size {
            *buf.add(len) = 0;
        } else {
            return -1;
        }
    }
    len as libc::c_int
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_match_the_kernel() {
        assert_eq!(guid(0x0250_56ff_fe00_0001), "0250:56ff:fe00:0001\n");
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[127, 0, 0, 1]);
        assert_eq!(gid(&g), "0000:0000:0000:0000:0000:ffff:7f00:0001\n");
        assert_eq!(port_state(PortState::Active), "4: ACTIVE\n");
        assert_eq!(phys_state(5), "5: LinkUp\n");
        assert_eq!(rate(32, 2), "100 Gb/sec (4X EDR)\n");
        assert_eq!(rate(1, 1), "2.5 Gb/sec (1X)\n");
        assert_eq!(rate(16, 2), "56 Gb/sec (4X FDR)\n");
    }

    #[test]
    fn the_key_follows_the_contents() {
        let a = vec![("x".to_string(), "1\n".to_string())];
        let b = vec![("x".to_string(), "2\n".to_string())];
        assert_eq!(key(&a), key(&a.clone()));
        assert_ne!(key(&a), key(&b));
    }

    /// The tree of this process's devices, read back the way rdma-core and UCX parse it,
    /// holds what the devices' own queries say.
    #[test]
    fn the_files_hold_what_the_device_says() {
        let nics = Device::list().unwrap();
        let devs: Vec<&Device> = nics.iter().map(|n| &**n).collect();
        let base = std::env::temp_dir().join(format!("softverbs-sysfs-dev-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let root = publish_in(&base, &render(&devs)).unwrap();
        let read = |p: String| {
            std::fs::read_to_string(root.join(&p)).unwrap_or_else(|e| panic!("{p}: {e}"))
        };
        let hex = |t: &str| u64::from_str_radix(t.trim().trim_start_matches("0x"), 16).unwrap();
        assert_eq!(read("class/infiniband_verbs/abi_version".into()), "6\n");
        for (i, dev) in devs.iter().enumerate() {
            let name = dev.name();
            let d = format!("class/infiniband/{name}");
            let uv = format!("class/infiniband_verbs/uverbs{i}");
            assert_eq!(read(format!("{uv}/ibdev")).trim(), name);
            let (maj, min) = read(format!("{uv}/dev"))
                .trim()
                .split_once(':')
                .map(|(a, b)| (a.parse::<u32>().unwrap(), b.parse::<u32>().unwrap()))
                .unwrap();
            assert_eq!((maj, min), (1, 3), "/dev/null's number");
            let a = dev.attr();
            let guid = read(format!("{d}/node_guid")).trim().replace(':', "");
            assert_eq!(u64::from_str_radix(&guid, 16).unwrap(), a.node_guid);
            assert_eq!(read(format!("{d}/fw_ver")).trim(), a.fw_ver);
            assert_eq!(read(format!("{d}/node_type")).split(':').next(), Some("1"));
            let numa: i32 = read(format!("{d}/device/numa_node"))
                .trim()
                .parse()
                .unwrap();
            assert!(numa >= -1);
            let p = dev.port_attr(1).unwrap();
            let pd = format!("{d}/ports/1");
            let state: u32 = read(format!("{pd}/state"))
                .split(':')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(state, p.state as u32);
            assert_eq!(hex(&read(format!("{pd}/lid"))), u64::from(p.lid));
            assert_eq!(
                hex(&read(format!("{pd}/cap_mask"))),
                u64::from(p.port_cap_flags)
            );
            let ll = read(format!("{pd}/link_layer"));
            assert_eq!(ll.trim() == "Ethernet", p.link_layer == LinkLayer::Ethernet);
            for g in 0..p.gid_tbl_len as u32 {
                let text = read(format!("{pd}/gids/{g}"));
                let mut bytes = [0u8; 16];
                for (k, grp) in text.trim().split(':').enumerate() {
                    let v = u16::from_str_radix(grp, 16).unwrap();
                    bytes[2 * k..2 * k + 2].copy_from_slice(&v.to_be_bytes());
                }
                assert_eq!(bytes, dev.gid(1, g).unwrap().0, "gids/{g}");
                let ty = read(format!("{pd}/gid_attrs/types/{g}"));
                let want = if p.link_layer == LinkLayer::Ethernet {
                    "RoCE v2"
                } else {
                    "IB/RoCE v1"
                };
                assert_eq!(ty.trim(), want);
            }
            assert_eq!(
                hex(&read(format!("{pd}/pkeys/0"))),
                u64::from(dev.pkey(1, 0).unwrap())
            );
        }
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn publishing_twice_gives_the_same_whole_tree() {
        let base =
            std::env::temp_dir().join(format!("softverbs-sysfs-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let files = vec![
            ("a/b/c".to_string(), "one\n".to_string()),
            ("a/d".to_string(), "two\n".to_string()),
        ];
        let r1 = publish_in(&base, &files).unwrap();
        let r2 = publish_in(&base, &files).unwrap();
        assert_eq!(r1, r2);
        assert_eq!(std::fs::read_to_string(r1.join("a/b/c")).unwrap(), "one\n");
        assert_eq!(std::fs::read_to_string(r1.join("a/d")).unwrap(), "two\n");
        // Only the tree is left: no temporary directories.
        let names: Vec<_> = std::fs::read_dir(&base).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
