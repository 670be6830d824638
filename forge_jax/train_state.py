"""``fj.TrainState``: flax's ``TrainState`` that keeps FORGE's layers safe.

FORGE's backward pass makes each ForgeDense's cotangents its *updated*
variables, and ``TrainState.apply_gradients`` installs them (the
``_overwrite_with_gradient`` collection). flax's stock ``TrainState`` installs
whatever arrives: a layer the loss did not reach gets zero cotangents and
its kernel and state are overwritten with zeros. :class:`TrainState`
installs a layer's cotangents only where FORGE wrote them (their ``intact``
flag), keeps the other layers' variables bit for bit, and records which
layers the step reached and the step's global gradient norm. It clips by
the global norm (``max_grad_norm``, :mod:`forge_jax.clipping`), and refuses
optax transformations that cannot be right for FORGE's layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.core import meta
from flax.training import train_state

from forge_jax import clipping, layer_context, optax_storage
from forge_jax.clipping import layer_at, with_layer
from forge_jax.linen import FORGE_COLLECTION, forge_layers
from forge_jax.optimizers import (
  WHOLE_GRADIENT_TRANSFORMATIONS,
  has_weight_decay,
  transformation_names,
)


class TrainState(train_state.TrainState):
  """flax's ``TrainState`` (same fields and ``create``) for FORGE models.

  Create it from the *whole* variables dict that ``model.init`` returns, with
  the layers' optimizer as ``tx`` for the parameters FORGE does not own::

    state = fj.TrainState.create(apply_fn=model.apply, params=variables,
                                 tx=opt.to_optax())

  and differentiate the loss with respect to all of ``state.params``. Other
  collections of ``variables`` (``batch_stats``, ...) stay in ``params`` as
  they are, through every step: write their new values with
  ``state.replace(params={**state.params, 'batch_stats': new})``.

  The layers' optimizer states and step counts are variables too, in
  ``params``: a state created anew from ``state.params`` (another ``tx``)
  restarts ``tx``'s state, not theirs, and ``state.replace(params=...)``
  with older variables takes their older states with them. Replace
  ``params`` before taking the gradient, not between it and
  ``apply_gradients``: FORGE's gradient is the stepped variables of the
  parameters it was taken of, installed in place of the replaced ones (as
  is a gradient of another model's parameters). To restart the
  whole optimizer, initialize the model's variables anew and carry the
  weights over (``fj.to_dense`` / ``fj.from_dense`` give fresh states).

  Global-norm clipping (``optax.clip_by_global_norm`` cannot be in ``tx``:
  FORGE's layers update before the global norm exists) is set at creation
  and takes :meth:`value_and_grad` in place of ``jax.value_and_grad``::

    state = fj.TrainState.create(..., tx=opt.to_optax(), max_grad_norm=1.0)
    loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
    state = state.apply_gradients(grads=grads)

  Attributes:
    reached: after a step, ``{layer path: 1.0 or 0.0}`` (float32; ``[L]``
      for layers stacked by a scan): whether the step's loss reached the
      ForgeDense layer. A layer it did not reach keeps its kernel, state and
      count as they were. All 1.0 before the first step; None for a model
      without ForgeDense layers.
    grad_norm: the last step's global gradient norm over all trained
      parameters, before clipping (float32; 0.0 before the first step).
      None where ``track_grad_norm`` is off.
    track_grad_norm: whether each step computes ``grad_norm`` (default
      True). Off, a step without clipping skips the sum of the squared
      gradients of the parameters FORGE does not own and the root: what
      optax's step without a norm does not pay either. Clipping needs it
      on.
    max_grad_norm: None, or the global norm every step's gradient is
      clipped to, as ``optax.clip_by_global_norm(max_grad_norm)`` first in
      ``tx`` would.
    clip: ``'exact'``: clipped by the step's own norm (one forward and one
      backward pass, each ForgeDense keeping its input and output
      cotangent, ``tokens * (K + N)`` elements, until the norm is known and
      it steps; two backward passes where a layer cannot defer its update:
      under a ``ShardedLayout``, or inside ``nn.scan`` / ``nn.vmap``);
      ``'delayed'``: by the previous step's norm (one backward pass; the
      first step is not clipped).
  """

  reached: Any = None
  grad_norm: Any = None
  max_grad_norm: Optional[float] = struct.field(pytree_node=False, default=None)
  clip: str = struct.field(pytree_node=False, default="exact")
  track_grad_norm: bool = struct.field(pytree_node=False, default=True)

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Callable,
    params,
    tx,
    max_grad_norm: Optional[float] = None,
    clip: str = "exact",
    track_grad_norm: bool = True,
    **kwargs,
  ):
    check_transformation(tx)
    clipping.check_clipping(max_grad_norm, clip, track_grad_norm)
    if track_grad_norm:
      kwargs.setdefault("grad_norm", jnp.zeros((), jnp.float32))
    if isinstance(params, Mapping) and FORGE_COLLECTION in params:
      # A model whose every parameter is FORGE's has no 'params' collection.
      params = {"params": {}, **params}
      # Every layer counts as reached until a step says otherwise: the
      # state's structure stays the same across steps (no retrace).
      kwargs.setdefault(
        "reached",
        {
          "/".join(path): jnp.ones(jnp.shape(layer["intact"]), jnp.float32)
          for path, layer in forge_layers(params[FORGE_COLLECTION])
        },
      )
    try:
      return super().create(
        apply_fn=apply_fn,
        params=params,
        tx=tx,
        max_grad_norm=max_grad_norm,
        clip=clip,
        track_grad_norm=track_grad_norm,
        **kwargs,
      )
    except (ValueError, TypeError, KeyError):
      if not isinstance(params, Mapping) or FORGE_COLLECTION not in params:
        raise
      layers = forge_layers(params[FORGE_COLLECTION])
      check_named_absent_layers(
        tx,
        params["params"],
        [path for path, _ in layers],
        {path: layer_context.weight_name(path) for path, _ in layers},
        _kernel_ranks(params[FORGE_COLLECTION]),
      )
      raise

  def value_and_grad(self, fun: Callable, has_aux: bool = False) -> Callable:
    """``jax.value_and_grad(fun, has_aux=has_aux)`` for this state's
    clipping: with ``max_grad_norm``, FORGE's layers step with their
    gradient clipped (:func:`forge_jax.clipping.value_and_grad`), and
    :meth:`apply_gradients` clips the other parameters' alike. Take it from
    the state of each step: ``'delayed'`` clips by this state's
    ``grad_norm``."""
    return clipping.value_and_grad(
      fun,
      has_aux,
      max_norm=self.max_grad_norm,
      clip=self.clip,
      previous_norm=self.grad_norm,
    )

  def apply_gradients(self, *, grads, **kwargs):
    # Also here: replace() can set the clipping without create's checks.
    clipping.check_clipping(self.max_grad_norm, self.clip, self.track_grad_norm)
    if self.track_grad_norm:
      kwargs.setdefault("grad_norm", clipping.global_norm(grads))
    old = (
      self.params.get(FORGE_COLLECTION)
      if isinstance(self.params, Mapping)
      else None
    )
    if self.max_grad_norm is not None:
      check_clipped(
        [
          ("/".join(path), _recorded_key(path, layer), _kernel(layer))
          for path, layer in forge_layers(old or {})
        ],
        "take the gradient with state.value_and_grad(loss_fn), not "
        "jax.value_and_grad(loss_fn).",
      )
      reference = (
        kwargs["grad_norm"]
        if self.clip == "exact"
        else clipping.delayed_norm(self.grad_norm)
      )
      grads = clipping.clip_gradients(grads, reference, self.max_grad_norm)
    if not old:
      return super().apply_gradients(grads=grads, **kwargs)
    if FORGE_COLLECTION not in grads:
      raise ValueError(
        f"grads has no {FORGE_COLLECTION!r} collection, so FORGE's layers "
        "would train nothing: differentiate the loss with respect to all "
        "of state.params (jax.grad(loss)(state.params)), not "
        "state.params['params'] alone."
      )
    # Also here, not only in create: a tx swapped in by replace(tx=...)
    # or the constructor steps the probes alike while its values (an
    # injected learning rate, a plateau's scale) equal the layers'.
    _check_transformation_once(self.tx)
    check_layer_optimizers(
      self.tx, old, self.params.get("params"), grads[FORGE_COLLECTION]
    )
    new, reached = install(old, grads[FORGE_COLLECTION])
    grads = {**grads, FORGE_COLLECTION: new}
    state = super().apply_gradients(grads=grads, reached=reached, **kwargs)
    # flax's step keeps 'params' and FORGE's collection only: the others
    # (batch_stats, ...) stay as they are, for the caller to update.
    kept = {k: v for k, v in self.params.items() if k not in state.params}
    return state.replace(params={**state.params, **kept}) if kept else state

  def unreached_layers(self) -> list[str]:
    """Paths of the layers the last step's loss did not reach (host side;
    layers stacked by a scan are named ``path[i]``)."""
    names = []
    for name, flags in (self.reached or {}).items():
      flags = np.asarray(jax.device_get(flags))
      if flags.ndim == 0:
        names += [name] if flags == 0 else []
      else:
        names += [f"{name}[{i}]" for i in np.flatnonzero(flags == 0)]
    return names


def install(old, cotangents):
  """FORGE's new variables and ``{path: reached}``.

  A layer whose backward was traced last, since the last install
  (:func:`forge_jax.layer_context.take_backwards`), takes its cotangents as
  they are, so its update stays in place. Any other layer is checked at run
  time: where FORGE did not write its cotangents (``intact`` is 0: the loss
  did not reach it) the old values stay.
  """
  new, reached = cotangents, {}
  layers = list(forge_layers(old))
  writes = [layer_at(cotangents, path) for path, _ in layers]
  traced = layer_context.take_backwards(
    [_recorded_key(path, layer) for path, layer in layers],
    [_written(written, "count") for written in writes],
    [_kernel(layer) for _, layer in layers],
    [_written(written, "kernel") for written in writes],
  )
  for (path, layer), written, backward_traced in zip(layers, writes, traced):
    installed, reached["/".join(path)] = install_layer(
      dict(layer), written, backward_traced
    )
    if installed is not written:
      new = with_layer(new, path, installed)
  return new, reached


def _written(written, name: str):
  """A layer's installed ``name`` entry (``count``, ``kernel``), unboxed,
  or None where it has none."""
  return meta.unbox(written.get(name) if isinstance(written, Mapping) else None)


def _recorded_key(path: tuple, layer: Mapping) -> tuple:
  """The :mod:`forge_jax.layer_context` key of the layer at ``path``
  (:func:`forge_jax.layer_context.recorded_key`)."""
  return layer_context.recorded_key(path, _kernel(layer))


def _kernel(layer: Mapping):
  """A layer's kernel as its forward read it: a partitioned variable's box
  (``nn.with_partitioning``) holds the array."""
  return meta.unbox(layer.get("kernel"))


def install_layer(old, written, backward_traced: bool):
  """One layer's variables to install, and whether the step reached it.

  ``old`` and ``written`` (its cotangents) are mappings of the layer's
  variables with ``count`` and ``intact`` entries. With ``backward_traced``
  the layer's backward wrote ``written``: it is returned as it is (the
  update stays in place). Otherwise, where ``intact`` is 0 (the loss did
  not reach the layer; for stacks, per layer) the old values stay.
  Installed eagerly, the written flags themselves decide.

  A reached layer's backward moves its ``count`` by one, or by none when
  it skipped every element (``skipped`` the kernel's size). Anything else
  is not what a backward wrote: the sum of several uses' updates (a kernel
  that a ``lax.scan`` over micro-batches stepped under one traced
  backward), or cotangents changed
  on their way (a gradient clip, loss scaling applied to FORGE's
  collection). Such a layer is poisoned as a wiped one (its ``count``
  NaN: its next step turns it NaN, ``fj.wiped_layers`` names it). The
  count, not ``intact``: XLA already keeps a copy of each old count, which
  the step reads and overwrites.

  Raises where ``written`` holds another dtype than ``old`` (grads cast to
  bfloat16 by the caller): the new weights and state were rounded.
  """
  check_dtypes(old, written)
  flags = written["intact"] > 0
  reached = flags.astype(jnp.float32)
  if not isinstance(flags, jax.core.Tracer):
    # Installed eagerly: the flags are known, and no trace tells which
    # gradient (a cached jit's) is being installed.
    backward_traced = bool(np.all(flags))
  if not backward_traced:
    keep = lambda ct, value: jnp.where(
      jnp.reshape(
        flags, jnp.shape(flags) + (1,) * (jnp.ndim(ct) - jnp.ndim(flags))
      ),
      ct,
      value,
    )
    written = jax.tree.map(keep, written, old)
  layer_size = np.size(old["kernel"]) // max(1, np.size(old["count"]))
  # The backward's own float32 sum: from 2**24 on, count + 1 rounds to count
  # (the count stays there), which a difference would read as no step.
  written_by_backward = jnp.logical_or(
    written["count"] == old["count"] + 1.0,
    jnp.logical_and(
      written["count"] == old["count"],
      written["skipped"] == float(layer_size),
    ),
  )
  changed = jnp.logical_and(flags, jnp.logical_not(written_by_backward))
  return {
    **written,
    "count": jnp.where(changed, jnp.nan, written["count"]),
  }, reached


def check_dtypes(old, written):
  """Raises where a layer's installed variables are not in the dtypes of
  its variables: a cast of grads (to bfloat16, to save memory or
  communication) rounded FORGE's new weights and optimizer state, where
  optax's step keeps the weights in their own dtypes."""
  cast = sorted(
    {
      f"{jnp.dtype(new.dtype).name} for {jnp.dtype(value.dtype).name}"
      for new, value in zip(jax.tree.leaves(written), jax.tree.leaves(old))
      if jnp.dtype(new.dtype) != jnp.dtype(value.dtype)
    }
  )
  if cast:
    raise TypeError(
      f"The gradient installed for a FORGE layer holds {', '.join(cast)}: "
      "FORGE's gradients are the layer's new weights and optimizer state, "
      "and a cast of grads changes their dtypes (a narrower one rounds "
      "them). Pass FORGE's collection to "
      "apply_gradients in the dtypes its backward wrote (cast the other "
      "gradients only)."
    )


#: What :func:`check_transformation` advises instead of clip_by_global_norm.
CLIPPING_ADVICE = (
  "Remove it from tx and clip with fj.TrainState.create(..., "
  "max_grad_norm=max_norm), taking the gradient with "
  "state.value_and_grad(loss_fn) in place of jax.value_and_grad(loss_fn)."
)


def check_transformation(tx, clipping_advice: str = CLIPPING_ADVICE):
  """Refuses a ``tx`` that cannot be right beside FORGE's layers."""
  names = transformation_names(tx)
  if "MultiSteps" in names:
    raise ValueError(
      "tx=optax.MultiSteps(...) cannot work with FORGE: the ForgeDense "
      "layers update inside every backward pass and never store the "
      "gradient it would accumulate, so the kernels would step every "
      "micro-step and the rest every k-th. Use a larger micro-batch "
      "instead: FORGE frees the gradient memory to make room for it. (To "
      "skip non-finite steps, as MultiSteps(tx, 1, should_skip_update_fn="
      "optax.skip_not_finite) does, drop it: each layer skips a step whose "
      "gradient is not finite, and tx=fj.optax_with_storage(opt) keeps the "
      "other parameters where theirs is not.)"
    )
  if "apply_every" in names:
    raise ValueError(
      "tx holds optax.apply_every(k), which accumulates the gradients of k "
      "steps and applies them every k-th: the ForgeDense layers update "
      "inside every backward pass and never store the gradient it would "
      "accumulate, so the kernels would step every step and the rest every "
      "k-th. Drop it and use a larger micro-batch instead: FORGE frees the "
      "gradient memory to make room for it."
    )
  if "clip_by_global_norm" in names:
    raise ValueError(
      "tx holds clip_by_global_norm: the ForgeDense layers update inside "
      "the backward pass, before the global norm exists, and their "
      "gradients never reach tx. " + clipping_advice
    )
  if "inject_hyperparams" in names:
    raise ValueError(
      "tx=optax.inject_hyperparams(...) cannot drive FORGE's layers: they "
      "take their hyperparameters from their optimizer (fj.adamw(...)), so "
      "a value changed in tx's state would not reach them, and its float32 "
      "hyperparameters round the bias corrections unlike the layers' rule. "
      "Pass tx=opt.to_optax(), with an optax schedule as the learning rate "
      "if it changes (the schedule gives its value at any step, to log)."
    )
  if "reduce_on_plateau" in names:
    raise ValueError(
      "tx holds reduce_on_plateau: it scales the updates of tx by a factor "
      "kept in tx's state, which FORGE's layers never see (they step "
      "inside the backward pass by their own optimizer), so only the other "
      "parameters would slow down. Pass tx=opt.to_optax(), with an optax "
      "schedule as the learning rate of opt."
    )
  if "zero_nans" in names:
    raise ValueError(
      "tx holds zero_nans: the ForgeDense layers keep their weights and "
      "states where a gradient element is not finite (counted in skipped), "
      "and their gradients never reach tx, so zero_nans would step only "
      "the other parameters, and unlike the layers. Remove it from tx; "
      "tx=fj.optax_with_storage(opt) keeps the other parameters' "
      "non-finite elements as the layers do."
    )
  copies = sorted(names.intersection({"lookahead", "schedule_free"}))
  if copies:
    raise ValueError(
      f"tx holds {', '.join(copies)}, which keeps another copy of the "
      "weights in its state (lookahead's slow weights, schedule-free's "
      "averaged iterate) and moves it by the updates tx computes: FORGE's "
      "kernels step inside the backward pass by their own optimizer and "
      "never pass through tx. Use flax's layers for it, or drop it."
    )
  whole = sorted(names.intersection(WHOLE_GRADIENT_TRANSFORMATIONS))
  if whole:
    raise ValueError(
      f"tx holds {', '.join(whole)}, which needs the whole gradient; the "
      "ForgeDense layers update inside the backward pass and their "
      "gradients never reach tx, so it would act on the other parameters "
      "only. Remove it from tx."
    )


def _check_transformation_once(tx):
  """:func:`check_transformation`, asked once per hashable ``tx`` that
  passes it (a step traced or run eagerly again asks nothing)."""
  try:
    _check_hashable_transformation(tx)
  except TypeError:  # an unhashable tx: checked each time
    check_transformation(tx)


@functools.lru_cache(maxsize=64)
def _check_hashable_transformation(tx):
  check_transformation(tx)


def check_clipped(layers, advice: str):
  """Refuses a clipped step whose FORGE layers' backward passes were
  traced without clipping: they stepped unclipped. ``layers``: ``(name,
  key, kernel)`` of each layer, ``key`` its :mod:`forge_jax.layer_context`
  path; ``advice``: how to take the gradient instead."""
  unclipped = []
  for name, key, kernel in layers:
    stepped = layer_context.stepping_pass(key, kernel)
    if stepped is not None and stepped[0] not in (
      layer_context.SCALED,
      layer_context.DEFERRED,
    ):
      unclipped.append(name)
  if unclipped:
    raise ValueError(
      f"max_grad_norm is set, but the FORGE layers {unclipped} stepped "
      f"with unclipped gradients: {advice}"
    )


@functools.lru_cache(maxsize=64)
def _same_rule(tx, optimizer) -> bool | None:
  """Whether ``tx`` steps a probe like ``optimizer.to_optax()`` or
  ``fj.optax_with_storage(optimizer)`` does (None: ``tx`` cannot run on
  the probe, e.g. it labels parameters by name, or leaves it where it is:
  a freezing label that reaches the probe says nothing of the rule)."""
  if _is_rule_form(tx, optimizer):
    return True
  try:
    # Eagerly, also while a train step traces: the probe is concrete.
    with jax.ensure_compile_time_eval():
      for reference in (
        optimizer.to_optax,
        functools.partial(optax_storage.optax_with_storage, optimizer),
      ):
        verdict = _steps_match(tx, reference())
        if verdict is not False:
          return verdict
  except Exception:  # pylint: disable=broad-exception-caught
    return None
  return False


def _is_rule_form(tx, optimizer) -> bool:
  """Whether ``tx`` is ``optimizer.to_optax()`` or
  ``fj.optax_with_storage(optimizer)`` itself (each shared by equal
  optimizers): it steps by ``optimizer``'s rule, without a probe."""
  return tx is optimizer.to_optax() or (
    tx is optax_storage.optax_with_storage(optimizer)
  )


#: The probe: a kernel-shaped parameter (made into an array where it steps,
#: eagerly).
_PROBE_KERNEL = [[0.5, -1.0, 2.0], [-0.25, 3.0, 0.1]]

#: The probe's gradients: three steps whose magnitudes range from 1e-4 to
#: 1e4, so that a transformation that changes some steps (an elementwise
#: clip, a rescaling by magnitude) changes the probe's.
_PROBE_GRADIENTS = (
  [[0.1, -0.3, 2e3], [0.02, -1e-4, 0.5]],
  [[-0.2, 0.1, 1.0], [0.4, -5e3, 0.3]],
  [[0.05, 40.0, -1e4], [-0.3, 1.0, 2e-3]],
)


#: The comparison of ``tx`` with the layers' rule steps on from the
#: probe's three steps: six steps of gradients that turn against the ones
#: before them at ratios from 1e-3 to 1e5 (Lion's ``b1`` shows only in the
#: sign of its mix of the gradient and the momentum; RAdam's threshold once
#: its rectification starts, from the fourth step on). Chosen so that each
#: of Lion's ``b1`` in 0.5, 0.8, 0.85, 0.95 against 0.9, ``b2`` 0.98 and
#: 0.999 against 0.99, and RAdam's threshold 3, 4, 6 against 5 differ.
_RULE_PROBE_GRADIENTS = _PROBE_GRADIENTS + (
  [[0.0036, -3.99, -23.5], [-0.0134, -0.0021, 0.0446]],
  [[-0.394, 10.4, -0.344], [6.30, -638.0, -12.5]],
  [[-1.17, -222.0, -45.0], [-0.0811, -351.0, -0.669]],
  [[0.0163, 203.0, 12.0], [-125.0, -7.36, -0.275]],
  [[0.426, 226.0, 4.81], [94.7, -0.974, 14.3]],
  [[0.004, -0.0017, 16.3], [0.548, -243.0, -103.0]],
)

#: Then one step at each of these step counts (every integer scalar of both
#: states, their ``count``s, set to it): a learning-rate schedule of ``tx``
#: that departs from the layers' late (a decay's length, a boundary).
_PROBE_COUNTS = (30, 300, 3_000, 30_000, 300_000)


def _at_count(state, count: int):
  """``state`` with every integer scalar (a transformation's step count)
  set to ``count``."""
  return jax.tree.map(
    lambda leaf: (
      jnp.full_like(leaf, count)
      if jnp.ndim(leaf) == 0
      and jnp.issubdtype(jnp.result_type(leaf), jnp.integer)
      else leaf
    ),
    state,
  )


def _same_steps(a, b) -> bool:
  """Whether two probe steps agree (NaN where both step NaN: RAdam below
  its threshold)."""
  return np.allclose(a, b, rtol=1e-5, atol=1e-8, equal_nan=True)


def _steps_match(tx, reference) -> bool | None:
  """Whether ``tx`` steps the probe as ``reference`` does; None where
  ``tx`` never moves it."""
  expected = _rule_probe_steps(reference)
  same, moved = True, False
  for update, want in zip(_rule_probe_updates(tx), expected):
    moved = moved or bool(update.any())
    same = same and _same_steps(update, want)
    if moved and not same:
      return False
  return same if moved else None


@functools.lru_cache(maxsize=64)
def _rule_probe_steps(reference) -> tuple:
  """``reference``'s updates in the rule probe's steps (a transformation
  shared by equal optimizers: computed once)."""
  return tuple(_rule_probe_updates(reference))


def _rule_probe_updates(tx):
  """``tx``'s update of the probe kernel in each rule probe step, as each
  is taken."""
  # A kernel-shaped parameter named like one: weight-decay masks by rank or
  # by name treat it as they would a kernel.
  params = {"kernel": jnp.asarray(_PROBE_KERNEL)}
  state = tx.init(params)
  steps = [(g, None) for g in _RULE_PROBE_GRADIENTS]
  steps += [(_PROBE_GRADIENTS[0], count) for count in _PROBE_COUNTS]
  for g, count in steps:
    if count is not None:
      state = _at_count(state, count)
    grads = {"kernel": jnp.asarray(g, jnp.float32)}
    update, state = tx.update(grads, state, params)
    yield np.asarray(update["kernel"])


def check_layer_optimizers(tx, collection, params=None, written=None):
  """Refuses a ``tx`` that is not the optimizer of the ForgeDense layers of
  ``collection`` (the parameters it trains would follow another rule),
  that would freeze some of them the gradient steps, or that steps some of
  them by another rule than their own (a learning rate of their own by
  path, another layer's rule).

  ``params``: the tree ``tx`` steps (the ``'params'`` collection), probed
  where ``tx`` cannot run on kernel-shaped probes at the layers' paths
  (labels given as a pytree of that tree, not as a function). ``written``:
  the gradient being installed (FORGE's collection), whose layers the loss
  did not reach may be frozen (their output's gradient stopped)."""
  kernels = {path: _kernel(layer) for path, layer in forge_layers(collection)}
  keys = {
    path: layer_context.recorded_key(path, kernel)
    for path, kernel in kernels.items()
  }
  candidates = {
    path: layer_context.optimizers(keys[path], kernel)
    for path, kernel in kernels.items()
  }
  layers = tuple((path, _followed(tx, c)) for path, c in candidates.items())
  ambiguous = {
    "/".join(map(str, p)) for p, c in candidates.items() if len(c) > 1
  }
  weights = {path: layer_context.weight_name(keys[path]) for path, _ in layers}
  ranks = {path: np.ndim(kernel) for path, kernel in kernels.items()}
  try:
    by_kernels = probe_kernels(tx, layers, weights, params, ranks)
    by_params = None if params is None else probe_layers(tx, layers, params)
  except TypeError:  # an unhashable tx: nothing to probe
    by_kernels = by_params = None
  probe = by_kernels if by_kernels is not None else by_params
  if probe is not None and written is not None:
    unreached = _unreached(collection, written)
    probe = probe._replace(
      frozen=tuple(n for n in probe.frozen if n not in unreached)
    )
  check_optimizers(tx, {optimizer for _, optimizer in layers})
  check_decay_masks(layers, weights, kernels)
  check_probed(probe, by_params, by_kernels, ambiguous)


def _kernel_ranks(collection) -> dict:
  """``{path: rank of the kernel}`` of the ForgeDense layers of
  ``collection`` (3 or more for ``nn.DenseGeneral``'s kernels and a scan's
  stacks): a weight-decay mask by rank reads it."""
  return {
    path: np.ndim(_kernel(layer)) for path, layer in forge_layers(collection)
  }


def _unreached(collection, written) -> set:
  """Names of the layers of ``collection`` that the gradient ``written``
  (FORGE's collection) does not step (:func:`unreached_layer`)."""
  names = set()
  for path, layer in forge_layers(collection):
    flags = layer_at(written, path)
    flags = flags.get("intact") if isinstance(flags, Mapping) else None
    if unreached_layer(flags, _recorded_key(path, layer), _kernel(layer)):
      names.add("/".join(map(str, path)))
  return names


def unreached_layer(flags, key: tuple, kernel) -> bool:
  """Whether a gradient does not step the layer keyed ``key`` in
  :mod:`forge_jax.layer_context`, whose old kernel is ``kernel``: its
  written ``intact`` ``flags`` say so, or, where traced (or None), the
  gradient traced its forward and no backward (its output's gradient
  stopped)."""
  if flags is not None and not isinstance(flags, jax.core.Tracer):
    return not np.any(np.asarray(flags) > 0)
  return layer_context.forward_only(key, kernel)


def _followed(tx, candidates: tuple):
  """Of a layer's candidate optimizers (the likeliest first), the first
  whose rule ``tx`` may be; else the first (None where there are none)."""
  for optimizer in candidates:
    try:
      if _same_rule(tx, optimizer) is not False:
        return optimizer
    except TypeError:  # an unhashable tx: nothing to compare with
      break
  return candidates[0] if candidates else None


def check_decay_masks(layers: tuple, weights: Mapping, kernels: Mapping):
  """Refuses a weight-decay ``mask`` of a layer's optimizer that leaves out
  that layer's kernel, asked at the path where flax's layer keeps it:
  FORGE decays every kernel it steps, and the mask reaches only the
  parameters optax owns. The mask may be a function of the parameters or
  a pytree of them or of a prefix (:func:`mask_at`). ``layers``:
  ``(path, optimizer)`` pairs; ``weights``: by path, the name flax's layer
  keeps its weight under (``'embedding'`` for an embedding; ``'kernel'``
  where absent); ``kernels``: by path, the kernel (an array or its shape
  and dtype), which a mask function reads as optax would give it: by its
  rank, shape, size or dtype. A mask that reads the kernel's values
  cannot be judged and is let through."""
  left_out = []
  for path, optimizer in layers:
    mask = getattr(optimizer, "mask", None)
    if mask is None or not has_weight_decay(optimizer.weight_decay):
      continue
    keys = (*path, weights.get(path, "kernel"))
    if callable(mask):
      mask = _mask_of_kernel(mask, keys, kernels[path])
    decided = mask_at(mask, keys)
    try:
      kept = decided is None or np.all(np.asarray(decided))
    except jax.errors.TracerArrayConversionError:  # read the values
      kept = True
    if not kept:
      left_out.append("/".join(map(str, path)))
  if left_out:
    raise ValueError(undecayed_message(left_out))


def _mask_of_kernel(mask: Callable, keys: tuple, kernel):
  """``mask`` called on a tree holding the kernel alone at ``keys``, traced
  abstractly (no memory): a kernel of its real shape and dtype. None where
  the mask fails on that tree (written for another tree)."""
  leaf = jax.ShapeDtypeStruct(jnp.shape(kernel), kernel.dtype)
  tree = leaf
  for key in reversed(keys):
    tree = {key: tree}
  decided = []

  def call(tree):
    decided.append(mask(tree))
    return 0

  try:
    jax.eval_shape(call, tree)
  except Exception:  # noqa: BLE001 (a mask written for another tree)
    return None
  return decided[0]


def mask_at(mask, keys: tuple):
  """What the mask pytree ``mask`` says of the parameter at key path
  ``keys``: the first leaf on the way there, which optax applies to the
  whole subtree below it (a mask may be a prefix of the parameters); None
  where ``mask`` has no such path, or holds no leaf on it."""
  node = mask
  for key in keys:
    if node is None:
      return None
    if isinstance(node, Mapping):
      node = node.get(key)
    elif isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
      node = node[key] if isinstance(key, int) and key < len(node) else None
    else:
      return node
  return None if isinstance(node, (Mapping, list, tuple)) else node


def check_named_absent_layers(tx, params, paths, weights=None, ranks=None):
  """Where ``tx`` cannot start on ``params`` (the tree it steps), refuses
  it in FORGE's words if it starts once the FORGE layers at ``paths`` get
  their kernels there (named and of the rank of
  :func:`_kernel_probe_tree`'s; the tree holds a layer's bias at most, its
  kernel and state being FORGE's): its labels or mask, given as a pytree
  of flax's layers' parameters, name those kernels. Returns otherwise."""
  weights = weights or {}
  # The tree with the kernels of the layers it has no entry for (bias-free
  # layers, which a pytree may name by a leaf), else with every kernel
  # (a pytree of flax's layers' parameters, kernels and biases).
  unnamed = [
    path
    for path in paths
    if not _holds(params, (*path, weights.get(path, "kernel")))
  ]
  for absent in ([path for path in paths if not _holds(params, path)], unnamed):
    beside = _with_kernels(params, absent, weights, ranks) if absent else None
    if beside is None:
      continue
    try:
      jax.eval_shape(tx.init, beside)
    except Exception:  # noqa: BLE001 (another cause: the caller raises it)
      continue
    raise ValueError(_unnamed_kernels_message(absent))


def _unnamed_kernels_message(absent) -> str:
  """The error for labels or a mask that name the kernels of the layers at
  ``absent``."""
  names = ["/".join(map(str, path)) for path in absent]
  return (
    "tx cannot start on the tree it steps (the 'params' collection; "
    "under NNX, nnx.state(model, wrt)), which holds no kernel of the FORGE "
    f"layers {names} (a layer without a bias has no entry at all): their "
    "kernel and optimizer state are FORGE's. tx's "
    "labels or mask (an optimizer's weight-decay mask too), given as a "
    "pytree, name them (as for flax's nn.Dense / nn.Embed, whose weight is "
    "a parameter). "
    "Leave them out of that tree, or give the labels or mask as a function "
    "of the parameters: FORGE steps and decays those layers' kernels by "
    "their own optimizer (a layer to keep frozen or undecayed is flax's "
    "own: nn.Embed, nn.Dense, nnx.Linear)."
  )


def _holds(params, path) -> bool:
  """Whether the tree ``params`` has an entry at the module ``path``."""
  node = params
  for key in path:
    if not isinstance(node, Mapping) or key not in node:
      return False
    node = node[key]
  return True


def undecayed_message(paths) -> str:
  """The error for a weight-decay mask that leaves out the kernels of the
  FORGE layers at ``paths``."""
  return (
    f"The weight-decay mask leaves out the kernels of the FORGE layers "
    f"{list(paths)}, but FORGE decays every kernel it steps: the mask "
    "reaches only the parameters optax owns (biases, norms). Make those "
    "layers flax's own (nn.Dense, nn.Embed, nnx.Linear), give them an "
    "optimizer without weight decay (fj.adamw(..., weight_decay=0.0)), "
    "or keep their kernels in the mask."
  )


def check_probed(
  frozen: Optional[LayerProbe],
  owned: Optional[LayerProbe],
  kernels: Optional[LayerProbe] = None,
  ambiguous=(),
):
  """Refuses what the layer probes (:func:`probe_layers`) found: in
  ``frozen``, layers ``tx`` freezes; in ``kernels`` (:func:`probe_kernels`),
  where one rule is every layer's, layers whose kernel ``tx`` would step
  by another (a learning rate of their own by path, a weight-decay mask
  that leaves it out), but for the ``ambiguous`` ones (their optimizer not
  known); in ``owned`` (the probe of the tree ``tx`` steps, where the
  layers own their biases), where the layers' optimizers differ, layers
  whose biases ``tx`` steps by another rule than their layer's, with or
  without its weight decay (then their kernels, where probed, by it). A
  ``None`` probe (``tx`` could not run on it) refuses nothing."""
  if frozen is not None and frozen.frozen:
    raise ValueError(frozen_message(frozen.frozen))
  off_kernels = tuple(
    name
    for name in (kernels.off_rule if kernels is not None else ())
    if name not in ambiguous
  )
  if kernels is not None and not kernels.mixed:
    misruled = off_kernels
  elif owned is not None and owned.mixed:
    # Biases alone may take rules of their own (no weight decay on some, by
    # rank or name): only a kernel at a layer's path, where nn.Dense keeps
    # one, says that tx singles the layer out. On several rules, a bias
    # stepped by another than its layer's rule says so too (a bias-free
    # layer's rule plays no part in tx).
    misruled = tuple(
      name
      for name in owned.misruled
      if name not in owned.undecayed or name in off_kernels
    )
  else:
    misruled = ()
  undecayed = [
    name
    for name in misruled
    if kernels is not None and name in kernels.undecayed
  ]
  if undecayed:
    raise ValueError(undecayed_message(undecayed))
  if misruled:
    raise ValueError(
      f"tx steps the FORGE layers {sorted(set(misruled))} by another rule "
      "than their own optimizer (a learning rate or rule of their own, or "
      "another layer's), but FORGE steps each layer's kernel by the "
      "layer's optimizer in the backward pass: only the bias would follow "
      "tx. Give such a layer the optimizer it should follow "
      "(fj.ForgeDense(..., optimizer=fj.adamw(...)) / fj.nnx.Linear), and "
      "step its bias by that optimizer's rule: optax.multi_transform({'a': "
      "opt_a.to_optax(), 'b': opt_b.to_optax()}, labels), the labels "
      "naming each layer's optimizer by its path (the parameters no layer "
      "owns may take any of them)."
    )


def frozen_message(
  paths,
  cause: str = "tx leaves the layers {paths} unchanged, as for frozen "
  "parameters (optax.set_to_zero, a frozen label of optax.multi_transform)",
) -> str:
  """The error for a ``tx`` (or ``cause``) that freezes the FORGE layers at
  ``paths``."""
  return (
    cause.format(paths=list(paths))
    + ", but they are FORGE layers: their kernels "
    "step inside the backward pass by their own optimizer and never pass "
    "through tx. Make a frozen layer a plain nn.Dense / nnx.Linear "
    "(frozen, it keeps no optimizer state), or stop the gradient of its "
    "output (jax.lax.stop_gradient) so that the loss does not reach it. "
    "(A label by leaf name, such as every 'kernel', reaches them too: "
    "label frozen layers by path. To freeze only a FORGE layer's bias, "
    "give the labels as a function of the parameters.)"
  )


class LayerProbe(NamedTuple):
  """What stepping a tree through ``tx`` and through each layer's rule
  says of the layers owning leaves there (paths joined by ``/``).

  Attributes:
    frozen: layers whose every leaf ``tx`` leaves unchanged while their
      rule moves it.
    misruled: layers whose leaves ``tx`` steps unlike their rule (unlike
      ``opt.to_optax()`` and ``fj.optax_with_storage(opt)`` both), where
      the optimizers of the layers owning leaves differ or ``tx`` steps
      other layers' leaves by it.
    mixed: whether the optimizers of the layers owning leaves differ.
    off_rule: every layer whose leaves ``tx`` steps unlike its rule.
    undecayed: those of ``off_rule`` whose leaves ``tx`` steps as their
      rule would without its weight decay.
  """

  frozen: tuple
  misruled: tuple
  mixed: bool = False
  off_rule: tuple = ()
  undecayed: tuple = ()


def probe_layers(
  tx, layers: tuple, params, weights=None
) -> Optional[LayerProbe]:
  """Steps a tree of ``params``' structure (the tree ``tx`` steps: a
  layer's bias there) through ``tx`` and each of ``layers``' rules
  (``(path, optimizer)`` pairs) for the probe's steps: catches a module
  frozen by path, or stepped by another layer's rule, with labels or a
  mask given as a pytree of ``params``. A layer owns the leaves under its
  path, or with ``weights`` (by path, as for :func:`check_decay_masks`)
  only its weight there. A layer without leaves there (no bias) says
  nothing. None where ``tx`` cannot run on a tree like ``params``."""
  leaves, treedef = jax.tree.flatten(params)
  ranks = tuple(np.ndim(leaf) for leaf in leaves)
  owners = tuple(
    (*path, weights.get(path, "kernel")) if weights is not None else path
    for path, _ in layers
  )
  return _probe_layers(tx, layers, owners, treedef, leaf_paths(params), ranks)


def key_name(key):
  """A pytree key path entry's name: its dict key, attribute name or
  sequence index."""
  for field in ("key", "name", "idx"):
    if hasattr(key, field):
      return getattr(key, field)
  return key


def leaf_paths(tree) -> tuple:
  """Each leaf's path in ``tree``: a tuple of names (:func:`key_name`)."""
  return tuple(
    tuple(key_name(key) for key in path)
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  )


def _probe_of_rank(values, rank: int) -> np.ndarray:
  """The 2 x 3 probe ``values`` as an array of ``rank`` dimensions."""
  values = np.asarray(values, np.float32)
  if rank == 0:
    return values.reshape(-1)[:1].reshape(())
  if rank == 1:
    return values.reshape(-1)
  return values.reshape((1,) * (rank - 2) + values.shape)


@functools.lru_cache(maxsize=64)
def _probe_layers(
  tx, layers, owners, treedef, names, ranks
) -> Optional[LayerProbe]:
  """:func:`probe_layers` on the structure ``treedef`` whose leaves have
  key paths ``names`` and ``ranks`` dimensions, each layer owning those
  under its entry of ``owners``."""
  owned = {
    path: [i for i, name in enumerate(names) if name[: len(owner)] == owner]
    for (path, opt), owner in zip(layers, owners)
    if opt is not None
  }
  owned = {path: leaves for path, leaves in owned.items() if leaves}
  if not owned:
    return LayerProbe((), ())
  rules = dict(layers)
  owning = {rules[path] for path in owned}
  if len(owning) == 1 and _is_rule_form(tx, *owning):
    return LayerProbe((), ())
  try:
    # Eagerly, also while a train step traces: the probe is concrete.
    with jax.ensure_compile_time_eval():
      return _judged_probe(tx, owned, rules, treedef, ranks)
  except Exception:  # pylint: disable=broad-exception-caught
    return None


def _judged_probe(tx, owned, rules, treedef, ranks) -> LayerProbe:
  """:func:`_probe_layers`'s verdicts on the leaves ``owned`` by each layer
  path, ``rules`` its optimizer. Each rule's optax forms step the probe
  only as far as a verdict needs them."""

  def form_steps(opt, form: int):
    if form == 0:
      return _probe_steps(opt.to_optax(), treedef, ranks)
    return _probe_steps(optax_storage.optax_with_storage(opt), treedef, ranks)

  def forms(opt):
    """The steps of ``opt``'s optax forms, each run when first asked for
    (none for None)."""
    return () if opt is None else (form_steps(opt, f) for f in (0, 1))

  by_tx = _probe_steps(tx, treedef, ranks)
  optimizers = {rules[path] for path in owned}
  moves = lambda taken, leaves: any(
    np.asarray(step).any() for i in leaves for step in taken[i]
  )
  follows = lambda taken, leaves: all(
    _same_steps(a, b) for i in leaves for a, b in zip(by_tx[i], taken[i])
  )
  name = lambda path: "/".join(map(str, path))
  frozen = tuple(
    name(path)
    for path, leaves in owned.items()
    if not moves(by_tx, leaves) and moves(form_steps(rules[path], 0), leaves)
  )
  stepped = {
    path: leaves
    for path, leaves in owned.items()
    if name(path) not in frozen and moves(by_tx, leaves)
  }
  off_rule = {
    name(path): not any(follows(taken, leaves) for taken in forms(rules[path]))
    for path, leaves in stepped.items()
  }
  undecayed = tuple(
    name(path)
    for path, leaves in stepped.items()
    if off_rule[name(path)]
    and any(follows(taken, leaves) for taken in forms(_undecayed(rules[path])))
  )
  # With one rule for every layer, tx stepping some layers by it and others
  # otherwise singles those out by their paths (a learning rate of their
  # own, on a kernel probe), which their kernels never follow. Where it
  # steps none by it, it treats all alike: the rule's probe of a kernel
  # (check_optimizers) decides.
  mixed = len(optimizers) > 1
  singled_out = mixed or not all(off_rule.values())
  misruled = tuple(n for n, off in off_rule.items() if off and singled_out)
  return LayerProbe(
    frozen,
    misruled,
    mixed,
    tuple(n for n, off in off_rule.items() if off),
    undecayed,
  )


@functools.lru_cache(maxsize=256)
def _probe_steps(tx, treedef, ranks) -> tuple:
  """Per leaf of a tree of structure ``treedef`` whose leaves have
  ``ranks`` dimensions: ``tx``'s update in each probe step (the layers'
  rules' optax forms, shared by equal optimizers, are stepped once)."""
  probe = lambda values: jax.tree.unflatten(
    treedef, [jnp.asarray(_probe_of_rank(values, r)) for r in ranks]
  )
  params = probe(_PROBE_KERNEL)
  state, taken = tx.init(params), [[] for _ in ranks]
  for g in _PROBE_GRADIENTS:
    updates, state = tx.update(probe(g), state, params)
    for i, step in enumerate(jax.tree.leaves(updates)):
      taken[i].append(np.asarray(step))
  return tuple(tuple(steps) for steps in taken)


def _undecayed(optimizer):
  """``optimizer`` without its weight decay; None where it has none (or is
  not a dataclass)."""
  weight_decay = getattr(optimizer, "weight_decay", 0.0)
  if not dataclasses.is_dataclass(optimizer) or not has_weight_decay(
    weight_decay
  ):
    return None
  return dataclasses.replace(optimizer, weight_decay=0.0)


def probe_kernels(
  tx, layers: tuple, weights=None, params=None, ranks=None
) -> Optional[LayerProbe]:
  """:func:`probe_layers` on a tree with a kernel at each of ``layers``'
  paths (where flax's layer keeps one; ``weights`` as for
  :func:`check_decay_masks`, ``ranks`` the kernels' numbers of dimensions
  by path, 2 where absent), judging those kernels alone: how freezing by
  name (``optax.multi_transform``, ``optax.masked``) treats them. (A
  learning rate that starts at zero leaves both unmoved on the first
  step.) Where ``tx`` cannot run on that tree, the kernels are added to
  ``params`` (the tree ``tx`` steps), for labels or masks given as a
  prefix of it (``{'encoder': False}``). None where ``tx`` cannot run on
  either tree."""
  weights = weights or {}
  paths = [path for path, _ in layers]
  probe = probe_layers(
    tx, layers, _kernel_probe_tree(paths, weights, ranks), weights
  )
  if probe is not None or params is None:
    return probe
  for kept in _insertable(params, paths):
    beside = _with_kernels(params, kept, weights, ranks)
    if beside is not None:
      probe = probe_layers(tx, layers, beside, weights)
    if probe is not None:
      break
  return probe


def _insertable(params, paths) -> list:
  """The sets of ``paths`` to add kernels at, the largest first: a layer
  without parameters in ``params`` (no bias) adds modules the tree lacks,
  which a prefix of ``params`` fits only where its leaf stands above them
  (``{'encoder': False}`` for a bias-free layer in the encoder). Each set
  keeps the paths whose modules ``params`` holds to a depth, deeper in
  each next set."""

  def depth(path):
    node = params
    for i, key in enumerate(path):
      if not isinstance(node, Mapping) or key not in node:
        return i
      node = node[key]
    return len(path)

  depths = {path: depth(path) for path in paths}
  sets = []
  for d in range(max(map(len, paths), default=0) + 1):
    kept = [path for path in paths if depths[path] >= min(d, len(path))]
    if kept and kept not in sets:
      sets.append(kept)
  return sets


def _with_kernels(params, paths, weights, ranks=None):
  """``params`` with a kernel-shaped leaf at each of ``paths`` (named and
  of the rank of :func:`_kernel_probe_tree`'s), its mappings of their own
  types (an ``nnx.State``); None where a leaf stands on a path."""

  def add(node, keys, leaf):
    if not keys:
      return None if node is not None else leaf
    if node is None:
      node = {}
    if not isinstance(node, Mapping):
      return None
    # An nnx.State wraps the mappings it holds: its raw ones keep their type.
    entries = dict(getattr(node, "raw_mapping", node))
    child = add(entries.get(keys[0]), keys[1:], leaf)
    if child is None:
      return None
    entries[keys[0]] = child
    try:
      return type(node)(entries)
    except TypeError:  # a mapping not made from a dict
      return entries

  ranks = ranks or {}
  for path in paths:
    weight = _probe_weight(ranks.get(path, 2))
    params = add(params, (*path, weights.get(path, "kernel")), weight)
    if params is None:
      return None
  return params


def _probe_weight(rank: int) -> np.ndarray:
  """A probe kernel of ``rank`` dimensions (the probe's ``2 x 3`` behind
  ones): a mask by rank treats it as the layer's kernel."""
  return np.zeros((1,) * (rank - 2) + (2, 3), np.float32)


def _kernel_probe_tree(paths, weights=None, ranks=None) -> dict:
  """A tree with a kernel-shaped leaf at each of ``paths``, named as flax's
  layer names its weight (``weights`` by path: ``'kernel'`` where absent,
  as for ``nn.Dense``) and of its kernel's rank (``ranks`` by path: 2
  where absent)."""
  weights, ranks = weights or {}, ranks or {}
  params = {}
  for path in paths:
    node = params
    for key in path:
      node = node.setdefault(key, {})
    node[weights.get(path, "kernel")] = _probe_weight(ranks.get(path, 2))
  return params


def check_optimizers(tx, optimizers):
  """Refuses a ``tx`` that is not the rule of the FORGE layers'
  ``optimizers`` (a set; None entries are ignored)."""
  optimizers = set(optimizers)
  optimizers.discard(None)
  if not optimizers:
    return
  try:
    verdicts = [_same_rule(tx, opt) for opt in optimizers]
  except TypeError:  # an unhashable tx: nothing to compare with
    return
  if any(v is None or v for v in verdicts):
    return
  names = ", ".join(sorted(repr(o) for o in optimizers))
  raise ValueError(
    f"tx is not the optimizer of the ForgeDense layers ({names}): the "
    "layers and the other parameters would train by different rules. "
    "Pass tx=opt.to_optax() for the layers' optimizer opt."
  )
