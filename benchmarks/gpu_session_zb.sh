#!/usr/bin/env bash
# Session 7, third H200 call: the SASS of the inline default and its
# rule-free variant at 512 tokens (Mosaic GPU's dumps: ptxas's register and
# spill report, the SASS), to count the epilogue's instructions an element;
# and the ring beside inline at 64 tokens (almost all epilogue: do more
# windows in flight speed up the bare W / m / v stream?).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_PTX=1 timeout 150 \
  python3 benchmarks/kernel_counters.py --only inline-T512 inline-T512-rule-free \
  --out $OUT/sass_probes_$C.json > $OUT/sass_inline_T512_$C.txt 2>&1
echo "dump rc=$?"; gzip $OUT/sass_inline_T512_$C.txt; ls -la $OUT
timeout 120 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --diag-configs ring-steps6 inline-steps5 --tokens 64 \
  --out $OUT/mosaic_diag_T64_h200_$C.json 2>&1 | grep "^diag"
