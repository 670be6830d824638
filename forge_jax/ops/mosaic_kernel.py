"""Pallas kernel (Mosaic GPU, Hopper): wgmma dW tiles with the update fused.

A persistent kernel (one CTA per SM) walks the kernel's ``tile_k x
(compute_wgs * tile_n)`` tiles. In each CTA a memory warpgroup streams ``x``
and ``dy`` blocks into shared memory with TMA while the compute warpgroups
accumulate ``dW = x.T @ dy`` with wgmma (``x``'s block is the transposed A
operand), each for its ``tile_k x tile_n`` part, in float32 registers. Each
compute warpgroup's epilogue then walks its part in ``epilogue_k x
epilogue_n`` sub-tiles: TMA loads of the kernel and state sub-tiles, the
optimizer rule in registers (:func:`forge_jax.ops.update.apply_update`, the
function the XLA reference applies to the whole array), and TMA stores of the
new values over the old ones. The loads of the first ``epilogue_slots``
sub-tiles are issued during the main loop, right after the wgmma of pipeline
step ``prefetch_step``, so the epilogue finds them waiting. Later sub-tiles
reuse the slots, their loads issued as soon as a slot's store has read it;
the stores are asynchronous and drain under the next tile's main loop. The
default config depends on the token count (:func:`ranked_configs`). ``dW``
never reaches device memory.

The kernel, its state and the skipped-element counts are ``jax.new_ref``
buffers the kernel writes in place (aliased in and out). Stacked ``[L, K,
N]`` variables (``layer_index``, :mod:`forge_jax.ops.stacks`) are read and
written at the layer's index, a TMA coordinate: no slice of a stack goes in
or out of the call.

Coverage: 16-bit activations (wgmma's transposed operand), float32 or
bfloat16 kernels (bfloat16 stochastically rounded too), float32, bfloat16 or
int8 block-64 states, shapes that divide into whole tiles. Other calls get a
reason from :func:`unsupported_reason`; 'auto' then uses the Triton-lowering
kernel, which it also tries first for int8 states (faster on the whole step
so far: :func:`forge_jax.ops.backends.select`).

Low precision (:mod:`forge_jax.quantization`, the reference's functions):
stochastic rounding hashes each element's global row and column (the tile's
offset plus an iota, plus the shard's ``offset`` under tensor parallelism)
and the step, which travel with the scalars (exact in float32 up to 2**24),
so the kernel draws the reference's bits. int8 states: the codes arrive as
int8 (bitcast from their float8 container outside the kernel) and go
through shared memory by TMA like the other leaves; an epilogue sub-tile is
one block wide (``epilogue_n`` = 64), so its float32 scales are one column
of the ``[K, N / 64]`` scale array: 4 bytes a row, below TMA's 16-byte
minimum, and a 16-byte box would span other CTAs' blocks. They are read
and written by the epilogue's threads directly in global memory (a strided
non-vectorized load, a store), as a ``[epilogue_k]`` vector: Mosaic GPU's
layout inference finds no layout for ``[R, 1]`` arrays next to a wgmma-
layout tile ("Failed to infer a possible set of layouts"), so the quantizer
keeps per-block values of one-block tiles 1-D (``quantize(rows_1d=True)``)
and broadcasts them explicitly. This JAX's warpgroup lowering also lacks
``floor`` (registered below) and pointwise ops on 8-bit vectors (the
quantizer selects codes as int32).

Off-GPU the kernel runs in Mosaic GPU's interpret mode (how the CPU tests
check it), which simulates the warpgroups, shared memory, TMA and barriers;
its wgmma takes no transposed operand, so there ``x`` arrives transposed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forge_jax import quantization
from forge_jax.ops import stacks
from forge_jax.ops.update import (apply_update, pack_kernel_scalars,
                                  read_kernel_scalars)

_ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16)
_STORAGE_DTYPES = (jnp.float32, jnp.bfloat16)
#: int8 states: codes in their one-byte container and float32 block scales.
_STATE_DTYPES = _STORAGE_DTYPES + (quantization.CODES_CONTAINER,)
#: Shared memory a CTA may take (H100/H200: 227 KB), less some for barriers.
SHARED_MEMORY_BUDGET = 220 * 1024
#: Streaming multiprocessors of an H100/H200 (the persistent grid's size when
#: no GPU is present, i.e. interpret mode and cross-lowering).
DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tile shapes of the Mosaic GPU kernel.

  A CTA computes ``tile_k x (compute_wgs * tile_n)`` of dW (one
  ``tile_k x tile_n`` part per compute warpgroup), streaming ``tile_t``
  tokens per pipeline step, ``max_concurrent_steps`` steps in flight. The
  epilogue works on ``epilogue_k x epilogue_n`` sub-tiles of each part,
  with ``epilogue_slots`` buffers per warpgroup, whose loads are issued at
  pipeline step ``prefetch_step`` of the main loop (the last step if the
  loop is shorter); with as many slots as sub-tiles the whole part's kernel
  and state are loaded under the main loop. ``ctas_per_sm`` persistent CTAs
  share an SM (2: one's epilogue overlaps the other's main loop, if both
  fit).
  """

  tile_k: int = 128
  tile_n: int = 64
  tile_t: int = 64
  max_concurrent_steps: int = 3
  epilogue_k: int = 64
  epilogue_n: int = 32
  #: Tiles of this many consecutive N-blocks share their x blocks in L2.
  grid_tile_width: int = 8
  compute_wgs: int = 2
  epilogue_slots: int = 2
  prefetch_step: int = 0
  ctas_per_sm: int = 1

  def __post_init__(self):
    for name in ("tile_k", "tile_n", "tile_t", "epilogue_k", "epilogue_n"):
      value = getattr(self, name)
      if value < 8 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 8")
    if self.tile_t % 64:
      raise ValueError(f"tile_t={self.tile_t} must be a multiple of 64 "
                       "(wgmma's contraction with a transposed operand)")
    if self.tile_k % 64 or self.epilogue_k % 64:
      raise ValueError(f"tile_k={self.tile_k} and epilogue_k={self.epilogue_k} "
                       "must be multiples of 64 (a warpgroup's wgmma rows)")
    if self.tile_k % self.epilogue_k or self.tile_n % self.epilogue_n:
      raise ValueError(
          f"epilogue_k={self.epilogue_k} and epilogue_n={self.epilogue_n} "
          f"must divide tile_k={self.tile_k} and tile_n={self.tile_n}")
    for name in ("compute_wgs", "ctas_per_sm"):
      if getattr(self, name) not in (1, 2):
        raise ValueError(f"{name}={getattr(self, name)} must be 1 or 2")
    if not 1 <= self.epilogue_slots <= self.epilogue_subtiles:
      raise ValueError(
          f"epilogue_slots={self.epilogue_slots} must be between 1 and the "
          f"{self.epilogue_subtiles} epilogue sub-tiles of a warpgroup's part")
    if self.prefetch_step < 0:
      raise ValueError(f"prefetch_step={self.prefetch_step} must be >= 0")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} "
                       "must be at least 2")

  @property
  def cta_tile_n(self) -> int:
    return self.compute_wgs * self.tile_n

  @property
  def epilogue_subtiles(self) -> int:
    """Sub-tiles of one warpgroup's ``tile_k x tile_n`` part."""
    return (self.tile_k // self.epilogue_k) * (self.tile_n // self.epilogue_n)


def shared_memory_bytes(config: MosaicConfig, activation_itemsize: int,
                        storage_itemsizes) -> int:
  """A CTA's pipeline buffers + its warpgroups' epilogue buffers."""
  pipeline = (config.max_concurrent_steps * config.tile_t
              * (config.tile_k + config.cta_tile_n) * activation_itemsize)
  epilogue = (config.compute_wgs * config.epilogue_slots * config.epilogue_k
              * config.epilogue_n * sum(storage_itemsizes))
  return pipeline + epilogue


#: Defaults by token count, fastest first (H200, AdamW, bf16 and float32
#: storage; benchmarks/NOTES.md, session 3). Few tokens: the kernel and state
#: traffic dominates and 64 x 64 sub-tiles move it fastest, their loads
#: issued at step 4 (at step 0 the compute warpgroups wait for the previous
#: tile's stores); many: the main loop dominates, and 128 x 256 CTA tiles run
#: it fastest.
FEW_TOKENS, MANY_TOKENS = 2048, 8192
RANKED_CONFIGS = {
    "few": (MosaicConfig(epilogue_n=64, prefetch_step=4), MosaicConfig()),
    "some": (MosaicConfig(),
             MosaicConfig(tile_n=128, max_concurrent_steps=2)),
    "many": (MosaicConfig(tile_n=128, max_concurrent_steps=2),
             MosaicConfig(epilogue_slots=1, max_concurrent_steps=4)),
}
#: Tried after the ranked ones: smaller buffers for optimizers with more
#: state tensors (centered RMSprop with momentum: four) and fewer columns.
FALLBACK_CONFIGS = (
    MosaicConfig(epilogue_slots=1, max_concurrent_steps=4),
    MosaicConfig(epilogue_slots=1, max_concurrent_steps=2),
)


def ranked_configs(tokens: int) -> tuple:
  """The default configs for ``tokens`` tokens, fastest first."""
  regime = ("few" if tokens < FEW_TOKENS else
            "some" if tokens < MANY_TOKENS else "many")
  return RANKED_CONFIGS[regime] + FALLBACK_CONFIGS


def _storage_itemsizes(kernel, state) -> list:
  """Bytes per element of the kernel and of each state leaf that passes
  through shared memory (all but int8 block scales)."""
  is_scale = [False] + quantization.scale_leaf_mask(state)
  return [jnp.dtype(leaf.dtype).itemsize
          for leaf, scale in zip([kernel] + jax.tree.leaves(state), is_scale)
          if not scale]


def _layer_state(kernel, optimizer):
  """The shapes of one layer's optimizer state (``kernel`` may be a stack:
  int8 states quantize 2-D kernels only)."""
  layer = jax.ShapeDtypeStruct(kernel.shape[-2:], kernel.dtype)
  return jax.eval_shape(optimizer.init, layer)


def _fitting_config(tokens, k, n, activation_itemsize, storage_itemsizes,
                    quantized: bool) -> MosaicConfig:
  """The first ranked config whose tiles divide the shape and whose buffers
  fit in shared memory (else the last: unsupported_reason says why). With
  int8 states an epilogue sub-tile is one quantization block wide."""
  configs = ranked_configs(tokens)
  if quantized:
    configs = tuple(
        dataclasses.replace(config, epilogue_n=quantization.BLOCK_SIZE)
        for config in configs)
  for config in configs:
    if (shared_memory_bytes(config, activation_itemsize, storage_itemsizes)
        <= SHARED_MEMORY_BUDGET and not k % config.tile_k
        and not n % config.cta_tile_n and not tokens % config.tile_t):
      return config
  return configs[-1]


def default_config(x, kernel, optimizer) -> MosaicConfig:
  """The fastest default config for this call's shapes and dtypes."""
  state = _layer_state(kernel, optimizer)
  return _fitting_config(math.prod(x.shape[:-1]), *kernel.shape[-2:],
                         jnp.dtype(x.dtype).itemsize,
                         _storage_itemsizes(kernel, state),
                         quantization.has_quantized(state))


def unsupported_reason(x, dy, kernel, optimizer,
                       config: Optional[MosaicConfig] = None) -> Optional[str]:
  """Why the Mosaic GPU kernel cannot run this call, or None if it can."""
  for name, value in (("x", x), ("dy", dy)):
    if jnp.dtype(value.dtype) not in map(jnp.dtype, _ACTIVATION_DTYPES):
      return f"{name}.dtype={value.dtype} must be bfloat16 or float16"
  if x.dtype != dy.dtype:
    return f"{x.dtype=} and {dy.dtype=} must match"
  if jnp.dtype(kernel.dtype) not in map(jnp.dtype, _STORAGE_DTYPES):
    return f"kernel.dtype={kernel.dtype} must be float32 or bfloat16"
  state = _layer_state(kernel, optimizer)
  quantized = quantization.has_quantized(state)
  for leaf in jax.tree.leaves(state):
    if jnp.dtype(leaf.dtype) not in map(jnp.dtype, _STATE_DTYPES):
      return (f"optimizer state dtype {leaf.dtype} is not supported (float32, "
              "bfloat16 or int8 blocks)")
  activation_itemsize = jnp.dtype(x.dtype).itemsize
  itemsizes = _storage_itemsizes(kernel, state)
  k, n = kernel.shape[-2:]
  tokens = math.prod(x.shape[:-1])
  if tokens == 0:
    return f"{x.shape=} has no tokens"
  config = config or _fitting_config(tokens, k, n, activation_itemsize,
                                     itemsizes, quantized)
  if quantized and config.epilogue_n != quantization.BLOCK_SIZE:
    return (f"int8 states are quantized in blocks of "
            f"{quantization.BLOCK_SIZE} columns: epilogue_n="
            f"{config.epilogue_n} must be {quantization.BLOCK_SIZE}")
  for name, size, tile in (("in_features", k, config.tile_k),
                           ("features", n, config.cta_tile_n),
                           ("tokens", tokens, config.tile_t)):
    if size % tile:
      return f"{name}={size} must be a multiple of {tile}"
  needed = shared_memory_bytes(config, activation_itemsize, itemsizes)
  if needed * config.ctas_per_sm > SHARED_MEMORY_BUDGET:
    return (f"the tiles of {config} need {needed} bytes of shared memory "
            f"per CTA, {config.ctas_per_sm} CTAs per SM: more than "
            f"{SHARED_MEMORY_BUDGET}")
  return None


def check_supported(x, dy, kernel, optimizer, config=None):
  reason = unsupported_reason(x, dy, kernel, optimizer, config)
  if reason is not None:
    raise ValueError(f"implementation='mosaic' cannot run this call: {reason}")


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
  return jnp.where(jnp.abs(x) < 2.0**jnp.finfo(x.dtype).nmant, down, x)


def _register_missing_lowerings():
  """Lower sqrt, is_finite (which the optimizer rules use) and floor (int8
  quantization) through other ops where this JAX's Mosaic GPU warpgroup
  lowering lacks them."""
  # pylint: disable=import-outside-toplevel,protected-access
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu import lowering
  rules = lowering.mosaic_lowering_rules[gpu_core.WGxWG_SEMANTICS]
  rules.setdefault(lax.sqrt_p, lowering._lower_fun(_sqrt_via_rsqrt))
  rules.setdefault(lax.is_finite_p, lowering._lower_fun(_is_finite))
  rules.setdefault(lax.floor_p, lowering._lower_fun(_floor_via_truncation))


_register_missing_lowerings()


def _swizzled(block_minor: int, dtype):
  """TMA transforms for a block whose minor dimension has ``block_minor``
  elements of ``dtype``."""
  swizzle = plgpu.find_swizzle(block_minor * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _fused_kernel(scalars_gmem, x_gmem, dy_gmem, storage_gmem, storage_out,
                  skipped_gmem, *, optimizer, state_treedef, scalars_treedef,
                  config: MosaicConfig, layer_id, interpret, stacked,
                  is_scale):
  """``storage_gmem`` (kernel, *state leaves) are read; ``storage_out`` written
  (on the GPU the same refs: in place). ``scalars_gmem`` is
  :func:`forge_jax.ops.update.pack_kernel_scalars`'s vector (``stacked``:
  the refs are ``[L, K, N]`` stacks, stepped at its layer index)."""
  # x is [tokens, k]; in interpret mode it arrives transposed, [k, tokens].
  tokens, k = x_gmem.shape[::-1] if interpret else x_gmem.shape
  n = dy_gmem.shape[1]
  tk, tn, tt = config.tile_k, config.tile_n, config.tile_t
  ek, en = config.epilogue_k, config.epilogue_n
  stochastic = (optimizer.weight_rounding == "stochastic"
                and storage_gmem[0].dtype == jnp.bfloat16)
  k_iters, n_iters = k // tk, n // config.cta_tile_n
  if interpret:
    x_block, x_index = (tk, tt), lambda t: (0, t)
    x_window = lambda k_start: x_gmem.at[pl.ds(k_start, tk), :]
  else:
    x_block, x_index = (tt, tk), lambda t: (t, 0)
    x_window = lambda k_start: x_gmem.at[:, pl.ds(k_start, tk)]
  x_transforms = _swizzled(x_block[1], x_gmem.dtype)
  dy_transforms = _swizzled(config.cta_tile_n, dy_gmem.dtype)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(tokens // tt,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec(x_block, x_index, transforms=x_transforms),
            plgpu.BlockSpec((tt, config.cta_tile_n), lambda t: (t, 0),
                            transforms=dy_transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=config.compute_wgs,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None
  slots = config.epilogue_slots
  prefetch_step = min(config.prefetch_step, tokens // tt - 1)
  num_buffers = config.compute_wgs * slots
  # int8 block scales (a sub-tile's is one 4-byte column: no TMA box) are
  # read and written directly in global memory; every other leaf goes
  # through shared memory by TMA.
  tma_gmem = [ref for ref, scale in zip(storage_gmem, is_scale) if not scale]
  tma_out = [ref for ref, scale in zip(storage_out, is_scale) if not scale]

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=pipeline(ignore, ignore).get_allocations(
          x_window(0), dy_gmem.at[:, :config.cta_tile_n]),
      epilogue_smem=[plgpu.SMEM((num_buffers, ek, en), ref.dtype,
                                transforms=_swizzled(en, ref.dtype))
                     for ref in tma_gmem],
      # One barrier per (warpgroup, slot, tensor): each TMA load arrives once.
      load_barrier=plgpu.Barrier(num_barriers=num_buffers * len(tma_gmem)),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, epilogue_smem, load_barrier):
    wg = lax.axis_index("wg")
    # The step and the shard's global offset seed stochastic rounding.
    scalars, apply, step, shard_row, shard_col, layer_index = (
        read_kernel_scalars(scalars_gmem, scalars_treedef))
    layer = (layer_index,) if stacked else ()

    @plgpu.nd_loop((k_iters * n_iters,), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (linear,) = loop_info.index
      k_idx, n_idx = plgpu.planar_snake(linear, (k_iters, n_iters), 1,
                                        config.grid_tile_width)
      k0 = k_idx * tk
      n0 = n_idx * config.cta_tile_n + wg * tn

      # The epilogue's sub-tiles of this warpgroup's part, in order.
      tiles = [(i, j) for i in range(tk // ek) for j in range(tn // en)]

      def window(ref, i, j):
        return ref.at[(*layer, pl.ds(k0 + i * ek, ek), pl.ds(n0 + j * en, en))]

      def global_indices(i, j):
        """Stochastic rounding's (rows, cols) of sub-tile (i, j)."""
        if not stochastic:
          return None
        shape = (ek, en)  # full tiles: their layout is the update's
        rows = shard_row + k0 + i * ek + lax.broadcasted_iota(
            jnp.int32, shape, 0)
        cols = shard_col + n0 + j * en + lax.broadcasted_iota(
            jnp.int32, shape, 1)
        return rows, cols

      def scale_index(i, j):
        """The sub-tile's block scales, as ``[ek]``: one column (en is one
        block; Mosaic GPU has no layout for an ``[ek, 1]`` tile)."""
        block = (n0 + j * en) // quantization.BLOCK_SIZE
        return (*layer, pl.ds(k0 + i * ek, ek), block)

      def buffer(slot):
        return wg * slots + slot

      def barrier(slot, t):
        return load_barrier.at[buffer(slot) * len(tma_gmem) + t]

      def issue_loads(index):
        i, j = tiles[index]
        slot = index % slots
        # The stores that last read this slot must have finished reading.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for t, (gmem, smem) in enumerate(zip(tma_gmem, epilogue_smem)):
          plgpu.copy_gmem_to_smem(window(gmem, i, j), smem.at[buffer(slot)],
                                  barrier(slot, t))

      def read_scales(gmem, i, j):
        if interpret:  # the interpreter has no plgpu.load
          return gmem[scale_index(i, j)]
        # A strided column: no optimized (vectorized) load exists.
        return plgpu.load(gmem, scale_index(i, j), optimized=False)

      def read_values(slot, i, j):
        """Kernel and state leaves of sub-tile (i, j), its loads landed."""
        smem_values = iter(smem[buffer(slot)] for smem in epilogue_smem)
        return [read_scales(gmem, i, j) if scale else next(smem_values)
                for gmem, scale in zip(storage_gmem, is_scale)]

      def write_values(slot, i, j, values):
        """New leaves to shared memory (scales to global), then TMA stores."""
        smem_values = []
        for gmem, value, scale in zip(storage_out, values, is_scale):
          if scale:
            gmem[scale_index(i, j)] = value
          else:
            smem_values.append(value)
        for smem, value in zip(epilogue_smem, smem_values):
          smem[buffer(slot)] = value
        plgpu.commit_smem()
        for gmem, smem in zip(tma_out, epilogue_smem):
          plgpu.copy_smem_to_gmem(smem.at[buffer(slot)], window(gmem, i, j))

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped,
                           acc_ref=plgpu.ACC((tk, tn), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)  # issues the first `slots` sub-tiles' loads
          acc = acc_ref[...]
          skipped = jnp.zeros((), jnp.int32)
          for index, (i, j) in enumerate(tiles):
            slot = index % slots
            for t in range(len(tma_gmem)):
              plgpu.barrier_wait(barrier(slot, t))
            grad = acc[i * ek:(i + 1) * ek, j * en:(j + 1) * en]
            values = read_values(slot, i, j)
            state = jax.tree.unflatten(state_treedef, values[1:])
            new_w, new_state, updated = apply_update(
                optimizer, grad, values[0], state, scalars, apply,
                step=step, layer_id=layer_id, indices=global_indices(i, j))
            write_values(slot, i, j, [new_w] + jax.tree.leaves(new_state))
            if index + slots < len(tiles):
              issue_loads(index + slots)  # into this slot, once stored
            # Rows first: Mosaic GPU's layout inference finds no layout for
            # a 2-D -> scalar reduction of the wgmma-layout mask.
            skipped += jnp.sum(jnp.sum(jnp.where(updated, 0.0, 1.0), axis=1)
                               ).astype(jnp.int32)
          # Every thread holds the same sum: all write the same value.
          skipped_gmem[config.compute_wgs * linear + wg] = skipped

      def mma(indices, x_smem, dy_smem, acc_ref):
        dy_half = dy_smem.at[:, pl.ds(wg * tn, tn)]
        # The interpreter's wgmma takes no transposed operand: there x
        # arrives transposed (the GPU tests check the transposed path).
        lhs = x_smem if interpret else plgpu.transpose_ref(x_smem, (1, 0))
        plgpu.wgmma(acc_ref, lhs, dy_half)

        # Issued after this step's wgmma, so the tensor cores work while
        # the previous tile's stores finish reading the slots.
        @pl.when(indices[0] == prefetch_step)
        def _prefetch():
          for index in range(slots):
            issue_loads(index)

        plgpu.wgmma_wait(1)
        return acc_ref

      pipeline(mma, compute_context)(
          x_window(k0),
          dy_gmem.at[:, pl.ds(n_idx * config.cta_tile_n, config.cta_tile_n)],
          allocations=pipeline_allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def _num_ctas(num_tiles: int, config: MosaicConfig, interpret: bool) -> int:
  """``ctas_per_sm`` CTAs per SM (persistent), never more than there are
  tiles. Interpret mode simulates every CTA's threads on the CPU: two CTAs
  keep it quick and still check the persistent loop."""
  if interpret:
    return min(num_tiles, 2)
  sms = (jax.devices()[0].core_count if jax.default_backend() == "gpu"
         else DEFAULT_NUM_SMS)
  return min(num_tiles, sms * config.ctas_per_sm)


def mosaic_update(spec, x, dy, kernel, opt_state, scalars, apply,
                  config: Optional[MosaicConfig] = None,
                  interpret: Optional[bool] = None, *, step=None,
                  offset=None, layer_index=None):
  """Backend entry point: same contract as ``backends.xla_update``."""
  optimizer = spec.optimizer
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if interpret and layer_index is not None:
    # Interpret mode writes separate outputs, not the stacks in place: step
    # the layer's entries and put them back (same values).
    new_kernel, new_state, skipped = mosaic_update(
        spec, x, dy, stacks.layer_entry(kernel, layer_index),
        stacks.layer_entries(opt_state, layer_index), scalars, apply,
        config, interpret, step=step, offset=offset)
    return (stacks.with_layer_entry(kernel, new_kernel, layer_index),
            stacks.with_layer_entries(opt_state, new_state, layer_index),
            skipped)
  config = config or default_config(x, kernel, optimizer)
  check_supported(x, dy, kernel, optimizer, config)
  k, n = kernel.shape[-2:]
  x2 = x.reshape(-1, k)
  dy2 = dy.reshape(-1, n)

  # int8 codes travel as int8 (their float8 container is for jax.grad only).
  kernel_state = quantization.codes_as_int8(opt_state)
  state_leaves, state_treedef = jax.tree.flatten(kernel_state)
  scalar_vector, scalars_treedef = pack_kernel_scalars(
      scalars, apply, step, offset, layer_index)
  kernel_fn = functools.partial(
      _fused_kernel, optimizer=optimizer, state_treedef=state_treedef,
      scalars_treedef=scalars_treedef,
      config=config, layer_id=spec.layer_id, interpret=interpret,
      stacked=layer_index is not None,
      is_scale=tuple([False] + quantization.scale_leaf_mask(kernel_state)))
  storage = [kernel] + state_leaves
  num_tiles = (k // config.tile_k) * (n // config.cta_tile_n)
  skipped_type = jax.ShapeDtypeStruct((config.compute_wgs * num_tiles,),
                                      jnp.int32)
  threads = config.compute_wgs + 1  # + the memory warpgroup
  mesh = plgpu.Mesh(grid=(_num_ctas(num_tiles, config, interpret),),
                    grid_names=("sm",), num_threads=threads, thread_name="wg")
  compiler_params = plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  name = "forge_fused_dense_update_mosaic"
  if interpret:
    # Interpret mode takes no refs: the new values are separate outputs.
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=import-outside-toplevel
    num = len(storage)
    outputs = plgpu.kernel(
        lambda s, x, dy, *refs: kernel_fn(s, x, dy, refs[:num],
                                          refs[num:2 * num], refs[-1]),
        out_type=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in storage]
        + [skipped_type],
        grid=mesh.grid, grid_names=mesh.grid_names, num_threads=threads,
        thread_name="wg", compiler_params=compiler_params,
        interpret=params.InterpretGPUParams(), kernel_name=name,
    )(scalar_vector, x2.T, dy2, *storage)
    new_storage, skipped = outputs[:-1], outputs[-1]
  else:
    # pl.kernel (not plgpu.kernel, whose batching wrapper rejects refs): the
    # refs passed in are aliased in and out, so the update is in place.
    refs = [jax.new_ref(a) for a in storage]
    skipped_ref = jax.new_ref(jnp.zeros(skipped_type.shape, jnp.int32))
    pl.kernel(
        lambda s, x, dy, *refs: kernel_fn(s, x, dy, refs[:-1], refs[:-1],
                                          refs[-1]),
        out_type=(), mesh=mesh, compiler_params=compiler_params, name=name,
    )(scalar_vector, x2, dy2, *refs, skipped_ref)
    new_storage = [r[...] for r in refs]
    skipped = skipped_ref[...]
  new_state = quantization.codes_as_container(
      jax.tree.unflatten(state_treedef, new_storage[1:]))
  return new_storage[0], new_state, jnp.sum(skipped)
