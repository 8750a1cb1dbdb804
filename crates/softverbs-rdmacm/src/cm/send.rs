//! How MADs leave: to a socket on this host or to the host engine, an outbox for busy
//! receivers, MADs kept to send again until answered, and the DREQs leased to the engine.

use super::*;

impl Cm {
    pub(super) fn wake_agent(&self) {
        let b = 1u8;
        // SAFETY: a one-byte write to our non-blocking pipe.
        let _ = unsafe { libc::write(self.wake.1, (&b as *const u8).cast(), 1) };
    }

    /// Sends `mad` from id `i` to `dest`. False if it could not leave (no such socket here:
    /// nobody listens or the peer is gone).
    pub(super) fn send(&mut self, i: u32, dest: Dest, m: &[u8; mad::MAD_LEN]) -> bool {
        let Some(c) = self.conns.get(&i) else {
            return false;
        };
        let (sgid, dgid) = (c.sgid, c.dgid);
        self.send_from(sgid, dgid, dest, m)
    }

    pub(super) fn send_from(
        &mut self,
        sgid: [u8; 16],
        dgid: [u8; 16],
        dest: Dest,
        m: &[u8; mad::MAD_LEN],
    ) -> bool {
        self.send_flagged(0, sgid, dgid, dest, m)
    }

    /// As [`Self::send_from`], with envelope `flags` ([`wire::LEASE`] and [`wire::CANCEL`]
    /// go to the host engine whatever the destination).
    pub(super) fn send_flagged(
        &mut self,
        flags: u8,
        sgid: [u8; 16],
        dgid: [u8; 16],
        dest: Dest,
        m: &[u8; mad::MAD_LEN],
    ) -> bool {
        let env = Envelope {
            flags,
            sgid,
            dgid,
            src_qpn: 1,
            mad: *m,
        };
        let name = if flags == 0 && device::is_local_gid(&dgid) {
            wire::local_name(dest)
        } else {
            // Another host: its CM is reached through our host engine, which puts the MAD on
            // the wire from QP1.
            wire::engine_name(self.engine_addr(&sgid))
        };
        let bytes = env.emit().to_vec();
        let sent = if self.outbox.is_empty() {
            wire::send_named(&self.sock, &name, &bytes)
        } else {
            Sent::Busy
        };
        log(format_args!(
            "send {} flags {flags} to {name} {sent:?}",
            describe(m)
        ));
        match sent {
            Sent::Done => true,
            Sent::Busy => {
                // Kept in order and sent by the agent as room appears, never waited for
                // under the lock (two agents could wait on each other).
                self.outbox.push_back((name, bytes));
                self.wake_agent();
                true
            }
            Sent::Nobody => false,
        }
    }

    /// The address whose engine carries MADs from GID `sgid`: the engine of a device is
    /// named by the device's first IPv4 address (else its first GID).
    pub(super) fn engine_addr(&self, sgid: &[u8; 16]) -> IpAddr {
        let devs = device::devices();
        let dev = devs.iter().find(|d| d.gids.contains(sgid));
        dev.and_then(|d| {
            d.gids
                .iter()
                .map(addr::ip_of)
                .find(IpAddr::is_ipv4)
                .or_else(|| d.gids.first().map(addr::ip_of))
        })
        .unwrap_or_else(|| addr::ip_of(sgid))
    }

    /// Sends what waited for room; true if the outbox is empty.
    pub(super) fn flush(&mut self) -> bool {
        while let Some((name, bytes)) = self.outbox.front() {
            match wire::send_named(&self.sock, name, bytes) {
                Sent::Busy => return false,
                // Done, or the receiver went away meanwhile (its peer's timers tell).
                _ => {
                    self.outbox.pop_front();
                }
            }
        }
        true
    }

    /// Sends `mad` and keeps it to send again until answered.
    pub(super) fn send_reliable(&mut self, i: u32, dest: Dest, m: [u8; mad::MAD_LEN]) -> bool {
        let sent = self.send(i, dest, &m);
        let every = cm_timeout(CM_RESPONSE_TIMEOUT);
        if let Some(c) = self.conns.get_mut(&i) {
            c.pending = Some(Pending {
                mad: m,
                dest,
                tries_left: MAX_CM_RETRIES,
                every,
                due: Instant::now() + every,
            });
        }
        self.wake_agent();
        sent
    }

    /// The DREQ of connection `i`.
    pub(super) fn dreq_of(&self, i: u32) -> Option<[u8; mad::MAD_LEN]> {
        let c = self.conns.get(&i)?;
        Some(
            Mad {
                tid: c.tid,
                msg: Msg::Dreq(mad::Dreq {
                    local_comm_id: c.comm_id,
                    remote_comm_id: c.remote_comm_id,
                    remote_qpn: c.remote_qpn,
                    private_data: Vec::new(),
                }),
            }
            .emit(),
        )
    }

    /// Connection `i` is up with a peer on another host: its host engine keeps the DREQ,
    /// to send should this process die (see [`wire::LEASE`]).
    pub(super) fn lease(&mut self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        if c.leased || device::is_local_gid(&c.dgid) {
            return;
        }
        let (sgid, dgid, dest) = (c.sgid, c.dgid, Dest::Agent(c.remote_comm_id >> 12));
        if let Some(m) = self.dreq_of(i) {
            if self.send_flagged(wire::LEASE, sgid, dgid, dest, &m) {
                if let Some(c) = self.conns.get_mut(&i) {
                    c.leased = true;
                }
            }
        }
    }

    /// Connection `i` is going down by the book: the engine forgets its lease.
    pub(super) fn unlease(&mut self, i: u32) {
        let Some(c) = self.conns.get_mut(&i) else {
            return;
        };
        if !std::mem::replace(&mut c.leased, false) {
            return;
        }
        let (sgid, dgid, dest) = (c.sgid, c.dgid, Dest::Agent(c.remote_comm_id >> 12));
        if let Some(m) = self.dreq_of(i) {
            self.send_flagged(wire::CANCEL, sgid, dgid, dest, &m);
        }
    }

    pub(super) fn send_rtu(&mut self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        let m = Mad {
            tid: c.tid,
            msg: Msg::Rtu(mad::Ids {
                local_comm_id: c.comm_id,
                remote_comm_id: c.remote_comm_id,
                private_data: Vec::new(),
            }),
        }
        .emit();
        let dest = Dest::Agent(c.remote_comm_id >> 12);
        self.send(i, dest, &m);
    }

    pub(super) fn send_drep(&mut self, i: u32) {
        let Some(c) = self.conns.get(&i) else { return };
        let m = Mad {
            tid: c.tid,
            msg: Msg::Drep(mad::Ids {
                local_comm_id: c.comm_id,
                remote_comm_id: c.remote_comm_id,
                private_data: Vec::new(),
            }),
        }
        .emit();
        self.send(i, Dest::Agent(c.remote_comm_id >> 12), &m);
    }
}
