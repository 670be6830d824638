"""What a traced ForgeDense learns from around it, and what it leaves behind.

Four trace-time channels between the parts of the package:

* :func:`stacked_layer`: while :func:`forge_jax.scan` traces its block, the
  ForgeDense layers inside it receive their whole variable stacks and step
  one layer of them in place (the layer's index, the number of layers, and
  the scan's module path, which prefixes the layers' own paths).
* :func:`record_forward` / :func:`record_backward` / :func:`take_backwards`:
  each ForgeDense records, by module path, that its forward ran, and the
  fused op's backward that it ran after it. :class:`forge_jax.TrainState`
  installs the new variables of a layer whose backward ran last, in the
  gradient computation being installed and inside the install's own trace,
  without reading the old ones (so updates stay in place), and checks the
  others at run time (a layer the loss did not reach gets zero cotangents
  and keeps its variables). A forward traced after a backward starts
  another gradient computation: the earlier one's backwards are no longer
  trusted, since its gradients may never be installed (a gradient taken
  for a diagnostic, another model's) and the loss being installed may not
  reach those layers. Nor is a layer trusted that an earlier gradient computation of the same
  layers, not yet installed, did not reach: that gradient may be the one
  installed.
  Installing forgets the layer's events: a later trace that traces neither
  its forward nor its backward (both inside a ``jax.jit`` whose trace is
  cached) must not trust a backward that ran in an earlier trace. A layer
  traced inside a conditional (``nn.cond``, ``nn.switch``) is never
  trusted: its backward is traced whether or not its branch runs. A
  backward traced twice for one kernel in one computation and pass (the
  kernel used twice by the loss) raises. Several models may share layer
  paths: what a check asks of a layer's backward (its optimizer, its
  clipping pass, its updates) it reads from the backward that read the
  installed layer's kernel.
* :func:`gradient_pass` / :func:`running`: which backward pass of
  :mod:`forge_jax.clipping`'s gradient functions is being traced (a
  norm-only pass computes each layer's ``grad_sq_norm`` and updates
  nothing; a deferred pass also hands each layer's factors out);
  :func:`last_pass` says under which pass a layer's backward was traced
  last, and :func:`running` lists the passes every backward traced inside
  it ran as.
* :func:`discovering` / :func:`declare`: while exact clipping traces the
  loss abstractly, each ForgeDense declares, by path, the factors its
  deferred backward would hand out and whether it can defer
  (:class:`DeferrableLayer`).
* :func:`plain_gradients` / :func:`differentiates_plainly`: the calls
  traced inside differentiate as ``nn.Dense`` does, with no fused update.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import sys
import weakref
from typing import Any, NamedTuple, Optional

from jax import tree_util
from jax._src import core as jax_core  # a trace's parents: no public API
from jax.experimental.xla_metadata import set_xla_metadata

FORWARD = "forward"
BACKWARD = "backward"

#: The backward passes of :mod:`forge_jax.clipping`: the norm of every
#: weight gradient and no update; the update with a scaled seed; and the
#: norm with the layer's factors handed out, for an update after the pass.
NORM_ONLY = "norm_only"
SCALED = "scaled"
DEFERRED = "deferred"


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


_PLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "forge_plain_gradients", default=False
)


@contextlib.contextmanager
def plain_gradients():
  """Traces the ForgeDense layers inside as ``nn.Dense``: no fused update.

  Differentiating through them then gives ordinary gradients: with respect
  to the inputs (adversarial examples, saliency maps, gradient penalties,
  a GAN's generator loss through its discriminator), derivatives of
  gradients (Hessian-vector products, ``jax.hessian``) and, where asked, to
  each kernel (its ``dW``, which a train step must not install: the install
  refuses it when traced beside it, and otherwise keeps such a layer as it
  was, as one the loss did not reach). ``fj.scan`` and ``fj.nnx.scan`` run
  as plain scans::

    with fj.plain_gradients():
      dx = jax.grad(loss, argnums=1)(variables, x)

  A plain use differentiated with respect to the kernel inside a loss
  whose FORGE backward steps that kernel (a gradient penalty, a second
  call) is a second use of it: the kernel's cotangent would be the new
  kernel plus the plain ``dW``, so the layer is poisoned instead
  (:func:`forge_jax.ops.fused_dense.plainly_used`; ``fj.wiped_layers``
  names it). Use ``nn.Dense`` for a layer such a loss differentiates twice.
  In a plain gradient with respect to the variables, each layer's ``count``
  entry holds that mark, not a gradient: take ``dW`` from the kernels.
  Forward mode differentiates the inputs (``jax.jvp``, ``jax.jacfwd``,
  ``jax.hessian``) and, over a reverse pass, the variables (``jax.hessian``
  of the variables); a ``jax.jvp`` or ``jax.jacfwd`` with respect to the
  variables alone meets the mark's ``custom_vjp`` and raises JAX's "can't
  apply forward-mode autodiff (jvp) to a custom_vjp function": apply the
  flax model to ``fj.to_dense(variables)`` for it.

  The mode also goes into the XLA metadata, which is part of the trace
  context: a function jitted both inside and outside gets a trace of each.
  """
  token = _PLAIN.set(True)
  try:
    with set_xla_metadata(forge_plain_gradients=True):
      yield
  finally:
    _PLAIN.reset(token)


def differentiates_plainly() -> bool:
  """Whether the calls traced now are inside :func:`plain_gradients`."""
  return _PLAIN.get()


_GRADIENT_PASS: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
  "forge_gradient_pass", default=None
)


def gradient_pass() -> Optional[str]:
  """The pass being traced (:data:`NORM_ONLY`, :data:`SCALED`), or None."""
  return _GRADIENT_PASS.get()


@contextlib.contextmanager
def running(gradient_pass_name: str):
  """Traces the calls inside as backward pass ``gradient_pass_name``;
  yields a list that receives the pass each fused op's backward traced
  inside runs as (:func:`record_backward`).

  JAX caches the transposes of ``scan``, ``while``, ``cond``, ``remat`` and
  ``jit`` bodies by their linearized jaxpr and its trace context, so a
  second call of one ``jax.vjp`` pullback would reuse the first call's
  trace of every ForgeDense backward inside such a body. The pass's name
  also goes into the XLA metadata, which is part of the trace context:
  each pass gets its own traces (and its ops say which pass they belong
  to).
  """
  traced = []
  token = _GRADIENT_PASS.set(gradient_pass_name)
  traced_token = _TRACED.set(traced)
  try:
    with set_xla_metadata(forge_gradient_pass=gradient_pass_name):
      yield traced
  finally:
    _TRACED.reset(traced_token)
    _GRADIENT_PASS.reset(token)


_TRACED: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar(
  "forge_traced_backwards", default=None
)


#: The most (count, kernel) stacks of fj.scan's backwards the records keep.
_KEPT_STACKS = 64


class _Events:
  """The events traced per layer path, and which gradient computation each
  belongs to (see the module docstring)."""

  def __init__(self):
    self.computation = 0
    self.last: Optional[str] = None
    #: path -> (FORWARD or BACKWARD, its computation)
    self.events: dict[tuple, tuple[str, int]] = {}
    #: path -> the traces its last backward nests in (:func:`_lineage`).
    self.backward_lineage: dict[tuple, tuple] = {}
    #: path -> (optimizer, the traces it nests in) of its last forwards,
    #: oldest first.
    self.optimizers: dict[tuple, list[tuple[Any, tuple]]] = {}
    #: path -> the name flax's twin of the layer keeps its weight under.
    self.weights: dict[tuple, str] = {}
    #: path -> (the kernel read, the pass, the optimizer, whether the
    #: kernel read was laid out anew) of its last backwards, oldest first.
    self.backward_records: dict[
      tuple, list[tuple[Any, Optional[str], Any, bool]]
    ] = {}
    #: Paths whose last forward ran inside a conditional.
    self.conditional: set[tuple] = set()
    #: (path, pass) -> (computation, the kernel the backward read).
    self.kernels: dict[tuple, tuple[int, weakref.ref]] = {}
    #: path -> (computation, the applied kernel a lifted forward read).
    self.lifted: dict[tuple, tuple[int, weakref.ref]] = {}
    #: path -> the :class:`_Update` of each backward that stepped the layer
    #: since its last install.
    self.updates: dict[tuple, list] = {}
    #: (count, kernel) stacks fj.scan's backwards wrote, the last few.
    self.written_stacks: collections.deque = collections.deque(
      maxlen=_KEPT_STACKS
    )
    #: (count, kernel) the deferred pass's backwards returned (as they
    #: were), until :func:`take_deferred_returns`.
    self.deferred_returns: list = []
    #: path -> the computations that traced its forward (its backward),
    #: since its last install.
    self.forwards: dict[tuple, set[int]] = {}
    self.backwards: dict[tuple, set[int]] = {}
    #: The computations that traced a backward whose gradients no install
    #: has taken yet, with the traces their backwards ran in.
    self.unsettled: set[int] = set()
    self.traces: dict[int, list] = {}
    #: path -> the traces that differentiated a plain use of its kernel
    #: (``plain_gradients``) since its last install.
    self.plain: dict[tuple, list] = {}

  def current(self, path: tuple) -> Optional[str]:
    event = self.events.get(path)
    if event is None or event[1] != self.computation:
      return None
    return event[0]


_EVENTS = _Events()

#: Names shown for layers whose key is not their path in the model
#: (``fj.nnx.Linear``'s, named by the ``fj.nnx.Optimizer`` made for it).
_DISPLAY_NAMES: dict = {}


def name_layer(path: tuple, name: str):
  """Shows the layer keyed ``path`` as ``name`` in error messages."""
  _DISPLAY_NAMES[tuple(path)] = name


def is_differentiated(value) -> bool:
  """Whether ``value`` is being differentiated (a tracer of JAX's JVP or
  linearization, which carries a tangent): a second use then sums two
  updates, while inference may use a layer as often as it likes."""
  return isinstance(value, jax_core.Tracer) and hasattr(value, "tangent")


def layer_name(path: tuple) -> str:
  """The name error messages give the layer keyed ``path``."""
  return _DISPLAY_NAMES.get(tuple(path), "/".join(map(str, path)))


#: The most forwards, backwards and updates of a layer path the records
#: keep (the layers of several models may share a path).
_KEPT_RECORDS = 8


def _keep(records: dict, path: tuple, record):
  kept = records.setdefault(path, [])
  kept.append(record)
  del kept[:-_KEPT_RECORDS]


def record_forward(path: tuple, optimizer, weight: str = "kernel") -> bool:
  """Records that the forward of the ForgeDense at module ``path``, with
  ``optimizer``, was traced (``weight``: the name flax's twin of the layer
  keeps its weight under), and returns whether inside a conditional (a
  branch of ``jax.lax.cond`` or ``switch``: ``nn.cond``, ``nnx.cond``, a
  ``lax.cond`` around ``apply``)."""
  path = tuple(path)
  conditional = in_lax_branch()
  if _EVENTS.last == BACKWARD:
    _EVENTS.computation += 1
  _EVENTS.last = FORWARD
  _EVENTS.events[path] = (FORWARD, _EVENTS.computation)
  _EVENTS.forwards.setdefault(path, set()).add(_EVENTS.computation)
  _keep(_EVENTS.optimizers, path, (optimizer, _lineage()))
  _EVENTS.weights[path] = weight
  if conditional:
    _EVENTS.conditional.add(path)
  else:
    _EVENTS.conditional.discard(path)
  return conditional


_CONDITIONALS = "jax._src.lax.control_flow.conditionals"
_LOOPS = "jax._src.lax.control_flow.loops"


def _traced_by(module: str, functions: tuple) -> bool:
  """Whether one of ``functions`` of the JAX module ``module`` is on the
  call stack: JAX does not say which transform a trace belongs to; its
  call frames do."""
  frame = sys._getframe(2)  # pylint: disable=protected-access
  while frame is not None:
    if (
      frame.f_globals.get("__name__") == module
      and frame.f_code.co_name in functions
    ):
      return True
    frame = frame.f_back
  return False


def in_lax_branch() -> bool:
  """Whether the caller runs inside a branch that ``jax.lax.cond`` or
  ``jax.lax.switch`` is tracing (flax's and nnx's conditionals call
  them). Such a branch's
  layers trace a backward whether or not the branch runs, and the branch
  not taken writes zeros as their new variables, so their install checks
  the written flags at run time."""
  return _traced_by(_CONDITIONALS, ("cond", "switch", "_switch_internal"))


def in_lax_while_loop() -> bool:
  """Whether the caller runs inside a body (or condition) that
  ``jax.lax.while_loop`` is tracing (flax's ``nn.while_loop`` calls it).
  Its layers run as often as the loop turns, for inference only: JAX does
  not differentiate a while loop in reverse."""
  return _traced_by(_LOOPS, ("while_loop",))


def _weak(value):
  """A weak reference to ``value``, or a dead one where it takes none."""
  try:
    return weakref.ref(value)
  except TypeError:  # not weakly referenceable (a Python scalar)
    return lambda: None


def record_lifted_forward(path: tuple, applied_kernel) -> bool:
  """Records that the forward of the ForgeDense at ``path`` ran inside a
  lifted transform (``nn.remat``, ``nn.jit``, ...) that passes it its own
  copy of the kernel, reading ``applied_kernel``, the array given to the
  outermost ``apply``. Returns whether this computation already ran such a
  forward on the same array: the layer called twice, which the backward's
  own check cannot see (each call's backward reads its own copy)."""
  path = tuple(path)
  previous = _EVENTS.lifted.get(path)
  _EVENTS.lifted[path] = (_EVENTS.computation, _weak(applied_kernel))
  return (
    previous is not None
    and previous[0] == _EVENTS.computation
    and previous[1]() is applied_kernel
  )


def record_backward(
  path: Optional[tuple],
  deferred: bool,
  kernel=None,
  optimizer=None,
  relaid: bool = False,
) -> str:
  """Records that the fused op's backward was traced for the ForgeDense at
  ``path`` (None: an unnamed op, recorded only in :func:`running`'s
  list), reading ``kernel``, stepping by ``optimizer``, and returns the
  pass it runs as: the :func:`gradient_pass`, but :data:`NORM_ONLY` for a
  layer in a :data:`DEFERRED` pass that has no factor sink (``deferred``
  False). ``relaid``: ``kernel`` is a copy the op laid out on an explicit
  mesh, not the array the layer was given.

  Raises if this computation already traced a backward of the same pass
  that read the same ``kernel`` at ``path``."""
  name = gradient_pass()
  if name == DEFERRED and not deferred:
    name = NORM_ONLY
  if path is not None:
    path = tuple(path)
    _check_single_backward(path, name, kernel)
    _EVENTS.last = BACKWARD
    _EVENTS.events[path] = (BACKWARD, _EVENTS.computation)
    _EVENTS.backward_lineage[path] = _lineage()
    _EVENTS.backwards.setdefault(path, set()).add(_EVENTS.computation)
    _EVENTS.unsettled.add(_EVENTS.computation)
    traces = _EVENTS.traces.setdefault(_EVENTS.computation, [])
    traces += [t for t in _lineage() if not _within(t, traces)]
    _keep(
      _EVENTS.backward_records,
      path,
      (_weak(kernel), name, optimizer, relaid),
    )
  traced = _TRACED.get()
  if traced is not None:
    traced.append(name)
  return name


class _Update(NamedTuple):
  """A backward's update of one layer, as :func:`record_update` keeps it
  (weak references to the arrays)."""

  computation: int
  kernel: Any  # the kernel it read
  count: Any  # the count it wrote
  new_kernel: Any  # the kernel it wrote (None: not known)
  lineage: tuple  # the traces it was traced in


def record_update(path: Optional[tuple], kernel, count, new_kernel=None):
  """Records that the backward just traced for the ForgeDense at ``path``
  stepped it: it read ``kernel`` and wrote ``count`` and ``new_kernel``
  (its cotangents for the layer's ``count`` and ``kernel``; None: the
  layer's kernel cotangent is not this array, not checked).
  :func:`take_backwards` tells from these an install of one backward's
  gradient from one of several combined, and a kernel's cotangent that
  another use of the kernel added to."""
  if path is None or gradient_pass() not in (None, SCALED):
    return
  # Gradients taken and never installed (an analysis loop) add up: the
  # last few suffice to tell a combined gradient.
  _keep(
    _EVENTS.updates,
    tuple(path),
    _Update(
      _EVENTS.computation,
      _weak(kernel),
      _weak(count),
      None if new_kernel is None else _weak(new_kernel),
      _lineage(),
    ),
  )


def record_written_stacks(stacks) -> None:
  """Records the ``count`` and ``kernel`` stacks of each layer in
  ``stacks`` (FORGE's collection as fj.scan's backward returns it, the
  stepped stacks) for :func:`take_backwards`: the loop's own updates,
  recorded by :func:`record_update`, are arrays of its body. As there,
  only a pass that steps the layers records; the deferred pass's stacks,
  returned as they were, go to :func:`take_deferred_returns`."""
  if gradient_pass() == DEFERRED:
    for layer in _layers_of(stacks):
      record_deferred_return(layer["count"], layer["kernel"])
    return
  if gradient_pass() not in (None, SCALED):
    return
  for layer in _layers_of(stacks):
    _EVENTS.written_stacks.append(
      (_weak(layer["count"]), _weak(layer["kernel"]))
    )


def _layers_of(stacks) -> list[dict]:
  """The variables of each layer in ``stacks`` (FORGE's collection, or an
  NNX state of it) that has a ``count`` and a ``kernel``."""
  name = lambda key: str(getattr(key, "key", getattr(key, "name", "")))
  layers = {}
  for keys, leaf in tree_util.tree_flatten_with_path(stacks)[0]:
    if name(keys[-1]) == "value":  # an nnx.Variable's, in NNX's stacks
      keys = keys[:-1]
    layers.setdefault(keys[:-1], {})[name(keys[-1])] = leaf
  return [
    layer for layer in layers.values() if "count" in layer and "kernel" in layer
  ]


def record_deferred_return(count, kernel) -> None:
  """Records the ``count`` and ``kernel`` a backward of the deferred pass
  returned for a layer (its variables as they were, stepped afterwards
  from their factors): :func:`check_deferred_returns` tells from them a
  kernel whose cotangent another use of it added to."""
  _EVENTS.deferred_returns.append((count, kernel))


def take_deferred_returns() -> list:
  """The records of :func:`record_deferred_return` since the last call,
  forgotten."""
  records, _EVENTS.deferred_returns = _EVENTS.deferred_returns, []
  return records


def check_deferred_returns(records, layers) -> None:
  """Raises for the layers whose kernel cotangent is not the kernel their
  deferred backward returned, while their count is: the loss also reads
  the kernel outside its layer. ``records``: from
  :func:`take_deferred_returns`; ``layers``: ``(name, count, kernel)``
  of each layer's cotangents."""
  returned = {id(count): kernel for count, kernel in records}
  added_to = [
    name
    for name, count, kernel in layers
    if id(count) in returned and returned[id(count)] is not kernel
  ]
  if added_to:
    raise ValueError(_added_to_message(added_to))


def _kernel_added_to(path: tuple, written_count, written_kernel) -> bool:
  """Whether the gradient installed for ``path`` holds the very ``count``
  a backward wrote (it flowed from that backward unchanged) but not its
  kernel: another use of the kernel (a weight penalty, a decoder tied to
  it) added its gradient to the update."""
  if written_count is None or written_kernel is None:
    return False
  written = [(u.count, u.new_kernel) for u in _EVENTS.updates.get(path, ())]
  for count, kernel in written + list(_EVENTS.written_stacks):
    if count() is written_count:
      # The written kernel, if installed, is alive: a dead reference is
      # another array's.
      return kernel is not None and kernel() is not written_kernel
  return False


def _added_to_message(names) -> str:
  return (
    f"The gradient installed for the FORGE layers {names} is not the "
    "kernel their backward wrote, while their count is: another use of "
    "the kernel added its gradient (the loss also reads the kernel "
    "outside its layer: a weight penalty on it, a decoder or head tied "
    "to it), or the kernel's gradient alone was changed on its way (a "
    "cast, a sharding constraint). FORGE's gradient of a kernel is its "
    "updated value, so what is added to it, or done to it, is done to "
    "the weights. Use the optimizer's weight_decay for an L2 penalty, "
    "flax's layer (nn.Dense, nnx.Linear) for a kernel the loss reads "
    "elsewhere, and pass FORGE's gradients to the install as they are."
  )


def _combined(path: tuple, written_count, kernel, trace) -> bool:
  """Whether the gradient installed for ``path``, whose ``count`` entry is
  ``written_count`` (None: not known), is not one backward's: its count is
  none of the counts the layer's backwards in this trace wrote, and several
  gradient computations of this trace stepped the same kernel since the
  last install (gradient accumulation). Forgets the layer's updates of
  ``kernel``, the installed layer's old kernel (None: not known), and
  those of no known kernel. ``trace``: the install's."""
  # Only this trace's: a gradient taken elsewhere (eagerly, in another jit)
  # reaches the install as another array, whichever one it is. Another
  # model's layer at the same path (another kernel) keeps its updates.
  updates, kept = [], []
  for update in _EVENTS.updates.pop(path, []):
    read = update.kernel()
    other = read is not None and kernel is not None and read is not kernel
    (kept if other else updates).append(update)
  if kept:
    _EVENTS.updates[path] = kept
  updates = [update for update in updates if _within(trace, update.lineage)]
  if written_count is None or any(
    update.count() is written_count for update in updates
  ):
    return False
  by_kernel = {}
  for update in updates:
    read = update.kernel()
    if read is not None:
      by_kernel.setdefault(id(read), set()).add(update.computation)
  return any(len(computations) > 1 for computations in by_kernel.values())


def record_plain_backward(path: tuple):
  """Records that a plain use (:func:`plain_gradients`) of the kernel of the
  ForgeDense at ``path`` was differentiated with respect to the kernel."""
  _EVENTS.plain.setdefault(tuple(path), []).append(_lineage())


def _check_single_backward(path, name, kernel):
  if kernel is None or path in _EVENTS.conditional:
    return
  try:
    ref = weakref.ref(kernel)
  except TypeError:  # not weakly referenceable (a Python scalar)
    return
  previous = _EVENTS.kernels.get((path, name))
  if (
    previous is not None
    and previous[0] == _EVENTS.computation
    and previous[1]() is kernel
  ):
    raise ValueError(
      f"The FORGE layer {layer_name(path)!r} ran its backward twice "
      "in one gradient computation: the loss uses its kernel more than "
      "once (a module or submodule called twice, model.apply called twice, "
      "a layer called in a Python loop). FORGE updates the kernel inside "
      "each use's backward, so a shared kernel would receive the updates "
      "summed together. Use one layer per use, or flax's layer for shared "
      "weights. (Two models made from one initialization's arrays, in one "
      "loss, look the same: give each its own copy, "
      "jax.tree.map(jnp.copy, variables).)"
    )
  _EVENTS.kernels[(path, name)] = (_EVENTS.computation, ref)


def take_backwards(
  paths, written_counts=None, kernels=None, written_kernels=None
) -> list[bool]:
  """For each ForgeDense at ``paths`` (the layers one install writes):
  whether its cotangents can be taken as its backward wrote them. That
  holds where the fused op's backward was the last event traced for the
  layer in the current gradient computation, in the install's trace (or a
  body traced inside it, or writing the count the install holds), outside
  any conditional, and in every gradient computation of this trace that
  traced any of these layers since their last install and whose gradients
  no install took: whichever of them is being installed then reached the
  layer. (A gradient traced for a diagnostic after the training gradient,
  reaching a layer the training loss does not, says nothing of the
  gradient being installed.)

  Forgets the layers' events, so the next call says False until a forward
  or backward is traced again (:func:`last_pass` keeps the pass, which
  counts only beside a backward event), and settles the computations that
  traced their backwards: their gradients are taken.

  Raises for a layer whose gradient in this trace came only from a plain
  use (:func:`record_plain_backward`): it would not train. With
  ``written_counts`` (each layer's installed ``count`` entry), raises for
  layers whose installed gradient combines several backwards' updates of
  one kernel (:func:`record_update`): summed or averaged updates are not
  the update of the summed gradient. ``kernels``: each layer's old kernel,
  so that the updates of another model's layer at the same path stay
  recorded for that layer's install. With ``written_kernels`` (each
  layer's installed ``kernel`` entry), raises for layers whose installed
  count is a backward's own but whose kernel is not: the loss read the
  kernel outside its layer too (:func:`record_update`).
  """
  paths = [tuple(path) for path in paths]
  trace = _current_trace()
  if written_counts is None:
    written_counts = [None] * len(paths)
  if kernels is None:
    kernels = [None] * len(paths)
  if written_kernels is None:
    written_kernels = [None] * len(paths)
  added_to = [
    layer_name(path)
    for path, count, kernel in zip(paths, written_counts, written_kernels)
    if _kernel_added_to(path, count, kernel)
  ]
  if added_to:
    raise ValueError(_added_to_message(added_to))
  # An install traced inside the gradient's trace (a branch of a lax.cond
  # that skips bad steps, closing over the grads) holds the very count a
  # backward wrote.
  written_here = [
    count is not None
    and any(update.count() is count for update in _EVENTS.updates.get(path, ()))
    for path, count in zip(paths, written_counts)
  ]
  combined = [
    layer_name(path)
    for path, count, kernel in zip(paths, written_counts, kernels)
    if _combined(path, count, kernel, trace)
  ]
  if combined:
    raise ValueError(
      f"The gradient installed for the FORGE layers {combined} combines "
      "the gradients of several gradient computations of their kernels "
      "(gradient accumulation: grads summed or averaged over "
      "micro-batches). FORGE's gradients are updates: each backward "
      "already stepped the layer, and combining steps is not stepping by "
      "the combined gradient. Install one gradient a step (a larger batch "
      "instead of accumulation); take gradients that are not installed "
      "(diagnostics) inside fj.plain_gradients()."
    )
  pending = set()
  for path in paths:
    pending |= _EVENTS.forwards.pop(path, set())
    pending |= _EVENTS.backwards.get(path, set())
  # Only this trace's: a gradient another jit traced (a diagnostic of its
  # own, or one a plain nnx.update took) is not the one installed here.
  pending = {
    c for c in pending & _EVENTS.unsettled if _within(trace, _EVENTS.traces[c])
  }
  plain_only = []
  for path in paths:
    plain_traces = _EVENTS.plain.pop(path, ())
    if any(
      _within(trace, lineage) for lineage in plain_traces
    ) and not _EVENTS.backwards.get(path):
      plain_only.append(layer_name(path))
  if plain_only:
    raise ValueError(
      f"The gradient installed for the FORGE layers {plain_only} was taken "
      "inside fj.plain_gradients(), where they differentiate as nn.Dense "
      "and update nothing: they would not train. Call inside "
      "plain_gradients() only the models the loss does not train (a GAN's "
      "discriminator in the generator's loss), or take input gradients "
      "there."
    )
  # A backward at the path that read another layer's kernel (a clone of
  # the model, its layers under the same keys, in the same loss) says
  # nothing of this layer.
  others_only = [
    _read_others_only(path, kernel) for path, kernel in zip(paths, kernels)
  ]
  decisions, taken = [], set()
  for path, wrote, other in zip(paths, written_here, others_only):
    event = _EVENTS.current(path)
    _EVENTS.events.pop(path, None)
    backwards = _EVENTS.backwards.pop(path, set())
    taken |= backwards
    # Traced in this trace (or a body inside it), or installing what it
    # wrote: a backward traced elsewhere (eagerly, another jit) wrote
    # another gradient than the one this trace installs each time it runs.
    lineage = _EVENTS.backward_lineage.pop(path, ())
    here = wrote or _within(trace, lineage)
    decisions.append(
      event == BACKWARD
      and here
      and path not in _EVENTS.conditional
      and pending <= backwards
      and not other
    )
  _EVENTS.unsettled -= taken
  for computation in taken:
    _EVENTS.traces.pop(computation, None)
  return decisions


def _read_others_only(path: tuple, kernel) -> bool:
  """Whether the recorded backwards of the layer at ``path`` read kernels
  (arrays still alive) of ``kernel``'s own trace and none of them is
  ``kernel``: they stepped another layer under the same key (a second
  model of one module in the same loss). A kernel of another trace (the
  operand of a branch the install runs in, a shard of a ``shard_map``) is
  the same layer seen through that trace, and so is a copy laid out on an
  explicit mesh. False where ``kernel`` is None or no kernel they read is
  known."""
  if kernel is None:
    return False
  read = [
    record[0]()
    for record in _EVENTS.backward_records.get(path, ())
    if not record[3]
  ]
  read = [array for array in read if array is not None]
  if any(array is kernel for array in read):
    return False
  trace = getattr(kernel, "_trace", None)
  return any(getattr(array, "_trace", None) is trace for array in read)


def _current_trace() -> weakref.ref:
  """A weak reference to the trace JAX is tracing into: a jit's, where its
  gradients' backwards run and their install is traced."""
  return weakref.ref(jax_core.trace_ctx.trace)


def _lineage() -> tuple:
  """Weak references to the trace JAX is tracing into and to the traces it
  nests in, innermost first: a ``scan`` or ``remat`` body's, then its
  jit's (eagerly, evaluation's)."""
  refs, trace = [], jax_core.trace_ctx.trace
  while trace is not None:
    refs.append(weakref.ref(trace))
    trace = getattr(trace, "parent_trace", None)
  # Evaluation's only when eager: every trace nests in it, but an eager
  # install takes only what was computed eagerly.
  return tuple(refs[:-1]) if len(refs) > 1 else tuple(refs)


def _within(trace: weakref.ref, lineage) -> bool:
  """Whether ``trace`` is one of ``lineage``'s (:func:`_lineage`)."""
  return any(t is trace for t in lineage)


def optimizers(path: tuple, kernel=None) -> tuple:
  """The optimizers the ForgeDense at ``path`` may have, the likeliest
  first; empty where no forward of it was traced.

  The layers of several models (a learning-rate sweep, a GAN's two
  networks) may share a path. The optimizer is the one of the backward
  that read ``kernel`` (the layer's kernel as an install holds it), else
  of the last forward traced inside the current trace, else any optimizer
  of the path's last forwards, the last first (inside a jitted ``apply``
  the backward reads a tracer that no eager install holds)."""
  path = tuple(path)
  backward = _backward_of(path, kernel)
  if backward is not None:
    return (backward[2],)
  records = _EVENTS.optimizers.get(path, [])
  if not isinstance(jax_core.trace_ctx.trace, jax_core.EvalTrace):
    trace = _current_trace()
    for optimizer, lineage in reversed(records):
      if _within(trace, lineage):
        return (optimizer,)
  return tuple(dict.fromkeys(record[0] for record in reversed(records)))


def recorded_key(path: tuple, kernel=None) -> tuple:
  """The key the events of the layer at ``path`` of FORGE's Linen
  collection are recorded under: ``path``, but the key of the last
  backward that read ``kernel`` where none at ``path`` did (an
  ``fj.nnx.Linear`` wrapped by ``nnx.bridge.ToLinen`` records under its
  own key, while another model's layer may have recorded at ``path``)."""
  path = tuple(path)
  if kernel is None or _backward_of(path, kernel) is not None:
    return path
  # The latest keys first: the backward that read ``kernel`` is recent.
  for key, records in reversed(_EVENTS.backward_records.items()):
    if any(record[0]() is kernel for record in records):
      return key
  return path


def _backward_of(path: tuple, kernel) -> Optional[tuple]:
  """The record (kernel read, pass, optimizer, relaid) of the last backward
  of the ForgeDense at ``path`` that read ``kernel``; None where none did
  (or ``kernel`` is None)."""
  if kernel is not None:
    for record in reversed(_EVENTS.backward_records.get(path, [])):
      if record[0]() is kernel:
        return record
  return None


def weight_name(path: tuple) -> str:
  """The name flax's twin of the ForgeDense at ``path`` keeps its weight
  under: ``'embedding'`` for an embedding's table, else ``'kernel'``."""
  return _EVENTS.weights.get(tuple(path), "kernel")


def stepping_pass(path: tuple, kernel=None) -> Optional[tuple]:
  """``(pass,)`` of the backward that stepped the ForgeDense at ``path``:
  the last backward that read ``kernel``, else (none recorded, or None)
  the last event of the current gradient computation, if a backward; None
  where neither is."""
  path = tuple(path)
  backward = _backward_of(path, kernel)
  if backward is not None:
    return (backward[1],)
  if _EVENTS.current(path) == BACKWARD:
    return (last_pass(path),)
  return None


def forward_only(path: tuple, kernel=None) -> bool:
  """Whether the forward of the ForgeDense at ``path`` was traced since its
  last install and no backward of it was (its output's gradient stopped:
  the loss does not reach it). Any backward since then counts, not only
  the current computation's: a gradient traced in one jit and installed
  in another may be followed by a forward alone (an evaluation), and the
  install cannot tell which computation's gradient it takes."""
  path = tuple(path)
  return (
    stepping_pass(path, kernel) is None
    and bool(_EVENTS.forwards.get(path))
    and not _EVENTS.backwards.get(path)
  )


def last_pass(path: tuple) -> Optional[str]:
  """The pass the last backward of the ForgeDense at ``path`` ran as (see
  :func:`record_backward`; None: a plain ``jax.grad`` or none traced)."""
  records = _EVENTS.backward_records.get(tuple(path))
  return records[-1][1] if records else None


class DeferrableLayer(NamedTuple):
  """What a ForgeDense declares while :func:`discovering`."""

  spec: Any  # its FusedDenseSpec
  #: ``Factors`` of ShapeDtypeStructs: the compute-dtype input ``[tokens,
  #: K]`` and the output's cotangent ``[tokens, N]`` (with a leading axis of
  #: ``length`` for stacked layers).
  factors: Any
  length: Optional[int]  # the number of layers of fj.scan's stacks, or None
  #: False under a ShardedLayout or inside nn.scan / nn.vmap: the layer
  #: runs norm-only in a deferred pass.
  can_defer: bool


_DISCOVERED: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
  "forge_discovered_layers", default=None
)


@contextlib.contextmanager
def discovering():
  """Yields a dict that every ForgeDense traced inside fills with its
  :class:`DeferrableLayer`, by path (a path declared twice, as by two
  models in one loss, cannot defer)."""
  layers = {}
  token = _DISCOVERED.set(layers)
  try:
    # A fresh value in the trace context each time: a jitted function
    # inside the loss (``jax.jit(model.apply)``) is traced again instead of
    # served from JAX's cache, where its layers would declare nothing.
    with set_xla_metadata(forge_discovery=next(_DISCOVERIES)):
      yield layers
  finally:
    _DISCOVERED.reset(token)


_DISCOVERIES = itertools.count()


def is_discovering() -> bool:
  """Whether the layers traced now declare themselves (:func:`declare`)."""
  return _DISCOVERED.get() is not None


def declare(path: tuple, layer: DeferrableLayer) -> None:
  """Declares the ForgeDense at ``path`` while :func:`discovering`."""
  layers = _DISCOVERED.get()
  path = tuple(path)
  if path in layers:
    layer = layer._replace(can_defer=False)
  layers[path] = layer
