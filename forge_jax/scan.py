"""Scan over layers whose backward updates stacked ForgeDense kernels in place.

``nn.scan`` over layers that hold ForgeDense variables works, but its
transpose builds *new* stacked buffers for every cotangent, so the updated
kernels and states of all layers exist beside the old ones until the step
ends: worse than optax. :func:`scan_layers` keeps ``nn.scan``'s variable
layout (every collection stacked on a leading layer axis) and replaces the
backward pass with a hand-written reverse loop over ``l = L-1 .. 0`` that
recomputes layer ``l``'s forward pass (remat) and runs its backward.

FORGE's collection is *not* sliced: every ForgeDense of the layer receives
its whole stacks (kernel, optimizer state, and the ``[L]`` count, skipped
and intact) and the index ``l`` (through a private context variable of
:mod:`forge_jax.linen` set while the layer is traced), reads the layer's
kernel at ``l`` and steps entry ``l`` of its stacks. The cotangent of each
stack is then the updated stack itself, carried to the next iteration. A
slice would not do: an update that is a custom call (the Pallas kernel)
cannot alias into a slice of a stack, so ``dynamic_slice -> update ->
dynamic_update_slice`` makes XLA copy the layer's kernels and states. The
other collections (norm scales, biases) are sliced, and their gradients
written into stacked gradients with ``dynamic_update_slice``.

With a remat ``policy`` the forward runs each layer the way the backward
will (stacked mode) under ``jax.vjp(jax.checkpoint(layer, policy=policy))``
and keeps the pullback: its leaves are the residuals. Leaves that are the
layer's own variables or broadcast arguments are not saved; the backward
puts its own there (for FORGE's collection: the stacks as stepped so far).
The other leaves (what the policy saved, the layer's input) are scan
outputs, stacked per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import flax.linen as nn

from forge_jax.linen import FORGE_COLLECTION, _STACKED_LAYER, _stacked_layer


def scan_layers(block: type[nn.Module], length: int,
                num_broadcast_args: int = 0,
                metadata_params: dict | None = None,
                policy: Callable | None = None) -> type[nn.Module]:
  """``nn.scan`` over ``block`` with FORGE's in-place backward pass.

  Use it where you would write::

    nn.scan(nn.remat(block), variable_axes={True: 0},
            split_rngs={'params': True},
            in_axes=(nn.broadcast,) * num_broadcast_args, length=length)

  (with ``nn.remat(block, policy=policy)`` when a ``policy`` is given).
  ``metadata_params`` is nn.scan's (e.g. ``{nn.PARTITION_NAME: 'layers'}``
  to name the stacking axis in partitioned variables' metadata).
  ``block(...)(carry, *broadcast_args)`` must return ``(carry, None)``. The
  variables have exactly nn.scan's layout, so checkpoints move between the
  two.

  ``policy`` None: each layer is recomputed in the backward pass (nn.remat's
  default: only its input is saved). A ``jax.checkpoint_policies`` policy
  (``dots_with_no_batch_dims_saveable``, ``save_only_these_names(...)``,
  ...): the forward saves, per layer and stacked on the layer axis, the
  values the policy allows, and the backward recomputes the rest. FORGE's
  stacks are not saved (the backward passes its own, the later layers
  already stepped), nor anything computed from them but ForgeDense's
  output (its forward reads the layer's kernel only for the dot).

  The broadcast arguments (RoPE tables, masks) are treated as constants:
  their cotangent is zero. The block must use its ForgeDense variables as
  they come (no nn.scan, nn.vmap or another scan_layers over ForgeDense
  inside it): the backward hands them over as whole stacks.
  """
  scanned = nn.scan(block, variable_axes={True: 0},
                    split_rngs={"params": True},
                    in_axes=(nn.broadcast,) * num_broadcast_args,
                    length=length, metadata_params=metadata_params or {})

  class ForgeScan(scanned):  # pylint: disable=missing-class-docstring
    def __call__(self, carry, *broadcast_args):
      if self.is_initializing():
        return super().__call__(carry, *broadcast_args)
      if _STACKED_LAYER.get() is not None:
        raise NotImplementedError(
            f"fj.scan_layers({block.__name__}) inside the block of another "
            "fj.scan_layers: the outer backward hands its ForgeDense "
            "variables over as whole stacks")
      fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(block)
                if f.init and f.name not in ("parent", "name")}
      layer = block(**fields, parent=None)
      return _scan_apply(layer, length, carry, self.variables,
                         tuple(broadcast_args), policy), None

  ForgeScan.__name__ = f"ForgeScan{block.__name__}"
  return ForgeScan


def _split_forge(variables):
  """``(FORGE's stacks, the other collections)``."""
  forge = variables.get(FORGE_COLLECTION, {})
  return forge, {k: v for k, v in variables.items() if k != FORGE_COLLECTION}


def _scan_apply(layer: nn.Module, length: int, carry, variables, broadcast_args,
                policy=None):
  """``carry`` through ``length`` layers; a custom_vjp over the stacks."""

  def layer_fn(layer_variables, x, args):
    out, _ = layer.apply(layer_variables, x, *args)
    return out

  @jax.custom_vjp
  def run(carry, variables, args):
    out, _ = lax.scan(lambda x, v: (layer_fn(v, x, args), None), carry, variables)
    return out

  if policy is None:
    run.defvjp(*_full_remat_vjp(layer_fn, length))
  else:
    run.defvjp(*_policy_remat_vjp(layer_fn, length, policy))
  return run(carry, dict(variables), broadcast_args)


def _full_remat_vjp(layer_fn, length):
  """fwd and bwd that save each layer's input only."""

  def run_fwd(carry, variables, args):
    out, inputs = lax.scan(lambda x, v: (layer_fn(v, x, args), x), carry,
                           variables)
    return out, (variables, inputs, args)

  def run_bwd(residuals, d_out):
    variables, inputs, args = residuals
    forge, others = _split_forge(variables)

    def layer_vjp(index, forge_stack, d_x):
      take = lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False)
      # Layer `index` of the FORGE stacks is not updated yet: it holds the
      # old values. Its cotangent is the stacks with that layer stepped.
      layer_vars = {**jax.tree.map(take, others), FORGE_COLLECTION: forge_stack}
      with _stacked_layer(index, length):
        _, pullback = jax.vjp(lambda v, x: layer_fn(v, x, args), layer_vars,
                              take(inputs))
        d_vars, d_x = pullback(d_x)
      forge_ct = d_vars.pop(FORGE_COLLECTION)
      return d_vars, forge_ct, d_x

    return _reverse_loop(layer_vjp, length, forge, others, d_out, args)

  return run_fwd, run_bwd


def _reverse_loop(layer_vjp, length, forge, others, d_out, args):
  """The backward loop over ``l = L-1 .. 0``: ``layer_vjp(l, forge_stack,
  d_x) -> (others' grads, updated forge stacks, d_x)``."""

  def body(i, loop_carry):
    d_x, forge_stack, others_grad = loop_carry
    index = length - 1 - i
    d_others, forge_stack, d_x = layer_vjp(index, forge_stack, d_x)
    put = lambda stack, value: lax.dynamic_update_index_in_dim(
        stack, value, index, 0)
    others_grad = jax.tree.map(put, others_grad, d_others)
    return d_x, forge_stack, others_grad

  d_carry, new_forge, others_grad = lax.fori_loop(
      0, length, body, (d_out, forge, jax.tree.map(jnp.zeros_like, others)))
  d_variables = dict(others_grad)
  if forge:
    d_variables[FORGE_COLLECTION] = new_forge
  return d_carry, d_variables, jax.tree.map(jnp.zeros_like, args)


class _PullbackLayout(NamedTuple):
  """How to rebuild one layer's pullback (``jax.vjp``'s function, a pytree)
  in the backward loop; static, recorded while the forward traces.

  ``sources[i]`` says where leaf ``i`` of the pullback comes from: an
  ``int``, the leaf of ``(others[l], forge stacks, broadcast args)`` it is
  (the backward passes its own: the stacks with layers > l stepped), or
  None: a value saved per layer (stacked on the layer axis).
  """
  treedef: Any
  sources: tuple


def _policy_remat_vjp(layer_fn, length, policy):
  """fwd and bwd that save per layer what ``policy`` allows.

  The forward runs each layer as the backward will (stacked mode, layer
  ``l`` of the whole FORGE stacks) under ``jax.vjp(jax.checkpoint(...,
  policy))``: the pullback's leaves are its residuals. Those that are the
  layer's variables or the broadcast arguments are not saved (the backward
  has them, and must pass its stepped stacks); the rest are.
  """
  remat_fn = jax.checkpoint(
      lambda others, forge, x, args: layer_fn(
          {**others, FORGE_COLLECTION: forge}, x, args),
      policy=policy, prevent_cse=False)
  layout = []  # one _PullbackLayout, set when run_fwd's scan body traces

  def run_fwd(carry, variables, args):
    forge, others = _split_forge(variables)

    def body(x, index_and_others):
      index, layer_others = index_and_others
      with _stacked_layer(index, length):
        out, pullback = jax.vjp(remat_fn, layer_others, forge, x, args)
      leaves, treedef = jax.tree.flatten(pullback)
      at_hand = {id(leaf): i for i, leaf in
                 enumerate(jax.tree.leaves((layer_others, forge, args)))}
      sources = tuple(at_hand.get(id(leaf)) for leaf in leaves)
      layout[:] = [_PullbackLayout(treedef, sources)]
      return out, [leaf for leaf, source in zip(leaves, sources)
                   if source is None]

    out, saved = lax.scan(body, carry, (jnp.arange(length), others))
    return out, (variables, saved, args)

  def run_bwd(residuals, d_out):
    variables, saved, args = residuals
    forge, others = _split_forge(variables)
    (treedef, sources), = layout

    def layer_vjp(index, forge_stack, d_x):
      take = lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False)
      at_hand = jax.tree.leaves((jax.tree.map(take, others), forge_stack, args))
      saved_leaves = iter(saved)
      leaves = [take(next(saved_leaves)) if source is None else at_hand[source]
                for source in sources]
      d_others, forge_ct, d_x, _ = jax.tree.unflatten(treedef, leaves)(d_x)
      return d_others, forge_ct, d_x

    return _reverse_loop(layer_vjp, length, forge, others, d_out, args)

  return run_fwd, run_bwd
