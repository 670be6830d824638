"""``ForgeDense``: a drop-in for ``flax.linen.Dense`` that trains itself."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from forge_jax import quantization
from forge_jax.optimizers import ForgeOptimizer
from forge_jax.ops.fused_dense import (ForgeVariables, FusedDenseSpec,
                                       forge_dense, init_variables,
                                       _not_elementwise_message)

#: The collection that holds every ForgeDense kernel and optimizer state.
#: ``flax.training.train_state.TrainState.apply_gradients`` overwrites it with
#: its "gradient", which FORGE's backward makes the updated variables.
FORGE_COLLECTION = OVERWRITE_WITH_GRADIENT


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
      reference) or 'triton' (the Pallas kernel; interpret mode off-GPU).
    layer_id: static id that seeds stochastic rounding (an optimizer with
      ``weight_rounding='stochastic'``); None: a CRC-32 of the module path.
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

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not isinstance(self.optimizer, ForgeOptimizer):
      raise TypeError(_not_elementwise_message(self.optimizer))
    in_features = jnp.shape(inputs)[-1]
    kernel_shape = (in_features, self.features)
    kernel = self.variable(
        FORGE_COLLECTION, "kernel",
        lambda: self.kernel_init(self.make_rng("params"), kernel_shape,
                                 self.param_dtype)).value
    opt_state = self.variable(FORGE_COLLECTION, "opt_state",
                              self.optimizer.init, kernel).value
    count, skipped, intact = (
        self.variable(FORGE_COLLECTION, name, jnp.full, (), value, jnp.float32).value
        for name, value in (("count", 0.0), ("skipped", 0.0), ("intact", 1.0)))
    bias = (self.param("bias", self.bias_init, (self.features,),
                       self.param_dtype) if self.use_bias else None)
    variables = ForgeVariables(kernel, opt_state, count, skipped, intact)
    self._check_variables(variables, jax.eval_shape(
        functools.partial(init_variables, self.optimizer),
        jax.ShapeDtypeStruct(kernel_shape, self.param_dtype)))
    self._check_single_use(kernel)
    spec = FusedDenseSpec(optimizer=self.optimizer,
                          implementation=self.implementation,
                          precision=self.precision, dtype=self.dtype,
                          layer_id=self._layer_id())
    return forge_dense(inputs, variables, bias, spec)

  def _layer_id(self) -> int:
    if self.optimizer.weight_rounding != "stochastic":
      return 0  # unused: keep the spec (and its jit cache key) as before
    if self.layer_id is not None:
      return int(self.layer_id) & 0xFFFFFFFF
    return quantization.layer_id_from_path(self.path)

  def _check_variables(self, variables: ForgeVariables,
                       expected: ForgeVariables):
    """Shapes and dtypes as init made them: a transformed copy would receive
    the new weights through the transformation's transpose."""
    actual = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), variables)
    wanted = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), expected)
    if jax.tree.structure(actual) != jax.tree.structure(wanted) or actual != wanted:
      raise TypeError(
          f"ForgeDense {self.path!r}: its variables are {actual} but "
          f"{wanted} was expected for param_dtype={self.param_dtype} and "
          f"{self.optimizer!r}. The variables were changed before apply (a "
          "cast, or another optimizer's state): FORGE writes the updated "
          "weights back through whatever produced them, so pass them as "
          "init created them.")

  def _check_single_use(self, kernel):
    # The cotangent of a kernel used twice would be the sum of two updated
    # kernels. Module instances live for one trace, and so does the tracer.
    previous = getattr(self, "_forge_kernel_in_use", None)
    if previous is not None and previous is kernel:
      raise ValueError(
          f"ForgeDense {self.path!r} was called twice in one forward pass. "
          "FORGE updates the kernel inside each call's backward, so a shared "
          "kernel would receive two updates summed together. Use one "
          "ForgeDense per use, or nn.Dense for shared weights.")
    object.__setattr__(self, "_forge_kernel_in_use", kernel)


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
      wiped += [f"{name}[{i}]" for i in np.flatnonzero(flags.reshape(-1) == 0.0)]
  return wiped
