"""The ``'deferred'`` schedule: each compute warpgroup updates its part of a
tile during the next tile's main loop, so the rule runs while the tensor
cores work.

The compute warpgroups share a CTA tile as in the inline schedule. After a
tile's main loop each stashes its float32 part of dW in shared memory,
sub-tile by sub-tile, and goes on to the next tile. Inside that tile's main
loop, at steps spread evenly over it, it issues the wgmma of up to
``wgmma_ahead`` steps (as many as its ring holds, by default) and, while
they run, updates one sub-tile of the stashed part: the kernel and state
sub-tile's loads were issued when the part was stashed (or when an earlier
sub-tile's stores had read the buffer), and the rule reads its gradient
from the stash. Sub-tiles that find no step (a main loop shorter than a
part's sub-tiles) are updated after the loop, and the CTA's last tile after
its tile loop.

What it costs: the stash (``compute_wgs x tile_k x tile_n`` float32) takes
shared memory the ring would otherwise use, so it runs with fewer stages.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forge_jax.ops.mosaic.config import compute_warpgroup_registers
from forge_jax.ops.mosaic.pipeline import Pipeline, swizzled


def interleaving(num_steps: int, num_subtiles: int, stages: int, ahead: int):
  """Where a part's sub-tile updates go in the next tile's main loop: a
  list of ``(step, depth)``, one per sub-tile that finds a step, ``depth``
  steps' wgmma issued from ``step`` on before the update runs. The rest
  are updated after the loop. Each update comes as late in its share of
  the steps as its wgmma allow, giving its buffer's loads the most time."""
  in_loop = min(num_subtiles, num_steps)
  if not in_loop:
    return []
  spacing = num_steps // in_loop
  # A step's buffers are released one step late: a ring of ``stages`` holds
  # ``stages - 1`` steps issued ahead of the previous step's release.
  depth = min(spacing, stages - 1, ahead or stages)
  return [
    (index * spacing + spacing - depth, depth) for index in range(in_loop)
  ]


def deferred_schedule(pipeline: Pipeline):
  """The compute warpgroups accumulate each tile together, as in the inline
  schedule, and update their parts of it during the next tile's main loop,
  from a float32 stash in shared memory."""
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
  num_subtiles = len(part_subtiles)
  plan = interleaving(num_steps, num_subtiles, stages, config.wgmma_ahead)

  @functools.partial(
    pl.run_scoped,
    **pipeline.ring_buffers(stages),
    loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
    **pipeline.epilogue_allocations(),
    stash=plgpu.SMEM(
      (wgs * num_subtiles, ek, en),
      jnp.float32,
      transforms=swizzled(en, jnp.float32),
    ),
    collective_axes="wg",
  )
  def _scope(
    x_smem, dy_smem, loaded, consumed, epilogue_smem, load_barriers, stash
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

      def part_origin(linear):
        k0, cta_n0 = pipeline.tile_origin(linear)
        return k0, cta_n0 + wg * tn

      def load_subtile(index, linear, after_stores=True):
        k0, n0 = part_origin(linear)
        di, dj = part_subtiles[index]
        ep.issue_loads(
          wg * slots + index % slots, k0 + di, n0 + dj, after_stores
        )

      def update_subtile(index, linear, sums):
        """Updates stashed sub-tile ``index`` of tile ``linear``'s part;
        its buffer, once its stores have read it, takes the sub-tile
        ``slots`` on. Returns ``sums`` plus its skipped counts and sums of
        squares."""
        k0, n0 = part_origin(linear)
        di, dj = part_subtiles[index]
        following = index + slots
        release = (
          functools.partial(load_subtile, following, linear, False)
          if following < num_subtiles
          else None
        )
        skipped, grad_sq = ep.update(
          wg * slots + index % slots,
          k0 + di,
          n0 + dj,
          stash[wg * num_subtiles + index],
          release,
        )
        return sums[0] + skipped, sums[1] + grad_sq

      def update_if(has_part, index, linear, sums):
        return lax.cond(
          has_part,
          functools.partial(update_subtile, index, linear),
          lambda sums: sums,
          sums,
        )

      def write_sums(linear, sums):
        skipped_gmem[wgs * linear + wg] = sums[0]
        grad_sq_gmem[wgs * linear + wg] = sums[1]

      def stash_part(acc, linear):
        """Stashes a part's dW sub-tiles and loads the first ``slots``
        sub-tiles of its kernel and state. Each thread writes, and later
        reads, only its own elements of the wgmma layout."""
        for index, (di, dj) in enumerate(part_subtiles):
          stash[wg * num_subtiles + index] = acc[di : di + ek, dj : dj + en]
        for index in range(slots):
          load_subtile(index, linear)

      def main_loop(acc_ref, first, previous_linear):
        """The tile's main loop (:meth:`Pipeline.main_loop`'s ring
        protocol) with the previous tile's sub-tiles updated at the
        plan's steps. Returns the accumulator and the previous part's
        sums so far."""
        has_previous = previous_linear >= 0
        sums = (jnp.zeros((ek,), jnp.float32), jnp.zeros((ek,), jnp.float32))

        def step(t, carry):
          slot, last = carry
          plgpu.barrier_wait(loaded.at[slot])
          pipeline.wgmma(acc_ref, x_smem.at[slot], dy_smem.at[slot], wg)
          plgpu.wgmma_wait(1)

          @pl.when(t > 0)
          def _release():
            plgpu.barrier_arrive(consumed.at[last])

          return lax.select(slot + 1 == stages, 0, slot + 1), slot

        def advance(slot):
          return lax.select(slot + 1 == stages, 0, slot + 1)

        slot = lax.rem(first, stages)
        last = slot
        t = 0
        for index, (start, depth) in enumerate(plan):
          slot, last = lax.fori_loop(t, start, step, (slot, last))
          issued = []
          for _ in range(depth):
            plgpu.barrier_wait(loaded.at[slot])
            pipeline.wgmma(acc_ref, x_smem.at[slot], dy_smem.at[slot], wg)
            issued.append(slot)
            slot = advance(slot)
          sums = update_if(has_previous, index, previous_linear, sums)
          plgpu.wgmma_wait(1)
          released = ([last] if start > 0 else []) + issued[:-1]
          for done in released:
            plgpu.barrier_arrive(consumed.at[done])
          last = issued[-1]
          t = start + depth
        slot, last = lax.fori_loop(t, num_steps, step, (slot, last))
        acc = acc_ref[...]  # waits for the last wgmma
        plgpu.barrier_arrive(consumed.at[last])
        for index in range(len(plan), num_subtiles):
          sums = update_if(has_previous, index, previous_linear, sums)

        @pl.when(has_previous)
        def _write():
          write_sums(previous_linear, sums)

        return acc

      @plgpu.nd_loop(
        (num_tiles,), collective_axes="sm", init_carry=jnp.int32(-1)
      )
      def last_linear(loop_info: plgpu.NDLoopInfo, carry):
        (linear,) = loop_info.index

        @functools.partial(
          pl.run_scoped, acc_ref=plgpu.ACC((tk, tn), jnp.float32)
        )
        def _acc_scope(acc_ref):
          acc = main_loop(acc_ref, loop_info.local_index * num_steps, carry)
          stash_part(acc, linear)

        return linear

      @pl.when(last_linear >= 0)
      def _last_part():
        sums = (jnp.zeros((ek,), jnp.float32), jnp.zeros((ek,), jnp.float32))
        for index in range(num_subtiles):
          sums = update_subtile(index, last_linear, sums)
        write_sums(last_linear, sums)
