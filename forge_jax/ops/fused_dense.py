"""The fused op: ``y = x @ W + b`` whose backward updates W and its state.

``forge_dense`` is a ``jax.custom_vjp``. Its backward computes
``dx = dy @ W.T`` with the old ``W`` first, then hands ``x`` and ``dy`` to a
backend that forms ``dW = x.T @ dy`` and applies the optimizer rule, and
returns the *new* kernel and optimizer state as the cotangents of the old
ones. A training step that overwrites the variables with these cotangents
(flax's ``_overwrite_with_gradient`` collection; ``TrainState.apply_gradients``
does it) has then taken an optimizer step without ever storing ``dW``.

Stacked mode (``fj.scan_layers``' backward): given a ``layer_index``, every
leaf of the variables is a stack over a leading layer axis; the op uses the
layer's kernel, steps only that layer, and the cotangent is the whole stacks
with that layer updated, in place (:mod:`forge_jax.ops.stacks`).

Deferred mode (exact clipping, :mod:`forge_jax.clipping`): given a sink of
:class:`Factors`, a backward traced as the deferred pass steps nothing; it
returns ``dx``, ``dbias`` and ``dW``'s sum of squares as the norm-only pass
does, and the layer's factors (its input in the compute dtype and ``dy``)
as the sink's cotangent. :func:`deferred_update` steps the layer from them
once the global norm is known.

Sharded mode (tensor / sequence parallelism): given a
:class:`forge_jax.parallel.ShardedLayout`, the forward and backward rules
each run per shard in ``jax.shard_map``, with the all-gathers, all-reduces
and reduce-scatters the layout plans written out (see
:mod:`forge_jax.parallel`). On one device the layout is empty, every
collective is the identity and there is no ``shard_map``: one forward and
one backward serve both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as flax_dtypes
from jax import lax
from jax.custom_derivatives import SymbolicZero

from forge_jax import layer_context, parallel, quantization
from forge_jax.ops import backends, stacks
from forge_jax.ops.mosaic import matmul
from forge_jax.ops.update import true_after
from forge_jax.optimizers import ForgeOptimizer, not_elementwise_message

IMPLEMENTATIONS = ("auto", "xla", "triton", "mosaic")


class ForgeVariables(NamedTuple):
  """What FORGE stores for one dense layer (outside ``params``).

  Attributes:
    kernel: the weight, ``[in_features, features]``; or stored in
      ``nn.DenseGeneral``'s shape (contracted dimensions, then features),
      which the op views as ``[K, N]`` with ``K`` the input's last dimension.
    opt_state: the optimizer's per-element state (kernel-shaped arrays).
    count: float32 scalar, the number of steps applied to this layer (exact up
      to 2**24 steps, where it stops; float because jax.grad only
      differentiates float leaves).
    skipped: float32 scalar, the number of kernel elements the last step left
      untouched because their gradient was not finite.
    intact: float32 scalar, 1.0 while the variables are ones FORGE wrote. A
      layer whose output did not reach the loss gets zero cotangents, which an
      overwrite-with-gradient step writes as zeros; ``intact`` becomes 0.0,
      and the layer's next backward pass writes a NaN kernel (so the loss
      turns NaN) instead of silently training on from zeros.
    grad_sq_norm: float32 scalar, the sum of the squared elements of the
      weight gradient of the last backward pass (the gradient the update
      consumed, whose loss cotangent :mod:`forge_jax.clipping` may have
      scaled), accumulated by the kernels from the float32 tiles they hold:
      this layer's part of the global gradient norm (:func:`fj.global_norm
      <forge_jax.clipping.global_norm>`).
  """

  kernel: jax.Array
  opt_state: Any
  count: jax.Array
  skipped: jax.Array
  intact: jax.Array
  grad_sq_norm: jax.Array


def check_kernel_precision(dtype) -> None:
  """Refuses a float64 kernel: the rules compute in float32, so its update
  would lose the precision optax's float64 update keeps."""
  if jnp.dtype(dtype) == jnp.float64:
    raise TypeError(
      "FORGE's optimizer rules compute in float32: a float64 kernel would "
      "be stepped at float32 precision, unlike optax's float64 update. "
      "Use param_dtype=jnp.float32 (inputs and dtype may stay float64), or "
      "nn.Dense / nnx.Linear + optax to train in float64."
    )


def init_variables(
  optimizer: ForgeOptimizer, kernel: jax.Array
) -> ForgeVariables:
  dtype = jnp.dtype(kernel.dtype)
  check_kernel_precision(dtype)
  if optimizer.weight_rounding == "stochastic" and dtype not in (
    jnp.bfloat16,
    jnp.float32,
  ):
    raise ValueError(
      f"weight_rounding='stochastic' writes bfloat16 (or float32) kernels, "
      f"not {dtype}: use param_dtype=jnp.bfloat16, or weight_rounding="
      "'nearest'"
    )
  scalar = lambda v: jnp.asarray(v, jnp.float32)
  return ForgeVariables(
    kernel=kernel,
    opt_state=optimizer.init(kernel),
    count=scalar(0),
    skipped=scalar(0),
    intact=scalar(1),
    grad_sq_norm=scalar(0),
  )


class Factors(NamedTuple):
  """The two factors of one layer's weight gradient ``dW = x.T @ dy``.

  Attributes:
    x: the layer's input in the compute dtype, ``[tokens, K]``.
    dy: the cotangent of its output, ``[tokens, N]``.

  With a leading layer axis for layers stacked by ``fj.scan``.
  """

  x: jax.Array
  dy: jax.Array


@dataclasses.dataclass(frozen=True)
class FusedDenseSpec:
  """Static configuration of one fused dense call (hashable)."""

  optimizer: ForgeOptimizer
  implementation: str = "auto"
  precision: Any = None
  dtype: Any = None
  #: Static id of the layer, one input of stochastic rounding's hash.
  layer_id: int = 0
  #: The layer's module path (``()``: the root module); its backward
  #: records that it ran (:mod:`forge_jax.layer_context`). None: an unnamed
  #: op, nothing is recorded.
  path: Optional[tuple] = None


def _dense(x, kernel, bias, spec: FusedDenseSpec, reduce=lambda y: y):
  """``flax.linen.Dense``'s forward, operation for operation; ``reduce``
  sums a shard's partial products before the bias is added."""
  x, kernel, bias = flax_dtypes.promote_dtype(x, kernel, bias, dtype=spec.dtype)
  y = lax.dot_general(
    x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=spec.precision
  )
  return _add_bias(reduce(y), bias)


def _add_bias(y, bias):
  if bias is not None:
    y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
  return y


def _in_place_dtype(spec, layout, x, stack, bias, layer_index, transpose):
  """The compute dtype when a stacked layer's product with its kernel runs
  as :func:`forge_jax.ops.mosaic.matmul.stacked_matmul`, reading the layer
  out of the stack in place (XLA would copy it out first); else None.

  It does on a Hopper GPU, for one device's stacks already in the compute
  dtype (a kernel cast to it is read once either way), with 'auto' or
  'mosaic' and the default precision, where the GEMM's tiles fit and the
  tokens are at most :data:`~forge_jax.ops.mosaic.matmul.MAX_IN_PLACE_TOKENS`.
  """
  if (
    layer_index is None
    or layout.mesh is not None
    or spec.implementation not in ("auto", "mosaic")
    or spec.precision is not None
    or not backends.on_hopper_or_newer()
  ):
    return None
  compute = flax_dtypes.canonicalize_dtype(x, stack, bias, dtype=spec.dtype)
  if jnp.dtype(stack.dtype) != jnp.dtype(compute):
    return None
  tokens = math.prod(x.shape[:-1])
  if tokens > matmul.MAX_IN_PLACE_TOKENS:
    return None
  rows = jax.ShapeDtypeStruct((tokens, x.shape[-1]), compute)
  if transpose:  # x is dy: contracted with the kernel's N
    rows = jax.ShapeDtypeStruct((rows.shape[0], stack.shape[-1]), compute)
  if matmul.unsupported_reason(rows, stack, transpose) is not None:
    return None
  return compute


def _validate(
  x, variables: ForgeVariables, bias, spec: FusedDenseSpec, layer_index=None
):
  if layer_index is not None:
    _validate_stacked(variables, layer_index)
  kernel = stacks.layer_entry(variables.kernel, layer_index)
  if kernel.ndim != 2:
    raise ValueError(
      f"{kernel.shape=} must be rank 2 ([in_features, features])"
    )
  if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(
      f"{x.shape=} must end in the kernel's in_features {kernel.shape[0]}"
    )
  for name, value in (("x", x), ("kernel", kernel)):
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise TypeError(f"{name}.dtype={value.dtype} must be a floating dtype")
  check_kernel_precision(kernel.dtype)
  if bias is not None and bias.shape != (kernel.shape[1],):
    raise ValueError(f"{bias.shape=} must be ({kernel.shape[1]},)")
  if spec.implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{spec.implementation=} must be one of {IMPLEMENTATIONS}")
  if not isinstance(spec.optimizer, ForgeOptimizer):
    raise TypeError(not_elementwise_message(spec.optimizer))


def _validate_stacked(variables: ForgeVariables, layer_index):
  """Stacks share one leading layer axis; the index is an integer scalar."""
  if jnp.ndim(layer_index) != 0 or not jnp.issubdtype(
    jnp.result_type(layer_index), jnp.integer
  ):
    raise TypeError(f"layer_index={layer_index!r} must be an integer scalar")
  if jnp.ndim(variables.kernel) != 3:
    raise ValueError(
      f"{variables.kernel.shape=} must be rank 3 ([layers, "
      "in_features, features]) with a layer_index"
    )
  layers = variables.kernel.shape[0]
  for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
    if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != layers:
      raise ValueError(
        f"variables{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}: "
        f"with a layer_index every leaf must be stacked on a leading axis "
        f"of {layers} layers"
      )


def forge_dense(
  x: jax.Array,
  variables: ForgeVariables,
  bias: Optional[jax.Array],
  spec: FusedDenseSpec,
  layer_index: Optional[jax.Array] = None,
  layout: Optional[parallel.ShardedLayout] = None,
  where: str = "forge_dense",
  factors: Optional[Factors] = None,
) -> jax.Array:
  """``x @ kernel + bias``; differentiating it w.r.t. ``variables`` steps them.

  Args:
    x: ``[..., in_features]`` inputs.
    variables: the layer's :class:`ForgeVariables`; with a ``layer_index``,
      stacks of them (every leaf on a leading layer axis). The optimizer
      state is on the kernel's ``[K, N]`` view; the updated kernel comes
      back in the kernel's stored shape.
    bias: ``[features]`` or None. Its gradient is an ordinary gradient.
    spec: static configuration (optimizer, implementation, precision, dtype).
    layer_index: None, or an int32 scalar: the layer of the stacks to use
      and step (its cotangent is zero).
    layout: None (one device), or the
      :class:`forge_jax.parallel.ShardedLayout` that
      ``parallel.plan_layout`` made: the op runs per shard as it says.
      ``x``, ``variables`` and ``bias`` are global arrays either way.
    where: the layer's name for error messages.
    factors: None, or the layer's sink: :class:`Factors` shaped as
      :func:`factor_shapes` says (one layer's with a ``layer_index``),
      whose values are unused. A backward traced as the deferred pass
      (:data:`forge_jax.layer_context.DEFERRED`) returns the factors as
      its cotangent and steps nothing; other passes return zeros for it.
      Not under a ``layout``.

  Returns:
    ``[..., features]``, bit for bit what ``flax.linen.Dense`` computes
    (stacked layers on a Hopper GPU: the in-place GEMM's float32 sums over
    ``K`` in order, XLA's bits wherever XLA's GEMM does not split ``K``). The
    cotangent returned for ``variables`` is the *updated* variables (with a
    ``layer_index``: the stacks, that layer updated); under a ``layout``,
    sharded like the kernel on every leaf that follows the kernel
    (:func:`forge_jax.parallel.follows_kernel`), the scalars replicated.
  """
  stacked = layer_index is not None
  viewed = _viewed(variables, jnp.shape(x)[-1:], stacked)
  if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
    # Integer or boolean inputs, as flax.linen.Dense promotes them.
    x = jnp.asarray(x, spec.dtype or jnp.result_type(x, viewed.kernel))
  _validate(x, viewed, bias, spec, layer_index)
  if factors is not None:
    _check_factors(x, viewed, bias, spec, layout, factors, where)
  if layout is None:
    parallel.check_unpartitioned(x, viewed, where)
    layout = parallel.unsharded_layout(jnp.ndim(x))
  else:
    parallel.check_layout(x, viewed, layout, where, stacked)
    if parallel.is_explicit(layout.mesh):
      x, relaid, bias = parallel.to_layout(x, viewed, bias, layout, stacked)
      if not stacked:
        # Stacks are laid out already (to_layout refuses others) and stay
        # the arrays given, which fj.scan's backward steps in place.
        variables = relaid
  if layer_context.differentiates_plainly():
    if factors is not None:
      raise ValueError(
        f"{where}: fj.plain_gradients() inside global-norm clipping's "
        "gradient (state.value_and_grad): the clipped step needs FORGE's "
        "backward. Take plain gradients with jax.grad outside it."
      )
    # XLA's ops only (no in-place Pallas GEMM, which has no autodiff rule):
    # autodiff of the dense function, as for nn.Dense.
    plain = dataclasses.replace(spec, implementation="xla")
    variables = variables._replace(
      kernel=plainly_used(variables.kernel, variables.count, spec.path)
    )
    return _forward(plain, layout, x, variables, bias, layer_index)
  # The variables as they are stored: the custom_vjp's residuals are the
  # very arrays given (fj.scan's backward recognizes its stacks by them).
  return _forge_dense(
    spec, layout, factors is not None, x, variables, bias, layer_index, factors
  )


#: What a kernel's plain use (:func:`plainly_used`) adds to the cotangent of
#: its layer's ``count`` where it adds a ``dW``.
PLAIN_USE_MARK = -0.5


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def plainly_used(kernel, count, path=None):
  """``kernel``, used outside FORGE's backward (``fj.plain_gradients``) by
  the layer at ``path`` (its module path; None: an unnamed op).

  Where this use adds a ``dW`` to the kernel's cotangent (its output, or
  a gradient taken from it, is differentiated with respect to the kernel),
  it adds :data:`PLAIN_USE_MARK` to ``count``'s (per layer of a stack).
  Beside a FORGE backward of the same kernel (a gradient penalty inside a
  loss FORGE trains) the sum would be the new kernel plus this ``dW``: the
  count then moved by half a step, and ``fj.TrainState`` poisons the layer
  instead of installing it. Alone, the cotangent says the layer was not
  reached (``intact`` 0): its ``dW`` is not installed either, and the
  install refuses it (:func:`forge_jax.layer_context.record_plain_backward`).
  """
  del count, path
  return kernel


def _plainly_used_fwd(kernel, count, path):
  del path
  return kernel, count


def _plainly_used_bwd(path, count, ct):
  if path is not None:
    layer_context.record_plain_backward(path)
  axes = tuple(range(jnp.ndim(count), jnp.ndim(ct)))
  used = jnp.any(ct != 0, axis=axes)
  return ct, jnp.where(used, PLAIN_USE_MARK, 0.0).astype(jnp.result_type(count))


plainly_used.defvjp(_plainly_used_fwd, _plainly_used_bwd)


def one_hot_precision(dtype):
  """The precision of an embedding's one-hot product in ``dtype``: HIGHEST
  for float32 (a one-hot row times the table is then the row's bits), the
  default otherwise."""
  if jnp.dtype(dtype) == jnp.float32:
    return lax.Precision.HIGHEST
  return None


def one_hot_lookup(tokens, num_embeddings: int, dtype, product, where: str):
  """``nn.Embed``'s lookup of integer ``tokens`` as ``product(one_hot)``,
  the tokens' one-hot rows ``[..., num_embeddings]`` in ``dtype`` times a
  table; with ``jnp.take``'s indexing: negative tokens count from the end,
  tokens outside the table look up NaN rows. ``where`` names the layer in
  errors."""
  if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise TypeError(
      f"{where} looks up integer tokens, got {jnp.result_type(tokens)}"
    )
  if jnp.iinfo(jnp.result_type(tokens)).bits < 32:
    # The one-hot's index range, the shift of negative tokens and the range
    # check are in the tokens' dtype: int8 / uint8 / 16-bit tokens wrap in
    # a table past their range. Widened, each means what nn.Embed's index
    # means.
    tokens = jnp.asarray(tokens, jnp.int32)
  tokens = jnp.where(tokens < 0, tokens + num_embeddings, tokens)
  rows = product(jax.nn.one_hot(tokens, num_embeddings, dtype=dtype))
  inside = jnp.logical_and(tokens >= 0, tokens < num_embeddings)
  return jnp.where(inside[..., None], rows, jnp.nan)


def factor_shapes(x, kernel, bias, spec: FusedDenseSpec) -> Factors:
  """The shapes and dtypes of a layer's :class:`Factors` (``x`` ``[...,
  K]``, ``kernel`` the layer's ``[K, N]`` view, ``bias`` ``[N]`` or None;
  arrays or ShapeDtypeStructs): ``x`` in the compute dtype, ``dy`` in the
  output's."""
  compute = jax.eval_shape(
    lambda x, kernel: flax_dtypes.promote_dtype(x, kernel, dtype=spec.dtype)[0],
    x,
    kernel,
  )
  y = jax.eval_shape(
    lambda x, kernel, bias: _dense(x, kernel, bias, spec), x, kernel, bias
  )
  tokens = math.prod(jnp.shape(x)[:-1])
  return Factors(
    jax.ShapeDtypeStruct((tokens, jnp.shape(x)[-1]), compute.dtype),
    jax.ShapeDtypeStruct((tokens, y.shape[-1]), y.dtype),
  )


def _check_factors(x, variables, bias, spec, layout, factors, where):
  if layout is not None:
    raise ValueError(
      f"{where}: a factor sink under a ShardedLayout: a sharded layer steps "
      "inside its backward pass"
    )
  kernel = jax.ShapeDtypeStruct(
    jnp.shape(variables.kernel)[-2:], jnp.result_type(variables.kernel)
  )
  expected = factor_shapes(x, kernel, bias, spec)
  actual = Factors(
    *(jax.ShapeDtypeStruct(jnp.shape(f), jnp.result_type(f)) for f in factors)
  )
  if actual != expected:
    raise ValueError(f"{where}: factor sink {actual}, expected {expected}")


def _viewed(variables: ForgeVariables, k: tuple, stacked: bool):
  """The variables with the kernel on its ``[K, N]`` view (``k``: ``(K,)``,
  the input's last dimension). A kernel stored in ``nn.DenseGeneral``'s
  shape, contracted dimensions first, is that view reshaped (no copy)."""
  kernel = variables.kernel
  lead = jnp.shape(kernel)[:1] if stacked else ()
  if jnp.ndim(kernel) == len(lead) + 2 or not k[0]:
    return variables
  size = int(np.prod(jnp.shape(kernel)[len(lead) :]))
  if size % k[0]:
    raise ValueError(
      f"kernel.shape={jnp.shape(kernel)} has no [K, N] view for inputs "
      f"with K={k[0]} features"
    )
  return variables._replace(
    kernel=jnp.reshape(kernel, lead + (k[0], size // k[0]))
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _forge_dense(spec, layout, defers, x, variables, bias, layer_index, sink):
  del defers, sink  # the sink only receives the factors as its cotangent
  return _forward(spec, layout, x, variables, bias, layer_index)


def check_differentiated(x, variables, bias, path=None):
  """Raise when inputs or bias are differentiated but the kernel is not.

  Takes the ``CustomVJPPrimal`` wrappers a ``symbolic_zeros`` fwd rule sees;
  ``path`` names the layer (its module path).
  """
  kernel_perturbed = variables.kernel.perturbed
  others_perturbed = x.perturbed or (bias is not None and bias.perturbed)
  if others_perturbed and not kernel_perturbed:
    layer = (
      "A ForgeDense kernel"
      if path is None
      else f"The kernel of the FORGE layer {layer_context.layer_name(path)!r}"
    )
    raise ValueError(
      f"{layer} is not being differentiated while its inputs or "
      "bias are: FORGE would silently train nothing. Differentiate with "
      "respect to all variables, e.g. jax.grad(loss)(variables) with "
      "variables = {'params': ..., '_overwrite_with_gradient': ...} "
      "(TrainState.params when created from the whole variables dict), "
      "not variables['params'] alone. Flax NNX: fj.nnx.grad(loss), or "
      "nnx.grad(loss, argnums=nnx.DiffState(0, fj.nnx.TRAINABLE)). Where "
      "the loss passes gradients through a FORGE model it does not train "
      "(a GAN's generator loss through its discriminator) or wants "
      "gradients with respect to the inputs only (adversarial examples, "
      "saliency), call that model inside `with fj.plain_gradients():`, "
      "where its layers differentiate as nn.Dense and update nothing (not "
      "for a layer the same loss trains: a gradient penalty on a FORGE "
      "layer is a second use of its kernel, which poisons it). A layer "
      "frozen inside a model the loss trains (stop_gradient on its "
      "variables, a frozen base under LoRA adapters) needs flax's layer "
      "(nn.Dense, nnx.Linear): FORGE's layers train whenever they are "
      "differentiated."
    )


def check_unshared(kernel, dy, path=None):
  """``dy`` (an array or a tree of them), unchanged; raises where
  ``jax.vmap`` maps the backward over ``dy`` but not over ``kernel``.

  There every mapped slice's backward steps the one shared kernel, and
  JAX combines the slices' new variables as if they were gradients:
  summed where the vmap is inside the gradient (the sum of the updates,
  not the update of the summed gradient), one a slice where it is outside
  (per-example "gradients" that are updates; their mean is not the
  update of the mean gradient either). Only the batching rule sees which
  operands are mapped, so the check is a ``custom_vmap`` that passes
  ``dy`` through. An ensemble (the kernel mapped too) passes.
  """

  @jax.custom_batching.custom_vmap
  def unshared(kernel, dy):
    del kernel
    return dy

  @unshared.def_vmap
  def _check(axis_size, in_batched, kernel, dy):
    del axis_size, kernel
    kernel_mapped, dy_mapped = in_batched
    if any(jax.tree.leaves(dy_mapped)) and not kernel_mapped:
      layer = (
        "a ForgeDense layer"
        if path is None
        else f"the FORGE layer {layer_context.layer_name(path)!r}"
      )
      raise ValueError(
        f"The backward of {layer} is mapped by jax.vmap (or nn.vmap, "
        "nnx.vmap, lax.map with a batch_size, jax.jacrev) over a kernel "
        "shared by the mapped slices: each slice's backward would step "
        "the same kernel, and JAX would sum (or stack) those updates as if "
        "they were gradients, which trains it wrong. Apply the layer to "
        "the whole batch instead (it takes any leading dimensions, so the "
        "mapped axis can join the batch), map the kernel too (an "
        "ensemble: nn.vmap with variable_axes for FORGE's collection), or "
        "use nn.Dense / nnx.Linear for per-example gradients."
      )
    return dy, dy_mapped

  return unshared(kernel, dy)


def primal_values(tree):
  """The values inside a fwd rule's ``CustomVJPPrimal`` wrappers."""
  return jax.tree.map(
    lambda p: p.value,
    tree,
    is_leaf=lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal),
  )


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _InputGradient:
  """Whether the backward forms dx: a static residual. An input that is not
  differentiated (one-hot rows of integer tokens, a model's raw inputs)
  needs none, and its dx would be a GEMM and a ``[tokens, K]`` buffer for
  nothing (the update waits for dx only when there is one)."""

  needed: bool


def _forge_dense_fwd(
  spec, layout, defers, x, variables, bias, layer_index, sink
):
  del defers, sink  # no residual: the backward only knows it has a sink
  check_differentiated(x, variables, bias, spec.path)
  # A mesh's per-shard backward keeps one output structure: dx always.
  needs_dx = _InputGradient(x.perturbed or layout.mesh is not None)
  x, variables, bias, layer_index = primal_values(
    (x, variables, bias, layer_index)
  )
  # The dot itself, not a nested call of the custom_vjp: remat policies
  # (``dots_saveable``, ...) see a dot_general and may save its output.
  return (
    _forward(spec, layout, x, variables, bias, layer_index),
    (x, variables, bias, layer_index, needs_dx),
  )


def order_after(value):
  """A scalar True that XLA computes after ``value`` (True if ``value`` is
  None): AND it into a predicate to order work after ``value``. One element
  is read, enough where ``value`` comes from a dot, which XLA does not
  duplicate."""
  if value is None:
    return True
  return true_after(value.reshape(-1)[0])


def backward_finite(dy, dx):
  """Whether ``dy`` is finite, read from the first column of ``dx`` when
  the layer computed one (else from all of ``dy``).

  A row of dY with a non-finite element makes its row of ``dx = dY Wᵀ``
  non-finite in every column (infinity times anything is infinite or NaN,
  NaN spreads, and inf - inf is NaN), so one column of dx, a value a
  token, stands for a pass over all of dY. A finite dY whose dx overflowed
  reads as not finite too: the layer skips a step whose backward
  overflowed. An update that depends on the flag runs after dx, the last
  reader of the old kernel, so XLA updates the kernel in place instead of
  copying it.
  """
  if dx is None:
    return jnp.all(jnp.isfinite(dy))
  return jnp.all(jnp.isfinite(dx[..., 0]))


def step_scalars(
  spec: FusedDenseSpec, variables: ForgeVariables, layer_index=None
):
  """This step's optimizer scalars, the learning rate poisoned if wiped.

  Each backward writes ``intact`` as it read it, 1. A wiped layer (zeros
  written over it: ``intact`` 0), one overwritten with the sum of several
  uses' updates (``intact`` above 1), or one whose ``count``
  ``fj.TrainState``'s install made NaN (it did not move as a backward
  moves it) gets a NaN learning rate: its kernel turns NaN, and so does
  the loss, from the next step on. Poisoning a per-step
  scalar costs nothing; poisoning the output would cost a pass over the
  activations.
  """
  scalars = spec.optimizer.scalars(layer_step(variables, layer_index))
  intact = stacks.layer_entry(variables.intact, layer_index)
  count = stacks.layer_entry(variables.count, layer_index)
  whole = jnp.logical_and(intact == 1, count == count)
  return scalars._replace(
    neg_lr=scalars.neg_lr
    * jnp.where(whole, 1.0, jnp.nan).astype(scalars.neg_lr.dtype)
  )


def poisoned(name: str, intact, count) -> list[str]:
  """On the host: ``name`` (``name[i]`` for the entries of a stack) where
  a layer's ``intact`` is not 1 or its ``count`` is NaN, the layers
  :func:`step_scalars` poisons."""
  intact = np.asarray(jax.device_get(intact), np.float32)
  count = np.asarray(jax.device_get(count), np.float32)
  bad = (intact != 1.0) | np.isnan(count)
  if bad.ndim == 0:
    return [name] if bad else []
  return [f"{name}[{i}]" for i in np.flatnonzero(bad.reshape(-1))]


def layer_step(variables: ForgeVariables, layer_index=None) -> jax.Array:
  """The layer's step count as an int32 scalar."""
  return stacks.layer_entry(variables.count, layer_index).astype(jnp.int32)


def layer_rounding_key(
  spec: FusedDenseSpec, variables: ForgeVariables, layer_index=None
):
  """The layer's stochastic rounding key at this step (None where the
  optimizer draws no random bits): a traced scalar, so one compiled kernel
  serves every layer."""
  optimizer = spec.optimizer
  if not optimizer.draws_random_bits:
    return None
  return quantization.rounding_key(
    optimizer.rounding_seed, spec.layer_id, layer_step(variables, layer_index)
  )


def stepped(
  variables: ForgeVariables,
  new_kernel,
  new_state,
  skipped,
  grad_sq_norm,
  apply,
  layer_index=None,
) -> ForgeVariables:
  """The layer's variables after a step (``count`` advances if applied).

  With a ``layer_index``, ``new_kernel`` and ``new_state`` are the stacks
  and only the layer's ``count``, ``skipped`` and ``grad_sq_norm`` entries
  change.
  """
  if layer_index is None:
    # Read the old values this step replaces. jit prunes the arguments a
    # step never reads, and matches donated arguments to outputs by shape
    # and dtype in order: with these two pruned, the layer's other donated
    # scalars would each alias the next one's output and be copied.
    (skipped, grad_sq_norm), _ = lax.optimization_barrier(
      ((skipped, grad_sq_norm), (variables.skipped, variables.grad_sq_norm))
    )
  return ForgeVariables(
    kernel=new_kernel,
    opt_state=new_state,
    count=stacks.add_at_layer(
      variables.count, apply.astype(jnp.float32), layer_index
    ),
    skipped=stacks.with_layer_scalar(
      variables.skipped, skipped.astype(jnp.float32), layer_index
    ),
    intact=variables.intact,
    grad_sq_norm=stacks.with_layer_scalar(
      variables.grad_sq_norm, grad_sq_norm.astype(jnp.float32), layer_index
    ),
  )


def measured(
  variables: ForgeVariables, grad_sq_norm, layer_index=None
) -> ForgeVariables:
  """``variables`` unchanged but for the layer's ``grad_sq_norm`` (entry):
  what a norm-only backward pass returns."""
  return variables._replace(
    grad_sq_norm=stacks.with_layer_scalar(
      variables.grad_sq_norm, grad_sq_norm.astype(jnp.float32), layer_index
    )
  )


# ---------------------------------------------------------------------------
# The forward and backward of one shard, with the collectives the layout
# plans. A collective over no axes is the identity: with the one-device
# layout this is the unsharded op, run on the global arrays directly.


def _live(axes) -> tuple:
  """``axes`` without those of size 1: a collective over them is the
  identity, and is not emitted (a data axis of size 1 costs nothing)."""
  return tuple(a for a in axes if lax.axis_size(a) > 1)


def _psum(value, axes):
  axes = _live(axes)
  return lax.psum(value, axes) if axes else value


def _all_gather(value, where):
  if where is None or not _live(where[1]):
    return value
  dim, axes = where
  return lax.all_gather(value, axes, axis=dim, tiled=True)


def _reduce(value, axes, scatter):
  """Sum partials over ``axes``; reduce-scatter the ``scatter`` part."""
  if scatter is None or not _live(scatter[1]):
    return _psum(value, axes)
  dim, scattered = scatter
  value = _psum(value, tuple(a for a in axes if a not in scattered))
  return lax.psum_scatter(value, scattered, scatter_dimension=dim, tiled=True)


def _on_every_shard(flag, axes):
  """Whether the boolean scalar ``flag`` holds on every shard over ``axes``
  (pmin of a value over axes it does not vary on is the value itself)."""
  axes = _live(axes)
  if not axes:
    return flag
  return lax.pmin(flag.astype(jnp.int32), axes) > 0


def _forward(spec, layout, x, variables, bias, layer_index):
  variables = _viewed(variables, jnp.shape(x)[-1:], layer_index is not None)
  forward = functools.partial(_local_forward, spec, layout)
  if layout.mesh is not None:
    x_s, v_s, b_s, i_s = parallel.operand_specs(
      layout, variables, bias, layer_index is not None
    )
    forward = parallel.per_shard(
      forward, layout, (x_s, v_s.kernel, b_s, i_s), layout.y_spec()
    )
  return forward(x, variables.kernel, bias, layer_index)


def _gather_kernel(kernel, layout, after):
  """This shard's kernel all-gathered over the layout's FSDP axes: the
  tensor-parallel shard the layer computes with; the identity without FSDP.

  Just in time: the gather reads the shard through a select on a predicate
  that depends on ``after`` (the layer's input in the forward, dY in the
  backward) and that XLA cannot fold, so it neither schedules every layer's
  gather at the start of the step nor merges a layer's forward and
  backward gathers into one buffer kept alive in between. One layer's
  kernel is whole only while its forward or its backward runs.
  """
  if not any(layout.live_weight_gather):
    return kernel
  kernel = jnp.where(order_after(after), kernel, jnp.zeros_like(kernel))
  for dim, axes in enumerate(layout.live_weight_gather):
    if axes:
      kernel = lax.all_gather(kernel, axes, axis=dim, tiled=True)
  return kernel


def _local_forward(spec, layout, x, kernel, bias, layer_index):
  x = _all_gather(x, layout.gather)
  compute = _in_place_dtype(spec, layout, x, kernel, bias, layer_index, False)
  if compute is not None:
    y = matmul.stacked_matmul(
      jnp.reshape(x, (-1, x.shape[-1])).astype(compute), kernel, layer_index
    )
    y = jnp.reshape(y, x.shape[:-1] + y.shape[-1:])
    return _add_bias(y, None if bias is None else bias.astype(compute))
  reduce = functools.partial(
    _reduce, axes=layout.k_axes, scatter=layout.scatter
  )
  kernel = _gather_kernel(stacks.layer_entry(kernel, layer_index), layout, x)
  return _dense(x, kernel, bias, spec, reduce)


def _local_backward(
  spec, layout, gradient_pass, needs_dx, x, variables, bias, layer_index, dy
):
  kernel = _gather_kernel(
    stacks.layer_entry(variables.kernel, layer_index), layout, dy
  )
  x = _all_gather(x, layout.gather)  # the tokens the forward used
  dy = _all_gather(dy, layout.scatter)  # transpose of the reduce-scatter
  # dx and dbias exactly as autodiff of flax.linen.Dense, with the old
  # kernel; then dx summed over the kernel's N axes, dbias over the tokens'
  # data axes. Without ``needs_dx`` (inputs that are not differentiated,
  # such as ForgeEmbed's one-hot rows), only dbias.
  dx, dbias = None, None
  if needs_dx:
    compute = _in_place_dtype(
      spec, layout, dy, variables.kernel, bias, layer_index, True
    )
    if compute is None:
      _, dense_vjp = jax.vjp(lambda x, b: _dense(x, kernel, b, spec), x, bias)
      dx, dbias = dense_vjp(dy)
    else:
      dx, dbias = _in_place_dense_vjp(
        x, variables.kernel, bias, layer_index, dy, compute
      )
    dx = _reduce(dx, layout.n_axes, layout.gather)
  elif bias is not None:
    _, bias_vjp = jax.vjp(lambda b: _dense(x, kernel, b, spec), bias)
    (dbias,) = bias_vjp(dy)
  if dbias is not None:
    dbias = _psum(dbias, layout.token_axes)

  x_c, _, _ = flax_dtypes.promote_dtype(x, kernel, None, dtype=spec.dtype)
  local_shape = variables.kernel.shape[-2:]
  if gradient_pass in (layer_context.NORM_ONLY, layer_context.DEFERRED):
    # Exact clipping's first (or deferred) pass: the norm of dW, no update.
    if layout.reduces_weight_gradient:  # this shard's dW, summed over tokens
      grad_sq_norm = _reduced_sq_norm(
        spec, layout, x_c, dy, local_shape, variables.opt_state
      )
    else:
      grad_sq_norm = backends.weight_gradient_sq_norm(x_c, dy, spec.precision)
    grad_sq_norm = _psum(grad_sq_norm, layout.kernel_axes)
    return dx, measured(variables, grad_sq_norm, layer_index), dbias

  # One decision for the whole layer: skip it when any shard's dY is not
  # finite. Read from dx, it also orders the update after dx.
  apply = _on_every_shard(backward_finite(dy, dx), layout.mesh_axes)
  scalars = step_scalars(spec, variables, layer_index)
  key = layer_rounding_key(spec, variables, layer_index)
  offset = _shard_offset(layout, local_shape)
  if layout.reduces_weight_gradient:  # FSDP, or data_parallel='psum'
    new_kernel, new_state, skipped, grad_sq_norm = _reduced_update(
      spec,
      layout,
      x_c,
      dy,
      variables,
      scalars,
      apply,
      rounding_key=key,
      offset=offset,
      layer_index=layer_index,
    )
  else:
    # The whole stack: a backend may refuse a stack by its size.
    backend = backends.select(
      spec.implementation, x_c, dy, variables.kernel, spec.optimizer
    )
    new_kernel, new_state, skipped, grad_sq_norm = backend(
      spec,
      x_c,
      dy,
      variables.kernel,
      variables.opt_state,
      scalars,
      apply,
      rounding_key=key,
      offset=offset,
      layer_index=layer_index,
    )
  skipped = _psum(skipped, layout.kernel_axes)
  grad_sq_norm = _psum(grad_sq_norm, layout.kernel_axes)
  return (
    dx,
    stepped(
      variables,
      new_kernel,
      new_state,
      skipped,
      grad_sq_norm,
      apply,
      layer_index,
    ),
    dbias,
  )


def _in_place_dense_vjp(x, stack, bias, layer_index, dy, compute):
  """``(dx, dbias)`` of the in-place forward: ``dx = dy @ stack[l].T``
  reading the layer in place, in ``x``'s dtype; ``dbias`` as autodiff of
  the bias's addition."""
  dy_c = jnp.reshape(dy, (-1, dy.shape[-1])).astype(compute)
  dx = matmul.stacked_matmul(dy_c, stack, layer_index, transpose_rhs=True)
  dx = jnp.reshape(dx, x.shape).astype(x.dtype)
  dbias = None
  if bias is not None:
    _, bias_vjp = jax.vjp(
      lambda b: _add_bias(jnp.zeros(dy.shape, compute), b.astype(compute)),
      bias,
    )
    (dbias,) = bias_vjp(dy)
  return dx, dbias


def _reduced_gradient(
  spec, layout, x, dy, shape, blocked=None, start=0, size=None
):
  """This shard's ``dW`` (local ``shape``), summed over the token axes: the
  local tokens' ``x.T @ dy`` all-reduced over the 'psum' data axes and
  reduce-scattered over the FSDP axes; with ``blocked`` (0: rows, 1:
  columns), only the local rows or columns ``start .. start + size``."""
  if blocked == 0:
    x = lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)
  elif blocked == 1:
    dy = lax.dynamic_slice_in_dim(dy, start, size, axis=dy.ndim - 1)
  grad = _psum(
    backends.weight_gradient(x, dy, spec.precision), layout.data_axes
  )
  for dim, axes in enumerate(layout.live_weight_gather):
    grad = _to_shard(grad, axes, dim, shape[dim], layout.token_axes)
  return grad


def _reduced_sq_norm(spec, layout, x, dy, shape, opt_state):
  """The sum of squares of this shard's ``dW`` (summed over the token
  axes), formed in the blocks :func:`_reduced_update` steps in, so the
  transient ``dW`` is one block."""
  blocked, count = layout.gradient_blocks(
    shape, quantization.has_quantized(opt_state)
  )
  if count == 1:
    grad = _reduced_gradient(spec, layout, x, dy, shape)
    return jnp.sum(jnp.square(grad))
  size = shape[blocked] // count
  block_norm = lambda i, total: (
    total
    + jnp.sum(
      jnp.square(
        _reduced_gradient(spec, layout, x, dy, shape, blocked, i * size, size)
      )
    )
  )
  return lax.fori_loop(0, count, block_norm, jnp.zeros((), jnp.float32))


def _reduced_update(
  spec,
  layout,
  x,
  dy,
  variables,
  scalars,
  apply,
  *,
  rounding_key,
  offset,
  layer_index,
):
  """The update of this shard from ``dW`` summed over the token axes:
  ``(kernel, state, skipped, grad_sq_norm)``.

  ``dW = xᵀ·dY`` of the local tokens is all-reduced over the 'psum' data
  axes and reduce-scattered over the FSDP axes onto this shard's rows or
  columns, then the elementwise rule (the XLA backend's, the one every
  backend applies) updates the shard in place. A kernel gathered over one
  dimension is stepped in blocks of the other (``layout.gradient_blocks``), so
  the transient float32 ``dW`` before its reduce-scatter is one block, the
  size of this shard's ``dW``, not the gathered layer's.
  """
  shape = variables.kernel.shape[-2:]
  blocked, count = layout.gradient_blocks(
    shape, quantization.has_quantized(variables.opt_state)
  )
  gradient = functools.partial(
    _reduced_gradient, spec, layout, x, dy, shape, blocked
  )

  if count == 1:
    return backends.apply_gradient(
      spec,
      gradient(),
      variables.kernel,
      variables.opt_state,
      scalars,
      apply,
      rounding_key=rounding_key,
      offset=offset,
      layer_index=layer_index,
    )
  size = shape[blocked] // count
  treedef = jax.tree.structure(variables.opt_state)
  divisors = quantization.column_divisors(variables.opt_state)

  def window(divisor, start):
    """A block's ``(start, size)`` in a leaf: a column block of an int8
    leaf's scales or 4-bit codes spans fewer columns (column blocks hold
    whole quantization blocks)."""
    if blocked == 1:
      return start // divisor, size // divisor
    return start, size

  def take(leaf, at):
    entry = stacks.layer_entry(leaf, layer_index)
    return lax.dynamic_slice_in_dim(entry, *at, axis=blocked)

  def put(leaf, block, at):
    return _with_block(leaf, block, blocked, at[0], layer_index)

  def body(i, carry):
    kernel, state, skipped, grad_sq_norm = carry
    start = i * size
    windows = [window(divisor, start) for divisor in divisors]
    state_leaves = jax.tree.leaves(state)
    block_offset = list(offset)
    block_offset[blocked] = block_offset[blocked] + start
    new_kernel, new_state, block_skipped, block_norm = backends.apply_gradient(
      spec,
      gradient(start, size),
      take(kernel, (start, size)),
      treedef.unflatten(map(take, state_leaves, windows)),
      scalars,
      apply,
      rounding_key=rounding_key,
      offset=tuple(block_offset),
    )
    kernel = put(kernel, new_kernel, (start, size))
    state = treedef.unflatten(
      map(put, state_leaves, jax.tree.leaves(new_state), windows)
    )
    return kernel, state, skipped + block_skipped, grad_sq_norm + block_norm

  zero = lambda dtype: jnp.zeros((), dtype)
  return lax.fori_loop(
    0,
    count,
    body,
    (variables.kernel, variables.opt_state, zero(jnp.int32), zero(jnp.float32)),
  )


def _to_shard(grad, axes, dim, local, token_axes):
  """``grad``'s part on this shard along ``dim`` (gathered over ``axes``):
  reduce-scattered where the axes shard the tokens (FSDP), sliced where
  every device saw all tokens (it holds the whole sum already)."""
  if not axes:
    return grad
  if axes[0] in token_axes:
    return lax.psum_scatter(grad, axes, scatter_dimension=dim, tiled=True)
  return lax.dynamic_slice_in_dim(
    grad, lax.axis_index(axes) * local, local, axis=dim
  )


def _with_block(stack, block, dim, start, layer_index):
  """``stack`` with ``block`` written at ``start`` of the layer's local
  dimension ``dim`` (the layer's entry with a ``layer_index``)."""
  if layer_index is None:
    return lax.dynamic_update_slice_in_dim(stack, block, start, axis=dim)
  at = [layer_index, 0, 0]
  at[1 + dim] = start
  return lax.dynamic_update_slice(stack, block[None], at)


def _shard_offset(layout, local_shape) -> Optional[tuple]:
  """The global ``(row, column)`` of this shard's kernel element ``(0, 0)``
  (stochastic rounding hashes global indices: the bits of one device);
  None for a kernel that is not sharded."""
  if not layout.kernel_axes:
    return None
  return tuple(
    _axis_offset(axes, size) for axes, size in zip(layout.kernel, local_shape)
  )


def _axis_offset(axes, local_size):
  """This shard's first global index along a dimension sharded over
  ``axes`` (the first axis major, as in a PartitionSpec)."""
  if not axes:
    return jnp.zeros((), jnp.int32)
  return lax.axis_index(axes) * local_size


def check_backward_not_differentiated(x, kernel, dy, path=None):
  """Raise where the backward pass itself is being differentiated."""
  if any(map(layer_context.is_differentiated, (x, kernel, dy))):
    layer = (
      "A ForgeDense layer"
      if path is None
      else f"The FORGE layer {layer_context.layer_name(path)!r}"
    )
    raise ValueError(
      f"{layer}: its backward pass is being differentiated (jax.jvp or "
      "jax.grad of a gradient: a Hessian-vector product, jax.hessian, a "
      "meta-gradient through an inner training step). FORGE's backward "
      "returns the layer's updated variables, not its gradient, so this "
      "would differentiate the optimizer's update. Take such derivatives "
      "inside `with fj.plain_gradients():`, where the layers differentiate "
      "as nn.Dense and update nothing."
    )


def _forge_dense_bwd(spec, layout, defers, residuals, dy):
  x, variables, bias, layer_index, needs_dx = residuals
  if isinstance(dy, SymbolicZero):
    dy = jnp.zeros(dy.shape, dy.dtype)
  check_backward_not_differentiated(x, variables.kernel, dy, spec.path)
  dy = check_unshared(variables.kernel, dy, spec.path)
  # The kernel as the forward read it: the same array twice is one kernel
  # used twice.
  kernel = variables.kernel
  gradient_pass = layer_context.record_backward(
    spec.path,
    defers,
    kernel,
    spec.optimizer,
    relaid=layout.mesh is not None and parallel.is_explicit(layout.mesh),
  )
  stored_shape = jnp.shape(variables.kernel)
  variables = _viewed(variables, jnp.shape(x)[-1:], layer_index is not None)
  backward = functools.partial(
    _local_backward, spec, layout, gradient_pass, needs_dx.needed
  )
  if layout.mesh is not None:
    x_s, v_s, b_s, i_s = parallel.operand_specs(
      layout, variables, bias, layer_index is not None
    )
    backward = parallel.per_shard(
      backward, layout, (x_s, v_s, b_s, i_s, layout.y_spec()), (x_s, v_s, b_s)
    )
  dx, new_variables, dbias = backward(x, variables, bias, layer_index, dy)
  new_variables = new_variables._replace(
    kernel=jnp.reshape(new_variables.kernel, stored_shape)
  )
  # Under a mesh the kernel may reach the op through a relayout or a
  # sharding constraint, whose transpose gives the layer a new array: the
  # install can tell the written kernel from another only without one.
  unchanged = layout.mesh is None and not parallel.mesh_is_set()
  layer_context.record_update(
    spec.path,
    kernel,
    new_variables.count,
    new_variables.kernel if unchanged else None,
  )
  factors = None  # zeros: the sink's cotangent outside the deferred pass
  if gradient_pass == layer_context.DEFERRED:
    if unchanged:
      layer_context.record_deferred_return(
        new_variables.count, new_variables.kernel
      )
    x_c = jnp.asarray(
      x, flax_dtypes.canonicalize_dtype(x, variables.kernel, dtype=spec.dtype)
    )
    factors = Factors(
      jnp.reshape(x_c, (-1, x_c.shape[-1])), jnp.reshape(dy, (-1, dy.shape[-1]))
    )
  return dx, new_variables, dbias, None, factors


_forge_dense.defvjp(_forge_dense_fwd, _forge_dense_bwd, symbolic_zeros=True)


def deferred_update(
  spec: FusedDenseSpec,
  variables: ForgeVariables,
  factors: Factors,
  scale,
  length: Optional[int] = None,
) -> ForgeVariables:
  """The layer stepped from the :class:`Factors` its deferred backward
  handed out, with ``dy`` scaled by ``scale`` (a float32 scalar): what its
  backward would have stepped with the loss's cotangent scaled so, by the
  same backend. The kernel comes back in its stored shape; each
  ``grad_sq_norm`` stays the deferred pass's.

  With a ``length``, ``variables`` and ``factors`` are stacks over that many
  layers (``fj.scan``'s), stepped one layer after the other in place.
  """
  stored_shape = jnp.shape(variables.kernel)
  stacked = length is not None
  viewed = _viewed(variables, jnp.shape(factors.x)[-1:], stacked)

  def step_layer(layer_index, variables):
    x = stacks.layer_entry(factors.x, layer_index)
    dy = stacks.layer_entry(factors.dy, layer_index)
    dy = (dy.astype(jnp.float32) * scale).astype(dy.dtype)
    finite = jnp.all(jnp.isfinite(dy))
    backend = backends.select(
      spec.implementation, x, dy, variables.kernel, spec.optimizer
    )
    new_kernel, new_state, skipped, _ = backend(
      spec,
      x,
      dy,
      variables.kernel,
      variables.opt_state,
      step_scalars(spec, variables, layer_index),
      finite,
      rounding_key=layer_rounding_key(spec, variables, layer_index),
      layer_index=layer_index,
    )
    grad_sq_norm = stacks.layer_entry(variables.grad_sq_norm, layer_index)
    return stepped(
      variables,
      new_kernel,
      new_state,
      skipped,
      grad_sq_norm,
      finite,
      layer_index,
    )

  if stacked:
    new = lax.fori_loop(0, length, step_layer, viewed)
  else:
    new = step_layer(None, viewed)
  return new._replace(kernel=jnp.reshape(new.kernel, stored_shape))
