#!/usr/bin/env bash
# The local demo, from a fresh checkout:
#
#   ./demo.sh          build what is needed, start a real control plane with three simulated GPU
#                      nodes, install the chart with helm, run the operator and one node agent
#                      per node as local processes, apply three GpuPools, and show
#                      `kubectl get gpupools` / `kubectl get gpunodes` once they settle
#                      (and, when Debian's `prometheus` is installed, a Prometheus scraping them
#                      with the chart's alerting rules; it prints its URL and the alerts firing)
#   ./demo.sh down     stop the local processes and the control plane
#
# The nodes (created by e2e/cluster, simulated by kwok):
#   gpu-node-0  8 x H100 80GB, driver 550.54.15 / CUDA 12.4 — pool "inference", MIG all-1g.10gb
#   gpu-node-1  8 x A100 80GB, driver 535.104.05 / CUDA 12.2 — pool "training", which needs
#               CUDA 12.4: fails validation, and says why
#   gpu-node-2  4 x L4,        driver 550.54.15 / CUDA 12.4 — pool "serving"
#
# Container images cannot be pulled here, so the chart's Deployment and DaemonSet pods are
# kwok's stand-ins that run nothing. The real work is done by local processes that use the
# chart's own identities: the operator runs with a token of the chart's operator
# ServiceAccount, and each agent with a token of the agent ServiceAccount bound to the
# DaemonSet's pod on its node — so the chart's RBAC and its own-node admission policy apply
# exactly as in a cluster. The agents use simulated GPUs (device-plugin/fixtures format) and a
# fake driver root per node under target/demo/. No kubelet runs on these nodes, and the agents
# are told so (`--no-kubelet`): no pod can hold a device, so MIG changes need not wait for the
# kubelet's PodResources answer, which a real node always gives.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
REPO=$PWD
export PATH=$HOME/.cargo/bin:/usr/local/go/bin:$PATH
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/gpupool/target}
DEMO=$REPO/target/demo
# The fake nodes' host directories hold the plugins' unix sockets, whose paths must fit the
# 108 bytes of sun_path: under a deep checkout, target/ is too long, so they live in /tmp.
HOSTS=${GPUPOOL_DEMO_HOSTS:-${TMPDIR:-/tmp}/gpupool-demo-$(id -u)}
NS=gpupool-system
RELEASE=gpupool
AGENT_NS=$RELEASE-node
NODES=(gpu-node-0 gpu-node-1 gpu-node-2)
SETTLE_TIMEOUT=${GPUPOOL_DEMO_TIMEOUT:-240}

step() { printf '\n==> %s\n' "$*"; }
die() {
    printf 'demo: %s\n' "$*" >&2
    exit 1
}

# PID of a demo process if it is running and is ours (its command line names $DEMO).
demo_pid() {
    local f=$DEMO/pids/$1.pid pid
    [[ -f $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] || return 1
    grep -qaF -- "$DEMO/" "/proc/$pid/cmdline" || return 1
    echo "$pid"
}

stop_processes() {
    local f name pid
    [[ -d $DEMO/pids ]] || return 0
    for f in "$DEMO"/pids/*.pid; do
        [[ -e $f ]] || continue
        name=$(basename "$f" .pid)
        if pid=$(demo_pid "$name"); then
            echo "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$f"
    done
}

if [[ ${1:-up} == down ]]; then
    step "stopping the operator and the node agents"
    stop_processes
    step "taking the control plane down"
    e2e/cluster down
    rm -rf "$DEMO" "$HOSTS"
    exit 0
elif [[ ${1:-up} != up ]]; then
    die "usage: $0 [up|down]"
fi

step "building or reusing the control-plane tools (first build: see e2e/tools/BUILD-TIMES.md)"
start=$SECONDS
e2e/tools/build.sh
BIN=$(e2e/tools/build.sh --print-bin-dir)
echo "tools ready in $((SECONDS - start))s"

step "building the operator, the node agent and the fake driver root builder (cargo, debug profile)"
start=$SECONDS
# One cargo invocation per artifact (see e2e/artifacts.sh for why).
eval "$(e2e/artifacts.sh)"
# Private copies: the shared target directory may be rebuilt while the demo runs.
stop_processes
mkdir -p "$DEMO/bin" "$DEMO/pids" "$DEMO/logs"
cp "$GPUPOOL_OPERATOR_BIN" "$GPUPOOL_AGENT_BIN" "$GPUPOOL_FAKE_DRIVER_ROOT_BIN" "$DEMO/bin/"
FAKE_DRIVER_ROOT=$DEMO/bin/$(basename "$GPUPOOL_FAKE_DRIVER_ROOT_BIN")
echo "binaries ready in $((SECONDS - start))s"

step "starting the control plane with 3 simulated GPU nodes"
e2e/cluster up --nodes 3 >/dev/null
eval "$(e2e/cluster env)"
kubectl get nodes -L nvidia.com/gpu.product -L nvidia.com/gpu.count

step "installing the chart: helm install $RELEASE charts/gpupool -n $NS --create-namespace"
# --take-ownership: a cluster reused from an earlier run may hold CRDs applied without helm.
# Its warnings (the agent namespace's PodSecurity `warn: restricted` listing every exception
# the agent needs, by design) go to the log.
helm upgrade --install "$RELEASE" charts/gpupool -n "$NS" --create-namespace \
    --take-ownership --wait --timeout 120s >"$DEMO/logs/helm.log" 2>&1 ||
    {
        cat "$DEMO/logs/helm.log" >&2
        die "helm install failed"
    }
echo "installed (helm's output: $DEMO/logs/helm.log)"
kubectl wait --for condition=established --timeout=60s crd/gpupools.gpupool.io crd/gpunodes.gpupool.io
kubectl -n "$NS" get deploy,sa -o wide
kubectl -n "$AGENT_NS" get daemonset,pods -o wide

# A kubeconfig holding a ServiceAccount token: token_kubeconfig FILE SA NAMESPACE [POD]
token_kubeconfig() {
    local file=$1 sa=$2 ns=$3 pod=${4:-} token server ca
    local args=(create token "$sa" -n "$ns" --duration=24h)
    [[ -n $pod ]] && args+=(--bound-object-kind=Pod "--bound-object-name=$pod")
    token=$(kubectl "${args[@]}")
    server=$(kubectl config view --raw -o jsonpath='{.clusters[0].cluster.server}')
    ca=$(kubectl config view --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
    cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: gpupool-demo
  cluster: {server: "$server", certificate-authority-data: "$ca"}
users:
- name: $sa
  user: {token: "$token"}
contexts:
- name: gpupool-demo
  context: {cluster: gpupool-demo, user: $sa}
current-context: gpupool-demo
EOF
    chmod 600 "$file"
}

# A free local port, from $1 up.
free_port() {
    local p=$1
    while [[ -n $(ss -Htln "sport = :$p" 2>/dev/null) ]]; do p=$((p + 1)); done
    echo "$p"
}

# start NAME KUBECONFIG COMMAND...: a detached local process with its log and pid file.
start() {
    local name=$1 kc=$2
    shift 2
    KUBECONFIG=$kc setsid "$@" </dev/null >"$DEMO/logs/$name.log" 2>&1 &
    echo $! >"$DEMO/pids/$name.pid"
}

# fake_host DIR DRIVER_VERSION GPUS: a driver root as a driver installs it (device nodes as
# plain files, MIG capability minors, kernel module version, libraries, nvidia-smi, firmware;
# built by gpupool-fake-driver-root, the builder the tests use), a kubelet dir, a CDI dir.
fake_host() {
    local dir=$1 ver=$2 gpus=$3
    rm -rf "$dir"
    mkdir -p "$dir/kubelet/device-plugins" "$dir/cdi"
    : >"$dir/kmsg"   # the kernel log the XidErrors check reads: empty, no Xid since boot
    "$FAKE_DRIVER_ROOT" "$dir/driver" "$ver" "$gpus"
}

# One row per node: name, fixture model, GPUs, driver, CUDA.
NODE_GPUS=(
    "gpu-node-0 H100-SXM5-80GB 8 550.54.15 12.4"
    "gpu-node-1 A100-SXM4-80GB 8 535.104.05 12.2"
    "gpu-node-2 L4 4 550.54.15 12.4"
)

step "starting the operator as the chart's ServiceAccount ($NS/$RELEASE-operator), as a local process"
token_kubeconfig "$DEMO/operator.kubeconfig" "$RELEASE-operator" "$NS"
OPERATOR_PORT=$(free_port 28080)
start operator "$DEMO/operator.kubeconfig" "$DEMO/bin/gpupool-operator" \
    --http-addr "127.0.0.1:$OPERATOR_PORT" --lease-namespace "$NS" --identity demo-local \
    --reclaim-interval 5
echo "operator: log $DEMO/logs/operator.log, metrics http://127.0.0.1:$OPERATOR_PORT/metrics"

step "starting one node agent per node (simulated GPUs), each with a token bound to its DaemonSet pod"
port=$(free_port 28090)
AGENT_TARGETS=()
for row in "${NODE_GPUS[@]}"; do
    read -r node model gpus ver cuda <<<"$row"
    host=$HOSTS/$node
    fake_host "$host" "$ver" "$gpus"
    cat >"$host/fixture.yaml" <<EOF
node: $node
driver: {version: "$ver", cuda: "$cuda"}
gpus:
  - model: $model
    count: $gpus
EOF
    pod=""
    for _ in $(seq 1 120); do
        pod=$(kubectl -n "$AGENT_NS" get pods --field-selector "spec.nodeName=$node" -o name | head -n1)
        [[ -n $pod ]] && break
        sleep 0.5
    done
    [[ -n $pod ]] || die "no agent DaemonSet pod on $node"
    token_kubeconfig "$host/agent.kubeconfig" "$RELEASE-agent" "$AGENT_NS" "${pod#pod/}"
    port=$(free_port "$port")
    start "agent-$node" "$host/agent.kubeconfig" "$DEMO/bin/gpupool-device-plugin" \
        --node-name "$node" --backend sim --fixture "$host/fixture.yaml" \
        --kubelet-dir "$host/kubelet" --cdi-dir "$host/cdi" \
        --driver-root "$host/driver" --proc-root "$host/driver/proc" \
        --kmsg-path "$host/kmsg" --no-kubelet \
        --metrics-addr "127.0.0.1:$port" --validate-interval-secs 10
    echo "agent on $node: $gpus x $model, driver $ver; log $DEMO/logs/agent-$node.log, metrics http://127.0.0.1:$port/metrics"
    AGENT_TARGETS+=("'127.0.0.1:$port'")
    port=$((port + 1))
done

step "applying the demo's GpuPools"
kubectl apply -f - <<'EOF'
# H100 inference node: every GPU split into seven 1g.10gb MIG slices (nvidia.com/mig-1g.10gb).
apiVersion: gpupool.io/v1alpha1
kind: GpuPool
metadata:
  name: inference
spec:
  nodeSelector:
    matchLabels:
      nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
  driver:
    cudaVersion: "12.4"
  mig:
    strategy: mixed
    layout:
      preset: all-1g.10gb
---
# A100 training node: needs CUDA 12.4, but its driver is R535 (CUDA 12.2).
apiVersion: gpupool.io/v1alpha1
kind: GpuPool
metadata:
  name: training
spec:
  nodeSelector:
    matchLabels:
      nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB
  driver:
    minVersion: "535"
    cudaVersion: "12.4"
    onFailure: Taint
  reclaim:
    mode: DryRun
    idleAfter: 1h
---
# L4 serving node: every check on, each GPU time-sliced between four pods (no isolation).
apiVersion: gpupool.io/v1alpha1
kind: GpuPool
metadata:
  name: serving
spec:
  nodeSelector:
    matchLabels:
      nvidia.com/gpu.product: NVIDIA-L4
  driver:
    cudaVersion: "12.2"
  sharing:
    timeSlicing:
      replicas: 4
EOF

step "waiting for the pools to settle (up to ${SETTLE_TIMEOUT}s)"
ready() { kubectl get gpupools "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null || true; }
deadline=$((SECONDS + SETTLE_TIMEOUT))
while :; do
    inference=$(ready inference) serving=$(ready serving)
    problems=$(kubectl get gpupools training -o jsonpath='{.status.problems[*].message}' 2>/dev/null || true)
    line=$(printf '  %3ss  inference Ready=%-5s  serving Ready=%-5s  training problems: %s' \
        "$((SECONDS - deadline + SETTLE_TIMEOUT))" "${inference:-?}" "${serving:-?}" \
        "$([[ -n $problems ]] && echo reported || echo none yet)")
    # A line per change, not per poll.
    [[ ${line#*s  } != "${last:-}" ]] && echo "$line"
    last=${line#*s  }
    [[ $inference == True && $serving == True && -n $problems ]] && break
    for name in operator agent-gpu-node-0 agent-gpu-node-1 agent-gpu-node-2; do
        demo_pid "$name" >/dev/null || {
            echo
            tail -n 20 "$DEMO/logs/$name.log" >&2
            die "$name exited; its log is $DEMO/logs/$name.log"
        }
    done
    if ((SECONDS >= deadline)); then
        echo "demo: the pools did not settle within ${SETTLE_TIMEOUT}s; showing them as they are" >&2
        break
    fi
    sleep 1
done

# Prometheus (Debian's `prometheus` package), when installed: scrapes the operator and the agents
# under the job names the chart's ServiceMonitors use, with the chart's alerting rules, each
# `for:` shortened to 15s so the alerts show within the demo (the chart keeps the real ones).
PROM_URL=""
if command -v prometheus >/dev/null; then
    step "starting Prometheus on a loopback port, scraping the operator and the agents"
    mkdir -p "$DEMO/prometheus"
    sed -E 's/^([[:space:]]*)for: .*/\1for: 15s/' charts/gpupool/files/prometheus-rules.yaml \
        >"$DEMO/prometheus/rules.yaml"
    targets=$(IFS=,; echo "${AGENT_TARGETS[*]}")
    cat >"$DEMO/prometheus/prometheus.yml" <<CONFIG
global: {scrape_interval: 5s, evaluation_interval: 5s}
rule_files: [rules.yaml]
scrape_configs:
  - job_name: gpupool-operator
    honor_labels: true
    static_configs: [{targets: ['127.0.0.1:$OPERATOR_PORT']}]
  - job_name: gpupool-agent
    honor_labels: true
    static_configs: [{targets: [$targets]}]
CONFIG
    PROM_PORT=$(free_port 29090)
    start prometheus "" prometheus --config.file="$DEMO/prometheus/prometheus.yml" \
        --storage.tsdb.path="$DEMO/prometheus/data" --web.listen-address="127.0.0.1:$PROM_PORT"
    PROM_URL=http://127.0.0.1:$PROM_PORT
    # The old-driver node's alert: pending for its 15s, then firing.
    query='ALERTS{alertstate="firing",alertname="GpupoolDriverCheckFailed",node="gpu-node-1"}'
    for _ in $(seq 1 90); do
        curl -sf --get "$PROM_URL/api/v1/query" --data-urlencode "query=$query" 2>/dev/null |
            grep -q '"alertname"' && break
        sleep 1
    done
    echo "Prometheus: $PROM_URL (alerts: $PROM_URL/alerts; log $DEMO/logs/prometheus.log)"
    echo "gpupool alerts firing now (alert{where}):"
    curl -sf --get "$PROM_URL/api/v1/query" \
        --data-urlencode 'query=ALERTS{alertstate="firing",alertname=~"Gpupool.*"}' |
        grep -o '"metric":{[^}]*}' | while read -r alert; do
        name=$(grep -o '"alertname":"[^"]*"' <<<"$alert" | cut -d'"' -f4)
        where=$(grep -oE '"(node|pool)":"[^"]*"' <<<"$alert" | tr -d '"' | sed 's/:/="/; s/$/"/' | paste -sd, -)
        echo "  $name{$where}"
    done
else
    echo
    echo "prometheus is not installed (apt-get install prometheus): no Prometheus in this demo"
fi

step "kubectl get gpupools"
kubectl get gpupools
step "kubectl get gpunodes"
kubectl get gpunodes
step "why training is not Ready"
kubectl get gpupools training -o jsonpath='{range .status.problems[*]}{.node}: {.reason}: {.message}{"\n"}{end}'

cat <<MSG

Everything runs on this machine: the control plane (e2e/cluster), the operator and three node
agents (local processes, logs in target/demo/logs/). To explore:
  eval "\$(e2e/cluster env)"                  # KUBECONFIG and the built kubectl/helm on PATH
  kubectl describe gpupools training           # conditions, per-node problems, events
  kubectl get gpunode gpu-node-0 -o yaml       # what the agent reports: GPUs, MIG devices, checks, CDI
  kubectl get node gpu-node-1 -o jsonpath='{.spec.taints}'   # the driver-invalid taint
  cat $HOSTS/gpu-node-0/cdi/gpupool-nvidia.yaml   # the CDI spec the agent wrote
  curl -s http://127.0.0.1:$OPERATOR_PORT/metrics | grep gpupool_
  curl -s ${PROM_URL:-http://127.0.0.1:<prometheus>}/api/v1/alerts   # the alerts Prometheus holds
  kubectl apply -f crds/tests/invalid/10-mig-too-many-slices.yaml   # admission rejects it
Tear down (local processes and the control plane):
  ./demo.sh down
MSG
