//! Out-of-band links: how two ends of a test swap addresses and synchronise before (and
//! after) they talk RDMA, the way `ibv_rc_pingpong` and perftest use a TCP socket.
//!
//! An [`OobLink`] carries whole messages (one JSON document each) in order. [`ChannelLink`]
//! joins two threads of one process; [`TcpLink`] joins two processes (or hosts) with one
//! newline-terminated message per line. Every wait has a time limit, so a peer that hangs or
//! vanishes is an error, never a hang.

use crate::Result;
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longest message accepted from a peer (the messages are a few hundred bytes).
const MAX_MESSAGE: u64 = 1 << 16;
/// How often waits for a peer to connect re-check their time limit and abort conditions.
const POLL_SLICE: Duration = Duration::from_millis(100);

/// Carries whole messages (one JSON document each) between the two ends, in order.
pub trait OobLink {
    fn send(&mut self, msg: String) -> Result<()>;
    fn recv(&mut self) -> Result<String>;
}

/// The error of an end whose peer stopped (closed the link) first: the peer's error, where it
/// can be had, is the one to report.
#[derive(Debug)]
pub struct PeerFailed;

impl std::fmt::Display for PeerFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the other end stopped")
    }
}

impl std::error::Error for PeerFailed {}

/// An error the peer reported over the link before it stopped (its text).
#[derive(Debug)]
pub struct PeerError(pub String);

impl std::fmt::Display for PeerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PeerError {}

/// "N s" for error messages.
fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{s:.1} s")
    }
}

// ---------------------------------------------------------------------------------------------
// In-process.

/// One end of an in-process link.
pub struct ChannelLink {
    tx: mpsc::Sender<String>,
    rx: mpsc::Receiver<String>,
    timeout: Duration,
}

impl ChannelLink {
    /// Two joined ends; `recv` gives up after `timeout`.
    pub fn pair(timeout: Duration) -> (ChannelLink, ChannelLink) {
        let (a_tx, b_rx) = mpsc::channel();
        let (b_tx, a_rx) = mpsc::channel();
        (
            ChannelLink {
                tx: a_tx,
                rx: a_rx,
                timeout,
            },
            ChannelLink {
                tx: b_tx,
                rx: b_rx,
                timeout,
            },
        )
    }
}

impl OobLink for ChannelLink {
    fn send(&mut self, msg: String) -> Result<()> {
        self.tx.send(msg).map_err(|_| PeerFailed.into())
    }

    fn recv(&mut self) -> Result<String> {
        match self.rx.recv_timeout(self.timeout) {
            Ok(m) => Ok(m),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(PeerFailed.into()),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(format!("the peer sent nothing for {}", secs(self.timeout)).into())
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// TCP.

/// One end of a TCP connection carrying one JSON message per line.
pub struct TcpLink {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    peer: SocketAddr,
    timeout: Duration,
}

impl TcpLink {
    /// Wraps a connected stream; each `recv` waits at most `timeout`.
    fn new(stream: TcpStream, timeout: Duration) -> Result<TcpLink> {
        let peer = stream.peer_addr()?;
        // Messages are small and each one is waited for: send them at once.
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let writer = stream.try_clone()?;
        Ok(TcpLink {
            reader: BufReader::new(stream),
            writer,
            peer,
            timeout,
        })
    }

    /// Another handle to the socket (to watch it from another thread).
    pub fn stream_clone(&self) -> Result<TcpStream> {
        Ok(self.writer.try_clone()?)
    }

    /// The address of the other end.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Binds a listening socket on `addr` (port 0: one the kernel picks).
    pub fn listen(addr: SocketAddr) -> Result<TcpListener> {
        TcpListener::bind(addr).map_err(|e| {
            let hint = if e.kind() == ErrorKind::AddrInUse {
                " (another server running? choose another port with -p)"
            } else {
                ""
            };
            format!("cannot listen on {addr}: {e}{hint}").into()
        })
    }

    /// Waits at most `timeout` for one peer to connect to `listener`. `check` runs every
    /// 100 ms or so: an error from it (say, "the child process exited") ends the wait.
    pub fn accept(
        listener: &TcpListener,
        timeout: Duration,
        link_timeout: Duration,
        mut check: impl FnMut() -> Result<()>,
    ) -> Result<TcpLink> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let at = listener
                    .local_addr()
                    .map(|a| format!(" on port {}", a.port()))
                    .unwrap_or_default();
                return Err(format!("no peer connected{at} within {}", secs(timeout)).into());
            }
            let slice = Timespec::try_from(left.min(POLL_SLICE)).map_err(|e| e.to_string())?;
            let mut fds = [PollFd::new(listener, PollFlags::IN)];
            match poll(&mut fds, Some(&slice)) {
                Ok(0) => {}
                Ok(_) => match listener.accept() {
                    Ok((stream, _)) => return TcpLink::new(stream, link_timeout),
                    // The connection went away between poll and accept: keep waiting.
                    Err(e) if e.kind() == ErrorKind::ConnectionAborted => {}
                    Err(e) => return Err(format!("accepting a connection: {e}").into()),
                },
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(format!("waiting for a connection: {e}").into()),
            }
            check()?;
        }
    }

    /// Connects to `host:port`, retrying refused connections (a server that is still
    /// starting) for at most `timeout`.
    pub fn connect(
        host: &str,
        port: u16,
        timeout: Duration,
        link_timeout: Duration,
    ) -> Result<TcpLink> {
        let deadline = Instant::now() + timeout;
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve `{host}`: {e}"))?
            .collect();
        if addrs.is_empty() {
            return Err(format!("`{host}` has no address").into());
        }
        let mut last: Option<std::io::Error> = None;
        loop {
            for addr in &addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match TcpStream::connect_timeout(addr, left) {
                    Ok(stream) => return TcpLink::new(stream, link_timeout),
                    Err(e) => last = Some(e),
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let retry = last
                .as_ref()
                .is_some_and(|e| e.kind() == ErrorKind::ConnectionRefused);
            if left.is_zero() || !retry {
                let why = last.map_or_else(|| "timed out".to_string(), |e| e.to_string());
                let hint = if retry {
                    " (is the server running?)"
                } else {
                    ""
                };
                return Err(format!(
                    "cannot connect to {host} port {port} within {}: {why}{hint}",
                    secs(timeout)
                )
                .into());
            }
            std::thread::sleep(left.min(POLL_SLICE));
        }
    }
}

impl OobLink for TcpLink {
    fn send(&mut self, mut msg: String) -> Result<()> {
        if msg.contains('\n') {
            return Err("internal error: an out-of-band message contains a newline".into());
        }
        msg.push('\n');
        self.writer
            .write_all(msg.as_bytes())
            .and_then(|()| self.writer.flush())
            .map_err(|e| match e.kind() {
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset => PeerFailed.into(),
                ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                    "the peer at {} took nothing for {}",
                    self.peer,
                    secs(self.timeout)
                )
                .into(),
                _ => format!("sending to the peer at {}: {e}", self.peer).into(),
            })
    }

    fn recv(&mut self) -> Result<String> {
        let mut line = String::new();
        let n = self
            .reader
            .by_ref()
            .take(MAX_MESSAGE)
            .read_line(&mut line)
            .map_err(|e| -> crate::Error {
                match e.kind() {
                    ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                        "the peer at {} sent nothing for {}",
                        self.peer,
                        secs(self.timeout)
                    )
                    .into(),
                    ErrorKind::ConnectionReset => PeerFailed.into(),
                    _ => format!("receiving from the peer at {}: {e}", self.peer).into(),
                }
            })?;
        if n == 0 {
            return Err(PeerFailed.into());
        }
        match line.strip_suffix('\n') {
            Some(msg) => Ok(msg.to_string()),
            None if n as u64 == MAX_MESSAGE => Err(format!(
                "the peer at {} sent a message longer than {MAX_MESSAGE} bytes",
                self.peer
            )
            .into()),
            None => Err(PeerFailed.into()),
        }
    }
}

/// Sets `abort` when the peer closes `stream` or sends an error on it (a JSON message that
/// starts `{"msg":"error"`), looking every `every`, until `done`. Other messages are left
/// unread for the link's owner.
///
/// Run on a thread of its own while the main thread is busy with RDMA traffic and does not
/// read the link: a peer that fails is noticed at once rather than after a time-out.
pub fn watch_for_failure(
    stream: &TcpStream,
    abort: &AtomicBool,
    done: &AtomicBool,
    every: Duration,
) {
    let error_prefix = br#"{"msg":"error""#;
    let mut buf = [0u8; 16];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    while !done.load(Ordering::Relaxed) {
        let mut fds = [PollFd::new(stream, PollFlags::IN)];
        if poll(&mut fds, Some(&zero)).unwrap_or(0) > 0 {
            // Readable, so peeking returns at once; 0 bytes: the peer closed the connection.
            let failed = match stream.peek(&mut buf) {
                Ok(0) | Err(_) => true,
                Ok(n) => n >= error_prefix.len() && buf.starts_with(error_prefix),
            };
            if failed {
                abort.store(true, Ordering::Relaxed);
                return;
            }
        }
        std::thread::sleep(every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);
    const LOCAL: SocketAddr =
        SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

    #[test]
    fn tcp_messages_arrive_whole_and_in_order() {
        let listener = TcpLink::listen(LOCAL).unwrap();
        let port = listener.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let mut c = TcpLink::connect("127.0.0.1", port, T, T).unwrap();
            c.send("one".into()).unwrap();
            c.send("{\"two\": 2}".into()).unwrap();
            c.recv().unwrap()
        });
        let mut s = TcpLink::accept(&listener, T, T, || Ok(())).unwrap();
        assert_eq!(s.recv().unwrap(), "one");
        assert_eq!(s.recv().unwrap(), "{\"two\": 2}");
        s.send("three".into()).unwrap();
        assert_eq!(t.join().unwrap(), "three");
        // The client is gone: the server learns it at once.
        assert!(s.recv().unwrap_err().is::<PeerFailed>());
        assert!(s.send("x\ny".into()).is_err());
    }

    #[test]
    fn tcp_waits_are_bounded() {
        let listener = TcpLink::listen(LOCAL).unwrap();
        let port = listener.local_addr().unwrap().port();
        let short = Duration::from_millis(300);
        let err = TcpLink::accept(&listener, short, T, || Ok(()))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no peer connected"), "{err}");
        let err = TcpLink::accept(&listener, T, T, || Err("the child exited".into()))
            .err()
            .unwrap()
            .to_string();
        assert_eq!(err, "the child exited");
        // A silent peer: recv times out.
        let _c = TcpLink::connect("127.0.0.1", port, T, short).unwrap();
        let mut s = TcpLink::accept(&listener, T, short, || Ok(())).unwrap();
        let t0 = Instant::now();
        let err = s.recv().unwrap_err().to_string();
        assert!(err.contains("sent nothing for 0.3 s"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(3));
        // Nobody listening: connect gives up after its time limit.
        drop(listener);
        let err = TcpLink::connect("127.0.0.1", port, short, T)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("is the server running?"), "{err}");
    }
}
