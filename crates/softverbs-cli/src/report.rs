//! What `perf`, `perf cq-poll` and `perf noncontig` share: option counts, the median, and
//! printing a report as text or JSON.

use crate::Result;
use serde::Serialize;

/// The count given by option `flag` (`given`), else its default (`defaults`: normally, with
/// `--quick`); it must be at least 1 and at most `max`.
pub(crate) fn count_arg<T>(
    flag: &str,
    given: Option<T>,
    quick: bool,
    defaults: (T, T),
    max: T,
) -> Result<T>
where
    T: Copy + PartialOrd + From<u8> + std::fmt::Display,
{
    let n = given.unwrap_or(if quick { defaults.1 } else { defaults.0 });
    if n == T::from(0) {
        return Err(format!("{flag} must be at least 1").into());
    }
    if n > max {
        return Err(format!("{flag} {n}: too many").into());
    }
    Ok(n)
}

/// The median of `v` (which it sorts); 0 for none.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Writes `report` to standard output: one JSON object with `json`, else its `text`.
pub(crate) fn print_report<R: Serialize>(
    report: &R,
    json: bool,
    text: fn(&R) -> String,
) -> Result<()> {
    let text = if json {
        format!("{}\n", serde_json::to_string(report)?)
    } else {
        text(report)
    };
    crate::write_stdout(&text)
}

/// CPUs this process may run on.
pub(crate) fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn count_arg_defaults_and_limits() {
        assert_eq!(count_arg("--n", None, false, (10u64, 2), 100).unwrap(), 10);
        assert_eq!(count_arg("--n", None, true, (10u64, 2), 100).unwrap(), 2);
        assert_eq!(
            count_arg("--n", Some(7usize), true, (10, 2), 100).unwrap(),
            7
        );
        let zero = count_arg("--n", Some(0u64), false, (10, 2), 100).unwrap_err();
        assert_eq!(zero.to_string(), "--n must be at least 1");
        let big = count_arg("--n", Some(101u64), false, (10, 2), 100).unwrap_err();
        assert_eq!(big.to_string(), "--n 101: too many");
    }
}
