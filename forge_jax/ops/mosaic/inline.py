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

With ``stash_accumulator`` each compute warpgroup stores its accumulator
in shared memory after the main loop and updates the sub-tiles in a rolled
loop (:class:`~forge_jax.ops.mosaic.config.MosaicConfig`).

This is the default schedule below 2048 tokens or with few tiles an SM,
and for int8 states
(:func:`forge_jax.ops.mosaic.config.ranked_configs`).
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

  subtile_cols = tn // en

  def subtile_origin(index):
    """Sub-tile ``index``'s offset in its part (``index`` may be traced)."""
    if isinstance(index, int):
      return part_subtiles[index]
    return index // subtile_cols * ek, lax.rem(index, subtile_cols) * en

  def buffer_of(wg, index):
    return wg * slots + (
      index % slots if isinstance(index, int) else lax.rem(index, slots)
    )

  def load_subtile(ep, wg, index, k0, n0):
    """Loads sub-tile ``index`` of the part at ``(k0, n0)`` into one of
    warpgroup ``wg``'s ``slots`` buffers, once its stores have read it."""
    di, dj = subtile_origin(index)
    ep.issue_loads(buffer_of(wg, index), k0 + di, n0 + dj)

  def update_subtile(ep, wg, index, k0, n0, grad, totals):
    """Updates sub-tile ``index`` of the part at ``(k0, n0)`` with its
    ``grad`` once its buffer's loads land; the buffer, once released, takes
    the sub-tile ``slots`` on. Adds the sub-tile's per-row skipped counts and
    sums of squared ``dW`` elements to ``totals``."""
    following = index + slots
    refill = functools.partial(load_subtile, ep, wg, following, k0, n0)
    if isinstance(following, int):
      release = refill if following < len(part_subtiles) else None
    else:

      def release():
        pl.when(following < len(part_subtiles))(refill)

    di, dj = subtile_origin(index)
    sub_skipped, sub_grad_sq = ep.update(
      buffer_of(wg, index), k0 + di, n0 + dj, grad, release
    )
    return totals[0] + sub_skipped, totals[1] + sub_grad_sq

  def update_part(ep, wg, k0, n0, acc, stash):
    """Updates the part at ``(k0, n0)`` with its accumulated ``acc``,
    sub-tile by sub-tile through warpgroup ``wg``'s buffers, whose first
    loads were issued under the main loop. With a ``stash`` (shared memory
    for the part's sub-tiles) the sub-tiles of ``acc`` are stored there and
    updated in a rolled loop. Returns the per-row skipped counts and sums of
    squared ``dW`` elements."""
    totals = (jnp.zeros((ek,), jnp.float32), jnp.zeros((ek,), jnp.float32))
    if stash is None:
      for index, (di, dj) in enumerate(part_subtiles):
        grad = acc[di : di + ek, dj : dj + en]
        totals = update_subtile(ep, wg, index, k0, n0, grad, totals)
      return totals
    # Each thread reads back the elements it stored (the same layout): no
    # barrier between the stores and the loads.
    for index, (di, dj) in enumerate(part_subtiles):
      stash[index] = acc[di : di + ek, dj : dj + en]
    return lax.fori_loop(
      0,
      len(part_subtiles),
      lambda index, totals: update_subtile(
        ep, wg, index, k0, n0, stash[index], totals
      ),
      totals,
    )

  @functools.partial(
    pl.run_scoped,
    **pipeline.ring_buffers(stages),
    loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
    **pipeline.epilogue_allocations(),
    **pipeline.stash_allocations(),
    collective_axes="wg",
  )
  def _scope(
    x_smem,
    dy_smem,
    loaded,
    consumed,
    epilogue_smem,
    load_barriers,
    stash_smem=None,
  ):
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

      @plgpu.nd_loop((num_tiles,), collective_axes="sm")
      def _tile_loop(loop_info: plgpu.NDLoopInfo):
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
          stash = None
          if stash_smem is not None:
            subtiles = len(part_subtiles)
            stash = stash_smem.at[pl.ds(wg * subtiles, subtiles)]
          skipped, grad_sq = update_part(ep, wg, k0, n0, acc, stash)
          skipped_gmem[wgs * linear + wg] = skipped
          grad_sq_gmem[wgs * linear + wg] = grad_sq
