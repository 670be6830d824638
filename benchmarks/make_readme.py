"""Regenerate the README's result tables and plots from benchmarks/results/.

Tables sit between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` markers;
nothing inside them is typed by hand. Run after adding results:

  python benchmarks/make_readme.py
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PLOTS = os.path.join(ROOT, "benchmarks", "plots")

sys.path.insert(0, ROOT)
from forge_jax.ops import mosaic_kernel  # pylint: disable=wrong-import-position

def _current_default(tokens: int) -> dict:
  """The Mosaic kernel's default config for bf16 kernels and states today."""
  return dataclasses.asdict(mosaic_kernel.ranked_configs(tokens)[0])


def _with_schedule(config: dict) -> dict:
  """A recorded MosaicConfig's fields, sessions before 5 included (their
  ``epilogue_warpgroup`` flag is now ``schedule``), with the defaults of
  fields added since it was recorded."""
  config = dict(config)
  if "epilogue_warpgroup" in config:
    config["schedule"] = ("epilogue-warpgroup"
                          if config.pop("epilogue_warpgroup") else "inline")
  return {**dataclasses.asdict(mosaic_kernel.MosaicConfig()), **config}


def _load(pattern):
  runs = []
  for path in sorted(glob.glob(os.path.join(RESULTS, pattern))):
    with open(path) as f:
      data = json.load(f)
    data["_file"] = os.path.relpath(path, ROOT)
    runs.append(data)
  return runs


_COMMIT_IN_NAME = re.compile(r"_([0-9a-f]{7,40})\.json$")


def _code_commit(run) -> str:
  """The commit whose code made the run: the one its file name carries (the
  GPU session scripts name files by the commit they run), else meta's."""
  match = _COMMIT_IN_NAME.search(run["_file"])
  return match.group(1)[:7] if match else run["meta"]["commit"][:10]


def _recorded_commit_note(run) -> str:
  """'' unless the device's checkout recorded another commit than the name."""
  match = _COMMIT_IN_NAME.search(run["_file"])
  recorded = run["meta"]["commit"]
  if not match or recorded.startswith(match.group(1)):
    return ""
  dirty = "-dirty" if recorded.endswith("-dirty") else ""
  return (f" (from the file name; the device's git checkout recorded "
          f"`{recorded[:10]}{dirty}`)")


def _provenance(run) -> str:
  meta = run["meta"]
  return (f"{meta['device']}, JAX {meta['jax_version']}, commit "
          f"`{_code_commit(run)}`{_recorded_commit_note(run)}, "
          f"{meta['date'][:10]}; from `{run['_file']}`")


def _median(values):
  values = sorted(values)
  mid = len(values) // 2
  return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _is_mosaic(run) -> bool:
  return any("fused_mosaic" in r for r in run.get("bench") or [])


def _kernel_runs():
  runs = [r for r in _load("kernel_*.json") if r.get("bench")]
  mosaic = sorted((r for r in runs if _is_mosaic(r)),
                  key=lambda r: r["meta"]["date"], reverse=True)
  triton = sorted((r for r in runs if not _is_mosaic(r)),
                  key=lambda r: r["meta"]["date"], reverse=True)
  return mosaic, triton


# The targets for one AdamW update at the 8B shapes: fused time over
# the GEMM alone (at most), and GEMM + optax over fused (at least, per T).
KERNEL_TARGETS = {
    "Mosaic": {"over_gemm": 1.05, "speedup": {8192: 1.4, 2048: 1.8}},
    "Triton": {"over_gemm": 1.10, "speedup": {8192: 1.25, 2048: 1.5}},
}
_RATIO_KEYS = {"Mosaic": ("mosaic_over_gemm", "unfused_over_mosaic"),
               "Triton": ("fused_over_gemm", "unfused_over_fused")}


def _adamw_rows(run, tokens):
  return [r for r in run["bench"]
          if r["optimizer"] == "adamw" and r["tokens"] == tokens]


def _shape_counts(runs):
  """Most AdamW shapes any of the runs has, per token count."""
  counts = {}
  for run in runs:
    for r in run["bench"]:
      if r["optimizer"] == "adamw":
        counts.setdefault(r["tokens"], set()).add((r["k"], r["n"]))
  return {t: len(shapes) for t, shapes in counts.items()}


def _runs_for_tokens(mosaic_runs, tokens):
  """The newest Mosaic run with AdamW rows at ``tokens``, and, where it lacks
  shapes, the newest one with all of them too."""
  full = _shape_counts(mosaic_runs).get(tokens, 0)
  having = [r for r in mosaic_runs if _adamw_rows(r, tokens)]
  if not having:
    return []
  chosen = [having[0]]
  if len(_adamw_rows(having[0], tokens)) < full:
    complete = [r for r in having if len(_adamw_rows(r, tokens)) == full]
    if complete:
      chosen.append(complete[0])
  return chosen


def _verdict(ok: bool) -> str:
  return "**met**" if ok else "missed"


def kernel_targets(mosaic_runs) -> str:
  """Each kernel's targets against the side-by-side runs, AdamW medians."""
  full = _shape_counts(mosaic_runs)
  lines = [
      "| kernel | T | fused / GEMM: median (range) | target | | "
      "unfused / fused: median (range) | target | | run (AdamW shapes) |",
      "|---|---|---|---|---|---|---|---|---|"]
  for kernel, targets in KERNEL_TARGETS.items():
    over_key, speed_key = _RATIO_KEYS[kernel]
    for tokens in sorted(targets["speedup"]):
      for run in _runs_for_tokens(mosaic_runs, tokens):
        rows = _adamw_rows(run, tokens)
        over = [r[over_key] for r in rows]
        speed = [r[speed_key] for r in rows]
        goal_over, goal_speed = targets["over_gemm"], targets["speedup"][tokens]
        lines.append(
            f"| {kernel} | {tokens} | {_median(over):.2f} ({min(over):.2f}-"
            f"{max(over):.2f}) | ≤ {goal_over:.2f} | "
            f"{_verdict(_median(over) <= goal_over)} | {_median(speed):.2f} "
            f"({min(speed):.2f}-{max(speed):.2f}) | ≥ {goal_speed:.2f} | "
            f"{_verdict(_median(speed) >= goal_speed)} | `{_code_commit(run)}` "
            f"({len(rows)} of {full[tokens]}) |")
  return "\n".join(lines)


def _traffic_bound(row) -> dict:
  """What one AdamW row allows at best. The fused kernel must move W and its
  state in and out (``2 x weight_and_state_bytes``); optax's update moves
  those bytes and reads the gradient. Timed at the bandwidth optax's update
  reached in the same run ((GEMM + optax) - GEMM), that traffic alone takes
  ``traffic`` ms; a fused kernel takes at least ``max(GEMM, traffic)`` (all
  traffic hidden under tensor-core work) and, without overlap, ``GEMM +
  traffic``. x and dy (read once a tile, mostly from L2) are left out."""
  params = row["k"] * row["n"]
  fused_bytes = 2 * row["fused_memory"]["weight_and_state_bytes"]
  gradient_bytes = params * 4  # float32 dW
  gemm, unfused = row["gemm"]["ms"], row["unfused"]["ms"]
  bandwidth = (fused_bytes + gradient_bytes) / (unfused - gemm)  # bytes / ms
  traffic = fused_bytes / bandwidth
  bound = max(gemm, traffic)
  mosaic = row["fused_mosaic"]["ms"]
  return {"tb_per_s": bandwidth / 1e9, "bound_over_gemm": bound / gemm,
          "best_speedup": unfused / bound, "mosaic_over_bound": mosaic / bound,
          "mosaic_over_serial": mosaic / (gemm + traffic),
          "bytes_per_param": fused_bytes / params}


def traffic_bounds(mosaic_runs) -> str:
  """How close the targets and the Mosaic kernel are to the traffic bound."""
  targets = KERNEL_TARGETS["Mosaic"]
  lines = [
      "| T | fused bytes a parameter | optax's update (TB/s) | best fused / "
      "GEMM | target | | best unfused / fused | target | | Mosaic / best | "
      "Mosaic / (GEMM + traffic) | run |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for tokens in sorted(targets["speedup"]):
    runs = _runs_for_tokens(mosaic_runs, tokens)
    if not runs:
      continue
    run = runs[-1]  # the one with every shape
    bounds = [_traffic_bound(r) for r in _adamw_rows(run, tokens)]
    med = lambda key: _median([b[key] for b in bounds])
    lines.append(
        f"| {tokens} | {med('bytes_per_param'):.0f} | {med('tb_per_s'):.2f} | "
        f"{med('bound_over_gemm'):.2f} | ≤ {targets['over_gemm']:.2f} | "
        f"{'reachable' if med('bound_over_gemm') <= targets['over_gemm'] else '**out of reach**'} | "
        f"{med('best_speedup'):.2f} | ≥ {targets['speedup'][tokens]:.2f} | "
        f"{'reachable' if med('best_speedup') >= targets['speedup'][tokens] else '**out of reach**'} | "
        f"{med('mosaic_over_bound'):.2f} | {med('mosaic_over_serial'):.2f} | "
        f"`{_code_commit(run)}` |")
  return "\n".join(lines)


def _config_text(config: dict) -> str:
  return ", ".join(f"{k}={v}" for k, v in config.items())


def side_by_side_table(run, tokens) -> str:
  """Both kernels beside XLA's GEMM and GEMM + optax at one token count."""
  lines = [
      "| optimizer | K x N | XLA dW GEMM (ms) | GEMM + optax (ms) | "
      "Triton fused (ms) | Mosaic fused (ms) | Triton / GEMM | Mosaic / GEMM | "
      "unfused / Triton | unfused / Mosaic |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  order = {"adamw": 0, "sgd_momentum": 1, "lion": 2}
  rows = [r for r in run["bench"] if r["tokens"] == tokens]
  for r in sorted(rows, key=lambda r: (order.get(r["optimizer"], 9),
                                       r["optimizer"], r["k"], r["n"])):
    lines.append(
        f"| {r['optimizer']} | {r['k']} x {r['n']} | {r['gemm']['ms']:.3f} | "
        f"{r['unfused']['ms']:.3f} | {r['fused']['ms']:.3f} | "
        f"{r['fused_mosaic']['ms']:.3f} | {r['fused_over_gemm']:.2f} | "
        f"{r['mosaic_over_gemm']:.2f} | {r['unfused_over_fused']:.2f} | "
        f"{r['unfused_over_mosaic']:.2f} |")
  return "\n".join(lines)


def _mosaic_run_notes(run) -> list:
  rows = run["bench"]
  faster_triton = sum(r["fused_mosaic"]["ms"] < r["fused"]["ms"] for r in rows)
  faster_unfused = sum(r["fused_mosaic"]["ms"] < r["unfused"]["ms"] for r in rows)
  configs = []
  for r in rows:
    if r["mosaic_config"] not in configs:
      configs.append(r["mosaic_config"])
  notes = [
      f"- Mosaic faster than Triton in {faster_triton} of {len(rows)} rows, "
      f"faster than GEMM + optax in {faster_unfused} of {len(rows)}.",
      "- Mosaic config: " + "; ".join(f"`{_config_text(c)}`" for c in configs)
      + f". Triton config: `{_config_text(run['config'])}`."]
  if run.get("truncated"):
    notes.append(f"- The run was cut by its time budget ({run['truncated']}).")
  for e in run.get("errors") or []:
    notes.append(f"- Not measured: {' '.join(map(str, e['case']))}: "
                 f"`{e['error'][:120]}`.")
  notes.append(f"- {_provenance(run)}.")
  return notes


def mosaic_sweep_table(run) -> str:
  sweep = run.get("sweep") or []
  if not sweep:
    return ""
  configs, cells = [], {}
  for r in sweep:
    key = _config_text(r["mosaic_config"])
    if key not in configs:
      configs.append(key)
    if "error" in r:
      reason = re.search(r"\((['\"])(.*)\1\)", r["error"])
      cells[key, r["tokens"]] = (
          "does not fit (shared memory)" if "shared memory" in r["error"]
          else "error: " + (reason.group(2) if reason else r["error"])[:50])
    else:
      cells[key, r["tokens"]] = (f"{r['fused_mosaic']['ms']:.3f}"
                                 + (f" ({r['check']['update_rel_err']:.1e})"
                                    if "check" in r else ""))
  token_counts = sorted({r["tokens"] for r in sweep})
  lines = ["| Mosaic config (4096 x 4096, AdamW) | "
           + " | ".join(f"T = {t}: ms (update rel. error)" for t in token_counts)
           + " |", "|---|" + "---|" * len(token_counts)]
  for key in configs:
    lines.append(f"| `{key}` | "
                 + " | ".join(cells.get((key, t), "-") for t in token_counts)
                 + " |")
  return "\n".join(lines)


def mosaic_section(mosaic_runs) -> str:
  """Targets, then each Mosaic run's tables per token count, newest first;
  earlier runs folded."""
  parts = []
  for i, run in enumerate(mosaic_runs):
    tables = []
    for tokens in sorted({r["tokens"] for r in run["bench"]}):
      tables.append(f"T = {tokens}:\n\n" + side_by_side_table(run, tokens))
    body = "\n\n".join(tables) + "\n\n" + "\n".join(_mosaic_run_notes(run))
    sweep = mosaic_sweep_table(run)
    title = f"Mosaic beside Triton, commit {_code_commit(run)}"
    if i == 0:
      parts.append(f"#### {title}\n\n{body}")
      if sweep:
        parts.append("<details><summary>Mosaic tile sweep of this run</summary>"
                     f"\n\n{sweep}\n\n</details>")
    else:
      parts.append(f"<details><summary>{title} (earlier Mosaic version)"
                   f"</summary>\n\n{body}"
                   + (f"\n\nTile sweep:\n\n{sweep}" if sweep else "")
                   + "\n\n</details>")
  return "\n\n".join(parts)


def kernel_table(run) -> str:
  lines = [
      "| optimizer | K x N | T | XLA dW GEMM (ms) | GEMM + optax (ms) | "
      "Triton fused (ms) | fused / GEMM | unfused / fused |",
      "|---|---|---|---|---|---|---|---|"]
  for r in sorted(run["bench"], key=lambda r: (r["optimizer"], r["tokens"], r["k"], r["n"])):
    lines.append(
        f"| {r['optimizer']} | {r['k']} x {r['n']} | {r['tokens']} | "
        f"{r['gemm']['ms']:.3f} | {r['unfused']['ms']:.3f} | "
        f"{r['fused']['ms']:.3f} | {r['fused_over_gemm']:.2f} | "
        f"{r['unfused_over_fused']:.2f} |")
  summary = run.get("summary_adamw", {})
  lines.append("")
  for tokens, s in sorted(summary.items(), key=lambda kv: int(kv[0])):
    lines.append(
        f"- AdamW, T = {tokens}, median over shapes: fused / GEMM "
        f"**{s['median_fused_over_gemm']:.2f}**, unfused / fused "
        f"**{s['median_unfused_over_fused']:.2f}**.")
  config = run.get("best_config") or run["bench"][0]["config"]
  lines.append(f"- Kernel config: `{config}`.")
  lines.append(f"- {_provenance(run)}.")
  return "\n".join(lines)


def kernel_perf_section(mosaic_runs, triton_runs, plot) -> str:
  parts = []
  if plot:
    parts.append(f"![fused vs unfused]({plot})")
  if mosaic_runs:
    goals = "; ".join(
        f"{kernel}: fused ≤ {t['over_gemm']:.2f}x the GEMM alone and "
        + " / ".join(f"≥ {t['speedup'][tokens]:.2f}x faster than GEMM + optax "
                     f"at T = {tokens}" for tokens in sorted(t["speedup"],
                                                             reverse=True))
        for kernel, t in KERNEL_TARGETS.items())
    parts.append(
        f"Targets of the issue ({goals}), judged on the median over the "
        "AdamW shapes of the newest side-by-side run, and of the newest run "
        "with every shape where that one lacks some:")
    parts.append(kernel_targets(mosaic_runs))
    parts.append(
        "How far each target and the Mosaic kernel are from the traffic "
        "bound (medians over the AdamW shapes of the run with every shape; "
        "float32 W, m, v: `_traffic_bound` in `benchmarks/make_readme.py`). "
        "The traffic is timed at the bandwidth optax's update reached in "
        "the same run; the best fused kernel hides all of it under its "
        "GEMM, so it takes max(GEMM, traffic), and a kernel that hides none "
        "takes GEMM + traffic:")
    parts.append(traffic_bounds(mosaic_runs))
    parts.append(mosaic_section(mosaic_runs))
  if triton_runs:
    tokens = sorted({r["tokens"] for r in triton_runs[0]["bench"]})
    parts.append(f"#### Triton kernel, full run (T = "
                 f"{', '.join(map(str, tokens))})\n\n"
                 + kernel_table(triton_runs[0]))
  parts.append("Device time from the JAX profiler (sum of kernel durations "
               "per call, median of repeats).")
  return "\n\n".join(parts)


def _check_rows(checks):
  lines = ["| optimizer | K x N | T | update rel. error | worst state rel. "
           "error | skipped: kernel / reference |", "|---|---|---|---|---|---|"]
  for c in checks:
    if "error" in c:
      message = c["error"].replace("|", "/")
      if "shared memory" in message:
        message = "does not fit: " + re.sub(
            r".*need (\d+) bytes of shared memory.*more than (\d+).*",
            r"needs \1 bytes of shared memory per CTA, more than \2",
            message)
      lines.append(f"| {c['optimizer']} | - | - | not run: {message[:140]} "
                   "| | |")
      continue
    worst_state = max(c["state_rel_err"].values(), default=None)
    lines.append(
        f"| {c['optimizer']} | {c['k']} x {c['n']} | {c['tokens']} | "
        f"{c['update_rel_err']:.1e} | "
        f"{'-' if worst_state is None else f'{worst_state:.1e}'} | "
        f"{c['skipped']} / {c['ref_skipped']} |")
  return lines


def mosaic_check_table(run, earlier) -> str:
  checks = run["checks"]
  lines = _check_rows(checks)
  ok = [c for c in checks if "error" not in c]
  lines.append("")
  lines.append(
      f"- Worst update error {max(c['update_rel_err'] for c in ok):.1e}, worst "
      f"state error {max(max(c['state_rel_err'].values(), default=0) for c in ok):.1e}; "
      f"skipped counts equal the reference's in "
      f"{sum(c['skipped'] == c['ref_skipped'] for c in ok)} of {len(ok)} cases; "
      f"every result finite: {'yes' if all(c['finite'] for c in ok) else 'no'}. "
      "`adamw_nan_column` puts a NaN in one column of x, so one row of dW is "
      "not finite: those elements must keep their weight and state and be "
      "counted.")
  for c in checks:
    if "error" not in c:
      continue
    for other in earlier:
      prior = next((p for p in other["checks"] if p["optimizer"] == c["optimizer"]
                    and "error" not in p), None)
      if prior:
        worst = max([prior["update_rel_err"], *prior["state_rel_err"].values()])
        lines.append(
            f"- {c['optimizer']} ran in the earlier Mosaic run "
            f"`{_code_commit(other)}` (its config): worst error {worst:.1e}, "
            f"skipped {prior['skipped']} / {prior['ref_skipped']}.")
        break
  config = (f"Config `{_config_text(run['best_mosaic_config'])}`"
            if "best_mosaic_config" in run else
            "The default config for each shape (`--mosaic-defaults`)")
  lines.append(f"- {config}. "
               "Error of the update (new W − old W) and of each state leaf, "
               f"‖a − b‖ / ‖b‖, against the XLA reference. {_provenance(run)}.")
  return "\n".join(lines)


def check_table(run) -> str:
  checks = run.get("checks") or []
  if not checks:
    return "_No GPU correctness run recorded yet._"
  by_opt = {}
  for c in checks:
    worst = max([c["update_rel_err"], *c["state_rel_err"].values()])
    by_opt[c["optimizer"]] = max(by_opt.get(c["optimizer"], 0.0), worst)
  shapes = sorted({f"{c['k']}x{c['n']}" for c in checks})
  lines = ["| optimizer | worst relative error vs XLA reference |", "|---|---|"]
  lines += [f"| {name} | {err:.1e} |" for name, err in by_opt.items()]
  lines.append("")
  lines.append(f"- Shapes {', '.join(shapes)}, T = {checks[0]['tokens']}; "
               "error of the update (new W − old W) and of each state leaf, "
               "‖a − b‖ / ‖b‖. " + _provenance(run) + ".")
  return "\n".join(lines)


def kernel_checks_section(mosaic_runs, triton_runs) -> str:
  parts = []
  mosaic = [r for r in mosaic_runs if r.get("checks")]
  if mosaic:
    parts.append("Mosaic kernel:\n\n" + mosaic_check_table(mosaic[0], mosaic[1:]))
  triton = [r for r in triton_runs if r.get("checks")]
  if triton:
    parts.append("Triton kernel:\n\n" + check_table(triton[0]))
  return "\n\n".join(parts) or "_No GPU correctness run recorded yet._"


_STATE_ORDER = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3}


def _mm_key(r):
  """What makes two whole-model runs the same measurement."""
  return (r["config"], r["variant"], r["batch"], r["seq"],
          r.get("param_dtype", "bfloat16"), r.get("state_dtype", "bfloat16"),
          r.get("weight_rounding", "nearest"), r.get("attention") or "xla",
          r.get("remat_policy"), json.dumps(r.get("mosaic_config"),
                                            sort_keys=True), _xla_flags(r))


def _xla_flags(r) -> str:
  """The ``XLA_FLAGS`` a run had (recorded from session 8 on; none before)."""
  return r["meta"].get("xla_flags", "")


def _as_default_run(r):
  """A run whose forced Mosaic config is today's first default (bf16 W and
  states) measured the defaults: it counts as a default run, newer than the
  runs of earlier defaults."""
  if (r.get("variant") == "forge" and r.get("mosaic_config")
      and _with_schedule(r["mosaic_config"])
      == _current_default(r["batch"] * r["seq"])):
    return {**r, "mosaic_config": None, "forced_current_default": True}
  return r


def _is_default_run(r) -> bool:
  """Full remat and the kernel's own configs (not a diagnostic run)."""
  return (r.get("remat_policy") is None and r.get("mosaic_config") is None
          and not _xla_flags(r))


def _mm_sort(r):
  return (r["config"], r["batch"], r["seq"], r["variant"] != "optax",
          (r.get("attention") or "xla") != "xla",
          _STATE_ORDER.get(r.get("state_dtype", "bfloat16"), 9),
          r.get("weight_rounding", "nearest"), r["meta"]["date"])


def _latest_model_runs(runs):
  latest = {}
  for r in runs:
    key = _mm_key(r)
    if key not in latest or r["meta"]["date"] > latest[key]["meta"]["date"]:
      latest[key] = r
  return latest


def _precision(r) -> str:
  weights = _STATES.get(r.get("param_dtype", "bfloat16"), r.get("param_dtype"))
  if r.get("weight_rounding") == "stochastic":
    weights += " + SR"
  states = _STATES.get(r.get("state_dtype", "bfloat16"), r.get("state_dtype"))
  return f"{weights} / {states}"


def _variant(r) -> str:
  name = "FORGE" if r["variant"] == "forge" else r["variant"]
  if r.get("remat_policy"):
    name += f", remat policy `{r['remat_policy']}`"
  if r.get("mosaic_config"):
    name += f", Mosaic config forced to `{_config_text(r['mosaic_config'])}`"
  if r.get("forced_current_default"):
    name += " (the current default Mosaic config, forced)"
  if _xla_flags(r):
    name += f", `XLA_FLAGS={_xla_flags(r)}`"
  return name


_GIB = 2**30

# The whole-step targets: FORGE's step time against optax's at the
# same precision (optax / FORGE, at least), and FORGE's peak (GiB, at most).
STEP_SPEEDUP_TARGETS = {512: 1.2, 2048: 1.08}
PEAK_TARGETS = (
    ("llama-3.1-8b", 1, 2048, "bfloat16", 47.0),
    ("llama-3.1-8b", 1, 2048, "int8", 36.0),
    ("qwen3-14b", 1, 2048, None, 64.0),
)


def _peak_targets(latest) -> list:
  lines = []
  for config, batch, seq, states, goal in PEAK_TARGETS:
    for r in sorted(latest.values(), key=_mm_sort):
      if (r["variant"] == "forge" and _is_default_run(r)
          and r["config"] == config and r["batch"] == batch and r["seq"] == seq
          and (states is None or r.get("state_dtype", "bfloat16") == states)):
        peak = r["peak_bytes_in_use"] / _GIB
        lines.append(
            f"| {config}, B = {batch}, T = {seq}, FORGE {_precision(r)}, "
            f"{r.get('attention') or 'xla'} attention | ≤ {goal:g} | "
            f"{peak:.2f} | {_verdict(peak <= goal)} | `{_code_commit(r)}` |")
  if not lines:
    return []
  return (["| peak-memory target | GiB | measured (GiB) | | commit |",
           "|---|---|---|---|---|"] + lines)


def model_memory_table(runs) -> str:
  """Every whole-model run; FORGE against optax where both were measured."""
  if not runs:
    return "_No whole-model run recorded yet._"
  latest = _latest_model_runs(runs)
  newest = {id(r) for r in latest.values()}
  lines = ["| model | B | T | variant | weights / states | attention | commit | "
           "peak (GiB) | compiled temp (GiB) | step ms (median of n) | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(runs, key=_mm_sort):
    note = ("" if id(r) in newest else
            f"superseded by `{_code_commit(latest[_mm_key(r)])}`")
    lines.append(
        f"| {r['config']} ({r['num_layers']} layers) | {r['batch']} | "
        f"{r['seq']} | {_variant(r)} | {_precision(r)} | "
        f"{r.get('attention') or 'xla'} | `{_code_commit(r)}` | "
        f"{r['peak_bytes_in_use'] / _GIB:.2f} | "
        f"{r['compiled_temp_bytes'] / _GIB:.2f} | {r['step_ms_median']:.1f} "
        f"({len(r.get('step_ms_all') or []) or '?'}) | {note} |")

  # FORGE beside optax: the newest run of each, same model, B, T, attention.
  pairs = []
  for o in sorted(latest.values(), key=_mm_sort):
    if o["variant"] != "optax":
      continue
    for f in sorted(latest.values(), key=_mm_sort):
      if (f["variant"] == "forge" and f.get("mosaic_config") is None
          and all(f.get(k) == o.get(k)
                  for k in ("config", "batch", "seq", "remat_policy"))
          and _xla_flags(f) == _xla_flags(o)
          and (f.get("attention") or "xla") == (o.get("attention") or "xla")):
        pairs.append((o, f))
  if pairs:
    lines += ["", "Whole step, FORGE against optax (newest run of each; same "
              "model, B, T, attention and remat policy):", "",
              "| model | B x T | FORGE weights / states | optax step / FORGE step "
              "| target | | FORGE peak / optax peak | peak saved (GiB; % of the "
              "projection kernels' bf16 gradients) | commits (optax, FORGE) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for o, f in pairs:
      speedup = o["step_ms_median"] / f["step_ms_median"]
      same = _precision(f) == _precision(o)
      goal = STEP_SPEEDUP_TARGETS.get(f["seq"]) if same else None
      saved = o["peak_bytes_in_use"] - f["peak_bytes_in_use"]
      lines.append(
          f"| {f['config']}"
          + (f", {f['attention']} attention" if f.get("attention") not in
             (None, "xla") else "")
          + (f", remat policy `{f['remat_policy']}`" if f.get("remat_policy")
             else "")
          + (f", `XLA_FLAGS={_xla_flags(f)}`" if _xla_flags(f) else "")
          + f" | {f['batch']} x {f['seq']} | {_precision(f)} | "
          f"{speedup:.3f} | {f'≥ {goal:g}' if goal else '-'} | "
          f"{_verdict(speedup >= goal) if goal else ''} | "
          f"{f['peak_bytes_in_use'] / o['peak_bytes_in_use']:.2f} | "
          f"{saved / _GIB:.2f}"
          + (f" ({100 * saved / f['projection_kernel_bytes']:.0f}% of "
             f"{f['projection_kernel_bytes'] / _GIB:.2f})" if same else "")
          + " | "
          f"`{_code_commit(o)}`, `{_code_commit(f)}` |")
  targets = _peak_targets(latest)
  if targets:
    lines += ["", "Peak memory against the issue's targets (newest run of each "
              "configuration):", ""] + targets
  meta = runs[0]["meta"]
  recorded = sorted({r["meta"]["commit"][:10] + ("-dirty" if r["meta"]["commit"]
                                                 .endswith("-dirty") else "")
                     for r in runs if _recorded_commit_note(r)})
  lines.append("")
  lines.append(
      f"- {meta['device']}, JAX {meta['jax_version']}; AdamW, scan over layers "
      "with remat; one process per row; peak = `memory_stats()` "
      "`peak_bytes_in_use` / 2^30; step time: median of the timed steps (n) "
      "after warm-up; `benchmarks/results/model_memory_*.json`.")
  if recorded:
    lines.append(
        "- Commit: the one in the result's file name (the GPU session scripts "
        "name each file by the commit they ran); those runs' `meta.commit` is "
        f"the device's stale git checkout ({', '.join(f'`{c}`' for c in recorded)}).")
  return "\n".join(lines)


def model_memory_plot(runs) -> str | None:
  """Peak memory of the newest 8B run of each configuration, with targets
  (diagnostic runs, with a forced Mosaic config, a remat policy or XLA
  flags, have their default run's peak and are left out)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  config = "llama-3.1-8b"
  rows = sorted((r for r in _latest_model_runs(runs).values()
                 if r["config"] == config and _is_default_run(r)),
                key=_mm_sort)
  if not rows:
    return None
  colors = {"optax": "tab:gray", "bfloat16": "tab:blue", "float32": "tab:purple",
            "int8": "tab:green"}
  fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 2), 4.5))
  for i, r in enumerate(rows):
    peak = r["peak_bytes_in_use"] / _GIB
    color = colors["optax"] if r["variant"] == "optax" else colors.get(
        r.get("state_dtype", "bfloat16"), "tab:orange")
    ax.bar(i, peak, color=color,
           hatch="//" if (r.get("attention") or "xla") != "xla" else None,
           edgecolor="white")
    ax.text(i, peak + 0.5, f"{peak:.1f}", ha="center", fontsize=8)
  labels = [f"{_variant(r)}\n{_precision(r)}\nB={r['batch']} T={r['seq']}"
            + (f"\n{r['attention']} attn." if r.get("attention") else "")
            for r in rows]
  ax.set_xticks(range(len(rows)), labels, fontsize=7)
  from matplotlib.patches import Patch  # pylint: disable=import-outside-toplevel
  handles = [Patch(color=colors["optax"], label="nn.Dense + optax"),
             Patch(color=colors["bfloat16"], label="FORGE, bf16 states"),
             Patch(color=colors["int8"], label="FORGE, int8 states"),
             Patch(facecolor="lightgray", hatch="//", edgecolor="white",
                   label="cuDNN attention")]
  for (cfg, batch, seq, states, goal) in PEAK_TARGETS:
    if cfg == config:
      handles.append(ax.axhline(
          goal, color=colors.get(states, "k"), linestyle="--", linewidth=1,
          label=f"target, FORGE {_STATES.get(states, states)} states, "
                f"B={batch} T={seq}: {goal:g} GiB"))
  ax.legend(handles=handles, fontsize=7, ncol=3, loc="upper left")
  ax.set_ylabel("peak memory (GiB)")
  ax.set_ylim(0, max(r["peak_bytes_in_use"] / _GIB for r in rows) * 1.35)
  ax.set_title(f"{config}, one {rows[0]['meta']['device']}: peak memory of "
               "the train step (newest run of each)", fontsize=9)
  fig.tight_layout()
  os.makedirs(PLOTS, exist_ok=True)
  path = os.path.join(PLOTS, "model_memory.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.path.relpath(path, ROOT)


def memory_sweep_table(runs) -> str:
  """Compiled temp memory as the model grows (latest sweep)."""
  if not runs:
    return "_No memory sweep recorded yet._"
  run = max(runs, key=lambda r: r["meta"]["date"])
  mib = lambda b: b / 2**20
  pairs = {}
  for r in run["rows"]:
    pairs.setdefault((r["dim"], r["num_layers"]), {})[r["variant"]] = r
  lines = ["| width | layers | kernel bytes (MiB) | optax temp (MiB) | "
           "FORGE temp (MiB) |", "|---|---|---|---|---|"]
  for (dim, layers), pair in sorted(pairs.items()):
    lines.append(f"| {dim} | {layers} | {mib(pair['forge']['kernel_bytes']):.1f} | "
                 f"{mib(pair['optax']['temp_bytes']):.1f} | "
                 f"{mib(pair['forge']['temp_bytes']):.1f} |")
  meta = run["meta"]
  lines.append("")
  lines.append(f"- {meta['device']} (`memory_analysis()` of the compiled, donated "
               f"step; float32, scan over layers with remat; XLA reference "
               f"backend), JAX {meta['jax_version']}, commit `{meta['commit'][:10]}`; "
               f"`{run['_file']}`.")
  return "\n".join(lines)


_STATES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
           "int8": "int8"}


def _capacity_label(spec: dict) -> str:
  weights = "bf16 + SR" if spec.get("weight_rounding") == "stochastic" else "bf16"
  states = _STATES.get(spec.get("state_dtype"), spec.get("state_dtype"))
  kind = "FORGE" if spec.get("forge") else "nn.Dense + optax"
  return f"{kind}, {weights} / {states}"


def _last_batch_tried(run: dict) -> int:
  return max(p["batch"] for r in run["results"].values() for p in r["points"])


def _first_failure(r: dict, run: dict) -> str:
  if r.get("first_failure_batch"):
    failed = next((p for p in r["points"]
                   if p["batch"] == r["first_failure_batch"]), {})
    kind = r["first_failure"]
    if kind == "oom":
      what = "out of memory"
    elif kind == "timeout":
      limit = failed.get("wall_s")
      what = ("timeout: the point's process ran past its "
              f"{f'{limit:g} s ' if limit else ''}limit (not an out-of-memory)")
    else:
      what = kind
      if failed.get("message"):
        message = failed["message"].splitlines()[0].replace("|", "/")
        what += f" ({message[:60]}{'...' if len(message) > 60 else ''})"
    return f"{r['first_failure_batch']}: {what}"
  if not r.get("complete", True):
    tried = max(p["batch"] for p in r["points"])
    return ("not reached: the sweep's time budget ran out before batch "
            f"{2 * tried}")
  return f"none up to {run['max_batch_tried']}"


def capacity_table(run) -> str:
  """Largest micro-batch under a memory cap per variant, tokens/s per batch."""
  gib = lambda b: b / 2**30
  lines = ["| variant | weights / states | largest micro-batch | tokens/s by "
           "micro-batch | peak per GPU at the largest (GiB) | first failure |",
           "|---|---|---|---|---|---|"]
  for variant, r in run["results"].items():
    fits = [p for p in r["points"] if p["fits"]]
    speeds = ", ".join(f"{p['batch']}: {p['tokens_per_s']:,.0f}" for p in fits)
    peak = r.get("max_peak_bytes_in_use_at_max_batch")
    largest = r["max_batch"] or "none"
    if r["max_batch"] and not r.get("complete", True) and not r.get(
        "first_failure_batch"):
      largest = f"≥ {r['max_batch']}"
    lines.append(
        f"| {variant} | {_capacity_label(run['variants'][variant])} | "
        f"{largest} | {speeds or '-'} | "
        f"{f'{gib(peak):.2f}' if peak else '-'} | {_first_failure(r, run)} |")
  meta = run["meta"]
  if run.get("mem_cap_gib"):
    cap = f"XLA allocator capped at {run['mem_cap_gib']:g} GiB per process"
    if run.get("mem_fraction"):
      cap += f" (memory fraction {run['mem_fraction']:.3f})"
  elif run.get("mem_fraction"):
    cap = f"XLA_PYTHON_CLIENT_MEM_FRACTION={run['mem_fraction']:.3f}"
  elif run.get("cpu_cap_mib"):
    cap = (f"a simulated cap of {run['cpu_cap_mib']:g} MiB on the compiled "
           "memory estimate")
  else:
    cap = "no memory cap"
  layers = run.get("num_layers")
  shape = ", ".join(
      ([f"{layers} layer{'s' if layers != 1 else ''}"] if layers else [])
      + (["scanned"] if run.get("scan_layers") else []))
  lines.append("")
  lines.append(
      f"- {run['config']}{f' ({shape})' if shape else ''}, T = {run['seq']}, "
      f"TP = {run['tp']}{' with SP' if run.get('sp') else ''}, {cap}; "
      "tokens/s of the TP group (micro-batch x T / median of "
      f"{run['steps']} steps after {run['warmup']} warm-up), one process "
      "per point; embedding and norms: optax.adamw, bf16 states.")
  if any(not r.get("complete", True) for r in run["results"].values()):
    lines.append(f"- The sweep's time budget stopped it after batch "
                 f"{_last_batch_tried(run)} (of up to {run['max_batch_tried']}): "
                 "'≥' marks a variant whose largest batch was not reached.")
  lines.append(f"- {meta['device']} x {meta['num_devices']}, JAX "
               f"{meta['jax_version']}, commit `{_code_commit(run)}`"
               f"{_recorded_commit_note(run)}, {meta['date'][:10]}; "
               f"`{run['_file']}`.")
  return "\n".join(lines)


def capacity_section(runs) -> str:
  """Every capacity sweep, newest first."""
  if not runs:
    return "_No capacity sweep recorded yet._"
  runs = sorted(runs, key=lambda r: r["meta"]["date"], reverse=True)
  return "\n\n".join(capacity_table(r) for r in runs)


def kernel_plot(mosaic_runs, triton_runs) -> str | None:
  """Time over the GEMM's per AdamW shape: unfused, Triton, Mosaic; per T, the
  newest side-by-side run with every shape (else the Triton full run)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  panels = []
  for tokens in sorted(_shape_counts(mosaic_runs)):
    panels.append((tokens, _runs_for_tokens(mosaic_runs, tokens)[-1]))
  if not panels and triton_runs:
    panels = [(t, triton_runs[0]) for t in sorted(
        {r["tokens"] for r in triton_runs[0]["bench"]})]
  if not panels:
    return None
  series = (("gemm", "XLA GEMM"), ("unfused", "GEMM + optax"),
            ("fused", "Triton fused"), ("fused_mosaic", "Mosaic fused"))
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4),
                           squeeze=False)
  for ax, (tokens, run) in zip(axes[0], panels):
    sub = sorted(_adamw_rows(run, tokens), key=lambda r: (r["k"], r["n"]))
    keys = [(k, name) for k, name in series if all(k in r for r in sub)]
    width = 0.8 / len(keys)
    xs = range(len(sub))
    for offset, (key, name) in enumerate(keys):
      ax.bar([x + (offset - (len(keys) - 1) / 2) * width for x in xs],
             [r[key]["ms"] / r["gemm"]["ms"] for r in sub], width=width,
             label=name)
    if any(k == "fused_mosaic" for k, _ in keys):
      goal = KERNEL_TARGETS["Mosaic"]["over_gemm"]
      ax.axhline(goal, color="k", linestyle="--", linewidth=1)
      ax.text(len(sub) - 0.5, goal + 0.03, f"Mosaic target {goal:g}x",
              ha="right", fontsize=7)
    ax.set_xticks(list(xs), [f"{r['k']}x{r['n']}" for r in sub], rotation=30,
                  fontsize=8)
    ax.set_title(f"AdamW, T = {tokens} (commit {_code_commit(run)})", fontsize=9)
    ax.set_ylabel("time / XLA GEMM time")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
  fig.suptitle(f"{panels[0][1]['meta']['device']}, JAX "
               f"{panels[0][1]['meta']['jax_version']}", fontsize=10)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  os.makedirs(PLOTS, exist_ok=True)
  path = os.path.join(PLOTS, "kernel_speed.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.path.relpath(path, ROOT)


def replace_section(text: str, name: str, body: str) -> str:
  pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
  if not pattern.search(text):
    raise ValueError(f"README has no section {name!r}")
  return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main():
  readme_path = os.path.join(ROOT, "README.md")
  with open(readme_path) as f:
    text = f.read()
  mosaic_runs, triton_runs = _kernel_runs()
  if mosaic_runs or triton_runs:
    plot = kernel_plot(mosaic_runs, triton_runs)
    text = replace_section(text, "kernel-perf",
                           kernel_perf_section(mosaic_runs, triton_runs, plot))
    text = replace_section(text, "kernel-checks",
                           kernel_checks_section(mosaic_runs, triton_runs))
  model_runs = [_as_default_run(r) for r in _load("model_memory_*.json")]
  body = model_memory_table(model_runs)
  plot = model_memory_plot(model_runs) if model_runs else None
  if plot:
    body = f"![peak memory per run]({plot})\n\n" + body
  text = replace_section(text, "model-memory", body)
  text = replace_section(text, "memory-sweep",
                         memory_sweep_table(_load("memory_sweep_*.json")))
  text = replace_section(text, "capacity-sweep",
                         capacity_section(_load("capacity_*.json")))
  with open(readme_path, "w") as f:
    f.write(text)
  print(f"README regenerated from {RESULTS}")


if __name__ == "__main__":
  main()
