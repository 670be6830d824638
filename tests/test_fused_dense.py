"""The fused dense op on every backend: fused_dense_test_base's checks.

* ``XlaTest``: the XLA reference backend (its checks against itself assert
  what the reference does: skipped elements, moved weights, optax's steps).
* ``TritonInterpretTest``: the Pallas Triton kernel in interpret mode, with
  small explicit tiles on odd shapes (several tiles, masked edges and a
  masked token tail).
* ``MosaicInterpretTest``: the Mosaic GPU kernel in Mosaic GPU's interpret
  mode, on the smallest shape that spans several of its tiles (its configs
  and schedules are test_mosaic.py's subject).
* ``TritonGpuTest``, ``MosaicGpuTest``: both kernels compiled, on a GPU
  (skipped elsewhere).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import forge_jax as fj
from forge_jax.ops import backends, mosaic, triton_kernel
from forge_jax.ops.fused_dense import FusedDenseSpec

from conftest import assert_same_bits, assert_within_rounding, bits, host_copy
from fused_dense_test_base import (
  BF16,
  F32,
  FOURBIT_OPTIMIZERS,
  LOWP_OPTIMIZERS,
  OPTAX_CASES,
  OPTIMIZERS,
  FusedDenseTestBase,
  assert_leaves_match,
  exact_inputs,
  random_inputs,
  rounding_key,
)

# x.shape (rank 2 or 3; the last axis is K) and N. None is a multiple of 16:
# 37 / 33 tokens leave a masked tail slab, K = 40 / 33 / 5 and N = 24 / 8 / 3
# leave masked tile edges.
SHAPES = [
  ((37, 40), 24),  # 3x2 tiles, 3 slabs
  ((3, 11, 33), 8),  # rank-3 x (33 tokens), 3x1 tiles, N < one tile
  ((2, 3, 5), 3),  # a layer smaller than one tile
]
# Small explicit tiles, so the odd shapes above span several tiles with
# masked edges. 'b16': 16x16 tiles, grouped launch order in groups of 2
# K-blocks (3 K-blocks: a full group and a partial one). 'b32-split2':
# 16x32 tiles whose epilogue runs in two 16-column chunks (N=24: the second
# chunk half masked; N=8 and N=3: fully masked).
TRITON_CONFIGS = {
  "b16": triton_kernel.TritonConfig(
    block_k=16, block_n=16, block_t=16, group_k=2, epilogue_split=1
  ),
  "b32-split2": triton_kernel.TritonConfig(
    block_k=16, block_n=32, block_t=16, epilogue_split=2
  ),
}
# bf16 weights and int8 states: x shape and N: 37 tokens (masked slab),
# K = 40 (3 tiles, masked edge), N = 150 (two 128-tiles / three 64-tiles;
# the last block 22 wide); a rank-3 x with N = 70.
LOWP_SHAPES = [((37, 40), 150), ((3, 11, 33), 70)]
# 16 x 128 tiles with two 64-column chunks (one int8 block each), and
# 16 x 64 tiles with one; grouped launch order over 3 K-blocks.
TRITON_LOWP_CONFIGS = {
  "n128-split2": triton_kernel.TritonConfig(
    block_k=16, block_n=128, block_t=16, group_k=2, epilogue_split=2
  ),
  "n64": triton_kernel.TritonConfig(
    block_k=16, block_n=64, block_t=16, epilogue_split=1
  ),
}

# 64 x 64 parts, two compute warpgroups: a CTA tile is 64 x 128. K = 128,
# N = 256, 128 tokens: 2 x 2 tiles on two CTAs, 2 pipeline steps each.
MOSAIC_SHAPE = ((2, 64, 128), 256)
_SMALL = dict(
  tile_k=64, tile_n=64, tile_t=64, max_concurrent_steps=2, epilogue_k=64
)
MOSAIC_CONFIGS = {
  # One buffer of 64 x 32 epilogue sub-tiles: room for the four state
  # tensors of centered RMSprop with momentum.
  "inline": mosaic.MosaicConfig(**_SMALL, epilogue_n=32, epilogue_slots=1),
  "pingpong": mosaic.MosaicConfig(
    **_SMALL, epilogue_n=32, epilogue_slots=2, schedule="pingpong"
  ),
}
# int8 states: epilogue sub-tiles of one quantization block (64 columns).
MOSAIC_LOWP_CONFIGS = {
  "int8": mosaic.MosaicConfig(**_SMALL, epilogue_n=64, epilogue_slots=1),
}


def kernel_step(kernel_update, spec, config, interpret):
  """One step of a Pallas kernel's ``*_update`` entry point with
  ``config``, in the shape :meth:`FusedDenseTestBase.backend` returns."""

  def update(x, dy, kernel, state, scalars, apply, rounding_key):
    return kernel_update(
      spec,
      x,
      dy,
      kernel,
      state,
      scalars,
      apply,
      config=config,
      interpret=interpret,
      rounding_key=rounding_key,
    )

  return update


class XlaTest(FusedDenseTestBase):
  implementation = "xla"
  shapes = SHAPES
  configs = {"default": None}
  lowp_shapes = LOWP_SHAPES
  lowp_configs = {"default": None}
  # By default the optax table's core rows, the fused op and the int8
  # blocks (test_optax_equivalence.py steps every row's rule as the optax
  # alias, bit for bit; --run-slow trains every row here). Against itself
  # the reference agrees by construction: the kernels' checks assert what it
  # computes, and one 4-bit case runs the op's path for those states.
  default_cases = {
    "test_matches_optax": sum(case.core for case in OPTAX_CASES),
    "test_matches_reference": 0,
    "test_every_element_is_written": 0,
    "test_poisoned_elements_stay_in_place": 0,
    "test_nonfinite_gradient_elements_are_skipped": 0,
    "test_nonfinite_dy_skips_the_whole_layer": 0,
    "test_matches_reference_bits_bf16_sr_int8": 0,
    "test_matches_reference_bits_4bit": 1,
  }

  def backend(self, spec, config):
    del config  # the reference has none

    def update(x, dy, kernel, state, scalars, apply, rounding_key):
      return backends.xla_update(
        spec, x, dy, kernel, state, scalars, apply, rounding_key=rounding_key
      )

    return update


@pytest.mark.parametrize(
  "opt",
  [
    pytest.param(fj.adamw(0.05, weight_decay=0.1), id="fp32"),
    # The 4-bit case chunks int8 first moments as this one does.
    pytest.param(
      LOWP_OPTIMIZERS[0][1], id="bf16-sr-int8", marks=pytest.mark.slow
    ),
    pytest.param(FOURBIT_OPTIMIZERS[0][1], id="bf16-sr-4bit"),
  ],
)
@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "stacked"])
@pytest.mark.parametrize(
  "sharded",
  # Sharded row chunks also run by default in test_data_parallel.py's FSDP.
  [False, pytest.param(True, marks=pytest.mark.slow)],
  ids=["whole", "shard"],
)
def test_xla_reference_steps_large_kernels_in_row_chunks(
  opt, stacked, sharded, seed, monkeypatch
):
  """A kernel past ``XLA_CHUNK_ELEMENTS`` is stepped by chunks of rows, each
  with its own dW GEMM, bit for bit as the whole kernel (dW exact in float32
  here, so only the rule's bits could differ): a shard's global offset, a
  stacked layer's index and stochastic rounding's global indices carry
  into every chunk."""
  k, n, layers = 40, 150, 3
  x, dy = exact_inputs(seed, (37, k), n, BF16)
  dtype = BF16 if opt.weight_rounding == "stochastic" else F32
  w = (0.5 * jax.random.normal(jax.random.key(seed), (layers, k, n))).astype(
    dtype
  )
  state = jax.vmap(opt.init)(w)
  layer_index = jnp.int32(1) if stacked else None
  if not stacked:
    w, state = jax.tree.map(lambda a: a[1], (w, state))
  spec = FusedDenseSpec(optimizer=opt, implementation="xla")

  def step():
    # Per shard, as a sharded layer runs it: the arrays are local.
    update = jax.shard_map(
      functools.partial(
        backends.xla_update,
        spec,
        rounding_key=rounding_key(opt, jnp.int32(5), layer_id=3),
        offset=(jnp.int32(80), jnp.int32(300)) if sharded else None,
        layer_index=layer_index,
      ),
      mesh=jax.make_mesh((1,), ("shard",), devices=jax.devices()[:1]),
      in_specs=P(),
      out_specs=P(),
    )
    scalars = opt.scalars(jnp.int32(5))
    return host_copy(jax.jit(update)(x, dy, w, state, scalars, jnp.bool_(True)))

  assert backends.chunk_rows(k, n) == k
  whole = step()
  monkeypatch.setattr(backends, "XLA_CHUNK_ELEMENTS", 10 * n + 5)
  monkeypatch.setattr(backends, "MIN_CHUNK_ROWS", 2)
  assert backends.chunk_rows(k, n) == 10
  chunked = step()

  assert_same_bits(chunked[:3], whole[:3], "chunked against whole")
  np.testing.assert_allclose(chunked[3], whole[3], rtol=1e-6)
  moved = bits(whole[0]) != bits(np.asarray(w))
  assert moved.reshape(-1, k, n)[1 if stacked else 0].mean() > 0.3
  if stacked:  # the other layers are untouched
    assert not moved[[0, 2]].any()


def test_xla_reference_chunks_only_local_arrays(monkeypatch):
  """Under a jit whose arrays XLA may partition (several devices, no
  shard_map) the reference steps the kernel whole: a chunk's dynamic slice
  of a sharded dimension would gather it."""
  monkeypatch.setattr(backends, "XLA_CHUNK_ELEMENTS", 64)
  monkeypatch.setattr(backends, "MIN_CHUNK_ROWS", 1)
  opt = fj.adamw(0.05)
  spec = FusedDenseSpec(optimizer=opt, implementation="xla")
  x, dy = jnp.ones((4, 16), F32), jnp.ones((4, 32), F32)
  w = jnp.zeros((16, 32), F32)
  args = (x, dy, w, opt.init(w), opt.scalars(jnp.int32(1)), jnp.bool_(True))
  update = functools.partial(backends.xla_update, spec)
  mesh = jax.make_mesh((1,), ("shard",), devices=jax.devices()[:1])
  per_shard = jax.shard_map(update, mesh=mesh, in_specs=P(), out_specs=P())
  assert jax.device_count() > 1  # the suite's CPU devices
  assert "dynamic_update_slice" not in str(jax.make_jaxpr(update)(*args))
  assert "dynamic_update_slice" in str(jax.make_jaxpr(per_shard)(*args))


def test_chunk_rows_divide_the_kernel_or_keep_it_whole(monkeypatch):
  monkeypatch.setattr(backends, "XLA_CHUNK_ELEMENTS", 1000)
  monkeypatch.setattr(backends, "MIN_CHUNK_ROWS", 4)
  assert backends.chunk_rows(10, 100) == 10  # fits: one chunk
  assert backends.chunk_rows(40, 100) == 10
  assert backends.chunk_rows(36, 100) == 9
  assert backends.chunk_rows(37, 100) == 37  # prime: kept whole
  assert backends.chunk_rows(40, 400) == 40  # 2 rows a chunk: too few


class TritonInterpretTest(FusedDenseTestBase):
  implementation = "triton"
  interpret = True
  shapes = SHAPES
  configs = TRITON_CONFIGS
  lowp_shapes = LOWP_SHAPES
  lowp_configs = TRITON_LOWP_CONFIGS
  # Every dtype, shape and config at least once (the first four optimizers:
  # each rule is the reference's traced apply_update, every optimizer with
  # --run-slow); every shape's edges written; skipped elements in float32
  # and bf16, poisoned ones on one config; the first three of the optax
  # table's core rows; int8 states with stochastic rounding on AdamW (Lion
  # and SGD with --run-slow; the Triton kernel's int8 steps also run in
  # test_scan.py, test_nnx.py and test_parallel.py by default); 4-bit second
  # moments on the first two optimizers and configs (the rule is the
  # reference's; the compiled GPU tests run every case).
  default_cases = {
    "test_matches_reference": 4,
    "test_every_element_is_written": 3,
    "test_poisoned_elements_stay_in_place": 1,
    "test_nonfinite_gradient_elements_are_skipped": 2,
    "test_nonfinite_dy_skips_the_whole_layer": 2,
    "test_matches_reference_bits_bf16_sr_int8": 1,
    "test_matches_optax": 3,
    "test_matches_reference_bits_4bit": 2,
  }

  def backend(self, spec, config):
    return kernel_step(
      triton_kernel.triton_update, spec, config, self.interpret
    )


class MosaicInterpretTest(FusedDenseTestBase):
  implementation = "mosaic"
  interpret = True
  shapes = [MOSAIC_SHAPE]
  configs = MOSAIC_CONFIGS
  lowp_shapes = [MOSAIC_SHAPE]
  lowp_configs = MOSAIC_LOWP_CONFIGS
  # A call takes seconds to tens of seconds: every case with --run-slow
  # (test_mosaic_kernel.py's default run covers the kernel against the
  # reference, on this shape and config too, its schedules, non-finite
  # gradients and int8 states; NaN int8 blocks propagate on the other
  # backends by default).
  default_cases = {
    "test_nan_int8_blocks_propagate": 0,
    "test_matches_reference": 0,
    "test_every_element_is_written": 0,
    "test_poisoned_elements_stay_in_place": 0,
    "test_nonfinite_gradient_elements_are_skipped": 0,
    "test_nonfinite_dy_skips_the_whole_layer": 0,
    "test_matches_reference_bits_bf16_sr_int8": 0,
    "test_nonfinite_gradients_keep_int8_blocks_bit_for_bit": 0,
    "test_fused_op_with_nonfinite_dy_does_not_step": 0,
    # 4-bit second moments: the Triton kernel checks two optimizers by
    # default, the compiled GPU tests every case.
    "test_matches_reference_bits_4bit": 0,
    # The overflow guard is the rule's (update.finite_result), the code
    # the kernel traces: checked by default on the other backends, compiled
    # on the GPU.
    "test_overflowing_int8_moments_are_skipped": 0,
  }
  takes_partial_tiles = False

  def backend(self, spec, config):
    return kernel_step(mosaic.mosaic_update, spec, config, self.interpret)

  def activation_dtype(self, dtype):
    del dtype
    return BF16  # the kernel's wgmma takes 16-bit activations only

  def test_matches_optax(self):
    pytest.skip(
      "the Mosaic kernel takes 16-bit activations only: the "
      "float32 MLP of this check cannot use it"
    )


def _lowp_kernel_check():
  path = os.path.join(
    os.path.dirname(__file__), "..", "benchmarks", "lowp_kernel_check.py"
  )
  spec = importlib.util.spec_from_file_location("lowp_kernel_check", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class CompiledOnGpu:
  """Mixed into a backend's test: its kernel compiled, every case by
  default."""

  interpret = False
  default_cases = {}

  def precision(self):
    # The kernels' float32 dots are IEEE; XLA's default on a GPU is TF32,
    # which alone moves the reference by ~2e-5.
    return jax.default_matmul_precision("highest")

  def assert_lowp_rule_matches(self, actual, expected, what):
    assert_within_rounding(actual, expected, what, identical=0.999)

  def test_matches_reference_bits_bf16_sr_int8(self, case, seed):
    del case, seed
    pytest.skip(
      "compiled, the rule's float32 arithmetic may round as XLA's "
      "does not (FMA contraction, Triton's division, Mosaic's "
      "sqrt): test_compiled_lowp_kernel_matches_reference holds "
      "the kernels to one bf16 ulp or one int8 code step"
    )

  def test_matches_reference_bits_4bit(self, case, seed):
    if not self.takes_4bit_second_moments:
      super().test_matches_reference_bits_4bit(case, seed)
      return
    pytest.skip(
      "compiled, as test_matches_reference_bits_bf16_sr_int8: "
      "test_compiled_lowp_kernel_matches_reference's adamw_4bit"
    )

  @pytest.mark.parametrize(
    "name",
    [
      "adamw",
      "lion",
      "sgd_momentum",
      "radam",
      "rmsprop_bias_correction",
      "adamw_4bit",
    ],
  )
  def test_compiled_lowp_kernel_matches_reference(self, name):
    """Fused steps with exact dW: only the rule's float32 arithmetic may
    differ (FMA contraction, Triton's division, Mosaic's sqrt), moving a
    rare element across a rounding boundary: one bf16 ulp or one int8 code
    step at most (an element the rule cancels to near zero: one ulp at the
    leaf's RMS)."""
    if name.endswith("4bit") and not self.takes_4bit_second_moments:
      pytest.skip("the kernel refuses 4-bit second moments")
    case = _lowp_kernel_check().check_fused(
      name,
      512,
      384,
      256,
      2,
      interpret=False,
      implementation=self.implementation,
    )
    for step in case["steps"]:
      assert step["skipped"] == [0, 0]
      for leaf, r in step["leaves"].items():
        assert r["identical"] >= 0.999, (leaf, r)
        # A block's scale is on the bfloat16 grid: a first-moment element an
        # ulp off (m = b1 m + (1 - b1) g contracts to an FMA differently in
        # Mosaic and XLA) moves it only across a grid threshold, by a step.
        if leaf.endswith("scale"):
          assert r.get("max_rel_diff", 0.0) <= 2.0**-7, (leaf, r)
          continue
        if leaf.endswith("codes"):
          # Where a block's scale moved, all its codes re-round: they stay
          # one code apart where the scales agree, and what they encode
          # within one code step everywhere.
          assert r["max_code_distance_same_scale"] <= 1, (leaf, r)
          assert r["max_step_distance"] <= 1 + 2.0**-10, (leaf, r)
          continue
        assert r.get("beyond_one_ulp", 0) == 0, (leaf, r)


@pytest.mark.gpu
class TritonGpuTest(CompiledOnGpu, TritonInterpretTest):
  def test_compiled_storage_primitives_match_xla_bits(self):
    """Stochastic rounding, int8 quantization and dequantization inside a
    compiled Triton kernel give XLA's bits on the same float32 inputs."""
    result = _lowp_kernel_check().check_primitives(256, 512, interpret=False)
    assert all(r["identical"] == 1.0 for r in result.values()), result

  @pytest.mark.parametrize(
    "name,opt,count", OPTIMIZERS[:6], ids=[c[0] for c in OPTIMIZERS[:6]]
  )
  def test_default_config_matches_reference(self, name, opt, count, seed):
    del name
    x, dy, kernel, state = random_inputs(
      seed, opt, (300, 200), 136, (F32, F32, F32)
    )
    expected = self.reference(opt, x, dy, kernel, state, count)
    spec = FusedDenseSpec(optimizer=opt, implementation="triton")
    actual = host_copy(
      jax.jit(self.backend(spec, None))(
        x,
        dy,
        kernel,
        state,
        opt.scalars(jnp.int32(count)),
        jnp.bool_(True),
        None,
      )
    )
    assert_leaves_match(actual, expected, "gpu")
    assert int(actual[2]) == int(expected[2])


@pytest.mark.gpu
class MosaicGpuTest(CompiledOnGpu, MosaicInterpretTest):
  def setup_method(self):
    if float(jax.devices()[0].compute_capability) < 9.0:
      pytest.skip("the Mosaic kernel needs a Hopper or newer GPU")
