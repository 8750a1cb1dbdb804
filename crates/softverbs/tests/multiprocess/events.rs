//! Event-driven ping-pong between two processes, many round trips, in every way a program
//! waits: a plain CQ polled with `poll`, an extended CQ read with the cursor, with and without
//! completion timestamps, armed for every completion or for solicited ones only.
//!
//! Each side waits as `ibv_rc_pingpong -e` does (arm before the traffic; per event: ack,
//! re-arm, drain the CQ), and every event must find a completion to poll. A wait that takes
//! longer than a second is a lost event: the side that waits prints its own state and the
//! other process's (threads and CQ rings, read through `/proc`) and fails.

use crate::common::*;
use crate::harness::{Peer, exclusive, msg, peer};
use rustix::event::{PollFd, PollFlags, poll};
use rustix::time::Timespec;
use softverbs::*;
use std::time::{Duration, Instant};

/// Round trips per variant (four variants).
const ROUND_TRIPS: u64 = 100_000;
/// Receives kept posted on each side.
const RECV_DEPTH: u64 = 64;
/// Longer than this without the completion a side waits for is a lost event.
const STUCK: Duration = Duration::from_secs(1);
const MSG: usize = 64;

/// How a side creates, arms and reads its CQ.
#[derive(Clone, Copy, Debug)]
enum Variant {
    /// `create_cq` and `poll`, armed for every completion.
    Plain,
    /// `create_cq_ex` (standard fields) and the cursor, armed for every completion.
    Extended,
    /// `create_cq_ex` with completion timestamps and the cursor, armed for every completion.
    Timestamps,
    /// `create_cq_ex` with timestamps and the cursor, armed for solicited completions only:
    /// the SENDs are solicited, so each side wakes for the receive and finds its own send's
    /// completion (unsolicited) beside it.
    Solicited,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::Extended => "extended",
            Variant::Timestamps => "timestamps",
            Variant::Solicited => "solicited",
        }
    }
    fn from_name(s: &str) -> Variant {
        [
            Variant::Plain,
            Variant::Extended,
            Variant::Timestamps,
            Variant::Solicited,
        ]
        .into_iter()
        .find(|v| v.name() == s)
        .unwrap_or_else(|| panic!("unknown variant {s}"))
    }
    fn solicited(self) -> bool {
        matches!(self, Variant::Solicited)
    }
}

/// Completions a side has polled, and events it has taken.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    sends: u64,
    recvs: u64,
    events: u64,
    /// Timestamps read (the variants with timestamps read one from every completion).
    stamps: u64,
}

/// One process's end: an RC QP whose send and receive completions go to one CQ with a
/// channel.
struct Side {
    who: &'static str,
    variant: Variant,
    ch: CompletionChannel,
    cq: CompletionQueue,
    qp: QueuePair,
    buf: MemoryRegion<'static>,
    counts: Counts,
    recvs_posted: u64,
    other: u32,
}

impl Side {
    fn new(who: &'static str, variant: Variant, n: &Node) -> Side {
        let ch = n.ctx.create_comp_channel().expect("create_comp_channel");
        let depth = 2 * RECV_DEPTH as u32 + 16;
        let cq = match variant {
            Variant::Plain => n.ctx.create_cq(depth, Some(&ch)),
            Variant::Extended => n.ctx.create_cq_ex(&CqInitAttrEx::new(depth).channel(&ch)),
            Variant::Timestamps | Variant::Solicited => n.ctx.create_cq_ex(
                &CqInitAttrEx::new(depth)
                    .channel(&ch)
                    .wc_flags(WcExFlags::STANDARD | WcExFlags::COMPLETION_TIMESTAMP),
            ),
        }
        .expect("create the CQ");
        let qp =
            n.pd.create_qp(&QpInitAttr::rc(&cq, &cq))
                .expect("create_qp");
        Side {
            who,
            variant,
            ch,
            cq,
            qp,
            buf: n.mr(MSG * (RECV_DEPTH as usize + 1)),
            counts: Counts::default(),
            recvs_posted: 0,
            other: 0,
        }
    }

    /// Connects to the other side, posts the receives and arms the CQ, before any traffic.
    fn start(&mut self, them: &Endpoint, other: u32) {
        self.other = other;
        self.qp
            .connect(them, 0, AccessFlags::empty())
            .expect("connect");
        while self.recvs_posted < RECV_DEPTH {
            self.post_recv();
        }
        self.cq.req_notify(self.variant.solicited()).expect("arm");
    }

    fn post_recv(&mut self) {
        let slot = (self.recvs_posted % RECV_DEPTH) as usize;
        let at = MSG * (slot + 1);
        self.qp
            .post_recv([RecvWr::new(
                self.recvs_posted,
                &[self.buf.sge(at..at + MSG)],
            )])
            .expect("post_recv");
        self.recvs_posted += 1;
    }

    fn send(&mut self, i: u64) {
        let mut flags = SendFlags::SIGNALED;
        if self.variant.solicited() {
            flags |= SendFlags::SOLICITED;
        }
        self.buf.write_at(0, &i.to_le_bytes()).expect("write_at");
        self.qp
            .post_send([SendWr::new(i, SendOp::Send, &[self.buf.sge(0..MSG)]).flags(flags)])
            .expect("post_send");
    }

    /// Counts one polled completion; reposts a receive for each one received.
    fn take(&mut self, opcode: WcOpcode, status: WcStatus, stamp: Option<u64>) {
        assert_eq!(
            status,
            WcStatus::Success,
            "{}: a completion failed",
            self.who
        );
        match opcode {
            WcOpcode::Send => self.counts.sends += 1,
            WcOpcode::Recv => {
                self.counts.recvs += 1;
                self.post_recv();
            }
            other => panic!("{}: unexpected completion {other:?}", self.who),
        }
        if let Some(ts) = stamp {
            assert_ne!(ts, 0, "{}: a completion without its timestamp", self.who);
            self.counts.stamps += 1;
        }
    }

    /// Polls the CQ empty, the way the variant reads it; returns how many it took.
    fn drain(&mut self) -> u64 {
        let mut n = 0;
        match self.variant {
            Variant::Plain => {
                let mut wc = [WorkCompletion::default(); 16];
                loop {
                    let k = self.cq.poll(&mut wc);
                    for w in &wc[..k] {
                        self.take(w.opcode(), w.status(), None);
                    }
                    n += k as u64;
                    if k == 0 {
                        break;
                    }
                }
            }
            _ => {
                let cq = self.cq.clone();
                let stamps = !matches!(self.variant, Variant::Extended);
                if let Some(mut c) = cq.start_poll() {
                    loop {
                        let stamp = if stamps {
                            Some(c.completion_ts().expect("the CQ has timestamps"))
                        } else {
                            assert!(c.completion_ts().is_none());
                            None
                        };
                        self.take(c.opcode(), c.status(), stamp);
                        n += 1;
                        if !c.next() {
                            break;
                        }
                    }
                    c.end();
                }
            }
        }
        n
    }

    /// Waits by events until `done` holds of the counts: sleeps on the channel's descriptor,
    /// takes the event, acknowledges it, re-arms and drains the CQ. Fails (with both
    /// processes' state) when a second goes by without the event.
    fn wait_until(&mut self, what: &str, done: impl Fn(&Counts) -> bool) {
        while !done(&self.counts) {
            let since = Instant::now();
            let cq = loop {
                let left = STUCK.saturating_sub(since.elapsed());
                if left.is_zero() {
                    self.stuck(what);
                }
                let mut fds = [PollFd::new(&self.ch, PollFlags::IN)];
                let timeout = Timespec {
                    tv_sec: left.as_secs() as i64,
                    tv_nsec: i64::from(left.subsec_nanos()),
                };
                let _ = poll(&mut fds, Some(&timeout));
                match self.ch.try_get_cq_event() {
                    Ok(cq) => break cq,
                    // Readable for an event that was withheld (nothing new to poll): the CQ
                    // is armed again, and the wait goes on.
                    Err(Error::WouldBlock) => continue,
                    Err(e) => panic!("{}: get_cq_event: {e}", self.who),
                }
            };
            assert!(cq.same_as(&self.cq), "{}: the event names our CQ", self.who);
            cq.ack_events(1);
            self.counts.events += 1;
            cq.req_notify(self.variant.solicited()).expect("re-arm");
            let before = self.counts;
            if self.drain() == 0 {
                panic!(
                    "{}: an event with nothing to poll (waiting for {what}; counts {before:?})\n{}",
                    self.who,
                    self.state()
                );
            }
        }
    }

    /// Polls in the last send completions: a solicited-only arm never fires for them.
    fn settle(&mut self) {
        let since = Instant::now();
        while self.counts.sends < ROUND_TRIPS {
            if self.drain() == 0 {
                if since.elapsed() > STUCK {
                    self.stuck("the last send completions");
                }
                std::thread::yield_now();
            }
        }
    }

    fn state(&self) -> String {
        format!(
            "--- this process ({}):\n{}--- the other process:\n{}",
            self.who,
            inspect::process(std::process::id()),
            inspect::process(self.other)
        )
    }

    fn stuck(&self, what: &str) -> ! {
        panic!(
            "{} ({:?}): no event within {STUCK:?} while waiting for {what}; counts {:?}\n{}",
            self.who,
            self.variant,
            self.counts,
            self.state()
        )
    }
}

peer!(peer_events_echo, |p| {
    let m = p.expect("variant");
    let variant = Variant::from_name(&m.get::<String>(0));
    let n = node();
    let mut side = Side::new("echo", variant, &n);
    p.send(msg!("echo", side.qp.endpoint(0).unwrap()));
    let them: Endpoint = p.expect("initiator").get(0);
    side.start(
        &them,
        rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get() as u32),
    );
    p.send("ready");
    for i in 0..ROUND_TRIPS {
        side.wait_until("a ping", |c| c.recvs > i);
        side.send(i);
    }
    side.settle();
    let c = side.counts;
    p.send(msg!("done", c.sends, c.recvs, c.events, c.stamps));
});

fn ping_pong(variant: Variant) {
    // Alone: peers of other tests busy-polling on two cores could hold a woken process off
    // the CPU long enough to look like a lost event.
    let _alone = exclusive();
    let mut echo = Peer::spawn("events::peer_events_echo");
    echo.send(msg!("variant", variant.name()));
    let them: Endpoint = echo.expect("echo").get(0);
    let n = node();
    let mut side = Side::new("pinger", variant, &n);
    side.start(&them, echo.pid());
    echo.send(msg!("initiator", side.qp.endpoint(0).unwrap()));
    echo.expect("ready");
    let start = Instant::now();
    for i in 0..ROUND_TRIPS {
        side.send(i);
        side.wait_until("a pong and the ping's send completion", |c| {
            c.recvs > i && c.sends > i
        });
    }
    let took = start.elapsed();
    let done = echo.expect_within("done", Duration::from_secs(30));
    let theirs: Vec<u64> = (0..4).map(|i| done.get(i)).collect();
    let c = side.counts;
    assert_eq!((c.sends, c.recvs), (ROUND_TRIPS, ROUND_TRIPS), "pinger");
    assert_eq!((theirs[0], theirs[1]), (ROUND_TRIPS, ROUND_TRIPS), "echo");
    let stamped = !matches!(variant, Variant::Plain | Variant::Extended);
    assert_eq!(
        (c.stamps, theirs[3]),
        if stamped {
            (2 * ROUND_TRIPS, 2 * ROUND_TRIPS)
        } else {
            (0, 0)
        },
        "timestamps read"
    );
    println!(
        "{variant:?}: {ROUND_TRIPS} round trips in {took:.2?} ({:.1} us each); events: pinger {}, echo {}",
        took.as_secs_f64() * 1e6 / ROUND_TRIPS as f64,
        c.events,
        theirs[2]
    );
    echo.finish();
}

#[test]
fn event_driven_ping_pong_with_a_plain_cq() {
    ping_pong(Variant::Plain);
}

#[test]
fn event_driven_ping_pong_with_an_extended_cq_and_the_cursor() {
    ping_pong(Variant::Extended);
}

#[test]
fn event_driven_ping_pong_with_completion_timestamps() {
    ping_pong(Variant::Timestamps);
}

#[test]
fn event_driven_ping_pong_armed_for_solicited_completions() {
    ping_pong(Variant::Solicited);
}
