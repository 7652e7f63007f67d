#!/usr/bin/env bash
# gpupool side by side with NVIDIA's nvidia-ctk and k8s-device-plugin on the same simulated
# hardware (the fake libnvidia-ml.so). Builds what is missing, then runs:
#
#   compare.sh conformance   the conformance report (exit 1 on an unexpected difference)
#   compare.sh bench         the benchmark table
#   compare.sh               both
#
# Needs root (mknod for the fake driver root's device nodes; unshare -m for NVIDIA's plugin,
# whose socket directory is compiled in), gcc and Go >= 1.26 for the NVIDIA binaries.
# Work files go to $GPUPOOL_NVIDIA_WORK (default: a temp dir, removed at exit).
set -euo pipefail
DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$DIR/../../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}

bin=$("$DIR/build.sh")
export NVIDIA_CTK=$bin/nvidia-ctk NVIDIA_DEVICE_PLUGIN=$bin/nvidia-device-plugin
# A release build: every NVML call of both stacks goes through it, and a debug build's cost
# (each call reads the state file) would sit in the latency figures.
export GPUPOOL_FAKE_NVML_LIB=${GPUPOOL_FAKE_NVML_LIB:-$("$REPO/e2e/fake-nvml/build.sh" release)}
export GPUPOOL_REPO=$REPO
cargo build --quiet --release --manifest-path "$DIR/compare/Cargo.toml"
compare=$CARGO_TARGET_DIR/release/gpupool-nvidia-compare

work=${GPUPOOL_NVIDIA_WORK:-}
if [[ -z $work ]]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
case ${1:-all} in
    conformance) "$compare" conformance "$work" ;;
    bench) "$compare" bench "$work" ;;
    all)
        "$compare" conformance "$work"
        "$compare" bench "$work"
        ;;
    *)
        echo "usage: compare.sh [conformance|bench]" >&2
        exit 2
        ;;
esac
