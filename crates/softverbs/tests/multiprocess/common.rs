//! Verbs set-up, checks and process inspection shared by both roles.

use softverbs::*;
use std::time::{Duration, Instant};

pub const ALL_REMOTE: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// How long a completion or a byte already on its way may take to show up.
pub const DATA_WAIT: Duration = Duration::from_secs(5);

/// One process's verbs objects: a context on the default device, a PD and a CQ.
pub struct Node {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
}

/// Opens the default device (`softverbs0`, the first one listed), as both processes do.
pub fn node() -> Node {
    let dev = devices().expect("device list")[0].clone();
    let ctx = dev
        .open()
        .unwrap_or_else(|e| panic!("open {}: {e}", dev.name()));
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(256, None).expect("create_cq");
    Node { ctx, pd, cq }
}

impl Node {
    /// A QP of `qp_type` on this node's CQ.
    pub fn qp(&self, qp_type: QpType) -> QueuePair {
        self.pd
            .create_qp(&QpInitAttr::new(qp_type, &self.cq, &self.cq))
            .expect("create_qp")
    }
    /// An RC QP connected to the target process's `tep`; tells the target this end's
    /// endpoint and returns once it answers `ready`.
    pub fn rc_to(&self, t: &mut crate::harness::Peer, tep: &Endpoint, ready: &str) -> QueuePair {
        let qp = self.qp(QpType::Rc);
        qp.connect(tep, 0, ALL_REMOTE).unwrap();
        t.send(crate::harness::msg!("initiator", qp.endpoint(0).unwrap()));
        t.expect(ready);
        qp
    }
    /// A shared-memory region (`alloc_mr`) with every right.
    pub fn mr(&self, len: usize) -> MemoryRegion<'static> {
        self.pd.alloc_mr(len, ALL_REMOTE).expect("alloc_mr")
    }
    /// The address vector for reaching `remote` from this node's port.
    pub fn av(&self, remote: &Endpoint) -> AhAttr {
        let port = self.ctx.query_port(1).expect("query_port");
        address_vector(port.link_layer, remote)
    }
    /// True on a RoCE port (UD receives carry a GRH).
    pub fn is_roce(&self) -> bool {
        self.ctx.query_port(1).expect("query_port").link_layer == LinkLayer::Ethernet
    }
}

/// The target's side of [`Node::rc_to`]: connects `qp` (with every remote right) to the
/// endpoint the initiator sends; the caller answers `ready` (with whatever it adds).
pub fn accept_rc(p: &mut crate::harness::Parent, qp: &QueuePair) {
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
}

/// Polls until `n` completions arrived, within [`DATA_WAIT`]; panics naming `what` otherwise.
pub fn poll_n(cq: &CompletionQueue, n: usize, what: &str) -> Vec<WorkCompletion> {
    poll_n_within(cq, n, what, DATA_WAIT)
}

pub fn poll_n_within(
    cq: &CompletionQueue,
    n: usize,
    what: &str,
    within: Duration,
) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::default(); 16];
    while out.len() < n {
        let k = cq.poll(&mut buf[..(n - out.len()).min(16)]);
        out.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(
                Instant::now() < deadline,
                "{what}: {} of {n} completions within {within:?}: {out:?}",
                out.len()
            );
            std::thread::yield_now();
        }
    }
    out
}

/// Asserts that `what` produced no completion (beyond those already polled).
pub fn assert_no_completion(cq: &CompletionQueue, what: &str) {
    std::thread::sleep(Duration::from_millis(20));
    let mut buf = [WorkCompletion::default(); 4];
    let n = cq.poll(&mut buf);
    assert_eq!(n, 0, "{what}: unexpected completions {:?}", &buf[..n]);
}

/// Asserts every completion succeeded, naming `what` and the first failure.
/// The fields receive checks compare: (wr_id, opcode, byte_len, imm_data, src_qp).
pub fn recv_summary(wcs: &[WorkCompletion]) -> Vec<(u64, WcOpcode, u32, Option<u32>, u32)> {
    wcs.iter()
        .map(|w| {
            (
                w.wr_id(),
                w.opcode(),
                w.byte_len(),
                w.imm_data(),
                w.src_qp(),
            )
        })
        .collect()
}

pub fn assert_all_ok(wcs: &[WorkCompletion], what: &str) {
    if let Some((i, wc)) = wcs.iter().enumerate().find(|(_, w)| !w.is_ok()) {
        panic!(
            "{what}: completion {i} of {} failed with {:?}: {wc:?}\n all: {wcs:?}",
            wcs.len(),
            wc.status()
        );
    }
}

/// Spins until `done()` or `within` passes; returns whether it got done.
pub fn spin_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::hint::spin_loop();
    }
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

pub fn signaled(wr: SendWr<'_>) -> SendWr<'_> {
    wr.flags(SendFlags::SIGNALED)
}

/// Compares bytes, as one side-channel token: `ok`, or how many differ and the first one.
pub fn compare(got: &[u8], want: &[u8]) -> String {
    if got.len() != want.len() {
        return format!("length-{}-not-{}", got.len(), want.len());
    }
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    match bad.first() {
        None => "ok".into(),
        Some(&i) => format!(
            "{}-bytes-differ,first-at-{i}:got-{:#04x}-want-{:#04x}",
            bad.len(),
            got[i],
            want[i]
        ),
    }
}

/// RTS → SQD → (set `timeout` and `retry_cnt`) → RTS: those cannot change in RTS.
pub fn set_timeout_and_retries(qp: &QueuePair, timeout: u8, retry_cnt: u8) {
    let mut set = QpAttr {
        qp_state: QpState::Sqd,
        ..QpAttr::default()
    };
    qp.modify(&set, QpAttrMask::STATE).expect("RTS -> SQD");
    set.timeout = timeout;
    set.retry_cnt = retry_cnt;
    qp.modify(&set, QpAttrMask::TIMEOUT | QpAttrMask::RETRY_CNT)
        .expect("SQD: timeout and retry count");
    set.qp_state = QpState::Rts;
    qp.modify(&set, QpAttrMask::STATE).expect("SQD -> RTS");
}

/// The local ACK timeout for the QP attribute `timeout`: 4.096 µs × 2^timeout.
pub fn ack_timeout(timeout: u8) -> Duration {
    Duration::from_nanos(4096u64 << timeout)
}

/// Each thread of process `pid`: `(tid, name, state letter)`.
pub fn thread_states(pid: u32) -> Vec<(u32, String, char)> {
    inspect::process(pid)
        .threads
        .into_iter()
        .map(|t| (t.tid, t.name, t.state))
        .collect()
}

/// The state letter of process `pid` (`R`, `S`, `T` stopped, `Z`…), `None` if it is gone.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.rfind(')')?;
    stat[close + 1..].trim_start().chars().next()
}
