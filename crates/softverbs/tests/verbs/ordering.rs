//! Strict placement order: a reader spinning on the last byte sees the whole message.

use crate::common::*;
use softverbs::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

fn spin_reader_sees_whole_messages(op: fn(&MemoryRegion<'_>) -> SendOp) {
    const LEN: usize = 1 << 16;
    const ROUNDS: u8 = 50;
    let p = pair(QpType::Rc);
    let src = p.pd.alloc_mr(LEN, ALL_REMOTE).unwrap();
    let dst = Arc::new(p.pd.alloc_mr(LEN, ALL_REMOTE).unwrap());
    let b = Arc::new(p.b);
    // The reader says which round it has checked, so the writer never runs a round ahead.
    let seen = Arc::new(AtomicU8::new(0));
    let reader = {
        let dst = dst.clone();
        let b = b.clone();
        let seen = seen.clone();
        let sges: Vec<Sge> = vec![dst.sge(0..LEN)];
        std::thread::spawn(move || {
            let mut torn = 0;
            for round in 1..=ROUNDS {
                b.post_recv([RecvWr::new(round as u64, &sges)]).unwrap();
                // Spin on the last byte only, then check every other byte.
                let deadline = Instant::now() + Duration::from_secs(20);
                while dst.load_u8(LEN - 1).unwrap() != round {
                    assert!(Instant::now() < deadline, "round {round} never landed");
                    std::hint::spin_loop();
                }
                let got = dst.to_vec();
                torn += got.iter().filter(|&&x| x != round).count();
                seen.store(round, Ordering::Release);
            }
            torn
        })
    };
    for round in 1..=ROUNDS {
        src.fill(round);
        let deadline = Instant::now() + Duration::from_secs(20);
        while seen.load(Ordering::Acquire) != round - 1 {
            assert!(
                Instant::now() < deadline,
                "reader stuck before round {round}"
            );
            std::thread::yield_now();
        }
        // A SEND may beat the reader's next receive; the RNR retry covers that.
        let s = [src.sge(0..LEN)];
        p.a.post_send([signaled(SendWr::new(round as u64, op(&dst), &s))])
            .unwrap();
        let wc = poll_n(&p.cq_a, 1)[0];
        assert!(wc.is_ok(), "{wc:?}");
    }
    assert_eq!(
        reader.join().unwrap(),
        0,
        "bytes seen stale after the last byte arrived"
    );
}

#[test]
fn rdma_write_last_byte_is_placed_last() {
    spin_reader_sees_whole_messages(|d| SendOp::RdmaWrite {
        remote_addr: d.iova(),
        rkey: d.rkey(),
    });
}

#[test]
fn send_last_byte_is_placed_last() {
    spin_reader_sees_whole_messages(|_| SendOp::Send);
}
