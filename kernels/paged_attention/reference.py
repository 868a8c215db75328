"""Paged decode attention in pure jnp: the definition, the CPU path and the kernels' oracle.

A sequence of length L attends to positions `[0, L)`, or with a sliding window w to
`[max(0, L - w), L)` (its query is at L - 1, and transformers keep `kv_idx > q_idx - w`).
With a logit softcap c (Gemma 2) the scaled logits `s` become `c * tanh(s / c)`
(`scale_logits`, which the kernels share). With attention sinks (gpt-oss) each query head's
softmax has one more logit, its sink, whose value is zero.

Shapes: n sequences, h query heads, k kv heads, g = h // k query heads per kv head, d head dim,
p pages in the pool, s tokens per page, m pages per sequence, t = m * s token positions.
"""

import jax
import jax.numpy as jnp

from jaxrl.kernels.common import softcap


def scale_logits(logits: jax.Array, sm_scale: float, cap: float | None) -> jax.Array:
  """`logits * sm_scale`, then with a softcap c `c * tanh(. / c)`; float32 in and out."""
  return softcap(logits * sm_scale, cap)


def paged_attention(
  q_nhd: jax.Array,
  k_pages_kpsd: jax.Array,
  v_pages_kpsd: jax.Array,
  lengths_n: jax.Array,
  page_indices_nm: jax.Array,
  *,
  sm_scale: float,
  sliding_window: int | None = None,
  logit_softcap: float | None = None,
  sinks_h: jax.Array | None = None,
) -> jax.Array:
  """One decode step of attention over a paged KV cache, written as plainly as possible.

  Gathers every page each sequence lists, masks positions at or past its length and, with a
  window, those before it (with `where`, so whatever sits in the unused slots, NaN included,
  cannot leak in) and takes the softmax in float32. A sequence of length 0 gets zeros.

  Args:
    q_nhd: queries, one per sequence.
    k_pages_kpsd: key page pool.
    v_pages_kpsd: value page pool, same shape as the keys.
    lengths_n: int32 tokens in cache per sequence, already clipped to [0, m * s].
    page_indices_nm: int32 page ids of each sequence, in order.
    sm_scale: multiplier of the logits.
    sliding_window: None, or w >= 1: only the last w positions of each sequence are seen.
    logit_softcap: None, or c > 0: the scaled logits are capped at c (`scale_logits`).
    sinks_h: None, or float32 `[h]`: each query head's sink logit (value zero).

  Returns:
    The attention output `[n, h, d]` in q's dtype.
  """
  n, h, d = q_nhd.shape
  k, _, s, _ = k_pages_kpsd.shape
  m = page_indices_nm.shape[1]
  g = h // k
  f32 = jnp.float32
  hi = jax.lax.Precision.HIGHEST

  k_kntd = k_pages_kpsd[:, page_indices_nm].reshape(k, n, m * s, d).astype(f32)
  v_kntd = v_pages_kpsd[:, page_indices_nm].reshape(k, n, m * s, d).astype(f32)
  pos_1t = jnp.arange(m * s, dtype=jnp.int32)[None, :]
  valid_nt = pos_1t < lengths_n[:, None]
  if sliding_window is not None:
    valid_nt &= pos_1t >= lengths_n[:, None] - sliding_window
  q_nkgd = q_nhd.reshape(n, k, g, d).astype(f32)

  logits_nkgt = jnp.einsum("nkgd,kntd->nkgt", q_nkgd, k_kntd, precision=hi)
  logits_nkgt = scale_logits(logits_nkgt, sm_scale, logit_softcap)
  logits_nkgt = jnp.where(valid_nt[:, None, None, :], logits_nkgt, -jnp.inf)
  max_nkg1 = jnp.max(logits_nkgt, axis=-1, keepdims=True)
  if sinks_h is not None:
    sink_1kg1 = sinks_h.astype(f32).reshape(1, k, g, 1)
    max_nkg1 = jnp.maximum(max_nkg1, sink_1kg1)
  max_nkg1 = jnp.where(jnp.isfinite(max_nkg1), max_nkg1, 0.0)  # all-masked row: length 0
  probs_nkgt = jnp.exp(logits_nkgt - max_nkg1)
  denom_nkg1 = jnp.sum(probs_nkgt, axis=-1, keepdims=True)
  if sinks_h is not None:
    denom_nkg1 = denom_nkg1 + jnp.exp(sink_1kg1 - max_nkg1)
  v_kntd = jnp.where(valid_nt[None, :, :, None], v_kntd, 0.0)
  out_nkgd = jnp.einsum("nkgt,kntd->nkgd", probs_nkgt, v_kntd, precision=hi)
  out_nkgd = out_nkgd / jnp.where(denom_nkg1 > 0, denom_nkg1, 1.0)
  return out_nkgd.reshape(n, h, d).astype(q_nhd.dtype)
