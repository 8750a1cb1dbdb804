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

/// The process's cache of mapped peer QPs, by device GID and QP number.
#[derive(Default)]
pub(crate) struct Peers {
    map: Mutex<HashMap<(Gid, u32), Arc<RemoteQp>>>,
    misses: Mutex<HashMap<(Gid, u32), Instant>>,
}

/// The one cache of this process (a device is its GID, so one map serves every device).
pub(crate) fn peers() -> &'static Peers {
    static PEERS: LazyLock<Peers> = LazyLock::new(Peers::default);
    &PEERS
}

impl Peers {
    /// Forgets (and unmaps) peers of the device with `gid` that no QP of this process uses
    /// any more.
    pub(crate) fn prune(&self, gid: Gid) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        // Only the cache holds an entry with a strong count of 1; nothing can be copying
        // through its mappings, so dropping it here is safe.
        map.retain(|&(g, _), q| g != gid || Arc::strong_count(q) > 1);
    }

    /// The live peer QP `qpn` of the device with `gid`.
    pub(crate) fn get(
        &self,
        gid: Gid,
        qpn: u32,
        clock: crate::clock::Clock,
    ) -> Option<Arc<RemoteQp>> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(q) = map.get(&(gid, qpn)) {
            if q.alive() {
                return Some(q.clone());
            }
            map.remove(&(gid, qpn));
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
                map.insert((gid, qpn), q.clone());
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
