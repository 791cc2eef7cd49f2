export PYTHONPATH=. CUPY_CACHE_DIR=/tmp/cache1
python benchmarks/precompile.py --jobs 16 --family 'fwd_decode|fwd_combine' > $OUT/pre.log 2>&1; tail -1 $OUT/pre.log
timeout 300 python .dev/probe3.py > $OUT/probe3.log 2>&1; echo probe rc $?
timeout 200 python -m pytest -q -m "gpu or gpu_sweep" -p no:cacheprovider -n 8 tests/test_merge_gpu.py tests/test_split_gpu.py > $OUT/tests.log 2>&1; echo tests rc $?
tail -3 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
cat $OUT/probe3.log
