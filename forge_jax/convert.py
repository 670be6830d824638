"""Pretrained weights in and out of FORGE models.

A FORGE model is the flax model with ``nn.Dense`` -> ``fj.ForgeDense``,
``nn.DenseGeneral`` -> ``fj.ForgeDenseGeneral``, ``nn.Embed`` ->
``fj.ForgeEmbed`` (its ``embedding`` is a FORGE ``kernel``),
``nn.MultiHeadDotProductAttention`` -> ``fj.MultiHeadDotProductAttention``
and ``nn.scan`` -> ``fj.scan``. Its variables are flax's, with two
differences: each FORGE kernel sits at ``_overwrite_with_gradient/<path>/
kernel`` (beside its optimizer state) instead of ``params/<path>/kernel``,
and auto-named layers are named after their class (``ForgeDense_0`` where
flax says ``Dense_0``). Kernels keep flax's shapes, and scanned layers
flax's stacked layout, so :func:`from_dense` and :func:`to_dense` only move
leaves between paths.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional

import flax.linen as nn
import jax
from flax import traverse_util
from flax.core import unfreeze

from forge_jax import parallel
from forge_jax.linen import FORGE_COLLECTION
from forge_jax.ops.fused_dense import ForgeVariables

#: The leaves of one FORGE layer in its collection; all but ``kernel`` are
#: FORGE's own (optimizer state, step count, flags).
_LAYER_LEAVES = ForgeVariables._fields

_AUTO_EMBED = re.compile(r"^([A-Za-z]*?)ForgeEmbed_(\d+)$")
#: Auto-names of FORGE's layers -> the names flax gives the layers they
#: replace (``fj.scan`` names its class ``ForgeScan<Block>``, nn.scan
#: ``Scan<Block>``), also under flax's lifted transforms, which prefix the
#: class name (``nn.vmap(fj.ForgeDense)`` is ``VmapForgeDense_0`` where
#: ``nn.vmap(nn.Dense)`` is ``VmapDense_0``).
_AUTO_NAMES = (
  (re.compile(r"^([A-Za-z]*?)ForgeDense_(\d+)$"), r"\1Dense_\2"),
  (re.compile(r"^([A-Za-z]*?)ForgeDenseGeneral_(\d+)$"), r"\1DenseGeneral_\2"),
  (_AUTO_EMBED, r"\1Embed_\2"),
  (re.compile(r"^([A-Za-z]*?)ForgeScan(\w+_\d+)$"), r"\1Scan\2"),
)


def dense_path(path: tuple) -> tuple:
  """The module path in the flax model of the module at ``path`` in the
  FORGE model (auto-names translated, explicit names kept)."""
  renamed = []
  for name in path:
    for pattern, replacement in _AUTO_NAMES:
      name = pattern.sub(replacement, name)
    renamed.append(name)
  return tuple(renamed)


def from_dense(
  dense_variables,
  forge_model: nn.Module,
  *init_args,
  rngs: Any = None,
  rename: Optional[Callable[[tuple], tuple]] = None,
  **init_kwargs,
):
  """FORGE variables for ``forge_model`` holding ``dense_variables``' weights.

  ``dense_variables`` are the variables of the same architecture built with
  flax's layers (unrolled, or stacked by ``nn.scan`` where the FORGE model
  uses ``fj.scan``). ``forge_model.init(rngs, *init_args, **init_kwargs)``
  says what the FORGE model holds, traced under ``jax.jit`` (its random
  kernels are never computed): every kernel and parameter is taken from
  ``dense_variables``, and each FORGE layer gets a fresh optimizer state,
  count and flags, with the optimizer and dtypes its layer says.

  Args:
    dense_variables: the flax model's variables (``{'params': ...}``, and
      any other collections the FORGE model has).
    forge_model: the FORGE model.
    *init_args: the arguments of ``forge_model.init`` after the rngs (e.g.
      a batch of tokens; only its shape and dtype matter).
    rngs: ``init``'s rngs; default ``jax.random.key(0)``.
    rename: maps a module path of the FORGE model (a tuple of names) to
      the flax model's; default :func:`dense_path`.
    **init_kwargs: further keyword arguments of ``forge_model.init``.

  Returns:
    The FORGE variables: the dense leaves bit for bit (cast where the FORGE
    model's dtype differs), the optimizer states as ``init`` makes them.
    Under a mesh (``jax.set_mesh``) each leaf is sharded as its
    partitioning says, the optimizer states like their kernels.

  Warns:
    UserWarning: ``forge_model`` has no FORGE layers (the flax model
      passed in its place, say).

  Raises:
    TypeError: ``dense_variables`` is not a dict (a ``TrainState``, say).
    ValueError: a leaf of the FORGE model has no counterpart in
      ``dense_variables``, or a shape differs, or ``dense_variables`` holds
      leaves the FORGE model has no place for, or lacks a whole collection
      the FORGE model's init makes (a decode ``cache``: pass the flax
      model's, as its init makes it).
  """
  rename = dense_path if rename is None else rename
  rngs = jax.random.key(0) if rngs is None else rngs
  if not isinstance(dense_variables, Mapping):
    raise TypeError(
      "from_dense takes the flax model's variables dict, not "
      f"{type(dense_variables).__name__} (a flax TrainState's are "
      "{'params': state.params})"
    )
  if "params" not in dense_variables:
    raise ValueError(
      "dense_variables has no 'params' collection (its top level holds "
      f"{sorted(map(str, dense_variables))[:8]}): pass the flax model's "
      "whole variables, {'params': params, ...}, as model.init returns "
      "them; for a checkpoint of the parameters alone, "
      "{'params': params}."
    )

  def convert(dense_variables):
    fresh = forge_model.init(rngs, *init_args, **init_kwargs)
    if FORGE_COLLECTION not in fresh:
      warnings.warn(
        f"{type(forge_model).__name__} has no FORGE layers: from_dense "
        "returns its flax variables, and nothing trains with a fused "
        "update. Pass the FORGE model (fj.ForgeDense in place of "
        "nn.Dense, ...) as forge_model.",
        stacklevel=4,
      )
    return _fill(fresh, dense_variables, rename)

  if jax.sharding.get_abstract_mesh().empty:
    return jax.jit(convert)(dense_variables)
  # Under a mesh every leaf is placed as its partitioning says (the states
  # like their kernels), as parallel.init_sharded places a fresh model's.
  specs = parallel.partition_specs(jax.eval_shape(convert, dense_variables))
  return jax.jit(convert, out_shardings=specs)(dense_variables)


def to_dense(
  forge_variables,
  rename: Optional[Callable[[tuple], tuple]] = None,
  embeddings: Iterable[tuple | str] = (),
):
  """The flax model's variables from a FORGE model's (inverse of
  :func:`from_dense` on the weights).

  Every FORGE kernel goes to ``params/<path>/kernel``, or to
  ``params/<path>/embedding`` for a :class:`forge_jax.ForgeEmbed` (an
  auto-named ``ForgeEmbed_i``, or a module path in ``embeddings``: tuples
  of names in the FORGE model, such as ``("model", "embed")``, or strings,
  ``"model/embed"``; ``embeddings=["embed"]`` and ``embeddings="embed"``
  name the layer ``embed``). Its optimizer state
  and counters are dropped, and auto-named paths take flax's names
  (``rename``, default :func:`dense_path`). The arrays are the FORGE
  variables' own.
  """
  if not isinstance(forge_variables, Mapping):
    raise TypeError(
      f"to_dense takes a variables dict, not {type(forge_variables).__name__}"
      " (a TrainState's variables are its .params)"
    )
  rename = dense_path if rename is None else rename
  if isinstance(embeddings, str):
    embeddings = (embeddings,)
  embeddings = {
    tuple(path.split("/")) if isinstance(path, str) else tuple(path)
    for path in embeddings
  }
  flat = traverse_util.flatten_dict(unfreeze(forge_variables))
  layers = {
    tuple(path)
    for collection, *path, name in flat
    if collection == FORGE_COLLECTION and name == "kernel"
  }
  if embeddings - layers:
    raise ValueError(
      f"embeddings= names {sorted(embeddings - layers)}, which are not "
      f"FORGE layers of these variables: {sorted(layers)}"
    )
  out, sources = {}, {}
  for key, leaf in flat.items():
    collection, *path, name = key
    if collection == FORGE_COLLECTION:
      if name == "kernel":
        is_table = tuple(path) in embeddings or (
          path and _AUTO_EMBED.match(path[-1])
        )
        leaf_name = "embedding" if is_table else "kernel"
        target = ("params",) + tuple(rename(tuple(path))) + (leaf_name,)
      elif name not in _LAYER_LEAVES:
        raise ValueError(
          f"{'/'.join(map(str, key))} is not a leaf of a FORGE layer "
          f"({', '.join(_LAYER_LEAVES)})"
        )
      else:
        continue
    else:
      target = (collection,) + tuple(rename(tuple(path))) + (name,)
    if target in sources:
      joined = lambda k: "/".join(map(str, k))
      raise ValueError(
        f"{joined(sources[target])} and {joined(key)} both become "
        f"{joined(target)}: an auto-named FORGE layer takes flax's name for "
        "its kind and index, which a flax layer of the same model already "
        "has. Name the layers, or pass rename=."
      )
    sources[target] = key
    out[target] = leaf
  return traverse_util.unflatten_dict(out)


def _fill(fresh, dense_variables, rename):
  """``fresh`` (the FORGE model's init) with the dense leaves in place.
  Values a model sows (``self.sow``: tuples, the init's outputs rather than
  state) are left out on both sides."""
  # sow appends to a plain tuple; optimizer states are NamedTuples.
  sown = lambda leaf: type(leaf) is tuple  # noqa: E721
  dense = {
    key: leaf
    for key, leaf in traverse_util.flatten_dict(
      unfreeze(dense_variables)
    ).items()
    if not sown(leaf)
  }
  flat = traverse_util.flatten_dict(unfreeze(fresh), keep_empty_nodes=True)
  collections = {key[0] for key in dense}
  used, missing, absent, out = set(), [], set(), {}
  for key, leaf in flat.items():
    if sown(leaf):
      continue
    if leaf is traverse_util.empty_node:
      out[key] = leaf
      continue
    collection, *path, name = key
    if collection == FORGE_COLLECTION and name != "kernel":
      out[key] = leaf  # FORGE's own: fresh
      continue
    source = (
      ("params" if collection == FORGE_COLLECTION else collection,)
      + tuple(rename(tuple(path)))
      + (name,)
    )
    embedding = source[:-1] + ("embedding",)
    if collection == FORGE_COLLECTION and embedding in dense:
      source = embedding  # an nn.Embed table for a fj.ForgeEmbed
    if source not in dense:
      if source[0] in collections or source[0] == "params":
        missing.append(f"{'/'.join(map(str, key))} (from {'/'.join(source)})")
      else:
        absent.add(source[0])
      continue
    used.add(source)
    out[key] = _put(leaf, dense[source], key, source)
  if absent:
    # A whole collection (a decode cache, batch statistics): no path of a
    # layer is wrong, the flax model's collection is not there.
    raise ValueError(
      f"dense_variables has no {', '.join(map(repr, sorted(absent)))} "
      "collection, which the FORGE model's init makes: pass the flax "
      "model's too (a decode cache as its init makes it: "
      "{'params': params, 'cache': dense_model.init(...)['cache']}), or "
      "convert the model without it (decode=False) and take it from the "
      "FORGE model's init."
    )
  unused = sorted("/".join(map(str, k)) for k in dense if k not in used)
  if missing or unused:
    raise ValueError(
      "the dense variables do not match the FORGE model: "
      + (f"no dense leaf for {', '.join(missing)}; " if missing else "")
      + (
        f"dense leaves without a place: {', '.join(unused)}; " if unused else ""
      )
      + _SAME_PATH
    )
  return traverse_util.unflatten_dict(out)


#: How a FORGE model's paths meet the flax model's, the hint of a mismatch.
_SAME_PATH = (
  "each FORGE layer must replace the flax layer of the same path "
  "(auto-names ForgeDense_i, ForgeDenseGeneral_i, ForgeEmbed_i, "
  "ForgeScan<Block>_i stand for Dense_i, DenseGeneral_i, Embed_i, "
  "Scan<Block>_i, also behind a lifted transform's prefix: "
  "VmapForgeDense_i for VmapDense_i; the flax layers kept beside them are "
  "numbered among their own kind only); name the layers, or pass rename=."
)


def _put(fresh_leaf, dense_leaf, key, source):
  """``dense_leaf``'s value in ``fresh_leaf``'s place, dtype and box."""
  value = _unboxed(dense_leaf)
  target = _unboxed(fresh_leaf)
  if value.shape != target.shape:
    raise ValueError(
      f"{'/'.join(map(str, key))} has shape {target.shape} in the FORGE "
      f"model but {'/'.join(source)} has {value.shape} in the dense one: "
      + _SAME_PATH
    )
  value = value.astype(target.dtype)
  if isinstance(fresh_leaf, nn.Partitioned):
    return fresh_leaf.replace_boxed(value)
  return value


def _unboxed(leaf):
  return leaf.value if isinstance(leaf, nn.Partitioned) else leaf
