#!/usr/bin/env bash
# Session 8, sixth H200 call: does the kernel's strided access to W, m and v
# cost it bandwidth? At 64 tokens (the kernel nearly all W / m / v traffic)
# the same 58.7 M parameters as 4096 x 14336 (a 64 x 32 sub-tile's rows 28 KB
# apart), 57344 x 1024 (2 KB apart) and 458752 x 128 (256 B apart: each
# 128 x 128 tile contiguous): inline default with the rule, without it, and
# as SGD, beside the GEMM and GEMM + optax (whose update streams linearly).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
for S in "4096 14336" "57344 1024" "458752 128"; do
  set -- $S
  timeout 100 python3 benchmarks/kernel_bench.py --suite mosaic-diag --tokens 64 \
    --diag-shape $1 $2 --diag-configs inline-steps5 --diag-extras \
    --out $OUT/mosaic_diag_T64_${1}x${2}_h200_$C.json 2>&1 | grep "^diag\|Error"
done
