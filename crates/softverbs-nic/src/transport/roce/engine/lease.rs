//! Leases: the DREQs a process's CM agent leaves with the engine, to be sent if the process
//! dies with its connections established.
//!
//! A kernel CM outlives the processes it serves: when one dies, the host's CM sends each of
//! its peers a DREQ, and the peer's program sees `RDMA_CM_EVENT_DISCONNECTED`. Here the CM
//! runs in the process and dies with it, so its agent hands the engine, for each established
//! connection, the DREQ it would send ([`LEASE`](super::gsi::LEASE) envelopes), and takes it
//! back when the connection ends ([`CANCEL`](super::gsi::CANCEL)). The engine watches the
//! processes that hold leases and sends the DREQs of one that is gone.
//!
//! Leases are keyed by the sender's pid as the kernel reported it (`SCM_CREDENTIALS`), never a
//! pid the envelope claims, and the local communication ID of the DREQ. The table is bounded
//! ([`PER_PID`], [`IN_ALL`]); every operation on it is O(log n), and one look at whether the
//! holders are alive is bounded too ([`PIDS_PER_SWEEP`]).

use super::gsi::MAD_LEN;
use rustix::event::{PollFd, PollFlags, poll};
use rustix::fd::OwnedFd;
use rustix::process::{Pid, PidfdFlags, pidfd_open};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

/// At most this many leases for one process (a process with more connections than this
/// loses the DREQs of the extra ones if it dies; its peers then time out instead).
pub(crate) const PER_PID: usize = 4096;
/// At most this many leases in all (about 19 MiB of MADs).
pub(crate) const IN_ALL: usize = 65_536;
/// How often the engine looks whether the holders of leases are still alive.
pub(crate) const CHECK_EVERY: Duration = Duration::from_millis(200);
/// Holders looked at per sweep: a sweep is a system call per holder, and must not stall the
/// QPs; the next sweep goes on where this one stopped.
pub(crate) const PIDS_PER_SWEEP: usize = 1024;
/// Holders watched through a pidfd (immune to pid reuse, and it sees a zombie as dead); the
/// others are looked at with `kill(pid, 0)`. Bounded so that leases never take the
/// descriptors the engine needs for its clients.
pub(crate) const PIDFDS_AT_MOST: usize = 256;

/// One leased DREQ: what to send, from where, to where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lease {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub mad: [u8; MAD_LEN],
}

/// A process holding leases.
struct Holder {
    leases: usize,
    /// Readable once the process has ended; `None` past [`PIDFDS_AT_MOST`] or where
    /// `pidfd_open` fails.
    pidfd: Option<OwnedFd>,
}

/// Whether the process of `pid` (watched through `pidfd`, if any) still runs.
fn alive(pid: u32, pidfd: Option<&OwnedFd>) -> bool {
    if let Some(fd) = pidfd {
        let mut fds = [PollFd::new(fd, PollFlags::IN)];
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        return match poll(&mut fds, Some(&zero)) {
            Ok(_) => fds[0].revents().is_empty(),
            // Cannot tell: keep the leases, look again next time.
            Err(_) => true,
        };
    }
    crate::sync::process_exists(pid)
}

/// What happened to a lease offered to the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taken {
    /// Held (a new key).
    Held,
    /// Held in place of the lease with the same key.
    Replaced,
    /// Refused: the process or the table is full.
    Dropped,
}

/// The engine's leases, by (pid, local communication ID).
#[derive(Default)]
pub(crate) struct Leases {
    by_key: BTreeMap<(u32, u32), Lease>,
    holders: BTreeMap<u32, Holder>,
    pidfds: usize,
    /// Where the next sweep starts (sweeps go round the holders in pid order).
    cursor: u32,
}

impl Leases {
    /// Leases held now.
    pub(crate) fn len(&self) -> usize {
        self.by_key.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Processes holding leases now.
    #[cfg(test)]
    pub(crate) fn holders(&self) -> usize {
        self.holders.len()
    }

    /// Holds `lease` for process `pid` under local communication ID `id`, in place of an
    /// earlier one with the same key.
    pub(crate) fn lease(&mut self, pid: u32, id: u32, lease: Lease) -> Taken {
        if let Some(old) = self.by_key.get_mut(&(pid, id)) {
            *old = lease;
            return Taken::Replaced;
        }
        if self.by_key.len() >= IN_ALL
            || self.holders.get(&pid).is_some_and(|h| h.leases >= PER_PID)
        {
            return Taken::Dropped;
        }
        let pidfds = &mut self.pidfds;
        let h = self.holders.entry(pid).or_insert_with(|| {
            // Opened now, while the sender most likely still runs: a pidfd then names this
            // process and no later one with its pid. If it is already gone, the next look
            // with kill(pid, 0) says so (a pid reused in between is the known gap).
            let pidfd = (*pidfds < PIDFDS_AT_MOST)
                .then(|| {
                    let p = i32::try_from(pid).ok().and_then(Pid::from_raw)?;
                    pidfd_open(p, PidfdFlags::empty()).ok()
                })
                .flatten();
            *pidfds += usize::from(pidfd.is_some());
            Holder { leases: 0, pidfd }
        });
        h.leases += 1;
        self.by_key.insert((pid, id), lease);
        Taken::Held
    }

    /// Forgets the lease of process `pid` with local communication ID `id`; false if there
    /// was none.
    pub(crate) fn cancel(&mut self, pid: u32, id: u32) -> bool {
        if self.by_key.remove(&(pid, id)).is_none() {
            return false;
        }
        if let Some(h) = self.holders.get_mut(&pid) {
            h.leases -= 1;
            if h.leases == 0 {
                self.forget_holder(pid);
            }
        }
        true
    }

    fn forget_holder(&mut self, pid: u32) {
        if let Some(h) = self.holders.remove(&pid) {
            self.pidfds -= usize::from(h.pidfd.is_some());
        }
    }

    /// Removes and appends to `out` every lease of process `pid`.
    fn take_all(&mut self, pid: u32, out: &mut Vec<Lease>) {
        let keys: Vec<(u32, u32)> = self
            .by_key
            .range((pid, 0)..=(pid, u32::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some(l) = self.by_key.remove(&k) {
                out.push(l);
            }
        }
        self.forget_holder(pid);
    }

    /// If process `pid` holds leases and is gone, removes them and appends them to `out`.
    pub(crate) fn fire_if_dead(&mut self, pid: u32, out: &mut Vec<Lease>) {
        self.fire_if(pid, out, alive);
    }

    fn fire_if(
        &mut self,
        pid: u32,
        out: &mut Vec<Lease>,
        alive: impl Fn(u32, Option<&OwnedFd>) -> bool,
    ) {
        if let Some(h) = self.holders.get(&pid)
            && !alive(pid, h.pidfd.as_ref())
        {
            self.take_all(pid, out);
        }
    }

    /// Looks at up to [`PIDS_PER_SWEEP`] holders, from where the last sweep stopped, and
    /// removes and appends to `out` the leases of those that are gone.
    pub(crate) fn sweep(&mut self, out: &mut Vec<Lease>) {
        self.sweep_with(out, alive);
    }

    fn sweep_with(&mut self, out: &mut Vec<Lease>, alive: impl Fn(u32, Option<&OwnedFd>) -> bool) {
        let mut dead = Vec::new();
        let mut next = None;
        // From the cursor to the end, then from the start up to the cursor.
        let order = self
            .holders
            .range(self.cursor..)
            .chain(self.holders.range(..self.cursor));
        for (looked, (&pid, h)) in order.enumerate() {
            if looked == PIDS_PER_SWEEP {
                next = Some(pid);
                break;
            }
            if !alive(pid, h.pidfd.as_ref()) {
                dead.push(pid);
            }
        }
        self.cursor = next.unwrap_or(0);
        for pid in dead {
            self.take_all(pid, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dreq(id: u32) -> Lease {
        let mut mad = [0u8; MAD_LEN];
        mad[..4].copy_from_slice(&[1, 7, 2, 3]);
        mad[16..18].copy_from_slice(&0x15u16.to_be_bytes());
        mad[24..28].copy_from_slice(&id.to_be_bytes());
        Lease {
            src: "10.0.0.1".parse().unwrap(),
            dst: "10.0.0.2".parse().unwrap(),
            mad,
        }
    }

    /// A pid that has just ended: a child run and reaped.
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true")
            .spawn()
            .expect("run true");
        let pid = c.id();
        c.wait().expect("reap it");
        pid
    }

    #[test]
    fn a_lease_is_held_replaced_and_cancelled_by_pid_and_comm_id() {
        let mut t = Leases::default();
        assert_eq!(t.lease(10, 1, dreq(1)), Taken::Held);
        assert_eq!(t.lease(10, 2, dreq(2)), Taken::Held);
        assert_eq!(t.lease(11, 1, dreq(1)), Taken::Held, "another pid's ID 1");
        let mut newer = dreq(1);
        newer.mad[255] = 9;
        assert_eq!(t.lease(10, 1, newer.clone()), Taken::Replaced);
        assert_eq!((t.len(), t.holders()), (3, 2));
        assert!(!t.cancel(10, 3), "no such lease");
        assert!(!t.cancel(12, 1), "no such pid");
        assert!(t.cancel(11, 1));
        assert!(!t.cancel(11, 1), "only once");
        assert_eq!((t.len(), t.holders()), (2, 1), "pid 11 holds nothing now");
        // Pid 10 is gone: both of its leases come out, the replacement and not the first.
        let mut out = Vec::new();
        t.fire_if(10, &mut out, |_, _| false);
        assert_eq!(out.len(), 2);
        assert!(out.contains(&newer));
        assert!(out.contains(&dreq(2)));
        assert!(t.is_empty() && t.holders() == 0);
    }

    #[test]
    fn a_living_holder_keeps_its_leases() {
        let me = std::process::id();
        let mut t = Leases::default();
        t.lease(me, 7, dreq(7));
        let mut out = Vec::new();
        t.fire_if_dead(me, &mut out);
        t.sweep(&mut out);
        assert!(out.is_empty(), "this process runs");
        assert_eq!(t.len(), 1);
        assert!(t.pidfds <= 1);
        t.fire_if_dead(me + 1, &mut out);
        assert!(out.is_empty(), "a pid without leases fires nothing");
    }

    #[test]
    fn the_leases_of_a_dead_process_fire_once() {
        let me = std::process::id();
        let gone = dead_pid();
        let mut t = Leases::default();
        t.lease(me, 1, dreq(1));
        t.lease(gone, 1, dreq(0x100));
        t.lease(gone, 2, dreq(0x200));
        let mut out = Vec::new();
        t.sweep(&mut out);
        assert_eq!(
            out,
            vec![dreq(0x100), dreq(0x200)],
            "the dead pid's, in ID order"
        );
        assert_eq!((t.len(), t.holders()), (1, 1), "ours stays");
        out.clear();
        t.sweep(&mut out);
        t.fire_if_dead(gone, &mut out);
        assert!(out.is_empty(), "fired once");
    }

    #[test]
    fn a_process_dead_before_its_pidfd_was_opened_is_seen_by_kill() {
        // No pidfd (pidfd_open fails with ESRCH): kill(pid, 0) tells.
        let gone = dead_pid();
        let mut t = Leases::default();
        t.lease(gone, 5, dreq(5));
        assert_eq!(t.pidfds, 0);
        let mut out = Vec::new();
        t.fire_if_dead(gone, &mut out);
        assert_eq!(out, vec![dreq(5)]);
    }

    #[test]
    fn the_table_is_bounded_per_process_and_in_all() {
        let mut t = Leases::default();
        for id in 0..PER_PID as u32 {
            assert_eq!(t.lease(1, id, dreq(id)), Taken::Held);
        }
        assert_eq!(
            t.lease(1, u32::MAX, dreq(0)),
            Taken::Dropped,
            "pid 1 is full"
        );
        assert_eq!(
            t.lease(1, 0, dreq(0)),
            Taken::Replaced,
            "replacing still works"
        );
        assert!(t.cancel(1, 0));
        assert_eq!(t.lease(1, u32::MAX, dreq(0)), Taken::Held, "room again");
        for pid in 2..(IN_ALL / PER_PID) as u32 + 1 {
            for id in 0..PER_PID as u32 {
                assert_eq!(t.lease(pid, id, dreq(id)), Taken::Held);
            }
        }
        assert_eq!(t.len(), IN_ALL);
        assert_eq!(
            t.lease(99_999, 0, dreq(0)),
            Taken::Dropped,
            "the table is full"
        );
        assert_eq!(t.holders(), IN_ALL / PER_PID);
    }

    #[test]
    fn a_sweep_is_bounded_and_goes_round() {
        let mut t = Leases::default();
        let n = PIDS_PER_SWEEP as u32 + 10;
        for pid in 1..=n {
            // Whether these pids run does not matter: the closure says they are gone.
            t.lease(pid, 0, dreq(pid));
        }
        let looked = std::cell::Cell::new(0);
        let mut out = Vec::new();
        let all_dead = |_: u32, _: Option<&OwnedFd>| {
            looked.set(looked.get() + 1);
            false
        };
        t.sweep_with(&mut out, all_dead);
        assert_eq!(looked.get(), PIDS_PER_SWEEP);
        assert_eq!(out.len(), PIDS_PER_SWEEP);
        t.sweep_with(&mut out, all_dead);
        assert_eq!(out.len(), n as usize, "the next sweep took the rest");
        assert!(t.is_empty());
    }
}
