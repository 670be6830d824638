#!/usr/bin/env bash
# Session 6, fourth H200 call: four compute warpgroups with setmaxnreg
# asking only for the registers the memory warpgroup releases (the third
# call's hang). Diagnosis of two wg4 configs beside the inline default (own
# processes, time limits), their GPU tests, Nsight Compute at T = 512, and
# the whole 8B step at T = 512 with the faster wg4 config if it beats the
# inline default there.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 90 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --diag-configs wg4-steps3-slots1 inline-steps5 --tokens 512 2048 \
  --out $OUT/mosaic_diag_wg4_h200_$C.json > $OUT/diag_wg4_$C.txt 2>&1
echo "wg4 rc=$?"; grep "^diag" $OUT/diag_wg4_$C.txt
timeout 60 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --diag-configs wg4-steps3-en16-slots2 --tokens 512 2048 \
  --out $OUT/mosaic_diag_wg4_en16_h200_$C.json > $OUT/diag_wg4_en16_$C.txt 2>&1
echo "wg4 en16 rc=$?"; grep "^diag" $OUT/diag_wg4_en16_$C.txt
grep -q "wg4-steps3-slots1: [0-9]" $OUT/diag_wg4_$C.txt || exit 0
timeout 80 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "four-warpgroups and matches_reference_on_gpu" > $OUT/gpu_tests_wg4_$C.txt 2>&1
echo "wg4 GPU tests rc=$?"; tail -3 $OUT/gpu_tests_wg4_$C.txt
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 ncu --profile-from-start off \
  --clock-control none --section SpeedOfLight --section WarpStateStats \
  --section LaunchStats --section SourceCounters --section MemoryWorkloadAnalysis \
  -f -o $OUT/counters_$C python3 benchmarks/kernel_counters.py \
  --out $OUT/kernel_counters_probes_h200_$C.json --only wg4-slots1-T512 \
  > $OUT/ncu_log_$C.txt 2>&1
echo "ncu rc=$?"
if [ -f $OUT/counters_$C.ncu-rep ]; then
  ncu --import $OUT/counters_$C.ncu-rep --csv --page details > $OUT/kernel_counters_details_h200_$C.csv 2>&1
  timeout 30 ncu --import $OUT/counters_$C.ncu-rep --csv --page source --print-source sass \
    | gzip > $OUT/kernel_counters_source_h200_$C.csv.gz
  rm -f $OUT/counters_$C.ncu-rep
fi
python3 - <<PY > $OUT/best_$C.txt
import json
row = next(b for b in json.load(open("$OUT/mosaic_diag_wg4_h200_$C.json"))["bench"]
           if b["tokens"] == 512)
print("yes" if row["wg4-steps3-slots1_ms"] < row["inline-steps5_ms"] else "no")
PY
echo "wg4 faster at 512: $(cat $OUT/best_$C.txt)"
[ "$(cat $OUT/best_$C.txt)" = yes ] || exit 0
timeout 130 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 512 --mosaic-config '{"compute_wgs": 4, "max_concurrent_steps": 3, "epilogue_slots": 1}' \
  --out $OUT/model_memory_8b_forge_T512_wg4_h200_$C.json 2>&1 | tail -1
