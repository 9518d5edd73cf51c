//! ARCHITECTURE.md names the file and function of every hop of a create and
//! a command. This keeps it true: every `path.rs::function` it writes must be
//! a function in that file, and every other path it writes must exist.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace")
        .to_path_buf()
}

/// Every `backticked` span of the document.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// `dir/file.rs::name` → ("dir/file.rs", Some("name")); `dir/file.proto` →
/// ("dir/file.proto", None); anything else is not a reference.
fn reference(span: &str) -> Option<(&str, Option<&str>)> {
    let (path, function) = match span.split_once("::") {
        Some((p, f)) => (p, Some(f)),
        None => (span, None),
    };
    let is_path = path.contains('/')
        && !path.contains(' ')
        && (path.ends_with(".rs") || path.ends_with(".proto"));
    is_path.then_some((path, function))
}

fn defines(source: &str, function: &str) -> bool {
    ["(", "<"]
        .iter()
        .any(|next| source.contains(&format!("fn {function}{next}")))
}

#[test]
fn every_file_and_function_the_architecture_page_names_exists() {
    let root = root();
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let mut checked = 0;
    let mut missing = Vec::new();
    for (path, function) in code_spans(&doc).into_iter().filter_map(reference) {
        checked += 1;
        let Ok(source) = std::fs::read_to_string(root.join(path)) else {
            missing.push(format!("{path}: no such file"));
            continue;
        };
        if let Some(f) = function
            && !defines(&source, f)
        {
            missing.push(format!("{path}: no fn {f}"));
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md is out of date:\n{}",
        missing.join("\n")
    );
    // The create and command paths alone name more than this; fewer means
    // the parsing above stopped seeing them.
    assert!(checked >= 30, "only {checked} references found");
}

#[test]
fn references_are_recognised() {
    assert_eq!(
        reference("agent/src/spec.rs::build"),
        Some(("agent/src/spec.rs", Some("build")))
    );
    assert_eq!(
        reference("proto/proto/sandbolt/control/v1/control.proto"),
        Some(("proto/proto/sandbolt/control/v1/control.proto", None))
    );
    assert_eq!(
        reference("sandbolt.control.v1.SandboxService/CreateSandbox"),
        None
    );
    assert_eq!(reference("wait_ready"), None);
    assert!(defines("pub async fn create<B: Backend>(", "create"));
    assert!(!defines("fn create_inner(", "create"));
}
