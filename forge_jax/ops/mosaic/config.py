"""Tile shapes and schedules of the Mosaic GPU kernel, what they cost, and
the default configs.

:class:`MosaicConfig` checks that a config can run; the functions below give
its registers per thread (setmaxnreg) and its shared memory per CTA, and
:func:`default_config` picks the first of :func:`ranked_configs` whose tiles
divide a call's shape and whose buffers fit.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from forge_jax import quantization
from forge_jax.ops import stacks

#: Streaming multiprocessors of an H100/H200 (the persistent grid's size when
#: no GPU is present, i.e. interpret mode and cross-lowering).
DEFAULT_NUM_SMS = 132


def num_sms() -> int:
  """The GPU's streaming multiprocessors; off a GPU, DEFAULT_NUM_SMS."""
  if jax.default_backend() == "gpu":
    return jax.devices()[0].core_count
  return DEFAULT_NUM_SMS


#: The persistent grid has ``min(tiles, SMs)`` CTAs and each walks every
#: token of its tiles, so a call with few ``K x N`` tiles leaves SMs idle
#: for its whole token loop, while XLA's GEMM spreads the same work over every
#: SM. One layer's train step on an H200 (bf16, 4096 and 32768 tokens,
#: 256 x 256 to 2048 x 2048): the kernel took 0.99-1.07x the XLA reference's
#: time where ``tokens * SMs / tiles`` was 2112-33792, and 1.11-2.3x where it
#: was 67584 or more. Within 7 % the kernel keeps the call: it holds no
#: float32 ``dW``.
MAX_TOKENS_PER_SM_SHARE = 49152


#: Shared memory a CTA may take (H100/H200: 227 KB), less some for barriers.
SHARED_MEMORY_BUDGET = 220 * 1024
#: Mosaic GPU tracks a group of barriers' phases in one 32-bit register.
MAX_BARRIERS = 32

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
  ``rolled_epilogue`` updates the sub-tiles in a loop (one copy of the
  update's code, the accumulator's sub-tiles rotated through the loop's
  carry) instead of unrolled: a long update, as int8 states', unrolled over
  several sub-tiles misses the instruction cache (``'inline'`` only).

  ``schedule``:

  - ``'inline'`` (:mod:`forge_jax.ops.mosaic.inline`): the compute
    warpgroups share a CTA tile of ``tile_k x (compute_wgs * tile_n)`` and
    each updates its part right after the tile's main loop. ``ctas_per_sm``
    persistent CTAs share an SM (2: one's epilogue overlaps the other's
    main loop, if both fit).
  - ``'pingpong'`` (:mod:`forge_jax.ops.mosaic.pingpong`): a CTA tile is
    one warpgroup's ``tile_k x tile_n``; the compute warpgroups take the
    CTA's tiles in turn, so one updates its tile while the other's wgmma
    run. A loader warpgroup fills each one's ring of ``epilogue_slots``
    buffers ahead, across its tiles (``prefetch_step`` does not apply).
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
  rolled_epilogue: bool = False

  def __post_init__(self):
    for name in ("tile_k", "tile_n", "tile_t", "epilogue_k", "epilogue_n"):
      value = getattr(self, name)
      if value < 8 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 8")
    if self.tile_t % 64:
      raise ValueError(
        f"tile_t={self.tile_t} must be a multiple of 64 "
        "(wgmma's contraction with a transposed operand)"
      )
    if self.tile_k % 64 or self.epilogue_k % 64:
      raise ValueError(
        f"tile_k={self.tile_k} and epilogue_k={self.epilogue_k} "
        "must be multiples of 64 (a warpgroup's wgmma rows)"
      )
    if self.tile_k % self.epilogue_k or self.tile_n % self.epilogue_n:
      raise ValueError(
        f"epilogue_k={self.epilogue_k} and epilogue_n={self.epilogue_n} "
        f"must divide tile_k={self.tile_k} and tile_n={self.tile_n}"
      )
    if self.ctas_per_sm not in (1, 2):
      raise ValueError(f"ctas_per_sm={self.ctas_per_sm} must be 1 or 2")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
    # Four, with 64 x 64 parts in a 64 x 256 CTA tile, measured 1.2-1.3x the
    # default's time on the H200 (bf16 W / m / v, 4096 x 14336, 512 and
    # 2048 tokens); with 128 x 64 parts their registers spill.
    if self.compute_wgs not in (1, 2):
      raise ValueError(f"compute_wgs={self.compute_wgs} must be 1 or 2")
    if self.parts_per_tile > 1 and self.tile_n < 64:
      raise ValueError(
        f"tile_n={self.tile_n} must be at least 64 when "
        f"{self.parts_per_tile} compute warpgroups share a tile: each "
        "takes its columns of dy's block, whose 128-byte swizzle tiles are "
        "64 columns wide"
      )
    if self.schedule != "inline" and self.ctas_per_sm != 1:
      raise ValueError(
        f"ctas_per_sm={self.ctas_per_sm} must be 1 with "
        f"schedule={self.schedule!r} (its warpgroups take the "
        "SM's registers)"
      )
    if self.schedule != "inline" and self.prefetch_step:
      raise ValueError(
        f"prefetch_step={self.prefetch_step} does not apply "
        f"with schedule={self.schedule!r}"
      )
    if not 1 <= self.epilogue_slots <= self.epilogue_subtiles:
      raise ValueError(
        f"epilogue_slots={self.epilogue_slots} must be between 1 and the "
        f"{self.epilogue_subtiles} epilogue sub-tiles of a warpgroup's part"
      )
    if self.schedule == "pingpong":
      compute = accumulator_registers(self)
      available = compute_warpgroup_registers(self)
      if compute > available:
        raise ValueError(
          f"the {self.tile_k} x {self.tile_n} accumulator and the update "
          f"take {compute} registers a thread, more than the {available} "
          f"of each of {self.compute_wgs} compute warpgroups "
          "(schedule='pingpong')"
        )
    if self.rolled_epilogue and self.schedule != "inline":
      raise ValueError(
        f"rolled_epilogue applies to schedule='inline', not {self.schedule!r}"
      )
    if self.prefetch_step < 0:
      raise ValueError(f"prefetch_step={self.prefetch_step} must be >= 0")
    if self.max_concurrent_steps < 2:
      raise ValueError(
        f"max_concurrent_steps={self.max_concurrent_steps} must be at least 2"
      )

  @property
  def parts_per_tile(self) -> int:
    """Compute warpgroups sharing a CTA tile (each has a part)."""
    return 1 if self.schedule == "pingpong" else self.compute_wgs

  @property
  def cta_tile_n(self) -> int:
    return self.parts_per_tile * self.tile_n

  def num_tiles(self, k: int, n: int) -> int:
    """CTA tiles of a ``k x n`` kernel (the persistent grid's work items)."""
    return (k // self.tile_k) * (n // self.cta_tile_n)

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
  and the last setmaxnreg waits forever.) With ``ctas_per_sm`` CTAs a CTA
  has its share of the file."""
  launch = (
    _REGISTER_FILE // config.ctas_per_sm // config.num_warpgroups // 8 * 8
  )
  released = _released_registers(config, launch)
  return min(MAX_REGISTERS, (launch + released // config.compute_wgs) // 8 * 8)


def epilogue_buffers(config: MosaicConfig) -> int:
  """A CTA's epilogue buffers: ``epilogue_slots`` per compute warpgroup."""
  return config.epilogue_slots * config.compute_wgs


def shared_memory_bytes(
  config: MosaicConfig, activation_itemsize: int, storage_itemsizes
) -> int:
  """A CTA's pipeline buffers + its epilogue buffers."""
  pipeline = (
    config.max_concurrent_steps
    * config.tile_t
    * (config.tile_k + config.cta_tile_n)
    * activation_itemsize
  )
  epilogue = (
    epilogue_buffers(config)
    * config.epilogue_k
    * config.epilogue_n
    * sum(storage_itemsizes)
  )
  return pipeline + int(epilogue)


#: Defaults, fastest first: the first whose buffers fit in shared memory and
#: whose tiles divide the shape. On the H200 (AdamW, bf16 storage, 4096 x
#: 14336) a five-stage pipeline is fastest at 512, 2048 and 8192 tokens
#: alike (0.32 / 0.55 / 1.53 ms, four stages 0.34 / 0.59 / 1.68): a step's
#: buffers are released one step late, once the wgmma reading them is done,
#: so five stages keep four in flight. float32 W, m, v or int8 states fit one
#: epilogue buffer per warpgroup beside it; optimizers with four float32
#: state tensors a shallower pipeline. Wider parts (``tile_n=128``, a
#: 128 x 256 CTA tile, 3-4 stages) were 17-48 % slower at 2048 tokens at
#: every 8B shape and tied or lost by up to 9 % at 8192 (an H100), where
#: their main loop alone matches XLA's GEMM but their update takes twice as
#: long; 64 x 64 or 128 x 32 epilogue sub-tiles (one buffer, to
#: fit) 7-21 %; six stages with one epilogue buffer 4-27 % at 512 to 8192
#: tokens.
INLINE_CONFIGS = (
  MosaicConfig(max_concurrent_steps=5),
  MosaicConfig(max_concurrent_steps=5, epilogue_slots=1),
  MosaicConfig(max_concurrent_steps=4, epilogue_slots=1),
  MosaicConfig(max_concurrent_steps=3, epilogue_slots=1),
  MosaicConfig(max_concurrent_steps=2, epilogue_slots=1),
)
#: The pingpong schedule's configs. One warpgroup's update runs under the
#: other's wgmma, which pays off once the token loop is long and each CTA
#: walks many tiles; a tile's update on one warpgroup's four warps cannot
#: hide the rule's latencies otherwise. On the H200 (bf16 storage, one
#: call, ``benchmarks/schedule_speed.py``), 4096 x 14336 at 2048 tokens:
#: AdamW 0.520 against inline's 0.538 ms, Lion, SGD with and without
#: momentum 8-10 % faster; at 8192 tokens 1-2 % faster; at 512 tokens 0.458
#: against 0.303 (AdamW); at 1024 AdamW 3 % slower (the others 10 %
#: faster). With fewer tiles a CTA, at 2048 tokens: 4096 x 1024 (two) AdamW
#: 0.064 against 0.045, 4096 x 4096 (eight) 0.180 against 0.162. The second
#: config is slower than the first at every token count measured.
PINGPONG_CONFIGS = (
  MosaicConfig(
    schedule="pingpong", tile_n=128, max_concurrent_steps=4, epilogue_slots=3
  ),
  MosaicConfig(
    schedule="pingpong", tile_n=128, max_concurrent_steps=5, epilogue_slots=2
  ),
)

#: int8 states: an epilogue sub-tile is one quantization block wide (64
#: columns), and the quantizer's block reductions and stochastic rounding's
#: hash add to the rule's live values. With a 128 x 64 accumulator a thread
#: keeps 168 registers and spills (ncu on the H200, 4096 x 14336, 512
#: tokens, AdamW, bf16 weights with stochastic rounding: 12.3 M local-memory
#: requests, 0.80 instructions a cycle; 2.49 ms). A 64 x 64 accumulator
#: halves those registers: 1.00 ms at 512 tokens and 1.38 ms at 2048
#: (2.49 / 2.75 ms with 128 x 64), faster than the Triton kernel (1.41 /
#: 2.12 ms); one warpgroup per CTA with 232 registers is slower (2.54 /
#: 3.46 ms), and so are the pingpong schedules (2.30 / 2.81 ms). With the
#: current quantizer 128 x 64 parts still take 1.8-2.2x the time: their
#: unrolled update of two sub-tiles misses the instruction cache. With the
#: whole accumulator stashed in shared memory and the sub-tiles updated in a
#: rolled loop they tie at 2048 tokens and are 11 % slower at 512 (the stash
#: takes a pipeline stage). Six or seven stages are no faster.
QUANTIZED_CONFIGS = (
  MosaicConfig(tile_k=64, max_concurrent_steps=5, epilogue_slots=1),
) + INLINE_CONFIGS
#: int8 states whose update draws no random bits, from
#: QUANTIZED_ROLLED_MIN_TOKENS tokens: 128 x 64 parts, as bf16 states have,
#: their two 64 x 64 sub-tiles updated in a rolled loop (one copy of the
#: update's code) through one buffer, five stages. On an H100 (AdamW,
#: ``benchmarks/lowp_breakdown.py``, same bits as the default): at 2048
#: tokens 0.874 against 0.947 ms (4096 x 14336), 0.860 against 0.930
#: (14336 x 4096), 0.256 against 0.281 (4096 x 4096); at 512 tokens a tie
#: (0.590-0.607 against 0.593). With stochastic rounding it is 15-25 %
#: slower at 512 tokens and ties at 2048; four stages with a buffer per
#: sub-tile are slower everywhere.
QUANTIZED_ROLLED_CONFIGS = (
  MosaicConfig(max_concurrent_steps=5, epilogue_slots=1, rolled_epilogue=True),
)
QUANTIZED_ROLLED_MIN_TOKENS = 2048


#: Unquantized calls with at least this many tokens, and at least
#: PINGPONG_MIN_TILES_PER_SM 128 x 128 tiles for every SM, rank the first
#: pingpong config first (it does not fit float32 AdamW or Lion states;
#: those stay inline). Calls with stochastically rounded kernels stay
#: inline: on the H200 (bf16 W / m / v, 2048 tokens, one run) the pingpong
#: schedule took 2.1-2.4x the inline schedule's time with them, AdamW 1.190
#: against 0.570 ms at 4096 x 14336 and 1.147 against 0.552 at
#: 14336 x 4096, NAdam and RAdam alike (not profiled).
PINGPONG_MIN_TOKENS = 2048
PINGPONG_MIN_TILES_PER_SM = 16
#: A light update (at most LIGHT_UPDATE_BYTES of kernel and state a
#: parameter: a bf16 kernel with one bf16 state, as Lion's or SGD's with
#: momentum, or none) leaves one warpgroup's epilogue short enough to hide
#: under the other's wgmma with shorter token loops and fewer tiles. On the
#: H200 (bf16, one call, ``benchmarks/schedule_speed.py``), Lion, SGD with
#: and without momentum, RMSprop and AdaGrad at 1024 tokens: pingpong 9-12 %
#: faster at 4096 x 14336 and 14336 x 4096, 2-8 % at 4096 x 4096 (eight
#: tiles an SM); at 512 tokens 3 % faster to 6 % slower; at 4096 x 1024 (two
#: tiles an SM) up to 11 % slower. AdamW (6 bytes) at 1024 tokens: 3-4 %
#: slower, 25 % at 4096 x 4096. A float32 kernel without state (4 bytes)
#: counts as light too; it was not timed on its own.
LIGHT_UPDATE_BYTES = 4
LIGHT_PINGPONG_MIN_TOKENS = 1024
LIGHT_PINGPONG_MIN_TILES_PER_SM = 4


def ranked_configs(
  tokens: int,
  quantized: bool = False,
  tiles: int = 0,
  update_bytes: int | None = None,
  stochastic_rounding: bool = False,
) -> tuple:
  """The default configs for a call with ``tokens`` rows of x whose dW
  holds ``tiles`` 128 x 128 tiles (the pingpong config's) and whose update
  moves ``update_bytes`` of kernel and state a parameter through shared
  memory (None: not known, ranked as a heavy update), and whose update
  rounds stochastically (its kernel, or 4-bit levels) or not, fastest
  first (before :func:`fitting_config` makes int8 sub-tiles a block
  wide)."""
  if quantized:
    if not stochastic_rounding and tokens >= QUANTIZED_ROLLED_MIN_TOKENS:
      return QUANTIZED_ROLLED_CONFIGS + QUANTIZED_CONFIGS
    return QUANTIZED_CONFIGS
  if stochastic_rounding:
    return INLINE_CONFIGS
  light = update_bytes is not None and update_bytes <= LIGHT_UPDATE_BYTES
  min_tokens, min_tiles_per_sm = (
    (LIGHT_PINGPONG_MIN_TOKENS, LIGHT_PINGPONG_MIN_TILES_PER_SM)
    if light
    else (PINGPONG_MIN_TOKENS, PINGPONG_MIN_TILES_PER_SM)
  )
  if tokens >= min_tokens and tiles >= min_tiles_per_sm * num_sms():
    return PINGPONG_CONFIGS[:1] + INLINE_CONFIGS
  return INLINE_CONFIGS


def storage_itemsizes(kernel, state) -> list:
  """Bytes per kernel element of the kernel and of each state leaf that
  passes through shared memory (all but int8 block scales; 4-bit codes
  take half a byte)."""
  divisors = [1] + quantization.column_divisors(state)
  return [
    jnp.dtype(leaf.dtype).itemsize / divisor
    for leaf, divisor in zip([kernel] + jax.tree.leaves(state), divisors)
    if divisor != quantization.BLOCK_SIZE
  ]


def fitting_config(
  tokens,
  k,
  n,
  activation_itemsize,
  itemsizes,
  quantized: bool,
  stochastic_rounding: bool = False,
) -> MosaicConfig:
  """The first ranked config whose tiles divide the shape and whose buffers
  fit in shared memory (else the last: ``unsupported_reason`` says why);
  ``itemsizes`` are :func:`storage_itemsizes`. With int8 states an epilogue
  sub-tile is one quantization block wide."""
  configs = ranked_configs(
    tokens,
    quantized,
    PINGPONG_CONFIGS[0].num_tiles(k, n),
    sum(itemsizes),
    stochastic_rounding,
  )
  if quantized:
    configs = tuple(
      dataclasses.replace(config, epilogue_n=quantization.BLOCK_SIZE)
      for config in configs
    )
  for config in configs:
    if (
      shared_memory_bytes(config, activation_itemsize, itemsizes)
      <= SHARED_MEMORY_BUDGET
      and not k % config.tile_k
      and not n % config.cta_tile_n
      and not tokens % config.tile_t
    ):
      return config
  return configs[-1]


def default_config(x, kernel, optimizer) -> MosaicConfig:
  """The fastest default config for this call's shapes and dtypes."""
  state = stacks.layer_state_shapes(kernel, optimizer)
  return fitting_config(
    math.prod(x.shape[:-1]),
    *kernel.shape[-2:],
    jnp.dtype(x.dtype).itemsize,
    storage_itemsizes(kernel, state),
    quantization.has_quantized(state),
    optimizer.draws_random_bits,
  )
