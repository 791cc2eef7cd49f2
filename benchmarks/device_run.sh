#!/usr/bin/env bash
# One device call: GPU tests, demo, benchmark; logs under $OUT, short summary last.
#   bash benchmarks/device_run.sh [pytest args...]      (BENCH=0 skips the benchmark)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cuflash_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m cuflash info
python3 -m pytest -m gpu -p no:cacheprovider -rfE "$@" > "$OUT/pytest.log" 2>&1
echo "pytest exit code: $?" >> "$OUT/pytest.log"
python3 -m cuflash demo > "$OUT/demo.log" 2>&1
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/bench.py ${BENCH_ARGS:---quick} --out "$OUT" > "$OUT/bench.log" 2>&1
fi
echo "== pytest (tail) =="
tail -25 "$OUT/pytest.log"
echo "== demo =="
cat "$OUT/demo.log"
