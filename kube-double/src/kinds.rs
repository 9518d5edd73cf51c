//! The resource kinds the double serves, and the per-kind rules in which the
//! API server's built-in registries differ from custom resources.

use serde_json::{Value, json};

/// One registered resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kind {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
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
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `pods` or `leases.coordination.k8s.io`, as error messages name it.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
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
    vec![
        Kind {
            group: "",
            version: "v1",
            kind: "Pod",
            plural: "pods",
            namespaced: true,
            status_subresource: true,
            custom: false,
            returns_deleted_object: true,
            extra_fields: POD_FIELDS,
        },
        Kind {
            group: "coordination.k8s.io",
            version: "v1",
            kind: "Lease",
            plural: "leases",
            namespaced: true,
            status_subresource: false,
            custom: false,
            returns_deleted_object: false,
            extra_fields: &[],
        },
        Kind {
            group: "sandbox.fast.io",
            version: "v1alpha2",
            kind: "Sandbox",
            plural: "sandboxes",
            namespaced: true,
            status_subresource: true,
            custom: true,
            returns_deleted_object: false,
            extra_fields: &[],
        },
        Kind {
            group: "sandbolt.io",
            version: "v1alpha1",
            kind: "SandboxPool",
            plural: "sandboxpools",
            namespaced: true,
            status_subresource: true,
            custom: true,
            returns_deleted_object: false,
            extra_fields: &[],
        },
        Kind {
            group: "sandbolt.io",
            version: "v1alpha1",
            kind: "SandboxWarmPool",
            plural: "sandboxwarmpools",
            namespaced: true,
            status_subresource: true,
            custom: true,
            returns_deleted_object: false,
            extra_fields: &[],
        },
        Kind {
            group: "sandbolt.io",
            version: "v1alpha1",
            kind: "SandboxSnapshot",
            plural: "sandboxsnapshots",
            namespaced: true,
            status_subresource: false,
            custom: true,
            returns_deleted_object: false,
            extra_fields: &[],
        },
    ]
}
