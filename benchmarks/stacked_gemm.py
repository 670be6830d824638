"""The in-place GEMM of a stacked layer against XLA's, inside a layer scan.

A scan over ``--layers`` layers of a ``[L, K, N]`` bf16 stack computes, per
layer, the forward product ``x @ W[l]`` (``[T, K] -> [T, N]``) or the input
gradient's ``dy @ W[l].T`` (``[T, N] -> [T, K]``). Variants, side by side
in one process (device time per layer, medians):

* ``xla_scan``: XLA's ``dynamic_slice`` + dot, i.e. a copy of the layer's
  kernel out of the stack, then the GEMM;
* ``xla_gemm``: XLA's GEMM of one unstacked kernel, no scan (the bound the
  in-place GEMM chases);
* ``in_place``: :func:`forge_jax.ops.mosaic.matmul.stacked_matmul` with its
  default tiles, reading ``W[l]`` where it lies;
* ``in_place_gemm``: the same scan's GEMM kernel alone (its device time by
  kernel name). Both scans also copy each layer's output into the scan's
  stacked result (about 40 µs a layer at 2048 x 14336): ``in_place`` and
  ``xla_scan`` include that copy, this excludes it, so it is the figure to
  hold against ``xla_gemm``.

  python benchmarks/stacked_gemm.py --tokens 512 2048 --out FILE
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import (  # noqa: E402
  device_time_ms,
  kernel_profile,
  run_grid,
)

from forge_jax.ops.mosaic import matmul  # noqa: E402

SHAPES = ("4096x4096", "4096x1024", "4096x14336", "14336x4096")


def _product(transpose):
  return lambda a, w: a @ w.T if transpose else a @ w


def _per_layer(fn, layers, *args):
  """Device ms per layer of ``fn`` (one call runs ``layers`` layers)."""
  return device_time_ms(lambda: fn(*args), calls=5, repeats=3)["ms"] / layers


def _kernel_per_layer(fn, layers, name, *args):
  """Device ms per layer of the kernels of ``fn`` whose names contain
  ``name``."""
  profile = kernel_profile(lambda: fn(*args), calls=5)
  return sum(k["ms"] for k in profile["top"] if name in k["name"]) / layers


def case(tokens, k, n, kind, layers):
  transpose = kind == "dx"
  keys = jax.random.split(jax.random.key(tokens + k + n), 2)
  a = jax.random.normal(keys[0], (tokens, n if transpose else k), jnp.bfloat16)
  stack = jax.random.normal(keys[1], (layers, k, n), jnp.bfloat16)
  product = _product(transpose)
  in_place = functools.partial(matmul.stacked_matmul, transpose_rhs=transpose)

  def scan(layer_product):
    return jax.jit(
      lambda a, stack: lax.scan(
        lambda c, i: (c, layer_product(a, stack, i)),
        None,
        jnp.arange(layers, dtype=jnp.int32),
      )[1]
    )

  xla_scan = scan(lambda a, s, i: product(a, s[i]))
  ours = scan(in_place)
  expected, actual = xla_scan(a, stack), ours(a, stack)
  config = matmul.default_config(tokens, k if transpose else n)
  return {
    "tokens": tokens,
    "k": k,
    "n": n,
    "kind": kind,
    "config": dataclasses.asdict(config),
    "max_rel_err": float(
      jnp.max(jnp.abs(actual.astype(jnp.float32) - expected))
      / jnp.max(jnp.abs(expected.astype(jnp.float32)))
    ),
    "ms": {
      "xla_scan": _per_layer(xla_scan, layers, a, stack),
      "xla_gemm": _per_layer(jax.jit(product), 1, a, stack[0]),
      "in_place": _per_layer(ours, layers, a, stack),
      "in_place_gemm": _kernel_per_layer(
        ours, layers, matmul.KERNEL_NAME, a, stack
      ),
    },
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument("--kinds", nargs="+", default=["fwd", "dx"])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)

  def measure(tokens, shape, kind):
    k, n = (int(d) for d in shape.split("x"))
    return case(tokens, k, n, kind, args.layers)

  run_grid(args, ("tokens", "shapes", "kinds"), measure)


if __name__ == "__main__":
  main()
