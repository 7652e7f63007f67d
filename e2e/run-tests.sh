#!/usr/bin/env bash
# Runs gpupool's end-to-end tests against a fresh local control plane:
# builds (or reuses) the tools, brings the cluster up, runs
# `cargo test -p gpupool-e2e` against it, and always takes it down again —
# on success, on test failure, and on Ctrl-C.
#
#   e2e/run-tests.sh [cargo test args...]     e.g. e2e/run-tests.sh -- --test-threads=2
#
# Environment:
#   GPUPOOL_E2E_DIR        cluster state directory (default <repo>/target/e2e-run)
#   GPUPOOL_E2E_NODES      fake GPU nodes (default 3)
#   GPUPOOL_E2E_KEEP_LOGS  where to copy the component logs when tests fail
#                          (default <repo>/target/e2e-logs)
#   GPUPOOL_E2E_KUBELET    1: also build the real-kubelet layer's tools (kubelet, fakecri)
#                          and the real node's (containerd, CNI plugins, test images)
#   GPUPOOL_OPERATOR_BIN, GPUPOOL_AGENT_BIN, GPUPOOL_FAKE_NVML_LIB, GPUPOOL_FAKE_CUDA_LIB
#                          prebuilt artifacts; when any is unset, e2e/artifacts.sh builds all
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export GPUPOOL_E2E_DIR=${GPUPOOL_E2E_DIR:-$REPO/target/e2e-run}
NODES=${GPUPOOL_E2E_NODES:-3}
KEEP_LOGS=${GPUPOOL_E2E_KEEP_LOGS:-$REPO/target/e2e-logs}
CLUSTER="$REPO/e2e/cluster"

say() { printf 'run-tests: %s\n' "$*" >&2; }

teardown() {
    local rc=$?
    trap - EXIT INT TERM
    if ((rc != 0)) && [[ -d $GPUPOOL_E2E_DIR/logs ]]; then
        rm -rf "$KEEP_LOGS"
        mkdir -p "$KEEP_LOGS"
        cp -r "$GPUPOOL_E2E_DIR/logs/." "$KEEP_LOGS/" || true
        say "tests failed (exit $rc); component logs copied to $KEEP_LOGS"
    fi
    say "taking the cluster down"
    if ! "$CLUSTER" down; then
        say "e2e/cluster down failed; state left in $GPUPOOL_E2E_DIR"
        ((rc != 0)) || rc=1
    fi
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say "building or reusing the tools"
"$REPO/e2e/tools/build.sh"
if [[ ${GPUPOOL_E2E_KUBELET:-0} == 1 ]]; then
    # The real-kubelet layer's tools, built here rather than inside the test that needs them.
    "$REPO/e2e/tools/build.sh" kubelet fakecri
    # The real node's runtime and images, when this machine can run them (`check` says why not;
    # the node test then skips with the same words).
    if "$REPO/e2e/tools/node/build.sh" check >&2; then
        "$REPO/e2e/tools/node/build.sh" bin >/dev/null
        "$REPO/e2e/tools/node/build.sh" images >/dev/null
    fi
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
if [[ -z ${GPUPOOL_OPERATOR_BIN:-} || -z ${GPUPOOL_AGENT_BIN:-} || -z ${GPUPOOL_FAKE_NVML_LIB:-} ||
    -z ${GPUPOOL_FAKE_CUDA_LIB:-} ]]; then
    say "building the operator, the node agent, the fake libnvidia-ml and the fake libcuda"
    eval "$("$REPO/e2e/artifacts.sh")"
fi

say "bringing the cluster up in $GPUPOOL_E2E_DIR"
"$CLUSTER" up --nodes "$NODES" >/dev/null
export KUBECONFIG=$GPUPOOL_E2E_DIR/kubeconfig
export GPUPOOL_E2E_REUSE=1

# --no-fail-fast: one failing test binary does not hide how the others fare.
say "cargo test -p gpupool-e2e --no-fail-fast $*"
cargo test -p gpupool-e2e --no-fail-fast "$@"
