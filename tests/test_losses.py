"""``fj.softmax_cross_entropy_with_integer_labels``: optax's losses, a
leaner backward.

The losses are optax's bits; the gradient is autodiff's of optax's loss
bit for bit for bfloat16 logits and within an ulp for float32 ones; the
compiled gradient of a bfloat16 head holds at least one logits-sized
bfloat16 array less than optax's (CPU; on the GPU a float32 one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax as fj

from conftest import assert_bitwise_equal, ulp_distance


def _optax_loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), labels
  )


def _case(seed, dtype, shape=(2, 24, 1000)):
  keys = jax.random.split(jax.random.key(seed), 3)
  logits = (4 * jax.random.normal(keys[0], shape)).astype(dtype)
  labels = jax.random.randint(keys[1], shape[:-1], 0, shape[-1])
  cotangent = jax.random.normal(keys[2], shape[:-1])
  return logits, labels, cotangent


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_losses_and_gradient_are_optaxs(dtype, seed):
  logits, labels, cotangent = _case(seed, dtype)

  @functools.partial(jax.jit, static_argnums=1)
  def losses_and_grad(logits, loss):
    values, vjp = jax.vjp(lambda x: loss(x, labels), logits)
    return values, vjp(cotangent)[0]

  ours = losses_and_grad(logits, fj.softmax_cross_entropy_with_integer_labels)
  theirs = losses_and_grad(logits, _optax_loss)
  assert_bitwise_equal(ours[0], theirs[0], "losses")
  assert ours[1].dtype == dtype
  if dtype == jnp.bfloat16:
    assert_bitwise_equal(ours[1], theirs[1], "gradient")
  else:  # e * (g / s) - g may contract into a multiply-add either way
    assert ulp_distance(ours[1], theirs[1]).max() <= 1


def test_gradient_of_a_bf16_head_holds_less_memory():
  """The compiled gradient through a bfloat16 head (512 tokens, 32000
  classes) needs at least one bfloat16 logits array less temp memory."""
  tokens, width, classes = 512, 256, 32000
  x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((width, classes), jnp.bfloat16)
  labels = jnp.zeros((tokens,), jnp.int32)
  temp = {}
  for name, loss in (
    ("ours", fj.softmax_cross_entropy_with_integer_labels),
    ("optax", _optax_loss),
  ):
    grad = jax.grad(lambda w, x, loss=loss: loss(x @ w, labels).mean())
    compiled = jax.jit(grad).lower(w, x).compile()
    temp[name] = compiled.memory_analysis().temp_size_in_bytes
  assert temp["ours"] <= temp["optax"] - tokens * classes * 2, temp


def test_labels_are_checked():
  logits = jnp.zeros((4, 10))
  with pytest.raises(TypeError, match="integer"):
    fj.softmax_cross_entropy_with_integer_labels(logits, jnp.zeros((4,)))
  with pytest.raises(ValueError, match="class"):
    fj.softmax_cross_entropy_with_integer_labels(
      logits, jnp.zeros((4, 10), jnp.int32)
    )
  np.testing.assert_allclose(
    fj.softmax_cross_entropy_with_integer_labels(
      logits, jnp.zeros((4,), jnp.int32)
    ),
    np.log(10.0),
    rtol=1e-6,
  )
