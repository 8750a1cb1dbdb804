//! UD multicast between processes (and, run by `between_hosts`, between hosts, where the
//! group is an IP multicast group the hosts' engines join): a datagram to the group reaches
//! the member QP of another process, and not a QP beside it that did not join.

use crate::common::*;
use crate::harness::{Peer, msg, peer};
use softverbs::*;
use std::time::Duration;

const QKEY: u32 = 0x6d63;

/// An IPv4 group as rdma_cm maps it on RoCEv2 (`::ffff:239.255.77.7`): an IP multicast group
/// between hosts, and a group of the host's device on one host.
fn group() -> Gid {
    "::ffff:239.255.77.7".parse().unwrap()
}

fn ud(n: &Node) -> QueuePair {
    let q = n.qp(QpType::Ud);
    q.ready_ud(QKEY, 0).unwrap();
    q
}

// Two UD QPs, a member of the group and one beside it; on `check` it reports what each got.
peer!(peer_mcast_member, |p| {
    let n = node();
    let (member, other) = (ud(&n), ud(&n));
    member.attach_mcast(group(), 0).expect("attach_mcast");
    let bufs = [n.mr(GRH_LEN + 64), n.mr(GRH_LEN + 64)];
    for (q, b) in [&member, &other].into_iter().zip(&bufs) {
        q.post_recv([RecvWr::new(
            u64::from(q.qp_num()),
            &[b.sge(0..GRH_LEN + 64)],
        )])
        .unwrap();
    }
    p.send("ready");
    p.expect("check");
    let wc = poll_n(&n.cq, 1, "member: the group's datagram")[0];
    let got = bufs[0].to_vec();
    let text = String::from_utf8_lossy(&got[GRH_LEN..GRH_LEN + 5]).into_owned();
    p.send(msg!(
        "member",
        wc.wr_id() == u64::from(member.qp_num()),
        format!("{:?}", wc.status()),
        wc.src_qp(),
        text
    ));
    std::thread::sleep(Duration::from_millis(100));
    let mut more = [WorkCompletion::default(); 2];
    p.send(msg!("others", n.cq.poll(&mut more)));
    p.expect("done");
    member.detach_mcast(group(), 0).unwrap();
});

#[test]
fn a_datagram_to_a_group_reaches_the_member_qp_of_another_process_only() {
    let mut t = Peer::spawn("multicast::peer_mcast_member");
    t.expect("ready");
    let n = node();
    let qp = ud(&n);
    let ah =
        n.pd.create_ah(&AhAttr {
            port_num: 1,
            grh: Some(GlobalRoute {
                dgid: group(),
                hop_limit: 1,
                ..GlobalRoute::default()
            }),
            ..AhAttr::default()
        })
        .expect("an address handle to the group");
    let src = n.mr(64);
    src.write_at(0, b"hello").unwrap();
    let s = [src.sge(0..5)];
    qp.post_send([signaled(SendWr::new(1, SendOp::Send, &s).ud(
        &ah,
        MULTICAST_QPN,
        QKEY,
    ))])
    .unwrap();
    assert!(poll_n(&n.cq, 1, "initiator: send")[0].is_ok());
    t.send("check");
    let m = t.expect("member");
    assert!(m.get::<bool>(0), "the member QP took it");
    assert_eq!(m.get::<String>(1), "Success");
    assert_eq!(m.get::<u32>(2), qp.qp_num(), "from our QP");
    assert_eq!(m.get::<String>(3), "hello");
    assert_eq!(
        t.expect("others").get::<usize>(0),
        0,
        "the QP beside it got nothing"
    );
    t.send("done");
    t.finish();
}
