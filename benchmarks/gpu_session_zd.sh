#!/usr/bin/env bash
# Session 7, last H200 call: the whole 8B step with the defaults after the
# barrier change, FORGE and optax side by side at T = 512, FORGE at 2048;
# the inline sub-tile and stage variants at 512 tokens; then the kernel
# table (float32 W and state) for what time is left.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
for V in forge optax; do
  timeout 135 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant $V \
    --batch 1 --seq 512 --out $OUT/model_memory_8b_${V}_T512_h200_$C.json 2>&1 | tail -1
done
timeout 150 python3 benchmarks/model_memory.py --config llama-3.1-8b --variant forge \
  --batch 1 --seq 2048 --out $OUT/model_memory_8b_forge_h200_$C.json 2>&1 | tail -1
timeout 60 python3 benchmarks/kernel_bench.py --suite mosaic-diag --tokens 512 \
  --diag-configs inline-steps5 inline-steps5-en16 inline-steps4 \
  --out $OUT/mosaic_diag_T512_h200_$C.json 2>&1 | grep "^diag"
timeout 110 python3 benchmarks/kernel_bench.py --suite mosaic --mosaic-defaults \
  --time-budget-s 70 --out $OUT/kernel_h200_mosaic_$C.json > $OUT/kernel_table_$C.txt 2>&1
echo "table rc=$?"; grep -c "adamw\|sgd\|lion" $OUT/kernel_table_$C.txt
