"""The elementwise step every backend applies to a kernel (or one tile of it)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax.optimizers import ForgeOptimizer


def _as_f32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def apply_update(optimizer: ForgeOptimizer, grad: jax.Array, kernel: jax.Array,
                 state: NamedTuple, scalars: NamedTuple, apply: jax.Array, *,
                 order_in_place: bool = False):
  """One optimizer step on ``kernel`` (any shape), skipping non-finite grads.

  The rule runs in float32 whatever the storage dtypes, and its kernel half
  reads the state as stored (rounded to its storage dtype), so every backend
  computes the same bits. Elements whose gradient is not finite, and every
  element when ``apply`` is false, keep their old kernel and state bit for
  bit.

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
    new = optimizer.update_kernel(grad, kernel_f32, _as_f32(read_state), scalars)
    return jnp.where(ok, new, kernel_f32).astype(kernel.dtype)

  def new_state_from(old_state):
    new = optimizer.update_state(grad, kernel_f32, _as_f32(old_state), scalars)
    return jax.tree.map(
        lambda n, o: jnp.where(ok, n, o.astype(jnp.float32)).astype(o.dtype),
        new, old_state)

  if optimizer.kernel_reads_old_state:
    new_kernel = new_kernel_from(state)
    new_kernel, state = barrier((new_kernel, state))
    new_state = new_state_from(state)
  else:
    new_state = barrier(new_state_from(state))
    new_kernel = new_kernel_from(new_state)
  return new_kernel, new_state, ok
