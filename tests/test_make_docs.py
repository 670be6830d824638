"""The benchmark docs generator (benchmarks/make_docs.py) on the kept results."""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import make_docs  # noqa: E402  (benchmarks/ is on sys.path only now)


def _row(gemm_ms, unfused_ms, mosaic_ms, k=1000, n=1000):
  """An AdamW row of a kernel run: float32 W, m and v (12 bytes a weight)."""
  return {
    "k": k,
    "n": n,
    "gemm": {"ms": gemm_ms},
    "unfused": {"ms": unfused_ms},
    "fused_mosaic": {"ms": mosaic_ms},
    "fused_memory": {"weight_and_state_bytes": 12 * k * n},
  }


def test_traffic_bound_times_the_fused_bytes_at_optax_bandwidth():
  # optax's update moves 28 MB (W, m, v in and out, dW read) in 0.28 ms:
  # 100 GB/s here, so the fused kernel's 24 MB take 0.24 ms.
  bound = make_docs.traffic_bound(_row(0.2, 0.48, 0.6))
  assert bound["bytes_per_param"] == 24
  assert bound["tb_per_s"] == pytest.approx(0.1)
  assert bound["bound_over_gemm"] == pytest.approx(0.24 / 0.2)
  assert bound["best_speedup"] == pytest.approx(0.48 / 0.24)
  assert bound["mosaic_over_bound"] == pytest.approx(0.6 / 0.24)
  assert bound["mosaic_over_serial"] == pytest.approx(0.6 / 0.44)


def test_traffic_bound_is_the_gemm_when_the_traffic_hides_under_it():
  bound = make_docs.traffic_bound(_row(1.0, 1.28, 1.2))
  assert bound["bound_over_gemm"] == pytest.approx(1.0)
  assert bound["best_speedup"] == pytest.approx(1.28)
  assert bound["mosaic_over_serial"] == pytest.approx(1.2 / 1.24)


def test_step_breakdown_sorts_kernels_by_kind_and_counts_the_rest_small():
  # 9 launches: the fused kernel, two GEMMs, a 20 µs fusion, and five small
  # ones of which only two made the profile's top list.
  profile = {
    "device_ms": 0.200,
    "kernels_per_call": 9,
    "top": [
      {"name": "forge_fused_dense_update_mosaic", "ms": 0.100, "launches": 1},
      {"name": "nvjet_sm90_tst_128x128", "ms": 0.030, "launches": 1},
      {"name": "gemm_fusion_dot_2", "ms": 0.025, "launches": 1},
      {"name": "loop_add_fusion", "ms": 0.020, "launches": 1},
      {"name": "input_reduce_fusion", "ms": 0.004, "launches": 1},
      {"name": "loop_select_fusion", "ms": 0.003, "launches": 1},
    ],
  }
  parts = make_docs.step_breakdown(profile)
  assert parts["fused"] == pytest.approx(100)
  assert parts["gemm"] == pytest.approx(55)
  assert parts["large"] == pytest.approx(20)
  assert parts["small"] == pytest.approx(25)
  assert parts["small_launches"] == 5


def _model_run(
  variant, step_ms, flags="", date="2026-11-30", device="NVIDIA H200"
):
  return {
    "config": "llama-3.1-8b",
    "num_layers": 32,
    "variant": variant,
    "batch": 1,
    "seq": 512,
    "step_ms_median": step_ms,
    "step_ms_all": [step_ms],
    "peak_bytes_in_use": 2**30,
    "compiled_argument_bytes": 0,
    "compiled_temp_bytes": 0,
    "projection_kernel_bytes": 2**30,
    "mosaic_config": None,
    "meta": {
      "device": device,
      "jax_version": "0.11.2",
      "commit": "c0ffee0",
      "date": date,
      "xla_flags": flags,
    },
    "_file": f"model_memory_{variant}{flags}_{device[-4:]}_c0ffee0.json",
  }


def test_forge_is_paired_with_optax_only_under_the_same_xla_flags():
  flag = "--xla_gpu_enable_dynamic_slice_fusion=true"
  runs = [
    _model_run("optax", 110.0),
    _model_run("forge", 100.0),
    _model_run("optax", 90.0, flag),
    _model_run("forge", 100.0, flag),
  ]
  text = make_docs.step_section(runs)
  pairs = [
    line
    for line in text.splitlines()
    if line.startswith("| H200 | llama-3.1-8b") and "1 x 512" in line
  ]
  assert len(pairs) == 2
  assert "| 1.100 |" in next(p for p in pairs if flag not in p)
  assert "| 0.900 |" in next(p for p in pairs if flag in p)


def test_tables_take_the_newest_run_of_each_configuration():
  runs = [
    _model_run("optax", 110.0),
    _model_run("forge", 100.0),
    _model_run("forge", 50.0, date="2026-12-01"),
  ]
  runs[2]["_file"] = "model_memory_forge_newer_c0ffee0.json"
  table = make_docs.readme_table(runs)
  assert "| 50 / 110 |" in table and "| 100 / 110 |" not in table


def test_step_times_are_compared_on_one_device_only():
  # An H100 pair measured later must neither replace the H200 pair nor pair
  # an H100 FORGE step with an H200 optax step; the README keeps the device
  # with the most runs.
  h100 = dict(date="2026-12-06", device="NVIDIA H100 80GB HBM3")
  runs = [
    _model_run("optax", 110.0),
    _model_run("forge", 100.0),
    _model_run("optax", 130.0, **h100),
    _model_run("forge", 65.0, **h100),
    _model_run("forge", 90.0, flags="--xla_flag=1"),
  ]
  pairs = [
    line
    for line in make_docs.step_section(runs).splitlines()
    if "1 x 512" in line and "llama-3.1-8b |" in line
  ]
  assert len(pairs) == 2
  assert "| 1.100 |" in next(p for p in pairs if p.startswith("| H200 |"))
  assert "| 2.000 |" in next(p for p in pairs if p.startswith("| H100 |"))
  readme = make_docs.readme_table(runs)
  assert "| 100 / 110 |" in readme and "65" not in readme
  assert "one NVIDIA H200;" in readme


def test_docs_are_generated_from_the_kept_results():
  """README's generated sections and docs/benchmarks.md are what the
  generator writes from benchmarks/results/, and every kept result file
  appears in a table (older runs of a configuration leave the tree)."""
  with open(make_docs.README) as f:
    readme = f.read()
  for name, body in make_docs.readme_sections().items():
    section = re.search(
      rf"<!-- BEGIN {name} -->\n(.*?)\n<!-- END {name} -->", readme, re.S
    )
    assert section and section.group(1) == body, (
      f"README's {name!r} section is stale: run python benchmarks/make_docs.py"
    )
  with open(make_docs.BENCHMARKS_MD) as f:
    assert f.read() == make_docs.benchmarks_page(), (
      "docs/benchmarks.md is stale: run python benchmarks/make_docs.py"
    )
  kept = {
    os.path.relpath(os.path.join(dirpath, name), ROOT)
    for dirpath, _, names in os.walk(make_docs.RESULTS)
    for name in names
  }
  assert kept == make_docs.used_results(), (
    f"result files no table uses: {sorted(kept - make_docs.used_results())}"
  )


@pytest.mark.parametrize(
  "mosaic, kernel_only, verdict",
  [
    (1.0, 0.9, make_docs.MET),
    (0.999, 0.999, make_docs.BOUND_BELOW),
    (0.95, 1.0, make_docs.OPEN),
  ],
)
def test_never_slower_verdict_reads_the_bound_when_the_step_loses(
  mosaic, kernel_only, verdict
):
  case = {"speedup": {"mosaic": mosaic, make_docs.KERNEL_ONLY: kernel_only}}
  assert make_docs.never_slower_verdict(case) == verdict


def _parts_run(date, fused_ms, storage="bfloat16", gemm_ms=0.5, unfused_ms=0.9):
  """A diagnosis run of one case whose inline kernel took ``fused_ms``."""
  row = {
    "k": 1000,
    "n": 1000,
    "tokens": 512,
    "storage": storage,
    "gemm_ms": gemm_ms,
    "unfused_ms": unfused_ms,
    "default_ms": fused_ms,
    "default-main-loop_ms": 0.6,
    "default_config": {"schedule": "inline"},
  }
  return {
    "meta": {
      "device": "NVIDIA H200",
      "jax_version": "0",
      "commit": "0",
      "date": date,
    },
    "bench": [row],
    "_file": f"mosaic_parts_x_{date}.json",
  }


def test_kernel_parts_section_shows_the_newest_run_of_a_case():
  text = make_docs.kernel_parts_section(
    [_parts_run("2026-01-01", 0.8), _parts_run("2026-01-02", 0.7)]
  )
  rows = [r for r in text.splitlines() if r.startswith("| H200")]
  assert len(rows) == 1 and "| 0.700 |" in rows[0]


def test_kernel_parts_section_sets_the_main_loop_against_the_gemm():
  # bf16 W / m / v: 6 bytes a parameter, 12 moved by the fused kernel and
  # 16 by optax's update (the float32 gradient read too); optax's update
  # takes 0.4 ms, so the fused traffic takes 0.3 ms, under the 0.5 ms GEMM.
  run = _parts_run("2026-01-01", 0.8)
  text = make_docs.kernel_parts_section([run])
  line = next(r for r in text.splitlines() if r.startswith("| H200"))
  assert line.split(" | ")[-2:] == ["1.20", "1.60 |"]


@pytest.mark.parametrize(
  "storage, name, over_bound",
  [("bfloat16", "bf16", "1.52"), ("float32", "fp32", "1.33")],
)
def test_kernel_parts_section_bounds_each_storage_by_its_bytes(
  storage, name, over_bound
):
  # optax's update takes 0.7 ms for 16 (bf16) or 28 (float32) bytes a
  # parameter; the fused kernel moves 12 or 24, so its traffic takes 0.525
  # or 0.6 ms, past the 0.2 ms GEMM: 0.8 ms against that bound.
  run = _parts_run("2026-01-01", 0.8, storage, gemm_ms=0.2, unfused_ms=0.9)
  line = next(
    r
    for r in make_docs.kernel_parts_section([run]).splitlines()
    if r.startswith("| H200")
  )
  cells = line.split(" | ")
  assert cells[1] == name
  assert cells[-2:] == ["3.00", f"{over_bound} |"]


def test_kernel_parts_section_keeps_each_storage_of_a_case():
  runs = [
    _parts_run("2026-01-01", 0.8, "bfloat16"),
    _parts_run("2026-01-02", 0.9, "float32"),
  ]
  text = make_docs.kernel_parts_section(runs)
  assert len([r for r in text.splitlines() if r.startswith("| H200")]) == 2


def test_mosaic_tiles_section_names_the_tried_config_and_its_main_loop():
  """The tried config (the one whose main loop was timed) gets the columns
  of its own; the others timed beside it, but not the default, are listed
  by name, its patched runs not at all."""

  def config(schedule, tile_n, stages, slots):
    return dict(
      schedule=schedule,
      tile_k=128,
      tile_n=tile_n,
      compute_wgs=2,
      tile_t=64,
      max_concurrent_steps=stages,
      epilogue_slots=slots,
      epilogue_k=64,
      epilogue_n=32,
    )

  row = {
    "k": 1000,
    "n": 1000,
    "tokens": 8192,
    "gemm_ms": 0.5,
    "unfused_ms": 0.9,
    "wide_ms": 0.8,
    "wide_config": config("inline", 128, 4, 1),
    "wide-main-loop_ms": 0.55,
    "wide-sgd_ms": 0.6,
    "narrow_ms": 0.75,
    "narrow_config": config("inline", 64, 5, 2),
    "default_ms": 0.7,
    "default_config": config("pingpong", 128, 4, 3),
  }
  run = _parts_run("2026-01-01", 0.7)

  def cells(row):
    """The cells of ``row``'s line in the section."""
    text = make_docs.mosaic_tiles_section([dict(run, bench=[row])])
    (line,) = [r for r in text.splitlines() if r.startswith("| H200")]
    return line.split(" | ")

  assert cells(row)[3:10] == [
    "0.500",
    "0.700 (pingpong)",
    "inline 128 x 256, 64 tokens a step, 4 stages, 1 buffer of 64 x 32",
    "0.800",
    "0.550",
    "1.10",
    "inline 128 x 128, 64 tokens a step, 5 stages, 2 buffers of 64 x 32: 0.750",
  ]
  # Without patched runs (no --diag-extras) the first config is the one
  # tried, and its main loop is not known.
  unpatched = {k: v for k, v in row.items() if not k.startswith("wide-")}
  assert cells(unpatched)[5:9] == [
    "inline 128 x 256, 64 tokens a step, 4 stages, 1 buffer of 64 x 32",
    "0.800",
    "-",
    "-",
  ]


def test_speed_line_counts_the_newest_case_of_each_gpu_once():
  """A case measured twice on one GPU counts once, as its newest run says;
  the same case on another GPU counts apart."""

  def run(device, date, mosaic):
    case = {
      "storage": "bf16",
      "tokens": 512,
      "k": 128,
      "n": 128,
      "ms": {"optax": 1.0, "mosaic": 1 / mosaic, make_docs.KERNEL_ONLY: 1.0},
      "speedup": {"mosaic": mosaic, make_docs.KERNEL_ONLY: 1.0},
    }
    return {
      "meta": {"device": device, "date": date},
      "config": {"variants": ["optax", "mosaic", make_docs.KERNEL_ONLY]},
      "cases": [case],
    }

  line = make_docs.speed_line(
    [
      run("A", "2026-01-01", 0.5),
      run("A", "2026-01-02", 1.25),
      run("B", "2026-01-01", 0.8),
    ]
  )
  assert "0.80-1.25x optax's time, no slower in 1 of 2 cases" in line
