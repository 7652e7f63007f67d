#!/usr/bin/env bash
# The local demo: builds (or reuses) the control-plane tools, starts a real control plane with
# three simulated GPU nodes, installs the chart with helm, applies the example GpuPools and
# shows `kubectl get gpupools` / `kubectl get gpunodes`.
#
# Container images cannot be pulled here, so the chart's workloads are not what runs: the
# operator and node agents run as local processes once they exist (see README).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export PATH=$HOME/.cargo/bin:/usr/local/go/bin:$PATH
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/gpupool/target}

step() { printf '\n==> %s\n' "$*"; }

step "building or reusing the control-plane tools (first build: see README, Build times)"
start=$SECONDS
e2e/tools/build.sh
echo "tools ready in $((SECONDS - start))s"

step "starting the control plane with 3 simulated GPU nodes"
e2e/cluster up --nodes "${GPUPOOL_DEMO_NODES:-3}"
eval "$(e2e/cluster env)"
kubectl get nodes -L nvidia.com/gpu.product

step "installing the chart: helm install gpupool charts/gpupool -n gpupool-system --create-namespace"
helm upgrade --install gpupool charts/gpupool -n gpupool-system --create-namespace --wait
kubectl wait --for condition=established --timeout=60s crd/gpupools.gpupool.io crd/gpunodes.gpupool.io

step "applying the example pools"
kubectl apply -f examples/

step "kubectl get gpupools"
kubectl get gpupools
step "kubectl get gpunodes"
kubectl get gpunodes

cat <<MSG

The control plane is up. To explore:
  eval "\$(e2e/cluster env)"        # KUBECONFIG and the built kubectl/helm on PATH
  kubectl describe gpupool training
  kubectl explain gpupool.spec.reclaim
  kubectl apply -f crds/tests/invalid/10-mig-too-many-slices.yaml   # see admission reject it
Tear down with:
  e2e/cluster down
MSG
