"""Peak GPU memory and step time of a whole train step: FORGE against optax.

One configuration per process (peak memory is a process-wide high-water
mark), so run it once per variant:

  python benchmarks/model_memory.py --config llama-3.1-8b --variant optax --out optax.json
  python benchmarks/model_memory.py --config llama-3.1-8b --variant forge --out forge.json

``--clip`` trains with global-norm clipping to ``--max-grad-norm``: FORGE
through ``fj.TrainState(max_grad_norm=..., clip='exact' | 'delayed')`` and
``state.value_and_grad``, optax with ``optax.clip_by_global_norm`` first in
``tx`` (``'exact'``); ``--clip none`` is FORGE's ``fj.TrainState`` without
clipping (it still reports the global norm).

``--forge-embedding`` makes FORGE's embedding a ``fj.ForgeEmbed``;
``--optax-storage`` trains FORGE's embedding and norms with
``fj.optax_with_storage(optimizer)`` (the state dtype and rounding of the
layers) instead of ``optimizer.to_optax()``.

``--profile`` adds the device time of each kernel of two more steps.
``--breakdown`` compiles the step with an XLA dump of that compile only (a
temporary directory) and stores its largest temp allocations, and the temp
values live at the temp peak, under ``breakdown`` (buffer_report.py); the
timed steps run the same executable.

The model is the package's Llama-style decoder (scan over layers with remat;
FORGE uses fj.scan_layers), bf16 weights and bf16 optimizer states in both
variants, AdamW. Peak memory is ``memory_stats()['peak_bytes_in_use']``
after the timed steps; the step is compiled before the state is created
(XLA's autotuner allocates buffers while compiling, which would otherwise
sit on top of the state). Step time is the median wall time of jitted,
donated steps (each blocked on), after two warm-up steps. Every step
trains on the same random batch; ``step_losses`` holds each step's loss
(warm-up steps first), so a run's trajectory can be compared with
another's, not only its last loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import forge_jax as fj
from examples.lm import llama
from examples.lm import train as train_lib

sys.path.insert(0, __file__.rsplit("/", 1)[0])
# pylint: disable=wrong-import-position
import buffer_report
from timing import kernel_profile, metadata, time_steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="llama-3.1-8b")
  parser.add_argument("--variant", choices=["forge", "optax"], required=True)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument(
    "--layers",
    type=int,
    default=None,
    help="override the number of layers (smoke tests)",
  )
  parser.add_argument("--implementation", default="auto")
  parser.add_argument(
    "--state-dtype",
    default="bfloat16",
    choices=["bfloat16", "int8"],
    help="FORGE's optimizer state storage (optax: bf16)",
  )
  parser.add_argument(
    "--second-moment-bits",
    type=int,
    default=8,
    choices=[8, 4],
    help="with --state-dtype int8: 4 stores second moments in 4 bits",
  )
  parser.add_argument(
    "--weight-rounding", default="nearest", choices=["nearest", "stochastic"]
  )
  parser.add_argument(
    "--attention",
    default=None,
    choices=[None, "cudnn"],
    help="jax.nn.dot_product_attention's implementation (default: XLA)",
  )
  parser.add_argument(
    "--breakdown",
    action="store_true",
    help="record where the compiled step's temp bytes go",
  )
  parser.add_argument(
    "--profile",
    action="store_true",
    help="after the timed steps, profile two more and "
    "store their kernels' device time under 'profile'",
  )
  parser.add_argument(
    "--remat-policy",
    default=None,
    choices=[None, *sorted(llama.REMAT_POLICIES)],
    help="what each layer saves for the backward (default: "
    "nothing, full remat)",
  )
  parser.add_argument(
    "--mosaic-config",
    default=None,
    help="JSON of MosaicConfig fields: the Mosaic kernel's "
    "only default config for this run",
  )
  parser.add_argument(
    "--clip",
    default=None,
    choices=[None, "none", "exact", "delayed"],
    help="global-norm clipping (default: the plain train step)",
  )
  parser.add_argument("--max-grad-norm", type=float, default=1.0)
  parser.add_argument(
    "--learning-rate",
    type=float,
    default=1e-4,
    help="AdamW's (both variants; the losses of a run depend on it)",
  )
  parser.add_argument(
    "--forge-embedding",
    action="store_true",
    help="FORGE: the embedding is a fj.ForgeEmbed trained by the layers' "
    "optimizer (no table-sized gradient)",
  )
  parser.add_argument(
    "--optax-storage",
    action="store_true",
    help="FORGE: train the embedding and norms with "
    "fj.optax_with_storage(optimizer) (its state dtype and rounding) "
    "instead of optimizer.to_optax()",
  )
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  if args.variant == "optax" and args.clip == "delayed":
    parser.error("--clip delayed is FORGE's; optax clips exactly")
  if args.variant == "optax" and (args.optax_storage or args.forge_embedding):
    parser.error("--optax-storage and --forge-embedding are FORGE's")
  with contextlib.ExitStack() as stack:
    if args.mosaic_config:
      # pylint: disable=import-outside-toplevel
      from kernel_bench import mosaic_patched

      from forge_jax.ops import mosaic

      forced = mosaic.MosaicConfig(**json.loads(args.mosaic_config))
      stack.enter_context(
        mosaic_patched("ranked_configs", lambda *_: (forced,))
      )
    measure(args)


def _init_and_step(args, model, optimizer, batch):
  """The jitted train-state initializer (of a key) and the jitted, donated
  step for ``args.clip``."""
  tx = optimizer.to_optax()
  if args.optax_storage:
    tx = fj.optax_with_storage(optimizer)
  if args.variant == "optax" and args.clip not in (None, "none"):
    tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), tx)
  if args.clip is None or args.variant == "optax":
    init = lambda key: train_lib.create_train_state(model, tx, key, batch)
    return jax.jit(init), train_lib.make_train_step()
  max_norm = None if args.clip == "none" else args.max_grad_norm
  init = lambda key: fj.TrainState.create(
    apply_fn=model.apply,
    params=model.init(key, batch[:, :-1]),
    tx=tx,
    max_grad_norm=max_norm,
    clip="exact" if args.clip == "none" else args.clip,
  )

  def step(state, batch):
    loss, grads = state.value_and_grad(train_lib.loss_fn)(
      state.params, state.apply_fn, batch
    )
    return state.apply_gradients(grads=grads), loss

  return jax.jit(init), jax.jit(step, donate_argnums=0)


def measure(args):
  """Builds, compiles and times the step; writes ``args.out``."""
  optimizer = fj.adamw(
    args.learning_rate,
    weight_decay=0.1,
    state_dtype=args.state_dtype,
    second_moment_bits=args.second_moment_bits,
    weight_rounding=args.weight_rounding,
  )
  overrides = dict(
    param_dtype=jnp.bfloat16,
    dtype=jnp.bfloat16,
    scan_layers=True,
    remat=True,
    remat_policy=args.remat_policy,
    implementation=args.implementation,
    attention_implementation=args.attention,
  )
  if args.layers:
    overrides["num_layers"] = args.layers
  if args.variant == "forge":
    overrides["forge_optimizer"] = optimizer
    overrides["forge_embedding"] = args.forge_embedding
  model = llama.make_model(args.config, **overrides)
  config = model.config

  key = jax.random.key(0)
  batch = jax.random.randint(
    key, (args.batch, args.seq + 1), 0, config.vocab_size, dtype=jnp.int32
  )
  init, step = _init_and_step(args, model, optimizer, batch)
  device = jax.local_devices()[0]
  # The step compiles from the state's shapes, before the state exists: XLA's
  # GEMM autotuner allocates device buffers while it compiles (1.32 GiB at
  # the 8B shape), which would add to the resident state.
  lowered = step.lower(jax.eval_shape(init, key), batch)
  breakdown = None
  if args.breakdown:
    compiled, breakdown = buffer_report.compile_with_breakdown(
      lowered, module="train_step"
    )
  else:
    compiled = lowered.compile()
  analysis = compiled.memory_analysis()
  state = init(key)

  state, losses, times = time_steps(compiled, state, batch, args.steps)
  loss = losses[-1]
  stats = device.memory_stats() or {}
  profile = None
  if args.profile:

    def run_once():
      nonlocal state
      state, step_loss = compiled(state, batch)
      return step_loss

    profile = kernel_profile(run_once)
  kernels = llama.kernels(state.params)
  kernel_bytes = sum(k.size * k.dtype.itemsize for k in kernels.values())
  result = {
    "compiled_before_state": True,
    "meta": metadata(),
    "config": args.config,
    "variant": args.variant,
    "num_layers": config.num_layers,
    "batch": args.batch,
    "seq": args.seq,
    "remat_policy": args.remat_policy,
    "implementation": args.implementation,
    "mosaic_config": (
      json.loads(args.mosaic_config) if args.mosaic_config else None
    ),
    "param_dtype": "bfloat16",
    "state_dtype": args.state_dtype if args.variant == "forge" else "bfloat16",
    "second_moment_bits": (
      args.second_moment_bits if args.variant == "forge" else None
    ),
    "attention": args.attention or "xla",
    "weight_rounding": args.weight_rounding
    if args.variant == "forge"
    else "nearest",
    "optax_storage": args.optax_storage,
    "forge_embedding": args.forge_embedding,
    # The allocator's limit, which also bounds XLA's rematerialization.
    "mem_fraction": os.environ.get("XLA_CLIENT_MEM_FRACTION"),
    "num_params": config.num_params(),
    "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
    "bytes_in_use_after": stats.get("bytes_in_use"),
    "projection_kernel_bytes": kernel_bytes,
    "compiled_temp_bytes": analysis.temp_size_in_bytes,
    "compiled_argument_bytes": analysis.argument_size_in_bytes,
    "compiled_alias_bytes": analysis.alias_size_in_bytes,
    "step_ms_median": 1e3 * statistics.median(times),
    "step_ms_all": [1e3 * t for t in times],
    "final_loss": loss,
    "step_losses": losses,
    "loss_finite": bool(np.isfinite(loss)),
    "learning_rate": args.learning_rate,
    "clip": args.clip,
    "max_grad_norm": args.max_grad_norm if args.clip else None,
    "final_grad_norm": (
      float(state.grad_norm) if hasattr(state, "grad_norm") else None
    ),
  }
  if breakdown is not None:
    result["breakdown"] = breakdown
  if profile is not None:
    result["profile"] = profile
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  gib = lambda b: (b or 0) / 2**30
  print(
    f"{args.variant} clip={args.clip} {args.config} L={config.num_layers} "
    f"B={args.batch} "
    f"T={args.seq}: peak {gib(result['peak_bytes_in_use']):.2f} GiB, "
    f"temp {gib(analysis.temp_size_in_bytes):.2f} GiB, step "
    f"{result['step_ms_median']:.1f} ms, loss {loss:.3f}",
    flush=True,
  )


if __name__ == "__main__":
  main()
