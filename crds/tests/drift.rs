//! The committed CRD YAML (crds/ and the chart's templates) must be exactly what the Rust
//! types generate: a hand edit, or a type change without `crdgen`, fails here.

use std::path::Path;

#[test]
fn committed_crd_yaml_matches_the_types() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let files = gpupool_crds::crdgen::generated_files().expect("CRDs render");
    assert_eq!(files.len(), 4, "two CRDs, each in crds/ and in the chart");
    let mut stale = Vec::new();
    for file in files {
        let on_disk = std::fs::read_to_string(root.join(&file.path)).unwrap_or_default();
        if on_disk != file.content {
            stale.push(file.path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "out of date: {stale:?}; run `cargo run -p gpupool-crds --bin crdgen` and commit the result"
    );
}

#[test]
fn generated_crds_carry_printer_columns_short_names_and_cel() {
    let files = gpupool_crds::crdgen::generated_files().expect("CRDs render");
    let pools = &files
        .iter()
        .find(|f| f.path.ends_with("gpupool.io_gpupools.yaml"))
        .expect("pool CRD")
        .content;
    for column in [
        "Nodes",
        "GPUs",
        "Healthy",
        "MIG",
        "Driver",
        "Reclaimed",
        "Ready",
        "Age",
    ] {
        assert!(
            pools.contains(&format!("name: {column}\n")),
            "GpuPool column {column}"
        );
    }
    assert!(
        pools.contains("- gp\n")
            && pools.contains("- gpupool-all\n")
            && pools.contains("scope: Cluster")
    );
    assert!(pools.contains("x-kubernetes-validations"));
    let nodes = &files
        .iter()
        .find(|f| f.path.ends_with("gpupool.io_gpunodes.yaml"))
        .expect("node CRD")
        .content;
    for column in [
        "Pool",
        "GPUs",
        "Healthy",
        "MIG-State",
        "Driver",
        "Valid",
        "Age",
    ] {
        assert!(
            nodes.contains(&format!("name: {column}\n")),
            "GpuNode column {column}"
        );
    }
    assert!(
        nodes.contains("- gn\n")
            && nodes.contains("scope: Cluster")
            && nodes.contains("status: {}")
    );
}

/// `kubectl explain gpupool` / `gpunode` print the root and `spec` descriptions first: they are
/// sentences a user understands, not kube-derive's "Auto-generated derived type" default.
#[test]
fn explain_starts_with_human_sentences() {
    use kube::CustomResourceExt;
    for (crd, root, spec) in [
        (
            gpupool_crds::GpuPool::crd(),
            "A GpuPool is a set of GPU nodes",
            "The pool's nodes, chosen by a label selector",
        ),
        (
            gpupool_crds::GpuNode::crd(),
            "A GpuNode is one GPU node as gpupool manages it",
            "The desired state of one GPU node",
        ),
    ] {
        let schema = crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("schema");
        let spec_schema = schema
            .properties
            .as_ref()
            .and_then(|p| p.get("spec"))
            .expect("spec");
        for (what, text, start) in [
            ("root", &schema.description, root),
            ("spec", &spec_schema.description, spec),
        ] {
            let text = text.as_deref().unwrap_or_default();
            let name = &crd.spec.names.kind;
            assert!(
                text.starts_with(start) && !text.contains("Auto-generated"),
                "{name} {what} description: {text:?}"
            );
            assert!(text.trim_end().ends_with('.'), "{name} {what}: a sentence");
        }
    }
}
