//! `SandboxTemplate` in `sandbox.fast.io/v1alpha2`, in the shape the
//! OpenSandbox server (1.1.1, `services/templates/template_service.py`)
//! writes and reads:
//!
//! - the server creates one per `POST /templates`, named after the template
//!   id (`tpl-<uuid>`, also `spec.indexKey`), the user metadata as plain
//!   labels, and a spec built for fast-sandbox's microVM golden-image
//!   builder: `image`, `indexKey`, `entrypoint`, `execd`, `kernel`,
//!   `machine{vcpu,memory}`, `output{rootfsSize,format,publish,
//!   publishSecretRef{name}}`, `envs[{name,value}]`, `readiness{probe,
//!   warmupSeconds}`. Everything but `image` is optional here, so a
//!   template applied with kubectl needs no builder settings.
//! - it reads `status.phase` ([`TemplatePhase`]), `status.manifestRef` and
//!   the message (else reason) of the `Failed` condition; a sandbox is
//!   created from a template only once its phase is `Succeeded`, with
//!   `image` = the template's name.
//!
//! sandbolt runs the OCI image itself: the controller's reconciler sets the
//! phase from `spec.image` (see the controller's `template` module) and a
//! create naming the template runs that image.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of the SandboxTemplate resource.
pub const GROUP: &str = "sandbox.fast.io";
/// API version of the SandboxTemplate resource.
pub const VERSION: &str = "v1alpha2";
/// Prefix of the template ids (and names) the OpenSandbox server makes.
pub const NAME_PREFIX: &str = "tpl-";
/// Condition type whose message the OpenSandbox server shows for a failed
/// template.
pub const FAILED_CONDITION: &str = "Failed";
/// Condition type saying whether sandboxes can be created from the template.
pub const READY_CONDITION: &str = "Ready";

/// A sandbox image and its defaults, as the OpenSandbox server describes a
/// golden-image build.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "sandbox.fast.io",
    version = "v1alpha2",
    kind = "SandboxTemplate",
    plural = "sandboxtemplates",
    singular = "sandboxtemplate",
    shortname = "sbtpl",
    namespaced,
    status = "SandboxTemplateStatus",
    derive = "PartialEq",
    category = "sandbolt",
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.image"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Manifest","type":"string","priority":1,"jsonPath":".status.manifestRef"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateSpec {
    /// Source OCI image reference: what sandboxes of the template run.
    #[schemars(length(min = 1))]
    pub image: String,
    /// Second name a create may use for the template (the server sets it to
    /// the template id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_key: Option<String>,
    /// Default command (argv) of the template's sandboxes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    /// execd image for the microVM build (sandbolt injects its own execd).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execd: Option<String>,
    /// Guest kernel of the microVM build (no meaning for containers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// Guest size: sandbolt makes it the sandboxes' cpu and memory limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<TemplateMachine>,
    /// Where and how the microVM build publishes its artifacts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<TemplateOutput>,
    /// Environment of the template's sandboxes (a create's own env wins).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub envs: Vec<TemplateEnv>,
    /// Build-time readiness gate of the microVM build.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<TemplateReadiness>,
}

/// Guest machine size, as Kubernetes quantities (`"1"`, `"500m"`, `"512Mi"`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateMachine {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu: Option<IntOrString>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<IntOrString>,
}

/// Artifact output of the microVM build.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateOutput {
    /// Logical size of the guest rootfs (a quantity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs_size: Option<IntOrString>,
    /// `native` or `overlaybd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Object-store URL the artifacts are published to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish: Option<String>,
    /// Secret with the object-store credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_secret_ref: Option<SecretRef>,
}

/// A Secret of the template's namespace, by name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct SecretRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// One environment variable.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct TemplateEnv {
    #[schemars(length(min = 1))]
    pub name: String,
    #[serde(default)]
    pub value: String,
}

/// Build-time readiness gate.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateReadiness {
    /// `tcp://host:port` or `cmd://<command>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub warmup_seconds: Option<i64>,
}

/// Where the template stands.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<TemplatePhase>,
    /// The image sandboxes of the template run (normalized reference).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_ref: Option<String>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, and `Failed` when the phase is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// The phases the OpenSandbox server knows.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TemplatePhase {
    Pending,
    Building,
    Succeeded,
    Failed,
}

impl SandboxTemplate {
    /// Whether a create's `image` names this template: its name, or its
    /// `spec.indexKey`.
    pub fn is_named(&self, image: &str) -> bool {
        self.metadata.name.as_deref() == Some(image)
            || self.spec.index_key.as_deref() == Some(image)
    }
}
