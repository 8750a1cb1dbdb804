//! Polling a CQ in place: the cursor (`ibv_start_poll` / `ibv_next_poll` / `ibv_end_poll` and
//! the `ibv_wc_read_*` readers) and its typed form.

use super::{CompletionQueue, WorkCompletion};
use crate::{Error, Result, WcExFlags, WcFlags, WcOpcode, WcStatus};
use softverbs_nic::cq::{Cqe, Cursor as NicCursor};

/// A polling section: it holds one completion, read where it lies in the CQ ring, until
/// [`next`](Self::next) moves on or the cursor is dropped ([`end`](Self::end)).
///
/// Readers of fields the CQ was not created with return `None`; [`TypedCursor`] moves that
/// check to compile time.
///
/// ```
/// use softverbs::*;
///
/// let ctx = softverbs::devices()?[0].open()?;
/// let cq = ctx.create_cq_ex(&CqInitAttrEx::new(16)
///     .wc_flags(WcExFlags::BYTE_LEN | WcExFlags::COMPLETION_TIMESTAMP))?;
/// if let Some(mut c) = cq.start_poll() {
///     loop {
///         println!("{} {:?} {:?} at {:?}", c.wr_id(), c.status(), c.byte_len(), c.completion_ts());
///         if !c.next() {
///             break; // ENOENT: the CQ is empty
///         }
///     }
///     c.end();
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Cursor<'a> {
    /// Alone: see the NIC cursor's `wall` for why nothing is added beside it.
    inner: NicCursor<'a>,
}

impl CompletionQueue {
    /// `ibv_start_poll`: a cursor on the oldest completion, or `None` (`ENOENT`) when the CQ
    /// is empty.
    #[inline(always)]
    pub fn start_poll(&self) -> Option<Cursor<'_>> {
        let wall = self
            .inner
            .wc_flags()
            .contains(WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK);
        let inner = self.inner.start_poll(wall)?;
        Some(Cursor { inner })
    }

    /// This CQ with its field set `F` (a union of [`fields`] constants) in the type, for
    /// [`TypedCursor`]. `EINVAL` if the CQ was not created with every field of `F`; the one
    /// check, made here rather than per completion.
    pub fn typed<const F: u64>(&self) -> Result<TypedCompletionQueue<F>> {
        let want = WcExFlags::from_bits_retain(F);
        if !self.inner.wc_flags().contains(want) {
            return Err(Error::InvalidArgument(format!(
                "typed poller wants {want:?}; the CQ returns {:?}",
                self.inner.wc_flags()
            )));
        }
        Ok(TypedCompletionQueue { cq: self.clone() })
    }
}

impl Cursor<'_> {
    #[inline]
    fn cqe(&self) -> &Cqe {
        self.inner.cqe()
    }

    #[inline]
    fn field<T>(&self, flag: WcExFlags, v: impl FnOnce(&Cqe) -> T) -> Option<T> {
        self.inner.wc_flags().contains(flag).then(|| v(self.cqe()))
    }

    /// `ibv_next_poll`: moves to the next completion; false (`ENOENT`) when there is none, in
    /// which case the cursor must only be ended.
    #[inline(always)]
    #[allow(clippy::should_implement_trait)] // the verbs name; a cursor is not an iterator
    pub fn next(&mut self) -> bool {
        self.inner.advance()
    }

    /// `ibv_end_poll`: ends the section (dropping the cursor does the same).
    #[inline(always)]
    pub fn end(self) {}

    /// `wr_id` of the work request completed.
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.cqe().wr_id
    }

    /// `status`.
    #[inline]
    pub fn status(&self) -> WcStatus {
        self.cqe().status()
    }

    /// True when the status is `SUCCESS` (one compare, no conversion).
    #[inline]
    pub fn is_ok(&self) -> bool {
        self.cqe().status == WcStatus::Success as u8
    }

    /// `ibv_wc_read_opcode`.
    #[inline]
    pub fn opcode(&self) -> WcOpcode {
        self.cqe().opcode()
    }

    /// `ibv_wc_read_vendor_err`.
    #[inline]
    pub fn vendor_err(&self) -> u32 {
        self.cqe().vendor_err
    }

    /// `ibv_wc_read_wc_flags`.
    #[inline]
    pub fn wc_flags(&self) -> WcFlags {
        self.cqe().flags()
    }

    /// `ibv_wc_read_byte_len`; `None` unless the CQ returns `BYTE_LEN`.
    #[inline]
    pub fn byte_len(&self) -> Option<u32> {
        self.field(WcExFlags::BYTE_LEN, |c| c.byte_len)
    }

    /// `ibv_wc_read_imm_data`; `None` unless the CQ returns `IMM` and the message had
    /// immediate data.
    #[inline]
    pub fn imm_data(&self) -> Option<u32> {
        self.field(WcExFlags::IMM, |c| c.imm_data)
            .filter(|_| self.wc_flags().contains(WcFlags::WITH_IMM))
    }

    /// `ibv_wc_read_qp_num`.
    #[inline]
    pub fn qp_num(&self) -> Option<u32> {
        self.field(WcExFlags::QP_NUM, |c| c.qp_num)
    }

    /// `ibv_wc_read_src_qp`.
    #[inline]
    pub fn src_qp(&self) -> Option<u32> {
        self.field(WcExFlags::SRC_QP, |c| c.src_qp)
    }

    /// `ibv_wc_read_slid`.
    #[inline]
    pub fn slid(&self) -> Option<u16> {
        self.field(WcExFlags::SLID, |c| c.slid)
    }

    /// `ibv_wc_read_sl`.
    #[inline]
    pub fn sl(&self) -> Option<u8> {
        self.field(WcExFlags::SL, |c| c.sl)
    }

    /// `ibv_wc_read_dlid_path_bits`.
    #[inline]
    pub fn dlid_path_bits(&self) -> Option<u8> {
        self.field(WcExFlags::DLID_PATH_BITS, |c| c.dlid_path_bits)
    }

    /// `ibv_wc_read_completion_ts`: the raw device-clock value.
    #[inline]
    pub fn completion_ts(&self) -> Option<u64> {
        self.field(WcExFlags::COMPLETION_TIMESTAMP, |c| c.timestamp)
    }

    /// `ibv_wc_read_completion_wallclock_ns`.
    #[inline]
    pub fn completion_wallclock_ns(&self) -> Option<u64> {
        self.field(WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK, |c| {
            self.inner.wall().ns(c.timestamp)
        })
    }

    /// The whole completion, as [`CompletionQueue::poll`] returns it.
    pub fn work_completion(&self) -> WorkCompletion {
        WorkCompletion(*self.cqe())
    }
}

/// Field sets for [`CompletionQueue::typed`]: OR them together.
pub mod fields {
    use crate::WcExFlags;
    /// No optional field.
    pub const NONE: u64 = 0;
    pub const BYTE_LEN: u64 = WcExFlags::BYTE_LEN.bits();
    pub const IMM: u64 = WcExFlags::IMM.bits();
    pub const QP_NUM: u64 = WcExFlags::QP_NUM.bits();
    pub const SRC_QP: u64 = WcExFlags::SRC_QP.bits();
    pub const SLID: u64 = WcExFlags::SLID.bits();
    pub const SL: u64 = WcExFlags::SL.bits();
    pub const DLID_PATH_BITS: u64 = WcExFlags::DLID_PATH_BITS.bits();
    pub const COMPLETION_TIMESTAMP: u64 = WcExFlags::COMPLETION_TIMESTAMP.bits();
    pub const COMPLETION_TIMESTAMP_WALLCLOCK: u64 =
        WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK.bits();
    /// Every field softverbs returns.
    pub const ALL: u64 = WcExFlags::SUPPORTED.bits();
}

/// A CQ whose field set `F` is part of its type (see [`CompletionQueue::typed`]).
#[derive(Clone)]
pub struct TypedCompletionQueue<const F: u64> {
    cq: CompletionQueue,
}

impl<const F: u64> TypedCompletionQueue<F> {
    /// The CQ.
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// `ibv_start_poll` for a typed cursor; `None` when the CQ is empty.
    #[inline(always)]
    pub fn start_poll(&self) -> Option<TypedCursor<'_, F>> {
        // Decided at compile time: a field set without the wall clock pays nothing for it.
        let wall = F & fields::COMPLETION_TIMESTAMP_WALLCLOCK != 0;
        let inner = self.cq.inner.start_poll(wall)?;
        Some(TypedCursor { inner })
    }
}

/// The cursor with its field set in the type: each reader is a plain load from the CQ ring,
/// and reading a field outside `F` does not compile.
///
/// ```
/// use softverbs::*;
/// use softverbs::fields::{BYTE_LEN, COMPLETION_TIMESTAMP};
///
/// let ctx = softverbs::devices()?[0].open()?;
/// let cq = ctx.create_cq_ex(&CqInitAttrEx::new(16)
///     .wc_flags(WcExFlags::BYTE_LEN | WcExFlags::COMPLETION_TIMESTAMP))?;
/// let typed = cq.typed::<{ BYTE_LEN | COMPLETION_TIMESTAMP }>()?;
/// if let Some(mut c) = typed.start_poll() {
///     loop {
///         let (_len, _ts) = (c.byte_len(), c.completion_ts());
///         if !c.next() { break; }
///     }
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Reading a field the type does not have is a compile error:
///
/// ```compile_fail,E0080
/// use softverbs::*;
/// let ctx = softverbs::devices()?[0].open()?;
/// let cq = ctx.create_cq_ex(&CqInitAttrEx::new(16).wc_flags(WcExFlags::BYTE_LEN))?;
/// let typed = cq.typed::<{ fields::BYTE_LEN }>()?;
/// if let Some(c) = typed.start_poll() {
///     let _ = c.completion_ts(); // not in the field set
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TypedCursor<'a, const F: u64> {
    /// Alone, as in [`Cursor`].
    inner: NicCursor<'a>,
}

/// A reader of field `$flag`, refused at compile time when `F` lacks it.
macro_rules! typed_reader {
    ($(#[$doc:meta])* $name:ident, $flag:path, $ty:ty, |$c:ident| $read:expr) => {
        $(#[$doc])*
        #[inline(always)]
        pub fn $name(&self) -> $ty {
            const {
                assert!(
                    F & $flag != 0,
                    concat!("the typed CQ's field set lacks ", stringify!($flag))
                )
            };
            let $c = self.inner.cqe();
            $read
        }
    };
}

impl<const F: u64> TypedCursor<'_, F> {
    /// `ibv_next_poll`: false (`ENOENT`) when the CQ is empty.
    #[inline(always)]
    #[allow(clippy::should_implement_trait)] // the verbs name; a cursor is not an iterator
    pub fn next(&mut self) -> bool {
        self.inner.advance()
    }

    /// `ibv_end_poll` (dropping the cursor does the same).
    #[inline(always)]
    pub fn end(self) {}

    /// `wr_id`.
    #[inline(always)]
    pub fn wr_id(&self) -> u64 {
        self.inner.cqe().wr_id
    }

    /// `status`.
    #[inline(always)]
    pub fn status(&self) -> WcStatus {
        self.inner.cqe().status()
    }

    /// True when the status is `SUCCESS` (one compare, no conversion).
    #[inline(always)]
    pub fn is_ok(&self) -> bool {
        self.inner.cqe().status == WcStatus::Success as u8
    }

    /// `ibv_wc_read_opcode`.
    #[inline(always)]
    pub fn opcode(&self) -> WcOpcode {
        self.inner.cqe().opcode()
    }

    /// `ibv_wc_read_vendor_err`.
    #[inline(always)]
    pub fn vendor_err(&self) -> u32 {
        self.inner.cqe().vendor_err
    }

    /// `ibv_wc_read_wc_flags`.
    #[inline(always)]
    pub fn wc_flags(&self) -> WcFlags {
        self.inner.cqe().flags()
    }

    typed_reader!(
        /// `ibv_wc_read_byte_len`.
        byte_len, fields::BYTE_LEN, u32, |c| c.byte_len
    );
    typed_reader!(
        /// `ibv_wc_read_imm_data`: `Some` when the message carried immediate data.
        imm_data, fields::IMM, Option<u32>,
        |c| (c.wc_flags & WcFlags::WITH_IMM.bits() as u8 != 0).then_some(c.imm_data)
    );
    typed_reader!(
        /// `ibv_wc_read_qp_num`.
        qp_num, fields::QP_NUM, u32, |c| c.qp_num
    );
    typed_reader!(
        /// `ibv_wc_read_src_qp`.
        src_qp, fields::SRC_QP, u32, |c| c.src_qp
    );
    typed_reader!(
        /// `ibv_wc_read_slid`.
        slid, fields::SLID, u16, |c| c.slid
    );
    typed_reader!(
        /// `ibv_wc_read_sl`.
        sl, fields::SL, u8, |c| c.sl
    );
    typed_reader!(
        /// `ibv_wc_read_dlid_path_bits`.
        dlid_path_bits, fields::DLID_PATH_BITS, u8, |c| c.dlid_path_bits
    );
    typed_reader!(
        /// `ibv_wc_read_completion_ts`: the raw device-clock value.
        completion_ts, fields::COMPLETION_TIMESTAMP, u64, |c| c.timestamp
    );

    /// `ibv_wc_read_completion_wallclock_ns`.
    #[inline(always)]
    pub fn completion_wallclock_ns(&self) -> u64 {
        const {
            assert!(
                F & fields::COMPLETION_TIMESTAMP_WALLCLOCK != 0,
                "the typed CQ's field set lacks fields::COMPLETION_TIMESTAMP_WALLCLOCK"
            )
        };
        self.inner.wall().ns(self.inner.cqe().timestamp)
    }
}
