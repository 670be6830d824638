#!/usr/bin/env bash
# Session 8, fourth H200 call: the whole 8B step at T = 512, FORGE and optax,
# each with XLA's defaults and with XLA's dynamic-slice fusion (a GEMM reads
# its layer's weights inside the stacked array instead of a copy: session
# 5's profile put the scan's weight copies at 14 ms of FORGE's step, 20 ms
# of optax's). One configuration per fresh process.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
for V in forge optax; do
  timeout 130 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant $V \
    --batch 1 --seq 512 --out $OUT/model_memory_8b_${V}_T512_h200_$C.json 2>&1 | tail -1
  XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true timeout 130 python3 \
    benchmarks/model_memory.py --config llama-3.1-8b --variant $V --batch 1 --seq 512 \
    --out $OUT/model_memory_8b_${V}_T512_dsfusion_h200_$C.json 2>&1 | tail -1
done
