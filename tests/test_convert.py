"""``fj.from_dense`` / ``fj.to_dense``: pretrained weights in and out.

* The package's Llama (examples/lm/llama.py) built with nn.Dense loads into
  the FORGE Llama, unrolled and scanned, and gives the same logits.
* Round trips are bit for bit; the optimizer state is fresh, with the FORGE
  model's optimizer and dtypes.
* Auto-named layers (``Dense_0`` -> ``ForgeDense_0``, ``ScanBlock_0`` ->
  ``ForgeScanBlock_0``) map by name; mismatches raise and name the leaves.
* An ``nn.Embed`` table moves into a ``fj.ForgeEmbed`` and back out.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import forge_jax as fj
from examples.lm.llama import Llama, LlamaConfig

from conftest import COLL, assert_bitwise_equal, assert_same_bits

LLAMA = LlamaConfig(
  vocab_size=64,
  dim=16,
  num_layers=2,
  num_heads=2,
  num_kv_heads=1,
  head_dim=8,
  ffn_dim=32,
  max_len=32,
  implementation="xla",
)


@pytest.mark.parametrize(
  "scan_layers",
  # Unrolled layers by default: test_auto_names_round_trip_bit_for_bit.
  [pytest.param(False, marks=pytest.mark.slow), True],
  ids=["unrolled", "scan"],
)
def test_llama_from_nn_dense_gives_the_same_logits(scan_layers, seed):
  """The nn.Dense Llama's variables in the FORGE Llama: the same logits,
  bit for bit, and back out unchanged."""
  opt = fj.adamw(1e-3, weight_decay=0.1)
  dense_model = Llama(
    LlamaConfig(**{**vars(LLAMA), "scan_layers": scan_layers})
  )
  forge_model = Llama(
    LlamaConfig(
      **{**vars(LLAMA), "scan_layers": scan_layers, "forge_optimizer": opt}
    )
  )
  tokens = jax.random.randint(jax.random.key(seed), (2, 8), 0, 64)
  dense_vars = jax.jit(dense_model.init)(jax.random.key(seed), tokens)
  forge_vars = fj.from_dense(dense_vars, forge_model, tokens)
  q_proj = (
    forge_vars[COLL]["layers"]["attn"]["q_proj"]
    if scan_layers
    else forge_vars[COLL]["layers_1"]["attn"]["q_proj"]
  )
  layers = (LLAMA.num_layers,) if scan_layers else ()
  assert q_proj["kernel"].shape == layers + (16, 16)
  assert float(jnp.sum(q_proj["count"])) == 0.0
  assert not jax.tree.leaves(forge_vars["params"].get("lm_head", {}))
  apply = jax.jit(lambda model, v: model.apply(v, tokens), static_argnums=0)
  assert_bitwise_equal(
    apply(forge_model, forge_vars), apply(dense_model, dense_vars), "logits"
  )
  assert_same_bits(fj.to_dense(forge_vars), dense_vars, "round trip")


class Block(nn.Module):
  """Auto-named layers of every kind, for nn.scan or fj.scan."""

  optimizer: fj.ForgeOptimizer | None = None

  @nn.compact
  def __call__(self, x, _):
    forge = self.optimizer is not None
    kw = dict(optimizer=self.optimizer, implementation="xla") if forge else {}
    attention = (
      fj.MultiHeadDotProductAttention
      if forge
      else nn.MultiHeadDotProductAttention
    )
    x = x + attention(num_heads=2, **kw)(nn.LayerNorm()(x))
    h = (fj.ForgeDense if forge else nn.Dense)(12, **kw)(x)
    h = (fj.ForgeDenseGeneral if forge else nn.DenseGeneral)((2, 3), **kw)(h)
    dense_general = fj.ForgeDenseGeneral if forge else nn.DenseGeneral
    return x + dense_general(x.shape[-1], axis=(-2, -1), **kw)(h), None


class Model(nn.Module):
  optimizer: fj.ForgeOptimizer | None = None
  scan: bool = False

  @nn.compact
  def __call__(self, x):
    forge = self.optimizer is not None
    if self.scan:
      stack = (fj.scan if forge else nn.scan)(
        Block,
        variable_axes={True: 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=2,
      )
      x, _ = stack(self.optimizer)(x, None)
    else:
      for _ in range(2):
        x, _ = Block(self.optimizer)(x, None)
    dense = (
      fj.ForgeDense(4, optimizer=self.optimizer, use_bias=False)
      if forge
      else nn.Dense(4, use_bias=False)
    )
    return dense(x)


@pytest.mark.parametrize(
  "scan",
  # Stacks by default: test_llama_from_nn_dense_gives_the_same_logits.
  [False, pytest.param(True, marks=pytest.mark.slow)],
  ids=["unrolled", "scan"],
)
def test_auto_names_round_trip_bit_for_bit(scan, seed):
  opt = fj.lion(1e-3)
  x = jax.random.normal(jax.random.key(seed), (2, 3, 8))
  dense_model, forge_model = Model(scan=scan), Model(opt, scan=scan)
  dense_vars = jax.jit(dense_model.init)(jax.random.key(seed), x)
  forge_vars = fj.from_dense(dense_vars, forge_model, x)
  forge = forge_vars[COLL]
  block = forge["ForgeScanBlock_0"] if scan else forge["Block_1"]
  assert set(block) == {
    "MultiHeadDotProductAttention_0",
    "ForgeDense_0",
    "ForgeDenseGeneral_0",
    "ForgeDenseGeneral_1",
  }
  assert set(forge) >= {"ForgeDense_0"}
  assert_same_bits(fj.to_dense(forge_vars), dense_vars, "round trip")
  # And back in: the same FORGE weights, the state fresh.
  again = fj.from_dense(fj.to_dense(forge_vars), forge_model, x)
  assert_same_bits(again, forge_vars, "from_dense(to_dense(...))")
  apply = jax.jit(lambda model, v: model.apply(v, x), static_argnums=0)
  np.testing.assert_allclose(
    apply(forge_model, forge_vars), apply(dense_model, dense_vars), 1e-6
  )


def test_fresh_state_in_the_forge_model_s_dtypes():
  """The FORGE model's optimizer and dtypes: bf16 kernels (cast from the
  dense float32 ones), int8 states as init makes them."""
  opt = fj.adamw(1e-3, state_dtype="int8", weight_rounding="stochastic")
  x = jnp.ones((2, 8))
  dense_vars = jax.jit(nn.Dense(128).init)(jax.random.key(0), x)
  forge_model = fj.ForgeDense(128, optimizer=opt, param_dtype=jnp.bfloat16)
  forge_vars = fj.from_dense(dense_vars, forge_model, x)
  layer = forge_vars[COLL]
  assert layer["kernel"].dtype == jnp.bfloat16
  assert_bitwise_equal(
    layer["kernel"],
    dense_vars["params"]["kernel"].astype(jnp.bfloat16),
    "kernel",
  )
  assert_same_bits(
    layer["opt_state"],
    jax.jit(forge_model.init)(jax.random.key(1), x)[COLL]["opt_state"],
    "fresh state",
  )


def test_mismatches_name_the_leaves():
  x = jnp.ones((2, 3, 8))
  dense_vars = jax.jit(Model().init)(jax.random.key(0), x)
  with pytest.raises(ValueError, match="no dense leaf for .*Block_1"):
    fj.from_dense(
      {
        "params": {
          k: v for k, v in dense_vars["params"].items() if k != "Block_1"
        }
      },
      Model(fj.adam(1e-3)),
      x,
    )
  extra = {"params": {**dense_vars["params"], "Extra_0": {"w": jnp.ones(3)}}}
  with pytest.raises(ValueError, match="without a place: params/Extra_0/w"):
    fj.from_dense(extra, Model(fj.adam(1e-3)), x)
  wrong = jax.tree.map(lambda a: a, dense_vars)
  wrong["params"]["Dense_0"]["kernel"] = jnp.ones((8, 5))
  with pytest.raises(ValueError, match="shape.*name the layers"):
    fj.from_dense(wrong, Model(fj.adam(1e-3)), x)
  # The parameters alone, as many checkpoints hold them.
  with pytest.raises(ValueError, match="no 'params' collection"):
    fj.from_dense(dense_vars["params"], Model(fj.adam(1e-3)), x)
  # The flax TrainState the weights were trained in.
  state = TrainState.create(
    apply_fn=Model().apply, params=dense_vars["params"], tx=optax.sgd(0.1)
  )
  with pytest.raises(TypeError, match=r"not TrainState.*state\.params"):
    fj.from_dense(state, Model(fj.adam(1e-3)), x)


def test_a_model_without_forge_layers_warns():
  """The flax model passed as ``forge_model`` by mistake: its variables come
  back as they are, with a warning that nothing trains fused."""
  x = jnp.ones((2, 3, 8))
  dense_vars = jax.jit(Model().init)(jax.random.key(0), x)
  with pytest.warns(UserWarning, match="Model has no FORGE layers"):
    out = fj.from_dense(dense_vars, Model(), x)
  assert_same_bits(out, dense_vars, "variables")


def test_to_dense_refuses_two_layers_at_one_path():
  """An auto-named ForgeDense beside a flax Dense: ``ForgeDense_0`` takes
  flax's name ``Dense_0``, which the flax layer has. Refused, naming both,
  instead of one overwriting the other."""

  class Mixed(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = fj.ForgeDense(4, optimizer=fj.adam(1e-3))(x)
      return nn.Dense(2)(x)

  x = jnp.ones((2, 3))
  variables = Mixed().init(jax.random.key(0), x)
  with pytest.raises(
    ValueError,
    match=r"ForgeDense_0/kernel and params/Dense_0/kernel both become",
  ):
    fj.to_dense(variables)


def test_to_dense_names_what_it_cannot_take():
  """A TrainState instead of its variables, and an embeddings= path that
  is no FORGE layer (a typo would write the table as a kernel)."""
  model = fj.ForgeDense(4, optimizer=fj.adam(1e-3), name="head")
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=fj.adam(1e-3).to_optax()
  )
  with pytest.raises(TypeError, match=r"not TrainState.*\.params"):
    fj.to_dense(state)
  with pytest.raises(ValueError, match=r"\[\('embed',\)\].*not FORGE layers"):
    fj.to_dense(state.params, embeddings=[("embed",)])


def test_forge_embedding_moves_as_nn_embeds_table(seed):
  """The nn.Dense Llama's embedding in the FORGE Llama's fj.ForgeEmbed:
  the same logits, bit for bit; back out with ``embeddings=``, unchanged."""
  opt = fj.adamw(1e-3)
  config = {
    **vars(LLAMA),
    "vocab_size": 128,
    "dim": 128,
    "head_dim": 64,
    "scan_layers": True,
  }
  dense_model = Llama(LlamaConfig(**config))
  forge_model = Llama(
    LlamaConfig(**{**config, "forge_optimizer": opt, "forge_embedding": True})
  )
  tokens = jax.random.randint(jax.random.key(seed), (2, 8), 0, 128)
  dense_vars = jax.jit(dense_model.init)(jax.random.key(seed), tokens)
  forge_vars = fj.from_dense(dense_vars, forge_model, tokens)
  assert "embed" not in forge_vars["params"]
  assert_bitwise_equal(
    forge_vars[COLL]["embed"]["kernel"],
    dense_vars["params"]["embed"]["embedding"],
    "table",
  )
  apply = jax.jit(lambda model, v: model.apply(v, tokens), static_argnums=0)
  assert_bitwise_equal(
    apply(forge_model, forge_vars), apply(dense_model, dense_vars), "logits"
  )
  assert_same_bits(
    fj.to_dense(forge_vars, embeddings=[("embed",)]), dense_vars, "round trip"
  )


def test_auto_named_forge_embed_round_trips():
  """``ForgeEmbed_0`` stands for ``Embed_0``, its kernel for ``embedding``."""

  class Tiny(nn.Module):
    forge: bool

    @nn.compact
    def __call__(self, tokens):
      if self.forge:
        return fj.ForgeEmbed(16, 4, optimizer=fj.adam(1e-3))(tokens)
      return nn.Embed(16, 4)(tokens)

  tokens = jnp.arange(4)
  dense_vars = Tiny(False).init(jax.random.key(0), tokens)
  forge_vars = fj.from_dense(dense_vars, Tiny(True), tokens)
  assert set(forge_vars[COLL]) == {"ForgeEmbed_0"}
  assert_same_bits(fj.to_dense(forge_vars), dense_vars, "round trip")


@pytest.mark.parametrize(
  "embeddings",
  [[("embed",)], ["embed"], ("embed",), "embed"],
  ids=["paths", "names", "tuple-of-names", "name"],
)
def test_to_dense_takes_embedding_names_as_strings(embeddings):
  """A layer's name as a string (alone, or in a list or tuple) names the
  layer, not the tuple of its letters."""

  class Tiny(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = fj.ForgeEmbed(16, 4, optimizer=fj.adam(1e-3), name="embed")(tokens)
      return fj.ForgeDense(3, optimizer=fj.adam(1e-3))(x)

  variables = Tiny().init(jax.random.key(0), jnp.arange(4))
  dense = fj.to_dense(variables, embeddings=embeddings)
  assert set(dense["params"]["embed"]) == {"embedding"}
  assert_bitwise_equal(
    dense["params"]["embed"]["embedding"],
    variables[COLL]["embed"]["kernel"],
    "table",
  )


def test_a_decode_cache_missing_from_the_dense_variables_is_named():
  """A decode model's ``cache`` collection, absent from a checkpoint of
  parameters: named as a collection to pass, which then converts, and the
  cached steps give the full sequence's outputs."""
  opt = fj.adam(1e-3)
  x = jax.random.normal(jax.random.key(0), (2, 4, 8))
  dense = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
  forge = fj.MultiHeadDotProductAttention(
    num_heads=2, decode=True, optimizer=opt, implementation="xla"
  )
  dense_vars = dense.init(jax.random.key(1), x)
  with pytest.raises(ValueError, match=r"no 'cache' collection.*decode=False"):
    fj.from_dense({"params": dense_vars["params"]}, forge, x)
  forge_vars = fj.from_dense(dense_vars, forge, x)
  full = nn.MultiHeadDotProductAttention(num_heads=2).apply(
    {"params": dense_vars["params"]}, x, mask=nn.make_causal_mask(x[..., 0])
  )
  cache = forge_vars["cache"]
  for i in range(x.shape[1]):
    y, updated = forge.apply(
      {**forge_vars, "cache": cache}, x[:, i : i + 1], mutable=["cache"]
    )
    cache = updated["cache"]
    np.testing.assert_allclose(y[:, 0], full[:, i], rtol=1e-5, atol=1e-6)


def test_rename_may_return_a_list_both_ways():
  """A ``rename`` that returns a list of names (a comprehension) serves
  from_dense and to_dense alike."""

  class Head(nn.Module):
    forge: bool

    @nn.compact
    def __call__(self, x):
      if self.forge:
        return fj.ForgeDense(4, optimizer=fj.adam(1e-3), name="forge_proj")(x)
      return nn.Dense(4, name="proj")(x)

  rename = lambda path: [name.replace("forge_", "") for name in path]
  x = jnp.ones((2, 3))
  dense_vars = Head(False).init(jax.random.key(0), x)
  forge_vars = fj.from_dense(dense_vars, Head(True), x, rename=rename)
  assert set(forge_vars[COLL]) == {"forge_proj"}
  assert_same_bits(
    fj.to_dense(forge_vars, rename=rename), dense_vars, "round trip"
  )


@pytest.mark.filterwarnings("ignore::forge_jax.ForgeMemoryWarning")  # vmap's
def test_auto_names_under_lifted_transforms_map_to_flax_s(seed):
  """flax's lifted transforms prefix the class name: ``nn.vmap`` experts
  (``VmapForgeDense_0`` for ``VmapDense_0``) and ``nn.remat`` layers
  (``CheckpointForgeEmbed_0`` for ``CheckpointEmbed_0``) convert both ways,
  bit for bit, with the same outputs."""
  opt = fj.adam(1e-3)

  class Experts(nn.Module):
    forge: bool

    @nn.compact
    def __call__(self, tokens):
      kw = dict(optimizer=opt, implementation="xla") if self.forge else {}
      embed = fj.ForgeEmbed if self.forge else nn.Embed
      x = nn.remat(embed)(16, 6, **kw)(tokens)
      dense = fj.ForgeDense if self.forge else nn.Dense
      vmapped = nn.vmap(
        dense,
        variable_axes={True: 0},
        split_rngs={"params": True},
        in_axes=0,
      )
      return vmapped(5, **kw)(x)

  tokens = jax.random.randint(jax.random.key(seed), (3, 4), 0, 16)
  dense_vars = Experts(False).init(jax.random.key(seed), tokens)
  forge_vars = fj.from_dense(dense_vars, Experts(True), tokens)
  assert set(forge_vars[COLL]) == {"CheckpointForgeEmbed_0", "VmapForgeDense_0"}
  assert forge_vars[COLL]["VmapForgeDense_0"]["kernel"].shape == (3, 6, 5)
  assert_same_bits(fj.to_dense(forge_vars), dense_vars, "round trip")
  np.testing.assert_allclose(
    Experts(True).apply(forge_vars, tokens),
    Experts(False).apply(dense_vars, tokens),
    rtol=1e-6,
  )
