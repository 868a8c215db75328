"""Paged attention: reference vs a numpy oracle, both Pallas kernels in interpret mode vs the
reference on poisoned caches, the GPU kernel's ways to multiply (tensor-core dots at each
precision, CUDA-core sums) vs the oracle, and input errors (sliding windows:
`paged_attention_window_test.py`; lowering for TPU and CUDA: `paged_attention_lowering_test.py`;
the tilings the kernels choose: `paged_attention_tiling_test.py`).

Shapes: n sequences, h query heads, k kv heads, g = h // k, d head dim, p pages in the pool,
s tokens per page, m pages per sequence.
"""

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl.kernels.paged_attention import BlockSizes, paged_attention
from jaxrl.kernels.paged_attention import pallas_gpu as gpu_kernel

KERNELS = ("pallas_tpu", "pallas_gpu")
# bfloat16 inputs and outputs: a few bf16 ulps (2**-7 relative) apart.
BF16_TOL = 3e-2
# Error of one float32 product, relative to its size, beyond float32 rounding. 3xTF32 (the GPU
# kernel's default for float32): operands split as x = hi + lo + e with |lo| <= 2**-11 |x| and
# |e| <= 2**-22 |x|; hi*hi + lo*hi + hi*lo leaves out lo*lo and the two e terms, each <= 2**-22.
TF32X3_ERROR = 3 * 2.0**-22
# One TF32 pass (precision="default"): hi*hi with |x - hi| <= 2**-11 |x| on both sides.
TF32_ERROR = 2 * 2.0**-11 + 2.0**-22


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _lengths(rng, n, s, m):
  """Ragged lengths that always include 0, 1 and exactly full pages (and a full sequence)."""
  special = [0, 1, s, min(2 * s, m * s), m * s]
  rest = rng.integers(1, m * s + 1, size=max(0, n - len(special)))
  return np.array((special + list(rest))[:n], np.int32)


def _make_inputs(rng, *, n, h, k, d, s, m, dtype, lengths=None):
  """A pool where every slot that no sequence owns, or that lies past its length, is NaN.

  Page 0 is a pure-NaN page that every unused page-table entry points at; used pages are a
  random permutation of the rest of the pool.
  """
  lengths_n = _lengths(rng, n, s, m) if lengths is None else np.asarray(lengths, np.int32)
  p = n * m + 1
  q_nhd = rng.standard_normal((n, h, d)).astype(np.float32)
  k_kpsd = np.full((k, p, s, d), np.nan, np.float32)
  v_kpsd = np.full((k, p, s, d), np.nan, np.float32)
  page_indices_nm = np.zeros((n, m), np.int32)
  owned = rng.permutation(np.arange(1, p))
  for b in range(n):
    length = int(np.clip(lengths_n[b], 0, m * s))
    used = -(-length // s)
    page_indices_nm[b, :used] = owned[b * m : b * m + used]
    for t in range(length):
      page, slot = page_indices_nm[b, t // s], t % s
      k_kpsd[:, page, slot] = rng.standard_normal((k, d))
      v_kpsd[:, page, slot] = rng.standard_normal((k, d))
  cast = lambda x: jnp.asarray(x, dtype)
  return (
    cast(q_nhd),
    cast(k_kpsd),
    cast(v_kpsd),
    jnp.asarray(lengths_n),
    jnp.asarray(page_indices_nm),
  )


def _heads_f64(q_nhd, k_kpsd, v_kpsd, lengths_n, page_indices_nm, sm_scale, sliding_window=None):
  """Yields (sequence, head, its query, keys, values, softmax weights) in float64 for every
  sequence with a positive length: dense attention, one sequence and head at a time, over the
  positions `[max(0, length - sliding_window), length)` (transformers' rule `kv_idx > q_idx -
  sliding_window` with the query at `length - 1`) or, without a window, `[0, length)`."""
  q, kp, vp = (np.asarray(x, np.float64) for x in (q_nhd, k_kpsd, v_kpsd))
  _, h, d = q.shape
  k, _, s, _ = kp.shape
  m = page_indices_nm.shape[1]
  for b in range(q.shape[0]):
    length = int(np.clip(lengths_n[b], 0, m * s))
    start = 0 if sliding_window is None else max(0, length - sliding_window)
    pages = np.asarray(page_indices_nm[b])
    for i in range(h if length else 0):
      kv = i // (h // k)
      keys = kp[kv, pages].reshape(m * s, d)[start:length]
      values = vp[kv, pages].reshape(m * s, d)[start:length]
      logits = keys @ q[b, i] * sm_scale
      weights = np.exp(logits - logits.max())
      yield b, i, q[b, i], keys, values, weights / weights.sum()


def _numpy_oracle(q_nhd, k_kpsd, v_kpsd, lengths_n, page_indices_nm, sm_scale, sliding_window=None):
  """Dense float64 attention (0 for sequences of length 0), within the window if given."""
  out = np.zeros(q_nhd.shape)
  for b, i, _, _, values, weights in _heads_f64(
    q_nhd, k_kpsd, v_kpsd, lengths_n, page_indices_nm, sm_scale, sliding_window
  ):
    out[b, i] = weights @ values
  return out


def _rounding_sums(q_nhd, k_kpsd, v_kpsd, lengths_n, page_indices_nm, sm_scale, sliding_window):
  """(terms, scale per output element) of float32 rounding in attention: the output sums up to
  m * s weighted values, sum_t w_t |v_t| in absolute value; each logit sums d products, and
  logits off by e relative to the sum of their |products| move the output by up to
  e * sum_t w_t |v_t - out|."""
  d, s, m = q_nhd.shape[-1], k_kpsd.shape[2], page_indices_nm.shape[1]
  scale = np.zeros(q_nhd.shape)
  for b, i, q_d, keys, values, weights in _heads_f64(
    q_nhd, k_kpsd, v_kpsd, lengths_n, page_indices_nm, sm_scale, sliding_window
  ):
    logit_sums = np.abs(keys) @ np.abs(q_d) * abs(sm_scale)
    spread = weights @ np.abs(values - weights @ values)
    scale[b, i] = weights @ np.abs(values) + logit_sums.max() * spread
  return max(d, m * s), scale


def _assert_close(out, ref, dtype, args, sm_scale=None, products_error=0.0, sliding_window=None):
  """`out` matches `ref`, both attention over `args` = (q, k pages, v pages, lengths, page
  indices) within `sliding_window`; sm_scale defaults to d**-0.5 as in paged_attention. For
  float32, `out`'s products may be off by `products_error` of their size (split precision) on
  top of rounding."""
  out, ref = np.asarray(out, np.float32), np.asarray(ref)
  assert out.shape == ref.shape
  assert np.all(np.isfinite(out)), "NaN/inf leaked from the poisoned cache or output buffer"
  empty = np.asarray(args[3]) <= 0
  np.testing.assert_array_equal(out[empty], 0.0)
  if dtype == jnp.bfloat16:
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=BF16_TOL, rtol=BF16_TOL)
  else:
    sm_scale = out.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    n, scale = _rounding_sums(*args, sm_scale, sliding_window)
    # Against the float64 oracle only `out` rounds.
    exact = ref.dtype == np.float64
    # Products off by a fraction e of their size move each logit by e times the sum of its
    # |products| and each weighted sum of values by e times sum_t w_t |v_t|: e * scale in all
    # (`_rounding_sums`), added once (only `out` has it) to what rounding allows.
    rounding = (1 if exact else 2) * tolerance.LAMBDA * math.sqrt(n) * tolerance.UNIT_ROUNDOFF
    scale = scale * (1 + products_error / rounding)
    tolerance.assert_close(out, ref, n=n, scale=scale, exact=exact)


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize(
  "g,s,dtype", [(1, 8, jnp.float32), (4, 16, jnp.float32), (2, 8, jnp.bfloat16)]
)
def test_reference_matches_numpy_oracle(g, s, dtype):
  n, k, d, m = 6, 2, 32, 3
  args = _make_inputs(_rng("ref", g, s), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=dtype)
  out = paged_attention(*args, impl="reference")
  assert out.dtype == dtype
  ref = _numpy_oracle(*args, sm_scale=d**-0.5)
  _assert_close(out, ref, dtype, args)


def test_auto_is_reference_on_cpu_and_under_jit():
  args = _make_inputs(_rng("auto"), n=5, h=4, k=2, d=16, s=8, m=3, dtype=jnp.float32)
  ref = paged_attention(*args, impl="reference")
  np.testing.assert_array_equal(paged_attention(*args), ref)
  np.testing.assert_array_equal(jax.jit(paged_attention)(*args), ref)


def test_lengths_are_clipped_and_sm_scale_is_used():
  n, h, k, d, s, m = 4, 4, 1, 16, 8, 2
  wild = jnp.array([-3, 1, 1000, 9], jnp.int32)
  clipped = jnp.clip(wild, 0, m * s)
  q, kp, vp, _, pages = _make_inputs(
    _rng("clip"), n=n, h=h, k=k, d=d, s=s, m=m, dtype=jnp.float32, lengths=clipped
  )
  ref = _numpy_oracle(q, kp, vp, clipped, pages, sm_scale=0.3)
  for impl, interpret in (("reference", False), ("pallas_gpu", True), ("pallas_tpu", True)):
    out = paged_attention(q, kp, vp, wild, pages, sm_scale=0.3, impl=impl, interpret=interpret)
    error = TF32X3_ERROR if impl == "pallas_gpu" else 0.0
    _assert_close(
      out, ref, jnp.float32, (q, kp, vp, clipped, pages), sm_scale=0.3, products_error=error
    )


# ----------------------------------------------------------------------------- kernels

# (g, page_size, dtype, kv heads, head_dim, pages per sequence): GQA 1/2/3/4/8, pages of 8 to
# 64 tokens, both dtypes; not the full cross product, to keep the file fast on 2 cores. The
# first six (every g, page size and dtype) run by default, the other four are `slow`.
_SLOW = pytest.mark.slow
KERNEL_CASES = [
  (1, 8, jnp.float32, 2, 32, 5),
  (2, 16, jnp.bfloat16, 2, 64, 4),
  (4, 32, jnp.float32, 2, 32, 3),
  (8, 64, jnp.bfloat16, 1, 64, 2),
  pytest.param(4, 8, jnp.bfloat16, 2, 16, 6, marks=_SLOW),
  pytest.param(8, 16, jnp.float32, 2, 32, 4, marks=_SLOW),
  pytest.param(1, 64, jnp.float32, 4, 16, 2, marks=_SLOW),
  pytest.param(2, 32, jnp.bfloat16, 2, 32, 3, marks=_SLOW),
  # g not a power of two: the GPU kernel's padded-heads path (dots for bf16, sums for float32).
  (3, 16, jnp.bfloat16, 2, 32, 3),
  (3, 16, jnp.float32, 2, 32, 3),
]


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("g,s,dtype,k,d,m", KERNEL_CASES)
def test_kernel_matches_reference(impl, g, s, dtype, k, d, m):
  n = 7
  args = _make_inputs(_rng(impl, g, s, k, d, m), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=dtype)
  out = paged_attention(*args, impl=impl, interpret=True)
  assert out.dtype == dtype and out.shape == (n, g * k, d)
  ref = paged_attention(*args, impl="reference")
  _assert_close(out, ref, dtype, args, products_error=TF32X3_ERROR if impl == "pallas_gpu" else 0)


# Block sizes the defaults would not pick: blocks that do not divide the page table, one page
# per block, and (GPU) more parts than blocks, so some parts see no token at all; for the GPU
# both ways to multiply (g = 2 here: CUDA-core sums by default, dots with dot_min_group=1).
BLOCK_CASES = [
  ("pallas_tpu", BlockSizes(pages_per_compute_block=1)),
  ("pallas_tpu", BlockSizes(pages_per_compute_block=3)),
  ("pallas_tpu", BlockSizes(pages_per_compute_block=8, num_splits=1)),
  ("pallas_gpu", BlockSizes(pages_per_compute_block=1, num_splits=1)),
  ("pallas_gpu", BlockSizes(pages_per_compute_block=2, num_splits=3, num_warps=8, dot_min_group=1)),
  ("pallas_gpu", BlockSizes(pages_per_compute_block=4, num_splits=4, num_stages=3)),
  ("pallas_gpu", BlockSizes(num_splits=7, dot_min_group=1)),
]


@pytest.mark.parametrize("impl,block_sizes", BLOCK_CASES)
def test_kernel_block_sizes(impl, block_sizes):
  n, k, g, d, s, m = 6, 2, 2, 32, 16, 7
  args = _make_inputs(_rng(impl, block_sizes), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=jnp.float32)
  out = paged_attention(*args, impl=impl, block_sizes=block_sizes, interpret=True)
  error = TF32X3_ERROR if impl == "pallas_gpu" else 0.0
  _assert_close(
    out, paged_attention(*args, impl="reference"), jnp.float32, args, products_error=error
  )


# (g, dtype, precision, dot_min_group, products_error): each way the GPU kernel multiplies, at
# GQA 1, 2, 4 and 8, against the float64 oracle. Float32: 3xTF32 dots (its default from g = 5,
# forced below), one TF32 pass, IEEE dots, and exact CUDA-core sums (its default up to g = 4,
# in KERNEL_CASES, and below g = 16 at "highest"); bfloat16: sums (its default, dots, is in
# KERNEL_CASES).
PRECISION_CASES = [
  (1, jnp.float32, "high", 1, TF32X3_ERROR),
  (2, jnp.float32, None, 1, TF32X3_ERROR),
  (4, jnp.float32, "high", 1, TF32X3_ERROR),
  (8, jnp.float32, None, None, TF32X3_ERROR),
  (2, jnp.float32, "default", 1, TF32_ERROR),
  (4, jnp.float32, "highest", 1, 0.0),
  (8, jnp.float32, "highest", None, 0.0),
  (1, jnp.bfloat16, None, 64, 0.0),
  (8, jnp.bfloat16, None, 64, 0.0),
]


@pytest.mark.parametrize("g,dtype,precision,dot_min_group,products_error", PRECISION_CASES)
def test_gpu_kernel_precisions_match_oracle(g, dtype, precision, dot_min_group, products_error):
  n, k, d, s, m = 5, 2, 32, 16, 4
  rng = _rng("precision", g, dtype, precision, dot_min_group)
  args = _make_inputs(rng, n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=dtype)
  run = functools.partial(
    paged_attention,
    impl="pallas_gpu",
    block_sizes=dot_min_group and BlockSizes(dot_min_group=dot_min_group),
    precision=precision,
    interpret=True,
  )
  precision_enum = jax.lax.Precision(precision or "high")
  dot = g >= (dot_min_group or gpu_kernel.default_dot_min_group(dtype, precision_enum))
  assert ("dot_general" in str(jax.make_jaxpr(run)(*args))) == dot, "not the path meant"
  out = run(*args)
  oracle = _numpy_oracle(*args, sm_scale=d**-0.5)
  _assert_close(out, oracle, dtype, args, products_error=products_error)
  if precision == "default":  # the bound tells one TF32 pass from three
    with pytest.raises(AssertionError):
      _assert_close(out, oracle, dtype, args, products_error=TF32X3_ERROR)


@pytest.mark.parametrize("dma_execution_mode", ["eager", "on_wait"])
def test_tpu_kernel_under_both_dma_modes(dma_execution_mode):
  """Eager DMAs catch a copy into the slot being read; on-wait ones a read before the wait."""
  n, k, g, d, s, m = 5, 2, 2, 32, 8, 6
  args = _make_inputs(
    _rng("dma", dma_execution_mode), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=jnp.float32
  )
  params = pltpu.InterpretParams(dma_execution_mode=dma_execution_mode)
  out = paged_attention(
    *args, impl="pallas_tpu", block_sizes=BlockSizes(pages_per_compute_block=2), interpret=params
  )
  _assert_close(out, paged_attention(*args, impl="reference"), jnp.float32, args)


@pytest.mark.parametrize("impl", KERNELS)
def test_interpret_really_runs_the_pallas_kernel(impl):
  args = _make_inputs(_rng("jaxpr", impl), n=3, h=4, k=2, d=16, s=8, m=2, dtype=jnp.float32)
  jaxpr = str(jax.make_jaxpr(functools.partial(paged_attention, impl=impl, interpret=True))(*args))
  assert "pallas_call" in jaxpr
  if impl == "pallas_tpu":  # the Mosaic TPU interpreter, which simulates DMAs and semaphores
    assert "InterpretParams" in jaxpr
  ref_jaxpr = str(jax.make_jaxpr(functools.partial(paged_attention, impl="reference"))(*args))
  assert "pallas_call" not in ref_jaxpr


@pytest.mark.parametrize("impl", KERNELS)
def test_interpret_mode_poisons_unwritten_outputs(impl):
  """The zero rows checked above prove something only if unwritten outputs read as NaN."""

  def lazy_kernel(x_ref, o_ref):
    del x_ref, o_ref  # writes nothing

  interpret = pltpu.InterpretParams() if impl == "pallas_tpu" else True
  out = pl.pallas_call(
    lazy_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=interpret
  )(jnp.ones((8, 128), jnp.float32))
  assert np.all(np.isnan(np.asarray(out)))


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def small_args():
  return _make_inputs(_rng("errors"), n=3, h=4, k=2, d=16, s=8, m=2, dtype=jnp.float32)


def test_unknown_impl_lists_the_options(small_args):
  with pytest.raises(ValueError, match="auto.*reference.*pallas_tpu.*pallas_gpu"):
    paged_attention(*small_args, impl="triton")


def test_bad_shapes(small_args):
  q, kp, vp, lengths, pages = small_args
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    paged_attention(q[:, :3], kp, vp, lengths, pages)
  with pytest.raises(ValueError, match="page_indices"):
    paged_attention(q, kp, vp, lengths, pages[:2])
  with pytest.raises(ValueError, match="lengths"):
    paged_attention(q, kp, vp, lengths[:2], pages)
  with pytest.raises(ValueError, match="same shape"):
    paged_attention(q, kp, vp[:, :-1], lengths, pages)
  with pytest.raises(ValueError, match="head_dim"):
    paged_attention(q[..., :8], kp, vp, lengths, pages)
  with pytest.raises(ValueError, match="q must be"):
    paged_attention(q[0], kp, vp, lengths, pages)
  with pytest.raises(ValueError, match="integer"):
    paged_attention(q, kp, vp, lengths.astype(jnp.float32), pages)
  with pytest.raises(ValueError, match="same dtype"):
    paged_attention(q, kp, vp.astype(jnp.bfloat16), lengths, pages)


def test_block_sizes_a_kernel_cannot_use(small_args):
  q, kp, vp, lengths, pages = small_args
  run = functools.partial(paged_attention, interpret=True)
  with pytest.raises(ValueError, match="GPU setting"):
    run(*small_args, impl="pallas_tpu", block_sizes=BlockSizes(num_splits=2))
  with pytest.raises(ValueError, match="power of two"):
    run(*small_args, impl="pallas_gpu", block_sizes=BlockSizes(pages_per_compute_block=3))
  with pytest.raises(ValueError, match="GPU setting"):
    run(*small_args, impl="pallas_tpu", block_sizes=BlockSizes(dot_min_group=1))
  with pytest.raises(ValueError, match=">= 16"):
    one_page_dots = BlockSizes(pages_per_compute_block=1, dot_min_group=1)
    run(*small_args, impl="pallas_gpu", block_sizes=one_page_dots)
  with pytest.raises(ValueError, match="block_sizes must be"):
    run(*small_args, impl="pallas_gpu", block_sizes={"pages_per_compute_block": 2})
  odd = _make_inputs(_rng("odd"), n=2, h=2, k=1, d=80, s=4, m=2, dtype=jnp.float32)
  with pytest.raises(ValueError, match="power of two"):
    run(*odd, impl="pallas_gpu")
  with pytest.raises(ValueError, match="multiple of 8"):
    run(*odd, impl="pallas_tpu")


def test_precision_names(small_args):
  with pytest.raises(ValueError, match="precision must be"):
    paged_attention(*small_args, precision="fp32")
  with pytest.raises(ValueError, match="precision must be"):
    paged_attention(*small_args, precision=(jax.lax.Precision.HIGH,) * 2)
  ref = paged_attention(*small_args, impl="reference")
  for precision in ("highest", "float32", jax.lax.Precision.DEFAULT):
    out = paged_attention(*small_args, impl="reference", precision=precision)
    np.testing.assert_array_equal(out, ref)  # the reference always multiplies in float32


@pytest.mark.parametrize("window", [0, -4, 2.0, True, "4", jnp.int32(4)])
def test_bad_sliding_window(small_args, window):
  with pytest.raises(ValueError, match="sliding_window must be None or a Python int >= 1"):
    paged_attention(*small_args, sliding_window=window)


def test_numpy_int_window_is_an_int(small_args):
  out = paged_attention(*small_args, sliding_window=np.int64(3))
  np.testing.assert_array_equal(out, paged_attention(*small_args, sliding_window=3))


def test_auto_runs_the_reference_below_the_threshold(small_args, monkeypatch):
  """`reference_below_tokens` moves impl="auto" to the reference for short capacities only,
  never an impl named by the caller. Traced as if on a GPU (a CPU's auto is the reference)."""
  from jaxrl.kernels import common

  monkeypatch.setitem(common._AUTO, "cpu", "pallas_gpu")
  capacity = small_args[4].shape[1] * small_args[1].shape[2]

  def uses_kernel(threshold, impl="auto"):
    bs = BlockSizes(reference_below_tokens=threshold)
    f = functools.partial(paged_attention, impl=impl, block_sizes=bs)
    return "pallas_call" in str(jax.make_jaxpr(f)(*small_args))

  assert not uses_kernel(capacity + 1)
  assert uses_kernel(capacity)
  assert uses_kernel(capacity + 1, impl="pallas_gpu")


def test_interpret_needs_a_kernel(small_args):
  with pytest.raises(ValueError, match="interpret"):
    paged_attention(*small_args, impl="reference", interpret=True)
  with pytest.raises(ValueError, match="name the kernel"):
    paged_attention(*small_args, interpret=True)


# ----------------------------------------------------------------------------- on a GPU

# Compiled (not interpreted) on a real GPU: `JAX_PLATFORMS=cuda pytest -m gpu` on a machine
# with one. Elsewhere these are reported as skipped. Both the kernel and the reference are
# checked against the float64 oracle, since XLA's GPU matmuls may use TF32 for float32.
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")

# (n, g, k, d, s, m, dtype, block_sizes, precision): model-sized heads, ragged batches, GQA
# 1-8; float32 both as CUDA-core sums (g <= 4) and as tensor-core dots (3xTF32, one TF32 pass).
GPU_CASES = [
  (37, 4, 8, 128, 16, 64, jnp.bfloat16, None, None),
  (37, 4, 8, 128, 16, 64, jnp.float32, None, None),
  (5, 8, 4, 128, 32, 40, jnp.bfloat16, None, None),
  (64, 2, 8, 64, 64, 9, jnp.bfloat16, None, None),
  (9, 1, 16, 128, 8, 33, jnp.float32, BlockSizes(pages_per_compute_block=4, num_splits=3), None),
  (12, 4, 2, 256, 16, 20, jnp.bfloat16, BlockSizes(num_warps=8, num_stages=3), None),
  (16, 8, 2, 128, 16, 48, jnp.float32, None, None),
  (64, 2, 8, 128, 16, 32, jnp.float32, BlockSizes(dot_min_group=1), None),
  (16, 8, 2, 128, 16, 48, jnp.float32, None, "default"),
  (16, 8, 2, 128, 16, 48, jnp.float32, BlockSizes(dot_min_group=1), "highest"),
]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("n,g,k,d,s,m,dtype,block_sizes,precision", GPU_CASES)
def test_gpu_kernel_compiled_matches_oracle(n, g, k, d, s, m, dtype, block_sizes, precision):
  args = _make_inputs(_rng("gpu", n, g, k, d, s, m), n=n, h=g * k, k=k, d=d, s=s, m=m, dtype=dtype)
  out = paged_attention(*args, impl="pallas_gpu", block_sizes=block_sizes, precision=precision)
  assert "pallas_call" in str(
    jax.make_jaxpr(functools.partial(paged_attention, impl="auto", block_sizes=block_sizes))(*args)
  ), "impl='auto' on a GPU should pick the Pallas kernel"
  oracle = _numpy_oracle(*args, sm_scale=d**-0.5)
  error = {"default": TF32_ERROR, "highest": 0.0}.get(precision, TF32X3_ERROR)
  _assert_close(out, oracle, dtype, args, products_error=error)
  _assert_close(paged_attention(*args, impl="reference"), oracle, dtype, args)
