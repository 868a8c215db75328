"""Flash attention: the reference vs a float64 numpy oracle (output and gradients), both Pallas
kernels in interpret mode vs the reference (forward and backward), all three with a sliding
window vs the oracle, input errors, and the GPU kernel compiled on a GPU. With a logit
softcap: `flash_attention_softcap_test.py`; lowering for the platforms:
`flash_attention_lowering_test.py`.

Shapes: b batch, t query tokens, s key tokens, h query heads, k kv heads, g = h // k, e head
dim.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.kernels.flash_attention import BlockSizes, flash_attention, reference
from jaxrl.kernels.flash_attention import pallas_gpu as gpu_kernel
from jaxrl.kernels.flash_attention import pallas_tpu as tpu_kernel

IMPLS = ("reference", "pallas_tpu", "pallas_gpu")
KERNELS = ("pallas_tpu", "pallas_gpu")
# bfloat16 inputs and outputs, products rounded to bfloat16 inside the kernels: a few bf16 ulps
# (2**-8 relative) of the sums' scale apart.
BF16_TOL = 3e-2
# XLA:CPU's cheapest backend settings: the interpreted kernels and the reference's loops
# compile about twice as fast, and compute the same sums (the tolerances cover any order).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
NAMES = ("out", "dq", "dk", "dv")


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _packed_row(rng, length: int, segment_ids, padding: int):
  """Segments of random lengths with the given ids, then `padding` tokens of id -1; positions
  restart at 0 in each segment."""
  cuts = np.sort(rng.choice(np.arange(1, length - padding), len(segment_ids) - 1, replace=False))
  bounds = [0, *cuts.tolist(), length - padding]
  seg, pos = [], []
  for sid, lo, hi in zip(segment_ids, bounds[:-1], bounds[1:], strict=True):
    seg += [sid] * (hi - lo)
    pos += list(range(hi - lo))
  return seg + [-1] * padding, pos + [0] * padding


def _ids(rng, b: int, t: int, s: int, layout: str):
  """(q segment ids, kv segment ids, q positions, kv positions), int32 numpy.

  `packed`: self-attention (t == s) over rows of several packed sequences: row 0 ends in
  padding, row 1 has unsorted ids. `packed_long`: every row holds a short sequence, then one
  of 3/4 of the row that crosses the middle, then padding (the first half of the row sees
  nothing of the second). `prefill`: a chunk of t queries after cached keys: the keys are
  [cache | padding | the chunk itself]; rows have caches of different lengths, and the last
  row ends in padding queries (whose keys are padding too).
  """
  if layout == "packed_long":
    assert t == s
    short, long = t // 8, 3 * t // 4
    seg = np.array([[0] * short + [1] * long + [-1] * (t - short - long)] * b, np.int32)
    pos = np.array([list(range(short)) + list(range(long)) + [0] * (t - short - long)] * b)
    return seg, seg, pos.astype(np.int32), pos.astype(np.int32)
  if layout == "packed":
    assert t == s
    rows = [_packed_row(rng, t, [0, 1, 2], padding=max(1, t // 8)), _packed_row(rng, t, [7, 2], 0)]
    rows = (rows * b)[:b]
    seg = np.array([r[0] for r in rows], np.int32)
    pos = np.array([r[1] for r in rows], np.int32)
    return seg, seg, pos, pos
  q_seg, kv_seg = np.zeros((b, t), np.int32), np.zeros((b, s), np.int32)
  q_pos, kv_pos = np.zeros((b, t), np.int32), np.zeros((b, s), np.int32)
  for row in range(b):
    cache = s - t - (row * (s - t)) // (b + 1)
    kv_pos[row, :cache] = np.arange(cache)
    kv_seg[row, cache : s - t] = -1
    q_pos[row] = cache + np.arange(t)
    kv_pos[row, s - t :] = q_pos[row]
    if row == b - 1:
      q_seg[row, t - 3 :] = -1
      kv_seg[row, s - 3 :] = -1
  return q_seg, kv_seg, q_pos, kv_pos


def _make_inputs(rng, *, b, t, s, h, k, e, dtype, layout):
  """q, k, v in `dtype`, the four id arrays, and a float32 cotangent for the output."""
  cast = lambda shape: jnp.asarray(rng.standard_normal(shape), dtype)
  ids = tuple(jnp.asarray(x) for x in _ids(rng, b, t, s, layout))
  cot = jnp.asarray(rng.standard_normal((b, t, h, e)), jnp.float32)
  return (cast((b, t, h, e)), cast((b, s, k, e)), cast((b, s, k, e))), ids, cot


def _call(qkv, ids, *, causal=True, **kwargs):
  q_seg, kv_seg, q_pos, kv_pos = ids
  return flash_attention(
    *qkv,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    q_positions=q_pos,
    kv_positions=kv_pos,
    causal=causal,
    **kwargs,
  )


def _outputs(qkv, ids, cot, **kwargs):
  """{out, dq, dk, dv}: the output and the gradients of sum(out * cot), from one compilation."""

  def run(q, k, v, ids, cot):
    out, vjp = jax.vjp(lambda q, k, v: _call((q, k, v), ids, **kwargs), q, k, v)
    return (out, *vjp(cot.astype(out.dtype)))

  compiled = jax.jit(run).lower(*qkv, ids, cot).compile(FAST_COMPILE)
  return dict(zip(NAMES, compiled(*qkv, ids, cot), strict=True))


def _oracle(qkv, ids, cot, *, causal=True, sm_scale=None, sliding_window=None, logit_softcap=None):
  """Dense float64 attention and its gradients, with the scale of each element's float32
  rounding; a query that sees no key gets 0. The mask is `flash_attention`'s rule written out
  over `[t, s]`; a `logit_softcap` c caps the scaled logits s to `c * tanh(s / c)` before it.

  Scales (sums of |terms| along the chain of sums behind each element): logits of row i are off
  by up to L_i = max_j sm|q_i|.|k_j| units, which moves p_ij by 2 L_i p_ij (through the exp and
  the normaliser); the output sums p |v|; dp_ij sums |do_i|.|v_j|, delta_i = do_i . o_i sums
  |do_i|.(|o_i| + its error); ds = p (dp - delta) carries all of those, and dq, dk, dv sum
  ds |k|, ds |q|, p |do|. A cap adds the tanh's rounding to the logits' (within 4.4 float32 ulps
  of c on XLA:CPU, 2 in CUDA's libdevice, then the multiply by c: 5c more units in L_i) and
  takes ds through `1 - tanh**2`, itself off by about twice the tanh's ulps (10 u, absolute).
  """
  q, k, v = (np.asarray(x, np.float64) for x in qkv)
  q_seg, kv_seg, q_pos, kv_pos = (np.asarray(x) for x in ids)
  do = np.asarray(cot, np.float64)
  b, t, h, e = q.shape
  s, kh = k.shape[1:3]
  g = h // kh
  sm = e**-0.5 if sm_scale is None else sm_scale
  vis = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] >= 0)
  if causal:
    vis &= kv_pos[:, None, :] <= q_pos[:, :, None]
  if sliding_window is not None:
    vis &= kv_pos[:, None, :] > q_pos[:, :, None] - sliding_window
  vis = vis[:, None]  # [b, 1, t, s]
  kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  scaled = np.einsum("bthe,bshe->bhts", q, kk) * sm
  tanh = np.tanh(scaled / logit_softcap) if logit_softcap is not None else None
  logits = np.where(vis, scaled if tanh is None else logit_softcap * tanh, -np.inf)
  top = np.max(logits, axis=-1, keepdims=True)
  weights = np.where(vis, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
  denom = weights.sum(-1, keepdims=True)
  p = weights / np.where(denom > 0, denom, 1.0)
  out = np.einsum("bhts,bshe->bthe", p, vv)
  dp = np.einsum("bthe,bshe->bhts", do, vv)
  delta = np.einsum("bthe,bthe->bht", do, out)
  ds = p * (dp - delta[..., None])  # the gradient of the (capped) logits
  dscaled = ds if tanh is None else ds * (1 - tanh**2)  # of the scaled logits

  def group_sum(x_bshe):
    return x_bshe.reshape(b, s, kh, g, e).sum(3)

  want = {
    "out": out,
    "dq": sm * np.einsum("bhts,bshe->bthe", dscaled, kk),
    "dk": group_sum(sm * np.einsum("bhts,bthe->bshe", dscaled, q)),
    "dv": group_sum(np.einsum("bhts,bthe->bshe", p, do)),
  }
  aq, ak, av, ado = np.abs(q), np.abs(kk), np.abs(vv), np.abs(do)
  lmax = np.max(np.where(vis, np.einsum("bthe,bshe->bhts", aq, ak) * sm, 0.0), axis=-1)
  lmax += 0.0 if tanh is None else 5 * logit_softcap
  pv = np.einsum("bhts,bshe->bthe", p, av)
  lmax_t = np.moveaxis(lmax, 1, 2)[..., None]  # [b, t, h, 1]
  scale_out = pv + lmax_t * (pv + np.abs(out))
  d_bht = np.einsum("bthe,bthe->bht", ado, np.abs(out) + scale_out)
  ds_scale = p * (
    np.einsum("bthe,bshe->bhts", ado, av)
    + d_bht[..., None]
    + 2 * lmax[..., None] * np.abs(dp - delta[..., None])
  ) + np.abs(ds)
  if tanh is not None:
    ds_scale = ds_scale * (1 - tanh**2 + 10 * tolerance.UNIT_ROUNDOFF) + 10 * np.abs(ds)
  scales = {
    "out": scale_out,
    "dq": sm * np.einsum("bhts,bshe->bthe", ds_scale, ak),
    "dk": group_sum(sm * np.einsum("bhts,bthe->bshe", ds_scale, aq)),
    "dv": group_sum(np.einsum("bhts,bthe->bshe", p * (1 + 2 * lmax[..., None]), ado)),
  }
  terms = {"out": e + s, "dq": 2 * e + s + t, "dk": 2 * e + s + t, "dv": 2 * e + s + t}
  empty_q = ~vis[:, 0].any(-1)  # [b, t]: queries that see no key
  unseen_kv = ~vis[:, 0].any(-2)  # [b, s]: keys nobody sees
  return want, scales, terms, (empty_q, unseen_kv)


def _assert_matches(got, want, oracle, dtype, *, exact):
  """`got` (a dict of NAMES) matches `want` within rounding; queries that see nothing and keys
  nobody sees get exact zeros."""
  _, scales, terms, (empty_q, unseen_kv) = oracle
  for name in NAMES:
    g, w = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
    assert g.shape == w.shape, name
    assert np.all(np.isfinite(g)), f"{name}: NaN/inf (an unwritten, poisoned block?)"
    zero = empty_q if name in ("out", "dq") else unseen_kv
    np.testing.assert_array_equal(g[zero], 0.0, err_msg=f"{name} where nothing is visible")
    if dtype == jnp.bfloat16:
      allowed = BF16_TOL * (scales[name] + np.abs(w))
      bad = np.abs(g - w) > allowed
      assert not bad.any(), (
        f"{name}: {bad.sum()} elements off by more than {BF16_TOL} of their scale; worst "
        f"{np.max(np.abs(g - w) / allowed):.3g}x"
      )
    else:
      tolerance.assert_close(g, w, n=terms[name], scale=scales[name], exact=exact, err_msg=name)


# ----------------------------------------------------------------------------- reference

# (g, e, dtype, layout, causal, block_sizes): several blocks each way (blocks that divide
# nothing, different backward blocks), one block each way, both dtypes, GQA 1/2/4.
REFERENCE_CASES = [
  (
    1,
    64,
    jnp.float32,
    "packed",
    True,
    BlockSizes(block_q=16, block_kv=24, block_q_bwd=32, block_kv_bwd=8),
  ),
  (4, 128, jnp.float32, "prefill", True, BlockSizes(block_q=8, block_kv=16)),
  (2, 64, jnp.bfloat16, "packed", False, None),
]


@pytest.mark.parametrize("g,e,dtype,layout,causal,block_sizes", REFERENCE_CASES)
def test_reference_matches_numpy_oracle(g, e, dtype, layout, causal, block_sizes):
  b, k = 2, 2
  t, s = (72, 72) if layout == "packed" else (24, 56)
  qkv, ids, cot = _make_inputs(
    _rng("ref", g, e, layout), b=b, t=t, s=s, h=g * k, k=k, e=e, dtype=dtype, layout=layout
  )
  got = _outputs(qkv, ids, cot, causal=causal, impl="reference", block_sizes=block_sizes)
  assert got["out"].dtype == dtype and got["dk"].dtype == dtype
  oracle = _oracle(qkv, ids, cot, causal=causal)
  _assert_matches(got, oracle[0], oracle, dtype, exact=True)


def test_auto_is_reference_on_cpu_and_under_jit_and_ids_default_to_one_causal_segment():
  """No ids: one segment per row, positions arange (`dot_attention` over a whole row)."""
  qkv, _, _ = _make_inputs(
    _rng("auto"), b=2, t=24, s=24, h=4, k=2, e=16, dtype=jnp.float32, layout="packed"
  )
  zeros = jnp.zeros((2, 24), jnp.int32)
  ids = (zeros, zeros, *(jnp.broadcast_to(jnp.arange(24), (2, 24)),) * 2)
  want, scales, terms, _ = _oracle(qkv, ids, jnp.zeros((2, 24, 4, 16)))
  for out in (flash_attention(*qkv), jax.jit(flash_attention)(*qkv)):
    tolerance.assert_close(out, want["out"], n=terms["out"], scale=scales["out"], exact=True)


# ----------------------------------------------------------------------------- kernels

# (dtype, g, e, b, t, s, layout, block sizes per kernel), shared by both kernels, whose outputs
# are compared with the reference's on the same inputs. Case 0: several blocks each way (the
# TPU's key blocks are 128 tokens at least): a sequence across blocks (the online softmax over
# several key blocks), skipped blocks, two sequences and padding in one block. Case 1: a
# prefill chunk after cached keys of different lengths, with padding keys and queries;
# whole-length blocks on the TPU, several blocks on the GPU.
KERNEL_CASES = [
  (
    jnp.float32,
    4,
    128,
    1,
    256,
    256,
    "packed_long",
    {
      "pallas_tpu": BlockSizes(block_q=128, block_kv=128, block_q_bwd=128, block_kv_bwd=128),
      # dq tiled apart from dk/dv (transposed blocks: its walks differ from dk/dv's)
      "pallas_gpu": BlockSizes(
        block_q=64, block_kv=32, block_q_bwd=32, block_kv_bwd=64, block_q_dq=64, block_kv_dq=32
      ),
    },
  ),
  (
    jnp.bfloat16,
    1,
    64,
    2,
    40,
    72,
    "prefill",
    {
      "pallas_tpu": None,
      "pallas_gpu": BlockSizes(block_q=16, block_kv=32, block_q_bwd=16, block_kv_bwd=16),
    },
  ),
]


@functools.cache
def _kernel_case(index: int):
  """Inputs, reference outputs and oracle of KERNEL_CASES[index], computed once."""
  dtype, g, e, b, t, s, layout, _ = KERNEL_CASES[index]
  k = 2 if g == 1 else 1
  qkv, ids, cot = _make_inputs(
    _rng("kernel", index), b=b, t=t, s=s, h=g * k, k=k, e=e, dtype=dtype, layout=layout
  )
  ref = _outputs(qkv, ids, cot, impl="reference")
  return qkv, ids, cot, ref, _oracle(qkv, ids, cot)


@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_matches_reference(impl, case):
  dtype, *_, block_sizes = KERNEL_CASES[case]
  qkv, ids, cot, ref, oracle = _kernel_case(case)
  if case == 0:  # the first query block skips the second key block, the second sees both
    bs = block_sizes[impl]
    meta = reference.pad_metadata(reference.Metadata(*ids), 256, 256)
    maybe = np.asarray(reference.block_visibility(meta, bq=bs.block_q, bk=bs.block_kv, causal=True))
    assert not maybe.all() and maybe[:, -1].sum(-1).min() > 1
  got = _outputs(qkv, ids, cot, impl=impl, block_sizes=block_sizes[impl], interpret=True)
  for name, x in got.items():
    assert x.dtype == dtype and x.shape == ref[name].shape, name
  _assert_matches(got, ref, oracle, dtype, exact=False)


@pytest.mark.parametrize("impl", KERNELS)
def test_interpret_really_runs_the_pallas_kernels(impl):
  """Forward: one kernel; gradient: the forward, dq and dk/dv kernels, no XLA fallback."""
  qkv, ids, cot = _make_inputs(
    _rng("jaxpr", impl), b=1, t=16, s=16, h=2, k=1, e=16, dtype=jnp.float32, layout="packed"
  )
  fwd = functools.partial(_call, ids=ids, impl=impl, interpret=True)
  jaxpr = str(jax.make_jaxpr(lambda *qkv: fwd(qkv))(*qkv))
  assert jaxpr.count("pallas_call") == 1
  if impl == "pallas_tpu":  # the Mosaic TPU interpreter, which simulates DMAs and semaphores
    assert "InterpretParams" in jaxpr
  grad = jax.grad(lambda *qkv: jnp.sum(fwd(qkv) * cot), argnums=(0, 1, 2))
  assert str(jax.make_jaxpr(grad)(*qkv)).count("pallas_call") == 3
  ref = functools.partial(_call, ids=ids, impl="reference")
  assert "pallas_call" not in str(jax.make_jaxpr(lambda *qkv: ref(qkv))(*qkv))


def test_gpu_default_block_sizes():
  bs = gpu_kernel.resolve_block_sizes(None, t=4096, s=4096, e=128)
  assert (bs.block_q, bs.block_kv, bs.num_warps) == (128, 64, 8)
  assert (bs.block_q_dq, bs.block_kv_dq) == (bs.block_q_bwd, bs.block_kv_bwd) == (64, 64)
  apart = gpu_kernel.resolve_block_sizes(
    BlockSizes(block_q_bwd=32, block_kv_bwd=128, block_kv_dq=32), t=4096, s=4096, e=128
  )
  assert (apart.block_q_dq, apart.block_kv_dq) == (32, 32)
  f32 = gpu_kernel.resolve_block_sizes(None, t=4096, s=4096, e=128, itemsize=4)
  assert (f32.block_q, f32.block_kv, f32.block_q_bwd, f32.block_kv_bwd) == (64, 64, 64, 32)
  assert (f32.block_q_dq, f32.block_kv_dq) == (64, 32)
  small = gpu_kernel.resolve_block_sizes(None, t=5, s=3, e=64)
  assert (small.block_q, small.block_kv, small.block_q_bwd, small.num_warps) == (16, 16, 16, 4)


def test_tpu_default_block_sizes():
  bs, t_pad, s_pad = tpu_kernel.resolve_block_sizes(None, t=1000, s=1000, dtype=jnp.bfloat16)
  assert (bs.block_q, bs.block_kv, t_pad, s_pad) == (512, 512, 1024, 1024)
  whole, t_pad, s_pad = tpu_kernel.resolve_block_sizes(None, t=40, s=72, dtype=jnp.float32)
  assert (whole.block_q, whole.block_kv, t_pad, s_pad) == (40, 72, 40, 72)


# ----------------------------------------------------------------------------- sliding window

# (layout, t, s, window), float32: packed rows (positions restart in each segment, padding)
# with a window of 1 (a query sees itself alone), one across several blocks (of a short
# sequence and a long one crossing the middle: late query blocks skip the first key block, on
# the TPU's 128-token blocks too), and one past the row (the same as no window); a prefill
# chunk after cached keys of different lengths, its window smaller than a block reaching into
# the cache (across a block boundary on the GPU).
WINDOW_CASES = [
  ("packed", 64, 64, 1),
  ("packed_long", 256, 256, 40),
  ("packed", 64, 64, 1000),
  ("prefill", 24, 56, 5),
]
# Several blocks each way (the TPU's fewest: each interpreted grid step costs), the backward's
# apart from the forward's.
WINDOW_BLOCKS = {
  "reference": BlockSizes(block_q=16, block_kv=16, block_q_bwd=32, block_kv_bwd=8),
  "pallas_tpu": BlockSizes(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=128),
  "pallas_gpu": BlockSizes(
    block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=32, block_q_dq=32, block_kv_dq=16
  ),
}


@pytest.mark.parametrize("case", range(len(WINDOW_CASES)))
@pytest.mark.parametrize("impl", IMPLS)
def test_sliding_window_matches_dense_oracle(impl, case):
  """Output and gradients against the float64 oracle of the rule with the window; where the
  window covers every earlier position, that is the oracle without one."""
  layout, t, s, window = WINDOW_CASES[case]
  b = 2 if layout == "prefill" else 1  # the prefill rows' caches differ
  qkv, ids, cot = _make_inputs(
    _rng("window", case), b=b, t=t, s=s, h=2, k=1, e=16, dtype=jnp.float32, layout=layout
  )
  blocks = WINDOW_BLOCKS[impl]
  if layout == "packed_long":  # the window, not causality, drops block pairs

    def maybe(w):
      meta = reference.pad_metadata(reference.Metadata(*ids), t, s)
      bq, bk = blocks.block_q, blocks.block_kv
      return np.asarray(reference.block_visibility(meta, bq=bq, bk=bk, causal=True, window=w))

    assert (maybe(None) & ~maybe(window)).any()
  kwargs = {"impl": impl, "block_sizes": blocks, "sliding_window": window}
  got = _outputs(qkv, ids, cot, **kwargs, **({} if impl == "reference" else {"interpret": True}))
  oracle = _oracle(qkv, ids, cot, sliding_window=window if window < s else None)
  _assert_matches(got, oracle[0], oracle, jnp.float32, exact=True)


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def small():
  qkv, ids, _ = _make_inputs(
    _rng("errors"), b=2, t=16, s=16, h=4, k=2, e=16, dtype=jnp.float32, layout="packed"
  )
  return qkv, ids


def test_unknown_impl_lists_the_options(small):
  qkv, _ = small
  with pytest.raises(ValueError, match="auto.*reference.*pallas_tpu.*pallas_gpu"):
    flash_attention(*qkv, impl="triton")


def test_bad_inputs(small):
  (q, k, v), (seg, _, pos, _) = small
  bad = [
    ((q[0], k, v), {}, r"q must be \[batch, q_len"),
    ((q, k[0], v), {}, r"k must be \[batch, kv_len"),
    ((q, k, v[:, :-1]), {}, "same shape"),
    ((q, k, v.astype(jnp.bfloat16)), {}, "same dtype"),
    ((q.astype(jnp.int32), k, v), {}, "floating"),
    ((q[:1], k, v), {}, "batch"),
    ((q[..., :8], k, v), {}, "head_dim"),
    ((q[:, :, :3], k, v), {}, "multiple of num_kv_heads"),
    ((q, k, v), {"q_segment_ids": seg[:, :-1]}, r"q_segment_ids must be \[batch, q_len\]"),
    ((q, k, v), {"kv_positions": pos[:1]}, r"kv_positions must be \[batch, kv_len\]"),
    ((q, k, v), {"q_positions": pos * 1.0}, "integer"),
    ((q[:, :8], k, v), {}, "needs q_positions and kv_positions"),
    ((q[:, :8], k, v), {"q_segment_ids": seg[:, :8]}, "both q_segment_ids and kv_segment_ids"),
    ((q, k, v), {"causal": 1}, "causal must be a bool"),
    ((q, k, v), {"sm_scale": 0.0}, "sm_scale > 0"),
    ((q, k, v), {"sm_scale": -0.1}, "sm_scale > 0"),
    ((q, k, v), {"sliding_window": 4, "causal": False}, "sliding_window=4 needs causal=True"),
    ((q, k, v), {"sliding_window": 0}, "sliding_window must be None or a Python int"),
    ((q, k, v), {"sliding_window": 4.0}, "sliding_window must be None or a Python int"),
    ((q, k, v), {"sliding_window": True}, "sliding_window must be None or a Python int"),
    ((q, k, v), {"sliding_window": 2**31}, "sliding_window must be None or a Python int"),
    ((q, k, v), {"logit_softcap": 0.0}, "logit_softcap must be None or a Python float > 0"),
    ((q, k, v), {"logit_softcap": -50.0}, "logit_softcap must be None or a Python float > 0"),
    ((q, k, v), {"logit_softcap": float("nan")}, "logit_softcap must be None or a Python float"),
    ((q, k, v), {"logit_softcap": True}, "logit_softcap must be None or a Python float > 0"),
    ((q, k, v), {"logit_softcap": "50"}, "logit_softcap must be None or a Python float > 0"),
    ((q, k, v), {"logit_softcap": jnp.float32(50)}, "logit_softcap must be None or a Python"),
    ((q, k, v), {"logit_softcap": float("inf")}, "logit_softcap must be finite"),
  ]
  for args, kwargs, match in bad:
    with pytest.raises(ValueError, match=match):
      flash_attention(*args, **kwargs)


def test_empty_shapes_give_zeros(small):
  (q, k, v), _ = small
  assert flash_attention(q[:0], k[:0], v[:0]).shape == (0, *q.shape[1:])
  out = flash_attention(q, k[:, :0], v[:, :0], causal=False)
  np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize(
  "fields,match",
  [
    ({"block_q": 0}, "positive int"),
    ({"block_kv": -128}, "positive int"),
    ({"block_q_bwd": 64.0}, "positive int"),
    ({"block_kv_bwd": True}, "positive int"),
    ({"num_warps": 3}, "power of two"),
    ({"num_warps_bwd": 6}, "num_warps_bwd must be a power of two"),
    ({"num_stages_bwd": 0}, "positive int"),
  ],
)
def test_bad_block_sizes(fields, match):
  with pytest.raises(ValueError, match=match):
    BlockSizes(**fields)


def test_block_sizes_an_impl_cannot_use():
  qkv, ids, _ = _make_inputs(
    _rng("blocks"), b=1, t=300, s=300, h=2, k=1, e=32, dtype=jnp.bfloat16, layout="packed"
  )
  run = functools.partial(_call, qkv, ids)
  with pytest.raises(ValueError, match="GPU setting"):
    run(impl="pallas_tpu", interpret=True, block_sizes=BlockSizes(num_warps=4))
  with pytest.raises(ValueError, match="GPU setting"):
    run(impl="reference", block_sizes=BlockSizes(num_stages=3))
  with pytest.raises(ValueError, match="num_warps_bwd=8 is a GPU setting; impl='pallas_tpu'"):
    run(impl="pallas_tpu", interpret=True, block_sizes=BlockSizes(num_warps_bwd=8))
  with pytest.raises(ValueError, match="num_stages_bwd=3 is a GPU setting; impl='reference'"):
    run(impl="reference", block_sizes=BlockSizes(num_stages_bwd=3))
  with pytest.raises(ValueError, match="block_q_dq=64 is a GPU setting; impl='pallas_tpu'"):
    run(impl="pallas_tpu", interpret=True, block_sizes=BlockSizes(block_q_dq=64))
  with pytest.raises(ValueError, match="block_kv_dq to be a power of two >= 16"):
    run(impl="pallas_gpu", interpret=True, block_sizes=BlockSizes(block_kv_dq=48))
  with pytest.raises(ValueError, match="block_q to be a multiple of 16"):
    run(impl="pallas_tpu", interpret=True, block_sizes=BlockSizes(block_q=8))
  with pytest.raises(ValueError, match="block_kv_bwd to be a multiple of 128"):
    run(impl="pallas_tpu", interpret=True, block_sizes=BlockSizes(block_kv_bwd=64))
  with pytest.raises(ValueError, match="power of two >= 16"):
    run(impl="pallas_gpu", interpret=True, block_sizes=BlockSizes(block_q=48))
  with pytest.raises(ValueError, match="power of two >= 16"):
    run(impl="pallas_gpu", interpret=True, block_sizes=BlockSizes(block_kv=8))
  with pytest.raises(ValueError, match="block_sizes must be"):
    run(impl="pallas_gpu", interpret=True, block_sizes={"block_q": 16})
  odd = tuple(x[..., :24] for x in qkv)
  with pytest.raises(ValueError, match="head_dim to be a power of two"):
    _call(odd, ids, impl="pallas_gpu", interpret=True)


def test_interpret_needs_a_kernel(small):
  qkv, _ = small
  with pytest.raises(ValueError, match="interpret"):
    flash_attention(*qkv, impl="reference", interpret=True)
  with pytest.raises(ValueError, match="name the kernel"):
    flash_attention(*qkv, interpret=True)


# ----------------------------------------------------------------------------- on a GPU

# Compiled (not interpreted) on a real GPU: `JAX_PLATFORMS=cuda pytest -m gpu` on a machine
# with one. Elsewhere these are reported as skipped. The kernel is checked against the float64
# oracle, since XLA's GPU matmuls in the reference may use TF32 for float32.
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")


# The defaults, and the backward tiled as the tuning sweep's candidates do: dk/dv at 32 x 128
# with warps and stages of its own, dq apart at 128 x 32.
GPU_TILINGS = {
  "default": None,
  "dq_apart": BlockSizes(
    block_q_bwd=32,
    block_kv_bwd=128,
    num_warps_bwd=8,
    num_stages_bwd=3,
    block_q_dq=128,
    block_kv_dq=32,
  ),
}


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
  "dtype,tiling",
  # The dq-apart tiling is a bf16 one: float32's TF32 parts take twice the shared memory.
  [(jnp.bfloat16, "default"), (jnp.bfloat16, "dq_apart"), (jnp.float32, "default")],
)
def test_gpu_kernel_compiled_matches_oracle(dtype, tiling):
  qkv, ids, cot = _make_inputs(
    _rng("gpu", dtype), b=2, t=512, s=512, h=16, k=8, e=128, dtype=dtype, layout="packed"
  )
  got = _outputs(qkv, ids, cot, impl="pallas_gpu", block_sizes=GPU_TILINGS[tiling])
  oracle = _oracle(qkv, ids, cot)
  _assert_matches(got, oracle[0], oracle, dtype, exact=True)
