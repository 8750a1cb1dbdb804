//! `softverbs pingpong --ts`: receive-completion timestamp statistics, like `ibv_rc_pingpong -t`.

use std::process::Command;

fn softverbs(args: &[&str], devices: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_softverbs"));
    cmd.args(args);
    match devices {
        Some(d) => cmd.env("SOFTVERBS_DEVICES", d),
        None => cmd.env_remove("SOFTVERBS_DEVICES"),
    };
    cmd.output().expect("run softverbs")
}

fn ok_stdout(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn pingpong_ts_json_has_the_receive_completion_deltas() {
    for (devices, mask) in [
        (None, 0xffff_ffff_ffff_u64),
        (Some("name=ts16,ts_bits=16"), 0xffff),
    ] {
        let out = softverbs(
            &["pingpong", "--loopback", "--ts", "-n", "500", "--json"],
            devices,
        );
        let v: serde_json::Value = serde_json::from_str(&ok_stdout(&out)).expect("one JSON object");
        let ts = &v["recv_completion_ts"];
        assert!(ts.is_object(), "no recv_completion_ts in {v}");
        let num = |k: &str| {
            ts[k]
                .as_f64()
                .unwrap_or_else(|| panic!("no numeric {k} in {ts}"))
        };
        assert_eq!(ts["deltas"].as_u64(), Some(499), "{ts}");
        assert_eq!(ts["completion_timestamp_mask"].as_u64(), Some(mask), "{ts}");
        assert_eq!(ts["hca_core_clock_khz"].as_u64(), Some(1_000_000), "{ts}");
        for unit in ["cycles", "ns"] {
            let (min, avg, max) = (
                num(&format!("min_{unit}")),
                num(&format!("avg_{unit}")),
                num(&format!("max_{unit}")),
            );
            assert!(min > 0.0, "{unit}: {ts}");
            assert!(min <= avg && avg <= max, "{unit}: {ts}");
            // Wrap-around handled with the mask: no delta is larger than the clock.
            assert!(max <= mask as f64, "{unit}: {ts}");
        }
    }
}

#[test]
fn pingpong_ts_text_prints_the_figures_and_without_ts_nothing() {
    let text = ok_stdout(&softverbs(
        &["pingpong", "--loopback", "--ts", "-n", "50"],
        None,
    ));
    for line in [
        "Max receive completion clock cycles = ",
        "Min receive completion clock cycles = ",
        "Average receive completion clock cycles = ",
    ] {
        assert!(text.contains(line), "no `{line}` in {text}");
    }
    let text = ok_stdout(&softverbs(&["pingpong", "--loopback", "-n", "50"], None));
    assert!(!text.contains("receive completion"), "{text}");
    let out = softverbs(&["pingpong", "--loopback", "-n", "50", "--json"], None);
    let v: serde_json::Value = serde_json::from_str(&ok_stdout(&out)).unwrap();
    assert!(v.get("recv_completion_ts").is_none(), "{v}");
}
