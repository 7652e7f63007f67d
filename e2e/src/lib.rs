//! End-to-end test harness for gpupool.
//!
//! It runs the tests against a real control plane — etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler, and kwok for fake GPU nodes —
//! started by the `e2e/cluster` script from binaries that
//! `e2e/tools/build.sh` builds from pinned Go modules (and caches).
//!
//! ```text
//! e2e/run-tests.sh                       # build/reuse tools, up, cargo test -p gpupool-e2e, down
//! cargo test -p gpupool-e2e              # the harness starts (and later stops) its own cluster
//! GPUPOOL_E2E_REUSE=1 KUBECONFIG=… cargo test -p gpupool-e2e   # use a running cluster
//! ```
//!
//! A test gets the shared [`Cluster`] with [`Cluster::shared`], its own
//! names and namespace with [`TestScope`], a client with
//! [`Cluster::client`], and the built kubectl with [`Cluster::kubectl`]. See
//! [`cluster`] for how the cluster is started and always torn down.

pub mod agent;
pub mod artifacts;
pub mod cluster;
pub mod crds;
pub mod images;
pub mod kubectl;
pub mod kubelet;
pub mod kueue;
pub mod manifest;
pub mod node;
pub mod plot;
pub mod prometheus;
pub mod scope;
pub mod service_relay;
pub mod tools;
pub mod wait;

pub use cluster::{Cluster, FAKE_NODE_LABEL};
pub use kubectl::Kubectl;
pub use scope::TestScope;
pub use tools::{Tools, repo_root};

/// Whether `GPUPOOL_E2E_STRICT=1`: every layer that would skip for a missing tool or machine
/// capability fails instead (CI sets it, since it installs everything the layers need).
pub fn strict() -> bool {
    std::env::var("GPUPOOL_E2E_STRICT").as_deref() == Ok("1")
}

/// A log line without its terminal colour codes: the binaries colour their logs, and tests
/// read fields such as `addr=` from them.
pub fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters, ended by a letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
