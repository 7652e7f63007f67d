//! Writes the generated CRD manifests (`crds/*.yaml`, chart CRD templates).
//!
//! `crdgen` writes them into the repository; `crdgen --check` exits 1 when a committed
//! file differs from what the types generate.

use anyhow::Context;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    // crds/ is one level below the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn main() -> anyhow::Result<()> {
    let check = std::env::args().any(|a| a == "--check");
    let root = repo_root();
    let mut stale = Vec::new();
    for file in gpupool_crds::crdgen::generated_files()? {
        let path = root.join(&file.path);
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current == file.content {
            continue;
        }
        if check {
            stale.push(file.path.display().to_string());
            continue;
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&path, &file.content)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", file.path.display());
    }
    if !stale.is_empty() {
        anyhow::bail!(
            "generated CRD files are out of date: {}; run `cargo run -p gpupool-crds --bin crdgen`",
            stale.join(", ")
        );
    }
    Ok(())
}
