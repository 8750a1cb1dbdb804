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

/// The CPU's model name as `/proc/cpuinfo` gives it, so figures from different machines can
/// be told apart ("unknown" where it says none).
pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The CPUs this process may run on, by number, lowest first.
pub(crate) fn allowed_cpus() -> Vec<usize> {
    match rustix::thread::sched_getaffinity(None) {
        Ok(set) => (0..rustix::thread::CpuSet::MAX_CPU)
            .filter(|&c| set.is_set(c))
            .collect(),
        Err(_) => vec![0],
    }
}

/// The pair of CPUs the two processes of a measurement run on: `given` (`--cpus A,B`), else
/// the first two this process may use (the same one twice on a single CPU). Where the
/// scheduler puts two processes moves latencies several-fold, so baseline and measurement
/// are taken on one fixed pair.
pub(crate) fn cpu_pair(given: Option<&str>) -> Result<[usize; 2]> {
    let allowed = allowed_cpus();
    let pair = match given {
        Some(text) => {
            let parsed: Option<Vec<usize>> =
                text.split(',').map(|t| t.trim().parse().ok()).collect();
            match parsed.as_deref() {
                Some(&[a, b]) => [a, b],
                _ => return Err(format!("--cpus {text}: want two CPU numbers, A,B").into()),
            }
        }
        None => [allowed[0], allowed.get(1).copied().unwrap_or(allowed[0])],
    };
    if let Some(c) = pair.iter().find(|c| !allowed.contains(c)) {
        return Err(
            format!("--cpus: CPU {c} is not one this process may use ({allowed:?})").into(),
        );
    }
    Ok(pair)
}

/// Runs the calling thread (and the threads it starts from now on) on `cpu` only.
pub(crate) fn pin_to(cpu: usize) -> Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)
        .map_err(|e| format!("pinning to CPU {cpu}: {e}").into())
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
