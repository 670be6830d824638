"""Training helpers shared by the main job, the benchmarks and the tests.

A FORGE model (ForgeDense projections) and its nn.Dense baseline train with
the same code: differentiate the loss with respect to the *whole* variables
dict and let ``TrainState.apply_gradients`` apply optax to ``params`` and
install FORGE's updated kernels from ``_overwrite_with_gradient``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from forge_jax.optimizers import ForgeOptimizer


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), targets
  ).mean()


def loss_fn(variables, apply_fn: Callable, batch: jax.Array) -> jax.Array:
  """Next-token cross entropy of ``batch [B, T+1]`` (inputs ``[:, :-1]``)."""
  inputs, targets = batch[:, :-1], batch[:, 1:]
  return cross_entropy(apply_fn(variables, inputs), targets)


def create_train_state(
  model: nn.Module,
  tx: optax.GradientTransformation,
  key: jax.Array,
  batch: jax.Array,
) -> TrainState:
  """Init ``model`` on ``batch [B, T+1]`` and wrap all its variables.

  ``params`` of the state is the whole variables dict, so FORGE's collection
  is differentiated (and overwritten) with the rest; ``tx`` sees only
  ``params['params']`` when FORGE's collection is present.
  """
  variables = model.init(key, batch[:, :-1])
  return TrainState.create(apply_fn=model.apply, params=variables, tx=tx)


def train_step(state: TrainState, batch: jax.Array):
  """One step: ``(state, batch) -> (new_state, loss)``. Not jitted."""
  loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, batch)
  return state.apply_gradients(grads=grads), loss


def eval_step(state: TrainState, batch: jax.Array) -> jax.Array:
  """Loss of ``batch`` without training. Not jitted."""
  return loss_fn(state.params, state.apply_fn, batch)


def make_train_step(*, donate: bool = True) -> Callable:
  """The jitted ``train_step`` (state donated when ``donate``).

  One step function serves both variants: it reads the model from
  ``state.apply_fn`` and the optax transformation from ``state.tx``, and
  FORGE's optimizer lives inside the model's ForgeDense layers.
  """
  return jax.jit(train_step, donate_argnums=(0,) if donate else ())


def make_eval_step() -> Callable:
  return jax.jit(eval_step)


@dataclasses.dataclass(frozen=True)
class Variant:
  """A model and the optax transformation for its ``params``.

  ``forge``: every projection is a ForgeDense trained inside the backward by
  ``optimizer``; ``tx = optimizer.to_optax()`` trains embedding and norms.
  ``baseline``: nn.Dense projections; ``tx`` trains everything.
  """

  name: str
  model: nn.Module
  tx: optax.GradientTransformation

  def init_state(self, key: jax.Array, batch: jax.Array) -> TrainState:
    return create_train_state(self.model, self.tx, key, batch)

  def train_step(self, donate: bool = True) -> Callable:
    return make_train_step(donate=donate)


def build_variants(
  config, optimizer: ForgeOptimizer, **overrides
) -> dict[str, Variant]:
  """``{'forge': ..., 'baseline': ...}`` for one Llama config.

  Both use ``optimizer.to_optax()`` for their ``params``, so FORGE and the
  baseline share every hyper-parameter; init with the same key gives the same
  weights (ForgeDense initializes like nn.Dense of the same name).
  """
  from examples.lm.llama import make_model  # pylint: disable=import-outside-toplevel

  if not isinstance(optimizer, ForgeOptimizer):
    raise TypeError(f"{optimizer=} must be a forge_jax optimizer")
  overrides.pop("forge_optimizer", None)
  forge = make_model(config, forge_optimizer=optimizer, **overrides)
  baseline = make_model(config, forge_optimizer=None, **overrides)
  baseline = baseline.clone(
    config=dataclasses.replace(baseline.config, forge_optimizer=None)
  )
  return {
    "forge": Variant("forge", forge, optimizer.to_optax()),
    "baseline": Variant("baseline", baseline, optimizer.to_optax()),
  }


def memory_stats(compiled) -> dict[str, Optional[int]]:
  """Byte sizes from ``compiled.memory_analysis()`` (None where unavailable)."""
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    analysis = None
  names = (
    "temp_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "generated_code_size_in_bytes",
  )
  stats = {
    name: (None if analysis is None else int(getattr(analysis, name, 0) or 0))
    for name in names
  }
  if analysis is not None:
    stats["peak_estimate_bytes"] = (
      stats["temp_size_in_bytes"]
      + stats["argument_size_in_bytes"]
      + stats["output_size_in_bytes"]
      - stats["alias_size_in_bytes"]
    )
  return stats
