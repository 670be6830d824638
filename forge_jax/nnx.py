"""FORGE for Flax NNX: ``fj.nnx.Linear``, ``fj.nnx.Embed``,
``fj.nnx.Optimizer``, ``fj.nnx.scan``.

:class:`Linear` is a drop-in for ``nnx.Linear`` that calls the same fused op
as ``fj.ForgeDense`` (:func:`forge_jax.forge_dense`). Its kernel and
optimizer state are :class:`OverwriteWithGradient` variables, not
``nnx.Param``: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` leaves them
alone, and the gradient of the loss with respect to them is their *updated*
value, which :class:`Optimizer` (or :func:`install`) writes into the model.

The training loop changes in one way: ``nnx.Optimizer`` and
``nnx.grad`` (``nnx.value_and_grad``) become their ``fj.nnx`` namesakes;
:func:`global_norm` of the grads is the step's global gradient norm, and
``fj.nnx.Optimizer(..., max_grad_norm=c)`` clips by it (gradients from
:meth:`Optimizer.value_and_grad`).
:func:`grad` differentiates FORGE's variables too (``nnx.grad`` with
``argnums=nnx.DiffState(0, fj.nnx.TRAINABLE)`` does the same), and
:class:`Optimizer` installs them before optax steps the parameters::

  optimizer = fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    grads = fj.nnx.grad(loss_fn)(model, batch)
    optimizer.update(model, grads)

:func:`scan` replaces ``nnx.scan`` over a stack of layers (made with
``nnx.vmap``) with FORGE's in-place backward pass, the one ``fj.scan`` gives
Linen (:func:`forge_jax.scan.scan_stacks`).
"""

from __future__ import annotations

import functools
import itertools
import warnings
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import nnx
from flax.core import spmd
from flax.nnx.nn.dtypes import promote_dtype as nnx_promote_dtype
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from jax.sharding import PartitionSpec as P

from forge_jax import clipping, layer_context, parallel, quantization
from forge_jax.linen import (
  DEFAULT_DOT_GENERAL,
  FORGE_COLLECTION,
  check_products,
)
from forge_jax.ops.fused_dense import (
  IMPLEMENTATIONS,
  ForgeVariables,
  FusedDenseSpec,
  forge_dense,
  init_variables,
  one_hot_lookup,
  one_hot_precision,
  poisoned,
)
from forge_jax.optimizers import ForgeOptimizer, not_elementwise_message
from forge_jax.scan import scan_stacks
from forge_jax.train_state import (
  check_clipped,
  check_decay_masks,
  check_named_absent_layers,
  check_optimizers,
  check_probed,
  check_transformation,
  frozen_message,
  install_layer,
  probe_kernels,
  probe_layers,
  unreached_layer,
)


class OverwriteWithGradient(nnx.Variable):
  """A variable whose gradient is its new value.

  :class:`Linear` keeps its kernel, optimizer state, ``count``, ``skipped``
  ``intact`` and ``grad_sq_norm`` in variables of this type. FORGE's backward pass returns
  their updated values as their gradients; :class:`Optimizer` installs
  them. Not an ``nnx.Param``, so optax never holds state for them.
  Registered as the Linen ``ForgeDense``'s collection: ``nnx.bridge``
  moves them between the two APIs under that name, where
  ``fj.TrainState`` finds a bridged layer's variables.
  """


nnx.register_variable_name(
  FORGE_COLLECTION, OverwriteWithGradient, overwrite=True
)


#: The filter to differentiate with: the parameters optax trains and
#: FORGE's variables, ``nnx.grad(loss, argnums=nnx.DiffState(0, TRAINABLE))``.
TRAINABLE = (nnx.Param, OverwriteWithGradient)

#: Sharding metadata a kernel's optimizer state inherits from the kernel.
_SHARDING_KEYS = ("out_sharding", "sharding_rules", "mesh")

_LAYER_KEYS = itertools.count()

#: The ``layer_key`` of every layer an :class:`Optimizer` was made for or
#: :func:`install` wrote: the layers whose updates reach their model.
_INSTALLED = set()


class NotInstalledWarning(UserWarning):
  """A :class:`Linear` is differentiated though nothing installs its
  updates: no :class:`Optimizer` was made for its model and
  :func:`install` never wrote it (a plain ``nnx.Optimizer`` steps only
  ``nnx.Param``, so FORGE's kernels would never train)."""


def _value(variable):
  return variable.get_value()


def _values(tree):
  """The values of a pytree of variables."""
  return jax.tree.map(
    _value, tree, is_leaf=lambda v: isinstance(v, nnx.Variable)
  )


class Linear(nnx.Module):
  """A linear layer whose backward pass applies the optimizer step in place.

  Use it where you would use ``nnx.Linear``: the arguments are the same,
  plus ``optimizer`` (a forge_jax optimizer such as ``fj.adamw(...)``) and
  ``implementation``. The same ``rngs`` give the same initial kernel and bias
  as ``nnx.Linear``. ``kernel`` (``[in_features, out_features]``),
  ``opt_state`` (a pytree of variables), ``count``, ``skipped``,
  ``intact`` and ``grad_sq_norm`` are :class:`OverwriteWithGradient`
  variables; ``bias`` is an
  ``nnx.Param`` trained by your optax transformation.

  Args:
    in_features, out_features, use_bias, dtype, param_dtype, precision,
      kernel_init, bias_init, rngs, kernel_metadata, bias_metadata: as for
      ``nnx.Linear``.
    optimizer: the elementwise optimizer FORGE fuses into the backward pass.
    implementation: 'auto', 'xla', 'triton' or 'mosaic' (see
      ``fj.ForgeDense``).
    layer_id: static id that seeds stochastic rounding; None:
      :class:`Optimizer` sets a CRC-32 of the layer's path in the model.
    input_partitioning, output_partitioning, data_parallel: as for
      ``fj.ForgeDense`` (tensor and sequence parallelism).
    dot_general, promote_dtype, preferred_element_type: ``nnx.Linear``'s
      defaults only (a custom product is refused: FORGE computes the
      product and its weight gradient itself, promoting as flax does).

  Partitioning works as for ``nnx.Linear``
  (``kernel_init=nnx.with_partitioning(init, (None, 'model'))``, logical
  names with ``sharding_rules``): every optimizer state leaf that follows the
  kernel (kernel-shaped, int8 block scales) gets the kernel's sharding
  metadata, so ``nnx.get_partition_spec`` shards it like the kernel; the
  scalars are replicated. Under a mesh the layer runs per shard with
  ``jax.shard_map`` (:mod:`forge_jax.parallel`).
  """

  #: The name nnx's own layer keeps the weight under (checks of tx and of
  #: weight-decay masks ask about a leaf so named).
  twin_weight = "kernel"

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    optimizer: ForgeOptimizer,
    implementation: str = "auto",
    use_bias: bool = True,
    dtype: Optional[Any] = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: Callable = default_kernel_init,
    bias_init: Callable = default_bias_init,
    rngs: nnx.Rngs,
    layer_id: Optional[int] = None,
    input_partitioning: Optional[tuple] = None,
    output_partitioning: Optional[tuple] = None,
    data_parallel: str = "auto",
    kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
    bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    dot_general: Callable = DEFAULT_DOT_GENERAL,
    promote_dtype: Callable = nnx_promote_dtype,
    preferred_element_type: Optional[Any] = None,
  ):
    if not isinstance(optimizer, ForgeOptimizer):
      raise TypeError(not_elementwise_message(optimizer))
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    kind = type(self).__name__  # Linear, Embed: nnx's names
    check_products(
      f"fj.nnx.{kind}{(in_features, out_features)}",
      f"nnx.{kind}",
      (
        ("dot_general", dot_general, (DEFAULT_DOT_GENERAL,)),
        ("promote_dtype", promote_dtype, (nnx_promote_dtype,)),
        ("preferred_element_type", preferred_element_type, (None,)),
      ),
    )
    self.kernel = OverwriteWithGradient(
      kernel_init(rngs.params(), (in_features, out_features), param_dtype),
      **kernel_metadata,
    )
    metadata = self.kernel.get_metadata()
    sharding = {k: metadata[k] for k in _SHARDING_KEYS if k in metadata}
    kernel = self.kernel.get_value()
    variables = init_variables(optimizer, kernel)
    # Before the states take the kernel's sharding, which an int8 block
    # scale leaf of a too narrow column shard cannot divide.
    parallel.check_placed_block_split(
      f"fj.nnx.Linear{(in_features, out_features)}", variables
    )

    def state_variable(leaf):
      follows = parallel.follows_kernel(jnp.shape(leaf), jnp.shape(kernel))
      return OverwriteWithGradient(leaf, **(sharding if follows else {}))

    self.opt_state = nnx.data(jax.tree.map(state_variable, variables.opt_state))
    self.count = OverwriteWithGradient(variables.count)
    self.skipped = OverwriteWithGradient(variables.skipped)
    self.intact = OverwriteWithGradient(variables.intact)
    self.grad_sq_norm = OverwriteWithGradient(variables.grad_sq_norm)
    self.bias: Optional[nnx.Param]
    if use_bias:
      self.bias = nnx.Param(
        bias_init(rngs.params(), (out_features,), param_dtype),
        **bias_metadata,
      )
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.optimizer = optimizer
    self.implementation = implementation
    self.layer_id = layer_id
    self.input_partitioning = input_partitioning
    self.output_partitioning = output_partitioning
    self.data_parallel = data_parallel
    #: The kernel's (names, rules, mesh), one layer's (a stack made with
    #: nnx.vmap adds a layer axis to the variables' own metadata), or None.
    self.kernel_sharding = (
      (
        tuple(sharding["out_sharding"]),
        _hashable(sharding.get("sharding_rules")),
        sharding.get("mesh"),
      )
      if sharding.get("out_sharding")
      else None
    )
    #: The layer's key in :mod:`forge_jax.layer_context` (unique per layer).
    self.layer_key = ("fj.nnx.Linear", next(_LAYER_KEYS))

  def __call__(self, inputs: jax.Array) -> jax.Array:
    variables = ForgeVariables(
      _value(self.kernel),
      _values(self.opt_state),
      _value(self.count),
      _value(self.skipped),
      _value(self.intact),
      _value(self.grad_sq_norm),
    )
    bias = _value(self.bias) if self.bias is not None else None
    context = layer_context.stacked_layer()
    stacked = (
      context if context is not None and context.index is not None else None
    )
    self._check_variables(variables, stacked)
    layer_context.record_forward(
      self.layer_key, self.optimizer, self.twin_weight
    )
    spec = FusedDenseSpec(
      optimizer=self.optimizer,
      implementation=self.implementation,
      precision=self.precision,
      dtype=self.dtype,
      layer_id=self._layer_id(),
      path=self.layer_key,
    )
    layer_index = None if stacked is None else stacked.index
    layout = self._layout(inputs)
    return forge_dense(
      inputs,
      variables,
      bias,
      spec,
      layer_index,
      layout,
      where=self._where(),
    )

  def _where(self) -> str:
    """The layer as error messages show it."""
    return (
      f"fj.nnx.{type(self).__name__}({self.in_features}, {self.out_features})"
    )

  def _layer_id(self) -> int:
    if not self.optimizer.draws_random_bits:
      return 0  # unused: keep the spec (and its jit cache key) as before
    if self.layer_id is None:
      raise ValueError(
        f"{self._where()} rounds "
        "stochastically (its weights or 4-bit second moments) but has no "
        "layer_id to seed the rounding: create "
        "fj.nnx.Optimizer(model, ...) before the first step (it numbers "
        "the layers by their path in the model), or pass layer_id=."
      )
    return int(self.layer_id) & 0xFFFFFFFF

  def _check_variables(self, variables, stacked):
    """Shapes and dtypes as the constructor made them (a cast or another
    optimizer's state would receive the new weights through the change)."""
    one_layer = jax.eval_shape(
      functools.partial(init_variables, self.optimizer),
      jax.ShapeDtypeStruct(
        (self.in_features, self.out_features), self.param_dtype
      ),
    )
    expected = one_layer
    if stacked is not None:
      expected = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct((stacked.length,) + v.shape, v.dtype),
        expected,
      )
    describe = lambda tree: jax.tree.map(
      lambda x: (jnp.shape(x), jnp.result_type(x)), tree
    )
    same = lambda a, b: (
      jax.tree.structure(a) == jax.tree.structure(b) and a == b
    )
    actual, wanted = describe(variables), describe(expected)
    if same(actual, wanted):
      return
    where = self._where()
    if stacked is not None and same(actual, describe(one_layer)):
      raise TypeError(
        f"{where} is called inside an fj.nnx.scan block but is not one of "
        "the scanned layers (a layer passed to the block as a broadcast "
        "argument, or closed over): the block runs once per layer, so its "
        f"kernel would be shared by the {stacked.length} layers, and FORGE "
        "steps a kernel in each use's backward pass. Make a layer shared "
        "across the stack an nnx.Linear, or give each layer its own (made "
        "with the block by nnx.vmap)."
      )
    if stacked is not None:
      raise TypeError(
        f"{where}: its variables are {actual} but {wanted} was expected: "
        f"fj.nnx.scan hands every layer its variables stacked over the "
        f"{stacked.length} layers, so the block must use them as they come "
        "(no nnx.scan, nnx.vmap or fj.nnx.scan over the layer inside it)."
      )
    raise TypeError(
      f"{where}: its variables are {actual} but {wanted} was expected for "
      f"param_dtype={self.param_dtype} and {self.optimizer!r}. Call a "
      "stack of layers made with nnx.vmap through fj.nnx.scan (or "
      "nnx.scan); otherwise pass the variables as the constructor made "
      "them (no cast, no other optimizer's state)."
    )

  def _layout(self, inputs) -> Optional[parallel.ShardedLayout]:
    """The per-shard layout, or None for the single-device op."""
    if (
      self.kernel_sharding is None
      and self.input_partitioning is None
      and self.output_partitioning is None
    ):
      return None
    names, rules, mesh = self.kernel_sharding or ((None, None), None, None)
    resolve = lambda names: spmd.get_pspec(P(*names), rules)
    return parallel.layer_layout(
      inputs,
      mesh,
      names,
      self.input_partitioning,
      self.output_partitioning,
      resolve,
      self.data_parallel,
      where=self._where(),
    )


def _compute_dtype(dtype, param_dtype):
  """The one-hot rows' dtype: the layer's ``dtype``, else its table's."""
  return param_dtype if dtype is None else dtype


class Embed(Linear):
  """``nnx.Embed`` whose table FORGE steps in the backward pass: the lookup
  as the tokens' one-hot rows times the table, a :class:`Linear` kernel
  ``[num_embeddings, features]`` (see ``fj.ForgeEmbed`` for what that
  costs and saves). Same arguments as ``nnx.Embed`` plus ``optimizer`` and
  ``implementation``; the same initialization (``embedding_init``) and
  looked-up rows, with ``nnx.Embed``'s indexing: negative tokens count from
  the end, tokens outside the table look up NaN rows. ``promote_dtype``
  takes ``nnx.Embed``'s default only.
  """

  twin_weight = "embedding"

  def __init__(
    self,
    num_embeddings: int,
    features: int,
    *,
    optimizer: ForgeOptimizer,
    implementation: str = "auto",
    dtype: Optional[Any] = None,
    param_dtype: Any = jnp.float32,
    embedding_init: Callable = nnx.initializers.variance_scaling(
      1.0, "fan_in", "normal", out_axis=0
    ),
    rngs: nnx.Rngs,
    layer_id: Optional[int] = None,
    promote_dtype: Callable = nnx_promote_dtype,
    embedding_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    super().__init__(
      num_embeddings,
      features,
      optimizer=optimizer,
      implementation=implementation,
      use_bias=False,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=one_hot_precision(_compute_dtype(dtype, param_dtype)),
      kernel_init=embedding_init,
      rngs=rngs,
      layer_id=layer_id,
      kernel_metadata=embedding_metadata,
      promote_dtype=promote_dtype,
    )
    self.num_embeddings = num_embeddings
    self.features = features

  def __call__(self, inputs: jax.Array) -> jax.Array:
    return one_hot_lookup(
      inputs,
      self.num_embeddings,
      _compute_dtype(self.dtype, self.param_dtype),
      super().__call__,
      "fj.nnx.Embed",
    )

  def attend(self, query: jax.Array) -> jax.Array:
    raise NotImplementedError(
      "fj.nnx.Embed.attend: a head tied to a FORGE table would return its "
      "gradient to the table, which FORGE updates in the lookup's backward "
      "pass alone. Use nnx.Embed for tied embeddings."
    )


def _hashable(rules):
  """Logical axis rules as nested tuples (a static attribute is hashed)."""
  if rules is None:
    return None
  return tuple(
    (name, tuple(axes) if isinstance(axes, list) else axes)
    for name, axes in rules
  )


def _written(written, path, name: str):
  """The ``name`` entry (``count``, ``intact``) that the gradient
  ``written`` holds for the layer at ``path``, or None where it holds
  none."""
  try:
    value = _at(written, path)[name]
  except (KeyError, IndexError, TypeError):
    return None
  return _value(value) if isinstance(value, nnx.Variable) else value


def forge_layers(model) -> list[tuple[tuple, Linear]]:
  """``(path, layer)`` of every :class:`Linear` in ``model``."""
  return [
    (tuple(path), module)
    for path, module in nnx.iter_modules(model)
    if isinstance(module, Linear)
  ]


def check_owned_by_layers(model, layers):
  """Refuses FORGE variables of ``model`` that no :class:`Linear` of
  ``layers`` holds: a Linen ``fj.ForgeDense`` wrapped by
  ``nnx.bridge.ToNNX``, whose updates no NNX install would write."""
  owners = [path for path, _ in layers]
  stray = sorted(
    {
      _name(path[:-1])
      for path, _ in nnx.to_flat_state(nnx.state(model, OverwriteWithGradient))
      if path[-1] == "intact"
      and not any(path[: len(owner)] == owner for owner in owners)
    }
  )
  if stray:
    raise ValueError(
      f"The FORGE variables of {stray} belong to no fj.nnx.Linear (a Linen "
      "fj.ForgeDense wrapped by nnx.bridge.ToNNX?): fj.nnx.Optimizer "
      "installs the updates of fj.nnx.Linear and fj.nnx.Embed layers only. "
      "Use those in an NNX model (or train the Linen model with "
      "fj.TrainState)."
    )


def _name(path) -> str:
  return "/".join(map(str, path))


def _at(state, path):
  for key in path:
    state = state[key]
  return state


def install(model, grads) -> dict[str, jax.Array]:
  """Writes FORGE's new variables from ``grads`` into ``model``.

  ``grads`` is what ``nnx.grad`` returned for ``model`` with
  :class:`OverwriteWithGradient` in its filter (:data:`TRAINABLE`). A layer
  whose backward was traced in this step takes its gradients as they are
  (the update stays in place); any other layer only where FORGE wrote them
  (``intact``): a layer the loss did not reach keeps its variables bit for
  bit.

  Returns:
    ``{layer path: 1.0 or 0.0}`` (float32; ``[L]`` for a stack of layers):
    whether the step's loss reached the layer.
  """
  writes, reached = _installed(model, grads)
  _write(writes)
  return reached


def _installed(
  model, grads, left_out: tuple = ()
) -> tuple[list, dict[str, jax.Array]]:
  """What :func:`install` writes, as ``(layer, state, new values)`` triples,
  and its ``reached``; raises before anything is written.

  A layer of ``left_out`` (the paths an :class:`Optimizer`'s ``wrt``
  leaves out) that ``grads`` holds nothing for was not differentiated,
  so its backward never ran: it keeps its variables, as the frozen
  ``nnx.Linear`` would, and counts as not reached."""
  layers = forge_layers(model)
  written = nnx.state(grads, OverwriteWithGradient)
  reached, writes = {}, []
  traced = layer_context.take_backwards(
    [layer.layer_key for _, layer in layers],
    [_written(written, path, "count") for path, _ in layers],
    [_value(layer.kernel) for _, layer in layers],
    [_written(written, path, "kernel") for path, _ in layers],
  )
  for (path, layer), backward_traced in zip(layers, traced):
    _INSTALLED.add(layer.layer_key)
    try:
      layer_grads = nnx.to_pure_dict(_at(written, path))
    except (KeyError, IndexError, TypeError):
      layer_grads = None
    if not layer_grads and _name(path) in left_out:
      reached[_name(path)] = jnp.zeros(
        jnp.shape(_value(layer.intact)), jnp.float32
      )
      continue
    if not layer_grads:
      raise ValueError(
        f"grads has no gradients for the fj.nnx.Linear at {_name(path)!r}, "
        "so FORGE's layers would train nothing: differentiate with respect "
        "to FORGE's variables too, fj.nnx.grad(loss_fn) (or nnx.grad with "
        "argnums=nnx.DiffState(0, fj.nnx.TRAINABLE)), not nnx.Param alone."
      )
    state = nnx.state(layer, OverwriteWithGradient)
    new, reached[_name(path)] = install_layer(
      nnx.to_pure_dict(state),
      layer_grads,
      backward_traced,
    )
    writes.append((layer, state, new))
  return writes, reached


def _write(writes):
  for layer, state, new in writes:
    nnx.replace_by_pure_dict(state, new)
    nnx.update(layer, state)


def _with_forge(argnums):
  """``argnums`` of ``nnx.grad`` with FORGE's variables in every filter."""
  if isinstance(argnums, int):
    return nnx.DiffState(argnums, TRAINABLE)
  if isinstance(argnums, nnx.DiffState):
    return nnx.DiffState(
      argnums.argnum, nnx.Any(argnums.filter, OverwriteWithGradient)
    )
  return tuple(_with_forge(a) for a in argnums)


def grad(f: Optional[Callable] = None, *, argnums=0, **kwargs):
  """``nnx.grad`` (same arguments) that also differentiates FORGE's
  variables: each argnum's filter (``nnx.Param`` by default) gets
  :class:`OverwriteWithGradient` added.

  Warns (:class:`NotInstalledWarning`) for a :class:`Linear` whose updates
  nothing installs: no :class:`Optimizer` was made for its model and
  :func:`install` never wrote it."""
  if f is None:
    return functools.partial(grad, argnums=argnums, **kwargs)
  return _warning_if_not_installed(
    nnx.grad(f, argnums=_with_forge(argnums), **kwargs), argnums
  )


def value_and_grad(f: Optional[Callable] = None, *, argnums=0, **kwargs):
  """``nnx.value_and_grad`` that also differentiates FORGE's variables (see
  :func:`grad`)."""
  if f is None:
    return functools.partial(value_and_grad, argnums=argnums, **kwargs)
  return _warning_if_not_installed(
    nnx.value_and_grad(f, argnums=_with_forge(argnums), **kwargs), argnums
  )


def _argnums(argnums) -> tuple:
  """The positions ``argnums`` (ints or ``nnx.DiffState``) differentiates."""
  if isinstance(argnums, (int, nnx.DiffState)):
    argnums = (argnums,)
  return tuple(getattr(a, "argnum", a) for a in argnums)


def _warning_if_not_installed(differentiated: Callable, argnums) -> Callable:
  @functools.wraps(differentiated)
  def call(*args, **kwargs):
    for position in _argnums(argnums):
      argument = args[position] if position < len(args) else None
      if not isinstance(argument, nnx.Module):
        continue
      for path, layer in forge_layers(argument):
        if layer.layer_key not in _INSTALLED:
          warnings.warn(
            f"The fj.nnx.Linear at {_name(path)!r} is differentiated, but "
            "nothing installs its updates: its kernel steps only when "
            "fj.nnx.Optimizer.update (or fj.nnx.install) writes the "
            "gradients into the model. A plain nnx.Optimizer steps "
            "nnx.Param alone. Make the optimizer with fj.nnx.Optimizer(model,"
            " tx, wrt=nnx.Param). (Installing with fj.nnx.install after "
            "this gradient silences this warning from then on.)",
            NotInstalledWarning,
            stacklevel=2,
          )
    return differentiated(*args, **kwargs)

  return call


def global_norm(grads) -> jax.Array:
  """The global norm of the gradient that ``grads`` (from :func:`grad`)
  stands for: ``optax.global_norm`` of every gradient, each
  :class:`Linear`'s ``dW`` included, without a ``dW`` stored (float32).

  A Linear's part is its ``grad_sq_norm`` (the sum of the squared ``dW``
  elements its backward pass accumulated; summed over a stack's layers);
  every other floating leaf that is not an :class:`OverwriteWithGradient`
  is a gradient. Gradients taken inside ``fj.plain_gradients()`` hold each
  ``dW`` in the Linear's kernel entry instead (and no ``grad_sq_norm``):
  this misses them. Their norm is ``optax.global_norm`` of the
  ``nnx.Param`` entries and the Linears' ``kernel`` entries::

    kernels = [g for path, g in nnx.to_flat_state(
        nnx.state(grads, fj.nnx.OverwriteWithGradient)) if path[-1] == "kernel"]
    optax.global_norm((nnx.state(grads, nnx.Param), kernels))
  """
  total = jnp.zeros((), jnp.float32)
  forge, others = nnx.filter_state(
    grads, OverwriteWithGradient, nnx.Not(OverwriteWithGradient)
  )
  for path, leaf in jax.tree_util.tree_flatten_with_path(forge)[0]:
    names = [getattr(key, "key", None) for key in path]
    if "grad_sq_norm" in names:
      total += jnp.sum(jnp.asarray(leaf, jnp.float32))
  return jnp.sqrt(clipping.squared_norm(others, total))


#: What :func:`forge_jax.train_state.check_transformation` advises instead
#: of ``clip_by_global_norm`` in an NNX ``tx``.
CLIPPING_ADVICE = (
  "Remove it from tx and clip with fj.nnx.Optimizer(model, tx, wrt=..., "
  "max_grad_norm=max_norm), taking the gradient with "
  "optimizer.value_and_grad(loss_fn) in place of "
  "fj.nnx.value_and_grad(loss_fn)."
)


def _map_gradients(grads, other: Callable, forge: Callable, *more):
  """``grads`` (an ``nnx.State`` of variables) with each floating gradient
  ``g`` replaced by ``other(g, *the same leaf of more)`` and each of
  FORGE's variables ``v`` by ``forge(name, v, *...)``, ``name`` its key."""

  def one(path, variable, *others):
    values = [_value(v) for v in (variable, *others)]
    if isinstance(variable, OverwriteWithGradient):
      return variable.replace(forge(getattr(path[-1], "key", None), *values))
    if jnp.issubdtype(jnp.result_type(values[0]), jnp.inexact):
      return variable.replace(other(*values))
    return variable

  return jax.tree_util.tree_map_with_path(
    one, grads, *more, is_leaf=lambda v: isinstance(v, nnx.Variable)
  )


def _clipped_value_and_grad(
  f, differentiated, has_aux, max_norm, clip, previous_norm
):
  """``value_and_grad`` of ``f(model, ...)`` with respect to the model's
  ``differentiated`` variables, FORGE's layers clipped by the global norm
  (:mod:`forge_jax.clipping`): ``'exact'`` runs the pullback of one
  forward pass twice, norm only, then seeded with ``min(1, max_norm /
  ||g||)``; ``'delayed'`` once, seeded by ``previous_norm``. The model's
  other variables (batch statistics, rng counts) and those of the graph
  nodes among the other arguments (an ``nnx.Rngs``, a teacher model) take
  the forward's updates, as ``nnx.value_and_grad`` gives them."""

  def value_and_grad_fn(model, *args, **kwargs):
    if clip == "delayed":
      clipping.check_traced_alike(
        nnx.state(model), previous_norm[...], "optimizer", "nnx.jit"
      )
    nodes, rebuild = _graph_nodes((args, kwargs))
    # One split keeps the references the model shares with the other
    # arguments; only the model's own variables are differentiated.
    in_model = nnx.All(differentiated, lambda path, _: path[0] == 0)
    graphdef, diff, rest = nnx.split((model, nodes), in_model, ...)

    def loss(diff):
      inner, inner_nodes = nnx.merge(graphdef, diff, rest, copy=True)
      inner_args, inner_kwargs = rebuild(inner_nodes)
      out = f(inner, *inner_args, **inner_kwargs)
      value, aux = out if has_aux else (out, None)
      return value, (aux, nnx.state((inner, inner_nodes), nnx.Not(in_model)))

    value, pullback, (aux, updates) = jax.vjp(loss, diff, has_aux=True)
    pullback = _of_model(pullback)
    seed = lambda scale: jnp.asarray(scale, jnp.result_type(value))
    if clip == "exact":
      with layer_context.running(layer_context.NORM_ONLY):
        (measured,) = pullback(seed(1.0))
      scale = clipping.clip_scale(global_norm(measured), max_norm)
      with layer_context.running(layer_context.SCALED):
        (stepped,) = pullback(seed(scale))
      # The layers' new variables from the clipped pass, with the norm of
      # their unclipped dW; the other gradients unclipped.
      grads = _map_gradients(
        measured,
        lambda unclipped, _: unclipped,
        lambda name, norm_only, new: (
          norm_only if name == "grad_sq_norm" else new
        ),
        stepped,
      )
    else:
      scale = clipping.clip_scale(
        clipping.delayed_norm(previous_norm[...]), max_norm
      )
      with layer_context.running(layer_context.SCALED):
        (stepped,) = pullback(seed(scale))
      grads = _map_gradients(
        stepped,
        lambda g: g / scale.astype(g.dtype),
        lambda name, v: v / scale**2 if name == "grad_sq_norm" else v,
      )
    nnx.update((model, nodes), updates)
    return ((value, aux) if has_aux else value), grads

  return value_and_grad_fn


def _graph_nodes(tree):
  """The graph nodes among ``tree``'s leaves (modules, ``nnx.Rngs``,
  variables), and a function that rebuilds ``tree`` with others in their
  places."""
  is_node = nnx.graphlib.is_graph_node
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_node)
  places = [i for i, leaf in enumerate(leaves) if is_node(leaf)]

  def rebuild(nodes):
    rebuilt = list(leaves)
    for place, node in zip(places, nodes):
      rebuilt[place] = node
    return jax.tree.unflatten(treedef, rebuilt)

  return [leaves[place] for place in places], rebuild


def _of_model(pullback):
  """``pullback`` of the split ``(model, nodes)``, returning the model's
  gradients alone (as ``nnx.split(model, ...)`` orders them)."""

  def model_pullback(seed):
    (grads,) = pullback(seed)
    return (grads[0] if 0 in grads else nnx.State({}),)

  return model_pullback


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` (same arguments) that installs FORGE's variables.

  ``update(model, grads)`` writes the new kernels and states of the
  model's :class:`Linear` layers (:func:`install`) and steps the
  variables ``wrt`` selects with ``tx``, as ``nnx.Optimizer`` does; grads
  either refuses leave everything as it was. Pass the
  layers' optimizer as ``tx`` (``opt.to_optax()``); transformations that
  cannot be right beside FORGE's layers (``optax.MultiSteps``,
  ``clip_by_global_norm``, another rule than the layers') are refused. A
  layer that ``wrt`` leaves out or ``tx`` freezes is refused at the
  ``update`` whose grads step it (its kernel would train in the backward
  pass); with its output's gradient stopped, or (left out by ``wrt``) not
  differentiated at all, it stays as it was.

  Global-norm clipping is ``max_grad_norm`` (and ``clip``, as for
  ``fj.TrainState``), with the gradient from :meth:`value_and_grad`::

    optimizer = fj.nnx.Optimizer(model, opt.to_optax(), wrt=nnx.Param,
                                 max_grad_norm=1.0)
    loss, grads = optimizer.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)

  ``'exact'`` equals ``optax.chain(optax.clip_by_global_norm(max_grad_norm),
  tx)`` with ``nnx.Linear`` (two backward passes of one forward);
  ``'delayed'`` clips by the previous step's norm (one backward pass; the
  first step is not clipped).

  The layers' optimizer states and step counts live in the model, as
  :class:`OverwriteWithGradient` variables: a new ``Optimizer`` for a
  trained model starts ``tx``'s state afresh (the biases') but not theirs.
  To restart the whole optimizer, make the model anew or restore both
  from a checkpoint (``nnx.state(model)`` holds the layers' states; a
  state filtered by ``nnx.Param`` holds neither their kernels nor their
  states).

  Attributes:
    reached: one float32 variable per layer (``[L]`` for a stack): whether
      the last step's loss reached it; :meth:`unreached_layers` names the
      others.
    layer_paths: the layers' paths in the model, in the order of
      ``reached``.
    grad_norm: the last step's global gradient norm over the gradients
      ``update`` steps (those ``wrt`` selects, and the layers'), before
      clipping (float32; 0.0 before the first step). None where
      ``track_grad_norm`` is off.
    track_grad_norm: whether each ``update`` computes ``grad_norm``
      (default True). Off, an update without clipping skips the sum of the
      other gradients' squares and the root. Clipping needs it on.
    max_grad_norm, clip: the clipping (None: none).
  """

  def __init__(
    self,
    model,
    tx,
    *,
    wrt,
    max_grad_norm: Optional[float] = None,
    clip: str = "exact",
    track_grad_norm: bool = True,
    **kwargs,
  ):
    check_transformation(tx, CLIPPING_ADVICE)
    clipping.check_clipping(max_grad_norm, clip, track_grad_norm)
    owned = nnx.state(model, nnx.All(wrt, OverwriteWithGradient))
    if jax.tree.leaves(owned):
      raise ValueError(
        f"wrt={wrt!r} selects FORGE's variables (fj.nnx.Overwrite"
        "WithGradient), which FORGE's backward pass updates: tx would "
        "keep a second optimizer state for them. Use wrt=nnx.Param."
      )
    layers = forge_layers(model)
    check_owned_by_layers(model, layers)
    try:
      super().__init__(model, tx, wrt=wrt, **kwargs)
    except (ValueError, TypeError, KeyError):
      check_named_absent_layers(
        tx,
        nnx.state(model, wrt),
        [path for path, _ in layers],
        {path: layer.twin_weight for path, layer in layers},
        _kernel_ranks(layers),
      )
      raise
    check_optimizers(tx, {layer.optimizer for _, layer in layers})
    check_decay_masks(
      tuple((path, layer.optimizer) for path, layer in layers),
      {path: layer.twin_weight for path, layer in layers},
      {path: _value(layer.kernel) for path, layer in layers},
    )
    # Refused at update unless the grads do not step them.
    self._frozen_layers = frozen_layers(model, tx, wrt, layers)
    for path, layer in layers:
      _INSTALLED.add(layer.layer_key)
      layer_context.name_layer(layer.layer_key, _name(path))
      if layer.layer_id is None and layer.optimizer.draws_random_bits:
        try:
          layer.layer_id = quantization.layer_id_from_path(path)
        except flax_errors.TraceContextError:
          # nnx.eval_shape of an optimizer over a model made outside it:
          # the model stays as it is; its real optimizer numbers it.
          pass
    self.layer_paths = tuple(_name(path) for path, _ in layers)
    self.reached = nnx.data(
      [
        nnx.OptState(jnp.ones(jnp.shape(_value(layer.intact)), jnp.float32))
        for _, layer in layers
      ]
    )
    self.max_grad_norm = max_grad_norm
    self.clip = clip
    self.track_grad_norm = track_grad_norm
    self.grad_norm = (
      nnx.OptState(jnp.zeros((), jnp.float32)) if track_grad_norm else None
    )

  def value_and_grad(self, f: Callable, *, has_aux: bool = False):
    """:func:`value_and_grad` of ``f(model, *args, **kwargs)`` with respect
    to the model's ``wrt`` and FORGE's variables, for this optimizer's
    clipping: with ``max_grad_norm``, the layers step with their gradient
    clipped by the global norm (``'exact'``: this step's, in two backward
    passes of one forward; ``'delayed'``: the previous step's, in one), and
    :meth:`update` clips the other gradients alike. The returned gradients
    of the other variables are unclipped, so :func:`global_norm` of them is
    the step's norm."""
    if self.max_grad_norm is None:
      return value_and_grad(
        f, argnums=nnx.DiffState(0, self.wrt), has_aux=has_aux
      )
    return _clipped_value_and_grad(
      f,
      nnx.Any(self.wrt, OverwriteWithGradient),
      has_aux,
      self.max_grad_norm,
      self.clip,
      self.grad_norm,
    )

  def update(self, model, grads, /, **kwargs):
    """Installs FORGE's variables and steps the others with ``tx``
    (clipped by the global norm where ``max_grad_norm`` is set); where
    either refuses the grads, nothing is written.

    Refuses grads that step a layer ``wrt`` or ``tx`` freezes: its kernel
    would train in the backward pass."""
    check_frozen_unreached(self._frozen_layers, self.wrt, model, grads)
    # Also here: the clipping attributes can be set after construction.
    clipping.check_clipping(self.max_grad_norm, self.clip, self.track_grad_norm)
    # Over what tx and the layers step, as clip_by_global_norm in an
    # nnx.Optimizer's tx sees the grads wrt selects.
    trained = nnx.Any(self.wrt, OverwriteWithGradient)
    norm = (
      global_norm(nnx.state(grads, trained)) if self.track_grad_norm else None
    )
    if self.max_grad_norm is not None:
      check_clipped(
        [
          (_name(path), layer.layer_key, _value(layer.kernel))
          for path, layer in forge_layers(model)
        ],
        "take the gradient with optimizer.value_and_grad(loss_fn), not "
        "fj.nnx.value_and_grad(loss_fn).",
      )
      reference = (
        norm
        if self.clip == "exact"
        else clipping.delayed_norm(self.grad_norm[...])
      )
      grads = _map_gradients(
        grads,
        lambda g: clipping.clipped(g, reference, self.max_grad_norm),
        lambda name, value: value,
      )
    # Nothing is written until tx's step has run: grads it refuses leave
    # the model and this optimizer as they were.
    writes, reached = _installed(model, grads, self._frozen_layers.by_wrt)
    updates = super().update(model, grads, **kwargs)
    _write(writes)
    if self.track_grad_norm:
      self.grad_norm[...] = norm
    for name, flags in zip(self.layer_paths, self.reached):
      flags[...] = reached[name]
    return updates

  def unreached_layers(self) -> list[str]:
    """Paths of the layers the last step's loss did not reach (host side;
    stacked layers are named ``path[i]``)."""
    names = []
    for name, flags in zip(self.layer_paths, self.reached):
      flags = np.asarray(jax.device_get(_value(flags)))
      if flags.ndim == 0:
        names += [name] if flags == 0 else []
      else:
        names += [f"{name}[{i}]" for i in np.flatnonzero(flags == 0)]
    return names


class FrozenLayers(NamedTuple):
  """The paths of the :class:`Linear` layers an :class:`Optimizer` freezes:
  those its ``wrt`` leaves out (their kernel, asked as for
  ``nnx.Linear``'s) and those its ``tx`` steps by exactly zero."""

  by_wrt: tuple
  by_tx: tuple


def frozen_layers(model, tx, wrt, layers) -> FrozenLayers:
  """The :class:`FrozenLayers` of ``layers`` (the model's ``(path,
  Linear)`` pairs); ``tx`` is probed by
  :func:`forge_jax.train_state.probe_kernels`, else by a bias probe. Their
  kernels step in the backward pass either way, unless the loss does not
  reach them: :func:`check_frozen_unreached` decides at the update.

  Refuses at once a ``tx`` that steps a layer's kernel or bias by another
  rule than the layer's, which no gradient makes right."""
  selected = nnx.state(model, wrt)
  # The kernel is not an nnx.Param, so ``wrt`` is asked about an nnx.Param
  # at its path, named as nnx's twin names it (an Embed's 'embedding'):
  # what it would select were the layer nnx's own. A bias it leaves out
  # stays as nnx.Linear's would.
  selects = nnx.filterlib.to_predicate(wrt)
  left_out = tuple(
    _name(path)
    for path, layer in layers
    if not selects((*path, layer.twin_weight), nnx.Param(_value(layer.kernel)))
  )
  optimizers = tuple((path, layer.optimizer) for path, layer in layers)
  probed = probe_layers(tx, optimizers, selected)
  kernels = probe_kernels(
    tx,
    optimizers,
    {path: layer.twin_weight for path, layer in layers},
    selected,
    _kernel_ranks(layers),
  )
  check_probed(None, probed, kernels)
  # As Linen's: the kernel probe, where tx runs on it, says whether a
  # layer is frozen (a bias alone may be); else the bias probe.
  frozen = kernels if kernels is not None else probed
  return FrozenLayers(left_out, () if frozen is None else tuple(frozen.frozen))


def _kernel_ranks(layers) -> dict:
  """``{path: rank of the kernel}`` of ``(path, Linear)`` pairs (3 for a
  stack of ``nnx.vmap``-made layers): a weight-decay mask by rank reads
  it."""
  return {path: jnp.ndim(_value(layer.kernel)) for path, layer in layers}


def check_frozen_unreached(frozen: FrozenLayers, wrt, model, grads):
  """Refuses ``grads`` that step a layer of ``frozen``: the loss reaches
  it, and its kernel steps though ``wrt`` or ``tx`` freezes it. A layer
  whose output's gradient is stopped stays as the frozen ``nnx.Linear``
  would."""
  if not frozen.by_wrt and not frozen.by_tx:
    return
  written = nnx.state(grads, OverwriteWithGradient)
  unreached = set()
  for path, layer in forge_layers(model):
    flags = _written(written, path, "intact")
    if flags is None:
      unreached.add(_name(path))  # install refuses grads without it
      continue
    if unreached_layer(flags, layer.layer_key, _value(layer.kernel)):
      unreached.add(_name(path))
  stepped = lambda paths: [path for path in paths if path not in unreached]
  if stepped(frozen.by_wrt):
    raise ValueError(
      frozen_message(
        stepped(frozen.by_wrt),
        f"wrt={wrt!r} leaves the layers {{paths}} out, as for frozen layers",
      )
      + " Or leave them out of the gradient too (fj.nnx.grad "
      "differentiates every FORGE layer): nnx.grad(loss_fn, argnums="
      "nnx.DiffState(0, nnx.All(fj.nnx.TRAINABLE, <what wrt selects by "
      "path>)))."
    )
  if stepped(frozen.by_tx):
    raise ValueError(frozen_message(stepped(frozen.by_tx)))


def wiped_layers(model) -> list[str]:
  """Paths of :class:`Linear` layers whose variables were overwritten with
  zeros (``intact`` 0: installed without :func:`install`, e.g. by
  ``nnx.update(model, grads)`` after a step the layer's output did not
  reach) or with cotangents no single backward wrote (a kernel shared
  under a ``lax.scan``, a clip of FORGE's collection: see
  :func:`forge_jax.wiped_layers`); their next step makes the kernel NaN.
  Stacked layers are named ``path[i]``."""
  names = []
  for path, layer in forge_layers(model):
    names += poisoned(_name(path), _value(layer.intact), _value(layer.count))
  return names


_STATEFUL_BLOCK = (
  "fj.nnx.scan's block changes its variables (dropout's rng counts, batch "
  "statistics, ...): fj.nnx.scan runs stateless blocks; use nnx.scan for "
  "this one."
)


def _stateful(layers) -> bool:
  """Whether the block keeps state its call changes: rng streams of its own
  (``nnx.Dropout(rngs=...)``) or batch statistics in training mode. The
  scan's layers are slices, so such changes would be lost, with no error
  outside a gradient."""
  if jax.tree.leaves(nnx.state(layers, nnx.RngCount)):
    return True
  return any(
    isinstance(module, nnx.BatchNorm) and not module.use_running_average
    for _, module in nnx.iter_modules(layers)
  )


def _inexact(path, variable) -> bool:
  del path
  return all(
    jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    for leaf in jax.tree.leaves(variable)
  )


def scan(
  f: Optional[Callable] = None,
  *,
  in_axes: Any = (nnx.Carry, 0),
  out_axes: Any = nnx.Carry,
  unroll: int = 1,
) -> Callable:
  """``nnx.scan`` over stacked layers, FORGE's variables updated in place.

  Replace ``nnx.scan`` with ``fj.nnx.scan`` over a stack of layers made with
  ``nnx.vmap`` (every variable on a leading layer axis)::

    @fj.nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
    def forward(x, block, cos):
      return block(x, cos)

    x = forward(x, self.blocks, cos)

  ``f(carry, layer, *args)`` returns the new carry; every argument after the
  layer is broadcast to all layers (``in_axes`` None) and its gradient is
  summed over them. The backward pass runs the layers from the last to the
  first; each :class:`Linear` steps its entry of the whole stacks, so no
  layer's kernel or state is copied (``fj.scan``'s backward,
  :func:`forge_jax.scan.scan_stacks`). Wrap the block call in
  ``nnx.remat`` to save only what its policy saves per layer.

  Raises:
    ValueError: for ``in_axes`` or ``out_axes`` other than the above.
    NotImplementedError: for a block that changes its variables (dropout's
      rng counts, batch statistics): use ``nnx.scan`` for those.
  """
  if f is None:
    return functools.partial(
      scan, in_axes=in_axes, out_axes=out_axes, unroll=unroll
    )
  in_axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else in_axes
  if (
    not isinstance(in_axes, tuple)
    or len(in_axes) < 2
    or in_axes[0] is not nnx.Carry
    or in_axes[1] != 0
    or any(axis is not None for axis in in_axes[2:])
    or out_axes is not nnx.Carry
  ):
    raise ValueError(
      f"fj.nnx.scan(in_axes={in_axes!r}, out_axes={out_axes!r}): scans "
      "f(carry, layers, *args) with in_axes=(nnx.Carry, 0, None, ...) "
      "(the layers stacked on axis 0, the other arguments broadcast) and "
      "out_axes=nnx.Carry. Use nnx.scan for per-layer inputs or outputs."
    )

  @functools.wraps(f)
  def scanned(carry, layers, *args):
    if len(args) != len(in_axes) - 2:
      raise ValueError(
        f"fj.nnx.scan: {2 + len(args)} arguments for in_axes={in_axes!r}"
      )
    context = layer_context.stacked_layer()
    if context is not None and context.index is not None:
      raise NotImplementedError(
        "fj.nnx.scan inside the block of another fj.nnx.scan: the outer "
        "backward hands its layers' variables over as whole stacks"
      )
    if _stateful(layers):
      raise NotImplementedError(_STATEFUL_BLOCK)
    graphdef, forge, others, fixed = nnx.split(
      layers, OverwriteWithGradient, _inexact, ...
    )
    lengths = {jnp.shape(leaf)[0] for leaf in jax.tree.leaves(layers)}
    if len(lengths) != 1:
      raise ValueError(
        "fj.nnx.scan: the layers' variables must share one leading layer "
        f"axis (nnx.vmap's stack); their leading sizes are {lengths}"
      )
    (length,) = lengths

    def layer_fn(layer_others, forge, x, layer_fixed, args):
      layer = nnx.merge(graphdef, forge, layer_others, layer_fixed)
      try:
        out = f(x, layer, *args)
      except flax_errors.TraceContextError as error:
        raise NotImplementedError(_STATEFUL_BLOCK) from error
      before = jax.tree.leaves((forge, layer_others, layer_fixed))
      after = jax.tree.leaves(
        nnx.split(layer, OverwriteWithGradient, _inexact, ...)[1:]
      )
      if len(before) != len(after) or any(
        a is not b for a, b in zip(after, before)
      ):
        raise NotImplementedError(_STATEFUL_BLOCK)
      return out

    return scan_stacks(
      layer_fn, length, carry, forge, others, fixed, args, unroll=unroll
    )

  return scanned


__all__ = [
  "TRAINABLE",
  "Linear",
  "Optimizer",
  "OverwriteWithGradient",
  "forge_layers",
  "global_norm",
  "grad",
  "install",
  "scan",
  "value_and_grad",
  "wiped_layers",
]
