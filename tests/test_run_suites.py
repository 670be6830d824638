"""benchmarks/run.py's suites write the result files the docs generator
reads."""

import fnmatch
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import make_docs  # noqa: E402  (benchmarks/ is on sys.path only now)
import run  # noqa: E402


@pytest.mark.parametrize(
  "suite, section",
  [
    ("bounds", make_docs.never_slower_section),
    ("parts", make_docs.kernel_parts_section),
    ("tiles", make_docs.mosaic_tiles_section),
  ],
)
def test_suite_names_its_results_as_its_section_reads_them(suite, section):
  (pattern,) = [p for p, render, _ in make_docs.SECTIONS if render is section]
  args = run.parse_args([suite, "--out", "results"])
  args.timeout = 300
  steps = run.SUITES[suite](args, lambda name: f"{name}_abc1234.json")
  assert steps
  for step in steps:
    assert fnmatch.fnmatch(step.argv[-1], pattern), step.argv
