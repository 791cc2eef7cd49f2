set -x
export PYTHONPATH=. CUPY_CACHE_DIR=/tmp/cache1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
python benchmarks/precompile.py --jobs 16 --family 'fwd_decode|fwd_combine' > $OUT/pre.log 2>&1; tail -2 $OUT/pre.log
timeout 330 python .dev/probe_onesplit.py "$@" > $OUT/probe.log 2>&1; echo probe rc $?
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider -x -n 8 tests/test_split_gpu.py tests/test_kvcache.py -k "not even_shares" > $OUT/tests.log 2>&1; echo tests rc $?
tail -5 $OUT/tests.log
cat $OUT/probe.log | grep -v "^  B="
grep "^  B=" $OUT/probe.log | head -40
