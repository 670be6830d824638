#!/usr/bin/env bash
# Session 3, second H200 call: the Mosaic suite (sweep of the prefetch
# configs, per-optimizer checks, the side-by-side table).
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
python3 benchmarks/kernel_bench.py --suite mosaic --time-budget-s 420 \
  --out $OUT/kernel_h200_mosaic_$C.json 2>&1 | grep -v "^WARNING\|Deprecat" | tail -40
