//! Claiming a warm sandbox W: a create whose id names W takes it over,
//! under W's lock, instead of starting a container. In order:
//!
//! 0. everything that can refuse the request is worked out first (runtime,
//!    limits, policy, host bindings, named volumes, the entrypoint): a bad
//!    request leaves W warm;
//! 1. W is taken: marked not warm (nothing else can claim or trim it), with
//!    the request's identity in its table entry; its labels are rewritten to
//!    those of a cold create (the warm ones dropped);
//! 2. the request's limits are applied to the running task (`tasks.Update`);
//! 3. the request's network policy, when it has one, replaces the allow-all
//!    (node isolation only) W started with;
//! 4. host bindings and named volumes are mounted into the running task;
//! 5. execd (`POST /sandbolt/claim`, authenticated with the warm token)
//!    takes the new token, env and working directory and starts the
//!    entrypoint.
//!
//! A failure in 1-5 removes W and the create goes on cold under W's id:
//! never a wrong sandbox. Once execd has started the entrypoint there is no
//! going back (user code ran): a later failure fails the create, as a cold
//! create's would.

use containerd_client::services::v1::UpdateTaskRequest;
use sandbolt_proto::wire::EXECD_TOKEN_HEADER;

use super::*;

/// containerd's type of a live resource update.
const RESOURCES_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";
/// execd's claim endpoint (not part of the OpenSandbox API).
const CLAIM_PATH: &str = "/sandbolt/claim";

/// What a claim applies, worked out before W is taken.
struct Plan<'a> {
    runtime: &'a RuntimeInfo,
    limits: hardening::Options,
    policy: Option<NetworkPolicy>,
    held: Vec<volumes::HeldMount>,
    /// The body of `POST /sandbolt/claim`.
    body: Vec<u8>,
}

/// W as the claim took it.
struct Taken {
    pid: u32,
    /// How execd in W is dialled (its namespace, or its address under
    /// gVisor).
    upstream: proxy::Upstream,
    warm_token: String,
    /// The limits W runs under (its class's); `None` when they cannot be
    /// worked out, and the request's are then applied whatever they are.
    warm_limits: Option<hardening::Options>,
}

/// How execd answered the claim.
enum Answer {
    /// The entrypoint runs.
    Started,
    /// The entrypoint could not be started: execd exits as a cold sandbox
    /// with that entrypoint would (the sandbox fails).
    SpawnFailed,
}

impl Sandboxes {
    /// Serves `spec` by claiming the warm sandbox of its id. `Ok(None)`:
    /// W could not be claimed and is removed now (the caller creates cold
    /// under its id). `Err`: the request is refused (W stays warm), or the
    /// claimed sandbox failed as a cold create would have.
    pub(super) async fn claim(
        &self,
        spec: &SandboxSpec,
        clock: &CreateClock,
    ) -> Result<Option<Created>> {
        let id = &spec.sandbox_id;
        let started = Instant::now();
        let plan = self.claim_plan(spec).await?;
        let taken = match self.take_warm(spec) {
            Ok(Some(taken)) => taken,
            Ok(None) => {
                self.undo_create(id, true).await;
                return Ok(None);
            }
            Err(e) => {
                self.volumes.release(id, None);
                return Err(e);
            }
        };
        let answer = match self.rebind(spec, plan, &taken).await {
            Ok(answer) => answer,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "claim failed half way: the warm sandbox is removed and the create goes on cold under its id");
                self.undo_create(id, true).await;
                return Ok(None);
            }
        };
        if matches!(answer, Answer::SpawnFailed) {
            tracing::warn!(sandbox = %id, "claimed: execd could not start the entrypoint (the sandbox fails)");
        }
        // A 200 from the claim is execd answering with the new token
        // already in force: only a sandbox whose entrypoint could not start
        // is waited for (and then fails as a cold one would).
        if spec.wait_for_execd
            && matches!(answer, Answer::SpawnFailed)
            && let Err(e) = self.wait_for_execd(id, &spec.access_token).await
        {
            tracing::warn!(sandbox = %id, error = %e, "claimed sandbox did not become ready");
            self.undo_create(id, true).await;
            return Err(e);
        }
        let timings = CreateTimings {
            claimed_us: clock.elapsed_us(),
            ..Default::default()
        };
        self.metrics
            .observe_stage(CreateStage::WarmClaim, started.elapsed());
        tracing::info!(sandbox = %id, pid = taken.pid, claimed_us = timings.claimed_us, "warm sandbox claimed");
        Ok(Some(Created {
            status: self.get(id)?,
            timings,
            claimed_warm: true,
        }))
    }

    /// Step 0: the checks and preparations that can refuse the request,
    /// and its named volumes reserved (released again on failure).
    async fn claim_plan(&self, spec: &SandboxSpec) -> Result<Plan<'_>> {
        let runtime = self.runtime_for(spec)?;
        let limits = self.limits_for(spec.resources.clone().unwrap_or_default())?;
        let policy = self.network_policy(spec)?;
        let image = self.image_for(spec).await?;
        let entrypoint = self.entrypoint(spec, &image)?;
        let body = serde_json::to_vec(&serde_json::json!({
            "accessToken": spec.access_token,
            "env": entrypoint.env,
            "command": entrypoint.command,
            "workingDir": entrypoint.cwd,
        }))
        .map_err(|e| AgentError::io("encoding the claim")(e.into()))?;
        let held = self.bind_mounts(spec)?;
        let id = &spec.sandbox_id;
        self.reserve_volumes(id, &spec.volume_mounts, "volume_mounts")
            .await?;
        let held = match self.with_named_volumes(spec, held).await {
            Ok(held) => held,
            Err(e) => {
                self.volumes.release(id, None);
                return Err(e);
            }
        };
        Ok(Plan {
            runtime,
            limits,
            policy,
            held,
            body,
        })
    }

    /// Step 1 in the table: W stops being warm and takes the request's
    /// identity. `Ok(None)`: W is not claimable for this request (exited,
    /// or of another image or runtime). Capacity counts W as a user
    /// sandbox from here on.
    fn take_warm(&self, spec: &SandboxSpec) -> Result<Option<Taken>> {
        let id = &spec.sandbox_id;
        let fresh = self.new_entry(spec);
        let mut table = self.table.write();
        let users = table.values().filter(|e| e.warm.is_none()).count();
        let Some(e) = table.get_mut(id) else {
            return Ok(None);
        };
        let Some(w) = e.warm.as_ref() else {
            return Ok(None);
        };
        let Some(netns) = e
            .netns
            .clone()
            .filter(|_| w.ready && e.phase == SandboxPhase::Running)
        else {
            tracing::info!(sandbox = %id, phase = ?e.phase, "warm sandbox is not claimable (exited)");
            return Ok(None);
        };
        if e.image != fresh.image || e.runtime != fresh.runtime {
            tracing::info!(sandbox = %id, warm_image = %e.image, warm_runtime = %e.runtime, image = %fresh.image, runtime = %fresh.runtime, "warm sandbox is of another class than the request");
            return Ok(None);
        }
        if users >= self.cfg.max_sandboxes as usize {
            return Err(AgentError::Capacity {
                max: self.cfg.max_sandboxes,
            });
        }
        let Some(upstream) = self.upstream_of(e) else {
            tracing::info!(sandbox = %id, "warm sandbox is not claimable (no address)");
            return Ok(None);
        };
        let warm_limits = self
            .limits_for(w.class.resources.clone().unwrap_or_default())
            .ok();
        // runsc has no `update`: a gVisor sandbox keeps the limits it was
        // started with, so only a request for exactly those can claim it.
        if e.runtime == crate::gvisor::RUNSC
            && warm_limits
                != self
                    .limits_for(spec.resources.clone().unwrap_or_default())
                    .ok()
        {
            tracing::info!(sandbox = %id, "warm runsc sandbox has other limits than the request (runsc cannot change them)");
            return Ok(None);
        }
        let taken = Taken {
            pid: e.pid,
            upstream,
            warm_token: w.token.clone(),
            warm_limits,
        };
        *e = Entry {
            phase: SandboxPhase::Running,
            pid: e.pid,
            netns: Some(netns),
            ..fresh
        };
        Ok(Some(taken))
    }

    /// Steps 1 (labels) to 5 on the running task. The label rewrite (a
    /// containerd metadata commit) runs beside the rest: the answer waits
    /// for both, and a crash before the labels are written leaves a
    /// warm-labelled container that the restarted agent removes. Limits
    /// already right (the request asks for the class's) are not rewritten:
    /// `tasks.Update` runs `runc update`, the slowest step of a claim.
    async fn rebind(&self, spec: &SandboxSpec, plan: Plan<'_>, taken: &Taken) -> Result<Answer> {
        let id = &spec.sandbox_id;
        let t = Instant::now();
        let labels = self.container_labels(spec, plan.runtime)?;
        let relabel = async {
            let done = self.replace_labels(id, labels).await;
            (done, t.elapsed())
        };
        let bind = async {
            if taken.warm_limits.as_ref() != Some(&plan.limits) {
                self.update_limits(id, &plan.limits).await?;
            }
            let limited = t.elapsed();
            // W runs under the allow-all policy of a create without one.
            if let (Some(network), Some(policy)) = (self.network(), plan.policy)
                && !policy.is_allow_all()
            {
                network.update_policy(id, policy).await?;
            }
            let networked = t.elapsed();
            crate::live_mount::attach_held(taken.pid, id, plan.held).await?;
            let answer = self.post_claim(id, taken, &plan.body).await?;
            Ok::<_, AgentError>((answer, limited, networked))
        };
        let ((relabelled, labelled), bound) = tokio::join!(relabel, bind);
        let (answer, limited, networked) = bound?;
        relabelled?;
        tracing::debug!(sandbox = %id, ?labelled, ?limited, ?networked, started = ?t.elapsed(), "claim stages (from the start of the rebind)");
        Ok(answer)
    }

    /// Replaces every label of the container (the mask `labels`): the warm
    /// ones go.
    async fn replace_labels(&self, id: &str, labels: HashMap<String, String>) -> Result<()> {
        let update = Container {
            id: id.to_string(),
            labels,
            ..Default::default()
        };
        self.ctrd
            .containers()
            .update(self.ctrd.req(UpdateContainerRequest {
                container: Some(update),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["labels".into()],
                }),
            }))
            .await
            .map_err(AgentError::containerd("containers.Update"))?;
        Ok(())
    }

    /// The request's limits on the running task's cgroup.
    async fn update_limits(&self, id: &str, limits: &hardening::Options) -> Result<()> {
        let resources = hardening::update_resources(limits);
        let value = serde_json::to_vec(&resources)
            .map_err(|e| AgentError::io("encoding the limits")(e.into()))?;
        self.ctrd
            .tasks()
            .update(self.ctrd.req(UpdateTaskRequest {
                container_id: id.to_string(),
                resources: Some(prost_types::Any {
                    type_url: RESOURCES_TYPE_URL.into(),
                    value,
                }),
                annotations: Default::default(),
            }))
            .await
            .map_err(AgentError::containerd("tasks.Update"))?;
        Ok(())
    }

    /// Step 5: execd takes the request's token, env and working directory
    /// and starts the entrypoint.
    async fn post_claim(&self, id: &str, taken: &Taken, body: &[u8]) -> Result<Answer> {
        let (code, answer) = crate::netns::http_post_json(
            &taken.upstream,
            self.cfg.execd_port,
            CLAIM_PATH,
            &[(EXECD_TOKEN_HEADER, &taken.warm_token)],
            body,
            // execd answers once the entrypoint is spawned: as quick as a
            // ping; a frozen or wedged execd is given up like a silent one.
            self.cfg.execd_ready_timeout,
        )
        .await
        .map_err(AgentError::io(format!(
            "POST {CLAIM_PATH} to execd of {id}"
        )))?;
        let answer = String::from_utf8_lossy(&answer);
        match code {
            200 => Ok(Answer::Started),
            500 if answer.contains("SPAWN_FAILED") => Ok(Answer::SpawnFailed),
            _ => Err(AgentError::ExecdNotReady {
                id: id.to_string(),
                reason: format!("{CLAIM_PATH} answered {code}: {answer}"),
            }),
        }
    }
}
