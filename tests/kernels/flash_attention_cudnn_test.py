"""`flash_attention(impl="cudnn")`: the packed layout built from segment ids, the choice between
cuDNN and the Pallas kernel, padding selected away, the remat policy, errors; on a CPU through
an emulation of cuDNN (`helpers.cudnn_emulator`: what jax's wrapper and cuDNN document), and on
a GPU through cuDNN itself (`-m gpu`).

Shapes: b batch, t tokens, h query heads, k kv heads, e head dim, m segment slots.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cudnn_emulator

from jaxrl.kernels.flash_attention import BlockSizes, cudnn, flash_attention, save_attention_policy
from jaxrl.kernels.flash_attention import api as flash_api

from .flash_attention_test import (  # noqa: TID252
  _assert_matches,
  _make_inputs,
  _oracle,
  _outputs,
  _rng,
)


def _runs_row(t: int, runs, ids=None):
  """(segment ids, positions) of a row of `t` tokens holding the `(first, end)` runs (ids 0,
  1, ... unless given), padding elsewhere; positions restart at 0 in each run."""
  seg, pos = np.full(t, -1, np.int32), np.zeros(t, np.int32)
  for n, (first, end) in enumerate(runs):
    seg[first:end] = n if ids is None else ids[n]
    pos[first:end] = np.arange(end - first)
  return seg, pos


def _batch(t: int, rows):
  seg, pos = zip(*(_runs_row(t, *row) for row in rows), strict=True)
  return jnp.asarray(np.stack(seg)), jnp.asarray(np.stack(pos))


def _layout(seg, pos, *, kv_seg=None, kv_pos=None, max_segments=4, causal=True):
  return cudnn.packed_layout(
    seg,
    seg if kv_seg is None else kv_seg,
    pos,
    pos if kv_pos is None else kv_pos,
    max_segments=max_segments,
    causal=causal,
  )


def test_packed_layout_gives_each_segments_first_token_and_length():
  rng = np.random.default_rng(0)
  t, m = 64, 6
  rows, want_offsets, want_lengths = [], [], []
  for runs_in_row in (1, 3, 6, 4):
    cuts = np.sort(rng.choice(np.arange(1, t), 2 * runs_in_row - 1, replace=False))
    bounds = [0, *cuts.tolist()]  # run n is [bounds[2n], bounds[2n+1]); padding between
    runs = [(bounds[2 * n], bounds[2 * n + 1]) for n in range(runs_in_row - 1)]
    runs.append((bounds[-1], t) if runs_in_row > 1 else (5, t - 7))
    rows.append((runs,))
    firsts = [first for first, _ in runs]
    want_offsets.append(firsts + [-1] * (m + 1 - len(runs)))
    want_lengths.append([end - first for first, end in runs] + [-1] * (m - len(runs)))
  seg, pos = _batch(t, rows)
  layout = _layout(seg, pos, max_segments=m)
  assert bool(layout.servable)
  np.testing.assert_array_equal(layout.offsets_bm, want_offsets)
  np.testing.assert_array_equal(layout.seqlen_bm, want_lengths)
  np.testing.assert_array_equal(layout.in_segment_bt, seg >= 0)


def test_jax_turns_the_layout_into_each_segments_span_of_the_batch():
  """jax's private wrapper rewrites the per-row layout into cuDNN's (lengths of the batch's
  segments in order; offsets into the flattened `[b * t, heads * e]` tokens, then the end):
  run on the layout, that gives every segment's global span, and nothing for padding or for a
  row of padding only."""
  t, heads, e = 20, 2, 8
  seg, pos = _batch(t, [([(0, 5), (5, 12), (14, 20)],), ([(2, 9)],), ([],)])
  layout = _layout(seg, pos, max_segments=4)
  q = jnp.zeros((3, t, heads, e), jnp.bfloat16)
  lengths, _, offsets, _ = cudnn._cudnn._fix_seqlen_offsets(
    layout.seqlen_bm, layout.seqlen_bm, layout.offsets_bm, layout.offsets_bm, q, q
  )
  lengths, offsets = np.ravel(lengths), np.ravel(offsets)
  spans = [(0, 5), (5, 12), (14, 20), (t + 2, t + 9)]  # tokens of the flattened batch
  np.testing.assert_array_equal(lengths[:4], [end - first for first, end in spans])
  np.testing.assert_array_equal(lengths[4:], 0)
  np.testing.assert_array_equal(offsets[:4], [first * heads * e for first, _ in spans])
  np.testing.assert_array_equal(offsets[4:], 3 * t * heads * e)


@pytest.mark.parametrize(
  "case, servable",
  [
    ("packed", True),
    ("an id after padding again", False),  # one segment in two runs: cuDNN sees two
    ("ids not increasing", False),
    ("positions repeat", False),  # causal by position is not causal by token
    ("positions repeat, not causal", True),
    ("too many segments", False),
    ("as many segments as slots", True),
    ("kv ids differ", False),
    ("kv positions differ", False),
  ],
)
def test_packed_layout_serves_only_what_cudnn_computes_alike(case, servable):
  t = 16
  seg, pos = _batch(t, [([(0, 4), (4, 9), (10, 16)],)])
  kwargs = {"max_segments": 4}
  if case == "an id after padding again":
    seg, pos = _batch(t, [([(0, 4), (4, 9), (10, 16)], [0, 1, 1])])
  elif case == "ids not increasing":
    seg, pos = _batch(t, [([(0, 4), (4, 9), (10, 16)], [0, 2, 1])])
  elif case.startswith("positions repeat"):
    pos = pos.at[0, 6].set(pos[0, 5])
    kwargs["causal"] = case == "positions repeat"
  elif case == "too many segments":
    kwargs["max_segments"] = 2
  elif case == "as many segments as slots":
    kwargs["max_segments"] = 3
  elif case == "kv ids differ":
    kwargs["kv_seg"] = seg.at[0, 9].set(1)
  elif case == "kv positions differ":
    kwargs["kv_pos"] = pos + 1
  assert bool(_layout(seg, pos, **kwargs).servable) is servable


@pytest.fixture
def stand_in(monkeypatch):
  """`stand_in(fn)` puts `fn` where jax's cuDNN attention is, and admits float32 (the stand-ins
  compute in float32). `_run_cudnn`'s trace cache does not know of the swap: it is cleared
  around it (only it, so that other tests' compilations stay cached)."""

  def swap(fn):
    flash_api._run_cudnn.clear_cache()
    monkeypatch.setattr(cudnn._cudnn, "dot_product_attention", fn)
    monkeypatch.setattr(cudnn, "_DTYPES", (*cudnn._DTYPES, "float32"))

  yield swap
  flash_api._run_cudnn.clear_cache()


def _sorted_packed(b: int, t: int):
  """Rows as `jaxrl.train.packing` lays them out: 3 runs then padding; 2 runs with padding
  between them; one run; 5 short runs."""
  rows = [
    ([(0, t // 4), (t // 4, t // 2), (t // 2, t - 5)],),
    ([(0, t // 3), (t // 3 + 2, t)],),
    ([(0, t)],),
    ([(n * t // 5, (n + 1) * t // 5) for n in range(5)],),
  ]
  seg, pos = _batch(t, (rows * b)[:b])
  return seg, seg, pos, pos


CASES = {
  # (layout, max_segments, cuDNN serves it)
  "packed": ("sorted", 8, True),
  "packed, a row over max_segments": ("sorted", 4, False),
  "packed, ids unsorted (Pallas kernel)": ("unsorted", 8, False),
  "one sequence a row, positions given": ("positions", 8, True),
  "one sequence a row": ("none", 8, True),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_the_oracle_through_emulated_cudnn(stand_in, case):
  """Output and gradients are the rule's (float64 oracle), padding included (zeros: the
  emulation leaves NaN there), whichever of cuDNN and the fallback kernel runs."""
  stand_in(cudnn_emulator.dot_product_attention)
  layout, max_segments, _ = CASES[case]
  b, t, h, k, e = 4, 40, 4, 2, 16
  rng = _rng("cudnn", case)
  qkv, ids, cot = _make_inputs(
    rng, b=b, t=t, s=t, h=h, k=k, e=e, dtype=jnp.float32, layout="packed"
  )  # the "packed" layout of flash_attention_test: a row with unsorted ids
  if layout == "sorted":
    ids = _sorted_packed(b, t)
  given = ids
  if layout in ("positions", "none"):
    arange = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ids = (jnp.zeros((b, t), jnp.int32),) * 2 + (arange, arange)
    given = (None, None, arange, arange) if layout == "positions" else (None,) * 4
  got = _outputs(
    qkv, given, cot, impl="cudnn", interpret=True, block_sizes=BlockSizes(max_segments=max_segments)
  )
  oracle = _oracle(qkv, ids, cot)
  _assert_matches(got, oracle[0], oracle, jnp.float32, exact=True)


@pytest.mark.parametrize("given", ["kv ids", "kv positions", "q ids and kv positions"])
def test_ids_given_on_one_side_take_the_packages_defaults(stand_in, given):
  """Ids or positions given for one side only: the other side takes `flash_attention`'s
  defaults (query ids 0, query positions `arange`), as the reference does, not the given side's."""
  stand_in(cudnn_emulator.dot_product_attention)
  b, t = 2, 40
  qkv, _, _ = _make_inputs(
    _rng("one side", given), b=b, t=t, s=t, h=4, k=2, e=16, dtype=jnp.float32, layout="packed"
  )
  seg, pos = _sorted_packed(b, t)[::2]
  kwargs = {
    "kv ids": {"kv_segment_ids": seg},
    "kv positions": {"kv_positions": pos},
    "q ids and kv positions": {"q_segment_ids": seg, "kv_positions": pos},
  }[given]
  got = flash_attention(*qkv, impl="cudnn", interpret=True, **kwargs)
  want = flash_attention(*qkv, impl="reference", **kwargs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_cudnn_runs_exactly_where_it_serves(stand_in, case):
  """A stand-in for cuDNN that returns 7 everywhere shows which branch ran: 7 at every token
  of a segment where cuDNN serves the batch, the Pallas kernel's output where it does not."""
  stand_in(lambda q, *args, **kwargs: jnp.full_like(q, 7.0))
  layout, max_segments, serves = CASES[case]
  b, t = 4, 40
  qkv, ids, _ = _make_inputs(
    _rng("branch", case), b=b, t=t, s=t, h=4, k=2, e=16, dtype=jnp.float32, layout="packed"
  )
  if layout == "sorted":
    ids = _sorted_packed(b, t)
  elif layout in ("positions", "none"):
    arange = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ids = (None, None, arange, arange) if layout == "positions" else (None,) * 4
  q_seg, kv_seg, q_pos, kv_pos = ids
  out = flash_attention(
    *qkv, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos, kv_positions=kv_pos,
    impl="cudnn", interpret=True, block_sizes=BlockSizes(max_segments=max_segments),
  )  # fmt: skip
  in_segment = np.ones((b, t), bool) if q_seg is None else np.asarray(q_seg) >= 0
  sevens = np.all(np.asarray(out) == 7.0, axis=(2, 3))
  assert sevens[in_segment].all() == serves
  assert not sevens[in_segment].any() or serves
  np.testing.assert_array_equal(np.asarray(out)[~in_segment], 0.0)


@pytest.mark.parametrize(
  "rule",
  [{"sliding_window": 6}, {"logit_softcap": 1.0}, {"sliding_window": 6, "logit_softcap": 1.0}],
)
def test_a_sliding_window_or_a_softcap_runs_the_pallas_kernel(stand_in, rule):
  """With a window or a logit softcap, impl="cudnn" runs its fallback, the Pallas GPU kernel,
  even for a batch cuDNN would serve (the stand-in's 7s appear nowhere), and gives the output
  of the rule with them."""
  stand_in(lambda q, *args, **kwargs: jnp.full_like(q, 7.0))
  b, t = 2, 40
  qkv, _, _ = _make_inputs(
    _rng("cudnn window"), b=b, t=t, s=t, h=4, k=2, e=16, dtype=jnp.float32, layout="packed"
  )
  seg, _, pos, _ = _sorted_packed(b, t)
  kwargs = {"q_segment_ids": seg, "q_positions": pos, **rule}
  got = flash_attention(*qkv, impl="cudnn", interpret=True, **kwargs)
  assert not np.any(np.asarray(got) == 7.0)
  want = flash_attention(*qkv, impl="reference", **kwargs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- remat

_REMAT = ("checkpoint", "remat2", "remat")


def _recomputed_forwards(jaxpr, *, inside=False) -> int:
  """cuDNN forward calls inside a `jax.checkpoint` (what the backward pass runs again)."""
  total = 0
  for eqn in jaxpr.eqns:
    in_remat = inside or eqn.primitive.name in _REMAT
    total += in_remat and eqn.primitive.name in cudnn.CUDNN_FORWARD_PRIMITIVES
    for sub in jax.core.jaxprs_in_params(eqn.params):
      total += _recomputed_forwards(sub, inside=in_remat)
  return total


@pytest.mark.parametrize("policy, recomputed", [(None, 1), (save_attention_policy, 0)])
def test_save_attention_policy_keeps_the_cudnn_forward(monkeypatch, policy, recomputed):
  """jax's cuDNN attention traced (not run: its version and GPU checks stubbed) inside a
  rematerialised block: without a policy the backward runs its forward again, under
  `save_attention_policy` it keeps the forward's outputs."""
  flash_api._run_cudnn.clear_cache()  # traces of other tests' stand-ins
  monkeypatch.setattr(cudnn._cudnn, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn._cudnn, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(cudnn._cudnn, "is_cuda_compute_capability_equal", lambda c: False)
  b, t = 1, 32
  q = jnp.ones((b, t, 4, 16), jnp.bfloat16)
  kv = jnp.ones((b, t, 2, 16), jnp.bfloat16)
  seg, pos = _batch(t, [([(0, 10), (10, 30)],)])

  def block(q, k, v):
    out = flash_attention(q, k, v, q_segment_ids=seg, q_positions=pos, impl="cudnn")
    return jnp.sin(out.astype(jnp.float32))

  remat = jax.checkpoint(block, policy=policy)
  grads = jax.grad(lambda *qkv: jnp.sum(remat(*qkv)), argnums=(0, 1, 2))
  assert _recomputed_forwards(jax.make_jaxpr(grads)(q, kv, kv).jaxpr) == recomputed


# ----------------------------------------------------------------------------- errors


def test_errors():
  q = jnp.ones((1, 16, 4, 16), jnp.bfloat16)
  kv = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="bfloat16 or float16 inputs, got float32"):
    flash_attention(
      q.astype(jnp.float32), kv.astype(jnp.float32), kv.astype(jnp.float32), impl="cudnn"
    )
  with pytest.raises(ValueError, match="q_len == kv_len"):
    flash_attention(
      q[:, :8],
      kv,
      kv,
      impl="cudnn",
      q_positions=jnp.zeros((1, 8), jnp.int32),
      kv_positions=jnp.zeros((1, 16), jnp.int32),
    )
  odd = jnp.ones((1, 16, 2, 12), jnp.bfloat16)
  with pytest.raises(ValueError, match="head_dim a multiple of 8"):
    flash_attention(odd, odd, odd, impl="cudnn")
  with pytest.raises(ValueError, match="max_segments must be >= 2"):
    flash_attention(q, kv, kv, impl="cudnn", block_sizes=BlockSizes(max_segments=1))
  with pytest.raises(ValueError, match="applies to impl='cudnn' only"):
    flash_attention(q, kv, kv, impl="reference", block_sizes=BlockSizes(max_segments=4))
  with pytest.raises(ValueError, match="expected one of .*'cudnn'"):
    flash_attention(q, kv, kv, impl="cuDNN")


def test_without_cudnn_the_error_says_what_to_use():
  """On this CPU jax has no cuDNN: the call fails with what to use instead."""
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU backend has cuDNN")
  q = jnp.ones((1, 16, 4, 16), jnp.bfloat16)
  kv = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="use impl='pallas_gpu'"):
    flash_attention(q, kv, kv, impl="cudnn", interpret=True)


# ----------------------------------------------------------------------------- on a GPU

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("layout", ["sorted", "unsorted"])
def test_gpu_cudnn_matches_oracle(layout):
  """cuDNN itself (compiled, Hopper or later for packed rows) on Qwen3-0.6B's heads: packed
  rows laid out as packing does ("sorted": cuDNN runs), and a batch with a row of unsorted ids
  (the Pallas kernel runs), against the float64 oracle at bf16's tolerance."""
  b, t = 4, 512
  qkv, ids, cot = _make_inputs(
    _rng("gpu cudnn", layout), b=b, t=t, s=t, h=16, k=8, e=128, dtype=jnp.bfloat16,
    layout="packed",
  )  # fmt: skip
  if layout == "sorted":
    ids = _sorted_packed(b, t)
  got = _outputs(qkv, ids, cot, impl="cudnn")
  oracle = _oracle(qkv, ids, cot)
  _assert_matches(got, oracle[0], oracle, jnp.bfloat16, exact=True)
