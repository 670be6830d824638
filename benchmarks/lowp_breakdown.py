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
  config's first step;
- ``<storage>, m and v as e4m3`` and ``<storage>, v as e4m3``: the int8
  leaves (both moments, or the second only) encoded as float8 e4m3 codes
  of blocks of 64 scaled by a power of two instead (:func:`e4m3_codes`;
  timing only, not a format of the package): a quantizer without
  division, square root, scale search or threshold correction; ``<storage>,
  m and v as e4m3, scales kept``: those codes written at the blocks' old
  scales, no block maximum taken (not an encoding: what the block
  reduction costs). These rows and the int8 rows carry
  ``state_matches_reference``: the share of state elements bit for bit
  equal to the XLA reference's after two steps, the reference under the
  same encoding.

  python benchmarks/lowp_breakdown.py --out benchmarks/results/lowp_breakdown.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import (  # noqa: E402
  fused_runner,
  fused_step,
  make_inputs,
  reference_step,
)
from lowp_speed import STORAGES, storage_optimizer  # noqa: E402
from timing import device_time_ms, run_grid  # noqa: E402

from forge_jax import quantization  # noqa: E402
from forge_jax.ops import mosaic  # noqa: E402

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


def quantizer_passed_through():
  """A context in which int8 states are stored back unchanged (traced
  inside)."""
  return mock.patch.object(quantization, "update", _passthrough_update)


#: Columns of a quantization block.
BLOCK = quantization.BLOCK_SIZE
#: e4m3's largest value, 1.75 * 2**8: a block's scale is ``2**(e - 8)`` for
#: an absmax of exponent ``e``, twice that where its mantissa exceeds 1.75.
_E4M3_MANTISSA_175 = np.uint32(0x600000)


def _power_of_two_scale(amax):
  """``(s, 1 / s)``: the smallest power of two with ``448 s >= amax``
  (``amax`` normal and finite), from its bits, so every backend gets them."""
  bits = lax.bitcast_convert_type(amax, jnp.uint32)
  up = (bits & np.uint32(0x7FFFFF)) > _E4M3_MANTISSA_175
  exponent = (bits >> 23) - np.uint32(8) + up.astype(jnp.uint32)
  scale = lax.bitcast_convert_type(exponent << 23, jnp.float32)
  inverse = lax.bitcast_convert_type(
    (np.uint32(254) - exponent) << 23, jnp.float32
  )
  return scale, inverse


def _power_of_two_inverse(scale):
  """``1 / scale`` of power-of-two scales, from their bits; 0 where a scale
  is 0 or NaN."""
  exponent = lax.bitcast_convert_type(scale, jnp.uint32) >> 23
  inverse = lax.bitcast_convert_type(
    (np.uint32(254) - exponent) << 23, jnp.float32
  )
  return jnp.where(scale > 0, inverse, 0.0)


def _block_max(x, rows_1d):
  """``[R, C] -> [R, C / 64]`` block maxima (``[R]`` for a kernel tile's one
  block a row)."""
  if rows_1d:
    return jnp.max(x, axis=1)
  rows, cols = x.shape
  return jnp.max(x.reshape(rows, cols // BLOCK, BLOCK), axis=2)


def _per_element(per_block, cols):
  """Inverse shape of :func:`_block_max`: each block's value on its
  elements."""
  if per_block.ndim == 1:
    return lax.broadcast_in_dim(per_block, (per_block.shape[0], cols), (0,))
  rows, blocks = per_block.shape
  repeated = lax.broadcast_in_dim(per_block, (rows, blocks, BLOCK), (0, 1))
  return repeated.reshape(rows, cols)


def _e4m3_quantize(x, rows_1d):
  """int8 codes (e4m3 bytes) and float32 power-of-two scales of float32
  ``x``: zero codes in all-but-zero blocks, a NaN scale in non-finite
  ones, as the int8 encodings store them."""
  finite = jnp.isfinite(x)
  amax = _block_max(jnp.where(finite, jnp.abs(x), jnp.inf), rows_1d)
  keep = (amax >= quantization.TINY) & (amax < jnp.inf)
  scale, inverse = _power_of_two_scale(jnp.where(keep, amax, 1.0))
  inverse = _per_element(jnp.where(keep, inverse, 0.0), x.shape[1])
  scaled = jnp.where(finite, x, 0.0) * inverse
  codes = lax.bitcast_convert_type(scaled.astype(jnp.float8_e4m3fn), jnp.int8)
  scale = jnp.where(keep, scale, 0.0)
  return codes, jnp.where(amax == jnp.inf, jnp.float32(jnp.nan), scale)


def _e4m3_dequantize(codes, scale):
  values = lax.bitcast_convert_type(
    quantization.int8_codes(codes), jnp.float8_e4m3fn
  )
  return values.astype(jnp.float32) * _per_element(scale, codes.shape[1])


def _code_bits(leaf):
  return 4 if isinstance(leaf, quantization.QuantizedSqrt4Blocks) else 8


def e4m3_codes(second_moment_only=False, keep_scales=False):
  """A context in which int8 state leaves (second moments only, if asked) are
  float8 e4m3 codes with power-of-two block scales: the same bytes, the
  values themselves (not ``sqrt(v)``), read with a multiply and written
  with a conversion that Hopper does two values an instruction. Blocks
  that no element of a step touches keep their codes, as in
  ``quantization.update``. Traced inside; initial (all-zero) states are
  the same bytes in both encodings.

  ``keep_scales``: codes written at the blocks' old scales, no block
  maximum taken (timing only: a block's scale never grows from zero, so
  this is not an encoding): what the block reduction costs."""
  update, dequantize = quantization.update, quantization.dequantize

  def encoded(sqrt, bits=8):
    return bits == 8 and (sqrt or not second_moment_only)

  def patched_dequantize(codes, scale, *, sqrt=False, bits=8, **kwargs):
    if encoded(sqrt, bits):
      return _e4m3_dequantize(codes, scale)
    return dequantize(codes, scale, sqrt=sqrt, bits=bits, **kwargs)

  def patched_update(new, old, ok, valid=None, level_bits=None):
    sqrt = isinstance(old, quantization.SQRT_TYPES)
    if not (quantization.is_quantized(old) and encoded(sqrt, _code_bits(old))):
      return update(new, old, ok, valid, level_bits)
    if new.shape[1] % BLOCK:
      raise ValueError(f"e4m3 codes take whole blocks, not {new.shape}")
    rows_1d = old.scale.ndim == 1
    values = jnp.where(ok, new, _e4m3_dequantize(old.codes, old.scale))
    if valid is not None:
      values = jnp.where(valid, values, 0.0)
    if keep_scales:
      scale = old.scale
      inverse = _per_element(_power_of_two_inverse(scale), values.shape[1])
      codes = lax.bitcast_convert_type(
        (values * inverse).astype(jnp.float8_e4m3fn), jnp.int8
      )
    else:
      codes, scale = _e4m3_quantize(values, rows_1d)
    touched = ok if valid is None else ok & valid
    touched = jnp.broadcast_to(touched, values.shape).astype(jnp.float32)
    changed = _block_max(touched, rows_1d) > 0.0
    codes = jnp.where(
      _per_element(changed, codes.shape[1]),
      codes.astype(jnp.int32),
      quantization.int8_codes(old.codes).astype(jnp.int32),
    ).astype(jnp.int8)
    if old.codes.dtype != jnp.int8:
      codes = quantization.container_codes(codes)
    return type(old)(codes=codes, scale=jnp.where(changed, scale, old.scale))

  return mock.patch.multiple(
    quantization, update=patched_update, dequantize=patched_dequantize
  )


#: The e4m3 probe's variants, by the names their rows take.
E4M3, E4M3_V_ONLY = "m and v as e4m3", "v as e4m3"
E4M3_SCALES_KEPT = "m and v as e4m3, scales kept"
E4M3_VARIANTS = {
  E4M3: functools.partial(e4m3_codes, False),
  E4M3_V_ONLY: functools.partial(e4m3_codes, True),
  E4M3_SCALES_KEPT: functools.partial(e4m3_codes, False, keep_scales=True),
}


def state_matches_reference(optimizer, config, w, x, dy, context):
  """The share of state elements (codes and scales) bit for bit equal to
  the XLA reference's after two steps from the initial state (the lowest
  over the leaves)."""
  with context():
    config = config or mosaic.default_config(x, w, optimizer)
    fused, reference = fused_step(optimizer, config), reference_step(optimizer)
    count = jnp.asarray(0, jnp.int32)
    ours, theirs = (jnp.copy(w), optimizer.init(w)), (w, optimizer.init(w))
    for step in range(2):
      ours = fused(*ours[:2], count + step, x, dy)
      theirs = reference(*theirs[:2], count + step, x, dy)
  shares = []
  for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(theirs[1])):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.itemsize == 1:
      a, b = a.view(np.int8), b.view(np.int8)
    shares.append(float(np.mean((a == b) | (np.isnan(a) & np.isnan(b)))))
  return min(shares)


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

  bf16 = storage_optimizer("bf16")
  record("bf16", bf16, None, w, x, dy)
  record("bf16 on the int8 tile", bf16, INT8_TILE, w, x, dy)
  record(
    "int8, quantizer passed through",
    storage_optimizer("int8"),
    None,
    w,
    x,
    dy,
    context=quantizer_passed_through,
  )
  for storage in args.storages:
    default = record(storage, storage_optimizer(storage), None, w, x, dy)
    contexts = {storage: contextlib.nullcontext}
    for variant, context in E4M3_VARIANTS.items():
      name = f"{storage}, {variant}"
      contexts[name] = context
      record(name, storage_optimizer(storage), None, w, x, dy, context=context)
    for name, context in contexts.items():
      case.setdefault("state_matches_reference", {})[name] = (
        state_matches_reference(
          storage_optimizer(storage), None, w, x, dy, context
        )
      )
    for fields in args.configs:
      name = f"{storage} {fields}"
      config = mosaic.MosaicConfig(**json.loads(fields))
      first = record(name, storage_optimizer(storage), config, w, x, dy)
      if first is not None and default is not None:
        case["same_bits"][name] = bool(np.array_equal(first, default))
  return case


def main(argv=None):
  args = _args(argv)
  run_grid(args, ("tokens", "shapes"), functools.partial(measure, args))


if __name__ == "__main__":
  main()
