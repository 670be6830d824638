"""The elementwise step every backend applies to a kernel (or one tile of it)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import quantization
from forge_jax.optimizers import ForgeOptimizer


def apply_update(optimizer: ForgeOptimizer, grad: jax.Array, kernel: jax.Array,
                 state: NamedTuple, scalars: NamedTuple, apply: jax.Array, *,
                 order_in_place: bool = False,
                 step: Optional[jax.Array] = None, layer_id: int = 0,
                 indices: Optional[tuple] = None,
                 valid: Optional[jax.Array] = None):
  """One optimizer step on ``kernel`` (2-D: a kernel or a tile of one),
  skipping non-finite grads.

  The rule runs in float32 whatever the storage dtypes, and its kernel half
  reads the state as stored (rounded to its storage dtype, or int8-quantized
  and dequantized), so every backend computes the same bits. Elements whose
  gradient is not finite, and every element when ``apply`` is false, keep
  their old kernel and state bit for bit (int8 states: see
  :func:`forge_jax.quantization.update`).

  Storage (:mod:`forge_jax.quantization`, the one place that rounds,
  quantizes and dequantizes): state leaves are read with ``load`` and written
  with ``update``; the new kernel is rounded with ``round_weights``
  (stochastic rounding draws its bits from ``(optimizer.rounding_seed,
  layer_id, step, row, column)``, the global ``indices`` of the elements:
  ``(rows, cols)`` broadcastable to ``kernel``, default a whole-kernel
  iota). ``valid`` masks the elements of a tile that exist (quantization
  blocks count the others as zero).

  ``order_in_place`` (for whole-array XLA backends) puts an optimization
  barrier between the two halves of the rule, so that no fusion needs a
  value another fusion overwrote and XLA can update every donated buffer in
  place instead of copying it.

  Returns:
    ``(new_kernel, new_state, updated)``, where ``updated`` is a boolean
    array, false where the element was left untouched.
  """
  grad = grad.astype(jnp.float32)
  kernel_f32 = kernel.astype(jnp.float32)
  ok = jnp.logical_and(jnp.isfinite(grad), apply)
  barrier = lax.optimization_barrier if order_in_place else (lambda x: x)

  def new_kernel_from(read_state):
    new = optimizer.update_kernel(grad, kernel_f32,
                                  quantization.load_state(read_state), scalars)
    return quantization.round_weights(
        jnp.where(ok, new, kernel_f32), kernel.dtype,
        rounding=optimizer.weight_rounding, seed=optimizer.rounding_seed,
        layer_id=layer_id, step=step, indices=indices)

  def new_state_from(old_state):
    new = optimizer.update_state(grad, kernel_f32,
                                 quantization.load_state(old_state), scalars)
    return quantization.update_state(new, old_state, ok, valid)

  if optimizer.kernel_reads_old_state:
    new_kernel = new_kernel_from(state)
    new_kernel, state = barrier((new_kernel, state))
    new_state = new_state_from(state)
  else:
    new_state = barrier(new_state_from(state))
    new_kernel = new_kernel_from(new_state)
  return new_kernel, new_state, ok
