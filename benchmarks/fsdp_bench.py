"""FORGE's FSDP code path with a data axis of size ``--dp`` against FORGE
without a mesh: peak memory, compiled temp memory and step time.

Two measured variants, each in its own process (peak memory is a
process-wide high-water mark):

* ``plain``: the configured Llama model (``--config``, ``--layers``,
  ``--batch``, ``--seq``) with bf16 weights, bf16 AdamW states and remat,
  trained by FORGE on one device, no partitioning.
* ``fsdp``: the same model with MaxText's FSDP rules (every kernel's embed
  dimension and the batch over mesh axis 'data') on a ``data = --dp`` mesh:
  each layer's kernel gathered just in time, its weight gradient
  reduce-scattered before the update. With ``--dp 1`` (one GPU) every
  collective is over one device and is not emitted: the path must cost no
  more than ``plain`` (``peak_ratio`` and ``time_ratio`` <= 1 within noise)
  and compute the same losses.

On one H200 (kind nvidia-h200):

  python benchmarks/fsdp_bench.py --config llama-3.1-8b --layers 8 --batch 1 \\
      --seq 4096 --out benchmarks/results/fsdp_dp1_h200.json

Smoke test on CPU:

  python benchmarks/fsdp_bench.py --cpu --config small --layers 1 --batch 2 \\
      --seq 16 --steps 2 --out /tmp/fsdp_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variant", choices=["plain", "fsdp"])
  parser.add_argument("--dp", type=int, default=1)
  parser.add_argument("--config", default="llama-3.1-8b")
  parser.add_argument("--layers", type=int, default=0)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--scan", action="store_true", help="fj.scan the layers")
  parser.add_argument("--implementation", default="auto")
  parser.add_argument("--cpu", action="store_true", help="run on CPU devices")
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def _fsdp_config(config):
  """``config`` whose axis rules also shard every kernel's ``embed``
  dimension over the batch axis (after the batch, which takes it first in
  the activations)."""
  from examples.lm import llama  # pylint: disable=import-outside-toplevel

  @dataclasses.dataclass(frozen=True)
  class FSDPConfig(llama.LlamaConfig):
    def axis_rules(self) -> tuple:
      rules = super().axis_rules()
      return rules[:1] + (("embed", self.batch_axis),) + rules[1:]

  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  return FSDPConfig(**fields)


def measure(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  if args.cpu:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(args.dp, 1))
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax.training.train_state import TrainState  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  import forge_jax as fj  # pylint: disable=import-outside-toplevel
  from examples.lm import llama, train  # pylint: disable=import-outside-toplevel
  from forge_jax import parallel  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, HERE)
  from timing import time_steps  # pylint: disable=import-outside-toplevel

  optimizer = fj.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.bfloat16)
  overrides = dict(
    param_dtype=jnp.bfloat16,
    dtype=jnp.bfloat16,
    remat=True,
    scan_layers=args.scan,
    implementation=args.implementation,
    forge_optimizer=optimizer,
  )
  if args.layers:
    overrides["num_layers"] = args.layers
  config = llama.make_model(args.config, **overrides).config
  key = jax.random.key(0)
  batch = jax.random.randint(
    key, (args.batch, args.seq + 1), 0, config.vocab_size, dtype=jnp.int32
  )
  step = jax.jit(train.train_step, donate_argnums=(0,))
  if args.variant == "plain":
    model = llama.Llama(config)
    variables = jax.jit(model.init)(key, batch[:, :-1])
    state = TrainState.create(
      apply_fn=model.apply, params=variables, tx=optimizer.to_optax()
    )
    compiled = step.lower(state, batch).compile()
    state, losses, times = time_steps(compiled, state, batch, args.steps)
  else:
    config = _fsdp_config(
      dataclasses.replace(config, batch_axis="data", forge_data_parallel="auto")
    )
    model = llama.Llama(config)
    mesh = parallel.make_mesh(model=1, data=args.dp)
    variables = parallel.init_sharded(model.init, mesh, key, batch[:, :-1])
    with jax.set_mesh(mesh):
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      state = TrainState.create(
        apply_fn=model.apply, params=variables, tx=optimizer.to_optax()
      )
      compiled = step.lower(state, batch).compile()
      state, losses, times = time_steps(compiled, state, batch, args.steps)
  loss = losses[-1]
  analysis = compiled.memory_analysis()
  hlo = compiled.as_text()
  stats = [d.memory_stats() or {} for d in jax.local_devices()[: args.dp]]
  peaks = [s.get("peak_bytes_in_use") for s in stats]
  return {
    "variant": args.variant,
    "dp": args.dp if args.variant == "fsdp" else None,
    "config": args.config,
    "num_layers": config.num_layers,
    "batch": args.batch,
    "seq": args.seq,
    "scan_layers": args.scan,
    "implementation": args.implementation,
    "max_peak_bytes_in_use": max((p or 0) for p in peaks) or None,
    "compiled_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
    "compiled_argument_bytes": getattr(
      analysis, "argument_size_in_bytes", None
    ),
    "collectives": {
      op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(")
      for op in ("all-gather", "reduce-scatter", "all-reduce")
    },
    "step_ms_median": 1e3 * statistics.median(times) if times else None,
    "step_ms_all": [1e3 * t for t in times],
    "final_loss": loss,
  }


def _child(variant: str, args) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "part.json")
    cmd = [
      sys.executable,
      os.path.abspath(__file__),
      "--variant",
      variant,
      "--out",
      out,
      "--dp",
      str(args.dp),
      "--config",
      args.config,
      "--layers",
      str(args.layers),
      "--batch",
      str(args.batch),
      "--seq",
      str(args.seq),
      "--steps",
      str(args.steps),
      "--implementation",
      args.implementation,
    ]
    cmd += ["--scan"] if args.scan else []
    cmd += ["--cpu"] if args.cpu else []
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env["PYTHONPATH"] = os.pathsep.join(
      filter(None, [ROOT, env.get("PYTHONPATH")])
    )
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
      return {"error": f"exit status {proc.returncode}"}
    with open(out) as f:
      return json.load(f)


def main(argv=None):
  args = _args(argv)
  if args.variant:
    result = measure(args)
  else:
    result = {v: _child(v, args) for v in ("plain", "fsdp")}
    sys.path.insert(0, HERE)
    import jax  # pylint: disable=import-outside-toplevel

    if args.cpu:
      jax.config.update("jax_platforms", "cpu")
    from timing import metadata  # pylint: disable=import-outside-toplevel

    result["meta"] = metadata()
    plain, fsdp = result["plain"], result["fsdp"]
    if "error" not in plain and "error" not in fsdp:
      for name, key in (
        ("peak_ratio", "max_peak_bytes_in_use"),
        ("temp_ratio", "compiled_temp_bytes"),
        ("time_ratio", "step_ms_median"),
      ):
        if plain[key] and fsdp[key]:
          result[f"{name}_fsdp_over_plain"] = fsdp[key] / plain[key]
      result["same_final_loss"] = plain["final_loss"] == fsdp["final_loss"]
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1)[:4000], flush=True)
  if not args.variant and any("error" in result[v] for v in ("plain", "fsdp")):
    raise SystemExit(1)


if __name__ == "__main__":
  main()
