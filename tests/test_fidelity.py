"""The fidelity benchmark's bookkeeping: resuming a file, the seed spread."""

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fidelity  # noqa: E402  (benchmarks/ is on sys.path only now)


def _summary(final):
  return {"final_train_loss_last10": final, "valid_loss": final, "wall_s": 1.0}


def _written(tmp_path, args, losses):
  path = tmp_path / "partial.json"
  payload = {
    "meta": {"commit": "abc1234"},
    "args": vars(args),
    "summary": {n: _summary(run[-1]) for n, run in losses.items()},
    "losses": losses,
  }
  path.write_text(json.dumps(payload))
  return str(path)


def test_resume_keeps_the_runs_of_a_file_with_the_same_training_flags(
  tmp_path,
):
  args = fidelity.parse_args(["--config", "tiny", "--steps", "3"])
  losses = {"optax_fp32": [3.0, 2.0, 1.0], "forge_fp32": [3.0, 2.0, 1.5]}
  args.resume = _written(tmp_path, args, losses)
  resumed = fidelity.resumed_runs(args)
  assert resumed["source"] == {
    "commit": "abc1234",
    "runs": ["forge_fp32", "optax_fp32"],
  }
  for name, run in resumed["results"].items():
    np.testing.assert_array_equal(run["losses"], losses[name])
    assert run["valid_loss"] == losses[name][-1] and run["state"] is None


def test_resume_refuses_a_file_trained_with_other_flags(tmp_path):
  args = fidelity.parse_args(["--config", "tiny", "--steps", "3"])
  path = _written(tmp_path, args, {"optax_fp32": [3.0, 2.0, 1.0]})
  other = fidelity.parse_args(["--config", "tiny", "--steps", "4"])
  other.resume = path
  with pytest.raises(SystemExit, match="steps"):
    fidelity.resumed_runs(other)


def test_seed_spread_is_the_range_of_the_reference_runs():
  summary = {
    "optax_fp32": {"final_train_loss_last10": 1.0},
    "optax_fp32_seed1": {"final_train_loss_last10": 1.2},
    "forge_fp32": {"final_train_loss_last10": 1.1},
    "forge_bf16_nearest": {"final_train_loss_last10": 1.5},
  }
  spread = fidelity.seed_spread(summary)
  assert spread["range"] == pytest.approx(0.2)
  assert spread["within_range"] == {
    "forge_fp32": True,
    "forge_bf16_nearest": False,
  }
  assert fidelity.seed_spread({"optax_fp32": summary["optax_fp32"]}) is None
