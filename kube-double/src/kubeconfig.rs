//! The kubeconfig that points a client at a running double.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde_json::json;

/// Cluster, user and context names in the written kubeconfig.
const NAME: &str = "kube-double";

/// The kubeconfig document (YAML) for a double at `url` with `token`.
pub(crate) fn render(url: &str, token: &str) -> String {
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": NAME, "cluster": {"server": url}}],
        "users": [{"name": NAME, "user": {"token": token}}],
        "contexts": [{"name": NAME, "context": {"cluster": NAME, "user": NAME, "namespace": "default"}}],
        "current-context": NAME,
        "preferences": {},
    });
    serde_yaml::to_string(&config).expect("a JSON value renders as YAML")
}

/// Writes [`render`] to `path` through a temporary file in the same
/// directory, renamed into place: a reader never sees half a file. Mode
/// 0600 because it holds the token.
pub(crate) fn write(path: &Path, url: &str, token: &str) -> std::io::Result<()> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = Path::new(&tmp_name);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(tmp)?;
    file.write_all(render(url, token).as_bytes())?;
    file.sync_all()?;
    std::fs::rename(tmp, path)
}
