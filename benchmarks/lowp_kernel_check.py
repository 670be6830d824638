"""Low-precision storage on the GPU: kernel bits vs the XLA reference, speed.

    python benchmarks/lowp_kernel_check.py --suite h200   # GPU: 4096x4096 ...
    python benchmarks/lowp_kernel_check.py --suite tiny   # CPU, interpret mode

Three checks, written to ``benchmarks/results/lowp_kernel_<suite>_<commit>.json``:

1. ``primitives``: the storage path alone. A small Pallas kernel applies
   :mod:`forge_jax.quantization`'s stochastic rounding (bf16), int8 block
   quantization (signed and sqrt-encoded) and dequantization to float32
   tiles; XLA applies the same functions to the whole arrays. The inputs are
   identical, so any differing bit is the storage path's: expected 0.
2. ``fused``: one to three fused steps (AdamW, Lion, SGD-momentum, RAdam on
   both sides of its rectification, RMSprop with bias correction; bf16
   weights, stochastic rounding and int8 states) at Llama shapes, each
   kernel (Triton; Mosaic GPU where the shape divides into its tiles) vs
   the XLA reference, with x and dy small multiples of 1/4 and 1/8 so that
   dW is exact in any summation order. What remains is the optimizer rule's
   float32 arithmetic (Triton contracts multiply-adds into FMAs and lowers
   ``/`` to an approximate division; Mosaic's sqrt is ``x * rsqrt(x)`` and
   a Newton step; XLA may do neither): reported as the fraction of identical
   bits per leaf, the largest bf16 ulp / int8 code distance, the largest
   relative scale difference, and the largest distance of what the codes
   encode, in code steps (a block whose scale moved one grid step re-rounds
   all its codes, up to two apart near the top of the sqrt encoding). In
   interpret mode (CPU) every bit must match.
3. ``speed`` (GPU only): the fused AdamW step with float32 weights and
   states vs bf16 weights + SR + int8 states, device time, per kernel.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import forge_jax as fj
from forge_jax import quantization as Q
from forge_jax.ops import backends, mosaic, triton_kernel
from forge_jax.ops.fused_dense import FusedDenseSpec

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import device_time_ms, metadata  # pylint: disable=wrong-import-position

SUITES = {
  # (K, N, T) per fused case; primitives on [rows, cols]; steps per case.
  "h200": {
    "fused": [(4096, 4096, 2048), (4096, 14336, 2048), (14336, 4096, 2048)],
    "primitives": (4096, 4096),
    "steps": 2,
    "speed": [(4096, 4096, 2048), (4096, 4096, 8192)],
  },
  # The odd shape is Triton's only (Mosaic needs whole tiles); the other is
  # Mosaic's default tiles, 2 of them.
  "tiny": {
    "fused": [(40, 150, 37), (128, 256, 64)],
    "primitives": (64, 192),
    "steps": 2,
    "speed": [],
  },
}

OPTIMIZERS = {
  "adamw": lambda **kw: fj.adamw(1e-3, weight_decay=0.1, **kw),
  "lion": lambda **kw: fj.lion(1e-4, **kw),
  "sgd_momentum": lambda **kw: fj.sgd(1e-2, momentum=0.9, **kw),
  # b2 = 0.9 rectifies from the sixth step: its fused steps start at the
  # fifth (FIRST_COUNT), so they take both branches.
  "radam": lambda **kw: fj.radam(1e-3, b2=0.9, **kw),
  "rmsprop_bias_correction": lambda **kw: fj.rmsprop(
    1e-3, bias_correction=True, eps_in_sqrt=False, initial_scale=0.5, **kw
  ),
  "adamw_4bit": lambda **kw: fj.adamw(
    1e-3, weight_decay=0.1, second_moment_bits=4, **kw
  ),
}
#: The count of an optimizer's first fused step (0 where not listed).
FIRST_COUNT = {"radam": 4}
LOWP = dict(state_dtype="int8", weight_rounding="stochastic", rounding_seed=3)
#: The fused kernels and their backend functions.
KERNELS = {
  "triton": triton_kernel.triton_update,
  "mosaic": mosaic.mosaic_update,
}


def _compare(a, b):
  """Identical-bit fraction and distances between two same-dtype arrays."""
  a, b = np.asarray(a), np.asarray(b)
  out = {"dtype": str(a.dtype), "shape": list(a.shape)}
  if a.dtype == Q.CODES_CONTAINER or a.dtype == np.int8:
    qa = np.asarray(Q.int8_codes(jnp.asarray(a))).astype(np.int32)
    qb = np.asarray(Q.int8_codes(jnp.asarray(b))).astype(np.int32)
    out["identical"] = float((qa == qb).mean())
    out["max_code_distance"] = int(np.abs(qa - qb).max())
    return out
  width = a.dtype.itemsize
  ia = a.view(f"u{width}")
  ib = b.view(f"u{width}")
  out["identical"] = float((ia == ib).mean())
  fa, fb = a.astype(np.float64), b.astype(np.float64)
  finite = np.isfinite(fa) & np.isfinite(fb)
  out["nonfinite_mismatch"] = int((np.isfinite(fa) != np.isfinite(fb)).sum())
  if a.dtype == np.float32:
    den = np.maximum(np.abs(fb), 1e-30)
    out["max_rel_diff"] = float((np.abs(fa - fb) / den)[finite].max(initial=0))
  else:
    signed = np.dtype(f"i{width}")
    order = lambda x: np.where(
      x.view(signed) < 0,
      -(x.view(signed).astype(np.int64) & ((1 << (8 * width - 1)) - 1)),
      x.view(signed).astype(np.int64),
    )
    ulps = np.abs(order(a) - order(b))
    out["max_ulp"] = int(ulps[finite].max(initial=0))
    # Where the rule cancels to near zero (w - lr * update ~ 0), rounding its
    # float32 arithmetic differently moves the result by many of its own
    # tiny ulps, but by less than one ulp at the leaf's scale.
    rms = np.sqrt(np.mean(np.square(fb[finite]))) if finite.any() else 0.0
    scale_ulp = rms * 2.0 ** -(jnp.finfo(a.dtype).nmant)
    beyond = finite & (ulps > 1) & (np.abs(fa - fb) > scale_ulp)
    out["beyond_one_ulp"] = int(beyond.sum())
  return out


def _compare_int8(a, b):
  """:func:`_compare` of the codes, with the codes' largest distance where
  the two blocks' scales agree and that of the values they encode, in code
  steps (:func:`forge_jax.quantization.encoded_distance`)."""
  codes, steps = map(np.asarray, Q.encoded_distance(a, b))
  return {
    **_compare(a.codes, b.codes),
    "max_code_distance_same_scale": int(codes.max(initial=0)),
    "max_step_distance": float(steps.max(initial=0)),
  }


# ---------------------------------------------------------------------------
# 1. The storage path alone.


def _storage_fns(step):
  """``values [R, C] f32 -> outputs`` of every storage primitive, given the
  global ``(rows, cols)`` indices (broadcastable)."""

  def fns(values, rows, cols):
    sr = Q.round_weights(
      values,
      jnp.bfloat16,
      rounding="stochastic",
      key=Q.rounding_key(3, 77, step),
      indices=(rows, cols),
    )
    codes, scale = Q.quantize(values)
    sq_codes, sq_scale = Q.quantize(jnp.abs(values), sqrt=True)
    sq4_codes, sq4_scale = Q.quantize(jnp.abs(values), sqrt=True, bits=4)
    return (
      sr,
      codes,
      scale,
      Q.dequantize(codes, scale),
      sq_codes,
      sq_scale,
      Q.dequantize(sq_codes, sq_scale, sqrt=True),
      sq4_codes,
      sq4_scale,
      Q.dequantize(sq4_codes, sq4_scale, sqrt=True, bits=4),
    )

  return fns


PRIMITIVE_NAMES = (
  "sr_bf16",
  "codes",
  "scale",
  "dequantized",
  "sqrt_codes",
  "sqrt_scale",
  "sqrt_dequantized",
  "sqrt4_codes",
  "sqrt4_scale",
  "sqrt4_dequantized",
)
_FNS = _storage_fns(12345)  # a Python int step: kernels close over no arrays


def primitives_xla(values):
  rows, cols = values.shape
  return _FNS(values, jnp.arange(rows)[:, None], jnp.arange(cols)[None, :])


def primitives_kernel(values, interpret):
  """The same functions in a Pallas kernel on 64 x 64 tiles."""
  rows, cols = values.shape
  block_r, block_c = 64, Q.BLOCK_SIZE

  def kernel(v_ref, *out_refs):
    ri = pl.program_id(0) * block_r + jax.lax.broadcasted_iota(
      jnp.int32, (block_r, 1), 0
    )
    ci = pl.program_id(1) * block_c + jax.lax.broadcasted_iota(
      jnp.int32, (1, block_c), 1
    )
    for ref, value in zip(out_refs, _FNS(v_ref[...], ri, ci)):
      ref[...] = value

  expected = jax.eval_shape(primitives_xla, values)
  tile = pl.BlockSpec((block_r, block_c), lambda i, j: (i, j))
  scale_tile = pl.BlockSpec((block_r, 1), lambda i, j: (i, j))
  pair_tile = pl.BlockSpec((block_r, block_c // 2), lambda i, j: (i, j))
  return pl.pallas_call(
    kernel,
    out_shape=list(expected),
    grid=(rows // block_r, cols // block_c),
    in_specs=[tile],
    out_specs=[tile, tile, scale_tile, tile, tile, scale_tile, tile]
    + [pair_tile, scale_tile, tile],
    interpret=interpret,
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
  )(values)


def check_primitives(rows, cols, interpret):
  rng = np.random.default_rng(0)
  values = jnp.asarray(
    (
      rng.standard_normal((rows, cols)) * np.exp(rng.normal(0, 2, (rows, cols)))
    ).astype(np.float32)
  )
  expected = jax.jit(primitives_xla)(values)
  actual = jax.jit(functools.partial(primitives_kernel, interpret=interpret))(
    values
  )
  return {
    name: _compare(a, e)
    for name, a, e in zip(PRIMITIVE_NAMES, actual, expected)
  }


# ---------------------------------------------------------------------------
# 2. Fused steps.


def exact_inputs(seed, tokens, k, n):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.integers(-3, 4, (tokens, k)) / 4.0, jnp.bfloat16)
  dy = jnp.asarray(rng.integers(-3, 4, (tokens, n)) / 8.0, jnp.bfloat16)
  return x, dy


def mosaic_unsupported(name, k, n, tokens):
  """Why the Mosaic kernel cannot run this fused case (None: it can)."""
  x = jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16)
  dy = jax.ShapeDtypeStruct((tokens, n), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
  return mosaic.unsupported_reason(x, dy, w, OPTIMIZERS[name](**LOWP))


def check_fused(name, k, n, tokens, steps, interpret, implementation="triton"):
  opt = OPTIMIZERS[name](**LOWP)
  ref_spec = FusedDenseSpec(optimizer=opt, implementation="xla")
  ker_spec = FusedDenseSpec(optimizer=opt, implementation=implementation)
  reference = jax.jit(functools.partial(backends.xla_update, ref_spec))
  kernel = jax.jit(
    lambda *a, rounding_key: KERNELS[implementation](
      ker_spec, *a, interpret=interpret, rounding_key=rounding_key
    )
  )
  w = (0.02 * jax.random.normal(jax.random.key(0), (k, n))).astype(jnp.bfloat16)
  state = opt.init(w)
  results = []
  first = FIRST_COUNT.get(name, 0)
  for count in range(first, first + steps):
    x, dy = exact_inputs(count, tokens, k, n)
    args = (x, dy, w, state, opt.scalars(jnp.int32(count)), jnp.bool_(True))
    key = Q.rounding_key(opt.rounding_seed, 5, jnp.int32(count))
    expected = jax.device_get(reference(*args, rounding_key=key))
    actual = jax.device_get(kernel(*args, rounding_key=key))
    leaves = jax.tree_util.tree_flatten_with_path(
      expected[:2], is_leaf=Q.is_quantized
    )[0]
    compared = {}
    for (p, e), a in zip(
      leaves, jax.tree.leaves(actual[:2], is_leaf=Q.is_quantized)
    ):
      path = jax.tree_util.keystr(p)
      if Q.is_quantized(e):
        compared[f"{path}.codes"] = _compare_int8(a, e)
        compared[f"{path}.scale"] = _compare(a.scale, e.scale)
      else:
        compared[path] = _compare(a, e)
    results.append(
      {
        "count": count,
        "skipped": [int(actual[2]), int(expected[2])],
        "leaves": compared,
      }
    )
    w, state = jax.tree.map(
      jnp.asarray, expected[:2]
    )  # continue from the reference
  return {
    "optimizer": name,
    "implementation": implementation,
    "k": k,
    "n": n,
    "tokens": tokens,
    "steps": results,
  }


# ---------------------------------------------------------------------------
# 3. Speed.


def speed_case(k, n, tokens, implementation="triton"):
  """Keys ``fp32`` and ``bf16_sr_int8`` (Triton), ``mosaic_...`` (Mosaic)."""
  out = {"k": k, "n": n, "tokens": tokens}
  prefix = "" if implementation == "triton" else f"{implementation}_"
  update = KERNELS[implementation]
  for label, kernel_dtype, kw in (
    ("fp32", jnp.float32, {}),
    ("bf16_sr_int8", jnp.bfloat16, LOWP),
  ):
    label = prefix + label
    opt = OPTIMIZERS["adamw"](**kw)
    spec = FusedDenseSpec(optimizer=opt, implementation=implementation)
    x, dy = exact_inputs(0, tokens, k, n)
    w = (0.02 * jax.random.normal(jax.random.key(0), (k, n))).astype(
      kernel_dtype
    )
    step = jax.jit(
      lambda w, s, x, dy, opt=opt, spec=spec, update=update: update(
        spec,
        x,
        dy,
        w,
        s,
        opt.scalars(jnp.int32(3)),
        jnp.bool_(True),
        rounding_key=Q.rounding_key(opt.rounding_seed, 5, jnp.int32(3)),
      )[:2],
      donate_argnums=(0, 1),
    )
    carry = [w, opt.init(w)]

    def run_once(step=step, carry=carry, x=x, dy=dy):
      carry[0], carry[1] = step(carry[0], carry[1], x, dy)
      return carry[0]

    out[label] = device_time_ms(run_once, calls=10, repeats=5)
    out[f"{label}_state_bytes"] = Q.state_bytes(carry[1])
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--suite",
    default="h200" if jax.default_backend() == "gpu" else "tiny",
    choices=sorted(SUITES),
  )
  p.add_argument(
    "--optimizers",
    default=",".join(OPTIMIZERS),
    help="comma-separated optimizers of the fused check (default: all)",
  )
  p.add_argument("--no-speed", action="store_true", help="skip the speed check")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  names = args.optimizers.split(",")
  unknown = sorted(set(names) - set(OPTIMIZERS))
  if unknown:
    p.error(f"unknown optimizers {unknown}; choose from {sorted(OPTIMIZERS)}")
  suite = SUITES[args.suite]
  interpret = jax.default_backend() != "gpu"
  meta = metadata()
  out = args.out or os.path.join(
    HERE, "results", f"lowp_kernel_{args.suite}_{meta['commit'][:7]}.json"
  )
  result = {"meta": meta, "suite": args.suite, "interpret": interpret}

  def save():
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f, indent=1)

  result["primitives"] = check_primitives(*suite["primitives"], interpret)
  print(
    "primitives (fraction of identical bits):",
    {k: v["identical"] for k, v in result["primitives"].items()},
    flush=True,
  )
  save()
  result["fused"] = []
  for name in names:
    for (k, n, tokens), implementation in itertools.product(
      suite["fused"], KERNELS
    ):
      reason = (
        mosaic_unsupported(name, k, n, tokens)
        if implementation == "mosaic"
        else None
      )
      if reason is not None:
        print(
          f"fused {name} {k}x{n} T={tokens} {implementation}: skipped "
          f"({reason})",
          flush=True,
        )
        continue
      case = check_fused(
        name, k, n, tokens, suite["steps"], interpret, implementation
      )
      result["fused"].append(case)
      worst = min(
        leaf["identical"]
        for s in case["steps"]
        for leaf in s["leaves"].values()
      )
      print(
        f"fused {name} {k}x{n} T={tokens} {implementation}: worst "
        f"identical fraction {worst:.6f}",
        flush=True,
      )
      save()
  result["speed"] = []
  for k, n, tokens in [] if args.no_speed else suite["speed"]:
    case = speed_case(k, n, tokens)
    case.update(speed_case(k, n, tokens, "mosaic"))
    result["speed"].append(case)
    print(
      f"speed {k}x{n} T={tokens}: "
      + ", ".join(
        f"{label} {case[label]['ms']:.3f} ms"
        for label in (
          "fp32",
          "bf16_sr_int8",
          "mosaic_fp32",
          "mosaic_bf16_sr_int8",
        )
      ),
      flush=True,
    )
    save()
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main()
