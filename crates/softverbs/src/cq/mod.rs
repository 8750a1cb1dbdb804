//! Completion queues, completions and completion channels.
//!
//! One CQ ring, four ways to read it: [`CompletionQueue::poll`] copies whole completions out
//! (`ibv_poll_cq`); [`CompletionQueue::poll_ex`] writes the seed's compact records holding only
//! the fields the CQ was created with; [`CompletionQueue::start_poll`] is a cursor reading the
//! ring in place field by field (`ibv_start_poll`); and [`TypedCompletionQueue`] is that cursor
//! with the field set in the type, so reading a field the CQ does not return fails to compile.

mod cursor;
mod ex;

pub use cursor::{Cursor, TypedCompletionQueue, TypedCursor, fields};
pub use ex::{CqInitAttrEx, CreateCqFlags, PollCqExAttr, cq_init_attr_mask};

use crate::{Error, Result, WcFlags, WcOpcode, WcStatus};
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use softverbs_nic::cq::{Channel, Cq, Cqe};
use std::sync::Arc;

/// One completion (`struct ibv_wc`).
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkCompletion(Cqe);

impl WorkCompletion {
    /// The `wr_id` of the work request this completes.
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }
    /// The outcome.
    #[inline]
    pub fn status(&self) -> WcStatus {
        self.0.status()
    }
    /// True when the status is `SUCCESS`.
    #[inline]
    pub fn is_ok(&self) -> bool {
        self.0.status == WcStatus::Success as u8
    }
    /// What completed. Not meaningful for flushed receives (`WR_FLUSH_ERR`), as in verbs.
    #[inline]
    pub fn opcode(&self) -> WcOpcode {
        self.0.opcode()
    }
    /// Bytes transferred (receives: including the 40-byte GRH area on UD).
    #[inline]
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }
    /// Immediate data, if the message carried some.
    #[inline]
    pub fn imm_data(&self) -> Option<u32> {
        self.wc_flags()
            .contains(WcFlags::WITH_IMM)
            .then_some(self.0.imm_data)
    }
    /// The rkey a SEND with Invalidate invalidated here, if the message was one
    /// (`IBV_WC_WITH_INV`; `wc.invalidated_rkey` in C).
    #[inline]
    pub fn invalidated_rkey(&self) -> Option<u32> {
        self.wc_flags()
            .contains(WcFlags::WITH_INV)
            .then_some(self.0.imm_data)
    }
    /// The local QP number.
    #[inline]
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }
    /// The sending QP (receives).
    #[inline]
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }
    /// Completion flags (GRH present, immediate present).
    #[inline]
    pub fn wc_flags(&self) -> WcFlags {
        self.0.flags()
    }
    /// Source LID (receives, InfiniBand link layer).
    #[inline]
    pub fn slid(&self) -> u16 {
        self.0.slid
    }
    /// Service level (receives).
    #[inline]
    pub fn sl(&self) -> u8 {
        self.0.sl
    }
    /// P_Key index (receives, UD).
    #[inline]
    pub fn pkey_index(&self) -> u16 {
        self.0.pkey_index
    }
    /// Destination LID path bits (receives).
    #[inline]
    pub fn dlid_path_bits(&self) -> u8 {
        self.0.dlid_path_bits
    }
    /// Raw device-clock value when the completion happened, in a CQ created with
    /// [`COMPLETION_TIMESTAMP`](crate::WcExFlags::COMPLETION_TIMESTAMP) or
    /// [`COMPLETION_TIMESTAMP_WALLCLOCK`](crate::WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK)
    /// ([`Context::create_cq_ex`](crate::Context::create_cq_ex)); 0 in any other CQ, as in
    /// verbs, where only such a CQ has the field. Reading the clock is the costliest step of
    /// a completion, so CQs that do not ask for the time do not pay for it.
    #[inline]
    pub fn timestamp(&self) -> u64 {
        self.0.timestamp
    }
    /// Vendor error syndrome (always 0 on the software NIC).
    #[inline]
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
}

impl std::fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("qp_num", &self.qp_num())
            .field("src_qp", &self.src_qp())
            .field("wc_flags", &self.wc_flags())
            .field("imm_data", &self.imm_data())
            .finish()
    }
}

/// A completion queue. Clones are handles to the same CQ.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<Cq>,
}

impl CompletionQueue {
    /// `ibv_poll_cq`: moves up to `out.len()` completions into `out`, oldest first, and
    /// returns how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let mut n = 0;
        self.inner.poll_with(out.len(), |c| {
            out[n] = WorkCompletion(*c);
            n += 1;
        });
        n
    }

    /// Busy-polls until one completion arrives, for at most ten seconds (then
    /// `Error::WouldBlock`): a convenience for examples and tests.
    pub fn wait_one(&self) -> Result<WorkCompletion> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut wc = [WorkCompletion::default()];
        loop {
            if self.poll(&mut wc) == 1 {
                return Ok(wc[0]);
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::WouldBlock);
            }
            std::thread::yield_now();
        }
    }

    /// `ibv_req_notify_cq`: the next completion (or, with `solicited_only`, the next
    /// solicited or failed one) raises an event on the CQ's channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.inner.req_notify(solicited_only)
    }

    /// `ibv_ack_cq_events`.
    pub fn ack_events(&self, n: u32) {
        self.inner.ack_events(n);
    }

    /// `ibv_resize_cq`: returns the new capacity.
    pub fn resize(&self, cqe: u32) -> Result<u32> {
        self.inner.resize(cqe)
    }

    /// Completions the CQ holds (`cq->cqe`).
    pub fn capacity(&self) -> u32 {
        self.inner.capacity()
    }

    /// True if `other` is a handle to the same CQ.
    pub fn same_as(&self, other: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// A completion channel (`struct ibv_comp_channel`). Its file descriptor is readable while
/// an event waits, so it can be registered with epoll, mio or tokio.
#[derive(Clone)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<Channel>,
}

impl CompletionChannel {
    pub(crate) fn new() -> Result<Self> {
        Ok(CompletionChannel {
            inner: Channel::new()?,
        })
    }

    /// `ibv_get_cq_event`: waits for a CQ on this channel to report, and returns it.
    pub fn get_cq_event(&self) -> Result<CompletionQueue> {
        Ok(CompletionQueue {
            inner: self.inner.get_event(true)?,
        })
    }

    /// Like [`get_cq_event`](Self::get_cq_event) but returns `Error::WouldBlock` at once when
    /// nothing is pending.
    pub fn try_get_cq_event(&self) -> Result<CompletionQueue> {
        Ok(CompletionQueue {
            inner: self.inner.get_event(false)?,
        })
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.fd()
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd().as_raw_fd()
    }
}
