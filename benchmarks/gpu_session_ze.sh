#!/usr/bin/env bash
# Session 7, sixth H200 call: optax's whole step at T = 2048 beside
# FORGE's of the fifth call (same session), then the kernel table's
# T = 8192 rows (the fifth call's time budget ended in the 2048 ones).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 150 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant optax \
  --batch 1 --seq 2048 --out $OUT/model_memory_8b_optax_h200_$C.json 2>&1 | tail -1
timeout 280 python3 benchmarks/kernel_bench.py --suite mosaic --mosaic-defaults --tokens 8192 \
  --time-budget-s 230 --out $OUT/kernel_h200_mosaic_T8192_$C.json > $OUT/kernel_table_T8192_$C.txt 2>&1
echo "table rc=$?"; grep -c "adamw\|sgd\|lion" $OUT/kernel_table_T8192_$C.txt
