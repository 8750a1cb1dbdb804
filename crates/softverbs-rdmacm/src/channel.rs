//! Event channels: `rdma_create_event_channel`, `rdma_get_cm_event`, `rdma_ack_cm_event`.
//!
//! A channel's `fd` is an eventfd in semaphore mode that counts the queued events, so it
//! polls readable exactly while an event waits, blocks `rdma_get_cm_event` when the program
//! left it blocking, and answers EAGAIN when the program set `O_NONBLOCK`, as the kernel's
//! `rdma_cm` file does; and a thread still waiting in `rdma_get_cm_event` when the channel is
//! destroyed goes on waiting (as on the kernel's file) rather than waking to an error.

use crate::abi::*;
use crate::set_errno;
use core::ffi::c_int;
use std::collections::VecDeque;
use std::sync::Mutex;

/// A channel; the C struct first, so the program's pointer converts back.
#[repr(C)]
pub struct Channel {
    pub c: rdma_event_channel,
    queue: Mutex<VecDeque<Box<Event>>>,
}

/// An event as handed out; the C struct first. Private data lives in the event, valid until
/// it is acknowledged, as the man page promises.
#[repr(C)]
pub struct Event {
    pub ev: rdma_cm_event,
    private: [u8; 256],
}

// SAFETY: the raw pointers in an event are only handed to the program.
unsafe impl Send for Event {}

impl Event {
    /// An event of type `kind` for `id`.
    pub fn new(id: *mut rdma_cm_id, kind: c_int, status: c_int) -> Box<Event> {
        Box::new(Event {
            ev: rdma_cm_event {
                id,
                listen_id: std::ptr::null_mut(),
                event: kind,
                status,
                // SAFETY: both union members are plain data; all-zero is valid.
                param: unsafe { std::mem::zeroed() },
            },
            private: [0; 256],
        })
    }

    /// Connection parameters, with `data` as the private data.
    pub fn with_conn(mut self: Box<Event>, mut conn: rdma_conn_param, data: &[u8]) -> Box<Event> {
        let n = data.len().min(255);
        self.private[..n].copy_from_slice(&data[..n]);
        conn.private_data = if n > 0 {
            self.private.as_ptr().cast()
        } else {
            std::ptr::null()
        };
        conn.private_data_len = n as u8;
        self.ev.param.conn = conn;
        self
    }

    /// A multicast event's UD parameters: `private_data` is the context the program gave
    /// `rdma_join_multicast` (librdmacm's convention), not bytes of ours.
    pub fn with_group(
        mut self: Box<Event>,
        mut ud: rdma_ud_param,
        context: *mut core::ffi::c_void,
    ) -> Box<Event> {
        ud.private_data = context.cast_const();
        ud.private_data_len = 0;
        self.ev.param.ud = ud;
        self
    }

    /// UD parameters, with `data` as the private data.
    pub fn with_ud(mut self: Box<Event>, mut ud: rdma_ud_param, data: &[u8]) -> Box<Event> {
        let n = data.len().min(255);
        self.private[..n].copy_from_slice(&data[..n]);
        ud.private_data = if n > 0 {
            self.private.as_ptr().cast()
        } else {
            std::ptr::null()
        };
        ud.private_data_len = n as u8;
        self.ev.param.ud = ud;
        self
    }
}

impl Channel {
    pub fn new() -> Option<Box<Channel>> {
        // SAFETY: eventfd has no memory arguments.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return None;
        }
        Some(Box::new(Channel {
            c: rdma_event_channel { fd },
            queue: Mutex::new(VecDeque::new()),
        }))
    }

    /// Queues `e` and makes the fd readable.
    pub fn push(&self, e: Box<Event>) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(e);
        let one = 1u64;
        // SAFETY: an 8-byte write from a live buffer to our eventfd.
        let _ = unsafe { libc::write(self.c.fd, (&one as *const u64).cast(), 8) };
    }

    /// Waits (if the fd is blocking) for the next event and takes it; errno on failure.
    pub fn pop(&self) -> Option<Box<Event>> {
        let mut count = 0u64;
        loop {
            // SAFETY: an 8-byte read into a live buffer from our eventfd (semaphore mode:
            // it takes one).
            let n = unsafe { libc::read(self.c.fd, (&mut count as *mut u64).cast(), 8) };
            if n == 8 {
                // The count of an event that `forget` dropped finds no event: wait for the
                // next one.
                if let Some(e) = self
                    .queue
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .pop_front()
                {
                    return Some(e);
                }
                continue;
            }
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if n < 0 && e == libc::EINTR {
                continue;
            }
            set_errno(if n == 0 { libc::EIO } else { e });
            return None;
        }
    }

    /// Drops the queued events of `id` (it is being destroyed; the kernel's CM discards
    /// what the program has not read). Their counts stay in the eventfd and `pop` skips them.
    pub fn forget(&self, id: *mut rdma_cm_id) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.retain(|e| e.ev.id != id && e.ev.listen_id != id);
    }

    /// Number of events waiting.
    pub fn pending(&self) -> usize {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: our eventfd, closed once. A thread of the program still reading it (rping's
        // CM thread is while `main` tears down) keeps waiting on the file, as on the kernel's.
        unsafe { libc::close(self.c.fd) };
    }
}

/// `rdma_create_event_channel`.
#[unsafe(no_mangle)]
pub extern "C" fn sv_rdma_create_event_channel() -> *mut rdma_event_channel {
    match Channel::new() {
        Some(c) => Box::into_raw(c).cast(),
        None => std::ptr::null_mut(),
    }
}

/// `rdma_destroy_event_channel`: the program has destroyed its ids and acked its events.
///
/// # Safety
/// `channel` came from `rdma_create_event_channel` and is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    if !channel.is_null() {
        // SAFETY: the caller's contract; a Channel starts with its C struct.
        drop(unsafe { Box::from_raw(channel as *mut Channel) });
    }
}

/// `rdma_get_cm_event`.
///
/// # Safety
/// `channel` is a live channel of ours and `event` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    if channel.is_null() || event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's contract.
    let ch = unsafe { &*(channel as *const Channel) };
    match ch.pop() {
        Some(e) => {
            let e = Box::into_raw(e);
            // SAFETY: `e` is live until acked; `event` is writable.
            unsafe { *event = &mut (*e).ev };
            0
        }
        None => -1,
    }
}

/// `rdma_ack_cm_event`: frees the event.
///
/// # Safety
/// `event` came from `rdma_get_cm_event` and is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    if event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's contract; an Event starts with its C struct.
    drop(unsafe { Box::from_raw(event as *mut Event) });
    0
}

/// `rdma_event_str`.
#[unsafe(no_mangle)]
pub extern "C" fn sv_rdma_event_str(event: c_int) -> *const core::ffi::c_char {
    let s: &'static core::ffi::CStr = match event {
        RDMA_CM_EVENT_ADDR_RESOLVED => c"RDMA_CM_EVENT_ADDR_RESOLVED",
        RDMA_CM_EVENT_ADDR_ERROR => c"RDMA_CM_EVENT_ADDR_ERROR",
        RDMA_CM_EVENT_ROUTE_RESOLVED => c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        RDMA_CM_EVENT_ROUTE_ERROR => c"RDMA_CM_EVENT_ROUTE_ERROR",
        RDMA_CM_EVENT_CONNECT_REQUEST => c"RDMA_CM_EVENT_CONNECT_REQUEST",
        RDMA_CM_EVENT_CONNECT_RESPONSE => c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        RDMA_CM_EVENT_CONNECT_ERROR => c"RDMA_CM_EVENT_CONNECT_ERROR",
        RDMA_CM_EVENT_UNREACHABLE => c"RDMA_CM_EVENT_UNREACHABLE",
        RDMA_CM_EVENT_REJECTED => c"RDMA_CM_EVENT_REJECTED",
        RDMA_CM_EVENT_ESTABLISHED => c"RDMA_CM_EVENT_ESTABLISHED",
        RDMA_CM_EVENT_DISCONNECTED => c"RDMA_CM_EVENT_DISCONNECTED",
        RDMA_CM_EVENT_DEVICE_REMOVAL => c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        RDMA_CM_EVENT_MULTICAST_JOIN => c"RDMA_CM_EVENT_MULTICAST_JOIN",
        RDMA_CM_EVENT_MULTICAST_ERROR => c"RDMA_CM_EVENT_MULTICAST_ERROR",
        RDMA_CM_EVENT_ADDR_CHANGE => c"RDMA_CM_EVENT_ADDR_CHANGE",
        RDMA_CM_EVENT_TIMEWAIT_EXIT => c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => c"UNKNOWN EVENT",
    };
    s.as_ptr()
}
