#!/usr/bin/env bash
# Builds what a real node in the e2e cluster runs below the kubelet, with no
# registry and no Docker engine:
#
#   build.sh            containerd, containerd-shim-runc-v2, ctr and the CNI
#                       plugins (bridge, host-local, loopback) from the Go module
#                       pinned in go.mod here; prints the bin dir
#   build.sh images     the test images as one OCI image archive; prints its path
#   build.sh check      exit 0 if both can be built and run here, else print what
#                       is missing (exit 3)
#   build.sh --print-bin-dir | --print-images
#
# The images (all linux/amd64, one archive, imported with `ctr images import`):
#   gpupool.local/e2e/pause:1          the pod sandbox: a static C binary alone
#   gpupool.local/e2e/probe:1          Debian bookworm (minbase + python3) with
#                                      NVIDIA's nvidia-ml-py and /probe (C)
#   gpupool.local/e2e/probe-cuda-env:1 the same files, with the environment
#                                      NVIDIA's CUDA images set:
#                                      LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64
# The root file system comes from Debian's archive through mmdebstrap; the
# Python bindings from PyPI through pip.
#
# runc is not built here: the node uses the distribution's (`runc` on PATH;
# Debian's package). Outputs are cached under $GPUPOOL_CACHE_DIR/node/<hash of
# the pins and of this directory's sources>; a second run builds nothing.
#
# Environment:
#   GPUPOOL_CACHE_DIR       cache root (default ~/.cache/gpupool)
#   GPUPOOL_DEBIAN_MIRROR   Debian mirror for mmdebstrap (default http://deb.debian.org/debian)
#   GO                      the go command (default: go on PATH)
set -euo pipefail

DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z ${HOME:-} ]]; then
    HOME=$(getent passwd "$(id -u)" | cut -d: -f6)
    export HOME
fi
CACHE_DIR=${GPUPOOL_CACHE_DIR:-$HOME/.cache/gpupool}
MIRROR=${GPUPOOL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PYNVML=nvidia-ml-py==13.615.71
CUDA_IMAGE_LD_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64

# Go packages -> binary names.
PACKAGES=(
    github.com/containerd/containerd/v2/cmd/containerd
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
    github.com/containerd/containerd/v2/cmd/ctr
    github.com/containernetworking/plugins/plugins/main/bridge
    github.com/containernetworking/plugins/plugins/ipam/host-local
    github.com/containernetworking/plugins/plugins/main/loopback
)
BINARIES=(containerd containerd-shim-runc-v2 ctr bridge host-local loopback)

say() { printf 'node/build.sh: %s\n' "$*" >&2; }
die() {
    say "$*"
    exit 1
}

hash_of() { (cd "$DIR" && for f in "$@"; do printf '%s\n' "$f" && cat "$f"; done) | sha256sum | cut -c1-16; }
BIN_DIR="$CACHE_DIR/node/bin-$(hash_of build.sh go.mod go.sum)"
IMAGES_DIR="$CACHE_DIR/node/images-$(hash_of build.sh images/pause.c images/probe.c images/pyprobe.py)"
ARCHIVE="$IMAGES_DIR/e2e-images.oci.tar"

# --- check --------------------------------------------------------------------

# Prints the first missing piece; exit 3 then.
cmd_check() {
    local why="" t
    if [[ $(id -u) != 0 ]]; then
        why="not root (uid $(id -u)): containerd, runc and mmdebstrap's root mode need root"
    elif ! command -v runc >/dev/null; then
        why="runc is not on PATH (Debian: apt-get install runc)"
    elif ! command -v mmdebstrap >/dev/null && [[ ! -f $ARCHIVE ]]; then
        why="mmdebstrap is not on PATH and the images are not cached (Debian: apt-get install mmdebstrap)"
    elif ! command -v cc >/dev/null && [[ ! -f $ARCHIVE ]]; then
        why="no C compiler (cc) to build the pause and probe binaries"
    elif ! grep -qw overlay /proc/filesystems && ! modprobe overlay 2>/dev/null; then
        why="the kernel has no overlay file system (containerd's overlayfs snapshotter needs it)"
    fi
    for t in sha256sum tar; do
        [[ -n $why ]] || command -v "$t" >/dev/null || why="$t is not on PATH"
    done
    if [[ -n $why ]]; then
        echo "real node unsupported here: $why"
        return 3
    fi
    echo "ok: root, runc ($(runc --version | head -n1)), overlayfs, image tools"
}

# --- binaries -------------------------------------------------------------------

cmd_bin() {
    local b missing=0
    for b in "${BINARIES[@]}"; do [[ -x $BIN_DIR/$b ]] || missing=1; done
    if ((missing == 0)); then
        echo "$BIN_DIR"
        return 0
    fi
    local go=${GO:-go}
    command -v "$go" >/dev/null || go=/usr/local/go/bin/go
    mkdir -p "$BIN_DIR"
    exec 9>"$BIN_DIR/.lock"
    flock 9
    local log="$BIN_DIR/build.log" start=$SECONDS
    say "building containerd and the CNI plugins (log: $log)"
    # Static, without the btrfs/devmapper/zfs snapshotters (they need cgo); the
    # node uses overlayfs.
    if ! (cd "$DIR" && CGO_ENABLED=0 GOFLAGS=-mod=readonly "$go" build -p 2 -trimpath -buildvcs=false \
        -tags "no_btrfs no_devmapper no_zfs" -ldflags "-s -w" -o "$BIN_DIR/.tmp/" "${PACKAGES[@]}") >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        die "building containerd failed after $((SECONDS - start))s; see $log"
    fi
    for b in "${BINARIES[@]}"; do mv -f "$BIN_DIR/.tmp/$b" "$BIN_DIR/$b"; done
    rmdir "$BIN_DIR/.tmp"
    say "built in $((SECONDS - start))s"
    echo "$BIN_DIR"
}

# --- images ---------------------------------------------------------------------

# Writes a blob into the OCI layout at $1 and prints "<digest> <size>".
put_blob() {
    local layout=$1 file=$2 sum size
    sum=$(sha256sum "$file" | cut -d' ' -f1)
    size=$(stat -c %s "$file")
    mv -f "$file" "$layout/blobs/sha256/$sum"
    echo "sha256:$sum $size"
}

# Adds one image (a single uncompressed layer) to the layout; prints its
# manifest descriptor as JSON. Args: layout layer-digest layer-size name env-json cmd-json
add_image() {
    local layout=$1 layer=$2 lsize=$3 name=$4 env=$5 cmd=$6 tmp cfg msize mdigest csize
    tmp=$(mktemp -p "$layout")
    printf '{"architecture":"amd64","os":"linux","config":{"Env":%s,"Cmd":%s,"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":["%s"]}}' \
        "$env" "$cmd" "$layer" >"$tmp"
    read -r cfg csize < <(put_blob "$layout" "$tmp")
    tmp=$(mktemp -p "$layout")
    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
        "$cfg" "$csize" "$layer" "$lsize" >"$tmp"
    read -r mdigest msize < <(put_blob "$layout" "$tmp")
    printf '{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}' \
        "$mdigest" "$msize" "$name" "${name##*:}"
}

# A reproducible layer from a directory; prints "<digest> <size>".
layer_of() {
    local layout=$1 root=$2 tmp
    tmp=$(mktemp -p "$layout")
    tar --sort=name --numeric-owner --mtime=@0 --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
        --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' --exclude='./run/*' --exclude='./tmp/*' \
        -C "$root" -cf "$tmp" .
    put_blob "$layout" "$tmp"
}

# The images' root file systems under $1/pause and $1/probe. (Every step
# checked: errexit does not apply inside a function called left of `||`.)
build_roots() {
    local work=$1
    mkdir -p "$work/pause" "$work/layout/blobs/sha256" || return 1
    cc -O2 -static -o "$work/pause/pause" "$DIR/images/pause.c" || return 1
    mmdebstrap --variant=minbase --include=python3 --mode=root --format=directory \
        "$SUITE" "$work/probe" "$MIRROR" || return 1
    # Not a registry pull: pip fetches the pure-Python wheel, unpacked where
    # Debian's python3 looks for system packages.
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$work/wheel" "$PYNVML" || return 1
    python3 -m zipfile -e "$work"/wheel/*.whl "$work/probe/usr/lib/python3/dist-packages/" || return 1
    cc -O2 -Wall -o "$work/probe/probe" "$DIR/images/probe.c" -ldl || return 1
    cp "$DIR/images/pyprobe.py" "$work/probe/pyprobe.py" || return 1
    rm -rf "$work/probe/var/cache/apt" "$work/probe/var/lib/apt/lists"
}

cmd_images() {
    if [[ -f $ARCHIVE ]]; then
        echo "$ARCHIVE"
        return 0
    fi
    local why
    why=$(cmd_check) || die "$why"
    mkdir -p "$IMAGES_DIR"
    exec 8>"$IMAGES_DIR/.lock"
    flock 8
    [[ -f $ARCHIVE ]] && {
        echo "$ARCHIVE"
        return 0
    }
    local work start=$SECONDS
    work=$(mktemp -d -p "$IMAGES_DIR")
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    local log="$IMAGES_DIR/build.log"
    say "building the e2e images (log: $log)"
    build_roots "$work" >"$log" 2>&1 || {
        tail -n 20 "$log" >&2
        die "building the image root file systems failed; see $log"
    }
    local L=$work/layout pl pls ql qls d1 d2 d3
    read -r pl pls < <(layer_of "$L" "$work/pause")
    read -r ql qls < <(layer_of "$L" "$work/probe")
    local path='"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"'
    d1=$(add_image "$L" "$pl" "$pls" gpupool.local/e2e/pause:1 '[]' '["/pause"]')
    d2=$(add_image "$L" "$ql" "$qls" gpupool.local/e2e/probe:1 "[$path]" '["/probe"]')
    d3=$(add_image "$L" "$ql" "$qls" gpupool.local/e2e/probe-cuda-env:1 \
        "[$path,\"LD_LIBRARY_PATH=$CUDA_IMAGE_LD_PATH\"]" '["/probe"]')
    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[%s,%s,%s]}' \
        "$d1" "$d2" "$d3" >"$L/index.json"
    printf '{"imageLayoutVersion":"1.0.0"}' >"$L/oci-layout"
    tar --sort=name --mtime=@0 --numeric-owner -C "$L" -cf "$ARCHIVE.tmp" oci-layout index.json blobs
    mv -f "$ARCHIVE.tmp" "$ARCHIVE"
    say "images built in $((SECONDS - start))s: $(du -h "$ARCHIVE" | cut -f1)"
    echo "$ARCHIVE"
}

case ${1:-bin} in
    bin) cmd_bin ;;
    images) cmd_images ;;
    check) cmd_check ;;
    --print-bin-dir) echo "$BIN_DIR" ;;
    --print-images) echo "$ARCHIVE" ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" ;;
    *)
        echo "usage: build.sh [bin|images|check|--print-bin-dir|--print-images]" >&2
        exit 2
        ;;
esac
