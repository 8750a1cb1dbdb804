//! The harness on its own, without RDMA: these pass whatever the NIC can do.

use crate::harness::{PEER_LIFETIME, Peer, WAIT, msg, peer};
use softverbs::Endpoint;
use std::time::{Duration, Instant};

peer!(peer_echo, |p| {
    let m = p.expect("ping");
    let n: u64 = m.get(0);
    let ep: Endpoint = m.get(1);
    p.send(msg!("pong", n + 1, ep, std::process::id()));
    p.expect("bye");
});

#[test]
fn harness_exchanges_messages_with_a_child_process_and_reaps_it() {
    let mut peer = Peer::spawn("selftest::peer_echo");
    assert_ne!(
        peer.pid(),
        std::process::id(),
        "the peer is another process"
    );
    let ep = Endpoint {
        qpn: 0xab_cdef,
        psn: 0x12_3456,
        lid: 7,
        gid: "::ffff:127.0.0.1".parse().unwrap(),
    };
    peer.send(msg!("ping", 41u64, ep));
    let m = peer.expect("pong");
    assert_eq!(m.get::<u64>(0), 42);
    assert_eq!(m.get::<Endpoint>(1), ep, "an endpoint survives the trip");
    assert_eq!(m.get::<u32>(2), peer.pid());
    peer.send("bye");
    peer.finish();
}

peer!(peer_relay_a, |p| {
    p.send(msg!("from-a", 1u32));
    assert_eq!(p.expect("from-b").get::<u32>(0), 2);
    p.send("done");
});

peer!(peer_relay_b, |p| {
    assert_eq!(p.expect("from-a").get::<u32>(0), 1);
    p.send(msg!("from-b", 2u32));
    p.send("done");
});

#[test]
fn harness_relays_messages_between_two_child_processes() {
    let mut a = Peer::spawn("selftest::peer_relay_a");
    let mut b = Peer::spawn("selftest::peer_relay_b");
    let m = a.expect("from-a");
    b.send(m.line());
    let m = b.expect("from-b");
    a.send(m.line());
    a.expect("done");
    b.expect("done");
    a.finish();
    b.finish();
}

peer!(peer_panics, |p| {
    p.expect("go");
    panic!("deliberate failure in the peer");
});

#[test]
fn harness_reports_a_failing_peer_quickly_with_its_panic_message() {
    let start = Instant::now();
    let mut peer = Peer::spawn("selftest::peer_panics");
    peer.send("go");
    let err = peer.try_recv(WAIT).unwrap_err();
    assert!(err.contains("deliberate failure in the peer"), "{err}");
    assert!(err.contains("exited with"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "{err}");
}

peer!(peer_silent, |p| {
    p.send("ready");
    std::thread::sleep(PEER_LIFETIME);
});

#[test]
fn harness_times_out_on_a_silent_peer_and_kills_it() {
    let mut peer = Peer::spawn("selftest::peer_silent");
    peer.expect("ready");
    let pid = peer.pid();
    let start = Instant::now();
    let err = peer.try_recv(Duration::from_millis(200)).unwrap_err();
    assert!(err.contains("no message within"), "{err}");
    assert!(err.contains("killed by the harness"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5), "{err}");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the peer is killed and reaped"
    );
}

#[test]
fn harness_kills_the_peer_when_the_test_drops_it() {
    let mut peer = Peer::spawn("selftest::peer_silent");
    peer.expect("ready");
    let pid = peer.pid();
    drop(peer);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the peer is killed and reaped"
    );
}

peer!(peer_waits, |p| {
    p.send("ready");
    p.recv_within(PEER_LIFETIME);
    unreachable!("the parent sends nothing");
});

#[test]
fn harness_peer_exits_by_itself_when_its_parent_link_closes() {
    let mut peer = Peer::spawn("selftest::peer_waits");
    peer.expect("ready");
    let st = peer.close_and_wait().expect("the peer exits on EOF");
    assert_eq!(st.code(), Some(3), "{st}");
}
