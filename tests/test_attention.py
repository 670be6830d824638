"""``fj.MultiHeadDotProductAttention``: flax's attention, FORGE-trained.

* Its fields, variables (names and shapes) and outputs are flax's: cross
  and self attention, masks, dropout, ``normalize_qk``, sown weights, the
  decode cache.
* An lm1b-style Transformer (flax's examples/lm1b, written here small) with
  every ``nn.Dense`` -> ``fj.ForgeDense`` and its attention ->
  ``fj.MultiHeadDotProductAttention`` trains as the original with the optax
  alias, within 1e-6 in float32, dropout on; and decodes the same tokens'
  logits with the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax import lax

import forge_jax as fj

from conftest import COLL, assert_bitwise_equal, assert_rel_close, host_copy

OPT = fj.adamw(1e-2, weight_decay=0.1)


def test_fields_are_flax_s():
  """nn.MultiHeadDotProductAttention's fields, in order, with its defaults;
  then the keyword-only optimizer, the backend and the partitioning."""
  ours = [f for f in dataclasses.fields(fj.MultiHeadDotProductAttention)]
  theirs = [f for f in dataclasses.fields(nn.MultiHeadDotProductAttention)]
  own = [f.name for f in ours if f.name not in {g.name for g in theirs}]
  assert own == [
    "optimizer",
    "implementation",
    "input_partitioning",
    "mesh",
    "data_parallel",
  ]
  shared = [f for f in ours if f.name not in own]
  assert [f.name for f in shared] == [f.name for f in theirs]
  for a, b in zip(shared, theirs):
    assert a.default is b.default or a.default == b.default, a.name
  with pytest.raises(TypeError, match="optimizer"):
    fj.MultiHeadDotProductAttention(num_heads=2)


def _pair(**fields):
  return (
    nn.MultiHeadDotProductAttention(**fields),
    fj.MultiHeadDotProductAttention(
      **fields, optimizer=OPT, implementation="xla"
    ),
  )


CASES = {
  "self": (dict(num_heads=2), dict()),
  "cross-masked-dropout": (
    dict(
      num_heads=4,
      qkv_features=8,
      out_features=6,
      dropout_rate=0.3,
      broadcast_dropout=False,
      deterministic=False,
    ),
    dict(kv_length=7, mask=True),
  ),
  "normalize-qk-no-bias": (
    dict(num_heads=2, normalize_qk=True, use_bias=False),
    dict(sow_weights=True),
  ),
}


@pytest.mark.parametrize(
  "fields, call",
  [
    # Plain self attention by default: test_self_attention_is_flax_s.
    pytest.param(
      *case, id=name, marks=pytest.mark.slow if name == "self" else ()
    )
    for name, case in CASES.items()
  ],
)
def test_same_variables_and_outputs_as_flax(fields, call, seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (2, 5, 12))
  kv_length = call.get("kv_length")
  kv = () if kv_length is None else (jax.random.normal(keys[1], (2, 7, 12)),)
  kwargs = {}
  if call.get("mask"):
    kwargs["mask"] = jax.random.bernoulli(keys[2], 0.7, (2, 1, 5, 7))
  if call.get("sow_weights"):
    kwargs["sow_weights"] = True
  ref, forge = _pair(**fields)
  ref_vars = ref.init(keys[3], q, *kv, **kwargs)
  forge_vars = fj.from_dense(ref_vars, forge, q, *kv, **kwargs)
  heads = fields["num_heads"]
  head_dim = fields.get("qkv_features", 12) // heads
  for name in ("query", "key", "value"):
    assert forge_vars[COLL][name]["kernel"].shape == (12, heads, head_dim)
    assert forge_vars[COLL][name]["opt_state"].mu.shape == (
      12,
      heads * head_dim,
    )
  assert forge_vars[COLL]["out"]["kernel"].shape == (
    heads,
    head_dim,
    fields.get("out_features", 12),
  )
  assert set(forge_vars["params"]) == set(ref_vars["params"]) - (
    set() if fields.get("use_bias", True) else {"query", "key", "value", "out"}
  )
  rngs = {"dropout": jax.random.key(seed + 1)}
  ref_out, ref_sown = ref.apply(
    ref_vars, q, *kv, **kwargs, rngs=rngs, mutable=["intermediates"]
  )
  out, sown = forge.apply(
    forge_vars, q, *kv, **kwargs, rngs=rngs, mutable=["intermediates"]
  )
  assert_bitwise_equal(out, ref_out, "output")
  jax.tree.map(lambda a, b: assert_bitwise_equal(a, b, "sown"), sown, ref_sown)
  assert bool(sown) == bool(call.get("sow_weights"))


def test_self_attention_is_flax_s(seed):
  x = jax.random.normal(jax.random.key(seed), (2, 5, 8))
  ref = nn.SelfAttention(num_heads=2)
  forge = fj.SelfAttention(num_heads=2, optimizer=OPT, implementation="xla")
  with pytest.warns(DeprecationWarning):
    ref_vars = ref.init(jax.random.key(0), x)
  forge_vars = fj.from_dense(ref_vars, forge, x)
  mask = nn.make_causal_mask(x[..., 0])
  with pytest.warns(DeprecationWarning):
    expected = ref.apply(ref_vars, x, mask)
  assert_bitwise_equal(forge.apply(forge_vars, x, mask), expected, "output")


def test_square_inputs_v_warns_as_flax():
  """flax warns where inputs_v's last two dimensions are equal, as a mask
  passed positionally (the call before flax 0.7.4) would have them."""
  q = jax.random.normal(jax.random.key(0), (2, 4, 4))
  ref, forge = _pair(num_heads=2)
  ref_vars = ref.init(jax.random.key(1), q)
  forge_vars = fj.from_dense(ref_vars, forge, q)
  outputs = []
  for model, variables in ((ref, ref_vars), (forge, forge_vars)):
    with pytest.warns(DeprecationWarning, match="`mask` arg"):
      outputs.append(model.apply(variables, q, q, q))
  assert_bitwise_equal(outputs[1], outputs[0], "output")


@pytest.mark.parametrize(
  "field",
  [
    "qkv_dot_general",
    "out_dot_general",
    "qkv_dot_general_cls",
    "out_dot_general_cls",
  ],
)
def test_custom_dot_general_is_refused_by_its_name(field):
  """The refusal names the attention's field the user set, not the
  projection's."""
  product = lambda *a, **k: lax.dot_general(*a, **k)
  forge = fj.MultiHeadDotProductAttention(
    num_heads=2,
    **{field: (lambda: product) if field.endswith("_cls") else product},
    optimizer=OPT,
  )
  with pytest.raises(ValueError, match=f"custom {field} is not supported"):
    forge.init(jax.random.key(0), jnp.ones((1, 3, 4)))


def test_lax_dot_general_is_flax_s_default():
  """lax.dot_general is what flax computes without one: accepted."""
  x = jax.random.normal(jax.random.key(0), (1, 3, 4))
  fields = dict(
    num_heads=2,
    qkv_dot_general=lax.dot_general,
    out_dot_general=lax.dot_general,
  )
  ref, forge = _pair(**fields)
  ref_vars = ref.init(jax.random.key(1), x)
  forge_vars = fj.from_dense(ref_vars, forge, x)
  assert_bitwise_equal(
    forge.apply(forge_vars, x), ref.apply(ref_vars, x), "output"
  )


def test_kernel_init_sharding_head_dim_of_out_is_refused():
  """Without out_kernel_init the out kernel [heads, head_dim, features]
  takes kernel_init's names, which here shard its head_dim: the refusal
  says to give out_kernel_init; given, the variables are flax's."""
  x = jax.random.normal(jax.random.key(0), (1, 3, 8))
  init = nn.initializers.lecun_normal()
  heads = nn.with_partitioning(init, (None, "model", None))
  _, forge = _pair(num_heads=2, kernel_init=heads)
  with pytest.raises(ValueError, match="Give out_kernel_init"):
    forge.init(jax.random.key(0), x)
  ref, forge = _pair(
    num_heads=2,
    kernel_init=heads,
    out_kernel_init=nn.with_partitioning(init, ("model", None, None)),
  )
  ref_vars = ref.init(jax.random.key(1), x)
  forge_vars = fj.to_dense(forge.init(jax.random.key(1), x))
  chex.assert_trees_all_equal(nn.unbox(forge_vars), nn.unbox(ref_vars))


def test_trains_as_flax_s(seed):
  """One module: kernels and biases after 3 steps of cross attention as
  flax's with the optax alias. (SGD: the key bias's gradient is zero up to
  rounding, softmax being invariant to it, which Adam would scale up.)"""
  opt = fj.sgd(0.1, momentum=0.9)
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (2, 5, 8))
  kv = jax.random.normal(keys[1], (2, 3, 8))
  target = jax.random.normal(keys[2], (2, 5, 8))
  ref = nn.MultiHeadDotProductAttention(num_heads=2)
  forge = fj.MultiHeadDotProductAttention(
    num_heads=2, optimizer=opt, implementation="xla"
  )
  ref_vars = ref.init(jax.random.key(0), q, kv)
  forge_vars = fj.from_dense(ref_vars, forge, q, kv)

  def train(state_class, model, variables, tx):
    state = state_class.create(apply_fn=model.apply, params=variables, tx=tx)
    loss = lambda p: jnp.mean((model.apply(p, q, kv) - target) ** 2)
    step = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(loss)(s.params)))
    for _ in range(3):
      state = step(state)
    return host_copy(state.params)

  ours = fj.to_dense(train(fj.TrainState, forge, forge_vars, opt.to_optax()))
  theirs = train(TrainState, ref, ref_vars, optax.sgd(0.1, momentum=0.9))
  for (path, a), b in zip(
    jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree.leaves(theirs)
  ):
    name = jax.tree_util.keystr(path)
    if name == "['params']['key']['bias']":
      # Its gradient is rounding noise: both stay at the zeros they started
      # from, to the noise's size (whose bits depend on the matmuls' order).
      assert np.abs(a).max() <= 1e-6 and np.abs(b).max() <= 1e-6, name
      continue
    assert_rel_close(a, b, 1e-6, name)


# ---------------------------------------------------------------------------
# An lm1b-style decoder (flax's examples/lm1b/models.py, small).


@dataclasses.dataclass(frozen=True)
class LMConfig:
  vocab_size: int = 32
  emb_dim: int = 16
  num_heads: int = 2
  num_layers: int = 2
  qkv_dim: int = 16
  mlp_dim: int = 32
  max_len: int = 16
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = False
  decode: bool = False
  optimizer: Any = None  # None: flax's layers; else FORGE's


def _dense(config: LMConfig, features: int, **kwargs):
  if config.optimizer is None:
    return nn.Dense(features, **kwargs)
  return fj.ForgeDense(
    features, optimizer=config.optimizer, implementation="xla", **kwargs
  )


def _attention(config: LMConfig, **kwargs):
  if config.optimizer is None:
    return nn.MultiHeadDotProductAttention(**kwargs)
  return fj.MultiHeadDotProductAttention(
    optimizer=config.optimizer, implementation="xla", **kwargs
  )


KERNEL_INIT = nn.initializers.xavier_uniform()
BIAS_INIT = nn.initializers.normal(stddev=1e-6)


def sinusoidal_table(max_len: int, features: int) -> np.ndarray:
  position = np.arange(max_len)[:, None]
  scale = np.log(10_000.0) / (features // 2 - 1)
  div = np.exp(np.arange(features // 2) * -scale)
  table = np.concatenate(
    [np.sin(position * div), np.cos(position * div)], axis=-1
  )
  return jnp.asarray(table[None], jnp.float32)  # [1, max_len, features]


class AddPositionEmbs(nn.Module):
  config: LMConfig

  @nn.compact
  def __call__(self, inputs):
    c = self.config
    table = sinusoidal_table(c.max_len, inputs.shape[-1])
    if c.decode:
      initialized = self.has_variable("cache", "cache_index")
      index = self.variable(
        "cache", "cache_index", lambda: jnp.array(0, jnp.int32)
      )
      if initialized:
        i = index.value
        index.value = i + 1
        return inputs + lax.dynamic_slice(
          table, (0, i, 0), (1, 1, inputs.shape[-1])
        )
    return inputs + table[:, : inputs.shape[1]]


class MlpBlock(nn.Module):
  config: LMConfig

  @nn.compact
  def __call__(self, inputs):
    c = self.config
    init = dict(kernel_init=KERNEL_INIT, bias_init=BIAS_INIT)
    x = nn.relu(_dense(c, c.mlp_dim, **init)(inputs))
    x = nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic)
    x = _dense(c, inputs.shape[-1], **init)(x)
    return nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic)


class DecoderBlock(nn.Module):
  config: LMConfig

  @nn.compact
  def __call__(self, inputs, mask):
    c = self.config
    x = nn.LayerNorm()(inputs)
    x = _attention(
      c,
      num_heads=c.num_heads,
      qkv_features=c.qkv_dim,
      kernel_init=KERNEL_INIT,
      bias_init=BIAS_INIT,
      use_bias=False,
      broadcast_dropout=False,
      dropout_rate=c.attention_dropout_rate,
      deterministic=c.deterministic,
      decode=c.decode,
    )(x, mask=mask)
    x = nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic)
    x = x + inputs
    return x + MlpBlock(c)(nn.LayerNorm()(x))


class TransformerLM(nn.Module):
  config: LMConfig

  @nn.compact
  def __call__(self, inputs):
    c = self.config
    if c.decode:
      mask, y = None, inputs
    else:
      mask = nn.combine_masks(
        nn.make_attention_mask(inputs > 0, inputs > 0),
        nn.make_causal_mask(inputs),
      )
      y = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]  # shifted right
    y = nn.Embed(
      c.vocab_size,
      c.emb_dim,
      embedding_init=nn.initializers.normal(stddev=1.0),
    )(y.astype(jnp.int32))
    y = AddPositionEmbs(c)(y)
    y = nn.Dropout(c.dropout_rate)(y, deterministic=c.deterministic)
    for i in range(c.num_layers):
      y = DecoderBlock(c, name=f"encoderdecoderblock_{i}")(y, mask)
    y = nn.LayerNorm(name="encoderdecoder_norm")(y)
    return _dense(
      c,
      c.vocab_size,
      kernel_init=KERNEL_INIT,
      bias_init=BIAS_INIT,
      name="logitdense",
    )(y)


def _lm_loss(apply_fn, variables, tokens, rng):
  logits = apply_fn(variables, tokens, rngs={"dropout": rng})
  weights = (tokens > 0).astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
  return (losses * weights).sum() / weights.sum()


def _layer_paths(collection, path=()):
  """The module paths of the FORGE layers in FORGE's collection."""
  if "intact" in collection:
    return ["/".join(path)]
  return [
    name
    for key, value in collection.items()
    for name in _layer_paths(value, path + (key,))
  ]


def test_lm1b_transformer_trains_as_flax_s(seed):
  """Every nn.Dense -> fj.ForgeDense, attention -> fj.MultiHeadDotProduct-
  Attention: 4 steps with dropout train every parameter as the original
  with optax.adamw, within 1e-6 (float32); then both decode the same
  logits with their caches."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 32, (4, 2, 12))
  tokens[:, :, 9:] = 0  # padding
  tokens = jnp.asarray(tokens, jnp.int32)
  ref_model = TransformerLM(LMConfig())
  forge_model = TransformerLM(LMConfig(optimizer=OPT))
  init_rngs = {"params": jax.random.key(seed), "dropout": jax.random.key(1)}
  ref_vars = jax.jit(ref_model.init)(init_rngs, tokens[0])
  forge_vars = fj.from_dense(ref_vars, forge_model, tokens[0], rngs=init_rngs)
  forge_layers = _layer_paths(forge_vars[COLL])
  # 6 matmuls per block (query, key, value, out and the two of the MLP),
  # and the logits.
  assert len(forge_layers) == 6 * 2 + 1, sorted(forge_layers)

  def train(state_class, model, variables, tx):
    state = state_class.create(apply_fn=model.apply, params=variables, tx=tx)

    @jax.jit
    def step(state, batch, rng):
      grads = jax.grad(lambda p: _lm_loss(state.apply_fn, p, batch, rng))(
        state.params
      )
      return state.apply_gradients(grads=grads)

    history = []
    for i, batch in enumerate(tokens):
      state = step(state, batch, jax.random.key(100 + i))
      history.append(host_copy(state.params))
    return history

  ours = train(fj.TrainState, forge_model, forge_vars, OPT.to_optax())
  theirs = train(
    TrainState, ref_model, ref_vars, optax.adamw(1e-2, weight_decay=0.1)
  )
  for step, (forge, ref) in enumerate(zip(ours, theirs)):
    dense = fj.to_dense(forge)
    flat_ours = jax.tree_util.tree_flatten_with_path(dense)[0]
    flat_theirs = jax.tree_util.tree_flatten_with_path(ref)[0]
    assert [p for p, _ in flat_ours] == [p for p, _ in flat_theirs]
    for (path, a), (_, b) in zip(flat_ours, flat_theirs):
      assert_rel_close(
        a, b, 1e-6, f"step {step + 1} {jax.tree_util.keystr(path)}"
      )

  # Decoding with the trained weights: the caches fill alike.
  ref_decoder = TransformerLM(LMConfig(deterministic=True, decode=True))
  forge_decoder = TransformerLM(
    LMConfig(deterministic=True, decode=True, optimizer=OPT)
  )
  prompt = tokens[0][:, :1]
  ref_cache, forge_cache = (
    jax.eval_shape(model.init, jax.random.key(0), tokens[0])["cache"]
    for model in (ref_decoder, forge_decoder)
  )
  ref_cache, forge_cache = jax.tree.map(
    lambda c: jnp.zeros(c.shape, c.dtype), (ref_cache, forge_cache)
  )
  decode = jax.jit(
    lambda model, variables, cache, tokens: model.apply(
      {**variables, "cache": cache}, tokens, mutable=["cache"]
    ),
    static_argnums=0,
  )
  for t in range(4):
    ref_logits, ref_mut = decode(ref_decoder, theirs[-1], ref_cache, prompt)
    forge_logits, forge_mut = decode(
      forge_decoder, ours[-1], forge_cache, prompt
    )
    ref_cache, forge_cache = ref_mut["cache"], forge_mut["cache"]
    assert_rel_close(forge_logits, ref_logits, 1e-6, f"decode step {t}")
    prompt = jnp.argmax(ref_logits, -1).astype(jnp.int32)


class CachedBlock(nn.Module):
  """A causal self-attention block with a decode cache, for a scan."""

  decode: bool
  optimizer: Any = None

  @nn.compact
  def __call__(self, x):
    fields = dict(num_heads=2, decode=self.decode)
    if self.optimizer is None:
      attention = nn.MultiHeadDotProductAttention(**fields)
    else:
      attention = fj.MultiHeadDotProductAttention(
        **fields, optimizer=self.optimizer, implementation="xla"
      )
    mask = None if self.decode else nn.make_causal_mask(x[..., 0])
    return x + attention(x, mask=mask), None


def _cached_stack(decode, optimizer=None):
  scan = nn.scan if optimizer is None else fj.scan
  return scan(
    CachedBlock,
    variable_axes={True: 0},
    split_rngs={"params": True},
    length=1,
  )(decode, optimizer)


def test_decoding_a_scanned_stack_does_not_warn(seed):
  """fj.scan runs as nn.scan while the cache is mutable; decoding has no
  backward, so no memory warning, and its steps are flax's (nn.scan). A
  train step with a mutable collection still warns."""
  x = jax.random.normal(jax.random.key(seed), (1, 2, 4))
  ref, forge = _cached_stack(True), _cached_stack(True, OPT)
  ref_vars = ref.init(jax.random.key(1), x)
  forge_vars = fj.from_dense(ref_vars, forge, x)

  @functools.partial(jax.jit, static_argnums=0)
  def decode(model, variables, cache, x):
    (y, _), mutated = model.apply(
      {**variables, "cache": cache}, x, mutable=["cache"]
    )
    return y, mutated["cache"]

  ref_cache, forge_cache = ref_vars["cache"], forge_vars["cache"]
  with warnings.catch_warnings():
    warnings.simplefilter("error", fj.ForgeMemoryWarning)
    for t in range(x.shape[1]):
      step = x[:, t : t + 1]
      expected, ref_cache = decode(ref, ref_vars, ref_cache, step)
      out, forge_cache = decode(forge, forge_vars, forge_cache, step)
      assert_rel_close(out, expected, 1e-6, f"decode step {t}")

  train = _cached_stack(False, OPT)
  variables = train.init(jax.random.key(1), x)

  def loss(variables):
    (y, _), _ = train.apply(variables, x, mutable=["intermediates"])
    return jnp.sum(y**2)

  with pytest.warns(fj.ForgeMemoryWarning, match="runs as nn.scan"):
    jax.eval_shape(jax.grad(loss), variables)
