//! Thread domains and parent domains (`ibv_alloc_td`, `ibv_alloc_parent_domain`).
//!
//! A thread domain is the program's promise that one thread uses what is made in it, which
//! lets a provider drop locks; softverbs' queues are safe from any thread, so it changes
//! nothing and is kept only to be named. A parent domain is a PD that is its protection
//! domain to every check (its QPs, regions and windows are the PD's) and names a thread
//! domain. The C drop-in's parent domains also take the program's allocators, which
//! softverbs never calls (its queues are shared-memory segments that peers map); Rust has no
//! allocator hook to offer.

use crate::{Context, Error, ProtectionDomain, Result};
use softverbs_nic::device::{Context as NicContext, InUse};
use std::sync::Arc;

/// A thread domain (`struct ibv_td`). Clones are handles to the same one.
#[derive(Clone)]
pub struct ThreadDomain {
    ctx: Arc<NicContext>,
}

/// What a parent domain holds: its thread domain, and its PD in use while it lives.
pub(crate) struct Parent {
    td: Option<ThreadDomain>,
    _hold: InUse,
}

impl Context {
    /// `ibv_alloc_td`: a thread domain of this context.
    pub fn alloc_td(&self) -> ThreadDomain {
        ThreadDomain {
            ctx: self.inner.clone(),
        }
    }
}

impl ProtectionDomain {
    /// `ibv_alloc_parent_domain`: a PD that is this one to every check, naming thread domain
    /// `td` (of this PD's context). A parent domain cannot be the PD of another.
    ///
    /// ```
    /// use softverbs::*;
    /// let ctx = softverbs::devices()?[0].open()?;
    /// let pd = ctx.alloc_pd()?;
    /// let td = ctx.alloc_td();
    /// let parent = pd.alloc_parent_domain(Some(&td))?;
    /// assert!(parent.is_parent_domain() && parent.thread_domain().is_some());
    /// assert_eq!(parent.handle(), pd.handle(), "the same protection domain");
    /// assert!(parent.alloc_parent_domain(None).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_parent_domain(&self, td: Option<&ThreadDomain>) -> Result<ProtectionDomain> {
        if self.parent.is_some() {
            return Err(Error::InvalidArgument(
                "a parent domain cannot be the PD of another".into(),
            ));
        }
        if td.is_some_and(|t| !Arc::ptr_eq(&t.ctx, self.inner.context())) {
            return Err(Error::InvalidArgument(
                "the thread domain belongs to another context".into(),
            ));
        }
        Ok(ProtectionDomain {
            inner: self.inner.clone(),
            parent: Some(Arc::new(Parent {
                td: td.cloned(),
                _hold: self.inner.hold(),
            })),
        })
    }

    /// True for a parent domain.
    pub fn is_parent_domain(&self) -> bool {
        self.parent.is_some()
    }

    /// A parent domain's thread domain.
    pub fn thread_domain(&self) -> Option<&ThreadDomain> {
        self.parent.as_ref().and_then(|p| p.td.as_ref())
    }
}
