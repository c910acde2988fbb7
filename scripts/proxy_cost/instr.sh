#!/usr/bin/env bash
# Instructions a request (valgrind's callgrind): a count that does not move with the machine's
# load, so changes of a few per cent to the request path can be told apart (CPU time moves
# 5-10 % between runs of split.sh). Two fake vLLM backends (paced: TTFT 20 ms, 10 ms a token)
# and the load generator on CPU 1; the proxy on CPU 0 under callgrind (about 50x slower, so
# the load is light); counters zeroed after a warm-up and dumped after the measured run.
#
#   scripts/proxy_cost/instr.sh TARGET [MAX_TOKENS=16] [CONCURRENCY=4] [SECONDS=10]
#
# TARGET: a directory holding the gateway's code (a worktree of any commit), or `bare`
# (bare_proxy.py: aiohttp's server and backends.upstream.h1, no features). CONCURRENCY 0 measures the
# idle gateway over SECONDS (its scrapes and probes), to subtract. The target's code is what
# runs whatever the working directory (PYTHONSAFEPATH: no checkout in it shadows the target).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
target=$1 tokens=${2:-16} conc=${3:-4} secs=${4:-10}
bench=${BENCH:-$repo/loadtest/peers}
py=${PY:-$repo/.venv/bin/python}
command -v valgrind >/dev/null || { echo "instr.sh: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
. "$here/harness.sh"  # $out, ${pids[@]}, the two fake backends
grind=(valgrind --tool=callgrind --callgrind-out-file="$out/cg.out" --dump-instr=no)
case $target in
  bare) PYTHONPATH=$repo taskset -c 0 "${grind[@]}" "$py" "$here/bare_proxy.py" 18100 18001 18002 \
          >"$out/proxy.log" 2>&1 & ;;
  *) PYTHONSAFEPATH=1 PYTHONPATH=$target taskset -c 0 "${grind[@]}" "$py" -m gateway serve --host 127.0.0.1 \
       --port 18100 --backends http://127.0.0.1:18001,http://127.0.0.1:18002 >"$out/proxy.log" 2>&1 & ;;
esac
proxy=$!
pids+=($proxy)
url=http://127.0.0.1:18100
answering "$url"
if [ "$conc" -gt 0 ]; then
  taskset -c 1 "$py" "$bench/loadgen.py" --url "$url" -c "$conc" -d 3 -t "$tokens" >/dev/null
fi
callgrind_control -z $proxy >/dev/null
if [ "$conc" -gt 0 ]; then
  taskset -c 1 "$py" "$bench/loadgen.py" --url "$url" -c "$conc" -d "$secs" -t "$tokens" \
    >"$out/load.json"
else
  sleep "$secs"
  echo '{"requests_ok": 0, "events_per_s": 0, "duration_s": 0, "errors": 0, "timeouts": 0}' \
    >"$out/load.json"
fi
callgrind_control -d $proxy >/dev/null
for _ in $(seq 50); do
  dump=$(ls "$out"/cg.out.* 2>/dev/null | head -1)
  [ -n "$dump" ] && grep -q '^totals:\|^summary:' "$dump" && break
  sleep 0.2
done
"$py" - "$target" "$dump" "$out/load.json" <<'PY'
import json, sys
target, dump, path = sys.argv[1:]
ir = next(int(line.split()[1]) for line in open(dump) if line.startswith(("totals:", "summary:")))
r = json.load(open(path))
n, events = r["requests_ok"], r["events_per_s"] * r["duration_s"]
per = f" instructions_per_request={ir / n / 1e3:.0f}k" if n else ""
print(f"{target}: requests={n} events={events:.0f} instructions={ir / 1e6:.0f}M{per}"
      f" errors={r['errors'] + r['timeouts']}")
PY
