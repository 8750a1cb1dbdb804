//! MADs that arrive: requests for listeners, and answers for the connections they name.

use super::*;

impl Cm {
    /// One envelope that came to socket `on` (the agent's, or listener `Some(i)`'s).
    pub(super) fn handle(&mut self, listener: Option<u32>, env: Envelope) {
        log(format_args!("recv {} on {listener:?}", describe(&env.mad)));
        if env.flags & !wire::FROM_NETWORK != 0 {
            return;
        }
        let Ok(m) = Mad::parse(&env.mad) else { return };
        let early = matches!(m.msg, Msg::Req(_) | Msg::SidrReq(_))
            && listener.is_some_and(|l| {
                self.conns
                    .get(&l)
                    .is_some_and(|c| c.state == State::AddrBound)
            });
        if let (true, Some(l)) = (early, listener) {
            // Not listening yet: it may be about to (see `Cm::early`).
            if self.early.len() < 1024 {
                self.early.push((l, env, Instant::now()));
                return;
            }
        }
        match m.msg {
            Msg::Req(r) => self.on_req(listener, &env, m.tid, r),
            Msg::SidrReq(r) => self.on_sidr_req(listener, &env, m.tid, r),
            Msg::Rep(r) => self.on_rep(r),
            Msg::Rtu(r) => {
                if let Some(i) = self
                    .by_comm_id(r.remote_comm_id)
                    .filter(|i| self.conns[i].remote_comm_id == r.local_comm_id)
                {
                    if self.conns[&i].state == State::RepSent {
                        self.rtu_received(i);
                    }
                }
            }
            Msg::Rej(r) => self.on_rej(r),
            Msg::Mra(r) => {
                if let Some(i) = self.by_comm_id(r.remote_comm_id) {
                    if let Some(p) = self.conns.get_mut(&i).and_then(|c| c.pending.as_mut()) {
                        p.due = Instant::now() + cm_timeout(r.service_timeout) + p.every;
                    }
                }
            }
            Msg::Dreq(r) => self.on_dreq(&env, m.tid, r),
            Msg::Drep(r) => {
                if let Some(i) = self.by_comm_id(r.remote_comm_id) {
                    if self.conns[&i].state == State::DreqSent {
                        let id = self.conns[&i].id;
                        self.enter_timewait(i);
                        self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, 0));
                    }
                }
            }
            Msg::SidrRep(r) => self.on_sidr_rep(r),
        }
    }

    pub(super) fn listener_for(&self, on: Option<u32>) -> Option<u32> {
        let i = on?;
        (self.conns.get(&i)?.state == State::Listen).then_some(i)
    }

    /// A new id for a request to listener `l`, on the device the request came in on.
    pub(super) fn child(&mut self, l: u32, env: &Envelope, hdr: Option<IpHeader>) -> Option<u32> {
        let lc = self.conns.get(&l)?;
        // As the kernel's rdma_cm: a backlog of 0 or less is its maximum, 1024.
        let backlog = if lc.backlog <= 0 {
            1024
        } else {
            lc.backlog.min(1024)
        } as usize;
        let waiting = self
            .conns
            .values()
            .filter(|c| {
                c.listener == Some(l) && matches!(c.state, State::ReqRcvd | State::SidrReqRcvd)
            })
            .count();
        if waiting >= backlog {
            return None;
        }
        let (channel, ps, context, sync) = {
            // SAFETY: the listener is live.
            let ctx = unsafe { (*lc.id).c.context };
            (lc.channel, lc.ps, ctx, lc.sync)
        };
        // SAFETY: the listener's id is live.
        let qp_type = unsafe { (*lc.id).c.qp_type };
        let port = lc.src.map_or(0, |s| s.port());
        let id = self.create_id(
            if sync { std::ptr::null() } else { channel },
            context,
            ps,
            qp_type,
        )?;
        // SAFETY: just made.
        let i = unsafe { (*id).index };
        if sync {
            // The request itself is reported on the listener's channel (rdma_get_request).
            if let Some(c) = self.conns.get_mut(&i) {
                let _ = c;
            }
        }
        let place = device::place_of(addr::ip_of(&env.dgid)).or_else(|| {
            let dev = self.conns.get(&l)?.dev?;
            Some(Place { dev, gid_index: 0 })
        })?;
        self.set_place(i, place);
        let c = self.conns.get_mut(&i)?;
        c.listener = Some(l);
        c.dgid = env.sgid;
        let (src_ip, dst) = match hdr {
            Some(h) => (h.dst, SocketAddr::new(h.src, h.src_port)),
            None => (
                addr::ip_of(&env.dgid),
                SocketAddr::new(addr::ip_of(&env.sgid), 0),
            ),
        };
        c.src = Some(SocketAddr::new(src_ip, port));
        c.dst = Some(dst);
        Some(i)
    }

    pub(super) fn on_req(&mut self, on: Option<u32>, env: &Envelope, tid: u64, r: mad::Req) {
        // A REQ sent again: answer again what was answered.
        if let Some((&i, c)) = self.conns.iter().find(|(_, c)| {
            c.remote_comm_id == r.local_comm_id && c.dgid == env.sgid && c.listener.is_some()
        }) {
            if c.state == State::RepSent {
                if let Some(p) = &c.pending {
                    let (mad, dest) = (p.mad, p.dest);
                    self.send(i, dest, &mad);
                }
            }
            return;
        }
        let Some(l) = self.listener_for(on) else {
            self.reject_req(env, tid, &r, mad::reason::INVALID_SERVICE_ID);
            return;
        };
        let hdr = IpHeader::parse(&r.private_data);
        let Some(i) = self.child(l, env, hdr) else {
            // Over the backlog: the kernel's CM destroys the new id, which rejects the REQ.
            self.reject_req(env, tid, &r, mad::reason::CONSUMER);
            return;
        };
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        c.remote_comm_id = r.local_comm_id;
        c.remote_qpn = r.local_qpn;
        c.remote_psn = r.starting_psn;
        // Our responder resources answer their initiator depth, and the other way round.
        c.responder_resources = r.initiator_depth;
        c.initiator_depth = r.responder_resources;
        c.retry_count = r.retry_count;
        c.peer_rnr_retry = r.rnr_retry_count;
        c.srq = r.srq;
        c.mtu = c.mtu.min(i32::from(r.mtu)).max(1);
        c.ack_timeout = Some(r.primary.local_ack_timeout);
        c.tid = tid;
        c.state = State::ReqRcvd;
        let id = c.id;
        let conn = rdma_conn_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            responder_resources: r.initiator_depth,
            initiator_depth: r.responder_resources,
            flow_control: u8::from(r.flow_control),
            retry_count: r.retry_count,
            rnr_retry_count: r.rnr_retry_count,
            srq: u8::from(r.srq),
            qp_num: r.local_qpn,
        };
        self.write_route_resolved(i);
        let skip = if hdr.is_some() { IpHeader::LEN } else { 0 };
        let mut e = Event::new(id.cast(), RDMA_CM_EVENT_CONNECT_REQUEST, 0)
            .with_conn(conn, &r.private_data[skip..]);
        e.ev.listen_id = self.conns[&l].id.cast();
        self.post(l, e);
    }

    pub(super) fn write_route_resolved(&mut self, i: u32) {
        if let Some(c) = self.conns.get_mut(&i) {
            let s = c.state;
            c.state = State::RouteResolved;
            self.write_route(i);
            if let Some(c) = self.conns.get_mut(&i) {
                c.state = s;
            }
        }
    }

    /// The REJ a host's CM sends for a REQ that no listener takes.
    pub(super) fn reject_req(&mut self, env: &Envelope, tid: u64, r: &mad::Req, reason: u16) {
        let m = Mad {
            tid,
            msg: Msg::Rej(mad::Rej {
                local_comm_id: 0,
                remote_comm_id: r.local_comm_id,
                message_rejected: 0,
                reason,
                private_data: Vec::new(),
            }),
        }
        .emit();
        self.send_from(env.dgid, env.sgid, Dest::Agent(r.local_comm_id >> 12), &m);
    }

    pub(super) fn on_sidr_req(
        &mut self,
        on: Option<u32>,
        env: &Envelope,
        tid: u64,
        r: mad::SidrReq,
    ) {
        let refuse = |cm: &mut Cm, status: u8| {
            let m = Mad {
                tid,
                msg: Msg::SidrRep(mad::SidrRep {
                    request_id: r.request_id,
                    status,
                    qpn: 0,
                    service_id: r.service_id,
                    qkey: 0,
                    private_data: Vec::new(),
                }),
            }
            .emit();
            cm.send_from(env.dgid, env.sgid, Dest::Agent(r.request_id >> 12), &m);
        };
        let Some(l) = self.listener_for(on) else {
            refuse(self, 1);
            return;
        };
        let hdr = IpHeader::parse(&r.private_data);
        let Some(i) = self.child(l, env, hdr) else {
            refuse(self, 2);
            return;
        };
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        c.remote_comm_id = r.request_id;
        c.tid = tid;
        c.state = State::SidrReqRcvd;
        let id = c.id;
        self.write_route_resolved(i);
        let c = &self.conns[&i];
        let ud = rdma_ud_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            ah_attr: self.ah_of(c),
            qp_num: 0,
            qkey: RDMA_UDP_QKEY,
        };
        let skip = if hdr.is_some() { IpHeader::LEN } else { 0 };
        let mut e = Event::new(id.cast(), RDMA_CM_EVENT_CONNECT_REQUEST, 0)
            .with_ud(ud, &r.private_data[skip..]);
        e.ev.listen_id = self.conns[&l].id.cast();
        self.post(l, e);
    }

    pub(super) fn on_rep(&mut self, r: mad::Rep) {
        let Some(i) = self.by_comm_id(r.remote_comm_id) else {
            return;
        };
        let c = &self.conns[&i];
        match c.state {
            State::ReqSent => {}
            State::Established | State::RepRcvd if c.remote_comm_id == r.local_comm_id => {
                // Our RTU was lost: send it again.
                if c.state == State::Established {
                    self.send_rtu(i);
                }
                return;
            }
            _ => return,
        }
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        c.pending = None;
        c.remote_comm_id = r.local_comm_id;
        c.remote_qpn = r.local_qpn;
        c.remote_psn = r.starting_psn;
        c.initiator_depth = c.initiator_depth.min(r.responder_resources);
        c.peer_rnr_retry = r.rnr_retry_count;
        let id = c.id;
        // SAFETY: the id is live.
        let has_qp = unsafe { !(*id).c.qp.is_null() };
        let conn = rdma_conn_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            responder_resources: r.initiator_depth,
            initiator_depth: r.responder_resources,
            flow_control: u8::from(r.flow_control),
            retry_count: 0,
            rnr_retry_count: r.rnr_retry_count,
            srq: u8::from(r.srq),
            qp_num: r.local_qpn,
        };
        if !has_qp {
            c.state = State::RepRcvd;
            let e = Event::new(id.cast(), RDMA_CM_EVENT_CONNECT_RESPONSE, 0)
                .with_conn(conn, &r.private_data);
            self.post(i, e);
            return;
        }
        match self.modify_qp(i, &[IBV_QPS_RTR, IBV_QPS_RTS]) {
            Ok(()) => {
                self.send_rtu(i);
                if let Some(c) = self.conns.get_mut(&i) {
                    c.state = State::Established;
                }
                self.lease(i);
                let e = Event::new(id.cast(), RDMA_CM_EVENT_ESTABLISHED, 0)
                    .with_conn(conn, &r.private_data);
                self.post(i, e);
            }
            Err(errno) => {
                // Tell the peer, as librdmacm does when its QP cannot follow the REP.
                let c = &self.conns[&i];
                let m = Mad {
                    tid: c.tid,
                    msg: Msg::Rej(mad::Rej {
                        local_comm_id: c.comm_id,
                        remote_comm_id: c.remote_comm_id,
                        message_rejected: 1,
                        reason: mad::reason::CONSUMER,
                        private_data: Vec::new(),
                    }),
                }
                .emit();
                self.send(i, Dest::Agent(r.local_comm_id >> 12), &m);
                if let Some(c) = self.conns.get_mut(&i) {
                    c.state = State::Rejected;
                }
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_CONNECT_ERROR, -errno),
                );
            }
        }
    }

    pub(super) fn rtu_received(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        c.pending = None;
        c.state = State::Established;
        let id = c.id;
        self.lease(i);
        self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_ESTABLISHED, 0));
    }

    pub(super) fn on_rej(&mut self, r: mad::Rej) {
        let Some(i) = self.by_comm_id(r.remote_comm_id) else {
            return;
        };
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        if !matches!(c.state, State::ReqSent | State::RepSent | State::RepRcvd) {
            return;
        }
        c.pending = None;
        c.state = State::Rejected;
        let id = c.id;
        self.qp_to_err(i);
        let conn = rdma_conn_param::NONE;
        let e = Event::new(id.cast(), RDMA_CM_EVENT_REJECTED, i32::from(r.reason))
            .with_conn(conn, &r.private_data);
        self.post(i, e);
    }

    pub(super) fn on_dreq(&mut self, env: &Envelope, tid: u64, r: mad::Dreq) {
        let found = self
            .by_comm_id(r.remote_comm_id)
            .filter(|i| self.conns[i].remote_comm_id == r.local_comm_id);
        let Some(i) = found else {
            // No such connection (any more): the DREP the spec asks for all the same.
            let m = Mad {
                tid,
                msg: Msg::Drep(mad::Ids {
                    local_comm_id: r.remote_comm_id,
                    remote_comm_id: r.local_comm_id,
                    private_data: Vec::new(),
                }),
            }
            .emit();
            self.send_from(env.dgid, env.sgid, Dest::Agent(r.local_comm_id >> 12), &m);
            return;
        };
        let id = self.conns[&i].id;
        self.unlease(i);
        match self.conns[&i].state {
            State::Established | State::RepSent | State::RepRcvd => {
                let Some(c) = self.conns.get_mut(&i) else {
                    return;
                };
                c.state = State::DreqRcvd;
                c.pending = None;
                self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, 0));
            }
            State::DreqSent => {
                // Both ends disconnected at once: each answers the other.
                self.send_drep(i);
                self.enter_timewait(i);
                self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, 0));
            }
            State::TimeWait => self.send_drep(i),
            _ => {}
        }
    }

    pub(super) fn on_sidr_rep(&mut self, r: mad::SidrRep) {
        let Some(i) = self.by_comm_id(r.request_id) else {
            return;
        };
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        if c.state != State::SidrReqSent {
            return;
        }
        c.pending = None;
        let id = c.id;
        if r.status != 0 {
            c.state = State::RouteResolved;
            self.post(
                i,
                Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, i32::from(r.status)),
            );
            return;
        }
        c.state = State::Established;
        c.remote_qpn = r.qpn;
        c.remote_qkey = r.qkey;
        let c = &self.conns[&i];
        let ud = rdma_ud_param {
            private_data: std::ptr::null(),
            private_data_len: 0,
            ah_attr: self.ah_of(c),
            qp_num: r.qpn,
            qkey: r.qkey,
        };
        let e = Event::new(id.cast(), RDMA_CM_EVENT_ESTABLISHED, 0).with_ud(ud, &r.private_data);
        self.post(i, e);
    }
}
