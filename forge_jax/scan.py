"""Scan over layers whose backward updates stacked ForgeDense kernels in place.

``nn.scan`` over layers that hold ForgeDense variables works, but its
transpose builds *new* stacked buffers for every cotangent, so the updated
kernels and states of all layers exist beside the old ones until the step
ends: worse than optax. :func:`scan_layers` keeps ``nn.scan``'s variable
layout (every collection stacked on a leading layer axis) and replaces the
backward pass with a hand-written reverse loop: for layer ``l = L-1 .. 0`` it
slices the layer's variables out of the stacks, recomputes the layer's
forward pass (remat), runs its backward (each ForgeDense updates its kernel
and state there), and writes the updated variables back into the carried
stacks with ``dynamic_update_slice``, which XLA does in place. Other
parameters of the stack (norm scales) get ordinary stacked gradients.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
from jax import lax
import flax.linen as nn

from forge_jax.linen import FORGE_COLLECTION


def scan_layers(block: type[nn.Module], length: int,
                num_broadcast_args: int = 0,
                metadata_params: dict | None = None) -> type[nn.Module]:
  """``nn.scan`` over ``block`` with FORGE's in-place backward pass.

  Use it where you would write::

    nn.scan(nn.remat(block), variable_axes={True: 0},
            split_rngs={'params': True},
            in_axes=(nn.broadcast,) * num_broadcast_args, length=length)

  ``metadata_params`` is nn.scan's (e.g. ``{nn.PARTITION_NAME: 'layers'}``
  to name the stacking axis in partitioned variables' metadata).
  ``block(...)(carry, *broadcast_args)`` must return ``(carry, None)``. The
  variables have exactly nn.scan's layout, so checkpoints move between the
  two. Each layer is recomputed in the backward pass (nn.remat's default:
  nothing saved inside a layer). The broadcast arguments (RoPE tables,
  masks) are treated as constants: their cotangent is zero.
  """
  scanned = nn.scan(block, variable_axes={True: 0},
                    split_rngs={"params": True},
                    in_axes=(nn.broadcast,) * num_broadcast_args,
                    length=length, metadata_params=metadata_params or {})

  class ForgeScan(scanned):  # pylint: disable=missing-class-docstring
    def __call__(self, carry, *broadcast_args):
      if self.is_initializing():
        return super().__call__(carry, *broadcast_args)
      fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(block)
                if f.init and f.name not in ("parent", "name")}
      layer = block(**fields, parent=None)
      return _scan_apply(layer, length, carry, self.variables,
                         tuple(broadcast_args)), None

  ForgeScan.__name__ = f"ForgeScan{block.__name__}"
  return ForgeScan


def _scan_apply(layer: nn.Module, length: int, carry, variables, broadcast_args):
  """``carry`` through ``length`` layers; a custom_vjp over the stacks."""

  def layer_fn(layer_variables, x, args):
    out, _ = layer.apply(layer_variables, x, *args)
    return out

  @jax.custom_vjp
  def run(carry, variables, args):
    out, _ = lax.scan(lambda x, v: (layer_fn(v, x, args), None), carry, variables)
    return out

  def run_fwd(carry, variables, args):
    # Keep each layer's input only: the layer is recomputed in the backward.
    out, inputs = lax.scan(lambda x, v: (layer_fn(v, x, args), x), carry,
                           variables)
    return out, (variables, inputs, args)

  def run_bwd(residuals, d_out):
    variables, inputs, args = residuals
    forge = variables.get(FORGE_COLLECTION, {})
    others = {k: v for k, v in variables.items() if k != FORGE_COLLECTION}

    def body(i, loop_carry):
      d_x, forge_stack, others_grad = loop_carry
      index = length - 1 - i
      take = lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False)
      # Layer `index` is not updated yet: its slice holds the old values.
      layer_vars = jax.tree.map(take, {**others, FORGE_COLLECTION: forge_stack})
      _, layer_vjp = jax.vjp(lambda v, x: layer_fn(v, x, args), layer_vars,
                             take(inputs))
      d_vars, d_x = layer_vjp(d_x)
      put = lambda stack, value: lax.dynamic_update_index_in_dim(
          stack, value, index, 0)
      forge_stack = jax.tree.map(put, forge_stack, d_vars[FORGE_COLLECTION])
      others_grad = jax.tree.map(
          put, others_grad, {k: d_vars[k] for k in others_grad})
      return d_x, forge_stack, others_grad

    d_carry, new_forge, others_grad = lax.fori_loop(
        0, length, body, (d_out, forge, jax.tree.map(jnp.zeros_like, others)))
    d_variables = dict(others_grad)
    if forge:
      d_variables[FORGE_COLLECTION] = new_forge
    return d_carry, d_variables, jax.tree.map(jnp.zeros_like, args)

  run.defvjp(run_fwd, run_bwd)
  return run(carry, dict(variables), broadcast_args)
