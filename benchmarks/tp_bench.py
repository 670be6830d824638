"""Tensor parallelism on 2 GPUs: exactness at a small shape, then per-GPU
peak memory and step time of FORGE against optax under the same TP.

Three parts, each in its own process (peak memory is a process-wide
high-water mark, so every measured variant gets a fresh one):

1. ``exactness``: a tiny float32 Llama, STEPS steps, TP=``--tp`` with and
   without sequence parallelism against FORGE on one device and against
   nn.Dense + optax under the same sharding (‖a − b‖ / ‖b‖, worst leaf).
2. ``measure --variant optax`` and 3. ``measure --variant forge``: the
   configured model (``--config``, ``--layers``, ``--batch``, ``--seq``,
   ``--tp``, ``--sp``) with bf16 weights, bf16 AdamW states, remat,
   unrolled layers; per GPU ``memory_stats()['peak_bytes_in_use']`` after
   the timed steps, median wall time of jitted, donated steps, the compiled
   memory analysis, and the number of whole-weight all-gathers in the
   compiled step (0 expected for FORGE). With ``--breakdown``, the step
   is compiled with an XLA dump of that compile only and its largest temp
   allocations are stored under ``breakdown`` (buffer_report.py).

On two H200s (kind nvidia-h200-x2):

  python benchmarks/tp_bench.py --tp 2 --sp --config llama-3.1-8b --layers 8 \\
      --batch 1 --seq 4096 --breakdown --out benchmarks/results/tp_h200x2.json

Smoke test on CPU with 2 simulated devices:

  python benchmarks/tp_bench.py --cpu-devices 2 --tp 2 --sp --config small --layers 1 \\
      --batch 2 --seq 16 --steps 2 --out /tmp/tp_cpu.json

NCCL's NVLink multicast stays as the machine sets it (off); this script
never turns it on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--part", choices=["all", "exactness", "measure"], default="all"
  )
  parser.add_argument("--variant", choices=["forge", "optax"])
  parser.add_argument("--tp", type=int, default=2)
  parser.add_argument(
    "--sp",
    action="store_true",
    help="sequence parallelism in the measured runs",
  )
  parser.add_argument("--config", default="llama-3.1-8b")
  parser.add_argument("--layers", type=int, default=None)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--implementation", default="auto")
  parser.add_argument(
    "--scan",
    action="store_true",
    help="scan over layers (fj.scan_layers / nn.scan) "
    "instead of unrolling them",
  )
  parser.add_argument(
    "--breakdown",
    action="store_true",
    help="measured runs: record where the compiled step's "
    "temp bytes go (buffer_report.py)",
  )
  parser.add_argument(
    "--cpu-devices",
    type=int,
    default=0,
    help="simulate this many CPU devices (smoke tests)",
  )
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def _setup_jax(args):
  import jax  # pylint: disable=import-outside-toplevel

  if args.cpu_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if jax.device_count() < args.tp:
    raise SystemExit(
      f"--tp {args.tp} needs {args.tp} devices, {jax.device_count()} available"
    )
  return jax


# ---------------------------------------------------------------------------
# Part 1: exactness at a small shape.


def exactness(args) -> dict:
  jax = _setup_jax(args)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax.training.train_state import TrainState  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P

  import forge_jax as fj  # pylint: disable=import-outside-toplevel
  from examples.lm import (
    llama,  # pylint: disable=import-outside-toplevel
    train,  # pylint: disable=import-outside-toplevel
  )
  from forge_jax import parallel

  opt = fj.adamw(1e-3, weight_decay=0.1)
  tp = args.tp
  config = llama.LlamaConfig(
    vocab_size=32 * tp,
    dim=64,
    num_layers=2,
    num_heads=4 * tp,
    num_kv_heads=2 * tp,
    head_dim=16,
    ffn_dim=64 * tp,
    max_len=256,
    implementation=args.implementation,
  )
  steps = 3
  batches = [
    jax.random.randint(k, (2, 65), 0, config.vocab_size)
    for k in jax.random.split(jax.random.key(1), steps)
  ]

  def run(forge: bool, mesh=None, sp=False):
    c = dataclasses.replace(config, forge_optimizer=opt if forge else None)
    if mesh is not None:
      c = dataclasses.replace(
        c, tensor_axis="model", batch_axis="data", sequence_parallel=sp
      )
    model = llama.Llama(c)
    step = jax.jit(train.train_step)
    key = jax.random.key(0)
    if mesh is None:
      variables = jax.jit(model.init)(key, batches[0][:, :-1])
      state = TrainState.create(
        apply_fn=model.apply, params=variables, tx=opt.to_optax()
      )
      for b in batches:
        state, loss = step(state, b)
      return jax.device_get(state.params), float(loss)
    variables = parallel.init_sharded(model.init, mesh, key, batches[0][:, :-1])
    with jax.set_mesh(mesh):
      state = TrainState.create(
        apply_fn=model.apply, params=variables, tx=opt.to_optax()
      )
      for b in batches:
        state, loss = step(state, jax.device_put(b, NamedSharding(mesh, P())))
    return jax.device_get(state.params), float(loss)

  def worst(a, b):
    errs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
      den = np.linalg.norm(y.ravel())
      errs.append(float(np.linalg.norm((x - y).ravel()) / den) if den else 0.0)
    return max(errs)

  def kernel_error(a, b):
    ka, kb = llama.kernels(a), llama.kernels(b)
    return worst([ka[k] for k in sorted(kb)], [kb[k] for k in sorted(kb)])

  mesh = parallel.make_mesh(tp)
  # float32 matmuls in full precision (not TF32), as the Pallas kernel does
  # for float32 operands: the comparison then measures summation order only.
  with jax.default_matmul_precision("highest"):
    one_forge, one_loss = run(True)
    one_optax, _ = run(False)
    result = {
      "tp": tp,
      "steps": steps,
      "dtype": "float32",
      "learning_rate": 1e-3,
      "batch": 2,
      "seq": 64,
      "shape": {
        f: getattr(config, f)
        for f in (
          "vocab_size",
          "dim",
          "num_layers",
          "num_heads",
          "num_kv_heads",
          "head_dim",
          "ffn_dim",
        )
      },
      "one_device_forge_loss": one_loss,
      "metric": (
        "worst leaf of ||a - b|| / ||b||: over all variables, or "
        "over the projection kernels (*_kernels)"
      ),
    }
    for sp in (False, True):
      forge, forge_loss = run(True, mesh, sp)
      optax_tp, optax_loss = run(False, mesh, sp)
      result["sp" if sp else "nosp"] = {
        # every variable: kernels, optimizer moments, counts, norms
        "forge_tp_vs_forge_one_device": worst(forge, one_forge),
        "forge_tp_vs_forge_one_device_kernels": kernel_error(forge, one_forge),
        "forge_tp_vs_optax_tp_kernels": kernel_error(forge, optax_tp),
        # The yardstick: how far optax's weights move under the same TP.
        "optax_tp_vs_optax_one_device_kernels": kernel_error(
          optax_tp, one_optax
        ),
        "forge_tp_loss": forge_loss,
        "optax_tp_loss": optax_loss,
      }
  result["exact"] = all(
    result[n]["forge_tp_vs_forge_one_device_kernels"] <= 1e-5
    and result[n]["forge_tp_vs_optax_tp_kernels"] <= 1e-5
    for n in ("sp", "nosp")
  )
  del jnp
  return result


# ---------------------------------------------------------------------------
# Parts 2 and 3: memory and time of one variant.


def _whole_weight_gathers(hlo: str, shapes: set) -> int:
  count = 0
  for m in re.finditer(
    r"=\s*\(?\w+\[([\d,]*)\][^=]*?\ball-gather(?:-start)?\(", hlo
  ):
    shape = tuple(int(d) for d in m.group(1).split(",") if d)
    count += shape in shapes
  return count


def build_sharded(args, optimizer, forge: bool):
  """The measured setup under TP=``args.tp`` (and SP with ``args.sp``):
  the configured model (``args.config``, ``args.layers``) with bf16 weights,
  remat, unrolled layers (scanned with ``args.scan``), ForgeDense trained by ``optimizer`` when ``forge``
  (else nn.Dense, ``optimizer.to_optax()`` for everything); weights and
  states initialized in their shardings.

  Returns ``(mesh, config, state, batch, step)``; lower, compile and run
  ``step`` (jitted, state donated) under ``jax.set_mesh(mesh)``.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax.training.train_state import TrainState  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P

  from examples.lm import (
    llama,  # pylint: disable=import-outside-toplevel
    train,  # pylint: disable=import-outside-toplevel
  )
  from forge_jax import parallel

  overrides = dict(
    param_dtype=jnp.bfloat16,
    dtype=jnp.bfloat16,
    scan_layers=getattr(args, "scan", False),
    remat=True,
    implementation=args.implementation,
    tensor_axis="model",
    batch_axis="data",
    sequence_parallel=args.sp,
    forge_optimizer=optimizer if forge else None,
  )
  if args.layers:
    overrides["num_layers"] = args.layers
  model = llama.make_model(args.config, **overrides)
  if not forge:  # make_model keeps the config's optimizer
    model = llama.Llama(dataclasses.replace(model.config, forge_optimizer=None))
  mesh = parallel.make_mesh(args.tp)
  key = jax.random.key(0)
  batch = jax.random.randint(
    key, (args.batch, args.seq + 1), 0, model.config.vocab_size, dtype=jnp.int32
  )
  variables = parallel.init_sharded(model.init, mesh, key, batch[:, :-1])
  with jax.set_mesh(mesh):
    batch = jax.device_put(batch, NamedSharding(mesh, P()))
    state = TrainState.create(
      apply_fn=model.apply, params=variables, tx=optimizer.to_optax()
    )
  step = jax.jit(train.train_step, donate_argnums=(0,))
  return mesh, model.config, state, batch, step


def compile_step(args, step, state, batch):
  """``(compiled, breakdown)``: ``breakdown`` (buffer_report) with
  ``args.breakdown``, else None. Call under the mesh."""
  lowered = step.lower(state, batch)
  if not getattr(args, "breakdown", False):
    return lowered.compile(), None
  sys.path.insert(0, HERE)
  import buffer_report  # pylint: disable=import-outside-toplevel

  return buffer_report.compile_with_breakdown(lowered, module="train_step")


def per_device_memory(jax, tp: int) -> list:
  """``memory_stats()`` peak and current bytes of the first ``tp`` devices."""
  out = []
  for device in jax.local_devices()[:tp]:
    stats = device.memory_stats() or {}
    out.append(
      {
        "device": str(device),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_in_use": stats.get("bytes_in_use"),
      }
    )
  return out


def measure(args) -> dict:
  jax = _setup_jax(args)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import forge_jax as fj  # pylint: disable=import-outside-toplevel
  from examples.lm import llama  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, HERE)
  from timing import time_steps  # pylint: disable=import-outside-toplevel

  optimizer = fj.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.bfloat16)
  mesh, config, state, batch, step = build_sharded(
    args, optimizer, forge=args.variant == "forge"
  )
  with jax.set_mesh(mesh):
    compiled, breakdown = compile_step(args, step, state, batch)
    analysis = compiled.memory_analysis()
    hlo = compiled.as_text()
    state, losses, times = time_steps(compiled, state, batch, args.steps)
    loss = losses[-1]
  kernels = llama.kernels(state.params)
  shapes = {tuple(k.shape) for k in kernels.values()}
  shapes |= {s[::-1] for s in shapes}
  per_device = per_device_memory(jax, args.tp)
  kernel_bytes = sum(k.size * k.dtype.itemsize for k in kernels.values())
  result = {
    "variant": args.variant,
    "config": args.config,
    "num_layers": config.num_layers,
    "batch": args.batch,
    "seq": args.seq,
    "tp": args.tp,
    "sp": args.sp,
    "scan_layers": args.scan,
    "param_dtype": "bfloat16",
    "state_dtype": "bfloat16",
    "implementation": args.implementation,
    "per_device": per_device,
    "max_peak_bytes_in_use": max(
      (d["peak_bytes_in_use"] or 0) for d in per_device
    )
    or None,
    "projection_kernel_bytes_total": kernel_bytes,
    "compiled_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
    "compiled_argument_bytes": getattr(
      analysis, "argument_size_in_bytes", None
    ),
    "compiled_alias_bytes": getattr(analysis, "alias_size_in_bytes", None),
    "whole_weight_all_gathers": _whole_weight_gathers(hlo, shapes),
    "step_ms_median": 1e3 * statistics.median(times) if times else None,
    "step_ms_all": [1e3 * t for t in times],
    "final_loss": loss,
    "loss_finite": bool(np.isfinite(loss)),
  }
  if breakdown is not None:
    result["breakdown"] = breakdown
  return result


# ---------------------------------------------------------------------------
# Driver.


def _child(argv_tail: list, args) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "part.json")
    cmd = [
      sys.executable,
      os.path.abspath(__file__),
      *argv_tail,
      "--out",
      out,
      "--tp",
      str(args.tp),
      "--config",
      args.config,
      "--batch",
      str(args.batch),
      "--seq",
      str(args.seq),
      "--steps",
      str(args.steps),
      "--implementation",
      args.implementation,
      "--cpu-devices",
      str(args.cpu_devices),
    ]
    if args.layers:
      cmd += ["--layers", str(args.layers)]
    if args.sp:
      cmd.append("--sp")
    if args.breakdown:
      cmd.append("--breakdown")
    if args.scan:
      cmd.append("--scan")
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
      return {"error": f"exit status {proc.returncode}"}
    with open(out) as f:
      return json.load(f)


def _without_breakdown(result: dict) -> dict:
  """``result`` less its metadata and buffer breakdowns (printed as tables)."""
  return {
    k: _without_breakdown(v) if isinstance(v, dict) else v
    for k, v in result.items()
    if k not in ("meta", "breakdown")
  }


def main(argv=None):
  args = _args(argv)
  if args.part == "exactness":
    result = exactness(args)
  elif args.part == "measure":
    if not args.variant:
      raise SystemExit("--part measure needs --variant")
    result = measure(args)
  else:
    result = {"exactness": _child(["--part", "exactness"], args)}
    for variant in ("optax", "forge"):
      result[variant] = _child(
        ["--part", "measure", "--variant", variant], args
      )
    sys.path.insert(0, HERE)
    _setup_jax(args)  # metadata() reads the devices
    from timing import metadata  # pylint: disable=import-outside-toplevel

    result["meta"] = metadata()
    f, o = result["forge"], result["optax"]
    if (
      "error" not in f
      and "error" not in o
      and f["max_peak_bytes_in_use"]
      and o["max_peak_bytes_in_use"]
    ):
      result["peak_ratio_forge_over_optax"] = (
        f["max_peak_bytes_in_use"] / o["max_peak_bytes_in_use"]
      )
    if "error" not in f and "error" not in o and o["step_ms_median"]:
      result["time_ratio_forge_over_optax"] = (
        f["step_ms_median"] / o["step_ms_median"]
      )
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(_without_breakdown(result), indent=1)[:4000], flush=True)
  if args.part == "all" and any(
    "error" in result[k] for k in ("exactness", "optax", "forge")
  ):
    raise SystemExit(1)


if __name__ == "__main__":
  main()
