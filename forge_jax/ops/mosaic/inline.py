"""The ``'inline'`` schedule: each compute warpgroup updates its part of a
tile right after the tile's main loop.

The compute warpgroups (``compute_wgs``) share a CTA tile of ``tile_k x
(compute_wgs * tile_n)``, each accumulating its ``tile_k x tile_n`` part of
dW from the same x and dy blocks. Each then walks its part in ``epilogue_k
x epilogue_n`` sub-tiles through its ``epilogue_slots`` buffers: the loads
of the first ``epilogue_slots`` sub-tiles are issued during the main loop,
right after the wgmma of pipeline step ``prefetch_step``, so the epilogue
finds them waiting; later sub-tiles reuse the slots, their loads issued as
soon as a slot's store has read it. The stores are asynchronous and drain
under the next tile's main loop, while the memory warpgroup's ring runs on
into the next tile. ``ctas_per_sm=2`` puts two CTAs on an SM, so one's
epilogue overlaps the other's main loop where both fit.

With ``rolled_epilogue`` a part's sub-tiles are updated in a loop instead
of unrolled: its carry rotates the accumulator's sub-tiles, so the loop
body, one copy of the update's code, always updates the first. int8
states' update, unrolled over two sub-tiles, misses the instruction cache.

This is the default schedule below 2048 tokens (1024 for light updates) or
with few tiles an SM, and for int8 states: 64 x 64 parts, or from 2048
tokens, where the update draws no random bits, 128 x 64 parts with the
rolled update (:func:`forge_jax.ops.mosaic.config.ranked_configs`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forge_jax.ops.mosaic.config import compute_warpgroup_registers
from forge_jax.ops.mosaic.pipeline import Pipeline


def inline_schedule(pipeline: Pipeline):
  """The compute warpgroups share each tile's x and dy blocks, each
  accumulating its part, and update their parts right after the tile's
  main loop while the memory warpgroup's ring runs on into the next
  tile."""
  config, num_tiles, num_steps = (
    pipeline.config,
    pipeline.num_tiles,
    pipeline.num_steps,
  )
  tk, tn, ek, en = pipeline.tk, pipeline.tn, pipeline.ek, pipeline.en
  slots, part_subtiles = pipeline.slots, pipeline.part_subtiles
  skipped_gmem, grad_sq_gmem = pipeline.skipped_gmem, pipeline.grad_sq_gmem
  stages, wgs = config.max_concurrent_steps, config.compute_wgs
  compute_registers = compute_warpgroup_registers(config)
  prefetch_step = min(config.prefetch_step, num_steps - 1)

  subtiles_n = tn // en

  def subtile_origin(index):
    """Sub-tile ``index``'s offset in its part (``index`` may be traced):
    the order of ``part_subtiles``."""
    if isinstance(index, int):
      return part_subtiles[index]
    return index // subtiles_n * ek, index % subtiles_n * en

  def load_subtile(ep, wg, index, k0, n0, after_stores=True):
    """Loads sub-tile ``index`` of the part at ``(k0, n0)`` into one of
    warpgroup ``wg``'s ``slots`` buffers."""
    di, dj = subtile_origin(index)
    ep.issue_loads(wg * slots + index % slots, k0 + di, n0 + dj, after_stores)

  def update_part(ep, wg, k0, n0, acc):
    """Updates the part at ``(k0, n0)`` with its accumulated ``acc``,
    sub-tile by sub-tile through warpgroup ``wg``'s buffers, whose first
    loads were issued under the main loop; each buffer, once released,
    takes the sub-tile ``slots`` on. Returns the per-row skipped counts and
    sums of squared ``dW`` elements."""
    skipped = jnp.zeros((ek,), jnp.float32)
    grad_sq = jnp.zeros((ek,), jnp.float32)
    for index, (di, dj) in enumerate(part_subtiles):
      following = index + slots
      release = (
        functools.partial(
          load_subtile, ep, wg, following, k0, n0, after_stores=False
        )
        if following < len(part_subtiles)
        else None
      )
      sub_skipped, sub_grad_sq = ep.update(
        wg * slots + index % slots,
        k0 + di,
        n0 + dj,
        acc[di : di + ek, dj : dj + en],
        release,
      )
      skipped += sub_skipped
      grad_sq += sub_grad_sq
    return skipped, grad_sq

  def update_part_rolled(ep, wg, k0, n0, acc):
    """:func:`update_part` with one copy of the update's code: a loop over
    the sub-tiles whose carry rotates them, so that the first is always
    the one updated."""
    num = len(part_subtiles)
    subtiles = tuple(
      acc[di : di + ek, dj : dj + en] for di, dj in part_subtiles
    )

    def step(index, carry):
      subtiles, skipped, grad_sq = carry

      def release():
        @pl.when(index + slots < num)
        def _load_following():
          load_subtile(ep, wg, index + slots, k0, n0, after_stores=False)

      di, dj = subtile_origin(index)
      sub_skipped, sub_grad_sq = ep.update(
        wg * slots + index % slots,
        k0 + di,
        n0 + dj,
        subtiles[0],
        release if num > slots else None,
      )
      rotated = subtiles[1:] + subtiles[:1]
      return rotated, skipped + sub_skipped, grad_sq + sub_grad_sq

    zeros = jnp.zeros((ek,), jnp.float32)
    _, skipped, grad_sq = lax.fori_loop(0, num, step, (subtiles, zeros, zeros))
    return skipped, grad_sq

  @functools.partial(
    pl.run_scoped,
    **pipeline.ring_buffers(stages),
    loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
    **pipeline.epilogue_allocations(),
    collective_axes="wg",
  )
  def _scope(x_smem, dy_smem, loaded, consumed, epilogue_smem, load_barriers):
    wg = lax.axis_index("wg")

    @pl.when(wg == wgs)
    def _memory():
      pipeline.stream_tiles(
        x_smem, dy_smem, lambda _, slot: loaded.at[slot], consumed, stages
      )

    @pl.when(wg < wgs)
    def _compute():
      pipeline.take_registers(compute_registers)
      ep = pipeline.epilogue(epilogue_smem, load_barriers)

      # Each warpgroup sums its parts' counts over the CTA's tiles and
      # writes them once: one row per (CTA, warpgroup).
      zeros = jnp.zeros((ek,), jnp.float32)

      @plgpu.nd_loop(
        (num_tiles,), collective_axes="sm", init_carry=(zeros,) * 2
      )
      def _tile_loop(loop_info: plgpu.NDLoopInfo, carry):
        (linear,) = loop_info.index
        k0, cta_n0 = pipeline.tile_origin(linear)
        n0 = cta_n0 + wg * tn

        def prefetch(t):
          # After this step's wgmma: the tensor cores work while the
          # previous tile's stores finish reading the buffers.
          @pl.when(t == prefetch_step)
          def _prefetch():
            for index in range(slots):
              load_subtile(ep, wg, index, k0, n0)

        @functools.partial(
          pl.run_scoped, acc_ref=plgpu.ACC((tk, tn), jnp.float32)
        )
        def _acc_scope(acc_ref):
          acc = pipeline.main_loop(
            acc_ref,
            x_smem,
            dy_smem,
            lambda slot: loaded.at[slot],
            consumed,
            stages,
            loop_info.local_index * num_steps,
            wg,
            prefetch,
          )
          update = update_part_rolled if config.rolled_epilogue else update_part
          return update(ep, wg, k0, n0, acc)

        return tuple(total + part for total, part in zip(carry, _acc_scope))

      skipped, grad_sq = _tile_loop
      row = wgs * lax.axis_index("sm") + wg
      skipped_gmem[row] = skipped
      grad_sq_gmem[row] = grad_sq
