"""Weight-update backends of the fused dense op, and the switch between them.

A backend is a function
``(spec, x, dy, kernel, opt_state, scalars, apply, *, step=None,
layer_index=None) -> (kernel, opt_state, skipped)``
that forms ``dW = x.T @ dy`` (contracting every axis but the last) and applies
the optimizer rule. With a ``layer_index`` (an int32 scalar), ``kernel`` and
every ``opt_state`` leaf are stacked on a leading layer axis, only that layer
is stepped, and the whole stacks come back (updated in place). ``'xla'`` is
the reference: plain XLA ops, the specification, and the default where no
GPU kernel applies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax.ops import stacks
from forge_jax.ops.update import apply_update


def weight_gradient(x, dy, precision=None):
  """``dW = x.T @ dy`` in float32, with the dimension numbers autodiff uses."""
  batch_axes = tuple(range(x.ndim - 1))
  return lax.dot_general(x, dy, ((batch_axes, batch_axes), ((), ())),
                         precision=precision,
                         preferred_element_type=jnp.float32)


def xla_update(spec, x, dy, kernel, opt_state, scalars, apply, *, step=None,
               layer_index=None):
  """Reference backend: ``dW`` through XLA, then the elementwise rule.

  ``step`` (the layer's count, an integer scalar; None: 0) and
  ``spec.layer_id`` seed stochastic rounding.
  """
  return apply_gradient(spec, weight_gradient(x, dy, spec.precision), kernel,
                        opt_state, scalars, apply, step=step,
                        layer_index=layer_index)


def apply_gradient(spec, grad, kernel, opt_state, scalars, apply, *, step=None,
                   layer_index=None):
  """The elementwise rule on a whole float32 ``grad``, updating in place:
  ``(new_kernel, new_state, skipped)``.

  With a ``layer_index``, ``kernel`` and ``opt_state`` are stacks: the
  layer's entries are stepped and written back with
  ``dynamic_update_slice``, which XLA fuses with the update and runs in place.
  """
  new_kernel, new_state, updated = apply_update(
      spec.optimizer, grad, kernel, opt_state, scalars, apply,
      order_in_place=True, step=step, layer_id=spec.layer_id,
      layer_index=layer_index)
  return (stacks.with_layer_entry(kernel, new_kernel, layer_index),
          stacks.with_layer_entries(opt_state, new_state, layer_index),
          jnp.sum(jnp.logical_not(updated), dtype=jnp.int32))


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def select(implementation: str, x, dy, kernel, optimizer):
  """The backend for ``implementation``; 'auto' picks the fastest that applies.

  'auto' uses the Pallas-Triton kernel on a GPU when it supports the call,
  and otherwise falls back to the XLA reference. An explicit
  'triton' on a machine without a GPU runs the kernel in Pallas interpret
  mode; where the kernel cannot run the call it raises and says why.
  """
  if implementation == "xla":
    return xla_update
  from forge_jax.ops import triton_kernel  # pylint: disable=import-outside-toplevel
  if implementation == "triton":
    triton_kernel.check_supported(x, dy, kernel, optimizer)
    return triton_kernel.triton_update
  if implementation == "auto":
    if _on_gpu() and triton_kernel.unsupported_reason(x, dy, kernel, optimizer) is None:
      return triton_kernel.triton_update
    return xla_update
  raise ValueError(f"{implementation=} must be 'auto', 'xla' or 'triton'")
