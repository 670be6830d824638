"""Run one benchmark suite on this machine; results are named by commit.

  python benchmarks/run.py SUITE [options]     # from the repository root

Suites, by what they measure:

  kernel     one fused update of each kernel beside XLA's GEMM and GEMM +
             optax at the Llama-3.1-8B shapes, and each kernel against the
             XLA reference for every optimizer (one GPU)
  schedules  the Mosaic kernel's schedules at the MLP shape, bf16 storage
  step       peak memory and step time of the whole train step, FORGE and
             optax, one fresh process per configuration (one GPU)
  clipping   global-norm clipping: the step of FORGE without clipping, exact
             and delayed, and of optax without and with clip_by_global_norm,
             one fresh process each; then the demo LM's loss curves, exact
             against delayed (one GPU)
  memory     compiled temp memory of the train step as the model grows (CPU)
  capacity   the largest micro-batch under a memory cap, TP = 2 with SP
  tp         TP = 2 against one device: exactness, per-GPU peak, step time
  fidelity   loss curves of low-precision storage on the demo LM's
             'medium' config (136 M parameters) beside optax fp32 from
             three initializations (one GPU)
  lowp       low-precision storage bits of each kernel against the reference
  counters   Nsight Compute counters of the fused kernel (needs ncu)
  layer      one layer's whole train step, each backend against optax
  bounds     one layer's step at every 8B shape beside its kernel-only
             bound, a process per storage and token count
  parts      the Mosaic kernel timed in parts: its main loop alone, without
             its rule's arithmetic or its norm sums
  tiles      the Mosaic kernel with 128 x 256 CTA tiles (and their main loop
             alone) beside its default, where the main loop bounds
  gemm       the in-place GEMM of a stacked layer against XLA's slice +
             GEMM inside a layer scan, and XLA's GEMM alone (one GPU)
  lowp-speed one fused update per storage (bf16, int8, stochastic rounding)
             and backend
  lowp-breakdown
             the int8 update's time beyond bf16's, one difference at a time
             (tile shape, bytes and rule, quantizer), and int8 on other
             Mosaic configs
  compile    compile time of an unrolled model, per kernel implementation
  fsdp       the FSDP code path with a data axis of one device against no
             mesh (one GPU)
  gpu-tests  the tests marked ``gpu``

Each result file goes to ``--out`` (default ``$OUT``, else
``benchmarks/results/``), its name ending in the commit: ``--commit``, else
``$FORGE_COMMIT``, else git's ``HEAD``. Every command gets ``FORGE_COMMIT``
(results record it in their metadata: a device's copy of the tree may carry
a stale ``.git``), the repository root on ``PYTHONPATH`` and, with
``--xla-flags``, ``XLA_FLAGS``. ``python benchmarks/make_docs.py`` then
turns the results into the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import os
import shutil
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = "benchmarks"

#: Nsight Compute sections the counter summary reads.
NCU_SECTIONS = (
  "SpeedOfLight",
  "MemoryWorkloadAnalysis",
  "ComputeWorkloadAnalysis",
  "WarpStateStats",
  "SchedulerStats",
  "LaunchStats",
  "Occupancy",
  "SourceCounters",
)


@dataclasses.dataclass
class Step:
  """One command. ``stdout``: a file (under ``--out``) that receives its
  output, gzipped if the name ends in ``.gz``."""

  argv: list
  timeout: int = 600
  stdout: Optional[str] = None
  env: dict = dataclasses.field(default_factory=dict)


def _python(script: str, *args) -> list:
  return [sys.executable, os.path.join(BENCH, script), *map(str, args)]


def kernel_steps(a, out):
  steps = [
    Step(
      _python(
        "kernel_bench.py",
        "--suite",
        "mosaic",
        "--mosaic-defaults",
        "--tokens",
        tokens,
        "--time-budget-s",
        a.timeout - 60,
        "--out",
        out(f"kernel_mosaic_T{tokens}"),
      ),
      timeout=a.timeout,
    )
    for tokens in a.tokens or (2048, 8192)
  ]
  if a.full:  # the Triton kernel alone, up to 32768 tokens
    steps.append(
      Step(
        _python(
          "kernel_bench.py",
          "--suite",
          "full",
          "--time-budget-s",
          a.timeout - 60,
          "--out",
          out("kernel_full"),
        ),
        timeout=a.timeout,
      )
    )
  return steps


def schedules_steps(a, out):
  steps = []
  for k, n in a.shape or ((4096, 14336),):
    args = [
      "--suite",
      "mosaic-diag",
      "--diag-shape",
      k,
      n,
      "--tokens",
      *(a.tokens or (512, 2048, 8192)),
    ]
    if a.configs:
      args += ["--diag-configs", *a.configs] + (
        ["--diag-extras"] if a.extras else []
      )
    steps.append(
      Step(
        _python("kernel_bench.py", *args, "--out", out(f"mosaic_diag_{k}x{n}")),
        timeout=a.timeout,
      )
    )
  return steps


def step_steps(a, out):
  short = {"llama-3.1-8b": "8b", "qwen3-14b": "qwen14b"}.get(a.config, a.config)
  steps = []
  for variant in a.variant or ("forge", "optax"):
    for batch in a.batch or (1,):
      for seq in a.seq or (512, 2048):
        args = [
          "--config",
          a.config,
          "--variant",
          variant,
          "--batch",
          batch,
          "--seq",
          seq,
          "--implementation",
          a.implementation,
        ]
        name = f"model_memory_{short}_{variant}"
        if a.int8 and variant == "forge":
          args += ["--state-dtype", "int8", "--weight-rounding", "stochastic"]
          name += "-int8-sr"
          if a.second_moment_bits == 4:
            args += ["--second-moment-bits", "4"]
            name += "-4bit"
        if variant == "forge":
          for flag, on, suffix in (
            ("--optax-storage", a.optax_storage, "-optax-storage"),
            ("--forge-embedding", a.forge_embedding, "-forge-embed"),
          ):
            if on:
              args.append(flag)
              name += suffix
        name += f"_B{batch}_T{seq}"
        for flag, value in (
          ("--attention", a.attention),
          ("--remat-policy", a.remat_policy),
          ("--mosaic-config", a.mosaic_config),
        ):
          if value:
            args += [flag, value]
        if a.attention:
          name += f"_{a.attention}"
        if a.remat_policy:
          name += f"_{a.remat_policy}"
        if a.implementation != "auto":
          name += f"_{a.implementation}"
        args += ["--profile"] * a.profile + ["--breakdown"] * a.breakdown
        steps.append(
          Step(
            _python("model_memory.py", *args, "--out", out(name)),
            timeout=a.timeout,
            env={"XLA_CLIENT_MEM_FRACTION": str(a.mem_fraction)}
            if a.mem_fraction
            else {},
          )
        )
  return steps


def clipping_steps(a, out):
  """model_memory.py per clipping configuration (``--max-grad-norm``; named
  ``clipping_step_*``, apart from the step suite's tables), then
  clipping_curves.py (its plot beside its JSON)."""
  short = {"llama-3.1-8b": "8b", "qwen3-14b": "qwen14b"}.get(a.config, a.config)
  steps = []
  configurations = [
    ("forge", "none"),
    ("forge", "exact"),
    ("forge", "delayed"),
    ("optax", "none"),
    ("optax", "exact"),
  ]
  for variant, clip in configurations:
    for batch in a.batch or (1,):
      for seq in a.seq or (512,):
        name = f"clipping_step_{short}_{variant}-{clip}_B{batch}_T{seq}"
        args = [
          "--config",
          a.config,
          "--variant",
          variant,
          "--batch",
          batch,
          "--seq",
          seq,
          "--implementation",
          a.implementation,
          "--clip",
          clip,
          "--max-grad-norm",
          a.max_grad_norm,
        ]
        steps.append(
          Step(
            _python("model_memory.py", *args, "--out", out(name)),
            timeout=a.timeout,
          )
        )
  curves = out("clipping_curves")
  steps.append(
    Step(
      _python(
        "clipping_curves.py",
        "--out",
        curves,
        "--plot",
        curves[: -len(".json")] + ".png",
      ),
      timeout=max(a.timeout, 3600),
    )
  )
  return steps


def memory_steps(a, out):
  return [
    Step(
      _python("memory_sweep.py", "--out", out("memory_sweep")),
      timeout=a.timeout,
    )
  ]


def capacity_steps(a, out):
  return [
    Step(
      _python(
        "capacity_sweep.py",
        "--tp",
        2,
        "--sp",
        "--scan",
        "--config",
        "llama-3.1-8b",
        "--seq",
        2048,
        "--mem-cap-gib",
        40,
        "--max-batch",
        8,
        "--variants",
        "forge-bf16,optax,forge-int8-sr,forge-fp32",
        "--child-timeout",
        140,
        "--budget-s",
        a.timeout - 120,
        "--out",
        out("capacity_tp2_40g"),
      ),
      timeout=a.timeout,
    )
  ]


def tp_steps(a, out):
  return [
    Step(
      _python(
        "tp_bench.py",
        "--tp",
        2,
        "--sp",
        "--config",
        "llama-3.1-8b",
        "--layers",
        8,
        "--batch",
        1,
        "--seq",
        4096,
        "--breakdown",
        "--out",
        out("tp"),
      ),
      timeout=a.timeout,
    )
  ]


def layer_steps(a, out):
  return [
    Step(
      _python("layer_step.py", "--out", out("layer_step")), timeout=a.timeout
    )
  ]


#: The one-layer step's variants beside their bound (docs/benchmarks.md,
#: "Never slower").
BOUND_VARIANTS = ("optax", "mosaic", "mosaic-untracked", "mosaic-kernel-only")


def bounds_steps(a, out):
  """The one-layer step of every 8B shape beside its kernel-only bound, one
  process per storage and token count."""
  return [
    Step(
      _python(
        "layer_step.py",
        "--tokens",
        tokens,
        "--storage",
        storage,
        "--variants",
        *BOUND_VARIANTS,
        "--profile",
        "--time-budget-s",
        a.timeout - 60,
        "--out",
        out(f"bound_step_{storage}_T{tokens}"),
      ),
      timeout=a.timeout,
    )
    for storage in ("bf16", "fp32")
    for tokens in a.tokens or (512, 2048, 8192)
  ]


def _diagnosis_in_parts(a, out, name, shapes, tokens, configs, storage):
  """``kernel_bench.py``'s diagnosis of each kernel shape (``a.shape``, else
  ``shapes``) with ``storage`` W and states, its first config
  (``a.configs``, else ``configs``) also traced in parts, written to
  ``<name>_<K>x<N>``."""
  return [
    Step(
      _python(
        "kernel_bench.py",
        "--suite",
        "mosaic-diag",
        "--diag-shape",
        k,
        n,
        "--tokens",
        *(a.tokens or tokens),
        "--diag-configs",
        *(a.configs or configs),
        "--diag-extras",
        "--diag-storage",
        storage,
        "--out",
        out(f"{name}_{k}x{n}"),
      ),
      timeout=a.timeout,
    )
    for k, n in a.shape or shapes
  ]


def parts_steps(a, out):
  """The Mosaic kernel timed in parts: its main loop alone, without its
  rule's arithmetic or its norm sums; bf16 W / m / v, or float32 with
  ``--storage fp32``."""
  fp32 = a.storage == "fp32"
  return _diagnosis_in_parts(
    a,
    out,
    "mosaic_parts_fp32" if fp32 else "mosaic_parts",
    shapes=((4096, 14336), (4096, 4096)),
    tokens=(512, 2048, 8192),
    # Parts of the inline schedule: pingpong's main loop alone hangs
    # (kernel_bench.MAIN_LOOP_PINGPONG); the default config beside it.
    # float32 states fit one epilogue buffer a warpgroup.
    configs=("inline-steps5-slots1" if fp32 else "inline-steps5", "default"),
    storage="float32" if fp32 else "bfloat16",
  )


def tiles_steps(a, out):
  """The Mosaic kernel's tile shapes where its main loop bounds: 128 x 256
  CTA tiles beside the default and the inline schedule's 128 x 128, with
  the first config's main loop alone."""
  return _diagnosis_in_parts(
    a,
    out,
    "mosaic_tiles",
    shapes=((4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024)),
    tokens=(8192, 2048),
    configs=(
      "inline-wide-steps4-slots1",
      "inline-wide-steps3",
      "inline-steps5",
      "default",
    ),
    storage="bfloat16",
  )


def gemm_steps(a, out):
  return [
    Step(
      _python("stacked_gemm.py", "--out", out("stacked_gemm")),
      timeout=a.timeout,
    )
  ]


def lowp_speed_steps(a, out):
  return [
    Step(
      _python("lowp_speed.py", "--out", out("lowp_speed")), timeout=a.timeout
    )
  ]


def lowp_breakdown_steps(a, out):
  return [
    Step(
      _python("lowp_breakdown.py", "--out", out("lowp_breakdown")),
      timeout=a.timeout,
    )
  ]


def compile_steps(a, out):
  return [
    Step(
      _python(
        "compile_time.py",
        "--storages",
        "bf16",
        "bf16-sr",
        "--out",
        out("compile_time"),
      ),
      timeout=a.timeout,
    )
  ]


def fsdp_steps(a, out):
  return [
    Step(
      _python(
        "fsdp_bench.py",
        "--scan",
        "--config",
        "llama-3.1-8b",
        "--layers",
        8,
        "--batch",
        1,
        "--seq",
        4096,
        "--out",
        out("fsdp_dp1"),
      ),
      timeout=a.timeout,
    )
  ]


def fidelity_steps(a, out):
  return [
    Step(
      _python(
        "fidelity.py",
        "--config",
        "medium",
        "--steps",
        200,
        "--batch-size",
        16,
        "--seq-len",
        256,
        "--lr",
        1e-3,
        "--dtype",
        "bfloat16",
        "--implementation",
        "auto",
        "--no-moment-encodings",
        "--out",
        out("fidelity_medium"),
        "--plot",
        os.path.join(a.out, "fidelity_medium_200.png"),
      ),
      timeout=a.timeout,
    )
  ]


def lowp_steps(a, out):
  return [
    Step(
      _python(
        "lowp_kernel_check.py", "--suite", "h200", "--out", out("lowp_kernel")
      ),
      timeout=a.timeout,
    )
  ]


def _ncu() -> str:
  installed = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
  return shutil.which("ncu") or (installed[-1] if installed else "ncu")


def counters_steps(a, out):
  ncu = _ncu()
  report = os.path.join(a.out, f"counters_{a.commit}")
  probes = out("kernel_counters_probes")
  details = os.path.join(a.out, f"kernel_counters_details_{a.commit}.csv")
  source = os.path.join(a.out, f"kernel_counters_source_{a.commit}.csv.gz")
  sections = [arg for s in NCU_SECTIONS for arg in ("--section", s)]
  return [
    Step(
      [
        ncu,
        "--profile-from-start",
        "off",
        "--clock-control",
        "none",
        *sections,
        "-f",
        "-o",
        report,
        *_python("kernel_counters.py", "--out", probes),
        *(["--only", *a.probes] if a.probes else []),
      ],
      timeout=a.timeout,
      env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    ),
    Step(
      [ncu, "--import", report + ".ncu-rep", "--csv", "--page", "details"],
      stdout=details,
    ),
    Step(
      [
        ncu,
        "--import",
        report + ".ncu-rep",
        "--csv",
        "--page",
        "source",
        "--print-source",
        "sass",
      ],
      stdout=source,
    ),
    Step(
      _python(
        "counters_summary.py",
        "--probes",
        probes,
        "--details",
        details,
        "--source",
        source,
        "--out",
        out("kernel_counters"),
      )
    ),
  ]


def gpu_tests_steps(a, out):
  del out
  return [
    Step(
      [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rfE",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "tests/",
        *(["-k", a.k] if a.k else []),
        *(["-n", a.workers] if a.workers > 1 else []),
      ],
      timeout=a.timeout,
      stdout=os.path.join(a.out, f"gpu_tests_{a.commit}.txt"),
    )
  ]


#: Seconds a command of each suite may run, unless --timeout says otherwise.
TIMEOUTS = {
  "kernel": 300,
  "schedules": 300,
  "step": 200,
  "clipping": 300,
  "counters": 400,
  # A shape's two token counts took 70-80 s on an H100: a hang stops early.
  "tiles": 200,
}

SUITES = {
  "kernel": kernel_steps,
  "schedules": schedules_steps,
  "step": step_steps,
  "clipping": clipping_steps,
  "memory": memory_steps,
  "capacity": capacity_steps,
  "tp": tp_steps,
  "fidelity": fidelity_steps,
  "lowp": lowp_steps,
  "counters": counters_steps,
  "layer": layer_steps,
  "bounds": bounds_steps,
  "parts": parts_steps,
  "tiles": tiles_steps,
  "gemm": gemm_steps,
  "lowp-speed": lowp_speed_steps,
  "lowp-breakdown": lowp_breakdown_steps,
  "compile": compile_steps,
  "fsdp": fsdp_steps,
  "gpu-tests": gpu_tests_steps,
}


def _commit() -> str:
  if os.environ.get("FORGE_COMMIT"):
    return os.environ["FORGE_COMMIT"]
  try:
    return subprocess.run(
      ["git", "rev-parse", "--short=7", "HEAD"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    raise SystemExit("set --commit or FORGE_COMMIT: no git checkout here")


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__.split("\n\n", 1)[1],
  )
  p.add_argument("suite", choices=sorted(SUITES))
  p.add_argument(
    "--out",
    default=os.environ.get("OUT")
    or os.path.join(ROOT, "benchmarks", "results"),
    help="directory of the result files",
  )
  p.add_argument(
    "--commit", default=None, help="names the files and goes to FORGE_COMMIT"
  )
  p.add_argument(
    "--tag",
    default="",
    help="added to every result name: tells runs apart whose "
    "options the names leave out (--mosaic-config, --xla-flags)",
  )
  p.add_argument("--xla-flags", default=None, help="XLA_FLAGS of every command")
  p.add_argument(
    "--timeout",
    type=int,
    default=None,
    help="seconds a command may run (default: 300 for kernel "
    "and schedules, 200 for step, 300 for clipping, 400 for counters, else 600)",
  )
  p.add_argument(
    "--dry-run",
    action="store_true",
    help="print the commands without running them",
  )
  g = p.add_argument_group("kernel, schedules")
  g.add_argument(
    "--tokens",
    nargs="+",
    type=int,
    help="token counts (kernel: 2048 8192; schedules: 512 2048 8192)",
  )
  g.add_argument(
    "--full",
    action="store_true",
    help="kernel: also the Triton kernel alone up to 32768 tokens",
  )
  g.add_argument(
    "--shape",
    nargs=2,
    type=int,
    action="append",
    metavar=("K", "N"),
    help="schedules, parts, tiles: a kernel shape (repeatable; default: "
    "the suite's)",
  )
  g.add_argument(
    "--configs",
    nargs="+",
    help="schedules, parts, tiles: names of kernel_bench's "
    "MOSAIC_DIAG_CONFIGS or TILE_DIAG_CONFIGS (schedules' default: all "
    "of the first, the first also without the rule and as SGD)",
  )
  g.add_argument(
    "--storage",
    choices=("bf16", "fp32"),
    default="bf16",
    help="parts: the dtype of W and its states",
  )
  g.add_argument(
    "--extras",
    action="store_true",
    help="schedules with --configs: the first also without the rule and as SGD",
  )
  g = p.add_argument_group("step")
  g.add_argument("--config", default="llama-3.1-8b")
  g.add_argument("--variant", nargs="+", choices=("forge", "optax"))
  g.add_argument("--batch", nargs="+", type=int, help="default 1")
  g.add_argument("--seq", nargs="+", type=int, help="default 512 2048")
  g.add_argument(
    "--int8",
    action="store_true",
    help="FORGE with bf16 + stochastic rounding and int8 states",
  )
  g.add_argument(
    "--second-moment-bits",
    type=int,
    choices=(8, 4),
    default=8,
    help="with --int8: 4-bit second moments",
  )
  g.add_argument(
    "--optax-storage",
    action="store_true",
    help="FORGE: the embedding and norms through fj.optax_with_storage",
  )
  g.add_argument(
    "--forge-embedding",
    action="store_true",
    help="FORGE: the embedding as a fj.ForgeEmbed",
  )
  g.add_argument(
    "--mem-fraction",
    type=float,
    help="XLA_CLIENT_MEM_FRACTION of each run (JAX's default 0.75 of the "
    "GPU is too little for optax at the Qwen3-14B shape)",
  )
  g.add_argument("--attention", choices=("cudnn",))
  g.add_argument("--remat-policy")
  g.add_argument("--mosaic-config", help="JSON of MosaicConfig fields")
  g.add_argument("--implementation", default="auto")
  g.add_argument("--profile", action="store_true")
  g.add_argument("--breakdown", action="store_true")
  g = p.add_argument_group("clipping (and step's --config, --batch, --seq)")
  g.add_argument("--max-grad-norm", type=float, default=1.0)
  g = p.add_argument_group("counters, gpu-tests")
  g.add_argument(
    "--probes",
    nargs="+",
    help="counters: kernel_counters.PROBES names (default: all)",
  )
  g.add_argument("-k", help="gpu-tests: pytest's -k expression")
  g.add_argument(
    "--workers",
    type=int,
    default=6,
    help="gpu-tests: pytest-xdist workers sharing the GPU (1: none)",
  )
  args = p.parse_args(argv)
  if args.second_moment_bits == 4 and not args.int8:
    p.error("--second-moment-bits 4 stores int8 second moments: add --int8")
  return args


def run(step: Step, env: dict, dry_run: bool) -> int:
  print(
    "$ "
    + " ".join(map(str, step.argv))
    + (f" > {step.stdout}" if step.stdout else ""),
    flush=True,
  )
  if dry_run:
    return 0
  start = time.time()
  try:
    done = subprocess.run(
      list(map(str, step.argv)),
      cwd=ROOT,
      timeout=step.timeout,
      env={**env, **step.env},
      check=False,
      stdout=subprocess.PIPE if step.stdout else None,
    )
    rc = done.returncode
  except subprocess.TimeoutExpired as e:
    done, rc = e, 124
  except OSError as e:  # e.g. ncu not installed
    print(e, file=sys.stderr)
    return 127
  if step.stdout:
    opener = gzip.open if step.stdout.endswith(".gz") else open
    with opener(step.stdout, "wb") as f:
      f.write(done.stdout or b"")
    if not step.stdout.endswith(".gz"):  # the summary at its end
      print(b"\n".join((done.stdout or b"").splitlines()[-3:]).decode())
  print(f"# rc={rc} after {time.time() - start:.0f} s", flush=True)
  return rc


def main(argv=None):
  a = parse_args(argv)
  a.commit = a.commit or _commit()
  a.timeout = a.timeout or TIMEOUTS.get(a.suite, 600)
  if not a.dry_run:
    os.makedirs(a.out, exist_ok=True)
  tag = f"_{a.tag}" if a.tag else ""
  out = lambda name: os.path.join(a.out, f"{name}{tag}_{a.commit}.json")
  env = {
    **os.environ,
    "FORGE_COMMIT": a.commit,
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": os.pathsep.join(
      filter(None, (ROOT, os.environ.get("PYTHONPATH")))
    ),
  }
  if a.xla_flags is not None:
    env["XLA_FLAGS"] = a.xla_flags
  failed = [
    step for step in SUITES[a.suite](a, out) if run(step, env, a.dry_run) != 0
  ]
  if failed:
    print(f"{len(failed)} command(s) failed", file=sys.stderr)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
