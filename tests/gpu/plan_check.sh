#!/usr/bin/env bash
# The GPU memory plan on a real device: a daemon serving a random V4 checkpoint (V4-Flash widths, native
# FP8 + MXFP4) logs its plan; nvidia-smi is sampled while long prompts run, and the most it saw is set
# against the plan's total.  Then a kv_cache_tokens that cannot fit must be refused at start.  Logs under $OUT.
set -o pipefail
. "$(dirname "$0")/daemon_lib.sh"
ds4d_setup || exit 1
WIDTHS=${WIDTHS:-flash} DEVICE=${DEVICE:-cuda} LAYERS=${LAYERS:-0,4} UTIL=${UTIL:-0.3} PORT=${PORT:-8124} CKPT=${CKPT:-/tmp/ds4d-plan-ckpt}
MAXCTX=${MAXCTX:-65536} PROMPT_WORDS=${PROMPT_WORDS:-60000} PARALLEL=${PARALLEL:-4}

$PY -m ds4d.cli make-tiny --widths "$WIDTHS" --device "$DEVICE" --layers "$LAYERS" --out "$CKPT" >"$OUT/make_tiny.log" 2>&1 \
  || { tail -20 "$OUT/make_tiny.log"; exit 1; }
smi() { nvidia-smi "$@" 2>/dev/null || echo 0; }
smi --query-gpu=memory.used,memory.total --format=csv,noheader | tee "$OUT/idle.txt"

serve() {  # extra arguments go to `ds4d serve`
  exec $PY -m ds4d.cli serve --model "$CKPT" --device "$DEVICE" --weight-format "$([ "$DEVICE" = cpu ] && echo auto || echo native)" --port "$PORT" \
    --cache-disk-dir "" "$@"
}

# 1. The plan binds: a pool asked for far more than the device has gets what gpu_memory_utilization leaves.
# The longest prompts it accepts (MAXCTX) are sent, several at once.
serve --gpu-memory-utilization "$UTIL" --kv-cache-gib 400 --max-num-seqs 64 --max-context "$MAXCTX" \
  >"$OUT/daemon.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null' EXIT
ds4d_wait_ready "$PORT" $daemon || { tail -30 "$OUT/daemon.log"; exit 1; }
grep -E "memory plan|weights|activations|graphs|KV|headroom|parameters" "$OUT/daemon.log" | cut -c1-200 | tee "$OUT/plan.txt"
smi --query-gpu=memory.used --format=csv,noheader | tee "$OUT/ready.txt"
( while kill -0 $daemon 2>/dev/null; do smi --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.2; done ) \
  >"$OUT/samples.txt" &
sampler=$!
$PY - "$PORT" "$PROMPT_WORDS" "$PARALLEL" <<'EOF' | tee "$OUT/load.txt"
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, words, parallel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
    model = json.loads(r.read())["data"][0]["id"]
def one(i):
    body = {"model": model, "prompt": f"{i} " + "alpha beta gamma delta " * (words // 4), "max_tokens": 24,
            "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out["usage"], time.time() - t0
with ThreadPoolExecutor(parallel) as pool:
    for usage, took in pool.map(one, range(parallel)):
        print(f"request: {usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} generated, {took:.1f} s")
with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/ds4d/stats", timeout=10) as r:
    for gpu in json.loads(r.read())["gpus"]:
        print("after the load, GiB: " + ", ".join(f"{k.removesuffix('_bytes')} {v / 2**30:.2f}" for k, v in gpu.items()
                                                  if k.endswith("_bytes")))
EOF
sleep 1
kill $sampler 2>/dev/null
echo "most used during the load: $(sort -n "$OUT/samples.txt" | tail -1) MiB" | tee -a "$OUT/load.txt"
kill $daemon; wait $daemon 2>/dev/null

[ "$DEVICE" = cpu ] && exit 0  # no plan on the CPU
# 2. An explicit pool that cannot fit is refused at start.
(serve --kv-cache-tokens 2000000000 --max-context 1000000 >"$OUT/refused.log" 2>&1)
echo "exit status with kv_cache_tokens 2e9: $?" | tee -a "$OUT/load.txt"
grep -iE "error|does not fit|refus" "$OUT/refused.log" | tail -3 | cut -c1-300 | tee -a "$OUT/load.txt"

# 3. The plan at the model's full context (the profiling step at the end of its longest prompt).
serve >"$OUT/full_context.log" 2>&1 &
daemon=$!
ds4d_wait_ready "$PORT" $daemon && grep -E "memory plan|weights|activations|graphs|KV|headroom" "$OUT/full_context.log" | cut -c1-200 \
  | tee "$OUT/plan_full_context.txt"
kill $daemon; wait $daemon 2>/dev/null
