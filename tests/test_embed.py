"""``fj.ForgeEmbed``: ``nn.Embed`` whose table FORGE steps in the backward.

* Same initialization and looked-up rows as ``nn.Embed`` (bit for bit, in
  float32 and bfloat16).
* Trained beside an ``nn.Dense`` head, it steps its table as ``nn.Embed`` +
  optax does (tokens unique within a step), clipped by the global norm as
  ``optax.clip_by_global_norm`` does, and each fused kernel as the XLA
  reference.
* With the fused kernel (GPU), the compiled train step holds no
  table-sized gradient.
* Non-integer tokens and ``attend`` (a tied head) raise, Linen and NNX.
* ``fj.nnx.Embed`` is ``nnx.Embed`` (initialization, lookups) and trains as
  ``nnx.Embed`` + optax under ``fj.nnx.Optimizer``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import forge_jax as fj
from forge_jax.ops import backends

from conftest import (
  assert_bitwise_equal,
  jaxpr_equations,
  train_step_temp_bytes,
)

OPT = fj.adamw(1e-2, weight_decay=0.1)


class TinyLM(nn.Module):
  vocab: int = 128
  width: int = 128
  forge: bool = True
  implementation: str = "xla"
  param_dtype: object = jnp.float32
  dtype: object = None
  outputs: int | None = None  # the head's width (default: vocab)

  @nn.compact
  def __call__(self, tokens):
    if self.forge:
      embed = fj.ForgeEmbed(
        self.vocab,
        self.width,
        optimizer=OPT,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        implementation=self.implementation,
        name="embed",
      )
    else:
      embed = nn.Embed(
        self.vocab,
        self.width,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        name="embed",
      )
    x = nn.gelu(embed(tokens))
    return nn.Dense(
      self.outputs or self.vocab, param_dtype=self.param_dtype, name="head"
    )(x)


def test_tokens_outside_the_table_index_as_nn_embed():
  """Negative tokens count from the end and tokens past the table look up
  NaN rows, as nn.Embed's jnp.take does."""
  tokens = jnp.asarray([[0, -1, 127, 128, -129, 5]])
  outputs = []
  for module in (
    fj.ForgeEmbed(128, 8, optimizer=OPT, name="embed"),
    nn.Embed(128, 8, name="embed"),
  ):
    variables = module.init(jax.random.key(0), tokens)
    outputs.append(np.asarray(module.apply(variables, tokens)))
  np.testing.assert_array_equal(outputs[0], outputs[1])
  assert np.isnan(outputs[0][0, 3]).all() and np.isnan(outputs[0][0, 4]).all()


@pytest.mark.parametrize("token_dtype", [jnp.uint8, jnp.int8, jnp.uint16])
def test_narrow_tokens_look_up_their_rows_in_a_larger_table(token_dtype):
  """Tokens of a dtype narrower than the table's range (uint8 bytes in a
  vocabulary padded past 256) look up the rows their values name, as in
  int32, Linen and NNX: the one-hot's range and the bounds do not wrap."""
  vocab = 300 if token_dtype != jnp.uint16 else 70000
  high = 127 if token_dtype == jnp.int8 else 255
  tokens = jnp.asarray([[0, 5, 100, high]], token_dtype)
  module = fj.ForgeEmbed(vocab, 4, optimizer=OPT)
  variables = module.init(jax.random.key(0), tokens)
  table = np.asarray(variables[fj.FORGE_COLLECTION]["kernel"])
  rows = np.asarray(module.apply(variables, tokens))
  np.testing.assert_array_equal(rows[0], table[[0, 5, 100, high]])
  layer = fj.nnx.Embed(vocab, 4, optimizer=OPT, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(
    np.asarray(layer(tokens))[0],
    np.asarray(layer(jnp.asarray(tokens, jnp.int32)))[0],
  )


def _table(variables, forge):
  if forge:
    return variables[fj.FORGE_COLLECTION]["embed"]["kernel"]
  return variables["params"]["embed"]["embedding"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_initialization_and_lookup_are_nn_embeds(dtype, seed):
  tokens = jax.random.randint(jax.random.key(seed), (3, 7), 0, 128)
  outputs, tables = [], []
  for forge in (True, False):
    model = TinyLM(forge=forge, param_dtype=dtype)
    variables = model.init(jax.random.key(seed + 1), tokens)
    tables.append(_table(variables, forge))
    outputs.append(model.apply(variables, tokens))
  assert_bitwise_equal(tables[0], tables[1], "table")
  assert_bitwise_equal(outputs[0], outputs[1], "logits")


def _train(
  forge,
  tokens,
  targets,
  implementation="xla",
  dtype=None,
  max_grad_norm=None,
  steps=3,
  tx=None,
):
  """``(state, losses)`` of ``steps`` steps (``tx``: OPT's optax alias
  where None); clipped by the global norm with
  ``fj.TrainState(max_grad_norm=...)`` (FORGE) or
  ``optax.clip_by_global_norm`` first in ``tx`` (nn.Embed)."""
  model = TinyLM(forge=forge, implementation=implementation, dtype=dtype)
  variables = model.init(jax.random.key(0), tokens)
  tx = tx or OPT.to_optax()
  if forge:
    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=tx,
      max_grad_norm=max_grad_norm,
    )
  else:
    if max_grad_norm is not None:
      tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
  clipped_forge = forge and max_grad_norm is not None

  @jax.jit
  def step(state):
    def loss_fn(params):
      logits = state.apply_fn(params, tokens)
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets
      ).mean()

    grad_fn = state.value_and_grad if clipped_forge else jax.value_and_grad
    loss, grads = grad_fn(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(steps):
    state, loss = step(state)
    losses.append(float(loss))
  return state, losses


def _assert_trained_alike(run, reference, reference_is_forge):
  """Losses and tables of two ``_train`` runs, the first FORGE's."""
  (state, losses), (expected_state, expected) = run, reference
  np.testing.assert_allclose(losses, expected, rtol=1e-5)
  np.testing.assert_allclose(
    _table(state.params, True),
    _table(expected_state.params, reference_is_forge),
    rtol=1e-5,
    atol=1e-7,
  )


def _unique_tokens(seed):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.permutation(128)[:64].reshape(2, 32))
  return tokens, jnp.asarray(rng.integers(0, 128, (2, 32)))


def test_trains_its_table_as_nn_embed_and_optax(seed):
  """Tokens unique within the step: each row's gradient is one output
  gradient, so the float32 table steps as nn.Embed + optax's (to the
  rounding of the rule's multiply-adds)."""
  tokens, targets = _unique_tokens(seed)
  run = _train(True, tokens, targets)
  _assert_trained_alike(run, _train(False, tokens, targets), False)
  assert float(run[0].params[fj.FORGE_COLLECTION]["embed"]["count"]) == 3


def test_clipped_training_matches_optax_clipping(seed):
  """fj.TrainState(max_grad_norm=...) clips the table's step by the global
  norm as optax.clip_by_global_norm does for nn.Embed (unique tokens)."""
  tokens, targets = _unique_tokens(seed)
  _assert_trained_alike(
    _train(True, tokens, targets, max_grad_norm=0.05),
    _train(False, tokens, targets, max_grad_norm=0.05),
    False,
  )


@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_kernels_step_the_table_as_the_reference(implementation, seed):
  """bfloat16 lookups (one-hot rows and output gradients in bfloat16, the
  fused kernels' inputs): each kernel steps the table as the XLA reference,
  from a zero state and then from the state it wrote."""
  tokens, targets = _unique_tokens(seed)
  _assert_trained_alike(
    _train(True, tokens, targets, implementation, jnp.bfloat16, steps=2),
    _train(True, tokens, targets, "xla", jnp.bfloat16, steps=2),
    True,
  )


def test_backward_forms_no_gradient_of_the_one_hot_rows():
  """The one-hot rows are not differentiated: the backward has no
  ``[tokens, vocab]`` product (a GEMM and a buffer for nothing), only the
  table's update."""
  model = TinyLM(vocab=96, width=16, outputs=8)
  tokens = jnp.arange(40, dtype=jnp.int32).reshape(2, 20)
  variables = model.init(jax.random.key(0), tokens)
  grad = jax.make_jaxpr(
    jax.grad(lambda v: jnp.sum(jnp.square(model.apply(v, tokens))))
  )(variables)
  products = [
    eqn.outvars[0].aval.shape
    for eqn in jaxpr_equations(grad.jaxpr)
    if eqn.primitive.name == "dot_general"
  ]
  assert (96, 16) in products, products  # the table's gradient (XLA)
  rows = [shape for shape in products if shape[-1] == 96]
  assert not any(np.prod(shape[:-1]) == 40 for shape in rows), products


@pytest.mark.gpu
def test_train_step_holds_no_table_sized_gradient():
  """A 131072 x 512 bfloat16 table (128 MiB) looked up by 64 tokens, a
  small head beside it: nn.Embed + optax's compiled step holds the table's
  gradient (temp >= the table), the fused kernel's no table-sized buffer
  (temp <= half the table: the one-hot rows and their mask). (The
  XLA reference forms the gradient: only a kernel saves it.)"""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs the Mosaic kernel (a Hopper or newer GPU)")
  vocab, width = 131072, 512
  tokens = jnp.zeros((1, 64), jnp.int32)
  temp = {
    forge: train_step_temp_bytes(
      TinyLM(
        vocab=vocab,
        width=width,
        forge=forge,
        implementation="mosaic",
        param_dtype=jnp.bfloat16,
        dtype=jnp.bfloat16,
        outputs=64,
      ),
      fj.TrainState.create if forge else TrainState.create,
      OPT.to_optax(),
      tokens,
    )
    for forge in (True, False)
  }
  table = vocab * width * 2
  assert temp[False] >= table and temp[True] <= table / 2, temp


def test_tokens_must_be_integers_and_attend_is_refused():
  model = fj.ForgeEmbed(8, 4, optimizer=OPT)
  with pytest.raises(TypeError, match="integer"):
    model.init(jax.random.key(0), jnp.zeros((2,), jnp.float32))
  variables = model.init(jax.random.key(0), jnp.zeros((2,), jnp.int32))
  with pytest.raises(NotImplementedError, match="tied"):
    model.apply(variables, jnp.ones((2, 4)), method=fj.ForgeEmbed.attend)
  table = fj.nnx.Embed(8, 4, optimizer=OPT, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="tied.*nnx.Embed"):
    table.attend(jnp.ones((2, 4)))


class NNXLM(nnx.Module):
  def __init__(self, forge: bool, rngs: nnx.Rngs):
    if forge:
      self.embed = fj.nnx.Embed(128, 128, optimizer=OPT, rngs=rngs)
    else:
      self.embed = nnx.Embed(128, 128, rngs=rngs)
    self.head = nnx.Linear(128, 128, rngs=rngs)

  def __call__(self, tokens):
    return self.head(nnx.gelu(self.embed(tokens)))


def test_nnx_embed_is_nnx_embed_and_trains_as_optax(seed):
  """fj.nnx.Embed: nnx.Embed's initialization and lookups (indexing
  included), and, trained by fj.nnx.Optimizer on unique tokens, nnx.Embed +
  optax's table."""
  probe = jnp.asarray([[0, -1, 127, 128, 5]])
  forge, plain = NNXLM(True, nnx.Rngs(seed)), NNXLM(False, nnx.Rngs(seed))
  np.testing.assert_array_equal(forge.embed(probe), plain.embed(probe))

  tokens, targets = _unique_tokens(seed)
  loss_fn = lambda model: optax.softmax_cross_entropy_with_integer_labels(
    model(tokens), targets
  ).mean()
  optimizers = (
    fj.nnx.Optimizer(forge, OPT.to_optax(), wrt=nnx.Param),
    nnx.Optimizer(plain, OPT.to_optax(), wrt=nnx.Param),
  )

  @nnx.jit
  def forge_step(model, optimizer):
    loss, grads = fj.nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def plain_step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  for _ in range(3):
    losses = (
      float(forge_step(forge, optimizers[0])),
      float(plain_step(plain, optimizers[1])),
    )
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
  np.testing.assert_allclose(
    forge.embed.kernel.get_value(),
    plain.embed.embedding.get_value(),
    rtol=1e-5,
    atol=1e-7,
  )


def test_a_decay_mask_that_leaves_out_the_table_is_refused():
  """The usual AdamW mask by leaf name, no decay on ``embedding`` leaves:
  FORGE would decay the table all the same, so the mask is asked about a
  leaf named as ``nn.Embed`` / ``nnx.Embed`` name it, and refused."""
  no_decay = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, _: getattr(path[-1], "key", None) != "embedding", params
  )
  opt = fj.adamw(1e-2, weight_decay=0.1, mask=no_decay)
  tokens = jnp.arange(6) % 5
  model = fj.ForgeEmbed(5, 4, optimizer=opt, implementation="xla")
  state = fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), tokens),
    tx=opt.to_optax(),
  )
  grads = jax.grad(lambda v: jnp.sum(model.apply(v, tokens) ** 2))(state.params)
  with pytest.raises(ValueError, match="leaves out the kernels"):
    state.apply_gradients(grads=grads)
  table = fj.nnx.Embed(5, 4, optimizer=opt, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="leaves out the kernels"):
    fj.nnx.Optimizer(table, opt.to_optax(), wrt=nnx.Param)


def test_a_tree_of_labels_or_mask_naming_the_table_says_why_it_cannot():
  """Labels or a weight-decay mask given as a pytree of nn.Embed's
  parameters name the table (``{'embed': ..., 'head': ...}``), which
  FORGE's tree of parameters lacks (the table is FORGE's, with no bias):
  refused in FORGE's words, naming it, not by optax's structure error.
  Left out of the tree, the same mask trains as nn.Embed + optax."""
  tokens, targets = _unique_tokens(0)
  decay = lambda mask: optax.adamw(1e-2, weight_decay=0.1, mask=mask)
  by_rate = lambda labels: optax.multi_transform(
    {"slow": optax.adamw(1e-3), "fast": OPT.to_optax()}, labels
  )
  refused = r"of the FORGE layers \['embed'\]"
  for tx, tree in (
    (decay, {"embed": True, "head": True}),
    (by_rate, {"embed": "slow", "head": "fast"}),
  ):
    with pytest.raises(ValueError, match=refused):
      _train(True, tokens, targets, steps=1, tx=tx(tree))
    with pytest.raises(ValueError, match=refused):
      fj.nnx.Optimizer(
        NNXLM(True, nnx.Rngs(0)), tx(nnx.State(tree)), wrt=nnx.Param
      )

  run = _train(True, tokens, targets, tx=decay({"head": True}))
  reference = _train(
    False, tokens, targets, tx=decay({"params": {"embed": True, "head": True}})
  )
  _assert_trained_alike(run, reference, False)
