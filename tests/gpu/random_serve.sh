#!/usr/bin/env bash
# A daemon over random weights (`ds4d serve --load-format random`) on one GPU: a directory holding only a
# config.json, V4.1-Flash widths with 6 layers 0,0,2,2,1,1 and the release's 384 experts by default
# (FAMILY=deepseek_v4: V4-Flash widths, layers 0,0,4,128; LAYERS / EXPERTS to change), the weights drawn as
# stored; then, after one warm-up request, a 2K-token prompt twice and a 64-token decode (the better of
# two, less a one-token request's time) through /v1/completions, timed from the client; SERVE_ARGS go to
# `ds4d serve`.  Logs under $OUT (or ./out).
#
#   FAMILY=deepseek_v4 LAYERS=<43 ratios> SERVE_ARGS="--gpus 0,1 --parallel-layout ep --weight-format native" \
#     tests/gpu/random_serve.sh   # V4 split over GPUs, each rank drawing its own layers and experts
#   GGUF=/tmp/q2.gguf LAYERS=0,0,4,128,... tests/gpu/random_serve.sh   # a DeepSeek-V4 q2 GGUF FILE instead:
#       written first when missing (`make-tiny --gguf q2 --widths flash --device cuda`, V4-Flash widths at
#       LAYERS), then served from the file (`ds4d serve --model FILE`)
set -o pipefail
source "$(dirname "$0")/daemon_lib.sh"
ds4d_setup || exit 1
DIR=${DIR:-/tmp/random_v41}; PORT=${PORT:-18431}
FAMILY=${FAMILY:-deepseek_v41}
if [ -n "${GGUF:-}" ]; then
  if [ ! -f "$GGUF" ]; then
    written=$(date +%s)
    $PY -m ds4d.cli make-tiny --family deepseek_v4 --gguf q2 --widths flash --device cuda --out "$GGUF" \
      ${LAYERS:+--layers "$LAYERS"} || exit 1
    echo "written in $(( $(date +%s) - written )) s"
  fi
  MODEL_ARGS=(--model "$GGUF")
else
  ds4d_random_config "$DIR" "$FAMILY" "${LAYERS:-}" "${EXPERTS:-384}" || exit 1
  MODEL_ARGS=(--model "$DIR" --load-format random)
fi
start=$(date +%s)
$PY -m ds4d.cli serve "${MODEL_ARGS[@]}" --device cuda --port "$PORT" ${SERVE_ARGS:-} \
  > "$OUT/random_serve.log" 2>&1 &
PID=$!
ds4d_wait_ready "$PORT" "$PID" "${READY_S:-400}" || { tail -30 "$OUT/random_serve.log"; kill $PID; exit 1; }
echo "ready after $(( $(date +%s) - start )) s"
$PY - "$PORT" <<'PYEOF'
import random, sys, time
import openai
client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="x", max_retries=0, timeout=300)
model = client.models.list().data[0].id
rng = random.Random(0)
def timed(prompt, tokens):
    t = time.perf_counter()
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
    return time.perf_counter() - t, reply.usage
timed([rng.randrange(1000, 120000) for _ in range(16)], 2)  # the daemon's first request
rows = []
for case in ("first", "second"):
    seconds, usage = timed([rng.randrange(1000, 120000) for _ in range(2048)], 1)
    rows.append((f"prefill 2048, {case}", f"{seconds:.3f} s", f"{usage.prompt_tokens / seconds:,.0f} tok/s"))
short = min(timed([rng.randrange(1000, 120000) for _ in range(16)], 1)[0] for _ in range(2))
long = min(timed([rng.randrange(1000, 120000) for _ in range(16)], 65)[0] for _ in range(2))
rows.append(("decode 64 after 16", f"{long - short:.3f} s", f"{64 / (long - short):,.1f} tok/s"))
print("| case | time | rate |\n|---|---|---|")
for row in rows:
    print("| " + " | ".join(row) + " |")
PYEOF
kill "$PID"; wait "$PID"
grep -E "RANDOM WEIGHTS|weights:|Engram tables|GPU memory plan|forward paths" "$OUT/random_serve.log" | cut -c1-300 | head -8
