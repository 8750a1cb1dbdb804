//! UD multicast through the Rust API: attach, detach, delivery to every member (the sender's
//! own QP included), the group's GID in the GRH, and the errors of attach and detach.

use crate::common::*;
use softverbs::*;

const QKEY: u32 = 0x4d43;

fn group(n: u8) -> Gid {
    Gid([
        0xff, 0x12, 0x40, 0x1b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x53, n,
    ])
}

struct Members {
    ctx: Context,
    pd: ProtectionDomain,
    cqs: Vec<CompletionQueue>,
    qps: Vec<QueuePair>,
    bufs: Vec<MemoryRegion<'static>>,
}

/// `n` UD QPs of one PD, each with its own CQ and a posted 40 + 64-byte receive.
fn members(ctx: Context, n: usize) -> Members {
    let pd = ctx.alloc_pd().unwrap();
    let cqs: Vec<_> = (0..n).map(|_| ctx.create_cq(16, None).unwrap()).collect();
    let qps: Vec<_> = cqs
        .iter()
        .map(|cq| {
            let q = pd.create_qp(&QpInitAttr::new(QpType::Ud, cq, cq)).unwrap();
            q.ready_ud(QKEY, 0).unwrap();
            q
        })
        .collect();
    let bufs: Vec<_> = qps
        .iter()
        .map(|q| {
            let b = pd.alloc_mr(GRH_LEN + 64, ALL_REMOTE).unwrap();
            q.post_recv([RecvWr::new(1, &[b.sge(0..GRH_LEN + 64)])])
                .unwrap();
            b
        })
        .collect();
    Members {
        ctx,
        pd,
        cqs,
        qps,
        bufs,
    }
}

impl Members {
    /// Sends `bytes` from QP `from` to the multicast QPN through `ah` and polls `n`
    /// completions from the sender's CQ (2 for a member sender: its send and its own copy,
    /// in either order), the send's first.
    fn send(&self, from: usize, ah: &AddressHandle, bytes: &[u8], n: usize) -> Vec<WorkCompletion> {
        let src = self.pd.alloc_mr(64, ALL_REMOTE).unwrap();
        src.write_at(0, bytes).unwrap();
        let s = [src.sge(0..bytes.len())];
        self.qps[from]
            .post_send([signaled(SendWr::new(9, SendOp::Send, &s).ud(
                ah,
                MULTICAST_QPN,
                QKEY,
            ))])
            .unwrap();
        let mut wcs = poll_n(&self.cqs[from], n);
        wcs.sort_by_key(|c| c.wr_id() != 9);
        assert_eq!((wcs[0].wr_id(), wcs[0].status()), (9, WcStatus::Success));
        wcs
    }

    fn group_ah(&self, mgid: Gid) -> AddressHandle {
        self.pd
            .create_ah(&AhAttr {
                port_num: 1,
                grh: Some(GlobalRoute {
                    dgid: mgid,
                    hop_limit: 1,
                    ..GlobalRoute::default()
                }),
                ..AhAttr::default()
            })
            .unwrap()
    }
}

#[test]
fn the_device_offers_multicast_groups() {
    let a = ctx().query_device();
    assert!(a.max_mcast_grp > 0 && a.max_mcast_qp_attach > 0, "{a:?}");
    assert_eq!(
        a.max_total_mcast_qp_attach,
        a.max_mcast_grp * a.max_mcast_qp_attach
    );
}

#[test]
fn a_send_to_a_group_reaches_every_attached_qp_with_the_group_in_its_grh() {
    let m = members(ctx(), 4);
    let g = group(1);
    // 0 sends and is a member; 1 and 2 are members; 3 is not.
    for q in &m.qps[..3] {
        q.attach_mcast(g, 0).unwrap();
    }
    m.qps[1].attach_mcast(g, 0).unwrap(); // again: nothing changes
    let ah = m.group_ah(g);
    let own = m.send(0, &ah, b"to the group", 2)[1];
    let sgid = m.ctx.query_gid(1, 0).unwrap();
    for i in 0..3 {
        let wc = if i == 0 { own } else { poll_n(&m.cqs[i], 1)[0] };
        assert_eq!(
            (wc.wr_id(), wc.status()),
            (1, WcStatus::Success),
            "member {i}"
        );
        assert_eq!(wc.byte_len() as usize, GRH_LEN + 12);
        assert_eq!(wc.src_qp(), m.qps[0].qp_num());
        assert!(wc.wc_flags().contains(WcFlags::GRH));
        let got = m.bufs[i].to_vec();
        assert_eq!(&got[8..24], &sgid.0, "source: the sender's GID");
        assert_eq!(&got[24..40], &g.0, "destination: the group");
        assert_eq!(&got[GRH_LEN..GRH_LEN + 12], b"to the group");
        assert_empty(&m.cqs[i]);
    }
    assert_empty(&m.cqs[3]);
    // Detached, 2 gets no more copies; the others do (one copy each, not two for 1).
    m.qps[2].detach_mcast(g, 0).unwrap();
    for i in 0..2 {
        m.qps[i]
            .post_recv([RecvWr::new(2, &[m.bufs[i].sge(0..GRH_LEN + 64)])])
            .unwrap();
    }
    m.send(3, &ah, b"second", 1);
    for i in 0..2 {
        assert_eq!(poll_n(&m.cqs[i], 1)[0].wr_id(), 2, "member {i}");
        assert_empty(&m.cqs[i]);
    }
    assert_empty(&m.cqs[2]);
    assert_empty(&m.cqs[3]);
}

#[test]
fn members_with_another_qkey_drop_the_datagram() {
    let m = members(ctx(), 2);
    let g = group(2);
    m.qps[1].attach_mcast(g, 0).unwrap();
    let other = m.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let s = [other.sge(0..8)];
    let ah = m.group_ah(g);
    m.qps[0]
        .post_send([signaled(SendWr::new(9, SendOp::Send, &s).ud(
            &ah,
            MULTICAST_QPN,
            QKEY + 1,
        ))])
        .unwrap();
    assert!(poll_n(&m.cqs[0], 1)[0].is_ok(), "the sender never knows");
    assert_empty(&m.cqs[1]);
}

#[test]
fn attach_and_detach_refuse_what_the_verbs_refuse() {
    let m = members(ctx(), 1);
    let ud = &m.qps[0];
    let inval = |r: Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(
        inval(ud.attach_mcast(Gid([0xfe; 16]), 0)),
        "not a multicast GID"
    );
    assert!(inval(ud.detach_mcast(group(3), 0)), "not attached");
    let cq = m.ctx.create_cq(4, None).unwrap();
    let rc = m.pd.create_qp(&QpInitAttr::rc(&cq, &cq)).unwrap();
    assert!(inval(rc.attach_mcast(group(3), 0)), "RC");
    ud.attach_mcast(group(3), 0).unwrap();
    ud.detach_mcast(group(3), 0).unwrap();
    assert!(inval(ud.detach_mcast(group(3), 0)), "twice");
}

#[test]
fn on_infiniband_a_group_is_reached_by_its_lid_and_needs_a_multicast_lid() {
    let dev = Device::builder()
        .name("mc-ib")
        .link_layer(LinkLayer::InfiniBand)
        .lid(0x21)
        .gid("fe80::21".parse().unwrap())
        .build()
        .unwrap();
    let m = members(dev.open().unwrap(), 2);
    let g = group(4);
    assert!(matches!(
        m.qps[1].attach_mcast(g, 0x21),
        Err(Error::InvalidArgument(_))
    ));
    m.qps[1].attach_mcast(g, 0xc004).unwrap();
    let ah =
        m.pd.create_ah(&AhAttr {
            dlid: 0xc004,
            port_num: 1,
            ..AhAttr::default()
        })
        .unwrap();
    m.send(0, &ah, b"by lid", 1);
    let wc = poll_n(&m.cqs[1], 1)[0];
    assert_eq!(wc.status(), WcStatus::Success);
    assert_eq!(&m.bufs[1].to_vec()[GRH_LEN..GRH_LEN + 6], b"by lid");
}
