//! Completion timestamps and the device clock: every completion of a CQ created with a
//! timestamp field is stamped (and none of a CQ without one), the stamps follow the OS
//! monotonic clock, wrap-around of a narrow clock is handled, and the clock read with
//! `query_rt_values` is the one the completions are stamped with.

use softverbs::*;
use std::time::{Duration, Instant};

const ALL_REMOTE: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

struct Pair {
    ctx: Context,
    pd: ProtectionDomain,
    cq_a: CompletionQueue,
    cq_b: CompletionQueue,
    a: QueuePair,
    b: QueuePair,
}

fn ctx_on(device: &Device) -> Context {
    device.open().expect("open")
}

fn default_device() -> Device {
    devices().expect("device list")[0].clone()
}

/// Two QPs of `qp_type`, each with its own CQ that has the completion timestamp: connected
/// (RC, UC) or ready (UD).
fn pair(device: &Device, qp_type: QpType) -> Pair {
    pair_with(device, qp_type, WcExFlags::COMPLETION_TIMESTAMP)
}

/// [`pair`] with CQs of `wc_flags` (beside the standard fields).
fn pair_with(device: &Device, qp_type: QpType, wc_flags: WcExFlags) -> Pair {
    let ctx = ctx_on(device);
    let pd = ctx.alloc_pd().unwrap();
    let attr = CqInitAttrEx::new(256).wc_flags(WcExFlags::STANDARD | wc_flags);
    let cq_a = ctx.create_cq_ex(&attr).unwrap();
    let cq_b = ctx.create_cq_ex(&attr).unwrap();
    let a = pd
        .create_qp(&QpInitAttr::new(qp_type, &cq_a, &cq_a))
        .unwrap();
    let b = pd
        .create_qp(&QpInitAttr::new(qp_type, &cq_b, &cq_b))
        .unwrap();
    if qp_type == QpType::Ud {
        a.ready_ud(0x1111, 0).unwrap();
        b.ready_ud(0x1111, 0).unwrap();
    } else {
        a.connect(&b.endpoint(100).unwrap(), 200, ALL_REMOTE)
            .unwrap();
        b.connect(&a.endpoint(200).unwrap(), 100, ALL_REMOTE)
            .unwrap();
    }
    Pair {
        ctx,
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

/// Polls one completion in a tight loop (no yield, so the polling delay stays small), for
/// at most ten seconds.
fn poll_one(cq: &CompletionQueue) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wc = [WorkCompletion::default()];
    let mut spins = 0u32;
    loop {
        if cq.poll(&mut wc) == 1 {
            assert!(wc[0].is_ok(), "{:?}", wc[0]);
            return wc[0];
        }
        spins = spins.wrapping_add(1);
        if spins % 4096 == 0 {
            assert!(Instant::now() < deadline, "no completion within 10 s");
        }
        std::hint::spin_loop();
    }
}

/// Asserts `ts` lies between the raw clock values `before` and `after` (wrap-aware).
fn assert_between(clock: DeviceClock, before: u64, ts: u64, after: u64, what: &str) {
    assert!(
        clock.delta(before, ts) <= clock.delta(before, after),
        "{what}: timestamp {ts:#x} not within [{before:#x}, {after:#x}]"
    );
}

#[test]
fn device_reports_the_clock() {
    let ctx = ctx_on(&default_device());
    let a = ctx.query_device();
    let clock = ctx.clock();
    assert_eq!(clock, DeviceClock::from_attr(&a));
    assert_ne!(clock.mask, 0);
    assert_ne!(clock.khz, 0);
    assert!(ctx.query_rt_values() <= clock.mask);
    // The helpers.
    let c = DeviceClock {
        mask: 0xffff,
        khz: 1_000_000,
    };
    assert_eq!(c.delta(0xfff0, 0x0010), 0x20);
    assert_eq!(c.delta(5, 9), 4);
    assert_eq!(c.ticks_to_ns(1234), 1234);
    let slow = DeviceClock {
        mask: u64::MAX,
        khz: 156_250,
    };
    assert_eq!(slow.ticks_to_ns(156_250), 1_000_000);
    assert_eq!(slow.delta_ns(u64::MAX, 156_249), 1_000_000);
    assert_eq!(DeviceClock { mask: 1, khz: 0 }.ticks_to_ns(5), 0);
}

/// A CQ without a timestamp field (a classic `create_cq` one) is never stamped: reading the
/// clock is the costliest step of a completion. Its completions read 0, send and receive
/// side alike, while a CQ with only the wall-clock field is stamped (the raw time is what
/// its wall-clock reading is worked out from).
#[test]
fn only_cqs_with_a_timestamp_field_are_stamped() {
    let device = default_device();
    for (flags, stamped) in [
        (WcExFlags::empty(), false),
        (WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK, true),
    ] {
        let p = pair_with(&device, QpType::Rc, flags);
        let mr = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
        p.b.post_recv([RecvWr::new(1, &[mr.sge(32..64)])]).unwrap();
        p.a.post_send([SendWr::new(2, SendOp::Send, &[mr.sge(0..8)]).flags(SendFlags::SIGNALED)])
            .unwrap();
        let (send, recv) = (poll_one(&p.cq_a), poll_one(&p.cq_b));
        assert!(send.is_ok() && recv.is_ok(), "{send:?} {recv:?}");
        assert_eq!(
            (send.timestamp() != 0, recv.timestamp() != 0),
            (stamped, stamped),
            "{flags:?}"
        );
    }
    let classic = ctx_on(&device).create_cq(4, None).unwrap();
    assert!(
        !classic.wc_flags().intersects(
            WcExFlags::COMPLETION_TIMESTAMP | WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK
        )
    );
}

#[test]
fn every_completion_kind_carries_a_timestamp() {
    let device = default_device();
    for qp_type in [QpType::Rc, QpType::Uc] {
        let p = pair(&device, qp_type);
        let clock = p.ctx.clock();
        let src = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
        let dst = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
        let remote = |off: u64| (dst.iova() + off, dst.rkey());
        let s8 = [src.sge(0..8)];
        let mut ops = vec![
            ("send", SendOp::Send, true),
            ("send with imm", SendOp::SendWithImm { imm: 7 }, true),
            (
                "RDMA write",
                {
                    let (remote_addr, rkey) = remote(16);
                    SendOp::RdmaWrite { remote_addr, rkey }
                },
                false,
            ),
            (
                "RDMA write with imm",
                {
                    let (remote_addr, rkey) = remote(16);
                    SendOp::RdmaWriteWithImm {
                        remote_addr,
                        rkey,
                        imm: 9,
                    }
                },
                true,
            ),
        ];
        if qp_type == QpType::Rc {
            let (remote_addr, rkey) = remote(32);
            ops.push(("RDMA read", SendOp::RdmaRead { remote_addr, rkey }, false));
            ops.push((
                "compare and swap",
                SendOp::CmpSwap {
                    remote_addr,
                    rkey,
                    compare: 0,
                    swap: 1,
                },
                false,
            ));
            ops.push((
                "fetch and add",
                SendOp::FetchAdd {
                    remote_addr,
                    rkey,
                    add: 1,
                },
                false,
            ));
        }
        for (i, (what, op, consumes_recv)) in ops.into_iter().enumerate() {
            let what = format!("{qp_type:?} {what}");
            if consumes_recv {
                p.b.post_recv([RecvWr::new(i as u64, &[dst.sge(48..64)])])
                    .unwrap();
            }
            let before = p.ctx.query_rt_values();
            p.a.post_send([SendWr::new(i as u64, op, &s8).flags(SendFlags::SIGNALED)])
                .unwrap();
            let send = poll_one(&p.cq_a);
            let recv = consumes_recv.then(|| poll_one(&p.cq_b));
            let after = p.ctx.query_rt_values();
            assert_ne!(send.timestamp(), 0, "{what}");
            assert_between(clock, before, send.timestamp(), after, &what);
            if let Some(recv) = recv {
                assert_ne!(recv.timestamp(), 0, "{what} (receive)");
                assert_between(clock, before, recv.timestamp(), after, &what);
            }
        }
    }

    // UD: send and receive.
    let p = pair(&device, QpType::Ud);
    let clock = p.ctx.clock();
    let link = p.ctx.query_port(1).unwrap().link_layer;
    let ep = p.b.endpoint(0).unwrap();
    let ah = p.pd.create_ah(&address_vector(link, &ep)).unwrap();
    let src = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(GRH_LEN + 64, ALL_REMOTE).unwrap();
    p.b.post_recv([RecvWr::new(1, &[dst.sge(0..GRH_LEN + 64)])])
        .unwrap();
    let before = p.ctx.query_rt_values();
    let s = [src.sge(0..32)];
    p.a.post_send([SendWr::new(2, SendOp::Send, &s)
        .flags(SendFlags::SIGNALED)
        .ud(&ah, ep.qpn, 0x1111)])
        .unwrap();
    let send = poll_one(&p.cq_a);
    let recv = poll_one(&p.cq_b);
    let after = p.ctx.query_rt_values();
    assert_eq!(recv.byte_len(), GRH_LEN as u32 + 32);
    for (what, wc) in [("UD send", send), ("UD receive", recv)] {
        assert_ne!(wc.timestamp(), 0, "{what}");
        assert_between(clock, before, wc.timestamp(), after, what);
    }
}

#[test]
fn timestamps_increase_along_a_cq() {
    let p = pair(&default_device(), QpType::Rc);
    let clock = p.ctx.clock();
    let mr = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let s = [mr.sge(0..8)];
    let mut last = None;
    let mut stamps = Vec::new();
    for round in 0..20u64 {
        // Batches, so the CQ holds several completions at once.
        let wrs: Vec<_> = (0..10)
            .map(|i| SendWr::new(round * 10 + i, SendOp::Send, &s).flags(SendFlags::SIGNALED))
            .collect();
        for i in 0..10 {
            p.b.post_recv([RecvWr::new(round * 10 + i, &[mr.sge(8..16)])])
                .unwrap();
        }
        p.a.post_send(wrs).unwrap();
        for _ in 0..10 {
            stamps.push(poll_one(&p.cq_a).timestamp());
            stamps.push(poll_one(&p.cq_b).timestamp());
        }
    }
    // Along each CQ (sends on cq_a are the even entries, receives on cq_b the odd ones).
    for parity in 0..2 {
        for ts in stamps.iter().skip(parity).step_by(2) {
            if let Some(prev) = last {
                // Wrap-aware "not earlier": the step forward is less than half the clock.
                assert!(
                    clock.delta(prev, *ts) < clock.mask / 2,
                    "timestamp went backwards: {prev:#x} then {ts:#x}"
                );
            }
            last = Some(*ts);
        }
        last = None;
    }
}

#[test]
fn deltas_agree_with_the_os_monotonic_clock_over_one_second() {
    let p = pair(&default_device(), QpType::Rc);
    let clock = p.ctx.clock();
    let mr = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let s = [mr.sge(0..8)];
    const N: u64 = 21;
    let mut stamps = Vec::new();
    let mut instants = Vec::new();
    for i in 0..N {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
        p.b.post_recv([RecvWr::new(i, &[mr.sge(8..16)])]).unwrap();
        p.a.post_send([SendWr::new(i, SendOp::Send, &s).flags(SendFlags::SIGNALED)])
            .unwrap();
        let recv = poll_one(&p.cq_b);
        instants.push(Instant::now());
        stamps.push(recv.timestamp());
        poll_one(&p.cq_a);
    }
    let device_ns: u64 = stamps.windows(2).map(|w| clock.delta_ns(w[0], w[1])).sum();
    let os_ns = u64::try_from((instants[instants.len() - 1] - instants[0]).as_nanos()).unwrap();
    assert!(os_ns >= 1_000_000_000, "the run took {os_ns} ns");
    let diff = device_ns.abs_diff(os_ns);
    assert!(
        diff * 100 <= os_ns,
        "device clock {device_ns} ns vs OS monotonic clock {os_ns} ns over the same completions \
         ({diff} ns apart, more than 1%)"
    );
}

#[test]
fn a_16_bit_clock_wraps_and_deltas_stay_right() {
    let device = Device::builder()
        .name("ts-wrap16")
        .gid("fe80::7516".parse().unwrap())
        .timestamp_bits(16)
        .build()
        .unwrap();
    let p = pair(&device, QpType::Rc);
    let clock = p.ctx.clock();
    assert_eq!(clock.mask, 0xffff);
    let mr = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let s = [mr.sge(0..8)];
    // One completion about every 20 µs, for about 8 ms: the raw value wraps every 65.5 µs.
    const N: usize = 400;
    let spacing = Duration::from_micros(20);
    let mut samples = Vec::with_capacity(N); // (instant before posting, stamp, instant after polling)
    let mut next = Instant::now();
    for i in 0..N as u64 {
        while Instant::now() < next {
            std::hint::spin_loop();
        }
        next += spacing;
        p.b.post_recv([RecvWr::new(i, &[mr.sge(8..16)])]).unwrap();
        let t_pre = Instant::now();
        p.a.post_send([SendWr::new(i, SendOp::Send, &s).flags(SendFlags::SIGNALED)])
            .unwrap();
        let recv = poll_one(&p.cq_b);
        let t_post = Instant::now();
        poll_one(&p.cq_a);
        assert!(recv.timestamp() <= 0xffff);
        samples.push((t_pre, recv.timestamp(), t_post));
    }
    let (mut checked, mut wraps) = (0, 0);
    for w in samples.windows(2) {
        let ((pre0, ts0, post0), (pre1, ts1, post1)) = (w[0], w[1]);
        // The true time between the two stamps lies in [pre1 - post0, post1 - pre0].
        let (lo, hi) = (
            pre1.saturating_duration_since(post0).as_nanos() as u64,
            (post1 - pre0).as_nanos() as u64,
        );
        if hi > 0xffff {
            // This pair was preempted: more than one wrap may lie between them.
            continue;
        }
        let delta = clock.delta(ts0, ts1);
        assert_eq!(delta, ts1.wrapping_sub(ts0) & 0xffff);
        assert_eq!(clock.delta_ns(ts0, ts1), delta);
        assert!(
            (lo..=hi).contains(&delta),
            "delta {delta} ticks from {ts0:#x} to {ts1:#x}, but the OS clock says {lo}..={hi} ns"
        );
        if ts1 < ts0 {
            wraps += 1;
            // The naive difference would be nonsense here.
            assert!(ts1.wrapping_sub(ts0) > 0xffff);
        }
        checked += 1;
    }
    assert!(
        checked >= N / 2,
        "only {checked} of {} pairs were close enough to check",
        N - 1
    );
    assert!(
        wraps >= 1,
        "the 16-bit clock never wrapped ({checked} pairs)"
    );
}

#[test]
fn query_rt_values_between_two_completions_lies_between_their_timestamps() {
    for (name, bits) in [(None, 48), (Some("ts-rt16"), 16)] {
        let device = match name {
            None => default_device(),
            Some(name) => Device::builder()
                .name(name)
                .gid("fe80::7517".parse().unwrap())
                .timestamp_bits(bits)
                .build()
                .unwrap(),
        };
        let p = pair(&device, QpType::Rc);
        let clock = p.ctx.clock();
        let mr = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
        let s = [mr.sge(0..8)];
        let mut first: Option<(Instant, u64, u64)> = None;
        let mut checked = 0;
        for i in 0..200u64 {
            let t_pre = Instant::now();
            p.a.post_send([SendWr::new(
                i,
                SendOp::RdmaWrite {
                    remote_addr: mr.iova() + 16,
                    rkey: mr.rkey(),
                },
                &s,
            )
            .flags(SendFlags::SIGNALED)])
                .unwrap();
            let wc = poll_one(&p.cq_a);
            if let Some((t0, ts0, rt)) = first.take() {
                let ts1 = wc.timestamp();
                // Skip the rare pair preempted for a whole wrap of the 16-bit clock.
                if bits == 16 && t0.elapsed() > Duration::from_micros(60) {
                    continue;
                }
                assert_between(clock, ts0, rt, ts1, &format!("{bits}-bit clock, round {i}"));
                checked += 1;
            } else {
                first = Some((t_pre, wc.timestamp(), p.ctx.query_rt_values()));
            }
        }
        assert!(
            checked >= 50,
            "{bits}-bit clock: only {checked} pairs checked"
        );
    }
}
