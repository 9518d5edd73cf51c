//! The harness's quick mode as a smoke test: every system and scenario
//! produces samples, and the table, raw samples and chart are written. It
//! asserts that the harness works — never a speed.

use sandbolt_benches::systems::System;
use sandbolt_benches::{Options, report, runtimes, scenarios, sdk, snapshot, telemetry, warm};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_run_measures_every_system_and_writes_results() {
    // The telemetry scenario exports through the harness's subscriber.
    telemetry::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = Options::quick(dir.path().to_path_buf());
    opts.iterations = 2;
    opts.burst = 2;
    opts.churn = 1;
    opts.sdk_rounds = 2;
    opts.warm_rounds = 2;
    opts.warm_burst = 3;
    opts.snapshot_rounds = 2;
    opts.snapshot_sizes_mib = vec![1];
    opts.telemetry_rounds = 2;
    opts.runtime_rounds = 1;
    let out = scenarios::run(&opts).await.expect("harness runs");
    assert!(
        out.skipped.is_empty(),
        "systems that could not run: {:?}",
        out.skipped
    );
    for system in System::ALL {
        let n = out
            .samples
            .iter()
            .filter(|s| s.scenario == "sequential" && s.system == system.name())
            .count();
        assert_eq!(n, 2, "{} sequential samples", system.name());
    }
    assert!(
        out.samples
            .iter()
            .any(|s| s.scenario == "churn"
                && s.stages.iter().any(|(k, _)| k == "first_command_done"))
    );
    // The three burst systems, and the warm pools' burst warm and cold.
    assert_eq!(out.bursts.len(), 5, "{:?}", out.bursts);
    // Warm pools (issue 17): every warm create was a claim (one that was
    // not is recorded under its own name), and every cold counterpart ran.
    for (warm_system, cold_system) in warm::PAIRS {
        for system in [warm_system, cold_system] {
            let n = out
                .samples
                .iter()
                .filter(|s| s.scenario == warm::SCENARIO && s.system == system)
                .count();
            assert_eq!(n, 2, "{system} samples: {:?}", out.notes);
        }
    }
    for system in [warm::SDK_WARM, warm::SDK_COLD, warm::SDK_FLOOR] {
        let n = out
            .samples
            .iter()
            .filter(|s| s.scenario == sdk::SCENARIO_CREATE && s.system == system)
            .count();
        assert_eq!(n, 2, "{system} sdk create samples");
    }
    for system in [warm::BURST_WARM, warm::BURST_COLD] {
        let n = out
            .samples
            .iter()
            .filter(|s| s.scenario == warm::burst_scenario(3) && s.system == system)
            .count();
        assert_eq!(n, 3, "{system} burst samples");
    }
    assert!(
        out.notes
            .iter()
            .any(|n| n.contains(warm::BURST_WARM) && n.contains("3 of 3 creates were claims")),
        "{:?}",
        out.notes
    );
    // Snapshots (issue 18): every capture answered READY with its pause
    // window, and every create from the snapshot and its cold counterpart
    // ran.
    let count = |scenario: &str, system: &str| {
        out.samples
            .iter()
            .filter(|s| s.scenario == scenario && s.system == system)
            .count()
    };
    let one_mib = snapshot::capture_system(1);
    assert_eq!(count(snapshot::CAPTURE, &one_mib), 2, "{:?}", out.notes);
    assert_eq!(count(snapshot::PAUSE, &one_mib), 2);
    assert!(
        out.samples
            .iter()
            .filter(|s| s.scenario == snapshot::CAPTURE)
            .all(|s| s.stages.iter().any(|(k, us)| k == "paused" && *us > 0)),
        "a running sandbox is frozen for its capture, for some time"
    );
    for system in [snapshot::COLD.to_string(), snapshot::restore_system(1)] {
        assert_eq!(count(snapshot::RESTORE, &system), 2, "{system}");
    }
    // Telemetry (issue 20): every round ran off and on (the on rounds
    // exported spans, or the scenario would be in `skipped`), and each on
    // round's flush was timed.
    for system in [telemetry::OFF, telemetry::ON] {
        assert_eq!(count(telemetry::CREATE, system), 2, "{system}");
        assert_eq!(count(telemetry::DELETE, system), 2, "{system}");
    }
    assert_eq!(count(telemetry::FLUSH, telemetry::ON), 2);
    // Runtimes (issue 24): runc and runsc each created, ran commands,
    // moved a MiB both ways, and had their idle memory read.
    for runtime in runtimes::RUNTIMES {
        let system = runtimes::system(runtime);
        assert_eq!(count(runtimes::SCENARIO_CREATE, &system), 1, "{system}");
        assert_eq!(count(runtimes::SCENARIO_EXEC, &system), 5, "{system}");
        assert_eq!(count(runtimes::SCENARIO_FILE, &system), 1, "{system}");
        assert!(
            out.notes.iter().any(|n| n
                .starts_with(&format!("idle memory per sandbox, {runtime} ("))
                && n.contains("PSS median")),
            "{:?}",
            out.notes
        );
    }
    // The SDK scenario: every lifecycle server, the OpenSandbox server 1.1.1
    // included, answers every round (skipped is empty, checked above).
    for system in sdk::SYSTEMS {
        let creates: Vec<_> = out
            .samples
            .iter()
            .filter(|s| s.scenario == sdk::SCENARIO_CREATE && s.system == system)
            .collect();
        assert_eq!(creates.len(), 2, "{system} sdk create samples");
        assert!(
            creates
                .iter()
                .all(|s| s.stages.iter().any(|(k, _)| k == "execd_ready")),
            "{system}: every SDK create ends with execd answering /ping: {creates:?}"
        );
        let kills = out
            .samples
            .iter()
            .filter(|s| s.scenario == sdk::SCENARIO_KILL && s.system == system)
            .count();
        assert_eq!(kills, 2, "{system} sdk kill samples");
    }

    report::write_all(&out, dir.path(), "test").expect("results written");
    let md = std::fs::read_to_string(dir.path().join("results.md")).unwrap();
    assert!(md.contains("| sequential | ctr run -d |"), "{md}");
    assert!(md.contains("Ratios of p50"), "{md}");
    assert!(md.contains("sdk create: "), "{md}");
    // Issue 19: the OpenSandbox server on sandbolt (Kubernetes runtime, fsb
    // provider, sandbolt's gateway) against the same server on Docker.
    for scenario in [sdk::SCENARIO_CREATE, sdk::SCENARIO_KILL] {
        assert!(
            md.contains(&format!(
                "{scenario}: {} ÷ {}",
                sdk::OPENSANDBOX_SANDBOLT,
                sdk::OPENSANDBOX
            )),
            "{md}"
        );
    }
    assert!(
        md.contains(&format!(
            "{}: {} ÷ {}",
            warm::SCENARIO,
            warm::WARM_V2,
            warm::COLD_V2
        )),
        "{md}"
    );
    assert!(
        md.contains(&format!(
            "{}: {} ÷ {}",
            snapshot::RESTORE,
            snapshot::restore_system(1),
            snapshot::COLD
        )),
        "{md}"
    );
    assert!(
        md.contains(&format!("{}: on ÷ off", telemetry::CREATE)),
        "{md}"
    );
    // Issue 13: both limits pairs (native API, SDK) get their row.
    assert!(md.contains("Limits vs no limits"), "{md}");
    for (scenario, _, without) in report::limit_pairs() {
        assert!(
            md.contains(&format!("| {scenario} | {without} |")),
            "{scenario}: {md}"
        );
    }
    let csv = std::fs::read_to_string(dir.path().join("samples.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + out.samples.len());
    let png = std::fs::read(dir.path().join("latency.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}
