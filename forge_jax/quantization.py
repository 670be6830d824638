"""Low-precision storage: stochastically rounded bf16 weights, int8 states.

Everything here is elementwise (or reduces within one block of 64 elements
of a row), so the XLA reference applies it to whole arrays and the Pallas
kernel to its register tiles through the same functions, called from
:func:`forge_jax.ops.update.apply_update` only.

**Stochastic rounding** (``weight_rounding='stochastic'``) writes a float32
weight ``w`` to bfloat16 as one of its two bf16 neighbours, the upper one
with probability ``(w - lower) / (upper - lower)``, so that ``E[round(w)] =
w``: an update smaller than half a bf16 ulp is not lost, it lands in
expectation. The random bits are a counter-based hash of ``(seed, layer,
step, row, column)`` computed with uint32 multiplies, xors and shifts, so the
XLA reference, Pallas interpret mode and the GPU kernel draw the same bits
for the same element, whatever the tiling. ``step`` is the layer's ``count``
(a new draw every step); ``layer`` is static (``ForgeDense.layer_id``, by
default a CRC-32 of the module path). Seed, layer and step are hashed into
one uint32 key outside the kernels (:func:`rounding_key`), which take it as
a runtime scalar: the layers of a model share one compiled kernel.

**int8 block states** (``state_dtype='int8'``): each row of a state leaf is
cut into blocks of :data:`BLOCK_SIZE` = 64 consecutive columns (the
contiguous axis of the ``[in, out]`` kernel); a block is stored as 64 int8
codes and one float32 scale. The Pallas kernel's epilogue handles column
chunks of exactly one block, so a block never straddles a tile.

* Signed states (first moments, momentum traces): ``x ~ q * s`` with ``q`` in
  ``[-127, 127]`` and ``s`` the smallest bfloat16 value with
  ``127 s >= absmax`` (:class:`QuantizedBlocks`).
* Non-negative second moments (``nu``, ``sum_of_squares``): stored as
  ``sqrt(v) ~ L * s`` with ``L`` in ``[0, 254]`` (all 255 non-NaN codes, as
  ``q = L - 127``) and ``s >= sqrt(max v) / 254``; every ``v > 0`` keeps
  ``L >= 1`` (:class:`QuantizedSqrtBlocks`). Why: absmax-linear int8 of ``v``
  maps every ``v < max(v) / 254`` of a block to zero, and an element whose
  ``v`` is rounded to zero while its ``m`` is not takes the step ``m / eps``
  (the "zero-point problem" of low-bit Adam states). The square root halves
  the dynamic range in decibels (``v`` down to ``max / 64516`` keeps a
  non-zero code, ``max / 258064`` with rounding), the error of ``sqrt(v)`` is
  the error of Adam's denominator directly, and the floor at ``L = 1`` makes
  an underflowing ``v`` err on the large side (a smaller step, never
  ``m / eps``). Measured on the moments of the demo LM: linear int8 of ``v``
  blows Adam's direction up by a factor ~1e4 (5 % of the elements read back
  as zero), the sqrt encoding errs by ~1 %; see :data:`ENCODING_NOTE`.

**4-bit second moments** (``second_moment_bits=4``): the same sqrt encoding
on 15 levels, ``sqrt(v) ~ L * s`` with ``L`` in ``[0, 14]`` and the floor at
``L = 1``, two levels a byte (:class:`QuantizedSqrt4Blocks`): the levels of
a block's columns ``j`` and ``j + 32`` are stored as the one int8 code
``lo + 15 hi - 112``, in ``[-112, 112]``. Second moments then take 0.53
bytes an element instead of 1.06; first moments stay int8. Fifteen levels
rather than sixteen keep every code off ``-128``, the container's NaN.
Pairing a block's halves lets a kernel holding one block pack it with two
slices and unpack it with one concatenation. A step rounds
the levels *stochastically*: down or up with the probability of the
fraction (:func:`level_offsets`), drawn from the low 16 bits of the same
per-element hash as the weights' stochastic rounding. Rounded to nearest, a
level moves only when one step changes it by more than half a level: in a
block whose peak stays put, an element whose second moment grows by less
than that each step stays at its level while Adam's bias correction divides
it by a growing ``1 - b2^t``, so its steps grow as ``sqrt(t)``. Rounded
stochastically, the level moves by the change in expectation.

The quantizer is bit-exact across backends without trusting division or
square roots (Triton lowers float32 ``/`` to an approximate ``div.full``):
a code is first *estimated* with ``x * (1 / s)``, then corrected by one
step against the threshold ``(q ± 0.5) * s`` on the estimate's side, which
uses only correctly rounded multiplies and comparisons; a block's scale is
the smallest value on the bfloat16 grid with ``127 s >= absmax`` (``(254
s)^2 >= max v`` in the sqrt domain), found the same way. Any backend whose
estimate errs by less than half a code (float32 estimates err by about 1e-5
of one) gets the same bits. The grid costs at most 2**-8 of a code's
resolution and keeps a block's scale where it is when a backend's rule
rounds the block's largest element an ulp apart (a multiply-add contracted
differently): the scale moves only if that ulp crosses a grid threshold.

Storage. JAX differentiates floating leaves only (``jax.grad`` refuses
int8), and FORGE returns the new state as a cotangent, so the int8 codes are
carried in a one-byte *floating* container dtype, ``float8_e4m3fnuz``, bit
for bit (:func:`int8_codes` views them as int8). Of its 256 bit patterns only
``0x80`` (int8 -128, never used) is NaN, and it has no -0, so every code is a
distinct finite value and any value-preserving op (copies, ``x + 0`` from
autodiff, checkpoints) preserves the bits.

Non-finite values: a block whose state holds a NaN or inf is stored with a
NaN scale (all 64 elements read back NaN), the same in every backend.
"""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

#: Elements per quantization block (consecutive columns of one row).
BLOCK_SIZE = 64
#: Largest code magnitude: codes are in [-127, 127]; -128 is never written.
CODE_MAX = 127
#: Levels of the sqrt-domain (non-negative) encoding: L = q + 127 in [0, 254].
SQRT_LEVELS = 2 * CODE_MAX
#: Levels of the 4-bit sqrt encoding: L in [0, 14], two a byte.
SQRT4_LEVELS = 14
#: A byte's two levels ``(lo, hi)`` are the code ``lo + 15 hi - 112``.
_PAIR_BASE = SQRT4_LEVELS + 1
_PAIR_OFFSET = (_PAIR_BASE**2 - 1) // 2
#: Bits of a second moment's code: 8 (int8) or 4 (two levels a byte).
SECOND_MOMENT_BITS = (8, 4)
#: The floating one-byte dtype that carries int8 codes bit for bit.
CODES_CONTAINER = jnp.dtype(jnp.float8_e4m3fnuz)
#: Blocks whose absmax is below this are stored as zeros (1 / scale would
#: overflow float32 for denormal scales).
TINY = 2.0**-100

STATE_DTYPES = ("float32", "bfloat16", "float16", "int8")
WEIGHT_ROUNDINGS = ("nearest", "stochastic")

#: What the encodings of Adam's second moment cost on real moments, measured
#: by ``benchmarks/fidelity.py`` (``moment_encodings`` in its JSON).
ENCODING_NOTE = """
Adam moments of the 'small' demo LM after 150 float32 FORGE steps (every
kernel, 1.0 M elements). Relative L2 error of the Adam direction
m_hat / (sqrt(v_hat) + eps) when v alone is stored (m exact), and the share of
elements with v > 0 that read back as 0:
  linear v, absmax / 127, blocks of 64:     9.1e+03  (5.3 %: they step m / eps)
  sqrt(v), 255 levels, blocks of 64 (used): 1.1e-02  (0)
  the same, blocks of 256 / 2048:           1.6e-02 / 1.7e-02
  sqrt(v), 15 levels (second_moment_bits=4): 1.6e-01  (0)
  bfloat16 v, for scale:                    8.3e-04
With m int8 as well (linear, blocks of 64): 1.8e-02. Without the floor at
level 1 no element of this run reads back as 0 either; on the 'tiny' config
(60 steps, benchmarks/results/fidelity_tiny_*.json) 0.09 % do, and the
direction error without the floor is 1.6e+03 against 6.8e-02 with it
(linear v: 1.6e+05). Trained with 4-bit second moments (bf16 weights with
stochastic rounding, int8 first moments), the 'small' LM ends 0.0001 from
float32 optax's final loss, inside the 0.046 between three of its
initializations (int8: 0.006); over 600 steps 0.010, inside 0.036 (int8:
0.004; bf16 weights alone 0.009), with the 4-bit direction error down to
8.9e-02.
"""


class QuantizedBlocks(NamedTuple):
  """A signed state leaf as int8 codes and a float32 scale per 64-block.

  Attributes:
    codes: ``[K, N]`` int8 codes (``float8_e4m3fnuz`` container in the
      variables; int8 inside the kernel).
    scale: ``[K, ceil(N / 64)]`` float32 on the bfloat16 grid, the
      smallest with ``127 * scale >= absmax`` of each block.
  """

  codes: jax.Array
  scale: jax.Array


class QuantizedSqrtBlocks(NamedTuple):
  """A non-negative state leaf stored as ``sqrt(v) ~ (codes + 127) * scale``.

  Attributes:
    codes: ``[K, N]`` int8 codes, ``L - 127`` for levels ``L`` in [0, 254].
    scale: ``[K, ceil(N / 64)]`` float32, on the bfloat16 grid.
  """

  codes: jax.Array
  scale: jax.Array


class QuantizedSqrt4Blocks(NamedTuple):
  """A non-negative state leaf in 4 bits: ``sqrt(v) ~ L * scale`` with
  levels ``L`` in [0, 14], two levels a byte.

  Attributes:
    codes: ``[K, 32 ceil(N / 64)]`` int8 codes, 32 a block; code ``j`` of
      block ``b`` is ``lo + 15 hi - 112`` for the levels ``lo``, ``hi`` of
      the block's columns ``64 b + j`` and ``64 b + 32 + j`` (levels past
      ``N`` are 0).
    scale: ``[K, ceil(N / 64)]`` float32, on the bfloat16 grid.
  """

  codes: jax.Array
  scale: jax.Array


QUANTIZED_TYPES = (QuantizedBlocks, QuantizedSqrtBlocks, QuantizedSqrt4Blocks)
SQRT_TYPES = (QuantizedSqrtBlocks, QuantizedSqrt4Blocks)


def is_quantized(x) -> bool:
  return isinstance(x, QUANTIZED_TYPES)


def has_quantized(state) -> bool:
  """Whether any leaf of ``state`` is int8 block-quantized."""
  return any(map(is_quantized, jax.tree.leaves(state, is_leaf=is_quantized)))


def block_scale_shape(kernel_shape) -> tuple:
  """The shape of a ``[K, N]`` leaf's block scales: ``[K, ceil(N / 64)]``."""
  rows, cols = kernel_shape
  return (rows, -(-cols // BLOCK_SIZE))


def pair_codes_shape(kernel_shape) -> tuple:
  """The shape of a ``[K, N]`` leaf's 4-bit codes: ``[K, 32 ceil(N / 64)]``
  (a block's 64 levels in 32 bytes; a partial last block is padded)."""
  rows, cols = kernel_shape
  return (rows, BLOCK_SIZE // 2 * -(-cols // BLOCK_SIZE))


def canonical_state_dtype(state_dtype) -> Optional[str]:
  """``None`` or one of :data:`STATE_DTYPES` (accepts dtypes and names)."""
  if state_dtype is None:
    return None
  if isinstance(state_dtype, str) and state_dtype in STATE_DTYPES:
    return state_dtype
  try:
    name = jnp.dtype(state_dtype).name
  except TypeError:
    name = None
  if name not in STATE_DTYPES:
    raise ValueError(
      f"state_dtype={state_dtype!r} must be None or one of {STATE_DTYPES}"
    )
  return name


# ---------------------------------------------------------------------------
# int8 codes <-> their floating container.


def int8_codes(codes: jax.Array) -> jax.Array:
  """The int8 view of codes (a container or already int8)."""
  if codes.dtype == jnp.int8:
    return codes
  if codes.dtype != CODES_CONTAINER:
    raise TypeError(
      f"codes of dtype {codes.dtype} are neither int8 nor {CODES_CONTAINER}"
    )
  return lax.bitcast_convert_type(codes, jnp.int8)


def container_codes(codes: jax.Array) -> jax.Array:
  """int8 codes in their ``float8_e4m3fnuz`` container (bit for bit)."""
  if codes.dtype == CODES_CONTAINER:
    return codes
  return lax.bitcast_convert_type(codes.astype(jnp.int8), CODES_CONTAINER)


def _codes_like(codes_int8, like):
  return codes_int8 if like.dtype == jnp.int8 else container_codes(codes_int8)


def codes_as_int8(state):
  """``state`` with every quantized leaf's codes viewed as int8."""
  return jax.tree.map(
    lambda q: q._replace(codes=int8_codes(q.codes)) if is_quantized(q) else q,
    state,
    is_leaf=is_quantized,
  )


def codes_as_container(state):
  """Inverse of :func:`codes_as_int8`."""
  return jax.tree.map(
    lambda q: (
      q._replace(codes=container_codes(q.codes)) if is_quantized(q) else q
    ),
    state,
    is_leaf=is_quantized,
  )


def column_divisors(state) -> list[int]:
  """For each leaf of ``jax.tree.leaves(state)``: how many of the kernel's
  columns one of its columns stands for. 1 for elementwise leaves and int8
  codes, 2 for 4-bit codes (two a byte), :data:`BLOCK_SIZE` for block
  scales: the columns ``[c, c + w)`` of the kernel are the columns ``[c /
  d, (c + w) / d)`` of the leaf, for ``c`` and ``w`` multiples of
  :data:`BLOCK_SIZE` (a 4-bit code pairs columns 32 apart)."""

  def divisors(q):
    if not is_quantized(q):
      return 1
    codes = 2 if isinstance(q, QuantizedSqrt4Blocks) else 1
    return type(q)(codes=codes, scale=BLOCK_SIZE)

  return list(
    jax.tree.leaves(jax.tree.map(divisors, state, is_leaf=is_quantized))
  )


def has_4bit(state) -> bool:
  """Whether any leaf of ``state`` is a 4-bit second moment."""
  return any(
    isinstance(q, QuantizedSqrt4Blocks)
    for q in jax.tree.leaves(state, is_leaf=is_quantized)
  )


# ---------------------------------------------------------------------------
# Block helpers. ``x`` is [R, C] with C a multiple of the block (the kernel's
# chunk is exactly one block, so no reshape reaches Triton). Per-block values
# are [R, C / block], or [R] for a tile of one block per row whose kernel has
# no [R, 1] layout (``rows_1d``: Mosaic GPU).


def _blocks_max(x, block, rows_1d=False):
  """``[R, C] -> [R, C / block]``: the maximum of each block of a row
  (``rows_1d``: ``[R, block] -> [R]``)."""
  rows, cols = x.shape
  if rows_1d:
    return jnp.max(x, axis=1)
  if cols == block:
    return jnp.max(x, axis=1, keepdims=True)
  return jnp.max(x.reshape(rows, cols // block, block), axis=2)


def _expand(per_block, block, cols):
  """``[R, nb] -> [R, cols]`` (``[R, 1]``, to broadcast, when nb == 1; an
  explicit broadcast of ``[R]``)."""
  if per_block.ndim == 1:
    return lax.broadcast_in_dim(per_block, (per_block.shape[0], cols), (0,))
  if per_block.shape[1] == 1:
    return per_block
  rows, blocks = per_block.shape
  # A broadcast and a reshape, which XLA fuses into the consumer (jnp.repeat
  # lowers to a scatter, a cumulative sum and gathers).
  repeated = lax.broadcast_in_dim(per_block, (rows, blocks, block), (0, 1))
  return repeated.reshape(rows, blocks * block)[:, :cols]


def _pad_cols(x, block):
  cols = x.shape[1]
  padded = -(-cols // block) * block
  if padded == cols:
    return x
  return jnp.pad(x, ((0, 0), (0, padded - cols)))


def _check_2d(x, what):
  if x.ndim != 2:
    raise ValueError(f"{what} must be 2-D ([rows, columns]), got {x.shape}")


def _corrected_round(x, s, product, square: bool, offset=None):
  """The integer ``q`` nearest ``x / s + d`` (``sqrt(x) / s + d`` when
  ``square``), as float32, from ``product``, an estimate of the quotient
  within a few ulps of it (``x * (1 / s)``), using correctly rounded
  multiplies and comparisons only. ``d`` is ``offset`` (0 when None), a
  float32 in ``[-0.5, 0.5)`` with at most 16 fraction bits (see
  :func:`level_offsets`): rounding ``y + d`` to nearest rounds ``y`` down or
  up with the probability of its fraction when ``d`` is uniform.

  ``e``, the integer nearest ``product + d``, is ``q`` or one of its
  neighbours, and only the one on that side of ``e`` can be nearer (the
  estimate errs by far less than half an integer): with the half-way point
  ``h = e ± 0.5`` on that side and ``t = (h - d) * s`` (squared when
  ``square``), ``q = h + 0.5`` if ``x >= t``, else ``h - 0.5``. One
  threshold an element: the same ``q`` as testing both neighbours. ``h - d``
  is exact (an integer minus 16 fraction bits); where it is negative every
  ``x >= 0`` is past the threshold, so it is clamped at 0 before squaring.
  """
  if offset is not None:
    product = product + offset
  estimate = _nearest_integer(product)
  h = estimate + jnp.where(product >= estimate, 0.5, -0.5)
  t = h if offset is None else jnp.maximum(h - offset, 0.0)
  t = t * s
  if square:
    t = t * t
  return h + jnp.where(x >= t, 0.5, -0.5)


#: 1.5 * 2**23: a float32 in [2**23, 2**24) has no fraction bits, so adding
#: it to a float32 ``|y| < 2**22`` rounds ``y`` to an integer, and the sum's
#: low mantissa bits hold that integer plus ``2**22``.
_ROUNDER = np.float32(1.5 * 2**23)


def _rounded_to_int32(y):
  """``y`` (float32, ``|y| < 2**22``) rounded to the nearest integer, ties
  to even, as int32: read from the mantissa of ``y + 1.5 * 2**23``. Two
  instructions, where Mosaic GPU's float-to-int conversion clamps first
  (three) and its floor goes through that conversion; the bitcast also keeps
  XLA from folding the rounding away, as it folds ``(y + c) - c`` to ``y``."""
  biased = lax.bitcast_convert_type(y + _ROUNDER, jnp.int32)
  return biased - _ROUNDER.view(np.int32)


def _nearest_integer(y):
  """``y`` (``|y| < 2**22``) rounded to an integer, ties to even, as
  float32."""
  return _rounded_to_int32(y).astype(jnp.float32)


def _bf16_grid(x, offset: int):
  """``x >= 0`` rounded up to the bfloat16 grid, then moved ``offset`` grid
  steps (as float32)."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  up = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
  if offset > 0:
    up = up + jnp.uint32(offset << 16)
  elif offset < 0:
    up = up - jnp.uint32((-offset) << 16)
  return lax.bitcast_convert_type(up, jnp.float32)


def quantize(
  x: jax.Array,
  *,
  block: int = BLOCK_SIZE,
  sqrt: bool = False,
  valid: Optional[jax.Array] = None,
  rows_1d: bool = False,
  bits: int = 8,
):
  """Blockwise absmax int8 quantization of ``x`` along its last axis.

  Args:
    x: ``[R, C]`` (any C; the last block is zero-padded).
    block: elements per block (64 in stored states; other sizes for tests).
    sqrt: encode ``sqrt(x)`` of a non-negative ``x`` on 255 levels (second
      moments), else ``x`` on 255 signed levels.
    valid: optional mask of the elements that exist (the kernel's masked
      tile edges); the others count as zero.
    rows_1d: ``x`` is one block per row (``C == block``) and the scale comes
      back as ``[R]`` (a Mosaic GPU tile's).
    bits: 4 encodes ``sqrt(x)`` on 15 levels, two a byte (``sqrt`` only).

  Returns:
    ``(codes, scale)``: int8 ``[R, C]`` (``[R, block / 2 * ceil(C /
    block)]`` with ``bits=4``) and float32 ``[R, ceil(C / block)]``.
  """
  codes, scale = _quantize(x, block, sqrt, valid, rows_1d, bits)
  return codes.astype(jnp.int8), scale


def _quantize(x, block, sqrt, valid, rows_1d, bits=8, offsets=None):
  """:func:`quantize` with the codes as int32; ``offsets`` (``[R, C]``, 4-bit
  only) round the levels stochastically (:func:`_corrected_round`)."""
  _check_2d(x, "quantize's input")
  if bits not in SECOND_MOMENT_BITS or (bits == 4 and not sqrt):
    raise ValueError(
      f"bits={bits} must be 8, or 4 with sqrt=True (second moments only)"
    )
  if offsets is not None and bits != 4:
    raise ValueError("only 4-bit levels are rounded stochastically")
  if bits == 4 and block != BLOCK_SIZE:
    raise ValueError(f"4-bit codes pair the halves of {BLOCK_SIZE}-blocks")
  if rows_1d and x.shape[1] != block:
    raise ValueError(
      f"rows_1d quantizes one block per row: {x.shape=} must "
      f"have {block} columns"
    )
  x = x.astype(jnp.float32)
  if valid is not None:
    x = jnp.where(valid, x, 0.0)
  cols = x.shape[1]
  xp = _pad_cols(x, block)
  finite = jnp.isfinite(xp)
  # One reduction finds both the absmax and the blocks holding a NaN or an
  # inf, which count as inf (Triton's max ignores NaN, XLA's propagates it);
  # such a block is stored as zero codes and a NaN scale.
  amax = _blocks_max(jnp.where(finite, jnp.abs(xp), jnp.inf), block, rows_1d)
  bad = amax == jnp.inf
  if sqrt:
    mag = jnp.where(finite, jnp.abs(xp), 0.0)
    top = SQRT_LEVELS if bits == 8 else SQRT4_LEVELS
    if offsets is not None:
      offsets = _pad_cols(jnp.broadcast_to(offsets, x.shape), block)
    scale, levels = _quantize_sqrt(mag, amax, block, top, offsets)
    bad_cols = _expand(bad, block, xp.shape[1])
    codes = jnp.where(
      bad_cols, 0.0, levels - float(CODE_MAX) if bits == 8 else levels
    )
  else:
    scale, codes = _quantize_linear(jnp.where(finite, xp, 0.0), amax, block)
  scale = jnp.where(bad, jnp.float32(jnp.nan), scale)
  if bits == 4:
    return _pack_pairs(_rounded_to_int32(codes), rows_1d), scale
  return _rounded_to_int32(codes[:, :cols]), scale


def _pack_pairs(levels, one_block=False):
  """int32 levels ``[R, 64 B]`` in [0, 14] -> the int32 codes ``[R, 32 B]``
  of their pairs: column ``j`` of a block with column ``j + 32``.

  Halves of a block rather than neighbouring columns, so that a kernel
  holding one block packs it with two slices (``one_block``: a Mosaic GPU
  tile, whose lowering has no strided slices); elsewhere a reshape and a
  split, which Triton's lowering has."""
  half = BLOCK_SIZE // 2
  if one_block:
    lo, hi = levels[:, :half], levels[:, half:]
  else:
    rows, cols = levels.shape
    blocks = levels.reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE)
    lo, hi = (h.reshape(rows, cols // 2) for h in jnp.split(blocks, 2, axis=2))
  return lo + _PAIR_BASE * hi - _PAIR_OFFSET


def _unpack_pairs(codes, one_block=False):
  """Inverse of :func:`_pack_pairs`: int8 codes ``[R, 32 B]`` -> int32
  levels ``[R, 64 B]``. (``one_block``: a concatenation, which Mosaic GPU
  lowers; else a stack on the last axis, a transpose and a merging reshape,
  which Triton lowers.)"""
  pair = codes.astype(jnp.int32) + _PAIR_OFFSET
  hi = lax.div(pair, jnp.int32(_PAIR_BASE))
  lo = pair - _PAIR_BASE * hi
  if one_block:
    return jnp.concatenate([lo, hi], axis=1)
  rows, width = codes.shape
  half = BLOCK_SIZE // 2
  halves = [h.reshape(rows, width // half, half) for h in (lo, hi)]
  blocks = jnp.swapaxes(jnp.stack(halves, axis=3), 2, 3)
  return blocks.reshape(rows, 2 * width)


def _quantize_linear(x, amax, block):
  """``(scale, codes)`` of the signed encoding; a block that is all but
  zero (absmax below :data:`TINY`) or holds a non-finite value (an
  infinite ``amax``) gets zero codes."""
  cols = x.shape[1]
  keep = jnp.logical_and(amax >= TINY, amax < jnp.inf)
  scale = jnp.where(keep, _grid_scale(amax, CODE_MAX, square=False), 0.0)
  inv = jnp.where(keep, 1.0 / jnp.where(keep, scale, 1.0), 0.0)
  s = _expand(scale, block, cols)
  q = _corrected_round(x, s, x * _expand(inv, block, cols), square=False)
  # Masked blocks (scale 0) get zeros by a select: with the clip's bounds
  # at +-0 instead, XLA's GPU code gave an all-zero block codes of -1 (read
  # back as -0.0).
  q = jnp.clip(q, -float(CODE_MAX), float(CODE_MAX))
  return scale, jnp.where(s > 0, q, 0.0)


def _grid_scale(peak, levels: int, square: bool):
  """Smallest ``s`` on the bfloat16 grid with ``levels * s >= peak``
  (``(levels * s)^2 >= peak`` when ``square``), for ``peak > 0``.

  ``peak * (1 / levels)`` (its square root when ``square``) only estimates
  it; correctly rounded multiplies and comparisons pick the result, so every
  backend gets the same bits. On the grid, a block's scale moves only when
  its peak crosses one of the grid's thresholds: a peak one float32 ulp
  apart (a multiply-add contracted differently) almost never moves it.
  """
  levels = np.float32(levels)

  def ok(s):
    reach = s * levels
    return (reach * reach if square else reach) >= peak

  estimate = (jnp.sqrt(peak) if square else peak) * (np.float32(1) / levels)
  below, grid, above = (_bf16_grid(estimate, d) for d in (-1, 0, 1))
  return jnp.where(ok(below), below, jnp.where(ok(grid), grid, above))


def _sqrt_scale(vmax, top):
  """Smallest ``s`` on the bfloat16 grid with ``(top s)^2 >= vmax`` (0 where
  ``vmax == 0``)."""
  return jnp.where(vmax > 0, _grid_scale(vmax, top, square=True), 0.0)


def _quantize_sqrt(mag, vmax, block, top, offsets=None):
  """``(scale, levels)`` of the sqrt encoding on ``top + 1`` levels: levels
  in ``[1, top]`` where ``mag > 0`` (no ``v > 0`` reads back as 0: Adam
  would step ``m / eps`` there), 0 where ``mag`` is 0 and in all-zero
  blocks. With ``offsets``, ``sqrt(mag) / scale`` is rounded stochastically
  (before the floor at 1)."""
  scale = _sqrt_scale(vmax, top)
  inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
  s = _expand(scale, block, mag.shape[1])
  product = jnp.sqrt(mag) * _expand(inv, block, mag.shape[1])
  levels = _corrected_round(mag, s, product, square=True, offset=offsets)
  floor = jnp.where(mag > 0, 1.0, 0.0)
  ceiling = _expand(jnp.where(scale > 0, float(top), 0.0), block, mag.shape[1])
  return scale, jnp.minimum(jnp.maximum(levels, floor), ceiling)


def dequantize(
  codes: jax.Array,
  scale: jax.Array,
  *,
  block: int = BLOCK_SIZE,
  sqrt: bool = False,
  bits: int = 8,
  cols: Optional[int] = None,
) -> jax.Array:
  """float32 values of ``(codes, scale)``: one rounded multiply each (the
  sqrt encoding squares ``level * scale``). A ``[R]`` scale is one block per
  row. 4-bit codes (``bits=4``) unpack to ``cols`` columns (default: two a
  code)."""
  _check_2d(codes, "codes")
  if bits == 4:
    one_block = scale.ndim == 1  # a Mosaic GPU tile
    levels = _levels(int8_codes(codes), sqrt, bits, cols, one_block)
    r = levels * _expand(scale, block, levels.shape[1])
    return r * r
  # int8 codes: what _levels computes, with the scale expanded before the
  # offset is added, the order of operations the Mosaic kernel's epilogue
  # is compiled and tested with.
  q = int8_codes(codes).astype(jnp.float32)
  s = _expand(scale, block, q.shape[1])
  if sqrt:
    r = (q + float(CODE_MAX)) * s
    return r * r
  return q * s


def _levels(codes, sqrt, bits, cols=None, one_block=False):
  """float32 ``[R, C]``: what int8 ``codes`` encode linearly (the sqrt
  encoding's levels; the signed codes themselves). 4-bit codes unpack to
  whole blocks, or to ``cols`` columns."""
  if bits == 4:
    levels = _unpack_pairs(codes, one_block).astype(jnp.float32)
    if cols is None or cols == levels.shape[1]:
      return levels
    return levels[:, :cols]
  q = codes.astype(jnp.float32)
  return q + float(CODE_MAX) if sqrt else q


# ---------------------------------------------------------------------------
# State leaves: what init stores, what the rule reads, what a step writes.


def store(
  x: jax.Array,
  state_dtype: Optional[str],
  nonnegative: bool,
  second_moment_bits: int = 8,
):
  """A freshly initialized state leaf in its storage form (int8 second
  moments in ``second_moment_bits``)."""
  if state_dtype is None or x is None:
    return x
  if state_dtype != "int8":
    return x.astype(state_dtype)
  return _store_int8(x, nonnegative, second_moment_bits if nonnegative else 8)


# Jitted: a layer initialized eagerly (an NNX layer, a vmapped stack of
# them) compiles the quantizer once per shape instead of each of its dozens
# of operations one by one, seconds per layer.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _store_int8(x, nonnegative: bool, bits: int):
  # Initial states are constants: without the barrier, XLA constant-folds
  # the block reductions of every leaf, seconds per leaf at compile time.
  x = jax.lax.optimization_barrier(x)
  codes, scale = quantize(x, sqrt=nonnegative, bits=bits)
  if not nonnegative:
    cls = QuantizedBlocks
  else:
    cls = QuantizedSqrt4Blocks if bits == 4 else QuantizedSqrtBlocks
  return cls(codes=container_codes(codes), scale=scale)


def _bits(leaf) -> int:
  return 4 if isinstance(leaf, QuantizedSqrt4Blocks) else 8


def load(leaf, cols: Optional[int] = None) -> jax.Array:
  """A stored state leaf (or a kernel tile of one) as float32 values, of
  ``cols`` columns (needed for a 4-bit leaf of an odd number of columns)."""
  if is_quantized(leaf):
    return dequantize(
      leaf.codes,
      leaf.scale,
      sqrt=isinstance(leaf, SQRT_TYPES),
      bits=_bits(leaf),
      cols=cols,
    )
  return leaf.astype(jnp.float32)


def encoded_value(leaf) -> tuple[jax.Array, jax.Array]:
  """``(value, step)`` of an int8 state leaf, both ``[K, N]`` float32.

  ``value`` is what the codes encode linearly (the value itself; ``sqrt(v)``
  for the sqrt encoding) and ``step`` one code's size there, the block's
  scale (4-bit codes: ``[K, 64 ceil(N / 64)]``, a partial last block's
  padding included). Nearly equal values encoded at scales one grid step
  apart (a relative 2**-8 to 2**-7) can get codes up to two apart near the
  top of the sqrt encoding's 254 levels, but their ``value``s stay within
  one ``step``.
  """
  q = _levels(int8_codes(leaf.codes), isinstance(leaf, SQRT_TYPES), _bits(leaf))
  step = jnp.broadcast_to(_expand(leaf.scale, BLOCK_SIZE, q.shape[1]), q.shape)
  return q * step, step


def encoded_distance(a, b) -> tuple[jax.Array, jax.Array]:
  """``(codes, steps)`` between two int8 leaves of one shape, both ``[K, N]``:
  how many codes apart each element is where the two blocks' scales agree
  (0 elsewhere), and how far apart what they encode is (:func:`encoded_value`)
  in code steps of the larger scale (0 where either value is not finite or
  ``b``'s block is all zero)."""
  value_a, step_a = encoded_value(a)
  value_b, step_b = encoded_value(b)
  sqrt, bits = isinstance(a, SQRT_TYPES), _bits(a)
  codes = jnp.abs(
    _levels(int8_codes(a.codes), sqrt, bits)
    - _levels(int8_codes(b.codes), sqrt, bits)
  ).astype(jnp.int32)
  compared = jnp.isfinite(value_a) & jnp.isfinite(value_b) & (step_b > 0)
  steps = jnp.abs(value_a - value_b) / jnp.maximum(step_a, step_b)
  return (
    jnp.where(step_a == step_b, codes, 0),
    jnp.where(compared, steps, 0.0),
  )


def load_state(state, cols: Optional[int] = None):
  """:func:`load` over a state NamedTuple."""
  return jax.tree.map(lambda x: load(x, cols), state, is_leaf=is_quantized)


def nan_where_blocks_not_finite(state, cols: int) -> Optional[jax.Array]:
  """NaN in the blocks that an int8 leaf of ``state`` stores as non-finite
  (a NaN scale), 0 elsewhere, broadcastable to ``[rows, cols]``; None if
  ``state`` has no int8 leaf. One value a block: the scales, not the codes,
  are read."""
  scales = [
    q.scale
    for q in jax.tree.leaves(state, is_leaf=is_quantized)
    if is_quantized(q)
  ]
  if not scales:
    return None
  total = scales[0] - scales[0]
  for scale in scales[1:]:
    total = total + (scale - scale)
  return _expand(total, BLOCK_SIZE, cols)


def update(
  new: jax.Array,
  old,
  ok: jax.Array,
  valid: Optional[jax.Array] = None,
  level_bits: Optional[jax.Array] = None,
):
  """The stored form of a step's new float32 state leaf ``new``.

  Elements where ``ok`` is false keep their old value: bit for bit for
  float leaves; for int8 leaves a block in which no (valid) element is
  ``ok`` keeps its codes and scale bit for bit, and in a partly skipped block
  the skipped elements keep their old value re-quantized in the block's new
  scale (the same codes while the scale stays).

  A 4-bit leaf's levels are rounded stochastically with ``level_bits``
  (uint32 :func:`element_bits`, broadcastable to ``new``; required):
  rounded to nearest, a level moves only when one step's change exceeds
  half a level, and Adam's slowly growing second moments stall below their
  value (see the module's notes).
  """
  if not is_quantized(old):
    return jnp.where(ok, new, old.astype(jnp.float32)).astype(old.dtype)
  sqrt, bits = isinstance(old, SQRT_TYPES), _bits(old)
  rows_1d = old.scale.ndim == 1  # a Mosaic GPU tile's scales
  values = jnp.where(ok, new, load(old, new.shape[1]))
  offsets = None
  if bits == 4:
    if level_bits is None:
      raise ValueError(
        "4-bit second moments round their levels stochastically: pass the "
        "elements' level_bits (element_bits of the layer's rounding key)"
      )
    offsets = level_offsets(level_bits)
  codes, scale = _quantize(
    values, BLOCK_SIZE, sqrt, valid, rows_1d, bits, offsets
  )
  touched = ok if valid is None else jnp.logical_and(ok, valid)
  touched = jnp.broadcast_to(touched, values.shape).astype(jnp.float32)
  changed = (
    _blocks_max(_pad_cols(touched, BLOCK_SIZE), BLOCK_SIZE, rows_1d) > 0.0
  )
  # Selected as int32: Mosaic GPU has no pointwise ops on 8-bit vectors.
  codes_per_block = BLOCK_SIZE * bits // 8
  codes = jnp.where(
    _expand(changed, codes_per_block, codes.shape[1]),
    codes,
    int8_codes(old.codes).astype(jnp.int32),
  ).astype(jnp.int8)
  scale = jnp.where(changed, scale, old.scale)
  return type(old)(codes=_codes_like(codes, old.codes), scale=scale)


def storage_dtypes(state) -> list:
  """Each leaf's storage dtype, in ``jax.tree.leaves`` order of its float32
  state: float32 for int8 leaves (a NaN or infinity becomes a block's NaN
  scale)."""
  return [
    jnp.dtype(jnp.float32) if is_quantized(leaf) else leaf.dtype
    for leaf in jax.tree.leaves(state, is_leaf=is_quantized)
  ]


def rounds_to_finite(x: jax.Array, dtype) -> jax.Array:
  """True where float32 ``x`` rounds to nearest to a finite ``dtype`` value:
  ``|x|`` below the largest value plus half its step (a tie rounds to the
  even infinity). False where ``x`` is NaN or infinite."""
  if jnp.dtype(dtype) == jnp.float32:
    return jnp.isfinite(x)
  finfo = jnp.finfo(dtype)
  half_step = float(finfo.eps) * 2.0 ** (finfo.maxexp - 2)
  return jnp.abs(x) < np.float32(float(finfo.max) + half_step)


def update_state(new_state, old_state, ok, valid=None, level_bits=None):
  """:func:`update` over a state NamedTuple (quantized nodes whole)."""
  return jax.tree.map(
    lambda n, o: update(n, o, ok, valid, level_bits), new_state, old_state
  )


# ---------------------------------------------------------------------------
# Stochastic rounding to bfloat16.

_M1, _M2 = np.uint32(0x7FEB352D), np.uint32(0x846CA68B)
_GOLDEN = np.uint32(0x9E3779B9)


def mix32(h):
  """A 32-bit integer hash with full avalanche ("lowbias32"), for numpy or
  jax uint32 values: shifts, xors and wrapping multiplies only."""
  h = h ^ (h >> 16)
  h = h * _M1
  h = h ^ (h >> 15)
  h = h * _M2
  return h ^ (h >> 16)


def layer_key(seed: int, layer_id: int) -> int:
  """Static per-(seed, layer) key (a Python int, computed with numpy)."""
  with np.errstate(over="ignore"):
    h = mix32(np.uint32(seed & 0xFFFFFFFF) ^ _GOLDEN)
    h = mix32(h ^ np.uint32(layer_id & 0xFFFFFFFF))
  return int(h)


def layer_id_from_path(path: Sequence[str]) -> int:
  """A stable layer id: CRC-32 of ``'/'.join(path)`` (not Python's hash)."""
  return zlib.crc32("/".join(map(str, path)).encode()) & 0xFFFFFFFF


def rounding_key(seed: int, layer_id: int, step=None) -> jax.Array:
  """The uint32 scalar that keys one layer's draw at ``step`` (an integer
  scalar, the layer's count; None: 0): ``mix32(layer_key(seed, layer_id) ^
  step)``. A traced value, so kernels take it at run time and every layer
  runs the same compiled kernel."""
  step = jnp.zeros((), jnp.uint32) if step is None else step
  return mix32(
    jnp.uint32(layer_key(seed, layer_id)) ^ jnp.asarray(step).astype(jnp.uint32)
  )


def random_bits(key: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
  """uint32 random bits for elements ``(rows, cols)`` (broadcastable int
  arrays of global indices) under a :func:`rounding_key` ``key``."""
  row_key = mix32(jnp.asarray(key, jnp.uint32) ^ rows.astype(jnp.uint32))
  return mix32(row_key ^ (cols.astype(jnp.uint32) * _GOLDEN))


def element_bits(
  key: jax.Array, shape: tuple, indices: Optional[tuple] = None
) -> jax.Array:
  """:func:`random_bits` of a 2-D ``shape``'s elements, at their global
  ``indices`` (``(rows, cols)`` broadcastable to ``shape``; None: an iota
  over ``shape``)."""
  if len(shape) != 2:
    raise ValueError(f"random bits are drawn for 2-D kernels, got {shape}")
  if indices is None:
    rows = lax.broadcasted_iota(jnp.int32, (shape[0], 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (1, shape[1]), 1)
  else:
    rows, cols = indices
  return jnp.broadcast_to(random_bits(key, rows, cols), shape)


def level_offsets(bits: jax.Array) -> jax.Array:
  """float32 offsets in ``[-0.5, 0.5)`` from the low 16 of uint32 ``bits``
  (stochastic rounding of the weights takes the high 16): added before
  rounding to nearest, they round a 4-bit level stochastically. Exact, with
  16 fraction bits."""
  low = (bits & jnp.uint32(0xFFFF)).astype(jnp.float32)
  return low * np.float32(2.0**-16) - np.float32(0.5)


def stochastic_round_bf16(x: jax.Array, bits: jax.Array) -> jax.Array:
  """float32 ``x`` to bfloat16, rounding up with probability equal to the
  discarded fraction: add the top 16 random bits below the kept mantissa and
  truncate. Non-finite values round to nearest (stay NaN/inf)."""
  x = x.astype(jnp.float32)
  pattern = lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (pattern + (bits >> 16)) & jnp.uint32(0xFFFF0000)
  out = lax.bitcast_convert_type(rounded, jnp.float32)
  return jnp.where(jnp.isfinite(x), out, x).astype(jnp.bfloat16)


def round_weights(
  new: jax.Array,
  dtype,
  *,
  rounding: str,
  key: Optional[jax.Array] = None,
  indices: Optional[tuple] = None,
) -> jax.Array:
  """Float32 weights to their storage ``dtype`` with ``rounding``.

  ``key``: the layer's :func:`rounding_key` (stochastic rounding only).
  ``indices``: ``(rows, cols)`` global element indices broadcastable to
  ``new`` (a tile's offset plus an iota); None for a whole 2-D kernel.
  """
  dtype = jnp.dtype(dtype)
  if rounding == "nearest" or dtype == jnp.float32:
    return new.astype(dtype)
  if rounding != "stochastic":
    raise ValueError(
      f"weight_rounding={rounding!r} must be one of {WEIGHT_ROUNDINGS}"
    )
  if dtype != jnp.bfloat16:
    raise ValueError(
      f"stochastic rounding writes bfloat16 (or float32) weights, not {dtype}"
    )
  if key is None:
    raise ValueError("stochastic rounding needs the layer's rounding_key")
  return stochastic_round_bf16(new, element_bits(key, new.shape, indices))


def state_bytes(state) -> int:
  """Bytes of a state tree as stored (codes, scales, float leaves)."""
  return sum(
    int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(state)
  )


__all__ = [
  "BLOCK_SIZE",
  "QuantizedBlocks",
  "QuantizedSqrtBlocks",
  "QuantizedSqrt4Blocks",
  "quantize",
  "dequantize",
  "int8_codes",
  "container_codes",
  "stochastic_round_bf16",
  "random_bits",
  "rounding_key",
  "round_weights",
  "layer_id_from_path",
  "store",
  "load",
  "update",
]
