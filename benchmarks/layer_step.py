"""One layer's whole train step: FORGE's backends against nn.Dense + optax.

The step a user with an unrolled model pays per layer: RMSNorm, then a
bias-free dense layer of the Llama-3.1-8B shapes, a sum-of-squares loss,
``jax.value_and_grad`` and the TrainState update, jitted with the state
donated. Variants, timed side by side in one process per case (device
time, medians):

* ``optax``: ``nn.Dense`` + the optax alias of the same AdamW, flax's own
  ``TrainState`` (``fj.TrainState`` would add a pass over ``dW`` for the
  gradient norm it records);
* ``xla``, ``triton``, ``mosaic``: ``fj.ForgeDense`` with that
  implementation, ``fj.TrainState``;
* ``mosaic-rule-free`` (a measurement, not a train step): the Mosaic kernel
  traced without the optimizer's arithmetic and the check of its results
  (``kernel_bench.rule_free_epilogue``: W and state streamed in and out
  unchanged, the skipped counts and norm sums kept): the step's time with a
  rule that costs nothing, a bound for any change to the rule's code;
* ``mosaic-kernel-only`` (a measurement, not a train step): the same model
  through the same Mosaic kernel, its new W and state written straight
  back, without FORGE's per-layer bookkeeping (no step count, skip and
  wipe checks, gradient norm or install): the step's time if that
  bookkeeping cost nothing, a bound for any change to it;
* ``<backend>-untracked`` (``mosaic-untracked``, ``auto-untracked``): that
  backend with ``fj.TrainState(track_grad_norm=False)``, which records no
  gradient norm (nor does flax's ``TrainState`` under ``optax``);
* the result names the backend ``'auto'`` takes for each case.

Each case's ``speedup`` is optax's time over each variant's (> 1: faster
than optax).

  python benchmarks/layer_step.py --out benchmarks/results/layer_step.json
  python benchmarks/layer_step.py --cpu --tokens 16 --shapes 64x32 \\
      --out /tmp/layer_step.json          # smoke test, interpret mode
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import rule_free_epilogue  # noqa: E402
from timing import (  # noqa: E402
  device_time_ms,
  kernel_profile,
  run_grid,
)

import forge_jax as fj  # noqa: E402
from forge_jax.ops import backends, fused_dense  # noqa: E402
from forge_jax.ops.fused_dense import FusedDenseSpec  # noqa: E402

SHAPES = ("4096x4096", "4096x1024", "4096x14336", "14336x4096", "4096x128256")
#: The variant that times the Mosaic kernel without the rule's arithmetic.
RULE_FREE = "mosaic-rule-free"
#: The variant that times the Mosaic kernel without FORGE's bookkeeping.
KERNEL_ONLY = "mosaic-kernel-only"
#: The suffix of the variants whose TrainState records no gradient norm.
UNTRACKED = "-untracked"

#: W / m / v storage: (param dtype, FORGE's state dtype, FORGE's weight
#: rounding, bits of FORGE's second moments). optax keeps bf16 states
#: beside bf16 weights.
STORAGE = {
  "fp32": (jnp.float32, None, "nearest", 8),
  "bf16": (jnp.bfloat16, jnp.bfloat16, "nearest", 8),
  "int8-sr": (jnp.bfloat16, "int8", "stochastic", 8),
  "int8-4bit-sr": (jnp.bfloat16, "int8", "stochastic", 4),
}


def _forge_optimizer(storage):
  _, state_dtype, rounding, bits = STORAGE[storage]
  return fj.adamw(
    1e-4,
    weight_decay=0.1,
    state_dtype=state_dtype,
    weight_rounding=rounding,
    second_moment_bits=bits,
  )


COMPUTE = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


class Layer(nn.Module):
  """RMSNorm, then the dense layer: optax's or FORGE's."""

  features: int
  param_dtype: object
  dtype: object = jnp.bfloat16
  optimizer: object = None  # FORGE's; None: nn.Dense
  implementation: str = "auto"

  @nn.compact
  def __call__(self, x):
    x = nn.RMSNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
    if self.optimizer is None:
      dense = nn.Dense(
        self.features,
        use_bias=False,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
      )
    else:
      dense = fj.ForgeDense(
        self.features,
        self.optimizer,
        use_bias=False,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        implementation=self.implementation,
      )
    return dense(x)


def _loss(apply_fn, params, x):
  y = apply_fn(params, x).astype(jnp.float32)
  return 0.5 * jnp.mean(jnp.square(y))


def make_runner(variant, tokens, k, n, storage, compute="bf16"):
  """A no-argument function running one donated train step per call."""
  if variant == KERNEL_ONLY:
    return _kernel_only_runner(tokens, k, n, storage, compute)
  param_dtype = STORAGE[storage][0]
  opt = _forge_optimizer(storage)
  forge = variant != "optax"
  tracked = not variant.endswith(UNTRACKED)
  implementation = variant if tracked else variant[: -len(UNTRACKED)]
  model = Layer(
    n,
    param_dtype,
    COMPUTE[compute],
    optimizer=opt if forge else None,
    implementation="mosaic" if variant == RULE_FREE else implementation,
  )
  x = jax.random.normal(jax.random.key(0), (tokens, k), COMPUTE[compute])
  variables = jax.jit(model.init)(jax.random.key(1), x)
  if forge:
    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=opt.to_optax(),
      track_grad_norm=tracked,
    )
  else:
    mu_dtype = None if param_dtype == jnp.float32 else jnp.bfloat16
    tx = optax.adamw(1e-4, weight_decay=0.1, mu_dtype=mu_dtype)
    state = train_state.TrainState.create(
      apply_fn=model.apply, params=variables, tx=tx
    )

  def step(state, x):
    loss, grads = jax.value_and_grad(lambda p: _loss(state.apply_fn, p, x))(
      state.params
    )
    return state.apply_gradients(grads=grads), loss

  step = jax.jit(step, donate_argnums=0)
  carry = {"state": state}

  def run():
    carry["state"], loss = step(carry["state"], x)
    return loss

  run.carry = carry  # the current state, for tests
  return run


def _kernel_only_runner(tokens, k, n, storage, compute):
  """:data:`KERNEL_ONLY`'s runner: the :class:`Layer`'s step with the
  dense layer a ``jax.custom_vjp`` whose backward returns ``dx`` and the
  Mosaic kernel's new W and state as their cotangents, written back as
  the new values. The step count stays at 0 (the first step's scalars);
  RMSNorm's scale trains with the optax alias, as ``fj.TrainState``
  trains it.
  """
  param_dtype = STORAGE[storage][0]
  dtype = COMPUTE[compute]
  optimizer = _forge_optimizer(storage)
  spec = FusedDenseSpec(optimizer=optimizer, dtype=dtype)
  scalars = optimizer.scalars(jnp.int32(0))
  x = jax.random.normal(jax.random.key(0), (tokens, k), dtype)
  norm = nn.RMSNorm(dtype=dtype, param_dtype=param_dtype)
  kernel = nn.initializers.lecun_normal()(jax.random.key(1), (k, n))
  kernel = kernel.astype(param_dtype)
  update = backends.select(
    "mosaic", x, jax.ShapeDtypeStruct((tokens, n), dtype), kernel, optimizer
  )

  @jax.custom_vjp
  def dense(h, kernel, opt_state):
    del opt_state
    return h @ kernel.astype(dtype)

  def dense_fwd(h, kernel, opt_state):
    return dense(h, kernel, opt_state), (h, kernel, opt_state)

  def dense_bwd(residuals, dy):
    h, kernel, opt_state = residuals
    dx = dy @ kernel.astype(dtype).T
    apply = fused_dense.backward_finite(dy, dx)
    new_kernel, new_state, _, _ = update(
      spec, h, dy, kernel, opt_state, scalars, apply
    )
    return dx, new_kernel, new_state

  dense.defvjp(dense_fwd, dense_bwd)
  tx = optimizer.to_optax()
  params = {
    "norm": jax.jit(norm.init)(jax.random.key(2), x)["params"],
    "kernel": kernel,
    "opt_state": optimizer.init(kernel),
  }

  def loss_fn(params, x):
    h = norm.apply({"params": params["norm"]}, x)
    y = dense(h, params["kernel"], params["opt_state"])
    return 0.5 * jnp.mean(jnp.square(y.astype(jnp.float32)))

  def step(carry, x):
    params, tx_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, tx_state = tx.update(grads["norm"], tx_state, params["norm"])
    new_norm = optax.apply_updates(params["norm"], updates)
    return ({**grads, "norm": new_norm}, tx_state), loss

  step = jax.jit(step, donate_argnums=0)
  carry = {"state": (params, tx.init(params["norm"]))}

  def run():
    carry["state"], loss = step(carry["state"], x)
    return loss

  run.carry = carry
  return run


def _jitted_afresh(update):
  """``update`` under a jit of its own, instead of the one every call site
  shares (``backends.lowered_once``)."""

  def fresh(spec, *args, **kwargs):
    return update(spec, *args, **kwargs)

  return jax.jit(fresh, static_argnums=0)


@contextlib.contextmanager
def traced_as(variant):
  """The context a variant's runner is built, traced and timed in.

  For :data:`RULE_FREE`, the rule-free epilogue, each kernel call under a
  jit of its own: a process otherwise traces a kernel once per shape (one
  jit shared by every call site), and the rule-free trace would reuse
  another variant's kernel or be left for the next variant's.
  """
  if variant != RULE_FREE:
    yield
    return
  with (
    rule_free_epilogue(),
    mock.patch.object(backends, "lowered_once", _jitted_afresh),
  ):
    yield


def auto_choice(tokens, k, n, storage, compute="bf16"):
  """The backend ``implementation='auto'`` takes for this case."""
  param_dtype = STORAGE[storage][0]
  opt = _forge_optimizer(storage)
  x = jax.ShapeDtypeStruct((tokens, k), COMPUTE[compute])
  dy = jax.ShapeDtypeStruct((tokens, n), COMPUTE[compute])
  kernel = jax.ShapeDtypeStruct((k, n), param_dtype)
  update = backends.select("auto", x, dy, kernel, opt)
  return update.__module__.rsplit(".", 1)[-1] + "." + update.__name__


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--tokens", type=int, nargs="+", default=[512, 2048, 8192]
  )
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument(
    "--storage", nargs="+", default=["fp32", "bf16"], choices=sorted(STORAGE)
  )
  parser.add_argument(
    "--compute",
    nargs="+",
    default=["bf16"],
    choices=sorted(COMPUTE),
    help="the layer's compute dtype (its activations)",
  )
  parser.add_argument(
    "--variants", nargs="+", default=["optax", "xla", "triton", "mosaic"]
  )
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--time-budget-s", type=float, default=0)
  parser.add_argument(
    "--profile",
    action="store_true",
    help="also store each variant's kernels' device time under 'profile'",
  )
  parser.add_argument(
    "--xla-chunk-elements",
    type=int,
    default=backends.XLA_CHUNK_ELEMENTS,
    help="elements of the XLA reference's row chunks (a number past the "
    "largest kernel steps whole kernels)",
  )
  parser.add_argument("--cpu", action="store_true")
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def measure(args, compute, storage, tokens, shape) -> dict:
  """One case's record: each variant's device time (or the error it
  raised), the backend 'auto' takes, and the speedups over optax."""
  k, n = (int(d) for d in shape.split("x"))
  case = {
    "compute": compute,
    "storage": storage,
    "tokens": tokens,
    "k": k,
    "n": n,
    "auto": auto_choice(tokens, k, n, storage, compute),
    "ms": {},
  }
  for variant in args.variants:
    try:
      with traced_as(variant):
        run = make_runner(variant, tokens, k, n, storage, compute)
        timing = device_time_ms(run, calls=args.calls, repeats=args.repeats)
        case["ms"][variant] = timing["ms"]
        if args.profile:
          case.setdefault("profile", {})[variant] = kernel_profile(run)
    except Exception as e:  # a backend that cannot run the case
      case.setdefault("errors", {})[variant] = f"{type(e).__name__}: {e}"[:300]
  if "optax" in case["ms"]:
    case["speedup"] = {
      v: case["ms"]["optax"] / ms for v, ms in case["ms"].items()
    }
  return case


def main(argv=None):
  args = _args(argv)
  if args.cpu:
    jax.config.update("jax_platforms", "cpu")
  backends.XLA_CHUNK_ELEMENTS = args.xla_chunk_elements
  run_grid(
    args,
    ("compute", "storage", "tokens", "shapes"),
    functools.partial(measure, args),
  )


if __name__ == "__main__":
  main()
