"""The Llama model, its FORGE / nn.Dense variants, the data and the main job."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from flax.training.train_state import TrainState

import forge_jax as fj
from examples.lm import data as data_lib
from examples.lm.llama import (
  CONFIGS,
  PROJECTIONS,
  apply_rope,
  kernels,
  make_model,
  rope_tables,
  stack_layers,
  unstack_layers,
)
from examples.lm.train import build_variants, make_train_step

TINY = CONFIGS["tiny"]
TINY_QK = dataclasses.replace(TINY, qk_norm=True)
OPT = fj.adamw(learning_rate=1e-2, weight_decay=0.1)
KEY = jax.random.key(0)


def _batches(n, b=2, t=16, seed=1):
  keys = jax.random.split(jax.random.key(seed), n)
  return [jax.random.randint(k, (b, t + 1), 0, TINY.vocab_size) for k in keys]


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _train(state, batches, step=None):
  step = step or make_train_step()
  losses = []
  for batch in batches:
    state, loss = step(state, batch)
    losses.append(float(loss))
  return state, losses


def _assert_kernels_close(a, b, rtol=1e-5):
  ka, kb = kernels(a), kernels(b)
  assert sorted(ka) == sorted(kb)
  for path in kb:
    assert _rel(ka[path], kb[path]) <= rtol, path


def _non_kernel_params(variables):
  """``params`` leaves other than kernels (embedding, norm scales) by path."""
  flat = traverse_util.flatten_dict(variables["params"], sep="/")
  return {k: v for k, v in flat.items() if not k.endswith("/kernel")}


def _assert_params_close(a, b, rtol=1e-5):
  pa, pb = _non_kernel_params(a), _non_kernel_params(b)
  assert sorted(pa) == sorted(pb)
  for path in pb:
    assert _rel(pa[path], pb[path]) <= rtol, path


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("variant", ["forge", "baseline"])
def test_shapes_and_param_count(variant, qk_norm):
  v = build_variants(TINY, OPT, qk_norm=qk_norm)[variant]
  tokens = _batches(1)[0][:, :-1]
  variables = v.model.init(KEY, tokens)
  logits = v.model.apply(variables, tokens)
  assert logits.shape == (2, 16, TINY.vocab_size)
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))
  n_kernels = sum(k.size for k in kernels(variables).values())
  n_params = sum(x.size for x in jax.tree.leaves(variables["params"]))
  if variant == "forge":
    assert n_kernels + n_params == v.model.config.num_params()
    forge_paths = set(
      kernels(
        {"params": {}, **{fj.FORGE_COLLECTION: variables[fj.FORGE_COLLECTION]}}
      )
    )
    assert len(forge_paths) == 7 * TINY.num_layers + 1
    assert {p.split("/")[-1] for p in forge_paths} == set(PROJECTIONS)
  else:
    assert fj.FORGE_COLLECTION not in variables
    assert n_params == v.model.config.num_params()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_variants_same_init_and_outputs(qk_norm):
  variants = build_variants(TINY, OPT, qk_norm=qk_norm)
  tokens = _batches(1)[0][:, :-1]
  vf = variants["forge"].model.init(KEY, tokens)
  vb = variants["baseline"].model.init(KEY, tokens)
  kf, kb = kernels(vf), kernels(vb)
  assert sorted(kf) == sorted(kb)
  for path in kb:
    np.testing.assert_array_equal(kf[path], kb[path], err_msg=path)
  # Everything but the kernels is in params in both variants, identically.
  pf, pb = _non_kernel_params(vf), _non_kernel_params(vb)
  assert sorted(pf) == sorted(pb)
  for path in pb:
    np.testing.assert_array_equal(pf[path], pb[path], err_msg=path)
  np.testing.assert_array_equal(
    variants["forge"].model.apply(vf, tokens),
    variants["baseline"].model.apply(vb, tokens),
  )


@functools.lru_cache(maxsize=None)
def _reference(variant, qk_norm=True):
  """3 adamw steps of the unrolled TINY model (shared by several tests).

  Returns ``(initial variables, losses, final variables)`` on the host.
  """
  batches = _batches(3)
  v = build_variants(TINY, OPT, qk_norm=qk_norm)[variant]
  state = v.init_state(KEY, batches[0])
  initial = _host(state.params)
  state, losses = _train(state, batches)
  return initial, losses, _host(state.params)


def test_forge_matches_baseline_training():
  _, lf, final_f = _reference("forge")
  init_b, lb, final_b = _reference("baseline")
  np.testing.assert_allclose(lf, lb, rtol=1e-5)
  _assert_kernels_close(final_f, final_b)
  k0 = kernels(init_b)
  for path, k in kernels(final_f).items():
    assert np.max(np.abs(k - k0[path])) > 1e-4, path
  # Embedding and norms (q/k norms too): optax in both variants.
  _assert_params_close(final_f, final_b)
  counts = [
    x
    for p, x in jax.tree_util.tree_flatten_with_path(
      final_f[fj.FORGE_COLLECTION]
    )[0]
    if getattr(p[-1], "key", None) == "count"
  ]
  assert len(counts) == 7 * TINY.num_layers + 1
  assert all(float(c) == 3.0 for c in counts)
  assert fj.wiped_layers(final_f) == []


@pytest.mark.parametrize(
  "remat", [pytest.param(False, marks=pytest.mark.slow), True]
)
def test_scan_layers_trains_and_matches_unrolled(remat):
  """nn.scan(nn.remat(Block)) with ForgeDense: every collection is stacked,
  FORGE's cotangents come back stacked, and training matches the loop.

  Without q/k norms: with them, scan and remat change XLA's summation order
  enough that 3 adamw steps differ by ~5e-5 (scan) and ~5e-4 (remat) relative
  from the unrolled loop, for nn.Dense + optax exactly as for FORGE (Adam
  turns tiny differences in near-zero gradients into lr-sized steps); the
  next test compares FORGE with the baseline in the same layout instead.
  """
  batches = _batches(3)
  init_u, lu, final_u = _reference("forge", qk_norm=False)
  scanned = build_variants(TINY, OPT, scan_layers=True, remat=remat)["forge"]

  # The layout alone: shapes, without running the initializers.
  native = jax.eval_shape(scanned.model.init, KEY, batches[0][:, :-1])
  assert jax.tree.map(jnp.shape, native) == jax.tree.map(
    jnp.shape, stack_layers(init_u)
  )
  q = native[fj.FORGE_COLLECTION]["layers"]["attn"]["q_proj"]
  assert q["kernel"].shape == (
    TINY.num_layers,
    TINY.dim,
    TINY.num_heads * TINY.head_dim,
  )
  assert q["count"].shape == (TINY.num_layers,)

  # Same weights as the unrolled reference, in the stacked layout.
  state = TrainState.create(
    apply_fn=scanned.model.apply,
    tx=scanned.tx,
    params=jax.tree.map(jnp.asarray, stack_layers(init_u)),
  )
  state, ls = _train(state, batches)
  np.testing.assert_allclose(ls, lu, rtol=1e-5)
  final = _host(unstack_layers(state.params))
  _assert_kernels_close(final, final_u)
  _assert_params_close(final, final_u)
  k0 = kernels(init_u)
  for path, k in kernels(final).items():  # every layer's kernel moved
    assert np.max(np.abs(k - k0[path])) > 1e-4, path
  stacked = state.params[fj.FORGE_COLLECTION]["layers"]
  np.testing.assert_array_equal(
    stacked["mlp"]["down_proj"]["count"], [3.0] * TINY.num_layers
  )
  assert fj.wiped_layers(state.params) == []


@functools.lru_cache(maxsize=None)
def _trained_qk(variant, **options):
  """3 adamw steps of TINY_QK built with ``build_variants`` ``options``
  (shared by several tests): ``(losses, final variables)`` on the host."""
  batches = _batches(3)
  v = build_variants(TINY_QK, OPT, **options)[variant]
  state = v.init_state(KEY, batches[0])
  state, losses = _train(state, batches)
  return losses, _host(state.params)


@pytest.mark.slow  # the scanned, remat'd model without qk-norm runs by default
def test_scan_remat_qk_norm_forge_matches_baseline():
  final = {}
  for name in ("forge", "baseline"):
    losses, params = _trained_qk(name, scan_layers=True, remat=True)
    final[name] = (losses, unstack_layers(params))
  np.testing.assert_allclose(final["forge"][0], final["baseline"][0], rtol=1e-5)
  _assert_kernels_close(final["forge"][1], final["baseline"][1])
  _assert_params_close(final["forge"][1], final["baseline"][1])


@pytest.mark.parametrize(
  "policy",
  [
    # The default run checks remat policies through fj.scan alone
    # (test_scan.py::test_policy_matches_full_remat_and_nn_scan).
    pytest.param("dots_with_no_batch_dims_saveable", marks=pytest.mark.slow),
    pytest.param("everything_saveable", marks=pytest.mark.slow),
  ],
)
def test_scan_remat_policy_matches_full_remat_and_baseline(policy):
  """fj.scan with a remat policy: the updated kernels, optimizer
  states and counts match full remat's, and training matches the nn.Dense
  baseline under nn.scan(nn.remat(Block, policy=...)).

  Saving instead of recomputing changes how XLA fuses the backward, so the
  float32 sums differ in order: ~1e-5 relative after 3 steps, as much as
  the baseline itself moves between full remat and the policy.
  """
  final = {
    "full": _trained_qk("forge", scan_layers=True, remat=True),
    "forge": _trained_qk(
      "forge", scan_layers=True, remat=True, remat_policy=policy
    ),
    "baseline": _trained_qk(
      "baseline", scan_layers=True, remat=True, remat_policy=policy
    ),
  }
  np.testing.assert_allclose(final["forge"][0], final["full"][0], rtol=1e-6)
  forge, full = final["forge"][1], final["full"][1]
  flat = jax.tree_util.tree_flatten_with_path(forge)[0]
  for (path, leaf), other in zip(flat, jax.tree.leaves(full)):
    assert _rel(leaf, other) <= 3e-5, jax.tree_util.keystr(path)
  counts = forge[fj.FORGE_COLLECTION]["layers"]["mlp"]["down_proj"]["count"]
  np.testing.assert_array_equal(counts, [3.0] * TINY.num_layers)
  np.testing.assert_allclose(final["forge"][0], final["baseline"][0], rtol=1e-5)
  _assert_kernels_close(forge, final["baseline"][1])
  _assert_params_close(forge, final["baseline"][1])


@pytest.mark.parametrize(
  "overrides, match",
  [
    (dict(remat=True, remat_policy="dots"), "must be None or one of"),
    (dict(remat_policy="dots_saveable"), "needs remat=True"),
  ],
)
def test_remat_policy_names_are_checked(overrides, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(TINY, **overrides)


@pytest.mark.slow  # nn.remat blocks train by default in test_drop_in.py
def test_remat_unrolled_matches():
  batches = _batches(3)
  init_u, lu, final_u = _reference("forge", qk_norm=False)
  v = build_variants(TINY, OPT, remat=True)["forge"]
  state = TrainState.create(
    apply_fn=v.model.apply, tx=v.tx, params=jax.tree.map(jnp.asarray, init_u)
  )
  state, lr = _train(state, batches)
  np.testing.assert_allclose(lr, lu, rtol=1e-5)
  _assert_kernels_close(_host(state.params), final_u)


def test_stack_unstack_roundtrip():
  tokens = _batches(1)[0][:, :-1]
  variables = make_model(TINY, OPT).init(KEY, tokens)
  back = unstack_layers(stack_layers(variables))
  assert jax.tree.structure(back) == jax.tree.structure(variables)
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, back, variables)))


@pytest.mark.parametrize(
  "name,expected",
  [("llama-3.1-8b", 8_030_261_248), ("qwen3-14b", 14_768_307_200)],
)
def test_large_configs_abstract(name, expected):
  config = CONFIGS[name]
  assert config.num_params() == expected
  model = make_model(config)  # baseline, scan + remat: one layer traced
  shapes = jax.eval_shape(model.init, KEY, jnp.zeros((1, 8), jnp.int32))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == expected


def test_rope_is_a_rotation():
  config = dataclasses.replace(TINY, rope_scaling=(8.0, 1.0, 4.0, 64))
  cos, sin = rope_tables(config, 16)
  x = jax.random.normal(KEY, (2, 16, 3, TINY.head_dim))
  y = apply_rope(x, cos, sin)
  np.testing.assert_allclose(
    jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
  )
  np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)  # position 0


def test_stdlib_corpus_and_batches():
  corpus = data_lib.load_stdlib_corpus(max_mb=0.5)
  again = data_lib.load_stdlib_corpus(max_mb=0.5)
  assert corpus.train.dtype == np.uint8 and corpus.valid.size > 0
  assert corpus.train.size + corpus.valid.size == 500_000
  np.testing.assert_array_equal(corpus.train, again.train)
  it = data_lib.batch_iterator(corpus.train, 4, 32, seed=3)
  b1, b2 = next(it), next(it)
  assert b1.shape == (4, 33) and b1.dtype == np.int32
  assert b1.min() >= 0 and b1.max() < data_lib.VOCAB_SIZE
  assert not np.array_equal(b1, b2)
  np.testing.assert_array_equal(
    next(data_lib.batch_iterator(corpus.train, 4, 32, seed=3)), b1
  )
  # Windows are contiguous slices of the corpus.
  text = corpus.train.tobytes()
  assert bytes(b1[0].astype(np.uint8).tolist()) in text


def test_main_job_smoke(tmp_path):
  from examples.lm import main as main_lib

  out = str(tmp_path / "run")
  summary = main_lib.main(
    [
      "--config",
      "tiny",
      "--steps",
      "4",
      "--batch-size",
      "2",
      "--seq-len",
      "32",
      "--max-mb",
      "0.5",
      "--eval-batches",
      "1",
      "--no-progress",
      "--out",
      out,
    ]
  )
  assert os.path.getsize(os.path.join(out, "loss_curves.png")) > 1000
  with open(os.path.join(out, "summary.json")) as f:
    saved = json.load(f)
  for name in ("forge", "baseline"):
    assert len(saved["losses"][name]) == 4
    assert np.all(np.isfinite(saved["losses"][name]))
    assert np.isfinite(saved["valid_loss"][name])
  assert saved["init_kernels_equal"] is True
  assert saved["max_abs_loss_diff"] < 1e-4
  assert saved["memory"]["forge"]["temp_size_in_bytes"] is not None
  assert summary["wiped_layers"] == []
