//! Errors returned by NIC calls. Run-time failures of work requests are completions, not these.

use rustix::io::Errno;

/// A verbs call that failed. Each variant names what was wrong and maps to the errno that the
/// C ABI returns for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument is out of range or inconsistent (EINVAL).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The device does not implement this (EOPNOTSUPP).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A device limit or queue capacity is exhausted (ENOMEM).
    #[error("out of resources: {0}")]
    NoResources(String),
    /// Memory the call was given is not mapped with the rights it needs (EFAULT).
    #[error("bad address: {0}")]
    BadAddress(String),
    /// The object is still in use (EBUSY).
    #[error("busy: {0}")]
    Busy(String),
    /// Nothing to return yet (EAGAIN), for non-blocking waits.
    #[error("would block")]
    WouldBlock,
    /// No such device, port or entry (ENODEV / ENOENT as the call says).
    #[error("not found: {0}")]
    NotFound(String),
    /// The device configuration (builder or `SOFTVERBS_DEVICES`) is malformed (EINVAL).
    #[error("bad device configuration: {0}")]
    Config(String),
    /// A system call failed.
    #[error("{what}: {errno}")]
    Os { what: &'static str, errno: Errno },
}

impl Error {
    /// The errno the C ABI reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::InvalidArgument(_) | Error::Config(_) => libc_errno::EINVAL,
            Error::Unsupported(_) => libc_errno::EOPNOTSUPP,
            Error::NoResources(_) => libc_errno::ENOMEM,
            Error::BadAddress(_) => libc_errno::EFAULT,
            Error::Busy(_) => libc_errno::EBUSY,
            Error::WouldBlock => libc_errno::EAGAIN,
            Error::NotFound(_) => libc_errno::ENOENT,
            Error::Os { errno, .. } => errno.raw_os_error(),
        }
    }

    pub(crate) fn os(what: &'static str) -> impl FnOnce(Errno) -> Error {
        move |errno| Error::Os { what, errno }
    }
}

/// Linux errno values, kept here so no caller needs `libc` for them.
pub mod libc_errno {
    pub const ENOENT: i32 = 2;
    pub const EAGAIN: i32 = 11;
    pub const EFAULT: i32 = 14;
    pub const ENOMEM: i32 = 12;
    pub const EBUSY: i32 = 16;
    pub const EINVAL: i32 = 22;
    pub const EOPNOTSUPP: i32 = 95;
}

/// Shorthand for building an [`Error::InvalidArgument`].
pub(crate) fn inval(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
