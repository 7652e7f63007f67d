//! The conformance report: for each scenario, the CDI spec of both generators and, for each
//! MIG strategy, what both plugins register, advertise and answer to the same Allocate.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use anyhow::Result;

use crate::Tools;
use crate::cdi_cmp::{self, normalize};
use crate::node::{self, SCENARIOS};
use crate::plugins::{self, Registered, Side};
use crate::report::{Outcome, Report};

/// NVIDIA's CDI kind in Allocate answers (its plugin's own spec).
const NVIDIA_PLUGIN_KIND: &str = "k8s.device-plugin.nvidia.com/gpu";

/// Runs every scenario; returns the number of unexpected differences.
pub async fn run(tools: &Tools, work: &Path) -> Result<usize> {
    fs::create_dir_all(work)?;
    let mut report = Report::default();
    // GPUPOOL_NVIDIA_SCENARIOS=a,b runs only those (by name).
    let only: Option<Vec<String>> = std::env::var("GPUPOOL_NVIDIA_SCENARIOS")
        .ok()
        .map(|s| s.split(',').map(str::to_owned).collect());
    for scenario in SCENARIOS
        .iter()
        .filter(|s| only.as_ref().is_none_or(|o| o.iter().any(|n| n == s.name)))
    {
        println!("\n=== {} ({})", scenario.name, scenario.fixture);
        let dir = work.join(scenario.name);
        let node = node::prepare(
            &tools.repo,
            scenario,
            &dir.join("node"),
            &tools.fake_lib,
            &tools.self_exe,
        )?;
        node::pin_clock(&node)?;

        let (nvidia_text, _) = cdi_cmp::run_nvidia_ctk(&tools.ctk, &node, &dir)?;
        let (ours_text, _) = cdi_cmp::run_ours(&tools.self_exe, &node, &dir)?;
        cdi_cmp::compare(
            &mut report,
            scenario.name,
            &normalize(&nvidia_text)?,
            &normalize(&ours_text)?,
        );

        for strategy in scenario.strategies {
            let label = format!("{} strategy={strategy}", scenario.name);
            let mut seen = BTreeMap::new();
            let mut answers = BTreeMap::new();
            for side in [Side::Nvidia, Side::Gpupool] {
                let work = dir.join(format!("plugin-{strategy}-{}", side.name()));
                let mut running =
                    plugins::start(side, &node, strategy, &work, &tools.plugin, &tools.self_exe)
                        .await?;
                let registered = running.registered().await?;
                let mut allocations = BTreeMap::new();
                if registered.exited.is_none() {
                    for (resource, devices) in &registered.resources {
                        let mut ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
                        ids.sort();
                        ids.truncate(2);
                        if ids.is_empty() {
                            continue;
                        }
                        let answer = running.allocate(resource, &ids).await;
                        allocations
                            .insert(resource.clone(), (ids, answer.map_err(|e| e.to_string())));
                    }
                }
                running.stop().await;
                seen.insert(side, registered);
                answers.insert(side, allocations);
            }
            compare_plugins(&mut report, &label, &seen, &answers);
        }
    }
    let table = report.table();
    println!("\n## Conformance summary\n\n{table}");
    fs::write(work.join("conformance.md"), &table)?;
    println!(
        "{} rows: {} equal, {} documented difference(s), {} unexpected",
        report.rows.len(),
        report
            .rows
            .iter()
            .filter(|r| r.outcome == Outcome::Equal)
            .count(),
        report
            .rows
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Documented(_)))
            .count(),
        report.unexpected()
    );

    Ok(report.unexpected())
}

type Answers = BTreeMap<
    Side,
    BTreeMap<
        String,
        (
            Vec<String>,
            Result<gpupool_device_plugin::plugin::api::v1beta1::ContainerAllocateResponse, String>,
        ),
    >,
>;

fn compare_plugins(
    report: &mut Report,
    label: &str,
    seen: &BTreeMap<Side, Registered>,
    answers: &Answers,
) {
    let (nvidia, ours) = (&seen[&Side::Nvidia], &seen[&Side::Gpupool]);
    let resources = |r: &Registered| r.resources.keys().cloned().collect::<BTreeSet<_>>();
    if let Some(exit) = &nvidia.exited {
        // NVIDIA's plugin refuses some layouts by exiting; ours then advertises nothing.
        let outcome = if ours.resources.values().all(Vec::is_empty) {
            Outcome::Documented(
                "both refuse this layout: NVIDIA's plugin exits, gpupool registers no devices \
                 (and reports it in GpuNode status)"
                    .to_owned(),
            )
        } else {
            Outcome::Unexpected
        };
        let mut detail = vec![format!("nvidia: {exit}")];
        detail.push(format!("gpupool registered: {:?}", resources(ours)));
        report.push(label, "resources registered", outcome, detail);
        return;
    }
    report.compare_sets(
        label,
        "resources registered",
        &resources(nvidia),
        &resources(ours),
        |_, _| None,
    );
    let ids = |r: &Registered| {
        r.resources
            .iter()
            .flat_map(|(res, devs)| {
                devs.iter()
                    .map(move |d| (res.clone(), d.id.clone(), d.health.clone()))
            })
            .collect::<BTreeSet<_>>()
    };
    report.compare_sets(
        label,
        "device IDs and health per resource",
        &ids(nvidia),
        &ids(ours),
        |_, _| None,
    );
    let numa = |r: &Registered| {
        r.resources
            .iter()
            .flat_map(|(res, devs)| {
                devs.iter().map(move |d| {
                    let nodes: Vec<i64> = d
                        .topology
                        .iter()
                        .flat_map(|t| t.nodes.iter().map(|n| n.id))
                        .collect();
                    (res.clone(), d.id.clone(), nodes)
                })
            })
            .collect::<BTreeSet<_>>()
    };
    report.compare_sets(
        label,
        "NUMA topology per device",
        &numa(nvidia),
        &numa(ours),
        |n, _| {
            n.iter().all(|(_, _, nodes)| nodes.is_empty()).then(|| {
                "NVIDIA's plugin reads /sys/bus/pci/devices/<bus id>/numa_node, a host file the \
                 simulated node does not have (so it reports none); we read NVML \
                 (nvmlDeviceGetNumaNodeId), which the fake answers from the fixture"
                    .to_owned()
            })
        },
    );

    let (a_nvidia, a_ours) = (&answers[&Side::Nvidia], &answers[&Side::Gpupool]);
    let mut cdi_n = BTreeSet::new();
    let mut cdi_o = BTreeSet::new();
    let mut kinds_n = BTreeSet::new();
    let mut kinds_o = BTreeSet::new();
    let mut env_n = BTreeSet::new();
    let mut env_o = BTreeSet::new();
    let mut other_n = BTreeSet::new();
    let mut other_o = BTreeSet::new();
    let mut failures = Vec::new();
    for (answers, cdi, kinds, env, other) in [
        (a_nvidia, &mut cdi_n, &mut kinds_n, &mut env_n, &mut other_n),
        (a_ours, &mut cdi_o, &mut kinds_o, &mut env_o, &mut other_o),
    ] {
        for (resource, (ids, answer)) in answers {
            match answer {
                Ok(r) => {
                    for d in &r.cdi_devices {
                        let (kind, name) = d.name.split_once('=').unwrap_or(("", &d.name));
                        kinds.insert(kind.to_owned());
                        cdi.insert((resource.clone(), ids.join(","), name.to_owned()));
                    }
                    for (k, v) in &r.envs {
                        env.insert((resource.clone(), format!("{k}={v}")));
                    }
                    for (k, v) in &r.annotations {
                        other.insert((resource.clone(), format!("annotation {k}={v}")));
                    }
                    for m in &r.mounts {
                        other.insert((resource.clone(), format!("mount {}", m.container_path)));
                    }
                    for d in &r.devices {
                        other.insert((resource.clone(), format!("device {}", d.container_path)));
                    }
                }
                Err(e) => failures.push(format!("{resource} {ids:?}: {e}")),
            }
        }
    }
    if !failures.is_empty() {
        report.push(label, "Allocate", Outcome::Unexpected, failures);
    }
    report.compare_sets(
        label,
        "Allocate: CDI device names (resource, request, name)",
        &cdi_n,
        &cdi_o,
        |_, _| None,
    );
    report.compare_sets(label, "Allocate: CDI kind", &kinds_n, &kinds_o, |n, o| {
        (n.iter().all(|k| k == NVIDIA_PLUGIN_KIND) && o.iter().all(|k| k == "gpupool.io/gpu")).then(
            || {
                "each names devices of its own CDI spec: NVIDIA's plugin writes \
                     k8s.device-plugin.nvidia.com-gpu.json, we answer with our gpupool.io/gpu spec"
                    .to_owned()
            },
        )
    });
    report.compare_sets(label, "Allocate: env", &env_n, &env_o, |n, o| {
        (n.is_empty()
            && o.iter()
                .all(|(_, e)| e.starts_with("NVIDIA_VISIBLE_DEVICES=")))
        .then(|| {
            "with device-list-strategy cdi-cri NVIDIA's plugin sets no env; we also set \
                     NVIDIA_VISIBLE_DEVICES=<ids> for nodes still on the legacy runtime hook"
                .to_owned()
        })
    });
    report.compare_sets(
        label,
        "Allocate: annotations, mounts, device specs",
        &other_n,
        &other_o,
        |n, o| {
            (n.is_empty()
                && o.iter()
                    .all(|(_, a)| a.starts_with("annotation cdi.k8s.io/")))
            .then(|| {
                "we also answer with the cdi.k8s.io/ annotation (device-list-strategy \
                     cdi-annotations in NVIDIA's terms) for runtimes without the CRI CDI field"
                    .to_owned()
            })
        },
    );
}
