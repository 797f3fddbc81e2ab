#!/usr/bin/env bash
# One command for a cluster on this machine: etcd, two sidecars (two simulated engines each) and two
# central replicas (http://127.0.0.1:8010 and :8020). Ctrl-C stops everything.
#   examples/cluster/run.sh            (after `make serve` or `make test` created .venv)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
lockgate="${LOCKGATE:-$here/../../.venv/bin/lockgate}"
data="$(mktemp -d)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$data"; }
trap cleanup EXIT INT TERM

# History is compacted: sidecars rewrite their record every 100 ms (see docs/cluster.md).
etcd --name example --data-dir "$data" --log-level error \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster example=http://127.0.0.1:2380 \
    --auto-compaction-mode revision --auto-compaction-retention 1000 >"$data/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf http://127.0.0.1:2379/health >/dev/null && break; sleep 0.1; done

for n in 1 2; do "$lockgate" sidecar --config "$here/sidecar-$n.yaml" & pids+=($!); done
for n in 1 2; do "$lockgate" serve --config "$here/central-$n.yaml" & pids+=($!); done
for port in 8010 8020; do
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 0.1; done
done
cat <<'TEXT'
Cluster up: central replicas on :8010 and :8020, sidecars on :8111 and :8112, etcd on :2379.
  curl -s http://127.0.0.1:8010/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "demo-model", "messages": [{"role": "user", "content": "Hello!"}]}'
  curl -s http://127.0.0.1:8020/admin/fleet      # the etcd view: nodes, ages, engines
  kill -9 a sidecar, stop etcd: the replicas keep serving (docs/cluster.md)
TEXT
wait
