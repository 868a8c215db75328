"""Grouped matmuls: reference vs a float64 numpy oracle, both Pallas kernels in interpret mode
vs the reference (forward, tgmm and gradients), lowering for TPU and CUDA, and input errors.

Shapes: m rows, k contraction dim, n output columns, g groups; tm, tk, tn tiles.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance
from helpers.lowering import TRITON_CALL, export_cuda, triton_modules

from jaxrl.kernels.gmm import BlockSizes, gmm, tgmm

IMPLS = ("reference", "pallas_tpu", "pallas_gpu")
KERNELS = ("pallas_tpu", "pallas_gpu")
BF16_TOL = 2e-2  # float32 sums rounded to bfloat16: a bf16 ulp (2**-7 relative) or two apart
TM = 16  # rows per tile in the multi-tile cases, for both kernels

# Tiles the defaults would not pick, so that the small shapes below span several tiles in every
# dim: 4 row tiles (groups straddle them), 2 k steps and 2-3 column tiles. The TPU needs lane
# dims that are multiples of 128; Triton needs powers of two >= 16.
TILED = {
  "pallas_tpu": BlockSizes(tm=TM, tk=128, tn=128),
  "pallas_gpu": BlockSizes(tm=TM, tk=16, tn=16),
}
TILED_SHAPE = {"pallas_tpu": (64, 256, 256), "pallas_gpu": (64, 32, 40)}  # (m, k, n)


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _group_sizes(rng, g, m) -> np.ndarray:
  """Random sizes with an empty group, a group of 1, one larger than a tile, and sum < m."""
  big = TM + int(rng.integers(1, TM))
  budget = m - 1 - big - 1 - int(rng.integers(0, TM // 2))
  rest = rng.multinomial(int(rng.integers(budget // 2, budget + 1)), [1 / (g - 3)] * (g - 3))
  sizes = rng.permutation(np.array([0, 1, big, *rest], np.int32))
  assert 0 < sizes.sum() < m
  return sizes


def _inputs(rng, m, k, n, g, dtype, sizes=None):
  sizes = _group_sizes(rng, g, m) if sizes is None else np.asarray(sizes, np.int32)
  cast = lambda shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return cast((m, k)), cast((g, k, n)), cast((m, n)), jnp.asarray(sizes)


def _numpy_gmm(lhs, rhs, sizes):
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for group, size in enumerate(np.asarray(sizes)):
    out[start : start + size] = lhs[start : start + size] @ rhs[group]
    start += size
  return out


def _numpy_tgmm(lhs, grad, sizes):
  lhs, grad = np.asarray(lhs, np.float64), np.asarray(grad, np.float64)
  out = np.zeros((len(sizes), lhs.shape[1], grad.shape[1]))
  start = 0
  for group, size in enumerate(np.asarray(sizes)):
    out[group] = lhs[start : start + size].T @ grad[start : start + size]
    start += size
  return out


def _gmm_sums(lhs, rhs, sizes):
  """(terms, sum of |terms|) of each element of gmm(lhs, rhs): float32 rounding scales with
  them, whatever order a kernel adds in."""
  return lhs.shape[1], _numpy_gmm(np.abs(np.asarray(lhs, np.float64)), np.abs(rhs), sizes)


def _tgmm_sums(lhs, grad, sizes):
  """(terms, sum of |terms|) of each element of tgmm(lhs, grad)."""
  rows = max(1, int(np.max(np.asarray(sizes), initial=1)))
  return rows, _numpy_tgmm(np.abs(np.asarray(lhs, np.float64)), np.abs(grad), sizes)


def _assert_close(out, ref, dtype, sums):
  out, ref = np.asarray(out, np.float32), np.asarray(ref)
  assert out.shape == ref.shape
  assert np.all(np.isfinite(out)), "NaN/inf in the output: an unwritten (poisoned) block?"
  if dtype == jnp.bfloat16:
    ref = np.asarray(ref, np.float32)
    atol = BF16_TOL * max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(out, ref, rtol=BF16_TOL, atol=atol)
  else:
    n, scale = sums
    # Against the float64 oracle only `out` rounds.
    exact = ref.dtype == np.float64
    tolerance.assert_close(out, ref, n=n, scale=scale, exact=exact)


def _assert_zero_past_groups(out_mn, sizes):
  np.testing.assert_array_equal(np.asarray(out_mn, np.float32)[int(np.sum(sizes)) :], 0.0)


def _assert_zero_empty_groups(out_gkn, sizes):
  np.testing.assert_array_equal(np.asarray(out_gkn, np.float32)[np.asarray(sizes) == 0], 0.0)


def _kwargs(impl, tiled=True):
  if impl == "reference":
    return {"impl": impl}
  return {"impl": impl, "interpret": True, "block_sizes": TILED[impl] if tiled else None}


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_matches_numpy_oracle(dtype):
  lhs, rhs, grad, sizes = _inputs(_rng("ref", dtype), 40, 24, 20, 6, dtype)
  out = gmm(lhs, rhs, sizes, impl="reference")
  assert out.dtype == dtype and out.shape == (40, 20)
  _assert_close(out, _numpy_gmm(lhs, rhs, sizes), dtype, _gmm_sums(lhs, rhs, sizes))
  _assert_zero_past_groups(out, sizes)
  out = tgmm(lhs, grad, sizes, impl="reference")
  assert out.dtype == dtype and out.shape == (6, 24, 20)
  _assert_close(out, _numpy_tgmm(lhs, grad, sizes), dtype, _tgmm_sums(lhs, grad, sizes))
  _assert_zero_empty_groups(out, sizes)


def test_auto_is_reference_on_cpu_and_under_jit():
  lhs, rhs, grad, sizes = _inputs(_rng("auto"), 40, 24, 20, 5, jnp.float32)
  ref = gmm(lhs, rhs, sizes, impl="reference")
  np.testing.assert_array_equal(gmm(lhs, rhs, sizes), ref)
  np.testing.assert_array_equal(jax.jit(gmm)(lhs, rhs, sizes), ref)
  ref = tgmm(lhs, grad, sizes, impl="reference")
  np.testing.assert_array_equal(jax.jit(tgmm)(lhs, grad, sizes), ref)


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "default_blocks"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", KERNELS)
def test_gmm_kernel_matches_reference(impl, dtype, tiled):
  m, k, n = TILED_SHAPE[impl] if tiled else (40, 24, 40)
  lhs, rhs, _, sizes = _inputs(_rng("gmm", impl, dtype, tiled), m, k, n, 6, dtype)
  out = gmm(lhs, rhs, sizes, **_kwargs(impl, tiled))
  assert out.dtype == dtype and out.shape == (m, n)
  _assert_close(out, gmm(lhs, rhs, sizes, impl="reference"), dtype, _gmm_sums(lhs, rhs, sizes))
  _assert_zero_past_groups(out, sizes)


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "default_blocks"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", KERNELS)
def test_tgmm_kernel_matches_reference(impl, dtype, tiled):
  m, k, n = TILED_SHAPE[impl] if tiled else (40, 24, 40)
  lhs, _, grad, sizes = _inputs(_rng("tgmm", impl, dtype, tiled), m, k, n, 6, dtype)
  out = tgmm(lhs, grad, sizes, **_kwargs(impl, tiled))
  assert out.dtype == dtype and out.shape == (6, k, n)
  ref = tgmm(lhs, grad, sizes, impl="reference")
  _assert_close(out, ref, dtype, _tgmm_sums(lhs, grad, sizes))
  _assert_zero_empty_groups(out, sizes)


@pytest.mark.parametrize("impl", KERNELS)
def test_kernels_never_read_rows_past_the_groups(impl):
  """Rows past the groups may hold anything (a capacity buffer's unused tail): NaN there
  reaches neither gmm's nor tgmm's results."""
  m, k, n = TILED_SHAPE[impl]
  lhs, rhs, grad, sizes = _inputs(_rng("tail", impl), m, k, n, 6, jnp.float32)
  used = int(np.sum(sizes))
  lhs, grad = lhs.at[used:].set(jnp.nan), grad.at[used:].set(jnp.nan)
  out = gmm(lhs, rhs, sizes, **_kwargs(impl))
  _assert_close(out, _numpy_gmm(lhs, rhs, sizes), jnp.float32, _gmm_sums(lhs, rhs, sizes))
  _assert_zero_past_groups(out, sizes)
  out = tgmm(lhs, grad, sizes, **_kwargs(impl))
  _assert_close(out, _numpy_tgmm(lhs, grad, sizes), jnp.float32, _tgmm_sums(lhs, grad, sizes))


# Layouts the random sizes rarely hit: nothing at all, one group taking every row, groups
# aligned to the row tiles, all rows in the last group, and trailing empty groups.
EDGE_SIZES = [(0, 0, 0, 0), (64, 0, 0, 0), (16, 16, 16, 16), (0, 0, 0, 63), (3, 17, 0, 0)]


@pytest.mark.parametrize("sizes", EDGE_SIZES, ids=str)
@pytest.mark.parametrize("impl", KERNELS)
def test_kernels_on_edge_group_layouts(impl, sizes):
  m, k, n = TILED_SHAPE[impl]
  lhs, rhs, grad, sizes = _inputs(_rng("edge", impl, sizes), m, k, n, 4, jnp.float32, sizes)
  out = gmm(lhs, rhs, sizes, **_kwargs(impl))
  _assert_close(out, _numpy_gmm(lhs, rhs, sizes), jnp.float32, _gmm_sums(lhs, rhs, sizes))
  _assert_zero_past_groups(out, sizes)
  out = tgmm(lhs, grad, sizes, **_kwargs(impl))
  _assert_close(out, _numpy_tgmm(lhs, grad, sizes), jnp.float32, _tgmm_sums(lhs, grad, sizes))
  _assert_zero_empty_groups(out, sizes)


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_group_sizes_past_m_are_cut_like_ragged_dot(impl):
  """Under jit the sum cannot be checked: groups end at row m, as with ragged_dot."""
  m, k, n = TILED_SHAPE.get(impl, (64, 32, 40))
  lhs, rhs, grad, _ = _inputs(_rng("past_m", impl), m, k, n, 4, jnp.float32, [0, 0, 0, 0])
  sizes = jnp.array([20, 0, 30, 40], jnp.int32)  # sum 90 > m = 64
  out = jax.jit(functools.partial(gmm, **_kwargs(impl)))(lhs, rhs, sizes)
  cut = np.array([20, 0, 30, 14])
  ref = jax.lax.ragged_dot(lhs, rhs, sizes)
  _assert_close(out, ref, jnp.float32, _gmm_sums(lhs, rhs, cut))
  out = jax.jit(functools.partial(tgmm, **_kwargs(impl)))(lhs, grad, sizes)
  _assert_close(out, _numpy_tgmm(lhs, grad, cut), jnp.float32, _tgmm_sums(lhs, grad, cut))


@pytest.mark.parametrize("impl", KERNELS)
def test_preferred_element_type(impl):
  lhs, rhs, grad, sizes = _inputs(_rng("pet", impl), 40, 24, 40, 5, jnp.bfloat16)
  kwargs = _kwargs(impl, tiled=False)
  out = gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32, **kwargs)
  assert out.dtype == jnp.float32
  _assert_close(out, _numpy_gmm(lhs, rhs, sizes), jnp.float32, _gmm_sums(lhs, rhs, sizes))
  out = tgmm(lhs, grad, sizes, preferred_element_type=jnp.float32, **kwargs)
  assert out.dtype == jnp.float32
  _assert_close(out, _numpy_tgmm(lhs, grad, sizes), jnp.float32, _tgmm_sums(lhs, grad, sizes))


@pytest.mark.parametrize("impl", KERNELS)
def test_interpret_really_runs_the_pallas_kernel(impl):
  lhs, rhs, grad, sizes = _inputs(_rng("jaxpr", impl), 40, 24, 40, 4, jnp.float32)
  for op, args in ((gmm, (lhs, rhs, sizes)), (tgmm, (lhs, grad, sizes))):
    jaxpr = str(jax.make_jaxpr(functools.partial(op, impl=impl, interpret=True))(*args))
    assert "pallas_call" in jaxpr
    if impl == "pallas_tpu":  # the Mosaic TPU interpreter, which simulates DMAs
      assert "InterpretParams" in jaxpr
    assert "pallas_call" not in str(jax.make_jaxpr(functools.partial(op, impl="reference"))(*args))


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_gmm_gradients_match_ragged_dot(impl, dtype):
  m, k, n = TILED_SHAPE.get(impl, (64, 32, 40))
  lhs, rhs, cot, sizes = _inputs(_rng("grad", impl, dtype), m, k, n, 6, dtype)

  def loss(f, lhs, rhs):
    return jnp.sum(f(lhs, rhs).astype(jnp.float32) * cot.astype(jnp.float32))

  ours = functools.partial(gmm, group_sizes=sizes, **_kwargs(impl))
  ref = functools.partial(jax.lax.ragged_dot, group_sizes=sizes)
  dlhs, drhs = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1)))(lhs, rhs)
  ref_dlhs, ref_drhs = jax.grad(functools.partial(loss, ref), argnums=(0, 1))(lhs, rhs)
  assert dlhs.dtype == dtype and drhs.dtype == dtype
  # dlhs = cot @ rhs[g].T over the n columns, drhs = lhs.T @ cot over each group's rows.
  _assert_close(dlhs, ref_dlhs, dtype, _gmm_sums(cot, np.swapaxes(rhs, 1, 2), sizes))
  _assert_close(drhs, ref_drhs, dtype, _tgmm_sums(lhs, cot, sizes))
  _assert_zero_past_groups(dlhs, sizes)
  _assert_zero_empty_groups(drhs, sizes)


@pytest.mark.parametrize("impl", IMPLS)
def test_tgmm_gradients_match_dense_masked_einsum(impl):
  """One tile per dim: this checks the custom_vjp's wiring; the tests above cover tiling."""
  m, k, n = 40, 24, 40
  lhs, _, grad, sizes = _inputs(_rng("tgrad", impl), m, k, n, 5, jnp.float32)
  cot = jnp.asarray(_rng("tgrad_cot", impl).standard_normal((5, k, n)), jnp.float32)
  # Rows past the groups get group id 5, whose one-hot row is all zeros.
  onehot_mg = jax.nn.one_hot(np.searchsorted(np.cumsum(sizes), np.arange(m), side="right"), 5)

  def dense(lhs, grad):
    return jnp.einsum("mg,mk,mn->gkn", onehot_mg, lhs, grad, precision="highest")

  def loss(f, lhs, grad):
    return jnp.sum(f(lhs, grad) * cot)

  ours = functools.partial(tgmm, group_sizes=sizes, **_kwargs(impl, tiled=False))
  got = jax.grad(functools.partial(loss, ours), argnums=(0, 1))(lhs, grad)
  want = jax.grad(functools.partial(loss, dense), argnums=(0, 1))(lhs, grad)
  # d lhs = grad @ cot[g].T over the n columns, d grad = lhs @ cot[g] over the k rows.
  cot_gnk = np.swapaxes(np.asarray(cot), 1, 2)
  sums = (_gmm_sums(grad, cot_gnk, sizes), _gmm_sums(lhs, cot, sizes))
  for g, w, s in zip(got, want, sums, strict=True):
    _assert_close(g, w, jnp.float32, s)


# ----------------------------------------------------------------------------- lowering


def _shapes(op, m, k, n, g, dtype):
  sds = jax.ShapeDtypeStruct
  second = sds((g, k, n), dtype) if op is gmm else sds((m, n), dtype)
  return sds((m, k), dtype), second, sds((g,), jnp.int32)


# (m, k, n, g, dtype, block_sizes): MoE-sized shapes as a model would use them, one ragged.
LOWERING_CASES = [
  (2048, 1024, 768, 8, jnp.bfloat16, None),
  (1000, 384, 200, 5, jnp.float32, None),
  (4096, 512, 1024, 64, jnp.bfloat16, BlockSizes(tm=256, tk=256, tn=256)),
]


def _out_shape(op, m, k, n, g):
  return (m, n) if op is gmm else (g, k, n)


@pytest.mark.parametrize("op", [gmm, tgmm], ids=["gmm", "tgmm"])
@pytest.mark.parametrize("m,k,n,g,dtype,block_sizes", LOWERING_CASES)
def test_tpu_kernel_lowers_for_tpu(op, m, k, n, g, dtype, block_sizes):
  f = functools.partial(op, impl="pallas_tpu", block_sizes=block_sizes)
  exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*_shapes(op, m, k, n, g, dtype))
  assert "tpu_custom_call" in exported.mlir_module()
  (out,) = exported.out_avals
  assert out.shape == _out_shape(op, m, k, n, g) and out.dtype == dtype


# Hopper's default tiles (`gmm_block_sizes`, `tgmm_block_sizes`), which a CPU's lowering, with
# no compute capability to read, does not pick by itself.
HOPPER_TILES = [
  (8192, 2048, 768, 64, jnp.bfloat16, BlockSizes(tm=128, tk=64, tn=128, num_warps=8, num_stages=3)),
  (8192, 2048, 768, 64, jnp.bfloat16, BlockSizes(tm=64, tk=128, tn=128, num_warps=4, num_stages=3)),
]


@pytest.mark.parametrize("op", [gmm, tgmm], ids=["gmm", "tgmm"])
@pytest.mark.parametrize("m,k,n,g,dtype,block_sizes", LOWERING_CASES + HOPPER_TILES)
def test_gpu_kernel_lowers_for_cuda(op, m, k, n, g, dtype, block_sizes):
  f = functools.partial(op, impl="pallas_gpu", block_sizes=block_sizes)
  exported = export_cuda(f, *_shapes(op, m, k, n, g, dtype))
  text = exported.mlir_module()
  assert TRITON_CALL in text
  (out,) = exported.out_avals
  assert out.shape == _out_shape(op, m, k, n, g) and out.dtype == dtype
  modules = triton_modules(text)
  assert len(modules) == 1
  verified, triton_ir = modules[0]
  assert verified and "tt.dot" in triton_ir


@pytest.mark.parametrize("impl", KERNELS)
def test_backward_pass_lowers_to_kernels(impl):
  """The gradient is the transposed gmm and tgmm kernels, not an XLA fallback."""
  m, k, n, g, dtype, _ = LOWERING_CASES[0]

  def loss(lhs, rhs, sizes):
    return jnp.sum(gmm(lhs, rhs, sizes, impl=impl).astype(jnp.float32))

  grad_fn = jax.grad(loss, argnums=(0, 1))
  args = _shapes(gmm, m, k, n, g, dtype)
  if impl == "pallas_tpu":
    text = jax.export.export(jax.jit(grad_fn), platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") == 2
  else:
    text = export_cuda(grad_fn, *args).mlir_module()
    assert text.count(TRITON_CALL) == 2
  assert "ragged_dot" not in text


# ----------------------------------------------------------------------------- GPU layout


@pytest.mark.parametrize("tm", [16, 64])
@pytest.mark.parametrize("g", [1, 7, 128])
def test_gpu_work_tiles_cover_every_row_once_within_one_group(g, tm):
  """The GPU gmm's row tiles: each row of [0, m) in exactly one tile, a tile never crosses a
  group boundary (the rows past the groups are group g), and `cdiv(m, tm) + g` programs are
  enough however the sizes fall (empty groups, groups of one row, all rows in one group)."""
  from jaxrl.kernels.gmm.pallas_gpu import _work_tiles

  rng = _rng("work_tiles", g, tm)
  tiles = jax.jit(_work_tiles, static_argnames=("m", "tm", "num_tiles"))
  for trial, m in enumerate(np.repeat([1, tm - 1, tm, 5 * tm + 3, 599], 4)):
    m = int(m)
    if trial % 4 == 0:
      sizes = np.zeros(g, np.int64)
      sizes[rng.integers(g)] = int(rng.integers(0, m + 1))
    else:
      p = rng.dirichlet(np.full(g, 0.3))
      sizes = rng.multinomial(int(rng.integers(0, m + 1)), p)
    num_tiles = -(-m // tm) + g
    group, start, end = map(
      np.asarray, tiles(jnp.asarray(sizes, jnp.int32), m=m, tm=tm, num_tiles=num_tiles)
    )
    owner = np.full(m, -1)
    bounds = np.concatenate([[0], np.cumsum(sizes), [m]])
    for w in range(num_tiles):
      assert start[w] <= end[w] <= min(start[w] + tm, m)
      if start[w] == end[w]:
        continue
      assert np.all(owner[start[w] : end[w]] == -1), "a row in two tiles"
      owner[start[w] : end[w]] = group[w]
      assert bounds[group[w]] <= start[w] and end[w] <= bounds[group[w] + 1]
    expected = np.repeat(np.arange(g + 1), np.diff(bounds))
    np.testing.assert_array_equal(owner, expected)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("capability", ["9.0", "10.0", "8.0", "8.9", "7.5", None])
def test_gpu_default_tiles_fit_the_shared_memory_of_the_gpu(capability, dtype):
  """Triton fails to compile a kernel whose pipelined operand tiles exceed the GPU's shared
  memory per block: 227 KiB on Hopper-class GPUs, 64 KiB on the smallest (sm_75)."""
  from jaxrl.kernels.gmm.pallas_gpu import gmm_block_sizes, tgmm_block_sizes

  budget = (227 if capability in ("9.0", "10.0") else 64) * 1024
  itemsize = jnp.dtype(dtype).itemsize
  for m, g in [(16384, 8), (16384, 128), (8192, 64), (512, 4)]:
    bs = gmm_block_sizes(m, g, itemsize, capability)
    operands = (bs.tm * bs.tk + bs.tk * bs.tn) * itemsize * bs.num_stages
    assert operands <= budget, (m, g, bs)
    if capability == "9.0" and dtype == jnp.bfloat16:  # the swept tiles, on an H200
      assert (bs.tm, bs.tk, bs.num_warps, bs.num_stages) == (128, 64, 8, 3)
      assert bs.tn == (256 if m >= 256 * g else 128)
  # tgmm streams [tm, tk] of lhs and [tm, tn] of the gradient a step.
  bs = tgmm_block_sizes(itemsize, capability)
  assert (bs.tm * bs.tk + bs.tm * bs.tn) * itemsize * bs.num_stages <= budget, bs
  if capability in ("9.0", "10.0") and dtype == jnp.bfloat16:  # the swept tiles, on an H100
    assert (bs.tm, bs.tk, bs.tn, bs.num_warps, bs.num_stages) == (64, 128, 128, 4, 3)


on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_sizes", [None, BlockSizes(tm=128, tk=64, tn=128, num_warps=8)])
def test_gpu_kernels_compiled_match_oracle(dtype, block_sizes):
  """Compiled by Triton on the GPU: MoE-like sizes (m 1,000 over 24 groups, one empty)."""
  m, k, n, g = 1000, 256, 384, 24
  rng = _rng("gpu", dtype, block_sizes)
  sizes = rng.multinomial(m - 37, np.full(g, 1 / g)).astype(np.int32)
  sizes[3] = 0
  lhs, rhs, grad, sizes = _inputs(rng, m, k, n, g, dtype, sizes)
  out = gmm(lhs, rhs, sizes, impl="pallas_gpu", block_sizes=block_sizes)
  _assert_close(out, _numpy_gmm(lhs, rhs, sizes), dtype, _gmm_sums(lhs, rhs, sizes))
  _assert_zero_past_groups(out, sizes)
  out = tgmm(lhs, grad, sizes, impl="pallas_gpu", block_sizes=block_sizes)
  _assert_close(out, _numpy_tgmm(lhs, grad, sizes), dtype, _tgmm_sums(lhs, grad, sizes))
  _assert_zero_empty_groups(out, sizes)


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def small():
  return _inputs(_rng("errors"), 40, 24, 20, 4, jnp.float32, [10, 0, 5, 20])


def test_unknown_impl_lists_the_options(small):
  lhs, rhs, grad, sizes = small
  with pytest.raises(ValueError, match="auto.*reference.*pallas_tpu.*pallas_gpu"):
    gmm(lhs, rhs, sizes, impl="triton")
  with pytest.raises(ValueError, match="auto.*reference.*pallas_tpu.*pallas_gpu"):
    tgmm(lhs, grad, sizes, impl="megablox")


BAD_GMM_INPUTS = {
  "lhs rank": (lambda a: (a["lhs"][None], a["rhs"], a["sizes"]), r"lhs must be \[m, k\]"),
  "rhs rank": (lambda a: (a["lhs"], a["rhs"][0], a["sizes"]), r"rhs must be \[num_groups, k, n\]"),
  "k mismatch": (lambda a: (a["lhs"][:, :-1], a["rhs"], a["sizes"]), "contraction dims differ"),
  "sizes 2-D": (lambda a: (a["lhs"], a["rhs"], a["sizes"][None]), "group_sizes must be 1-D"),
  "sizes length": (lambda a: (a["lhs"], a["rhs"], a["sizes"][:3]), r"num_groups=4"),
  "sizes float": (lambda a: (a["lhs"], a["rhs"], a["sizes"] * 1.0), "integer"),
  "lhs int": (lambda a: (a["lhs"].astype(jnp.int32), a["rhs"], a["sizes"]), "floating"),
  "dtype mismatch": (lambda a: (a["lhs"], a["rhs"].astype(jnp.bfloat16), a["sizes"]), "same dtype"),
  "sum past m": (lambda a: (a["lhs"], a["rhs"], a["sizes"] + 3), "sum to 47 but lhs has only m=40"),
  "negative": (lambda a: (a["lhs"], a["rhs"], a["sizes"] - 1), "non-negative"),
}


@pytest.mark.parametrize("case", BAD_GMM_INPUTS)
def test_bad_gmm_inputs(small, case):
  lhs, rhs, _, sizes = small
  make_args, match = BAD_GMM_INPUTS[case]
  args = make_args({"lhs": lhs, "rhs": rhs, "sizes": sizes})
  for impl in IMPLS:
    with pytest.raises(ValueError, match=match):
      gmm(*args, impl=impl)


BAD_TGMM_INPUTS = {
  "lhs rank": (lambda a: (a["lhs"][None], a["grad"], a["sizes"]), r"lhs must be \[m, k\]"),
  "grad rank": (lambda a: (a["lhs"], a["grad"][None], a["sizes"]), r"grad must be \[m, n\]"),
  "m mismatch": (lambda a: (a["lhs"], a["grad"][:-1], a["sizes"]), "same rows"),
  "sizes 2-D": (lambda a: (a["lhs"], a["grad"], a["sizes"][None]), "group_sizes must be 1-D"),
  "sizes float": (lambda a: (a["lhs"], a["grad"], a["sizes"] * 1.0), "integer"),
  "grad int": (lambda a: (a["lhs"], a["grad"].astype(jnp.int32), a["sizes"]), "floating"),
  "dtype mismatch": (lambda a: (a["lhs"], a["grad"].astype(jnp.float16), a["sizes"]), "same dtype"),
  "sum past m": (lambda a: (a["lhs"], a["grad"], a["sizes"] * 2), "sum to 70 but lhs has only"),
}


@pytest.mark.parametrize("case", BAD_TGMM_INPUTS)
def test_bad_tgmm_inputs(small, case):
  lhs, _, grad, sizes = small
  make_args, match = BAD_TGMM_INPUTS[case]
  with pytest.raises(ValueError, match=match):
    tgmm(*make_args({"lhs": lhs, "grad": grad, "sizes": sizes}), impl="pallas_gpu", interpret=True)


def test_bad_preferred_element_type(small):
  lhs, rhs, _, sizes = small
  with pytest.raises(ValueError, match="preferred_element_type must be a floating"):
    gmm(lhs, rhs, sizes, preferred_element_type=jnp.int32)


@pytest.mark.parametrize(
  "fields,match",
  [
    ({"tm": 0}, "positive int"),
    ({"tk": -128}, "positive int"),
    ({"tn": 128.0}, "positive int"),
    ({"tm": True}, "positive int"),
    ({"num_warps": 3}, "power of two"),
  ],
)
def test_bad_block_sizes(fields, match):
  with pytest.raises(ValueError, match=match):
    BlockSizes(**fields)


def test_block_sizes_a_kernel_cannot_use():
  lhs, rhs, _, sizes = _inputs(_rng("bad_blocks"), 64, 256, 256, 4, jnp.bfloat16, [8, 8, 8, 8])
  run = functools.partial(gmm, lhs, rhs, sizes, interpret=True)
  with pytest.raises(ValueError, match="GPU setting"):
    run(impl="pallas_tpu", block_sizes=BlockSizes(num_warps=4))
  with pytest.raises(ValueError, match="tm to be a multiple of 16"):
    run(impl="pallas_tpu", block_sizes=BlockSizes(tm=8))
  with pytest.raises(ValueError, match="tk to be a multiple of 128"):
    run(impl="pallas_tpu", block_sizes=BlockSizes(tk=64))
  with pytest.raises(ValueError, match="tn to be a multiple of 128"):
    run(impl="pallas_tpu", block_sizes=BlockSizes(tn=200))
  with pytest.raises(ValueError, match="power of two >= 16"):
    run(impl="pallas_gpu", block_sizes=BlockSizes(tm=48))
  with pytest.raises(ValueError, match="power of two >= 16"):
    run(impl="pallas_gpu", block_sizes=BlockSizes(tk=8))
  with pytest.raises(ValueError, match="block_sizes must be"):
    run(impl="pallas_gpu", block_sizes={"tm": 16})


def test_interpret_needs_a_kernel(small):
  lhs, rhs, grad, sizes = small
  with pytest.raises(ValueError, match="interpret"):
    gmm(lhs, rhs, sizes, impl="reference", interpret=True)
  with pytest.raises(ValueError, match="name the kernel"):
    tgmm(lhs, grad, sizes, interpret=True)
