//! The node: a fixture resolved into GPUs, with UUIDs, bus IDs and topology.

use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use crate::error::{SimError, SimResult};
use crate::fixture::{DeviceNodes, Fixture};
use crate::models::{MODEL_INFOS, ModelInfo, model_info};

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct SimGpu {
    /// Index (NVML enumeration order).
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Model facts.
    pub model: &'static ModelInfo,
    /// PCI bus ID, `00000000:BB:DD.F`.
    pub pci_bus_id: String,
    /// Minor number of `/dev/nvidiaN`.
    pub minor: u32,
    /// NUMA node.
    pub numa_node: u32,
    /// Whether MIG mode is on at boot.
    pub mig_enabled_at_boot: bool,
    /// Temperature when no fault says otherwise.
    pub temperature_c: u32,
    /// Whether persistence mode is on.
    pub persistence_mode: bool,
}

/// A fixture resolved into GPUs; immutable.
#[derive(Debug, Clone)]
pub struct Node {
    /// The fixture it came from.
    pub fixture: Fixture,
    /// The GPUs, by index.
    pub gpus: Vec<SimGpu>,
}

/// A deterministic 128-bit hash (two FNV-1a 64 lanes), for generated UUIDs.
fn hash128(parts: &[&str]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (lane, seed) in [0xcbf2_9ce4_8422_2325u64, 0x8422_2325_cbf2_9ce4u64]
        .into_iter()
        .enumerate()
    {
        let mut h = seed;
        for part in parts {
            for b in part.bytes().chain(std::iter::once(0xff)) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        out[lane * 8..lane * 8 + 8].copy_from_slice(&h.to_be_bytes());
    }
    out
}

fn uuid_text(prefix: &str, bytes: [u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{prefix}-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The UUID a MIG device gets: stable for (parent, GI, CI), as hardware keeps it while the
/// instances exist.
pub fn mig_uuid(parent_uuid: &str, gi: u32, ci: u32) -> String {
    uuid_text(
        "MIG",
        hash128(&[parent_uuid, &gi.to_string(), &ci.to_string()]),
    )
}

/// PCI buses of a DGX-style board, used for generated bus IDs.
const DGX_BUSES: &[u32] = &[0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb];

impl Node {
    /// Reads and resolves a fixture file.
    pub fn load(path: &Path) -> SimResult<Node> {
        let text = fs::read_to_string(path)
            .map_err(|e| SimError::Fixture(format!("reading fixture {}: {e}", path.display())))?;
        let fixture: Fixture = serde_yaml::from_str(&text)
            .map_err(|e| SimError::Fixture(format!("parsing fixture {}: {e}", path.display())))?;
        Node::new(fixture)
            .map_err(|e| SimError::Fixture(format!("fixture {}: {e}", path.display())))
    }

    /// Resolves a fixture: models, UUIDs, bus IDs; checks indices in faults and topology.
    pub fn new(fixture: Fixture) -> SimResult<Node> {
        let bad = |m: String| SimError::Fixture(m);
        let mut gpus = Vec::new();
        for group in &fixture.gpus {
            let model = model_info(&group.model).ok_or_else(|| {
                bad(format!(
                    "unknown GPU model {:?}; known: {}",
                    group.model,
                    MODEL_INFOS
                        .iter()
                        .map(|m| m.key)
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            for n in 0..group.count {
                let index = gpus.len() as u32;
                let uuid = match group.uuids.get(n as usize) {
                    Some(u) if u.starts_with("GPU-") => u.clone(),
                    Some(u) => return Err(bad(format!("GPU UUID {u:?} does not start with GPU-"))),
                    None => uuid_text("GPU", hash128(&[&fixture.node, &index.to_string()])),
                };
                let pci_bus_id = match group.pci_bus_ids.get(n as usize) {
                    Some(b) => b.clone(),
                    None => {
                        let bus = DGX_BUSES
                            .get(index as usize)
                            .copied()
                            .unwrap_or(0x10 + index * 8);
                        format!("00000000:{bus:02X}:00.0")
                    }
                };
                if group.mig_enabled && model.mig_catalog.is_none() {
                    return Err(bad(format!("{} is not MIG-capable", model.key)));
                }
                gpus.push(SimGpu {
                    index,
                    uuid,
                    model,
                    pci_bus_id,
                    minor: index,
                    numa_node: fixture
                        .topology
                        .numa_nodes
                        .get(index as usize)
                        .copied()
                        .unwrap_or(0),
                    mig_enabled_at_boot: group.mig_enabled,
                    temperature_c: group.temperature_c,
                    persistence_mode: group.persistence_mode,
                });
            }
        }
        let count = gpus.len() as u32;
        let check = |what: &str, i: u32| {
            if i < count {
                Ok(())
            } else {
                Err(bad(format!(
                    "{what} names GPU {i}; the fixture has {count}"
                )))
            }
        };
        for f in &fixture.faults {
            check("a fault", f.gpu)?;
        }
        for u in &fixture.utilization {
            check("a utilization trace", u.gpu)?;
        }
        for group in fixture
            .topology
            .nvlink
            .iter()
            .chain(&fixture.topology.pcie_switches)
        {
            for &i in group {
                check("the topology", i)?;
            }
        }
        let mut uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
        uuids.sort();
        uuids.dedup();
        if uuids.len() != gpus.len() {
            return Err(bad("two GPUs share a UUID".to_owned()));
        }
        Ok(Node { fixture, gpus })
    }

    /// The GPU at `index`.
    pub fn gpu(&self, index: u32) -> SimResult<&SimGpu> {
        self.gpus
            .get(index as usize)
            .ok_or_else(|| SimError::InvalidArgument(format!("no GPU with index {index}")))
    }

    /// The GPU with this UUID.
    pub fn gpu_by_uuid(&self, uuid: &str) -> SimResult<&SimGpu> {
        self.gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .ok_or_else(|| SimError::NotFound(format!("no GPU with UUID {uuid}")))
    }

    /// Indices of the GPUs a process sees, in enumeration order, under the fixture's
    /// [`DeviceNodes`] rule with device nodes under `dev_dir` (normally `/dev`).
    pub fn visible_gpus(&self, dev_dir: &Path) -> Vec<u32> {
        self.gpus
            .iter()
            .filter(|g| {
                let node = dev_dir.join(format!("nvidia{}", g.minor));
                match self.fixture.device_nodes {
                    DeviceNodes::Ignored => true,
                    // Follows symlinks, as open(2) would.
                    DeviceNodes::Files => node.exists(),
                    DeviceNodes::CharDevices => {
                        fs::metadata(&node).is_ok_and(|m| m.file_type().is_char_device())
                    }
                }
            })
            .map(|g| g.index)
            .collect()
    }

    /// Whether two GPUs share an NVLink group.
    pub fn nvlink(&self, a: u32, b: u32) -> bool {
        a != b
            && self
                .fixture
                .topology
                .nvlink
                .iter()
                .any(|g| g.contains(&a) && g.contains(&b))
    }

    /// The NVML topology level (`nvmlGpuTopologyLevel_t`) of the closest common ancestor.
    pub fn topology_level(&self, a: u32, b: u32) -> SimResult<u32> {
        let (ga, gb) = (self.gpu(a)?, self.gpu(b)?);
        Ok(if a == b {
            topology::INTERNAL
        } else if self
            .fixture
            .topology
            .pcie_switches
            .iter()
            .any(|g| g.contains(&a) && g.contains(&b))
        {
            topology::SINGLE
        } else if ga.numa_node == gb.numa_node {
            topology::NODE
        } else {
            topology::SYSTEM
        })
    }
}

/// NVML `nvmlGpuTopologyLevel_t` values.
pub mod topology {
    /// Same board.
    pub const INTERNAL: u32 = 0;
    /// One PCIe switch.
    pub const SINGLE: u32 = 10;
    /// Several PCIe switches, no host bridge.
    pub const MULTIPLE: u32 = 20;
    /// One host bridge.
    pub const HOSTBRIDGE: u32 = 30;
    /// One NUMA node.
    pub const NODE: u32 = 40;
    /// Across NUMA nodes (SMP interconnect).
    pub const SYSTEM: u32 = 50;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A fresh device directory for one test, removed when dropped.
    struct DevDir(PathBuf);

    impl DevDir {
        fn new(name: &str) -> DevDir {
            let dir =
                std::env::temp_dir().join(format!("gpupool-sim-dev-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            DevDir(dir)
        }
    }

    impl Drop for DevDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn node(device_nodes: &str) -> Node {
        let yaml = format!(
            "driver: {{version: \"550.54.15\", cuda: \"12.4\"}}\n\
             gpus: [{{model: L4, count: 4}}]\n{device_nodes}"
        );
        Node::new(serde_yaml::from_str(&yaml).unwrap()).unwrap()
    }

    #[test]
    fn visible_gpus_follow_the_device_nodes_rule() {
        let dev = DevDir::new("rule");
        // Plain files for GPUs 1 and 3, a directory where GPU 2's node would be.
        fs::write(dev.0.join("nvidia1"), "").unwrap();
        fs::write(dev.0.join("nvidia3"), "").unwrap();
        fs::create_dir(dev.0.join("nvidia2")).unwrap();
        let cases: [(&str, Vec<u32>); 4] = [
            ("", vec![]),
            ("device_nodes: char_devices\n", vec![]),
            ("device_nodes: files\n", vec![1, 2, 3]),
            ("device_nodes: ignored\n", vec![0, 1, 2, 3]),
        ];
        for (rule, want) in cases {
            assert_eq!(node(rule).visible_gpus(&dev.0), want, "{rule:?}");
        }
    }

    #[test]
    fn a_missing_dev_dir_shows_no_gpus_unless_ignored() {
        let missing = Path::new("/nonexistent/gpupool-sim-dev");
        assert!(node("").visible_gpus(missing).is_empty());
        assert_eq!(
            node("device_nodes: ignored\n").visible_gpus(missing).len(),
            4
        );
    }

    #[test]
    fn character_devices_count_by_default() {
        // /dev/null is a character device everywhere; a symlink named nvidia2 points at it.
        let dev = DevDir::new("chr");
        std::os::unix::fs::symlink("/dev/null", dev.0.join("nvidia2")).unwrap();
        fs::write(dev.0.join("nvidia0"), "").unwrap();
        assert_eq!(node("").visible_gpus(&dev.0), vec![2]);
    }

    #[test]
    fn an_unknown_rule_is_an_error() {
        let yaml =
            "driver: {version: \"550.54.15\", cuda: \"12.4\"}\ngpus: []\ndevice_nodes: some\n";
        assert!(serde_yaml::from_str::<Fixture>(yaml).is_err());
    }
}
