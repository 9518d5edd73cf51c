//! Holds sandbolt's compiled FastPath descriptors to the contract files,
//! parsed here at test time: any difference in packages, messages, fields
//! (name, number, type, label, oneof, map key/value), enums or services
//! fails.
//!
//! The contract files are `proto/contracts/fastpath/`, verbatim copies of
//! `shared/contracts/fastpath/` checked in so that a clone alone can run the
//! tests; where `shared/` sits beside the checkout, the copies are held to
//! it byte for byte.

use std::collections::BTreeSet;
use std::path::PathBuf;

use prost::Message;
use prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet};

const CONTRACT_FILES: [&str; 2] = ["fastpath_v1.proto", "fastpath_v2.proto"];

fn contracts_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("contracts/fastpath")
}

#[test]
fn the_checked_in_contracts_are_the_shared_ones() {
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/contracts/fastpath");
    for name in CONTRACT_FILES {
        let ours = std::fs::read(contracts_dir().join(name))
            .unwrap_or_else(|e| panic!("proto/contracts/fastpath/{name}: {e}"));
        assert!(ours.len() > 1000, "{name} is nearly empty");
        if !shared.is_dir() {
            // A clone without shared/ beside it (CI's clean checkout):
            // the checked-in copies are the contract.
            eprintln!(
                "note: {} is absent; comparing against the checked-in copies only",
                shared.display()
            );
            continue;
        }
        let theirs = std::fs::read(shared.join(name)).unwrap();
        assert!(
            ours == theirs,
            "proto/contracts/fastpath/{name} differs from shared/contracts/fastpath/{name}: copy it again"
        );
    }
}

/// One line per wire-relevant fact of every file in `packages`.
fn wire_facts(files: &[FileDescriptorProto], packages: &[&str]) -> BTreeSet<String> {
    let mut facts = BTreeSet::new();
    for file in files {
        let package = file.package();
        if !packages.contains(&package) {
            continue;
        }
        facts.insert(format!("package {package} syntax {}", file.syntax()));
        for message in &file.message_type {
            message_facts(
                &format!("{package}.{}", message.name()),
                message,
                &mut facts,
            );
        }
        for e in &file.enum_type {
            for v in &e.value {
                facts.insert(format!(
                    "enum {package}.{} {} = {}",
                    e.name(),
                    v.name(),
                    v.number()
                ));
            }
        }
        for service in &file.service {
            for m in &service.method {
                facts.insert(format!(
                    "rpc {package}.{}.{}({}{}) returns ({}{})",
                    service.name(),
                    m.name(),
                    if m.client_streaming() { "stream " } else { "" },
                    m.input_type(),
                    if m.server_streaming() { "stream " } else { "" },
                    m.output_type(),
                ));
            }
        }
    }
    facts
}

fn message_facts(full: &str, message: &DescriptorProto, facts: &mut BTreeSet<String>) {
    facts.insert(format!(
        "message {full}{}",
        if message.options.as_ref().is_some_and(|o| o.map_entry()) {
            " (map entry)"
        } else {
            ""
        }
    ));
    for field in &message.field {
        let oneof = field
            .oneof_index
            .filter(|_| !field.proto3_optional())
            .map(|i| format!(" oneof {}", message.oneof_decl[i as usize].name()))
            .unwrap_or_default();
        facts.insert(format!(
            "field {full}.{} = {} {:?} {:?} {}{}{}",
            field.name(),
            field.number(),
            field.label(),
            field.r#type(),
            field.type_name(),
            oneof,
            if field.proto3_optional() {
                " optional"
            } else {
                ""
            },
        ));
    }
    for nested in &message.nested_type {
        message_facts(&format!("{full}.{}", nested.name()), nested, facts);
    }
    for e in &message.enum_type {
        for v in &e.value {
            facts.insert(format!(
                "enum {full}.{} {} = {}",
                e.name(),
                v.name(),
                v.number()
            ));
        }
    }
}

fn ours() -> Vec<FileDescriptorProto> {
    FileDescriptorSet::decode(sandbolt_proto::FILE_DESCRIPTOR_SET)
        .expect("embedded descriptor set decodes")
        .file
}

fn contract() -> Vec<FileDescriptorProto> {
    protox::compile(CONTRACT_FILES, [contracts_dir()])
        .expect("contract protos parse")
        .file
}

fn diff(a: &BTreeSet<String>, b: &BTreeSet<String>) -> Vec<String> {
    let mut out: Vec<String> = a
        .difference(b)
        .map(|l| format!("- contract: {l}"))
        .collect();
    out.extend(b.difference(a).map(|l| format!("+ sandbolt: {l}")));
    out
}

#[test]
fn fastpath_descriptors_match_the_contract_files() {
    let packages = ["fastpath.v1", "fastpath.v2"];
    let theirs = wire_facts(&contract(), &packages);
    let mine = wire_facts(&ours(), &packages);
    // Guard against comparing two empty sets.
    assert!(
        theirs.len() > 300,
        "contract parsed to only {} facts",
        theirs.len()
    );
    let drift = diff(&theirs, &mine);
    assert!(drift.is_empty(), "wire drift:\n{}", drift.join("\n"));
}

#[test]
fn the_comparison_notices_drift() {
    // Renumbering one field, renaming one enum value or retyping one field
    // must each be caught; otherwise the test above proves nothing.
    let packages = ["fastpath.v1", "fastpath.v2"];
    let theirs = wire_facts(&contract(), &packages);
    let mutations: [fn(&mut Vec<FileDescriptorProto>); 3] = [
        |files| files[0].message_type[0].field[0].number = Some(99),
        |files| files[0].enum_type[0].value[0].name = Some("RENAMED".into()),
        |files| files[0].message_type[0].field[0].r#type = Some(5),
    ];
    for mutate in mutations {
        let mut files: Vec<FileDescriptorProto> = ours()
            .into_iter()
            .filter(|f| packages.contains(&f.package()))
            .collect();
        mutate(&mut files);
        assert!(!diff(&theirs, &wire_facts(&files, &packages)).is_empty());
    }
}

#[test]
fn agent_api_is_in_the_descriptor_set() {
    let files = ours();
    let agent = files
        .iter()
        .find(|f| f.package() == "sandbolt.agent.v1")
        .expect("sandbolt.agent.v1 compiled");
    let services: Vec<&str> = agent.service.iter().map(|s| s.name()).collect();
    assert_eq!(services, ["AgentService", "RegistryService"]);
}
