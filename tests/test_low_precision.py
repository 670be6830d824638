"""Low-precision storage: stochastic rounding, int8 block states, checkpoints.

* Stochastic rounding (bf16 weights) is unbiased, deterministic given the
  seed, new every step, and lets updates below half a bf16 ulp accumulate
  where round-to-nearest loses them.
* int8 block-64 quantization stays within half a code of each element and is
  measurably more accurate than blocks of 256 or 2048; second moments keep a
  non-zero code.
* The kernels write the same bits as the XLA reference for bf16 SR weights
  and int8 states: fused_dense_test_base.py's check, on every backend.
* Checkpoints restore every leaf bit for bit with its dtype, refuse to cast,
  and training resumed from one takes exactly the steps it would have taken.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import forge_jax as fj
from forge_jax import checkpoint
from forge_jax import quantization as Q
from forge_jax.ops import backends
from forge_jax.ops.fused_dense import FusedDenseSpec

from conftest import (
  COLL,
  assert_bitwise_equal,
  assert_same_bits,
  bits,
  host_copy,
)

# test_mosaic_kernel.py takes it from here.

BF16, F32 = jnp.bfloat16, jnp.float32
# Jitted once: eager dispatch of the quantizer's many small ops is slow.
quantize = jax.jit(
  Q.quantize, static_argnames=("block", "sqrt", "bits", "rows_1d")
)
dequantize = jax.jit(
  Q.dequantize, static_argnames=("block", "sqrt", "bits", "cols")
)


def _bf16_neighbours(x):
  """The bf16 values just below and above each float32 ``x`` (by truncation)."""
  x = np.asarray(x, np.float32)
  pattern = x.view(np.uint32)
  lower = (pattern & np.uint32(0xFFFF0000)).view(np.float32)
  upper = ((pattern & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(
    np.float32
  )
  lo, hi = np.where(x >= 0, lower, upper), np.where(x >= 0, upper, lower)
  return lo, hi


# ---------------------------------------------------------------------------
# Stochastic rounding.


def test_stochastic_rounding_is_unbiased(seed):
  """Over 4096 draws, the mean of the rounded values of each element matches
  its float32 value within 6 standard errors, and every draw is one of the
  two bf16 neighbours."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(256) * np.exp(rng.uniform(-8, 8, 256))).astype(
    np.float32
  )
  draws = 4096
  round_all = jax.jit(
    jax.vmap(
      lambda step: Q.stochastic_round_bf16(
        x,
        Q.random_bits(
          Q.rounding_key(seed, 17, step),
          jnp.zeros((1,), jnp.int32),
          jnp.arange(x.size),
        ),
      )
    )
  )
  rounded = np.asarray(round_all(jnp.arange(draws)).astype(F32), np.float64)
  lo, hi = _bf16_neighbours(x)
  assert ((rounded == lo) | (rounded == hi)).all()
  ulp = (hi - lo).astype(np.float64)
  # Each draw is lo + ulp * Bernoulli(p): std of the mean <= ulp / (2 sqrt(n)).
  error = np.abs(rounded.mean(axis=0) - x.astype(np.float64))
  assert (error <= 6 * ulp / (2 * np.sqrt(draws))).all(), (error / ulp).max()
  # Not round-to-nearest in disguise: both neighbours occur.
  frac = (x.astype(np.float64) - lo) / ulp
  inner = (frac > 0.05) & (frac < 0.95)
  up = (rounded == hi).mean(axis=0)
  assert (np.abs(up - frac)[inner] < 0.1).all()


def test_stochastic_rounding_bits_are_deterministic_and_new_every_step():
  rows = jnp.arange(64)[:, None]
  cols = jnp.arange(80)[None, :]
  draw = lambda seed, layer, step: np.asarray(
    Q.random_bits(Q.rounding_key(seed, layer, jnp.int32(step)), rows, cols)
  )
  a = draw(0, 1, 5)
  assert_bitwise_equal(a, draw(0, 1, 5), "same seed, layer and step")
  for other in (draw(1, 1, 5), draw(0, 2, 5), draw(0, 1, 6)):
    assert (a != other).mean() > 0.99
  # Each of the 16 bits used is close to a fair coin over the elements.
  top = a >> 16
  for bit in range(16):
    assert abs(((top >> bit) & 1).mean() - 0.5) < 0.05
  # Stable ids: no dependence on Python's hash randomization.
  assert Q.layer_id_from_path(("layers_0", "attn", "q_proj")) == (
    zlib.crc32(b"layers_0/attn/q_proj")
  )


def _sgd_steps(rounding, steps, k=64, n=64, delta=1e-3, seed=0):
  """``steps`` SGD steps of +delta on a bf16 kernel of ones, through the XLA
  backend with the step count feeding stochastic rounding."""
  opt = fj.sgd(1.0, weight_rounding=rounding, rounding_seed=seed)
  spec = FusedDenseSpec(optimizer=opt, implementation="xla")
  x = jnp.ones((1, k), F32)
  dy = jnp.full((1, n), -delta, F32)  # dW = -delta: w += delta
  kernel = jnp.ones((k, n), BF16)
  step = jax.jit(functools.partial(backends.xla_update, spec))
  for i in range(steps):
    kernel, *_ = step(
      x,
      dy,
      kernel,
      opt.init(kernel),
      opt.scalars(jnp.int32(i)),
      jnp.bool_(True),
      rounding_key=Q.rounding_key(seed, 3, jnp.int32(i)),
    )
  return np.asarray(kernel.astype(F32), np.float64)


def test_updates_below_half_an_ulp_vanish_when_rounding_to_nearest_and_accumulate_stochastically():
  steps, delta = 200, 1e-3  # bf16 ulp at 1.0 is 2**-7: delta ~ 0.13 ulp
  assert delta < 2.0**-8
  nearest = _sgd_steps("nearest", steps, delta=delta)
  np.testing.assert_array_equal(nearest, 1.0)
  sr = _sgd_steps("stochastic", steps, delta=delta)
  expected = 1.0 + steps * delta
  # Per element: a sum of `steps` rounding errors of variance <= ulp**2 / 4.
  per_element_std = np.sqrt(steps) * 2.0**-7 / 2
  assert abs(sr.mean() - expected) < 6 * per_element_std / np.sqrt(sr.size)
  assert np.abs(sr - expected).max() < 6 * per_element_std
  assert len(np.unique(sr)) > 3  # elements draw independently


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_rounds_to_finite_is_the_cast_finiteness(dtype):
  """The fused kernels' overflow test of a value stored rounded to nearest
  agrees with the cast itself at the threshold (a tie rounds to infinity),
  next to it, and for NaN and infinities."""
  finfo = jnp.finfo(dtype)
  with np.errstate(over="ignore"):  # float32's threshold is infinite
    threshold = np.float32(
      float(finfo.max) + float(finfo.eps) * 2.0 ** (finfo.maxexp - 2)
    )
  near = [threshold, np.nextafter(threshold, np.float32(0))]
  near = near if np.isfinite(threshold) else []
  values = np.array(
    [0.0, 1.0, float(finfo.max), np.finfo(np.float32).max, np.inf, np.nan]
    + near,
    np.float32,
  )
  values = np.concatenate([values, -values])
  expected = np.isfinite(np.asarray(jnp.asarray(values).astype(dtype)))
  np.testing.assert_array_equal(
    Q.rounds_to_finite(jnp.asarray(values), dtype), expected
  )
  assert expected.any() and not expected.all()


def test_stochastic_rounding_options_are_checked():
  with pytest.raises(ValueError, match="weight_rounding"):
    fj.adamw(1e-3, weight_rounding="up")
  with pytest.raises(ValueError, match="bfloat16"):
    Q.round_weights(
      jnp.ones((2, 2)),
      jnp.float16,
      rounding="stochastic",
      key=Q.rounding_key(0, 0),
    )
  # A float16 ForgeDense is refused when it is created, not at its first
  # backward pass.
  layer = fj.ForgeDense(
    4,
    optimizer=fj.adamw(1e-3, weight_rounding="stochastic"),
    param_dtype=jnp.float16,
  )
  with pytest.raises(ValueError, match="not float16"):
    layer.init(jax.random.key(0), jnp.ones((2, 3)))
  # float32 kernels: nothing to round, the rule's values are stored as is.
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)), F32)
  assert_bitwise_equal(
    Q.round_weights(x, F32, rounding="stochastic", key=Q.rounding_key(0, 0)),
    x,
    "f32",
  )


@pytest.mark.parametrize(
  "opt",
  [
    fj.adamw(1e-2, weight_rounding="stochastic"),
    fj.adamw(1e-2, state_dtype="int8", second_moment_bits=4),
  ],
  ids=["stochastic_weights", "4bit_levels"],
)
def test_forge_dense_layer_ids_follow_the_module_path(opt, seed, monkeypatch):
  """Every optimizer that draws random bits keys them by the layer: layers
  sharing an id would round the same elements the same way."""

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      a = fj.ForgeDense(8, optimizer=opt, param_dtype=BF16, name="a")
      b = fj.ForgeDense(
        8, optimizer=opt, param_dtype=BF16, layer_id=42, name="b"
      )
      return b(a(x))

  ids = []
  real = fj.forge_dense

  def spy(x, variables, bias, spec, *args, **kwargs):
    ids.append(spec.layer_id)
    return real(x, variables, bias, spec, *args, **kwargs)

  monkeypatch.setattr(fj.linen, "forge_dense", spy)
  Two().init(jax.random.key(seed), jnp.ones((2, 8)))
  assert ids == [Q.layer_id_from_path(("a",)), 42]
  ids.clear()
  plain = fj.adamw(1e-2, state_dtype="int8")
  fj.ForgeDense(8, optimizer=plain, name="a").init(
    jax.random.key(seed), jnp.ones((2, 8))
  )
  assert ids == [0]  # no random bits: one spec (and compiled kernel) for all


# ---------------------------------------------------------------------------
# int8 block quantization.


def _heavy_tailed(seed, shape):
  """Adam-like magnitudes: a normal times a per-element log-normal scale."""
  rng = np.random.default_rng(seed)
  return (
    rng.standard_normal(shape) * np.exp(rng.normal(0.0, 1.5, shape))
  ).astype(np.float32)


def test_int8_block_quantization_error_bound_and_block_size(seed):
  """Every element is within half a code (scale / 2) of its value, blocks of
  64 do not straddle (scale shape), and the error is measurably smaller with
  blocks of 64 than 256 than 2048 (outliers inflate fewer elements' scale)."""
  x = _heavy_tailed(seed, (64, 4096 + 37))  # a partial last block
  errors = {}
  for block in (64, 256, 2048):
    codes, scale = quantize(jnp.asarray(x), block=block)
    assert codes.dtype == jnp.int8 and scale.shape == (
      64,
      -(-x.shape[1] // block),
    )
    assert int(jnp.min(codes)) >= -127 and int(jnp.max(codes)) <= 127
    values = np.asarray(dequantize(codes, scale, block=block), np.float64)
    per_element = np.repeat(np.asarray(scale, np.float64), block, axis=1)
    per_element = per_element[:, : x.shape[1]]
    err = np.abs(values - x)
    assert (err <= per_element / 2 * (1 + 1e-6)).all()
    # The largest element of each block is (nearly) exact.
    errors[block] = np.linalg.norm(err) / np.linalg.norm(x)
  assert errors[64] < 0.75 * errors[256] < 0.75 * 0.75 * errors[2048], errors

  # Second moments: sqrt(v) within half a level; no v > 0 reads back as 0.
  v = x.astype(np.float64) ** 2
  codes, scale = quantize(jnp.asarray(v, F32), sqrt=True)
  back = np.asarray(dequantize(codes, scale, sqrt=True), np.float64)
  s = np.repeat(np.asarray(scale, np.float64), 64, axis=1)[:, : v.shape[1]]
  level = np.sqrt(v) / s
  near = level >= 1.0  # the floor at level 1 is by design
  assert (
    np.abs(np.sqrt(back) - np.sqrt(v))[near] <= s[near] / 2 * (1 + 1e-5)
  ).all()
  assert not ((back == 0) & (v > 0)).any()
  linear_codes, linear_scale = quantize(jnp.asarray(v, F32))
  linear = np.asarray(dequantize(linear_codes, linear_scale))
  assert ((linear == 0) & (v > 0)).mean() > 0.2  # why v is stored as sqrt


def test_4bit_second_moments_are_within_half_a_level_two_a_code(seed):
  """4-bit second moments: ``sqrt(v)`` within half of one of 15 levels, no
  ``v > 0`` read back as 0, zeros stay 0, each block's scale the smallest
  bfloat16 value with ``(14 s)^2 >= max v``; two columns a code, 32 a
  block (a partial last block is padded), codes in [-112, 112] (never the
  container's NaN); the error of ``sqrt(v)`` several times int8's."""
  v = _heavy_tailed(seed, (64, 1024 + 37)).astype(np.float64) ** 2
  v[3, :64] = 0.0  # an all-zero block
  v[5, 7] = 0.0
  codes, scale = quantize(jnp.asarray(v, F32), sqrt=True, bits=4)
  assert codes.dtype == jnp.int8
  assert codes.shape == Q.pair_codes_shape(v.shape) == (64, 32 * 17)
  assert scale.shape == (64, -(-v.shape[1] // 64))
  assert -112 <= int(jnp.min(codes)) and int(jnp.max(codes)) <= 112
  container = Q.container_codes(codes)
  assert np.isfinite(np.asarray(container.astype(F32))).all()
  back = np.asarray(
    dequantize(codes, scale, sqrt=True, bits=4, cols=v.shape[1]), np.float64
  )
  assert back.shape == v.shape
  s = np.repeat(np.asarray(scale, np.float64), 64, axis=1)[:, : v.shape[1]]
  near = np.sqrt(v) >= s  # the floor at level 1 is by design
  error = np.abs(np.sqrt(back) - np.sqrt(v))
  assert (error[near] <= s[near] / 2 * (1 + 1e-5)).all()
  assert not ((back == 0) & (v > 0)).any() and (back[v == 0] == 0).all()
  peak = v.reshape(64, -1)[:, : (v.shape[1] // 64) * 64].reshape(64, -1, 64)
  full = np.asarray(scale, np.float64)[:, : peak.shape[1]]
  assert ((14 * full) ** 2 >= peak.max(axis=2)).all()
  below = (full.astype(np.float32).view(np.uint32) - (1 << 16)).view(np.float32)
  positive = peak.max(axis=2) > 0
  assert ((14 * below.astype(np.float64)) ** 2 < peak.max(axis=2))[
    positive
  ].all()
  int8 = np.asarray(
    dequantize(*quantize(jnp.asarray(v, F32), sqrt=True), sqrt=True),
    np.float64,
  )
  rel = lambda x: (
    np.linalg.norm(np.sqrt(x) - np.sqrt(v)) / np.linalg.norm(np.sqrt(v))
  )
  assert 4 * rel(int8) < rel(back), (rel(int8), rel(back))


def test_4bit_codes_pair_the_halves_of_a_block():
  """Code ``j`` of a block holds the levels of its columns ``j`` (``lo``)
  and ``j + 32`` (``hi``) as ``lo + 15 hi - 112``, checked on chosen
  levels, through the generic packing and a kernel tile's one-block
  packing (slices and a concatenation, which Mosaic GPU lowers)."""
  scale_step = 0.5  # the block's peak, level 14, sets it: 14 * 0.5 = 7
  block = np.array([0, 1, 14, 3, 7, 14, 14, 0] + [1] * 56, np.float64)
  levels = np.stack([block, block[::-1]])  # two rows
  v = (levels * scale_step) ** 2
  codes, scale = quantize(jnp.asarray(v, F32), sqrt=True, bits=4)
  assert float(scale[0, 0]) == scale_step
  expected = levels[:, :32] + 15 * levels[:, 32:] - 112
  np.testing.assert_array_equal(np.asarray(codes, np.float64), expected)
  back = dequantize(codes, scale, sqrt=True, bits=4)
  np.testing.assert_array_equal(np.asarray(back, np.float64), v)
  # A kernel tile of one block per row: [R] scales.
  tile_codes, tile_scale = quantize(
    jnp.asarray(v, F32), sqrt=True, bits=4, rows_1d=True
  )
  np.testing.assert_array_equal(tile_codes, codes)
  np.testing.assert_array_equal(tile_scale, scale[:, 0])
  tile_back = dequantize(tile_codes, tile_scale, sqrt=True, bits=4)
  np.testing.assert_array_equal(tile_back, back)


def test_4bit_codes_of_several_blocks_pair_within_each_block(seed):
  """Each block's codes pair its own halves: the codes of a wide leaf are
  its blocks' codes side by side."""
  v = _heavy_tailed(seed, (8, 64 * 5)).astype(np.float32) ** 2
  codes, scale = quantize(jnp.asarray(v), sqrt=True, bits=4)
  for b in range(5):
    block_codes, block_scale = quantize(
      jnp.asarray(v[:, 64 * b : 64 * (b + 1)]), sqrt=True, bits=4
    )
    np.testing.assert_array_equal(codes[:, 32 * b : 32 * (b + 1)], block_codes)
    np.testing.assert_array_equal(scale[:, b : b + 1], block_scale)


def _stored_4bit(v):
  codes, scale = quantize(jnp.asarray(v, F32), sqrt=True, bits=4)
  return Q.QuantizedSqrt4Blocks(codes=Q.container_codes(codes), scale=scale)


def test_4bit_levels_round_stochastically_and_follow_slow_growth(seed):
  """A step's 4-bit levels round ``sqrt(v) / s`` down or up with the
  probability of its fraction (``Q.level_offsets``: every element's bits
  differ, the same ones twice give the same codes), so a second moment that
  grows by less than half a level a step still grows in expectation.
  Rounded to nearest, every element here would stay at level 5 for ever
  (each step's 1 % is a twentieth of a level) while its true value grows by
  half: a block whose peak stays put stalls, and Adam's steps grow as
  ``sqrt(t)``."""
  rows = 256
  v = np.full((rows, 64), 25.0, np.float32)  # level 5 at scale 1
  v[:, 0] = 196.0  # the block's peak, level 14, sets the scale to 1
  state = _stored_4bit(v)
  update = jax.jit(
    lambda new, old, bits: Q.update(new, old, jnp.bool_(True), None, bits)
  )
  truth = v.astype(np.float64)
  for step in range(40):
    key = Q.rounding_key(seed, 7, step)
    bits = Q.element_bits(key, v.shape)
    new = np.asarray(Q.load(state), np.float64)
    new[:, 1:] *= 1.02
    truth[:, 1:] *= 1.02
    state = update(jnp.asarray(new, F32), state, bits)
    assert float(state.scale[0, 0]) == 1.0
  first, second = (
    update(jnp.asarray(new, F32), _stored_4bit(v), bits) for _ in range(2)
  )
  assert_same_bits(first, second, "4-bit levels under the same bits")
  back = np.asarray(Q.load(state), np.float64)[:, 1:]
  ratio = np.sqrt(back).mean() / np.sqrt(truth[:, 1:]).mean()
  assert abs(ratio - 1) < 0.03, ratio  # nearest: 1 / sqrt(1.02**40) = 0.67
  assert len(np.unique(back)) > 2  # levels differ element by element
  with pytest.raises(ValueError, match="round their levels stochastically"):
    Q.update(jnp.asarray(new, F32), state, jnp.bool_(True))


def test_second_moment_bits_option(seed):
  """``second_moment_bits=4``: the second moment in half a byte an element
  (0.53 bytes with its scales against 1.06), the first moment int8; refused
  without int8 states or without a second moment."""
  kernel = jax.random.normal(jax.random.key(seed), (40, 192), BF16)
  adamw = fj.adamw(1e-3, state_dtype="int8", second_moment_bits=4)
  state = adamw.init(kernel)
  assert isinstance(state.mu, Q.QuantizedBlocks)
  assert isinstance(state.nu, Q.QuantizedSqrt4Blocks)
  assert state.nu.codes.shape == (40, 96) and state.nu.scale.shape == (40, 3)
  assert Q.state_bytes(state.nu) == 40 * 96 + 40 * 3 * 4
  assert Q.state_bytes(state) == 40 * 192 + 40 * 96 + 2 * 40 * 3 * 4
  # A partial last block is padded to a whole block's 32 codes.
  ragged = adamw.init(kernel[:, :150])
  assert ragged.nu.codes.shape == (40, 96) and ragged.nu.scale.shape == (40, 3)
  state = fj.adagrad(1e-3, state_dtype="int8", second_moment_bits=4).init(
    kernel
  )
  assert isinstance(state.sum_of_squares, Q.QuantizedSqrt4Blocks)
  for make in (
    lambda: fj.adamw(1e-3, second_moment_bits=4),
    lambda: fj.adamw(1e-3, state_dtype="bfloat16", second_moment_bits=4),
    # Rules without a second moment take no such argument either.
    lambda: dataclasses.replace(
      fj.lion(1e-3, state_dtype="int8"), second_moment_bits=4
    ),
    lambda: dataclasses.replace(
      fj.sgd(1e-3, momentum=0.9, state_dtype="int8"), second_moment_bits=4
    ),
  ):
    with pytest.raises(ValueError, match="second_moment_bits=4"):
      make()
  with pytest.raises(ValueError, match="second_moment_bits"):
    fj.adamw(1e-3, state_dtype="int8", second_moment_bits=2)


@pytest.mark.parametrize("sqrt", [False, True], ids=["linear", "sqrt"])
def test_int8_scales_are_the_smallest_bf16_values_that_cover_their_block(
  sqrt, seed
):
  """Each block's scale is the smallest bfloat16 ``s`` with ``127 s >=
  absmax`` (``(254 s)^2 >= max v``), checked in float64; the largest
  element of every block moved one float32 ulp up, as a multiply-add
  contracted differently moves it, leaves almost every scale's bits as they
  were."""
  x = _heavy_tailed(seed, (64, 4096))
  x = np.abs(x) if sqrt else x
  _, scale = quantize(jnp.asarray(x), sqrt=sqrt)
  scale = np.asarray(scale, np.float64)
  peak = np.abs(x.astype(np.float64)).reshape(64, -1, 64).max(axis=2)
  covers = (lambda s: (254 * s) ** 2) if sqrt else (lambda s: 127 * s)
  assert (scale == scale.astype(jnp.bfloat16).astype(np.float64)).all()
  assert (covers(scale) >= peak).all()
  # One bfloat16 step down: the float32 bits less one in the 16th bit.
  below = (scale.astype(np.float32).view(np.uint32) - (1 << 16)).view(
    np.float32
  )
  assert (covers(below.astype(np.float64)) < peak).all()

  blocks = x.reshape(64, -1, 64)
  at = np.abs(blocks).argmax(axis=2)[..., None]
  top = np.take_along_axis(blocks, at, axis=2)
  nudged = blocks.copy()
  np.put_along_axis(nudged, at, np.nextafter(top, np.sign(top) * np.inf), 2)
  _, moved = quantize(jnp.asarray(nudged.reshape(x.shape)), sqrt=sqrt)
  assert (bits(moved) != bits(scale.astype(np.float32))).mean() <= 1e-3


def test_a_scale_one_grid_step_up_moves_codes_but_not_what_they_encode():
  """Second moments whose block peaks differ by one float32 ulp across a
  grid threshold: the scale moves one bfloat16 step, every code of the
  block re-rounds (two apart near the top of the 254 levels), and what the
  codes encode (``sqrt(v)``) stays within one code step."""
  s = 2.0**-10
  v = np.full((1, 64), (250 * s) ** 2, np.float32)
  v[0, 0] = (254 * s) ** 2  # the peak exactly at 254 levels of s
  nudged = v.copy()
  nudged[0, 0] = np.nextafter(v[0, 0], np.float32(np.inf))
  at, above = (Q.store(jnp.asarray(x), "int8", True) for x in (v, nudged))
  np.testing.assert_array_equal(np.asarray(at.scale), [[s]])
  np.testing.assert_array_equal(np.asarray(above.scale), [[s * (1 + 2**-7)]])
  codes = lambda leaf: np.asarray(Q.int8_codes(leaf.codes), np.int32)
  assert np.abs(codes(at) - codes(above)).max() == 2
  (value_at, step_at), (value_above, step_above) = (
    map(np.asarray, Q.encoded_value(leaf)) for leaf in (at, above)
  )
  np.testing.assert_allclose(value_at, np.sqrt(v), rtol=1e-6)
  assert (
    np.abs(value_at - value_above) <= np.maximum(step_at, step_above)
  ).all()
  # The scales differ, so encoded_distance counts no code distance there.
  codes_apart, steps_apart = map(np.asarray, Q.encoded_distance(above, at))
  assert not codes_apart.any()
  assert 0 < steps_apart.max() <= 1


@pytest.mark.parametrize("sqrt", [False, True], ids=["linear", "sqrt"])
def test_int8_codes_are_nearest_by_their_thresholds_at_ties(sqrt, seed):
  """Values on a rounding threshold ``t(q) = (q + 0.5) * s`` (squared for
  second moments) take code ``q + 1``, every other value the ``q`` with
  ``t(q - 1) <= x < t(q)``: the definition, checked in float32 numpy against
  each block's scale; ties are where an estimate that is off by more than
  one (or not rounded at all) shows."""
  rng = np.random.default_rng(seed)
  x = (
    np.abs(_heavy_tailed(seed, (8, 128)))
    if sqrt
    else _heavy_tailed(seed, (8, 128))
  )
  _, scale = quantize(jnp.asarray(x), sqrt=sqrt)
  s = np.repeat(np.asarray(scale), 64, axis=1)
  low = 1 if sqrt else -126
  q = rng.integers(low, 126, x.shape).astype(np.float32)
  ties = ((q + np.float32(0.5)) * s).astype(np.float32)
  ties = ties * ties if sqrt else ties
  # Every other element on a threshold; each block's largest stays (its
  # scale with it).
  keep = np.abs(x) == np.abs(x).reshape(8, 2, 64).max(-1).repeat(64, 1)
  on_tie = (np.arange(x.shape[1]) % 2 == 0) & ~keep
  x = np.where(on_tie, ties, x).astype(np.float32)
  codes, new_scale = quantize(jnp.asarray(x), sqrt=sqrt)
  assert_bitwise_equal(new_scale, scale, "scales")
  level = np.asarray(codes).astype(np.float32) + (127 if sqrt else 0)

  def threshold(level):
    t = ((level + np.float32(0.5)) * s).astype(np.float32)
    return t * t if sqrt else t

  inside = (level > low) & (level < 126)
  assert (x >= threshold(level - 1))[inside].all()
  assert (x < threshold(level))[inside].all()
  np.testing.assert_array_equal(level[on_tie], q[on_tie] + 1)


def test_int8_quantizer_edge_cases():
  zero = jnp.zeros((2, 64))
  for sqrt in (False, True):
    codes, scale = quantize(zero, sqrt=sqrt)
    assert_bitwise_equal(dequantize(codes, scale, sqrt=sqrt), zero, "zeros")
  # A NaN or inf poisons its block (NaN scale), never a neighbouring block.
  x = (
    jnp.asarray(_heavy_tailed(0, (2, 128)))
    .at[0, 3]
    .set(jnp.nan)
    .at[1, 70]
    .set(jnp.inf)
  )
  for sqrt in (False, True):
    codes, scale = quantize(jnp.abs(x) if sqrt else x, sqrt=sqrt)
    back = np.asarray(dequantize(codes, scale, sqrt=sqrt))
    assert np.isnan(back[0, :64]).all() and np.isnan(back[1, 64:]).all()
    assert np.isfinite(back[0, 64:]).all() and np.isfinite(back[1, :64]).all()
    # The poisoned blocks' codes are zeros, whatever their finite elements.
    codes = np.asarray(codes)
    assert (codes[0, :64] == 0).all() and (codes[1, 64:] == 0).all()
  # Codes never use -128 (the NaN pattern of their float8 container).
  codes, _ = quantize(jnp.asarray(_heavy_tailed(1, (8, 640))))
  container = Q.container_codes(codes)
  assert np.isfinite(np.asarray(container.astype(F32))).all()
  assert_bitwise_equal(Q.int8_codes(container), codes, "container round trip")
  # Tiny blocks are stored as zeros instead of overflowing 1 / scale.
  tiny = jnp.full((1, 64), 1e-35, F32).at[0, 5].set(-3e-35)
  codes, scale = quantize(tiny)
  assert float(scale[0, 0]) == 0.0
  assert (np.asarray(codes) == 0).all()


def test_state_dtype_option(seed):
  kernel = jax.random.normal(jax.random.key(seed), (40, 150), BF16)
  state = fj.adamw(1e-3, state_dtype="float32").init(kernel)
  assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {jnp.dtype(F32)}
  state = fj.lion(1e-3, state_dtype=jnp.bfloat16).init(kernel.astype(F32))
  assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {jnp.dtype(BF16)}
  state = fj.adamw(1e-3, state_dtype="int8").init(kernel)
  assert isinstance(state.mu, Q.QuantizedBlocks)
  assert isinstance(state.nu, Q.QuantizedSqrtBlocks)
  assert state.mu.codes.dtype == Q.CODES_CONTAINER
  assert state.mu.scale.shape == (40, 3) and state.mu.scale.dtype == F32
  # 1 + 4/64 bytes an element instead of 4.
  assert Q.state_bytes(state) == 2 * (40 * 150 + 40 * 3 * 4)
  with pytest.raises(ValueError, match="not both"):
    fj.adam(1e-3, mu_dtype=BF16, state_dtype="int8")
  with pytest.raises(ValueError, match="centered"):
    fj.rmsprop(1e-3, centered=True, state_dtype="int8")
  with pytest.raises(ValueError, match="state_dtype"):
    fj.sgd(1e-3, momentum=0.9, state_dtype="int4")


@pytest.mark.parametrize("name", ["adamw", "adagrad", "lion"])
def test_jitted_int8_init_quantizes_at_run_time(name):
  # Initial states are constants. Folded at compile time, every leaf's block
  # reductions took seconds, so a jitted model.init took minutes.
  opt = getattr(fj, name)(1e-3, state_dtype="int8")
  kernel = jax.ShapeDtypeStruct((256, 512), BF16)
  compiled = jax.jit(opt.init).lower(kernel).compile().as_text()
  assert " reduce(" in compiled
  jitted = jax.jit(opt.init)(jnp.ones(kernel.shape, BF16))
  assert_same_bits(jitted, opt.init(jnp.ones(kernel.shape, BF16)), name)


# ---------------------------------------------------------------------------
# Training, checkpoints, resuming.

LOWP_OPT = fj.adamw(
  3e-2,
  weight_decay=0.1,
  state_dtype="int8",
  weight_rounding="stochastic",
  rounding_seed=5,
)


LOWP_4BIT_OPT = dataclasses.replace(LOWP_OPT, second_moment_bits=4)
LOWP_OPTS = pytest.mark.parametrize(
  "opt", [LOWP_OPT, LOWP_4BIT_OPT], ids=["int8", "int8-4bit"]
)


class LowpMLP(nn.Module):
  implementation: str = "xla"
  optimizer: fj.ForgeOptimizer = LOWP_OPT

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(
      fj.ForgeDense,
      optimizer=self.optimizer,
      param_dtype=BF16,
      implementation=self.implementation,
    )
    x = nn.gelu(dense(96, name="fc1")(x))
    return dense(10, use_bias=False, name="fc2")(x)


def _batches(seed, steps):
  rng = np.random.default_rng(seed)
  return [
    (
      jnp.asarray(rng.standard_normal((16, 24)), F32),
      jnp.asarray(rng.integers(0, 10, 16)),
    )
    for _ in range(steps)
  ]


def _new_state(
  seed, implementation="xla", state_class=TrainState, opt=LOWP_OPT, **kwargs
):
  model = LowpMLP(implementation, opt)
  variables = model.init(jax.random.key(seed), jnp.ones((2, 24)))
  return state_class.create(
    apply_fn=model.apply, params=variables, tx=opt.to_optax(), **kwargs
  )


@jax.jit
def _train_step(state, batch):
  x, y = batch
  loss, grads = jax.value_and_grad(
    lambda p: optax.softmax_cross_entropy_with_integer_labels(
      state.apply_fn(p, x), y
    ).mean()
  )(state.params)
  return state.apply_gradients(grads=grads), loss


# The 4-bit case learns with int8 first moments and stochastic rounding;
# int8 second moments learn in test_optax_storage.py's float32 comparison.
@pytest.mark.parametrize(
  "opt",
  [pytest.param(LOWP_OPT, marks=pytest.mark.slow), LOWP_4BIT_OPT],
  ids=["int8", "int8-4bit"],
)
def test_training_with_bf16_sr_and_int8_states_learns(opt, seed):
  state = _new_state(seed, opt=opt)
  batches = _batches(seed, 1) * 30  # fit one batch
  losses = []
  for batch in batches:
    state, loss = _train_step(state, batch)
    losses.append(float(loss))
  assert losses[-1] < 0.3 * losses[0], losses
  layer = state.params[COLL]["fc1"]
  assert layer["kernel"].dtype == BF16 and float(layer["count"]) == 30
  assert layer["opt_state"].mu.codes.dtype == Q.CODES_CONTAINER
  assert layer["opt_state"].nu.codes.shape == (
    Q.pair_codes_shape((24, 96)) if opt.second_moment_bits == 4 else (24, 96)
  )


@LOWP_OPTS
def test_checkpoint_round_trip_is_bit_exact_and_never_casts(
  tmp_path, opt, seed
):
  state = _new_state(seed, opt=opt)
  for batch in _batches(seed, 3):
    state, _ = _train_step(state, batch)
  path = checkpoint.save(str(tmp_path / "ckpt"), state)
  restored = checkpoint.restore(path, _new_state(seed + 1, opt=opt))
  # (apply_fn and tx come from the abstract state: compare the arrays.)
  for part in ("params", "opt_state"):
    assert jax.tree.structure(getattr(restored, part)) == jax.tree.structure(
      getattr(state, part)
    )
  for (key, a), b in zip(
    jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(state)
  ):
    assert_bitwise_equal(
      np.atleast_1d(a), np.atleast_1d(b), jax.tree_util.keystr(key)
    )
  layer = restored.params[COLL]["fc1"]
  assert layer["opt_state"].nu.codes.dtype == Q.CODES_CONTAINER
  assert layer["kernel"].dtype == BF16 and float(layer["count"]) == 3.0
  # orbax would cast int8 codes (their container) to whatever the target
  # says; the helper refuses.
  wrong = _new_state(seed).replace(
    params=jax.tree.map(
      lambda a: a.astype(BF16) if a.dtype == Q.CODES_CONTAINER else a,
      _new_state(seed).params,
    )
  )
  with pytest.raises(TypeError, match="float8_e4m3fnuz"):
    checkpoint.restore(path, wrong)


def test_params_restored_by_orbax_without_a_target_are_refused_by_name(
  tmp_path, seed
):
  """Plain orbax restores int8 states saved without a target as dicts:
  applying them raises and says to restore into the abstract state, with
  which the same checkpoint restores bit for bit."""
  ocp = pytest.importorskip("orbax.checkpoint")
  state = _new_state(seed)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "params", state.params)
  checkpointer.wait_until_finished()
  x, _ = _batches(seed, 1)[0]
  apply = jax.jit(state.apply_fn)
  raw = checkpointer.restore(tmp_path / "params")
  with pytest.raises(TypeError, match="checkpoint without a target"):
    apply(raw, x)
  restored = checkpointer.restore(
    tmp_path / "params", jax.eval_shape(lambda: state.params)
  )
  assert_same_bits(restored, state.params, "params")
  assert np.array_equal(apply(restored, x), apply(state.params, x))


def test_checkpoint_of_another_storage_format_is_refused(tmp_path, seed):
  """int8 second moments restored into a state with 4-bit ones (and back)
  raise a TypeError naming each mismatched leaf and both shapes."""
  for saved, wanted in ((LOWP_OPT, LOWP_4BIT_OPT), (LOWP_4BIT_OPT, LOWP_OPT)):
    path = checkpoint.save(
      str(tmp_path / f"bits{saved.second_moment_bits}"),
      _new_state(seed, opt=saved),
    )
    with pytest.raises(TypeError, match=r"fc1/opt_state/nu/codes: saved with"):
      checkpoint.restore(path, _new_state(seed, opt=wanted))


def test_checkpoint_of_another_optax_chain_is_refused_by_name(tmp_path, seed):
  """adamw's and adam's states have leaves of the same names (their chains
  differ in stateless links only): each restores into the other's state
  with a TypeError naming the empty state that differs, not orbax's
  structure error."""
  adam = fj.adam(
    3e-2, state_dtype="int8", weight_rounding="stochastic", rounding_seed=5
  )
  for saved, wanted in ((LOWP_OPT, adam), (adam, LOWP_OPT)):
    path = checkpoint.save(
      str(tmp_path / f"decoupled_{saved.decoupled}"),
      _new_state(seed, opt=saved),
    )
    side = "in the checkpoint" if saved is LOWP_OPT else "of the abstract"
    with pytest.raises(TypeError, match=f"opt_state/2: an empty state {side}"):
      checkpoint.restore(path, _new_state(seed, opt=wanted))


def test_checkpoint_of_4bit_codes_without_their_layout_is_refused(
  tmp_path, seed
):
  """4-bit codes of another pairing have the same shape and dtype: a
  checkpoint that does not record the codes' layout restores no state with
  4-bit second moments (int8 ones still restore)."""
  for opt in (LOWP_4BIT_OPT, LOWP_OPT):
    path = checkpoint.save(
      str(tmp_path / f"bits{opt.second_moment_bits}"), _new_state(seed, opt=opt)
    )
    layout_file = os.path.join(path, checkpoint.LAYOUT_FILE)
    with open(layout_file, encoding="utf-8") as f:
      record = f.read()
    os.remove(layout_file)
    if opt.second_moment_bits == 4:
      with pytest.raises(TypeError, match="layout None") as refusal:
        checkpoint.restore(path, _new_state(seed, opt=opt))
      # The refusal says what to write where to restore it.
      assert f"write {record} to {layout_file}" in str(refusal.value)
      with open(layout_file, "w", encoding="utf-8") as f:
        f.write(record)
    checkpoint.restore(path, _new_state(seed, opt=opt))


def test_checkpoint_of_a_fresh_state_restores_into_its_eval_shape(
  tmp_path, seed
):
  """A state saved before its first step (``step`` a Python 0) restores into
  ``jax.eval_shape`` of its creation, whose step is an int32, and trains."""
  create = lambda: _new_state(seed, state_class=fj.TrainState)
  path = checkpoint.save(str(tmp_path / "step_0"), create())
  restored = checkpoint.restore(path, jax.eval_shape(create))
  assert restored.step.dtype == jnp.int32 and int(restored.step) == 0
  resumed, loss = _train_step(restored, _batches(seed, 1)[0])
  assert np.isfinite(float(loss)) and int(resumed.step) == 1


def test_checkpoint_without_gradient_norms_restores_them_as_zeros(
  tmp_path, seed
):
  """A checkpoint without the gradient-norm leaves (the layers'
  grad_sq_norm, the state's grad_norm) restores every other leaf bit for
  bit and those as zeros; any other missing leaf still raises."""
  state = _new_state(seed, state_class=fj.TrainState)
  for batch in _batches(seed, 2):
    state, _ = _train_step(state, batch)
  without_norms = state.replace(
    grad_norm=None,
    params={
      **state.params,
      COLL: {
        name: {k: v for k, v in layer.items() if k != "grad_sq_norm"}
        for name, layer in state.params[COLL].items()
      },
    },
  )
  path = checkpoint.save(str(tmp_path / "ckpt"), without_norms)
  restored = checkpoint.restore(
    path, _new_state(seed + 1, state_class=fj.TrainState)
  )
  assert float(restored.grad_norm) == 0.0
  for name, layer in restored.params[COLL].items():
    assert float(layer["grad_sq_norm"]) == 0.0, name
    for k, v in state.params[COLL][name].items():
      if k != "grad_sq_norm":
        for a, b in zip(jax.tree.leaves(layer[k]), jax.tree.leaves(v)):
          assert_bitwise_equal(np.atleast_1d(a), np.atleast_1d(b), k)
  for a, b in zip(
    jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state)
  ):
    assert_bitwise_equal(np.atleast_1d(a), np.atleast_1d(b), "opt_state")
  assert int(restored.step) == 2
  # Training resumes from it.
  resumed, loss = _train_step(restored, _batches(seed, 3)[2])
  assert np.isfinite(float(loss))
  assert float(resumed.params[COLL]["fc1"]["count"]) == 3.0
  without_count = without_norms.replace(
    params={
      **without_norms.params,
      COLL: {
        name: {k: v for k, v in layer.items() if k != "count"}
        for name, layer in without_norms.params[COLL].items()
      },
    }
  )
  path = checkpoint.save(str(tmp_path / "no_count"), without_count)
  with pytest.raises(TypeError, match="count: not in the checkpoint"):
    checkpoint.restore(path, _new_state(seed, state_class=fj.TrainState))
  # A leaf the abstract state lacks is not dropped: refused, named.
  path = checkpoint.save(str(tmp_path / "extra"), without_norms)
  fewer = without_count.replace(grad_norm=None)
  with pytest.raises(TypeError, match="count: in the checkpoint, not in"):
    checkpoint.restore(path, fewer)


@pytest.mark.slow
def test_checkpoint_moves_between_tracked_and_untracked_norms(tmp_path, seed):
  """A state that tracks the gradient norm restores into one that does
  not (its saved grad_norm left out) and back (grad_norm 0.0), every other
  leaf bit for bit; training resumes either way."""
  new = lambda track: _new_state(
    seed + 1, state_class=fj.TrainState, track_grad_norm=track
  )
  state = _new_state(seed, state_class=fj.TrainState)
  for batch in _batches(seed, 2):
    state, _ = _train_step(state, batch)
  path = checkpoint.save(str(tmp_path / "tracked"), state)
  restored = checkpoint.restore(path, new(False))
  assert restored.grad_norm is None and not restored.track_grad_norm
  assert_same_bits(restored.params, state.params, "params")
  assert_same_bits(restored.opt_state, state.opt_state, "opt_state")
  restored, loss = _train_step(restored, _batches(seed, 3)[2])
  assert np.isfinite(float(loss)) and restored.grad_norm is None
  path = checkpoint.save(str(tmp_path / "untracked"), restored)
  back = checkpoint.restore(path, new(True))
  assert float(back.grad_norm) == 0.0
  assert_same_bits(back.params, restored.params, "params")
  back, _ = _train_step(back, _batches(seed, 4)[3])
  assert float(back.grad_norm) > 0.0


def test_resumed_training_takes_the_same_steps(tmp_path, seed):
  batches = _batches(seed, 6)
  state = _new_state(seed)
  uninterrupted = []
  for i, batch in enumerate(batches):
    state, loss = _train_step(state, batch)
    uninterrupted.append((host_copy(state.params), float(loss)))
    if i == 2:
      path = checkpoint.save(str(tmp_path / "step3"), state)
  resumed = checkpoint.restore(path, _new_state(seed + 7))
  for batch, (params, loss) in zip(batches[3:], uninterrupted[3:]):
    resumed, resumed_loss = _train_step(resumed, batch)
    assert resumed_loss == loss
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(params)):
      assert_bitwise_equal(np.atleast_1d(a), np.atleast_1d(b), "params")
