"""``ForgeDense``: a drop-in for ``flax.linen.Dense`` that trains itself."""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax.sharding import PartitionSpec as P

from forge_jax import layer_context, parallel, quantization
from forge_jax.ops.fused_dense import (
  ForgeVariables,
  FusedDenseSpec,
  forge_dense,
  init_variables,
)
from forge_jax.optimizers import ForgeOptimizer, not_elementwise_message

#: The collection that holds every ForgeDense kernel and optimizer state.
#: ``flax.training.train_state.TrainState.apply_gradients`` overwrites it with
#: its "gradient", which FORGE's backward makes the updated variables.
FORGE_COLLECTION = OVERWRITE_WITH_GRADIENT


class ForgeMemoryWarning(UserWarning):
  """A ForgeDense trains correctly but holds more memory than it needs to.

  Silence it with
  ``warnings.filterwarnings('ignore', category=fj.ForgeMemoryWarning)``.
  """


#: Flax transforms that stack or map a ForgeDense's variables. Their
#: transpose builds new buffers for every cotangent, so the updated kernels
#: and states of all layers exist beside the old ones until the step ends.
_STACKING_TRANSFORMS = ("scan", "vmap", "map_variables")


def _stacking_transform(scope) -> Optional[str]:
  """The first stacking transform on the module's scope path, or None."""
  for part in getattr(scope, "debug_path", ()):
    # Nested transforms read "remat(scan(Block_0))".
    for name in _STACKING_TRANSFORMS:
      if re.search(rf"\b{name}\(", part):
        return name
  return None


def _warn_stacked(path, transform: str):
  fix = (
    "fj.scan(...) with the same arguments instead of nn.scan(...)"
    if transform == "scan"
    else "fj.scan over the layers (or unrolled layers) instead of "
    f"nn.{transform}"
  )
  warnings.warn(
    f"ForgeDense {'/'.join(path)!r} runs inside nn.{transform}: it trains "
    f"correctly, but the transpose of nn.{transform} keeps the updated "
    "kernels and optimizer states of all layers beside the old ones until "
    "the step ends, which costs more memory than optax. Write "
    f"{fix} to update the stacks in place. (Silence with "
    "warnings.filterwarnings('ignore', category=fj.ForgeMemoryWarning).)",
    ForgeMemoryWarning,
    stacklevel=4,
  )


class ForgeDense(nn.Module):
  """A linear layer whose backward pass applies the optimizer step in place.

  Use it where you would use ``nn.Dense``: the fields are the same, plus
  ``optimizer`` (a forge_jax optimizer such as ``fj.adamw(...)``) and
  ``implementation``. The bias stays at ``params/<module>/bias`` and is
  trained by your optax transformation; the kernel (same leaf name,
  ``kernel``) and its optimizer state live in the ``_overwrite_with_gradient``
  collection, so differentiate with respect to the whole variables dict and
  let ``TrainState.apply_gradients`` (or any overwrite) install the result.

  Attributes:
    features: the number of output features.
    optimizer: the elementwise optimizer FORGE fuses into the backward pass.
    use_bias: whether to add a bias to the output (default: True).
    dtype: the dtype of the computation (default: inferred from input and params).
    param_dtype: the dtype of the kernel, bias and optimizer state default.
    precision: numerical precision of the computation, see ``jax.lax.Precision``.
    kernel_init: initializer for the weight matrix.
    bias_init: initializer for the bias.
    implementation: 'auto' (the fastest backend that applies), 'xla' (the
      reference), 'triton' (the Pallas-Triton kernel) or 'mosaic' (the
      Mosaic GPU kernel, Hopper and newer); the kernels run in Pallas
      interpret mode off-GPU.
    layer_id: static id that seeds stochastic rounding (an optimizer with
      ``weight_rounding='stochastic'``); None: a CRC-32 of the module path.
    mesh: the device mesh for tensor / sequence parallelism; None: the
      ``mesh`` of the kernel's partitioning metadata, else the mesh set with
      ``jax.set_mesh``. Without any mesh the partitioning is inert (as for
      ``nn.Dense``) and the layer runs as on one device.
    input_partitioning: names of the input's dimensions (mesh axes, or
      logical names when the kernel uses ``nn.with_logical_partitioning``,
      resolved with the same rules). None: tokens not sharded, features
      sharded like the kernel's in_features. Tokens sharded over the
      kernel's feature axis are all-gathered (sequence parallelism).
    output_partitioning: names of the output's dimensions. None: tokens as
      the input's after the gather, features like the kernel's; a token
      dimension that adds the kernel's in_features axis receives a
      reduce-scatter instead of an all-reduce (sequence parallelism).
    data_parallel: 'error' (default) refuses tokens sharded over a mesh axis
      that does not shard the kernel; 'psum' all-reduces ``dW`` over such
      axes inside the backward pass (materializes ``dW``). See
      :mod:`forge_jax.parallel`.

  Partitioning works as for ``nn.Dense``:
  ``kernel_init=nn.with_partitioning(init, (None, 'model'))`` (or
  ``nn.with_logical_partitioning`` and a rules table). Every kernel-shaped
  optimizer state leaf, and every int8 block-scale leaf ``[K, N / 64]``,
  gets the kernel's partitioning metadata, so ``nn.get_partition_spec``
  gives it the kernel's spec; the scalars are replicated (column-parallel
  layers with int8 states need ``features / shards`` to be a multiple of
  64). Under a mesh the layer then runs per shard with ``jax.shard_map``
  (:func:`forge_jax.parallel.forge_dense_sharded`).
  """

  features: int
  optimizer: ForgeOptimizer
  use_bias: bool = True
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros_init()
  implementation: str = "auto"
  layer_id: Optional[int] = None
  mesh: Optional[Any] = None
  input_partitioning: Optional[tuple] = None
  output_partitioning: Optional[tuple] = None
  data_parallel: str = "error"

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not isinstance(self.optimizer, ForgeOptimizer):
      raise TypeError(not_elementwise_message(self.optimizer))
    self._check_collection()
    in_features = jnp.shape(inputs)[-1]
    kernel_shape = (in_features, self.features)
    kernel_meta = self._kernel_metadata(kernel_shape)
    kernel = self.variable(
      FORGE_COLLECTION,
      "kernel",
      lambda: self.kernel_init(
        self.make_rng("params"), kernel_shape, self.param_dtype
      ),
    ).value
    opt_state = self.variable(
      FORGE_COLLECTION, "opt_state", self._init_state, kernel, kernel_meta
    ).value
    count, skipped, intact, grad_sq_norm = (
      self.variable(
        FORGE_COLLECTION, name, jnp.full, (), value, jnp.float32
      ).value
      for name, value in (
        ("count", 0.0),
        ("skipped", 0.0),
        ("intact", 1.0),
        ("grad_sq_norm", 0.0),
      )
    )
    bias = (
      self.param("bias", self.bias_init, (self.features,), self.param_dtype)
      if self.use_bias
      else None
    )
    variables = ForgeVariables(
      kernel, opt_state, count, skipped, intact, grad_sq_norm
    )
    context = layer_context.stacked_layer()
    stacked = (
      context if context is not None and context.index is not None else None
    )
    self._check_variables(
      variables,
      _stacked_shapes(
        jax.eval_shape(
          functools.partial(init_variables, self.optimizer),
          jax.ShapeDtypeStruct(kernel_shape, self.param_dtype),
        ),
        stacked,
      ),
      stacked,
    )
    layer_index = None if stacked is None else stacked.index
    self._check_single_use(kernel)
    path = (context.path if context is not None else ()) + tuple(self.path)
    if not self.is_initializing():
      transform = _stacking_transform(self.scope) if context is None else None
      if transform is not None:
        _warn_stacked(path, transform)
      layer_context.record(path, layer_context.FORWARD, self.optimizer)
    spec = FusedDenseSpec(
      optimizer=self.optimizer,
      implementation=self.implementation,
      precision=self.precision,
      dtype=self.dtype,
      layer_id=self._layer_id(),
      path=path,
    )
    layout = self._layout(inputs, kernel_meta)
    if layout is None:
      return forge_dense(inputs, variables, bias, spec, layer_index)
    return forge_dense(
      inputs,
      variables,
      bias,
      spec,
      layer_index,
      layout,
      where=f"ForgeDense {self.path!r}",
    )

  def _check_collection(self):
    """FORGE's collection must come with the variables: flax's own error
    (``ScopeCollectionNotFound``) points the wrong way."""
    if (
      self.is_initializing()
      or self.has_variable(FORGE_COLLECTION, "kernel")
      or self.is_mutable_collection(FORGE_COLLECTION)
    ):
      return
    raise ValueError(
      f"ForgeDense {'/'.join(self.path)!r} has no variables in the "
      f"{FORGE_COLLECTION!r} collection, where FORGE keeps its kernel and "
      "optimizer state. Keep the whole variables dict that init returns: "
      "fj.TrainState.create(apply_fn=model.apply, params=variables, tx=...) "
      "(not variables['params']), and apply the model with all of it, "
      "model.apply(state.params, ...)."
    )

  def _kernel_metadata(self, kernel_shape):
    """The partitioning box ``kernel_init`` wraps the kernel in, or None."""
    boxed = jax.eval_shape(
      lambda: self.kernel_init(
        jax.random.key(0), kernel_shape, self.param_dtype
      )
    )
    return boxed if isinstance(boxed, nn.Partitioned) else None

  def _init_state(self, kernel, kernel_meta):
    """The optimizer state; with the kernel's partitioning box on every leaf
    that follows the kernel (kernel-shaped, int8 block scales), so that it is
    sharded exactly like the kernel."""
    state = self.optimizer.init(kernel)
    if kernel_meta is None:
      return state
    follows = lambda leaf: parallel.follows_kernel(
      jnp.shape(leaf), jnp.shape(kernel)
    )
    return jax.tree.map(
      lambda leaf: kernel_meta.replace_boxed(leaf) if follows(leaf) else leaf,
      state,
    )

  def _layout(self, inputs, kernel_meta) -> Optional[parallel.ShardedLayout]:
    """The per-shard layout, or None for the single-device op."""
    if (
      kernel_meta is None
      and self.mesh is None
      and self.input_partitioning is None
      and self.output_partitioning is None
    ):
      return None
    mesh = (
      self.mesh if self.mesh is not None else getattr(kernel_meta, "mesh", None)
    )
    if mesh is None:
      context = jax.sharding.get_abstract_mesh()
      if context.empty:
        return None  # no mesh: inert annotations, as for nn.Dense
      mesh = context
    if isinstance(kernel_meta, nn.LogicallyPartitioned):
      resolve = lambda names: nn.logical_to_mesh_axes(names, kernel_meta.rules)
    else:
      resolve = lambda names: P(*names)
    kernel_spec = (
      resolve(kernel_meta.names) if kernel_meta is not None else P(None, None)
    )
    x_spec, y_spec = (
      None if names is None else resolve(tuple(names))
      for names in (self.input_partitioning, self.output_partitioning)
    )
    if x_spec is None and parallel.is_explicit(mesh):
      # Explicit axes: the input's type says how it is sharded.
      x_spec = getattr(jax.typeof(inputs).sharding, "spec", None)
    return parallel.plan_layout(
      mesh,
      jnp.ndim(inputs),
      kernel_spec,
      x_spec,
      y_spec,
      self.data_parallel,
      where=f"ForgeDense {self.path!r}",
    )

  def _layer_id(self) -> int:
    if self.optimizer.weight_rounding != "stochastic":
      return 0  # unused: keep the spec (and its jit cache key) as before
    if self.layer_id is not None:
      return int(self.layer_id) & 0xFFFFFFFF
    return quantization.layer_id_from_path(self.path)

  def _check_variables(
    self,
    variables: ForgeVariables,
    expected: ForgeVariables,
    stacked: Optional[layer_context.StackedLayer],
  ):
    """Shapes and dtypes as init made them: a transformed copy would receive
    the new weights through the transformation's transpose."""
    actual = jax.tree.map(
      lambda x: (jnp.shape(x), jnp.result_type(x)), variables
    )
    wanted = jax.tree.map(
      lambda x: (jnp.shape(x), jnp.result_type(x)), expected
    )
    if (
      jax.tree.structure(actual) != jax.tree.structure(wanted)
      or actual != wanted
    ):
      if stacked is not None:
        raise TypeError(
          f"ForgeDense {self.path!r}: its variables are {actual} but "
          f"{wanted} was expected: fj.scan's backward hands every "
          f"ForgeDense of the block its variables stacked over the "
          f"{stacked.length} layers, so the block must use them as they "
          "come (no nn.scan, nn.vmap or fj.scan over ForgeDense inside "
          "it)."
        )
      raise TypeError(
        f"ForgeDense {self.path!r}: its variables are {actual} but "
        f"{wanted} was expected for param_dtype={self.param_dtype} and "
        f"{self.optimizer!r}. The variables were changed before apply (a "
        "cast, or another optimizer's state): FORGE writes the updated "
        "weights back through whatever produced them, so pass them as "
        "init created them."
      )

  def _check_single_use(self, kernel):
    # The cotangent of a kernel used twice would be the sum of two updated
    # kernels. Module instances live for one trace, and so does the tracer.
    previous = getattr(self, "_forge_kernel_in_use", None)
    if previous is not None and previous is kernel:
      raise ValueError(
        f"ForgeDense {self.path!r} was called twice in one forward pass. "
        "FORGE updates the kernel inside each call's backward, so a shared "
        "kernel would receive two updates summed together. Use one "
        "ForgeDense per use, or nn.Dense for shared weights."
      )
    object.__setattr__(self, "_forge_kernel_in_use", kernel)


def _stacked_shapes(variables, stacked: Optional[layer_context.StackedLayer]):
  """``variables``' shapes, on a leading layer axis when ``stacked``."""
  if stacked is None:
    return variables
  return jax.tree.map(
    lambda v: jax.ShapeDtypeStruct((stacked.length,) + v.shape, v.dtype),
    variables,
  )


def wiped_layers(variables) -> list[str]:
  """Paths of ForgeDense layers whose variables were overwritten with zeros.

  A layer whose output does not reach the loss in a step receives zero
  cotangents; an overwrite-with-gradient step then stores zeros, and the
  layer's next backward pass makes its kernel NaN. Call this on the host to
  name them. Layers stacked by ``nn.scan`` are named ``path[i]``.
  """
  collection = variables.get(FORGE_COLLECTION, {})
  wiped = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(collection)[0]:
    if not path or getattr(path[-1], "key", None) != "intact":
      continue
    name = "/".join(str(getattr(k, "key", k)) for k in path[:-1])
    flags = np.asarray(jax.device_get(leaf))
    if flags.ndim == 0:
      wiped += [name] if flags == 0.0 else []
    else:
      wiped += [
        f"{name}[{i}]" for i in np.flatnonzero(flags.reshape(-1) == 0.0)
      ]
  return wiped
