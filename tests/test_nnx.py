"""``fj.nnx``: FORGE for Flax NNX against ``nnx.Linear`` + ``nnx.Optimizer``.

The NNX training loop with its one change (differentiate with respect to
``fj.nnx.TRAINABLE``, update with ``fj.nnx.Optimizer``) trains as
``nnx.Linear`` + the optax alias, on every optimizer row of the table; the
NNX layer calls the fused op of ``fj.ForgeDense`` (bit-identical steps, int8
states and stochastic rounding included); ``fj.nnx.scan`` steps stacked
layers in place; the safety checks of the Linen layer hold; tensor
parallelism; orbax checkpoints resume bit for bit; an NNX Llama-style model
follows the Linen one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import forge_jax as fj
from examples.lm import llama
from examples.lm import train as train_lib

from conftest import (
  assert_bitwise_equal,
  assert_rel_close,
  assert_same_bits,
  make_batch,
  make_batches,
  poison,
)
from fused_dense_test_base import (
  BF16_STATE_RTOL,
  CLASSES,
  FEATURES,
  OPTAX_CASES,
  RTOL,
  STEPS,
)

OPT = fj.adamw(1e-2, weight_decay=0.1)
WRT = nnx.DiffState(0, fj.nnx.TRAINABLE)


class MLP(nnx.Module):
  """``fc1 -> gelu -> fc2 -> ...`` of ``fj.nnx.Linear`` or ``nnx.Linear``."""

  def __init__(self, features, rngs, optimizer=None, **kwargs):
    linear = nnx.Linear
    if optimizer is not None:
      linear = lambda *a, **k: fj.nnx.Linear(*a, optimizer=optimizer, **k)
    self.layers = nnx.List(
      [
        linear(i, o, rngs=rngs, **kwargs)
        for i, o in zip(features[:-1], features[1:])
      ]
    )

  def __call__(self, x):
    *hidden, last = self.layers
    for layer in hidden:
      x = nnx.gelu(layer(x))
    return last(x)


def cross_entropy(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def forge_step(loss_fn=cross_entropy):
  """The NNX train step with FORGE's one change: the DiffState."""

  @nnx.jit
  def step(model, optimizer, *batch):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=WRT)(model, *batch)
    optimizer.update(model, grads)
    return loss

  return step


def reference_step(loss_fn=cross_entropy):
  @nnx.jit
  def step(model, optimizer, *batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, *batch)
    optimizer.update(model, grads)
    return loss

  return step


def kernels_and_biases(model):
  """``{(layer, 'kernel' | 'bias'): array}`` of every linear layer."""
  out = {}
  for path, module in nnx.iter_modules(model):
    if isinstance(module, (nnx.Linear, fj.nnx.Linear)):
      out[path, "kernel"] = np.asarray(module.kernel[...])
      if module.bias is not None:
        out[path, "bias"] = np.asarray(module.bias[...])
  return out


def forge_values(model):
  return jax.tree.map(
    np.asarray, nnx.to_pure_dict(nnx.state(model, fj.nnx.OverwriteWithGradient))
  )


# ---------------------------------------------------------------------------
# The optimizer table against nnx.Linear + nnx.Optimizer(optax alias).

#: Core rows of these optimizers run by default (the Linen table runs every
#: optimizer through the same fused op), every row with --run-slow.
DEFAULT_OPTIMIZERS = ("adamw",)
TABLE = [
  pytest.param(
    case,
    id=case.id,
    marks=()
    if case.core and case.name in DEFAULT_OPTIMIZERS
    else pytest.mark.slow,
  )
  for case in OPTAX_CASES
]


@pytest.mark.parametrize("case", TABLE)
def test_matches_nnx_linear_and_optax(case, seed):
  """Every optimizer row: kernels, biases and losses of every step follow
  ``nnx.Linear`` + ``nnx.Optimizer(optax.<name>)`` to 1e-6 (fp32)."""
  opt = getattr(fj, case.name)(**case.kwargs)
  features = (case.shape[-1],) + FEATURES
  model = MLP(features, nnx.Rngs(seed), opt, implementation="xla")
  ref = MLP(features, nnx.Rngs(seed))
  initial = kernels_and_biases(model)
  for key, value in kernels_and_biases(ref).items():
    np.testing.assert_array_equal(initial[key], value)  # same init
  optimizer = fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param)
  ref_optimizer = nnx.Optimizer(
    ref, getattr(optax, case.name)(**case.kwargs), wrt=nnx.Param
  )
  bf16 = jnp.bfloat16 in (
    case.kwargs.get("mu_dtype"),
    case.kwargs.get("accumulator_dtype"),
  )
  rtol = BF16_STATE_RTOL if bf16 else RTOL
  step, ref_step = forge_step(), reference_step()
  for i, batch in enumerate(make_batches(seed, STEPS, case.shape, CLASSES)):
    loss = step(model, optimizer, *batch)
    ref_loss = ref_step(ref, ref_optimizer, *batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
    ours, theirs = kernels_and_biases(model), kernels_and_biases(ref)
    for key in theirs:
      assert_rel_close(ours[key], theirs[key], rtol, f"step {i} {key}")
  assert all(
    np.abs(kernels_and_biases(model)[k] - v).max() > 0
    for k, v in initial.items()
    if k[1] == "kernel"
  )
  assert int(optimizer.step[...]) == STEPS


# ---------------------------------------------------------------------------
# The same fused op as fj.ForgeDense: every backend, int8 states, SR.


class LinenMLP(nn.Module):
  features: tuple
  optimizer: fj.ForgeOptimizer
  implementation: str = "xla"

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate(self.features):
      x = fj.ForgeDense(
        f,
        optimizer=self.optimizer,
        implementation=self.implementation,
        param_dtype=x.dtype,
        name=f"layers_{i}",
      )(x)
      if i < len(self.features) - 1:
        x = nn.gelu(x)
    return x


def _linen_loss(variables, apply_fn, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(
    apply_fn(variables, x).astype(jnp.float32), y
  ).mean()


def _copy_linen_into_nnx(variables, model):
  """The Linen model's kernels and biases, in the NNX model of the same
  layer names (``layers_i`` -> ``layers[i]``)."""
  for i, layer in enumerate(model.layers):
    linen = variables[fj.FORGE_COLLECTION][f"layers_{i}"]
    layer.kernel[...] = linen["kernel"]
    layer.bias[...] = variables["params"][f"layers_{i}"]["bias"]


OPS = [
  pytest.param(
    "xla",
    fj.adamw(1e-2, weight_decay=0.1),
    12,
    id="xla-adamw",
    marks=pytest.mark.slow,
  ),
  pytest.param(  # by default: test_scan_steps_as_nnx_scan_bit_for_bit's
    "xla",
    fj.adamw(1e-2, state_dtype="int8", weight_rounding="stochastic"),
    128,
    id="xla-int8-sr",
    marks=pytest.mark.slow,
  ),
  pytest.param(
    "triton",
    fj.lion(1e-3, state_dtype="int8", weight_rounding="stochastic"),
    128,
    id="triton-int8-sr",
  ),
  pytest.param(
    "triton",
    fj.adamw(
      1e-2,
      state_dtype="int8",
      second_moment_bits=4,
      weight_rounding="stochastic",
    ),
    128,
    id="triton-int8-4bit-sr",
    marks=pytest.mark.slow,  # the kernel's 4-bit steps: test_fused_dense.py
  ),
  pytest.param(
    "mosaic",
    fj.adamw(1e-2, weight_rounding="stochastic"),
    128,
    id="mosaic-sr",
    marks=pytest.mark.slow,
  ),
]


def test_nnx_linear_product_fields_at_their_defaults():
  """``nnx.Linear``'s ``dot_general``, ``promote_dtype`` and
  ``preferred_element_type`` at their defaults give nnx.Linear's output;
  a custom one is refused by name, not computed otherwise."""
  from flax.nnx.nn.dtypes import promote_dtype

  x = jax.random.normal(jax.random.key(1), (3, 6))
  defaults = dict(
    dot_general=jax.lax.dot_general,
    promote_dtype=promote_dtype,
    preferred_element_type=None,
  )
  layer = fj.nnx.Linear(6, 4, optimizer=OPT, rngs=nnx.Rngs(0), **defaults)
  expected = nnx.Linear(6, 4, rngs=nnx.Rngs(0), **defaults)(x)
  np.testing.assert_array_equal(layer(x), expected)
  for name, value in (
    ("dot_general", lambda *a, **k: jax.lax.dot_general(*a, **k)),
    ("promote_dtype", lambda args, **k: args),
    ("preferred_element_type", jnp.float32),
  ):
    with pytest.raises(ValueError, match=f"custom {name} is not supported"):
      fj.nnx.Linear(6, 4, optimizer=OPT, rngs=nnx.Rngs(0), **{name: value})
  tokens = jnp.array([0, 3, 5])
  table = fj.nnx.Embed(
    6, 4, optimizer=OPT, rngs=nnx.Rngs(0), promote_dtype=promote_dtype
  )
  np.testing.assert_array_equal(
    table(tokens), nnx.Embed(6, 4, rngs=nnx.Rngs(0))(tokens)
  )
  with pytest.raises(ValueError, match=r"Embed\(6, 4\): a custom promote"):
    fj.nnx.Embed(
      6, 4, optimizer=OPT, rngs=nnx.Rngs(0), promote_dtype=lambda a, **k: a
    )


@pytest.mark.parametrize("implementation,opt,width", OPS)
def test_steps_bit_for_bit_as_forge_dense(implementation, opt, width, seed):
  """The NNX layer is the Linen layer's fused op: the same steps bit for
  bit (bf16 kernels for stochastic rounding, seeded with the Linen layers'
  ids), on every backend."""
  dtype = jnp.bfloat16 if opt.weight_rounding == "stochastic" else jnp.float32
  features = (width, width)  # the Mosaic kernel: K and N multiples of 128
  x, y = make_batch(seed, (64, width), CLASSES)
  x = x.astype(dtype)
  linen = LinenMLP(features, opt, implementation)
  variables = linen.init(jax.random.key(seed), x)
  state = fj.TrainState.create(
    apply_fn=linen.apply, params=variables, tx=opt.to_optax()
  )
  model = MLP(
    (width,) + features,
    nnx.Rngs(seed),
    opt,
    implementation=implementation,
    param_dtype=dtype,
  )
  _copy_linen_into_nnx(variables, model)
  for i, layer in enumerate(model.layers):  # the Linen layers' rounding ids
    layer.layer_id = fj.quantization.layer_id_from_path((f"layers_{i}",))
  optimizer = fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param)

  @jax.jit
  def linen_step(state, x, y):
    loss, grads = jax.value_and_grad(_linen_loss)(
      state.params, state.apply_fn, x, y
    )
    return state.apply_gradients(grads=grads), loss

  loss_fn = lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(
    m(x).astype(jnp.float32), y
  ).mean()
  step = forge_step(loss_fn)
  for _ in range(2):
    state, linen_loss = linen_step(state, x, y)
    loss = step(model, optimizer, x, y)
    assert_bitwise_equal(loss, linen_loss, "loss")
  ours = forge_values(model)
  for i in range(len(features)):
    theirs = state.params[fj.FORGE_COLLECTION][f"layers_{i}"]
    for name in fj.ForgeVariables._fields:
      for a, b in zip(
        jax.tree.leaves(ours["layers"][i][name]),
        jax.tree.leaves(theirs[name]),
      ):
        assert_bitwise_equal(a, b, f"layers_{i}/{name}")


# ---------------------------------------------------------------------------
# Safety, as for the Linen layer.


def _mlp(seed, features=(6, 8, 4), **kwargs):
  model = MLP(features, nnx.Rngs(seed), OPT, implementation="xla", **kwargs)
  return model, make_batch(seed, (5, features[0]), features[-1])


class Branches(nnx.Module):
  """A head per task; the loss reaches only the one it is given."""

  def __init__(self, rngs):
    self.body = fj.nnx.Linear(6, 8, optimizer=OPT, rngs=rngs)
    self.heads = nnx.List(
      [fj.nnx.Linear(8, 4, optimizer=OPT, rngs=rngs) for _ in range(2)]
    )

  def __call__(self, x, task):
    return self.heads[task](nnx.gelu(self.body(x)))


class BothHeads(Branches):
  def __call__(self, x):
    h = nnx.gelu(self.body(x))
    return self.heads[0](h), self.heads[1](h)


def test_layer_reached_in_an_earlier_trace_keeps_its_weights_when_not_reached(
  seed,
):
  """The forward inside an ``nnx.jit`` whose trace is cached: a second step
  traces neither the forward nor the backward of the head its loss does not
  reach, and must not trust the first step's trace, which reached it."""
  model = BothHeads(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  x, _ = make_batch(seed, (5, 6), 4)
  heads = nnx.jit(lambda m, x: m(x))

  def loss_fn(use_second):
    def loss(m, x):
      first, second = heads(m, x)
      loss = jnp.mean(first**2)
      return loss + jnp.mean(second**2) if use_second else loss

    return loss

  forge_step(loss_fn(True))(model, optimizer, x)
  before = forge_values(model)
  assert float(before["heads"][1]["count"]) == 1.0
  forge_step(loss_fn(False))(model, optimizer, x)
  after = forge_values(model)
  for a, b in zip(
    jax.tree.leaves(after["heads"][1]), jax.tree.leaves(before["heads"][1])
  ):
    assert_bitwise_equal(a, b, "heads[1]")
  assert optimizer.unreached_layers() == ["heads/1"]
  assert float(after["heads"][0]["count"]) == 2.0


@pytest.mark.parametrize("eager", [False, True], ids=["jit", "eager"])
def test_a_diagnostic_gradient_before_the_install_does_not_wipe(seed, eager):
  """The training gradient (one head), then a diagnostic gradient that
  reaches both heads and is never installed, then the install of the
  training gradient: the head the training loss does not reach keeps its
  variables bit for bit, in one ``nnx.jit`` step and with the gradients
  jitted apart and installed eagerly."""
  model = Branches(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  x, y = make_batch(seed, (5, 6), 4)

  def one_head(m):
    return cross_entropy(lambda x: m(x, 0), x, y)

  def both_heads(m):  # the body once, both heads
    h = nnx.gelu(m.body(x))
    return sum(
      optax.softmax_cross_entropy_with_integer_labels(head(h), y).mean()
      for head in m.heads
    )

  train_grad = fj.nnx.grad(one_head)
  diagnostic = lambda m: fj.nnx.global_norm(fj.nnx.grad(both_heads)(m))
  if eager:
    train_grad, diagnostic = nnx.jit(train_grad), nnx.jit(diagnostic)
    grads = train_grad(model)
    optimizer.update(model, grads)
    grads = train_grad(model)  # cached: nothing traced
    diagnostic(model)
    before = forge_values(model)
    optimizer.update(model, grads)
  else:

    @nnx.jit
    def step(model, optimizer):
      grads = train_grad(model)
      diagnostic(model)
      optimizer.update(model, grads)

    before = forge_values(model)
    step(model, optimizer)
  after = forge_values(model)
  for a, b in zip(
    jax.tree.leaves(after["heads"][1]), jax.tree.leaves(before["heads"][1])
  ):
    assert_bitwise_equal(a, b, "heads[1]")
  assert (
    float(after["heads"][0]["count"])
    == float(before["heads"][0]["count"]) + 1.0
  )
  assert fj.nnx.wiped_layers(model) == []


def test_unreached_layer_keeps_its_variables_bit_for_bit(seed):
  model = Branches(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  x, y = make_batch(seed, (5, 6), 4)
  step = forge_step(lambda m, x, y: cross_entropy(lambda x: m(x, 0), x, y))
  step(model, optimizer, x, y)
  before = forge_values(model)
  step(model, optimizer, x, y)  # traced once: head 1 is never reached
  after = forge_values(model)
  for a, b in zip(
    jax.tree.leaves(after["heads"][1]), jax.tree.leaves(before["heads"][1])
  ):
    assert_bitwise_equal(a, b, "heads[1]")
  assert float(after["heads"][1]["count"]) == 0.0
  assert float(after["heads"][0]["count"]) == 2.0
  assert optimizer.unreached_layers() == ["heads/1"]
  assert fj.nnx.wiped_layers(model) == []

  # nnx.update(model, grads) instead of the optimizer wipes the layer, and
  # its next step turns the loss NaN.
  @nnx.jit
  def overwrite(model):
    grads = nnx.grad(
      lambda m: cross_entropy(lambda x: m(x, 0), x, y), argnums=WRT
    )(model)
    nnx.update(model, nnx.state(grads, fj.nnx.OverwriteWithGradient))

  overwrite(model)
  assert fj.nnx.wiped_layers(model) == ["heads/1"]
  other_step = forge_step(
    lambda m, x, y: cross_entropy(lambda x: m(x, 1), x, y)
  )
  assert np.isfinite(other_step(model, optimizer, x, y))
  assert np.isnan(other_step(model, optimizer, x, y))


def test_a_clone_in_the_same_loss_does_not_wipe_an_unreached_head(seed):
  """A model and its nnx.clone (its layers under the same keys) trained by
  one loss in one nnx.jit, each reaching another head: the clone's head
  that ran its backward says nothing of the model's, which keeps its
  variables bit for bit, as it would under nnx.Linear + optax."""
  model = Branches(nnx.Rngs(seed))
  twin = nnx.clone(model)
  optimizers = [
    fj.nnx.Optimizer(m, OPT.to_optax(), wrt=nnx.Param) for m in (model, twin)
  ]
  x, y = make_batch(seed, (5, 6), 4)
  before = [forge_values(m) for m in (model, twin)]

  @nnx.jit
  def step(model, twin, optimizers):
    def loss(model, twin):
      return cross_entropy(lambda x: model(x, 0), x, y) + cross_entropy(
        lambda x: twin(x, 1), x, y
      )

    grads = fj.nnx.grad(loss, argnums=(0, 1))(model, twin)
    for m, o, g in zip((model, twin), optimizers, grads):
      o.update(m, g)

  step(model, twin, optimizers)
  for m, o, old, unreached in zip((model, twin), optimizers, before, (1, 0)):
    new = forge_values(m)
    for a, b in zip(
      jax.tree.leaves(new["heads"][unreached]),
      jax.tree.leaves(old["heads"][unreached]),
    ):
      assert_bitwise_equal(a, b, f"heads[{unreached}]")
    assert float(new["heads"][1 - unreached]["count"]) == 1.0
    assert o.unreached_layers() == [f"heads/{unreached}"]
    assert fj.nnx.wiped_layers(m) == []


def test_the_head_of_the_branch_not_taken_keeps_its_variables(seed):
  """jax.lax.cond picks the head by a traced flag: the branch not taken
  traces its head's backward too, and writes zeros as its new variables;
  the install checks the written flags at run time and keeps them."""
  model = Branches(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  x, y = make_batch(seed, (5, 6), 4)
  branchwise = lambda m, x, y, second: jax.lax.cond(
    second,
    lambda: cross_entropy(lambda x: m(x, 1), x, y),
    lambda: cross_entropy(lambda x: m(x, 0), x, y),
  )
  step = forge_step(branchwise)
  before = forge_values(model)
  step(model, optimizer, x, y, jnp.asarray(False))
  after = forge_values(model)
  for a, b in zip(
    jax.tree.leaves(after["heads"][1]), jax.tree.leaves(before["heads"][1])
  ):
    assert_bitwise_equal(a, b, "heads[1]")
  assert optimizer.unreached_layers() == ["heads/1"]
  step(model, optimizer, x, y, jnp.asarray(True))
  assert float(forge_values(model)["heads"][1]["count"]) == 1.0
  assert fj.nnx.wiped_layers(model) == []


def test_a_gradient_taken_elsewhere_does_not_wipe_an_unreached_layer(seed):
  """A gradient of the task-1 loss traced for a diagnostic (its own jit,
  never installed) must not vouch for head 1 in a step on task 0."""
  model = Branches(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  x, y = make_batch(seed, (5, 6), 4)
  loss = lambda task: lambda m, x, y: cross_entropy(lambda x: m(x, task), x, y)
  diagnostic = nnx.jit(
    lambda m: fj.nnx.global_norm(nnx.grad(loss(1), argnums=WRT)(m, x, y))
  )
  assert np.isfinite(float(diagnostic(model)))
  before = forge_values(model)
  forge_step(loss(0))(model, optimizer, x, y)
  after = forge_values(model)
  for a, b in zip(
    jax.tree.leaves(after["heads"][1]), jax.tree.leaves(before["heads"][1])
  ):
    assert_bitwise_equal(a, b, "heads[1]")
  assert optimizer.unreached_layers() == ["heads/1"]
  assert fj.nnx.wiped_layers(model) == []


def test_eager_gradients_installed_by_a_jitted_update_keep_unreached_heads(
  seed,
):
  """Gradients taken eagerly and installed by ``nnx.jit(optimizer.update)``:
  the update's cached trace cannot trust a backward traced elsewhere, so
  a later step whose loss does not reach head 0 keeps it bit for bit."""
  model = Branches(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  x, y = make_batch(seed, (5, 6), 4)
  loss = lambda task: lambda m: cross_entropy(lambda x: m(x, task), x, y)
  update = nnx.jit(lambda o, m, g: o.update(m, g))
  update(optimizer, model, fj.nnx.grad(loss(0))(model))
  before = forge_values(model)
  update(optimizer, model, fj.nnx.grad(loss(1))(model))
  for a, b in zip(
    jax.tree.leaves(forge_values(model)["heads"][0]),
    jax.tree.leaves(before["heads"][0]),
  ):
    assert_bitwise_equal(a, b, "heads[0]")
  assert optimizer.unreached_layers() == ["heads/0"]
  assert fj.nnx.wiped_layers(model) == []


class Twice(nnx.Module):
  def __init__(self, rngs):
    self.fc = fj.nnx.Linear(4, 4, optimizer=OPT, rngs=rngs)

  def __call__(self, x):
    return self.fc(self.fc(x))


def test_called_twice_in_one_loss_raises(seed):
  """A layer called twice in a differentiated loss raises; inference may
  call it as often as it likes, eagerly or jitted."""
  model = Twice(nnx.Rngs(seed))
  x = jnp.ones((2, 4))
  np.asarray(model(model.fc(x)))
  np.asarray(nnx.jit(lambda m, x: m(x) + m(2 * x))(model, x))
  with pytest.raises(ValueError, match="ran its backward twice"):
    nnx.grad(lambda m: m(x).sum(), argnums=WRT)(model)
  with pytest.raises(ValueError, match="ran its backward twice"):
    nnx.jit(lambda m: nnx.grad(lambda m: m(x).sum(), argnums=WRT)(m))(model)
  fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)  # names the layer
  with pytest.raises(ValueError, match="'fc' ran its backward twice"):
    nnx.grad(lambda m: m(x).sum(), argnums=WRT)(model)


class TiedAutoencoder(nnx.Module):
  def __init__(self, rngs):
    self.encoder = fj.nnx.Linear(4, 3, optimizer=OPT, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.encoder(x)) @ self.encoder.kernel[...].T


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_kernel_read_outside_its_layer_raises(jit, seed):
  """A decoder tied to the encoder's kernel adds its gradient to the
  kernel's update: the optimizer raises, naming the layer, and leaves the
  model as it was."""
  model = TiedAutoencoder(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(seed), (2, 4))
  before = np.array(model.encoder.kernel[...])

  def step(model, optimizer):
    grads = fj.nnx.grad(lambda m: ((m(x) - x) ** 2).mean())(model)
    optimizer.update(model, grads)

  with pytest.raises(ValueError, match=r"\['encoder'\].*another use of"):
    (nnx.jit(step) if jit else step)(model, optimizer)
  np.testing.assert_array_equal(model.encoder.kernel[...], before)


class _TanhBlock(nnx.Module):
  def __init__(self, rngs):
    self.fc = fj.nnx.Linear(4, 4, optimizer=OPT, rngs=rngs)

  def __call__(self, h):
    return jnp.tanh(self.fc(h))


class ScannedStack(nnx.Module):
  def __init__(self, rngs):
    make = nnx.vmap(lambda key: _TanhBlock(nnx.Rngs(key)))
    self.blocks = make(jax.random.split(rngs.params(), 3))

  def __call__(self, h):
    run = fj.nnx.scan(lambda h, block: block(h))
    return run(h, self.blocks)


def test_a_penalty_on_a_scanned_stack_raises(seed):
  """An L2 penalty on ``fj.nnx.scan``'s stacked kernels adds its gradient
  to their update: the optimizer raises, naming the stack's layer; the
  same step without it trains."""
  x = jax.random.normal(jax.random.key(seed), (2, 4))
  model = ScannedStack(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  output = lambda m: (m(x) ** 2).mean()
  penalized = lambda m: output(m) + 0.1 * jnp.sum(m.blocks.fc.kernel[...] ** 2)
  with pytest.raises(ValueError, match=r"\['blocks/fc'\].*another use of"):
    optimizer.update(model, fj.nnx.grad(penalized)(model))
  optimizer.update(model, fj.nnx.grad(output)(model))
  np.testing.assert_array_equal(model.blocks.fc.count[...], [1.0, 1.0, 1.0])


def test_a_layer_shared_across_nnx_vmap_raises(seed):
  """nnx.vmap over examples with the model broadcast maps the backward but
  not the kernel: it raises at trace time, naming the layer, instead of
  summing one update an example into the kernel."""
  model, (x, _) = _mlp(seed)
  fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)  # names the layers
  per_example = nnx.vmap(lambda m, xi: (m(xi) ** 2).sum(), in_axes=(None, 0))
  with pytest.raises(ValueError, match="layer 'layers/1'.*jax.vmap"):
    fj.nnx.grad(lambda m: per_example(m, x).sum())(model)


def test_accumulated_gradients_are_refused(seed):
  """Averaged micro-batch gradients would install averaged updates: the
  optimizer refuses them, naming the layers."""
  model, (x, y) = _mlp(seed)
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)

  @nnx.jit
  def accumulate(model, optimizer, x, y):
    grads = [
      fj.nnx.grad(cross_entropy)(model, x[i::2], y[i::2]) for i in (0, 1)
    ]
    optimizer.update(model, jax.tree.map(lambda a, b: (a + b) / 2, *grads))

  with pytest.raises(ValueError, match=r"\['layers/0', 'layers/1'\] combines"):
    accumulate(model, optimizer, x, y)


def test_grad_of_params_only_raises(seed):
  model, (x, y) = _mlp(seed)
  with pytest.raises(ValueError, match="fj.nnx.TRAINABLE"):
    nnx.grad(cross_entropy)(model, x, y)


def test_gradient_without_an_installer_warns(seed):
  """A plain nnx.Optimizer steps nnx.Param alone: FORGE's kernels would
  never train. fj.nnx.value_and_grad warns for such a model, naming the
  layers; an fj.nnx.Optimizer made for it silences the warning."""
  model, (x, y) = _mlp(seed)
  nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  with pytest.warns(fj.nnx.NotInstalledWarning, match="'layers/0'"):
    fj.nnx.value_and_grad(cross_entropy)(model, x, y)
  fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  with warnings.catch_warnings():
    warnings.simplefilter("error", fj.nnx.NotInstalledWarning)
    fj.nnx.value_and_grad(cross_entropy)(model, x, y)


def _refused_at_update(model, tx, wrt, match, x, y):
  """``fj.nnx.Optimizer(model, tx, wrt=wrt)`` refuses the first step's
  gradient (``match``) and leaves the model as it was."""
  optimizer = fj.nnx.Optimizer(model, tx, wrt=wrt)
  before = nnx.to_pure_dict(nnx.state(model))
  grads = fj.nnx.grad(cross_entropy)(model, x, y)
  with pytest.raises(ValueError, match=match):
    optimizer.update(model, grads)
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model)), before)


def test_update_that_tx_refuses_leaves_the_model_as_it_was(seed):
  """Grads taken with a narrower filter than ``wrt`` fail inside optax, in
  an eager update: FORGE's layers, stepped by the backward, are not
  installed either, so no layer is half a step ahead."""
  model, (x, y) = _mlp(seed, (6, 8, 8, 4))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  first = nnx.All(nnx.Param, nnx.PathContains(0))
  grads = fj.nnx.grad(cross_entropy, argnums=nnx.DiffState(0, first))(
    model, x, y
  )
  with pytest.raises(ValueError):  # optax's tree mismatch
    optimizer.update(model, grads)
  after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  assert_same_bits(after, before, "the model after a refused update")
  assert float(optimizer.grad_norm[...]) == 0.0


def test_optimizer_refuses_to_freeze_a_forge_layer(seed):
  """Freezing a module by ``wrt`` or by a frozen label cannot reach a
  Linear's kernel, which steps in the backward pass: a step the loss
  reaches it in is refused, naming the layer; the other layers may be
  frozen, and a Linear's bias alone too."""
  model, (x, y) = _mlp(seed, features=(6, 8, 8, 4))
  model.norm = nnx.LayerNorm(4, rngs=nnx.Rngs(seed))
  head_only = nnx.All(nnx.Param, nnx.PathContains(2))
  match = r"\['layers/0', 'layers/1'\].*FORGE"
  _refused_at_update(model, OPT.to_optax(), head_only, match, x, y)

  def freezing(*path):
    labels = jax.tree.map(lambda _: "train", nnx.state(model, nnx.Param))
    node = labels
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = "frozen"
    return optax.multi_transform(
      {"train": OPT.to_optax(), "frozen": optax.set_to_zero()}, labels
    )

  # Labels as a pytree of the parameters hold no kernel: a frozen bias
  # stands for its module.
  tx = freezing("layers", 1, "bias")
  _refused_at_update(model, tx, nnx.Param, r"\['layers/1'\].*FORGE", x, y)
  fj.nnx.Optimizer(model, freezing("norm", "scale"), wrt=nnx.Param)

  # Bias-free layers: ``wrt`` is read as for nnx.Linear's kernel.
  bias_free, _ = _mlp(seed, features=(6, 8, 8, 4), use_bias=False)
  _refused_at_update(bias_free, OPT.to_optax(), head_only, match, x, y)
  fj.nnx.Optimizer(bias_free, OPT.to_optax(), wrt=nnx.Param)
  # A filter on values sees the kernel's own; the biases it leaves out
  # stay, as nnx.Linear's would.
  matrices = nnx.All(nnx.Param, lambda path, v: jnp.ndim(v[...]) > 1)
  for m in (bias_free, model):
    optimizer = fj.nnx.Optimizer(m, OPT.to_optax(), wrt=matrices)
    optimizer.update(m, fj.nnx.grad(cross_entropy)(m, x, y))
  biases_only = nnx.All(nnx.Param, nnx.PathContains("bias"))
  match = r"\['layers/0', 'layers/1', 'layers/2'"
  _refused_at_update(model, OPT.to_optax(), biases_only, match, x, y)

  # LoRA on a frozen FORGE base: the base would train in the backward.
  base = fj.nnx.Linear(6, 4, use_bias=False, optimizer=OPT, rngs=nnx.Rngs(0))
  lora = nnx.LoRA(6, 2, 4, base_module=base, rngs=nnx.Rngs(1))
  match = r"\['base_module'\].*nnx.Linear"
  _refused_at_update(lora, OPT.to_optax(), nnx.LoRAParam, match, x, y)


def _frozen_labels(frozen):
  """optax.multi_transform labels as a function of the parameters:
  'frozen' for the leaves whose path ``frozen(keystr)`` picks."""
  return lambda params: jax.tree_util.tree_map_with_path(
    lambda path, _: "frozen" if frozen(jax.tree_util.keystr(path)) else "train",
    params,
  )


def _freezing(frozen, train=OPT.to_optax()):
  return optax.multi_transform(
    {"train": train, "frozen": optax.set_to_zero()}, _frozen_labels(frozen)
  )


#: The optax alias of OPT, for nnx.Linear.
OPTAX_OPT = optax.adamw(1e-2, weight_decay=0.1)


def _train_against_nnx(model, ref, tx, ref_tx, wrt, batches):
  """Trains ``model`` (FORGE) and ``ref`` (nnx.Linear) by the same steps,
  differentiating ``wrt`` as nnx.Optimizer's own loop does, and checks
  that their losses, kernels and biases agree; returns both models'
  kernels and biases."""
  optimizer = fj.nnx.Optimizer(model, tx, wrt=wrt)
  ref_optimizer = nnx.Optimizer(ref, ref_tx, wrt=wrt)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = fj.nnx.value_and_grad(
      cross_entropy, argnums=nnx.DiffState(0, wrt)
    )(model, x, y)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def ref_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(
      cross_entropy, argnums=nnx.DiffState(0, wrt)
    )(model, x, y)
    optimizer.update(model, grads)
    return loss

  for x, y in batches:
    np.testing.assert_allclose(
      step(model, optimizer, x, y), ref_step(ref, ref_optimizer, x, y), 1e-6
    )
  ours, theirs = kernels_and_biases(model), kernels_and_biases(ref)
  for key in theirs:
    assert_rel_close(ours[key], theirs[key], RTOL, str(key))
  return ours, theirs


@pytest.mark.parametrize("how", ["labels", "wrt"])
def test_optimizer_lets_one_linear_bias_be_frozen(how, seed):
  """One Linear's bias frozen alone, by labels as a function of the
  parameters (they leave its kernel, asked at its path, trained) or by a
  ``wrt`` that leaves it out: the step passes and trains as nnx.Linear +
  nnx.Optimizer frozen alike, that bias kept bit for bit."""
  features = (6, 8, 4)
  model, ref = MLP(features, nnx.Rngs(seed), OPT), MLP(features, nnx.Rngs(seed))
  initial = kernels_and_biases(ref)
  if how == "labels":
    bias_0 = lambda name: name.startswith("['layers'][0]['bias']")
    tx, ref_tx, wrt = _freezing(bias_0), _freezing(bias_0, OPTAX_OPT), nnx.Param
  else:
    tx, ref_tx = OPT.to_optax(), OPTAX_OPT
    wrt = nnx.All(nnx.Param, lambda path, _: path != ("layers", 0, "bias"))
  batches = make_batches(seed, 3, (5, 6), 4)
  ours, _ = _train_against_nnx(model, ref, tx, ref_tx, wrt, batches)
  assert ours.keys() == initial.keys()
  for key, value in initial.items():
    frozen = key == (("layers", 0), "bias")
    assert np.array_equal(ours[key], value) == frozen, key


class StoppedBody(nnx.Module):
  """``body -> gelu -> head``; where ``stop``, the body's output gradient
  is stopped (the body frozen as FORGE's refusal advises)."""

  def __init__(self, rngs, optimizer=None, stop=True):
    linear = nnx.Linear
    if optimizer is not None:
      linear = lambda *a, **k: fj.nnx.Linear(*a, optimizer=optimizer, **k)
    self.body = linear(6, 8, rngs=rngs)
    self.head = linear(8, 4, rngs=rngs)
    self.stop = stop

  def __call__(self, x):
    h = nnx.gelu(self.body(x))
    return self.head(jax.lax.stop_gradient(h) if self.stop else h)


@pytest.mark.parametrize("how", ["labels", "wrt"])
def test_optimizer_lets_a_stopped_linear_be_frozen(how, seed):
  """A body frozen by a label (so that weight decay spares its bias too)
  or by ``wrt``, its output's gradient stopped: nothing steps its kernel,
  so the step passes and trains as nnx.Linear + nnx.Optimizer, the body
  kept bit for bit. The same freezing without the stop_gradient would
  train the body's kernel in the backward pass: refused at the update,
  naming the body."""
  in_body = lambda name: name.startswith("['body']")
  if how == "labels":
    tx, ref_tx, wrt = (
      _freezing(in_body),
      _freezing(in_body, OPTAX_OPT),
      nnx.Param,
    )
  else:
    tx, ref_tx = OPT.to_optax(), OPTAX_OPT
    wrt = nnx.All(nnx.Param, nnx.PathContains("head"))
  model = StoppedBody(nnx.Rngs(seed), OPT)
  ref = StoppedBody(nnx.Rngs(seed))
  initial = kernels_and_biases(ref)
  batches = make_batches(seed, 3, (5, 6), 4)
  ours, _ = _train_against_nnx(model, ref, tx, ref_tx, wrt, batches)
  for key, value in initial.items():
    assert np.array_equal(ours[key], value) == (key[0] == ("body",)), key

  reached = StoppedBody(nnx.Rngs(seed), OPT, stop=False)
  optimizer = fj.nnx.Optimizer(reached, tx, wrt=wrt)
  before = nnx.to_pure_dict(nnx.state(reached))

  @nnx.jit
  def step(model, optimizer, x, y):
    optimizer.update(model, fj.nnx.grad(cross_entropy)(model, x, y))

  with pytest.raises(ValueError, match=r"\['body'\].*FORGE layers"):
    step(reached, optimizer, *batches[0])
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(reached)), before)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_linear_left_out_of_wrt_and_of_the_gradient_stays_frozen(jit, seed):
  """Fine-tuning the head alone: ``wrt`` and the gradient's filter leave
  the body out, so the body is never differentiated and its backward never
  runs. The update keeps it bit for bit, as nnx.Linear + nnx.Optimizer
  keep theirs, and trains the head as they do; the body is named as not
  reached. fj.nnx.grad, which differentiates the body too, is refused.
  """
  wrt = nnx.All(nnx.Param, nnx.PathContains("head"))
  diff = nnx.All(fj.nnx.TRAINABLE, nnx.PathContains("head"))
  model = StoppedBody(nnx.Rngs(seed), OPT, stop=False)
  ref = StoppedBody(nnx.Rngs(seed), stop=False)
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=wrt)
  ref_optimizer = nnx.Optimizer(ref, OPTAX_OPT, wrt=wrt)
  before = nnx.to_pure_dict(nnx.state(model.body))

  def step(model, optimizer, x, y):
    grads = nnx.grad(cross_entropy, argnums=nnx.DiffState(0, diff))(model, x, y)
    optimizer.update(model, grads)

  def ref_step(model, optimizer, x, y):
    grads = nnx.grad(cross_entropy, argnums=nnx.DiffState(0, wrt))(model, x, y)
    optimizer.update(model, grads)

  if jit:
    step, ref_step = nnx.jit(step), nnx.jit(ref_step)
  for x, y in make_batches(seed, 3, (5, 6), 4):
    step(model, optimizer, x, y)
    ref_step(ref, ref_optimizer, x, y)
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model.body)), before)
  ours, theirs = kernels_and_biases(model), kernels_and_biases(ref)
  for key in theirs:
    assert_rel_close(ours[key], theirs[key], RTOL, str(key))
  assert float(model.head.count[...]) == 3.0
  assert optimizer.unreached_layers() == ["body"]
  # fj.nnx.grad differentiates the body too: refused, saying how to leave
  # it out.
  widened = fj.nnx.grad(cross_entropy, argnums=nnx.DiffState(0, wrt))
  with pytest.raises(ValueError, match=r"\['body'\].*nnx.All\(fj.nnx.TRAIN"):
    optimizer.update(model, widened(model, x, y))


def test_a_frozen_body_stepped_in_one_jit_is_refused_in_another(seed):
  """Gradients from one jit, an evaluation's forward, the update in another
  jit: the update cannot tell which computation's gradient it installs,
  so a body ``wrt`` freezes that the gradient stepped is refused, the model
  kept as it was. With the body's output gradient stopped the same loop
  trains the head alone, the body kept bit for bit."""
  wrt = nnx.All(nnx.Param, nnx.PathContains("head"))
  x, y = make_batch(seed, (5, 6), 4)
  for stop in (False, True):
    model = StoppedBody(nnx.Rngs(seed), OPT, stop=stop)
    optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=wrt)
    before = nnx.to_pure_dict(nnx.state(model))
    grad_fn = fj.nnx.grad(cross_entropy, argnums=nnx.DiffState(0, wrt))
    grads = nnx.jit(grad_fn)(model, x, y)
    nnx.jit(lambda model, x: model(x))(model, x)
    update = nnx.jit(
      lambda model, optimizer, grads: optimizer.update(model, grads)
    )
    if not stop:
      with pytest.raises(ValueError, match=r"\['body'\].*FORGE layers"):
        update(model, optimizer, grads)
      chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model)), before)
      continue
    update(model, optimizer, grads)
    after = nnx.to_pure_dict(nnx.state(model))
    chex.assert_trees_all_equal(after["body"], before["body"])
    assert float(model.head.count[...]) == 1.0


class EmbeddedHead(nnx.Module):
  """``embed -> gelu -> head`` of fj.nnx's or nnx's layers; where ``stop``,
  the table's output gradient is stopped."""

  def __init__(self, rngs, optimizer=None, stop=False):
    if optimizer is None:
      self.embed = nnx.Embed(11, 8, rngs=rngs)
      self.head = nnx.Linear(8, 4, rngs=rngs)
    else:
      self.embed = fj.nnx.Embed(11, 8, optimizer=optimizer, rngs=rngs)
      self.head = fj.nnx.Linear(8, 4, optimizer=optimizer, rngs=rngs)
    self.stop = stop

  def __call__(self, tokens):
    h = nnx.gelu(self.embed(tokens))
    return self.head(jax.lax.stop_gradient(h) if self.stop else h)


def test_optimizer_asks_wrt_about_an_embed_table_by_its_name(seed):
  """A ``wrt`` that leaves out every ``'embedding'`` freezes fj.nnx.Embed's
  table as it would nnx.Embed's: refused at the update the loss reaches it
  in; with its output's gradient stopped, the step trains as nnx.Embed +
  nnx.Optimizer frozen alike, the table kept bit for bit."""
  wrt = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embedding")))
  tokens = jax.random.randint(jax.random.key(seed), (5,), 0, 11)
  labels = jax.random.randint(jax.random.key(seed + 1), (5,), 0, 4)
  model = EmbeddedHead(nnx.Rngs(seed), OPT)
  match = r"\['embed'\].*FORGE"
  _refused_at_update(model, OPT.to_optax(), wrt, match, tokens, labels)

  model = EmbeddedHead(nnx.Rngs(seed), OPT, stop=True)
  ref = EmbeddedHead(nnx.Rngs(seed), stop=True)
  initial = np.asarray(ref.embed.embedding[...])
  batches = [(tokens, labels), (tokens[::-1], labels)]
  _train_against_nnx(model, ref, OPT.to_optax(), OPTAX_OPT, wrt, batches)
  np.testing.assert_array_equal(model.embed.kernel[...], initial)
  np.testing.assert_array_equal(ref.embed.embedding[...], initial)


def test_optimizer_refuses_a_decay_mask_without_a_forge_kernel(seed):
  head_undecayed = lambda p: jax.tree_util.tree_map_with_path(
    lambda path, _: "1" not in jax.tree_util.keystr(path), p
  )
  opt = fj.adamw(1e-2, weight_decay=0.1, mask=head_undecayed)
  model = MLP((6, 8, 4), nnx.Rngs(seed), opt, implementation="xla")
  with pytest.raises(ValueError, match=r"mask leaves out.*\['layers/1'\]"):
    fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param)


def test_optimizer_reads_a_decay_mask_by_size_at_each_kernels_shape(seed):
  """A mask by size that decays the ``[6, 8]`` kernel but not the ``[8, 4]``
  one (nor the biases) is refused, naming the second layer."""
  big = lambda p: jax.tree.map(lambda a: a.size > 40, p)
  opt = fj.adamw(1e-2, weight_decay=0.1, mask=big)
  model = MLP((6, 8, 4), nnx.Rngs(seed), opt, implementation="xla")
  with pytest.raises(ValueError, match=r"mask leaves out.*\['layers/1'\]"):
    fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param)


def test_optimizer_takes_each_bias_by_its_layer_rule(seed):
  """Linears on two rules: a tx that steps the Lion layer's bias by AdamW
  is refused, naming it; labels that give it Lion pass."""
  model, _ = _mlp(seed)
  lion = fj.lion(1e-3)
  model.layers[0] = fj.nnx.Linear(
    6, 8, optimizer=lion, implementation="xla", rngs=nnx.Rngs(seed)
  )
  with pytest.raises(ValueError, match=r"\['layers/0'\].*another rule"):
    fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  labels = nnx.state(model, nnx.Param)
  labels = jax.tree.map(lambda _: "adamw", labels)
  labels["layers"][0]["bias"] = "lion"
  tx = optax.multi_transform(
    {"adamw": OPT.to_optax(), "lion": lion.to_optax()}, labels
  )
  fj.nnx.Optimizer(model, tx, wrt=nnx.Param)


def test_optimizer_refuses_a_decay_mask_tree_without_a_forge_kernel(seed):
  """A weight-decay mask given as an ``nnx.State`` prefix of the
  parameters, on the layers' optimizer or on tx: a leaf above a Linear
  (``1: False``) applies to its whole subtree, so nnx.Linear + optax would
  leave its kernel undecayed while FORGE decays it: refused, naming it. A
  tree that keeps the kernels decayed (the LayerNorm left out) passes."""
  left_out = nnx.State({"layers": {0: True, 1: False}, "norm": False})
  kept = nnx.State({"layers": {0: True, 1: True}, "norm": False})
  for mask, refused in ((left_out, True), (kept, False)):
    opt = fj.adamw(1e-2, weight_decay=0.1, mask=mask)
    on_optimizer = MLP((6, 8, 4), nnx.Rngs(seed), opt, implementation="xla")
    on_tx, _ = _mlp(seed)
    for model, tx in (
      (on_optimizer, opt.to_optax()),
      (on_tx, optax.adamw(1e-2, weight_decay=0.1, mask=mask)),
    ):
      model.norm = nnx.LayerNorm(4, rngs=nnx.Rngs(seed))
      if refused:
        with pytest.raises(ValueError, match=r"mask leaves out.*\['layers/1'"):
          fj.nnx.Optimizer(model, tx, wrt=nnx.Param)
      else:
        fj.nnx.Optimizer(model, tx, wrt=nnx.Param)


class LayerwiseMLP(MLP):
  """``MLP`` whose layers each take their own optimizer (``optimizers``;
  None: nnx.Linear layers)."""

  def __init__(self, features, rngs, optimizers=None):
    def linear(i, o, opt):
      if opt is None:
        return nnx.Linear(i, o, rngs=rngs)
      return fj.nnx.Linear(i, o, optimizer=opt, implementation="xla", rngs=rngs)

    shapes = list(zip(features[:-1], features[1:]))
    self.layers = nnx.List(
      [
        linear(i, o, opt)
        for (i, o), opt in zip(shapes, optimizers or [None] * len(shapes))
      ]
    )


def test_optimizer_takes_layerwise_rates_without_bias_decay(seed):
  """Layer-wise learning rates (each Linear on its own ``fj.adamw``, tx a
  ``multi_transform`` labelled by path: a function, or an ``nnx.State``
  prefix) with no weight decay on biases (each rate's rule masked by
  rank): trains as nnx.Linear + nnx.Optimizer under the same tx. One rate
  for all is refused, naming the layers on other rates."""
  features, rates = (6, 8, 8, 4), (1e-3, 3e-3, 1e-2)
  no_bias_decay = lambda p: jax.tree.map(lambda a: jnp.ndim(a) > 1, p)
  rules = {
    f"g{i}": optax.adamw(lr, weight_decay=0.1, mask=no_bias_decay)
    for i, lr in enumerate(rates)
  }
  by_path = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, _: f"g{path[1].key}", params
  )
  prefix = nnx.State({"layers": {i: f"g{i}" for i in range(len(rates))}})
  opts = [fj.adamw(lr, weight_decay=0.1) for lr in rates]
  for labels in (by_path, prefix):
    model = LayerwiseMLP(features, nnx.Rngs(seed), opts)
    ref = LayerwiseMLP(features, nnx.Rngs(seed))
    tx = optax.multi_transform(rules, labels)
    optimizer = fj.nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    step, ref_step = forge_step(), reference_step()
    for i, batch in enumerate(make_batches(seed, 3, (5, 6), 4)):
      loss = step(model, optimizer, *batch)
      np.testing.assert_allclose(loss, ref_step(ref, ref_optimizer, *batch))
      ours, theirs = kernels_and_biases(model), kernels_and_biases(ref)
      for key in theirs:
        assert_rel_close(ours[key], theirs[key], RTOL, f"step {i} {key}")
  model = LayerwiseMLP(features, nnx.Rngs(seed), opts)
  with pytest.raises(ValueError, match=r"\['layers/1', 'layers/2'\] by"):
    fj.nnx.Optimizer(model, rules["g0"], wrt=nnx.Param)


class TwoLayerNet(nnx.Module):
  def __init__(self, features_in, features_out, rngs, forge: bool):
    def linear(i, o):
      if forge:
        return fj.nnx.Linear(i, o, optimizer=OPT, rngs=rngs)
      return nnx.Linear(i, o, rngs=rngs)

    self.a = linear(features_in, 8)
    self.b = linear(8, features_out)

  def __call__(self, x):
    return self.b(nnx.relu(self.a(x)))


def test_a_gan_trains_as_with_nnx_linear(seed):
  """A generator and a discriminator, both FORGE, stepped in turn: the
  generator's loss goes through the discriminator, which it does not train,
  inside ``fj.plain_gradients()``. Without it the error names the
  discriminator's layer and says so; with the generator inside too, its
  install is refused. Both train as nnx.Linear + optax."""
  keys = jax.random.split(jax.random.key(seed), 2)
  z = jax.random.normal(keys[0], (4, 2))
  real = jax.random.normal(keys[1], (4, 3))

  def d_loss(d, fake):
    score = d(jnp.concatenate([real, fake]))
    return jnp.mean(nnx.softplus(-score[:4]) + nnx.softplus(score[4:]))

  def g_loss(d, plain):
    def loss(g):
      if plain == "all":
        with fj.plain_gradients():
          return jnp.mean(nnx.softplus(-d(g(z))))
      fake = g(z)
      if plain is None:
        return jnp.mean(nnx.softplus(-d(fake)))
      with fj.plain_gradients():  # the discriminator only
        return jnp.mean(nnx.softplus(-d(fake)))

    return loss

  def train(forge, plain="discriminator"):
    g = TwoLayerNet(2, 3, nnx.Rngs(seed), forge)
    d = TwoLayerNet(3, 1, nnx.Rngs(seed + 1), forge)
    make = fj.nnx.Optimizer if forge else nnx.Optimizer
    g_opt, d_opt = (make(m, OPT.to_optax(), wrt=nnx.Param) for m in (g, d))
    grad = fj.nnx.grad if forge else nnx.grad

    @nnx.jit
    def rounds(g, d, g_opt, d_opt):
      for _ in range(3):
        d_opt.update(d, grad(d_loss)(d, g(z)))
        g_opt.update(g, grad(g_loss(d, plain))(g))

    rounds(g, d, g_opt, d_opt)
    return g, d

  with pytest.raises(ValueError, match=r"FORGE layer 'a'.*GAN"):
    train(True, plain=None)
  with pytest.raises(ValueError, match=r"\['a', 'b'\].*plain_gradients"):
    train(True, plain="all")  # the generator too: it would not train
  forge, expected = train(True), train(False)
  for trained, reference in zip(forge, expected):
    assert fj.nnx.wiped_layers(trained) == []
    for name in ("a", "b"):
      np.testing.assert_allclose(
        getattr(trained, name).kernel[...],
        getattr(reference, name).kernel[...],
        rtol=1e-5,
        atol=1e-6,
      )


def test_misuse_raises(seed):
  model, (x, y) = _mlp(seed)
  with pytest.raises(ValueError, match="selects FORGE's variables"):
    fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Variable)
  with pytest.raises(ValueError, match="not the optimizer"):
    fj.nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  with pytest.raises(ValueError, match="MultiSteps"):
    fj.nnx.Optimizer(model, optax.MultiSteps(OPT.to_optax(), 2), wrt=nnx.Param)
  # A learning rate of its own for the second layer, by path: its kernel
  # would not follow.
  by_path = lambda state: jax.tree_util.tree_map_with_path(
    lambda path, _: (
      "slow" if 1 in [getattr(k, "key", None) for k in path] else "rest"
    ),
    state,
  )
  groups = {"slow": fj.adamw(1e-3).to_optax(), "rest": OPT.to_optax()}
  with pytest.raises(ValueError, match=r"\['layers/1'\] by another rule"):
    fj.nnx.Optimizer(
      model, optax.multi_transform(groups, by_path), wrt=nnx.Param
    )
  # Driven by update(..., value=loss), it would slow the other parameters
  # alone.
  plateau = optax.chain(OPT.to_optax(), optax.contrib.reduce_on_plateau())
  with pytest.raises(ValueError, match="reduce_on_plateau"):
    fj.nnx.Optimizer(model, plateau, wrt=nnx.Param)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), OPT.to_optax())
  with pytest.raises(ValueError, match="max_grad_norm=max_norm"):
    fj.nnx.Optimizer(model, clipped, wrt=nnx.Param)
  with pytest.raises(TypeError, match="elementwise|forge_jax"):
    fj.nnx.Linear(2, 3, optimizer=optax.adam(1e-3), rngs=nnx.Rngs(0))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  # Partial gradients that do not reach the FORGE layers: no install.
  grads = nnx.grad(
    lambda m: sum(jnp.sum(layer.bias[...]) for layer in m.layers)
  )(model)
  with pytest.raises(ValueError, match="fj.nnx.TRAINABLE"):
    optimizer.update(model, grads)
  # A cast kernel would receive the update through the cast.
  kernel = model.layers[0].kernel
  kernel.set_value(kernel.get_value().astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="was expected"):
    model(x)


@pytest.mark.parametrize(
  "opt",
  [
    fj.adamw(1e-2, weight_rounding="stochastic"),
    fj.adamw(1e-2, state_dtype="int8", second_moment_bits=4),
  ],
  ids=["stochastic_weights", "4bit_levels"],
)
def test_stochastic_rounding_needs_a_layer_id(opt, seed):
  model = MLP((6, 4), nnx.Rngs(seed), opt, param_dtype=jnp.bfloat16)
  x = jnp.ones((2, 6), jnp.bfloat16)
  with pytest.raises(ValueError, match="layer_id"):
    model(x)
  # An abstract optimizer (a checkpoint's target) leaves the model as it is.
  abstract = nnx.eval_shape(
    lambda: fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param)
  )
  assert isinstance(abstract, fj.nnx.Optimizer)
  assert model.layers[0].layer_id is None
  fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param)  # numbers them
  assert model.layers[0].layer_id == fj.quantization.layer_id_from_path(
    ("layers", 0)
  )
  model(x)


def test_nonfinite_step_is_skipped_and_counted(seed):
  """NaN in one input: every layer skips the step whole (kernel and state
  bit for bit, count not advanced, skipped = kernel size)."""
  model, (x, y) = _mlp(seed)
  # fj.nnx.Optimizer refuses apply_if_finite (a whole-gradient rule); it
  # keeps the biases finite here, and fj.nnx.install FORGE's variables.
  optimizer = nnx.Optimizer(
    model,
    optax.apply_if_finite(OPT.to_optax(), max_consecutive_errors=3),
    wrt=nnx.Param,
  )

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(cross_entropy, argnums=WRT)(model, x, y)
    fj.nnx.install(model, grads)
    optimizer.update(model, grads)
    return loss

  step(model, optimizer, x, y)
  before = forge_values(model)
  assert np.isnan(step(model, optimizer, poison(x, np.s_[1, 2]), y))
  after = forge_values(model)
  for i, layer in enumerate(before["layers"].values()):
    new = after["layers"][i]
    for a, b in zip(
      jax.tree.leaves((new["kernel"], new["opt_state"])),
      jax.tree.leaves((layer["kernel"], layer["opt_state"])),
    ):
      assert_bitwise_equal(a, b, f"layers[{i}]")
    assert float(new["count"]) == 1.0
    assert float(new["skipped"]) == layer["kernel"].size
  step(model, optimizer, x, y)
  assert float(model.layers[0].count[...]) == 2.0
  assert float(model.layers[0].skipped[...]) == 0.0


# ---------------------------------------------------------------------------
# fj.nnx.scan over stacked layers.


class Block(nnx.Module):
  def __init__(self, dim, hidden, rngs, optimizer=None, **kwargs):
    linear = nnx.Linear
    if optimizer is not None:
      linear = lambda *a, **k: fj.nnx.Linear(*a, optimizer=optimizer, **k)
    self.up = linear(dim, hidden, rngs=rngs, **kwargs)
    self.down = linear(hidden, dim, rngs=rngs, **kwargs)
    self.scale = nnx.Param(jnp.ones((dim,)))

  def __call__(self, x, shift):
    return x + self.down(nnx.gelu(self.up(x * self.scale[...] + shift)))


class Stack(nnx.Module):
  """Layers made with nnx.vmap, scanned as in the Flax NNX examples."""

  def __init__(
    self, layers, dim, hidden, rngs, scan=nnx.scan, remat=True, **kwargs
  ):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(dim, hidden, rngs, **kwargs)

    self.blocks = make(rngs)
    self.shift = nnx.Param(jnp.zeros((dim,)))
    self.head = nnx.Linear(dim, CLASSES, rngs=rngs)
    self.scan, self.remat = scan, remat

  def __call__(self, x):
    call = lambda block, x, shift: block(x, shift)
    if self.remat:
      call = nnx.remat(call)

    @self.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
    def forward(x, block, shift):
      return call(block, x, shift)

    return self.head(forward(x, self.blocks, self.shift[...]))


def _stack_values(model):
  return {
    name: np.asarray(getattr(model.blocks, name).kernel[...])
    for name in ("up", "down")
  } | {
    "scale": np.asarray(model.blocks.scale[...]),
    "shift": np.asarray(model.shift[...]),
  }


def _train_stacks_alike(model, optimizer, ref, ref_optimizer, steps, seed):
  """``steps`` steps of the FORGE Stack and of its nnx.scan twin on the
  same batches: the same losses, and the same stacks after them."""
  step, ref_step = forge_step(), reference_step()
  for x, y in make_batches(seed, steps, (10, 8), CLASSES):
    np.testing.assert_allclose(
      step(model, optimizer, x, y), ref_step(ref, ref_optimizer, x, y), 1e-6
    )
  ours, theirs = _stack_values(model), _stack_values(ref)
  for name in theirs:
    assert_rel_close(ours[name], theirs[name], RTOL, name)


@pytest.mark.parametrize(
  "remat",
  [True, pytest.param(False, marks=pytest.mark.slow)],
  ids=["remat", "no-remat"],
)
def test_scan_trains_like_nnx_scan_and_optax(remat, seed):
  """fj.nnx.scan over fj.nnx.Linear follows nnx.scan over nnx.Linear +
  the optax alias (the broadcast argument gets its summed gradient)."""
  model = Stack(3, 8, 16, nnx.Rngs(seed), fj.nnx.scan, remat, optimizer=OPT)
  ref = Stack(3, 8, 16, nnx.Rngs(seed), nnx.scan, remat)
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  ref_optimizer = nnx.Optimizer(
    ref, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param
  )
  _train_stacks_alike(model, optimizer, ref, ref_optimizer, 4, seed)
  np.testing.assert_array_equal(model.blocks.up.count[...], [4.0] * 3)
  assert optimizer.unreached_layers() == []


def test_optimizer_asks_a_decay_mask_by_rank_at_the_stacks_rank(seed):
  """Stacked Linears' kernels have three dimensions, as nnx.Linear's made
  by nnx.vmap do: a weight-decay mask that decays rank-2 leaves only (on
  the layers' optimizer or on tx) leaves them undecayed under nnx.Linear
  + optax while FORGE decays them: refused, naming them. A mask by rank
  that decays them trains as nnx.scan over nnx.Linear + optax."""
  rank_two = lambda p: jax.tree.map(lambda a: jnp.ndim(a) == 2, p)
  opt = fj.adamw(1e-2, weight_decay=0.1, mask=rank_two)
  for optimizer, tx in (
    (opt, opt.to_optax()),
    (OPT, optax.adamw(1e-2, weight_decay=0.1, mask=rank_two)),
  ):
    model = Stack(3, 8, 16, nnx.Rngs(seed), fj.nnx.scan, optimizer=optimizer)
    with pytest.raises(ValueError, match=r"mask leaves out.*'blocks/down'"):
      fj.nnx.Optimizer(model, tx, wrt=nnx.Param)

  by_rank = lambda p: jax.tree.map(lambda a: jnp.ndim(a) > 1, p)
  tx = optax.adamw(1e-2, weight_decay=0.1, mask=by_rank)
  model = Stack(3, 8, 16, nnx.Rngs(seed), fj.nnx.scan, optimizer=OPT)
  ref = Stack(3, 8, 16, nnx.Rngs(seed), nnx.scan)
  optimizer = fj.nnx.Optimizer(model, tx, wrt=nnx.Param)
  ref_optimizer = nnx.Optimizer(ref, tx, wrt=nnx.Param)
  _train_stacks_alike(model, optimizer, ref, ref_optimizer, 3, seed)


def test_plain_gradients_give_nnx_linear_input_gradients(seed):
  """Under fj.plain_gradients() the gradient with respect to the input,
  through fj.nnx.scan over fj.nnx.Linear, is nnx.scan over nnx.Linear's.
  Outside it, such a gradient through an unscanned fj.nnx.Linear raises
  and names it."""
  model = Stack(3, 8, 16, nnx.Rngs(seed), fj.nnx.scan, True, optimizer=OPT)
  ref = Stack(3, 8, 16, nnx.Rngs(seed), nnx.scan, True)
  x, y = make_batches(seed, 1, (10, 8), CLASSES)[0]
  input_grad = nnx.jit(nnx.grad(cross_entropy, argnums=1))
  with fj.plain_gradients():
    dx = input_grad(model, x, y)
  assert_rel_close(dx, input_grad(ref, x, y), 1e-6, "dx")
  mlp, (x, y) = _mlp(seed)
  with pytest.raises(ValueError, match="fj.plain_gradients"):
    input_grad(mlp, x, y)
  with fj.plain_gradients():
    assert np.all(np.isfinite(input_grad(mlp, x, y)))


def test_a_differentiated_backward_raises(seed):
  """A Hessian-vector product (jax.jvp of jax.grad) differentiates FORGE's
  backward, whose kernel entry is the updated kernel: it raises, naming
  the layer, instead of returning the derivative of the update. Under
  fj.plain_gradients() it is nnx.Linear's."""
  model, (x, y) = _mlp(seed)
  fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)  # names the layers
  ref = MLP((6, 8, 4), nnx.Rngs(seed))

  def hvp(model, diff):
    graphdef, state, rest = nnx.split(model, diff, ...)
    loss = lambda state: cross_entropy(nnx.merge(graphdef, state, rest), x, y)
    ones = jax.tree.map(jnp.ones_like, state)
    # One program (eager, every op of the product compiles on its own).
    return jax.jit(lambda s, t: jax.jvp(jax.grad(loss), (s,), (t,))[1])(
      state, ones
    )

  with pytest.raises(ValueError, match="'layers/1'.*backward pass is being"):
    hvp(model, fj.nnx.TRAINABLE)
  with fj.plain_gradients():
    ours = hvp(model, fj.nnx.TRAINABLE)
  theirs = hvp(ref, nnx.Param)
  for i in (0, 1):
    for name in ("kernel", "bias"):
      assert_rel_close(
        ours["layers"][i][name][...],
        theirs["layers"][i][name][...],
        1e-5,
        f"layers/{i}/{name}",
      )


def test_scan_steps_as_nnx_scan_bit_for_bit(seed):
  """int8 states and stochastic rounding: fj.nnx.scan's in-place stacked
  steps (each layer by its index) are nnx.scan's sliced steps, bit for
  bit."""
  opt = fj.adamw(1e-2, state_dtype="int8", weight_rounding="stochastic")
  kwargs = dict(optimizer=opt, param_dtype=jnp.bfloat16, implementation="xla")
  models = [
    Stack(2, 16, 64, nnx.Rngs(seed), scan, True, **kwargs)
    for scan in (fj.nnx.scan, nnx.scan)
  ]
  optimizers = [
    fj.nnx.Optimizer(m, opt.to_optax(), wrt=nnx.Param) for m in models
  ]
  step = forge_step()
  for x, y in make_batches(seed, 2, (8, 16), CLASSES):
    losses = [step(m, o, x, y) for m, o in zip(models, optimizers)]
    assert_bitwise_equal(losses[0], losses[1], "loss")
  for a, b in zip(*(jax.tree.leaves(forge_values(m)) for m in models)):
    assert_bitwise_equal(a, b, "FORGE's variables")


def test_scan_refuses_what_it_cannot_honor(seed):
  with pytest.raises(ValueError, match="in_axes"):
    fj.nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 1))
  with pytest.raises(ValueError, match="out_axes"):
    fj.nnx.scan(lambda x, b: b(x), out_axes=(nnx.Carry, 0))

  class Noisy(nnx.Module):
    def __init__(self, rngs):
      self.fc = fj.nnx.Linear(4, 4, optimizer=OPT, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.dropout(self.fc(x))

  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Noisy(rngs)

  stack = make(nnx.Rngs(seed, dropout=seed))
  forward = fj.nnx.scan(lambda x, block: block(x))
  with pytest.raises(NotImplementedError, match="changes its variables"):
    nnx.grad(lambda s: forward(jnp.ones((2, 4)), s).sum(), argnums=WRT)(stack)
  # Outside a gradient too: the rng counts (or batch statistics) a block
  # changes would be dropped, each call drawing the same masks.
  with pytest.raises(NotImplementedError, match="changes its variables"):
    forward(jnp.ones((2, 4)), stack)

  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make_normed(rngs):
    return nnx.Sequential(
      fj.nnx.Linear(4, 4, optimizer=OPT, rngs=rngs),
      nnx.BatchNorm(4, use_running_average=False, rngs=rngs),
    )

  with pytest.raises(NotImplementedError, match="changes its variables"):
    forward(jnp.ones((2, 4)), make_normed(nnx.Rngs(seed)))


def test_scan_names_a_layer_shared_across_the_stack(seed):
  """A Linear outside the stack, called in the block (a broadcast argument
  or closed over), would share its kernel across the layers: its gradient
  is refused as such, not as a stack used inside its block. Inference
  runs it, and through a shared nnx.Linear the stack differentiates."""
  stack = Stack(3, 8, 16, nnx.Rngs(seed), fj.nnx.scan, optimizer=OPT)
  x = jnp.ones((2, 8))
  for shared in (
    fj.nnx.Linear(8, 8, optimizer=OPT, rngs=nnx.Rngs(seed)),
    nnx.Linear(8, 8, rngs=nnx.Rngs(seed)),
  ):
    passed = fj.nnx.scan(
      lambda x, block, linear: linear(block(x, 0.0)),
      in_axes=(nnx.Carry, 0, None),
    )
    closed = fj.nnx.scan(lambda x, block: shared(block(x, 0.0)))
    for forward in (
      lambda blocks: passed(x, blocks, shared),
      lambda blocks: closed(x, blocks),
    ):
      assert forward(stack.blocks).shape == x.shape
      loss = lambda blocks: forward(blocks).sum()
      if isinstance(shared, fj.nnx.Linear):
        with pytest.raises(TypeError, match="not one of the scanned layers"):
          nnx.grad(loss, argnums=WRT)(stack.blocks)
      else:
        grads = nnx.grad(loss, argnums=WRT)(stack.blocks)
        assert np.all(np.isfinite(grads["scale"][...]))


def _compiled(model, optimizer, x, y):
  """The donated, jitted train step of ``(model, optimizer)``, compiled."""
  graphdef, state = nnx.split((model, optimizer))
  forge = model.blocks.up.__class__ is fj.nnx.Linear
  wrt = WRT if forge else 0

  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(cross_entropy, argnums=wrt)(model, x, y)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  return jax.jit(step, donate_argnums=0).lower(state, x, y).compile()


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_scan_temp_memory_grows_with_activations_not_layers(seed):
  """Doubling the depth: nnx.scan + optax holds every layer's stacked
  gradient (temp grows by the added kernel bytes); fj.nnx.scan steps the
  stacks in place (temp grows by the activations only, a small fraction
  of the kernels here), and aliases every donated FORGE variable."""
  dim, hidden, batch = 128, 512, (16, 128)
  rows = {}
  for layers in (2, 4):
    for forge in (True, False):
      kwargs = dict(optimizer=OPT, implementation="xla") if forge else {}
      scan = fj.nnx.scan if forge else nnx.scan
      model = Stack(layers, dim, hidden, nnx.Rngs(seed), scan, **kwargs)
      optimizer = (fj.nnx.Optimizer if forge else nnx.Optimizer)(
        model, OPT.to_optax(), wrt=nnx.Param
      )
      x, y = make_batch(seed, batch, CLASSES)
      memory = _compiled(model, optimizer, x, y).memory_analysis()
      kernels = _nbytes(
        [model.blocks.up.kernel[...], model.blocks.down.kernel[...]]
      )
      rows[layers, forge] = (memory, kernels, forge_values(model))
  kernel_growth = rows[4, True][1] - rows[2, True][1]
  growth = {
    forge: rows[4, forge][0].temp_size_in_bytes
    - rows[2, forge][0].temp_size_in_bytes
    for forge in (True, False)
  }
  assert growth[False] >= 0.9 * kernel_growth, (growth, kernel_growth)
  assert growth[True] <= 0.1 * kernel_growth, (growth, kernel_growth)
  for layers in (2, 4):
    memory, _, forge = rows[layers, True]
    assert memory.alias_size_in_bytes >= _nbytes(forge)


# ---------------------------------------------------------------------------
# Checkpoints, as NNX users write them.


def test_orbax_checkpoint_resumes_bit_for_bit(tmp_path, seed):
  """``nnx.state((model, optimizer))`` saved with orbax, restored into
  ``nnx.eval_shape``'s abstract state: the resumed run takes exactly the
  steps of the uninterrupted one (bf16 + stochastic rounding, int8
  states: every bit of count, codes and scales came back)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  opt = fj.adamw(1e-2, state_dtype="int8", weight_rounding="stochastic")

  def create():
    model = MLP(
      (64, 64, CLASSES),
      nnx.Rngs(seed),
      opt,
      implementation="xla",
      param_dtype=jnp.bfloat16,
    )
    return model, fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param)

  model, optimizer = create()
  batches = make_batches(seed, 4, (16, 64), CLASSES)
  step = forge_step()
  for batch in batches[:2]:
    step(model, optimizer, *batch)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "step_2", nnx.state((model, optimizer)))
  checkpointer.wait_until_finished()
  for batch in batches[2:]:
    step(model, optimizer, *batch)

  graphdef, abstract = nnx.split(nnx.eval_shape(create))
  restored = checkpointer.restore(tmp_path / "step_2", abstract)
  resumed_model, resumed_optimizer = nnx.merge(graphdef, restored)
  assert float(resumed_model.layers[0].count[...]) == 2.0
  for batch in batches[2:]:
    step(resumed_model, resumed_optimizer, *batch)
  expected = nnx.to_pure_dict(nnx.state((model, optimizer)))
  actual = nnx.to_pure_dict(nnx.state((resumed_model, resumed_optimizer)))
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert_bitwise_equal(a, b, "resumed state")


def test_readme_nnx_section_runs_and_trains():
  """The README's Flax NNX example (after its quickstart, whose imports
  and optimizer it uses) trains as written."""
  readme = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")
  with open(readme) as f:
    text = f.read()
  blocks = [
    re.search(r"```python\n(.*?)```", text[text.index(title) :], re.S).group(1)
    for title in ("## Quickstart", "## Flax NNX")
  ]
  scope = {}
  for block in blocks:
    exec(compile(block, "README", "exec"), scope)  # pylint: disable=exec-used
  model, optimizer = scope["model"], scope["optimizer"]
  x = jax.random.normal(jax.random.key(0), (8, 784))
  y = jax.random.normal(jax.random.key(1), (8, 10))
  losses = [float(scope["nnx_step"](model, optimizer, x, y)) for _ in range(3)]
  assert losses[-1] < losses[0]
  assert float(model.fc1.count[...]) == 3.0


# ---------------------------------------------------------------------------
# An NNX Llama-style model against the Linen one (examples/lm/llama.py).


class RMSNorm(nnx.Module):
  def __init__(self, dim, eps):
    self.scale = nnx.Param(jnp.ones((dim,)))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(
      jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps
    )
    return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class LlamaBlock(nnx.Module):
  """llama.Block in NNX: the same projections, names and operations."""

  def __init__(self, c: llama.LlamaConfig, rngs):
    def dense(i, o):
      return fj.nnx.Linear(
        i,
        o,
        optimizer=c.forge_optimizer,
        implementation=c.implementation,
        use_bias=False,
        rngs=rngs,
      )

    self.c = c
    self.attn_norm = RMSNorm(c.dim, c.norm_eps)
    self.mlp_norm = RMSNorm(c.dim, c.norm_eps)
    heads, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    self.q_proj, self.k_proj = dense(c.dim, heads), dense(c.dim, kv)
    self.v_proj, self.o_proj = dense(c.dim, kv), dense(heads, c.dim)
    self.gate_proj = dense(c.dim, c.ffn_dim)
    self.up_proj = dense(c.dim, c.ffn_dim)
    self.down_proj = dense(c.ffn_dim, c.dim)

  def __call__(self, x, cos, sin):
    c = self.c
    b, t, _ = x.shape
    h = self.attn_norm(x)
    q = self.q_proj(h).reshape(b, t, c.num_heads, c.head_dim)
    k = self.k_proj(h).reshape(b, t, c.num_kv_heads, c.head_dim)
    v = self.v_proj(h).reshape(b, t, c.num_kv_heads, c.head_dim)
    q, k = llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin)
    out = jax.nn.dot_product_attention(q, k, v.astype(q.dtype), is_causal=True)
    x = x + self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim))
    h = self.mlp_norm(x)
    return x + self.down_proj(nnx.silu(self.gate_proj(h)) * self.up_proj(h))


class NNXLlama(nnx.Module):
  def __init__(self, c: llama.LlamaConfig, rngs):
    self.c = c
    self.embed = nnx.Embed(
      c.vocab_size,
      c.dim,
      embedding_init=nnx.initializers.normal(stddev=0.02),
      rngs=rngs,
    )
    if c.scan_layers:

      @nnx.split_rngs(splits=c.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return LlamaBlock(c, rngs)

      self.layers = make(rngs)
    else:
      self.layers = nnx.List([LlamaBlock(c, rngs) for _ in range(c.num_layers)])
    self.norm = RMSNorm(c.dim, c.norm_eps)
    self.lm_head = fj.nnx.Linear(
      c.dim,
      c.vocab_size,
      optimizer=c.forge_optimizer,
      implementation=c.implementation,
      use_bias=False,
      rngs=rngs,
    )

  def __call__(self, tokens):
    x = self.embed(tokens)
    cos, sin = llama.rope_tables(self.c, tokens.shape[-1])
    if self.c.scan_layers:

      @fj.nnx.scan(in_axes=(nnx.Carry, 0, None, None))
      def forward(x, block, cos, sin):
        return nnx.remat(lambda b, x: b(x, cos, sin))(block, x)

      x = forward(x, self.layers, cos, sin)
    else:
      for block in self.layers:
        x = block(x, cos, sin)
    return self.lm_head(self.norm(x)).astype(jnp.float32)


def _load_linen(model: NNXLlama, variables):
  """The Linen model's weights into the NNX one (the same names)."""
  params, forge = variables["params"], variables[fj.FORGE_COLLECTION]
  scanned = model.c.scan_layers
  model.embed.embedding[...] = params["embed"]["embedding"]
  model.norm.scale[...] = params["norm"]["scale"]
  model.lm_head.kernel[...] = forge["lm_head"]["kernel"]
  blocks = [model.layers] if scanned else list(model.layers)
  for i, block in enumerate(blocks):
    name = "layers" if scanned else f"layers_{i}"
    for norm in ("attn_norm", "mlp_norm"):
      getattr(block, norm).scale[...] = params[name][norm]["scale"]
    for part, projections in (
      ("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
      ("mlp", ("gate_proj", "up_proj", "down_proj")),
    ):
      for projection in projections:
        getattr(block, projection).kernel[...] = forge[name][part][projection][
          "kernel"
        ]


# Slow (CI time): the NNX layers, scan and optimizer it is made of are
# checked bit for bit against the Linen ones by the default tests above.
@pytest.mark.slow
@pytest.mark.parametrize(
  "scan_layers", [False, True], ids=["unrolled", "scanned"]
)
def test_llama_matches_the_linen_model(scan_layers, seed):
  """Same weights, same batches: the NNX Llama-style model (fj.nnx.Linear,
  fj.nnx.Optimizer) takes the Linen model's (ForgeDense, fj.TrainState)
  losses and kernels, step by step."""
  config = dataclasses.replace(
    llama.CONFIGS["tiny"],
    forge_optimizer=OPT,
    implementation="xla",
    scan_layers=scan_layers,
    remat=scan_layers,
  )
  tokens = jax.random.randint(jax.random.key(seed), (4, 3, 17), 0, 256)
  linen_model = llama.Llama(config)
  state = train_lib.create_train_state(
    linen_model, OPT.to_optax(), jax.random.key(seed), tokens[0]
  )
  model = NNXLlama(config, nnx.Rngs(seed))
  _load_linen(model, state.params)
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  linen_step = train_lib.make_train_step(donate=False)

  def loss_fn(model, batch):
    return train_lib.cross_entropy(model(batch[:, :-1]), batch[:, 1:])

  step = forge_step(loss_fn)
  for batch in tokens:
    state, linen_loss = linen_step(state, batch)
    np.testing.assert_allclose(step(model, optimizer, batch), linen_loss, 1e-6)
  theirs = llama.kernels(state.params)
  ours = model.lm_head.kernel[...]
  assert_rel_close(ours, theirs["lm_head"], RTOL, "lm_head")
  name = "layers" if scan_layers else "layers_0"
  block = model.layers if scan_layers else model.layers[0]
  assert_rel_close(
    block.down_proj.kernel[...], theirs[f"{name}/mlp/down_proj"], RTOL, "down"
  )


# ---------------------------------------------------------------------------
# Tensor parallelism through nnx.with_partitioning.


INT8 = fj.adamw(1e-2, state_dtype="int8")


class Megatron(nnx.Module):
  """Column-parallel up, row-parallel down (partitioned or not), int8
  states."""

  def __init__(self, rngs, partitioned):
    init = nnx.initializers.lecun_normal()
    shard = lambda names: (
      nnx.with_partitioning(init, names) if partitioned else init
    )
    self.up = fj.nnx.Linear(
      8, 256, optimizer=INT8, kernel_init=shard((None, "model")), rngs=rngs
    )
    self.down = fj.nnx.Linear(
      256, 4, optimizer=INT8, kernel_init=shard(("model", None)), rngs=rngs
    )

  def __call__(self, x):
    return self.down(nnx.gelu(self.up(x)))


@pytest.mark.slow  # the fused op's tensor parallelism runs by default (Linen)
@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_tensor_parallel_matches_one_device(seed):
  """``nnx.with_partitioning`` kernels train per shard as on one device;
  every optimizer state leaf is sharded like its kernel (int8 block scales
  included), and so are the updated ones."""
  mesh = fj.parallel.make_mesh(model=2)
  with jax.set_mesh(mesh):
    model = Megatron(nnx.Rngs(seed), partitioned=True)
    optimizer = fj.nnx.Optimizer(model, INT8.to_optax(), wrt=nnx.Param)
  ref = Megatron(nnx.Rngs(seed), partitioned=False)
  ref_optimizer = fj.nnx.Optimizer(ref, INT8.to_optax(), wrt=nnx.Param)
  step = forge_step()
  for x, y in make_batches(seed, 2, (6, 8), 4):
    with jax.set_mesh(mesh):
      loss = step(model, optimizer, x, y)
    np.testing.assert_allclose(loss, step(ref, ref_optimizer, x, y), 1e-6)
  for name, spec in (("up", P(None, "model")), ("down", P("model", None))):
    layer = getattr(model, name)
    leaves = jax.tree.leaves(
      nnx.to_pure_dict(nnx.state(layer, fj.nnx.OverwriteWithGradient))
    )
    for leaf in leaves:
      if leaf.ndim == 2:  # the kernel, the int8 codes and block scales
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    assert_rel_close(
      layer.kernel[...], getattr(ref, name).kernel[...], RTOL, name
    )
    assert sum(leaf.ndim == 2 for leaf in leaves) == 5


def test_int8_column_shards_must_hold_whole_blocks():
  """A kernel whose columns are sharded into shards narrower than an int8
  block: refused at construction with what to change, as ForgeDense does,
  instead of JAX's error for the block scales' sharding."""
  mesh = fj.parallel.make_mesh(model=2)
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="multiple of the int8 block size"):
      fj.nnx.Linear(8, 8, optimizer=INT8, kernel_init=init, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  "scanned",
  # The scanned stacks' norms by default; unstacked ForgeDense layers' in
  # test_clipping.py.
  [pytest.param(False, marks=pytest.mark.slow), True],
  ids=["mlp", "fj.nnx.scan"],
)
def test_global_norm_is_optax_global_norm_of_the_gradient(scanned, seed):
  """fj.nnx.global_norm of FORGE's grads (each layer's grad_sq_norm, the
  other gradients) equals optax.global_norm of the nnx.Linear model's."""
  rngs = lambda: nnx.Rngs(seed)
  if scanned:
    model = Stack(3, 8, 16, rngs(), fj.nnx.scan, optimizer=OPT)
    ref = Stack(3, 8, 16, rngs(), nnx.scan)
    shape = (10, 8)
  else:
    model = MLP((6, 8, 4), rngs(), optimizer=OPT)
    ref = MLP((6, 8, 4), rngs())
    shape = (10, 6)
  ((x, y),) = make_batches(seed, 1, shape, 4 if not scanned else CLASSES)
  grads = fj.nnx.grad(cross_entropy)(model, x, y)
  ref_grads = nnx.grad(cross_entropy)(ref, x, y)
  np.testing.assert_allclose(
    fj.nnx.global_norm(grads), optax.tree.norm(ref_grads), rtol=1e-6
  )


class FrozenBody(nnx.Module):
  """An nnx.Linear body, left out of ``wrt``, under FORGE's head."""

  def __init__(self, rngs, optimizer=None):
    self.body = nnx.Linear(6, 8, rngs=rngs)
    self.head = MLP((8, 4), rngs, optimizer)

  def __call__(self, x):
    return self.head(nnx.gelu(self.body(x)))


def test_the_norm_is_over_the_variables_wrt_selects(seed):
  """Grads of every nnx.Param, installed by an optimizer whose ``wrt``
  leaves the body out: ``grad_norm`` is over what it steps, as
  clip_by_global_norm in nnx.Optimizer's tx measures it."""
  wrt = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("body")))
  model = FrozenBody(nnx.Rngs(seed), OPT)
  ref = FrozenBody(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=wrt)
  ((x, y),) = make_batches(seed, 1, (10, 6), 4)

  @nnx.jit
  def step(model, optimizer):
    optimizer.update(model, fj.nnx.grad(cross_entropy)(model, x, y))

  ref_grad = nnx.jit(nnx.grad(cross_entropy, argnums=nnx.DiffState(0, wrt)))
  step(model, optimizer)
  np.testing.assert_allclose(
    optimizer.grad_norm[...], optax.tree.norm(ref_grad(ref, x, y)), rtol=1e-6
  )


# ---------------------------------------------------------------------------
# Global-norm clipping: fj.nnx.Optimizer(..., max_grad_norm=c).


class Normed(nnx.Module):
  """BatchNorm on the input, an MLP, dropout: a model whose forward
  changes its other variables (batch statistics, rng counts)."""

  def __init__(self, rngs, optimizer=None):
    self.norm = nnx.BatchNorm(6, rngs=rngs)
    self.mlp = MLP((6, 16, 16, 4), rngs, optimizer)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)

  def __call__(self, x):
    return self.dropout(self.mlp(self.norm(x)))


# One program for both cases (eager, every op of the gradient compiles on
# its own).
_gradient_norm = nnx.jit(
  lambda model, x, y: optax.tree.norm(nnx.grad(cross_entropy)(model, x, y))
)


@pytest.mark.parametrize("clip", ["exact", "delayed"])
def test_clipping_matches_clip_by_global_norm(clip, seed):
  """``max_grad_norm=c`` trains as nnx.Linear + ``optax.chain(
  clip_by_global_norm(c), tx)`` ('exact'), or with each gradient scaled by
  ``min(1, c / ||g_prev||)`` ('delayed'); ``grad_norm`` is the unclipped
  norm, and the batch statistics and dropout masks follow nnx's."""
  model = Normed(nnx.Rngs(seed), OPT)
  ref = Normed(nnx.Rngs(seed))
  batches = make_batches(seed, 4, (10, 6), 4)
  max_norm = 0.5 * float(_gradient_norm(Normed(nnx.Rngs(seed)), *batches[0]))
  optimizer = fj.nnx.Optimizer(
    model, OPT.to_optax(), wrt=nnx.Param, max_grad_norm=max_norm, clip=clip
  )
  alias = optax.adamw(1e-2, weight_decay=0.1)
  if clip == "exact":
    alias = optax.chain(optax.clip_by_global_norm(max_norm), alias)
  ref_optimizer = nnx.Optimizer(ref, alias, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss_fn = lambda m: cross_entropy(m, x, y)
    loss, grads = optimizer.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def ref_step(model, optimizer, x, y, scale):
    loss, grads = nnx.value_and_grad(cross_entropy)(model, x, y)
    scaled = jax.tree.map(lambda g: g * scale, grads)
    optimizer.update(model, scaled)
    return loss, optax.tree.norm(grads)

  previous = None
  for number, (x, y) in enumerate(batches):
    scale = 1.0
    if clip == "delayed" and previous is not None and previous >= max_norm:
      scale = max_norm / previous
    loss = step(model, optimizer, x, y)
    ref_loss, norm = ref_step(ref, ref_optimizer, x, y, scale)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(optimizer.grad_norm[...], norm, rtol=1e-5)
    ours, theirs = kernels_and_biases(model), kernels_and_biases(ref)
    for name in theirs:
      assert_rel_close(ours[name], theirs[name], 1e-5, f"{number} {name}")
    np.testing.assert_allclose(
      model.norm.mean[...], ref.norm.mean[...], rtol=1e-6
    )
    previous = float(norm)
  assert previous is not None and float(optimizer.grad_norm[...]) > max_norm


def test_untracked_norm_trains_alike_without_the_norm(seed):
  """``track_grad_norm=False``: the same model bit for bit, no
  ``grad_norm``, and an update with no root in it (plain SGD has none)."""
  opt = fj.sgd(0.1)
  models = [MLP((6, 16, 4), nnx.Rngs(seed), opt) for _ in range(2)]
  optimizers = [
    fj.nnx.Optimizer(m, opt.to_optax(), wrt=nnx.Param, track_grad_norm=t)
    for m, t in zip(models, (True, False))
  ]
  assert optimizers[1].grad_norm is None

  def step(model, optimizer, x, y):
    grads = fj.nnx.grad(cross_entropy)(model, x, y)
    optimizer.update(model, grads)

  x, y = make_batches(seed, 1, (10, 6), 4)[0]
  for model, optimizer, roots in zip(models, optimizers, (1, 0)):
    graphdef, state = nnx.split((model, optimizer))

    def pure(state, x, y):
      model, optimizer = nnx.merge(graphdef, state)
      step(model, optimizer, x, y)
      return nnx.state((model, optimizer))

    assert str(jax.make_jaxpr(pure)(state, x, y)).count("sqrt") == roots
  for x, y in make_batches(seed, 3, (10, 6), 4):
    for model, optimizer in zip(models, optimizers):
      nnx.jit(step)(model, optimizer, x, y)
  assert optimizers[1].grad_norm is None
  assert_same_bits(
    nnx.state(models[1]), nnx.state(models[0]), "the untracked model"
  )


def test_clipping_needs_the_norm_tracked(seed):
  model = MLP((6, 16, 4), nnx.Rngs(seed), OPT)
  with pytest.raises(ValueError, match="clipping needs the global"):
    fj.nnx.Optimizer(
      model,
      OPT.to_optax(),
      wrt=nnx.Param,
      max_grad_norm=1.0,
      track_grad_norm=False,
    )
  optimizer = fj.nnx.Optimizer(
    model, OPT.to_optax(), wrt=nnx.Param, track_grad_norm=False
  )
  optimizer.max_grad_norm = 1.0  # set after construction
  x, y = make_batches(seed, 1, (10, 6), 4)[0]
  grads = fj.nnx.grad(cross_entropy)(model, x, y)
  with pytest.raises(ValueError, match="clipping needs the global"):
    optimizer.update(model, grads)


def test_clipping_through_fj_nnx_scan(seed):
  """The stacks of fj.nnx.scan step clipped as nnx.scan + optax.chain."""
  model = Stack(3, 8, 16, nnx.Rngs(seed), fj.nnx.scan, optimizer=OPT)
  ref = Stack(3, 8, 16, nnx.Rngs(seed), nnx.scan)
  batches = make_batches(seed, 3, (10, 8), CLASSES)
  max_norm = 0.05
  optimizer = fj.nnx.Optimizer(
    model, OPT.to_optax(), wrt=nnx.Param, max_grad_norm=max_norm
  )
  ref_optimizer = nnx.Optimizer(
    ref,
    optax.chain(
      optax.clip_by_global_norm(max_norm),
      optax.adamw(1e-2, weight_decay=0.1),
    ),
    wrt=nnx.Param,
  )

  @nnx.jit
  def step(model, optimizer, x, y):
    grads = optimizer.value_and_grad(cross_entropy)(model, x, y)[1]
    optimizer.update(model, grads)

  for x, y in batches:
    step(model, optimizer, x, y)
    reference_step()(ref, ref_optimizer, x, y)
    assert float(optimizer.grad_norm[...]) > max_norm
  ours, theirs = _stack_values(model), _stack_values(ref)
  for name in theirs:
    assert_rel_close(ours[name], theirs[name], 1e-5, name)


class CallDropout(nnx.Module):
  """An MLP whose dropout draws from the ``rngs`` it is called with."""

  def __init__(self, rngs, optimizer=None):
    self.mlp = MLP((6, 16, 4), rngs, optimizer)
    self.dropout = nnx.Dropout(0.25)

  def __call__(self, x, rngs):
    return self.dropout(self.mlp(x), rngs=rngs)


def test_clipping_takes_graph_nodes_among_the_loss_arguments(seed):
  """An ``nnx.Rngs`` passed to the loss (dropout drawn at call time) takes
  the forward's updates as with nnx.value_and_grad: the masks, rng counts
  and clipped steps follow nnx.Linear + ``optax.chain(clip_by_global_norm,
  tx)``."""
  model, ref = CallDropout(nnx.Rngs(seed), OPT), CallDropout(nnx.Rngs(seed))
  rngs, ref_rngs = nnx.Rngs(dropout=seed), nnx.Rngs(dropout=seed)
  max_norm = 0.05
  optimizer = fj.nnx.Optimizer(
    model, OPT.to_optax(), wrt=nnx.Param, max_grad_norm=max_norm
  )
  ref_optimizer = nnx.Optimizer(
    ref,
    optax.chain(optax.clip_by_global_norm(max_norm), OPTAX_OPT),
    wrt=nnx.Param,
  )

  def loss_fn(model, x, y, rngs):
    logits = model(x, rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @nnx.jit
  def step(model, optimizer, x, y, rngs):
    loss, grads = optimizer.value_and_grad(loss_fn)(model, x, y, rngs)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def ref_step(model, optimizer, x, y, rngs):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y, rngs)
    optimizer.update(model, grads)
    return loss

  for x, y in make_batches(seed, 3, (10, 6), 4):
    np.testing.assert_allclose(
      step(model, optimizer, x, y, rngs),
      ref_step(ref, ref_optimizer, x, y, ref_rngs),
      rtol=1e-6,
    )
    assert float(optimizer.grad_norm[...]) > max_norm
  assert int(rngs.dropout.count[...]) == int(ref_rngs.dropout.count[...]) == 3
  ours, theirs = kernels_and_biases(model), kernels_and_biases(ref)
  for name in theirs:
    assert_rel_close(ours[name], theirs[name], 1e-5, name)


def test_delayed_clipping_refuses_a_gradient_function_made_outside(seed):
  """``optimizer.value_and_grad(loss_fn)`` taken before ``nnx.jit``, from
  the optimizer outside the step, reads that optimizer's norm at trace
  time: 'delayed' would seed every compiled step with it, so it is
  refused. Called eagerly it reads the current norm and trains as the
  gradient function taken inside a jitted step."""
  max_norm = 0.05
  models = [MLP((6, 8, 4), nnx.Rngs(seed), OPT) for _ in range(2)]
  optimizers = [
    fj.nnx.Optimizer(
      m, OPT.to_optax(), wrt=nnx.Param, max_grad_norm=max_norm, clip="delayed"
    )
    for m in models
  ]
  outside = optimizers[0].value_and_grad(cross_entropy)

  @nnx.jit
  def stale_step(model, optimizer, x, y):
    optimizer.update(model, outside(model, x, y)[1])

  @nnx.jit
  def step(model, optimizer, x, y):
    grads = optimizer.value_and_grad(cross_entropy)(model, x, y)[1]
    optimizer.update(model, grads)

  batches = make_batches(seed, 3, (5, 6), 4)
  with pytest.raises(ValueError, match="inside the step"):
    stale_step(models[0], optimizers[0], *batches[0])
  for x, y in batches:
    optimizers[0].update(models[0], outside(models[0], x, y)[1])
    step(models[1], optimizers[1], x, y)
    np.testing.assert_allclose(
      optimizers[0].grad_norm[...], optimizers[1].grad_norm[...], rtol=1e-6
    )
  assert float(optimizers[1].grad_norm[...]) > max_norm
  ours, theirs = kernels_and_biases(models[0]), kernels_and_biases(models[1])
  for name in theirs:
    assert_rel_close(ours[name], theirs[name], 1e-6, name)


def test_clipping_refuses_unclipped_layers(seed):
  """With ``max_grad_norm``, gradients from fj.nnx.value_and_grad (whose
  layers stepped unclipped) are refused; ``clip`` is checked."""
  model, (x, y) = _mlp(seed)
  optimizer = fj.nnx.Optimizer(
    model, OPT.to_optax(), wrt=nnx.Param, max_grad_norm=1.0
  )
  grads = fj.nnx.grad(cross_entropy)(model, x, y)
  with pytest.raises(ValueError, match="optimizer.value_and_grad"):
    optimizer.update(model, grads)
  with pytest.raises(ValueError, match="clip="):
    fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param, clip="late")


# ---------------------------------------------------------------------------
# nnx.bridge between Linen and NNX.


class _Bridged(nn.Module):
  """Two ``nnx.bridge.ToLinen`` layers: ``fj.nnx.Linear`` with
  ``optimizer``, else ``nnx.Linear``."""

  optimizer: object = None

  @nn.compact
  def __call__(self, x):
    if self.optimizer is None:
      linear, kwargs = nnx.Linear, {}
    else:
      linear, kwargs = fj.nnx.Linear, {"optimizer": self.optimizer}
    h = nnx.bridge.ToLinen(linear, args=(6, 8), kwargs=kwargs, name="a")(x)
    return nnx.bridge.ToLinen(linear, args=(8, 4), kwargs=kwargs, name="b")(
      nnx.gelu(h)
    )


def test_linears_bridged_into_linen_train_with_fj_train_state(seed):
  """``nnx.bridge.ToLinen(fj.nnx.Linear)`` keeps the layer's variables in
  FORGE's Linen collection, where ``fj.TrainState`` installs them: the
  steps match ``ToLinen(nnx.Linear)`` + optax."""
  from flax.training.train_state import TrainState  # pylint: disable=import-outside-toplevel

  x, y = make_batch(seed, (4, 6), 4)
  model, reference = _Bridged(OPT), _Bridged()
  variables = model.init(jax.random.key(seed), x)
  assert set(variables) == {"params", fj.FORGE_COLLECTION}
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  expected = TrainState.create(
    apply_fn=reference.apply,
    params=reference.init(jax.random.key(seed), x)["params"],
    tx=optax.adamw(1e-2, weight_decay=0.1),
  )

  @jax.jit
  def step(state):
    loss = lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  @jax.jit
  def flax_step(state):
    loss = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  for _ in range(STEPS):
    state, expected = step(state), flax_step(expected)
  for name in ("a", "b"):
    layer = state.params[fj.FORGE_COLLECTION][name]
    assert float(layer["count"]) == STEPS
    assert_rel_close(layer["kernel"], expected.params[name]["kernel"], RTOL)


class _SgdLayersAB(nn.Module):
  """Linen ForgeDense layers at the paths of :class:`_Bridged`'s, by SGD."""

  @nn.compact
  def __call__(self, x):
    sgd = fj.sgd(0.05, momentum=0.9)
    h = fj.ForgeDense(8, optimizer=sgd, name="a")(x)
    return fj.ForgeDense(4, optimizer=sgd, name="b")(h)


def _bridged_step(model, x, y, tx, **kwargs):
  """The first jitted step of ``model`` with ``fj.TrainState(tx=tx)``."""
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x),
    tx=tx,
    **kwargs,
  )
  loss = lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2)
  return jax.jit(
    lambda state: state.apply_gradients(grads=jax.grad(loss)(state.params))
  )(state)


def test_bridged_linears_are_checked_against_tx_whatever_shares_their_paths(
  seed,
):
  """The install checks ``tx`` against the rule of the bridged
  ``fj.nnx.Linear`` layers (recorded under their own keys, not their Linen
  paths), also after another model's layers at those paths trained by
  another rule in this process: ``tx`` of another rule is refused, the
  layers' own rule trains."""
  x, y = make_batch(seed, (4, 6), 4)
  _bridged_step(_SgdLayersAB(), x, y, fj.sgd(0.05, momentum=0.9).to_optax())
  state = _bridged_step(_Bridged(OPT), x, y, OPT.to_optax())
  assert float(state.params[fj.FORGE_COLLECTION]["a"]["count"]) == 1
  with pytest.raises(ValueError, match="tx is not the optimizer"):
    _bridged_step(_Bridged(OPT), x, y, optax.adamw(2e-2, weight_decay=0.1))


def test_bridged_linears_stepped_unclipped_are_refused(seed):
  """With ``max_grad_norm``, a gradient of the bridged layers taken by
  ``jax.grad`` (unclipped) is refused, as for Linen's layers."""
  x, y = make_batch(seed, (4, 6), 4)
  with pytest.raises(ValueError, match="state.value_and_grad"):
    _bridged_step(_Bridged(OPT), x, y, OPT.to_optax(), max_grad_norm=1.0)


def test_an_optimizer_refuses_a_linen_layer_bridged_into_nnx(seed):
  """``nnx.bridge.ToNNX(fj.ForgeDense)``: no NNX install writes a Linen
  layer's updates, so ``fj.nnx.Optimizer`` refuses it, naming it."""
  x, _ = make_batch(seed, (4, 6), 4)
  model = MLP((6, 8), nnx.Rngs(seed), OPT)
  model.head = nnx.bridge.ToNNX(
    fj.ForgeDense(4, optimizer=OPT), rngs=nnx.Rngs(seed)
  )
  nnx.bridge.lazy_init(model.head, x)
  with pytest.raises(
    ValueError, match=r"\['head'\] belong to no fj.nnx.Linear"
  ):
    fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
