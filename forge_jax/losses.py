"""A cross entropy whose gradient holds no float32 copy of the logits.

``optax.softmax_cross_entropy_with_integer_labels`` on a language model's
logits (``[tokens, vocab]``, often bfloat16, upcast to float32 for the
loss) differentiates through ``take_along_axis``, whose transpose scatters
the labels' cotangents into a float32 array of zeros of the logits' shape:
the backward pass holds that array beside the logits and their gradient.
At the Llama-3.1-8B vocabulary and 8192 tokens it is 4.2 GB.

:func:`softmax_cross_entropy_with_integer_labels` computes the same losses
with a ``jax.custom_vjp`` whose backward forms the gradient in one
elementwise pass from the logits and two per-row statistics, with the
labels' one-hot as a comparison against an iota:

.. math::
  \\frac{\\partial \\ell_i}{\\partial x_{ij}}
  = g_i \\frac{e^{x_{ij} - m_i}}{s_i} - g_i [j = y_i],
  \\quad m_i = \\max_j x_{ij},\\ s_i = \\sum_j e^{x_{ij} - m_i},

in float32, cast to the logits' dtype: the arithmetic autodiff of optax's
loss performs, so the losses are optax's bits and the gradient is too
where XLA compiles both alike (bfloat16 logits: bit for bit; float32: to
the contraction of ``e * (g / s) - g`` into a multiply-add).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


@jax.custom_vjp
def softmax_cross_entropy_with_integer_labels(
  logits: jax.Array, labels: jax.Array
) -> jax.Array:
  """``optax.softmax_cross_entropy_with_integer_labels(logits.astype(f32),
  labels)``: the float32 loss of each row of ``logits [..., classes]`` at
  its integer label ``labels [...]``, with a backward that holds no
  float32 array of the logits' shape."""
  losses, _ = _forward(logits, labels)
  return losses


def _forward(logits, labels):
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"labels.dtype={labels.dtype} must be an integer dtype")
  if labels.shape != logits.shape[:-1]:
    raise ValueError(
      f"{labels.shape=} must be the logits' shape {logits.shape} without "
      "its last (class) axis"
    )
  x = logits.astype(jnp.float32)
  # As jax.nn.logsumexp computes it, the maximum held out of the gradient.
  row_max = lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
  row_sum = jnp.sum(jnp.exp(x - row_max), axis=-1, keepdims=True)
  log_normalizer = (jnp.log(row_sum) + row_max)[..., 0]
  label_logit = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
  return log_normalizer - label_logit, (logits, labels, row_max, row_sum)


def _backward(residuals, cotangent):
  logits, labels, row_max, row_sum = residuals
  x = logits.astype(jnp.float32)
  classes = lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)
  g = cotangent[..., None]
  grad = jnp.exp(x - row_max) * (g / row_sum) + jnp.where(
    classes == labels[..., None], -g, 0.0
  )
  return grad.astype(logits.dtype), None


softmax_cross_entropy_with_integer_labels.defvjp(_forward, _backward)
