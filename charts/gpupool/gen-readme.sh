#!/usr/bin/env bash
# Regenerates the values table in charts/gpupool/README.md from values.yaml's comments; the
# test that runs here (crds/tests/chart_readme.rs) fails under ./test.sh when they drift.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PATH=$HOME/.cargo/bin:$PATH
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/gpupool/target}
GPUPOOL_WRITE_CHART_README=1 cargo test -q -p gpupool-crds --test chart_readme
