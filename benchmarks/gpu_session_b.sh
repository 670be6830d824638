#!/usr/bin/env bash
# One H200 call: the Mosaic GPU kernel sweep + checks + table, then whole-model
# runs, each configuration in a fresh process.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
python3 benchmarks/kernel_bench.py --suite mosaic --time-budget-s 230 \
  --out $OUT/kernel_h200_mosaic_$C.json 2>&1 | grep -v "^WARNING\|Deprecat" | tail -45
mm() { timeout 150 python3 benchmarks/model_memory.py "$@" 2>&1 | tail -1; }
mm --config llama-3.1-8b --variant optax --batch 1 --seq 512 --out $OUT/model_memory_8b_optax_T512_h200_$C.json
mm --config qwen3-14b --variant forge --batch 1 --seq 2048 --implementation triton \
   --state-dtype int8 --weight-rounding stochastic --breakdown \
   --out $OUT/model_memory_qwen14b_forge-int8-sr_h200_$C.json
mm --config llama-3.1-8b --variant forge --batch 4 --seq 2048 --implementation triton \
   --out $OUT/model_memory_8b_forge_B4_h200_$C.json
