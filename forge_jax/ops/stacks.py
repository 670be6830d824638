"""One layer's entry of layer-stacked FORGE variables.

``fj.scan_layers``' backward hands each ForgeDense its whole ``[L, ...]``
stacks and the layer's index (an int32 scalar), so that the update writes
into the stacks in place: a custom call cannot alias into a slice of a
stack, and slicing around it makes XLA copy the layer's kernel and states.
A ``layer_index`` of None means the variables are one layer's, unstacked.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax


def layer_entry(
  stack: jax.Array, layer_index: Optional[jax.Array]
) -> jax.Array:
  """``stack[layer_index]`` (``stack`` itself when ``layer_index`` is None)."""
  if layer_index is None:
    return stack
  return lax.dynamic_index_in_dim(stack, layer_index, keepdims=False)


def with_layer_entry(
  stack: jax.Array, entry: jax.Array, layer_index: Optional[jax.Array]
) -> jax.Array:
  """``stack`` with ``stack[layer_index]`` replaced by ``entry`` (``entry``
  itself when ``layer_index`` is None)."""
  if layer_index is None:
    return entry
  return lax.dynamic_update_index_in_dim(stack, entry, layer_index, 0)


def with_layer_scalar(
  stack: jax.Array, entry: jax.Array, layer_index: Optional[jax.Array]
) -> jax.Array:
  """A ``[L]`` stack of per-layer scalars with entry ``layer_index``
  replaced by ``entry`` (``entry`` itself when ``layer_index`` is None).

  A select over the whole stack (an elementwise fusion of ``L`` elements),
  not a slice read and a ``dynamic_update_slice``: when other ops read the
  old entry too (the step's optimizer scalars read ``count[l]``), XLA
  gives that slice read a launch of its own.
  """
  if layer_index is None:
    return entry
  return jnp.where(_is_layer(stack, layer_index), entry, stack)


def add_at_layer(
  stack: jax.Array, value: jax.Array, layer_index: Optional[jax.Array]
) -> jax.Array:
  """A ``[L]`` stack of per-layer scalars with ``value`` added to entry
  ``layer_index`` (to the scalar ``stack`` when ``layer_index`` is None),
  without reading the entry apart (:func:`with_layer_scalar`)."""
  if layer_index is None:
    return stack + value
  return stack + jnp.where(_is_layer(stack, layer_index), value, 0)


def _is_layer(stack, layer_index):
  return lax.broadcasted_iota(jnp.int32, stack.shape, 0) == layer_index


def layer_entries(tree, layer_index: Optional[jax.Array]):
  """:func:`layer_entry` of every leaf of ``tree``."""
  return jax.tree.map(lambda s: layer_entry(s, layer_index), tree)


def with_layer_entries(stacks, entries, layer_index: Optional[jax.Array]):
  """:func:`with_layer_entry` of every leaf of ``stacks``."""
  return jax.tree.map(
    lambda s, e: with_layer_entry(s, e, layer_index), stacks, entries
  )


def layer_state_shapes(kernel, optimizer):
  """The shapes and dtypes of one layer's optimizer state for ``kernel`` (one
  layer's or a ``[L, K, N]`` stack: int8 states quantize 2-D kernels only)."""
  layer = jax.ShapeDtypeStruct(kernel.shape[-2:], kernel.dtype)
  return jax.eval_shape(optimizer.init, layer)
