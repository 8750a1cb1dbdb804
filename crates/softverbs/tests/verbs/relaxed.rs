//! Relaxed-ordering memory regions: the optional access bits, `reg_mr_iova2`, and the ordering
//! check, which scrambles placement into relaxed regions so that a program polling the last
//! byte instead of waiting for the completion sees torn data.
//!
//! The torn-data tests are deterministic: the ordering-check observer pauses placement after
//! the first (final) piece until a second thread, polling the last byte as a buggy program
//! would, has seen it and taken its snapshot.

use crate::common::*;
use softverbs::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const LW: u32 = AccessFlags::LOCAL_WRITE.bits();
const RELAXED: u32 = AccessFlags::RELAXED_ORDERING.bits();
const LEN: usize = 8192;
/// Bounds every wait, so a broken build fails instead of hanging.
const WAIT: Duration = Duration::from_secs(20);

#[test]
fn supported_optional_bit_takes_effect_and_is_reported() {
    let pd = ctx().alloc_pd().unwrap();
    let mut buf = vec![0u8; 64];
    let mr = pd
        .reg_mr(&mut buf, ALL_REMOTE | AccessFlags::RELAXED_ORDERING)
        .unwrap();
    assert_eq!(mr.access(), ALL_REMOTE | AccessFlags::RELAXED_ORDERING);
    drop(mr);
    let owned = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::RELAXED_ORDERING)
        .unwrap();
    assert_eq!(
        owned.access(),
        AccessFlags::LOCAL_WRITE | AccessFlags::RELAXED_ORDERING
    );
    // The bit is IBV_ACCESS_OPTIONAL_FIRST, the first of the optional range.
    assert_eq!(RELAXED, 1 << 20);
    assert_eq!(AccessFlags::OPTIONAL_RANGE, 0x3ff << 20);
}

#[test]
fn unsupported_optional_bits_are_dropped_silently() {
    let pd = ctx().alloc_pd().unwrap();
    let mut buf = vec![0u8; 64];
    for bit in 21..30 {
        let mr = pd.reg_mr_iova2(&mut buf, 0x1000, LW | 1 << bit).unwrap();
        assert_eq!(mr.access().bits(), LW, "optional bit {bit} dropped");
    }
    // All of them at once, with the supported one: only that one stays.
    let mr = pd
        .reg_mr_iova2(&mut buf, 0x1000, LW | AccessFlags::OPTIONAL_RANGE)
        .unwrap();
    assert_eq!(mr.access().bits(), LW | RELAXED);
}

#[test]
fn unknown_mandatory_bits_fail_with_einval() {
    let pd = ctx().alloc_pd().unwrap();
    let mut buf = vec![0u8; 64];
    for bit in (10..20).chain([30, 31]) {
        let e = pd
            .reg_mr_iova2(&mut buf, 0x1000, LW | RELAXED | 1 << bit)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "bit {bit}: {e}");
        assert_eq!(e.errno(), 22, "bit {bit}");
        let e = pd
            .reg_mr(&mut buf, AccessFlags::from_bits_retain(LW | 1 << bit))
            .unwrap_err();
        assert_eq!(e.errno(), 22, "bit {bit} through reg_mr");
    }
}

#[test]
fn reg_mr_iova2_registers_at_the_chosen_iova() {
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    src.write_at(0, b"relaxed iova2").unwrap();
    let mut at = vec![0u8; 256];
    const IOVA: u64 = 0x2_0000_0000;
    let dst =
        p.pd.reg_mr_iova2(&mut at, IOVA, ALL_REMOTE.bits() | RELAXED | 1 << 25)
            .unwrap();
    assert_eq!(dst.iova(), IOVA);
    assert_eq!(dst.access(), ALL_REMOTE | AccessFlags::RELAXED_ORDERING);
    let s = [src.sge(0..13)];
    let write = |remote_addr| {
        p.a.post_send([signaled(SendWr::new(
            1,
            SendOp::RdmaWrite {
                remote_addr,
                rkey: dst.rkey(),
            },
            &s,
        ))])
        .unwrap();
        poll_n(&p.cq_a, 1)[0]
    };
    assert!(write(IOVA + 100).is_ok());
    assert_eq!(&dst.to_vec()[100..113], b"relaxed iova2");
    // Peers address the region by the chosen IOVA, not by its host address.
    let host = dst.as_ptr() as u64;
    assert_eq!(write(host).status(), WcStatus::RemAccessErr);
    drop(dst);

    // ZERO_BASED wins over the chosen IOVA, as with ibv_reg_mr_iova.
    let mut zb = vec![0u8; 64];
    let z =
        p.pd.reg_mr_iova2(
            &mut zb,
            IOVA,
            ALL_REMOTE.bits() | AccessFlags::ZERO_BASED.bits(),
        )
        .unwrap();
    assert_eq!(z.iova(), 0);
}

/// A device of its own with the ordering check on (or off), and a connected RC pair on it,
/// so the observer set here sees only this test's traffic.
struct Rig {
    dev: Device,
    p: Pair,
}

fn rig(name: &str, ordering_check: bool) -> Rig {
    // Each device needs a GID of its own on the process's fabric.
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    let gid = format!("fe80::5e1:{:x}", NEXT.fetch_add(1, Ordering::Relaxed));
    let dev = Device::builder()
        .name(name)
        .gid(gid.parse().unwrap())
        .ordering_check(ordering_check)
        .build()
        .unwrap();
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx.create_cq(256, None).unwrap();
    let cq_b = ctx.create_cq(256, None).unwrap();
    let a = pd.create_qp(&QpInitAttr::rc(&cq_a, &cq_a)).unwrap();
    let b = pd.create_qp(&QpInitAttr::rc(&cq_b, &cq_b)).unwrap();
    a.connect(&b.endpoint(100).unwrap(), 200, ALL_REMOTE)
        .unwrap();
    b.connect(&a.endpoint(200).unwrap(), 100, ALL_REMOTE)
        .unwrap();
    Rig {
        dev,
        p: Pair {
            ctx,
            pd,
            cq_a,
            cq_b,
            a,
            b,
        },
    }
}

/// Every piece the observer saw, in placement order.
fn recording_observer() -> (OrderingObserver, Arc<Mutex<Vec<ScrambledPiece>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    (
        Arc::new(move |p: &ScrambledPiece| l.lock().unwrap().push(*p)),
        log,
    )
}

/// Data whose bytes are all non-zero, so "not yet placed" (zero) is unambiguous.
fn nonzero(len: usize, seed: u8) -> Vec<u8> {
    pattern(len, seed).into_iter().map(|b| b | 1).collect()
}

/// `nonzero(LEN, seed)`, and a region of `pd` holding it (the source of the tests' messages).
fn filled_source(pd: &ProtectionDomain, seed: u8) -> (Vec<u8>, MemoryRegion<'_>) {
    let data = nonzero(LEN, seed);
    let src = pd.alloc_mr(LEN, ALL_REMOTE).unwrap();
    src.write_at(0, &data).unwrap();
    (data, src)
}

/// A relaxed-ordering region of `LEN` bytes open to every remote access.
fn relaxed_target(pd: &ProtectionDomain) -> MemoryRegion<'_> {
    pd.alloc_mr(LEN, ALL_REMOTE | AccessFlags::RELAXED_ORDERING)
        .unwrap()
}

fn write_wr<'a>(id: u64, dst: &MemoryRegion<'_>, s: &'a [Sge]) -> SendWr<'a> {
    SendWr::new(
        id,
        SendOp::RdmaWrite {
            remote_addr: dst.iova(),
            rkey: dst.rkey(),
        },
        s,
    )
}

/// Spins (from another thread) on the last byte of `dst` like a program that skips the
/// completion, snapshots the whole region once the byte is set, and returns the snapshot.
/// `release` lets the paused placement go on afterwards.
fn last_byte_poller(dst: &MemoryRegion<'_>, expect_last: u8, release: &Sender<()>) -> Vec<u8> {
    let deadline = Instant::now() + WAIT;
    while dst.load_u8(dst.len() - 1).unwrap() != expect_last {
        assert!(Instant::now() < deadline, "the last byte never landed");
        std::hint::spin_loop();
    }
    let snapshot = dst.to_vec();
    release.send(()).unwrap();
    snapshot
}

/// An observer that pauses placement after its first piece until `released`.
fn pausing_observer(released: Receiver<()>) -> (OrderingObserver, Arc<AtomicBool>) {
    let released = Mutex::new(released);
    let timed_out = Arc::new(AtomicBool::new(false));
    let t = timed_out.clone();
    let observer: OrderingObserver = Arc::new(move |p: &ScrambledPiece| {
        if p.step == 0 && released.lock().unwrap().recv_timeout(WAIT).is_err() {
            t.store(true, Ordering::SeqCst);
        }
    });
    (observer, timed_out)
}

/// Posts (with `post`) while a pausing observer holds placement after the first piece and a
/// last-byte poller of `dst` waits for `last`: what the poller saw, and whether the observer
/// timed out waiting for it.
fn torn_snapshot(
    dev: &Device,
    dst: &MemoryRegion<'_>,
    last: u8,
    post: impl FnOnce(),
) -> (Vec<u8>, bool) {
    let (release, released) = channel();
    let (observer, timed_out) = pausing_observer(released);
    dev.set_ordering_observer(Some(observer));
    let snapshot = std::thread::scope(|scope| {
        let poller = scope.spawn(|| last_byte_poller(dst, last, &release));
        post();
        poller.join().unwrap()
    });
    dev.set_ordering_observer(None);
    (snapshot, timed_out.load(Ordering::SeqCst))
}

#[test]
fn ordering_check_shows_torn_data_to_a_last_byte_poller_of_a_relaxed_mr() {
    let Rig { dev, p } = rig("svrelaxed-torn", true);
    let (data, src) = filled_source(&p.pd, 7);
    let dst = relaxed_target(&p.pd);
    let s = [src.sge(0..LEN)];
    let (snapshot, timed_out) = torn_snapshot(&dev, &dst, data[LEN - 1], || {
        p.a.post_send([signaled(write_wr(1, &dst, &s))]).unwrap();
    });
    assert!(!timed_out, "the poller never saw the last byte");
    // What the buggy reader saw: the last byte, but not the start of the message.
    assert_eq!(snapshot[LEN - 1], data[LEN - 1]);
    assert!(
        snapshot[..64].iter().all(|&b| b == 0),
        "first bytes already placed"
    );
    let placed = snapshot.iter().zip(&data).filter(|(a, b)| a == b).count();
    assert!(placed < LEN / 8, "{placed} of {LEN} bytes placed: not torn");
    // The completion-based reader sees everything.
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    assert_eq!(dst.to_vec(), data);
}

#[test]
fn ordering_check_tears_sends_into_relaxed_receive_buffers() {
    let Rig { dev, p } = rig("svrelaxed-send", true);
    let (data, src) = filled_source(&p.pd, 9);
    let dst =
        p.pd.alloc_mr(
            LEN,
            AccessFlags::LOCAL_WRITE | AccessFlags::RELAXED_ORDERING,
        )
        .unwrap();
    let r = [dst.sge(0..LEN)];
    p.b.post_recv([RecvWr::new(5, &r)]).unwrap();
    let s = [src.sge(0..LEN)];
    let (snapshot, timed_out) = torn_snapshot(&dev, &dst, data[LEN - 1], || {
        p.a.post_send([signaled(SendWr::new(1, SendOp::Send, &s))])
            .unwrap();
    });
    assert!(!timed_out);
    assert!(snapshot[..64].iter().all(|&b| b == 0), "torn SEND expected");
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    let wc = poll_n(&p.cq_b, 1)[0];
    assert!(wc.is_ok());
    assert_eq!(wc.byte_len() as usize, LEN);
    assert_eq!(dst.to_vec(), data);
}

#[test]
fn ordering_check_never_scrambles_strict_mrs() {
    let Rig { dev, p } = rig("svrelaxed-strict", true);
    let (observer, log) = recording_observer();
    dev.set_ordering_observer(Some(observer));
    let src = p.pd.alloc_mr(LEN, ALL_REMOTE).unwrap();
    let dst = p.pd.alloc_mr(LEN, ALL_REMOTE).unwrap();
    let recv = p.pd.alloc_mr(LEN, ALL_REMOTE).unwrap();
    let s = [src.sge(0..LEN)];
    let r = [recv.sge(0..LEN)];
    for round in 1..=20u8 {
        let mut data = nonzero(LEN, round);
        data[LEN - 1] = round;
        src.write_at(0, &data).unwrap();
        // A last-byte poller of a strict region always sees the whole message.
        std::thread::scope(|scope| {
            let poller = scope.spawn(|| {
                let deadline = Instant::now() + WAIT;
                while dst.load_u8(LEN - 1).unwrap() != round {
                    assert!(Instant::now() < deadline, "round {round} never landed");
                    std::hint::spin_loop();
                }
                dst.to_vec()
            });
            p.a.post_send([signaled(write_wr(round as u64, &dst, &s))])
                .unwrap();
            assert_eq!(
                poller.join().unwrap(),
                data,
                "round {round}: torn strict write"
            );
        });
        p.b.post_recv([RecvWr::new(round as u64, &r)]).unwrap();
        p.a.post_send([signaled(SendWr::new(0, SendOp::Send, &s))])
            .unwrap();
        assert!(poll_n(&p.cq_a, 2).iter().all(|w| w.is_ok()));
        assert!(poll_n(&p.cq_b, 1)[0].is_ok());
        assert_eq!(recv.to_vec(), data);
    }
    dev.set_ordering_observer(None);
    assert!(log.lock().unwrap().is_empty(), "a strict MR was scrambled");
}

#[test]
fn completion_based_readers_see_every_byte_of_every_earlier_transfer() {
    let Rig { dev, p } = rig("svrelaxed-done", true);
    let (observer, log) = recording_observer();
    dev.set_ordering_observer(Some(observer));
    const N: usize = 8;
    let relaxed = ALL_REMOTE | AccessFlags::RELAXED_ORDERING;
    let src = p.pd.alloc_mr(LEN * N, ALL_REMOTE).unwrap();
    let data = nonzero(LEN * N, 3);
    src.write_at(0, &data).unwrap();
    let dsts: Vec<_> = (0..N)
        .map(|_| p.pd.alloc_mr(LEN, relaxed).unwrap())
        .collect();
    let sges: Vec<[Sge; 1]> = (0..N).map(|i| [src.sge(i * LEN..(i + 1) * LEN)]).collect();
    // N-1 unsignaled relaxed writes, then a signaled one: its completion covers them all.
    p.a.post_send((0..N).map(|i| {
        let wr = write_wr(i as u64, &dsts[i], &sges[i]);
        if i == N - 1 { signaled(wr) } else { wr }
    }))
    .unwrap();
    let wc = poll_n(&p.cq_a, 1)[0];
    assert!(wc.is_ok());
    assert_eq!(wc.wr_id(), (N - 1) as u64);
    for (i, d) in dsts.iter().enumerate() {
        assert_eq!(d.to_vec(), &data[i * LEN..(i + 1) * LEN], "write {i}");
    }
    // RDMA READ into a relaxed local region: scrambled too, and whole at completion.
    let back = p.pd.alloc_mr(LEN, relaxed).unwrap();
    let rs = [back.sge(0..LEN)];
    p.a.post_send([signaled(SendWr::new(
        99,
        SendOp::RdmaRead {
            remote_addr: dsts[2].iova(),
            rkey: dsts[2].rkey(),
        },
        &rs,
    ))])
    .unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    assert_eq!(back.to_vec(), &data[2 * LEN..3 * LEN]);
    dev.set_ordering_observer(None);

    // Every message was scrambled: N + 1 of them, each starting with its final piece.
    let log = log.lock().unwrap();
    let firsts: Vec<_> = log.iter().filter(|p| p.step == 0).collect();
    assert_eq!(firsts.len(), N + 1);
    assert!(
        firsts
            .iter()
            .all(|p| p.offset + p.len == p.message_len && p.pieces > 1)
    );
    assert_eq!(log.len(), firsts.iter().map(|p| p.pieces).sum::<usize>());
}

#[test]
fn relaxed_write_never_passes_a_later_atomic() {
    let Rig { dev, p } = rig("svrelaxed-atomic", true);
    let (data, src) = filled_source(&p.pd, 11);
    let dst = relaxed_target(&p.pd);
    // The flag word lives in a strict region, as the man page's safe pattern has it.
    let flag = Arc::new(p.pd.alloc_mr(8, ALL_REMOTE).unwrap());
    let result = p.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    // While any piece of the relaxed write is being placed, the atomic must not have run.
    let passed = Arc::new(AtomicUsize::new(0));
    let pieces = Arc::new(AtomicUsize::new(0));
    let observer: OrderingObserver = {
        let (passed, pieces, flag) = (passed.clone(), pieces.clone(), flag.clone());
        Arc::new(move |_: &ScrambledPiece| {
            pieces.fetch_add(1, Ordering::SeqCst);
            if flag.load_u64(0).unwrap() != 0 {
                passed.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    dev.set_ordering_observer(Some(observer));
    let s = [src.sge(0..LEN)];
    let rs = [result.sge(0..8)];
    let seen = std::thread::scope(|scope| {
        // A reader that waits for the atomic instead of the completion sees the whole write.
        let reader = scope.spawn(|| {
            let deadline = Instant::now() + WAIT;
            while flag.load_u64(0).unwrap() == 0 {
                assert!(Instant::now() < deadline, "the atomic never landed");
                std::hint::spin_loop();
            }
            dst.to_vec()
        });
        p.a.post_send([
            write_wr(1, &dst, &s),
            signaled(SendWr::new(
                2,
                SendOp::FetchAdd {
                    remote_addr: flag.iova(),
                    rkey: flag.rkey(),
                    add: 1,
                },
                &rs,
            )),
        ])
        .unwrap();
        reader.join().unwrap()
    });
    dev.set_ordering_observer(None);
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    assert!(
        pieces.load(Ordering::SeqCst) > 1,
        "the write was not scrambled"
    );
    assert_eq!(
        passed.load(Ordering::SeqCst),
        0,
        "the atomic passed the relaxed write"
    );
    assert_eq!(seen, data);
    assert_eq!(flag.load_u64(0).unwrap(), 1);
    assert_eq!(result.load_u64(0).unwrap(), 0);
}

#[test]
fn without_the_ordering_check_relaxed_mrs_are_not_scrambled() {
    let Rig { dev, p } = rig("svrelaxed-plain", false);
    let (observer, log) = recording_observer();
    dev.set_ordering_observer(Some(observer));
    let (data, src) = filled_source(&p.pd, 13);
    let dst = relaxed_target(&p.pd);
    let s = [src.sge(0..LEN)];
    p.a.post_send([signaled(write_wr(1, &dst, &s))]).unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    assert_eq!(dst.to_vec(), data);
    dev.set_ordering_observer(None);
    assert!(log.lock().unwrap().is_empty());
}

#[test]
fn ordering_check_is_a_device_option_in_the_environment_syntax() {
    let dev = Device::builder()
        .name("svrelaxed-env")
        .gid("fe80::5e1:e0".parse().unwrap())
        .set("ordering_check", "1")
        .unwrap()
        .build()
        .unwrap();
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let a = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let b = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    a.connect(&b.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    b.connect(&a.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    let (observer, log) = recording_observer();
    dev.set_ordering_observer(Some(observer));
    let src = pd.alloc_mr(256, ALL_REMOTE).unwrap();
    let dst = pd
        .alloc_mr(256, ALL_REMOTE | AccessFlags::RELAXED_ORDERING)
        .unwrap();
    let s = [src.sge(0..256)];
    a.post_send([signaled(write_wr(1, &dst, &s))]).unwrap();
    assert!(poll_n(&cq, 1)[0].is_ok());
    dev.set_ordering_observer(None);
    assert!(!log.lock().unwrap().is_empty());
    assert!(
        Device::builder()
            .name("svrelaxed-bad")
            .set("ordering_check", "maybe")
            .is_err()
    );
}
