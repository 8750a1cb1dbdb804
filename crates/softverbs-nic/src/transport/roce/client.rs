//! A process's connection to the host engine of a networked device: found by its abstract
//! socket name, started when nobody answers, watched for as long as the process uses it.

use super::engine;
use super::protocol::{Ctl, EngineState, Reply, engine_name};
use crate::config::DeviceConfig;
use crate::config::net::ip_of;
use crate::device_memory::doorbell::ring_fd;
use crate::device_memory::export::open_peer_fd;
use crate::device_memory::segment::Segment;
use crate::error::{Error, Result};
use crate::qp::Qp;
use rustix::event::{PollFd, PollFlags, poll};
use rustix::fd::{AsFd, OwnedFd};
use rustix::net::{
    AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType, connect, recv,
    send, socket_with,
};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

/// The environment variable naming a capture file for every packet the engine of this
/// process's networked devices sends and receives.
pub const ENV_PCAP: &str = "SOFTVERBS_PCAP";

/// How long a process waits for an engine it started to answer.
const START_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a control request waits for its answer.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to an engine.
pub(crate) struct Link {
    /// The engine's process id, as it said in its welcome.
    pub(crate) engine_pid: u32,
    sock: OwnedFd,
    bell: OwnedFd,
    state: Segment,
    dead: AtomicBool,
    qps: Mutex<Vec<Weak<Qp>>>,
}

static LINKS: LazyLock<Mutex<HashMap<IpAddr, Arc<Link>>>> = LazyLock::new(Default::default);

fn connect_to(ip: IpAddr) -> Result<OwnedFd> {
    let sock = socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(Error::os("socket"))?;
    let addr = SocketAddrUnix::new_abstract_name(engine_name(ip).as_bytes())
        .map_err(Error::os("socket name"))?;
    connect(&sock, &addr).map_err(Error::os("connect to the RoCE engine"))?;
    Ok(sock)
}

/// Waits up to `timeout` for a message on `sock`.
fn recv_reply(sock: &OwnedFd, timeout: Duration) -> Result<Reply> {
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::NotFound("the RoCE engine did not answer".into()));
        }
        let ts = rustix::time::Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let mut fds = [PollFd::new(sock, PollFlags::IN)];
        match poll(&mut fds, Some(&ts)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(Error::os("poll")(e)),
        }
        match recv(sock, &mut buf[..], RecvFlags::DONTWAIT) {
            Ok((0, _)) => return Err(Error::NotFound("the RoCE engine closed".into())),
            Ok((n, _)) => {
                return Reply::decode(&buf[..n.min(buf.len())])
                    .ok_or_else(|| Error::InvalidArgument("malformed engine reply".into()));
            }
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(Error::os("recv")(e)),
        }
    }
}

fn send_msg(sock: &OwnedFd, m: &Ctl) -> Result<()> {
    send(sock, &m.encode(), SendFlags::NOSIGNAL)
        .map(|_| ())
        .map_err(Error::os("send to the RoCE engine"))
}

/// One request to the engine serving `ip` on a connection of its own (for `softverbs nic` and
/// `devinfo -v`); it does not start an engine.
pub(crate) fn request(ip: IpAddr, m: &Ctl) -> Result<String> {
    let sock = connect_to(ip)?;
    send_msg(
        &sock,
        &Ctl::Hello {
            pid: std::process::id(),
        },
    )?;
    let _ = recv_reply(&sock, REPLY_TIMEOUT)?;
    send_msg(&sock, m)?;
    match recv_reply(&sock, REPLY_TIMEOUT)? {
        Reply::Text(t) => Ok(t),
        Reply::Welcome(_) => Err(Error::InvalidArgument("unexpected engine reply".into())),
    }
}

impl Link {
    /// The live connection to the engine of device `cfg`, made (and the engine started) if
    /// there is none.
    pub(crate) fn get(cfg: &DeviceConfig) -> Result<Arc<Link>> {
        let ip = ip_of(cfg.gid);
        let mut links = LINKS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = links.get(&ip)
            && !l.dead.load(Ordering::Acquire)
        {
            return Ok(l.clone());
        }
        let capture = std::env::var(ENV_PCAP).ok().filter(|p| !p.is_empty());
        let sock = match connect_to(ip) {
            Ok(s) => s,
            Err(_) => {
                engine::start(cfg)?;
                let deadline = Instant::now() + START_TIMEOUT;
                loop {
                    match connect_to(ip) {
                        Ok(s) => break s,
                        Err(e) if Instant::now() >= deadline => {
                            return Err(Error::NotFound(format!(
                                "the RoCE engine for {ip} did not start ({e}); is UDP port \
                                 4791 of {ip} taken by another program?"
                            )));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            }
        };
        send_msg(
            &sock,
            &Ctl::Hello {
                pid: std::process::id(),
            },
        )?;
        let Reply::Welcome(w) = recv_reply(&sock, REPLY_TIMEOUT)? else {
            return Err(Error::InvalidArgument("unexpected engine reply".into()));
        };
        let bell = open_peer_fd(w.pid, w.bell_fd, w.bell_ino, true)?;
        let state = Segment::open(open_peer_fd(w.pid, w.state_fd, w.state_ino, false)?)?;
        if state.len() < std::mem::size_of::<EngineState>() {
            return Err(Error::InvalidArgument(
                "engine state segment too small".into(),
            ));
        }
        if let Some(path) = capture {
            send_msg(&sock, &Ctl::Capture { path })?;
        }
        let link = Arc::new(Link {
            engine_pid: w.pid,
            sock,
            bell,
            state,
            dead: AtomicBool::new(false),
            qps: Mutex::new(Vec::new()),
        });
        let watched = Arc::downgrade(&link);
        let fd = link.sock.try_clone().map_err(|e| {
            Error::os("dup")(
                rustix::io::Errno::from_io_error(&e).unwrap_or(rustix::io::Errno::BADF),
            )
        })?;
        std::thread::Builder::new()
            .name("softverbs-engine-watch".into())
            .spawn(move || watch(fd, watched))
            .map_err(|_| Error::NoResources("cannot start a thread".into()))?;
        links.insert(ip, link.clone());
        Ok(link)
    }

    pub(crate) fn send(&self, m: &Ctl) -> Result<()> {
        if self.dead.load(Ordering::Acquire) {
            return Err(Error::NotFound("the RoCE engine is gone".into()));
        }
        send_msg(&self.sock, m)
    }

    /// Wakes the engine if it sleeps; called after a WQE was pushed into a send ring.
    pub(crate) fn ring(&self) {
        // The engine's side: set `sleeping`, fence, look at the rings (see `Engine::sleep`).
        fence(Ordering::SeqCst);
        let st: &EngineState = self.state.at(0);
        if st.sleeping.load(Ordering::Relaxed) != 0 {
            ring_fd(self.bell.as_fd());
        }
    }

    pub(crate) fn add(&self, qp: Weak<Qp>) {
        let mut qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
        qps.retain(|q| q.strong_count() > 0);
        qps.push(qp);
    }

    /// Whether the engine is gone (its connection closed).
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }
}

/// Waits for the engine's connection to close; then every QP on it fails.
fn watch(fd: OwnedFd, link: Weak<Link>) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match recv(&fd, &mut buf[..], RecvFlags::empty()) {
            // Replies to capture requests; nothing else arrives unasked.
            Ok((n, _)) if n > 0 => continue,
            Err(rustix::io::Errno::INTR) => continue,
            _ => break,
        }
    }
    let Some(link) = link.upgrade() else { return };
    link.dead.store(true, Ordering::Release);
    let qps = std::mem::take(&mut *link.qps.lock().unwrap_or_else(|e| e.into_inner()));
    for q in qps.iter().filter_map(Weak::upgrade) {
        q.offload_lost();
    }
}
