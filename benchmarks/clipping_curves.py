"""Convergence of global-norm clipping on the demo LM: exact against delayed.

Trains the main job's byte-level Llama-style model (examples/lm) from one
initialization on the same batches, AdamW (warmup + cosine), every
projection a ForgeDense:

* ``forge``: no clipping;
* ``forge-exact``: ``fj.TrainState(max_grad_norm=c)``, this step's norm;
* ``forge-delayed``: ``clip='delayed'``, the previous step's norm;
* ``optax-clip``: nn.Dense + ``optax.chain(optax.clip_by_global_norm(c),
  adamw)``, the reference of ``forge-exact``.

Writes each run's losses and global gradient norms (JSON) and the loss
curves in one plot (PNG):

  python benchmarks/clipping_curves.py --out clipping_curves.json \\
      --plot clipping_curves.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import optax

import forge_jax as fj
from examples.lm import data as data_lib
from examples.lm import train as train_lib
from examples.lm.llama import CONFIGS

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import metadata  # pylint: disable=wrong-import-position

RUNS = ("forge", "forge-exact", "forge-delayed", "optax-clip")


def parse_args(argv=None):
  on_gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="medium" if on_gpu else "small")
  p.add_argument("--steps", type=int, default=1000 if on_gpu else 100)
  p.add_argument("--batch-size", type=int, default=16 if on_gpu else 8)
  p.add_argument("--seq-len", type=int, default=256 if on_gpu else 128)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--weight-decay", type=float, default=0.1)
  p.add_argument(
    "--max-grad-norm",
    type=float,
    default=0.5,
    help="low enough that clipping acts on most steps",
  )
  p.add_argument("--max-mb", type=float, default=8.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--runs", nargs="*", default=list(RUNS), choices=RUNS)
  p.add_argument("--out", default="clipping_curves.json")
  p.add_argument("--plot", default=None, help="PNG of the loss curves")
  return p.parse_args(argv)


def _states_and_steps(args, config, key, first):
  """``{run: (state, jitted step)}`` from one initialization."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, max(1, args.steps // 20), args.steps
  )
  optimizer = fj.adamw(schedule, weight_decay=args.weight_decay)
  variants = train_lib.build_variants(config, optimizer)
  forge, baseline = variants["forge"], variants["baseline"]
  runs = {}
  for name in args.runs:
    if name == "optax-clip":
      tx = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm), optimizer.to_optax()
      )
      state = train_lib.create_train_state(baseline.model, tx, key, first)

      def step(state, batch):
        loss, grads = jax.value_and_grad(train_lib.loss_fn)(
          state.params, state.apply_fn, batch
        )
        norm = optax.tree.norm(grads)
        return state.apply_gradients(grads=grads), loss, norm

    else:
      clip = name.removeprefix("forge-") if name != "forge" else "exact"
      state = fj.TrainState.create(
        apply_fn=forge.model.apply,
        params=forge.model.init(key, first[:, :-1]),
        tx=optimizer.to_optax(),
        max_grad_norm=None if name == "forge" else args.max_grad_norm,
        clip=clip,
      )

      def step(state, batch):
        loss, grads = state.value_and_grad(train_lib.loss_fn)(
          state.params, state.apply_fn, batch
        )
        state = state.apply_gradients(grads=grads)
        return state, loss, state.grad_norm

    runs[name] = (state, jax.jit(step, donate_argnums=0))
  return runs


def plot(path, result):
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, ax = plt.subplots(figsize=(7, 4))
  for name, run in result["runs"].items():
    ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=name, lw=1)
  ax.set_xlabel("step")
  ax.set_ylabel("train loss")
  ax.set_title(
    f"{result['config']}: global-norm clipping to "
    f"{result['max_grad_norm']:g}, exact vs delayed"
  )
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  args = parse_args(argv)
  config = dataclasses.replace(
    CONFIGS[args.config],
    vocab_size=data_lib.VOCAB_SIZE,
    max_len=max(CONFIGS[args.config].max_len, args.seq_len),
  )
  corpus = data_lib.load_stdlib_corpus(max_mb=args.max_mb)
  batches = data_lib.batch_iterator(
    corpus.train, args.batch_size, args.seq_len, seed=args.seed
  )
  first = jnp.asarray(next(batches))
  runs = _states_and_steps(args, config, jax.random.key(args.seed), first)
  curves = {name: {"losses": [], "grad_norms": []} for name in runs}
  batch = first
  for step in range(args.steps):
    for name, (state, fn) in runs.items():
      state, loss, norm = fn(state, batch)
      runs[name] = (state, fn)
      curves[name]["losses"].append(float(loss))
      curves[name]["grad_norms"].append(float(norm))
    if (step + 1) % 50 == 0:
      print(
        f"step {step + 1}: "
        + ", ".join(f"{n} {c['losses'][-1]:.3f}" for n, c in curves.items()),
        flush=True,
      )
    batch = jnp.asarray(next(batches))
  result = {
    "meta": metadata(),
    "config": args.config,
    "steps": args.steps,
    "batch_size": args.batch_size,
    "seq_len": args.seq_len,
    "lr": args.lr,
    "max_grad_norm": args.max_grad_norm,
    "runs": curves,
  }
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  if args.plot:
    plot(args.plot, result)


if __name__ == "__main__":
  main()
