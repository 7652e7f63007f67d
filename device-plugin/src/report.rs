//! What the agent reports: GpuNode status, hardware-fact labels on its Node, Events on its
//! GpuNode. The builders here are pure; the agent loop does the writes, and only when the
//! result differs from what it wrote last.

use std::collections::BTreeMap;

use gpupool_crds::conditions::Observed;
use gpupool_crds::labels;
use gpupool_crds::node::{
    CheckResult, GpuStatus, Health as StatusHealth, Idleness, MigDeviceStatus, PodRef, Verdict,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;

use crate::inventory::Inventory;
use crate::plugin::{Advertisement, CdiKind, CdiNaming, Health};
use crate::utilization::IdleTracker;

/// Field manager of every write the agent makes.
pub const FIELD_MANAGER: &str = "gpupool-agent";

/// Health of each advertised device (GPU or MIG UUID), from the health-overlaid advertisement.
pub fn device_health(adv: &Advertisement) -> BTreeMap<String, Health> {
    adv.resources
        .values()
        .flatten()
        .map(|d| (d.id.to_string(), d.health.clone()))
        .collect()
}

fn to_status(h: Option<&Health>) -> (StatusHealth, Option<String>) {
    match h {
        Some(Health::Unhealthy { reason }) => (StatusHealth::Unhealthy, Some(reason.clone())),
        _ => (StatusHealth::Healthy, None),
    }
}

/// The `gpus` list of GpuNode status. MIG devices' `cdiName` is `cdi_kind` qualifying the name
/// `naming` gives them: the one the kubelet plugins' `Allocate` hands out.
pub fn gpu_statuses(
    inventory: &Inventory,
    health: &BTreeMap<String, Health>,
    idle: &IdleTracker,
    pods: &BTreeMap<String, Vec<PodRef>>,
    cdi_kind: &CdiKind,
    naming: CdiNaming,
) -> Vec<GpuStatus> {
    inventory
        .gpus
        .iter()
        .map(|g| {
            let uuid = g.device.uuid.to_string();
            let mig_health: Vec<Option<&Health>> = g
                .mig_devices
                .iter()
                .map(|m| health.get(m.uuid.as_str()))
                .collect();
            let (mut gpu_health, mut reason) = to_status(health.get(&uuid));
            // Under MIG the GPU itself may not be advertised; it is unhealthy when all of its
            // advertised MIG devices are.
            if health.get(&uuid).is_none()
                && !mig_health.is_empty()
                && mig_health
                    .iter()
                    .all(|h| matches!(h, Some(Health::Unhealthy { .. })))
            {
                (gpu_health, reason) = to_status(mig_health[0]);
            }
            if let Err(e) = &g.health
                && (e.contains("fallen off the bus") || e.contains("lost"))
            {
                gpu_health = StatusHealth::Unhealthy;
                reason = Some(e.clone());
            }
            let mig_devices = g
                .mig_devices
                .iter()
                .enumerate()
                .map(|(j, m)| {
                    let (h, _) = to_status(health.get(m.uuid.as_str()));
                    MigDeviceStatus {
                        uuid: m.uuid.to_string(),
                        profile: m.profile.to_string(),
                        gpu_instance: m.gpu_instance.0,
                        compute_instance: m.compute_instance.0,
                        cdi_name: cdi_kind.qualify(&naming.mig_device_name(
                            g.device.index,
                            j as u32,
                            m.uuid.as_str(),
                        )),
                        health: h,
                        idleness: idle.idleness(
                            m.uuid.as_str(),
                            pods.get(m.uuid.as_str()).cloned().unwrap_or_default(),
                        ),
                    }
                })
                .collect();
            GpuStatus {
                index: g.device.index,
                uuid: uuid.clone(),
                model: g.device.name.clone(),
                memory_mib: g.device.memory_mib,
                pci_bus_id: g.device.pci_bus_id.clone(),
                health: gpu_health,
                reason,
                mig_enabled: g.mig_enabled(),
                mig_pending: g
                    .mig_mode
                    .filter(|m| m.pending != m.current)
                    .map(|m| m.pending),
                mig_devices,
                idleness: if g.mig_enabled() {
                    Idleness::default()
                } else {
                    idle.idleness(&uuid, pods.get(&uuid).cloned().unwrap_or_default())
                },
            }
        })
        .collect()
}

/// A label value from free text: characters outside `[A-Za-z0-9._-]` become `-`, trimmed to
/// 63 characters and to alphanumeric ends.
pub fn label_value(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// The hardware-fact labels the agent owns on its Node.
pub fn node_labels(inventory: &Inventory) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    out.insert(
        labels::COUNT_LABEL.to_owned(),
        inventory.gpus.len().to_string(),
    );
    out.insert(
        labels::DRIVER_LABEL.to_owned(),
        label_value(&inventory.driver.driver_version),
    );
    if let Some(first) = inventory.gpus.first() {
        out.insert(
            labels::PRODUCT_LABEL.to_owned(),
            label_value(&first.device.name),
        );
        out.insert(
            labels::MEMORY_LABEL.to_owned(),
            first.device.memory_mib.to_string(),
        );
    }
    let capable = !inventory.gpus.is_empty() && inventory.gpus.iter().all(|g| g.device.mig_capable);
    out.insert(labels::MIG_CAPABLE_LABEL.to_owned(), capable.to_string());
    out
}

/// `True` / `False` from check results (`Unknown` when there are none).
pub fn validated(checks: &[CheckResult]) -> String {
    Verdict::of_checks(checks).to_string()
}

/// Sets a condition in `conditions` with [`gpupool_crds::conditions::set_condition`]
/// (`lastTransitionTime` kept unless the status changes, whole seconds), sorted by type.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    gpupool_crds::conditions::set_condition(
        conditions,
        Observed {
            type_,
            status,
            reason,
            message: message.to_owned(),
            observed_generation: generation,
        },
        now,
    );
    conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    #[test]
    fn label_values_are_valid() {
        assert_eq!(
            label_value("NVIDIA H100 80GB HBM3"),
            "NVIDIA-H100-80GB-HBM3"
        );
        assert_eq!(label_value("550.54.15"), "550.54.15");
        assert_eq!(label_value(" (x) "), "x");
        assert_eq!(label_value(&"a".repeat(80)).len(), 63);
    }

    #[test]
    fn conditions_keep_transition_time_until_status_changes() {
        let t = |s: i64| Timestamp::from_second(1_700_000_000 + s).unwrap();
        let mut c = Vec::new();
        set_condition(
            &mut c,
            "PodResourcesAvailable",
            false,
            "SocketMissing",
            "m",
            Some(1),
            t(0),
        );
        set_condition(
            &mut c,
            "PodResourcesAvailable",
            false,
            "SocketMissing",
            "m",
            Some(1),
            t(10),
        );
        assert_eq!(c[0].last_transition_time, Time(t(0)));
        set_condition(
            &mut c,
            "PodResourcesAvailable",
            true,
            "Listed",
            "ok",
            Some(1),
            t(20),
        );
        assert_eq!(c[0].last_transition_time, Time(t(20)));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn validated_summary() {
        let ok = CheckResult {
            name: "A".into(),
            passed: true,
            message: String::new(),
        };
        let bad = CheckResult {
            passed: false,
            ..ok.clone()
        };
        assert_eq!(validated(&[]), "Unknown");
        assert_eq!(validated(std::slice::from_ref(&ok)), "True");
        assert_eq!(validated(&[ok, bad]), "False");
    }
}
