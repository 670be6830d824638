#!/usr/bin/env bash
# Session 5, second H200 call: where the whole 8B step's time goes at T = 512
# (kernel profiles of optax and of FORGE with its default config), and the
# whole step at T = 2048 with the pingpong schedule (the diagnosis's fastest
# config at that token count, 8e89c93).
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
mm() { timeout 150 python3 benchmarks/model_memory.py --config llama-3.1-8b --batch 1 "$@" 2>&1 | tail -1; }
mm --variant optax --seq 512 --profile --out $OUT/model_memory_8b_optax_T512_profile_h200_$C.json
mm --variant forge --seq 512 --profile --out $OUT/model_memory_8b_forge_T512_profile_h200_$C.json
PP='{"schedule": "pingpong", "tile_n": 128, "max_concurrent_steps": 4, "epilogue_n": 64, "epilogue_slots": 1}'
mm --variant forge --seq 2048 --mosaic-config "$PP" --out $OUT/model_memory_8b_forge_pingpong_h200_$C.json
