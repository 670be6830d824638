#!/usr/bin/env bash
# Session 8, last H200 call: where FORGE's whole 8B step at T = 512 spends
# its time now (kernel profile, default config); then the GPU tests of the
# schedules whose optimizer table has not run since the skip counts became
# per-row vectors (pingpong, one epilogue warpgroup, four compute
# warpgroups), and int8 + SR.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 150 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 512 --profile \
  --out $OUT/model_memory_8b_forge_T512_profile_h200_$C.json 2>&1 | tail -1
timeout 260 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "matches_reference_on_gpu and (pingpong or epilogue-warpgroup or four) and not two" \
  > $OUT/gpu_tests_$C.txt 2>&1
echo "GPU tests rc=$?"; tail -3 $OUT/gpu_tests_$C.txt
timeout 100 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "int8_sr_matches_reference_on_gpu" > $OUT/gpu_tests_int8_$C.txt 2>&1
echo "int8 GPU tests rc=$?"; tail -2 $OUT/gpu_tests_int8_$C.txt
