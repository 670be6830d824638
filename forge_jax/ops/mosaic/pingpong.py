"""The ``'pingpong'`` schedule: the compute warpgroups take a CTA's tiles in
turn, so one updates its tile while the other's wgmma run.

A CTA tile is one compute warpgroup's ``tile_k x tile_n``. The memory
warpgroup streams x and dy for the CTA's tiles in order, a step's loads
arriving on its owner's barrier. A loader warpgroup keeps each compute
warpgroup's ring of ``epilogue_slots`` buffers full, running ahead into its
next tile (``prefetch_step`` does not apply).

It pays off once the token loop is long and every SM walks many tiles: a
tile's update on one warpgroup's four warps, one a scheduler, cannot hide
the rule's latencies unless the other warpgroup's main loop runs beside it.
:func:`forge_jax.ops.mosaic.config.ranked_configs` ranks it first from
``PINGPONG_MIN_TOKENS`` tokens and ``PINGPONG_MIN_TILES_PER_SM`` tiles an
SM, and for light updates (``LIGHT_UPDATE_BYTES``) from
``LIGHT_PINGPONG_MIN_TOKENS`` tokens and ``LIGHT_PINGPONG_MIN_TILES_PER_SM``
tiles an SM, never for stochastically rounded kernels (2.1-2.4x the inline
schedule's time with them); a ``MosaicConfig(schedule='pingpong', ...)``
passed in selects it anywhere.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forge_jax.ops.mosaic.config import (
  MEMORY_REGISTERS,
  compute_warpgroup_registers,
)
from forge_jax.ops.mosaic.pipeline import Pipeline


def pingpong_schedule(pipeline: Pipeline):
  """A memory warpgroup streams x and dy for the CTA's tiles in order; the
  compute warpgroups take the tiles in turn, each running its own main
  loop and epilogue, so one updates its tile while the other's wgmma keep
  the tensor cores busy. A loader warpgroup fills each compute
  warpgroup's ring of ``slots`` epilogue buffers with its tiles' kernel
  and state sub-tiles, numbered across tiles, as soon as a buffer's
  stores have read it: the loads run ahead of the updates, into the next
  tile's, instead of waiting for them."""
  config, num_tiles, num_steps = (
    pipeline.config,
    pipeline.num_tiles,
    pipeline.num_steps,
  )
  tk, tn, ek, en = pipeline.tk, pipeline.tn, pipeline.ek, pipeline.en
  slots, part_subtiles = pipeline.slots, pipeline.part_subtiles
  skipped_gmem, grad_sq_gmem = pipeline.skipped_gmem, pipeline.grad_sq_gmem
  stages, wgs = config.max_concurrent_steps, config.compute_wgs
  memory_wg, loader_wg = wgs, wgs + 1
  compute_registers = compute_warpgroup_registers(config)
  per_tile = len(part_subtiles)

  @functools.partial(
    pl.run_scoped,
    **pipeline.ring_buffers(stages),
    # One barrier per (owner, slot): a thread tracks a barrier's phase by
    # waiting on every phase of it, so a warpgroup's barriers must not
    # complete for the other's steps.
    loaded=plgpu.Barrier(num_arrivals=2, num_barriers=wgs * stages),
    consumed=plgpu.Barrier(num_barriers=stages),
    buffer_free=plgpu.Barrier(num_barriers=wgs * slots),
    **pipeline.epilogue_allocations(),
    collective_axes="wg",
  )
  def _scope(
    x_smem, dy_smem, loaded, consumed, buffer_free, epilogue_smem, load_barriers
  ):
    wg = lax.axis_index("wg")
    owner = lambda local_tile: lax.rem(local_tile, wgs)

    def buffer(local_tile, index):
      """Sub-tile ``index`` of a local tile: its epilogue buffer (in its
      owner's ring) and its position in the owner's sequence."""
      position = local_tile // wgs * per_tile + index
      return owner(local_tile) * slots + lax.rem(position, slots), position

    @pl.when(wg == memory_wg)
    def _memory():
      pipeline.stream_tiles(
        x_smem,
        dy_smem,
        lambda local_tile, slot: loaded.at[owner(local_tile) * stages + slot],
        consumed,
        stages,
      )

    @pl.when(wg == loader_wg)
    def _loader():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
      ep = pipeline.epilogue(epilogue_smem, load_barriers)

      @plgpu.nd_loop((num_tiles,), collective_axes="sm")
      def _tile_loop(loop_info: plgpu.NDLoopInfo):
        k0, n0 = pipeline.tile_origin(loop_info.index[0])
        for index, (di, dj) in enumerate(part_subtiles):
          buf, position = buffer(loop_info.local_index, index)

          @pl.when(position >= slots)
          def _wait_free():
            plgpu.barrier_wait(buffer_free.at[buf])

          ep.issue_loads(buf, k0 + di, n0 + dj, after_stores=False)

      # Observe the last buffers' releases too, leaving the barriers clean.
      for owner_wg in range(wgs):
        total = (pipeline.local_tiles() - owner_wg + wgs - 1) // wgs * per_tile

        @pl.loop(lax.max(total - slots, 0), total)
        def _drain(position):
          plgpu.barrier_wait(
            buffer_free.at[owner_wg * slots + lax.rem(position, slots)]
          )

    @pl.when(wg < wgs)
    def _compute():
      pipeline.take_registers(compute_registers)
      ep = pipeline.epilogue(epilogue_smem, load_barriers)

      @plgpu.nd_loop((num_tiles,), collective_axes="sm")
      def _tile_loop(loop_info: plgpu.NDLoopInfo):
        @pl.when(owner(loop_info.local_index) == wg)
        def _own_tile():
          (linear,) = loop_info.index
          k0, n0 = pipeline.tile_origin(linear)

          @functools.partial(
            pl.run_scoped, acc_ref=plgpu.ACC((tk, tn), jnp.float32)
          )
          def _acc_scope(acc_ref):
            acc = pipeline.main_loop(
              acc_ref,
              x_smem,
              dy_smem,
              lambda slot: loaded.at[wg * stages + slot],
              consumed,
              stages,
              loop_info.local_index * num_steps,
              0,
            )
            skipped = jnp.zeros((ek,), jnp.float32)
            grad_sq = jnp.zeros((ek,), jnp.float32)
            for index, (di, dj) in enumerate(part_subtiles):
              buf, _ = buffer(loop_info.local_index, index)
              sub_skipped, sub_grad_sq = ep.update(
                buf,
                k0 + di,
                n0 + dj,
                acc[di : di + ek, dj : dj + en],
                functools.partial(plgpu.barrier_arrive, buffer_free.at[buf]),
              )
              skipped += sub_skipped
              grad_sq += sub_grad_sq
            skipped_gmem[linear] = skipped
            grad_sq_gmem[linear] = grad_sq
