//! Unpredictable numbers from the kernel, for what an attacker on the network must not guess:
//! the memory keys, QP numbers and first PSNs of networked devices.

/// 64 random bits (`getrandom(2)`; a clock-seeded fallback only if the kernel refuses, which
/// Linux does not once booted).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    match rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
        Ok(8) => u64::from_ne_bytes(b),
        _ => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            // SplitMix64's finalizer: the bits of the clock spread over the word.
            let mut z = t ^ u64::from(std::process::id()).rotate_left(32);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
    }
}

/// A random 24-bit PSN (what `ibv_modify_qp` callers pass as `sq_psn`).
pub fn random_psn() -> u32 {
    (random_u64() & 0xff_ffff) as u32
}
