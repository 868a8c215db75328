"""Flash attention's block bookkeeping, with and without a sliding window: which block pairs
may see each other (the rest are skipped) and which see each other whole (and skip the mask in
the GPU kernels), checked against the token-level rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.kernels.flash_attention import BlockSizes, flash_attention, reference
from jaxrl.kernels.flash_attention import pallas_gpu as gpu_kernel


def _metadata(rng, b: int, t: int, s: int) -> reference.Metadata:
  """Rows of packed segments of random lengths (ids in order, or every other id), some ending
  in padding; the queries are the last t keys (after a cache when s > t), in some rows at
  later positions."""
  q_seg, q_pos, kv_seg, kv_pos = [], [], [], []
  for row in range(b):
    seg, pos = [], []
    sid = 0
    while len(seg) < s:
      n = int(rng.integers(1, s))
      seg += [sid] * n
      pos += list(range(n))
      sid += 1 if row % 2 == 0 else 2
    seg, pos = np.array(seg[:s]), np.array(pos[:s])
    pad = int(rng.integers(0, s // 4))
    if pad:
      seg[-pad:] = -1
      pos[-pad:] = 0
    kv_seg.append(seg)
    kv_pos.append(pos)
    q_seg.append(seg[s - t :])
    # Queries further on than their keys in most rows, so that a key block's last position
    # and a query block's first meet at every offset, not only at whole blocks.
    q_pos.append(pos[s - t :] + int(rng.integers(0, 32)))
  return reference.Metadata(
    *(jnp.asarray(np.stack(x), jnp.int32) for x in (q_seg, kv_seg, q_pos, kv_pos))
  )


def _plain_metadata(b: int, t: int, s: int) -> reference.Metadata:
  """Rows of one sequence without padding: keys at positions `arange(s)`, the queries the
  last t of them, in row r moved on by 8 r positions."""
  kv_pos = np.broadcast_to(np.arange(s), (b, s))
  q_pos = np.arange(s - t, s)[None] + 8 * np.arange(b)[:, None]
  zeros = np.zeros((b, t), np.int32), np.zeros((b, s), np.int32)
  return reference.Metadata(*(jnp.asarray(x, jnp.int32) for x in (*zeros, q_pos, kv_pos)))


def _token_visibility(meta: reference.Metadata, causal: bool, window) -> np.ndarray:
  """bool `[b, t, s]`: the rule, token by token."""
  return np.asarray(
    reference.visible(
      meta.q_segment_ids_bt[:, :, None],
      meta.q_positions_bt[:, :, None],
      meta.kv_segment_ids_bs[:, None, :],
      meta.kv_positions_bs[:, None, :],
      causal=causal,
      window=window,
    )
  )


def _blocks(x_bts: np.ndarray, bq: int, bk: int) -> np.ndarray:
  """`[b, t, s]` -> `[b, n, bq, m, bk]`."""
  b, t, s = x_bts.shape
  return x_bts.reshape(b, t // bq, bq, s // bk, bk)


# (causal, window): without a window; with one inside a block and one across several blocks.
RULES = [(False, None), (True, None), (True, 5), (True, 48)]
SHAPES = [(64, 64, 8, 16), (64, 64, 16, 8), (32, 96, 8, 32)]


@pytest.mark.parametrize("causal, window", RULES)
@pytest.mark.parametrize("t, s, bq, bk", SHAPES)
def test_full_visibility_is_exactly_every_token_pair(causal, window, t, s, bq, bk):
  rng = np.random.default_rng([t, s, bq, bk, causal, *([window] if window else [])])
  kinds = set()
  for _ in range(8):
    meta = _metadata(rng, 4, t, s)
    got = reference.block_full_visibility(meta, bq=bq, bk=bk, causal=causal, window=window)
    want = _blocks(_token_visibility(meta, causal, window), bq, bk).all(axis=(2, 4))
    np.testing.assert_array_equal(np.asarray(got), want)
    kinds |= set(want.ravel().tolist())
  # Both kinds of block pair occurred, where a window can hold a whole pair.
  assert kinds == ({True, False} if window is None or window >= bq + bk else {False})


@pytest.mark.parametrize("causal, window", RULES)
@pytest.mark.parametrize("t, s, bq, bk", SHAPES)
def test_block_visibility_drops_only_pairs_that_see_nothing(causal, window, t, s, bq, bk):
  """Conservative on packed rows; exact on rows of one sequence (the per-block summaries then
  describe every token pair), where a window drops pairs that causality alone keeps."""
  rng = np.random.default_rng([t, s, bq, bk, causal, *([window] if window else [])])
  for _ in range(8):
    meta = _metadata(rng, 4, t, s)
    got = np.asarray(reference.block_visibility(meta, bq=bq, bk=bk, causal=causal, window=window))
    sees = _blocks(_token_visibility(meta, causal, window), bq, bk).any(axis=(2, 4))
    assert not (sees & ~got).any()
  plain = _plain_metadata(4, t, s)
  got = np.asarray(reference.block_visibility(plain, bq=bq, bk=bk, causal=causal, window=window))
  sees = _blocks(_token_visibility(plain, causal, window), bq, bk).any(axis=(2, 4))
  np.testing.assert_array_equal(got, sees)
  if window is not None:
    assert (np.asarray(reference.block_visibility(plain, bq=bq, bk=bk, causal=True)) & ~got).any()


@pytest.mark.parametrize("window", [None, 5, 48])
def test_gpu_walks_visit_every_pair_that_sees_and_skip_the_mask_only_on_whole_ones(window):
  """The GPU kernels' walks on packed rows, by query block and by key block: every block pair
  that sees lies in `[lo, hi)`, and every pair of the run `[first, end)` visited without a
  mask sees whole (a window's far edge is a second place where a run can end)."""
  rng = np.random.default_rng([11, window or 0])
  runs = 0
  for t, s, bq, bk in SHAPES:
    meta = _metadata(rng, 4, t, s)
    vis = _blocks(_token_visibility(meta, True, window), bq, bk)
    by_query, by_key = gpu_kernel._walks(meta, bq, bk, True, window)
    for walk, sees, whole in (
      (by_query, vis.any(axis=(2, 4)), vis.all(axis=(2, 4))),
      (by_key, vis.any(axis=(2, 4)).swapaxes(1, 2), vis.all(axis=(2, 4)).swapaxes(1, 2)),
    ):
      lo, hi, first, end = (np.asarray(x).reshape(sees.shape[:2])[..., None] for x in walk)
      blocks = np.arange(sees.shape[-1])
      assert not (sees & ((blocks < lo) | (blocks >= hi))).any()
      assert whole[(blocks >= first) & (blocks < end)].all()
      runs += int(np.sum(end > first))
  # Unmasked runs occurred, except where the window cannot hold a pair of blocks whole.
  assert (runs > 0) == (window != 5)


def test_full_block_run_is_the_first_run_inside_the_range():
  rng = np.random.default_rng(7)
  full = rng.random((200, 12)) < 0.6
  lo = rng.integers(0, 12, 200)
  hi = np.minimum(lo + rng.integers(0, 12, 200), 12)
  first, end = (
    np.asarray(x)
    for x in reference.full_block_run(jnp.asarray(full), jnp.asarray(lo), jnp.asarray(hi))
  )
  for i in range(200):
    inside = [j for j in range(lo[i], hi[i]) if full[i, j]]
    assert lo[i] <= first[i] <= end[i] <= hi[i]
    if not inside:
      assert first[i] == end[i] == hi[i]
      continue
    assert first[i] == inside[0]
    assert full[i, first[i] : end[i]].all()
    assert end[i] == hi[i] or not full[i, end[i]]


@pytest.mark.parametrize("setting", ["mask_every_block", "natural_exp"])
def test_gpu_kernel_a_b_settings_give_the_same_results(setting):
  """The GPU kernels (interpreted) with and without each of their timing A/B settings,
  forward and backward, on packed rows where all three parts of a walk (masked, full, masked)
  occur. `mask_every_block`: on a pair that sees itself whole the mask selects every score, so
  skipping it changes the same sums only by how XLA compiles the two loop bodies (rounding).
  `natural_exp`: exp(x ln 2) for exp2(x), the same numbers to rounding."""
  rng = np.random.default_rng(11)
  b, t, h, k, e = 2, 128, 2, 1, 32
  meta = _metadata(rng, b, t, t)
  blocks = BlockSizes(block_q=16, block_kv=32, block_q_bwd=32, block_kv_bwd=16)
  for bq, bk in ((16, 32), (32, 16)):
    padded = reference.pad_metadata(meta, t, t)
    for which, walks in zip(("key", "query"), gpu_kernel._walks(padded, bq, bk, True), strict=True):
      lo, hi, first, end = (np.asarray(x) for x in walks)
      run = end > first
      assert (run & (first > lo)).any() and (run & (hi > end)).any(), which
  q = jnp.asarray(rng.standard_normal((b, t, h, e)), jnp.float32)
  kv = [jnp.asarray(rng.standard_normal((b, t, k, e)), jnp.float32) for _ in range(2)]
  cot = jnp.asarray(rng.standard_normal((b, t, h, e)), jnp.float32)

  def outputs():
    def loss(q, k, v):
      out = flash_attention(
        q, k, v, q_segment_ids=meta.q_segment_ids_bt, q_positions=meta.q_positions_bt,
        impl="pallas_gpu", block_sizes=blocks, interpret=True,
      )  # fmt: skip
      return jnp.sum(out * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, *kv)
    return [np.asarray(x) for x in (out, *grads)]

  shipped = outputs()
  with getattr(gpu_kernel, setting)():
    baseline = outputs()
  for name, got, want in zip(("out", "dq", "dk", "dv"), shipped, baseline, strict=True):
    # Scores sum e terms, outputs and gradients t more; a key wrongly seen moves an output
    # by its probability, orders of magnitude more.
    tolerance.assert_close(got, want, n=4 * (e + t), err_msg=name)
