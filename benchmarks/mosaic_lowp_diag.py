"""Which part of the Mosaic kernel's low-precision path leaves the reference's
bits on the GPU: stochastic rounding alone, int8 states alone, or both.

  python benchmarks/mosaic_lowp_diag.py --out diag.json

AdamW, 4096 x 1024, 2048 tokens, dW exact (small-integer x and dy), one
step from a fresh state; per leaf the fraction of identical bits against the
XLA reference.
"""

import argparse
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from forge_jax import quantization as Q
from forge_jax.ops import backends, mosaic
from forge_jax.ops.fused_dense import FusedDenseSpec

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import metadata  # pylint: disable=wrong-import-position


def exact_inputs(key, tokens, k, n):
  kx, kdy = jax.random.split(key)
  x = jax.random.randint(kx, (tokens, k), -2, 3).astype(jnp.bfloat16)
  dy = (jax.random.randint(kdy, (tokens, n), -2, 3) / 64).astype(jnp.bfloat16)
  return x, dy


def identical_fractions(opt, k=4096, n=1024, tokens=2048, count=3):
  x, dy = exact_inputs(jax.random.key(0), tokens, k, n)
  w = (0.02 * jax.random.normal(jax.random.key(1), (k, n))).astype(jnp.bfloat16)
  state = opt.init(w)
  scalars = opt.scalars(jnp.int32(count))
  step = jnp.int32(count)
  out = {}
  for name, impl in (
    ("reference", backends.xla_update),
    ("mosaic", mosaic.mosaic_update),
  ):
    spec = FusedDenseSpec(optimizer=opt)
    key = Q.rounding_key(opt.rounding_seed, 9, step)
    fn = jax.jit(functools.partial(impl, spec, rounding_key=key))
    out[name] = jax.device_get(
      fn(
        x,
        dy,
        jnp.copy(w),
        jax.tree.map(jnp.copy, state),
        scalars,
        jnp.bool_(True),
      )
    )
  paths = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(out["reference"][:2])[0]
  ]
  fractions = {}
  for path, a, e in zip(
    paths,
    jax.tree.leaves(out["mosaic"][:2]),
    jax.tree.leaves(out["reference"][:2]),
  ):
    a, e = np.asarray(a), np.asarray(e)
    same = a.view(np.uint8).reshape(a.shape + (-1,)) == e.view(
      np.uint8
    ).reshape(e.shape + (-1,))
    fractions[path] = float(same.all(-1).mean())
  return fractions


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  base = fj.adamw(1e-3, weight_decay=0.1, rounding_seed=5)
  cases = {
    "nearest_bf16_states": dataclasses.replace(base),
    "sr_fp32_states": dataclasses.replace(base, weight_rounding="stochastic"),
    "nearest_int8": dataclasses.replace(base, state_dtype="int8"),
    "sr_int8": dataclasses.replace(
      base, state_dtype="int8", weight_rounding="stochastic"
    ),
  }
  result = {"meta": metadata(), "cases": {}}
  for name, opt in cases.items():
    try:
      result["cases"][name] = identical_fractions(opt)
    except Exception as e:  # pylint: disable=broad-except
      result["cases"][name] = {"error": repr(e)[-400:]}
    print(name, result["cases"][name], flush=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
