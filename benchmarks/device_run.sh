#!/usr/bin/env bash
# One device call: the steps named in $STEPS, logs under $OUT, a short summary last.
#   STEPS="compile tests" bash benchmarks/device_run.sh [pytest args...]
# Steps (default "compile tests demo bench"):
#   compile   build every kernel variant for this GPU into CuPy's cache, in parallel
#   tests     python -m pytest -m gpu (extra arguments go to pytest)
#   sanitize  compute-sanitizer: memcheck and initcheck on the full sanitize workload, racecheck
#             and synccheck on its quick set, synccheck on the persistent Hopper forward, all four on
#             the split-KV forward (--split)
#             (benchmarks/sanitize_workload.py; $SAN_SPECS overrides the list)
#   compare   benchmarks/compare_trees.py --before $BEFORE (default .before) --after .
#   accuracy  benchmarks/accuracy.py (the README's accuracy table)
#   demo      python -m cuflash demo
#   bench     benchmarks/bench.py $BENCH_ARGS (default --quick) into $OUT/bench
#   masking   benchmarks/bench_masking.py $MASK_ARGS into $OUT/masking
#   decode    benchmarks/bench_decode.py $DECODE_ARGS (default --quick) into $OUT/decode
#   ring      benchmarks/bench_ring.py $RING_ARGS (2 GPUs by default) into $OUT/ring
#   varlen    benchmarks/varlen_vs_dense.py $VARLEN_ARGS (the packed forward against the dense kernel), then
#             benchmarks/bench_varlen.py $VARLEN_BENCH_ARGS (default --quick) into $OUT/varlen
#   ncu       ncu's summary sections for benchmarks/profile_case.py $NCU_CASES
#   hot       ncu --set full per "$HOT_SPECS" entry case:kernel-regex:launch-skip:launch-count,
#             then benchmarks/ncu_hot.py (stall reasons, hottest SASS lines)
#   masking   benchmarks/bench_masking.py $MASK_ARGS (default --repeat 10) into $OUT/masking
#   tune      the float64 / float32 tuning candidates: dmma_rate.py, tune_fwd.py and
#             tune_bwd.py --dtype float64, tune_f32.py (or the ';'-separated $TUNE_CMDS); each under $TUNE_TIMEOUT (default 200 s), exit codes
#             and table tails in the summary
#   ncu       Nsight Compute on benchmarks/profile_case.py for $NCU_CASES (default "plain bias"):
#             three forward or dK/dV launches after the first call, key sections, text in ncu_<case>.log
# Logs are written to a scratch folder and come back as $OUT/logs.tgz beside $OUT/summary.txt
# (the device tool returns at most 8 files).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
RESULTS=${OUT:-/tmp/cuflash_out}
OUT=$(mktemp -d)
STEPS=${STEPS:-compile tests demo bench}
mkdir -p "$RESULTS"
summary="$OUT/summary.txt"
: > "$summary"
has() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$summary"
python3 -m cuflash info > "$OUT/info.log" 2>&1

if has compile; then
  python3 -m cuflash compile > "$OUT/compile.log" 2>&1
  echo "compile: $(tail -1 "$OUT/compile.log")" >> "$summary"
fi
if has tests; then
  timeout "${TEST_TIMEOUT:-520}" python3 -m pytest -m gpu -p no:cacheprovider -rfE --durations=15 "$@" \
    > "$OUT/pytest.log" 2>&1
  echo "pytest exit code: $?" >> "$OUT/pytest.log"
  { echo "== pytest (tail) =="; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30; tail -3 "$OUT/pytest.log"; } >> "$summary"
fi
if has sanitize; then
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  echo "== compute-sanitizer ($san) ==" >> "$summary"
  n=0
  for spec in ${SAN_SPECS:-memcheck: initcheck: racecheck:--quick synccheck:--quick synccheck:--hopper-persistent memcheck:--split initcheck:--split racecheck:--split synccheck:--split}; do
    tool=${spec%%:*}; extra=${spec#*:}; n=$((n + 1))
    log="$OUT/sanitize_${n}_$tool.log"
    timeout "${SAN_TIMEOUT:-300}" "$san" --tool "$tool" --error-exitcode 9 python3 benchmarks/sanitize_workload.py $extra \
      > "$log" 2>&1
    echo "$tool $extra exit $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|hazard' "$log" | tail -2 | tr '\n' ' ') ($(grep -c finite=True "$log") finite, $(grep -c finite=False "$log") not)" >> "$summary"
  done
fi
if has compare; then
  python3 benchmarks/compare_trees.py --before "${BEFORE:-.before}" --after . ${COMPARE_ARGS:-} \
    --json "$OUT/compare.json" > "$OUT/compare.log" 2>&1
  { echo "== before / after =="; cat "$OUT/compare.log"; } >> "$summary"
fi
if has accuracy; then
  python3 benchmarks/accuracy.py > "$OUT/accuracy.log" 2>&1
  { echo "== accuracy =="; cat "$OUT/accuracy.log"; } >> "$summary"
fi
if has demo; then
  python3 -m cuflash demo > "$OUT/demo.log" 2>&1
  { echo "== demo =="; cat "$OUT/demo.log"; } >> "$summary"
fi
if has bench; then
  python3 benchmarks/bench.py ${BENCH_ARGS:---quick} --out "$OUT/bench" > "$OUT/bench.log" 2>&1
  echo "bench exit $? (tables in $OUT/bench)" >> "$summary"
fi
if has masking; then
  python3 benchmarks/bench_masking.py ${MASK_ARGS:---repeat 10} --out "$OUT/masking" > "$OUT/masking.log" 2>&1
  { echo "== masking (exit $?) =="; cat "$OUT"/masking/*.md 2>/dev/null || tail -20 "$OUT/masking.log"; } >> "$summary"
fi
if has decode; then
  python3 benchmarks/bench_decode.py ${DECODE_ARGS:---quick} --out "$OUT/decode" > "$OUT/decode.log" 2>&1
  { echo "== decode (exit $?) =="; cat "$OUT"/decode/*.md 2>/dev/null || tail -20 "$OUT/decode.log"; } >> "$summary"
fi
if has ring; then
  python3 benchmarks/bench_ring.py ${RING_ARGS:-} --out "$OUT/ring" > "$OUT/ring.log" 2>&1
  { echo "== ring (exit $?) =="; cat "$OUT"/ring/*.md 2>/dev/null || tail -20 "$OUT/ring.log"; } >> "$summary"
fi
if has varlen; then
  python3 benchmarks/varlen_vs_dense.py ${VARLEN_ARGS:-} > "$OUT/varlen_vs_dense.log" 2>&1
  { echo "== varlen vs dense (exit $?) =="; grep "^D=" "$OUT/varlen_vs_dense.log" || tail -20 "$OUT/varlen_vs_dense.log"; } >> "$summary"
  python3 benchmarks/bench_varlen.py ${VARLEN_BENCH_ARGS:---quick} --out "$OUT/varlen" > "$OUT/varlen.log" 2>&1
  { echo "== varlen (exit $?) =="; cat "$OUT"/varlen/*.md 2>/dev/null || tail -20 "$OUT/varlen.log"; } >> "$summary"
fi
if has tune; then
  echo "== tune ==" >> "$summary"
  # $TUNE_CMDS: ';'-separated script commands (default: all four)
  IFS=';' read -ra tune_cmds <<< "${TUNE_CMDS:-dmma_rate.py;tune_fwd.py --dtype float64 --heads 64,128 --lengths 4096 --wide-only;tune_bwd.py --dtype float64 --heads 64,128;tune_f32.py --heads 64,128}"
  for cmd in "${tune_cmds[@]}"; do
    name=${cmd%%.py*}
    timeout "${TUNE_TIMEOUT:-200}" python3 benchmarks/$cmd > "$OUT/$name.log" 2>&1
    { echo "-- $cmd: exit $?"; grep -v "^\s*$" "$OUT/$name.log" | tail -"${TUNE_TAIL:-30}"; } >> "$summary"
  done
fi
if has ncu; then
  ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for case in ${NCU_CASES:-plain bias}; do
    timeout "${NCU_TIMEOUT:-240}" "$ncu_bin" -k 'regex:flash_(fwd|bwd_dkdv)' --launch-skip 3 --launch-count 3 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section LaunchStats --section Occupancy \
      python3 benchmarks/profile_case.py "$case" --calls 3 > "$OUT/ncu_$case.log" 2>&1
    { echo "== ncu $case (exit $?) =="
      grep -E "flash_|Duration|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc Active|Registers Per|Achieved Occupancy|Stall|L2 Hit|Issue Slots Busy" \
        "$OUT/ncu_$case.log" | head -60; } >> "$summary"
  done
fi
if has hot; then
  ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for spec in ${HOT_SPECS:-plain:flash_fwd_mma:2:1 plain:flash_bwd_dkdv:2:1 bias:flash_fwd_mma:2:1 bias:flash_bwd_dkdv:4:2}; do
    IFS=: read -r case kern skip count <<< "$spec"
    rep="$OUT/hot_${case}_${kern}"
    timeout "${NCU_TIMEOUT:-240}" "$ncu_bin" --set full --import-source no -k "regex:$kern" --launch-skip "$skip" \
      --launch-count "$count" -o "$rep" python3 benchmarks/profile_case.py "$case" --calls 3 ${PROFILE_ARGS:-} > "$rep.log" 2>&1
    { echo "== hot $spec (exit $?) =="; python3 benchmarks/ncu_hot.py "$rep.ncu-rep" --top "${HOT_TOP:-25}" 2>&1; } >> "$summary"
  done
fi
tar czf "$RESULTS/logs.tgz" --exclude="*.ncu-rep" -C "$OUT" .
cp "$summary" "$RESULTS/summary.txt"
cat "$summary"
