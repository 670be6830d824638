"""Elementwise optimizer rules that FORGE fuses into the weight-gradient GEMM.

Each optimizer mirrors the optax alias of the same name (arguments, defaults,
state, and the order of floating-point operations), split into three pure
pieces so that every backend (XLA reference, Pallas kernels) shares one
definition of the math:

* ``init(kernel)``: the per-element state, a NamedTuple of kernel-shaped arrays.
* ``scalars(count)``: per-step scalars (learning rate, bias corrections, ...),
  computed once per step from ``count``, the number of updates applied so far.
* ``update_state(grad, kernel, state, scalars)`` and
  ``update_kernel(grad, kernel, state, scalars)``: the elementwise rule on
  float32 arrays of any shape (a whole kernel or one register tile), in two
  halves. The kernel half reads the state this step computed (or, for
  Lion, the state from before the step).

``to_optax()`` returns the optax alias with the same arguments, for the
parameters that FORGE does not own (biases, norms, embeddings), so the
optimizer is stated once.

Every optimizer also takes four keyword-only storage options (see
:mod:`forge_jax.quantization`), which apply to the ForgeDense kernels it
trains and not to ``to_optax()`` (:func:`forge_jax.optax_with_storage`
applies them to the other parameters):

* ``state_dtype``: None (the optax alias's dtypes: the kernel's, or
  ``mu_dtype``), ``'float32'``, ``'bfloat16'``, ``'float16'`` (rules
  without a second moment: float16 flushes ``(1 - b2) g**2`` to zero) or
  ``'int8'`` (blocks of 64 with absmax scales; second moments stored as
  their square root).

The rule runs in float32 whatever the storage. With a 16-bit ``mu_dtype``
(``accumulator_dtype``) optax multiplies the stored moment by ``b1`` in
that dtype, ``b1`` rounded to it too, before adding the gradient's term:
there FORGE's moments differ from optax's by that product's rounding
(about 1e-4 relative after a few steps).

Hyperparameters are Python numbers or optax schedules; concrete scalar
arrays are taken as numbers (the optimizers are hashed static arguments).
* ``second_moment_bits`` (the rules with a second moment: adam, adamw,
  nadam, nadamw, radam, rmsprop, adagrad): 8 (default) or 4: with
  ``state_dtype='int8'``, the second moments' square roots on 15 levels, two
  a byte, rounded stochastically.
* ``weight_rounding``: ``'nearest'`` (default) or ``'stochastic'`` (bfloat16
  kernels written with unbiased stochastic rounding).
* ``rounding_seed``: the seed of the stochastic rounding, of the weights and
  of 4-bit levels (uint32).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from forge_jax import quantization

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]
Mask = Optional[Union[Any, Callable[[Any], Any]]]


class EmptyState(NamedTuple):
  """State of a rule that keeps no per-element state (plain SGD)."""


# ---------------------------------------------------------------------------
# Helpers that reproduce optax's scalar arithmetic bit for bit.


def _scheduled(name: str, value: ScalarOrSchedule, count: jax.Array):
  """``value(count)`` for a schedule, else the constant, as a float32
  scalar: a schedule's one-element array too (optax broadcasts it), which
  the fused kernels take among their scalars."""
  if not callable(value):
    return jnp.asarray(value, jnp.float32)
  scheduled = jnp.asarray(value(count), jnp.float32)
  if scheduled.size != 1:
    raise TypeError(
      f"the {name} schedule returned an array of shape {scheduled.shape}: "
      "a schedule gives one number a step"
    )
  return jnp.reshape(scheduled, ())


def _neg_learning_rate(learning_rate: ScalarOrSchedule, count: jax.Array):
  """optax.scale_by_learning_rate: the schedule sees the pre-increment count."""
  return -1 * _scheduled("learning_rate", learning_rate, count)


def _bias_correction(decay: float, count_inc: jax.Array) -> jax.Array:
  """``1 - decay**t`` in float32, as optax.tree.bias_correction computes it."""
  return jnp.asarray(1 - decay**count_inc, jnp.float32)


def _inverse_bias_correction(decay: float, count_inc: jax.Array) -> jax.Array:
  """``1 / (1 - decay**t)`` in float32: the rules multiply a moment by it
  where optax divides by :func:`_bias_correction`, which is how XLA's
  simplifier computes optax's division by a broadcast scalar (on the CPU,
  where a test checks the bits); a division per element would cost the
  fused kernels several instructions, the multiplication one."""
  return 1.0 / _bias_correction(decay, count_inc)


def _validate_count_dtype(count):
  if not jnp.issubdtype(count.dtype, jnp.integer):
    raise TypeError(f"{count.dtype=} must be an integer dtype")


# ---------------------------------------------------------------------------
# Base class.


@dataclasses.dataclass(frozen=True)
class ForgeOptimizer(abc.ABC):
  """An elementwise optimizer rule that FORGE can fuse into a backward GEMM.

  Subclasses are frozen dataclasses (hashable, so they can be static arguments
  of ``jax.jit`` and ``jax.custom_vjp``) whose fields are the optax alias's
  keyword arguments, plus the keyword-only storage options below.

  Attributes:
    state_dtype: storage of every per-element state leaf: None (as optax:
      the kernel's dtype, or ``mu_dtype``), 'float32', 'bfloat16', 'float16'
      (not for a rule with a second moment, which float16 flushes to zero)
      or 'int8' (:mod:`forge_jax.quantization`: 64-element blocks along the
      output axis, an absmax scale each; second moments as ``sqrt``).
    second_moment_bits: 8, or 4 to store int8 second moments (``nu``,
      ``sum_of_squares``) in half a byte an element (15 levels of
      ``sqrt(v)``; first moments stay int8). Needs ``state_dtype='int8'``
      and a rule with a second moment. The levels round stochastically,
      from the same per-element hash as the weights' stochastic rounding
      (``rounding_seed``). Coarser than int8: on the Llama-3.1-8B
      benchmark the loss spikes at learning rates where int8's does not
      (docs/design.md); use it where int8 does not fit.
    weight_rounding: 'nearest' (round to nearest even, the default) or
      'stochastic' (bfloat16 kernels only; float32 kernels need no rounding).
    rounding_seed: seed of the stochastic rounding's hash (0 .. 2**32 - 1).
  """

  state_dtype: Any = dataclasses.field(default=None, kw_only=True)
  second_moment_bits: int = dataclasses.field(default=8, kw_only=True)
  weight_rounding: str = dataclasses.field(default="nearest", kw_only=True)
  rounding_seed: int = dataclasses.field(default=0, kw_only=True)

  #: State fields that are non-negative second moments (int8: sqrt encoding).
  nonnegative_state: ClassVar[tuple[str, ...]] = ()

  def __post_init__(self):
    for field in dataclasses.fields(self):
      object.__setattr__(
        self, field.name, _hyperparameter(field.name, getattr(self, field.name))
      )
    object.__setattr__(
      self, "state_dtype", quantization.canonical_state_dtype(self.state_dtype)
    )
    if self.state_dtype == "float16" and self.nonnegative_state:
      raise ValueError(
        f"state_dtype='float16' cannot hold {type(self).__name__}'s second "
        f"moment ({', '.join(self.nonnegative_state)}): float16 flushes "
        "values below 6e-8 to zero, where the squares of ordinary gradients "
        "(times 1 - b2) fall, and those elements would step by m / eps. "
        "Use 'bfloat16' (float32's range) or 'int8' (stores the square "
        "root)."
      )
    if self.second_moment_bits not in quantization.SECOND_MOMENT_BITS:
      raise ValueError(
        f"second_moment_bits={self.second_moment_bits!r} must be one of "
        f"{quantization.SECOND_MOMENT_BITS}"
      )
    if self.second_moment_bits == 4 and (
      self.state_dtype != "int8" or not self.nonnegative_state
    ):
      raise ValueError(
        "second_moment_bits=4 stores int8 second moments in 4 bits: it "
        f"needs state_dtype='int8' (got {self.state_dtype!r}) and a rule "
        f"with a second moment ({type(self).__name__} has "
        f"{self.nonnegative_state or 'none'})"
      )
    if self.weight_rounding not in quantization.WEIGHT_ROUNDINGS:
      raise ValueError(
        f"weight_rounding={self.weight_rounding!r} must be one "
        f"of {quantization.WEIGHT_ROUNDINGS}"
      )
    if not 0 <= int(self.rounding_seed) < 2**32:
      raise ValueError(
        f"rounding_seed={self.rounding_seed} must be in [0, 2**32)"
      )
    for name in ("mu_dtype", "accumulator_dtype"):
      dtype = getattr(self, name, None)
      if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
          f"{name}={dtype!r} must be a floating dtype (float32, bfloat16, "
          "float16): a moment stored in another would be truncated every "
          "step"
        )
      if self.state_dtype is not None and getattr(self, name, None) is not None:
        raise ValueError(
          f"give state_dtype or {name}, not both "
          f"(state_dtype={self.state_dtype!r}, "
          f"{name}={getattr(self, name)!r})"
        )

  @property
  def draws_random_bits(self) -> bool:
    """Whether a step draws random bits, keyed by the layer's
    :func:`forge_jax.quantization.rounding_key`: stochastic rounding of the
    weights, or of 4-bit second moments' levels."""
    return self.weight_rounding == "stochastic" or self.second_moment_bits == 4

  def _stored(self, state: NamedTuple) -> NamedTuple:
    """``state`` (as the optax alias initializes it) in ``state_dtype``."""
    if self.state_dtype is None:
      return state
    return type(state)(
      **{
        name: quantization.store(
          value,
          self.state_dtype,
          name in self.nonnegative_state,
          self.second_moment_bits,
        )
        for name, value in state._asdict().items()
      }
    )

  @abc.abstractmethod
  def init(self, kernel: jax.Array) -> NamedTuple:
    """Per-element optimizer state for ``kernel`` (no step count)."""

  @abc.abstractmethod
  def scalars(self, count: jax.Array) -> NamedTuple:
    """Per-step float32 scalars from ``count`` (int32, updates applied so far)."""

  #: Whether ``update_kernel`` reads the state from before this step's
  #: ``update_state`` (Lion) rather than the updated one (everything else).
  kernel_reads_old_state: ClassVar[bool] = False

  @abc.abstractmethod
  def update_state(self, grad, kernel, state, scalars) -> NamedTuple:
    """This step's new optimizer state (float32, elementwise)."""

  @abc.abstractmethod
  def update_kernel(self, grad, kernel, state, scalars) -> jax.Array:
    """The new kernel (float32, elementwise), from the new state, or the old
    one if ``kernel_reads_old_state``."""

  def update(
    self, grad, kernel, state, scalars
  ) -> tuple[jax.Array, NamedTuple]:
    """Both halves of the rule: ``(new_kernel, new_state)``."""
    new_state = self.update_state(grad, kernel, state, scalars)
    read = state if self.kernel_reads_old_state else new_state
    return self.update_kernel(grad, kernel, read, scalars), new_state

  def to_optax(self) -> optax.GradientTransformation:
    """The optax alias with the same arguments (for non-FORGE parameters).

    Equal optimizers with the same ``mask`` object (which equality leaves
    out) share one alias object, which ``fj.TrainState`` then knows as
    their rule without stepping a probe through it again."""
    return shared_by_equal_optimizers(type(self).optax_alias, self)

  @abc.abstractmethod
  def optax_alias(self) -> optax.GradientTransformation:
    """A new optax alias with the same arguments."""


def shared_by_equal_optimizers(make: Callable, optimizer: ForgeOptimizer):
  """``make(optimizer)``, one object for equal optimizers with the same
  ``mask`` object (which equality leaves out); a new one where a field is
  unhashable. ``fj.TrainState`` knows such a shared transformation as the
  optimizer's rule by identity."""
  try:
    return _shared(make, optimizer, id(getattr(optimizer, "mask", None)))
  except TypeError:  # an unhashable field
    return make(optimizer)


@functools.lru_cache(maxsize=256)
def _shared(make: Callable, optimizer: ForgeOptimizer, mask_id: int):
  """``make(optimizer)``; ``mask_id`` tells masks apart (the cached
  optimizer holds its mask, so the id is not reused while cached)."""
  del mask_id
  return make(optimizer)


# ---------------------------------------------------------------------------
# Adam family: adam, adamw, nadam, nadamw.


class AdamState(NamedTuple):
  mu: jax.Array
  nu: jax.Array


class AdamScalars(NamedTuple):
  neg_lr: jax.Array
  weight_decay: jax.Array
  inv_bc1: jax.Array  # 1 / (1 - b1**t)
  inv_bc2: jax.Array  # 1 / (1 - b2**t)
  inv_bc1_next: jax.Array  # 1 / (1 - b1**(t+1)), for Nesterov


@dataclasses.dataclass(frozen=True)
class Adam(ForgeOptimizer):
  r"""Adam / AdamW / NAdam / NAdamW, as ``optax.adamw`` computes them.

  With :math:`t = count + 1`:

  .. math::
    m &\leftarrow (1-\beta_1) g + \beta_1 m, \qquad
    v \leftarrow (1-\beta_2) g^2 + \beta_2 v \\
    \hat m &= m / (1-\beta_1^t) \quad\text{or, with Nesterov,}\quad
    \beta_1 \frac{m}{1-\beta_1^{t+1}} + (1-\beta_1)\frac{g}{1-\beta_1^t} \\
    \hat v &= v / (1-\beta_2^t) \\
    w &\leftarrow w - \eta_{count}\left(
      \frac{\hat m}{\sqrt{\hat v + \epsilon_{root}} + \epsilon}
      + \lambda_{count} w\right)

  The bias corrections multiply by their float32 reciprocals
  (:func:`_inverse_bias_correction`).
  """

  learning_rate: ScalarOrSchedule = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  eps_root: float = 0.0
  mu_dtype: Any = None
  weight_decay: ScalarOrSchedule = 0.0
  mask: Mask = dataclasses.field(default=None, compare=False)
  nesterov: bool = False
  decoupled: bool = False  # adamw/nadamw (chain with add_decayed_weights)

  nonnegative_state: ClassVar[tuple[str, ...]] = ("nu",)

  def init(self, kernel):
    mu_dtype = kernel.dtype if self.mu_dtype is None else self.mu_dtype
    return self._stored(
      AdamState(mu=jnp.zeros(kernel.shape, mu_dtype), nu=jnp.zeros_like(kernel))
    )

  def scalars(self, count):
    _validate_count_dtype(count)
    count_inc = optax.safe_increment(count)
    return AdamScalars(
      neg_lr=_neg_learning_rate(self.learning_rate, count),
      weight_decay=_scheduled("weight_decay", self.weight_decay, count),
      inv_bc1=_inverse_bias_correction(self.b1, count_inc),
      inv_bc2=_inverse_bias_correction(self.b2, count_inc),
      inv_bc1_next=_inverse_bias_correction(
        self.b1, optax.safe_increment(count_inc)
      ),
    )

  def update_state(self, grad, kernel, state, s):
    return _adam_moments(self.b1, self.b2, grad, state)

  def update_kernel(self, grad, kernel, state, s):
    mu_hat = _adam_mu_hat(self.b1, self.nesterov, grad, state.mu, s)
    u = mu_hat / _adam_denominator(
      state.nu * s.inv_bc2, self.eps_root, self.eps
    )
    if has_weight_decay(self.weight_decay):
      u = u + s.weight_decay * kernel
    return kernel + s.neg_lr * u

  def optax_alias(self):
    if self.decoupled:
      return optax.adamw(
        self.learning_rate,
        b1=self.b1,
        b2=self.b2,
        eps=self.eps,
        eps_root=self.eps_root,
        mu_dtype=self.mu_dtype,
        weight_decay=self.weight_decay,
        mask=self.mask,
        nesterov=self.nesterov,
      )
    return optax.adam(
      self.learning_rate,
      b1=self.b1,
      b2=self.b2,
      eps=self.eps,
      eps_root=self.eps_root,
      mu_dtype=self.mu_dtype,
      nesterov=self.nesterov,
    )


def _adam_moments(b1, b2, grad, state) -> AdamState:
  return AdamState(
    mu=(1 - b1) * grad + b1 * state.mu, nu=(1 - b2) * (grad**2) + b2 * state.nu
  )


def _adam_mu_hat(b1, nesterov, grad, mu, s):
  if nesterov:
    return b1 * (mu * s.inv_bc1_next) + (1 - b1) * (grad * s.inv_bc1)
  return mu * s.inv_bc1


def _adam_denominator(nu_hat, eps_root: float, eps: float):
  """``sqrt(nu_hat + eps_root) + eps``. A zero ``eps_root`` (the default) is
  not added: adding it only turns -0 into +0, which ``sqrt(.) + eps`` maps
  to the same value, and the fused kernels save an instruction per
  element."""
  return jnp.sqrt(nu_hat + eps_root if eps_root else nu_hat) + eps


def _hyperparameter(name: str, value):
  """``value`` as a field of a (hashable) optimizer: a concrete scalar
  array (``jnp.asarray(1e-3)``, a NumPy scalar), which optax takes, as a
  Python number; anything else unchanged. Refuses traced and non-scalar
  arrays, which a static, hashed optimizer cannot hold."""
  if not isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return value
  if isinstance(value, jax.core.Tracer) or np.ndim(value) != 0:
    raise TypeError(
      f"{name}={value!r}: FORGE's optimizers are static (hashed by jit), so "
      "each hyperparameter is a Python number, a concrete scalar or an "
      "optax schedule (a function of the step count); a traced or "
      "non-scalar array cannot be one. For a value that changes during "
      "training, give a schedule."
    )
  return np.asarray(value).item()


def has_weight_decay(weight_decay) -> bool:
  """Whether a rule with ``weight_decay`` decays at all: optax's
  ``add_decayed_weights`` skips a constant zero; a schedule always
  applies."""
  return callable(weight_decay) or weight_decay != 0.0


# ---------------------------------------------------------------------------
# RAdam.


class RAdamScalars(NamedTuple):
  neg_lr: jax.Array
  inv_bc1: jax.Array
  inv_bc2: jax.Array
  inv_bc1_next: jax.Array
  rect: jax.Array  # the rectification factor r_t (only used when rectify)
  rectify: jax.Array  # 1.0 where rho_t >= threshold, else 0.0


@dataclasses.dataclass(frozen=True)
class RAdam(ForgeOptimizer):
  r"""Rectified Adam, as ``optax.radam`` computes it.

  With :math:`\rho_\infty = 2/(1-\beta_2) - 1` and
  :math:`\rho_t = \rho_\infty - 2 t \beta_2^t / (1-\beta_2^t)`, the step is
  :math:`r_t \hat m / (\sqrt{\hat v + \epsilon_{root}} + \epsilon)` when
  :math:`\rho_t \ge` ``threshold`` and :math:`\hat m` otherwise, with
  :math:`r_t = \sqrt{\frac{(\rho_t-4)(\rho_t-2)\rho_\infty}
  {(\rho_\infty-4)(\rho_\infty-2)\rho_t}}`.
  """

  learning_rate: ScalarOrSchedule = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  eps_root: float = 0.0
  threshold: float = 5.0
  nesterov: bool = False

  nonnegative_state: ClassVar[tuple[str, ...]] = ("nu",)

  def init(self, kernel):
    return self._stored(
      AdamState(mu=jnp.zeros_like(kernel), nu=jnp.zeros_like(kernel))
    )

  def scalars(self, count):
    _validate_count_dtype(count)
    b2 = self.b2
    count_inc = optax.safe_increment(count)
    ro_inf = 2.0 / (1.0 - b2) - 1.0
    b2t = b2**count_inc
    ro = ro_inf - 2 * count_inc * b2t / (1 - b2t)
    rectify = ro >= self.threshold
    # r_t is the square root of a negative number for rho_t < 4: only
    # evaluate it where it is used.
    safe_ro = jnp.where(rectify, ro, ro_inf)
    rect = jnp.sqrt(
      (safe_ro - 4.0)
      * (safe_ro - 2.0)
      * ro_inf
      / ((ro_inf - 4.0) * (ro_inf - 2.0) * safe_ro)
    )
    return RAdamScalars(
      neg_lr=_neg_learning_rate(self.learning_rate, count),
      inv_bc1=_inverse_bias_correction(self.b1, count_inc),
      inv_bc2=_inverse_bias_correction(b2, count_inc),
      inv_bc1_next=_inverse_bias_correction(
        self.b1, optax.safe_increment(count_inc)
      ),
      rect=jnp.asarray(rect, jnp.float32),
      rectify=rectify.astype(jnp.float32),
    )

  def update_state(self, grad, kernel, state, s):
    return _adam_moments(self.b1, self.b2, grad, state)

  def update_kernel(self, grad, kernel, state, s):
    mu_hat = _adam_mu_hat(self.b1, self.nesterov, grad, state.mu, s)
    rectified = (
      s.rect
      * mu_hat
      / _adam_denominator(state.nu * s.inv_bc2, self.eps_root, self.eps)
    )
    # An explicit broadcast: Mosaic GPU lowers no implicit scalar broadcast.
    u = jnp.where(
      jnp.broadcast_to(s.rectify > 0.5, mu_hat.shape), rectified, mu_hat
    )
    return kernel + s.neg_lr * u

  def optax_alias(self):
    return optax.radam(
      self.learning_rate,
      b1=self.b1,
      b2=self.b2,
      eps=self.eps,
      eps_root=self.eps_root,
      threshold=self.threshold,
      nesterov=self.nesterov,
    )


# ---------------------------------------------------------------------------
# Lion.


class LionState(NamedTuple):
  mu: jax.Array


class LionScalars(NamedTuple):
  neg_lr: jax.Array
  weight_decay: jax.Array


@dataclasses.dataclass(frozen=True)
class Lion(ForgeOptimizer):
  r"""Lion, as ``optax.lion`` computes it (``sign(0) = 0``).

  .. math::
    u = \operatorname{sign}((1-\beta_1) g + \beta_1 m), \quad
    m \leftarrow (1-\beta_2) g + \beta_2 m, \quad
    w \leftarrow w - \eta (u + \lambda w)
  """

  learning_rate: ScalarOrSchedule = 1e-4
  b1: float = 0.9
  b2: float = 0.99
  mu_dtype: Any = None
  weight_decay: ScalarOrSchedule = 1e-3
  mask: Mask = dataclasses.field(default=None, compare=False)

  def init(self, kernel):
    mu_dtype = kernel.dtype if self.mu_dtype is None else self.mu_dtype
    return self._stored(LionState(mu=jnp.zeros(kernel.shape, mu_dtype)))

  def scalars(self, count):
    _validate_count_dtype(count)
    return LionScalars(
      neg_lr=_neg_learning_rate(self.learning_rate, count),
      weight_decay=_scheduled("weight_decay", self.weight_decay, count),
    )

  kernel_reads_old_state: ClassVar[bool] = True

  def update_state(self, grad, kernel, state, s):
    return LionState(mu=(1 - self.b2) * grad + self.b2 * state.mu)

  def update_kernel(self, grad, kernel, state, s):
    u = jnp.sign((1.0 - self.b1) * grad + self.b1 * state.mu)
    if has_weight_decay(self.weight_decay):
      u = u + s.weight_decay * kernel
    return kernel + s.neg_lr * u

  def optax_alias(self):
    return optax.lion(
      self.learning_rate,
      b1=self.b1,
      b2=self.b2,
      mu_dtype=self.mu_dtype,
      weight_decay=self.weight_decay,
      mask=self.mask,
    )


# ---------------------------------------------------------------------------
# RMSprop.


class RMSpropState(NamedTuple):
  nu: jax.Array
  mu: Optional[jax.Array] = None  # centered only
  trace: Optional[jax.Array] = None  # momentum only


class RMSpropScalars(NamedTuple):
  neg_lr: jax.Array
  inv_bc: jax.Array  # 1 / (1 - decay**t) (1.0 without bias correction)


@dataclasses.dataclass(frozen=True)
class RMSprop(ForgeOptimizer):
  r"""RMSprop, as ``optax.rmsprop`` computes it.

  .. math::
    v \leftarrow (1-\rho) g^2 + \rho v, \quad
    u = -\eta\, g / \sqrt{\hat v + \epsilon}
    \ \text{(or } -\eta\, g / (\sqrt{\hat v} + \epsilon)
    \text{ with eps_in_sqrt=False)}

  ``centered`` subtracts the squared mean :math:`\hat m^2` inside the root;
  ``momentum`` then accumulates the learning-rate-scaled step:
  :math:`\tau \leftarrow u + \mu\tau`, applying :math:`\tau`
  (or :math:`u + \mu\tau` with Nesterov).
  """

  learning_rate: ScalarOrSchedule = 1e-3
  decay: float = 0.9
  eps: float = 1e-8
  initial_scale: float = 0.0
  eps_in_sqrt: bool = True
  centered: bool = False
  momentum: Optional[float] = None
  nesterov: bool = False
  bias_correction: bool = False

  nonnegative_state: ClassVar[tuple[str, ...]] = ("nu",)

  def __post_init__(self):
    super().__post_init__()
    if self.centered and self.state_dtype == "int8":
      raise ValueError(
        "rmsprop(centered=True) cannot keep int8 states: the variance "
        "nu - mu**2 of separately quantized moments can turn negative. Use "
        "state_dtype='bfloat16' or 'float32'."
      )

  def init(self, kernel):
    return self._stored(
      RMSpropState(
        nu=jnp.full_like(kernel, self.initial_scale),
        mu=jnp.zeros_like(kernel) if self.centered else None,
        trace=jnp.zeros_like(kernel) if self.momentum is not None else None,
      )
    )

  def scalars(self, count):
    _validate_count_dtype(count)
    if self.bias_correction:
      inv_bc = _inverse_bias_correction(self.decay, optax.safe_increment(count))
    else:
      inv_bc = jnp.ones([], jnp.float32)
    return RMSpropScalars(
      neg_lr=_neg_learning_rate(self.learning_rate, count), inv_bc=inv_bc
    )

  def _step(self, grad, nu, mu, s):
    """The learning-rate-scaled step before momentum, from the new moments."""
    nu_hat = nu * s.inv_bc if self.bias_correction else nu
    if self.centered:
      mu_hat = mu * s.inv_bc if self.bias_correction else mu
      var = nu_hat - mu_hat * mu_hat
    else:
      var = nu_hat
    if self.eps_in_sqrt:
      scaling = jax.lax.rsqrt(var + self.eps)
    else:
      scaling = 1 / (jnp.sqrt(var) + self.eps)
    return s.neg_lr * (scaling * grad)

  def update_state(self, grad, kernel, state, s):
    decay = self.decay
    nu = (1 - decay) * (grad**2) + decay * state.nu
    mu = (1 - decay) * grad + decay * state.mu if self.centered else None
    trace = None
    if self.momentum is not None:
      trace = self._step(grad, nu, mu, s) + self.momentum * state.trace
    return RMSpropState(nu=nu, mu=mu, trace=trace)

  def update_kernel(self, grad, kernel, state, s):
    u = self._step(grad, state.nu, state.mu, s)
    if self.momentum is not None:
      u = u + self.momentum * state.trace if self.nesterov else state.trace
    return kernel + u

  def optax_alias(self):
    return optax.rmsprop(
      self.learning_rate,
      decay=self.decay,
      eps=self.eps,
      initial_scale=self.initial_scale,
      eps_in_sqrt=self.eps_in_sqrt,
      centered=self.centered,
      momentum=self.momentum,
      nesterov=self.nesterov,
      bias_correction=self.bias_correction,
    )


# ---------------------------------------------------------------------------
# AdaGrad.


class AdagradState(NamedTuple):
  sum_of_squares: jax.Array


class LearningRateScalars(NamedTuple):
  neg_lr: jax.Array


@dataclasses.dataclass(frozen=True)
class Adagrad(ForgeOptimizer):
  r"""AdaGrad, as ``optax.adagrad`` computes it.

  .. math::
    s \leftarrow s + g^2, \quad
    w \leftarrow w - \eta\, g / \sqrt{s + \epsilon}\ \ (0 \text{ where } s = 0)
  """

  learning_rate: ScalarOrSchedule = 1e-2
  initial_accumulator_value: float = 0.1
  eps: float = 1e-7

  nonnegative_state: ClassVar[tuple[str, ...]] = ("sum_of_squares",)

  def init(self, kernel):
    return self._stored(
      AdagradState(
        sum_of_squares=jnp.full_like(kernel, self.initial_accumulator_value)
      )
    )

  def scalars(self, count):
    _validate_count_dtype(count)
    return LearningRateScalars(
      neg_lr=_neg_learning_rate(self.learning_rate, count)
    )

  def update_state(self, grad, kernel, state, s):
    return AdagradState(sum_of_squares=grad * grad + state.sum_of_squares)

  def update_kernel(self, grad, kernel, state, s):
    sum_of_squares = state.sum_of_squares
    inv_sqrt = jnp.where(
      sum_of_squares > 0, jax.lax.rsqrt(sum_of_squares + self.eps), 0.0
    )
    return kernel + s.neg_lr * (inv_sqrt * grad)

  def optax_alias(self):
    return optax.adagrad(
      self.learning_rate,
      initial_accumulator_value=self.initial_accumulator_value,
      eps=self.eps,
    )


# ---------------------------------------------------------------------------
# SGD.


class TraceState(NamedTuple):
  trace: jax.Array


@dataclasses.dataclass(frozen=True)
class SGD(ForgeOptimizer):
  r"""SGD with optional (Nesterov) momentum, as ``optax.sgd`` computes it.

  .. math::
    \tau \leftarrow g + \mu \tau, \quad
    w \leftarrow w - \eta\,\tau \ \ (\text{or } w - \eta (g + \mu\tau)
    \text{ with Nesterov})
  """

  learning_rate: ScalarOrSchedule = 1e-2
  momentum: Optional[float] = None
  nesterov: bool = False
  accumulator_dtype: Any = None

  def init(self, kernel):
    if self.momentum is None:
      return EmptyState()
    dtype = (
      kernel.dtype if self.accumulator_dtype is None else self.accumulator_dtype
    )
    return self._stored(TraceState(trace=jnp.zeros(kernel.shape, dtype)))

  def scalars(self, count):
    _validate_count_dtype(count)
    return LearningRateScalars(
      neg_lr=_neg_learning_rate(self.learning_rate, count)
    )

  def update_state(self, grad, kernel, state, s):
    if self.momentum is None:
      return EmptyState()
    return TraceState(trace=grad + self.momentum * state.trace)

  def update_kernel(self, grad, kernel, state, s):
    if self.momentum is None:
      return kernel + s.neg_lr * grad
    u = grad + self.momentum * state.trace if self.nesterov else state.trace
    return kernel + s.neg_lr * u

  def optax_alias(self):
    return optax.sgd(
      self.learning_rate,
      momentum=self.momentum,
      nesterov=self.nesterov,
      accumulator_dtype=self.accumulator_dtype,
    )


# ---------------------------------------------------------------------------
# The public constructors: the optax aliases' names, arguments and defaults.


def adam(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  mu_dtype: Any = None,
  *,
  nesterov: bool = False,
  state_dtype: Any = None,
  second_moment_bits: int = 8,
  weight_rounding: str = "nearest",
  rounding_seed: int = 0,
) -> Adam:
  """FORGE version of :func:`optax.adam` (storage options: ForgeOptimizer)."""
  return Adam(
    learning_rate,
    b1,
    b2,
    eps,
    eps_root,
    mu_dtype,
    nesterov=nesterov,
    state_dtype=state_dtype,
    second_moment_bits=second_moment_bits,
    weight_rounding=weight_rounding,
    rounding_seed=rounding_seed,
  )


def adamw(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  mu_dtype: Any = None,
  weight_decay: ScalarOrSchedule = 1e-4,
  mask: Mask = None,
  *,
  nesterov: bool = False,
  state_dtype: Any = None,
  second_moment_bits: int = 8,
  weight_rounding: str = "nearest",
  rounding_seed: int = 0,
) -> Adam:
  """FORGE version of :func:`optax.adamw` (storage options: ForgeOptimizer).

  ``mask`` is handed to the optax equivalent (``to_optax()``) for the
  parameters optax owns; every ForgeDense kernel is decayed, and a mask
  (a function of the parameters, or a pytree of them or of a prefix) that
  leaves a layer's kernel out (asked at the path where ``nn.Dense`` keeps
  it) is refused when the layer's update is installed.
  """
  return Adam(
    learning_rate,
    b1,
    b2,
    eps,
    eps_root,
    mu_dtype,
    weight_decay=weight_decay,
    mask=mask,
    nesterov=nesterov,
    decoupled=True,
    state_dtype=state_dtype,
    second_moment_bits=second_moment_bits,
    weight_rounding=weight_rounding,
    rounding_seed=rounding_seed,
  )


nadam = functools.partial(adam, nesterov=True)
nadam.__doc__ = "FORGE version of :func:`optax.nadam`."
nadamw = functools.partial(adamw, nesterov=True)
nadamw.__doc__ = "FORGE version of :func:`optax.nadamw`."


def radam(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  threshold: float = 5.0,
  *,
  nesterov: bool = False,
  state_dtype: Any = None,
  second_moment_bits: int = 8,
  weight_rounding: str = "nearest",
  rounding_seed: int = 0,
) -> RAdam:
  """FORGE version of :func:`optax.radam` (storage options: ForgeOptimizer)."""
  return RAdam(
    learning_rate,
    b1,
    b2,
    eps,
    eps_root,
    threshold,
    nesterov=nesterov,
    state_dtype=state_dtype,
    second_moment_bits=second_moment_bits,
    weight_rounding=weight_rounding,
    rounding_seed=rounding_seed,
  )


def lion(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.99,
  mu_dtype: Any = None,
  weight_decay: ScalarOrSchedule = 1e-3,
  mask: Mask = None,
  *,
  state_dtype: Any = None,
  weight_rounding: str = "nearest",
  rounding_seed: int = 0,
) -> Lion:
  """FORGE version of :func:`optax.lion` (``mask`` as for :func:`adamw`;
  storage options: ForgeOptimizer)."""
  return Lion(
    learning_rate,
    b1,
    b2,
    mu_dtype,
    weight_decay,
    mask,
    state_dtype=state_dtype,
    weight_rounding=weight_rounding,
    rounding_seed=rounding_seed,
  )


def rmsprop(
  learning_rate: ScalarOrSchedule,
  decay: float = 0.9,
  eps: float = 1e-8,
  initial_scale: float = 0.0,
  eps_in_sqrt: bool = True,
  centered: bool = False,
  momentum: Optional[float] = None,
  nesterov: bool = False,
  bias_correction: bool = False,
  *,
  state_dtype: Any = None,
  second_moment_bits: int = 8,
  weight_rounding: str = "nearest",
  rounding_seed: int = 0,
) -> RMSprop:
  """FORGE version of :func:`optax.rmsprop` (storage options:
  ForgeOptimizer)."""
  return RMSprop(
    learning_rate,
    decay,
    eps,
    initial_scale,
    eps_in_sqrt,
    centered,
    momentum,
    nesterov,
    bias_correction,
    state_dtype=state_dtype,
    second_moment_bits=second_moment_bits,
    weight_rounding=weight_rounding,
    rounding_seed=rounding_seed,
  )


def adagrad(
  learning_rate: ScalarOrSchedule,
  initial_accumulator_value: float = 0.1,
  eps: float = 1e-7,
  *,
  state_dtype: Any = None,
  second_moment_bits: int = 8,
  weight_rounding: str = "nearest",
  rounding_seed: int = 0,
) -> Adagrad:
  """FORGE version of :func:`optax.adagrad` (storage options:
  ForgeOptimizer)."""
  return Adagrad(
    learning_rate,
    initial_accumulator_value,
    eps,
    state_dtype=state_dtype,
    second_moment_bits=second_moment_bits,
    weight_rounding=weight_rounding,
    rounding_seed=rounding_seed,
  )


def sgd(
  learning_rate: ScalarOrSchedule,
  momentum: Optional[float] = None,
  nesterov: bool = False,
  accumulator_dtype: Any = None,
  *,
  state_dtype: Any = None,
  weight_rounding: str = "nearest",
  rounding_seed: int = 0,
) -> SGD:
  """FORGE version of :func:`optax.sgd` (storage options: ForgeOptimizer)."""
  return SGD(
    learning_rate,
    momentum,
    nesterov,
    accumulator_dtype,
    state_dtype=state_dtype,
    weight_rounding=weight_rounding,
    rounding_seed=rounding_seed,
  )


# ---------------------------------------------------------------------------
# Recognizing optax transformations (for clear errors).

#: The optax alias each forge_jax optimizer twins, by the name of the rule
#: inside the alias's chain.
_TWINS = {
  "scale_by_adam": "adamw / adam / nadamw / nadam",
  "scale_by_radam": "radam",
  "scale_by_lion": "lion",
  "scale_by_rms": "rmsprop",
  "scale_by_stddev": "rmsprop",
  "scale_by_rss": "adagrad",
  "trace": "sgd",
}

#: Transformations that need the whole gradient (or hold it across steps):
#: FORGE's layers never form it.
WHOLE_GRADIENT_TRANSFORMATIONS = (
  "clip_by_global_norm",
  "apply_if_finite",
  "skip_not_finite",
  "skip_large_updates",
  "MultiSteps",
  "adafactor",
  "scale_by_factored_rms",
  "scale_by_trust_ratio",
  "scale_by_lbfgs",
  "scale_by_shampoo",
  "scale_by_muon",
  "scale_by_sm3",
  "scale_by_backtracking_linesearch",
  "scale_by_zoom_linesearch",
  "scale_by_polyak",
  "scale_by_dog",
  "scale_by_distance_over_gradients",
  "prodigy",
  "sam",
)


def transformation_names(tx, depth: int = 64) -> set:
  """Names of the optax transformations ``tx`` is built from.

  optax builds a transformation from closures (``chain`` closes over its
  members' functions, ``multi_transform`` over a dict of them): the names
  are the outermost function names of every function reachable through
  ``init``/``update`` and their closures, and ``MultiSteps`` for its bound
  methods. Each wrapper adds two or three levels of closures (a
  ``clip_by_global_norm`` in a chain inside ``optax.partition`` inside a
  chain is ten levels down), so ``depth`` reaches well past any nesting
  written by hand; every object is visited once.
  """
  names, seen = set(), set()

  def visit(obj, level):
    if level > depth or id(obj) in seen:
      return
    seen.add(id(obj))
    owner = getattr(obj, "__self__", None)
    if owner is not None and not isinstance(owner, type):
      names.add(type(owner).__name__)
      visit(getattr(owner, "_opt", None), level + 1)
    func = getattr(obj, "__func__", obj)
    qualname = getattr(func, "__qualname__", None)
    if callable(func) and qualname:
      names.add(qualname.split(".<locals>")[0].split(".")[0])
      for cell in getattr(func, "__closure__", None) or ():
        try:
          visit(cell.cell_contents, level + 1)
        except ValueError:  # an empty cell
          pass
    elif isinstance(obj, (tuple, list)):
      for item in obj:
        visit(item, level + 1)
    elif isinstance(obj, Mapping):
      for item in obj.values():
        visit(item, level + 1)
    if hasattr(obj, "init") and hasattr(obj, "update") and not callable(obj):
      visit(obj.init, level + 1)
      visit(obj.update, level + 1)

  if type(tx).__name__ == "MultiSteps":
    names.add("MultiSteps")
  visit(tx, 0)
  return names


def optax_twin(tx) -> Optional[str]:
  """The forge_jax optimizer(s) that twin the optax alias ``tx``, or None."""
  names = transformation_names(tx)
  for rule, twin in _TWINS.items():
    if rule in names:
      return twin
  if "add_decayed_weights" in names:
    return "adamw"
  if names & {"scale_by_learning_rate", "scale"}:
    return "sgd"
  return None


def not_elementwise_message(optimizer) -> str:
  """Why ``optimizer`` cannot be a ForgeDense's optimizer, and what to use."""
  shown = (
    "an optax transformation"
    if isinstance(optimizer, optax.GradientTransformation)
    or hasattr(optimizer, "update")
    else repr(optimizer)
  )
  text = (
    f"optimizer={shown} must be a forge_jax optimizer (fj.adamw, fj.sgd, ...)."
  )
  names = transformation_names(optimizer)
  if "MultiSteps" in names:
    return text + (
      " Gradient accumulation (optax.MultiSteps) cannot work: FORGE never "
      "stores the gradient it would have to accumulate. Use a larger "
      "micro-batch instead; FORGE frees the gradient memory to make room "
      "for it."
    )
  whole = sorted(names.intersection(WHOLE_GRADIENT_TRANSFORMATIONS))
  if whole:
    clip = (
      " Clip by the global norm with fj.TrainState.create(..., "
      "max_grad_norm=max_norm) and state.value_and_grad(loss_fn)."
      if "clip_by_global_norm" in whole
      else ""
    )
    return text + (
      f" It holds {', '.join(whole)}, which needs the whole gradient: "
      "FORGE applies the update tile by tile inside the weight-gradient "
      "GEMM, so only elementwise rules can be fused." + clip
    )
  twin = optax_twin(optimizer)
  if twin is not None:
    twins = " / ".join(f"fj.{name}" for name in twin.split(" / "))
    return text + (
      f" It is an optax alias: its FORGE twin is {twins}, with the same "
      "arguments; opt.to_optax() gives the optax alias back for the "
      "parameters FORGE does not own."
    )
  return text + (
    " FORGE applies the update tile by tile inside the "
    "weight-gradient GEMM, so only elementwise rules can be "
    "fused."
  )
