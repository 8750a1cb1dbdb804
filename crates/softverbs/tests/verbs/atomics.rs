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
