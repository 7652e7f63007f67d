#!/usr/bin/env bash
# Re-pins this wrapper module to a Kubernetes release: pin.sh 1.36.3
#
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/client-go,
# ...) at v0.0.0 and resolves them with `replace => ./staging/...` lines that
# only apply inside its own repository. A module that builds its commands must
# replace each of them with the published v0.X.Y matching release v1.X.Y. The
# list is taken from that release's own go.mod, so it follows the release.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}

v=${1:?usage: pin.sh <kubernetes version, e.g. 1.36.3>}
v=${v#v}
staging="v0.${v#*.}"

modfile=$("$GO" mod download -json "k8s.io/kubernetes@v$v" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[[ -f $modfile ]] || {
    echo "pin.sh: could not download k8s.io/kubernetes@v$v" >&2
    exit 1
}
godirective=$(awk '$1 == "go" { print $2; exit }' "$modfile")
mapfile -t modules < <(sed -n 's|^[[:space:]]*\(k8s.io/[^ ]*\) => ./staging/.*|\1|p' "$modfile")
((${#modules[@]})) || {
    echo "pin.sh: no staging replaces found in $modfile" >&2
    exit 1
}

{
    echo "module gpupool.io/e2e/tools/kubernetes"
    echo
    echo "go $godirective"
    echo
    echo "tool ("
    for t in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do
        printf '\tk8s.io/kubernetes/cmd/%s\n' "$t"
    done
    echo ")"
    echo
    echo "require k8s.io/kubernetes v$v"
    echo
    echo "// Staging modules of k8s.io/kubernetes v$v (from its go.mod), at their published versions."
    echo "replace ("
    for m in "${modules[@]}"; do printf '\t%s => %s %s\n' "$m" "$m" "$staging"; done
    echo ")"
} >go.mod
rm -f go.sum
GOTOOLCHAIN=local "$GO" mod tidy
echo "pin.sh: pinned k8s.io/kubernetes v$v with ${#modules[@]} staging replaces at $staging"
