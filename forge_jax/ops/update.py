"""The elementwise step every backend applies to a kernel (or one tile of it)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import quantization
from forge_jax.ops import stacks
from forge_jax.optimizers import ForgeOptimizer


def true_after(value: jax.Array) -> jax.Array:
  """A boolean True that XLA must compute after the scalar ``value``.

  ``isnan(v) | ~isnan(v)`` is always true and XLA does not fold it: AND it
  into a predicate to order an in-place write after a read that has no
  other data dependency (optimization barriers are gone by then).
  """
  return jnp.logical_or(jnp.isnan(value), jnp.logical_not(jnp.isnan(value)))


def apply_update(
  optimizer: ForgeOptimizer,
  grad: jax.Array,
  kernel: jax.Array,
  state: NamedTuple,
  scalars: NamedTuple,
  apply: jax.Array,
  *,
  order_in_place: bool = False,
  rounding_key: Optional[jax.Array] = None,
  indices: Optional[tuple] = None,
  valid: Optional[jax.Array] = None,
  layer_index: Optional[jax.Array] = None,
  guard_results: bool = True,
):
  """One optimizer step on ``kernel`` (2-D: a kernel or a tile of one),
  skipping non-finite grads.

  The rule runs in float32 whatever the storage dtypes; its kernel half
  reads this step's new state in float32, before it is rounded or quantized
  for storage (as optax does), and every backend computes the same bits.
  Elements whose gradient is not finite, whose new kernel or state would not
  be finite as stored (:func:`finite_result`; with ``guard_results``, which
  the fused kernels set, and the XLA reference for int8 states: in
  registers the check costs no memory, while over whole arrays it makes XLA
  keep a kernel-sized temporary), and every
  element when ``apply`` is false, keep their old kernel and state bit for
  bit (int8 states: see :func:`forge_jax.quantization.update`).

  Storage (:mod:`forge_jax.quantization`, the one place that rounds,
  quantizes and dequantizes): state leaves are read with ``load`` and written
  with ``update``; the new kernel is rounded with ``round_weights``
  (stochastic rounding, and the stochastic rounding of 4-bit second
  moments' levels, draw their bits from the layer's ``rounding_key``,
  :func:`forge_jax.quantization.rounding_key` of its seed, id and step, and
  the global ``indices`` of the elements: ``(rows, cols)`` broadcastable to
  ``kernel``, default a whole-kernel iota). ``valid`` masks the elements of
  a tile that exist (quantization blocks count the others as zero).

  ``order_in_place`` (for whole arrays compiled by XLA for the CPU, see
  :func:`forge_jax.ops.backends.apply_gradient`) orders the state's stores
  after the kernel's fusion, which reads the old state, so XLA can update
  every donated buffer in place instead of copying it.

  With a ``layer_index``, ``kernel`` and ``state`` are stacks on a leading
  layer axis (:mod:`forge_jax.ops.stacks`) and the layer's entries are
  stepped; they are read where they are used, so XLA fuses the reads
  instead of copying the layer out of the stacks.

  Returns:
    ``(new_kernel, new_state, updated)``, where ``updated`` is a boolean
    array, false where the element was left untouched (the layer's entries
    with a ``layer_index``).
  """
  grad = grad.astype(jnp.float32)

  stochastic = optimizer.weight_rounding == "stochastic"

  def rule(grad, kernel_f32, old_state, stored_state):
    """The stepped kernel (float32), its stochastically rounded form (None
    when rounding to nearest), the new state (float32) and where to keep
    them."""
    new_state_f32 = optimizer.update_state(grad, kernel_f32, old_state, scalars)
    read = old_state if optimizer.kernel_reads_old_state else new_state_f32
    stepped = optimizer.update_kernel(grad, kernel_f32, read, scalars)
    rounded = None
    if stochastic:
      rounded = quantization.round_weights(
        stepped,
        kernel.dtype,
        rounding=optimizer.weight_rounding,
        key=rounding_key,
        indices=indices,
      )
    ok = jnp.logical_and(jnp.isfinite(grad), apply)
    if guard_results:
      new_values = [
        (stepped, kernel.dtype)
        if rounded is None
        else (rounded.astype(jnp.float32), jnp.float32),
        *zip(
          jax.tree.leaves(new_state_f32),
          quantization.storage_dtypes(stored_state),
        ),
      ]
      ok = jnp.logical_and(
        ok,
        finite_result(
          new_values,
          kernel_f32,
          old_state,
          stored_state,
          scalars,
          multiply_add=not quantization.has_quantized(state),
        ),
      )
    return stepped, rounded, new_state_f32, ok

  stored_kernel = stacks.layer_entry(kernel, layer_index)
  kernel_f32 = stored_kernel.astype(jnp.float32)
  stored = stacks.layer_entries(state, layer_index)
  stepped, rounded, new_state, ok = rule(
    grad, kernel_f32, quantization.load_state(stored, grad.shape[-1]), stored
  )
  if rounded is None:
    new_kernel = jnp.where(ok, stepped, kernel_f32).astype(kernel.dtype)
  else:
    # The old bits where skipped, without hashing again (rounding them
    # would give them back: stochastic rounding adds bits below a
    # bfloat16's mantissa).
    new_kernel = jnp.where(ok, rounded, stored_kernel)
  store_ok, store_index, stored_at_store = ok, layer_index, stored
  if order_in_place:
    # The kernel's fusion reads the old state; the state's fusions overwrite
    # it. Depending on a reduction of the new kernel (which XLA cannot
    # duplicate into the state's fusions) orders the writes after the read,
    # so XLA updates every buffer in place instead of copying the old state.
    after_kernel = true_after(jnp.sum(new_kernel.astype(jnp.float32)))
    if layer_index is not None:
      # XLA copies a layer's old entry out of a stack it then updates in
      # place. Reading it at an index that depends on the new kernel
      # schedules the copy after this kernel's update: one layer's copies
      # are not all alive at once.
      store_index = jnp.where(after_kernel, layer_index, 0)
      stored_at_store = stacks.layer_entries(state, store_index)
    # Recompute the new state (and where to store it) for the stores from
    # barrier-separated inputs: no float32 copy of it, nor of the mask,
    # stays alive between the two fusions.
    grad_s, kernel_s, old_s = lax.optimization_barrier(
      (
        grad,
        stacks.layer_entry(kernel, store_index).astype(jnp.float32),
        quantization.load_state(stored_at_store, grad.shape[-1]),
      )
    )
    _, _, new_state, ok_s = rule(grad_s, kernel_s, old_s, stored_at_store)
    store_ok = jnp.logical_and(ok_s, after_kernel)
  new_state = quantization.update_state(
    new_state,
    stored_at_store,
    store_ok,
    valid,
    level_bits=_level_bits(state, rounding_key, grad.shape, indices),
  )
  return new_kernel, new_state, ok


def _level_bits(state, rounding_key, shape, indices):
  """The random bits of 4-bit levels (None without 4-bit leaves)."""
  if not quantization.has_4bit(state):
    return None
  if rounding_key is None:
    raise ValueError(
      "4-bit second moments are rounded stochastically: the update needs "
      "the layer's rounding_key (ForgeOptimizer.draws_random_bits)"
    )
  return quantization.element_bits(rounding_key, shape, indices)


def finite_result(
  new_values,
  kernel,
  state,
  stored_state,
  scalars,
  *,
  multiply_add=False,
) -> jax.Array:
  """False where the rule made a non-finite kernel or state element from a
  finite one, as stored.

  Such an element keeps its old values and counts as skipped, like one with
  a non-finite gradient: no update writes a NaN or an infinity from finite
  inputs unreported. Non-finite inputs propagate as in optax, and a NaN
  learning rate (a wiped layer's poison, see ``fused_dense.step_scalars``)
  is let through on purpose.

  ``new_values`` pairs each new kernel or state value (float32) with the
  dtype it is stored in: float32 for float32 leaves, for int8 leaves (a NaN
  or infinity becomes a block's NaN scale) and for the stochastically
  rounded kernel, passed rounded (it may round up past bfloat16's largest
  value). A value rounded to nearest into a narrower float is compared with
  that dtype's overflow threshold
  (:func:`forge_jax.quantization.rounds_to_finite`) instead of rounded.

  ``state`` is the old state as read (float32), ``stored_state`` as stored:
  an int8 leaf holds a NaN or an infinity only as a block's NaN scale (how
  quantization stores such a block), so its scales are checked, one value a
  block, instead of its elements.

  Each float32 value's ``x - x`` (or, with ``multiply_add``, ``x * 0``) is
  zero where ``x`` is finite and NaN where it is not; the terms are summed
  and compared once (Mosaic GPU lowers no negation of boolean vectors). The
  ``x * 0`` terms accumulate in one multiply-add a leaf instead of a
  subtraction and an add: fewer instructions in an issue-bound epilogue, the
  same mask. The int8 update keeps the subtractions, with which its
  registers spill less.
  """

  def term(x):
    return x * 0.0 if multiply_add else x - x

  def nan_where_not_finite(values):
    total = None
    for value in values:
      value = term(value.astype(jnp.float32))
      total = value if total is None else total + value
    return total

  made = nan_where_not_finite(
    v for v, dtype in new_values if dtype == jnp.float32
  )
  made_ok = True if made is None else made == made
  for value, dtype in new_values:
    if dtype != jnp.float32:
      made_ok = jnp.logical_and(
        made_ok, quantization.rounds_to_finite(value, dtype)
      )
  unquantized = jax.tree.map(
    lambda stored, read: None if quantization.is_quantized(stored) else read,
    stored_state,
    state,
    is_leaf=quantization.is_quantized,
  )
  given = nan_where_not_finite([kernel, *jax.tree.leaves(unquantized)])
  blocks = quantization.nan_where_blocks_not_finite(
    stored_state, kernel.shape[-1]
  )
  if blocks is not None:
    given = given + blocks
  return jnp.logical_or(
    made_ok,
    jnp.logical_or(jnp.isnan(given), jnp.isnan(scalars.neg_lr)),
  )


class KernelScalars(NamedTuple):
  """What a fused kernel reads from its scalar vector
  (:func:`pack_kernel_scalars`)."""

  scalars: NamedTuple  # the optimizer's
  apply: jax.Array  # bool
  rounding_key: jax.Array  # uint32: stochastic rounding's (0 without)
  shard_row: jax.Array  # int32: the shard's global offset (ditto)
  shard_col: jax.Array
  layer_index: jax.Array  # int32: the layer of stacked refs


def pack_kernel_scalars(
  scalars: NamedTuple,
  apply: jax.Array,
  rounding_key=None,
  offset=None,
  layer_index=None,
):
  """The optimizer's scalars, then ``apply``, the rounding key's high and low
  16 bits, the shard's offset ``(row, column)`` and the layer index, as one
  float32 vector (the integers are exact up to 2**24), and the optimizer
  scalars' treedef."""
  leaves, treedef = jax.tree.flatten(scalars)
  key = jnp.zeros((), jnp.uint32) if rounding_key is None else rounding_key
  key = jnp.asarray(key, jnp.uint32)
  offset = (0, 0) if offset is None else offset
  layer_index = 0 if layer_index is None else layer_index
  integers = (key >> 16, key & 0xFFFF, *offset, layer_index)
  vector = jnp.stack(
    [jnp.asarray(s, jnp.float32) for s in leaves]
    + [apply.astype(jnp.float32)]
    + [jnp.asarray(v).astype(jnp.float32) for v in integers]
  )
  return vector, treedef


def read_kernel_scalars(ref, treedef) -> KernelScalars:
  """Inside a kernel: the :func:`pack_kernel_scalars` vector ``ref``."""
  num = treedef.num_leaves
  values = [ref[i] for i in range(num + len(KernelScalars._fields))]
  key_high, key_low, *integers = (
    v.astype(jnp.int32) for v in values[num + 1 :]
  )
  key = key_high.astype(jnp.uint32) * jnp.uint32(1 << 16) + key_low.astype(
    jnp.uint32
  )
  return KernelScalars(
    jax.tree.unflatten(treedef, values[:num]),
    values[num] > 0.5,
    key,
    *integers,
  )
