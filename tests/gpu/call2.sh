export OUT=${OUT:-out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py tests/gpu/test_quant_matmul_gpu.py tests/unit/test_hc_triton.py tests/gpu/test_hc_kernel.py tests/gpu/test_dsv4_gpu.py tests/gpu/test_dsv4_gpu_reuse.py > $OUT/tests.log 2>&1
timeout 60 python3 tests/gpu/decode_anatomy.py --compile --lookahead > $OUT/anat_bf16_la.txt 2>&1
timeout 60 python3 tests/gpu/decode_anatomy.py --compile --native --lookahead > $OUT/anat_nat_la.txt 2>&1
timeout 60 python3 tests/gpu/decode_anatomy.py --compile --native > $OUT/anat_nat.txt 2>&1
timeout 120 python3 -m ds4d.cli bench model --sweep --kernels --native --no-hf --no-reference --batches 1 --decode-tokens 8 > $OUT/sweep.log 2>&1
timeout 150 python3 -m ds4d.cli bench model --native --compile --lookahead --no-hf --no-reference --batches 1,8,64 > $OUT/native.log 2>&1
tail -5 $OUT/tests.log; grep -h -A3 "^| wall" $OUT/anat_*.txt; grep "mxfp4_rows" $OUT/sweep.log | head -5; tail -12 $OUT/native.log
