"""Regenerate the README's result tables and plots from benchmarks/results/.

Tables sit between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` markers;
nothing inside them is typed by hand. Run after adding results:

  python benchmarks/make_readme.py
"""

from __future__ import annotations

import glob
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PLOTS = os.path.join(ROOT, "benchmarks", "plots")


def _load(pattern):
  runs = []
  for path in sorted(glob.glob(os.path.join(RESULTS, pattern))):
    with open(path) as f:
      data = json.load(f)
    data["_file"] = os.path.relpath(path, ROOT)
    runs.append(data)
  return runs


def _latest_kernel_run():
  runs = [r for r in _load("kernel_*.json") if r.get("bench")]
  if not runs:
    return None
  return max(runs, key=lambda r: r["meta"]["date"])


def _provenance(run) -> str:
  meta = run["meta"]
  return (f"{meta['device']}, JAX {meta['jax_version']}, commit "
          f"`{meta['commit'][:10]}`, {meta['date'][:10]}; from "
          f"`{run['_file']}`")


def kernel_table(run) -> str:
  lines = [
      "| optimizer | K x N | T | XLA dW GEMM (ms) | GEMM + optax (ms) | "
      "FORGE fused (ms) | fused / GEMM | unfused / fused |",
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
  lines.append(f"- {_provenance(run)}. Device time from the JAX profiler "
               "(sum of kernel durations per call, median of repeats).")
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


def model_memory_table(runs) -> str:
  """Peak memory and step time per (config, batch, seq), optax beside FORGE."""
  if not runs:
    return "_No whole-model run recorded yet._"
  gib = lambda b: b / 2**30
  lines = ["| model | B x T | variant | weights / states | peak memory (GiB) | "
           "compiled temp (GiB) | step (ms) |", "|---|---|---|---|---|---|---|"]
  for r in sorted(runs, key=lambda r: (r["config"], r["batch"], r["seq"],
                                       r["variant"] != "optax")):
    lines.append(
        f"| {r['config']} ({r['num_layers']} layers) | {r['batch']} x {r['seq']} | "
        f"{r['variant']} | bf16{' + SR' if r.get('weight_rounding') == 'stochastic' else ''}"
        f" / {r.get('state_dtype', 'bfloat16').replace('bfloat16', 'bf16')} | "
        f"{gib(r['peak_bytes_in_use']):.2f} | "
        f"{gib(r['compiled_temp_bytes']):.2f} | {r['step_ms_median']:.1f} |")
  lines.append("")
  grads = {(r["config"], r["batch"], r["seq"]): r["projection_kernel_bytes"]
           for r in runs}
  for key, kernel_bytes in sorted(grads.items()):
    # Same weight and state precision on both sides.
    pair = {r["variant"]: r for r in runs
            if (r["config"], r["batch"], r["seq"]) == key
            and r.get("state_dtype", "bfloat16") == "bfloat16"}
    if {"optax", "forge"} <= set(pair):
      saved = pair["optax"]["peak_bytes_in_use"] - pair["forge"]["peak_bytes_in_use"]
      lines.append(
          f"- {key[0]}, B = {key[1]}, T = {key[2]}: FORGE saves "
          f"{gib(saved):.2f} GiB of peak memory, "
          f"{100 * saved / kernel_bytes:.0f}% of the "
          f"{gib(kernel_bytes):.2f} GiB that the projection kernels' bf16 "
          f"gradients take; step time {pair['forge']['step_ms_median'] / pair['optax']['step_ms_median']:.2f}x optax's.")
  meta = runs[0]["meta"]
  commits = ", ".join(sorted({f"`{r['meta']['commit'][:7]}`" for r in runs}))
  lines.append(f"- {meta['device']}, JAX {meta['jax_version']}, commits "
               f"{commits}; AdamW, scan over layers "
               "with remat; one process per row; `benchmarks/model_memory.py` "
               "(`--state-dtype int8 --weight-rounding stochastic` for the "
               "int8 row).")
  return "\n".join(lines)


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


_STATES = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}


def _capacity_label(spec: dict) -> str:
  weights = "bf16 + SR" if spec.get("weight_rounding") == "stochastic" else "bf16"
  states = _STATES.get(spec.get("state_dtype"), spec.get("state_dtype"))
  kind = "FORGE" if spec.get("forge") else "nn.Dense + optax"
  return f"{kind}, {weights} / {states}"


def _first_failure(r: dict, run: dict) -> str:
  if r.get("first_failure_batch"):
    failed = next((p for p in r["points"]
                   if p["batch"] == r["first_failure_batch"]), {})
    what = {"oom": "out of memory"}.get(r["first_failure"], r["first_failure"])
    if r["first_failure"] != "oom" and failed.get("message"):
      message = failed["message"].splitlines()[0].replace("|", "/")
      what += f" ({message[:60]}{'...' if len(message) > 60 else ''})"
    return f"{r['first_failure_batch']}: {what}"
  if not r.get("complete", True):
    return "not reached (time budget)"
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
    lines.append(
        f"| {variant} | {_capacity_label(run['variants'][variant])} | "
        f"{r['max_batch'] or 'none'} | {speeds or '-'} | "
        f"{f'{gib(peak):.2f}' if peak else '-'} | {_first_failure(r, run)} |")
  meta = run["meta"]
  if run.get("mem_cap_gib"):
    cap = f"XLA allocator capped at {run['mem_cap_gib']:g} GiB per process"
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
  lines.append(f"- {meta['device']} x {meta['num_devices']}, JAX "
               f"{meta['jax_version']}, commit `{meta['commit'][:10]}`, "
               f"{meta['date'][:10]}; `{run['_file']}`.")
  return "\n".join(lines)


def capacity_section(runs) -> str:
  """Every capacity sweep, newest first."""
  if not runs:
    return "_No capacity sweep recorded yet._"
  runs = sorted(runs, key=lambda r: r["meta"]["date"], reverse=True)
  return "\n\n".join(capacity_table(r) for r in runs)


def kernel_plot(run) -> str | None:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  rows = [r for r in run["bench"] if r["optimizer"] == "adamw"]
  token_counts = sorted({r["tokens"] for r in rows})
  fig, axes = plt.subplots(1, len(token_counts), figsize=(5 * len(token_counts), 4),
                           squeeze=False)
  for ax, tokens in zip(axes[0], token_counts):
    sub = [r for r in rows if r["tokens"] == tokens]
    labels = [f"{r['k']}x{r['n']}" for r in sub]
    xs = range(len(sub))
    for offset, (key, name) in enumerate(
        (("gemm", "XLA GEMM"), ("unfused", "GEMM + optax"), ("fused", "FORGE fused"))):
      ax.bar([x + (offset - 1) * 0.27 for x in xs],
             [r[key]["ms"] / r["gemm"]["ms"] for r in sub], width=0.27, label=name)
    ax.set_xticks(list(xs), labels, rotation=30, fontsize=8)
    ax.set_title(f"AdamW, T = {tokens}")
    ax.set_ylabel("time / XLA GEMM time")
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"{run['meta']['device']}, JAX {run['meta']['jax_version']}")
  fig.tight_layout()
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
  run = _latest_kernel_run()
  if run is not None:
    body = kernel_table(run)
    plot = kernel_plot(run)
    if plot:
      body = f"![fused vs unfused]({plot})\n\n" + body
    text = replace_section(text, "kernel-perf", body)
    checks_run = max((r for r in _load("kernel_*.json") if r.get("checks")),
                     key=lambda r: r["meta"]["date"], default=None)
    if checks_run is not None:
      text = replace_section(text, "kernel-checks", check_table(checks_run))
  text = replace_section(text, "model-memory",
                         model_memory_table(_load("model_memory_*.json")))
  text = replace_section(text, "memory-sweep",
                         memory_sweep_table(_load("memory_sweep_*.json")))
  text = replace_section(text, "capacity-sweep",
                         capacity_section(_load("capacity_*.json")))
  with open(readme_path, "w") as f:
    f.write(text)
  print(f"README regenerated from {RESULTS}")


if __name__ == "__main__":
  main()
