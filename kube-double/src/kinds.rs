//! The resource kinds the double serves, and the per-kind rules in which the
//! API server's built-in registries differ from custom resources.

use serde_json::{Value, json};

/// One registered resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kind {
    pub group: String,
    pub version: String,
    pub kind: String,
    pub plural: String,
    pub namespaced: bool,
    pub status_subresource: bool,
    /// Served from a CustomResourceDefinition. The API server treats those
    /// differently: a PUT must carry `metadata.resourceVersion`, strategic
    /// merge patch is rejected with 415.
    pub custom: bool,
    /// Whether an immediate DELETE answers with the deleted object (the
    /// registry's `ReturnDeletedObject`, set for pods) or with a `Status` of
    /// `Success` (leases, custom resources).
    pub returns_deleted_object: bool,
    /// Field labels usable in `fieldSelector` besides metadata.name/namespace.
    pub extra_fields: &'static [&'static str],
}

impl Kind {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `pods` or `leases.coordination.k8s.io`, as error messages name it.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `details` of a Status about one object: the server names the
    /// resource (plural) in `kind`, not the Kind.
    pub fn details(&self, name: &str) -> Value {
        json!({"name": name, "group": self.group, "kind": self.plural})
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }
}

const POD_FIELDS: &[&str] = &[
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
];

/// The kinds every double starts with.
pub(crate) fn builtin() -> Vec<Kind> {
    let mut kinds = vec![
        Kind {
            group: "".into(),
            version: "v1".into(),
            kind: "Pod".into(),
            plural: "pods".into(),
            namespaced: true,
            status_subresource: true,
            custom: false,
            returns_deleted_object: true,
            extra_fields: POD_FIELDS,
        },
        Kind {
            group: "coordination.k8s.io".into(),
            version: "v1".into(),
            kind: "Lease".into(),
            plural: "leases".into(),
            namespaced: true,
            status_subresource: false,
            custom: false,
            returns_deleted_object: false,
            extra_fields: &[],
        },
    ];
    // sandbolt's own CRDs, served before any CRD file is registered.
    let custom = [
        CustomKind::new("sandbox.fast.io", "v1alpha2", "Sandbox", "sandboxes").with_status(),
        CustomKind::new("sandbolt.io", "v1alpha1", "SandboxPool", "sandboxpools").with_status(),
        CustomKind::new(
            "sandbolt.io",
            "v1alpha1",
            "SandboxWarmPool",
            "sandboxwarmpools",
        )
        .with_status(),
        CustomKind::new(
            "sandbolt.io",
            "v1alpha1",
            "SandboxSnapshot",
            "sandboxsnapshots",
        ),
    ];
    kinds.extend(
        custom
            .iter()
            .map(|c| Kind::from_custom(c).expect("built-in kinds are well-formed")),
    );
    kinds
}

/// A custom resource kind to serve, as a CustomResourceDefinition names it:
/// namespaced, one served version, with or without the status subresource.
/// It gets the rules of custom resources (a PUT must carry a
/// resourceVersion, strategic merge patch is 415, DELETE answers with a
/// `Status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomKind {
    /// e.g. `sandbox.opensandbox.io`.
    pub group: String,
    /// e.g. `v1alpha1`.
    pub version: String,
    /// e.g. `BatchSandbox`.
    pub kind: String,
    /// e.g. `batchsandboxes`: the URL segment.
    pub plural: String,
    /// `/status` is a subresource: the main resource ignores status
    /// changes and `/status` ignores everything else.
    pub status_subresource: bool,
}

impl CustomKind {
    /// A namespaced kind without the status subresource.
    pub fn new(group: &str, version: &str, kind: &str, plural: &str) -> CustomKind {
        CustomKind {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            plural: plural.into(),
            status_subresource: false,
        }
    }

    /// The same kind with the status subresource.
    pub fn with_status(mut self) -> CustomKind {
        self.status_subresource = true;
        self
    }
}

/// Why a kind cannot be registered.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    #[error("{what} {value:?} of kind {kind:?} is not a lowercase DNS label")]
    NotDnsLabel {
        kind: String,
        what: &'static str,
        value: String,
    },
    #[error("group {group:?} of kind {kind:?} is not a DNS subdomain with at least one dot")]
    BadGroup { kind: String, group: String },
    #[error("kind {kind:?} must start with an upper-case letter and be alphanumeric")]
    BadKindName { kind: String },
    #[error(
        "group {group:?} is served by the double's built-in kinds; a custom kind cannot join it"
    )]
    BuiltinGroup { group: String },
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl Kind {
    /// The served form of `custom`, checked as the API server checks a
    /// CustomResourceDefinition's names.
    pub fn from_custom(custom: &CustomKind) -> Result<Kind, KindError> {
        let CustomKind {
            group,
            version,
            kind,
            plural,
            status_subresource,
        } = custom;
        if !group.contains('.') || !group.split('.').all(is_dns_label) {
            return Err(KindError::BadGroup {
                kind: kind.clone(),
                group: group.clone(),
            });
        }
        for (what, value) in [("version", version), ("plural", plural)] {
            if !is_dns_label(value) {
                return Err(KindError::NotDnsLabel {
                    kind: kind.clone(),
                    what,
                    value: value.clone(),
                });
            }
        }
        let kind_ok = kind.starts_with(|c: char| c.is_ascii_uppercase())
            && kind.chars().all(|c| c.is_ascii_alphanumeric());
        if !kind_ok {
            return Err(KindError::BadKindName { kind: kind.clone() });
        }
        Ok(Kind {
            group: group.clone(),
            version: version.clone(),
            kind: kind.clone(),
            plural: plural.clone(),
            namespaced: true,
            status_subresource: *status_subresource,
            custom: true,
            returns_deleted_object: false,
            extra_fields: &[],
        })
    }
}
