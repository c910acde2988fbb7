# Sourced by split.sh and instr.sh (after they set $py and $bench): a scratch directory $out,
# the ${pids[@]} killed on exit, and two fake vLLM backends on CPU 1 at ports 18001 and 18002
# (paced: first token after 20 ms, then one every 10 ms).
out=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$out"; }
trap cleanup EXIT
for port in 18001 18002; do
  taskset -c 1 "$py" "$bench/fake_backend.py" --port $port --ttft-ms 20 --itl-ms 10 >/dev/null 2>&1 &
  pids+=($!)
done
