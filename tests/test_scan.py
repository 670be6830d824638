"""fj.scan_layers: nn.scan's layout, an in-place reverse-loop backward."""

import functools

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
from flax.training.train_state import TrainState

import forge_jax as fj
from forge_jax.scan import scan_layers

COLL = fj.FORGE_COLLECTION
OPT = fj.adamw(1e-2, weight_decay=0.1)
WIDTH, LAYERS, TOKENS = 32, 4, 24


class Block(nn.Module):
  forge: bool = True

  @nn.compact
  def __call__(self, x, scale):
    def dense(name):
      if self.forge:
        return fj.ForgeDense(WIDTH, optimizer=OPT, use_bias=False, name=name)
      return nn.Dense(WIDTH, use_bias=False, name=name)
    norm = self.param("norm", nn.initializers.ones_init(), (WIDTH,))
    h = jnp.tanh(dense("fc1")(x * norm * scale))
    return x + dense("fc2")(h), None


class Stack(nn.Module):
  mode: str  # 'forge_scan' | 'forge_nn_scan' | 'optax'

  @nn.compact
  def __call__(self, x):
    forge = self.mode != "optax"
    if self.mode == "forge_scan":
      layers = scan_layers(Block, LAYERS, num_broadcast_args=1)
    else:
      layers = nn.scan(nn.remat(Block), variable_axes={True: 0},
                       split_rngs={"params": True}, in_axes=(nn.broadcast,),
                       length=LAYERS)
    x, _ = layers(forge, name="layers")(x, 0.5)
    return x


def _train(mode, seed, steps=3):
  model = Stack(mode)
  key = jax.random.key(seed)
  x = jax.random.normal(key, (TOKENS, WIDTH))
  target = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, WIDTH))
  variables = model.init(key, x)
  state = TrainState.create(apply_fn=model.apply, params=variables,
                            tx=OPT.to_optax())

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
      lambda a: (a.shape, a.dtype), theirs)
  assert ours[COLL]["layers"]["fc1"]["kernel"].shape == (LAYERS, WIDTH, WIDTH)


def test_matches_nn_scan_and_optax(seed):
  init_s, forge, forge_losses, _ = _train("forge_scan", seed)
  init_n, nn_scan, nn_losses, _ = _train("forge_nn_scan", seed)
  _, ref, ref_losses, _ = _train("optax", seed)
  jax.tree.map(np.testing.assert_array_equal, init_s, init_n)  # same init
  np.testing.assert_allclose(forge_losses, nn_losses, rtol=1e-6)
  np.testing.assert_allclose(forge_losses, ref_losses, rtol=1e-5)
  for name, kernel in _kernels(forge, "forge").items():
    np.testing.assert_allclose(kernel, _kernels(nn_scan, "forge")[name],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernel, _kernels(ref, "optax")[name],
                               rtol=1e-5, atol=1e-6)
    moved = np.abs(kernel - init_s[COLL]["layers"][name]["kernel"])
    assert moved.reshape(LAYERS, -1).max(axis=1).min() > 0, "every layer moves"
  # Norm scales: ordinary stacked gradients, trained by optax.
  np.testing.assert_allclose(forge.params["params"]["layers"]["norm"],
                             ref.params["params"]["layers"]["norm"],
                             rtol=1e-5, atol=1e-6)
  counts = forge.params[COLL]["layers"]["fc1"]["count"]
  np.testing.assert_array_equal(counts, np.full(LAYERS, 3.0))
  assert fj.wiped_layers(forge.params) == []


def test_less_temporary_memory_than_nn_scan(seed):
  _, _, _, ours = _train("forge_scan", seed, steps=1)
  _, _, _, theirs = _train("forge_nn_scan", seed, steps=1)
  # nn.scan's transpose builds new stacks for every updated kernel and state.
  assert ours.temp_size_in_bytes < theirs.temp_size_in_bytes
