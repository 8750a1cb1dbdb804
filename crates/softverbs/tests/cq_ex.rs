//! Extended completion queues (issue 5): creation-time errors, every field of every opcode and
//! QP type through each of the four ways to poll (checked against expected values, not only
//! against each other), the seed's compact record layout against an independent computation,
//! and the cursor's semantics.
//!
//! The timestamp acceptance tests (increase along a CQ, agreement with the OS monotonic clock,
//! 16-bit wrap-around, `query_rt_values` between two completions) live in `timestamps.rs`.

use proptest::prelude::*;
use softverbs::compact::{self, SeedWcFlags as S};
use softverbs::nic::cq::Cqe;
use softverbs::*;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const EINVAL: i32 = 22;
const EOPNOTSUPP: i32 = 95;

const ALL_REMOTE: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

const QKEY: u32 = 0x1111_2222;

fn default_device() -> Device {
    devices().expect("device list")[0].clone()
}

fn ctx() -> Context {
    default_device().open().expect("open")
}

/// The errno of a call expected to fail.
fn errno<T>(r: Result<T>, what: &str) -> i32 {
    match r {
        Ok(_) => panic!("{what}: succeeded, expected an error"),
        Err(e) => e.errno(),
    }
}

/// `CLOCK_REALTIME` now, in nanoseconds.
fn wall_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

// ---------------------------------------------------------------------------------------------
// 1. Creation
// ---------------------------------------------------------------------------------------------

#[test]
fn unknown_comp_mask_bits_are_einval() {
    let ctx = ctx();
    for bad in [2u32, 4, 1 << 8, 1 << 31, u32::MAX] {
        let mut a = CqInitAttrEx::new(16);
        a.comp_mask = bad;
        assert_eq!(
            errno(ctx.create_cq_ex(&a), "comp_mask"),
            EINVAL,
            "comp_mask {bad:#x}"
        );
    }
    // The one known bit, with valid flags, is fine.
    let mut a = CqInitAttrEx::new(16);
    a.comp_mask = cq_init_attr_mask::FLAGS;
    ctx.create_cq_ex(&a).unwrap();
}

#[test]
fn each_field_the_device_cannot_give_is_eopnotsupp() {
    let ctx = ctx();
    let unsupported = [
        ("CVLAN", WcExFlags::CVLAN),
        ("FLOW_TAG", WcExFlags::FLOW_TAG),
        ("TM_INFO", WcExFlags::TM_INFO),
        ("unknown bit 12", WcExFlags::from_bits_retain(1 << 12)),
        ("unknown bit 40", WcExFlags::from_bits_retain(1 << 40)),
        ("unknown bit 63", WcExFlags::from_bits_retain(1 << 63)),
    ];
    for (name, bad) in unsupported {
        for with in [
            WcExFlags::empty(),
            WcExFlags::BYTE_LEN,
            WcExFlags::SUPPORTED,
        ] {
            let a = CqInitAttrEx::new(16).wc_flags(bad | with);
            assert_eq!(
                errno(ctx.create_cq_ex(&a), name),
                EOPNOTSUPP,
                "{name} with {with:?}"
            );
        }
    }
    // Every supported field alone, none at all, and all of them are accepted and reported back.
    let mut sets: Vec<WcExFlags> = WcExFlags::SUPPORTED.iter().collect();
    sets.push(WcExFlags::empty());
    sets.push(WcExFlags::STANDARD);
    sets.push(WcExFlags::SUPPORTED);
    for f in sets {
        let cq = ctx
            .create_cq_ex(&CqInitAttrEx::new(16).wc_flags(f))
            .unwrap_or_else(|e| panic!("{f:?}: {e}"));
        assert_eq!(cq.wc_flags(), f);
    }
    // A classic CQ returns the standard fields.
    assert_eq!(
        ctx.create_cq(16, None).unwrap().wc_flags(),
        WcExFlags::STANDARD
    );
}

#[test]
fn comp_vector_out_of_range_is_einval() {
    let ctx = ctx();
    let n = ctx.num_comp_vectors();
    assert!(n >= 1);
    for bad in [n, n + 1, u32::MAX] {
        let mut a = CqInitAttrEx::new(16);
        a.comp_vector = bad;
        assert_eq!(
            errno(ctx.create_cq_ex(&a), "comp_vector"),
            EINVAL,
            "comp_vector {bad}"
        );
    }
    let mut a = CqInitAttrEx::new(16);
    a.comp_vector = n - 1;
    ctx.create_cq_ex(&a).unwrap();
}

#[test]
fn create_flags_unknown_are_eopnotsupp_and_completion_timestamp_is_accepted() {
    let ctx = ctx();
    for bad in [2u32, 1 << 5, 1 << 31] {
        for with in [CreateCqFlags::empty(), CreateCqFlags::COMPLETION_TIMESTAMP] {
            let a = CqInitAttrEx::new(16).flags(CreateCqFlags::from_bits_retain(bad) | with);
            assert_eq!(
                a.comp_mask & cq_init_attr_mask::FLAGS,
                cq_init_attr_mask::FLAGS
            );
            assert_eq!(
                errno(ctx.create_cq_ex(&a), "create flags"),
                EOPNOTSUPP,
                "flags {bad:#x} | {with:?}"
            );
        }
        // Without the comp_mask bit the flags field is not read.
        let mut a = CqInitAttrEx::new(16);
        a.flags = CreateCqFlags::from_bits_retain(bad);
        ctx.create_cq_ex(&a)
            .unwrap_or_else(|e| panic!("flags {bad:#x} without comp_mask FLAGS: {e}"));
    }
    // The seed's COMPLETION_TIMESTAMP: accepted, and completions do carry timestamps.
    let cq = ctx
        .create_cq_ex(
            &CqInitAttrEx::new(16)
                .wc_flags(WcExFlags::COMPLETION_TIMESTAMP)
                .flags(CreateCqFlags::COMPLETION_TIMESTAMP),
        )
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let (a, _b) = connected(&pd, &cq, &cq);
    let mr = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let before = ctx.query_rt_values();
    post_write(&a, &mr, 5);
    let c = wait_cursor(&cq);
    assert_eq!(c.wr_id(), 5);
    let ts = c.completion_ts().expect("timestamp field");
    let after = ctx.query_rt_values();
    assert_ne!(ts, 0);
    let clock = ctx.clock();
    assert!(clock.delta(before, ts) <= clock.delta(before, after));
}

#[test]
fn cqe_zero_or_above_the_device_limit_is_einval() {
    let ctx = ctx();
    assert_eq!(
        errno(ctx.create_cq_ex(&CqInitAttrEx::new(0)), "cqe 0"),
        EINVAL
    );
    let max = ctx.query_device().max_cqe;
    assert_eq!(
        errno(ctx.create_cq_ex(&CqInitAttrEx::new(max + 1)), "cqe max+1"),
        EINVAL
    );
    let cq = ctx.create_cq_ex(&CqInitAttrEx::new(1)).unwrap();
    assert!(cq.capacity() >= 1);
}

#[test]
fn cq_context_round_trips_directly_and_through_a_channel_event() {
    let ctx = ctx();
    let value = 0xfeed_f00d_1234_5678u64;
    let mut plain = CqInitAttrEx::new(8);
    plain.cq_context = 42;
    assert_eq!(ctx.create_cq_ex(&plain).unwrap().context(), 42);
    assert_eq!(ctx.create_cq(8, None).unwrap().context(), 0);

    let ch = ctx.create_comp_channel().unwrap();
    let mut attr = CqInitAttrEx::new(16)
        .wc_flags(WcExFlags::SUPPORTED)
        .channel(&ch);
    attr.cq_context = value;
    let cq = ctx.create_cq_ex(&attr).unwrap();
    assert_eq!(cq.context(), value);
    let pd = ctx.alloc_pd().unwrap();
    let (a, _b) = connected(&pd, &cq, &cq);
    let mr = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    cq.req_notify(false).unwrap();
    post_write(&a, &mr, 9);
    let ev = ch.get_cq_event().unwrap();
    assert!(ev.same_as(&cq), "the event names another CQ");
    assert_eq!(ev.context(), value);
    assert_eq!(ev.wc_flags(), WcExFlags::SUPPORTED);
    ev.ack_events(1);
    // The event's handle polls the same ring.
    let c = wait_cursor(&ev);
    assert_eq!(c.wr_id(), 9);
}

// ---------------------------------------------------------------------------------------------
// Shared set-up
// ---------------------------------------------------------------------------------------------

/// Two connected RC QPs: `a` on `cq_a`, `b` on `cq_b`.
fn connected(
    pd: &ProtectionDomain,
    cq_a: &CompletionQueue,
    cq_b: &CompletionQueue,
) -> (QueuePair, QueuePair) {
    connected_with(pd, QpType::Rc, cq_a, cq_b, 128)
}

fn connected_with(
    pd: &ProtectionDomain,
    qp_type: QpType,
    cq_a: &CompletionQueue,
    cq_b: &CompletionQueue,
    sq_depth: u32,
) -> (QueuePair, QueuePair) {
    let mut ia = QpInitAttr::new(qp_type, cq_a, cq_a);
    ia.cap.max_send_wr = sq_depth;
    let a = pd.create_qp(&ia).unwrap();
    let b = pd.create_qp(&QpInitAttr::new(qp_type, cq_b, cq_b)).unwrap();
    if qp_type == QpType::Ud {
        a.ready_ud(QKEY, 0).unwrap();
        b.ready_ud(QKEY, 0).unwrap();
    } else {
        a.connect(&b.endpoint(100).unwrap(), 200, ALL_REMOTE)
            .unwrap();
        b.connect(&a.endpoint(200).unwrap(), 100, ALL_REMOTE)
            .unwrap();
    }
    (a, b)
}

/// A signaled 8-byte RDMA WRITE from `mr` into `mr` (a loop-back through `a`'s peer).
fn post_write(a: &QueuePair, mr: &MemoryRegion<'_>, wr_id: u64) {
    let s = [mr.sge(0..8)];
    a.post_send([SendWr::new(
        wr_id,
        SendOp::RdmaWrite {
            remote_addr: mr.iova() + 32,
            rkey: mr.rkey(),
        },
        &s,
    )
    .flags(SendFlags::SIGNALED)])
        .unwrap();
}

/// Spins until the CQ has a completion and returns a cursor on it (10 s at most).
fn wait_cursor(cq: &CompletionQueue) -> Cursor<'_> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(c) = cq.start_poll() {
            return c;
        }
        assert!(Instant::now() < deadline, "no completion within 10 s");
        std::thread::yield_now();
    }
}

fn assert_cq_empty(cq: &CompletionQueue, what: &str) {
    let mut wc = [WorkCompletion::default(); 4];
    let n = cq.poll(&mut wc);
    assert_eq!(n, 0, "{what}: unexpected completions {:?}", &wc[..n]);
}

// ---------------------------------------------------------------------------------------------
// 2. Every field, every opcode, every QP type, four APIs
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Classic,
    Compact,
    Cursor,
    Typed,
}

const APIS: [Api; 4] = [Api::Classic, Api::Compact, Api::Cursor, Api::Typed];

/// One completion as one API returned it: `None` for a field that API did not return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Rec {
    wr_id: u64,
    status: u32,
    opcode: u32,
    /// Output flags (GRH, IMM, ...).
    wc_flags: u32,
    /// Compact records only: the header's `WITH_*` bits.
    with: Option<u64>,
    byte_len: Option<u32>,
    imm: Option<u32>,
    qp_num: Option<u32>,
    src_qp: Option<u32>,
    slid: Option<u16>,
    sl: Option<u8>,
    dlid_path_bits: Option<u8>,
    ts: Option<u64>,
    wall: Option<u64>,
}

fn rec_classic(wc: &WorkCompletion) -> Rec {
    Rec {
        wr_id: wc.wr_id(),
        status: wc.status() as u32,
        opcode: wc.opcode() as u32,
        wc_flags: wc.wc_flags().bits(),
        with: None,
        byte_len: Some(wc.byte_len()),
        imm: wc.imm_data(),
        qp_num: Some(wc.qp_num()),
        src_qp: Some(wc.src_qp()),
        slid: Some(wc.slid()),
        sl: Some(wc.sl()),
        dlid_path_bits: Some(wc.dlid_path_bits()),
        ts: Some(wc.timestamp()),
        wall: None,
    }
}

fn rec_compact(rec: &[u8], cq_flags: u64) -> Rec {
    let h = compact::header(rec);
    assert_eq!(h.reserved, 0);
    assert_eq!(h.vendor_err, 0);
    let has = |f: S| h.wc_flags & f.bits() != 0;
    let g64 = |f: S| has(f).then(|| compact::get64(rec, cq_flags, f.bits()));
    let g32 = |f: S| has(f).then(|| compact::get32(rec, cq_flags, f.bits()));
    let g16 = |f: S| has(f).then(|| compact::get16(rec, cq_flags, f.bits()));
    let g8 = |f: S| has(f).then(|| compact::get8(rec, cq_flags, f.bits()));
    Rec {
        wr_id: h.wr_id,
        status: h.status,
        opcode: h.opcode,
        wc_flags: (h.wc_flags & compact::OUTPUT_FLAGS) as u32,
        with: Some(h.wc_flags & !compact::OUTPUT_FLAGS),
        byte_len: g32(S::WITH_BYTE_LEN),
        imm: g32(S::WITH_IMM).filter(|_| has(S::IMM)),
        qp_num: g32(S::WITH_QP_NUM),
        src_qp: g32(S::WITH_SRC_QP),
        slid: g16(S::WITH_SLID),
        sl: g8(S::WITH_SL),
        dlid_path_bits: g8(S::WITH_DLID_PATH_BITS),
        ts: g64(S::WITH_COMPLETION_TIMESTAMP),
        wall: g64(S::WITH_COMPLETION_TIMESTAMP_WALLCLOCK),
    }
}

fn rec_cursor(c: &Cursor<'_>) -> Rec {
    assert_eq!(c.is_ok(), c.status() == WcStatus::Success);
    Rec {
        wr_id: c.wr_id(),
        status: c.status() as u32,
        opcode: c.opcode() as u32,
        wc_flags: c.wc_flags().bits(),
        with: None,
        byte_len: c.byte_len(),
        imm: c.imm_data(),
        qp_num: c.qp_num(),
        src_qp: c.src_qp(),
        slid: c.slid(),
        sl: c.sl(),
        dlid_path_bits: c.dlid_path_bits(),
        ts: c.completion_ts(),
        wall: c.completion_wallclock_ns(),
    }
}

fn rec_typed(c: &TypedCursor<'_, { fields::ALL }>) -> Rec {
    assert_eq!(c.is_ok(), c.status() == WcStatus::Success);
    Rec {
        wr_id: c.wr_id(),
        status: c.status() as u32,
        opcode: c.opcode() as u32,
        wc_flags: c.wc_flags().bits(),
        with: None,
        byte_len: Some(c.byte_len()),
        imm: c.imm_data(),
        qp_num: Some(c.qp_num()),
        src_qp: Some(c.src_qp()),
        slid: Some(c.slid()),
        sl: Some(c.sl()),
        dlid_path_bits: Some(c.dlid_path_bits()),
        ts: Some(c.completion_ts()),
        wall: Some(c.completion_wallclock_ns()),
    }
}

/// One completion through `api`, or `None` when the CQ is empty.
fn try_one(api: Api, cq: &CompletionQueue) -> Option<Rec> {
    match api {
        Api::Classic => {
            let mut wc = [WorkCompletion::default()];
            (cq.poll(&mut wc) == 1).then(|| rec_classic(&wc[0]))
        }
        Api::Compact => {
            let size = cq.compact_record_size();
            // Room for two records, so a second completion would show (and fail the test).
            let mut buf = vec![0xa5u8; 2 * size];
            let n = cq
                .poll_ex(
                    &mut buf,
                    PollCqExAttr {
                        max_entries: 1,
                        comp_mask: 0,
                    },
                )
                .unwrap();
            assert!(n <= 1);
            assert!(
                buf[size..].iter().all(|&b| b == 0xa5),
                "poll_ex wrote past its one record"
            );
            (n == 1).then(|| rec_compact(&buf[..size], cq.compact_flags().bits()))
        }
        Api::Cursor => {
            let c = cq.start_poll()?;
            let r = rec_cursor(&c);
            c.end();
            Some(r)
        }
        Api::Typed => {
            let t = cq.typed::<{ fields::ALL }>().unwrap();
            let c = t.start_poll()?;
            let r = rec_typed(&c);
            c.end();
            Some(r)
        }
    }
}

fn poll_one(api: Api, cq: &CompletionQueue) -> Rec {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(r) = try_one(api, cq) {
            return r;
        }
        assert!(Instant::now() < deadline, "{api:?}: no completion in 10 s");
        std::thread::yield_now();
    }
}

/// What a completion must say.
#[derive(Debug, Clone, Copy)]
struct Exp {
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    recv: bool,
    byte_len: u32,
    imm: Option<u32>,
    qp_num: u32,
    src_qp: u32,
    slid: u16,
    sl: u8,
    dlid_path_bits: u8,
    wc_flags: WcFlags,
}

/// Raw device-clock and wall-clock readings taken around an operation.
struct Window {
    clock: DeviceClock,
    before: u64,
    after: u64,
    wall_before: u64,
    wall_after: u64,
}

impl Window {
    /// Runs `op` between readings of `ctx`'s clock (read as `clock`) and the wall clock.
    fn around<T>(ctx: &Context, clock: DeviceClock, op: impl FnOnce() -> T) -> (T, Window) {
        let wall_before = wall_now();
        let before = ctx.query_rt_values();
        let out = op();
        let after = ctx.query_rt_values();
        let wall_after = wall_now();
        let w = Window {
            clock,
            before,
            after,
            wall_before,
            wall_after,
        };
        (out, w)
    }
}

/// What the requester's completion of `wr_id` on QP `qp_num` must say: no receive-side
/// fields.
fn requester_exp(
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    qp_num: u32,
) -> Exp {
    Exp {
        wr_id,
        status,
        opcode,
        recv: false,
        byte_len,
        imm: None,
        qp_num,
        src_qp: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
        wc_flags: WcFlags::empty(),
    }
}

/// The seed fields only receive completions carry (computed here, not taken from the
/// library).
const RECV_ONLY_SEED: u64 = S::WITH_IMM.bits()
    | S::WITH_SRC_QP.bits()
    | S::WITH_PKEY_INDEX.bits()
    | S::WITH_SLID.bits()
    | S::WITH_SL.bits()
    | S::WITH_DLID_PATH_BITS.bits();

/// Slack allowed between the wall-clock field and `SystemTime::now` around the operation.
const WALL_SLACK_NS: u64 = 5_000_000;

fn check(api: Api, what: &str, got: &Rec, exp: &Exp, w: &Window, cq_seed_flags: u64) {
    let what = format!("{what} via {api:?}: {got:?}");
    let ok = exp.status == WcStatus::Success;
    assert_eq!(got.wr_id, exp.wr_id, "wr_id: {what}");
    assert_eq!(got.status, exp.status as u32, "status: {what}");
    if ok {
        assert_eq!(got.opcode, exp.opcode as u32, "opcode: {what}");
    }
    assert_eq!(got.wc_flags, exp.wc_flags.bits(), "wc_flags: {what}");
    assert_eq!(got.imm, exp.imm, "imm_data: {what}");
    assert_eq!(got.qp_num, Some(exp.qp_num), "qp_num: {what}");
    if ok {
        assert_eq!(got.byte_len, Some(exp.byte_len), "byte_len: {what}");
    }
    if ok && exp.recv {
        assert_eq!(got.src_qp, Some(exp.src_qp), "src_qp: {what}");
        assert_eq!(got.slid, Some(exp.slid), "slid: {what}");
        assert_eq!(got.sl, Some(exp.sl), "sl: {what}");
        assert_eq!(
            got.dlid_path_bits,
            Some(exp.dlid_path_bits),
            "dlid_path_bits: {what}"
        );
    }
    // The raw timestamp: non-zero and taken between the readings around the operation.
    let ts = got.ts.unwrap_or_else(|| panic!("no timestamp: {what}"));
    assert_ne!(ts, 0, "timestamp: {what}");
    assert!(ts <= w.clock.mask, "timestamp beyond the mask: {what}");
    assert!(
        w.clock.delta(w.before, ts) <= w.clock.delta(w.before, w.after),
        "timestamp {ts:#x} not within [{:#x}, {:#x}]: {what}",
        w.before,
        w.after
    );
    // Wall clock: every API but the classic one returns it.
    match (api, got.wall) {
        (Api::Classic, None) => {}
        (Api::Classic, Some(_)) => unreachable!(),
        (_, None) => panic!("no wall-clock field: {what}"),
        (_, Some(ns)) => assert!(
            ns + WALL_SLACK_NS >= w.wall_before && ns <= w.wall_after + WALL_SLACK_NS,
            "wall clock {ns} not within a few ms of [{}, {}]: {what}",
            w.wall_before,
            w.wall_after
        ),
    }
    // Compact records: exactly the fields valid on this completion are marked present.
    if api == Api::Compact {
        let fields = cq_seed_flags & !compact::OUTPUT_FLAGS;
        let want = if !ok {
            fields
                & (S::WITH_QP_NUM
                    | S::WITH_COMPLETION_TIMESTAMP
                    | S::WITH_COMPLETION_TIMESTAMP_WALLCLOCK)
                    .bits()
        } else if !exp.recv {
            fields & !RECV_ONLY_SEED
        } else {
            fields
        };
        assert_eq!(
            got.with,
            Some(want),
            "header WITH_* bits ({:?} wanted): {what}",
            S::from_bits_retain(want)
        );
        if !ok || !exp.recv {
            assert_eq!(
                (got.src_qp, got.slid, got.sl, got.dlid_path_bits),
                (None, None, None, None),
                "receive-only fields on a send or failed completion: {what}"
            );
        }
        if !ok {
            assert_eq!(
                got.byte_len, None,
                "byte_len on a failed completion: {what}"
            );
        }
    }
}

/// Asserts the records of the same completion polled through different APIs agree on every
/// field both returned (timestamps differ between runs and are checked per run).
fn agree(what: &str, recs: &[(Api, Rec)]) {
    let (api0, r0) = recs[0];
    for (api, r) in &recs[1..] {
        let what = format!("{what}: {api0:?} {r0:?} vs {api:?} {r:?}");
        assert_eq!(
            (r.wr_id, r.status, r.opcode, r.wc_flags, r.imm),
            (r0.wr_id, r0.status, r0.opcode, r0.wc_flags, r0.imm),
            "{what}"
        );
        fn both<T: PartialEq + std::fmt::Debug>(a: Option<T>, b: Option<T>, f: &str, what: &str) {
            if let (Some(a), Some(b)) = (a, b) {
                assert_eq!(a, b, "{f}: {what}");
            }
        }
        both(r.byte_len, r0.byte_len, "byte_len", &what);
        both(r.qp_num, r0.qp_num, "qp_num", &what);
        both(r.src_qp, r0.src_qp, "src_qp", &what);
        both(r.slid, r0.slid, "slid", &what);
        both(r.sl, r0.sl, "sl", &what);
        both(r.dlid_path_bits, r0.dlid_path_bits, "dlid_path_bits", &what);
    }
}

struct Rig {
    ctx: Context,
    pd: ProtectionDomain,
    cq_a: CompletionQueue,
    cq_b: CompletionQueue,
    a: QueuePair,
    b: QueuePair,
    link: LinkLayer,
}

/// Two QPs of `qp_type` on CQs returning every supported field.
fn rig(device: &Device, qp_type: QpType) -> Rig {
    let ctx = device.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let attr = CqInitAttrEx::new(64).wc_flags(WcExFlags::SUPPORTED);
    let cq_a = ctx.create_cq_ex(&attr).unwrap();
    let cq_b = ctx.create_cq_ex(&attr).unwrap();
    let (a, b) = connected_with(&pd, qp_type, &cq_a, &cq_b, 128);
    let link = ctx.query_port(1).unwrap().link_layer;
    Rig {
        ctx,
        pd,
        cq_a,
        cq_b,
        a,
        b,
        link,
    }
}

/// One operation of the matrix: what to post and what the receive side sees.
struct Case {
    name: &'static str,
    op: SendOp,
    /// Local bytes (an offset range in the source MR).
    local: std::ops::Range<usize>,
    send_opcode: WcOpcode,
    /// Receive completion: its opcode and immediate data.
    recv: Option<(WcOpcode, Option<u32>)>,
}

const LEN: usize = 24;
const UD_SL: u8 = 5;

fn cases(qp_type: QpType, dst: &MemoryRegion<'_>) -> Vec<Case> {
    let (addr, rkey) = (dst.iova(), dst.rkey());
    let mut v = vec![
        Case {
            name: "SEND",
            op: SendOp::Send,
            local: 0..LEN,
            send_opcode: WcOpcode::Send,
            recv: Some((WcOpcode::Recv, None)),
        },
        Case {
            name: "SEND_WITH_IMM",
            op: SendOp::SendWithImm { imm: 0x8765_4321 },
            local: 0..LEN,
            send_opcode: WcOpcode::Send,
            recv: Some((WcOpcode::Recv, Some(0x8765_4321))),
        },
    ];
    if qp_type == QpType::Ud {
        return v;
    }
    v.push(Case {
        name: "RDMA_WRITE",
        op: SendOp::RdmaWrite {
            remote_addr: addr + 1024,
            rkey,
        },
        local: 0..LEN,
        send_opcode: WcOpcode::RdmaWrite,
        recv: None,
    });
    v.push(Case {
        name: "RDMA_WRITE_WITH_IMM",
        op: SendOp::RdmaWriteWithImm {
            remote_addr: addr + 1024,
            rkey,
            imm: 0x0bad_cafe,
        },
        local: 0..LEN,
        send_opcode: WcOpcode::RdmaWrite,
        recv: Some((WcOpcode::RecvRdmaWithImm, Some(0x0bad_cafe))),
    });
    if qp_type == QpType::Uc {
        return v;
    }
    v.push(Case {
        name: "RDMA_READ",
        op: SendOp::RdmaRead {
            remote_addr: addr + 2048,
            rkey,
        },
        local: 256..256 + LEN,
        send_opcode: WcOpcode::RdmaRead,
        recv: None,
    });
    v.push(Case {
        name: "ATOMIC_CMP_AND_SWP",
        op: SendOp::CmpSwap {
            remote_addr: addr + 3072,
            rkey,
            compare: 0,
            swap: 0,
        },
        local: 512..520,
        send_opcode: WcOpcode::CompSwap,
        recv: None,
    });
    v.push(Case {
        name: "ATOMIC_FETCH_AND_ADD",
        op: SendOp::FetchAdd {
            remote_addr: addr + 3072,
            rkey,
            add: 1,
        },
        local: 512..520,
        send_opcode: WcOpcode::FetchAdd,
        recv: None,
    });
    v
}

fn every_field_on(device: &Device) {
    for qp_type in [QpType::Rc, QpType::Uc, QpType::Ud] {
        let r = rig(device, qp_type);
        let clock = r.ctx.clock();
        let seed_flags = r.cq_a.compact_flags().bits();
        assert_eq!(r.cq_b.compact_flags().bits(), seed_flags);
        let src = r.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
        let dst = r.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
        let (ah, ah_grh) = if qp_type == QpType::Ud {
            let mut attr = address_vector(r.link, &r.b.endpoint(0).unwrap());
            // A service level the receiver must report (RC/UC paths use SL 0).
            attr.sl = UD_SL;
            (Some(r.pd.create_ah(&attr).unwrap()), attr.grh.is_some())
        } else {
            (None, false)
        };
        let port = r.ctx.query_port(1).unwrap();
        let slid = match r.link {
            LinkLayer::InfiniBand => port.lid,
            LinkLayer::Ethernet => 0,
        };
        for (ci, case) in cases(qp_type, &dst).into_iter().enumerate() {
            let what = format!("{} {qp_type:?} {}", device.name(), case.name);
            let send_id = 0x5e00 + ci as u64;
            let recv_id = 0x7e00 + ci as u64;
            let len = case.local.len() as u32;
            let send_exp = requester_exp(
                send_id,
                WcStatus::Success,
                case.send_opcode,
                len,
                r.a.qp_num(),
            );
            let recv_exp = case.recv.map(|(opcode, imm)| {
                let mut wc_flags = WcFlags::empty();
                if imm.is_some() {
                    wc_flags |= WcFlags::WITH_IMM;
                }
                if ah_grh {
                    wc_flags |= WcFlags::GRH;
                }
                Exp {
                    wr_id: recv_id,
                    status: WcStatus::Success,
                    opcode,
                    recv: true,
                    byte_len: len
                        + if qp_type == QpType::Ud {
                            GRH_LEN as u32
                        } else {
                            0
                        },
                    imm,
                    qp_num: r.b.qp_num(),
                    src_qp: r.a.qp_num(),
                    slid,
                    sl: if qp_type == QpType::Ud { UD_SL } else { 0 },
                    dlid_path_bits: 0,
                    wc_flags,
                }
            });
            let mut sends = Vec::new();
            let mut recvs = Vec::new();
            for api in APIS {
                if case.recv.is_some() {
                    r.b.post_recv([RecvWr::new(recv_id, &[dst.sge(0..GRH_LEN + 64)])])
                        .unwrap();
                }
                let sges = [src.sge(case.local.clone())];
                let mut wr = SendWr::new(send_id, case.op, &sges).flags(SendFlags::SIGNALED);
                if let Some(ah) = &ah {
                    wr = wr.ud(ah, r.b.qp_num(), QKEY);
                }
                let ((send, recv), w) = Window::around(&r.ctx, clock, || {
                    r.a.post_send([wr]).unwrap();
                    let send = poll_one(api, &r.cq_a);
                    (send, case.recv.map(|_| poll_one(api, &r.cq_b)))
                });
                check(api, &what, &send, &send_exp, &w, seed_flags);
                sends.push((api, send));
                if let (Some(recv), Some(exp)) = (recv, &recv_exp) {
                    check(
                        api,
                        &format!("{what} (receive)"),
                        &recv,
                        exp,
                        &w,
                        seed_flags,
                    );
                    recvs.push((api, recv));
                }
                assert_cq_empty(&r.cq_a, &what);
                assert_cq_empty(&r.cq_b, &what);
            }
            agree(&what, &sends);
            if !recvs.is_empty() {
                agree(&format!("{what} (receive)"), &recvs);
            }
        }
    }
}

#[test]
fn every_field_of_every_opcode_and_qp_type_through_all_four_apis_roce() {
    let device = default_device();
    assert_eq!(
        device.open().unwrap().query_port(1).unwrap().link_layer,
        LinkLayer::Ethernet
    );
    every_field_on(&device);
}

#[test]
fn every_field_of_every_opcode_and_qp_type_through_all_four_apis_infiniband() {
    let device = Device::builder()
        .name("cqex-ib")
        .link_layer(LinkLayer::InfiniBand)
        .lid(0x17)
        .gid("fe80::5ce1".parse().unwrap())
        .build()
        .unwrap();
    assert_eq!(device.open().unwrap().query_port(1).unwrap().lid, 0x17);
    every_field_on(&device);
}

#[test]
fn failed_completions_carry_only_qp_num_and_timestamps() {
    for api in APIS {
        let r = rig(&default_device(), QpType::Rc);
        let clock = r.ctx.clock();
        let seed_flags = r.cq_a.compact_flags().bits();
        let src = r.pd.alloc_mr(64, ALL_REMOTE).unwrap();
        let dst = r.pd.alloc_mr(64, ALL_REMOTE).unwrap();
        let s = [src.sge(0..16)];
        let (got, w) = Window::around(&r.ctx, clock, || {
            r.a.post_send([SendWr::new(
                0xbad,
                SendOp::RdmaRead {
                    remote_addr: dst.iova(),
                    rkey: dst.rkey() ^ 0x5a5a_0000,
                },
                &s,
            )
            .flags(SendFlags::SIGNALED)])
                .unwrap();
            poll_one(api, &r.cq_a)
        });
        assert_ne!(got.status, WcStatus::Success as u32, "{api:?}: {got:?}");
        let status = WcStatus::from_raw(got.status).unwrap();
        assert!(
            matches!(status, WcStatus::RemAccessErr | WcStatus::RemInvReqErr),
            "{api:?}: {status:?}"
        );
        let exp = requester_exp(0xbad, status, WcOpcode::RdmaRead, 0, r.a.qp_num());
        check(api, "READ with a bad rkey", &got, &exp, &w, seed_flags);
        // The QP is in error now: a later request is flushed, and that completion too carries
        // only the QP number and timestamps.
        let before = r.ctx.query_rt_values();
        r.a.post_send([SendWr::new(0xf1, SendOp::Send, &s).flags(SendFlags::SIGNALED)])
            .unwrap();
        let got = poll_one(api, &r.cq_a);
        let w = Window {
            before,
            after: r.ctx.query_rt_values(),
            wall_after: wall_now(),
            ..w
        };
        let exp = Exp {
            wr_id: 0xf1,
            status: WcStatus::WrFlushErr,
            ..exp
        };
        check(api, "flushed SEND", &got, &exp, &w, seed_flags);
    }
}

/// A CQ made with any subset of the supported fields reports the seed flags of exactly those
/// fields, and its records are `get_size` bytes.
#[test]
fn compact_flags_and_record_size_for_every_field_subset() {
    let ctx = ctx();
    // softverbs' WcExFlags → the seed's bits, written out independently.
    let map: [(WcExFlags, u64); 9] = [
        (WcExFlags::BYTE_LEN, 1 << 4),
        (WcExFlags::IMM, 1 << 5),
        (WcExFlags::QP_NUM, 1 << 6),
        (WcExFlags::SRC_QP, 1 << 7),
        (WcExFlags::SLID, 1 << 9),
        (WcExFlags::SL, 1 << 10),
        (WcExFlags::DLID_PATH_BITS, 1 << 11),
        (WcExFlags::COMPLETION_TIMESTAMP, 1 << 12),
        (WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK, 1 << 13),
    ];
    for subset in 0u32..1 << map.len() {
        let (mut ex, mut seed) = (WcExFlags::empty(), 0u64);
        for (i, (e, s)) in map.iter().enumerate() {
            if subset & (1 << i) != 0 {
                ex |= *e;
                seed |= s;
            }
        }
        let cq = ctx
            .create_cq_ex(&CqInitAttrEx::new(4).wc_flags(ex))
            .unwrap();
        assert_eq!(cq.compact_flags().bits(), seed, "{ex:?}");
        assert_eq!(cq.compact_record_size(), model_size(seed), "{ex:?}");
    }
}

/// poll_ex: a non-zero comp_mask is EINVAL, a buffer too short for one record returns nothing
/// and consumes nothing, and several records come back to back in order.
#[test]
fn poll_ex_argument_checks_and_batches() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let flags = WcExFlags::BYTE_LEN | WcExFlags::QP_NUM | WcExFlags::COMPLETION_TIMESTAMP;
    let cq = ctx
        .create_cq_ex(&CqInitAttrEx::new(32).wc_flags(flags))
        .unwrap();
    let (a, _b) = connected(&pd, &cq, &cq);
    let mr = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let size = cq.compact_record_size();
    let f = cq.compact_flags().bits();
    assert_eq!(size, 32 + 8 + 4 + 4);
    for i in 0..5 {
        post_write(&a, &mr, 100 + i);
    }
    let mut buf = vec![0u8; 16 * size];
    let attr = |max_entries| PollCqExAttr {
        max_entries,
        comp_mask: 0,
    };
    assert_eq!(
        errno(
            cq.poll_ex(
                &mut buf,
                PollCqExAttr {
                    max_entries: 16,
                    comp_mask: 1
                }
            ),
            "poll_ex comp_mask"
        ),
        EINVAL
    );
    assert_eq!(cq.poll_ex(&mut buf[..size - 1], attr(16)).unwrap(), 0);
    assert_eq!(cq.poll_ex(&mut buf, attr(0)).unwrap(), 0);
    // Two fit in the buffer though four are asked for.
    assert_eq!(cq.poll_ex(&mut buf[..2 * size + 7], attr(4)).unwrap(), 2);
    let mut ids: Vec<u64> = buf
        .chunks_exact(size)
        .take(2)
        .map(|r| compact::header(r).wr_id)
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while ids.len() < 5 {
        let n = cq.poll_ex(&mut buf, attr(16)).unwrap();
        for rec in buf.chunks_exact(size).take(n) {
            let h = compact::header(rec);
            assert_eq!(h.status, 0);
            assert_eq!(h.opcode, WcOpcode::RdmaWrite as u32);
            assert_eq!(compact::get32(rec, f, S::WITH_BYTE_LEN.bits()), 8);
            assert_eq!(compact::get32(rec, f, S::WITH_QP_NUM.bits()), a.qp_num());
            assert_ne!(
                compact::get64(rec, f, S::WITH_COMPLETION_TIMESTAMP.bits()),
                0
            );
            ids.push(h.wr_id);
        }
        assert!(Instant::now() < deadline);
    }
    assert_eq!(ids, vec![100, 101, 102, 103, 104]);
    assert_cq_empty(&cq, "after poll_ex");
}

// ---------------------------------------------------------------------------------------------
// 3. The compact layout against an independent computation
// ---------------------------------------------------------------------------------------------

/// The seed's fields: (bit, width in bytes), in the order the seed's comment lists them.
const FIELD_TABLE: [(u32, usize); 10] = [
    (12, 8), // completion_timestamp
    (13, 8), // completion_timestamp_wallclock (softverbs, after the seed's 64-bit field)
    (4, 4),  // byte_len
    (5, 4),  // imm_data
    (6, 4),  // qp_num
    (7, 4),  // src_qp
    (8, 2),  // pkey_index
    (9, 2),  // slid
    (10, 1), // sl
    (11, 1), // dlid_path_bits
];

/// Field offsets (after the header) and the record size, by laying the record out: the
/// present fields sorted by width, widest first, then by bit; each placed where the previous
/// one ended.
fn model_layout(flags: u64) -> (Vec<(u32, usize, usize)>, usize) {
    let mut present: Vec<(u32, usize)> = FIELD_TABLE
        .iter()
        .copied()
        .filter(|(bit, _)| flags & (1u64 << bit) != 0)
        .collect();
    present.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut at = 0;
    let mut out = Vec::new();
    for (bit, width) in present {
        out.push((bit, at, width));
        at += width;
    }
    let padded = at.div_ceil(8) * 8;
    (out, padded + 32)
}

fn model_size(flags: u64) -> usize {
    model_layout(flags).1
}

/// The library's offset of the field `bit` of `width` bytes.
fn lib_offset(flags: u64, bit: u32, width: usize) -> usize {
    let flag = 1u64 << bit;
    match width {
        8 => compact::get_offsetof64(flags, flag),
        4 => compact::get_offsetof32(flags, flag),
        2 => compact::get_offsetof16(flags, flag),
        1 => compact::get_offsetof8(flags, flag),
        _ => unreachable!(),
    }
}

fn check_layout(flags: u64) {
    let (fields, size) = model_layout(flags);
    assert_eq!(compact::get_size(flags), size, "get_size({flags:#x})");
    assert_eq!(size % 8, 0);
    for &(bit, off, width) in &fields {
        assert_eq!(
            lib_offset(flags, bit, width),
            off,
            "offset of bit {bit} in {flags:#x}"
        );
        // Every field is naturally aligned (the header is 32 bytes).
        assert_eq!((32 + off) % width, 0, "bit {bit} misaligned in {flags:#x}");
        assert!(
            32 + off + width <= size,
            "bit {bit} past the end in {flags:#x}"
        );
    }
    // No two fields overlap.
    for (i, &(b1, o1, w1)) in fields.iter().enumerate() {
        for &(b2, o2, w2) in &fields[i + 1..] {
            assert!(
                o1 + w1 <= o2 || o2 + w2 <= o1,
                "bits {b1} and {b2} overlap in {flags:#x}"
            );
        }
    }
    // Output bits and bits outside the seed's fields change nothing.
    let known = flags & 0x3ff0;
    assert_eq!(compact::get_size(known), size);
    if let Some(&(bit, off, width)) = fields.first() {
        assert_eq!(lib_offset(known, bit, width), off);
    }
}

#[test]
fn compact_layout_matches_the_model_for_every_combination_of_fields() {
    for combo in 0u64..1 << 10 {
        let flags = combo << 4;
        check_layout(flags);
        check_layout(flags | 0xf);
    }
    // Spot values worked out by hand from the seed's formulas.
    assert_eq!(compact::get_size(0), 32);
    assert_eq!(compact::get_size(S::WITH_SL.bits()), 40);
    // 2 × 8 + 4 × 4 + 2 × 2 + 2 × 1 = 38 bytes of fields, padded to 40.
    assert_eq!(compact::get_size(0x3ff0), 72);
}

/// A completion built from random words.
fn cqe_from(r: [u64; 4], opcode: u8, status: u8) -> Cqe {
    Cqe {
        wr_id: r[0],
        timestamp: r[1] & 0xffff_ffff_ffff,
        byte_len: r[2] as u32,
        imm_data: (r[2] >> 32) as u32,
        qp_num: r[3] as u32,
        src_qp: (r[3] >> 32) as u32,
        vendor_err: (r[1] >> 11) as u32,
        wqe_seq: 0,
        slid: (r[0] >> 48) as u16,
        pkey_index: (r[0] >> 32) as u16,
        status,
        opcode,
        wc_flags: (r[0] & 0xf) as u8,
        sl: (r[1] >> 56) as u8,
        dlid_path_bits: (r[1] >> 48) as u8,
        solicited: 0,
        _reserved: [0; 6],
    }
}

fn check_fill(flags: u64, cqe: &Cqe) {
    let layout = compact::Layout::new(S::from_bits_retain(flags));
    let size = layout.size();
    let (fields, model) = model_layout(flags);
    assert_eq!(size, model);
    let wall = softverbs::nic::clock::Clock::new(48).wall();
    let mut buf = vec![0xeeu8; size + 24];
    layout.fill(&mut buf, cqe, Some(&wall));
    assert!(
        buf[size..].iter().all(|&b| b == 0xee),
        "fill wrote past the record ({flags:#x})"
    );
    let rec = &buf[..size];
    let h = compact::header(rec);
    // Which fields this completion carries, worked out here.
    let fields_in_cq = flags & 0x3ff0;
    let valid = if cqe.status != 0 {
        fields_in_cq & ((1 << 6) | (1 << 12) | (1 << 13))
    } else if cqe.opcode & 0x80 == 0 {
        fields_in_cq & !((1 << 5) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11))
    } else {
        fields_in_cq
    };
    let what = format!("flags {flags:#x}, {cqe:?}");
    assert_eq!(h.wr_id, cqe.wr_id, "{what}");
    assert_eq!(h.status, u32::from(cqe.status), "{what}");
    assert_eq!(h.opcode, u32::from(cqe.opcode), "{what}");
    assert_eq!(h.vendor_err, cqe.vendor_err, "{what}");
    assert_eq!(h.reserved, 0, "{what}");
    assert_eq!(
        h.wc_flags,
        valid | u64::from(cqe.wc_flags & 0xf),
        "header wc_flags: {what}"
    );
    // Each valid field reads back through the seed's getters (which use `flags`, the CQ's
    // creation flags, as a C program would) and lies where the model says.
    let f = flags;
    let mut covered = vec![false; size];
    for &(bit, off, width) in &fields {
        let flag = 1u64 << bit;
        let at = 32 + off;
        let bytes = &rec[at..at + width];
        let got: u64 = match width {
            8 => compact::get64(rec, f, flag),
            4 => u64::from(compact::get32(rec, f, flag)),
            2 => u64::from(compact::get16(rec, f, flag)),
            1 => u64::from(compact::get8(rec, f, flag)),
            _ => unreachable!(),
        };
        let mut le = [0u8; 8];
        le[..width].copy_from_slice(bytes);
        assert_eq!(
            got,
            u64::from_ne_bytes(le),
            "bit {bit} read elsewhere: {what}"
        );
        covered[at..at + width].iter_mut().for_each(|c| *c = true);
        if valid & flag == 0 {
            continue;
        }
        let want: u64 = match bit {
            4 => u64::from(cqe.byte_len),
            5 => u64::from(cqe.imm_data),
            6 => u64::from(cqe.qp_num),
            7 => u64::from(cqe.src_qp),
            8 => u64::from(cqe.pkey_index),
            9 => u64::from(cqe.slid),
            10 => u64::from(cqe.sl),
            11 => u64::from(cqe.dlid_path_bits),
            12 => cqe.timestamp,
            13 => wall.ns(cqe.timestamp),
            _ => unreachable!(),
        };
        assert_eq!(got, want, "bit {bit}: {what}");
    }
    // Padding is zero.
    for (i, c) in covered.iter().enumerate().skip(32) {
        if !c {
            assert_eq!(rec[i], 0, "padding byte {i} not zero: {what}");
        }
    }
}

#[test]
fn fill_places_every_field_where_the_getters_read_it_for_every_combination() {
    let r = [
        0x0123_4567_89ab_cdef,
        0xfedc_ba98_7654_3210,
        0x1111_2222_3333_4444,
        0x5555_6666_7777_8888,
    ];
    for combo in 0u64..1 << 10 {
        let flags = combo << 4;
        for (opcode, status) in [(0u8, 0u8), (2, 0), (128, 0), (129, 0), (1, 5), (128, 5)] {
            check_fill(flags, &cqe_from(r, opcode, status));
        }
    }
}

fn opcode_strategy() -> impl Strategy<Value = u8> {
    prop_oneof![0u8..=4, Just(128u8), Just(129u8)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn compact_layout_matches_the_model_for_random_flags(flags in any::<u64>()) {
        check_layout(flags);
    }

    #[test]
    fn fill_round_trips_random_completions(
        combo in 0u64..1 << 10,
        output in 0u64..16,
        r in any::<[u64; 4]>(),
        opcode in opcode_strategy(),
        failed in any::<bool>(),
    ) {
        let status = if failed { 1 + (r[3] % 20) as u8 } else { 0 };
        check_fill(combo << 4 | output, &cqe_from(r, opcode, status));
    }

    /// Creation flags with bits outside the seed's fields (as a C caller could pass to the
    /// getters): records are laid out and marked as if those bits were absent.
    #[test]
    fn fill_ignores_bits_outside_the_seeds_fields(
        flags in any::<u64>(),
        r in any::<[u64; 4]>(),
        opcode in opcode_strategy(),
    ) {
        check_fill(flags, &cqe_from(r, opcode, 0));
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Cursor semantics
// ---------------------------------------------------------------------------------------------

struct Loop {
    ctx: Context,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    a: QueuePair,
    _b: QueuePair,
    mr: MemoryRegion<'static>,
}

/// An RC pair whose sender completes on `cq` (created with `wc_flags`).
fn write_loop(wc_flags: WcExFlags, sq_depth: u32) -> Loop {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx
        .create_cq_ex(&CqInitAttrEx::new(64).wc_flags(wc_flags))
        .unwrap();
    let other = ctx.create_cq(16, None).unwrap();
    let (a, b) = connected_with(&pd, QpType::Rc, &cq, &other, sq_depth);
    let mr = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    Loop {
        ctx,
        _pd: pd,
        cq,
        a,
        _b: b,
        mr,
    }
}

impl Loop {
    fn write(&self, ids: impl IntoIterator<Item = u64>) {
        for id in ids {
            post_write(&self.a, &self.mr, id);
        }
    }

    /// Gives the writes posted a moment to complete, without polling (the software NIC
    /// completes a loop-back write within `post_send`; this only avoids relying on it).
    fn settle(&self) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn classic_ids(cq: &CompletionQueue) -> Vec<u64> {
    let mut wc = [WorkCompletion::default(); 32];
    let n = cq.poll(&mut wc);
    wc[..n].iter().map(|w| w.wr_id()).collect()
}

#[test]
fn start_poll_on_an_empty_cq_is_none() {
    let l = write_loop(WcExFlags::SUPPORTED, 16);
    assert!(l.cq.start_poll().is_none());
    let t = l.cq.typed::<{ fields::ALL }>().unwrap();
    assert!(t.start_poll().is_none());
    // Still none after a full poll cycle.
    l.write([1]);
    l.settle();
    let c = l.cq.start_poll().unwrap();
    assert_eq!(c.wr_id(), 1);
    c.end();
    assert!(l.cq.start_poll().is_none());
    assert!(t.start_poll().is_none());
}

#[test]
fn next_is_false_at_the_end_and_a_new_section_sees_later_completions() {
    let l = write_loop(WcExFlags::SUPPORTED, 16);
    l.write(0..3);
    l.settle();
    let mut c = l.cq.start_poll().unwrap();
    let mut ids = vec![c.wr_id()];
    while c.next() {
        ids.push(c.wr_id());
    }
    assert_eq!(ids, vec![0, 1, 2]);
    assert!(!c.next(), "next() after the end must stay false");
    c.end();
    assert!(l.cq.start_poll().is_none());

    l.write(3..5);
    l.settle();
    let t =
        l.cq.typed::<{ fields::BYTE_LEN | fields::QP_NUM }>()
            .unwrap();
    let mut c = t.start_poll().expect("later completions");
    let mut ids = vec![(c.wr_id(), c.byte_len(), c.qp_num())];
    while c.next() {
        ids.push((c.wr_id(), c.byte_len(), c.qp_num()));
    }
    c.end();
    let q = l.a.qp_num();
    assert_eq!(ids, vec![(3, 8, q), (4, 8, q)]);
    assert!(t.start_poll().is_none());

    // A section whose next() failed, then more completions, then a new section.
    l.write([5]);
    l.settle();
    let mut c = l.cq.start_poll().unwrap();
    assert_eq!(c.wr_id(), 5);
    assert!(!c.next());
    drop(c);
    l.write([6]);
    l.settle();
    let c = l.cq.start_poll().unwrap();
    assert_eq!(c.wr_id(), 6);
    c.end();
    assert_cq_empty(&l.cq, "after the last section");
}

#[test]
fn completions_read_by_a_cursor_are_consumed() {
    let l = write_loop(WcExFlags::SUPPORTED, 16);
    l.write(0..4);
    l.settle();
    let mut c = l.cq.start_poll().unwrap();
    assert_eq!(c.wr_id(), 0);
    assert!(c.next());
    assert_eq!(c.wr_id(), 1);
    c.end();
    assert_eq!(classic_ids(&l.cq), vec![2, 3]);

    l.write(4..6);
    l.settle();
    let t = l.cq.typed::<{ fields::NONE }>().unwrap();
    let mut c = t.start_poll().unwrap();
    assert_eq!(c.wr_id(), 4);
    assert!(c.next());
    assert_eq!(c.wr_id(), 5);
    assert!(!c.next());
    c.end();
    assert_eq!(classic_ids(&l.cq), Vec::<u64>::new());
}

#[test]
fn dropping_a_cursor_midway_leaves_the_rest_in_order() {
    for variant in 0..3 {
        let l = write_loop(WcExFlags::SUPPORTED, 32);
        l.write(0..8);
        l.settle();
        {
            let mut c = l.cq.start_poll().unwrap();
            assert_eq!(c.wr_id(), 0);
            assert!(c.next());
            assert!(c.next());
            assert_eq!(c.wr_id(), 2);
            // Dropped here, holding completion 2: it is consumed, 3.. stay.
        }
        l.write(8..10);
        l.settle();
        let rest: Vec<u64> = match variant {
            0 => classic_ids(&l.cq),
            1 => {
                let size = l.cq.compact_record_size();
                let mut buf = vec![0u8; 32 * size];
                let n =
                    l.cq.poll_ex(
                        &mut buf,
                        PollCqExAttr {
                            max_entries: 32,
                            comp_mask: 0,
                        },
                    )
                    .unwrap();
                buf.chunks_exact(size)
                    .take(n)
                    .map(|r| compact::header(r).wr_id)
                    .collect()
            }
            _ => {
                let t = l.cq.typed::<{ fields::ALL }>().unwrap();
                let mut c = t.start_poll().unwrap();
                let mut v = vec![c.wr_id()];
                while c.next() {
                    v.push(c.wr_id());
                }
                v
            }
        };
        assert_eq!(rest, (3..10).collect::<Vec<_>>(), "variant {variant}");
        assert_cq_empty(&l.cq, "after the rest");
    }
}

#[test]
fn polling_with_the_cursor_frees_send_queue_slots() {
    const DEPTH: u32 = 4;
    let l = write_loop(WcExFlags::SUPPORTED, DEPTH);
    // The SQ really is DEPTH deep and completions hold their slots until polled.
    l.write(0..u64::from(DEPTH));
    l.settle();
    let s = [l.mr.sge(0..8)];
    let extra = SendWr::new(
        99,
        SendOp::RdmaWrite {
            remote_addr: l.mr.iova() + 32,
            rkey: l.mr.rkey(),
        },
        &s,
    )
    .flags(SendFlags::SIGNALED);
    assert!(
        l.a.post_send([extra]).is_err(),
        "a full send queue accepted another request"
    );
    let mut next_id = u64::from(DEPTH);
    let mut seen = 0u64;
    let t = l.cq.typed::<{ fields::COMPLETION_TIMESTAMP }>().unwrap();
    // 50 rounds, 200 requests through a 4-deep SQ, every completion polled by a cursor.
    for round in 0..50 {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = 0;
        while got < DEPTH {
            if round % 2 == 0 {
                if let Some(mut c) = l.cq.start_poll() {
                    loop {
                        assert_eq!(c.wr_id(), seen, "round {round}");
                        assert_eq!(c.status(), WcStatus::Success);
                        seen += 1;
                        got += 1;
                        if !c.next() {
                            break;
                        }
                    }
                }
            } else if let Some(mut c) = t.start_poll() {
                loop {
                    assert_eq!(c.wr_id(), seen, "round {round}");
                    assert!(c.is_ok());
                    assert_ne!(c.completion_ts(), 0);
                    seen += 1;
                    got += 1;
                    if !c.next() {
                        break;
                    }
                }
            }
            assert!(Instant::now() < deadline, "round {round}: {got} of {DEPTH}");
        }
        assert_eq!(got, DEPTH);
        for _ in 0..DEPTH {
            post_write(&l.a, &l.mr, next_id);
            next_id += 1;
        }
    }
    assert_eq!(seen, 50 * u64::from(DEPTH));
}

#[test]
fn typed_with_a_field_the_cq_lacks_is_einval() {
    let l = write_loop(WcExFlags::BYTE_LEN | WcExFlags::QP_NUM, 16);
    fn typed_errno<const F: u64>(cq: &CompletionQueue) -> Option<i32> {
        cq.typed::<F>().err().map(|e| e.errno())
    }
    assert_eq!(typed_errno::<{ fields::NONE }>(&l.cq), None);
    assert_eq!(typed_errno::<{ fields::BYTE_LEN }>(&l.cq), None);
    assert_eq!(
        typed_errno::<{ fields::BYTE_LEN | fields::QP_NUM }>(&l.cq),
        None
    );
    assert_eq!(
        typed_errno::<{ fields::BYTE_LEN | fields::COMPLETION_TIMESTAMP }>(&l.cq),
        Some(EINVAL)
    );
    assert_eq!(
        typed_errno::<{ fields::COMPLETION_TIMESTAMP_WALLCLOCK }>(&l.cq),
        Some(EINVAL)
    );
    assert_eq!(typed_errno::<{ fields::ALL }>(&l.cq), Some(EINVAL));
    // A classic CQ has the standard fields, not the timestamps.
    let classic = l.ctx.create_cq(4, None).unwrap();
    assert_eq!(typed_errno::<{ fields::SLID | fields::SL }>(&classic), None);
    assert_eq!(
        typed_errno::<{ fields::COMPLETION_TIMESTAMP }>(&classic),
        Some(EINVAL)
    );

    // The untyped cursor's readers of absent fields return None.
    l.write([1]);
    l.settle();
    let c = l.cq.start_poll().unwrap();
    assert_eq!(c.byte_len(), Some(8));
    assert_eq!(c.qp_num(), Some(l.a.qp_num()));
    assert_eq!(
        (
            c.imm_data(),
            c.src_qp(),
            c.slid(),
            c.sl(),
            c.dlid_path_bits()
        ),
        (None, None, None, None, None)
    );
    assert_eq!(
        (c.completion_ts(), c.completion_wallclock_ns()),
        (None, None)
    );
    // The whole completion is still there for those who want it, but without the time: a
    // CQ without a timestamp field is not stamped.
    let wc = c.work_completion();
    assert_eq!((wc.wr_id(), wc.byte_len()), (1, 8));
    assert_eq!(wc.timestamp(), 0);
}
