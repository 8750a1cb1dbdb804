//! Memory windows between processes (and, run by `between_hosts`, between hosts, where the
//! target's host engine executes the bind and the invalidation): a type-2 window over part of
//! a region that has no remote rights is the peer's only key to that part, and a SEND with
//! Invalidate revokes it between the requests before and after it.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;

const WINDOW_AT: usize = 1024;

// A region with no remote rights and a type-2 window over 1024..2048 of it, bound by the QP
// the initiator connects to. On `check` it reports its receive and its memory.
peer!(peer_mw_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let region =
        n.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
            .expect("alloc_mr");
    let recv = n.mr(64);
    let mw = n.pd.alloc_mw(MwType::Type2).expect("alloc_mw");
    p.send(msg!("target", qp.endpoint(0).unwrap()));
    accept_rc(p, &qp);
    qp.post_recv([RecvWr::new(50, &[recv.sge(0..64)])]).unwrap();
    let rights = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let bind = mw.bind(&region, WINDOW_AT..2 * WINDOW_AT, rights);
    qp.post_send([signaled(SendWr::new(7, bind, &[]))]).unwrap();
    let wc = poll_n(&n.cq, 1, "target: bind")[0];
    assert_eq!(
        (wc.wr_id(), wc.status(), wc.opcode()),
        (7, WcStatus::Success, WcOpcode::BindMw)
    );
    let window = RemoteMr {
        iova: region.iova() + WINDOW_AT as u64,
        rkey: mw.rkey(),
        len: WINDOW_AT,
    };
    p.send(msg!("ready", window));
    p.expect("check");
    let r = poll_n(&n.cq, 1, "target: the SEND with Invalidate")[0];
    let inv = r
        .invalidated_rkey()
        .map_or("none".into(), |k| format!("{k:#x}"));
    p.send(msg!("recv", format!("{:?},{}", r.status(), inv)));
    let got = region.to_vec();
    let first = compare(&got[WINDOW_AT..WINDOW_AT + 8], &pattern(16, 3)[..8]);
    let after = compare(&got[WINDOW_AT + 8..WINDOW_AT + 16], &[0; 8]);
    p.send(msg!("memory", first, after));
    p.expect("done");
});

#[test]
fn a_peers_type2_window_is_its_only_key_and_send_with_invalidate_revokes_it_in_order() {
    let mut t = Peer::spawn("mw::peer_mw_target");
    let tep: Endpoint = t.expect("target").get(0);
    let n = node();
    let qp = n.qp(QpType::Rc);
    qp.connect(&tep, 0, ALL_REMOTE).unwrap();
    t.send(msg!("initiator", qp.endpoint(0).unwrap()));
    let win: RemoteMr = t.expect("ready").get(0);
    let src = n.mr(64);
    src.write_at(0, &pattern(16, 3)).unwrap();
    let (a, b, m) = ([src.sge(0..8)], [src.sge(8..16)], [src.sge(0..4)]);
    let write = |at: u64| SendOp::RdmaWrite {
        remote_addr: win.iova + at,
        rkey: win.rkey,
    };
    qp.post_send([
        signaled(SendWr::new(1, write(0), &a)),
        signaled(SendWr::new(2, SendOp::SendWithInv { rkey: win.rkey }, &m)),
        signaled(SendWr::new(3, write(8), &b)),
    ])
    .unwrap();
    let got: Vec<_> = poll_n(&n.cq, 3, "initiator: completions")
        .iter()
        .map(|c| (c.wr_id(), c.status()))
        .collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::RemAccessErr)
        ],
        "the WRITE after the SEND with Invalidate is refused"
    );
    t.send("check");
    assert_eq!(
        t.expect("recv").get::<String>(0),
        format!("Success,{:#x}", win.rkey),
        "the receive reports the invalidated rkey"
    );
    let mem = t.expect("memory");
    assert_eq!(mem.get::<String>(0), "ok", "the WRITE before landed");
    assert_eq!(mem.get::<String>(1), "ok", "the WRITE after did not");
    t.send("done");
    t.finish();
}
