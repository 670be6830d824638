"""Compiled memory of whole train steps: FORGE against nn.Dense + optax.

A stack of ``--layers`` dense layers of ``--width`` x ``--width`` (unrolled),
``--tokens`` tokens, AdamW; for each variant the jitted, donated train step is
compiled and ``memory_analysis()`` read: temp bytes (scratch beyond the
arguments), alias bytes (donated buffers updated in place), and the number of
parameter-sized copies in the optimized HLO. FORGE needs no gradient buffers,
so its temp should not grow with the parameter count.

  python benchmarks/step_memory.py --out step_memory.json
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.training.train_state import TrainState

import forge_jax as fj

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import metadata  # pylint: disable=wrong-import-position


class Stack(nn.Module):
  layers: int
  width: int
  optimizer: fj.ForgeOptimizer
  variant: str  # 'optax' or a ForgeDense implementation
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      if self.variant == "optax":
        layer = nn.Dense(
          self.width,
          use_bias=False,
          name=f"fc{i}",
          param_dtype=self.param_dtype,
        )
      else:
        layer = fj.ForgeDense(
          self.width,
          optimizer=self.optimizer,
          use_bias=False,
          name=f"fc{i}",
          param_dtype=self.param_dtype,
          implementation=self.variant,
        )
      x = x + jnp.tanh(layer(x))
    return x


def measure(variant, layers, width, tokens, dtype):
  optimizer = fj.adamw(1e-3, weight_decay=0.1)
  model = Stack(layers, width, optimizer, variant, param_dtype=dtype)
  key = jax.random.key(0)
  x = jax.random.normal(key, (tokens, width), dtype)
  # Bias-free FORGE layers leave no 'params' collection, which
  # TrainState.create expects.
  variables = {"params": {}, **model.init(key, x)}
  state = TrainState.create(
    apply_fn=model.apply, params=variables, tx=optimizer.to_optax()
  )

  def loss_fn(variables):
    return jnp.mean(jnp.square(model.apply(variables, x).astype(jnp.float32)))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state):
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  compiled = step.lower(state).compile()
  memory = compiled.memory_analysis()
  copies = len(
    re.findall(rf"\[{width},{width}\]\{{[^}}]*\}} copy\(", compiled.as_text())
  )
  state, _ = step(state)  # it runs
  param_bytes = layers * width * width * jnp.dtype(dtype).itemsize
  return {
    "variant": variant,
    "layers": layers,
    "width": width,
    "tokens": tokens,
    "dtype": jnp.dtype(dtype).name,
    "temp_bytes": memory.temp_size_in_bytes,
    "alias_bytes": memory.alias_size_in_bytes,
    "argument_bytes": memory.argument_size_in_bytes,
    "kernel_bytes": param_bytes,
    "activation_bytes": layers * tokens * width * jnp.dtype(dtype).itemsize,
    "kernel_sized_copies": copies,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="step_memory.json")
  parser.add_argument("--tokens", type=int, default=256)
  parser.add_argument("--dtype", default="float32")
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  variants = ["optax", "xla"] + (["triton"] if on_gpu else [])
  sizes = [(4, 512), (8, 512), (16, 512), (8, 1024)]
  if on_gpu:
    sizes += [(16, 2048), (32, 2048)]
  rows = []
  for layers, width in sizes:
    for variant in variants:
      row = measure(variant, layers, width, args.tokens, jnp.dtype(args.dtype))
      rows.append(row)
      print(
        f"{variant:>7} L={layers:>3} D={width:>5}: temp "
        f"{row['temp_bytes'] / 2**20:8.2f} MiB, alias "
        f"{row['alias_bytes'] / 2**20:8.2f} MiB, kernels "
        f"{row['kernel_bytes'] / 2**20:8.2f} MiB, kernel copies "
        f"{row['kernel_sized_copies']}",
        flush=True,
      )
  with open(args.out, "w") as f:
    json.dump({"meta": metadata(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
