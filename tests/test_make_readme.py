"""The README generator's traffic bound (benchmarks/make_readme.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import make_readme  # pylint: disable=wrong-import-position


def _row(gemm_ms, unfused_ms, mosaic_ms, k=1000, n=1000):
  """An AdamW row of a kernel run: float32 W, m and v (12 bytes a weight)."""
  return {"k": k, "n": n, "gemm": {"ms": gemm_ms},
          "unfused": {"ms": unfused_ms}, "fused_mosaic": {"ms": mosaic_ms},
          "fused_memory": {"weight_and_state_bytes": 12 * k * n}}


def test_traffic_bound_times_the_fused_bytes_at_optax_bandwidth():
  # optax's update moves 28 MB (W, m, v in and out, dW read) in 0.28 ms:
  # 100 GB/s here, so the fused kernel's 24 MB take 0.24 ms.
  bound = make_readme._traffic_bound(_row(0.2, 0.48, 0.6))  # pylint: disable=protected-access
  assert bound["bytes_per_param"] == 24
  assert bound["tb_per_s"] == pytest.approx(0.1)
  assert bound["bound_over_gemm"] == pytest.approx(0.24 / 0.2)
  assert bound["best_speedup"] == pytest.approx(0.48 / 0.24)
  assert bound["mosaic_over_bound"] == pytest.approx(0.6 / 0.24)
  assert bound["mosaic_over_serial"] == pytest.approx(0.6 / 0.44)


def test_traffic_bound_is_the_gemm_when_the_traffic_hides_under_it():
  bound = make_readme._traffic_bound(_row(1.0, 1.28, 1.2))  # pylint: disable=protected-access
  assert bound["bound_over_gemm"] == pytest.approx(1.0)
  assert bound["best_speedup"] == pytest.approx(1.28)
  assert bound["mosaic_over_serial"] == pytest.approx(1.2 / 1.24)


def _model_run(variant, step_ms, flags="", mosaic_config=None):
  return {"config": "llama-3.1-8b", "num_layers": 32, "variant": variant,
          "batch": 1, "seq": 512, "step_ms_median": step_ms,
          "step_ms_all": [step_ms], "peak_bytes_in_use": 2**30,
          "compiled_temp_bytes": 0, "projection_kernel_bytes": 2**30,
          "mosaic_config": mosaic_config,
          "meta": {"device": "H200", "jax_version": "0.11.2", "commit": "c0ffee",
                   "date": "2026-11-30", "xla_flags": flags},
          "_file": f"model_memory_{variant}{flags}.json"}


def test_forge_is_paired_with_optax_only_under_the_same_xla_flags():
  flag = "--xla_gpu_enable_dynamic_slice_fusion=true"
  runs = [_model_run("optax", 110.0), _model_run("forge", 100.0),
          _model_run("optax", 90.0, flag), _model_run("forge", 100.0, flag)]
  table = make_readme.model_memory_table(runs)
  pairs = [line for line in table.splitlines()
           if line.startswith("| llama-3.1-8b") and "1 x 512" in line]
  assert len(pairs) == 2
  assert "| 1.100 |" in next(p for p in pairs if flag not in p)
  assert "| 0.900 |" in next(p for p in pairs if flag in p)


def test_recorded_mosaic_configs_get_the_defaults_of_newer_fields():
  """A config recorded before a field existed (and with the flag that
  became ``schedule``) still compares equal to today's config."""
  recorded = make_readme.dataclasses.asdict(
      make_readme.mosaic_kernel.MosaicConfig(max_concurrent_steps=5))
  del recorded["epilogue_wgs"], recorded["schedule"]
  recorded["epilogue_warpgroup"] = False
  assert make_readme._with_schedule(recorded) == make_readme.dataclasses.asdict(  # pylint: disable=protected-access
      make_readme.mosaic_kernel.MosaicConfig(max_concurrent_steps=5))
