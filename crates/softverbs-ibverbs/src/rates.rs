//! rdma-core's rate conversions (`ibv_rate_to_mult`, `mult_to_ibv_rate`, `ibv_rate_to_mbps`,
//! `mbps_to_ibv_rate`): pure functions over `enum ibv_rate`, answered from one table.

use core::ffi::c_int;

/// `enum ibv_rate` values, their multiple of 2.5 Gbit/s (-1: not a multiple) and their
/// Mbit/s, as rdma-core answers them (the 64b/66b-coded rates are not round numbers).
const RATES: [(c_int, c_int, c_int); 23] = [
    (2, 1, 2500),
    (5, 2, 5000),
    (3, 4, 10000),
    (6, 8, 20000),
    (4, 12, 30000),
    (7, 16, 40000),
    (8, 24, 60000),
    (9, 32, 80000),
    (10, 48, 120000),
    (11, -1, 14062),
    (12, -1, 56250),
    (13, -1, 112500),
    (14, -1, 168750),
    (15, -1, 25781),
    (16, -1, 103125),
    (17, -1, 206250),
    (18, -1, 309375),
    (19, 11, 28125),
    (20, 20, 53125),
    (21, 160, 425000),
    (22, 240, 637500),
    (23, 320, 850000),
    (24, 480, 1275000),
];

/// `IBV_RATE_MAX`: what an unknown value converts to.
const RATE_MAX: c_int = 0;

fn find(pick: impl Fn(&(c_int, c_int, c_int)) -> bool) -> Option<&'static (c_int, c_int, c_int)> {
    RATES.iter().find(|r| pick(r))
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_rate_to_mult(rate: c_int) -> c_int {
    find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_mult_to_ibv_rate(mult: c_int) -> c_int {
    find(|r| r.1 == mult && mult > 0).map_or(RATE_MAX, |r| r.0)
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_ibv_rate_to_mbps(rate: c_int) -> c_int {
    find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

#[unsafe(no_mangle)]
pub extern "C" fn sv_mbps_to_ibv_rate(mbps: c_int) -> c_int {
    find(|r| r.2 == mbps).map_or(RATE_MAX, |r| r.0)
}
