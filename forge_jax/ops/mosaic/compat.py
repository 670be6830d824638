"""What this JAX's Mosaic GPU lowering lacks, supplied through private JAX.

The optimizer rules use ``sqrt`` and ``is_finite`` and int8 quantization
rounds with ``floor``; the warpgroup lowering of jax 0.10 and 0.11 has none
of the three. :func:`register_missing_lowerings` lowers them through ops it
has, where it lacks them (a lowering JAX has is kept). The kernel calls it
before Mosaic GPU lowers its body; importing this module changes nothing.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax


def _sqrt_via_rsqrt(x, accuracy=None):
  """sqrt for Mosaic GPU's warpgroup lowering, which has rsqrt but not sqrt:
  ``x * rsqrt(x)`` and one Newton step (correctly rounded but for rare last-
  bit ties); 0 stays 0."""
  del accuracy
  inv = lax.rsqrt(x)
  root = x * inv
  root = root + 0.5 * inv * (x - root * root)
  return jnp.where(x == 0, x, root)


def _is_finite(x):
  return jnp.abs(x) < jnp.inf  # NaN compares false


def _floor_via_truncation(x):
  """floor for Mosaic GPU's warpgroup lowering (int8 quantization rounds with
  it): truncate through int32, step down where that rounded up; magnitudes
  from 2**nmant on are integers already (NaN and inf stay), and a zero
  result keeps x's sign (floor(-0.0) is -0.0)."""
  truncated = x.astype(jnp.int32).astype(x.dtype)
  down = jnp.where(truncated > x, truncated - 1, truncated)
  down = jnp.where(down == 0, x * 0, down)
  return jnp.where(jnp.abs(x) < 2.0 ** jnp.finfo(x.dtype).nmant, down, x)


@functools.cache
def register_missing_lowerings():
  """Lowers sqrt, is_finite (which the optimizer rules use) and floor (int8
  quantization) through other ops where this JAX's Mosaic GPU warpgroup
  lowering lacks them. Registers once per process; later calls do
  nothing."""
  # pylint: disable=import-outside-toplevel,protected-access
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu import lowering

  rules = lowering.mosaic_lowering_rules[gpu_core.WGxWG_SEMANTICS]
  rules.setdefault(lax.sqrt_p, lowering._lower_fun(_sqrt_via_rsqrt))
  rules.setdefault(lax.is_finite_p, lowering._lower_fun(_is_finite))
  rules.setdefault(lax.floor_p, lowering._lower_fun(_floor_via_truncation))
