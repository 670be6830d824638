#!/usr/bin/env bash
# Session 4, first H200 call: the epilogue warpgroup. GPU tests of the Mosaic
# kernel (every optimizer with both schedules against the reference; bits
# across configs and calls), then where the time goes with bf16 storage for
# both schedules (kernel_bench --suite mosaic-diag).
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "matches_reference_on_gpu and not int8 or bits_do_not" 2>&1 \
  | grep -v "Warning\|warn" | tail -12
timeout 300 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep -v "^WARNING\|Deprecat" | tail -45
