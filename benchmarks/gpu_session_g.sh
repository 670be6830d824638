#!/usr/bin/env bash
# Session 3, fourth H200 call: the remat-policy tests under JAX 0.11.2 (CPU
# platform), then whole 8B steps, each in a fresh process: FORGE with the
# token-ranked default Mosaic configs at T = 512 and 2048; FORGE and optax
# with the dots_with_no_batch_dims_saveable remat policy; optax with cuDNN attention
# (the anchor for FORGE's cuDNN run).
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
JAX_PLATFORMS=cpu timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/test_scan.py -k policy 2>&1 | tail -2
mm() { timeout 150 python3 benchmarks/model_memory.py "$@" 2>&1 | tail -1; }
M="--config llama-3.1-8b --batch 1"
mm $M --variant forge --seq 512 --out $OUT/model_memory_8b_forge_T512_h200_$C.json
mm $M --variant forge --seq 2048 --breakdown --out $OUT/model_memory_8b_forge_h200_$C.json
mm $M --variant forge --seq 2048 --remat-policy dots_with_no_batch_dims_saveable \
   --out $OUT/model_memory_8b_forge_dots_h200_$C.json
mm $M --variant optax --seq 2048 --remat-policy dots_with_no_batch_dims_saveable \
   --out $OUT/model_memory_8b_optax_dots_h200_$C.json
mm $M --variant optax --seq 2048 --attention cudnn \
   --out $OUT/model_memory_8b_optax_cudnn_h200_$C.json
