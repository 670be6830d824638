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
the FORGE layers, and a step with any non-finite gradient element (a NaN
batch, whose untouched embedding rows still have finite zero gradients)
leaves the step count, as a non-finite ``dY`` leaves each layer's
``count``: the layers and the parameters ``tx`` owns keep one count. The
rule computes the new parameters; the updates it returns are their
float32 differences from the old ones, which
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
from forge_jax.optimizers import (
  ForgeOptimizer,
  not_elementwise_message,
  shared_by_equal_optimizers,
)


class StoredOptaxState(NamedTuple):
  """State of :func:`optax_with_storage`.

  Attributes:
    count: int32, the number of steps taken.
    state: the optimizer's state NamedTuple (``AdamState(mu, nu)``, ...)
      whose leaves are trees shaped like the parameters' (of their 2-D
      views), as optax's states are; an int8 leaf is a
      :class:`forge_jax.quantization.QuantizedBlocks` of two such trees,
      codes and scales.
  """

  count: jax.Array
  state: Any


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

  ``fj.nnx.Optimizer(model, fj.optax_with_storage(opt), wrt=nnx.Param)``
  takes it alike. Stochastic rounding draws each parameter's bits from the
  optimizer's ``rounding_seed``, the step and the parameter's path in the
  tree. A weight-decay ``mask`` (adamw, lion) is resolved on the parameters
  as optax does; masked parameters take the rule without decay.

  ``update`` needs ``params``. Equal optimizers with the same ``mask``
  object share one transformation, as for ``optimizer.to_optax()``:
  ``fj.TrainState`` knows it as their rule without stepping a probe.
  """
  if not isinstance(optimizer, ForgeOptimizer):
    raise TypeError(not_elementwise_message(optimizer))
  return shared_by_equal_optimizers(_with_storage, optimizer)


def _with_storage(optimizer: ForgeOptimizer) -> optax.GradientTransformation:
  """A new :func:`optax_with_storage` transformation of ``optimizer``."""
  # One parameter's state treedef, the same for every parameter.
  state_def = jax.tree.structure(
    jax.eval_shape(optimizer.init, jax.ShapeDtypeStruct((1, 64), jnp.float32))
  )

  def init_fn(params):
    leaves, params_def = jax.tree.flatten(params)
    rules = params_def.flatten_up_to(_per_param_rules(optimizer, params))
    per_param = [rule.init(_as_2d(p)) for rule, p in zip(rules, leaves)]
    return StoredOptaxState(
      count=jnp.zeros((), jnp.int32),
      state=_fields_outside(params_def, per_param, state_def),
    )

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "optax_with_storage's update needs params: its rule reads the "
        "parameters and computes their new values"
      )
    grads, params_def = jax.tree.flatten(updates)
    paths = [
      path for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]
    ]
    rules = params_def.flatten_up_to(_per_param_rules(optimizer, params))
    per_param = _fields_inside(params_def, state.state, state_def)
    stepped = [
      _step(rule, path, grad, param, old, state.count)
      for rule, path, grad, param, old in zip(
        rules, paths, grads, params_def.flatten_up_to(params), per_param
      )
    ]
    # A non-finite gradient element anywhere comes from a non-finite dY
    # (a NaN batch, an overflow), which skips every layer it reaches and
    # leaves their counts: this count stays too, so that the bias
    # corrections and schedules of the layers and of tx stay in step.
    taken = jnp.bool_(True)
    for grad in grads:
      taken &= jnp.all(jnp.isfinite(grad))
    return params_def.unflatten(
      [step for step, _ in stepped]
    ), StoredOptaxState(
      count=jnp.where(taken, optax.safe_increment(state.count), state.count),
      state=_fields_outside(params_def, [new for _, new in stepped], state_def),
    )

  return optax.GradientTransformation(init_fn, update_fn)


def _fields_outside(params_def, per_param: list, state_def):
  """One state per parameter -> the state's fields, each a tree shaped like
  the parameters: the layout of optax's states, which Flax NNX's optimizer
  updates field by field."""
  if not state_def.num_leaves:  # plain SGD: an empty state
    return state_def.unflatten([])
  if not params_def.num_leaves:  # every parameter is a FORGE layer's
    return state_def.unflatten(
      [params_def.unflatten([])] * state_def.num_leaves
    )
  return jax.tree.transpose(
    params_def, state_def, params_def.unflatten(per_param)
  )


def _fields_inside(params_def, state, state_def) -> list:
  """Inverse of :func:`_fields_outside`: one state per parameter."""
  if not state_def.num_leaves or not params_def.num_leaves:
    return [state] * params_def.num_leaves
  return params_def.flatten_up_to(
    jax.tree.transpose(state_def, params_def, state)
  )


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
  if rule.draws_random_bits:
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
    # As the XLA reference: int8 blocks must not store an overflow.
    guard_results=quantization.has_quantized(state),
  )
  update = new_kernel.astype(jnp.float32) - kernel.astype(jnp.float32)
  return jnp.reshape(update, param.shape), new_state
