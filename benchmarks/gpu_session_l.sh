#!/usr/bin/env bash
# Session 4, third H200 call: the inline epilogue with race-free buffer
# release (one or two pipeline stages deeper) against the epilogue warpgroup.
# GPU tests of the default config (every optimizer) and of the bits across
# configs and calls; the bf16 diagnosis; then the whole 8B step at T = 512
# and 2048, each with the diagnosis's fastest config at its token count.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 90 python3 -m pytest -q -x -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "default and matches_reference_on_gpu or bits_do_not" 2>&1 \
  | grep -v "Warning\|warn\|transpose_ref" | grep -v "^$" | tail -6
D=$OUT/mosaic_diag_h200_$C.json
timeout 200 python3 benchmarks/kernel_bench.py --suite mosaic-diag --out $D 2>&1 | grep "^diag"
best() { python3 -c "import json; print(json.dumps(json.load(open('$D'))['best_diag_config_fields']['$1']))" 2>/dev/null; }
mm() { timeout 130 python3 benchmarks/model_memory.py "$@" 2>&1 | tail -1; }
M="--config llama-3.1-8b --variant forge --batch 1"
B512=$(best 512); B2048=$(best 2048)
[ -n "$B512" ] && mm $M --seq 512 --mosaic-config "$B512" --out $OUT/model_memory_8b_forge_T512_h200_$C.json
[ -n "$B2048" ] && mm $M --seq 2048 --mosaic-config "$B2048" --out $OUT/model_memory_8b_forge_h200_$C.json
