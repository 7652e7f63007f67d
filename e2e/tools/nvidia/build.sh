#!/usr/bin/env bash
# Builds NVIDIA's nvidia-ctk and nvidia-device-plugin from the Go wrapper modules beside this
# script, for gpupool's conformance report and benchmark only (never a runtime dependency, not
# part of the default e2e/tools/build.sh). Both use go-nvml, which dlopens libnvidia-ml.so.1,
# so they are cgo binaries (CGO_ENABLED=1, needs gcc).
#
#   build.sh                  build (or reuse) both; prints the bin dir on stdout
#   build.sh --print-bin-dir  print the bin dir for the current pins and exit
#
# Binaries land in $GPUPOOL_CACHE_DIR/bin-nvidia/<hash> (default ~/.cache/gpupool), keyed by
# a hash of this script and the go.mod/go.sum files, so a second run builds nothing.
# Environment: GO (default: go on PATH, else /usr/local/go/bin/go), GPUPOOL_GO_BUILD_P
# (`go build -p`, default 2).
set -euo pipefail

DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z ${HOME:-} ]]; then
    HOME=$(getent passwd "$(id -u)" | cut -d: -f6)
    export HOME
fi
CACHE_DIR=${GPUPOOL_CACHE_DIR:-$HOME/.cache/gpupool}
BUILD_P=${GPUPOOL_GO_BUILD_P:-2}
GO_BIN=${GO:-$(command -v go || echo /usr/local/go/bin/go)}

hash=$(cd "$DIR" && cat build.sh ctk/go.mod ctk/go.sum device-plugin/go.mod device-plugin/go.sum |
    sha256sum | cut -c1-16)
BIN_DIR="$CACHE_DIR/bin-nvidia/$hash"
if [[ ${1:-} == --print-bin-dir ]]; then
    echo "$BIN_DIR"
    exit 0
fi
mkdir -p "$BIN_DIR"

pinned() { awk -v p="$2" '$1 == p || $1 == "require" && $2 == p { print $NF; exit }' "$1"; }

# name, wrapper module, package, version variable
build() {
    local name=$1 module=$2 pkg=$3 modpath=$4
    if [[ -x $BIN_DIR/$name ]]; then
        return 0
    fi
    local version
    version=$(pinned "$DIR/$module/go.mod" "$modpath")
    echo "build.sh: building $name $version (go build -p $BUILD_P)" >&2
    local start=$SECONDS
    (cd "$DIR/$module" && CGO_ENABLED=1 "$GO_BIN" build -p "$BUILD_P" -trimpath \
        -ldflags "-X $modpath/internal/info.version=$version" \
        -o "$BIN_DIR/$name.tmp" "$pkg") >&2
    mv "$BIN_DIR/$name.tmp" "$BIN_DIR/$name"
    echo "build.sh: $name built in $((SECONDS - start)) s" >&2
}

build nvidia-ctk ctk github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk \
    github.com/NVIDIA/nvidia-container-toolkit
build nvidia-device-plugin device-plugin github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin \
    github.com/NVIDIA/k8s-device-plugin
echo "$BIN_DIR"
