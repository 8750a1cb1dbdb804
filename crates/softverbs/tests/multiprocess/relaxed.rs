//! Relaxed ordering between processes: the ordering check is an option of the device that
//! owns the memory region, so a write from another process into a relaxed region of such a
//! device is scrambled (final piece first) while strict regions keep their order.
//!
//! Both processes build a device with the same GID (one device, seen from two processes); only
//! the target's has the ordering check on. The initiator's ordering observer pauses the
//! placement after its first piece until the target, polling its last byte as a buggy program
//! would, has reported what it saw: deterministic, no timing involved.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;
use std::sync::{Arc, Mutex};

const GID: &str = "fe80::5e1:900d";
/// Several KiB, not a multiple of a page.
const LEN: usize = 3 * 4096 - 17;

fn rig(name: &str, ordering_check: bool) -> (Device, Node) {
    let dev = Device::builder()
        .name(name)
        .gid(GID.parse().unwrap())
        .ordering_check(ordering_check)
        .build()
        .unwrap_or_else(|e| panic!("build {name}: {e}"));
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None).unwrap();
    (dev, Node { ctx, pd, cq })
}

/// Round `r`'s message: no zero byte, so "not yet placed" is unambiguous.
fn round_data(r: u8) -> Vec<u8> {
    pattern(LEN, r.wrapping_mul(53))
        .into_iter()
        .map(|b| b | 1)
        .collect()
}

peer!(peer_relaxed_target, |p| {
    let (_dev, n) = rig("svrelaxed-mp-target", true);
    let qp = n.qp(QpType::Rc);
    let relaxed =
        n.pd.alloc_mr(LEN, ALL_REMOTE | AccessFlags::RELAXED_ORDERING)
            .unwrap();
    let strict = n.mr(LEN);
    p.send(msg!(
        "target",
        qp.endpoint(0).unwrap(),
        RemoteMr::of(&relaxed),
        RemoteMr::of(&strict),
        relaxed.access().bits()
    ));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.connect(&them, 0, ALL_REMOTE).unwrap();
    p.send("ready");

    // Relaxed: poll the last byte instead of waiting for the completion (the bug under test).
    let want = round_data(1);
    let landed = spin_until(DATA_WAIT, || {
        relaxed.load_u8(LEN - 1).unwrap() == want[LEN - 1]
    });
    let seen = relaxed.to_vec();
    let verdict = match landed {
        false => "never-landed".to_string(),
        true if seen[..64].iter().all(|&b| b == 0) => "torn".to_string(),
        true => format!("not-torn:{}", compare(&seen, &want)),
    };
    p.send(msg!("polled", verdict));
    // Once the initiator has its completion, every byte is there.
    p.expect("completed");
    p.send(msg!("after-completion", compare(&relaxed.to_vec(), &want)));

    // Strict: the last-byte poller sees the whole message.
    let want = round_data(2);
    let landed = spin_until(DATA_WAIT, || {
        strict.load_u8(LEN - 1).unwrap() == want[LEN - 1]
    });
    let verdict = match landed {
        true => compare(&strict.to_vec(), &want),
        false => "never-landed".to_string(),
    };
    p.send(msg!("strict", verdict));
});

#[test]
fn ordering_check_of_the_owning_device_tears_relaxed_writes_from_another_process() {
    if crate::harness::between_hosts() {
        eprintln!(
            "skipped between hosts: the ordering check runs on a device of its own, which is not networked"
        );
        return;
    }
    let mut t = Peer::spawn("relaxed::peer_relaxed_target");
    let m = t.expect("target");
    let (tep, rmr, smr, access): (Endpoint, RemoteMr, RemoteMr, u32) =
        (m.get(0), m.get(1), m.get(2), m.get(3));
    assert_eq!(
        AccessFlags::from_bits_retain(access),
        ALL_REMOTE | AccessFlags::RELAXED_ORDERING,
        "the target's relaxed MR reports its effective access"
    );
    // The initiator's side of the device has no ordering check: the target's decides.
    let (dev, n) = rig("svrelaxed-mp-initiator", false);
    let qp = n.rc_to(&mut t, &tep, "ready");
    let t = Arc::new(Mutex::new(t));
    let pieces = Arc::new(Mutex::new(Vec::new()));
    let polled = Arc::new(Mutex::new(None));
    dev.set_ordering_observer(Some({
        let (t, pieces, polled) = (t.clone(), pieces.clone(), polled.clone());
        Arc::new(move |piece: &ScrambledPiece| {
            pieces.lock().unwrap().push(*piece);
            if piece.step == 0 {
                // Hold the rest of the message back until the target has polled.
                let got = t.lock().unwrap().try_recv(crate::harness::WAIT);
                *polled.lock().unwrap() = Some(got.map(|m| m.line().to_string()));
            }
        })
    }));
    let src = n.mr(LEN);
    let s = [src.sge(0..LEN)];
    let write = |r: u8, to: RemoteMr| {
        src.write_at(0, &round_data(r)).unwrap();
        qp.post_send([signaled(SendWr::new(
            r as u64,
            SendOp::RdmaWrite {
                remote_addr: to.iova,
                rkey: to.rkey,
            },
            &s,
        ))])
        .unwrap();
        let wc = poll_n(&n.cq, 1, "initiator: write completion")[0];
        assert_eq!((wc.wr_id(), wc.status()), (r as u64, WcStatus::Success));
    };

    write(1, rmr);
    let polled = polled.lock().unwrap().take();
    assert_eq!(
        polled,
        Some(Ok("polled torn".to_string())),
        "what the target's last-byte poller saw"
    );
    {
        let log = pieces.lock().unwrap();
        assert!(log.len() > 1, "the relaxed write was not split: {log:?}");
        assert_eq!(log[0].offset + log[0].len, LEN, "final piece first");
        assert_eq!(log.len(), log[0].pieces);
    }
    let mut g = t.lock().unwrap();
    g.send("completed");
    let m = g.expect("after-completion");
    assert_eq!(m.get::<String>(0), "ok", "completion-based reader");

    pieces.lock().unwrap().clear();
    write(2, smr);
    let m = g.expect("strict");
    assert_eq!(m.get::<String>(0), "ok", "strict last-byte poller");
    assert!(
        pieces.lock().unwrap().is_empty(),
        "a strict MR was scrambled"
    );
    drop(g);
    dev.set_ordering_observer(None);
    let t = Arc::try_unwrap(t)
        .unwrap_or_else(|_| panic!("the observer still holds the peer"))
        .into_inner()
        .unwrap();
    t.finish();
}
