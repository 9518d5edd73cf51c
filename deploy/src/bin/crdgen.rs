//! Writes the CRDs generated from the Rust types into `deploy/crds/` and the
//! Helm chart's `crds/` directory (`--check`: only compares, exits 1 on drift).
//!
//! `cargo run -p sandbolt-deploy --bin crdgen`

use std::process::ExitCode;

fn main() -> ExitCode {
    let check = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--check") => true,
        Some(other) => {
            eprintln!("crdgen: unknown argument {other:?} (usage: crdgen [--check])");
            return ExitCode::from(2);
        }
    };
    let root = sandbolt_deploy::crd::deploy_dir();
    let result = if check {
        sandbolt_deploy::crd::check_files(&root).map(|drift| {
            for d in &drift {
                eprintln!("{d}");
            }
            drift.is_empty()
        })
    } else {
        sandbolt_deploy::crd::write_files(&root).map(|written| {
            for p in written {
                println!("wrote {}", p.display());
            }
            true
        })
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("regenerate with: {}", sandbolt_deploy::crd::REGENERATE);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("crdgen: {e:#}");
            ExitCode::FAILURE
        }
    }
}
