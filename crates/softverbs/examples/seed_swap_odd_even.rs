//! Seed 002's `ibv_mr_set_layout_interleaved(3)` example: send 100 items with the odd and even
//! ones swapped, without moving a byte of the source buffer.
//!
//! ```sh
//! cargo run -p softverbs --example seed_swap_odd_even
//! ```
//!
//! A layout region (a zero-length `ZERO_BASED` MR) gets an interleaved layout of two entries
//! over the same buffer: the first walks the odd items (1, 3, 5, ...), the second the even ones
//! (0, 2, 4, ...), and the layout takes one item from each in turn. A SEND of the layout's 100
//! items with one SGE therefore carries item 1, item 0, item 3, item 2, ... — the NIC does the
//! gathering; the CPU never copies an item and the buffer stays as it was. The program exits
//! with an error (status 1) if the received order or the source buffer is wrong.

use softverbs::*;
use std::time::{Duration, Instant};

/// Items in the buffer (the man page's 100) and bytes per item (one `u64` each, so they print
/// as numbers).
const ITEMS: usize = 100;
const ITEM_LEN: usize = 8;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub fn main() -> Result<()> {
    // One device, one PD, and two RC QPs of this process connected to each other: the
    // software NIC carries a SEND between them like between two hosts.
    let ctx = devices()?.first().ok_or("no RDMA device")?.open()?;
    let pd = ctx.alloc_pd()?;
    let (send_cq, recv_cq) = (ctx.create_cq(16, None)?, ctx.create_cq(16, None)?);
    let sender = pd.create_qp(&QpInitAttr::rc(&send_cq, &send_cq))?;
    let receiver = pd.create_qp(&QpInitAttr::rc(&recv_cq, &recv_cq))?;
    sender.connect(&receiver.endpoint(0)?, 0, AccessFlags::LOCAL_WRITE)?;
    receiver.connect(&sender.endpoint(0)?, 0, AccessFlags::LOCAL_WRITE)?;

    // The contiguous buffer (the man page's `contig_mr`): item i holds the number i.
    let contig = pd.alloc_mr(ITEMS * ITEM_LEN, AccessFlags::LOCAL_WRITE)?;
    let before: Vec<u64> = (0..ITEMS as u64).collect();
    contig.write_at(0, &to_bytes(&before))?;

    // The non-contiguous region: zero-length and zero-based until it gets a layout.
    let noncontig = pd.create_layout_mr(AccessFlags::empty())?;
    // Both entries step two items at a time ("after item[x] take item[x+2]"), 50 times.
    let dims = vec![Dim::new(2 * ITEM_LEN as u64, (ITEMS / 2) as u64)];
    let item = |i: usize| {
        Datum::new(
            contig.lkey(),
            contig.iova() + (i * ITEM_LEN) as u64,
            ITEM_LEN as u64,
        )
    };
    noncontig.set_layout_interleaved(
        SetLayoutFlags::empty(),
        &[
            InterleavedEntry::new(item(1), dims.clone()), // start with item[1]...
            InterleavedEntry::new(item(0), dims),         // ...then item[0], round-robin
        ],
    )?;
    // The layout's bytes are addressed from 0, like the man page's `.addr = 0` SGE.
    assert_eq!(noncontig.len(), ITEMS * ITEM_LEN);

    // The receiver's contiguous buffer, and one receive into it.
    let received = pd.alloc_mr(ITEMS * ITEM_LEN, AccessFlags::LOCAL_WRITE)?;
    receiver.post_recv([RecvWr::new(1, &[received.sge(0..ITEMS * ITEM_LEN)])])?;

    // One SEND, one SGE, one key: the whole swapped sequence.
    let sge = [noncontig.sge(0..ITEMS * ITEM_LEN)];
    sender.post_send([SendWr::new(2, SendOp::Send, &sge).flags(SendFlags::SIGNALED)])?;
    wait_ok(&send_cq, "the SEND")?;
    // The receive completion is what makes the received bytes safe to read.
    let len = wait_ok(&recv_cq, "the receive")?.byte_len() as usize;

    let after = from_bytes(&received.to_vec());
    let untouched = from_bytes(&contig.to_vec());
    println!("source (first 10 of {ITEMS}):   {:?}", &before[..10]);
    println!("received (first 10 of {ITEMS}): {:?}", &after[..10]);

    // Check: item i of the message is item i ^ 1 of the buffer (odd and even swapped), all
    // 100 arrived, and the buffer itself was not rewritten.
    if len != ITEMS * ITEM_LEN {
        return Err(format!("received {len} bytes, expected {}", ITEMS * ITEM_LEN).into());
    }
    let want: Vec<u64> = (0..ITEMS as u64).map(|i| i ^ 1).collect();
    if after != want {
        return Err(format!("wrong order: received {after:?}").into());
    }
    if untouched != before {
        return Err(format!("the source buffer changed: {untouched:?}").into());
    }
    println!("ok: odd and even items swapped in flight; the source buffer is unchanged");
    Ok(())
}

/// Polls `cq` for one completion (10 s at most) and fails unless it succeeded.
fn wait_ok(cq: &CompletionQueue, what: &str) -> Result<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wc = [WorkCompletion::default()];
    while cq.poll(&mut wc) == 0 {
        if Instant::now() > deadline {
            return Err(format!("{what}: no completion within 10 s").into());
        }
        std::thread::yield_now();
    }
    if !wc[0].is_ok() {
        return Err(format!("{what} failed: {:?}", wc[0]).into());
    }
    Ok(wc[0])
}

fn to_bytes(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}
