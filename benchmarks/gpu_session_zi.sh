#!/usr/bin/env bash
# Session 8, second H200 call: why two epilogue warpgroups stream W, m, v
# at half the inline schedule's rate at 512 tokens (even without the rule).
# ptxas's register and spill report for both; Nsight Compute counters of
# inline and ew2 at T = 512, with and without the rule, summarized on the
# device. Then the inline default's GPU tests (x's transpose now through
# ref.transpose, plgpu.transpose_ref being deprecated in JAX 0.11).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
C=${FORGE_COMMIT}
MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python3 benchmarks/kernel_counters.py \
  --only ew2-T512 inline-T512 --out $OUT/ptxas_probes_$C.json > $OUT/ptxas_$C.txt 2>&1
echo "ptxas dump rc=$?"; grep -iE "registers|spill" $OUT/ptxas_$C.txt | head -12
timeout 200 ncu --profile-from-start off --clock-control none --section SpeedOfLight \
  --section WarpStateStats --section LaunchStats --section SourceCounters \
  --section MemoryWorkloadAnalysis --section SchedulerStats \
  -f -o $OUT/counters_$C python3 benchmarks/kernel_counters.py \
  --out $OUT/kernel_counters_probes_h200_$C.json \
  --only inline-T512 inline-T512-rule-free ew2-T512 ew2-T512-rule-free \
  > $OUT/ncu_log_$C.txt 2>&1
echo "ncu rc=$?"; tail -2 $OUT/ncu_log_$C.txt
if [ -f $OUT/counters_$C.ncu-rep ]; then
  ncu --import $OUT/counters_$C.ncu-rep --csv --page details > $OUT/kernel_counters_details_h200_$C.csv 2>&1
  timeout 60 ncu --import $OUT/counters_$C.ncu-rep --csv --page source --print-source sass \
    | gzip > $OUT/kernel_counters_source_h200_$C.csv.gz
  rm -f $OUT/counters_$C.ncu-rep
  python3 benchmarks/counters_summary.py --probes $OUT/kernel_counters_probes_h200_$C.json \
    --details $OUT/kernel_counters_details_h200_$C.csv \
    --source $OUT/kernel_counters_source_h200_$C.csv.gz \
    --out $OUT/kernel_counters_h200_$C.json > $OUT/summary_log_$C.txt 2>&1
  echo "summary rc=$?"; tail -30 $OUT/summary_log_$C.txt
  gzip -f $OUT/kernel_counters_details_h200_$C.csv
fi
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "matches_reference_on_gpu and default" > $OUT/gpu_tests_$C.txt 2>&1
echo "GPU tests rc=$?"; tail -2 $OUT/gpu_tests_$C.txt
