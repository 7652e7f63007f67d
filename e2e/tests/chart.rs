//! The Helm chart (`charts/gpupool`) against the real control plane:
//!
//! - `helm lint --strict` passes;
//! - `helm template` with the default values and with a set of non-default values renders
//!   objects the apiserver accepts under `kubectl apply --dry-run=server --validate=strict`:
//!   the real OpenAPI schemas (including the CRDs' and admission), unknown fields rejected.
//!   This is stronger than an offline schema check such as kubeconform, so we use it instead;
//! - a wrong value fails `helm template` and `helm install` with values.schema.json's message
//!   naming the value;
//! - `helm install` brings every object up with the CRDs Established; `helm upgrade` applies a
//!   change; `helm uninstall` removes the release's objects and keeps the CRDs;
//! - the Dockerfiles build in stages from pinned bases, the operator's as a non-root user.

#[path = "chart_support.rs"]
mod support;

use std::fs;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpupool_crds::GpuPool;
use gpupool_e2e::manifest::parse_objects;
use gpupool_e2e::wait::poll;
use gpupool_e2e::{Cluster, TestScope, Tools, crds, repo_root};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::runtime::wait::{await_condition, conditions};
use serde_json::json;
use support::{Release, chart_dir, helm, helm_try};

const CRDS: [&str; 2] = ["gpupools.gpupool.io", "gpunodes.gpupool.io"];

fn chart_path() -> String {
    chart_dir().to_string_lossy().into_owned()
}

/// `helm template` output for `release` in `namespace` with `--set` values.
fn template(tools: &Tools, release: &str, namespace: &str, sets: &[&str]) -> Result<String> {
    template_with(tools, release, namespace, sets, &[])
}

/// [`template`] with more `helm template` arguments (e.g. `--api-versions`).
fn template_with(
    tools: &Tools,
    release: &str,
    namespace: &str,
    sets: &[&str],
    extra: &[&str],
) -> Result<String> {
    let chart = chart_path();
    let mut args = vec!["template", release, &chart, "-n", namespace];
    for s in sets {
        args.extend(["--set", s]);
    }
    args.extend(extra);
    helm(tools, None, &args)
}

/// The `kind/name` of every object in a rendered manifest.
fn kinds_and_names(rendered: &str) -> Result<Vec<String>> {
    Ok(
        parse_objects(rendered, std::path::Path::new("helm-template"))?
            .into_iter()
            .map(|m| {
                format!(
                    "{}/{}",
                    m.object
                        .types
                        .as_ref()
                        .map(|t| t.kind.clone())
                        .unwrap_or_default(),
                    m.object.metadata.name.clone().unwrap_or_default()
                )
            })
            .collect(),
    )
}

#[test]
fn chart_lints_strictly() -> Result<()> {
    let tools = Tools::ensure()?;
    let out = helm(&tools, None, &["lint", "--strict", &chart_path()])?;
    assert!(
        out.contains("1 chart(s) linted, 0 chart(s) failed"),
        "{out}"
    );
    Ok(())
}

#[test]
fn crd_templates_are_kept_on_uninstall_and_optional() -> Result<()> {
    let tools = Tools::ensure()?;
    let with = template(&tools, "gpupool", "gpupool-system", &[])?;
    for crd in CRDS {
        assert!(
            with.contains(&format!("name: {crd}")),
            "{crd} missing from the default render"
        );
    }
    assert_eq!(with.matches("helm.sh/resource-policy: keep").count(), 2);
    let without = template(&tools, "gpupool", "gpupool-system", &["crds.install=false"])?;
    assert!(!without.contains("kind: CustomResourceDefinition"));
    Ok(())
}

/// The hooks: a pre-delete uninstall Job by default, a post-install/post-upgrade Job that
/// applies the default pool (never a GpuPool hook, which an upgrade would delete and create
/// again), both run by the operator's image with a ServiceAccount of their own.
#[test]
fn hooks_clean_up_on_uninstall_and_apply_the_default_pool_in_place() -> Result<()> {
    let tools = Tools::ensure()?;
    let docs = |sets: &[&str]| -> Result<Vec<serde_json::Value>> {
        let text = template(&tools, "r", "gs", sets)?;
        Ok(parse_objects(&text, std::path::Path::new("helm-template"))?
            .into_iter()
            .map(|m| serde_json::to_value(&m.object))
            .collect::<Result<_, _>>()?)
    };
    let hook = |o: &serde_json::Value| {
        o["metadata"]["annotations"]["helm.sh/hook"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let job = |docs: &[serde_json::Value], name: &str| {
        docs.iter()
            .find(|o| o["kind"] == "Job" && o["metadata"]["name"] == name)
            .cloned()
    };

    let default = docs(&[])?;
    let uninstall = job(&default, "r-gpupool-hooks-uninstall").context("no uninstall Job")?;
    assert_eq!(hook(&uninstall), "pre-delete");
    let pod = &uninstall["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "r-gpupool-hooks");
    let c = &pod["containers"][0];
    assert_eq!(c["image"], "ghcr.io/gpupool/gpupool-operator:0.1.0");
    assert_eq!(
        c["args"],
        json!(["--log=info", "uninstall", "--timeout-secs=120"])
    );
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    for kind in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"] {
        let o = default
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == "r-gpupool-hooks")
            .with_context(|| format!("no hook {kind}"))?;
        assert_eq!(hook(o), "pre-delete", "{kind}");
        // Made before the Job, gone after it.
        assert_eq!(o["metadata"]["annotations"]["helm.sh/hook-weight"], "-10");
    }
    assert!(default.iter().all(|o| o["kind"] != "GpuPool"));

    let with_pool = docs(&[
        "defaultPool.enabled=true",
        "defaultPool.name=shared",
        "operator.poolSelector=tier=gpu",
    ])?;
    assert!(
        with_pool.iter().all(|o| o["kind"] != "GpuPool"),
        "the default pool must not be a hook object"
    );
    let apply = job(&with_pool, "r-gpupool-hooks-default-pool").context("no default-pool Job")?;
    assert_eq!(hook(&apply), "post-install,post-upgrade");
    let c = &apply["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        c["args"],
        json!(["--log=info", "--pool-selector=tier=gpu", "apply-pool"])
    );
    let pool: serde_json::Value = serde_json::from_str(
        c["env"][0]["value"]
            .as_str()
            .context("no GPUPOOL_POOL_JSON")?,
    )?;
    assert_eq!(c["env"][0]["name"], "GPUPOOL_POOL_JSON");
    assert_eq!(pool["metadata"]["name"], "shared");
    assert_eq!(
        pool["spec"]["nodeSelector"]["matchLabels"]["nvidia.com/gpu.present"],
        "true"
    );
    let sa = with_pool
        .iter()
        .find(|o| o["kind"] == "ServiceAccount" && o["metadata"]["name"] == "r-gpupool-hooks")
        .context("no hook ServiceAccount")?;
    assert_eq!(hook(sa), "pre-delete,post-install,post-upgrade");

    // `helm test`: one pod asking for one GPU of the configured resource, no token.
    let test_pod = default
        .iter()
        .find(|o| o["kind"] == "Pod" && hook(o) == "test")
        .context("no helm test pod")?;
    assert_eq!(test_pod["metadata"]["name"], "r-gpupool-test-gpu");
    assert_eq!(test_pod["spec"]["automountServiceAccountToken"], false);
    let c = &test_pod["spec"]["containers"][0];
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], 1);
    assert_eq!(c["image"], "docker.io/library/debian:bookworm-slim");
    let script = c["command"][2].as_str().unwrap_or_default();
    assert!(
        script.contains("nvidia-smi -L") && script.contains("/dev/nvidia[0-9]*"),
        "{script}"
    );
    let mig = docs(&["tests.resource=nvidia.com/mig-1g.10gb"])?;
    let mig_pod = mig
        .iter()
        .find(|o| o["kind"] == "Pod" && hook(o) == "test")
        .context("no helm test pod")?;
    assert_eq!(
        mig_pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/mig-1g.10gb"],
        1
    );

    // All off: no hooks at all.
    let none = docs(&["uninstall.cleanup=false", "tests.enabled=false"])?;
    assert!(
        none.iter().all(|o| hook(o).is_empty()),
        "hooks rendered with uninstall.cleanup=false and tests.enabled=false"
    );
    Ok(())
}

#[test]
fn default_render_has_the_documented_shape() -> Result<()> {
    let tools = Tools::ensure()?;
    let text = template(&tools, "gpupool", "gpupool-system", &[])?;
    let objects = kinds_and_names(&text)?;
    for wanted in [
        "Namespace/gpupool-node",
        "ServiceAccount/gpupool-operator",
        "ServiceAccount/gpupool-agent",
        "ClusterRole/gpupool-operator",
        "ClusterRole/gpupool-agent",
        "Role/gpupool-operator-leader-election",
        "Role/gpupool-agent-events",
        "Deployment/gpupool-operator",
        "DaemonSet/gpupool-agent",
        "Service/gpupool-operator-metrics",
        "ValidatingAdmissionPolicy/gpupool-agent-own-node",
        "ValidatingAdmissionPolicyBinding/gpupool-agent-own-node",
    ] {
        assert!(
            objects.iter().any(|o| o == wanted),
            "{wanted} not rendered; got {objects:?}"
        );
    }
    let docs = parse_objects(&text, std::path::Path::new("helm-template"))?;
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|m| {
                m.object.types.as_ref().is_some_and(|t| t.kind == kind)
                    && m.object.metadata.name.as_deref() == Some(name)
            })
            .map(|m| m.object.data.clone())
            .with_context(|| format!("{kind}/{name}"))
    };

    let deploy = find("Deployment", "gpupool-operator")?;
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(c["resources"]["limits"]["memory"].is_string());

    let ds = find("DaemonSet", "gpupool-agent")?;
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    // NVML lists only the processes in the caller's PID namespace.
    assert_eq!(pod["hostPID"], true);
    let terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .context("nodeSelectorTerms")?;
    let keys: Vec<_> = terms
        .iter()
        .map(|t| t["matchExpressions"][0]["key"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        keys,
        [
            "nvidia.com/gpu.present",
            "feature.node.kubernetes.io/pci-10de.present"
        ]
    );
    let c = &pod["containers"][0];
    assert_eq!(c["env"][0]["name"], "NODE_NAME");
    assert_eq!(
        c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    let mounts: Vec<(String, bool)> = c["volumeMounts"]
        .as_array()
        .context("volumeMounts")?
        .iter()
        .map(|m| {
            (
                m["mountPath"].as_str().unwrap_or_default().to_owned(),
                m["readOnly"].as_bool().unwrap_or(false),
            )
        })
        .collect();
    assert_eq!(
        mounts,
        [
            ("/var/lib/kubelet/device-plugins".to_owned(), false),
            ("/var/lib/kubelet/pod-resources".to_owned(), true),
            ("/var/run/cdi".to_owned(), false),
            ("/dev".to_owned(), true),
            ("/host".to_owned(), true),
            ("/host/run/gpupool/mps".to_owned(), false),
        ]
    );
    // The host's `/` at /host, never over the image's /usr or /lib; the agent reads the
    // driver root there, and the driver root is the pools' unless the chart sets one.
    let host = c["volumeMounts"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["mountPath"] == "/host"))
        .context("/host mount")?;
    assert_eq!(host["mountPropagation"], "HostToContainer");
    let volume = pod["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == host["name"]))
        .context("host-root volume")?;
    assert_eq!(volume["hostPath"]["path"], "/");
    let args: Vec<&str> = c["args"]
        .as_array()
        .context("args")?
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(args.contains(&"--host-root=/host"), "{args:?}");
    // MPS: the one writable directory under /host, where the chrooted daemons find it.
    assert!(args.contains(&"--mps-root=/run/gpupool/mps"), "{args:?}");
    let mps = pod["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "mps"))
        .context("mps volume")?;
    assert_eq!(mps["hostPath"]["path"], "/run/gpupool/mps");
    assert_eq!(mps["hostPath"]["type"], "DirectoryOrCreate");
    assert!(
        !args.iter().any(|a| a.starts_with("--driver-root")),
        "{args:?}"
    );
    let text = template(
        &tools,
        "gpupool",
        "gpupool-system",
        &["agent.hostPaths.driverRoot=/run/nvidia/driver"],
    )?;
    assert!(
        text.contains("- --driver-root=/run/nvidia/driver"),
        "{text}"
    );

    // The operator's pod delete is opt-in.
    let role = find("ClusterRole", "gpupool-operator")?;
    let pod_rule = role["rules"]
        .as_array()
        .context("rules")?
        .iter()
        .find(|r| r["resources"][0] == "pods")
        .context("no pods rule")?;
    assert!(!pod_rule["verbs"].to_string().contains("delete"));
    let text = template(
        &tools,
        "gpupool",
        "gpupool-system",
        &["operator.rbac.allowPodDelete=true"],
    )?;
    assert!(text.contains("verbs: [get, list, watch, patch, delete]"));
    Ok(())
}

/// Whether every `key: value` of a `matchLabels` selector is among `labels`.
fn selects(selector: &serde_json::Value, labels: &serde_json::Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| s.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// `networkPolicy`: nothing by default. Enabled, one NetworkPolicy per component in that
/// component's namespace, selecting exactly its pods (no hook Job or test pod), ingress only,
/// on the metrics port its probes use, from exactly `networkPolicy.metricsFrom`; with no peer
/// listed, no ingress at all.
#[test]
fn network_policy_admits_only_the_listed_peers_to_the_metrics_ports() -> Result<()> {
    let tools = Tools::ensure()?;
    let docs = |sets: &[&str]| -> Result<Vec<serde_json::Value>> {
        let text = template(&tools, "r", "gs", sets)?;
        Ok(parse_objects(&text, std::path::Path::new("helm-template"))?
            .into_iter()
            .map(|m| serde_json::to_value(&m.object))
            .collect::<Result<_, _>>()?)
    };
    let policies = |docs: &[serde_json::Value]| -> Vec<serde_json::Value> {
        docs.iter()
            .filter(|o| o["kind"] == "NetworkPolicy")
            .cloned()
            .collect()
    };
    let find = |docs: &[serde_json::Value], kind: &str, name: &str| {
        docs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .cloned()
            .with_context(|| format!("no {kind}/{name}"))
    };

    let default = docs(&[])?;
    ensure!(
        policies(&default).is_empty(),
        "a NetworkPolicy rendered by default"
    );

    let enabled = docs(&[
        "networkPolicy.enabled=true",
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
        "networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus",
        "operator.metricsPort=9090",
        "agent.metricsPort=9100",
    ])?;
    ensure!(
        policies(&enabled).len() == 2,
        "{} NetworkPolicies",
        policies(&enabled).len()
    );
    let peers = json!([{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app": "prometheus"}},
    }]);
    // Every pod the chart can make: workloads' templates, hook Jobs' and the test pod.
    let pods: Vec<(String, &serde_json::Value, &serde_json::Value)> = enabled
        .iter()
        .filter_map(|o| {
            let name = format!(
                "{}/{}",
                o["kind"].as_str().unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap_or_default()
            );
            let ns = &o["metadata"]["namespace"];
            if o["kind"] == "Pod" {
                Some((name, ns, &o["metadata"]["labels"]))
            } else {
                let labels = &o["spec"]["template"]["metadata"]["labels"];
                labels.is_object().then_some((name, ns, labels))
            }
        })
        .collect();
    for (workload_kind, workload_name, policy_name, namespace, port) in [
        (
            "Deployment",
            "r-gpupool-operator",
            "r-gpupool-operator-metrics",
            "gs",
            9090,
        ),
        (
            "DaemonSet",
            "r-gpupool-agent",
            "r-gpupool-agent-metrics",
            "r-node",
            9100,
        ),
    ] {
        let workload = find(&enabled, workload_kind, workload_name)?;
        let policy = find(&enabled, "NetworkPolicy", policy_name)?;
        assert_eq!(policy["metadata"]["namespace"], namespace, "{policy_name}");
        assert_eq!(
            workload["metadata"]["namespace"], namespace,
            "{workload_name}"
        );

        let selector = &policy["spec"]["podSelector"]["matchLabels"];
        let selected: Vec<&str> = pods
            .iter()
            .filter(|(_, ns, labels)| *ns == namespace && selects(selector, labels))
            .map(|(name, _, _)| name.as_str())
            .collect();
        assert_eq!(
            selected,
            [format!("{workload_kind}/{workload_name}")],
            "{policy_name} selects the wrong pods"
        );

        assert_eq!(
            policy["spec"]["policyTypes"],
            json!(["Ingress"]),
            "{policy_name}"
        );
        assert_eq!(
            policy["spec"]["ingress"],
            json!([{"from": peers, "ports": [{"port": port, "protocol": "TCP"}]}]),
            "{policy_name}"
        );
        // The port the policy opens is the one the server listens on and the probes use.
        let c = &workload["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            c["ports"],
            json!([{"name": "metrics", "containerPort": port, "protocol": "TCP"}])
        );
        assert_eq!(c["livenessProbe"]["httpGet"]["port"], "metrics");
    }

    // Enabled with no peer: both policies admit nobody (the kubelet's probes, from the node,
    // are not subject to them).
    let closed = docs(&["networkPolicy.enabled=true"])?;
    let closed = policies(&closed);
    ensure!(closed.len() == 2, "{} NetworkPolicies", closed.len());
    for p in closed {
        assert_eq!(p["spec"]["ingress"], json!([]), "{}", p["metadata"]["name"]);
    }
    Ok(())
}

/// Renders with `sets` and applies with `--dry-run=server --validate=strict`; returns what
/// kubectl printed.
fn server_dry_run(cluster: &Cluster, release: &str, ns: &str, sets: &[&str]) -> Result<String> {
    let rendered = template(cluster.tools(), release, ns, sets)?;
    let run = cluster.kubectl().try_run(
        ["apply", "--dry-run=server", "--validate=strict", "-f", "-"],
        Some(&rendered),
    )?;
    ensure!(
        run.success,
        "the apiserver rejected the chart rendered with {sets:?}:\n{}",
        run.stderr
    );
    Ok(run.stdout)
}

#[tokio::test]
async fn rendered_chart_passes_strict_server_side_validation() -> Result<()> {
    let cluster = Cluster::shared()?;
    // The default pool (a GpuPool) is validated by the CRD's schema: the CRDs must exist.
    crds::install(cluster).await?;
    let scope = TestScope::new(cluster, "chart-dry-run")?;
    let release = scope.name("r");
    // Objects in the agent namespace the chart creates are only accepted once it exists; a
    // dry run does not create it.
    let agent_ns = format!("{release}-node");
    cluster.kubectl().run(["create", "namespace", &agent_ns])?;
    let _cleanup = NamespaceGuard(cluster, agent_ns.clone());
    // The `helm test` pod runs as the release namespace's default ServiceAccount, which the
    // controller manager creates a few seconds after the namespace; until then the apiserver
    // refuses the pod, dry run or not.
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.client().await?, scope.namespace());
    poll(
        "the release namespace's default ServiceAccount",
        Duration::from_secs(60),
        Duration::from_millis(250),
        || {
            let accounts = accounts.clone();
            async move { Ok(accounts.get_opt("default").await?.map(|_| ())) }
        },
    )
    .await?;

    let out = server_dry_run(cluster, &release, scope.namespace(), &[])?;
    assert!(
        out.contains("daemonset.apps/") && out.contains("(server dry run)"),
        "{out}"
    );

    let agent_ns_value = format!("agent.namespace.name={}", scope.namespace());
    let pool_name = format!("defaultPool.name={}", scope.name("pool"));
    let out = server_dry_run(
        cluster,
        &release,
        scope.namespace(),
        &[
            "crds.install=false",
            "operator.replicas=3",
            "operator.leaderElection.enabled=false",
            "operator.poolSelector=tier=gpu",
            "operator.logJson=false",
            "operator.rbac.allowPodDelete=true",
            "operator.image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "agent.namespace.create=false",
            &agent_ns_value,
            "agent.privileged=false",
            "agent.runtimeClassName=nvidia",
            "agent.hostPaths.driverRoot=/run/nvidia/driver",
            "agent.hostPaths.cdiDir=/etc/cdi",
            "agent.admissionPolicy.enabled=false",
            "operator.admissionPolicy.enabled=false",
            "agent.nodeSelector.pool=gpu",
            "agent.gpuNodeLabels[0].key=example.com/accelerator",
            "agent.gpuNodeLabels[0].value=nvidia",
            "defaultPool.enabled=true",
            &pool_name,
            "commonLabels.team=ml",
            "networkPolicy.enabled=true",
            "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
            "networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus",
            "networkPolicy.metricsFrom[1].ipBlock.cidr=10.0.0.0/8",
        ],
    )?;
    assert!(out.contains("-hooks-default-pool"), "{out}");
    assert!(
        out.matches("networkpolicy.networking.k8s.io/").count() == 2,
        "{out}"
    );
    assert!(!out.contains("customresourcedefinition"), "{out}");
    assert!(!out.contains("validatingadmissionpolicy"), "{out}");
    Ok(())
}

struct NamespaceGuard(&'static Cluster, String);

impl Drop for NamespaceGuard {
    fn drop(&mut self) {
        let _ = self.0.kubectl().run([
            "delete",
            "namespace",
            &self.1,
            "--ignore-not-found",
            "--wait=false",
        ]);
    }
}

#[tokio::test]
async fn wrong_values_fail_with_the_schema_message() -> Result<()> {
    let tools = Tools::ensure()?;
    let chart = chart_path();
    for (set, expected) in [
        (
            "operator.replica=3",
            "at '/operator': additional properties 'replica' not allowed",
        ),
        (
            "agent.hostPaths.cdiDir=var/run/cdi",
            "at '/agent/hostPaths/cdiDir'",
        ),
        ("agent.backend=cuda", "at '/agent/backend'"),
        ("operator.metricsPort=70000", "at '/operator/metricsPort'"),
        ("operator.initialList=all", "at '/operator/initialList'"),
        ("crds.install=yes", "at '/crds/install'"),
        ("tests.resource=amd.com/gpu", "at '/tests/resource'"),
        (
            "uninstall.timeoutSeconds=0",
            "at '/uninstall/timeoutSeconds'",
        ),
        (
            "networkPolicy.metricsFrom[0].podselector.app=x",
            "at '/networkPolicy/metricsFrom/0': additional properties 'podselector' not allowed",
        ),
    ] {
        let run = helm_try(&tools, None, &["template", "x", &chart, "--set", set])?;
        assert!(!run.success, "{set} was accepted");
        assert!(
            run.stderr
                .contains("values don't meet the specifications of the schema")
                && run.stderr.contains(expected),
            "{set}: {}",
            run.stderr
        );
    }

    // The same check stops `helm install` before anything reaches the cluster.
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "chart-bad-value")?;
    let release = scope.name("r");
    let run = helm_try(
        &tools,
        Some(cluster.kubeconfig()),
        &[
            "install",
            &release,
            &chart,
            "-n",
            scope.namespace(),
            "--set",
            "agent.hostPaths.cdiDir=var/run/cdi",
        ],
    )?;
    assert!(!run.success);
    assert!(
        run.stderr.contains("at '/agent/hostPaths/cdiDir'"),
        "{}",
        run.stderr
    );
    let list = helm(
        &tools,
        Some(cluster.kubeconfig()),
        &["list", "-n", scope.namespace(), "-q", "--all"],
    )?;
    assert!(list.trim().is_empty(), "a release was recorded: {list}");
    Ok(())
}

#[tokio::test]
async fn install_upgrade_and_uninstall_keep_the_crds() -> Result<()> {
    let cluster = Cluster::shared()?;
    let scope = TestScope::new(cluster, "chart-install")?;
    let kubectl = cluster.kubectl();
    let name = scope.name("gpupool");
    // The previous chart first (as last released), then an upgrade to this one: the CRDs
    // are upgraded in place and the pools stored under the old ones stay, same objects.
    let previous = previous_chart(&scope)?;
    // The CRDs may already be there, applied by other tests without helm: take them over.
    let release = Release::install_chart(
        cluster,
        &previous,
        &name,
        scope.namespace(),
        &["--take-ownership"],
        &["crds.install=true"],
    )?;
    let client = cluster.client().await?;
    scope.track_kind("gpupools.gpupool.io");
    let (k, v) = scope.label();
    let pool_name = scope.name("kept");
    let pools: Api<GpuPool> = Api::all(client.clone());
    let pool: GpuPool = serde_json::from_value(json!({
        "apiVersion": "gpupool.io/v1alpha1",
        "kind": "GpuPool",
        "metadata": {"name": pool_name, "labels": {k: v}},
        "spec": {"nodeSelector": {"matchLabels": {"e2e.gpupool.io/none": "x"}}},
    }))?;
    let before = pools.create(&Default::default(), &pool).await?;
    // Values of the older chart lack this one's new keys: helm's own way to upgrade them.
    release.upgrade_with("--reset-then-reuse-values", &[])?;
    let after = pools.get(&pool_name).await?;
    ensure!(
        after.metadata.uid == before.metadata.uid,
        "the pool was replaced by the upgrade"
    );
    let crd_api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let live = crd_api.get("gpupools.gpupool.io").await?;
    let shipped: CustomResourceDefinition = serde_yaml::from_str(&fs::read_to_string(
        repo_root().join("crds/gpupool.io_gpupools.yaml"),
    )?)?;
    let description = |crd: &CustomResourceDefinition| {
        crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| s.description.clone())
    };
    ensure!(
        description(&live) == description(&shipped) && description(&live).is_some(),
        "the CRD was not upgraded: {:?}",
        description(&live)
    );
    pools.delete(&pool_name, &Default::default()).await?;

    for crd in CRDS {
        tokio::time::timeout(
            Duration::from_secs(60),
            await_condition(crd_api.clone(), crd, conditions::is_crd_established()),
        )
        .await
        .with_context(|| format!("{crd} not Established"))??;
        let got = crd_api.get(crd).await?;
        assert_eq!(
            got.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("meta.helm.sh/release-name")),
            Some(&name),
            "{crd} is not owned by the release"
        );
    }

    // Every object of the release exists.
    let manifest = helm(
        cluster.tools(),
        Some(cluster.kubeconfig()),
        &["get", "manifest", &name, "-n", scope.namespace()],
    )?;
    let objects = kinds_and_names(&manifest)?;
    ensure!(objects.len() >= 18, "only {objects:?}");
    let got = kubectl.run_with_stdin(["get", "-f", "-", "-o", "name"], Some(&manifest))?;
    assert_eq!(got.lines().count(), objects.len(), "{got}");

    // The workloads came up (kwok runs their pods).
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), scope.namespace());
    let deploy = deployments.get(&release.operator_name()).await?;
    assert_eq!(
        deploy.status.as_ref().and_then(|s| s.ready_replicas),
        Some(2)
    );
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), &release.agent_namespace);
    let ds = daemonsets.get(&release.agent_name()).await?;
    let status = ds.status.clone().unwrap_or_default();
    ensure!(
        status.desired_number_scheduled >= 1
            && status.number_ready == status.desired_number_scheduled,
        "agent DaemonSet not ready: {status:?}"
    );

    // Upgrade: one operator replica, debug logs.
    release.upgrade(&["operator.replicas=1", "operator.logLevel=debug"])?;
    let history = helm(
        cluster.tools(),
        Some(cluster.kubeconfig()),
        &["history", &name, "-n", scope.namespace(), "-o", "json"],
    )?;
    let history: serde_json::Value = serde_json::from_str(&history)?;
    assert_eq!(history.as_array().map(Vec::len), Some(3), "{history}");
    let deploy = deployments.get(&release.operator_name()).await?;
    assert_eq!(deploy.spec.as_ref().and_then(|s| s.replicas), Some(1));
    let args = deploy
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers[0].args.clone())
        .unwrap_or_default();
    assert!(args.iter().any(|a| a == "--log=debug"), "{args:?}");

    // Uninstall: the release's objects go, the CRDs stay.
    helm(
        cluster.tools(),
        Some(cluster.kubeconfig()),
        &["uninstall", &name, "-n", scope.namespace(), "--wait"],
    )?;
    poll(
        "the operator Deployment deleted",
        Duration::from_secs(60),
        Duration::from_millis(250),
        || {
            let deployments = deployments.clone();
            let op = release.operator_name();
            async move { Ok(deployments.get_opt(&op).await?.is_none().then_some(())) }
        },
    )
    .await?;
    for crd in CRDS {
        ensure!(
            crd_api.get_opt(crd).await?.is_some(),
            "{crd} was deleted by helm uninstall"
        );
    }
    let cluster_roles = kubectl.run([
        "get",
        "clusterroles",
        "-l",
        &format!("app.kubernetes.io/instance={name}"),
        "-o",
        "name",
    ])?;
    assert!(cluster_roles.trim().is_empty(), "{cluster_roles}");
    drop(release);
    Ok(())
}

/// The commit whose chart was last released (the last landed main before the hooks and the
/// host-root mount); the upgrade test starts from it.
const PREVIOUS_CHART_COMMIT: &str = "b1ea7d0";

/// The chart as it was at [`PREVIOUS_CHART_COMMIT`], extracted from git under `target/`.
fn previous_chart(scope: &TestScope) -> Result<std::path::PathBuf> {
    let dir = repo_root()
        .join("target/e2e-previous-chart")
        .join(scope.prefix());
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let archive = std::process::Command::new("git")
        .arg("-C")
        .arg(repo_root())
        .args([
            "archive",
            "--format=tar",
            PREVIOUS_CHART_COMMIT,
            "charts/gpupool",
        ])
        .output()
        .context("running git archive")?;
    ensure!(
        archive.status.success(),
        "git archive {PREVIOUS_CHART_COMMIT}: {} (a clone with history is needed)",
        String::from_utf8_lossy(&archive.stderr)
    );
    let mut tar = std::process::Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(&dir)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("running tar")?;
    {
        use std::io::Write as _;
        let mut stdin = tar.stdin.take().context("tar stdin")?;
        stdin.write_all(&archive.stdout)?;
    }
    ensure!(tar.wait()?.success(), "tar -x of the previous chart failed");
    Ok(dir.join("charts/gpupool"))
}

#[test]
fn dockerfiles_build_in_stages_from_pinned_bases() -> Result<()> {
    for (path, needs_non_root) in [
        ("operator/Dockerfile", true),
        ("device-plugin/Dockerfile", false),
    ] {
        let text = fs::read_to_string(repo_root().join(path))
            .with_context(|| format!("reading {path}"))?;
        let instructions: Vec<(String, String)> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(|l| {
                let (op, rest) = l.split_once(char::is_whitespace)?;
                Some((op.to_ascii_uppercase(), rest.trim().to_owned()))
            })
            .collect();
        let froms: Vec<&String> = instructions
            .iter()
            .filter(|(op, _)| op == "FROM")
            .map(|(_, rest)| rest)
            .collect();
        ensure!(froms.len() >= 2, "{path}: not a multi-stage build");
        ensure!(
            froms[0].to_ascii_lowercase().contains(" as build"),
            "{path}: the first stage is not `FROM … AS build`: {}",
            froms[0]
        );
        for from in &froms {
            let image = from.split_whitespace().next().unwrap_or_default();
            if image == "build" || image == "scratch" {
                continue;
            }
            let tagged = image
                .rsplit('/')
                .next()
                .is_some_and(|last| last.contains(':'));
            ensure!(tagged || image.contains('@'), "{path}: {image} has no tag");
            ensure!(
                !image.ends_with(":latest"),
                "{path}: {image} uses the latest tag"
            );
        }
        ensure!(
            instructions
                .iter()
                .any(|(op, rest)| op == "COPY" && rest.contains("--from=build")),
            "{path}: the final stage copies nothing from the build stage"
        );
        let user = instructions
            .iter()
            .rev()
            .find(|(op, _)| op == "USER")
            .map(|(_, u)| u.clone());
        if needs_non_root {
            let user = user.with_context(|| format!("{path}: no USER"))?;
            ensure!(
                user != "root" && user != "0" && !user.starts_with("0:"),
                "{path}: runs as {user}"
            );
        }
        ensure!(
            instructions.iter().any(|(op, _)| op == "ENTRYPOINT"),
            "{path}: no ENTRYPOINT"
        );
    }
    Ok(())
}

/// The monitoring objects: the PrometheusRule only where the cluster serves the kind (and the
/// switch is on), its rules exactly the shared rules file; the dashboard ConfigMap labelled for
/// Grafana's sidecar, its JSON exactly the shared dashboard file; the ServiceMonitors naming
/// the jobs the rules expect and honouring the series' own labels.
#[test]
fn monitoring_objects_come_from_the_shared_files() -> Result<()> {
    let tools = Tools::ensure()?;
    let served = ["--api-versions", "monitoring.coreos.com/v1/PrometheusRule"];
    let find = |text: &str, kind: &str| -> Result<Vec<serde_json::Value>> {
        Ok(parse_objects(text, std::path::Path::new("helm-template"))?
            .into_iter()
            .filter(|m| m.object.types.as_ref().is_some_and(|t| t.kind == kind))
            .map(|m| {
                let mut v = m.object.data.clone();
                v["metadata"] = serde_json::to_value(&m.object.metadata).unwrap_or_default();
                v
            })
            .collect())
    };

    let text = template_with(&tools, "gpupool", "gpupool-system", &[], &served)?;
    let rules = find(&text, "PrometheusRule")?;
    ensure!(rules.len() == 1, "{} PrometheusRules", rules.len());
    let shipped: serde_json::Value = serde_yaml::from_str(&fs::read_to_string(
        repo_root().join("charts/gpupool/files/prometheus-rules.yaml"),
    )?)?;
    assert_eq!(
        rules[0]["spec"], shipped,
        "the PrometheusRule is not the rules file"
    );
    assert_eq!(rules[0]["metadata"]["namespace"], "gpupool-system");

    let default = template(&tools, "gpupool", "gpupool-system", &[])?;
    ensure!(
        find(&default, "PrometheusRule")?.is_empty(),
        "a PrometheusRule rendered for a cluster without the kind"
    );
    let off = template_with(
        &tools,
        "gpupool",
        "gpupool-system",
        &[
            "prometheusRule.enabled=false",
            "grafanaDashboard.enabled=false",
        ],
        &served,
    )?;
    ensure!(
        find(&off, "PrometheusRule")?.is_empty(),
        "prometheusRule.enabled=false ignored"
    );

    let dashboards: Vec<serde_json::Value> = find(&default, "ConfigMap")?
        .into_iter()
        .filter(|c| c["metadata"]["name"] == "gpupool-dashboard")
        .collect();
    ensure!(dashboards.len() == 1, "no dashboard ConfigMap");
    assert_eq!(
        dashboards[0]["metadata"]["labels"]["grafana_dashboard"],
        "1"
    );
    let json_text = dashboards[0]["data"]["gpupool.json"]
        .as_str()
        .context("no gpupool.json")?;
    let rendered: serde_json::Value = serde_json::from_str(json_text)?;
    let file: serde_json::Value = serde_json::from_str(&fs::read_to_string(
        repo_root().join("charts/gpupool/files/grafana-dashboard.json"),
    )?)?;
    assert_eq!(
        rendered, file,
        "the dashboard ConfigMap is not the dashboard file"
    );
    ensure!(
        !find(&off, "ConfigMap")?
            .iter()
            .any(|c| c["metadata"]["name"] == "gpupool-dashboard"),
        "grafanaDashboard.enabled=false ignored"
    );

    let monitored = template(
        &tools,
        "gpupool",
        "gpupool-system",
        &["serviceMonitor.enabled=true"],
    )?;
    let monitors = find(&monitored, "ServiceMonitor")?;
    ensure!(monitors.len() == 2, "{} ServiceMonitors", monitors.len());
    let rules_text =
        fs::read_to_string(repo_root().join("charts/gpupool/files/prometheus-rules.yaml"))?;
    for m in &monitors {
        assert_eq!(m["spec"]["jobLabel"], "gpupool.io/metrics-job");
        assert_eq!(m["spec"]["endpoints"][0]["honorLabels"], true);
    }
    let jobs: Vec<String> = find(&monitored, "Service")?
        .iter()
        .filter_map(|s| {
            s["metadata"]["labels"]["gpupool.io/metrics-job"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(jobs.len(), 2, "{jobs:?}");
    ensure!(
        jobs.iter().any(|j| j == "gpupool-agent") && rules_text.contains("job=\"gpupool-agent\""),
        "the agent's job name and the rules disagree: {jobs:?}"
    );
    Ok(())
}
