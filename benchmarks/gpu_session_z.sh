#!/usr/bin/env bash
# Session 7, first H200 call: the epilogue stores from registers
# (direct_stores). GPU tests of the direct-store schedules (stop if they
# fail); the bits across configs and calls at 512 tokens (the direct-store
# configs among them: a buffer refilled too early changes the bits); the
# diagnosis, defaults beside their direct-store variants, 512-8192 tokens.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 170 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "direct and matches_reference_on_gpu" > $OUT/gpu_tests_$C.txt 2>&1
RC=$?; echo "GPU tests rc=$RC"; tail -3 $OUT/gpu_tests_$C.txt
[ $RC = 0 ] || exit 1
timeout 100 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not and 512" > $OUT/gpu_tests_bits_$C.txt 2>&1
echo "bits tests rc=$?"; tail -2 $OUT/gpu_tests_bits_$C.txt
timeout 220 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --diag-configs inline-steps5 inline-steps5-direct inline-steps5-en16-slots4-direct \
  inline-steps4-slots3-direct pingpong-steps4-slots3 pingpong-steps4-slots3-direct \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep "^diag"
