#!/usr/bin/env bash
# Session 3, fifth H200 call: whole 8B steps after `after_update` (the update
# before dx's consumers, so the LM head's cotangent dies early), each in a
# fresh process: XLA attention with the buffer breakdown, cuDNN attention
# (five timed steps, as optax's cuDNN anchor), and T = 512 with the final
# token-ranked Mosaic defaults.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
mm() { timeout 150 python3 benchmarks/model_memory.py "$@" 2>&1 | tail -1; }
M="--config llama-3.1-8b --batch 1 --variant forge"
mm $M --seq 2048 --breakdown --out $OUT/model_memory_8b_forge_h200_$C.json
mm $M --seq 2048 --attention cudnn --out $OUT/model_memory_8b_forge_cudnn_h200_$C.json
mm $M --seq 512 --out $OUT/model_memory_8b_forge_T512_h200_$C.json
