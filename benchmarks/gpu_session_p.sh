#!/usr/bin/env bash
# Session 5, third H200 call: the pingpong schedule with a loader warpgroup
# that keeps each compute warpgroup's ring of epilogue buffers full. GPU
# tests of it (every optimizer; stops here if they fail or hang), the bf16
# diagnosis (pingpong configs beside the session-4 default), then the whole
# 8B step at T = 512 with the diagnosis's fastest config there, profiled.
set -u
export PYTHONPATH=$PWD
C=${FORGE_COMMIT}
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "pingpong and matches_reference_on_gpu" > $OUT/gpu_tests_pingpong_$C.txt 2>&1
rc=$?
tail -4 $OUT/gpu_tests_pingpong_$C.txt
[ $rc -eq 0 ] || { echo "GPU tests rc=$rc: stopping"; exit 1; }
D=$OUT/mosaic_diag_h200_$C.json
timeout 250 python3 benchmarks/kernel_bench.py --suite mosaic-diag --out $D 2>&1 | grep "^diag"
best() { python3 -c "import json; print(json.dumps(json.load(open('$D'))['best_diag_config_fields']['$1']))" 2>/dev/null; }
B512=$(best 512)
echo "best at 512: $B512"
[ -n "$B512" ] && timeout 140 python3 benchmarks/model_memory.py --config llama-3.1-8b \
  --variant forge --batch 1 --seq 512 --mosaic-config "$B512" --profile \
  --out $OUT/model_memory_8b_forge_T512_h200_$C.json 2>&1 | tail -1
