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
  with open(readme_path, "w") as f:
    f.write(text)
  print(f"README regenerated from {RESULTS}")


if __name__ == "__main__":
  main()
