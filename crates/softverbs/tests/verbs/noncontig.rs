//! Non-contiguous memory regions (seed 002) in one process: SG and interleaved layouts, nesting,
//! page lists and bitmaps, used as local and remote keys; every set-layout result; key
//! changes; bind work requests; dereg busy; atomics into layouts.

use crate::common::*;
use proptest::prelude::*;
use softverbs::*;

const NONE: SetLayoutFlags = SetLayoutFlags::empty();

fn datum(mr: &MemoryRegion<'_>, off: usize, len: usize) -> Datum {
    Datum::new(mr.lkey(), mr.iova() + off as u64, len as u64)
}

fn entry(first: Datum, dims: &[(u64, u64)]) -> InterleavedEntry {
    InterleavedEntry::new(first, dims.iter().map(|&(s, c)| Dim::new(s, c)).collect())
}

/// Sends `len` bytes at `sge` from `a` and returns what `b` received (into a fresh buffer).
fn send_and_receive(p: &Pair, sge: Sge) -> Vec<u8> {
    let len = sge.length as usize;
    let dst = p.pd.alloc_mr(len.max(1), ALL_REMOTE).unwrap();
    p.b.post_recv([RecvWr::new(7, &[dst.sge(0..len)])]).unwrap();
    p.a.post_send([signaled(SendWr::new(1, SendOp::Send, &[sge]))])
        .unwrap();
    let wc = poll_n(&p.cq_a, 1);
    assert!(wc[0].is_ok(), "{wc:?}");
    let wc = poll_n(&p.cq_b, 1);
    assert!(wc[0].is_ok(), "{wc:?}");
    assert_eq!(wc[0].byte_len() as usize, len);
    dst.to_vec()[..len].to_vec()
}

/// One signaled work request on `a`; returns its completion.
fn one(p: &Pair, op: SendOp, sges: &[Sge]) -> WorkCompletion {
    p.a.post_send([signaled(SendWr::new(9, op, sges))]).unwrap();
    poll_n(&p.cq_a, 1)[0]
}

fn whole(mr: &MemoryRegion<'_>) -> Sge {
    Sge {
        addr: mr.iova(),
        length: mr.len() as u32,
        lkey: mr.lkey(),
    }
}

#[test]
fn caps_are_reported() {
    let caps = ctx().query_device().mr_layout_caps;
    assert_eq!(caps, LayoutCaps::DEFAULT);
    assert!(
        caps.cap_flags
            .contains(LayoutCapFlags::SG | LayoutCapFlags::INTERLEAVED)
    );
    assert!(caps.max_nesting_level >= 2);
}

#[test]
fn seed_example_swap_odd_and_even_items_without_touching_memory() {
    let p = pair(QpType::Rc);
    let item = 24usize;
    let contig = p.pd.alloc_mr(item * 100, ALL_REMOTE).unwrap();
    let data = pattern(item * 100, 3);
    contig.write_at(0, &data).unwrap();
    let noncontig = p.pd.create_layout_mr(AccessFlags::empty()).unwrap();
    assert!(noncontig.is_layout());
    assert_eq!(noncontig.len(), 0);
    let dims = [(2 * item as u64, 50)];
    noncontig
        .set_layout_interleaved(
            NONE,
            &[
                entry(datum(&contig, item, item), &dims), // item[1] first
                entry(datum(&contig, 0, item), &dims),    // then item[0]
            ],
        )
        .unwrap();
    assert_eq!(noncontig.len(), item * 100);
    assert_eq!(noncontig.iova(), 0);
    let got = send_and_receive(&p, noncontig.sge(0..item * 100));
    for i in 0..100 {
        let j = i ^ 1;
        assert_eq!(
            got[i * item..][..item],
            data[j * item..][..item],
            "item {i}"
        );
    }
    // Memory itself is untouched.
    assert_eq!(contig.to_vec(), data);
}

#[test]
fn seed_example_one_send_from_two_buffers() {
    let p = pair(QpType::Rc);
    let (len1, len2) = (1000, 333);
    let mr1 = p.pd.alloc_mr(len1, ALL_REMOTE).unwrap();
    let mr2 = p.pd.alloc_mr(len2, ALL_REMOTE).unwrap();
    mr1.write_at(0, &pattern(len1, 1)).unwrap();
    mr2.write_at(0, &pattern(len2, 2)).unwrap();
    let mr3 = p.pd.create_layout_mr(AccessFlags::empty()).unwrap();
    mr3.set_layout_sg(NONE, &[whole(&mr1), whole(&mr2)])
        .unwrap();
    let got = send_and_receive(&p, mr3.sge(0..len1 + len2));
    let mut want = pattern(len1, 1);
    want.extend(pattern(len2, 2));
    assert_eq!(got, want);
    // A sub-range across the boundary.
    let got = send_and_receive(&p, mr3.sge(len1 - 10..len1 + 10));
    assert_eq!(got, want[len1 - 10..len1 + 10]);
}

#[test]
fn a_receive_scatters_into_a_layout() {
    // The receive side of the seed's swap: a contiguous message lands as a matrix column,
    // through one receive SGE on the layout's lkey, and nothing else of the matrix changes.
    let p = pair(QpType::Rc);
    let n = 32usize;
    let m = p.pd.alloc_mr(n * n * 8, ALL_REMOTE).unwrap();
    let before = pattern(n * n * 8, 4);
    m.write_at(0, &before).unwrap();
    let col = p.pd.create_layout_mr(AccessFlags::LOCAL_WRITE).unwrap();
    let c = 5usize;
    col.set_layout_interleaved(
        NONE,
        &[entry(datum(&m, c * 8, 8), &[((n * 8) as u64, n as u64)])],
    )
    .unwrap();
    assert_eq!(col.len(), n * 8);
    let src = p.pd.alloc_mr(n * 8, ALL_REMOTE).unwrap();
    let msg = pattern(n * 8, 200);
    src.write_at(0, &msg).unwrap();
    p.b.post_recv([RecvWr::new(9, &[col.sge(0..n * 8)])])
        .unwrap();
    p.a.post_send([signaled(SendWr::new(1, SendOp::Send, &[src.sge(0..n * 8)]))])
        .unwrap();
    assert!(poll_n(&p.cq_a, 1)[0].is_ok());
    let wc = poll_n(&p.cq_b, 1);
    assert!(wc[0].is_ok(), "{wc:?}");
    assert_eq!(wc[0].byte_len() as usize, n * 8);
    let mut want = before.clone();
    for r in 0..n {
        want[(r * n + c) * 8..][..8].copy_from_slice(&msg[r * 8..][..8]);
    }
    assert_eq!(m.to_vec(), want);
    // A receive layout without LOCAL_WRITE is a local protection error, and writes nothing.
    let ro = p.pd.create_layout_mr(AccessFlags::empty()).unwrap();
    ro.set_layout_interleaved(
        NONE,
        &[entry(datum(&m, 0, 8), &[((n * 8) as u64, n as u64)])],
    )
    .unwrap();
    p.b.post_recv([RecvWr::new(10, &[ro.sge(0..n * 8)])])
        .unwrap();
    p.a.post_send([signaled(SendWr::new(2, SendOp::Send, &[src.sge(0..n * 8)]))])
        .unwrap();
    let wc = poll_n(&p.cq_b, 1);
    assert_eq!(wc[0].status(), WcStatus::LocProtErr, "{wc:?}");
    assert_eq!(
        m.to_vec(),
        want,
        "nothing placed through a read-only layout"
    );
}

/// A row-major `n x n` matrix of 8-byte cells.
fn matrix(p: &Pair, n: usize) -> (MemoryRegion<'static>, Vec<u8>) {
    let m = p.pd.alloc_mr(n * n * 8, ALL_REMOTE).unwrap();
    let data = pattern(n * n * 8, 9);
    m.write_at(0, &data).unwrap();
    (m, data)
}

#[test]
fn matrix_column_and_sub_block_as_local_and_remote_keys() {
    let p = pair(QpType::Rc);
    let n = 64usize;
    let (m, data) = matrix(&p, n);
    let cell = |r: usize, c: usize| &data[(r * n + c) * 8..][..8];
    // Column 5: one SGE, received contiguous.
    let col = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    col.set_layout_interleaved(
        NONE,
        &[entry(datum(&m, 5 * 8, 8), &[((n * 8) as u64, n as u64)])],
    )
    .unwrap();
    let got = send_and_receive(&p, col.sge(0..n * 8));
    let want: Vec<u8> = (0..n).flat_map(|r| cell(r, 5).to_vec()).collect();
    assert_eq!(got, want);
    // 2-D sub-block rows 10..20, columns 3..7: dims (cell stride, 4) then (row stride, 10).
    let blk = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    blk.set_layout_interleaved(
        NONE,
        &[entry(
            datum(&m, (10 * n + 3) * 8, 8),
            &[(8, 4), ((n * 8) as u64, 10)],
        )],
    )
    .unwrap();
    assert_eq!(blk.len(), 40 * 8);
    let got = send_and_receive(&p, blk.sge(0..40 * 8));
    let want: Vec<u8> = (10..20)
        .flat_map(|r| (3..7).map(move |c| (r, c)))
        .flat_map(|(r, c)| cell(r, c).to_vec())
        .collect();
    assert_eq!(got, want);
    // The reverse: a remote WRITE of a contiguous buffer into the column.
    let src = p.pd.alloc_mr(n * 8, ALL_REMOTE).unwrap();
    let fresh = pattern(n * 8, 77);
    src.write_at(0, &fresh).unwrap();
    let wc = one(
        &p,
        SendOp::RdmaWrite {
            remote_addr: 0,
            rkey: col.rkey(),
        },
        &[src.sge(0..n * 8)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    let after = m.to_vec();
    for r in 0..n {
        for c in 0..n {
            let want = if c == 5 {
                &fresh[r * 8..][..8]
            } else {
                cell(r, c)
            };
            assert_eq!(&after[(r * n + c) * 8..][..8], want, "cell {r},{c}");
        }
    }
    // And an RDMA READ of the sub-block into a contiguous buffer.
    let dst = p.pd.alloc_mr(40 * 8, ALL_REMOTE).unwrap();
    let wc = one(
        &p,
        SendOp::RdmaRead {
            remote_addr: 0,
            rkey: blk.rkey(),
        },
        &[dst.sge(0..40 * 8)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    let want: Vec<u8> = (10..20)
        .flat_map(|r| (3..7).map(move |c| (r, c)))
        .flat_map(|(r, c)| after[(r * n + c) * 8..][..8].to_vec())
        .collect();
    assert_eq!(dst.to_vec(), want);
    // Out of the layout's bounds: a remote access error.
    let wc = one(
        &p,
        SendOp::RdmaRead {
            remote_addr: 8,
            rkey: blk.rkey(),
        },
        &[dst.sge(0..40 * 8)],
    );
    assert_eq!(wc.status(), WcStatus::RemAccessErr);
}

#[test]
fn nested_sg_of_interleaved_layouts() {
    let p = pair(QpType::Rc);
    let n = 16usize;
    let (m, data) = matrix(&p, n);
    let extra = p.pd.alloc_mr(100, ALL_REMOTE).unwrap();
    extra.write_at(0, &pattern(100, 5)).unwrap();
    let col = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    col.set_layout_interleaved(
        NONE,
        &[entry(datum(&m, 2 * 8, 8), &[((n * 8) as u64, n as u64)])],
    )
    .unwrap();
    let outer = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    outer
        .set_layout_sg(
            NONE,
            &[
                Sge {
                    addr: 8,
                    length: (n as u32 - 2) * 8,
                    lkey: col.lkey(),
                },
                extra.sge(0..100),
            ],
        )
        .unwrap();
    let got = send_and_receive(&p, outer.sge(0..outer.len()));
    let mut want: Vec<u8> = (1..n - 1)
        .flat_map(|r| data[(r * n + 2) * 8..][..8].to_vec())
        .collect();
    want.extend(pattern(100, 5));
    assert_eq!(got, want);
    // Nesting deeper than the caps allow is unsupported.
    let caps = ctx().query_device().mr_layout_caps;
    let mut chain = vec![col];
    while chain.len() < caps.max_nesting_level as usize {
        let inner = chain.last().unwrap();
        let next = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
        next.set_layout_sg(NONE, &[inner.sge(0..8)]).unwrap();
        chain.push(next);
    }
    let too_deep = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    let err = too_deep
        .set_layout_sg(NONE, &[chain.last().unwrap().sge(0..8)])
        .unwrap_err();
    assert_eq!(
        set_layout_code(&err),
        Some(LayoutError::ERR_UNSUPPORTED),
        "{err}"
    );
    // The deepest allowed chain works end to end.
    let got = send_and_receive(&p, chain.last().unwrap().sge(0..8));
    assert_eq!(got, data[2 * 8..][..8]);
}

#[test]
fn every_set_layout_error_leaves_the_old_layout_in_force() {
    let p = pair(QpType::Rc);
    let buf = p.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    buf.write_at(0, &pattern(4096, 4)).unwrap();
    let other_pd = p.ctx.alloc_pd().unwrap();
    let foreign = other_pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let c = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    c.set_layout_sg(NONE, &[buf.sge(100..200)]).unwrap();
    let key = c.lkey();
    let input = LayoutError::ERR_INPUT;
    let unsupported = LayoutError::ERR_UNSUPPORTED;
    let cases: Vec<(&str, Result<()>, i32)> = vec![
        ("empty SG", c.set_layout_sg(NONE, &[]), input),
        (
            "zero-length SGE",
            c.set_layout_sg(NONE, &[buf.sge(0..0)]),
            input,
        ),
        (
            "unknown key",
            c.set_layout_sg(
                NONE,
                &[Sge {
                    addr: 0,
                    length: 8,
                    lkey: 0x00ff_ff01,
                }],
            ),
            input,
        ),
        (
            "another PD",
            c.set_layout_sg(NONE, &[foreign.sge(0..8)]),
            input,
        ),
        (
            "outside its region",
            c.set_layout_sg(
                NONE,
                &[Sge {
                    addr: buf.iova() + 4000,
                    length: 100,
                    lkey: buf.lkey(),
                }],
            ),
            input,
        ),
        (
            "plain buffer without REGISTER_BUFFERS",
            c.set_layout_sg(
                NONE,
                &[Sge {
                    addr: 0x1000,
                    length: 8,
                    lkey: PLAIN_KEY,
                }],
            ),
            input,
        ),
        (
            "REGISTER_BUFFERS through the safe call",
            c.set_layout_sg(SetLayoutFlags::REGISTER_BUFFERS, &[buf.sge(0..8)]),
            input,
        ),
        (
            // A capability this library does not have, as the C calls say too.
            "unknown flag",
            c.set_layout_sg(SetLayoutFlags::from_bits_retain(1 << 9), &[buf.sge(0..8)]),
            unsupported,
        ),
        ("itself", c.set_layout_sg(NONE, &[c.sge(0..8)]), input),
        (
            "not a layout container",
            buf.set_layout_sg(NONE, &[buf.sge(0..8)]),
            input,
        ),
        (
            "datum_count 0",
            c.set_layout_interleaved(NONE, &[entry(datum(&buf, 0, 8), &[(8, 0)])]),
            input,
        ),
        (
            "no dimensions",
            c.set_layout_interleaved(NONE, &[entry(datum(&buf, 0, 8), &[])]),
            input,
        ),
        (
            "stride overflow",
            c.set_layout_interleaved(NONE, &[entry(datum(&buf, 0, 8), &[(u64::MAX, 3)])]),
            input,
        ),
        (
            "too many dimensions",
            c.set_layout_interleaved(NONE, &[entry(datum(&buf, 0, 1), &[(0, 1); 9])]),
            unsupported,
        ),
        (
            "too many SGEs",
            c.set_layout_sg(NONE, &vec![buf.sge(0..1); 4097]),
            unsupported,
        ),
        (
            "num_repeated beyond max_repeat",
            c.set_layout_interleaved(
                NONE,
                &[entry(datum(&buf, 0, 1), &[(1, 1)]).repeated(1 << 20)],
            ),
            unsupported,
        ),
        (
            "more room with AVOID_INVALIDATION",
            c.set_layout_sg(SetLayoutFlags::AVOID_INVALIDATION, &vec![buf.sge(0..1); 17]),
            LayoutError::ERR_WOULD_INVALIDATE,
        ),
    ];
    for (what, r, code) in cases {
        let err = r.expect_err(what);
        assert_eq!(set_layout_code(&err), Some(code), "{what}: {err}");
        let errno = match code {
            -1 => 22,
            -2 => 16,
            _ => 95,
        };
        assert_eq!(err.errno(), errno, "{what}: {err}");
        // The old layout and key still work.
        assert_eq!(c.lkey(), key, "{what}");
        assert_eq!(c.len(), 100, "{what}");
        assert_eq!(
            send_and_receive(&p, c.sge(0..100)),
            pattern(4096, 4)[100..200],
            "{what}"
        );
    }
}

#[test]
fn keys_change_only_when_the_layout_needs_more_room() {
    let p = pair(QpType::Rc);
    let buf = p.pd.alloc_mr(4096, ALL_REMOTE).unwrap();
    buf.write_at(0, &pattern(4096, 6)).unwrap();
    let c = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    let k0 = c.rkey();
    // Up to max_inline_num_sg (16) SGEs fit in the key entry: the key stays.
    let caps = ctx().query_device().mr_layout_caps;
    let sges = |n: usize| {
        (0..n)
            .map(|i| buf.sge(i * 10..i * 10 + 5))
            .collect::<Vec<_>>()
    };
    c.set_layout_sg(NONE, &sges(caps.max_inline_sg as usize))
        .unwrap();
    assert_eq!(c.rkey(), k0);
    c.set_layout_sg(SetLayoutFlags::AVOID_INVALIDATION, &sges(3))
        .unwrap();
    assert_eq!(c.rkey(), k0);
    // One more fails with AVOID_INVALIDATION...
    let err = c
        .set_layout_sg(SetLayoutFlags::AVOID_INVALIDATION, &sges(17))
        .unwrap_err();
    assert!(matches!(err, Error::Busy(_)), "{err}");
    assert_eq!(c.rkey(), k0);
    // ...and changes the keys without it: the old key stops working at once.
    c.set_layout_sg(NONE, &sges(17)).unwrap();
    let k1 = c.rkey();
    assert_ne!(k1, k0);
    assert_eq!(c.lkey(), k1);
    let dst = p.pd.alloc_mr(85, ALL_REMOTE).unwrap();
    let wc = one(
        &p,
        SendOp::RdmaRead {
            remote_addr: 0,
            rkey: k1,
        },
        &[dst.sge(0..85)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    let want: Vec<u8> = (0..17)
        .flat_map(|i| pattern(4096, 6)[i * 10..][..5].to_vec())
        .collect();
    assert_eq!(dst.to_vec(), want);
    // The room stays: the same count again (or fewer) keeps the new key.
    c.set_layout_sg(SetLayoutFlags::AVOID_INVALIDATION, &sges(17))
        .unwrap();
    c.set_layout_sg(SetLayoutFlags::AVOID_INVALIDATION, &sges(2))
        .unwrap();
    assert_eq!(c.rkey(), k1);
    // The old key: a remote access error (on a fresh pair, since errors break an RC QP).
    let q = pair(QpType::Rc);
    let dst = q.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    let wc = one(
        &q,
        SendOp::RdmaRead {
            remote_addr: 0,
            rkey: k0,
        },
        &[dst.sge(0..8)],
    );
    assert_eq!(wc.status(), WcStatus::RemAccessErr);
}

#[test]
fn bind_work_request_applies_a_staged_layout_in_program_order() {
    let p = pair(QpType::Rc);
    let buf = p.pd.alloc_mr(256, ALL_REMOTE).unwrap();
    buf.write_at(0, &pattern(256, 8)).unwrap();
    let c = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    c.set_layout_sg(NONE, &[buf.sge(0..16)]).unwrap();
    // Staged: the old layout stays in force until the bind executes.
    c.set_layout_sg(
        SetLayoutFlags::WITH_POST_WR,
        &[buf.sge(100..132), buf.sge(0..8)],
    )
    .unwrap();
    assert_eq!(c.len(), 16);
    assert_eq!(send_and_receive(&p, c.sge(0..16)), pattern(256, 8)[..16]);
    // Bind and use it in the same post: the send after the bind sees the new layout.
    let dst = p.pd.alloc_mr(40, ALL_REMOTE).unwrap();
    p.b.post_recv([RecvWr::new(1, &[dst.sge(0..40)])]).unwrap();
    let sge = [Sge {
        addr: 0,
        length: 40,
        lkey: c.lkey(),
    }];
    p.a.post_send([
        signaled(SendWr::new(10, SendOp::BindLayout { key: c.lkey() }, &[])),
        signaled(SendWr::new(11, SendOp::Send, &sge)),
    ])
    .unwrap();
    let wc = poll_n(&p.cq_a, 2);
    assert_eq!(
        (wc[0].wr_id(), wc[0].status(), wc[0].opcode()),
        (10, WcStatus::Success, WcOpcode::BindMw)
    );
    assert!(wc[1].is_ok(), "{wc:?}");
    assert!(poll_n(&p.cq_b, 1)[0].is_ok());
    let mut want = pattern(256, 8)[100..132].to_vec();
    want.extend_from_slice(&pattern(256, 8)[..8]);
    assert_eq!(dst.to_vec(), want);
    assert_eq!(c.len(), 40);
    // A bind with nothing staged is a bind error.
    let wc = one(&p, SendOp::BindLayout { key: c.lkey() }, &[]);
    assert_eq!(
        (wc.status(), wc.opcode()),
        (WcStatus::MwBindErr, WcOpcode::BindMw)
    );
    // A bind with data is refused at post time.
    let q = pair(QpType::Rc);
    let err =
        q.a.post_send([SendWr::new(
            1,
            SendOp::BindLayout { key: 1 },
            &[buf.sge(0..1)],
        )])
        .unwrap_err();
    assert_eq!(err.error.errno(), 22);
}

#[test]
fn an_mr_used_by_a_layout_is_busy_until_the_layout_lets_go() {
    let p = pair(QpType::Rc);
    let a = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let b = p.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let c = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    c.set_layout_sg(NONE, &[a.sge(0..8), a.sge(16..24)])
        .unwrap();
    let (a, err) = a.dereg().unwrap_err();
    assert!(matches!(err, Error::Busy(_)), "{err}");
    assert_eq!(err.errno(), 16);
    // Re-laid-out onto `b`: `a` is free, `b` busy.
    c.set_layout_sg(NONE, &[b.sge(0..8)]).unwrap();
    a.dereg().unwrap();
    let (b, _) = b.dereg().unwrap_err();
    // A staged layout counts too.
    drop(c);
    b.dereg().unwrap();
}

#[test]
fn atomics_into_a_layout_need_one_aligned_datum() {
    let p = pair(QpType::Rc);
    let buf = p.pd.alloc_mr(256, ALL_REMOTE).unwrap();
    buf.store_u64(64, 40).unwrap();
    let result = p.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    let c = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    c.set_layout_sg(
        NONE,
        &[
            buf.sge(0..8),
            buf.sge(64..72),
            buf.sge(132..140),
            buf.sge(200..204),
            buf.sge(208..212),
        ],
    )
    .unwrap();
    let fadd = |remote_addr| SendOp::FetchAdd {
        remote_addr,
        rkey: c.rkey(),
        add: 2,
    };
    let wc = one(&p, fadd(8), &[result.sge(0..8)]);
    assert!(wc.is_ok(), "{wc:?}");
    assert_eq!(result.load_u64(0).unwrap(), 40);
    assert_eq!(buf.load_u64(64).unwrap(), 42);
    // A datum at an unaligned address: invalid request.
    let wc = one(&p, fadd(16), &[result.sge(0..8)]);
    assert_eq!(wc.status(), WcStatus::RemInvReqErr);
    // 8 bytes across two data.
    let q = pair(QpType::Rc);
    let buf = q.pd.alloc_mr(256, ALL_REMOTE).unwrap();
    let result = q.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    let c = q.pd.create_layout_mr(ALL_REMOTE).unwrap();
    c.set_layout_sg(NONE, &[buf.sge(200..204), buf.sge(208..212)])
        .unwrap();
    let wc = one(
        &q,
        SendOp::CmpSwap {
            remote_addr: 0,
            rkey: c.rkey(),
            compare: 0,
            swap: 1,
        },
        &[result.sge(0..8)],
    );
    assert_eq!(wc.status(), WcStatus::RemInvReqErr);
    assert_eq!(buf.to_vec(), vec![0; 256]);
}

#[test]
fn rights_are_checked_per_piece_and_on_the_container() {
    let p = pair(QpType::Rc);
    let ro =
        p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
            .unwrap();
    let c = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    c.set_layout_sg(NONE, &[ro.sge(0..8)]).unwrap();
    let src = p.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    let wc = one(
        &p,
        SendOp::RdmaWrite {
            remote_addr: 0,
            rkey: c.rkey(),
        },
        &[src.sge(0..8)],
    );
    assert_eq!(wc.status(), WcStatus::RemAccessErr);
    // A container without remote rights refuses remote access even over writable pieces.
    let q = pair(QpType::Rc);
    let rw = q.pd.alloc_mr(64, ALL_REMOTE).unwrap();
    let c = q.pd.create_layout_mr(AccessFlags::LOCAL_WRITE).unwrap();
    c.set_layout_sg(NONE, &[rw.sge(0..8)]).unwrap();
    let src = q.pd.alloc_mr(8, ALL_REMOTE).unwrap();
    let wc = one(
        &q,
        SendOp::RdmaWrite {
            remote_addr: 0,
            rkey: c.rkey(),
        },
        &[src.sge(0..8)],
    );
    assert_eq!(wc.status(), WcStatus::RemAccessErr);
}

#[test]
fn register_buffers_takes_plain_memory() {
    let p = pair(QpType::Rc);
    let mut plain = vec![0u8; 64];
    plain[..10].copy_from_slice(b"0123456789");
    let mr = p.pd.alloc_mr(16, ALL_REMOTE).unwrap();
    mr.write_at(0, b"abcdefghijklmnop").unwrap();
    let c = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
    // SAFETY: `plain` outlives `c` (dropped at the end of the test, after `c`).
    unsafe {
        c.set_layout_sg_raw(
            SetLayoutFlags::REGISTER_BUFFERS,
            &[
                Sge {
                    addr: plain.as_ptr() as u64,
                    length: 10,
                    lkey: PLAIN_KEY,
                },
                mr.sge(0..4),
            ],
        )
        .unwrap();
    }
    assert_eq!(send_and_receive(&p, c.sge(0..14)), b"0123456789abcd");
    drop(c);
    drop(plain);
}

#[test]
fn page_list_and_bitmap_registrations_with_rdma_read_and_write() {
    let p = pair(QpType::Rc);
    let page = 4096usize;
    let backing = p.pd.alloc_mr(8 * page, ALL_REMOTE).unwrap();
    let data = pattern(8 * page, 12);
    backing.write_at(0, &data).unwrap();
    let base = backing.as_ptr();
    // Pages 5, 2, 3 (2 and 3 merge), 7, starting 100 bytes into page 5.
    let order = [5usize, 2, 3, 7];
    let pages: Vec<*const u8> = order
        .iter()
        .map(|&i| base.wrapping_add(i * page) as *const u8)
        .collect();
    let len = 3 * page + 50;
    let iova = 0x7000_0000_0000u64;
    // SAFETY: `backing` outlives the registration (dropped after it).
    let pl = unsafe { p.pd.reg_mr_pages(&pages, page, 100, len, iova, ALL_REMOTE) }.unwrap();
    assert_eq!((pl.iova(), pl.len()), (iova, len));
    let model: Vec<usize> = order
        .iter()
        .flat_map(|&i| i * page..(i + 1) * page)
        .skip(100)
        .take(len)
        .collect();
    let dst = p.pd.alloc_mr(len, ALL_REMOTE).unwrap();
    let wc = one(
        &p,
        SendOp::RdmaRead {
            remote_addr: iova,
            rkey: pl.rkey(),
        },
        &[dst.sge(0..len)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    let want: Vec<u8> = model.iter().map(|&i| data[i]).collect();
    assert_eq!(dst.to_vec(), want);
    // WRITE 5000 bytes at IOVA + 4000 (across the merged run and into page 7).
    let src = p.pd.alloc_mr(5000, ALL_REMOTE).unwrap();
    let fresh = pattern(5000, 99);
    src.write_at(0, &fresh).unwrap();
    let wc = one(
        &p,
        SendOp::RdmaWrite {
            remote_addr: iova + 4000,
            rkey: pl.rkey(),
        },
        &[src.sge(0..5000)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    let mut expect = data.clone();
    for (k, &i) in model[4000..9000].iter().enumerate() {
        expect[i] = fresh[k];
    }
    assert_eq!(backing.to_vec(), expect);

    // Bitmap: pages 1, 4, 6 of the same buffer, zero-based.
    let bm = unsafe {
        p.pd.reg_mr_bitmap(
            base,
            page,
            &[0b101_0010],
            0,
            ALL_REMOTE | AccessFlags::ZERO_BASED,
        )
    }
    .unwrap();
    assert_eq!((bm.iova(), bm.len()), (0, 3 * page));
    let dst = p.pd.alloc_mr(3 * page, ALL_REMOTE).unwrap();
    let wc = one(
        &p,
        SendOp::RdmaRead {
            remote_addr: 0,
            rkey: bm.rkey(),
        },
        &[dst.sge(0..3 * page)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    let now = backing.to_vec();
    let want: Vec<u8> = [1, 4, 6]
        .iter()
        .flat_map(|&i| now[i * page..(i + 1) * page].to_vec())
        .collect();
    assert_eq!(dst.to_vec(), want);
    // Malformed lists are input errors.
    let bad = unsafe { p.pd.reg_mr_pages(&pages, 3000, 0, 10, 0, ALL_REMOTE) };
    assert!(matches!(bad, Err(Error::InvalidArgument(_))));
    let bad = unsafe {
        p.pd.reg_mr_pages(&pages[..1], page, 0, 2 * page, 0, ALL_REMOTE)
    };
    assert!(matches!(bad, Err(Error::InvalidArgument(_))));
    let bad = unsafe { p.pd.reg_mr_bitmap(base, page, &[0, 0], 0, ALL_REMOTE) };
    assert!(matches!(bad, Err(Error::InvalidArgument(_))));
    drop((pl, bm));
}

/// The naive model of a layout: one byte offset of `buf` per layout byte (the seed's
/// pseudo-code run literally).
fn model(layout: &Layout) -> Vec<usize> {
    let mut out = Vec::new();
    match layout {
        Layout::Sg(list) => {
            for d in list {
                out.extend((d.addr..d.addr + d.len).map(|a| a as usize));
            }
        }
        Layout::Interleaved(list) => {
            let lists: Vec<Vec<u64>> = list
                .iter()
                .map(|e| {
                    let total: u64 = e.dims.iter().map(|d| d.datum_count).product();
                    (0..total)
                        .map(|mut k| {
                            let mut a = e.first.addr;
                            for d in &e.dims {
                                a += (k % d.datum_count) * d.offset_stride;
                                k /= d.datum_count;
                            }
                            a
                        })
                        .collect()
                })
                .collect();
            let mut pos = vec![0usize; list.len()];
            loop {
                let mut any = false;
                for (j, e) in list.iter().enumerate() {
                    for _ in 0..e.num_repeated {
                        if let Some(&a) = lists[j].get(pos[j]) {
                            out.extend((a..a + e.first.len).map(|x| x as usize));
                            pos[j] += 1;
                            any = true;
                        }
                    }
                }
                if !any {
                    break;
                }
            }
        }
    }
    out
}

const BUF: usize = 2048;

fn layout_strategy() -> impl Strategy<Value = Layout> {
    let sg = prop::collection::vec((0usize..BUF - 64, 1usize..64), 1..8).prop_map(|v| {
        Layout::Sg(
            v.into_iter()
                .map(|(a, l)| Datum::new(0, a as u64, l as u64))
                .collect(),
        )
    });
    let entry = (
        0usize..256,
        1u64..16,
        1u32..3,
        prop::collection::vec((0u64..48, 1u64..5), 1..3),
    )
        .prop_map(|(a, l, r, dims)| {
            InterleavedEntry::new(
                Datum::new(0, a as u64, l),
                dims.into_iter().map(|(s, c)| Dim::new(s, c)).collect(),
            )
            .repeated(r)
        });
    let il = prop::collection::vec(entry, 1..4).prop_map(Layout::Interleaved);
    prop_oneof![sg, il]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random layouts over one buffer; random remote WRITE and READ ranges through them,
    /// checked against a byte model.
    #[test]
    fn random_layouts_and_ranges_match_a_byte_model(
        layout in layout_strategy(),
        ops in prop::collection::vec((any::<bool>(), 0.0f64..1.0, 0.0f64..1.0, any::<u8>()), 1..6),
    ) {
        let p = pair(QpType::Rc);
        let buf = p.pd.alloc_mr(BUF, ALL_REMOTE).unwrap();
        let mut mem = pattern(BUF, 1);
        buf.write_at(0, &mem).unwrap();
        let key = buf.lkey();
        let keyed = match &layout {
            Layout::Sg(l) => Layout::Sg(l.iter().map(|d| Datum::new(key, buf.iova() + d.addr, d.len)).collect()),
            Layout::Interleaved(l) => Layout::Interleaved(l.iter().map(|e| {
                let mut e = e.clone();
                e.first = Datum::new(key, buf.iova() + e.first.addr, e.first.len);
                e
            }).collect()),
        };
        let map = model(&layout);
        prop_assume!(map.iter().all(|&a| a < BUF) && !map.is_empty());
        let c = p.pd.create_layout_mr(ALL_REMOTE).unwrap();
        let r = match &keyed {
            Layout::Sg(l) => c.set_layout_sg(NONE, &l.iter().map(|d| Sge { addr: d.addr, length: d.len as u32, lkey: d.lkey() }).collect::<Vec<_>>()),
            Layout::Interleaved(l) => c.set_layout_interleaved(NONE, l),
        };
        r.unwrap();
        prop_assert_eq!(c.len(), map.len());
        let tmp = p.pd.alloc_mr(map.len(), ALL_REMOTE).unwrap();
        for (write, a, b, seed) in ops {
            let off = ((map.len() as f64) * a) as usize % map.len();
            let len = 1 + ((map.len() - off - 1) as f64 * b) as usize;
            if write {
                let src = pattern(len, seed);
                tmp.write_at(0, &src).unwrap();
                let wc = one(&p, SendOp::RdmaWrite { remote_addr: off as u64, rkey: c.rkey() }, &[tmp.sge(0..len)]);
                prop_assert!(wc.is_ok(), "{:?}", wc);
                // Overlapping data: later bytes win, as the copy goes in layout order.
                for (k, &at) in map[off..off + len].iter().enumerate() {
                    mem[at] = src[k];
                }
                prop_assert_eq!(buf.to_vec(), mem.clone());
            } else {
                let wc = one(&p, SendOp::RdmaRead { remote_addr: off as u64, rkey: c.rkey() }, &[tmp.sge(0..len)]);
                prop_assert!(wc.is_ok(), "{:?}", wc);
                let want: Vec<u8> = map[off..off + len].iter().map(|&at| mem[at]).collect();
                prop_assert_eq!(&tmp.to_vec()[..len], &want[..]);
            }
        }
    }
}

trait Lkey {
    fn lkey(&self) -> u32;
}
impl Lkey for Datum {
    fn lkey(&self) -> u32 {
        self.key
    }
}
