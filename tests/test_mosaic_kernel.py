"""The Mosaic GPU kernel (GPU interpret mode on CPU) against the XLA reference.

``mosaic.mosaic_update`` has ``backends.xla_update``'s contract. On CPU it
runs in Mosaic GPU's interpret mode, which simulates the CTAs' warpgroups,
shared memory, TMA copies and barriers, so the persistent tile loop, the
warp-specialized pipeline and the epilogue's load/update/store sequence
(single- and double-buffered) of both schedules are checked here. One part
is not: the interpreter's wgmma takes no transposed operand, so there x
arrives transposed (``mosaic_update``'s interpret path); the compiled path
(transposed wgmma, in-place refs, setmaxnreg) goes through Mosaic GPU's CUDA
lowering on the CPU here, and runs in the GPU tests and
``benchmarks/kernel_bench.py --suite mosaic``.

Tolerances are test_kernel.py's (a float32 sum in another order). Each
interpreted call takes several seconds (the interpreter compiles the kernel
body for every simulated warpgroup of every CTA), so shapes are the
smallest that span several tiles, and the default run is a subset of the
tables: the inline schedule ('auto' ranks no other) with every storage mode
(float32, bfloat16, bfloat16 with stochastic rounding, int8 states) and one
optimizer of each state kind, its pipeline edge cases, and every optimizer
on every schedule through the CUDA lowering; ``--run-slow`` runs the rest.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax as fj
from forge_jax import quantization as Q
from forge_jax.ops import backends, mosaic, triton_kernel
from forge_jax.ops.fused_dense import FusedDenseSpec
from forge_jax.ops.mosaic import compat as mosaic_compat
from forge_jax.ops.mosaic import config as mosaic_config

from conftest import (
  assert_bitwise_equal,
  assert_same_bits,
  assert_within_rounding,
  bits,
  host_copy,
  poison,
)
from fused_dense_test_base import (
  BF16,
  F32,
  OPTIMIZERS,
  assert_leaves_match,
  assert_outputs_match,
  exact_inputs,
  random_inputs,
  rounding_key,
  run_reference,
)

# 64 x 64 parts, two compute warpgroups: a CTA tile is 64 x 128. K = 128,
# N = 256, 128 tokens: 2 x 2 tiles on two CTAs, 2 pipeline steps each, and
# two 64 x 32 epilogue sub-tiles per part (four of 64 x 16 when
# double-buffered: two slots, each reused once).
SMALL = dict(
  tile_k=64, tile_n=64, tile_t=64, max_concurrent_steps=2, epilogue_k=64
)
CONFIGS = {
  "all-prefetched": mosaic.MosaicConfig(
    **SMALL, epilogue_n=32, epilogue_slots=2
  ),
  "double-buffered": mosaic.MosaicConfig(
    **SMALL, epilogue_n=16, epilogue_slots=2, prefetch_step=0
  ),
  "single-buffered": mosaic.MosaicConfig(
    **SMALL, epilogue_n=32, epilogue_slots=1
  ),
  "one-warpgroup": mosaic.MosaicConfig(
    **SMALL, epilogue_n=32, epilogue_slots=2, compute_wgs=1
  ),
  # A 64 x 64 tile per warpgroup, in turns: four tiles a CTA, two steps
  # each; two 64 x 32 sub-tiles per tile in two buffers per warpgroup,
  # loaded ahead across tiles.
  "pingpong": mosaic.MosaicConfig(
    **SMALL, epilogue_n=32, epilogue_slots=2, schedule="pingpong"
  ),
  # Four sub-tiles a tile, single-buffered: each load waits for the
  # previous sub-tile's stores.
  "pingpong-single-buffered": mosaic.MosaicConfig(
    **SMALL, epilogue_n=16, epilogue_slots=1, schedule="pingpong"
  ),
}
X_SHAPE, N = (2, 64, 128), 256
# int8 states: epilogue sub-tiles of one quantization block (64 columns).
# 'int8': 2 x 2 tiles of 64 x 128, one sub-tile per part; 'int8-two-rows':
# one row of 128 x 128 tiles, two sub-tiles per part (double-buffered);
# 'int8-pingpong': eight 64 x 64 tiles, one sub-tile each.
INT8_CONFIGS = {
  "int8": mosaic.MosaicConfig(**SMALL, epilogue_n=64, epilogue_slots=1),
  "int8-pingpong": mosaic.MosaicConfig(
    **SMALL, epilogue_n=64, epilogue_slots=1, schedule="pingpong"
  ),
  "int8-two-rows": mosaic.MosaicConfig(
    **{**SMALL, "tile_k": 128}, epilogue_n=64, epilogue_slots=2
  ),
}
#: One config per schedule (inline, pingpong): the per-optimizer tests run
#: each with --run-slow.
SCHEDULES = ("all-prefetched", "pingpong")
#: The schedule the default run simulates: 'auto' ranks inline configs
#: only. Pingpong is checked by every optimizer's CUDA lowering in the
#: default run and in interpret mode with --run-slow.
DEFAULT_SCHEDULE = "all-prefetched"
#: The optimizers the default run checks in interpret mode here: the one
#: with the most state tensors (four, in float32, on the single-buffered
#: epilogue); two moments in float32 are AdamW's in the non-finite and
#: pipeline checks below (Adam's: test_fused_dense.py's
#: MosaicInterpretTest::test_matches_reference, with --run-slow); in int8,
#: AdamW's in
#: test_mosaic_nonfinite_gradients_keep_int8_blocks_bit_for_bit (every
#: finite row's codes, scales and weights bit for bit). Every rule is the
#: same traced ``apply_update`` as the XLA reference's (which
#: tests/test_optax_equivalence.py holds to optax), and every optimizer
#: lowers for CUDA in the default run; --run-slow simulates them all.
FP32_DEFAULT = ("rmsprop-centered-nesterov",)
INT8_DEFAULT = ()
#: The int8 steps on the "int8" config; the others cycle through the int8
#: configs.
INT8_ON_DEFAULT_CONFIG = ("adamw-schedule", "radam-rectified")
#: The int8 config of the default run's int8 steps (the non-finite test).
NONFINITE_INT8_CONFIG = "int8"


def slow_unless(default, *values, case_id=None):
  """``pytest.param(*values)``, marked slow unless the default run takes it."""
  return pytest.param(
    *values, id=case_id, marks=() if default else pytest.mark.slow
  )


def by_schedule(default_schedules):
  """One case per schedule, slow unless in ``default_schedules``."""
  return [
    slow_unless(schedule in default_schedules, schedule, case_id=schedule)
    for schedule in SCHEDULES
  ]


def run_mosaic(
  opt,
  x,
  dy,
  kernel,
  state,
  count,
  config,
  layer_index=None,
  step=None,
  offset=None,
  layer_id=0,
):
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  apply = jnp.all(jnp.isfinite(dy))
  scalars = opt.scalars(jnp.asarray(count, jnp.int32))
  fn = jax.jit(
    functools.partial(
      mosaic.mosaic_update,
      spec,
      config=config,
      interpret=True,
      layer_index=layer_index,
      offset=offset,
    )
  )
  key = rounding_key(opt, step, layer_id)
  return host_copy(fn(x, dy, kernel, state, scalars, apply, rounding_key=key))


def run_reference_at(
  opt, x, dy, kernel, state, count, step, offset=None, layer_id=0
):
  """The reference with stochastic rounding's step, offset and layer id."""
  spec = FusedDenseSpec(optimizer=opt, implementation="xla")
  fn = jax.jit(functools.partial(backends.xla_update, spec, offset=offset))
  return host_copy(
    fn(
      x,
      dy,
      kernel,
      state,
      opt.scalars(jnp.asarray(count, jnp.int32)),
      jnp.all(jnp.isfinite(dy)),
      rounding_key=rounding_key(opt, step, layer_id),
    )
  )


FP32_CASES = [
  slow_unless(
    name in FP32_DEFAULT and schedule == DEFAULT_SCHEDULE,
    name,
    opt,
    count,
    schedule,
    case_id=f"{name}-{schedule}",
  )
  for name, opt, count in OPTIMIZERS
  for schedule in SCHEDULES
]


@pytest.mark.parametrize("name,opt,count,schedule", FP32_CASES)
def test_mosaic_kernel_matches_reference(name, opt, count, schedule, seed):
  dtypes = (F32, F32, BF16)  # 16-bit activations
  config = CONFIGS[schedule]
  if name.startswith("rmsprop-centered") and schedule == "all-prefetched":
    config = CONFIGS["single-buffered"]  # four state tensors: less smem
  inputs = random_inputs(seed, opt, X_SHAPE, N, dtypes)
  old_kernel = np.asarray(inputs[2]).copy()
  expected = run_reference(opt, *inputs, count)
  actual = run_mosaic(opt, *inputs, count, config)
  assert_leaves_match(actual, expected, name)
  assert int(actual[2]) == int(expected[2]) == 0
  assert (bits(actual[0]) != bits(old_kernel)).mean() > 0.5


BF16_CASES = [
  slow_unless(config == DEFAULT_SCHEDULE, config, case_id=config)
  for config in sorted(CONFIGS)
]


@pytest.mark.parametrize("config", BF16_CASES)
def test_mosaic_configs_and_bf16_storage(config, seed):
  opt = fj.adamw(0.05, weight_decay=0.1)
  inputs = random_inputs(seed, opt, X_SHAPE, N, (BF16, BF16, BF16))
  expected = run_reference(opt, *inputs, 3)
  actual = run_mosaic(opt, *inputs, 3, CONFIGS[config])
  assert_leaves_match(actual, expected, config)


# No default config takes 128-token steps: pingpong's case runs with
# --run-slow.
@pytest.mark.parametrize(
  "schedule", ["inline", pytest.param("pingpong", marks=pytest.mark.slow)]
)
def test_mosaic_128_token_steps_match_reference(schedule, seed):
  """128 tokens a pipeline step (wgmma contracting 128 rows of the
  transposed x block): 256 tokens give each tile two steps, and the
  three-stage ring runs on across a CTA's two tiles."""
  opt = fj.adamw(0.05, weight_decay=0.1)
  config = mosaic.MosaicConfig(
    **{**SMALL, "tile_t": 128, "max_concurrent_steps": 3},
    epilogue_n=32,
    epilogue_slots=1,
    schedule=schedule,
  )
  inputs = random_inputs(seed, opt, (2, 128, 128), N, (BF16, BF16, BF16))
  expected = run_reference(opt, *inputs, 3)
  actual = run_mosaic(opt, *inputs, 3, config)
  assert_leaves_match(actual, expected, f"{schedule}-t128")


# Slow on every schedule: the default run skips a NaN row of dW in
# test_mosaic_nonfinite_gradients_keep_int8_blocks_bit_for_bit and counts
# skipped elements in test_mosaic_counts_skipped_elements_per_warpgroup.
@pytest.mark.parametrize("schedule", by_schedule(set()))
def test_mosaic_skips_and_counts_nonfinite_gradient_elements(schedule, seed):
  opt = fj.adamw(0.05)
  x, dy, kernel, state = random_inputs(seed, opt, X_SHAPE, N, (F32, F32, BF16))
  x = x.at[0, 3, 17].set(jnp.nan)  # row 17 of dW is NaN: N elements skipped
  expected = run_reference(opt, x, dy, kernel, state, 2)
  actual = run_mosaic(opt, x, dy, kernel, state, 2, CONFIGS[schedule])
  assert int(expected[2]) == int(actual[2]) == N
  np.testing.assert_array_equal(bits(actual[0])[17], bits(kernel)[17])
  rows = np.arange(kernel.shape[0]) != 17
  for a, e in zip(jax.tree.leaves(actual[:2]), jax.tree.leaves(expected[:2])):
    assert_outputs_match(np.asarray(a)[rows], np.asarray(e)[rows], schedule)


def overflowing_inputs(x, dy, rows, columns):
  """x and dy whose dW = xᵀ·dy overflows to inf exactly at ``rows`` x
  ``columns`` (dy stays finite, so the step applies): token 0 has x = 3e38
  at ``rows`` and dy = 4 at ``columns``, 0 at dy's other columns."""
  x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
  x2 = x2.at[0, jnp.asarray(rows)].set(3e38)
  dy2 = dy2.at[0].set(0).at[0, jnp.asarray(columns)].set(4)
  return x2.reshape(x.shape), dy2.reshape(dy.shape)


def uneven_columns(n):
  """Non-finite columns whose count differs between 64-column parts (0, ~9
  or ~18 a part), so each warpgroup's count differs from its neighbour's."""
  return [j for j in range(n) if j % 7 < j // 64 % 3]


@pytest.mark.filterwarnings("ignore:overflow encountered in matmul")
@pytest.mark.parametrize("schedule", by_schedule({DEFAULT_SCHEDULE}))
def test_mosaic_counts_skipped_elements_per_warpgroup(schedule, seed):
  """Warpgroups whose parts skip different numbers of elements: the total
  is each one's count, not one's twice."""
  opt = fj.adamw(0.05)
  x, dy, kernel, state = random_inputs(seed, opt, X_SHAPE, N, (F32, F32, BF16))
  rows, columns = [3, 70], uneven_columns(N)
  x, dy = overflowing_inputs(x, dy, rows, columns)
  expected = run_reference(opt, x, dy, kernel, state, 2)
  actual = run_mosaic(opt, x, dy, kernel, state, 2, CONFIGS[schedule])
  assert int(expected[2]) == int(actual[2]) == len(rows) * len(columns)
  assert_leaves_match(actual, expected, schedule)


# Slow on every schedule: the default run steps a stacked layer (the same
# path) in test_mosaic_stochastic_rounding_of_a_stacked_layer.
@pytest.mark.parametrize("schedule", by_schedule(set()))
def test_mosaic_stacked_layer_updates_only_its_entry(schedule, seed):
  """Interpret mode steps the layer's entries outside the kernel
  (``mosaic_update``), the same for either schedule."""
  opt = fj.adamw(0.05)
  x, dy, kernel, state = random_inputs(seed, opt, X_SHAPE, N, (F32, F32, BF16))
  stack = lambda a: jnp.stack([a, a + 1.0, a - 1.0])
  kernels, states = stack(kernel), jax.tree.map(stack, state)
  layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  expected = run_reference(opt, x, dy, kernels[1], layer(states, 1), 2)
  actual = run_mosaic(
    opt, x, dy, kernels, states, 2, CONFIGS[schedule], layer_index=jnp.int32(1)
  )
  assert_leaves_match((actual[0][1], layer(actual[1], 1)), expected, "layer 1")
  for i in (0, 2):  # the other layers are untouched, bit for bit
    for a, b in zip(
      jax.tree.leaves(layer(actual[:2], i)),
      jax.tree.leaves(layer((kernels, states), i)),
    ):
      np.testing.assert_array_equal(bits(a), bits(b))


def test_mosaic_config_errors_name_the_bad_field():
  with pytest.raises(
    ValueError,
    match=r"epilogue_slots=5 must be between 1 "
    r"and the 4 epilogue sub-tiles",
  ):
    mosaic.MosaicConfig(epilogue_slots=5)
  with pytest.raises(ValueError, match=r"prefetch_step=-1 must be >= 0"):
    mosaic.MosaicConfig(prefetch_step=-1)
  with pytest.raises(ValueError, match=r"tile_t=32 must be a multiple of 64"):
    mosaic.MosaicConfig(tile_t=32)
  with pytest.raises(ValueError, match=r"compute_wgs=3 must be 1 or 2"):
    mosaic.MosaicConfig(compute_wgs=3)
  for schedule in mosaic.SCHEDULES:
    with pytest.raises(ValueError, match=r"compute_wgs=4 must be 1 or 2"):
      mosaic.MosaicConfig(compute_wgs=4, schedule=schedule)
  with pytest.raises(
    ValueError,
    match=r"tile_n=32 must be at least 64 when 2 "
    r"compute warpgroups share a tile",
  ):
    mosaic.MosaicConfig(tile_n=32)
  with pytest.raises(ValueError, match=r"prefetch_step=1 does not apply"):
    mosaic.MosaicConfig(prefetch_step=1, schedule="pingpong")
  with pytest.raises(
    ValueError,
    match=r"take 320 registers a thread, more "
    r"than the 216 of each of 2 compute warpgroups",
  ):
    mosaic.MosaicConfig(tile_n=256, schedule="pingpong")
  with pytest.raises(
    ValueError,
    match=r"ctas_per_sm=2 must be 1 with "
    r"schedule='pingpong'",
  ):
    mosaic.MosaicConfig(ctas_per_sm=2, schedule="pingpong")
  with pytest.raises(
    ValueError,
    match=r"rolled_epilogue applies to schedule='inline', not 'pingpong'",
  ):
    mosaic.MosaicConfig(rolled_epilogue=True, schedule="pingpong")
  for removed in ("overlap", "epilogue-warpgroup", "ring"):
    with pytest.raises(
      ValueError,
      match=rf"schedule='{removed}' must be one "
      r"of \('inline', 'pingpong'\)",
    ):
      mosaic.MosaicConfig(schedule=removed)


@pytest.mark.parametrize(
  "schedule,features,slots",
  [
    pytest.param("all-prefetched", 128, 2, id="all-prefetched-128-2"),
    pytest.param("pingpong", 64, 2, id="pingpong-64-2", marks=pytest.mark.slow),
  ],
)
def test_mosaic_hand_written_pipelines_with_uneven_tiles_and_steps(
  schedule, features, slots, seed
):
  """Three tiles on two CTAs (one CTA gets two, the other one: with
  'pingpong' its second warpgroup has none) and three pipeline steps on a
  ring of two buffers: the step and sub-tile rings run across tiles, and
  the last tile's loads must not be issued."""
  opt = fj.adamw(0.05, weight_decay=0.1)
  inputs = random_inputs(seed, opt, (3, 64, 192), features, (BF16, F32, BF16))
  config = dataclasses.replace(
    CONFIGS[schedule], epilogue_n=16, epilogue_slots=slots
  )
  expected = run_reference(opt, *inputs, 2)
  actual = run_mosaic(opt, *inputs, 2, config)
  assert_leaves_match(actual, expected, schedule)


@pytest.mark.parametrize("schedule", by_schedule({DEFAULT_SCHEDULE}))
def test_mosaic_one_pipeline_step_per_tile(schedule, seed):
  """64 tokens: one step a tile, so each tile's only step is also its last
  (released once the accumulator is read) and the ring of buffers is
  reused across tiles. A pipeline that shrinks to one stage here hangs
  (interpret mode) or fails to launch (H200)."""
  opt = fj.adamw(0.05, weight_decay=0.1)
  inputs = random_inputs(seed, opt, (64, 128), N, (BF16, F32, BF16))
  expected = run_reference(opt, *inputs, 2)
  actual = run_mosaic(opt, *inputs, 2, CONFIGS[schedule])
  assert_leaves_match(actual, expected, schedule)


def test_default_config_fits_dtypes_and_shape():
  def default(tokens, n, dtype, opt=fj.adamw(1e-3)):
    return mosaic.default_config(
      jax.ShapeDtypeStruct((tokens, 4096), BF16),
      jax.ShapeDtypeStruct((4096, n), dtype),
      opt,
    )

  inline = mosaic.INLINE_CONFIGS
  # bf16 W, m and v: the pingpong schedule from 2048 tokens where every SM
  # walks at least 16 tiles (4096 x 14336: 3584 tiles), inline otherwise.
  for tokens in (512, 1024, 2048, 8192):
    assert default(tokens, 4096, BF16) == inline[0]
    assert default(tokens, 1024, BF16) == inline[0]
  for tokens, schedule in ((1024, "inline"), (2048, "pingpong")):
    assert default(tokens, 14336, BF16).schedule == schedule
  assert default(8192, 14336, BF16) == mosaic.PINGPONG_CONFIGS[0]
  # A light update (a bf16 W and at most one bf16 state: Lion, SGD) takes
  # it from 1024 tokens where every SM walks at least 4 tiles (4096 x 4096:
  # 1024 tiles); a float32 state makes Lion's update heavy.
  for opt in (fj.lion(1e-4), fj.sgd(1e-2, momentum=0.9), fj.sgd(1e-2)):
    assert default(512, 14336, BF16, opt) == inline[0]
    assert default(1024, 14336, BF16, opt) == mosaic.PINGPONG_CONFIGS[0]
    assert default(1024, 4096, BF16, opt) == mosaic.PINGPONG_CONFIGS[0]
    assert default(2048, 1024, BF16, opt) == inline[0]
  lion_f32 = fj.lion(1e-4, state_dtype=F32)
  assert default(1024, 14336, BF16, lion_f32).schedule == "inline"
  # Stochastically rounded kernels stay inline at every token count.
  for opt in (
    fj.adamw(1e-3, weight_rounding="stochastic"),
    fj.lion(1e-4, weight_rounding="stochastic"),
  ):
    for tokens in (1024, 2048, 8192):
      assert default(tokens, 14336, BF16, opt) == inline[0]
  # float32 W, m and v fit one epilogue buffer per warpgroup beside the
  # five-stage pipeline (no pingpong config fits); four float32 state
  # tensors a shallower pipeline.
  four = fj.rmsprop(1e-3, centered=True, momentum=0.9)
  assert default(2048, 4096, F32) == inline[1]
  assert default(2048, 14336, F32) == inline[1]
  assert default(2048, 4096, F32, four) == inline[2]
  # int8 states with stochastic rounding (of the kernel or of 4-bit
  # levels): 64 x 64 parts, one block-wide sub-tile each, at every token
  # count.
  int8 = int8_sr(fj.adamw(1e-3))
  quantized = dataclasses.replace(mosaic.QUANTIZED_CONFIGS[0], epilogue_n=64)
  assert quantized.tile_k == quantized.tile_n == 64
  int8_4bit = fj.adamw(1e-3, state_dtype="int8", second_moment_bits=4)
  for opt in (int8, int8_4bit):
    assert default(512, 4096, BF16, opt) == quantized
    assert default(8192, 4096, BF16, opt) == quantized
  # Rounded to nearest: from 2048 tokens 128 x 64 parts whose two
  # sub-tiles are updated in a rolled loop.
  int8_nearest = fj.adamw(1e-3, state_dtype="int8")
  rolled = dataclasses.replace(
    mosaic.QUANTIZED_ROLLED_CONFIGS[0], epilogue_n=64
  )
  assert rolled.rolled_epilogue and rolled.epilogue_subtiles == 2
  assert default(1024, 4096, BF16, int8_nearest) == quantized
  assert default(2048, 4096, BF16, int8_nearest) == rolled
  assert default(2048, 4096, F32, int8_nearest) == rolled
  for tokens, n, dtype, opt in (
    (2048, 4096, F32, four),
    (8192, 384, BF16, fj.adamw(1e-3)),
    (8192, 4096, BF16, int8),
    (2048, 4096, F32, int8_nearest),
  ):
    config = default(tokens, n, dtype, opt)
    assert (
      mosaic.unsupported_reason(
        jnp.zeros((tokens, 4096), BF16),
        jnp.zeros((tokens, n), BF16),
        jnp.zeros((4096, n), dtype),
        opt,
        config,
      )
      is None
    )


@pytest.mark.parametrize(
  "config",
  [
    mosaic.MosaicConfig(compute_wgs=1),
    mosaic.MosaicConfig(ctas_per_sm=2),
    *mosaic.INLINE_CONFIGS,
    *mosaic.PINGPONG_CONFIGS,
    *mosaic.QUANTIZED_CONFIGS,
    *mosaic.QUANTIZED_ROLLED_CONFIGS,
  ],
  ids=repr,
)
def test_compute_warpgroups_take_only_released_registers(config):
  """setmaxnreg raises a warpgroup's registers from what the CTA's other
  warpgroups released and waits for them: asking for more than the memory
  warpgroups give back hangs the kernel."""
  launch = mosaic_config.launch_registers(config)
  wanted = mosaic_config.compute_warpgroup_registers(config)
  memory_wgs = config.num_warpgroups - config.compute_wgs
  assert launch * config.num_warpgroups <= 512
  if wanted > launch:
    released = memory_wgs * (launch - mosaic_config.MEMORY_REGISTERS)
    assert config.compute_wgs * (wanted - launch) <= released
  assert wanted % 8 == 0 and wanted <= mosaic_config.MAX_REGISTERS


def test_too_many_epilogue_barriers_is_a_clear_error():
  """Mosaic GPU tracks at most 32 barriers per group: 2 warpgroups x 5
  buffers x 4 leaves (W and three state tensors) would be 40."""
  opt = fj.rmsprop(1e-3, centered=True, momentum=0.9)
  config = mosaic.MosaicConfig(tile_k=64, epilogue_n=8, epilogue_slots=5)
  x = jnp.zeros((64, 64), BF16)
  reason = mosaic.unsupported_reason(
    x, x, jnp.zeros((64, 128), BF16), opt, config
  )
  assert "40 barriers, more than Mosaic GPU's 32" in reason


# ---------------------------------------------------------------------------
# Low precision: stochastically rounded bf16 weights (and int8 states) give
# the reference's bits. x and dy are exact_inputs (dW is exact in any
# summation order), so any differing bit would be the kernel's storage path.


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
    expected = run_reference_at(
      opt, x, dy, w, state, count, step, offset, layer_id=9
    )
    actual = run_mosaic(
      opt, x, dy, w, state, count, config, step=step, offset=offset, layer_id=9
    )
    # Kernel, state and skipped count bit for bit; the gradient's sum of
    # squares follows each backend's summation order.
    assert_same_bits(actual[:3], expected[:3], f"count={count}")
    np.testing.assert_allclose(actual[3], expected[3], rtol=1e-5)
    assert (bits(expected[0]) != bits(w)).mean() > 0.3
    w, state = jax.tree.map(jnp.asarray, expected[:2])
  return w, state


SR_OPTIMIZERS = {
  "adamw": fj.adamw(
    0.05, weight_decay=0.1, weight_rounding="stochastic", rounding_seed=11
  ),
  "lion": fj.lion(0.05, weight_rounding="stochastic", rounding_seed=3),
}


SR_CASES = [
  slow_unless(False, "adamw", None, "double-buffered", case_id="adamw-whole"),
  # The default run's stochastic rounding at an offset is the stacked
  # layer's (below).
  slow_unless(
    False, "lion", (4096, 512), "double-buffered", case_id="lion-shard-offset"
  ),
  slow_unless(
    False, "lion", (4096, 512), "pingpong", case_id="lion-shard-offset-pingpong"
  ),
]


@pytest.mark.parametrize("name,offset,config", SR_CASES)
def test_mosaic_stochastic_rounding_matches_reference_bits(
  name, offset, config, seed
):
  """Two steps (a new draw each); a tensor-parallel shard at a global
  offset hashes the global indices, as the reference does."""
  run_lowp_steps(SR_OPTIMIZERS[name], seed, CONFIGS[config], offset=offset)


#: The stacked layer's schedule: the default run's stochastic rounding, at a
#: shard's offset, on the inline schedule.
SR_STACKED_CONFIG = "single-buffered"


def test_mosaic_stochastic_rounding_of_a_stacked_layer(seed):
  opt = SR_OPTIMIZERS["adamw"]
  x, dy = exact_inputs(seed, X_SHAPE, N, BF16)
  w = 0.5 * jax.random.normal(jax.random.key(seed), (X_SHAPE[-1], N))
  kernels = jnp.stack([w, w + 1.0, w - 1.0]).astype(BF16)
  states = opt.init(kernels)
  step, offset = jnp.int32(7), (128, 256)
  expected = run_reference_at(
    opt,
    x,
    dy,
    kernels[2],
    jax.tree.map(lambda a: a[2], states),
    7,
    step,
    offset,
    layer_id=9,
  )
  actual = run_mosaic(
    opt,
    x,
    dy,
    kernels,
    states,
    7,
    CONFIGS[SR_STACKED_CONFIG],
    layer_index=jnp.int32(2),
    step=step,
    offset=offset,
    layer_id=9,
  )
  layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  assert_same_bits(layer(actual[:2], 2), expected[:2], "layer 2")
  assert_same_bits(layer(actual[:2], 0), layer((kernels, states), 0), "layer 0")


def int8_sr(opt, seed=0):
  return dataclasses.replace(
    opt, state_dtype="int8", weight_rounding="stochastic", rounding_seed=seed
  )


# Every optimizer with a state that int8 can hold (centered RMSprop refuses
# int8; plain SGD has no state).
INT8_OPTIMIZERS = [
  (name, int8_sr(opt, i), count)
  for i, (name, opt, count) in enumerate(OPTIMIZERS)
  if name not in ("rmsprop-centered-nesterov", "sgd")
]


def int8_inputs(seed, opt, x_shape=X_SHAPE, n=N):
  """Exact x and dy; a bf16 kernel and a random state, quantized."""
  float_opt = dataclasses.replace(opt, state_dtype=None)
  _, _, kernel, state = random_inputs(
    seed, float_opt, x_shape, n, (BF16, F32, BF16)
  )
  state = type(state)(
    **{
      field: Q.store(value, "int8", field in opt.nonnegative_state)
      for field, value in state._asdict().items()
    }
  )
  return (*exact_inputs(seed, x_shape, n, BF16), kernel, state)


INT8_CASES = [
  slow_unless(
    name in INT8_DEFAULT,
    name,
    opt,
    count,
    "int8"
    if name in INT8_DEFAULT + INT8_ON_DEFAULT_CONFIG
    else sorted(INT8_CONFIGS)[i % len(INT8_CONFIGS)],
    case_id=name,
  )
  for i, (name, opt, count) in enumerate(INT8_OPTIMIZERS)
]


@pytest.mark.parametrize("name,opt,count,config", INT8_CASES)
def test_mosaic_int8_states_match_reference_bits(
  name, opt, count, config, seed
):
  """One step from a random int8 state, with stochastic rounding: codes,
  scales and weights are the reference's but for rare elements whose
  float32 update XLA compiles differently in the interpreter's tile (NAdam:
  one of 32768 weights one bf16 ulp off, with some configs)."""
  inputs = int8_inputs(seed, opt)
  step = jnp.int32(count + 1)
  expected = run_reference_at(opt, *inputs, count, step, layer_id=9)
  actual = run_mosaic(
    opt, *inputs, count, INT8_CONFIGS[config], step=step, layer_id=9
  )
  assert int(actual[2]) == int(expected[2]) == 0
  assert_within_rounding(actual[:2], expected[:2], name, identical=0.9999)
  for new, old in zip(
    jax.tree.leaves(expected[:2]), jax.tree.leaves(inputs[2:])
  ):
    assert (bits(new) != bits(old)).any(), f"{name}: a leaf did not move"


# One and two buffers with --run-slow: the compiled GPU test
# (test_compiled_rolled_int8_update_gives_the_unrolled_bits) runs the
# package's rolled configs by default.
@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 2])
def test_mosaic_rolled_epilogue_gives_the_unrolled_bits(slots, seed):
  """Two int8 sub-tiles a part, updated in a loop that rotates them through
  its carry (one or two buffers: the second sub-tile's loads issued on the
  first's release, or under the main loop): the unrolled update's bits."""
  opt = int8_sr(SR_OPTIMIZERS["adamw"], 5)
  inputs = int8_inputs(seed, opt)
  step = jnp.int32(4)
  config = dataclasses.replace(
    INT8_CONFIGS["int8-two-rows"], epilogue_slots=slots, rolled_epilogue=True
  )
  rolled = run_mosaic(opt, *inputs, 3, config, step=step, layer_id=9)
  unrolled = run_mosaic(
    opt,
    *inputs,
    3,
    dataclasses.replace(config, rolled_epilogue=False),
    step=step,
    layer_id=9,
  )
  assert_same_bits(rolled, unrolled, "rolled")
  for new, old in zip(jax.tree.leaves(rolled[:2]), jax.tree.leaves(inputs[2:])):
    assert (bits(new) != bits(old)).any(), "a leaf did not move"


def test_mosaic_rolled_epilogue_lowers_for_cuda_on_cpu():
  """The rolled update's loop (carried wgmma-layout sub-tiles, buffers and
  barriers at a traced index) has Mosaic GPU layouts."""
  config = mosaic.MosaicConfig(
    max_concurrent_steps=4,
    epilogue_n=Q.BLOCK_SIZE,
    epilogue_slots=1,
    rolled_epilogue=True,
  )
  opt = int8_sr(SR_OPTIMIZERS["adamw"], 5)
  text = lower_for_cuda(opt, (256, 512), BF16, "inline", config=config)
  assert "mosaic_gpu" in text


@pytest.mark.slow
def test_mosaic_int8_steps_of_a_shard_and_of_a_stacked_layer(seed):
  """Two AdamW steps of a tensor-parallel shard; then a stacked layer."""
  opt = int8_sr(SR_OPTIMIZERS["adamw"], 11)
  w, state = run_lowp_steps(
    opt, seed, INT8_CONFIGS["int8-two-rows"], offset=(256, 1024)
  )
  x, dy = exact_inputs(seed, X_SHAPE, N, BF16)
  stack = lambda a: jnp.stack([a, a])
  step = jnp.int32(6)
  expected = run_reference_at(opt, x, dy, w, state, 6, step, layer_id=9)
  actual = run_mosaic(
    opt,
    x,
    dy,
    stack(w),
    jax.tree.map(stack, state),
    6,
    INT8_CONFIGS["int8"],
    layer_index=jnp.int32(1),
    step=step,
    layer_id=9,
  )
  layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  assert_same_bits(layer(actual[:2], 1), expected[:2], "layer 1")
  assert_same_bits(layer(actual[:2], 0), (w, state), "layer 0")


def test_mosaic_nonfinite_gradients_keep_int8_blocks_bit_for_bit(seed):
  """A NaN in x makes row 17 of dW non-finite: its blocks keep their codes
  and scales (and weights) bit for bit, as in the reference; a non-finite
  dy skips the whole layer."""
  opt = int8_sr(SR_OPTIMIZERS["adamw"], 11)
  x, dy, w, state = int8_inputs(seed, opt)
  config, step = INT8_CONFIGS[NONFINITE_INT8_CONFIG], jnp.int32(3)
  x = poison(x, np.s_[1, 5, 17])
  expected = run_reference_at(opt, x, dy, w, state, 2, step)
  actual = run_mosaic(opt, x, dy, w, state, 2, config, step=step)
  assert int(actual[2]) == int(expected[2]) == N
  assert_same_bits(actual[:3], expected[:3], "NaN row")
  assert np.isnan(actual[3]) and np.isnan(expected[3])  # a NaN in dW
  old = host_copy((w, state))
  assert_bitwise_equal(actual[0][17], old[0][17], "weights of the NaN row")
  quantized_leaves = lambda state: jax.tree.leaves(
    state, is_leaf=Q.is_quantized
  )
  for new_leaf, old_leaf in zip(
    quantized_leaves(actual[1]), quantized_leaves(old[1])
  ):
    assert_bitwise_equal(new_leaf.codes[17], old_leaf.codes[17], "codes")
    assert_bitwise_equal(new_leaf.scale[17], old_leaf.scale[17], "scales")
  dy = poison(dy, np.s_[0, 3, 0], np.inf)
  actual = run_mosaic(opt, x, dy, w, state, 2, config, step=step)
  assert int(actual[2]) == w.size
  assert_same_bits(actual[:2], old, "skipped layer")


def test_mosaic_refuses_what_it_cannot_run_and_auto_falls_back(monkeypatch):
  opt = fj.adamw(1e-3)
  x = jnp.zeros((128, 128), BF16)
  kernel = jnp.zeros((128, 256), F32)
  for supported in (opt, SR_OPTIMIZERS["adamw"]):
    assert (
      mosaic.unsupported_reason(x, x[:, :1].repeat(256, 1), kernel, supported)
      is None
    )
  odd = jnp.zeros((128, 200), F32)
  with pytest.raises(ValueError, match=r"features=200 must be a multiple"):
    backends.select("mosaic", x, jnp.zeros((128, 200), BF16), odd, opt)
  with pytest.raises(ValueError, match=r"x.dtype=float32 must be bfloat16"):
    backends.select("mosaic", x.astype(F32), x.astype(F32), kernel, opt)
  int8 = fj.adamw(1e-3, state_dtype="int8")
  assert (
    mosaic.unsupported_reason(x, x[:, :1].repeat(256, 1), kernel, int8) is None
  )
  assert mosaic.default_config(x, kernel, int8).epilogue_n == 64
  with pytest.raises(ValueError, match=r"epilogue_n=32 must be 64"):
    mosaic.check_supported(
      x, x[:, :1].repeat(256, 1), kernel, int8, CONFIGS["single-buffered"]
    )
  f16 = fj.lion(1e-3, state_dtype="float16")
  with pytest.raises(ValueError, match=r"state dtype float16 is not"):
    backends.select("mosaic", x, x[:, :1].repeat(256, 1), kernel, f16)
  # 4-bit second moments: on a GPU whose JAX lowers no concatenate in
  # Mosaic GPU, refused with the reason (interpret mode runs them).
  fourbit = fj.adamw(1e-3, state_dtype="int8", second_moment_bits=4)
  dy = x[:, :1].repeat(256, 1)
  assert mosaic.unsupported_reason(x, dy, kernel, fourbit) is None
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(mosaic_compat, "lowers_concatenate", lambda: False)
  assert "concatenate" in mosaic.unsupported_reason(x, dy, kernel, fourbit)
  monkeypatch.undo()
  # Off-GPU 'auto' is the reference.
  monkeypatch.setattr(backends, "on_gpu", lambda: False)
  assert backends.select("auto", x, x, kernel, opt) is backends.xla_update


#: The schedules of the GPU test: with one epilogue buffer per warpgroup
#: every optimizer's float32 state fits.
GPU_CONFIGS = {
  "default": None,
  "pingpong": mosaic.MosaicConfig(
    schedule="pingpong", tile_n=128, max_concurrent_steps=4, epilogue_slots=1
  ),
}

#: Storage modes: the kernel's dtype and the optimizer's state and rounding.
STORAGE_MODES = {
  "fp32": (F32, lambda opt, seed: opt),
  "bf16": (
    BF16,
    lambda opt, seed: dataclasses.replace(opt, state_dtype="bfloat16"),
  ),
  "bf16-sr": (
    BF16,
    lambda opt, seed: dataclasses.replace(
      opt,
      state_dtype="bfloat16",
      weight_rounding="stochastic",
      rounding_seed=seed,
    ),
  ),
  "int8": (BF16, int8_sr),
}
INT8_NAMES = {name for name, _, _ in INT8_OPTIMIZERS}


#: Pingpong's lowering takes several times inline's, most of all with
#: stochastic rounding and int8 states: the default run lowers those on one
#: optimizer each (these), the others' in float32 and bfloat16 in turn.
PINGPONG_DEFAULT_STORAGE = {"sgd": "bf16-sr", "sgd-nesterov": "int8"}


def default_storage(i, name, schedule, storages):
  """The storage mode the default run lowers optimizer ``i`` in."""
  # Each schedule lowers every other optimizer (default_schedule).
  if schedule == "pingpong":
    return PINGPONG_DEFAULT_STORAGE.get(name, ("fp32", "bf16")[i // 2 % 2])
  return storages[i // 2 % len(storages)]


def default_schedule(i, name):
  """The schedule the default run lowers optimizer ``i`` in: the schedules
  in turn (the rule's code is the same in both), pingpong for the
  optimizers it lowers in a storage mode of their own."""
  if name in PINGPONG_DEFAULT_STORAGE:
    return "pingpong"
  return mosaic.SCHEDULES[i % len(mosaic.SCHEDULES)]


def lowering_cases():
  """Every schedule x optimizer x storage mode; the default run lowers each
  optimizer once, the schedules and storage modes in turn."""
  for i, (name, opt, _) in enumerate(OPTIMIZERS):
    storages = [
      storage
      for storage in STORAGE_MODES
      if storage != "int8" or name in INT8_NAMES
    ]
    for schedule in mosaic.SCHEDULES:
      for storage in storages:
        yield slow_unless(
          schedule == default_schedule(i, name)
          and storage == default_storage(i, name, schedule, storages),
          schedule,
          name,
          opt,
          storage,
          case_id=f"{schedule}-{name}-{storage}",
        )


LOWERING_CASES = list(lowering_cases())


def lower_for_cuda(
  opt,
  kernel_shape,
  kernel_dtype,
  schedule,
  tokens=512,
  layer_index=None,
  config=None,
):
  """``mosaic_update`` through Mosaic GPU's CUDA lowering (the compiled
  path: transposed wgmma, refs updated in place, setmaxnreg), on the CPU,
  with ``config``, else a config a GPU runs: the default ranking's for
  'inline', ``GPU_CONFIGS['pingpong']`` for 'pingpong'. Returns the
  lowered text."""
  k, n = kernel_shape[-2:]
  x = jax.ShapeDtypeStruct((tokens, k), BF16)
  dy = jax.ShapeDtypeStruct((tokens, n), BF16)
  kernel = jax.ShapeDtypeStruct(kernel_shape, kernel_dtype)
  if config is None and schedule == "inline":
    config = mosaic.default_config(x, kernel, opt)
  elif config is None:
    config = GPU_CONFIGS[schedule]
    if opt.state_dtype == "int8":
      config = dataclasses.replace(config, epilogue_n=Q.BLOCK_SIZE)
  assert config.schedule == schedule
  assert mosaic.unsupported_reason(x, dy, kernel, opt, config) is None
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")

  def update(x, dy, kernel, state, scalars, apply, key):
    return mosaic.mosaic_update(
      spec,
      x,
      dy,
      kernel,
      state,
      scalars,
      apply,
      config,
      interpret=False,
      rounding_key=key,
      layer_index=layer_index,
    )

  traced = jax.jit(update).trace(
    x,
    dy,
    kernel,
    jax.eval_shape(opt.init, kernel),
    jax.eval_shape(opt.scalars, jnp.int32(3)),
    jax.ShapeDtypeStruct((), jnp.bool_),
    jax.ShapeDtypeStruct((), jnp.uint32),
  )
  return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("schedule,name,opt,storage", LOWERING_CASES)
def test_mosaic_kernel_lowers_for_cuda_on_cpu(schedule, name, opt, storage):
  """Every op of the kernel body, the rule's included, has a Mosaic GPU
  warpgroup lowering (:mod:`forge_jax.ops.mosaic.compat` supplies the
  missing ones) and every layout is inferred, int8 block scales' strided
  loads too."""
  del name
  kernel_dtype, storage_optimizer = STORAGE_MODES[storage]
  text = lower_for_cuda(
    storage_optimizer(opt, 7), (256, 512), kernel_dtype, schedule
  )
  assert "mosaic_gpu" in text


@pytest.mark.parametrize(
  "schedule",
  # Both schedules copy through pipeline.epilogue (the same coordinates).
  [
    slow_unless(schedule == "inline", schedule, case_id=schedule)
    for schedule in mosaic.SCHEDULES
  ],
)
def test_mosaic_stacked_kernel_lowers_for_cuda_on_cpu(schedule):
  """A stacked layer's kernel and state, read and written in place at the
  layer's index (a TMA coordinate: no interpret-mode test sees it)."""
  opt = SR_OPTIMIZERS["adamw"]
  text = lower_for_cuda(
    opt, (3, 256, 512), BF16, schedule, layer_index=jnp.int32(1)
  )
  assert "mosaic_gpu" in text


def test_mosaic_kernel_under_vmap_lowers_for_cuda_on_cpu():
  """Under ``jax.vmap`` (``nn.vmap``) an unstacked call cannot update in
  place (an in-place launch takes a batch of one): it writes separate
  outputs, which ``plgpu.kernel`` batches over an extra grid axis."""
  opt = SR_OPTIMIZERS["adamw"]
  x = jax.ShapeDtypeStruct((2, 128, 256), BF16)
  dy = jax.ShapeDtypeStruct((2, 128, 512), BF16)
  kernel = jax.ShapeDtypeStruct((2, 256, 512), BF16)
  config = mosaic.default_config(x, kernel, opt)
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")

  def update(x, dy, kernel, state, scalars, apply):
    return mosaic.mosaic_update(
      spec, x, dy, kernel, state, scalars, apply, config, interpret=False
    )

  state = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct((2, *a.shape), a.dtype),
    jax.eval_shape(opt.init, jax.ShapeDtypeStruct((256, 512), BF16)),
  )
  batched = jax.vmap(update, in_axes=(0, 0, 0, 0, None, None))
  text = (
    jax.jit(batched)
    .trace(
      x,
      dy,
      kernel,
      state,
      jax.eval_shape(opt.scalars, jnp.int32(3)),
      jax.ShapeDtypeStruct((), jnp.bool_),
    )
    .lower(lowering_platforms=("cuda",))
    .as_text()
  )
  assert "mosaic_gpu" in text
  assert "tensor<2x256x512xbf16>" in text


def test_default_run_covers_every_schedule_optimizer_and_storage_mode():
  """The default run (not ``slow``) simulates the schedule 'auto' ranks
  with every storage mode and each kind of optimizer state, and lowers
  every optimizer, and every schedule with every storage mode, for CUDA
  (the compiled GPU tests run every optimizer on every schedule)."""

  def default(cases):
    return [case.values for case in cases if not case.marks]

  def schedule_of(config):
    return {**CONFIGS, **INT8_CONFIGS}[config].schedule

  names = {name for name, _, _ in OPTIMIZERS}
  simulated = {case[0] for case in default(FP32_CASES) + default(INT8_CASES)}
  assert simulated == set(FP32_DEFAULT) | set(INT8_DEFAULT)
  inline = CONFIGS[DEFAULT_SCHEDULE].schedule
  for configs in (
    [case[3] for case in default(FP32_CASES)],
    [case[0] for case in default(BF16_CASES)],
    [case[2] for case in default(SR_CASES)] + [SR_STACKED_CONFIG],
    [case[3] for case in default(INT8_CASES)] + [NONFINITE_INT8_CONFIG],
  ):
    assert set(map(schedule_of, configs)) == {inline}
  lowered = default(LOWERING_CASES)
  assert {case[1] for case in lowered} == names
  assert {(case[0], case[3]) for case in lowered} == {
    (schedule, storage)
    for schedule in mosaic.SCHEDULES
    for storage in STORAGE_MODES
  }


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", sorted(GPU_CONFIGS))
@pytest.mark.parametrize(
  "name,opt,count", OPTIMIZERS, ids=[name for name, _, _ in OPTIMIZERS]
)
def test_compiled_mosaic_kernel_matches_reference_on_gpu(
  name, opt, count, schedule, seed
):
  """On sm90+: the compiled kernel (transposed wgmma, TMA, in place) at a
  Llama layer shape, with the default config and with each schedule."""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs a Hopper or newer GPU")
  inputs = random_inputs(seed, opt, (2048, 4096), 1024, (F32, F32, BF16))
  config = GPU_CONFIGS[schedule]
  if config is not None and (
    reason := mosaic.unsupported_reason(*inputs[:3], opt, config)
  ):
    pytest.skip(reason)
  expected = run_reference(opt, *inputs, count)
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  scalars = opt.scalars(jnp.asarray(count, jnp.int32))
  fn = jax.jit(
    functools.partial(mosaic.mosaic_update, spec, config=config),
    donate_argnums=(2, 3),
  )
  actual = host_copy(fn(*inputs, scalars, jnp.all(jnp.isfinite(inputs[1]))))
  assert_leaves_match(actual, expected, name)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", sorted(GPU_CONFIGS))
def test_compiled_mosaic_kernel_counts_skipped_elements_on_gpu(schedule, seed):
  """On sm90+: parts with different skipped counts, updated by warpgroups
  at the same time (counts summed across warps through a reduction scratch
  every warpgroup shares would race:
  :func:`forge_jax.ops.mosaic.kernel.skipped_rows_shape`)."""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs a Hopper or newer GPU")
  opt = fj.adamw(1e-3, weight_decay=0.1)
  inputs = random_inputs(seed, opt, (2048, 4096), 1024, (F32, F32, BF16))
  rows, columns = [5, 700, 2049, 4000], uneven_columns(1024)
  inputs = (*overflowing_inputs(*inputs[:2], rows, columns), *inputs[2:])
  expected = run_reference(opt, *inputs, 3)
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  fn = jax.jit(
    functools.partial(mosaic.mosaic_update, spec, config=GPU_CONFIGS[schedule]),
    donate_argnums=(2, 3),
  )
  for _ in range(3):  # a race may hit one call and not the next
    kernel, state = jax.tree.map(jnp.copy, inputs[2:])
    actual = host_copy(
      fn(
        *inputs[:2],
        kernel,
        state,
        opt.scalars(jnp.asarray(3, jnp.int32)),
        jnp.bool_(True),
      )
    )
    assert int(expected[2]) == int(actual[2]) == len(rows) * len(columns)
    assert_leaves_match(actual, expected, schedule)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "name,opt,count",
  INT8_OPTIMIZERS,
  ids=[name for name, _, _ in INT8_OPTIMIZERS],
)
def test_compiled_mosaic_kernel_int8_sr_matches_reference_on_gpu(
  name, opt, count, seed
):
  """On sm90+: bf16 SR weights and int8 states at a Llama layer shape, dW
  exact. Only the rule's float32 arithmetic may differ (FMA contraction,
  sqrt through rsqrt), moving a rare element across a rounding boundary:
  one int8 code or one bf16 ulp at most (at the leaf's scale where the
  update cancels to near zero: RAdam's first step on the H200 leaves 52
  weights of about 5e-9 up to 15 of their own ulps apart, 0.42 of one at
  the leaf's scale), >= 99.9 % of the bits identical."""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs a Hopper or newer GPU")
  x, dy = exact_inputs(seed, (2048, 4096), 1024, BF16)
  w = (0.02 * jax.random.normal(jax.random.key(seed), (4096, 1024))).astype(
    BF16
  )
  state = opt.init(w)
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  fn = jax.jit(
    functools.partial(mosaic.mosaic_update, spec), donate_argnums=(2, 3)
  )
  for count in (count, count + 1):
    step = jnp.int32(count)
    expected = run_reference_at(opt, x, dy, w, state, count, step, layer_id=9)
    actual = host_copy(
      fn(
        x,
        dy,
        jnp.copy(w),
        jax.tree.map(jnp.copy, state),
        opt.scalars(jnp.int32(count)),
        jnp.bool_(True),
        rounding_key=rounding_key(opt, step, layer_id=9),
      )
    )
    assert int(actual[2]) == int(expected[2]) == 0
    assert_within_rounding(
      actual[:2], expected[:2], (name, count), identical=0.999
    )
    w, state = jax.tree.map(jnp.asarray, expected[:2])


@pytest.mark.gpu
def test_auto_selects_mosaic_on_hopper_and_triton_where_it_cannot_run():
  """Mosaic for what it runs (4-bit second moments where its lowering has
  concatenate); float16 states through the Triton kernel."""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs a Hopper or newer GPU")
  x = jnp.zeros((2048, 4096), BF16)
  dy = jnp.zeros((2048, 1024), BF16)
  kernel = jnp.zeros((4096, 1024), BF16)
  sr = fj.adamw(1e-3, weight_rounding="stochastic")
  for opt in (fj.adamw(1e-3), sr):
    assert backends.select("auto", x, dy, kernel, opt).__wrapped__ is (
      mosaic.mosaic_update
    )
  # int8 states: Mosaic too (the Triton kernel trained a 14B-shaped scanned
  # model to NaN); float16 states: Triton only.
  int8 = int8_sr(fj.adamw(1e-3))
  f16 = fj.lion(1e-3, state_dtype="float16")
  selected = lambda impl, opt: backends.select(impl, x, dy, kernel, opt)
  assert selected("auto", int8).__wrapped__ is mosaic.mosaic_update
  assert selected("auto", f16).__wrapped__ is triton_kernel.triton_update
  assert selected("mosaic", int8).__wrapped__ is mosaic.mosaic_update
  # 4-bit second moments: Mosaic where its lowering has concatenate, else
  # the XLA reference (faster than the Triton kernel for them).
  fourbit = dataclasses.replace(int8, second_moment_bits=4)
  expected = (
    mosaic.mosaic_update
    if mosaic_compat.lowers_concatenate()
    else backends.xla_update
  )
  chosen = selected("auto", fourbit)
  assert getattr(chosen, "__wrapped__", chosen) is expected


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_compiled_rolled_int8_update_gives_the_unrolled_bits(rounding, seed):
  """int8 states through 128 x 64 parts updated in a rolled loop (one and
  two buffers) give the 64 x 64 parts' bits, call after call (4096 x 4096,
  2048 tokens: several tiles a CTA), and every leaf moves."""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs a Hopper or newer GPU")
  opt = fj.adamw(
    1e-3, weight_decay=0.1, state_dtype="int8", weight_rounding=rounding
  )
  x, dy, kernel, state = int8_inputs(seed, opt, (2048, 4096), 4096)
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  scalars = opt.scalars(jnp.asarray(3, jnp.int32))
  apply = jnp.all(jnp.isfinite(dy))
  key = jnp.uint32(12345) if rounding == "stochastic" else None
  configs = [
    dataclasses.replace(mosaic.QUANTIZED_CONFIGS[0], epilogue_n=64),
    *(
      dataclasses.replace(
        mosaic.QUANTIZED_ROLLED_CONFIGS[0], epilogue_n=64, **fields
      )
      for fields in ({}, {"max_concurrent_steps": 4, "epilogue_slots": 2})
    ),
  ]
  first = None
  for config in configs:
    fn = jax.jit(
      functools.partial(
        mosaic.mosaic_update, spec, config=config, rounding_key=key
      ),
      donate_argnums=(2, 3),
    )
    for _ in range(2):
      stepped = host_copy(
        fn(x, dy, *jax.tree.map(jnp.copy, (kernel, state)), scalars, apply)
      )[:3]
      first = stepped if first is None else first
      for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(first)):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=repr(config))
  for new, old in zip(
    jax.tree.leaves(first[:2]), jax.tree.leaves((kernel, state))
  ):
    assert (bits(new) != bits(old)).any(), "a leaf did not move"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [512, 2048])
def test_compiled_kernel_bits_do_not_depend_on_config_or_run(tokens, seed):
  """Every default config (and other epilogue configs between them) gives
  the same kernel, state and skipped count bits, call after call: the
  tiles' accumulation order does not change with the epilogue, and a slot's
  loads never overtake the previous tile's stores. 4096 x 4096 is ~8 tiles
  per CTA, so tiles follow each other in every CTA. The sum of squares is
  summed in an order each config sets (its tiles, a CTA's tiles in turn):
  the same bits call after call, across configs within its float32
  rounding."""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs a Hopper or newer GPU")
  opt = fj.adamw(1e-3, weight_decay=0.1)
  inputs = random_inputs(seed, opt, (tokens, 4096), 4096, (BF16, BF16, BF16))
  configs = set(mosaic.ranked_configs(tokens)) | set(mosaic.PINGPONG_CONFIGS)
  configs |= {
    mosaic.MosaicConfig(epilogue_n=64),
    mosaic.MosaicConfig(epilogue_slots=4, prefetch_step=4),
    mosaic.MosaicConfig(
      schedule="pingpong", tile_n=128, max_concurrent_steps=5
    ),
    mosaic.MosaicConfig(
      schedule="pingpong", tile_n=128, max_concurrent_steps=3, epilogue_slots=4
    ),
  }
  spec = FusedDenseSpec(optimizer=opt, implementation="mosaic")
  scalars = opt.scalars(jnp.asarray(3, jnp.int32))
  apply = jnp.all(jnp.isfinite(inputs[1]))
  first = None
  for config in sorted(configs, key=repr):
    fn = jax.jit(
      functools.partial(mosaic.mosaic_update, spec, config=config),
      donate_argnums=(2, 3),
    )
    config_first = None
    for _ in range(3):
      kernel, state = jax.tree.map(jnp.copy, inputs[2:])
      *stepped, grad_sq_norm = host_copy(
        fn(inputs[0], inputs[1], kernel, state, scalars, apply)
      )
      if first is None:
        first = stepped, grad_sq_norm
      if config_first is None:
        config_first = grad_sq_norm
      for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(first[0])):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=repr(config))
      np.testing.assert_array_equal(
        bits(grad_sq_norm), bits(config_first), err_msg=repr(config)
      )
      # A tile summed twice or not at all would move it by about 1e-3.
      np.testing.assert_allclose(
        grad_sq_norm, first[1], rtol=1e-5, err_msg=repr(config)
      )
