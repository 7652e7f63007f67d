//! The gpupool API on a real kube-apiserver: the CRDs install, the examples
//! are accepted, bad GpuPools are rejected with a message naming the field,
//! and kubectl prints the printer columns.

use std::fs;

use anyhow::{Context, Result, bail, ensure};
use gpupool_crds::node::{MigState, NodeMigStatus, Verdict};
use gpupool_crds::pool::{GpuCounts, MigProgress, ReclaimStatus};
use gpupool_crds::{GpuNode, GpuNodeSpec, GpuNodeStatus, GpuPoolStatus};
use gpupool_e2e::manifest::{self, Manifest, expectation, read_objects, scoped, yaml_files};
use gpupool_e2e::{Cluster, FAKE_NODE_LABEL, TestScope, crds, repo_root};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{self, Scope};
use kube::{Client, ResourceExt};

/// The fewest invalid GpuPools the table must hold.
const MIN_INVALID_CASES: usize = 15;

/// The kubernetes release e2e/tools/kubernetes pins, e.g. `v1.36.3`.
fn pinned_kubernetes_version() -> Result<String> {
    let path = repo_root().join("e2e/tools/kubernetes/go.mod");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.contains("=>") && !l.trim_start().starts_with("//"))
        .find_map(|l| {
            let mut words = l.split_whitespace();
            while let Some(w) = words.next() {
                if w == "k8s.io/kubernetes" {
                    return words.next().map(str::to_owned);
                }
            }
            None
        })
        .with_context(|| format!("{} pins no k8s.io/kubernetes", path.display()))
}

#[tokio::test]
async fn cluster_runs_the_pinned_release_with_ready_fake_gpu_nodes() -> Result<()> {
    let cluster = Cluster::shared()?;
    let pinned = pinned_kubernetes_version()?;

    // The version ldflags reached both kubectl and the apiserver.
    let out = cluster.kubectl().run(["version", "-o", "json"])?;
    let version: serde_json::Value =
        serde_json::from_str(&out).context("parsing kubectl version")?;
    assert_eq!(
        version["clientVersion"]["gitVersion"],
        pinned.as_str(),
        "{version}"
    );
    assert_eq!(
        version["serverVersion"]["gitVersion"],
        pinned.as_str(),
        "{version}"
    );

    let helm = std::process::Command::new(cluster.helm_path())
        .args(["version", "--short"])
        .output()
        .context("running helm version")?;
    let helm_version = String::from_utf8_lossy(&helm.stdout);
    assert!(
        helm.status.success() && helm_version.starts_with("v3."),
        "helm version: {helm_version}"
    );

    let nodes: Api<Node> = Api::all(cluster.client().await?);
    let fake = nodes
        .list(&ListParams::default().labels(FAKE_NODE_LABEL))
        .await
        .context("listing fake nodes")?;
    ensure!(!fake.items.is_empty(), "the cluster has no fake GPU nodes");
    for node in &fake.items {
        let name = node.name_any();
        let labels = node.labels();
        assert_eq!(
            labels.get("nvidia.com/gpu.present").map(String::as_str),
            Some("true"),
            "{name}"
        );
        let product = labels
            .get("nvidia.com/gpu.product")
            .with_context(|| format!("{name}: no product label"))?;
        assert!(product.starts_with("NVIDIA-"), "{name}: {product}");
        let count = labels
            .get("nvidia.com/gpu.count")
            .with_context(|| format!("{name}: no count label"))?;
        let status = node
            .status
            .as_ref()
            .with_context(|| format!("{name} has no status"))?;
        let capacity = status
            .capacity
            .as_ref()
            .with_context(|| format!("{name} has no capacity"))?;
        assert_eq!(
            capacity.get("nvidia.com/gpu").map(|q| q.0.as_str()),
            Some(count.as_str()),
            "{name}"
        );
        let ready = status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == "Ready")
            .map(|c| c.status.as_str());
        assert_eq!(ready, Some("True"), "{name} is not Ready");
    }
    Ok(())
}

#[tokio::test]
async fn crds_install_and_become_established() -> Result<()> {
    let cluster = Cluster::shared()?;
    let mut names = crds::install(cluster).await?;
    names.sort();
    assert_eq!(names, ["gpunodes.gpupool.io", "gpupools.gpupool.io"]);

    let api: Api<CustomResourceDefinition> = Api::all(cluster.client().await?);
    for name in &names {
        let crd = api
            .get(name)
            .await
            .with_context(|| format!("reading CRD {name}"))?;
        let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
        for wanted in ["Established", "NamesAccepted"] {
            let status = conditions
                .iter()
                .find(|c| c.type_ == wanted)
                .map(|c| c.status.as_str());
            assert_eq!(
                status,
                Some("True"),
                "{name}: condition {wanted}: {conditions:?}"
            );
        }
    }

    // The kinds are served: discovery knows them and an empty list works.
    let client = cluster.client().await?;
    for kind in ["GpuPool", "GpuNode"] {
        let gvk = GroupVersionKind::gvk("gpupool.io", "v1alpha1", kind);
        let (resource, caps) = discovery::pinned_kind(&client, &gvk)
            .await
            .with_context(|| format!("discovering {kind}"))?;
        assert!(
            matches!(caps.scope, Scope::Cluster),
            "{kind} should be cluster-scoped"
        );
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        api.list(&ListParams::default().limit(1))
            .await
            .with_context(|| format!("listing {kind}"))?;
    }
    Ok(())
}

/// Creates `manifest`'s object, renamed into `scope`, with a real create.
async fn create_scoped(
    client: &Client,
    scope: &TestScope,
    manifest: &Manifest,
) -> Result<Result<DynamicObject, kube::Error>> {
    let types = manifest
        .object
        .types
        .as_ref()
        .with_context(|| format!("{} has no apiVersion/kind", manifest.origin()))?;
    let gvk = GroupVersionKind::try_from(types)
        .with_context(|| format!("{}: bad apiVersion", manifest.origin()))?;
    let (resource, caps) = discovery::pinned_kind(client, &gvk)
        .await
        .with_context(|| format!("{}: discovering {}", manifest.origin(), types.kind))?;
    let namespaced = matches!(caps.scope, Scope::Namespaced);
    if !namespaced {
        scope.track_kind(&format!("{}.{}", resource.plural, resource.group));
    }
    let object = scoped(
        manifest.object.clone(),
        scope,
        namespaced,
        &format!("doc{}", manifest.index),
    );
    let api: Api<DynamicObject> = if namespaced {
        Api::namespaced_with(client.clone(), scope.namespace(), &resource)
    } else {
        Api::all_with(client.clone(), &resource)
    };
    Ok(api.create(&PostParams::default(), &object).await)
}

/// Every `examples/<name>.yaml` that `README.md` or a page under `docs/` names.
fn examples_the_docs_name() -> Result<std::collections::BTreeSet<String>> {
    let root = repo_root();
    let mut pages = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    let mut named = std::collections::BTreeSet::new();
    for page in pages {
        let text =
            fs::read_to_string(&page).with_context(|| format!("reading {}", page.display()))?;
        for (at, _) in text.match_indices("examples/") {
            let stem: String = text[at + "examples/".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .collect();
            // A sentence's full stop may follow the name: cut at the extension.
            if let Some(end) = stem.find(".yaml") {
                named.insert(format!("examples/{}.yaml", &stem[..end]));
            }
        }
    }
    Ok(named)
}

#[tokio::test]
async fn every_example_is_accepted() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "examples")?;

    let files = yaml_files(&repo_root().join("examples"))?;
    ensure!(!files.is_empty(), "examples/ holds no YAML files");
    // Every example the README and docs/ name is among those applied here (crds/tests/docs.rs
    // checks that each named file exists; this, that the apiserver takes it).
    let named = examples_the_docs_name()?;
    ensure!(!named.is_empty(), "the docs name no example");
    for name in &named {
        ensure!(
            files.contains(&repo_root().join(name)),
            "{name} is named in the docs but is not one of the examples applied here"
        );
    }
    let mut created = 0;
    for file in &files {
        let manifests = read_objects(file)?;
        ensure!(!manifests.is_empty(), "{} holds no objects", file.display());
        for manifest in &manifests {
            let object = create_scoped(&client, &scope, manifest)
                .await?
                .with_context(|| format!("the apiserver rejected {}", manifest.origin()))?;
            // What was stored is what was sent, apart from defaults.
            assert!(object.uid().is_some(), "{}: no uid", manifest.origin());
            assert_eq!(
                object.labels().get(scope.label().0).map(String::as_str),
                Some(scope.prefix()),
                "{}",
                manifest.origin()
            );
            created += 1;
        }
    }
    assert!(created >= files.len());
    Ok(())
}

#[tokio::test]
async fn invalid_gpupools_are_rejected_naming_the_field() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "invalid")?;

    let dir = repo_root().join("crds/tests/invalid");
    let files = yaml_files(&dir)?;
    ensure!(
        files.len() >= MIN_INVALID_CASES,
        "{} holds {} cases; at least {MIN_INVALID_CASES} are expected",
        dir.display(),
        files.len()
    );

    let mut failures = Vec::new();
    for file in &files {
        let text =
            fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let wanted = expectation(&text).with_context(|| {
            format!(
                "{}: the first line must be `# expect: <substring>`",
                file.display()
            )
        })?;
        let manifests = manifest::parse_objects(&text, file)?;
        let [manifest] = manifests.as_slice() else {
            bail!("{} must hold exactly one object", file.display());
        };
        match create_scoped(&client, &scope, manifest).await? {
            Ok(_) => failures.push(format!(
                "{}: accepted, expected an error containing {wanted:?}",
                file.display()
            )),
            Err(kube::Error::Api(status)) if (400..500).contains(&status.code) => {
                if !status.message.contains(&wanted) {
                    failures.push(format!(
                        "{}: rejected, but the message lacks {wanted:?}: {}",
                        file.display(),
                        status.message
                    ));
                }
            }
            Err(e) => failures.push(format!("{}: unexpected error: {e}", file.display())),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
    Ok(())
}

/// `kubectl get <resource> -l <scope>`: the header's columns and the first row's cells.
fn kubectl_table(
    cluster: &Cluster,
    resource: &str,
    scope: &TestScope,
) -> Result<(Vec<String>, Vec<String>)> {
    let out = cluster
        .kubectl()
        .run(["get", resource, "-l", &scope.selector()])?;
    let mut lines = out.lines();
    let split = |l: &str| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let header = lines
        .next()
        .map(split)
        .with_context(|| format!("kubectl get {resource} printed nothing"))?;
    let row = lines
        .next()
        .map(split)
        .with_context(|| format!("kubectl get {resource} printed no row:\n{out}"))?;
    Ok((header, row))
}

/// Writes `status` through the status subresource.
async fn patch_status(
    api: &Api<DynamicObject>,
    name: &str,
    status: serde_json::Value,
) -> Result<()> {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": status })),
    )
    .await
    .with_context(|| format!("patching the status of {name}"))?;
    Ok(())
}

#[tokio::test]
async fn kubectl_prints_the_printer_columns() -> Result<()> {
    let cluster = Cluster::shared()?;
    crds::install(cluster).await?;
    let client = cluster.client().await?;
    let scope = TestScope::new(cluster, "columns")?;

    // A GpuPool from the minimal example, with a status as the operator would write it.
    let example = repo_root().join("examples/minimal-pool.yaml");
    let manifests = read_objects(&example)?;
    let pool_manifest = manifests
        .first()
        .with_context(|| format!("{} is empty", example.display()))?;
    let pool = create_scoped(&client, &scope, pool_manifest)
        .await?
        .context("creating the GpuPool")?;
    let pool_name = pool.name_any();
    let pool_gvk = GroupVersionKind::gvk("gpupool.io", "v1alpha1", "GpuPool");
    let (pool_resource, _) = discovery::pinned_kind(&client, &pool_gvk).await?;
    let pools: Api<DynamicObject> = Api::all_with(client.clone(), &pool_resource);
    let pool_status = GpuPoolStatus {
        nodes: Some("2/3".to_owned()),
        selected_nodes: 3,
        ready_nodes: 2,
        gpus: GpuCounts {
            total: 16,
            healthy: 15,
        },
        driver: Some("550.54.15".to_owned()),
        mig: MigProgress {
            summary: Some("all-1g.10gb".to_owned()),
            applied: 2,
            ..Default::default()
        },
        reclaim: ReclaimStatus {
            reclaimed: 3,
            ..Default::default()
        },
        // One word, so the row splits on whitespace.
        sharing: Some("Exclusive".to_owned()),
        conditions: vec![Condition {
            type_: "Ready".to_owned(),
            status: "True".to_owned(),
            reason: "AllNodesReady".to_owned(),
            message: "2 of 3 nodes ready".to_owned(),
            last_transition_time: Time(Timestamp::now()),
            observed_generation: None,
        }],
        ..Default::default()
    };
    patch_status(&pools, &pool_name, serde_json::to_value(&pool_status)?).await?;

    let (header, row) = kubectl_table(cluster, "gpupools", &scope)?;
    assert_eq!(
        header,
        [
            "NAME",
            "NODES",
            "GPUS",
            "HEALTHY",
            "MIG",
            "SHARING",
            "DRIVER",
            "RECLAIMED",
            "READY",
            "AGE"
        ]
    );
    assert_eq!(
        row[..9],
        [
            pool_name.as_str(),
            "2/3",
            "16",
            "15",
            "all-1g.10gb",
            "Exclusive",
            "550.54.15",
            "3",
            "True"
        ],
        "row: {row:?}"
    );

    // A GpuNode with the agent's view of a node.
    let node_name = scope.name("gpu-node");
    let mut node = GpuNode::new(
        &node_name,
        GpuNodeSpec {
            sharing: Default::default(),
            pool: pool_name.clone(),
            driver: Default::default(),
            cdi: Default::default(),
            mig: Default::default(),
            utilization: Default::default(),
        },
    );
    node.labels_mut()
        .insert(scope.label().0.to_owned(), scope.prefix().to_owned());
    scope.track_kind("gpunodes.gpupool.io");
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    gpunodes
        .create(&PostParams::default(), &node)
        .await
        .context("creating the GpuNode")?;
    let node_status = GpuNodeStatus {
        driver_version: Some("550.54.15".to_owned()),
        cuda_version: Some("12.4".to_owned()),
        gpu_count: 8,
        healthy_gpus: 7,
        validated: Some(Verdict::True),
        mig: NodeMigStatus {
            state: MigState::Applied,
            ..Default::default()
        },
        ..Default::default()
    };
    gpunodes
        .patch_status(
            &node_name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": node_status })),
        )
        .await
        .context("patching the GpuNode status")?;

    let (header, row) = kubectl_table(cluster, "gpunodes", &scope)?;
    assert_eq!(
        header,
        [
            "NAME",
            "POOL",
            "GPUS",
            "HEALTHY",
            "MIG-STATE",
            "DRIVER",
            "VALID",
            "AGE"
        ]
    );
    assert_eq!(
        row[..7],
        [
            node_name.as_str(),
            pool_name.as_str(),
            "8",
            "7",
            "Applied",
            "550.54.15",
            "True"
        ],
        "row: {row:?}"
    );

    // Short names work too.
    let short = cluster
        .kubectl()
        .run(["get", "gp", &pool_name, "-o", "name"])?;
    assert_eq!(short.trim(), format!("gpupool.gpupool.io/{pool_name}"));

    // The singular kind name resolves to one resource (the category must not shadow it),
    // so the documented `kubectl describe gpupool <name>` works; the category lists both kinds.
    let described = cluster.kubectl().run(["describe", "gpupool", &pool_name])?;
    assert!(
        described.contains(&format!("Name:         {pool_name}")),
        "describe output: {described}"
    );
    let category = cluster
        .kubectl()
        .run(["get", "gpupool-all", "-o", "name"])?;
    assert!(
        category.contains(&format!("gpupool.gpupool.io/{pool_name}"))
            && category.contains(&format!("gpunode.gpupool.io/{node_name}")),
        "category output: {category}"
    );

    gpunodes
        .delete(&node_name, &DeleteParams::default())
        .await
        .context("deleting the GpuNode")?;
    pools
        .delete(&pool_name, &DeleteParams::default())
        .await
        .context("deleting the GpuPool")?;
    Ok(())
}
