"""Largest micro-batch under a per-process memory cap, and its throughput, at
a given tensor-parallel degree: FORGE against nn.Dense + optax.

For each variant, micro-batches 1, 2, 4, ... (up to ``--max-batch``) run
each in a fresh process whose XLA allocator is capped with
``XLA_PYTHON_CLIENT_MEM_FRACTION`` (``--mem-fraction``, or ``--mem-cap-gib``
divided by the device's memory). An out-of-memory failure is a result: the
doubling stops at the first failure (``--bisect`` then searches between the
last batch that fit and it). Variants advance together, batch by batch, so a
``--budget-s`` cut leaves every variant its smaller batches.

Variants (bf16 weights, AdamW; the model and sharding of tp_bench.py:
remat, layers unrolled or scanned (``--scan``), TP over ``--tp`` devices,
``--sp`` for sequence parallelism; embedding and norms use optax.adamw with
bf16 states in all):

* ``forge-fp32``: ForgeDense, float32 optimizer states.
* ``forge-int8-sr``: ForgeDense, int8 states, stochastic weight rounding.
* ``optax``: nn.Dense + optax.adamw, bf16 states (as model_memory/tp_bench).
* ``forge-bf16`` (only when named in ``--variants``): ForgeDense, bf16 states.

Each successful point records tokens/second (micro-batch x seq / median
step time; each step blocked on its loss; ``--steps`` after ``--warmup``),
per-GPU peak memory (``memory_stats()``), the allocator limit in effect and
the compiled memory analysis. One JSON with every point and the metadata.

On two H200s (kind nvidia-h200-x2), 40 GiB per process:

  python benchmarks/capacity_sweep.py --tp 2 --sp --config llama-3.1-8b \\
      --seq 2048 --mem-cap-gib 40 --max-batch 32 --bisect \\
      --out benchmarks/results/capacity_h200x2_tp2_40g.json

Smoke test on CPU with 2 simulated devices (no allocator cap on CPU:
``--cpu-cap-mib`` makes a batch fail when its compiled estimate exceeds it):

  python benchmarks/capacity_sweep.py --cpu-devices 2 --tp 2 --sp --config small \\
      --layers 1 --seq 16 --max-batch 8 --cpu-cap-mib 2.8 --bisect --out /tmp/cap.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tp_bench  # pylint: disable=wrong-import-position

VARIANTS = {
  "forge-fp32": dict(
    forge=True, state_dtype="float32", weight_rounding="nearest"
  ),
  "forge-int8-sr": dict(
    forge=True, state_dtype="int8", weight_rounding="stochastic"
  ),
  "optax": dict(forge=False, state_dtype="bfloat16", weight_rounding="nearest"),
  # Not swept by default: FORGE at optax's state precision.
  "forge-bf16": dict(
    forge=True, state_dtype="bfloat16", weight_rounding="nearest"
  ),
}
DEFAULT_VARIANTS = "forge-fp32,forge-int8-sr,optax"
_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|\bOOM\b")
_PROBE_FRACTION = 0.5


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--part",
    choices=["sweep", "point", "probe"],
    default="sweep",
    help="internal: one process's job",
  )
  parser.add_argument(
    "--variants",
    default=DEFAULT_VARIANTS,
    help=f"comma-separated, of {', '.join(VARIANTS)}",
  )
  parser.add_argument(
    "--variant", choices=list(VARIANTS), help="--part point: the variant"
  )
  parser.add_argument("--tp", type=int, default=2)
  parser.add_argument("--sp", action="store_true", help="sequence parallelism")
  parser.add_argument(
    "--scan",
    action="store_true",
    help="scan over layers (compile time independent of "
    "the depth) instead of unrolling them",
  )
  parser.add_argument("--config", default="llama-3.1-8b")
  parser.add_argument(
    "--layers",
    type=int,
    default=None,
    help="override the number of layers (shorter compiles)",
  )
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument(
    "--batch", type=int, default=1, help="--part point: the micro-batch"
  )
  parser.add_argument("--max-batch", type=int, default=32)
  parser.add_argument(
    "--bisect",
    action="store_true",
    help="search between the last fit and the first OOM",
  )
  cap = parser.add_mutually_exclusive_group()
  cap.add_argument(
    "--mem-cap-gib",
    type=float,
    help="XLA allocator cap per process (per GPU), GiB",
  )
  cap.add_argument(
    "--mem-fraction",
    type=float,
    help="XLA_PYTHON_CLIENT_MEM_FRACTION for each run",
  )
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument(
    "--child-timeout",
    type=int,
    default=300,
    help="seconds per point before it is killed",
  )
  parser.add_argument(
    "--budget-s",
    type=int,
    default=480,
    help="start no new point after this many seconds",
  )
  parser.add_argument("--implementation", default="auto")
  parser.add_argument(
    "--cpu-devices",
    type=int,
    default=0,
    help="simulate this many CPU devices (smoke tests)",
  )
  parser.add_argument(
    "--cpu-cap-mib",
    type=float,
    default=None,
    help="smoke tests: a point fails as out of memory when "
    "its compiled memory estimate exceeds this",
  )
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


# ---------------------------------------------------------------------------
# One process: a probe of the devices, or one (variant, batch) point.


def probe(args) -> dict:
  """Metadata, device count and the device memory (from the allocator limit
  at a known fraction, nothing preallocated)."""
  jax = tp_bench._setup_jax(args)  # pylint: disable=protected-access
  from timing import metadata  # pylint: disable=import-outside-toplevel

  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return {
    "meta": metadata(),
    "num_devices": jax.device_count(),
    "device_bytes": int(limit / _PROBE_FRACTION) if limit else None,
  }


def _optimizer(variant: str):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import forge_jax as fj  # pylint: disable=import-outside-toplevel

  spec = VARIANTS[variant]
  if not spec["forge"]:
    return fj.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.bfloat16), False
  return fj.adamw(
    1e-4,
    weight_decay=0.1,
    state_dtype=spec["state_dtype"],
    weight_rounding=spec["weight_rounding"],
  ), True


def _compiled_estimate(analysis) -> int:
  return (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )


def _analysis_json(analysis) -> dict:
  return {
    "compiled_temp_bytes": analysis.temp_size_in_bytes,
    "compiled_argument_bytes": analysis.argument_size_in_bytes,
    "compiled_alias_bytes": analysis.alias_size_in_bytes,
    "compiled_estimate_bytes": _compiled_estimate(analysis),
  }


def _run_point(args, jax, record: dict) -> None:
  """Build, compile and time one point; fills ``record`` as it goes."""
  from timing import time_steps  # pylint: disable=import-outside-toplevel

  optimizer, forge = _optimizer(args.variant)
  record["stage"] = "init"
  mesh, config, state, batch, step = tp_bench.build_sharded(
    args, optimizer, forge
  )
  record["num_layers"] = config.num_layers
  with jax.set_mesh(mesh):
    record["stage"] = "compile"
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    record["compile_s"] = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    record.update(_analysis_json(analysis))
    if (
      args.cpu_cap_mib
      and _compiled_estimate(analysis) > args.cpu_cap_mib * 2**20
    ):
      raise MemoryError(
        "RESOURCE_EXHAUSTED (simulated: compiled estimate "
        f"above --cpu-cap-mib {args.cpu_cap_mib})"
      )
    record["stage"] = "run"
    state, losses, times = time_steps(
      compiled, state, batch, args.steps, warmup=args.warmup
    )
    loss = losses[-1]
  median = statistics.median(times)
  record.update(
    fits=True,
    step_ms_median=1e3 * median,
    step_ms_all=[1e3 * t for t in times],
    tokens_per_s=args.batch * args.seq / median,
    final_loss=loss,
    loss_finite=math.isfinite(loss),
  )
  del record["stage"]


def _memory(jax, tp: int) -> dict:
  per_device = tp_bench.per_device_memory(jax, tp)
  stats = jax.local_devices()[0].memory_stats() or {}
  peaks = [d["peak_bytes_in_use"] or 0 for d in per_device]
  return {
    "per_device": per_device,
    "bytes_limit": stats.get("bytes_limit"),
    "max_peak_bytes_in_use": max(peaks) or None,
  }


def point(args) -> dict:
  """One (variant, batch): ``fits`` and its measurements, or ``fits: False``
  with ``failure`` ('oom' or 'error'), the exception and the stage it was
  raised in (init, compile, run)."""
  jax = tp_bench._setup_jax(args)  # pylint: disable=protected-access
  record = {
    "variant": args.variant,
    "batch": args.batch,
    "seq": args.seq,
    "fits": False,
  }
  try:
    _run_point(args, jax, record)
  except Exception as e:  # pylint: disable=broad-except
    message = f"{type(e).__name__}: {e}"
    record.update(
      failure="oom" if _OOM.search(message) else "error", message=message[:800]
    )
    traceback.print_exc()
  record.update(_memory(jax, args.tp))
  return record


# ---------------------------------------------------------------------------
# The sweep: one child process per point.


def _child_cmd(args, part: str, out: str, variant=None, batch=None) -> list:
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--part",
    part,
    "--out",
    out,
    "--tp",
    str(args.tp),
    "--config",
    args.config,
    "--seq",
    str(args.seq),
    "--steps",
    str(args.steps),
    "--warmup",
    str(args.warmup),
    "--implementation",
    args.implementation,
    "--cpu-devices",
    str(args.cpu_devices),
  ]
  if variant:
    cmd += ["--variant", variant, "--batch", str(batch)]
  if args.layers:
    cmd += ["--layers", str(args.layers)]
  if args.sp:
    cmd.append("--sp")
  if args.scan:
    cmd.append("--scan")
  if args.cpu_cap_mib:
    cmd += ["--cpu-cap-mib", str(args.cpu_cap_mib)]
  return cmd


def _child_env(fraction) -> dict:
  env = dict(os.environ)
  env.setdefault("NCCL_NVLS_ENABLE", "0")
  # JAX 0.11 reads XLA_CLIENT_MEM_FRACTION and refuses it beside the
  # deprecated XLA_PYTHON_CLIENT_MEM_FRACTION: set the new name only.
  deprecated = env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  if fraction is not None:
    env["XLA_CLIENT_MEM_FRACTION"] = f"{fraction:.6f}"
  elif deprecated is not None and "XLA_CLIENT_MEM_FRACTION" not in env:
    env["XLA_CLIENT_MEM_FRACTION"] = deprecated
  return env


def _run_child(cmd: list, env: dict, timeout: int) -> dict:
  """The child's JSON, or a failure record (crash, timeout); a crash whose
  output names an out-of-memory error counts as one."""
  out = cmd[cmd.index("--out") + 1]
  print("+", " ".join(cmd), flush=True)
  start = time.monotonic()
  try:
    proc = subprocess.run(
      cmd, env=env, capture_output=True, text=True, timeout=timeout
    )
  except subprocess.TimeoutExpired:
    return {"fits": False, "failure": "timeout", "wall_s": timeout}
  wall = time.monotonic() - start
  print(proc.stdout[-2000:], end="", flush=True)
  tail = proc.stderr[-1500:]
  if proc.returncode == 0 and os.path.exists(out):
    with open(out) as f:
      record = dict(json.load(f), wall_s=wall)
    if not record.get("fits", True):
      print(tail, flush=True)
    return record
  print(tail, flush=True)
  failure = "oom" if _OOM.search(proc.stderr) else "error"
  return {
    "fits": False,
    "failure": failure,
    "exit_status": proc.returncode,
    "message": tail[-600:],
    "wall_s": wall,
  }


def _point(args, variant: str, batch: int, fraction) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    cmd = _child_cmd(
      args, "point", os.path.join(tmp, "point.json"), variant, batch
    )
    record = _run_child(cmd, _child_env(fraction), args.child_timeout)
  record.update(variant=variant, batch=batch)
  gib = (record.get("max_peak_bytes_in_use") or 0) / 2**30
  status = (
    f"{record['tokens_per_s']:.0f} tokens/s, peak {gib:.2f} GiB"
    if record["fits"]
    else record.get("failure")
  )
  print(f"== {variant} batch {batch}: {status}", flush=True)
  return record


def _probe(args) -> dict:
  env = _child_env(_PROBE_FRACTION)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  with tempfile.TemporaryDirectory() as tmp:
    result = _run_child(
      _child_cmd(args, "probe", os.path.join(tmp, "p.json")),
      env,
      args.child_timeout,
    )
  if "meta" not in result:
    raise SystemExit(f"device probe failed: {result}")
  if result["num_devices"] < args.tp:
    raise SystemExit(
      f"--tp {args.tp} needs {args.tp} devices, "
      f"{result['num_devices']} available"
    )
  return result


def _fraction(args, probe_result):
  device_bytes = probe_result["device_bytes"]
  if args.mem_fraction is not None:
    return args.mem_fraction
  if args.mem_cap_gib is None:
    return None
  if not device_bytes:
    if probe_result["meta"]["platform"] == "cpu":
      print("no allocator cap on CPU (--cpu-cap-mib simulates one)", flush=True)
      return None
    raise SystemExit("the device reports no memory limit: give --mem-fraction")
  fraction = args.mem_cap_gib * 2**30 / device_bytes
  if not 0 < fraction <= 1:
    raise SystemExit(
      f"--mem-cap-gib {args.mem_cap_gib} is not within the "
      f"device's {device_bytes / 2**30:.1f} GiB"
    )
  return fraction


class _Search:
  """Doubling, then (optionally) bisection, of one variant's micro-batch."""

  def __init__(self, max_batch: int, bisect: bool):
    self.max_batch, self.bisect = max_batch, bisect
    self.fit, self.fail, self.failure, self.next = 0, None, None, 1

  def record(self, batch: int, fits: bool, failure=None):
    if fits:
      self.fit = max(self.fit, batch)
    else:
      self.fail = batch if self.fail is None else min(self.fail, batch)
      self.failure = self.failure or failure
    if self.fail is None:
      self.next = (
        min(batch * 2, self.max_batch) if batch < self.max_batch else None
      )
    elif (
      self.bisect
      and self.failure == "oom"
      and self.fit
      and self.fail - self.fit > 1
    ):
      self.next = (self.fit + self.fail) // 2
    else:
      self.next = None


def _summary(search: _Search, points: list) -> dict:
  best = max(
    (p for p in points if p["fits"]), key=lambda p: p["batch"], default=None
  )
  return {
    "max_batch": search.fit or None,
    "first_failure_batch": search.fail,
    "first_failure": search.failure,
    "tokens_per_s_at_max_batch": best and best["tokens_per_s"],
    "max_peak_bytes_in_use_at_max_batch": best
    and best["max_peak_bytes_in_use"],
    "complete": search.next is None,
  }


def sweep(args) -> dict:
  probe_result = _probe(args)
  fraction = _fraction(args, probe_result)
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  searches = {v: _Search(args.max_batch, args.bisect) for v in variants}
  points = {v: [] for v in variants}
  start = time.monotonic()
  while any(s.next for s in searches.values()):
    for variant, search in searches.items():
      if not search.next or time.monotonic() - start > args.budget_s:
        continue
      record = _point(args, variant, search.next, fraction)
      points[variant].append(record)
      search.record(record["batch"], record["fits"], record.get("failure"))
    if time.monotonic() - start > args.budget_s:
      print(f"budget of {args.budget_s} s spent; stopping", flush=True)
      break
  return {
    "meta": probe_result["meta"],
    "config": args.config,
    "seq": args.seq,
    "num_layers": next(
      (
        p["num_layers"]
        for ps in points.values()
        for p in ps
        if "num_layers" in p
      ),
      args.layers,
    ),
    "tp": args.tp,
    "sp": args.sp,
    "scan_layers": args.scan,
    "implementation": args.implementation,
    "param_dtype": "bfloat16",
    "optimizer": "adamw",
    "variants": {v: dict(VARIANTS[v]) for v in variants},
    # the cap in effect: none on CPU, where --cpu-cap-mib simulates one
    "mem_cap_gib": args.mem_cap_gib if fraction is not None else None,
    "mem_fraction": fraction,
    "cpu_cap_mib": args.cpu_cap_mib,
    "device_bytes": probe_result["device_bytes"],
    "max_batch_tried": args.max_batch,
    "bisect": args.bisect,
    "steps": args.steps,
    "warmup": args.warmup,
    "wall_s": time.monotonic() - start,
    "results": {
      v: dict(
        _summary(searches[v], points[v]),
        points=sorted(points[v], key=lambda p: p["batch"]),
      )
      for v in variants
    },
  }


def main(argv=None):
  args = _args(argv)
  unknown = set(args.variants.split(",")) - set(VARIANTS)
  if unknown:
    raise SystemExit(
      f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}"
    )
  if args.part == "probe":
    result = probe(args)
  elif args.part == "point":
    result = point(args)
  else:
    result = sweep(args)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  if args.part == "sweep":
    for variant, r in result["results"].items():
      print(
        f"{variant}: largest micro-batch {r['max_batch']} (first failure "
        f"{r['first_failure_batch']}: {r['first_failure']}), "
        f"{r['tokens_per_s_at_max_batch'] or 0:.0f} tokens/s",
        flush=True,
      )


if __name__ == "__main__":
  main()
