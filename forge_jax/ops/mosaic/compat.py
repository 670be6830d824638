"""What this JAX's Mosaic GPU lowering lacks, supplied through private JAX.

The optimizer rules use ``sqrt`` and ``is_finite``; the warpgroup lowering
of jax 0.10 has neither, that of jax 0.11 has ``sqrt``.
:func:`register_missing_lowerings` lowers them through ops it has, where it
lacks them (a lowering JAX has is kept);
:func:`lowers_concatenate` tells whether it has ``concatenate``.
The kernel calls it before Mosaic GPU lowers its body; importing this module
changes nothing. :func:`interpret_params` reaches Mosaic GPU's interpret
mode, whose parameters JAX does not export. :func:`load_unvectorized`
calls ``plgpu.load`` in the form this JAX takes.
"""

from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu


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


@functools.cache
def register_missing_lowerings():
  """Lowers sqrt and is_finite (which the optimizer rules use) through other
  ops where this JAX's Mosaic GPU warpgroup lowering lacks them. Registers
  once per process; later calls do nothing."""
  # pylint: disable=import-outside-toplevel,protected-access
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu import lowering

  rules = lowering.mosaic_lowering_rules[gpu_core.WGxWG_SEMANTICS]
  rules.setdefault(lax.sqrt_p, lowering._lower_fun(_sqrt_via_rsqrt))
  rules.setdefault(lax.is_finite_p, lowering._lower_fun(_is_finite))


@functools.cache
def lowers_concatenate() -> bool:
  """Whether this JAX's Mosaic GPU warpgroup lowering has ``concatenate``
  (jax 0.11 and later), which unpacking 4-bit codes needs."""
  # pylint: disable=import-outside-toplevel,protected-access
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu import lowering

  rules = lowering.mosaic_lowering_rules[gpu_core.WGxWG_SEMANTICS]
  return lax.concatenate_p in rules


def interpret_params():
  """Mosaic GPU's interpret-mode parameters (``plgpu.kernel(interpret=...)``)."""
  # pylint: disable-next=import-outside-toplevel
  from jax._src.pallas.mosaic_gpu.interpret import params

  return params.InterpretGPUParams()


@functools.cache
def _load_requires_index() -> bool:
  """Whether ``plgpu.load`` requires its index argument (jax 0.10)."""
  index = inspect.signature(plgpu.load).parameters["idx"]
  return index.default is inspect.Parameter.empty


def load_unvectorized(ref):
  """The whole of ``ref`` (a view: ``ref.at[...]``) through ``plgpu.load``
  without its optimized (vectorized) path, which a strided view lacks. jax
  0.10 takes the index as a second argument; later versions deprecate it
  in favour of the view."""
  if _load_requires_index():
    return plgpu.load(ref, (), optimized=False)
  return plgpu.load(ref, optimized=False)
