#!/usr/bin/env bash
# Session 8, third H200 call: the memory warpgroup prefetches the kernel and
# state of the CTA's next tile (or the one after) into L2 (l2_prefetch).
# GPU tests of every optimizer with it (stop if they fail); the diagnosis
# beside the same configs without it; the bits across configs and calls at
# 512 tokens (prefetching configs among them).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "matches_reference_on_gpu and l2-prefetch" > $OUT/gpu_tests_$C.txt 2>&1
RC=$?; echo "GPU tests rc=$RC"; tail -3 $OUT/gpu_tests_$C.txt
[ $RC = 0 ] || exit 1
timeout 200 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --diag-configs inline-steps5 inline-steps5-l2pf1 inline-steps5-l2pf2 \
  pingpong-steps4-slots3 pingpong-steps4-slots3-l2pf1 ring-steps6 \
  ring-steps6-l2pf1 ew2-steps4-slots1 ew2-steps4-slots1-l2pf1 \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep "^diag"
timeout 100 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not and 512" > $OUT/gpu_tests_bits_$C.txt 2>&1
echo "bits tests rc=$?"; tail -2 $OUT/gpu_tests_bits_$C.txt
