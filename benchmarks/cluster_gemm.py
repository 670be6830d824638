"""TMA multicast in 2-CTA clusters: does it speed up the fused kernel's GEMM?

JAX's own Hopper GEMM (``hopper_matmul_mgpu``) with the fused kernel's
tiling, a 128 x 128 CTA tile of two 128 x 64 warpgroup parts and 64-token
steps (four or five stages), without a cluster and with 2-CTA clusters along
M or N that multicast the block they share; a 128 x 256 CTA tile without a
cluster, and XLA's GEMM, beside them. ``m x n`` is the kernel's ``K x N``,
``k`` the tokens; bf16 in and out. Device time, medians, one process.

  python benchmarks/cluster_gemm.py --out benchmarks/results/cluster_gemm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import device_time_ms, metadata  # noqa: E402

SHAPES = ("4096x14336x2048", "4096x14336x512", "14336x4096x2048")
SHAPES += ("4096x4096x2048", "4096x14336x8192")


def configs(clusters: bool = True) -> list:
  """(tile_n, stages, cluster) of each GEMM config timed (``clusters``:
  with 2-CTA clusters too)."""
  dims = hm.MatmulDimension
  cluster_dims = (None, dims.M, dims.N) if clusters else (None,)
  fused_tiling = [
    (64, stages, cluster) for stages in (4, 5) for cluster in cluster_dims
  ]
  return fused_tiling + [(128, 4, cluster) for cluster in cluster_dims]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument(
    "--no-clusters",
    action="store_true",
    help="only the configs without a cluster (the tilings alone)",
  )
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  result = {"meta": metadata(), "config": vars(args), "rows": []}
  for shape in args.shapes:
    m, n, k = (int(d) for d in shape.split("x"))
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
    xla = jax.jit(
      lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(
        jnp.bfloat16
      )
    )
    expected = xla(a, b).astype(jnp.float32)
    row = {
      "shape": [m, n, k],
      "xla_ms": device_time_ms(lambda: xla(a, b))["ms"],
      "configs": [],
    }
    for tile_n, stages, cluster in configs(not args.no_clusters):
      fields = dict(
        tile_m=128,
        tile_n=tile_n,
        tile_k=64,
        max_concurrent_steps=stages,
        wg_dimension=hm.MatmulDimension.N,
        cluster_dimension=cluster,
        grid_minor_dim=hm.MatmulDimension.N,
        grid_tile_width=8,
      )
      entry = {name: str(value) for name, value in fields.items()}
      try:
        config = hm.TuningConfig(**fields)
        gemm = jax.jit(
          lambda a, b, config=config: hm.matmul(a, b, None, config)
        )
        out = gemm(a, b).astype(jnp.float32)
        entry["max_abs_diff"] = float(jnp.max(jnp.abs(out - expected)))
        entry["ms"] = device_time_ms(lambda: gemm(a, b))["ms"]
      except Exception as e:  # a config this GPU cannot run
        entry["error"] = repr(e)[:300]
      row["configs"].append(entry)
      print(shape, entry, flush=True)
    result["rows"].append(row)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
