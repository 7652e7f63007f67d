//! The plugin's input model: what to advertise, per resource, and how the GPUs
//! are wired to each other. Deliberately independent of the GPU backend; the
//! agent converts its inventory into these types.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use super::api::MAX_DEVICE_ID_LEN;

/// Errors from parsing the plugin's input types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A resource name that the kubelet would reject as an extended resource.
    #[error("invalid resource name {name:?}: {why}")]
    ResourceName {
        /// The rejected name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A device ID the kubelet would reject.
    #[error("invalid device ID {id:?}: {why}")]
    DeviceId {
        /// The rejected ID.
        id: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A CDI kind that is not `vendor/class`.
    #[error("invalid CDI kind {kind:?}: {why}")]
    CdiKind {
        /// The rejected kind.
        kind: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// An extended resource name such as `nvidia.com/gpu` or `nvidia.com/mig-1g.10gb`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceName(String);

impl ResourceName {
    /// The full name, e.g. `nvidia.com/gpu`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The part after the domain, e.g. `gpu` or `mig-1g.10gb`.
    pub fn short_name(&self) -> &str {
        self.0.split_once('/').map_or(self.0.as_str(), |(_, n)| n)
    }

    /// Socket file name for this resource's server: `<prefix>-<domain>-<name>.sock`.
    pub fn socket_file_name(&self, prefix: &str) -> String {
        format!("{prefix}-{}.sock", self.0.replace('/', "-"))
    }
}

impl FromStr for ResourceName {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why| ModelError::ResourceName {
            name: s.to_owned(),
            why,
        };
        let (domain, name) = s.split_once('/').ok_or(err("needs a domain prefix"))?;
        if domain.is_empty() || domain.len() > 253 {
            return Err(err("domain must be 1..=253 characters"));
        }
        if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
            return Err(err("the kubernetes.io domain is reserved"));
        }
        if !domain
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        {
            return Err(err("domain must be a lowercase DNS subdomain"));
        }
        if name.is_empty() || name.len() > 63 {
            return Err(err("name must be 1..=63 characters"));
        }
        if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
            || !name.starts_with(|c: char| c.is_ascii_alphanumeric())
            || !name.ends_with(|c: char| c.is_ascii_alphanumeric())
        {
            return Err(err("name must be alphanumeric with inner '-', '_' or '.'"));
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A device ID as the kubelet sees it: a GPU UUID (`GPU-…`) or a MIG UUID (`MIG-…`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId(String);

impl DeviceId {
    /// The ID string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for DeviceId {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why| ModelError::DeviceId {
            id: s.to_owned(),
            why,
        };
        if s.is_empty() {
            return Err(err("empty"));
        }
        if s.len() > MAX_DEVICE_ID_LEN {
            return Err(err("longer than the kubelet's 63 characters"));
        }
        if s.chars().any(|c| c.is_whitespace() || c == ',') {
            return Err(err("must not contain whitespace or ','"));
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A CDI kind, `vendor/class` (default `gpupool.io/gpu`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CdiKind(String);

impl CdiKind {
    /// The kind string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Fully qualified CDI device name `<kind>=<name>`.
    pub fn qualify(&self, device_name: &str) -> String {
        format!("{}={}", self.0, device_name)
    }
}

impl Default for CdiKind {
    fn default() -> Self {
        Self("gpupool.io/gpu".to_owned())
    }
}

impl FromStr for CdiKind {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why| ModelError::CdiKind {
            kind: s.to_owned(),
            why,
        };
        let (vendor, class) = s.split_once('/').ok_or(err("expected vendor/class"))?;
        // CDI parser rules: start with a letter, end alphanumeric, inner [A-Za-z0-9_.-].
        let valid = |part: &str| {
            part.starts_with(|c: char| c.is_ascii_alphabetic())
                && part.ends_with(|c: char| c.is_ascii_alphanumeric())
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        };
        if !valid(vendor) {
            return Err(err("vendor must start with a letter, end alphanumeric"));
        }
        if !valid(class) {
            return Err(err("class must start with a letter, end alphanumeric"));
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for CdiKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether a device may be handed out.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Health {
    /// Usable.
    #[default]
    Healthy,
    /// Not usable; `reason` says why (for logs and status).
    Unhealthy {
        /// Why the device is unhealthy.
        reason: String,
    },
}

impl Health {
    /// True when the device may be allocated.
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }
}

/// One device the plugin advertises under a resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvertisedDevice {
    /// The kubelet-facing ID (GPU or MIG UUID).
    pub id: DeviceId,
    /// The CDI device name inside our CDI kind: `0`, `0:1`, `GPU-…` or `MIG-…`.
    pub cdi_name: String,
    /// Current health.
    pub health: Health,
    /// NUMA node of the parent GPU, when the platform reports one.
    pub numa_node: Option<i64>,
    /// Index of the parent GPU (the GPU itself for whole GPUs).
    pub parent_gpu: u32,
    /// Set when this is a time-slicing replica of another device (see `plugin::sharing`).
    pub replica: Option<Replica>,
}

/// What a sharing replica (time-slicing or MPS) stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    /// The underlying device's kubelet ID.
    pub of: DeviceId,
    /// Whether a container asking for more than one replica of this resource is refused (it
    /// would get no more compute than with one).
    pub fail_requests_greater_than_one: bool,
    /// What a container given this replica needs beyond the device (MPS: the daemon's pipe
    /// directory and shared memory, the client limits); `None` for time-slicing.
    pub client: Option<Arc<ShareClient>>,
    /// How a container's replicas are chosen among the free ones.
    pub placement: Placement,
}

/// Where `GetPreferredAllocation` puts shared replicas (a preference: the kubelet picks the
/// devices, among those the scheduler left on the node).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Placement {
    /// Across devices, quietest first: fewer neighbours per pod.
    #[default]
    Spread,
    /// Onto the busiest device with room: whole GPUs stay free longer.
    Pack,
}

/// Environment and host mounts `Allocate` adds for a container given a shared device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShareClient {
    /// Environment variables, by name.
    pub envs: BTreeMap<String, String>,
    /// Host directories mounted into the container.
    pub mounts: Vec<HostMount>,
}

/// A host path mounted into a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMount {
    /// The path on the host.
    pub host_path: String,
    /// Where the container sees it.
    pub container_path: String,
    /// Read-only.
    pub read_only: bool,
}

impl AdvertisedDevice {
    /// The device this one is (itself, or the device a replica shares).
    pub fn underlying(&self) -> &DeviceId {
        self.replica.as_ref().map_or(&self.id, |r| &r.of)
    }
}

/// How two GPUs are connected, best first when compared with [`LinkKind::rank`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkKind {
    /// NVLink with this many links between the two GPUs.
    NvLink(u32),
    /// Behind the same PCIe switch.
    SamePcieSwitch,
    /// Same NUMA node (host bridge), no closer link.
    SameNuma,
    /// Across NUMA nodes / the CPU interconnect.
    Cross,
}

/// Pairwise links between GPUs (by GPU index). Missing pairs are `Cross`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    links: BTreeMap<(u32, u32), LinkKind>,
}

impl Topology {
    /// An empty topology: every pair is `Cross`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the link between GPUs `a` and `b` (symmetric).
    pub fn set_link(&mut self, a: u32, b: u32, kind: LinkKind) {
        self.links.insert(Self::key(a, b), kind);
    }

    /// Builder form of [`Topology::set_link`].
    pub fn with_link(mut self, a: u32, b: u32, kind: LinkKind) -> Self {
        self.set_link(a, b, kind);
        self
    }

    /// The link between two different GPUs (`None` for `a == b`).
    pub fn link(&self, a: u32, b: u32) -> Option<LinkKind> {
        if a == b {
            return None;
        }
        Some(
            self.links
                .get(&Self::key(a, b))
                .copied()
                .unwrap_or(LinkKind::Cross),
        )
    }

    fn key(a: u32, b: u32) -> (u32, u32) {
        if a <= b { (a, b) } else { (b, a) }
    }
}

/// Everything the plugin advertises on this node: devices per resource, and the
/// GPU topology used for preferred allocations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Advertisement {
    /// Devices per resource name.
    pub resources: BTreeMap<ResourceName, Vec<AdvertisedDevice>>,
    /// Links between the GPUs named by `AdvertisedDevice::parent_gpu`.
    pub topology: Arc<Topology>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_names() {
        let cases = [
            ("nvidia.com/gpu", true),
            ("nvidia.com/mig-1g.10gb", true),
            ("gpu", false),
            ("/gpu", false),
            ("nvidia.com/", false),
            ("kubernetes.io/gpu", false),
            ("Nvidia.com/gpu", false),
            ("nvidia.com/-gpu", false),
        ];
        for (name, ok) in cases {
            assert_eq!(name.parse::<ResourceName>().is_ok(), ok, "{name}");
        }
        let r: ResourceName = "nvidia.com/mig-1g.10gb".parse().unwrap();
        assert_eq!(r.short_name(), "mig-1g.10gb");
        assert_eq!(
            r.socket_file_name("gpupool"),
            "gpupool-nvidia.com-mig-1g.10gb.sock"
        );
    }

    #[test]
    fn device_ids() {
        assert!(
            "GPU-fef8089b-4820-abfc-e83e-94318197576e"
                .parse::<DeviceId>()
                .is_ok()
        );
        assert!("".parse::<DeviceId>().is_err());
        assert!("a,b".parse::<DeviceId>().is_err());
        assert!("x".repeat(64).parse::<DeviceId>().is_err());
    }

    #[test]
    fn cdi_kinds() {
        assert_eq!(CdiKind::default().qualify("0:1"), "gpupool.io/gpu=0:1");
        assert!("nvidia.com/gpu".parse::<CdiKind>().is_ok());
        assert!("gpu".parse::<CdiKind>().is_err());
        assert!("1vendor/gpu".parse::<CdiKind>().is_err());
        assert!("vendor/gpu-".parse::<CdiKind>().is_err());
    }

    #[test]
    fn topology_is_symmetric_and_defaults_to_cross() {
        let t = Topology::new().with_link(1, 0, LinkKind::NvLink(12));
        assert_eq!(t.link(0, 1), Some(LinkKind::NvLink(12)));
        assert_eq!(t.link(1, 0), Some(LinkKind::NvLink(12)));
        assert_eq!(t.link(0, 2), Some(LinkKind::Cross));
        assert_eq!(t.link(3, 3), None);
    }
}
