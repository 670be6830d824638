"""benchmarks/buffer_report.py on a tiny Llama train step (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import jax
import pytest

import forge_jax as fj
from examples.lm import llama
from examples.lm import train as train_lib


def _buffer_report():
  path = os.path.join(
    os.path.dirname(__file__), "..", "benchmarks", "buffer_report.py"
  )
  spec = importlib.util.spec_from_file_location("buffer_report", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # for its dataclasses
  spec.loader.exec_module(module)
  return module


br = _buffer_report()

_TEXT = """BufferAssignment:
allocation 0: size 64, parameter 1, shape |f32[4,4]| at ShapeIndex {}, maybe-live-out:
 value: <3 state_params____w__.1 @0> (size=64,offset=0): f32[4,4]{1,0}
 value: <9 add.2 @0> (size=64,offset=0): f32[4,4]{1,0}
allocation 1: size 4, constant:
 value: <5 constant.1 @0> (size=4,offset=0): f32[]
allocation 2: size 96, preallocated-temp:
 value: <6 dot.1 @0> (size=64,offset=0): f32[4,4]{1,0}
 value: <7 exp.1 @0> (size=32,offset=64): f32[8]{0}
 value: <8 while.1{2} (phi) @0> (size=32,offset=0): f32[8]{0}
"""


def test_parse_kinds_values_and_slots():
  allocations = br.parse_buffer_assignment(_TEXT)
  assert [a.kind for a in allocations] == ["parameter", "constant", "temp"]
  assert allocations[0].parameter == 1 and allocations[0].maybe_live_out
  phi = allocations[2].values[2]
  assert (phi.name, phi.index, phi.key, phi.shape) == (
    "while.1",
    "{2}",
    "while.1{2}",
    "f32[8]",
  )
  report = br.Report(
    "m",
    allocations,
    {"dot.1{}": (0, 2), "exp.1{}": (1, 3), "while.1{2}": (3, 4)},
  )
  assert [s["bytes"] for s in br.top_temp(report)] == [64, 32, 32]
  peak = br.temp_at_peak(report)
  assert peak["bytes"] == 96 and peak["step"] == 1
  assert {v["name"] for v in peak["values"]} == {"dot.1", "exp.1"}


def test_short_op():
  assert (
    br.short_op("jit(step)/transpose(jvp(Llama))/lm_head/dot_general")
    == "bwd Llama/lm_head/dot_general"
  )
  assert br.short_op("jit(step)/jvp(Llama)/embed/take").startswith("fwd Llama/")
  assert br.short_op("jit(step)/add") == "add"


# Slow (CI time): the report parses a real XLA dump; the unit tests above
# check its parsing and the benchmarks run it.
@pytest.mark.slow
@pytest.mark.parametrize("forge", [False, True])
def test_tiny_step_report(tmp_path, forge):
  """The temp allocations sum to memory_analysis()'s temp bytes, the JSON
  summary is serializable, and the float32 logits show up with their op."""
  opt = fj.adamw(1e-3, weight_decay=0.1)
  model = llama.make_model(
    "tiny", opt if forge else None, scan_layers=True, remat=True
  )
  key = jax.random.key(0)
  batch = jax.random.randint(key, (2, 33), 0, model.config.vocab_size)
  state = jax.jit(
    lambda k: train_lib.create_train_state(model, opt.to_optax(), k, batch)
  )(key)
  lowered = train_lib.make_train_step().lower(state, batch)
  compiled, report = br.compile_with_report(
    lowered, "train_step", dump_dir=str(tmp_path)
  )
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert br.totals(report)["temp"]["bytes"] == temp
  summary = json.loads(json.dumps(br.breakdown(report, 10)))
  sizes = [s["bytes"] for s in summary["top_temp"]]
  assert sizes == sorted(sizes, reverse=True) and len(sizes) == 10
  peak = summary["temp_at_peak"]
  assert peak is not None and 0 < peak["bytes"] <= temp
  values = [
    v for s in br.top_temp(report, 1000, values=100) for v in s["values"]
  ]
  assert any(
    "lm_head" in v["op"] and v["shape"] in ("f32[64,256]", "f32[2,32,256]")
    for v in values
  ), values
  assert "temp" in br.format_report(report, 5)
  # the CLI reads the same dump
  br.main(
    [
      str(tmp_path),
      "--module",
      "train_step",
      "--top",
      "3",
      "--json",
      str(tmp_path / "out.json"),
    ]
  )
  with open(tmp_path / "out.json") as f:
    assert json.load(f)["totals"]["temp"]["bytes"] == temp
