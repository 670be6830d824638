"""The Mosaic GPU kernel (GPU interpret mode on CPU) against the XLA reference.

``mosaic_kernel.mosaic_update`` has ``backends.xla_update``'s contract. On
CPU it runs in Mosaic GPU's interpret mode, which simulates the CTAs'
warpgroups, shared memory, TMA copies and barriers, so the persistent tile
loop, the warp-specialized pipeline and the epilogue's load/update/store
sequence (single- and double-buffered) are checked here. One part is not:
the interpreter's wgmma takes no transposed operand, so there x arrives
transposed (``mosaic_update``'s interpret path); the GPU tests and
``benchmarks/kernel_bench.py --suite mosaic`` check the transposed wgmma.

Tolerances are test_kernel.py's (a float32 sum in another order). Each call
takes a few seconds, so the table is the optimizers, not their product with
every dtype; shapes are the smallest that span several tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax as fj
from forge_jax.ops import backends, mosaic_kernel
from forge_jax.ops.fused_dense import FusedDenseSpec

from conftest import assert_bitwise_equal, bits, host_copy
from test_kernel import (BF16, F32, OPTIMIZERS, assert_leaves_match,
                         random_inputs, run_reference)
from test_low_precision import exact_inputs

# 64 x 64 parts, two compute warpgroups: a CTA tile is 64 x 128. K = 128,
# N = 256, 128 tokens: 2 x 2 tiles on two CTAs, 2 pipeline steps each, and
# two 64 x 32 epilogue sub-tiles per part.
SMALL = dict(tile_k=64, tile_n=64, tile_t=64, max_concurrent_steps=2,
             epilogue_k=64, epilogue_n=32)
CONFIGS = {
    "double-buffered": mosaic_kernel.MosaicConfig(**SMALL),
    "single-buffered": mosaic_kernel.MosaicConfig(**SMALL, epilogue_slots=1),
    "one-warpgroup": mosaic_kernel.MosaicConfig(**SMALL, compute_wgs=1),
}
X_SHAPE, N = (2, 64, 128), 256


def run_mosaic(opt, x, dy, kernel, state, count, config, layer_index=None,
               step=None, offset=None, layer_id=0):
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic",
                        layer_id=layer_id)
  apply = jnp.all(jnp.isfinite(dy))
  scalars = opt.scalars(jnp.asarray(count, jnp.int32))
  fn = jax.jit(functools.partial(mosaic_kernel.mosaic_update, spec,
                                 config=config, interpret=True,
                                 layer_index=layer_index, offset=offset))
  return host_copy(fn(x, dy, kernel, state, scalars, apply, step=step))


def run_reference_at(opt, x, dy, kernel, state, count, step, offset=None,
                     layer_id=0):
  """The reference with stochastic rounding's step, offset and layer id."""
  spec = FusedDenseSpec(optimizer=opt, implementation="xla",
                        layer_id=layer_id)
  fn = jax.jit(functools.partial(backends.xla_update, spec, offset=offset))
  return host_copy(fn(x, dy, kernel, state,
                      opt.scalars(jnp.asarray(count, jnp.int32)),
                      jnp.all(jnp.isfinite(dy)), step=step))


@pytest.mark.parametrize("name,opt,count", OPTIMIZERS,
                         ids=[name for name, _, _ in OPTIMIZERS])
def test_mosaic_kernel_matches_reference(name, opt, count, seed):
  dtypes = (F32, F32, BF16)  # wgmma takes 16-bit activations
  config = CONFIGS["double-buffered"]
  if name.startswith("rmsprop-centered"):
    config = CONFIGS["single-buffered"]  # four state tensors: less smem
  inputs = random_inputs(seed, opt, X_SHAPE, N, dtypes)
  old_kernel = np.asarray(inputs[2]).copy()
  expected = run_reference(opt, *inputs, count)
  actual = run_mosaic(opt, *inputs, count, config)
  assert_leaves_match(actual, expected, name)
  assert int(actual[2]) == int(expected[2]) == 0
  assert (bits(actual[0]) != bits(old_kernel)).mean() > 0.5


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_mosaic_configs_and_bf16_storage(config, seed):
  opt = fj.adamw(0.05, weight_decay=0.1)
  inputs = random_inputs(seed, opt, X_SHAPE, N, (BF16, BF16, BF16))
  expected = run_reference(opt, *inputs, 3)
  actual = run_mosaic(opt, *inputs, 3, CONFIGS[config])
  assert_leaves_match(actual, expected, config)


def test_mosaic_skips_and_counts_nonfinite_gradient_elements(seed):
  opt = fj.adamw(0.05)
  x, dy, kernel, state = random_inputs(seed, opt, X_SHAPE, N, (F32, F32, BF16))
  x = x.at[0, 3, 17].set(jnp.nan)  # row 17 of dW is NaN: N elements skipped
  expected = run_reference(opt, x, dy, kernel, state, 2)
  actual = run_mosaic(opt, x, dy, kernel, state, 2, CONFIGS["double-buffered"])
  assert int(expected[2]) == int(actual[2]) == N
  np.testing.assert_array_equal(bits(actual[0])[17], bits(kernel)[17])
  rows = np.arange(kernel.shape[0]) != 17
  for a, e in zip(jax.tree.leaves(actual[:2]), jax.tree.leaves(expected[:2])):
    np.testing.assert_allclose(np.asarray(a)[rows], np.asarray(e)[rows],
                               rtol=1e-5, atol=1e-6)


def test_mosaic_stacked_layer_updates_only_its_entry(seed):
  opt = fj.adamw(0.05)
  x, dy, kernel, state = random_inputs(seed, opt, X_SHAPE, N, (F32, F32, BF16))
  stack = lambda a: jnp.stack([a, a + 1.0, a - 1.0])
  kernels, states = stack(kernel), jax.tree.map(stack, state)
  layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  expected = run_reference(opt, x, dy, kernels[1], layer(states, 1), 2)
  actual = run_mosaic(opt, x, dy, kernels, states, 2,
                      CONFIGS["double-buffered"], layer_index=jnp.int32(1))
  assert_leaves_match((actual[0][1], layer(actual[1], 1)), expected, "layer 1")
  for i in (0, 2):  # the other layers are untouched, bit for bit
    for a, b in zip(jax.tree.leaves(layer(actual[:2], i)),
                    jax.tree.leaves(layer((kernels, states), i))):
      np.testing.assert_array_equal(bits(a), bits(b))


# ---------------------------------------------------------------------------
# Low precision: stochastically rounded bf16 weights (and int8 states) give
# the reference's bits. x and dy are exact_inputs (dW is exact in any
# summation order), so any differing bit would be the kernel's storage path.


def assert_same_bits(actual, expected, what):
  names = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(expected)[0]]
  for name, a, e in zip(names, jax.tree.leaves(actual),
                        jax.tree.leaves(expected)):
    assert_bitwise_equal(np.atleast_1d(a), np.atleast_1d(e), f"{what} {name}")


def run_lowp_steps(opt, seed, config, counts=(4, 5), offset=None):
  """Consecutive steps, each from the reference's previous weights and
  state: the kernel writes the reference's bits, and the steps move the
  weights."""
  k, n = X_SHAPE[-1], N
  w = (0.5 * jax.random.normal(jax.random.key(seed), (k, n))).astype(BF16)
  state = opt.init(w)
  for count in counts:
    x, dy = exact_inputs(seed + count, X_SHAPE, n, BF16)
    step = jnp.int32(count)
    expected = run_reference_at(opt, x, dy, w, state, count, step, offset,
                                layer_id=9)
    actual = run_mosaic(opt, x, dy, w, state, count, config, step=step,
                        offset=offset, layer_id=9)
    assert_same_bits(actual, expected, f"count={count}")
    assert (bits(expected[0]) != bits(w)).mean() > 0.3
    w, state = jax.tree.map(jnp.asarray, expected[:2])
  return w, state


SR_OPTIMIZERS = {
    "adamw": fj.adamw(0.05, weight_decay=0.1, weight_rounding="stochastic",
                      rounding_seed=11),
    "lion": fj.lion(0.05, weight_rounding="stochastic", rounding_seed=3),
}


@pytest.mark.parametrize("name,offset", [("adamw", None),
                                         ("lion", (4096, 512))],
                         ids=["adamw-whole", "lion-shard-offset"])
def test_mosaic_stochastic_rounding_matches_reference_bits(name, offset,
                                                           seed):
  """Two steps (a new draw each); a tensor-parallel shard at a global
  offset hashes the global indices, as the reference does."""
  run_lowp_steps(SR_OPTIMIZERS[name], seed, CONFIGS["double-buffered"],
                 offset=offset)


def test_mosaic_stochastic_rounding_of_a_stacked_layer(seed):
  opt = SR_OPTIMIZERS["adamw"]
  x, dy = exact_inputs(seed, X_SHAPE, N, BF16)
  w = (0.5 * jax.random.normal(jax.random.key(seed), (X_SHAPE[-1], N)))
  kernels = jnp.stack([w, w + 1.0, w - 1.0]).astype(BF16)
  states = opt.init(kernels)
  step, offset = jnp.int32(7), (128, 256)
  expected = run_reference_at(opt, x, dy, kernels[2], jax.tree.map(
      lambda a: a[2], states), 7, step, offset, layer_id=9)
  actual = run_mosaic(opt, x, dy, kernels, states, 7,
                      CONFIGS["single-buffered"], layer_index=jnp.int32(2),
                      step=step, offset=offset, layer_id=9)
  layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  assert_same_bits(layer(actual[:2], 2), expected[:2], "layer 2")
  assert_same_bits(layer(actual[:2], 0), layer((kernels, states), 0),
                   "layer 0")


def test_mosaic_refuses_what_it_cannot_run_and_auto_falls_back():
  opt = fj.adamw(1e-3)
  x = jnp.zeros((128, 128), BF16)
  kernel = jnp.zeros((128, 256), F32)
  for supported in (opt, SR_OPTIMIZERS["adamw"]):
    assert mosaic_kernel.unsupported_reason(x, x[:, :1].repeat(256, 1),
                                            kernel, supported) is None
  odd = jnp.zeros((128, 200), F32)
  with pytest.raises(ValueError, match=r"features=200 must be a multiple"):
    backends.select("mosaic", x, jnp.zeros((128, 200), BF16), odd, opt)
  with pytest.raises(ValueError, match=r"x.dtype=float32 must be bfloat16"):
    backends.select("mosaic", x.astype(F32), x.astype(F32), kernel, opt)
  int8 = fj.adamw(1e-3, state_dtype="int8")
  with pytest.raises(ValueError, match=r"int8 states run on"):
    backends.select("mosaic", x, x[:, :1].repeat(256, 1), kernel, int8)
  # Off-GPU 'auto' is the reference.
  assert backends.select("auto", x, x, kernel, opt) is backends.xla_update


@pytest.mark.gpu
@pytest.mark.parametrize("name,opt,count", OPTIMIZERS,
                         ids=[name for name, _, _ in OPTIMIZERS])
def test_compiled_mosaic_kernel_matches_reference_on_gpu(name, opt, count,
                                                         seed):
  """On sm90+: the compiled kernel (transposed wgmma, TMA, in place) at a
  Llama layer shape."""
  if not backends._on_hopper_or_newer():  # pylint: disable=protected-access
    pytest.skip("needs a Hopper or newer GPU")
  inputs = random_inputs(seed, opt, (2048, 4096), 1024, (F32, F32, BF16))
  expected = run_reference(opt, *inputs, count)
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  scalars = opt.scalars(jnp.asarray(count, jnp.int32))
  fn = jax.jit(functools.partial(mosaic_kernel.mosaic_update, spec),
               donate_argnums=(2, 3))
  actual = host_copy(fn(*inputs, scalars, jnp.all(jnp.isfinite(inputs[1]))))
  assert_leaves_match(actual, expected, name)


@pytest.mark.gpu
def test_auto_selects_mosaic_on_hopper_and_triton_where_it_cannot_run():
  if not backends._on_hopper_or_newer():  # pylint: disable=protected-access
    pytest.skip("needs a Hopper or newer GPU")
  opt = fj.adamw(1e-3)
  x = jnp.zeros((2048, 4096), BF16)
  dy = jnp.zeros((2048, 1024), BF16)
  kernel = jnp.zeros((4096, 1024), BF16)
  assert backends.select("auto", x, dy, kernel, opt) is (
      mosaic_kernel.mosaic_update)
  int8 = fj.adamw(1e-3, state_dtype="int8")
  assert backends.select("auto", x, dy, kernel, int8) is not (
      mosaic_kernel.mosaic_update)
