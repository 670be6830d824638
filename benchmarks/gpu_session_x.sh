#!/usr/bin/env bash
# Session 6, fifth H200 call: the main loop carries its ring slot instead of
# recomputing (first + t) % stages each step (Nsight Compute: integer
# division between the wgmma at 2048 tokens). GPU tests of the defaults and
# pingpong (stop if they fail); the diagnosis (inline with 5 and 4 stages,
# pingpong) at 512-8192 tokens; then the kernel table with the default
# configs for as long as the call allows.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 110 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "(default or pingpong) and matches_reference_on_gpu" > $OUT/gpu_tests_$C.txt 2>&1
RC=$?; echo "GPU tests rc=$RC"; tail -2 $OUT/gpu_tests_$C.txt
[ $RC = 0 ] || exit 1
timeout 130 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --diag-configs inline-steps5 inline-steps4 pingpong-steps4-slots3 \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep "^diag"
timeout 320 python3 benchmarks/kernel_bench.py --suite mosaic --mosaic-defaults \
  --time-budget-s 270 --out $OUT/kernel_h200_mosaic_$C.json > $OUT/kernel_table_$C.txt 2>&1
echo "table rc=$?"; grep -c "adamw\|sgd\|lion" $OUT/kernel_table_$C.txt
