#!/usr/bin/env bash
# Session 5, fourth H200 call: the pingpong schedule ranked first from 2048
# tokens (bf16 storage). The bits-across-configs-and-calls GPU tests (every
# default config of T = 512 and 2048, pingpong among them), the overlap
# probe (64 and 512 tokens: the epilogue's traffic alone, and the tile
# order's effect), then the whole 8B step at T = 2048 with the defaults.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 170 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not" > $OUT/gpu_tests_bits_$C.txt 2>&1
echo "bits tests rc=$?"; tail -3 $OUT/gpu_tests_bits_$C.txt
timeout 130 python3 benchmarks/kernel_bench.py --suite mosaic-overlap \
  --out $OUT/mosaic_overlap_h200_$C.json 2>&1 | grep "^diag"
timeout 150 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 2048 --out $OUT/model_memory_8b_forge_h200_$C.json 2>&1 | tail -1
