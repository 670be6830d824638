"""The global gradient norm and global-norm clipping (forge_jax.clipping).

* ``'exact'`` clipping through ``fj.TrainState(max_grad_norm=c)`` steps as
  ``optax.chain(optax.clip_by_global_norm(c), <alias>)`` over all
  parameters (ForgeDense kernels and the optax-owned biases), within 1e-6
  in float32, for the optimizer table's rows with clipping active and
  inactive, and for an fj.scan model.
* The reported norm (``state.grad_norm``, ``fj.global_norm``) is
  ``optax.global_norm`` of the reference gradient, every step.
* ``'delayed'`` scales step t's gradient by ``min(1, c / ||g_{t-1}||)``.
* The Pallas kernels (interpret mode) sum the same squares as the XLA
  reference; the compiled exact step runs the forward pass once.
* ``'exact'`` runs one backward pass and steps each layer from its factors
  afterwards (unrolled, fj.scan-stacked, the Triton kernel in interpret
  mode); it falls back to two backward passes, still exact, when a layer
  runs under nn.scan or the loss does not hand the factor sinks on. Int8
  states with stochastic rounding: bit-for-bit the two-pass step while the
  clipping is inactive; clipped, ``dy`` is scaled at each layer instead of
  the seed at the loss, a different float32 rounding of the same product.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState as FlaxTrainState

import forge_jax as fj
from forge_jax import layer_context, parallel
from forge_jax.linen import forge_layers
from forge_jax.ops import backends, mosaic, triton_kernel
from forge_jax.ops.fused_dense import FusedDenseSpec

from conftest import (
  COLL,
  MLP,
  assert_rel_close,
  assert_same_bits,
  cross_entropy,
  make_batches,
  ulp_distance,
)
from fused_dense_test_base import (
  BF16_STATE_RTOL,
  CLASSES,
  FEATURES,
  LOWP_OPTIMIZERS,
  OPTAX_CASES,
  RTOL,
  compare_states,
)

STEPS = 3
MLP_LAYERS = [(f"fc{i + 1}",) for i in range(len(FEATURES))]


def _last_passes(paths):
  """The passes the last traced backward of each layer ran as."""
  return {layer_context.last_pass(path) for path in paths}


def _without_factors(variables):
  """The variables a loss hands the model when it keeps only ``params`` and
  FORGE's collection: the layers find no factor sinks."""
  return {name: variables[name] for name in ("params", COLL)}


#: The optimizers whose first row the default run clips: clipping scales the
#: gradient before the alias, whatever its rule (every optimizer with
#: --run-slow; AdamW is clipped by default in the tests below).
CLIPPED_BY_DEFAULT = ("adam",)


def _table_rows():
  """``(case, active)`` pairs of the table: clipping active on the first row
  of each of :data:`CLIPPED_BY_DEFAULT` and inactive on the table's first
  row by default, every pair with --run-slow."""
  seen, rows = set(), []
  for i, case in enumerate(OPTAX_CASES):
    first = case.name not in seen and case.name in CLIPPED_BY_DEFAULT
    seen.add(case.name)
    for active in (True, False):
      default = first and (active or i == 0)
      rows.append(
        pytest.param(
          case,
          active,
          id=f"{case.id}-{'active' if active else 'inactive'}",
          marks=() if default else pytest.mark.slow,
        )
      )
  return rows


def _loss(apply_fn, batch):
  return lambda variables: cross_entropy(apply_fn, variables, batch)


# One program per model and shapes (eager, every op of the backward
# compiles on its own).
@functools.partial(jax.jit, static_argnums=0)
def _gradient_and_norm(apply_fn, variables, batch):
  grads = jax.grad(_loss(apply_fn, batch))(variables)
  return grads, optax.tree.norm(grads)


def _reference_norms(model, variables, tx, batches):
  """optax.global_norm of the nn.Dense model's gradient at every step."""
  state = FlaxTrainState.create(apply_fn=model.apply, params=variables, tx=tx)
  norms = []
  for batch in batches:
    grads, norm = _gradient_and_norm(model.apply, state.params, batch)
    norms.append(float(norm))
    state = state.apply_gradients(grads=grads)
  return norms


def _clipped_runs(
  name,
  kwargs,
  shape,
  features,
  max_norm,
  seed,
  clip="exact",
  implementation="xla",
  factors=True,
  has_aux=False,
):
  """FORGE (fj.TrainState, ``max_grad_norm``) and nn.Dense + optax.chain(
  clip_by_global_norm, alias) from one initialization: the states and the
  reference's gradient norms after every step. ``factors=False``: the loss
  hands the model only ``params`` and FORGE's collection. ``has_aux``:
  FORGE's loss also returns the loss and the logits as aux."""
  opt = getattr(fj, name)(**kwargs)
  forge_model = MLP(features, optimizer=opt, implementation=implementation)
  ref_model = MLP(features)
  batches = make_batches(seed + 1, STEPS, shape, features[-1])
  key = jax.random.key(seed)
  forge_vars = forge_model.init(key, batches[0][0])
  ref_vars = ref_model.init(key, batches[0][0])
  forge = fj.TrainState.create(
    apply_fn=forge_model.apply,
    params=forge_vars,
    tx=opt.to_optax(),
    max_grad_norm=max_norm,
    clip=clip,
  )
  ref = FlaxTrainState.create(
    apply_fn=ref_model.apply,
    params=ref_vars,
    tx=optax.chain(
      optax.clip_by_global_norm(max_norm), getattr(optax, name)(**kwargs)
    ),
  )

  @jax.jit
  def forge_step(state, batch):
    loss_fn = _loss(state.apply_fn, batch)
    if not factors:
      loss_fn = lambda v, loss_fn=loss_fn: loss_fn(_without_factors(v))
    if not has_aux:
      loss, grads = state.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss
    with_aux = lambda v: (loss_fn(v), (loss_fn(v), state.apply_fn(v, batch[0])))
    (loss, (aux_loss, logits)), grads = state.value_and_grad(
      with_aux, has_aux=True
    )(state.params)
    expected_logits = state.apply_fn(state.params, batch[0])
    aux_ok = jnp.logical_and(
      aux_loss == loss, jnp.all(logits == expected_logits)
    )
    return state.apply_gradients(grads=grads), jnp.where(aux_ok, loss, jnp.nan)

  @jax.jit
  def ref_step(state, batch):
    loss, grads = jax.value_and_grad(_loss(state.apply_fn, batch))(state.params)
    return state.apply_gradients(grads=grads), loss, optax.tree.norm(grads)

  runs = []
  for batch in batches:
    forge, forge_loss = forge_step(forge, batch)
    ref, ref_loss, ref_norm = ref_step(ref, batch)
    runs.append(
      (
        jax.device_get(forge),
        jax.device_get(ref),
        float(forge_loss),
        float(ref_loss),
        float(ref_norm),
      )
    )
  return runs


def _initial_norm(name, kwargs, shape, features, seed):
  model = MLP(features)
  batch = make_batches(seed + 1, 1, shape, features[-1])[0]
  variables = model.init(jax.random.key(seed), batch[0])
  return float(_gradient_and_norm(model.apply, variables, batch)[1])


@pytest.mark.parametrize("case,active", _table_rows())
def test_exact_clipping_matches_optax_chain(case, active, seed):
  """Every step, kernels, biases and moments within 1e-6 of optax.chain(
  clip_by_global_norm(c), alias); the reported norm is optax's."""
  initial = _initial_norm(case.name, case.kwargs, case.shape, FEATURES, seed)
  max_norm = initial * (0.5 if active else 100.0)
  runs = _clipped_runs(
    case.name, case.kwargs, case.shape, FEATURES, max_norm, seed
  )
  bf16_state = jnp.bfloat16 in (
    case.kwargs.get("mu_dtype"),
    case.kwargs.get("accumulator_dtype"),
  )
  rtol = BF16_STATE_RTOL if bf16_state else RTOL
  assert _last_passes(MLP_LAYERS) == {layer_context.DEFERRED}
  for step, (forge, ref, forge_loss, ref_loss, ref_norm) in enumerate(runs):
    assert (ref_norm > max_norm) == active, (step, ref_norm, max_norm)
    compare_states(step, forge, ref, rtol)
    np.testing.assert_allclose(forge_loss, ref_loss, rtol=rtol)
    np.testing.assert_allclose(float(forge.grad_norm), ref_norm, rtol=rtol)


@pytest.mark.parametrize(
  "factors,implementation,expected_pass,rtol",
  [
    # Two passes against optax.chain by default: test_exact_clipping_under_
    # nn_scan_runs_two_passes (and under TP: test_clipping_under_tensor_
    # parallelism).
    pytest.param(
      False, "xla", layer_context.SCALED, RTOL, marks=pytest.mark.slow
    ),
    (True, "triton", layer_context.DEFERRED, 1e-5),
  ],
  ids=["two-passes-without-factor-sinks", "deferred-triton-interpret"],
)
def test_exact_clipping_by_each_path(
  factors, implementation, expected_pass, rtol, seed
):
  """A loss that hands the model only ``params`` and FORGE's collection:
  no layer finds its factor sink, and the step runs two backward passes.
  The Triton kernel (interpret mode) steps the deferred layers (its dW sums
  in another order: 1e-5, as the kernel tests). Both as optax.chain."""
  kwargs = dict(learning_rate=1e-2, weight_decay=0.1)
  shape, features = (16, 16), (32, 16)
  max_norm = 0.5 * _initial_norm("adamw", kwargs, shape, features, seed)
  runs = _clipped_runs(
    "adamw",
    kwargs,
    shape,
    features,
    max_norm,
    seed,
    implementation=implementation,
    factors=factors,
  )
  assert _last_passes(MLP_LAYERS) == {expected_pass}
  for step, (forge, ref, forge_loss, ref_loss, ref_norm) in enumerate(runs):
    assert ref_norm > max_norm
    compare_states(step, forge, ref, rtol)
    np.testing.assert_allclose(forge_loss, ref_loss, rtol=rtol)
    np.testing.assert_allclose(float(forge.grad_norm), ref_norm, rtol=rtol)


@pytest.mark.parametrize(
  "clip",
  # Delayed clipping's step: test_delayed_clipping_scales_by_the_previous_norm.
  ["exact", pytest.param("delayed", marks=pytest.mark.slow)],
)
def test_clipping_with_aux(clip, seed):
  """``state.value_and_grad(loss_fn, has_aux=True)``: the aux comes back as
  the loss function returned it (the loss and the logits of the step's
  variables), and the step is the one without aux (exact: optax's), to
  float32 rounding."""
  kwargs = dict(learning_rate=1e-2, weight_decay=0.1)
  shape = (10, 12)
  max_norm = 0.5 * _initial_norm("adamw", kwargs, shape, FEATURES, seed)
  plain = _clipped_runs("adamw", kwargs, shape, FEATURES, max_norm, seed, clip)
  runs = _clipped_runs(
    "adamw", kwargs, shape, FEATURES, max_norm, seed, clip, has_aux=True
  )
  for step, ((forge, ref, loss, _, _), (same, _, same_loss, _, _)) in enumerate(
    zip(runs, plain)
  ):
    assert np.isfinite(loss), f"step {step}: the aux differs"
    np.testing.assert_allclose(loss, same_loss, rtol=RTOL)
    # Not bit for bit: the aux's forward changes how XLA fuses the step.
    jax.tree.map(
      lambda a, b: assert_rel_close(a, b, RTOL, f"step {step}"),
      forge.params,
      same.params,
    )
    if clip == "exact":
      compare_states(step, forge, ref)


@pytest.mark.parametrize(
  "tokens",
  # The table's layers (10 tokens) sum dW's squares by default.
  [4, pytest.param(64, marks=pytest.mark.slow)],
  ids=["gram", "weight-gradient"],
)
def test_exact_clipping_of_a_wide_layer(tokens, seed):
  """A 12 -> 128 layer: with few tokens the norm-only pass sums
  ``(x x^T) * (dy dy^T)`` (no dW), with many it sums dW's squares."""
  kwargs = dict(learning_rate=1e-2, weight_decay=0.1)
  features = (128, 10)
  shape = (tokens, 12)
  max_norm = 0.5 * _initial_norm("adamw", kwargs, shape, features, seed)
  runs = _clipped_runs("adamw", kwargs, shape, features, max_norm, seed)
  assert _last_passes(MLP_LAYERS) == {layer_context.DEFERRED}
  for step, (forge, ref, _, _, ref_norm) in enumerate(runs):
    assert ref_norm > max_norm
    compare_states(step, forge, ref)
    np.testing.assert_allclose(float(forge.grad_norm), ref_norm, rtol=1e-6)


@pytest.mark.parametrize(
  "general,clip",
  [
    # Each layer and each kind of clipping once by default.
    pytest.param(False, "exact", marks=pytest.mark.slow),
    (False, "delayed"),
    (True, "exact"),
    pytest.param(True, "delayed", marks=pytest.mark.slow),
  ],
  ids=["dense-exact", "dense-delayed", "general-exact", "general-delayed"],
)
def test_clipping_a_model_that_is_one_layer(general, clip, seed):
  """A ForgeDense (or ForgeDenseGeneral) that is the whole model (module
  path ``()``): clipped like nn.Dense under optax.clip_by_global_norm, by
  this step's norm or by the previous one's."""
  opt = fj.adamw(1e-2, weight_decay=0.1)
  if general:
    model = fj.ForgeDenseGeneral(features=(2, 5), optimizer=opt)
    ref = nn.DenseGeneral(features=(2, 5))
  else:
    model, ref = fj.ForgeDense(10, optimizer=opt), nn.Dense(10)
  batches = make_batches(seed + 1, STEPS, (3, 4, 12), CLASSES)
  flat = lambda y: y.reshape(y.shape[:-2] + (-1,)) if general else y
  variables = model.init(jax.random.key(seed), batches[0][0])
  ref_params = fj.to_dense(variables)
  max_norm = 0.05
  forge = fj.TrainState.create(
    apply_fn=lambda v, x: flat(model.apply(v, x)),
    params=variables,
    tx=opt.to_optax(),
    max_grad_norm=max_norm,
    clip=clip,
  )

  @jax.jit
  def step(state, batch):
    _, grads = state.value_and_grad(_loss(state.apply_fn, batch))(state.params)
    return state.apply_gradients(grads=grads)

  tx = opt.to_optax()
  opt_state = tx.init(ref_params)
  previous = None
  ref_apply = lambda v, x: flat(ref.apply(v, x))
  for batch in batches:
    forge = step(forge, batch)
    grads, norm = _gradient_and_norm(ref_apply, ref_params, batch)
    by = norm if clip == "exact" else previous
    if by is not None:
      grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, max_norm / by), grads)
    updates, opt_state = tx.update(grads, opt_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    previous = norm
    assert norm > max_norm
    np.testing.assert_allclose(float(forge.grad_norm), norm, rtol=1e-5)
    actual = fj.to_dense(forge.params)["params"]
    for name in ("kernel", "bias"):
      assert_rel_close(actual[name], ref_params["params"][name], RTOL, name)
  assert forge.unreached_layers() == []


@pytest.mark.parametrize("tokens,k,n", [(5, 64, 48), (300, 16, 8)])
def test_norm_only_pass_sums_the_weight_gradient_squares(tokens, k, n, seed):
  keys = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(keys[0], (tokens, k))
  dy = jax.random.normal(keys[1], (tokens, n))
  expected = np.sum(np.square(np.asarray(x, np.float64).T @ np.asarray(dy)))
  actual = backends.weight_gradient_sq_norm(x, dy)
  np.testing.assert_allclose(float(actual), expected, rtol=1e-6)


def test_reported_norm_without_clipping(seed):
  """jax.value_and_grad + fj.TrainState: state.grad_norm and
  fj.global_norm(grads) are optax.global_norm of the reference gradient."""
  opt = fj.adam(1e-2)
  forge_model, ref_model = MLP(FEATURES, optimizer=opt), MLP(FEATURES)
  batches = make_batches(seed + 1, STEPS, (10, 12), CLASSES)
  key = jax.random.key(seed)
  forge = fj.TrainState.create(
    apply_fn=forge_model.apply,
    params=forge_model.init(key, batches[0][0]),
    tx=opt.to_optax(),
  )
  ref_norms = _reference_norms(
    ref_model, ref_model.init(key, batches[0][0]), optax.adam(1e-2), batches
  )
  assert float(forge.grad_norm) == 0.0

  @jax.jit
  def step(state, batch):
    grads = jax.grad(_loss(state.apply_fn, batch))(state.params)
    return state.apply_gradients(grads=grads), fj.global_norm(grads)

  for batch, ref_norm in zip(batches, ref_norms):
    forge, norm = step(forge, batch)
    np.testing.assert_allclose(float(norm), ref_norm, rtol=1e-6)
    assert float(forge.grad_norm) == float(norm)


class ScaledInput(nn.Module):
  """An MLP whose input is scaled by a table in a collection of its own,
  which nothing trains (a constant the forward reads differentiably)."""

  features: Any
  optimizer: Any = None

  @nn.compact
  def __call__(self, x):
    table = self.variable("consts", "table", lambda: jnp.full(x.shape[-1], 3.0))
    return MLP(self.features, self.optimizer, name="mlp")(x * table.value)


@pytest.mark.parametrize(
  "clip",
  # 'exact' reads the same norm in test_norm_counts_the_trained_parameters_alone.
  [pytest.param("exact", marks=pytest.mark.slow), "delayed"],
)
def test_the_norm_leaves_out_collections_nothing_trains(clip, seed):
  """A collection beside ``params`` gets a gradient that tx never steps
  (flax's TrainState steps ``params`` alone): the norm, and the clipping,
  are optax's over ``params`` and the kernels, as nn.Dense + optax.chain(
  clip_by_global_norm(c), alias) with the constants outside the state."""
  opt, max_norm = fj.sgd(0.1), 0.2
  forge_model, ref_model = ScaledInput(FEATURES, opt), ScaledInput(FEATURES)
  batches = make_batches(seed + 1, STEPS, (10, 12), CLASSES)
  key = jax.random.key(seed)
  ref_vars = ref_model.init(key, batches[0][0])
  forge = fj.TrainState.create(
    apply_fn=forge_model.apply,
    params=forge_model.init(key, batches[0][0]),
    tx=opt.to_optax(),
    max_grad_norm=max_norm,
    clip=clip,
  )
  ref = FlaxTrainState.create(
    apply_fn=ref_model.apply,
    params=ref_vars["params"],
    tx=optax.sgd(0.1),
  )

  @jax.jit
  def step(state, batch):
    loss_fn = _loss(state.apply_fn, batch)
    grads = state.value_and_grad(loss_fn)(state.params)[1]
    return state.apply_gradients(grads=grads)

  @jax.jit
  def ref_step(state, batch, previous):
    apply = lambda p, x: state.apply_fn({**ref_vars, "params": p}, x)
    grads = jax.grad(_loss(apply, batch))(state.params)
    norm = optax.tree.norm(grads)
    # 'delayed': the previous step's norm (none before the first step).
    scale = jnp.minimum(1.0, max_norm / (norm if clip == "exact" else previous))
    grads = jax.tree.map(lambda g: g * scale, grads)
    return state.apply_gradients(grads=grads), norm

  previous = 0.0
  for batch in batches:
    forge = step(forge, batch)
    ref, ref_norm = ref_step(ref, batch, previous)
    np.testing.assert_allclose(forge.grad_norm, ref_norm, rtol=1e-6)
    assert ref_norm > max_norm
    previous = ref_norm
  forge_params = fj.to_dense(forge.params)["params"]["mlp"]
  for name, ref_layer in ref.params["mlp"].items():
    for leaf, value in ref_layer.items():
      assert_rel_close(forge_params[name][leaf], value, RTOL, name + leaf)


def _sqrt_count(fun, *args) -> int:
  return str(jax.make_jaxpr(fun)(*args)).count("sqrt")


def test_untracked_norm_trains_alike_without_the_norm(seed):
  """``track_grad_norm=False``: the same parameters bit for bit, no
  ``grad_norm``, and a step with no root in it (plain SGD has none of
  its own)."""
  opt = fj.sgd(0.1)
  model = MLP(FEATURES, optimizer=opt)
  batches = make_batches(seed + 1, 3, (10, 12), CLASSES)
  variables = model.init(jax.random.key(seed), batches[0][0])
  states = [
    fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=opt.to_optax(),
      track_grad_norm=track,
    )
    for track in (True, False)
  ]
  assert states[1].grad_norm is None

  def step(state, batch):
    grads = jax.grad(_loss(state.apply_fn, batch))(state.params)
    return state.apply_gradients(grads=grads)

  assert _sqrt_count(step, states[0], batches[0]) == 1
  assert _sqrt_count(step, states[1], batches[0]) == 0
  for batch in batches:
    states = [jax.jit(step)(state, batch) for state in states]
  assert states[1].grad_norm is None
  assert_same_bits(states[1].params, states[0].params, "params")


def test_clipping_needs_the_norm_tracked():
  model = MLP(FEATURES)
  variables = model.init(jax.random.key(0), jnp.ones((2, 12)))
  with pytest.raises(ValueError, match="clipping needs the global"):
    fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=optax.sgd(0.1),
      max_grad_norm=1.0,
      track_grad_norm=False,
    )
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=variables,
    tx=optax.sgd(0.1),
    track_grad_norm=False,
  ).replace(max_grad_norm=1.0)
  grads = jax.grad(lambda p: jnp.sum(model.apply(p, jnp.ones((2, 12)))))
  with pytest.raises(ValueError, match="clipping needs the global"):
    state.apply_gradients(grads=grads(state.params))


def test_delayed_clipping_scales_by_the_previous_norm(seed):
  """Step t's gradient is scaled by min(1, c / ||g_{t-1}||) (step 1: 1),
  checked against the reference gradient scaled so, then the optimizer."""
  name, kwargs = "sgd", dict(learning_rate=0.5, momentum=0.9)
  shape = (10, 12)
  max_norm = 0.5 * _initial_norm(name, kwargs, shape, FEATURES, seed)
  runs = _clipped_runs(
    name, kwargs, shape, FEATURES, max_norm, seed, clip="delayed"
  )
  assert _last_passes(MLP_LAYERS) == {layer_context.SCALED}
  # The reference: nn.Dense + sgd, each gradient scaled by the delayed factor.
  opt = getattr(fj, name)(**kwargs)
  model = MLP(FEATURES)
  batches = make_batches(seed + 1, STEPS, shape, FEATURES[-1])
  ref = FlaxTrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(seed), batches[0][0]),
    tx=opt.to_optax(),
  )
  previous = 0.0
  for step, batch in enumerate(batches):
    grads = jax.grad(_loss(model.apply, batch))(ref.params)
    norm = float(optax.tree.norm(grads))
    scale = 1.0 if previous < max_norm else max_norm / previous
    if step > 0:
      assert scale < 1.0, "the test must clip by the previous norm"
    ref = ref.apply_gradients(grads=jax.tree.map(lambda g: g * scale, grads))
    forge = runs[step][0]
    np.testing.assert_allclose(float(forge.grad_norm), norm, rtol=1e-5)
    for layer in ref.params["params"]:
      assert_rel_close(
        forge.params[COLL][layer]["kernel"],
        ref.params["params"][layer]["kernel"],
        1e-5,
        f"step {step + 1} {layer} kernel",
      )
      assert_rel_close(
        forge.params["params"][layer]["bias"],
        ref.params["params"][layer]["bias"],
        1e-5,
        f"step {step + 1} {layer} bias",
      )
    previous = norm


def test_delayed_clipping_refuses_a_gradient_function_made_outside(seed):
  """``state.value_and_grad(loss_fn)`` taken before ``jax.jit`` from the
  state outside the step carries that state's norm into every compiled
  step: 'delayed' refuses it; taken inside it reads each step's norm."""
  opt = fj.sgd(0.5)
  model = MLP(FEATURES, optimizer=opt)
  batch = make_batches(seed + 1, 1, (10, 12), FEATURES[-1])[0]
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(seed), batch[0]),
    tx=opt.to_optax(),
    max_grad_norm=1e-3,
    clip="delayed",
  )
  outside = state.value_and_grad(_loss(model.apply, batch))

  @jax.jit
  def stale_step(state):
    return state.apply_gradients(grads=outside(state.params)[1])

  @jax.jit
  def step(state):
    loss_fn = _loss(state.apply_fn, batch)
    return state.apply_gradients(
      grads=state.value_and_grad(loss_fn)(state.params)[1]
    )

  with pytest.raises(ValueError, match="inside the step"):
    stale_step(state)
  state = step(step(state))
  assert float(state.grad_norm) > 1e-3


WIDTH, LAYERS, TOKENS = 16, 3, 8


def _dense(forge: bool, optimizer, param_dtype, name: str):
  if forge:
    return fj.ForgeDense(
      WIDTH, optimizer=optimizer, param_dtype=param_dtype, name=name
    )
  return nn.Dense(WIDTH, name=name)


class Block(nn.Module):
  forge: bool = True
  optimizer: Any = fj.adamw(1e-2)
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, _):
    dense = lambda name: _dense(
      self.forge, self.optimizer, self.param_dtype, name
    )
    norm = self.param("norm", nn.initializers.ones_init(), (WIDTH,))
    return x + dense("fc2")(jnp.tanh(dense("fc1")(x * norm))), None


class Stack(nn.Module):
  """Scanned remat blocks, then a head: ForgeDense layers stepped in place
  in fj.scan's stacks (``scan='fj.scan'``) or under nn.scan, and one of
  their own."""

  forge: bool = True
  scan: str = "fj.scan"
  optimizer: Any = fj.adamw(1e-2)
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scan = fj.scan if self.forge and self.scan == "fj.scan" else nn.scan
    layers = scan(
      nn.remat(Block, prevent_cse=False),
      variable_axes={True: 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,),
      length=LAYERS,
    )
    x, _ = layers(self.forge, self.optimizer, self.param_dtype, name="layers")(
      x, None
    )
    return _dense(self.forge, self.optimizer, self.param_dtype, "head")(x)


STACK_LAYERS = [("layers", "fc1"), ("layers", "fc2"), ("head",)]


def test_exact_clipping_through_fj_scan(seed):
  """fj.scan of remat blocks (kernels, biases and norm scales) and a head:
  the stacks and the head step as nn.scan + optax.chain(
  clip_by_global_norm, adamw), every layer deferring its update."""
  _check_stack_clipping("fj.scan", layer_context.DEFERRED, seed)


def test_exact_clipping_under_nn_scan_runs_two_passes(seed):
  """ForgeDense layers under nn.scan cannot defer (nn.scan slices their
  variables): the step runs two backward passes, and is as exact."""
  _check_stack_clipping("nn.scan", layer_context.SCALED, seed)


def _check_stack_clipping(scan, expected_pass, seed):
  """Three clipped steps of ``Stack(scan=scan)`` against nn.scan + optax;
  every ForgeDense's backward ran as ``expected_pass``."""
  key = jax.random.key(seed)
  x = jax.random.normal(key, (TOKENS, WIDTH))
  target = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, WIDTH))
  loss_fn = lambda model: (
    lambda v: jnp.mean(jnp.square(model.apply(v, x) - target))
  )
  forge_model, ref_model = Stack(True, scan), Stack(False)
  forge_vars, ref_vars = forge_model.init(key, x), ref_model.init(key, x)
  norm0 = float(optax.tree.norm(jax.grad(loss_fn(ref_model))(ref_vars)))
  max_norm = 0.1 * norm0
  forge = fj.TrainState.create(
    apply_fn=forge_model.apply,
    params=forge_vars,
    tx=fj.adamw(1e-2).to_optax(),
    max_grad_norm=max_norm,
  )
  ref = FlaxTrainState.create(
    apply_fn=ref_model.apply,
    params=ref_vars,
    tx=optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(1e-2)),
  )

  @jax.jit
  def forge_step(state):
    _, grads = state.value_and_grad(loss_fn(forge_model))(state.params)
    return state.apply_gradients(grads=grads)

  @jax.jit
  def ref_step(state):
    grads = jax.grad(loss_fn(ref_model))(state.params)
    return state.apply_gradients(grads=grads), optax.tree.norm(grads)

  for step in range(STEPS):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", fj.ForgeMemoryWarning)  # nn.scan's
      forge = forge_step(forge)
    ref, ref_norm = ref_step(ref)
    assert _last_passes(STACK_LAYERS) == {expected_pass}
    assert float(ref_norm) > max_norm
    np.testing.assert_allclose(float(forge.grad_norm), ref_norm, rtol=1e-6)
    assert_rel_close(
      forge.params[COLL]["head"]["kernel"],
      ref.params["params"]["head"]["kernel"],
      RTOL,
      f"step {step + 1} head kernel",
    )
    forge_layers = forge.params[COLL]["layers"]
    ref_layers = ref.params["params"]["layers"]
    for name in ("fc1", "fc2"):
      assert_rel_close(
        forge_layers[name]["kernel"],
        ref_layers[name]["kernel"],
        RTOL,
        f"step {step + 1} {name} kernel",
      )
      assert_rel_close(
        forge.params["params"]["layers"][name]["bias"],
        ref_layers[name]["bias"],
        RTOL,
        f"step {step + 1} {name} bias",
      )
      np.testing.assert_array_equal(forge_layers[name]["count"], step + 1)
    assert_rel_close(
      forge.params["params"]["layers"]["norm"],
      ref_layers["norm"],
      RTOL,
      f"step {step + 1} norm",
    )


@pytest.mark.parametrize(
  "active",
  [pytest.param(True, marks=pytest.mark.slow), False],
  ids=["active", "inactive"],
)
def test_deferred_int8_stochastic_rounding_equals_two_passes(active, seed):
  """bf16 weights with stochastic rounding and int8 states, in fj.scan's
  stacks and a head: the deferred step is the two-pass step bit for bit
  while the clipping is inactive (``dy`` scaled by exactly 1). Clipped, the
  two round ``s * dy`` differently (the two-pass step carries the seed
  ``s`` through the backward pass, the deferred one scales each layer's
  ``dy``: float32 roundings of the same product), so one step agrees up to
  the stochastic-rounding and code boundaries such a rounding crosses (one
  bf16 ulp, one int8 code, on under 1% of the elements), the int8 scales
  and other float32 leaves within 1e-5."""
  _, opt = LOWP_OPTIMIZERS[0]
  model = Stack(True, optimizer=opt, param_dtype=jnp.bfloat16)
  key = jax.random.key(seed)
  x = jax.random.normal(key, (TOKENS, WIDTH))
  target = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, WIDTH))
  loss = lambda v: jnp.mean(jnp.square(model.apply(v, x) - target))
  variables = model.init(key, x)
  max_norm = 1e-3 if active else 1e3  # the gradient's norm is about 1

  def run(factors):
    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=opt.to_optax(),
      max_grad_norm=max_norm,
    )

    @jax.jit
    def step(state):
      loss_fn = loss if factors else lambda v: loss(_without_factors(v))
      _, grads = state.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads)

    states = []
    for _ in range(1 if active else STEPS):
      state = step(state)
      states.append(jax.device_get((state.params, state.grad_norm)))
    return states

  deferred = run(True)
  assert _last_passes(STACK_LAYERS) == {layer_context.DEFERRED}
  two_passes = run(False)
  assert _last_passes(STACK_LAYERS) == {layer_context.SCALED}
  assert (deferred[0][1] > max_norm) == active
  for step, (actual, expected) in enumerate(zip(deferred, two_passes)):
    if not active:
      assert_same_bits(actual, expected, f"step {step + 1}")
      continue
    for (path, a), e in zip(
      jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)
    ):
      a, e, what = np.asarray(a), np.asarray(e), jax.tree_util.keystr(path)
      if a.dtype == jnp.float32:
        assert_rel_close(a, e, 1e-5, what)
        continue
      apart = (
        ulp_distance(a, e)
        if a.dtype == jnp.bfloat16
        else np.abs(a.astype(np.int32) - e.astype(np.int32))
      )
      assert apart.max() <= 1 and np.mean(apart > 0) < 0.01, what


class TensorParallel(nn.Module):
  """A column-parallel then a row-parallel layer over the 'model' axis."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    opt = fj.adamw(1e-2)
    h = fj.ForgeDense(
      32, optimizer=opt, kernel_init=nn.with_partitioning(init, (None, "model"))
    )(x)
    return fj.ForgeDense(
      8, optimizer=opt, kernel_init=nn.with_partitioning(init, ("model", None))
    )(jnp.tanh(h))


@pytest.mark.parametrize(
  "clip",
  # Both all-reduce the shards' sums of squares (the same psum).
  ["exact", pytest.param("delayed", marks=pytest.mark.slow)],
)
def test_clipping_under_tensor_parallelism(clip, seed):
  """The shards' sums of squares are all-reduced: two shards step and
  report the norm as one device does."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  model = TensorParallel()
  key = jax.random.key(seed)
  x = jax.random.normal(key, (TOKENS, WIDTH))
  target = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, 8))
  mesh = parallel.make_mesh(model=2)
  variables = parallel.strip_boxes(model.init(key, x))
  sharded = parallel.init_sharded(model.init, mesh, key, x)

  def run(variables):
    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=fj.adamw(1e-2).to_optax(),
      max_grad_norm=0.1,
      clip=clip,
    )

    @jax.jit
    def step(state):
      loss = lambda v: jnp.mean(jnp.square(state.apply_fn(v, x) - target))
      _, grads = state.value_and_grad(loss)(state.params)
      return state.apply_gradients(grads=grads)

    norms = []
    for _ in range(STEPS):
      state = step(state)
      norms.append(float(state.grad_norm))
    return jax.device_get(state.params), norms

  layers = [("ForgeDense_0",), ("ForgeDense_1",)]
  one, one_norms = run(variables)
  # Exact: one device defers the updates; sharded layers cannot.
  deferred = layer_context.DEFERRED if clip == "exact" else None
  assert _last_passes(layers) == {deferred or layer_context.SCALED}
  with jax.set_mesh(mesh):
    two, two_norms = run(sharded)
  assert _last_passes(layers) == {layer_context.SCALED}
  assert min(one_norms) > 0.1
  np.testing.assert_allclose(two_norms, one_norms, rtol=1e-5)
  for (path, a), b in zip(
    jax.tree_util.tree_flatten_with_path(two)[0], jax.tree.leaves(one)
  ):
    assert_rel_close(a, b, 1e-5, jax.tree_util.keystr(path))


UNUSED_OPT = fj.adamw(1e-2, weight_decay=0.1)


class WithUnusedLayer(nn.Module):
  @nn.compact
  def __call__(self, x):
    fj.ForgeDense(16, optimizer=UNUSED_OPT, name="unused")(x)
    return fj.ForgeDense(16, optimizer=UNUSED_OPT, name="used")(x)


def test_exact_clipping_keeps_a_layer_the_loss_does_not_reach(seed):
  """The deferred pass steps every layer it found from its factors; one the
  loss did not reach (zero cotangents) keeps its variables bit for bit."""
  model = WithUnusedLayer()
  x = jax.random.normal(jax.random.key(seed), (8, 32))
  variables = model.init(jax.random.key(seed + 1), x)
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=variables,
    tx=UNUSED_OPT.to_optax(),
    max_grad_norm=1e-3,
  )

  @jax.jit
  def step(state):
    loss_fn = lambda p: jnp.sum(state.apply_fn(p, x) ** 2)
    _, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)

  new = step(state)
  assert layer_context.last_pass(("used",)) == layer_context.DEFERRED
  assert_same_bits(
    new.params[COLL]["unused"], state.params[COLL]["unused"], "unused"
  )
  assert float(new.params[COLL]["used"]["count"]) == 1.0
  assert not np.array_equal(
    new.params[COLL]["used"]["kernel"], state.params[COLL]["used"]["kernel"]
  )
  assert {k: float(v) for k, v in new.reached.items()} == {
    "unused": 0.0,
    "used": 1.0,
  }


MOMENTUM_OPT = fj.sgd(0.05, momentum=0.9)


class TwoLayers(nn.Module):
  forge: bool = True

  @nn.compact
  def __call__(self, x):
    def dense(features, name):
      if self.forge:
        return fj.ForgeDense(features, optimizer=MOMENTUM_OPT, name=name)
      return nn.Dense(features, name=name)

    return dense(3, "b")(jnp.tanh(dense(6, "a")(x)))


@pytest.mark.parametrize(
  "wrap",
  [jax.jit, pytest.param(jax.checkpoint, marks=pytest.mark.slow)],
  ids=["jit", "remat"],
)
def test_exact_clipping_through_a_wrapped_apply_traced_again(wrap, seed):
  """The loss calls ``wrap(model.apply)``, made once: JAX serves its later
  traces from a cache. Three trainings, each with a newly jitted step (a
  sweep, a notebook cell run again), each follow optax's
  ``chain(clip_by_global_norm, sgd)``."""
  keys = jax.random.split(jax.random.key(seed), 3)
  x = 2 * jax.random.normal(keys[0], (8, 5))
  y = 3 * jax.random.normal(keys[1], (8, 3))
  reference = TwoLayers(forge=False)
  dense_variables = reference.init(keys[2], x)
  model = TwoLayers()
  variables = fj.from_dense(dense_variables, model, x)
  apply_fn = wrap(model.apply)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, 0.9))

  for _ in range(3):
    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=MOMENTUM_OPT.to_optax(),
      max_grad_norm=1.0,
    )
    expected = FlaxTrainState.create(
      apply_fn=reference.apply, params=dense_variables, tx=tx
    )

    @jax.jit
    def step(state, expected):
      loss = lambda apply: lambda p: jnp.mean((apply(p, x) - y) ** 2)
      _, grads = state.value_and_grad(loss(apply_fn))(state.params)
      grads_expected = jax.grad(loss(reference.apply))(expected.params)
      return (
        state.apply_gradients(grads=grads),
        expected.apply_gradients(grads=grads_expected),
      )

    for _ in range(3):
      state, expected = step(state, expected)
    assert fj.wiped_layers(state.params) == []
    for name in ("a", "b"):
      np.testing.assert_allclose(
        state.params[COLL][name]["kernel"],
        expected.params["params"][name]["kernel"],
        rtol=1e-5,
        atol=1e-6,
      )


@pytest.mark.parametrize(
  "factors", [True, False], ids=["deferred", "two-passes"]
)
def test_exact_step_runs_the_forward_once(factors, seed):
  """The compiled exact step has one forward pass (its sine), and one
  backward pass (its cosine) whose dX GEMM is the unclipped step's (the
  second layer's: the first layer's input is not differentiated); two of
  each when the loss does not hand the factor sinks on."""

  class Sine(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jnp.sin(fj.ForgeDense(8, optimizer=fj.sgd(0.1))(x))
      return fj.ForgeDense(4, optimizer=fj.sgd(0.1))(x)

  x = jax.random.normal(jax.random.key(seed), (6, 5))
  model = Sine()
  variables = model.init(jax.random.key(seed), x)
  kernels = [
    layer["kernel"].shape for _, layer in forge_layers(variables[COLL])
  ]

  def step_fn(max_grad_norm):
    def step(state):
      def loss(v):
        v = v if factors else _without_factors(v)
        return jnp.sum(jnp.square(state.apply_fn(v, x)))

      _, grads = state.value_and_grad(loss)(state.params)
      return state.apply_gradients(grads=grads)

    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=fj.sgd(0.1).to_optax(),
      max_grad_norm=max_grad_norm,
    )
    return step, state

  unclipped = _dx_gemms(*step_fn(None), kernels)
  step, state = step_fn(0.01)
  passes = 1 if factors else 2
  assert _dx_gemms(step, state, kernels) == passes * unclipped == passes
  hlo = jax.jit(step).lower(state).compile().as_text()
  assert len(re.findall(r"= f32\[[\d,]*\]\{?[\d,]*\}? sine\(", hlo)) == 1
  assert len(re.findall(r" cosine\(", hlo)) == passes


def _dx_gemms(step, state, kernels) -> int:
  """The dot_generals in ``step``'s jaxpr that form a ``dx = dy @ W.T``:
  the right operand a kernel of ``kernels`` (shapes), contracted on N."""

  def count(jaxpr):
    total = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        (_, rhs_contracting), _ = eqn.params["dimension_numbers"]
        rhs = eqn.invars[1].aval.shape
        total += rhs in kernels and tuple(rhs_contracting) == (1,)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
          if hasattr(sub, "eqns"):
            total += count(sub)
    return total

  return count(jax.make_jaxpr(step)(state).jaxpr)


def _backend_inputs(seed, tokens, k, n, dtype):
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (tokens, k)).astype(dtype)
  dy = jax.random.normal(keys[1], (tokens, n)).astype(dtype)
  kernel = jax.random.normal(keys[2], (k, n)) * 0.1
  return x, dy, kernel


def _grad_sq_norm(update, opt, x, dy, kernel, **kwargs):
  spec = FusedDenseSpec(optimizer=opt)
  out = jax.jit(functools.partial(update, spec, **kwargs))(
    x, dy, kernel, opt.init(kernel), opt.scalars(jnp.int32(0)), jnp.bool_(True)
  )
  return float(out[3])


@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "stacked"])
def test_triton_kernel_sums_the_squares_of_the_reference(stacked, seed):
  """Per-tile partial sums over masked edges (K = 40, N = 24 in 16 x 16
  tiles): the XLA reference's sum."""
  opt = fj.adamw(1e-2)
  x, dy, kernel = _backend_inputs(seed, 37, 40, 24, jnp.float32)
  expected = _grad_sq_norm(backends.xla_update, opt, x, dy, kernel)
  config = triton_kernel.TritonConfig(
    block_k=16, block_n=16, block_t=16, group_k=2, epilogue_split=1
  )
  kwargs = dict(config=config, interpret=True)
  if stacked:
    kernel = jnp.stack([kernel, kernel + 1.0])
    kwargs["layer_index"] = jnp.int32(1)
  actual = _grad_sq_norm(
    triton_kernel.triton_update, opt, x, dy, kernel, **kwargs
  )
  np.testing.assert_allclose(actual, expected, rtol=1e-6)


MOSAIC_SMALL = dict(
  tile_k=64, tile_n=64, tile_t=64, max_concurrent_steps=2, epilogue_k=64
)


@pytest.mark.parametrize(
  "schedule",
  ["inline", pytest.param("pingpong", marks=pytest.mark.slow)],
)
def test_mosaic_kernel_sums_the_squares_of_the_reference(schedule, seed):
  """Per-row sums of each warpgroup's parts (K = 128, N = 256, 128 tokens
  of bfloat16): the XLA reference's sum."""
  opt = fj.adamw(1e-2)
  x, dy, kernel = _backend_inputs(seed, 128, 128, 256, jnp.bfloat16)
  expected = _grad_sq_norm(backends.xla_update, opt, x, dy, kernel)
  config = mosaic.MosaicConfig(
    **MOSAIC_SMALL, epilogue_n=32, epilogue_slots=2, schedule=schedule
  )
  actual = _grad_sq_norm(
    mosaic.mosaic_update, opt, x, dy, kernel, config=config, interpret=True
  )
  np.testing.assert_allclose(actual, expected, rtol=1e-5)


def test_clipping_errors_say_what_to_do(seed):
  opt = fj.adamw(1e-2)
  model = MLP(FEATURES, optimizer=opt)
  x, y = make_batches(seed, 1, (4, 12), CLASSES)[0]
  variables = model.init(jax.random.key(seed), x)
  with pytest.raises(ValueError, match="max_grad_norm=max_norm"):
    fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=optax.chain(optax.clip_by_global_norm(1.0), opt.to_optax()),
    )
  with pytest.raises(TypeError, match="max_grad_norm=max_norm"):
    fj.ForgeDense(
      4, optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    ).init(jax.random.key(0), x)
  for bad in (dict(max_grad_norm=0.0), dict(max_grad_norm=1.0, clip="late")):
    with pytest.raises(ValueError, match="must be"):
      fj.TrainState.create(
        apply_fn=model.apply, params=variables, tx=opt.to_optax(), **bad
      )
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=opt.to_optax(), max_grad_norm=1
  )
  # Gradients from jax.value_and_grad stepped the layers unclipped.
  grads = jax.grad(_loss(model.apply, (x, y)))(state.params)
  with pytest.raises(ValueError, match=r"state\.value_and_grad"):
    state.apply_gradients(grads=grads)


def _accumulated(state, loss_fn):
  """Grads averaged over two halves of the batch (accumulation)."""
  halves = [
    state.value_and_grad(loss_fn)(state.params, half)[1]
    for half in (slice(None, 2), slice(2, None))
  ]
  return jax.tree.map(lambda a, b: (a + b) / 2, *halves)


def _penalized(state, loss_fn):
  """Grads of a loss that also reads the last kernel (an L2 penalty)."""
  kernel = lambda p: p[COLL][f"fc{len(FEATURES)}"]["kernel"]
  penalized = lambda p, batch: loss_fn(p, batch) + jnp.sum(kernel(p) ** 2)
  return state.value_and_grad(penalized)(state.params, slice(None))[1]


@pytest.mark.parametrize(
  "grads,match",
  [(_accumulated, "combines the gradients"), (_penalized, "weight penalty")],
  ids=["accumulated", "penalized"],
)
def test_deferred_step_refuses_what_a_backward_step_refuses(grads, match, seed):
  """Gradient accumulation and a loss that reads a kernel outside its
  layer raise under 'exact' clipping (updates deferred out of the
  backward) as without it, before anything is written."""
  opt = fj.adamw(1e-2)
  model = MLP(FEATURES, optimizer=opt)
  x, y = make_batches(seed, 1, (4, 12), CLASSES)[0]
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(seed), x),
    tx=opt.to_optax(),
    max_grad_norm=0.1,
  )
  loss_fn = lambda p, rows: _loss(model.apply, (x[rows], y[rows]))(p)

  @jax.jit
  def step(state):
    return state.apply_gradients(grads=grads(state, loss_fn))

  with pytest.raises(ValueError, match=match):
    step(state)
  assert _last_passes(MLP_LAYERS) == {layer_context.DEFERRED}


def test_exact_clipping_of_partitioned_kernels(seed):
  """Kernels boxed by nn.with_partitioning, on one device: the deferred
  updates keep the boxes and step as optax.chain(clip_by_global_norm(c),
  alias) with nn.Dense boxed alike."""
  init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
  opt, max_norm = fj.adamw(1e-2, weight_decay=0.1), 0.1
  forge_model = fj.ForgeDense(CLASSES, optimizer=opt, kernel_init=init)
  ref_model = nn.Dense(CLASSES, kernel_init=init)
  batches = make_batches(seed + 1, 2, (10, 12), CLASSES)
  key = jax.random.key(seed)
  forge = fj.TrainState.create(
    apply_fn=forge_model.apply,
    params=forge_model.init(key, batches[0][0]),
    tx=opt.to_optax(),
    max_grad_norm=max_norm,
  )
  ref = FlaxTrainState.create(
    apply_fn=ref_model.apply,
    params=ref_model.init(key, batches[0][0]),
    tx=optax.chain(
      optax.clip_by_global_norm(max_norm),
      optax.adamw(1e-2, weight_decay=0.1),
    ),
  )

  @jax.jit
  def step(state, batch):
    grads = state.value_and_grad(_loss(state.apply_fn, batch))(state.params)
    return state.apply_gradients(grads=grads[1])

  @jax.jit
  def ref_step(state, batch):
    grads = jax.grad(_loss(state.apply_fn, batch))(state.params)
    return state.apply_gradients(grads=grads), optax.tree.norm(grads)

  for batch in batches:
    forge = step(forge, batch)
    ref, ref_norm = ref_step(ref, batch)
    assert ref_norm > max_norm
  assert _last_passes([()]) == {layer_context.DEFERRED}
  assert isinstance(forge.params[COLL]["kernel"], nn.Partitioned)
  ours, theirs = fj.to_dense(nn.unbox(forge.params)), nn.unbox(ref.params)
  for name in ("kernel", "bias"):
    assert_rel_close(ours["params"][name], theirs["params"][name], RTOL, name)


def test_readme_clipping_variant_trains():
  """The README Quickstart's clipping variant runs as written and clips."""
  readme = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md"
  )
  with open(readme) as f:
    text = f.read()
  quickstart = text[text.index("## Quickstart") :]
  blocks = re.findall(r"```python\n(.*?)```", quickstart, re.S)[:2]
  assert "max_grad_norm" in blocks[1]
  scope = {}
  for i, code in enumerate(blocks):
    exec(compile(code, f"README quickstart {i}", "exec"), scope)  # pylint: disable=exec-used
  state, batch = scope["state"], scope["batch"]
  losses = []
  for _ in range(3):
    state, loss = scope["train_step"](state, batch)
    losses.append(float(loss))
    assert float(state.grad_norm) > 0
  assert losses[-1] < losses[0]
  layer = state.params[COLL]["ForgeDense_0"]
  assert float(layer["count"]) == 3.0


class FrozenNormMLP(nn.Module):
  """A layer, a BatchNorm reading its running statistics (a pretrained
  model's norm, frozen while finetuning), a layer."""

  forge: bool
  optimizer: Any = None

  @nn.compact
  def __call__(self, x):
    dense = (
      functools.partial(fj.ForgeDense, optimizer=self.optimizer)
      if self.forge
      else nn.Dense
    )
    x = nn.BatchNorm(use_running_average=True)(dense(16, name="fc1")(x))
    return dense(CLASSES, name="fc2")(nn.relu(x))


@pytest.mark.parametrize(
  "clip",
  # 'delayed' reads the same norm in
  # test_the_norm_leaves_out_collections_nothing_trains.
  ["exact", pytest.param("delayed", marks=pytest.mark.slow)],
)
def test_norm_counts_the_trained_parameters_alone(clip, seed):
  """A loss that reads ``batch_stats`` has gradients for them, which no
  optimizer step reads: the norm, and the clipping by it, are optax's over
  ``params`` alone."""
  opt, max_norm = fj.sgd(0.5), 0.1
  forge_model, ref_model = FrozenNormMLP(True, opt), FrozenNormMLP(False)
  batches = make_batches(seed + 1, 3, (10, 12), CLASSES)
  ref = ref_model.init(jax.random.key(seed), batches[0][0])
  forge = fj.TrainState.create(
    apply_fn=forge_model.apply,
    params=fj.from_dense(ref, forge_model, batches[0][0]),
    tx=opt.to_optax(),
    max_grad_norm=max_norm,
    clip=clip,
  )
  expected = FlaxTrainState.create(
    apply_fn=ref_model.apply, params=ref["params"], tx=optax.sgd(0.5)
  )

  @jax.jit
  def forge_step(state, batch):
    _, grads = state.value_and_grad(_loss(state.apply_fn, batch))(state.params)
    return state.apply_gradients(grads=grads)

  previous_norm = np.inf
  for batch in batches:
    loss = lambda p: _loss(ref_model.apply, batch)({**ref, "params": p})
    grads = jax.grad(loss)(expected.params)
    norm = float(optax.tree.norm(grads))
    by = norm if clip == "exact" else previous_norm
    scale = min(1.0, max_norm / by) if np.isfinite(by) else 1.0
    expected = expected.apply_gradients(
      grads=jax.tree.map(lambda g: g * scale, grads)
    )
    forge = forge_step(forge, batch)
    np.testing.assert_allclose(float(forge.grad_norm), norm, rtol=1e-6)
    previous_norm = norm
  jax.tree.map(
    lambda actual, want: assert_rel_close(actual, want, 1e-5, "params"),
    fj.to_dense(forge.params)["params"],
    expected.params,
  )
