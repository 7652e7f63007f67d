//! GPU models the simulator knows, with the facts NVML reports for each.

use gpupool_mig_catalog::{self as catalog, GpuModel};

/// NVML `nvmlDeviceArchitecture_t` values (nvml.h `NVML_DEVICE_ARCH_*`).
pub mod arch {
    /// Turing
    pub const TURING: u32 = 6;
    /// Ampere
    pub const AMPERE: u32 = 7;
    /// Ada Lovelace
    pub const ADA: u32 = 8;
    /// Hopper
    pub const HOPPER: u32 = 9;
}

/// Static facts about a GPU model (from NVIDIA's product pages and `nvidia-smi` on the boards;
/// memory totals are what NVML's `nvmlDeviceGetMemoryInfo` reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelInfo {
    /// Fixture key.
    pub key: &'static str,
    /// Name NVML reports.
    pub product_name: &'static str,
    /// Total memory, MiB.
    pub memory_mib: u64,
    /// `NVML_DEVICE_ARCH_*`.
    pub architecture: u32,
    /// CUDA compute capability.
    pub compute_capability: (u32, u32),
    /// PCI device ID (`device << 16 | 0x10DE`).
    pub pci_device_id: u32,
    /// Whether the board has ECC memory.
    pub ecc: bool,
    /// Catalog key of the MIG profiles, if MIG-capable.
    pub mig_catalog: Option<&'static str>,
    /// Whether enabling/disabling MIG needs a GPU reset (Ampere) or applies at once (Hopper).
    pub mig_mode_needs_reset: bool,
    /// Most MIG devices the GPU can hold (`nvmlDeviceGetMaxMigDeviceCount`).
    pub max_mig_devices: u32,
}

/// Models a fixture may name.
pub const MODEL_INFOS: &[ModelInfo] = &[
    ModelInfo {
        key: "H100-SXM5-80GB",
        product_name: "NVIDIA H100 80GB HBM3",
        memory_mib: 81559,
        architecture: arch::HOPPER,
        compute_capability: (9, 0),
        pci_device_id: 0x2330_10DE,
        ecc: true,
        mig_catalog: Some("H100-80GB"),
        mig_mode_needs_reset: false,
        max_mig_devices: 7,
    },
    ModelInfo {
        key: "H200-SXM5-141GB",
        product_name: "NVIDIA H200",
        memory_mib: 143771,
        architecture: arch::HOPPER,
        compute_capability: (9, 0),
        pci_device_id: 0x2335_10DE,
        ecc: true,
        mig_catalog: Some("H200-141GB"),
        mig_mode_needs_reset: false,
        max_mig_devices: 7,
    },
    ModelInfo {
        key: "A100-SXM4-80GB",
        product_name: "NVIDIA A100-SXM4-80GB",
        memory_mib: 81920,
        architecture: arch::AMPERE,
        compute_capability: (8, 0),
        pci_device_id: 0x20B2_10DE,
        ecc: true,
        mig_catalog: Some("A100-80GB"),
        mig_mode_needs_reset: true,
        max_mig_devices: 7,
    },
    ModelInfo {
        key: "A100-SXM4-40GB",
        product_name: "NVIDIA A100-SXM4-40GB",
        memory_mib: 40960,
        architecture: arch::AMPERE,
        compute_capability: (8, 0),
        pci_device_id: 0x20B0_10DE,
        ecc: true,
        mig_catalog: Some("A100-40GB"),
        mig_mode_needs_reset: true,
        max_mig_devices: 7,
    },
    ModelInfo {
        key: "A30-24GB",
        product_name: "NVIDIA A30",
        memory_mib: 24576,
        architecture: arch::AMPERE,
        compute_capability: (8, 0),
        pci_device_id: 0x20B7_10DE,
        ecc: true,
        mig_catalog: Some("A30-24GB"),
        mig_mode_needs_reset: true,
        max_mig_devices: 4,
    },
    ModelInfo {
        key: "L4",
        product_name: "NVIDIA L4",
        memory_mib: 23034,
        architecture: arch::ADA,
        compute_capability: (8, 9),
        pci_device_id: 0x27B8_10DE,
        ecc: true,
        mig_catalog: None,
        mig_mode_needs_reset: false,
        max_mig_devices: 0,
    },
    ModelInfo {
        key: "RTX-4090",
        product_name: "NVIDIA GeForce RTX 4090",
        memory_mib: 24564,
        architecture: arch::ADA,
        compute_capability: (8, 9),
        pci_device_id: 0x2684_10DE,
        ecc: false,
        mig_catalog: None,
        mig_mode_needs_reset: false,
        max_mig_devices: 0,
    },
    ModelInfo {
        key: "T4",
        product_name: "Tesla T4",
        memory_mib: 15360,
        architecture: arch::TURING,
        compute_capability: (7, 5),
        pci_device_id: 0x1EB8_10DE,
        ecc: true,
        mig_catalog: None,
        mig_mode_needs_reset: false,
        max_mig_devices: 0,
    },
];

/// Finds a model by fixture key or NVML product name (case-insensitive).
pub fn model_info(name: &str) -> Option<&'static ModelInfo> {
    MODEL_INFOS.iter().find(|m| {
        m.key.eq_ignore_ascii_case(name.trim()) || m.product_name.eq_ignore_ascii_case(name.trim())
    })
}

impl ModelInfo {
    /// The MIG catalog entry, if MIG-capable.
    pub fn mig(&self) -> Option<&'static GpuModel> {
        self.mig_catalog.and_then(catalog::model_by_product_name)
    }
}
