"""The kernel benchmarks' steps (the XLA reference they check and time
against computes the fused steps' bits) and their case loop."""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax as fj

from conftest import assert_same_bits, bits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import kernel_bench  # noqa: E402  (benchmarks/ is on sys.path only now)
import layer_step  # noqa: E402
import lowp_breakdown  # noqa: E402
import timing  # noqa: E402


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


@pytest.mark.slow  # the Mosaic kernel's interpret mode, for a benchmark
def test_layer_step_rule_free_variant_streams_and_leaves_no_trace():
  """The one-layer step's rule-free variant stores the layer's W and state
  unchanged, and the Mosaic variant after it in the same process steps them
  (a process traces a kernel once per shape: the rule-free trace is left
  for no other variant, nor takes another's)."""

  def moved(variant):
    with layer_step.traced_as(variant):
      run = layer_step.make_runner(variant, 64, 128, 128, "bf16")
      before = jax.device_get(run.carry["state"].params)
      run()
      after = jax.device_get(run.carry["state"].params)

    def dense(params):  # the layer's W and state
      layer = params["_overwrite_with_gradient"]["ForgeDense_0"]
      return layer["kernel"], layer["opt_state"]

    return [
      float(np.mean(bits(a) != bits(b)))
      for a, b in zip(
        jax.tree.leaves(dense(before)), jax.tree.leaves(dense(after))
      )
    ]

  assert max(moved(layer_step.RULE_FREE)) == 0.0
  assert min(moved("mosaic")) > 0.2  # W, m and v


@pytest.mark.slow  # the Mosaic kernel's interpret mode, for a benchmark
def test_layer_step_kernel_only_variant_steps_as_the_mosaic_variant():
  """The kernel-only variant (FORGE's bookkeeping left out) takes the same
  first step as the Mosaic variant from the same variables: W, its state
  and RMSNorm's scale, bit for bit."""
  bare = layer_step.make_runner(layer_step.KERNEL_ONLY, 64, 128, 128, "bf16")
  forge = layer_step.make_runner("mosaic", 64, 128, 128, "bf16")
  params, _ = bare.carry["state"]
  state = forge.carry["state"]
  layer = state.params["_overwrite_with_gradient"]["ForgeDense_0"]
  start = {
    "params": {"RMSNorm_0": params["norm"]},
    "_overwrite_with_gradient": {
      "ForgeDense_0": {
        **layer,
        "kernel": params["kernel"],
        "opt_state": params["opt_state"],
      }
    },
  }
  forge.carry["state"] = state.replace(params=jax.tree.map(jnp.copy, start))
  bare.carry["state"] = jax.tree.map(jnp.copy, bare.carry["state"])
  bare()
  forge()
  stepped, _ = bare.carry["state"]
  expected = forge.carry["state"].params
  layer = expected["_overwrite_with_gradient"]["ForgeDense_0"]
  assert np.mean(bits(stepped["kernel"]) != bits(params["kernel"])) > 0.2
  assert_same_bits(
    (stepped["kernel"], stepped["opt_state"], stepped["norm"]),
    (layer["kernel"], layer["opt_state"], expected["params"]["RMSNorm_0"]),
    "kernel-only step",
  )


def test_run_cases_saves_each_case_and_stops_at_its_budget(tmp_path):
  """Every measured case is on disk before the next starts; past the time
  budget no case starts, and the saved result says it stopped early."""
  out = str(tmp_path / "cases.json")
  seen_on_disk = []

  def measure(i):
    if i:  # the previous case is saved before this one runs
      with open(out) as f:
        seen_on_disk.append(len(json.load(f)["cases"]))
    time.sleep(0.05)
    return {"i": i}

  result = timing.run_cases({"cases": []}, [(0,), (1,), (2,)], measure, out)
  assert [c["i"] for c in result["cases"]] == [0, 1, 2]
  assert seen_on_disk == [1, 2]
  assert "stopped_early" not in result

  timing.run_cases({"cases": []}, [(0,), (1,), (2,)], measure, out, 0.01)
  with open(out) as f:
    saved = json.load(f)
  assert [c["i"] for c in saved["cases"]] == [0]
  assert saved["stopped_early"] is True


def test_run_grid_walks_the_product_of_the_named_flags(tmp_path):
  """Cases in the order of the flags' product, the flags as the config."""
  args = argparse.Namespace(
    tokens=[1, 2], shapes=["a", "b"], out=str(tmp_path / "grid.json")
  )
  result = timing.run_grid(
    args, ("tokens", "shapes"), lambda t, s: {"case": [t, s]}
  )
  assert [c["case"] for c in result["cases"]] == [
    [1, "a"],
    [1, "b"],
    [2, "a"],
    [2, "b"],
  ]
  with open(args.out) as f:
    assert json.load(f)["config"]["shapes"] == ["a", "b"]


@pytest.mark.parametrize(
  "variant",
  [
    # A probe of the benchmarks, not of the package: with --run-slow (CI
    # time).
    pytest.param("m and v as e4m3", marks=pytest.mark.slow),
    pytest.param("v as e4m3", marks=pytest.mark.slow),
  ],
)
def test_e4m3_probe_encodes_e4m3_and_the_kernel_matches_its_reference(
  variant,
):
  """The breakdown's float8 probe: the kernel (interpret mode) and the XLA
  reference, both under it, store the same state bits over two steps; its
  scales are the smallest powers of two with 448 s >= a block's absmax, and
  its codes decode to the float32 moments within e4m3's resolution."""
  optimizer = fj.adamw(1e-3, weight_decay=0.1, state_dtype="int8")
  x, dy, w = kernel_bench.make_inputs(jax.random.key(3), 64, 64, 128)
  w = w.astype(jnp.bfloat16)
  context = lowp_breakdown.E4M3_VARIANTS[variant]
  assert (
    lowp_breakdown.state_matches_reference(optimizer, None, w, x, dy, context)
    == 1.0
  )
  exact = fj.adamw(1e-3, weight_decay=0.1)
  count = jnp.asarray(0, jnp.int32)
  _, moments, _ = kernel_bench.reference_step(exact)(
    w.astype(jnp.float32), exact.init(w), count, x, dy
  )
  with context():
    _, state, _ = kernel_bench.reference_step(optimizer)(
      w, optimizer.init(w), count, x, dy
    )
  names = ("nu",) if variant == "v as e4m3" else ("mu", "nu")
  for name in names:
    leaf, reference = getattr(state, name), np.asarray(getattr(moments, name))
    amax = np.abs(reference).reshape(64, 2, 64).max(axis=2).astype(np.float64)
    expected = 2.0 ** np.ceil(np.log2(amax / 448))
    np.testing.assert_array_equal(np.asarray(leaf.scale), expected)
    with context():
      value = np.asarray(fj.quantization.load(leaf))
    np.testing.assert_allclose(
      value, reference, rtol=2**-4, atol=float(amax.min()) * 2**-9
    )


@pytest.mark.slow  # CI time: a timing-only variant of the probe above
def test_e4m3_probe_with_kept_scales_takes_no_block_maximum():
  """The probe's timing-only variant writes codes at the old scales: the
  kernel matches its reference, and the scales stay the initial ones."""
  optimizer = fj.adamw(1e-3, weight_decay=0.1, state_dtype="int8")
  x, dy, w = kernel_bench.make_inputs(jax.random.key(4), 64, 64, 128)
  w = w.astype(jnp.bfloat16)
  context = lowp_breakdown.E4M3_VARIANTS["m and v as e4m3, scales kept"]
  assert (
    lowp_breakdown.state_matches_reference(optimizer, None, w, x, dy, context)
    == 1.0
  )
  initial = optimizer.init(w)
  with context():
    _, state, _ = kernel_bench.reference_step(optimizer)(
      w, initial, jnp.asarray(0, jnp.int32), x, dy
    )
  for leaf, before in ((state.mu, initial.mu), (state.nu, initial.nu)):
    assert_same_bits(leaf.scale, before.scale, "kept scales")


def test_layer_step_untracked_variant_records_no_norm():
  """``<backend>-untracked`` runs that backend with a TrainState that
  records no gradient norm, and steps the layer."""
  run = layer_step.make_runner("xla-untracked", 16, 64, 32, "bf16")
  before = jax.device_get(run.carry["state"].params)
  run()
  state = run.carry["state"]
  assert not state.track_grad_norm and state.grad_norm is None
  layer = "_overwrite_with_gradient", "ForgeDense_0", "kernel"
  old, new = before, jax.device_get(state.params)
  for key in layer:
    old, new = old[key], new[key]
  assert np.mean(bits(old) != bits(new)) > 0.1  # bf16 at a 1e-4 rate


@pytest.mark.slow  # the Mosaic kernel's interpret mode, for a benchmark
def test_diagnosis_patches_drop_only_what_they_name():
  """The main-loop run still accumulates ``dW`` (its norm's sums are the
  kernel's) but stores no update; the run without the norm's sums steps W
  and its state as the kernel does, with a zero norm."""
  optimizer = fj.adamw(1e-3, weight_decay=0.1, state_dtype=jnp.bfloat16)
  x, dy, w = kernel_bench.make_inputs(jax.random.key(1), 64, 128, 128)
  w = w.astype(jnp.bfloat16)
  spec = fj.FusedDenseSpec(optimizer=optimizer)

  def update():
    return kernel_bench.mosaic.mosaic_update(
      spec,
      x,
      dy,
      w,
      optimizer.init(w),
      optimizer.scalars(jnp.asarray(0, jnp.int32)),
      jnp.asarray(True),
      interpret=True,
    )

  stepped, state, _, grad_sq_norm = update()
  with kernel_bench.main_loop_only():
    main_loop = update()
  with kernel_bench.without_norm_sums():
    no_norm = update()
  assert float(grad_sq_norm) > 0
  np.testing.assert_allclose(main_loop[3], grad_sq_norm, rtol=1e-6)
  assert not np.array_equal(bits(main_loop[0]), bits(stepped))
  assert float(no_norm[3]) == 0.0
  assert np.mean(bits(stepped) != bits(w)) > 0.5
  assert_same_bits(no_norm[:2], (stepped, state), "without the norm's sums")
