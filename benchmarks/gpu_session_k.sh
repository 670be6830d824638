#!/usr/bin/env bash
# Session 4, second H200 call: two epilogue warpgroups. GPU tests (every
# optimizer with two epilogue warpgroups against the reference; bits across
# configs and calls), then the bf16 diagnosis of both schedules, the inline
# one with its pipeline a stage deeper (race-free buffer release).
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "epilogue-warpgroups and matches_reference_on_gpu or bits_do_not" 2>&1 \
  | grep -v "Warning\|warn\|transpose_ref" | grep -v "^$" | tail -12
timeout 330 python3 benchmarks/kernel_bench.py --suite mosaic-diag \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep "^diag"
