"""``ForgeDense`` and ``ForgeDenseGeneral``: drop-ins for ``flax.linen.Dense``
and ``flax.linen.DenseGeneral`` that train themselves."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from flax.linen.dtypes import promote_dtype
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax.sharding import PartitionSpec as P

from forge_jax import layer_context, parallel, quantization
from forge_jax.ops.fused_dense import (
  Factors,
  ForgeVariables,
  FusedDenseSpec,
  factor_shapes,
  forge_dense,
  init_variables,
  one_hot_lookup,
  one_hot_precision,
  poisoned,
)
from forge_jax.optimizers import ForgeOptimizer, not_elementwise_message

#: The collection that holds every ForgeDense kernel and optimizer state.
#: ``flax.training.train_state.TrainState.apply_gradients`` overwrites it with
#: its "gradient", which FORGE's backward makes the updated variables.
FORGE_COLLECTION = OVERWRITE_WITH_GRADIENT

#: The transient collection through which exact clipping's deferred pass
#: receives each ForgeDense's factors (:mod:`forge_jax.clipping`): per
#: layer, zeros ``{'x': [tokens, K], 'dy': [tokens, N]}`` whose cotangents
#: are the factors. Built for one gradient call; never stored in a state.
FACTORS_COLLECTION = "forge_factors"


class ForgeMemoryWarning(UserWarning):
  """A ForgeDense trains correctly but holds more memory than it needs to.

  Silence it with
  ``warnings.filterwarnings('ignore', category=fj.ForgeMemoryWarning)``.
  """


#: Flax transforms that stack or map a ForgeDense's variables. Their
#: transpose builds new buffers for every cotangent, so the updated kernels
#: and states of all layers exist beside the old ones until the step ends.
_STACKING_TRANSFORMS = ("scan", "vmap", "map_variables")


def _transform_names(part: str) -> list[str]:
  """The flax transforms named in one part of a scope's debug path,
  outermost first ("remat(map_variables(Dense_0))": remat, map_variables)."""
  return re.findall(r"(\w+)\(", part)


def _stacking_transform(scope) -> Optional[str]:
  """The first stacking transform on the module's scope path, or None."""
  for part in getattr(scope, "debug_path", ()):
    names = _transform_names(part)
    for name in _STACKING_TRANSFORMS:
      if name in names:
        return name
  return None


def _lifted_transforms(scope) -> list[str]:
  """The names of the flax transforms on the module's scope path, outermost
  first."""
  return [
    name
    for part in getattr(scope, "debug_path", ())
    for name in _transform_names(part)
  ]


def _containers_hint(actual, wanted) -> str:
  """Why variables with the expected arrays but another structure differ:
  a checkpoint restored without a target brings optimizer states back as
  dicts, not their NamedTuples."""
  if jax.tree.leaves(actual) != jax.tree.leaves(wanted):
    return ""
  return (
    " Its arrays are the expected ones in other containers (dicts in "
    "place of the optimizer state's NamedTuples): restored from a "
    "checkpoint without a target? Restore into the state's structure: "
    "forge_jax.checkpoint.restore(path, abstract_state), or orbax's "
    "restore(path, abstract_state)."
  )


#: flax's default product, which ``dot_general=None`` computes.
DEFAULT_DOT_GENERAL = jax.lax.dot_general


def check_products(where: str, flax_layer: str, fields) -> None:
  """Refuses the first of ``fields`` (``(name, value, defaults)``) whose
  value is none of its ``defaults``: FORGE computes the product, its dtype
  promotion and its weight gradient itself, as flax's defaults do, so a
  custom one would be silently ignored."""
  for name, value, defaults in fields:
    if all(value is not default for default in defaults):
      raise ValueError(
        f"{where}: a custom {name} is not supported: FORGE computes the "
        "product and its weight gradient itself (the fused op's "
        "dot_general, or a Pallas kernel), promoting dtypes as flax does. "
        f"Leave it at its default, or use {flax_layer} for this layer."
      )


def _applied_kernel(module: nn.Module):
  """The FORGE kernel at ``module``'s path in the variables of the
  outermost module being applied, or None. Inside a lifted transform the
  module reads its own copy of that array. Read from flax's module stack,
  which flax keeps private: where it is missing, None."""
  stack = getattr(getattr(nn.module, "_context", None), "module_stack", ())
  top = next((m for m in stack if m is not None), None)
  if top is None or top.scope is None:
    return None
  node = top.variables.get(FORGE_COLLECTION)
  path = tuple(module.path)
  if node is None or path[: len(top.path)] != tuple(top.path):
    return None
  for name in path[len(top.path) :] + ("kernel",):
    node = node.get(name) if isinstance(node, Mapping) else None
  return node


def _warn_stacked(path, transform: str, layer: str):
  if transform == "map_variables":
    how = (
      "It trains correctly where trans_in_fn passes its kernel unchanged, "
      "but the transpose of nn.map_variables"
    )
    fix = "the layer outside nn.map_variables"
  else:
    shared = (
      "its backward raises"
      if transform == "vmap"
      else "it takes the sum of their updates and is poisoned (see "
      "fj.wiped_layers)"
    )
    how = (
      "With its variables broadcast (variable_axes None, "
      "variable_broadcast: one kernel for every iteration) "
      f"{shared}: use nn.Dense for a shared kernel. With its variables "
      f"stacked it trains correctly, but the transpose of nn.{transform}"
    )
    fix = (
      "fj.scan(...) with the same arguments instead of nn.scan(...)"
      if transform == "scan"
      else "fj.scan over the layers (or unrolled layers) instead of "
      f"nn.{transform}"
    )
  warnings.warn(
    f"{layer} {'/'.join(path)!r} runs inside nn.{transform}. {how} keeps "
    "the updated kernels and optimizer states of all layers beside the old "
    "ones until the step ends, which costs more memory than optax. Write "
    f"{fix} to update them in place. (Silence with "
    "warnings.filterwarnings('ignore', category=fj.ForgeMemoryWarning).)",
    ForgeMemoryWarning,
    stacklevel=5,
  )


class _ForgeLinear(nn.Module):
  """What ForgeDense and ForgeDenseGeneral share: the FORGE variables of one
  kernel, their checks, and the fused op on the kernel's ``[K, N]`` view.

  A subclass's ``__call__`` brings its input to ``[..., K]`` and calls
  :meth:`_fused` with the kernel's stored shape (the first ``in_rank``
  dimensions make ``K``, the others ``N``); it has the fields ``optimizer``,
  ``param_dtype``, ``precision``, ``dtype``, ``implementation``,
  ``layer_id``, ``mesh`` and ``data_parallel``.
  """

  #: What a mesh axis that shards neither the kernel nor a declared input
  #: should prompt, for a layer without ``input_partitioning`` (``{axis}``:
  #: the axis); None: declare ``input_partitioning``.
  undeclared_input_advice: ClassVar[Optional[str]] = None
  #: The name flax's own layer keeps the weight under (checks of tx and of
  #: weight-decay masks ask about a leaf so named).
  twin_weight: ClassVar[str] = "kernel"
  #: flax's layer this one replaces, for error messages.
  flax_twin: ClassVar[str] = "nn.Dense"

  def _check_product(self):
    """Refuses a custom product of flax's fields (:func:`check_products`)."""
    check_products(
      self._where(),
      f"flax's {self.flax_twin}",
      (
        (
          "dot_general",
          getattr(self, "dot_general", None),
          (None, DEFAULT_DOT_GENERAL),
        ),
        ("dot_general_cls", getattr(self, "dot_general_cls", None), (None,)),
        ("promote_dtype", self.promote_dtype, (promote_dtype,)),
      ),
    )

  def _fused(
    self,
    inputs: jax.Array,
    kernel_shape: tuple,
    in_rank: int,
    init_kernel,
    make_bias,
    input_names: Optional[tuple] = None,
    output_names: Optional[tuple] = None,
  ) -> jax.Array:
    """``inputs [..., K] @ kernel view [K, N] + bias [N]``, FORGE-trained.

    ``init_kernel(rng)`` makes the kernel in ``kernel_shape`` (boxed with
    one partitioning name per dimension, or plain); ``make_bias()`` creates
    the bias parameter as ``[N]`` (or returns None). ``input_names`` and
    ``output_names`` partition ``[..., K]`` and ``[..., N]``.
    """
    if not isinstance(self.optimizer, ForgeOptimizer):
      raise TypeError(not_elementwise_message(self.optimizer))
    self._check_collection()
    view = _kernel_view_shape(kernel_shape, in_rank)
    view_meta = self._view_metadata(init_kernel, kernel_shape, in_rank)
    kernel = self.variable(
      FORGE_COLLECTION,
      "kernel",
      lambda: init_kernel(self.make_rng("params")),
    ).value
    # Stored on the [K, N] view: the int8 block scales are [K, N / 64].
    opt_state = self.variable(
      FORGE_COLLECTION,
      "opt_state",
      lambda: self._init_state(jnp.reshape(kernel, view), view_meta),
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
    bias = make_bias()
    variables = ForgeVariables(
      kernel, opt_state, count, skipped, intact, grad_sq_norm
    )
    context = layer_context.stacked_layer()
    stacked = (
      context if context is not None and context.index is not None else None
    )
    expected = jax.eval_shape(
      functools.partial(init_variables, self.optimizer),
      jax.ShapeDtypeStruct(view, self.param_dtype),
    )
    expected = expected._replace(
      kernel=jax.ShapeDtypeStruct(kernel_shape, self.param_dtype)
    )
    self._check_variables(
      variables, _stacked_shapes(expected, stacked), stacked
    )
    inner = _stacking_transform(self.scope)
    if stacked is not None and inner is not None:
      raise NotImplementedError(
        f"{self._where()} runs inside nn.{inner} "
        "within fj.scan's block: fj.scan hands each ForgeDense of its block "
        "the whole stacks of its own layer axis, which an inner scan or vmap "
        "would slice as its own. Use the inner layers directly in the block "
        "(one fj.scan over all of them), or nn.scan for the outer stack."
      )
    layer_index = None if stacked is None else stacked.index
    self._check_single_use(kernel)
    path = (context.path if context is not None else ()) + tuple(self.path)
    transform = None
    if not self.is_initializing():
      transform = inner if context is None else None
      if transform == "map_variables":
        self._check_kernel_unmapped(kernel)
      if transform is not None:
        _warn_stacked(path, transform, type(self).__name__)
      conditional = layer_context.record_forward(
        path, self.optimizer, self.twin_weight
      )
      if context is None and transform is None and not conditional:
        self._check_single_lifted_use(path, kernel)
    spec = FusedDenseSpec(
      optimizer=self.optimizer,
      implementation=self.implementation,
      precision=self.precision,
      dtype=self.dtype,
      layer_id=self._layer_id(),
      path=path,
    )
    # The kernel as stored: the op views it as [K, N] (a reshape, no copy)
    # and returns the updated kernel in the stored shape.
    layout = self._layout(inputs, view_meta, input_names, output_names)
    # A layer can defer its update out of the backward pass in place in
    # fj.scan's stacks or on its own, not under a layout (its update runs
    # per shard) or in a transform that slices its variables.
    can_defer = layout is None and (
      stacked is not None or (context is None and transform is None)
    )
    sink = self._factor_sink(
      path,
      spec,
      inputs,
      jax.ShapeDtypeStruct(view, jnp.result_type(kernel)),
      bias,
      stacked,
      can_defer,
    )
    return forge_dense(
      inputs,
      variables,
      bias,
      spec,
      layer_index,
      layout,
      where=self._where(),
      factors=sink,
    )

  def _where(self) -> str:
    return f"{type(self).__name__} {'/'.join(self.path)!r}"

  def _factor_sink(
    self, path, spec, inputs, kernel, bias, stacked, can_defer
  ) -> Optional[Factors]:
    """The layer's factor sink from :data:`FACTORS_COLLECTION` (None when
    there is none, or when the layer cannot defer its update). While
    exact clipping discovers the layers, declares the layer instead
    (:func:`forge_jax.layer_context.declare`)."""
    if self.is_initializing():
      return None
    if layer_context.is_discovering():
      length = None if stacked is None else stacked.length
      factors = None
      if can_defer:
        factors = factor_shapes(inputs, kernel, bias, spec)
        if length is not None:
          factors = Factors(
            *(
              jax.ShapeDtypeStruct((length,) + f.shape, f.dtype)
              for f in factors
            )
          )
      layer_context.declare(
        path,
        layer_context.DeferrableLayer(spec, factors, length, can_defer),
      )
      return None
    # The sink's leaves are named as Factors' fields ('x', 'dy').
    if not can_defer or not self.has_variable(FACTORS_COLLECTION, "x"):
      return None
    return Factors(
      *(self.get_variable(FACTORS_COLLECTION, name) for name in Factors._fields)
    )

  def _check_collection(self):
    """FORGE's collection must come with the variables: flax's own error
    (``ScopeCollectionNotFound``) points the wrong way."""
    if self.has_variable(FORGE_COLLECTION, "kernel"):
      return
    if self.is_initializing() and not self.is_mutable_collection(
      FORGE_COLLECTION
    ):
      raise ValueError(
        f"{self._where()} is initialized inside a lifted transformation "
        "(nn.scan, nn.vmap, ...) that does not lift FORGE's collection "
        f"{FORGE_COLLECTION!r}, where FORGE keeps its kernel and optimizer "
        "state: list it in variable_axes beside 'params' (variable_axes="
        f"{{'params': 0, {FORGE_COLLECTION!r}: 0}}), or lift every "
        "collection (variable_axes={True: 0}). fj.scan adds it to a "
        "variable_axes that names 'params'. That gives each iteration a "
        "kernel of its own: where the iterations share one kernel (a "
        "recurrent cell; nn.RNN broadcasts 'params'), use nn.Dense, since "
        "a FORGE kernel steps once a use and a shared one would take the "
        "sum of every iteration's update."
      )
    if self.is_initializing() or self.is_mutable_collection(FORGE_COLLECTION):
      return
    context = layer_context.stacked_layer()
    if context is not None:
      # fj.scan hands its block the stacks of the block's own layers only.
      raise ValueError(
        f"{self._where()} is called inside the block of fj.scan "
        f"{'/'.join(context.path)!r} but is not one of its layers (a module "
        "made outside the block and passed in, or closed over), so it has "
        "no stacks there. Create it inside the block (a layer per "
        "iteration), or call it outside the scan."
      )
    raise ValueError(
      f"{self._where()} has no variables in the "
      f"{FORGE_COLLECTION!r} collection, where FORGE keeps its kernel and "
      "optimizer state. Keep the whole variables dict that init returns: "
      "fj.TrainState.create(apply_fn=model.apply, params=variables, tx=...) "
      "(not variables['params']), and apply the model with all of it, "
      "model.apply(state.params, ...)."
    )

  def _view_metadata(self, init_kernel, kernel_shape, in_rank):
    """The partitioning box ``init_kernel`` wraps the kernel in, its names
    merged onto the ``[K, N]`` view; None for a plain kernel."""
    boxed = jax.eval_shape(lambda: init_kernel(jax.random.key(0)))
    if not isinstance(boxed, nn.Partitioned):
      return None
    groups = (tuple(range(in_rank)), tuple(range(in_rank, len(kernel_shape))))
    names = _merge_partitioning(
      boxed.names,
      groups,
      partition_resolver(boxed),
      f"{self._where()}: the kernel {tuple(kernel_shape)}",
    )
    return boxed.replace(names=names)

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

  def _layout(
    self, inputs, kernel_meta, input_names, output_names
  ) -> Optional[parallel.ShardedLayout]:
    """The per-shard layout, or None for the single-device op."""
    if (
      kernel_meta is None
      and self.mesh is None
      and input_names is None
      and output_names is None
    ):
      return None
    mesh = (
      self.mesh if self.mesh is not None else getattr(kernel_meta, "mesh", None)
    )
    if _unresolved_logical_names(kernel_meta) and (
      mesh is not None or not jax.sharding.get_abstract_mesh().empty
    ):
      raise ValueError(
        f"{self._where()}: its kernel is partitioned with the logical names "
        f"{tuple(kernel_meta.names)} under a mesh, and no rules resolve them "
        "(none in nn.with_logical_partitioning, no nn.logical_axis_rules "
        "around apply). They would resolve to no mesh axis: the layer would "
        "gather its kernel and optimizer state whole on every device and "
        "return them replicated. Apply the model under the rules it was "
        "initialized with (with nn.logical_axis_rules(rules): ...), or give "
        "the box its rules (nn.with_logical_partitioning(init, names, "
        "rules=rules))."
      )
    return parallel.layer_layout(
      inputs,
      mesh,
      kernel_meta.names if kernel_meta is not None else (None, None),
      input_names,
      output_names,
      partition_resolver(kernel_meta),
      self.data_parallel,
      where=self._where(),
      refuse_undeclared_input=not self.is_initializing(),
      undeclared_advice=self.undeclared_input_advice,
    )

  def _layer_id(self) -> int:
    if not self.optimizer.draws_random_bits:
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
          f"{self._where()}: its variables are {actual} but "
          f"{wanted} was expected: fj.scan's backward hands every "
          f"ForgeDense of the block its variables stacked over the "
          f"{stacked.length} layers, so the block must use them as they "
          "come (no nn.scan, nn.vmap or fj.scan over ForgeDense inside "
          "it)."
        )
      raise TypeError(
        f"{self._where()}: its variables are {actual} but "
        f"{wanted} was expected for param_dtype={self.param_dtype} and "
        f"{self.optimizer!r}. The variables were changed before apply (a "
        "cast, or another optimizer's state): FORGE writes the updated "
        "weights back through whatever produced them, so pass them as "
        "init created them." + _containers_hint(actual, wanted)
      )

  def _check_kernel_unmapped(self, kernel):
    # Under nn.map_variables alone the layer reads the array the outermost
    # apply holds unless trans_in_fn changed it; other lifted transforms
    # (remat, jit) hand the layer a copy either way, so with them nothing
    # tells the two apart.
    applied = _applied_kernel(self)
    if (
      set(_lifted_transforms(self.scope)) == {"map_variables"}
      and layer_context.is_differentiated(applied)
      and applied is not kernel
      and not layer_context.is_discovering()
    ):
      raise ValueError(
        f"{self._where()} reads a kernel that nn.map_variables changed "
        "(its trans_in_fn maps FORGE's collection): FORGE steps the kernel "
        "the layer reads and writes the result back through the "
        "transform's transpose, so the stored kernel would not take the "
        "optimizer's step. Map the layer's inputs or outputs instead, or "
        "use flax's layer for a reparameterized kernel (weight scaling, "
        "weight norm)."
      )

  def _check_single_lifted_use(self, path, kernel):
    # Inside nn.remat, nn.jit and other lifted transforms each call reads
    # its own copy of the kernel; the array the outermost apply holds at
    # this path tells two calls of one layer from two layers.
    applied = _applied_kernel(self)
    if (
      layer_context.is_differentiated(applied)
      and applied is not kernel
      and not layer_context.is_discovering()
      and layer_context.record_lifted_forward(path, applied)
    ):
      raise ValueError(
        f"{self._where()} was called twice in one loss through a lifted "
        "transform (nn.remat, nn.checkpoint, nn.jit, ...: a block applied "
        "repeatedly, as in ALBERT or a universal transformer). FORGE "
        "updates the kernel inside each call's backward, so a shared "
        "kernel would receive the updates summed together. Use one "
        f"{type(self).__name__} per use (fj.scan for repeated blocks), or "
        "flax's layer for shared weights."
      )

  def _check_single_use(self, kernel):
    # The cotangent of a kernel used twice would be the sum of two updated
    # kernels. Module instances live for one trace, and so does the tracer.
    # Inference (eager, jitted, or a bound module's setup() layers, which
    # outlive each call) may call a layer as often as it likes. So may
    # init inside a branch: flax's compact nn.cond / nn.switch calls every
    # branch's layers once before the conditional. And init inside
    # nn.while_loop, whose body calls the layers that init called before
    # the loop (a while loop is not differentiated in reverse).
    previous = getattr(self, "_forge_kernel_in_use", None)
    if (
      previous is not None
      and previous is kernel
      and (
        layer_context.is_differentiated(kernel)
        or (
          self.is_initializing()
          and not layer_context.in_lax_branch()
          and not layer_context.in_lax_while_loop()
        )
      )
    ):
      raise ValueError(
        f"{self._where()} was called twice in one forward pass. "
        "FORGE updates the kernel inside each call's backward, so a shared "
        f"kernel would receive two updates summed together. Use one "
        f"{type(self).__name__} per use, or flax's layer for shared weights."
      )
    object.__setattr__(self, "_forge_kernel_in_use", kernel)


class ForgeDense(_ForgeLinear):
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
    promote_dtype, dot_general, dot_general_cls: flax's defaults only (a
      custom product is refused: FORGE computes the product itself).
    implementation: 'auto' (the fastest backend that applies), 'xla' (the
      reference), 'triton' (the Pallas-Triton kernel) or 'mosaic' (the
      Mosaic GPU kernel, Hopper and newer); the kernels run in Pallas
      interpret mode off-GPU.
    layer_id: static id that seeds stochastic rounding (an optimizer with
      ``weight_rounding='stochastic'`` or ``second_moment_bits=4``); None:
      a CRC-32 of the module path.
    mesh: the device mesh for tensor / sequence parallelism; None: the
      ``mesh`` of the kernel's partitioning metadata, else the mesh set with
      ``jax.set_mesh``. Without any mesh the partitioning is inert (as for
      ``nn.Dense``) and the layer runs as on one device; a mesh other than
      ``jax.set_mesh``'s raises.
    input_partitioning: names of the input's dimensions (mesh axes, or
      logical names when the kernel uses ``nn.with_logical_partitioning``,
      resolved with the same rules: the box's, else those of
      ``nn.logical_axis_rules``; under a mesh, logical names that no rules
      resolve raise). None: tokens not sharded, features
      sharded like the kernel's in_features. Tokens sharded over the
      kernel's feature axis are all-gathered (sequence parallelism).
    output_partitioning: names of the output's dimensions. None: tokens as
      the input's after the gather, features like the kernel's; a token
      dimension that adds the kernel's in_features axis receives a
      reduce-scatter instead of an all-reduce (sequence parallelism).
    data_parallel: 'auto' (default): a mesh axis that shards the input's
      tokens and the kernel is FSDP (the kernel gathered just in time, its
      gradient reduce-scattered, the shard updated); an axis that shards the
      tokens but not the kernel raises ``parallel.DataParallelError``.
      'psum' all-reduces ``dW`` over such axes instead (materializes
      ``dW``); 'error' refuses any token axis outside sequence parallelism.
      See :mod:`forge_jax.parallel`.

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
  data_parallel: str = "auto"
  promote_dtype: Any = promote_dtype
  dot_general: Any = None
  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    self._check_product()
    kernel_shape = (jnp.shape(inputs)[-1], self.features)
    return self._fused(
      inputs,
      kernel_shape,
      1,
      lambda rng: self.kernel_init(rng, kernel_shape, self.param_dtype),
      lambda: (
        self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        if self.use_bias
        else None
      ),
      self.input_partitioning,
      self.output_partitioning,
    )


class ForgeEmbed(_ForgeLinear):
  """``nn.Embed`` whose backward pass applies the optimizer step in place.

  The lookup is the product of the tokens' one-hot rows with the table, so
  the table is a ForgeDense kernel ``[num_embeddings, features]`` (at
  ``_overwrite_with_gradient/<module>/kernel``) and its gradient, summed
  over the tokens in float32, never exists: ``nn.Embed`` + optax hold a
  table-sized gradient at the end of the backward pass. The one-hot input
  ``[tokens, num_embeddings]`` in the compute dtype is kept for the
  backward instead, so it saves memory while the tokens of a step are
  fewer than ``features``. The product costs ``2 * tokens * num_embeddings * features`` flops in
  each direction, as a head of the same size does.

  ``fj.from_dense`` takes an ``nn.Embed``'s ``embedding`` for its table;
  ``fj.to_dense`` writes it back as ``embedding`` (auto-named, or listed in
  its ``embeddings``). Looked-up rows
  are the table's bits (a float32 table's product runs at
  ``Precision.HIGHEST``). A token that appears once in a step steps its row
  as ``nn.Embed`` + optax would; repeated tokens' gradients are summed in
  float32 (``nn.Embed`` sums them in the table's dtype). Tokens index as in
  ``nn.Embed``: negative ones count from the end, others outside the table
  look up NaN rows.

  Attributes:
    num_embeddings: the number of rows (the vocabulary).
    features: the width of each row.
    optimizer: the elementwise optimizer FORGE fuses into the backward pass.
    dtype: the dtype of the looked-up rows (default: ``param_dtype``).
    param_dtype: the dtype of the table and the optimizer state default.
    embedding_init: initializer of the table (``nn.Embed``'s default).
    implementation, layer_id, mesh, data_parallel: as for
      :class:`ForgeDense`.
    promote_dtype: flax's default only (a custom one is refused).
  """

  num_embeddings: int
  features: int
  optimizer: ForgeOptimizer
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  embedding_init: Any = nn.linear.default_embed_init
  implementation: str = "auto"
  layer_id: Optional[int] = None
  mesh: Optional[Any] = None
  data_parallel: str = "auto"
  promote_dtype: Any = promote_dtype

  twin_weight: ClassVar[str] = "embedding"
  flax_twin: ClassVar[str] = "nn.Embed"
  undeclared_input_advice: ClassVar[str] = (
    "ForgeEmbed has no input_partitioning: shard the table over {axis!r} "
    "too, embedding_init=nn.with_partitioning(init, ({axis!r}, None)) (each "
    "device then steps the rows it holds, for every token of the batch), "
    "keep the tokens replicated over it, or train the table with nn.Embed "
    "and tx=fj.optax_with_storage(opt)."
  )

  @property
  def precision(self):
    return one_hot_precision(self._compute_dtype)

  @property
  def _compute_dtype(self):
    return self.param_dtype if self.dtype is None else self.dtype

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    self._check_product()
    table_shape = (self.num_embeddings, self.features)
    return one_hot_lookup(
      inputs,
      self.num_embeddings,
      self._compute_dtype,
      lambda one_hot: self._fused(
        one_hot,
        table_shape,
        1,
        lambda rng: self.embedding_init(rng, table_shape, self.param_dtype),
        lambda: None,
      ),
      self._where(),
    )

  def attend(self, query: jax.Array) -> jax.Array:
    raise NotImplementedError(
      f"{self._where()}.attend: a head tied to a ForgeEmbed table would "
      "return its gradient to the table, which FORGE updates in the "
      "lookup's backward pass alone. Use nn.Embed for tied embeddings."
    )


class ForgeDenseGeneral(_ForgeLinear):
  """``nn.DenseGeneral`` whose backward pass applies the optimizer step.

  The fields are ``nn.DenseGeneral``'s (same order), plus the keyword-only
  ``optimizer`` and ForgeDense's ``implementation``, ``layer_id``, ``mesh``,
  ``input_partitioning``, ``output_partitioning`` and ``data_parallel``. The
  kernel keeps ``nn.DenseGeneral``'s shape ``[*contracted dims, *features]``
  (and is initialized as it is, from ``kernel_init`` on the flattened
  shape), at ``_overwrite_with_gradient/<module>/kernel``; the bias stays at
  ``params/<module>/bias``, shaped ``features``.

  The fused op sees the kernel as ``[K, N]`` (K the product of the
  contracted dimensions, N of the features), a reshape without a copy, and
  the input as ``[..., K]`` (the contracted axes moved last, in order, and
  merged). The optimizer state is stored on that view: kernel-shaped leaves
  are ``[K, N]``, int8 block scales ``[K, ceil(N / 64)]``.

  Partitioning names one mesh (or logical) axis per dimension of the
  stored kernel, input and output, as for ``nn.DenseGeneral``; the merged
  dimensions of the view take the name of their outermost dimension, and
  the inner ones must not be sharded (``(None, 'model', None)`` for a
  query kernel ``[embed, heads, head_dim]`` shards the heads, and with them
  contiguous blocks of N). The state gets the view's names.

  Attributes:
    features: int or tuple of output features.
    axis: int or tuple of the input axes contracted.
    batch_dims: must be empty: a kernel per batch entry is a batched
      matmul, not the one GEMM whose backward FORGE fuses.
    use_bias, dtype, param_dtype, kernel_init, bias_init, precision: as for
      ``nn.DenseGeneral``.
    promote_dtype, dot_general, dot_general_cls: flax's defaults only (a
      custom product is refused: FORGE computes the product itself).
    optimizer, implementation, layer_id, mesh, input_partitioning,
      output_partitioning, data_parallel: as for :class:`ForgeDense`.
  """

  flax_twin: ClassVar[str] = "nn.DenseGeneral"

  features: int | Sequence[int]
  axis: int | Sequence[int] = -1
  batch_dims: Sequence[int] = ()
  use_bias: bool = True
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros_init()
  precision: Any = None
  promote_dtype: Any = promote_dtype
  dot_general: Any = None
  dot_general_cls: Any = None
  optimizer: ForgeOptimizer = dataclasses.field(kw_only=True)
  implementation: str = "auto"
  layer_id: Optional[int] = None
  mesh: Optional[Any] = None
  input_partitioning: Optional[tuple] = None
  output_partitioning: Optional[tuple] = None
  data_parallel: str = "auto"

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    self._check_fields()
    features = _as_tuple(self.features)
    ndim = jnp.ndim(inputs)
    axis = self._contracted_axes(jnp.shape(inputs))
    free = tuple(d for d in range(ndim) if d not in axis)
    contracted = tuple(jnp.shape(inputs)[a] for a in axis)
    free_shape = tuple(jnp.shape(inputs)[d] for d in free)
    kernel_shape = contracted + features
    k, n = math.prod(contracted), math.prod(features)

    def init_kernel(rng):
      # As nn.DenseGeneral: initialized as [K, N], then reshaped; a box's
      # names are the stored shape's, so no constraint on the [K, N] value.
      kernel = self.kernel_init(rng, (k, n), self.param_dtype)
      if isinstance(kernel, nn.Partitioned):
        return kernel.replace_boxed(jnp.reshape(kernel.value, kernel_shape))
      if isinstance(kernel, meta.AxisMetadata):
        return meta.replace_boxed(
          kernel, jnp.reshape(kernel.unbox(), kernel_shape)
        )
      return jnp.reshape(kernel, kernel_shape)

    def make_bias():
      if not self.use_bias:
        return None

      def init_bias(rng, shape, dtype):
        bias = self.bias_init(rng, (n,), dtype)  # as nn.DenseGeneral
        if isinstance(bias, nn.Partitioned):
          return bias.replace_boxed(jnp.reshape(bias.value, shape))
        return jnp.reshape(bias, shape)

      bias = self.param("bias", init_bias, features, self.param_dtype)
      return jnp.reshape(bias, (n,))

    x = (
      jnp.transpose(inputs, free + axis)
      if free + axis != tuple(range(ndim))
      else inputs
    )
    x = jnp.reshape(x, free_shape + (k,))
    input_names, output_names = None, None
    if (self.input_partitioning, self.output_partitioning) != (None, None):
      resolve = self._names_resolver()
    if self.input_partitioning is not None:
      input_names = _merge_partitioning(
        tuple(self.input_partitioning),
        tuple((d,) for d in free) + (axis,),
        resolve,
        f"{self._where()}: the input {jnp.shape(inputs)}",
      )
    if self.output_partitioning is not None:
      lead = len(free)
      output_names = _merge_partitioning(
        tuple(self.output_partitioning),
        tuple((d,) for d in range(lead))
        + (tuple(range(lead, lead + len(features))),),
        resolve,
        f"{self._where()}: the output",
      )
    y = self._fused(
      x,
      kernel_shape,
      len(axis),
      init_kernel,
      make_bias,
      input_names,
      output_names,
    )
    return jnp.reshape(y, free_shape + features)

  def _check_fields(self):
    if _as_tuple(self.batch_dims):
      raise ValueError(
        f"{self._where()}: batch_dims={self.batch_dims!r} is not "
        "supported: a kernel per batch entry is a batched matmul, not the "
        "one [K, N] GEMM whose backward FORGE fuses. Use nn.DenseGeneral "
        "for this layer."
      )
    self._check_product()

  def _contracted_axes(self, shape) -> tuple:
    """``axis`` as sorted non-negative axes of an input of ``shape``;
    refuses one out of its range (flax's product fails on it) and an axis
    named twice."""
    ndim = len(shape)
    given = _as_tuple(self.axis)
    if any(not -ndim <= a < ndim for a in given):
      raise ValueError(
        f"{self._where()}: axis={self.axis!r} is out of range for an input "
        f"of shape {tuple(shape)} (axes -{ndim} to {ndim - 1})"
      )
    axis = tuple(sorted(a % ndim for a in given))
    if len(set(axis)) != len(axis):
      raise ValueError(
        f"{self._where()}: axis={self.axis!r} names an axis of the input "
        f"of shape {tuple(shape)} twice"
      )
    return axis

  def _names_resolver(self):
    """How input and output names resolve: like the kernel's box's."""
    boxed = jax.eval_shape(
      lambda: self.kernel_init(jax.random.key(0), (1, 1), self.param_dtype)
    )
    return partition_resolver(
      boxed if isinstance(boxed, nn.Partitioned) else None
    )


def _kernel_view_shape(kernel_shape, in_rank: int) -> tuple:
  """``(K, N)``: the fused op's view of a kernel whose first ``in_rank``
  dimensions are contracted."""
  return (
    math.prod(kernel_shape[:in_rank]),
    math.prod(kernel_shape[in_rank:]),
  )


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, Iterable) else (value,)


def _unresolved_logical_names(box) -> bool:
  """Whether ``box`` names logical axes that no rules resolve: none in the
  box and none from ``nn.logical_axis_rules``."""
  return (
    isinstance(box, nn.LogicallyPartitioned)
    and box.rules is None
    and not nn.get_logical_axis_rules()
    and any(name is not None for name in box.names)
  )


def partition_resolver(box):
  """Names -> a mesh PartitionSpec, as ``box`` resolves them."""
  if isinstance(box, nn.LogicallyPartitioned):
    return lambda names: nn.logical_to_mesh_axes(names, box.rules)
  return lambda names: P(*names)


def _merge_partitioning(names, groups, resolve, what: str) -> tuple:
  """One name per group of dimensions (``groups``: tuples of dimension
  indices), for an array whose groups are merged by a reshape.

  A merged dimension is sharded in contiguous blocks exactly when only its
  group's outermost dimension is sharded; it takes that dimension's name.
  Raises otherwise.
  """
  names = tuple(names)
  if len(names) != sum(len(g) for g in groups):
    raise ValueError(
      f"{what} has {sum(len(g) for g in groups)} dimensions but its "
      f"partitioning {names} names {len(names)}"
    )
  mesh_axes = tuple(resolve(names))
  mesh_axes += (None,) * (len(names) - len(mesh_axes))
  merged = []
  for group in groups:
    inner = [d for d in group[1:] if mesh_axes[d] not in (None, ())]
    if inner:
      raise ValueError(
        f"{what}: partitioning {names} shards dimension {inner[0]} "
        f"({mesh_axes[inner[0]]!r}), an inner dimension of the dimensions "
        f"{group} that FORGE merges into one. Only the outermost dimension "
        "of a merged group can be sharded (e.g. the heads of a "
        "[embed, heads, head_dim] kernel), so that the merged dimension is "
        "sharded in contiguous blocks."
      )
    merged.append(names[group[0]])
  return tuple(merged)


def _stacked_shapes(variables, stacked: Optional[layer_context.StackedLayer]):
  """``variables``' shapes, on a leading layer axis when ``stacked``."""
  if stacked is None:
    return variables
  return jax.tree.map(
    lambda v: jax.ShapeDtypeStruct((stacked.length,) + v.shape, v.dtype),
    variables,
  )


def wiped_layers(variables) -> list[str]:
  """Paths of ForgeDense layers whose variables were overwritten with zeros
  or with summed updates.

  A layer whose output does not reach the loss in a step receives zero
  cotangents; an overwrite-with-gradient step then stores zeros (``intact``
  0). A kernel used several times by one loss under a transform that
  traces its backward once (a ``lax.scan`` over micro-batches, variables
  that ``nn.scan`` broadcasts; ``jax.vmap`` with shared weights raises)
  receives the sum of the uses' updates (``intact`` above 1, or a NaN
  ``count``: ``fj.TrainState`` makes it NaN where the count did not move as
  one backward moves it, which also catches a clip or scaling applied to
  FORGE's collection). Either way the layer's next backward pass makes its
  kernel NaN. Call this on the host to
  name them. Layers stacked by ``nn.scan`` are named ``path[i]``.
  """
  wiped = []
  layers = forge_layers(variables.get(FORGE_COLLECTION, {}))
  for path, layer in sorted(layers, key=lambda item: item[0]):
    wiped += poisoned("/".join(map(str, path)), layer["intact"], layer["count"])
  return wiped


def forge_layers(collection, path=()):
  """``(path, layer variables)`` of every ForgeDense in FORGE's collection."""
  if isinstance(collection, Mapping) and "intact" in collection:
    yield path, collection
  elif isinstance(collection, Mapping):
    for key, value in collection.items():
      yield from forge_layers(value, path + (key,))
