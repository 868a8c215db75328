"""Paged attention with Gemma 2's attention-logit softcap (`logit_softcap=c`: the scaled logits
`s` become `c * tanh(s / c)` before the softmax): every implementation against a float64
oracle, with and without a sliding window, on poisoned caches; the capped kernels lower for TPU
and CUDA; bad caps are refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.lowering import TRITON_CALL, export_cuda, triton_modules

from jaxrl.kernels.paged_attention import paged_attention

from .paged_attention_lowering_test import _shapes  # noqa: TID252
from .paged_attention_test import _make_inputs, _rng  # noqa: TID252


def _capped_oracle(q_nhd, k_kpsd, v_kpsd, lengths_n, page_indices_nm, cap, window=None):
  """Dense float64 attention of each sequence's positions (within the window), logits capped."""
  q, kp, vp = (np.asarray(x, np.float64) for x in (q_nhd, k_kpsd, v_kpsd))
  n, h, d = q.shape
  k, _, s, _ = kp.shape
  m = page_indices_nm.shape[1]
  out = np.zeros(q.shape)
  for b in range(n):
    length = int(lengths_n[b])
    start = 0 if window is None else max(0, length - window)
    pages = np.asarray(page_indices_nm[b])
    for i in range(h if length else 0):
      kv = i // (h // k)
      keys = kp[kv, pages].reshape(m * s, d)[start:length]
      values = vp[kv, pages].reshape(m * s, d)[start:length]
      logits = cap * np.tanh(keys @ q[b, i] * d**-0.5 / cap)
      weights = np.exp(logits - logits.max())
      out[b, i] = weights / weights.sum() @ values
  return out


@pytest.mark.parametrize("impl", ["reference", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("window", [None, 11])
def test_capped_logits_match_the_oracle(impl, window):
  """Queries scaled up so that most logits lie far past the cap (1.5): the cap changes the
  output by far more than the tolerance."""
  n, k, g, d, s, m, cap = 6, 2, 2, 32, 8, 5, 1.5
  q, *rest = _make_inputs(
    _rng("softcap", impl), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=jnp.float32
  )
  args = (q * 4.0, *rest)
  out = paged_attention(
    *args, sliding_window=window, logit_softcap=cap, impl=impl, interpret=impl != "reference",
    precision="highest",
  )  # fmt: skip
  want = _capped_oracle(*args, cap=cap, window=window)
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
  uncapped = _capped_oracle(*args, cap=1e9, window=window)
  assert np.abs(uncapped - want).max() > 0.1


def test_bad_caps():
  args = _make_inputs(_rng("bad cap"), n=2, h=2, k=1, d=8, s=8, m=2, dtype=jnp.float32)
  for cap in (0.0, -1.0, True, float("inf"), "50"):
    with pytest.raises(ValueError, match="logit_softcap must be None or a finite"):
      paged_attention(*args, logit_softcap=cap)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_capped_kernels_lower(platform, dtype):
  """Gemma 2 2B's heads (8 query heads of 256, 4 kv heads), cap 50, a 4,096 window."""
  impl = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}[platform]
  shapes = _shapes(4, 8, 4, 256, 1100, 16, 272, dtype)

  def export(**kwargs):
    f = functools.partial(paged_attention, impl=impl, sliding_window=4096, **kwargs)
    if platform == "cuda":
      return export_cuda(f, *shapes)
    return jax.export.export(jax.jit(f), platforms=["tpu"])(*shapes)

  text = export(logit_softcap=50.0).mlir_module()
  if platform == "tpu":
    assert "tpu_custom_call" in text
  else:
    assert TRITON_CALL in text
    ((verified, triton_ir),) = triton_modules(text)
    assert verified and "tanh" in triton_ir
  assert text != export().mlir_module(), "the cap should change the kernel"
