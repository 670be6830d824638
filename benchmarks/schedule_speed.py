"""The Mosaic kernel's two schedules side by side: where the default ranks each.

For each optimizer, storage, token count and Llama-3.1-8B shape, one fused
update through the first inline config that fits and through the first
pingpong config (device time, medians, one process), and the schedule the
default config (``mosaic.default_config``) takes for that call. Both
schedules accumulate each tile in the same order, so the kernels their
first steps from the same state write must agree bit for bit: ``same_bits``
records it.

  python benchmarks/schedule_speed.py --out benchmarks/results/schedule_speed.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import fused_runner, make_inputs  # noqa: E402
from timing import device_time_ms, run_grid  # noqa: E402

import forge_jax as fj  # noqa: E402
from forge_jax.ops import mosaic  # noqa: E402

OPTIMIZERS = {
  "adamw": lambda **kw: fj.adamw(1e-3, weight_decay=0.1, **kw),
  "nadam": lambda **kw: fj.nadam(1e-3, **kw),
  "radam": lambda **kw: fj.radam(1e-3, **kw),
  "lion": lambda **kw: fj.lion(1e-4, **kw),
  "sgd_momentum": lambda **kw: fj.sgd(1e-2, momentum=0.9, **kw),
  "sgd": lambda **kw: fj.sgd(1e-2, **kw),
  "rmsprop": lambda **kw: fj.rmsprop(1e-3, **kw),
  "adagrad": lambda **kw: fj.adagrad(1e-2, **kw),
}
#: Each storage's kernel dtype and the optimizer's storage fields.
STORAGES = {
  "bf16": (jnp.bfloat16, {"state_dtype": jnp.bfloat16}),
  "bf16-sr": (
    jnp.bfloat16,
    {"state_dtype": jnp.bfloat16, "weight_rounding": "stochastic"},
  ),
  "fp32": (jnp.float32, {"state_dtype": jnp.float32}),
}


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--tokens", type=int, nargs="+", default=[512, 1024, 2048, 8192]
  )
  parser.add_argument(
    "--shapes", nargs="+", default=["4096x14336", "14336x4096", "4096x1024"]
  )
  parser.add_argument(
    "--optimizers",
    nargs="+",
    default=["adamw", "lion", "sgd_momentum", "sgd"],
    choices=OPTIMIZERS,
  )
  parser.add_argument(
    "--storages", nargs="+", default=["bf16"], choices=STORAGES
  )
  parser.add_argument("--time-budget-s", type=float, default=0)
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def _first_fitting(configs, x, w, optimizer):
  """The first of ``configs`` the kernel can run for this call, or None."""
  dy = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
  for config in configs:
    if mosaic.unsupported_reason(x, dy, w, optimizer, config) is None:
      return config
  return None


def run_case(optimizer, tokens, k, n, dtype) -> dict:
  """Both schedules' times for one call, and whether their steps agree."""
  x, dy, w = make_inputs(jax.random.key(tokens + k + n), tokens, k, n)
  w = w.astype(dtype)
  configs = {
    "inline": _first_fitting(mosaic.INLINE_CONFIGS, x, w, optimizer),
    "pingpong": _first_fitting(mosaic.PINGPONG_CONFIGS[:1], x, w, optimizer),
  }
  case = {
    "default": mosaic.default_config(x, w, optimizer).schedule,
    "configs": {
      name: dataclasses.asdict(c) if c else None for name, c in configs.items()
    },
    "ms": {},
  }
  firsts = {}
  for name, config in configs.items():
    if config is None:
      continue
    run = fused_runner(optimizer, config, w, x, dy)
    firsts[name] = jnp.copy(run())
    case["ms"][name] = device_time_ms(run, calls=10, repeats=3)["ms"]
  if len(firsts) == 2:
    case["same_bits"] = bool(
      jnp.array_equal(firsts["inline"], firsts["pingpong"])
    )
    case["pingpong_over_inline"] = case["ms"]["pingpong"] / case["ms"]["inline"]
  return case


def measure(storage, opt_name, tokens, shape) -> dict:
  """One case's record: :func:`run_case`, or the error it raised."""
  k, n = (int(d) for d in shape.split("x"))
  case = {
    "optimizer": opt_name,
    "storage": storage,
    "tokens": tokens,
    "k": k,
    "n": n,
  }
  dtype, fields = STORAGES[storage]
  optimizer = OPTIMIZERS[opt_name](**fields)
  try:
    case.update(run_case(optimizer, tokens, k, n, dtype))
  except Exception as e:  # a case the kernel cannot run
    case["error"] = f"{type(e).__name__}: {e}"[:300]
  return case


def main(argv=None):
  args = _args(argv)
  run_grid(args, ("storages", "optimizers", "tokens", "shapes"), measure)


if __name__ == "__main__":
  main()
