//! SandboxTemplates (`sandbox.fast.io/v1alpha2`): the images the
//! OpenSandbox server creates sandboxes from.
//!
//! The server makes a template per `POST /templates`, waits for its
//! `status.phase` to turn `Succeeded`, then sends FastPath creates whose
//! `image` is the template's name (`tpl-<uuid>`). In fast-sandbox a builder
//! turns the template into a microVM golden image; sandbolt runs the OCI
//! image as a container, so a template is its image plus defaults:
//!
//! - **Assessment** ([`assess`]): `spec.image` must be an image reference,
//!   `spec.machine.vcpu` / `spec.machine.memory` quantities (they become the
//!   sandboxes' cpu and memory limits), `spec.envs` names usable as
//!   environment names. The build settings that mean nothing for a
//!   container (`execd`: sandbolt injects its own; `kernel`, `output`,
//!   `readiness`) are ignored, and the status says so.
//! - **Status** ([`reconcile`]): the leader publishes the assessment as
//!   `Succeeded` (`manifestRef` = the normalized image, a `Ready`
//!   condition naming what was ignored) or `Failed` (a `Failed` condition
//!   whose message the server shows).
//! - **Resolution** ([`Core::resolve_template`], in `Core::validate`): with a
//!   store that has a [`TemplateCatalog`] (the Kubernetes store), a create
//!   whose image names a template of its namespace (by name or
//!   `spec.indexKey`) runs the template's image, with the template's env
//!   under its own, the template's limits where it set none, and the
//!   template's entrypoint when it gave no command. The resolved spec is
//!   what is recorded: recovery and recreation never need the template
//!   again. Resolution assesses the template itself rather than trusting
//!   its status, so a create racing the status write (the server may read
//!   `Succeeded` before this controller's watch delivers it) resolves the
//!   same way. A server-made template id naming no template is refused;
//!   other images are images. The embedded store has no catalog: images
//!   are always images there.

pub mod catalog;
pub mod reconcile;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sandbolt_deploy::template::{NAME_PREFIX, SandboxTemplateSpec};
use sandbolt_proto::quantity;

pub use catalog::TemplateCatalog;

use crate::error::{Error, Result};
use crate::sandbox::Core;
use crate::store::SandboxSpec;

/// What a sandbox created from a template takes from it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateDefaults {
    /// `spec.image` as written (trimmed).
    pub image: String,
    /// The normalized reference: the status's `manifestRef`.
    pub manifest_ref: String,
    pub envs: BTreeMap<String, String>,
    pub entrypoint: Vec<String>,
    /// Quantities; empty when the template sets none.
    pub cpu_limit: String,
    pub memory_limit: String,
    /// Spec fields that have no meaning for a container, present on this
    /// template.
    pub ignored: Vec<&'static str>,
}

/// Why the ignored fields are ignored, for the status.
pub const IGNORED_WHY: &str = "microVM build settings: sandbolt runs the image as a container \
     with its own execd";

/// The template's defaults, or why no sandbox can be made from it.
pub fn assess(spec: &SandboxTemplateSpec) -> std::result::Result<TemplateDefaults, String> {
    let image = spec.image.trim();
    let parsed =
        sandbolt_image_ref::ImageRef::parse(image).map_err(|e| format!("spec.image: {e}"))?;
    let machine = spec.machine.clone().unwrap_or_default();
    let cpu_limit = quantity_text(machine.vcpu.as_ref());
    if !cpu_limit.is_empty() {
        quantity::millicores(&cpu_limit).map_err(|e| format!("spec.machine.vcpu: {e}"))?;
    }
    let memory_limit = quantity_text(machine.memory.as_ref());
    if !memory_limit.is_empty() {
        quantity::bytes(&memory_limit).map_err(|e| format!("spec.machine.memory: {e}"))?;
    }
    let mut envs = BTreeMap::new();
    for e in &spec.envs {
        if e.name.is_empty() || e.name.contains(['=', '\0']) {
            return Err(format!(
                "spec.envs: {:?} is not an environment variable name",
                e.name
            ));
        }
        envs.insert(e.name.clone(), e.value.clone());
    }
    let ignored = [
        ("execd", spec.execd.is_some()),
        ("kernel", spec.kernel.is_some()),
        ("output", spec.output.is_some()),
        ("readiness", spec.readiness.is_some()),
    ]
    .into_iter()
    .filter_map(|(field, set)| set.then_some(field))
    .collect();
    Ok(TemplateDefaults {
        image: image.to_string(),
        manifest_ref: parsed.to_string(),
        envs,
        entrypoint: spec.entrypoint.clone(),
        cpu_limit,
        memory_limit,
        ignored,
    })
}

/// A quantity as text (`2` → `"2"`); empty when unset.
fn quantity_text(q: Option<&IntOrString>) -> String {
    match q {
        Some(IntOrString::Int(n)) => n.to_string(),
        Some(IntOrString::String(s)) => s.trim().to_string(),
        None => String::new(),
    }
}

impl TemplateDefaults {
    /// Makes `spec` a create from this template: its image; its env under
    /// the request's; its limits where the request set none; its entrypoint
    /// when the request gave no command.
    pub fn apply(&self, spec: &mut SandboxSpec) {
        spec.image.clone_from(&self.image);
        for (k, v) in &self.envs {
            spec.envs.entry(k.clone()).or_insert_with(|| v.clone());
        }
        if spec.command.is_empty() && spec.args.is_empty() {
            spec.command.clone_from(&self.entrypoint);
        }
        let r = &mut spec.resources;
        if r.cpu_limit.trim().is_empty() {
            r.cpu_limit.clone_from(&self.cpu_limit);
        }
        if r.memory_limit.trim().is_empty() {
            r.memory_limit.clone_from(&self.memory_limit);
        }
    }
}

/// Whether `image` is shaped like the template ids the OpenSandbox server
/// makes (`tpl-<uuid>`): such an image naming no template is a mistake,
/// not an image to pull.
pub fn is_template_id(image: &str) -> bool {
    image
        .strip_prefix(NAME_PREFIX)
        .is_some_and(|id| uuid::Uuid::try_parse(id).is_ok())
}

impl Core {
    /// Replaces a create's template-named image by the template (see the
    /// module docs); leaves every other image alone.
    #[tracing::instrument(skip_all, fields(namespace = %namespace, image = %spec.image))]
    pub(crate) fn resolve_template(&self, namespace: &str, spec: &mut SandboxSpec) -> Result<()> {
        let Some(catalog) = self.store.template_catalog() else {
            return Ok(());
        };
        let image = spec.image.trim().to_string();
        if image.is_empty() {
            return Ok(());
        }
        let template = match catalog.find(namespace, &image) {
            Ok(Some(t)) => t,
            Ok(None) if is_template_id(&image) => {
                return Err(Error::InvalidArgument(format!(
                    "image {image:?} names no SandboxTemplate in namespace {namespace:?}"
                )));
            }
            Err(why) if is_template_id(&image) => {
                return Err(Error::InvalidArgument(format!(
                    "image {image:?} names a SandboxTemplate, but {why}"
                )));
            }
            Ok(None) | Err(_) => return Ok(()),
        };
        let name = template.metadata.name.clone().unwrap_or_default();
        let defaults = assess(&template.spec).map_err(|why| {
            Error::InvalidArgument(format!(
                "SandboxTemplate {namespace}/{name} cannot be used: {why}"
            ))
        })?;
        defaults.apply(spec);
        tracing::info!(template = %name, resolved = %spec.image, "image resolved from its SandboxTemplate");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbolt_deploy::template::{TemplateEnv, TemplateMachine};

    fn spec(image: &str) -> SandboxTemplateSpec {
        SandboxTemplateSpec {
            image: image.into(),
            entrypoint: vec!["tail".into(), "-f".into(), "/dev/null".into()],
            kernel: Some("vmlinux.bin".into()),
            machine: Some(TemplateMachine {
                vcpu: Some(IntOrString::Int(2)),
                memory: Some(IntOrString::String("512Mi".into())),
            }),
            envs: vec![
                TemplateEnv {
                    name: "A".into(),
                    value: "template".into(),
                },
                TemplateEnv {
                    name: "B".into(),
                    value: "2".into(),
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn a_template_gives_image_env_limits_and_entrypoint_under_the_request() {
        let d = assess(&spec(" busybox:1.36 ")).unwrap();
        assert_eq!(d.image, "busybox:1.36");
        assert_eq!(d.manifest_ref, "docker.io/library/busybox:1.36");
        assert_eq!(d.ignored, ["kernel"]);
        let mut s = SandboxSpec {
            image: "tpl-x".into(),
            envs: BTreeMap::from([("A".to_string(), "request".to_string())]),
            ..Default::default()
        };
        s.resources.memory_limit = "64Mi".into();
        d.apply(&mut s);
        assert_eq!(s.image, "busybox:1.36");
        assert_eq!(s.envs["A"], "request", "the request's env wins");
        assert_eq!(s.envs["B"], "2");
        assert_eq!(s.command, ["tail", "-f", "/dev/null"]);
        assert_eq!(
            (
                s.resources.cpu_limit.as_str(),
                s.resources.memory_limit.as_str()
            ),
            ("2", "64Mi")
        );
        // A request with a command keeps it.
        let mut s = SandboxSpec {
            command: vec!["sleep".into()],
            ..Default::default()
        };
        d.apply(&mut s);
        assert_eq!(s.command, ["sleep"]);
    }

    #[test]
    fn unusable_templates_say_which_field_is_wrong() {
        let why = |s: SandboxTemplateSpec| assess(&s).unwrap_err();
        assert!(why(spec("Not An Image!")).starts_with("spec.image"));
        let mut s = spec("busybox");
        s.machine.as_mut().unwrap().memory = Some(IntOrString::String("lots".into()));
        assert!(why(s).starts_with("spec.machine.memory"));
        let mut s = spec("busybox");
        s.machine.as_mut().unwrap().vcpu = Some(IntOrString::Int(0));
        assert!(why(s).starts_with("spec.machine.vcpu"));
        let mut s = spec("busybox");
        s.envs[1].name = "B=1".into();
        assert!(why(s).contains("\"B=1\""));
    }

    #[test]
    fn only_server_shaped_ids_are_template_ids() {
        assert!(is_template_id("tpl-0b4b7c1e-3c1f-4a57-9d7e-2f1d1b0b9c11"));
        assert!(!is_template_id("tpl-tools:1.0"));
        assert!(!is_template_id("busybox"));
    }
}
