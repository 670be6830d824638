#!/usr/bin/env bash
# Session 5, fifth H200 call: the inline schedule on the hand-written
# pipeline (emit_pipeline_warp_specialized shrank to one stage at one step a
# tile and failed to launch, 0528c76). GPU tests of every optimizer (default
# and pingpong), int8 + SR, the bits across configs and calls; the overlap
# probe at 64, 512 and 2048 tokens; the whole 8B step at T = 512, defaults.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 280 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "(default or pingpong) and matches_reference_on_gpu or int8_sr or bits_do_not" \
  > $OUT/gpu_tests_$C.txt 2>&1
echo "GPU tests rc=$?"; tail -4 $OUT/gpu_tests_$C.txt
timeout 120 python3 benchmarks/kernel_bench.py --suite mosaic-overlap \
  --out $OUT/mosaic_overlap_h200_$C.json 2>&1 | grep "^diag"
timeout 130 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 512 --out $OUT/model_memory_8b_forge_T512_h200_$C.json 2>&1 | tail -1
