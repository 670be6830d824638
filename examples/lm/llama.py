"""A compact Llama / Qwen3-style decoder whose projections can be ForgeDense.

Every projection (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj`` and the untied ``lm_head``) is a
:class:`forge_jax.ForgeDense` when ``config.forge_optimizer`` is set, and a
``flax.linen.Dense`` otherwise. Both variants have the same module paths, and
ForgeDense initializes its kernel exactly as ``nn.Dense`` of the same name, so
``model.init(key, tokens)`` gives the same weights for the same key; only the
collection differs (``params`` for nn.Dense, ``_overwrite_with_gradient`` for
ForgeDense). Embedding and RMSNorm scales are ordinary ``params`` trained by
optax in both variants.

Layers are unrolled (``layers_0``, ``layers_1``, ...) by default, or stacked
with ``nn.scan`` (one ``layers`` module whose variables, in every collection,
carry a leading ``num_layers`` axis) when ``config.scan_layers`` is set.
:func:`stack_layers` / :func:`unstack_layers` convert between the layouts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from forge_jax.linen import FORGE_COLLECTION, ForgeDense, ForgeEmbed
from forge_jax.optimizers import ForgeOptimizer
from forge_jax.scan import scan as forge_scan

#: ``LlamaConfig.remat_policy`` names -> ``jax.checkpoint_policies``.
REMAT_POLICIES = {
  name: getattr(jax.checkpoint_policies, name)
  for name in (
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
  )
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyper-parameters of the decoder (hashable).

  Attributes:
    vocab_size, dim, num_layers, num_heads, num_kv_heads, head_dim, ffn_dim:
      the usual shapes (``num_heads`` must be a multiple of ``num_kv_heads``).
    rope_theta: RoPE base.
    rope_scaling: ``None``, or Llama 3.1's frequency scaling as
      ``(factor, low_freq_factor, high_freq_factor, original_max_len)``.
    norm_eps: RMSNorm epsilon.
    qk_norm: Qwen3's per-head RMSNorm on queries and keys (before RoPE).
    dtype: the compute dtype (activations, matmul inputs).
    param_dtype: the storage dtype of the weights.
    max_len: the longest sequence the model accepts.
    remat: rematerialize each block in the backward pass (FORGE's scan,
      used when both scan_layers and forge_optimizer are set, always does).
    remat_policy: None (recompute everything), or the name of a
      ``jax.checkpoint_policies`` policy in :data:`REMAT_POLICIES` (e.g.
      'dots_with_no_batch_dims_saveable'): what each rematerialized block
      saves instead of recomputing. Needs ``remat`` (a name, so the config
      stays hashable and serializable).
    scan_layers: stack the layers with ``nn.scan`` instead of a Python loop.
    forge_optimizer: a forge_jax optimizer (``fj.adamw(...)``); when set, every
      projection is a ForgeDense trained by it, else an nn.Dense.
    forge_embedding: with ``forge_optimizer``, the embedding is a
      ``fj.ForgeEmbed`` trained by it too (no table-sized gradient), else
      an ``nn.Embed`` trained by the optax transformation.
    implementation: ForgeDense's backend: 'auto', 'xla', 'triton' or 'mosaic'.
    attention_implementation: ``jax.nn.dot_product_attention``'s
      ``implementation``: None (XLA; the [T, T] scores are materialized) or
      'cudnn' (fused flash attention on NVIDIA GPUs).
    tensor_axis: mesh axis for Megatron-style tensor parallelism, or None (no
      partitioning annotations). q/k/v/gate/up and lm_head (on the vocab)
      are column-parallel, o/down row-parallel; attention heads are split
      over the axis (``num_kv_heads`` must be a multiple of its size).
    batch_axis: mesh axis the batch is sharded over, or None. For FORGE an
      axis of size > 1 over replicated kernels is refused unless
      ``forge_data_parallel='psum'`` (see :mod:`forge_jax.parallel`).
    sequence_parallel: shard the sequence over ``tensor_axis`` outside the
      tensor-parallel regions (norms, residual stream).
    mesh: the device mesh; None: the one set with ``jax.set_mesh``.
    forge_data_parallel: ForgeDense's ``data_parallel`` ('error', 'auto' or
      'psum'). FSDP ('auto') also needs the kernels sharded over
      ``batch_axis``, which :meth:`axis_rules` does not do.

  With ``tensor_axis`` set, every kernel carries logical partitioning
  metadata (``nn.with_logical_partitioning``) resolved by
  :meth:`axis_rules`; see :func:`forge_jax.parallel.shard_variables`.
  """

  vocab_size: int = 256
  dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  ffn_dim: int = 176
  rope_theta: float = 10_000.0
  rope_scaling: Optional[tuple] = None
  norm_eps: float = 1e-5
  qk_norm: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  max_len: int = 2048
  remat: bool = False
  remat_policy: Optional[str] = None
  scan_layers: bool = False
  forge_optimizer: Optional[ForgeOptimizer] = None
  forge_embedding: bool = False
  implementation: str = "auto"
  attention_implementation: Optional[str] = None
  tensor_axis: Optional[str] = None
  batch_axis: Optional[str] = None
  sequence_parallel: bool = False
  mesh: Optional[Any] = None
  forge_data_parallel: str = "error"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of "
        f"num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.forge_optimizer is not None and not isinstance(
      self.forge_optimizer, ForgeOptimizer
    ):
      raise TypeError(
        f"forge_optimizer={self.forge_optimizer!r} must be a "
        "forge_jax optimizer (fj.adamw(...), ...)"
      )
    if self.sequence_parallel and self.tensor_axis is None:
      raise ValueError("sequence_parallel=True needs a tensor_axis")
    if (
      self.remat_policy is not None and self.remat_policy not in REMAT_POLICIES
    ):
      raise ValueError(
        f"remat_policy={self.remat_policy!r} must be None or "
        f"one of {sorted(REMAT_POLICIES)}"
      )
    if self.remat_policy is not None and not self.remat:
      raise ValueError(f"remat_policy={self.remat_policy!r} needs remat=True")

  @property
  def checkpoint_policy(self):
    """The ``jax.checkpoint_policies`` function named by ``remat_policy``."""
    return (
      None if self.remat_policy is None else REMAT_POLICIES[self.remat_policy]
    )

  @property
  def partitioned(self) -> bool:
    return self.tensor_axis is not None or self.batch_axis is not None

  def axis_rules(self) -> tuple:
    """Logical axis name -> mesh axis (Megatron-style TP, optional SP).

    ``act_seq`` is the sequence outside the tensor-parallel regions (sharded
    on the tensor axis under sequence parallelism), ``seq`` inside them.
    """
    tp = self.tensor_axis
    return (
      ("batch", self.batch_axis),
      ("act_seq", tp if self.sequence_parallel else None),
      ("heads", tp),
      ("kv_heads", tp),
      ("mlp", tp),
      ("vocab", tp),
      ("seq", None),
      ("embed", None),
      ("head_dim", None),
      ("layers", None),
    )

  def num_params(self) -> int:
    """Trainable parameters (kernels, embedding, norm scales)."""
    d, h, kv, hd, f = (
      self.dim,
      self.num_heads,
      self.num_kv_heads,
      self.head_dim,
      self.ffn_dim,
    )
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d
    block = attn + 3 * d * f + 2 * d + (2 * hd if self.qk_norm else 0)
    return self.num_layers * block + 2 * self.vocab_size * d + d


CONFIGS: dict[str, LlamaConfig] = {
  # Tests: ~15K parameters (byte vocabulary).
  "tiny": LlamaConfig(
    vocab_size=256,
    dim=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    ffn_dim=48,
    max_len=256,
  ),
  # CPU demo: ~1.0M parameters.
  "small": LlamaConfig(
    vocab_size=256,
    dim=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    ffn_dim=512,
    max_len=1024,
  ),
  # GPU demo: ~130M parameters, bf16 compute.
  "medium": LlamaConfig(
    vocab_size=256,
    dim=1024,
    num_layers=12,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    ffn_dim=2816,
    max_len=2048,
    dtype=jnp.bfloat16,
  ),
  "llama-3.1-8b": LlamaConfig(
    vocab_size=128256,
    dim=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_dim=14336,
    rope_theta=500_000.0,
    rope_scaling=(8.0, 1.0, 4.0, 8192),
    norm_eps=1e-5,
    max_len=131072,
    dtype=jnp.bfloat16,
    remat=True,
    scan_layers=True,
  ),
  "qwen3-14b": LlamaConfig(
    vocab_size=151936,
    dim=5120,
    num_layers=40,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    ffn_dim=17408,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    qk_norm=True,
    max_len=40960,
    dtype=jnp.bfloat16,
    remat=True,
    scan_layers=True,
  ),
}

#: Names of the projections; the ones FORGE trains when forge_optimizer is set.
PROJECTIONS = (
  "q_proj",
  "k_proj",
  "v_proj",
  "o_proj",
  "gate_proj",
  "up_proj",
  "down_proj",
  "lm_head",
)


#: Logical names of each projection: (kernel, input, output). Column-parallel
#: layers read the (possibly sequence-sharded) residual stream and write
#: head/feature-sharded activations; row-parallel ones the reverse.
_COLUMN_IN = ("batch", "act_seq", "embed")
_ROW_OUT = ("batch", "act_seq", "embed")
_PARTITIONING = {
  "q_proj": (("embed", "heads"), _COLUMN_IN, ("batch", "seq", "heads")),
  "k_proj": (("embed", "kv_heads"), _COLUMN_IN, ("batch", "seq", "kv_heads")),
  "v_proj": (("embed", "kv_heads"), _COLUMN_IN, ("batch", "seq", "kv_heads")),
  "o_proj": (("heads", "embed"), ("batch", "seq", "heads"), _ROW_OUT),
  "gate_proj": (("embed", "mlp"), _COLUMN_IN, ("batch", "seq", "mlp")),
  "up_proj": (("embed", "mlp"), _COLUMN_IN, ("batch", "seq", "mlp")),
  "down_proj": (("mlp", "embed"), ("batch", "seq", "mlp"), _ROW_OUT),
  "lm_head": (("embed", "vocab"), _COLUMN_IN, ("batch", "seq", "vocab")),
}


def _dense(config: LlamaConfig, features: int, name: str) -> nn.Module:
  kernel_init = nn.initializers.lecun_normal()
  extra = {}
  if config.partitioned:
    kernel_axes, in_axes, out_axes = _PARTITIONING[name]
    kernel_init = nn.with_logical_partitioning(
      kernel_init, kernel_axes, mesh=config.mesh, rules=config.axis_rules()
    )
    extra = dict(
      input_partitioning=in_axes,
      output_partitioning=out_axes,
      mesh=config.mesh,
      data_parallel=config.forge_data_parallel,
    )
  if config.forge_optimizer is not None:
    return ForgeDense(
      features,
      optimizer=config.forge_optimizer,
      use_bias=False,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      implementation=config.implementation,
      name=name,
      kernel_init=kernel_init,
      **extra,
    )
  return nn.Dense(
    features,
    use_bias=False,
    dtype=config.dtype,
    param_dtype=config.param_dtype,
    name=name,
    kernel_init=kernel_init,
  )


def _constrain(config: LlamaConfig, x, *names):
  """Shard an activation by logical names (no-op unless partitioned)."""
  if not config.partitioned:
    return x
  return nn.with_logical_constraint(
    x, names, rules=config.axis_rules(), mesh=config.mesh
  )


def _check_heads(config: LlamaConfig):
  if config.tensor_axis is None:
    return
  mesh = (
    config.mesh if config.mesh is not None else jax.sharding.get_abstract_mesh()
  )
  if mesh.empty or config.tensor_axis not in mesh.axis_names:
    return
  tp = dict(zip(mesh.axis_names, mesh.axis_sizes))[config.tensor_axis]
  for what, n in (
    ("num_kv_heads", config.num_kv_heads),
    ("ffn_dim", config.ffn_dim),
    ("vocab_size", config.vocab_size),
  ):
    if n % tp:
      raise ValueError(
        f"{what}={n} must be a multiple of the tensor-parallel size {tp} "
        f"(mesh axis {config.tensor_axis!r}); replicating KV heads is not "
        "implemented"
      )


class RMSNorm(nn.Module):
  """``x / rms(x) * scale`` over the last axis, computed in float32."""

  eps: float = 1e-5
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      "scale", nn.initializers.ones_init(), (x.shape[-1],), self.param_dtype
    )
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(
      jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps
    )
    return (x32 * scale.astype(jnp.float32)).astype(self.dtype)


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
  """Inverse frequencies ``[head_dim // 2]`` (float64, host-side constants)."""
  d = config.head_dim
  inv_freq = 1.0 / (
    config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  )
  if config.rope_scaling is not None:  # Llama 3.1 ("llama3" rope_type)
    factor, low, high, old_len = config.rope_scaling
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq


def rope_tables(config: LlamaConfig, seq_len: int):
  """``cos, sin`` of shape ``[seq_len, head_dim]`` (float32)."""
  if seq_len > config.max_len:
    raise ValueError(
      f"sequence length {seq_len} exceeds max_len={config.max_len}"
    )
  freqs = np.outer(
    np.arange(seq_len, dtype=np.float64), rope_frequencies(config)
  )
  emb = np.concatenate([freqs, freqs], axis=-1)
  return jnp.asarray(np.cos(emb), jnp.float32), jnp.asarray(
    np.sin(emb), jnp.float32
  )


def apply_rope(x, cos, sin):
  """Rotate ``x [B, T, H, D]`` (Hugging Face's rotate-half convention)."""
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]
  return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Module):
  """Causal grouped-query attention with RoPE (and optional q/k RMSNorm)."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x, cos, sin):
    c = self.config
    b, t, _ = x.shape
    q = _dense(c, c.num_heads * c.head_dim, "q_proj")(x)
    k = _dense(c, c.num_kv_heads * c.head_dim, "k_proj")(x)
    v = _dense(c, c.num_kv_heads * c.head_dim, "v_proj")(x)
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    q = _constrain(c, q, "batch", "seq", "heads", "head_dim")
    k = _constrain(c, k, "batch", "seq", "kv_heads", "head_dim")
    v = _constrain(c, v, "batch", "seq", "kv_heads", "head_dim")
    if c.qk_norm:
      q = RMSNorm(c.norm_eps, c.dtype, c.param_dtype, name="q_norm")(q)
      k = RMSNorm(c.norm_eps, c.dtype, c.param_dtype, name="k_norm")(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # GQA: jax.nn.dot_product_attention shares each K/V head among
    # num_heads // num_kv_heads query heads; softmax is in float32.
    out = jax.nn.dot_product_attention(
      q,
      k,
      v.astype(q.dtype),
      is_causal=True,
      implementation=c.attention_implementation,
    )
    out = _constrain(c, out, "batch", "seq", "heads", "head_dim")
    out = out.reshape(b, t, c.num_heads * c.head_dim)
    out = _constrain(c, out, "batch", "seq", "heads")
    return _dense(c, c.dim, "o_proj")(out)


class MLP(nn.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    gate = _dense(c, c.ffn_dim, "gate_proj")(x)
    up = _dense(c, c.ffn_dim, "up_proj")(x)
    hidden = _constrain(c, nn.silu(gate) * up, "batch", "seq", "mlp")
    return _dense(c, c.dim, "down_proj")(hidden)


class Block(nn.Module):
  """Pre-norm decoder block. Returns ``(x, None)`` so nn.scan can stack it."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x, cos, sin):
    c = self.config
    norm = lambda name: RMSNorm(c.norm_eps, c.dtype, c.param_dtype, name=name)
    x = x + Attention(c, name="attn")(norm("attn_norm")(x), cos, sin)
    x = _constrain(c, x, *_ROW_OUT)
    x = x + MLP(c, name="mlp")(norm("mlp_norm")(x))
    x = _constrain(c, x, *_ROW_OUT)
    return x, None


class Llama(nn.Module):
  """Decoder-only LM: ``tokens [B, T] int -> logits [B, T, vocab] float32``."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    embed_fields = dict(
      dtype=c.dtype,
      param_dtype=c.param_dtype,
      embedding_init=nn.initializers.normal(stddev=0.02),
      name="embed",
    )
    if c.forge_optimizer is not None and c.forge_embedding:
      embed = ForgeEmbed(
        c.vocab_size,
        c.dim,
        optimizer=c.forge_optimizer,
        implementation=c.implementation,
        **embed_fields,
      )
    else:
      embed = nn.Embed(c.vocab_size, c.dim, **embed_fields)
    x = embed(tokens)
    _check_heads(c)
    x = _constrain(c, x, *_ROW_OUT)
    cos, sin = rope_tables(c, tokens.shape[-1])
    block = (
      nn.remat(Block, prevent_cse=not c.scan_layers, policy=c.checkpoint_policy)
      if c.remat
      else Block
    )
    if c.scan_layers:
      # variable_axes={True: 0}: every collection (params and FORGE's
      # _overwrite_with_gradient) is stacked along a leading layer axis.
      # FORGE's scan walks the layers in reverse in the backward, recomputes
      # each one and updates the stacked kernels and states in place.
      if c.forge_optimizer is not None:
        scan = forge_scan
        block = nn.remat(Block, prevent_cse=False, policy=c.checkpoint_policy)
      else:
        scan = nn.scan
      stack = scan(
        block,
        variable_axes={True: 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast),
        length=c.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = stack(c, name="layers")(x, cos, sin)
    else:
      for i in range(c.num_layers):
        x, _ = block(c, name=f"layers_{i}")(x, cos, sin)
    x = RMSNorm(c.norm_eps, c.dtype, c.param_dtype, name="norm")(x)
    logits = _dense(c, c.vocab_size, "lm_head")(x)
    logits = _constrain(c, logits, "batch", "seq", "vocab")
    return logits.astype(jnp.float32)


def make_model(
  config: LlamaConfig | str,
  forge_optimizer: Optional[ForgeOptimizer] = None,
  **overrides,
) -> Llama:
  """``Llama`` for a config (or the name of one in ``CONFIGS``).

  ``forge_optimizer`` (or ``overrides``) replace the config's fields, e.g.
  ``make_model('small', fj.adamw(3e-4), scan_layers=True)``.
  """
  if isinstance(config, str):
    config = CONFIGS[config]
  if forge_optimizer is not None:
    overrides["forge_optimizer"] = forge_optimizer
  return Llama(dataclasses.replace(config, **overrides))


# ---------------------------------------------------------------------------
# Variable layout helpers.


def _layer_names(tree) -> list[str]:
  names = [k for k in tree if k.startswith("layers_") and k[7:].isdigit()]
  return sorted(names, key=lambda k: int(k[7:]))


def stack_layers(variables):
  """Unrolled variables (``layers_0``, ...) -> the ``nn.scan`` layout (``layers``).

  Applies to every collection; leaves are stacked along a new axis 0.
  """
  out = {}
  for collection, tree in variables.items():
    tree = dict(tree)
    names = _layer_names(tree)
    if names:
      layers = [tree.pop(n) for n in names]
      tree["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    out[collection] = tree
  return out


def unstack_layers(variables):
  """The ``nn.scan`` layout -> unrolled variables; inverse of :func:`stack_layers`."""
  out = {}
  for collection, tree in variables.items():
    tree = dict(tree)
    if "layers" in tree:
      stacked = tree.pop("layers")
      n = jax.tree.leaves(stacked)[0].shape[0]
      for i in range(n):
        tree[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    out[collection] = tree
  return out


def kernels(variables) -> dict[str, jax.Array]:
  """Every projection kernel by module path, whichever collection holds it.

  ``'layers_0/attn/q_proj' -> kernel`` for both variants, so FORGE and the
  nn.Dense baseline can be compared leaf by leaf.
  """
  out = {}
  for collection in ("params", FORGE_COLLECTION):
    flat = jax.tree_util.tree_flatten_with_path(variables.get(collection, {}))[
      0
    ]
    for path, leaf in flat:
      keys = [str(getattr(k, "key", k)) for k in path]
      if keys[-1] == "kernel":
        out["/".join(keys[:-1])] = leaf
  return out
