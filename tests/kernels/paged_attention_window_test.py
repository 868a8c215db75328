"""Paged attention with a sliding window: every implementation against the float64 oracle of
the rule with the slots before each window NaN, at several tilings (windows starting past the
first compute block; page tables much longer than the window, whose blocks the GPU kernel's
parts cut from the window's first), a window past every length, and pages before the window
never copied (TPU). Shared inputs and oracle: `paged_attention_test.py`.

Shapes: n sequences, h query heads, k kv heads, g = h // k, d head dim, s tokens per page, m
pages per sequence.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.paged_attention import BlockSizes, paged_attention

from .paged_attention_test import (  # noqa: TID252
  KERNELS,
  TF32X3_ERROR,
  _assert_close,
  _make_inputs,
  _numpy_oracle,
  _rng,
)


def _poison_before_window(args, window):
  """`args` with every key and value slot before each sequence's window set to NaN, so that a
  position before the window that is not masked with `where` shows as NaN in the output."""
  q, k_kpsd, v_kpsd, lengths_n, page_indices_nm = args
  k_kpsd, v_kpsd = np.array(k_kpsd), np.array(v_kpsd)
  s = k_kpsd.shape[2]
  for b, length in enumerate(np.asarray(lengths_n)):
    for t in range(max(0, int(length) - window)):
      page, slot = page_indices_nm[b, t // s], t % s
      k_kpsd[:, page, slot] = v_kpsd[:, page, slot] = np.nan
  return q, jnp.asarray(k_kpsd), jnp.asarray(v_kpsd), lengths_n, page_indices_nm


def _check_window(impl, args, window, block_sizes=None):
  """`impl` with `sliding_window=window` on `args` with the slots before each window NaN,
  against the float64 oracle of the rule (the GPU kernel's products within 3xTF32's error)."""
  q, _, _, _, _ = args
  out = paged_attention(
    *_poison_before_window(args, window),
    sliding_window=window,
    impl=impl,
    block_sizes=block_sizes,
    interpret=impl != "reference",
  )
  assert out.dtype == q.dtype and out.shape == q.shape
  oracle = _numpy_oracle(*args, sm_scale=q.shape[-1] ** -0.5, sliding_window=window)
  error = TF32X3_ERROR if impl == "pallas_gpu" else 0.0
  _assert_close(out, oracle, q.dtype, args, products_error=error, sliding_window=window)


# (g, page_size, dtype, kv heads, head_dim, pages per sequence, windows): GQA 1/2/3/8, and for
# each dtype windows of one position, less than a page, two whole pages and several pages not
# page-aligned (`_lengths`' lengths, 0, 1, whole pages, a full table and random ones, make
# windows start mid-page too); a window past every length: the test after next. With the
# default tiling the TPU kernel takes each sequence in one compute block and the GPU kernel
# splits the bfloat16 cases' page axis in two parts; other tilings: WINDOW_BLOCK_CASES.
WINDOW_CASES = [
  (1, 8, jnp.float32, 2, 32, 5, (1, 19)),
  (2, 16, jnp.bfloat16, 2, 64, 4, (9, 32)),
  (3, 16, jnp.float32, 2, 32, 3, (9, 32)),
  (8, 8, jnp.bfloat16, 1, 32, 4, (1, 19)),
]


@pytest.mark.parametrize("impl", ("reference", *KERNELS))
@pytest.mark.parametrize("g,s,dtype,k,d,m,windows", WINDOW_CASES)
def test_sliding_window_matches_oracle(impl, g, s, dtype, k, d, m, windows):
  """Every implementation against the float64 oracle, which slices each sequence's last
  `window` positions (the rule itself); slots before the window are NaN."""
  args = _make_inputs(_rng("window", impl, g, s), n=7, h=g * k, k=k, d=d, s=s, m=m, dtype=dtype)
  for window in windows:
    _check_window(impl, args, window)


# Tilings where windows start past the first compute block, with pages of 8 tokens and lengths
# 0, 1, 8, 16, 48 (a full table) and one random. TPU: the loop starts at a later block, and
# (blocks of 2 pages, a window of 5) pages of the first block visited are skipped. GPU (both
# ways to multiply): parts wholly before the window run no block.
WINDOW_BLOCK_CASES = [
  ("pallas_tpu", BlockSizes(pages_per_compute_block=1), 19),
  ("pallas_tpu", BlockSizes(pages_per_compute_block=2), 5),
  ("pallas_gpu", BlockSizes(pages_per_compute_block=1, num_splits=6), 19),
  ("pallas_gpu", BlockSizes(pages_per_compute_block=2, num_splits=3, dot_min_group=1), 5),
]


@pytest.mark.parametrize("impl,block_sizes,window", WINDOW_BLOCK_CASES)
def test_sliding_window_block_sizes(impl, block_sizes, window):
  n, k, g, d, s, m = 6, 2, 2, 32, 8, 6
  args = _make_inputs(
    _rng("window", block_sizes), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=jnp.float32
  )
  _check_window(impl, args, window, block_sizes)


# (impl, block sizes): the default tiling, and GPU tilings whose derived splits cut a window
# into parts of one block (4 to 6 parts), by sums and by dots.
LONG_TABLE_CASES = [
  ("pallas_tpu", None),
  ("pallas_gpu", None),
  ("pallas_gpu", BlockSizes(pages_per_compute_block=1)),
  ("pallas_gpu", BlockSizes(pages_per_compute_block=2, dot_min_group=1)),
]


@pytest.mark.parametrize("impl,block_sizes", LONG_TABLE_CASES)
@pytest.mark.parametrize("window", (1, 19, 40))
def test_long_table_short_window(impl, block_sizes, window):
  """A page table much longer than the window: the GPU kernel's parts cut the window's blocks
  (from the one holding its first position), not the table's, so parts start at different
  blocks per sequence; lengths up to the full table, slots before each window NaN."""
  n, k, g, d, s, m = 6, 2, 4, 32, 8, 24
  args = _make_inputs(_rng("long table", impl, window), n=n, h=g * k, k=k, d=d, s=s, m=m,
                      dtype=jnp.float32)  # fmt: skip
  _check_window(impl, args, window, block_sizes)


@pytest.mark.parametrize("impl", ("reference", *KERNELS))
def test_window_past_every_length_changes_nothing(impl):
  """A window longer than every length gives what no window gives, bit for bit, through the
  windowed code; one of at least the page table's capacity runs as no window."""
  n, k, g, d, s, m = 5, 2, 2, 32, 8, 4
  args = _make_inputs(
    _rng("wide window", impl),
    n=n,
    h=g * k,
    k=k,
    d=d,
    s=s,
    m=m,
    dtype=jnp.float32,
    lengths=[0, 1, 9, 17, 23],
  )
  run = functools.partial(paged_attention, impl=impl, interpret=impl != "reference")
  jaxpr = lambda **kw: str(jax.make_jaxpr(functools.partial(run, **kw))(*args))
  assert jaxpr(sliding_window=24) != jaxpr(), "the window should reach the implementation"
  np.testing.assert_array_equal(run(*args, sliding_window=24), run(*args))
  assert jaxpr(sliding_window=m * s) == jaxpr(sliding_window=10**9) == jaxpr()


def test_tpu_kernel_copies_no_page_before_the_window():
  """Pages wholly before the window are never copied. White-box: their page-table entries here
  are out of bounds (outside the contract, which asks for valid ids), which the TPU interpreter
  raises on, as it does for the same table without the window. Compute blocks of 2 pages: whole
  blocks and single pages of a block are skipped."""
  n, k, g, d, s, m, window = 4, 2, 2, 32, 8, 6, 11
  args = _make_inputs(
    _rng("skip"), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=jnp.float32, lengths=[48, 37, 20, 0]
  )
  q, kp, vp, lengths, pages = args
  out_of_bounds = np.array(pages)
  for b, length in enumerate(np.asarray(lengths)):
    out_of_bounds[b, : max(0, int(length) - window) // s] = kp.shape[1] + 100
  run = functools.partial(
    paged_attention,
    impl="pallas_tpu",
    block_sizes=BlockSizes(pages_per_compute_block=2),
    interpret=True,
  )
  out = run(q, kp, vp, lengths, jnp.asarray(out_of_bounds), sliding_window=window)
  oracle = _numpy_oracle(*args, sm_scale=d**-0.5, sliding_window=window)
  _assert_close(out, oracle, jnp.float32, args, sliding_window=window)
  with pytest.raises(Exception, match="Out-of-bounds read"):
    jax.block_until_ready(run(q, kp, vp, lengths, jnp.asarray(out_of_bounds)))
