//! The program's side of a connection: connect, accept, reject, establish, disconnect,
//! and what happens when the peer is gone.

use super::*;

impl Cm {
    pub(super) fn path_of(&self, c: &Conn) -> mad::Path {
        mad::Path {
            local_gid: c.sgid,
            remote_gid: c.dgid,
            flow_label: 0,
            packet_rate: 3,
            traffic_class: c.tos,
            hop_limit: 64,
            sl: 0,
            local_ack_timeout: c.ack_timeout.unwrap_or(DEFAULT_ACK_TIMEOUT),
        }
    }

    pub(super) fn service_id(ps: c_int, port: u16) -> u64 {
        (u64::from(ps as u32 & 0xffff) << 16) | u64::from(port)
    }

    /// The private data a REQ or SIDR_REQ carries: rdma_cm's IP header, then the program's.
    pub(super) fn ip_private(c: &Conn, user: &[u8]) -> Vec<u8> {
        let src = c
            .src
            .map_or(IpAddr::from([0, 0, 0, 0]), |s| addr::canonical(s.ip()));
        let dst = c
            .dst
            .map_or(IpAddr::from([0, 0, 0, 0]), |s| addr::canonical(s.ip()));
        let (src, dst) = match (src, dst) {
            (IpAddr::V4(_), IpAddr::V6(d)) => {
                (src, d.to_ipv4_mapped().map_or(IpAddr::V6(d), IpAddr::V4))
            }
            x => x,
        };
        let h = IpHeader {
            src,
            dst,
            src_port: c.src.map_or(0, |s| s.port()),
        };
        let mut p = h.emit().to_vec();
        p.extend_from_slice(user);
        p
    }

    /// `rdma_connect`: a REQ (RC/UC) or SIDR_REQ (UD).
    pub fn connect(&mut self, i: u32, p: &rdma_conn_param, user: &[u8]) -> Result<(), c_int> {
        let tid = self.new_tid();
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        if c.state != State::RouteResolved {
            return Err(libc::EINVAL);
        }
        let dst_port = c.dst.map_or(0, |d| d.port());
        let service_id = Self::service_id(c.ps, dst_port);
        // SAFETY: the id is live.
        let id = unsafe { &*c.id };
        let qp_type = if id.c.qp.is_null() {
            id.c.qp_type
        } else {
            // SAFETY: the program's QP, created on this id.
            unsafe { (*id.c.qp).qp_type }
        };
        c.tid = tid;
        if qp_type == IBV_QPT_UD || c.ps == RDMA_PS_UDP {
            if user.len() > mad::SIDR_REQ_PRIVATE - IpHeader::LEN {
                return Err(libc::EINVAL);
            }
            let private_data = Self::ip_private(c, user);
            let m = Mad {
                tid,
                msg: Msg::SidrReq(mad::SidrReq {
                    request_id: c.comm_id,
                    pkey: 0xffff,
                    service_id,
                    private_data,
                }),
            }
            .emit();
            c.state = State::SidrReqSent;
            if !self.send_reliable(i, Dest::Service(service_id), m) {
                self.no_listener(i);
            }
            return Ok(());
        }
        if user.len() > mad::REQ_PRIVATE - IpHeader::LEN {
            return Err(libc::EINVAL);
        }
        let qpn = if id.c.qp.is_null() {
            p.qp_num
        } else {
            // SAFETY: as above.
            unsafe { (*id.c.qp).qp_num }
        };
        c.responder_resources = p.responder_resources;
        c.initiator_depth = p.initiator_depth;
        c.retry_count = p.retry_count.min(7);
        c.rnr_retry_count = p.rnr_retry_count.min(7);
        c.srq = p.srq != 0 || !id.c.srq.is_null();
        let private_data = Self::ip_private(c, user);
        let req = mad::Req {
            local_comm_id: c.comm_id,
            service_id,
            local_ca_guid: device::devices()
                .get(c.dev.unwrap_or(0))
                .map_or(0, |d| d.guid),
            local_qkey: 0,
            local_qpn: qpn & 0xff_ffff,
            responder_resources: c.responder_resources,
            initiator_depth: c.initiator_depth,
            remote_cm_response_timeout: CM_RESPONSE_TIMEOUT,
            transport: if qp_type == IBV_QPT_UC {
                mad::Transport::Uc
            } else {
                mad::Transport::Rc
            },
            flow_control: p.flow_control != 0,
            starting_psn: c.psn,
            local_cm_response_timeout: CM_RESPONSE_TIMEOUT,
            retry_count: c.retry_count,
            pkey: 0xffff,
            mtu: c.mtu as u8,
            rnr_retry_count: c.rnr_retry_count,
            max_cm_retries: MAX_CM_RETRIES,
            srq: c.srq,
            primary: self.path_of(self.conns.get(&i).ok_or(libc::EINVAL)?),
            private_data,
        };
        let m = Mad {
            tid,
            msg: Msg::Req(req),
        }
        .emit();
        self.conns.get_mut(&i).ok_or(libc::EINVAL)?.state = State::ReqSent;
        if !self.send_reliable(i, Dest::Service(service_id), m) {
            self.no_listener(i);
        }
        Ok(())
    }

    /// A REQ or SIDR_REQ to a service nobody on this host listens on: what the host's CM
    /// would have answered (REJ "invalid service ID", SIDR_REP "not supported").
    pub(super) fn no_listener(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        if !device::is_local_gid(&c.dgid) {
            // Across the wire the peer host's engine answers, or the timer gives up.
            return;
        }
        c.pending = None;
        let id = c.id;
        if c.state == State::SidrReqSent {
            c.state = State::RouteResolved;
            self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, 1));
        } else {
            c.state = State::Rejected;
            self.qp_to_err(i);
            let conn = rdma_conn_param::NONE;
            let e = Event::new(
                id.cast(),
                RDMA_CM_EVENT_REJECTED,
                i32::from(mad::reason::INVALID_SERVICE_ID),
            )
            .with_conn(conn, &[0; mad::REJ_PRIVATE]);
            self.post(i, e);
        }
    }

    /// `rdma_accept`.
    pub fn accept(
        &mut self,
        i: u32,
        p: Option<&rdma_conn_param>,
        user: &[u8],
    ) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        match c.state {
            State::SidrReqRcvd => return self.sidr_answer(i, 0, user),
            State::ReqRcvd => {}
            _ => return Err(libc::EINVAL),
        }
        if user.len() > mad::REP_PRIVATE {
            return Err(libc::EINVAL);
        }
        // SAFETY: the id is live.
        let qp = unsafe { (*c.id).c.qp };
        let c = self.conns.get_mut(&i).ok_or(libc::EINVAL)?;
        if let Some(p) = p {
            // The REQ's offer bounds what we take.
            c.responder_resources = c.responder_resources.min(p.responder_resources);
            c.initiator_depth = c.initiator_depth.min(p.initiator_depth);
            c.rnr_retry_count = p.rnr_retry_count.min(7);
            if p.srq != 0 {
                c.srq = true;
            }
        }
        let qpn = if qp.is_null() {
            p.map_or(0, |p| p.qp_num)
        } else {
            // SAFETY: the program's QP on this id.
            unsafe { (*qp).qp_num }
        };
        self.modify_qp(i, &[IBV_QPS_RTR, IBV_QPS_RTS])?;
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        let rep = mad::Rep {
            local_comm_id: c.comm_id,
            remote_comm_id: c.remote_comm_id,
            local_qkey: 0,
            local_qpn: qpn & 0xff_ffff,
            starting_psn: c.psn,
            responder_resources: c.responder_resources,
            initiator_depth: c.initiator_depth,
            target_ack_delay: 0,
            flow_control: true,
            rnr_retry_count: c.rnr_retry_count,
            srq: c.srq,
            local_ca_guid: device::devices()
                .get(c.dev.unwrap_or(0))
                .map_or(0, |d| d.guid),
            private_data: user.to_vec(),
        };
        let m = Mad {
            tid: c.tid,
            msg: Msg::Rep(rep),
        }
        .emit();
        let dest = Dest::Agent(c.remote_comm_id >> 12);
        self.conns.get_mut(&i).ok_or(libc::EINVAL)?.state = State::RepSent;
        if !self.send_reliable(i, dest, m) {
            self.peer_gone(i);
        }
        Ok(())
    }

    /// `rdma_reject`.
    pub fn reject(&mut self, i: u32, user: &[u8]) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        match c.state {
            State::SidrReqRcvd => return self.sidr_answer(i, 2, user),
            State::ReqRcvd | State::RepRcvd => {}
            _ => return Err(libc::EINVAL),
        }
        if user.len() > mad::REJ_PRIVATE {
            return Err(libc::EINVAL);
        }
        let m = Mad {
            tid: c.tid,
            msg: Msg::Rej(mad::Rej {
                local_comm_id: c.comm_id,
                remote_comm_id: c.remote_comm_id,
                message_rejected: if c.state == State::RepRcvd { 1 } else { 0 },
                reason: mad::reason::CONSUMER,
                private_data: user.to_vec(),
            }),
        }
        .emit();
        let dest = Dest::Agent(c.remote_comm_id >> 12);
        self.send(i, dest, &m);
        if let Some(c) = self.conns.get_mut(&i) {
            c.state = State::Rejected;
        }
        Ok(())
    }

    pub(super) fn sidr_answer(&mut self, i: u32, status: u8, user: &[u8]) -> Result<(), c_int> {
        if user.len() > mad::SIDR_REP_PRIVATE {
            return Err(libc::EINVAL);
        }
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        // SAFETY: the id is live.
        let qp = unsafe { (*c.id).c.qp };
        let qpn = if qp.is_null() {
            0
        } else {
            // SAFETY: the program's QP on this id.
            unsafe { (*qp).qp_num }
        };
        let m = Mad {
            tid: c.tid,
            msg: Msg::SidrRep(mad::SidrRep {
                request_id: c.remote_comm_id,
                status,
                qpn,
                service_id: Self::service_id(c.ps, c.src.map_or(0, |s| s.port())),
                qkey: RDMA_UDP_QKEY,
                private_data: user.to_vec(),
            }),
        }
        .emit();
        let dest = Dest::Agent(c.remote_comm_id >> 12);
        self.send(i, dest, &m);
        if let Some(c) = self.conns.get_mut(&i) {
            c.state = if status == 0 {
                State::Established
            } else {
                State::Rejected
            };
        }
        Ok(())
    }

    /// `rdma_establish` (after CONNECT_RESPONSE on an id without a QP) and `rdma_notify`.
    pub fn establish(&mut self, i: u32) -> Result<(), c_int> {
        let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
        match c.state {
            State::RepRcvd => {
                self.send_rtu(i);
                if let Some(c) = self.conns.get_mut(&i) {
                    c.state = State::Established;
                }
                self.lease(i);
                Ok(())
            }
            State::RepSent => {
                // Traffic came before the RTU: the connection is up (IBV_EVENT_COMM_EST).
                self.rtu_received(i);
                Ok(())
            }
            State::Established => Ok(()),
            _ => Err(libc::EINVAL),
        }
    }

    /// `rdma_disconnect`: QP to ERR, then DREQ (or DREP if the peer's DREQ came first).
    pub fn disconnect(&mut self, i: u32) -> Result<(), c_int> {
        let state = self.conns.get(&i).ok_or(libc::EINVAL)?.state;
        self.unlease(i);
        match state {
            State::Established | State::RepSent | State::RepRcvd => {
                self.qp_to_err(i);
                let c = self.conns.get(&i).ok_or(libc::EINVAL)?;
                // SAFETY: the id is live.
                let qp = unsafe { (*c.id).c.qp };
                let _ = qp;
                let m = Mad {
                    tid: c.tid,
                    msg: Msg::Dreq(mad::Dreq {
                        local_comm_id: c.comm_id,
                        remote_comm_id: c.remote_comm_id,
                        remote_qpn: c.remote_qpn,
                        private_data: Vec::new(),
                    }),
                }
                .emit();
                let dest = Dest::Agent(c.remote_comm_id >> 12);
                self.conns.get_mut(&i).ok_or(libc::EINVAL)?.state = State::DreqSent;
                if !self.send_reliable(i, dest, m) {
                    self.peer_gone(i);
                }
                Ok(())
            }
            State::DreqRcvd => {
                self.qp_to_err(i);
                self.send_drep(i);
                self.enter_timewait(i);
                Ok(())
            }
            State::DreqSent | State::TimeWait => Ok(()),
            _ => Err(libc::EINVAL),
        }
    }

    pub(super) fn enter_timewait(&mut self, i: u32) {
        if let Some(c) = self.conns.get_mut(&i) {
            c.state = State::TimeWait;
            c.pending = None;
            c.timewait_until = Some(Instant::now() + TIMEWAIT);
        }
        self.wake_agent();
    }

    /// The peer of id `i` can no longer be reached (its socket is gone): as if it had
    /// disconnected, or never answered.
    pub(super) fn peer_gone(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        let id = c.id;
        c.pending = None;
        match c.state {
            State::Established | State::DreqSent | State::RepRcvd => {
                self.qp_to_err(i);
                self.enter_timewait(i);
                self.post(i, Event::new(id.cast(), RDMA_CM_EVENT_DISCONNECTED, 0));
            }
            State::RepSent => {
                if let Some(c) = self.conns.get_mut(&i) {
                    c.state = State::Rejected;
                }
                self.post(
                    i,
                    Event::new(id.cast(), RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT),
                );
            }
            _ => {}
        }
    }
}
