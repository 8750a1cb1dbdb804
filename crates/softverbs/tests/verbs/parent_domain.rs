//! Thread and parent domains through the Rust API: a parent domain is its PD to every check.

use crate::common::*;
use softverbs::*;

#[test]
fn a_parent_domain_is_its_pd_to_every_check() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let td = ctx.alloc_td();
    let parent = pd.alloc_parent_domain(Some(&td)).unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    // A QP made in the parent domain, one in the PD, a region registered in each.
    let a = parent.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let b = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    a.connect(&b.endpoint(1).unwrap(), 2, ALL_REMOTE).unwrap();
    b.connect(&a.endpoint(2).unwrap(), 1, ALL_REMOTE).unwrap();
    let in_parent = parent.alloc_mr(64, ALL_REMOTE).unwrap();
    let in_pd = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    in_parent.write_at(0, &pattern(64, 4)).unwrap();
    let op = SendOp::RdmaWrite {
        remote_addr: in_pd.iova(),
        rkey: in_pd.rkey(),
    };
    a.post_send([signaled(SendWr::new(1, op, &[in_parent.sge(0..64)]))])
        .unwrap();
    assert_eq!(poll_n(&cq, 1)[0].status(), WcStatus::Success);
    assert_eq!(in_pd.to_vec(), pattern(64, 4));
    // And back: the PD's QP writes into the parent domain's region.
    in_pd.write_at(0, &pattern(64, 5)).unwrap();
    let op = SendOp::RdmaWrite {
        remote_addr: in_parent.iova(),
        rkey: in_parent.rkey(),
    };
    b.post_send([signaled(SendWr::new(2, op, &[in_pd.sge(0..64)]))])
        .unwrap();
    assert_eq!(poll_n(&cq, 1)[0].status(), WcStatus::Success);
    assert_eq!(in_parent.to_vec(), pattern(64, 5));
}

#[test]
fn a_parent_domain_refuses_a_foreign_thread_domain_and_a_parent() {
    let (ctx, other) = (ctx(), self::ctx());
    let pd = ctx.alloc_pd().unwrap();
    let foreign = other.alloc_td();
    assert!(matches!(
        pd.alloc_parent_domain(Some(&foreign)),
        Err(Error::InvalidArgument(_))
    ));
    let parent = pd.alloc_parent_domain(None).unwrap();
    assert!(parent.thread_domain().is_none() && !pd.is_parent_domain());
    assert!(matches!(
        parent.alloc_parent_domain(None),
        Err(Error::InvalidArgument(_))
    ));
}
