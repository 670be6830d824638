"""Device-side timing for JAX functions, and the metadata every result carries.

``device_time_ms`` runs a function under the JAX profiler and sums the
durations of the GPU kernels and copies it launched, per call: launch gaps
and host overhead are excluded. Off-GPU (no device events) it falls back to
wall-clock time of back-to-back dispatch, and says so in the result.
``run_cases`` is the benchmarks' case loop: a time budget, and every case
printed and saved as soon as it is measured.
"""

from __future__ import annotations

import collections
import datetime
import glob
import itertools
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

import jax


def metadata() -> dict:
  """Device, versions, commit and date for a results JSON.

  ``FORGE_COMMIT`` (set by whoever sends the tree to a device machine) wins
  over git there: the device's copy may carry a stale ``.git``.
  """
  commit, dirty = os.environ.get("FORGE_COMMIT"), ""
  if commit is None:
    try:
      commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
      ).stdout.strip()
      dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
      ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
      commit = "unknown"
  device = jax.devices()[0]
  return {
    "device": getattr(device, "device_kind", str(device)),
    "platform": device.platform,
    "num_devices": jax.device_count(),
    "jax_version": jax.__version__,
    "python": platform.python_version(),
    "commit": commit + ("-dirty" if dirty else ""),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"
    ),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def time_steps(step, state, batch, steps: int, warmup: int = 2):
  """Run ``warmup + steps`` train steps, each blocked on (``float(loss)``).

  Returns ``(state, losses, seconds)``: the last state, every step's loss
  (warmup steps first) and the wall time of each of the last ``steps``
  steps.
  """
  losses, seconds = [], []
  for i in range(warmup + steps):
    start = time.perf_counter()
    state, loss = step(state, batch)
    losses.append(float(loss))
    if i >= warmup:
      seconds.append(time.perf_counter() - start)
  return state, losses, seconds


def _device_events(trace_dir: str):
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel

  paths = glob.glob(
    os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True
  )
  events = []
  for path in paths:
    data = ProfileData.from_file(path)
    for plane in data.planes:
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        # Stream lines hold the kernels and copies; skip the summary lines
        # (XLA Modules / XLA Ops / Steps) that would count them twice.
        if not line.name.lower().startswith("stream"):
          continue
        events.extend((e.name, e.duration_ns) for e in line.events)
  return events


def _profiled_calls(run_once, calls: int):
  """Profiles ``calls`` back-to-back calls of ``run_once()``: their wall time
  per call (ms) and the device events (name, ns) they launched."""
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      start = time.perf_counter()
      for _ in range(calls):
        out = run_once()
      jax.block_until_ready(out)
      wall_ms = (time.perf_counter() - start) * 1e3 / calls
      del out
    return wall_ms, _device_events(trace_dir)


def kernel_profile(run_once, *, calls: int = 2, top: int = 30) -> dict:
  """Where one call's device time goes: per call, the summed duration of
  each kernel (by name) over ``calls`` profiled calls, the ``top`` largest,
  and the total against the wall time (their difference: launch gaps and
  host time)."""
  wall_ms, events = _profiled_calls(run_once, calls)
  per_name = collections.Counter()
  launches = collections.Counter()
  for name, duration_ns in events:
    per_name[name] += duration_ns / 1e6 / calls
    launches[name] += 1
  return {
    "wall_ms": wall_ms,
    "device_ms": sum(per_name.values()),
    "kernels_per_call": len(events) / calls,
    "top": [
      {"name": name, "ms": ms, "launches": launches[name] // calls}
      for name, ms in per_name.most_common(top)
    ],
  }


def device_time_ms(
  run_once, *, calls: int = 20, repeats: int = 5, warmup: int = 2
) -> dict:
  """Median device time per call of ``run_once()``, in milliseconds.

  ``run_once`` dispatches one call and returns its output; it keeps its own
  state (donated buffers chain from one call's output to the next call).
  Each repeat profiles ``calls`` back-to-back calls; its device time is the
  sum of the kernel and copy durations divided by ``calls``.
  """
  for _ in range(warmup):
    jax.block_until_ready(run_once())
  per_call, wall = [], []
  for _ in range(repeats):
    wall_ms, events = _profiled_calls(run_once, calls)
    wall.append(wall_ms)
    if events:
      per_call.append(sum(d for _, d in events) / 1e6 / calls)
  result = {"wall_ms": statistics.median(wall), "method": "wall-clock"}
  if per_call:
    result.update(
      ms=statistics.median(per_call),
      method="profiler-device",
      spread_ms=max(per_call) - min(per_call),
    )
  else:
    result["ms"] = result["wall_ms"]
  return result


def run_cases(result: dict, cases, measure, out: str, time_budget_s=0.0):
  """Appends ``measure(*case)`` to ``result['cases']`` for each of
  ``cases`` in order, printing each record and saving ``result`` to ``out``
  after each, so a run cut short keeps what it measured. No case starts
  after ``time_budget_s`` seconds (0: no budget); ``result['stopped_early']``
  then says so. Returns ``result``."""

  def save():
    with open(out, "w") as f:
      json.dump(result, f, indent=1)

  started = time.perf_counter()
  for case in cases:
    if time_budget_s and time.perf_counter() - started > time_budget_s:
      result["stopped_early"] = True
      save()
      break
    record = measure(*case)
    result["cases"].append(record)
    print(json.dumps(record), flush=True)
    save()
  return result


def run_grid(args, axes, measure):
  """:func:`run_cases` over the product of ``axes``, names of list-valued
  flags of ``args`` (in that order), into ``args.out``, with ``vars(args)``
  as the result's config and ``args.time_budget_s`` (if it has one) as the
  budget."""
  return run_cases(
    {"meta": metadata(), "config": vars(args), "cases": []},
    itertools.product(*(getattr(args, axis) for axis in axes)),
    measure,
    args.out,
    getattr(args, "time_budget_s", 0.0),
  )
