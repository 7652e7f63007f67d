//! Resolving a pool's MIG layout for one node's GPU model (pure).

use std::collections::BTreeMap;

use gpupool_crds::node::{GpuMigSpec, NodeMigSpec};
use gpupool_crds::policy::{MigLayout, MigLayoutEntry, MigPolicy};
use gpupool_mig_catalog::{self as catalog, GpuModel};

/// Label that GPU feature discovery puts on nodes: the product name.
pub const GFD_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
/// Label that GPU feature discovery puts on nodes: the number of GPUs.
pub const GFD_COUNT_LABEL: &str = "nvidia.com/gpu.count";

/// The GPU facts of a node, read from its labels.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeGpus {
    /// Product name as the label spells it, e.g. `NVIDIA-H100-80GB-HBM3`.
    pub product: Option<String>,
    /// Number of GPUs.
    pub count: Option<u32>,
}

impl NodeGpus {
    /// Reads the GFD labels, falling back to the ones the gpupool agent publishes.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Self {
        let get = |gfd: &str, ours: &str| labels.get(gfd).or_else(|| labels.get(ours)).cloned();
        let product = get(GFD_PRODUCT_LABEL, gpupool_crds::labels::PRODUCT_LABEL);
        let count = get(GFD_COUNT_LABEL, gpupool_crds::labels::COUNT_LABEL)
            .and_then(|c| c.trim().parse::<u32>().ok());
        Self { product, count }
    }
}

/// Why a layout cannot be resolved for a node. Shown as a per-node problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutProblem {
    /// CamelCase reason.
    pub reason: &'static str,
    /// What is wrong and what to do.
    pub message: String,
}

impl LayoutProblem {
    fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

/// Resolves the pool's MIG policy for a node. On a problem the node gets an unmanaged layout
/// (MIG left as found) and the problem is reported; it never fails the whole pool.
pub fn resolve(policy: &MigPolicy, gpus: &NodeGpus) -> (NodeMigSpec, Option<LayoutProblem>) {
    let unmanaged = NodeMigSpec {
        strategy: policy.strategy,
        managed: false,
        layout_name: None,
        gpus: Vec::new(),
    };
    let Some(layout) = &policy.layout else {
        return (unmanaged, None);
    };
    let name = layout_name(layout);
    match resolve_gpus(layout, gpus) {
        Ok(Some(specs)) => (
            NodeMigSpec {
                strategy: policy.strategy,
                managed: true,
                layout_name: Some(name),
                gpus: specs,
            },
            None,
        ),
        Ok(None) => (unmanaged, None),
        Err(problem) => (unmanaged, Some(problem)),
    }
}

/// The display name of a layout: the preset, or `custom`.
pub fn layout_name(layout: &MigLayout) -> String {
    layout.preset.clone().unwrap_or_else(|| "custom".to_owned())
}

/// `Ok(None)`: nothing to manage on this node (e.g. `all-disabled` on a GPU without MIG).
fn resolve_gpus(
    layout: &MigLayout,
    gpus: &NodeGpus,
) -> Result<Option<Vec<GpuMigSpec>>, LayoutProblem> {
    let model = gpus
        .product
        .as_deref()
        .and_then(catalog::model_by_product_name);
    let product = gpus.product.as_deref().unwrap_or("");
    let count = gpus.count;
    if let Some(preset) = &layout.preset {
        if preset == "all-disabled" && model.is_none() {
            // Nothing can be MIG-enabled on a model without MIG, so nothing to do.
            return Ok(None);
        }
        let (model, count) = need_model(model, product, count, preset)?;
        let per_gpu = preset_profiles(model, preset)?;
        return Ok(Some(
            (0..count)
                .map(|index| GpuMigSpec {
                    index,
                    enabled: preset != "all-disabled",
                    profiles: per_gpu.clone(),
                })
                .collect(),
        ));
    }
    let entries = layout.custom.as_deref().unwrap_or_default();
    let count = count.ok_or_else(|| {
        LayoutProblem::new(
            "GPULabelsMissing",
            format!("the node has no {GFD_COUNT_LABEL} label, so the custom MIG layout cannot be placed: install GPU feature discovery or the gpupool agent"),
        )
    })?;
    let mut specs = Vec::new();
    for index in 0..count {
        let Some(entry) = entries.iter().find(|e| entry_matches(e, index, product)) else {
            continue;
        };
        if entry.enabled || !entry.profiles.is_empty() {
            let Some(model) = model else {
                return Err(no_mig_model(product, "custom"));
            };
            let wanted = expand(&entry.profiles);
            let names: Vec<&str> = wanted.iter().map(String::as_str).collect();
            catalog::plan_layout(model, &names).map_err(|e| {
                LayoutProblem::new(
                    "MIGLayoutDoesNotFit",
                    format!("custom layout on GPU {index}: {e}: change the entry's profiles"),
                )
            })?;
        }
        specs.push(GpuMigSpec {
            index,
            enabled: entry.enabled,
            profiles: entry.profiles.clone(),
        });
    }
    Ok(Some(specs))
}

fn need_model<'m>(
    model: Option<&'m GpuModel>,
    product: &str,
    count: Option<u32>,
    preset: &str,
) -> Result<(&'m GpuModel, u32), LayoutProblem> {
    let model = model.ok_or_else(|| no_mig_model(product, preset))?;
    let count = count.ok_or_else(|| {
        LayoutProblem::new(
            "GPULabelsMissing",
            format!("the node has no {GFD_COUNT_LABEL} label, so {preset} cannot be placed"),
        )
    })?;
    Ok((model, count))
}

fn no_mig_model(product: &str, layout: &str) -> LayoutProblem {
    if product.is_empty() {
        LayoutProblem::new(
            "GPULabelsMissing",
            format!(
                "the node has no {GFD_PRODUCT_LABEL} label, so MIG layout {layout} cannot be resolved"
            ),
        )
    } else {
        LayoutProblem::new(
            "MIGNotSupported",
            format!(
                "GPU model {product} does not support MIG, so layout {layout} cannot be applied: select only MIG-capable nodes or use all-disabled"
            ),
        )
    }
}

fn entry_matches(entry: &MigLayoutEntry, index: u32, product: &str) -> bool {
    let gpu_ok = entry.gpus.as_ref().is_none_or(|g| g.contains(&index));
    let model_ok = entry.models.as_ref().is_none_or(|models| {
        models.iter().any(|m| {
            m.eq_ignore_ascii_case(product)
                || matches!(
                    (catalog::model_by_product_name(m), catalog::model_by_product_name(product)),
                    (Some(a), Some(b)) if a.key == b.key
                )
        })
    });
    gpu_ok && model_ok
}

fn expand(profiles: &BTreeMap<String, u32>) -> Vec<String> {
    profiles
        .iter()
        .flat_map(|(name, n)| std::iter::repeat_n(name.clone(), *n as usize))
        .collect()
}

/// Profiles of one GPU for a preset on a model, checked to fit.
pub fn preset_profiles(
    model: &GpuModel,
    preset: &str,
) -> Result<BTreeMap<String, u32>, LayoutProblem> {
    match preset {
        "all-disabled" | "all-enabled" => Ok(BTreeMap::new()),
        "all-balanced" => balanced(model),
        other => {
            let Some(profile_name) = other.strip_prefix("all-") else {
                return Err(LayoutProblem::new(
                    "MIGLayoutDoesNotFit",
                    format!("unknown preset {other}"),
                ));
            };
            let Some(profile) = model.profile(profile_name) else {
                return Err(LayoutProblem::new(
                    "MIGLayoutDoesNotFit",
                    format!(
                        "{} has no MIG profile {profile_name}; its profiles are {}: pick one of them or select other nodes",
                        model.key,
                        model
                            .profiles
                            .iter()
                            .map(|p| p.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            };
            // As many as fit: try from the most down.
            for n in (1..=profile.max_instances).rev() {
                let wanted = vec![profile.name; n as usize];
                if catalog::plan_layout(model, &wanted).is_ok() {
                    return Ok(BTreeMap::from([(profile.name.to_owned(), n)]));
                }
            }
            Err(LayoutProblem::new(
                "MIGLayoutDoesNotFit",
                format!("no instance of {profile_name} fits {}", model.key),
            ))
        }
    }
}

/// NVIDIA's `all-balanced`: two of the smallest 1-slice profile, one 2-slice, and one
/// 3-slice profile where the GPU has 7 compute slices.
fn balanced(model: &GpuModel) -> Result<BTreeMap<String, u32>, LayoutProblem> {
    let smallest = |slices: u32| {
        model
            .profiles
            .iter()
            .filter(|p| p.compute_slices == slices && !p.media_extensions)
            .min_by_key(|p| p.memory_mib)
            .map(|p| p.name)
    };
    let mut wanted = Vec::new();
    if let Some(p) = smallest(1) {
        wanted.extend([p, p]);
    }
    if let Some(p) = smallest(2) {
        wanted.push(p);
    }
    if model.compute_slices >= 7
        && let Some(p) = smallest(3)
    {
        wanted.push(p);
    }
    catalog::plan_layout(model, &wanted).map_err(|e| {
        LayoutProblem::new(
            "MIGLayoutDoesNotFit",
            format!("all-balanced on {}: {e}", model.key),
        )
    })?;
    let mut out = BTreeMap::new();
    for p in wanted {
        *out.entry(p.to_owned()).or_insert(0) += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool_crds::policy::MigStrategy;

    fn gpus(product: &str, count: u32) -> NodeGpus {
        NodeGpus {
            product: Some(product.into()),
            count: Some(count),
        }
    }

    fn preset(name: &str) -> MigPolicy {
        MigPolicy {
            strategy: MigStrategy::Mixed,
            layout: Some(MigLayout {
                preset: Some(name.into()),
                custom: None,
            }),
            max_unavailable: None,
        }
    }

    #[test]
    fn presets_resolve_per_model() {
        struct Case {
            preset: &'static str,
            product: &'static str,
            want: Result<&'static [(&'static str, u32)], &'static str>,
        }
        let cases = [
            Case {
                preset: "all-1g.10gb",
                product: "NVIDIA-H100-80GB-HBM3",
                want: Ok(&[("1g.10gb", 7)]),
            },
            Case {
                preset: "all-3g.40gb",
                product: "NVIDIA-H100-80GB-HBM3",
                want: Ok(&[("3g.40gb", 2)]),
            },
            Case {
                preset: "all-balanced",
                product: "NVIDIA-A100-SXM4-80GB",
                want: Ok(&[("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)]),
            },
            Case {
                preset: "all-enabled",
                product: "NVIDIA-H100-80GB-HBM3",
                want: Ok(&[]),
            },
            Case {
                preset: "all-1g.5gb",
                product: "NVIDIA-H100-80GB-HBM3",
                want: Err("MIGLayoutDoesNotFit"),
            },
            Case {
                preset: "all-1g.10gb",
                product: "NVIDIA-L4",
                want: Err("MIGNotSupported"),
            },
        ];
        for c in cases {
            let (spec, problem) = resolve(&preset(c.preset), &gpus(c.product, 2));
            match c.want {
                Ok(profiles) => {
                    assert_eq!(problem, None, "{} on {}", c.preset, c.product);
                    assert!(spec.managed);
                    assert_eq!(spec.gpus.len(), 2);
                    let want: BTreeMap<String, u32> = profiles
                        .iter()
                        .map(|(p, n)| ((*p).to_owned(), *n))
                        .collect();
                    assert_eq!(spec.gpus[1].profiles, want, "{}", c.preset);
                    assert_eq!(spec.layout_name.as_deref(), Some(c.preset));
                }
                Err(reason) => {
                    assert_eq!(problem.map(|p| p.reason), Some(reason), "{}", c.preset);
                    assert!(!spec.managed);
                }
            }
        }
    }

    #[test]
    fn all_disabled_on_a_gpu_without_mig_is_nothing_to_do() {
        let (spec, problem) = resolve(&preset("all-disabled"), &gpus("NVIDIA-L4", 4));
        assert_eq!(problem, None);
        assert!(!spec.managed);
    }

    #[test]
    fn missing_labels_are_a_problem_not_a_crash() {
        let (spec, problem) = resolve(
            &preset("all-1g.10gb"),
            &NodeGpus {
                product: Some("NVIDIA-H100-80GB-HBM3".into()),
                count: None,
            },
        );
        assert_eq!(problem.map(|p| p.reason), Some("GPULabelsMissing"));
        assert!(!spec.managed);
    }

    #[test]
    fn custom_entries_first_match_wins_and_must_fit() {
        let policy = MigPolicy {
            strategy: MigStrategy::Mixed,
            layout: Some(MigLayout {
                preset: None,
                custom: Some(vec![
                    MigLayoutEntry {
                        gpus: Some(vec![0]),
                        models: None,
                        enabled: false,
                        profiles: BTreeMap::new(),
                    },
                    MigLayoutEntry {
                        gpus: None,
                        models: Some(vec!["NVIDIA-H100-80GB-HBM3".into()]),
                        enabled: true,
                        profiles: BTreeMap::from([("3g.40gb".into(), 1), ("1g.10gb".into(), 2)]),
                    },
                ]),
            }),
            max_unavailable: None,
        };
        let (spec, problem) = resolve(&policy, &gpus("NVIDIA-H100-80GB-HBM3", 3));
        assert_eq!(problem, None);
        assert_eq!(spec.gpus.len(), 3);
        assert!(!spec.gpus[0].enabled);
        assert_eq!(spec.gpus[2].profiles.get("3g.40gb"), Some(&1));
        // Another model: only GPU 0 matches an entry.
        let (spec, _) = resolve(&policy, &gpus("NVIDIA-A100-SXM4-80GB", 3));
        assert_eq!(spec.gpus.len(), 1);

        let mut too_big = policy.clone();
        if let Some(layout) = too_big.layout.as_mut()
            && let Some(custom) = layout.custom.as_mut()
        {
            custom[1].profiles = BTreeMap::from([("3g.40gb".into(), 3)]);
        }
        let (_, problem) = resolve(&too_big, &gpus("NVIDIA-H100-80GB-HBM3", 3));
        assert_eq!(problem.map(|p| p.reason), Some("MIGLayoutDoesNotFit"));
    }

    #[test]
    fn no_layout_leaves_mig_alone() {
        let (spec, problem) = resolve(&MigPolicy::default(), &gpus("NVIDIA-L4", 4));
        assert_eq!(problem, None);
        assert!(!spec.managed && spec.gpus.is_empty());
    }
}
