#!/usr/bin/env bash
# The whole test suite: unit, conformance and device-plugin tests (no cluster needed), then the
# end-to-end tests against a real local control plane built from Go modules (e2e/run-tests.sh
# builds or reuses the tools, brings the cluster up and always takes it down).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export PATH=$HOME/.cargo/bin:/usr/local/go/bin:$PATH
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/gpupool/target}

echo "==> the operator, the node agent and the fake libnvidia-ml (one cargo build each)"
eval "$(e2e/artifacts.sh)"

echo "==> unit, conformance and device-plugin tests"
cargo test --workspace --exclude gpupool-e2e --locked

# The real-kubelet layer (e2e/tests/kubelet.rs) runs a kubelet, which needs root; as root it is
# on unless GPUPOOL_E2E_KUBELET says otherwise, elsewhere it skips and says why.
if [[ $(id -u) == 0 ]]; then
    export GPUPOOL_E2E_KUBELET=${GPUPOOL_E2E_KUBELET:-1}
fi

echo "==> end-to-end tests against a real control plane"
e2e/run-tests.sh
