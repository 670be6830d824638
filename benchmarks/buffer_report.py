"""Where a compiled step's memory goes: its XLA buffer assignment, summarized.

XLA writes a ``*buffer-assignment.txt`` for every module it compiles while
dumping: the allocations (parameter, output, temp, constant, thread-local;
maybe-live-out) and the HLO values placed in each (instruction, shape, offset
and size inside the allocation). All temporaries of a step usually share one
``preallocated-temp`` allocation (``memory_analysis().temp_size_in_bytes``);
this module splits it into slots (values at one offset and size) and, from
the dumped live ranges, lists the values live when the temp bytes peak, with
each value's shape and ``op_name`` (``fwd``/``bwd`` path), e.g. the float32
logits, the embedding gradient, or a dynamic-slice copy of a layer's kernel.

From a dump directory (the largest module whose name matches ``--module``):

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python train.py
  python benchmarks/buffer_report.py /tmp/dump --module train_step --top 25 --json out.json

From Python (a compiled executable's own buffer assignment names
instructions only by id, so the lowered step is compiled with a dump of that
one compile into a temporary directory):

  compiled, report = buffer_report.compile_with_report(jax.jit(step).lower(state, batch))
  print(buffer_report.format_report(report, 25))
  buffer_report.top_temp(report, 25)       # JSON-able list
  buffer_report.breakdown(report, 25)      # JSON-able dict for a results file
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import tempfile
from typing import Optional

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
_VALUE = re.compile(
  r"^ value: <(\d+) ([^\s{>]+)(\{[^}]*\})?[^>]*> "
  r"\(size=(\d+),offset=(\d+)\): (.*)$"
)
_LIVE_RANGE = re.compile(r"^\s+(\S+?)(\{[^}]*\}):(\d+)-(\d+)\s*$")
_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=(]+)\s*=\s")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(([^()]*)\)")


@dataclasses.dataclass
class Value:
  """One HLO value in an allocation."""

  id: int
  name: str  # defining instruction
  index: str  # shape index inside a tuple, '' for an array
  size: int
  offset: int
  shape: str  # shortened: no layouts
  op: str = ""  # shortened op_name metadata ('' where none)
  allocation: int = -1

  @property
  def slot(self) -> tuple:
    """Where it lives: (allocation, offset, size)."""
    return (self.allocation, self.offset, self.size)

  @property
  def key(self) -> str:
    return self.name + (self.index or "{}")


@dataclasses.dataclass
class Allocation:
  index: int
  size: int
  kind: str  # parameter, output, temp, constant, thread-local
  maybe_live_out: bool
  parameter: Optional[int]
  values: list


@dataclasses.dataclass
class Report:
  module: str
  allocations: list
  live_ranges: dict  # value key -> (first, last) position in the schedule


# ---------------------------------------------------------------------------
# Parsing.


def short_shape(shape: str, limit: int = 72) -> str:
  """``f32[2,32]{1,0}`` -> ``f32[2,32]``; long tuples cut at ``limit``."""
  shape = re.sub(r"\]\{[^}]*\}", "]", shape)
  shape = re.sub(r"/\*index=\d+\*/", "", shape).strip()
  return shape if len(shape) <= limit else shape[: limit - 3] + "..."


def short_op(op_name: str, limit: int = 80) -> str:
  """``jit(step)/transpose(jvp(Llama))/.../lm_head/dot_general`` ->
  ``bwd Llama/.../lm_head/dot_general`` (middle cut at ``limit``); ``fwd``
  inside the forward, nothing outside both (the optimizer)."""
  if not op_name:
    return ""
  phase = (
    "bwd " if "transpose(" in op_name else "fwd " if "jvp(" in op_name else ""
  )
  path = re.sub(r"^jit\([^)]*\)/", "", op_name)
  path = re.sub(r"^transpose\(jvp\(([^()/]*)\)\)", r"\1", path)
  path = re.sub(r"^jvp\(([^()/]*)\)", r"\1", path)
  path = path.replace("/while/body/closed_call/", "/scan/")
  path = re.sub(
    r"\['([^']*)'\]", r"/\1", path
  )  # state.params['a'] -> state.params/a
  if len(path) > limit:
    path = path[: limit // 3] + "..." + path[-(2 * limit // 3) :]
  return phase + path.lstrip("/")


def short_name(name: str) -> str:
  """Parameter names from the state's pytree: ``a____b__.1`` -> ``a/b/.1``."""
  return re.sub(r"_{2,}", "/", name)


def _kind(flags: str) -> str:
  if re.search(r"\bparameter \d+", flags):
    return "parameter"
  for kind in ("constant", "thread-local"):
    if kind in flags:
      return kind
  if "output shape is" in flags or "maybe-live-out" in flags:
    return "output"
  return "temp"


def parse_buffer_assignment(text: str) -> list:
  """The allocations of a ``*buffer-assignment.txt``, values included."""
  allocations = []
  for line in text.splitlines():
    m = _ALLOCATION.match(line)
    if m:
      flags = re.sub(r"\|[^|]*\|", "", m.group(3))  # drop shapes
      param = re.search(r"\bparameter (\d+)", flags)
      allocations.append(
        Allocation(
          int(m.group(1)),
          int(m.group(2)),
          _kind(flags),
          "maybe-live-out" in flags,
          int(param.group(1)) if param else None,
          [],
        )
      )
      continue
    m = _VALUE.match(line)
    if m and allocations:
      index = m.group(3) or ""
      allocations[-1].values.append(
        Value(
          int(m.group(1)),
          m.group(2),
          "" if index == "{}" else index,
          int(m.group(4)),
          int(m.group(5)),
          short_shape(m.group(6)),
          allocation=allocations[-1].index,
        )
      )
  return allocations


def _opcode(line: str):
  """``(opcode, operands)`` of an HLO instruction line."""
  m = _OPCODE.search(line.split("=", 1)[1])
  if not m:
    return "", []
  operands = re.findall(r"%([\w.\-]+)", m.group(2)) or [
    o.strip() for o in m.group(2).split(",") if o.strip()
  ]
  return m.group(1), operands


def parse_op_names(hlo_text: str) -> dict:
  """Instruction name -> op_name metadata in an HLO module's text. A fusion
  without metadata takes its fused computation's root's; an instruction
  with none at all is described as ``opcode(operands)`` (a fusion by its
  root's opcode), e.g. ``convert(<kernel parameter>)``."""
  ops, bare, roots, computation = {}, {}, {}, None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      computation = m.group(1)
      continue
    m = _HLO_LINE.match(line)
    if not m:
      continue
    op = _OP_NAME.search(line)
    if op:
      ops[m.group(1)] = re.sub(r"\\(.)", r"\1", op.group(1))
    if line.lstrip().startswith("ROOT") and computation:
      roots[computation] = (ops.get(m.group(1)), _opcode(line)[0])
    if not op:
      call = _CALLS.search(line)
      bare[m.group(1)] = (call.group(1) if call else None, *_opcode(line))
  for name, (called, opcode, operands) in bare.items():
    root_op, root_opcode = roots.get(called, (None, opcode))
    if root_op:
      ops[name] = root_op
    else:
      args = ", ".join(short_name(o) for o in operands[:2])
      ops[name] = f"{root_opcode}({args}{', ...' if len(operands) > 2 else ''})"
  return ops


def parse_live_ranges(text: str) -> dict:
  """``BufferLiveRange`` section: value key -> (first, last) schedule step."""
  ranges, inside = {}, False
  for line in text.splitlines():
    if "BufferLiveRange" in line:
      inside = True
      continue
    if inside:
      m = _LIVE_RANGE.match(line)
      if not m:
        if ranges:
          break
        continue
      ranges[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
  return ranges


def find_buffer_assignment(dump_dir: str, module: str = "") -> str:
  """The largest ``*buffer-assignment.txt`` in ``dump_dir`` whose file name
  matches the regular expression ``module``."""
  paths = [
    p
    for p in glob.glob(os.path.join(dump_dir, "*buffer-assignment.txt"))
    if re.search(module, os.path.basename(p))
  ]
  if not paths:
    raise FileNotFoundError(
      f"no *buffer-assignment.txt matching {module!r} in {dump_dir} (dump "
      "with --xla_dump_to=DIR --xla_dump_hlo_as_text)"
    )
  return max(paths, key=os.path.getsize)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def from_dump(dump_dir: str, module: str = "") -> Report:
  """Report of one module's buffer assignment in an XLA dump directory."""
  path = find_buffer_assignment(dump_dir, module)
  text = _read(path)
  prefix = path[: -len("-buffer-assignment.txt")]
  allocations = parse_buffer_assignment(text)
  if os.path.exists(prefix + ".txt"):
    ops = parse_op_names(_read(prefix + ".txt"))
    for allocation in allocations:
      for value in allocation.values:
        value.op = short_op(ops.get(value.name, ""))
  live_path = prefix + "-live-range.txt"
  live_ranges = parse_live_ranges(
    _read(live_path) if os.path.exists(live_path) else text
  )
  return Report(os.path.basename(path), allocations, live_ranges)


def _compile_dumped(lowered, dump_dir: str):
  """``lowered.compile()`` with an XLA dump of this compile only."""
  return lowered.compile(
    compiler_options={"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True}
  )


def compile_with_report(
  lowered, module: str = "", dump_dir: Optional[str] = None
):
  """``(compiled, report)``: ``lowered`` compiled with a dump of this compile
  only, to a temporary directory (removed afterwards) unless ``dump_dir``."""
  with tempfile.TemporaryDirectory(prefix="xla_dump_") as tmp:
    compiled = _compile_dumped(lowered, dump_dir or tmp)
    report = from_dump(dump_dir or tmp, module)
  return compiled, report


def compile_with_breakdown(
  lowered, n: int = 25, module: str = "", print_rows: int = 10
):
  """``(compiled, breakdown(report, n))`` for a benchmark's results file; the
  short table is printed. A dump that cannot be read gives ``{'error': ...}``
  in place of the breakdown, not an exception."""
  with tempfile.TemporaryDirectory(prefix="xla_dump_") as tmp:
    compiled = _compile_dumped(lowered, tmp)
    try:
      report = from_dump(tmp, module)
    except (OSError, ValueError) as e:
      print(f"buffer breakdown unavailable: {e}", flush=True)
      return compiled, {"error": str(e)}
  print(format_report(report, print_rows), flush=True)
  return compiled, breakdown(report, n)


# ---------------------------------------------------------------------------
# Summaries.


def totals(report: Report) -> dict:
  """Bytes and allocation count per kind."""
  out = {}
  for allocation in report.allocations:
    entry = out.setdefault(allocation.kind, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += allocation.size
  return out


def _value_json(value: Value) -> dict:
  return {
    "name": short_name(value.key if value.index else value.name),
    "shape": value.shape,
    "op": value.op,
  }


def _distinct(values: list, limit: int) -> list:
  """Up to ``limit`` values, one per (shape, op), largest first."""
  seen, out = set(), []
  for value in sorted(values, key=lambda v: (-v.size, v.id)):
    tag = (value.shape, value.op or value.name)
    if tag not in seen:
      seen.add(tag)
      out.append(value)
  return out[:limit]


def top_allocations(report: Report, n: int = 10, values: int = 3) -> list:
  """The ``n`` largest allocations of any kind (JSON-able)."""
  rows = []
  for a in sorted(report.allocations, key=lambda a: (-a.size, a.index))[:n]:
    rows.append(
      {
        "allocation": a.index,
        "bytes": a.size,
        "kind": a.kind,
        "maybe_live_out": a.maybe_live_out,
        "parameter": a.parameter,
        "num_values": len(a.values),
        "values": [_value_json(v) for v in _distinct(a.values, values)],
      }
    )
  return rows


def temp_slots(report: Report) -> list:
  """Every (offset, size) slot of the temp allocations with its values,
  largest first. Slots of one allocation overlap when their values are not
  live at the same time."""
  slots = collections.defaultdict(list)
  for allocation in report.allocations:
    if allocation.kind == "temp":
      for value in allocation.values:
        slots[value.slot].append(value)
  return sorted(slots.items(), key=lambda kv: (-kv[0][2], kv[0][1]))


def top_temp(report: Report, n: int = 25, values: int = 3) -> list:
  """The ``n`` largest temp slots (JSON-able): bytes, offset, allocation,
  number of values, and up to ``values`` distinct values (name, shape, op)."""
  return [
    {
      "bytes": size,
      "offset": offset,
      "allocation": index,
      "num_values": len(vals),
      "values": [_value_json(v) for v in _distinct(vals, values)],
    }
    for (index, offset, size), vals in temp_slots(report)[:n]
  ]


def _live_temp_values(report: Report) -> list:
  out = []
  for allocation in report.allocations:
    if allocation.kind == "temp":
      for value in allocation.values:
        if value.key in report.live_ranges:
          out.append(value)
  return out


def _peak_time(values: list, ranges: dict):
  """Schedule step where the live temp bytes (one count per slot) peak."""
  events = []
  for v in values:
    first, last = ranges[v.key]
    events += [(first, 1, v), (last + 1, -1, v)]
  events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations
  refs, live, best = collections.Counter(), 0, (0, None)
  for time, delta, v in events:
    slot = v.slot
    refs[slot] += delta
    if delta > 0 and refs[slot] == 1:
      live += v.size
    elif delta < 0 and refs[slot] == 0:
      live -= v.size
    if live > best[0]:
      best = (live, time)
  return best


def temp_at_peak(report: Report, n: int = 25) -> Optional[dict]:
  """The temp values live when the temp bytes peak (from the dumped live
  ranges; None without them): step, bytes, the ``n`` largest values and the
  bytes per op."""
  values = _live_temp_values(report)
  if not values:
    return None
  live_bytes, time = _peak_time(values, report.live_ranges)
  live, seen = [], set()
  for v in sorted(values, key=lambda v: (-v.size, v.id)):
    first, last = report.live_ranges[v.key]
    if first <= time <= last and v.slot not in seen:
      seen.add(v.slot)
      live.append(v)
  by_op, shapes = collections.Counter(), collections.defaultdict(list)
  for v in live:
    op = v.op or re.sub(r"\.\d+$", "", v.name)
    by_op[op] += v.size
    if v.shape not in shapes[op]:
      shapes[op].append(v.shape)
  return {
    "step": time,
    "bytes": live_bytes,
    "num_values": len(live),
    "values": [
      dict(_value_json(v), bytes=v.size, offset=v.offset) for v in live[:n]
    ],
    "bytes_by_op": [
      {"op": op, "bytes": b, "shapes": shapes[op][:3]}
      for op, b in by_op.most_common(n)
    ],
  }


def breakdown(report: Report, n: int = 25) -> dict:
  """Everything above as one JSON-able dict for a results file."""
  return {
    "module": report.module,
    "totals": totals(report),
    "top_allocations": top_allocations(report, 10),
    "top_temp": top_temp(report, n),
    "temp_at_peak": temp_at_peak(report, n),
  }


# ---------------------------------------------------------------------------
# Text.


def _mib(b: int) -> str:
  return f"{b / 2**20:10.2f}"


def _describe(values: list) -> str:
  return "; ".join(f"{v['shape']} {v['op'] or v['name']}" for v in values)


def format_report(report: Report, n: int = 25) -> str:
  """A short table: totals, largest allocations, temp slots, temp at peak."""
  lines = [f"{report.module}", "  kind          count        MiB"]
  for kind, t in sorted(totals(report).items(), key=lambda kv: -kv[1]["bytes"]):
    lines.append(f"  {kind:12s} {t['count']:6d} {_mib(t['bytes'])}")
  lines.append("largest allocations:        MiB  kind")
  for a in top_allocations(report, min(n, 10), values=2):
    out = " (live-out)" if a["maybe_live_out"] else ""
    lines.append(
      f"  #{a['allocation']:<6d}      {_mib(a['bytes'])}  "
      f"{a['kind']}{out}: {_describe(a['values'])}"
    )
  lines.append("largest temp slots:         MiB  values")
  for s in top_temp(report, n, values=2):
    lines.append(
      f"  @{s['offset']:<14d}{_mib(s['bytes'])}  "
      f"x{s['num_values']}: {_describe(s['values'])}"
    )
  peak = temp_at_peak(report, n)
  if peak:
    lines.append(
      f"temp live at its peak (step {peak['step']}, "
      f"{peak['bytes'] / 2**20:.2f} MiB), by op:"
    )
    for row in peak["bytes_by_op"][:n]:
      lines.append(
        f"  {_mib(row['bytes'])}  {row['op']} ({', '.join(row['shapes'])})"
      )
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dump_dir")
  parser.add_argument(
    "--module", default="", help="regular expression on the dump file names"
  )
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--json", help="write breakdown() here")
  args = parser.parse_args(argv)
  report = from_dump(args.dump_dir, args.module)
  print(format_report(report, args.top))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(breakdown(report, args.top), f, indent=1)


if __name__ == "__main__":
  main()
