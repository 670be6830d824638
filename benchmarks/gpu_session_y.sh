#!/usr/bin/env bash
# Session 6, last H200 call: the whole 8B step at T = 512 with the defaults
# (inline, main loop carrying its slot), then the bits-across-configs-and-
# calls GPU tests for as long as the call allows.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 135 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 512 --out $OUT/model_memory_8b_forge_T512_h200_$C.json 2>&1 | tail -1
timeout 110 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not" > $OUT/gpu_tests_bits_$C.txt 2>&1
echo "bits tests rc=$?"; tail -2 $OUT/gpu_tests_bits_$C.txt
