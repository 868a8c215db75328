"""Flash attention's block bookkeeping: which block pairs see each other whole (and skip the
mask in the GPU kernels), checked against the token-level rule."""

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


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t, s, bq, bk", [(64, 64, 8, 16), (64, 64, 16, 8), (32, 96, 8, 32)])
def test_full_visibility_is_exactly_every_token_pair(causal, t, s, bq, bk):
  rng = np.random.default_rng([t, s, bq, bk, causal])
  kinds = set()
  for _ in range(8):
    meta = _metadata(rng, 4, t, s)
    got = np.asarray(reference.block_full_visibility(meta, bq=bq, bk=bk, causal=causal))
    vis = np.asarray(
      reference.visible(
        meta.q_segment_ids_bt[:, :, None],
        meta.q_positions_bt[:, :, None],
        meta.kv_segment_ids_bs[:, None, :],
        meta.kv_positions_bs[:, None, :],
        causal=causal,
      )
    )
    b = vis.shape[0]
    want = vis.reshape(b, t // bq, bq, s // bk, bk).all(axis=(2, 4))
    np.testing.assert_array_equal(got, want)
    kinds |= set(want.ravel().tolist())
  assert kinds == {True, False}  # both kinds of block pair occurred


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
