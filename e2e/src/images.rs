//! The project's images, as `images/build.sh` makes them, in the real node's containerd.
//!
//! Release builds are too slow for CI, so the images here carry the debug binaries the
//! suite already built (`images/build.sh --binaries`, debug info stripped) on the same base
//! and layout as the released ones, under the names and tag the chart deploys by default.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};

use crate::artifacts::{agent_binary, operator_binary};
use crate::kubelet::RealKubelet;
use crate::repo_root;

/// Builds both images under `work` and imports them into `kubelet`'s containerd (namespace
/// `k8s.io`, where the kubelet's pods find them). Returns the archives.
pub fn build_and_import(kubelet: &RealKubelet, work: &Path) -> Result<Vec<PathBuf>> {
    let ctr = kubelet
        .ctr
        .as_ref()
        .context("images are imported into containerd only")?;
    let bin = work.join("bin");
    let out = work.join("images");
    let _ = fs::remove_dir_all(&bin);
    fs::create_dir_all(&bin)?;
    for (from, name) in [
        (operator_binary()?, "gpupool-operator"),
        (agent_binary()?, "gpupool-device-plugin"),
    ] {
        fs::copy(&from, bin.join(name))
            .with_context(|| format!("copying {} into {}", from.display(), bin.display()))?;
    }
    let started = std::time::Instant::now();
    let build = Command::new(repo_root().join("images/build.sh"))
        .arg("--binaries")
        .arg(&bin)
        .arg("--out")
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .context("running images/build.sh")?;
    ensure!(
        build.status.success(),
        "images/build.sh --binaries {} failed ({}):\n{}",
        bin.display(),
        build.status,
        String::from_utf8_lossy(&build.stderr)
    );
    let archives: Vec<PathBuf> = String::from_utf8_lossy(&build.stdout)
        .lines()
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .collect();
    ensure!(
        archives.len() == 2,
        "images/build.sh named {} archives, want 2:\n{}",
        archives.len(),
        String::from_utf8_lossy(&build.stdout)
    );
    eprintln!(
        "e2e: images built in {:.1}s: {}",
        started.elapsed().as_secs_f64(),
        archives
            .iter()
            .map(|a| a.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for archive in &archives {
        let import = Command::new(ctr)
            .arg("--address")
            .arg(&kubelet.cri_socket)
            .args(["-n", "k8s.io", "images", "import"])
            .arg(archive)
            .stdin(Stdio::null())
            .output()
            .context("running ctr images import")?;
        ensure!(
            import.status.success(),
            "ctr images import {} failed ({}):\n{}",
            archive.display(),
            import.status,
            String::from_utf8_lossy(&import.stderr)
        );
    }
    let _ = fs::remove_dir_all(&bin);
    Ok(archives)
}
