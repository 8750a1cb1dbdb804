//! Network namespaces for tests and `perf --net`: two hosts joined by a veth pair, cut off
//! from every other network, made and removed by one value.
//!
//! RoCEv2 between hosts needs two network stacks on one machine: each namespace is a host
//! with its own interfaces, addresses and routes. [`NetPair::new`] makes
//!
//! - **A** and **B**, two namespaces named `svA-<pid>-<n>` and `svB-<pid>-<n>` (unique per
//!   process and per pair), with `lo` up;
//! - a veth pair between them: `sva` in A, `svb` in B, at the chosen MTU, up;
//! - on `sva` 10.77.N.1/24 and fd00:5f:N::1/64, on `svb` .2 and ::2 (N is the pair's number
//!   in this process, so captures of two pairs do not mix up addresses); the IPv6 addresses
//!   are added with `nodad`, and duplicate address detection is off on the interfaces
//!   before they go up, so the link-local addresses too are usable at once;
//! - with [`NetConfig::attacker`], a third host **C** (`svC-…`, interface `svc`, .3 and
//!   ::3) on the same segment: then no veth joins A and B directly; each host's veth ends
//!   in a bridge of a fourth namespace, `svS-…`, so C can send packets to either host as if
//!   it were on the wire (a spoofer), and the hosts' interfaces are veths either way.
//!
//! Only routes to the /24 and /64 exist, so nothing leaves the namespaces. Dropping the
//! [`NetPair`] deletes the namespaces, which deletes their interfaces; that happens on a
//! panic's unwinding too, and namespaces left by a process that was killed are deleted by
//! the next [`NetPair::new`] (their names carry the dead process's id).
//!
//! ```no_run
//! use softverbs_cli::netns::{NetConfig, NetPair};
//!
//! let net = NetPair::new(&NetConfig::default())?;
//! let out = net.a().command("ping").args(["-c1", &net.b().ipv4.to_string()]).output()?;
//! assert!(out.status.success());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::OsStr;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};

/// Where `ip netns` keeps its named namespaces.
const NETNS_DIR: &str = "/run/netns";
/// Prefix of every namespace this module makes (`svA-`, `svB-`, `svC-`, `svS-`).
const PREFIX: &str = "sv";
/// The MTUs a pair may have: IPv6 needs 1280; veths go up to 64 KiB, jumbo frames to 9000.
pub const MTU_RANGE: std::ops::RangeInclusive<u32> = 1280..=9000;

/// Pairs made by this process so far: the N in names and addresses.
static PAIRS: AtomicU8 = AtomicU8::new(0);

/// What went wrong making, changing or removing namespaces.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// Making namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN).
    #[error("network namespaces need root (this process runs as uid {0})")]
    NotRoot(u32),
    /// `ip` could not be started at all.
    #[error("cannot run `ip` (install iproute2): {0}")]
    NoIp(#[source] std::io::Error),
    /// An `ip` command ran and failed.
    #[error("`{command}` failed: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// What it printed on standard error.
        stderr: String,
    },
    /// The requested MTU is outside [`MTU_RANGE`].
    #[error("MTU {0} is out of range ({lo}..={hi})", lo = MTU_RANGE.start(), hi = MTU_RANGE.end())]
    BadMtu(u32),
    /// The pair was made without the attacker host.
    #[error("this pair has no attacker host (make it with NetConfig {{ attacker: true, .. }})")]
    NoAttacker,
}

/// How to make a [`NetPair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    /// MTU of every interface of the segment (default 1500).
    pub mtu: u32,
    /// Also make host C on the same segment (through a bridge namespace).
    pub attacker: bool,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            mtu: 1500,
            attacker: false,
        }
    }
}

/// One of the hosts of a [`NetPair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    /// The first end (`sva`, .1).
    A,
    /// The second end (`svb`, .2).
    B,
    /// The third host on the segment (`svc`, .3), with [`NetConfig::attacker`] only.
    Attacker,
}

/// A host: its namespace, its interface on the segment and that interface's addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNs {
    /// The namespace's name, as `ip netns` knows it.
    pub netns: String,
    /// The interface on the segment (a veth end).
    pub ifname: String,
    /// Its IPv4 address (prefix /24).
    pub ipv4: Ipv4Addr,
    /// Its unique-local IPv6 address (prefix /64).
    pub ipv6: Ipv6Addr,
}

impl HostNs {
    /// `program` to be run inside this host's namespace (`ip netns exec NETNS program`); add
    /// arguments, environment and standard streams as for any [`Command`].
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.arg("netns").arg("exec").arg(&self.netns).arg(program);
        cmd
    }

    /// Runs `ip -n NETNS ARGS...`; its standard output on success.
    pub fn ip(&self, args: &[&str]) -> Result<String, NetnsError> {
        let mut all = vec!["-n", &self.netns];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// The interface's IPv6 link-local address, if it has one.
    pub fn link_local(&self) -> Result<Option<Ipv6Addr>, NetnsError> {
        let out = self.ip(&[
            "-6",
            "-o",
            "addr",
            "show",
            "dev",
            &self.ifname,
            "scope",
            "link",
        ])?;
        // Lines look like "2: sva    inet6 fe80::1/64 scope link ...".
        Ok(out
            .split_whitespace()
            .skip_while(|w| *w != "inet6")
            .nth(1)
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok()))
    }
}

/// Two (or three) hosts in network namespaces on one segment; removed when dropped.
#[derive(Debug)]
pub struct NetPair {
    hosts: Vec<HostNs>,
    /// The bridge's namespace, with [`NetConfig::attacker`].
    switch: Option<String>,
    /// Every namespace made, in order, for the clean-up.
    made: Vec<String>,
    mtu: u32,
}

impl NetPair {
    /// Makes the namespaces, links and addresses `config` asks for. Namespaces of dead
    /// processes that made pairs before are deleted first.
    ///
    /// # Errors
    ///
    /// [`NetnsError::NotRoot`] unless root; [`NetnsError::BadMtu`]; the first `ip` command
    /// that failed (whatever was made by then is removed again).
    pub fn new(config: &NetConfig) -> Result<NetPair, NetnsError> {
        check_privileges()?;
        if !MTU_RANGE.contains(&config.mtu) {
            return Err(NetnsError::BadMtu(config.mtu));
        }
        remove_stale();
        let n = PAIRS.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let name = |role: char| format!("{PREFIX}{role}-{pid}-{n}");
        let host = |role: char, last: u8| HostNs {
            netns: name(role),
            ifname: format!("sv{}", role.to_ascii_lowercase()),
            ipv4: Ipv4Addr::new(10, 77, n, last),
            ipv6: Ipv6Addr::new(0xfd00, 0x5f, u16::from(n), 0, 0, 0, 0, u16::from(last)),
        };
        let mut hosts = vec![host('A', 1), host('B', 2)];
        if config.attacker {
            hosts.push(host('C', 3));
        }
        // From here on, dropping `pair` removes whatever was made.
        let mut pair = NetPair {
            hosts: Vec::new(),
            switch: None,
            made: Vec::new(),
            mtu: config.mtu,
        };
        for h in &hosts {
            pair.add_namespace(&h.netns)?;
        }
        let mtu = config.mtu.to_string();
        if config.attacker {
            let s = name('S');
            pair.add_namespace(&s)?;
            ip(&["-n", &s, "link", "add", "br0", "type", "bridge"])?;
            // No STP delay and no multicast snooping: frames (neighbour discovery
            // included) flow the moment the ports are up.
            ip(&[
                "-n",
                &s,
                "link",
                "set",
                "br0",
                "type",
                "bridge",
                "forward_delay",
                "0",
                "mcast_snooping",
                "0",
            ])?;
            ip(&["-n", &s, "link", "set", "br0", "mtu", &mtu, "up"])?;
            for h in &hosts {
                let port = format!("p{}", &h.ifname[2..]);
                ip(&[
                    "-n", &h.netns, "link", "add", &h.ifname, "type", "veth", "peer", "name",
                    &port, "netns", &s,
                ])?;
                ip(&[
                    "-n", &s, "link", "set", &port, "mtu", &mtu, "master", "br0", "up",
                ])?;
            }
            pair.switch = Some(s);
        } else {
            let (a, b) = (&hosts[0], &hosts[1]);
            ip(&[
                "-n", &a.netns, "link", "add", &a.ifname, "type", "veth", "peer", "name",
                &b.ifname, "netns", &b.netns,
            ])?;
        }
        for h in &hosts {
            // Before the link goes up, so the link-local address skips DAD as well.
            let dad = format!("net.ipv6.conf.{}.accept_dad=0", h.ifname);
            run(h.command("sysctl").args(["-q", "-w", &dad]))?;
            h.ip(&["addr", "add", &format!("{}/24", h.ipv4), "dev", &h.ifname])?;
            h.ip(&["link", "set", &h.ifname, "mtu", &mtu, "up"])?;
            h.ip(&["link", "set", "lo", "up"])?;
        }
        // The IPv6 addresses once every link is up: added to an interface that is still
        // down, the first neighbour solicitation for them went unanswered and the address
        // was unreachable for about 2 s.
        for h in &hosts {
            let addr = format!("{}/64", h.ipv6);
            h.ip(&["addr", "add", &addr, "dev", &h.ifname, "nodad"])?;
        }
        pair.hosts = hosts;
        Ok(pair)
    }

    fn add_namespace(&mut self, name: &str) -> Result<(), NetnsError> {
        ip(&["netns", "add", name])?;
        self.made.push(name.to_owned());
        Ok(())
    }

    /// Host A.
    pub fn a(&self) -> &HostNs {
        &self.hosts[0]
    }

    /// Host B.
    pub fn b(&self) -> &HostNs {
        &self.hosts[1]
    }

    /// Host C, if the pair was made with [`NetConfig::attacker`].
    pub fn attacker(&self) -> Option<&HostNs> {
        self.hosts.get(2)
    }

    /// The host `host`.
    ///
    /// # Errors
    ///
    /// [`NetnsError::NoAttacker`] for [`Host::Attacker`] on a pair without one.
    pub fn host(&self, host: Host) -> Result<&HostNs, NetnsError> {
        match host {
            Host::A => Ok(self.a()),
            Host::B => Ok(self.b()),
            Host::Attacker => self.attacker().ok_or(NetnsError::NoAttacker),
        }
    }

    /// The MTU of the segment.
    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    /// Every namespace of the pair (hosts, then the bridge's, if any).
    pub fn namespaces(&self) -> Vec<String> {
        self.made.clone()
    }

    /// Sets `host`'s interface down (`up == false`) or up again: the other end sees its
    /// carrier go away, as when a cable is pulled.
    ///
    /// # Errors
    ///
    /// [`NetnsError::NoAttacker`], or the `ip` command's failure.
    pub fn set_link(&self, host: Host, up: bool) -> Result<(), NetnsError> {
        let h = self.host(host)?;
        h.ip(&["link", "set", &h.ifname, if up { "up" } else { "down" }])
            .map(drop)
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            if let Err(e) = ip(&["netns", "delete", ns]) {
                eprintln!("softverbs netns: removing namespace {ns}: {e}");
            }
        }
    }
}

/// Ok if this process may make namespaces: it runs as root and `ip` runs.
///
/// # Errors
///
/// [`NetnsError::NotRoot`] or [`NetnsError::NoIp`].
pub fn check_privileges() -> Result<(), NetnsError> {
    let uid = rustix::process::geteuid().as_raw();
    if uid != 0 {
        return Err(NetnsError::NotRoot(uid));
    }
    Command::new("ip")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(NetnsError::NoIp)?;
    Ok(())
}

/// For tests: true if namespaces can be made here. Otherwise prints `SKIPPED: <test>: why`
/// and returns false, except under `CI=true`, where it panics (a CI run must not skip).
pub fn available_for_test(test: &str) -> bool {
    match check_privileges() {
        Ok(()) => true,
        Err(e) => {
            let ci = std::env::var("CI").as_deref() == Ok("true");
            assert!(!ci, "{test}: {e} (CI=true: not skipping)");
            eprintln!("SKIPPED: {test}: {e}");
            false
        }
    }
}

/// True if a namespace called `name` exists.
pub fn namespace_exists(name: &str) -> bool {
    std::path::Path::new(NETNS_DIR).join(name).exists()
}

/// Deletes namespaces of this module whose process is gone (killed before its drop ran).
fn remove_stale() {
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = owner_pid(&name) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "delete", &name]);
        }
    }
}

/// The process id in a name this module made (`svA-<pid>-<n>`), if it is one.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?;
    let mut parts = rest.splitn(3, '-');
    let role = parts.next()?;
    if !matches!(role, "A" | "B" | "C" | "S") {
        return None;
    }
    let pid = parts.next()?.parse().ok()?;
    parts.next()?.parse::<u8>().ok()?;
    Some(pid)
}

/// Runs `ip ARGS...`; its standard output on success.
fn ip(args: &[&str]) -> Result<String, NetnsError> {
    let mut cmd = Command::new("ip");
    cmd.args(args);
    run(&mut cmd)
}

/// Runs `cmd` to its end; its standard output on success, else its standard error.
fn run(cmd: &mut Command) -> Result<String, NetnsError> {
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(NetnsError::NoIp)?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    Err(NetnsError::Command {
        command: shown,
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_this_module_are_owned() {
        assert_eq!(owner_pid("svA-123-0"), Some(123));
        assert_eq!(owner_pid("svS-9-255"), Some(9));
        assert_eq!(owner_pid("svX-123-0"), None);
        assert_eq!(owner_pid("svA-123"), None);
        assert_eq!(owner_pid("svA-12x-0"), None);
        assert_eq!(owner_pid("other"), None);
    }

    #[test]
    fn a_bad_mtu_is_refused_before_anything_is_made() {
        if check_privileges().is_err() {
            return;
        }
        let err = NetPair::new(&NetConfig {
            mtu: 100,
            attacker: false,
        })
        .unwrap_err();
        assert!(matches!(err, NetnsError::BadMtu(100)), "{err}");
    }
}
