#!/usr/bin/env bash
# What one proxy costs per request and per event, on its own core: two fake vLLM backends
# (tools/fake_vllm, paced: TTFT 20 ms, 10 ms a token) and its load generator on CPU 1, the
# proxy on CPU 0; CPU from /proc/<pid>/stat over the measured run.
#
#   scripts/proxy_cost/split.sh TARGET MAX_TOKENS [CONCURRENCY=64] [SECONDS=10]
#
# TARGET: a directory holding the gateway's code (a worktree of any commit), or `raw`
# (raw_proxy.py: the floor of Python + uvloop) or `bare` (bare_proxy.py: aiohttp's server and
# backends.upstream.h1, no features) or `lean` (lean_proxy.py: bare without aiohttp's server, httptools
# parsing the requests), or `vllm-router` (the peer bench's install of it, under
# /tmp/peerbench/venvs), or `direct` (no proxy: the load generator on one backend; its TTFT is
# the reference the others add to, its CPU figures mean nothing). Run it at two MAX_TOKENS (say 16 and 64) and solve
# cpu = requests x a + events x b for the cost per request (a) and per event (b).
# BENCH (default loadtest/peers) holds loadgen.py; PY the Python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
target=$1 tokens=$2 conc=${3:-64} secs=${4:-10}
bench=${BENCH:-$repo/loadtest/peers}
py=${PY:-$repo/.venv/bin/python}
. "$here/harness.sh"  # $out, ${pids[@]}, the two fake backends
case $target in
  raw) taskset -c 0 "$py" "$here/raw_proxy.py" 18100 18001 18002 >"$out/proxy.log" 2>&1 & ;;
  bare) PYTHONPATH=$repo taskset -c 0 "$py" "$here/bare_proxy.py" 18100 18001 18002 >"$out/proxy.log" 2>&1 & ;;
  lean) PYTHONPATH=$repo taskset -c 0 "$py" "$here/lean_proxy.py" 18100 18001 18002 >"$out/proxy.log" 2>&1 & ;;
  vllm-router) taskset -c 0 "${ROUTER:-/tmp/peerbench/venvs/vllm-router/bin/vllm-router}" \
       --host 127.0.0.1 --port 18100 --worker-urls http://127.0.0.1:18001 http://127.0.0.1:18002 \
       --policy round_robin --prometheus-port 18101 --log-level warning >"$out/proxy.log" 2>&1 & ;;
  direct) taskset -c 0 "$py" "$here/raw_proxy.py" 18100 18001 >"$out/proxy.log" 2>&1 & ;;
  *) PYTHONSAFEPATH=1 PYTHONPATH=$target taskset -c 0 "$py" -m gateway serve --host 127.0.0.1 --port 18100 \
       --backends http://127.0.0.1:18001,http://127.0.0.1:18002 >"$out/proxy.log" 2>&1 & ;;
esac
proxy=$!
pids+=($proxy)
url=http://127.0.0.1:18100
[ "$target" = direct ] && url=http://127.0.0.1:18001
answering "$url"
taskset -c 1 "$py" "$bench/loadgen.py" --url "$url" -c 16 -d 2 -t "$tokens" >/dev/null
before=$(awk '{print $14, $15}' "/proc/$proxy/stat")
taskset -c 1 "$py" "$bench/loadgen.py" --url "$url" -c "$conc" -d "$secs" \
  -t "$tokens" >"$out/load.json"
after=$(awk '{print $14, $15}' "/proc/$proxy/stat")
"$py" - "$target" "$before" "$after" "$out/load.json" <<'PY'
import json, os, sys
target, before, after, path = sys.argv[1:]
hz = os.sysconf("SC_CLK_TCK")
(u0, s0), (u1, s1) = (map(int, x.split()) for x in (before, after))
user, system = (u1 - u0) / hz, (s1 - s0) / hz
r = json.load(open(path))
n, events = r["requests_ok"], r["events_per_s"] * r["duration_s"]
print(
    f"{target}: requests={n} events={events:.0f} cpu_s={user + system:.2f} (user {user:.2f},"
    f" sys {system:.2f}) us_per_request={(user + system) / max(n, 1) * 1e6:.0f}"
    f" ttft_p50={r['ttft_ms']['p50']} ttft_p99={r['ttft_ms']['p99']}"
    f" errors={r['errors'] + r['timeouts']}"
)
PY
