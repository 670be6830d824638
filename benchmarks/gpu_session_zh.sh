#!/usr/bin/env bash
# Session 8, first H200 call. (1) The skip count's race: the new GPU test
# (parts with different counts) against the kernel of 360e368, whose
# warpgroups summed their counts in one shared reduction scratch, then
# against this commit's. (2) GPU tests of every optimizer for two epilogue
# warpgroups and the ring (its memory warpgroup refactored in acb1246, not
# run on the GPU since). (3) The diagnosis: inline, pingpong and the three
# two-epilogue-warpgroup configs (the first also rule-free and as SGD).
# (4) The bits across configs and calls at 512 tokens.
# Step (1) needs the old kernel beside the tree, untracked:
#   git show 360e368:forge_jax/ops/mosaic_kernel.py > benchmarks/old_mosaic_kernel_360e368.py
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${FORGE_COMMIT}
if [ -f benchmarks/old_mosaic_kernel_360e368.py ]; then
  rm -rf /tmp/old && mkdir /tmp/old && cp -r forge_jax /tmp/old/
  cp benchmarks/old_mosaic_kernel_360e368.py /tmp/old/forge_jax/ops/mosaic_kernel.py
  PYTHONPATH=/tmp/old timeout 150 python3 - > $OUT/skipcount_360e368.txt 2>&1 <<'PY'
# The old kernel, the new test's inputs: the skipped count of three calls
# per schedule against the reference's.
import functools, jax, jax.numpy as jnp
import forge_jax as fj
from forge_jax.ops import backends, mosaic_kernel as mk
from forge_jax.ops.fused_dense import FusedDenseSpec
opt = fj.adamw(1e-3, weight_decay=0.1)
keys = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(keys[0], (2048, 4096)).astype(jnp.bfloat16)
dy = jax.random.normal(keys[1], (2048, 1024)).astype(jnp.bfloat16)
rows = jnp.asarray([5, 700, 2049, 4000])
cols = jnp.asarray([j for j in range(1024) if j % 7 < j // 64 % 3])
x = x.at[0, rows].set(3e38)
dy = dy.at[0].set(0).at[0, cols].set(4)
configs = {"default": None, "pingpong": mk.PINGPONG_CONFIGS[0],
           "epilogue-warpgroup": mk.MosaicConfig(schedule="epilogue-warpgroup"),
           "ring": mk.MosaicConfig(schedule="ring", max_concurrent_steps=6)}
for name, cfg in configs.items():
  w = (0.5 * jax.random.normal(keys[2], (4096, 1024))).astype(jnp.bfloat16)
  state = jax.tree.map(lambda a: a.astype(jnp.bfloat16), opt.init(w))
  scal, ok = opt.scalars(jnp.int32(3)), jnp.bool_(True)
  ref = backends.xla_update(FusedDenseSpec(optimizer=opt, implementation="xla"),
                            x, dy, w, state, scal, ok)[2]
  fn = jax.jit(functools.partial(mk.mosaic_update,
               FusedDenseSpec(optimizer=opt, implementation="mosaic"), config=cfg))
  got = [int(fn(x, dy, jnp.copy(w), jax.tree.map(jnp.copy, state), scal, ok)[2])
         for _ in range(3)]
  print(f"{name}: reference {int(ref)} expected {len(rows) * len(cols)} kernel {got}",
        flush=True)
PY
  echo "old kernel skip counts rc=$?"; cat $OUT/skipcount_360e368.txt | grep -v Warn | tail -6
fi
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "counts_skipped_elements_on_gpu" > $OUT/gpu_tests_skipcount_$C.txt 2>&1
echo "skip-count tests rc=$?"; tail -3 $OUT/gpu_tests_skipcount_$C.txt
timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "matches_reference_on_gpu and (two-epilogue or ring)" > $OUT/gpu_tests_$C.txt 2>&1
RC=$?; echo "GPU tests rc=$RC"; tail -3 $OUT/gpu_tests_$C.txt
timeout 150 python3 benchmarks/kernel_bench.py --suite mosaic-diag --diag-extras \
  --diag-configs ew2-steps3-slots2 inline-steps5 pingpong-steps4-slots3 \
  ew2-steps4-slots1 ew2-steps4-en16-slots2 \
  --out $OUT/mosaic_diag_h200_$C.json 2>&1 | grep "^diag"
[ $RC = 0 ] || exit 1
timeout 90 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/test_mosaic_kernel.py \
  -k "bits_do_not and 512" > $OUT/gpu_tests_bits_$C.txt 2>&1
echo "bits tests rc=$?"; tail -2 $OUT/gpu_tests_bits_$C.txt
