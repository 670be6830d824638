"""Flax's multi-head attention with its projections trained by FORGE.

:class:`MultiHeadDotProductAttention` is ``nn.MultiHeadDotProductAttention``
(its fields, call signature, decode cache and dropout) whose ``query``,
``key``, ``value`` and ``out`` projections are
:class:`forge_jax.ForgeDenseGeneral` layers. The variables have flax's names
and shapes; each kernel sits in the ``_overwrite_with_gradient`` collection
instead of ``params`` (``fj.from_dense`` / ``fj.to_dense`` move them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from forge_jax.linen import (
  DEFAULT_DOT_GENERAL,
  ForgeDenseGeneral,
  check_products,
  partition_resolver,
)
from forge_jax.optimizers import ForgeOptimizer


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """``nn.MultiHeadDotProductAttention`` whose four projections are FORGE's.

  Every field of ``nn.MultiHeadDotProductAttention`` (same order, same
  defaults), plus the keyword-only ``optimizer`` that trains the ``query``,
  ``key``, ``value`` and ``out`` kernels in their backward pass, and
  ``implementation`` (the fused op's backend, as for
  :class:`forge_jax.ForgeDense`). Called as flax's, with the same
  variables: ``params/<module>/{query,key,value,out}/bias`` (and the
  ``query_ln`` / ``key_ln`` scales with ``normalize_qk``), the kernels at
  ``_overwrite_with_gradient/<module>/{query,key,value,out}/kernel`` with
  their optimizer state, and the decode ``cache``.

  For tensor parallelism give ``kernel_init`` (``[features, heads,
  head_dim]``) and ``out_kernel_init`` (``[heads, head_dim, features]``)
  partitioning on the heads, e.g. ``nn.with_partitioning(init, (None,
  'model', None))`` and ``(('model', None, None))``. For FSDP (and sequence
  parallelism) shard the features over the data axis too, ``('data',
  'model', None)`` and ``('model', None, 'data')``, and give
  ``input_partitioning``, the names of the inputs' dimensions (``[batch...,
  length, features]``, e.g. ``('data', None, None)``, or ``('data',
  'model', None)`` with the sequence sharded): the ``query``, ``key`` and
  ``value`` projections read the inputs so, the attention sees whole
  sequences with the heads sharded as their kernels say, and ``out``
  writes its output as the inputs came. A custom ``qkv_dot_general`` or
  ``out_dot_general`` (or their ``_cls``) is refused.

  Attributes:
    input_partitioning: None, or the names of the inputs' dimensions (mesh
      axes or logical names), as for :class:`forge_jax.ForgeDense`.
    mesh, data_parallel: as for :class:`forge_jax.ForgeDense`, for the four
      projections.
  """

  optimizer: ForgeOptimizer = dataclasses.field(kw_only=True)
  implementation: str = "auto"
  input_partitioning: Optional[tuple] = dataclasses.field(
    default=None, kw_only=True
  )
  mesh: Optional[Any] = dataclasses.field(default=None, kw_only=True)
  data_parallel: str = dataclasses.field(default="auto", kw_only=True)

  @nn.compact
  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: Optional[jax.Array] = None,
    inputs_v: Optional[jax.Array] = None,
    *,
    inputs_kv: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    deterministic: Optional[bool] = None,
    dropout_rng: Optional[jax.Array] = None,
    sow_weights: bool = False,
  ):
    """Attention of ``inputs_q`` over ``inputs_k`` / ``inputs_v``, as
    ``nn.MultiHeadDotProductAttention.__call__``."""
    self._check_products()
    inputs_k, inputs_v = _key_value_inputs(
      inputs_q, inputs_k, inputs_v, inputs_kv
    )
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(
        f"Memory dimension ({qkv_features}) must be divisible by number of "
        f"heads ({self.num_heads})."
      )
    head_dim = qkv_features // self.num_heads
    out_kernel_init = self.out_kernel_init or self.kernel_init
    if self.out_kernel_init is None:
      self._check_shared_init((self.num_heads, head_dim, features))
    qkv_names, out_names = None, None
    if self.input_partitioning is not None:
      # [batch..., length, heads, head_dim]: whole sequences, the heads
      # sharded as the kernels shard them.
      batch = tuple(self.input_partitioning)[:-2]
      qkv_names = (
        *batch,
        None,
        self._kernel_names(
          self.kernel_init, (inputs_q.shape[-1], self.num_heads, head_dim)
        )[1],
        None,
      )
      out_names = (
        *batch,
        None,
        self._kernel_names(
          out_kernel_init, (self.num_heads, head_dim, features)
        )[0],
        None,
      )
    dense = functools.partial(
      ForgeDenseGeneral,
      axis=-1,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      features=(self.num_heads, head_dim),
      input_partitioning=self.input_partitioning,
      output_partitioning=qkv_names,
      mesh=self.mesh,
      data_parallel=self.data_parallel,
      kernel_init=self.kernel_init,
      bias_init=self.bias_init,
      use_bias=self.use_bias,
      precision=self.precision,
      dot_general=self.qkv_dot_general,
      dot_general_cls=self.qkv_dot_general_cls,
      optimizer=self.optimizer,
      implementation=self.implementation,
    )
    # [batch..., length, heads, head_dim]
    query = dense(name="query")(inputs_q)
    key = dense(name="key")(inputs_k)
    value = dense(name="value")(inputs_v)

    if self.normalize_qk:
      norm = functools.partial(
        nn.LayerNorm,
        use_bias=False,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
      )
      query = norm(name="query_ln")(query)
      key = norm(name="key_ln")(key)

    if self.decode:
      key, value, mask = self._decode_step(query, key, value, mask)

    if self.dropout_rate > 0.0:  # `deterministic` is needed only for dropout
      m_deterministic = nn.merge_param(
        "deterministic", self.deterministic, deterministic
      )
      if not m_deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      m_deterministic = True

    attn_kwargs = dict(
      mask=mask,
      dropout_rng=dropout_rng,
      dropout_rate=self.dropout_rate,
      broadcast_dropout=self.broadcast_dropout,
      deterministic=m_deterministic,
      dtype=self.dtype,
      precision=self.precision,
      force_fp32_for_softmax=self.force_fp32_for_softmax,
      qk_attn_weights_einsum=(
        self.qk_attn_weights_einsum_cls()
        if self.qk_attn_weights_einsum_cls
        else None
      ),
      attn_weights_value_einsum=(
        self.attn_weights_value_einsum_cls()
        if self.attn_weights_value_einsum_cls
        else None
      ),
    )
    # Only the arguments the attention function takes (as flax filters).
    parameters = inspect.signature(self.attention_fn).parameters
    attn_kwargs = {k: v for k, v in attn_kwargs.items() if k in parameters}
    if sow_weights:
      x = self.attention_fn(query, key, value, **attn_kwargs, module=self)
    else:
      x = self.attention_fn(query, key, value, **attn_kwargs)
    return ForgeDenseGeneral(
      features=features,
      axis=(-2, -1),
      input_partitioning=out_names,
      output_partitioning=self.input_partitioning,
      mesh=self.mesh,
      data_parallel=self.data_parallel,
      kernel_init=out_kernel_init,
      bias_init=self.out_bias_init or self.bias_init,
      use_bias=self.use_bias,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      precision=self.precision,
      dot_general=self.out_dot_general,
      dot_general_cls=self.out_dot_general_cls,
      optimizer=self.optimizer,
      implementation=self.implementation,
      name="out",
    )(x)

  def _check_products(self):
    """Refuses a custom product of the projections, naming the field."""
    check_products(
      f"{type(self).__name__} {'/'.join(self.path)!r}",
      "flax's nn.MultiHeadDotProductAttention",
      (
        (
          name,
          getattr(self, name),
          (None,) if "_cls" in name else (None, DEFAULT_DOT_GENERAL),
        )
        for name in _PRODUCT_FIELDS
      ),
    )

  def _check_shared_init(self, out_shape):
    """Refuses a ``kernel_init`` whose partitioning, which the out kernel
    shares without ``out_kernel_init``, shards its ``head_dim``: FORGE
    merges ``[heads, head_dim]`` into one dimension (flax lays the names on
    the ``[features, heads, head_dim]`` projections and the out kernel
    alike)."""
    flat = (out_shape[0] * out_shape[1], out_shape[2])  # as DenseGeneral
    boxed = jax.eval_shape(
      lambda: self.kernel_init(jax.random.key(0), flat, self.param_dtype)
    )
    if not isinstance(boxed, nn.Partitioned):
      return
    mesh_axes = tuple(partition_resolver(boxed)(tuple(boxed.names)))
    if len(mesh_axes) > 1 and mesh_axes[1] not in (None, ()):
      raise ValueError(
        f"{type(self).__name__} {'/'.join(self.path)!r}: out_kernel_init "
        f"is None, so the out kernel {out_shape} ([heads, head_dim, "
        f"features]) takes kernel_init's partitioning {boxed.names}, which "
        "shards its head_dim; FORGE merges [heads, head_dim] into one "
        "dimension, of which only the heads can be sharded. Give "
        "out_kernel_init its own partitioning, e.g. "
        "nn.with_partitioning(init, ('model', None, None))."
      )

  def _kernel_names(self, init, shape) -> tuple:
    """The partitioning names ``init`` gives a kernel of ``shape`` (None
    for each dimension of an unpartitioned one)."""
    boxed = jax.eval_shape(
      lambda: init(jax.random.key(0), shape, self.param_dtype)
    )
    names = getattr(boxed, "names", None)
    return tuple(names) if names is not None else (None,) * len(shape)

  def _decode_step(self, query, key, value, mask):
    """The autoregressive cache: write this position's key and value, and
    mask the positions not generated yet (flax's cache, same variables)."""
    is_initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable(
      "cache", "cached_key", jnp.zeros, key.shape, key.dtype
    )
    cached_value = self.variable(
      "cache", "cached_value", jnp.zeros, value.shape, value.dtype
    )
    cache_index = self.variable(
      "cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32)
    )
    if not is_initialized:
      return key, value, mask
    *batch_dims, max_length, num_heads, depth_per_head = cached_key.value.shape
    expected_shape = tuple(batch_dims) + (1, num_heads, depth_per_head)
    if expected_shape != query.shape:
      raise ValueError(
        "Autoregressive cache shape error, expected query shape "
        f"{expected_shape} instead got {query.shape}."
      )
    cur_index = cache_index.value
    zero = jnp.array(0, dtype=lax.dtype(cur_index.dtype))
    indices = (zero,) * len(batch_dims) + (cur_index, zero, zero)
    key = lax.dynamic_update_slice(cached_key.value, key, indices)
    value = lax.dynamic_update_slice(cached_value.value, value, indices)
    cached_key.value = key
    cached_value.value = value
    cache_index.value = cache_index.value + 1
    # The query attends to the positions cached so far, not the zeros after.
    mask = nn.combine_masks(
      mask,
      jnp.broadcast_to(
        jnp.arange(max_length) <= cur_index,
        tuple(batch_dims) + (1, 1, max_length),
      ),
    )
    return key, value, mask


#: The fields of flax's attention that replace its projections' product.
_PRODUCT_FIELDS = (
  "qkv_dot_general",
  "out_dot_general",
  "qkv_dot_general_cls",
  "out_dot_general_cls",
)


class SelfAttention(MultiHeadDotProductAttention):
  """``nn.SelfAttention`` (attention of the input over itself), FORGE's."""

  @nn.compact
  def __call__(  # type: ignore[override]
    self,
    inputs_q: jax.Array,
    mask: Optional[jax.Array] = None,
    deterministic: Optional[bool] = None,
    dropout_rng: Optional[jax.Array] = None,
    sow_weights: bool = False,
  ):
    return super().__call__(
      inputs_q,
      mask=mask,
      deterministic=deterministic,
      dropout_rng=dropout_rng,
      sow_weights=sow_weights,
    )


def _key_value_inputs(inputs_q, inputs_k, inputs_v, inputs_kv):
  """``(inputs_k, inputs_v)`` with flax's defaults and checks."""
  if inputs_kv is not None:
    if inputs_k is not None or inputs_v is not None:
      raise ValueError(
        "If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must "
        "be None. If `inputs_kv` is not None, both `inputs_k` and "
        "`inputs_v` must be None."
      )
    warnings.warn(
      "The inputs_kv arg will be deprecated soon. Use inputs_k and "
      "inputs_v instead.",
      DeprecationWarning,
      stacklevel=3,
    )
    return inputs_kv, inputs_kv
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError(
        "`inputs_k` cannot be None if `inputs_v` is not None. To have both "
        "`inputs_k` and `inputs_v` be the same value, pass in the value to "
        "`inputs_k` and leave `inputs_v` as None."
      )
    inputs_k = inputs_q
  if inputs_v is None:
    inputs_v = inputs_k
  elif inputs_v.shape[-1] == inputs_v.shape[-2]:
    # A mask passed positionally, as before flax 0.7.4, lands here.
    warnings.warn(
      f"You are passing an array of shape {inputs_v.shape} to the "
      "`inputs_v` arg, when you may have intended to pass it to the `mask` "
      "arg. The call is `__call__(inputs_q, inputs_k=None, inputs_v=None, "
      "*, inputs_kv=None, mask=None, deterministic=None)`, as flax's: use "
      "the kwarg `mask` instead.",
      DeprecationWarning,
      stacklevel=3,
    )
  return inputs_k, inputs_v
