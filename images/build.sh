#!/usr/bin/env bash
# Builds the two release images, without Docker, as OCI image archives:
#
#   images/out/gpupool-operator-<version>-amd64.oci.tar       ghcr.io/gpupool/gpupool-operator:<version>
#   images/out/gpupool-device-plugin-<version>-amd64.oci.tar  ghcr.io/gpupool/gpupool-device-plugin:<version>
#
# Their paths are printed on stdout, one per line; progress goes to stderr.
# <version> is the chart's appVersion (charts/gpupool/Chart.yaml), the tag the chart deploys.
# Load one with `ctr -n k8s.io images import FILE` (the index names it through
# io.containerd.image.name), `podman load -i FILE` or `skopeo copy oci-archive:FILE docker://…`.
#
# Usage: images/build.sh [--check] [--out DIR] [--binaries DIR]
#        images/build.sh verify ARCHIVE...
#   --check     after building, verify the archives (images/verify.py) and fail on any mismatch;
#               then check that the verifier rejects tampered copies of the first one
#   --binaries  take gpupool-operator and gpupool-device-plugin from DIR instead of building
#               them (the e2e suite packs its debug builds this way: release builds are too
#               slow for CI); their debug info is stripped so the layers stay small. Not for
#               release: the images then hold whatever DIR held.
#   verify    only verify existing archives (and run that self-test)
#
# Layers: a base (Debian bookworm's libc6, libgcc-s1, ca-certificates, tzdata, base-files,
# netbase, unpacked by `mmdebstrap --variant=extract`: no shell, no dpkg, no package manager,
# the same set as distroless/cc-debian12), shared by both images, and one layer per binary
# (`cargo build --locked --release`). The operator runs as gpupool (65532:65532) from
# /usr/local/bin, as operator/Dockerfile builds it. The agent runs as root from
# /gpupool-device-plugin, on the image's own glibc: the chart mounts the host's / at /host,
# never over the image's /usr or /lib, and the agent loads NVML from the driver root by full
# path (--host-root).
#
# Reproducible: every mtime is SOURCE_DATE_EPOCH (the last commit's time unless set), tars
# are sorted with numeric owners, gzip stores no name or time, and the files that differ
# per run (apt lists and caches, logs, resolv.conf, hostname, machine-id) are removed. Two
# builds of the same commit on the same day give the same manifest digests. Across days the
# Debian mirror moves on; for a fixed base set GPUPOOL_DEBIAN_MIRROR to a
# snapshot.debian.org URL. The binaries are as reproducible as the Rust build (same
# toolchain, same source and target paths). cargo sees SOURCE_DATE_EPOCH too (the cc crate
# hands it to the C compilers of ring, aws-lc-sys and psm), so after each new commit those
# crates and everything above them rebuild: about 5 minutes on 2 cores, 13 from nothing.
#
# Needs: root (mmdebstrap's root mode), mmdebstrap, cargo, python3 (verify), tar, gzip, jq.
#
# Architectures: amd64 only. arm64 needs the Rust target (`rustup target add
# aarch64-unknown-linux-gnu`) and a cross linker (Debian's gcc-aarch64-linux-gnu, with
# CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc), then
# `mmdebstrap --architectures=arm64` for the base, which extracts without running anything.
# What blocks it on the machine this was written on: only x86_64-unknown-linux-gnu is in
# `rustup target list --installed`, and gcc-aarch64-linux-gnu (Debian 4:12.2.0-3) is available
# from apt but not installed.
#
# Environment:
#   GPUPOOL_DEBIAN_MIRROR   Debian mirror (default http://deb.debian.org/debian)
#   SOURCE_DATE_EPOCH       timestamp for every file and for .created (default: HEAD's commit time)
#   CARGO_TARGET_DIR        where cargo builds (default: target/ in the repository)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$ROOT/images/out
MIRROR=${GPUPOOL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
ARCH=amd64
BASE_PACKAGES=libc6,libgcc-s1,ca-certificates,tzdata,base-files,netbase
REGISTRY=ghcr.io/gpupool
SOURCE_URL=https://github.com/gpupool/gpupool
LICENSE=Apache-2.0
PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

say() { echo "images: $*" >&2; }
die() {
    echo "images: error: $*" >&2
    exit 1
}

# --- OCI writer -------------------------------------------------------------------

# Moves a file into the layout's blobs; prints "<digest> <size>".
put_blob() {
    local layout=$1 file=$2 sum size
    sum=$(sha256sum "$file" | cut -d' ' -f1)
    size=$(stat -c %s "$file")
    mv -f "$file" "$layout/blobs/sha256/$sum"
    echo "sha256:$sum $size"
}

# A reproducible gzip layer of a directory; prints "<blob digest> <size> <diff_id>".
layer_of() {
    local layout=$1 root=$2 tar diff_id blob size
    tar=$(mktemp -p "$layout")
    tar --sort=name --numeric-owner --owner=0 --group=0 --mtime="@$SOURCE_DATE_EPOCH" \
        --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
        --format=posix -C "$root" -cf "$tar" .
    diff_id=sha256:$(sha256sum "$tar" | cut -d' ' -f1)
    gzip -9n "$tar"
    read -r blob size < <(put_blob "$layout" "$tar.gz")
    echo "$blob $size $diff_id"
}

# Writes one image's config and manifest, and its archive. Args: name layout title
# config-json(the "config" object) layer-triples...
write_image() {
    local name=$1 layout=$2 title=$3 runconfig=$4
    shift 4
    local layers='[]' diff_ids='[]' blob size diff tmp cfg csize mdigest msize ref
    while (($#)); do
        read -r blob size diff <<<"$1"
        shift
        layers=$(jq -c --arg d "$blob" --argjson s "$size" \
            '. + [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $d, size: $s}]' <<<"$layers")
        diff_ids=$(jq -c --arg d "$diff" '. + [$d]' <<<"$diff_ids")
    done
    ref=$REGISTRY/$name:$VERSION
    local annotations
    annotations=$(jq -cn --arg src "$SOURCE_URL" --arg v "$VERSION" --arg rev "$REVISION" \
        --arg created "$CREATED" --arg title "$title" --arg lic "$LICENSE" '{
            "org.opencontainers.image.source": $src,
            "org.opencontainers.image.version": $v,
            "org.opencontainers.image.revision": $rev,
            "org.opencontainers.image.created": $created,
            "org.opencontainers.image.title": $title,
            "org.opencontainers.image.licenses": $lic}')
    tmp=$(mktemp -p "$layout")
    jq -cn --arg arch "$ARCH" --arg created "$CREATED" --argjson config "$runconfig" \
        --argjson diff_ids "$diff_ids" --argjson labels "$annotations" '{
            created: $created, architecture: $arch, os: "linux",
            config: ($config + {Labels: $labels}),
            rootfs: {type: "layers", diff_ids: $diff_ids},
            history: [{created: $created, created_by: "images/build.sh"}]}' >"$tmp"
    read -r cfg csize < <(put_blob "$layout" "$tmp")
    tmp=$(mktemp -p "$layout")
    jq -cn --arg cfg "$cfg" --argjson csize "$csize" --argjson layers "$layers" \
        --argjson ann "$annotations" '{
            schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
            config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cfg, size: $csize},
            layers: $layers, annotations: $ann}' >"$tmp"
    read -r mdigest msize < <(put_blob "$layout" "$tmp")
    jq -cn --arg m "$mdigest" --argjson ms "$msize" --arg arch "$ARCH" --arg ref "$ref" \
        --arg tag "$VERSION" --argjson ann "$annotations" '{
            schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json",
            manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $m, size: $ms,
                platform: {architecture: $arch, os: "linux"},
                annotations: {"io.containerd.image.name": $ref, "org.opencontainers.image.ref.name": $tag}}],
            annotations: $ann}' >"$layout/index.json"
    printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
    local archive=$OUT/$name-$VERSION-$ARCH.oci.tar
    tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
        -C "$layout" -cf "$archive.tmp" oci-layout index.json blobs
    mv -f "$archive.tmp" "$archive"
    say "$ref  manifest $mdigest  $(du -h "$archive" | cut -f1)  $archive"
    echo "$archive"
}

# --- root file systems ------------------------------------------------------------

# The shared base: Debian's packages unpacked (no maintainer scripts run), then what those
# scripts would have made and nothing that changes from run to run.
build_base() {
    local base=$1
    SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH mmdebstrap --variant=extract --mode=root \
        --architectures=$ARCH --include=$BASE_PACKAGES --format=directory \
        "$SUITE" "$base" "$MIRROR" >&2 ||
        die "mmdebstrap failed (mirror $MIRROR)"
    (
        cd "$base"
        # Package tooling (no shell or dpkg to run it), docs except the licenses, and files
        # that differ per run or are the runtime's to provide.
        rm -rf usr/bin/* usr/sbin/* usr/share/perl5 usr/share/man usr/share/info \
            usr/share/lintian usr/share/debconf usr/lib/x86_64-linux-gnu/perl* \
            etc/apt etc/debconf.conf etc/update-motd.d etc/profile.d etc/skel \
            etc/dpkg etc/default etc/fstab \
            var/cache var/log var/lib/apt var/lib/dpkg/triggers var/lib/dpkg/updates \
            var/lib/dpkg/info var/lib/dpkg/alternatives var/lib/dpkg/lock* var/lib/debconf \
            etc/resolv.conf etc/hostname etc/machine-id etc/ld.so.cache var/cache/ldconfig \
            dev/* proc/* sys/* run/* tmp/*
        find usr/share/doc -mindepth 2 ! -name copyright ! -type d -delete
        find usr/share/doc -mindepth 1 -type d -empty -delete
        mkdir -p var/cache var/log var/lib/dpkg home/gpupool
        chown 65532:65532 home/gpupool
        # What ca-certificates' postinst builds: the bundle every TLS stack looks for.
        mkdir -p etc/ssl/certs
        find usr/share/ca-certificates -name '*.crt' -print0 | LC_ALL=C sort -z |
            xargs -0 cat >etc/ssl/certs/ca-certificates.crt
        # What base-passwd and tzdata's postinst would write; gpupool is distroless's nonroot.
        cat >etc/passwd <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
gpupool:x:65532:65532:gpupool:/home/gpupool:/sbin/nologin
EOF
        cat >etc/group <<'EOF'
root:x:0:
nogroup:x:65534:
gpupool:x:65532:
EOF
        printf 'passwd: files\ngroup: files\nhosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n' \
            >etc/nsswitch.conf
        ln -sfn /usr/share/zoneinfo/Etc/UTC etc/localtime
        echo Etc/UTC >etc/timezone
    ) || die "pruning the base in $base failed"
}

# --- commands -----------------------------------------------------------------------

cmd_build() {
    [[ $(id -u) == 0 ]] || die "needs root: mmdebstrap's root mode keeps file owners"
    local tools=(mmdebstrap jq gzip tar sha256sum) tool bin_dir
    if [[ -n $BINARIES ]]; then tools+=(strip); else tools+=(cargo); fi
    for tool in "${tools[@]}"; do
        command -v "$tool" >/dev/null || die "$tool is not on PATH"
    done
    local start=$SECONDS
    if [[ -n $BINARIES ]]; then
        bin_dir=$BINARIES
        say "binaries from $bin_dir (not built here)"
    else
        bin_dir=${CARGO_TARGET_DIR:-$ROOT/target}/release
        say "cargo build --release (into $bin_dir)"
        (cd "$ROOT" && cargo build --locked --release -p gpupool-operator --bin gpupool-operator \
            -p gpupool-device-plugin --bin gpupool-device-plugin) ||
            die "cargo build failed"
    fi
    for tool in gpupool-operator gpupool-device-plugin; do
        [[ -x $bin_dir/$tool ]] || die "$bin_dir/$tool is missing or not executable"
    done
    local built=$SECONDS
    mkdir -p "$OUT"
    local work
    work=$(mktemp -d -p "$OUT" .work.XXXXXX)
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    mkdir -p "$work/layout/blobs/sha256" "$work/op/usr/local/bin" "$work/agent"
    say "base: mmdebstrap $SUITE ($BASE_PACKAGES) from $MIRROR"
    build_base "$work/base"
    install -m 0755 "$bin_dir/gpupool-operator" "$work/op/usr/local/bin/gpupool-operator"
    install -m 0755 "$bin_dir/gpupool-device-plugin" "$work/agent/gpupool-device-plugin"
    if [[ -n $BINARIES ]]; then
        strip --strip-debug "$work/op/usr/local/bin/gpupool-operator" "$work/agent/gpupool-device-plugin" ||
            die "stripping the binaries from $bin_dir failed"
    fi

    local base op agent
    base=$(layer_of "$work/layout" "$work/base")
    op=$(layer_of "$work/layout" "$work/op")
    agent=$(layer_of "$work/layout" "$work/agent")
    local op_config agent_config archives=()
    op_config=$(jq -cn --arg p "$PATH_ENV" '{User: "65532:65532", Env: [$p, "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"],
        Entrypoint: ["/usr/local/bin/gpupool-operator"], WorkingDir: "/", ExposedPorts: {"8080/tcp": {}}}')
    agent_config=$(jq -cn --arg p "$PATH_ENV" '{User: "0:0", Env: [$p],
        Entrypoint: ["/gpupool-device-plugin"], WorkingDir: "/", ExposedPorts: {"8081/tcp": {}}}')
    # One layout per image: each archive holds its own blobs (the base blob is the same file).
    cp -a "$work/layout" "$work/layout-agent"
    local op_blob=${op%% *} agent_blob=${agent%% *}
    rm -f "$work/layout-agent/blobs/sha256/${op_blob#sha256:}" "$work/layout/blobs/sha256/${agent_blob#sha256:}"
    archives+=("$(write_image gpupool-operator "$work/layout" "gpupool-operator" "$op_config" "$base" "$op")")
    archives+=("$(write_image gpupool-device-plugin "$work/layout-agent" "gpupool-device-plugin" "$agent_config" "$base" "$agent")")
    say "built in $((SECONDS - start))s (binaries $((built - start))s, images $((SECONDS - built))s)"
    if [[ $CHECK == 1 ]]; then
        cmd_verify "${archives[@]}"
    fi
    printf '%s\n' "${archives[@]}"
}

cmd_verify() {
    (($#)) || die "verify: no archives given"
    python3 "$ROOT/images/verify.py" "$@" || die "verification failed"
    # The checks themselves must catch a broken archive.
    python3 "$ROOT/images/verify.py" --self-test "$1" || die "the verifier's self-test failed"
}

CHECK=0
BINARIES=
cmd=build
args=()
while (($#)); do
    case $1 in
        --check) CHECK=1 ;;
        --out)
            [[ $# -ge 2 ]] || die "--out needs a directory"
            OUT=$(realpath -m "$2")
            shift
            ;;
        --binaries)
            [[ $# -ge 2 ]] || die "--binaries needs a directory"
            BINARIES=$(realpath -e "$2") || die "--binaries: no directory $2"
            shift
            ;;
        verify) cmd=verify ;;
        -h | --help)
            awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
            exit 0
            ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) args+=("$1") ;;
    esac
    shift
done

if [[ $cmd == verify ]]; then
    cmd_verify "${args[@]}"
    exit 0
fi
((${#args[@]} == 0)) || die "unexpected arguments: ${args[*]}"

VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$ROOT/charts/gpupool/Chart.yaml")
[[ -n $VERSION ]] || die "no appVersion in charts/gpupool/Chart.yaml"
REVISION=$(git -C "$ROOT" rev-parse HEAD) || die "not a git checkout: the revision annotation needs one"
if [[ -n $(git -C "$ROOT" status --porcelain --untracked-files=no) ]]; then
    say "warning: uncommitted changes; the revision annotation says $REVISION-dirty"
    REVISION=$REVISION-dirty
fi
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$ROOT" log -1 --format=%ct)}
export SOURCE_DATE_EPOCH
CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
cmd_build
