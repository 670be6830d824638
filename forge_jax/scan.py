"""``fj.scan``: ``nn.scan`` over layers, with FORGE's in-place backward pass.

``nn.scan`` over layers that hold ForgeDense variables trains correctly, but
its transpose builds *new* stacked buffers for every cotangent, so the
updated kernels and states of all layers exist beside the old ones until the
step ends: more memory than optax. :func:`scan` takes ``nn.scan``'s
arguments and keeps its variable layout (every collection stacked on a
leading layer axis), and replaces the backward pass with a reverse loop over
``l = L-1 .. 0`` that runs layer ``l``'s pullback.

FORGE's collection is *not* sliced: every ForgeDense of the layer receives
its whole stacks (kernel, optimizer state, and the ``[L]`` count, skipped
and intact) and the index ``l`` (:func:`forge_jax.layer_context.stacking`),
reads the layer's kernel at ``l`` and steps entry ``l`` of its stacks. The
cotangent of each stack is then the updated stack itself, carried to the
next iteration. A slice would not do: an update that is a custom call (the
Pallas kernel) cannot alias into a slice of a stack, so ``dynamic_slice ->
update -> dynamic_update_slice`` makes XLA copy the layer's kernels and
states. The other collections (norm scales, biases) are sliced, and their
gradients written into stacked gradients with ``dynamic_update_slice``.

The forward runs each layer the way the backward will (stacked mode) under
``jax.vjp`` and keeps the pullback: its leaves are the residuals. With a
block wrapped in ``nn.remat(Block, policy=...)`` they are what the policy
saves (the layer's input alone by default). Leaves that are the layer's own
variables or the broadcast arguments are not saved per layer (the
backward puts its own there; for FORGE's collection: the stacks as stepped
so far). The other leaves are scan outputs, stacked per layer.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict
from jax import lax

from forge_jax import layer_context, parallel
from forge_jax.linen import (
  FACTORS_COLLECTION,
  FORGE_COLLECTION,
  ForgeMemoryWarning,
)
from forge_jax.ops import fused_dense


def scan(
  target: type[nn.Module],
  variable_axes: Mapping[Any, int] = FrozenDict(),
  variable_broadcast: Any = False,
  variable_carry: Any = False,
  split_rngs: Mapping[Any, bool] = FrozenDict(),
  in_axes: Any = 0,
  out_axes: Any = 0,
  length: int | None = None,
  reverse: bool = False,
  unroll: int = 1,
  data_transform: Callable | None = None,
  metadata_params: Mapping[Any, Any] | None = None,
  methods: Any = None,
) -> type[nn.Module]:
  """``nn.scan`` over layers whose ForgeDense variables update in place.

  Replace ``nn.scan`` with ``fj.scan`` and keep the arguments::

    Stack = fj.scan(nn.remat(Block, prevent_cse=False),
                    variable_axes={True: 0}, split_rngs={'params': True,
                    'dropout': True}, in_axes=(nn.broadcast,), length=16)

  The variables have exactly ``nn.scan``'s layout, so checkpoints move
  between the two. A ``variable_axes`` that names ``'params'`` (and not
  ``True``) stacks FORGE's collections with it.
  ``target(...)(carry, *args)`` must return ``(carry, None)``; every extra
  argument is broadcast (``nn.broadcast``) to all layers, and its gradient
  is summed over them. Rng streams are
  split per layer or broadcast as ``split_rngs`` says (the layers draw from
  the same streams as under ``nn.scan``, though not the same bits). A block
  wrapped in ``nn.remat`` saves, per layer, what its policy saves; an
  unwrapped block saves every residual, as ``nn.scan`` would.

  While a collection other than ``params`` and FORGE's (and exact
  clipping's factor sinks, sliced per layer like every other collection)
  is mutable (a decode cache, ``sow``'s intermediates: named in
  ``mutable`` though the variables do not hold them yet, or
  ``mutable=True``), the call runs as ``nn.scan`` itself: correct, without
  the in-place backward (a ``ForgeMemoryWarning`` says so where FORGE's
  variables are differentiated; a decode loop has no backward).

  Raises:
    ValueError: for an argument of ``nn.scan`` that fj.scan cannot honor
      (``variable_broadcast``, ``variable_carry``, ``reverse``,
      ``data_transform``, ``methods``, a per-layer ``in_axes``, an axis
      other than 0, no ``length``), naming it.
  """
  _check_arguments(
    variable_axes,
    variable_broadcast,
    variable_carry,
    reverse,
    data_transform,
    methods,
    length,
    out_axes,
  )
  scanned = nn.scan(
    target,
    variable_axes=_with_forge_collections(variable_axes),
    split_rngs=split_rngs,
    in_axes=in_axes,
    out_axes=out_axes,
    length=length,
    unroll=unroll,
    metadata_params=dict(metadata_params or {}),
  )
  rng_splits = dict(split_rngs)

  class ForgeScan(scanned):  # pylint: disable=missing-class-docstring
    # Unwrapped: flax would run the block's setup() here, at the stack's
    # scope, where a parameter it declares (unstacked) meets its stack.
    @nn.nowrap
    def __call__(self, carry, *args):
      _check_in_axes(in_axes, len(args))
      mutable = _mutable_others(self)
      if self.is_initializing() or mutable:
        if (
          mutable
          and not self.is_initializing()
          and _stacks_differentiated(self.variables.get(FORGE_COLLECTION, {}))
        ):
          warnings.warn(
            f"fj.scan {'/'.join(self.path)!r} runs as nn.scan while "
            f"{mutable} is mutable: correct, without FORGE's in-place "
            "backward.",
            ForgeMemoryWarning,
            stacklevel=2,
          )
        # nn.scan's layers have their whole paths: no prefix.
        with layer_context.stacking(None, length, ()):
          return super().__call__(carry, *args)
      context = layer_context.stacked_layer()
      if context is not None and context.index is not None:
        raise NotImplementedError(
          f"fj.scan({target.__name__}) inside the block of another "
          "fj.scan: the outer backward hands its ForgeDense variables over "
          "as whole stacks"
        )
      _check_layer_axis_unsharded(metadata_params, target.__name__)
      fields = {
        f.name: getattr(self, f.name)
        for f in dataclasses.fields(target)
        if f.init and f.name not in ("parent", "name")
      }
      layer = target(**fields, parent=None)
      rngs = self._layer_rngs(rng_splits)
      out = _scan_apply(
        layer,
        length,
        carry,
        dict(self.variables),
        rngs,
        tuple(args),
        tuple(self.path),
        unroll,
      )
      return out, None

    @nn.nowrap
    def _layer_rngs(self, splits):
      """``(per-layer keys [L], broadcast keys)`` of the rng streams given."""
      split, broadcast = {}, {}
      for name in sorted(getattr(self.scope, "rngs", {})):
        if name == "params":
          continue
        how = splits.get(name, splits.get(True))
        if how is None:
          continue
        key = self.make_rng(name)
        if how:
          split[name] = jax.random.split(key, length)
        else:
          broadcast[name] = key
      return split, broadcast

  ForgeScan.__name__ = f"ForgeScan{target.__name__}"
  return ForgeScan


def _with_forge_collections(variable_axes) -> dict:
  """``variable_axes`` with FORGE's collections stacked as ``'params'`` is,
  where it names ``'params'`` and not every collection (``True``)."""
  axes = dict(variable_axes)
  if True not in axes and "params" in axes:
    for name in (FORGE_COLLECTION, FACTORS_COLLECTION):
      axes.setdefault(name, axes["params"])
  return axes


def _check_arguments(
  variable_axes,
  variable_broadcast,
  variable_carry,
  reverse,
  data_transform,
  methods,
  length,
  out_axes,
):
  refused = {
    "variable_broadcast": variable_broadcast,
    "variable_carry": variable_carry,
    "reverse": reverse,
    "data_transform": data_transform,
    "methods": methods,
  }
  for name, value in refused.items():
    if value not in (False, None):
      raise ValueError(
        f"fj.scan({name}={value!r}) is not supported: fj.scan stacks every "
        "collection on a leading layer axis and steps the layers from the "
        f"last to the first. Use nn.scan for a {name}."
      )
  if not isinstance(length, int) or length < 1:
    raise ValueError(
      f"fj.scan(length={length!r}) must be the number of "
      "layers (a positive int)"
    )
  if any(axis != 0 for axis in dict(variable_axes).values()):
    raise ValueError(
      f"fj.scan(variable_axes={dict(variable_axes)!r}): "
      "every collection must be stacked on axis 0"
    )
  if out_axes != 0:
    raise ValueError(
      f"fj.scan(out_axes={out_axes!r}) is not supported: the "
      "block returns (carry, None)"
    )


def _check_in_axes(in_axes, num_args):
  axes = (
    in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * num_args
  )
  if len(axes) != num_args or any(a is not nn.broadcast for a in axes):
    raise ValueError(
      f"fj.scan(in_axes={in_axes!r}) with {num_args} argument(s) after "
      "the carry: every argument must be nn.broadcast (the same value for "
      "every layer). Per-layer inputs are not supported: stack them in a "
      "variable collection, or use nn.scan."
    )


def _check_layer_axis_unsharded(metadata_params, name: str):
  """Refuse stacks whose layer axis is sharded over a mesh axis.

  Every layer reads and steps its entry of the whole stacks, laid out as
  its kernel's partitioning says behind the layer axis: a layer axis
  sharded over a mesh axis would all-gather every stack, optimizer states
  included, in each layer's forward and backward. The partition name is
  read as a mesh axis and through the ``nn.logical_axis_rules`` in effect.
  """
  mesh = jax.sharding.get_abstract_mesh()
  layer_name = (metadata_params or {}).get(nn.PARTITION_NAME)
  if mesh.empty or layer_name is None:
    return
  names = (layer_name,) if isinstance(layer_name, str) else tuple(layer_name)
  if nn.get_logical_axis_rules():
    resolved = nn.logical_to_mesh_axes((layer_name,))[0]
    names += (resolved,) if isinstance(resolved, str) else tuple(resolved or ())
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  sharded = tuple(a for a in dict.fromkeys(names) if sizes.get(a, 1) > 1)
  if sharded:
    raise ValueError(
      f"fj.scan({name}) with metadata_params={{nn.PARTITION_NAME: "
      f"{layer_name!r}}} shards the stacks' layer axis over mesh axis "
      f"{', '.join(map(repr, sharded))}: each layer reads and steps its "
      "entry of the whole stacks, so every stack, optimizer states "
      "included, would be all-gathered in each layer's forward and "
      "backward. Leave the layer axis unsharded "
      "(metadata_params={nn.PARTITION_NAME: None}, or a logical name the "
      "rules map to None) and shard the layers' kernels instead."
    )


def _stacks_differentiated(stacks) -> bool:
  """Whether FORGE's ``stacks`` are being differentiated: only then does
  running as ``nn.scan`` cost memory (a decode loop has no backward)."""
  return any(
    layer_context.is_differentiated(leaf) for leaf in jax.tree.leaves(stacks)
  )


def _split_forge(variables):
  """``(FORGE's stacks, the other collections)``."""
  forge = variables.get(FORGE_COLLECTION, {})
  return forge, {k: v for k, v in variables.items() if k != FORGE_COLLECTION}


class _PullbackLayout(NamedTuple):
  """How to rebuild one layer's pullback (``jax.vjp``'s function, a pytree)
  in the backward loop; static, recorded while the forward traces.

  ``sources[i]`` says where leaf ``i`` of the pullback comes from: an
  ``int``, the leaf of ``(others[l], forge stacks, broadcast args)`` it is (the backward passes its own: the stacks with layers > l
  stepped), or None: a value saved per layer (stacked on the layer axis).
  """

  treedef: Any
  sources: tuple


#: Collections fj.scan's in-place call handles itself.
_OWN_COLLECTIONS = ("params", FORGE_COLLECTION, FACTORS_COLLECTION)

#: A collection name no module uses: mutable only where every collection
#: not named otherwise is (``mutable=True``, a deny list).
_ANY_OTHER = "<any other collection>"


def _mutable_others(module: nn.Module) -> list:
  """The collections other than :data:`_OWN_COLLECTIONS` that ``module``'s
  apply may write: those it holds or ``mutable`` names (a block's ``sow``
  creates its collection as it writes it), or every other collection."""
  names = set(module.variables)
  named = module.scope.mutable
  if isinstance(named, str):
    names.add(named)
  elif isinstance(named, (list, tuple, set, frozenset)):
    names.update(c for c in named if isinstance(c, str))
  names.add(_ANY_OTHER)
  return sorted(
    c
    for c in names
    if c not in _OWN_COLLECTIONS and module.is_mutable_collection(c)
  )


def _checked_unshared(forge, d_out, path):
  """``d_out``, its float leaves passed through
  :func:`forge_jax.ops.fused_dense.check_unshared` against the stacks."""
  stacks = jax.tree.leaves(forge)
  if not stacks:
    # A block without FORGE layers: no kernel to share.
    return d_out
  leaves, treedef = jax.tree.flatten(d_out)
  floats = [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]
  checked = fused_dense.check_unshared(
    stacks[0], [leaves[i] for i in floats], path
  )
  for i, leaf in zip(floats, checked):
    leaves[i] = leaf
  return jax.tree.unflatten(treedef, leaves)


def _differentiable(value) -> bool:
  """Whether ``value`` has a cotangent of its own dtype (not float0)."""
  return jnp.issubdtype(jnp.result_type(value), jnp.inexact)


def _zero_cotangent(value):
  """A zero cotangent for ``value`` (float0 for integer and key arrays)."""
  if _differentiable(value):
    return jnp.zeros_like(value)
  return np.zeros(jnp.shape(value), jax.dtypes.float0)


def _scan_apply(
  layer: nn.Module,
  length: int,
  carry,
  variables,
  rngs,
  broadcast_args,
  path: tuple,
  unroll: int,
):
  """``carry`` through ``length`` layers; a custom_vjp over the stacks."""
  split_rngs, broadcast_rngs = rngs
  # Keys travel as their raw data: integers, which custom_vjp and jax.vjp
  # give float0 cotangents.
  impls = {name: jax.random.key_impl(keys) for name, keys in split_rngs.items()}
  split_data = {
    name: jax.random.key_data(keys) for name, keys in split_rngs.items()
  }

  def layer_fn(others, forge, x, key_data, args):
    keys = {
      name: jax.random.wrap_key_data(data, impl=impls[name])
      for name, data in key_data.items()
    }
    layer_variables = {**others, FORGE_COLLECTION: forge} if forge else others
    out, per_layer = layer.apply(
      layer_variables, x, *args, rngs={**broadcast_rngs, **keys}
    )
    if per_layer is not None:
      raise ValueError(
        f"fj.scan's block returned (carry, {type(per_layer).__name__}): it "
        "must return (carry, None); per-layer outputs are not supported"
      )
    return out

  forge, others = _split_forge(variables)
  return scan_stacks(
    layer_fn,
    length,
    carry,
    forge,
    others,
    split_data,
    broadcast_args,
    path,
    unroll,
  )


def scan_stacks(
  layer_fn: Callable,
  length: int,
  carry,
  forge,
  others,
  per_layer,
  broadcast_args,
  path: tuple = (),
  unroll: int = 1,
):
  """``carry`` through ``length`` layers, FORGE's stacks stepped in place.

  The custom_vjp of :func:`scan` (and of ``fj.nnx.scan``), independent of
  the module system: ``layer_fn(others_l, forge, x, per_layer_l, args)``
  runs layer ``l`` on the carry ``x``. ``others`` (differentiable, stacked
  on a leading layer axis) and ``per_layer`` (not differentiated: rng key
  data, integer state) are sliced per layer; ``forge``, FORGE's stacks, is
  handed over whole, and the forge layers inside step entry ``l`` of it
  (:func:`forge_jax.layer_context.stacking`). The cotangent of ``forge`` is
  the stepped stacks; those of ``others`` and ``broadcast_args`` are their
  gradients (summed over the layers for the broadcast arguments).
  """
  layout = []  # one _PullbackLayout, set when the forward's scan body traces
  take = lambda index: (
    lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False)
  )

  def plain_run(carry, forge, others, per_layer, args):
    def body(x, xs):
      layer_forge, layer_others, layer_per_layer = xs
      return layer_fn(layer_others, layer_forge, x, layer_per_layer, args), None

    with layer_context.stacking(None, length, path):
      out, _ = lax.scan(
        body, carry, (forge, others, per_layer), length=length, unroll=unroll
      )
    return out

  def run_fwd(carry, forge, others, per_layer, args):
    def body(x, xs):
      index, layer_others, layer_per_layer = xs
      layer_vjp_fn = lambda others, forge, x, args: layer_fn(
        others, forge, x, layer_per_layer, args
      )
      with layer_context.stacking(index, length, path):
        out, pullback = jax.vjp(layer_vjp_fn, layer_others, forge, x, args)
      leaves, treedef = jax.tree.flatten(pullback)
      at_hand = {
        id(leaf): i
        for i, leaf in enumerate(jax.tree.leaves((layer_others, forge, args)))
      }
      sources = tuple(at_hand.get(id(leaf)) for leaf in leaves)
      layout[:] = [_PullbackLayout(treedef, sources)]
      return out, [
        leaf for leaf, source in zip(leaves, sources) if source is None
      ]

    out, saved = lax.scan(
      body,
      carry,
      (jnp.arange(length), others, per_layer),
      length=length,
      unroll=unroll,
    )
    return out, (forge, others, saved, per_layer, args)

  def run_bwd(residuals, d_out):
    forge, others, saved, per_layer, args = residuals
    # Checked here, not only per layer: under jax.vmap the loop below maps
    # its carried stacks once a layer's update is mapped.
    d_out = _checked_unshared(forge, d_out, path)
    ((treedef, sources),) = layout

    def body(i, loop_carry):
      d_x, forge_stack, others_grad, args_grad = loop_carry
      index = length - 1 - i
      at = take(index)
      at_hand = jax.tree.leaves((jax.tree.map(at, others), forge_stack, args))
      saved_leaves = iter(saved)
      leaves = [
        at(next(saved_leaves)) if source is None else at_hand[source]
        for source in sources
      ]
      with layer_context.stacking(index, length, path):
        d_others, forge_stack, d_x, d_args = jax.tree.unflatten(
          treedef, leaves
        )(d_x)
      put = lambda stack, value: lax.dynamic_update_index_in_dim(
        stack, value, index, 0
      )
      others_grad = jax.tree.map(put, others_grad, d_others)
      args_grad = jax.tree.map(
        lambda total, d: (
          total + d if total.dtype != jax.dtypes.float0 else total
        ),
        args_grad,
        d_args,
      )
      return d_x, forge_stack, others_grad, args_grad

    d_carry, new_forge, others_grad, args_grad = lax.fori_loop(
      0,
      length,
      body,
      (
        d_out,
        forge,
        jax.tree.map(jnp.zeros_like, others),
        jax.tree.map(_zero_cotangent, args),
      ),
      unroll=unroll,
    )
    if not parallel.mesh_is_set():  # as for one layer's
      layer_context.record_written_stacks(new_forge)
    return (
      d_carry,
      new_forge,
      others_grad,
      jax.tree.map(_zero_cotangent, per_layer),
      args_grad,
    )

  if layer_context.differentiates_plainly():
    # Autodiff of the plain scan: each layer's entries sliced out, ordinary
    # gradients for every input, the stacks' included.
    return plain_run(carry, forge, others, per_layer, broadcast_args)
  run = jax.custom_vjp(plain_run)
  run.defvjp(run_fwd, run_bwd)
  return run(carry, forge, others, per_layer, broadcast_args)
