#!/usr/bin/env bash
# Session 6, second H200 call: four compute warpgroups in the inline
# schedule. GPU tests of every optimizer with it; the diagnosis suite
# (wg4 variants beside the session-5 defaults, 512-8192 tokens); Nsight
# Compute on the wg4 probes; the whole 8B step at T = 512 with the fastest
# wg4 config at 512 tokens.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "four-warpgroups and matches_reference_on_gpu" > $OUT/gpu_tests_$C.txt 2>&1
echo "GPU tests rc=$?"; tail -3 $OUT/gpu_tests_$C.txt
timeout 220 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep "^diag"
NCU=$(command -v ncu)
SECTIONS=""
for s in SpeedOfLight MemoryWorkloadAnalysis ComputeWorkloadAnalysis \
         WarpStateStats SchedulerStats LaunchStats Occupancy SourceCounters; do
  SECTIONS="$SECTIONS --section $s"
done
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 $NCU --profile-from-start off \
  --clock-control none $SECTIONS -f -o $OUT/counters_$C \
  python3 benchmarks/kernel_counters.py --out $OUT/kernel_counters_probes_h200_$C.json \
  --only wg4-en16-T512 wg4-slots1-T512 wg4-en16-T64-rule-free wg4-en16-T2048 \
  > $OUT/ncu_log_$C.txt 2>&1
echo "ncu rc=$?"
R=$OUT/counters_$C.ncu-rep
$NCU --import $R --csv --page details > $OUT/kernel_counters_details_h200_$C.csv 2>&1
$NCU --import $R --csv --page raw | gzip > $OUT/kernel_counters_raw_h200_$C.csv.gz
timeout 40 $NCU --import $R --csv --page source --print-source sass \
  | gzip > $OUT/kernel_counters_source_h200_$C.csv.gz
rm -f $R
BEST=$(python3 - <<PY 2>/dev/null
import dataclasses, json, sys
sys.path.insert(0, "benchmarks")
from kernel_bench import MOSAIC_DIAG_CONFIGS
row = next(b for b in json.load(open("$OUT/mosaic_diag_h200_$C.json"))["bench"]
           if b["tokens"] == 512)
name = min((n for n in MOSAIC_DIAG_CONFIGS if n.startswith("wg4")
            and n + "_ms" in row), key=lambda n: row[n + "_ms"])
print(json.dumps(dataclasses.asdict(MOSAIC_DIAG_CONFIGS[name])))
PY
)
echo "best wg4 config at 512: $BEST"
timeout 130 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 512 --mosaic-config "$BEST" \
  --out $OUT/model_memory_8b_forge_T512_wg4_h200_$C.json 2>&1 | tail -1
