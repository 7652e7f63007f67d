//! Driver validation: the checks a GpuNode's driver policy asks for, each reported as
//! `{name, passed, message}`.
//!
//! [`observe`] gathers facts from NVML and the host (I/O); [`run_checks`] judges them against
//! the policy (pure, table-tested).

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use gpupool_crds::node::CheckResult;
use gpupool_crds::policy::{DriverCheck, DriverPolicy};

use crate::backend::{CudaVersion, DriverInfo, GpuBackend, HealthSnapshot};
use crate::kmsg::{self, Attributed, KernelLog, KmsgError, PciAddress};
use crate::xid::is_fatal as is_fatal_xid;

/// The minimum Linux driver of each CUDA toolkit release (major, minor, driver), from the
/// "CUDA Toolkit and Corresponding Driver Versions" table of NVIDIA's CUDA Toolkit release
/// notes (<https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html>, table 3,
/// "Toolkit Driver Version", Linux x86_64, GA release of each minor version).
pub const CUDA_MIN_DRIVER: &[(u32, u32, &str)] = &[
    (11, 0, "450.36.06"),
    (11, 1, "455.23.05"),
    (11, 2, "460.27.03"),
    (11, 3, "465.19.01"),
    (11, 4, "470.42.01"),
    (11, 5, "495.29.05"),
    (11, 6, "510.39.01"),
    (11, 7, "515.43.04"),
    (11, 8, "520.61.05"),
    (12, 0, "525.60.13"),
    (12, 1, "530.30.02"),
    (12, 2, "535.54.03"),
    (12, 3, "545.23.06"),
    (12, 4, "550.54.14"),
    (12, 5, "555.42.02"),
    (12, 6, "560.28.03"),
    (12, 8, "570.26"),
    (12, 9, "575.51.03"),
    (13, 0, "580.65.06"),
];

/// The lowest driver that supports `cuda`: the entry for the first release at or above it.
pub fn min_driver_for_cuda(cuda: CudaVersion) -> Option<&'static str> {
    CUDA_MIN_DRIVER
        .iter()
        .find(|(major, minor, _)| (*major, *minor) >= (cuda.major, cuda.minor))
        .map(|(_, _, driver)| *driver)
}

/// Compares dot-separated version numbers numerically (`550.54.15` > `535.104.05`); missing
/// parts count as 0. `None` when either is not numeric.
pub fn compare_versions(a: &str, b: &str) -> Option<Ordering> {
    let parse = |s: &str| -> Option<Vec<u64>> {
        s.trim().split('.').map(|p| p.parse::<u64>().ok()).collect()
    };
    let (mut a, mut b) = (parse(a)?, parse(b)?);
    let len = a.len().max(b.len());
    a.resize(len, 0);
    b.resize(len, 0);
    Some(a.cmp(&b))
}

/// Whether the kernel log was read for Xids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KernelLogRead {
    /// No kernel log was scanned.
    #[default]
    NotScanned,
    /// Read from this path: Xids since boot count (as far back as the ring buffer holds).
    Read(PathBuf),
    /// This path could not be read: only Xids since the agent started count.
    Unreadable {
        /// The kernel log path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// The fatal Xids the `XidErrors` check judges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct XidObservations {
    /// (GPU, Xid), sorted and without repeats: NVML events since the agent started and kernel
    /// log records since boot.
    pub fatal: Vec<(u32, u64)>,
    /// (address, Xid) the kernel logged where no enumerated GPU is.
    pub unattributed: Vec<(PciAddress, u64)>,
    /// Whether the kernel log was read.
    pub kernel_log: KernelLogRead,
}

impl XidObservations {
    /// Combines the Xids of NVML events (`(GPU, Xid)`) with those of the kernel log, keeping
    /// the fatal ones, each once: an Xid after the agent started shows in both.
    pub fn combine(
        events: &[(u32, u64)],
        kernel: &Attributed,
        kernel_log: KernelLogRead,
    ) -> XidObservations {
        let mut fatal: Vec<(u32, u64)> = events
            .iter()
            .chain(&kernel.on_gpus)
            .copied()
            .filter(|(_, xid)| is_fatal_xid(*xid))
            .collect();
        fatal.sort_unstable();
        fatal.dedup();
        let mut unattributed: Vec<(PciAddress, u64)> = kernel
            .elsewhere
            .iter()
            .copied()
            .filter(|(_, xid)| is_fatal_xid(*xid))
            .collect();
        unattributed.sort_unstable();
        unattributed.dedup();
        XidObservations {
            fatal,
            unattributed,
            kernel_log,
        }
    }
}

/// The fatal Xids the agent has seen, from NVML events and from the kernel log: what the
/// `XidErrors` check judges. Each (GPU, Xid) and (address, Xid) is kept once.
#[derive(Debug)]
pub struct XidLedger {
    events: BTreeSet<(u32, u64)>,
    kernel: BTreeSet<(PciAddress, u64)>,
    log: KernelLog,
    kernel_log: KernelLogRead,
}

impl XidLedger {
    /// A ledger that scans the kernel log at `kmsg_path`.
    pub fn new(kmsg_path: impl Into<PathBuf>) -> XidLedger {
        XidLedger {
            events: BTreeSet::new(),
            kernel: BTreeSet::new(),
            log: KernelLog::new(kmsg_path),
            kernel_log: KernelLogRead::NotScanned,
        }
    }

    /// Records the Xid of an NVML event; one that is not fatal is left out.
    pub fn record_event(&mut self, gpu: u32, xid: u64) {
        if is_fatal_xid(xid) {
            self.events.insert((gpu, xid));
        }
    }

    /// Reads the kernel log records that arrived since the last scan (all of them, the first
    /// time) and keeps their fatal Xids. Returns how many Xid records it found. Reads never
    /// wait (the log is opened non-blocking), but this is file I/O: async callers use
    /// `spawn_blocking`.
    pub fn scan_kernel_log(&mut self) -> Result<usize, KmsgError> {
        let path = self.log.path().to_path_buf();
        match self.log.scan() {
            Ok(found) => {
                self.kernel.extend(
                    found
                        .iter()
                        .filter(|x| is_fatal_xid(x.xid))
                        .map(|x| (x.pci, x.xid)),
                );
                self.kernel_log = KernelLogRead::Read(path);
                Ok(found.len())
            }
            Err(e) => {
                self.kernel_log = KernelLogRead::Unreadable {
                    path,
                    reason: e.io_error().to_string(),
                };
                Err(e)
            }
        }
    }

    /// How the last kernel-log scan went.
    pub fn kernel_log(&self) -> &KernelLogRead {
        &self.kernel_log
    }

    /// The Xids for the check, kernel-log ones attributed to GPUs by bus ID (`(index, bus ID)`
    /// of each GPU the backend enumerates).
    pub fn observations(&self, gpus: &[(u32, String)]) -> XidObservations {
        let events: Vec<(u32, u64)> = self.events.iter().copied().collect();
        let kernel = kmsg::attribute(self.kernel.iter().copied(), gpus);
        XidObservations::combine(&events, &kernel, self.kernel_log.clone())
    }
}

/// Everything the checks look at.
#[derive(Debug, Clone, PartialEq)]
pub struct Observations {
    /// NVML's driver info, or why NVML failed.
    pub nvml: Result<DriverInfo, String>,
    /// First line of `/proc/driver/nvidia/version`, when it exists.
    pub kernel_module: Option<String>,
    /// Device nodes that should exist under the driver root but do not.
    pub missing_device_nodes: Vec<String>,
    /// Health counters per GPU index (or why they could not be read).
    pub health: BTreeMap<u32, Result<HealthSnapshot, String>>,
    /// Fatal Xids.
    pub xids: XidObservations,
    /// Persistence mode per GPU index: on, off, or why it could not be read.
    pub persistence: BTreeMap<u32, Result<bool, String>>,
}

fn check(name: &str, passed: bool, message: impl Into<String>) -> CheckResult {
    CheckResult {
        name: name.into(),
        passed,
        message: message.into(),
    }
}

/// Judges the observations against the policy. `DriverVersion` and `CUDAVersion` are added
/// when the policy sets `minVersion` / `cudaVersion`; the rest as `checks` lists them.
pub fn run_checks(policy: &DriverPolicy, obs: &Observations) -> Vec<CheckResult> {
    let mut out = Vec::new();
    let mut wanted = policy.checks.clone();
    wanted.sort();
    wanted.dedup();
    if wanted.contains(&DriverCheck::NvmlInit)
        || policy.min_version.is_some()
        || policy.cuda_version.is_some()
    {
        out.push(match &obs.nvml {
            Ok(d) => check(
                "NVMLInit",
                true,
                format!("NVML initialised: driver {}, CUDA {}", d.driver_version, d.cuda_version),
            ),
            Err(e) => check(
                "NVMLInit",
                false,
                format!("NVML did not initialise: {e}; check that the NVIDIA driver is installed and loaded"),
            ),
        });
    }
    if let Some(min) = &policy.min_version {
        out.push(match &obs.nvml {
            Err(_) => check(
                "DriverVersion",
                false,
                format!("driver version unknown (NVML failed); pool requires ≥ {min}"),
            ),
            Ok(d) => match compare_versions(&d.driver_version, min) {
                Some(Ordering::Less) => check(
                    "DriverVersion",
                    false,
                    format!(
                        "driver {} is older than the pool's minimum {min}: upgrade the driver",
                        d.driver_version
                    ),
                ),
                Some(_) => check(
                    "DriverVersion",
                    true,
                    format!("driver {} ≥ {min}", d.driver_version),
                ),
                None => check(
                    "DriverVersion",
                    false,
                    format!(
                        "cannot compare driver version {:?} with {min:?}",
                        d.driver_version
                    ),
                ),
            },
        });
    }
    if let Some(wanted_cuda) = &policy.cuda_version {
        out.push(match (&obs.nvml, wanted_cuda.parse::<CudaVersion>()) {
            (_, Err(e)) => check(
                "CUDAVersion",
                false,
                format!("pool's cudaVersion is not valid: {e}"),
            ),
            (Err(_), Ok(w)) => check(
                "CUDAVersion",
                false,
                format!("CUDA version unknown (NVML failed); pool requires {w}"),
            ),
            (Ok(d), Ok(w)) if d.cuda_version >= w => check(
                "CUDAVersion",
                true,
                format!(
                    "driver {} supports CUDA {}; pool requires {w}",
                    d.driver_version, d.cuda_version
                ),
            ),
            (Ok(d), Ok(w)) => {
                let advice = match min_driver_for_cuda(w) {
                    Some(min) => format!("upgrade the driver to ≥ {min}"),
                    None => "upgrade the driver to one that supports it".to_owned(),
                };
                check(
                    "CUDAVersion",
                    false,
                    format!(
                        "driver {} supports CUDA {}; pool requires {w}: {advice}",
                        d.driver_version, d.cuda_version
                    ),
                )
            }
        });
    }
    for c in wanted {
        match c {
            DriverCheck::NvmlInit => {}
            DriverCheck::KernelModule => out.push(match &obs.kernel_module {
                Some(line) => check(
                    "KernelModule",
                    true,
                    format!("nvidia kernel module loaded: {line}"),
                ),
                None => check(
                    "KernelModule",
                    false,
                    "/proc/driver/nvidia/version not found: the nvidia kernel module is not loaded",
                ),
            }),
            DriverCheck::DeviceNodes => out.push(if obs.missing_device_nodes.is_empty() {
                check("DeviceNodes", true, "all device nodes present")
            } else {
                check(
                    "DeviceNodes",
                    false,
                    format!(
                        "missing under the driver root: {}",
                        obs.missing_device_nodes.join(", ")
                    ),
                )
            }),
            DriverCheck::EccErrors => {
                let bad: Vec<String> = obs
                    .health
                    .iter()
                    .filter_map(|(gpu, h)| match h {
                        Ok(h) => h
                            .ecc_uncorrected
                            .filter(|n| *n > 0)
                            .map(|n| format!("GPU {gpu}: {n}")),
                        Err(e) => Some(format!("GPU {gpu}: unreadable ({e})")),
                    })
                    .collect();
                out.push(if bad.is_empty() {
                    check("ECCErrors", true, "no uncorrected ECC errors")
                } else {
                    check(
                        "ECCErrors",
                        false,
                        format!("uncorrected ECC errors: {}", bad.join("; ")),
                    )
                });
            }
            DriverCheck::PcieReplay => {
                let threshold = u64::from(policy.pcie_replay_threshold);
                let bad: Vec<String> = obs
                    .health
                    .iter()
                    .filter_map(|(gpu, h)| match h {
                        Ok(h) => h
                            .pcie_replay
                            .filter(|n| *n >= threshold)
                            .map(|n| format!("GPU {gpu}: {n}")),
                        Err(_) => None,
                    })
                    .collect();
                out.push(if bad.is_empty() {
                    check(
                        "PCIeReplay",
                        true,
                        format!("PCIe replay counters below {threshold}"),
                    )
                } else {
                    check(
                        "PCIeReplay",
                        false,
                        format!(
                            "PCIe replay counter at or above {threshold}: {}",
                            bad.join("; ")
                        ),
                    )
                });
            }
            DriverCheck::XidErrors => out.push(xid_check(&obs.xids)),
            DriverCheck::PersistenceMode => out.push(persistence_check(&obs.persistence)),
        }
    }
    out
}

fn xid_check(xids: &XidObservations) -> CheckResult {
    let scope = match &xids.kernel_log {
        KernelLogRead::Read(path) => {
            format!("since boot (kernel log {}, NVML events)", path.display())
        }
        KernelLogRead::Unreadable { path, reason } => format!(
            "since the agent started; kernel log not readable at {} ({reason}): only Xids since \
             agent start are counted",
            path.display()
        ),
        KernelLogRead::NotScanned => "since the agent started (kernel log not scanned)".to_owned(),
    };
    let list: Vec<String> = xids
        .fatal
        .iter()
        .map(|(g, x)| format!("GPU {g}: Xid {x}"))
        .chain(
            xids.unattributed
                .iter()
                .map(|(pci, x)| format!("PCI {pci} (no GPU enumerated there): Xid {x}")),
        )
        .collect();
    if list.is_empty() {
        check("XidErrors", true, format!("no fatal Xid errors {scope}"))
    } else {
        check(
            "XidErrors",
            false,
            format!("fatal Xid errors {scope}: {}", list.join("; ")),
        )
    }
}

fn persistence_check(persistence: &BTreeMap<u32, Result<bool, String>>) -> CheckResult {
    let with_mode = |mode: bool| -> Vec<String> {
        persistence
            .iter()
            .filter(|(_, p)| p.as_ref().is_ok_and(|on| *on == mode))
            .map(|(gpu, _)| gpu.to_string())
            .collect()
    };
    let (on, off) = (with_mode(true), with_mode(false));
    let unreadable: Vec<String> = persistence
        .iter()
        .filter_map(|(gpu, p)| p.as_ref().err().map(|e| format!("GPU {gpu}: {e}")))
        .collect();
    let not_read = if unreadable.is_empty() {
        String::new()
    } else {
        format!("; not readable, so not checked: {}", unreadable.join("; "))
    };
    if !off.is_empty() {
        return check(
            "PersistenceMode",
            false,
            format!(
                "persistence mode off on GPU {}: enable it with `nvidia-smi -pm 1` or run \
                 nvidia-persistenced, so the driver stays initialised between jobs{not_read}",
                off.join(", ")
            ),
        );
    }
    let message = if on.is_empty() && unreadable.is_empty() {
        "no GPUs to check".to_owned()
    } else if on.is_empty() {
        format!(
            "persistence mode cannot be read, so it is not checked: {}",
            unreadable.join("; ")
        )
    } else {
        format!("persistence mode on for GPU {}{not_read}", on.join(", "))
    };
    check("PersistenceMode", true, message)
}

/// Gathers the facts: NVML through `backend` (`None` when it failed to load, with the error),
/// the kernel module under `proc_root`, device nodes under `driver_root`.
pub fn observe(
    backend: Result<&dyn GpuBackend, String>,
    driver_root: &Path,
    proc_root: &Path,
    xids: XidObservations,
) -> Observations {
    let kernel_module = std::fs::read_to_string(proc_root.join("driver/nvidia/version"))
        .ok()
        .map(|t| t.lines().next().unwrap_or_default().trim().to_owned());
    let mut missing = Vec::new();
    let mut health = BTreeMap::new();
    let mut persistence = BTreeMap::new();
    let nvml = match backend {
        Err(e) => Err(e),
        Ok(b) => {
            let driver = b.driver().map_err(|e| e.to_string());
            let mut nodes = vec!["dev/nvidiactl".to_owned(), "dev/nvidia-uvm".to_owned()];
            if let Ok(devices) = b.devices() {
                for d in devices {
                    nodes.push(format!("dev/nvidia{}", d.minor_number));
                    health.insert(d.index, b.health(d.index).map_err(|e| e.to_string()));
                    persistence.insert(
                        d.index,
                        b.persistence_mode(d.index).map_err(|e| e.to_string()),
                    );
                }
            }
            for n in nodes {
                if std::fs::symlink_metadata(driver_root.join(&n)).is_err() {
                    missing.push(format!("/{n}"));
                }
            }
            driver
        }
    };
    Observations {
        nvml,
        kernel_module,
        missing_device_nodes: missing,
        health,
        xids,
        persistence,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn driver(version: &str, cuda: &str) -> DriverInfo {
        DriverInfo {
            driver_version: version.to_owned(),
            cuda_version: cuda.parse().unwrap(),
        }
    }

    fn good() -> Observations {
        Observations {
            nvml: Ok(driver("550.54.15", "12.4")),
            kernel_module: Some("NVRM version: 550.54.15".to_owned()),
            missing_device_nodes: vec![],
            health: [(
                0,
                Ok(HealthSnapshot {
                    ecc_uncorrected: Some(0),
                    pcie_replay: Some(3),
                    ..Default::default()
                }),
            )]
            .into_iter()
            .collect(),
            xids: XidObservations::default(),
            persistence: [(0, Ok(true))].into_iter().collect(),
        }
    }

    fn policy(min: Option<&str>, cuda: Option<&str>) -> DriverPolicy {
        DriverPolicy {
            min_version: min.map(str::to_owned),
            cuda_version: cuda.map(str::to_owned),
            ..DriverPolicy::default()
        }
    }

    fn find<'a>(checks: &'a [CheckResult], name: &str) -> &'a CheckResult {
        checks
            .iter()
            .find(|c| c.name.as_str() == name)
            .unwrap_or_else(|| panic!("no {name} in {checks:?}"))
    }

    #[test]
    fn all_pass_on_a_good_node() {
        let checks = run_checks(&policy(Some("550"), Some("12.4")), &good());
        assert!(checks.iter().all(|c| c.passed), "{checks:?}");
        let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "NVMLInit",
                "DriverVersion",
                "CUDAVersion",
                "KernelModule",
                "DeviceNodes",
                "ECCErrors",
                "PCIeReplay",
                "XidErrors",
                "PersistenceMode"
            ]
        );
        assert_eq!(
            find(&checks, "PersistenceMode").message,
            "persistence mode on for GPU 0"
        );
    }

    #[test]
    fn old_driver_fails_cuda_with_both_numbers_and_the_driver_to_install() {
        let obs = Observations {
            nvml: Ok(driver("535.104.05", "12.2")),
            ..good()
        };
        let checks = run_checks(&policy(Some("550.54.15"), Some("12.4")), &obs);
        let cuda = find(&checks, "CUDAVersion");
        assert!(!cuda.passed);
        assert_eq!(
            cuda.message,
            "driver 535.104.05 supports CUDA 12.2; pool requires 12.4: upgrade the driver to ≥ 550.54.14"
        );
        let version = find(&checks, "DriverVersion");
        assert!(
            !version.passed
                && version.message.contains("535.104.05")
                && version.message.contains("550.54.15")
        );
    }

    #[test]
    fn table_of_failures() {
        type Mutate = fn(&mut Observations);
        let cases: Vec<(&str, Mutate, &str)> = vec![
            (
                "NVMLInit",
                |o| o.nvml = Err("driver not loaded".into()),
                "driver not loaded",
            ),
            ("KernelModule", |o| o.kernel_module = None, "not loaded"),
            (
                "DeviceNodes",
                |o| o.missing_device_nodes = vec!["/dev/nvidia0".into()],
                "/dev/nvidia0",
            ),
            (
                "ECCErrors",
                |o| {
                    o.health.insert(
                        1,
                        Ok(HealthSnapshot {
                            ecc_uncorrected: Some(2),
                            ..Default::default()
                        }),
                    );
                },
                "GPU 1: 2",
            ),
            (
                "PCIeReplay",
                |o| {
                    o.health.insert(
                        2,
                        Ok(HealthSnapshot {
                            pcie_replay: Some(100),
                            ..Default::default()
                        }),
                    );
                },
                "GPU 2: 100",
            ),
            (
                "XidErrors",
                |o| o.xids.fatal = vec![(0, 79)],
                "GPU 0: Xid 79",
            ),
            (
                "PersistenceMode",
                |o| {
                    o.persistence.insert(3, Ok(false));
                },
                "off on GPU 3: enable it with `nvidia-smi -pm 1`",
            ),
        ];
        for (name, mutate, needle) in cases {
            let mut obs = good();
            mutate(&mut obs);
            let checks = run_checks(&DriverPolicy::default(), &obs);
            let c = find(&checks, name);
            assert!(!c.passed, "{name} should fail: {c:?}");
            assert!(
                c.message.contains(needle),
                "{name}: {:?} lacks {needle:?}",
                c.message
            );
            let others_fail: Vec<_> = checks
                .iter()
                .filter(|c| !c.passed && c.name.as_str() != name)
                .collect();
            assert!(others_fail.is_empty(), "{name}: {others_fail:?}");
        }
    }

    #[test]
    fn persistence_mode_names_the_gpus_that_have_it_off() {
        let run = |persistence: Vec<(u32, Result<bool, String>)>| {
            let obs = Observations {
                persistence: persistence.into_iter().collect(),
                ..good()
            };
            let p = DriverPolicy {
                checks: vec![DriverCheck::PersistenceMode],
                ..DriverPolicy::default()
            };
            let checks = run_checks(&p, &obs);
            assert_eq!(checks.len(), 1, "{checks:?}");
            checks[0].clone()
        };
        let lost = || Err("reading persistence mode on GPU 2: lost".to_owned());

        let c = run(vec![
            (0, Ok(true)),
            (1, Ok(false)),
            (2, lost()),
            (3, Ok(false)),
        ]);
        assert!(!c.passed, "{c:?}");
        assert!(
            c.message.starts_with("persistence mode off on GPU 1, 3: "),
            "{}",
            c.message
        );
        assert!(
            c.message.contains("nvidia-smi -pm 1") && c.message.contains("nvidia-persistenced"),
            "{}",
            c.message
        );
        assert!(
            c.message.contains("GPU 2: reading persistence mode"),
            "{}",
            c.message
        );
        assert!(!c.message.contains("GPU 0"), "{}", c.message);

        let c = run(vec![(0, Ok(true)), (1, Ok(true))]);
        assert!(c.passed);
        assert_eq!(c.message, "persistence mode on for GPU 0, 1");

        // Unreadable is reported, not failed: the GPU's own health checks fail it.
        let c = run(vec![(0, Ok(true)), (2, lost())]);
        assert!(c.passed, "{c:?}");
        assert!(c.message.contains("not checked: GPU 2"), "{}", c.message);
        let c = run(vec![(2, lost())]);
        assert!(c.passed && c.message.starts_with("persistence mode cannot be read"));

        let c = run(vec![]);
        assert!(c.passed);
        assert_eq!(c.message, "no GPUs to check");
    }

    #[test]
    fn observe_reads_persistence_mode_from_the_backend() {
        use crate::backend::{Fixture, ManualSimClock, SimBackend};
        let fixture: Fixture = serde_yaml::from_str(
            "driver: {version: \"550.54.15\", cuda: \"12.4\"}\n\
             gpus:\n  - {model: L4, count: 2}\n  - {model: L4, persistence_mode: false}\n",
        )
        .unwrap();
        let sim = SimBackend::new(fixture, Arc::new(ManualSimClock::new())).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let obs = observe(Ok(&sim), dir.path(), dir.path(), XidObservations::default());
        assert_eq!(
            obs.persistence,
            [(0, Ok(true)), (1, Ok(true)), (2, Ok(false))]
                .into_iter()
                .collect()
        );
        let checks = run_checks(&DriverPolicy::default(), &obs);
        let c = find(&checks, "PersistenceMode");
        assert!(!c.passed);
        assert!(c.message.contains("off on GPU 2:"), "{}", c.message);
    }

    #[test]
    fn xid_check_counts_the_kernel_log_and_says_when_it_cannot() {
        let pci = |s: &str| s.parse::<PciAddress>().unwrap();
        let only_xids = |xids: XidObservations| {
            let p = DriverPolicy {
                checks: vec![DriverCheck::XidErrors],
                ..DriverPolicy::default()
            };
            let obs = Observations { xids, ..good() };
            let checks = run_checks(&p, &obs);
            assert_eq!(checks.len(), 1, "{checks:?}");
            checks[0].clone()
        };
        let kmsg = || KernelLogRead::Read(PathBuf::from("/dev/kmsg"));
        let unreadable = || KernelLogRead::Unreadable {
            path: PathBuf::from("/dev/kmsg"),
            reason: "Permission denied (os error 13)".to_owned(),
        };

        // Kernel-log Xids join the event ones; ignored Xids (13, 31, 45) and repeats drop out.
        let kernel = Attributed {
            on_gpus: vec![(1, 79), (0, 13), (1, 79)],
            elsewhere: vec![(pci("0000:b1:00"), 48), (pci("0000:b1:00"), 31)],
        };
        let xids = XidObservations::combine(&[(1, 79), (2, 94), (3, 45)], &kernel, kmsg());
        assert_eq!(xids.fatal, vec![(1, 79), (2, 94)]);
        assert_eq!(xids.unattributed, vec![(pci("0000:b1:00"), 48)]);
        let c = only_xids(xids);
        assert!(!c.passed);
        assert_eq!(
            c.message,
            "fatal Xid errors since boot (kernel log /dev/kmsg, NVML events): GPU 1: Xid 79; \
             GPU 2: Xid 94; PCI 0000:b1:00 (no GPU enumerated there): Xid 48"
        );

        // Only the kernel log saw it (before the agent started): still a failure.
        let before_start = Attributed {
            on_gpus: vec![(0, 79)],
            ..Attributed::default()
        };
        let c = only_xids(XidObservations::combine(&[], &before_start, kmsg()));
        assert!(!c.passed && c.message.ends_with("GPU 0: Xid 79"), "{c:?}");

        let c = only_xids(XidObservations::combine(
            &[],
            &Attributed::default(),
            kmsg(),
        ));
        assert!(c.passed);
        assert_eq!(
            c.message,
            "no fatal Xid errors since boot (kernel log /dev/kmsg, NVML events)"
        );

        // An unreadable kernel log is said, not failed.
        let c = only_xids(XidObservations::combine(
            &[],
            &Attributed::default(),
            unreadable(),
        ));
        assert!(c.passed, "{c:?}");
        assert!(
            c.message.contains(
                "kernel log not readable at /dev/kmsg (Permission denied (os error 13)): \
                 only Xids since agent start are counted"
            ),
            "{}",
            c.message
        );
        let c = only_xids(XidObservations::combine(
            &[(4, 48)],
            &Attributed::default(),
            unreadable(),
        ));
        assert!(!c.passed);
        assert!(
            c.message.contains("not readable") && c.message.ends_with("GPU 4: Xid 48"),
            "{}",
            c.message
        );
    }

    #[test]
    fn ledger_reads_the_kernel_log_incrementally_and_joins_events() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kmsg");
        std::fs::write(
            &path,
            "6,1,100,-;Linux version 6.8.0\n\
             4,2,200,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n \
             SUBSYSTEM=pci\n\
             4,3,300,-;NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception\n\
             4,4,400,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1234\n",
        )
        .unwrap();
        let gpus = vec![
            (0, "00000000:18:00.0".to_owned()),
            (1, "00000000:3B:00.0".to_owned()),
        ];
        let mut ledger = XidLedger::new(&path);
        assert_eq!(ledger.kernel_log(), &KernelLogRead::NotScanned);
        assert_eq!(ledger.scan_kernel_log().unwrap(), 3);
        ledger.record_event(0, 79);
        ledger.record_event(0, 13);
        ledger.record_event(2, 48);
        let obs = ledger.observations(&gpus);
        assert_eq!(obs.fatal, vec![(0, 79), (1, 79), (2, 48)]);
        assert!(obs.unattributed.is_empty());
        assert_eq!(obs.kernel_log, KernelLogRead::Read(path.clone()));

        // Only new records count again; one on a bus with no GPU is named by its address.
        assert_eq!(ledger.scan_kernel_log().unwrap(), 0);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(&mut f, b"4,5,500,-;NVRM: Xid (PCI:0000:b1:00): 94, pid=1\n")
            .unwrap();
        assert_eq!(ledger.scan_kernel_log().unwrap(), 1);
        let obs = ledger.observations(&gpus);
        assert_eq!(obs.unattributed, vec![("0000:b1:00".parse().unwrap(), 94)]);
        let p = DriverPolicy {
            checks: vec![DriverCheck::XidErrors],
            ..DriverPolicy::default()
        };
        let checks = run_checks(
            &p,
            &Observations {
                xids: obs,
                ..good()
            },
        );
        assert!(!checks[0].passed);
        assert!(
            checks[0].message.ends_with(
                "GPU 0: Xid 79; GPU 1: Xid 79; GPU 2: Xid 48; \
                 PCI 0000:b1:00 (no GPU enumerated there): Xid 94"
            ),
            "{}",
            checks[0].message
        );
    }

    #[test]
    fn ledger_with_an_unreadable_kernel_log_still_counts_events() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no-kmsg");
        let mut ledger = XidLedger::new(&path);
        assert!(ledger.scan_kernel_log().is_err());
        let obs = ledger.observations(&[]);
        assert!(matches!(&obs.kernel_log, KernelLogRead::Unreadable { path: p, .. } if *p == path));
        let checks = run_checks(
            &DriverPolicy::default(),
            &Observations {
                xids: obs,
                ..good()
            },
        );
        let c = find(&checks, "XidErrors");
        assert!(c.passed, "{c:?}");
        assert!(
            c.message
                .contains(&format!("kernel log not readable at {}", path.display()))
                && c.message
                    .ends_with("only Xids since agent start are counted"),
            "{}",
            c.message
        );
        ledger.record_event(1, 79);
        let c = run_checks(
            &DriverPolicy::default(),
            &Observations {
                xids: ledger.observations(&[]),
                ..good()
            },
        );
        assert!(!find(&c, "XidErrors").passed);
    }

    #[test]
    fn only_listed_checks_run() {
        let p = DriverPolicy {
            checks: vec![DriverCheck::EccErrors],
            ..DriverPolicy::default()
        };
        let names: Vec<String> = run_checks(&p, &good())
            .into_iter()
            .map(|c| c.name.to_string())
            .collect();
        assert_eq!(names, ["ECCErrors"]);
    }

    #[test]
    fn versions_and_cuda_table() {
        assert_eq!(
            compare_versions("550.54.15", "535.104.05"),
            Some(Ordering::Greater)
        );
        assert_eq!(compare_versions("550", "550.0.0"), Some(Ordering::Equal));
        assert_eq!(
            compare_versions("550.54.14", "550.54.15"),
            Some(Ordering::Less)
        );
        assert_eq!(compare_versions("x", "1"), None);
        let v = |s: &str| s.parse::<CudaVersion>().unwrap();
        assert_eq!(min_driver_for_cuda(v("12.4")), Some("550.54.14"));
        assert_eq!(min_driver_for_cuda(v("12.7")), Some("570.26"));
        assert_eq!(min_driver_for_cuda(v("11.0")), Some("450.36.06"));
        assert_eq!(min_driver_for_cuda(v("99.0")), None);
        // The table is sorted, so the lookup's first match is the right one.
        assert!(
            CUDA_MIN_DRIVER
                .windows(2)
                .all(|w| (w[0].0, w[0].1) < (w[1].0, w[1].1)
                    && compare_versions(w[0].2, w[1].2) == Some(Ordering::Less))
        );
    }
}
