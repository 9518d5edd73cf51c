//! The scale harness's quick form (issue 25): the real controller binary
//! on both stores against 20 simulated agents, 2,000 sandboxes per store
//! through FastPath v2 and the native API (fast and strong), 10 % agent
//! churn during the load, a restart and (Kubernetes store) a leader
//! failover. It asserts correctness only — every create answered, every
//! answered create listed after the load, after the rebuild and after the
//! failover — never a speed (that is `sandbolt-bench scale`, BENCHMARKS.md).

use std::path::PathBuf;

use sandbolt_benches::scale::{self, Api, ScaleOptions, StoreKind};

fn sandbolt_bin() -> PathBuf {
    let bin = std::env::var_os("SANDBOLT_STATIC_BIN")
        .map(PathBuf::from)
        .expect("SANDBOLT_STATIC_BIN must name the sandbolt binary (scripts/build-static.sh)");
    assert!(
        bin.is_file(),
        "SANDBOLT_STATIC_BIN {} is not a file",
        bin.display()
    );
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_scale_run_answers_every_create_and_keeps_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let opts = ScaleOptions::quick(sandbolt_bin(), dir.path().to_path_buf());
    let r = scale::run(&opts, "scale_quick test")
        .await
        .expect("scale run");
    assert_eq!(r.stores.len(), 2);
    for s in &r.stores {
        let store = s.store.name();
        assert_eq!(s.error, None, "{store}: the run stopped early");
        assert_eq!(s.steps.len(), opts.concurrency.len() * Api::ALL.len());
        let issued: usize = s.steps.iter().map(|st| st.result.issued).sum();
        assert_eq!(issued, opts.sandboxes, "{store}: creates issued");
        let ok: usize = s.steps.iter().map(|st| st.result.ok).sum();
        for st in &s.steps {
            // Every create succeeded (failed attempts are retried with the
            // same request id), none hung past the deadline.
            assert_eq!(st.result.unanswered, 0, "{store}: {}", st.line());
            assert_eq!(st.result.ok, st.result.issued, "{store}: {}", st.line());
        }
        assert!(ok > 0, "{store}: no create succeeded");
        for st in &s.steps {
            for (code, msg) in &st.result.failure_samples {
                assert!(
                    code == "Unavailable" && msg.contains("agent sim-"),
                    "{store}: {} failed with {code}: {msg}",
                    st.result.api.name()
                );
            }
        }
        assert_eq!(
            s.missing_after_load, 0,
            "{store}: answered creates not listed"
        );
        assert!(
            s.listed_after_load >= ok,
            "{store}: {} listed < {ok}",
            s.listed_after_load
        );
        assert_eq!(
            s.fleet.overcommits, 0,
            "{store}: an agent was placed over capacity"
        );
        assert!(
            s.fleet.stops > 0 && s.fleet.restarts > 0,
            "{store}: no churn happened"
        );
        let rebuild = s.rebuild.as_ref().expect("a rebuild");
        assert_eq!(
            rebuild.missing, 0,
            "{store}: the rebuilt controller lost records"
        );
        // Its probe create is the one record more.
        assert_eq!(rebuild.listed, rebuild.records + 1, "{store}: {rebuild:?}");
        match s.store {
            StoreKind::Kubernetes => {
                let f = s.failover.as_ref().expect("a failover");
                assert_eq!(f.missing, 0, "{store}: the new leader lost records");
                assert_eq!(f.listed, f.records + 1, "{store}: {f:?}");
            }
            StoreKind::Embedded => assert!(s.failover.is_none()),
        }
        // The controller's own histograms were read around every step.
        assert!(
            s.steps.iter().all(|st| st.place_p99_ms.is_some()),
            "{store}"
        );
        assert!(s.rss.len() > 1, "{store}: RSS sampled");
    }
    // The report renders what was measured.
    let md = scale::report::markdown(&r);
    assert!(
        md.contains("redb store") && md.contains("kube store"),
        "{md}"
    );
}
