"""Paged attention with attention sinks (gpt-oss: one more logit per query head, with a zero
value, in every softmax): the reference and both Pallas kernels in interpret mode against a
float64 oracle with the sink as an extra key, over GQA groups of 1 to 8 (3: padded heads on
the GPU), a window, split-K parts (the sink counted once in their merge), both ways the GPU
kernel multiplies, and bfloat16; padding rows still output zeros; bad sinks. Poisoned caches:
`paged_attention_test._make_inputs`.

Shapes: n sequences, h query heads, k kv heads, g = h // k, d head dim, s page size, m pages
per sequence.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.paged_attention import BlockSizes, paged_attention

from .paged_attention_test import TF32X3_ERROR, _assert_close, _make_inputs, _rng  # noqa: TID252
from .paged_attention_window_test import _poison_before_window  # noqa: TID252


def _sink_oracle(q_nhd, k_kpsd, v_kpsd, lengths_n, page_indices_nm, sinks_h, window=None):
  """Dense float64 attention whose softmax has the head's sink as one more logit (value 0);
  zeros for a sequence of length 0."""
  q, kp, vp = (np.asarray(x, np.float64) for x in (q_nhd, k_kpsd, v_kpsd))
  sinks = np.asarray(sinks_h, np.float64)
  n, h, d = q.shape
  k, _, s, _ = kp.shape
  m = page_indices_nm.shape[1]
  out = np.zeros(q.shape)
  for b in range(n):
    length = int(np.clip(lengths_n[b], 0, m * s))
    start = 0 if window is None else max(0, length - window)
    pages = np.asarray(page_indices_nm[b])
    for i in range(h if length else 0):
      keys = kp[i // (h // k), pages].reshape(m * s, d)[start:length]
      values = vp[i // (h // k), pages].reshape(m * s, d)[start:length]
      logits = np.append(keys @ q[b, i] * d**-0.5, sinks[i])
      weights = np.exp(logits - logits.max())
      out[b, i] = weights[:-1] @ values / weights.sum()
  return out


# (impl, g, dtype, window, block sizes): every impl at GQA 1, 3 and 8 in float32; the GPU
# kernel split into parts (with and without a window), multiplying by dots (3xTF32) and by
# sums; bfloat16.
CASES = [
  ("reference", 1, jnp.float32, None, None),
  ("reference", 3, jnp.float32, 9, None),
  ("pallas_tpu", 1, jnp.float32, None, None),
  ("pallas_tpu", 8, jnp.float32, 9, BlockSizes(pages_per_compute_block=1)),
  ("pallas_gpu", 1, jnp.float32, None, None),
  ("pallas_gpu", 3, jnp.float32, None, BlockSizes(pages_per_compute_block=1, num_splits=3)),
  ("pallas_gpu", 8, jnp.float32, 9, BlockSizes(pages_per_compute_block=2, num_splits=3)),
  ("pallas_gpu", 2, jnp.float32, None, BlockSizes(num_splits=2, dot_min_group=1)),
  ("pallas_gpu", 4, jnp.bfloat16, None, BlockSizes(pages_per_compute_block=2, num_splits=2)),
  ("pallas_tpu", 2, jnp.bfloat16, None, None),
]


@pytest.mark.parametrize("impl,g,dtype,window,block_sizes", CASES)
def test_sinks_match_the_oracle(impl, g, dtype, window, block_sizes):
  n, k, d, s, m = 7, 2, 32, 8, 4
  args = _make_inputs(_rng("sinks", impl, g, dtype), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=dtype)
  # Around the logits' size: the sink takes a sizeable share of every softmax.
  sinks = jnp.asarray(_rng("sink logits", g).normal(1.0, 1.0, g * k), jnp.float32)
  inputs = args if window is None else _poison_before_window(args, window)
  out = paged_attention(
    *inputs, sliding_window=window, sinks=sinks, impl=impl, block_sizes=block_sizes,
    interpret=impl != "reference",
  )  # fmt: skip
  assert out.dtype == dtype and out.shape == (n, g * k, d)
  oracle = _sink_oracle(*args, sinks, window)
  error = TF32X3_ERROR if impl == "pallas_gpu" else 0.0
  _assert_close(out, oracle, dtype, args, products_error=error, sliding_window=window)
  plain = _sink_oracle(*args, jnp.full((g * k,), -1e4), window)
  assert np.max(np.abs(oracle - plain)) > 0.1 * np.max(np.abs(plain))  # the sinks matter


@pytest.mark.parametrize("sinks", [jnp.zeros((3,)), jnp.zeros((4,), jnp.int32), [0.0] * 4])
def test_bad_sinks(sinks):
  args = _make_inputs(_rng("bad sinks"), n=2, h=4, k=2, d=32, s=8, m=2, dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"sinks must be None or a float \[num_q_heads=4\]"):
    paged_attention(*args, sinks=sinks)
