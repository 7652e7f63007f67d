#!/usr/bin/env bash
# Builds the project's own artifacts that the tests and the demo run, one explicit cargo
# invocation each, and prints `export` lines naming them:
#
#   eval "$(e2e/artifacts.sh)"
#
#   GPUPOOL_OPERATOR_BIN   the operator          (cargo build -p gpupool-operator --bin …)
#   GPUPOOL_AGENT_BIN      the node agent        (cargo build -p gpupool-device-plugin --bin …)
#   GPUPOOL_FAKE_NVML_LIB  the fake NVML library (cargo build -p gpupool-fake-nvml --lib)
#   GPUPOOL_FAKE_CUDA_LIB  the fake CUDA driver library, for in-container probes
#                          (cargo build -p gpupool-fake-cuda --lib)
#   GPUPOOL_FAKE_DRIVER_ROOT_BIN  the demo's fake driver root builder
#                                 (cargo build -p gpupool-sim --bin gpupool-fake-driver-root)
#
# One invocation per artifact: a `--bin` filter makes cargo skip a cdylib named beside it, and
# packages built together share unified features, which is not how either ships. Each output
# is checked to exist, so a build that only a warm target directory satisfied fails here, with
# its name, instead of inside a test. Progress goes to stderr; stdout carries only the exports.
#
# Environment: CARGO_TARGET_DIR (default <repo>/target).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$REPO/target}
cd "$REPO"

build() {
    local out=$1
    shift
    echo "artifacts: cargo build --locked $*" >&2
    CARGO_TARGET_DIR=$TARGET cargo build --locked "$@" >&2
    if [[ ! -f $TARGET/debug/$out ]]; then
        echo "artifacts: cargo build $* left no $TARGET/debug/$out" >&2
        exit 1
    fi
}

build gpupool-operator -p gpupool-operator --bin gpupool-operator
build gpupool-device-plugin -p gpupool-device-plugin --bin gpupool-device-plugin
build libnvidia_ml.so -p gpupool-fake-nvml --lib
build libcuda_fake.so -p gpupool-fake-cuda --lib
build gpupool-fake-driver-root -p gpupool-sim --bin gpupool-fake-driver-root

printf 'export GPUPOOL_OPERATOR_BIN=%q\n' "$TARGET/debug/gpupool-operator"
printf 'export GPUPOOL_AGENT_BIN=%q\n' "$TARGET/debug/gpupool-device-plugin"
printf 'export GPUPOOL_FAKE_NVML_LIB=%q\n' "$TARGET/debug/libnvidia_ml.so"
printf 'export GPUPOOL_FAKE_CUDA_LIB=%q\n' "$TARGET/debug/libcuda_fake.so"
printf 'export GPUPOOL_FAKE_DRIVER_ROOT_BIN=%q\n' "$TARGET/debug/gpupool-fake-driver-root"
