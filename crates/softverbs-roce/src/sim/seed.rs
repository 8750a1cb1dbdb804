//! Running a simulation over many seeds, and replaying the one that failed.
//!
//! A seeded simulation is only as useful as the ability to rerun the failing seed alone,
//! under a debugger or with a capture on. [`for_each_seed`] names the failing seed in the
//! test output and, given `SOFTVERBS_SIM_SEED`, runs just that one:
//!
//! ```text
//! simulator seed 17 failed; replay with SOFTVERBS_SIM_SEED=17
//! $ SOFTVERBS_SIM_SEED=17 cargo test -p softverbs-roce the_test
//! ```

use std::panic::{self, AssertUnwindSafe};

/// The environment variable that restricts [`for_each_seed`] to one seed (decimal, or hex
/// with `0x`).
pub const SEED_ENV: &str = "SOFTVERBS_SIM_SEED";

/// Runs `f` once per seed in `seeds`, or only for the seed in `SOFTVERBS_SIM_SEED` when that
/// is set (and not empty). When `f` panics, prints which seed failed and how to replay it,
/// then re-raises the panic unchanged, so the test fails as it would have.
///
/// # Panics
///
/// Re-raises `f`'s panic; panics if `SOFTVERBS_SIM_SEED` is set to something that is not a
/// seed.
///
/// ```
/// use softverbs_roce::sim::{SplitMix64, for_each_seed};
///
/// for_each_seed(0..8, |seed| {
///     let mut rng = SplitMix64::new(seed);
///     assert!(rng.below(10) < 10);
/// });
/// ```
pub fn for_each_seed(seeds: impl IntoIterator<Item = u64>, f: impl FnMut(u64)) {
    let env = std::env::var(SEED_ENV).ok();
    run_seeds(seeds, env.as_deref(), &mut |line| eprintln!("{line}"), f);
}

/// [`for_each_seed`] with the environment and the output passed in, so tests can drive it
/// (the 2024 edition makes setting environment variables `unsafe`, which this crate forbids).
pub(crate) fn run_seeds(
    seeds: impl IntoIterator<Item = u64>,
    env: Option<&str>,
    report: &mut dyn FnMut(&str),
    mut f: impl FnMut(u64),
) {
    let only = match env.map(str::trim).filter(|s| !s.is_empty()) {
        None => None,
        Some(text) => match parse_seed(text) {
            Some(seed) => Some(seed),
            None => panic!("{SEED_ENV}={text:?} is not a seed (a u64, decimal or 0x-hex)"),
        },
    };
    // Lazily: a caller may pass a huge range and rely on the first failure to stop it.
    let (one, many) = match only {
        Some(seed) => {
            report(&format!("simulator: running only seed {seed} ({SEED_ENV})"));
            (Some(seed), None)
        }
        None => (None, Some(seeds.into_iter())),
    };
    for seed in one.into_iter().chain(many.into_iter().flatten()) {
        if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| f(seed))) {
            report(&format!(
                "simulator seed {seed} failed; replay with {SEED_ENV}={seed}"
            ));
            panic::resume_unwind(payload);
        }
    }
}

fn parse_seed(text: &str) -> Option<u64> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(env: Option<&str>, seeds: std::ops::Range<u64>, fail_at: Option<u64>) -> Outcome {
        let mut ran = Vec::new();
        let mut lines = Vec::new();
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            run_seeds(seeds, env, &mut |l| lines.push(l.to_string()), |seed| {
                ran.push(seed);
                if Some(seed) == fail_at {
                    panic!("boom at {seed}");
                }
            })
        }));
        let panic = result.err().map(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        });
        Outcome { ran, lines, panic }
    }

    struct Outcome {
        ran: Vec<u64>,
        lines: Vec<String>,
        panic: Option<String>,
    }

    #[test]
    fn runs_every_seed() {
        let o = collect(None, 0..5, None);
        assert_eq!(o.ran, [0, 1, 2, 3, 4]);
        assert!(o.lines.is_empty());
        assert!(o.panic.is_none());
        // An empty variable counts as unset.
        assert_eq!(collect(Some(""), 0..2, None).ran, [0, 1]);
    }

    #[test]
    fn names_the_failing_seed_and_reraises() {
        let o = collect(None, 0..10, Some(3));
        assert_eq!(o.ran, [0, 1, 2, 3]);
        assert_eq!(
            o.lines,
            ["simulator seed 3 failed; replay with SOFTVERBS_SIM_SEED=3"]
        );
        assert_eq!(o.panic.as_deref(), Some("boom at 3"));
    }

    #[test]
    fn env_runs_only_that_seed() {
        let o = collect(Some("42"), 0..10, None);
        assert_eq!(o.ran, [42]);
        assert_eq!(o.lines.len(), 1);
        let o = collect(Some("0x2a"), 0..10, Some(42));
        assert_eq!(o.ran, [42]);
        assert_eq!(
            o.lines[1],
            "simulator seed 42 failed; replay with SOFTVERBS_SIM_SEED=42"
        );
        assert!(o.panic.is_some());
    }

    #[test]
    fn garbage_env_is_an_error() {
        let o = collect(Some("seven"), 0..10, None);
        assert!(o.ran.is_empty());
        assert!(o.panic.unwrap().contains("is not a seed"));
    }
}
