"""``opt.to_optax()`` of every optimizer and variant is the optax alias.

fused_dense_test_base.OPTAX_CASES holds one row per optimizer and variant;
for each, ``fj.<name>(**kwargs).to_optax()`` steps exactly (bit for bit,
updates and state) as ``optax.<name>(**kwargs)``. Training through
ForgeDense against the optax alias, on every backend, is the base's
``test_matches_optax``, run by test_fused_dense.py; the reference rule
itself steps a kernel as the optax alias does, bit for bit where XLA
compiles both alike.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax as fj
from forge_jax.ops.update import apply_update

from fused_dense_test_base import BF16_STATE_RTOL, OPTAX_CASES


@pytest.mark.parametrize(
  "form",
  [lambda opt: opt.to_optax(), fj.optax_with_storage],
  ids=["to_optax", "optax_with_storage"],
)
def test_equal_optimizers_share_one_alias_unless_their_masks_differ(form):
  """Optimizer equality leaves the decay mask out (the layers decay every
  kernel): equal optimizers share one alias object (one
  ``optax_with_storage`` transformation) only with the same mask object,
  and a mask given as a tree masks as optax's does."""
  no_bias = lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
  assert form(fj.adamw(1e-2)) is form(fj.adamw(1e-2))
  assert form(fj.adamw(1e-2)) is not form(fj.adamw(2e-2))
  masked = fj.adamw(1e-2, weight_decay=0.1, mask=no_bias)
  assert form(masked) is form(masked)
  assert masked == fj.adamw(1e-2, weight_decay=0.1)
  assert form(masked) is not form(fj.adamw(1e-2, weight_decay=0.1))
  tree = {"fc": {"kernel": True, "bias": False}}
  params = {"fc": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)}}
  zeros = jax.tree.map(jnp.zeros_like, params)
  tx = form(fj.adamw(1e-2, weight_decay=0.1, mask=tree))
  assert tx is not form(fj.adamw(1e-2, weight_decay=0.1, mask=dict(tree)))
  updates, _ = tx.update(zeros, tx.init(params), params)
  assert float(jnp.abs(updates["fc"]["bias"]).max()) == 0.0
  assert float(jnp.abs(updates["fc"]["kernel"]).max()) > 0.0


@pytest.mark.parametrize("case", OPTAX_CASES, ids=[c.id for c in OPTAX_CASES])
def test_to_optax_is_the_optax_alias(case, seed):
  """``opt.to_optax()`` steps exactly as ``optax.<name>(**kwargs)``."""
  opt = getattr(fj, case.name)(**case.kwargs)
  ours, theirs = opt.to_optax(), getattr(optax, case.name)(**case.kwargs)
  keys = jax.random.split(jax.random.key(seed), 8)
  params = {
    "fc1": {
      "kernel": jax.random.normal(keys[0], (5, 3)),
      "bias": jax.random.normal(keys[1], (3,)),
    }
  }
  state_a, state_b = ours.init(params), theirs.init(params)
  for i in range(3):
    grads = jax.tree.map(
      lambda p, k=keys[2 + i]: jax.random.normal(k, p.shape), params
    )
    upd_a, state_a = ours.update(grads, state_a, params)
    upd_b, state_b = theirs.update(grads, state_b, params)
    chex.assert_trees_all_equal(upd_a, upd_b)
    chex.assert_trees_all_equal(state_a, state_b)
    params = optax.apply_updates(params, upd_a)


#: Rows whose rule XLA contracts into other multiply-adds than optax's graph
#: (Nesterov look-aheads, one centered RMSprop): one float32 rounding apart.
CONTRACTED_OTHERWISE = {
  "adam(lr=0.01,nesterov=True)-r2",
  "nadam(lr=0.01)-r3",
  "nadamw(lr=schedule,weight_decay=0.1)-r2",
  "radam(lr=0.01,b2=0.9,nesterov=True)-r3",
  "rmsprop(lr=0.01,centered=True)-r2",
}


def _tolerance(case):
  """None where the reference rule must step optax's bits; else the rtol:
  bfloat16 states (optax multiplies them in bfloat16, FORGE rounds once) and
  :data:`CONTRACTED_OTHERWISE`."""
  kwargs = case.kwargs
  if jnp.bfloat16 in (kwargs.get("mu_dtype"), kwargs.get("accumulator_dtype")):
    return BF16_STATE_RTOL
  return 2e-6 if case.id in CONTRACTED_OTHERWISE else None


@pytest.mark.skipif(
  jax.default_backend() != "cpu",
  reason="which multiply-adds XLA contracts is the CPU backend's",
)
@pytest.mark.parametrize("case", OPTAX_CASES, ids=[c.id for c in OPTAX_CASES])
def test_reference_rule_steps_optax_bits(case, seed):
  """The XLA reference rule (``apply_update``) and the optax alias, both
  jitted, step a float32 kernel from the same gradients: bit for bit (a
  bias correction multiplies by its reciprocal, which is how XLA computes
  optax's division by a broadcast scalar), or to one float32 rounding where
  the two graphs contract differently."""
  opt = getattr(fj, case.name)(**case.kwargs)
  tx = getattr(optax, case.name)(**case.kwargs)
  keys = jax.random.split(jax.random.key(seed), 7)
  kernel = jax.random.normal(keys[0], (24, 40))
  forge_state, optax_state = opt.init(kernel), tx.init(kernel)

  @jax.jit
  def forge_step(kernel, state, count, grad):
    new_kernel, new_state, _ = apply_update(
      opt, grad, kernel, state, opt.scalars(count), jnp.bool_(True)
    )
    return new_kernel, new_state

  @jax.jit
  def optax_step(kernel, state, grad):
    updates, state = tx.update(grad, state, kernel)
    return optax.apply_updates(kernel, updates), state

  for step, key in enumerate(keys[1:]):
    grad = jax.random.normal(key, kernel.shape)
    ours, forge_state = forge_step(kernel, forge_state, jnp.int32(step), grad)
    theirs, optax_state = optax_step(kernel, optax_state, grad)
    rtol = _tolerance(case)
    if rtol is None:
      np.testing.assert_array_equal(ours, theirs)
    else:
      np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=rtol)
    kernel = theirs
