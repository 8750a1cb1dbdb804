//! Devices, queries and configuration.

use crate::common::*;
use softverbs::*;

#[test]
fn default_device_needs_no_setup() {
    let devs = devices().unwrap();
    assert!(!devs.is_empty());
    let ctx = devs[0].open().unwrap();
    let a = ctx.query_device();
    assert!(a.max_qp > 0 && a.max_qp_wr > 0 && a.max_sge > 0 && a.max_cq > 0 && a.max_cqe > 0);
    assert!(a.max_mr > 0 && a.max_mr_size > 0 && a.max_qp_rd_atom > 0 && a.max_inline_data > 0);
    assert_eq!(a.atomic_cap, AtomicCap::Hca);
    assert_eq!(a.phys_port_cnt, 1);
    assert_ne!(a.completion_timestamp_mask, 0);
    let port = ctx.query_port(1).unwrap();
    assert_eq!(port.state, PortState::Active);
    assert_eq!(port.gid_tbl_len, 1);
    assert!(ctx.query_port(2).is_err());
    assert!(ctx.query_gid(1, 0).is_ok());
    assert!(ctx.query_gid(1, 1).is_err());
    assert_eq!(ctx.query_pkey(1, 0).unwrap(), 0xffff);
}

#[test]
fn builder_devices_reach_each_other_by_gid() {
    let d1 = Device::builder()
        .name("b-one")
        .gid("fe80::b1".parse().unwrap())
        .build()
        .unwrap();
    let d2 = Device::builder()
        .name("b-two")
        .gid("fe80::b2".parse().unwrap())
        .mtu(Mtu::Mtu1024)
        .build()
        .unwrap();
    assert!(
        Device::builder()
            .name("b-one")
            .gid("fe80::b3".parse().unwrap())
            .build()
            .is_err(),
        "duplicate name"
    );
    assert!(
        Device::builder()
            .name("b-three")
            .gid("fe80::b2".parse().unwrap())
            .build()
            .is_err(),
        "duplicate GID"
    );
    assert!(devices().unwrap().iter().any(|d| d.name() == "b-two"));
    let (c1, c2) = (d1.open().unwrap(), d2.open().unwrap());
    assert_eq!(c2.query_port(1).unwrap().active_mtu, Mtu::Mtu1024);
    let (pd1, pd2) = (c1.alloc_pd().unwrap(), c2.alloc_pd().unwrap());
    let (cq1, cq2) = (
        c1.create_cq(8, None).unwrap(),
        c2.create_cq(8, None).unwrap(),
    );
    let q1 = pd1.create_qp(&QpInitAttr::rc(&cq1, &cq1)).unwrap();
    let q2 = pd2.create_qp(&QpInitAttr::rc(&cq2, &cq2)).unwrap();
    q1.connect(&q2.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    q2.connect(&q1.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    // A CQ of one device cannot serve a QP of another.
    assert_eq!(
        pd1.create_qp(&QpInitAttr::rc(&cq2, &cq2))
            .err()
            .map(|e| e.errno()),
        Some(22)
    );
    let mr = pd2.alloc_mr(16, ALL_REMOTE).unwrap();
    q1.post_send([signaled(SendWr::inline(
        1,
        SendOp::RdmaWrite {
            remote_addr: mr.iova(),
            rkey: mr.rkey(),
        },
        b"cross-device",
    ))])
    .unwrap();
    assert!(poll_n(&cq1, 1)[0].is_ok());
    assert_eq!(&mr.to_vec()[..12], b"cross-device");
}

#[test]
fn device_limits_are_enforced() {
    let limits = Limits {
        max_qp: 2,
        max_cq: 2,
        max_pd: 1,
        max_mr: 2,
        ..Limits::default()
    };
    let dev = Device::builder()
        .name("tiny")
        .gid("fe80::71".parse().unwrap())
        .limits(limits)
        .build()
        .unwrap();
    let ctx = dev.open().unwrap();
    assert_eq!(ctx.query_device().max_qp, 2);
    let pd = ctx.alloc_pd().unwrap();
    assert_eq!(ctx.alloc_pd().err().map(|e| e.errno()), Some(12));
    let cq = ctx.create_cq(4, None).unwrap();
    let _cq2 = ctx.create_cq(4, None).unwrap();
    assert!(ctx.create_cq(4, None).is_err());
    let _q1 = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let q2 = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    assert_eq!(
        pd.create_qp(&QpInitAttr::rc(&cq, &cq))
            .err()
            .map(|e| e.errno()),
        Some(12)
    );
    drop(q2);
    pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let _m1 = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let _m2 = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).is_err());
}

#[test]
fn configuration_errors_are_typed() {
    assert!(matches!(
        Device::builder().name("x").set("mtu", "1500"),
        Err(Error::Config(_))
    ));
    assert!(matches!(Device::builder().build(), Err(Error::Config(_))));
    let bad = Limits {
        max_sge: 0,
        ..Limits::default()
    };
    assert!(
        Device::builder()
            .name("bad-limits")
            .gid("fe80::bad".parse().unwrap())
            .limits(bad)
            .build()
            .is_err()
    );
}
