//! Memory-region access flags: every rejected combination, and what takes effect.

use crate::common::*;
use softverbs::*;

const LW: u32 = 1;
const RW: u32 = 2;
const RR: u32 = 4;
const RA: u32 = 8;

#[test]
fn remote_write_or_atomic_without_local_write_is_einval() {
    let pd = ctx().alloc_pd().unwrap();
    let mut buf = vec![0u8; 64];
    // Every combination of the four basic bits: the ones with RW or RA but no LW fail.
    for bits in 0..16u32 {
        let r = pd.reg_mr(&mut buf, AccessFlags::from_bits_retain(bits));
        let bad = bits & (RW | RA) != 0 && bits & LW == 0;
        match r {
            Ok(mr) => {
                assert!(!bad, "{bits:#x} must be rejected");
                assert_eq!(mr.access().bits(), bits);
            }
            Err(e) => {
                assert!(bad, "{bits:#x} must be accepted: {e}");
                assert!(matches!(e, Error::InvalidArgument(_)));
                assert_eq!(e.errno(), 22);
            }
        }
    }
}

#[test]
fn unknown_mandatory_bits_are_einval() {
    let pd = ctx().alloc_pd().unwrap();
    let mut buf = vec![0u8; 64];
    for bit in (10..20).chain(30..32) {
        let e = pd
            .reg_mr(&mut buf, AccessFlags::from_bits_retain(LW | 1 << bit))
            .unwrap_err();
        assert_eq!(e.errno(), 22, "bit {bit}");
    }
}

#[test]
fn known_but_unimplemented_bits_are_unsupported() {
    let pd = ctx().alloc_pd().unwrap();
    let mut buf = vec![0u8; 64];
    // Persistent flush needs persistent memory, which a software NIC has not.
    let e = pd
        .reg_mr(
            &mut buf,
            AccessFlags::FLUSH_PERSISTENT | AccessFlags::LOCAL_WRITE,
        )
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert_eq!(e.errno(), 95);
    // Global flush, windows and on-demand paging are implemented: accepted.
    let ok = AccessFlags::FLUSH_GLOBAL | AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE;
    assert_eq!(pd.reg_mr(&mut buf, ok).unwrap().access(), ok);
}

#[test]
fn unsupported_optional_bits_are_accepted_and_reported_as_not_in_effect() {
    let pd = ctx().alloc_pd().unwrap();
    let mut buf = vec![0u8; 64];
    // Bit 20 (RELAXED_ORDERING) is supported and stays: see relaxed.rs.
    for bit in 21..30 {
        let mr = pd
            .reg_mr(&mut buf, AccessFlags::from_bits_retain(LW | RR | 1 << bit))
            .unwrap();
        assert_eq!(mr.access().bits(), LW | RR, "optional bit {bit} dropped");
    }
    let mr = pd
        .reg_mr(
            &mut buf,
            AccessFlags::LOCAL_WRITE | AccessFlags::RELAXED_ORDERING,
        )
        .unwrap();
    assert!(mr.access().contains(AccessFlags::RELAXED_ORDERING));
}

#[test]
fn zero_based_and_chosen_iova_registrations() {
    let p = pair(QpType::Rc);
    let mut zb = vec![0u8; 128];
    let mut at = vec![0u8; 128];
    let zmr =
        p.pd.reg_mr(&mut zb, ALL_REMOTE | AccessFlags::ZERO_BASED)
            .unwrap();
    assert_eq!(zmr.iova(), 0);
    let imr =
        p.pd.reg_mr_iova(&mut at, 0x1_0000_0000, ALL_REMOTE)
            .unwrap();
    assert_eq!(imr.iova(), 0x1_0000_0000);
    let s = [imr.sge(0..5)];
    imr.write_at(0, b"hello").unwrap();
    // Peers address a zero-based region by offset.
    p.a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaWrite {
            remote_addr: 10,
            rkey: zmr.rkey(),
        },
        &s,
    ))])
    .unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    drop(p.a);
    assert_eq!(&zmr.to_vec()[10..15], b"hello");
}

#[test]
fn registration_limits() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let max = ctx.query_device().max_mr_size;
    let e = unsafe {
        pd.reg_mr_raw(
            std::ptr::dangling_mut(),
            max as usize + 1,
            0,
            AccessFlags::LOCAL_WRITE,
        )
    };
    assert_eq!(e.unwrap_err().errno(), 22);
}

#[test]
fn qp_access_flags_gate_remote_operations() {
    // A QP without REMOTE_WRITE rejects WRITEs even to an MR that allows them.
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let a = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    let b = pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    a.connect(&b.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    b.connect(
        &a.endpoint(0).unwrap(),
        0,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
    )
    .unwrap();
    let mr = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let s = [mr.sge(0..8)];
    a.post_send([signaled(SendWr::new(
        1,
        SendOp::RdmaRead {
            remote_addr: mr.iova() + 8,
            rkey: mr.rkey(),
        },
        &s,
    ))])
    .unwrap();
    assert!(poll_n(&cq, 1)[0].is_ok());
    a.post_send([signaled(SendWr::new(
        2,
        SendOp::RdmaWrite {
            remote_addr: mr.iova() + 8,
            rkey: mr.rkey(),
        },
        &s,
    ))])
    .unwrap();
    assert_eq!(poll_n(&cq, 1)[0].status(), WcStatus::RemInvReqErr);
    assert_eq!(a.state(), QpState::Err);
}
