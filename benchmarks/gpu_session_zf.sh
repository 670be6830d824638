#!/usr/bin/env bash
# Session 7, seventh H200 call: FORGE's whole step at T = 2048 again with
# the default (pingpong from 2048 tokens) and with the inline schedule
# forced, each in a fresh process (the fifth call's 325.6 ms was slower than
# optax's 316.5 in the sixth).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 150 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 2048 --out $OUT/model_memory_8b_forge_rerun_h200_$C.json 2>&1 | tail -1
timeout 150 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 2048 --mosaic-config '{"max_concurrent_steps": 5}' \
  --out $OUT/model_memory_8b_forge_inline_h200_$C.json 2>&1 | tail -1
