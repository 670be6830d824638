#!/usr/bin/env bash
# Session 5, sixth H200 call: the bits-across-configs-and-calls GPU tests
# alone (the fifth call's time limit cut them): every default config of
# T = 512 and 2048 (inline on the hand-written pipeline, pingpong) and the
# other schedules give the same bits, call after call.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 230 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not" > $OUT/gpu_tests_bits_$C.txt 2>&1
echo "bits tests rc=$?"; tail -3 $OUT/gpu_tests_bits_$C.txt
