"""`qk_rope_write`: the reference against a float64 numpy oracle, the Pallas GPU kernel in
interpret mode against the reference (q, every written row, and every row left alone), its
lowering for CUDA, the model's decode path through it, and input errors.

Shapes: n tokens, h query heads, k kv heads, e head dim, f = e // 2, p pages, z page size.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance
from helpers.lowering import TRITON_CALL

from jaxrl.kernels.qk_rope_write import qk_rope_write

EPS = 1e-6


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


# (normed, plus_one): no norms, Qwen3's q/k norms, Gemma 3's (times `1 + scale`).
NORMS = [(False, False), (True, False), (True, True)]


def _inputs(rng, *, n, h, k, e, p, z, dtype, normed=True, plus_one=False):
  """Tokens whose rows are distinct, in and out of the pool (-1 and p * z: padding); with
  `plus_one` the scales are stored minus one, as Gemma's."""
  cast = functools.partial(jnp.asarray, dtype=dtype)
  rows = rng.permutation(p * z)[:n].astype(np.int32)
  rows[: min(n, 2)] = [-1, p * z][: min(n, 2)]
  angles = rng.uniform(0, 2 * np.pi, size=(n, e // 2)) * rng.integers(1, 100, size=(n, 1))
  args = (
    cast(rng.standard_normal((n, h, e)) * 3),
    cast(rng.standard_normal((n, k, e))),
    cast(rng.standard_normal((n, k, e))),
    jnp.asarray(np.cos(angles), jnp.float32),
    jnp.asarray(np.sin(angles), jnp.float32),
    jnp.asarray(rows),
    cast(rng.standard_normal((k, p, z, e))),
    cast(rng.standard_normal((k, p, z, e))),
  )
  scales = {}
  if normed:
    low = -0.5 if plus_one else 0.5
    scales = {"q_scale": cast(rng.uniform(low, 2, e)), "k_scale": cast(rng.uniform(low, 2, e))}
    if plus_one:
      scales["norm_plus_one"] = True
  return args, scales


def _oracle(
  q, k, v, cos, sin, rows, k_pages, v_pages, q_scale=None, k_scale=None, norm_plus_one=False
):
  """float64 numpy: RMS norm (no rounding between its steps), rotation, and the writes."""
  f64 = functools.partial(np.asarray, dtype=np.float64)
  q, k, v, cos, sin = map(f64, (q, k, v, cos, sin))
  if q_scale is not None:

    def norm(x, scale):
      return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * (f64(scale) + norm_plus_one)

    q, k = norm(q, q_scale), norm(k, k_scale)

  def rotate(x):
    x1, x2 = np.split(x, 2, axis=-1)
    c, s = cos[:, None], sin[:, None]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

  k_pages, v_pages = f64(k_pages).copy(), f64(v_pages).copy()
  kh, p, z, e = k_pages.shape
  for i, row in enumerate(np.asarray(rows)):
    if 0 <= row < p * z:
      k_pages[:, row // z, row % z] = rotate(k)[i]
      v_pages[:, row // z, row % z] = v[i]
  return rotate(q), k_pages, v_pages


@pytest.mark.parametrize("normed,plus_one", NORMS)
@pytest.mark.parametrize("h,k,e", [(4, 2, 16), (3, 1, 64), (8, 8, 128)])
def test_reference_matches_float64_oracle(h, k, e, normed, plus_one):
  args, scales = _inputs(_rng("oracle", h, k, e, normed, plus_one), n=6, h=h, k=k, e=e, p=5, z=4,
                         dtype=jnp.float32, normed=normed, plus_one=plus_one)  # fmt: skip
  got = qk_rope_write(*args, **scales, eps=EPS, impl="reference")
  for name, a, b in zip(("q", "k_pages", "v_pages"), got, _oracle(*args, **scales), strict=True):
    tolerance.assert_close(a, b, n=e + 4, exact=True, err_msg=name)


def _assert_kernel_matches(got, want, dtype, e):
  for name, a, b in zip(("q", "k_pages", "v_pages"), got, want, strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    if dtype == jnp.float32:
      tolerance.assert_close(a, b, n=e + 4, err_msg=name)
    else:  # a float32 rounding difference may flip the last bit of a bf16 result
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-30, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("normed,plus_one", NORMS)
@pytest.mark.parametrize(
  "n,h,k,e,p,z", [(5, 4, 2, 16, 6, 4), (3, 6, 2, 64, 3, 8), (4, 2, 2, 8, 2, 2)]
)
def test_gpu_kernel_matches_reference(n, h, k, e, p, z, dtype, normed, plus_one):
  args, scales = _inputs(_rng("kernel", n, h, k, e, dtype, normed, plus_one), n=n, h=h, k=k, e=e,
                         p=p, z=z, dtype=dtype, normed=normed, plus_one=plus_one)  # fmt: skip
  want = qk_rope_write(*args, **scales, eps=EPS, impl="reference")
  got = qk_rope_write(*args, **scales, eps=EPS, impl="pallas_gpu", interpret=True)
  _assert_kernel_matches(got, want, dtype, e)
  # Rows no token writes are left exactly as they were (the pools are updated in place).
  rows = np.asarray(args[5])
  untouched = np.ones(p * z, bool)
  untouched[rows[(rows >= 0) & (rows < p * z)]] = False
  for before, after in ((args[6], got[1]), (args[7], got[2])):
    before = np.asarray(before, np.float32).reshape(k, p * z, e)[:, untouched]
    np.testing.assert_array_equal(np.asarray(after, np.float32).reshape(k, p * z, e)[:, untouched],
                                  before)  # fmt: skip


def test_gpu_kernel_casts_to_a_wider_pool():
  """bf16 projections into a float32 pool: k rounded to bf16 first, as the reference does."""
  args, scales = _inputs(_rng("wide"), n=4, h=4, k=2, e=16, p=3, z=4, dtype=jnp.bfloat16)
  args = (*args[:6], args[6].astype(jnp.float32), args[7].astype(jnp.float32))
  want = qk_rope_write(*args, **scales, eps=EPS, impl="reference")
  got = qk_rope_write(*args, **scales, eps=EPS, impl="pallas_gpu", interpret=True)
  _assert_kernel_matches(got, want, jnp.bfloat16, 16)


def test_interpret_really_runs_the_pallas_kernel():
  args, scales = _inputs(_rng("jaxpr"), n=3, h=2, k=1, e=16, p=2, z=4, dtype=jnp.float32)
  kernel = functools.partial(qk_rope_write, impl="pallas_gpu", interpret=True, **scales)
  assert "pallas_call" in str(jax.make_jaxpr(kernel)(*args))
  auto = functools.partial(qk_rope_write, **scales)  # on CPU: the reference
  assert "pallas_call" not in str(jax.make_jaxpr(auto)(*args))


@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_lowers_for_cuda_with_pools_in_place(dtype, normed):
  n, h, k, e, p, z = 64, 16, 8, 128, 4096, 16  # Qwen3-0.6B's heads, a decode step of 64 rows
  sds = jax.ShapeDtypeStruct
  shapes = [sds((n, h, e), dtype), sds((n, k, e), dtype), sds((n, k, e), dtype)]
  shapes += [sds((n, e // 2), jnp.float32)] * 2 + [sds((n,), jnp.int32)]
  shapes += [sds((k, p, z, e), dtype)] * 2
  scales = [sds((e,), dtype)] * 2 if normed else [None, None]

  def f(*args):
    return qk_rope_write(*args[:8], q_scale=args[8], k_scale=args[9], impl="pallas_gpu")

  exported = jax.export.export(
    jax.jit(f, donate_argnums=(6, 7)),
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
  )(*shapes, *scales)
  text = exported.mlir_module()
  assert text.count(TRITON_CALL) == 1
  assert "output_operand_aliases" in text  # both pools written in place, not copied
  assert [a.shape for a in exported.out_avals] == [(n, h, e), (k, p, z, e), (k, p, z, e)]


def test_model_decode_through_the_kernel_equals_the_unfused_path():
  """`attend_paged_decode` (the model's decode step) against the norms, `apply_rope` and
  `attend` it replaces, with the kernel in interpret mode."""
  from jaxrl.kernels.qk_rope_write import apply_rope, rms_norm
  from jaxrl.model import cache as cache_lib

  rng = _rng("model")
  b, h, k, e, p, z, m = 3, 4, 2, 16, 10, 4, 3
  q, kk, v = (jnp.asarray(rng.standard_normal((b, 1, x, e)), jnp.float32) for x in (h, k, k))
  scales = [jnp.asarray(rng.uniform(0.5, 2, e), jnp.float32) for _ in range(2)]
  positions = jnp.asarray([[5], [0], [-1]], jnp.int32)  # the last row is padding
  table = jnp.asarray(rng.permutation(p)[: b * m].reshape(b, m), jnp.int32)
  pools = [jnp.asarray(rng.standard_normal((k, p, z, e)), jnp.float32) for _ in range(2)]
  cache = cache_lib.PagedLayerCache(*pools, table)
  angles = jnp.asarray(rng.uniform(0, 6, (b, 1, e // 2)), jnp.float32)
  cos, sin = jnp.cos(angles), jnp.sin(angles)

  q2, k2 = rms_norm(q, scales[0], EPS), rms_norm(kk, scales[1], EPS)
  want_out, want_cache = cache_lib.attend(apply_rope(q2, cos, sin), apply_rope(k2, cos, sin), v,
                                          positions, cache)  # fmt: skip
  kernel = functools.partial(qk_rope_write, impl="pallas_gpu", interpret=True)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(cache_lib, "qk_rope_write", kernel)
    got_out, got_cache = cache_lib.attend_paged_decode(
      q, kk, v, positions, cache, cos, sin, *scales, eps=EPS
    )
  tolerance.assert_close(got_out[:2], want_out[:2], n=e + 4 + m * z)
  for got, want in zip(got_cache[:2], want_cache[:2], strict=True):
    tolerance.assert_close(got, want, n=e + 4)


def test_bad_inputs():
  args, scales = _inputs(_rng("bad"), n=3, h=4, k=2, e=16, p=2, z=4, dtype=jnp.float32)
  q, k, v, cos, sin, rows, kp, vp = args
  with pytest.raises(ValueError, match="k and v must both be"):
    qk_rope_write(q, k, v[:, :1], cos, sin, rows, kp, vp)
  with pytest.raises(ValueError, match="cos and sin must be"):
    qk_rope_write(q, k, v, cos[:, :4], sin, rows, kp, vp)
  with pytest.raises(ValueError, match="rows must be an integer"):
    qk_rope_write(q, k, v, cos, sin, rows.astype(jnp.float32), kp, vp)
  with pytest.raises(ValueError, match="k_pages must be"):
    qk_rope_write(q, k, v, cos, sin, rows, kp[:1], vp)
  with pytest.raises(ValueError, match="v_pages must match"):
    qk_rope_write(q, k, v, cos, sin, rows, kp, vp.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="both q_scale and k_scale"):
    qk_rope_write(q, k, v, cos, sin, rows, kp, vp, q_scale=scales["q_scale"])
  with pytest.raises(ValueError, match="no TPU kernel"):
    qk_rope_write(q, k, v, cos, sin, rows, kp, vp, impl="pallas_tpu")
  with pytest.raises(ValueError, match="interpret"):
    qk_rope_write(q, k, v, cos, sin, rows, kp, vp, interpret=True)


def test_head_dims_the_gpu_kernel_cannot_load():
  """head_dim // 2 not a power of two (Triton loads): named kernel refuses, auto falls back."""
  args, scales = _inputs(_rng("e24"), n=3, h=2, k=1, e=24, p=2, z=4, dtype=jnp.float32)
  with pytest.raises(ValueError, match="power of two"):
    qk_rope_write(*args, **scales, impl="pallas_gpu", interpret=True)
  from jaxrl.kernels.common import target_platform

  with target_platform("cuda"):
    jaxpr = str(jax.make_jaxpr(functools.partial(qk_rope_write, **scales))(*args))
  assert "pallas_call" not in jaxpr


def test_auto_impls_overrides_auto_inside_and_only_inside():
  from jaxrl.kernels.common import auto_impls, target_platform

  args, scales = _inputs(_rng("override"), n=3, h=2, k=1, e=16, p=2, z=4, dtype=jnp.float32)
  traced = functools.partial(qk_rope_write, **scales)
  with target_platform("cuda"):
    assert "pallas_call" in str(jax.make_jaxpr(traced)(*args))
    with auto_impls(qk_rope_write="reference"):
      assert "pallas_call" not in str(jax.make_jaxpr(traced)(*args))
      named = functools.partial(traced, impl="pallas_gpu")  # a named impl is kept
      assert "pallas_call" in str(jax.make_jaxpr(named)(*args))
    with auto_impls(paged_attention="reference"):  # another kernel's override: no effect
      assert "pallas_call" in str(jax.make_jaxpr(traced)(*args))
    assert "pallas_call" in str(jax.make_jaxpr(traced)(*args))
  with pytest.raises(ValueError, match="auto_impls"), auto_impls(qk_rope_write="auto"):
    pass


on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")


def _assert_bf16_roundings_from_exact(got, exact, e):
  """bf16 results against the float64 oracle, allowing the roundings `reference.rms_norm`
  defines: the normed value rounded to bf16 before its scale (one unit roundoff 2**-8 of each
  component, two components per rotated element: 2**-7 of the head's largest), the result
  rounded once (2**-8 of itself), and float32 rounding of the norm's sums. Loose next to the
  float32 test, but a wrong sign, index or angle still misses by the size of the values."""
  for name, a, b in zip(("q", "k_pages", "v_pages"), got, exact, strict=True):
    a = np.asarray(a, np.float64)
    head_max = np.max(np.abs(b), axis=-1, keepdims=True)
    bound = 2.0**-8 * np.abs(b) + 2.0**-7 * head_max
    bound = bound + tolerance.atol(e + 4, head_max, evaluations=1)
    excess = np.max(np.abs(a - b) - bound)
    assert excess <= 0, f"{name}: {excess:.3g} past the bf16 roundings of the exact value"


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("plus_one", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_compiled_matches_oracle(dtype, plus_one):
  """Compiled by Triton, the kernel against the float64 oracle: float32 within rounding of its
  sums, bf16 within the roundings the reference defines. Not bit for bit against the compiled
  reference in bf16 (as in interpret mode on a CPU): on an H100 they differed by a bf16 unit
  in the last place in some elements, since XLA:GPU and Triton round the float32 steps
  between the norm and the rotation differently."""
  args, scales = _inputs(_rng("gpu", dtype, plus_one), n=64, h=16, k=8, e=128, p=64, z=16,
                         dtype=dtype, plus_one=plus_one)  # fmt: skip
  got = qk_rope_write(*args, **scales, eps=EPS, impl="pallas_gpu")
  assert "pallas_call" in str(jax.make_jaxpr(functools.partial(qk_rope_write, **scales))(*args))
  exact = _oracle(*args, **scales)
  if dtype == jnp.float32:
    for name, a, b in zip(("q", "k_pages", "v_pages"), got, exact, strict=True):
      tolerance.assert_close(a, b, n=128 + 4, exact=True, err_msg=name)
  else:
    _assert_bf16_roundings_from_exact(got, exact, 128)


@pytest.mark.parametrize("logit_scale", [0.0, 0.1])
@pytest.mark.parametrize("plus_one", [False, True])
def test_bf16_decode_step_norms_q_and_k_as_the_unfused_path_does(plus_one, logit_scale):
  """A bf16 attention layer's decode step (the fused path) against the same layer on the same
  token through the unfused norms and rotation (a two-token call whose second token is
  padding): in Gemma's norm order (`1 + scale` in float32, then rounded) the keys written to
  the pages are the same bits, in Llama's (rounded, then times the scale in bf16) within a
  bf16 unit (XLA computes that product unrounded where it fuses it into the rotation); the
  outputs agree to bf16 rounding, with and without a query scale folded into the q norm's
  scale."""
  from flax import nnx

  from jaxrl.model import cache as cache_lib
  from jaxrl.model.config import ModelConfig
  from jaxrl.model.transformer import Attention

  cfg = ModelConfig(
    dtype="bfloat16", param_dtype="bfloat16", qk_norm=True, norm_scale_plus_one=plus_one,
    attention_logit_scale=logit_scale,
  )  # fmt: skip
  layer = Attention(cfg, rngs=nnx.Rngs(0))
  rng = _rng("bf16 decode", plus_one, logit_scale)
  e = cfg.head_dim
  for norm in (layer.q_norm, layer.k_norm):  # scales far from their identity
    norm.scale.set_value(jnp.asarray(rng.uniform(-0.6, 0.9, e) + (not plus_one), jnp.bfloat16))
  b, m, z = 2, 3, 4
  pools = [
    jnp.asarray(rng.standard_normal((cfg.num_kv_heads, b * m, z, e)), jnp.bfloat16)
    for _ in range(2)
  ]
  cache = cache_lib.PagedLayerCache(*pools, jnp.arange(b * m, dtype=jnp.int32).reshape(b, m))
  x = jnp.asarray(rng.standard_normal((b, 2, cfg.d_model)), jnp.bfloat16)
  positions = jnp.asarray([[5, -1], [9, -1]], jnp.int32)
  fused_out, fused_cache = layer(x[:, :1], positions[:, :1], cache)
  plain_out, plain_cache = layer(x, positions, cache)
  for fused, plain in zip(fused_cache[:2], plain_cache[:2], strict=True):
    fused, plain = np.asarray(fused, np.float32), np.asarray(plain, np.float32)
    if plus_one:  # rounded where `rms_norm` rounds, in both paths
      np.testing.assert_array_equal(fused, plain)
    else:  # XLA may leave the bf16 product with the scale unrounded where it fuses it
      head_max = np.max(np.abs(plain), axis=-1, keepdims=True)
      assert np.all(np.abs(fused - plain) <= 2**-7 * np.abs(plain) + 2**-8 * head_max)
  fused_out, plain_out = (np.asarray(o[:, 0], np.float64) for o in (fused_out, plain_out))
  scale = np.max(np.abs(plain_out))
  np.testing.assert_allclose(fused_out, plain_out, rtol=2**-6, atol=2**-7 * scale)
