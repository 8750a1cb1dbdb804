//! Layout containers: the state an MR with a non-contiguous layout shares, and the registry a
//! device keeps of them, so that a bind work request (and a layout that nests another) finds
//! a container by key.

use crate::mr::keys::KeyTable;
use crate::mr::layout::Compiled;
use crate::mr::store::Prepared;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// The parts of an MR that change after registration, shared with the device's registry of
/// layout containers ([`Layouts`], so a bind work request can find the MR by key).
pub(crate) struct MrShared {
    /// The key: changes when a layout needs more room than the key entry had.
    pub(crate) key: AtomicU32,
    /// Length in bytes: a layout container's is its layout's.
    pub(crate) len: AtomicU64,
    pub(crate) pd: u32,
    /// `Some` for layout containers.
    pub(crate) layout: Option<Mutex<LayoutState>>,
}

/// The layouts of a container.
#[derive(Default)]
pub(crate) struct LayoutState {
    /// The layout in force.
    pub(crate) current: Option<Prepared>,
    /// A `WITH_POST_WR` layout waiting for its bind work request.
    pub(crate) staged: Option<Prepared>,
    /// Descriptor slots allotted to the key entry (see [`LayoutCaps::check_replace`](crate::mr::layout::LayoutCaps::check_replace)).
    pub(crate) room: u64,
}

impl MrShared {
    /// Executes a bind work request for this container (`pd`: the QP's): publishes the staged
    /// layout. False (a bind error completion) without one, or from another PD.
    pub(crate) fn bind(&self, keys: &KeyTable, layouts: &Layouts, pd: u32) -> bool {
        let Some(state) = &self.layout else {
            return false;
        };
        if self.pd != pd {
            return false;
        }
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(p) = st.staged.take() else {
            return false;
        };
        if p.publish(keys, self.key.load(Ordering::Acquire)).is_err() {
            st.staged = Some(p);
            return false;
        }
        self.len.store(p.compiled.len(), Ordering::Release);
        if let Some(old) = st.current.replace(p) {
            layouts.release(&old.refs);
        }
        true
    }

    /// The compiled layout in force, if any.
    pub(crate) fn current(&self) -> Option<Arc<Compiled>> {
        let st = self
            .layout
            .as_ref()?
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        st.current.as_ref().map(|p| p.compiled.clone())
    }
}

/// The layout containers of one device in this process, by key, and how many layouts (in
/// force or staged) use each key: such an MR is busy.
#[derive(Default)]
pub(crate) struct Layouts {
    mrs: Mutex<HashMap<u32, Weak<MrShared>>>,
    refs: Mutex<HashMap<u32, u32>>,
}

impl Layouts {
    pub(crate) fn register(&self, key: u32, mr: &Arc<MrShared>) {
        lock(&self.mrs).insert(key, Arc::downgrade(mr));
    }

    pub(crate) fn forget(&self, key: u32) {
        lock(&self.mrs).remove(&key);
    }

    pub(crate) fn rekey(&self, old: u32, new: u32, mr: &Arc<MrShared>) {
        let mut m = lock(&self.mrs);
        m.remove(&old);
        m.insert(new, Arc::downgrade(mr));
    }

    /// The layout container with `key`, if it is one of this process.
    pub(crate) fn find(&self, key: u32) -> Option<Arc<MrShared>> {
        lock(&self.mrs).get(&key)?.upgrade()
    }

    /// The layout in force on container `key` (for nesting checks).
    pub(crate) fn current(&self, key: u32) -> Option<Arc<Compiled>> {
        self.find(key)?.current()
    }

    pub(crate) fn acquire(&self, keys: &[u32]) {
        let mut m = lock(&self.refs);
        for k in keys {
            *m.entry(*k).or_insert(0) += 1;
        }
    }

    pub(crate) fn release(&self, keys: &[u32]) {
        let mut m = lock(&self.refs);
        for k in keys {
            if let Some(n) = m.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(k);
                }
            }
        }
    }

    /// How many layouts use `key`.
    pub(crate) fn users(&self, key: u32) -> u32 {
        lock(&self.refs).get(&key).copied().unwrap_or(0)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
