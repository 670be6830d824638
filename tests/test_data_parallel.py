"""Data parallelism (FSDP) for FORGE (forge_jax.parallel) on 8 CPU devices.

A mesh axis that shards both the input's tokens and a ForgeDense kernel is
FSDP: the kernel and its states are stored sharded over it, the layer
all-gathers the kernel just in time, and reduce-scatters its weight gradient
(in blocks) before the elementwise update of its own shard. The device count
is set by ``conftest.py`` (8 CPU devices); where JAX was initialized with
fewer, ``test_suite_in_subprocess`` reruns this file in a fresh process.

Everything is float32 with tiny shapes unless said otherwise; "exact" means
≤ 1e-5 relative (‖a − b‖ / ‖b‖ per leaf) after several steps: FSDP sums the
weight gradient over devices in another order than one device's GEMM.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.train_state import TrainState
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import forge_jax as fj
from examples.lm.llama import Llama, LlamaConfig, kernels
from examples.lm.train import loss_fn
from forge_jax import parallel

from fused_dense_test_base import BF16_STATE_RTOL, OPTAX_CASES

NUM_DEVICES = 8  # conftest.py sets them before JAX initializes
COLL = fj.FORGE_COLLECTION
ENOUGH = jax.default_backend() == "cpu" and jax.device_count() >= NUM_DEVICES
needs_devices = pytest.mark.skipif(
  not ENOUGH,
  reason=f"needs {NUM_DEVICES} devices: run by test_suite_in_subprocess",
)
OPT = fj.adamw(learning_rate=1e-2, weight_decay=0.1)
STEPS = 3
RTOL = 1e-5
SLOW = pytest.mark.slow  # run with --run-slow (CI runs the rest)


@pytest.mark.skipif(
  ENOUGH or os.environ.get("FORGE_DATA_PARALLEL_CHILD") == "1",
  reason="the tests run in this process",
)
def test_suite_in_subprocess():
  env = dict(os.environ, FORGE_DATA_PARALLEL_CHILD="1", JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    + (["--run-slow"] if "--run-slow" in sys.argv else [])
    + [os.path.abspath(__file__)],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert " passed" in last and "failed" not in last and "error" not in last, (
    proc.stdout[-3000:]
  )


# ---------------------------------------------------------------------------
# Helpers.


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  den = np.linalg.norm(b.ravel())
  num = np.linalg.norm((a - b).ravel())
  return float(num / den) if den else float(num)


def _assert_trees_close(actual, expected, rtol=RTOL, what=""):
  flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  flat_e = jax.tree_util.tree_flatten_with_path(expected)[0]
  assert [p for p, _ in flat_a] == [p for p, _ in flat_e]
  for (path, a), (_, e) in zip(flat_a, flat_e):
    assert np.all(np.isfinite(np.asarray(a, np.float64))), (what, path)
    err = _rel(a, e)
    assert err <= rtol, (
      f"{what} {jax.tree_util.keystr(path)}: {err:.3g} > {rtol}"
    )


def _host(tree):
  return jax.tree.map(lambda a: np.array(a, copy=True), tree)


def _bits(a) -> np.ndarray:
  a = np.atleast_1d(np.asarray(a))
  return a.view(f"u{a.dtype.itemsize}")


def _all_gathers(hlo: str) -> list[tuple]:
  """``(dtype, shape)`` of every all-gather in a compiled module."""
  found = re.finditer(
    r"=\s*\(?(\w+)\[([\d,]*)\][^=\n]*?\ball-gather(?:-start)?\(", hlo
  )
  return [
    (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
    for m in found
  ]


def _mesh(dp: int, tp: int = 1):
  return parallel.make_mesh(model=tp, data=dp)


INIT = nn.initializers.lecun_normal()


class FSDPNet(nn.Module):
  """Two dense layers the way MaxText shards FSDP weights: the embedding
  dimension of every kernel over 'data' (the batch axis), the hidden one
  over 'model'. ``up`` gathers its in_features (K), ``down`` its features
  (N, which its declared output leaves out). ``forge=False``: nn.Dense."""

  optimizer: fj.ForgeOptimizer = OPT
  forge: bool = True
  hidden: int = 64
  features: int = 16
  param_dtype: object = jnp.float32
  implementation: str = "xla"

  def _dense(self, features, kernel_names, name, **io):
    kw = dict(
      kernel_init=nn.with_partitioning(INIT, kernel_names),
      param_dtype=self.param_dtype,
      name=name,
    )
    if not self.forge:
      return nn.Dense(features, **kw)
    return fj.ForgeDense(
      features,
      optimizer=self.optimizer,
      implementation=self.implementation,
      **kw,
      **io,
    )

  @nn.compact
  def __call__(self, x):
    h = self._dense(
      self.hidden,
      ("data", "model"),
      "up",
      input_partitioning=("data", None, None),
      output_partitioning=("data", None, "model"),
    )(x)
    return self._dense(
      self.features,
      ("model", "data"),
      "down",
      input_partitioning=("data", None, "model"),
      output_partitioning=("data", None, None),
    )(nn.gelu(h))


@dataclasses.dataclass
class Run:
  params: dict
  losses: list
  hlo: str = ""
  memory: object = None
  shardings: dict = None


def _mse(variables, apply_fn, batch):
  x, target = batch
  return jnp.mean((apply_fn(variables, x) - target) ** 2)


def _lm_loss(variables, apply_fn, batch):
  return loss_fn(variables, apply_fn, batch)


def _train(
  model, batches, tx, mesh=None, loss=_mse, init_arg=None, steps=STEPS
) -> Run:
  """``steps`` jitted TrainState steps on one device (mesh None) or under
  ``mesh`` with the batch sharded over 'data' and every variable placed in
  the sharding its partitioning metadata gives (the same initial values)."""
  init_arg = batches[0][0] if init_arg is None else init_arg
  variables = parallel.strip_boxes(
    jax.jit(model.init)(jax.random.key(0), init_arg)
  )

  def step(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, state.apply_fn, batch)
    return state.apply_gradients(grads=grads), value

  step = jax.jit(step)
  if mesh is None:
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    losses = []
    for batch in batches[:steps]:
      state, value = step(state, batch)
      losses.append(float(value))
    return Run(_host(state.params), losses)
  with jax.set_mesh(mesh):
    abstract = jax.eval_shape(model.init, jax.random.key(0), init_arg)
  specs = parallel.partition_specs(abstract)
  variables = jax.tree.map(
    lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), variables, specs
  )
  data = NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    batches = [jax.device_put(b, data) for b in batches[:steps]]
    compiled = step.lower(state, batches[0]).compile()
    losses = []
    for batch in batches:
      state, value = step(state, batch)
      losses.append(float(value))
  return Run(
    _host(state.params),
    losses,
    compiled.as_text(),
    compiled.memory_analysis(),
    jax.tree.map(lambda a: a.sharding, state.params),
  )


def _regression_batches(shape=(8, 4, 16), features=16, steps=STEPS):
  out = []
  for k in jax.random.split(jax.random.key(7), steps):
    kx, ky = jax.random.split(k)
    out.append(
      (
        jax.random.normal(kx, shape),
        jax.random.normal(ky, shape[:-1] + (features,)),
      )
    )
  return out


def _assert_matches_optax(forge: Run, baseline: Run, what: str, rtol=RTOL):
  fk, bk = kernels(forge.params), kernels(baseline.params)
  assert sorted(fk) == sorted(bk) and fk
  _assert_trees_close(fk, bk, rtol, what=f"{what}: kernels vs nn.Dense + optax")
  biases = lambda run: {
    k: v for k, v in jax.tree_util.tree_leaves_with_path(run.params["params"])
  }
  fb, bb = biases(forge), biases(baseline)
  fb = {k: v for k, v in fb.items() if not k[-1].key == "kernel"}
  bb = {k: v for k, v in bb.items() if not k[-1].key == "kernel"}
  assert fb.keys() == bb.keys()
  for k in fb:
    assert _rel(fb[k], bb[k]) <= rtol, (what, k)
  np.testing.assert_allclose(forge.losses, baseline.losses, rtol=rtol)


def _assert_fsdp_shardings(params, mesh):
  """Every kernel and kernel-shaped state leaf sharded like its kernel."""
  for name, spec in (("up", P("data", "model")), ("down", P("model", "data"))):
    layer = params[COLL][name]
    want = NamedSharding(mesh, spec)
    for leaf in jax.tree.leaves((layer["kernel"], layer["opt_state"])):
      assert leaf.sharding.is_equivalent_to(want, 2), (name, leaf.sharding)


# ---------------------------------------------------------------------------
# Exactness: FSDP (x TP) against one device and nn.Dense + optax.

# FSDP x TP by default (FSDP alone: the scanned Llama and the optimizer
# table at DP = 4); the rest is slow.
DP_TP = [
  pytest.param(dp, tp, id=f"dp{dp}-tp{tp}", marks=() if fast else SLOW)
  for dp, tp, fast in [
    (2, 1, False),
    (4, 1, False),
    (8, 1, False),
    (2, 2, False),
    (4, 2, True),
  ]
]


@needs_devices
@pytest.mark.parametrize("dp,tp", DP_TP)
def test_fsdp_matches_one_device_and_optax(dp, tp):
  mesh = _mesh(dp, tp)
  batches = _regression_batches()
  tx = OPT.to_optax()
  forge = _train(FSDPNet(), batches, tx, mesh)
  single = _train(FSDPNet(), batches, tx)
  _assert_trees_close(forge.params, single.params, what="FSDP vs one device")
  np.testing.assert_allclose(forge.losses, single.losses, rtol=RTOL)
  baseline = _train(FSDPNet(forge=False), batches, tx, mesh)
  _assert_matches_optax(forge, baseline, f"dp{dp}-tp{tp}")
  # Each layer's kernel is gathered once in the forward and once in the
  # backward; nothing else of kernel size is (no optimizer state).
  gathered = _all_gathers(forge.hlo)
  kernel_shapes = {(16, 64), (64, 16), (16, 64 // tp), (64 // tp, 16)}
  assert len([g for g in gathered if g[1] in kernel_shapes]) == 4, gathered


#: The table's core rows of these optimizers run by default, every row with
#: --run-slow: centered RMSprop with momentum's three state tensors shard
#: like the kernel (AdamW's two: every other test here).
DEFAULT_OPTIMIZERS = ("rmsprop",)


def _optimizer_rows():
  return [
    pytest.param(
      c,
      id=c.id,
      marks=() if c.core and c.name in DEFAULT_OPTIMIZERS else SLOW,
    )
    for c in OPTAX_CASES
  ]


@needs_devices
@pytest.mark.parametrize("case", _optimizer_rows())
def test_fsdp_optimizer_table(case):
  """Every optimizer of the table (one core row by default, all with
  --run-slow) at DP=4 equals one device (1e-5) and nn.Dense + optax (1e-5;
  rows with bfloat16 states to the bf16 rounding one device has too)."""
  opt = getattr(fj, case.name)(**case.kwargs)
  mesh = _mesh(4)
  batches = _regression_batches()
  tx = opt.to_optax()
  forge = _train(FSDPNet(optimizer=opt), batches, tx, mesh)
  single = _train(FSDPNet(optimizer=opt), batches, tx)
  _assert_trees_close(forge.params, single.params, what=case.id)
  baseline = _train(FSDPNet(optimizer=opt, forge=False), batches, tx, mesh)
  # With bfloat16 states optax rounds decay * state in bf16, FORGE in
  # float32 (as on one device: fused_dense_test_base.test_matches_optax).
  bf16_state = jnp.bfloat16 in (
    case.kwargs.get("mu_dtype"),
    case.kwargs.get("accumulator_dtype"),
  )
  _assert_matches_optax(
    forge, baseline, case.id, BF16_STATE_RTOL if bf16_state else RTOL
  )


# ---------------------------------------------------------------------------
# The main job's model (examples/lm): FSDP rules, unrolled and scanned.


@dataclasses.dataclass(frozen=True)
class FSDPLlamaConfig(LlamaConfig):
  """The Llama model with MaxText's FSDP rule: every kernel's ``embed``
  dimension over the batch axis (activations keep theirs unsharded: the
  batch takes the axis first)."""

  def axis_rules(self) -> tuple:
    rules = super().axis_rules()
    return rules[:1] + (("embed", self.batch_axis),) + rules[1:]


# test_parallel.py's config: Adam amplifies the summation order of dW less
# on it (4 heads of 8 drift by ~1.8e-5 at DP=4, nn.Dense + optax too).
LM = LlamaConfig(
  vocab_size=64,
  dim=32,
  num_layers=2,
  num_heads=16,
  num_kv_heads=8,
  head_dim=4,
  ffn_dim=64,
  max_len=64,
  implementation="xla",
)
T = 16


def _lm_config(forge: bool, tp: int = 0, sp: bool = False, **overrides):
  kw = dict(
    forge_optimizer=OPT if forge else None,
    batch_axis="data",
    forge_data_parallel="auto",
  )
  if tp:
    kw.update(tensor_axis="model", sequence_parallel=sp)
  return _fsdp_config(dataclasses.replace(LM, **kw, **overrides))


def _fsdp_config(config: LlamaConfig) -> FSDPLlamaConfig:
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  return FSDPLlamaConfig(**fields)


def _lm_batches(batch: int):
  keys = jax.random.split(jax.random.key(7), STEPS)
  return [jax.random.randint(k, (batch, T + 1), 0, LM.vocab_size) for k in keys]


def _unpartitioned(config) -> LlamaConfig:
  """The same model, one device: no partitioning, the stock rules."""
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  off = dict(tensor_axis=None, batch_axis=None, sequence_parallel=False)
  return LlamaConfig(**{**fields, **off})


def _lm_run(config, mesh=None, batch=8):
  batches = _lm_batches(batch)
  model = Llama(config if mesh is not None else _unpartitioned(config))
  return _train(
    model,
    batches,
    OPT.to_optax(),
    mesh,
    loss=_lm_loss,
    init_arg=batches[0][:, :-1],
  )


@needs_devices
@pytest.mark.parametrize(
  "dp,tp,sp",
  [
    # The default run covers DP x TP on FSDPNet and the Llama scanned.
    pytest.param(2, 2, True, id="dp2-tp2-sp", marks=SLOW),
    pytest.param(2, 0, False, id="dp2", marks=SLOW),
    pytest.param(4, 0, False, id="dp4", marks=SLOW),
    pytest.param(8, 0, False, id="dp8", marks=SLOW),
  ],
)
def test_fsdp_llama_matches_one_device_and_optax(dp, tp, sp):
  mesh = _mesh(dp, max(tp, 1))
  forge = _lm_run(_lm_config(True, tp, sp), mesh)
  single = _lm_run(_lm_config(True), None)
  _assert_trees_close(forge.params, single.params, what="llama FSDP")
  np.testing.assert_allclose(forge.losses, single.losses, rtol=RTOL)
  baseline = _lm_run(_lm_config(False, tp, sp), mesh)
  _assert_matches_optax(forge, baseline, f"llama dp{dp}")
  for path, sharding in kernels(forge.shardings).items():
    assert "data" in str(sharding.spec), (path, sharding)


@needs_devices
@pytest.mark.parametrize(
  "dp,tp",
  # Slow: fj.scan under FSDP runs by default in the one-layer and Explicit
  # mesh scan tests.
  [
    pytest.param(4, 1, id="dp4", marks=SLOW),
    pytest.param(2, 2, id="dp2-tp2", marks=SLOW),
  ],
)
def test_fsdp_scanned_llama(dp, tp):
  """fj.scan's stacked, in-place backward under FSDP: one layer's kernel is
  gathered at a time (never the [L, K, N] stack), and the model equals one
  device."""
  config = _lm_config(True, tp if tp > 1 else 0, scan_layers=True)
  mesh = _mesh(dp, tp)
  forge = _lm_run(config, mesh)
  single = _lm_run(config, None)
  _assert_trees_close(forge.params, single.params, what="scanned FSDP")
  np.testing.assert_allclose(forge.losses, single.losses, rtol=RTOL)
  gathered = _all_gathers(forge.hlo)
  assert gathered and all(len(shape) <= 2 for _, shape in gathered), gathered
  assert forge.params[COLL]["layers"]["attn"]["q_proj"]["kernel"].shape[0] == (
    LM.num_layers
  )
  stack = forge.shardings[COLL]["layers"]["attn"]["q_proj"]["kernel"]
  assert stack.spec[0] is None and "data" in str(stack.spec), stack


# ---------------------------------------------------------------------------
# Low precision: bf16 kernels with stochastic rounding, int8 states.


def _exact_batch(shape, features, key):
  """Inputs and output weights of small integers: every partial sum of dW is
  an exactly representable float32, so FSDP's reduce-scatter forms the
  one-device dW bit for bit and any difference is the update's own."""
  kx, kw = jax.random.split(jax.random.key(key))
  x = jax.random.randint(kx, shape, -2, 3).astype(jnp.float32)
  weight = jax.random.randint(kw, shape[:-1] + (features,), -2, 3)
  return x, weight.astype(jnp.float32)


def _linear_steps(net, variables, x, weight, steps=STEPS):
  """FORGE steps on ``sum(y * weight)`` (dY does not depend on the weights)."""
  loss = lambda v, x, weight: jnp.sum(net.apply(v, x) * weight)
  step = jax.jit(jax.grad(loss))
  for _ in range(steps):
    variables = {**variables, COLL: step(variables, x, weight)[COLL]}
  return variables


def _fsdp_dense(optimizer, features, kernel_names, param_dtype):
  gathers_n = kernel_names[1] == "data"
  return fj.ForgeDense(
    features,
    optimizer=optimizer,
    param_dtype=param_dtype,
    implementation="xla",
    use_bias=False,
    name="dense",
    kernel_init=nn.with_partitioning(INIT, kernel_names),
    input_partitioning=("data", None, None),
    output_partitioning=("data", None, None) if gathers_n else None,
  )


SR_OPT = fj.adamw(1e-2, weight_decay=0.1, weight_rounding="stochastic")
INT8_OPT = fj.adamw(
  1e-2, weight_decay=0.1, state_dtype="int8", weight_rounding="stochastic"
)
FOUR_BIT_OPT = dataclasses.replace(INT8_OPT, second_moment_bits=4)
LOWP = [
  # (optimizer, kernel partitioning, K, N, dp). By default int8 states with
  # stochastic rounding, one block a shard.
  pytest.param(SR_OPT, ("data", None), 32, 48, 4, marks=SLOW),
  pytest.param(SR_OPT, (None, "data"), 32, 48, 4, marks=SLOW),
  pytest.param(  # column blocks of 64
    INT8_OPT, ("data", None), 32, 256, 4, marks=SLOW
  ),
  (INT8_OPT, (None, "data"), 32, 256, 4),  # N / dp = 64: one block a shard
  pytest.param(  # a partial block, no blocking
    INT8_OPT, ("data", None), 16, 96, 8, marks=SLOW
  ),
  # Column blocks of 64: 32 4-bit codes each.
  (FOUR_BIT_OPT, ("data", None), 32, 256, 4),
]


@needs_devices
@pytest.mark.parametrize(
  "optimizer,names,k,n,dp",
  LOWP,
  ids=[
    "sr-k",
    "sr-n",
    "int8-k-blocks",
    "int8-n",
    "int8-k-partial-block",
    "int8-4bit-k-blocks",
  ],
)
def test_low_precision_fsdp_is_one_device_bit_for_bit(
  optimizer, names, k, n, dp
):
  """Stochastically rounded bf16 kernels hash global indices (the shard's
  and the block's offsets), and int8 codes and scales (and 4-bit codes) are
  quantized per whole block: FSDP writes one device's bits."""
  mesh = _mesh(dp)
  net = _fsdp_dense(optimizer, n, names, jnp.bfloat16)
  x, weight = _exact_batch((8, 4, k), n, 1)
  sharded = parallel.init_sharded(net.init, mesh, jax.random.key(0), x)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ws = jax.device_put(weight, NamedSharding(mesh, P("data")))
    sharded = _linear_steps(net, sharded, xs, ws)
  single = _linear_steps(
    net, parallel.strip_boxes(net.init(jax.random.key(0), x)), x, weight
  )
  got, want = _host(sharded[COLL]), _host(single[COLL])
  assert float(got["count"]) == STEPS
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(_bits(g), _bits(w))
  spec = NamedSharding(mesh, P(*names))
  for leaf in jax.tree.leaves(
    (sharded[COLL]["kernel"], sharded[COLL]["opt_state"])
  ):
    assert leaf.sharding.is_equivalent_to(spec, 2), leaf.sharding


@needs_devices
def test_int8_fsdp_over_features_needs_whole_blocks():
  mesh = _mesh(4)
  net = _fsdp_dense(INT8_OPT, 96, (None, "data"), jnp.bfloat16)
  x = jnp.ones((8, 4, 32))
  with pytest.raises(
    ValueError,
    match=re.escape(
      "features=96 split over 4 devices gives 24 columns per shard"
    )
    + ".*mesh axes \\('data',\\)",
  ):
    parallel.init_sharded(net.init, mesh, jax.random.key(0), x)


# ---------------------------------------------------------------------------
# Memory and collectives of the compiled step.


class Deep(nn.Module):
  """``layers`` FSDP layers (K gathered, the MaxText column layout)."""

  layers: int
  width: int
  optimizer: fj.ForgeOptimizer

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = fj.ForgeDense(
        self.width,
        optimizer=self.optimizer,
        implementation="xla",
        kernel_init=nn.with_partitioning(INIT, ("data", None)),
        input_partitioning=("data", None),
        name=f"layer{i}",
      )(x)
      x = jnp.tanh(x)
    return x


@needs_devices
def test_fsdp_step_holds_one_layer_gradient_block():
  """8 devices: the compiled step's temp holds one layer's gathered kernel
  (the operand of its forward or backward) and one block of one layer's
  weight gradient beyond the activations; a layer more adds activations
  only, never a dW. Each kernel is gathered twice (forward, backward) and
  no state leaf ever (bf16 states: no bf16 all-gather at all)."""
  dp, width, tokens = 8, 512, 64
  optimizer = fj.adamw(1e-3, state_dtype="bfloat16")
  x = jax.random.normal(jax.random.key(1), (tokens, width))
  runs = {
    layers: _train(
      Deep(layers, width, optimizer),
      [(x, x)],
      optimizer.to_optax(),
      _mesh(dp),
      steps=1,
    )
    for layers in (4, 8)
  }
  kernel = width * width * 4
  grad_block = kernel // dp  # [width, width / dp] float32: one shard's dW
  activation = tokens // dp * width * 4
  temp = {n: run.memory.temp_size_in_bytes for n, run in runs.items()}
  # Per layer: its input, output and cotangent, about; a dW shard is twice
  # that.
  per_layer = (temp[8] - temp[4]) / 4
  assert per_layer <= 4 * activation < grad_block, (temp, activation)
  assert temp[8] <= kernel + grad_block + 4 * 8 * activation, temp
  gathered = _all_gathers(runs[8].hlo)
  assert [d for d, _ in gathered].count("bf16") == 0, gathered
  assert gathered.count(("f32", (width, width))) == 2 * 8, gathered


@needs_devices
def test_data_axis_of_size_one_is_the_one_device_op():
  """FSDP partitioning on a mesh whose data axis has size 1 runs the fused
  backend as on one device: the same bits, no collective."""
  mesh = _mesh(1, 1)
  batches = _regression_batches()
  tx = OPT.to_optax()
  forge = _train(FSDPNet(), batches, tx, mesh)
  single = _train(FSDPNet(), batches, tx)
  _assert_trees_close(forge.params, single.params, rtol=0)
  for op in ("all-gather", "reduce-scatter", "all-reduce"):
    assert op not in forge.hlo, op


# ---------------------------------------------------------------------------
# Layouts: what is planned, what is refused, what warns.


def test_plan_layout_of_fsdp():
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
  column = parallel.plan_layout(
    mesh,
    3,
    P("data", "model"),
    x_spec=("data", None, None),
    y_spec=("data", None, "model"),
  )
  assert column.weight_gather == (("data",), ())
  assert column.token_axes == ("data",) and column.data_axes == ()
  assert column.k_axes == () and column.n_axes == ("model",)
  assert column.bias_spec() == P("model")
  # Column blocks of dW: 4 blocks of the 16 local columns (64 / model 2 /
  # blocks 4 = 8 columns each).
  assert column.gradient_blocks((8, 32), quantized=False) == (1, 4)
  assert column.gradient_blocks((8, 96), quantized=True) == (None, 1)
  row = parallel.plan_layout(
    mesh,
    3,
    P("model", "data"),
    x_spec=("data", None, "model"),
    y_spec=("data", None, None),
  )
  assert row.weight_gather == ((), ("data",)) and row.k_axes == ("model",)
  assert row.gradient_blocks((16, 4), quantized=False) == (0, 4)
  # Without a declared output an axis of N that shards the tokens is
  # sequence parallelism (the input's tokens are gathered), as before.
  sp = parallel.plan_layout(
    mesh, 3, P("data", "model"), x_spec=("data", "model", None)
  )
  assert sp.gather == (1, ("model",)) and sp.weight_gather == (("data",), ())
  assert sp.y == (("data",), (), ("model",))
  with pytest.raises(ValueError, match="must come last"):
    parallel.plan_layout(
      mesh,
      2,
      P(("data", "model"), None),
      x_spec=("data", "model"),
    )


@needs_devices
def test_undeclared_input_on_an_auto_mesh_is_refused():
  """Auto axes carry no sharding in the types: a layer that does not say
  how its input is sharded, on a mesh axis its kernel does not use, would
  gather a batch sharded over it. It raises, naming the axis."""
  mesh = _mesh(2)
  x = jax.random.normal(jax.random.key(1), (4, 8, 16))
  net = fj.ForgeDense(
    8,
    optimizer=OPT,
    implementation="xla",
    kernel_init=nn.with_partitioning(INIT, (None, "model")),
  )
  variables = parallel.init_sharded(net.init, mesh, jax.random.key(0), x)
  loss = lambda v, x: jnp.sum(net.apply(v, x) ** 2)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    with pytest.raises(
      parallel.DataParallelError,
      match="'data' \\(size 2\\).*input_partitioning",
    ):
      jax.jit(jax.grad(loss))(variables, xs)
  # The same layer without any partitioning, under jax.set_mesh.
  plain = fj.ForgeDense(8, optimizer=OPT, implementation="xla")
  plain_vars = plain.init(jax.random.key(0), x)
  with jax.set_mesh(mesh):
    with pytest.raises(parallel.DataParallelError, match="'data' \\(size 2\\)"):
      jax.jit(jax.grad(lambda v: jnp.sum(plain.apply(v, xs) ** 2)))(plain_vars)
  # Declared replicated: exact, every device computes the whole batch.
  replicated = net.clone(input_partitioning=(None, None, None))
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(lambda v, x: jnp.sum(replicated.apply(v, x) ** 2)))(
      variables, xs
    )
  want = jax.grad(loss)(parallel.strip_boxes(net.init(jax.random.key(0), x)), x)
  _assert_trees_close(_host(got), _host(want))


@needs_devices
def test_hybrid_sharding_is_exact():
  """FSDP over 'data' and data_parallel='psum' over 'replica' (the batch
  over both): each dW block all-reduced over the replicas, then
  reduce-scattered over 'data'; equals one device."""
  mesh = parallel.make_mesh(model=4, data=2, axis_names=("replica", "data"))
  net = _fsdp_dense(OPT, 16, ("data", None), jnp.float32).clone(
    input_partitioning=(("replica", "data"), None, None),
    data_parallel="psum",
  )
  x = jax.random.normal(jax.random.key(1), (8, 4, 16))
  loss = lambda v, x: jnp.sum(net.apply(v, x) ** 2)
  step = lambda v, x: {**v, COLL: jax.grad(loss)(v, x)[COLL]}
  variables = parallel.init_sharded(net.init, mesh, jax.random.key(0), x)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(("replica", "data"))))
    got = variables
    for _ in range(STEPS):
      got = jax.jit(step)(got, xs)
  want = parallel.strip_boxes(net.init(jax.random.key(0), x))
  for _ in range(STEPS):
    want = jax.jit(step)(want, x)
  _assert_trees_close(_host(got[COLL]), _host(want[COLL]))
  assert got[COLL]["opt_state"].nu.sharding.is_equivalent_to(
    NamedSharding(mesh, P("data", None)), 2
  )


@needs_devices
def test_data_parallel_error_mode_refuses_fsdp():
  mesh = _mesh(2)
  net = _fsdp_dense(OPT, 16, ("data", None), jnp.float32).clone(
    data_parallel="error"
  )
  with pytest.raises(
    parallel.DataParallelError,
    match="'data' \\(size 2\\).*data_parallel='auto'",
  ):
    parallel.init_sharded(
      net.init, mesh, jax.random.key(0), jnp.ones((4, 8, 16))
    )


@needs_devices
def test_kernel_gathered_without_data_parallelism_warns_once_and_is_exact():
  """A kernel sharded over an axis that shards neither the tokens nor a
  feature dimension: gathered just in time, exact, and warned about once."""
  mesh = _mesh(2)
  net = fj.ForgeDense(
    16,
    optimizer=OPT,
    implementation="xla",
    kernel_init=nn.with_partitioning(INIT, ("data", None)),
    input_partitioning=(None, None, None),
    name="idle",
  )
  x = jax.random.normal(jax.random.key(1), (4, 8, 16))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    variables = parallel.init_sharded(net.init, mesh, jax.random.key(0), x)
    loss = lambda v: jnp.sum(net.apply(v, x) ** 2)
    with jax.set_mesh(mesh):
      got = jax.jit(jax.grad(loss))(variables)
      got = jax.jit(jax.grad(loss))({**variables, COLL: got[COLL]})
  found = [
    w for w in caught if issubclass(w.category, parallel.ShardingWarning)
  ]
  assert len(found) == 1 and "'data'" in str(found[0].message), found
  single = parallel.strip_boxes(net.init(jax.random.key(0), x))
  want = jax.grad(loss)(single)
  want = jax.grad(loss)({**single, COLL: want[COLL]})
  _assert_trees_close(_host(got[COLL]), _host(want[COLL]))
  assert got[COLL]["kernel"].sharding.is_equivalent_to(
    NamedSharding(mesh, P("data", None)), 2
  )


@needs_devices
@pytest.mark.parametrize(
  "kernel_names,output_partitioning",
  [(("data", None), None), ((None, "data"), ("data", None, None))],
  ids=["gather-k", "gather-n"],
)
def test_fsdp_under_explicit_axes_from_the_input_types(
  kernel_names, output_partitioning
):
  """On an Explicit mesh the input's type says its batch is sharded over
  'data', and the kernel's partitioning says it is too: FSDP, exact. A
  declared output (FSDP over N) initializes with init_sharded, whose Auto
  copy of the mesh does not know the input's sharding."""
  mesh = jax.make_mesh(
    (4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
  )
  net = fj.ForgeDense(
    16,
    optimizer=OPT,
    implementation="xla",
    kernel_init=nn.with_partitioning(INIT, kernel_names),
    output_partitioning=output_partitioning,
  )
  x = jax.random.normal(jax.random.key(1), (8, 4, 16))
  loss = lambda v, x: jnp.sum(net.apply(v, x) ** 2)
  variables = parallel.init_sharded(net.init, mesh, jax.random.key(0), x)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = jax.jit(jax.grad(loss))(variables, xs)
  want = jax.grad(loss)(parallel.strip_boxes(net.init(jax.random.key(0), x)), x)
  _assert_trees_close(_host(got[COLL]), _host(want[COLL]))
  assert jax.typeof(got[COLL]["opt_state"].mu).sharding.spec == P(*kernel_names)


class _FsdpBlock(nn.Module):
  """A Dense and a DenseGeneral, FORGE's with their embedding dimension
  over 'data', or flax's."""

  forge: bool

  @nn.compact
  def __call__(self, x, _=None):
    if self.forge:
      sgd = fj.sgd(learning_rate=5e-2)
      part = lambda *names: nn.with_partitioning(INIT, names)
      tokens = ("data", None)
      dense = fj.ForgeDense(
        16,
        optimizer=sgd,
        kernel_init=part("data", None),
        input_partitioning=tokens,
      )
      general = fj.ForgeDenseGeneral(
        (2, 8),
        optimizer=sgd,
        kernel_init=part("data", None, None),
        input_partitioning=tokens,
      )
    else:
      dense = nn.Dense(16, kernel_init=INIT)
      general = nn.DenseGeneral((2, 8), kernel_init=INIT)
    return jnp.tanh(general(jnp.tanh(dense(x)))).reshape(x.shape), None


class _ScannedFsdp(nn.Module):
  """Two blocks under ``fj.scan`` (FORGE) or ``nn.scan`` (flax)."""

  forge: bool
  layer_axis: object = None

  @nn.compact
  def __call__(self, x):
    stack = (fj.scan if self.forge else nn.scan)(
      _FsdpBlock,
      variable_axes={True: 0} if self.forge else {"params": 0},
      split_rngs={"params": True},
      length=2,
      metadata_params={nn.PARTITION_NAME: self.layer_axis},
    )
    return stack(self.forge, name="stack")(x)[0]


@needs_devices
def test_scan_on_an_explicit_mesh_steps_every_layer():
  """fj.scan under FSDP on an Explicit mesh equals nn.scan + optax: each
  layer reads the stacks it is given, so the reverse loop keeps the updates
  of the layers after it; stacks laid out otherwise are refused."""
  import optax  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh(
    (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
  )
  x = jax.random.normal(jax.random.key(1), (4, 16))
  y = jax.random.normal(jax.random.key(2), (4, 16))
  forge, flax_net = _ScannedFsdp(True), _ScannedFsdp(False)
  variables = parallel.init_sharded(forge.init, mesh, jax.random.key(0), x)
  params = fj.to_dense(_host(variables))
  tx = fj.sgd(learning_rate=5e-2).to_optax()
  state = fj.TrainState.create(apply_fn=forge.apply, params=variables, tx=tx)
  opt_state = tx.init(params)

  def step(state, x, y):
    grads = jax.grad(_mse)(state.params, state.apply_fn, (x, y))
    return state.apply_gradients(grads=grads)

  def flax_step(params, opt_state):
    grads = jax.grad(_mse)(params, flax_net.apply, (x, y))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with jax.set_mesh(mesh):
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    for _ in range(STEPS):
      state = jax.jit(step)(state, xs, ys)
      params, opt_state = jax.jit(flax_step)(params, opt_state)
    _assert_trees_close(fj.to_dense(_host(state.params)), _host(params))
    replicated = jax.tree.map(
      lambda a: jax.device_put(a, NamedSharding(mesh, P())), state
    )
    with pytest.raises(ValueError, match="lay the stacks out"):
      jax.jit(step)(replicated, xs, ys)


@needs_devices
def test_scan_with_its_layer_axis_sharded_is_refused():
  """fj.scan's layers read their entry of the whole stacks: stacks whose
  layer axis is sharded over a mesh axis would be all-gathered, states
  included, in every layer; refused naming the axis."""
  devices = np.array(jax.devices()[:4]).reshape(2, 2)
  mesh = jax.sharding.Mesh(
    devices, ("layers", "data"), axis_types=(AxisType.Auto,) * 2
  )
  x = jax.random.normal(jax.random.key(1), (4, 16))
  net = _ScannedFsdp(True, layer_axis="layers")
  variables = parallel.init_sharded(net.init, mesh, jax.random.key(0), x)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="layer axis over mesh axis 'layers'"):
      jax.jit(jax.grad(lambda v: jnp.sum(net.apply(v, xs) ** 2)))(variables)


@needs_devices
@SLOW
def test_triton_kernel_layers_around_fsdp():
  """implementation='triton' (interpret mode): FSDP layers apply the XLA
  rule after the reduce-scatter; the result equals the 'xla' run."""
  mesh = _mesh(2, 2)
  batches = _regression_batches()
  tx = OPT.to_optax()
  runs = {
    impl: _train(FSDPNet(implementation=impl), batches, tx, mesh)
    for impl in ("xla", "triton")
  }
  _assert_trees_close(runs["triton"].params, runs["xla"].params, rtol=1e-6)


@needs_devices
@pytest.mark.parametrize(
  "clip",
  # Both sum the same sharded squares; delayed clipping's step is
  # test_clipping.py's.
  ["exact", pytest.param("delayed", marks=SLOW)],
)
def test_fsdp_clipping_and_norm_equal_one_device(clip):
  """Under FSDP (DP = 4 x TP = 2) each layer's norm is summed from its
  reduce-scattered shards (in the norm-only pass and in the blocked update):
  the reported global norm and the clipped steps equal one device's."""
  batches = _regression_batches()

  def run(mesh):
    model = FSDPNet()
    x0 = batches[0][0]
    variables = parallel.strip_boxes(jax.jit(model.init)(jax.random.key(0), x0))
    if mesh is not None:
      with jax.set_mesh(mesh):
        abstract = jax.eval_shape(model.init, jax.random.key(0), x0)
      specs = parallel.partition_specs(abstract)
      variables = jax.tree.map(
        lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), variables, specs
      )
    state = fj.TrainState.create(
      apply_fn=model.apply,
      params=variables,
      tx=OPT.to_optax(),
      max_grad_norm=0.5,
      clip=clip,
    )

    @jax.jit
    def step(state, batch):
      loss = lambda v: _mse(v, state.apply_fn, batch)
      _, grads = state.value_and_grad(loss)(state.params)
      return state.apply_gradients(grads=grads)

    norms = []
    for batch in batches:
      if mesh is not None:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      state = step(state, batch)
      norms.append(float(state.grad_norm))
    return _host(state.params), norms

  single, single_norms = run(None)
  mesh = _mesh(4, 2)
  with jax.set_mesh(mesh):
    sharded, sharded_norms = run(mesh)
  assert min(single_norms) > 0.5  # clipping acts on every step
  np.testing.assert_allclose(sharded_norms, single_norms, rtol=RTOL)
  _assert_trees_close(sharded, single, what=f"FSDP clip={clip}")


class DenseGeneralNet(nn.Module):
  """Attention-shaped ForgeDenseGeneral projections under FSDP x TP: the
  query ``[embed, heads, head_dim]`` with embed over 'data' and heads over
  'model', the output ``[heads, head_dim, embed]`` the other way round."""

  @nn.compact
  def __call__(self, x):
    dense = lambda features, names, **kw: fj.ForgeDenseGeneral(
      features,
      optimizer=OPT,
      implementation="xla",
      kernel_init=nn.with_partitioning(INIT, names),
      **kw,
    )
    h = dense(
      (4, 8),
      ("data", "model", None),
      input_partitioning=("data", None, None),
      output_partitioning=("data", None, "model", None),
      name="query",
    )(x)
    return dense(
      16,
      ("model", None, "data"),
      axis=(-2, -1),
      input_partitioning=("data", None, "model", None),
      output_partitioning=("data", None, None),
      name="out",
    )(jnp.tanh(h))


@needs_devices
def test_fsdp_dense_general_matches_one_device():
  batches = _regression_batches()
  forge = _train(DenseGeneralNet(), batches, OPT.to_optax(), _mesh(4, 2))
  single = _train(DenseGeneralNet(), batches, OPT.to_optax())
  _assert_trees_close(forge.params, single.params, what="DenseGeneral FSDP")
  # The kernels stay sharded over 'data' (FSDP).
  for name in ("query", "out"):
    assert "data" in str(forge.shardings[COLL][name]["kernel"].spec), name
