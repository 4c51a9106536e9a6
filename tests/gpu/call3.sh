export OUT=${OUT:-out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_matmul_gpu.py > $OUT/tests.log 2>&1
timeout 150 python3 -m ds4d.cli bench model --sweep --kernels --native --no-hf --no-reference --batches 1 --decode-tokens 8 > $OUT/sweep.log 2>&1
timeout 150 python3 -m ds4d.cli bench model --native --compile --lookahead --no-hf --no-reference --batches 1,8,64 --json $OUT/native.json > $OUT/native.log 2>&1
timeout 60 python3 tests/gpu/decode_anatomy.py --compile --native --lookahead > $OUT/anat_nat_la.txt 2>&1
tail -3 $OUT/tests.log; grep "mxfp4_rows:" $OUT/sweep.log; grep "experts" $OUT/sweep.log; tail -12 $OUT/native.log; grep -A2 "^| wall" $OUT/anat_nat_la.txt
