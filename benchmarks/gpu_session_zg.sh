#!/usr/bin/env bash
# Session 7, last H200 call: the bits across configs and calls at 2048
# tokens (every default and the other schedules, ring among them), which
# the sixth session's calls ran out of time for.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
timeout 230 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not and 2048" > $OUT/gpu_tests_bits_2048_$C.txt 2>&1
echo "bits tests rc=$?"; tail -3 $OUT/gpu_tests_bits_2048_$C.txt
