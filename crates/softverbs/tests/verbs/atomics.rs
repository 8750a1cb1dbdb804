//! Atomics from several QPs and threads on one counter.

use crate::common::*;
use softverbs::*;
use std::sync::Arc;

#[test]
fn fetch_add_and_cmp_swap_from_two_threads_end_exact() {
    const N: u64 = 5_000;
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let target_cq = ctx.create_cq(16, None).unwrap();
    let counter = Arc::new(pd.alloc_mr(64, ALL_REMOTE).unwrap());
    let (iova, rkey) = (counter.iova(), counter.rkey());
    let mut workers = Vec::new();
    for kind in 0..2 {
        let cq = ctx.create_cq(64, None).unwrap();
        let me = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
        let target = pd
            .create_qp(&QpInitAttr::rc(&target_cq, &target_cq))
            .unwrap();
        me.connect(&target.endpoint(0).unwrap(), 0, ALL_REMOTE)
            .unwrap();
        target
            .connect(&me.endpoint(0).unwrap(), 0, ALL_REMOTE)
            .unwrap();
        let local = pd.alloc_mr(8, ALL_REMOTE).unwrap();
        workers.push(std::thread::spawn(move || {
            let s = [local.sge(0..8)];
            let mut guess = 0u64;
            let mut done = 0;
            let mut attempts = 0u64;
            while done < N {
                let op = if kind == 0 {
                    SendOp::FetchAdd {
                        remote_addr: iova,
                        rkey,
                        add: 1,
                    }
                } else {
                    SendOp::CmpSwap {
                        remote_addr: iova,
                        rkey,
                        compare: guess,
                        swap: guess + 1,
                    }
                };
                me.post_send([signaled(SendWr::new(done, op, &s))]).unwrap();
                let wc = poll_n(&cq, 1)[0];
                assert!(wc.is_ok(), "{wc:?}");
                let old = local.load_u64(0).unwrap();
                attempts += 1;
                if kind == 0 || old == guess {
                    done += 1;
                }
                guess = if kind == 0 {
                    old
                } else if old == guess {
                    guess + 1
                } else {
                    old
                };
            }
            drop(target);
            attempts
        }));
    }
    let attempts: Vec<u64> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert_eq!(
        counter.load_u64(0).unwrap(),
        2 * N,
        "every increment counted once (CAS attempts: {})",
        attempts[1]
    );
}

/// RDMA ATOMIC WRITE stores its 8 bytes in one piece: a reader spinning on the word sees only
/// values that were written whole, never a mix of two; it completes as `AtomicWrite`.
#[test]
fn atomic_write_stores_its_word_whole() {
    const N: u64 = 2_000;
    let p = pair(QpType::Rc);
    let word = Arc::new(p.pd.alloc_mr(64, ALL_REMOTE).unwrap());
    let (a, b) = (0x0123_4567_89ab_cdefu64, 0xfedc_ba98_7654_3210u64);
    word.store_u64(8, a).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (word, stop) = (word.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen = std::collections::BTreeSet::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                seen.insert(word.load_u64(8).unwrap());
            }
            seen
        })
    };
    for i in 0..N {
        let value = if i % 2 == 0 { b } else { a };
        p.a.post_send([signaled(SendWr::new(
            i,
            SendOp::AtomicWrite {
                remote_addr: word.iova() + 8,
                rkey: word.rkey(),
                value,
            },
            &[],
        ))])
        .unwrap();
        let wc = poll_n(&p.cq_a, 1)[0];
        assert_eq!(
            (wc.status(), wc.opcode()),
            (WcStatus::Success, WcOpcode::AtomicWrite)
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = reader.join().unwrap();
    assert!(
        seen.iter().all(|v| *v == a || *v == b),
        "torn values: {seen:x?}"
    );
    assert_eq!(word.load_u64(8).unwrap(), a, "the last value written");
}

/// ATOMIC WRITE needs REMOTE_WRITE of the region (else REM_ACCESS_ERR) and an aligned
/// address (else refused at post), on RC only.
#[test]
fn atomic_write_is_checked_like_a_write() {
    let p = pair(QpType::Rc);
    let read_only = p.pd.alloc_mr(64, AccessFlags::REMOTE_READ).unwrap();
    let op = |remote_addr| SendOp::AtomicWrite {
        remote_addr,
        rkey: read_only.rkey(),
        value: 7,
    };
    let e =
        p.a.post_send([signaled(SendWr::new(1, op(read_only.iova() + 4), &[]))]);
    assert_eq!(e.unwrap_err().error.errno(), 22, "misaligned");
    p.a.post_send([signaled(SendWr::new(2, op(read_only.iova()), &[]))])
        .unwrap();
    assert_eq!(poll_n(&p.cq_a, 1)[0].status(), WcStatus::RemAccessErr);
    assert_eq!(read_only.load_u64(0).unwrap(), 0, "nothing stored");
    let uc = pair(QpType::Uc);
    let mr = uc.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let e = uc.a.post_send([signaled(SendWr::new(
        3,
        SendOp::AtomicWrite {
            remote_addr: mr.iova(),
            rkey: mr.rkey(),
            value: 1,
        },
        &[],
    ))]);
    assert_eq!(e.unwrap_err().error.errno(), 22, "UC");
}
