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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from flax.linen import dtypes as flax_dtypes

from forge_jax.optimizers import ForgeOptimizer
from forge_jax.ops import backends
from forge_jax.ops import stacks
from forge_jax.ops.update import true_after

IMPLEMENTATIONS = ("auto", "xla", "triton", "mosaic")


class ForgeVariables(NamedTuple):
  """What FORGE stores for one dense layer (outside ``params``).

  Attributes:
    kernel: the weight, ``[in_features, features]``.
    opt_state: the optimizer's per-element state (kernel-shaped arrays).
    count: float32 scalar, the number of steps applied to this layer (exact up
      to 2**24 steps; float because jax.grad only differentiates float leaves).
    skipped: float32 scalar, the number of kernel elements the last step left
      untouched because their gradient was not finite.
    intact: float32 scalar, 1.0 while the variables are ones FORGE wrote. A
      layer whose output did not reach the loss gets zero cotangents, which an
      overwrite-with-gradient step writes as zeros; ``intact`` becomes 0.0,
      and the layer's next backward pass writes a NaN kernel (so the loss
      turns NaN) instead of silently training on from zeros.
  """

  kernel: jax.Array
  opt_state: Any
  count: jax.Array
  skipped: jax.Array
  intact: jax.Array


def init_variables(optimizer: ForgeOptimizer, kernel: jax.Array) -> ForgeVariables:
  scalar = lambda v: jnp.asarray(v, jnp.float32)
  return ForgeVariables(kernel=kernel, opt_state=optimizer.init(kernel),
                        count=scalar(0), skipped=scalar(0), intact=scalar(1))


@dataclasses.dataclass(frozen=True)
class FusedDenseSpec:
  """Static configuration of one fused dense call (hashable)."""

  optimizer: ForgeOptimizer
  implementation: str = "auto"
  precision: Any = None
  dtype: Any = None
  #: Static id of the layer, one input of stochastic rounding's hash.
  layer_id: int = 0


def _dense(x, kernel, bias, spec: FusedDenseSpec):
  """``flax.linen.Dense``'s forward, operation for operation."""
  x, kernel, bias = flax_dtypes.promote_dtype(x, kernel, bias, dtype=spec.dtype)
  y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                      precision=spec.precision)
  if bias is not None:
    y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
  return y


def _validate(x, variables: ForgeVariables, bias, spec: FusedDenseSpec,
              layer_index=None):
  if layer_index is not None:
    _validate_stacked(variables, layer_index)
  kernel = stacks.layer_entry(variables.kernel, layer_index)
  if kernel.ndim != 2:
    raise ValueError(f"{kernel.shape=} must be rank 2 ([in_features, features])")
  if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(
        f"{x.shape=} must end in the kernel's in_features {kernel.shape[0]}")
  for name, value in (("x", x), ("kernel", kernel)):
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise TypeError(f"{name}.dtype={value.dtype} must be a floating dtype")
  if bias is not None and bias.shape != (kernel.shape[1],):
    raise ValueError(f"{bias.shape=} must be ({kernel.shape[1]},)")
  if spec.implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{spec.implementation=} must be one of {IMPLEMENTATIONS}")
  if not isinstance(spec.optimizer, ForgeOptimizer):
    raise TypeError(_not_elementwise_message(spec.optimizer))


def _validate_stacked(variables: ForgeVariables, layer_index):
  """Stacks share one leading layer axis; the index is an integer scalar."""
  if jnp.ndim(layer_index) != 0 or not jnp.issubdtype(
      jnp.result_type(layer_index), jnp.integer):
    raise TypeError(f"layer_index={layer_index!r} must be an integer scalar")
  if jnp.ndim(variables.kernel) != 3:
    raise ValueError(f"{variables.kernel.shape=} must be rank 3 ([layers, "
                     "in_features, features]) with a layer_index")
  layers = variables.kernel.shape[0]
  for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
    if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != layers:
      raise ValueError(
          f"variables{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}: "
          f"with a layer_index every leaf must be stacked on a leading axis "
          f"of {layers} layers")


def _not_elementwise_message(optimizer) -> str:
  text = (f"optimizer={optimizer!r} must be a forge_jax optimizer "
          "(fj.adamw, fj.sgd, ...). FORGE applies the update tile by tile "
          "inside the weight-gradient GEMM, so only elementwise rules can be "
          "fused; optax transformations that need the whole gradient "
          "(clip_by_global_norm, adafactor, ...) cannot.")
  if "MultiSteps" in type(optimizer).__name__ or "MultiSteps" in repr(optimizer):
    text += (" Gradient accumulation (optax.MultiSteps) cannot work either: "
             "FORGE never stores the gradient it would have to accumulate. "
             "Use a larger micro-batch instead; FORGE frees the gradient "
             "memory to make room for it.")
  return text


def forge_dense(x: jax.Array, variables: ForgeVariables,
                bias: Optional[jax.Array], spec: FusedDenseSpec,
                layer_index: Optional[jax.Array] = None) -> jax.Array:
  """``x @ kernel + bias``; differentiating it w.r.t. ``variables`` steps them.

  Args:
    x: ``[..., in_features]`` inputs.
    variables: the layer's :class:`ForgeVariables`; with a ``layer_index``,
      stacks of them (every leaf on a leading layer axis).
    bias: ``[features]`` or None. Its gradient is an ordinary gradient.
    spec: static configuration (optimizer, implementation, precision, dtype).
    layer_index: None, or an int32 scalar: the layer of the stacks to use
      and step (its cotangent is zero).

  Returns:
    ``[..., features]``, bit for bit what ``flax.linen.Dense`` computes. The
    cotangent returned for ``variables`` is the *updated* variables (with a
    ``layer_index``: the stacks, that layer updated).
  """
  _validate(x, variables, bias, spec, layer_index)
  from forge_jax import parallel  # pylint: disable=import-outside-toplevel
  parallel.check_unpartitioned(x, variables)
  return _forge_dense(spec, x, variables, bias, layer_index)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _forge_dense(spec, x, variables, bias, layer_index):
  return _dense(x, stacks.layer_entry(variables.kernel, layer_index), bias, spec)


def check_differentiated(x, variables, bias):
  """Raise when inputs or bias are differentiated but the kernel is not.

  Takes the ``CustomVJPPrimal`` wrappers a ``symbolic_zeros`` fwd rule sees.
  """
  kernel_perturbed = variables.kernel.perturbed
  others_perturbed = x.perturbed or (bias is not None and bias.perturbed)
  if others_perturbed and not kernel_perturbed:
    raise ValueError(
        "A ForgeDense kernel is not being differentiated while its inputs or "
        "bias are: FORGE would silently train nothing. Differentiate with "
        "respect to all variables, e.g. jax.grad(loss)(variables) with "
        "variables = {'params': ..., '_overwrite_with_gradient': ...} "
        "(TrainState.params when created from the whole variables dict), "
        "not variables['params'] alone.")


def primal_values(tree):
  """The values inside a fwd rule's ``CustomVJPPrimal`` wrappers."""
  return jax.tree.map(
      lambda p: p.value, tree,
      is_leaf=lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal))


def _forge_dense_fwd(spec, x, variables, bias, layer_index):
  check_differentiated(x, variables, bias)
  x, variables, bias, layer_index = primal_values(
      (x, variables, bias, layer_index))
  # The dot itself, not a nested call of the custom_vjp: remat policies
  # (``dots_saveable``, ...) see a dot_general and may save its output.
  y = _dense(x, stacks.layer_entry(variables.kernel, layer_index), bias, spec)
  return y, (x, variables, bias, layer_index)


def order_after(dx):
  """A scalar True that depends on ``dx`` (True if ``dx`` is None).

  The update overwrites the kernel in place, so it must run after dx, the
  last reader of the old kernel, or XLA copies the kernel. dx comes from a
  dot, which XLA does not duplicate: one element of it is enough.
  """
  if dx is None:
    return True
  return true_after(dx.reshape(-1)[0])


def step_scalars(spec: FusedDenseSpec, variables: ForgeVariables,
                 layer_index=None):
  """This step's optimizer scalars, the learning rate poisoned if wiped.

  A wiped layer (zeros written over it) gets a NaN learning rate: its
  kernel turns NaN, and so does the loss, from the next step on. Poisoning
  a per-step scalar costs nothing; poisoning the output would cost a pass
  over the activations.
  """
  scalars = spec.optimizer.scalars(layer_step(variables, layer_index))
  intact = stacks.layer_entry(variables.intact, layer_index)
  return scalars._replace(neg_lr=scalars.neg_lr * jnp.where(
      intact > 0, 1.0, jnp.nan).astype(scalars.neg_lr.dtype))


def layer_step(variables: ForgeVariables, layer_index=None) -> jax.Array:
  """The layer's step count as an int32 scalar."""
  return stacks.layer_entry(variables.count, layer_index).astype(jnp.int32)


def stepped(variables: ForgeVariables, new_kernel, new_state, skipped,
            apply, layer_index=None) -> ForgeVariables:
  """The layer's variables after a step (``count`` advances if applied).

  With a ``layer_index``, ``new_kernel`` and ``new_state`` are the stacks
  and only the layer's ``count`` and ``skipped`` entries change.
  """
  count = stacks.layer_entry(variables.count, layer_index)
  return ForgeVariables(
      kernel=new_kernel,
      opt_state=new_state,
      count=stacks.with_layer_entry(
          variables.count, count + apply.astype(jnp.float32), layer_index),
      skipped=stacks.with_layer_entry(
          variables.skipped, skipped.astype(jnp.float32), layer_index),
      intact=variables.intact)


def _forge_dense_bwd(spec, residuals, dy):
  x, variables, bias, layer_index = residuals
  if isinstance(dy, SymbolicZero):
    dy = jnp.zeros(dy.shape, dy.dtype)
  kernel = stacks.layer_entry(variables.kernel, layer_index)
  # dx and dbias exactly as autodiff of flax.linen.Dense, with the old kernel.
  _, dense_vjp = jax.vjp(lambda x, b: _dense(x, kernel, b, spec), x, bias)
  dx, dbias = dense_vjp(dy)
  after_dx = order_after(dx)
  apply = jnp.logical_and(jnp.all(jnp.isfinite(dy)), after_dx)
  scalars = step_scalars(spec, variables, layer_index)
  x_c, _, _ = flax_dtypes.promote_dtype(x, kernel, None, dtype=spec.dtype)
  backend = backends.select(spec.implementation, x_c, dy, kernel,
                            spec.optimizer)
  new_kernel, new_state, skipped = backend(
      spec, x_c, dy, variables.kernel, variables.opt_state, scalars, apply,
      step=layer_step(variables, layer_index), layer_index=layer_index)
  new_variables = stepped(variables, new_kernel, new_state, skipped, apply,
                          layer_index)
  return dx, new_variables, dbias, None


_forge_dense.defvjp(_forge_dense_fwd, _forge_dense_bwd, symbolic_zeros=True)
