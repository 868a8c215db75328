"""cuDNN's fused attention emulated in jnp, for testing `flash_attention(impl="cudnn")` on a CPU.

It takes what `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` takes (BTNH
layout, grouped kv heads) and computes what cuDNN documents: with `q_offsets`, row b holds
segment m at tokens `[offsets[b, m], offsets[b, m] + seqlen[b, m])` (entries past the row's
segments are -1), each attending to itself alone, causally from its own first token under a
causal mask type; without offsets, plain (causal) attention over the row. Like cuDNN, it leaves
the tokens outside every segment unwritten: there its output and gradients are NaN, so a
wrapper that does not select them away fails. Float32 inside, whatever the input dtype.

Glossary: b batch, t query tokens, s key tokens, n query heads, k kv heads, e head dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_api

CAUSAL_MASKS = (cudnn_api.MaskType.CAUSAL, cudnn_api.MaskType.PADDING_CAUSAL)


def _visibility(b, t, s, q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal):
  """(visible [b, t, s], query in a segment [b, t], key in a segment [b, s])."""
  i = jnp.arange(t)[None, :, None]
  j = jnp.arange(s)[None, None, :]
  if q_offsets is None:
    visible = jnp.broadcast_to(j <= i if causal else True, (b, t, s))
    return visible, jnp.ones((b, t), bool), jnp.ones((b, s), bool)
  visible = jnp.zeros((b, t, s), bool)
  q_in, kv_in = jnp.zeros((b, t), bool), jnp.zeros((b, s), bool)
  for m in range(q_seqlen.shape[1]):
    q_first, q_len = q_offsets[:, m, None, None], q_seqlen[:, m, None, None]
    kv_first, kv_len = kv_offsets[:, m, None, None], kv_seqlen[:, m, None, None]
    live = (q_first >= 0) & (q_len > 0)
    q_here = live & (i >= q_first) & (i < q_first + q_len)
    kv_here = live & (j >= kv_first) & (j < kv_first + kv_len)
    pair = q_here & kv_here
    if causal:
      pair &= j - kv_first <= i - q_first
    visible |= pair
    q_in |= q_here[:, :, 0]
    kv_in |= kv_here[:, 0, :]
  return visible, q_in, kv_in


def _dense(q, k, v, visible, q_in, scale):
  b, t, n, e = q.shape
  kh = k.shape[2]
  q_btkge = q.reshape(b, t, kh, n // kh, e).astype(jnp.float32)
  logits = jnp.einsum("btkge,bske->bkgts", q_btkge, k.astype(jnp.float32)) * scale
  logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
  probs = jnp.where(visible[:, None, None], jax.nn.softmax(logits, axis=-1), 0.0)
  out = jnp.einsum("bkgts,bske->btkge", probs, v.astype(jnp.float32)).reshape(b, t, n, e)
  return jnp.where(q_in[:, :, None, None], out, 0.0).astype(q.dtype)


def _unwritten(x, written_bt):
  return jnp.where(written_bt[:, :, None, None], x, jnp.nan).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, visible, q_in, kv_in, scale):
  return _unwritten(_dense(q, k, v, visible, q_in, scale), q_in)


def _attention_fwd(q, k, v, visible, q_in, kv_in, scale):
  return _attention(q, k, v, visible, q_in, kv_in, scale), (q, k, v, visible, q_in, kv_in)


def _attention_bwd(scale, residuals, d_out):
  q, k, v, visible, q_in, kv_in = residuals
  d_out = jnp.where(q_in[:, :, None, None], d_out, 0)  # cuDNN reads only the segments' tokens
  _, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, visible, q_in, scale), q, k, v)
  dq, dk, dv = vjp(d_out)
  return _unwritten(dq, q_in), _unwritten(dk, kv_in), _unwritten(dv, kv_in), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def dot_product_attention(
  query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, q_offsets=None,
  kv_offsets=None, fp8_params=None, *, scale=1.0, mask_type=cudnn_api.MaskType.NO_MASK,
  qkv_layout="BTNH", **unused,
):  # fmt: skip
  """The emulation, with jax's wrapper's signature (module docstring)."""
  assert qkv_layout == "BTNH" and bias is None and mask is None and fp8_params is None
  b, t = query.shape[:2]
  causal = mask_type in CAUSAL_MASKS
  visible, q_in, kv_in = _visibility(
    b, t, key.shape[1], q_seqlen, kv_seqlen, q_offsets, kv_offsets, causal
  )
  return _attention(query, key, value, visible, q_in, kv_in, scale)
