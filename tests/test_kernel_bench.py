"""The kernel benchmarks' steps: the XLA reference they check and time
against computes the fused steps' bits."""

import os
import sys

import jax
import jax.numpy as jnp

import forge_jax as fj

from conftest import assert_same_bits, bits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import kernel_bench  # noqa: E402  (benchmarks/ is on sys.path only now)


def test_reference_step_rounds_stochastically_as_the_fused_step():
  """The fused steps pass no rounding key (their kernels draw from key 0);
  the reference step draws from the same key instead of raising for want of
  one."""
  optimizer = fj.adamw(
    1e-3,
    weight_decay=0.1,
    state_dtype=jnp.bfloat16,
    weight_rounding="stochastic",
  )
  x, dy, w = kernel_bench.make_inputs(jax.random.key(0), 64, 64, 128)
  w = w.astype(jnp.bfloat16)
  count = jnp.asarray(0, jnp.int32)
  expected = kernel_bench.reference_step(optimizer)(
    w, optimizer.init(w), count, x, dy
  )
  fused = kernel_bench.fused_step(optimizer, None, interpret=True)(
    jnp.copy(w), optimizer.init(w), count, x, dy
  )
  assert (bits(expected[0]) != bits(w)).mean() > 0.5
  assert_same_bits(fused[:2], expected[:2], "fused step")
