"""Speed of low-precision storage: one fused update per storage and backend.

Where the time of int8 states and stochastic rounding goes, one kernel call
at a time (device time, medians, side by side in one process): bf16 W and
AdamW states rounded to nearest, bf16 with stochastic rounding, int8 states,
int8 states with stochastic rounding, and with 4-bit second moments, each
through the Mosaic and Triton kernels and the XLA reference, beside XLA's
GEMM + optax's update of bf16 storage. Llama-3.1-8B shapes;
``ratio_to_bf16`` is each time over the same backend's bf16 time.

  python benchmarks/lowp_speed.py --out benchmarks/results/lowp_speed.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import (  # noqa: E402
  fused_runner,
  make_inputs,
  reference_step,
  unfused_runner,
)
from timing import device_time_ms, run_grid  # noqa: E402

import forge_jax as fj  # noqa: E402
from forge_jax.ops import mosaic  # noqa: E402

STORAGES = {
  "bf16": {},
  "bf16-sr": {"weight_rounding": "stochastic"},
  "int8": {"state_dtype": jnp.int8},
  "int8-sr": {"state_dtype": jnp.int8, "weight_rounding": "stochastic"},
  "int8-4bit-sr": {
    "state_dtype": jnp.int8,
    "second_moment_bits": 4,
    "weight_rounding": "stochastic",
  },
}


def storage_optimizer(storage):
  """AdamW (lr 1e-3, weight decay 0.1) with bf16 states and the options of
  ``STORAGES[storage]``."""
  return fj.adamw(
    1e-3,
    weight_decay=0.1,
    **{"state_dtype": jnp.bfloat16, **STORAGES[storage]},
  )


def reference_runner(optimizer, w, x, dy):
  step = reference_step(optimizer)
  state = optimizer.init(w)
  count = jnp.asarray(0, jnp.int32)
  return lambda: step(w, state, count, x, dy)[0]


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
  parser.add_argument(
    "--shapes", nargs="+", default=["4096x4096", "4096x14336", "14336x4096"]
  )
  parser.add_argument("--storages", nargs="+", default=list(STORAGES))
  parser.add_argument(
    "--backends", nargs="+", default=["mosaic", "triton", "xla"]
  )
  parser.add_argument(
    "--mosaic-configs",
    nargs="*",
    default=[],
    help="JSON MosaicConfig fields; each a 'mosaic[<json>]/<storage>' row",
  )
  parser.add_argument("--time-budget-s", type=float, default=0)
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def measure(args, tokens, shape) -> dict:
  """One case's record: GEMM + optax, then each storage through each
  backend and each of ``args.mosaic_configs`` (or the error it raised),
  and each time over the same backend's bf16 time."""
  k, n = (int(d) for d in shape.split("x"))
  x, dy, w = make_inputs(jax.random.key(tokens), tokens, k, n)
  w = w.astype(jnp.bfloat16)
  case = {"tokens": tokens, "k": k, "n": n, "ms": {}}
  base = storage_optimizer("bf16")
  case["ms"]["gemm+optax"] = device_time_ms(
    unfused_runner(base, w, x, dy), calls=10, repeats=3
  )["ms"]
  for storage in args.storages:
    optimizer = storage_optimizer(storage)
    for backend in args.backends:
      name = f"{backend}/{storage}"
      try:
        if backend == "xla":
          run = reference_runner(optimizer, w, x, dy)
        else:
          config = (
            mosaic.default_config(x, w, optimizer)
            if backend == "mosaic"
            else None
          )
          run = fused_runner(optimizer, config, w, x, dy)
        case["ms"][name] = device_time_ms(run, calls=10, repeats=3)["ms"]
      except Exception as e:  # a backend that cannot run the case
        case.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
    reference = None  # the XLA reference's first step, made once
    for fields in args.mosaic_configs:
      name = f"mosaic[{fields}]/{storage}"
      try:
        config = mosaic.MosaicConfig(**json.loads(fields))
        run = fused_runner(optimizer, config, w, x, dy)
        # The first step, from the fresh state (a copy: the next call
        # donates the kernel it returns).
        fused = run().astype(jnp.float32)
        if reference is None:
          reference = reference_runner(optimizer, w, x, dy)().astype(
            jnp.float32
          )
        case.setdefault("max_abs_diff_to_xla", {})[name] = float(
          jnp.max(jnp.abs(fused - reference))
        )
        case["ms"][name] = device_time_ms(run, calls=10, repeats=3)["ms"]
      except Exception as e:  # a config that cannot run the case
        case.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
  case["ratio_to_bf16"] = {
    name: ms / case["ms"][name.split("/")[0] + "/bf16"]
    for name, ms in case["ms"].items()
    if "/" in name and name.split("/")[0] + "/bf16" in case["ms"]
  }
  return case


def main(argv=None):
  args = _args(argv)
  run_grid(args, ("tokens", "shapes"), functools.partial(measure, args))


if __name__ == "__main__":
  main()
