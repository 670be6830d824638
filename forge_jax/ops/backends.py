"""Weight-update backends of the fused dense op, and the switch between them.

A backend is a function
``(spec, x, dy, kernel, opt_state, scalars, apply, *, rounding_key=None,
offset=None, layer_index=None) -> (kernel, opt_state, skipped, grad_sq_norm)``
that forms ``dW = x.T @ dy`` (contracting every axis but the last), applies
the optimizer rule, and sums the squares of the float32 ``dW`` elements
(``grad_sq_norm``, the layer's part of the global gradient norm).
``rounding_key`` is the layer's stochastic rounding key
(:func:`forge_jax.quantization.rounding_key` of its seed, id and step; None
without stochastic rounding). ``offset`` is the global ``(row, column)`` of
the kernel's element ``(0, 0)`` when ``kernel`` is one shard of a larger
kernel (None: the whole kernel): stochastic rounding hashes global indices,
so a shard draws the bits the whole kernel would. With a ``layer_index`` (an
int32 scalar), ``kernel`` and every ``opt_state`` leaf are stacked on a
leading layer axis, only that layer is stepped, and the whole stacks come back
(updated in place). ``'xla'`` is the reference: plain XLA ops, the
specification, and the default where no GPU kernel applies.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import quantization
from forge_jax.ops import stacks
from forge_jax.ops.update import apply_update


def as_stored(*operands) -> tuple:
  """``operands`` as their dtypes hold them, for a dot that accumulates in
  float32. XLA's CPU compiler computes such a dot of 16-bit operands in
  float32 and, allowed excess precision, then drops the rounding of an
  operand made by a float32 op (the input after a LayerNorm or GELU): the
  product would read values neither ``nn.Dense``'s gradient nor the
  kernels see. An optimization barrier keeps the rounded operands."""
  if all(jnp.dtype(a.dtype).itemsize >= 4 for a in operands):
    return operands
  return lax.optimization_barrier(operands)


def weight_gradient(x, dy, precision=None):
  """``dW = x.T @ dy`` in float32, with the dimension numbers autodiff uses
  (on the operands :func:`as_stored`)."""
  x, dy = as_stored(x, dy)
  batch_axes = tuple(range(x.ndim - 1))
  return lax.dot_general(
    x,
    dy,
    ((batch_axes, batch_axes), ((), ())),
    precision=precision,
    preferred_element_type=jnp.float32,
  )


def weight_gradient_sq_norm(x, dy, precision=None, data_axes=()):
  """``sum((x.T @ dy) ** 2)`` in float32, without an update.

  With few tokens ``T`` it never forms ``dW``: ``||x.T dy||_F^2 = sum((x
  x.T) * (dy dy.T))`` costs ``2 T^2 (K + N)`` flops and two ``T x T``
  float32 temporaries, against the ``2 T K N`` flops and ``K x N`` float32
  temporary of ``dW``; the cheaper of the two runs. With ``data_axes``
  (data parallelism by psum) the shards' partial ``dW`` are summed first.
  """
  k, n = x.shape[-1], dy.shape[-1]
  tokens = math.prod(x.shape[:-1])
  if data_axes or tokens * (k + n) >= k * n:
    grad = weight_gradient(x, dy, precision)
    if data_axes:
      grad = lax.psum(grad, data_axes)
    return jnp.sum(jnp.square(grad))
  x, dy = as_stored(x, dy)
  gram = lambda a: lax.dot_general(
    a,
    a,
    (((1,), (1,)), ((), ())),
    precision=precision,
    preferred_element_type=jnp.float32,
  )
  return jnp.sum(gram(x.reshape(tokens, k)) * gram(dy.reshape(tokens, n)))


#: Elements of ``dW`` the XLA reference forms at once (128 MiB of float32).
#: A larger layer is stepped in chunks of rows, each chunk's ``dW`` formed
#: by its own GEMM and stepped before the next: the reference's float32
#: temporaries (``dW`` and, with int8 or 4-bit states, the rule's
#: intermediates) are then those of one chunk instead of the whole layer.
XLA_CHUNK_ELEMENTS = 2**25

#: Rows a chunk keeps at least: a kernel whose rows have no divisor this
#: large that fits :data:`XLA_CHUNK_ELEMENTS` is stepped whole.
MIN_CHUNK_ROWS = 64


def chunk_rows(k: int, n: int) -> int:
  """Rows of the XLA reference's chunks of a ``[k, n]`` kernel: the largest
  divisor of ``k`` whose ``rows x n`` chunk holds at most
  :data:`XLA_CHUNK_ELEMENTS`; ``k`` (one chunk) when the kernel fits or no
  divisor of at least :data:`MIN_CHUNK_ROWS` rows does."""
  limit = XLA_CHUNK_ELEMENTS
  if k * n <= limit:
    return k
  divisors = {
    d for i in range(1, math.isqrt(k) + 1) if k % i == 0 for d in (i, k // i)
  }
  rows = max((d for d in divisors if d * n <= limit), default=0)
  return rows if rows >= MIN_CHUNK_ROWS else k


def arrays_are_local() -> bool:
  """Whether a trace's arrays are wholly this device's: with one device and
  no mesh, or under a ``shard_map`` whose every mesh axis is manual (the
  sharded layers' per-shard code). Elsewhere XLA's partitioner may shard
  them (a jit's shardings), and a row chunk's dynamic slice of a sharded
  dimension would gather it."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return jax.device_count() == 1
  return set(mesh.manual_axes) == set(mesh.axis_names)


def xla_update(
  spec,
  x,
  dy,
  kernel,
  opt_state,
  scalars,
  apply,
  *,
  rounding_key=None,
  offset=None,
  layer_index=None,
):
  """Reference backend: ``dW`` through XLA, then the elementwise rule; a
  kernel of more than :data:`XLA_CHUNK_ELEMENTS` elements whose arrays are
  local (:func:`arrays_are_local`) chunk by chunk of rows
  (:func:`chunk_rows`), each written back in place. Every element gets the
  same rule and rounding bits either way (the chunks pass their global row
  offsets); only ``grad_sq_norm`` sums in another order."""
  k, n = kernel.shape[-2:]
  rows = chunk_rows(k, n) if arrays_are_local() else k
  if rows == k:
    return apply_gradient(
      spec,
      weight_gradient(x, dy, spec.precision),
      kernel,
      opt_state,
      scalars,
      apply,
      rounding_key=rounding_key,
      offset=offset,
      layer_index=layer_index,
    )
  row0, col0 = (0, 0) if offset is None else offset
  layer = () if layer_index is None else (layer_index,)
  zero = jnp.int32(0)

  def read(stack, start):
    """Rows ``start:start + rows`` of the (layer's) 2-D leaf."""
    sizes = (1,) * len(layer) + (rows, stack.shape[-1])
    chunk = lax.dynamic_slice(stack, (*layer, start, zero), sizes)
    return chunk.reshape(sizes[-2:])

  def write(stack, chunk, start):
    chunk = chunk.reshape((1,) * len(layer) + chunk.shape)
    return lax.dynamic_update_slice(stack, chunk, (*layer, start, zero))

  def step_chunk(i, carry):
    kernel, opt_state, skipped, grad_sq_norm = carry
    start = i * rows
    x_rows = lax.dynamic_slice_in_dim(x, start, rows, axis=x.ndim - 1)
    new_kernel, new_state, chunk_skipped, chunk_sq = apply_gradient(
      spec,
      weight_gradient(x_rows, dy, spec.precision),
      read(kernel, start),
      jax.tree.map(lambda s: read(s, start), opt_state),
      scalars,
      apply,
      rounding_key=rounding_key,
      offset=(row0 + start, col0),
    )
    return (
      write(kernel, new_kernel, start),
      jax.tree.map(lambda s, c: write(s, c, start), opt_state, new_state),
      skipped + chunk_skipped,
      grad_sq_norm + chunk_sq,
    )

  return lax.fori_loop(
    0,
    k // rows,
    step_chunk,
    (kernel, opt_state, jnp.int32(0), jnp.float32(0)),
  )


def apply_gradient(
  spec,
  grad,
  kernel,
  opt_state,
  scalars,
  apply,
  *,
  rounding_key=None,
  offset=None,
  layer_index=None,
):
  """The elementwise rule on a whole float32 ``grad``, updating in place:
  ``(new_kernel, new_state, skipped, grad_sq_norm)``.

  With a ``layer_index``, ``kernel`` and ``opt_state`` are stacks: the
  layer's entries are stepped and written back with
  ``dynamic_update_slice``, which XLA fuses with the update and runs in place.

  Elements whose new kernel or state would not be finite as stored are
  skipped (``guard_results``, as in the fused kernels) only for int8
  states: an int8 block that receives one stores NaN (its scale), and the
  next step would write NaN over the whole block's weights. Float states
  take the value as it comes (an overflowed second moment stays infinite
  and freezes its element, as in optax), which spares the check's
  kernel-sized temporary.

  The state's stores are ordered after the kernel's update
  (``order_in_place``) only when XLA compiles for the CPU: its CPU compiler
  keeps the kernel's and the state's updates in separate fusions and would
  otherwise copy the old state. XLA's GPU compiler fuses them into one
  multi-output fusion that updates every buffer in place, which the
  ordering would split again (on an H200, one-layer and scanned steps took
  1.2-1.6x the time and 1.0-3.3x the temporary memory with it).
  """
  # Summed before the update reads dW (the barrier orders it): summed
  # later, the reduction would hold dW alive beside the next layer's.
  grad, grad_sq_norm = lax.optimization_barrier(
    (grad, jnp.sum(jnp.square(grad.astype(jnp.float32))))
  )
  new_kernel, new_state, updated = apply_update(
    spec.optimizer,
    grad,
    kernel,
    opt_state,
    scalars,
    apply,
    order_in_place=jax.default_backend() == "cpu",
    guard_results=quantization.has_quantized(opt_state),
    rounding_key=rounding_key,
    indices=global_indices(kernel.shape[-2:], offset),
    layer_index=layer_index,
  )
  return (
    stacks.with_layer_entry(kernel, new_kernel, layer_index),
    stacks.with_layer_entries(opt_state, new_state, layer_index),
    jnp.sum(jnp.logical_not(updated), dtype=jnp.int32),
    grad_sq_norm,
  )


def global_indices(shape, offset):
  """``(rows, cols)``: the global indices of a ``shape`` kernel shard whose
  element ``(0, 0)`` is at ``offset`` (None: a whole kernel, no indices)."""
  if offset is None:
    return None
  row0, col0 = offset
  rows = row0 + lax.broadcasted_iota(jnp.int32, (shape[0], 1), 0)
  cols = col0 + lax.broadcasted_iota(jnp.int32, (1, shape[1]), 1)
  return rows, cols


def on_gpu() -> bool:
  """Whether JAX's default backend is a GPU."""
  return jax.default_backend() == "gpu"


def on_hopper_or_newer() -> bool:
  """sm90+: where Mosaic GPU's wgmma/TMA kernel runs."""
  if not on_gpu():
    return False
  capability = getattr(jax.devices()[0], "compute_capability", "0")
  try:
    return float(capability) >= 9.0
  except ValueError:  # not an NVIDIA "major.minor" (e.g. a ROCm gfx name)
    return False


@functools.cache
def lowered_once(update):
  """``update`` as one jitted function shared by every call site.

  A model with unrolled layers calls a kernel once per projection. Traced
  under one ``jax.jit``, calls with the same shapes, dtypes and static
  configuration share one jaxpr, which JAX lowers once into one function of
  the module, so the kernel is traced, lowered and compiled once instead of
  once per call site. The spec's module path and ``layer_id`` play no part
  in an update (stochastic rounding's key arrives as a traced argument):
  both are cleared, so the layers of a model share one function.
  """
  jitted = jax.jit(update, static_argnums=0)

  @functools.wraps(update)
  def shared(spec, *args, **kwargs):
    return jitted(
      dataclasses.replace(spec, path=None, layer_id=0), *args, **kwargs
    )

  return shared


def _half_precision(x, dy) -> bool:
  """Whether both activations are 16-bit floats (tensor-core inputs)."""
  return all(jnp.dtype(a.dtype).itemsize == 2 for a in (x, dy))


def select(implementation: str, x, dy, kernel, optimizer):
  """The backend for ``implementation``; 'auto' picks the fastest that applies.

  'auto' uses, on a GPU:

  - the Mosaic GPU kernel (Hopper and newer) when it supports the call, int8
    states and 4-bit second moments included, and its tiles fill the GPU
    for the call's token count (:func:`forge_jax.ops.mosaic.fills_the_gpu`);
    when they do not, the XLA reference, which is faster there;
  - else, for 4-bit second moments, the XLA reference: in row chunks
    (:data:`XLA_CHUNK_ELEMENTS`) it took the Llama-3.1-8B step to 0.44x
    (512 tokens) and 0.62x (2048) the time of the step through the Triton
    kernel, at up to 0.4 GiB more peak memory, on an H200
    (docs/kernels.md);
  - else the Pallas-Triton kernel when it supports the call and the
    activations are 16-bit. With float32 activations (a TF32 ``dW`` by
    default, as XLA's) its programs, one per output tile, ran 1.3-2.1x the
    XLA reference's time on an H200;
  - else the XLA reference.

  The Mosaic kernel's int8 update is the faster one, and the Triton kernel
  refuses int8 states of stacks past 2**31 elements (docs/kernels.md). An
  explicit 'triton' or 'mosaic' on a machine without a GPU runs that kernel
  in its Pallas interpret mode; where the kernel cannot run the call it
  raises and says why.
  """
  # pylint: disable=import-outside-toplevel
  if implementation == "xla":
    return xla_update
  from forge_jax.ops import mosaic, triton_kernel

  if implementation == "triton":
    triton_kernel.check_supported(x, dy, kernel, optimizer)
    return lowered_once(triton_kernel.triton_update)
  if implementation == "mosaic":
    mosaic.check_supported(x, dy, kernel, optimizer)
    return lowered_once(mosaic.mosaic_update)
  if implementation == "auto":
    if (
      on_hopper_or_newer()
      and mosaic.unsupported_reason(x, dy, kernel, optimizer) is None
    ):
      if mosaic.fills_the_gpu(x, kernel, optimizer):
        return lowered_once(mosaic.mosaic_update)
      return xla_update
    if (
      on_gpu()
      and _half_precision(x, dy)
      and optimizer.second_moment_bits != 4
      and triton_kernel.unsupported_reason(x, dy, kernel, optimizer) is None
    ):
      return lowered_once(triton_kernel.triton_update)
    return xla_update
  raise ValueError(
    f"{implementation=} must be 'auto', 'xla', 'triton' or 'mosaic'"
  )
