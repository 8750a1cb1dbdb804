//! The same-host transport: the initiator executes a request itself against the responder's
//! device memory, in this process or mapped from another process on this host.

pub(crate) mod peers;
pub(crate) mod remote;

pub(crate) use peers::peers;
pub(crate) use remote::RemoteQp;
