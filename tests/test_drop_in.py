"""The drop-in contract: a user's own Flax model, nn.Dense swapped for
ForgeDense and nothing else, trains correctly or is refused in FORGE's words.

The models here are written as a user writes them (``nn.scan``, ``nn.remat``,
dropout, auxiliary heads, optax wrappers), not through the package's Llama.
"""

import functools
import re
import warnings
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from flax.training.train_state import TrainState as FlaxTrainState
from jax import lax

import forge_jax as fj
from forge_jax.ops import backends, fused_dense

from conftest import jaxpr_equations, selects_of_shape

COLL = fj.FORGE_COLLECTION
OPT = fj.adamw(1e-2, weight_decay=0.1)


class Block(nn.Module):
  """A residual MLP block, optionally with dropout."""

  features: int = 16
  rate: float = 0.0
  implementation: str = "xla"
  param_dtype: jnp.dtype = jnp.float32
  dtype: jnp.dtype | None = None
  optimizer: fj.ForgeOptimizer = OPT

  @nn.compact
  def __call__(self, x, scale):
    dense = lambda n: fj.ForgeDense(
      n,
      optimizer=self.optimizer,
      implementation=self.implementation,
      param_dtype=self.param_dtype,
      dtype=self.dtype,
    )
    h = nn.gelu(dense(self.features)(x))
    h = nn.Dropout(self.rate, deterministic=self.rate == 0.0)(h)
    return (x + scale * dense(x.shape[-1])(h)).astype(x.dtype), None


def stacked_model(
  scan, *, layers=3, remat=True, variable_axes=None, **block_fields
):
  """A model whose blocks are stacked by ``scan`` (nn.scan or fj.scan)."""
  block = nn.remat(Block, prevent_cse=False) if remat else Block

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      scale = self.param("scale", nn.initializers.ones, ())
      x, _ = scan(
        block,
        variable_axes=variable_axes or {True: 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,),
        length=layers,
      )(**block_fields, name="layers")(x, scale)
      return nn.Dense(4, name="head")(x)

  return Model()


def data(seed=0, tokens=6, width=8):
  keys = jax.random.split(jax.random.key(seed), 2)
  return (
    jax.random.normal(keys[0], (tokens, width)),
    jax.random.normal(keys[1], (tokens, 4)),
  )


def train(model, steps=3, seed=0, state_cls=fj.TrainState, tx=None, x_y=None):
  """``steps`` jitted steps from the same init; ``(state, losses)``."""
  x, y = x_y or data(seed)
  variables = model.init(jax.random.key(seed), x)
  state = state_cls.create(
    apply_fn=model.apply, params=variables, tx=tx or OPT.to_optax()
  )

  @jax.jit
  def step(state, key):
    def loss(params):
      out = state.apply_fn(params, x, rngs={"dropout": key})
      return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value

  losses = []
  for i in range(steps):
    state, value = step(state, jax.random.key(100 + i))
    losses.append(float(value))
  return state, losses


# ---------------------------------------------------------------------------
# fj.scan: nn.scan's arguments, one word to change.


@pytest.mark.parametrize(
  "remat",
  # fj.scan without remat trains by default in test_parallel.py's and
  # test_data_parallel.py's scanned Llama models.
  [True, pytest.param(False, marks=pytest.mark.slow)],
  ids=["remat", "no_remat"],
)
def test_fj_scan_trains_like_nn_scan(remat):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", fj.ForgeMemoryWarning)
    reference, expected = train(stacked_model(nn.scan, remat=remat))
  with warnings.catch_warnings():
    warnings.simplefilter("error", fj.ForgeMemoryWarning)
    state, losses = train(stacked_model(fj.scan, remat=remat))
  np.testing.assert_allclose(losses, expected, rtol=1e-6)
  chex.assert_trees_all_close(state.params, reference.params, atol=1e-6)


def test_fj_scan_stacks_forge_collections_with_params():
  """``variable_axes={'params': 0}``, the usual form with nn.Dense, stacks
  FORGE's collections too: the same variables and steps as ``{True: 0}``."""
  expected, losses = train(stacked_model(fj.scan), steps=2)
  state, params_only = train(
    stacked_model(fj.scan, variable_axes={"params": 0}), steps=2
  )
  assert params_only == losses
  chex.assert_trees_all_equal(state.params, expected.params)


def test_forge_dense_says_which_collection_a_lift_misses():
  """nn.scan / nn.vmap that lift 'params' only: init names FORGE's
  collection and how to lift it, instead of flax's missing-collection
  error, and that iterations sharing one kernel (a recurrent cell) need
  nn.Dense."""
  x, _ = data()
  with pytest.raises(
    ValueError, match=r"variable_axes.*'params'.*recurrent cell.*nn\.Dense"
  ):
    stacked_model(nn.scan, variable_axes={"params": 0}).init(
      jax.random.key(0), x
    )


class SetupBlock(nn.Module):
  """A block written with setup(): a submodule and a parameter of its own."""

  def setup(self):
    self.fc = fj.ForgeDense(8, optimizer=OPT)
    self.gain = self.param("gain", nn.initializers.constant(0.5), (8,))

  def __call__(self, x, _=None):
    return x + self.gain * nn.gelu(self.fc(x)), None


def test_fj_scan_of_a_setup_block_with_a_parameter_trains_like_nn_scan():
  """fj.scan runs the block's setup() per layer, as nn.scan does, not at
  the stack's scope (where its parameter, unstacked, met the stack)."""

  def model(scan):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = scan(
          SetupBlock,
          variable_axes={True: 0},
          split_rngs={"params": True},
          length=3,
        )(name="layers")(x)
        return nn.Dense(4, name="head")(x)

    return Model()

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", fj.ForgeMemoryWarning)
    expected, expected_losses = train(model(nn.scan))
  state, losses = train(model(fj.scan))
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
  chex.assert_trees_all_close(
    state.params, expected.params, rtol=1e-5, atol=1e-6
  )


def test_fj_scan_passes_dropout_rngs_split_per_layer():
  state, losses = train(stacked_model(fj.scan, rate=0.5))
  assert all(np.isfinite(losses))
  _, deterministic = train(stacked_model(fj.scan, rate=0.0))
  assert losses[0] != deterministic[0]  # dropout ran
  # The layers draw different masks: split keys.
  model = stacked_model(fj.scan, rate=0.5, layers=2)
  x, _ = data()
  variables = model.init(jax.random.key(0), x)
  out = model.apply(variables, x, rngs={"dropout": jax.random.key(7)})
  again = model.apply(variables, x, rngs={"dropout": jax.random.key(7)})
  np.testing.assert_array_equal(out, again)  # deterministic per key


def test_fj_scan_without_the_rngs_it_needs_fails_like_nn_scan():
  model = stacked_model(fj.scan, rate=0.5)
  x, _ = data()
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(Exception, match="dropout"):
    model.apply(variables, x)


def test_fj_scan_broadcast_argument_gets_its_gradient():
  """The broadcast ``scale`` is a parameter: its gradient is summed over the
  layers, as under nn.scan."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", fj.ForgeMemoryWarning)
    reference, _ = train(stacked_model(nn.scan), steps=2)
  state, _ = train(stacked_model(fj.scan), steps=2)
  np.testing.assert_allclose(
    state.params["params"]["scale"],
    reference.params["params"]["scale"],
    rtol=1e-6,
  )
  assert state.params["params"]["scale"] != 1.0


@pytest.mark.parametrize(
  "argument, value",
  [
    ("variable_broadcast", "params"),
    ("variable_carry", "batch_stats"),
    ("reverse", True),
    ("data_transform", lambda v, r: (v, r)),
  ],
)
def test_fj_scan_refuses_what_it_cannot_honor(argument, value):
  with pytest.raises(ValueError, match=argument):
    fj.scan(Block, variable_axes={True: 0}, length=2, **{argument: value})


def test_fj_scan_refuses_per_layer_inputs():
  model = stacked_model(
    lambda block, **kw: fj.scan(block, **{**kw, "in_axes": 0})
  )
  x, _ = data()
  with pytest.raises(ValueError, match="in_axes"):
    model.init(jax.random.key(0), x)


class _PassedIn(nn.Module):
  """A block that calls a module its parent made and passed in."""

  layer: nn.Module

  @nn.compact
  def __call__(self, x, scale):
    return jnp.tanh(self.layer(x) * scale + Block()(x, scale)[0]), None


class _StackWithLayerPassedIn(nn.Module):
  @nn.compact
  def __call__(self, x):
    outside = fj.ForgeDense(x.shape[-1], optimizer=OPT, name="outside")
    stack = fj.scan(
      _PassedIn,
      variable_axes={True: 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,),
      length=2,
    )
    return stack(outside, name="stack")(x, 1.0)[0]


def test_fj_scan_refuses_a_layer_from_outside_its_block():
  """A ForgeDense made outside the block and called in it is none of the
  stacks fj.scan steps: applying the model names it, instead of flax's
  error about a missing collection."""
  model = _StackWithLayerPassedIn()
  x, _ = data()
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="is called inside the block of fj.scan"):
    model.apply(variables, x)


def test_fj_scan_needs_a_length():
  with pytest.raises(ValueError, match="length"):
    fj.scan(Block, variable_axes={True: 0})


# ---------------------------------------------------------------------------
# ForgeDense inside plain nn.scan / nn.vmap: correct, and says what it costs.


def test_forge_dense_inside_nn_scan_warns_once_per_layer():
  with pytest.warns(
    fj.ForgeMemoryWarning, match=r"fj\.scan\(\.\.\.\)"
  ) as record:
    train(stacked_model(nn.scan), steps=1)
  paths = {
    str(w.message).split("'")[1]
    for w in record
    if w.category is fj.ForgeMemoryWarning
  }
  assert paths == {"layers/ForgeDense_0", "layers/ForgeDense_1"}


def test_the_warning_can_be_silenced():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=fj.ForgeMemoryWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    train(stacked_model(nn.scan), steps=1)


def test_forge_dense_inside_nn_vmap_trains_like_unbatched_layers():
  class Ensemble(nn.Module):
    @nn.compact
    def __call__(self, x):
      members = nn.vmap(
        Block,
        variable_axes={True: 0},
        split_rngs={"params": True},
        in_axes=(None, None),
        axis_size=2,
      )
      out, _ = members(name="members")(x, 1.0)
      return nn.Dense(4)(out.mean(0))

  with pytest.warns(fj.ForgeMemoryWarning, match="nn.vmap"):
    state, losses = train(Ensemble(), steps=3)
  assert losses[-1] < losses[0]
  kernels = state.params[COLL]["members"]["ForgeDense_0"]["kernel"]
  assert kernels.shape[0] == 2 and not np.allclose(kernels[0], kernels[1])


# ---------------------------------------------------------------------------
# A layer the loss does not reach keeps its weights.


class WithAuxHead(nn.Module):
  @nn.compact
  def __call__(self, x, use_aux=False):
    h = nn.gelu(fj.ForgeDense(8, optimizer=OPT, name="fc1")(x))
    out = fj.ForgeDense(4, optimizer=OPT, name="fc2")(h)
    aux = fj.ForgeDense(4, optimizer=OPT, name="aux")(h)
    return out + aux if use_aux else out


def test_unreached_layer_keeps_kernel_state_and_count_bit_for_bit():
  model = WithAuxHead()
  x, y = data()
  variables = model.init(jax.random.key(0), x)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )

  @functools.partial(jax.jit, static_argnums=1)
  def step(state, use_aux):
    grads = jax.grad(
      lambda p: jnp.mean((state.apply_fn(p, x, use_aux) - y) ** 2)
    )(state.params)
    return state.apply_gradients(grads=grads)

  before = jax.tree.map(np.asarray, state.params[COLL]["aux"])
  state = step(state, False)
  chex.assert_trees_all_equal(state.params[COLL]["aux"], before)
  assert state.unreached_layers() == ["aux"]
  assert float(state.params[COLL]["fc1"]["count"]) == 1.0
  # Reached again later, it trains from where it was.
  state = step(state, True)
  assert state.unreached_layers() == []
  assert float(state.params[COLL]["aux"]["count"]) == 1.0
  assert not np.array_equal(
    state.params[COLL]["aux"]["kernel"], before["kernel"]
  )


@pytest.mark.parametrize("branch", ["lax.cond", "lax.switch"])
def test_a_layer_in_the_branch_not_taken_keeps_its_variables(branch):
  """A jitted step whose loss picks the aux head by jax.lax.cond (switch)
  on a traced flag: the branch not taken still traces its layers'
  backwards, and writes zeros as their new variables. The install checks
  their written flags at run time, so the aux head keeps its variables
  bit for bit until a step takes its branch, and then trains."""
  model = WithAuxHead()
  x, y = data()
  variables = model.init(jax.random.key(0), x)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  loss = lambda p, use_aux: jnp.mean((model.apply(p, x, use_aux) - y) ** 2)

  @jax.jit
  def step(state, use_aux):
    def branchwise(p):
      if branch == "lax.cond":
        return jax.lax.cond(
          use_aux, lambda p: loss(p, True), lambda p: loss(p, False), p
        )
      return jax.lax.switch(
        use_aux.astype(jnp.int32),
        [lambda p: loss(p, False), lambda p: loss(p, True)],
        p,
      )

    return state.apply_gradients(grads=jax.grad(branchwise)(state.params))

  before = jax.tree.map(np.asarray, state.params[COLL]["aux"])
  state = step(state, jnp.asarray(False))
  chex.assert_trees_all_equal(state.params[COLL]["aux"], before)
  assert state.unreached_layers() == ["aux"]
  assert fj.wiped_layers(state.params) == []
  state = step(state, jnp.asarray(True))
  assert state.unreached_layers() == []
  assert float(state.params[COLL]["aux"]["count"]) == 1.0
  assert np.isfinite(np.asarray(state.params[COLL]["aux"]["kernel"])).all()


@pytest.mark.parametrize("eager", [False, True], ids=["jit", "eager"])
def test_a_diagnostic_gradient_before_the_install_does_not_wipe(eager):
  """The training gradient (the main head), then a diagnostic gradient that
  reaches the aux head too and is never installed, then the install of the
  training gradient: the aux head keeps its variables bit for bit, in one
  jitted step and with the gradients jitted apart and installed eagerly."""
  model = WithAuxHead()
  x, y = data()
  variables = model.init(jax.random.key(0), x)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )

  def loss(params, use_aux):
    return jnp.mean((state.apply_fn(params, x, use_aux) - y) ** 2)

  train_grad = jax.grad(functools.partial(loss, use_aux=False))
  diagnostic = lambda p: fj.global_norm(
    jax.grad(functools.partial(loss, use_aux=True))(p)
  )
  if eager:
    train_grad, diagnostic = jax.jit(train_grad), jax.jit(diagnostic)
    state = state.apply_gradients(grads=train_grad(state.params))
    grads = train_grad(state.params)  # cached: nothing traced
    diagnostic(state.params)
    before = state.params[COLL]["aux"]
    state = state.apply_gradients(grads=grads)
  else:

    @jax.jit
    def step(state):
      grads = train_grad(state.params)
      diagnostic(state.params)
      return state.apply_gradients(grads=grads)

    before = state.params[COLL]["aux"]
    state = step(state)
  after = state.params[COLL]["aux"]
  chex.assert_trees_all_equal(after, before)
  assert state.unreached_layers() == ["aux"]
  assert fj.wiped_layers(state.params) == []


def _fused_kernels(jaxpr) -> set:
  """The fused kernels ``jaxpr`` calls ('mosaic', 'triton'): each kernel's
  calls are one jitted function, named after its entry point."""
  return {
    eqn.params["name"].removesuffix("_update")
    for eqn in jaxpr_equations(jaxpr)
    if eqn.primitive.name in ("jit", "pjit")
    and eqn.params["name"] in ("mosaic_update", "triton_update")
  }


FOUR_BIT = fj.adamw(
  1e-3, state_dtype=jnp.int8, second_moment_bits=4, weight_rounding="stochastic"
)


@pytest.mark.parametrize(
  "hopper, dtype, tokens, features, kernel, opt",
  [
    # 16-bit activations, tiles that fill the GPU: the Mosaic kernel.
    (True, jnp.bfloat16, 4096, 1024, "mosaic", OPT),
    # As many tiles, 8x the tokens: each CTA's token loop leaves most SMs
    # idle for longer than XLA's GEMM takes.
    (True, jnp.bfloat16, 32768, 1024, None, OPT),
    (True, jnp.bfloat16, 4096, 256, None, OPT),
    # Before Hopper: the Triton kernel, for 16-bit activations only.
    (False, jnp.bfloat16, 4096, 1024, "triton", OPT),
    (False, jnp.float32, 4096, 1024, None, OPT),
    (False, None, 4096, 1024, None, OPT),  # flax's default: float32
    (True, jnp.float32, 4096, 1024, None, OPT),
    # 4-bit second moments: the Mosaic kernel, else the XLA reference
    # (faster than the Triton kernel for them).
    (True, jnp.bfloat16, 4096, 1024, "mosaic", FOUR_BIT),
    (False, jnp.bfloat16, 4096, 1024, None, FOUR_BIT),
  ],
)
def test_auto_takes_a_fused_kernel_only_where_it_is_the_faster(
  monkeypatch, hopper, dtype, tokens, features, kernel, opt
):
  """What a user's unrolled layer runs on a GPU with 'auto': the XLA
  reference where the fused kernels measured slower (float32 activations
  in the Triton kernel: 1.3-2.1x; the Mosaic kernel with few tiles for its
  token count: 1.09-2.2x, one layer's step on an H200). 4-bit second
  moments go to the Mosaic kernel, else to the XLA reference, whose row
  chunks bound its temporaries: the Triton kernel took the 8B step
  1.6-2.3x the reference's time (H200)."""
  monkeypatch.setattr(backends, "on_gpu", lambda: True)
  monkeypatch.setattr(backends, "on_hopper_or_newer", lambda: hopper)
  x = jax.ShapeDtypeStruct((tokens, features), jnp.float32)
  model = fj.ForgeDense(features, optimizer=opt, dtype=dtype, use_bias=False)
  state = jax.eval_shape(
    lambda x: fj.TrainState.create(
      apply_fn=model.apply,
      params=model.init(jax.random.key(0), x),
      tx=opt.to_optax(),
    ),
    x,
  )

  def step(state, x):
    loss = lambda p: jnp.mean(jnp.square(state.apply_fn(p, x)))
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  kernels = _fused_kernels(jax.make_jaxpr(step)(state, x).jaxpr)
  assert kernels == ({kernel} if kernel else set())


class Wrapped(nn.Module):
  @nn.compact
  def __call__(self, x):
    return fj.ForgeDense(4, optimizer=OPT, name="fc")(x)


def test_bare_forge_dense_model_installs_its_update_as_written():
  """A ForgeDense that is the whole model (module path ``()``) records its
  backward like a named layer: fj.TrainState installs the kernel and state
  the backward wrote, with no run-time select over them beyond the update
  rule's own (an install select reads and writes every kernel and state
  element once more), and the step equals optax's."""
  x, y = data()

  def traced_step(model):
    variables = model.init(jax.random.key(0), x)
    state = fj.TrainState.create(
      apply_fn=model.apply, params=variables, tx=OPT.to_optax()
    )

    def step(state):
      grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2))(
        state.params
      )
      return state.apply_gradients(grads=grads)

    return state, step, jax.make_jaxpr(step)(state).jaxpr

  state, step, bare = traced_step(fj.ForgeDense(4, optimizer=OPT))
  _, _, named = traced_step(Wrapped())
  shape = state.params[COLL]["kernel"].shape
  assert selects_of_shape(bare, shape) == selects_of_shape(named, shape)

  new = jax.jit(step)(state)
  assert new.unreached_layers() == []
  assert float(new.params[COLL]["count"]) == 1.0
  params = {
    "params": {
      "kernel": state.params[COLL]["kernel"],
      "bias": state.params["params"]["bias"],
    }
  }
  grads = jax.grad(lambda p: jnp.mean((nn.Dense(4).apply(p, x) - y) ** 2))(
    params
  )
  tx = OPT.to_optax()
  updates, _ = tx.update(grads, tx.init(params), params)
  expected = optax.apply_updates(params, updates)["params"]["kernel"]
  chex.assert_trees_all_close(
    new.params[COLL]["kernel"], expected, rtol=1e-6, atol=1e-7
  )


class Scanned(nn.Module):
  """Three residual blocks under fj.scan (nn.scan with ``forge=False``),
  then a head."""

  forge: bool = True

  @nn.compact
  def __call__(self, x):
    def dense(features, name):
      if self.forge:
        return fj.ForgeDense(features, optimizer=OPT, name=name)
      return nn.Dense(features, name=name)

    class Residual(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return x + dense(8, "fc2")(nn.gelu(dense(16, "fc1")(x))), None

    scan = fj.scan if self.forge else nn.scan
    x, _ = scan(
      nn.remat(Residual, prevent_cse=False),
      variable_axes={True: 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,),
      length=3,
    )(name="layers")(x, None)
    return dense(4, "head")(x)


@pytest.mark.parametrize(
  "model",
  # Through fj.nnx.scan by default: test_nnx.py's plain gradients.
  ["unrolled", pytest.param("scanned", marks=pytest.mark.slow)],
)
def test_plain_gradients_differentiate_as_nn_dense(model):
  """Under fj.plain_gradients() the layers differentiate as nn.Dense: the
  input gradient and every kernel's dW are nn.Dense's, bit for bit (both
  are the same XLA ops on the CPU). Outside it, a gradient with respect to
  the input alone raises and names it. An adversarial step (FGSM input,
  then the train step) equals nn.Dense + optax."""
  if model == "unrolled":
    forge, ref = WithAuxHead(), None
  else:
    forge, ref = Scanned(), Scanned(forge=False)
  x, y = data()
  variables = forge.init(jax.random.key(0), x)
  dense_vars = fj.to_dense(variables)
  if ref is None:
    # WithAuxHead's nn.Dense twin: the same names, its aux head unused.
    class Ref(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.gelu(nn.Dense(8, name="fc1")(x))
        nn.Dense(4, name="aux")(h)
        return nn.Dense(4, name="fc2")(h)

    ref = Ref()
  loss = lambda model, v, x: jnp.mean((model.apply(v, x) - y) ** 2)

  forge_loss = functools.partial(loss, forge)
  with fj.plain_gradients():
    dx = jax.jit(jax.grad(forge_loss, argnums=1))(variables, x)
    grads = jax.jit(jax.grad(forge_loss))(variables, x)
  with pytest.raises(ValueError, match="fj.plain_gradients"):
    jax.grad(forge_loss, argnums=1)(variables, x)
  ref_loss = functools.partial(loss, ref)
  ref_dx = jax.jit(jax.grad(ref_loss, argnums=1))(dense_vars, x)
  ref_grads = jax.jit(jax.grad(ref_loss))(dense_vars, x)
  chex.assert_trees_all_equal(dx, ref_dx)
  chex.assert_trees_all_equal(
    fj.to_dense({"params": grads["params"], COLL: grads[COLL]})["params"],
    ref_grads["params"],
  )

  state = fj.TrainState.create(
    apply_fn=forge.apply, params=variables, tx=OPT.to_optax()
  )

  @jax.jit
  def adversarial_step(state):
    with fj.plain_gradients():
      dx = jax.grad(lambda x: loss(forge, state.params, x))(x)
    x_adv = x + 0.1 * jnp.sign(dx)
    grads = jax.grad(lambda p: loss(forge, p, x_adv))(state.params)
    return state.apply_gradients(grads=grads)

  state = adversarial_step(state)
  tx = OPT.to_optax()
  x_adv = x + 0.1 * jnp.sign(ref_dx)
  ref_grads = jax.grad(lambda p: loss(ref, p, x_adv))(dense_vars)
  updates, _ = tx.update(ref_grads, tx.init(dense_vars), dense_vars)
  expected = optax.apply_updates(dense_vars, updates)
  actual = fj.to_dense(state.params)["params"]
  expected = dict(expected["params"])
  if model == "unrolled":  # aux, unreached: FORGE keeps it, AdamW decays it
    chex.assert_trees_all_equal(actual["aux"], dense_vars["params"]["aux"])
    expected["aux"] = actual["aux"]
  chex.assert_trees_all_close(actual, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
  "dtype", [pytest.param(None, marks=pytest.mark.slow), jnp.bfloat16]
)
def test_integer_inputs_are_promoted_as_nn_dense_promotes_them(dtype):
  """int32 inputs (a feature index, a count): the output is nn.Dense's,
  bit for bit, and the layer steps."""
  x = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)
  dense = nn.Dense(5, dtype=dtype)
  forge = fj.ForgeDense(5, optimizer=OPT, dtype=dtype)
  variables = forge.init(jax.random.key(0), x)
  expected = dense.apply(dense.init(jax.random.key(0), x), x)
  chex.assert_trees_all_equal(forge.apply(variables, x), expected)
  state = fj.TrainState.create(
    apply_fn=forge.apply, params=variables, tx=OPT.to_optax()
  )
  grads = jax.grad(lambda p: jnp.sum(forge.apply(p, x).astype(jnp.float32)))
  new = state.apply_gradients(grads=grads(state.params))
  assert float(new.params[COLL]["count"]) == 1.0


@pytest.mark.parametrize(
  "flax_layer, forge_layer",
  [(nn.Dense, fj.ForgeDense), (nn.DenseGeneral, fj.ForgeDenseGeneral)],
)
def test_nn_dense_fields_at_flax_defaults_compute_as_nn_dense(
  flax_layer, forge_layer
):
  """Every field of flax's layer is one of FORGE's: given explicitly at
  flax's defaults (``dot_general=lax.dot_general`` is what None computes),
  the output is flax's bit for bit; a custom product is refused by name."""
  flax_fields = {f.name for f in flax_layer.__dataclass_fields__.values()}
  assert flax_fields <= set(forge_layer.__dataclass_fields__)
  x = jax.random.normal(jax.random.key(1), (4, 3))
  defaults = dict(
    promote_dtype=nn.dtypes.promote_dtype,
    dot_general=lax.dot_general,
    dot_general_cls=None,
  )
  dense = flax_layer(5, **defaults)
  forge = forge_layer(5, optimizer=OPT, **defaults)
  variables = fj.from_dense(dense.init(jax.random.key(0), x), forge, x)
  expected = dense.apply(fj.to_dense(variables), x)
  chex.assert_trees_all_equal(forge.apply(variables, x), expected)
  custom = lambda *args, **kwargs: lax.dot_general(*args, **kwargs)
  with pytest.raises(ValueError, match="custom dot_general is not supported"):
    forge_layer(5, optimizer=OPT, dot_general=custom).init(jax.random.key(0), x)


def test_nn_embed_fields_at_flax_defaults_look_up_as_nn_embed():
  """ForgeEmbed has every field of nn.Embed: at flax's ``promote_dtype`` it
  looks up nn.Embed's rows; a custom one is refused by name."""
  flax_fields = {f.name for f in nn.Embed.__dataclass_fields__.values()}
  assert flax_fields <= set(fj.ForgeEmbed.__dataclass_fields__)
  tokens = jnp.array([[0, 5, 2]])
  embed = nn.Embed(6, 4, promote_dtype=nn.dtypes.promote_dtype)
  forge = fj.ForgeEmbed(6, 4, OPT, promote_dtype=nn.dtypes.promote_dtype)
  dense = embed.init(jax.random.key(0), tokens)
  variables = fj.from_dense(dense, forge, tokens)
  expected = embed.apply(dense, tokens)
  chex.assert_trees_all_equal(forge.apply(variables, tokens), expected)
  custom = fj.ForgeEmbed(6, 4, OPT, promote_dtype=lambda a, **k: a)
  with pytest.raises(ValueError, match="custom promote_dtype is not support"):
    custom.init(jax.random.key(0), tokens)


@pytest.mark.parametrize(
  "jitted",
  [False, pytest.param(True, marks=pytest.mark.slow)],
  ids=["eager", "jit"],
)
def test_plain_gradients_are_not_installed(jitted):
  """Plain gradients handed to fj.TrainState: a kernel's dW is no updated
  kernel. Refused, naming the layers the plain use reached; at run time
  (where the trace cannot tell) each layer keeps its variables, named as
  unreached."""
  model = WithAuxHead()
  x, y = data()
  variables = model.init(jax.random.key(0), x)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  loss = lambda p: jnp.mean((model.apply(p, x) - y) ** 2)

  def step(state):
    with fj.plain_gradients():
      grads = jax.grad(loss)(state.params)
    return state.apply_gradients(grads=grads)

  with pytest.raises(ValueError, match=r"\['fc1', 'fc2'\].*plain_gradients"):
    (jax.jit(step) if jitted else step)(state)
  # Taken in another trace than the install's, they are caught at run time.
  with fj.plain_gradients():
    grads = jax.jit(jax.grad(loss))(state.params)
  new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
  chex.assert_trees_all_equal(new.params[COLL], state.params[COLL])
  assert sorted(new.unreached_layers()) == ["aux", "fc1", "fc2"]


@pytest.mark.parametrize("use", ["gradient_penalty", "second_call"])
def test_a_plain_use_differentiated_in_a_forge_loss_poisons_the_layer(use):
  """A loss that FORGE trains and that also differentiates a plain use of
  the kernels (an input-gradient penalty traced under fj.plain_gradients, a
  second call there): the kernel's cotangent would be the new kernel plus
  the plain use's dW. The layers are poisoned instead of stepped with it
  (fj.wiped_layers names them; the next step turns the loss NaN); a plain
  use whose output is not differentiated leaves training as it is."""
  model = WithAuxHead()
  x, y = data()
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x),
    tx=OPT.to_optax(),
  )

  def loss(params, plain_use):
    out = jnp.mean((model.apply(params, x) - y) ** 2)
    with fj.plain_gradients():
      if use == "gradient_penalty":
        dx = jax.grad(lambda x: jnp.sum(model.apply(params, x)))(x)
        extra = jnp.mean(dx**2)
      else:
        extra = jnp.mean(model.apply(params, x[::-1]) ** 2)
    return out + (extra if plain_use else lax.stop_gradient(extra))

  @functools.partial(jax.jit, static_argnums=1)
  def step(state, plain_use):
    return state.apply_gradients(grads=jax.grad(loss)(state.params, plain_use))

  assert fj.wiped_layers(step(state, False).params) == []
  assert sorted(fj.wiped_layers(step(state, True).params)) == ["fc1", "fc2"]


class TwoHeads(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = fj.ForgeDense(8, optimizer=OPT, name="body")(x)
    return (
      fj.ForgeDense(4, optimizer=OPT, name="main")(h),
      fj.ForgeDense(4, optimizer=OPT, name="aux")(h),
    )


def test_layer_reached_in_an_earlier_trace_keeps_its_weights_when_not_reached():
  """``apply_fn=jax.jit(model.apply)``: a second train step traces neither
  the forward (the jitted apply's trace is cached) nor the backward of a
  layer its loss does not reach. The first step's trace, which did reach
  it, must not make the second trust its zero cotangents."""
  model = TwoHeads()
  x, y = data()
  variables = model.init(jax.random.key(0), x)
  state = fj.TrainState.create(
    apply_fn=jax.jit(model.apply), params=variables, tx=OPT.to_optax()
  )

  def make_step(use_aux):
    def step(state):
      def loss(params):
        main, aux = state.apply_fn(params, x)
        loss = jnp.mean((main - y) ** 2)
        return loss + jnp.mean((aux - y) ** 2) if use_aux else loss

      return state.apply_gradients(grads=jax.grad(loss)(state.params))

    return jax.jit(step)

  state = make_step(True)(state)
  before = jax.tree.map(np.asarray, state.params[COLL]["aux"])
  assert float(before["count"]) == 1.0
  state = make_step(False)(state)
  chex.assert_trees_all_equal(state.params[COLL]["aux"], before)
  assert state.unreached_layers() == ["aux"]
  assert float(state.params[COLL]["main"]["count"]) == 2.0


def test_unreached_stacked_block_layer_keeps_its_stack():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x, _ = fj.scan(
        nn.remat(Block, prevent_cse=False),
        variable_axes={True: 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=2,
      )(name="layers")(x, 1.0)
      aux = fj.ForgeDense(4, optimizer=OPT, name="aux")(x)
      del aux
      return nn.Dense(4)(x)

  state, _ = train(Model(), steps=1)
  assert state.unreached_layers() == ["aux"]
  assert float(state.params[COLL]["aux"]["count"]) == 0.0
  np.testing.assert_array_equal(
    state.params[COLL]["layers"]["ForgeDense_0"]["count"], [1.0, 1.0]
  )


def test_train_state_compiles_its_step_once():
  """``reached`` exists from ``create`` on: the state's structure is the same
  before and after a step, so a jitted step does not retrace."""
  model = WithAuxHead()
  x, y = data()
  variables = model.init(jax.random.key(0), x)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  assert state.unreached_layers() == []

  traces = []

  @jax.jit
  def step(state):
    traces.append(1)
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2))(
      state.params
    )
    return state.apply_gradients(grads=grads)

  for _ in range(3):
    state = step(state)
  assert len(traces) == 1
  assert state.unreached_layers() == ["aux"]


@pytest.mark.parametrize(
  "implementation",
  # Both kernels take the rounding key alike (fused_dense's call).
  [pytest.param("triton", marks=pytest.mark.slow), "mosaic"],
)
def test_unrolled_layers_share_one_lowered_kernel(implementation):
  """Projections of one shape trace and lower their kernel once: the train
  step's module holds one copy, called by each of the six projections. With
  stochastic rounding too: each layer's id reaches the kernel in its traced
  rounding key, not in the kernel's static configuration."""
  x = jax.random.normal(jax.random.key(0), (64, 128))
  name = f"{implementation}_update"
  for optimizer, stochastic in (
    (OPT, False),
    (fj.adamw(1e-3, weight_rounding="stochastic"), True),
  ):

    class Unrolled(nn.Module):
      @nn.compact
      def __call__(self, h):
        for i in range(3):
          h, _ = Block(
            features=128,
            implementation=implementation,
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16 if stochastic else jnp.float32,
            optimizer=optimizer,
            name=f"layers_{i}",
          )(h, 0.5)
        return h

    model = Unrolled()
    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=model.init(jax.random.key(1), x),
      tx=optimizer.to_optax(),
    )

    def step(state):
      loss = lambda p: jnp.mean(state.apply_fn(p, x).astype(jnp.float32) ** 2)
      return state.apply_gradients(grads=jax.grad(loss)(state.params))

    text = jax.jit(step).lower(state).as_text()
    assert len(re.findall(rf"func.func private @{name}(_\d+)?\(", text)) == 1
    assert len(re.findall(rf"call @{name}(_\d+)?\(", text)) == 6


def test_stock_train_state_still_fails_loudly_on_an_unreached_layer():
  model = WithAuxHead()
  x, y = data()
  variables = model.init(jax.random.key(0), x)
  state = FlaxTrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(
    state.params
  )
  state = state.apply_gradients(grads=grads)
  assert fj.wiped_layers(state.params) == ["aux"]


# ---------------------------------------------------------------------------
# tx that cannot be right for the FORGE layers is refused.


def _for_every_parameter(tx):
  """``tx`` as the one member of an ``optax.multi_transform`` (which keeps
  its members in a dict)."""
  return optax.multi_transform(
    {"all": tx}, lambda params: jax.tree.map(lambda _: "all", params)
  )


@pytest.mark.parametrize(
  "tx, match",
  [
    (optax.MultiSteps(OPT.to_optax(), 4), "MultiSteps"),
    (
      optax.chain(OPT.to_optax(), optax.apply_every(1000)),
      "apply_every",
    ),
    (
      optax.chain(optax.clip_by_global_norm(1.0), OPT.to_optax()),
      "clip_by_global_norm",
    ),
    (optax.apply_if_finite(OPT.to_optax(), 3), "apply_if_finite"),
    (optax.chain(optax.zero_nans(), OPT.to_optax()), "zero_nans: the"),
    (
      optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-2, weight_decay=0.1
      ),
      "inject_hyperparams",
    ),
    (
      optax.chain(OPT.to_optax(), optax.contrib.reduce_on_plateau()),
      "reduce_on_plateau",
    ),
    (
      optax.chain(
        OPT.to_optax(),
        optax.scale_by_backtracking_linesearch(max_backtracking_steps=4),
      ),
      "scale_by_backtracking_linesearch",
    ),
    (optax.polyak_sgd(), "scale_by_polyak"),
    (
      _for_every_parameter(
        optax.inject_hyperparams(optax.adamw)(
          learning_rate=1e-2, weight_decay=0.1
        )
      ),
      "inject_hyperparams",
    ),
    (
      _for_every_parameter(optax.apply_if_finite(OPT.to_optax(), 3)),
      "apply_if_finite",
    ),
    (
      _for_every_parameter(
        optax.chain(optax.clip_by_global_norm(1.0), OPT.to_optax())
      ),
      "clip_by_global_norm",
    ),
    (optax.lars(1e-2), "scale_by_trust_ratio"),
    (optax.lookahead(OPT.to_optax(), 2, 0.5), "lookahead, which keeps"),
    (optax.contrib.schedule_free_adamw(1e-2), "schedule_free, which keeps"),
  ],
  ids=[
    "multi_steps",
    "apply_every",
    "clip_by_global_norm",
    "apply_if_finite",
    "zero_nans",
    "inject_hyperparams",
    "reduce_on_plateau",
    "linesearch",
    "polyak",
    "inject_hyperparams_in_multi_transform",
    "apply_if_finite_in_multi_transform",
    "clip_by_global_norm_in_multi_transform",
    "lars",
    "lookahead",
    "schedule_free",
  ],
)
def test_train_state_refuses_whole_gradient_transformations(tx, match):
  model = WithAuxHead()
  variables = model.init(jax.random.key(0), data()[0])
  with pytest.raises(ValueError, match=match):
    fj.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)


SGD = fj.sgd(1e-2, momentum=0.9)


@pytest.mark.parametrize(
  "tx, match",
  [
    (
      optax.inject_hyperparams(optax.sgd)(learning_rate=1e-2, momentum=0.9),
      "inject_hyperparams",
    ),
    (
      optax.chain(SGD.to_optax(), optax.contrib.reduce_on_plateau()),
      "reduce_on_plateau",
    ),
  ],
  ids=["inject_hyperparams", "reduce_on_plateau"],
)
def test_train_state_refuses_a_tx_swapped_in_after_create(tx, match):
  """A tx given by state.replace(tx=...) (or the constructor) rather than
  create: until its hyperparameters change it steps like the layers' rule,
  and then only the other parameters would follow them. Refused at the
  step; swapping in the layers' own rule passes."""
  model = nn.Sequential(
    [fj.ForgeDense(8, optimizer=SGD), nn.gelu, fj.ForgeDense(4, optimizer=SGD)]
  )
  x, y = data()
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x),
    tx=SGD.to_optax(),
  )
  grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))

  def swapped(tx):
    return state.replace(tx=tx, opt_state=tx.init(state.params["params"]))

  new = swapped(SGD.to_optax()).apply_gradients(grads=grads(state.params))
  assert float(new.params[COLL]["layers_0"]["count"]) == 1.0
  with pytest.raises(ValueError, match=match):
    swapped(tx).apply_gradients(grads=grads(state.params))


@pytest.mark.parametrize(
  "tx",
  [
    optax.adamw(3e-2),
    # Equal to the layers' rule while every gradient is within 1: the
    # layers would not clip the larger ones.
    optax.chain(optax.clip(1.0), OPT.to_optax()),
  ],
  ids=["another_learning_rate", "elementwise_clip"],
)
def test_train_state_refuses_another_optimizer_than_the_layers(tx):
  with pytest.raises(ValueError, match="not the optimizer of the ForgeDense"):
    train(WithAuxHead(), steps=1, tx=tx)


@pytest.mark.parametrize("how", ["multi_transform", "masked"])
def test_train_state_refuses_a_tx_that_freezes_forge_layers(how):
  """Freezing by name (the fine-tuning recipe) cannot reach a FORGE
  layer, which steps in its own backward pass: a tx that would leave the
  kernel at one's path unchanged is refused, naming the layers; freezing
  only the biases and norms passes."""
  frozen = lambda names: (
    lambda p: jax.tree_util.tree_map_with_path(
      lambda path, _: any(n in jax.tree_util.keystr(path) for n in names), p
    )
  )

  def tx(names):
    if how == "masked":
      return optax.chain(
        OPT.to_optax(), optax.masked(optax.set_to_zero(), frozen(names))
      )
    labels = lambda p: jax.tree.map(
      lambda f: "frozen" if f else "train", frozen(names)(p)
    )
    return optax.multi_transform(
      {"train": OPT.to_optax(), "frozen": optax.set_to_zero()}, labels
    )

  with pytest.raises(ValueError, match=r"\['fc1'\].*FORGE layers"):
    train(WithAuxHead(), steps=1, tx=tx(["fc1"]))
  _, losses = train(WithAuxHead(), steps=1, tx=tx(["bias"]))
  assert np.isfinite(losses).all()


class FrozenBody(nn.Module):
  """A body whose output's gradient is stopped (frozen), then a head."""

  @nn.compact
  def __call__(self, x):
    h = lax.stop_gradient(nn.gelu(fj.ForgeDense(8, OPT, name="body")(x)))
    return fj.ForgeDense(4, OPT, name="head")(h)


def test_a_frozen_forge_layer_behind_stop_gradient_may_be_labelled_frozen():
  """A body frozen as the refusal advises, its output's gradient stopped,
  and labelled frozen in tx too (so that weight decay spares its bias): the
  loss never reaches it, so tx's freezing label is right, and the step
  trains the head and keeps the body bit for bit."""
  labels = lambda p: jax.tree_util.tree_map_with_path(
    lambda path, _: (
      "frozen" if "body" in jax.tree_util.keystr(path) else "train"
    ),
    p,
  )
  tx = optax.multi_transform(
    {"train": OPT.to_optax(), "frozen": optax.set_to_zero()}, labels
  )
  before = FrozenBody().init(jax.random.key(0), data()[0])
  state, losses = train(FrozenBody(), steps=2, tx=tx)
  assert np.isfinite(losses).all()
  body = lambda v: {c: v[c]["body"] for c in ("params", fj.FORGE_COLLECTION)}
  chex.assert_trees_all_equal(body(state.params), body(before))
  assert float(state.params[fj.FORGE_COLLECTION]["head"]["count"]) == 2.0


def test_a_frozen_layer_stepped_in_one_jit_is_refused_in_another():
  """Gradients from one jit, an evaluation's forward, apply_gradients in
  another jit: it cannot tell which computation's gradient it installs,
  so a layer tx freezes that the gradient stepped is refused; behind a
  stop_gradient the same loop keeps the body bit for bit."""
  frozen = lambda path: any(
    name in jax.tree_util.keystr(path) for name in ("fc1", "body")
  )
  labels = lambda p: jax.tree_util.tree_map_with_path(
    lambda path, _: "frozen" if frozen(path) else "train", p
  )
  tx = optax.multi_transform(
    {"train": OPT.to_optax(), "frozen": optax.set_to_zero()}, labels
  )
  x, y = data()
  apply = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
  for model in (Pair(), FrozenBody()):
    variables = model.init(jax.random.key(0), x)
    state = fj.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    loss = lambda params: jnp.mean((model.apply(params, x) - y) ** 2)
    grads = jax.jit(jax.grad(loss))(state.params)
    jax.jit(model.apply)(state.params, x)
    if isinstance(model, Pair):
      with pytest.raises(ValueError, match=r"\['fc1'\].*FORGE layers"):
        apply(state, grads)
      continue
    layer = lambda v: {c: v[c]["body"] for c in v}
    state = apply(state, grads)
    chex.assert_trees_all_equal(layer(state.params), layer(variables))


class Pair(nn.Module):
  """``fc1 -> gelu -> fc2``."""

  dense: Any = None  # None: FORGE's layers; else nn.Dense

  @nn.compact
  def __call__(self, x):
    layer = self.dense or functools.partial(fj.ForgeDense, optimizer=OPT)
    return layer(4, name="fc2")(nn.gelu(layer(8, name="fc1")(x)))


def test_train_state_lets_a_label_function_freeze_one_forge_bias():
  """Labels as a function of the parameters, 'frozen' for fc1's bias
  alone: they leave fc1's kernel, asked at its path, trained, so tx
  passes, and the model trains as nn.Dense under the same labels, fc1's
  bias kept bit for bit."""
  # flax's TrainState steps params['params'] with tx beside FORGE's
  # collection, the whole params of nn.Dense's model: by the path's end.
  label = lambda path, _: "frozen" if path[-2:] == ("fc1", "bias") else "train"
  tx = optax.multi_transform(
    {"train": OPT.to_optax(), "frozen": optax.set_to_zero()},
    lambda params: traverse_util.path_aware_map(label, params),
  )
  before = Pair().init(jax.random.key(0), data()[0])
  state, losses = train(Pair(), steps=3, tx=tx)
  expected, expected_losses = train(
    Pair(dense=nn.Dense), steps=3, state_cls=FlaxTrainState, tx=tx
  )
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  chex.assert_trees_all_equal(
    state.params["params"]["fc1"]["bias"], before["params"]["fc1"]["bias"]
  )
  for name in ("fc1", "fc2"):
    chex.assert_trees_all_close(
      {
        "kernel": state.params[COLL][name]["kernel"],
        **state.params["params"][name],
      },
      expected.params["params"][name],
      rtol=1e-5,
      atol=1e-6,
    )
  assert not np.array_equal(
    state.params[COLL]["fc1"]["kernel"], before[COLL]["fc1"]["kernel"]
  )


def test_train_state_keeps_the_other_collections_of_the_variables():
  """Created from the whole variables (the README's recipe), a model with
  BatchNorm keeps its batch_stats in state.params through every step
  (flax's step would drop them): the caller writes their new values, and
  they accumulate as under flax."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
      x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
      return fj.ForgeDense(4, optimizer=OPT, name="fc")(x)

  x, y = data()
  variables = Net().init(jax.random.key(0), x)
  state = fj.TrainState.create(
    apply_fn=Net().apply, params=variables, tx=OPT.to_optax()
  )

  @jax.jit
  def step(state):
    def loss(params):
      out, updates = state.apply_fn(params, x, mutable=["batch_stats"])
      return jnp.mean((out - y) ** 2), updates["batch_stats"]

    grads, stats = jax.grad(loss, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), stats

  for _ in range(3):
    before = state.params["batch_stats"]
    state, after = step(state)
    assert set(state.params) == set(variables)
    chex.assert_trees_all_equal(state.params["batch_stats"], before)
    state = state.replace(params={**state.params, "batch_stats": after})
    # momentum 0.5 with the same batch: halfway to its mean each step
    np.testing.assert_allclose(
      after["BatchNorm_0"]["mean"],
      0.5 * before["BatchNorm_0"]["mean"] + 0.5 * jnp.mean(x, axis=0),
      rtol=1e-5,
      atol=1e-7,
    )


def test_train_state_refuses_labels_that_freeze_a_forge_module():
  """flax's fine-tuning recipe: labels as a pytree of the 'params'
  collection (``traverse_util.path_aware_map``), which holds a FORGE
  layer's bias but not its kernel. Freezing the module (its bias) is
  refused, naming it; labels that train everything pass."""
  model = WithAuxHead()
  variables = model.init(jax.random.key(0), data()[0])

  def tx(frozen):
    labels = traverse_util.path_aware_map(
      lambda path, _: "frozen" if frozen in path else "train",
      variables["params"],
    )
    return optax.multi_transform(
      {"train": OPT.to_optax(), "frozen": optax.set_to_zero()}, labels
    )

  with pytest.raises(ValueError, match=r"\['fc1'\].*FORGE layers"):
    train(model, steps=1, tx=tx("fc1"))
  _, losses = train(model, steps=2, tx=tx("nothing"))
  assert np.isfinite(losses).all()


LION = fj.lion(1e-3, weight_decay=0.1)
SGD = fj.sgd(1e-2, momentum=0.9)


class MixedRules(nn.Module):
  """Layers on three rules; the SGD layer has no bias."""

  dense: Any = None  # None: FORGE's layers; else nn.Dense

  @nn.compact
  def __call__(self, x):
    def layer(features, opt, name, use_bias=True):
      if self.dense is not None:
        return self.dense(features, use_bias=use_bias, name=name)
      return fj.ForgeDense(features, opt, use_bias=use_bias, name=name)

    h = nn.gelu(layer(8, LION, "fc1")(x))
    h = nn.gelu(layer(8, SGD, "fc3", use_bias=False)(h))
    return layer(4, OPT, "fc2")(h)


def by_layer(rules: dict):
  """``optax.multi_transform`` of ``rules`` (a module name: its
  optimizer), labelled by path; other parameters take AdamW."""
  tx = {name: opt.to_optax() for name, opt in rules.items()}
  label = lambda path, _: next((n for n in rules if n in path), "rest")
  return optax.multi_transform(
    {**tx, "rest": OPT.to_optax()},
    lambda params: traverse_util.path_aware_map(label, params),
  )


def test_layers_on_several_rules_take_each_bias_by_its_layer_rule():
  """Layers on AdamW, Lion and SGD: a tx that steps the Lion layer's bias
  by AdamW is refused, naming it (the bias-free SGD layer has nothing tx
  steps); labels giving each layer's bias its layer's rule train as
  nn.Dense under the same labels, the SGD kernel by SGD."""
  with pytest.raises(ValueError, match=r"\['fc1'\].*another rule"):
    train(MixedRules(), steps=1, tx=OPT.to_optax())
  state, losses = train(MixedRules(), steps=3, tx=by_layer({"fc1": LION}))
  expected, expected_losses = train(
    MixedRules(dense=nn.Dense),
    steps=3,
    state_cls=FlaxTrainState,
    tx=by_layer({"fc1": LION, "fc3": SGD}),
  )
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  forge = state.params["_overwrite_with_gradient"]
  for name in ("fc1", "fc2", "fc3"):
    layer = expected.params["params"][name]
    chex.assert_trees_all_close(
      {"kernel": forge[name]["kernel"], **state.params["params"].get(name, {})},
      layer,
      rtol=1e-5,
      atol=1e-6,
    )


class ThreeLayers(nn.Module):
  """Three AdamW layers; ``fc3`` has no bias."""

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(fj.ForgeDense(8, OPT, name="fc1")(x))
    h = nn.gelu(fj.ForgeDense(8, OPT, name="fc3", use_bias=False)(h))
    return fj.ForgeDense(4, OPT, name="fc2")(h)


@pytest.mark.parametrize("layer", ["fc2", "fc3"])
def test_a_learning_rate_of_its_own_for_a_forge_layer_is_refused(layer):
  """Discriminative learning rates by path in tx (a layer on a tenth of the
  rate, through ``optax.multi_transform``): FORGE steps the layer's kernel
  by its own optimizer, so only its bias would follow. Refused, naming the
  layer, with or without a bias; the same labels with the layers' own
  rule everywhere train."""
  slow = fj.adamw(1e-3, weight_decay=0.1)
  with pytest.raises(ValueError, match=rf"\['{layer}'\] by another rule"):
    train(ThreeLayers(), steps=1, tx=by_layer({layer: slow}))
  _, losses = train(ThreeLayers(), steps=2, tx=by_layer({layer: OPT}))
  assert np.isfinite(losses).all()


class RankTwoBias(nn.Module):
  """A ForgeDenseGeneral with a ``[2, 4]`` bias beside a ForgeDense."""

  @nn.compact
  def __call__(self, x):
    h = fj.ForgeDenseGeneral((2, 4), optimizer=OPT, name="heads")(x)
    return fj.ForgeDense(4, OPT, name="out")(nn.gelu(h.reshape(x.shape)))


def test_rules_of_their_own_for_some_biases_alone_pass():
  """Biases may take rules of their own, on some layers only: a decay mask
  by rank (the ``[2, 4]`` bias decayed, the other not) and a bias at twice
  the rate, by path. Only a kernel at a layer's path would single the
  layer out."""
  by_rank = optax.adamw(
    1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
  )
  label = lambda path, _: "fast" if path[-2:] == ("out", "bias") else "rest"
  fast_bias = optax.multi_transform(
    {
      "fast": fj.adamw(2e-2, weight_decay=0.1).to_optax(),
      "rest": OPT.to_optax(),
    },
    lambda params: traverse_util.path_aware_map(label, params),
  )
  for tx in (by_rank, fast_bias):
    _, losses = train(RankTwoBias(), steps=2, tx=tx)
    assert np.isfinite(losses).all()


NO_BIAS_DECAY = lambda p: jax.tree.map(lambda a: jnp.ndim(a) > 1, p)
RATES = {"fc0": 1e-3, "fc1": 3e-3, "fc2": 1e-2}
RATE_OPTS = {name: fj.adamw(lr, weight_decay=0.1) for name, lr in RATES.items()}


class LayerwiseRates(nn.Module):
  """Three layers, each on its own learning rate (layer-wise decay)."""

  dense: Any = None  # None: FORGE's layers; else nn.Dense

  @nn.compact
  def __call__(self, x):
    for name, opt in RATE_OPTS.items():
      features = 4 if name == "fc2" else 8
      if self.dense is not None:
        layer = self.dense(features, name=name)
      else:
        layer = fj.ForgeDense(features, opt, name=name)
      x = layer(x) if name == "fc2" else nn.gelu(layer(x))
    return x


def by_rate(rule, labels=None):
  """``optax.multi_transform`` of ``rule(lr)`` for each layer's rate,
  labelled by path (``labels``: a pytree of the parameters; else a
  function of them)."""
  label = lambda path, _: next(name for name in RATES if name in path)
  return optax.multi_transform(
    {name: rule(lr) for name, lr in RATES.items()},
    labels or (lambda params: traverse_util.path_aware_map(label, params)),
  )


def _adamw_without_bias_decay(lr):
  return optax.adamw(lr, weight_decay=0.1, mask=NO_BIAS_DECAY)


def _chain_without_bias_decay(lr):
  return optax.chain(
    optax.scale_by_adam(),
    optax.masked(optax.add_decayed_weights(0.1), NO_BIAS_DECAY),
    optax.scale_by_learning_rate(lr),
  )


@pytest.mark.parametrize(
  "rule", [_adamw_without_bias_decay, _chain_without_bias_decay]
)
@pytest.mark.parametrize("labels", ["function", "pytree", "prefix"])
def test_layerwise_rates_without_bias_decay_train_as_nn_dense(rule, labels):
  """Layer-wise learning rates (each layer on its own ``fj.adamw``, tx a
  ``multi_transform`` of the rates labelled by path: a function, a pytree
  of the parameters or a prefix of it) with no weight decay on biases
  (each rate's rule masked by rank): every kernel follows its layer's
  rule, so FORGE trains as nn.Dense under the same tx."""
  x, _ = data()
  label = lambda path, _: next(name for name in RATES if name in path)

  def tx(model):
    if labels == "function":
      return by_rate(rule)
    # The labels' tree is the one tx steps: FORGE's 'params' collection,
    # all of flax's variables.
    variables = model.init(jax.random.key(0), x)
    tree = variables["params"] if COLL in variables else variables
    if labels == "prefix":
      prefix = {name: name for name in RATES}
      return by_rate(
        rule, prefix if tree is not variables else {"params": prefix}
      )
    return by_rate(rule, traverse_util.path_aware_map(label, tree))

  state, losses = train(LayerwiseRates(), tx=tx(LayerwiseRates()))
  flax_model = LayerwiseRates(dense=nn.Dense)
  expected, expected_losses = train(
    flax_model, state_cls=FlaxTrainState, tx=tx(flax_model)
  )
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
  forge = state.params[COLL]
  for name in RATES:
    chex.assert_trees_all_close(
      {"kernel": forge[name]["kernel"], **state.params["params"][name]},
      expected.params["params"][name],
      rtol=1e-5,
      atol=1e-7,
    )


@pytest.mark.parametrize(
  "tx, refused",
  [
    # One rate for all: fc1 and fc2 would step by fc0's.
    (_adamw_without_bias_decay(1e-3), r"\['fc1', 'fc2'\] by another rule"),
    # fc1's rule decays nothing: its kernel would not be decayed.
    (
      by_rate(
        lambda lr: (
          optax.adam(lr)
          if lr == RATES["fc1"]
          else _adamw_without_bias_decay(lr)
        )
      ),
      r"mask leaves out.*\['fc1'\]",
    ),
    # A prefix of the parameters labelling fc1 with fc0's rate.
    (
      by_rate(
        _adamw_without_bias_decay, {"fc0": "fc0", "fc1": "fc0", "fc2": "fc2"}
      ),
      r"\['fc1'\] by another rule",
    ),
  ],
  ids=["one_rate", "undecayed_layer", "prefix_with_another_rate"],
)
def test_layerwise_rates_refuse_another_rule_than_the_layers(tx, refused):
  with pytest.raises(ValueError, match=refused):
    train(LayerwiseRates(), steps=1, tx=tx)


class Encoder(nn.Module):
  """An embedding and a dense layer: FORGE's on ``optimizer``, or flax's
  (``optimizer`` None)."""

  optimizer: Any = None

  @nn.compact
  def __call__(self, tokens):
    if self.optimizer is None:
      return nn.gelu(
        nn.Dense(8, name="body")(nn.Embed(16, 8, name="embed")(tokens))
      )
    opt = self.optimizer
    h = fj.ForgeEmbed(16, 8, optimizer=opt, name="embed")(tokens)
    return nn.gelu(fj.ForgeDense(8, opt, name="body")(h))


class MaskedEncoder(nn.Module):
  """An encoder, a LayerNorm, a bias-free layer and a projection: FORGE's
  layers on ``optimizer``, or flax's (``optimizer`` None)."""

  optimizer: Any = OPT

  @nn.compact
  def __call__(self, tokens):
    h = nn.LayerNorm(name="norm")(
      Encoder(self.optimizer, name="encoder")(tokens)
    )
    if self.optimizer is None:
      h = nn.Dense(8, use_bias=False, name="mix")(h)
      return nn.Dense(4, name="proj")(h)
    h = fj.ForgeDense(8, self.optimizer, use_bias=False, name="mix")(h)
    return fj.ForgeDense(4, self.optimizer, name="proj")(h)


@pytest.mark.parametrize("where", ["optimizer", "tx"])
def test_a_decay_mask_tree_that_leaves_out_a_forge_kernel_is_refused(where):
  """A weight-decay mask given as a pytree, a prefix of the parameters (as
  optax allows), on the layers' optimizer or on tx: a leaf above a FORGE
  layer (``'encoder': False``) applies to its whole subtree, so
  nn.Dense + optax would leave the table and kernel below undecayed while
  FORGE decays them: refused, naming the layers. A tree that keeps the
  kernels decayed (the LayerNorm left out) trains as flax's layers + optax
  under the same mask."""
  tokens = jnp.arange(6) % 16
  y = jax.random.normal(jax.random.key(1), (6, 4))

  def forge(mask):
    opt = fj.adamw(1e-2, weight_decay=0.1, mask=mask)
    if where == "optimizer":
      return MaskedEncoder(opt), opt.to_optax()
    return MaskedEncoder(), optax.adamw(1e-2, weight_decay=0.1, mask=mask)

  for left_out, names in (
    ({"encoder": False, "norm": False, "proj": True}, "'encoder/body', 'e"),
    ({"encoder": True, "norm": False, "proj": False}, "'proj'"),
  ):
    model, tx = forge(left_out)
    with pytest.raises(ValueError, match=rf"mask leaves out.*\[{names}"):
      train(model, steps=1, tx=tx, x_y=(tokens, y))

  kept = {"encoder": True, "norm": False, "proj": True}
  model, tx = forge(kept)
  state, losses = train(model, tx=tx, x_y=(tokens, y))
  expected, expected_losses = train(
    MaskedEncoder(None),
    state_cls=FlaxTrainState,
    # flax's TrainState steps all variables, the bias-free layer's kernel
    # among them.
    tx=optax.adamw(
      1e-2, weight_decay=0.1, mask={"params": {**kept, "mix": True}}
    ),
    x_y=(tokens, y),
  )
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
  forge_encoder = state.params[COLL]["encoder"]
  flax_encoder = expected.params["params"]["encoder"]
  chex.assert_trees_all_close(
    (forge_encoder["embed"]["kernel"], forge_encoder["body"]["kernel"]),
    (flax_encoder["embed"]["embedding"], flax_encoder["body"]["kernel"]),
    rtol=1e-5,
    atol=1e-7,
  )


class Biased(nn.Module):
  """Two dense layers with biases: FORGE's on ``optimizer``, or flax's
  (``optimizer`` None)."""

  optimizer: Any = OPT

  @nn.compact
  def __call__(self, x):
    if self.optimizer is None:
      return nn.Dense(4, name="fc2")(nn.gelu(nn.Dense(8, name="fc1")(x)))
    h = nn.gelu(fj.ForgeDense(8, self.optimizer, name="fc1")(x))
    return fj.ForgeDense(4, self.optimizer, name="fc2")(h)


@pytest.mark.parametrize("where", ["optimizer", "tx"])
def test_a_decay_mask_tree_naming_forge_kernels_says_why_it_cannot(where):
  """A weight-decay mask given as a pytree of nn.Dense's parameters
  (``{'fc1': {'kernel': True, 'bias': False}}``, no bias decay) names the
  kernels, which the tree tx steps lacks (they are FORGE's): refused in
  FORGE's words, naming them, not by optax's structure error. With the
  kernels left out of the tree, it trains as nn.Dense + optax with it."""

  def tx_and_model(mask):
    opt = fj.adamw(1e-2, weight_decay=0.1, mask=mask)
    if where == "optimizer":
      return opt.to_optax(), Biased(opt)
    return optax.adamw(1e-2, weight_decay=0.1, mask=mask), Biased()

  no_bias = {"kernel": True, "bias": False}
  tx, model = tx_and_model({"fc1": no_bias, "fc2": no_bias})
  with pytest.raises(ValueError, match=r"FORGE layers \['fc1', 'fc2'\]"):
    train(model, steps=1, tx=tx)

  tx, model = tx_and_model({"fc1": {"bias": False}, "fc2": {"bias": False}})
  state, losses = train(model, tx=tx)
  expected, expected_losses = train(
    Biased(None),
    state_cls=FlaxTrainState,
    tx=optax.adamw(
      1e-2, weight_decay=0.1, mask={"params": {"fc1": no_bias, "fc2": no_bias}}
    ),
  )
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
  for layer in ("fc1", "fc2"):
    np.testing.assert_allclose(
      state.params[COLL][layer]["kernel"],
      expected.params["params"][layer]["kernel"],
      rtol=1e-5,
      atol=1e-7,
    )
    np.testing.assert_allclose(
      state.params["params"][layer]["bias"],
      expected.params["params"][layer]["bias"],
      rtol=1e-5,
      atol=1e-7,
    )


class GeneralHeads(nn.Module):
  """A ``[8, 2, 4]`` kernel (``nn.DenseGeneral``'s) before a dense layer:
  FORGE's layers on ``optimizer``, or flax's (``optimizer`` None)."""

  optimizer: Any = OPT

  @nn.compact
  def __call__(self, x):
    if self.optimizer is None:
      h = nn.DenseGeneral((2, 4), name="heads")(x)
      return nn.Dense(4, name="out")(nn.gelu(h.reshape(x.shape)))
    opt = self.optimizer
    h = fj.ForgeDenseGeneral((2, 4), optimizer=opt, name="heads")(x)
    return fj.ForgeDense(4, opt, name="out")(nn.gelu(h.reshape(x.shape)))


RANK_TWO = lambda p: jax.tree.map(lambda a: jnp.ndim(a) == 2, p)


@pytest.mark.parametrize("where", ["optimizer", "tx"])
def test_a_decay_mask_by_rank_reads_each_kernels_rank(where):
  """A weight-decay mask by rank asks each kernel at its own rank: one
  that decays rank-2 leaves only leaves nn.DenseGeneral's ``[8, 2, 4]``
  kernel, and nn.scan's stacked kernels, undecayed under flax + optax,
  while FORGE decays them: refused, naming them. A mask that decays every
  leaf of two dimensions or more trains as flax's layers + optax."""

  def forge(mask, model=GeneralHeads):
    opt = fj.adamw(1e-2, weight_decay=0.1, mask=mask)
    if where == "optimizer":
      return model(optimizer=opt), opt.to_optax()
    return model(), optax.adamw(1e-2, weight_decay=0.1, mask=mask)

  stacked = lambda **fields: stacked_model(fj.scan, remat=False, **fields)
  for model, refused in ((GeneralHeads, r"\['heads'\]"), (stacked, "'layers/")):
    model, tx = forge(RANK_TWO, model)
    with pytest.raises(ValueError, match=rf"mask leaves out.*{refused}"):
      train(model, steps=1, tx=tx)

  by_rank = lambda p: jax.tree.map(lambda a: jnp.ndim(a) > 1, p)
  _assert_heads_train_as_flax(*forge(by_rank), by_rank)


def _assert_heads_train_as_flax(model, tx, mask):
  """``model`` (a FORGE ``GeneralHeads``) on ``tx`` trains as flax's layers
  + ``optax.adamw`` with the weight-decay ``mask``."""
  state, losses = train(model, tx=tx)
  expected, expected_losses = train(
    GeneralHeads(None),
    state_cls=FlaxTrainState,
    tx=optax.adamw(1e-2, weight_decay=0.1, mask=mask),
  )
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
  chex.assert_trees_all_close(
    fj.to_dense(state.params)["params"],
    expected.params["params"],
    rtol=1e-5,
    atol=1e-7,
  )


def test_a_decay_mask_by_shape_reads_each_kernels_shape():
  """The layers' weight-decay mask by shape or size asks each kernel at
  its own shape (``[8, 2, 4]`` and ``[8, 4]`` here), as optax asks flax's
  layers' kernels: one that leaves a kernel out is refused, naming it, and
  one that decays every kernel but no bias trains as flax's layers +
  optax."""

  def forge(mask):
    opt = fj.adamw(1e-2, weight_decay=0.1, mask=mask)
    return GeneralHeads(optimizer=opt), opt.to_optax()

  by_rows = lambda p: jax.tree.map(lambda a: a.ndim > 1 and a.shape[0] != 8, p)
  big = lambda p: jax.tree.map(lambda a: a.size > 40, p)
  for mask, refused in ((by_rows, r"\['heads', 'out'\]"), (big, r"\['out'\]")):
    model, tx = forge(mask)
    with pytest.raises(ValueError, match=rf"mask leaves out.*{refused}"):
      train(model, steps=1, tx=tx)

  kernels_only = lambda p: jax.tree.map(lambda a: a.size > 16, p)
  _assert_heads_train_as_flax(*forge(kernels_only), kernels_only)


def test_train_state_accepts_a_learning_rate_warmed_up_from_zero():
  """A schedule that starts at 0 leaves the probe unmoved on its first
  step, the layers' rule too: that is no freezing."""
  opt = fj.adamw(optax.linear_schedule(0.0, 1e-2, 10), weight_decay=0.1)

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return fj.ForgeDense(4, optimizer=opt, name="fc")(x)

  _, losses = train(Layer(), steps=2, tx=opt.to_optax())
  assert np.isfinite(losses).all()


PIECEWISE = lambda boundary: optax.piecewise_constant_schedule(
  1e-2, {boundary: 0.1}
)


@pytest.mark.parametrize(
  "opt, same, other",
  [
    (fj.lion(1e-3), optax.lion(1e-3), optax.lion(1e-3, b1=0.5)),
    (
      fj.radam(1e-3, threshold=5.0),
      optax.radam(1e-3, threshold=5.0),
      optax.radam(1e-3, threshold=3.0),
    ),
    (
      fj.sgd(PIECEWISE(5_000)),
      optax.sgd(PIECEWISE(5_000)),
      optax.sgd(PIECEWISE(50_000)),
    ),
    (
      fj.adam(optax.cosine_decay_schedule(1e-2, 1_000)),
      optax.adam(optax.cosine_decay_schedule(1e-2, 1_000)),
      optax.adam(optax.cosine_decay_schedule(1e-2, 10_000)),
    ),
  ],
  ids=["lion_b1", "radam_threshold", "late_boundary", "decay_length"],
)
def test_a_tx_that_departs_late_or_in_sign_alone_is_another_rule(
  opt, same, other
):
  """The probe compares ``tx`` with the layers' rule past RAdam's
  threshold, through Lion's sign and at late step counts: the same alias
  passes, one with another ``b1``, threshold, boundary or decay length is
  refused."""
  fj.train_state.check_optimizers(same, {opt})
  with pytest.raises(ValueError, match="not the optimizer of the ForgeDense"):
    fj.train_state.check_optimizers(other, {opt})


def test_radam_below_its_threshold_is_its_own_optax_alias():
  """optax's RAdam steps NaN at some counts below threshold 4; the probe
  that compares tx with the layers' rule takes NaN where both are."""
  opt = fj.radam(1e-2, threshold=1.0)
  fj.train_state.check_optimizers(opt.to_optax(), {opt})


def test_train_state_accepts_a_weight_decay_mask():
  """A mask that decays kernels (by rank) and not biases: FORGE's kernels
  are decayed, as the mask says; the biases follow optax's mask."""
  tx = optax.adamw(
    1e-2,
    weight_decay=0.1,
    mask=lambda p: jax.tree.map(lambda a: jnp.ndim(a) > 1, p),
  )
  _, losses = train(WithAuxHead(), steps=2, tx=tx)
  assert all(np.isfinite(losses))


def test_train_state_accepts_the_layers_optax_alias():
  _, losses = train(
    WithAuxHead(), steps=2, tx=optax.adamw(1e-2, weight_decay=0.1)
  )
  assert all(np.isfinite(losses))


def test_grads_of_params_alone_are_refused():
  """A bias-free first ForgeDense sees nothing perturbed when only
  ``params`` are differentiated; the state refuses such grads."""

  class NoBias(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = fj.ForgeDense(8, optimizer=OPT, use_bias=False, name="fc1")(x)
      return fj.ForgeDense(4, optimizer=OPT, use_bias=False, name="fc2")(h)

  model = NoBias()
  x, y = data()
  variables = model.init(jax.random.key(0), x)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  grads = jax.grad(
    lambda p: jnp.mean(
      (model.apply({"params": p, COLL: state.params[COLL]}, x) - y) ** 2
    )
  )(state.params["params"])
  with pytest.raises(ValueError, match="all of state.params"):
    state.apply_gradients(grads={"params": grads})


# ---------------------------------------------------------------------------
# Errors in FORGE's words at the first wrong call site.


def test_params_alone_in_apply_names_the_collection():
  model = WithAuxHead()
  x, _ = data()
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="Keep the whole variables dict"):
    model.apply({"params": variables["params"]}, x)


@pytest.mark.parametrize(
  "tx, twin",
  [
    (optax.adamw(1e-3), "fj.adamw"),
    (optax.sgd(1e-2), "fj.sgd"),
    (optax.lion(1e-4), "fj.lion"),
    (optax.rmsprop(1e-3), "fj.rmsprop"),
    (optax.adagrad(1e-2), "fj.adagrad"),
    (optax.radam(1e-3), "fj.radam"),
  ],
)
def test_optax_alias_as_layer_optimizer_names_its_twin(tx, twin):
  layer = fj.ForgeDense(4, optimizer=tx)
  with pytest.raises(TypeError, match=twin):
    layer.init(jax.random.key(0), jnp.ones((2, 3)))


# ---------------------------------------------------------------------------
# No update writes a non-finite value from finite inputs unreported.


BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)  # (2 - 2**-7) * 2**127


def _fused_step(optimizer, kernel, x, implementation, state=None):
  """The layer's variables after one fused step of ``kernel`` with input
  ``x`` and a cotangent of ones (``dW`` sums ``x`` over its tokens)."""
  variables = fused_dense.init_variables(optimizer, kernel)
  if state is not None:
    variables = variables._replace(opt_state=state)
  spec = fused_dense.FusedDenseSpec(
    optimizer=optimizer, implementation=implementation, dtype=jnp.bfloat16
  )
  return jax.grad(
    lambda v: jnp.sum(
      fused_dense.forge_dense(x, v, None, spec).astype(jnp.float32)
    )
  )(variables)


@pytest.mark.parametrize(
  "implementation",
  # Mosaic's overflowing elements are skipped and counted by default in
  # test_mosaic_kernel.py::test_mosaic_counts_skipped_elements_per_warpgroup.
  ["triton", pytest.param("mosaic", marks=pytest.mark.slow)],
)
def test_overflowing_fused_update_is_skipped_and_counted(implementation):
  """A step that overflows from finite inputs keeps the old values and counts
  them as skipped (the XLA reference, like optax, writes what the rule
  computes)."""
  optimizer = fj.sgd(3e38)
  kernel = jnp.full((128, 128), 1e38, jnp.float32)
  x = -jnp.ones((64, 128), jnp.bfloat16)
  new = _fused_step(optimizer, kernel, x, implementation)
  assert np.all(np.isfinite(new.kernel))
  np.testing.assert_array_equal(new.kernel, kernel)
  assert float(new.skipped) == kernel.size


@pytest.mark.parametrize(
  "implementation", ["triton", pytest.param("mosaic", marks=pytest.mark.slow)]
)
def test_weights_rounded_up_to_infinity_are_skipped_and_counted(
  implementation,
):
  """A float32 weight a quarter of bfloat16's last step above its largest
  value rounds to that value to nearest, and to infinity a quarter of the
  time stochastically. The check reads the weights as stored: those
  elements keep their old value and count as skipped."""
  optimizer = fj.sgd(1.0, weight_rounding="stochastic")
  kernel = jnp.full((128, 128), BF16_MAX, jnp.bfloat16)
  x = jnp.full((64, 128), -(2.0**112), jnp.bfloat16)  # dW = -2**118
  new = _fused_step(optimizer, kernel, x, implementation)
  np.testing.assert_array_equal(new.kernel, kernel)
  # Each element rounds up with probability 1/4: 4096 of 16384 expected.
  assert 3500 < float(new.skipped) < 4700, float(new.skipped)


@pytest.mark.parametrize(
  "implementation", ["triton", pytest.param("mosaic", marks=pytest.mark.slow)]
)
def test_state_overflowing_its_bfloat16_storage_is_skipped_and_counted(
  implementation,
):
  """A momentum trace that float32 holds but bfloat16 rounds to infinity
  is not written: the elements keep their old kernel and trace."""
  optimizer = fj.sgd(1e-3, momentum=0.5, state_dtype="bfloat16")
  kernel = jnp.ones((128, 128), jnp.bfloat16)
  trace = jnp.full((128, 128), BF16_MAX, jnp.bfloat16)
  # dW = 2**127 + 2**118 (64 tokens of 2**121, one of 2**118), so the new
  # trace 0.5 * BF16_MAX + dW = 2**128 - 2**118.
  x = jnp.zeros((128, 128), jnp.bfloat16).at[:64].set(2.0**121)
  x = x.at[64].set(2.0**118)
  new_trace = np.float32(0.5 * BF16_MAX) + np.float32(2.0**127 + 2.0**118)
  assert np.isfinite(new_trace), "precondition"
  assert np.isinf(new_trace.astype(jnp.bfloat16)), "precondition"
  state = optimizer.init(kernel)._replace(trace=trace)
  new = _fused_step(optimizer, kernel, x, implementation, state)
  np.testing.assert_array_equal(new.kernel, kernel)
  np.testing.assert_array_equal(new.opt_state.trace, trace)
  assert float(new.skipped) == kernel.size


def test_float16_momentum_overflowing_is_skipped_and_counted():
  """A float16 momentum overflows from gradients past 65504 while float32
  holds them: those elements keep their old values and count as skipped
  instead of storing an infinite moment that would stall their weights.
  (The Mosaic kernel takes no float16 states.)"""
  optimizer = fj.sgd(1e-3, momentum=0.9, state_dtype="float16")
  kernel = jnp.ones((128, 128), jnp.bfloat16)
  x = jnp.full((64, 128), 2.0**10, jnp.bfloat16)  # dW = 2**16 everywhere
  new = _fused_step(optimizer, kernel, x, "triton")
  np.testing.assert_array_equal(new.kernel, kernel)
  old_state = optimizer.init(kernel)
  for new_leaf, old_leaf in zip(
    jax.tree.leaves(new.opt_state), jax.tree.leaves(old_state)
  ):
    np.testing.assert_array_equal(new_leaf, old_leaf)
  assert float(new.skipped) == kernel.size


def test_float16_second_moments_are_refused():
  """float16 flushes (1 - b2) * g**2 of ordinary gradients to zero, where
  Adam would step by m / eps: a rule with a second moment refuses float16
  storage, naming the moment and what to use."""
  for make in (fj.adamw, fj.rmsprop, fj.adagrad):
    with pytest.raises(ValueError, match="float16.*'bfloat16'.*'int8'"):
      make(1e-3, state_dtype="float16")
  fj.lion(1e-3, state_dtype="float16")


def test_triton_kernel_refuses_int8_stacks_whose_offsets_wrap():
  """Pallas's Triton lowering addresses arrays of up to 2**32 bytes with
  signed 32-bit element offsets: int8 codes of a Qwen3-14B-shaped stack
  (40 x 5120 x 17408 elements) wrap, and a scanned model trained to NaN
  through them. The kernel refuses int8 (and 4-bit) states of such stacks
  and of 25 layers (2.2e9 elements), not of 24 (2.1e9); bf16 stacks and
  states (over 2**32 bytes: 64-bit offsets) and one layer run."""
  from forge_jax.ops import backends, triton_kernel  # pylint: disable=import-outside-toplevel

  int8 = fj.adamw(1e-4, weight_rounding="stochastic", state_dtype="int8")
  four_bit = fj.adamw(1e-4, state_dtype="int8", second_moment_bits=4)
  x = jax.ShapeDtypeStruct((2048, 5120), jnp.bfloat16)
  dy = jax.ShapeDtypeStruct((2048, 17408), jnp.bfloat16)
  reason = triton_kernel.unsupported_reason
  for layers in (40, 25):
    stack = jax.ShapeDtypeStruct((layers, 5120, 17408), jnp.bfloat16)
    for optimizer in (int8, four_bit):
      assert "32-bit offsets" in reason(x, dy, stack, optimizer)
    assert reason(x, dy, stack, fj.adamw(1e-4)) is None
  with pytest.raises(ValueError, match="32-bit offsets"):
    backends.select("triton", x, dy, stack, int8)
  stack = jax.ShapeDtypeStruct((24, 5120, 17408), jnp.bfloat16)
  assert reason(x, dy, stack, int8) is None
  layer = jax.ShapeDtypeStruct((5120, 17408), jnp.bfloat16)
  assert reason(x, dy, layer, int8) is None


# ---------------------------------------------------------------------------
# GPU: every implementation inside nn.scan, fj.scan and unrolled layers.


GPU_OPT = fj.adamw(3e-4, weight_decay=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "param_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"]
)
@pytest.mark.parametrize("stacking", ["nn.scan", "fj.scan", "unrolled"])
def test_every_implementation_trains_like_xla_on_gpu(stacking, param_dtype):
  steps, layers = 8, 4
  x = jax.random.normal(jax.random.key(1), (512, 512), jnp.bfloat16)
  y = jax.random.normal(jax.random.key(2), (512, 4))

  def model(implementation):
    fields = dict(
      features=512,
      implementation=implementation,
      param_dtype=param_dtype,
      dtype=jnp.bfloat16,
      optimizer=GPU_OPT,
    )
    if stacking == "unrolled":

      class Unrolled(nn.Module):
        @nn.compact
        def __call__(self, h):
          for i in range(layers):
            h, _ = nn.remat(Block)(**fields, name=f"layers_{i}")(h, 0.5)
          return nn.Dense(4, name="head")(h)

      return Unrolled()
    scan = nn.scan if stacking == "nn.scan" else fj.scan
    return stacked_model(scan, layers=layers, **fields)

  results = {}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", fj.ForgeMemoryWarning)
    for implementation in ("xla", "triton", "mosaic"):
      state, losses = train(
        model(implementation), steps=steps, x_y=(x, y), tx=GPU_OPT.to_optax()
      )
      kernels = [
        np.asarray(k, np.float32)
        for k in jax.tree.leaves(state.params[COLL])
        if np.ndim(k) >= 2 and k.shape[-1] == 512
      ]
      results[implementation] = (losses, kernels)
  expected, reference = results["xla"]
  assert expected[-1] < expected[0]
  for implementation in ("triton", "mosaic"):
    losses, kernels = results[implementation]
    np.testing.assert_allclose(
      losses, expected, rtol=2e-2, err_msg=implementation
    )
    for kernel, ref in zip(kernels, reference):
      assert np.linalg.norm(kernel) > 0.5 * np.linalg.norm(ref)
      np.testing.assert_allclose(
        np.linalg.norm(kernel),
        np.linalg.norm(ref),
        rtol=1e-2,
        err_msg=implementation,
      )


@pytest.mark.gpu
def test_every_implementation_trains_nn_vmap_like_xla_on_gpu():
  """An ensemble of ForgeDense blocks under nn.vmap: the batched backward
  cannot update in place and writes separate outputs, the same values."""
  x = jax.random.normal(jax.random.key(1), (512, 512), jnp.bfloat16)
  y = jax.random.normal(jax.random.key(2), (512, 4))

  def model(implementation):
    class Ensemble(nn.Module):
      @nn.compact
      def __call__(self, h):
        members = nn.vmap(
          Block,
          variable_axes={True: 0},
          split_rngs={"params": True},
          in_axes=(None, None),
          axis_size=2,
        )
        out, _ = members(
          features=512,
          implementation=implementation,
          param_dtype=jnp.bfloat16,
          dtype=jnp.bfloat16,
          optimizer=GPU_OPT,
          name="members",
        )(h, 0.5)
        return nn.Dense(4)(out.mean(0))

    return Ensemble()

  results = {}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", fj.ForgeMemoryWarning)
    for implementation in ("xla", "triton", "mosaic"):
      state, losses = train(
        model(implementation), steps=4, x_y=(x, y), tx=GPU_OPT.to_optax()
      )
      kernel = state.params[COLL]["members"]["ForgeDense_0"]["kernel"]
      results[implementation] = (losses, np.asarray(kernel, np.float32))
  expected, reference = results["xla"]
  for implementation in ("triton", "mosaic"):
    losses, kernel = results[implementation]
    np.testing.assert_allclose(
      losses, expected, rtol=2e-2, err_msg=implementation
    )
    np.testing.assert_allclose(
      np.linalg.norm(kernel, axis=(1, 2)),
      np.linalg.norm(reference, axis=(1, 2)),
      rtol=1e-2,
      err_msg=implementation,
    )


#: Every projection shape of Llama-3.1-8B and Qwen3-14B, [in, out].
MODEL_SHAPES = {
  "8b_q": (4096, 4096),
  "8b_kv": (4096, 1024),
  "8b_up": (4096, 14336),
  "8b_down": (14336, 4096),
  "14b_q": (5120, 5120),
  "14b_kv": (5120, 1024),
  "14b_up": (5120, 17408),
  "14b_down": (17408, 5120),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES.values(), ids=MODEL_SHAPES)
def test_int8_states_stay_finite_and_agree_at_model_shapes(shape):
  """Three steps of bf16 + stochastic rounding + int8 AdamW states through
  each kernel, against the reference, from finite inputs."""
  optimizer = fj.adamw(
    1e-4, weight_decay=0.1, weight_rounding="stochastic", state_dtype="int8"
  )
  k, n = shape
  kernel = (jax.random.normal(jax.random.key(0), shape) * 0.02).astype(
    jnp.bfloat16
  )
  x = jax.random.normal(jax.random.key(1), (2048, k), jnp.bfloat16)
  finals = {}
  for implementation in ("xla", "triton", "mosaic"):
    spec = fused_dense.FusedDenseSpec(
      optimizer=optimizer, implementation=implementation, layer_id=5
    )

    @jax.jit
    def step(variables, seed):
      dy = (jax.random.normal(jax.random.key(seed), (2048, n)) * 1e-3).astype(
        jnp.bfloat16
      )
      return jax.vjp(
        lambda v: fused_dense.forge_dense(x, v, None, spec), variables
      )[1](dy)[0]

    variables = fused_dense.init_variables(optimizer, kernel)
    for seed in range(3):
      variables = step(variables, seed)
      for leaf in jax.tree.leaves(variables):
        assert np.all(np.isfinite(np.asarray(leaf, np.float32))), implementation
      assert float(variables.skipped) == 0
    finals[implementation] = np.asarray(variables.kernel, np.float32)
  for implementation in ("triton", "mosaic"):
    np.testing.assert_allclose(
      finals[implementation], finals["xla"], atol=2e-3, err_msg=implementation
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
  "storage",
  [
    dict(),
    dict(weight_rounding="stochastic", state_dtype="int8"),
  ],
  ids=["bf16", "bf16-sr-int8"],
)
def test_stacks_past_2_31_elements_train_like_xla_on_gpu(storage):
  """The top layer of a stack of 26 Qwen3-14B up-projections (2.3e9
  elements, past 2**31), updated in place at a traced index for three steps
  through 'auto' and 'mosaic' (and 'triton' with bf16 states, whose
  offsets are 64-bit), equals 'xla' and stays finite; the other layers are
  untouched; 'triton' refuses int8 states, whose offsets would wrap."""
  layers, (k, n), tokens = 26, MODEL_SHAPES["14b_up"], 512
  optimizer = fj.adamw(1e-4, weight_decay=0.1, **storage)
  layer = layers - 1

  def step(implementation):
    spec = fused_dense.FusedDenseSpec(
      optimizer=optimizer, implementation=implementation, layer_id=5
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def update(variables, x, seed, index):
      dy = (jax.random.normal(jax.random.key(seed), (tokens, n)) * 1e-3).astype(
        jnp.bfloat16
      )
      return jax.vjp(
        lambda v: fused_dense.forge_dense(x, v, None, spec, index), variables
      )[1](dy)[0]

    return update

  def stacked_variables():
    kernel = jax.jit(
      lambda: (
        jax.random.normal(jax.random.key(0), (layers, k, n)) * 0.02
      ).astype(jnp.bfloat16)
    )()
    return jax.jit(
      jax.vmap(lambda w: fused_dense.init_variables(optimizer, w))
    )(kernel)

  x = jax.random.normal(jax.random.key(1), (tokens, k), jnp.bfloat16)
  index = jnp.int32(layer)
  kernels = ["auto", "mosaic"]
  if storage.get("state_dtype") == "int8":
    with pytest.raises(ValueError, match="32-bit offsets"):
      step("triton")(stacked_variables(), x, 0, index)
  else:
    kernels.append("triton")
  finals = {}
  for implementation in ("xla", *kernels):
    variables = stacked_variables()
    untouched = np.asarray(variables.kernel[0], np.float32)
    update = step(implementation)
    for seed in range(3):
      variables = update(variables, x, seed, index)
    top = jax.tree.map(
      lambda leaf: np.asarray(leaf[layer], np.float32), variables
    )
    for leaf in jax.tree.leaves(top):
      assert np.all(np.isfinite(leaf)), implementation
    assert float(top.count) == 3 and float(top.skipped) == 0, implementation
    np.testing.assert_array_equal(
      np.asarray(variables.kernel[0], np.float32), untouched
    )
    finals[implementation] = top
    del variables
  for implementation in kernels:
    np.testing.assert_allclose(
      finals[implementation].kernel,
      finals["xla"].kernel,
      atol=2e-3,
      err_msg=implementation,
    )


class NormedPair(nn.Module):
  """Two bfloat16 layers with a LayerNorm and GELU between them: the second
  layer's input comes out of float32 ops."""

  optimizer: Any = None  # None: nn.Dense
  implementation: str = "xla"

  @nn.compact
  def __call__(self, x):
    def dense(name):
      if self.optimizer is None:
        return nn.Dense(128, dtype=jnp.bfloat16, name=name)
      return fj.ForgeDense(
        128,
        optimizer=self.optimizer,
        implementation=self.implementation,
        dtype=jnp.bfloat16,
        name=name,
      )

    h = nn.gelu(nn.LayerNorm(dtype=jnp.bfloat16)(dense("fc1")(x)))
    return dense("fc2")(h)


# The XLA reference is the one whose dot could drop the rounding; the
# kernels read the stored bfloat16 input (Mosaic's in test_mosaic_kernel.py).
@pytest.mark.parametrize(
  "implementation",
  ["xla", "triton", pytest.param("mosaic", marks=pytest.mark.slow)],
)
def test_16bit_compute_steps_as_nn_dense_after_float32_ops(
  implementation, seed
):
  """With ``dtype=bfloat16``, ``dW`` reads the input rounded to bfloat16,
  as ``nn.Dense``'s gradient does, also where a float32 op made it (XLA's
  CPU compiler, allowed excess precision, would drop that rounding from a
  float32-accumulating dot): one Adam step equals optax's to float32
  rounding, where a flipped sign would move an element by twice the
  learning rate."""
  kx, ky = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (64, 128)).astype(jnp.bfloat16)
  y = jax.random.normal(ky, (64, 128))
  lr = 1e-2
  steps = {}
  for name, model, tx, create in (
    ("optax", NormedPair(), optax.adam(lr), FlaxTrainState.create),
    (
      "forge",
      NormedPair(fj.adam(lr), implementation),
      fj.adam(lr).to_optax(),
      fj.TrainState.create,
    ),
  ):
    variables = model.init(jax.random.key(seed), x)
    state = create(apply_fn=model.apply, params=variables, tx=tx)
    loss = lambda v, f=model.apply: jnp.mean((f(v, x) - y) ** 2)
    new = state.apply_gradients(grads=jax.jit(jax.grad(loss))(state.params))
    collection = "params" if name == "optax" else fj.FORGE_COLLECTION
    steps[name] = {
      layer: np.asarray(new.params[collection][layer]["kernel"])
      - np.asarray(variables[collection][layer]["kernel"])
      for layer in ("fc1", "fc2")
    }
  for layer in ("fc1", "fc2"):
    np.testing.assert_allclose(
      steps["forge"][layer], steps["optax"][layer], rtol=0, atol=1e-3 * lr
    )
