"""Tensor, sequence and data parallelism for FORGE, with ``jax.shard_map``.

FORGE stays exact under tensor parallelism (TP) because every shard's weight
gradient is complete at backward time:

* column-parallel (kernel sharded on N): ``dW_shard = Xᵀ · dY_shard``;
* row-parallel (kernel sharded on K): ``dW_shard = X_shardᵀ · dY``;
* with sequence parallelism (SP) the activations outside the TP region are
  sharded on the sequence over the TP axis; they are all-gathered before a
  column-parallel layer and reduce-scattered after a row-parallel one, so
  the local ``dW`` still sees every token.

Data parallelism is FSDP: a mesh axis that shards the input's tokens (the
batch) and the kernel too (MaxText's layout: the kernel's embedding
dimension). The kernel and every state leaf that follows it stay sharded
over the axis; the layer all-gathers its kernel just in time in the forward
and again in the backward, forms ``dW`` of its local tokens in blocks,
reduce-scatters each block over the axis onto its own shard, and applies
the elementwise update to that shard. No state is ever gathered.

The fused op cannot be left to XLA's partitioner (the Pallas kernel is
opaque to it, and a partitioner that gathers a weight defeats the point), so
:func:`forge_jax.forge_dense`, given the :class:`ShardedLayout` that
:func:`plan_layout` makes here, runs the layer per shard inside
``jax.shard_map`` (:func:`per_shard`) with its collectives written out:

================  ==========================  ===============================
where             forward                     backward
================  ==========================  ===============================
x tokens on an    all-gather x (SP)           reduce-scatter dx
axis of N
kernel K sharded  psum y, or reduce-scatter   all-gather dy if y was
(TP)              y onto a token axis (SP)    reduce-scattered
kernel N sharded  (y stays N-sharded)         psum dx (or reduce-scatter,
(TP)                                          above)
kernel and        all-gather the kernel       all-gather the kernel; dW of
tokens on an      over the axis               the local tokens
axis (FSDP)                                   reduce-scattered over it, in
                                              blocks
every shard       --                          the optimizer update of the
                                              local kernel and state
================  ==========================  ===============================

Each shard updates its own kernel and state shards on local shapes: with
the backend of the one-device op where its ``dW`` is complete (TP), with the
rule every backend applies (``apply_update``) after the reduce-scatter
(FSDP). Stochastic rounding hashes every element's global ``(row, column)``
(the shard passes its offset), so a shard draws the bits one device would.
int8 block states are sharded with the kernel, their scales
``[K, ceil(N / 64)]`` too; column shards must hold whole blocks of 64
(:func:`check_block_split`), so each shard's scales are exactly its blocks.

The whole layer is the one-device op's ``jax.custom_vjp``
(:mod:`forge_jax.ops.fused_dense`) over *global* arrays, whose forward and
backward rules are each a ``shard_map`` of the same per-shard code that runs
on one device, where every collective is the identity: JAX never transposes
the ``shard_map``, so no cotangent is implicitly summed over devices, and
the updated kernel shards come back with exactly the kernel's sharding. This
module plans and checks layouts and places the operands; it holds no part
of the op's forward or backward.

**Data parallelism over a replicated kernel is refused.** FORGE applies the
update inside the backward pass, from the gradient of the tokens the shard
sees. If tokens are sharded over a mesh axis that does not shard the kernel,
every replica would apply a different, partial update; under a user's
``shard_map`` the replicas' new kernels would even be summed.
:class:`DataParallelError` is raised at trace time instead, and so it is
where the layer cannot know how its input is sharded (Auto mesh axes and
no declared input partitioning). ``data_parallel='psum'`` opts in to a
correct but unfused alternative: the backward all-reduces ``dW`` over such
axes before the update, at the cost of plain data parallelism (a float32
``dW`` per layer shard, W and its states whole on every replica); with FSDP
over another axis that is hybrid sharding.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import mesh as mesh_lib  # the deprecated `with mesh:`'s
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from forge_jax import quantization

DATA_PARALLEL_MODES = ("auto", "psum", "error")

Axes = tuple  # a tuple of mesh axis names (empty: not sharded)


class DataParallelError(ValueError):
  """A layer's tokens are (or may be) sharded over a mesh axis in a way that
  FORGE cannot train exactly without gathering a kernel or state."""


class ShardingWarning(UserWarning):
  """A layout is exact but gathers a kernel for no data parallelism (warned
  once per layer and axes)."""


def make_mesh(
  model: int,
  data: int = 1,
  devices: Optional[Sequence] = None,
  axis_names: tuple = ("data", "model"),
) -> Mesh:
  """A ``(data, model)`` mesh with Auto axes over the first ``data * model``
  devices.

  ``axis_names`` renames the two axes in that order: the first, of size
  ``data``, and the second, of size ``model``, whatever their names.

  ``jax.make_mesh`` makes Explicit axes by default in recent JAX; Flax's
  partitioning metadata (``nn.with_partitioning``) and the Llama model here
  work with Auto axes (sharding constraints, XLA's propagation between
  layers).
  """
  devices = list(jax.devices() if devices is None else devices)
  if data * model > len(devices):
    raise ValueError(
      f"a {data}x{model} mesh needs {data * model} devices, "
      f"{len(devices)} available"
    )
  grid = np.empty((data, model), dtype=object)
  for i, device in enumerate(devices[: data * model]):
    grid[i // model, i % model] = device
  return Mesh(grid, axis_names, axis_types=(AxisType.Auto,) * len(axis_names))


# ---------------------------------------------------------------------------
# Layout: what each dimension is sharded over, and which collectives follow.


def _entries(spec, ndim: int, where: str, what: str) -> tuple:
  """``spec``'s mesh axes per dimension, padded with () to ``ndim``."""
  entries = tuple(_axes(e) for e in tuple(spec))
  if len(entries) > ndim:
    raise ValueError(
      f"{where}: {what} partitioning {spec} has more entries "
      f"than the {what} has dimensions ({ndim})"
    )
  return entries + ((),) * (ndim - len(entries))


def _axes(entry) -> Axes:
  """A PartitionSpec entry (None, a name, or a tuple of names) as a tuple."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  out = []
  for e in entry:
    out.extend(_axes(e))
  return tuple(out)


def _entry(axes: Axes):
  """The PartitionSpec entry for a tuple of axis names."""
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _spec(dims: Sequence[Axes]) -> P:
  return P(*(_entry(a) for a in dims))


def _mesh_sizes(mesh) -> dict:
  return dict(zip(mesh.axis_names, mesh.axis_sizes))


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
  """How one ForgeDense call is sharded (static and hashable).

  The layout without a mesh (:func:`unsharded_layout`) is the one-device
  op: nothing is sharded and every collective is the identity.

  Attributes:
    mesh: the ``Mesh`` (or ``AbstractMesh``) the op runs on; None: one
      device.
    x: mesh axes of every dimension of the input ``[..., K]``.
    kernel: mesh axes of the kernel's ``(K, N)`` dimensions: how the
      kernel and every state leaf that follows it are stored.
    y: mesh axes of every dimension of the output ``[..., N]``.
    gather: ``(dim, axes)``: input token dimension all-gathered over axes of
      the kernel's N (sequence parallelism into a column-parallel layer), or
      None.
    scatter: ``(dim, axes)``: output token dimension that the partial sums
      over the kernel's K axes are reduce-scattered onto (sequence
      parallelism out of a row-parallel layer), or None.
    data_axes: mesh axes (of size > 1) that shard the tokens but not the
      kernel: data parallelism over a replicated kernel ('psum').
    data_parallel: 'auto', 'psum' or 'error' (see the module docstring).
    weight_gather: per kernel dimension ``(K, N)``, the trailing axes of
      ``kernel`` that the layer all-gathers the kernel over just in time
      (FSDP when they shard the tokens, see :attr:`token_axes`); its
      weight gradient is reduce-scattered back over them.
    token_axes: mesh axes (of size > 1) that shard the tokens the layer
      computes on (after the gather): ``dW`` and ``dbias`` sum over them.
  """

  mesh: Any
  x: tuple
  kernel: tuple
  y: tuple
  gather: Optional[tuple] = None
  scatter: Optional[tuple] = None
  data_axes: Axes = ()
  data_parallel: str = "auto"
  weight_gather: tuple = ((), ())
  token_axes: Axes = ()

  @property
  def k_axes(self) -> Axes:
    """The tensor-parallel axes of the kernel's K (the input's features)."""
    return _drop(self.kernel[0], self.weight_gather[0])

  @property
  def n_axes(self) -> Axes:
    """The tensor-parallel axes of the kernel's N (the output's features)."""
    return _drop(self.kernel[1], self.weight_gather[1])

  @property
  def kernel_axes(self) -> Axes:
    """Every axis the stored kernel is sharded over."""
    return self.kernel[0] + self.kernel[1]

  @property
  def live_weight_gather(self) -> tuple:
    """:attr:`weight_gather` without axes of size 1 (no collective)."""
    sizes = _mesh_sizes(self.mesh) if self.mesh is not None else {}
    return tuple(
      tuple(a for a in axes if sizes[a] > 1) for axes in self.weight_gather
    )

  @property
  def reduces_weight_gradient(self) -> bool:
    """Whether ``dW`` needs a collective before the update (FSDP or
    'psum'): the update then follows a reduce-scatter, unfused."""
    return bool(self.data_axes or any(self.live_weight_gather))

  def gradient_blocks(self, shape, quantized: bool) -> tuple:
    """``(dimension, count)``: the local kernel dimension (0: rows, 1:
    columns) whose weight gradient an FSDP layer forms in ``count`` blocks.

    A kernel gathered over one dimension is stepped in blocks of the
    other, as many as the devices its gradient is reduce-scattered over, so
    a block's transient ``dW`` is the size of this shard's ``dW`` (fewer
    blocks where the extent does not divide; column blocks of int8 states
    hold whole blocks of 64). ``(None, 1)``: one piece (no FSDP, or both
    dimensions gathered).
    """
    gathered = self.live_weight_gather
    if bool(gathered[0]) == bool(gathered[1]):
      return None, 1
    blocked = 0 if gathered[1] else 1
    sizes = _mesh_sizes(self.mesh)
    devices = math.prod(sizes[a] for a in gathered[1 - blocked])
    for count in range(devices, 1, -1):
      size, rest = divmod(shape[blocked], count)
      if rest == 0 and not (
        quantized and blocked == 1 and size % quantization.BLOCK_SIZE
      ):
        return blocked, count
    return None, 1

  @property
  def mesh_axes(self) -> Axes:
    """Every axis of the mesh (none without one)."""
    return () if self.mesh is None else tuple(self.mesh.axis_names)

  def kernel_spec(self) -> P:
    return _spec(self.kernel)

  def y_spec(self) -> P:
    return _spec(self.y)

  def bias_spec(self) -> P:
    return _spec((self.n_axes,))


def _drop(axes: Axes, dropped: Axes) -> Axes:
  return tuple(a for a in axes if a not in dropped)


def unsharded_layout(x_ndim: int) -> ShardedLayout:
  """The layout of the one-device op: no mesh, no dimension sharded."""
  return ShardedLayout(
    mesh=None, x=((),) * x_ndim, kernel=((), ()), y=((),) * x_ndim
  )


def layer_layout(
  inputs,
  mesh,
  kernel_names,
  input_names,
  output_names,
  resolve,
  data_parallel: str = "auto",
  where: str = "ForgeDense",
  refuse_undeclared_input: bool = True,
  undeclared_advice: Optional[str] = None,
) -> Optional[ShardedLayout]:
  """The layout a layer plans for ``inputs`` (:func:`plan_layout`), or None
  without a mesh (``mesh`` None and none set with ``jax.set_mesh``): its
  partitioning is then inert, as ``nn.Dense``'s.

  ``kernel_names`` (names of the ``[K, N]`` view's dimensions), and
  ``input_names`` and ``output_names`` (None, or names of the input's and
  output's dimensions) become specs through ``resolve``; under Explicit
  axes an undeclared input's type says how it is sharded.
  ``undeclared_advice``: what the error for an undeclared input (a mesh
  axis that shards neither the kernel nor a declared input) advises, for a
  layer without ``input_partitioning``; ``{axis}`` names the axis.
  ``refuse_undeclared_input`` False (init): an undeclared input is not
  refused, and the declared output is not checked against it.
  """
  context = jax.sharding.get_abstract_mesh()
  if mesh is None:
    mesh = context
    if mesh.empty:
      return None
  elif not context.empty and mesh.abstract_mesh != context:
    raise ValueError(
      f"{where}: the layer's mesh {_mesh_sizes(mesh)} (its mesh field, or "
      "its partitioning's) is not the mesh set with jax.set_mesh "
      f"{_mesh_sizes(context)}: the layer runs per shard of its own mesh, "
      "which JAX allows only under that mesh. Pass the same mesh, or leave "
      "the layer's mesh None to use jax.set_mesh's."
    )
  x_spec, y_spec = (
    None if names is None else resolve(tuple(names))
    for names in (input_names, output_names)
  )
  if x_spec is None and is_explicit(mesh):
    x_spec = getattr(jax.typeof(inputs).sharding, "spec", None)
  if input_names is None and not refuse_undeclared_input:
    # Init, whose forward only shapes the variables, with the input's
    # sharding unknown (Auto axes, init_sharded's Auto copy of an Explicit
    # mesh) or that of the example input: the declared output, laid out
    # from the input the layer is applied to, is not checked against it.
    y_spec = None
  return plan_layout(
    mesh,
    jnp.ndim(inputs),
    resolve(tuple(kernel_names)),
    x_spec,
    y_spec,
    data_parallel,
    where=where,
    refuse_undeclared_input=refuse_undeclared_input,
    undeclared_advice=undeclared_advice,
  )


def plan_layout(
  mesh,
  x_ndim: int,
  kernel_spec,
  x_spec=None,
  y_spec=None,
  data_parallel: str = "auto",
  where: str = "ForgeDense",
  refuse_undeclared_input: bool = True,
  undeclared_advice: Optional[str] = None,
) -> ShardedLayout:
  """The :class:`ShardedLayout` of a dense layer, validated.

  Every mesh axis of the kernel's partitioning is one of:

  * tensor-parallel on K: the input's features are sharded over it too;
  * tensor-parallel on N: the output's features are sharded over it (the
    default for an axis of N);
  * gathered just in time: an axis of K that does not shard the input's
    features, or an axis of N that a declared output partitioning leaves
    out of the output's features. Where it also shards the input's tokens,
    that is FSDP (the weight gradient is reduce-scattered over it); where it
    does not, every device computes on all tokens and the gathered kernel
    is only a memory layout (exact; :class:`ShardingWarning`, once).

  Args:
    mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh``.
    x_ndim: rank of the input.
    kernel_spec: the kernel's PartitionSpec (or tuple of 2 entries).
    x_spec: the input's PartitionSpec (one entry per dimension); None: the
      tokens are not sharded and the features are sharded like the kernel's
      K. Undeclared on a mesh with an axis of size > 1 that the kernel does
      not use, it raises :class:`DataParallelError` (under Auto axes the
      input's sharding is not known at trace time).
    y_spec: the output's PartitionSpec; None: derived (tokens as the input's
      after any gather, features like the kernel's N, partial sums over the
      kernel's K all-reduced).
    data_parallel: 'auto' (FSDP over axes that shard the tokens and the
      kernel; :class:`DataParallelError` for an axis that shards the tokens
      but not the kernel), 'psum' (such an axis all-reduces ``dW``) or
      'error' (any axis that shards the tokens outside sequence parallelism
      raises).
    where: the layer's name for error messages.
    refuse_undeclared_input: False skips the check of an undeclared input
      (init, whose forward only shapes the variables).
  """
  if data_parallel not in DATA_PARALLEL_MODES:
    raise ValueError(
      f"{where}: data_parallel={data_parallel!r} must be one of "
      f"{DATA_PARALLEL_MODES}"
    )
  sizes = _mesh_sizes(mesh)
  kernel = tuple(_axes(e) for e in tuple(kernel_spec))
  if len(kernel) != 2:
    raise ValueError(
      f"{where}: the kernel's partitioning {kernel_spec} must "
      "have 2 entries (in_features, features)"
    )
  k_axes, n_axes = kernel
  declared_x = x_spec is not None
  if x_spec is None:
    x = ((),) * (x_ndim - 1) + (k_axes,)
  else:
    x = _entries(x_spec, x_ndim, where, "input")
  declared_y = (
    None if y_spec is None else _entries(y_spec, x_ndim, where, "output")
  )
  for axes in x + kernel + (declared_y or ()):
    for a in axes:
      if a not in sizes:
        raise ValueError(
          f"{where}: mesh axis {a!r} is not in the mesh {tuple(sizes)}"
        )
  if set(k_axes) & set(n_axes):
    raise ValueError(
      f"{where}: kernel partitioning {kernel_spec} uses an axis twice"
    )

  # Kernel axes gathered just in time: on K, those the input's features are
  # not sharded over; on N, those a declared output's features are not.
  weight_gather = (
    tuple(a for a in k_axes if a not in x[-1]),
    ()
    if declared_y is None
    else tuple(a for a in n_axes if a not in declared_y[-1]),
  )
  for dim, (axes, gathered) in enumerate(zip(kernel, weight_gather)):
    if gathered and axes[len(axes) - len(gathered) :] != gathered:
      raise ValueError(
        f"{where}: the kernel's dimension {dim} is sharded over {axes}; the "
        f"axes it is gathered over {gathered} (the ones that do not shard "
        f"the {'input' if dim == 0 else 'output'}'s features) must come last"
      )
  k_tp = _drop(k_axes, weight_gather[0])
  n_tp = _drop(n_axes, weight_gather[1])
  if x[-1] != k_tp:
    raise ValueError(
      f"{where}: the input's features are sharded over {_entry(x[-1])} but "
      f"the kernel's in_features over {_entry(k_tp)}; they must match (a "
      "row-parallel layer takes its input sharded on the features like its "
      "kernel; a column-parallel one takes it unsharded on the features)"
    )

  # Token dimensions: gathered over tensor-parallel N axes (sequence
  # parallelism), or data-parallel.
  gather = None
  tokens = []
  for dim, axes in enumerate(x[:-1]):
    on_n = tuple(a for a in axes if a in n_tp)
    rest = _drop(axes, on_n)
    if on_n:
      if axes[len(axes) - len(on_n) :] != on_n:
        raise ValueError(
          f"{where}: input dimension {dim} is sharded over {axes}; the axes "
          f"it shares with the kernel's features {on_n} must come last"
        )
      if gather is not None:
        raise ValueError(
          f"{where}: only one input dimension can be sharded "
          f"over the kernel's feature axes {n_tp}"
        )
      gather = (dim, on_n)
    tokens.append(rest)
  live = lambda axes: tuple(a for a in axes if sizes[a] > 1)
  token_axes = tuple(dict.fromkeys(live(sum(tokens, ()))))
  gathered_axes = weight_gather[0] + weight_gather[1]
  data_axes = _drop(token_axes, k_axes + n_axes)
  fsdp_axes = tuple(a for a in token_axes if a in gathered_axes)
  if data_axes and data_parallel != "psum":
    raise DataParallelError(
      _data_parallel_message(where, data_axes, sizes, kernel_spec)
    )
  if fsdp_axes and data_parallel == "error":
    raise DataParallelError(
      _data_parallel_message(where, fsdp_axes, sizes, kernel_spec, strict=True)
    )
  for dim, gathered in enumerate(weight_gather):
    kinds = {a in token_axes for a in live(gathered)}
    if len(kinds) > 1:
      raise ValueError(
        f"{where}: the kernel's dimension {dim} is gathered over "
        f"{live(gathered)}, of which only some shard the input's tokens "
        f"({_drop(live(gathered), token_axes)} do not): its gradient "
        "cannot be reduce-scattered over them together"
      )
  idle = _drop(live(gathered_axes), token_axes)
  if idle:
    _warn_once(
      (where, idle),
      f"{where}: the kernel is sharded over mesh axis "
      f"{', '.join(map(repr, idle))}, which shards neither the input's "
      "tokens nor a feature dimension: the layer gathers the kernel over it "
      "just in time and every device computes on all tokens and forms the "
      "whole weight gradient. Exact, but it gathers a kernel for no data "
      "parallelism: shard the batch over the axis too (FSDP) or leave the "
      "kernel unsharded over it.",
    )

  # The output: tokens as gathered, features like the kernel's N, partial
  # sums over K all-reduced or reduce-scattered onto one token dimension.
  default_y = tuple(tokens) + (n_tp,)
  scatter = None
  if declared_y is None:
    y = default_y
  else:
    y = declared_y
    for dim, (want, have) in enumerate(zip(y[:-1], default_y[:-1])):
      if want == have:
        continue
      extra = want[len(have) :]
      if (
        want[: len(have)] == have
        and extra
        and scatter is None
        and set(extra) <= set(k_tp)
      ):
        scatter = (dim, extra)
        continue
      raise ValueError(
        f"{where}: output dimension {dim} cannot be sharded over "
        f"{_entry(want)}: it is {_entry(have)} after the layer, and only "
        f"the kernel's in_features axes {_entry(k_tp)} can be added to "
        "one token dimension (a reduce-scatter, sequence parallelism)"
        + (
          ""
          if declared_x
          else "; the input's partitioning is not declared, so its tokens "
          "are taken as unsharded: declare input_partitioning"
        )
      )
    if y[-1] != n_tp:
      raise ValueError(
        f"{where}: the output's features must be sharded like the kernel's "
        f"features ({_entry(n_tp)}), not {_entry(y[-1])}"
      )
  if not declared_x and refuse_undeclared_input:
    unused = [
      a for a in mesh.axis_names if sizes[a] > 1 and a not in k_axes + n_axes
    ]
    if unused:
      raise DataParallelError(
        _undeclared_input_message(where, unused, sizes, undeclared_advice)
      )
  return ShardedLayout(
    mesh=mesh,
    x=x,
    kernel=kernel,
    y=y,
    gather=gather,
    scatter=scatter,
    data_axes=data_axes,
    data_parallel=data_parallel,
    weight_gather=weight_gather,
    token_axes=token_axes,
  )


_WARNED: set = set()


def _warn_once(key, message: str):
  if key in _WARNED:
    return
  _WARNED.add(key)
  warnings.warn(message, ShardingWarning, stacklevel=3)


def _names(axes, sizes) -> str:
  return ", ".join(f"{a!r} (size {sizes[a]})" for a in axes)


def _data_parallel_message(
  where, data_axes, sizes, kernel_spec, strict=False
) -> str:
  if strict:
    return (
      f"{where}: the input's tokens are sharded over mesh axis "
      f"{_names(data_axes, sizes)} and data_parallel='error' refuses data "
      "parallelism. Use data_parallel='auto' for FSDP (the kernel and its "
      "states sharded over the axis, gathered just in time, the weight "
      "gradient reduce-scattered), or keep the batch replicated over it."
    )
  return (
    f"{where}: the input's tokens are sharded over mesh axis "
    f"{_names(data_axes, sizes)}, over which the kernel (partitioning "
    f"{tuple(kernel_spec)}) is replicated. That is data parallelism over a "
    "replicated kernel, which FORGE cannot fuse: the update is applied "
    "inside the backward pass, from the gradient of the tokens a shard "
    "sees, so each replica would apply a different partial update (or, "
    "under shard_map, the replicas' new weights would be summed). Do one "
    "of: shard the kernel over that axis too (FSDP, e.g. kernel_init="
    f"nn.with_partitioning(init, ({data_axes[0]!r}, None)), in NNX "
    "nnx.with_partitioning: the layer "
    "gathers it just in time and reduce-scatters its gradient); shard the "
    "batch only over axes that shard the kernel as tensor / sequence "
    "parallelism; keep the batch replicated over that axis (a mesh axis of "
    "size 1, or no batch axis in the input partitioning); train this layer "
    "as flax's own (nn.Dense, nnx.Linear) + optax; or opt in with the "
    "layer's data_parallel='psum', which all-reduces dW over the data "
    "axes inside the backward pass before the update (it materializes a "
    "float32 dW per shard and keeps W, m and v whole on every replica: the "
    "cost of ordinary data parallelism)."
  )


def _undeclared_input_message(where, unused, sizes, advice=None) -> str:
  first = unused[0]
  advice = advice or (
    "Declare input_partitioning: the batch over it with the kernel sharded "
    f"over it too for FSDP (input_partitioning=({first!r}, None, None), "
    f"kernel_init=nn.with_partitioning(init, ({first!r}, None))), or None "
    "on every dimension if the input is replicated over it."
  )
  return (
    f"{where}: mesh axis {_names(unused, sizes)} shards neither the kernel "
    "nor, as far as the layer knows, its input: input_partitioning is not "
    "declared, and under Auto mesh axes an input's sharding is not known at "
    f"trace time. If the batch is sharded over {first!r}, the layer would "
    "gather it and every device would compute on the whole batch. "
    + advice.format(axis=first)
  )


# ---------------------------------------------------------------------------
# Variables: every leaf that follows the kernel is sharded like the kernel.


def follows_kernel(leaf_shape, kernel_shape) -> bool:
  """Whether a state leaf is sharded like the kernel: kernel-shaped, the
  kernel's int8 block scales ``[K, ceil(N / 64)]``, whose element ``(r, b)``
  scales the kernel's row ``r``, columns ``64 b`` to ``64 b + 63``, or its
  4-bit codes ``[K, 32 ceil(N / 64)]``, 32 a block (so a shard's scales
  and codes are its own when column shards hold whole blocks:
  :func:`check_block_split`)."""
  kernel_shape = tuple(kernel_shape)
  return tuple(leaf_shape) in (
    kernel_shape,
    quantization.block_scale_shape(kernel_shape),
    quantization.pair_codes_shape(kernel_shape),
  )


def variables_specs(variables, kernel_spec: P, stacked: bool = False):
  """PartitionSpecs for a :class:`forge_jax.ForgeVariables`: the kernel's
  for every leaf that follows the kernel, replicated for scalars;
  ``stacked``: each behind a replicated leading layer axis."""
  shape = jnp.shape(variables.kernel)
  layers = (None,) if stacked else ()

  def leaf_spec(leaf):
    if follows_kernel(jnp.shape(leaf)[len(layers) :], shape[len(layers) :]):
      return P(*layers, *kernel_spec)
    if jnp.ndim(leaf) == len(layers):
      return P(*layers)
    raise NotImplementedError(
      f"an optimizer state leaf of shape {jnp.shape(leaf)} (kernel "
      f"{shape}): only kernel-shaped, int8 block-scale "
      f"{quantization.block_scale_shape(shape)}, 4-bit code "
      f"{quantization.pair_codes_shape(shape)} and scalar state leaves can "
      "be sharded"
    )

  return jax.tree.map(leaf_spec, variables)


def check_block_split(where, variables, n_axes: Axes, sizes):
  """Column shards of a kernel with int8 states must hold whole blocks of
  64 columns (a block shares one scale, which one shard must own)."""
  if not quantization.has_quantized(variables.opt_state):
    return
  n = jnp.shape(variables.kernel)[-1]
  shards = math.prod(sizes[a] for a in n_axes)
  block = quantization.BLOCK_SIZE
  if shards > 1 and (n // shards) % block:
    raise ValueError(
      f"{where}: features={n} split over {shards} devices gives "
      f"{n // shards} columns per shard, which must be a multiple of the "
      f"int8 block size {block} (int8 optimizer states share one scale per "
      f"{block} columns of a row, and a block cannot straddle shards; the "
      f"kernel's features are sharded over mesh axes {n_axes}). Make "
      f"features a multiple of {block * shards}, shard this layer on its "
      "in_features instead (row-parallel, or FSDP over in_features), or use "
      "state_dtype='bfloat16'."
    )


def check_placed_block_split(where, variables):
  """:func:`check_block_split` for a kernel already placed on a mesh (its
  ``NamedSharding`` says which axes split its columns); nothing for a
  traced or unplaced kernel."""
  kernel = variables.kernel
  sharding = getattr(kernel, "sharding", None)
  if isinstance(kernel, jax.core.Tracer) or not isinstance(
    sharding, NamedSharding
  ):
    return
  spec = tuple(sharding.spec)
  columns = _axes(spec[1]) if len(spec) > 1 else ()
  check_block_split(where, variables, columns, dict(sharding.mesh.shape))


def _check_divisible(where, name, shape, dims, sizes):
  for d, (n, axes) in enumerate(zip(shape, dims)):
    parts = math.prod(sizes[a] for a in axes)
    if n % parts:
      raise ValueError(
        f"{where}: {name} dimension {d} of size {n} is sharded "
        f"over {axes} ({parts} shards) and must divide evenly"
      )


# ---------------------------------------------------------------------------
# Running a layer per shard: checks, placement, shard_map.


def check_layout(
  x: jax.Array,
  variables,
  layout: ShardedLayout,
  where: str = "forge_dense",
  stacked: bool = False,
):
  """Raise unless ``x`` and ``variables`` (a ``ForgeVariables``; ``stacked``:
  on a leading layer axis) can run per shard as ``layout`` says."""
  sizes = _mesh_sizes(layout.mesh)
  manual = _manual_axes()
  if manual:
    raise NotImplementedError(
      f"{where}: a partitioned ForgeDense inside shard_map (manual axes "
      f"{manual}) is not supported: ForgeDense runs its own shard_map; call "
      "it from jit over the whole mesh"
    )
  if jnp.ndim(x) != len(layout.x):
    raise ValueError(
      f"{where}: the input has rank {jnp.ndim(x)} but its "
      f"layout {layout.x} rank {len(layout.x)}"
    )
  _check_divisible(where, "input", jnp.shape(x), layout.x, sizes)
  _check_divisible(
    where, "kernel", jnp.shape(variables.kernel)[-2:], layout.kernel, sizes
  )
  check_block_split(where, variables, layout.kernel[1], sizes)
  # Raises on leaves that cannot be sharded like the kernel.
  variables_specs(variables, layout.kernel_spec(), stacked=stacked)


def to_layout(
  x: jax.Array,
  variables,
  bias: Optional[jax.Array],
  layout: ShardedLayout,
  stacked: bool = False,
):
  """``(x, variables, bias)`` resharded as ``layout`` says on a mesh with
  Explicit axes (where the sharding is in the types); as they are
  otherwise."""
  if not is_explicit(layout.mesh):
    return x, variables, bias
  x_s, v_s, b_s, _ = operand_specs(layout, variables, bias, stacked)
  x = _reshard(x, layout.mesh, x_s)
  if stacked:
    # The stacks are stepped in place from the ones the op reads: a copy
    # laid out for it would be stepped instead, and fj.scan's backward
    # would drop the updates of the layers after this one.
    for leaf, spec in zip(jax.tree.leaves(variables), jax.tree.leaves(v_s)):
      if not _laid_out(leaf, layout.mesh, spec):
        raise ValueError(
          f"a stack of FORGE variables of type {jax.typeof(leaf)} on an "
          f"Explicit mesh, where the layer reads it as {spec}: lay the "
          "stacks out as the kernel's partitioning says, behind an "
          "unsharded layer axis (parallel.init_sharded does, with "
          "metadata_params={nn.PARTITION_NAME: None} in fj.scan)"
        )
  variables = jax.tree.map(
    lambda v, s: _reshard(v, layout.mesh, s), variables, v_s
  )
  if bias is not None:
    bias = _reshard(bias, layout.mesh, b_s)
  return x, variables, bias


def mesh_is_set() -> bool:
  """Whether a mesh is in context: ``jax.set_mesh``'s, or the deprecated
  ``with mesh:``'s (under which flax still unboxes partitioned variables
  with a sharding constraint)."""
  legacy = getattr(getattr(mesh_lib, "thread_resources", None), "env", None)
  legacy = getattr(legacy, "physical_mesh", None)
  return not jax.sharding.get_abstract_mesh().empty or not (
    legacy is None or legacy.empty
  )


def is_explicit(mesh) -> bool:
  """Whether any axis of ``mesh`` is Explicit (sharding in types)."""
  return any(t == AxisType.Explicit for t in mesh.axis_types)


def _laid_out(value, mesh, spec) -> bool:
  """Whether ``value``'s type already says ``spec`` on ``mesh``."""
  sharding = getattr(jax.typeof(value), "sharding", None)
  spec_of = getattr(sharding, "spec", None)
  if spec_of is None or getattr(sharding, "mesh", None) is None:
    return False
  ndim = jnp.ndim(value)
  pad = lambda s: (
    tuple(_axes(e) for e in tuple(s)) + ((),) * (ndim - len(tuple(s)))
  )
  return sharding.mesh.axis_names == mesh.axis_names and pad(spec_of) == pad(
    spec
  )


def _reshard(value, mesh, spec):
  """``value`` with ``spec`` on ``mesh``: itself where its type says so."""
  if _laid_out(value, mesh, spec):
    return value
  return jax.sharding.reshard(value, NamedSharding(mesh, spec))


def _manual_axes() -> tuple:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  return tuple(mesh.manual_axes)


def operand_specs(layout: ShardedLayout, variables, bias, stacked: bool):
  """In-specs of x, variables, bias and the layer index (replicated)."""
  x = _spec(layout.x)
  v = variables_specs(variables, layout.kernel_spec(), stacked)
  b = None if bias is None else layout.bias_spec()
  return x, v, b, P()


def per_shard(fn, layout: ShardedLayout, in_specs, out_specs):
  """``fn`` run on each shard of ``layout.mesh`` (``jax.shard_map``). ``fn``
  writes its collectives out; ``check_vma=False``: JAX neither checks nor
  adds any."""
  return jax.shard_map(
    fn,
    mesh=layout.mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    check_vma=False,
  )


# ---------------------------------------------------------------------------
# The guard for the unpartitioned op inside a user's shard_map.


def _varying(value) -> Optional[frozenset]:
  """The manual mesh axes ``value`` varies over (None: not known)."""
  aval = jax.typeof(value)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  vma = getattr(aval, "vma", None)
  return None if vma is None else frozenset(vma)


def _explicit_mesh_of(x):
  """The mesh in ``x``'s type if it has Explicit axes, else None."""
  mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  return mesh if mesh is not None and is_explicit(mesh) else None


_DATA_PARALLEL_ADVICE = (
  "for data parallelism, flax's own layer + optax, or, under jit with "
  "input_partitioning declared (not inside shard_map), the layer's "
  "data_parallel='psum'."
)


def _varying_fields(variables, axis) -> tuple:
  """The names of the layer's variables that vary over manual ``axis``."""
  return tuple(
    name
    for name, value in zip(variables._fields, variables)
    if any(axis in (_varying(leaf) or ()) for leaf in jax.tree.leaves(value))
  )


def _varying_variables_message(where, axis, size, varying) -> str:
  return (
    f"{where}: called inside shard_map (or jax.pmap, which runs as one) "
    f"over mesh axis {axis!r} (size {size}), and the layer's "
    f"{', '.join(varying)} vary over it. FORGE's cotangent of a variable is "
    "its updated value, and the op cannot tell a per-device shard from a "
    "copy made in the step: a kernel all-gathered over the axis (FSDP "
    "written out) would receive the sum of the replicas' new kernels from "
    "all_gather's transpose, and a variable cast to varying the sum of "
    "their new values from the cast's. Pass the layer's variables "
    "replicated over the axis (in_specs P(), not cast) with an input "
    "replicated over it, or use a partitioned layer under jit for tensor "
    "parallelism and FSDP (kernel_init=nn.with_partitioning(...) or "
    "nnx.with_partitioning, see forge_jax.parallel); " + _DATA_PARALLEL_ADVICE
  )


def check_unpartitioned(x: jax.Array, variables, where: str = "forge_dense"):
  """Refuse data parallelism that the unpartitioned op would get wrong.

  * Inside a ``shard_map`` the op runs only where its input and variables
    are replicated over every manual axis. An input that varies over one
    gets a partial ``dW`` while the shard_map's transpose sums the
    replicated kernel's cotangent over the axis: every replica's *new*
    kernel would be added together. Variables that vary are refused too:
    the type of a per-device kernel shard is the type of a kernel gathered
    in the step (FSDP written out with ``all_gather``, whose transpose sums
    the replicas' new kernels), and a scalar cast to varying (``count``)
    has the cast's transpose sum the replicas' new values. When JAX does
    not track varying axes (``check_vma=False``) nothing is known and the
    call is refused.
  * Under Explicit mesh axes the input's type says how its tokens are
    sharded; tokens sharded over an axis the kernel is not sharded over are
    data parallelism. The input's type carries its Explicit mesh also
    without ``jax.set_mesh`` (an array put on a ``jax.make_mesh`` mesh).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = _explicit_mesh_of(x) or mesh
  if mesh.empty:
    return
  sizes = _mesh_sizes(mesh)
  # Axes of size 1 too: the step must be right on the devices it is meant
  # for, and check_vma would refuse it there with a type error of its own.
  for axis in mesh.manual_axes:
    x_vary = _varying(x)
    tracked = x_vary is not None and axis in (
      _varying(lax.axis_index(axis)) or frozenset()
    )
    if tracked:
      varying = _varying_fields(variables, axis)
      if varying:
        raise DataParallelError(
          _varying_variables_message(where, axis, sizes[axis], varying)
        )
      if axis not in x_vary:
        continue  # all replicated: every device does the same
    reason = (
      "varies over it while the kernel is replicated"
      if tracked
      else "may vary over it (shard_map(check_vma=False) does not say) and "
      "the kernel may be replicated"
    )
    raise DataParallelError(
      f"{where}: called inside shard_map (or jax.pmap, which runs as one) "
      f"over mesh axis {axis!r} (size "
      f"{sizes[axis]}), and the input {reason}. shard_map's transpose sums "
      "a replicated input's cotangent over the axis, and FORGE's cotangent "
      "is the updated kernel: the replicas' new weights would be added "
      "together. Use a partitioned layer under jit instead "
      "(kernel_init=nn.with_partitioning(...) or nnx.with_partitioning, see "
      f"forge_jax.parallel); {_DATA_PARALLEL_ADVICE}"
    )
  auto = [
    a
    for a, t in zip(mesh.axis_names, mesh.axis_types)
    if t == AxisType.Auto and sizes[a] > 1 and a not in mesh.manual_axes
  ]
  if auto and not _INIT_FOR_EXPLICIT.get():
    raise DataParallelError(
      f"{where}: called without a partitioning under jax.set_mesh with Auto "
      f"mesh axis {_names(auto, sizes)}. Under Auto axes the input's "
      "sharding is not known at trace time: if the batch is sharded over "
      "the axis, the layer's kernel would be replicated on every device "
      "(data parallelism FORGE cannot fuse) and the fused kernel's "
      "operands gathered. Give the layer its partitioning: "
      "kernel_init=nn.with_partitioning(init, (...)) (ForgeEmbed: "
      "embedding_init) and input_partitioning (the batch over the axis "
      "with the kernel sharded over it too is FSDP), or "
      "input_partitioning=(None, ...) if the input is replicated over the "
      "axis (ForgeEmbed has none: its table sharded over every such axis)."
    )
  explicit = [
    a
    for a, t in zip(mesh.axis_names, mesh.axis_types)
    if t == AxisType.Explicit and sizes[a] > 1
  ]
  if explicit:
    x_spec = getattr(jax.typeof(x).sharding, "spec", None)
    k_spec = getattr(jax.typeof(variables.kernel).sharding, "spec", None)
    if x_spec is None or k_spec is None:
      return
    kernel_axes = {a for e in tuple(k_spec) for a in _axes(e)}
    token_axes = {a for e in tuple(x_spec)[:-1] for a in _axes(e)}
    bad = tuple(a for a in explicit if a in token_axes - kernel_axes)
    if bad:
      raise DataParallelError(
        _data_parallel_message(where, bad, sizes, tuple(k_spec))
        + " Under Explicit mesh axes, "
        "give the layer its partitioning (kernel_init="
        "nn.with_partitioning(...) or nnx.with_partitioning) so that it "
        "runs per shard."
      )


# ---------------------------------------------------------------------------
# Variables of a partitioned model.


def _is_box(value) -> bool:
  return isinstance(value, nn.Partitioned)


def partition_specs(variables, rules=None):
  """Mesh PartitionSpecs of a (boxed) variables tree, e.g. ``jax.eval_shape``
  of ``model.init``.

  ``nn.Partitioned`` leaves give their names; ``nn.LogicallyPartitioned``
  ones their names resolved with their own rules (else ``rules``, else the
  ``nn.logical_axis_rules`` context); unboxed leaves are replicated. For a
  ForgeDense that is the kernel's spec on the kernel and on every optimizer
  state leaf that follows it (kernel-shaped, int8 block scales), and ``P()``
  on the scalars.
  """

  def spec(leaf):
    if isinstance(leaf, nn.LogicallyPartitioned):
      return nn.logical_to_mesh_axes(
        leaf.names, leaf.rules if leaf.rules is not None else rules
      )
    if _is_box(leaf):
      return leaf.get_partition_spec()
    return P()

  return jax.tree.map(spec, variables, is_leaf=_is_box)


def strip_boxes(variables):
  """The values of a boxed variables tree (no sharding constraint applied)."""
  return jax.tree.map(
    lambda v: v.value if _is_box(v) else v, variables, is_leaf=_is_box
  )


# True while init_sharded initializes for an Explicit mesh on its Auto copy:
# the layers' inputs are checked against their types when applied there.
_INIT_FOR_EXPLICIT = contextvars.ContextVar("init_for_explicit", default=False)


def _rules_in_context(rules):
  """``nn.logical_axis_rules(rules)``, or the caller's rules for None."""
  return (
    contextlib.nullcontext() if rules is None else nn.logical_axis_rules(rules)
  )


def init_sharded(init_fn, mesh, *args, rules=None):
  """``init_fn(*args)`` (e.g. ``model.init``) jitted under ``mesh`` with every
  variable created directly in its sharding; returns unboxed arrays.

  Equivalent to Flax's recipe: ``jax.eval_shape``, the partition specs of
  the boxes, ``jax.jit(init_fn, out_shardings=...)``. On a mesh with
  Explicit axes (where Flax's boxes cannot constrain freshly initialized
  values) init runs on the same devices with Auto axes and the results are
  given the explicit mesh's shardings (no data moves). An unpartitioned
  layer, which the Auto copy alone would refuse, initializes there: it is
  checked against its input's type when applied on the explicit mesh.

  ``rules``: a logical axis rules table for ``nn.with_logical_partitioning``
  names, in effect while init runs; apply the model under the same
  ``nn.logical_axis_rules`` (a partitioned layer whose logical names no
  rules resolve under a mesh raises).
  """
  init_mesh = mesh
  if is_explicit(mesh):
    init_mesh = Mesh(
      mesh.devices,
      mesh.axis_names,
      axis_types=(AxisType.Auto,) * len(mesh.axis_names),
    )
  token = _INIT_FOR_EXPLICIT.set(init_mesh is not mesh)
  try:
    with jax.set_mesh(init_mesh), _rules_in_context(rules):
      abstract = jax.eval_shape(init_fn, *args)
      specs = partition_specs(abstract, rules)
      shardings = jax.tree.map(
        lambda s: NamedSharding(init_mesh, s),
        specs,
        is_leaf=lambda s: isinstance(s, P),
      )
      variables = strip_boxes(jax.jit(init_fn, out_shardings=shardings)(*args))
  finally:
    _INIT_FOR_EXPLICIT.reset(token)
  if init_mesh is not mesh:
    variables = jax.tree.map(
      lambda v, s: jax.device_put(v, NamedSharding(mesh, s)),
      variables,
      specs,
      is_leaf=lambda s: isinstance(s, P),
    )
  return variables
