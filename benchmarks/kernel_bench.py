"""FORGE's fused weight update against XLA, side by side in one run.

For each weight shape K x N, token count T and optimizer, three things are
timed on the device (profiler kernel time, median of repeats):

  (a) gemm:    dW = x.T @ dy through XLA (bf16 inputs, float32 dW);
  (b) unfused: the same GEMM, then the optax alias's update, jitted with the
               weights and state donated (the standard two-phase step);
  (c) fused:   FORGE's Pallas-Triton kernel: dW tiles in float32 registers,
               the update applied in the epilogue, W and state in place;
  (d) fused_mosaic: the Mosaic GPU kernel (suite 'mosaic'): wgmma, TMA,
               warp specialization, the same epilogue.

Weights and optimizer states are float32, x and dy bfloat16. It also checks
the fused kernel against the XLA reference backend for every optimizer at
Llama-3.1-8B layer shapes, sweeps tile configurations, and reads the compiled
memory of the fused step (aliasing). Results: JSON (see --out).

  python benchmarks/kernel_bench.py --suite full --out results.json
  python benchmarks/kernel_bench.py --suite mosaic --out results.json
  python benchmarks/kernel_bench.py --suite mosaic --mosaic-defaults --out r.json
  python benchmarks/kernel_bench.py --suite mosaic-diag --out diag.json
  python benchmarks/kernel_bench.py --suite tiny   # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import optax

import forge_jax as fj
from forge_jax.ops import backends, mosaic, triton_kernel
from forge_jax.ops.fused_dense import FusedDenseSpec
from forge_jax.ops.mosaic import epilogue

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import device_time_ms, metadata  # pylint: disable=wrong-import-position

LLAMA_SHAPES = [
  (4096, 4096),
  (4096, 1024),
  (4096, 14336),
  (14336, 4096),
  (4096, 128256),
]

BENCH_OPTIMIZERS = {
  "adamw": fj.adamw(1e-3, weight_decay=0.1),
  "sgd_momentum": fj.sgd(1e-2, momentum=0.9),
  "lion": fj.lion(1e-4),
}

SWEEP_OPTIMIZERS = {"adamw": BENCH_OPTIMIZERS["adamw"], "sgd": fj.sgd(1e-2)}

CHECK_OPTIMIZERS = {
  "adam": fj.adam(1e-3),
  "adamw": fj.adamw(optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.1),
  "nadam": fj.nadam(1e-3),
  "nadamw": fj.nadamw(1e-3, weight_decay=0.1),
  "radam": fj.radam(1e-3, b2=0.9),
  "lion": fj.lion(1e-4),
  "rmsprop": fj.rmsprop(1e-3),
  "rmsprop_centered_momentum": fj.rmsprop(
    1e-3, centered=True, momentum=0.9, nesterov=True
  ),
  "adagrad": fj.adagrad(1e-2),
  "sgd": fj.sgd(1e-2),
  "sgd_momentum": fj.sgd(1e-2, momentum=0.9),
  "sgd_nesterov": fj.sgd(1e-2, momentum=0.9, nesterov=True),
}


def make_inputs(key, tokens, k, n, act_dtype=jnp.bfloat16):
  kx, kdy, kw = jax.random.split(key, 3)
  x = jax.random.normal(kx, (tokens, k), jnp.float32).astype(act_dtype)
  dy = (jax.random.normal(kdy, (tokens, n), jnp.float32) * 1e-2).astype(
    act_dtype
  )
  w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
  return x, dy, w


def fused_step(optimizer, config, interpret=None):
  """The fused kernel that ``config`` configures (Triton or Mosaic GPU)."""
  update = (
    mosaic.mosaic_update
    if isinstance(config, mosaic.MosaicConfig)
    else triton_kernel.triton_update
  )
  spec = FusedDenseSpec(optimizer=optimizer)

  def step(w, state, count, x, dy):
    scalars = optimizer.scalars(count)
    apply = jnp.all(jnp.isfinite(dy))
    new_w, new_state, skipped, _ = update(
      spec, x, dy, w, state, scalars, apply, config=config, interpret=interpret
    )
    return new_w, new_state, skipped

  return jax.jit(step, donate_argnums=(0, 1))


def reference_step(optimizer):
  spec = FusedDenseSpec(optimizer=optimizer, implementation="xla")
  # The fused steps here pass no rounding key: their kernels draw stochastic
  # rounding's bits from key 0, and so does the reference.
  key = jnp.uint32(0) if optimizer.weight_rounding == "stochastic" else None

  def step(w, state, count, x, dy):
    scalars = optimizer.scalars(count)
    apply = jnp.all(jnp.isfinite(dy))
    return backends.xla_update(
      spec, x, dy, w, state, scalars, apply, rounding_key=key
    )[:3]

  return jax.jit(step)


def unfused_step(optimizer):
  tx = optimizer.to_optax()

  def step(w, tx_state, x, dy):
    grad = backends.weight_gradient(x, dy)
    updates, tx_state = tx.update(grad, tx_state, w)
    return optax.apply_updates(w, updates), tx_state

  return jax.jit(step, donate_argnums=(0, 1)), tx


def fused_runner(optimizer, config, w, x, dy):
  """A no-argument function running one fused step per call on a copy of
  ``w`` and a fresh state, carried (donated) from call to call."""
  step = fused_step(optimizer, config)
  carry = {"w": jnp.copy(w), "s": optimizer.init(w)}
  count = jnp.asarray(0, jnp.int32)

  def run():
    carry["w"], carry["s"], _ = step(carry["w"], carry["s"], count, x, dy)
    return carry["w"]

  return run


def unfused_runner(optimizer, w, x, dy):
  """Like :func:`fused_runner` for the GEMM + optax step."""
  step, tx = unfused_step(optimizer)
  carry = {"w": jnp.copy(w), "s": tx.init(w)}

  def run():
    carry["w"], carry["s"] = step(carry["w"], carry["s"], x, dy)
    return carry["w"]

  return run


def rel_err(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def check_case(
  name,
  optimizer,
  k,
  n,
  tokens,
  config,
  seed,
  interpret=None,
  poison_x_column=None,
):
  """Fused kernel vs XLA reference: one step from a non-trivial state.
  ``poison_x_column``: a NaN in that column of x (its dW row is non-finite:
  those elements must be skipped and counted)."""
  key = jax.random.key(seed)
  x, dy, w = make_inputs(key, tokens, k, n)
  if poison_x_column is not None:
    x = x.at[0, poison_x_column].set(jnp.nan)
  state = jax.tree.map(
    lambda s: (
      s + 1e-3 * jax.random.uniform(jax.random.fold_in(key, 7), s.shape)
      if s is not None
      else None
    ),
    optimizer.init(w),
  )
  count = jnp.asarray(3, jnp.int32)
  ref_w, ref_state, ref_skipped = reference_step(optimizer)(
    w, state, count, x, dy
  )
  # Poison: the fused step writes over copies, so stale values would show.
  fused_w, fused_state, skipped = fused_step(optimizer, config, interpret)(
    jnp.copy(w), jax.tree.map(jnp.copy, state), count, x, dy
  )
  result = {
    "optimizer": name,
    "k": k,
    "n": n,
    "tokens": tokens,
    "kernel": type(config).__name__,
    # The update itself (new - old), not W, which would hide its errors.
    "update_rel_err": rel_err(
      jnp.nan_to_num(fused_w - w), jnp.nan_to_num(ref_w - w)
    ),
    "state_rel_err": {
      str(i): rel_err(a, b)
      for i, (a, b) in enumerate(
        zip(jax.tree.leaves(fused_state), jax.tree.leaves(ref_state))
      )
    },
    "skipped": int(skipped),
    "ref_skipped": int(ref_skipped),
    "finite": bool(jnp.all(jnp.isfinite(fused_w))),
  }
  return result


def bench_case(
  opt_name,
  optimizer,
  k,
  n,
  tokens,
  config,
  seed=0,
  calls=10,
  repeats=5,
  mosaic_config=None,
):
  key = jax.random.key(seed)
  x, dy, w = make_inputs(key, tokens, k, n)
  flops = 2.0 * tokens * k * n
  out = {
    "optimizer": opt_name,
    "k": k,
    "n": n,
    "tokens": tokens,
    "config": dataclasses.asdict(config),
  }

  gemm = jax.jit(backends.weight_gradient)
  out["gemm"] = device_time_ms(
    lambda: gemm(x, dy), calls=calls, repeats=repeats
  )

  unfused, tx = unfused_step(optimizer)
  carry = {"w": jnp.copy(w), "s": tx.init(w)}

  def run_unfused():
    carry["w"], carry["s"] = unfused(carry["w"], carry["s"], x, dy)
    return carry["w"]

  out["unfused"] = device_time_ms(run_unfused, calls=calls, repeats=repeats)
  del carry["w"], carry["s"]

  fused = fused_step(optimizer, config)
  count = jnp.asarray(0, jnp.int32)
  fcarry = {"w": jnp.copy(w), "s": optimizer.init(w)}
  memory = (
    fused.lower(fcarry["w"], fcarry["s"], count, x, dy)
    .compile()
    .memory_analysis()
  )
  if memory is not None:
    out["fused_memory"] = {
      "temp_bytes": memory.temp_size_in_bytes,
      "alias_bytes": memory.alias_size_in_bytes,
      "weight_and_state_bytes": sum(
        a.size * a.dtype.itemsize
        for a in jax.tree.leaves((fcarry["w"], fcarry["s"]))
      ),
    }

  def run_fused():
    fcarry["w"], fcarry["s"], _ = fused(fcarry["w"], fcarry["s"], count, x, dy)
    return fcarry["w"]

  out["fused"] = device_time_ms(run_fused, calls=calls, repeats=repeats)
  variants = ["gemm", "unfused", "fused"]

  if mosaic_config is not None:
    mosaic = fused_step(optimizer, mosaic_config)
    out["mosaic_config"] = dataclasses.asdict(mosaic_config)

    def run_mosaic():
      fcarry["w"], fcarry["s"], _ = mosaic(
        fcarry["w"], fcarry["s"], count, x, dy
      )
      return fcarry["w"]

    out["fused_mosaic"] = device_time_ms(
      run_mosaic, calls=calls, repeats=repeats
    )
    out["mosaic_over_gemm"] = out["fused_mosaic"]["ms"] / out["gemm"]["ms"]
    out["unfused_over_mosaic"] = (
      out["unfused"]["ms"] / out["fused_mosaic"]["ms"]
    )
    variants.append("fused_mosaic")
  del fcarry["w"], fcarry["s"]

  for variant in variants:
    out[variant]["tflops"] = flops / (out[variant]["ms"] * 1e-3) / 1e12
  out["fused_over_gemm"] = out["fused"]["ms"] / out["gemm"]["ms"]
  out["unfused_over_fused"] = out["unfused"]["ms"] / out["fused"]["ms"]
  return out


SWEEP_CONFIGS = [
  triton_kernel.TritonConfig(128, 128, 128, 8, 3),
  triton_kernel.TritonConfig(128, 128, 128, 8, 3, epilogue_split=2),
  triton_kernel.TritonConfig(128, 128, 64, 8, 3, epilogue_split=2),
  triton_kernel.TritonConfig(128, 128, 64, 8, 2, epilogue_split=4),
  triton_kernel.TritonConfig(128, 128, 64, 4, 3, epilogue_split=4),
  triton_kernel.TritonConfig(128, 128, 32, 8, 3, epilogue_split=2),
  triton_kernel.TritonConfig(64, 128, 128, 4, 3, epilogue_split=2),
  triton_kernel.TritonConfig(128, 64, 128, 4, 3),
]


MOSAIC_SWEEP_CONFIGS = [
  # float32 storage: the inline schedule with five stages and one
  # epilogue buffer a warpgroup beside pingpong (a warpgroup per 128 x 128
  # tile, the two taking turns).
  mosaic.MosaicConfig(max_concurrent_steps=5, epilogue_slots=1),
  mosaic.MosaicConfig(
    schedule="pingpong", tile_n=128, max_concurrent_steps=5, epilogue_slots=1
  ),
  mosaic.MosaicConfig(
    schedule="pingpong", tile_n=128, max_concurrent_steps=4, epilogue_slots=1
  ),
  mosaic.MosaicConfig(
    schedule="pingpong", tile_n=128, max_concurrent_steps=3, epilogue_slots=2
  ),
]


def adamw_medians(bench, keys) -> dict:
  """Per token count, the median over the AdamW rows of each ratio in
  ``keys``, as ``{"median_<key>": ...}``."""
  summary = {}
  for tokens in sorted({r["tokens"] for r in bench}):
    rows = [
      r for r in bench if r["tokens"] == tokens and r["optimizer"] == "adamw"
    ]
    if rows:
      summary[str(tokens)] = {
        f"median_{key}": statistics.median(r[key] for r in rows) for key in keys
      }
  return summary


def print_table(rows):
  print(
    f"{'opt':>13} {'K':>6} {'N':>7} {'T':>6} | {'gemm ms':>8} {'unfused':>8} "
    f"{'fused':>8} {'mosaic':>8} | {'fused TF/s':>10} | {'fused/gemm':>10} "
    f"{'unf/fused':>9} | {'mos/gemm':>8} {'unf/mos':>8}"
  )
  for r in rows:
    mosaic = r.get("fused_mosaic")
    mosaic_cols = (
      f"{r['mosaic_over_gemm']:8.3f} {r['unfused_over_mosaic']:8.3f}"
      if mosaic
      else f"{'-':>8} {'-':>8}"
    )
    print(
      f"{r['optimizer']:>13} {r['k']:>6} {r['n']:>7} {r['tokens']:>6} | "
      f"{r['gemm']['ms']:8.3f} {r['unfused']['ms']:8.3f} {r['fused']['ms']:8.3f} "
      f"{mosaic['ms'] if mosaic else float('nan'):8.3f} | "
      f"{r['fused']['tflops']:10.1f} | {r['fused_over_gemm']:10.3f} "
      f"{r['unfused_over_fused']:9.3f} | {mosaic_cols}",
      flush=True,
    )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--suite",
    default="quick",
    choices=["tiny", "quick", "sweep", "full", "mosaic", "mosaic-diag"],
  )
  parser.add_argument("--out", default="kernel_bench.json")
  parser.add_argument(
    "--config",
    default=None,
    help="block_k,block_n,block_t,num_warps,num_stages",
  )
  parser.add_argument(
    "--mosaic-defaults",
    action="store_true",
    help="suite 'mosaic': no sweep; each case runs the "
    "kernel's default config for its shape and dtypes",
  )
  parser.add_argument(
    "--diag-configs",
    nargs="*",
    default=None,
    help="suite 'mosaic-diag': these MOSAIC_DIAG_CONFIGS or "
    "TILE_DIAG_CONFIGS only, without the rule-free and SGD runs "
    "(unless --diag-extras)",
  )
  parser.add_argument(
    "--diag-shape",
    nargs=2,
    type=int,
    default=(4096, 14336),
    metavar=("K", "N"),
    help="suite 'mosaic-diag': the kernel's shape",
  )
  parser.add_argument(
    "--diag-storage",
    choices=("bfloat16", "float32"),
    default="bfloat16",
    help="suite 'mosaic-diag': the dtype of W and the optimizer's states",
  )
  parser.add_argument(
    "--diag-extras",
    action="store_true",
    help="suite 'mosaic-diag' with --diag-configs: the "
    "first config also rule-free and as SGD",
  )
  parser.add_argument(
    "--tokens",
    nargs="*",
    type=int,
    default=None,
    help="suites 'mosaic-diag' and 'mosaic': token counts "
    "(default 512 2048 8192 and 2048 8192)",
  )
  parser.add_argument(
    "--time-budget-s",
    type=float,
    default=500.0,
    help="stop starting new cases after this many seconds",
  )
  args = parser.parse_args()
  started = time.time()
  result = {
    "meta": metadata(),
    "suite": args.suite,
    "checks": [],
    "sweep": [],
    "bench": [],
  }

  def save():
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)

  config = (
    triton_kernel.TritonConfig(*map(int, args.config.split(",")))
    if args.config
    else triton_kernel.TritonConfig()
  )
  result["config"] = dataclasses.asdict(config)
  if args.suite == "tiny":
    config = triton_kernel.TritonConfig(16, 16, 16, 4, 1, epilogue_split=1)
    for name, opt in CHECK_OPTIMIZERS.items():
      result["checks"].append(check_case(name, opt, 40, 24, 37, config, 0))
    result["bench"].append(
      bench_case(
        "adamw",
        BENCH_OPTIMIZERS["adamw"],
        64,
        32,
        64,
        config,
        calls=2,
        repeats=2,
      )
    )
    print_table(result["bench"])
    save()
    return

  if args.suite == "mosaic":
    mosaic_suite(args, result, save, config, started)
    return
  if args.suite == "mosaic-diag":
    configs = (
      {name: NAMED_DIAG_CONFIGS[name] for name in args.diag_configs}
      if args.diag_configs
      else None
    )
    mosaic_diagnosis(
      result,
      save,
      configs,
      *args.diag_shape,
      extras=configs is None or args.diag_extras,
      token_counts=tuple(args.tokens or (512, 2048, 8192)),
      storage=args.diag_storage,
    )
    return

  # 1. Correctness at Llama-3.1-8B layer shapes, every optimizer.
  for name, opt in CHECK_OPTIMIZERS.items() if args.suite != "sweep" else ():
    for k, n in ((4096, 4096), (4096, 14336)):
      r = check_case(name, opt, k, n, 2048, config, seed=len(result["checks"]))
      result["checks"].append(r)
      print(
        f"check {name:>26} {k}x{n}: update rel err {r['update_rel_err']:.2e} "
        f"state {max(r['state_rel_err'].values(), default=0):.2e} "
        f"skipped {r['skipped']}/{r['ref_skipped']}",
        flush=True,
      )
  save()

  # 2. Tile sweep on one shape.
  if args.suite == "sweep":
    sweep = SWEEP_CONFIGS
    sweep_cases = [("adamw", cfg) for cfg in sweep]
    # Plain SGD touches only W in the epilogue: the gap to adamw is the cost
    # of the state traffic; the gap to the gemm is the main loop's.
    sweep_cases += [("sgd", cfg) for cfg in sweep[:2]]
    for opt_name, cfg in sweep_cases:
      try:
        r = bench_case(
          opt_name,
          SWEEP_OPTIMIZERS[opt_name],
          4096,
          4096,
          8192,
          cfg,
          calls=5,
          repeats=3,
        )
      except Exception as e:  # a config the compiler rejects (shared memory)
        r = {"config": dataclasses.asdict(cfg), "error": repr(e)[:300]}
      result["sweep"].append(r)
      if "error" not in r:
        print(
          f"sweep {opt_name} {cfg}: fused {r['fused']['ms']:.3f} ms, gemm "
          f"{r['gemm']['ms']:.3f}",
          flush=True,
        )
      save()
    ok = [
      r
      for r in result["sweep"]
      if "error" not in r and r["optimizer"] == "adamw"
    ]
    if ok and args.config is None:
      best = min(ok, key=lambda r: r["fused"]["ms"])
      config = triton_kernel.TritonConfig(**best["config"])
      result["best_config"] = best["config"]

  # 3. The benchmark table.
  cases = []
  tokens_list = {"quick": (8192,), "sweep": (2048, 8192)}.get(
    args.suite, (2048, 8192, 32768)
  )
  shapes = LLAMA_SHAPES[:4] if args.suite == "sweep" else LLAMA_SHAPES
  for tokens in tokens_list:
    for k, n in shapes:
      cases.append(("adamw", k, n, tokens))
  if args.suite == "full":
    for opt_name in ("sgd_momentum", "lion"):
      for tokens in (2048, 8192):
        for k, n in LLAMA_SHAPES[:4]:
          cases.append((opt_name, k, n, tokens))
  for opt_name, k, n, tokens in cases:
    if time.time() - started > args.time_budget_s:
      result["truncated"] = (
        f"time budget reached before {opt_name} {k}x{n} T={tokens}"
      )
      break
    result["bench"].append(
      bench_case(opt_name, BENCH_OPTIMIZERS[opt_name], k, n, tokens, config)
    )
    print_table(result["bench"][-1:])
    save()

  summary = adamw_medians(
    result["bench"], ("fused_over_gemm", "unfused_over_fused")
  )
  result["summary_adamw"] = summary
  save()
  print_table(result["bench"])
  print(json.dumps(summary, indent=1))


def _pingpong(**fields) -> mosaic.MosaicConfig:
  return mosaic.MosaicConfig(schedule="pingpong", tile_n=128, **fields)


#: bf16 kernel and states (the whole-step configuration): which schedule is
#: fastest, and where the time goes.
MOSAIC_DIAG_CONFIGS = {
  # The schedules' defaults first (the first is also timed as plain SGD
  # and in each of DIAG_PATCHES): inline, and pingpong, which ranks first
  # from 2048 tokens on the MLP shapes; inline with four stages (a
  # power-of-two ring) and with 64 x 16 sub-tiles.
  "inline-steps5": mosaic.MosaicConfig(max_concurrent_steps=5),
  "pingpong-steps4-slots3": _pingpong(max_concurrent_steps=4, epilogue_slots=3),
  "inline-steps4": mosaic.MosaicConfig(max_concurrent_steps=4),
  "inline-steps5-en16": mosaic.MosaicConfig(
    max_concurrent_steps=5, epilogue_n=16
  ),
  # Does the W / m / v stream evict x and dy from L2? Then the tile order
  # (the grid's width of consecutive N-blocks) changes the time.
  "inline-steps5-width1": mosaic.MosaicConfig(
    max_concurrent_steps=5, grid_tile_width=1
  ),
  "inline-steps5-width32": mosaic.MosaicConfig(
    max_concurrent_steps=5, grid_tile_width=32
  ),
  # The kernel's default config for each case (first with --diag-configs
  # default ...: its parts timed).
  "default": None,
}

#: Configs named like MOSAIC_DIAG_CONFIGS and timed only when
#: ``--diag-configs`` names them: the tile shapes tried where the main loop
#: bounds (``run.py tiles``; each lost to the default, the kernel notes'
#: "What was tried"), and the inline schedule that float32 storage's parts
#: are timed in (``run.py parts --storage fp32``).
TILE_DIAG_CONFIGS = {
  # float32 W, m and v fit one epilogue buffer a warpgroup beside five
  # stages (the float32 default's inline config).
  "inline-steps5-slots1": mosaic.MosaicConfig(
    max_concurrent_steps=5, epilogue_slots=1
  ),
  # 128 tokens a pipeline step: half the steps, barrier round trips and
  # wgmma issues of a tile for the same tokens in flight; the stages take
  # the shared memory of the second epilogue buffer.
  "inline-t128-steps3": mosaic.MosaicConfig(
    tile_t=128, max_concurrent_steps=3, epilogue_slots=1
  ),
  "inline-t128-steps2-slots2": mosaic.MosaicConfig(
    tile_t=128, max_concurrent_steps=2
  ),
  "pingpong-t128-steps2-slots3": _pingpong(
    tile_t=128, max_concurrent_steps=2, epilogue_slots=3
  ),
  # 128 x 256 CTA tiles (two 128 x 128 parts): their main loop matches
  # XLA's GEMM from 2048 tokens, and each thread keeps a 128-register
  # accumulator beside the update.
  "inline-wide-steps4-slots1": mosaic.MosaicConfig(
    tile_n=128, max_concurrent_steps=4, epilogue_slots=1
  ),
  "inline-wide-steps3": mosaic.MosaicConfig(tile_n=128, max_concurrent_steps=3),
  # The same with 64 x 16 epilogue sub-tiles: half the rule's live values
  # beside the accumulator, in two buffers a warpgroup.
  "inline-wide-steps4-en16": mosaic.MosaicConfig(
    tile_n=128, max_concurrent_steps=4, epilogue_n=16
  ),
}

#: Every config ``--diag-configs`` may name.
NAMED_DIAG_CONFIGS = {**MOSAIC_DIAG_CONFIGS, **TILE_DIAG_CONFIGS}


def _rule_free_update(optimizer, grad, kernel, state, *_, **__):
  """The epilogue without the optimizer's arithmetic: W and state are loaded
  and stored unchanged (the diagnosis's measure of the rule's cost)."""
  del optimizer
  return kernel, state, jnp.isfinite(grad)


@contextlib.contextmanager
def mosaic_patched(name: str, value: Any, enabled: bool = True):
  """While active (and ``enabled``), every module of the Mosaic kernel sees
  ``value`` as ``name`` (a kernel traced inside uses it)."""
  with contextlib.ExitStack() as patches:
    if enabled:
      for key, module in list(sys.modules.items()):
        if key.startswith("forge_jax.ops.mosaic") and hasattr(module, name):
          patches.enter_context(mock.patch.object(module, name, value))
    yield


def rule_free_epilogue(enabled: bool = True):
  """While active (and ``enabled``), the Mosaic kernel traces its epilogue
  without the optimizer's arithmetic: a step must first be called (traced)
  inside."""
  return mosaic_patched("apply_update", _rule_free_update, enabled)


def _skipped_counts_only(grad, updated):
  """``row_sums`` without the sums of squares: zeros in the counts' row
  layout (a constant vector has no layout the kernel's store takes). The
  counts' formula is written out: calling ``row_sums`` would trace the
  squares this run leaves out."""
  del grad
  skipped = jnp.sum(jnp.where(updated, 0.0, 1.0), axis=1)
  return skipped, skipped * 0.0


def without_norm_sums(enabled: bool = True):
  """While active (and ``enabled``), the Mosaic kernel traces its epilogue
  without the per-row sums of squared ``dW`` elements (the layer's part of
  the gradient norm; zeros instead): their cost in the update."""
  return mosaic_patched("row_sums", _skipped_counts_only, enabled)


def _main_loop_update(self, buffer, k0, n0, grad, release=None):
  """``Epilogue.update`` without the update: no W or state waited for,
  changed or stored; each row's sum of squares still reads ``grad``, so the
  main loop that accumulates it stays whole."""
  del self, buffer, k0, n0
  if release is not None:
    release()
  squares = jnp.sum(grad * grad, axis=1)
  return squares * 0.0, squares


#: Why the diagnosis times no pingpong main loop alone.
MAIN_LOOP_PINGPONG = (
  "pingpong's loader counts each epilogue buffer's releases by the phase "
  "of one barrier; released without waiting for loads, a buffer can be "
  "released twice before the loader waits once, and the kernel hangs"
)


@contextlib.contextmanager
def main_loop_only(enabled: bool = True):
  """While active (and ``enabled``), the Mosaic kernel traces its main loop
  alone: its epilogue issues no W or state loads and updates nothing (the
  kernel's outputs are not a step; a measurement of the ``dW`` GEMM inside
  the fused kernel, with its config, shared memory and tile walk). The
  inline schedule only: :data:`MAIN_LOOP_PINGPONG` says why."""
  with contextlib.ExitStack() as patches:
    if enabled:
      no_loads = lambda *_, **__: None
      for name, value in (
        ("issue_loads", no_loads),
        ("update", _main_loop_update),
      ):
        patches.enter_context(mock.patch.object(epilogue.Epilogue, name, value))
    yield


#: The diagnosis's extra runs of its first config: the suffix of each run's
#: name and the patch its kernel is traced in.
DIAG_PATCHES = {
  "rule-free": rule_free_epilogue,
  "main-loop": main_loop_only,
  "no-norm-sums": without_norm_sums,
}


def mosaic_diagnosis(
  result,
  save,
  configs=None,
  k=4096,
  n=14336,
  token_counts=(512, 2048, 8192),
  extras=True,
  storage="bfloat16",
):
  """Mosaic kernel time with ``storage`` W and states (the optimizers'
  states take W's dtype) per epilogue config (default:
  MOSAIC_DIAG_CONFIGS; a config of None is the kernel's default for the
  case) and token count, beside the GEMM and GEMM + optax; with
  ``extras``, for the first config also with plain SGD (W only, no state)
  and traced in each of ``DIAG_PATCHES``: without the rule's arithmetic,
  its main loop alone, and without the norm's sums of squares."""
  configs = configs or MOSAIC_DIAG_CONFIGS
  for tokens in token_counts:
    x, dy, w = make_inputs(jax.random.key(tokens), tokens, k, n)
    w = w.astype(storage)
    gemm = jax.jit(backends.weight_gradient)
    row = {
      "k": k,
      "n": n,
      "tokens": tokens,
      "storage": storage,
      "gemm_ms": device_time_ms(lambda: gemm(x, dy))["ms"],
    }
    run_unfused = unfused_runner(BENCH_OPTIMIZERS["adamw"], w, x, dy)
    row["unfused_ms"] = device_time_ms(run_unfused)["ms"]
    del run_unfused  # frees its weights and state
    variants = [(name, "adamw", cfg) for name, cfg in configs.items()]
    first = next(iter(configs))
    if extras:
      variants += [(first + "-sgd", "sgd", configs[first])]
      variants += [
        (f"{first}-{suffix}", "adamw", configs[first])
        for suffix in DIAG_PATCHES
      ]
    for name, opt_name, cfg in variants:
      optimizer = CHECK_OPTIMIZERS[opt_name]
      cfg = cfg or mosaic.default_config(x, w, optimizer)
      row[name + "_config"] = dataclasses.asdict(cfg)
      if name.endswith("-main-loop") and cfg.schedule == "pingpong":
        row[name + "_error"] = MAIN_LOOP_PINGPONG
        continue
      try:
        with contextlib.ExitStack() as patches:
          for suffix, patch in DIAG_PATCHES.items():
            patches.enter_context(patch(name.endswith("-" + suffix)))
          run_fused = fused_runner(optimizer, cfg, w, x, dy)
          row[name + "_ms"] = device_time_ms(run_fused)["ms"]
      except Exception as e:  # pylint: disable=broad-except
        row[name + "_error"] = repr(e)[-300:]
      print(f"diag T={tokens} {name}: {row.get(name + '_ms')}", flush=True)
    result["bench"].append(row)
    save()
  timed = {
    name: [r[name + "_ms"] / r["gemm_ms"] for r in result["bench"]]
    for name in configs
    if all(name + "_ms" in r for r in result["bench"])
  }
  result["best_diag_config"] = {
    str(r["tokens"]): min(
      (c for c in configs if c + "_ms" in r), key=lambda c: r[c + "_ms"]
    )
    for r in result["bench"]
  }
  result["best_diag_config_fields"] = {
    str(r["tokens"]): r[
      result["best_diag_config"][str(r["tokens"])] + "_config"
    ]
    for r in result["bench"]
  }
  result["diag_over_gemm"] = timed
  save()
  print(
    json.dumps(
      {"best": result["best_diag_config"], "over_gemm": timed}, indent=1
    )
  )


def mosaic_sweep(result, save, triton_config) -> mosaic.MosaicConfig:
  """Times every MOSAIC_SWEEP_CONFIGS entry at 4096 x 4096 (T = 8192, 2048)
  and returns the best over both token counts: least summed time relative
  to each count's fastest (correct runs only)."""
  for tokens in (8192, 2048):
    for cfg in MOSAIC_SWEEP_CONFIGS:
      try:
        check = check_case(
          "adamw",
          CHECK_OPTIMIZERS["adamw"],
          4096,
          4096,
          tokens,
          cfg,
          seed=tokens,
        )
        r = bench_case(
          "adamw",
          BENCH_OPTIMIZERS["adamw"],
          4096,
          4096,
          tokens,
          triton_config,
          calls=5,
          repeats=3,
          mosaic_config=cfg,
        )
        r["check"] = check
      except Exception as e:  # pylint: disable=broad-except
        r = {
          "mosaic_config": dataclasses.asdict(cfg),
          "tokens": tokens,
          "error": repr(e)[-600:],
        }
      result["sweep"].append(r)
      print(
        f"mosaic sweep T={tokens} {cfg}: "
        f"{r.get('fused_mosaic', r.get('error'))} "
        f"err {r.get('check', {}).get('update_rel_err')}",
        flush=True,
      )
      save()
  ok = [
    r
    for r in result["sweep"]
    if "error" not in r and r["check"]["update_rel_err"] < 1e-5
  ]
  fastest = {
    t: min(r["fused_mosaic"]["ms"] for r in ok if r["tokens"] == t)
    for t in {r["tokens"] for r in ok}
  }
  score = {}
  for r in ok:
    key = json.dumps(r["mosaic_config"], sort_keys=True)
    score[key] = (
      score.get(key, 0.0) + r["fused_mosaic"]["ms"] / fastest[r["tokens"]]
    )
  complete = [
    k
    for k in score
    if sum(json.dumps(r["mosaic_config"], sort_keys=True) == k for r in ok)
    == len(fastest)
  ]
  return (
    mosaic.MosaicConfig(**json.loads(min(complete, key=score.get)))
    if complete
    else mosaic.MosaicConfig()
  )


def mosaic_suite(args, result, save, triton_config, started):
  """The Mosaic GPU kernel: checks for every optimizer (and a skipped-element
  case), a tile sweep (or the default configs: --mosaic-defaults), then the
  table beside the Triton kernel."""
  if args.mosaic_defaults:

    def config_for(optimizer, k, n, tokens):
      return mosaic.default_config(
        jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((k, n), jnp.float32),
        optimizer,
      )
  else:
    best = mosaic_sweep(result, save, triton_config)
    result["best_mosaic_config"] = dataclasses.asdict(best)
    config_for = lambda *_: best
  for name, opt in CHECK_OPTIMIZERS.items():
    try:
      r = check_case(
        name,
        opt,
        4096,
        4096,
        2048,
        config_for(opt, 4096, 4096, 2048),
        seed=len(result["checks"]),
      )
    except Exception as e:  # pylint: disable=broad-except
      r = {"optimizer": name, "kernel": "MosaicConfig", "error": repr(e)[-600:]}
    result["checks"].append(r)
    print(f"mosaic check {name}: {r}", flush=True)
    save()
  r = check_case(
    "adamw_nan_column",
    CHECK_OPTIMIZERS["adamw"],
    4096,
    1024,
    2048,
    config_for(CHECK_OPTIMIZERS["adamw"], 4096, 1024, 2048),
    seed=99,
    poison_x_column=300,
  )
  result["checks"].append(r)
  print(f"mosaic check with a NaN column: {r}", flush=True)
  save()

  for tokens in args.tokens or (2048, 8192):
    for opt_name in ("adamw", "sgd_momentum", "lion"):
      for k, n in LLAMA_SHAPES if opt_name == "adamw" else LLAMA_SHAPES[:4]:
        if time.time() - started > args.time_budget_s:
          result["truncated"] = (
            f"time budget reached before {opt_name} {k}x{n} T={tokens}"
          )
          save()
          return
        try:
          optimizer = BENCH_OPTIMIZERS[opt_name]
          result["bench"].append(
            bench_case(
              opt_name,
              optimizer,
              k,
              n,
              tokens,
              triton_config,
              mosaic_config=config_for(optimizer, k, n, tokens),
            )
          )
          print_table(result["bench"][-1:])
        except Exception as e:  # pylint: disable=broad-except
          result.setdefault("errors", []).append(
            {"case": [opt_name, k, n, tokens], "error": repr(e)[-600:]}
          )
          print(result["errors"][-1], flush=True)
        save()
  summary = adamw_medians(
    result["bench"],
    (
      "fused_over_gemm",
      "unfused_over_fused",
      "mosaic_over_gemm",
      "unfused_over_mosaic",
    ),
  )
  result["summary_adamw"] = summary
  save()
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  main()
