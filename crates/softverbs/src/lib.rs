//! Safe RDMA verbs in Rust, with a software RDMA NIC built in.
//!
//! The default device, `softverbs0`, is a software NIC that needs no hardware, no kernel
//! module and no set-up, so RDMA code runs (and is tested) on any Linux machine. The verbs
//! are the familiar ones: devices, contexts, protection domains, memory regions, completion
//! queues and channels, RC/UC/UD queue pairs, shared receive queues, address handles, and the
//! SEND, RDMA WRITE/READ and atomic operations.
//!
//! ```
//! use softverbs::*;
//!
//! let ctx = softverbs::devices()?[0].open()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(16, None)?;
//! let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
//! let src = pd.alloc_mr(64, access)?;
//! let dst = pd.alloc_mr(64, access)?;
//! let (a, b) = (pd.create_qp(&QpInitAttr::rc(&cq, &cq))?, pd.create_qp(&QpInitAttr::rc(&cq, &cq))?);
//! a.connect(&b.endpoint(0)?, 0, access)?;
//! b.connect(&a.endpoint(0)?, 0, access)?;
//!
//! src.write_at(0, b"hello")?;
//! let sge = [src.sge(0..5)];
//! a.post_send([SendWr::new(1, SendOp::RdmaWrite { remote_addr: dst.iova(), rkey: dst.rkey() }, &sge)
//!     .flags(SendFlags::SIGNALED)])?;
//! let wc = cq.wait_one()?;
//! assert!(wc.is_ok());
//! let mut got = [0u8; 5];
//! dst.read_at(0, &mut got)?;
//! assert_eq!(&got, b"hello");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Errors of a call are [`Error`]s (each with the errno the C ABI reports); failures of a work
//! request at run time are completions with a [`WcStatus`], and move the QP to the error state
//! as the verbs specification says.

mod cq;
mod device;
mod mr;
mod parent_domain;
mod qp;
mod shared;
mod xrc;

pub use cq::{
    CompletionChannel, CompletionQueue, CqInitAttrEx, CreateCqFlags, Cursor, PollCqExAttr,
    TypedCompletionQueue, TypedCursor, WorkCompletion, cq_init_attr_mask, fields,
};
pub use device::{Context, Device, DeviceBuilder, DeviceClock, devices};
pub use mr::{DeviceMemory, MemoryRegion, MemoryWindow, ProtectionDomain};
pub use parent_domain::ThreadDomain;
pub use qp::{
    AddressHandle, Endpoint, QpInitAttr, QueuePair, RecvWr, SendWr, SharedReceiveQueue, SrqAttr,
    UdTarget, WrData, address_vector,
};
pub use shared::ImportedRegion;
pub use softverbs_nic::qp::xrc::XrcdOpen;
pub use xrc::XrcDomain;

pub use softverbs_nic::config::{DeviceConfig, ENV_DEVICES, Limits};
pub use softverbs_nic::device::event::{AsyncEvent, EventElement};
pub use softverbs_nic::device::multicast::MULTICAST_QPN;
pub use softverbs_nic::device::{DeviceAttr, OdpCaps, PortAttr, cap_flags, cap_flags_ex};
pub use softverbs_nic::mr::ordering::{OrderingObserver, ScrambledPiece};
pub use softverbs_nic::pd::{MwType, Prefetch, inc_rkey};
pub use softverbs_nic::qp::wr::SendOp;
pub use softverbs_nic::qp::{PostError, QpAttr, QpCap};
pub use softverbs_nic::types::{
    AccessFlags, AhAttr, AsyncEventType, AtomicCap, Gid, GlobalRoute, LinkLayer, Mtu, PortState,
    QpAttrMask, QpState, QpType, SendFlags, Sge, WcExFlags, WcFlags, WcOpcode, WcStatus, WrOpcode,
};

/// Seed 002's non-contiguous layouts: see [`ProtectionDomain::create_layout_mr`],
/// [`MemoryRegion::set_layout_sg`], [`MemoryRegion::set_layout_interleaved`],
/// [`ProtectionDomain::reg_mr_pages`] and [`SendOp::BindLayout`].
pub use softverbs_nic::mr::layout::{
    Datum, Dim, InterleavedEntry, Layout, LayoutCapFlags, LayoutCaps, LayoutError, PLAIN_KEY,
    SetLayoutFlags,
};
pub use softverbs_nic::mr::store::set_layout_code;
pub use softverbs_nic::{Error, GRH_LEN};

/// Seed 000's compact completion records: the layout of [`CompletionQueue::poll_ex`]'s
/// output and its `get_offsetof*`, `get*` and `get_size` helpers.
pub use softverbs_nic::cq::compact;

/// Another process's completion queues and threads, read through `/proc`: what a hung RDMA
/// program is waiting for (`softverbs inspect PID` prints it).
pub use softverbs_nic::inspect;

/// `Result` with the verbs [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The software NIC underneath, for tools that need its internals (clock, raw attributes).
pub use softverbs_nic as nic;

/// The README's Rust example, compiled and run as a doctest so it cannot rot.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
