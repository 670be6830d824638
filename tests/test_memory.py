"""No gradient floor: compiled memory of FORGE train steps.

``memory_analysis()`` of jitted, donated train steps of the package's
Llama-style model, unrolled and scanned, with and without remat (by
default the scanned step with remat, which compiles in about half the
unrolled steps' time; the other three layouts are slow), on the CPU; and
the XLA backend's one-layer step against optax's on a GPU.
"""

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import traverse_util
from flax.training import train_state

import forge_jax as fj
from examples.lm import llama
from examples.lm import train as train_lib
from forge_jax.ops import backends

from conftest import selects_of_shape, train_step_temp_bytes

BATCH, SEQ = 2, 32
CONFIG = dataclasses.replace(
  llama.CONFIGS["small"], num_layers=6, dim=128, ffn_dim=512, head_dim=32
)
OPT = fj.adamw(1e-3, weight_decay=0.1)


def _model(config, forge):
  return llama.Llama(
    dataclasses.replace(config, forge_optimizer=OPT if forge else None)
  )


def _abstract_state(model, tokens):
  return jax.eval_shape(
    lambda: train_lib.create_train_state(
      model, OPT.to_optax(), jax.random.key(0), tokens
    )
  )


@functools.lru_cache(maxsize=None)
def _compiled_step(config, forge):
  """The compiled train step and its abstract state (cached: the tests
  compile several steps of the same configs)."""
  model = _model(config, forge)
  tokens = jnp.zeros((BATCH, SEQ + 1), jnp.int32)
  state = _abstract_state(model, tokens)
  return train_lib.make_train_step().lower(state, tokens).compile(), state


def _step_memory(config, forge):
  compiled, state = _compiled_step(config, forge)
  return compiled.memory_analysis(), state


@functools.lru_cache(maxsize=None)
def _activation_floor(config) -> int:
  """Temp bytes of the nn.Dense model's backward with the kernels frozen:
  the activations (and input gradients) any train step must hold."""
  model = _model(config, forge=False)
  tokens = jnp.zeros((BATCH, SEQ + 1), jnp.int32)
  params = _abstract_state(model, tokens).params["params"]
  flat = traverse_util.flatten_dict(params)
  frozen = {k: v for k, v in flat.items() if k[-1] == "kernel"}
  trained = {k: v for k, v in flat.items() if k[-1] != "kernel"}

  def grads(trained, frozen, tokens):
    def loss(trained):
      variables = {
        "params": traverse_util.unflatten_dict({**trained, **frozen})
      }
      return train_lib.loss_fn(variables, model.apply, tokens)

    return jax.grad(loss)(trained)

  compiled = jax.jit(grads).lower(trained, frozen, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _growth(config, forge, layers=(4, 8)):
  """Temp bytes, kernel bytes and the activation floor at two depths."""
  rows = []
  for num_layers in layers:
    c = dataclasses.replace(config, num_layers=num_layers)
    memory, state = _step_memory(c, forge)
    rows.append(
      (
        memory,
        state,
        _activation_floor(c),
        _nbytes(llama.kernels(state.params)),
      )
    )
  return rows


@pytest.mark.parametrize(
  "scan_layers,remat",
  [
    pytest.param(False, False, id="unrolled-no-remat", marks=pytest.mark.slow),
    pytest.param(True, True, id="scan-remat"),
    pytest.param(False, True, id="unrolled-remat", marks=pytest.mark.slow),
    pytest.param(True, False, id="scan-no-remat", marks=pytest.mark.slow),
  ],
)
def test_no_temp_memory_grows_with_the_kernels(scan_layers, remat):
  """Doubling the depth adds the activations it must, never the gradients.

  optax's scanned step holds every kernel's stacked gradient: its temp grows
  by (at least 90% of) the added kernel bytes. FORGE's scanned step grows
  only by the added activations (fj.scan updates the stacks in place,
  layer by layer). Unrolled, XLA already interleaves optax's updates with
  the backward pass, and FORGE must grow no faster than optax.
  """
  config = dataclasses.replace(CONFIG, scan_layers=scan_layers, remat=remat)
  (f4, state4, floor4, k4), (f8, state8, floor8, k8) = _growth(config, True)
  (o4, _, _, _), (o8, _, _, _) = _growth(config, False)
  kernel_growth = k8 - k4
  forge_growth = f8.temp_size_in_bytes - f4.temp_size_in_bytes
  optax_growth = o8.temp_size_in_bytes - o4.temp_size_in_bytes
  floor_growth = floor8 - floor4
  if scan_layers:
    assert optax_growth >= 0.9 * kernel_growth, (optax_growth, kernel_growth)
    assert forge_growth <= floor_growth + 0.1 * kernel_growth, (
      forge_growth,
      floor_growth,
      kernel_growth,
    )
    assert f8.temp_size_in_bytes < o8.temp_size_in_bytes
  else:
    assert forge_growth <= optax_growth + 0.01 * kernel_growth, (
      forge_growth,
      optax_growth,
    )
    assert f8.temp_size_in_bytes <= o8.temp_size_in_bytes
  # Every donated kernel and optimizer state is updated in place.
  for memory, state in ((f4, state4), (f8, state8)):
    assert memory.alias_size_in_bytes >= _nbytes(
      state.params[fj.FORGE_COLLECTION]
    )


def test_scanned_step_copies_no_layer_out_of_the_stacks():
  """fj.scan' backward steps every layer inside its stacks.

  Slicing a layer's kernels and optimizer states out of the stacks around
  the update and writing them back made XLA hold a copy of them: the step's
  temp beyond the activations (the frozen-kernel floor, remat as FORGE's
  scan) was one layer's kernel and state bytes (1.00x here). What is left
  (0.34x) is the XLA reference's working memory on CPU (float32 dW, the
  slices its matmuls and in-place updates read), not a copy of the layer.
  """
  config = dataclasses.replace(CONFIG, scan_layers=True, remat=True)
  memory, state = _step_memory(config, True)
  stacks = [
    leaf
    for leaf in jax.tree.leaves(state.params[fj.FORGE_COLLECTION])
    if leaf.ndim == 3
  ]
  layer_bytes = _nbytes(stacks) // config.num_layers
  beyond_floor = memory.temp_size_in_bytes - _activation_floor(config)
  assert beyond_floor <= 0.5 * layer_bytes, (beyond_floor, layer_bytes)


def _policy_step(num_layers, policy):
  config = dataclasses.replace(
    CONFIG,
    scan_layers=True,
    remat=True,
    num_layers=num_layers,
    remat_policy=policy,
  )
  compiled, state = _compiled_step(config, True)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return compiled.memory_analysis(), cost["flops"], state


def test_unrolled_step_copies_no_layer_scalar_but_its_count():
  """Each layer's donated scalars alias their own outputs: the compiled
  step of four unrolled ForgeDense layers copies no ``intact``,
  ``skipped`` or ``grad_sq_norm`` (XLA keeps one copy of each ``count``,
  which the step both reads and overwrites)."""

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(4):
        x = fj.ForgeDense(64, OPT, use_bias=False)(x)
      return x

  model, x = Stack(), jnp.ones((8, 64))
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x),
    tx=OPT.to_optax(),
  )

  def step(state, x):
    loss, grads = jax.value_and_grad(
      lambda p: jnp.sum(state.apply_fn(p, x) ** 2)
    )(state.params)
    return state.apply_gradients(grads=grads), loss

  text = jax.jit(step, donate_argnums=0).lower(state, x).compile().as_text()
  copied = re.findall(r"= f32\[\]\S* copy\(%(\S+)\)", text)
  assert len(copied) <= 4
  assert all(name.endswith("count__.1") for name in copied), copied


@pytest.mark.slow  # CI time; test_scan checks each policy's steps
def test_remat_policy_saves_activations_not_kernels():
  """fj.scan over nn.remat(policy=dots_with_no_batch_dims_saveable) keeps, per
  layer, the layer's input and the projections' outputs the backward needs
  (all but down_proj's: the residual add needs no value), stacked on the
  layer axis: each added layer costs those bytes more than full remat, not
  a copy of its kernels or states; they are still updated in place. The
  backward recomputes the saved projections no more: fewer FLOPs (XLA on
  CPU counts a loop's body once, so by one layer's projections)."""
  c = CONFIG
  tokens = BATCH * SEQ
  saved_per_layer = (
    4
    * tokens
    * (
      c.dim  # the layer's input
      + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
      + c.dim  # q, k, v, o
      + 2 * c.ffn_dim
    )
  )  # gate, up
  rows = {
    (layers, policy): _policy_step(layers, policy)
    for layers in (4, 8)
    for policy in (None, "dots_with_no_batch_dims_saveable")
  }
  per_layer = {
    policy: (
      rows[8, policy][0].temp_size_in_bytes
      - rows[4, policy][0].temp_size_in_bytes
    )
    / 4
    for policy in (None, "dots_with_no_batch_dims_saveable")
  }
  extra = per_layer["dots_with_no_batch_dims_saveable"] - per_layer[None]
  inputs_per_layer = 4 * tokens * c.dim  # full remat saves those already
  assert abs(extra - (saved_per_layer - inputs_per_layer)) <= (
    0.05 * saved_per_layer
  ), (extra, saved_per_layer)
  memory, _, state = rows[8, "dots_with_no_batch_dims_saveable"]
  kernel_bytes_per_layer = _nbytes(llama.kernels(state.params)) // 8
  assert extra < 0.5 * kernel_bytes_per_layer, (extra, kernel_bytes_per_layer)
  assert memory.alias_size_in_bytes >= _nbytes(
    state.params[fj.FORGE_COLLECTION]
  )
  recomputed = 2 * tokens * c.dim * (
    (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 2 * c.ffn_dim
  ) + (2 * tokens * c.num_heads * c.head_dim * c.dim)  # q k v gate up, o
  saved_flops = (
    rows[8, None][1] - rows[8, "dots_with_no_batch_dims_saveable"][1]
  )
  assert saved_flops >= 0.95 * recomputed, (saved_flops, recomputed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_xla_backend_step_holds_one_float32_gradient_beyond_optax(dtype):
  """The XLA backend's one-layer step needs at most one float32 ``dW``
  more temporary memory than nn.Dense + optax (whose gradient is in the
  weights' dtype).

  Ordering the state's stores after the kernel's update, which XLA's CPU
  compiler needs to update in place, made XLA's GPU compiler keep float32
  copies of the new state: 3.3x optax's temporary memory.
  """
  tokens, k, n = 256, 512, 1024
  state_dtype = None if dtype == jnp.float32 else dtype
  opt = fj.adamw(1e-3, weight_decay=0.1, state_dtype=state_dtype)
  x = jnp.ones((tokens, k), jnp.bfloat16)

  layer = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=dtype)
  optax_temp = train_step_temp_bytes(
    nn.Dense(n, **layer),
    train_state.TrainState.create,
    optax.adamw(1e-3, weight_decay=0.1, mu_dtype=state_dtype),
    x,
  )
  forge_temp = train_step_temp_bytes(
    fj.ForgeDense(n, opt, implementation="xla", **layer),
    fj.TrainState.create,
    opt.to_optax(),
    x,
  )
  assert forge_temp <= optax_temp + 4 * k * n, (forge_temp, optax_temp)


@pytest.mark.parametrize(
  "second_moment_bits", [8, pytest.param(4, marks=pytest.mark.slow)]
)
def test_xla_reference_temp_follows_its_row_chunks(
  second_moment_bits, monkeypatch
):
  """The XLA reference steps a kernel past ``XLA_CHUNK_ELEMENTS`` by chunks
  of rows: its temporaries (dW and, for int8 and 4-bit states, the rule's
  float32 intermediates) are one chunk's, not the layer's (here eight
  chunks: under half the whole layer's temp; the rest is the layer's
  activations and outputs)."""
  tokens, k, n = 64, 512, 4096
  opt = fj.adamw(
    1e-3,
    weight_decay=0.1,
    state_dtype="int8",
    second_moment_bits=second_moment_bits,
    weight_rounding="stochastic",
  )
  # On a one-device mesh the layer steps per shard, where its arrays are
  # local (the suite's eight CPU devices would otherwise keep it whole).
  layer = fj.ForgeDense(
    n,
    opt,
    implementation="xla",
    use_bias=False,
    dtype=jnp.bfloat16,
    param_dtype=jnp.bfloat16,
    mesh=jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]),
  )
  x = jnp.ones((tokens, k), jnp.bfloat16)

  def temp():
    return train_step_temp_bytes(layer, fj.TrainState.create, opt.to_optax(), x)

  monkeypatch.setattr(backends, "XLA_CHUNK_ELEMENTS", k * n)
  whole = temp()
  monkeypatch.setattr(backends, "XLA_CHUNK_ELEMENTS", k * n // 8)
  assert backends.chunk_rows(k, n) == k // 8
  chunked = temp()
  assert chunked < 0.5 * whole, (chunked, whole)


@pytest.mark.parametrize("branch", ["cond", "switch"])
def test_an_install_in_a_branch_closing_over_the_gradient_stays_in_place(
  branch,
):
  """A step that skips non-finite losses with ``lax.cond`` / ``switch``
  around ``apply_gradients`` (the branch closing over the gradient taken
  in the step): the install traced in the branch holds the counts the
  backwards wrote, so it takes the layers' new variables in place: its
  jaxpr holds no more kernel-shaped selects than the plain step's."""
  opt = fj.adamw(1e-2)
  model = nn.Sequential(
    [
      fj.ForgeDense(32, optimizer=opt),
      nn.gelu,
      fj.ForgeDense(16, optimizer=opt),
    ]
  )
  x = jnp.ones((8, 16))
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x),
    tx=opt.to_optax(),
  )

  def step(state, skip):
    loss_fn = lambda v: jnp.mean(state.apply_fn(v, x) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    install = lambda s: s.apply_gradients(grads=grads)
    if skip == "cond":
      return jax.lax.cond(jnp.isfinite(loss), install, lambda s: s, state)
    if skip == "switch":
      index = jnp.where(jnp.isfinite(loss), 0, 1)
      return jax.lax.switch(index, [install, lambda s: s], state)
    return install(state)

  def kernel_selects(skip):
    jaxpr = jax.make_jaxpr(functools.partial(step, skip=skip))(state).jaxpr
    return [selects_of_shape(jaxpr, shape) for shape in ((16, 32), (32, 16))]

  assert kernel_selects(branch) == kernel_selects(None)
