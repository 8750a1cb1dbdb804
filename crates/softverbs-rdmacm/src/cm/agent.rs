//! The agent thread: its sockets, the wait, the timers (retries, timewait) and the check
//! that peers on this host are still alive.

use super::*;

impl Cm {
    /// Runs what is due; returns when to look again.
    pub(super) fn tick(&mut self) -> Duration {
        let now = Instant::now();
        let mut next = Duration::from_millis(500);
        if !self.flush() {
            next = Duration::from_millis(1);
        }
        let ids: Vec<u32> = self.conns.keys().copied().collect();
        for i in ids {
            let Some(c) = self.conns.get_mut(&i) else {
                continue;
            };
            if let Some(t) = c.timewait_until {
                if t <= now {
                    c.timewait_until = None;
                    let id = c.id;
                    self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_TIMEWAIT_EXIT, 0));
                    continue;
                }
                next = next.min(t - now);
            }
            let Some(c) = self.conns.get_mut(&i) else {
                continue;
            };
            let Some(p) = c.pending.as_mut() else {
                continue;
            };
            if p.due > now {
                next = next.min(p.due - now);
                continue;
            }
            if p.tries_left == 0 {
                c.pending = None;
                self.timed_out(i);
                continue;
            }
            p.tries_left -= 1;
            p.due = now + p.every;
            next = next.min(p.every);
            let (mad, dest) = (p.mad, p.dest);
            self.send(i, dest, &mad);
        }
        // Requests whose port never came to listen: answered as for no listener.
        if !self.early.is_empty() {
            let (late, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.early)
                .into_iter()
                .partition(|(_, _, since)| now.duration_since(*since) >= EARLY_HOLD);
            self.early = waiting;
            for (_, env, _) in late {
                self.handle(None, env);
            }
            if !self.early.is_empty() {
                next = next.min(Duration::from_millis(10));
            }
        }
        if now.duration_since(self.last_peer_check) >= PEER_CHECK {
            self.last_peer_check = now;
            self.check_local_peers();
        }
        next.min(PEER_CHECK)
    }

    pub(super) fn timed_out(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        let id = c.id;
        match c.state {
            State::ReqSent | State::SidrReqSent => {
                c.state = State::RouteResolved;
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT),
                );
            }
            State::RepSent => {
                c.state = State::Rejected;
                self.qp_to_err(i);
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT),
                );
            }
            State::DreqSent => {
                self.enter_timewait(i);
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, -libc::ETIMEDOUT),
                );
            }
            _ => {}
        }
    }

    /// Connected peers on this host whose agent socket is gone died without a DREQ.
    pub(super) fn check_local_peers(&mut self) {
        let gone: Vec<u32> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                matches!(
                    c.state,
                    State::Established | State::DreqSent | State::RepSent
                ) && device::is_local_gid(&c.dgid)
                    && c.remote_comm_id >> 12 != self.agent
                    && !wire::agent_alive(&self.sock, c.remote_comm_id >> 12)
            })
            .map(|(i, _)| *i)
            .collect();
        for i in gone {
            self.peer_gone(i);
        }
    }

    /// The sockets the agent thread waits on: its own, then each bound id's port socket.
    pub(super) fn sockets(&self) -> Vec<(Option<u32>, c_int)> {
        use std::os::fd::AsRawFd;
        let mut v = vec![(None, self.sock.as_raw_fd())];
        for (i, c) in &self.conns {
            if let Some(s) = &c.port {
                v.push((Some(*i), s.as_raw_fd()));
            }
        }
        v
    }
}

/// What the agent waits on: its sockets (each with the listener it belongs to, `None` for
/// the agent's own), the wake pipe, and how long at most.
type Wait = (Vec<(Option<u32>, c_int)>, c_int, Duration);

pub(super) fn agent_loop() {
    let mut buf = [0u8; 512];
    let mut wait: Option<Wait> = None;
    loop {
        // Everything but the wait runs where no registration moves heap pages (see
        // `verbs::without_moves`): this thread allocates and frees.
        let mut alive = true;
        crate::verbs::without_moves(&mut || {
            if let Some((socks, wake, _)) = &wait {
                alive = serve(socks, *wake, &mut buf);
            }
            wait = cm().map(|mut cm| {
                let t = cm.tick();
                (cm.sockets(), cm.wake.0, t)
            });
        });
        let Some((socks, wake, timeout)) = wait.as_ref().filter(|_| alive) else {
            return;
        };
        let mut fds: Vec<libc::pollfd> = socks
            .iter()
            .map(|(_, fd)| libc::pollfd {
                fd: *fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .chain([libc::pollfd {
                fd: *wake,
                events: libc::POLLIN,
                revents: 0,
            }])
            .collect();
        let ms = timeout.as_millis().clamp(1, 1000) as c_int;
        // SAFETY: a valid pollfd array of the length passed.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        // Which sockets to read is decided again under the lock: `serve` reads them all,
        // non-blocking, so the poll only paces the loop.
        drop(fds);
    }
}

/// Reads and handles what came to the agent's sockets; false when the CM is gone.
fn serve(socks: &[(Option<u32>, c_int)], wake: c_int, buf: &mut [u8; 512]) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: draining our own non-blocking pipe into a live buffer.
    while unsafe { libc::read(wake, buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
    let Some(mut cm) = cm() else { return false };
    for (listener, _) in socks {
        // The socket may have closed since: find it again.
        let sock = match listener {
            None => Some(cm.sock.as_raw_fd()),
            Some(i) => cm
                .conns
                .get(i)
                .and_then(|c| c.port.as_ref())
                .map(|s| s.as_raw_fd()),
        };
        let Some(fd) = sock else { continue };
        for _ in 0..64 {
            // SAFETY: a non-blocking receive into a live buffer.
            let n =
                unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            if n <= 0 {
                break;
            }
            if let Some(env) = Envelope::parse(&buf[..n as usize]) {
                cm.handle(*listener, env);
            }
        }
    }
    true
}
