"""FORGE's storage for the parameters optax trains: :func:`optax_with_storage`.

An optimizer's storage options (``state_dtype``, ``weight_rounding``) apply
to the ForgeDense kernels it trains; ``optimizer.to_optax()`` is the optax
alias itself, in optax's dtypes, for the other parameters (embeddings,
norms, biases). :func:`optax_with_storage` trains those with the same rule
*and* the same storage: int8 block states for an embedding table take 2.1
bytes a parameter instead of bfloat16's 4, and bfloat16 embeddings keep
updates smaller than half an ulp through stochastic rounding.

It is the rule the FORGE layers' XLA backend applies
(:func:`forge_jax.ops.update.apply_update`), run on each parameter viewed as
2-D (``[-1, last axis]``; quantization blocks run along the last axis). An
element whose gradient is not finite keeps its parameter and state, as in
the FORGE layers. The rule computes the new parameters; the updates it
returns are their float32 differences from the old ones, which
``optax.apply_updates`` adds back. For bfloat16 parameters that gives the
rule's values (unless a step shrinks a parameter more than 2**16-fold: the
difference then needs more than float32's 24 bits). For float32 parameters
it comes within an ulp of the larger of the old and new values: an additive
update cannot carry the rule's rounding where a step more than halves or
doubles a parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from forge_jax import quantization
from forge_jax.ops.update import apply_update
from forge_jax.optimizers import ForgeOptimizer, not_elementwise_message


class StoredOptaxState(NamedTuple):
  """State of :func:`optax_with_storage`.

  Attributes:
    count: int32, the number of steps taken.
    per_param: the parameters' tree with each leaf's optimizer state (the
      optimizer's state NamedTuple of 2-D leaves, int8 blocks as
      :class:`forge_jax.quantization.QuantizedBlocks`).
  """

  count: jax.Array
  per_param: Any


def optax_with_storage(
  optimizer: ForgeOptimizer,
) -> optax.GradientTransformation:
  """``optimizer``'s rule and storage as an optax transformation.

  Pass it as ``tx`` in place of ``optimizer.to_optax()`` to store the
  non-FORGE parameters' states in ``optimizer.state_dtype`` and to write
  their bfloat16 values with ``optimizer.weight_rounding``::

    opt = fj.adamw(1e-4, state_dtype="int8", weight_rounding="stochastic")
    state = fj.TrainState.create(
      apply_fn=model.apply, params=variables, tx=fj.optax_with_storage(opt)
    )

  Stochastic rounding draws each parameter's bits from the optimizer's
  ``rounding_seed``, the step and the parameter's path in the tree. A
  weight-decay ``mask`` (adamw, lion) is resolved on the parameters as
  optax does; masked parameters take the rule without decay.

  ``update`` needs ``params``.
  """
  if not isinstance(optimizer, ForgeOptimizer):
    raise TypeError(not_elementwise_message(optimizer))

  def init_fn(params):
    rules = _per_param_rules(optimizer, params)
    return StoredOptaxState(
      count=jnp.zeros((), jnp.int32),
      per_param=jax.tree.map(
        lambda p, rule: rule.init(_as_2d(p)), params, rules
      ),
    )

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "optax_with_storage's update needs params: its rule reads the "
        "parameters and computes their new values"
      )
    grads, treedef = jax.tree.flatten(updates)
    paths = [
      path for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]
    ]
    rules = treedef.flatten_up_to(_per_param_rules(optimizer, params))
    stepped = [
      _step(rule, path, grad, param, old, state.count)
      for rule, path, grad, param, old in zip(
        rules,
        paths,
        grads,
        treedef.flatten_up_to(params),
        treedef.flatten_up_to(state.per_param),
      )
    ]
    return treedef.unflatten([step for step, _ in stepped]), StoredOptaxState(
      count=optax.safe_increment(state.count),
      per_param=treedef.unflatten([new for _, new in stepped]),
    )

  return optax.GradientTransformation(init_fn, update_fn)


def _as_2d(x: jax.Array) -> jax.Array:
  """``x`` as ``[-1, last axis]`` (``[1, size]`` below rank 2)."""
  if x.ndim < 2:
    return jnp.reshape(x, (1, -1))
  return jnp.reshape(x, (-1, x.shape[-1]))


def _per_param_rules(optimizer: ForgeOptimizer, params):
  """Each parameter's rule: ``optimizer``, or without weight decay where its
  ``mask`` (if any) is False."""
  mask = getattr(optimizer, "mask", None)
  if mask is None:
    return jax.tree.map(lambda _: optimizer, params)
  if callable(mask):
    mask = mask(params)
  undecayed = dataclasses.replace(optimizer, weight_decay=0.0)
  # optax's masks may be a prefix of the parameters' tree.
  return jax.tree.map(
    lambda decayed, sub: jax.tree.map(
      lambda _: optimizer if decayed else undecayed, sub
    ),
    mask,
    params,
  )


def _step(rule: ForgeOptimizer, path, grad, param, state, count):
  """``(float32 update, new state)`` of one parameter."""
  key = None
  if rule.weight_rounding == "stochastic" and param.dtype == jnp.bfloat16:
    layer_id = quantization.layer_id_from_path([jax.tree_util.keystr(path)])
    key = quantization.rounding_key(rule.rounding_seed, layer_id, count)
  kernel = _as_2d(param)
  new_kernel, new_state, _ = apply_update(
    rule,
    _as_2d(grad),
    kernel,
    state,
    rule.scalars(count),
    jnp.bool_(True),
    rounding_key=key,
    guard_results=False,
  )
  update = new_kernel.astype(jnp.float32) - kernel.astype(jnp.float32)
  return jnp.reshape(update, param.shape), new_state
