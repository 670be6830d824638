"""The Pallas kernel (interpret mode) against the XLA reference backend.

``triton_kernel.triton_update`` and ``backends.xla_update`` have the same
contract: ``(spec, x, dy, kernel, opt_state, scalars, apply) -> (new kernel,
new state, skipped)``. Both apply the same float32 rule
(``forge_jax.ops.update.apply_update``); they differ in how ``dW = x.T @ dy``
is formed: XLA's dot_general vs. float32 accumulation over ``block_t``-token
slabs inside each ``block_k x block_n`` tile. The results therefore differ
only by the rounding of a differently ordered float32 sum:

* float32 outputs: ~1e-7 relative; checked at 1e-5 relative (to the leaf norm,
  and per element up to 1e-5 of the leaf's largest magnitude).
* bfloat16 outputs: the float32 results, ~1e-7 apart, are rounded to bf16
  (8 bits of mantissa); where they straddle a rounding boundary the stored
  values differ by one bf16 ulp. So: at most 1 ulp anywhere and >= 99% of
  the elements bit-identical (a boundary is hit with probability ~1e-4).

Every call uses a small explicit TritonConfig (16x16 tiles, 16-token slabs)
on odd shapes, so there are several tiles, masked K/N edges and a masked
token tail. The kernel runs inside ``jax.jit`` with the kernel and state
donated, so its aliased outputs are the very buffers of its inputs (what the
GPU kernel does in place); the reference is computed first, from its own
buffers, and every input is copied to the host before the donated call.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax as fj
from forge_jax.ops import backends, triton_kernel
from forge_jax.ops.fused_dense import FusedDenseSpec

from conftest import (assert_bitwise_equal, bits, host_copy, poison,
                      ulp_distance)

F32, BF16 = jnp.float32, jnp.bfloat16
# Small explicit tiles, so the odd shapes below span several tiles with
# masked edges. 'b16': 16x16 tiles, grouped launch order in groups of 2
# K-blocks (3 K-blocks: a full group and a partial one). 'b32-split2':
# 16x32 tiles whose epilogue runs in two 16-column chunks (N=24: the second
# chunk half masked; N=8 and N=3: fully masked).
CONFIGS = {
    "b16": triton_kernel.TritonConfig(block_k=16, block_n=16, block_t=16,
                                      group_k=2, epilogue_split=1),
    "b32-split2": triton_kernel.TritonConfig(block_k=16, block_n=32,
                                             block_t=16, epilogue_split=2),
}
CONFIG = CONFIGS["b16"]

# x.shape (rank 2 or 3; the last axis is K) and N. None is a multiple of 16:
# 37 / 33 tokens leave a masked tail slab, K = 40 / 33 / 5 and N = 24 / 8 / 3
# leave masked tile edges.
SHAPES = [
    ((37, 40), 24),     # 3x2 tiles, 3 slabs
    ((3, 11, 33), 8),   # rank-3 x (33 tokens), 3x1 tiles, N < one tile
    ((2, 3, 5), 3),     # a layer smaller than one tile
]

_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 20)

# (id, optimizer, count). Learning rates are large enough that a step moves
# bf16 weights by more than their ulp. RAdam runs at a count on each side of
# its threshold (b2=0.9: un-rectified up to t=5, rectified from t=6).
OPTIMIZERS = [
    ("adam", fj.adam(0.05), 3),
    ("adamw-schedule", fj.adamw(_SCHEDULE, weight_decay=optax.linear_schedule(
        0.1, 0.0, 10)), 4),
    ("nadam", fj.nadam(0.05, b1=0.8), 5),
    ("nadamw", fj.nadamw(0.05, weight_decay=0.1), 2),
    ("radam-unrectified", fj.radam(0.05, b2=0.9), 1),
    ("radam-rectified", fj.radam(0.05, b2=0.9, nesterov=True), 9),
    ("lion", fj.lion(0.05, weight_decay=0.1), 5),
    ("rmsprop-centered-nesterov", fj.rmsprop(
        0.05, centered=True, momentum=0.9, nesterov=True), 3),
    ("rmsprop-bias-correction", fj.rmsprop(
        0.05, bias_correction=True, eps_in_sqrt=False, initial_scale=0.5), 2),
    ("adagrad", fj.adagrad(0.1), 6),
    ("sgd", fj.sgd(0.1), 0),
    ("sgd-nesterov", fj.sgd(0.1, momentum=0.9, nesterov=True), 7),
]

# (kernel dtype, state dtype, activation dtype).
DTYPES = [(F32, F32, F32), (BF16, BF16, BF16), (F32, BF16, BF16),
          (BF16, F32, F32)]


def _dtype_id(combo):
  return "k{}-s{}-x{}".format(*(jnp.dtype(d).name.replace("float", "f")
                                for d in combo))


def _shape_id(shape):
  return f"x{shape[0]}n{shape[1]}".replace(" ", "")


def _cases():
  """Every optimizer with every dtype combination; shapes and tile configs
  cycle through (every optimizer meets every shape and both configs)."""
  cases = []
  config_names = sorted(CONFIGS)
  for (i, (name, opt, count)), (j, combo) in itertools.product(
      enumerate(OPTIMIZERS), enumerate(DTYPES)):
    shape = SHAPES[(i + j) % len(SHAPES)]
    config = config_names[j % len(config_names)]
    cases.append(pytest.param(
        name, opt, count, combo, shape, config,
        id=f"{name}-{_dtype_id(combo)}-{_shape_id(shape)}-{config}"))
  return cases


# ---------------------------------------------------------------------------
# Helpers.


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
      elif field == "nu":          # >= mu**2 (RMSprop centered: var >= 0)
        fields[field] = mu * mu + jax.random.uniform(next(keys), (k, n),
                                                     minval=0.01, maxval=0.1)
      elif field == "sum_of_squares":
        fields[field] = jax.random.uniform(next(keys), (k, n), minval=0.1,
                                           maxval=1.0)
      elif field == "mu":
        fields[field] = mu
      else:
        fields[field] = 0.1 * normal((k, n))
    state = type(state)(**fields)
  state = jax.tree.map(lambda s: s.astype(state_dtype), state)
  return x, dy, kernel, state


def run_reference(opt, x, dy, kernel, state, count, apply=None):
  spec = FusedDenseSpec(optimizer=opt, implementation="xla")
  if apply is None:
    apply = jnp.all(jnp.isfinite(dy))  # as the fused op's backward does
  scalars = opt.scalars(jnp.asarray(count, jnp.int32))
  fn = jax.jit(functools.partial(backends.xla_update, spec))
  return host_copy(fn(x, dy, kernel, state, scalars, apply))


def run_kernel(opt, x, dy, kernel, state, count, apply=None, config=CONFIG):
  """The Pallas kernel in interpret mode, jitted, kernel and state donated."""
  spec = FusedDenseSpec(optimizer=opt, implementation="triton")
  if apply is None:
    apply = jnp.all(jnp.isfinite(dy))
  scalars = opt.scalars(jnp.asarray(count, jnp.int32))

  def call(x, dy, kernel, state, scalars, apply):
    return triton_kernel.triton_update(spec, x, dy, kernel, state, scalars,
                                       apply, config=config, interpret=True)

  fn = jax.jit(call, donate_argnums=(2, 3))
  out = fn(x, dy, kernel, state, scalars, apply)
  return host_copy(out)


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
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=what)
  else:
    ulps = ulp_distance(actual, expected)
    # Near zero (a state that cancels, b1 m ~ -(1 - b1) g) the sum order's
    # float32 difference in dW spans many ulps: there, as for float32
    # leaves, an absolute error of 1e-5 of the leaf's scale is allowed.
    far = ulps > 1
    error = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    scale = np.abs(expected.astype(np.float64)).max()
    assert (error[far] <= 1e-5 * scale).all(), (
        f"{what}: {ulps.max()} ulp apart")
    assert (ulps == 0).mean() >= 0.99, (
        f"{what}: {(ulps != 0).sum()} of {ulps.size} elements 1 ulp apart")


def assert_leaves_match(actual, expected, what):
  names = ["kernel"] + [f"state.{f}" for f, v in expected[1]._asdict().items()
                        if v is not None]
  leaves_a = jax.tree.leaves(actual[:2])
  leaves_e = jax.tree.leaves(expected[:2])
  assert len(leaves_a) == len(leaves_e) == len(names)
  for name, a, e in zip(names, leaves_a, leaves_e):
    assert_outputs_match(a, e, f"{what} {name}")


# ---------------------------------------------------------------------------
# Kernel == reference.


@pytest.mark.parametrize("name,opt,count,dtypes,shape,config", _cases())
def test_kernel_matches_reference(name, opt, count, dtypes, shape, config,
                                  seed):
  x_shape, n = shape
  inputs = random_inputs(seed, opt, x_shape, n, dtypes)
  old_kernel, old_state = host_copy(inputs[2:])
  expected = run_reference(opt, *inputs, count)
  actual = run_kernel(opt, *inputs, count, config=CONFIGS[config])

  assert_leaves_match(actual, expected, "")
  assert int(actual[2]) == int(expected[2]) == 0  # nothing skipped
  # The step did something: the kernel moved (in every dtype).
  assert (bits(expected[0]) != bits(old_kernel)).mean() > 0.5
  if name.startswith("radam"):
    rectify = float(opt.scalars(jnp.int32(count)).rectify)
    assert rectify == (1.0 if name == "radam-rectified" else 0.0)
  # Every state leaf took a step too (bf16 leaves: most elements).
  for old_leaf, new_leaf in zip(jax.tree.leaves(old_state),
                                jax.tree.leaves(expected[1])):
    assert (bits(new_leaf) != bits(old_leaf)).mean() > 0.5


# Optimizers whose zero-initialized state changes in every element on the
# first step whenever dW != 0 (every state name: mu, nu, trace,
# sum_of_squares), and whose kernel step is never below a float32 ulp.
COVERAGE_OPTIMIZERS = [
    ("adam", fj.adam(0.05)),
    ("rmsprop-centered-momentum", fj.rmsprop(0.05, centered=True,
                                             momentum=0.9)),
    ("adagrad-zero-init", fj.adagrad(0.1, initial_accumulator_value=0.0)),
    ("lion", fj.lion(0.05)),
]


@pytest.mark.parametrize("opt,shape,config", [
    pytest.param(opt, shape, config, id=f"{name}-{_shape_id(shape)}-{config}")
    for i, (name, opt) in enumerate(COVERAGE_OPTIMIZERS)
    for j, shape in enumerate(SHAPES)
    for config in [sorted(CONFIGS)[(i + j) % len(CONFIGS)]]])
def test_every_element_is_written(opt, shape, config, seed):
  """The outputs alias the inputs, so an element the kernel failed to store
  would silently keep its OLD value. Choose inputs where the reference
  changes every element of the kernel and of every state leaf (first step
  from the zero state: asserted below, so the test cannot pass vacuously);
  then agreement with the reference proves every element was written,
  masked edges included."""
  x_shape, n = shape
  inputs = random_inputs(seed, opt, x_shape, n, (F32, F32, F32),
                         zero_state=True)
  old = host_copy(inputs[2:])
  expected = run_reference(opt, *inputs, 0)
  actual = run_kernel(opt, *inputs, 0, config=CONFIGS[config])
  for old_leaf, new_leaf in zip(jax.tree.leaves(old),
                                jax.tree.leaves(expected[:2])):
    assert (bits(old_leaf) != bits(new_leaf)).all(), "precondition"
  for old_leaf, new_leaf in zip(jax.tree.leaves(old),
                                jax.tree.leaves(actual[:2])):
    assert (bits(old_leaf) != bits(new_leaf)).all(), "element not written"
  assert_leaves_match(actual, expected, "")
  assert int(actual[2]) == int(expected[2]) == 0


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES[:2], ids=_shape_id)
def test_poisoned_elements_stay_in_place(shape, config, seed):
  """NaN planted in the kernel and state inputs at tile corners and at the
  masked last row/column must come out NaN at exactly those positions (the
  rule propagates NaN; dW is finite, so the element is updated, not skipped)
  and nowhere else: tiles and masked edges index the right elements."""
  opt = fj.rmsprop(0.05, centered=True, momentum=0.9)
  x_shape, n = shape
  x, dy, kernel, state = random_inputs(seed, opt, x_shape, n, (F32, F32, F32))
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
  expected = run_reference(opt, x, dy, kernel, state, 2)
  actual = run_kernel(opt, x, dy, kernel, state, 2, config=CONFIGS[config])

  # A NaN kernel element gives a NaN new kernel there; a NaN trace gives a
  # NaN new trace and kernel (kernel + trace); nu and mu stay clean.
  expected_nans = {"kernel": kernel_spots | state_spots, "nu": ~state_spots &
                   state_spots, "mu": ~state_spots & state_spots,
                   "trace": state_spots}
  for name, a, e in zip(["kernel", "nu", "mu", "trace"],
                        jax.tree.leaves(actual[:2]),
                        jax.tree.leaves(expected[:2])):
    spots = expected_nans[name]
    np.testing.assert_array_equal(np.isnan(e), spots, err_msg=f"ref {name}")
    np.testing.assert_array_equal(np.isnan(a), spots, err_msg=name)
    assert_outputs_match(a[~spots], e[~spots], name)
  assert int(actual[2]) == int(expected[2]) == 0


# ---------------------------------------------------------------------------
# Non-finite gradients.

NONFINITE_OPTIMIZERS = [
    ("adamw", fj.adamw(0.05, weight_decay=0.1)),
    ("lion", fj.lion(0.05)),
    ("rmsprop-centered-momentum", fj.rmsprop(0.05, centered=True,
                                             momentum=0.9)),
    ("sgd", fj.sgd(0.1)),
]


@pytest.mark.parametrize("dtypes", [(F32, F32, F32), (BF16, BF16, BF16)],
                         ids=_dtype_id)
@pytest.mark.parametrize("opt", [o for _, o in NONFINITE_OPTIMIZERS],
                         ids=[n for n, _ in NONFINITE_OPTIMIZERS])
def test_nonfinite_gradient_elements_are_skipped(opt, dtypes, seed):
  """inf / nan in columns of x make whole rows of dW non-finite. Exactly those
  elements keep their old kernel and state bit for bit; skipped counts them
  in both backends; every other element is updated as in the reference."""
  x_shape, n = SHAPES[0]
  x, dy, kernel, state = random_inputs(seed, opt, x_shape, n, dtypes)
  k = kernel.shape[0]
  x = poison(x, np.s_[5, 3], np.inf)          # row 3 of dW: +-inf (or nan)
  x = poison(x, np.s_[36, k - 1], np.nan)     # last row (masked tile edge)
  x = poison(x, np.s_[20, 17], -np.inf)       # a row inside the second tile
  grad = np.asarray(backends.weight_gradient(x, dy))
  bad = ~np.isfinite(grad)
  assert bad[[3, 17, k - 1]].all() and bad.sum() == 3 * n  # precondition
  old = host_copy((kernel, state))
  expected = run_reference(opt, x, dy, kernel, state, 3)
  actual = run_kernel(opt, x, dy, kernel, state, 3)

  assert int(actual[2]) == int(expected[2]) == int(bad.sum())
  for old_leaf, a, e in zip(jax.tree.leaves(old), jax.tree.leaves(actual[:2]),
                            jax.tree.leaves(expected[:2])):
    assert_bitwise_equal(a[bad], old_leaf[bad], "kernel output, skipped")
    assert_bitwise_equal(e[bad], old_leaf[bad], "reference, skipped")
    assert_outputs_match(a[~bad], e[~bad], "updated elements")
    assert (bits(e[~bad]) != bits(old_leaf[~bad])).mean() > 0.5


@pytest.mark.parametrize("where", ["dy-nan", "dy-inf"])
@pytest.mark.parametrize("dtypes", [(F32, F32, F32), (BF16, BF16, BF16)],
                         ids=_dtype_id)
def test_nonfinite_dy_skips_the_whole_layer_in_both_backends(where, dtypes,
                                                             seed):
  opt = fj.adamw(0.05, weight_decay=0.1)
  x_shape, n = SHAPES[0]
  x, dy, kernel, state = random_inputs(seed, opt, x_shape, n, dtypes)
  dy = poison(dy, np.s_[7, n - 1], np.nan if where == "dy-nan" else np.inf)
  old = host_copy((kernel, state))
  expected = run_reference(opt, x, dy, kernel, state, 3)
  actual = run_kernel(opt, x, dy, kernel, state, 3)
  assert int(actual[2]) == int(expected[2]) == kernel.size
  for old_leaf, a, e in zip(jax.tree.leaves(old), jax.tree.leaves(actual[:2]),
                            jax.tree.leaves(expected[:2])):
    assert_bitwise_equal(a, old_leaf, "kernel output")
    assert_bitwise_equal(e, old_leaf, "reference")


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_fused_op_with_nonfinite_dy_does_not_step(implementation, seed):
  """Through the custom_vjp: any non-finite dy -> apply=False, so the layer's
  variables come back bit for bit, count does not increment, and skipped is
  the kernel size. A finite dy steps the layer and increments count."""
  opt = fj.adam(0.05)
  x_shape, n = SHAPES[1]
  x, dy, kernel, _ = random_inputs(seed, opt, x_shape, n, (F32, F32, F32))
  variables = fj.init_variables(opt, kernel)._replace(count=jnp.float32(4.0))
  bias = jnp.zeros((n,), F32)
  spec = fj.FusedDenseSpec(optimizer=opt, implementation=implementation)
  _, vjp = jax.vjp(lambda v: fj.forge_dense(x, v, bias, spec), variables)

  (stepped,) = vjp(dy)
  assert float(stepped.count) == 5.0
  assert float(stepped.skipped) == 0.0
  assert (np.asarray(stepped.kernel) != np.asarray(kernel)).all()

  (skipped,) = vjp(poison(dy, np.s_[1, 4, n - 1]))
  assert float(skipped.count) == 4.0
  assert float(skipped.skipped) == kernel.size
  assert float(skipped.intact) == 1.0
  assert_bitwise_equal(skipped.kernel, kernel, "kernel")
  for a, e in zip(jax.tree.leaves(skipped.opt_state),
                  jax.tree.leaves(variables.opt_state)):
    assert_bitwise_equal(a, e, "state")


# ---------------------------------------------------------------------------
# Backend selection and the compiled kernel.


def test_auto_selects_xla_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("checks the CPU fallback")
  opt = fj.sgd(0.1)
  x, dy, kernel = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.ones((3, 2))
  assert backends.select("auto", x, dy, kernel, opt) is backends.xla_update
  assert backends.select("triton", x, dy, kernel, opt) is (
      triton_kernel.triton_update)
  with pytest.raises(ValueError, match="no tokens"):
    backends.select("triton", jnp.ones((0, 3)), jnp.ones((0, 2)), kernel, opt)


@pytest.mark.gpu
@pytest.mark.parametrize("name,opt,count", OPTIMIZERS[:6],
                         ids=[c[0] for c in OPTIMIZERS[:6]])
def test_compiled_kernel_matches_reference_on_gpu(name, opt, count, seed):
  del name
  x, dy, kernel, state = random_inputs(seed, opt, (300, 200), 136,
                                       (F32, F32, F32))
  # The kernel's float32 dot is IEEE; XLA's default on a GPU is TF32, which
  # alone moves the reference by ~2e-5. Compare against a full-precision one.
  with jax.default_matmul_precision("highest"):
    expected = run_reference(opt, x, dy, kernel, state, count)
  spec = FusedDenseSpec(optimizer=opt, implementation="triton")
  scalars = opt.scalars(jnp.int32(count))
  actual = host_copy(jax.jit(functools.partial(
      triton_kernel.triton_update, spec, interpret=False))(
          x, dy, kernel, state, scalars, jnp.bool_(True)))
  assert_leaves_match(actual, expected, "gpu")
  assert int(actual[2]) == int(expected[2])
