# Sourced by split.sh, instr.sh and calls.sh (after they set $py and $repo): a scratch
# directory $out, the ${pids[@]} killed on exit, two fake vLLM backends (tools/fake_vllm) on
# CPU 1 at ports 18001 and 18002 (paced: first token after 20 ms, then one every 10 ms), and
# `answering URL`.
out=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$out"; }
trap cleanup EXIT
for port in 18001 18002; do
  PYTHONPATH=$repo taskset -c 1 "$py" -m tools.fake_vllm --port $port --ttft-ms 20 --itl-ms 10 \
    >/dev/null 2>&1 &
  pids+=($!)
done

# Wait until the proxy at $1 answers a small chat request (it may take a while to start under
# valgrind or cProfile); gives up after about 150 s.
answering() {
  local body='{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
  for _ in $(seq 300); do
    curl -sf -o /dev/null -m 5 -H 'content-type: application/json' -d "$body" \
      "$1/v1/chat/completions" && return 0
    sleep 0.5
  done
  return 1
}
