"""The in-place GEMM of a stacked layer (``ops/mosaic/matmul.py``) against
XLA's dot, and the scanned model that uses it on a Hopper GPU.

On CPU the kernel runs in Mosaic GPU's interpret mode (whose wgmma takes no
transposed operand: ``transpose_rhs`` transposes the stack there); the
compiled kernel, its transposed operand and the model's step with it run
in the GPU tests.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax as fj
from forge_jax.ops import backends, fused_dense
from forge_jax.ops.mosaic import matmul


def _xla(x, stack, layer, transpose_rhs):
  w = stack[layer].T if transpose_rhs else stack[layer]
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _inputs(seed, m, k, n, layers, transpose_rhs):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  shape = (layers, n, k) if transpose_rhs else (layers, k, n)
  return x, jax.random.normal(kw, shape, jnp.bfloat16)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["x@W", "dy@W.T"])
def test_stacked_matmul_matches_xla_interpret(transpose_rhs, seed):
  """Two CTAs walk a 2 x 2 grid of 64 x 128 tiles, two K steps each, at
  the last layer of the stack (a nonzero TMA coordinate)."""
  x, stack = _inputs(seed, 128, 128, 256, 3, transpose_rhs)
  layer = jnp.int32(2)
  actual = jax.jit(
    lambda x, s, i: matmul.stacked_matmul(
      x, s, i, transpose_rhs=transpose_rhs, interpret=True
    )
  )(x, stack, layer)
  expected = _xla(x, stack, 2, transpose_rhs)
  np.testing.assert_allclose(
    np.asarray(actual, np.float32), np.asarray(expected, np.float32), rtol=1e-2
  )
  assert not np.array_equal(
    np.asarray(actual), np.asarray(_xla(x, stack, 1, transpose_rhs))
  )


@pytest.mark.parametrize(
  "m,n,tile",
  [
    (512, 4096, (128, 64)),  # 128 tiles of 128 x 128 fill a wave
    (512, 14336, (128, 128)),  # 224 of 128 x 256: two waves
    (512, 1024, (64, 64)),  # the smallest tiles: 64 of them
    (96, 1024, None),  # no tile divides 96 rows
  ],
)
def test_default_config_picks_the_tile_with_the_fewest_waves(m, n, tile):
  config = matmul.default_config(m, n, num_sms=132)
  assert (config and (config.tile_m, config.tile_n)) == tile


#: Shared memory a CTA may take on an H100/H200 (227 KB).
_SHARED_MEMORY = 227 * 1024


@pytest.mark.parametrize(
  "config",
  [matmul.default_config(512, n) for n in (1024, 4096, 14336)],
  ids=lambda c: f"{c.tile_m}x{c.cta_tile_n}",
)
def test_tiles_take_as_many_steps_as_fit(config):
  """Each candidate tile keeps as many pipeline steps in flight as fit in
  shared memory beside the output's staging buffers, and no more."""
  itemsize = 2
  step = (config.tile_m + config.cta_tile_n) * config.tile_k * itemsize
  staging = 2 * 2 * 64 * 64 * itemsize
  used = config.max_concurrent_steps * step + staging
  assert used <= _SHARED_MEMORY < used + step


def test_unsupported_calls_say_why():
  x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  stack = jax.ShapeDtypeStruct((2, 128, 256), jnp.float32)
  assert "bfloat16" in matmul.unsupported_reason(x, stack, False)
  x = jax.ShapeDtypeStruct((128, 96), jnp.bfloat16)
  stack = jax.ShapeDtypeStruct((2, 96, 256), jnp.bfloat16)
  assert "multiple of 64" in matmul.unsupported_reason(x, stack, False)
  with pytest.raises(ValueError, match="cannot run this call"):
    matmul.stacked_matmul(
      jnp.zeros((128, 96), jnp.bfloat16),
      jnp.zeros((2, 96, 256), jnp.bfloat16),
      0,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["x@W", "dy@W.T"])
@pytest.mark.parametrize(
  "m,k,n", [(512, 4096, 4096), (512, 4096, 1024), (2048, 1024, 14336)]
)
def test_stacked_matmul_matches_xla_on_gpu(m, k, n, transpose_rhs, seed):
  """The compiled kernel (TMA at the layer's coordinate, transposed
  wgmma operand) against XLA's dot, its output's memory poisoned first."""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs a Hopper or newer GPU")
  x, stack = _inputs(seed, m, k, n, 3, transpose_rhs)
  jnp.full((m, n), jnp.nan, jnp.bfloat16).block_until_ready()  # freed: reused
  actual = jax.jit(
    lambda x, s, i: matmul.stacked_matmul(x, s, i, transpose_rhs=transpose_rhs)
  )(x, stack, jnp.int32(1))
  expected = _xla(x, stack, 1, transpose_rhs)
  actual, expected = (np.asarray(a, np.float32) for a in (actual, expected))
  assert np.isfinite(actual).all()
  # float32 sums of the same products in another order, rounded to bf16.
  np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=1e-1)
  assert np.mean(actual == expected) > 0.99


class _Block(nn.Module):
  features: int
  implementation: str

  @nn.compact
  def __call__(self, h, _):
    dense = lambda name: fj.ForgeDense(
      self.features,
      fj.adamw(1e-3, state_dtype=jnp.bfloat16),
      use_bias=name == "up",
      dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16,
      implementation=self.implementation,
      name=name,
    )
    return h + dense("down")(nn.gelu(dense("up")(h))), None


def _scanned_step(implementation, remat=True):
  """A jitted train step of three fj.scan'd blocks, and its first state."""
  model = fj.scan(
    nn.remat(_Block, prevent_cse=False) if remat else _Block,
    variable_axes={True: 0},
    split_rngs={"params": True},
    in_axes=(nn.broadcast,),
    length=3,
  )(features=256, implementation=implementation)
  x = jax.random.normal(jax.random.key(0), (256, 256), jnp.bfloat16)
  variables = model.init(jax.random.key(1), x, None)
  opt = fj.adamw(1e-3, state_dtype=jnp.bfloat16)
  state = fj.TrainState.create(
    apply_fn=model.apply, params=variables, tx=opt.to_optax()
  )

  def step(state):
    def loss_fn(params):
      y, _ = state.apply_fn(params, x, None)
      return jnp.mean(jnp.square(y.astype(jnp.float32)))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return jax.jit(step), state


def _train(implementation, steps=3, remat=True):
  step, state = _scanned_step(implementation, remat)
  losses = []
  for _ in range(steps):
    state, loss = step(state)
    losses.append(float(loss))
  return state, losses


@pytest.mark.gpu
def test_scanned_layers_read_their_kernels_in_place_on_gpu():
  """fj.scan on a Hopper GPU: the forward and dx products run as the
  in-place GEMM ('auto'), and the steps match XLA's ('xla')."""
  if not backends.on_hopper_or_newer():
    pytest.skip("needs a Hopper or newer GPU")
  step, state = _scanned_step("auto")
  assert matmul.KERNEL_NAME in step.lower(state).as_text()
  expected_state, expected = _train("xla")
  state, losses = _train("auto")
  np.testing.assert_allclose(losses, expected, rtol=1e-2)
  for leaf, ref in zip(
    jax.tree.leaves(state.params), jax.tree.leaves(expected_state.params)
  ):
    np.testing.assert_allclose(
      np.asarray(leaf, np.float32), np.asarray(ref, np.float32), atol=2e-2
    )


def test_in_place_product_applies_only_to_stacked_layers_in_their_dtype(
  monkeypatch,
):
  """The in-place GEMM needs a stack, one device, the compute dtype, a
  Hopper GPU, 'auto' or 'mosaic' and at most MAX_IN_PLACE_TOKENS tokens
  (off a GPU: never)."""
  spec = fused_dense.FusedDenseSpec(fj.adamw(1e-3), dtype=jnp.bfloat16)
  layout = fj.parallel.unsharded_layout(2)
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  stack = jax.ShapeDtypeStruct((4, 256, 1024), jnp.bfloat16)
  applies = lambda spec=spec, stack=stack, index=jnp.int32(0): (
    fused_dense._in_place_dtype(spec, layout, x, stack, None, index, False)  # pylint: disable=protected-access
  )
  if not backends.on_hopper_or_newer():
    assert applies() is None
  monkeypatch.setattr(backends, "on_hopper_or_newer", lambda: True)
  assert applies() == jnp.bfloat16
  assert applies(index=None) is None
  assert applies(stack=stack.update(dtype=jnp.float32)) is None
  xla = fused_dense.FusedDenseSpec(
    fj.adamw(1e-3), dtype=jnp.bfloat16, implementation="xla"
  )
  assert applies(spec=xla) is None
  highest = fused_dense.FusedDenseSpec(
    fj.adamw(1e-3), dtype=jnp.bfloat16, precision="highest"
  )
  assert applies(spec=highest) is None
  # Without a dtype the inputs' promotion decides (arrays: flax inspects
  # their dtypes); float32 inputs compute in float32, XLA's product.
  promoted = fused_dense.FusedDenseSpec(fj.adamw(1e-3))
  stack = jnp.zeros(stack.shape, stack.dtype)
  x = jnp.zeros(x.shape, jnp.bfloat16)
  assert applies(spec=promoted, stack=stack) == jnp.bfloat16
  x = x.astype(jnp.float32)
  assert applies(spec=promoted, stack=stack) is None
  assert applies(stack=stack) == jnp.bfloat16  # cast to dtype=bfloat16
  x = jnp.zeros((96, 256), jnp.bfloat16)
  assert applies(stack=stack) is None  # no tile divides 96 tokens
  x = jax.ShapeDtypeStruct((matmul.MAX_IN_PLACE_TOKENS, 256), jnp.bfloat16)
  assert applies(stack=stack) == jnp.bfloat16
  x = x.update(shape=(2 * matmul.MAX_IN_PLACE_TOKENS, 256))
  assert applies(stack=stack) is None  # XLA's GEMM is faster there


@pytest.mark.slow
def test_scanned_layers_with_the_in_place_product_step_like_xla_interpret(
  monkeypatch,
):
  """The in-place products wired into fj.scan (reshapes, casts, the bias's
  gradient), run in interpret mode as if on a Hopper GPU, with the XLA
  update: the steps match 'xla'. Blocks without nn.remat: interpret mode's
  callbacks cannot be rematerialized."""
  expected_state, expected = _train("xla", steps=2, remat=False)
  monkeypatch.setattr(backends, "on_hopper_or_newer", lambda: True)
  xla_update = backends.xla_update
  monkeypatch.setattr(backends, "select", lambda *_, **__: xla_update)
  traced = []
  stacked_matmul = matmul.stacked_matmul
  monkeypatch.setattr(
    matmul,
    "stacked_matmul",
    lambda *args, **kwargs: (
      traced.append(kwargs) or stacked_matmul(*args, **kwargs)
    ),
  )
  state, losses = _train("auto", steps=2, remat=False)
  # up and down: each forward (a vjp in fj.scan's forward) and each dx.
  assert len(traced) == 4
  np.testing.assert_allclose(losses, expected, rtol=1e-3)
  for leaf, ref in zip(
    jax.tree.leaves(state.params), jax.tree.leaves(expected_state.params)
  ):
    np.testing.assert_allclose(
      np.asarray(leaf, np.float32), np.asarray(ref, np.float32), atol=5e-3
    )
