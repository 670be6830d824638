"""Save and restore a training state (FORGE variables included), bit for bit.

A FORGE training state keeps everything in ``TrainState.params``: kernels
(bfloat16 or float32), optimizer states (float leaves, or int8 codes in their
``float8_e4m3fnuz`` container plus float32 block scales), and each layer's
``count``, which seeds stochastic rounding. A checkpoint must bring all of it
back with the same dtypes and bits, or training does not resume where it
stopped (a quantized state silently cast to bf16 on reload would also no
longer match the optimizer's structure).

    from forge_jax import checkpoint
    checkpoint.save("/tmp/run/step_100", state)
    state = checkpoint.restore("/tmp/run/step_100", abstract_state)

``abstract_state`` is a state of the same structure (e.g. a freshly
initialized one, or ``jax.eval_shape`` of the function that creates it); its
static fields (``apply_fn``, ``tx``) are kept, its arrays only give shapes,
dtypes and shardings: a fresh state on another mesh restores onto that
mesh, and a leaf not sharded over the mesh of the others (a step counter)
is restored replicated on it; a fresh state on one device restores onto
that device, its step counter too. ``jax.eval_shape`` gives no shardings:
its leaves restore as they were saved. Restoring checks every leaf's dtype
and shape against it, and that the checkpoint holds no leaf it lacks (nor
another empty state: an optax chain's stateless links tell ``adam``'s
state from ``adamw``'s), and raises instead of casting or dropping. A
checkpoint without the gradient-norm leaves (each layer's
``grad_sq_norm`` and ``fj.TrainState.grad_norm``: what the last step
measured, not what the next one needs) restores them as
zeros, and a saved ``grad_norm`` restores into a state that tracks none
(``track_grad_norm=False``) by being left out; any other leaf missing
or left over raises. A checkpoint also records the layout
of 4-bit codes (:data:`FOURBIT_LAYOUT`), and a state with 4-bit second
moments restores only from a checkpoint of that layout: codes of another
pairing have the same shape and dtype but other levels (one written by
plain orbax records none; the refusal names the record to write). Uses
orbax (``pip
install forge_jax[checkpoint]``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from forge_jax import quantization
from forge_jax.train_state import key_name

#: How 4-bit codes pair their levels (:class:`forge_jax.quantization.
#: QuantizedSqrt4Blocks`), written beside every checkpoint in
#: :data:`LAYOUT_FILE`.
FOURBIT_LAYOUT = "block-halves"
LAYOUT_FILE = "forge_jax_layout.json"


def _checkpointer():
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  return ocp.StandardCheckpointer()


def _placement(tree):
  """Where a leaf of the abstract state ``tree`` without a sharding of its
  own (a Python scalar: ``TrainState.step`` at 0) is restored: replicated
  on the mesh of the first leaf sharded over one, else on the device of
  the first leaf on one; None where no leaf says."""
  shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(tree)]
  for sharding in shardings:
    if isinstance(sharding, NamedSharding):
      return NamedSharding(sharding.mesh, PartitionSpec())
  for sharding in shardings:
    if isinstance(sharding, SingleDeviceSharding):
      return sharding
  return None


def _abstract(x, placement=None):
  """A leaf of an abstract state as a ``ShapeDtypeStruct``. A leaf not
  sharded like the state (a Python scalar, an uncommitted scalar of a fresh
  state) goes to ``placement`` (:func:`_placement`): restored where it was
  saved (every device of a mesh), a step on the state's devices would
  refuse it."""
  if not isinstance(x, jax.ShapeDtypeStruct):
    if not hasattr(x, "dtype"):  # a Python scalar (TrainState.step at 0)
      x = np.asarray(x)
    x = jax.ShapeDtypeStruct(
      np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)
    )
  on_mesh = isinstance(placement, NamedSharding)
  if (on_mesh and not isinstance(x.sharding, NamedSharding)) or (
    placement is not None and x.sharding is None
  ):
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placement)
  return x


def save(path: str, state: Any, *, force: bool = False) -> str:
  """Write ``state`` (a TrainState or any pytree of arrays) to ``path``.

  Blocks until the checkpoint is complete. ``force`` overwrites an existing
  checkpoint at ``path``. Returns the absolute path.
  """
  path = os.path.abspath(path)
  checkpointer = _checkpointer()
  # A Python scalar (TrainState.step before the first step) as the array a
  # step makes of it (int32 without x64), the dtype jax.eval_shape gives.
  state = jax.tree.map(
    lambda x: x if hasattr(x, "dtype") else jnp.asarray(x), state
  )
  checkpointer.save(path, state, force=force)
  checkpointer.wait_until_finished()
  with open(os.path.join(path, LAYOUT_FILE), "w", encoding="utf-8") as f:
    json.dump({"fourbit_codes": FOURBIT_LAYOUT}, f)
  return path


def _fourbit_layout(path: str):
  """The 4-bit code layout a checkpoint recorded (None: none recorded)."""
  try:
    with open(os.path.join(path, LAYOUT_FILE), encoding="utf-8") as f:
      return json.load(f).get("fourbit_codes")
  except FileNotFoundError:
    return None


def _path_name(path) -> str:
  return "/".join(str(key_name(k)) for k in path)


def saved_dtypes(path: str) -> dict[str, Any]:
  """``{'params/.../opt_state/mu/codes': dtype, ...}`` as saved at ``path``."""
  named = _named_leaves(_saved_tree(os.path.abspath(path)))
  return {name: np.dtype(leaf.dtype) for name, leaf in named.items()}


def _named_leaves(saved_tree) -> dict[str, Any]:
  """``{'params/.../opt_state/mu/codes': leaf metadata, ...}``."""
  return {
    _path_name(p): leaf
    for p, leaf in jax.tree_util.tree_flatten_with_path(saved_tree)[0]
  }


#: Leaves a checkpoint may lack: the last step's gradient norms (a
#: diagnostic, and 'delayed' clipping's input, for which 0 means "do not
#: clip"), restored as zeros.
ZERO_IF_MISSING = ("grad_sq_norm", "grad_norm")
#: Saved leaves an abstract state may lack: the norm a state that tracks
#: none has no field for.
DROPPED_IF_UNWANTED = ("grad_norm",)


def _zero_if_missing(name: str) -> bool:
  return name.rsplit("/", 1)[-1] in ZERO_IF_MISSING


def _is_empty(x) -> bool:
  """An empty node: None, or a container without children (an optax
  ``EmptyState``, which orbax saves as None)."""
  return x is None or (isinstance(x, (tuple, list, dict)) and not x)


def _empty_names(tree) -> set:
  """The paths of ``tree``'s empty nodes (:func:`_is_empty`)."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty)[0]
  return {_path_name(p) for p, x in flat if _is_empty(x)}


def restore(path: str, abstract_state: Any) -> Any:
  """The state saved at ``path``, in the structure of ``abstract_state``.

  orbax casts every array to the dtype of the target it is given; this
  refuses instead: the saved dtypes (from the checkpoint's metadata) must be
  the abstract state's. Gradient-norm leaves (:data:`ZERO_IF_MISSING`) the
  checkpoint lacks come back as zeros; a saved ``grad_norm`` the abstract
  state lacks (:data:`DROPPED_IF_UNWANTED`) is left out.

  Raises:
    TypeError: a saved leaf's dtype or shape differs from the abstract
      state's (an optimizer state saved in another storage format:
      ``state_dtype``, ``second_moment_bits``), a leaf of the abstract
      state other than a gradient norm is not in the checkpoint, the two
      differ in their empty states (another optax chain: ``adam``'s
      against ``adamw``'s), or the
      abstract state has 4-bit second moments and the checkpoint does not
      record their layout as :data:`FOURBIT_LAYOUT`.
  """
  path = os.path.abspath(path)
  if quantization.has_4bit(abstract_state):
    layout = _fourbit_layout(path)
    if layout is None:
      raise TypeError(
        f"checkpoint {path} records no layout of 4-bit codes (layout None: "
        "not written by forge_jax.checkpoint.save; plain orbax, say): codes "
        "of another pairing would restore as other levels. If this "
        f"forge_jax's state was saved there (layout {FOURBIT_LAYOUT!r}), "
        f"record it: write {json.dumps({'fourbit_codes': FOURBIT_LAYOUT})} "
        f"to {os.path.join(path, LAYOUT_FILE)}"
      )
    if layout != FOURBIT_LAYOUT:
      raise TypeError(
        f"checkpoint {path} records 4-bit codes in layout {layout!r}, not "
        f"{FOURBIT_LAYOUT!r} (a block's columns j and j + 32 a byte): its "
        "second moments would restore as other levels"
      )
  saved_tree = _saved_tree(path)
  saved_leaves = _named_leaves(saved_tree)
  saved = {name: np.dtype(leaf.dtype) for name, leaf in saved_leaves.items()}
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
  placement = _placement(abstract_state)
  problems, leaves, zeros = [], [], set()
  for key, value in flat:
    name = _path_name(key)
    want = _abstract(value, placement)
    if name not in saved and _zero_if_missing(name):
      zeros.add(name)
    elif name not in saved:
      problems.append(f"{name}: not in the checkpoint")
    elif not hasattr(value, "dtype"):
      # A Python scalar (TrainState.step before the first step): it has no
      # dtype of its own, so it takes the saved one.
      want = jax.ShapeDtypeStruct(
        want.shape, saved[name], sharding=want.sharding
      )
    elif saved[name] != np.dtype(want.dtype):
      problems.append(
        f"{name}: saved as {saved[name]}, the abstract state "
        f"wants {np.dtype(want.dtype)}"
      )
    elif tuple(saved_leaves[name].shape) != tuple(want.shape):
      problems.append(
        f"{name}: saved with shape {tuple(saved_leaves[name].shape)}, the "
        f"abstract state wants {tuple(want.shape)}"
      )
    leaves.append(want)
  wanted_names = {_path_name(key) for key, _ in flat}
  unwanted = [name for name in saved if name not in wanted_names]
  dropped = {name for name in unwanted if name in DROPPED_IF_UNWANTED}
  problems += [
    f"{name}: in the checkpoint, not in the abstract state"
    for name in unwanted
    if name not in dropped
  ]
  # Stateless parts (an optax chain's EmptyStates) hold no leaf, so the
  # leaves of adam's and adamw's states, say, have the same names: their
  # empty nodes tell them apart (a node that holds leaves on the other
  # side is named by its leaves).
  named = {
    name.rsplit("/", depth)[0]
    for name in wanted_names | set(saved)
    for depth in range(name.count("/") + 1)
  }
  saved_empty = _empty_names(saved_tree) - named
  wanted_empty = _empty_names(abstract_state) - named
  problems += [
    f"{name}: an empty state in the checkpoint, not in the abstract state"
    for name in sorted(saved_empty - wanted_empty)
  ] + [
    f"{name}: an empty state of the abstract state, not in the checkpoint"
    for name in sorted(wanted_empty - saved_empty)
  ]
  if problems:
    raise TypeError(
      f"checkpoint {path} does not match the abstract state "
      "(nothing is cast): " + "; ".join(problems)
    )
  if not zeros and not dropped:
    return _checkpointer().restore(path, jax.tree.unflatten(treedef, leaves))
  # Restore what was saved, in the saved structure, then fill in the zeros
  # and leave out the dropped leaves.
  wanted = {_path_name(key): want for (key, _), want in zip(flat, leaves)}

  def target(key, _):
    name = _path_name(key)
    if name in wanted:
      return wanted[name]
    return jax.ShapeDtypeStruct(tuple(saved_leaves[name].shape), saved[name])

  restored = _checkpointer().restore(
    path, jax.tree_util.tree_map_with_path(target, saved_tree)
  )
  by_name = {
    _path_name(key): leaf
    for key, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
  }
  return jax.tree.unflatten(
    treedef,
    [
      jnp.zeros(want.shape, want.dtype, device=want.sharding)
      if name in zeros
      else by_name[name]
      for name, want in wanted.items()
    ],
  )


def _saved_tree(path: str):
  """The checkpoint's tree of leaf metadata, in the saved structure."""
  metadata = _checkpointer().metadata(path)
  tree = getattr(metadata, "item_metadata", metadata)
  return getattr(tree, "tree", tree)
