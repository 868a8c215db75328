"""Flash attention with attention sinks (gpt-oss: one more logit per query head, with a zero
value, in every query's softmax): the reference and both Pallas kernels in interpret mode
against a float64 oracle written with the sink as an extra key (output and the gradients of q,
k, v and the sinks), on packed rows under a window and on a prefill chunk; cuDNN's fallback;
bad sinks.

Shapes: b batch, t query tokens, s key tokens, h query heads, k kv heads, e head dim.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from .flash_attention_test import (  # noqa: TID252
  FAST_COMPILE,
  IMPLS,
  WINDOW_BLOCKS,
  _call,
  _make_inputs,
  _rng,
)

# (layout, t, s, window): packed rows (segments, padding) under a window across blocks, and a
# prefill chunk after cached keys of different lengths.
SINK_CASES = [("packed", 64, 64, 20), ("prefill", 24, 56, None)]
GRADS = ("out", "dq", "dk", "dv", "dsinks")


def _sink_oracle(qkv, ids, cot, sinks, window):
  """Dense float64 attention whose softmax has each head's sink as one more logit (value 0),
  and the gradients of sum(out * cot); a query that sees no key gets zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in qkv)
  q_seg, kv_seg, q_pos, kv_pos = (np.asarray(x) for x in ids)
  do, sink = np.asarray(cot, np.float64), np.asarray(sinks, np.float64)
  b, t, h, e = q.shape
  s, kh = k.shape[1:3]
  g = h // kh
  sm = e**-0.5
  vis = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] >= 0)
  vis &= kv_pos[:, None, :] <= q_pos[:, :, None]
  if window is not None:
    vis &= kv_pos[:, None, :] > q_pos[:, :, None] - window
  vis = vis[:, None]  # [b, 1, t, s]
  kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  logits = np.where(vis, np.einsum("bthe,bshe->bhts", q, kk) * sm, -np.inf)
  sink_bht1 = np.broadcast_to(sink[None, :, None, None], (b, h, t, 1))
  top = np.maximum(np.max(logits, axis=-1, keepdims=True), sink_bht1)
  weights = np.where(vis, np.exp(logits - top), 0.0)
  sink_weight = np.exp(sink_bht1 - top)
  denom = weights.sum(-1, keepdims=True) + sink_weight
  p, p_sink = weights / denom, (sink_weight / denom)[..., 0]
  seen = vis.any(-1)  # [b, 1, t]
  p, p_sink = np.where(seen[..., None], p, 0.0), np.where(seen, p_sink, 0.0)
  out = np.einsum("bhts,bshe->bthe", p, vv)
  dp = np.einsum("bthe,bshe->bhts", do, vv)
  delta = np.einsum("bthe,bthe->bht", do, out)
  ds = p * (dp - delta[..., None])

  def group_sum(x_bshe):
    return x_bshe.reshape(b, s, kh, g, e).sum(3)

  return {
    "out": out,
    "dq": sm * np.einsum("bhts,bshe->bthe", ds, kk),
    "dk": group_sum(sm * np.einsum("bhts,bthe->bshe", ds, q)),
    "dv": group_sum(np.einsum("bhts,bthe->bshe", p, do)),
    "dsinks": -np.sum(p_sink * delta, axis=(0, 2)),  # the sink's logit gradient, value 0
  }


def _outputs(qkv, ids, cot, sinks, **kwargs):
  def run(q, k, v, sinks, ids, cot):
    out, vjp = jax.vjp(lambda *a: _call(a[:3], ids, sinks=a[3], **kwargs), q, k, v, sinks)
    return (out, *vjp(cot.astype(out.dtype)))

  compiled = jax.jit(run).lower(*qkv, sinks, ids, cot).compile(FAST_COMPILE)
  return dict(zip(GRADS, compiled(*qkv, sinks, ids, cot), strict=True))


@functools.cache
def _case(case: int):
  """Inputs, sinks drawn around the logits' size (so the sink takes a sizeable share of each
  softmax), and the oracle, with and without sinks."""
  layout, t, s, window = SINK_CASES[case]
  b = 2 if layout == "prefill" else 1
  qkv, ids, cot = _make_inputs(
    _rng("sinks", case), b=b, t=t, s=s, h=4, k=2, e=16, dtype=jnp.float32, layout=layout
  )
  sinks = jnp.asarray(_rng("sink logits", case).normal(1.0, 1.0, 4), jnp.float32)
  oracle = _sink_oracle(qkv, ids, cot, sinks, window)
  plain = _sink_oracle(qkv, ids, cot, jnp.full((4,), -1e4, jnp.float32), window)
  return qkv, ids, cot, sinks, oracle, plain


@pytest.mark.parametrize("case", range(len(SINK_CASES)))
@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_match_the_dense_oracle(impl, case):
  *_, window = SINK_CASES[case]
  qkv, ids, cot, sinks, want, plain = _case(case)
  kwargs = {"impl": impl, "block_sizes": WINDOW_BLOCKS[impl], "sliding_window": window}
  if impl != "reference":
    kwargs["interpret"] = True
  got = _outputs(qkv, ids, cot, sinks, **kwargs)
  t, s, e = qkv[0].shape[1], qkv[1].shape[1], qkv[0].shape[3]
  terms = {"out": e + s, "dq": 2 * e + s + t, "dk": 2 * e + s + t, "dv": 2 * e + s + t}
  terms["dsinks"] = 2 * e + s + 2 * t
  for name in GRADS:
    tolerance.assert_close(got[name], want[name], n=terms[name], exact=True, err_msg=name)
    # The sinks move every result far past the tolerance (the oracle without them differs).
    allowed = tolerance.atol(terms[name], np.max(np.abs(want[name])), evaluations=1)
    assert np.max(np.abs(want[name] - plain[name])) > 100 * allowed, name
  np.testing.assert_array_equal(plain["dsinks"], 0.0)


def test_cudnn_with_sinks_runs_its_fallback_kernel():
  """cuDNN has no sinks: `impl="cudnn"` with sinks runs the Pallas GPU kernel (interpreted)."""
  qkv, ids, cot, sinks, want, _ = _case(0)
  q, k, v = (x.astype(jnp.bfloat16) for x in qkv)
  _, kv_seg, _, _ = ids
  got = _call((q, k, v), ids, sinks=sinks, impl="cudnn", sliding_window=20, interpret=True)
  assert got.dtype == jnp.bfloat16
  out = np.asarray(got, np.float64)
  np.testing.assert_allclose(out, want["out"], atol=0.05 * np.max(np.abs(want["out"])))


@pytest.mark.parametrize(
  "sinks,match",
  [(jnp.zeros((3,)), r"\[num_q_heads=4\]"), (jnp.zeros((4,), jnp.int32), "int32"), ([0.0] * 4, "")],
)
def test_bad_sinks(sinks, match):
  qkv, ids, *_ = _case(0)
  with pytest.raises(ValueError, match="sinks must be None or a float" + ".*" + match):
    _call(qkv, ids, sinks=sinks)
