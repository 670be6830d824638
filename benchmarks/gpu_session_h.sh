#!/usr/bin/env bash
# Session 3, fifth H200 call: whole 8B steps, each in a fresh process: FORGE
# with cuDNN attention (five timed steps, as optax's cuDNN anchor), T = 512
# with the final token-ranked Mosaic defaults, and B = 4 (the second
# batch size; optax's anchor 68.0 GiB).
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
mm() { timeout 170 python3 benchmarks/model_memory.py "$@" 2>&1 | tail -1; }
M="--config llama-3.1-8b --variant forge"
mm $M --batch 1 --seq 2048 --attention cudnn --out $OUT/model_memory_8b_forge_cudnn_h200_$C.json
mm $M --batch 1 --seq 512 --out $OUT/model_memory_8b_forge_T512_h200_$C.json
mm $M --batch 4 --seq 2048 --out $OUT/model_memory_8b_forge_B4_h200_$C.json
