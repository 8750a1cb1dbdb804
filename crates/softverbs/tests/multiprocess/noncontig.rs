//! Non-contiguous memory regions between two processes: the initiator reads the target's
//! layouts from the target's shared memory (never asking it), resolves them and moves the
//! bytes; the target's own sends go through layouts it set.

use crate::common::*;
use crate::harness::{Peer, RemoteMr, msg, peer};
use softverbs::*;

/// Matrix side (8-byte cells).
const N: usize = 16;
const PAGE: usize = 4096;
const NONE: SetLayoutFlags = SetLayoutFlags::empty();

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn entry(mr: &MemoryRegion<'_>, off: usize, len: usize, dims: &[(u64, u64)]) -> InterleavedEntry {
    InterleavedEntry::new(
        Datum::new(mr.lkey(), mr.iova() + off as u64, len as u64),
        dims.iter().map(|&(s, c)| Dim::new(s, c)).collect(),
    )
}

/// Column `c` of a row-major N x N matrix of 8-byte cells.
fn column(m: &MemoryRegion<'_>, c: usize) -> InterleavedEntry {
    entry(m, c * 8, 8, &[((N * 8) as u64, N as u64)])
}

/// Rows 2..6, columns 1..4.
fn block(m: &MemoryRegion<'_>) -> InterleavedEntry {
    entry(m, (2 * N + 1) * 8, 8, &[(8, 3), ((N * 8) as u64, 4)])
}

fn cells(data: &[u8], rc: impl Iterator<Item = (usize, usize)>) -> Vec<u8> {
    rc.flat_map(|(r, c)| data[(r * N + c) * 8..][..8].to_vec())
        .collect()
}

fn block_cells() -> impl Iterator<Item = (usize, usize)> {
    (2..6).flat_map(|r| (1..4).map(move |c| (r, c)))
}

// The target: a matrix with a column, a sub-block and a nested layout over it; a page list
// over plain (non-softverbs) memory; a contiguous receive buffer. It answers commands.
peer!(peer_layout_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let m = n.mr(N * N * 8);
    m.write_at(0, &pattern(N * N * 8, 9)).unwrap();
    let col = n.pd.create_layout_mr(ALL_REMOTE).unwrap();
    col.set_layout_interleaved(NONE, &[column(&m, 3)]).unwrap();
    let blk = n.pd.create_layout_mr(ALL_REMOTE).unwrap();
    blk.set_layout_interleaved(NONE, &[block(&m)]).unwrap();
    let nested = n.pd.create_layout_mr(ALL_REMOTE).unwrap();
    nested
        .set_layout_sg(NONE, &[col.sge(8..(N - 1) * 8), blk.sge(0..16)])
        .unwrap();
    // Plain process memory: peers reach it with cross-memory attach.
    let layout = std::alloc::Layout::from_size_align(4 * PAGE, PAGE).unwrap();
    // SAFETY: a non-zero size; the allocation is leaked (lives until the process exits).
    let plain = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!plain.is_null());
    let pages: Vec<*const u8> = [2usize, 0, 3]
        .iter()
        .map(|&i| plain.wrapping_add(i * PAGE) as *const u8)
        .collect();
    // SAFETY: the pages are leaked, valid for the whole process.
    let pl = unsafe {
        n.pd.reg_mr_pages(&pages, PAGE, 0, 3 * PAGE, 0x4000_0000, ALL_REMOTE)
    }
    .unwrap();
    let rbuf = n.mr(4096);
    qp.to_init(ALL_REMOTE).unwrap();
    let rsge = [rbuf.sge(0..4096)];
    qp.post_recv((0..4).map(|i| RecvWr::new(i, &rsge))).unwrap();
    p.send(msg!(
        "target",
        qp.endpoint(0).unwrap(),
        RemoteMr::of(&col),
        RemoteMr::of(&blk),
        RemoteMr::of(&nested),
        RemoteMr::of(&pl)
    ));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");
    loop {
        let cmd = p.recv();
        match cmd.tag() {
            "recv" => {
                let wc = poll_n(&n.cq, 1, "layout target: receive");
                assert_all_ok(&wc, "layout target: receive");
                let len = wc[0].byte_len() as usize;
                let mut got = vec![0; len];
                rbuf.read_at(0, &mut got).unwrap();
                p.send(msg!("got", hex(&got)));
            }
            "matrix" => p.send(msg!("matrix", hex(&m.to_vec()))),
            "plain" => {
                // SAFETY: the leaked allocation; no NIC write is in flight (the initiator
                // asks after its completion).
                let bytes = unsafe { std::slice::from_raw_parts(plain, 4 * PAGE) };
                p.send(msg!("plain", hex(bytes)));
            }
            "send-column" => {
                // The target sends its own column through its layout, one SGE.
                let sge = [col.sge(0..N * 8)];
                qp.post_send([signaled(SendWr::new(1, SendOp::Send, &sge))])
                    .unwrap();
                assert_all_ok(&poll_n(&n.cq, 1, "send"), "layout target: send");
                p.send("sent");
            }
            "done" => break,
            t => panic!("unknown command {t}"),
        }
    }
});

#[test]
fn layouts_between_two_processes() {
    let mut t = Peer::spawn("noncontig::peer_layout_target");
    let msg = t.expect("target");
    let tep: Endpoint = msg.get(0);
    let (tcol, tblk, tnested, tpages): (RemoteMr, RemoteMr, RemoteMr, RemoteMr) =
        (msg.get(1), msg.get(2), msg.get(3), msg.get(4));
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let tmatrix = pattern(N * N * 8, 9);
    let one = |op: SendOp, sges: &[Sge]| -> WorkCompletion {
        qp.post_send([signaled(SendWr::new(5, op, sges))]).unwrap();
        poll_n(&n.cq, 1, "initiator")[0]
    };
    let recv = |t: &mut Peer| -> Vec<u8> {
        t.send("recv");
        unhex(&t.expect("got").get::<String>(0))
    };

    // Seed example 1: swap odd and even items, sent with one SGE.
    let item = 24usize;
    let contig = n.mr(item * 20);
    let items = pattern(item * 20, 4);
    contig.write_at(0, &items).unwrap();
    let swap = n.pd.create_layout_mr(AccessFlags::empty()).unwrap();
    let dims = [(2 * item as u64, 10)];
    swap.set_layout_interleaved(
        NONE,
        &[
            entry(&contig, item, item, &dims),
            entry(&contig, 0, item, &dims),
        ],
    )
    .unwrap();
    assert!(one(SendOp::Send, &[swap.sge(0..item * 20)]).is_ok());
    let got = recv(&mut t);
    let want: Vec<u8> = (0..20)
        .flat_map(|i| items[(i ^ 1) * item..][..item].to_vec())
        .collect();
    assert_eq!(compare(&got, &want), "ok", "swap");

    // Seed example 2: one send from two buffers.
    let (b1, b2) = (n.mr(300), n.mr(200));
    b1.write_at(0, &pattern(300, 1)).unwrap();
    b2.write_at(0, &pattern(200, 2)).unwrap();
    let sg = n.pd.create_layout_mr(AccessFlags::empty()).unwrap();
    sg.set_layout_sg(NONE, &[b1.sge(0..300), b2.sge(0..200)])
        .unwrap();
    assert!(one(SendOp::Send, &[sg.sge(0..500)]).is_ok());
    let mut want = pattern(300, 1);
    want.extend(pattern(200, 2));
    assert_eq!(compare(&recv(&mut t), &want), "ok", "composite");

    // Our matrix's column and sub-block, one SGE each, received contiguous by the target.
    let m = n.mr(N * N * 8);
    let mine = pattern(N * N * 8, 33);
    m.write_at(0, &mine).unwrap();
    let col = n.pd.create_layout_mr(AccessFlags::empty()).unwrap();
    col.set_layout_interleaved(NONE, &[column(&m, 7)]).unwrap();
    assert!(one(SendOp::Send, &[col.sge(0..N * 8)]).is_ok());
    let want = cells(&mine, (0..N).map(|r| (r, 7)));
    assert_eq!(compare(&recv(&mut t), &want), "ok", "column");
    let blk = n.pd.create_layout_mr(AccessFlags::empty()).unwrap();
    blk.set_layout_interleaved(NONE, &[block(&m)]).unwrap();
    assert!(one(SendOp::Send, &[blk.sge(0..12 * 8)]).is_ok());
    assert_eq!(
        compare(&recv(&mut t), &cells(&mine, block_cells())),
        "ok",
        "block"
    );

    // The target's layouts as remote keys: READ its column and block into contiguous buffers.
    let dst = n.mr(4096);
    let read = |rmr: RemoteMr, off: u64, len: usize| {
        let wc = one(
            SendOp::RdmaRead {
                remote_addr: rmr.iova + off,
                rkey: rmr.rkey,
            },
            &[dst.sge(0..len)],
        );
        assert!(wc.is_ok(), "{wc:?}");
        dst.to_vec()[..len].to_vec()
    };
    assert_eq!(tcol.len, N * 8);
    assert_eq!(
        compare(
            &read(tcol, 0, N * 8),
            &cells(&tmatrix, (0..N).map(|r| (r, 3)))
        ),
        "ok",
        "remote column"
    );
    assert_eq!(
        compare(&read(tblk, 0, 96), &cells(&tmatrix, block_cells())),
        "ok",
        "remote block"
    );
    // The nested layout (SG of interleaved): column rows 1..N-1, then two block cells.
    let mut want = cells(&tmatrix, (1..N - 1).map(|r| (r, 3)));
    want.extend(cells(&tmatrix, block_cells().take(2)));
    assert_eq!(tnested.len, want.len());
    assert_eq!(
        compare(&read(tnested, 0, want.len()), &want),
        "ok",
        "nested"
    );

    // The reverse: WRITE contiguous bytes into the target's column and block.
    let src = n.mr(4096);
    let fresh = pattern(4096, 71);
    src.write_at(0, &fresh).unwrap();
    let wc = one(
        SendOp::RdmaWrite {
            remote_addr: tcol.iova,
            rkey: tcol.rkey,
        },
        &[src.sge(0..N * 8)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    let wc = one(
        SendOp::RdmaWrite {
            remote_addr: tblk.iova + 8,
            rkey: tblk.rkey,
        },
        &[src.sge(1000..1000 + 10 * 8)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    let mut model = tmatrix.clone();
    for r in 0..N {
        model[(r * N + 3) * 8..][..8].copy_from_slice(&fresh[r * 8..][..8]);
    }
    for (k, (r, c)) in block_cells().skip(1).take(10).enumerate() {
        model[(r * N + c) * 8..][..8].copy_from_slice(&fresh[1000 + k * 8..][..8]);
    }
    t.send("matrix");
    let got = unhex(&t.expect("matrix").get::<String>(0));
    assert_eq!(compare(&got, &model), "ok", "matrix after remote writes");

    // The target's page list over plain memory: WRITE then READ back through it.
    let wc = one(
        SendOp::RdmaWrite {
            remote_addr: tpages.iova + 4000,
            rkey: tpages.rkey,
        },
        &[src.sge(0..4096)],
    );
    assert!(wc.is_ok(), "{wc:?}");
    t.send("plain");
    let plain = unhex(&t.expect("plain").get::<String>(0));
    // Layout bytes 4000..8096 are page 2's bytes 4000.. then page 0's 0..4000.
    let mut want = vec![0u8; 4 * PAGE];
    want[2 * PAGE + 4000..3 * PAGE].copy_from_slice(&fresh[..96]);
    want[..4000].copy_from_slice(&fresh[96..]);
    assert_eq!(compare(&plain, &want), "ok", "page list write");
    assert_eq!(
        compare(&read(tpages, 4000, 4096), &fresh),
        "ok",
        "page list read"
    );

    // The target sends its column through its own layout.
    let rbuf = n.mr(N * 8);
    qp.post_recv([RecvWr::new(1, &[rbuf.sge(0..N * 8)])])
        .unwrap();
    t.send("send-column");
    t.expect("sent");
    assert!(poll_n(&n.cq, 1, "receive")[0].is_ok());
    assert_eq!(
        compare(&rbuf.to_vec(), &cells(&model, (0..N).map(|r| (r, 3)))),
        "ok",
        "target's column send"
    );

    // Out of bounds on a remote layout: a remote access error, and the QP goes to ERR.
    let wc = one(
        SendOp::RdmaRead {
            remote_addr: tcol.iova + 8,
            rkey: tcol.rkey,
        },
        &[dst.sge(0..N * 8)],
    );
    assert_eq!(wc.status(), WcStatus::RemAccessErr);
    t.send("done");
    t.finish();
}

// --- Random layouts across processes, against a byte model ------------------------------

/// Bytes of the target's region that the random layouts cover.
const RANDOM_SPAN: usize = 1 << 16;
const RANDOM_LAYOUTS: usize = 12;
const RANDOM_OPS: usize = 150;

/// A deterministic generator both processes run with the same seed (xorshift64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// One interleaved entry, as offsets into the target's region: first datum (offset, length)
/// and dimensions (stride, count), innermost first.
type RandEntry = (u64, u64, Vec<(u64, u64)>);

/// Random interleaved layouts: 1..=3 entries, each in its own slice of the region (so no two
/// data overlap and the model is unambiguous), 1 or 2 dimensions, the same datum count for
/// every entry of a layout (a uniform round-robin).
fn random_layouts(seed: u64) -> Vec<Vec<RandEntry>> {
    let mut r = Rng(seed);
    (0..RANDOM_LAYOUTS)
        .map(|_| {
            let entries = r.range(1, 3);
            let slice = RANDOM_SPAN as u64 / entries;
            let count0 = r.range(1, 12);
            let count1 = if r.range(0, 1) == 1 { r.range(2, 4) } else { 1 };
            (0..entries)
                .map(|e| {
                    let len = r.range(1, 24);
                    let stride0 = len + r.range(0, 40);
                    let mut dims = vec![(stride0, count0)];
                    if count1 > 1 {
                        dims.push((stride0 * count0 + r.range(0, 64), count1));
                    }
                    let extent = dims.iter().map(|&(s, c)| s * (c - 1)).sum::<u64>() + len;
                    let first = e * slice + r.range(0, slice - extent);
                    (first, len, dims)
                })
                .collect()
        })
        .collect()
}

/// The region offset of every byte of a layout, in layout order (the seed's round-robin).
fn expand(entries: &[RandEntry]) -> Vec<usize> {
    let total: u64 = entries[0].2.iter().map(|d| d.1).product();
    let mut out = Vec::new();
    for k in 0..total {
        for (first, len, dims) in entries {
            let (mut rest, mut at) = (k, *first);
            for &(stride, count) in dims {
                at += (rest % count) * stride;
                rest /= count;
            }
            out.extend((at..at + len).map(|b| b as usize));
        }
    }
    out
}

const RANDOM_SEED: u64 = 0x5eed_0002_c0ff_ee11;

// The target of the random test: a region, the random layouts over it as remote keys.
peer!(peer_random_layout_target, |p| {
    let n = node();
    let qp = n.qp(QpType::Rc);
    let m = n.mr(RANDOM_SPAN);
    m.write_at(0, &pattern(RANDOM_SPAN, 17)).unwrap();
    let layouts: Vec<MemoryRegion<'static>> = random_layouts(RANDOM_SEED)
        .iter()
        .map(|entries| {
            let l = n.pd.create_layout_mr(ALL_REMOTE).unwrap();
            let list: Vec<InterleavedEntry> = entries
                .iter()
                .map(|(first, len, dims)| entry(&m, *first as usize, *len as usize, dims))
                .collect();
            l.set_layout_interleaved(NONE, &list).unwrap();
            l
        })
        .collect();
    qp.to_init(ALL_REMOTE).unwrap();
    for l in &layouts {
        p.send(msg!("layout", RemoteMr::of(l)));
    }
    p.send(msg!("target", qp.endpoint(0).unwrap()));
    let them: Endpoint = p.expect("initiator").get(0);
    qp.to_rtr(&them).unwrap();
    qp.to_rts(0).unwrap();
    p.send("ready");
    loop {
        match p.recv().tag() {
            "region" => p.send(msg!("region", hex(&m.to_vec()))),
            "done" => break,
            t => panic!("unknown command {t}"),
        }
    }
});

#[test]
fn random_layouts_and_offsets_between_two_processes_match_a_model() {
    let mut t = Peer::spawn("noncontig::peer_random_layout_target");
    let remote: Vec<RemoteMr> = (0..RANDOM_LAYOUTS)
        .map(|_| t.expect("layout").get(0))
        .collect();
    let tep: Endpoint = t.expect("target").get(0);
    let n = node();
    let qp = n.rc_to(&mut t, &tep, "ready");
    let maps: Vec<Vec<usize>> = random_layouts(RANDOM_SEED)
        .iter()
        .map(|e| expand(e))
        .collect();
    for (rmr, map) in remote.iter().zip(&maps) {
        assert_eq!(rmr.len, map.len(), "layout length");
    }
    let mut model = pattern(RANDOM_SPAN, 17);
    let (src, dst) = (n.mr(4096), n.mr(4096));
    let mut r = Rng(RANDOM_SEED ^ 0xabcd);
    let (mut writes, mut reads) = (0, 0);
    for i in 0..RANDOM_OPS {
        let l = r.range(0, RANDOM_LAYOUTS as u64 - 1) as usize;
        let (rmr, map) = (remote[l], &maps[l]);
        let off = r.range(0, map.len() as u64 - 1) as usize;
        let len = r.range(1, (map.len() - off).min(4096) as u64) as usize;
        let write = r.range(0, 1) == 1;
        let op = if write {
            let bytes: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
            src.write_at(0, &bytes).unwrap();
            for (k, b) in bytes.iter().enumerate() {
                model[map[off + k]] = *b;
            }
            writes += 1;
            SendOp::RdmaWrite {
                remote_addr: rmr.iova + off as u64,
                rkey: rmr.rkey,
            }
        } else {
            reads += 1;
            SendOp::RdmaRead {
                remote_addr: rmr.iova + off as u64,
                rkey: rmr.rkey,
            }
        };
        let sge = if write {
            src.sge(0..len)
        } else {
            dst.sge(0..len)
        };
        qp.post_send([signaled(SendWr::new(i as u64, op, &[sge]))])
            .unwrap();
        let wc = poll_n(&n.cq, 1, "random op")[0];
        assert!(wc.is_ok(), "op {i} on layout {l} at {off}+{len}: {wc:?}");
        if !write {
            let want: Vec<u8> = (off..off + len).map(|k| model[map[k]]).collect();
            assert_eq!(
                compare(&dst.to_vec()[..len], &want),
                "ok",
                "read {i} of layout {l} at {off}+{len}"
            );
        }
    }
    assert!(writes > 20 && reads > 20, "{writes} writes, {reads} reads");
    t.send("region");
    let got = unhex(&t.expect("region").get::<String>(0));
    assert_eq!(
        compare(&got, &model),
        "ok",
        "the target's region after the writes"
    );
    t.send("done");
    t.finish();
}
