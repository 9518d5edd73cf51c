//! Egress policy over REST: the `networkpolicy` routes of the Lifecycle
//! API, and the egress sidecar's `/policy` API (what the SDK's
//! `get_egress_policy`, `patch_egress_rules` and `delete_egress_rules`
//! call) served by the lifecycle itself.
//!
//! The SDK finds the sidecar through `GET /sandboxes/{id}/endpoints/18080`.
//! sandbolt runs no sidecar inside the sandbox: the policy lives in the
//! engine's record and is enforced on the node. So that endpoint points back
//! at this server (`{host}{mount}/sandboxes/{id}/egress`), and carries a
//! header with a token good for that one sandbox's policy only. In direct
//! mode the SDK never sends the API key to an endpoint (it would travel
//! into the sandbox for every other port), so the token is what lets those
//! calls in; see [`egress_token`] for how it is made.
//!
//! The policy model (parsing, PATCH merge, DELETE by target) is the shared
//! one, `sandbolt_proto::egress`; this module only adds the REST shapes.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sandbolt_proto::egress::{Action, NetworkPolicy, NetworkRule, normalize_target};
use serde_json::{Value, json};
use sha2::Sha256;

use crate::api::{App, JsonBody};
use crate::backend::Backend;
use crate::error::{ApiError, ApiResult};

/// The egress sidecar's port in OpenSandbox (the SDK's `DEFAULT_EGRESS_PORT`).
pub const EGRESS_PORT: u16 = 18080;

/// The header carrying the per-sandbox token of the egress endpoint.
pub const EGRESS_TOKEN_HEADER: &str = "X-Sandbolt-Egress-Token";

/// `enforcementMode` of a policy the node enforces: DNS answers filtered by
/// the node's DNS proxy (the agent's, or on Docker the lifecycle's),
/// addresses filtered by nftables.
pub const ENFORCEMENT_DNS_NFT: &str = "dns+nft";

/// `enforcementMode` of a runtime that enforces no egress policy.
pub const ENFORCEMENT_NONE: &str = "none";

/// What GET answers and every mutation answers after committing.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyStatus {
    pub policy: NetworkPolicy,
    pub enforcement_mode: &'static str,
}

impl PolicyStatus {
    /// The sidecar's `PolicyStatusResponse`. `defaultAction` is always
    /// written out as the action in force: the SDK reads an omitted one as
    /// `deny`, which would misreport an allow-all policy.
    pub fn body(&self) -> Value {
        json!({
            "status": "ok",
            "mode": self.policy.mode(),
            "enforcementMode": self.enforcement_mode,
            "policy": {
                "defaultAction": self.policy.effective_default().as_str(),
                "egress": self.policy.egress,
            },
        })
    }
}

/// One change of a sandbox's policy, as the routes ask for it.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyChange {
    /// PUT: the whole policy.
    Replace(NetworkPolicy),
    /// PATCH: rules merged by target (checked and normalized).
    Patch(Vec<NetworkRule>),
    /// DELETE: rules removed by target (normalized).
    Delete(Vec<String>),
}

impl PolicyChange {
    /// The policy after this change. PATCH and DELETE keep the action in
    /// force when no rule matches, written out: the model reads a missing
    /// `defaultAction` as "deny once there are rules, allow without", so
    /// adding a deny rule to an allow-all sandbox would otherwise cut it off,
    /// and deleting the last allow rule would open a deny-by-default one.
    pub fn apply(&self, current: &NetworkPolicy) -> ApiResult<NetworkPolicy> {
        let kept = NetworkPolicy {
            default_action: Some(current.effective_default()),
            egress: current.egress.clone(),
        };
        let next = match self {
            Self::Replace(p) => p.clone(),
            Self::Patch(rules) => kept.patch(rules.clone()).map_err(policy_error)?,
            Self::Delete(targets) => kept.delete(targets),
        };
        Ok(normalized(next))
    }
}

/// The allow-all policy in its one spelling (`{}`, stored as `""`), so that
/// "no rules, default allow" is not a second way to say it.
pub fn normalized(p: NetworkPolicy) -> NetworkPolicy {
    if p.egress.is_empty() && p.effective_default() == Action::Allow {
        NetworkPolicy::default()
    } else {
        p
    }
}

fn policy_error(e: sandbolt_proto::egress::PolicyError) -> ApiError {
    ApiError::invalid_code("INVALID_NETWORK_POLICY", e.to_string())
}

/// PUT body: a `NetworkPolicy` object.
pub fn parse_replace(body: &Value) -> ApiResult<PolicyChange> {
    if !body.is_object() {
        return Err(ApiError::invalid_code(
            "INVALID_NETWORK_POLICY",
            "body must be a NetworkPolicy object ({\"defaultAction\": ..., \"egress\": [...]})",
        ));
    }
    let policy = NetworkPolicy::parse(&body.to_string()).map_err(policy_error)?;
    Ok(PolicyChange::Replace(normalized(policy)))
}

/// PATCH body: a list of `NetworkRule`; errors name `rules[i]`.
pub fn parse_patch(body: &Value) -> ApiResult<PolicyChange> {
    if !body.is_array() {
        return Err(ApiError::invalid_code(
            "INVALID_NETWORK_POLICY",
            "body must be a list of rules ([{\"action\": \"allow\", \"target\": \"example.com\"}])",
        ));
    }
    // The model's parser checks each rule and names the field; the rules
    // arrive as a bare list, so its `networkPolicy.egress[i]` becomes `rules[i]`.
    let rules = NetworkPolicy::parse(&json!({ "egress": body }).to_string())
        .map_err(|e| {
            ApiError::invalid_code(
                "INVALID_NETWORK_POLICY",
                e.0.replace("networkPolicy.egress", "rules"),
            )
        })?
        .egress;
    Ok(PolicyChange::Patch(rules))
}

/// DELETE body: a list of target strings; errors name `targets[i]`.
pub fn parse_delete(body: &Value) -> ApiResult<PolicyChange> {
    let not_a_list = || {
        ApiError::invalid_code(
            "INVALID_NETWORK_POLICY",
            "body must be a list of targets ([\"example.com\", \"*.example.org\"])",
        )
    };
    let items = body.as_array().ok_or_else(not_a_list)?;
    let targets = items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let t = t.as_str().ok_or_else(not_a_list)?;
            normalize_target(t, &format!("targets[{i}]")).map_err(policy_error)
        })
        .collect::<ApiResult<Vec<_>>>()?;
    Ok(PolicyChange::Delete(targets))
}

/// The token that authenticates calls to the egress endpoint of sandbox
/// `id`: hex HMAC-SHA256 of the id under the lifecycle's API key.
///
/// Why this shape: it names one sandbox (a token for one cannot touch
/// another); it is not the API key and does not reveal it (HMAC is one-way);
/// the sandbox never sees it (unlike execd's access token, which the code
/// inside could read and use to lift its own policy); and every replica of
/// the lifecycle, restarted or not, derives the same token from the key it
/// already shares, so nothing is stored. Rotating the API key revokes every
/// egress token with it.
pub fn egress_token(api_key: &str, id: &str) -> String {
    let mac = hmac_sha256(
        api_key.as_bytes(),
        format!("sandbolt egress policy v1\n{id}").as_bytes(),
    );
    mac.iter().map(|b| format!("{b:02x}")).collect()
}

/// HMAC-SHA-256 (RFC 2104).
fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    use hmac::Mac;
    let mut mac =
        hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// The sandbox whose egress policy a request path addresses
/// (`[/v1]/sandboxes/{id}/egress/policy`), if it is one. Percent-encoded
/// ids are not recognized, so the id checked against the token is the id
/// the handler acts on.
pub fn egress_policy_target(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1").unwrap_or(path);
    let id = rest
        .strip_prefix("/sandboxes/")?
        .strip_suffix("/egress/policy")?;
    (!id.is_empty() && !id.contains('/') && !id.contains('%')).then_some(id)
}

/// Does `presented` authenticate a call on the egress policy of `id`?
pub fn token_matches(api_key: &str, id: &str, presented: &[u8]) -> bool {
    sandbolt_proto::auth::constant_time_eq(presented, egress_token(api_key, id).as_bytes())
}

fn answer(status: &PolicyStatus) -> Response {
    (StatusCode::OK, axum::Json(status.body())).into_response()
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
pub async fn get_policy<B: Backend>(
    State(app): State<Arc<App<B>>>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    Ok(answer(&app.backend.network_policy(&id).await?))
}

async fn change<B: Backend>(app: &App<B>, id: &str, change: PolicyChange) -> ApiResult<Response> {
    let status = app.backend.change_network_policy(id, change).await?;
    tracing::info!(sandbox_id = %id, mode = status.policy.mode(), rules = status.policy.egress.len(), "egress policy changed");
    Ok(answer(&status))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
pub async fn put_policy<B: Backend>(
    State(app): State<Arc<App<B>>>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Value>,
) -> ApiResult<Response> {
    change(&app, &id, parse_replace(&body)?).await
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
pub async fn patch_policy<B: Backend>(
    State(app): State<Arc<App<B>>>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Value>,
) -> ApiResult<Response> {
    change(&app, &id, parse_patch(&body)?).await
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
pub async fn delete_policy<B: Backend>(
    State(app): State<Arc<App<B>>>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Value>,
) -> ApiResult<Response> {
    change(&app, &id, parse_delete(&body)?).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(action: Action, target: &str) -> NetworkRule {
        NetworkRule {
            action,
            target: target.into(),
        }
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // RFC 4231 test cases 2 and 6 (a key longer than the block).
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let mac = hmac_sha256(
            &[0xaa; 131],
            b"Test Using Larger Than Block-Size Key - Hash Key First",
        );
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn tokens_name_one_sandbox_under_one_key() {
        let t = egress_token("key-1", "sbx-1");
        assert_eq!(t.len(), 64);
        assert!(!t.contains("key-1"));
        assert_eq!(t, egress_token("key-1", "sbx-1"));
        assert_ne!(t, egress_token("key-1", "sbx-2"));
        assert_ne!(t, egress_token("key-2", "sbx-1"));
        assert!(token_matches("key-1", "sbx-1", t.as_bytes()));
        assert!(!token_matches("key-1", "sbx-2", t.as_bytes()));
        assert!(!token_matches("key-1", "sbx-1", b""));
    }

    #[test]
    fn only_the_egress_policy_path_is_recognized() {
        assert_eq!(
            egress_policy_target("/sandboxes/a-1/egress/policy"),
            Some("a-1")
        );
        assert_eq!(
            egress_policy_target("/v1/sandboxes/a-1/egress/policy"),
            Some("a-1")
        );
        for other in [
            "/sandboxes/a-1/networkpolicy",
            "/sandboxes/a-1",
            "/sandboxes/a-1/egress/policy/x",
            "/sandboxes/a-1/egress/policyx",
            "/sandboxes//egress/policy",
            "/sandboxes/a/b/egress/policy",
            "/sandboxes/a%2Fb/egress/policy",
            "/v2/sandboxes/a-1/egress/policy",
            "/sandboxes/a-1/proxy/44772/egress/policy",
        ] {
            assert_eq!(egress_policy_target(other), None, "{other}");
        }
    }

    #[test]
    fn patch_and_delete_keep_the_action_in_force() {
        // Adding a deny rule to an allow-all sandbox denies that one name.
        let p = parse_patch(&json!([{"action": "deny", "target": "Bad.test"}]))
            .unwrap()
            .apply(&NetworkPolicy::default())
            .unwrap();
        assert_eq!(p.effective_default(), Action::Allow);
        assert_eq!(p.egress, [rule(Action::Deny, "bad.test")]);
        // Deleting the last allow rule of a deny-by-default policy (default
        // left out) leaves it denying everything, not allowing it.
        let only_allow =
            NetworkPolicy::parse(r#"{"egress":[{"action":"allow","target":"a.test"}]}"#).unwrap();
        let p = parse_delete(&json!(["A.test."]))
            .unwrap()
            .apply(&only_allow)
            .unwrap();
        assert_eq!(p.mode(), "deny_all");
        assert_eq!(p.effective_default(), Action::Deny);
        // PATCH replaces in place and appends, as the sidecar does.
        let two = NetworkPolicy::parse(
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"a.test"},{"action":"allow","target":"b.test"}]}"#,
        )
        .unwrap();
        let p = parse_patch(&json!([
            {"action": "deny", "target": "a.test"},
            {"action": "ALLOW", "target": "*.c.test"}
        ]))
        .unwrap()
        .apply(&two)
        .unwrap();
        assert_eq!(
            p.egress,
            [
                rule(Action::Deny, "a.test"),
                rule(Action::Allow, "b.test"),
                rule(Action::Allow, "*.c.test")
            ]
        );
        // Allow-all has one spelling, whichever way it is reached.
        for change in [
            parse_replace(&json!({"defaultAction": "allow"})).unwrap(),
            parse_replace(&json!({})).unwrap(),
            parse_delete(&json!(["a.test", "b.test"])).unwrap(),
        ] {
            let allow_all = NetworkPolicy::from_parts(
                Some(Action::Allow),
                vec![rule(Action::Deny, "a.test"), rule(Action::Deny, "b.test")],
            )
            .unwrap();
            let p = change.apply(&allow_all).unwrap();
            assert!(p.is_allow_all(), "{change:?}: {p:?}");
            assert_eq!(p.to_json(), "");
        }
    }

    #[test]
    fn bad_bodies_name_what_is_wrong() {
        for (body, want) in [
            (json!([]), "NetworkPolicy object"),
            (
                json!({"defaultAction": "maybe"}),
                "networkPolicy.defaultAction",
            ),
            (
                json!({"egress": [{"action": "allow", "target": "bad name"}]}),
                "networkPolicy.egress[0].target",
            ),
            (json!({"egres": []}), "unknown field"),
        ] {
            let e = parse_replace(&body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
        for (body, want) in [
            (
                json!({"action": "allow", "target": "a.test"}),
                "list of rules",
            ),
            (
                json!([{"action": "allow", "target": "a.test"}, {"action": "drop", "target": "b.test"}]),
                "rules[1].action",
            ),
            (
                json!([{"action": "allow", "target": "::1"}]),
                "rules[0].target",
            ),
            (json!([{"action": "allow"}]), "target"),
        ] {
            let e = parse_patch(&body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
        for (body, want) in [
            (json!("a.test"), "list of targets"),
            (json!([1]), "list of targets"),
            (json!(["ok.test", "bad name"]), "targets[1]"),
            (json!([""]), "targets[0]"),
        ] {
            let e = parse_delete(&body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
    }

    #[test]
    fn status_body_has_the_sidecar_shape() {
        let allow_all = PolicyStatus {
            policy: NetworkPolicy::default(),
            enforcement_mode: ENFORCEMENT_NONE,
        };
        assert_eq!(
            allow_all.body(),
            json!({"status": "ok", "mode": "allow_all", "enforcementMode": "none",
                   "policy": {"defaultAction": "allow", "egress": []}})
        );
        let rules = PolicyStatus {
            policy: NetworkPolicy::parse(
                r#"{"egress":[{"action":"allow","target":"*.pypi.org"}]}"#,
            )
            .unwrap(),
            enforcement_mode: ENFORCEMENT_DNS_NFT,
        };
        assert_eq!(
            rules.body(),
            json!({"status": "ok", "mode": "rules", "enforcementMode": "dns+nft",
                   "policy": {"defaultAction": "deny",
                              "egress": [{"action": "allow", "target": "*.pypi.org"}]}})
        );
    }
}

#[cfg(test)]
mod route_tests;
