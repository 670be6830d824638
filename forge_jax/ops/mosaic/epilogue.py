"""The epilogue of the Mosaic GPU kernel: the optimizer update of a tile's
sub-tiles, from shared-memory buffers loaded by TMA, back in place.

The kernel and state sub-tiles go through shared memory by TMA (4-bit
codes as a half-width window: a block's 64 levels in 32 bytes). int8 block
scales do not: an epilogue sub-tile is one quantization block wide
(``epilogue_n`` = 64), so its float32 scales are one column of the ``[K, N
/ 64]`` scale array, 4 bytes a row, below TMA's 16-byte minimum (and a
16-byte box would span other CTAs' blocks). The epilogue's threads read and
write them directly in global memory (a strided non-vectorized load, a
store), as a ``[epilogue_k]`` vector: Mosaic GPU's layout inference finds no
layout for ``[R, 1]`` arrays next to a wgmma-layout tile, so the quantizer
keeps per-block values of one-block tiles 1-D (``quantize(rows_1d=True)``)
and broadcasts them explicitly.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forge_jax import quantization
from forge_jax.ops.mosaic import compat


def is_block_scale(divisor: int) -> bool:
  """Whether a leaf whose columns each stand for ``divisor`` of the
  kernel's holds block scales, which the epilogue reads and writes in
  global memory; every other leaf goes through shared memory by TMA."""
  return divisor == quantization.BLOCK_SIZE


def row_sums(grad, updated):
  """Each row's count of skipped elements (``updated`` false) and sum of
  squared ``grad`` elements (the layer's part of the gradient norm)."""
  return (
    jnp.sum(jnp.where(updated, 0.0, 1.0), axis=1),
    jnp.sum(grad * grad, axis=1),
  )


class Epilogue:
  """The update of ``epilogue_k x epilogue_n`` sub-tiles, shared by the
  schedules: TMA loads of the kernel and state windows into a shared-memory
  buffer, the rule in registers, the new values stored back in place.

  Buffers are indexed by ``buffer``; each has one load barrier per leaf that
  goes through shared memory (int8 block scales do not: their sub-tile's
  column is 4 bytes a row, below TMA's minimum, so they are read and
  written in global memory, as a ``[epilogue_k]`` vector). ``divisors``:
  each leaf's :func:`forge_jax.quantization.column_divisors` (1 for the
  kernel).
  """

  def __init__(
    self,
    *,
    storage_gmem,
    storage_out,
    divisors,
    smem,
    barriers,
    layer,
    rule,
    stochastic,
    shard_origin,
    config,
    interpret,
  ):
    self.storage_gmem, self.storage_out = storage_gmem, storage_out
    self.smem, self.barriers = smem, barriers
    self.is_scale = [is_block_scale(d) for d in divisors]
    tma = [not scale for scale in self.is_scale]
    self.tma_divisors = [d for d, t in zip(divisors, tma) if t]
    self.tma_gmem = [r for r, t in zip(storage_gmem, tma) if t]
    self.tma_out = [r for r, t in zip(storage_out, tma) if t]
    self.layer, self.rule, self.stochastic = layer, rule, stochastic
    self.shard_origin, self.interpret = shard_origin, interpret
    self.ek, self.en = config.epilogue_k, config.epilogue_n

  def _window(self, ref, k0, n0, divisor):
    """The sub-tile at ``(k0, n0)`` of a leaf whose columns each stand for
    ``divisor`` of the kernel's."""
    width = self.en // divisor
    start = n0 // divisor
    if divisor > 1 and not isinstance(start, int):
      # Mosaic GPU's layout inference proves a window's alignment from the
      # index arithmetic, which the division hides.
      start = pl.multiple_of(start, width)
    return ref.at[(*self.layer, pl.ds(k0, self.ek), pl.ds(start, width))]

  def _scale_index(self, k0, n0):
    """The sub-tile's block scales: one column (``epilogue_n`` is a block;
    Mosaic GPU has no layout for an ``[epilogue_k, 1]`` tile)."""
    return (*self.layer, pl.ds(k0, self.ek), n0 // quantization.BLOCK_SIZE)

  def _barrier(self, buffer, leaf):
    return self.barriers.at[buffer * len(self.tma_gmem) + leaf]

  def issue_loads(self, buffer, k0, n0, after_stores=True):
    """Loads the sub-tile at ``(k0, n0)`` into ``buffer``, once this
    thread's TMA stores have read it (``after_stores``; else the caller
    knows they have)."""
    if after_stores:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for leaf, (gmem, smem, divisor) in enumerate(
      zip(self.tma_gmem, self.smem, self.tma_divisors)
    ):
      plgpu.copy_gmem_to_smem(
        self._window(gmem, k0, n0, divisor),
        smem.at[buffer],
        self._barrier(buffer, leaf),
      )

  def _indices(self, k0, n0, shape):
    """Stochastic rounding's global (rows, cols) of the sub-tile at ``(k0,
    n0)`` of ``shape``."""
    if not self.stochastic:
      return None
    row0, col0 = self.shard_origin
    return (
      row0 + k0 + lax.broadcasted_iota(jnp.int32, shape, 0),
      col0 + n0 + lax.broadcasted_iota(jnp.int32, shape, 1),
    )

  def _read_scales(self, gmem, k0, n0):
    if self.interpret:  # the interpreter has no plgpu.load
      return gmem[self._scale_index(k0, n0)]
    # A strided column: no optimized (vectorized) load exists.
    return compat.load_unvectorized(gmem.at[self._scale_index(k0, n0)])

  def apply(self, grad, values, k0, n0):
    """The rule on the sub-tile at ``(k0, n0)``, of ``grad``'s shape: the
    new values, each row's count of skipped (non-finite) elements and each
    row's sum of squared ``grad`` elements (vectors, summed within warps
    only: see :func:`skipped_rows_shape`)."""
    new_values, updated = self.rule(
      grad, values, self._indices(k0, n0, grad.shape)
    )
    return (new_values, *row_sums(grad, updated))

  def update(self, buffer, k0, n0, grad, release=None):
    """Waits for ``buffer``'s loads, applies the rule with ``grad`` and
    stores the new values (asynchronously). ``release()``, if given, runs
    once the TMA stores have read the buffer, which may then be refilled.
    Returns each row's skipped count and sum of squared ``grad`` elements
    (:meth:`apply`)."""
    for leaf in range(len(self.tma_gmem)):
      plgpu.barrier_wait(self._barrier(buffer, leaf))
    smem_values = iter(smem[buffer] for smem in self.smem)
    values = [
      self._read_scales(gmem, k0, n0) if scale else next(smem_values)
      for gmem, scale in zip(self.storage_gmem, self.is_scale)
    ]
    new_values, skipped, grad_sq = self.apply(grad, values, k0, n0)
    if any(self.is_scale):
      # Every thread's reads of the block scales are done before any writes
      # them (the kernel runs without Mosaic GPU's automatic barriers).
      plgpu.commit_smem()
    to_smem = []
    for gmem, value, scale in zip(self.storage_out, new_values, self.is_scale):
      if scale:
        gmem[self._scale_index(k0, n0)] = value
      else:
        to_smem.append(value)
    for smem, value in zip(self.smem, to_smem):
      smem[buffer] = value
    plgpu.commit_smem()
    for gmem, smem, divisor in zip(self.tma_out, self.smem, self.tma_divisors):
      plgpu.copy_smem_to_gmem(
        smem.at[buffer], self._window(gmem, k0, n0, divisor)
      )
    if release is not None:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      release()
    return skipped, grad_sq
