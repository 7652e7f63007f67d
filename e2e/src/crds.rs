//! Installing gpupool's generated CRDs (`crds/*.yaml`) into the test cluster.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::runtime::wait::{await_condition, conditions};

use crate::cluster::Cluster;
use crate::manifest::{read_objects, yaml_files};
use crate::tools::repo_root;

/// The CRD files crdgen writes, which the tests expect.
pub const EXPECTED_CRD_FILES: [&str; 2] = ["gpupool.io_gpupools.yaml", "gpupool.io_gpunodes.yaml"];

/// How long a CRD may take to become Established.
const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(60);

/// The generated CRD files in `crds/`; an error names any expected file that
/// is missing.
pub fn crd_files() -> Result<Vec<PathBuf>> {
    let dir = repo_root().join("crds");
    let files = yaml_files(&dir)?;
    for wanted in EXPECTED_CRD_FILES {
        if !files
            .iter()
            .any(|f| f.file_name().is_some_and(|n| n == wanted))
        {
            bail!(
                "{} is missing; generate the CRDs with crdgen first",
                dir.join(wanted).display()
            );
        }
    }
    Ok(files)
}

/// Applies every CRD in `crds/` (server-side apply, idempotent, taking over fields another
/// manager holds) and waits
/// until each is Established. Returns the CRD names.
pub async fn install(cluster: &Cluster) -> Result<Vec<String>> {
    let files = crd_files()?;
    let mut names = Vec::new();
    for file in &files {
        for manifest in read_objects(file)? {
            let kind = manifest
                .object
                .types
                .as_ref()
                .map(|t| t.kind.as_str())
                .unwrap_or_default();
            if kind != "CustomResourceDefinition" {
                bail!("{} holds a {kind}, not a CRD", manifest.origin());
            }
            names.push(
                manifest
                    .object
                    .metadata
                    .name
                    .clone()
                    .with_context(|| format!("{} has no name", manifest.origin()))?,
            );
        }
        let path = file.to_string_lossy();
        // A chart test in parallel may have installed the same CRDs with helm, which then owns
        // `.spec.versions` (an atomic list the API server has defaulted): the content is the
        // same (a test fails when the chart's copy drifts), so take the fields over rather
        // than fail on the race.
        cluster.kubectl().run([
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=gpupool-e2e",
            "-f",
            path.as_ref(),
        ])?;
    }

    let client = cluster.client().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    for name in &names {
        tokio::time::timeout(
            ESTABLISH_TIMEOUT,
            await_condition(crds.clone(), name, conditions::is_crd_established()),
        )
        .await
        .with_context(|| format!("CRD {name} not Established within {ESTABLISH_TIMEOUT:?}"))?
        .with_context(|| format!("watching CRD {name}"))?;
    }
    Ok(names)
}
