//! A running process's softverbs state, read from outside it through `/proc`, for explaining
//! a hang: what each thread is blocked in, and the header of every CQ ring it holds (armed or
//! not, an event waiting for the channel, completions waiting to be polled).
//!
//! Device memory is shared memory by design, so this needs no help from the process: a hung
//! program is inspected as it is. It needs what a peer needs (the same user, or root, and a
//! ptrace policy that lets `/proc/<pid>/fd` be opened), and only reads.
//!
//! ```no_run
//! let report = softverbs_nic::inspect::process(std::process::id());
//! eprintln!("{report}");
//! ```

use crate::cq::RingState;
use crate::device_memory::ring::Ring;
use crate::device_memory::segment::Segment;

/// One thread of an inspected process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadState {
    pub tid: u32,
    /// The thread's name (`comm`).
    pub name: String,
    /// The scheduler state letter (`R` running, `S` sleeping, ...).
    pub state: char,
    /// The kernel function it sleeps in (`wchan`; `0` when running).
    pub wchan: String,
}

/// A CQ ring a process holds: its own CQ's, or one of another process it completes into
/// (the same ring shows in both processes with the same inode and offset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CqRing {
    /// The descriptor number in the inspected process.
    pub fd: i32,
    /// The `memfd`'s inode.
    pub inode: u64,
    /// Where the ring is in the `memfd` (an arena holds many).
    pub offset: usize,
    pub state: RingState,
}

/// What [`process`] found.
#[derive(Debug, Clone, Default)]
pub struct ProcessReport {
    pub pid: u32,
    pub threads: Vec<ThreadState>,
    /// Each CQ ring the process holds, by descriptor number.
    pub cq_rings: Vec<CqRing>,
    /// What could not be read, and why.
    pub problems: Vec<String>,
}

/// Inspects process `pid`; what cannot be read is listed in [`ProcessReport::problems`].
pub fn process(pid: u32) -> ProcessReport {
    let mut report = ProcessReport {
        pid,
        ..Default::default()
    };
    match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(tasks) => {
            for task in tasks.flatten() {
                if let Some(t) = thread(pid, &task.file_name().to_string_lossy()) {
                    report.threads.push(t);
                }
            }
            report.threads.sort_by_key(|t| t.tid);
        }
        Err(e) => report.problems.push(format!("/proc/{pid}/task: {e}")),
    }
    match std::fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(fds) => {
            for fd in fds.flatten() {
                let Ok(n) = fd.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                let Ok(target) = std::fs::read_link(fd.path()) else {
                    continue;
                };
                let target = target.to_string_lossy();
                let found = if target.starts_with("/memfd:softverbs-cq") {
                    cq_ring(pid, n).map(|r| vec![r])
                } else if target.starts_with("/memfd:softverbs-arena") {
                    arena_cq_rings(pid, n)
                } else {
                    continue;
                };
                match found {
                    Ok(rings) => report.cq_rings.extend(rings),
                    Err(e) => report.problems.push(format!("CQ rings at fd {n}: {e}")),
                }
            }
            report.cq_rings.sort_by_key(|r| (r.fd, r.offset));
        }
        Err(e) => report.problems.push(format!("/proc/{pid}/fd: {e}")),
    }
    report
}

fn thread(pid: u32, tid: &str) -> Option<ThreadState> {
    let dir = format!("/proc/{pid}/task/{tid}");
    let stat = std::fs::read_to_string(format!("{dir}/stat")).ok()?;
    // `pid (comm) S ...`: the name may hold spaces and parentheses, the state follows the last
    // closing parenthesis.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(').map_or("", |(_, n)| n).to_string();
    let state = rest.trim_start().chars().next().unwrap_or('?');
    let wchan = std::fs::read_to_string(format!("{dir}/wchan")).unwrap_or_default();
    Some(ThreadState {
        tid: tid.parse().ok()?,
        name,
        state,
        wchan,
    })
}

fn open_fd(pid: u32, fd: i32) -> crate::Result<rustix::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let path = format!("/proc/{pid}/fd/{fd}");
    rustix::fs::open(path.as_str(), OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
        .map_err(crate::Error::os("open /proc/<pid>/fd"))
}

fn cq_ring(pid: u32, fd: i32) -> crate::Result<CqRing> {
    let seg = Segment::open(open_fd(pid, fd)?)?;
    let inode = seg.inode();
    Ok(CqRing {
        fd,
        inode,
        offset: 0,
        state: RingState::of(&Ring::open(seg)?),
    })
}

/// The CQ rings in an arena file, as its tag map says. The map is read, not mapped: reading
/// a hole of the sparse file through a mapping would give it pages.
fn arena_cq_rings(pid: u32, fd: i32) -> crate::Result<Vec<CqRing>> {
    use crate::device_memory::arena::{Kind, MAP_BYTES, UNIT, decode_tag};
    let f = open_fd(pid, fd)?;
    let st = rustix::fs::fstat(&f).map_err(crate::Error::os("fstat"))?;
    let mut map = vec![0u8; MAP_BYTES];
    let mut got = 0;
    while got < map.len() {
        match rustix::io::pread(&f, &mut map[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => return Err(crate::Error::os("pread")(e)),
        }
    }
    let mut rings = Vec::new();
    for (unit, &tag) in map[..got].iter().enumerate() {
        let Some((Kind::CqRing, len)) = decode_tag(tag) else {
            continue;
        };
        let offset = unit * UNIT;
        let seg = Segment::open_peer(pid, fd, st.st_ino, offset, len)?;
        // A ring being created or freed right now has no valid header: not a ring yet.
        if let Ok(ring) = Ring::open(seg) {
            rings.push(CqRing {
                fd,
                inode: st.st_ino,
                offset,
                state: RingState::of(&ring),
            });
        }
    }
    Ok(rings)
}

impl std::fmt::Display for ProcessReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "process {}:", self.pid)?;
        for t in &self.threads {
            writeln!(
                f,
                "  thread {} ({}): state {}, wchan {}",
                t.tid,
                t.name,
                t.state,
                if t.wchan.is_empty() { "?" } else { &t.wchan }
            )?;
        }
        if self.cq_rings.is_empty() {
            writeln!(f, "  no CQ rings")?;
        }
        for r in &self.cq_rings {
            writeln!(
                f,
                "  fd {} (inode {}, at {:#x}): {}",
                r.fd, r.inode, r.offset, r.state
            )?;
        }
        for p in &self.problems {
            writeln!(f, "  (could not read {p})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cq::{Channel, Cq, Cqe};
    use crate::device::event::AsyncQueue;
    use crate::types::WcExFlags;
    use std::sync::Arc;

    fn cq(id: u32, ch: Option<Arc<Channel>>) -> Arc<Cq> {
        Cq::new(
            id,
            (8, 1 << 20),
            ch,
            Arc::new(AsyncQueue::new().unwrap()),
            (0..4)
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect(),
            crate::clock::Clock::new(64),
            None,
            WcExFlags::STANDARD,
        )
        .unwrap()
    }

    /// This process, inspected as another would inspect it: the CQ rings it holds, with their
    /// arm, pending event and waiting completions as they are.
    #[test]
    fn a_process_shows_its_cq_rings_and_threads() {
        let ch = Channel::new().unwrap();
        let armed = cq(0x5eed_0001, Some(ch.clone()));
        let plain = cq(0x5eed_0002, None);
        armed.req_notify(false).unwrap();
        assert!(plain.push(Cqe::default()));
        assert!(plain.push(Cqe::default()));
        let find = |r: &ProcessReport, id: u32| {
            r.cq_rings
                .iter()
                .map(|r| r.state.clone())
                .find(|s| s.cq_id == id)
                .unwrap_or_else(|| panic!("cq {id:#x} in {r}"))
        };
        let r = process(std::process::id());
        assert!(r.problems.is_empty(), "{r}");
        assert!(r.threads.iter().any(|t| t.tid == std::process::id()), "{r}");
        let a = find(&r, 0x5eed_0001);
        assert_eq!(
            (a.arm.as_str(), a.event_pending, a.has_channel, a.ready),
            ("next", false, true, 0),
            "{a}"
        );
        let p = find(&r, 0x5eed_0002);
        assert_eq!(
            (p.arm.as_str(), p.has_channel, p.ready, p.head, p.tail),
            ("none", false, 2, 0, 2),
            "{p}"
        );
        // The armed CQ fires: the event waits for the channel, the arm is spent.
        assert!(armed.push(Cqe::default()));
        let a = find(&process(std::process::id()), 0x5eed_0001);
        assert_eq!(
            (a.arm.as_str(), a.event_pending, a.ready),
            ("none", true, 1),
            "{a}"
        );
        let text = process(std::process::id()).to_string();
        assert!(text.contains("arm none, event pending"), "{text}");
    }

    #[test]
    fn a_process_that_is_gone_is_a_problem_not_a_panic() {
        let r = process(u32::MAX);
        assert!(r.threads.is_empty() && r.cq_rings.is_empty());
        assert_eq!(r.problems.len(), 2, "{r}");
    }
}
