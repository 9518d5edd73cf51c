//! The CRD documents generated from the types, and the checked-in copies.

use std::path::{Path, PathBuf};

use anyhow::Context;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use crate::{Sandbox, SandboxPool, SandboxSnapshot, SandboxTemplate, SandboxWarmPool};

/// Command that rewrites every checked-in CRD file from the types.
pub const REGENERATE: &str =
    "CARGO_TARGET_DIR=target-k8s cargo run -p sandbolt-deploy --bin crdgen";

/// Directories (relative to `deploy/`) that hold a copy of every CRD.
pub const CRD_DIRS: [&str; 2] = ["crds", "helm/sandbolt/crds"];

const HEADER: &str = "# Generated from the Rust types in deploy/src by `cargo run -p sandbolt-deploy --bin crdgen`.\n# Do not edit by hand: a test fails when this file drifts from the types.\n";

/// Every CRD of the project.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        Sandbox::crd(),
        SandboxPool::crd(),
        SandboxWarmPool::crd(),
        SandboxSnapshot::crd(),
        SandboxTemplate::crd(),
    ]
}

/// File name of a CRD: `<plural>.<group>.yaml`, as `kubectl` names CRDs.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or("unnamed"))
}

/// One CRD as the YAML document that is checked in.
pub fn to_yaml(crd: &CustomResourceDefinition) -> anyhow::Result<String> {
    let body = serde_yaml::to_string(crd).context("serializing a CRD to YAML")?;
    Ok(format!("{HEADER}{body}"))
}

/// Every CRD file as (file name, content).
pub fn rendered() -> anyhow::Result<Vec<(String, String)>> {
    crds()
        .iter()
        .map(|c| Ok((file_name(c), to_yaml(c)?)))
        .collect()
}

/// `deploy/` of this checkout.
pub fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Writes every CRD into each of [`CRD_DIRS`] under `deploy`, removing
/// stale generated files there; returns the paths written.
pub fn write_files(deploy: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let files = rendered()?;
    let mut written = Vec::new();
    for dir in CRD_DIRS {
        let dir = deploy.join(dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for stale in yaml_files(&dir)? {
            if !files.iter().any(|(name, _)| *name == stale) {
                let p = dir.join(&stale);
                std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
            }
        }
        for (name, content) in &files {
            let p = dir.join(name);
            std::fs::write(&p, content).with_context(|| format!("writing {}", p.display()))?;
            written.push(p);
        }
    }
    Ok(written)
}

/// Compares the checked-in CRD files under `deploy` with the types; returns
/// one line per difference (empty: no drift).
pub fn check_files(deploy: &Path) -> anyhow::Result<Vec<String>> {
    let files = rendered()?;
    let mut drift = Vec::new();
    for dir in CRD_DIRS {
        let dir = deploy.join(dir);
        for (name, want) in &files {
            let p = dir.join(name);
            match std::fs::read_to_string(&p) {
                Ok(have) if have == *want => {}
                Ok(_) => drift.push(format!("{} differs from the types", p.display())),
                Err(e) => drift.push(format!("{} cannot be read: {e}", p.display())),
            }
        }
        if dir.is_dir() {
            for extra in yaml_files(&dir)? {
                if !files.iter().any(|(name, _)| *name == extra) {
                    drift.push(format!(
                        "{} is not generated from any type",
                        dir.join(extra).display()
                    ));
                }
            }
        }
    }
    Ok(drift)
}

fn yaml_files(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".yaml") || name.ends_with(".yml") {
            out.push(name);
        }
    }
    out.sort();
    Ok(out)
}
