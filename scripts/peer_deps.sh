#!/usr/bin/env bash
# System library the vLLM side of bench/peers.py preloads, installed only when missing (idempotent):
#   libtcmalloc_minimal.so.4 - vLLM's CPU backend runs best with tcmalloc  (Debian package: libtcmalloc-minimal4)
# Installs with apt-get only when run as root; otherwise prints the command to run and exits 1 (the benchmark
# then runs vLLM without tcmalloc and says so).
set -euo pipefail

say() { printf 'peer-deps: %s\n' "$*"; }

if ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4 '; then
    say "libtcmalloc-minimal4 is present; nothing to do"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    say "missing libtcmalloc-minimal4; run as root: apt-get install --no-install-recommends libtcmalloc-minimal4"
    exit 1
fi
say "apt-get install libtcmalloc-minimal4"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends libtcmalloc-minimal4
