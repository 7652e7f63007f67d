#!/usr/bin/env bash
# Builds the control-plane tools the e2e tests and the demo run (kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, etcd, kwok, helm) from the
# Go wrapper modules beside this script, one binary at a time.
#
# Binaries land in a cache directory keyed by a hash of every go.mod/go.sum here
# and of this script, so a second run with the same pins builds nothing.
#
#   build.sh                      build (or reuse) every tool
#   build.sh kubectl etcd         build (or reuse) only these
#   build.sh kubelet fakecri      the optional kubelet layer (a real kubelet on an
#                                 in-memory CRI); never built unless named
#   build.sh --print-bin-dir      print the bin dir for the current pins and exit
#   build.sh --list               print the component names and exit
#   build.sh --prune              remove binaries and logs built for other pins
#
# Environment:
#   GPUPOOL_CACHE_DIR   cache root (default ~/.cache/gpupool)
#   GO                  the go command (default: go on PATH, else /usr/local/go/bin/go)
#   GPUPOOL_GO_BUILD_P  value for `go build -p` (default 2: each link needs ~2 GiB)
set -euo pipefail

TOOLS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Go keeps its caches under $HOME; some CI environments do not set it.
if [[ -z ${HOME:-} ]]; then
    HOME=$(getent passwd "$(id -u)" | cut -d: -f6)
    export HOME
fi
CACHE_DIR=${GPUPOOL_CACHE_DIR:-$HOME/.cache/gpupool}
BUILD_P=${GPUPOOL_GO_BUILD_P:-2}

# component -> wrapper module directory and Go package, in build order.
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok helm)
# Built only when named on the command line.
OPTIONAL_COMPONENTS=(kubelet fakecri)

module_of() {
    case $1 in
        kube-apiserver | kube-controller-manager | kube-scheduler | kubectl | kubelet) echo kubernetes ;;
        etcd) echo etcd ;;
        kwok) echo kwok ;;
        helm) echo helm ;;
        fakecri) echo fakecri ;;
        *) return 1 ;;
    esac
}

package_of() {
    case $1 in
        kube-apiserver | kube-controller-manager | kube-scheduler | kubectl | kubelet) echo "k8s.io/kubernetes/cmd/$1" ;;
        etcd) echo go.etcd.io/etcd/server/v3 ;;
        kwok) echo sigs.k8s.io/kwok/cmd/kwok ;;
        helm) echo helm.sh/helm/v3/cmd/helm ;;
        fakecri) echo gpupool.io/e2e/tools/fakecri ;;
        *) return 1 ;;
    esac
}

# The cache key: every input that decides what gets built.
pins_hash() {
    (
        cd "$TOOLS_DIR"
        for f in build.sh kubernetes/go.mod kubernetes/go.sum etcd/go.mod etcd/go.sum \
            kwok/go.mod kwok/go.sum helm/go.mod helm/go.sum \
            fakecri/go.mod fakecri/go.sum fakecri/main.go; do
            printf '%s\n' "$f"
            cat "$f"
        done
    ) | sha256sum | cut -c1-16
}

BIN_DIR="$CACHE_DIR/bin/$(pins_hash)"
LOG_DIR="$CACHE_DIR/logs/$(basename "$BIN_DIR")"

# The Go the wrapper modules need (their `go` lines say 1.26).
GO_MIN_MINOR=26
GO_FALLBACK_TOOLCHAIN=go1.26.8

go_minor() {
    "$1" env GOVERSION 2>/dev/null | sed -n 's/^go1\.\([0-9]*\).*/\1/p'
}

# Picks $GO, else the first of `go` on PATH and /usr/local/go/bin/go that is
# new enough. With only an older Go (>= 1.21), that Go fetches
# $GO_FALLBACK_TOOLCHAIN from the module proxy (GOTOOLCHAIN).
find_go() {
    local candidates=() c minor oldest=""
    if [[ -n ${GO:-} ]]; then
        candidates=("$GO")
    else
        if command -v go >/dev/null 2>&1; then candidates+=("$(command -v go)"); fi
        candidates+=(/usr/local/go/bin/go)
    fi
    for c in "${candidates[@]}"; do
        [[ -x $c ]] || continue
        minor=$(GOTOOLCHAIN=local go_minor "$c")
        [[ -n $minor ]] || continue
        if ((minor >= GO_MIN_MINOR)); then
            GO_BIN=$c
            GO_TOOLCHAIN=local
            return 0
        fi
        if ((minor >= 21)) && [[ -z $oldest ]]; then oldest=$c; fi
    done
    if [[ -n $oldest ]]; then
        echo "build.sh: $oldest is older than go1.$GO_MIN_MINOR; using GOTOOLCHAIN=$GO_FALLBACK_TOOLCHAIN" >&2
        GO_BIN=$oldest
        GO_TOOLCHAIN=$GO_FALLBACK_TOOLCHAIN
        return 0
    fi
    echo "build.sh: no usable Go toolchain found (need go1.$GO_MIN_MINOR+; set GO=/path/to/go)" >&2
    return 1
}

# The version a wrapper module pins for a module path, read from its go.mod
# require lines (replace lines, which contain "=>", and comments are skipped).
pinned_version() {
    local modfile=$1 path=$2
    awk -v p="$path" '!/=>/ && !/^[[:space:]]*\/\// { for (i = 1; i < NF; i++) if ($i == p) { print $(i + 1); exit } }' "$modfile"
}

ldflags_of() {
    local comp=$1 mod v
    mod=$(module_of "$comp")
    case $mod in
        kubernetes)
            v=$(pinned_version "$TOOLS_DIR/kubernetes/go.mod" k8s.io/kubernetes)
            local major=${v#v}
            major=${major%%.*}
            local minor=${v#v*.}
            minor=${minor%%.*}
            local flags=""
            # kubectl reports the client-go version as its own; the server
            # binaries report component-base's. Set both.
            for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
                flags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
                flags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit="
                flags+=" -X $pkg.buildDate=$(release_date k8s.io/kubernetes "$v")"
            done
            echo "$flags"
            ;;
        etcd | fakecri)
            # etcd's version is a constant in go.etcd.io/etcd/api/v3/version;
            # fakecri has none.
            echo ""
            ;;
        kwok)
            v=$(pinned_version "$TOOLS_DIR/kwok/go.mod" sigs.k8s.io/kwok)
            echo "-X sigs.k8s.io/kwok/pkg/consts.Version=${v#v}"
            ;;
        helm)
            v=$(pinned_version "$TOOLS_DIR/helm/go.mod" helm.sh/helm/v3)
            # The Kubernetes version helm assumes without a cluster (template,
            # lint): the one our control plane runs.
            local kv kmaj kmin
            kv=$(pinned_version "$TOOLS_DIR/kubernetes/go.mod" k8s.io/kubernetes)
            kmaj=${kv#v}
            kmaj=${kmaj%%.*}
            kmin=${kv#v*.}
            kmin=${kmin%%.*}
            echo "-X helm.sh/helm/v3/internal/version.version=$v -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
                "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$kmaj -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kmin" \
                "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$kmaj -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$kmin"
            ;;
    esac
}

# The release's commit time as the proxy records it; a stable build date.
release_date() {
    local info
    info=$(cd "$TOOLS_DIR/kubernetes" && "$GO_BIN" mod download -json "$1@$2" 2>/dev/null |
        sed -n 's/.*"Info": "\(.*\)".*/\1/p') || true
    if [[ -n $info && -f $info ]]; then
        sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info"
    else
        echo 1970-01-01T00:00:00Z
    fi
}

# kwok needs stage definitions to run; they ship inside its module. Copy the
# ones the cluster uses next to the binary so running needs no module cache.
install_kwok_stages() {
    local dir
    dir=$(cd "$TOOLS_DIR/kwok" && "$GO_BIN" list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
    local out="$BIN_DIR/kwok-stages.yaml.tmp"
    : >"$out"
    local f
    for f in stage/node/fast/node-initialize.yaml \
        stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
        stage/pod/fast/pod-ready.yaml \
        stage/pod/fast/pod-complete.yaml \
        stage/pod/fast/pod-delete.yaml; do
        if [[ ! -f $dir/kustomize/$f ]]; then
            echo "kwok stage file $f is missing from $dir/kustomize" >&2
            return 1
        fi
        cat "$dir/kustomize/$f"
        printf '\n---\n'
    done >>"$out"
    mv "$out" "$BIN_DIR/kwok-stages.yaml"
}

is_built() {
    [[ -x $BIN_DIR/$1 ]] && { [[ $1 != kwok ]] || [[ -f $BIN_DIR/kwok-stages.yaml ]]; }
}

build_one() {
    local comp=$1 mod pkg log start end
    mod=$(module_of "$comp")
    pkg=$(package_of "$comp")
    log="$LOG_DIR/$comp.log"
    if is_built "$comp"; then
        echo "build.sh: $comp: cached ($BIN_DIR/$comp)"
        return 0
    fi
    echo "build.sh: $comp: building $pkg (log: $log)"
    start=$(date +%s)
    local ld
    ld="-s -w $(ldflags_of "$comp")"
    if ! (
        cd "$TOOLS_DIR/$mod"
        echo "+ go build -p $BUILD_P -trimpath -buildvcs=false -ldflags '$ld' -o $BIN_DIR/.$comp.tmp $pkg"
        CGO_ENABLED=0 GOFLAGS=-mod=readonly \
            "$GO_BIN" build -p "$BUILD_P" -trimpath -buildvcs=false -ldflags "$ld" \
            -o "$BIN_DIR/.$comp.tmp" "$pkg"
        if [[ $comp == kwok ]]; then install_kwok_stages; fi
    ) >"$log" 2>&1; then
        end=$(date +%s)
        echo "build.sh: $comp: FAILED after $((end - start))s; see $log" >&2
        tail -n 20 "$log" | sed 's/^/    /' >&2
        return 1
    fi
    mv -f "$BIN_DIR/.$comp.tmp" "$BIN_DIR/$comp"
    end=$(date +%s)
    echo "build.sh: $comp: built in $((end - start))s"
    printf '%s\t%s\t%s\n' "$comp" "$((end - start))" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$LOG_DIR/times.tsv"
}

# Old pins' binaries are ~0.5 GiB a set; nothing removes them otherwise. A set
# that a running process was started from (a cluster someone still uses) stays.
prune() {
    local d name
    for d in "$CACHE_DIR"/bin/*; do
        name=$(basename "$d")
        [[ -d $d && $name != "$(basename "$BIN_DIR")" ]] || continue
        if grep -qsaF -- "$d/" /proc/[0-9]*/cmdline; then
            echo "build.sh: keeping $d (in use by a running process)"
            continue
        fi
        echo "build.sh: removing $d and its logs"
        rm -rf -- "$d" "$CACHE_DIR/logs/$name"
    done
}

main() {
    local wanted=()
    while (($#)); do
        case $1 in
            --print-bin-dir)
                echo "$BIN_DIR"
                return 0
                ;;
            --list)
                printf '%s\n' "${COMPONENTS[@]}"
                printf '%s (optional)\n' "${OPTIONAL_COMPONENTS[@]}"
                return 0
                ;;
            --prune)
                prune
                return 0
                ;;
            -h | --help)
                awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
                return 0
                ;;
            -*)
                echo "build.sh: unknown flag $1" >&2
                return 2
                ;;
            *)
                if ! module_of "$1" >/dev/null; then
                    echo "build.sh: unknown component '$1' (known: ${COMPONENTS[*]} ${OPTIONAL_COMPONENTS[*]})" >&2
                    return 2
                fi
                wanted+=("$1")
                ;;
        esac
        shift
    done
    ((${#wanted[@]})) || wanted=("${COMPONENTS[@]}")

    local missing=()
    local c
    for c in "${wanted[@]}"; do is_built "$c" || missing+=("$c"); done
    if ((${#missing[@]} == 0)); then
        echo "build.sh: all cached in $BIN_DIR"
        return 0
    fi

    find_go
    export GOTOOLCHAIN=$GO_TOOLCHAIN
    mkdir -p "$BIN_DIR" "$LOG_DIR"
    # One build at a time, across processes too (test harness and scripts).
    exec 9>"$BIN_DIR/.lock"
    if ! flock -n 9; then
        echo "build.sh: another build holds $BIN_DIR/.lock; waiting"
        flock 9
    fi
    echo "build.sh: $("$GO_BIN" version); bin dir $BIN_DIR"
    local total_start
    total_start=$(date +%s)
    for c in "${wanted[@]}"; do
        build_one "$c" || {
            echo "build.sh: building $c failed; its log is $LOG_DIR/$c.log" >&2
            return 1
        }
    done
    echo "build.sh: done in $(($(date +%s) - total_start))s; binaries in $BIN_DIR"
}

# On one line: bash has read it whole before main runs, so editing this file
# while it runs cannot make bash execute half-read text after main returns.
main "$@"; exit
