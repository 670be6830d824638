"""What a traced ForgeDense learns from around it, and what it leaves behind.

Two trace-time channels between the parts of the package:

* :func:`stacked_layer`: while :func:`forge_jax.scan` traces its block, the
  ForgeDense layers inside it receive their whole variable stacks and step
  one layer of them in place (the layer's index, the number of layers, and
  the scan's module path, which prefixes the layers' own paths).
* :func:`record` / :func:`last_event`: each ForgeDense records, by module
  path, that its forward ran, and the fused op's backward that it ran after
  it. :class:`forge_jax.TrainState` installs the new variables of a layer
  whose backward ran last without reading the old ones (so updates stay in
  place), and checks the others at run time (a layer the loss did not reach
  gets zero cotangents and keeps its variables).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple, Optional

FORWARD = "forward"
BACKWARD = "backward"


class StackedLayer(NamedTuple):
  """The layer of the stacks that the traced block stands for."""

  index: Any  # an int32 scalar; None while fj.scan runs its block unstacked
  length: int  # the number of stacked layers
  path: tuple  # the scan module's path


_STACKED_LAYER: contextvars.ContextVar[Optional[StackedLayer]] = (
  contextvars.ContextVar("forge_stacked_layer", default=None)
)


def stacked_layer() -> Optional[StackedLayer]:
  """The :class:`StackedLayer` being traced, or None outside fj.scan."""
  return _STACKED_LAYER.get()


@contextlib.contextmanager
def stacking(index, length: int, path: tuple):
  """ForgeDense calls traced inside step layer ``index`` of their stacks
  (``index`` None: fj.scan runs the block as nn.scan would)."""
  token = _STACKED_LAYER.set(StackedLayer(index, length, tuple(path)))
  try:
    yield
  finally:
    _STACKED_LAYER.reset(token)


_EVENTS: dict[tuple, str] = {}
_OPTIMIZERS: dict[tuple, Any] = {}


def record(path: tuple, event: str, optimizer=None) -> None:
  """Records that ``event`` (:data:`FORWARD` or :data:`BACKWARD`) was traced
  for the ForgeDense at module ``path`` (a forward names its optimizer)."""
  _EVENTS[tuple(path)] = event
  if optimizer is not None:
    _OPTIMIZERS[tuple(path)] = optimizer


def last_event(path: tuple) -> Optional[str]:
  """The last event traced for the ForgeDense at ``path``, or None."""
  return _EVENTS.get(tuple(path))


def optimizer(path: tuple):
  """The optimizer of the ForgeDense at ``path`` last traced, or None."""
  return _OPTIMIZERS.get(tuple(path))
