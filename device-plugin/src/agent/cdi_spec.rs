//! The node's CDI spec as a job of the agent: written (atomically, only when its content
//! changes) from the inventory and the GpuNode's CDI policy, or removed when the policy turns it
//! off.

use std::path::{Path, PathBuf};

use gpupool_crds::node::CdiStatus;
use gpupool_crds::policy::CdiPolicy;

use crate::cdi::{self, CdiOptions};
use crate::inventory::Inventory;

/// The CDI spec as last written, and why it last failed.
#[derive(Debug, Default)]
pub struct CdiJob {
    /// What status reports: the spec's path, digest and device count.
    pub status: Option<CdiStatus>,
    /// Spec files written (content changes).
    pub writes: u64,
    /// Why the spec was last not written; `None` once it is.
    pub last_error: Option<String>,
}

impl CdiJob {
    /// Makes the spec under `spec_dir` (else the policy's) match `inventory`, with the driver
    /// under `driver_root` (else the policy's).
    pub fn sync(
        &mut self,
        spec_dir: Option<&Path>,
        driver_root: Option<&Path>,
        policy: &CdiPolicy,
        inventory: &Inventory,
    ) {
        let dir = spec_dir
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(&policy.spec_dir));
        if !policy.enabled {
            match cdi::remove_spec(&dir) {
                Ok(true) => tracing::info!(dir = %dir.display(), "CDI disabled: spec removed"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "removing the CDI spec"),
            }
            self.status = None;
            return;
        }
        let root = driver_root
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(&policy.driver_root));
        let result = CdiOptions::from_policy(policy)
            .and_then(|opts| cdi::generate_and_write(inventory, &root, &dir, &opts));
        match result {
            Ok(outcome) => {
                if outcome.written.changed {
                    self.writes += 1;
                    tracing::info!(path = %outcome.written.path.display(), digest = %outcome.written.digest, devices = outcome.device_names.len(), "CDI spec written");
                }
                for s in &outcome.skipped {
                    tracing::warn!(skipped = %s, "CDI device left out");
                }
                self.status = Some(CdiStatus {
                    path: outcome.written.path.display().to_string(),
                    digest: outcome.written.digest,
                    devices: outcome.device_names.len() as u32,
                });
                self.last_error = None;
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::warn!(error = %msg, "CDI spec not written");
                self.last_error = Some(msg);
            }
        }
    }
}
