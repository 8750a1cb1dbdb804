//! The multi-process harness: the test binary runs itself again as the peer process.
//!
//! A parent test starts a peer with [`Peer::spawn`]`("module::peer_fn")`, which runs
//! `current_exe() --exact module::peer_fn --nocapture --test-threads=1` with
//! `SOFTVERBS_TEST_ROLE=module::peer_fn` in its environment. Peer functions are declared with
//! [`peer!`]: a `#[test]` that returns at once unless the role names it, so in a normal run
//! they pass without doing anything.
//!
//! The side channel is text, one message per line: parent → peer on the peer's stdin, peer →
//! parent on its stdout, where each line carries [`PREFIX`] so that libtest's own output is
//! skipped. A message is a tag and fields separated by spaces ([`msg!`], [`Msg`], [`Wire`]).
//! The peer's stderr (its panic message, if any) is collected and shown when it fails.
//!
//! Nothing waits forever: every receive has a deadline ([`WAIT`] unless told), a peer that
//! fails or falls silent is killed and reaped with its stderr in the panic message, dropping
//! a [`Peer`] kills it, and a peer exits by itself when its parent goes away (EOF on stdin) or
//! after [`PEER_LIFETIME`].

use softverbs::{Endpoint, Gid, WcStatus};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

/// The environment variable that makes a `peer!` test act.
pub const ROLE_ENV: &str = "SOFTVERBS_TEST_ROLE";
/// Set by the between-hosts run (`between_hosts`): peers run in this network namespace, as
/// on another host, with [`PEER_DEVICES_ENV`] as their `SOFTVERBS_DEVICES`.
pub const PEER_NETNS_ENV: &str = "SOFTVERBS_TEST_PEER_NETNS";
pub const PEER_DEVICES_ENV: &str = "SOFTVERBS_TEST_PEER_DEVICES";

/// True when this run's peers are on another host (see [`PEER_NETNS_ENV`]); tests of what
/// only the same host has (layout binds in the send queue, cross-memory attach) skip then.
pub fn between_hosts() -> bool {
    std::env::var_os(PEER_NETNS_ENV).is_some()
}
/// Marks side-channel lines on the peer's stdout.
pub const PREFIX: &str = "@@softverbs-test@@ ";
/// Default deadline of one receive, either side.
pub const WAIT: Duration = Duration::from_secs(20);
/// A peer exits by itself after this long, whatever it is doing.
pub const PEER_LIFETIME: Duration = Duration::from_secs(90);
/// How long a peer may take to exit once it is done (or its stdin is closed).
const EXIT_WAIT: Duration = Duration::from_secs(10);
/// Lines of a failed peer's stderr shown in the panic message.
const STDERR_TAIL: usize = 40;

/// Declares a peer function: `peer!(peer_name, |p| { ... });` makes `#[test] fn peer_name()`,
/// which runs the closure with the [`Parent`] link only in a process started by
/// [`Peer::spawn`] for it.
macro_rules! peer {
    ($name:ident, $body:expr $(,)?) => {
        #[test]
        fn $name() {
            $crate::harness::run_as_peer(
                &$crate::harness::test_name(module_path!(), stringify!($name)),
                $body,
            );
        }
    };
}
pub(crate) use peer;

/// Builds a message line: `msg!("tag", a, b)` is `"tag <a> <b>"` with each field in its
/// [`Wire`] form.
macro_rules! msg {
    ($tag:expr $(, $field:expr)* $(,)?) => {{
        #[allow(unused_mut)]
        let mut line = String::from($tag);
        $(
            line.push(' ');
            line.push_str(&$crate::harness::Wire::to_wire(&$field));
        )*
        line
    }};
}
pub(crate) use msg;

/// The libtest name of a function: its module path without the crate name, then its name.
pub fn test_name(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_, rest)) => format!("{rest}::{name}"),
        None => name.to_string(),
    }
}

/// A value that travels as one space-free token.
pub trait Wire: Sized {
    fn to_wire(&self) -> String;
    fn from_wire(s: &str) -> Option<Self>;
}

macro_rules! wire_by_display {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            fn to_wire(&self) -> String {
                self.to_string()
            }
            fn from_wire(s: &str) -> Option<Self> {
                s.parse().ok()
            }
        }
    )*};
}
wire_by_display!(u8, u16, u32, u64, usize, i32, bool);

impl Wire for String {
    fn to_wire(&self) -> String {
        assert!(
            !self.is_empty() && !self.contains(char::is_whitespace),
            "a String field must be one non-empty token: {self:?}"
        );
        self.clone()
    }
    fn from_wire(s: &str) -> Option<Self> {
        Some(s.to_string())
    }
}

impl Wire for &str {
    fn to_wire(&self) -> String {
        self.to_string().to_wire()
    }
    fn from_wire(_: &str) -> Option<Self> {
        None // send-only: receive as String
    }
}

impl Wire for Gid {
    fn to_wire(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
    fn from_wire(s: &str) -> Option<Self> {
        if s.len() != 32 {
            return None;
        }
        let mut g = [0u8; 16];
        for (i, b) in g.iter_mut().enumerate() {
            *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Gid(g))
    }
}

/// `qpn,psn,lid,gid`.
impl Wire for Endpoint {
    fn to_wire(&self) -> String {
        format!(
            "{},{},{},{}",
            self.qpn,
            self.psn,
            self.lid,
            self.gid.to_wire()
        )
    }
    fn from_wire(s: &str) -> Option<Self> {
        let mut it = s.split(',');
        let ep = Endpoint {
            qpn: it.next()?.parse().ok()?,
            psn: it.next()?.parse().ok()?,
            lid: it.next()?.parse().ok()?,
            gid: Gid::from_wire(it.next()?)?,
        };
        it.next().is_none().then_some(ep)
    }
}

/// By its C number.
impl Wire for WcStatus {
    fn to_wire(&self) -> String {
        (*self as u32).to_string()
    }
    fn from_wire(s: &str) -> Option<Self> {
        WcStatus::from_raw(s.parse().ok()?)
    }
}

/// What a peer needs to reach a memory region: `iova,rkey,len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteMr {
    pub iova: u64,
    pub rkey: u32,
    pub len: usize,
}

impl RemoteMr {
    pub fn of(mr: &softverbs::MemoryRegion<'_>) -> Self {
        RemoteMr {
            iova: mr.iova(),
            rkey: mr.rkey(),
            len: mr.len(),
        }
    }
}

impl Wire for RemoteMr {
    fn to_wire(&self) -> String {
        format!("{:#x},{:#x},{}", self.iova, self.rkey, self.len)
    }
    fn from_wire(s: &str) -> Option<Self> {
        let hex = |t: &str| u64::from_str_radix(t.strip_prefix("0x")?, 16).ok();
        let mut it = s.split(',');
        let m = RemoteMr {
            iova: hex(it.next()?)?,
            rkey: u32::try_from(hex(it.next()?)?).ok()?,
            len: it.next()?.parse().ok()?,
        };
        it.next().is_none().then_some(m)
    }
}

/// One received message: a tag and space-separated fields.
#[derive(Debug, Clone)]
pub struct Msg {
    line: String,
    from: String,
}

impl Msg {
    fn new(line: String, from: &str) -> Msg {
        Msg {
            line,
            from: from.to_string(),
        }
    }
    /// The first word.
    pub fn tag(&self) -> &str {
        self.line.split(' ').next().unwrap_or("")
    }
    /// How many fields follow the tag.
    pub fn len(&self) -> usize {
        self.line.split(' ').count().saturating_sub(1)
    }
    /// The whole line, to relay it to another peer.
    pub fn line(&self) -> &str {
        &self.line
    }
    /// Field `i` (0 is the first after the tag), parsed.
    pub fn get<T: Wire>(&self, i: usize) -> T {
        let tok = self.line.split(' ').nth(i + 1).unwrap_or_else(|| {
            panic!(
                "message {:?} from {} has no field {i}",
                self.line, self.from
            )
        });
        T::from_wire(tok).unwrap_or_else(|| {
            panic!(
                "field {i} ({tok:?}) of message {:?} from {} is not a {}",
                self.line,
                self.from,
                std::any::type_name::<T>()
            )
        })
    }
}

/// Reads lines into a channel until EOF; `keep` picks and trims the lines that count.
fn line_pump(
    src: impl Read + Send + 'static,
    keep: impl Fn(String) -> Option<String> + Send + 'static,
) -> Receiver<String> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(src).lines() {
            let Ok(line) = line else { break };
            if let Some(l) = keep(line)
                && tx.send(l).is_err()
            {
                break;
            }
        }
    });
    rx
}

// ---------------------------------------------------------------------------------------------
// Parent side

/// Lets one test run alone among this binary's multi-process tests (the clean-up check looks
/// at host-wide state): every [`Peer`] holds the gate shared, [`exclusive`] holds it alone.
struct Gate {
    state: Mutex<GateState>,
    cv: Condvar,
}

struct GateState {
    shared: usize,
    exclusive: Option<ThreadId>,
}

static GATE: Gate = Gate {
    state: Mutex::new(GateState {
        shared: 0,
        exclusive: None,
    }),
    cv: Condvar::new(),
};

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn wait<'a>(&self, g: MutexGuard<'a, GateState>) -> MutexGuard<'a, GateState> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }
}

/// Held shared by each [`Peer`]; a no-op inside the thread that holds [`exclusive`].
struct SharedPass {
    counted: bool,
}

impl SharedPass {
    fn enter() -> SharedPass {
        let me = std::thread::current().id();
        let mut g = GATE.lock();
        loop {
            match g.exclusive {
                Some(owner) if owner == me => return SharedPass { counted: false },
                Some(_) => g = GATE.wait(g),
                None => break,
            }
        }
        g.shared += 1;
        SharedPass { counted: true }
    }
}

impl Drop for SharedPass {
    fn drop(&mut self) {
        if self.counted {
            GATE.lock().shared -= 1;
            GATE.cv.notify_all();
        }
    }
}

/// While alive, no other test of this binary has a peer running.
pub struct ExclusivePass(());

/// Waits until no other test has a peer, then keeps them from starting any until dropped.
pub fn exclusive() -> ExclusivePass {
    let me = std::thread::current().id();
    let mut g = GATE.lock();
    while g.exclusive.is_some() || g.shared > 0 {
        g = GATE.wait(g);
    }
    g.exclusive = Some(me);
    ExclusivePass(())
}

impl Drop for ExclusivePass {
    fn drop(&mut self) {
        GATE.lock().exclusive = None;
        GATE.cv.notify_all();
    }
}

/// A peer process, seen from the test that started it. Dropping it kills the process.
pub struct Peer {
    role: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<Vec<String>>>,
    stderr_pump: Option<JoinHandle<()>>,
    exited: Option<ExitStatus>,
    _pass: SharedPass,
}

impl Peer {
    /// Starts the test binary again as peer `role` (a `peer!` function's libtest name, e.g.
    /// `"rc::peer_target"`) and waits for its hello.
    pub fn spawn(role: &str) -> Peer {
        let place = std::env::var(PEER_NETNS_ENV)
            .ok()
            .map(|ns| (ns, std::env::var(PEER_DEVICES_ENV).ok()));
        Peer::spawn_at(role, place)
    }

    /// Like [`spawn`](Self::spawn), in network namespace `netns` (another host) with
    /// `devices` as its `SOFTVERBS_DEVICES`.
    pub fn spawn_in(role: &str, netns: &str, devices: &str) -> Peer {
        Peer::spawn_at(role, Some((netns.to_string(), Some(devices.to_string()))))
    }

    fn spawn_at(role: &str, place: Option<(String, Option<String>)>) -> Peer {
        let pass = SharedPass::enter();
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = match place {
            Some((ns, devices)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns]).arg(&exe);
                if let Some(d) = devices {
                    c.env("SOFTVERBS_DEVICES", d);
                }
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .args(["--exact", role, "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start peer `{role}`: {e}"));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        // libtest may print `test name ... ` on the same line before the first message.
        let lines = line_pump(stdout, |l| {
            l.find(PREFIX).map(|i| l[i + PREFIX.len()..].to_string())
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = stderr.clone();
        let err = child.stderr.take().expect("piped stderr");
        let stderr_pump = std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        });
        let mut peer = Peer {
            role: role.to_string(),
            child,
            stdin,
            lines,
            stderr,
            stderr_pump: Some(stderr_pump),
            exited: None,
            _pass: pass,
        };
        let hello = peer.expect("hello");
        assert_eq!(
            hello.get::<u32>(0),
            peer.pid(),
            "hello from the wrong process"
        );
        peer
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one message line.
    pub fn send(&mut self, line: impl AsRef<str>) {
        let line = line.as_ref();
        assert!(!line.contains('\n'), "one line per message: {line:?}");
        let res = match self.stdin.as_mut() {
            Some(w) => writeln!(w, "{line}").and_then(|()| w.flush()),
            None => Err(std::io::Error::other("stdin already closed")),
        };
        if let Err(e) = res {
            let why = self.fail(&format!("cannot send {line:?}: {e}"));
            panic!("{why}");
        }
    }

    /// The next message within `within`; on timeout or if the peer exits, the peer is killed
    /// and reaped and the error describes it, with the tail of its stderr.
    pub fn try_recv(&mut self, within: Duration) -> Result<Msg, String> {
        match self.lines.recv_timeout(within) {
            Ok(line) => Ok(Msg::new(line, &self.role)),
            Err(RecvTimeoutError::Timeout) => {
                Err(self.fail(&format!("no message within {within:?}")))
            }
            Err(RecvTimeoutError::Disconnected) => Err(self.fail("it closed its stdout")),
        }
    }

    /// The next message, within [`WAIT`]; panics with the peer's story otherwise.
    pub fn recv(&mut self) -> Msg {
        self.recv_within(WAIT)
    }

    /// The next message within `within`; panics with the peer's story otherwise.
    pub fn recv_within(&mut self, within: Duration) -> Msg {
        self.try_recv(within).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The next message, which must be tagged `tag`.
    pub fn expect(&mut self, tag: &str) -> Msg {
        self.expect_within(tag, WAIT)
    }

    /// The next message within `within`, which must be tagged `tag`.
    pub fn expect_within(&mut self, tag: &str, within: Duration) -> Msg {
        let m = self
            .try_recv(within)
            .unwrap_or_else(|e| panic!("waiting for `{tag}`: {e}"));
        if m.tag() != tag {
            let why = self.fail(&format!("sent {:?} while `{tag}` was expected", m.line()));
            panic!("{why}");
        }
        m
    }

    /// Reads `check <what> <verdict>` messages up to `checked`, asserting each verdict is
    /// `ok` (see `common::compare`).
    pub fn expect_checks(&mut self, context: &str) {
        loop {
            let m = self.recv();
            match m.tag() {
                "check" => assert_eq!(
                    m.get::<String>(1),
                    "ok",
                    "{context}: check `{}` by peer `{}`",
                    m.get::<String>(0),
                    self.role
                ),
                "checked" => return,
                _ => {
                    let why = self.fail(&format!("sent {:?} among its checks", m.line()));
                    panic!("{why}");
                }
            }
        }
    }

    /// Closes its stdin (the link to it) and waits a bounded time for it to exit.
    pub fn close_and_wait(&mut self) -> Option<ExitStatus> {
        self.stdin = None;
        self.wait_exit(EXIT_WAIT)
    }

    /// Closes its stdin and waits (a bounded time) for it to exit successfully.
    pub fn finish(mut self) {
        match self.close_and_wait() {
            Some(st) if st.success() => {}
            Some(st) => {
                let why = self.fail(&format!("exited with {st}"));
                panic!("{why}");
            }
            None => {
                let why = self.fail(&format!("still running {EXIT_WAIT:?} after it was done"));
                panic!("{why}");
            }
        }
    }

    /// SIGKILLs it and reaps it; returns when it is gone.
    pub fn kill(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            self.exited = self.child.wait().ok();
        }
    }

    /// Sends a signal (e.g. STOP or CONT).
    pub fn signal(&self, sig: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.pid() as i32).expect("pid > 0");
        rustix::process::kill_process(pid, sig)
            .unwrap_or_else(|e| panic!("kill({}, {sig:?}): {e}", self.pid()));
    }

    /// Waits up to `within` for the process to exit.
    fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        while self.exited.is_none() {
            match self.child.try_wait() {
                Ok(Some(st)) => self.exited = Some(st),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => break,
            }
        }
        self.exited
    }

    /// Ends the peer (gently if it is exiting anyway, else SIGKILL) and describes it: `why`,
    /// how it ended, and the tail of its stderr.
    fn fail(&mut self, why: &str) -> String {
        let status = match self.wait_exit(Duration::from_millis(500)) {
            Some(st) => format!("it exited with {st}"),
            None => {
                self.kill();
                "killed by the harness".to_string()
            }
        };
        if let Some(h) = self.stderr_pump.take() {
            // The pipe closes with the process (nothing else holds it).
            let _ = h.join();
        }
        let err = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
        // Without backtrace frames, which would push the panic message out of the tail.
        let is_frame = |l: &str| {
            let t = l.trim_start();
            t.starts_with("at ")
                || t.split_once(": ")
                    .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        };
        let kept: Vec<&str> = err
            .iter()
            .map(String::as_str)
            .filter(|l| !is_frame(l) && !l.starts_with("note: "))
            .collect();
        let tail = &kept[kept.len().saturating_sub(STDERR_TAIL)..];
        format!(
            "peer `{}` (pid {}): {why}; {status}; its stderr{}:\n{}",
            self.role,
            self.pid(),
            if kept.len() > STDERR_TAIL {
                " (tail)"
            } else {
                ""
            },
            if tail.is_empty() {
                "  (empty)".to_string()
            } else {
                tail.iter()
                    .map(|l| format!("  | {l}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        )
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------------------------
// Peer side

/// The link to the parent, seen from a peer process.
pub struct Parent {
    role: String,
    lines: Receiver<String>,
}

impl Parent {
    /// Sends one message line to the parent.
    pub fn send(&self, line: impl AsRef<str>) {
        let line = line.as_ref();
        assert!(!line.contains('\n'), "one line per message: {line:?}");
        let mut out = std::io::stdout().lock();
        if writeln!(out, "{PREFIX}{line}")
            .and_then(|()| out.flush())
            .is_err()
        {
            // The parent is gone: nobody is left to report to.
            std::process::exit(3);
        }
    }

    /// The next message from the parent within `within`. If the parent goes away, exits.
    pub fn recv_within(&self, within: Duration) -> Msg {
        match self.lines.recv_timeout(within) {
            Ok(line) => Msg::new(line, "the parent"),
            Err(RecvTimeoutError::Timeout) => {
                panic!(
                    "peer `{}`: no message from the parent within {within:?}",
                    self.role
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                eprintln!("peer `{}`: the parent closed the link; exiting", self.role);
                std::process::exit(3);
            }
        }
    }

    /// The next message from the parent, within [`WAIT`].
    pub fn recv(&self) -> Msg {
        self.recv_within(WAIT)
    }

    /// The next message, which must be tagged `tag`.
    pub fn expect(&self, tag: &str) -> Msg {
        let m = self.recv();
        assert_eq!(
            m.tag(),
            tag,
            "peer `{}`: the parent sent {:?} while `{tag}` was expected",
            self.role,
            m.line()
        );
        m
    }
}

/// The body of a `peer!` test: runs `body` if this process was started as `role`.
pub fn run_as_peer(role: &str, body: impl FnOnce(&mut Parent)) {
    if std::env::var(ROLE_ENV).as_deref() != Ok(role) {
        return;
    }
    let me = role.to_string();
    std::thread::spawn(move || {
        std::thread::sleep(PEER_LIFETIME);
        eprintln!("peer `{me}`: still running after {PEER_LIFETIME:?}; exiting");
        std::process::exit(124);
    });
    let lines = line_pump(std::io::stdin(), Some);
    let mut parent = Parent {
        role: role.to_string(),
        lines,
    };
    parent.send(msg!("hello", std::process::id()));
    body(&mut parent);
}
