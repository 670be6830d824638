"""The fused dense op's checks, written once and run on every backend.

``FusedDenseTestBase`` holds them; test_fused_dense.py subclasses it once per
backend (the XLA reference, the Pallas Triton and Mosaic GPU kernels in
interpret mode, and both kernels compiled on a GPU). A subclass says how its
backend runs one step (``backend``), which shapes and tile configs its
kernel takes, and how many of each check's cases run by default.

Every backend has ``backends.xla_update``'s contract: ``(spec, x, dy,
kernel, opt_state, scalars, apply) -> (new kernel, new state, skipped)``.
All apply the same float32 rule (``forge_jax.ops.update.apply_update``);
they differ in how ``dW = x.T @ dy`` is formed: XLA's dot_general vs.
float32 accumulation over token slabs inside each tile. The results
therefore differ only by the rounding of a differently ordered float32 sum:

* float32 outputs: ~1e-7 relative; checked at 1e-5 relative (to the leaf
  norm, and per element up to 1e-5 of the leaf's largest magnitude).
* bfloat16 outputs: the float32 results, ~1e-7 apart, are rounded to bf16
  (8 bits of mantissa); where they straddle a rounding boundary the stored
  values differ by one bf16 ulp. So: at most 1 ulp anywhere and >= 99% of
  the elements bit-identical (a boundary is hit with probability ~1e-4).
* bf16 weights with stochastic rounding and int8 states, on inputs in
  multiples of 1/32 (dW exact in any summation order): the same bits.

A backend runs inside ``jax.jit`` with the kernel and state donated, so the
outputs of an aliasing kernel are the very buffers of its inputs (what the
GPU kernels do in place; Mosaic GPU's interpreter writes fresh outputs, which
it fills with NaN first): an element a kernel failed to store keeps its old
value or comes out NaN, and the checks below see either. The reference is
computed first, from its own buffers, and every input is copied to the host
before the donated call.

Cases: each parameterized check has a table of cases (``<check>_cases``),
ordered so that its first cases already spread over the optimizers, dtypes,
shapes and configs. ``default_cases`` says how many of them a backend runs
by default; the others are marked slow (``--run-slow`` runs them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax as fj
from forge_jax import quantization
from forge_jax.ops import backends
from forge_jax.ops.fused_dense import FusedDenseSpec

from conftest import (
  COLL,
  MLP,
  assert_bitwise_equal,
  assert_rel_close,
  assert_same_bits,
  bits,
  forge_bytes,
  host_copy,
  make_batch,
  make_batches,
  poison,
  run_steps,
  seed_of,
  ulp_distance,
)

F32, BF16 = jnp.float32, jnp.bfloat16

_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 20)

# (id, optimizer, count). Learning rates are large enough that a step moves
# bf16 weights by more than their ulp. RAdam runs at a count on each side of
# its threshold (b2=0.9: un-rectified up to t=5, rectified from t=6).
OPTIMIZERS = [
  ("adam", fj.adam(0.05), 3),
  (
    "adamw-schedule",
    fj.adamw(_SCHEDULE, weight_decay=optax.linear_schedule(0.1, 0.0, 10)),
    4,
  ),
  ("nadam", fj.nadam(0.05, b1=0.8), 5),
  ("nadamw", fj.nadamw(0.05, weight_decay=0.1), 2),
  ("radam-unrectified", fj.radam(0.05, b2=0.9), 1),
  ("radam-rectified", fj.radam(0.05, b2=0.9, nesterov=True), 9),
  ("lion", fj.lion(0.05, weight_decay=0.1), 5),
  (
    "rmsprop-centered-nesterov",
    fj.rmsprop(0.05, centered=True, momentum=0.9, nesterov=True),
    3,
  ),
  (
    "rmsprop-bias-correction",
    fj.rmsprop(
      0.05, bias_correction=True, eps_in_sqrt=False, initial_scale=0.5
    ),
    2,
  ),
  ("adagrad", fj.adagrad(0.1), 6),
  ("sgd", fj.sgd(0.1), 0),
  ("sgd-nesterov", fj.sgd(0.1, momentum=0.9, nesterov=True), 7),
]

# (kernel dtype, state dtype, activation dtype).
DTYPES = [
  (F32, F32, F32),
  (BF16, BF16, BF16),
  (F32, BF16, BF16),
  (BF16, F32, F32),
]

# Optimizers whose zero-initialized state changes in every element on the
# first step whenever dW != 0 (every state name: mu, nu, trace,
# sum_of_squares), and whose kernel step is never below a float32 ulp.
COVERAGE_OPTIMIZERS = [
  ("adam", fj.adam(0.05)),
  ("rmsprop-centered-momentum", fj.rmsprop(0.05, centered=True, momentum=0.9)),
  ("adagrad-zero-init", fj.adagrad(0.1, initial_accumulator_value=0.0)),
  ("lion", fj.lion(0.05)),
]

NONFINITE_OPTIMIZERS = [
  ("adamw", fj.adamw(0.05, weight_decay=0.1)),
  ("lion", fj.lion(0.05)),
  ("rmsprop-centered-momentum", fj.rmsprop(0.05, centered=True, momentum=0.9)),
  ("sgd", fj.sgd(0.1)),
]

# (name, optimizer); every one with int8 states and stochastic rounding.
LOWP_OPTIMIZERS = [
  (
    "adamw",
    fj.adamw(
      0.05,
      weight_decay=0.1,
      state_dtype="int8",
      weight_rounding="stochastic",
      rounding_seed=11,
    ),
  ),
  ("lion", fj.lion(0.05, state_dtype="int8", weight_rounding="stochastic")),
  (
    "sgd-nesterov",
    fj.sgd(
      0.1,
      momentum=0.9,
      nesterov=True,
      state_dtype="int8",
      weight_rounding="stochastic",
    ),
  ),
  (
    "adagrad",
    fj.adagrad(0.1, state_dtype="int8", weight_rounding="stochastic"),
  ),
  (
    "rmsprop-momentum",
    fj.rmsprop(
      0.05, momentum=0.9, state_dtype="int8", weight_rounding="stochastic"
    ),
  ),
]

# (name, optimizer); int8 states with 4-bit second moments (every rule that
# has one) and stochastic rounding.
FOURBIT_OPTIMIZERS = [
  (
    name,
    dataclasses.replace(opt, second_moment_bits=4),
  )
  for name, opt in LOWP_OPTIMIZERS
  if opt.nonnegative_state
] + [
  (
    "radam",
    fj.radam(
      0.05,
      b2=0.9,
      state_dtype="int8",
      second_moment_bits=4,
      weight_rounding="stochastic",
    ),
  ),
]


# ---------------------------------------------------------------------------
# Training against optax: one table covers every optimizer and variant.
#
# For each row, an MLP of ForgeDense layers (kernels and state in the
# '_overwrite_with_gradient' collection, biases trained by
# ``opt.to_optax()``) and the same MLP of nn.Dense layers trained by the
# optax alias constructed directly with the same arguments take 8 jitted,
# donated TrainState steps on the same batches. After every step the
# kernels, biases and every per-element optimizer state leaf (mu / nu /
# trace / sum_of_squares, located by name in the optax state) agree to 1e-6
# relative to the leaf's norm.

STEPS = 8
FEATURES = (16, 10)  # two ForgeDense layers: fc1 (D->16), gelu, fc2 (16->10)
CLASSES = FEATURES[-1]
RTOL = 1e-6
# Biases are optax's on both sides, stepped from autodiff's dbias, a sum
# over the tokens that XLA orders by the program around it: with a Pallas
# call in the step it may sum a cancelling element differently (rmsprop
# with nesterov momentum, 10 tokens: one element of dbias 1.6e-5 apart, the
# bias vector 1.6e-6 after the step, the kernels bit for bit).
BIAS_RTOL = 1e-5
RANK3 = (2, 5, 12)  # [batch, sequence, features]
RANK2 = (10, 12)

# Schedules are shared objects, so FORGE and optax receive the very same ones.
COSINE = optax.cosine_decay_schedule(3e-2, decay_steps=10)
WARMUP = optax.warmup_cosine_decay_schedule(
  0.0, 3e-2, warmup_steps=3, decay_steps=10
)
WD_SCHEDULE = optax.linear_schedule(0.2, 0.0, transition_steps=8)

# bfloat16 optimizer state (mu_dtype / accumulator_dtype) with float32
# weights: FORGE runs the whole rule in float32 and rounds the state only to
# store it; optax computes ``decay * t`` in bf16. The two differ by up to a
# bf16 rounding of the state per step, so these rows are held to two bf16
# ulps (2**-6: the roundings compound over 8 steps) instead of RTOL. README
# documents the difference.
BF16_STATE_RTOL = 2.0**-6


def _kernels_only(params):
  # adamw/lion ``mask``: decay matrices only. For FORGE's to_optax() the tree
  # holds biases only (all False); ForgeDense always decays its kernel.
  return jax.tree.map(lambda p: p.ndim > 1, params)


class OptaxCase(NamedTuple):
  """``fj.<name>(**kwargs)`` and ``optax.<name>(**kwargs)`` on ``shape``."""

  id: str
  name: str
  kwargs: dict
  shape: tuple
  #: Among the first rows of the table: together they take AdamW, Lion,
  #: RMSprop, AdaGrad and SGD, each kind of schedule (learning rate and
  #: weight decay) and a bf16 state.
  core: bool


def _row(name, shape=RANK3, core=False, **kwargs):
  label = ",".join(
    f"{k}={getattr(v, '__name__', v)}" for k, v in kwargs.items()
  )
  label = label.replace("learning_rate=", "lr=")
  return OptaxCase(f"{name}({label})-r{len(shape)}", name, kwargs, shape, core)


OPTAX_CASES = [
  # Adam family.
  _row("adam", learning_rate=1e-2),
  _row("adam", RANK2, learning_rate=1e-2, b1=0.8, b2=0.95, eps_root=1e-8),
  _row("adam", learning_rate=COSINE, eps=1e-6),
  _row("adam", RANK2, learning_rate=1e-2, nesterov=True),
  _row("adamw", learning_rate=1e-2, weight_decay=0.1),
  _row("adamw", RANK2, learning_rate=COSINE, weight_decay=0.1),
  _row("adamw", learning_rate=WARMUP, weight_decay=WD_SCHEDULE, core=True),
  _row(
    "adamw", RANK2, learning_rate=1e-2, weight_decay=0.1, mask=_kernels_only
  ),
  _row("adamw", learning_rate=1e-2, weight_decay=0.0),
  _row("nadam", learning_rate=1e-2),
  _row("nadamw", RANK2, learning_rate=COSINE, weight_decay=0.1),
  # RAdam: rho_t crosses the threshold inside the 8 steps, so both the
  # un-rectified (plain momentum) and the rectified branch run (checked).
  _row("radam", learning_rate=1e-2, b2=0.9),
  _row("radam", RANK2, learning_rate=1e-2, threshold=4.5),
  _row("radam", learning_rate=1e-2, b2=0.9, nesterov=True),
  # Lion. Sign-based, so a different summation order of dW (kernels) could
  # flip sign(u) where (1 - b1) g + b1 m is within rounding of zero and
  # move such an element by 2 lr. Not observed: with continuous random data
  # that needs |(1-b1) g + b1 m| ~ 1e-7 |g|, so these rows pass at 1e-6
  # with no loosening (and exactly where the token count fits one slab).
  _row("lion", learning_rate=1e-3),
  _row(
    "lion",
    RANK2,
    learning_rate=3e-3,
    b1=0.95,
    b2=0.98,
    weight_decay=0.1,
    core=True,
  ),
  _row("lion", learning_rate=COSINE, weight_decay=0.0),
  # RMSprop.
  _row("rmsprop", learning_rate=1e-2),
  _row("rmsprop", RANK2, learning_rate=1e-2, centered=True),
  _row("rmsprop", learning_rate=1e-2, momentum=0.9),
  _row("rmsprop", RANK2, learning_rate=1e-2, momentum=0.9, nesterov=True),
  _row("rmsprop", learning_rate=1e-2, eps_in_sqrt=False),
  _row("rmsprop", RANK2, learning_rate=1e-2, bias_correction=True),
  _row("rmsprop", learning_rate=1e-2, initial_scale=1.0),
  _row(
    "rmsprop",
    RANK2,
    learning_rate=WARMUP,
    decay=0.8,
    centered=True,
    momentum=0.5,
    nesterov=True,
    eps_in_sqrt=False,
    core=True,
  ),
  _row(
    "rmsprop",
    learning_rate=1e-2,
    bias_correction=True,
    momentum=0.9,
    initial_scale=0.5,
  ),
  # AdaGrad.
  _row("adagrad", learning_rate=1e-1),
  _row(
    "adagrad",
    RANK2,
    learning_rate=1e-1,
    initial_accumulator_value=0.0,
    eps=1e-10,
  ),
  _row("adagrad", learning_rate=COSINE, core=True),
  # SGD.
  _row("sgd", learning_rate=1e-1),
  _row("sgd", RANK2, learning_rate=1e-1, momentum=0.9),
  _row("sgd", learning_rate=1e-1, momentum=0.9, nesterov=True, core=True),
  _row(
    "sgd",
    RANK2,
    learning_rate=WARMUP,
    momentum=0.5,
    accumulator_dtype=jnp.float32,
  ),
  _row("sgd", learning_rate=COSINE),
  # bfloat16 optimizer state: see BF16_STATE_RTOL above.
  _row("adam", learning_rate=1e-2, mu_dtype=jnp.bfloat16, core=True),
  _row(
    "sgd",
    RANK2,
    learning_rate=1e-1,
    momentum=0.9,
    accumulator_dtype=jnp.bfloat16,
  ),
  _row("lion", learning_rate=1e-3, mu_dtype=jnp.bfloat16),
]


def moment_trees(opt_state) -> dict:
  """``{field: params-shaped tree}`` for every per-parameter state of optax.

  Walks the (nested) NamedTuple states of an optax chain and collects each
  field that holds a tree of parameters (mu, nu, trace, sum_of_squares, ...);
  scalars such as ``count`` are not trees and are left out.
  """
  found = {}

  def walk(node):
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      for field in node._fields:
        value = getattr(node, field)
        if isinstance(value, dict):
          assert field not in found, f"ambiguous optax state field {field}"
          found[field] = value
        else:
          walk(value)
    elif isinstance(node, (tuple, list)):
      for value in node:
        walk(value)

  walk(opt_state)
  # The reference TrainState optimizes the whole {'params': ...} dict; a
  # FORGE TrainState gives optax variables['params'] only.
  return {f: t.get("params", t) for f, t in found.items()}


def forge_state_fields(layer) -> dict:
  state = layer["opt_state"]
  return {f: v for f, v in state._asdict().items() if v is not None}


def compare_states(step, forge, ref, rtol=RTOL):
  """Kernels, biases and optimizer state of one step, leaf by leaf."""
  ref_moments = moment_trees(ref.opt_state)
  bias_moments = moment_trees(forge.opt_state)  # FORGE's optax: biases only
  for layer in ref.params["params"]:
    where = f"step {step + 1}, {layer}"
    forge_layer = forge.params[COLL][layer]
    ref_layer = ref.params["params"][layer]
    assert_rel_close(
      forge_layer["kernel"], ref_layer["kernel"], rtol, f"{where} kernel"
    )
    assert_rel_close(
      forge.params["params"][layer]["bias"],
      ref_layer["bias"],
      max(rtol, BIAS_RTOL),
      f"{where} bias",
    )
    fields = forge_state_fields(forge_layer)
    # Every per-parameter state optax keeps, FORGE keeps for the kernel.
    assert set(fields) == set(ref_moments), (
      where,
      set(fields),
      set(ref_moments),
    )
    for field, value in fields.items():
      expected = ref_moments[field][layer]["kernel"]
      assert value.dtype == expected.dtype, (where, field)
      assert_rel_close(value, expected, rtol, f"{where} kernel {field}")
      assert_rel_close(
        bias_moments[field][layer]["bias"],
        ref_moments[field][layer]["bias"],
        max(rtol, BIAS_RTOL),
        f"{where} bias {field}",
      )
    assert float(forge_layer["count"]) == step + 1, where
    assert float(forge_layer["skipped"]) == 0.0, where
    assert float(forge_layer["intact"]) == 1.0, where


# ---------------------------------------------------------------------------
# Inputs, the reference and the comparisons.


def dtype_id(combo):
  return "k{}-s{}-x{}".format(
    *(jnp.dtype(d).name.replace("float", "f") for d in combo)
  )


def shape_id(shape):
  x_shape, n = shape
  return f"x{'x'.join(map(str, x_shape))}n{n}"


def random_inputs(seed, opt, x_shape, n, dtypes, zero_state=False):
  """Random x, dy, kernel and a valid (random or initial) optimizer state."""
  kernel_dtype, state_dtype, act_dtype = dtypes
  k = x_shape[-1]
  keys = iter(jax.random.split(jax.random.key(seed), 16))
  normal = lambda shape: jax.random.normal(next(keys), shape, jnp.float32)
  x = normal(x_shape).astype(act_dtype)
  dy = normal(x_shape[:-1] + (n,)).astype(act_dtype)
  kernel = (0.5 * normal((k, n))).astype(kernel_dtype)
  state = opt.init(kernel)
  if not zero_state:
    fields = {}
    mu = 0.1 * normal((k, n))
    for field, value in state._asdict().items():
      if value is None:
        fields[field] = None
      elif field == "nu":  # >= mu**2 (RMSprop centered: var >= 0)
        fields[field] = mu * mu + jax.random.uniform(
          next(keys), (k, n), minval=0.01, maxval=0.1
        )
      elif field == "sum_of_squares":
        fields[field] = jax.random.uniform(
          next(keys), (k, n), minval=0.1, maxval=1.0
        )
      elif field == "mu":
        fields[field] = mu
      else:
        fields[field] = 0.1 * normal((k, n))
    state = type(state)(**fields)
  state = jax.tree.map(lambda s: s.astype(state_dtype), state)
  return x, dy, kernel, state


def exact_inputs(seed, x_shape, n, act_dtype=F32):
  """x in multiples of 1/4 and dy in multiples of 1/8, small enough that
  every partial sum of dW is exact in float32 (and bf16 inputs are exact)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.integers(-3, 4, x_shape) / 4.0, act_dtype)
  dy = jnp.asarray(rng.integers(-3, 4, x_shape[:-1] + (n,)) / 8.0, act_dtype)
  return x, dy


def positive_exact_inputs(seed, x_shape, n, act_dtype=F32):
  """x in {1, 2, 3} / 4 and dy in {1, 2, 3} / 8: every element of dW is
  positive (so a first step changes every element) and exact in float32
  in any summation order."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.integers(1, 4, x_shape) / 4.0, act_dtype)
  dy = jnp.asarray(rng.integers(1, 4, x_shape[:-1] + (n,)) / 8.0, act_dtype)
  return x, dy


def poison_tokens(a, spots, value=np.nan):
  """``a`` with ``value`` at ``(token, column)`` spots of its 2-D view
  (tokens flattened: the layout the op contracts over)."""
  where = np.zeros((a.size // a.shape[-1], a.shape[-1]), bool)
  for token, column in spots:
    where[token, column] = True
  return poison(a, where.reshape(a.shape), value)


def rounding_key(opt, step=None, layer_id=0):
  """The backends' stochastic rounding key of layer ``layer_id`` at ``step``
  (None: 0), as the fused op computes it; None without stochastic rounding."""
  if opt.weight_rounding != "stochastic":
    return None
  return quantization.rounding_key(opt.rounding_seed, layer_id, step)


def run_reference(
  opt, x, dy, kernel, state, count, apply=None, *, step=None, layer_id=0
):
  """One step of the XLA reference (jitted, nothing donated), on the host."""
  spec = FusedDenseSpec(optimizer=opt, implementation="xla")
  if apply is None:
    apply = jnp.all(jnp.isfinite(dy))  # as the fused op's backward does
  scalars = opt.scalars(jnp.asarray(count, jnp.int32))
  fn = jax.jit(functools.partial(backends.xla_update, spec))
  key = rounding_key(opt, step, layer_id)
  return host_copy(fn(x, dy, kernel, state, scalars, apply, rounding_key=key))


def assert_outputs_match(actual, expected, what):
  """Kernel/state leaves: tolerance by dtype (see the module docstring)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  finite = np.isfinite(expected.astype(np.float32))
  assert finite.all(), f"{what}: the reference is not finite"
  assert np.isfinite(actual.astype(np.float32)).all(), f"{what}: non-finite"
  if actual.dtype == np.float32:
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    scale = np.abs(e).max()
    assert np.linalg.norm(a - e) <= 1e-5 * np.linalg.norm(e), what
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * scale, err_msg=what)
  else:
    ulps = ulp_distance(actual, expected)
    # Near zero (a state that cancels, b1 m ~ -(1 - b1) g) the sum order's
    # float32 difference in dW spans many ulps: there, as for float32
    # leaves, an absolute error of 1e-5 of the leaf's scale is allowed.
    far = ulps > 1
    error = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    scale = np.abs(expected.astype(np.float64)).max()
    assert (error[far] <= 1e-5 * scale).all(), f"{what}: {ulps.max()} ulp apart"
    assert (ulps == 0).mean() >= 0.99, (
      f"{what}: {(ulps != 0).sum()} of {ulps.size} elements 1 ulp apart"
    )


def assert_leaves_match(actual, expected, what):
  names = ["kernel"] + [
    f"state.{f}" for f, v in expected[1]._asdict().items() if v is not None
  ]
  leaves_a = jax.tree.leaves(actual[:2])
  leaves_e = jax.tree.leaves(expected[:2])
  assert len(leaves_a) == len(leaves_e) == len(names)
  for name, a, e in zip(names, leaves_a, leaves_e):
    assert_outputs_match(a, e, f"{what} {name}")


# ---------------------------------------------------------------------------
# The checks.


class Case(NamedTuple):
  id: str
  args: tuple


def _spread(first: list, second: list) -> list:
  """Every ``(i, j)`` pair of the two lists, the first ``len(first)`` pairs
  taking each ``first[i]`` once and ``second`` in turn."""
  pairs = [
    (i, (i + r) % len(second))
    for r in range(len(second))
    for i in range(len(first))
  ]
  return [(first[i], second[j], i, j) for i, j in pairs]


class FusedDenseTestBase:
  """The op-level checks of one backend (see the module docstring).

  Subclasses set ``implementation`` and the shapes and configs below, and
  implement ``backend``.
  """

  #: ``FusedDenseSpec.implementation`` of the backend.
  implementation: str
  #: ``(x shape, N)`` of the float checks; several tiles and, where the
  #: kernel masks them, edges and a token tail.
  shapes: list
  #: ``{name: config}`` handed to ``backend``, cycled through the cases in
  #: this order (the first one serves the checks that take one).
  configs: dict
  #: Shapes and configs of the bf16 + stochastic rounding + int8 checks.
  lowp_shapes: list
  lowp_configs: dict
  #: How many of a check's cases run by default (the rest are slow);
  #: checks not named run every case by default.
  default_cases: dict = {}

  def backend(self, spec: FusedDenseSpec, config) -> Callable:
    """``(x, dy, kernel, state, scalars, apply, rounding_key) -> (kernel,
    state, skipped)``: one step of this backend with ``config``."""
    raise NotImplementedError

  def activation_dtype(self, dtype):
    """The dtype the backend takes x and dy in, for a wanted ``dtype``."""
    return dtype

  def precision(self):
    """The matmul precision context of the reference and of training."""
    return contextlib.nullcontext()

  def assert_lowp_rule_matches(self, actual, expected, what):
    """Low-precision outputs of the rule from an exact ``dW`` against the
    reference's: the same bits (compiled kernels override this with the
    rounding their float32 arithmetic may differ by)."""
    assert_same_bits(actual, expected, what)

  # pytest plumbing: the seeds and the cases of the checks.

  @pytest.fixture
  def seed(self, request):
    """A seed per check and case id, whichever backend runs it: backends
    that share a case (an optax row, say) run it on the same inputs."""
    return seed_of(request, f"{request.node.path.name}::{request.node.name}")

  def pytest_generate_tests(self, metafunc):
    """``test_<check>(self, case, ...)`` runs every case of
    ``<check>_cases()``; those past ``default_cases`` are marked slow."""
    if "case" not in metafunc.fixturenames:
      return
    name = metafunc.function.__name__
    cases = getattr(self, name.replace("test_", "", 1) + "_cases")()
    default = self.default_cases.get(name, len(cases))
    metafunc.parametrize(
      "case",
      [
        pytest.param(
          case, id=case.id, marks=[pytest.mark.slow] if i >= default else []
        )
        for i, case in enumerate(cases)
      ],
    )

  def dtypes(self, combo):
    kernel_dtype, state_dtype, act_dtype = combo
    return kernel_dtype, state_dtype, self.activation_dtype(act_dtype)

  def run(
    self,
    opt,
    x,
    dy,
    kernel,
    state,
    count,
    *,
    config=None,
    apply=None,
    step=None,
    layer_id=0,
  ):
    """One donated, jitted step of the backend, on the host."""
    spec = FusedDenseSpec(optimizer=opt, implementation=self.implementation)
    if apply is None:
      apply = jnp.all(jnp.isfinite(dy))
    scalars = opt.scalars(jnp.asarray(count, jnp.int32))
    fn = jax.jit(self.backend(spec, config), donate_argnums=(2, 3))
    key = rounding_key(opt, step, layer_id)
    return host_copy(fn(x, dy, kernel, state, scalars, apply, key))

  def reference(self, *args, **kwargs):
    with self.precision():
      return run_reference(*args, **kwargs)

  def first_config(self):
    return next(iter(self.configs.values()))

  # -------------------------------------------------------------------------
  # The backend == the reference.

  def matches_reference_cases(self):
    configs = list(self.configs)
    cases = []
    for (name, opt, count), combo, i, j in _spread(OPTIMIZERS, DTYPES):
      shape = self.shapes[(i + j) % len(self.shapes)]
      config = configs[j % len(configs)]
      dtypes = self.dtypes(combo)
      cases.append(
        Case(
          f"{name}-{dtype_id(dtypes)}-{shape_id(shape)}-{config}",
          (name, opt, count, dtypes, shape, config),
        )
      )
    return cases

  def test_matches_reference(self, case, seed):
    name, opt, count, dtypes, (x_shape, n), config = case.args
    inputs = random_inputs(seed, opt, x_shape, n, dtypes)
    old_kernel, old_state = host_copy(inputs[2:])
    expected = self.reference(opt, *inputs, count)
    actual = self.run(opt, *inputs, count, config=self.configs[config])

    assert_leaves_match(actual, expected, "")
    assert int(actual[2]) == int(expected[2]) == 0  # nothing skipped
    # The step did something: the kernel moved (in every dtype).
    assert (bits(expected[0]) != bits(old_kernel)).mean() > 0.5
    if name.startswith("radam"):
      rectify = float(opt.scalars(jnp.int32(count)).rectify)
      assert rectify == (1.0 if name == "radam-rectified" else 0.0)
    # Every state leaf took a step too (bf16 leaves: most elements).
    for old_leaf, new_leaf in zip(
      jax.tree.leaves(old_state), jax.tree.leaves(expected[1])
    ):
      assert (bits(new_leaf) != bits(old_leaf)).mean() > 0.5

  def every_element_is_written_cases(self):
    configs = list(self.configs)
    cases = []
    for (name, opt), shape, i, j in _spread(COVERAGE_OPTIMIZERS, self.shapes):
      config = configs[(i + j) % len(configs)]
      cases.append(
        Case(f"{name}-{shape_id(shape)}-{config}", (opt, shape, config))
      )
    return cases

  def test_every_element_is_written(self, case, seed):
    """An aliasing kernel's outputs are its inputs, so an element it failed
    to store would silently keep its OLD value. Choose inputs where the
    reference changes every element of the kernel and of every state leaf
    (first step from the zero state: asserted below, so the test cannot pass
    vacuously); then agreement with the reference proves every element was
    written, masked edges included."""
    opt, (x_shape, n), config = case.args
    # dW exact in any summation order: where a GEMM summed in another order
    # than XLA's cancels to near zero, an eps-sensitive rule (AdaGrad's first
    # step, centered RMSprop) would turn that rounding into a difference.
    _, _, kernel, state = random_inputs(
      seed, opt, x_shape, n, self.dtypes((F32, F32, F32)), zero_state=True
    )
    x, dy = positive_exact_inputs(
      seed, x_shape, n, self.dtypes((F32, F32, F32))[2]
    )
    inputs = (x, dy, kernel, state)
    old = host_copy(inputs[2:])
    expected = self.reference(opt, *inputs, 0)
    actual = self.run(opt, *inputs, 0, config=self.configs[config])
    for old_leaf, new_leaf in zip(
      jax.tree.leaves(old), jax.tree.leaves(expected[:2])
    ):
      assert (bits(old_leaf) != bits(new_leaf)).all(), "precondition"
    for old_leaf, new_leaf in zip(
      jax.tree.leaves(old), jax.tree.leaves(actual[:2])
    ):
      assert (bits(old_leaf) != bits(new_leaf)).all(), "element not written"
    assert_leaves_match(actual, expected, "")
    assert int(actual[2]) == int(expected[2]) == 0

  def poisoned_elements_stay_in_place_cases(self):
    shapes = self.shapes[:2]
    return [
      Case(f"{shape_id(shape)}-{config}", (shape, config))
      for config, shape, _, _ in _spread(list(self.configs), shapes)
    ]

  def test_poisoned_elements_stay_in_place(self, case, seed):
    """NaN planted in the kernel and state inputs at tile corners and at the
    last row/column must come out NaN at exactly those positions (the rule
    propagates NaN; dW is finite, so the element is updated, not skipped)
    and nowhere else: tiles and masked edges index the right elements."""
    (x_shape, n), config = case.args
    opt = fj.rmsprop(0.05, centered=True, momentum=0.9)
    x, dy, kernel, state = random_inputs(
      seed, opt, x_shape, n, self.dtypes((F32, F32, F32))
    )
    k = kernel.shape[0]
    rows = sorted({0, 15, 16, k - 1})
    cols = sorted({0, n - 1} | ({15, 16} & set(range(n))))
    kernel_spots = np.zeros((k, n), bool)
    kernel_spots[rows[0], cols[-1]] = kernel_spots[rows[-1], cols[0]] = True
    state_spots = np.zeros((k, n), bool)
    state_spots[np.ix_(rows, cols)] = True
    state_spots &= ~kernel_spots
    kernel = poison(kernel, kernel_spots)
    state = state._replace(trace=poison(state.trace, state_spots))
    expected = self.reference(opt, x, dy, kernel, state, 2)
    actual = self.run(opt, x, dy, kernel, state, 2, config=self.configs[config])

    # A NaN kernel element gives a NaN new kernel there; a NaN trace gives a
    # NaN new trace and kernel (kernel + trace); nu and mu stay clean.
    expected_nans = {
      "kernel": kernel_spots | state_spots,
      "nu": ~state_spots & state_spots,
      "mu": ~state_spots & state_spots,
      "trace": state_spots,
    }
    for name, a, e in zip(
      ["kernel", "nu", "mu", "trace"],
      jax.tree.leaves(actual[:2]),
      jax.tree.leaves(expected[:2]),
    ):
      spots = expected_nans[name]
      np.testing.assert_array_equal(np.isnan(e), spots, err_msg=f"ref {name}")
      np.testing.assert_array_equal(np.isnan(a), spots, err_msg=name)
      assert_outputs_match(a[~spots], e[~spots], name)
    assert int(actual[2]) == int(expected[2]) == 0

  # -------------------------------------------------------------------------
  # Non-finite gradients.

  def nonfinite_gradient_elements_are_skipped_cases(self):
    combos = [(F32, F32, F32), (BF16, BF16, BF16)]
    return [
      Case(f"{name}-{dtype_id(self.dtypes(combo))}", (opt, self.dtypes(combo)))
      for (name, opt), combo, _, _ in _spread(NONFINITE_OPTIMIZERS, combos)
    ]

  def test_nonfinite_gradient_elements_are_skipped(self, case, seed):
    """inf / nan in columns of x make whole rows of dW non-finite. Exactly
    those elements keep their old kernel and state bit for bit; skipped
    counts them in both the backend and the reference; every other element
    is updated as in the reference."""
    opt, dtypes = case.args
    x_shape, n = self.shapes[0]
    x, dy, kernel, state = random_inputs(seed, opt, x_shape, n, dtypes)
    k = kernel.shape[0]
    tokens = x.size // k
    # Rows 3, 17 (inside the second 16-row tile) and the last one (a masked
    # tile edge) of dW: +-inf or nan.
    x = poison_tokens(x, [(5, 3)], np.inf)
    x = poison_tokens(x, [(tokens - 1, k - 1)], np.nan)
    x = poison_tokens(x, [(20, 17)], -np.inf)
    grad = np.asarray(backends.weight_gradient(x, dy))
    bad = ~np.isfinite(grad)
    assert bad[[3, 17, k - 1]].all() and bad.sum() == 3 * n  # precondition
    old = host_copy((kernel, state))
    expected = self.reference(opt, x, dy, kernel, state, 3)
    actual = self.run(opt, x, dy, kernel, state, 3, config=self.first_config())

    assert int(actual[2]) == int(expected[2]) == int(bad.sum())
    for old_leaf, a, e in zip(
      jax.tree.leaves(old),
      jax.tree.leaves(actual[:2]),
      jax.tree.leaves(expected[:2]),
    ):
      assert_bitwise_equal(a[bad], old_leaf[bad], "kernel output, skipped")
      assert_bitwise_equal(e[bad], old_leaf[bad], "reference, skipped")
      assert_outputs_match(a[~bad], e[~bad], "updated elements")
      assert (bits(e[~bad]) != bits(old_leaf[~bad])).mean() > 0.5

  def nonfinite_dy_skips_the_whole_layer_cases(self):
    combos = [(F32, F32, F32), (BF16, BF16, BF16)]
    return [
      Case(
        f"{dtype_id(self.dtypes(combo))}-{where}", (where, self.dtypes(combo))
      )
      for where, combo, _, _ in _spread(["dy-nan", "dy-inf"], combos)
    ]

  def test_nonfinite_dy_skips_the_whole_layer(self, case, seed):
    where, dtypes = case.args
    opt = fj.adamw(0.05, weight_decay=0.1)
    x_shape, n = self.shapes[0]
    x, dy, kernel, state = random_inputs(seed, opt, x_shape, n, dtypes)
    dy = poison_tokens(
      dy, [(7, n - 1)], np.nan if where == "dy-nan" else np.inf
    )
    old = host_copy((kernel, state))
    expected = self.reference(opt, x, dy, kernel, state, 3)
    actual = self.run(opt, x, dy, kernel, state, 3, config=self.first_config())
    assert int(actual[2]) == int(expected[2]) == kernel.size
    for old_leaf, a, e in zip(
      jax.tree.leaves(old),
      jax.tree.leaves(actual[:2]),
      jax.tree.leaves(expected[:2]),
    ):
      assert_bitwise_equal(a, old_leaf, "kernel output")
      assert_bitwise_equal(e, old_leaf, "reference")

  def fused_op_with_nonfinite_dy_does_not_step_cases(self):
    shape = self.shapes[1 % len(self.shapes)]
    return [Case(shape_id(shape), (shape,))]

  def test_fused_op_with_nonfinite_dy_does_not_step(self, case, seed):
    """Through the custom_vjp: any non-finite dy (or a dx that overflows)
    -> apply=False, so the layer's variables come back bit for bit, count
    does not increment, and skipped is the kernel size. A finite dy steps
    the layer and increments count."""
    opt = fj.adam(0.05)
    ((x_shape, n),) = case.args
    x, dy, kernel, _ = random_inputs(
      seed, opt, x_shape, n, self.dtypes((F32, F32, F32))
    )
    variables = fj.init_variables(opt, kernel)._replace(count=jnp.float32(4.0))
    bias = jnp.zeros((n,), F32)
    spec = fj.FusedDenseSpec(
      optimizer=opt, implementation=self.implementation, dtype=dy.dtype
    )
    _, vjp = jax.vjp(lambda v: fj.forge_dense(x, v, bias, spec), variables)

    (stepped,) = vjp(dy)
    assert float(stepped.count) == 5.0
    assert float(stepped.skipped) == 0.0
    assert (np.asarray(stepped.kernel) != np.asarray(kernel)).all()

    # A non-finite dy, with x a constant (no dx: the flag reads dy) and
    # differentiated (the flag reads dx's first column); then a finite dy
    # whose dx = dy @ kernel.T overflows float32 while dW stays finite.
    def vjp_with_dx(variables):
      _, vjp = jax.vjp(
        lambda v, x: fj.forge_dense(x, v, bias, spec), variables, x
      )
      return lambda dy: vjp(dy)[:1]

    huge = variables._replace(kernel=kernel * 1e30)
    poisoned = poison_tokens(dy, [(15, n - 1)])
    for layer_vjp, before, cotangent in (
      (vjp, variables, poisoned),
      (vjp_with_dx(variables), variables, poisoned),
      (vjp_with_dx(huge), huge, dy * 1e10),
    ):
      (skipped,) = layer_vjp(cotangent)
      assert float(skipped.count) == 4.0
      assert float(skipped.skipped) == kernel.size
      assert float(skipped.intact) == 1.0
      assert_bitwise_equal(skipped.kernel, before.kernel, "kernel")
      for a, e in zip(
        jax.tree.leaves(skipped.opt_state), jax.tree.leaves(before.opt_state)
      ):
        assert_bitwise_equal(a, e, "state")

  # -------------------------------------------------------------------------
  # bf16 weights with stochastic rounding and int8 states: the same bits.

  def matches_reference_bits_bf16_sr_int8_cases(self):
    """One case per optimizer (cycling through shapes and configs), then
    AdamW on the remaining shape and config combinations."""
    combos = list(itertools.product(self.lowp_shapes, self.lowp_configs))
    picks = [
      (opt, combos[i % len(combos)]) for i, opt in enumerate(LOWP_OPTIMIZERS)
    ]
    picks += [(LOWP_OPTIMIZERS[0], combo) for combo in combos[1:]]
    return [
      Case(f"{name}-{shape_id(shape)}-{config}", (opt, shape, config))
      for (name, opt), (shape, config) in picks
    ]

  def test_matches_reference_bits_bf16_sr_int8(self, case, seed):
    """Three consecutive steps (count 4, 5, 6), each from the reference's
    previous state: kernel, codes, scales and skipped agree bit for bit, and
    the steps moved the weights and states."""
    self.check_lowp_steps(*case.args, seed)

  #: Whether the backend takes 4-bit second moments (else it must refuse).
  takes_4bit_second_moments = True
  #: Whether the backend takes kernels of partial tiles (else the 4-bit
  #: cases keep the shapes' N).
  takes_partial_tiles = True

  def matches_reference_bits_4bit_cases(self):
    """Each optimizer with a second moment on the shapes and configs in
    turn, with an odd N where the backend takes partial tiles (each row's
    last block is partial, its codes padded)."""
    shapes = self.lowp_shapes
    if self.takes_partial_tiles:
      shapes = [(x_shape, n | 1) for x_shape, n in shapes]
    combos = list(itertools.product(shapes, self.lowp_configs))
    return [
      Case(f"{name}-{shape_id(shape)}-{config}", (opt, shape, config))
      for i, (name, opt) in enumerate(FOURBIT_OPTIMIZERS)
      for shape, config in [combos[i % len(combos)]]
    ]

  def test_matches_reference_bits_4bit(self, case, seed):
    """int8 states with 4-bit second moments: the same three steps, bit for
    bit; a backend without them refuses the call and says why."""
    opt = case.args[0]
    assert quantization.has_4bit(
      jax.eval_shape(opt.init, jax.ShapeDtypeStruct((8, 64), BF16))
    )
    if self.takes_4bit_second_moments:
      self.check_lowp_steps(*case.args, seed)
      return
    with pytest.raises(ValueError, match="second_moment_bits=4"):
      self.check_lowp_steps(*case.args, seed)

  def check_lowp_steps(self, opt, lowp_shape, config, seed):
    """The steps of :meth:`test_matches_reference_bits_bf16_sr_int8`."""
    x_shape, n = lowp_shape
    k = x_shape[-1]
    spec = FusedDenseSpec(optimizer=opt, implementation=self.implementation)
    kernel_step = jax.jit(
      self.backend(spec, self.lowp_configs[config]), donate_argnums=(2, 3)
    )
    w = (0.5 * jax.random.normal(jax.random.key(seed), (k, n))).astype(BF16)
    state = opt.init(w)
    for count in (4, 5, 6):
      x, dy = exact_inputs(
        seed + count,
        x_shape,
        n,
        self.activation_dtype(BF16 if count % 2 else F32),
      )
      scalars, apply = opt.scalars(jnp.int32(count)), jnp.bool_(True)
      expected = self.reference(
        opt, x, dy, w, state, count, apply, step=jnp.int32(count), layer_id=9
      )
      old = host_copy((w, state))
      key = rounding_key(opt, jnp.int32(count), layer_id=9)
      actual = host_copy(kernel_step(x, dy, w, state, scalars, apply, key))
      # Kernel, state and skipped count; the gradient's sum of squares
      # follows each backend's summation order.
      assert_same_bits(actual[:3], expected[:3], f"count={count}")
      assert (bits(expected[0]) != bits(old[0])).mean() > 0.3
      w, state = jax.tree.map(jnp.asarray, expected[:2])
    for leaf in jax.tree.leaves(state):
      assert np.isfinite(np.asarray(leaf).astype(np.float32)).all()

  def nonfinite_gradients_keep_int8_blocks_bit_for_bit_cases(self):
    shape, config = self.lowp_shapes[0], next(iter(self.lowp_configs))
    opts = [LOWP_OPTIMIZERS[0]]
    if self.takes_4bit_second_moments:
      opts.append(("adamw-4bit", FOURBIT_OPTIMIZERS[0][1]))
    return [
      Case(f"{name}-{shape_id(shape)}-{config}", (opt, shape, config))
      for name, opt in opts
    ]

  def test_nonfinite_gradients_keep_int8_blocks_bit_for_bit(self, case, seed):
    """A NaN in x makes a row of dW non-finite: that row's blocks keep their
    codes and scales bit for bit (and the bf16 weights); a non-finite dy
    skips the whole layer."""
    opt, (x_shape, n), config = case.args
    config = self.lowp_configs[config]
    x, dy = exact_inputs(seed, x_shape, n, self.activation_dtype(F32))
    w = (
      0.5 * jax.random.normal(jax.random.key(seed), (x_shape[-1], n))
    ).astype(BF16)

    def run(x, dy, w, state, apply, step):
      return self.run(
        opt,
        x,
        dy,
        jnp.copy(w),
        jax.tree.map(jnp.copy, state),
        2,
        config=config,
        apply=apply,
        step=jnp.int32(step),
        layer_id=1,
      )

    state = run(x, dy, w, opt.init(w), jnp.bool_(True), 1)[1]
    old = (np.asarray(w), state)
    w, state = jax.tree.map(jnp.asarray, old)
    out = run(poison_tokens(x, [(5, 17)]), dy, w, state, jnp.bool_(True), 2)
    assert int(out[2]) == n
    assert_bitwise_equal(out[0][17], old[0][17], "weights of the NaN row")
    assert (bits(out[0][16]) != bits(old[0][16])).any()
    for new_leaf, old_leaf in ((out[1].mu, old[1].mu), (out[1].nu, old[1].nu)):
      assert_bitwise_equal(new_leaf.codes[17], old_leaf.codes[17], "codes")
      assert_bitwise_equal(new_leaf.scale[17], old_leaf.scale[17], "scales")
      assert (bits(new_leaf.codes[16]) != bits(old_leaf.codes[16])).any() or (
        bits(new_leaf.scale[16]) != bits(old_leaf.scale[16])
      ).any()
    out = run(
      x, poison_tokens(dy, [(3, 0)], np.inf), w, state, jnp.bool_(False), 2
    )
    assert int(out[2]) == w.size
    assert_same_bits(out[:2], old, "skipped layer")

  def overflowing_int8_moments_are_skipped_cases(self):
    return self.nonfinite_gradients_keep_int8_blocks_bit_for_bit_cases()

  def test_overflowing_int8_moments_are_skipped(self, case, seed):
    """A finite dW row whose square overflows float32 would store NaN
    blocks of ``nu`` (an int8 block stores a non-finite value as a NaN
    scale), and the next step would write NaN over their weights. Every
    backend skips the row instead (counted): its weights and blocks keep
    their bits, and the next step stays finite."""
    opt, (x_shape, n), config = case.args
    config = self.lowp_configs[config]
    x, dy = exact_inputs(seed, x_shape, n, self.activation_dtype(F32))
    # dy's token 5 all ones: below, x's (5, 17) spikes all of dW's row 17.
    dy = poison_tokens(dy, [(5, column) for column in range(n)], 1.0)
    w = (
      0.5 * jax.random.normal(jax.random.key(seed), (x_shape[-1], n))
    ).astype(BF16)

    def run(x, w, state, step):
      return self.run(
        opt,
        x,
        dy,
        jnp.copy(w),
        jax.tree.map(jnp.copy, state),
        step,
        config=config,
        step=jnp.int32(step),
        layer_id=1,
      )

    state = run(x, w, opt.init(w), 1)[1]
    old = (np.asarray(w), state)
    w, state = jax.tree.map(jnp.asarray, old)
    # dW[17] ~ 1e20: finite, its square is not.
    spiked = poison_tokens(x, [(5, 17)], 1e20)
    out = run(spiked, w, state, 2)
    assert int(out[2]) == n
    assert_bitwise_equal(out[0][17], old[0][17], "weights of the spiked row")
    for new_leaf, old_leaf in ((out[1].mu, old[1].mu), (out[1].nu, old[1].nu)):
      assert_bitwise_equal(new_leaf.codes[17], old_leaf.codes[17], "codes")
      assert_bitwise_equal(new_leaf.scale[17], old_leaf.scale[17], "scales")
      assert np.isfinite(new_leaf.scale).all()
    w, state = jax.tree.map(jnp.asarray, out[:2])
    out = run(x, w, state, 3)
    assert int(out[2]) == 0
    assert np.isfinite(np.asarray(out[0], F32)).all()

  def nan_int8_blocks_propagate_cases(self):
    shape, config = self.lowp_shapes[0], next(iter(self.lowp_configs))
    return [Case(f"{shape_id(shape)}-{config}", (shape, config))]

  def test_nan_int8_blocks_propagate(self, case, seed):
    """A block stored as non-finite (NaN scale) in ``mu`` or ``nu`` is an
    input NaN: it propagates to that block's weights and moment, as a NaN
    float state would, and is not counted as skipped; every other element
    steps as in the reference, bit for bit."""
    opt = LOWP_OPTIMIZERS[0][1]
    (x_shape, n), config = case.args
    k = x_shape[-1]
    x, dy = exact_inputs(seed, x_shape, n, self.activation_dtype(F32))
    w = (0.5 * jax.random.normal(jax.random.key(seed), (k, n))).astype(BF16)
    state = self.reference(opt, x, dy, w, opt.init(w), 1, step=jnp.int32(1))[1]
    mu_block, nu_block = (3, 1), (k - 1, 0)
    state = state._replace(
      mu=state.mu._replace(scale=poison(state.mu.scale, mu_block)),
      nu=state.nu._replace(scale=poison(state.nu.scale, nu_block)),
    )
    w = jnp.asarray(w)
    expected = self.reference(opt, x, dy, w, state, 2, step=jnp.int32(2))
    actual = self.run(
      opt,
      x,
      dy,
      jnp.copy(w),
      jax.tree.map(jnp.copy, state),
      2,
      config=self.lowp_configs[config],
      step=jnp.int32(2),
    )
    spots = np.zeros((k, n), bool)
    for row, block in (mu_block, nu_block):
      spots[row, block * 64 : (block + 1) * 64] = True
    assert int(actual[2]) == int(expected[2]) == 0
    for out in (expected, actual):
      np.testing.assert_array_equal(np.isnan(np.asarray(out[0], F32)), spots)
      for leaf, block in ((out[1].mu, mu_block), (out[1].nu, nu_block)):
        nan_scales = np.zeros(leaf.scale.shape, bool)
        nan_scales[block] = True
        np.testing.assert_array_equal(np.isnan(leaf.scale), nan_scales)
    # NaN's payload is the hardware's: compared where the values are finite.
    finite = lambda out: jax.tree.map(
      lambda a: (
        np.where(np.isnan(a), 0, a)
        if jnp.issubdtype(a.dtype, jnp.floating)
        else a
      ),
      host_copy(out[:2]),
    )
    self.assert_lowp_rule_matches(
      finite(actual), finite(expected), "NaN blocks"
    )

  # -------------------------------------------------------------------------
  # Training through ForgeDense == nn.Dense + the optax alias.

  def matches_optax_cases(self):
    """The core rows first (see ``OptaxCase.core``), then the others."""
    ordered = sorted(OPTAX_CASES, key=lambda case: not case.core)
    return [Case(case.id, case) for case in ordered]

  def test_matches_optax(self, case, seed):
    name, kwargs, shape = case.args.name, case.args.kwargs, case.args.shape
    opt = getattr(fj, name)(**kwargs)
    ref_tx = getattr(optax, name)(**kwargs)  # the optax alias, built directly
    forge_model = MLP(
      FEATURES, optimizer=opt, implementation=self.implementation
    )
    ref_model = MLP(FEATURES)

    x0, _ = make_batch(seed, shape, CLASSES)
    key = jax.random.key(seed)
    forge_vars = forge_model.init(key, x0)
    ref_vars = ref_model.init(key, x0)
    for layer in ref_vars["params"]:  # same initial weights, loaded by path
      np.testing.assert_array_equal(
        forge_vars[COLL][layer]["kernel"], ref_vars["params"][layer]["kernel"]
      )
    kernel_and_state_bytes = forge_bytes(forge_vars)
    initial_kernels = {
      layer: np.array(v["kernel"]) for layer, v in forge_vars[COLL].items()
    }

    if name == "radam":
      rectify = {float(opt.scalars(jnp.int32(c)).rectify) for c in range(STEPS)}
      assert rectify == {0.0, 1.0}, "both RAdam branches must be exercised"

    batches = make_batches(seed + 1, STEPS, shape, CLASSES)
    with self.precision():
      forge_run = run_steps(forge_model, forge_vars, opt.to_optax(), batches)
      ref_run = run_steps(ref_model, ref_vars, ref_tx, batches)

    # jit: traced once, nothing compiled after the first step.
    for run in (forge_run, ref_run):
      assert run.traces == 1
      assert run.compiles_after_first == 0
    # Donation: the step aliases (at least) every kernel and state buffer to
    # its output, and the donated input buffers were really given up.
    assert forge_run.alias_bytes >= kernel_and_state_bytes > 0
    assert forge_run.donated_deleted

    bf16_state = jnp.bfloat16 in (
      kwargs.get("mu_dtype"),
      kwargs.get("accumulator_dtype"),
    )
    rtol = BF16_STATE_RTOL if bf16_state else RTOL
    for step, (forge_state, ref_state) in enumerate(
      zip(forge_run.states, ref_run.states)
    ):
      compare_states(step, forge_state, ref_state, rtol)
    np.testing.assert_allclose(forge_run.losses, ref_run.losses, rtol=rtol)
    # The run is not trivial: every kernel moved.
    for layer, initial in initial_kernels.items():
      final = forge_run.states[-1].params[COLL][layer]["kernel"]
      assert np.abs(final - initial).max() > 0, layer
