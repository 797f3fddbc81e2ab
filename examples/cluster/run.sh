#!/usr/bin/env bash
# One command for a cluster on this machine: etcd, two sidecars (two simulated engines each) and two
# central replicas (http://127.0.0.1:8010 and :8020). Ctrl-C stops everything.
#   examples/cluster/run.sh            (after `make serve` or `make test` created .venv)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
lockgate="${LOCKGATE:-$here/../../.venv/bin/lockgate}"
data="$(mktemp -d)"
export LOCKGATE_EXAMPLE_DATA="$data"  # the usage records, in the YAML files: this run's own, gone with it
pids=()
names=()
stop() {
    # Ctrl-C reached every process of the terminal already (each drains); a TERM sent to this script alone is passed on.
    [ "${1:-}" = TERM ] && kill "${pids[@]}" 2>/dev/null
    wait 2>/dev/null || true
    rm -rf "$data"
}
trap 'stop INT' INT
trap 'stop TERM' TERM
trap 'kill "${pids[@]}" 2>/dev/null || true; stop' EXIT
start() {  # name, command...: started in the background, its output prefixed with its name
    local name="$1"
    shift
    "$@" > >(sed -u "s/^/[$name] /") 2>&1 &
    pids+=($!)
    names+=("$name")
}
ready() {  # url, name: waits up to 10 s; fails (naming the process) if it exits or never answers
    local url="$1" name="$2" pid="$3"
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || { echo "run.sh: $name exited (its output above says why)" >&2; return 1; }
        curl -sf "$url" >/dev/null && return 0
        sleep 0.1
    done
    echo "run.sh: $name did not answer $url within 10 s" >&2
    return 1
}

# History is compacted: sidecars rewrite their record every 100 ms (see docs/cluster.md). Its log: $data/etcd.log.
start etcd sh -c 'exec "$@" >"$LOCKGATE_EXAMPLE_DATA/etcd.log" 2>&1' etcd etcd --name example --data-dir "$data/etcd" --log-level error \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster example=http://127.0.0.1:2380 \
    --auto-compaction-mode revision --auto-compaction-retention 1000
ready http://127.0.0.1:2379/health etcd "${pids[0]}"

for n in 1 2; do start "sidecar-$n" "$lockgate" sidecar --config "$here/sidecar-$n.yaml"; done
for n in 1 2; do start "central-$n" "$lockgate" serve --config "$here/central-$n.yaml"; done
ready http://127.0.0.1:8111/ready sidecar-1 "${pids[1]}"
ready http://127.0.0.1:8112/ready sidecar-2 "${pids[2]}"
ready http://127.0.0.1:8010/ready central-1 "${pids[3]}"
ready http://127.0.0.1:8020/ready central-2 "${pids[4]}"
sleep 0.5  # (what answered may be another program on the port: ours is then gone)
for i in "${!pids[@]}"; do
    kill -0 "${pids[$i]}" 2>/dev/null || { echo "run.sh: ${names[$i]} exited (its output above says why)" >&2; exit 1; }
done
cat <<'TEXT'
Cluster up: central replicas on :8010 and :8020, sidecars on :8111 and :8112, etcd on :2379.
  curl -s http://127.0.0.1:8010/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "demo-model", "messages": [{"role": "user", "content": "Hello!"}]}'
  curl -s http://127.0.0.1:8020/admin/fleet      # the etcd view: nodes, ages, engines
  kill -9 a sidecar, stop etcd: the replicas keep serving (docs/cluster.md)
TEXT
wait
