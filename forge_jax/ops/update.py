"""The elementwise step every backend applies to a kernel (or one tile of it)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from forge_jax.optimizers import ForgeOptimizer


def apply_update(optimizer: ForgeOptimizer, grad: jax.Array, kernel: jax.Array,
                 state: NamedTuple, scalars: NamedTuple, apply: jax.Array):
  """One optimizer step on ``kernel`` (any shape), skipping non-finite grads.

  The rule runs in float32 whatever the storage dtypes; the results are cast
  back to the dtypes of ``kernel`` and ``state``. Elements whose gradient is
  not finite, and every element when ``apply`` is false, keep their old
  kernel and state values bit for bit.

  Returns:
    ``(new_kernel, new_state, updated)``, where ``updated`` is a boolean
    array, false where the element was left untouched.
  """
  grad = grad.astype(jnp.float32)
  kernel_f32 = kernel.astype(jnp.float32)
  state_f32 = jax.tree.map(lambda x: x.astype(jnp.float32), state)
  new_kernel, new_state = optimizer.update(grad, kernel_f32, state_f32, scalars)
  ok = jnp.logical_and(jnp.isfinite(grad), apply)
  new_kernel = jnp.where(ok, new_kernel, kernel_f32).astype(kernel.dtype)
  new_state = jax.tree.map(
      lambda new, old: jnp.where(ok, new, old.astype(jnp.float32)).astype(old.dtype),
      new_state, state)
  return new_kernel, new_state, ok
