//! Per-test names and namespaces, so tests sharing a cluster never collide.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Result, bail};

use crate::cluster::Cluster;

/// Objects a test creates carry this label with the test's prefix as value,
/// so whatever it leaves behind can be found and deleted.
pub const SCOPE_LABEL: &str = "e2e.gpupool.io/scope";

/// A test's own name prefix and namespace. Dropping it deletes the namespace
/// and every cluster-scoped object recorded with [`TestScope::track_kind`]
/// that carries the scope label.
#[derive(Debug)]
pub struct TestScope {
    cluster: &'static Cluster,
    prefix: String,
    namespace: String,
    cluster_kinds: Mutex<BTreeSet<String>>,
}

impl TestScope {
    /// A fresh scope for the test `test`: prefix `<test>-<unique>` and a
    /// namespace of the same name, created now.
    pub fn new(cluster: &'static Cluster, test: &str) -> Result<Self> {
        let prefix = unique_prefix(test)?;
        let kubectl = cluster.kubectl();
        kubectl.run(["create", "namespace", &prefix])?;
        kubectl.run([
            "label",
            "namespace",
            &prefix,
            &format!("{SCOPE_LABEL}={prefix}"),
        ])?;
        Ok(Self {
            cluster,
            namespace: prefix.clone(),
            prefix,
            cluster_kinds: Mutex::new(BTreeSet::new()),
        })
    }

    /// The unique prefix, e.g. `examples-1a2b3c`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A short directory of this test's own, `<tmp>/gpupool-e2e/<unique part of the prefix>`,
    /// for what holds unix sockets (a fake node's kubelet directory): a socket path must fit the
    /// 108 bytes of `sun_path`, which a path under a deep checkout's `target/` can exceed.
    pub fn socket_dir(&self) -> PathBuf {
        short_dir(&self.prefix)
    }

    /// The test's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// `<prefix>-<name>`: a name no other test uses.
    pub fn name(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    /// The label (key, value) to put on every object the test creates.
    pub fn label(&self) -> (&'static str, &str) {
        (SCOPE_LABEL, &self.prefix)
    }

    /// A label selector matching this test's objects.
    pub fn selector(&self) -> String {
        format!("{SCOPE_LABEL}={}", self.prefix)
    }

    /// Records a cluster-scoped resource type (e.g. `gpupools.gpupool.io`) in
    /// which the test creates labelled objects, for cleanup on drop.
    pub fn track_kind(&self, resource: &str) {
        if let Ok(mut kinds) = self.cluster_kinds.lock() {
            kinds.insert(resource.to_owned());
        }
    }
}

impl Drop for TestScope {
    fn drop(&mut self) {
        let kubectl = self.cluster.kubectl();
        let kinds: Vec<String> = self
            .cluster_kinds
            .lock()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default();
        if !kinds.is_empty() {
            let selector = self.selector();
            let mut args = vec!["delete".to_owned(), kinds.join(",")];
            args.extend([
                "-l".to_owned(),
                selector,
                "--ignore-not-found".to_owned(),
                "--wait=false".to_owned(),
            ]);
            if let Err(e) = kubectl.run(&args) {
                eprintln!("e2e: cleanup of {}: {e:#}", self.prefix);
            }
        }
        if let Err(e) = kubectl.run([
            "delete",
            "namespace",
            &self.namespace,
            "--ignore-not-found",
            "--wait=false",
        ]) {
            eprintln!("e2e: deleting namespace {}: {e:#}", self.namespace);
        }
    }
}

/// `<test>-<6 hex digits>`, lowercase and short enough that `<prefix>-<name>`
/// stays a valid DNS label for reasonable names.
fn short_dir(prefix: &str) -> PathBuf {
    let unique = prefix.rsplit('-').next().unwrap_or(prefix);
    std::env::temp_dir().join("gpupool-e2e").join(unique)
}

fn unique_prefix(test: &str) -> Result<String> {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let base: String = test
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect::<String>()
        .trim_matches('-')
        .chars()
        .take(30)
        .collect();
    if base.is_empty() {
        bail!("test name {test:?} has no usable characters for a prefix");
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mix = (std::process::id().wrapping_mul(2_654_435_761)) ^ nanos ^ n.wrapping_mul(40_503);
    Ok(format!(
        "{}-{:06x}",
        base.trim_end_matches('-'),
        mix & 0xff_ffff
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_dirs_leave_room_for_the_longest_plugin_socket() {
        let prefix = unique_prefix("a test name long enough to be cut at thirty chars").unwrap();
        let socket = short_dir(&prefix)
            .join("kubelet/device-plugins")
            .join("gpupool-nvidia.com-mig-4g.40gb+me.sock");
        let len = socket.as_os_str().len();
        assert!(len < 108, "{} is {len} bytes", socket.display());
        assert!(short_dir(&prefix).ends_with(prefix.rsplit('-').next().unwrap()));
    }

    #[test]
    fn prefixes_are_dns_labels_and_unique() {
        let a = unique_prefix("Invalid_GpuPools are rejected").unwrap();
        let b = unique_prefix("Invalid_GpuPools are rejected").unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with("invalid-gpupools-are-rejected-"), "{a}");
        assert!(a.len() <= 37, "{a}");
        assert!(
            a.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
    }

    #[test]
    fn empty_test_names_are_refused() {
        assert!(unique_prefix("__").is_err());
    }
}
