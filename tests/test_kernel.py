"""The Pallas Triton kernel's own rules, and the switch between backends.

The checks of the kernel against the XLA reference and optax are
fused_dense_test_base.py's, run for every backend by test_fused_dense.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import forge_jax as fj
from forge_jax import quantization as Q
from forge_jax.ops import backends, triton_kernel
from forge_jax.ops.fused_dense import FusedDenseSpec

from conftest import jaxpr_equations
from fused_dense_test_base import BF16, LOWP_OPTIMIZERS, exact_inputs


def test_auto_selects_xla_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("checks the CPU fallback")
  opt = fj.sgd(0.1)
  x, dy, kernel = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.ones((3, 2))
  assert backends.select("auto", x, dy, kernel, opt) is backends.xla_update
  assert backends.select("triton", x, dy, kernel, opt).__wrapped__ is (
    triton_kernel.triton_update
  )
  with pytest.raises(ValueError, match="no tokens"):
    backends.select("triton", jnp.ones((0, 3)), jnp.ones((0, 2)), kernel, opt)


def test_auto_takes_the_xla_reference_for_4bit_where_mosaic_cannot(
  monkeypatch,
):
  """On a GPU where the Mosaic kernel cannot run (before Hopper, or a JAX
  whose Mosaic GPU lowering lacks concatenate), 4-bit second moments go to
  the XLA reference, which updates them faster than the Triton kernel;
  other int8 states to the Triton kernel."""
  monkeypatch.setattr(backends, "on_gpu", lambda: True)
  monkeypatch.setattr(backends, "on_hopper_or_newer", lambda: False)
  x = jnp.zeros((256, 128), BF16)
  dy, kernel = jnp.zeros((256, 192), BF16), jnp.zeros((128, 192), BF16)
  int8 = fj.adamw(1e-3, state_dtype="int8", weight_rounding="stochastic")
  fourbit = fj.adamw(
    1e-3,
    state_dtype="int8",
    weight_rounding="stochastic",
    second_moment_bits=4,
  )
  select = lambda opt: backends.select("auto", x, dy, kernel, opt)
  assert select(int8).__wrapped__ is triton_kernel.triton_update
  assert select(fourbit) is backends.xla_update
  stack = jnp.zeros((3, 128, 192), BF16)
  assert backends.select("auto", x, dy, stack, fourbit) is backends.xla_update


def test_kernel_refuses_tiles_that_split_a_block():
  opt = LOWP_OPTIMIZERS[0][1]
  x, dy = exact_inputs(0, (8, 16), 96)
  w = jnp.zeros((16, 96), BF16)
  config = triton_kernel.TritonConfig(
    block_k=16, block_n=32, block_t=16, epilogue_split=1
  )
  spec = FusedDenseSpec(optimizer=opt, implementation="triton")
  with pytest.raises(ValueError, match="straddle"):
    triton_kernel.triton_update(
      spec,
      x,
      dy,
      w,
      opt.init(w),
      opt.scalars(jnp.int32(0)),
      jnp.bool_(True),
      config=config,
      interpret=True,
    )
  # The default config for quantized states makes chunks of one block.
  config = triton_kernel.default_config(8, 16, 8, state_block=Q.BLOCK_SIZE)
  assert config.block_n // config.epilogue_split == Q.BLOCK_SIZE


def _dot_precisions(jaxpr) -> list:
  """The precision of every dot_general in ``jaxpr``, Pallas bodies too."""
  return [
    eqn.params["precision"]
    for eqn in jaxpr_equations(jaxpr, kernel_bodies=True)
    if eqn.primitive.name == "dot_general"
  ]


@pytest.mark.parametrize("precision", [None, "highest", "bfloat16"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_dot_takes_the_layer_precision(precision, dtype):
  """The kernel forms dW at the precision the XLA reference (and nn.Dense's
  autodiff) uses: for float32 activations on a GPU the default is TF32; a
  dot at IEEE precision regardless ran 12-32x slower there."""
  opt = fj.sgd(0.1)
  x, dy = jnp.ones((16, 32), dtype), jnp.ones((16, 64), dtype)
  w = jnp.zeros((32, 64), jnp.float32)
  spec = FusedDenseSpec(
    optimizer=opt, implementation="triton", precision=precision
  )
  update = lambda *args: triton_kernel.triton_update(
    spec, *args, interpret=True
  )
  inputs = (x, dy, w, opt.init(w), opt.scalars(jnp.int32(0)), jnp.bool_(True))
  kernel_dots = _dot_precisions(jax.make_jaxpr(update)(*inputs).jaxpr)
  reference = jax.make_jaxpr(
    lambda x, dy: backends.weight_gradient(x, dy, precision)
  )(x, dy)
  assert kernel_dots
  assert set(kernel_dots) == set(_dot_precisions(reference.jaxpr))
