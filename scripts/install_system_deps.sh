#!/usr/bin/env bash
# System packages the project needs beyond Python (Debian 12). Idempotent; run as root.
#
# The HumanEval sandbox (pipelines/sandbox, docs/sandbox.md) needs `unshare` and
# `setpriv` from util-linux, which Debian marks essential, so on a stock system this
# installs nothing. It also needs the kernel to allow namespaces; the check at the end
# reports (without failing) when unprivileged user namespaces are off, which only
# matters for running the sandbox as a non-root user.
#
# The native CPU attention kernel (pallas_kernels/native) is compiled with g++ on
# first use; without it the engine falls back to the slower XLA path, so g++ is
# installed when missing (best effort: an offline machine keeps the fallback).
set -euo pipefail

if [[ "$(id -u)" -ne 0 ]]; then
  echo "install_system_deps.sh: run as root (e.g. sudo $0)" >&2
  exit 1
fi

missing=()
command -v unshare >/dev/null 2>&1 || missing+=(util-linux)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
if [[ ${#missing[@]} -gt 0 ]]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends util-linux
fi
if ! command -v g++ >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update && apt-get install -y --no-install-recommends g++; } \
    || echo "warning: g++ not installed; the engine uses the XLA attention path" >&2
fi

if [[ "$(cat /proc/sys/kernel/unprivileged_userns_clone 2>/dev/null || echo 1)" != 1 ]] \
    || [[ "$(cat /proc/sys/user/max_user_namespaces 2>/dev/null || echo 1)" == 0 ]]; then
  echo "note: unprivileged user namespaces are disabled; the sandbox works as root only" >&2
fi
unshare --net --pid --mount --fork true \
  || echo "warning: this machine cannot create namespaces; the sandbox will refuse to run" >&2
