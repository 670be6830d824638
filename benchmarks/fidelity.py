"""Fidelity of low-precision FORGE against float32 optax on the demo LM.

    python benchmarks/fidelity.py                 # CPU, 'small' config
    python benchmarks/fidelity.py --steps 60 --config tiny   # quick
    python benchmarks/fidelity.py ... --resume PARTIAL.json  # the rest

Trains the byte-level Llama of ``examples.lm.llama`` on the Python stdlib
(``examples.lm.data``), every run on the same batches and, unless stated, from
the same initialization:

* ``optax_fp32``: nn.Dense + ``optax.adamw``, float32 (the reference);
* ``optax_fp32_seed1``, ``optax_fp32_seed2``, ...: the same from other
  initializations (``--reference-seeds`` runs in all): the run-to-run noise
  any change has to be judged against;
* ``forge_fp32``: ForgeDense + ``fj.adamw``, float32 (should follow the
  reference to float32 rounding);
* ``forge_bf16_nearest``: bfloat16 kernels and Adam states, rounded to
  nearest (``fj.adamw(..., state_dtype='bfloat16')``);
* ``forge_bf16_sr``: the same with the kernels written with stochastic
  rounding;
* ``forge_bf16_sr_int8``: ForgeDense with bfloat16 kernels written with
  stochastic rounding and int8 block-64 Adam states
  (``fj.adamw(..., state_dtype='int8', weight_rounding='stochastic')``);
* ``forge_bf16_nearest_int8`` (ablation, ``--ablation``): the same with
  round-to-nearest bf16 weights.

The low-precision runs start from the float32 initialization rounded to
bfloat16; embeddings and norm scales (trained by optax) stay float32.
Reported: the mean absolute difference of each run's per-step training loss
from ``optax_fp32`` (all steps and the last quarter), final training and
validation losses, each run's final-loss gap to ``optax_fp32`` against the
seeds' spread (the range of the reference runs' final losses); and, from the
moments of ``forge_fp32`` at the end, what int8 encodings of Adam's second
moment cost (``moment_encodings``).
Writes ``benchmarks/results/fidelity_<config>_<commit>.json`` after every
run (``complete`` once all have trained) and
``benchmarks/plots/fidelity_<config>_<steps>.png`` at the end; ``--resume``
keeps the runs of such a file and trains the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="small")
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--weight-decay", type=float, default=0.1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--dtype",
    default="float32",
    choices=("float32", "bfloat16"),
    help="compute dtype of every run (the storage differs by run)",
  )
  p.add_argument(
    "--reference-seeds",
    type=int,
    default=3,
    help="optax fp32 runs from this many initializations (>= 2)",
  )
  p.add_argument("--eval-batches", type=int, default=8)
  p.add_argument(
    "--implementation",
    default="xla",
    choices=("auto", "xla", "triton", "mosaic"),
  )
  p.add_argument(
    "--ablation",
    action="store_true",
    help="also run bf16 round-to-nearest weights + int8 states",
  )
  p.add_argument(
    "--no-moment-encodings",
    action="store_true",
    help="skip measuring int8 encodings on forge_fp32's final moments",
  )
  p.add_argument("--out", default=None, help="JSON path")
  p.add_argument(
    "--resume",
    default=None,
    help="a JSON this script wrote with the same training flags: its runs "
    "are kept, only the others train",
  )
  p.add_argument(
    "--plot",
    default=None,
    help="PNG path (default: benchmarks/plots/fidelity_<config>_<steps>.png)",
  )
  return p.parse_args(argv)


def _schedule(args):
  import optax  # pylint: disable=import-outside-toplevel

  warmup = max(1, args.steps // 10)
  return optax.warmup_cosine_decay_schedule(
    0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr * 0.1
  )


def build_runs(args, skip=()):
  """``{name: TrainState}``, every run not in ``skip`` ready to train."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax.training.train_state import TrainState  # pylint: disable=import-outside-toplevel

  import forge_jax as fj  # pylint: disable=import-outside-toplevel
  from examples.lm import data as data_lib  # pylint: disable=import-outside-toplevel
  from examples.lm.llama import CONFIGS, make_model  # pylint: disable=import-outside-toplevel

  config = dataclasses.replace(
    CONFIGS[args.config],
    vocab_size=data_lib.VOCAB_SIZE,
    max_len=max(CONFIGS[args.config].max_len, args.seq_len),
    dtype=jnp.dtype(args.dtype),
    implementation=args.implementation,
  )
  lr = _schedule(args)
  fp32 = fj.adamw(lr, weight_decay=args.weight_decay)
  lowp = {
    "forge_bf16_nearest": fj.adamw(
      lr, weight_decay=args.weight_decay, state_dtype="bfloat16"
    ),
    "forge_bf16_sr": fj.adamw(
      lr,
      weight_decay=args.weight_decay,
      state_dtype="bfloat16",
      weight_rounding="stochastic",
      rounding_seed=args.seed,
    ),
    "forge_bf16_sr_int8": fj.adamw(
      lr,
      weight_decay=args.weight_decay,
      state_dtype="int8",
      weight_rounding="stochastic",
      rounding_seed=args.seed,
    ),
  }
  lowp["forge_bf16_sr_int8_4bit"] = dataclasses.replace(
    lowp["forge_bf16_sr_int8"], second_moment_bits=4
  )
  if args.ablation:
    lowp["forge_bf16_nearest_int8"] = fj.adamw(
      lr, weight_decay=args.weight_decay, state_dtype="int8"
    )
  tokens = jnp.zeros((1, 8), jnp.int32)

  def state(model, variables, tx):
    # Jitted: op-by-op dispatch of the states' inits compiles every op of
    # every shape separately, minutes on a GPU.
    create = lambda v: TrainState.create(apply_fn=model.apply, params=v, tx=tx)
    return jax.jit(create)(variables)

  runs = {}
  baseline = make_model(config)
  for i in range(args.reference_seeds):
    name = "optax_fp32" + (f"_seed{i}" if i else "")
    if name in skip:
      continue
    runs[name] = state(
      baseline,
      jax.jit(baseline.init)(jax.random.key(args.seed + i), tokens),
      fp32.to_optax(),
    )
  forge = make_model(config, forge_optimizer=fp32)
  forge_vars = jax.jit(forge.init)(jax.random.key(args.seed), tokens)
  if "forge_fp32" not in skip:
    runs["forge_fp32"] = state(forge, forge_vars, fp32.to_optax())
  coll = fj.FORGE_COLLECTION
  for name, opt in lowp.items():
    if name in skip:
      continue
    # bf16 ForgeDense kernels; the fp32 initialization rounded to bf16.
    # param_dtype only sets what ForgeDense expects (and what init would
    # make): embeddings and norms keep the float32 values given here.
    model = make_model(
      dataclasses.replace(config, param_dtype=jnp.bfloat16), forge_optimizer=opt
    )

    def lowp_layer(layer, opt=opt):
      kernel = layer["kernel"].astype(jnp.bfloat16)
      return {**layer, "kernel": kernel, "opt_state": opt.init(kernel)}

    def lowp_variables(variables, lowp_layer=lowp_layer):
      # Own copies: the float32 run donates (deletes) its buffers.
      return {
        "params": jax.tree.map(jnp.copy, variables["params"]),
        coll: jax.tree.map(
          lowp_layer,
          variables[coll],
          is_leaf=lambda d: isinstance(d, dict) and "kernel" in d,
        ),
      }

    variables = jax.jit(lowp_variables)(forge_vars)
    runs[name] = state(model, variables, opt.to_optax())
  return runs, config


#: The order the runs train in: a run cut short by a time limit keeps the
#: reference, the most compressed storage and the seed spread first.
RUN_ORDER = (
  "optax_fp32",
  "forge_bf16_sr_int8",
  "optax_fp32_seed1",
  "forge_bf16_sr_int8_4bit",
  "forge_bf16_sr",
  "forge_fp32",
  "forge_bf16_nearest",
)


def train(runs, args, corpus, on_run=None, results=None):
  """Trains each run in :data:`RUN_ORDER` (then the rest) and adds it to
  ``results`` (runs already trained); ``on_run(results)`` after each."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from examples.lm import data as data_lib  # pylint: disable=import-outside-toplevel
  from examples.lm import train as train_lib  # pylint: disable=import-outside-toplevel

  batches = data_lib.batch_iterator(
    corpus.train, args.batch_size, args.seq_len, seed=args.seed
  )
  batches = [jnp.asarray(next(batches)) for _ in range(args.steps)]
  valid_it = data_lib.batch_iterator(
    corpus.valid, args.batch_size, args.seq_len, seed=args.seed + 1
  )
  valid_batches = [
    jnp.asarray(next(valid_it)) for _ in range(args.eval_batches)
  ]
  eval_step = train_lib.make_eval_step()
  results = {} if results is None else results
  order = sorted(
    runs, key=lambda n: RUN_ORDER.index(n) if n in RUN_ORDER else len(RUN_ORDER)
  )
  for name in order:
    state = runs[name]
    t0 = time.time()
    step = jax.jit(train_lib.train_step, donate_argnums=0)
    losses = []
    for batch in batches:
      state, loss = step(state, batch)
      losses.append(loss)
    losses = np.asarray(jax.device_get(losses), np.float64)
    valid = float(np.mean([float(eval_step(state, b)) for b in valid_batches]))
    wall = time.time() - t0
    results[name] = {
      "losses": losses,
      "valid_loss": valid,
      "wall_s": wall,
      "state": state,
    }
    print(
      f"{name:26s} final train {losses[-10:].mean():.4f} | valid "
      f"{valid:.4f} | {wall:.1f} s",
      flush=True,
    )
    if on_run is not None:
      on_run(results)
  return results


# ---------------------------------------------------------------------------
# Second-moment encodings, measured on real Adam moments.


def _linear_int8(x, block):
  """absmax-linear int8 of x (the textbook encoding), numpy."""
  rows, cols = x.shape
  pad = -cols % block
  xp = np.pad(x, ((0, 0), (0, pad))).reshape(rows, -1, block)
  scale = np.abs(xp).max(axis=2, keepdims=True) / 127
  q = np.where(scale > 0, np.round(xp / np.where(scale > 0, scale, 1)), 0)
  return (q * scale).reshape(rows, -1)[:, :cols]


def _sqrt_int8_no_floor(v, block):
  """sqrt(v) on 255 levels, without the floor at level 1, numpy."""
  rows, cols = v.shape
  pad = -cols % block
  r = np.sqrt(np.pad(v, ((0, 0), (0, pad)))).reshape(rows, -1, block)
  scale = r.max(axis=2, keepdims=True) / 254
  level = np.where(scale > 0, np.round(r / np.where(scale > 0, scale, 1)), 0)
  return ((level * scale) ** 2).reshape(rows, -1)[:, :cols]


def _float8_pow2(x, block):
  """float8 (e4m3) of x in blocks scaled by a power of two (an exact
  multiply: the block's absmax at most 448, e4m3's largest value), numpy.
  Not one of the package's encodings: measured as a cheaper one's cost."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel

  rows, cols = x.shape
  xp = np.pad(x, ((0, 0), (0, -cols % block))).reshape(rows, -1, block)
  amax = np.abs(xp).max(axis=2, keepdims=True)
  scale = np.exp2(np.ceil(np.log2(np.where(amax > 0, amax / 448.0, 1.0))))
  codes = (xp / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
  return (codes.astype(np.float64) * scale).reshape(rows, -1)[:, :cols]


def moment_encodings(state, count, b1=0.9, b2=0.999, eps=1e-8):
  """Error of Adam's direction m_hat / (sqrt(v_hat) + eps) (relative L2 over
  every kernel element) when v goes through each encoding: with m exact
  (``..._v_only``) and with m through the int8 linear block-64 encoding (or
  the encoding's own, for those that name one for m).
  ``zero_point_fraction``: elements with v > 0 read back as 0;
  ``blowup_fraction``: elements whose step grew more than 10x."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import forge_jax as fj  # pylint: disable=import-outside-toplevel
  from forge_jax import quantization as Q  # pylint: disable=import-outside-toplevel

  quantize = jax.jit(Q.quantize, static_argnames=("block", "sqrt", "bits"))
  dequantize = jax.jit(Q.dequantize, static_argnames=("block", "sqrt", "bits"))
  layers = []
  flat = jax.tree_util.tree_flatten_with_path(
    state.params[fj.FORGE_COLLECTION],
    is_leaf=lambda d: isinstance(d, dict) and "opt_state" in d,
  )[0]
  for _, layer in flat:
    layers.append(
      (
        np.asarray(layer["opt_state"].mu, np.float32),
        np.asarray(layer["opt_state"].nu, np.float32),
      )
    )
  bc1, bc2 = 1 - b1**count, 1 - b2**count

  def direction(m, v):
    return (m / bc1) / (np.sqrt(v / bc2) + eps)

  def int8_m(m):
    return np.asarray(dequantize(*quantize(jnp.asarray(m))), np.float64)

  def through(fn, m_fn=int8_m):
    err2 = err2_v = ref2 = 0.0
    zero = total = blowup = 0
    for m, v in layers:
      m64, v64 = m.astype(np.float64), v.astype(np.float64)
      mq = m_fn(m)
      vq = fn(v)
      u = direction(m64, v64)
      uq, uq_v = direction(mq, vq), direction(m64, vq)
      err2 += float(((uq - u) ** 2).sum())
      err2_v += float(((uq_v - u) ** 2).sum())
      ref2 += float((u**2).sum())
      zero += int(((vq == 0) & (v > 0)).sum())
      total += v.size
      blowup += int((np.abs(uq) > 10 * np.abs(u) + 1e-3).sum())
    return {
      "direction_rel_err": float(np.sqrt(err2 / ref2)),
      "direction_rel_err_v_only": float(np.sqrt(err2_v / ref2)),
      "zero_point_fraction": zero / total,
      "blowup_fraction": blowup / total,
    }

  out = {
    "linear_v_127_levels_block64": through(lambda v: _linear_int8(v, 64)),
    "sqrt_v_255_levels_no_floor_block64": through(
      lambda v: _sqrt_int8_no_floor(v, 64)
    ),
    "sqrt_v_255_levels_floor_block64 (chosen)": through(
      lambda v: np.asarray(
        dequantize(*quantize(jnp.asarray(v), sqrt=True), sqrt=True), np.float64
      )
    ),
    "sqrt_v_15_levels_floor_block64 (second_moment_bits=4)": through(
      lambda v: np.asarray(
        dequantize(
          *quantize(jnp.asarray(v), sqrt=True, bits=4), sqrt=True, bits=4
        ),
        np.float64,
      )[:, : v.shape[1]]
    ),
    "bf16_v": through(
      lambda v: np.asarray(
        jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32), np.float64
      )
    ),
  }
  for block in (256, 2048):
    out[f"sqrt_v_chosen_block{block}"] = through(
      lambda v, block=block: np.asarray(
        dequantize(
          *quantize(jnp.asarray(v), sqrt=True, block=block),
          sqrt=True,
          block=block,
        ),
        np.float64,
      )
    )
  out["float8_e4m3_v_pow2_block64"] = through(lambda v: _float8_pow2(v, 64))
  out["float8_e4m3_m_and_v_pow2_block64"] = through(
    lambda v: _float8_pow2(v, 64), m_fn=lambda m: _float8_pow2(m, 64)
  )
  out["num_elements"] = int(sum(v.size for _, v in layers))
  return out


def seed_spread(summary) -> dict:
  """The reference runs' final losses and their range, and each other
  run's final-loss gap to ``optax_fp32`` with whether it is within that
  range (``summary``: per run, ``final_train_loss_last10``); None before
  two reference runs have trained."""
  final = {n: s["final_train_loss_last10"] for n, s in summary.items()}
  seeds = {n: v for n, v in final.items() if n.startswith("optax_fp32")}
  if len(seeds) < 2:
    return None
  spread = max(seeds.values()) - min(seeds.values())
  gaps = {
    n: abs(v - final["optax_fp32"]) for n, v in final.items() if n not in seeds
  }
  return {
    "reference_final_losses": seeds,
    "range": spread,
    "final_loss_gap": gaps,
    "within_range": {n: gap <= spread for n, gap in gaps.items()},
  }


def _plot(path, results, title):
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  styles = {
    "optax_fp32": ("tab:blue", "-", 2.2),
    "forge_fp32": ("tab:red", "--", 1.0),
    "forge_bf16_nearest": ("tab:purple", ":", 1.0),
    "forge_bf16_sr": ("tab:olive", "-.", 1.0),
    "forge_bf16_sr_int8": ("tab:green", "-", 1.2),
    "forge_bf16_nearest_int8": ("tab:orange", ":", 1.2),
  }
  smooth = lambda x, w=9: np.convolve(x, np.ones(w) / w, mode="valid")
  fig, (ax, ax_d) = plt.subplots(
    2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
  )
  ref = results["optax_fp32"]["losses"]
  steps = np.arange(1, len(ref) + 1)
  for name, r in results.items():
    default = ("tab:gray", "-", 1.0) if name.startswith("optax") else None
    color, ls, lw = styles.get(name, default or ("black", "-", 1.0))
    ax.plot(
      steps, r["losses"], color=color, ls=ls, lw=lw, label=name, alpha=0.8
    )
    if name != "optax_fp32":
      d = np.abs(r["losses"] - ref)
      ax_d.semilogy(
        steps[4:-4],
        np.maximum(smooth(d), 1e-9),
        color=color,
        ls=ls,
        lw=lw,
        label=f"{name}: mean {d.mean():.2e}",
      )
  ax.set_ylabel("train loss (nats / byte)")
  ax.set_title(title)
  ax.legend()
  ax.grid(alpha=0.3)
  ax_d.set_ylabel("|loss - optax_fp32| (9-step mean)")
  ax_d.set_xlabel("step")
  ax_d.legend(fontsize=8)
  ax_d.grid(alpha=0.3)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  if args.reference_seeds < 2:
    raise SystemExit("--reference-seeds must be at least 2 (the spread)")
  import jax  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, HERE)
  from timing import metadata  # pylint: disable=import-outside-toplevel

  from examples.lm import data as data_lib  # pylint: disable=import-outside-toplevel

  t0 = time.time()
  corpus = data_lib.load_stdlib_corpus(max_mb=8.0)
  resumed = resumed_runs(args) if args.resume else None
  done = resumed["results"] if resumed else {}
  if "forge_fp32" in done and not args.no_moment_encodings:
    raise SystemExit("moment encodings need forge_fp32 trained in this run")
  runs, config = build_runs(args, skip=done)
  print(f"set up in {time.time() - t0:.0f} s", flush=True)
  run_meta = metadata()
  commit = run_meta["commit"][:7]
  out = args.out or os.path.join(
    HERE, "results", f"fidelity_{args.config}_{commit}.json"
  )
  plot = args.plot or os.path.join(
    HERE, "plots", f"fidelity_{args.config}_{args.steps}.png"
  )
  repo = os.path.dirname(HERE)
  args.out, args.plot = (
    os.path.relpath(os.path.abspath(p), repo) for p in (out, plot)
  )

  def write(results, encodings=None):
    """The JSON of the runs trained so far (``complete`` once all are)."""
    summary = summarize(results)
    payload = {
      "meta": run_meta,
      "args": vars(args),
      "commit": commit,
      "backend": jax.default_backend(),
      "jax_version": jax.__version__,
      "model": {"config": args.config, "num_params": config.num_params()},
      "complete": len(results) == len(runs) + len(done),
      "resumed_from": resumed and resumed["source"],
      "summary": summary,
      "seed_spread": seed_spread(summary),
      "moment_encodings": encodings,
      "losses": {name: r["losses"].tolist() for name, r in results.items()},
      "wall_s": time.time() - t0,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
      json.dump(payload, f, indent=1)
    return payload

  results = train(runs, args, corpus, on_run=write, results=dict(done))
  encodings = None
  if not args.no_moment_encodings:
    encodings = moment_encodings(results["forge_fp32"]["state"], args.steps)
  payload = write(results, encodings)
  _plot(
    plot,
    results,
    f"'{args.config}' byte LM, {args.steps} steps: FORGE low precision "
    "vs fp32 optax",
  )
  print(json.dumps({"summary": payload["summary"]}, indent=1))
  print(f"wrote {out} and {plot} ({time.time() - t0:.0f} s)")
  return payload


#: The flags that decide what a run trains: a resumed file must agree on them.
TRAINING_FLAGS = (
  "config",
  "steps",
  "batch_size",
  "seq_len",
  "lr",
  "weight_decay",
  "seed",
  "dtype",
  "reference_seeds",
  "eval_batches",
  "implementation",
  "ablation",
)


def resumed_runs(args) -> dict:
  """The runs of ``args.resume`` as :func:`train` results (no states), and
  where they came from."""
  with open(args.resume) as f:
    prior = json.load(f)
  differ = {
    k: (prior["args"][k], getattr(args, k))
    for k in TRAINING_FLAGS
    if prior["args"][k] != getattr(args, k)
  }
  if differ:
    raise SystemExit(f"{args.resume} was trained with other flags: {differ}")
  results = {
    name: {
      "losses": np.asarray(losses, np.float64),
      "valid_loss": prior["summary"][name]["valid_loss"],
      "wall_s": prior["summary"][name]["wall_s"],
      "state": None,
    }
    for name, losses in prior["losses"].items()
  }
  source = {"commit": prior["meta"]["commit"], "runs": sorted(results)}
  return {"results": results, "source": source}


def summarize(results) -> dict:
  """Per run: its loss gaps to ``optax_fp32`` and its final losses."""
  ref = results["optax_fp32"]["losses"]
  quarter = max(1, len(ref) // 4)
  summary = {}
  for name, r in results.items():
    d = np.abs(r["losses"] - ref)
    summary[name] = {
      "mean_abs_diff_vs_optax_fp32": float(d.mean()),
      "mean_abs_diff_vs_optax_fp32_last_quarter": float(d[-quarter:].mean()),
      "max_abs_diff_vs_optax_fp32": float(d.max()),
      "final_train_loss_last10": float(r["losses"][-10:].mean()),
      "valid_loss": r["valid_loss"],
      "wall_s": r["wall_s"],
    }
  return summary


if __name__ == "__main__":
  sys.exit(main() and 0)
