#!/usr/bin/env bash
# Session 7, fourth H200 call: the kernel without Mosaic GPU's automatic
# barriers, the skip count summed once a part. GPU tests of every schedule
# and optimizer, then int8 + SR (stop if they fail); the bits across configs
# and calls at 512 tokens; the diagnosis; the PTX of the inline default at
# 512 tokens (its barriers counted).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 230 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "matches_reference_on_gpu and not four" > $OUT/gpu_tests_$C.txt 2>&1
RC=$?; echo "GPU tests rc=$RC"; tail -3 $OUT/gpu_tests_$C.txt
[ $RC = 0 ] || exit 1
timeout 100 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not and 512" > $OUT/gpu_tests_bits_$C.txt 2>&1
echo "bits tests rc=$?"; tail -2 $OUT/gpu_tests_bits_$C.txt
timeout 120 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --diag-configs inline-steps5 pingpong-steps4-slots3 ring-steps6 \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep "^diag"
MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 \
  python3 benchmarks/kernel_counters.py --only inline-T512 \
  --out $OUT/ptx_probes_$C.json > $OUT/ptx_inline_T512_h200_$C.txt 2>&1
echo "dump rc=$?"; grep -c "bar.sync" $OUT/ptx_inline_T512_h200_$C.txt; gzip $OUT/ptx_inline_T512_h200_$C.txt
