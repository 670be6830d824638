#!/usr/bin/env bash
# Session 4, last H200 call: the new default configs (five-stage pipeline).
# GPU tests of the Mosaic kernel (every optimizer; int8 + SR; bits across
# configs and calls), then the side-by-side kernel table (XLA GEMM, GEMM +
# optax, Triton, Mosaic with its default config per shape).
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 130 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "default and matches_reference_on_gpu or bits_do_not or int8_sr" 2>&1 \
  | grep -v "transpose_ref\|^  \|^$" | tail -8
timeout 290 python3 benchmarks/kernel_bench.py --suite mosaic --mosaic-defaults \
  --time-budget-s 240 --out $OUT/kernel_h200_mosaic_$C.json 2>&1 \
  | grep -v "^WARNING\|Deprecat\|mosaic check" | tail -40
