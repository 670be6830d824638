"""Misuse fails with a clear, named error; no silent data loss."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax import lax

import forge_jax as fj

from conftest import (
  COLL,
  MLP,
  assert_bitwise_equal,
  assert_rel_close,
  cross_entropy,
  host_copy,
  make_batch,
  make_train_step,
  poison,
)

OPT = fj.adamw(1e-2, weight_decay=0.1)


def _init(model, seed, shape=(4, 6)):
  x, y = make_batch(seed, shape, 4)
  return model.init(jax.random.key(seed), x), (x, y)


# ---------------------------------------------------------------------------
# A layer called twice.


class SharedLayer(nn.Module):
  twice: bool = True

  @nn.compact
  def __call__(self, x):
    layer = fj.ForgeDense(x.shape[-1], optimizer=OPT, name="fc1")
    y = layer(x)
    return layer(y) if self.twice else y


def test_called_twice_in_one_forward_raises(seed):
  x, _ = make_batch(seed, (4, 6), 4)
  with pytest.raises(ValueError, match="twice"):
    SharedLayer(twice=True).init(jax.random.key(seed), x)
  variables = SharedLayer(twice=False).init(jax.random.key(seed), x)
  loss = lambda v: SharedLayer(twice=True).apply(v, x).sum()
  with pytest.raises(ValueError, match="twice"):
    jax.grad(loss)(variables)
  with pytest.raises(ValueError, match="twice"):
    jax.jit(jax.grad(loss))(variables)


def test_a_bound_module_may_call_its_layers_again_for_inference(seed):
  """model.bind(variables) keeps its submodules between calls: calling it
  again (an eval loop, jitted or not) is inference with concrete kernels,
  as with nn.Dense; differentiating two uses still raises."""
  x, _ = make_batch(seed, (4, 6), 4)

  class SetupLayers(nn.Module):  # its layers outlive each bound call
    def setup(self):
      self.layers = [fj.ForgeDense(6, optimizer=OPT) for _ in range(2)]

    def __call__(self, x):
      return self.layers[1](nn.relu(self.layers[0](x)))

  model = SetupLayers()
  bound = model.bind(model.init(jax.random.key(seed), x))
  first = np.asarray(bound(x))
  bound.layers[0](x)
  np.testing.assert_array_equal(np.asarray(bound(x)), first)
  np.testing.assert_array_equal(np.asarray(jax.jit(bound.__call__)(x)), first)
  variables = SharedLayer(twice=False).init(jax.random.key(seed), x)
  with pytest.raises(ValueError, match="twice"):
    jax.grad(lambda v: SharedLayer(twice=True).apply(v, x).sum())(variables)


class DualEncoder(nn.Module):
  """Trains one encoder call a loss; scores a pair with two (retrieval)."""

  forge: bool = True

  def setup(self):
    self.encoder = (
      fj.ForgeDense(8, optimizer=OPT) if self.forge else nn.Dense(8)
    )

  def __call__(self, x):
    return self.encoder(x)

  def similarity(self, x, y):
    return (self.encoder(x) * self.encoder(y)).sum(-1)


def test_jitted_inference_may_call_a_layer_twice(seed):
  """A jitted eval that uses one layer twice is inference, as it is eagerly:
  it gives flax's output; differentiating it raises."""
  x, _ = make_batch(seed, (4, 6), 4)
  y, _ = make_batch(seed + 1, (4, 6), 4)
  model = DualEncoder()
  variables = model.init(jax.random.key(seed), x)
  score = lambda v: model.apply(v, x, y, method="similarity")
  expected = DualEncoder(forge=False).apply(
    fj.to_dense(variables), x, y, method="similarity"
  )
  np.testing.assert_allclose(score(variables), expected, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(score)(variables), expected, rtol=1e-6)
  for differentiate in (jax.grad, lambda f: jax.jit(jax.grad(f))):
    with pytest.raises(ValueError, match="twice"):
      differentiate(lambda v: score(v).sum())(variables)


class TiedAutoencoder(nn.Module):
  """A decoder that reads the encoder's kernel outside its layer."""

  @nn.compact
  def __call__(self, x):
    hidden = jnp.tanh(fj.ForgeDense(4, optimizer=OPT, name="encoder")(x))
    return hidden @ self.get_variable(COLL, "encoder")["kernel"].T


class _TanhBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.tanh(
      fj.ForgeDense(x.shape[-1], optimizer=OPT, name="fc")(x)
    ), None


class Stacked(nn.Module):
  """Three ``_TanhBlock`` layers stacked by ``fj.scan``."""

  @nn.compact
  def __call__(self, x):
    stack = fj.scan(
      _TanhBlock,
      variable_axes={True: 0},
      split_rngs={"params": True},
      length=3,
    )
    return stack(name="stack")(x)[0]


def _penalized(model):
  """The mean square of the output plus an L2 penalty on every FORGE
  kernel, read from the variables."""

  def loss(variables, x):
    penalty = sum(
      jnp.sum(leaf**2)
      for keys, leaf in jax.tree_util.tree_leaves_with_path(variables[COLL])
      if getattr(keys[-1], "key", None) == "kernel"
    )
    return (model.apply(variables, x) ** 2).mean() + 0.1 * penalty

  return loss


def _tied(model):
  return lambda variables, x: ((model.apply(variables, x) - x) ** 2).mean()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
  "model, make_loss",
  [
    (MLP((8, 4), optimizer=OPT), _penalized),
    (Stacked(), _penalized),
    (TiedAutoencoder(), _tied),
  ],
  ids=["l2_penalty", "l2_penalty_stacked", "tied_decoder"],
)
def test_a_kernel_read_outside_its_layer_raises(model, make_loss, jit, seed):
  """A loss that also reads a FORGE kernel (an L2 penalty on it, a decoder
  tied to it) adds that use's gradient to the kernel's cotangent, the
  layer's new value: the install raises, naming the layer, instead of
  installing the sum."""
  variables, (x, _) = _init(model, seed)
  loss = make_loss(model)
  step = lambda s: s.apply_gradients(grads=jax.grad(loss)(s.params, x))
  step = jax.jit(step) if jit else step
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  with pytest.raises(
    ValueError, match=r"\['(encoder|fc1', 'fc2|stack/fc)'\].*another use of"
  ):
    step(state)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_kernel_read_under_stop_gradient_trains(jit, seed):
  """A kernel read outside its layer under ``stop_gradient`` (a logged
  norm) adds nothing to its update: the step matches one without it."""
  model = MLP((8, 4), optimizer=OPT)
  variables, (x, _) = _init(model, seed)
  penalty = _penalized(model)
  losses = [
    lambda v: (model.apply(v, x) ** 2).mean(),
    lambda v: (
      (model.apply(v, x) ** 2).mean()
      + 0.0 * jax.lax.stop_gradient(penalty(v, x))
    ),
  ]
  states = []
  for loss in losses:
    state = fj.TrainState.create(
      apply_fn=model.apply, params=host_copy(variables), tx=OPT.to_optax()
    )
    step = lambda s, loss=loss: s.apply_gradients(
      grads=jax.grad(loss)(s.params)
    )
    states.append((jax.jit(step) if jit else step)(state))
  assert fj.wiped_layers(states[1].params) == []
  for name in ("fc1", "fc2"):
    assert_bitwise_equal(
      states[1].params[COLL][name]["kernel"],
      states[0].params[COLL][name]["kernel"],
      name,
    )


class Partitioned(nn.Module):
  """Layers whose kernels are created boxed for a mesh's axes
  (``nn.with_partitioning``), FORGE's or flax's (``optimizer`` None)."""

  optimizer: object = OPT

  @nn.compact
  def __call__(self, x):
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "m"))
    if self.optimizer is None:
      dense = lambda n, name: nn.Dense(n, kernel_init=init, name=name)
    else:
      dense = lambda n, name: fj.ForgeDense(
        n, optimizer=self.optimizer, kernel_init=init, name=name
      )
    return dense(4, "fc2")(nn.gelu(dense(8, "fc1")(x)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_boxed_kernels_train_without_a_mesh_as_flax(jit, seed):
  """Variables boxed by ``nn.with_partitioning``, trained on one device
  with no mesh (as flax trains them): each layer's install reads the
  array in its box, and the steps match ``nn.Dense`` + optax's."""
  model = Partitioned()
  variables, (x, y) = _init(model, seed)
  assert isinstance(variables[COLL]["fc1"]["kernel"], nn.Partitioned)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  reference = Partitioned(optimizer=None)
  expected = TrainState.create(
    apply_fn=reference.apply,
    params=reference.init(jax.random.key(seed), x)["params"],
    tx=OPT.to_optax(),
  )

  def step(state):
    loss = lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  def flax_step(state):
    loss = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  for _ in range(3):
    state = (jax.jit(step) if jit else step)(state)
    expected = jax.jit(flax_step)(expected)
  got, want = nn.unbox(state.params), nn.unbox(expected.params)
  for name in ("fc1", "fc2"):
    assert float(got[COLL][name]["count"]) == 3.0
    assert_rel_close(
      got[COLL][name]["kernel"], want[name]["kernel"], 1e-5, name
    )
    assert_rel_close(
      got["params"][name]["bias"], want[name]["bias"], 1e-5, name
    )


class Encoder(nn.Module):
  layer: str = "proj"

  @nn.compact
  def __call__(self, x):
    return fj.ForgeDense(4, optimizer=OPT, name=self.layer)(x)


def _state(model, seed, *inputs):
  return fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(seed), *inputs),
    tx=OPT.to_optax(),
  )


class Siamese(nn.Module):
  """One encoder (one kernel) applied to two inputs: a second use that
  creates a new ForgeDense instance each call."""

  @nn.compact
  def __call__(self, x):
    encoder = Encoder(name="enc")
    return encoder(x) - encoder(x[::-1])


def test_kernel_used_twice_by_the_loss_raises(seed):
  """However the second use comes (a submodule called twice, model.apply
  twice in one loss), the second backward traced for one kernel in one
  gradient computation raises; forward passes alone (inference) do not."""
  x, _ = make_batch(seed, (4, 6), 4)
  variables = Siamese().init(jax.random.key(seed), x)
  assert Siamese().apply(variables, x).shape == (4, 4)  # inference
  with pytest.raises(ValueError, match="ran its backward twice"):
    jax.grad(lambda v: Siamese().apply(v, x).sum())(variables)
  encoder = Encoder()
  variables = encoder.init(jax.random.key(seed), x)
  twice = lambda v: (encoder.apply(v, x) * encoder.apply(v, 2 * x)).sum()
  jax.jit(twice)(variables)  # inference
  with pytest.raises(ValueError, match="ran its backward twice"):
    jax.jit(jax.grad(twice))(variables)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.tanh(fj.ForgeDense(x.shape[-1], optimizer=OPT)(x))


class Repeated(nn.Module):
  """One lifted block applied ``times`` times (ALBERT's shared layers)."""

  lift: str = "remat"
  times: int = 2

  @nn.compact
  def __call__(self, x):
    lifted = {"remat": nn.remat, "checkpoint": nn.checkpoint, "jit": nn.jit}
    block = lifted[self.lift](_Block)()
    for _ in range(self.times):
      x = block(x)
    return fj.ForgeDense(4, optimizer=OPT, name="head")(x)


@pytest.mark.parametrize("lift", ["remat", "checkpoint", "jit"])
def test_a_lifted_block_applied_twice_raises(lift, seed):
  """Inside a lifted transform each call's backward reads its own copy of
  the kernel, so the backward's check cannot see a block applied twice;
  the forward compares the array the outermost apply holds and raises,
  naming the layer. Applied once, and two models of the same structure
  in one loss, train."""
  x, _ = make_batch(seed, (4, 6), 4)
  twice = Repeated(lift)
  variables = twice.init(jax.random.key(seed), x)
  with pytest.raises(
    ValueError, match="_Block_0/ForgeDense_0' was called twice"
  ):
    jax.grad(lambda v: twice.apply(v, x).sum())(variables)
  # Inference may apply the model twice (test-time augmentation), jitted.
  jax.jit(lambda v: twice.apply(v, x) + twice.apply(v, 2 * x))(variables)
  once = Repeated(lift, times=1)
  a, b = (once.init(jax.random.key(seed + i), x) for i in range(2))
  grads = jax.jit(
    jax.grad(lambda vs: (once.apply(vs[0], x) * once.apply(vs[1], x)).sum())
  )((a, b))
  for v, g in zip((a, b), grads):
    state = fj.TrainState.create(
      apply_fn=once.apply, params=v, tx=OPT.to_optax()
    )
    assert fj.wiped_layers(state.apply_gradients(grads=g).params) == []


def _scaled_kernels(tree):
  """Every kernel times two, the other leaves as they are (a weight-scaling
  reparameterization)."""
  return jax.tree_util.tree_map_with_path(
    lambda p, a: 2 * a if "kernel" in jax.tree_util.keystr(p) else a, tree
  )


class Mapped(nn.Module):
  """A ForgeDense inside nn.map_variables over ``collection``."""

  collection: str = COLL
  trans_in_fn: object = _scaled_kernels

  @nn.compact
  def __call__(self, x):
    dense = nn.map_variables(
      fj.ForgeDense, self.collection, trans_in_fn=self.trans_in_fn, init=True
    )
    return dense(4, optimizer=OPT)(x)


@pytest.mark.filterwarnings("ignore::forge_jax.ForgeMemoryWarning")
def test_a_kernel_changed_by_map_variables_raises(seed):
  """A trans_in_fn that changes FORGE's kernel would have the rule step the
  changed kernel and write it back through the transform's transpose; the
  layer names itself instead. Inference through it, and map_variables
  that leave the kernel as it is, train as nn.Dense + optax."""
  x, y = make_batch(seed, (4, 6), 4)
  model = Mapped()
  variables = model.init(jax.random.key(seed), x)
  with pytest.raises(ValueError, match="ForgeDense_0' reads a kernel"):
    jax.grad(lambda v: model.apply(v, x).sum())(variables)
  model.apply(variables, x)  # inference
  for unchanged in (Mapped(trans_in_fn=lambda t: t), Mapped("params")):
    variables = unchanged.init(jax.random.key(seed), x)
    ((name, layer),) = variables[COLL].items()
    dense = nn.Dense(4)
    reference = TrainState.create(
      apply_fn=dense.apply,
      params={
        "params": {"kernel": layer["kernel"], **variables["params"][name]}
      },
      tx=OPT.to_optax(),
    )
    state = fj.TrainState.create(
      apply_fn=unchanged.apply, params=variables, tx=OPT.to_optax()
    )
    step = make_train_step()
    state, reference = (step(s, (x, y))[0] for s in (state, reference))
    assert fj.wiped_layers(state.params) == []
    assert_rel_close(
      state.params[COLL][name]["kernel"],
      reference.params["params"]["kernel"],
      1e-6,
    )


def test_shared_kernel_under_lax_scan_poisons_the_layer(seed):
  """A ``lax.scan`` over micro-batches with one kernel runs one traced
  backward several times: the uses' updates are summed, and their counts.
  fj.TrainState poisons such a layer, ``fj.wiped_layers`` names it and its
  next step turns the kernel NaN, as for a wiped layer."""
  x, _ = make_batch(seed, (3, 5, 6), 4)
  model = Encoder()

  def loss(v):
    total = lambda carry, xs: (carry + model.apply(v, xs).sum(), None)
    return lax.scan(total, 0.0, x)[0]

  state = _state(model, seed, x[0])
  step = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(loss)(s.params)))
  state = step(state)
  assert fj.wiped_layers(state.params) == ["proj"]
  state = step(state)
  assert np.isnan(np.asarray(state.params[COLL]["proj"]["kernel"])).all()


class ScannedEncoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = fj.scan(
      _ScanBlock, variable_axes={True: 0}, split_rngs={"params": True}, length=2
    )
    return stack(name="stack")(x)[0][0]


class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.tanh(fj.ForgeDense(x.shape[-1], optimizer=OPT)(x)), None


class VmappedEncoder(nn.Module):
  """nn.vmap over examples, every collection broadcast: one kernel."""

  @nn.compact
  def __call__(self, x):
    mapped = nn.vmap(
      Encoder,
      variable_axes={"params": None, COLL: None},
      split_rngs={"params": False},
      in_axes=0,
    )
    return mapped(name="mapped")(x)


@pytest.mark.parametrize(
  "form", ["grad(vmap)", "vmap(grad)", "jit", "lax.map", "nn.vmap", "fj.scan"]
)
def test_a_kernel_shared_across_vmap_raises(form, seed):
  """A backward mapped over examples but not over the kernel would step
  the one kernel once a slice, and JAX would sum (or stack) the updates as
  gradients: it raises at trace time, naming the layer, before anything is
  installed."""
  x, _ = make_batch(seed, (3, 5, 6), 4)
  model = {"nn.vmap": VmappedEncoder(), "fj.scan": ScannedEncoder()}.get(
    form, Encoder()
  )
  variables = model.init(jax.random.key(seed), x if form == "nn.vmap" else x[0])
  per_example = lambda v, xi: (model.apply(v, xi) ** 2).sum()
  computations = {
    "grad(vmap)": lambda: jax.grad(
      lambda v: jax.vmap(per_example, in_axes=(None, 0))(v, x).sum()
    )(variables),
    "vmap(grad)": lambda: jax.vmap(jax.grad(per_example), in_axes=(None, 0))(
      variables, x
    ),
    "jit": lambda: jax.jit(
      jax.grad(lambda v: jax.vmap(lambda xi: per_example(v, xi))(x).sum())
    )(variables),
    "lax.map": lambda: jax.grad(
      lambda v: lax.map(lambda xi: per_example(v, xi), x, batch_size=3).sum()
    )(variables),
    "nn.vmap": lambda: jax.grad(lambda v: (model.apply(v, x) ** 2).sum())(
      variables
    ),
  }
  computations["fj.scan"] = computations["grad(vmap)"]
  name = {"nn.vmap": "mapped/proj", "fj.scan": "stack"}.get(form, "proj")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", fj.ForgeMemoryWarning)  # nn.vmap's
    with pytest.raises(ValueError, match=f"layer '{name}.*jax.vmap"):
      computations[form]()


class Projection(nn.Module):
  optimizer: fj.ForgeOptimizer

  @nn.compact
  def __call__(self, x):
    x = fj.ForgeDense(8, optimizer=self.optimizer, name="body")(x)
    return fj.ForgeDense(4, optimizer=self.optimizer, name="proj")(x)


def test_a_decay_mask_that_leaves_out_a_forge_kernel_is_refused(seed):
  """FORGE decays every kernel it steps; a mask (asked at the path where
  nn.Dense keeps the kernel) that leaves one out is refused, naming the
  layer. Masks by rank keep kernels and pass."""
  x, _ = make_batch(seed, (4, 6), 4)
  skip_proj = lambda p: jax.tree_util.tree_map_with_path(
    lambda path, _: "proj" not in jax.tree_util.keystr(path), p
  )
  by_rank = lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
  for mask, refused in ((skip_proj, True), (by_rank, False)):
    opt = fj.adamw(1e-2, weight_decay=0.1, mask=mask)
    model = Projection(opt)
    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=model.init(jax.random.key(seed), x),
      tx=opt.to_optax(),
    )
    grads = jax.grad(lambda v: model.apply(v, x).sum())(state.params)
    if refused:
      with pytest.raises(ValueError, match=r"mask leaves out.*\['proj'\]"):
        state.apply_gradients(grads=grads)
    else:
      assert fj.wiped_layers(state.apply_gradients(grads=grads).params) == []


@pytest.mark.parametrize("jit", [True, False])
def test_accumulated_gradients_are_refused(jit, seed):
  """Gradients of several micro-batches summed or averaged, then installed
  once: FORGE's gradients are updates, so the install refuses a gradient
  that combines several backwards of one kernel, naming the layer. One
  micro-batch's gradient installs."""
  x, _ = make_batch(seed, (4, 4, 6), 4)
  model = Encoder()
  state = _state(model, seed, x[0])
  grad = jax.grad(lambda v, xs: (model.apply(v, xs) ** 2).sum())

  def accumulate(state, micro_batches):
    grads = [grad(state.params, xs) for xs in micro_batches]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    return state.apply_gradients(grads=mean)

  step = jax.jit(accumulate) if jit else accumulate
  with pytest.raises(ValueError, match=r"\['proj'\] combines"):
    step(state, list(x[:2]))
  assert fj.wiped_layers(step(state, list(x[:1])).params) == []
  # Gradients taken eagerly, one of them installed by a jitted apply (a
  # retry after a bad batch): another trace's arrays, not a combination.
  grad(state.params, x[0])
  retried = grad(state.params, x[1])
  installed = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, retried)
  assert fj.wiped_layers(installed.params) == []


def test_hyperparameters_as_scalar_arrays_are_numbers():
  """optax takes jnp / NumPy scalars for hyperparameters; FORGE's static,
  hashed optimizers hold them as Python numbers (the same values), and
  refuse traced or non-scalar arrays with what to give instead."""
  opt = fj.adamw(jnp.asarray(1e-2), weight_decay=np.float32(0.1))
  as_floats = (float(np.float32(1e-2)), float(np.float32(0.1)))
  assert opt == fj.adamw(as_floats[0], weight_decay=as_floats[1])
  hash(opt)
  assert isinstance(opt.learning_rate, float)
  with pytest.raises(TypeError, match="schedule"):
    jax.jit(lambda lr: fj.sgd(lr).learning_rate)(1e-2)
  with pytest.raises(TypeError, match="schedule"):
    fj.sgd(jnp.ones(2))


@pytest.mark.parametrize(
  "name", ["adamw", "nadamw", "radam", "lion", "rmsprop", "adagrad", "sgd"]
)
def test_a_schedule_of_one_element_arrays_gives_scalars(name):
  """optax broadcasts a schedule's one-element array; FORGE's per-step
  scalars are scalars all the same (the fused kernels stack them), and a
  schedule of several elements per step is refused, naming it."""
  one = lambda count: jnp.full((1,), 1e-2) * (count + 1)
  kwargs = {"weight_decay": one} if name in ("adamw", "nadamw", "lion") else {}
  scalars = getattr(fj, name)(one, **kwargs).scalars(jnp.int32(2))
  for field, value in scalars._asdict().items():
    assert jnp.shape(value) == (), field
  np.testing.assert_allclose(scalars.neg_lr, -3e-2, rtol=1e-6)
  two = lambda count: jnp.full((2,), 1e-2)
  with pytest.raises(TypeError, match=r"learning_rate schedule .* \(2,\)"):
    getattr(fj, name)(two).scalars(jnp.int32(0))


@pytest.mark.parametrize(
  "make",
  [
    lambda: fj.adam(1e-2, mu_dtype=jnp.int8),
    lambda: fj.lion(1e-3, mu_dtype="int32"),
    lambda: fj.sgd(1e-1, momentum=0.9, accumulator_dtype=jnp.bool_),
  ],
  ids=["adam-int8", "lion-int32", "sgd-bool"],
)
def test_a_moment_dtype_that_is_not_floating_is_refused(make):
  """A moment stored in an integer dtype would truncate every step (optax
  lets it; FORGE's layers would fail in jax.grad's dtype check): refused
  where the optimizer is made, naming the argument."""
  with pytest.raises(TypeError, match="_dtype=.* must be a floating dtype"):
    make()


def test_cotangents_changed_before_install_poison_the_layer(seed):
  """FORGE's cotangents are the new variables: a gradient clip applied to
  all of grads clips them too. A count that moved neither by one step nor
  by a skipped step's none marks it; the layer is poisoned."""
  x, _ = make_batch(seed, (4, 6), 4)
  state = _state(Encoder(), seed, x)

  @jax.jit
  def step(state):
    grads = jax.grad(lambda v: (state.apply_fn(v, x) ** 2).sum())(state.params)
    return state.apply_gradients(
      grads=jax.tree.map(lambda g: jnp.clip(g, -1.0, 1.0), grads)
    )

  state = step(step(state))  # the count stops at 1 from the second step
  assert fj.wiped_layers(state.params) == ["proj"]
  state = step(state)
  assert np.isnan(np.asarray(state.params[COLL]["proj"]["kernel"])).all()


def test_a_count_at_two_to_the_24_stops_there_and_keeps_training(seed):
  """float32's count + 1 rounds back to 2**24: the count stops there (its
  schedule's step with it), and the install does not mistake the step for
  a changed cotangent."""
  x, _ = make_batch(seed, (4, 6), 4)
  state = _state(Encoder(), seed, x)
  layer = state.params[COLL]["proj"]
  late = {**layer, "count": jnp.float32(2**24 - 2)}
  state = state.replace(params={**state.params, COLL: {"proj": late}})

  @jax.jit
  def step(state):
    grads = jax.grad(lambda v: (state.apply_fn(v, x) ** 2).sum())(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(4):
    kernel = state.params[COLL]["proj"]["kernel"]
    state = step(state)
    assert fj.wiped_layers(state.params) == []
    assert not np.array_equal(state.params[COLL]["proj"]["kernel"], kernel)
  assert float(state.params[COLL]["proj"]["count"]) == 2**24
  assert np.isfinite(np.asarray(state.params[COLL]["proj"]["kernel"])).all()


# ---------------------------------------------------------------------------
# Backwards that do not vouch for a layer: another computation's, another
# model's, a branch's.


class TwoHeads(nn.Module):
  @nn.compact
  def __call__(self, x, task: int):
    heads = [fj.ForgeDense(4, optimizer=OPT, name=f"head{i}") for i in (0, 1)]
    return heads[task](x)


def _two_heads_state(seed, x):
  model = TwoHeads()
  variables = {
    key: {**model.init(jax.random.key(seed), x, 0)[key], **value}
    for key, value in model.init(jax.random.key(seed), x, 1).items()
  }
  return fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )


def test_a_gradient_taken_elsewhere_does_not_wipe_an_unreached_layer(seed):
  """A gradient traced for something else (a diagnostic's norm, in its own
  jit) and never installed must not vouch for a layer in the next step:
  there the loss does not reach head0, which keeps its variables."""
  x, _ = make_batch(seed, (4, 6), 4)
  state = _two_heads_state(seed, x)
  loss = lambda v, task: (state.apply_fn(v, x, task) ** 2).mean()
  diagnostic = jax.jit(lambda p: fj.global_norm(jax.grad(loss)(p, 0)))
  assert np.isfinite(float(diagnostic(state.params)))
  step = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(loss)(s.params, 1)))
  new = step(state)
  assert_bitwise_equal(
    new.params[COLL]["head0"]["kernel"],
    state.params[COLL]["head0"]["kernel"],
    "head0",
  )
  assert new.unreached_layers() == ["head0"]
  assert fj.wiped_layers(new.params) == []


def test_another_models_backward_does_not_vouch_for_a_layer(seed):
  """Model A's head0 (reached) and model B's head0 (not reached) share a
  path; in one jitted step B installs first: its head0 keeps its
  variables, and A's head0 steps."""
  x, _ = make_batch(seed, (4, 6), 4)
  state_b = _two_heads_state(seed, x)
  state_a = _state(Encoder(layer="head0"), seed, x)

  @jax.jit
  def step(a, b):
    grads_a = jax.grad(lambda v: (a.apply_fn(v, x) ** 2).mean())(a.params)
    grads_b = jax.grad(lambda v: (b.apply_fn(v, x, 1) ** 2).mean())(b.params)
    b = b.apply_gradients(grads=grads_b)
    return a.apply_gradients(grads=grads_a), b

  new_a, new_b = step(state_a, state_b)
  assert_bitwise_equal(
    new_b.params[COLL]["head0"]["kernel"],
    state_b.params[COLL]["head0"]["kernel"],
    "B's head0",
  )
  assert new_b.unreached_layers() == ["head0"]
  assert float(new_b.params[COLL]["head1"]["count"]) == 1.0
  assert float(new_a.params[COLL]["head0"]["count"]) == 1.0


def test_another_models_backward_in_the_same_loss_does_not_vouch(seed):
  """Two models of one module (their layers at the same paths), trained by
  one loss in one jitted step, each reaching another head: the head one
  model's backward stepped says nothing of the other's, which keeps its
  variables."""
  x, _ = make_batch(seed, (4, 6), 4)
  state_a, state_b = _two_heads_state(seed, x), _two_heads_state(seed + 1, x)

  @jax.jit
  def step(a, b):
    def loss(va, vb):
      return (a.apply_fn(va, x, 0) ** 2).mean() + (
        b.apply_fn(vb, x, 1) ** 2
      ).mean()

    grads_a, grads_b = jax.grad(loss, argnums=(0, 1))(a.params, b.params)
    return a.apply_gradients(grads=grads_a), b.apply_gradients(grads=grads_b)

  new_a, new_b = step(state_a, state_b)
  for new, old, unreached in ((new_a, state_a, 1), (new_b, state_b, 0)):
    assert_bitwise_equal(
      new.params[COLL][f"head{unreached}"]["kernel"],
      old.params[COLL][f"head{unreached}"]["kernel"],
      f"head{unreached}",
    )
    assert new.unreached_layers() == [f"head{unreached}"]
    assert float(new.params[COLL][f"head{1 - unreached}"]["count"]) == 1.0
    assert fj.wiped_layers(new.params) == []


@pytest.mark.parametrize("where", ["eager", "own jit"])
def test_gradients_taken_outside_a_jitted_install_keep_unreached_layers(
  where, seed
):
  """Gradients taken eagerly (or in a jit of their own) and installed by a
  jitted ``apply_gradients``: the install's trace, cached after its first
  call, cannot trust a backward traced elsewhere. A later step whose loss
  does not reach head0 keeps it bit for bit, as the eager install does."""
  x, _ = make_batch(seed, (4, 6), 4)
  state = _two_heads_state(seed, x)
  loss = lambda v, task: (state.apply_fn(v, x, task) ** 2).mean()
  grad = jax.grad(loss, argnums=0)
  if where == "own jit":
    grad = jax.jit(grad, static_argnums=1)
  install = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  state = install(state, grad(state.params, 0))
  before = host_copy(state.params[COLL]["head0"])
  state = install(state, grad(state.params, 1))
  assert_bitwise_equal(
    state.params[COLL]["head0"]["kernel"], before["kernel"], "head0"
  )
  assert state.unreached_layers() == ["head0"]
  assert fj.wiped_layers(state.params) == []


# ---------------------------------------------------------------------------
# Several models whose layers share paths, in one process (a sweep, a GAN).


def _sweep_state(optimizer, seed, x, tx=None, jit_apply=True):
  model = MLP((8, 4), optimizer)
  return fj.TrainState.create(
    apply_fn=jax.jit(model.apply) if jit_apply else model.apply,
    params=model.init(jax.random.key(seed), x),
    tx=(tx or optimizer).to_optax(),
  )


def test_models_at_the_same_paths_with_other_optimizers_train_in_turn(seed):
  """A learning-rate sweep whose models train in turn, with jitted
  ``apply`` and eager installs: each model's install checks tx against its
  own layers' optimizer, not the one traced last at the paths, and each
  trains as it does alone."""
  x, _ = make_batch(seed, (4, 6), 4)
  optimizers = (fj.adamw(1e-2), fj.adamw(3e-2))
  loss = lambda s: lambda v: (s.apply_fn(v, x) ** 2).mean()
  states = [_sweep_state(opt, seed, x) for opt in optimizers]
  alone = []
  for state in states:
    for _ in range(2):
      state = state.apply_gradients(grads=jax.grad(loss(state))(state.params))
    alone.append(state)
  for _ in range(2):
    grads = [jax.grad(loss(state))(state.params) for state in states]
    states = [s.apply_gradients(grads=g) for s, g in zip(states, grads)]
  for state, reference in zip(states, alone):
    assert_bitwise_equal(
      state.params[COLL]["fc1"]["kernel"],
      reference.params[COLL]["fc1"]["kernel"],
      "fc1",
    )
    assert_bitwise_equal(
      state.params["params"]["fc1"]["bias"],
      reference.params["params"]["fc1"]["bias"],
      "fc1's bias",
    )


def test_a_wrong_tx_is_refused_beside_a_model_that_it_fits(seed):
  """Model A's tx is model B's optimizer; B's layers share A's paths and
  are traced after A's: A's install still refuses its tx. (Known by the
  kernel its backward read; through a jitted ``apply`` the install would
  accept the optimizer of any recent model at those paths.)"""
  x, _ = make_batch(seed, (4, 6), 4)
  slow, fast = fj.adamw(1e-2), fj.adamw(3e-2)
  a = _sweep_state(slow, seed, x, tx=fast, jit_apply=False)
  b = _sweep_state(fast, seed, x, jit_apply=False)
  loss = lambda s: lambda v: (s.apply_fn(v, x) ** 2).mean()
  grads_a = jax.grad(loss(a))(a.params)
  b.apply_gradients(grads=jax.grad(loss(b))(b.params))
  with pytest.raises(ValueError, match="tx is not the optimizer"):
    a.apply_gradients(grads=grads_a)


def test_the_clipping_check_reads_each_models_own_backward(seed):
  """Model A steps clipped and B unclipped, their layers at the same paths:
  A's install takes A's clipped gradient whichever was taken last, and A's
  unclipped gradient (``jax.grad`` where ``max_grad_norm`` is set) is
  refused even after B's clipped one."""
  x, _ = make_batch(seed, (4, 6), 4)
  model = MLP((8, 4), OPT)
  params = model.init(jax.random.key(seed), x)
  a = fj.TrainState.create(
    apply_fn=model.apply, params=params, tx=OPT.to_optax(), max_grad_norm=0.1
  )
  b = fj.TrainState.create(
    apply_fn=model.apply,
    params=jax.tree.map(jnp.copy, params),
    tx=OPT.to_optax(),
    max_grad_norm=0.1,
  )
  loss = lambda v: (model.apply(v, x) ** 2).mean()
  clipped_a = a.value_and_grad(loss)(a.params)[1]
  jax.grad(loss)(jax.tree.map(jnp.copy, params))  # another model, unclipped
  assert fj.wiped_layers(a.apply_gradients(grads=clipped_a).params) == []
  unclipped_a = jax.grad(loss)(a.params)
  b.value_and_grad(loss)(b.params)
  with pytest.raises(ValueError, match="stepped with unclipped gradients"):
    a.apply_gradients(grads=unclipped_a)


def test_accumulation_is_refused_beside_another_models_install(seed):
  """Model A's gradients of two micro-batches averaged; model B, its
  layers at the same paths, installs a step in between: A's install still
  refuses the combination."""
  x, _ = make_batch(seed, (2, 4, 6), 4)
  model = Encoder()
  a, b = _state(model, seed, x[0]), _state(model, seed + 1, x[0])
  grad = jax.grad(lambda v, xs: (model.apply(v, xs) ** 2).sum())
  grads = [grad(a.params, xs) for xs in x]
  b.apply_gradients(grads=grad(b.params, x[0]))
  mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
  with pytest.raises(ValueError, match=r"\['proj'\] combines"):
    a.apply_gradients(grads=mean)


def test_a_layer_in_a_branch_that_does_not_run_keeps_its_variables(seed):
  """``nn.cond`` traces both branches' backwards, but only one runs: the
  layer of the other keeps its variables, and steps when its branch runs."""

  class Branches(nn.Module):
    def setup(self):
      self.a = fj.ForgeDense(4, optimizer=OPT)
      self.b = fj.ForgeDense(4, optimizer=OPT)

    def __call__(self, x, pred):
      if self.is_initializing():  # nn.cond's branches find both layers
        self.a(x)
        self.b(x)
      return nn.cond(pred, lambda m, x: m.a(x), lambda m, x: m.b(x), self, x)

  x, _ = make_batch(seed, (4, 6), 4)
  model = Branches()
  state = _state(model, seed, x, True)
  loss = lambda v, pred: (model.apply(v, x, pred) ** 2).mean()
  step = jax.jit(
    lambda s, pred: s.apply_gradients(grads=jax.grad(loss)(s.params, pred))
  )
  new = step(state, jnp.bool_(True))
  assert_bitwise_equal(
    new.params[COLL]["b"]["kernel"], state.params[COLL]["b"]["kernel"], "b"
  )
  assert new.unreached_layers() == ["b"]
  assert float(new.params[COLL]["a"]["count"]) == 1.0
  new = step(new, jnp.bool_(False))
  assert float(new.params[COLL]["b"]["count"]) == 1.0
  assert fj.wiped_layers(new.params) == []


_SGD = fj.sgd(0.1)


class CompactBranches(nn.Module):
  """flax's compact ``nn.cond`` idiom: the branches' layers are made outside
  the conditional and called once at init, so both branches find them."""

  forge: bool = True

  @nn.compact
  def __call__(self, x, pred):
    make = (
      (lambda name: fj.ForgeDense(4, optimizer=_SGD, name=name))
      if self.forge
      else (lambda name: nn.Dense(4, name=name))
    )
    a, b = make("a"), make("b")
    if self.is_initializing():
      a(x)
      b(x)
    return nn.cond(pred, lambda m, x: a(x), lambda m, x: 2 * b(x), self, x)


def test_compact_branches_initialize_and_train_like_flax(seed):
  """Calling each branch's layer at init and again inside ``nn.cond`` is
  one use a loss, as with flax's layers; both branches train as
  ``nn.Dense`` + optax do (plain SGD: the branch not taken keeps its
  weights in both)."""
  x, _ = make_batch(seed, (4, 6), 4)
  model = CompactBranches()
  variables = model.init(jax.random.key(seed), x, True)
  states = [
    fj.TrainState.create(
      apply_fn=model.apply, params=variables, tx=_SGD.to_optax()
    ),
    TrainState.create(
      apply_fn=CompactBranches(forge=False).apply,
      params=fj.to_dense(variables),
      tx=optax.sgd(0.1),
    ),
  ]
  step = jax.jit(
    lambda s, pred: s.apply_gradients(
      grads=jax.grad(lambda v: (s.apply_fn(v, x, pred) ** 2).mean())(s.params)
    )
  )
  for pred in (True, False, False):
    states = [step(s, jnp.bool_(pred)) for s in states]
  forge, flax = states
  for name in ("a", "b"):
    np.testing.assert_allclose(
      forge.params[COLL][name]["kernel"],
      flax.params["params"][name]["kernel"],
      rtol=1e-5,
      atol=1e-7,
    )
  assert fj.wiped_layers(forge.params) == []


class Looped(nn.Module):
  """A layer made in setup, called before ``nn.while_loop`` at init (flax's
  idiom) and inside it, its variables broadcast."""

  forge: bool = True

  def setup(self):
    self.layer = fj.ForgeDense(6, optimizer=OPT) if self.forge else nn.Dense(6)

  def __call__(self, x):
    if self.is_initializing():
      self.layer(x)
    body = lambda m, c: (c[0] + 1, jnp.tanh(m.layer(c[1])))
    return nn.while_loop(
      lambda m, c: c[0] < 3,
      body,
      self,
      (0, x),
      broadcast_variables=("params", COLL),
    )[1]


class CompactLooped(nn.Module):
  """``Looped`` with its layer made in a compact ``__call__``: the loop's
  body closes over the layer that init called before the loop."""

  forge: bool = True

  @nn.compact
  def __call__(self, x):
    layer = (
      fj.ForgeDense(6, optimizer=OPT, name="layer")
      if self.forge
      else nn.Dense(6, name="layer")
    )
    if self.is_initializing():
      layer(x)
    body = lambda m, c: (c[0] + 1, jnp.tanh(layer(c[1])))
    return nn.while_loop(lambda m, c: c[0] < 3, body, self, (0, x))[1]


@pytest.mark.parametrize("model", [Looped, CompactLooped])
def test_a_layer_initialized_before_a_while_loop_runs_in_it(model, seed):
  """Inference through ``nn.while_loop`` matches flax's layer; ``init``
  finds the variables made before the loop instead of asking to lift
  FORGE's collection, and takes the loop's calls of the layer for the
  inference they are."""
  x, _ = make_batch(seed, (4, 6), 4)
  variables = model().init(jax.random.key(seed), x)
  np.testing.assert_allclose(
    model().apply(variables, x),
    model(forge=False).apply(fj.to_dense(variables), x),
    rtol=1e-6,
  )


# ---------------------------------------------------------------------------
# Optimizers FORGE cannot fuse.


@pytest.mark.parametrize(
  "optimizer,extra",
  [
    pytest.param(optax.adafactor(1e-3), "elementwise", id="adafactor"),
    pytest.param(
      optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
      "clip_by_global_norm",
      id="chain-clip-adam",
    ),
    pytest.param(optax.adam(1e-3), "fj.adam", id="optax.adam"),
    pytest.param(
      optax.MultiSteps(optax.adam(1e-3), 4), "micro-batch", id="MultiSteps"
    ),
    pytest.param(
      optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation(),
      "micro-batch",
      id="MultiSteps.gradient_transformation()",
    ),
  ],
)
def test_non_forge_optimizer_raises_type_error(optimizer, extra, seed):
  x, _ = make_batch(seed, (4, 6), 4)
  layer = fj.ForgeDense(3, optimizer=optimizer)
  with pytest.raises(TypeError, match="forge_jax optimizer") as info:
    layer.init(jax.random.key(seed), x)
  assert extra in str(info.value)


# ---------------------------------------------------------------------------
# Wrong inputs and tampered variables.


def test_wrong_input_width_raises(seed):
  layer = fj.ForgeDense(5, optimizer=OPT)
  variables = layer.init(jax.random.key(seed), jnp.ones((4, 12)))
  with pytest.raises((TypeError, ValueError), match=r"\(12, 5\)"):
    layer.apply(variables, jnp.ones((4, 13)))


@pytest.mark.parametrize("what", ["collection", "kernel"])
def test_kernel_cast_before_apply_raises_type_error(what, seed):
  model = MLP((8, 4), optimizer=OPT)
  variables, (x, _) = _init(model, seed)
  if what == "collection":
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables[COLL])
  else:
    cast = jax.tree.map(lambda a: a, variables[COLL])
    cast["fc2"]["kernel"] = cast["fc2"]["kernel"].astype(jnp.bfloat16)
  tampered = {"params": variables["params"], COLL: cast}
  with pytest.raises(TypeError, match="changed before apply"):
    model.apply(tampered, x)
  with pytest.raises(TypeError, match="changed before apply"):
    jax.grad(lambda v: model.apply(v, x).sum())(tampered)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grads_cast_to_bfloat16_are_refused(jit, seed):
  """FORGE's gradients are the new weights and state: grads cast to
  bfloat16 by the caller would round them (eagerly they installed bfloat16
  kernels, under jit rounded float32 ones), where optax keeps its float32
  weights."""
  x, _ = make_batch(seed, (4, 6), 4)
  state = _state(Encoder(), seed, x)

  def step(state):
    grads = jax.grad(lambda v: (state.apply_fn(v, x) ** 2).sum())(state.params)
    cast = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
    return state.apply_gradients(grads=cast)

  with pytest.raises(TypeError, match="bfloat16 for float32"):
    (jax.jit(step) if jit else step)(state)


def test_nnx_grads_cast_to_bfloat16_are_refused():
  model = fj.nnx.Linear(6, 4, optimizer=OPT, rngs=nnx.Rngs(0))
  optimizer = fj.nnx.Optimizer(model, OPT.to_optax(), wrt=nnx.Param)
  grads = fj.nnx.grad(lambda m: (m(jnp.ones((4, 6))) ** 2).sum())(model)
  cast = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
  with pytest.raises(TypeError, match="bfloat16 for float32"):
    optimizer.update(model, cast)


def test_state_of_another_optimizer_raises_type_error(seed):
  variables, (x, _) = _init(MLP((8, 4), optimizer=fj.adam(1e-2)), seed)
  with pytest.raises(TypeError, match="another optimizer"):
    MLP((8, 4), optimizer=fj.sgd(1e-2, momentum=0.9)).apply(variables, x)


# ---------------------------------------------------------------------------
# Differentiating w.r.t. params only.


def _params_only_loss(model, variables, batch):
  """The loss as a function of ``params`` alone (the collection held fixed)."""
  return lambda params: cross_entropy(
    model.apply, {"params": params, COLL: variables[COLL]}, batch
  )


def test_grad_of_params_only_raises_at_trace_time(seed):
  model = MLP((8, 4), optimizer=OPT)
  variables, batch = _init(model, seed)

  loss = _params_only_loss(model, variables, batch)
  with pytest.raises(ValueError, match=COLL):
    jax.grad(loss)(variables["params"])
  with pytest.raises(ValueError, match=COLL):
    jax.jit(jax.grad(loss)).lower(variables["params"])  # trace only


class NoBiasFirst(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = fj.ForgeDense(8, optimizer=OPT, use_bias=False, name="fc1")(x)
    return nn.Dense(4, name="head")(nn.gelu(h))


def test_grad_of_params_only_is_refused_for_first_layer_without_bias(seed):
  """A first ForgeDense without bias sees neither a perturbed input (the
  data) nor a perturbed bias when only params are differentiated, so no
  check can run inside the layer; fj.TrainState refuses the grads."""
  model = NoBiasFirst()
  variables, batch = _init(model, seed)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=OPT.to_optax()
  )
  loss = _params_only_loss(model, variables, batch)
  grads = jax.grad(loss)(variables["params"])
  with pytest.raises(ValueError, match="all of state.params"):
    state.apply_gradients(grads={"params": grads})


# ---------------------------------------------------------------------------
# A layer whose output does not reach the loss.


class WithAuxHead(nn.Module):
  aux: str = "unused"  # 'unused' | 'stop_gradient' | 'used' (in the loss)

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(fj.ForgeDense(8, optimizer=OPT, name="fc1")(x))
    out = fj.ForgeDense(4, optimizer=OPT, name="fc2")(h)
    aux = fj.ForgeDense(4, optimizer=OPT, name="aux")(h)
    if self.aux == "stop_gradient":
      return out + 0.0 * jax.lax.stop_gradient(aux)
    if self.aux == "used":
      return out + aux
    return out  # aux computed, then dropped


def _kernel_and_state(layer):
  return jax.tree.leaves((layer["kernel"], layer["opt_state"]))


@pytest.mark.parametrize("mode", ["unused", "stop_gradient"])
def test_layer_not_reaching_the_loss_is_wiped_and_fails_loudly(mode, seed):
  """The documented contract (README, 'A ForgeDense whose output does not
  reach the loss loses its variables'): its cotangents are zero, so the step
  overwrites its kernel and state with zeros; ``intact`` becomes 0 and
  ``fj.wiped_layers`` names it; its next backward pass writes a NaN kernel
  (NaN learning rate), so the loss turns NaN and every other FORGE layer
  skips its update from then on. Data lost, loudly."""
  variables, batch = _init(WithAuxHead(mode), seed, (2, 3, 6))
  state = TrainState.create(
    apply_fn=WithAuxHead(mode).apply, params=variables, tx=OPT.to_optax()
  )
  assert fj.wiped_layers(state.params) == []
  step = jax.jit(make_train_step(), donate_argnums=0)

  # Step 1: aux does not reach the loss -> wiped.
  state, loss = step(state, batch)
  assert np.isfinite(float(loss))
  aux = state.params[COLL]["aux"]
  for leaf in _kernel_and_state(aux):
    assert not np.asarray(leaf).any()  # all zeros: the data is gone
  assert float(aux["intact"]) == 0.0
  assert fj.wiped_layers(state.params) == ["aux"]
  for name in ("fc1", "fc2"):  # the others trained normally
    assert float(state.params[COLL][name]["intact"]) == 1.0
    assert float(state.params[COLL][name]["count"]) == 1.0

  # Step 2: aux is used again; its backward writes a NaN kernel.
  state = state.replace(apply_fn=WithAuxHead("used").apply)
  state, loss = step(state, batch)
  assert np.isnan(np.asarray(state.params[COLL]["aux"]["kernel"])).all()
  assert fj.wiped_layers(state.params) == ["aux"]
  before = host_copy(state.params[COLL])

  # Step 3: the loss is NaN and no other FORGE layer takes the step.
  state, loss = step(state, batch)
  assert np.isnan(float(loss))
  assert fj.wiped_layers(state.params) == ["aux"]
  for name in ("fc1", "fc2"):
    after = state.params[COLL][name]
    for old, new in zip(
      _kernel_and_state(before[name]), _kernel_and_state(after)
    ):
      assert_bitwise_equal(new, old, name)
    assert float(after["count"]) == float(before[name]["count"]) == 2.0


# ---------------------------------------------------------------------------
# Non-finite loss.


def test_nonfinite_loss_leaves_every_forge_layer_untouched(seed):
  """NaN in one input element: the loss is NaN, every dy has a NaN, so every
  ForgeDense skips the step whole: kernel and state bit for bit, count not
  incremented, skipped = kernel size. (The biases belong to optax: plain
  optax would write NaN into them, so the model wraps its optax part in
  optax.apply_if_finite, which lets the next finite step train again.)"""
  model = MLP((8, 6, 4), optimizer=OPT)
  variables, (x, y) = _init(model, seed, (2, 5, 6))
  state = TrainState.create(
    apply_fn=model.apply,
    params=variables,
    tx=optax.apply_if_finite(OPT.to_optax(), max_consecutive_errors=3),
  )
  step = jax.jit(make_train_step(), donate_argnums=0)
  state, _ = step(state, (x, y))  # one good step: non-zero state, count 1
  before = host_copy(state.params[COLL])
  before_params = host_copy(state.params["params"])

  bad_x = poison(x, np.s_[1, 2, 3])
  state, loss = step(state, (bad_x, y))
  assert np.isnan(float(loss))
  after = host_copy(state.params[COLL])
  for name, layer in before.items():
    for old, new in zip(
      jax.tree.leaves((layer["kernel"], layer["opt_state"])),
      jax.tree.leaves((after[name]["kernel"], after[name]["opt_state"])),
    ):
      assert_bitwise_equal(new, old, f"{name}")
    assert float(after[name]["count"]) == float(layer["count"]) == 1.0
    assert float(after[name]["skipped"]) == layer["kernel"].size
    assert float(after[name]["intact"]) == 1.0

  # A finite step afterwards trains again.
  for old, new in zip(
    jax.tree.leaves(before_params),
    jax.tree.leaves(host_copy(state.params["params"])),
  ):
    assert_bitwise_equal(new, old, "bias")  # apply_if_finite kept them
  state, loss = step(state, (x, y))
  assert np.isfinite(float(loss))
  for name, layer in state.params[COLL].items():
    assert float(layer["count"]) == 2.0
    assert float(layer["skipped"]) == 0.0


# ---------------------------------------------------------------------------
# Drop-in for nn.Dense.


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("shape", [(6,), (2, 3, 2, 6)], ids=["rank1", "rank4"])
def test_rank1_and_rank4_inputs_work_like_nn_dense(shape, implementation, seed):
  x = jax.random.normal(jax.random.key(seed), shape)
  key = jax.random.key(seed + 1)
  forge = fj.ForgeDense(
    5, optimizer=OPT, implementation=implementation, name="fc1"
  )
  dense = nn.Dense(5, name="fc1")
  fv, dv = forge.init(key, x), dense.init(key, x)
  assert_bitwise_equal(fv[COLL]["kernel"], dv["params"]["kernel"], "kernel")
  y_forge, y_dense = forge.apply(fv, x), dense.apply(dv, x)
  assert y_forge.shape == y_dense.shape == shape[:-1] + (5,)
  assert_bitwise_equal(y_forge, y_dense, "outputs")

  # The backward: dx and dbias bit for bit; the kernel steps like optax.
  ct = jax.random.normal(jax.random.key(seed + 2), y_dense.shape)
  _, forge_vjp = jax.vjp(forge.apply, fv, x)
  _, dense_vjp = jax.vjp(dense.apply, dv, x)
  (fg, fdx), (dg, ddx) = forge_vjp(ct), dense_vjp(ct)
  assert_bitwise_equal(fdx, ddx, "dx")
  assert_bitwise_equal(fg["params"]["bias"], dg["params"]["bias"], "dbias")
  tx = OPT.to_optax()
  updates, _ = tx.update(dg["params"], tx.init(dv["params"]), dv["params"])
  expected = optax.apply_updates(dv["params"], updates)["kernel"]
  assert_rel_close(fg[COLL]["kernel"], expected, 1e-6, "stepped kernel")
  assert float(fg[COLL]["count"]) == 1.0


def test_pretrained_nn_dense_weights_load_by_path(seed):
  x, _ = make_batch(seed, (4, 6), 4)
  key = jax.random.key(seed)
  forge_model, dense_model = MLP((8, 4), optimizer=OPT), MLP((8, 4))
  fv, dv = forge_model.init(key, x), dense_model.init(key, x)
  # Same initializers, same rng paths: the same kernels by name.
  for name in ("fc1", "fc2"):
    assert_bitwise_equal(
      fv[COLL][name]["kernel"], dv["params"][name]["kernel"], name
    )
  paths = lambda tree: {
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  }
  assert paths(fv["params"]) == {"['fc1']['bias']", "['fc2']['bias']"}
  assert "['fc1']['kernel']" in paths(fv[COLL])

  # Load a pretrained nn.Dense checkpoint by path.
  pretrained = dense_model.init(jax.random.key(seed + 1), x)
  loaded = {
    "params": {
      name: {"bias": layer["bias"]}
      for name, layer in pretrained["params"].items()
    },
    COLL: {
      name: {
        **fv[COLL][name],
        "kernel": layer["kernel"],
        "opt_state": OPT.init(layer["kernel"]),
      }
      for name, layer in pretrained["params"].items()
    },
  }
  assert_bitwise_equal(
    forge_model.apply(loaded, x), dense_model.apply(pretrained, x), "outputs"
  )


def test_float64_kernels_are_refused_and_float64_inputs_train_as_nn_dense():
  """The rules compute in float32: a float64 kernel (x64 on) would lose
  optax's float64 precision, so it is refused by name; float64 inputs to a
  float32 kernel step as nn.Dense + optax does."""
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(1), (4, 3), jnp.float64)
    forge = fj.ForgeDense(5, optimizer=OPT, param_dtype=jnp.float64)
    with pytest.raises(TypeError, match="float64 kernel"):
      forge.init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="float64 kernel"):
      fj.nnx.Linear(
        3, 5, optimizer=OPT, param_dtype=jnp.float64, rngs=nnx.Rngs(0)
      )
    dense, forge = nn.Dense(5), fj.ForgeDense(5, optimizer=OPT)
    dense_vars = dense.init(jax.random.key(0), x)
    forge_vars = fj.from_dense(dense_vars, forge, x)
    loss = lambda apply: lambda p: jnp.sum(apply(p, x) ** 2)
    expected = TrainState.create(
      apply_fn=dense.apply, params=dense_vars, tx=OPT.to_optax()
    )
    actual = fj.TrainState.create(
      apply_fn=forge.apply, params=forge_vars, tx=OPT.to_optax()
    )
    # One program each (eager, every float64 op compiles on its own).
    step = lambda apply: jax.jit(
      lambda s: s.apply_gradients(grads=jax.grad(loss(apply))(s.params))
    )
    expected = step(dense.apply)(expected)
    actual = step(forge.apply)(actual)
    np.testing.assert_allclose(
      fj.to_dense(actual.params)["params"]["kernel"],
      expected.params["params"]["kernel"],
      rtol=1e-6,
    )
    assert forge.apply(actual.params, x).dtype == jnp.float64
