"""Paged attention's tiling: the block sizes, warps, stages and splits the kernels derive from
the shapes, those `default_block_sizes` sets around a trace, and the `BlockSizes` fields'
checks (the kernels' results at other tilings: `paged_attention_test.py`).
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxrl.kernels.paged_attention import BlockSizes, paged_attention
from jaxrl.kernels.paged_attention import pallas_gpu as gpu_kernel


def test_gpu_default_block_sizes_fill_the_gpu():
  small = gpu_kernel.resolve_block_sizes(None, num_programs=4, page_size=16, pages_per_seq=64)
  assert small.pages_per_compute_block * 16 >= 16 and small.num_splits > 1
  big = gpu_kernel.resolve_block_sizes(None, num_programs=1024, page_size=16, pages_per_seq=64)
  assert big.num_splits == 1
  tiny_pages = gpu_kernel.resolve_block_sizes(None, num_programs=8, page_size=8, pages_per_seq=1)
  assert tiny_pages.pages_per_compute_block * 8 >= 16


@pytest.mark.parametrize(
  "pages, dtype, block_pages, warps, stages, splits",
  [
    (6, jnp.bfloat16, 2, 2, 1, 1),  # 96 tokens a sequence: short
    (8, jnp.bfloat16, 2, 2, 1, 1),  # 128
    (9, jnp.bfloat16, 4, 2, 1, 1),  # 144: medium
    (68, jnp.bfloat16, 4, 2, 1, 2),  # 1,088 (1k-token prompts, the capacity measured)
    (128, jnp.bfloat16, 4, 2, 1, 2),  # 2,048
    (129, jnp.bfloat16, 8, 4, 2, 3),  # 2,064: long
    (6, jnp.float32, 2, 4, 2, 1),  # float32 (g = 2: sums, blocks of 8192 / (2 * 128) tokens)
  ],
)
def test_gpu_short_and_medium_contexts_take_small_blocks_of_few_warps(
  pages, dtype, block_pages, warps, stages, splits
):
  """A 16-bit cache of at most 128 tokens a sequence runs 32-token blocks at 2 warps and 1
  stage, one of at most 2,048 tokens 64-token blocks (the tilings measured fastest inside the
  model, docs/BENCHMARKS.md); longer ones and float32 caches keep their defaults. Qwen3-0.6B's
  heads, 64 rows, pages of 16 tokens."""
  from jaxrl.kernels.common import target_platform

  n = 64
  q = jnp.zeros((n, 16, 128), dtype)
  pool = jnp.zeros((8, n * pages, 16, 128), dtype)
  table = jnp.arange(n * pages, dtype=jnp.int32).reshape(n, pages)
  args = (q, pool, pool, jnp.full((n,), 90, jnp.int32), table)
  with target_platform("cuda"):
    jaxpr = str(jax.make_jaxpr(paged_attention)(*args))
  tiling = re.findall(r"num_warps=\d+|num_stages=\d+|grid=\([^)]*\)", jaxpr)
  assert tiling == [f"num_warps={warps}", f"num_stages={stages}", f"grid=(64, 8, {splits})"]
  # The kernel loads a compute block's pages of keys, then of values, from the pools.
  assert re.findall(r"\[(\d+),16,128\] <-", jaxpr) == [str(block_pages)] * 2


def test_gpu_window_tiling_follows_the_window_not_the_table():
  """A windowed call is tiled and split for the pages its window spans, not for the page
  table: Gemma 3 1B's local layers (1 kv head of 4 query heads, head_dim 256, a window of
  512) at 64 rows of an 8k-token table read 33 pages a sequence, so they take the medium
  tiling (blocks of 4 pages, 2 warps, 1 stage) in 3 parts of 3 blocks, where the same table
  without a window takes blocks of 8 pages in 8 parts. Results at such tilings:
  `paged_attention_window_test.py::test_long_table_short_window`."""
  from jaxrl.kernels.common import target_platform

  n, pages = 64, 512
  q = jnp.zeros((n, 4, 256), jnp.bfloat16)
  pool = jnp.zeros((1, n * pages, 16, 256), jnp.bfloat16)
  table = jnp.arange(n * pages, dtype=jnp.int32).reshape(n, pages)
  args = (q, pool, pool, jnp.full((n,), 8000, jnp.int32), table)

  def tiling(window):
    f = functools.partial(paged_attention, sliding_window=window)
    jaxpr = str(jax.make_jaxpr(f)(*args))
    found = re.findall(r"num_warps=\d+|num_stages=\d+|grid=\([^)]*\)", jaxpr)
    return found, re.findall(r"\[(\d+),16,256\] <-", jaxpr)

  with target_platform("cuda"):
    assert tiling(512) == (["num_warps=2", "num_stages=1", "grid=(64, 1, 3)"], ["4", "4"])
    assert tiling(None) == (["num_warps=4", "num_stages=2", "grid=(64, 1, 8)"], ["8", "8"])


def test_default_block_sizes_apply_where_a_call_passes_none_and_only_inside():
  from jaxrl.kernels.common import target_platform
  from jaxrl.kernels.paged_attention import default_block_sizes

  q = jnp.zeros((4, 16, 128), jnp.bfloat16)
  pool = jnp.zeros((8, 544, 16, 128), jnp.bfloat16)  # 2,176 tokens a sequence: a long context
  args = (q, pool, pool, jnp.full((4,), 90, jnp.int32), jnp.arange(544, dtype=jnp.int32))
  args = (*args[:4], args[4].reshape(4, 136))

  def tiling(**kwargs):
    jaxpr = str(jax.make_jaxpr(functools.partial(paged_attention, **kwargs))(*args))
    return re.findall(r"num_warps=\d+|num_stages=\d+|grid=\([^)]*\)", jaxpr)

  with target_platform("cuda"):
    derived = tiling()
    assert derived == ["num_warps=4", "num_stages=2", "grid=(4, 8, 6)"]
    with default_block_sizes(BlockSizes(2, None, 2, 1)):
      assert tiling() == ["num_warps=2", "num_stages=1", "grid=(4, 8, 8)"]
      given = tiling(block_sizes=BlockSizes(8, 1, 8, 3))  # a call's own block sizes win
      assert given == ["num_warps=8", "num_stages=3", "grid=(4, 8, 1)"]
    assert tiling() == derived
  with pytest.raises(ValueError, match="BlockSizes"), default_block_sizes((2, None, 2, 1)):
    pass


@pytest.mark.parametrize(
  "fields,match",
  [
    ({"pages_per_compute_block": 0}, "positive int"),
    ({"num_splits": -1}, "positive int"),
    ({"num_stages": 2.0}, "positive int"),
    ({"pages_per_compute_block": True}, "positive int"),
    ({"num_warps": 3}, "power of two"),
    ({"dot_min_group": 0}, "positive int"),
    ({"reference_below_tokens": -64}, "positive int"),
  ],
)
def test_bad_block_sizes(fields, match):
  with pytest.raises(ValueError, match=match):
    BlockSizes(**fields)
