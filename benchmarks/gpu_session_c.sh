#!/usr/bin/env bash
# One H200 call: GPU tests of both kernels, then whole-step 8B runs with the
# stacked in-place scan backward ('auto' = the Mosaic kernel where it applies),
# each configuration in a fresh process.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 150 python3 -m pytest -q -m gpu tests/test_mosaic_kernel.py tests/test_kernel.py \
  -p no:cacheprovider 2>&1 | tail -6
mm() { timeout 160 python3 benchmarks/model_memory.py "$@" 2>&1 | tail -2; }
mm --config llama-3.1-8b --variant forge --batch 1 --seq 2048 --breakdown \
   --out $OUT/model_memory_8b_forge_h200_$C.json \
 || mm --config llama-3.1-8b --variant forge --batch 1 --seq 2048 --implementation triton \
   --breakdown --out $OUT/model_memory_8b_forge-triton_h200_$C.json
mm --config llama-3.1-8b --variant forge --batch 1 --seq 512 \
   --out $OUT/model_memory_8b_forge_T512_h200_$C.json
mm --config llama-3.1-8b --variant forge --batch 1 --seq 2048 --state-dtype int8 \
   --weight-rounding stochastic --out $OUT/model_memory_8b_forge-int8-sr_h200_$C.json
