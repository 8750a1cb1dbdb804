//! Shared PDs across processes: a context's command descriptor, and the PDs and regions
//! another process imports through it (`ibv_import_device`, `ibv_import_pd`,
//! `ibv_import_mr`).

use crate::{Context, ProtectionDomain, Result, Sge};
use softverbs_nic::device::Context as NicContext;
use softverbs_nic::mr::keys::KeyInfo;
use std::ops::Range;
use std::os::fd::BorrowedFd;

impl Context {
    /// The command descriptor (`ibv_context::cmd_fd`). Pass it to another process on this
    /// host (`SCM_RIGHTS`, or inheritance) for [`Context::import`].
    pub fn cmd_fd(&self) -> BorrowedFd<'_> {
        self.inner.cmd_fd()
    }

    /// `ibv_import_device`: a context sharing the PDs of the context whose
    /// [`cmd_fd`](Self::cmd_fd) this is (of this process or another on this host). It has
    /// CQs, QPs and events of its own; PDs it allocates are its own.
    ///
    /// ```
    /// use softverbs::*;
    /// let ctx = softverbs::devices()?[0].open()?;
    /// let pd = ctx.alloc_pd()?;
    /// let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    /// mr.write_at(0, b"shared")?;
    ///
    /// // Usually in another process, with the descriptor passed over a socket.
    /// let other = Context::import(ctx.cmd_fd())?;
    /// let shared = other.import_pd(pd.handle())?;
    /// let region = shared.import_mr(mr.lkey())?;
    /// let cq = other.create_cq(4, None)?;
    /// let qp = shared.create_qp(&QpInitAttr::rc(&cq, &cq))?;
    /// qp.connect(&qp.endpoint(0)?, 0, AccessFlags::REMOTE_WRITE)?;
    /// // The imported region's bytes go out of this QP (an RDMA WRITE within the region).
    /// let op = SendOp::RdmaWrite { remote_addr: region.iova() + 32, rkey: region.rkey() };
    /// qp.post_send([SendWr::new(1, op, &[region.sge(0..6)]).flags(SendFlags::SIGNALED)])?;
    /// assert!(cq.wait_one()?.is_ok());
    /// assert_eq!(&mr.to_vec()[32..38], b"shared");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn import(cmd_fd: BorrowedFd<'_>) -> Result<Context> {
        Ok(Context {
            inner: NicContext::import(cmd_fd)?,
        })
    }

    /// `ibv_import_pd`: the exporter's PD `handle` ([`ProtectionDomain::handle`]), in a
    /// context made by [`Context::import`]. Regions and windows cannot be registered in it
    /// (register them in the exporting process and import them).
    pub fn import_pd(&self, handle: u32) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain {
            inner: self.inner.import_pd(handle)?,
            parent: None,
        })
    }
}

impl ProtectionDomain {
    /// The handle another process imports this PD by (`ibv_pd::handle`).
    pub fn handle(&self) -> u32 {
        self.inner.id()
    }

    /// `ibv_import_mr`: region `handle` (its key, `ibv_mr::handle`) of this imported PD.
    pub fn import_mr(&self, handle: u32) -> Result<ImportedRegion> {
        Ok(ImportedRegion {
            info: self.inner.import_mr(handle)?,
        })
    }
}

/// A region of another process, imported into a shared PD: its keys and IOVA range, for
/// work requests and for peers. Its bytes stay the owner's (and go when the owner
/// deregisters it).
#[derive(Debug, Clone, Copy)]
pub struct ImportedRegion {
    info: KeyInfo,
}

impl ImportedRegion {
    pub fn lkey(&self) -> u32 {
        self.info.key
    }
    pub fn rkey(&self) -> u32 {
        self.info.key
    }
    /// The IOVA of its first byte.
    pub fn iova(&self) -> u64 {
        self.info.iova
    }
    pub fn len(&self) -> usize {
        self.info.length as usize
    }
    pub fn is_empty(&self) -> bool {
        self.info.length == 0
    }
    /// The rights it was registered with.
    pub fn access(&self) -> crate::AccessFlags {
        self.info.access
    }
    /// An SGE over `range` of its bytes.
    pub fn sge(&self, range: Range<usize>) -> Sge {
        Sge {
            addr: self.iova() + range.start as u64,
            length: range.len() as u32,
            lkey: self.lkey(),
        }
    }
}
