#!/usr/bin/env bash
# Session 3, last H200 call: GPU tests of the Mosaic kernel (stochastic
# rounding and int8 states against the reference; bits across configs and
# runs), the 8B step with bf16 + SR weights and int8 states ('auto' = Mosaic
# now), the low-precision kernel check (Triton and Mosaic), and optax at
# B = 4 (the 68.0 GiB anchor), each in a fresh process.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  tests/test_low_precision.py 2>&1 | grep -v "Warning\|warn" | tail -8
mm() { timeout "$1" python3 benchmarks/model_memory.py "${@:2}" 2>&1 | tail -1; }
mm 170 --config llama-3.1-8b --variant forge --batch 1 --seq 2048 --state-dtype int8 \
   --weight-rounding stochastic --out $OUT/model_memory_8b_forge-int8-sr_h200_$C.json
timeout 100 python3 benchmarks/lowp_kernel_check.py --suite h200 \
   --out $OUT/lowp_kernel_h200_$C.json 2>&1 | grep -v "Warning\|warn" | tail -6
mm 120 --config llama-3.1-8b --variant optax --batch 4 --seq 2048 \
   --out $OUT/model_memory_8b_optax_B4_h200_$C.json
