"""A Hopper GEMM that reads one layer of a stacked kernel in place.

``x @ stack[l]`` (or ``x @ stack[l].T``) for a ``[L, K, N]`` stack and a
traced layer index ``l``. XLA computes ``x @ stack[l]`` inside a loop by
first copying ``stack[l]`` out of the stack (a dynamic slice feeds a GEMM
only through a copy), which at the Llama-3.1-8B shapes takes about as long
as the GEMM itself with 512 tokens, and half as long with 2048. Here the
layer is a TMA coordinate: the tiles of ``stack[l]`` stream from where they
lie.

The kernel is persistent (one CTA per SM) and warp-specialized: a memory
warpgroup streams ``x`` and kernel blocks through a ring of shared-memory
buffers (``plgpu.emit_pipeline_warp_specialized``), two compute warpgroups
each accumulate a ``tile_m x tile_n`` half of the CTA's output tile with
wgmma in float32, and the epilogue rounds to the output dtype and stores
through shared memory by TMA. CTAs take the output's tiles column by
column, so a wave of them reads each block of the layer once from HBM
while every row block of ``x`` (the smaller operand, re-read from L2) uses
it. With ``transpose_rhs`` the kernel block is wgmma's transposed operand.
The float32 accumulation runs over ``K`` in order, as XLA's GEMMs do where
they do not split ``K``; its outputs still differ from XLA's (cuBLAS's)
in some bits. On an H200, a two-layer model of Llama-3.1-8B's widths
(T = 512) computed its first loss 12.25208 against XLA's 12.25255, and one
step later 0.52 % of its kernels' elements differed, by at most 3.7e-4,
with bf16 and int8 states alike. ``implementation='xla'`` keeps XLA's
GEMMs.

Off-GPU it runs in Mosaic GPU's interpret mode, whose wgmma takes no
transposed operand: there ``transpose_rhs`` transposes the stack first.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forge_jax.ops.mosaic import compat
from forge_jax.ops.mosaic import config as mosaic_config
from forge_jax.ops.mosaic.pipeline import swizzled

_DTYPES = (jnp.bfloat16, jnp.float16)
_EPILOGUE_TILE = 64
#: The kernel's name in profiles.
KERNEL_NAME = "forge_stacked_matmul_mosaic"
#: The most rows (tokens) for which a stacked layer's products run in place
#: (:func:`forge_jax.ops.fused_dense` asks). Above it XLA's GEMM, on the
#: layer copied out of the stack, is faster: the copy costs the same at any
#: token count, the GEMM's speed gap grows with the tokens. Whole 8B step on
#: an H200: 296.8 ms in place against 316.0 with the copies at 2048 tokens,
#: 1128.6 against 1109.8 at 8192 (4 x 2048).
MAX_IN_PLACE_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
  """A CTA computes a ``tile_m x 2 * tile_n`` output tile (two compute
  warpgroups side by side along ``N``), in ``tile_k`` steps of which
  ``max_concurrent_steps`` are in flight; a step's buffers are released
  ``delay_release`` steps later, so that many wgmma stay in flight behind
  the one just issued."""

  tile_m: int = 128
  tile_n: int = 64
  tile_k: int = 64
  max_concurrent_steps: int = 4
  delay_release: int = 1

  @property
  def cta_tile_n(self) -> int:
    return 2 * self.tile_n


#: Candidate ``(tile_m, tile_n, max_concurrent_steps)``, largest tile
#: first, with their throughput relative to the largest (smaller wgmma tiles
#: issue more instructions a flop); each with as many steps in flight as fit
#: in shared memory beside the output's staging buffers.
_TILES = (((128, 128, 4), 1.0), ((128, 64, 6), 0.85), ((64, 64, 8), 0.7))


def default_config(
  m: int, n: int, num_sms: int = mosaic_config.DEFAULT_NUM_SMS
):
  """The tile whose waves of CTAs take the least estimated time for an
  ``m x n`` output, among those that divide it (None if none does).

  A CTA's time scales with its tile's area over the tile's relative
  throughput, and the whole with the number of waves of CTAs: the largest
  tile leaves most SMs idle when the output has few tiles."""
  best, best_cost = None, math.inf
  for (tile_m, tile_n, steps), throughput in _TILES:
    config = MatmulConfig(
      tile_m=tile_m, tile_n=tile_n, max_concurrent_steps=steps
    )
    if m % tile_m or n % config.cta_tile_n:
      continue
    tiles = (m // tile_m) * (n // config.cta_tile_n)
    waves = -(-tiles // num_sms)
    cost = waves * tile_m * config.cta_tile_n / throughput
    if cost < best_cost:
      best, best_cost = config, cost
  return best


def unsupported_reason(x, stack, transpose_rhs: bool) -> Optional[str]:
  """Why :func:`stacked_matmul` cannot run this call, or None if it can."""
  if x.ndim != 2 or stack.ndim != 3:
    return f"{x.shape=} must be [M, K] and {stack.shape=} [L, K, N]"
  if jnp.dtype(x.dtype) not in map(jnp.dtype, _DTYPES):
    return f"x.dtype={x.dtype} must be bfloat16 or float16"
  if x.dtype != stack.dtype:
    return f"{x.dtype=} and {stack.dtype=} must match"
  k, n = stack.shape[1:][:: -1 if transpose_rhs else 1]
  if x.shape[1] != k:
    return f"{x.shape=} does not contract with {stack.shape=}"
  if k % MatmulConfig.tile_k:
    return f"the contracted dimension {k} must be a multiple of 64"
  if default_config(x.shape[0], n) is None:
    return f"no tile divides the [{x.shape[0]}, {n}] output"
  return None


def stacked_matmul(
  x: jax.Array,
  stack: jax.Array,
  layer_index: jax.Array,
  *,
  transpose_rhs: bool = False,
  config: Optional[MatmulConfig] = None,
  interpret: Optional[bool] = None,
) -> jax.Array:
  """``x @ stack[layer_index]``, or ``x @ stack[layer_index].T`` with
  ``transpose_rhs``, in ``x``'s dtype (float32 accumulation).

  Args:
    x: ``[M, K]``, bfloat16 or float16.
    stack: ``[L, K, N]`` (``[L, N, K]`` with ``transpose_rhs``), ``x``'s
      dtype.
    layer_index: an integer scalar.
    transpose_rhs: contract with the layer's last dimension.
    config: the tiling; None: :func:`default_config`'s.
    interpret: run in Mosaic GPU's interpret mode (default: off a GPU).
  """
  reason = unsupported_reason(x, stack, transpose_rhs)
  if reason is not None:
    raise ValueError(f"stacked_matmul cannot run this call: {reason}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if interpret and transpose_rhs:
    stack, transpose_rhs = jnp.swapaxes(stack, 1, 2), False
  m = x.shape[0]
  n = stack.shape[1] if transpose_rhs else stack.shape[2]
  sms = mosaic_config.DEFAULT_NUM_SMS if interpret else mosaic_config.num_sms()
  config = config or default_config(m, n, sms)
  tiles = (m // config.tile_m) * (n // config.cta_tile_n)
  call = plgpu.kernel(
    functools.partial(_kernel, config=config, transpose_rhs=transpose_rhs),
    out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
    grid=(min(tiles, 2 if interpret else sms),),
    grid_names=("sm",),
    num_threads=3,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup
    ),
    interpret=compat.interpret_params() if interpret else None,
    kernel_name=KERNEL_NAME,
  )
  index = jnp.reshape(jnp.asarray(layer_index, jnp.int32), (1,))
  return call(index, x, stack)


def _kernel(index_gmem, x_gmem, stack_gmem, out_gmem, *, config, transpose_rhs):
  dtype = x_gmem.dtype
  m, k = x_gmem.shape
  n = out_gmem.shape[1]
  tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
  cta_tn = config.cta_tile_n
  m_tiles, n_tiles = m // tm, n // cta_tn
  et = _EPILOGUE_TILE
  layer = stack_gmem.at[index_gmem[0]]
  transforms = swizzled(tk, dtype)
  spec = lambda shape, index_map: plgpu.BlockSpec(
    shape,
    index_map,
    transforms=transforms,
    memory_space=plgpu.SMEM,
    delay_release=config.delay_release,
  )
  in_specs = [
    spec((tm, tk), lambda kk: (0, kk)),
    spec((cta_tn, tk), lambda kk: (0, kk))
    if transpose_rhs
    else spec((tk, cta_tn), lambda kk: (kk, 0)),
  ]

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k // tk,),
      memory_registers=40,
      in_specs=in_specs,
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=config.max_concurrent_steps,
      compute_context=compute_context,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
    pl.run_scoped,
    allocations=pipeline(ignore, ignore).get_allocations(x_gmem, layer),
    out_smem=plgpu.SMEM((2, 2, et, et), dtype, transforms=swizzled(et, dtype)),
    collective_axes="wg",
  )
  def _scope(allocations, out_smem):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (linear,) = loop_info.index
      # Column-major: see the module docstring.
      mi, ni = lax.rem(linear, m_tiles), linear // m_tiles
      rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * cta_tn, cta_tn)
      wg_cols = pl.ds(wg * tn, tn)

      def compute_context(run_pipeline):
        @functools.partial(
          pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32)
        )
        def _acc_scope(acc_ref):
          run_pipeline(acc_ref)
          plgpu.wgmma_wait(0)
          acc = acc_ref[...].astype(dtype)
          # The previous tile's stores have read out_smem.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for i in range(tm // et):
            for j in range(tn // et):
              slot = (i * (tn // et) + j) % 2
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)
              out_smem[wg, slot] = acc[
                i * et : (i + 1) * et, j * et : (j + 1) * et
              ]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(
                out_smem.at[wg, slot],
                out_gmem.at[rows, cols]
                .at[:, wg_cols]
                .at[pl.ds(i * et, et), pl.ds(j * et, et)],
              )

      def step(_, x_smem, w_smem, acc_ref):
        if transpose_rhs:
          w = w_smem.at[wg_cols, :].transpose((1, 0))
        else:
          w = w_smem.at[:, wg_cols]
        plgpu.wgmma(acc_ref, x_smem, w)
        plgpu.wgmma_wait(config.delay_release)
        return acc_ref

      w_block = layer.at[cols, :] if transpose_rhs else layer.at[:, cols]
      pipeline(step, compute_context)(
        x_gmem.at[rows, :], w_block, allocations=allocations
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
