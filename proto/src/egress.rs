//! The OpenSandbox egress policy (`networkPolicy`): its JSON shape, its
//! checks, how a name or an address is judged, and the sidecar's PATCH and
//! DELETE merge rules. One model for every component: the lifecycle parses
//! and merges it, the controller stores it in the record, the agent enforces
//! it (DNS answers and nftables sets).
//!
//! Semantics kept from OpenSandbox's egress sidecar:
//! - rules are evaluated in order; the first rule whose target matches wins;
//! - `defaultAction` applies when no rule matches; omitted, it is `deny`,
//!   except that a policy with no rules at all (`{}`) allows everything;
//! - PATCH: an incoming rule replaces the existing rule with the same target
//!   in place, new targets are appended, the first rule per target in the
//!   payload wins, the action that applied when no rule matched is kept;
//! - DELETE: rules with the given targets are removed (idempotent), the
//!   action that applied when no rule matched is kept.
//!
//! "Kept" means the effective default is written out: adding a deny rule to
//! an allow-all sandbox must not cut it off (an omitted `defaultAction` with
//! rules means deny), and deleting the last allow rule of a deny-by-default
//! sandbox must not open it.
//!
//! Targets: an FQDN (`example.com`, matched case-insensitively, with or
//! without a trailing dot), a wildcard (`*.example.com`: every name below
//! `example.com`, not `example.com` itself), or — a sandbolt extension — an
//! IPv4 address or CIDR (`203.0.113.7`, `203.0.113.0/24`).

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// Destinations sandbox isolation blocks on every runtime unless a pool
/// allows them: "this" network, private, shared (CGNAT), loopback,
/// link-local (cloud metadata), multicast and reserved ranges.
pub const ISOLATED_RANGES: [&str; 8] = [
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "224.0.0.0/3",
];

/// Most rules one policy may carry: every rule is walked for every DNS
/// question, and nftables holds one set element per resolved address.
pub const MAX_RULES: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Allow,
    Deny,
}

impl Action {
    fn parse(s: &str, field: &str) -> Result<Self, PolicyError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "allow" => Ok(Self::Allow),
            "deny" => Ok(Self::Deny),
            _ => Err(PolicyError(format!(
                "{field} must be \"allow\" or \"deny\", not {s:?}"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allow => "allow",
            Self::Deny => "deny",
        }
    }
}

/// A bad policy; the message names the field (`networkPolicy.egress[2].target`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PolicyError(pub String);

/// One rule as it travels (JSON `{action, target}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkRule {
    pub action: Action,
    pub target: String,
}

/// The policy as it travels (JSON `{defaultAction, egress}`), checked and
/// normalized by [`NetworkPolicy::parse`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkPolicy {
    #[serde(
        rename = "defaultAction",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub default_action: Option<Action>,
    #[serde(default)]
    pub egress: Vec<NetworkRule>,
}

/// What a rule's target matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<'a> {
    /// A full name, lowercase, without the trailing dot.
    Name(&'a str),
    /// `*.suffix`: names strictly below `suffix` (lowercase, no dot).
    Below(&'a str),
    /// An IPv4 network (a single address is a /32).
    Net(Ipv4Addr, u8),
}

/// Raw JSON shape, so that `defaultAction` and `action` accept any case and
/// their errors name the field.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(rename = "defaultAction", default)]
    default_action: Option<String>,
    #[serde(default)]
    egress: Option<Vec<RawRule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    action: String,
    target: String,
}

impl NetworkPolicy {
    /// Parses and checks policy JSON; `""` and `null` are the allow-all
    /// policy. Errors name the field under `networkPolicy`.
    pub fn parse(json: &str) -> Result<Self, PolicyError> {
        let json = json.trim();
        if json.is_empty() || json == "null" {
            return Ok(Self::default());
        }
        let raw: RawPolicy =
            serde_json::from_str(json).map_err(|e| PolicyError(format!("networkPolicy: {e}")))?;
        let default_action = raw
            .default_action
            .map(|a| Action::parse(&a, "networkPolicy.defaultAction"))
            .transpose()?;
        let rules = raw.egress.unwrap_or_default();
        let egress = rules
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let field = format!("networkPolicy.egress[{i}]");
                Ok(NetworkRule {
                    action: Action::parse(&r.action, &format!("{field}.action"))?,
                    target: normalize_target(&r.target, &format!("{field}.target"))?,
                })
            })
            .collect::<Result<Vec<_>, PolicyError>>()?;
        let policy = Self {
            default_action,
            egress,
        };
        policy.check_size()?;
        Ok(policy)
    }

    /// Checks rules built in code (PATCH payloads go through [`Self::patch`]).
    pub fn from_parts(
        default_action: Option<Action>,
        rules: Vec<NetworkRule>,
    ) -> Result<Self, PolicyError> {
        let egress = rules
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                Ok(NetworkRule {
                    action: r.action,
                    target: normalize_target(
                        &r.target,
                        &format!("networkPolicy.egress[{i}].target"),
                    )?,
                })
            })
            .collect::<Result<Vec<_>, PolicyError>>()?;
        let policy = Self {
            default_action,
            egress,
        };
        policy.check_size()?;
        Ok(policy)
    }

    fn check_size(&self) -> Result<(), PolicyError> {
        if self.egress.len() > MAX_RULES {
            return Err(PolicyError(format!(
                "networkPolicy.egress has {} rules; at most {MAX_RULES} are allowed",
                self.egress.len()
            )));
        }
        Ok(())
    }

    /// The JSON the record and the agent keep (`""` for allow-all).
    pub fn to_json(&self) -> String {
        if self.is_allow_all() {
            return String::new();
        }
        serde_json::to_string(self).expect("a policy always serializes")
    }

    /// No rules and nothing denied by default (`{}`, or only
    /// `defaultAction: allow`): everything is allowed.
    pub fn is_allow_all(&self) -> bool {
        self.egress.is_empty() && self.effective_default() == Action::Allow
    }

    /// What applies when no rule matches (see the module docs).
    pub fn effective_default(&self) -> Action {
        match self.default_action {
            Some(a) => a,
            None if self.egress.is_empty() => Action::Allow,
            None => Action::Deny,
        }
    }

    /// The verdict for a DNS name: the first matching name or wildcard rule,
    /// else the default. Address rules never match names.
    pub fn verdict_for_name(&self, name: &str) -> Action {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        self.egress
            .iter()
            .find(|r| match target(&r.target) {
                Target::Name(n) => n == name,
                Target::Below(suffix) => name
                    .strip_suffix(suffix)
                    .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
                Target::Net(..) => false,
            })
            .map_or_else(|| self.effective_default(), |r| r.action)
    }

    /// The address rules, in order, with their actions.
    pub fn address_rules(&self) -> impl Iterator<Item = (Action, Ipv4Addr, u8)> + '_ {
        self.egress.iter().filter_map(|r| match target(&r.target) {
            Target::Net(addr, prefix) => Some((r.action, addr, prefix)),
            _ => None,
        })
    }

    /// Exact names with a `deny` rule: under `defaultAction: allow` the node
    /// resolves these itself so that connecting to their addresses directly
    /// is refused too.
    pub fn denied_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.egress.iter().filter_map(|r| match target(&r.target) {
            Target::Name(n) if r.action == Action::Deny => Some(n),
            _ => None,
        })
    }

    /// The sidecar's PATCH (see the module docs).
    pub fn patch(&self, incoming: Vec<NetworkRule>) -> Result<Self, PolicyError> {
        let incoming = Self::from_parts(None, incoming)?.egress;
        let mut egress = self.egress.clone();
        let mut seen = std::collections::HashSet::new();
        for rule in incoming {
            if !seen.insert(rule.target.clone()) {
                continue; // the first rule per target in the payload wins
            }
            match egress.iter_mut().find(|r| r.target == rule.target) {
                Some(existing) => *existing = rule,
                None => egress.push(rule),
            }
        }
        let patched = Self {
            default_action: Some(self.effective_default()),
            egress,
        };
        patched.check_size()?;
        Ok(patched)
    }

    /// The sidecar's DELETE by target (see the module docs).
    pub fn delete(&self, targets: &[String]) -> Self {
        let gone: Vec<String> = targets
            .iter()
            .filter_map(|t| normalize_target(t, "target").ok())
            .collect();
        Self {
            default_action: Some(self.effective_default()),
            egress: self
                .egress
                .iter()
                .filter(|r| !gone.contains(&r.target))
                .cloned()
                .collect(),
        }
    }

    /// The sidecar's `mode` word for this policy, as GET reports it.
    pub fn mode(&self) -> &'static str {
        match (self.effective_default(), self.egress.is_empty()) {
            (Action::Allow, true) => "allow_all",
            (Action::Deny, true) => "deny_all",
            _ => "rules",
        }
    }
}

/// Classifies a normalized target (see [`normalize_target`]).
pub fn target(normalized: &str) -> Target<'_> {
    if let Some(suffix) = normalized.strip_prefix("*.") {
        return Target::Below(suffix);
    }
    if let Some(net) = parse_net(normalized) {
        return Target::Net(net.0, net.1);
    }
    Target::Name(normalized)
}

fn parse_net(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (addr, prefix) = match s.split_once('/') {
        Some((a, p)) => (a, p.parse::<u8>().ok().filter(|p| *p <= 32)?),
        None => (s, 32),
    };
    let addr: Ipv4Addr = addr.parse().ok()?;
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    Some((Ipv4Addr::from(u32::from(addr) & mask), prefix))
}

/// Lowercases a target, drops a trailing dot, checks it is a DNS name, a
/// `*.` wildcard of one, or an IPv4 address or CIDR; `field` names it in
/// the error. CIDRs come back in canonical form (`10.1.2.3/8` → `10.0.0.0/8`).
pub fn normalize_target(raw: &str, field: &str) -> Result<String, PolicyError> {
    let t = raw.trim().trim_end_matches('.').to_ascii_lowercase();
    if t.is_empty() {
        return Err(PolicyError(format!("{field} must not be empty")));
    }
    if t.contains(':') {
        return Err(PolicyError(format!(
            "{field} {raw:?}: IPv6 targets are not supported (sandboxes have IPv4 egress only)"
        )));
    }
    if t.bytes().next().is_some_and(|b| b.is_ascii_digit()) && t.contains('/') {
        return parse_net(&t)
            .map(|(a, p)| format!("{a}/{p}"))
            .ok_or_else(|| PolicyError(format!("{field} {raw:?} is not an IPv4 CIDR")));
    }
    if t.parse::<Ipv4Addr>().is_ok() {
        return Ok(t);
    }
    let name = t.strip_prefix("*.").unwrap_or(&t);
    if !is_dns_name(name) {
        return Err(PolicyError(format!(
            "{field} {raw:?} must be a DNS name (example.com), a wildcard (*.example.com), \
             or an IPv4 address or CIDR"
        )));
    }
    Ok(t)
}

fn is_dns_name(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
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
    fn empty_and_null_allow_everything() {
        for json in [
            "",
            "null",
            "{}",
            r#"{"egress": []}"#,
            r#"{"defaultAction": "allow"}"#,
        ] {
            let p = NetworkPolicy::parse(json).unwrap();
            assert!(p.is_allow_all(), "{json}");
            assert_eq!(p.verdict_for_name("anything.test"), Action::Allow);
            assert_eq!(p.to_json(), "");
            assert_eq!(p.mode(), "allow_all");
        }
    }

    #[test]
    fn omitted_default_is_deny_once_there_are_rules() {
        let p =
            NetworkPolicy::parse(r#"{"egress":[{"action":"allow","target":"a.test"}]}"#).unwrap();
        assert_eq!(p.effective_default(), Action::Deny);
        assert_eq!(p.verdict_for_name("a.test"), Action::Allow);
        assert_eq!(p.verdict_for_name("b.test"), Action::Deny);
        let deny_all = NetworkPolicy::parse(r#"{"defaultAction":"DENY"}"#).unwrap();
        assert_eq!(deny_all.mode(), "deny_all");
        assert_eq!(deny_all.verdict_for_name("a.test"), Action::Deny);
    }

    #[test]
    fn first_matching_rule_wins_and_wildcards_match_below_only() {
        let p = NetworkPolicy::parse(
            r#"{"defaultAction":"allow","egress":[
                {"action":"allow","target":"API.Example.com."},
                {"action":"deny","target":"*.example.com"},
                {"action":"deny","target":"bad.test"}]}"#,
        )
        .unwrap();
        assert_eq!(p.verdict_for_name("api.example.com"), Action::Allow);
        assert_eq!(p.verdict_for_name("x.api.example.com."), Action::Deny);
        assert_eq!(p.verdict_for_name("example.com"), Action::Allow);
        assert_eq!(p.verdict_for_name("notexample.com"), Action::Allow);
        assert_eq!(p.verdict_for_name("BAD.test"), Action::Deny);
        assert_eq!(p.denied_names().collect::<Vec<_>>(), ["bad.test"]);
    }

    #[test]
    fn addresses_and_cidrs_are_targets_too() {
        let p = NetworkPolicy::parse(
            r#"{"egress":[{"action":"allow","target":"203.0.113.7"},
                          {"action":"deny","target":"198.51.100.9/24"}]}"#,
        )
        .unwrap();
        assert_eq!(p.egress[1].target, "198.51.100.0/24");
        let rules: Vec<_> = p.address_rules().collect();
        assert_eq!(
            rules,
            [
                (Action::Allow, Ipv4Addr::new(203, 0, 113, 7), 32),
                (Action::Deny, Ipv4Addr::new(198, 51, 100, 0), 24)
            ]
        );
        assert_eq!(p.verdict_for_name("203.0.113.7"), Action::Deny);
    }

    #[test]
    fn bad_input_names_the_field() {
        let cases = [
            (
                r#"{"defaultAction":"maybe"}"#,
                "networkPolicy.defaultAction",
            ),
            (
                r#"{"egress":[{"action":"allow","target":"ok.test"},{"action":"drop","target":"x.test"}]}"#,
                "networkPolicy.egress[1].action",
            ),
            (
                r#"{"egress":[{"action":"allow","target":"exa mple.com"}]}"#,
                "networkPolicy.egress[0].target",
            ),
            (r#"{"egress":[{"action":"allow","target":"::1"}]}"#, "IPv6"),
            (
                r#"{"egress":[{"action":"allow","target":"10.0.0.0/33"}]}"#,
                "CIDR",
            ),
            (r#"{"egres":[]}"#, "unknown field"),
            (r#"[1]"#, "networkPolicy"),
        ];
        for (json, want) in cases {
            let err = NetworkPolicy::parse(json).unwrap_err().to_string();
            assert!(err.contains(want), "{json}: {err}");
        }
        let many = (0..=MAX_RULES)
            .map(|i| format!(r#"{{"action":"allow","target":"h{i}.test"}}"#))
            .collect::<Vec<_>>()
            .join(",");
        let err = NetworkPolicy::parse(&format!(r#"{{"egress":[{many}]}}"#)).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
    }

    #[test]
    fn patch_replaces_in_place_appends_new_and_keeps_the_default() {
        let p = NetworkPolicy::from_parts(
            Some(Action::Deny),
            vec![rule(Action::Allow, "a.test"), rule(Action::Allow, "b.test")],
        )
        .unwrap();
        let patched = p
            .patch(vec![
                rule(Action::Deny, "A.test"),
                rule(Action::Allow, "c.test"),
                rule(Action::Allow, "a.test"),
            ])
            .unwrap();
        assert_eq!(patched.default_action, Some(Action::Deny));
        assert_eq!(
            patched.egress,
            [
                rule(Action::Deny, "a.test"),
                rule(Action::Allow, "b.test"),
                rule(Action::Allow, "c.test")
            ]
        );
        assert!(p.patch(vec![rule(Action::Allow, "bad name")]).is_err());
    }

    #[test]
    fn patch_and_delete_keep_the_effective_default() {
        let open = NetworkPolicy::default();
        let patched = open.patch(vec![rule(Action::Deny, "bad.test")]).unwrap();
        assert_eq!(patched.effective_default(), Action::Allow);
        assert_eq!(patched.verdict_for_name("good.test"), Action::Allow);
        assert_eq!(patched.verdict_for_name("bad.test"), Action::Deny);
        let closed =
            NetworkPolicy::parse(r#"{"egress":[{"action":"allow","target":"a.test"}]}"#).unwrap();
        let emptied = closed.delete(&["a.test".into()]);
        assert_eq!(emptied.effective_default(), Action::Deny);
        assert_eq!(emptied.mode(), "deny_all");
    }

    #[test]
    fn delete_removes_by_target_idempotently() {
        let p = NetworkPolicy::from_parts(
            Some(Action::Allow),
            vec![rule(Action::Deny, "a.test"), rule(Action::Deny, "b.test")],
        )
        .unwrap();
        let d = p.delete(&["A.TEST".into(), "missing.test".into()]);
        assert_eq!(d.egress, [rule(Action::Deny, "b.test")]);
        assert_eq!(d.default_action, Some(Action::Allow));
        assert_eq!(d.delete(&["a.test".into()]), d);
    }

    #[test]
    fn json_round_trips_in_the_opensandbox_shape() {
        let p = NetworkPolicy::parse(
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"*.pypi.org"}]}"#,
        )
        .unwrap();
        let json = p.to_json();
        assert_eq!(
            json,
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"*.pypi.org"}]}"#
        );
        assert_eq!(NetworkPolicy::parse(&json).unwrap(), p);
    }
}
