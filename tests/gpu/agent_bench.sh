#!/usr/bin/env bash
# `ds4d bench agent` against a daemon serving a random V4 checkpoint written for the run (default:
# V4-Flash widths, 8 layers in the published pattern, native FP8 + MXFP4, on one GPU); logs under $OUT.
# Two runs on one daemon: step 2 right after step 1 (reuse from the GPU pool), then with another
# session's long request in between (the pool holds about one conversation, so step 1's blocks are
# pushed to the RAM tier and step 2 is served by promotions).
# LOAD=random: no checkpoint written, the daemon draws random weights of that config (`--load-format random`).
# TRACE=1: then `ds4d bench agent --trace` (OpenCode's sessions interleaved) on the same daemon, and the
# reuse of the system prompt by every session's first step after the first.
# A quick run on the CPU: WIDTHS=tiny DEVICE=cpu LAYERS=0,4,128,4 REUSED=600 NEW=100 BETWEEN=900 CTX=2048.
set -o pipefail
. "$(dirname "$0")/daemon_lib.sh"
ds4d_setup || exit 1
WIDTHS=${WIDTHS:-flash} DEVICE=${DEVICE:-cuda} LAYERS=${LAYERS:-0,0,4,128,4,128,4,128}
REUSED=${REUSED:-65000} NEW=${NEW:-1400} BETWEEN=${BETWEEN:-73000} CTX=${CTX:-81920} PORT=${PORT:-8123}
CKPT=${CKPT:-/tmp/ds4d-agent-ckpt}
FORMAT=$([ "$DEVICE" = cpu ] && echo auto || echo native)
[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
free -g | tee -a "$OUT/gpu.txt"

LOAD_ARGS=""
if [ "${LOAD:-}" = random ]; then
  ds4d_random_config "$CKPT" deepseek_v4 "$LAYERS" 0 "$WIDTHS" || exit 1
  LOAD_ARGS="--load-format random"
else
  began=$(date +%s%N)
  $PY -m ds4d.cli make-tiny --widths "$WIDTHS" --device "$DEVICE" --layers "$LAYERS" --out "$CKPT" || exit 1
  echo "checkpoint written in $(( ($(date +%s%N) - began) / 1000000 )) ms: $(du -sh "$CKPT" | cut -f1)" | tee "$OUT/timing.txt"
fi

began=$(date +%s%N)
$PY -m ds4d.cli serve --model "$CKPT" --device "$DEVICE" --weight-format "$FORMAT" --port "$PORT" \
  --max-context "$CTX" --kv-cache-tokens "$CTX" --max-num-seqs 2 --cache-disk-dir "" $LOAD_ARGS ${SERVE_ARGS:-} \
  >"$OUT/daemon.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null' EXIT
ds4d_wait_ready "$PORT" $daemon "${LOAD_S:-400}" || { tail -30 "$OUT/daemon.log"; exit 1; }
echo "daemon ready in $(( ($(date +%s%N) - began) / 1000000 )) ms" | tee -a "$OUT/timing.txt"
grep -E "loaded|KV pool|memory plan|GiB|warm-up:" "$OUT/daemon.log" | head -20

URL=http://127.0.0.1:$PORT
$PY -m ds4d.cli bench agent --url "$URL" --reused-words "$REUSED" --new-words "$NEW" --repeats "${REPEATS:-2}" \
  --json "$OUT/agent_gpu.json" 2>&1 | tee "$OUT/agent_gpu.log"
$PY -c "import urllib.request; print(urllib.request.urlopen('$URL/v1/ds4d/stats').read().decode())" >"$OUT/stats_gpu.json"
$PY -m ds4d.cli bench agent --url "$URL" --reused-words "$REUSED" --new-words "$NEW" --between-words "$BETWEEN" \
  --repeats "${REPEATS:-2}" --seed 1 --json "$OUT/agent_ram.json" 2>&1 | tee "$OUT/agent_ram.log"
$PY -c "import urllib.request; print(urllib.request.urlopen('$URL/v1/ds4d/stats').read().decode())" >"$OUT/stats.json"
if [ "${TRACE:-0}" = 1 ]; then
  $PY -m ds4d.cli bench agent --url "$URL" --trace --json "$OUT/trace.json" 2>&1 | tee "$OUT/trace.log"
  $PY - "$OUT/trace.json" <<'PYEOF'
import json, sys
firsts = [r for r in json.load(open(sys.argv[1]))["requests"] if r["kind"] == "first"][1:]
for r in firsts:  # each later session's first step: OpenCode's system prompt and tools, then its own task
    print(f"later session's first step: {r['cached_tokens']:,} of {r['prompt_tokens']:,} prompt tokens cached "
          f"({r['cached_tokens'] / r['prompt_tokens']:.3f}), TTFT {r['ttft_ms']:,.0f} ms")
PYEOF
fi
kill -TERM $daemon; wait $daemon
grep -E "cached|finish" "$OUT/daemon.log" | tail -24 | cut -c1-260
$PY -c "import json; [print(n, json.load(open(f'$OUT/{n}.json'))['cache']['copies']) for n in ('stats_gpu', 'stats')]"
