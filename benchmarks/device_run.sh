#!/usr/bin/env bash
# One device call: GPU tests, demo, benchmark; logs under $OUT, short summary last.
#   bash benchmarks/device_run.sh [pytest args...]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cuflash_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m cuflash info 2>&1 | tee "$OUT/info.log"
python3 -m pytest -q -m gpu -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40
python3 -m cuflash demo 2>&1 | tee "$OUT/demo.log"
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/bench.py ${BENCH_ARGS:---quick} --out "$OUT" 2>"$OUT/bench.err" | tee "$OUT/bench.log" | tail -80
fi
echo "== summary =="
tail -1 "$OUT/pytest.log"
grep -E "check vs|cuflash|naive" "$OUT/demo.log"
