#!/usr/bin/env bash
# Session 6, third H200 call. The second call's first kernel with four
# compute warpgroups (64 x 16 epilogue sub-tiles) never finished, in the GPU
# tests, the diagnosis and Nsight Compute alike. Each config alone now, in
# its own process with a time limit: four warpgroups with 64 x 32
# sub-tiles, two warpgroups with 64 x 16 sub-tiles, ... Then the GPU tests
# of the defaults and pingpong (kernel code changed since their last H200
# run, d9d8442), and of four warpgroups if they ran.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
for cfg in wg4-steps3-slots1 inline-steps5-en16 wg4-steps2-slots2 wg4-steps4-en16-slots1; do
  timeout 75 python3 benchmarks/kernel_bench.py --suite mosaic-diag --diag-configs $cfg \
    --tokens 512 2048 --out $OUT/mosaic_diag_${cfg}_h200_$C.json > $OUT/diag_${cfg}_$C.txt 2>&1
  echo "$cfg rc=$?"; grep "^diag" $OUT/diag_${cfg}_$C.txt
done
timeout 170 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "(default or pingpong) and matches_reference_on_gpu" > $OUT/gpu_tests_$C.txt 2>&1
echo "GPU tests rc=$?"; tail -3 $OUT/gpu_tests_$C.txt
if grep -q "wg4-steps3-slots1: [0-9]" $OUT/diag_wg4-steps3-slots1_$C.txt; then
  timeout 80 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
    -k "four-warpgroups and matches_reference_on_gpu" > $OUT/gpu_tests_wg4_$C.txt 2>&1
  echo "wg4 GPU tests rc=$?"; tail -3 $OUT/gpu_tests_wg4_$C.txt
fi
