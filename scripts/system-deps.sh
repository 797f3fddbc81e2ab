#!/usr/bin/env bash
# System packages the test suite uses: a real etcd server (cluster tests) and Debian's Chromium (the dashboard's
# browser test). Installed with apt-get when missing and we are root (CI is); otherwise the tests that need them
# say what is missing and are skipped outside CI (under CI=true they fail instead: nothing is skipped silently).
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server etcd-client)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "==> missing system packages (${need[*]}); install them to run every test" >&2
    exit 0
fi
echo "==> apt-get install ${need[*]} (once)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${need[@]}" | grep -E '^(Setting up|Unpacking)' || true
