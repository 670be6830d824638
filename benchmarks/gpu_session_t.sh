#!/usr/bin/env bash
# Session 6, first H200 call: Nsight Compute counters of the fused Mosaic
# kernel (inline and pingpong, 64-8192 tokens, with and without the rule)
# beside XLA's GEMM and the optax step (benchmarks/kernel_counters.py).
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
C=${FORGE_COMMIT}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; $NCU --version | tail -1
SECTIONS=""
for s in SpeedOfLight MemoryWorkloadAnalysis ComputeWorkloadAnalysis \
         WarpStateStats SchedulerStats LaunchStats Occupancy SourceCounters; do
  SECTIONS="$SECTIONS --section $s"
done
timeout 400 $NCU --profile-from-start off --clock-control none $SECTIONS \
  -f -o $OUT/counters_$C python3 benchmarks/kernel_counters.py \
  --out $OUT/kernel_counters_probes_h200_$C.json > $OUT/ncu_log_$C.txt 2>&1
echo "ncu rc=$?"; tail -5 $OUT/ncu_log_$C.txt
R=$OUT/counters_$C.ncu-rep
$NCU --import $R --csv --page details > $OUT/kernel_counters_details_h200_$C.csv 2>&1
$NCU --import $R --csv --page raw > $OUT/kernel_counters_raw_h200_$C.csv 2>&1
timeout 60 $NCU --import $R --csv --page source --print-source sass \
  > $OUT/kernel_counters_source_h200_$C.csv 2>&1
gzip -f $OUT/kernel_counters_raw_h200_$C.csv $OUT/kernel_counters_source_h200_$C.csv
ls -la $OUT
