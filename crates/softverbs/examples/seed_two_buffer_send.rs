//! Seed 002's `ibv_mr_set_layout_sg(3)` example: one SEND, with one SGE, of the bytes of two
//! separately registered buffers.
//!
//! ```sh
//! cargo run -p softverbs --example seed_two_buffer_send
//! ```
//!
//! Without layouts a sender names both regions in every work request (two SGEs, two keys).
//! With an SG layout the two regions are listed once, in a layout region; afterwards each send
//! names only that region's key, an offset and a length, and the receiver gets the two
//! buffers back to back in one message. The program exits with an error (status 1) if the
//! received message is not the concatenation.

use softverbs::*;
use std::time::{Duration, Instant};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub fn main() -> Result<()> {
    // Two RC QPs of this process, connected to each other through the software NIC.
    let ctx = devices()?.first().ok_or("no RDMA device")?.open()?;
    let pd = ctx.alloc_pd()?;
    let (send_cq, recv_cq) = (ctx.create_cq(16, None)?, ctx.create_cq(16, None)?);
    let sender = pd.create_qp(&QpInitAttr::rc(&send_cq, &send_cq))?;
    let receiver = pd.create_qp(&QpInitAttr::rc(&recv_cq, &recv_cq))?;
    sender.connect(&receiver.endpoint(0)?, 0, AccessFlags::LOCAL_WRITE)?;
    receiver.connect(&sender.endpoint(0)?, 0, AccessFlags::LOCAL_WRITE)?;

    // The man page's `mr1` and `mr2`: two buffers of different lengths, registered apart.
    let part1 = b"Hello from the first buffer; ";
    let part2 = b"and this came from the second one.";
    let mr1 = pd.alloc_mr(part1.len(), AccessFlags::LOCAL_WRITE)?;
    let mr2 = pd.alloc_mr(part2.len(), AccessFlags::LOCAL_WRITE)?;
    mr1.write_at(0, part1)?;
    mr2.write_at(0, part2)?;

    // `mr3`: a layout region whose bytes are all of mr1, then all of mr2 (the `composite`
    // SGE list). It is zero-based: offset 0 is mr1's first byte, offset len1 is mr2's.
    let mr3 = pd.create_layout_mr(AccessFlags::empty())?;
    mr3.set_layout_sg(
        SetLayoutFlags::empty(),
        &[mr1.sge(0..part1.len()), mr2.sge(0..part2.len())],
    )?;
    let total = part1.len() + part2.len();
    assert_eq!(mr3.len(), total);

    let received = pd.alloc_mr(total, AccessFlags::LOCAL_WRITE)?;
    receiver.post_recv([RecvWr::new(1, &[received.sge(0..total)])])?;

    // The `non_contig` SGE: one key, address 0, both lengths.
    let sge = [mr3.sge(0..total)];
    sender.post_send([SendWr::new(2, SendOp::Send, &sge).flags(SendFlags::SIGNALED)])?;
    wait_ok(&send_cq, "the SEND")?;
    let len = wait_ok(&recv_cq, "the receive")?.byte_len() as usize;

    let got = received.to_vec();
    println!(
        "buffer 1 ({} B): {:?}",
        part1.len(),
        String::from_utf8_lossy(part1)
    );
    println!(
        "buffer 2 ({} B): {:?}",
        part2.len(),
        String::from_utf8_lossy(part2)
    );
    println!(
        "received ({len} B, one SEND, one SGE): {:?}",
        String::from_utf8_lossy(&got)
    );

    let want = [&part1[..], &part2[..]].concat();
    if len != total || got != want {
        return Err(format!(
            "received {len} bytes {:?}, expected {total} bytes {:?}",
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&want)
        )
        .into());
    }
    println!("ok: one message carried both buffers back to back");
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
