"""Shared fixtures and helpers of the forge_jax test suite (CPU, fast).

* ``MLP``: a tiny MLP whose layers are ``fj.ForgeDense`` or ``nn.Dense`` with
  the same explicit names (``fc1``, ``fc2``, ...), so the two variants load the
  same weights by path and can be compared leaf by leaf.
* ``run_steps``: N jitted, donated ``TrainState`` steps; returns host copies
  of the state after every step, the losses, and what was traced/compiled.
* ``seed``: a fresh random seed per test (distinct per test id; set
  ``FORGE_TEST_SEED`` to shuffle every test's inputs; the seed is printed on
  failure so a failing case can be rerun). ``seed_of`` gives a group of
  tests one seed (fused_dense_test_base: a case id on every backend).
* ``poison``: NaN (or another value) written into chosen elements.
* ``gpu`` marker: skipped unless ``jax.default_backend() == 'gpu'``. On a
  GPU, ``python -m pytest -q -n 6 -m gpu tests/`` runs them; the workers
  share the device (no preallocation).
* ``slow`` marker: skipped unless pytest runs with ``--run-slow``. The
  default run covers every backend, optimizer and storage format at least
  once; ``--run-slow`` adds the exhaustive matrices (every optimizer with
  every dtype on every backend, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import forge_jax as fj
from forge_jax import quantization

# On CPU the suite's time is mostly XLA's compile time (tiny shapes,
# thousands of programs). Optimization level 1 without LLVM's expensive
# passes compiles test_model.py in about two thirds of the CPU time, and
# the tiny programs run about as fast. Level 1 keeps the bits the
# bit-for-bit kernel checks compare (level 0 moves int8 block scales' last
# bits). Set before the backends initialize.
if os.environ.get("JAX_PLATFORMS") == "cpu":
  os.environ["XLA_FLAGS"] = " ".join(
    [
      os.environ.get("XLA_FLAGS", ""),
      "--xla_backend_optimization_level=1",
      "--xla_llvm_disable_expensive_passes=true",
    ]
  ).strip()

# On a GPU, pytest-xdist's workers share the device: without this each
# would preallocate three quarters of its memory and all but the first
# would run out. Set before the backends initialize.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Mosaic GPU's interpret mode runs each simulated warpgroup as a nested CPU
# computation. With one CPU device on a 2-core machine, kernels with four
# warpgroups deadlocked (the epilogue-warpgroup schedule): two warpgroups
# blocked in barrier waits, the others parked inside their computations, as
# if the blocked ones held all of the CPU client's workers. With eight CPU
# devices (test_parallel's mesh too) the same kernels finish.
try:
  jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
  pass  # backends already initialized (an embedding process)

# The suite's float32 tolerances are those of IEEE float32 matmuls; XLA's
# default on a GPU (TF32) alone moves results by ~1e-5.
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")

COLL = fj.FORGE_COLLECTION  # '_overwrite_with_gradient'


# ---------------------------------------------------------------------------
# pytest plumbing.


def pytest_addoption(parser):
  parser.addoption(
    "--run-slow",
    action="store_true",
    default=False,
    help="also run the tests marked slow",
  )


def pytest_collection_modifyitems(config, items):
  skips = []
  if jax.default_backend() != "gpu":
    skips.append(
      (
        "gpu",
        pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')"),
      )
    )
  if not config.getoption("--run-slow"):
    skips.append(("slow", pytest.mark.skip(reason="slow: needs --run-slow")))
  for item in items:
    for marker, skip in skips:
      if item.get_closest_marker(marker) is not None:
        item.add_marker(skip)


def seed_of(request, key: str) -> int:
  """The seed of ``key`` (shuffled by ``FORGE_TEST_SEED``), recorded so that
  a failing test prints it."""
  base = os.environ.get("FORGE_TEST_SEED", "0")
  value = zlib.crc32(f"{base}:{key}".encode()) & 0x7FFFFFFF
  request.node.user_properties.append(("seed", value))
  return value


@pytest.fixture
def seed(request):
  """A seed of its own for every test (and every parameterization)."""
  return seed_of(request, request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if report.when == "call" and report.failed:
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if seeds:
      report.sections.append(
        (
          "seed",
          f"seed={seeds[0]} (FORGE_TEST_SEED="
          f"{os.environ.get('FORGE_TEST_SEED', '0')})",
        )
      )


# ---------------------------------------------------------------------------
# Models.


class MLP(nn.Module):
  """``fc1 -> gelu -> fc2 -> ... -> fcN`` with ForgeDense or nn.Dense layers."""

  features: Sequence[int]
  optimizer: Any = None  # None: nn.Dense layers (the reference)
  implementation: str = "xla"
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.features):
      if self.optimizer is None:
        layer = nn.Dense(width, use_bias=self.use_bias, name=f"fc{i + 1}")
      else:
        layer = fj.ForgeDense(
          width,
          optimizer=self.optimizer,
          implementation=self.implementation,
          use_bias=self.use_bias,
          name=f"fc{i + 1}",
        )
      x = layer(x)
      if i + 1 < len(self.features):
        x = nn.gelu(x)
    return x


def make_batch(seed: int, shape: Sequence[int], classes: int):
  """Random inputs of ``shape`` (any rank >= 1) and integer labels."""
  kx, ky = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, tuple(shape), jnp.float32)
  y = jax.random.randint(ky, tuple(shape[:-1]), 0, classes)
  return x, y


def cross_entropy(apply_fn, variables, batch):
  x, y = batch
  logits = apply_fn(variables, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_batches(seed: int, steps: int, shape: Sequence[int], classes: int):
  """A different batch for every step (so moments see varying gradients)."""
  return [make_batch(seed + 7919 * i, shape, classes) for i in range(steps)]


# ---------------------------------------------------------------------------
# Running jitted, donated train steps.


@contextlib.contextmanager
def count_backend_compiles():
  """Counts XLA backend compilations inside the block (a list of one int)."""
  counter = [0]

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      counter[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def host_copy(tree):
  """A numpy copy of every array leaf (survives donation of the original)."""
  return jax.tree.map(lambda a: np.array(a, copy=True), tree)


@dataclasses.dataclass
class StepRun:
  states: list  # host copies of the TrainState after every step
  losses: list  # host floats, one per step
  traces: int  # how often the step function was traced
  compiles_after_first: int  # backend compilations during steps 2..N
  alias_bytes: int  # memory_analysis().alias_size_in_bytes of the step
  donated_deleted: bool  # the first step's input kernel buffers were freed
  final_state: Any  # the last (device) TrainState


def make_train_step(
  counter: Optional[list] = None, loss: Callable = cross_entropy
):
  def train_step(state, batch):
    if counter is not None:
      counter[0] += 1  # Python side effect: runs once per trace only
    value, grads = jax.value_and_grad(lambda p: loss(state.apply_fn, p, batch))(
      state.params
    )
    return state.apply_gradients(grads=grads), value

  return train_step


def run_steps(
  model: nn.Module,
  variables,
  tx: optax.GradientTransformation,
  batches,
  loss: Callable = cross_entropy,
) -> StepRun:
  """``len(batches)`` steps of ``jax.jit(train_step, donate_argnums=0)``."""
  state = TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
  traces = [0]
  train_step = jax.jit(make_train_step(traces, loss), donate_argnums=0)
  # Lowering and compiling ahead of time uses (and fills) the same caches as
  # the calls below: the first call does not compile again.
  compiled = train_step.lower(state, batches[0]).compile()
  alias_bytes = compiled.memory_analysis().alias_size_in_bytes

  first_inputs = [
    leaf
    for layer in state.params.get(COLL, {}).values()
    for leaf in jax.tree.leaves((layer["kernel"], layer["opt_state"]))
  ]
  states, losses = [], []
  compiles_after_first = 0
  for i, batch in enumerate(batches):
    if i == 0:
      state, value = train_step(state, batch)
      jax.block_until_ready(value)
      donated_deleted = bool(first_inputs) and all(
        a.is_deleted() for a in first_inputs
      )
    else:
      with count_backend_compiles() as compiles:
        state, value = train_step(state, batch)
        jax.block_until_ready(value)
      compiles_after_first += compiles[0]
    states.append(host_copy(state))
    losses.append(float(value))
  return StepRun(
    states=states,
    losses=losses,
    traces=traces[0],
    compiles_after_first=compiles_after_first,
    alias_bytes=alias_bytes,
    donated_deleted=donated_deleted,
    final_state=state,
  )


def train_step_temp_bytes(model, make_state, tx, inputs) -> int:
  """Compiled temporary bytes of a jitted, donated train step of ``model``
  on ``inputs`` (loss: the mean square of its output), its state made by
  ``make_state`` (``TrainState.create`` or ``fj.TrainState.create``) with
  ``tx``. Compiled from shapes: nothing runs."""
  variables = jax.eval_shape(model.init, jax.random.key(0), inputs)
  state = jax.eval_shape(
    lambda v: make_state(apply_fn=model.apply, params=v, tx=tx), variables
  )

  def step(state, inputs):
    loss = lambda p: jnp.mean(jnp.square(state.apply_fn(p, inputs)))
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  compiled = jax.jit(step, donate_argnums=0).lower(state, inputs).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def forge_bytes(variables) -> int:
  """Bytes of every ForgeDense kernel and optimizer state in ``variables``."""
  total = 0
  for layer in variables.get(COLL, {}).values():
    for leaf in jax.tree.leaves((layer["kernel"], layer["opt_state"])):
      total += leaf.size * leaf.dtype.itemsize
  return total


# ---------------------------------------------------------------------------
# Comparisons.


def rel_err(actual, expected) -> float:
  """``||actual - expected|| / ||expected||`` in float64 (0 if both are 0)."""
  a = np.asarray(actual, np.float64)
  e = np.asarray(expected, np.float64)
  assert a.shape == e.shape, (a.shape, e.shape)
  num = np.linalg.norm((a - e).ravel())
  den = np.linalg.norm(e.ravel())
  if den == 0:
    return 0.0 if num == 0 else float("inf")
  return float(num / den)


def assert_rel_close(actual, expected, rtol, what=""):
  assert np.all(np.isfinite(np.asarray(actual, np.float64))), (
    f"{what}: non-finite"
  )
  err = rel_err(actual, expected)
  assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def bits(a) -> np.ndarray:
  """The raw bit patterns of ``a`` (bit-for-bit comparisons, NaN included)."""
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bitwise_equal(actual, expected, what=""):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  diff = bits(actual) != bits(expected)
  assert not diff.any(), f"{what}: {diff.sum()} of {diff.size} elements differ"


def assert_same_bits(actual, expected, what):
  """:func:`assert_bitwise_equal` on every leaf of two pytrees, each named by
  its path in ``expected``."""
  names = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]
  ]
  for name, a, e in zip(
    names, jax.tree.leaves(actual), jax.tree.leaves(expected)
  ):
    assert_bitwise_equal(np.atleast_1d(a), np.atleast_1d(e), f"{what} {name}")


def ulp_distance(actual, expected) -> np.ndarray:
  """Distance in units in the last place between same-dtype float arrays."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype
  width = actual.dtype.itemsize * 8
  signed = np.dtype(f"i{actual.dtype.itemsize}")

  def ordered(a):
    # Map the sign-magnitude float bit pattern onto a monotonic integer line.
    i = a.view(signed).astype(np.int64)
    return np.where(i < 0, -(i & ((1 << (width - 1)) - 1)), i)

  return np.abs(ordered(actual) - ordered(expected))


def beyond_one_ulp(actual, expected) -> np.ndarray:
  """Elements more than one ulp apart both at their own magnitude and at
  the leaf's scale (one ulp of the expected leaf's RMS).

  Where an update cancels to near zero (``w - lr * u ~ 0``), float32
  arithmetic compiled differently (FMA contraction, ``sqrt`` through
  ``rsqrt``) moves the result by many of its own tiny ulps but by less than
  one ulp at the leaf's scale: such an element is not counted."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
  rms = np.sqrt(np.mean(np.square(e64)))
  scale_ulp = rms * 2.0 ** -jnp.finfo(expected.dtype).nmant
  return (ulp_distance(actual, expected) > 1) & (np.abs(a64 - e64) > scale_ulp)


def jaxpr_equations(jaxpr, *, kernel_bodies=False):
  """Every equation of ``jaxpr`` and of the jaxprs nested in it (a Pallas
  kernel's body only with ``kernel_bodies``)."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name == "pallas_call" and not kernel_bodies:
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          yield from jaxpr_equations(sub, kernel_bodies=kernel_bodies)


def selects_of_shape(jaxpr, shape) -> int:
  """How many ``select_n`` of ``shape`` ``jaxpr`` holds, sub-jaxprs too:
  an install's run-time choice between a layer's written and old values
  is one."""
  return sum(
    eqn.primitive.name == "select_n"
    and any(v.aval.shape == shape for v in eqn.outvars)
    for eqn in jaxpr_equations(jaxpr)
  )


def assert_within_rounding(actual, expected, what, identical):
  """The rule's float32 arithmetic may be compiled differently from the
  reference's (FMA contraction: XLA's fusion of the interpreter's tile, or
  Mosaic's code on the GPU), moving a rare element across a stochastic-
  rounding or int8 boundary: at least ``identical`` of each leaf's bits
  match, the rest one bf16 ulp away, at the element's own magnitude or at
  the leaf's scale (:func:`beyond_one_ulp`: where the update cancels to
  near zero). An int8 leaf's block scales (on the bfloat16 grid: such an
  element moves its block's only across a grid threshold) are one bfloat16
  step apart at most, its codes one code apart where the scales agree, and
  what they encode within one code step everywhere (a block whose scale
  moved re-rounds all its codes: :func:`quantization.encoded_value`)."""
  leaves = lambda tree: jax.tree.leaves(tree, is_leaf=quantization.is_quantized)
  for a, e in zip(leaves(actual), leaves(expected)):
    if quantization.is_quantized(e):
      _assert_int8_within_rounding(a, e, what, identical)
      continue
    a, e = np.asarray(a), np.asarray(e)
    assert (bits(a) == bits(e)).mean() >= identical, (what, a.dtype)
    if a.dtype == np.float32:
      np.testing.assert_allclose(a, e, rtol=2.0**-7, err_msg=what)
      continue
    beyond = beyond_one_ulp(a, e)
    assert not beyond.any(), (
      what,
      f"{beyond.sum()} elements beyond one ulp, up to "
      f"{ulp_distance(a, e)[beyond].max()} ulps",
    )


def _assert_int8_within_rounding(actual, expected, what, identical):
  for field in ("codes", "scale"):
    a, e = (
      np.asarray(getattr(actual, field)),
      np.asarray(getattr(expected, field)),
    )
    assert (bits(a) == bits(e)).mean() >= identical, (what, field)
  np.testing.assert_allclose(
    actual.scale, expected.scale, rtol=2.0**-7, err_msg=what
  )
  value_a, _ = quantization.encoded_value(actual)
  value_e, _ = quantization.encoded_value(expected)
  np.testing.assert_array_equal(
    np.isfinite(value_a), np.isfinite(value_e), err_msg=str(what)
  )
  codes, steps = map(
    np.asarray, quantization.encoded_distance(actual, expected)
  )
  assert codes.max() <= 1, (what, "codes")
  assert steps.max() <= 1 + 2.0**-10, (
    what,
    f"encoded values up to {steps.max()} code steps apart",
  )


def poison(x, where=None, value=np.nan):
  """``x`` with ``value`` (NaN by default) at ``where`` (everywhere if None).

  ``where`` is a boolean mask or an index expression (``np.s_[...]``).
  """
  out = np.array(x, copy=True)
  if where is None:
    out[...] = value
  else:
    out[where] = value
  return jnp.asarray(out, dtype=jnp.asarray(x).dtype)
