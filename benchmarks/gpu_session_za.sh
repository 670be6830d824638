#!/usr/bin/env bash
# Session 7, second H200 call: the ring schedule (the kernel and state
# windows through the main loop's ring). Its GPU tests, every optimizer
# (stop if they fail); the diagnosis, ring beside the defaults, 512-8192
# tokens; the whole 8B step at T = 512 with the ring forced; the bits across
# configs and calls at 512 tokens (ring configs among them).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "ring and matches_reference_on_gpu" > $OUT/gpu_tests_$C.txt 2>&1
RC=$?; echo "GPU tests rc=$RC"; tail -3 $OUT/gpu_tests_$C.txt
[ $RC = 0 ] || exit 1
timeout 170 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --diag-configs ring-steps6 ring-steps5 inline-steps5 pingpong-steps4-slots3 \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep "^diag"
timeout 135 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 512 --mosaic-config '{"schedule": "ring", "max_concurrent_steps": 6}' \
  --out $OUT/model_memory_8b_forge_T512_ring_h200_$C.json 2>&1 | tail -1
timeout 100 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not and 512" > $OUT/gpu_tests_bits_$C.txt 2>&1
echo "bits tests rc=$?"; tail -2 $OUT/gpu_tests_bits_$C.txt
