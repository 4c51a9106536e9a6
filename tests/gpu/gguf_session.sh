#!/usr/bin/env bash
# DeepSeek-V4 GGUF blocks on one GPU, in one device call: the kernels' and the native model's GPU tests,
# the GEMV and prefill-tiles sweeps (tests/gpu/gguf_gemv_sweep.py, gguf_tiles_sweep.py), then
# `bench model --gguf q2` against the native FP8/MXFP4 model of the same depth, back to back.  Carry the gguf
# wheel in .whl/ (daemon_lib.sh installs it).
#
#   LAYERS=0,0,4,128 tests/gpu/gguf_session.sh      # the depth of both benchmarks (default: V4-Flash's first 4)
#   SWEEP=0 TESTS=0 tests/gpu/gguf_session.sh       # benchmarks only
#   KINDS=gguf FULL=1 tests/gpu/gguf_session.sh     # q2 only, then q2 at full depth (43 layers, CONTEXT=32768)
#   GATE=1 tests/gpu/gguf_session.sh                # also the regression gate's quick rows, after the tests
#   SWEPT=1 tests/gpu/gguf_session.sh               # the benchmarks with the sweeps' best launches (their JSON)
#   TILES_SWEEP=0 tests/gpu/gguf_session.sh         # no tiles sweep
#   SWEEP_TYPES=IQ2_XXS,Q2_K tests/gpu/gguf_session.sh   # the GEMV sweep of those types' cases only
#   BENCH=0 tests/gpu/gguf_session.sh               # tests and sweeps only (the sweeps alone take up to 8 minutes)
#   LAUNCHES=a.json,b.json SWEEP=0 TILES_SWEEP=0 tests/gpu/gguf_session.sh   # benchmarks with launches from files
set -o pipefail
source "$(dirname "$0")/daemon_lib.sh"
ds4d_setup || exit 1
LAYERS=${LAYERS:-0,0,4,128}
COMMON="--no-hf --no-reference --batches ${BATCHES:-1,8} --decode-tokens 64 ${BENCH_ARGS:-}"
if [ "${TESTS:-1}" = 1 ]; then
  timeout -s INT -k 20 ${TESTS_S:-200} $PY -m pytest -q -rf -x tests/unit/test_gguf_kernels.py tests/gpu/test_dsv4_gguf_gpu.py 2>&1 | tail -6
fi
if [ "${GATE:-0}" = 1 ]; then  # the regression gate's 4-layer rows (tests/gpu/gate.sh --quick)
  INSTALL=0 BENCH_S=${GATE_S:-200} bash tests/gpu/gate.sh --quick 2>&1 | tail -12
fi
if [ "${SWEEP:-1}" = 1 ]; then
  timeout ${SWEEP_S:-280} $PY tests/gpu/gguf_gemv_sweep.py "$OUT/launches.json" ${SWEEP_TYPES:+--types $SWEEP_TYPES} 2>&1 | tee "$OUT/sweep.txt" | grep -v "^  "
fi
if [ "${TILES_SWEEP:-1}" = 1 ]; then
  timeout ${TILES_SWEEP_S:-200} $PY tests/gpu/gguf_tiles_sweep.py "$OUT/tiles.json" 2>&1 | tee "$OUT/tiles.txt" \
    | grep -v "^  "
fi
LAUNCHES=${LAUNCHES:--}
if [ "${SWEPT:-0}" = 1 ]; then  # the sweeps' JSON files that were written
  swept=$(ls "$OUT/launches.json" "$OUT/tiles.json" 2>/dev/null | paste -sd, -)
  LAUNCHES=${swept:--}
fi
[ "${BENCH:-1}" = 1 ] || KINDS=skip
for kind in ${KINDS:-gguf native}; do
  [ $kind = skip ] && continue
  flag=$([ $kind = gguf ] && echo "--gguf q2" || echo "--native")
  echo "== bench model $flag $COMMON --layers $LAYERS"
  timeout "${BENCH_S:-240}" $PY tests/gpu/with_launches.py "$LAUNCHES" bench model $flag $COMMON --layers "$LAYERS" \
    --json "$OUT/$kind.json" \
    2>&1 | tee "$OUT/$kind.log" | grep -v "^  " | tail -14
done
if [ "${FULL:-0}" = 1 ]; then
  echo "== bench model --gguf q2 --depth full --main-only $COMMON --context ${CONTEXT:-32768}"
  timeout "${FULL_S:-300}" $PY tests/gpu/with_launches.py "$LAUNCHES" bench model --gguf q2 --depth full --main-only $COMMON \
    --context "${CONTEXT:-32768}" --json "$OUT/full.json" 2>&1 | tee "$OUT/full.log" | grep -v "^  " | tail -14
fi

