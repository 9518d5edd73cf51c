//! A create's warm pool, and the claim step of its placement.
//!
//! **Resolution** (in `Core::validate`): `spec.warm_pool`, or `spec.pool`
//! naming a warm pool, makes the sandbox a member of that pool: `pool`
//! becomes the warm pool's agent pool, the image defaults to the
//! template's (another image is refused: a claim could never serve it), the
//! runtime likewise, the template env sits under the request's env and the
//! template limits are the defaults under the request's.
//!
//! **Placement**: a member takes a free warm sandbox W of its pool (the
//! create's sandbox id becomes W, and the agent's `CreateSandbox` with that
//! id is the claim), else it is created cold while the pool's total stays
//! below `pool_max` (RESOURCE_EXHAUSTED beyond). A create that names no
//! warm pool may still be served by a claim from a pool of its agent pool
//! with the same image and runtime; then it joins that pool, and when none
//! is free it is an ordinary cold create outside any pool (a pool it did
//! not ask for never refuses it). Creates with named volumes that need a
//! volume root but no particular node are not claimed (cold): the warm
//! sandboxes' nodes may have no volume root.

use crate::error::{Error, Result};
use crate::ids::SandboxId;
use crate::placement::PlacementRequest;
use crate::registry::{WarmAsk, WarmPlacement};
use crate::sandbox::Core;
use crate::store::{Phase, SandboxRecord, SandboxSpec, WarmPoolRecord};

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// Applies warm pool `p` to `spec` (see the module docs).
fn apply_pool(spec: &mut SandboxSpec, p: &WarmPoolRecord) -> Result<()> {
    spec.warm_pool.clone_from(&p.name);
    spec.pool.clone_from(&p.agent_pool);
    let image = spec.image.trim();
    if image.is_empty() {
        spec.image.clone_from(&p.image);
    } else if sandbolt_image_ref::match_key(image) != sandbolt_image_ref::match_key(&p.image) {
        return Err(invalid(format!(
            "image {image:?} is not warm pool {}'s image {} (leave it empty to use it)",
            p.name, p.image
        )));
    }
    let runtime = spec.runtime.trim();
    if runtime.is_empty() {
        spec.runtime.clone_from(&p.runtime);
    } else if !p.runtime.is_empty() && runtime != p.runtime {
        return Err(invalid(format!(
            "runtime {runtime:?} is not warm pool {}'s runtime {:?}",
            p.name, p.runtime
        )));
    }
    for (k, v) in &p.env {
        spec.envs.entry(k.clone()).or_insert_with(|| v.clone());
    }
    let (r, t) = (&mut spec.resources, &p.limits);
    if r.cpu_limit.trim().is_empty() {
        r.cpu_limit.clone_from(&t.cpu_limit);
    }
    if r.memory_limit.trim().is_empty() {
        r.memory_limit.clone_from(&t.memory_limit);
    }
    if r.pids_limit == 0 {
        r.pids_limit = t.pids_limit;
    }
    Ok(())
}

impl Core {
    /// The create's warm pool, applied to its spec (before the agent
    /// pool's defaults). `spec.pool` is already defaulted.
    pub(crate) fn resolve_warm_pool(&self, spec: &mut SandboxSpec) -> Result<()> {
        let named = spec.warm_pool.trim().to_string();
        let pool = if named.is_empty() {
            match self.warm_pools.get(&spec.pool) {
                Some(p) => p,
                None => return Ok(()),
            }
        } else {
            self.warm_pools
                .get(&named)
                .ok_or_else(|| invalid(format!("warmPool: warm pool {named:?} does not exist")))?
        };
        apply_pool(spec, &pool)
    }

    /// A pool that may serve a create that names none: same agent pool,
    /// image and (effective) runtime.
    fn implicit_warm_pool(&self, r: &SandboxRecord) -> Option<WarmPoolRecord> {
        let key = sandbolt_image_ref::match_key(&r.spec.image);
        let policy_runtime = || {
            let pk = self.registry.pool_key(&r.namespace, &r.spec.pool);
            self.registry
                .pool_policy(&pk)
                .map(|p| p.runtime)
                .unwrap_or_default()
        };
        self.warm_pools
            .of_agent_pool(&r.spec.pool)
            .into_iter()
            .find(|p| {
                sandbolt_image_ref::match_key(&p.image) == key
                    && (if p.runtime.is_empty() {
                        policy_runtime()
                    } else {
                        p.runtime.clone()
                    }) == r.spec.runtime
            })
    }

    /// Placement of a create with its warm pool (see the module docs):
    /// `Some(W)` when warm sandbox W was claimed (`r` now names W and its
    /// agent), `None` when `r` was placed cold under its own id. `None` is
    /// also the answer, untouched, when no warm pool concerns `r`; then the
    /// caller places it.
    pub(crate) fn place_warm(
        &self,
        r: &mut SandboxRecord,
        req: &PlacementRequest<'_>,
        claim: bool,
    ) -> Result<Option<Placed>> {
        let (pool, implicit) = if r.spec.warm_pool.is_empty() {
            match self.implicit_warm_pool(r) {
                Some(p) if claim => (p, true),
                _ => return Ok(None),
            }
        } else {
            match self.warm_pools.get(&r.spec.warm_pool) {
                Some(p) => (p, false),
                // Deleted since validation: its sandboxes live on, cold.
                None => return Ok(None),
            }
        };
        let ask = WarmAsk {
            pool: &pool.name,
            pool_max: pool.pool_max,
            claim,
            implicit,
        };
        match self.registry.allocate_warm(req, &r.sandbox_id, &ask)? {
            WarmPlacement::Claimed { agent, warm_id } => {
                r.agent_id = agent;
                r.sandbox_id = warm_id.clone();
                r.spec.warm_pool.clone_from(&pool.name);
                r.push_event(
                    "info",
                    "controller",
                    format!(
                        "placed on agent {} by claiming warm sandbox {warm_id} of pool {}",
                        r.agent_id, pool.name
                    ),
                );
                Ok(Some(Placed::Claimed))
            }
            WarmPlacement::Cold(p) => Ok(Some(Placed::Cold(p))),
        }
    }
}

impl Core {
    /// Strong mode, the agent refused the claim of the record's warm id W
    /// (W is another sandbox's; see `refused_claim`): the committed,
    /// Pending record moves to a fresh id placed cold, and the create goes
    /// on. W is never removed. A crash in between leaves a Pending record
    /// with the new id, which re-driving creates cold.
    pub(crate) async fn strong_after_refused_claim(
        &self,
        r: SandboxRecord,
        wait_for_execd: bool,
    ) -> Result<SandboxRecord> {
        let warm_id = r.sandbox_id.clone();
        tracing::warn!(sandbox = %r.name, agent = %r.agent_id, %warm_id, "agent refused the warm claim; creating cold");
        self.registry.release(&r.agent_id, &warm_id);
        let mut n = r.clone();
        n.sandbox_id = SandboxId::generate();
        let _inflight = self.inflight(&n.sandbox_id);
        let moved = self.place_cold_after_claim(&mut n).and_then(|()| {
            self.modify(&r.key(), |x| {
                if x.sandbox_id != warm_id || x.phase != Phase::Pending {
                    return Err(Error::Aborted(format!("sandbox {} changed meanwhile", x.name)));
                }
                x.sandbox_id.clone_from(&n.sandbox_id);
                x.agent_id.clone_from(&n.agent_id);
                x.push_event(
                    "warning",
                    "controller",
                    format!(
                        "agent refused the claim of warm sandbox {warm_id} (another sandbox's id); creating {} cold on agent {}",
                        n.sandbox_id, n.agent_id
                    ),
                );
                Ok(())
            })
        });
        let x = match moved {
            Ok(x) => x,
            Err(e) => {
                self.registry.release(&n.agent_id, &n.sandbox_id);
                self.forget_failed_create(&r);
                return Err(e);
            }
        };
        match self.agent_create(&x, wait_for_execd).await {
            Ok(created) => self.mark_running(&x, created).await,
            Err(e) => {
                self.discard_container(&x).await;
                self.registry.release(&x.agent_id, &x.sandbox_id);
                self.forget_failed_create(&x);
                Err(e)
            }
        }
    }

    /// Removes the record of a strong create that failed (never
    /// acknowledged).
    fn forget_failed_create(&self, r: &SandboxRecord) {
        let _ = self.store.delete(&r.key());
        self.untrack_expiry(r);
    }
}

/// What [`Core::place_warm`] did.
#[derive(Debug)]
pub(crate) enum Placed {
    Claimed,
    Cold(crate::placement::Placement),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Resources;

    fn pool() -> WarmPoolRecord {
        WarmPoolRecord {
            name: "py".into(),
            agent_pool: "gpu".into(),
            image: "docker.io/library/busybox:latest".into(),
            runtime: "runc".into(),
            limits: Resources {
                cpu_limit: "500m".into(),
                memory_limit: "128Mi".into(),
                pids_limit: 64,
                ..Default::default()
            },
            env: [
                ("A".to_string(), "t".to_string()),
                ("B".to_string(), "t".to_string()),
            ]
            .into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_pool_fills_what_the_request_leaves_unset() {
        let mut s = SandboxSpec {
            pool: "py".into(),
            envs: [("A".to_string(), "req".to_string())].into(),
            resources: Resources {
                memory_limit: "64Mi".into(),
                ..Default::default()
            },
            ..Default::default()
        };
        apply_pool(&mut s, &pool()).unwrap();
        assert_eq!((s.warm_pool.as_str(), s.pool.as_str()), ("py", "gpu"));
        assert_eq!(s.image, "docker.io/library/busybox:latest");
        assert_eq!(s.runtime, "runc");
        assert_eq!(s.envs["A"], "req", "the request's env wins");
        assert_eq!(s.envs["B"], "t");
        assert_eq!(
            (
                s.resources.cpu_limit.as_str(),
                s.resources.memory_limit.as_str(),
                s.resources.pids_limit
            ),
            ("500m", "64Mi", 64)
        );
        // The same image spelled otherwise is fine.
        let mut s = SandboxSpec {
            image: "busybox:latest".into(),
            ..Default::default()
        };
        apply_pool(&mut s, &pool()).unwrap();
    }

    fn core(dir: &std::path::Path) -> Core {
        let cfg = crate::ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir, "t");
        let store = crate::store::embedded::RedbStore::open(dir).unwrap();
        let core = Core::new(cfg, std::sync::Arc::new(store)).unwrap();
        let mut p = pool();
        p.agent_pool = "default".into();
        p.runtime = String::new();
        core.warm_pools.put(p);
        core
    }

    fn validated(core: &Core, spec: SandboxSpec) -> Result<SandboxSpec> {
        let req = crate::sandbox::CreateRequest {
            name: "s".into(),
            spec,
            ..Default::default()
        };
        core.validate(req).map(|r| r.spec)
    }

    #[test]
    fn spec_pool_naming_a_warm_pool_resolves_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let core = core(dir.path());
        let s = validated(
            &core,
            SandboxSpec {
                pool: "py".into(),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!((s.warm_pool.as_str(), s.pool.as_str()), ("py", "default"));
        assert_eq!(s.image, "docker.io/library/busybox:latest");
        assert_eq!(s.envs["A"], "t");
        // Named explicitly: the same.
        let s = validated(
            &core,
            SandboxSpec {
                warm_pool: "py".into(),
                image: "busybox".into(),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(s.warm_pool, "py");
        // An agent pool name is not a warm pool: untouched, image required.
        let e = validated(&core, SandboxSpec::default())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("image is required"), "{e}");
        let e = validated(
            &core,
            SandboxSpec {
                warm_pool: "nope".into(),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("warmPool: "), "{e}");
        let e = validated(
            &core,
            SandboxSpec {
                pool: "py".into(),
                image: "alpine".into(),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.starts_with("image ")),
            "{e}"
        );
    }

    #[test]
    fn another_image_or_runtime_is_refused_naming_the_field() {
        let mut s = SandboxSpec {
            image: "alpine".into(),
            ..Default::default()
        };
        let e = apply_pool(&mut s, &pool()).unwrap_err().to_string();
        assert!(
            e.starts_with("image \"alpine\" is not warm pool py's image"),
            "{e}"
        );
        let mut s = SandboxSpec {
            runtime: "runsc".into(),
            ..Default::default()
        };
        let e = apply_pool(&mut s, &pool()).unwrap_err().to_string();
        assert!(e.starts_with("runtime \"runsc\""), "{e}");
    }
}
