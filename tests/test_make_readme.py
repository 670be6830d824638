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
