//! One-sided operation: the target process spends no CPU in the library during the data
//! phase — it only spins on its own memory, or is even stopped with SIGSTOP.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use rustix::process::Signal;
use softverbs::*;
use std::time::{Duration, Instant};

const ROUNDS: usize = 6;
/// Several KiB, not a multiple of a page or of the MTU.
const LEN: usize = 3 * 4096 - 17;

/// The message of round `r`: its last byte is a marker that differs from every other round's.
fn round_data(r: usize) -> Vec<u8> {
    let mut v = pattern(LEN, (r as u8).wrapping_mul(37).wrapping_add(1));
    v[LEN - 1] = 0x80 | r as u8;
    v
}

/// Even rounds are RDMA WRITEs, odd rounds SENDs into receives posted beforehand.
fn is_send_round(r: usize) -> bool {
    r % 2 == 1
}

peer!(peer_spinning_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let buf = n.mr(LEN + 4096);
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&buf)));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    let sge = [buf.sge(0..LEN)];
    let sends = (0..ROUNDS).filter(|&r| is_send_round(r)).count();
    qp.post_recv((0..sends).map(|i| RecvWr::new(i as u64, &sge)))
        .unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");

    // The data phase: no post, no poll, no verbs call at all; only loads from our memory.
    for r in 0..ROUNDS {
        let want = round_data(r);
        let mut last = 0;
        let landed = spin_until(DATA_WAIT, || {
            last = buf.load_u8(LEN - 1).unwrap();
            last == want[LEN - 1]
        });
        let verdict = if landed {
            let got = buf.to_vec();
            match compare(&got[..LEN], &want) {
                v if v == "ok" => compare(&got[LEN..], &vec![0; got.len() - LEN]),
                v => v,
            }
        } else {
            format!("last-byte-still-{last:#04x}-after-{DATA_WAIT:?}")
        };
        p.send(msg!("round", r, verdict));
    }

    // After the data phase: the SEND rounds completed receives.
    let wc = poll_n(&n.cq, sends, "spinning target: receive completions");
    assert_all_ok(&wc, "spinning target: receive completions");
    for (i, w) in wc.iter().enumerate() {
        assert_eq!(
            (w.wr_id(), w.opcode(), w.byte_len(), w.src_qp()),
            (i as u64, WcOpcode::Recv, LEN as u32, them.qpn),
            "{w:?}"
        );
    }
    p.send("done");
});

#[test]
fn target_spinning_only_on_its_last_byte_sees_each_whole_write_and_send_message() {
    let mut t = Peer::spawn("one_sided::peer_spinning_target");
    let m = t.expect("target");
    let (tep, buf): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let src = n.mr(LEN);
    // Three SGEs, the last byte alone in the last one.
    let sges = [
        src.sge(0..1000),
        src.sge(1000..LEN - 1),
        src.sge(LEN - 1..LEN),
    ];
    for r in 0..ROUNDS {
        src.write_at(0, &round_data(r)).unwrap();
        let op = if is_send_round(r) {
            SendOp::Send
        } else {
            SendOp::RdmaWrite {
                remote_addr: buf.iova,
                rkey: buf.rkey,
            }
        };
        qp.post_send([signaled(SendWr::new(r as u64, op, &sges))])
            .unwrap();
        let wc = poll_n(&n.cq, 1, "initiator: completion")[0];
        assert_eq!(
            (wc.wr_id(), wc.status()),
            (r as u64, WcStatus::Success),
            "round {r} ({op:?}): {wc:?}"
        );
        let m = t.expect("round");
        assert_eq!(m.get::<usize>(0), r);
        assert_eq!(
            m.get::<String>(1),
            "ok",
            "round {r} ({op:?}): what the spinning target saw once the last byte landed"
        );
    }
    t.expect("done");
    t.finish();
}

// Set up, then gets stopped (SIGSTOP) by the parent while the initiator works on it.
peer!(peer_stopped_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let mem = n.mr(64 * 1024);
    mem.write_at(32 * 1024, &pattern(16 * 1024, 21)).unwrap();
    mem.store_u64(60 * 1024, 1000).unwrap();
    mem.store_u64(60 * 1024 + 8, 5).unwrap();
    let rbuf = n.mr(8192);
    p.send(msg!("target", qp.endpoint(0).unwrap(), RemoteMr::of(&mem)));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_init(ALL_REMOTE).unwrap();
    qp.post_recv([
        RecvWr::new(1, &[rbuf.sge(0..4096)]),
        RecvWr::new(2, &[rbuf.sge(4096..8192)]),
        RecvWr::new(3, &[]),
    ])
    .unwrap();
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");

    p.expect("check"); // sent after SIGCONT
    let m = mem.to_vec();
    let r = rbuf.to_vec();
    let sent = pattern(32 * 1024, 22);
    let checks = [
        ("write", compare(&m[..32 * 1024], &sent)),
        (
            "read-source-unchanged",
            compare(&m[32 * 1024..48 * 1024], &pattern(16 * 1024, 21)),
        ),
        (
            "write-with-imm",
            compare(&m[48 * 1024..48 * 1024 + 100], &sent[..100]),
        ),
        (
            "fetch-add",
            compare(
                &mem.load_u64(60 * 1024).unwrap().to_le_bytes(),
                &1005u64.to_le_bytes(),
            ),
        ),
        (
            "cmp-swap",
            compare(
                &mem.load_u64(60 * 1024 + 8).unwrap().to_le_bytes(),
                &77u64.to_le_bytes(),
            ),
        ),
        ("send-1", compare(&r[..3000], &sent[..3000])),
        ("send-2", compare(&r[4096..8192], &sent[4096..8192])),
    ];
    for (what, verdict) in checks {
        p.send(msg!("check", what, verdict));
    }
    let wc = poll_n(&n.cq, 3, "stopped target: receive completions");
    assert_all_ok(&wc, "stopped target: receive completions");
    let got = recv_summary(&wc);
    assert_eq!(
        got,
        vec![
            (1, WcOpcode::Recv, 3000, None, them.qpn),
            (2, WcOpcode::Recv, 4096, None, them.qpn),
            (3, WcOpcode::RecvRdmaWithImm, 100, Some(0x5709), them.qpn),
        ],
        "stopped target: (wr_id, opcode, byte_len, imm, src_qp) of the receives"
    );
    p.send("checked");
});

fn wait_for_state(pid: u32, want: char, within: Duration) -> Option<char> {
    let deadline = Instant::now() + within;
    loop {
        let s = process_state(pid);
        if s == Some(want) || Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn target_stopped_with_sigstop_still_serves_write_read_atomics_and_sends() {
    let mut t = Peer::spawn("one_sided::peer_stopped_target");
    let m = t.expect("target");
    let (tep, mem): (Endpoint, RemoteMr) = (m.get(0), m.get(1));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");

    t.signal(Signal::STOP);
    let st = wait_for_state(t.pid(), 'T', Duration::from_secs(5));
    assert_eq!(st, Some('T'), "the target process is stopped");

    let src = n.mr(32 * 1024);
    let sent = pattern(32 * 1024, 22);
    src.write_at(0, &sent).unwrap();
    let local = n.mr(16 * 1024 + 64);
    let writes: Vec<[Sge; 1]> = (0..8)
        .map(|i| [src.sge(i * 4096..(i + 1) * 4096)])
        .collect();
    let read = [local.sge(0..16 * 1024)];
    let fadd = [local.sge(16 * 1024..16 * 1024 + 8)];
    let cas = [local.sge(16 * 1024 + 8..16 * 1024 + 16)];
    let send1 = [src.sge(0..3000)];
    let send2 = [src.sge(4096..8192)];
    let wimm = [src.sge(0..100)];
    let mut wrs: Vec<SendWr<'_>> = writes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            SendWr::new(
                i as u64,
                SendOp::RdmaWrite {
                    remote_addr: mem.iova + (i * 4096) as u64,
                    rkey: mem.rkey,
                },
                s,
            )
        })
        .collect();
    wrs.extend([
        SendWr::new(
            10,
            SendOp::RdmaRead {
                remote_addr: mem.iova + 32 * 1024,
                rkey: mem.rkey,
            },
            &read,
        ),
        SendWr::new(
            11,
            SendOp::FetchAdd {
                remote_addr: mem.iova + 60 * 1024,
                rkey: mem.rkey,
                add: 5,
            },
            &fadd,
        ),
        SendWr::new(
            12,
            SendOp::CmpSwap {
                remote_addr: mem.iova + 60 * 1024 + 8,
                rkey: mem.rkey,
                compare: 5,
                swap: 77,
            },
            &cas,
        ),
        SendWr::new(13, SendOp::Send, &send1),
        SendWr::new(14, SendOp::Send, &send2),
        SendWr::new(
            15,
            SendOp::RdmaWriteWithImm {
                remote_addr: mem.iova + 48 * 1024,
                rkey: mem.rkey,
                imm: 0x5709,
            },
            &wimm,
        ),
    ]);
    let count = wrs.len();
    qp.post_send(wrs.into_iter().map(signaled)).unwrap();
    let wc = poll_n(
        &n.cq,
        count,
        "initiator: completions while the target is stopped",
    );
    assert_all_ok(&wc, "initiator: completions while the target is stopped");
    assert_eq!(
        process_state(t.pid()),
        Some('T'),
        "the target stayed stopped throughout"
    );
    assert_eq!(
        compare(&local.to_vec()[..16 * 1024], &pattern(16 * 1024, 21)),
        "ok",
        "READ from the stopped target"
    );
    assert_eq!(
        local.load_u64(16 * 1024).unwrap(),
        1000,
        "FETCH_AND_ADD result"
    );
    assert_eq!(
        local.load_u64(16 * 1024 + 8).unwrap(),
        5,
        "CMP_AND_SWP result"
    );

    t.signal(Signal::CONT);
    t.send("check");
    t.expect_checks("the target after SIGCONT");
    t.finish();
}
