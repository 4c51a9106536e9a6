#!/usr/bin/env bash
# A fresh daemon's first request of each kind against the same request warm (tests/gpu/first_use.py), with
# the warm-up before /ready off and on (WARMUPS="off on"), each daemon with an empty Triton cache of its own
# (so every kernel variant is compiled in that process, as on a machine's first start).  Random weights of
# V4-Flash widths (LAYERS, default 0,0,4,128; FAMILY=deepseek_v41 for V4.1-Flash widths, 0,0,2,2,1,1), one
# GPU; SERVE_ARGS go to `ds4d serve`.  Logs and JSON under $OUT.
set -o pipefail
source "$(dirname "$0")/daemon_lib.sh"
ds4d_setup || exit 1
FAMILY=${FAMILY:-deepseek_v4}; PORT=${PORT:-18441}; DIR=${DIR:-/tmp/first_use_$FAMILY}
ds4d_random_config "$DIR" "$FAMILY" "${LAYERS:-}" || exit 1
for mode in ${WARMUPS:-off on}; do
  export TRITON_CACHE_DIR=$(mktemp -d)
  start=$(date +%s)
  $PY -m ds4d.cli serve --model "$DIR" --load-format random --device cuda --port "$PORT" --warmup "$mode" \
    --max-context "${CTX:-32768}" --max-num-seqs "${SEQS:-4}" ${SERVE_ARGS:-} > "$OUT/first_use_$mode.log" 2>&1 &
  PID=$!
  ds4d_wait_ready "$PORT" "$PID" "${READY_S:-500}" || { tail -30 "$OUT/first_use_$mode.log"; kill $PID; exit 1; }
  ready=$(date +%s)
  echo "warm-up $mode: ready after $(( ready - start )) s${CUDA_MODULE_LOADING:+ (CUDA_MODULE_LOADING=$CUDA_MODULE_LOADING)}," \
    "GPU memory used $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | head -1)"
  grep -E "warm-up:" "$OUT/first_use_$mode.log" | cut -c1-200
  $PY tests/gpu/first_use.py "$PORT" "warm-up $mode" "$OUT/first_use_$mode.json" || { kill $PID; exit 1; }
  kill "$PID"; wait "$PID"
  # which Triton kernels were compiled once serving had begun (what the warm-up did not run)
  $PY - "$TRITON_CACHE_DIR" "$ready" <<'PYEOF'
import collections, json, pathlib, sys
root, ready = pathlib.Path(sys.argv[1]), float(sys.argv[2])
before, after = collections.Counter(), []
for meta in root.glob("*/*.json"):
    try:
        data = json.loads(meta.read_text())
    except (OSError, ValueError):
        continue
    if not isinstance(data, dict) or "name" not in data:
        continue
    if meta.stat().st_mtime < ready:
        before[data["name"]] += 1
    else:
        detail = {k: data[k] for k in ("constants", "attrs", "signature") if k in data}
        after.append(f"{data['name']} {json.dumps(detail)[:300]}")
print(f"Triton variants compiled before ready: {sum(before.values())} ({len(before)} kernels); after: {len(after)}")
for line in after:
    print("  after ready:", line)
PYEOF
  rm -rf "$TRITON_CACHE_DIR"
done
