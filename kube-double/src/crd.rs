//! Kinds from `apiextensions.k8s.io/v1` CustomResourceDefinition files, so a
//! new CRD (e.g. one under `deploy/crds/`) is served with no code here.

use std::path::{Path, PathBuf};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::Deserialize;

use crate::kinds::{CustomKind, KindError};

/// Why a CRD could not be turned into a served kind.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{origin}: not an apiextensions.k8s.io/v1 CustomResourceDefinition: {source}")]
    Parse {
        origin: String,
        source: serde_yaml::Error,
    },
    #[error("CRD {name}: scope {scope:?} is not served; the double serves namespaced kinds only")]
    NotNamespaced { name: String, scope: String },
    #[error("CRD {name}: no version is both served and the storage version")]
    NoServedStorageVersion { name: String },
    #[error(
        "CRD {name}: versions {others:?} are served besides the storage version {storage}; \
         the double serves one version per kind"
    )]
    SeveralServedVersions {
        name: String,
        storage: String,
        others: Vec<String>,
    },
    #[error("CRD {name}: {source}")]
    Kind { name: String, source: KindError },
    #[error("{dir}: no .yaml or .yml file holds a CustomResourceDefinition")]
    NoCrds { dir: PathBuf },
}

/// Every CRD in `yaml` (one or more `---`-separated documents; empty
/// documents are skipped), as the kinds they define. `origin` names the
/// text in errors.
pub(crate) fn parse(yaml: &str, origin: &str) -> Result<Vec<CustomKind>, CrdError> {
    let mut kinds = Vec::new();
    for document in serde_yaml::Deserializer::from_str(yaml) {
        let value = serde_yaml::Value::deserialize(document).map_err(|source| CrdError::Parse {
            origin: origin.to_string(),
            source,
        })?;
        if value.is_null() {
            continue;
        }
        // k8s-openapi checks apiVersion and kind while deserializing.
        let crd: CustomResourceDefinition =
            serde_yaml::from_value(value).map_err(|source| CrdError::Parse {
                origin: origin.to_string(),
                source,
            })?;
        kinds.push(kind_of(&crd)?);
    }
    Ok(kinds)
}

/// The kind a CRD serves: its storage version, which must be the only
/// served one (the double keeps one copy of each object, unconverted).
fn kind_of(crd: &CustomResourceDefinition) -> Result<CustomKind, CrdError> {
    let name = crd.metadata.name.clone().unwrap_or_default();
    let spec = &crd.spec;
    if spec.scope != "Namespaced" {
        return Err(CrdError::NotNamespaced {
            name,
            scope: spec.scope.clone(),
        });
    }
    let Some(storage) = spec.versions.iter().find(|v| v.served && v.storage) else {
        return Err(CrdError::NoServedStorageVersion { name });
    };
    let others: Vec<String> = spec
        .versions
        .iter()
        .filter(|v| v.served && !v.storage)
        .map(|v| v.name.clone())
        .collect();
    if !others.is_empty() {
        return Err(CrdError::SeveralServedVersions {
            name,
            storage: storage.name.clone(),
            others,
        });
    }
    let status_subresource = storage
        .subresources
        .as_ref()
        .is_some_and(|s| s.status.is_some());
    let custom = CustomKind {
        group: spec.group.clone(),
        version: storage.name.clone(),
        kind: spec.names.kind.clone(),
        plural: spec.names.plural.clone(),
        status_subresource,
    };
    // Checked here too so the error names the CRD, not just the kind.
    crate::kinds::Kind::from_custom(&custom).map_err(|source| CrdError::Kind {
        name: name.clone(),
        source,
    })?;
    Ok(custom)
}

/// The `.yaml` / `.yml` files of `dir`, sorted by name.
pub(crate) fn files(dir: &Path) -> Result<Vec<PathBuf>, CrdError> {
    let read_err = |source| CrdError::Read {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let path = entry.map_err(read_err)?.path();
        let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        if yaml && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.io
spec:
  group: example.io
  names: {kind: Widget, plural: widgets}
  scope: Namespaced
  versions:
  - name: v1beta1
    served: false
    storage: false
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
"#;

    #[test]
    fn storage_version_and_status_subresource() {
        let kinds = parse(CRD, "test").unwrap();
        assert_eq!(
            kinds,
            vec![CustomKind::new("example.io", "v1", "Widget", "widgets").with_status()]
        );
    }

    #[test]
    fn several_documents_and_empty_ones() {
        let two = format!(
            "---\n# nothing\n---{CRD}---\n{}",
            CRD.replace("widgets", "gadgets")
        );
        let kinds = parse(&two, "test").unwrap();
        let plurals: Vec<&str> = kinds.iter().map(|k| k.plural.as_str()).collect();
        assert_eq!(plurals, ["widgets", "gadgets"]);
    }

    #[test]
    fn refusals_name_the_crd() {
        let cluster = CRD.replace("scope: Namespaced", "scope: Cluster");
        let err = parse(&cluster, "t").unwrap_err();
        assert!(matches!(err, CrdError::NotNamespaced { .. }), "{err}");
        let two_served = CRD.replace("served: false", "served: true");
        let err = parse(&two_served, "t").unwrap_err();
        assert!(err.to_string().contains("[\"v1beta1\"]"), "{err}");
        let no_storage = CRD.replace("storage: true", "storage: false");
        let err = parse(&no_storage, "t").unwrap_err();
        assert!(
            matches!(err, CrdError::NoServedStorageVersion { .. }),
            "{err}"
        );
        let bad_plural = CRD.replace("plural: widgets", "plural: Widgets");
        let err = parse(&bad_plural, "t").unwrap_err();
        assert!(
            err.to_string().starts_with("CRD widgets.example.io:"),
            "{err}"
        );
        let not_crd = CRD.replace("kind: CustomResourceDefinition", "kind: ConfigMap");
        let err = parse(&not_crd, "file.yaml").unwrap_err();
        assert!(matches!(err, CrdError::Parse { .. }), "{err}");
    }
}
