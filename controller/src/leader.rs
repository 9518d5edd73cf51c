//! Controller high availability through a `coordination.k8s.io/v1` Lease.
//!
//! Every controller replica runs a [`LeaderElector`]. At most one of them
//! holds the Lease and is the leader; the others are standbys that poll the
//! Lease every `retry_period` and take it over once its holder has stopped
//! renewing it for a full `lease_duration`. The state is published on a
//! [`tokio::sync::watch`] channel so the controller can stop serving writes
//! the moment it stops leading, and rebuild its registry before it starts.
//!
//! ```no_run
//! # async fn f(client: kube::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use sandbolt_controller::leader::{LeaderElector, LeaseConfig};
//! let cfg = LeaseConfig::new("sandbolt-system", "sandbolt-controller", "controller-0-3f2a");
//! let elector = LeaderElector::spawn(client, cfg)?;
//! let mut rx = elector.subscribe();
//! rx.wait_for(|s| s.is_leader()).await?;
//! // ... rebuild the registry, then serve writes while `elector.is_leader()` ...
//! elector.release().await; // graceful: a standby takes over at once
//! # Ok(()) }
//! ```
//!
//! # Algorithm
//!
//! Each round (every `retry_period`) the elector reads the Lease and:
//!
//! * absent: creates it naming itself (`leaseTransitions = 0`). Losing the
//!   create race (409) makes it a follower until the next round;
//! * held by itself: renews it (`renewTime = now`) with a `replace` guarded by
//!   the `resourceVersion` it read; a 409 means someone wrote in between, so
//!   it re-reads once and decides again;
//! * released (empty holder): takes it over at once;
//! * held by another whose record has not changed for the record's
//!   `leaseDurationSeconds`: takes it over (`leaseTransitions + 1`,
//!   `acquireTime = now`), again guarded by the `resourceVersion`;
//! * otherwise: follows.
//!
//! # Judging expiry: local observation, not the holder's clock
//!
//! A standby does *not* compare the Lease's `renewTime` with its own wall
//! clock. It remembers, on its own monotonic clock, when it last *saw the
//! record change* and deems the Lease expired once it has seen no change for
//! `leaseDurationSeconds`. Comparing `renewTime` with the local wall clock
//! would only be safe if the replicas' clocks agreed to within
//! `lease_duration - renew_deadline`: a standby whose clock runs 6 s ahead
//! (with the 15 s / 10 s defaults) would take the Lease while the leader
//! still believes it leads, and there would be two writers. Observation
//! time needs only that the replicas' clocks *tick at the same rate*, which
//! monotonic clocks do to within far less than the margin. The price is that
//! a replica that starts while a dead holder's Lease is still on record waits
//! one `lease_duration` from its first look, even if `renewTime` is long past;
//! a standby that has been running all along takes over within
//! `lease_duration + retry_period` of the last renewal, and a graceful
//! [`LeaderElector::release`] hands over within one `retry_period`.
//!
//! # Stepping down
//!
//! A leader that cannot renew must stop writing *before* a standby can take
//! over, or both would write. The leader records the instant at which it
//! *started* each successful renewal round (before its read, so before the
//! API server committed the write and before any standby could have observed
//! it). If no round has succeeded for `renew_deadline` since then it steps
//! down: it publishes [`LeaderState::Follower`] and [`LeaderElector::is_leader`]
//! turns false. A standby cannot take over earlier than `lease_duration`
//! after it observed that renewal, which is later than the leader's step-down
//! by at least `lease_duration - renew_deadline`. Every API call a leader
//! makes is bounded by the time left to its deadline, so a hung connection
//! cannot hold it past it, and `is_leader()` checks the deadline itself, so a
//! starved elector task cannot either.
//!
//! After stepping down the elector keeps campaigning: if the Lease still names
//! it (nobody else took it) it renews it and leads again. The integrator sees
//! a `Follower` → `Leader` transition and must treat it as a new term
//! (rebuild before writing).
//!
//! Identities must be unique per *process* (pod name plus a random suffix):
//! two processes with the same identity would both believe they hold the
//! Lease.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use parking_lot::Mutex;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Default `lease_duration`: how long a standby waits without seeing the
/// Lease change before it takes over.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// Default `renew_deadline`: how long a leader keeps leading without a
/// successful renewal.
pub const DEFAULT_RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// Default `retry_period`: the interval between rounds, for leaders and
/// standbys alike.
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);

/// Where the Lease lives, who we are, and the election's timings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity, written to `holderIdentity`. Must be unique
    /// per process.
    pub identity: String,
    /// Written (rounded up to whole seconds) to `leaseDurationSeconds`.
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

/// Why a [`LeaseConfig`] was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseConfigError {
    #[error("lease {0} must not be empty")]
    Empty(&'static str),
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("lease_duration {0:?} does not fit leaseDurationSeconds (i32 seconds)")]
    LeaseDurationTooLong(Duration),
    #[error(
        "renew_deadline ({renew_deadline:?}) must be shorter than lease_duration ({lease_duration:?})"
    )]
    RenewDeadlineNotBelowLeaseDuration {
        renew_deadline: Duration,
        lease_duration: Duration,
    },
    #[error(
        "retry_period ({retry_period:?}) must be shorter than renew_deadline ({renew_deadline:?})"
    )]
    RetryPeriodNotBelowRenewDeadline {
        retry_period: Duration,
        renew_deadline: Duration,
    },
}

impl LeaseConfig {
    /// A config with the default timings (15 s / 10 s / 2 s).
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: DEFAULT_LEASE_DURATION,
            renew_deadline: DEFAULT_RENEW_DEADLINE,
            retry_period: DEFAULT_RETRY_PERIOD,
        }
    }

    /// Replaces the three timings.
    pub fn with_timings(
        mut self,
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Self {
        self.lease_duration = lease_duration;
        self.renew_deadline = renew_deadline;
        self.retry_period = retry_period;
        self
    }

    /// Checks the names are set and
    /// `0 < retry_period < renew_deadline < lease_duration`.
    pub fn validate(&self) -> Result<(), LeaseConfigError> {
        for (what, value) in [
            ("namespace", &self.namespace),
            ("name", &self.name),
            ("identity", &self.identity),
        ] {
            if value.is_empty() {
                return Err(LeaseConfigError::Empty(what));
            }
        }
        for (what, value) in [
            ("lease_duration", self.lease_duration),
            ("renew_deadline", self.renew_deadline),
            ("retry_period", self.retry_period),
        ] {
            if value.is_zero() {
                return Err(LeaseConfigError::Zero(what));
            }
        }
        if self.renew_deadline >= self.lease_duration {
            return Err(LeaseConfigError::RenewDeadlineNotBelowLeaseDuration {
                renew_deadline: self.renew_deadline,
                lease_duration: self.lease_duration,
            });
        }
        if self.retry_period >= self.renew_deadline {
            return Err(LeaseConfigError::RetryPeriodNotBelowRenewDeadline {
                retry_period: self.retry_period,
                renew_deadline: self.renew_deadline,
            });
        }
        if i32::try_from(lease_duration_seconds(self.lease_duration)).is_err() {
            return Err(LeaseConfigError::LeaseDurationTooLong(self.lease_duration));
        }
        Ok(())
    }
}

/// `lease_duration` rounded *up* to whole seconds: standbys wait for the
/// record's value, which must not be shorter than ours (rounding up only adds
/// to the step-down margin).
fn lease_duration_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// What this replica currently is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaderState {
    /// Not leading. `holder` is the Lease's holder as last observed, `None`
    /// when unknown, released, or right after stepping down.
    Follower { holder: Option<String> },
    /// Leading since `since` (wall clock, for display). `term` is the Lease's
    /// `leaseTransitions` when this term started.
    Leader { since: SystemTime, term: i32 },
}

impl LeaderState {
    pub fn is_leader(&self) -> bool {
        matches!(self, LeaderState::Leader { .. })
    }

    /// The leader as far as this replica knows: itself when leading.
    pub fn holder<'a>(&'a self, own_identity: &'a str) -> Option<&'a str> {
        match self {
            LeaderState::Follower { holder } => holder.as_deref(),
            LeaderState::Leader { .. } => Some(own_identity),
        }
    }
}

/// State shared by the elector task and its handle.
struct Shared {
    tx: watch::Sender<LeaderState>,
    /// While leading: the instant at which leadership lapses unless a renewal
    /// succeeds first (start of the last successful round + renew_deadline).
    leading_until: Mutex<Option<Instant>>,
}

impl Shared {
    fn publish(&self, state: LeaderState) {
        self.tx.send_if_modified(|cur| {
            if *cur == state {
                false
            } else {
                *cur = state;
                true
            }
        });
    }

    fn is_leader(&self) -> bool {
        let within = matches!(*self.leading_until.lock(), Some(until) if Instant::now() < until);
        within && self.tx.borrow().is_leader()
    }

    /// Stops leading at once, as far as anyone asking this process is
    /// concerned.
    fn revoke(&self) {
        *self.leading_until.lock() = None;
        self.publish(LeaderState::Follower { holder: None });
    }
}

/// Handle to the elector task. Dropping it stops the task without releasing
/// the Lease (use [`LeaderElector::release`] for a graceful hand-over).
pub struct LeaderElector {
    cfg: LeaseConfig,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl LeaderElector {
    /// Validates `cfg` and starts campaigning on a tokio task. Must be called
    /// inside a tokio runtime.
    pub fn spawn(client: kube::Client, cfg: LeaseConfig) -> Result<Self, LeaseConfigError> {
        cfg.validate()?;
        let (tx, _) = watch::channel(LeaderState::Follower { holder: None });
        let shared = Arc::new(Shared {
            tx,
            leading_until: Mutex::new(None),
        });
        let (stop_tx, stop_rx) = oneshot::channel();
        let runner = Runner {
            api: Api::namespaced(client, &cfg.namespace),
            cfg: cfg.clone(),
            shared: shared.clone(),
            observed: None,
            leading: None,
        };
        let task = tokio::spawn(runner.run(stop_rx));
        Ok(Self {
            cfg,
            shared,
            stop: Some(stop_tx),
            task: Some(task),
        })
    }

    /// A receiver of state changes. It is notified on transitions (and on a
    /// change of the observed holder), not on every renewal.
    pub fn subscribe(&self) -> watch::Receiver<LeaderState> {
        self.shared.tx.subscribe()
    }

    /// The current published state.
    pub fn state(&self) -> LeaderState {
        self.shared.tx.borrow().clone()
    }

    /// Whether this replica leads *right now*: the published state is
    /// `Leader` and the renew deadline has not passed. Check it before each
    /// write; it turns false at the deadline even if the elector task has not
    /// run yet.
    pub fn is_leader(&self) -> bool {
        self.shared.is_leader()
    }

    pub fn identity(&self) -> &str {
        &self.cfg.identity
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.cfg
    }

    /// Graceful shutdown: stops campaigning, publishes `Follower` and, if
    /// this replica was leading, clears `holderIdentity` so a standby takes
    /// over on its next round instead of waiting for the Lease to expire.
    /// Bounded by `renew_deadline`; if the API server is unreachable the
    /// Lease simply expires.
    pub async fn release(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
            && e.is_panic()
        {
            tracing::error!(lease = %self.cfg.name, "leader elector task panicked");
        }
        self.shared.revoke();
    }

    /// Stops the task at once *without* releasing the Lease, as a crash
    /// would: standbys take over only when the Lease expires. The same as
    /// dropping the handle.
    pub fn abort(self) {
        drop(self);
    }
}

impl Drop for LeaderElector {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.shared.revoke();
    }
}

/// The parts of a Lease whose change shows its holder is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    acquire_time: Option<MicroTime>,
    transitions: Option<i32>,
    duration_seconds: Option<i32>,
}

impl Record {
    fn of(lease: &Lease) -> Self {
        let spec = lease.spec.clone().unwrap_or_default();
        Self {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            renew_time: spec.renew_time,
            acquire_time: spec.acquire_time,
            transitions: spec.lease_transitions,
            duration_seconds: spec.lease_duration_seconds,
        }
    }

    /// How long a standby waits without seeing a change: the holder's
    /// declared duration, or ours when the record has none.
    fn lease_duration(&self, fallback: Duration) -> Duration {
        match self.duration_seconds {
            Some(s) if s > 0 => Duration::from_secs(s as u64),
            _ => fallback,
        }
    }
}

/// A record and the local instant at which it was first seen.
#[derive(Debug, Clone)]
struct Observed {
    record: Record,
    at: Instant,
}

/// Whether a record first seen at `observed_at` and unchanged since has
/// expired at `now`.
fn expired(observed_at: Instant, lease_duration: Duration, now: Instant) -> bool {
    match observed_at.checked_add(lease_duration) {
        Some(expiry) => now >= expiry,
        None => false,
    }
}

/// Folds a freshly read record into the last observation: a changed record
/// restarts the observation clock at `now`, an unchanged one keeps the instant
/// it was first seen. Returns the observation and, if the holder changed to
/// someone, the new holder.
fn observe_record(
    last: &mut Option<Observed>,
    record: Record,
    now: Instant,
) -> (Observed, Option<String>) {
    let mut new_holder = None;
    if last.as_ref().is_none_or(|o| o.record != record) {
        let prev_holder = last.as_ref().and_then(|o| o.record.holder.as_ref());
        if record.holder.is_some() && record.holder.as_ref() != prev_holder {
            new_holder = record.holder.clone();
        }
        *last = Some(Observed { record, at: now });
    }
    let observed = last.clone().expect("set above when absent");
    (observed, new_holder)
}

/// What to do with an existing Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decision {
    /// It names us: renew it.
    Renew,
    /// Released or expired: take it over.
    TakeOver,
    /// Someone else holds it.
    Follow { holder: String },
}

fn decide(identity: &str, observed: &Observed, fallback: Duration, now: Instant) -> Decision {
    match &observed.record.holder {
        None => Decision::TakeOver,
        Some(h) if h == identity => Decision::Renew,
        Some(h) => {
            if expired(observed.at, observed.record.lease_duration(fallback), now) {
                Decision::TakeOver
            } else {
                Decision::Follow { holder: h.clone() }
            }
        }
    }
}

/// The Lease as we write it to renew it (`take_over == false`) or to take it
/// over, and the term it starts or continues. Everything else, the
/// `resourceVersion` we read in particular, is kept: the API server rejects
/// the replace with 409 if anyone wrote since our read, which is what makes
/// two simultaneous take-overs impossible.
fn claim(mut lease: Lease, take_over: bool, cfg: &LeaseConfig) -> (Lease, i32) {
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let now = now_micro();
    let mut term = spec.lease_transitions.unwrap_or(0);
    if take_over {
        term = term.saturating_add(1);
        spec.lease_transitions = Some(term);
        spec.acquire_time = Some(now.clone());
        spec.holder_identity = Some(cfg.identity.clone());
    }
    spec.renew_time = Some(now);
    spec.lease_duration_seconds = Some(lease_duration_seconds(cfg.lease_duration) as i32);
    (lease, term)
}

/// The Lease with its holder cleared, if it names `identity`; the
/// `resourceVersion` is kept, as in [`claim`].
fn released(mut lease: Lease, identity: &str) -> Option<Lease> {
    let spec = lease.spec.as_mut()?;
    if spec.holder_identity.as_deref() != Some(identity) {
        return None;
    }
    spec.holder_identity = None;
    spec.renew_time = Some(now_micro());
    Some(lease)
}

/// The result of one round.
#[derive(Debug)]
enum Outcome {
    /// We hold the Lease (created, renewed or taken over) at this term.
    Held { term: i32 },
    /// Someone else holds it (or `None`: unknown / lost a race).
    Follow { holder: Option<String> },
    /// Our writes kept conflicting; nothing was decided this round.
    Contended,
}

struct Leading {
    /// Start of the last successful round.
    last_renew: Instant,
}

struct Runner {
    api: Api<Lease>,
    cfg: LeaseConfig,
    shared: Arc<Shared>,
    observed: Option<Observed>,
    leading: Option<Leading>,
}

fn now_micro() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 || s.is_conflict() || s.is_already_exists())
}

impl Runner {
    async fn run(mut self, mut stop: oneshot::Receiver<()>) {
        tracing::info!(
            lease = %self.cfg.name, namespace = %self.cfg.namespace, identity = %self.cfg.identity,
            "leader election: campaigning"
        );
        // `Ok` from `stop` is a release; `Err` (the handle was dropped) is
        // an abort, which must not write to the Lease.
        let stopped = loop {
            tokio::select! {
                biased;
                r = &mut stop => break r,
                () = self.round() => {}
            }
            let next = self.next_round_at();
            tokio::select! {
                biased;
                r = &mut stop => break r,
                () = tokio::time::sleep_until(next.into()) => {}
            }
        };
        match stopped {
            Ok(()) => self.release().await,
            Err(_) => {
                self.leading = None;
                self.shared.revoke();
            }
        }
    }

    /// The next round starts one retry_period from now, or at the renew
    /// deadline if that comes first (so the step-down is not late).
    fn next_round_at(&self) -> Instant {
        let next = Instant::now() + self.cfg.retry_period;
        match &self.leading {
            Some(l) => next.min(l.last_renew + self.cfg.renew_deadline),
            None => next,
        }
    }

    fn step_down(&mut self, why: &str) {
        if self.leading.take().is_some() {
            tracing::warn!(
                lease = %self.cfg.name, identity = %self.cfg.identity, reason = why,
                "leader election: stepping down; stop writing"
            );
        }
        self.shared.revoke();
    }

    async fn round(&mut self) {
        let started = Instant::now();
        // A leader's round may not outlast its deadline; a standby's is
        // bounded by renew_deadline so a hung call does not stall it forever.
        let budget = match &self.leading {
            Some(l) => {
                let deadline = l.last_renew + self.cfg.renew_deadline;
                if started >= deadline {
                    self.step_down("no successful renewal within renew_deadline");
                    self.cfg.renew_deadline
                } else {
                    deadline - started
                }
            }
            None => self.cfg.renew_deadline,
        };
        let result = tokio::time::timeout(budget, self.attempt()).await;
        match result {
            Ok(Ok(Outcome::Held { term })) => {
                *self.shared.leading_until.lock() = Some(started + self.cfg.renew_deadline);
                match &mut self.leading {
                    Some(l) => {
                        l.last_renew = started;
                        tracing::debug!(lease = %self.cfg.name, term, "leader election: renewed");
                    }
                    None => {
                        self.leading = Some(Leading {
                            last_renew: started,
                        });
                        tracing::info!(
                            lease = %self.cfg.name, identity = %self.cfg.identity, term,
                            "leader election: acquired the lease; now leading"
                        );
                        self.shared.publish(LeaderState::Leader {
                            since: SystemTime::now(),
                            term,
                        });
                    }
                }
            }
            Ok(Ok(Outcome::Follow { holder })) => {
                if self.leading.is_some() {
                    self.step_down(&format!(
                        "lease is now held by {}",
                        holder.as_deref().unwrap_or("nobody")
                    ));
                }
                self.shared.publish(LeaderState::Follower { holder });
            }
            Ok(Ok(Outcome::Contended)) => {
                tracing::warn!(lease = %self.cfg.name, "leader election: lease update kept conflicting");
                self.check_deadline();
            }
            Ok(Err(e)) => {
                if self.leading.is_some() {
                    tracing::warn!(lease = %self.cfg.name, error = %e, "leader election: failed to renew the lease");
                } else {
                    tracing::debug!(lease = %self.cfg.name, error = %e, "leader election: failed to read or acquire the lease");
                }
                self.check_deadline();
            }
            Err(_) => {
                if self.leading.is_some() {
                    // The budget was the time left to the deadline.
                    self.step_down("lease renewal timed out at renew_deadline");
                } else {
                    tracing::debug!(lease = %self.cfg.name, "leader election: lease round timed out");
                }
            }
        }
    }

    fn check_deadline(&mut self) {
        if let Some(l) = &self.leading
            && Instant::now() >= l.last_renew + self.cfg.renew_deadline
        {
            self.step_down("no successful renewal within renew_deadline");
        }
    }

    /// Records what we saw; logs a new holder.
    fn observe(&mut self, lease: &Lease, now: Instant) -> Observed {
        let (observed, new_holder) = observe_record(&mut self.observed, Record::of(lease), now);
        if let Some(h) = new_holder
            && h != self.cfg.identity
        {
            tracing::info!(lease = %self.cfg.name, holder = %h, "leader election: observed leader");
        }
        observed
    }

    /// One read-decide-write; re-reads once after a write conflict.
    async fn attempt(&mut self) -> Result<Outcome, kube::Error> {
        for _ in 0..2 {
            let Some(lease) = self.api.get_opt(&self.cfg.name).await? else {
                return self.create().await;
            };
            let now = Instant::now();
            let observed = self.observe(&lease, now);
            let decision = decide(&self.cfg.identity, &observed, self.cfg.lease_duration, now);
            let take_over = match decision {
                Decision::Follow { holder } => {
                    return Ok(Outcome::Follow {
                        holder: Some(holder),
                    });
                }
                Decision::Renew => false,
                Decision::TakeOver => true,
            };
            let (lease, term) = claim(lease, take_over, &self.cfg);
            match self
                .api
                .replace(&self.cfg.name, &PostParams::default(), &lease)
                .await
            {
                Ok(written) => {
                    self.observe(&written, Instant::now());
                    return Ok(Outcome::Held { term });
                }
                Err(e) if is_conflict(&e) => {
                    tracing::debug!(lease = %self.cfg.name, "leader election: update conflict; re-reading");
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Outcome::Contended)
    }

    async fn create(&mut self) -> Result<Outcome, kube::Error> {
        let now = now_micro();
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.cfg.name.clone()),
                namespace: Some(self.cfg.namespace.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.cfg.identity.clone()),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_duration_seconds: Some(lease_duration_seconds(self.cfg.lease_duration) as i32),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(written) => {
                self.observe(&written, Instant::now());
                Ok(Outcome::Held { term: 0 })
            }
            Err(e) if is_conflict(&e) => {
                tracing::debug!(lease = %self.cfg.name, "leader election: lost the race to create the lease");
                Ok(Outcome::Follow { holder: None })
            }
            Err(e) => Err(e),
        }
    }

    /// On stop: stop leading first, then clear the holder if the Lease still
    /// names us, so a standby need not wait for it to expire.
    async fn release(&mut self) {
        let was_leading = self.leading.is_some();
        self.leading = None;
        self.shared.revoke();
        if !was_leading {
            return;
        }
        match tokio::time::timeout(self.cfg.renew_deadline, self.clear_holder()).await {
            Ok(Ok(true)) => {
                tracing::info!(lease = %self.cfg.name, identity = %self.cfg.identity, "leader election: released the lease")
            }
            Ok(Ok(false)) => {
                tracing::info!(lease = %self.cfg.name, "leader election: lease no longer ours; nothing to release")
            }
            Ok(Err(e)) => {
                tracing::warn!(lease = %self.cfg.name, error = %e, "leader election: could not release the lease; it will expire")
            }
            Err(_) => {
                tracing::warn!(lease = %self.cfg.name, "leader election: releasing the lease timed out; it will expire")
            }
        }
    }

    async fn clear_holder(&self) -> Result<bool, kube::Error> {
        for _ in 0..2 {
            let Some(lease) = self.api.get_opt(&self.cfg.name).await? else {
                return Ok(false);
            };
            let Some(lease) = released(lease, &self.cfg.identity) else {
                return Ok(false);
            };
            match self
                .api
                .replace(&self.cfg.name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => return Ok(true),
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LeaseConfig {
        LeaseConfig::new("ns", "lease", "me")
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn defaults_are_valid() {
        let c = cfg();
        assert_eq!(c.lease_duration, secs(15.0));
        assert_eq!(c.renew_deadline, secs(10.0));
        assert_eq!(c.retry_period, secs(2.0));
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn validation_rejects_bad_timings_and_names() {
        let bad = cfg().with_timings(secs(10.0), secs(10.0), secs(2.0));
        assert!(matches!(
            bad.validate(),
            Err(LeaseConfigError::RenewDeadlineNotBelowLeaseDuration { .. })
        ));
        let bad = cfg().with_timings(secs(10.0), secs(12.0), secs(2.0));
        assert!(matches!(
            bad.validate(),
            Err(LeaseConfigError::RenewDeadlineNotBelowLeaseDuration { .. })
        ));
        let bad = cfg().with_timings(secs(15.0), secs(2.0), secs(2.0));
        assert!(matches!(
            bad.validate(),
            Err(LeaseConfigError::RetryPeriodNotBelowRenewDeadline { .. })
        ));
        let bad = cfg().with_timings(secs(15.0), secs(10.0), Duration::ZERO);
        assert_eq!(bad.validate(), Err(LeaseConfigError::Zero("retry_period")));
        let bad = cfg().with_timings(Duration::from_secs(u64::MAX / 2), secs(10.0), secs(2.0));
        assert!(matches!(
            bad.validate(),
            Err(LeaseConfigError::LeaseDurationTooLong(_))
        ));
        let mut bad = cfg();
        bad.identity.clear();
        assert_eq!(bad.validate(), Err(LeaseConfigError::Empty("identity")));
        let mut bad = cfg();
        bad.namespace.clear();
        assert_eq!(bad.validate(), Err(LeaseConfigError::Empty("namespace")));
        // Sub-second timings are fine.
        let ok = cfg().with_timings(secs(1.5), secs(1.0), secs(0.2));
        assert_eq!(ok.validate(), Ok(()));
    }

    #[tokio::test]
    async fn spawn_rejects_invalid_config_with_typed_error() {
        let client = kube::Client::try_from(kube::Config::new(
            "http://127.0.0.1:9".parse().expect("uri"),
        ))
        .expect("client");
        let bad = cfg().with_timings(secs(5.0), secs(6.0), secs(1.0));
        let e = LeaderElector::spawn(client, bad).err().expect("rejected");
        assert!(matches!(
            e,
            LeaseConfigError::RenewDeadlineNotBelowLeaseDuration { .. }
        ));
        assert!(e.to_string().contains("renew_deadline"), "{e}");
    }

    #[test]
    fn lease_seconds_round_up() {
        assert_eq!(lease_duration_seconds(secs(15.0)), 15);
        assert_eq!(lease_duration_seconds(secs(1.5)), 2);
        assert_eq!(lease_duration_seconds(Duration::from_millis(1)), 1);
    }

    #[test]
    fn expiry_is_judged_from_local_observation() {
        let t0 = Instant::now();
        let d = secs(2.0);
        assert!(!expired(t0, d, t0));
        assert!(!expired(t0, d, t0 + secs(1.999)));
        assert!(expired(t0, d, t0 + d));
        assert!(expired(t0, d, t0 + secs(10.0)));
    }

    fn record(holder: Option<&str>, duration: Option<i32>) -> Record {
        Record {
            holder: holder.map(str::to_owned),
            renew_time: None,
            acquire_time: None,
            transitions: Some(3),
            duration_seconds: duration,
        }
    }

    #[test]
    fn decide_follows_live_holder_and_takes_expired_or_released() {
        let t0 = Instant::now();
        let fallback = secs(15.0);
        let live = Observed {
            record: record(Some("other"), Some(2)),
            at: t0,
        };
        assert_eq!(
            decide("me", &live, fallback, t0 + secs(1.9)),
            Decision::Follow {
                holder: "other".into()
            }
        );
        // Uses the record's duration (2 s), not the fallback (15 s).
        assert_eq!(
            decide("me", &live, fallback, t0 + secs(2.0)),
            Decision::TakeOver
        );
        // No duration on record: the fallback applies.
        let no_dur = Observed {
            record: record(Some("other"), None),
            at: t0,
        };
        assert!(matches!(
            decide("me", &no_dur, fallback, t0 + secs(14.0)),
            Decision::Follow { .. }
        ));
        assert_eq!(
            decide("me", &no_dur, fallback, t0 + secs(15.0)),
            Decision::TakeOver
        );
        // Released: take over at once.
        let released = Observed {
            record: record(None, Some(2)),
            at: t0,
        };
        assert_eq!(decide("me", &released, fallback, t0), Decision::TakeOver);
        // Ours: renew, however old.
        let ours = Observed {
            record: record(Some("me"), Some(2)),
            at: t0,
        };
        assert_eq!(
            decide("me", &ours, fallback, t0 + secs(100.0)),
            Decision::Renew
        );
    }

    #[test]
    fn empty_holder_counts_as_released() {
        let lease = Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(String::new()),
                ..Default::default()
            }),
        };
        assert_eq!(Record::of(&lease).holder, None);
        let no_spec = Lease {
            metadata: ObjectMeta::default(),
            spec: None,
        };
        assert_eq!(Record::of(&no_spec).holder, None);
    }

    #[test]
    fn a_changed_record_restarts_the_observation_clock() {
        let t0 = Instant::now();
        let d = secs(2.0);
        let mut last = None;
        let rec = record(Some("other"), Some(2));
        let (o, new_holder) = observe_record(&mut last, rec.clone(), t0);
        assert_eq!(o.at, t0);
        assert_eq!(new_holder.as_deref(), Some("other"));
        // Same record later: the clock keeps running from the first sight.
        let (o, new_holder) = observe_record(&mut last, rec.clone(), t0 + secs(1.5));
        assert_eq!(o.at, t0);
        assert_eq!(new_holder, None);
        assert!(expired(o.at, d, t0 + secs(2.5)));
        // A renewal (new renewTime) restarts it, same holder: no new leader.
        let mut renewed = rec;
        renewed.renew_time = Some(now_micro());
        let (o, new_holder) = observe_record(&mut last, renewed.clone(), t0 + secs(1.5));
        assert_eq!(o.at, t0 + secs(1.5));
        assert_eq!(new_holder, None);
        assert!(!expired(o.at, d, t0 + secs(2.5)));
        // A different holder is reported.
        let mut taken = renewed;
        taken.holder = Some("third".into());
        let (_, new_holder) = observe_record(&mut last, taken, t0 + secs(2.0));
        assert_eq!(new_holder.as_deref(), Some("third"));
        // Released: not a new leader.
        let (_, new_holder) = observe_record(&mut last, record(None, Some(2)), t0 + secs(3.0));
        assert_eq!(new_holder, None);
    }

    fn stored_lease(holder: &str, transitions: i32) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("lease".into()),
                namespace: Some("ns".into()),
                resource_version: Some("42".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                acquire_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
                renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)),
                lease_duration_seconds: Some(15),
                lease_transitions: Some(transitions),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn claim_renews_or_takes_over_guarded_by_the_read_version() {
        let c = cfg().with_timings(secs(1.5), secs(1.0), secs(0.2));
        let epoch = Some(MicroTime(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));

        let (renewed, term) = claim(stored_lease("me", 4), false, &c);
        let spec = renewed.spec.as_ref().expect("spec");
        assert_eq!(term, 4);
        assert_eq!(renewed.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.lease_transitions, Some(4));
        assert_eq!(spec.acquire_time, epoch, "a renewal keeps acquireTime");
        assert!(spec.renew_time > epoch);
        assert_eq!(spec.lease_duration_seconds, Some(2));

        let (taken, term) = claim(stored_lease("other", 4), true, &c);
        let spec = taken.spec.as_ref().expect("spec");
        assert_eq!(term, 5);
        assert_eq!(taken.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.lease_transitions, Some(5));
        assert!(spec.acquire_time > epoch);
        assert!(spec.renew_time > epoch);
    }

    #[test]
    fn release_clears_only_our_own_holder() {
        assert!(released(stored_lease("other", 1), "me").is_none());
        let r = released(stored_lease("me", 1), "me").expect("ours");
        assert_eq!(r.metadata.resource_version.as_deref(), Some("42"));
        let spec = r.spec.expect("spec");
        assert_eq!(spec.holder_identity, None);
        assert_eq!(spec.lease_transitions, Some(1));
    }

    #[test]
    fn leader_state_helpers() {
        let f = LeaderState::Follower {
            holder: Some("x".into()),
        };
        assert!(!f.is_leader());
        assert_eq!(f.holder("me"), Some("x"));
        let l = LeaderState::Leader {
            since: SystemTime::now(),
            term: 1,
        };
        assert!(l.is_leader());
        assert_eq!(l.holder("me"), Some("me"));
    }
}
