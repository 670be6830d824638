"""Hardware counters of the fused Mosaic kernel beside XLA's GEMM and optax.

Runs each probe once inside a CUDA profiler window (``cuProfilerStart`` /
``cuProfilerStop``), after a warm-up call outside it, so that Nsight Compute
started with ``--profile-from-start off`` measures exactly those launches:

  ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
      --section WarpStateStats ... -o report \\
      python benchmarks/kernel_counters.py --out probes.json

The JSON lists the probes in launch order. A 'gemm' probe launches XLA's
GEMM; an 'unfused' one that GEMM and optax's fusions; a 'fused' one the
Mosaic kernel among small XLA fusions (dy's finiteness, the step's
scalars): ``counters_summary.py`` matches them up. Shapes are
Llama-3.1-8B's MLP (4096 x 14336), bf16 x, dy, W and AdamW state, as in
``kernel_bench.py --suite mosaic-diag``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from forge_jax.ops import backends, mosaic

sys.path.insert(0, __file__.rsplit("/", 1)[0])
# pylint: disable=wrong-import-position
import lowp_breakdown
from kernel_bench import (
  CHECK_OPTIMIZERS,
  NAMED_DIAG_CONFIGS,
  fused_runner,
  make_inputs,
  rule_free_epilogue,
  unfused_runner,
)
from timing import metadata

K, N = 4096, 14336

RULE_FREE = "rule-free"
PASSED_THROUGH = "quantizer passed through"
E4M3, E4M3_SCALES_KEPT = lowp_breakdown.E4M3, lowp_breakdown.E4M3_SCALES_KEPT
#: Timing-only changes of the traced kernel, by name: each a function of
#: no arguments returning a context manager to trace the kernel in.
VARIANTS = {
  RULE_FREE: rule_free_epilogue,
  PASSED_THROUGH: lowp_breakdown.quantizer_passed_through,
  **lowp_breakdown.E4M3_VARIANTS,
}
#: (name, what, tokens, config, optimizer, variant). ``what``: 'gemm',
#: 'unfused' or 'fused'; ``config``: a key of NAMED_DIAG_CONFIGS, or
#: None for the default config of the call; ``optimizer``: a key of
#: CHECK_OPTIMIZERS, with ``+storage`` (a key of STORAGES) for
#: low-precision storage; ``variant``: None, or a key of VARIANTS (a
#: timing-only change of the traced kernel).
PROBES = (
  ("gemm-T512", "gemm", 512, None, "adamw", None),
  ("unfused-T512", "unfused", 512, None, "adamw", None),
  ("inline-T512", "fused", 512, "inline-steps5", "adamw", None),
  ("inline-T512-rule-free", "fused", 512, "inline-steps5", "adamw", RULE_FREE),
  ("inline-T64-rule-free", "fused", 64, "inline-steps5", "adamw", RULE_FREE),
  ("pingpong-T512", "fused", 512, "pingpong-steps4-slots3", "adamw", None),
  ("gemm-T2048", "gemm", 2048, None, "adamw", None),
  ("inline-T2048", "fused", 2048, "inline-steps5", "adamw", None),
  ("pingpong-T2048", "fused", 2048, "pingpong-steps4-slots3", "adamw", None),
  ("gemm-T8192", "gemm", 8192, None, "adamw", None),
  ("pingpong-T8192-sgd", "fused", 8192, "pingpong-steps4-slots3", "sgd", None),
  # What 128 x 256 CTA tiles spend beyond their main loop (twice the
  # default's): the W / state stream through the one epilogue buffer that
  # fits, and the rule's spills beside a 128-register accumulator.
  ("inline-T8192", "fused", 8192, "inline-steps5", "adamw", None),
  (
    "inline-T8192-rule-free",
    "fused",
    8192,
    "inline-steps5",
    "adamw",
    RULE_FREE,
  ),
  ("wide-T8192", "fused", 8192, "inline-wide-steps4-slots1", "adamw", None),
  (
    "wide-T8192-rule-free",
    "fused",
    8192,
    "inline-wide-steps4-slots1",
    "adamw",
    RULE_FREE,
  ),
  ("wide-slots2-T8192", "fused", 8192, "inline-wide-steps3", "adamw", None),
  # Where int8 states' time goes: each storage in its default config.
  ("bf16-T512", "fused", 512, None, "adamw", None),
  ("bf16-sr-T512", "fused", 512, None, "adamw+sr", None),
  ("int8-T512", "fused", 512, None, "adamw+int8", None),
  ("int8-sr-T512", "fused", 512, None, "adamw+int8-sr", None),
  ("bf16-sr-T2048", "fused", 2048, None, "adamw+sr", None),
  ("int8-sr-T2048", "fused", 2048, None, "adamw+int8-sr", None),
  # What int8's quantizer spends: its codes stored back unchanged, and
  # lowp_breakdown.py's e4m3 codes with and without the block maximum.
  (
    "int8-passed-through-T512",
    "fused",
    512,
    None,
    "adamw+int8",
    PASSED_THROUGH,
  ),
  ("int8-e4m3-T512", "fused", 512, None, "adamw+int8", E4M3),
  ("int8-e4m3-kept-T512", "fused", 512, None, "adamw+int8", E4M3_SCALES_KEPT),
)

#: Low-precision storage of the probes' optimizers (bf16 W and states
#: otherwise).
STORAGES = {
  "sr": dict(weight_rounding="stochastic"),
  "int8": dict(state_dtype="int8"),
  "int8-sr": dict(state_dtype="int8", weight_rounding="stochastic"),
}


def _profiler(call: str):
  """cuProfilerStart / cuProfilerStop of the driver API (what
  ``--profile-from-start off`` waits for)."""
  result = getattr(ctypes.CDLL("libcuda.so.1"), call)()
  if result:
    raise RuntimeError(f"{call} returned CUresult {result}")


def build(what, tokens, config_name, opt_name, variant):
  """A no-argument function that launches the probe's kernel(s) once."""
  x, dy, w = make_inputs(jax.random.key(tokens), tokens, K, N)
  w = w.astype(jnp.bfloat16)
  base, _, storage = opt_name.partition("+")
  optimizer = CHECK_OPTIMIZERS[base]
  if storage:
    optimizer = dataclasses.replace(optimizer, **STORAGES[storage])
  if what == "gemm":
    gemm = jax.jit(backends.weight_gradient)
    return lambda: gemm(x, dy)
  if what == "unfused":
    return unfused_runner(optimizer, w, x, dy)
  with VARIANTS[variant]() if variant else contextlib.nullcontext():
    config = (
      config_name and NAMED_DIAG_CONFIGS[config_name]
    ) or mosaic.default_config(x, w, optimizer)
    run = fused_runner(optimizer, config, w, x, dy)
    jax.block_until_ready(run())  # compiles with the rule chosen
  return run


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--only", nargs="*", help="probe names (default: all)")
  args = parser.parse_args()
  probes = [p for p in PROBES if not args.only or p[0] in args.only]
  runs = []
  for name, *spec in probes:
    run = build(*spec)
    jax.block_until_ready(run())  # warm-up, outside the profiler's window
    runs.append((name, run))
  _profiler("cuProfilerStart")
  for _, run in runs:
    jax.block_until_ready(run())
  _profiler("cuProfilerStop")
  with open(args.out, "w") as f:
    json.dump(
      {
        "meta": metadata(),
        "k": K,
        "n": N,
        "probes": [
          {
            "name": name,
            "what": what,
            "tokens": tokens,
            "config": config,
            "optimizer": opt_name,
            "variant": variant,
          }
          for name, what, tokens, config, opt_name, variant in probes
        ],
      },
      f,
      indent=1,
    )
  print("probes:", [name for name, _ in runs])


if __name__ == "__main__":
  main()
