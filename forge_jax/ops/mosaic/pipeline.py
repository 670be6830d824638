"""What every schedule of the Mosaic GPU kernel builds on, for one call.

:class:`Pipeline` holds the call's refs and tiling and the building blocks
the schedules share: the memory warpgroup's tile streaming
(:meth:`Pipeline.stream_tiles`), the compute warpgroups' main loop
(:meth:`Pipeline.main_loop`) and the epilogue
(:class:`forge_jax.ops.mosaic.epilogue.Epilogue`, with its shared-memory
buffers). A schedule (:mod:`forge_jax.ops.mosaic.inline`,
:mod:`forge_jax.ops.mosaic.pingpong`) decides which warpgroup runs what.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forge_jax.ops.mosaic.config import (
  MEMORY_REGISTERS,
  MosaicConfig,
  epilogue_buffers,
  launch_registers,
)
from forge_jax.ops.mosaic.epilogue import Epilogue, is_block_scale
from forge_jax.ops.update import apply_update, read_kernel_scalars


def swizzled(block_minor: int, dtype):
  """TMA transforms for a block whose minor dimension has ``block_minor``
  elements of ``dtype``."""
  swizzle = plgpu.find_swizzle(block_minor * jnp.dtype(dtype).itemsize * 8)
  return (
    plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )


class Pipeline:
  """The kernel body's refs, tiling and shared building blocks.

  ``storage_gmem`` (kernel, *state leaves) are read; ``storage_out`` written
  (on the GPU the same refs: in place); ``divisors`` are their
  :func:`forge_jax.quantization.column_divisors` (1 for the kernel), which
  tell int8 block scales and 4-bit codes apart. ``scalars_gmem`` is
  :func:`forge_jax.ops.update.pack_kernel_scalars`'s vector (``stacked``:
  the refs are ``[L, K, N]`` stacks, stepped at its layer index).
  ``skipped_gmem`` takes the compute warpgroups' per-row skipped counts, a
  row for each warpgroup of each CTA (``'inline'``) or for each tile
  (``'pingpong'``) (:func:`forge_jax.ops.mosaic.kernel.skipped_rows_shape`),
  and ``grad_sq_gmem`` at the same index their per-row sums of squared
  ``dW`` elements.
  """

  def __init__(
    self,
    scalars_gmem,
    x_gmem,
    dy_gmem,
    storage_gmem,
    storage_out,
    skipped_gmem,
    grad_sq_gmem,
    *,
    optimizer,
    state_treedef,
    scalars_treedef,
    config: MosaicConfig,
    interpret,
    stacked,
    divisors,
  ):
    self.scalars_gmem, self.x_gmem, self.dy_gmem = scalars_gmem, x_gmem, dy_gmem
    self.storage_gmem, self.storage_out = storage_gmem, storage_out
    self.skipped_gmem, self.grad_sq_gmem = skipped_gmem, grad_sq_gmem
    self.optimizer = optimizer
    self.state_treedef, self.scalars_treedef = state_treedef, scalars_treedef
    self.config, self.interpret = config, interpret
    self.stacked, self.divisors = stacked, divisors
    # x is [tokens, k]; in interpret mode it arrives transposed, [k, tokens].
    tokens, k = x_gmem.shape[::-1] if interpret else x_gmem.shape
    n = dy_gmem.shape[1]
    tk, tn, tt = config.tile_k, config.tile_n, config.tile_t
    self.tk, self.tn, self.tt = tk, tn, tt
    ek, en = config.epilogue_k, config.epilogue_n
    self.ek, self.en = ek, en
    self.cta_tn = config.cta_tile_n
    self.k_iters, self.n_iters = k // tk, n // self.cta_tn
    self.num_tiles = self.k_iters * self.n_iters
    self.num_steps = tokens // tt
    self.slots = config.epilogue_slots
    # x's block of the tile at k0, pipeline step t (transposed in interpret
    # mode).
    if interpret:
      self.x_block = (tk, tt)
      self.x_window = lambda k0, t: x_gmem.at[pl.ds(k0, tk), pl.ds(t * tt, tt)]
    else:
      self.x_block = (tt, tk)
      self.x_window = lambda k0, t: x_gmem.at[pl.ds(t * tt, tt), pl.ds(k0, tk)]
    self.x_transforms = swizzled(self.x_block[1], x_gmem.dtype)
    self.dy_transforms = swizzled(self.cta_tn, dy_gmem.dtype)
    self.tma_leaves = [
      (ref, divisor)
      for ref, divisor in zip(storage_gmem, divisors)
      if not is_block_scale(divisor)
    ]
    # Sub-tiles of one warpgroup's tile_k x tile_n part, in order.
    self.part_subtiles = [
      (i * ek, j * en) for i in range(tk // ek) for j in range(tn // en)
    ]

  def tile_origin(self, linear):
    k_idx, n_idx = plgpu.planar_snake(
      linear, (self.k_iters, self.n_iters), 1, self.config.grid_tile_width
    )
    return k_idx * self.tk, n_idx * self.cta_tn

  def wgmma(self, acc_ref, x_smem, dy_smem, part):
    # The interpreter's wgmma takes no transposed operand: there x arrives
    # transposed (the GPU tests check the transposed path).
    lhs = x_smem if self.interpret else x_smem.transpose((1, 0))
    plgpu.wgmma(acc_ref, lhs, dy_smem.at[:, pl.ds(part * self.tn, self.tn)])

  def epilogue(self, smem, barriers) -> Epilogue:
    """The epilogue of this call's optimizer, on the buffers ``smem`` (one
    per leaf that goes through shared memory) and their load ``barriers``
    (:meth:`epilogue_allocations`)."""
    optimizer, storage_gmem = self.optimizer, self.storage_gmem
    scalars, apply, key, shard_row, shard_col, layer_index = (
      read_kernel_scalars(self.scalars_gmem, self.scalars_treedef)
    )

    def rule(grad, values, indices):
      state = jax.tree.unflatten(self.state_treedef, values[1:])
      new_w, new_state, updated = apply_update(
        optimizer,
        grad,
        values[0],
        state,
        scalars,
        apply,
        rounding_key=key,
        indices=indices,
      )
      return [new_w] + jax.tree.leaves(new_state), updated

    return Epilogue(
      storage_gmem=storage_gmem,
      storage_out=self.storage_out,
      divisors=self.divisors,
      smem=smem,
      barriers=barriers,
      layer=(layer_index,) if self.stacked else (),
      rule=rule,
      stochastic=(
        optimizer.weight_rounding == "stochastic"
        and storage_gmem[0].dtype == jnp.bfloat16
      ),
      shard_origin=(shard_row, shard_col),
      config=self.config,
      interpret=self.interpret,
    )

  def epilogue_allocations(self):
    """The epilogue's buffers and load barriers, for ``pl.run_scoped``."""
    ek, en, tma_leaves = self.ek, self.en, self.tma_leaves
    num_buffers = epilogue_buffers(self.config)
    return dict(
      epilogue_smem=[
        plgpu.SMEM(
          (num_buffers, ek, en // divisor),
          ref.dtype,
          transforms=swizzled(en // divisor, ref.dtype),
        )
        for ref, divisor in tma_leaves
      ],
      # One barrier per (buffer, leaf): each TMA load arrives once.
      load_barriers=plgpu.Barrier(num_barriers=num_buffers * len(tma_leaves)),
    )

  def ring_buffers(self, stages):
    """The x and dy blocks of a ring of ``stages`` pipeline steps."""
    return dict(
      x_smem=plgpu.SMEM(
        (stages, *self.x_block), self.x_gmem.dtype, transforms=self.x_transforms
      ),
      dy_smem=plgpu.SMEM(
        (stages, self.tt, self.cta_tn),
        self.dy_gmem.dtype,
        transforms=self.dy_transforms,
      ),
    )

  def take_registers(self, registers):
    """Raises a compute warpgroup's registers (setmaxnreg) when ``registers``
    is more than its share at launch."""
    if registers > launch_registers(self.config):
      plgpu.set_max_registers(registers, action="increase")

  def local_tiles(self):
    """This CTA's tiles (the grid has no more CTAs than tiles)."""
    first_tile, num_ctas = lax.axis_index("sm"), lax.axis_size("sm")
    return (self.num_tiles - first_tile + num_ctas - 1) // num_ctas

  def stream_tiles(self, x_smem, dy_smem, ready, consumed, stages):
    """The memory warpgroup (every schedule): loads x and dy blocks of the
    CTA's tiles into a ring of ``stages`` buffers, the steps numbered across
    tiles so the ring runs on into the next tile. A step's loads arrive on
    ``ready(local_tile, slot)``; a slot is refilled once ``consumed`` says
    its last step is done."""
    num_steps, tt, cta_tn = self.num_steps, self.tt, self.cta_tn
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    @plgpu.nd_loop((self.num_tiles,), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      k0, cta_n0 = self.tile_origin(loop_info.index[0])

      @pl.loop(0, num_steps)
      def _step(t):
        count = loop_info.local_index * num_steps + t
        slot = lax.rem(count, stages)

        @pl.when(count >= stages)
        def _wait_consumed():
          plgpu.barrier_wait(consumed.at[slot])

        barrier = ready(loop_info.local_index, slot)
        plgpu.copy_gmem_to_smem(self.x_window(k0, t), x_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(
          self.dy_gmem.at[pl.ds(t * tt, tt), pl.ds(cta_n0, cta_tn)],
          dy_smem.at[slot],
          barrier,
        )

    # Observe the last steps' releases too, leaving the barriers clean.
    total = self.local_tiles() * num_steps

    @pl.loop(lax.max(total - stages, 0), total)
    def _drain(count):
      plgpu.barrier_wait(consumed.at[lax.rem(count, stages)])

  def main_loop(
    self,
    acc_ref,
    x_smem,
    dy_smem,
    ready,
    consumed,
    stages,
    first,
    part,
    after_wgmma=lambda t: None,
  ):
    """Accumulates one tile from the ring of ``stages`` buffers (steps
    ``first + t``, loads arriving on ``ready(slot)``) and returns the
    accumulator. A step's buffers are released after the next step's
    ``wgmma_wait(1)``, which proves its wgmma done.

    The slot is carried from step to step: recomputing ``(first + t) %
    stages`` each step (a multiply-shift division for 5 stages) would put
    integer arithmetic between the wgmma of a warpgroup that issues them
    all."""

    def step(t, carry):
      acc_ref, slot, previous = carry
      plgpu.barrier_wait(ready(slot))
      self.wgmma(acc_ref, x_smem.at[slot], dy_smem.at[slot], part)
      after_wgmma(t)
      plgpu.wgmma_wait(1)

      @pl.when(t > 0)
      def _release():
        plgpu.barrier_arrive(consumed.at[previous])

      following = slot + 1
      return acc_ref, lax.select(following == stages, 0, following), slot

    first_slot = lax.rem(first, stages)
    _, _, last = lax.fori_loop(
      0, self.num_steps, step, (acc_ref, first_slot, first_slot)
    )
    acc = acc_ref[...]  # waits for the last wgmma
    plgpu.barrier_arrive(consumed.at[last])
    return acc
