"""Write the benchmark tables and plots from ``benchmarks/results/``.

  python benchmarks/make_docs.py

Writes ``docs/benchmarks.md`` whole, the README's results table (between
``<!-- BEGIN results -->`` and ``<!-- END results -->``) and its main-job
line (``main-job`` markers), and the plots in ``benchmarks/plots/``. Nothing
in them is typed by hand. Every table takes the newest run (by the date its
metadata records) of each configuration; a result file that no table uses
does not belong in ``benchmarks/results/`` (``used_results`` names the
others).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PLOTS = os.path.join(ROOT, "benchmarks", "plots")
README = os.path.join(ROOT, "README.md")
BENCHMARKS_MD = os.path.join(ROOT, "docs", "benchmarks.md")

GIB = 2**30
STATES = {
  "float32": "fp32",
  "bfloat16": "bf16",
  "float16": "fp16",
  "int8": "int8",
}
#: Mosaic diagnosis variants of the shipped schedules, in column order.
SCHEDULE_VARIANTS = {
  "inline-steps5": "inline",
  "pingpong-steps4-slots3": "pingpong",
  "inline-steps5-rule-free": "inline, no rule arithmetic",
  "inline-steps5-sgd": "inline, plain SGD",
}
#: Counter probes of the shipped schedules, of each state storage in its
#: default config, and of XLA's kernels.
SHIPPED_PROBES = (
  "gemm",
  "unfused",
  "inline",
  "pingpong",
  "wide",
  "bf16",
  "int8",
)
#: How docs/benchmarks.md links the plots.
PLOT_LINK = "../benchmarks/plots/"
#: layer_step.py's variant without FORGE's per-layer bookkeeping.
KERNEL_ONLY = "mosaic-kernel-only"
#: layer_step.py's Mosaic variant whose TrainState records no gradient norm.
UNTRACKED = "mosaic-untracked"
_COMMIT_IN_NAME = re.compile(r"_([0-9a-f]{7,40})\.(json|txt)$")


# ---------------------------------------------------------------------------
# Loading and provenance.


def load(pattern: str, results: str = RESULTS) -> list:
  """Every result file matching ``pattern``, each with its path in ``_file``."""
  runs = []
  for path in sorted(glob.glob(os.path.join(results, pattern))):
    with open(path) as f:
      run = json.load(f)
    run["_file"] = (
      os.path.relpath(path, ROOT) if path.startswith(ROOT) else path
    )
    runs.append(run)
  return runs


def meta(run) -> dict:
  return run.get("meta") or {
    "device": run.get("device", run.get("backend")),
    "jax_version": run.get("jax_version"),
    "commit": run.get("commit", ""),
    "date": "",
  }


def commit(run) -> str:
  """The commit that ran: the one the file name carries (``run.py`` names
  files by it), else the one its metadata recorded."""
  match = _COMMIT_IN_NAME.search(run["_file"])
  return match.group(1)[:7] if match else meta(run)["commit"][:7]


def date(run) -> str:
  return meta(run)["date"][:10]


def provenance(runs) -> str:
  """One line per distinct file: device, JAX, commit, date, file."""
  seen, lines = set(), []
  for run in sorted(runs, key=lambda r: r["_file"]):
    if run["_file"] in seen:
      continue
    seen.add(run["_file"])
    m = meta(run)
    device = m["device"] + (
      f" x {m['num_devices']}" if m.get("num_devices", 1) > 1 else ""
    )
    when = f", {date(run)}" if date(run) else ""
    lines.append(
      f"- {device}, JAX {m['jax_version']}, commit "
      f"`{commit(run)}`{when}: `{run['_file']}`"
    )
  return "\n".join(lines)


def newest(runs, key) -> dict:
  """``{key(run): the newest run with that key}``."""
  latest = {}
  for run in runs:
    k = key(run)
    if k not in latest or meta(run)["date"] > meta(latest[k])["date"]:
      latest[k] = run
  return latest


def table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def section(title, intro, body, command, runs) -> str:
  return (
    f"## {title}\n\n{intro}\n\n{body}\n\nReproduce: `{command}`\n\n"
    f"{provenance(runs)}\n"
  )


# ---------------------------------------------------------------------------
# The whole train step: peak memory and step time (model_memory.py).


def xla_flags(run) -> str:
  return meta(run).get("xla_flags", "")


def precision(run) -> str:
  weights = STATES[run.get("param_dtype", "bfloat16")]
  if run.get("weight_rounding") == "stochastic":
    weights += " + SR"
  states = STATES[run.get("state_dtype", "bfloat16")]
  if run.get("second_moment_bits") == 4:
    states += " + 4-bit v"
  if run.get("forge_embedding"):
    states += " (FORGE embedding)"
  elif run.get("optax_storage"):
    states += " (embedding too)"
  return f"{weights} / {states}"


def device_name(run) -> str:
  """The run's GPU, short: ``H200`` for ``NVIDIA H200``, ``H100`` for
  ``NVIDIA H100 80GB HBM3``."""
  return meta(run)["device"].removeprefix("NVIDIA ").split()[0]


def main_device(runs) -> str:
  """The device of most runs: the one the README's table and the plot
  show (a step time is compared only with one of the same device)."""
  names = [device_name(r) for r in runs]
  return max(sorted(set(names)), key=names.count)


def step_key(run) -> tuple:
  """What makes two whole-step runs the same measurement."""
  return (
    run["config"],
    run["variant"],
    run["batch"],
    run["seq"],
    precision(run),
    run.get("attention") or "xla",
    run.get("remat_policy"),
    json.dumps(run.get("mosaic_config"), sort_keys=True),
    xla_flags(run),
    run.get("implementation", "auto"),
    device_name(run),
  )


def _step_sort(run):
  return (
    device_name(run),
    run["config"],
    run["batch"],
    run["seq"],
    run["variant"] != "optax",
    (run.get("attention") or "xla") != "xla",
    run.get("state_dtype") == "int8",
    run.get("remat_policy") or "",
    xla_flags(run),
    json.dumps(run.get("mosaic_config")),
    meta(run)["date"],
  )


def step_variant(run) -> str:
  name = "FORGE" if run["variant"] == "forge" else "optax"
  if run.get("remat_policy"):
    name += f", remat policy `{run['remat_policy']}`"
  if run.get("mosaic_config"):
    name += f", Mosaic config `{json.dumps(run['mosaic_config'])}`"
  if xla_flags(run):
    name += f", `XLA_FLAGS={xla_flags(run)}`"
  if run.get("implementation", "auto") != "auto":
    name += f", implementation `{run['implementation']}`"
  return name


def is_default(run) -> bool:
  """Full remat, 'auto' kernels with their own configs, XLA's flags."""
  return (
    not (run.get("remat_policy") or run.get("mosaic_config") or xla_flags(run))
    and run.get("implementation", "auto") == "auto"
  )


def step_pairs(runs) -> list:
  """(optax, FORGE) runs of the same model, B, T, attention, remat policy,
  XLA flags and device: the newest of each."""
  latest = sorted(newest(runs, step_key).values(), key=_step_sort)
  same = lambda o, f: all(
    step_key(o)[i] == step_key(f)[i] for i in (0, 2, 3, 5, 6, 8, 10)
  )
  return [
    (o, f)
    for f in latest
    if f["variant"] == "forge"
    for o in latest
    if o["variant"] == "optax" and same(o, f)
  ]


def readme_table(runs) -> str:
  """The README's one table: default Llama-3.1-8B runs on the main device,
  FORGE beside optax (the layers' options, such as a FORGE embedding, and
  other devices in docs/benchmarks.md)."""
  device = main_device(runs)
  rows = []
  for o, f in step_pairs(runs):
    if (
      device_name(f) != device
      or f["config"] != "llama-3.1-8b"
      or not is_default(f)
      or f.get("forge_embedding")
    ):
      continue
    rows.append(
      [
        f"{f['batch']} x {f['seq']}",
        precision(f),
        "cuDNN" if f.get("attention") == "cudnn" else "XLA",
        f"{f['peak_bytes_in_use'] / GIB:.1f} / {o['peak_bytes_in_use'] / GIB:.1f}",
        f"{f['step_ms_median']:.0f} / {o['step_ms_median']:.0f}",
      ]
    )
  m = meta(next(r for r in runs if device_name(r) == device))
  return (
    table(
      [
        "batch x tokens",
        "FORGE weights / states",
        "attention",
        "peak GiB: FORGE / optax",
        "step ms: FORGE / optax",
      ],
      rows,
    )
    + f"\n\nLlama-3.1-8B shape, AdamW, one {m['device']}; optax with "
    "bf16 weights and states. The newest run of each configuration; all "
    "runs: [docs/benchmarks.md](docs/benchmarks.md)."
  )


def step_section(runs) -> str:
  latest = sorted(newest(runs, step_key).values(), key=_step_sort)
  rows = [
    [
      device_name(r),
      f"{r['config']} ({r['num_layers']} layers)",
      r["batch"],
      r["seq"],
      step_variant(r),
      precision(r),
      r.get("attention") or "xla",
      f"{r['peak_bytes_in_use'] / GIB:.2f}"
      + ("*" if r.get("compiled_before_state") else ""),
      f"{r['compiled_argument_bytes'] / GIB:.2f}",
      f"{r['compiled_temp_bytes'] / GIB:.2f}",
      f"{r['step_ms_median']:.1f} ({len(r['step_ms_all'])})",
      f"`{commit(r)}`",
    ]
    for r in latest
  ]
  body = table(
    [
      "device",
      "model",
      "B",
      "T",
      "variant",
      "weights / states",
      "attention",
      "peak (GiB)",
      "arguments (GiB)",
      "compiled temp (GiB)",
      "step ms (median of n)",
      "commit",
    ],
    rows,
  )
  pairs = []
  for o, f in step_pairs(runs):
    saved = o["peak_bytes_in_use"] - f["peak_bytes_in_use"]
    share = (
      f" ({100 * saved / f['projection_kernel_bytes']:.0f} % of "
      f"{f['projection_kernel_bytes'] / GIB:.2f})"
      if precision(f) == precision(o)
      else ""
    )
    pairs.append(
      [
        device_name(f),
        step_variant(f).replace("FORGE", f["config"], 1),
        f"{f['batch']} x {f['seq']}",
        f.get("attention") or "xla",
        precision(f),
        f"{o['step_ms_median'] / f['step_ms_median']:.3f}",
        f"{f['peak_bytes_in_use'] / o['peak_bytes_in_use']:.2f}",
        f"{saved / GIB:.2f}{share}",
      ]
    )
  body += (
    "\n\nFORGE beside optax (same model, B x T, attention, remat policy, "
    "XLA flags and device):\n\n"
    + table(
      [
        "device",
        "model",
        "B x T",
        "attention",
        "FORGE weights / states",
        "optax step / FORGE step",
        "FORGE peak / optax peak",
        "peak saved (GiB; % of the projection kernels' gradients)",
      ],
      pairs,
    )
  )
  return section(
    "Whole train step (one GPU)",
    "The package's Llama-style model, scan over layers with remat, AdamW, "
    "bf16 weights; each run in a fresh process. Peak: `memory_stats()` "
    "`peak_bytes_in_use`; arguments: the compiled step's argument bytes "
    "(weights, optimizer states and the batch: what stays resident between "
    "steps, a floor under the peak). A peak marked * is a run that "
    "compiled the step from the state's shapes before creating it: XLA's "
    "autotuner allocates buffers while compiling (1.32 GiB at the 8B shape), "
    "which otherwise sit on top of the resident state and can set a FORGE "
    "peak at 512 tokens. Step time: the median of the timed "
    "steps after two warm-up steps. A ratio within a few hundredths of 1 is "
    "a tie: one configuration's step time moves by a few percent between "
    "machines.",
    f"![peak memory]({PLOT_LINK}model_memory.png)\n\n{body}",
    "python benchmarks/run.py step  # --seq, --batch, --int8 "
    "(--second-moment-bits 4), --optax-storage, --forge-embedding, "
    "--attention cudnn, --remat-policy, --xla-flags, --config select the rows",
    latest,
  )


def step_plot(plt, runs):
  """Peak memory of the newest default 8B run of each configuration on the
  main device."""
  device = main_device(runs)
  rows = [
    r
    for r in sorted(newest(runs, step_key).values(), key=_step_sort)
    if r["config"] == "llama-3.1-8b"
    and is_default(r)
    and device_name(r) == device
  ]
  fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 4))
  for i, r in enumerate(rows):
    peak = r["peak_bytes_in_use"] / GIB
    color = (
      "tab:gray"
      if r["variant"] == "optax"
      else "tab:green"
      if r.get("state_dtype") == "int8"
      else "tab:blue"
    )
    ax.bar(i, peak, color=color)
    ax.text(i, peak + 0.5, f"{peak:.1f}", ha="center", fontsize=8)
  ax.set_xticks(
    range(len(rows)),
    [
      f"{'FORGE' if r['variant'] == 'forge' else 'optax'}\n{precision(r)}\n"
      f"B={r['batch']} T={r['seq']}\n{r.get('attention') or 'xla'} attn."
      for r in rows
    ],
    fontsize=7,
  )
  ax.set_ylabel("peak memory (GiB)")
  ax.set_title(
    f"Llama-3.1-8B train step, one {meta(rows[0])['device']}: gray "
    "nn.Dense + optax, blue FORGE bf16 states, green FORGE int8 "
    "states",
    fontsize=8,
  )
  _save(fig, "model_memory.png")


# ---------------------------------------------------------------------------
# The fused update against XLA's GEMM and GEMM + optax (kernel_bench.py).


def kernel_rows(runs) -> list:
  """The newest row of each (optimizer, K, N, T) over the kernel runs."""
  rows = [dict(r, _run=run) for run in runs for r in run.get("bench") or []]
  key = lambda r: (r["optimizer"], r["k"], r["n"], r["tokens"])
  latest = newest([dict(r, meta=meta(r["_run"])) for r in rows], key)
  order = {"adamw": 0, "sgd_momentum": 1, "lion": 2}
  return sorted(
    latest.values(),
    key=lambda r: (r["tokens"], order.get(r["optimizer"], 9), r["k"], r["n"]),
  )


def traffic_bound(row) -> dict:
  """What one AdamW row allows at best. The fused kernel must move W and its
  state in and out (``2 x weight_and_state_bytes``); optax's update moves
  those bytes and reads the gradient. Timed at the bandwidth optax's update
  reached in the same run ((GEMM + optax) - GEMM), that traffic alone takes
  ``traffic`` ms; a fused kernel takes at least ``max(GEMM, traffic)`` (all
  traffic hidden under tensor-core work) and, without overlap, ``GEMM +
  traffic``. x and dy (read once a tile, mostly from L2) are left out."""
  params = row["k"] * row["n"]
  fused_bytes = 2 * row["fused_memory"]["weight_and_state_bytes"]
  gemm, unfused = row["gemm"]["ms"], row["unfused"]["ms"]
  bandwidth = (fused_bytes + 4 * params) / (unfused - gemm)  # bytes / ms
  traffic = fused_bytes / bandwidth
  bound = max(gemm, traffic)
  mosaic = row["fused_mosaic"]["ms"]
  return {
    "tb_per_s": bandwidth / 1e9,
    "bound_over_gemm": bound / gemm,
    "best_speedup": unfused / bound,
    "mosaic_over_bound": mosaic / bound,
    "mosaic_over_serial": mosaic / (gemm + traffic),
    "bytes_per_param": fused_bytes / params,
  }


def kernel_section(runs) -> str:
  rows = kernel_rows(runs)
  ms = lambda r, key: f"{r[key]['ms']:.3f}" if key in r else "-"
  ratio = lambda r, key: f"{r[key]:.2f}" if key in r else "-"
  body = table(
    [
      "optimizer",
      "K x N",
      "T",
      "XLA dW GEMM (ms)",
      "GEMM + optax (ms)",
      "Triton (ms)",
      "Mosaic (ms)",
      "Triton / GEMM",
      "Mosaic / GEMM",
      "unfused / Triton",
      "unfused / Mosaic",
      "commit",
    ],
    [
      [
        r["optimizer"],
        f"{r['k']} x {r['n']}",
        r["tokens"],
        ms(r, "gemm"),
        ms(r, "unfused"),
        ms(r, "fused"),
        ms(r, "fused_mosaic"),
        ratio(r, "fused_over_gemm"),
        ratio(r, "mosaic_over_gemm"),
        ratio(r, "unfused_over_fused"),
        ratio(r, "unfused_over_mosaic"),
        f"`{commit(r['_run'])}`",
      ]
      for r in rows
    ],
  )
  bounds = []
  for tokens in sorted({r["tokens"] for r in rows}):
    adamw = [
      r
      for r in rows
      if r["tokens"] == tokens
      and r["optimizer"] == "adamw"
      and "fused_mosaic" in r
    ]
    if not adamw:
      continue
    b = [traffic_bound(r) for r in adamw]
    med = lambda key, rs=adamw: statistics.median(r[key] for r in rs)
    bmed = lambda key, b=b: statistics.median(x[key] for x in b)
    bounds.append(
      [
        tokens,
        f"{med('mosaic_over_gemm'):.2f}",
        f"{med('fused_over_gemm'):.2f}",
        f"{med('unfused_over_mosaic'):.2f}",
        f"{bmed('bytes_per_param'):.0f}",
        f"{bmed('tb_per_s'):.2f}",
        f"{bmed('bound_over_gemm'):.2f}",
        f"{bmed('best_speedup'):.2f}",
        f"{bmed('mosaic_over_serial'):.2f}",
      ]
    )
  body += (
    "\n\nMedians over the AdamW shapes, and the traffic bound: the fused "
    "kernel's W and state bytes timed at the bandwidth optax's update "
    "reached in the same run. A kernel that hid all of that traffic under "
    "its GEMM would take max(GEMM, traffic) (`best`); one that hides none "
    "takes GEMM + traffic (`traffic_bound` in `benchmarks/make_docs.py`):"
    "\n\n"
    + table(
      [
        "T",
        "Mosaic / GEMM",
        "Triton / GEMM",
        "unfused / Mosaic",
        "fused bytes a parameter",
        "optax's update (TB/s)",
        "best / GEMM",
        "unfused / best",
        "Mosaic / (GEMM + traffic)",
      ],
      bounds,
    )
  )
  return section(
    "Fused update speed (one GPU)",
    "One update at the weight shapes of Llama-3.1-8B: bf16 x and dY, "
    "float32 W and state. XLA's dW GEMM alone, the GEMM followed by the "
    "jitted, donated optax update (the two-phase step), and FORGE's two "
    "kernels with their default configs, side by side in one process. "
    "Device time from the JAX profiler (kernel durations per call, median "
    "of repeats). The newest measurement of each row.",
    f"![fused against unfused]({PLOT_LINK}kernel_speed.png)\n\n{body}",
    "python benchmarks/run.py kernel  # --tokens 2048 8192; --full: "
    "Triton up to T = 32768",
    [r["_run"] for r in rows],
  )


def kernel_plot(plt, runs):
  """Time over the GEMM's per AdamW shape and T."""
  rows = kernel_rows(runs)
  panels = sorted({r["tokens"] for r in rows if "fused_mosaic" in r})
  series = (
    ("gemm", "XLA GEMM"),
    ("unfused", "GEMM + optax"),
    ("fused", "Triton"),
    ("fused_mosaic", "Mosaic"),
  )
  fig, axes = plt.subplots(
    1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False
  )
  for ax, tokens in zip(axes[0], panels):
    sub = [
      r for r in rows if r["tokens"] == tokens and r["optimizer"] == "adamw"
    ]
    width = 0.8 / len(series)
    for i, (key, name) in enumerate(series):
      ax.bar(
        [x + (i - 1.5) * width for x in range(len(sub))],
        [r[key]["ms"] / r["gemm"]["ms"] for r in sub],
        width=width,
        label=name,
      )
    ax.set_xticks(
      range(len(sub)),
      [f"{r['k']}x{r['n']}" for r in sub],
      rotation=30,
      fontsize=8,
    )
    ax.set_title(f"AdamW, T = {tokens}", fontsize=9)
    ax.set_ylabel("time / XLA GEMM time")
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"{meta(rows[0]['_run'])['device']}", fontsize=10)
  _save(fig, "kernel_speed.png")


def checks_section(runs) -> str:
  """Each kernel's newest check of each optimizer against the reference."""
  checks = [
    {"kernel": "TritonConfig", **c, "_run": run, "meta": meta(run)}
    for run in runs
    for c in run.get("checks") or []
    if "error" not in c
  ]
  latest = newest(
    checks, lambda c: (c["kernel"], c["optimizer"], c["k"], c["n"])
  )
  rows = [
    [
      c["kernel"].replace("Config", ""),
      c["optimizer"],
      f"{c['k']} x {c['n']}",
      c["tokens"],
      f"{c['update_rel_err']:.1e}",
      f"{max(c['state_rel_err'].values()):.1e}" if c["state_rel_err"] else "-",
      f"{c['skipped']} / {c['ref_skipped']}",
      "yes" if c["finite"] else "no",
      f"`{commit(c['_run'])}`",
    ]
    for c in sorted(latest.values(), key=lambda c: c["kernel"])
  ]
  return section(
    "Kernel correctness on the GPU",
    "One update from a non-trivial state, each kernel against the XLA "
    "reference: ‖a − b‖ / ‖b‖ of the update (new W − old W) and of each "
    "state leaf. `adamw_nan_column` puts a NaN in one column of x, so one "
    "row of dW is not finite: those elements keep their weight and state "
    "and are counted as skipped.",
    table(
      [
        "kernel",
        "optimizer",
        "K x N",
        "T",
        "update rel. error",
        "worst state rel. error",
        "skipped: kernel / reference",
        "finite",
        "commit",
      ],
      rows,
    ),
    "python benchmarks/run.py kernel",
    [c["_run"] for c in latest.values()],
  )


# ---------------------------------------------------------------------------
# The Mosaic schedules, hardware counters, low-precision bits.


def schedules_section(runs) -> str:
  """Per shape and T, the newest diagnosis run that timed a shipped schedule."""
  rows = [
    dict(r, _run=run, meta=meta(run))
    for run in runs
    for r in run.get("bench") or []
    if any(f"{name}_ms" in r for name in SCHEDULE_VARIANTS)
  ]
  latest = newest(rows, lambda r: (r["k"], r["n"], r["tokens"]))
  cell = lambda r, name: f"{r[name + '_ms']:.3f}" if name + "_ms" in r else "-"
  body = table(
    [
      "K x N",
      "T",
      "GEMM",
      "GEMM + optax",
      *SCHEDULE_VARIANTS.values(),
      "commit",
    ],
    [
      [
        f"{r['k']} x {r['n']}",
        r["tokens"],
        cell(r, "gemm"),
        cell(r, "unfused"),
        *(cell(r, name) for name in SCHEDULE_VARIANTS),
        f"`{commit(r['_run'])}`",
      ]
      for r in sorted(latest.values(), key=lambda r: (r["tokens"], r["k"]))
    ],
  )
  return section(
    "Mosaic schedules, bf16 storage (one GPU)",
    "ms per AdamW update with bf16 W, m and v (the whole step's storage). "
    "'no rule arithmetic' loads and stores W and state unchanged; 'plain "
    "SGD' moves W only. 64 tokens is nearly all W / state traffic; the "
    "three shapes there hold the same parameters, with rows 28 KB, 2 KB "
    "and 256 B apart.",
    body,
    "python benchmarks/run.py schedules  # --tokens, --shape K N, "
    "--configs, --extras",
    [r["_run"] for r in latest.values()],
  )


#: Bytes of W, m and v a parameter, by the diagnosis's storage.
ADAM_BYTES = {"bfloat16": 6, "float32": 12}


def kernel_parts_section(runs) -> str:
  """Per GPU, shape and T, the newest diagnosis that timed its first
  config's parts: the main loop alone, the update without its rule's
  arithmetic or its norm sums, and the kernel against its bound."""
  rows = []
  for run in runs:
    for r in run.get("bench") or []:
      timed = [k for k in r if k.endswith("-main-loop_ms")]
      if timed:
        base = timed[0].removesuffix("-main-loop_ms")
        rows.append(dict(r, _run=run, meta=meta(run), _base=base))
  latest = newest(
    rows,
    lambda r: (
      r["meta"]["device"],
      r["storage"],
      r["k"],
      r["n"],
      r["tokens"],
    ),
  )
  cells = []
  for key in sorted(latest):
    r = latest[key]
    base = r["_base"]
    bound = traffic_bound(
      {
        **r,
        "gemm": {"ms": r["gemm_ms"]},
        "unfused": {"ms": r["unfused_ms"]},
        "fused_memory": {
          "weight_and_state_bytes": ADAM_BYTES[r["storage"]] * r["k"] * r["n"]
        },
        "fused_mosaic": {"ms": r[base + "_ms"]},
      }
    )
    ms = lambda name: f"{r[name + '_ms']:.3f}" if name + "_ms" in r else "-"
    cells.append(
      [
        key[0].removeprefix("NVIDIA "),
        STATES[r["storage"]],
        f"{r['k']} x {r['n']}",
        r["tokens"],
        r[base + "_config"]["schedule"],
        ms("gemm"),
        ms("unfused"),
        ms(base),
        ms(base + "-main-loop"),
        ms(base + "-rule-free"),
        ms(base + "-no-norm-sums"),
        ms(base + "-sgd"),
        f"{r[base + '-main-loop_ms'] / r['gemm_ms']:.2f}",
        f"{bound['mosaic_over_bound']:.2f}",
      ]
    )
  return section(
    "Where the fused kernel's time goes",
    "ms per AdamW update with bf16 or float32 W, m and v, through the "
    "kernel's default config for the case or its inline schedule (named), "
    "beside "
    "XLA's `dW` GEMM and the GEMM followed by optax's update, in one "
    "process. The same kernel traced in parts: its main loop alone (the "
    "epilogue loads, updates and stores nothing: the `dW` GEMM inside the "
    "fused kernel), without the "
    "rule's arithmetic (W and state streamed unchanged), without the "
    "per-row sums of squares for the gradient norm, and as plain SGD (W "
    "alone). The bound is max(GEMM, the kernel's W / state traffic at the "
    "bandwidth optax's update reaches in the same run).",
    table(
      [
        "GPU",
        "W / m / v",
        "K x N",
        "T",
        "schedule",
        "XLA dW GEMM",
        "GEMM + optax",
        "fused",
        "main loop",
        "no rule arithmetic",
        "no norm sums",
        "plain SGD",
        "main loop / GEMM",
        "fused / bound",
      ],
      cells,
    ),
    "python benchmarks/run.py parts  # --storage fp32, --shape K N, "
    "--tokens, --configs",
    [r["_run"] for r in latest.values()],
  )


def mosaic_config_name(config: dict) -> str:
  """A Mosaic config, as the tables name it: CTA tile, tokens a step,
  stages, and epilogue buffers a warpgroup with their sub-tile."""
  cta_n = config["tile_n"] * (
    config["compute_wgs"] if config["schedule"] == "inline" else 1
  )
  return (
    f"{config['schedule']} {config['tile_k']} x {cta_n}, "
    f"{config['tile_t']} tokens a step, {config['max_concurrent_steps']} "
    f"stages, {config['epilogue_slots']} buffer"
    + ("s" if config["epilogue_slots"] > 1 else "")
    + f" of {config['epilogue_k']} x {config['epilogue_n']}"
  )


def mosaic_tiles_section(runs) -> str:
  """Each run's cases: the tile shape tried (its diagnosis's first config)
  and its main loop alone, beside XLA's GEMM, the default config and the
  others timed in the same process."""
  cells = []
  runs = sorted(runs, key=lambda run: meta(run)["date"])
  for run in runs:
    for r in sorted(
      run.get("bench") or [], key=lambda r: (r["k"], r["n"], r["tokens"])
    ):
      names = [k.removesuffix("_config") for k in r if k.endswith("_config")]
      timed = [n for n in names if n + "_ms" in r and n != "default"]
      # The tried config is the one timed in parts (its main loop alone).
      base = next((n for n in timed if f"{n}-main-loop_ms" in r), timed[0])
      loop = r.get(f"{base}-main-loop_ms")
      others = [
        f"{mosaic_config_name(r[name + '_config'])}: {r[name + '_ms']:.3f}"
        for name in timed
        if name != base and not name.startswith(base + "-")
      ]
      cells.append(
        [
          device_name(run),
          f"{r['k']} x {r['n']}",
          r["tokens"],
          f"{r['gemm_ms']:.3f}",
          f"{r['default_ms']:.3f} ({r['default_config']['schedule']})"
          if "default_ms" in r
          else "-",
          mosaic_config_name(r[base + "_config"]),
          f"{r[base + '_ms']:.3f}",
          f"{loop:.3f}" if loop else "-",
          f"{loop / r['gemm_ms']:.2f}" if loop else "-",
          "; ".join(others),
          f"`{commit(run)}`",
        ]
      )
  return section(
    "The Mosaic kernel's tiles where its main loop bounds",
    "ms per AdamW update with bf16 W, m and v, in one process per run: a "
    "tile shape tried, and the same kernel with its epilogue loading, "
    "updating and storing nothing (its main loop alone), beside XLA's "
    "`dW` GEMM, the kernel's default config for the case and the other "
    "configs timed in the same process. The default's CTA tiles are "
    "128 x 128 (the inline schedule's two 128 x 64 parts, or a pingpong "
    "warpgroup's tile).",
    table(
      [
        "GPU",
        "K x N",
        "T",
        "XLA dW GEMM",
        "default",
        "tried",
        "fused",
        "its main loop",
        "main loop / GEMM",
        "others",
        "commit",
      ],
      cells,
    ),
    "python benchmarks/run.py tiles  # --shape K N, --tokens, --configs",
    runs,
  )


def instructions_an_element(kernel, run) -> str:
  """A kernel's thread instructions over the layer's K x N elements ('-'
  where the summary has no source counts)."""
  executed = kernel.get("stalls", {}).get("instructions_executed")
  if executed is None:
    return "-"
  return f"{32 * executed / (run['k'] * run['n']):.0f}"


def counters_section(runs) -> str:
  probes = [
    dict(p, _run=run, meta=meta(run))
    for run in runs
    for p in run["probes"]
    if p["name"].split("-")[0] in SHIPPED_PROBES
    and any(k in p for k in ("kernel", "update_kernel", "gemm_kernel"))
  ]
  latest = newest(probes, lambda p: p["name"])
  rows = []
  for p in sorted(latest.values(), key=lambda p: (p["tokens"], p["name"])):
    kernel = p.get("kernel") or p.get("update_kernel") or p["gemm_kernel"]
    what = {"gemm": "XLA's dW GEMM", "unfused": "optax's update fusion"}.get(
      p["what"], "fused Mosaic kernel"
    )
    rows.append(
      [
        p["name"],
        what,
        p["tokens"],
        f"{kernel['duration_us']:.0f}",
        f"{kernel['dram_throughput_pct']:.0f}",
        f"{kernel['issue_slots_busy_pct']:.0f}"
        if "issue_slots_busy_pct" in kernel
        else "-",
        f"{kernel['registers_per_thread']:.0f}",
        f"{kernel['local_memory_spill_requests']:,.0f}",
        instructions_an_element(kernel, p["_run"]),
        device_name(p["_run"]),
        f"`{commit(p['_run'])}`",
      ]
    )
  return section(
    "Hardware counters (Nsight Compute, one GPU)",
    "One launch of each probe at 4096 x 14336, bf16 W, AdamW. The states "
    "are bf16 except in the `int8` probes; `sr` writes W with stochastic "
    "rounding. `passed-through`, `e4m3` and `e4m3-kept` are timing-only "
    "variants of the int8 update (`lowp_breakdown.py`'s: the old codes "
    "stored back; e4m3 codes with power-of-two block scales; those codes "
    "at the old scales, no block maximum). Instructions an element: "
    "thread instructions the kernel executed over K x N (32 a warp "
    "instruction). Stall reasons, per-instruction samples and instructions "
    "by opcode are in the JSON.",
    table(
      [
        "probe",
        "kernel",
        "T",
        "µs",
        "DRAM, % of peak",
        "issue slots busy, %",
        "registers a thread",
        "spill requests",
        "instructions an element",
        "device",
        "commit",
      ],
      rows,
    ),
    "python benchmarks/run.py counters",
    [p["_run"] for p in latest.values()],
  )


def lowp_section(runs) -> str:
  fused = [
    dict(f, _run=run, meta=meta(run))
    for run in runs
    for f in run.get("fused") or []
  ]
  latest = newest(
    fused,
    lambda f: (
      f.get("implementation", "triton"),
      f["optimizer"],
      f["k"],
      f["n"],
      f["tokens"],
    ),
  )

  def encoded(leaves):
    steps = [
      leaf["max_step_distance"]
      for _, leaf in leaves
      if "max_step_distance" in leaf
    ]
    return f"{max(steps):.3f}" if steps else "-"

  rows = []
  for f in latest.values():
    leaves = [
      (path, leaf)
      for step in f["steps"]
      for path, leaf in step["leaves"].items()
    ]
    worst = lambda kind: min(
      (leaf["identical"] for path, leaf in leaves if kind(path)), default=None
    )
    pct = lambda v: "-" if v is None else f"{100 * v:.4f}"
    rows.append(
      [
        f.get("implementation", "triton"),
        f["optimizer"],
        f"{f['k']} x {f['n']}",
        f["tokens"],
        len(f["steps"]),
        pct(worst(lambda p: p == "[0]")),
        pct(worst(lambda p: p.endswith("codes"))),
        pct(worst(lambda p: p.endswith("scale"))),
        max(leaf.get("max_ulp", 0) for _, leaf in leaves),
        encoded(leaves),
        f"`{commit(f['_run'])}`",
      ]
    )
  rows.sort(key=lambda row: (row[0] != "triton", row[1]))
  body = table(
    [
      "kernel",
      "optimizer",
      "K x N",
      "T",
      "steps",
      "weights identical (%)",
      "codes identical (%)",
      "scales identical (%)",
      "largest bf16 ulp apart",
      "codes' values apart (code steps)",
      "commit",
    ],
    rows,
  )
  speed = [dict(s, _run=run) for run in runs for s in run.get("speed") or []]
  kernels = [k for k in ("", "mosaic_") if any(k + "fp32" in s for s in speed)]
  ms = lambda s, key: f"{s[key]['ms']:.3f}" if key in s else "-"
  if speed:
    body += (
      "\n\nAdamW, device time of one update (ms), float32 W and "
      "states against bf16 + SR W and int8 states:\n\n"
      + table(
        [
          "K x N",
          "T",
          *(
            f"{k.rstrip('_') or 'triton'}: {p}"
            for k in kernels
            for p in ("fp32", "bf16 + SR / int8")
          ),
          "commit",
        ],
        [
          [
            f"{s['k']} x {s['n']}",
            s["tokens"],
            *(
              ms(s, k + key)
              for k in kernels
              for key in ("fp32", "bf16_sr_int8")
            ),
            f"`{commit(s['_run'])}`",
          ]
          for s in speed
        ],
      )
    )
  return section(
    "Low-precision storage on the GPU",
    "bf16 weights with stochastic rounding and int8 states: the fraction "
    "of bits identical to the XLA reference after each step (worst step "
    "and leaf), with x and dY chosen so that dW is exact in any summation "
    "order. What differs is the rule's float32 arithmetic (FMA "
    "contraction, approximate division and square root); in interpret "
    "mode every bit matches. A block whose scale moves one grid step "
    "re-rounds all its codes; the values the codes encode (sqrt(v) for "
    "second moments) stay within one code step of the reference's.",
    body,
    "python benchmarks/run.py lowp",
    [f["_run"] for f in latest.values()] + [s["_run"] for s in speed],
  )


# ---------------------------------------------------------------------------
# Memory as the model grows, capacity and exactness under TP, fidelity.


def memory_sweep_section(run) -> str:
  pairs = {}
  for r in run["rows"]:
    pairs.setdefault((r["dim"], r["num_layers"]), {})[r["variant"]] = r
  mib = lambda b: f"{b / 2**20:.1f}"
  return section(
    "Compiled temp memory as the model grows (CPU)",
    "`memory_analysis()` of the compiled, donated train step of the "
    "Llama-style model (float32, scan over layers with remat, XLA "
    "reference backend). optax's temp holds every kernel's stacked "
    "gradient and grows with the parameters; FORGE's stays flat.",
    table(
      [
        "width",
        "layers",
        "kernel bytes (MiB)",
        "optax temp (MiB)",
        "FORGE temp (MiB)",
      ],
      [
        [
          dim,
          layers,
          mib(p["forge"]["kernel_bytes"]),
          mib(p["optax"]["temp_bytes"]),
          mib(p["forge"]["temp_bytes"]),
        ]
        for (dim, layers), p in sorted(pairs.items())
      ],
    ),
    "python benchmarks/run.py memory",
    [run],
  )


def _first_failure(r) -> str:
  if r.get("first_failure_batch"):
    point = next(
      p for p in r["points"] if p["batch"] == r["first_failure_batch"]
    )
    what = {
      "oom": "out of memory",
      "timeout": f"its process ran past {point.get('wall_s', 0):g} s "
      "(not an out-of-memory)",
    }.get(r["first_failure"], r["first_failure"])
    return f"batch {r['first_failure_batch']}: {what}"
  if not r.get("complete", True):
    return (
      "not reached: the sweep's time budget ran out before batch "
      f"{2 * max(p['batch'] for p in r['points'])}"
    )
  return "none"


def capacity_section(run) -> str:
  rows = []
  for variant, r in run["results"].items():
    spec = run["variants"][variant]
    fits = [p for p in r["points"] if p["fits"]]
    largest = r["max_batch"] or "none"
    if (
      r["max_batch"]
      and not r.get("complete", True)
      and not r.get("first_failure_batch")
    ):
      largest = f"≥ {largest}"
    peak = r.get("max_peak_bytes_in_use_at_max_batch")
    weights = (
      "bf16 + SR" if spec.get("weight_rounding") == "stochastic" else "bf16"
    )
    rows.append(
      [
        variant,
        f"{'FORGE' if spec.get('forge') else 'nn.Dense + optax'}, "
        f"{weights} / {STATES[spec['state_dtype']]}",
        largest,
        ", ".join(f"{p['batch']}: {p['tokens_per_s']:,.0f}" for p in fits),
        f"{peak / GIB:.2f}" if peak else "-",
        _first_failure(r),
      ]
    )
  return section(
    "Largest micro-batch under a memory cap (tensor parallel)",
    f"{run['config']} ({run['num_layers']} layers, scanned), T = "
    f"{run['seq']}, TP = {run['tp']}{' with SP' if run.get('sp') else ''}, "
    f"XLA's allocator capped at {run['mem_cap_gib']:g} GiB per process. "
    "Each variant's micro-batch doubles, one fresh process per point, until "
    "the first failure or the sweep's time budget; tokens/s of the TP group "
    f"(micro-batch x T / median of {run['steps']} steps). Embedding and "
    "norms: optax.adamw, bf16 states.",
    table(
      [
        "variant",
        "weights / states",
        "largest micro-batch",
        "tokens/s by micro-batch",
        "peak per GPU at the largest (GiB)",
        "first failure",
      ],
      rows,
    ),
    "python benchmarks/run.py capacity  # two GPUs",
    [run],
  )


def tp_section(run) -> str:
  exact = run["exactness"]
  rows = [
    [
      mode.upper() if mode == "sp" else "no SP",
      f"{exact[mode]['forge_tp_vs_forge_one_device_kernels']:.1e}",
      f"{exact[mode]['optax_tp_vs_optax_one_device_kernels']:.1e}",
      f"{exact[mode]['forge_tp_vs_optax_tp_kernels']:.1e}",
    ]
    for mode in ("nosp", "sp")
  ]
  f, o = run["forge"], run["optax"]
  measured = table(
    ["variant", "per-GPU peak (GiB)", "step ms", "whole-weight all-gathers"],
    [
      [
        name,
        f"{r['max_peak_bytes_in_use'] / GIB:.2f}",
        f"{r['step_ms_median']:.1f}",
        r["whole_weight_all_gathers"],
      ]
      for name, r in (("FORGE", f), ("optax", o))
    ],
  )
  return section(
    "Tensor parallelism against one device",
    f"Exactness: a float32 Llama ({exact['shape']['num_layers']} layers, "
    f"width {exact['shape']['dim']}), {exact['steps']} steps, TP = "
    f"{exact['tp']}: the worst kernel's ‖a − b‖ / ‖b‖.",
    table(
      [
        "",
        "FORGE TP vs FORGE one device",
        "optax TP vs optax one device",
        "FORGE TP vs optax TP",
      ],
      rows,
    )
    + f"\n\nMeasured: {f['config']}, {f['num_layers']} unrolled layers, B = "
    f"{f['batch']}, T = {f['seq']}, TP = {f['tp']}"
    f"{' with SP' if f['sp'] else ''}, bf16:\n\n" + measured,
    "python benchmarks/run.py tp  # two GPUs",
    [run],
  )


def fsdp_section(run) -> str:
  p, f = run["plain"], run["fsdp"]
  rows = [
    [
      name,
      f"{r['max_peak_bytes_in_use'] / GIB:.2f}",
      f"{r['compiled_temp_bytes'] / GIB:.2f}",
      f"{r['step_ms_median']:.1f}",
      ", ".join(f"{k} {v}" for k, v in r["collectives"].items()),
      f"{r['final_loss']:.5f}",
    ]
    for name, r in (("FORGE, no mesh", p), (f"FORGE, FSDP data = {f['dp']}", f))
  ]
  return section(
    "FSDP code path on one GPU",
    f"{p['config']}, {p['num_layers']} layers "
    f"{'(fj.scan)' if p['scan_layers'] else '(unrolled)'}, B = {p['batch']}, "
    f"T = {p['seq']}, bf16 weights and AdamW states, remat: the FSDP path "
    "with a data axis of one device against no mesh, each in its own "
    "process. FSDP / plain: peak "
    f"{run['peak_ratio_fsdp_over_plain']:.4f}, compiled temp "
    f"{run['temp_ratio_fsdp_over_plain']:.4f}, step time "
    f"{run['time_ratio_fsdp_over_plain']:.4f}. The final losses (bf16 "
    "model, 5 steps) agree to "
    f"{abs(p['final_loss'] - f['final_loss']) / abs(p['final_loss']):.1e} "
    "relative; exactness against one device is the float32 tests' "
    "(8 simulated devices).",
    table(
      [
        "variant",
        "peak (GiB)",
        "compiled temp (GiB)",
        "step ms",
        "collectives",
        "final loss",
      ],
      rows,
    ),
    "python benchmarks/run.py fsdp  # one GPU",
    [run],
  )


def ratio(value) -> str:
  """Two decimals, three below 0.1 (where two would hide a 5x spread)."""
  return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def layer_step_compute(run) -> str:
  """The compute (activation) dtypes a one-layer run measured."""
  return ", ".join(run["config"].get("compute", ["bf16"]))


def auto_backend(case) -> str:
  """The backend 'auto' takes for a one-layer case, as its variant is
  named ('mosaic', 'triton', 'xla')."""
  return case["auto"].split(".")[-1].replace("_update", "")


def layer_step_table(run) -> str:
  variants = run["config"]["variants"]
  forge = [v for v in variants if v != "optax"]
  rows = [
    [
      c.get("compute", "bf16"),
      c["storage"],
      c["tokens"],
      f"{c['k']} x {c['n']}",
      f"{c['ms']['optax']:.3f}",
      *(
        ratio(c["speedup"][v]) if v in c.get("speedup", {}) else "-"
        for v in forge
      ),
      auto_backend(c),
    ]
    for c in run["cases"]
  ]
  return table(
    ["compute", "W / m / v", "T", "K x N", "optax ms", *forge, "'auto'"],
    rows,
  )


#: A kernel under this many milliseconds a launch counts as small: a
#: scalar, a reduction of counts or norms, a flag.
SMALL_KERNEL_MS = 0.010


def step_breakdown(profile) -> dict:
  """One profiled step's device time (µs) by kind of kernel: the fused
  update, XLA's GEMMs, other kernels of 10 µs or more a launch, and the
  small ones (with their count)."""
  parts = {"fused": 0.0, "gemm": 0.0, "large": 0.0}
  sorted_launches = 0  # the launches of the three kinds above
  for k in profile["top"]:
    name = k["name"]
    if name.startswith("forge_fused"):
      kind = "fused"
    elif "nvjet" in name or "gemm" in name or "cublas" in name:
      kind = "gemm"
    elif k["ms"] / max(k["launches"], 1) >= SMALL_KERNEL_MS:
      kind = "large"
    else:
      continue
    parts[kind] += k["ms"] * 1e3
    sorted_launches += k["launches"]
  device = profile["device_ms"] * 1e3
  return {
    **parts,
    "device": device,
    "small": device - sum(parts.values()),
    "small_launches": round(profile["kernels_per_call"]) - sorted_launches,
  }


def layer_step_breakdown(run) -> str:
  """Where each profiled case's step goes, optax beside the backend
  'auto' takes."""
  rows = []
  for c in run["cases"]:
    for variant in ("optax", auto_backend(c)):
      if variant not in c.get("profile", {}):
        continue
      b = step_breakdown(c["profile"][variant])
      rows.append(
        [
          c["storage"],
          c["tokens"],
          f"{c['k']} x {c['n']}",
          variant,
          f"{b['device']:.0f}",
          f"{b['gemm']:.0f}",
          f"{b['fused']:.0f}" if b["fused"] else "-",
          f"{b['large']:.0f}",
          f"{b['small']:.0f} ({b['small_launches']})",
        ]
      )
  if not rows:
    return ""
  return (
    "Where one step's device time goes (µs a step, from two profiled "
    "steps of the same run): XLA's GEMMs, the fused update kernel, other "
    "kernels of 10 µs or more a launch (optax's update, the RMSNorm's and "
    "the loss's passes over the activations, float32 weights' "
    "conversions) and the small ones "
    "(their launches in brackets: scalars, flags, the reductions of the "
    "kernel's skipped counts and norm sums).\n\n"
    + table(
      [
        "W / m / v",
        "T",
        "K x N",
        "variant",
        "device",
        "GEMMs",
        "fused kernel",
        "other ≥ 10 µs",
        "small kernels (launches)",
      ],
      rows,
    )
  )


def layer_step_command(run) -> str:
  command = list_flags_command(
    "layer_step.py",
    {"compute": ["bf16"], **run["config"]},
    ("compute", "variants", "shapes", "tokens", "storage"),
  )
  # The profiles the breakdown and kernel columns read.
  return command + " --profile" if run["config"].get("profile") else command


def layer_step_section(runs) -> str:
  """The newest run of each compute dtype and shape set, one table each."""
  newest = {}
  for run in sorted(runs, key=lambda r: meta(r)["date"]):
    newest[layer_step_compute(run), tuple(run["config"]["shapes"])] = run
  kept = [newest[c] for c in sorted(newest)]
  return section(
    "One layer's whole train step",
    "RMSNorm and a bias-free dense layer, sum-of-squares loss, jitted "
    "TrainState step with the state donated, AdamW, in the compute dtype "
    "shown: `fj.ForgeDense` (`fj.TrainState`) with each implementation "
    "against `nn.Dense` + optax (flax's `TrainState`), side by side in one "
    "process (device time, medians). Each FORGE "
    "column is optax's time over the backend's (> 1: faster than optax); "
    "the last column is the backend `'auto'` takes.",
    "\n\n".join(
      part
      for run in kept
      for part in (layer_step_table(run), layer_step_breakdown(run))
      if part
    ),
    "; ".join(layer_step_command(run) for run in kept),
    kept,
  )


def replaced_part_us(case, variant) -> str:
  """What a FORGE variant's fused kernel replaces in optax's step (µs): the
  GEMMs and kernels of 10 µs or more that optax runs and the variant does
  not (the ``dW`` GEMM and the update fusion)."""
  optax = step_breakdown(case["profile"]["optax"])
  forge = step_breakdown(case["profile"][variant])
  replaced = optax["gemm"] - forge["gemm"] + optax["large"] - forge["large"]
  return f"{replaced:.0f}"


#: The leading columns of :func:`bound_row`, before its bounds' ratios.
BOUND_COLUMNS = ["W / m / v", "T", "K x N", "optax ms", "mosaic"]


def bound_row(case, *bounds: str) -> list:
  """A case's cells, optax's step time, and the step time ratios of the
  Mosaic variant and of each of ``bounds``, variants that leave part of
  FORGE's step out or change it."""
  return [
    case["storage"],
    case["tokens"],
    f"{case['k']} x {case['n']}",
    f"{case['ms']['optax']:.3f}",
    ratio(case["speedup"]["mosaic"]),
    *(ratio(case["speedup"][bound]) for bound in bounds),
  ]


def short_name(variant: str) -> str:
  """A Mosaic variant's column name: ``mosaic-kernel-only`` is
  ``kernel-only``."""
  return variant.removeprefix("mosaic-")


def bookkeeping_table(run, bounds: tuple, profiled: tuple) -> str:
  """:func:`bound_row` of each case that ran optax, the Mosaic variant and
  ``bounds``, then the small kernels of the ``profiled`` variants."""
  needed = {"optax", "mosaic", *bounds}
  return table(
    [
      *BOUND_COLUMNS,
      *map(short_name, bounds),
      *(f"{short_name(v)} small µs" for v in profiled),
    ],
    [
      [*bound_row(c, *bounds), *(small_kernels_us(c, v) for v in profiled)]
      for c in run["cases"]
      if needed <= set(c["ms"])
    ],
  )


def rule_free_section(run) -> str:
  """The one-layer step with the Mosaic kernel's rule and without it."""
  rows = []
  for c in run["cases"]:
    if not {"optax", "mosaic", "mosaic-rule-free"} <= set(c["ms"]):
      continue
    profiled = {"optax", "mosaic", "mosaic-rule-free"} <= set(
      c.get("profile", {})
    )
    kernel_us = {
      v: f"{step_breakdown(c['profile'][v])['fused']:.0f}" if profiled else "-"
      for v in ("mosaic", "mosaic-rule-free")
    }
    rows.append(
      [
        *bound_row(c, "mosaic-rule-free"),
        kernel_us["mosaic"],
        kernel_us["mosaic-rule-free"],
        replaced_part_us(c, "mosaic") if profiled else "-",
      ]
    )
  return section(
    "One layer's step with a rule that costs nothing",
    "The one-layer step above (bf16 activations, AdamW) through the Mosaic "
    "kernel, and through the same kernel traced without the optimizer's "
    "arithmetic and the check of its results (`mosaic-rule-free`: W and "
    "its state streamed in and out unchanged, the skipped counts and norm "
    "sums kept; a measurement, not a train step), against `nn.Dense` + "
    "optax in the same process. Ratios are optax's step time over "
    "FORGE's (> 1: faster than optax); the kernel columns are each fused "
    "kernel's device µs a step, beside the µs of optax's kernels that the "
    "fused kernel replaces (its `dW` GEMM and update fusion, from the same "
    "profiles). The rule-free ratio is what a rule that cost nothing would "
    "give the step.",
    table(
      [
        *BOUND_COLUMNS,
        "rule-free",
        "kernel µs",
        "rule-free kernel µs",
        "optax's dW GEMM + update µs",
      ],
      rows,
    ),
    layer_step_command(run),
    [run],
  )


def small_kernels_us(case, variant) -> str:
  """A profiled variant's device µs in kernels under 10 µs a launch, their
  launches in brackets ('-' where the variant was not profiled)."""
  profile = case.get("profile", {})
  if variant not in profile:
    return "-"
  return "{small:.0f} ({small_launches})".format(
    **step_breakdown(profile[variant])
  )


def kernel_only_section(run) -> str:
  """The one-layer step through the Mosaic kernel with FORGE's per-layer
  bookkeeping and without it."""
  return section(
    "One layer's step without FORGE's bookkeeping",
    "The one-layer step above (bf16 activations, AdamW) through the Mosaic "
    "kernel, and through the same kernel with FORGE's per-layer "
    "bookkeeping left out (`mosaic-kernel-only`: the kernel's new W and "
    "state written straight back, with no step count, skip and wipe "
    "checks, gradient norm or install; a measurement, not a train step), "
    "against `nn.Dense` + optax in the same process. Ratios are optax's "
    "step time over FORGE's (> 1: faster than optax): the kernel-only "
    "ratio is what the step would give if that bookkeeping cost nothing. "
    "The last columns are the device µs of each step's kernels under 10 "
    "µs a launch (scalars, flags, reductions), their launches in "
    "brackets.",
    bookkeeping_table(run, (KERNEL_ONLY,), ("optax", "mosaic", KERNEL_ONLY)),
    layer_step_command(run),
    [run],
  )


def untracked_section(run) -> str:
  """The one-layer step through the Mosaic kernel with the gradient norm
  ``fj.TrainState`` records and without it, beside the kernel-only
  bound."""
  return section(
    "One layer's step without the gradient norm",
    "The one-layer step above (bf16 activations, AdamW) through the Mosaic "
    "kernel with `fj.TrainState`'s default, which records the step's "
    "global gradient norm, and with `track_grad_norm=False` "
    "(`mosaic-untracked`), which records none (nor does flax's "
    "`TrainState` under optax), with the kernel-only bound of the section "
    "below from the same run, against `nn.Dense` + optax in the same "
    "process. Ratios are "
    "optax's step time over FORGE's (> 1: faster than optax). The last "
    "columns are the device µs of each step's kernels under 10 µs a "
    "launch, their launches in brackets.",
    bookkeeping_table(
      run, (UNTRACKED, KERNEL_ONLY), ("optax", "mosaic", UNTRACKED)
    ),
    layer_step_command(run),
    [run],
  )


#: Verdicts of :func:`never_slower_section`.
MET, BOUND_BELOW, OPEN = "met", "bound below 1", "open"


def never_slower_verdict(case) -> str:
  """Whether FORGE's default step is at least as fast as optax's (met);
  if not, whether its kernel-only bound is below optax's too (then no change
  outside the fused kernel makes it so) or not (open)."""
  if case["speedup"]["mosaic"] >= 1.0:
    return MET
  return BOUND_BELOW if case["speedup"][KERNEL_ONLY] < 1.0 else OPEN


def with_bound(runs) -> list:
  """The one-layer step runs that measured the kernel-only bound."""
  return [
    r
    for r in runs
    if isinstance(r.get("config"), dict)
    and KERNEL_ONLY in r["config"].get("variants", [])
  ]


def never_slower_cases(runs) -> dict:
  """``{(device, storage, tokens, k, n): the newest case}`` of every
  one-layer case measured beside its kernel-only bound."""
  cases = [
    dict(c, meta=meta(run))
    for run in with_bound(runs)
    for c in run["cases"]
    if {"optax", "mosaic", KERNEL_ONLY} <= set(c["ms"])
  ]
  return newest(
    cases,
    lambda c: (c["meta"]["device"], c["storage"], c["tokens"], c["k"], c["n"]),
  )


def speed_line(runs) -> str:
  """The README's line on one layer's step time against optax's."""
  cases = never_slower_cases(runs).values()
  if not cases:
    return ""
  times = [1 / c["speedup"]["mosaic"] for c in cases]
  met = sum(never_slower_verdict(c) == MET for c in cases)
  return (
    f"- **Speed.** One unrolled layer's step takes {min(times):.2f}-"
    f"{max(times):.2f}x optax's time, no slower in {met} of "
    f"{len(times)} cases ([each](docs/benchmarks.md#never-slower-one-layers"
    "-step-against-its-bound)): bookkeeping and W / state traffic."
  )


def never_slower_section(runs) -> str:
  """Every one-layer case measured with the kernel-only bound, the newest
  measurement of each on each GPU, with its verdict, and the verdicts
  counted per GPU."""
  cases = never_slower_cases(runs)
  runs = with_bound(runs)
  rows, counts = [], {}
  for key in sorted(cases):
    c = cases[key]
    verdict = never_slower_verdict(c)
    device = key[0].removeprefix("NVIDIA ")
    tally = counts.setdefault(device, {MET: 0, BOUND_BELOW: 0, OPEN: 0})
    tally[verdict] += 1
    # Three decimals: the verdicts turn on the third.
    speedups = [c["speedup"].get(v) for v in ("mosaic", UNTRACKED, KERNEL_ONLY)]
    rows.append(
      [
        device,
        *bound_row(c)[:4],
        auto_backend(c),
        *(f"{s:.3f}" if s else "-" for s in speedups),
        verdict,
      ]
    )
  summary = table(
    ["GPU", "cases", MET, BOUND_BELOW, OPEN],
    [
      [device, sum(t.values()), t[MET], t[BOUND_BELOW], t[OPEN]]
      for device, t in counts.items()
    ],
  )
  commands = dict.fromkeys(layer_step_command(r) for r in runs)
  return section(
    "Never slower: one layer's step against its bound",
    "Every case of the one-layer step above (bf16 activations, AdamW) "
    "measured beside its kernel-only bound, the newest measurement of each "
    "on each GPU: FORGE's default step through the Mosaic kernel (the "
    "backend `'auto'` takes, named in the `'auto'` column), with "
    "`track_grad_norm=False` where that run measured it, and the same "
    "kernel with none of FORGE's bookkeeping (`mosaic-kernel-only`). "
    "Ratios are optax's step time over FORGE's (> 1: faster than optax), "
    "from one process per case; a case within about 1 % of 1.000 can land "
    "on either side of it from run to run. *met*: the default step at "
    "least as fast as optax's; *bound below 1*: the kernel alone, with no "
    "bookkeeping, is already slower than optax's step, so no change "
    "outside the fused "
    "kernel can make the step as fast; *open*: the bound is at or above 1 "
    "and the step is not.",
    summary
    + "\n\n"
    + table(
      [
        "GPU",
        *BOUND_COLUMNS[:4],
        "'auto'",
        "mosaic",
        "untracked",
        "kernel-only",
        "verdict",
      ],
      rows,
    ),
    "; ".join(commands),
    runs,
  )


def xla_chunks_section(runs) -> str:
  """The XLA reference's one-layer step in row chunks against whole
  kernels: the newest run of each chunk size, side by side per case."""
  newest = {}
  for run in sorted(runs, key=lambda r: meta(r)["date"]):
    newest[run["config"]["xla_chunk_elements"]] = run
  sizes = sorted(newest)
  cases = {}
  for size in sizes:
    for c in newest[size]["cases"]:
      key = (c["storage"], c["tokens"], c["k"], c["n"])
      cases.setdefault(key, {})[size] = c["ms"]
  whole = sizes[-1]

  def label(size):
    return "whole" if size == whole else f"chunks of 2^{size.bit_length() - 1}"

  rows = [
    [
      storage,
      tokens,
      f"{k} x {n}",
      f"{ms[whole]['optax']:.3f}",
      *(
        f"{ms[size]['xla']:.3f} ({ms[size]['xla'] / ms[whole]['xla']:.2f})"
        if size in ms
        else "-"
        for size in sizes
      ),
    ]
    for (storage, tokens, k, n), ms in sorted(cases.items())
  ]
  return section(
    "The XLA reference in row chunks: one layer's step",
    "The one-layer step of `layer_step.py` (bf16 activations, AdamW) "
    "through `implementation='xla'`, with the reference stepping kernels "
    "past `XLA_CHUNK_ELEMENTS` in row chunks and with whole kernels (a "
    "chunk size past every kernel), one process each on one machine; "
    "device ms (medians), in brackets the ratio to whole kernels. The "
    "chunks bound the update's float32 temporaries to one chunk's "
    "(`tests/test_memory.py`).",
    table(
      ["W / m / v", "T", "K x N", "optax ms", *map(label, sizes)],
      rows,
    ),
    "; ".join(
      layer_step_command(newest[size]) + f" --xla-chunk-elements {size}"
      for size in sizes
    ),
    [newest[size] for size in sizes],
  )


def stacked_gemm_section(run) -> str:
  products = {"fwd": "x @ W[l]", "dx": "dy @ W[l].T"}

  def row(c):
    ms = c["ms"]
    gemm = ms.get("in_place_gemm")
    return [
      c["tokens"],
      f"{c['k']} x {c['n']}",
      f"`{products[c['kind']]}`",
      f"{c['config']['tile_m']} x {2 * c['config']['tile_n']}",
      f"{ms['xla_scan'] * 1e3:.1f}",
      f"{ms['in_place'] * 1e3:.1f}",
      f"{ms['xla_scan'] / ms['in_place']:.2f}",
      f"{ms['xla_gemm'] * 1e3:.1f}",
      "-" if gemm is None else f"{gemm * 1e3:.1f}",
      "-" if gemm is None else f"{gemm / ms['xla_gemm']:.2f}",
    ]

  return section(
    "A stacked layer's GEMM, in place",
    "Inside a scan over the layers of a `[L, K, N]` bf16 stack, per layer: "
    "XLA's `dynamic_slice` + dot (a copy of the layer's kernel, then the "
    "GEMM) and the Mosaic GPU GEMM that reads the layer where it lies "
    "(`ops/mosaic/matmul.py`, its default tiles); both scans also copy "
    "each layer's output into their stacked result. Beside them XLA's "
    "GEMM of one unstacked kernel, no scan, and the in-place scan's GEMM "
    "kernel alone (timed by kernel name; '-' where a run did not record "
    "it). Side by side in one process (device time per layer, medians).",
    table(
      [
        "T",
        "K x N",
        "product",
        "CTA tile",
        "XLA in the scan (µs)",
        "in place in the scan (µs)",
        "XLA / in place, in the scan",
        "XLA GEMM alone (µs)",
        "in-place GEMM kernel (µs)",
        "GEMM kernel / XLA GEMM alone",
      ],
      [row(c) for c in run["cases"]],
    ),
    list_flags_command(
      "stacked_gemm.py", run["config"], ("tokens", "shapes", "kinds")
    ),
    [run],
  )


def list_flags_command(script: str, config, names) -> str:
  """The command line of a benchmark ``script`` whose run recorded the
  list-valued flags ``names`` in its ``config``."""
  flags = [
    " ".join([f"--{name}", *(shlex.quote(str(v)) for v in config[name])])
    for name in names
  ]
  return f"python benchmarks/{script} " + " ".join(flags) + " --out FILE"


def schedule_speed_section(runs) -> str:
  """The inline and pingpong schedules per optimizer, storage and call,
  every kept run (each measured a different set of calls)."""
  rows = []
  for run in sorted(runs, key=lambda run: meta(run)["date"]):
    for c in run["cases"]:
      ms = c.get("ms", {})
      rows.append(
        [
          f"{c['optimizer']} / {c['storage']}",
          c["tokens"],
          f"{c['k']} x {c['n']}",
          f"{ms['inline']:.3f}" if "inline" in ms else "failed",
          f"{ms['pingpong']:.3f}" if "pingpong" in ms else "does not fit",
          f"{c['pingpong_over_inline']:.3f}"
          if "pingpong_over_inline" in c
          else "-",
          {True: "yes", False: "**no**"}.get(c.get("same_bits"), "-"),
          f"`{commit(run)}`",
        ]
      )
  return section(
    "The Mosaic kernel's schedules",
    "One fused update through the first inline config that fits and through "
    "the first pingpong config, bf16 activations; device ms of one call "
    "(medians), side by side in one process. `same bits`: the kernels the "
    "two schedules' first steps write from the same state agree bit for "
    "bit. "
    "`mosaic.ranked_configs` ranks pingpong first where these runs show it "
    "faster (docs/kernels.md).",
    table(
      [
        "optimizer / storage",
        "tokens",
        "shape",
        "inline",
        "pingpong",
        "pingpong / inline",
        "same bits",
        "commit",
      ],
      rows,
    ),
    "`; `".join(
      list_flags_command(
        "schedule_speed.py",
        run["config"],
        ("tokens", "shapes", "optimizers", "storages"),
      )
      for run in sorted(runs, key=lambda run: meta(run)["date"])
    ),
    runs,
  )


def cluster_gemm_section(runs) -> str:
  """JAX's Hopper GEMM with the fused kernel's tiling, with and without
  2-CTA clusters, beside XLA's GEMM: the newest run of each shape on each
  GPU, a column each."""
  shapes = [
    dict(r, _run=run, meta=meta(run)) for run in runs for r in run["rows"]
  ]
  latest = newest(shapes, lambda r: (device_name(r["_run"]), *r["shape"]))
  header, columns = [], []
  for r in sorted(
    latest.values(), key=lambda r: (device_name(r["_run"]), r["shape"][2])
  ):
    cells = {}
    for c in r["configs"]:
      name = (
        f"{int(c['tile_m'])} x {2 * int(c['tile_n'])}, "
        f"{c['max_concurrent_steps']} stages, cluster "
        f"{'none' if c['cluster_dimension'] == 'None' else c['cluster_dimension']}"
      )
      cells[name] = f"{c['ms']:.4f}" if "ms" in c else "failed"
    cells["XLA's GEMM"] = f"{r['xla_ms']:.4f}"
    header += [name for name in cells if name not in header]
    m, n, k = r["shape"]
    columns.append((f"{device_name(r['_run'])}, {m} x {n}, T = {k}", cells))
  rows = [[h, *(cells.get(h, "-") for _, cells in columns)] for h in header]
  return section(
    "TMA multicast in 2-CTA clusters: JAX's Hopper GEMM",
    "`hopper_matmul_mgpu` with the fused kernel's tiling (two 128 x 64 "
    "warpgroup parts of a 128 x 128 CTA tile, 64-token steps) and a "
    "128 x 256 CTA tile, without a cluster and with 2-CTA clusters along M "
    "(the kernel's K) or N that multicast the shared block; device ms "
    "(medians), bf16, one process per GPU (- : not in that GPU's run). The "
    "columns' T is the GEMM's contraction.",
    table(["CTA tile, ring, cluster", *(name for name, _ in columns)], rows),
    "python benchmarks/cluster_gemm.py --out FILE  # --no-clusters: "
    "the tilings alone",
    sorted(
      {id(r["_run"]): r["_run"] for r in latest.values()}.values(),
      key=lambda run: meta(run)["date"],
    ),
  )


def compile_time_cells(r) -> tuple:
  """A run's lower, compile and first-step seconds: its error, or how long
  it ran without finishing."""
  if "compile_s" in r:
    return (
      f"{r['lower_s']:.1f}",
      f"{r['compile_s']:.1f}",
      f"{r['first_step_s']:.2f}",
    )
  if "timeout_s" in r:
    return (f"not done in {r['timeout_s']} s", "-", "-")
  return ("failed", "-", "-")


def compile_time_section(runs) -> str:
  """Every kept run, by commit: a change to the kernels' compilation shows
  beside the runs before it."""
  first = runs[0]
  rows = [
    [
      name,
      r.get("fused_calls", "-"),
      *compile_time_cells(r),
      f"{r['step_ms']:.1f}" if r.get("step_ms") else "-",
      f"`{commit(run)}`",
    ]
    for run in sorted(runs, key=lambda run: meta(run)["date"])
    for name, r in run["runs"].items()
  ]
  return section(
    "Compile time of an unrolled model",
    f"The '{first['shape']}' Llama shape, {first['layers']} unrolled layers, "
    f"B = {first['batch']}, T = {first['seq']}, AdamW, remat; each run in "
    "its own process, every kept run with its commit. Storage: bf16 weights "
    "and states unless the run names another (sr: bf16 weights "
    "stochastically rounded).",
    table(
      [
        "implementation",
        "fused calls",
        "lower s",
        "compile s",
        "first step s",
        "step ms",
        "commit",
      ],
      rows,
    ),
    "python benchmarks/run.py compile",
    runs,
  )


def lowp_sweep_section(run) -> str:
  """The Mosaic configs tried for int8 states (``--mosaic-configs``)."""
  return lowp_speed_section(
    [run],
    "int8 states: the Mosaic kernel's configs",
    "python benchmarks/lowp_speed.py --storages int8-sr --mosaic-configs "
    "'{...}' ... --out benchmarks/results/lowp_sweep.json",
  )


def _lowp_cell(case, name) -> str:
  if case is None or name not in case["ms"]:
    return "-"
  ratio = case.get("ratio_to_bf16", {}).get(name)
  return f"{case['ms'][name]:.3f}" + (f" ({ratio:.2f}x)" if ratio else "")


def lowp_speed_section(
  runs,
  title="Low-precision storage: speed of one fused update",
  command=None,
) -> str:
  """One fused update per storage and backend, each run's rows (newest
  first) with its commit; ``command`` defaults to the ``lowp_speed.py``
  command line of the newest run's config."""
  runs = sorted(runs, key=lambda run: meta(run)["date"], reverse=True)
  if command is None:
    command = list_flags_command(
      "lowp_speed.py",
      runs[0]["config"],
      ("tokens", "shapes", "storages", "backends"),
    )
  columns = []
  for run in runs:
    for c in run["cases"]:
      if (c["tokens"], c["k"], c["n"]) not in columns:
        columns.append((c["tokens"], c["k"], c["n"]))
  rows = []
  for run in runs:
    cases = {(c["tokens"], c["k"], c["n"]): c for c in run["cases"]}
    names = []
    for c in run["cases"]:
      names += [n for n in c["ms"] if n not in names]
    rows += [
      [
        name,
        *(_lowp_cell(cases.get(column), name) for column in columns),
        device_name(run),
        f"`{commit(run)}`",
      ]
      for name in names
    ]
  return section(
    title,
    "AdamW, bf16 activations, bf16 weights; states bf16 or int8 (`-4bit`: "
    "4-bit second moments), weights rounded to nearest or stochastically "
    "(`-sr`). Device ms of one call "
    "(medians), in brackets the ratio to the same backend's bf16 time where "
    "the run timed it; `gemm+optax` is XLA's GEMM and optax's update of bf16 "
    "storage. Each run's rows carry its device and commit, the newest run "
    "first.",
    table(
      [
        "backend / storage",
        *(f"T={t}, {k} x {n}" for t, k, n in columns),
        "device",
        "commit",
      ],
      rows,
    ),
    command,
    runs,
  )


def _breakdown_name(name: str) -> str:
  """A config row's name with its JSON fields as ``key=value``."""
  storage, _, fields = name.partition(" ")
  if not fields.startswith("{"):
    return name
  parsed = json.loads(fields)
  return f"{storage}, " + ", ".join(f"{k}={v}" for k, v in parsed.items())


def lowp_breakdown_section(runs) -> str:
  """The int8 update's time beyond bf16's, one difference at a time, per
  case of each run (newest first), each variant with its ratio to bf16."""
  runs = sorted(runs, key=lambda run: meta(run)["date"], reverse=True)
  rows = []
  for run in runs:
    for c in run["cases"]:
      bf16 = c["ms"].get("bf16")
      for name, ms in c["ms"].items():
        same = c.get("same_bits", {}).get(name)
        matches = c.get("state_matches_reference", {}).get(name)
        rows.append(
          [
            c["tokens"],
            f"{c['k']} x {c['n']}",
            _breakdown_name(name),
            f"{ms:.3f}" + (f" ({ms / bf16:.2f}x)" if bf16 else ""),
            "-" if same is None else ("yes" if same else "no"),
            "-" if matches is None else f"{matches:.6g}",
            device_name(run),
            f"`{commit(run)}`",
          ]
        )
  return section(
    "int8 states: where the fused update's time goes",
    "One fused AdamW update through the Mosaic kernel, bf16 weights, "
    "device ms (medians, one process per run), in brackets the ratio to "
    "bf16 states on their default config. `bf16 on the int8 tile`: bf16 "
    "states on int8's 64 x 64 config (64 x 64 parts, one 64-column "
    "sub-tile a part): the tile's cost. `int8, quantizer passed through`: "
    "int8 states read, dequantized and stepped, their old codes stored "
    "back (not exact): the bytes, the block scales' accesses, the "
    "dequantization and the rule. `int8`, `int8-sr`: the default config "
    "of the run's commit. The rows that name config fields run "
    "int8 states on that Mosaic config; `same bits`: its first step's "
    "weights equal the default config's. `m and v as e4m3`, `v as e4m3`: "
    "a probe, not a format of the package: those int8 leaves stored as "
    "float8 e4m3 codes of the values in blocks of 64 scaled by a power of "
    "two (a quantizer with no division, square root, scale search or "
    "threshold correction), on the storage's default config; `scales "
    "kept`: the same codes written at the blocks' old scales, no block "
    "maximum taken (timing only, not an encoding: what the block reduction "
    "costs). `state = "
    "XLA`: the share of state elements bit for bit equal to the XLA "
    "reference's (under the same encoding) after two steps.",
    table(
      [
        "T",
        "K x N",
        "variant",
        "ms",
        "same bits",
        "state = XLA",
        "device",
        "commit",
      ],
      rows,
    ),
    list_flags_command(
      "lowp_breakdown.py",
      runs[0]["config"],
      ("tokens", "shapes", "storages", "configs"),
    ),
    runs,
  )


FIDELITY_RUNS = {
  "optax_fp32": "optax AdamW, fp32 (reference)",
  "optax_fp32_seed1": "optax AdamW, fp32, another init seed",
  "optax_fp32_seed2": "optax AdamW, fp32, a third init seed",
  "forge_fp32": "FORGE fp32",
  "forge_bf16_nearest": "FORGE bf16 weights and states, round-to-nearest",
  "forge_bf16_sr": "FORGE bf16 weights (stochastic rounding) and states",
  "forge_bf16_sr_int8": "FORGE bf16 + stochastic rounding + int8 states",
  "forge_bf16_sr_int8_4bit": "FORGE bf16 + stochastic rounding + int8 "
  "states, 4-bit second moments",
  "forge_bf16_nearest_int8": "FORGE bf16 round-to-nearest + int8 states",
}


def fidelity_command(a) -> str:
  """The ``fidelity.py`` command line of a run's ``args``."""
  value = lambda v: f"{v:g}" if isinstance(v, float) else v
  flags = [
    f"--{name.replace('_', '-')} {value(a[name])}"
    for name in ("config", "steps", "batch_size", "seq_len", "lr", "dtype")
    if name in a
  ]
  flags.append(f"--implementation {a['implementation']}")
  # A run that does not record reference_seeds trained two.
  flags.append(f"--reference-seeds {a.get('reference_seeds', 2)}")
  flags += ["--ablation"] * bool(a.get("ablation"))
  return "python benchmarks/fidelity.py " + " ".join(flags)


def fidelity_sections(runs) -> str:
  """The newest run of each model config and length, the largest model
  first, then the longest run."""
  latest = newest(
    runs, lambda r: (r["args"]["config"], r["args"]["steps"])
  ).values()
  latest = sorted(
    latest, key=lambda r: (-r["model"]["num_params"], -r["args"]["steps"])
  )
  return "\n".join(fidelity_section(run) for run in latest)


def fidelity_section(run) -> str:
  a = run["args"]
  spread = run.get("seed_spread")
  rows = []
  for name, s in run["summary"].items():
    row = [
      FIDELITY_RUNS.get(name, name),
      f"{s['mean_abs_diff_vs_optax_fp32']:.2g}",
      f"{s['mean_abs_diff_vs_optax_fp32_last_quarter']:.2g}",
      f"{s['final_train_loss_last10']:.4f}",
      f"{s['valid_loss']:.4f}",
    ]
    if spread:
      gap = spread["final_loss_gap"].get(name)
      row.append(
        "-"
        if gap is None
        else f"{gap:.4f} ({'within' if spread['within_range'][name] else 'outside'})"
      )
    rows.append(row)
  headers = [
    "run",
    "mean \\|loss − optax fp32\\|",
    "last quarter",
    "final train loss",
    "validation loss",
  ]
  text = (
    f"The '{a['config']}' byte-level model, {a['steps']} steps of "
    f"{a['batch_size']} x {a['seq_len']} bytes, AdamW {a['lr']:g} with "
    f"warmup and cosine decay, weight decay {a['weight_decay']:g}, "
    f"{a.get('dtype', 'float32')} compute, "
    f"`implementation='{a['implementation']}'`; every run on the same "
    f"batches.\n\n![fidelity]({PLOT_LINK}"
    f"fidelity_{a['config']}_{a['steps']}.png)"
  )
  resumed = run.get("resumed_from")
  if resumed:
    names = ", ".join(f"`{n}`" for n in resumed["runs"])
    text += (
      f"\n\n{names} trained in an earlier process (commit "
      f"`{resumed['commit']}`, the same flags); the others continued from "
      "its file (`--resume`)."
    )
  if spread:
    headers.append("final-loss gap to optax fp32 (seed spread)")
    seeds = len(spread["reference_final_losses"])
    text += (
      f"\n\nThe seed spread is the range of the final losses of optax fp32 "
      f"from {seeds} initializations: {spread['range']:.4f}. A run is "
      "within it when its final loss is no further from optax fp32's than "
      "that."
    )
  return section(
    f"Fidelity of low-precision storage (demo LM, '{a['config']}', "
    f"{a['steps']} steps)",
    text,
    table(headers, rows),
    fidelity_command(a),
    [run],
  )


# ---------------------------------------------------------------------------
# Global-norm clipping (model_memory.py --clip, run.py clipping).

CLIP_LABELS = {
  ("forge", "none"): "FORGE, no clipping (the norm reported)",
  ("forge", "exact"): "FORGE, `clip='exact'`",
  ("forge", "delayed"): "FORGE, `clip='delayed'`",
  ("optax", "none"): "optax, no clipping",
  ("optax", "exact"): "optax, `clip_by_global_norm` in `tx`",
}


def clipping_section(runs) -> str:
  key = lambda r: (r["config"], r["batch"], r["seq"], r["variant"], r["clip"])
  latest = newest(runs, key)
  rows = []
  for (config, batch, seq, variant, clip), run in sorted(
    latest.items(), key=lambda kv: (kv[0][:3], kv[0][3], kv[0][4] != "none")
  ):
    base = latest.get((config, batch, seq, variant, "none"))
    ratio = run["step_ms_median"] / base["step_ms_median"] if base else None
    rows.append(
      [
        f"{config}, {batch} x {seq}",
        CLIP_LABELS.get((variant, clip), f"{variant} {clip}"),
        f"{run['peak_bytes_in_use'] / 2**30:.2f}",
        f"{run['step_ms_median']:.1f}",
        f"{ratio:.3f}" if ratio else "",
      ]
    )
  return section(
    "Global-norm clipping (one GPU)",
    "The package's Llama-style model, bf16 weights and states, AdamW, scan "
    "+ remat, `--max-grad-norm 1.0`; one fresh process per row (peak "
    "memory is `memory_stats()['peak_bytes_in_use']`), step time the "
    "median of the timed steps. The ratio is each row's step time over "
    "its variant's row without clipping.",
    table(["shape", "step", "peak GiB", "step ms", "step / no clipping"], rows),
    "python benchmarks/run.py clipping",
    list(latest.values()),
  )


CURVE_LABELS = {
  "forge": "FORGE, no clipping",
  "forge-exact": "FORGE, `clip='exact'`",
  "forge-delayed": "FORGE, `clip='delayed'`",
  "optax-clip": "nn.Dense + optax, `clip_by_global_norm`",
}


def _mean_abs_diff(a, b) -> float:
  return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def clipping_curves_section(run) -> str:
  reference = run["runs"].get("optax-clip", {}).get("losses")
  rows = []
  for name, r in run["runs"].items():
    losses, norms = r["losses"], r["grad_norms"]
    clipped = sum(n > run["max_grad_norm"] for n in norms) / len(norms)
    rows.append(
      [
        CURVE_LABELS.get(name, name),
        f"{_mean_abs_diff(losses, reference):.2g}" if reference else "",
        f"{sum(losses[-10:]) / len(losses[-10:]):.4f}",
        f"{clipped:.0%}",
      ]
    )
  return section(
    "Clipping convergence (demo LM)",
    f"The '{run['config']}' byte-level model, {run['steps']} steps of "
    f"{run['batch_size']} x {run['seq_len']} bytes, AdamW {run['lr']:g} "
    f"with warmup and cosine decay, clipping at {run['max_grad_norm']:g}; "
    "every run from one initialization on the same batches. `'delayed'` "
    "scales step t by the norm of step t - 1.\n\n"
    f"![clipping curves]({PLOT_LINK}clipping_curves.png)",
    table(
      [
        "run",
        "mean \\|loss − optax + clipping\\|",
        "final train loss (last 10)",
        "steps with norm > max",
      ],
      rows,
    ),
    "python benchmarks/clipping_curves.py --steps 400 --out "
    "benchmarks/results/clipping_curves_cpu_<commit>.json",
    [run],
  )


def clipping_curves_plot(plt, runs):
  if not runs:
    return
  run = max(runs, key=lambda r: meta(r)["date"])
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, r in run["runs"].items():
    ax.plot(r["losses"], label=CURVE_LABELS.get(name, name).replace("`", ""))
  ax.set_xlabel("step")
  ax.set_ylabel("train loss")
  ax.set_title(
    f"Global-norm clipping at {run['max_grad_norm']:g}, "
    f"'{run['config']}' demo LM ({meta(run)['device']})"
  )
  ax.legend()
  _save(fig, "clipping_curves.png")


# ---------------------------------------------------------------------------
# The main job, the page and the README.


def main_job_line(run) -> str:
  a = run["args"]
  return (
    f"Measured: `--steps {a['steps']}` on one {run['device']} takes "
    f"{run['wall_s']:.0f} s, both models and their compilation included."
  )


def main_job_section(run) -> str:
  a = run["args"]
  return section(
    "Main job",
    f"`python -m examples.lm.main --steps {a['steps']}`: both "
    "models from one initialization on the same batches.\n\n"
    f"![loss curves]({PLOT_LINK}main_job_h200_loss_curves.png)",
    table(
      ["", "FORGE", "nn.Dense + optax"],
      [
        [
          "final train loss",
          *(f"{run['final_train_loss'][k]:.4f}" for k in ("forge", "baseline")),
        ],
        [
          "validation loss",
          *(f"{run['valid_loss'][k]:.4f}" for k in ("forge", "baseline")),
        ],
        [
          "step ms",
          *(f"{run['step_ms'][k]:.1f}" for k in ("forge", "baseline")),
        ],
      ],
    )
    + "\n\n"
    + main_job_line(run),
    f"python -m examples.lm.main --steps {a['steps']}",
    [run],
  )


def draw_plots(results: str = RESULTS):
  """benchmarks/plots/model_memory.png, kernel_speed.png and
  clipping_curves.png (matplotlib)."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  step_plot(plt, load("model_memory_*.json", results))
  kernel_plot(plt, load("kernel_*.json", results))
  clipping_curves_plot(plt, load("clipping_curves_*.json", results))


def _save(fig, name):
  os.makedirs(PLOTS, exist_ok=True)
  fig.tight_layout()
  fig.savefig(os.path.join(PLOTS, name), dpi=110)
  fig.clf()


SECTIONS = (
  # (result files, section, whether the section takes the newest file only)
  ("model_memory_*.json", step_section, False),
  ("kernel_*.json", kernel_section, False),
  ("kernel_*.json", checks_section, False),
  ("mosaic_diag_*.json", schedules_section, False),
  ("mosaic_parts_*.json", kernel_parts_section, False),
  ("mosaic_tiles_*.json", mosaic_tiles_section, False),
  ("kernel_counters_*.json", counters_section, False),
  ("lowp_kernel_*.json", lowp_section, False),
  ("memory_sweep_*.json", memory_sweep_section, True),
  ("capacity_*.json", capacity_section, True),
  ("tp_*.json", tp_section, True),
  ("fidelity_*.json", fidelity_sections, False),
  ("main_job_*/summary_*.json", main_job_section, True),
  ("clipping_step_*.json", clipping_section, False),
  ("clipping_curves_*.json", clipping_curves_section, True),
  ("fsdp_*.json", fsdp_section, True),
  ("layer_step_*.json", layer_step_section, False),
  ("xla_chunks_*.json", xla_chunks_section, False),
  ("rule_free_step_*.json", rule_free_section, True),
  ("untracked_step_*.json", untracked_section, True),
  ("*_step_*.json", never_slower_section, False),
  ("kernel_only_step_*.json", kernel_only_section, True),
  ("stacked_gemm_*.json", stacked_gemm_section, True),
  ("lowp_speed_*.json", lowp_speed_section, False),
  ("lowp_breakdown_*.json", lowp_breakdown_section, False),
  ("lowp_sweep_*.json", lowp_sweep_section, True),
  ("schedule_speed_*.json", schedule_speed_section, False),
  ("cluster_gemm_*.json", cluster_gemm_section, False),
  ("compile_time_*.json", compile_time_section, False),
)


def _sections(results: str):
  """(section text, the runs it was given) for each section with results."""
  for pattern, render, newest_only in SECTIONS:
    runs = load(pattern, results)
    if newest_only and runs:
      runs = [max(runs, key=lambda r: meta(r)["date"])]
    if runs:
      yield render(runs[0] if newest_only else runs), runs


def benchmarks_page(results: str = RESULTS) -> str:
  """The text of docs/benchmarks.md."""
  return (
    "# Benchmarks\n\nGenerated by `python benchmarks/make_docs.py` from "
    "`benchmarks/results/`; do not edit by hand. Each table shows the "
    "newest run of each configuration, each run's device, JAX version, "
    "commit and date, and the command that reproduces it, run from the "
    "repository root on the device (`benchmarks/run.py` names result "
    "files by commit).\n\n" + "\n".join(text for text, _ in _sections(results))
  )


def readme_sections(results: str = RESULTS) -> dict:
  """The README's generated sections: ``{marker name: body}``."""
  main_job = load("main_job_*/summary_*.json", results)
  return {
    "results": readme_table(load("model_memory_*.json", results)),
    "main-job": main_job_line(max(main_job, key=lambda r: r["wall_s"]))
    if main_job
    else "",
    "speed": speed_line(load("*_step_*.json", results)),
  }


def replace_section(text: str, name: str, body: str) -> str:
  pattern = re.compile(
    rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S
  )
  if not pattern.search(text):
    raise ValueError(f"README has no section {name!r}")
  return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def used_results(results: str = RESULTS) -> set:
  """The result files the generated tables name (the newest of each)."""
  return {
    r["_file"]
    for text, runs in _sections(results)
    for r in runs
    if f"`{r['_file']}`" in text
  }


def main():
  with open(README) as f:
    text = f.read()
  for name, body in readme_sections().items():
    text = replace_section(text, name, body)
  with open(README, "w") as f:
    f.write(text)
  os.makedirs(os.path.dirname(BENCHMARKS_MD), exist_ok=True)
  with open(BENCHMARKS_MD, "w") as f:
    f.write(benchmarks_page())
  draw_plots()
  print(f"README.md and docs/benchmarks.md regenerated from {RESULTS}")


if __name__ == "__main__":
  main()
