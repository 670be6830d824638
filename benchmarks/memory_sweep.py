"""Compiled temp memory of train steps as the model grows: FORGE vs optax.

Sweeps the number of layers and the width of the package's Llama-style model
(scan over layers with remat, float32, AdamW) and reads
``memory_analysis().temp_size_in_bytes`` of the jitted, donated train step of
FORGE (ForgeDense + fj.scan_layers) and of nn.Dense + optax. optax's temp
holds the stacked gradients of every kernel, so it grows with the parameter
count; FORGE's should not. Runs on CPU in about a minute.

  python benchmarks/memory_sweep.py --out benchmarks/results/memory_sweep_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

import forge_jax as fj
from examples.lm import llama
from examples.lm import train as train_lib

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import metadata  # pylint: disable=wrong-import-position


def temp_bytes(config: llama.LlamaConfig, batch: int, seq: int, forge: bool):
  optimizer = fj.adamw(1e-3, weight_decay=0.1)
  model = llama.Llama(
    dataclasses.replace(config, forge_optimizer=optimizer if forge else None)
  )
  tokens = jnp.zeros((batch, seq + 1), jnp.int32)
  state = jax.eval_shape(
    lambda: train_lib.create_train_state(
      model, optimizer.to_optax(), jax.random.key(0), tokens
    )
  )
  compiled = train_lib.make_train_step().lower(state, tokens).compile()
  memory = compiled.memory_analysis()
  kernels = llama.kernels(state.params)
  return {
    "temp_bytes": memory.temp_size_in_bytes,
    "alias_bytes": memory.alias_size_in_bytes,
    "kernel_bytes": sum(k.size * k.dtype.itemsize for k in kernels.values()),
  }


def sweep(batch=2, seq=64):
  rows = []
  base = llama.CONFIGS["small"]
  for num_layers in (2, 4, 8, 16):
    for dim in (128, 256):
      config = dataclasses.replace(
        base,
        num_layers=num_layers,
        dim=dim,
        ffn_dim=4 * dim,
        head_dim=dim // base.num_heads,
        scan_layers=True,
        remat=True,
      )
      for forge in (False, True):
        row = {
          "num_layers": num_layers,
          "dim": dim,
          "batch": batch,
          "seq": seq,
          "variant": "forge" if forge else "optax",
          **temp_bytes(config, batch, seq, forge),
        }
        rows.append(row)
        print(
          f"{row['variant']:>5} L={num_layers:>2} D={dim:>3}: temp "
          f"{row['temp_bytes'] / 2**20:7.2f} MiB (kernels "
          f"{row['kernel_bytes'] / 2**20:6.2f} MiB)",
          flush=True,
        )
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="memory_sweep.json")
  args = parser.parse_args()
  with open(args.out, "w") as f:
    json.dump({"meta": metadata(), "rows": sweep()}, f, indent=1)


if __name__ == "__main__":
  main()
