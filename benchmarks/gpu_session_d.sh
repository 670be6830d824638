#!/usr/bin/env bash
# Session 3, first H200 call: GPU tests of the Mosaic kernel (epilogue loads
# prefetched under the main loop), then the whole 8B step at T = 512 and
# 2048 ('auto' = Mosaic), each configuration in a fresh process.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 150 python3 -m pytest -q -m gpu tests/test_mosaic_kernel.py \
  -p no:cacheprovider 2>&1 | tail -4
mm() { timeout 170 python3 benchmarks/model_memory.py "$@" 2>&1 | tail -1; }
mm --config llama-3.1-8b --variant forge --batch 1 --seq 512 \
   --out $OUT/model_memory_8b_forge_T512_h200_$C.json
mm --config llama-3.1-8b --variant forge --batch 1 --seq 2048 --breakdown \
   --out $OUT/model_memory_8b_forge_h200_$C.json
