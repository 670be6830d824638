"""Compile time of an unrolled FORGE model, per kernel implementation.

A model with unrolled layers has one fused call per projection: a backend
that compiles its kernel per call site compiles it ``7 x layers`` times. Each
implementation runs in its own process (no shared compilation cache), on a
Llama-3.2-1B-shaped model with unrolled layers (``--layers``, default 16),
AdamW with each of ``--storages`` (bf16 weights and states; bf16 weights
stochastically rounded; those and int8 states), B x T tokens:

* ``lower_s``: tracing and lowering the jitted train step;
* ``compile_s``: XLA's compilation of it (every kernel included);
* ``first_step_s``: the first step's wall time after that;
* ``step_ms``: the median of ``--steps`` further steps.

  python benchmarks/compile_time.py --out benchmarks/results/compile_time.json
  python benchmarks/compile_time.py --cpu --shape tiny --layers 2 \\
      --implementations xla --out /tmp/compile_time.json   # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Model shapes: Llama-3.2-1B's, and a tiny one for smoke tests.
SHAPES = {
  "1b": dict(
    vocab_size=128256,
    dim=2048,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    ffn_dim=8192,
  ),
  "tiny": dict(
    vocab_size=256,
    dim=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    ffn_dim=256,
  ),
}


#: AdamW's storage options per ``--storages`` name.
STORAGES = {
  "bf16": dict(state_dtype="bfloat16"),
  "bf16-sr": dict(state_dtype="bfloat16", weight_rounding="stochastic"),
  "bf16-sr-int8": dict(state_dtype="int8", weight_rounding="stochastic"),
}


def run_name(implementation: str, storage: str) -> str:
  """A run's key in the result: the implementation, and its storage unless
  bf16."""
  return implementation if storage == "bf16" else f"{implementation} {storage}"


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
  parser.add_argument("--layers", type=int, default=16)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument(
    "--implementations", nargs="+", default=["triton", "mosaic"]
  )
  parser.add_argument(
    "--storages", nargs="+", choices=sorted(STORAGES), default=["bf16"]
  )
  parser.add_argument(
    "--implementation", help="run one, in this process, writing --out"
  )
  parser.add_argument("--storage", choices=sorted(STORAGES), default="bf16")
  parser.add_argument("--cpu", action="store_true")
  parser.add_argument("--out", required=True)
  return parser.parse_args(argv)


def measure(args) -> dict:
  """Lower, compile and run the train step once with ``--implementation``."""
  if args.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, ROOT)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import forge_jax as fj  # pylint: disable=import-outside-toplevel
  from examples.lm.llama import CONFIGS, make_model  # pylint: disable=import-outside-toplevel

  opt = fj.adamw(1e-4, weight_decay=0.1, **STORAGES[args.storage])
  config = dataclasses.replace(
    CONFIGS["llama-3.1-8b"],
    **SHAPES[args.shape],
    num_layers=args.layers,
    scan_layers=False,
    remat=True,
    param_dtype=jnp.bfloat16,
    implementation=args.implementation,
    max_len=max(args.seq, 8),
  )
  model = make_model(config, forge_optimizer=opt)
  tokens = jax.random.randint(
    jax.random.key(0), (args.batch, args.seq + 1), 0, config.vocab_size
  )
  variables = jax.jit(model.init)(jax.random.key(1), tokens[:, :-1])
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=opt.to_optax()
  )

  def step(state, tokens):
    def loss_fn(params):
      logits = state.apply_fn(params, tokens[:, :-1]).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]
      ).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  start = time.perf_counter()
  lowered = jax.jit(step, donate_argnums=0).lower(state, tokens)
  lower_s = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  state, loss = compiled(state, tokens)
  float(loss)
  first_step_s = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    state, loss = compiled(state, tokens)
    float(loss)
    times.append((time.perf_counter() - start) * 1e3)
  return {
    "implementation": args.implementation,
    "storage": args.storage,
    "lower_s": lower_s,
    "compile_s": compile_s,
    "first_step_s": first_step_s,
    "step_ms": statistics.median(times) if times else None,
    "final_loss": float(loss),
    "fused_calls": 7 * args.layers + 1,  # the projections and the head
  }


def main(argv=None):
  args = _args(argv)
  if args.implementation:
    with open(args.out, "w") as f:
      json.dump(measure(args), f)
    return
  sys.path.insert(0, HERE)
  from timing import metadata  # pylint: disable=import-outside-toplevel

  if args.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
  result = {
    "meta": metadata(),
    "shape": args.shape,
    "layers": args.layers,
    "batch": args.batch,
    "seq": args.seq,
    "runs": {},
  }
  for implementation, storage in itertools.product(
    args.implementations, args.storages
  ):
    name = run_name(implementation, storage)
    with tempfile.TemporaryDirectory() as tmp:
      part = os.path.join(tmp, "part.json")
      command = [
        sys.executable,
        os.path.abspath(__file__),
        "--implementation",
        implementation,
        "--storage",
        storage,
        "--shape",
        args.shape,
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--out",
        part,
      ] + (["--cpu"] if args.cpu else [])
      done = subprocess.run(command, capture_output=True, text=True)
      if done.returncode:
        result["runs"][name] = {"error": done.stderr[-2000:]}
      else:
        with open(part) as f:
          result["runs"][name] = json.load(f)
    print(name, json.dumps(result["runs"][name]), flush=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
