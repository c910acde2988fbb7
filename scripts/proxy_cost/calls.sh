#!/usr/bin/env bash
# What runs a request: Python function entries a request (cProfile), by module and by function.
# instr.sh says how much a request costs; this says where the calls are, the map a redesign of
# the request path starts from. The gateway runs under cProfile twice, for SECONDS and for
# 3 x SECONDS (paced fake backends, the load generator at CONCURRENCY on CPU 1), and the
# difference of the two profiles is divided by the difference of their requests: start-up
# and imports drop out. (cProfile counts each resumption of a coroutine as an entry, so a
# coroutine that awaits counts more than once.)
#
#   scripts/proxy_cost/calls.sh TARGET [MAX_TOKENS=16] [CONCURRENCY=4] [SECONDS=10] [ROWS=60]
#
# TARGET: a directory holding the gateway's code (a worktree of any commit).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
target=$1 tokens=${2:-16} conc=${3:-4} secs=${4:-10} rows=${5:-60}
bench=${BENCH:-$repo/loadtest/peers}
py=${PY:-$repo/.venv/bin/python}
. "$here/harness.sh"  # $out, ${pids[@]}, the two fake backends
url=http://127.0.0.1:18100

profile() {  # $1: seconds of load; writes $out/$1.prof and $out/$1.json
  PYTHONSAFEPATH=1 PYTHONPATH=$target taskset -c 0 "$py" -m cProfile -o "$out/$1.prof" -m gateway serve \
    --host 127.0.0.1 --port 18100 --backends http://127.0.0.1:18001,http://127.0.0.1:18002 \
    >"$out/proxy-$1.log" 2>&1 &
  local proxy=$!
  answering "$url"
  taskset -c 1 "$py" "$bench/loadgen.py" --url "$url" -c "$conc" -d "$1" -t "$tokens" >"$out/$1.json"
  kill -INT $proxy  # a graceful stop: cProfile writes its file
  wait $proxy || true
}
profile "$secs"
profile $((3 * secs))
"$py" - "$out" "$secs" $((3 * secs)) "$rows" "$(cd "$target" && pwd)" <<'PY'
import collections, json, pstats, sys

out, short, long, rows, root = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]


def load(tag):
    return pstats.Stats(f"{out}/{tag}.prof").stats, json.load(open(f"{out}/{tag}.json"))


a, ra = load(short)
b, rb = load(long)
n = rb["requests_ok"] - ra["requests_ok"]
if n <= 0:
    sys.exit(f"calls.sh: no more requests in the longer run ({ra['requests_ok']}, {rb['requests_ok']})")
events = rb["events_per_s"] * rb["duration_s"] / max(rb["requests_ok"], 1)


def where(key):
    path, line, name = key
    for cut in ("/site-packages/", "/lib/python3."):
        if cut in path:
            path = path.split(cut, 1)[1]
            if cut == "/lib/python3.":
                path = "stdlib:" + path.split("/", 1)[1]
            break
    else:
        path = path.removeprefix(root + "/")
    return path, line, name


per = []
for key, (_, calls, *_rest) in b.items():
    more = calls - (a[key][1] if key in a else 0)
    if more > 0:
        per.append((more / n, where(key)))
modules = collections.Counter()
for c, (path, _, name) in per:
    module = "builtins" if path == "~" else path.split("/")[0] if path.startswith(("aiohttp", "stdlib")) else path
    modules[module] += c
print(f"{n} requests, {events:.1f} events each: {sum(c for c, _ in per):.0f} function entries a request")
print("\nby module:")
for module, c in modules.most_common(rows // 2):
    print(f"{c:9.1f}  {module}")
print("\nby function:")
for c, (path, line, name) in sorted(per, reverse=True)[:rows]:
    print(f"{c:9.2f}  {path}:{line} {name}")
PY
