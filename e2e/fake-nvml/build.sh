#!/usr/bin/env bash
# Builds the fake NVML library and links it under the driver's name. Prints the path to load:
#   GPUPOOL_NVML_LIBRARY=$(e2e/fake-nvml/build.sh) GPUPOOL_FAKE_NVML_FIXTURE=device-plugin/fixtures/h100-8x.yaml ...
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
profile=${1:-debug}
args=(build --quiet -p gpupool-fake-nvml --manifest-path "$root/Cargo.toml")
[ "$profile" = release ] && args+=(--release)
cargo "${args[@]}"
# Not next to the build output: cargo puts <target>/<profile> on LD_LIBRARY_PATH for tests and
# `cargo run`, and a libnvidia-ml.so.1 there would shadow a real driver's.
dir=$target/fake-nvml-lib
mkdir -p "$dir"
ln -sf "$target/$profile/libnvidia_ml.so" "$dir/libnvidia-ml.so.1"
echo "$dir/libnvidia-ml.so.1"
