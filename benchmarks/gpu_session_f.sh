#!/usr/bin/env bash
# Session 3, third H200 call: where the Mosaic kernel's time goes with bf16
# storage (epilogue configs; without the rule's arithmetic; SGD), then the
# whole 8B step at T = 512 with the session-2-like schedule and with the
# diagnosis's fastest config at T = 512, each in a fresh process.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
D=$OUT/mosaic_diag_h200_$C.json
timeout 240 python3 benchmarks/kernel_bench.py --suite mosaic-diag --out $D 2>&1 \
  | grep -v "^WARNING\|Deprecat" | tail -40
mm() { timeout 150 python3 benchmarks/model_memory.py "$@" 2>&1 | tail -1; }
OLD='{"epilogue_slots": 2, "prefetch_step": 0}'
BEST=$(python3 -c "import json; print(json.dumps(json.load(open('$D'))['best_diag_config_fields']['512']))" 2>/dev/null)
mm --config llama-3.1-8b --variant forge --batch 1 --seq 512 --mosaic-config "$OLD" \
   --out $OUT/model_memory_8b_forge_T512_slots2pf0_h200_$C.json
if [ -n "$BEST" ]; then
  mm --config llama-3.1-8b --variant forge --batch 1 --seq 512 --mosaic-config "$BEST" \
     --out $OUT/model_memory_8b_forge_T512_best_h200_$C.json
fi
