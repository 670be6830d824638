"""The global gradient norm and global-norm clipping, with FORGE's layers.

A ForgeDense updates its kernel inside the backward pass, before the
gradients of the layers below it exist: the global norm is unknown when the
first update happens, so ``optax.clip_by_global_norm`` in ``tx`` cannot
clip them. The backward pass is linear in the loss's cotangent, though:
run with a seed ``s`` instead of 1.0, it makes every gradient (each FORGE
layer's ``dW`` inside its kernel, and every other gradient) ``s`` times as
large. Clipping is a seed:

* ``'exact'``: one forward pass (``jax.vjp``) and, where every ForgeDense
  can defer its update, one backward pass. In it each ForgeDense computes
  ``dx`` and ``dbias``, sums the squares of its ``dW`` and updates nothing
  (:data:`forge_jax.layer_context.DEFERRED`); it hands its factors, the
  input ``x [tokens, K]`` in the compute dtype and ``dy [tokens, N]``, out
  of the backward as the cotangent of a sink of zeros in
  :data:`forge_jax.linen.FACTORS_COLLECTION` (a custom_vjp can hand values
  out only as the cotangent of an input). With the global norm known, each
  layer steps from its factors with ``dy`` scaled by ``min(1, max_norm /
  ||g||)``, by the backend its backward would use (the layers of an
  ``fj.scan`` one after the other, in place in the stacks). The factors
  cost ``tokens * (K + N)`` elements per layer until then, far less than
  the ``K * N`` of a stored ``dW``; the dX GEMMs and the remat'd forwards
  run once. Before the pass, the loss is traced abstractly to find the
  layers and the factors' shapes (:func:`forge_jax.layer_context.discovering`).
  A layer cannot defer under a ``ShardedLayout``, inside ``nn.scan`` or
  ``nn.vmap``, or when ``fun`` does not hand ``FACTORS_COLLECTION`` on to
  it; then the step runs as two backward passes, the first norm-only
  (:data:`forge_jax.layer_context.NORM_ONLY`), the second seeded with
  ``min(1, max_norm / ||g||)``, updating. Either way it equals
  ``optax.chain(optax.clip_by_global_norm(max_norm), tx)``.
* ``'delayed'``: one backward pass, seeded with ``min(1, max_norm /
  ||g_prev||)`` from the previous step's global norm (no clipping before
  the first step), so a step is clipped by the norm of the step before.

Every backward pass leaves each layer's sum of squared ``dW`` elements in
its ``grad_sq_norm`` (the kernels accumulate it from the float32 tiles they
hold), so :func:`global_norm` is exact for every step, clipped or not.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
from flax.core import meta
from jax import lax

from forge_jax import layer_context, parallel
from forge_jax.linen import FACTORS_COLLECTION, FORGE_COLLECTION, forge_layers
from forge_jax.ops.fused_dense import Factors, ForgeVariables, deferred_update

CLIP_MODES = ("exact", "delayed")


def layer_at(collection, path: tuple):
  """The entry of FORGE's collection (or a tree like it) at ``path``."""
  for key in path:
    collection = collection[key]
  return collection


def with_layer(collection: Mapping, path: tuple, value) -> dict:
  """``collection`` with ``value`` at ``path`` (new dicts along the path)."""
  if not path:
    return value
  return {
    **collection,
    path[0]: with_layer(collection[path[0]], path[1:], value),
  }


def _map_layers(fn, collection, *others):
  """FORGE's collection with ``fn(layer, *other layers)`` for each layer."""
  if isinstance(collection, Mapping) and "intact" in collection:
    return fn(collection, *others)
  if isinstance(collection, Mapping):
    return {
      key: _map_layers(fn, value, *(o[key] for o in others))
      for key, value in collection.items()
    }
  return collection


def _split(grads):
  """``(FORGE's collection, the other gradients)`` of ``grads``."""
  if isinstance(grads, Mapping) and FORGE_COLLECTION in grads:
    return grads[FORGE_COLLECTION], {
      k: v for k, v in grads.items() if k != FORGE_COLLECTION
    }
  return {}, grads


def squared_norm(tree, total=0.0) -> jax.Array:
  """``total`` plus the squares of every floating leaf of ``tree``, added
  leaf by leaf (float32; integer and key leaves are not gradients).

  Each leaf passes an optimization barrier first. Without it XLA fuses a
  small leaf's sum of squares into that leaf's optimizer update, and the
  fused reduction runs in one thread block: about 3 us for a 4096-element
  norm scale on an H100, against 1 us for the update and the sum apart.
  """
  total = jnp.asarray(total, jnp.float32)
  for leaf in jax.tree.leaves(tree):
    if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      leaf = lax.optimization_barrier(jnp.asarray(leaf))
      total += jnp.sum(jnp.square(leaf.astype(jnp.float32)))
  return total


def global_norm(grads) -> jax.Array:
  """The global norm of the gradient that ``grads`` stand for.

  ``grads`` is what ``jax.grad(loss)(variables)`` returns for a model with
  ForgeDense layers (or :func:`value_and_grad`'s grads): each layer's
  ``grad_sq_norm`` in FORGE's collection is its part, every leaf of
  ``params`` a gradient. ``optax.global_norm`` of the gradients trained,
  ``dW`` included, without a ``dW`` stored; float32. Beside FORGE's
  collection only ``params`` is trained (flax's ``TrainState`` steps it
  alone), so the other collections' gradients (a constant table read in
  the forward) do not count; without FORGE's collection every leaf
  counts. Gradients taken inside
  ``fj.plain_gradients()`` hold each ``dW`` in the layer's kernel entry
  instead (and no ``grad_sq_norm``): take their norm as
  ``optax.global_norm(fj.to_dense(grads))``.
  """
  forge, others = _split(grads)
  if forge:
    others = others.get("params", {})
  total = jnp.zeros((), jnp.float32)
  for _, layer in forge_layers(forge):
    total += jnp.sum(layer["grad_sq_norm"].astype(jnp.float32))
  return jnp.sqrt(squared_norm(others, total))


def clip_scale(norm, max_norm) -> jax.Array:
  """``min(1, max_norm / norm)``: 1.0 exactly below ``max_norm`` (as
  ``optax.clip_by_global_norm`` leaves such gradients untouched)."""
  return jnp.where(norm < max_norm, 1.0, max_norm / norm).astype(jnp.float32)


def clip_gradients(grads, norm, max_norm):
  """``optax.clip_by_global_norm(max_norm)``'s step, with the global norm
  ``norm``, on every gradient outside FORGE's collection (whose layers were
  clipped in their backward pass by :func:`value_and_grad`)."""
  forge, others = _split(grads)
  others = jax.tree.map(lambda t: clipped(t, norm, max_norm), others)
  if not forge:
    return others
  return {**others, FORGE_COLLECTION: forge}


def clipped(gradient, norm, max_norm):
  """``gradient`` (one leaf) as ``optax.clip_by_global_norm(max_norm)``
  leaves it when the global norm is ``norm`` (integer leaves as they
  are)."""
  if not jnp.issubdtype(jnp.result_type(gradient), jnp.inexact):
    return gradient
  return lax.select(
    norm < max_norm,
    gradient,
    (gradient / norm.astype(gradient.dtype)) * max_norm,
  )


def delayed_norm(previous_norm) -> jax.Array:
  """The norm that clips a ``'delayed'`` step: the previous step's, or 0
  (no clipping) where it is not finite (before the first step, or after a
  step whose gradient was not finite)."""
  previous_norm = jnp.asarray(previous_norm, jnp.float32)
  return jnp.where(jnp.isfinite(previous_norm), previous_norm, 0.0)


def check_clipping(max_norm, clip, track_norm: bool = True):
  if max_norm is not None and not max_norm > 0:
    raise ValueError(f"max_norm={max_norm!r} must be positive (or None)")
  if clip not in CLIP_MODES:
    raise ValueError(f"clip={clip!r} must be one of {CLIP_MODES}")
  if max_norm is not None and not track_norm:
    raise ValueError(
      "track_grad_norm=False with max_grad_norm set: clipping needs the "
      "global gradient norm. Leave track_grad_norm on, or drop the clipping."
    )


def value_and_grad(
  fun: Callable,
  has_aux: bool = False,
  *,
  max_norm: Optional[float] = None,
  clip: str = "exact",
  previous_norm: Any = None,
) -> Callable:
  """``jax.value_and_grad(fun, has_aux=has_aux)``, clipping FORGE's layers.

  ``fun(variables, *args, **kwargs)`` is differentiated with respect to
  ``variables`` (all of them, FORGE's collection included). With a
  ``max_norm``, every ForgeDense steps with its weight gradient clipped by
  the global norm: ``clip='exact'`` by this step's (one backward pass and
  deferred updates, or two backward passes), ``clip='delayed'`` by
  ``previous_norm``, the previous step's (one backward pass; see the module
  docstring).

  Returns:
    A function returning ``(value, grads)`` (``((value, aux), grads)`` with
    ``has_aux``). FORGE's collection in ``grads`` holds the layers' new
    variables, each ``grad_sq_norm`` that of the unclipped ``dW``; every
    other leaf is the *unclipped* gradient, so :func:`global_norm` of
    ``grads`` is this step's global norm. Clip the other leaves with
    :func:`clip_gradients` (by that norm; ``'delayed'``: by
    :func:`delayed_norm` of ``previous_norm``) before the optimizer:
    :meth:`forge_jax.TrainState.apply_gradients` does.
  """
  check_clipping(max_norm, clip)
  if max_norm is not None and clip == "delayed" and previous_norm is None:
    raise ValueError("clip='delayed' needs the previous step's previous_norm")

  def value_and_grad_fn(variables, *args, **kwargs):
    if max_norm is not None and clip == "delayed":
      check_traced_alike(variables, previous_norm)
    loss = lambda v: fun(v, *args, **kwargs)
    layers = None
    if max_norm is not None and clip == "exact":
      layers = _deferrable_layers(loss, variables, has_aux)
    if layers:
      sinks = _factor_sinks(layers)
      variables = {**variables, FACTORS_COLLECTION: sinks}
    out = jax.vjp(loss, variables, has_aux=has_aux)
    value, pullback = out[:2]
    _check_scalar(value)
    seed = lambda scale: jnp.asarray(scale, jnp.result_type(value))
    if max_norm is None:
      (grads,) = pullback(seed(1.0))
    elif clip == "exact":
      first = (
        layer_context.NORM_ONLY if layers is None else layer_context.DEFERRED
      )
      layer_context.take_deferred_returns()
      with layer_context.running(first) as traced:
        (measured,) = pullback(seed(1.0))
      returned = layer_context.take_deferred_returns()
      measured, factors = _split_factors(measured)
      scale = clip_scale(global_norm(measured), max_norm)
      if layers is not None and all(
        name == layer_context.DEFERRED for name in traced
      ):
        forge = _split(measured)[0]
        if not parallel.mesh_is_set():
          layer_context.check_deferred_returns(
            returned,
            [
              ("/".join(path), layer["count"], meta.unbox(layer["kernel"]))
              for path, layer in forge_layers(forge)
            ],
          )
        forge = _deferred_updates(
          layers, forge, factors, scale, _split(variables)[0]
        )
      else:
        with layer_context.running(layer_context.SCALED):
          (stepped,) = pullback(seed(scale))
        forge = _forge_norms(_split_factors(stepped)[0], measured)
      grads = _with_forge(measured, forge)
    else:
      scale = clip_scale(delayed_norm(previous_norm), max_norm)
      with layer_context.running(layer_context.SCALED):
        (stepped,) = pullback(seed(scale))
      grads = _unscaled(stepped, scale)
    return ((value, out[2]) if has_aux else value), grads

  return value_and_grad_fn


def check_traced_alike(
  variables, previous_norm, owner: str = "state", taken: str = "jax.jit"
):
  """Refuses a ``'delayed'`` gradient function whose ``previous_norm`` is
  not traced with the ``variables`` it differentiates (``value_and_grad``
  taken from the ``owner``, a state or optimizer, outside the traced step
  that ``taken`` names): every compiled step would clip by that norm, a
  constant, not the previous step's."""
  traced = lambda x: isinstance(x, jax.core.Tracer)
  if traced(previous_norm):
    return
  if any(traced(leaf) for leaf in jax.tree.leaves(variables)):
    raise ValueError(
      "clip='delayed': the gradient function reads the previous step's "
      f"norm from a {owner} outside the traced step ({owner}.value_and_"
      f"grad(loss_fn) taken before {taken}), so every compiled step would "
      f"clip by its norm at trace time. Take it inside the step, from the "
      f"{owner} the step receives: {owner}.value_and_grad(loss_fn)(...)."
    )


def _deferrable_layers(loss, variables, has_aux):
  """``{path: DeferrableLayer}`` of the ForgeDense layers ``loss`` runs, if
  every one can defer its update (``{}`` for a loss without any); else
  None. Traces ``loss`` abstractly, as ``jax.vjp`` will run it."""
  if not isinstance(variables, Mapping):
    return None
  with layer_context.discovering() as layers:
    jax.eval_shape(lambda v: jax.vjp(loss, v, has_aux=has_aux)[0], variables)
  if not all(layer.can_defer for layer in layers.values()):
    return None
  return layers


def _factor_sinks(layers):
  """:data:`FACTORS_COLLECTION`: zeros ``{'x', 'dy'}`` at every layer's
  path."""
  sinks = {}
  for path, layer in layers.items():
    zeros = {
      name: jnp.zeros(shape.shape, shape.dtype)
      for name, shape in layer.factors._asdict().items()
    }
    if not path:  # the model is the layer
      return zeros
    node = sinks
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = zeros
  return sinks


def _split_factors(grads):
  """``(grads without FACTORS_COLLECTION, its cotangents)``: the layers'
  factors where they deferred (zeros elsewhere)."""
  if not isinstance(grads, Mapping) or FACTORS_COLLECTION not in grads:
    return grads, {}
  factors = grads[FACTORS_COLLECTION]
  return {k: v for k, v in grads.items() if k != FACTORS_COLLECTION}, factors


def _deferred_updates(layers, forge, factors, scale, read):
  """FORGE's collection with every layer stepped from its factors with
  ``dy`` scaled by ``scale``; ``read``: the collection the forward read.

  The updates depend on ``scale``, so on every gradient: they run after
  every reader of the old kernels, and write them in place. Each is
  recorded as its layer's backward's would be, so that an install tells
  it from a combination of several (gradient accumulation).
  """
  for path, layer in layers.items():
    cotangents = layer_at(forge, path)
    new = deferred_update(
      layer.spec,
      ForgeVariables(**meta.unbox(cotangents)),
      Factors(**layer_at(factors, path)),
      scale,
      layer.length,
    )
    # As the op records it: under a mesh the install may hold a new array.
    written = None if parallel.mesh_is_set() else new.kernel
    layer_context.record_update(
      path, meta.unbox(layer_at(read, path)["kernel"]), new.count, written
    )
    forge = with_layer(forge, path, _reboxed(cotangents, new._asdict()))
  return forge


def _reboxed(boxed, values):
  """``values`` in the metadata boxes of ``boxed`` (``nn.with_partitioning``
  kernels' cotangents are boxed as the kernels are)."""
  is_box = lambda leaf: isinstance(leaf, meta.AxisMetadata)
  return jax.tree.map(
    lambda box, value: box.replace_boxed(value) if is_box(box) else value,
    dict(boxed),
    values,
    is_leaf=is_box,
  )


def _check_scalar(value):
  if jnp.shape(value) != () or not jnp.issubdtype(
    jnp.result_type(value), jnp.floating
  ):
    raise TypeError(
      "value_and_grad needs a function returning a real scalar, got "
      f"shape {jnp.shape(value)} dtype {jnp.result_type(value)}"
    )


def _with_forge(grads, forge):
  if not forge:
    return grads
  return {**grads, FORGE_COLLECTION: forge}


def _forge_norms(stepped, measured):
  """FORGE's collection of ``stepped``, each layer's ``grad_sq_norm`` taken
  from ``measured`` (the norm-only pass: the unclipped ``dW``'s)."""
  return _map_layers(
    lambda new, norm: {**new, "grad_sq_norm": norm["grad_sq_norm"]},
    _split(stepped)[0],
    _split(measured)[0],
  )


def _unscaled(grads, scale):
  """The gradients of a backward pass seeded with ``scale``, unscaled: the
  other leaves divided by it, each ``grad_sq_norm`` by its square."""
  forge, others = _split(grads)
  others = jax.tree.map(
    lambda t: (
      t / scale.astype(t.dtype)
      if jnp.issubdtype(jnp.result_type(t), jnp.inexact)
      else t
    ),
    others,
  )
  forge = _map_layers(
    lambda layer: {**layer, "grad_sq_norm": layer["grad_sq_norm"] / scale**2},
    forge,
  )
  return _with_forge(others, forge)
