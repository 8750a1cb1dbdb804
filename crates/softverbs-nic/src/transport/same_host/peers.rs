//! The cache of other processes' QPs this process has mapped, so that a connection maps its
//! peer once and a UD sender does not scan the directory for every message.

use super::remote::RemoteQp;
use crate::types::Gid;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

/// How long a failed lookup is remembered: UD sends to a QP number nobody has must not scan
/// `/proc/net/unix` every time.
const MISS_TTL: Duration = Duration::from_millis(50);
/// Up to this many peers, every QP that goes sweeps the cache at once.
const SWEEP_ALWAYS: usize = 64;

/// The process's cache of mapped peer QPs, by device GID and QP number.
#[derive(Default)]
pub(crate) struct Peers {
    map: Mutex<Mapped>,
    misses: Mutex<HashMap<(Gid, u32), Instant>>,
}

#[derive(Default)]
struct Mapped {
    qps: HashMap<(Gid, u32), Arc<RemoteQp>>,
    /// QPs gone since the last sweep.
    released: usize,
}

/// The one cache of this process (a device is its GID, so one map serves every device).
pub(crate) fn peers() -> &'static Peers {
    static PEERS: LazyLock<Peers> = LazyLock::new(Peers::default);
    &PEERS
}

impl Peers {
    /// A QP of the device with `gid` went: forgets (and unmaps) the peers no QP of this
    /// process uses any more. The sweep visits every peer, so with many it runs once in as
    /// many QPs gone as half the peers: each QP's share stays constant (a process closing
    /// 65,536 connections would otherwise sweep 65,536 peers for each); until then each QP
    /// gone leaves at most the peer it was connected to mapped.
    pub(crate) fn prune(&self, gid: Gid) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.released += 1;
        if map.qps.len() > SWEEP_ALWAYS && map.released * 2 < map.qps.len() {
            return;
        }
        map.released = 0;
        // Only the cache holds an entry with a strong count of 1; nothing can be copying
        // through its mappings, so dropping it here is safe.
        map.qps
            .retain(|&(g, _), q| g != gid || Arc::strong_count(q) > 1);
    }

    /// The live peer QP `qpn` of the device with `gid`.
    pub(crate) fn get(
        &self,
        gid: Gid,
        qpn: u32,
        clock: crate::clock::Clock,
    ) -> Option<Arc<RemoteQp>> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(q) = map.qps.get(&(gid, qpn)) {
            if q.alive() {
                return Some(q.clone());
            }
            map.qps.remove(&(gid, qpn));
        }
        let mut misses = self.misses.lock().unwrap_or_else(|e| e.into_inner());
        if misses
            .get(&(gid, qpn))
            .is_some_and(|t| t.elapsed() < MISS_TTL)
        {
            return None;
        }
        match RemoteQp::open(gid, qpn, clock) {
            Some(q) => {
                misses.remove(&(gid, qpn));
                map.qps.insert((gid, qpn), q.clone());
                Some(q)
            }
            None => {
                misses.retain(|_, t| t.elapsed() < MISS_TTL);
                misses.insert((gid, qpn), Instant::now());
                None
            }
        }
    }
}
