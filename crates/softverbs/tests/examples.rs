//! Runs the programs in `examples/` (seed 002's two man-page examples) as part of the test
//! suite: `cargo test` only builds examples, so each is included here as a module and its
//! `main` is called. Each `main` checks its own result and returns an error if it is wrong.

#[path = "../examples/seed_swap_odd_even.rs"]
mod seed_swap_odd_even;
#[path = "../examples/seed_two_buffer_send.rs"]
mod seed_two_buffer_send;

#[test]
fn example_seed_swap_odd_even() {
    if let Err(e) = seed_swap_odd_even::main() {
        panic!("examples/seed_swap_odd_even.rs failed: {e}");
    }
}

#[test]
fn example_seed_two_buffer_send() {
    if let Err(e) = seed_two_buffer_send::main() {
        panic!("examples/seed_two_buffer_send.rs failed: {e}");
    }
}
