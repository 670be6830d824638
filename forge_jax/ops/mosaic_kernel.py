"""Pallas kernel (Mosaic GPU, Hopper): wgmma dW tiles with the update fused.

A persistent kernel (one CTA per SM) walks the kernel's ``tile_k x
(compute_wgs * tile_n)`` tiles. In each CTA a memory warpgroup streams ``x``
and ``dy`` blocks into a ring of shared-memory buffers with TMA, the steps
numbered across the CTA's tiles, while the compute warpgroups accumulate
``dW = x.T @ dy`` with wgmma (``x``'s block is the transposed A operand),
each for its ``tile_k x tile_n`` part, in float32 registers. A step's
buffers are released after the next step's ``wgmma_wait(1)`` (the last
step's once the accumulator is read), when the wgmma reading them is known
to be done. Each compute warpgroup's epilogue then walks its part in
``epilogue_k x epilogue_n`` sub-tiles: TMA loads of the kernel and state
sub-tiles, the optimizer rule in registers
(:func:`forge_jax.ops.update.apply_update`, the function the XLA reference
applies to the whole array), and TMA stores of the new values over the old
ones. The loads of the first ``epilogue_slots`` sub-tiles are issued during
the main loop, right after the wgmma of pipeline step ``prefetch_step``, so
the epilogue finds them waiting. Later sub-tiles reuse the slots, their
loads issued as soon as a slot's store has read it; the stores are
asynchronous and drain under the next tile's main loop. This is the
``'inline'`` schedule (:class:`MosaicConfig`); the default config is the
first of :func:`ranked_configs` that fits. ``dW`` never reaches device
memory.

With ``schedule='pingpong'`` a CTA tile belongs to one compute warpgroup
and the two take the CTA's tiles in turn: one updates its tile while the
other's wgmma run (a step's loads arrive on its owner's barrier). A loader
warpgroup keeps each compute warpgroup's ring of epilogue buffers full,
running ahead into its next tile. On the H200 it is faster than the inline
schedule from 2048 tokens (bf16 storage), slower at 512 (benchmarks/
NOTES.md, session 5), so :func:`ranked_configs` puts it first from there.

The kernel runs without Mosaic GPU's automatic warpgroup barriers
(``unsafe_no_auto_barriers``): every barrier it needs is explicit.

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
#: Mosaic GPU tracks a group of barriers' phases in one 32-bit register.
MAX_BARRIERS = 32
#: Streaming multiprocessors of an H100/H200 (the persistent grid's size when
#: no GPU is present, i.e. interpret mode and cross-lowering).
DEFAULT_NUM_SMS = 132


#: How a CTA's warpgroups share a tile's main loop and its epilogue.
SCHEDULES = ("inline", "pingpong")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tile shapes and schedule of the Mosaic GPU kernel.

  Each compute warpgroup accumulates a ``tile_k x tile_n`` part of dW,
  streaming ``tile_t`` tokens per pipeline step, ``max_concurrent_steps``
  steps in flight. The epilogue works on ``epilogue_k x epilogue_n``
  sub-tiles of each part, with ``epilogue_slots`` buffers per warpgroup,
  whose loads are issued at pipeline step ``prefetch_step`` of the main loop
  (the last step if the loop is shorter); with as many slots as sub-tiles
  the whole part's kernel and state are loaded under the main loop.

  ``schedule``:

  - ``'inline'``: the compute warpgroups share a CTA tile of ``tile_k x
    (compute_wgs * tile_n)`` and each updates its part right after the
    tile's main loop. ``ctas_per_sm`` persistent CTAs share an SM (2: one's
    epilogue overlaps the other's main loop, if both fit).
  - ``'pingpong'``: a CTA tile is one warpgroup's ``tile_k x tile_n``; the
    compute warpgroups take the CTA's tiles in turn, so one updates its tile
    while the other's wgmma run. A loader warpgroup fills each one's ring of
    ``epilogue_slots`` buffers ahead, across its tiles (``prefetch_step``
    does not apply).
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
  schedule: str = "inline"

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
    if self.ctas_per_sm not in (1, 2):
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule={self.schedule!r} must be one of "
                       f"{SCHEDULES}")
    if self.compute_wgs not in (1, 2):
      raise ValueError(f"compute_wgs={self.compute_wgs} must be 1 or 2")
    if self.parts_per_tile > 1 and self.tile_n < 64:
      raise ValueError(
          f"tile_n={self.tile_n} must be at least 64 when "
          f"{self.parts_per_tile} compute warpgroups share a tile: each "
          "takes its columns of dy's block, whose 128-byte swizzle tiles are "
          "64 columns wide")
    if self.schedule != "inline" and self.ctas_per_sm != 1:
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 with "
                       f"schedule={self.schedule!r} (its warpgroups take the "
                       "SM's registers)")
    if self.schedule != "inline" and self.prefetch_step:
      raise ValueError(f"prefetch_step={self.prefetch_step} does not apply "
                       f"with schedule={self.schedule!r}")
    if not 1 <= self.epilogue_slots <= self.epilogue_subtiles:
      raise ValueError(
          f"epilogue_slots={self.epilogue_slots} must be between 1 and the "
          f"{self.epilogue_subtiles} epilogue sub-tiles of a warpgroup's part")
    if self.schedule == "pingpong":
      compute = accumulator_registers(self)
      available = compute_warpgroup_registers(self)
      if compute > available:
        raise ValueError(
            f"the {self.tile_k} x {self.tile_n} accumulator and the update "
            f"take {compute} registers a thread, more than the {available} "
            f"of each of {self.compute_wgs} compute warpgroups "
            "(schedule='pingpong')")
    if self.prefetch_step < 0:
      raise ValueError(f"prefetch_step={self.prefetch_step} must be >= 0")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} "
                       "must be at least 2")

  @property
  def parts_per_tile(self) -> int:
    """Compute warpgroups sharing a CTA tile (each has a part)."""
    return 1 if self.schedule == "pingpong" else self.compute_wgs

  @property
  def cta_tile_n(self) -> int:
    return self.parts_per_tile * self.tile_n

  @property
  def epilogue_subtiles(self) -> int:
    """Sub-tiles of one warpgroup's ``tile_k x tile_n`` part."""
    return (self.tile_k // self.epilogue_k) * (self.tile_n // self.epilogue_n)

  @property
  def num_warpgroups(self) -> int:
    """Compute warpgroups, the memory warpgroup, and pingpong's loader."""
    return self.compute_wgs + 1 + (self.schedule == "pingpong")


#: Registers a thread of the memory warpgroup keeps (it only issues TMA).
MEMORY_REGISTERS = 40
#: The most a thread may keep after setmaxnreg (as in JAX's Hopper attention
#: kernel).
MAX_REGISTERS = 232
#: The SM's 64K registers, counted in registers per thread of one warpgroup
#: (128 threads); at launch every warpgroup has an equal share.
_REGISTER_FILE = 512


def launch_registers(config: MosaicConfig) -> int:
  """Per-thread registers every warpgroup has at launch: the register file
  split over the CTA's warpgroups, in the hardware's units of 8."""
  return _REGISTER_FILE // config.num_warpgroups // 8 * 8


def _released_registers(config: MosaicConfig, launch: int) -> int:
  """What the warpgroups that only issue TMA (the memory warpgroup, and
  pingpong's loader) give back going down to ``MEMORY_REGISTERS`` from
  ``launch``: setmaxnreg raises a warpgroup's count only from registers the
  CTA's other warpgroups released, and waits until there are enough."""
  memory_wgs = 1 + (config.schedule == "pingpong")
  return memory_wgs * (launch - MEMORY_REGISTERS)


def accumulator_registers(config: MosaicConfig) -> int:
  """Per-thread registers a compute warpgroup needs: its float32
  accumulator and 64 more (setmaxnreg takes multiples of 8)."""
  accumulator = config.tile_k * config.tile_n // 128
  return -(-(accumulator + 64) // 8) * 8


def compute_warpgroup_registers(config: MosaicConfig) -> int:
  """Per-thread registers of a compute warpgroup of the inline and pingpong
  schedules, at most ``MAX_REGISTERS`` (multiples of 8: setmaxnreg): its
  launch count and an even share of what the memory warpgroups release.
  (Splitting the register file minus the memory warpgroups' part instead
  overdraws that pool when the warpgroups do not divide the file evenly,
  and the last setmaxnreg waits forever.) With
  ``ctas_per_sm`` CTAs a CTA has its share of the file."""
  launch = (_REGISTER_FILE // config.ctas_per_sm // config.num_warpgroups
            // 8 * 8)
  released = _released_registers(config, launch)
  return min(MAX_REGISTERS,
             (launch + released // config.compute_wgs) // 8 * 8)


def epilogue_buffers(config: MosaicConfig) -> int:
  """A CTA's epilogue buffers: ``epilogue_slots`` per compute warpgroup."""
  return config.epilogue_slots * config.compute_wgs


def shared_memory_bytes(config: MosaicConfig, activation_itemsize: int,
                        storage_itemsizes) -> int:
  """A CTA's pipeline buffers + its epilogue buffers."""
  pipeline = (config.max_concurrent_steps * config.tile_t
              * (config.tile_k + config.cta_tile_n) * activation_itemsize)
  epilogue = (epilogue_buffers(config) * config.epilogue_k * config.epilogue_n
              * sum(storage_itemsizes))
  return pipeline + epilogue


#: Defaults, fastest first: the first whose buffers fit in shared memory and
#: whose tiles divide the shape. H200, AdamW, bf16 storage, 4096 x 14336
#: (benchmarks/NOTES.md, session 4): a five-stage pipeline was fastest at
#: 512, 2048 and 8192 tokens alike (a step's buffers are released one step
#: late, once the wgmma reading them is done, so five stages keep four in
#: flight). float32 W, m, v or int8 states fit one epilogue buffer per
#: warpgroup beside it; optimizers with four float32 state tensors a
#: shallower pipeline. Re-measured on the kernel's own pipeline (session 6,
#: main loop carrying its slot): five stages 0.318 / 0.545 / 1.533 ms at
#: 512 / 2048 / 8192 tokens, four 0.343 / 0.591 / 1.679.
INLINE_CONFIGS = (
    MosaicConfig(max_concurrent_steps=5),
    MosaicConfig(max_concurrent_steps=5, epilogue_slots=1),
    MosaicConfig(max_concurrent_steps=4, epilogue_slots=1),
    MosaicConfig(max_concurrent_steps=3, epilogue_slots=1),
    MosaicConfig(max_concurrent_steps=2, epilogue_slots=1),
)
#: Ranked first from ``PINGPONG_MIN_TOKENS`` tokens, where they fit. Same
#: shape, session 6: 0.525 ms against the inline 0.545 at 2048 tokens, 1.500
#: against 1.533 at 8192 (five stages, two buffers: 1.448 in session 5); at
#: 512 tokens the inline schedule is faster (0.318 against 0.417). Not
#: measured with float32 W, m, v, which fit only one epilogue buffer per
#: warpgroup beside them, nor with int8 states: those keep the inline
#: ranking.
PINGPONG_CONFIGS = (
    MosaicConfig(schedule="pingpong", tile_n=128, max_concurrent_steps=4,
                 epilogue_slots=3),
    MosaicConfig(schedule="pingpong", tile_n=128, max_concurrent_steps=5,
                 epilogue_slots=2),
)
PINGPONG_MIN_TOKENS = 2048
def ranked_configs(tokens: int, quantized: bool = False) -> tuple:
  """The default configs for a call with ``tokens`` rows of x, fastest
  first."""
  if tokens >= PINGPONG_MIN_TOKENS and not quantized:
    return PINGPONG_CONFIGS + INLINE_CONFIGS
  return INLINE_CONFIGS


def _storage_itemsizes(kernel, state) -> list:
  """Bytes per element of the kernel and of each state leaf that passes
  through shared memory (all but int8 block scales)."""
  is_scale = [False] + quantization.scale_leaf_mask(state)
  return [jnp.dtype(leaf.dtype).itemsize
          for leaf, scale in zip([kernel] + jax.tree.leaves(state), is_scale)
          if not scale]


def _fitting_config(tokens, k, n, activation_itemsize, storage_itemsizes,
                    quantized: bool) -> MosaicConfig:
  """The first ranked config whose tiles divide the shape and whose buffers
  fit in shared memory (else the last: unsupported_reason says why). With
  int8 states an epilogue sub-tile is one quantization block wide."""
  configs = ranked_configs(tokens, quantized)
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
  state = stacks.layer_state_shapes(kernel, optimizer)
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
  state = stacks.layer_state_shapes(kernel, optimizer)
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
  barriers = epilogue_buffers(config) * len(itemsizes)
  if barriers > MAX_BARRIERS:
    return (f"{config} loads {len(itemsizes)} leaves into each of "
            f"{epilogue_buffers(config)} epilogue buffers: {barriers} "
            f"barriers, more than Mosaic GPU's {MAX_BARRIERS} per group")
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


class _Epilogue:
  """The update of ``epilogue_k x epilogue_n`` sub-tiles, shared by the
  schedules: TMA loads of the kernel
  and state windows into a shared-memory buffer, the rule in registers, the
  new values stored back in place.

  Buffers are indexed by ``buffer``; each has one load barrier per leaf that
  goes through shared memory (int8 block scales do not: their sub-tile's
  column is 4 bytes a row, below TMA's minimum, so they are read and
  written in global memory, as a ``[epilogue_k]`` vector).
  """

  def __init__(self, *, storage_gmem, storage_out, is_scale, smem, barriers,
               layer, rule, stochastic, shard_origin, config, interpret):
    self.storage_gmem, self.storage_out = storage_gmem, storage_out
    self.is_scale, self.smem, self.barriers = is_scale, smem, barriers
    self.tma_gmem = [r for r, scale in zip(storage_gmem, is_scale) if not scale]
    self.tma_out = [r for r, scale in zip(storage_out, is_scale) if not scale]
    self.layer, self.rule, self.stochastic = layer, rule, stochastic
    self.shard_origin, self.interpret = shard_origin, interpret
    self.ek, self.en = config.epilogue_k, config.epilogue_n

  def _window(self, ref, k0, n0):
    return ref.at[(*self.layer, pl.ds(k0, self.ek), pl.ds(n0, self.en))]

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
    for leaf, (gmem, smem) in enumerate(zip(self.tma_gmem, self.smem)):
      plgpu.copy_gmem_to_smem(self._window(gmem, k0, n0), smem.at[buffer],
                              self._barrier(buffer, leaf))

  def _indices(self, k0, n0, shape):
    """Stochastic rounding's global (rows, cols) of the sub-tile at ``(k0,
    n0)`` of ``shape``."""
    if not self.stochastic:
      return None
    row0, col0 = self.shard_origin
    return (row0 + k0 + lax.broadcasted_iota(jnp.int32, shape, 0),
            col0 + n0 + lax.broadcasted_iota(jnp.int32, shape, 1))

  def _read_scales(self, gmem, k0, n0):
    if self.interpret:  # the interpreter has no plgpu.load
      return gmem[self._scale_index(k0, n0)]
    # A strided column: no optimized (vectorized) load exists.
    return plgpu.load(gmem, self._scale_index(k0, n0), optimized=False)

  def apply(self, grad, values, k0, n0):
    """The rule on the sub-tile at ``(k0, n0)``, of ``grad``'s shape: the
    new values and each row's count of skipped (non-finite) elements (a
    vector, summed within warps only: see :func:`skipped_rows_shape`)."""
    new_values, updated = self.rule(grad, values,
                                    self._indices(k0, n0, grad.shape))
    return new_values, jnp.sum(jnp.where(updated, 0.0, 1.0), axis=1)

  def update(self, buffer, k0, n0, grad, release=None):
    """Waits for ``buffer``'s loads, applies the rule with ``grad`` and
    stores the new values (asynchronously). ``release()``, if given, runs
    once the TMA stores have read the buffer, which may then be refilled.
    Returns each row's skipped count (:meth:`apply`)."""
    for leaf in range(len(self.tma_gmem)):
      plgpu.barrier_wait(self._barrier(buffer, leaf))
    smem_values = iter(smem[buffer] for smem in self.smem)
    values = [self._read_scales(gmem, k0, n0) if scale else next(smem_values)
              for gmem, scale in zip(self.storage_gmem, self.is_scale)]
    new_values, skipped = self.apply(grad, values, k0, n0)
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
    for gmem, smem in zip(self.tma_out, self.smem):
      plgpu.copy_smem_to_gmem(smem.at[buffer], self._window(gmem, k0, n0))
    if release is not None:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      release()
    return skipped


def skipped_rows_shape(config: MosaicConfig, num_tiles: int) -> tuple:
  """The kernel's skipped-element counts: for each tile, each warpgroup that
  updates part of it writes one vector of per-row counts, summed over its
  sub-tiles (float32, exact: an entry counts at most a tile's elements);
  the caller sums them.

  The kernel sums no count across warps: Mosaic GPU's cross-warp reduction
  uses one shared-memory scratch at the same offset for every warpgroup, so
  two warpgroups reducing at once (the compute warpgroups of either
  schedule) could read each other's partial sums."""
  return (config.parts_per_tile * num_tiles, config.epilogue_k)


def _fused_kernel(scalars_gmem, x_gmem, dy_gmem, storage_gmem, storage_out,
                  skipped_gmem, *, optimizer, state_treedef, scalars_treedef,
                  config: MosaicConfig, layer_id, interpret, stacked,
                  is_scale):
  """``storage_gmem`` (kernel, *state leaves) are read; ``storage_out`` written
  (on the GPU the same refs: in place). ``scalars_gmem`` is
  :func:`forge_jax.ops.update.pack_kernel_scalars`'s vector (``stacked``:
  the refs are ``[L, K, N]`` stacks, stepped at its layer index).
  ``skipped_gmem[parts_per_tile * tile + part]`` has the per-row
  skipped counts of each tile's updating warpgroups
  (:func:`skipped_rows_shape`)."""
  # x is [tokens, k]; in interpret mode it arrives transposed, [k, tokens].
  tokens, k = x_gmem.shape[::-1] if interpret else x_gmem.shape
  n = dy_gmem.shape[1]
  tk, tn, tt = config.tile_k, config.tile_n, config.tile_t
  ek, en = config.epilogue_k, config.epilogue_n
  cta_tn = config.cta_tile_n
  k_iters, n_iters = k // tk, n // cta_tn
  num_tiles, num_steps = k_iters * n_iters, tokens // tt
  # x's block of the tile at k0, pipeline step t (transposed in interpret mode).
  if interpret:
    x_block = (tk, tt)
    x_window = lambda k0, t: x_gmem.at[pl.ds(k0, tk), pl.ds(t * tt, tt)]
  else:
    x_block = (tt, tk)
    x_window = lambda k0, t: x_gmem.at[pl.ds(t * tt, tt), pl.ds(k0, tk)]
  x_transforms = _swizzled(x_block[1], x_gmem.dtype)
  dy_transforms = _swizzled(cta_tn, dy_gmem.dtype)
  tma_refs = [ref for ref, scale in zip(storage_gmem, is_scale) if not scale]
  # Sub-tiles of one warpgroup's tile_k x tile_n part, in order.
  part_subtiles = [(i * ek, j * en) for i in range(tk // ek)
                   for j in range(tn // en)]

  def tile_origin(linear):
    k_idx, n_idx = plgpu.planar_snake(linear, (k_iters, n_iters), 1,
                                      config.grid_tile_width)
    return k_idx * tk, n_idx * cta_tn

  def wgmma(acc_ref, x_smem, dy_smem, part):
    # The interpreter's wgmma takes no transposed operand: there x arrives
    # transposed (the GPU tests check the transposed path).
    lhs = x_smem if interpret else x_smem.transpose((1, 0))
    plgpu.wgmma(acc_ref, lhs, dy_smem.at[:, pl.ds(part * tn, tn)])

  def epilogue(smem, barriers):
    scalars, apply, step, shard_row, shard_col, layer_index = (
        read_kernel_scalars(scalars_gmem, scalars_treedef))

    def rule(grad, values, indices):
      state = jax.tree.unflatten(state_treedef, values[1:])
      new_w, new_state, updated = apply_update(
          optimizer, grad, values[0], state, scalars, apply, step=step,
          layer_id=layer_id, indices=indices)
      return [new_w] + jax.tree.leaves(new_state), updated

    return _Epilogue(
        storage_gmem=storage_gmem, storage_out=storage_out, is_scale=is_scale,
        smem=smem, barriers=barriers,
        layer=(layer_index,) if stacked else (), rule=rule,
        stochastic=(optimizer.weight_rounding == "stochastic"
                    and storage_gmem[0].dtype == jnp.bfloat16),
        shard_origin=(shard_row, shard_col), config=config,
        interpret=interpret)

  def epilogue_allocations():
    num_buffers = epilogue_buffers(config)
    return dict(
        epilogue_smem=[plgpu.SMEM((num_buffers, ek, en), ref.dtype,
                                  transforms=_swizzled(en, ref.dtype))
                       for ref in tma_refs],
        # One barrier per (buffer, leaf): each TMA load arrives once.
        load_barriers=plgpu.Barrier(num_barriers=num_buffers * len(tma_refs)))

  slots = config.epilogue_slots

  def ring_buffers(stages):
    """The x and dy blocks of a ring of ``stages`` pipeline steps."""
    return dict(
        x_smem=plgpu.SMEM((stages, *x_block), x_gmem.dtype,
                          transforms=x_transforms),
        dy_smem=plgpu.SMEM((stages, tt, cta_tn), dy_gmem.dtype,
                           transforms=dy_transforms))

  def take_registers(registers):
    """Raises a compute warpgroup's registers (setmaxnreg) when ``registers``
    is more than its share at launch."""
    if registers > launch_registers(config):
      plgpu.set_max_registers(registers, action="increase")

  def local_tiles():
    """This CTA's tiles (the grid has no more CTAs than tiles)."""
    first_tile, num_ctas = lax.axis_index("sm"), lax.axis_size("sm")
    return (num_tiles - first_tile + num_ctas - 1) // num_ctas

  def stream_tiles(x_smem, dy_smem, ready, consumed, stages):
    """The memory warpgroup (every schedule): loads x and dy blocks of the
    CTA's tiles into a ring of ``stages`` buffers, the steps numbered across
    tiles so the ring runs on into the next tile. A step's loads arrive on
    ``ready(local_tile, slot)``; a slot is refilled once ``consumed`` says
    its last step is done."""
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    @plgpu.nd_loop((num_tiles,), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      k0, cta_n0 = tile_origin(loop_info.index[0])

      @pl.loop(0, num_steps)
      def _step(t):
        count = loop_info.local_index * num_steps + t
        slot = lax.rem(count, stages)

        @pl.when(count >= stages)
        def _wait_consumed():
          plgpu.barrier_wait(consumed.at[slot])

        barrier = ready(loop_info.local_index, slot)
        plgpu.copy_gmem_to_smem(x_window(k0, t), x_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(
            dy_gmem.at[pl.ds(t * tt, tt), pl.ds(cta_n0, cta_tn)],
            dy_smem.at[slot], barrier)

    # Observe the last steps' releases too, leaving the barriers clean.
    total = local_tiles() * num_steps

    @pl.loop(lax.max(total - stages, 0), total)
    def _drain(count):
      plgpu.barrier_wait(consumed.at[lax.rem(count, stages)])

  def main_loop(acc_ref, x_smem, dy_smem, ready, consumed, stages, first,
                part, after_wgmma=lambda t: None):
    """Accumulates one tile from the ring of ``stages`` buffers (steps
    ``first + t``, loads arriving on ``ready(slot)``) and returns the
    accumulator. A step's buffers are released after the next step's
    ``wgmma_wait(1)``, which proves its wgmma done.

    The slot is carried from step to step: recomputing ``(first + t) %
    stages`` each step (a multiply-shift division for 5 stages) put integer
    arithmetic between the wgmma of a warpgroup that issues them all
    (benchmarks/NOTES.md, session 6)."""

    def step(t, carry):
      acc_ref, slot, previous = carry
      plgpu.barrier_wait(ready(slot))
      wgmma(acc_ref, x_smem.at[slot], dy_smem.at[slot], part)
      after_wgmma(t)
      plgpu.wgmma_wait(1)

      @pl.when(t > 0)
      def _release():
        plgpu.barrier_arrive(consumed.at[previous])

      following = slot + 1
      return acc_ref, lax.select(following == stages, 0, following), slot

    first_slot = lax.rem(first, stages)
    _, _, last = lax.fori_loop(0, num_steps, step,
                               (acc_ref, first_slot, first_slot))
    acc = acc_ref[...]  # waits for the last wgmma
    plgpu.barrier_arrive(consumed.at[last])
    return acc

  def inline_schedule():
    """The compute warpgroups share each tile's x and dy blocks, each
    accumulating its part, and update their parts right after the tile's
    main loop while the memory warpgroup's ring runs on into the next
    tile."""
    stages, wgs = config.max_concurrent_steps, config.compute_wgs
    compute_registers = compute_warpgroup_registers(config)
    prefetch_step = min(config.prefetch_step, num_steps - 1)

    def load_subtile(ep, wg, index, k0, n0, after_stores=True):
      """Loads sub-tile ``index`` of the part at ``(k0, n0)`` into one of
      warpgroup ``wg``'s ``slots`` buffers."""
      di, dj = part_subtiles[index]
      ep.issue_loads(wg * slots + index % slots, k0 + di, n0 + dj,
                     after_stores)

    def update_part(ep, wg, k0, n0, acc):
      """Updates the part at ``(k0, n0)`` with its accumulated ``acc``,
      sub-tile by sub-tile through warpgroup ``wg``'s buffers, whose first
      loads were issued under the main loop; each buffer, once released,
      takes the sub-tile ``slots`` on. Returns the per-row skipped counts."""
      skipped = jnp.zeros((ek,), jnp.float32)
      for index, (di, dj) in enumerate(part_subtiles):
        following = index + slots
        release = (functools.partial(load_subtile, ep, wg, following, k0, n0,
                                     after_stores=False)
                   if following < len(part_subtiles) else None)
        skipped += ep.update(wg * slots + index % slots, k0 + di, n0 + dj,
                             acc[di:di + ek, dj:dj + en], release)
      return skipped

    @functools.partial(
        pl.run_scoped,
        **ring_buffers(stages),
        loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        **epilogue_allocations(),
        collective_axes="wg",
    )
    def _scope(x_smem, dy_smem, loaded, consumed, epilogue_smem,
               load_barriers):
      wg = lax.axis_index("wg")

      @pl.when(wg == wgs)
      def _memory():
        stream_tiles(x_smem, dy_smem, lambda _, slot: loaded.at[slot],
                     consumed, stages)

      @pl.when(wg < wgs)
      def _compute():
        take_registers(compute_registers)
        ep = epilogue(epilogue_smem, load_barriers)

        @plgpu.nd_loop((num_tiles,), collective_axes="sm")
        def _tile_loop(loop_info: plgpu.NDLoopInfo):
          (linear,) = loop_info.index
          k0, cta_n0 = tile_origin(linear)
          n0 = cta_n0 + wg * tn

          def prefetch(t):
            # After this step's wgmma: the tensor cores work while the
            # previous tile's stores finish reading the buffers.
            @pl.when(t == prefetch_step)
            def _prefetch():
              for index in range(slots):
                load_subtile(ep, wg, index, k0, n0)

          @functools.partial(pl.run_scoped,
                             acc_ref=plgpu.ACC((tk, tn), jnp.float32))
          def _acc_scope(acc_ref):
            acc = main_loop(acc_ref, x_smem, dy_smem,
                            lambda slot: loaded.at[slot], consumed, stages,
                            loop_info.local_index * num_steps, wg, prefetch)
            skipped_gmem[wgs * linear + wg] = update_part(ep, wg, k0, n0, acc)

  def pingpong_schedule():
    """A memory warpgroup streams x and dy for the CTA's tiles in order; the
    compute warpgroups take the tiles in turn, each running its own main
    loop and epilogue, so one updates its tile while the other's wgmma keep
    the tensor cores busy. A loader warpgroup fills each compute
    warpgroup's ring of ``slots`` epilogue buffers with its tiles' kernel
    and state sub-tiles, numbered across tiles, as soon as a buffer's
    stores have read it: the loads run ahead of the updates, into the next
    tile's, instead of waiting for them."""
    stages, wgs = config.max_concurrent_steps, config.compute_wgs
    memory_wg, loader_wg = wgs, wgs + 1
    compute_registers = compute_warpgroup_registers(config)
    per_tile = len(part_subtiles)

    @functools.partial(
        pl.run_scoped,
        **ring_buffers(stages),
        # One barrier per (owner, slot): a thread tracks a barrier's phase by
        # waiting on every phase of it, so a warpgroup's barriers must not
        # complete for the other's steps.
        loaded=plgpu.Barrier(num_arrivals=2, num_barriers=wgs * stages),
        consumed=plgpu.Barrier(num_barriers=stages),
        buffer_free=plgpu.Barrier(num_barriers=wgs * slots),
        **epilogue_allocations(),
        collective_axes="wg",
    )
    def _scope(x_smem, dy_smem, loaded, consumed, buffer_free, epilogue_smem,
               load_barriers):
      wg = lax.axis_index("wg")
      owner = lambda local_tile: lax.rem(local_tile, wgs)

      def buffer(local_tile, index):
        """Sub-tile ``index`` of a local tile: its epilogue buffer (in its
        owner's ring) and its position in the owner's sequence."""
        position = local_tile // wgs * per_tile + index
        return owner(local_tile) * slots + lax.rem(position, slots), position

      @pl.when(wg == memory_wg)
      def _memory():
        stream_tiles(
            x_smem, dy_smem,
            lambda local_tile, slot: loaded.at[owner(local_tile) * stages
                                               + slot],
            consumed, stages)

      @pl.when(wg == loader_wg)
      def _loader():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        ep = epilogue(epilogue_smem, load_barriers)

        @plgpu.nd_loop((num_tiles,), collective_axes="sm")
        def _tile_loop(loop_info: plgpu.NDLoopInfo):
          k0, n0 = tile_origin(loop_info.index[0])
          for index, (di, dj) in enumerate(part_subtiles):
            buf, position = buffer(loop_info.local_index, index)

            @pl.when(position >= slots)
            def _wait_free():
              plgpu.barrier_wait(buffer_free.at[buf])

            ep.issue_loads(buf, k0 + di, n0 + dj, after_stores=False)

        # Observe the last buffers' releases too, leaving the barriers clean.
        for owner_wg in range(wgs):
          total = (local_tiles() - owner_wg + wgs - 1) // wgs * per_tile

          @pl.loop(lax.max(total - slots, 0), total)
          def _drain(position):
            plgpu.barrier_wait(
                buffer_free.at[owner_wg * slots + lax.rem(position, slots)])

      @pl.when(wg < wgs)
      def _compute():
        take_registers(compute_registers)
        ep = epilogue(epilogue_smem, load_barriers)

        @plgpu.nd_loop((num_tiles,), collective_axes="sm")
        def _tile_loop(loop_info: plgpu.NDLoopInfo):
          @pl.when(owner(loop_info.local_index) == wg)
          def _own_tile():
            (linear,) = loop_info.index
            k0, n0 = tile_origin(linear)

            @functools.partial(pl.run_scoped,
                               acc_ref=plgpu.ACC((tk, tn), jnp.float32))
            def _acc_scope(acc_ref):
              acc = main_loop(
                  acc_ref, x_smem, dy_smem,
                  lambda slot: loaded.at[wg * stages + slot], consumed,
                  stages, loop_info.local_index * num_steps, 0)
              skipped = jnp.zeros((ek,), jnp.float32)
              for index, (di, dj) in enumerate(part_subtiles):
                buf, _ = buffer(loop_info.local_index, index)
                skipped += ep.update(
                    buf, k0 + di, n0 + dj, acc[di:di + ek, dj:dj + en],
                    functools.partial(plgpu.barrier_arrive,
                                      buffer_free.at[buf]))
              skipped_gmem[linear] = skipped

  {"inline": inline_schedule,
   "pingpong": pingpong_schedule}[config.schedule]()
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
  skipped_type = jax.ShapeDtypeStruct(skipped_rows_shape(config, num_tiles),
                                      jnp.float32)
  threads = config.num_warpgroups
  mesh = plgpu.Mesh(grid=(_num_ctas(num_tiles, config, interpret),),
                    grid_names=("sm",), num_threads=threads, thread_name="wg")
  # Without Mosaic GPU's automatic warpgroup barriers around every smem
  # store and before every TMA load (13 a sub-tile in the epilogue, where
  # the rule's four warps should run apart): a warp reads and writes only
  # its own rows of an epilogue buffer, buffers are refilled or freed only
  # after commit_smem's barrier or a per-thread barrier arrival, and every
  # cross-warpgroup hand-off is a barrier all threads arrive on.
  compiler_params = plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
      unsafe_no_auto_barriers=True)
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
    skipped_ref = jax.new_ref(jnp.zeros(skipped_type.shape, jnp.float32))
    pl.kernel(
        lambda s, x, dy, *refs: kernel_fn(s, x, dy, refs[:-1], refs[:-1],
                                          refs[-1]),
        out_type=(), mesh=mesh, compiler_params=compiler_params, name=name,
    )(scalar_vector, x2, dy2, *refs, skipped_ref)
    new_storage = [r[...] for r in refs]
    skipped = skipped_ref[...]
  new_state = quantization.codes_as_container(
      jax.tree.unflatten(state_treedef, new_storage[1:]))
  return new_storage[0], new_state, jnp.sum(skipped.astype(jnp.int32))
