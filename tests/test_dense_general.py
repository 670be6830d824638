"""``fj.ForgeDenseGeneral``: nn.DenseGeneral's layer, trained by FORGE.

* Its kernel is nn.DenseGeneral's (shape, initialization, path), and so is
  its forward, bit for bit.
* Its step is ForgeDense's on the kernel's ``[K, N]`` view, bit for bit, on
  every backend and optimizer, int8 states and stochastic rounding
  included; the optimizer state lives on that view.
* Trained against nn.DenseGeneral + the optax alias (the optimizer table of
  fused_dense_test_base), unrolled and inside fj.scan.
* Tensor parallelism with tuple axes (heads sharded) equals one device.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

import forge_jax as fj
from forge_jax import parallel

from conftest import (
  COLL,
  assert_bitwise_equal,
  assert_rel_close,
  assert_same_bits,
  host_copy,
  make_batches,
  make_train_step,
  run_steps,
)
from fused_dense_test_base import (
  BF16_STATE_RTOL,
  LOWP_OPTIMIZERS,
  OPTAX_CASES,
  OPTIMIZERS,
  RTOL,
  moment_trees,
)

# (features, axis, input shape): a projection to heads, an output
# projection from heads, and axes that are neither last nor adjacent.
GEOMETRIES = [
  ((4, 3), -1, (2, 5, 6)),
  (6, (-2, -1), (2, 5, 4, 3)),
  ((3, 2), (0, 2), (4, 5, 6, 7)),
]
GEOMETRY_IDS = ["to-heads", "from-heads", "axes-0-2"]
CLASSES = 10


def _flat_inputs(x, axis, ndim):
  """``x`` as the fused op sees it: contracted axes last, merged."""
  axis = tuple(sorted(a % ndim for a in np.atleast_1d(axis)))
  free = tuple(d for d in range(ndim) if d not in axis)
  x = jnp.transpose(x, free + axis)
  return x.reshape(x.shape[: len(free)] + (-1,))


@pytest.mark.parametrize("features, axis, shape", GEOMETRIES, ids=GEOMETRY_IDS)
def test_kernel_bias_and_forward_are_dense_generals(features, axis, shape):
  opt = fj.adam(1e-2)
  x = jax.random.normal(jax.random.key(1), shape)
  ref = nn.DenseGeneral(
    features, axis=axis, bias_init=nn.initializers.normal(), name="proj"
  )
  forge = fj.ForgeDenseGeneral(
    features,
    axis=axis,
    bias_init=nn.initializers.normal(),
    optimizer=opt,
    name="proj",
  )
  ref_vars = ref.init(jax.random.key(0), x)
  forge_vars = forge.init(jax.random.key(0), x)
  kernel = forge_vars[COLL]["kernel"]
  assert_bitwise_equal(kernel, ref_vars["params"]["kernel"], "kernel")
  assert_bitwise_equal(
    forge_vars["params"]["bias"], ref_vars["params"]["bias"], "bias"
  )
  # The state is on the [K, N] view.
  k = int(np.prod([shape[a] for a in np.atleast_1d(axis)]))
  n = int(np.prod(features))
  for leaf in jax.tree.leaves(forge_vars[COLL]["opt_state"]):
    assert leaf.shape == (k, n)
  assert_bitwise_equal(
    forge.apply(forge_vars, x), ref.apply(ref_vars, x), "forward"
  )


def _one_step(model, variables, x, dy):
  """The updated FORGE variables and dx of one backward pass."""
  y, pullback = jax.vjp(lambda v, x: model.apply(v, x), variables, x)
  d_vars, dx = pullback(dy.reshape(y.shape).astype(y.dtype))
  return d_vars, dx


def _same_step_as_forge_dense(
  opt, implementation, geometry, dtype, seed, count=0
):
  """ForgeDenseGeneral's step (at step ``count``) is ForgeDense's on the
  [K, N] view, bit for bit: the same fused op on the same (reshaped)
  operands."""
  features, axis, shape = geometry
  key = jax.random.key(seed)
  x = jax.random.normal(key, shape, dtype)
  general = fj.ForgeDenseGeneral(
    features,
    axis=axis,
    optimizer=opt,
    implementation=implementation,
    param_dtype=dtype,
    name="proj",
  )
  dense = fj.ForgeDense(
    int(np.prod(features)),
    optimizer=opt,
    implementation=implementation,
    param_dtype=dtype,
    name="proj",
  )
  g_vars = general.init(key, x)
  g_vars[COLL]["count"] = jnp.float32(count)
  x_flat = _flat_inputs(x, axis, len(shape))
  d_vars = jax.tree.map(lambda v: v, dense.init(key, x_flat))
  view = d_vars[COLL]["kernel"].shape
  d_vars[COLL]["kernel"] = g_vars[COLL]["kernel"].reshape(view)
  d_vars["params"]["bias"] = g_vars["params"]["bias"].reshape(-1)
  d_vars[COLL]["count"] = g_vars[COLL]["count"]
  dy = jax.random.normal(jax.random.key(seed + 1), x_flat.shape[:-1] + view[1:])
  g_new, g_dx = jax.jit(lambda v, x, dy: _one_step(general, v, x, dy))(
    g_vars, x, dy
  )
  d_new, d_dx = jax.jit(lambda v, x, dy: _one_step(dense, v, x, dy))(
    d_vars, x_flat, dy
  )
  assert g_new[COLL]["kernel"].shape == g_vars[COLL]["kernel"].shape
  g_new[COLL]["kernel"] = g_new[COLL]["kernel"].reshape(view)
  g_new["params"]["bias"] = g_new["params"]["bias"].reshape(-1)
  assert_same_bits(g_new, d_new, "variables")
  assert_bitwise_equal(_flat_inputs(g_dx, axis, len(shape)), d_dx, "dx")
  moved = np.asarray(g_new[COLL]["kernel"]) != np.asarray(
    d_vars[COLL]["kernel"]
  )
  assert moved.any()
  return g_new


@pytest.mark.parametrize(
  "name, opt, count, geometry",
  [
    # Each geometry once by default (every optimizer steps through the same
    # fused op: test_fused_dense.py), every optimizer with --run-slow.
    pytest.param(
      name,
      opt,
      count,
      GEOMETRIES[i % len(GEOMETRIES)],
      id=name,
      marks=() if i < len(GEOMETRIES) else pytest.mark.slow,
    )
    for i, (name, opt, count) in enumerate(OPTIMIZERS)
  ],
)
def test_step_is_forge_dense_on_the_view(name, opt, count, geometry, seed):
  _same_step_as_forge_dense(opt, "xla", geometry, jnp.float32, seed, count)


@pytest.mark.parametrize(
  "name, opt",
  [
    # AdamW (two int8 moments) by default, the others with --run-slow.
    pytest.param(name, opt, id=name, marks=() if i == 0 else pytest.mark.slow)
    for i, (name, opt) in enumerate(LOWP_OPTIMIZERS)
  ],
)
def test_int8_states_and_stochastic_rounding(name, opt, seed):
  """bf16 weights with stochastic rounding and int8 states: the bits of
  ForgeDense on the view; the block scales are [K, ceil(N / 64)]."""
  geometry = ((2, 40), -1, (4, 8, 16))  # N = 80: two blocks, the last part
  new = _same_step_as_forge_dense(opt, "xla", geometry, jnp.bfloat16, seed)
  scales = [
    leaf.shape
    for leaf in jax.tree.leaves(new[COLL]["opt_state"])
    if leaf.dtype == jnp.float32
  ]
  assert scales and all(s == (16, 2) for s in scales), scales


@pytest.mark.parametrize(
  "implementation, geometry, dtype",
  [
    ("triton", GEOMETRIES[1], jnp.float32),
    # Mosaic GPU takes 16-bit activations, K and N in multiples of 128,
    # tokens in 64. forge_dense makes the [K, N] view for every backend
    # alike: the default run takes one interpret-mode kernel.
    pytest.param(
      "mosaic",
      ((2, 64), -1, (64, 128)),
      jnp.bfloat16,
      marks=pytest.mark.slow,
    ),
  ],
  ids=["triton", "mosaic"],
)
def test_kernels_in_interpret_mode(implementation, geometry, dtype, seed):
  opt = fj.adamw(1e-2, weight_decay=0.1)
  _same_step_as_forge_dense(opt, implementation, geometry, dtype, seed)


# ---------------------------------------------------------------------------
# Training against nn.DenseGeneral and the optax alias.


class HeadsMLP(nn.Module):
  """``[..., D] -> [..., 4, 4] -> gelu -> [..., classes]`` (an attention's
  projections to and from heads), ForgeDenseGeneral or nn.DenseGeneral."""

  optimizer: fj.ForgeOptimizer | None = None

  @nn.compact
  def __call__(self, x):
    layers = []
    for name, features, axis in (
      ("fc1", (4, 4), -1),
      ("fc2", CLASSES, (-2, -1)),
    ):
      if self.optimizer is None:
        layers.append(nn.DenseGeneral(features, axis=axis, name=name))
      else:
        layers.append(
          fj.ForgeDenseGeneral(
            features,
            axis=axis,
            optimizer=self.optimizer,
            implementation="xla",
            name=name,
          )
        )
    return layers[1](nn.gelu(layers[0](x)))


#: Core rows of these optimizers run by default (the ForgeDense table runs
#: every optimizer through the same fused op), every row with --run-slow.
DEFAULT_OPTIMIZERS = ("adamw",)


def _optax_params(cases):
  return [
    pytest.param(
      case,
      id=case.id,
      marks=()
      if case.core and case.name in DEFAULT_OPTIMIZERS
      else pytest.mark.slow,
    )
    for case in cases
  ]


@pytest.mark.parametrize("case", _optax_params(OPTAX_CASES))
def test_matches_optax(case, seed):
  """8 steps: kernels, biases and every per-element state leaf as
  nn.DenseGeneral trained by the optax alias (the state on the [K, N]
  view of optax's)."""
  opt = getattr(fj, case.name)(**case.kwargs)
  ref_tx = getattr(optax, case.name)(**case.kwargs)
  batches = make_batches(seed, 8, case.shape, CLASSES)
  ref_model, forge_model = HeadsMLP(), HeadsMLP(opt)
  ref_vars = ref_model.init(jax.random.key(seed), batches[0][0])
  forge_vars = fj.from_dense(ref_vars, forge_model, batches[0][0])
  forge_run = run_steps(forge_model, forge_vars, opt.to_optax(), batches)
  ref_run = run_steps(ref_model, ref_vars, ref_tx, batches)
  bf16_state = jnp.bfloat16 in (
    case.kwargs.get("mu_dtype"),
    case.kwargs.get("accumulator_dtype"),
  )
  rtol = BF16_STATE_RTOL if bf16_state else RTOL
  for step, (forge, ref) in enumerate(zip(forge_run.states, ref_run.states)):
    ref_moments = moment_trees(ref.opt_state)
    for layer in ("fc1", "fc2"):
      where = f"step {step + 1}, {layer}"
      forge_layer = forge.params[COLL][layer]
      ref_layer = ref.params["params"][layer]
      assert_rel_close(
        forge_layer["kernel"], ref_layer["kernel"], rtol, f"{where} kernel"
      )
      assert_rel_close(
        forge.params["params"][layer]["bias"],
        ref_layer["bias"],
        rtol,
        f"{where} bias",
      )
      state = forge_layer["opt_state"]._asdict()
      fields = {f: v for f, v in state.items() if v is not None}
      assert set(fields) == set(ref_moments), where
      for field, value in fields.items():
        expected = ref_moments[field][layer]["kernel"]
        assert value.dtype == expected.dtype, (where, field)
        assert_rel_close(
          value,
          expected.reshape(value.shape),
          rtol,
          f"{where} kernel {field}",
        )
  np.testing.assert_allclose(forge_run.losses, ref_run.losses, rtol=rtol)


class Block(nn.Module):
  """A residual block of two DenseGeneral projections, for a scan."""

  optimizer: fj.ForgeOptimizer | None = None

  @nn.compact
  def __call__(self, x, _):
    if self.optimizer is None:
      dense = nn.DenseGeneral
    else:
      dense = lambda *a, **k: fj.ForgeDenseGeneral(
        *a, optimizer=self.optimizer, implementation="xla", **k
      )
    h = nn.gelu(dense((2, 4), name="up")(x))
    return x + dense(x.shape[-1], axis=(-2, -1), name="down")(h), None


class Stack(nn.Module):
  optimizer: fj.ForgeOptimizer | None = None

  @nn.compact
  def __call__(self, x):
    scan = nn.scan if self.optimizer is None else fj.scan
    stack = scan(
      Block,
      variable_axes={True: 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,),
      length=3,
    )
    x, _ = stack(self.optimizer, name="layers")(x, None)
    return nn.Dense(CLASSES, name="head")(x)


def test_scan_matches_nn_scan_and_optax(seed):
  """fj.scan over ForgeDenseGeneral layers trains as nn.scan over
  nn.DenseGeneral with the optax alias; the stacked kernels keep the
  DenseGeneral shapes behind the layer axis."""
  opt = fj.adamw(1e-2, weight_decay=0.1)
  batches = make_batches(seed, 4, (2, 5, 6), CLASSES)
  ref_model, forge_model = Stack(), Stack(opt)
  ref_vars = ref_model.init(jax.random.key(seed), batches[0][0])
  forge_vars = fj.from_dense(ref_vars, forge_model, batches[0][0])
  layers = forge_vars[COLL]["layers"]
  assert layers["up"]["kernel"].shape == (3, 6, 2, 4)
  assert layers["down"]["kernel"].shape == (3, 2, 4, 6)
  assert layers["down"]["opt_state"].mu.shape == (3, 8, 6)
  forge_states = _train(
    fj.TrainState, forge_model, forge_vars, opt.to_optax(), batches
  )
  ref_states = _train(
    TrainState,
    ref_model,
    ref_vars,
    optax.adamw(1e-2, weight_decay=0.1),
    batches,
  )
  for step, (forge, ref) in enumerate(zip(forge_states, ref_states)):
    for path, leaf in jax.tree_util.tree_flatten_with_path(ref)[0]:
      ours = fj.to_dense(forge)
      for key in path:
        ours = ours[key.key]
      assert_rel_close(ours, leaf, RTOL, f"step {step + 1} {path}")


def _train(state_class, model, variables, tx, batches):
  """Host copies of the variables after each jitted step."""
  state = state_class.create(apply_fn=model.apply, params=variables, tx=tx)
  step = jax.jit(make_train_step())
  params = []
  for batch in batches:
    state, _ = step(state, batch)
    params.append(host_copy(state.params))
  return params


def _scan_step_memory(block):
  """The compiled memory of a donated fj.scan train step over ``block``."""
  opt = fj.adam(1e-3)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      # No remat: every residual of a layer's pullback is kept, so a
      # kernel residual that is not the stack itself is saved per layer.
      stack = fj.scan(
        block,
        variable_axes={True: 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=3,
      )
      return stack(opt)(x, None)[0]

  x = jnp.ones((2, 4, 64))
  model = Model()
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x),
    tx=opt.to_optax(),
  )

  def step(state):
    loss = lambda p: jnp.mean(state.apply_fn(p, x) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  return (
    jax.jit(step, donate_argnums=0).lower(state).compile().memory_analysis()
  )


class ViewBlock(nn.Module):
  """``[64] -> [64] -> [64]``: GeneralBlock's layers on their [K, N]
  views."""

  optimizer: fj.ForgeOptimizer

  @nn.compact
  def __call__(self, x, _):
    kw = dict(optimizer=self.optimizer, implementation="xla", use_bias=False)
    h = fj.ForgeDense(64, **kw)(x)
    return x + fj.ForgeDense(64, **kw)(nn.gelu(h)), None


class GeneralBlock(nn.Module):
  optimizer: fj.ForgeOptimizer

  @nn.compact
  def __call__(self, x, _):
    kw = dict(optimizer=self.optimizer, implementation="xla", use_bias=False)
    h = fj.ForgeDenseGeneral((2, 32), **kw)(x)
    return x + fj.ForgeDenseGeneral(64, axis=(-2, -1), **kw)(nn.gelu(h)), None


def test_scan_updates_general_kernels_in_place():
  """Under fj.scan, DenseGeneral-shaped stacks cost what [K, N] stacks do:
  every kernel and state buffer donated, and no copy of a stack (the
  activations' reshapes may take a few bytes more)."""
  general = _scan_step_memory(GeneralBlock)
  view = _scan_step_memory(ViewBlock)
  stack_bytes = 3 * 64 * 64 * 4
  assert general.alias_size_in_bytes == view.alias_size_in_bytes > 0
  assert general.temp_size_in_bytes < view.temp_size_in_bytes + stack_bytes


# ---------------------------------------------------------------------------
# Tensor parallelism: heads sharded.

needs_devices = pytest.mark.skipif(
  jax.device_count() < 4, reason="needs 4 (CPU) devices"
)


class Heads(nn.Module):
  """Column-parallel ``[D] -> [heads, head_dim]``, then row-parallel back,
  heads sharded over 'model' (or ``kernel_names``)."""

  optimizer: fj.ForgeOptimizer
  kernel_names: tuple = ((None, "model", None), ("model", None, None))

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    names_in, names_out = self.kernel_names
    h = fj.ForgeDenseGeneral(
      (8, 4),
      kernel_init=nn.with_partitioning(init, names_in),
      output_partitioning=(None, None) + names_in[1:],
      optimizer=self.optimizer,
      implementation="xla",
      name="to_heads",
    )(x)
    return fj.ForgeDenseGeneral(
      x.shape[-1],
      axis=(-2, -1),
      kernel_init=nn.with_partitioning(init, names_out),
      input_partitioning=(None, None) + names_out[:2],
      optimizer=self.optimizer,
      implementation="xla",
      name="from_heads",
    )(nn.gelu(h))


class HeadsBlock(nn.Module):
  """A residual :class:`Heads` block, for fj.scan."""

  optimizer: fj.ForgeOptimizer

  @nn.compact
  def __call__(self, x, _):
    return x + Heads(self.optimizer, name="heads")(x), None


class ScannedHeads(nn.Module):
  optimizer: fj.ForgeOptimizer

  @nn.compact
  def __call__(self, x):
    stack = fj.scan(
      HeadsBlock,
      variable_axes={True: 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,),
      length=2,
      metadata_params={nn.PARTITION_NAME: None},
    )
    return stack(self.optimizer, name="layers")(x, None)[0]


@needs_devices
@pytest.mark.parametrize(
  "scan",
  # The heads in fj.scan's stacks by default (fj.scan under TP: test_
  # parallel.py's scanned model with --run-slow), unrolled with --run-slow.
  [pytest.param(False, marks=pytest.mark.slow), True],
  ids=["unrolled", "scan"],
)
def test_heads_sharded_matches_one_device(scan, seed):
  """Heads sharded over 4 devices: the kernels keep their stored shapes and
  specs, the states the view's; 3 steps as on one device (unrolled, and
  stacked by fj.scan)."""
  opt = fj.adamw(1e-2, weight_decay=0.1)
  model = ScannedHeads(opt) if scan else Heads(opt)
  x = jax.random.normal(jax.random.key(seed), (2, 4, 16))
  target = jax.random.normal(jax.random.key(seed + 1), (2, 4, 16))
  mesh = parallel.make_mesh(4)
  with jax.set_mesh(mesh):
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  specs = nn.get_partition_spec(abstract)[COLL]
  layers = (None,) if scan else ()
  heads = specs["layers"]["heads"] if scan else specs
  for name, stored, view in (
    ("to_heads", (None, "model", None), (None, "model")),
    ("from_heads", ("model", None, None), ("model", None)),
  ):
    assert heads[name]["kernel"] == P(*layers, *stored)
    assert heads[name]["opt_state"].mu == P(*layers, *view)
    assert all(axis is None for axis in heads[name]["count"])  # replicated

  def train(variables):
    state = fj.TrainState.create(
      apply_fn=model.apply, params=variables, tx=opt.to_optax()
    )

    @jax.jit
    def step(state):
      loss = lambda p: jnp.mean((state.apply_fn(p, x) - target) ** 2)
      return state.apply_gradients(grads=jax.grad(loss)(state.params))

    for _ in range(3):
      state = step(state)
    return jax.device_get(state.params)

  with jax.set_mesh(mesh):
    sharded = parallel.init_sharded(model.init, mesh, jax.random.key(0), x)
    sharded_result = train(sharded)
  single = parallel.strip_boxes(jax.jit(model.init)(jax.random.key(0), x))
  single_result = train(single)
  for (path, a), b in zip(
    jax.tree_util.tree_flatten_with_path(sharded_result)[0],
    jax.tree.leaves(single_result),
  ):
    assert_rel_close(a, b, 1e-5, jax.tree_util.keystr(path))


@needs_devices
def test_inner_dimension_sharded_is_refused():
  model = Heads(
    fj.adam(1e-2), kernel_names=((None, None, "model"), (None, "model", None))
  )
  x = jnp.ones((2, 4, 16))
  with jax.set_mesh(parallel.make_mesh(4)):
    with pytest.raises(ValueError, match="inner dimension"):
      jax.eval_shape(model.init, jax.random.key(0), x)


# ---------------------------------------------------------------------------
# What is refused.


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("batch_dims", (0,), "batch_dims"),
    ("dot_general", lambda *a, **k: jax.lax.dot_general(*a, **k), "custom"),
    ("dot_general_cls", object, "custom dot_general_cls"),
    ("promote_dtype", lambda *a, dtype=None: a, "custom promote_dtype"),
    # Out of range for the input [2, 3] (not wrapped around to axis 0 or
    # 1, as `% ndim` would), and twice the same axis.
    ("axis", 2, r"axis=2 .* input of shape \(2, 3\)"),
    ("axis", -3, r"axis=-3 .* input of shape \(2, 3\)"),
    ("axis", (-1, 1), r"axis=\(-1, 1\) .*twice"),
  ],
)
def test_refused_fields(field, value, match):
  layer = fj.ForgeDenseGeneral(4, optimizer=fj.adam(1e-2), **{field: value})
  with pytest.raises(ValueError, match=match):
    layer.init(jax.random.key(0), jnp.ones((2, 3)))


def test_optimizer_is_required_and_a_forge_optimizer():
  with pytest.raises(TypeError, match="optimizer"):
    fj.ForgeDenseGeneral(4)
  layer = fj.ForgeDenseGeneral(4, optimizer=optax.adam(1e-2))
  with pytest.raises(TypeError):
    layer.init(jax.random.key(0), jnp.ones((2, 3)))
