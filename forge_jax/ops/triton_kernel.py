"""Pallas kernel (Triton lowering): dW tiles in float32 registers, update fused.

One program per ``block_k x block_n`` tile of the kernel. It accumulates
``dW_tile = x[:, k-block].T @ dy[:, n-block]`` over the token axis in a
float32 accumulator, loads the kernel and state tiles, applies the optimizer
rule (:func:`forge_jax.ops.update.apply_update`, the function the XLA
reference applies to the whole array), and stores the new kernel and state
tiles over the old ones (``input_output_aliases``). ``dW`` never reaches
device memory. Each program also writes its tile's count of skipped
elements and sum of squared ``dW`` elements (one entry each per program,
summed by XLA: no atomics). Edges (any K, N, T) are masked.

Off-GPU the same kernel runs in Pallas interpret mode, which is how the tests
check it on CPU.

Low-precision storage (:mod:`forge_jax.quantization`): int8 state leaves
arrive as int8 codes (bitcast from their float8 container outside the
kernel) and float32 scales, one per 64 columns of a row; the epilogue's
column chunk is exactly one such block (``block_n / epilogue_split == 64``),
so a block never straddles a chunk or a tile, and the scale tile is
``block_k x 1`` (4-bit codes: ``block_k x 32``, two columns a code).
Stochastic rounding takes the global row and column of each
element (the shard's offset + the tile's + iota) and the layer's rounding
key (the key and the shard's offset are passed with the scalars).

Stacked (``layer_index`` given, :mod:`forge_jax.ops.stacks`): the kernel and
state refs are the whole ``[L, K, N]`` stacks (scales ``[L, K, N / 64]``),
aliased in place, and every tile is read and written at the layer's index
(passed with the scalars): no slice of a stack goes in or out of the call,
so XLA has none to copy around it.
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
from jax.experimental.pallas import triton as plgpu

from forge_jax import quantization
from forge_jax.ops import stacks
from forge_jax.ops.update import (
  apply_update,
  pack_kernel_scalars,
  read_kernel_scalars,
)

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tile shape and launch parameters of the fused kernel (powers of two)."""

  block_k: int = 128
  block_n: int = 128
  block_t: int = 128
  num_warps: int = 8
  num_stages: int = 3
  #: Consecutive programs sweep ``group_k`` K-blocks for each N-block, so
  #: the x and dy blocks they stream are shared through L2.
  group_k: int = 8
  #: The epilogue (optimizer update) processes the tile in this many column
  #: chunks, to lower its register pressure.
  epilogue_split: int = 2

  def __post_init__(self):
    for name in ("block_k", "block_n", "block_t"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")
    if self.group_k < 1:
      raise ValueError(f"group_k={self.group_k} must be positive")
    if self.epilogue_split not in (1, 2, 4) or self.block_n % (
      16 * self.epilogue_split
    ):
      raise ValueError(
        f"epilogue_split={self.epilogue_split} must be 1, 2 or 4 "
        f"and leave chunks of block_n={self.block_n} of at least 16"
      )


#: Shared memory the main loop's pipeline may take (H100/H200 have 227 KB a
#: block; the rest is left to Triton's layout conversions).
SHARED_MEMORY_BUDGET = 200 * 1024


def pipeline_shared_memory(config: TritonConfig, itemsize: int) -> int:
  """Bytes of shared memory for ``num_stages`` buffered x and dy blocks."""
  return (
    config.num_stages
    * config.block_t
    * (config.block_k + config.block_n)
    * itemsize
  )


def default_config(
  tokens: int,
  k: int,
  n: int,
  itemsize: int = 2,
  *,
  state_block: Optional[int] = None,
) -> TritonConfig:
  """A tile shape that fits the problem: full 128x128 tiles where they fit,
  smaller ones for tiny layers (8 outputs, say) so few elements are masked,
  and a token block whose pipeline fits in shared memory for ``itemsize``-
  byte activations (float32 halves it). With block-quantized states
  (``state_block`` = 64 columns) the epilogue chunks are one block wide."""
  pow2 = lambda v, cap: max(16, min(cap, 1 << max(0, (v - 1).bit_length())))
  block_n = pow2(n, 128)
  split = 2 if block_n >= 32 else 1
  if state_block is not None:
    block_n = max(block_n, state_block)
    split = block_n // state_block
  config = TritonConfig(
    block_k=pow2(k, 128),
    block_n=block_n,
    block_t=pow2(tokens, 128),
    epilogue_split=split,
  )
  while (
    pipeline_shared_memory(config, itemsize) > SHARED_MEMORY_BUDGET
    and config.block_t > 16
  ):
    config = dataclasses.replace(config, block_t=config.block_t // 2)
  return config


def unsupported_reason(x, dy, kernel, optimizer) -> Optional[str]:
  """Why the kernel cannot run this call, or None if it can."""
  for name, value in (("x", x), ("dy", dy), ("kernel", kernel)):
    if jnp.dtype(value.dtype) not in map(jnp.dtype, _SUPPORTED_DTYPES):
      return f"{name}.dtype={value.dtype} must be float32, bfloat16 or float16"
  state = jax.eval_shape(
    quantization.codes_as_int8, stacks.layer_state_shapes(kernel, optimizer)
  )
  for leaf in jax.tree.leaves(state):
    if jnp.dtype(leaf.dtype) not in map(
      jnp.dtype, _SUPPORTED_DTYPES + (jnp.int8,)
    ):
      return (
        f"optimizer state dtype {leaf.dtype} is not supported by the kernel"
      )
  if math.prod(x.shape[:-1]) == 0:
    return f"{x.shape=} has no tokens"
  layers = math.prod(kernel.shape[:-2])
  for leaf in jax.tree.leaves(state):
    elements = layers * math.prod(leaf.shape)
    if _offsets_overflow(elements, jnp.dtype(leaf.dtype).itemsize):
      return (
        f"an optimizer state leaf of {elements} {leaf.dtype} elements "
        "(all its stacked layers) is past 2**31 elements but within 2**32 "
        "bytes, which Pallas's Triton lowering addresses with 32-bit "
        "offsets that wrap; use implementation='mosaic' or 'xla'"
      )
  return None


def _offsets_overflow(elements: int, itemsize: int) -> bool:
  """Whether Pallas's Triton lowering addresses an array of ``elements``
  with signed 32-bit element offsets that wrap: it takes 32-bit offsets up
  to 2**32 bytes, so a 1-byte array (int8 codes) of 2**31 + 1 to 2**32
  elements has offsets past 2**31 - 1. (A scanned Qwen3-14B-shaped model
  with int8 states trained to NaN from its second step once the stacks
  passed 2**31 elements: its first step reads all-zero blocks, whose codes
  do not matter, and writes codes elsewhere.)"""
  return elements > 2**31 and elements * itemsize <= 2**32


def check_supported(x, dy, kernel, optimizer):
  reason = unsupported_reason(x, dy, kernel, optimizer)
  if reason is not None:
    raise ValueError(f"implementation='triton' cannot run this call: {reason}")


def check_config(config: TritonConfig, quantized: bool):
  """Quantization blocks must not straddle the epilogue's column chunks."""
  chunk = config.block_n // config.epilogue_split
  if quantized and chunk != quantization.BLOCK_SIZE:
    raise ValueError(
      f"int8 optimizer states are quantized in blocks of "
      f"{quantization.BLOCK_SIZE} consecutive columns, and the kernel's "
      f"epilogue works on chunks of block_n / epilogue_split = "
      f"{config.block_n} / {config.epilogue_split} = {chunk} columns: a "
      f"block would straddle chunks or tiles. Use block_n = "
      f"{quantization.BLOCK_SIZE} * epilogue_split (e.g. block_n=128, "
      f"epilogue_split=2)."
    )


def _fused_kernel(
  scalars_ref,
  x_ref,
  dy_ref,
  w_ref,
  *refs,
  optimizer,
  state_treedef,
  scalars_treedef,
  tokens,
  k,
  n,
  config: TritonConfig,
  dot_precision,
  divisors,
  stacked: bool,
):
  num_state = state_treedef.num_leaves
  state_refs = refs[:num_state]
  w_out_ref = refs[num_state]
  state_out_refs = refs[num_state + 1 : 2 * num_state + 1]
  skipped_ref, grad_sq_ref = refs[2 * num_state + 1 :]
  bk, bn, bt = config.block_k, config.block_n, config.block_t
  pid_k, pid_n = _tile_indices(
    pl.program_id(0), pl.cdiv(k, bk), pl.cdiv(n, bn), config.group_k
  )

  k_idx = pid_k * bk + lax.broadcasted_iota(jnp.int32, (bt, bk), 1)
  n_idx = pid_n * bn + lax.broadcasted_iota(jnp.int32, (bt, bn), 1)

  def accumulate(t, acc):
    t_x = t * bt + lax.broadcasted_iota(jnp.int32, (bt, bk), 0)
    t_dy = t * bt + lax.broadcasted_iota(jnp.int32, (bt, bn), 0)
    x = plgpu.load(
      x_ref.at[pl.ds(t * bt, bt), pl.ds(pid_k * bk, bk)],
      mask=(t_x < tokens) & (k_idx < k),
      other=0.0,
    )
    dy = plgpu.load(
      dy_ref.at[pl.ds(t * bt, bt), pl.ds(pid_n * bn, bn)],
      mask=(t_dy < tokens) & (n_idx < n),
      other=0.0,
    )
    return acc + lax.dot_general(
      x,
      dy,
      (((0,), (0,)), ((), ())),
      precision=dot_precision,
      preferred_element_type=jnp.float32,
    )

  grad = lax.fori_loop(
    0, pl.cdiv(tokens, bt), accumulate, jnp.zeros((bk, bn), jnp.float32)
  )

  # The shard's global offset: stochastic rounding hashes global indices.
  scalars, apply, key, shard_row, shard_col, layer_index = read_kernel_scalars(
    scalars_ref, scalars_treedef
  )
  # Stacked refs are [L, K, N]: one indexer, the layer first (Triton's
  # lowering takes a single indexer per load or store).
  layer = (layer_index,) if stacked else ()

  # The epilogue runs on column chunks of the accumulator: fewer live
  # registers (W and every state tile are float32 beside it).
  chunk = bn // config.epilogue_split
  skipped = jnp.zeros((), jnp.int32)
  grad_sq = jnp.zeros((), jnp.float32)
  for c, grad_chunk in enumerate(
    jnp.split(grad, config.epilogue_split, axis=1)
  ):
    col0 = pid_n * bn + c * chunk
    row_idx = pid_k * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    col_idx = col0 + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)

    def tile(ref, divisor):  # pylint: disable=cell-var-from-loop
      """The chunk's window of a leaf whose columns each cover ``divisor``
      of the kernel's, and which of its elements exist. A chunk is one
      quantization block: its scales are a ``[bk, 1]`` column, its 4-bit
      codes ``[bk, chunk / 2]``."""
      width = chunk // divisor
      leaf_cols = col0 // divisor + lax.broadcasted_iota(
        jnp.int32, (bk, width), 1
      )
      exists = (row_idx < k) & (leaf_cols < ref.shape[-1])
      window = (pl.ds(pid_k * bk, bk), pl.ds(col0 // divisor, width))
      return ref.at[layer + window], exists

    def load(ref, divisor):  # pylint: disable=cell-var-from-loop
      window, exists = tile(ref, divisor)
      return plgpu.load(
        window, mask=exists, other=0 if ref.dtype == jnp.int8 else 0.0
      )

    # The kernel's elements of the chunk that exist.
    mask = tile(w_ref, 1)[1]
    w = load(w_ref, 1)
    state = jax.tree.unflatten(
      state_treedef, [load(r, d) for r, d in zip(state_refs, divisors)]
    )
    new_w, new_state, updated = apply_update(
      optimizer,
      grad_chunk,
      w,
      state,
      scalars,
      apply,
      rounding_key=key,
      indices=(shard_row + row_idx, shard_col + col_idx),
      valid=mask,
    )
    for ref, value, divisor in zip(
      [w_out_ref, *state_out_refs],
      [new_w, *jax.tree.leaves(new_state)],
      [1, *divisors],
    ):
      window, window_mask = tile(ref, divisor)
      plgpu.store(window, value, mask=window_mask)
    # Masked-out elements loaded as 0 have a finite gradient: never counted.
    skipped += jnp.sum(jnp.where(mask & ~updated, 1, 0).astype(jnp.int32))
    # Masked-out elements are 0 in the accumulator.
    grad_sq += jnp.sum(grad_chunk * grad_chunk)
  skipped_ref[pl.program_id(0)] = skipped
  grad_sq_ref[pl.program_id(0)] = grad_sq


def _tile_indices(pid, num_k, num_n, group_k):
  """Grouped launch order: ``group_k`` K-blocks per N-block, then the next."""
  programs_per_group = group_k * num_n
  first_k = (pid // programs_per_group) * group_k
  group_size = jnp.minimum(num_k - first_k, group_k)
  pid_k = first_k + (pid % programs_per_group) % group_size
  pid_n = (pid % programs_per_group) // group_size
  return pid_k, pid_n


def triton_update(
  spec,
  x,
  dy,
  kernel,
  opt_state,
  scalars,
  apply,
  config: Optional[TritonConfig] = None,
  interpret: Optional[bool] = None,
  *,
  rounding_key=None,
  offset=None,
  layer_index=None,
):
  """Backend entry point: same contract as ``backends.xla_update``."""
  optimizer = spec.optimizer
  k, n = kernel.shape[-2:]
  x2 = x.reshape(-1, k)
  dy2 = dy.reshape(-1, n)
  tokens = x2.shape[0]
  quantized = quantization.has_quantized(opt_state)
  if config is None:
    config = default_config(
      tokens,
      k,
      n,
      max(x2.dtype.itemsize, dy2.dtype.itemsize),
      state_block=quantization.BLOCK_SIZE if quantized else None,
    )
  check_config(config, quantized)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"

  # int8 codes travel as int8 (their float8 container is for jax.grad only).
  kernel_state = quantization.codes_as_int8(opt_state)
  divisors = tuple(quantization.column_divisors(kernel_state))
  state_leaves, state_treedef = jax.tree.flatten(kernel_state)
  scalar_vector, scalars_treedef = pack_kernel_scalars(
    scalars, apply, rounding_key, offset, layer_index
  )

  grid = (pl.cdiv(k, config.block_k) * pl.cdiv(n, config.block_n),)
  kernel_fn = functools.partial(
    _fused_kernel,
    optimizer=optimizer,
    state_treedef=state_treedef,
    scalars_treedef=scalars_treedef,
    tokens=tokens,
    k=k,
    n=n,
    config=config,
    # The precision nn.Dense's dW would have (XLA's, the reference's): for
    # float32 activations on a GPU the default is TF32, 'highest' IEEE.
    dot_precision=spec.precision,
    divisors=divisors,
    stacked=layer_index is not None,
  )
  out_shape = (
    [jax.ShapeDtypeStruct(kernel.shape, kernel.dtype)]
    + [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state_leaves]
    + [jax.ShapeDtypeStruct(grid, jnp.int32)]
    + [jax.ShapeDtypeStruct(grid, jnp.float32)]
  )
  # Inputs: scalars, x, dy, kernel, *state. Kernel and state update in place.
  aliases = {3 + i: i for i in range(1 + len(state_leaves))}
  outputs = pl.pallas_call(
    kernel_fn,
    out_shape=out_shape,
    grid=grid,
    input_output_aliases=aliases,
    interpret=interpret,
    compiler_params=plgpu.CompilerParams(
      num_warps=config.num_warps, num_stages=config.num_stages
    ),
    name="forge_fused_dense_update",
  )(scalar_vector, x2, dy2, kernel, *state_leaves)
  new_kernel = outputs[0]
  new_state = jax.tree.unflatten(state_treedef, outputs[1:-2])
  if quantized:
    new_state = quantization.codes_as_container(new_state)
  return new_kernel, new_state, jnp.sum(outputs[-2]), jnp.sum(outputs[-1])
