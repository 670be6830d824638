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

from conftest import bits, host_copy
from test_kernel import (BF16, F32, OPTIMIZERS, assert_leaves_match,
                         random_inputs, run_reference)

# 64 x 64 parts, two compute warpgroups: a CTA tile is 64 x 128. K = 128,
# N = 256, 128 tokens: 2 x 2 tiles on two CTAs, 2 pipeline steps each, and
# two 64 x 32 epilogue sub-tiles per part (four of 64 x 16 when
# double-buffered: two slots, each reused once).
SMALL = dict(tile_k=64, tile_n=64, tile_t=64, max_concurrent_steps=2,
             epilogue_k=64)
CONFIGS = {
    "all-prefetched": mosaic_kernel.MosaicConfig(**SMALL, epilogue_n=32,
                                                 epilogue_slots=2),
    "double-buffered": mosaic_kernel.MosaicConfig(
        **SMALL, epilogue_n=16, epilogue_slots=2, prefetch_step=0),
    "single-buffered": mosaic_kernel.MosaicConfig(**SMALL, epilogue_n=32,
                                                  epilogue_slots=1),
    "one-warpgroup": mosaic_kernel.MosaicConfig(**SMALL, epilogue_n=32,
                                                epilogue_slots=2,
                                                compute_wgs=1),
}
X_SHAPE, N = (2, 64, 128), 256


def run_mosaic(opt, x, dy, kernel, state, count, config, layer_index=None):
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  apply = jnp.all(jnp.isfinite(dy))
  scalars = opt.scalars(jnp.asarray(count, jnp.int32))
  fn = jax.jit(functools.partial(mosaic_kernel.mosaic_update, spec,
                                 config=config, interpret=True,
                                 layer_index=layer_index))
  return host_copy(fn(x, dy, kernel, state, scalars, apply))


@pytest.mark.parametrize("name,opt,count", OPTIMIZERS,
                         ids=[name for name, _, _ in OPTIMIZERS])
def test_mosaic_kernel_matches_reference(name, opt, count, seed):
  dtypes = (F32, F32, BF16)  # wgmma takes 16-bit activations
  config = CONFIGS["all-prefetched"]
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
  actual = run_mosaic(opt, x, dy, kernel, state, 2, CONFIGS["all-prefetched"])
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
                      CONFIGS["all-prefetched"], layer_index=jnp.int32(1))
  assert_leaves_match((actual[0][1], layer(actual[1], 1)), expected, "layer 1")
  for i in (0, 2):  # the other layers are untouched, bit for bit
    for a, b in zip(jax.tree.leaves(layer(actual[:2], i)),
                    jax.tree.leaves(layer((kernels, states), i))):
      np.testing.assert_array_equal(bits(a), bits(b))


def test_mosaic_config_errors_name_the_bad_field():
  with pytest.raises(ValueError, match=r"epilogue_slots=5 must be between 1 "
                     r"and the 4 epilogue sub-tiles"):
    mosaic_kernel.MosaicConfig(epilogue_slots=5)
  with pytest.raises(ValueError, match=r"prefetch_step=-1 must be >= 0"):
    mosaic_kernel.MosaicConfig(prefetch_step=-1)
  with pytest.raises(ValueError, match=r"tile_t=32 must be a multiple of 64"):
    mosaic_kernel.MosaicConfig(tile_t=32)
  with pytest.raises(ValueError, match=r"compute_wgs=3 must be 1 or 2"):
    mosaic_kernel.MosaicConfig(compute_wgs=3)


def test_default_config_follows_tokens_dtypes_and_shape():
  def default(tokens, n, dtype, opt=fj.adamw(1e-3)):
    return mosaic_kernel.default_config(
        jax.ShapeDtypeStruct((tokens, 4096), BF16),
        jax.ShapeDtypeStruct((4096, n), dtype), opt)
  few, some, many = (mosaic_kernel.ranked_configs(t)[0]
                     for t in (512, 2048, 8192))
  assert default(512, 4096, BF16) == few
  assert default(2048, 4096, BF16) == some
  assert default(8192, 4096, BF16) == many
  # float32 W, m and v do not fit few's buffers; N = 384 not many's tiles.
  assert default(512, 4096, F32) == mosaic_kernel.ranked_configs(512)[1]
  assert default(8192, 384, BF16).cta_tile_n == 128
  for tokens, n, dtype in ((512, 4096, F32), (8192, 384, BF16)):
    config = default(tokens, n, dtype)
    assert mosaic_kernel.unsupported_reason(
        jnp.zeros((tokens, 4096), BF16), jnp.zeros((tokens, n), BF16),
        jnp.zeros((4096, n), dtype), fj.adamw(1e-3), config) is None


def test_mosaic_refuses_what_it_cannot_run_and_auto_falls_back():
  opt = fj.adamw(1e-3)
  x = jnp.zeros((128, 128), BF16)
  kernel = jnp.zeros((128, 256), F32)
  assert mosaic_kernel.unsupported_reason(x, x[:, :1].repeat(256, 1), kernel,
                                          opt) is None
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


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [512, 2048])
def test_compiled_kernel_bits_do_not_depend_on_config_or_run(tokens, seed):
  """Every default config (and the epilogue schedules between them) gives
  the same bits, call after call: the tiles' accumulation order does not
  change with the epilogue, and a slot's loads never overtake the previous
  tile's stores. 4096 x 4096 is ~8 tiles per CTA, so tiles follow each
  other in every CTA."""
  if not backends._on_hopper_or_newer():  # pylint: disable=protected-access
    pytest.skip("needs a Hopper or newer GPU")
  opt = fj.adamw(1e-3, weight_decay=0.1)
  inputs = random_inputs(seed, opt, (tokens, 4096), 4096, (BF16, BF16, BF16))
  configs = {c for t in (512, 2048, 8192)
             for c in mosaic_kernel.ranked_configs(t)}
  configs |= {mosaic_kernel.MosaicConfig(epilogue_n=64),
              mosaic_kernel.MosaicConfig(epilogue_slots=4, prefetch_step=4)}
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  scalars = opt.scalars(jnp.asarray(3, jnp.int32))
  apply = jnp.all(jnp.isfinite(inputs[1]))
  first = None
  for config in sorted(configs, key=repr):
    fn = jax.jit(functools.partial(mosaic_kernel.mosaic_update, spec,
                                   config=config), donate_argnums=(2, 3))
    for _ in range(3):
      kernel, state = jax.tree.map(jnp.copy, inputs[2:])
      out = host_copy(fn(inputs[0], inputs[1], kernel, state, scalars, apply))
      if first is None:
        first = out
      for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(first)):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=repr(config))
