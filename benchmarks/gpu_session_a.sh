#!/usr/bin/env bash
# One H200 call: the Mosaic GPU kernel suite, then the 8B FORGE step's memory
# breakdown (Triton kernel, as in the earlier 49.11 GiB run).
set -u
export PYTHONPATH=$PWD
python3 benchmarks/kernel_bench.py --suite mosaic --time-budget-s 300 \
  --out $OUT/kernel_h200_mosaic_${FORGE_COMMIT}.json 2>&1 | grep -v "^WARNING\|DeprecationWarning" | tail -80
python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge --batch 1 --seq 2048 \
  --implementation triton --breakdown --out $OUT/model_memory_8b_forge_breakdown_h200_${FORGE_COMMIT}.json 2>&1 | tail -40
