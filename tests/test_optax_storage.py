"""``fj.optax_with_storage``: the layers' rule and storage for optax's params.

* bfloat16 parameters step by the FORGE layers' XLA rule (``apply_update``),
  stochastic rounding keyed by each parameter's path;
  float32 ones come within an ulp of optax's alias.
* int8 states are stored as blocks, at about half of bfloat16's bytes, and
  train like float32 states; masks, non-finite gradients and a missing
  ``params`` behave as documented.
* ``fj.TrainState`` takes it as the layers' rule, trains an embedding with
  it, checkpoints it bit for bit, and refuses another optimizer's;
  ``fj.nnx.Optimizer`` trains an NNX embedding with it.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import forge_jax as fj
from forge_jax import checkpoint
from forge_jax import quantization as Q
from forge_jax.clipping import layer_at, with_layer
from forge_jax.ops.update import apply_update

from conftest import (
  assert_bitwise_equal,
  assert_same_bits,
  assert_within_rounding,
)

BF16, F32 = jnp.bfloat16, jnp.float32

RULES = {
  "adamw-int8-sr": fj.adamw(
    1e-2, weight_decay=0.1, state_dtype="int8", weight_rounding="stochastic"
  ),
  "lion-int8": fj.lion(1e-3, state_dtype="int8"),
  "sgd-momentum-bf16": fj.sgd(1e-2, momentum=0.9, state_dtype="bfloat16"),
  "rmsprop-int8-sr": fj.rmsprop(
    1e-3, state_dtype="int8", weight_rounding="stochastic", rounding_seed=7
  ),
  "adamw-int8-4bit-sr": fj.adamw(
    1e-2,
    weight_decay=0.1,
    state_dtype="int8",
    second_moment_bits=4,
    weight_rounding="stochastic",
  ),
}


def _params(seed, dtype):
  keys = jax.random.split(jax.random.key(seed), 3)
  return {
    "embed": jax.random.normal(keys[0], (100, 128), dtype),
    "norm": {"scale": 1 + 0.1 * jax.random.normal(keys[1], (96,), dtype)},
    "heads": jax.random.normal(keys[2], (2, 3, 64), dtype),
  }


def _grads(params, key):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten(
    [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  )


def _stepper(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


# adamw-int8-sr's int8 moments and rounding are those of lion-int8,
# rmsprop-int8-sr and adamw-int8-4bit-sr: it runs with --run-slow.
@pytest.mark.parametrize(
  "name",
  [
    pytest.param(name, marks=pytest.mark.slow)
    if name == "adamw-int8-sr"
    else name
    for name in RULES
  ],
)
def test_bf16_parameters_take_the_rules_bits(name, seed):
  """Each bfloat16 parameter and its state after three steps are those of
  ``apply_update`` on its 2-D view, with a rounding key of its own path (up
  to how XLA contracts the rule's multiply-adds in the two programs: one
  bf16 ulp or int8 code apart, float32 block scales within 1e-6)."""
  opt = RULES[name]
  tx = fj.optax_with_storage(opt)
  params = _params(seed, BF16)
  state = tx.init(params)
  reference = jax.tree.map(
    lambda p: opt.init(p.reshape(-1, p.shape[-1])), params
  )
  step = _stepper(tx)

  @functools.partial(jax.jit, static_argnames="path_key")
  def reference_step(param, leaf_state, grad, count, path_key):
    key = None
    if opt.weight_rounding == "stochastic":
      key = Q.rounding_key(opt.rounding_seed, path_key, count)
    view = (-1, param.shape[-1])
    new, new_state, _ = apply_update(
      opt,
      grad.reshape(view),
      param.reshape(view),
      leaf_state,
      opt.scalars(count),
      jnp.bool_(True),
      rounding_key=key,
    )
    return new.reshape(param.shape), new_state

  for count, key in enumerate(jax.random.split(jax.random.key(seed + 1), 3)):
    grads = _grads(params, key)
    expected = {}
    for path, param in jax.tree_util.tree_flatten_with_path(params)[0]:
      name_of = jax.tree_util.keystr(path)
      expected[name_of] = reference_step(
        param,
        _at(reference, path),
        _at(grads, path),
        jnp.int32(count),
        Q.layer_id_from_path([name_of]),
      )
    params, state = step(params, state, grads)
    for path, param in jax.tree_util.tree_flatten_with_path(params)[0]:
      name_of = jax.tree_util.keystr(path)
      new, new_state = expected[name_of]
      assert param.dtype == BF16
      assert_within_rounding(
        (param, _param_state(state, path)),
        (new, new_state),
        name_of,
        identical=0.99,
      )
      reference = with_layer(
        reference, tuple(key.key for key in path), _param_state(state, path)
      )
  assert int(state.count) == 3


def _at(tree, path):
  """The entry of a nested dict at a key path (``tree_flatten_with_path``'s)."""
  return layer_at(tree, tuple(key.key for key in path))


def _param_state(state, path):
  """One parameter's state from :class:`fj.optax_storage.StoredOptaxState`
  (whose fields are trees shaped like the parameters)."""
  return jax.tree.map(
    lambda tree: _at(tree, path),
    state.state,
    is_leaf=lambda x: isinstance(x, dict),
  )


def test_stochastic_rounding_keys_differ_between_parameters(seed):
  """Two identical bfloat16 parameters with identical gradients round
  differently (each draws from its own path), and each lands on one of the
  two bf16 neighbours of the float32 step."""
  opt = fj.sgd(1e-3, weight_rounding="stochastic")
  value = jax.random.normal(jax.random.key(seed), (64, 64), BF16)
  params = {"a": value, "b": value}
  grad = jax.random.normal(jax.random.key(seed + 1), (64, 64), BF16)
  tx = fj.optax_with_storage(opt)
  new, _ = _stepper(tx)(params, tx.init(params), {"a": grad, "b": grad})
  assert (np.asarray(new["a"]) != np.asarray(new["b"])).mean() > 0.1
  exact = np.asarray(value, np.float32) - 1e-3 * np.asarray(grad, np.float32)
  for leaf in (new["a"], new["b"]):
    gap = np.abs(np.asarray(leaf, np.float32) - exact)
    assert (gap <= np.spacing(np.abs(exact).astype(BF16)).astype(F32)).all()


@pytest.mark.parametrize(
  "opt",
  [fj.adamw(1e-3, weight_decay=0.1), fj.lion(1e-3), fj.rmsprop(1e-3)],
  ids=["adamw", "lion", "rmsprop"],
)
def test_float32_parameters_follow_the_optax_alias(opt, seed):
  """With the optax alias's storage, float32 parameters step as
  ``opt.to_optax()`` does to within an ulp (of the largest of the old
  value, the new value and the step), and the states are its bits."""
  tx, alias = fj.optax_with_storage(opt), opt.to_optax()
  params = _params(seed, F32)
  ours, theirs = tx.init(params), alias.init(params)
  step, alias_step = _stepper(tx), _stepper(alias)
  for key in jax.random.split(jax.random.key(seed + 1), 3):
    grads = _grads(params, key)
    new, ours = step(params, ours, grads)
    expected, theirs = alias_step(params, theirs, grads)
    for a, b, old in zip(*map(jax.tree.leaves, (new, expected, params))):
      old, b = np.asarray(old), np.asarray(b)
      largest = np.maximum(np.maximum(np.abs(old), np.abs(b)), np.abs(b - old))
      assert (np.abs(a - b) <= np.spacing(largest)).all()
    params = expected
  for path, param in jax.tree_util.tree_flatten_with_path(params)[0]:
    mine = _param_state(ours, path)
    for field in mine._fields:
      if getattr(mine, field) is not None:
        alias_leaf = _at(_optax_field(theirs, field), path)
        assert_bitwise_equal(
          getattr(mine, field).reshape(param.shape), alias_leaf, field
        )


def _optax_field(optax_state, field):
  """The tree under ``field`` of the optax state's NamedTuple that has it."""
  is_named = lambda x: hasattr(x, "_fields")
  for node in jax.tree.leaves(optax_state, is_leaf=is_named):
    if is_named(node) and field in node._fields:
      return getattr(node, field)
  raise KeyError(field)


def test_int8_states_take_half_of_bf16s_bytes_and_train_like_float32(seed):
  """An embedding-shaped parameter trained to a target: int8 states take
  under 0.55x the bytes of bfloat16 ones and reach float32 states' loss
  within 2 % (with 4-bit second moments: under 0.77x int8's bytes, within
  5 %); bfloat16 states end within 1 % of float32's parameters."""
  target = jax.random.normal(jax.random.key(seed), (256, 128))
  start = {"embed": jnp.zeros((256, 128))}
  loss_of = jax.jit(lambda p: jnp.sum((p["embed"] - target) ** 2))
  grad_of = jax.jit(jax.grad(loss_of))
  finals, sizes = {}, {}
  for dtype, state_dtype, bits in (
    ("float32", "float32", 8),
    ("bfloat16", "bfloat16", 8),
    ("int8", "int8", 8),
    ("int8-4bit", "int8", 4),
  ):
    opt = fj.adam(1e-2, state_dtype=state_dtype, second_moment_bits=bits)
    tx = fj.optax_with_storage(opt)
    params, state = start, tx.init(start)
    sizes[dtype] = Q.state_bytes(state.state)
    step = _stepper(tx)
    for _ in range(20):
      params, state = step(params, state, grad_of(params))
    finals[dtype] = params
  assert sizes["int8"] < 0.55 * sizes["bfloat16"]
  assert sizes["int8-4bit"] < 0.77 * sizes["int8"]
  assert isinstance(state.state.nu, Q.QuantizedSqrt4Blocks)
  losses = {dtype: float(loss_of(p)) for dtype, p in finals.items()}
  assert losses["float32"] < 0.8 * float(loss_of(start))
  assert losses["int8"] < 1.02 * losses["float32"], losses
  assert losses["int8-4bit"] < 1.05 * losses["float32"], losses
  f32, bf16 = finals["float32"]["embed"], finals["bfloat16"]["embed"]
  assert np.linalg.norm(bf16 - f32) < 0.01 * np.linalg.norm(f32)


def test_weight_decay_mask_prefix_and_callable(seed):
  """A mask (a prefix tree, or a callable) exempts its False parameters
  from weight decay: they step as with ``weight_decay=0``, bit for bit; the
  others do not."""
  params = _params(seed, BF16)
  grads = _grads(params, jax.random.key(seed + 1))
  mask = {"embed": True, "norm": False, "heads": True}
  results = {}
  for label, opt in {
    "prefix": fj.adamw(1e-2, weight_decay=0.5, mask=mask),
    "callable": fj.adamw(1e-2, weight_decay=0.5, mask=lambda p: mask),
    "undecayed": fj.adamw(1e-2, weight_decay=0.0),
    "decayed": fj.adamw(1e-2, weight_decay=0.5),
  }.items():
    tx = fj.optax_with_storage(opt)
    results[label], _ = _stepper(tx)(params, tx.init(params), grads)
  for label in ("prefix", "callable"):
    assert_same_bits(
      results[label]["norm"], results["undecayed"]["norm"], label
    )
    assert_same_bits(
      results[label]["embed"], results["decayed"]["embed"], label
    )
  assert not np.array_equal(
    results["decayed"]["embed"], results["undecayed"]["embed"]
  )


def test_non_finite_gradient_elements_keep_their_values(seed):
  """An element whose gradient is NaN or inf keeps its parameter (bf16
  states: and its state) bit for bit; the others step, and the count stays
  as a layer's does for a non-finite dY."""
  opt = fj.adam(1e-2, state_dtype="bfloat16")
  tx = fj.optax_with_storage(opt)
  params = {"w": jax.random.normal(jax.random.key(seed), (8, 64), BF16)}
  grads = {
    "w": jnp.ones((8, 64), BF16).at[1, 2].set(jnp.nan).at[3, 4].set(jnp.inf)
  }
  new, state = _stepper(tx)(params, tx.init(params), grads)
  changed = np.asarray(new["w"]) != np.asarray(params["w"])
  assert not changed[1, 2] and not changed[3, 4]
  assert changed.sum() == changed.size - 2
  assert float(state.state.mu["w"][1, 2]) == 0.0
  assert int(state.count) == 0
  # No finite element at all: everything stays.
  nan = {"w": jnp.full((8, 64), jnp.nan, BF16)}
  kept, after = _stepper(tx)(new, state, nan)
  assert_bitwise_equal(kept["w"], new["w"], "w")
  assert int(after.count) == 0
  finite = {"w": jnp.ones((8, 64), BF16)}
  assert int(_stepper(tx)(kept, after, finite)[1].count) == 1


def test_int8_states_skip_elements_whose_square_overflows(seed):
  """A finite gradient whose square overflows float32 would store a NaN
  block of int8 ``nu`` and turn the block's parameters NaN on the next
  step: the element is skipped instead, and the next step stays finite."""
  opt = fj.adam(1e-2, state_dtype="int8")
  tx = fj.optax_with_storage(opt)
  params = {"w": jax.random.normal(jax.random.key(seed), (8, 64))}
  step = _stepper(tx)
  spike = {"w": jnp.ones((8, 64)).at[1, 2].set(1e20)}
  new, state = step(params, tx.init(params), spike)
  changed = np.asarray(new["w"]) != np.asarray(params["w"])
  assert not changed[1, 2] and changed.sum() == changed.size - 1
  assert np.isfinite(np.asarray(state.state.nu.scale["w"])).all()
  new, state = step(new, state, {"w": jnp.ones((8, 64))})
  assert np.isfinite(np.asarray(new["w"])).all()


def test_update_needs_params():
  tx = fj.optax_with_storage(fj.adam(1e-3))
  params = {"w": jnp.ones((2, 64))}
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))
  with pytest.raises(TypeError):
    fj.optax_with_storage(optax.adam(1e-3))


@pytest.mark.parametrize(
  "opt", [fj.adamw(1e-2, state_dtype="bfloat16"), fj.sgd(1e-2)]
)
def test_a_model_of_forge_layers_alone_leaves_tx_nothing_to_train(opt, seed):
  """Bias-free FORGE layers leave ``tx`` an empty tree (a state with
  fields, or none): it starts, steps and counts, and the layers train."""
  model = fj.ForgeDense(64, optimizer=opt, param_dtype=BF16, use_bias=False)
  x = jax.random.normal(jax.random.key(seed), (8, 32))
  variables = model.init(jax.random.key(seed), x)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=fj.optax_with_storage(opt)
  )
  assert not jax.tree.leaves(state.opt_state.state)
  loss = lambda p: jnp.mean(state.apply_fn(p, x).astype(F32) ** 2)
  before = state.params["_overwrite_with_gradient"]["kernel"]
  state = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(loss)(s.params)))(
    state
  )
  assert int(state.opt_state.count) == 1
  layer = state.params["_overwrite_with_gradient"]
  assert float(layer["count"]) == 1.0
  assert not np.array_equal(np.asarray(layer["kernel"]), np.asarray(before))


class EmbedLM(nn.Module):
  optimizer: fj.ForgeOptimizer

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(64, 32, param_dtype=BF16, name="embed")(tokens)
    x = nn.gelu(
      fj.ForgeDense(64, optimizer=self.optimizer, param_dtype=BF16)(x)
    )
    return fj.ForgeDense(64, optimizer=self.optimizer, param_dtype=BF16)(x)


def test_train_state_trains_an_int8_embedding_and_checkpoints_it(
  tmp_path, seed
):
  """fj.TrainState takes ``optax_with_storage(opt)`` as the rule of ``opt``'s
  layers: the embedding's states are int8 blocks, the loss falls, a
  checkpoint restores every leaf bit for bit; another optimizer is refused."""
  opt = fj.adamw(
    3e-2, weight_decay=0.01, state_dtype="int8", weight_rounding="stochastic"
  )
  model = EmbedLM(opt)
  tokens = jax.random.randint(jax.random.key(seed), (4, 16), 0, 64)

  def new_state(tx):
    variables = model.init(jax.random.key(seed + 1), tokens)
    return fj.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)

  @jax.jit
  def train_step(state):
    def loss_fn(params):
      logits = state.apply_fn(params, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(F32), tokens[:, 1:]
      ).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  state = new_state(fj.optax_with_storage(opt))
  losses = []
  for _ in range(25):
    state, loss = train_step(state)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses
  embed_codes = state.opt_state.state.mu.codes["embed"]["embedding"]
  assert embed_codes.dtype == Q.CODES_CONTAINER

  path = checkpoint.save(str(tmp_path / "ckpt"), state)
  restored = checkpoint.restore(path, new_state(fj.optax_with_storage(opt)))
  for (key, a), b in zip(
    jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(state)
  ):
    assert_bitwise_equal(
      np.atleast_1d(a), np.atleast_1d(b), jax.tree_util.keystr(key)
    )

  other = new_state(fj.optax_with_storage(fj.lion(1e-3)))
  with pytest.raises(ValueError, match="not the optimizer"):
    train_step(other)


def test_a_nan_batch_leaves_the_layers_and_tx_one_count(seed):
  """A NaN batch skips every layer (non-finite dY) and leaves their
  ``count``; the embedding rows it does not touch have finite (zero)
  gradients, but ``tx``'s count stays too: one count for the whole model."""
  opt = fj.adamw(1e-2, weight_decay=0.1, state_dtype="int8")
  model = EmbedLM(opt)
  tokens = jax.random.randint(jax.random.key(seed), (2, 8), 0, 16)
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(seed + 1), tokens),
    tx=fj.optax_with_storage(opt),
  )

  @jax.jit
  def train_step(state, scale):
    loss = lambda v: scale * jnp.mean(state.apply_fn(v, tokens).astype(F32))
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  for scale in (1.0, jnp.nan, 1.0):
    state = train_step(state, scale)
  counts = {
    name: float(layer["count"])
    for name, layer in state.params[fj.FORGE_COLLECTION].items()
  }
  assert counts == {"ForgeDense_0": 2.0, "ForgeDense_1": 2.0}
  assert int(state.opt_state.count) == 2


def test_nnx_optimizer_trains_an_int8_embedding(seed):
  """fj.nnx.Optimizer steps an nnx.Embed with ``optax_with_storage(opt)``
  beside ``opt``'s fj.nnx.Linear, jitted, step after step (NNX updates the
  state field by field, as optax's)."""
  opt = fj.adamw(3e-2, state_dtype="int8", weight_rounding="stochastic")

  class EmbedLM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(64, 32, param_dtype=BF16, rngs=rngs)
      self.head = fj.nnx.Linear(
        32, 64, optimizer=opt, param_dtype=BF16, rngs=rngs
      )

    def __call__(self, tokens):
      return self.head(nnx.gelu(self.embed(tokens)))

  model = EmbedLM(nnx.Rngs(seed))
  optimizer = fj.nnx.Optimizer(model, fj.optax_with_storage(opt), wrt=nnx.Param)
  tokens = jax.random.randint(jax.random.key(seed), (4, 16), 0, 64)

  @nnx.jit
  def train_step(model, optimizer):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(
        model(tokens[:, :-1]).astype(F32), tokens[:, 1:]
      ).mean()

    loss, grads = fj.nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer)) for _ in range(25)]
  assert losses[-1] < 0.5 * losses[0], losses
  codes = nnx.as_pure(optimizer.opt_state).state.mu.codes["embed"]["embedding"]
  assert codes.dtype == Q.CODES_CONTAINER and codes.shape == (64, 32)
