"""Summarize Nsight Compute exports of ``kernel_counters.py`` probes as JSON.

  python benchmarks/counters_summary.py --probes probes.json \\
      --details details.csv [--source source.csv.gz] --out summary.json

``details.csv`` is ``ncu --import report --csv --page details``; the optional
``source.csv.gz`` is ``--page source --csv --print-source sass`` (either
may be gzipped),
from which each fused kernel's executed instructions are counted by
opcode, and its warp-stall samples split by reason, by instruction class and
by how often the instruction ran (which tells the code apart: with T tiles,
c compute warps and m memory warps per CTA, the memory warpgroup's per-tile
code runs T * m times, the epilogue T * c, the main loop T * c * steps). Samples come from every warp, idle ones too: a
warpgroup waiting on a barrier shows as long_sb. Kernels are matched to probes in launch order: a
'gemm' probe is the next cuBLAS (nvjet) kernel, an 'unfused' probe that
GEMM and then the longest kernel before the next probe's (optax's update),
a 'fused' probe the next Mosaic kernel.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json

#: Metrics of the details page, by the names ncu gives them.
DETAILS = {
  "duration": "Duration",
  "dram_throughput_pct": "DRAM Throughput",
  "l2_throughput_pct": "L2 Cache Throughput",
  "sm_throughput_pct": "Compute (SM) Throughput",
  "issue_slots_busy_pct": "Issue Slots Busy",
  "registers_per_thread": "Registers Per Thread",
  "local_memory_spill_requests": "Local Memory Spilling Requests",
  "warp_cycles_per_issued_instruction": "Warp Cycles Per Issued Instruction",
}
FUSED_KERNEL = "forge_fused_dense_update_mosaic"
GEMM_KERNEL = "nvjet"


def _open(path: str):
  return (
    gzip.open(path, "rt", newline="")
    if path.endswith(".gz")
    else open(path, newline="")
  )


def _number(text: str) -> float | None:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return None


def read_details(path: str) -> list[dict]:
  """Kernels in launch order: name and DETAILS (durations in microseconds)."""
  kernels: dict[str, dict] = {}
  with _open(path) as f:
    for row in csv.DictReader(f):
      kernel = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
      for key, metric in DETAILS.items():
        if row["Metric Name"] == metric and key not in kernel:
          value = _number(row["Metric Value"])
          if key == "duration" and value is not None:
            key = "duration_us"
            value *= {"ns": 1e-3, "us": 1.0, "ms": 1e3}[row["Metric Unit"]]
          kernel[key] = value
  return [kernels[k] for k in sorted(kernels, key=int)]


def read_stalls(path: str) -> list[dict]:
  """For each kernel of the source page, in launch order: the share of
  warp-stall samples by reason and by instruction class, and the warp
  instructions it executed, in all and by opcode."""
  kernels, current = [], None
  with _open(path) as f:
    for row in csv.reader(f):
      if not row:
        continue
      if row[0] == "Kernel Name":
        current = {"name": row[1], "rows": []}
        kernels.append(current)
      elif row[0] == "Address":
        current["header"] = row
      else:
        current["rows"].append(row)
  summaries = []
  for kernel in kernels:
    header, rows = kernel["header"], kernel["rows"]
    samples = header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed")
    reasons = [
      i
      for i, name in enumerate(header)
      if name.startswith("stall_") and "Not Issued" not in name
    ]
    total = sum(_number(r[samples]) or 0 for r in rows) or 1.0
    by_reason = collections.Counter()
    by_class = collections.Counter()
    by_count = collections.Counter()
    executed_by_class = collections.Counter()
    for r in rows:
      by_count[r[executed]] += _number(r[samples]) or 0
      for i in reasons:
        by_reason[header[i][len("stall_") :]] += _number(r[i]) or 0
      opcode = r[1].split()
      opcode = (
        opcode[1]
        if opcode and opcode[0].startswith("@")
        else (opcode[0] if opcode else "")
      )
      opcode_class = opcode.split(".")[0]
      by_class[opcode_class] += _number(r[samples]) or 0
      executed_by_class[opcode_class] += _number(r[executed]) or 0
    share = lambda counter: {
      k: round(v / total, 4) for k, v in counter.most_common(10) if v
    }
    summaries.append(
      {
        "name": kernel["name"],
        "samples": total,
        "stall_share_by_reason": share(by_reason),
        "sample_share_by_opcode": share(by_class),
        "sample_share_by_execution_count": share(by_count),
        "instructions_executed": sum(executed_by_class.values()),
        "instructions_by_opcode": dict(executed_by_class.most_common(16)),
      }
    )
  return summaries


def match_probes(probes: list[dict], kernels: list[dict]) -> list[dict]:
  """Each probe with the kernel(s) it launched (see the module docstring)."""
  matched, position = [], 0

  def next_index(prefix):
    nonlocal position
    while not kernels[position]["name"].startswith(prefix):
      position += 1
    position += 1
    return position - 1

  for probe in probes:
    entry = dict(probe)
    if probe["what"] == "fused":
      entry["kernel"] = next_index(FUSED_KERNEL)
    else:
      entry["gemm_kernel"] = next_index(GEMM_KERNEL)
      if probe["what"] == "unfused":
        end = position
        while end < len(kernels) and not kernels[end]["name"].startswith(
          (GEMM_KERNEL, FUSED_KERNEL)
        ):
          end += 1
        entry["update_kernel"] = max(
          range(position, end), key=lambda i: kernels[i]["duration_us"]
        )
    matched.append(entry)
  return matched


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--probes", required=True)
  parser.add_argument("--details", required=True)
  parser.add_argument("--source", default=None)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  with open(args.probes) as f:
    probes = json.load(f)
  kernels = read_details(args.details)
  if args.source:
    fused_stalls = iter(
      s for s in read_stalls(args.source) if s["name"].startswith(FUSED_KERNEL)
    )
    for kernel in kernels:
      if kernel["name"].startswith(FUSED_KERNEL):
        kernel["stalls"] = next(fused_stalls)
  summary = {
    "meta": probes["meta"],
    "k": probes["k"],
    "n": probes["n"],
    "probes": [],
  }
  for entry in match_probes(probes["probes"], kernels):
    for key in ("kernel", "gemm_kernel", "update_kernel"):
      if key in entry:
        entry[key] = kernels[entry[key]]
    summary["probes"].append(entry)
  with open(args.out, "w") as f:
    json.dump(summary, f, indent=1)
  for entry in summary["probes"]:
    kernel = (
      entry.get("kernel") or entry.get("update_kernel") or entry["gemm_kernel"]
    )
    shown = {
      key: kernel.get(key)
      for key in (
        "duration_us",
        "dram_throughput_pct",
        "issue_slots_busy_pct",
        "local_memory_spill_requests",
      )
    }
    print(entry["name"], json.dumps(shown))


if __name__ == "__main__":
  main()
