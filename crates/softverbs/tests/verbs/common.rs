//! Shared set-up: a context, a PD, and connected QP pairs.

use softverbs::*;

pub const ALL_REMOTE: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

pub struct Pair {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq_a: CompletionQueue,
    pub cq_b: CompletionQueue,
    pub a: QueuePair,
    pub b: QueuePair,
}

pub fn ctx() -> Context {
    devices().expect("device list")[0].open().expect("open")
}

/// Two connected QPs of `qp_type` (RC or UC), each with its own CQ.
pub fn pair(qp_type: QpType) -> Pair {
    pair_with(qp_type, |_| {})
}

pub fn pair_with(qp_type: QpType, tweak: impl Fn(&mut QpCap)) -> Pair {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx.create_cq(256, None).unwrap();
    let cq_b = ctx.create_cq(256, None).unwrap();
    let mut ia = QpInitAttr::new(qp_type, &cq_a, &cq_a);
    tweak(&mut ia.cap);
    let mut ib = QpInitAttr::new(qp_type, &cq_b, &cq_b);
    tweak(&mut ib.cap);
    let a = pd.create_qp(&ia).unwrap();
    let b = pd.create_qp(&ib).unwrap();
    a.connect(&b.endpoint(100).unwrap(), 200, ALL_REMOTE)
        .unwrap();
    b.connect(&a.endpoint(200).unwrap(), 100, ALL_REMOTE)
        .unwrap();
    Pair {
        ctx,
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

/// Polls until `n` completions arrived (10 s at most).
pub fn poll_n(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::default(); 16];
    while out.len() < n {
        let k = cq.poll(&mut buf[..(n - out.len()).min(16)]);
        out.extend_from_slice(&buf[..k]);
        assert!(
            std::time::Instant::now() < deadline,
            "timed out with {} of {n} completions: {out:?}",
            out.len()
        );
        if k == 0 {
            std::thread::yield_now();
        }
    }
    out
}

/// Asserts nothing more arrives within a short while.
pub fn assert_empty(cq: &CompletionQueue) {
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut buf = [WorkCompletion::default(); 4];
    let n = cq.poll(&mut buf);
    assert_eq!(n, 0, "unexpected completions: {:?}", &buf[..n]);
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub fn signaled(wr: SendWr<'_>) -> SendWr<'_> {
    wr.flags(SendFlags::SIGNALED)
}
