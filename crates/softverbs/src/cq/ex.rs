//! Extended CQ creation (`ibv_create_cq_ex`) and the seed's compact `poll_ex`.

use super::{CompletionChannel, CompletionQueue};
use crate::{Context, Error, Result, WcExFlags};
use bitflags::bitflags;
use softverbs_nic::cq::compact::SeedWcFlags;

bitflags! {
    /// `enum ibv_create_cq_attr_flags` as seed 000 defines it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct CreateCqFlags: u32 {
        /// The seed's `IBV_CREATE_CQ_ATTR_COMPLETION_TIMESTAMP`: completions must carry
        /// timestamps. Every softverbs completion does, so it is accepted and changes nothing.
        const COMPLETION_TIMESTAMP = 1;
    }
}

/// `enum ibv_cq_init_attr_mask`: which optional fields of [`CqInitAttrEx`] are valid.
pub mod cq_init_attr_mask {
    /// `IBV_CQ_INIT_ATTR_FLAGS`: [`flags`](super::CqInitAttrEx::flags) is valid.
    pub const FLAGS: u32 = 1;
}

/// `struct ibv_cq_init_attr_ex`.
///
/// ```
/// use softverbs::*;
///
/// let ctx = softverbs::devices()?[0].open()?;
/// let attr = CqInitAttrEx::new(64)
///     .wc_flags(WcExFlags::BYTE_LEN | WcExFlags::COMPLETION_TIMESTAMP);
/// let cq = ctx.create_cq_ex(&attr)?;
/// assert!(cq.capacity() >= 64);
/// assert_eq!(cq.wc_flags(), WcExFlags::BYTE_LEN | WcExFlags::COMPLETION_TIMESTAMP);
///
/// // A field the device cannot give truthfully is refused.
/// let err = ctx.create_cq_ex(&CqInitAttrEx::new(64).wc_flags(WcExFlags::CVLAN)).err().unwrap();
/// assert_eq!(err.errno(), 95); // EOPNOTSUPP
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy)]
pub struct CqInitAttrEx<'a> {
    /// Completions the CQ must hold at least.
    pub cqe: u32,
    /// The program's value, returned by [`CompletionQueue::context`].
    pub cq_context: u64,
    /// The channel that reports this CQ's events.
    pub channel: Option<&'a CompletionChannel>,
    /// Must be below [`Context::num_comp_vectors`].
    pub comp_vector: u32,
    /// The fields completions carry (anything outside [`WcExFlags::SUPPORTED`] → EOPNOTSUPP).
    pub wc_flags: WcExFlags,
    /// [`cq_init_attr_mask`] bits (unknown bits → EINVAL).
    pub comp_mask: u32,
    /// Creation flags, read when `comp_mask` has [`cq_init_attr_mask::FLAGS`] (unknown flags
    /// → EOPNOTSUPP).
    pub flags: CreateCqFlags,
}

impl<'a> CqInitAttrEx<'a> {
    /// `cqe` completions returning the standard fields (those of `ibv_poll_cq`).
    pub fn new(cqe: u32) -> Self {
        CqInitAttrEx {
            cqe,
            cq_context: 0,
            channel: None,
            comp_vector: 0,
            wc_flags: WcExFlags::STANDARD,
            comp_mask: 0,
            flags: CreateCqFlags::empty(),
        }
    }

    /// Sets the fields completions carry.
    pub fn wc_flags(mut self, wc_flags: WcExFlags) -> Self {
        self.wc_flags = wc_flags;
        self
    }

    /// Reports events on `channel`.
    pub fn channel(mut self, channel: &'a CompletionChannel) -> Self {
        self.channel = Some(channel);
        self
    }

    /// Sets creation flags (and the `comp_mask` bit that makes them valid).
    pub fn flags(mut self, flags: CreateCqFlags) -> Self {
        self.flags = flags;
        self.comp_mask |= cq_init_attr_mask::FLAGS;
        self
    }
}

impl Context {
    /// Completion vectors of this context (`context->num_comp_vectors`).
    pub fn num_comp_vectors(&self) -> u32 {
        1
    }

    /// `ibv_create_cq_ex`: a CQ whose completions carry the fields of `attr.wc_flags`.
    pub fn create_cq_ex(&self, attr: &CqInitAttrEx<'_>) -> Result<CompletionQueue> {
        let unknown_mask = attr.comp_mask & !cq_init_attr_mask::FLAGS;
        if unknown_mask != 0 {
            return Err(Error::InvalidArgument(format!(
                "unknown comp_mask bits {unknown_mask:#x}"
            )));
        }
        if attr.comp_vector >= self.num_comp_vectors() {
            return Err(Error::InvalidArgument(format!(
                "comp_vector {} (the context has {})",
                attr.comp_vector,
                self.num_comp_vectors()
            )));
        }
        let unsupported = attr.wc_flags.difference(WcExFlags::SUPPORTED);
        if !unsupported.is_empty() {
            return Err(Error::Unsupported(format!(
                "wc_flags {unsupported:?} (the device gives {:?})",
                WcExFlags::SUPPORTED
            )));
        }
        if attr.comp_mask & cq_init_attr_mask::FLAGS != 0 {
            let unknown = attr.flags.difference(CreateCqFlags::all());
            if !unknown.is_empty() {
                return Err(Error::Unsupported(format!(
                    "create flags {:#x}",
                    unknown.bits()
                )));
            }
        }
        let cq = self.inner.create_cq_ex(
            attr.cqe,
            attr.channel.map(|c| c.inner.clone()),
            attr.wc_flags,
        )?;
        cq.set_user_context(attr.cq_context);
        Ok(CompletionQueue { inner: cq })
    }
}

/// `struct ibv_poll_cq_ex_attr` of seed 000.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollCqExAttr {
    /// Records to return at most.
    pub max_entries: usize,
    /// Must be 0 (no optional fields are defined).
    pub comp_mask: u32,
}

impl CompletionQueue {
    /// The fields this CQ's completions carry (`wc_flags` at creation; the standard set for
    /// [`Context::create_cq`]).
    pub fn wc_flags(&self) -> WcExFlags {
        self.inner.wc_flags()
    }

    /// The `cq_context` given at creation.
    pub fn context(&self) -> u64 {
        self.inner.user_context()
    }

    /// The seed's `cq_creation_wc_flags` of this CQ: its fields in the seed's numbering,
    /// which [`poll_ex`](Self::poll_ex) records and the [`compact`](crate::compact) helpers
    /// use.
    pub fn compact_flags(&self) -> SeedWcFlags {
        self.inner.layout().flags()
    }

    /// Bytes of one [`poll_ex`](Self::poll_ex) record (`ibv_wc_ex_get_size`).
    pub fn compact_record_size(&self) -> usize {
        self.inner.layout().size()
    }

    /// Seed 000's `ibv_poll_cq_ex`: writes up to `attr.max_entries` completions into `buf` as
    /// compact records, each a 32-byte header then only this CQ's fields (64-, 32-, 16-, then
    /// 8-bit, rounded up to 8 bytes), and returns how many. A record's header `wc_flags` has
    /// the seed's output bits and the `WITH_*` bits of the fields valid in that record
    /// (receive-only fields are absent from send completions, and failed completions carry
    /// only the QP number and timestamps).
    ///
    /// ```
    /// use softverbs::{*, compact::SeedWcFlags as S};
    ///
    /// let ctx = softverbs::devices()?[0].open()?;
    /// let cq = ctx.create_cq_ex(&CqInitAttrEx::new(16).wc_flags(WcExFlags::BYTE_LEN))?;
    /// let flags = cq.compact_flags().bits();
    /// let mut buf = vec![0u8; 16 * cq.compact_record_size()];
    /// let n = cq.poll_ex(&mut buf, PollCqExAttr { max_entries: 16, comp_mask: 0 })?;
    /// for rec in buf.chunks_exact(cq.compact_record_size()).take(n) {
    ///     let len = compact::get32(rec, flags, S::WITH_BYTE_LEN.bits());
    ///     println!("{} bytes", len);
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn poll_ex(&self, buf: &mut [u8], attr: PollCqExAttr) -> Result<usize> {
        if attr.comp_mask != 0 {
            return Err(Error::InvalidArgument(format!(
                "poll_ex comp_mask {:#x}",
                attr.comp_mask
            )));
        }
        Ok(self.inner.poll_compact(buf, attr.max_entries))
    }
}
