//! The network-namespace harness (`softverbs_cli::netns`): the pair is reachable both ways
//! over IPv4 and IPv6, the attacker host reaches the victim, nothing routes out, a link
//! goes down and up, and dropping the pair removes every namespace and interface.
//!
//! Needs root and `ping` (iputils-ping); otherwise skipped with a message, except under
//! `CI=true`, where it fails.

use softverbs_cli::netns::{
    Host, HostNs, NetConfig, NetPair, available_for_test, namespace_exists,
};
use std::process::Output;
use support::show;

mod support;

fn ok(o: &Output) -> bool {
    o.status.success()
}

/// One ping from `from` to `to` (an address), waiting at most a second.
fn ping(from: &HostNs, to: &str) -> Output {
    from.command("ping")
        .args(["-c", "1", "-W", "1", "-n", to])
        .output()
        .expect("run ping")
}

fn have_ping(test: &str) -> bool {
    let found = std::process::Command::new("ping")
        .arg("-V")
        .output()
        .is_ok();
    if !found {
        let msg = "`ping` not found (apt-get install iputils-ping)";
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: {msg} (CI=true: not skipping)"
        );
        eprintln!("SKIPPED: {test}: {msg}");
    }
    found
}

#[test]
fn a_pair_talks_both_ways_and_nowhere_else_and_leaves_nothing_behind() {
    const T: &str = "netns pair";
    if !available_for_test(T) || !have_ping(T) {
        return;
    }
    let net = NetPair::new(&NetConfig {
        mtu: 9000,
        attacker: false,
    })
    .expect("make the pair");
    let names = net.namespaces();
    assert_eq!(names.len(), 2, "{names:?}");
    let (a, b) = (net.a().clone(), net.b().clone());
    for (from, to) in [(&a, &b), (&b, &a)] {
        for addr in [to.ipv4.to_string(), to.ipv6.to_string()] {
            let o = ping(from, &addr);
            assert!(ok(&o), "{} → {addr}: {}", from.netns, show(&o));
        }
    }
    // The link-local address is there (the RoCE GID table starts with it), and usable.
    let ll = b
        .link_local()
        .expect("ip addr")
        .expect("svb has a link-local address");
    let o = ping(&a, &format!("{ll}%{}", a.ifname));
    assert!(ok(&o), "link-local: {}", show(&o));
    // The MTU is the one asked for: a 9000-byte packet does not fragment.
    let o = a
        .command("ping")
        .args(["-c", "1", "-W", "1", "-M", "do", "-s", "8972"])
        .arg(b.ipv4.to_string())
        .output()
        .expect("ping");
    assert!(ok(&o), "jumbo ping: {}", show(&o));
    // No route anywhere else.
    for dst in ["1.1.1.1", "2606:4700:4700::1111", "127.0.0.53"] {
        let r = a.ip(&["route", "get", dst]);
        if dst.starts_with("127.") {
            // Loopback is the namespace's own `lo`: the root namespace is not reachable.
            let text = r.expect("route to loopback");
            assert!(text.contains("dev lo"), "{text}");
        } else {
            assert!(r.is_err(), "{} has a route to {dst}: {r:?}", a.netns);
        }
    }
    // Link down: B is unreachable; up again: reachable again.
    net.set_link(Host::B, false).expect("link down");
    assert!(
        !ok(&ping(&a, &b.ipv4.to_string())),
        "ping through a down link"
    );
    assert!(net.set_link(Host::Attacker, false).is_err());
    net.set_link(Host::B, true).expect("link up");
    let mut back = false;
    for _ in 0..20 {
        if ok(&ping(&a, &b.ipv4.to_string())) {
            back = true;
            break;
        }
    }
    assert!(back, "B unreachable after its link came back up");
    drop(net);
    for n in &names {
        assert!(!namespace_exists(n), "{n} still exists");
    }
    // The veth ends lived only in the namespaces; none leaked into the root namespace.
    let links = std::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip link");
    let links = String::from_utf8_lossy(&links.stdout);
    for ifname in [&a.ifname, &b.ifname] {
        assert!(
            !links.contains(&format!(": {ifname}@")),
            "{ifname} in the root namespace: {links}"
        );
    }
}

#[test]
fn the_attacker_reaches_the_victim_on_the_same_segment() {
    const T: &str = "netns attacker";
    if !available_for_test(T) || !have_ping(T) {
        return;
    }
    let net = NetPair::new(&NetConfig {
        mtu: 1500,
        attacker: true,
    })
    .expect("make the pair and the attacker");
    let names = net.namespaces();
    assert_eq!(names.len(), 4, "{names:?}");
    let c = net.attacker().expect("attacker").clone();
    for (from, to) in [
        (net.a(), net.b()),
        (&c, net.b()),
        (&c, net.a()),
        (net.b(), &c),
    ] {
        for addr in [to.ipv4.to_string(), to.ipv6.to_string()] {
            let o = ping(from, &addr);
            assert!(ok(&o), "{} → {addr}: {}", from.netns, show(&o));
        }
    }
    drop(net);
    for n in &names {
        assert!(!namespace_exists(n), "{n} still exists");
    }
}

#[test]
fn a_panicking_test_still_removes_its_namespaces() {
    const T: &str = "netns panic";
    if !available_for_test(T) {
        return;
    }
    let names = std::panic::catch_unwind(|| {
        let net = NetPair::new(&NetConfig::default()).expect("make the pair");
        let names = net.namespaces();
        std::panic::panic_any(names);
    })
    .expect_err("it panicked");
    let names = names.downcast::<Vec<String>>().expect("the names");
    assert_eq!(names.len(), 2);
    for n in names.iter() {
        assert!(!namespace_exists(n), "{n} still exists after the panic");
    }
}
