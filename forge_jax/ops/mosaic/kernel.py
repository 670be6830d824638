"""The Mosaic GPU kernel's entry point: dW tiles by wgmma, the update fused.

A persistent kernel (one CTA per SM) walks the kernel's tiles. In each CTA a
memory warpgroup streams ``x`` and ``dy`` blocks into a ring of
shared-memory buffers with TMA, the steps numbered across the CTA's tiles,
while compute warpgroups accumulate ``dW = x.T @ dy`` with wgmma (``x``'s
block is the transposed A operand), each for its ``tile_k x tile_n`` part,
in float32 registers. A step's buffers are released after the next step's
``wgmma_wait(1)`` (the last step's once the accumulator is read), when the
wgmma reading them is known to be done. The epilogue then walks each part
in ``epilogue_k x epilogue_n`` sub-tiles: TMA loads of the kernel and state
sub-tiles, the optimizer rule in registers
(:func:`forge_jax.ops.update.apply_update`, the function the XLA reference
applies to the whole array), and TMA stores of the new values over the old
ones. ``dW`` never reaches device memory; its per-row sums of squares are
written out beside the skipped counts (:func:`counts_shape`). The
schedule (:class:`~forge_jax.ops.mosaic.config.MosaicConfig`) says which warpgroup
runs what: :mod:`forge_jax.ops.mosaic.inline` or
:mod:`forge_jax.ops.mosaic.pingpong`; the default config is the first of
:func:`~forge_jax.ops.mosaic.config.ranked_configs` that fits.

The kernel runs without Mosaic GPU's automatic warpgroup barriers
(``unsafe_no_auto_barriers``): every barrier it needs is explicit.

Stacked ``[L, K, N]`` variables (``layer_index``,
:mod:`forge_jax.ops.stacks`) are ``jax.new_ref`` buffers the kernel updates
in place (aliased in and out) at the layer's index, a TMA coordinate: no
slice of a stack goes in or out of the call. An unstacked kernel and state
are updated in place too, behind optimization barriers that keep XLA's
dynamic-slice fusion from handing the call slices of a loop's stacks; under
``jax.vmap`` they are written to separate outputs (an in-place launch cannot
be batched).

Coverage: 16-bit activations (wgmma's transposed operand), float32 or
bfloat16 kernels (bfloat16 stochastically rounded too), float32, bfloat16 or
int8 block-64 states (4-bit second moments where Mosaic GPU lowers
``concatenate``: :func:`forge_jax.ops.mosaic.compat.lowers_concatenate`),
shapes that divide into whole tiles. Other calls get a
reason from :func:`unsupported_reason`; 'auto' then takes another backend
(:func:`forge_jax.ops.backends.select`).

Low precision (:mod:`forge_jax.quantization`, the reference's functions):
stochastic rounding hashes each element's global row and column (the tile's
offset plus an iota, plus the shard's ``offset`` under tensor parallelism)
and the layer's rounding key, which travels with the scalars (in two 16-bit
halves, exact in float32), so the kernel draws the reference's bits. int8
states: the codes arrive as int8 (bitcast from their float8 container
outside the kernel) and go through shared memory by TMA like the other
leaves; their block scales do not (:mod:`forge_jax.ops.mosaic.epilogue`
says why). The warpgroup lowering lacks pointwise ops on 8-bit vectors (the
quantizer selects codes as int32).

Off-GPU the kernel runs in Mosaic GPU's interpret mode (how the CPU tests
check it), which simulates the warpgroups, shared memory, TMA and barriers;
its wgmma takes no transposed operand, so there ``x`` arrives transposed.
"""

from __future__ import annotations

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
from forge_jax.ops.mosaic import compat
from forge_jax.ops.mosaic.config import (
  MAX_BARRIERS,
  MAX_TOKENS_PER_SM_SHARE,
  SHARED_MEMORY_BUDGET,
  MosaicConfig,
  default_config,
  epilogue_buffers,
  fitting_config,
  num_sms,
  shared_memory_bytes,
  storage_itemsizes,
)
from forge_jax.ops.mosaic.inline import inline_schedule
from forge_jax.ops.mosaic.pingpong import pingpong_schedule
from forge_jax.ops.mosaic.pipeline import Pipeline
from forge_jax.ops.update import pack_kernel_scalars

_ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16)
_STORAGE_DTYPES = (jnp.float32, jnp.bfloat16)
#: int8 states: codes in their one-byte container and float32 block scales.
_STATE_DTYPES = _STORAGE_DTYPES + (quantization.CODES_CONTAINER,)


def unsupported_reason(
  x, dy, kernel, optimizer, config: Optional[MosaicConfig] = None
) -> Optional[str]:
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
  if (
    quantization.has_4bit(state)
    and jax.default_backend() == "gpu"
    and not compat.lowers_concatenate()
  ):
    return (
      "4-bit second moments (second_moment_bits=4) need a JAX whose Mosaic "
      f"GPU lowering has concatenate (0.11 or later; this is {jax.__version__})"
      "; implementation='triton' and 'xla' take them"
    )
  for leaf in jax.tree.leaves(state):
    if jnp.dtype(leaf.dtype) not in map(jnp.dtype, _STATE_DTYPES):
      return (
        f"optimizer state dtype {leaf.dtype} is not supported (float32, "
        "bfloat16 or int8 blocks)"
      )
  activation_itemsize = jnp.dtype(x.dtype).itemsize
  itemsizes = storage_itemsizes(kernel, state)
  k, n = kernel.shape[-2:]
  tokens = math.prod(x.shape[:-1])
  if tokens == 0:
    return f"{x.shape=} has no tokens"
  config = config or fitting_config(
    tokens,
    k,
    n,
    activation_itemsize,
    itemsizes,
    quantized,
    optimizer.draws_random_bits,
  )
  if quantized and config.epilogue_n != quantization.BLOCK_SIZE:
    return (
      f"int8 states are quantized in blocks of "
      f"{quantization.BLOCK_SIZE} columns: epilogue_n="
      f"{config.epilogue_n} must be {quantization.BLOCK_SIZE}"
    )
  for name, size, tile in (
    ("in_features", k, config.tile_k),
    ("features", n, config.cta_tile_n),
    ("tokens", tokens, config.tile_t),
  ):
    if size % tile:
      return f"{name}={size} must be a multiple of {tile}"
  barriers = epilogue_buffers(config) * len(itemsizes)
  if barriers > MAX_BARRIERS:
    return (
      f"{config} loads {len(itemsizes)} leaves into each of "
      f"{epilogue_buffers(config)} epilogue buffers: {barriers} "
      f"barriers, more than Mosaic GPU's {MAX_BARRIERS} per group"
    )
  needed = shared_memory_bytes(config, activation_itemsize, itemsizes)
  if needed * config.ctas_per_sm > SHARED_MEMORY_BUDGET:
    return (
      f"the tiles of {config} need {needed} bytes of shared memory "
      f"per CTA, {config.ctas_per_sm} CTAs per SM: more than "
      f"{SHARED_MEMORY_BUDGET}"
    )
  return None


def fills_the_gpu(x, kernel, optimizer) -> bool:
  """Whether the default config's ``K x N`` tiles keep the SMs busy for this
  many tokens (``tokens * SMs / tiles`` at most
  :data:`~forge_jax.ops.mosaic.config.MAX_TOKENS_PER_SM_SHARE`); where they
  do not, XLA's GEMM and update are faster."""
  tiles = default_config(x, kernel, optimizer).num_tiles(*kernel.shape[-2:])
  tokens = math.prod(x.shape[:-1])
  return tokens * num_sms() <= MAX_TOKENS_PER_SM_SHARE * max(tiles, 1)


def check_supported(x, dy, kernel, optimizer, config=None):
  """Raises ``ValueError`` with :func:`unsupported_reason`'s reason, if any."""
  reason = unsupported_reason(x, dy, kernel, optimizer, config)
  if reason is not None:
    raise ValueError(f"implementation='mosaic' cannot run this call: {reason}")


def skipped_rows_shape(
  config: MosaicConfig, num_tiles: int, num_ctas: int
) -> tuple:
  """The kernel's skipped-element counts, one float32 vector of per-row
  counts a row (exact: an entry counts at most the elements of one row of
  the tiles it sums); the caller sums them. Under ``'inline'`` each compute
  warpgroup of each CTA sums its counts over all its tiles and writes one
  row. Under ``'pingpong'`` the warpgroup that updates a tile writes one
  row a tile: a sum carried across its tiles' main loops would hold
  registers that schedule's compute warpgroups lack (on an H200, 4096 x
  14336 at 2048 tokens: 0.531 ms with the carry, 0.519 without). Every row
  is written: the output needs no initialization.

  The kernel sums no count across warps: Mosaic GPU's cross-warp reduction
  uses one shared-memory scratch at the same offset for every warpgroup, so
  two warpgroups reducing at once (the compute warpgroups of either
  schedule) could read each other's partial sums. The sums of squared
  ``dW`` elements (the layer's part of the gradient norm) come in the same
  shape, stacked with the counts in one output (:func:`counts_shape`)."""
  if config.schedule == "pingpong":
    return (num_tiles, config.epilogue_k)
  return (config.compute_wgs * num_ctas, config.epilogue_k)


def counts_shape(config: MosaicConfig, num_tiles: int, num_ctas: int) -> tuple:
  """The kernel's second output: the skipped counts, then the sums of
  squares, each :func:`skipped_rows_shape`."""
  return (2, *skipped_rows_shape(config, num_tiles, num_ctas))


def _fused_kernel(
  scalars_gmem,
  x_gmem,
  dy_gmem,
  storage_gmem,
  storage_out,
  counts_gmem,
  *,
  optimizer,
  state_treedef,
  scalars_treedef,
  config: MosaicConfig,
  interpret,
  stacked,
  divisors,
):
  """The kernel body: the config's schedule on this call's :class:`Pipeline`
  (whose docstring says what the refs hold)."""
  compat.register_missing_lowerings()  # before Mosaic GPU lowers this body
  pipeline = Pipeline(
    scalars_gmem,
    x_gmem,
    dy_gmem,
    storage_gmem,
    storage_out,
    counts_gmem.at[0],
    counts_gmem.at[1],
    optimizer=optimizer,
    state_treedef=state_treedef,
    scalars_treedef=scalars_treedef,
    config=config,
    interpret=interpret,
    stacked=stacked,
    divisors=divisors,
  )
  {"inline": inline_schedule, "pingpong": pingpong_schedule}[config.schedule](
    pipeline
  )
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def _num_ctas(num_tiles: int, config: MosaicConfig, interpret: bool) -> int:
  """``ctas_per_sm`` CTAs per SM (persistent), never more than there are
  tiles. Interpret mode simulates every CTA's threads on the CPU: two CTAs
  keep it quick and still check the persistent loop."""
  if interpret:
    return min(num_tiles, 2)
  return min(num_tiles, num_sms() * config.ctas_per_sm)


def mosaic_update(
  spec,
  x,
  dy,
  kernel,
  opt_state,
  scalars,
  apply,
  config: Optional[MosaicConfig] = None,
  interpret: Optional[bool] = None,
  *,
  rounding_key=None,
  offset=None,
  layer_index=None,
):
  """Backend entry point: same contract as ``backends.xla_update``."""
  optimizer = spec.optimizer
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if interpret and layer_index is not None:
    # Interpret mode writes separate outputs, not the stacks in place: step
    # the layer's entries and put them back (same values).
    new_kernel, new_state, skipped, grad_sq_norm = mosaic_update(
      spec,
      x,
      dy,
      stacks.layer_entry(kernel, layer_index),
      stacks.layer_entries(opt_state, layer_index),
      scalars,
      apply,
      config,
      interpret,
      rounding_key=rounding_key,
      offset=offset,
    )
    return (
      stacks.with_layer_entry(kernel, new_kernel, layer_index),
      stacks.with_layer_entries(opt_state, new_state, layer_index),
      skipped,
      grad_sq_norm,
    )
  config = config or default_config(x, kernel, optimizer)
  check_supported(x, dy, kernel, optimizer, config)
  k, n = kernel.shape[-2:]
  x2 = x.reshape(-1, k)
  dy2 = dy.reshape(-1, n)

  # int8 codes travel as int8 (their float8 container is for jax.grad only).
  kernel_state = quantization.codes_as_int8(opt_state)
  state_leaves, state_treedef = jax.tree.flatten(kernel_state)
  scalar_vector, scalars_treedef = pack_kernel_scalars(
    scalars, apply, rounding_key, offset, layer_index
  )
  kernel_fn = functools.partial(
    _fused_kernel,
    optimizer=optimizer,
    state_treedef=state_treedef,
    scalars_treedef=scalars_treedef,
    config=config,
    interpret=interpret,
    stacked=layer_index is not None,
    divisors=tuple([1] + quantization.column_divisors(kernel_state)),
  )
  storage = [kernel] + state_leaves
  num_tiles = config.num_tiles(k, n)
  num_ctas = _num_ctas(num_tiles, config, interpret)
  counts_type = jax.ShapeDtypeStruct(
    counts_shape(config, num_tiles, num_ctas), jnp.float32
  )
  mesh = plgpu.Mesh(
    grid=(num_ctas,),
    grid_names=("sm",),
    num_threads=config.num_warpgroups,
    thread_name="wg",
  )
  # Without Mosaic GPU's automatic warpgroup barriers around every smem
  # store and before every TMA load (13 a sub-tile in the epilogue, where
  # the rule's four warps should run apart): a warp reads and writes only
  # its own rows of an epilogue buffer, buffers are refilled or freed only
  # after commit_smem's barrier or a per-thread barrier arrival, and every
  # cross-warpgroup hand-off is a barrier all threads arrive on.
  call = functools.partial(
    _call_kernel,
    kernel_fn,
    counts_type,
    mesh,
    plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
      unsafe_no_auto_barriers=True,
    ),
  )
  if interpret:
    # Separate outputs: interpret mode takes no refs.
    outputs = call(
      scalar_vector, x2.T, dy2, *storage, in_place=False, interpret=True
    )
  elif layer_index is not None:
    outputs = call(
      scalar_vector, x2, dy2, *storage, in_place=True, interpret=False
    )
  else:
    outputs = _in_place_unless_batched(call)(scalar_vector, x2, dy2, *storage)
  new_storage, counts = outputs[:-1], outputs[-1]
  new_state = quantization.codes_as_container(
    jax.tree.unflatten(state_treedef, new_storage[1:])
  )
  skipped, grad_sq_norm = _sum_counts(counts)
  return new_storage[0], new_state, skipped, grad_sq_norm


#: The most elements XLA's GPU compiler sums to a scalar in one launch (a
#: row reduction: 1024 threads of 16 elements); it splits a larger sum into
#: two launches.
SINGLE_LAUNCH_SUM = 1024 * 16


def _sum_counts(counts):
  """``(skipped, grad_sq_norm)``: the kernel's per-row counts and sums of
  squares summed in one variadic reduction (one pass over the output); the
  counts in int32, exact past float32's 2**24. The rows are first folded
  (slices added, which XLA fuses into the reduction) to at most
  ``SINGLE_LAUNCH_SUM`` elements, so the sum is one launch."""
  rows, width = counts.shape[-2:]
  parts = -(-rows * width // SINGLE_LAUNCH_SUM)
  height = -(-rows // parts)
  padded = jnp.pad(counts, ((0, 0), (0, parts * height - rows), (0, 0)))
  fold = lambda array: sum(
    array[i * height : (i + 1) * height] for i in range(parts)
  )
  return lax.reduce(
    (fold(padded[0].astype(jnp.int32)), fold(padded[1])),
    (jnp.int32(0), jnp.float32(0)),
    lambda a, b: (a[0] + b[0], a[1] + b[1]),
    (0, 1),
  )


_KERNEL_NAME = "forge_fused_dense_update_mosaic"


def _call_kernel(
  kernel_fn, counts_type, mesh, compiler_params, *args, in_place, interpret
):
  """One launch: ``(*new_storage, counts)`` from
  ``(scalar_vector, x, dy, *storage)``.

  In place, the storage goes in as refs, aliased in and out (a stack's layer
  is written at its index, a TMA coordinate), through ``pl.kernel`` in
  ``pl.run_state`` (``plgpu.kernel``'s batching wrapper rejects refs, and
  the refs stay inside the call). Otherwise the new values are separate
  outputs, which interpret mode needs (it takes no refs) and ``jax.vmap``
  can batch.
  """
  scalar_vector, x, dy, *storage = args
  if in_place:

    def launch(refs):
      pl.kernel(
        lambda s, x, dy, *refs: kernel_fn(
          s, x, dy, refs[:-1], refs[:-1], refs[-1]
        ),
        out_type=(),
        mesh=mesh,
        compiler_params=compiler_params,
        name=_KERNEL_NAME,
      )(scalar_vector, x, dy, *refs)

    # Uninitialized (the kernel writes every entry): no fill kernel.
    counts = lax.empty(counts_type.shape, counts_type.dtype)
    return list(pl.run_state(launch)((*storage, counts)))
  num = len(storage)
  return plgpu.kernel(
    lambda s, x, dy, *refs: kernel_fn(
      s, x, dy, refs[:num], refs[num : 2 * num], refs[-1]
    ),
    out_type=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in storage]
    + [counts_type],
    grid=mesh.grid,
    grid_names=mesh.grid_names,
    num_threads=mesh.num_threads,
    thread_name=mesh.thread_name,
    compiler_params=compiler_params,
    interpret=compat.interpret_params() if interpret else None,
    kernel_name=_KERNEL_NAME,
  )(scalar_vector, x, dy, *storage)


def _in_place_unless_batched(call):
  """An unstacked call in place, behind optimization barriers; under
  ``jax.vmap`` (``nn.vmap``) the batched call writes separate outputs.

  Inside a loop (``nn.scan``'s transpose, any ``lax.scan``) XLA's
  dynamic-slice fusion would hand an aliased call slices of the loop's
  stacks, and the updated kernel and state would come back as zeros; the
  barriers keep the slices out of the call. Outside a loop they cost
  nothing, and a step that donates the state writes it where it lies, with
  no copy. In-place launches cannot be batched (a launch takes a batch of
  one), so a batched call takes the separate outputs, which ``plgpu.kernel``
  batches.
  """

  @jax.custom_batching.custom_vmap
  def in_place(*args):
    scalar_vector, x, dy, *storage = args
    storage = jax.lax.optimization_barrier(storage)
    *new_storage, counts = call(
      scalar_vector, x, dy, *storage, in_place=True, interpret=False
    )
    return [*jax.lax.optimization_barrier(new_storage), counts]

  @in_place.def_vmap
  def _batched(axis_size, in_batched, *args):
    del axis_size
    axes = [0 if batched else None for batched in in_batched]
    separate = functools.partial(call, in_place=False, interpret=False)
    outputs = jax.vmap(separate, in_axes=axes)(*args)
    return outputs, [True] * len(outputs)

  return in_place
