"""fj.scan: nn.scan's layout, an in-place reverse-loop backward.

Its backward runs every ForgeDense in stacked mode (whole stacks and a layer
index): that mode must write the bits the one-layer op writes, for the XLA
reference and the Pallas kernel (interpret mode), float32 and bf16 weights
with stochastic rounding and int8 states.
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.train_state import TrainState
from jax.ad_checkpoint import checkpoint_name

import forge_jax as fj
from forge_jax.ops.fused_dense import FusedDenseSpec

from conftest import assert_bitwise_equal, jaxpr_equations

COLL = fj.FORGE_COLLECTION
OPT = fj.adamw(1e-2, weight_decay=0.1)
LOW_PRECISION = fj.adamw(
  1e-2,
  weight_decay=0.1,
  state_dtype="int8",
  weight_rounding="stochastic",
  rounding_seed=7,
)
FOUR_BIT = dataclasses.replace(LOW_PRECISION, second_moment_bits=4)
WIDTH, LAYERS, TOKENS = 32, 4, 24
# Backends and storage formats of the stacked mode: by default each backend
# and each format once, the XLA reference's stacked backward in float32 and
# with 4-bit second moments, the Triton kernel's stacked op in bf16 with
# int8 states and with 4-bit second moments.
_STACKED = [
  ("xla", OPT, jnp.float32, "xla-f32"),
  ("triton", OPT, jnp.float32, "triton-f32"),
  ("xla", LOW_PRECISION, jnp.bfloat16, "xla-bf16-sr-int8"),
  ("triton", LOW_PRECISION, jnp.bfloat16, "triton-bf16-sr-int8"),
  ("xla", FOUR_BIT, jnp.bfloat16, "xla-bf16-sr-int8-4bit"),
  ("triton", FOUR_BIT, jnp.bfloat16, "triton-bf16-sr-int8-4bit"),
]


def _stacked_cases(*defaults):
  return [
    pytest.param(
      *values,
      id=case_id,
      marks=() if case_id in defaults else pytest.mark.slow,
    )
    for *values, case_id in _STACKED
  ]


STACKED_CASES = _stacked_cases("xla-f32", "xla-bf16-sr-int8-4bit")
# The 4-bit case steps int8 first moments too.
STACKED_OP_CASES = _stacked_cases("triton-bf16-sr-int8-4bit")


class Block(nn.Module):
  forge: bool = True
  optimizer: fj.ForgeOptimizer = OPT
  implementation: str = "xla"
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, scale):
    def dense(name):
      if self.forge:
        # An explicit layer_id: the module paths (so the default ids) differ
        # between nn.scan and fj.scan.
        return fj.ForgeDense(
          WIDTH,
          optimizer=self.optimizer,
          use_bias=False,
          implementation=self.implementation,
          param_dtype=self.param_dtype,
          layer_id=int(name[-1]),
          name=name,
        )
      return nn.Dense(WIDTH, use_bias=False, name=name)

    norm = self.param("norm", nn.initializers.ones_init(), (WIDTH,))
    h = jnp.tanh(checkpoint_name(dense("fc1")(x * norm * scale), "fc1_out"))
    return x + dense("fc2")(h), None


class Stack(nn.Module):
  mode: str  # 'forge_scan' | 'forge_nn_scan' | 'optax'
  optimizer: fj.ForgeOptimizer = OPT
  implementation: str = "xla"
  param_dtype: Any = jnp.float32
  policy: Any = None  # a jax.checkpoint_policies policy; None: save nothing

  @nn.compact
  def __call__(self, x):
    forge = self.mode != "optax"
    if self.mode == "forge_scan":
      layers = fj.scan(
        nn.remat(Block, prevent_cse=False, policy=self.policy),
        variable_axes={True: 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=LAYERS,
      )
    else:
      layers = nn.scan(
        nn.remat(Block, policy=self.policy),
        variable_axes={True: 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=LAYERS,
      )
    x, _ = layers(
      forge,
      self.optimizer,
      self.implementation,
      self.param_dtype,
      name="layers",
    )(x, 0.5)
    return x


def _train(mode, seed, steps=3, **fields):
  model = Stack(mode, **fields)
  key = jax.random.key(seed)
  x = jax.random.normal(key, (TOKENS, WIDTH))
  target = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, WIDTH))
  variables = model.init(key, x)
  state = TrainState.create(
    apply_fn=model.apply, params=variables, tx=model.optimizer.to_optax()
  )

  def loss_fn(variables):
    return jnp.mean(jnp.square(model.apply(variables, x) - target))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state):
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  memory = step.lower(state).compile().memory_analysis()
  initial = jax.tree.map(np.array, variables)
  losses = []
  for _ in range(steps):
    state, loss = step(state)
    losses.append(float(loss))
  return initial, state, losses, memory


def _kernels(state, mode):
  coll = "params" if mode == "optax" else COLL
  layers = state.params[coll]["layers"]
  return {name: np.asarray(layers[name]["kernel"]) for name in ("fc1", "fc2")}


def test_same_layout_as_nn_scan(seed):
  x = jnp.ones((TOKENS, WIDTH))
  ours = jax.eval_shape(Stack("forge_scan").init, jax.random.key(seed), x)
  theirs = jax.eval_shape(Stack("forge_nn_scan").init, jax.random.key(seed), x)
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), ours) == jax.tree.map(
    lambda a: (a.shape, a.dtype), theirs
  )
  assert ours[COLL]["layers"]["fc1"]["kernel"].shape == (LAYERS, WIDTH, WIDTH)


def test_matches_nn_scan_and_optax(seed):
  init_s, forge, forge_losses, _ = _train("forge_scan", seed)
  init_n, nn_scan, nn_losses, _ = _train("forge_nn_scan", seed)
  _, ref, ref_losses, _ = _train("optax", seed)
  jax.tree.map(np.testing.assert_array_equal, init_s, init_n)  # same init
  np.testing.assert_allclose(forge_losses, nn_losses, rtol=1e-6)
  np.testing.assert_allclose(forge_losses, ref_losses, rtol=1e-5)
  for name, kernel in _kernels(forge, "forge").items():
    np.testing.assert_allclose(
      kernel, _kernels(nn_scan, "forge")[name], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
      kernel, _kernels(ref, "optax")[name], rtol=1e-5, atol=1e-6
    )
    moved = np.abs(kernel - init_s[COLL]["layers"][name]["kernel"])
    assert moved.reshape(LAYERS, -1).max(axis=1).min() > 0, "every layer moves"
  # Norm scales: ordinary stacked gradients, trained by optax.
  np.testing.assert_allclose(
    forge.params["params"]["layers"]["norm"],
    ref.params["params"]["layers"]["norm"],
    rtol=1e-5,
    atol=1e-6,
  )
  counts = forge.params[COLL]["layers"]["fc1"]["count"]
  np.testing.assert_array_equal(counts, np.full(LAYERS, 3.0))
  assert fj.wiped_layers(forge.params) == []


def test_a_block_without_forge_layers_differentiates_as_under_nn_scan(seed):
  """A model written with fj.scan and run with nn.Dense blocks (its flax
  twin) takes nn.scan's loss and gradients."""
  x = jax.random.normal(jax.random.key(seed), (TOKENS, WIDTH))
  results = []
  for scan in (fj.scan, nn.scan):
    stack = scan(
      nn.remat(Block),
      variable_axes={True: 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,),
      length=LAYERS,
    )(forge=False)
    variables = stack.init(jax.random.key(seed), x, 0.5)
    loss_fn = lambda v: jnp.sum(jnp.square(stack.apply(v, x, 0.5)[0]))
    results.append(jax.value_and_grad(loss_fn)(variables))
  jax.tree.map(np.testing.assert_array_equal, *results)


class SowingBlock(nn.Module):
  """A block that sows an auxiliary loss, as a mixture of experts sows its
  load-balancing term."""

  forge: bool = True

  @nn.compact
  def __call__(self, x):
    dense = (
      functools.partial(fj.ForgeDense, optimizer=OPT)
      if self.forge
      else nn.Dense
    )
    h = jnp.tanh(dense(WIDTH, name="fc")(x))
    self.sow("losses", "aux", jnp.mean(h**2))
    return h, None


class SowingStack(nn.Module):
  forge: bool = True

  @nn.compact
  def __call__(self, x):
    scan = fj.scan if self.forge else nn.scan
    stack = scan(
      SowingBlock,
      variable_axes={True: 0},
      split_rngs={"params": True},
      length=LAYERS,
    )
    return stack(self.forge, name="stack")(x)[0]


def test_a_sown_auxiliary_loss_trains_as_under_nn_scan(seed):
  """A collection the call may write but the variables do not hold yet
  (``sow``'s, named in ``mutable``) makes fj.scan run as nn.scan: the sown
  values come back, and a loss that adds them trains as nn.scan + optax.
  fj.from_dense converts the flax model's init, sown values and all."""
  x = jax.random.normal(jax.random.key(seed), (3, TOKENS, WIDTH))
  forge, plain = SowingStack(True), SowingStack(False)
  dense_variables = plain.init(jax.random.key(seed), x)
  # from_dense leaves out what the init sowed; so does the reference.
  variables = fj.from_dense(dense_variables, forge, x)
  assert set(variables) == {"params", COLL}
  dense_variables = {"params": dense_variables["params"]}

  def loss(model, v):
    y, sown = model.apply(v, x, mutable=["losses"])
    aux = sum(jnp.sum(a) for a in jax.tree.leaves(sown["losses"]))
    return jnp.mean(y**2) + aux, aux

  with pytest.warns(fj.ForgeMemoryWarning, match="losses"):
    (_, aux), grads = jax.value_and_grad(
      functools.partial(loss, forge), has_aux=True
    )(variables)
  (_, aux_ref), ref_grads = jax.value_and_grad(
    functools.partial(loss, plain), has_aux=True
  )(dense_variables)
  np.testing.assert_allclose(aux, aux_ref, rtol=1e-6)
  assert float(aux) > 0
  state = fj.TrainState.create(
    apply_fn=forge.apply, params=variables, tx=OPT.to_optax()
  )
  ref = TrainState.create(
    apply_fn=plain.apply, params=dense_variables, tx=OPT.to_optax()
  )
  new = fj.to_dense(state.apply_gradients(grads=grads).params)
  want = ref.apply_gradients(grads=ref_grads).params
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
    new,
    want,
  )


def test_nonfinite_dy_skips_every_stacked_layer(seed):
  """A NaN target in one token: the loss's cotangent, and through the
  residual stream every layer's dY, has a NaN row, so each layer of the
  stacks (reading the flag from its dx) keeps its kernel and state, its
  count stays and every element counts as skipped."""
  model = Stack("forge_scan")
  key = jax.random.key(seed)
  x = jax.random.normal(key, (TOKENS, WIDTH))
  target = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, WIDTH))
  target = target.at[5, 7].set(jnp.nan)
  variables = model.init(key, x)

  def loss_fn(variables):
    return jnp.mean(jnp.square(model.apply(variables, x) - target))

  new = jax.jit(jax.grad(loss_fn))(variables)[COLL]["layers"]
  old = variables[COLL]["layers"]
  for name in ("fc1", "fc2"):
    for leaf, before in zip(
      jax.tree.leaves((new[name]["kernel"], new[name]["opt_state"])),
      jax.tree.leaves((old[name]["kernel"], old[name]["opt_state"])),
    ):
      assert_bitwise_equal(leaf, before, name)
    np.testing.assert_array_equal(new[name]["count"], np.zeros(LAYERS))
    np.testing.assert_array_equal(
      new[name]["skipped"], np.full(LAYERS, WIDTH * WIDTH)
    )


def test_less_temporary_memory_than_nn_scan(seed):
  _, _, _, ours = _train("forge_scan", seed, steps=1)
  _, _, _, theirs = _train("forge_nn_scan", seed, steps=1)
  # nn.scan's transpose builds new stacks for every updated kernel and state.
  assert ours.temp_size_in_bytes < theirs.temp_size_in_bytes


@pytest.mark.parametrize("implementation, optimizer, dtype", STACKED_CASES)
def test_stacked_backward_matches_nn_scan(
  seed, implementation, optimizer, dtype
):
  """fj.scan' stacked backward against nn.scan's, which runs the
  one-layer op on slices, for every backend and storage format."""
  fields = dict(
    optimizer=optimizer, implementation=implementation, param_dtype=dtype
  )
  _, ours, our_losses, _ = _train("forge_scan", seed, **fields)
  _, theirs, their_losses, _ = _train("forge_nn_scan", seed, **fields)
  np.testing.assert_array_equal(our_losses, their_losses)
  flat = jax.tree_util.tree_flatten_with_path(ours.params[COLL])[0]
  for (path, leaf), other in zip(flat, jax.tree.leaves(theirs.params[COLL])):
    assert_bitwise_equal(leaf, other, jax.tree_util.keystr(path))


CP = jax.checkpoint_policies
# By default a policy that saves the dots and one that saves a named value.
POLICIES = [
  pytest.param(CP.nothing_saveable, id="nothing", marks=pytest.mark.slow),
  pytest.param(CP.dots_with_no_batch_dims_saveable, id="dots_no_batch"),
  pytest.param(CP.everything_saveable, id="everything", marks=pytest.mark.slow),
  pytest.param(
    CP.save_only_these_names("fc1_out"), id="names", marks=pytest.mark.slow
  ),
]


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_full_remat_and_nn_scan(seed, policy):
  """What a policy saves is what the full remat recomputes: the same bits,
  and those of nn.scan(nn.remat(Block, policy=...))."""
  _, full, full_losses, _ = _train("forge_scan", seed)
  _, ours, our_losses, _ = _train("forge_scan", seed, policy=policy)
  _, theirs, their_losses, _ = _train("forge_nn_scan", seed, policy=policy)
  np.testing.assert_array_equal(our_losses, full_losses)
  np.testing.assert_array_equal(our_losses, their_losses)
  flat = jax.tree_util.tree_flatten_with_path(ours.params)[0]
  for (path, leaf), a, b in zip(
    flat, jax.tree.leaves(full.params), jax.tree.leaves(theirs.params)
  ):
    assert_bitwise_equal(leaf, a, f"full remat {jax.tree_util.keystr(path)}")
    assert_bitwise_equal(leaf, b, f"nn.scan {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize(
  "policy", [None, CP.everything_saveable], ids=["full-remat", "everything"]
)
def test_pallas_kernel_updates_whole_stacks(seed, policy):
  """Under fj.scan the Pallas kernel reads and writes the stacked
  kernels and states themselves (aliased), and no [L, K, N] stack is
  written with dynamic_update_slice: nothing for XLA to copy around it.
  (Interpret mode's compiled memory on CPU says nothing about the GPU's, so
  the program is checked.) With a remat policy too: the pullback saved in
  the forward gets the backward's stacks."""
  model = Stack("forge_scan", implementation="triton", policy=policy)
  x = jnp.ones((TOKENS, WIDTH))
  variables = model.init(jax.random.key(seed), x)
  jaxpr = jax.make_jaxpr(jax.grad(lambda v: model.apply(v, x).sum()))(variables)
  equations = list(jaxpr_equations(jaxpr.jaxpr))
  calls = [e for e in equations if e.primitive.name == "pallas_call"]
  assert len(calls) == 2, "fc1 and fc2, in the backward loop's body"
  for call in calls:
    aliased = [
      call.invars[i].aval.shape for i, _ in call.params["input_output_aliases"]
    ]
    assert aliased == [(LAYERS, WIDTH, WIDTH)] * 3, aliased  # kernel, mu, nu
  stack_writes = [
    e
    for e in equations
    if e.primitive.name == "dynamic_update_slice" and e.invars[0].aval.ndim == 3
  ]
  assert not stack_writes


class InnerScan(nn.Module):
  """A block that scans its own layers: with ``fj.scan`` or ``nn.scan``."""

  scan: Any

  @nn.compact
  def __call__(self, x, scale):
    return self.scan(
      Block,
      variable_axes={True: 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,),
      length=2,
    )(name="inner")(x, scale)


@pytest.mark.parametrize(
  "inner, match",
  [
    (fj.scan, "inside the block of another"),
    (nn.scan, "inside nn.scan within"),
  ],
  ids=["fj.scan", "nn.scan"],
)
def test_scan_inside_fj_scan_raises(inner, match, seed):
  """The outer backward hands the block whole outer stacks, which an inner
  scan would slice as its own (an inner nn.scan of equal length: a wrong
  loss, silently)."""
  model = fj.scan(
    InnerScan,
    variable_axes={True: 0},
    split_rngs={"params": True},
    in_axes=(nn.broadcast,),
    length=2,
  )(inner)
  x = jnp.ones((TOKENS, WIDTH))
  variables = model.init(jax.random.key(seed), x, 0.5)
  with pytest.raises(NotImplementedError, match=match):
    jax.grad(lambda v: model.apply(v, x, 0.5)[0].sum())(variables)


# ---------------------------------------------------------------------------
# Stacked mode of the op: the stacks with one layer stepped, bit for bit.


def _stepped(spec, x, variables, dy, layer_index=None):
  """``(dx, new variables)``: one backward pass of the fused op."""
  _, vjp = jax.vjp(
    lambda x, v: fj.forge_dense(x, v, None, spec, layer_index), x, variables
  )
  return vjp(dy)


def _layer_stacks(spec, key, layers, k, n):
  """Stacked variables whose layers have taken 0, 1, ... steps (distinct
  counts, non-zero states)."""
  per_layer = []
  step_of = jax.jit(functools.partial(_stepped, spec))  # one program, not eager
  for layer in range(layers):
    kernel = jax.random.normal(jax.random.fold_in(key, layer), (k, n))
    variables = fj.init_variables(spec.optimizer, kernel.astype(spec.dtype))
    for step in range(layer):
      keys = jax.random.split(jax.random.fold_in(key, 100 * layer + step))
      x = jax.random.normal(keys[0], (TOKENS, k), spec.dtype)
      dy = jax.random.normal(keys[1], (TOKENS, n), spec.dtype)
      _, variables = step_of(x, variables, dy)
    per_layer.append(variables)
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer)


@pytest.mark.parametrize("implementation, optimizer, dtype", STACKED_OP_CASES)
def test_stacked_op_steps_one_layer_of_the_stacks(
  seed, implementation, optimizer, dtype
):
  """With a layer index the op's cotangent is the stacks with exactly that
  layer stepped: the bits the one-layer op writes (stochastic rounding uses
  the layer's own count), every other layer untouched, and the same dx."""
  k, n, layers = 40, 96, 3  # masked tiles, a partial int8 block of columns
  spec = FusedDenseSpec(
    optimizer=optimizer, implementation=implementation, dtype=dtype, layer_id=5
  )
  key_stacks, key_x, key_dy = jax.random.split(jax.random.key(seed), 3)
  stacks = _layer_stacks(
    dataclasses.replace(spec, implementation="xla"), key_stacks, layers, k, n
  )
  x = jax.random.normal(key_x, (2, TOKENS // 2, k), dtype)
  dy = jax.random.normal(key_dy, (2, TOKENS // 2, n), dtype)
  stacked_step = jax.jit(functools.partial(_stepped, spec))
  layer_step = jax.jit(functools.partial(_stepped, spec))
  for index in (layers - 1, 1):
    dx, new_stacks = stacked_step(x, stacks, dy, jnp.int32(index))
    layer = jax.tree.map(lambda a: a[index], stacks)  # pylint: disable=cell-var-from-loop
    dx_layer, new_layer = layer_step(x, layer, dy)
    assert_bitwise_equal(dx, dx_layer, "dx")
    flat_new = jax.tree_util.tree_flatten_with_path(new_stacks)[0]
    for (path, new), old, expected in zip(
      flat_new, jax.tree.leaves(stacks), jax.tree.leaves(new_layer)
    ):
      what = jax.tree_util.keystr(path)
      assert_bitwise_equal(new[index], expected, f"{what}[{index}]")
      others = [i for i in range(layers) if i != index]
      assert_bitwise_equal(
        np.asarray(new)[others],
        np.asarray(old)[others],
        f"{what}, other layers",
      )
