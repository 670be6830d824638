"""Where the Mosaic kernel's int8 update spends its time beyond bf16's.

One fused AdamW update (bf16 W, device time, medians, one process) per
variant, each step removing one difference between bf16 and int8 states:

- ``bf16``: bf16 W / m / v on their default config (128 x 64 parts);
- ``bf16 on the int8 tile``: the same on int8's 64 x 64 config (64 x 64
  parts, 64-column sub-tiles, one buffer), i.e. what the tile shape costs;
- ``int8, quantizer passed through``: int8 states read and dequantized,
  the rule applied, but the old codes stored back (``quantization.update``
  replaced; not exact: it measures the bytes, the block scales' accesses,
  the dequantization and the rule);
- ``int8`` and ``int8 + SR``: the real updates on their default config
  (``mosaic.default_config``);
- the rows of ``--configs``: int8 updates on other Mosaic configs (JSON
  fields of ``MosaicConfig``), with ``same_bits`` against the default
  config's first step.

  python benchmarks/lowp_breakdown.py --out benchmarks/results/lowp_breakdown.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import fused_runner, make_inputs  # noqa: E402
from timing import device_time_ms, metadata, run_cases  # noqa: E402

import forge_jax as fj  # noqa: E402
from forge_jax import quantization  # noqa: E402
from forge_jax.ops import mosaic  # noqa: E402

STORAGES = {
  "bf16": {"state_dtype": jnp.bfloat16},
  "int8": {"state_dtype": "int8"},
  "int8-sr": {"state_dtype": "int8", "weight_rounding": "stochastic"},
  "int8-4bit-sr": {
    "state_dtype": "int8",
    "second_moment_bits": 4,
    "weight_rounding": "stochastic",
  },
}
#: int8's 64 x 64 config on the bf16 update: the cost of its tile shape.
INT8_TILE = mosaic.MosaicConfig(
  tile_k=64, max_concurrent_steps=5, epilogue_slots=1, epilogue_n=64
)
#: int8 configs timed beside each storage's default by default: 64 x 64
#: parts, and 128 x 64 parts (bf16's tile) whose two 64 x 64 sub-tiles are
#: updated in a rolled loop, with four stages and a buffer per sub-tile or
#: five stages and one buffer.
CONFIGS = (
  '{"tile_k": 64, "max_concurrent_steps": 5, "epilogue_slots": 1, '
  '"epilogue_n": 64}',
  '{"max_concurrent_steps": 4, "epilogue_slots": 2, "epilogue_n": 64, '
  '"rolled_epilogue": true}',
  '{"max_concurrent_steps": 5, "epilogue_slots": 1, "epilogue_n": 64, '
  '"rolled_epilogue": true}',
)


def _passthrough_update(new, old, ok, valid=None, level_bits=None):
  """``quantization.update`` without the quantizer: int8 leaves keep their
  codes, their scales touched by a row sum of ``new`` (so that nothing of
  the rule is dead code and Mosaic GPU infers the scales' layout)."""
  del valid, level_bits
  if not quantization.is_quantized(old):
    return jnp.where(ok, new, old.astype(jnp.float32)).astype(old.dtype)
  scale = old.scale + 0.0 * jnp.sum(new, axis=1)
  return type(old)(codes=old.codes, scale=scale)


@contextlib.contextmanager
def quantizer_passed_through():
  """While active, int8 states are stored back unchanged (traced inside)."""
  original = quantization.update
  quantization.update = _passthrough_update
  try:
    yield
  finally:
    quantization.update = original


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
  parser.add_argument(
    "--shapes", nargs="+", default=["4096x14336", "14336x4096", "4096x4096"]
  )
  parser.add_argument(
    "--storages", nargs="+", default=["int8", "int8-sr"], choices=STORAGES
  )
  parser.add_argument(
    "--configs",
    nargs="*",
    default=list(CONFIGS),
    help="JSON MosaicConfig fields: each an '<storage> <json>' row",
  )
  parser.add_argument("--time-budget-s", type=float, default=0)
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def _optimizer(storage):
  return fj.adamw(1e-3, weight_decay=0.1, **STORAGES[storage])


def _time(optimizer, config, w, x, dy, context=contextlib.nullcontext):
  """(device ms, first step's kernel as float32) of one config."""
  with context():  # traced (and compiled) at the first call
    config = config or mosaic.default_config(x, w, optimizer)
    run = fused_runner(optimizer, config, w, x, dy)
    first = np.asarray(run().astype(jnp.float32))
    return device_time_ms(run, calls=10, repeats=3)["ms"], first


def measure(args, tokens, shape) -> dict:
  k, n = (int(d) for d in shape.split("x"))
  x, dy, w = make_inputs(jax.random.key(tokens), tokens, k, n)
  w = w.astype(jnp.bfloat16)
  case = {"tokens": tokens, "k": k, "n": n, "ms": {}, "same_bits": {}}

  def record(name, *timed_args, **timed_kwargs):
    try:
      case["ms"][name], first = _time(*timed_args, **timed_kwargs)
      return first
    except Exception as e:  # a config that cannot run the case
      case.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
      return None

  bf16 = _optimizer("bf16")
  record("bf16", bf16, None, w, x, dy)
  record("bf16 on the int8 tile", bf16, INT8_TILE, w, x, dy)
  record(
    "int8, quantizer passed through",
    _optimizer("int8"),
    None,
    w,
    x,
    dy,
    context=quantizer_passed_through,
  )
  for storage in args.storages:
    default = record(storage, _optimizer(storage), None, w, x, dy)
    for fields in args.configs:
      name = f"{storage} {fields}"
      config = mosaic.MosaicConfig(**json.loads(fields))
      first = record(name, _optimizer(storage), config, w, x, dy)
      if first is not None and default is not None:
        case["same_bits"][name] = bool(np.array_equal(first, default))
  return case


def main(argv=None):
  args = _args(argv)
  run_cases(
    {"meta": metadata(), "config": vars(args), "cases": []},
    itertools.product(args.tokens, args.shapes),
    functools.partial(measure, args),
    args.out,
    args.time_budget_s,
  )


if __name__ == "__main__":
  main()
