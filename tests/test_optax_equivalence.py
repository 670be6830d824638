"""``opt.to_optax()`` of every optimizer and variant is the optax alias.

fused_dense_test_base.OPTAX_CASES holds one row per optimizer and variant;
for each, ``fj.<name>(**kwargs).to_optax()`` steps exactly (bit for bit,
updates and state) as ``optax.<name>(**kwargs)``. Training through
ForgeDense against the optax alias, on every backend, is the base's
``test_matches_optax``, run by test_fused_dense.py.
"""

from __future__ import annotations

import chex
import jax
import optax
import pytest

import forge_jax as fj

from fused_dense_test_base import OPTAX_CASES


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
