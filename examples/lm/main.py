"""Main job: a byte-level Llama on the Python stdlib, FORGE beside optax.

    python -m examples.lm.main [--config small] [--steps 300] [--out artifacts]

Trains two copies of one model from the same initialization on the same
batches: FORGE (every projection a ForgeDense; fj.adamw runs inside the
backward pass) and the baseline (nn.Dense; optax.adamw with the same
hyper-parameters). Prints both losses as it goes, the compiled memory of both
train steps, and the largest difference between the two loss curves; writes
``loss_curves.png`` and ``summary.json`` to ``--out``.

On CPU the defaults (the 'small' config in float32) take a few minutes; on a
GPU the defaults pick the 'medium' config with bfloat16 compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import numpy as np


def _on_gpu() -> bool:
  import jax  # pylint: disable=import-outside-toplevel

  return jax.default_backend() == "gpu"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="python -m examples.lm.main",
    description="FORGE vs optax: a byte-level Llama on the Python stdlib.",
  )
  p.add_argument(
    "--config",
    default=None,
    help="a name in examples.lm.llama.CONFIGS (default: 'small' on "
    "CPU, 'medium' on GPU); the vocabulary is set to 256",
  )
  p.add_argument(
    "--steps",
    type=int,
    default=None,
    help="training steps (default: 200 CPU, 1000 GPU)",
  )
  p.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help="sequences per step (default: 16 CPU, 32 GPU)",
  )
  p.add_argument(
    "--seq-len",
    type=int,
    default=None,
    help="tokens per sequence (default: 128 CPU, 1024 GPU)",
  )
  p.add_argument(
    "--lr",
    type=float,
    default=None,
    help="peak learning rate (default: 3e-3 CPU, 1e-3 GPU)",
  )
  p.add_argument("--weight-decay", type=float, default=0.1)
  p.add_argument(
    "--warmup",
    type=float,
    default=0.1,
    help="fraction of steps of linear warmup before cosine decay "
    "(0 and --no-schedule: constant rate)",
  )
  p.add_argument(
    "--no-schedule", action="store_true", help="constant learning rate"
  )
  p.add_argument(
    "--implementation",
    default="auto",
    choices=("auto", "xla", "triton", "mosaic"),
    help="ForgeDense backend",
  )
  p.add_argument(
    "--dtype",
    default=None,
    choices=("float32", "bfloat16"),
    help="compute dtype (default: float32 CPU, bfloat16 GPU); "
    "parameters stay float32",
  )
  p.add_argument(
    "--scan-layers", action="store_true", help="stack the layers with nn.scan"
  )
  p.add_argument("--remat", action="store_true", help="rematerialize blocks")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--max-mb", type=float, default=8.0, help="cap on the stdlib bytes read"
  )
  p.add_argument(
    "--log-every",
    type=int,
    default=None,
    help="print both losses every N steps (default: steps // 10)",
  )
  p.add_argument(
    "--eval-batches",
    type=int,
    default=8,
    help="validation batches evaluated at the end",
  )
  p.add_argument("--out", default="artifacts", help="output directory")
  p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
  return p.parse_args(argv)


def _resolve_defaults(args):
  gpu = _on_gpu()
  defaults = dict(
    config="medium" if gpu else "small",
    steps=1000 if gpu else 200,
    batch_size=32 if gpu else 16,
    seq_len=1024 if gpu else 128,
    lr=1e-3 if gpu else 3e-3,
    dtype="bfloat16" if gpu else "float32",
  )
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.log_every is None:
    args.log_every = max(1, args.steps // 10)
  return args


def _mib(n):
  return "n/a" if n is None else f"{n / 2**20:9.2f} MiB"


def _config_dict(config):
  out = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if field.name == "forge_optimizer":
      value = None if value is None else repr(value)
    elif field.name in ("dtype", "param_dtype"):
      import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

      value = jnp.dtype(value).name
    out[field.name] = value
  return out


def _learning_rate(args):
  if args.no_schedule:
    return args.lr
  import optax  # pylint: disable=import-outside-toplevel

  warmup = int(args.warmup * args.steps)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=args.lr,
    warmup_steps=max(warmup, 1),
    decay_steps=max(args.steps, warmup + 1),
    end_value=args.lr * 0.1,
  )


def _plot(path, forge_losses, base_losses, title):
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  steps = np.arange(1, len(forge_losses) + 1)
  fig, (ax, ax_diff) = plt.subplots(
    2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.2]}
  )
  ax.plot(
    steps,
    base_losses,
    label="baseline: nn.Dense + optax.adamw",
    color="tab:blue",
    lw=2.2,
    alpha=0.6,
  )
  ax.plot(
    steps,
    forge_losses,
    label="FORGE: ForgeDense + fj.adamw",
    color="tab:red",
    lw=1.0,
    ls="--",
  )
  ax.set_ylabel("train loss (nats / byte)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  diff = np.abs(np.asarray(forge_losses) - np.asarray(base_losses))
  nonzero = diff > 0
  if nonzero.any():
    ax_diff.semilogy(steps[nonzero], diff[nonzero], ".", color="tab:gray", ms=3)
  ax_diff.text(
    0.01,
    0.92,
    f"bitwise equal at {int((~nonzero).sum())} of "
    f"{len(diff)} steps; max {diff.max():.2e}",
    transform=ax_diff.transAxes,
    va="top",
    fontsize=9,
  )
  ax_diff.set_ylabel("|FORGE - baseline|")
  ax_diff.set_xlabel("step")
  ax_diff.grid(alpha=0.3)
  fig.tight_layout()
  tmp = path + ".png.tmp"
  fig.savefig(tmp, dpi=120, format="png")
  plt.close(fig)
  os.replace(tmp, path)


def main(argv=None) -> dict:
  args = _resolve_defaults(parse_args(argv))
  t_start = time.time()

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

  import forge_jax as fj  # pylint: disable=import-outside-toplevel
  from examples.lm import data as data_lib  # pylint: disable=import-outside-toplevel
  from examples.lm import train as train_lib  # pylint: disable=import-outside-toplevel
  from examples.lm.llama import CONFIGS, kernels  # pylint: disable=import-outside-toplevel

  if args.config not in CONFIGS:
    raise SystemExit(f"--config {args.config!r}: choose from {sorted(CONFIGS)}")
  config = dataclasses.replace(
    CONFIGS[args.config],
    vocab_size=data_lib.VOCAB_SIZE,
    dtype=jnp.dtype(args.dtype),
    implementation=args.implementation,
    max_len=max(CONFIGS[args.config].max_len, args.seq_len),
    scan_layers=args.scan_layers or CONFIGS[args.config].scan_layers,
    remat=args.remat or CONFIGS[args.config].remat,
  )
  optimizer = fj.adamw(
    learning_rate=_learning_rate(args), weight_decay=args.weight_decay
  )
  variants = train_lib.build_variants(config, optimizer)

  corpus = data_lib.load_stdlib_corpus(max_mb=args.max_mb)
  device = jax.devices()[0]
  print(
    f"forge_jax main job | backend {jax.default_backend()} "
    f"({getattr(device, 'device_kind', device)}) | jax {jax.__version__}"
  )
  print(f"corpus: {corpus.describe()}")
  print(
    f"model: '{args.config}' {config.num_params() / 1e6:.2f}M params, "
    f"{config.num_layers} layers, dim {config.dim}, heads "
    f"{config.num_heads}/{config.num_kv_heads} kv, compute "
    f"{jnp.dtype(config.dtype).name}, params "
    f"{jnp.dtype(config.param_dtype).name}"
    f"{', scan' if config.scan_layers else ''}"
    f"{', remat' if config.remat else ''}"
  )
  print(
    f"train: {args.steps} steps x {args.batch_size} x {args.seq_len} "
    f"tokens, adamw lr {args.lr:g} (wd {args.weight_decay:g}, "
    f"{'constant' if args.no_schedule else 'warmup+cosine'}), "
    f"ForgeDense implementation '{args.implementation}'"
  )

  batches = data_lib.batch_iterator(
    corpus.train, args.batch_size, args.seq_len, seed=args.seed
  )
  first = jnp.asarray(next(batches))
  key = jax.random.key(args.seed)
  states = {name: v.init_state(key, first) for name, v in variants.items()}
  init_kernels_equal = all(
    bool(jnp.array_equal(a, kernels(states["baseline"].params)[path]))
    for path, a in kernels(states["forge"].params).items()
  )

  # Compile each step once, ahead of time: the executable gives the memory
  # analysis and then runs the training.
  steps, memory, compile_s = {}, {}, {}
  for name, v in variants.items():
    t0 = time.time()
    steps[name] = (
      jax.jit(train_lib.train_step, donate_argnums=0)
      .lower(states[name], first)
      .compile()
    )
    compile_s[name] = time.time() - t0
    memory[name] = train_lib.memory_stats(steps[name])
  print("compiled train step memory (memory_analysis):")
  print(f"  {'':28s} {'FORGE':>13s} {'baseline':>13s}")
  for field in (
    "temp_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "peak_estimate_bytes",
  ):
    print(
      f"  {field:28s} {_mib(memory['forge'].get(field)):>13s} "
      f"{_mib(memory['baseline'].get(field)):>13s}"
    )

  losses = {name: [] for name in variants}
  step_time = {name: 0.0 for name in variants}
  batch = first
  bar = tqdm(
    range(1, args.steps + 1),
    desc="training",
    unit="step",
    disable=args.no_progress,
    dynamic_ncols=True,
    file=sys.stdout,
  )
  for step in bar:
    for name in variants:  # the same batch for both
      t0 = time.perf_counter()
      states[name], loss = steps[name](states[name], batch)
      jax.block_until_ready(loss)
      if step > 1:  # the first call includes one-off costs
        step_time[name] += time.perf_counter() - t0
      losses[name].append(loss)
    if step % args.log_every == 0 or step == args.steps:
      lf, lb = float(losses["forge"][-1]), float(losses["baseline"][-1])
      bar.set_postfix(forge=f"{lf:.4f}", baseline=f"{lb:.4f}")
      tqdm.write(
        f"step {step:5d} | FORGE {lf:.6f} | baseline {lb:.6f} | "
        f"|diff| {abs(lf - lb):.2e}",
        file=sys.stdout,
      )
    if step < args.steps:
      batch = jnp.asarray(next(batches))
  bar.close()

  losses = {
    name: np.asarray(jax.device_get(ls), np.float64)
    for name, ls in losses.items()
  }
  diff = np.abs(losses["forge"] - losses["baseline"])

  eval_step = train_lib.make_eval_step()
  valid_batches = data_lib.batch_iterator(
    corpus.valid, args.batch_size, args.seq_len, seed=args.seed + 1
  )
  valid = {name: 0.0 for name in variants}
  for _ in range(args.eval_batches):
    vb = jnp.asarray(next(valid_batches))
    for name in variants:
      valid[name] += float(eval_step(states[name], vb)) / args.eval_batches

  kf, kb = kernels(states["forge"].params), kernels(states["baseline"].params)
  kernel_rel_diff = max(
    float(jnp.max(jnp.abs(kf[p] - kb[p])) / jnp.max(jnp.abs(kb[p]))) for p in kb
  )
  wiped = fj.wiped_layers(states["forge"].params)
  timed = max(args.steps - 1, 1)
  wall = time.time() - t_start

  print(
    f"validation loss ({args.eval_batches} batches): "
    f"FORGE {valid['forge']:.6f} | baseline {valid['baseline']:.6f}"
  )
  print(
    f"final train loss (mean of last 10): FORGE "
    f"{losses['forge'][-10:].mean():.6f} | baseline "
    f"{losses['baseline'][-10:].mean():.6f}"
  )
  print(
    f"max |loss FORGE - loss baseline| over {args.steps} steps: "
    f"{diff.max():.3e} (at step {int(diff.argmax()) + 1})"
  )
  print(f"max relative kernel difference after training: {kernel_rel_diff:.3e}")
  print(
    f"step time: FORGE {1e3 * step_time['forge'] / timed:.1f} ms | "
    f"baseline {1e3 * step_time['baseline'] / timed:.1f} ms | compile "
    f"FORGE {compile_s['forge']:.1f} s, baseline {compile_s['baseline']:.1f} s"
  )
  if wiped:
    print(f"WARNING: ForgeDense layers wiped (output unused): {wiped}")

  os.makedirs(args.out, exist_ok=True)
  png = os.path.join(args.out, "loss_curves.png")
  _plot(
    png,
    losses["forge"],
    losses["baseline"],
    f"byte-level Llama '{args.config}' on the Python stdlib "
    f"({jnp.dtype(config.dtype).name})",
  )
  summary = {
    "args": vars(args),
    "config": _config_dict(config),
    "optimizer": f"fj.adamw(lr={args.lr:g}, weight_decay={args.weight_decay:g}"
    f", {'constant' if args.no_schedule else f'warmup {args.warmup:g} + cosine'})"
    " / optax.adamw (same arguments)",
    "num_params": config.num_params(),
    "backend": jax.default_backend(),
    "device": str(getattr(device, "device_kind", device)),
    "jax_version": jax.__version__,
    "python": platform.python_version(),
    "corpus": {
      "files": corpus.num_files,
      "root": corpus.root,
      "train_bytes": int(corpus.train.size),
      "valid_bytes": int(corpus.valid.size),
    },
    "init_kernels_equal": init_kernels_equal,
    "losses": {name: ls.tolist() for name, ls in losses.items()},
    "final_train_loss": {
      name: float(ls[-10:].mean()) for name, ls in losses.items()
    },
    "valid_loss": valid,
    "max_abs_loss_diff": float(diff.max()),
    "max_rel_kernel_diff": kernel_rel_diff,
    "memory": memory,
    "step_ms": {name: 1e3 * t / timed for name, t in step_time.items()},
    "compile_s": compile_s,
    "wiped_layers": wiped,
    "wall_s": wall,
    "png": png,
  }
  path = os.path.join(args.out, "summary.json")
  with open(path + ".tmp", "w") as f:
    json.dump(summary, f, indent=1)
  os.replace(path + ".tmp", path)
  print(f"wrote {png} and {path} | wall time {wall:.1f} s")
  return summary


if __name__ == "__main__":
  main()
