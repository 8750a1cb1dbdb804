//! Nothing of softverbs outlives the processes that used it: no `/dev/shm` segment and no
//! abstract unix socket whose name contains "softverbs" — and a long-lived process does not
//! keep a dead peer's memory mapped.
//!
//! Both RDMA processes are children; the parent only relays. The test runs alone among this
//! binary's multi-process tests ([`exclusive`]). Entries that appear meanwhile but belong to
//! processes outside this test's process group (another test run on the host) are not ours
//! and are ignored; anything else new that is left once both children have exited is a leak.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, exclusive, msg, peer};
use softverbs::*;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const NEEDLE: &str = "softverbs";

/// The host-wide entries the test watches.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    /// Names in `/dev/shm`.
    shm: BTreeSet<String>,
    /// Unix sockets by inode, with their path (`@name` for abstract ones).
    sockets: BTreeMap<u64, String>,
}

fn snapshot() -> Snapshot {
    let shm = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(NEEDLE))
                .collect()
        })
        .unwrap_or_default();
    // "Num RefCount Protocol Flags Type St Inode Path"
    let unix = std::fs::read_to_string("/proc/net/unix").expect("/proc/net/unix");
    let sockets = unix
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let path = f.get(7..)?.join(" ");
            path.contains(NEEDLE)
                .then(|| Some((f[6].parse().ok()?, path)))
                .flatten()
        })
        .collect();
    Snapshot { shm, sockets }
}

/// What a process holds: socket inodes (open fds) and `/dev/shm` names (open fds or mappings,
/// any name), and how many softverbs memfds it maps.
#[derive(Debug, Default)]
struct Holdings {
    sockets: BTreeSet<u64>,
    shm: BTreeSet<String>,
    memfd_maps: usize,
}

fn holdings(pid: u32) -> Holdings {
    let mut h = Holdings::default();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let t = target.to_string_lossy();
            if let Some(ino) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                h.sockets.extend(ino.parse::<u64>().ok());
            } else if let Some(name) = t.strip_prefix("/dev/shm/") {
                h.shm
                    .insert(name.trim_end_matches(" (deleted)").to_string());
            }
        }
    }
    if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
        for l in maps.lines() {
            if let Some(i) = l.find("/dev/shm/") {
                h.shm
                    .insert(l[i + 9..].trim_end_matches(" (deleted)").to_string());
            } else if l.contains("/memfd:") && l.contains(NEEDLE) {
                h.memfd_maps += 1;
            }
        }
    }
    h
}

/// The process group of `pid`.
fn pgrp(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    // " S ppid pgrp ..."
    after.split_whitespace().nth(2)?.parse().ok()
}

/// Live processes other than this one, each with its process group and holdings.
fn live_processes() -> Vec<(u32, Option<u32>, Holdings)> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .map(|pid| (pid, pgrp(pid), holdings(pid)))
        .collect()
}

/// Entries new since `before` that are left over: held by nobody, or only by processes of our
/// own process group (descendants of the test's children), never by another test run's.
fn leftovers(before: &Snapshot) -> (Vec<String>, Vec<String>) {
    let after = snapshot();
    let my_group = pgrp(std::process::id());
    let others: Vec<_> = live_processes()
        .into_iter()
        .filter(|(_, g, _)| *g != my_group)
        .collect();
    let mine = holdings(std::process::id());
    let held_elsewhere_shm =
        |n: &String| mine.shm.contains(n) || others.iter().any(|(_, _, h)| h.shm.contains(n));
    let held_elsewhere_sock =
        |i: &u64| mine.sockets.contains(i) || others.iter().any(|(_, _, h)| h.sockets.contains(i));
    let shm = after
        .shm
        .difference(&before.shm)
        .filter(|n| !held_elsewhere_shm(n))
        .map(|n| format!("/dev/shm/{n}"))
        .collect();
    let sockets = after
        .sockets
        .iter()
        .filter(|(i, _)| !before.sockets.contains_key(i) && !held_elsewhere_sock(i))
        .map(|(i, p)| format!("{p} (inode {i})"))
        .collect();
    (shm, sockets)
}

peer!(peer_leak_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let mem = n.mr(16 * 1024);
    let rbuf = n.mr(4096);
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mem)));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.post_recv([RecvWr::new(1, &[rbuf.sge(0..4096)])])
        .unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");
    p.expect("report");
    let mut wc = [WorkCompletion::default()];
    let verdict = if !spin_until(DATA_WAIT, || n.cq.poll(&mut wc) == 1) {
        "no-receive-completion".to_string()
    } else if !wc[0].is_ok() {
        format!("receive-{:?}", wc[0].status())
    } else {
        let data = pattern(8192, 8);
        match compare(&mem.to_vec()[..8192], &data) {
            v if v == "ok" => compare(&rbuf.to_vec()[..100], &data[..100]),
            v => v,
        }
    };
    p.send(msg!("target-result", verdict));
    p.expect("exit");
});

peer!(peer_leak_initiator, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    p.send(msg!("initiator", qp.endpoint(0).unwrap()));
    let m = p.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    qp.connect(&tep, 0, ALL_REMOTE).unwrap();
    p.send("connected");
    p.expect("go");
    let src = n.mr(8192);
    let data = pattern(8192, 8);
    src.write_at(0, &data).unwrap();
    let local = n.mr(4096);
    let (w, s, r) = ([src.sge(0..8192)], [src.sge(0..100)], [local.sge(0..4096)]);
    qp.post_send([
        signaled(SendWr::new(
            1,
            SendOp::RdmaWrite {
                remote_addr: mem.iova,
                rkey: mem.rkey,
            },
            &w,
        )),
        signaled(SendWr::new(2, SendOp::Send, &s)),
        signaled(SendWr::new(
            3,
            SendOp::RdmaRead {
                remote_addr: mem.iova,
                rkey: mem.rkey,
            },
            &r,
        )),
    ])
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [WorkCompletion::default(); 3];
    spin_until(DATA_WAIT, || {
        let k = n.cq.poll(&mut buf);
        got.extend_from_slice(&buf[..k]);
        got.len() == 3
    });
    let verdict = if got.len() == 3 && got.iter().all(|w| w.is_ok()) {
        compare(&local.to_vec(), &data[..4096])
    } else {
        let st: Vec<String> = got.iter().map(|w| format!("{:?}", w.status())).collect();
        format!("{}-of-3-completions:{}", got.len(), st.join(","))
    };
    p.send(msg!("initiator-result", verdict));
    p.expect("exit");
});

#[test]
fn no_softverbs_shm_segment_or_abstract_socket_is_left_after_both_processes_exit() {
    let _alone = exclusive();
    let before = snapshot();
    let mut t = Peer::spawn("cleanup::peer_leak_target");
    let mut i = Peer::spawn("cleanup::peer_leak_initiator");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let iep: Endpoint = i.expect("initiator").get(0);
    t.send(msg!("initiator", iep));
    t.expect("ready");
    i.send(msg!("target", tep, mem));
    i.expect("connected");
    i.send("go");
    let initiator = i.expect("initiator-result").get::<String>(0);
    t.send("report");
    let target = t.expect("target-result").get::<String>(0);

    // Both alive, done with RDMA: what they hold, for the report.
    let during = snapshot();
    let (ht, hi) = (holdings(t.pid()), holdings(i.pid()));
    let count = |h: &Holdings| {
        h.sockets
            .iter()
            .filter(|s| during.sockets.contains_key(s))
            .count()
    };
    let held = format!(
        "while alive, the target (pid {}) mapped {} softverbs memfds and held {} of the \
         softverbs sockets, the initiator (pid {}) {} and {} (this process: pid {}); \
         softverbs entries then: {during:?}",
        t.pid(),
        ht.memfd_maps,
        count(&ht),
        i.pid(),
        hi.memfd_maps,
        count(&hi),
        std::process::id(),
    );
    eprintln!("{held}");
    t.send("exit");
    i.send("exit");
    t.finish();
    i.finish();

    // Sockets and segments may take a moment to go after the last holder exits.
    let deadline = Instant::now() + Duration::from_secs(3);
    let (shm, sockets) = loop {
        let (shm, sockets) = leftovers(&before);
        if (shm.is_empty() && sockets.is_empty()) || Instant::now() > deadline {
            break (shm, sockets);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        shm.is_empty() && sockets.is_empty(),
        "left after both processes exited: shared memory {shm:?}, abstract sockets \
         {sockets:?}\n before: {before:?}\n {held}"
    );
    // The check means something only if the processes really did RDMA with each other.
    assert_eq!(
        (initiator.as_str(), target.as_str()),
        ("ok", "ok"),
        "(initiator, target) results of the WRITE + SEND + READ exchange; no leftovers were \
         found, but the check is only meaningful once the exchange works\n {held}"
    );
}

/// Inodes of the softverbs memfds this process has open.
fn my_memfd_inodes() -> BTreeSet<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut out = BTreeSet::new();
    for fd in std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
    {
        let is_ours = std::fs::read_link(fd.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:softverbs"));
        if is_ours && let Ok(m) = std::fs::metadata(fd.path()) {
            out.insert(m.ino());
        }
    }
    out
}

/// How many mappings of this process are of a file with one of `inodes`.
fn mappings_of(inodes: &BTreeSet<u64>) -> usize {
    // "start-end perms offset dev inode path"
    std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .nth(4)
                .and_then(|i| i.parse::<u64>().ok())
                .is_some_and(|i| i != 0 && inodes.contains(&i))
        })
        .count()
}

// Tells the inodes of its softverbs memfds (its device memory), then serves as a target.
peer!(peer_mapped_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let mem = n.mr(64 * 1024);
    let inodes: Vec<String> = my_memfd_inodes().iter().map(u64::to_string).collect();
    p.send(msg!(
        "target",
        qp.endpoint(0).unwrap(),
        RemoteMr::of(&mem),
        inodes.join(",")
    ));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.connect(&them, 0, ALL_REMOTE).unwrap();
    p.send("ready");
    p.expect("exit");
});

#[test]
fn initiator_unmaps_a_peers_memory_once_the_peer_exited_and_the_qp_is_destroyed() {
    if crate::harness::between_hosts() {
        eprintln!(
            "skipped between hosts: an initiator on another host maps none of the target's memory"
        );
        return;
    }
    // Alone: another test's lookup of the same QP number must not tidy up for us.
    let _alone = exclusive();
    let mut t = Peer::spawn("cleanup::peer_mapped_target");
    let m = t.expect("target");
    let (tep, mem, list): (Endpoint, RemoteMr, String) = (m.get(0), m.get(1), m.get(2));
    let inodes: BTreeSet<u64> = list.split(',').filter_map(|i| i.parse().ok()).collect();
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let local = n.mr(64 * 1024);
    let s = [local.sge(0..64 * 1024)];
    let write = SendOp::RdmaWrite {
        remote_addr: mem.iova,
        rkey: mem.rkey,
    };
    let read = SendOp::RdmaRead {
        remote_addr: mem.iova,
        rkey: mem.rkey,
    };
    qp.post_send([
        signaled(SendWr::new(1, write, &s)),
        signaled(SendWr::new(2, read, &s)),
    ])
    .unwrap();
    assert_all_ok(&poll_n(&n.cq, 2, "WRITE and READ"), "WRITE and READ");
    let mapped = mappings_of(&inodes);
    assert!(
        mapped > 0,
        "the initiator maps the target's device memory while it works on it (memfd inodes \
         {inodes:?}); nothing to check otherwise"
    );

    t.send("exit");
    t.finish();
    drop(qp);
    let deadline = Instant::now() + Duration::from_secs(2);
    let left = loop {
        let left = mappings_of(&inodes);
        if left == 0 || Instant::now() > deadline {
            break left;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        left, 0,
        "{left} of the {mapped} mappings of the exited peer's memory (memfd inodes {inodes:?}) \
         are still in this process 2 s after the peer exited and the QP to it was destroyed"
    );
}

peer!(peer_idle, |p| {
    p.send("idle");
    p.expect("bye");
});

#[test]
fn destroying_a_qp_frees_its_discovery_names_even_while_a_child_process_started_meanwhile_lives() {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let qpn = qp.qp_num();
    let tag = format!("/{qpn:06x}");
    let mine = holdings(std::process::id()).sockets;
    let names: BTreeMap<u64, String> = snapshot()
        .sockets
        .into_iter()
        .filter(|(i, p)| mine.contains(i) && (p.ends_with(&tag) || p.contains(&format!("{tag}/"))))
        .collect();
    if names.is_empty() {
        eprintln!("QP {qpn:#x} has no abstract socket name with \"{NEEDLE}\": nothing to check");
        return;
    }
    let mut child = Peer::spawn("cleanup::peer_idle");
    child.expect("idle");
    let theirs = holdings(child.pid()).sockets;
    let inherited = names.keys().filter(|i| theirs.contains(i)).count();
    drop(qp);
    let deadline = Instant::now() + Duration::from_secs(1);
    let left = loop {
        let now = snapshot().sockets;
        let left: Vec<&String> = names
            .iter()
            .filter(|(i, _)| now.contains_key(i))
            .map(|(_, p)| p)
            .collect();
        if left.is_empty() || Instant::now() > deadline {
            break left;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        left.is_empty(),
        "QP {qpn:#x} is destroyed, but its names {left:?} are still bound while a child process \
         started meanwhile lives: it inherited {inherited} of the {} sockets (they lack \
         close-on-exec), so the QP number stays taken and listed",
        names.len()
    );
    child.send("bye");
    child.finish();
}
