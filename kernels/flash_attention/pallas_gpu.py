"""Flash attention as Pallas GPU kernels (Triton lowering), forward and backward.

Triton has no scalar prefetch, so the per-block metadata are ordinary inputs, computed in jnp
(`reference.block_visibility`): for each (row, query block) the range `[lo, hi)` of key blocks
that may be visible, and for each (row, key block) the range of query blocks that may see it.
Programs loop over their range only: causal rows skip the blocks above the diagonal, packed
rows the blocks of other segments, a sliding window the blocks behind it, and a query block of
padding runs no step at all. Inside the range, the mask (`reference.visible`) handles block
pairs that straddle a boundary, and only those: the run of pairs that see each other whole
(`reference.full_block_run`; in a causal row every pair off the diagonal and, with a window,
off its far edge) skips the mask's loads, compares and selects, about a third of the
elementwise work per score. Masks and walks take one static `rule`: `reference.visible`'s
keywords (`causal`, `window`). The softmax runs in base 2 (`exp2` of logits scaled by
`sm_scale * log2(e)`; the log-sum-exp stays natural), and the backward kernels apply
`sm_scale` once to the sums of dq and dk rather than to every score. A logit softcap
(`reference.scaled_logits`) needs the scaled logits inside its tanh: with one, the scores the
kernels take the maximum of and exponentiate are the capped logits, scaled already (`_scores`),
and the backward kernels recompute the tanh with the probabilities.

- forward, grid `(b, h, n)`: one query block of one head against the keys of its kv head,
  online softmax in float32; writes the output and the log-sum-exp of each query.
- dq, grid `(b, h, n)`: the same walk, recomputing the probabilities from the log-sum-exp;
  its blocks may differ from dk/dv's (`BlockSizes.block_q_dq`, `block_kv_dq`).
- dk and dv, grid `(b, k, m)`: one key block against the query blocks that see it, for every
  query head of its group (a static loop over the g heads), so the group's sum needs no
  atomics and no second pass.

Token axes are padded to whole blocks (padding tokens get segment id -1, which nobody sees).
Triton block dims are powers of two and its dot needs every dim >= 16: block sizes follow, and
head_dim must be a power of two >= 16.

Shapes: b batch, t query tokens, s key tokens, h query heads, k kv heads, g = h // k, e head
dim; n query blocks of bq tokens, m key blocks of bk tokens.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl.kernels.flash_attention import gpu_ab, reference
from jaxrl.kernels.flash_attention.api import BlockSizes
from jaxrl.kernels.tf32 import split_dot, tf32_parts

# The Triton compiler-params class was `TritonCompilerParams` before it became
# `CompilerParams`; take whichever this jax has.
_TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams

_MIN_DOT = 16  # Triton's tl.dot needs every dimension >= 16.
# Untuned starting points, the usual Triton flash-attention tiles for head_dim 64-128: larger
# query blocks forward (reuse of K/V loads), smaller blocks backward (more live tiles: q, k, v,
# do, probabilities and their gradient).
_DEFAULT_BQ, _DEFAULT_BK = 128, 64
_DEFAULT_BQ_BWD, _DEFAULT_BK_BWD = 64, 64
# Float32 inputs: split-precision dots stage each operand's two TF32 parts, so the 16-bit
# tiles ask for more shared memory than an H100 has (263 KB forward, compiled without one);
# these fit it (and spill 0.5-1.4 KB a thread, where IEEE float32 dots spilled 55-97 KB).
_DEFAULT_F32 = (64, 64, 64, 32)  # block_q, block_kv, block_q_bwd, block_kv_bwd
# Softmax in base 2. On CUDA jnp.exp lowers to libdevice's accurate expf, about ten float32
# instructions a score, jnp.exp2 to one ex2.approx (relative error 2**-22); log2(e) folds into
# the logits' scale. Compiled for an H100, the kernels' float32 instructions fell by 42-52%
# (`launch/bench.py kernel_code`; docs/BENCHMARKS.md).
_LOG2E = 1.4426950408889634

# The timing A/B settings (`gpu_ab`), where their users find them.
mask_every_block, natural_exp = gpu_ab.mask_every_block, gpu_ab.natural_exp


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


def resolve_block_sizes(
  block_sizes: BlockSizes | None, *, t: int, s: int, e: int, itemsize: int = 2
) -> BlockSizes:
  """Fills the None fields (defaults by the inputs' `itemsize`), clips blocks to the dims
  (rounded up to a power of two >= 16)."""
  bs = block_sizes or BlockSizes()
  bq, bk, bq_bwd, bk_bwd = (
    _DEFAULT_F32 if itemsize >= 4 else (_DEFAULT_BQ, _DEFAULT_BK, _DEFAULT_BQ_BWD, _DEFAULT_BK_BWD)
  )
  fields = {
    "block_q": (bq, t),
    "block_kv": (bk, s),
    "block_q_bwd": (bq_bwd, t),
    "block_kv_bwd": (bk_bwd, s),
  }
  # The dq kernel's blocks default to the backward's, whatever those resolve to.
  fields["block_q_dq"] = (bs.block_q_bwd or bq_bwd, t)
  fields["block_kv_dq"] = (bs.block_kv_bwd or bk_bwd, s)
  blocks = {}
  for name, (default, dim) in fields.items():
    block = getattr(bs, name) or default
    if not _is_pow2(block) or block < _MIN_DOT:
      raise ValueError(
        f"impl='pallas_gpu' needs BlockSizes.{name} to be a power of two >= {_MIN_DOT} (Triton "
        f"block shapes and dot), got {block}."
      )
    blocks[name] = min(block, max(_MIN_DOT, _next_pow2(dim)))
  num_warps = bs.num_warps or (4 if e <= 64 else 8)
  num_stages = bs.num_stages or 2
  return BlockSizes(
    **blocks,
    num_warps=num_warps,
    num_stages=num_stages,
    num_warps_bwd=bs.num_warps_bwd or num_warps,
    num_stages_bwd=bs.num_stages_bwd or num_stages,
  )


def _check_head_dim(e: int) -> None:
  if not _is_pow2(e) or e < _MIN_DOT:
    raise ValueError(
      f"impl='pallas_gpu' needs head_dim to be a power of two >= {_MIN_DOT} (Triton block "
      f"shapes and dot), got {e}; use impl='reference' for this shape."
    )


def _precision(dtype) -> jax.lax.Precision | None:
  """The kernels' dot precision for inputs of `dtype`: None (a plain dot) for 16-bit inputs;
  for float32, `HIGH`: split precision (3xTF32, `jaxrl.kernels.tf32`), each product within
  3 * 2**-22 of exact on tensor cores. (Triton's TF32 default is about 1e-3 off; its IEEE
  dots, used until 2026-11-26, ran on CUDA cores and spilled tens of KB a thread, compiled for
  an H100.)"""
  return jax.lax.Precision.HIGH if jnp.dtype(dtype) == jnp.float32 else None


def _operand(x, precision):
  """`x` as `_dot` takes it: its TF32 parts under split precision (split once, used by every
  dot it enters), else itself."""
  return tf32_parts(x, 2) if precision == jax.lax.Precision.HIGH else (x,)


def _dot(a, b, precision, *, trans_a=False, trans_b=False):
  """a @ b (or with a or b transposed) with float32 accumulation; `a` and `b` are arrays or
  `_operand`s of them."""
  a_parts = a if isinstance(a, tuple) else _operand(a, precision)
  b_parts = b if isinstance(b, tuple) else _operand(b, precision)
  contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
  if precision == jax.lax.Precision.HIGH:
    return split_dot(a_parts, b_parts, contract, 2)
  dims = (contract, ((), ()))
  return jax.lax.dot_general(
    a_parts[0], b_parts[0], dims, precision=precision, preferred_element_type=jnp.float32
  )


def _geometry(q_bthe, k_bske, bs: BlockSizes):
  """Padded lengths: multiples of every kernel's blocks (powers of two, so of the largest)."""
  t, s = q_bthe.shape[1], k_bske.shape[1]
  t_pad = reference.round_up(t, max(bs.block_q, bs.block_q_bwd, bs.block_q_dq))
  s_pad = reference.round_up(s, max(bs.block_kv, bs.block_kv_bwd, bs.block_kv_dq))
  return t_pad, s_pad


def _scores(logits_qk, sm_scale: float, softcap: float | None):
  """(scores, tanh): the kernels' softmax of the raw logits q . k is that of
  `scores * _logit_scale(...)`: without a cap the raw logits themselves (sm_scale joins log2(e)
  in the exp2's multiply), with one the capped logits and the tanh the backward needs."""
  if softcap is None:
    return logits_qk, None
  return reference.scaled_logits(logits_qk, sm_scale, softcap)


def _logit_scale(sm_scale: float, softcap: float | None) -> float:
  """The factor from the scores of `_scores` to natural logits."""
  return sm_scale if softcap is None else 1.0


def _masked_then_full_then_masked(lo_ref, hi_ref, first_ref, end_ref, body, carry):
  """Runs `body(j, carry, masked)` over the blocks `[lo, hi)`: masked where a block pair may
  see only in part, without the mask on the run `[first, end)` where every pair sees
  (`reference.full_block_run`), which saves the mask's loads and compares on most blocks."""
  masked = functools.partial(body, masked=True)
  carry = jax.lax.fori_loop(lo_ref[0], first_ref[0], masked, carry)
  carry = jax.lax.fori_loop(first_ref[0], end_ref[0], functools.partial(body, masked=False), carry)
  return jax.lax.fori_loop(end_ref[0], hi_ref[0], masked, carry)


def _fwd_kernel(
  lo_ref,  # int32[1]: first key block this query block may see
  hi_ref,  # int32[1]: one past the last
  first_ref,  # int32[1]: the run of key blocks that every query sees, [first, end)
  end_ref,  # int32[1]
  q_ref,  # [bq, e]
  k_ref,  # [s_pad, e] of this head's kv head
  v_ref,  # [s_pad, e]
  seg_q_ref,  # int32[bq]
  pos_q_ref,  # int32[bq]
  seg_kv_ref,  # int32[s_pad]
  pos_kv_ref,  # int32[s_pad]
  o_ref,  # [bq, e]
  lse_ref,  # f32[bq]
  *,
  bk: int,
  sm_scale: float,
  softcap: float | None,
  rule: dict,
  precision,
):
  bq, e = q_ref.shape
  q_qe = _operand(q_ref[...], precision)
  seg_q, pos_q = seg_q_ref[...][:, None], pos_q_ref[...][:, None]
  logit_scale = _logit_scale(sm_scale, softcap)
  log2_scale = logit_scale * _LOG2E

  def body(j, carry, masked):
    acc_qe, max_q, denom_q = carry  # max_q: the running maximum of the scores (`_scores`)
    keys = pl.ds(j * bk, bk)
    logits_qk = _dot(q_qe, k_ref[keys, :], precision, trans_b=True)
    logits_qk, _ = _scores(logits_qk, sm_scale, softcap)
    if masked:
      vis_qk = reference.visible(
        seg_q, pos_q, seg_kv_ref[keys][None, :], pos_kv_ref[keys][None, :], **rule
      )
      logits_qk = jnp.where(vis_qk, logits_qk, -jnp.inf)
    new_max = jnp.maximum(max_q, jnp.max(logits_qk, axis=1))
    # A query that has seen no key yet keeps max -inf; a finite stand-in keeps exp2() at 0.
    shift_q = jnp.where(new_max == -jnp.inf, 0.0, new_max * log2_scale)
    # exp(scale * (x - max)) as exp2(x * log2_scale - shift): a multiply, a subtract and one
    # ex2 a score (log2_scale > 0, so the maximum of the scaled scores is the scaled maximum).
    probs_qk = gpu_ab.exp2(logits_qk * log2_scale - shift_q[:, None])
    rescale = gpu_ab.exp2(max_q * log2_scale - shift_q)
    probs_qk_in = probs_qk.astype(v_ref.dtype)
    acc_qe = acc_qe * rescale[:, None] + _dot(probs_qk_in, v_ref[keys, :], precision)
    return acc_qe, new_max, denom_q * rescale + jnp.sum(probs_qk, axis=1)

  init = (
    jnp.zeros((bq, e), jnp.float32),
    jnp.full((bq,), -jnp.inf, jnp.float32),
    jnp.zeros((bq,), jnp.float32),
  )
  acc_qe, max_q, denom_q = _masked_then_full_then_masked(
    lo_ref, hi_ref, first_ref, end_ref, body, init
  )
  seen = denom_q > 0
  safe_denom = jnp.where(seen, denom_q, 1.0)
  o_ref[...] = (acc_qe * jnp.where(seen, 1.0 / safe_denom, 0.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, max_q * logit_scale + jnp.log(safe_denom), jnp.inf)


def _padded_inputs(q_bthe, k_bske, v_bske, meta, t_pad, s_pad):
  return (
    reference.pad_tokens(q_bthe, t_pad),
    reference.pad_tokens(k_bske, s_pad),
    reference.pad_tokens(v_bske, s_pad),
    reference.pad_metadata(meta, t_pad, s_pad),
  )


def _walks(meta_p, bq: int, bk: int, causal: bool, window: int | None = None) -> tuple[list, list]:
  """The programs' walks, each flattened to `[lo, hi, first, end]`: for each (row, query block)
  the key blocks it visits `[lo, hi)` and, inside, the run `[first, end)` it visits without a
  mask; and for each (row, key block) the query blocks that visit it and the run that sees it
  whole. One pair of block-visibility matrices serves both (the forward pass uses the first;
  jit drops the second)."""
  maybe_bnm = reference.block_visibility(meta_p, bq=bq, bk=bk, causal=causal, window=window)
  full_bnm = reference.block_full_visibility(meta_p, bq=bq, bk=bk, causal=causal, window=window)

  def walk(maybe, full):
    lo, hi = reference.block_ranges(maybe)
    first, end = gpu_ab.full_run(full, lo, hi)
    return [x.reshape(-1) for x in (lo, hi, first, end)]

  by_key_block = walk(jnp.swapaxes(maybe_bnm, 1, 2), jnp.swapaxes(full_bnm, 1, 2))
  return walk(maybe_bnm, full_bnm), by_key_block


def forward(
  q_bthe,
  k_bske,
  v_bske,
  meta: reference.Metadata,
  *,
  causal: bool,
  sm_scale: float,
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
  window: int | None = None,
  softcap: float | None = None,
):
  """Output `[b, t, h, e]` in q's dtype and the float32 log-sum-exp `[b, h, t_pad]` (+inf for
  queries that see no key); arguments as in `jaxrl.kernels.flash_attention.reference`."""
  b, t, h, e = q_bthe.shape
  s, kh = k_bske.shape[1:3]
  g = h // kh
  _check_head_dim(e)
  bs = resolve_block_sizes(block_sizes, t=t, s=s, e=e, itemsize=q_bthe.dtype.itemsize)
  bq, bk = bs.block_q, bs.block_kv
  t_pad, s_pad = _geometry(q_bthe, k_bske, bs)
  n = t_pad // bq
  q_p, k_p, v_p, meta_p = _padded_inputs(q_bthe, k_bske, v_bske, meta, t_pad, s_pad)
  rule = {"causal": causal, "window": window}
  ranges, _ = _walks(meta_p, bq, bk, **rule)

  def kv_head(j):
    return jax.lax.div(j, g)

  q_spec = pl.BlockSpec((None, bq, None, e), lambda i, j, x: (i, x, j, 0))
  kv_spec = pl.BlockSpec((None, s_pad, None, e), lambda i, j, x: (i, 0, kv_head(j), 0))
  range_spec = pl.BlockSpec((1,), lambda i, j, x: (i * n + x,))
  q_ids_spec = pl.BlockSpec((None, bq), lambda i, j, x: (i, x))
  kv_ids_spec = pl.BlockSpec((None, s_pad), lambda i, j, x: (i, 0))
  kernel = functools.partial(
    _fwd_kernel,
    bk=bk,
    sm_scale=sm_scale,
    softcap=softcap,
    rule=rule,
    precision=_precision(q_bthe.dtype),
  )
  o_bthe, lse_bht = pl.pallas_call(
    kernel,
    grid=(b, h, n),
    in_specs=[
      *[range_spec] * 4,
      q_spec,
      kv_spec,
      kv_spec,
      q_ids_spec,
      q_ids_spec,
      kv_ids_spec,
      kv_ids_spec,
    ],
    out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, j, x: (i, j, x))],
    out_shape=[
      jax.ShapeDtypeStruct((b, t_pad, h, e), q_bthe.dtype),
      jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32),
    ],
    compiler_params=_TritonParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
    interpret=interpret,
    name="flash_attention_fwd_gpu",
  )(
    *ranges,
    q_p,
    k_p,
    v_p,
    meta_p.q_segment_ids_bt,
    meta_p.q_positions_bt,
    meta_p.kv_segment_ids_bs,
    meta_p.kv_positions_bs,
  )
  return o_bthe[:, :t], lse_bht


def _dq_kernel(
  lo_ref,  # int32[1]
  hi_ref,  # int32[1]
  first_ref,  # int32[1]
  end_ref,  # int32[1]
  q_ref,  # [bq, e]
  k_ref,  # [s_pad, e]
  v_ref,  # [s_pad, e]
  do_ref,  # [bq, e]
  lse2_ref,  # f32[bq]: the log-sum-exp in base 2 (times log2(e))
  delta_ref,  # f32[bq]
  seg_q_ref,  # int32[bq]
  pos_q_ref,  # int32[bq]
  seg_kv_ref,  # int32[s_pad]
  pos_kv_ref,  # int32[s_pad]
  dq_ref,  # [bq, e]
  *,
  bk: int,
  sm_scale: float,
  softcap: float | None,
  rule: dict,
  precision,
):
  q_qe, do_qe = _operand(q_ref[...], precision), _operand(do_ref[...], precision)
  lse2_q1, delta_q1 = lse2_ref[...][:, None], delta_ref[...][:, None]
  seg_q, pos_q = seg_q_ref[...][:, None], pos_q_ref[...][:, None]
  log2_scale = _logit_scale(sm_scale, softcap) * _LOG2E

  def body(j, dq_qe, masked):
    keys = pl.ds(j * bk, bk)
    k_ke = _operand(k_ref[keys, :], precision)
    logits_qk = _dot(q_qe, k_ke, precision, trans_b=True)
    logits_qk, tanh_qk = _scores(logits_qk, sm_scale, softcap)
    probs_qk = gpu_ab.exp2(logits_qk * log2_scale - lse2_q1)
    if masked:
      vis_qk = reference.visible(
        seg_q, pos_q, seg_kv_ref[keys][None, :], pos_kv_ref[keys][None, :], **rule
      )
      probs_qk = jnp.where(vis_qk, probs_qk, 0.0)
    dprobs_qk = _dot(do_qe, v_ref[keys, :], precision, trans_b=True)
    # The scaled logits' gradient (through the cap's tanh) without its factor sm_scale,
    # applied once to the sum.
    dlogits_qk = reference.softcap_grad(probs_qk * (dprobs_qk - delta_q1), tanh_qk)
    return dq_qe + _dot(dlogits_qk.astype(k_ref.dtype), k_ke, precision)

  dq_qe = _masked_then_full_then_masked(
    lo_ref, hi_ref, first_ref, end_ref, body, jnp.zeros(q_ref.shape, jnp.float32)
  )
  dq_ref[...] = (dq_qe * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(
  lo_ref,  # int32[1]: first query block that may see this key block
  hi_ref,  # int32[1]: one past the last
  first_ref,  # int32[1]: the run of query blocks that see all of it, [first, end)
  end_ref,  # int32[1]
  q_ref,  # [t_pad, g, e]: the queries of this kv head's group
  k_ref,  # [bk, e]
  v_ref,  # [bk, e]
  do_ref,  # [t_pad, g, e]
  lse2_ref,  # f32[g, t_pad]: the log-sum-exp in base 2
  delta_ref,  # f32[g, t_pad]
  seg_q_ref,  # int32[t_pad]
  pos_q_ref,  # int32[t_pad]
  seg_kv_ref,  # int32[bk]
  pos_kv_ref,  # int32[bk]
  dk_ref,  # [bk, e]
  dv_ref,  # [bk, e]
  *,
  bq: int,
  sm_scale: float,
  softcap: float | None,
  rule: dict,
  precision,
):
  k_ke, v_ke = _operand(k_ref[...], precision), _operand(v_ref[...], precision)
  seg_kv, pos_kv = seg_kv_ref[...][:, None], pos_kv_ref[...][:, None]
  g = q_ref.shape[1]
  log2_scale = _logit_scale(sm_scale, softcap) * _LOG2E
  carry = (jnp.zeros(k_ref.shape, jnp.float32), jnp.zeros(v_ref.shape, jnp.float32))
  for head in range(g):  # static: g is small, and a static index keeps the loads plain
    # Scores are laid out keys by queries ([bk, bq], the transpose of the other kernels'), so
    # the probabilities and their gradient, computed in registers, are the left operands of
    # the dv and dk products as they stand: no transpose of a register tile through shared
    # memory (as with p.T @ do), one each a step.
    def body(i, carry, masked, head=head):
      dk_ke, dv_ke = carry
      queries = pl.ds(i * bq, bq)
      q_qe = _operand(q_ref[queries, head, :], precision)
      do_qe = _operand(do_ref[queries, head, :], precision)
      logits_kq = _dot(k_ke, q_qe, precision, trans_b=True)
      logits_kq, tanh_kq = _scores(logits_kq, sm_scale, softcap)
      probs_kq = gpu_ab.exp2(logits_kq * log2_scale - lse2_ref[head, queries][None, :])
      if masked:
        vis_kq = reference.visible(
          seg_q_ref[queries][None, :], pos_q_ref[queries][None, :], seg_kv, pos_kv, **rule
        )
        probs_kq = jnp.where(vis_kq, probs_kq, 0.0)
      dv_ke += _dot(probs_kq.astype(do_ref.dtype), do_qe, precision)
      dprobs_kq = _dot(v_ke, do_qe, precision, trans_b=True)
      # Without sm_scale, as in the dq kernel.
      dlogits_kq = probs_kq * (dprobs_kq - delta_ref[head, queries][None, :])
      dlogits_kq = reference.softcap_grad(dlogits_kq, tanh_kq)
      dk_ke += _dot(dlogits_kq.astype(q_ref.dtype), q_qe, precision)
      return dk_ke, dv_ke

    carry = _masked_then_full_then_masked(lo_ref, hi_ref, first_ref, end_ref, body, carry)
  dk_ke, dv_ke = carry
  dk_ref[...] = (dk_ke * sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_ke.astype(dv_ref.dtype)


def backward(
  q_bthe,
  k_bske,
  v_bske,
  meta: reference.Metadata,
  o_bthe,
  lse_bht,
  do_bthe,
  *,
  causal: bool,
  sm_scale: float,
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
  window: int | None = None,
  softcap: float | None = None,
  dlse_bht=None,
):
  """(dq, dk, dv) in the inputs' dtypes from the forward pass's output and log-sum-exp;
  `dlse_bht`, f32 `[b, h, t]` or None, is a cotangent of the log-sum-exp too (the api's
  attention sinks)."""
  b, t, h, e = q_bthe.shape
  s, kh = k_bske.shape[1:3]
  g = h // kh
  bs = resolve_block_sizes(block_sizes, t=t, s=s, e=e, itemsize=q_bthe.dtype.itemsize)
  bq, bk = bs.block_q_bwd, bs.block_kv_bwd  # the dk/dv kernel's blocks
  bq_dq, bk_dq = bs.block_q_dq, bs.block_kv_dq
  t_pad, s_pad = _geometry(q_bthe, k_bske, bs)
  n, m = t_pad // bq_dq, s_pad // bk
  q_p, k_p, v_p, meta_p = _padded_inputs(q_bthe, k_bske, v_bske, meta, t_pad, s_pad)
  do_p = reference.pad_tokens(do_bthe, t_pad)
  # delta_i = sum_j p_ij dp_ij = do_i . o_i: the softmax's backward, one number per query.
  delta_bht = jnp.einsum(
    "bthe,bthe->bht",
    do_bthe.astype(jnp.float32),
    o_bthe.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  if dlse_bht is not None:  # the log-sum-exp's own cotangent (attention sinks)
    delta_bht = delta_bht - dlse_bht
  delta_bht = jnp.pad(delta_bht, ((0, 0), (0, 0), (0, t_pad - t)))
  lse2_bht = lse_bht * _LOG2E  # +inf (a query that sees no key) stays +inf: exp2 gives 0
  rule = {"causal": causal, "window": window}
  key_ranges, query_ranges = _walks(meta_p, bq, bk, **rule)
  if (bq_dq, bk_dq) != (bq, bk):
    key_ranges, _ = _walks(meta_p, bq_dq, bk_dq, **rule)
  compiler_params = _TritonParams(num_warps=bs.num_warps_bwd, num_stages=bs.num_stages_bwd)
  precision = _precision(q_bthe.dtype)
  ids = (
    meta_p.q_segment_ids_bt,
    meta_p.q_positions_bt,
    meta_p.kv_segment_ids_bs,
    meta_p.kv_positions_bs,
  )

  def kv_head(j):
    return jax.lax.div(j, g)

  q_spec = pl.BlockSpec((None, bq_dq, None, e), lambda i, j, x: (i, x, j, 0))
  kv_spec = pl.BlockSpec((None, s_pad, None, e), lambda i, j, x: (i, 0, kv_head(j), 0))
  row_spec = pl.BlockSpec((None, None, bq_dq), lambda i, j, x: (i, j, x))
  q_range_spec = pl.BlockSpec((1,), lambda i, j, x: (i * n + x,))
  q_ids_spec = pl.BlockSpec((None, bq_dq), lambda i, j, x: (i, x))
  kv_ids_spec = pl.BlockSpec((None, s_pad), lambda i, j, x: (i, 0))
  scale = {"sm_scale": sm_scale, "softcap": softcap}
  dq_kernel = functools.partial(_dq_kernel, bk=bk_dq, rule=rule, precision=precision, **scale)
  dq_bthe = pl.pallas_call(
    dq_kernel,
    grid=(b, h, n),
    in_specs=[
      *[q_range_spec] * 4,
      q_spec,
      kv_spec,
      kv_spec,
      q_spec,
      row_spec,
      row_spec,
      q_ids_spec,
      q_ids_spec,
      kv_ids_spec,
      kv_ids_spec,
    ],
    out_specs=q_spec,
    out_shape=jax.ShapeDtypeStruct((b, t_pad, h, e), q_bthe.dtype),
    compiler_params=compiler_params,
    interpret=interpret,
    name="flash_attention_dq_gpu",
  )(*key_ranges, q_p, k_p, v_p, do_p, lse2_bht, delta_bht, *ids)

  # Queries grouped by kv head, [b, t_pad, k, g, e] (a free reshape): one block holds a group.
  group_spec = pl.BlockSpec((None, t_pad, None, g, e), lambda i, j, y: (i, 0, j, 0, 0))
  group_rows_spec = pl.BlockSpec((None, None, g, t_pad), lambda i, j, y: (i, j, 0, 0))
  kv_block_spec = pl.BlockSpec((None, bk, None, e), lambda i, j, y: (i, y, j, 0))
  kv_range_spec = pl.BlockSpec((1,), lambda i, j, y: (i * m + y,))
  all_q_ids_spec = pl.BlockSpec((None, t_pad), lambda i, j, y: (i, 0))
  kv_block_ids_spec = pl.BlockSpec((None, bk), lambda i, j, y: (i, y))
  dk_bske, dv_bske = pl.pallas_call(
    functools.partial(_dkv_kernel, bq=bq, rule=rule, precision=precision, **scale),
    grid=(b, kh, m),
    in_specs=[
      *[kv_range_spec] * 4,
      group_spec,
      kv_block_spec,
      kv_block_spec,
      group_spec,
      group_rows_spec,
      group_rows_spec,
      all_q_ids_spec,
      all_q_ids_spec,
      kv_block_ids_spec,
      kv_block_ids_spec,
    ],
    out_specs=[kv_block_spec, kv_block_spec],
    out_shape=[
      jax.ShapeDtypeStruct((b, s_pad, kh, e), k_bske.dtype),
      jax.ShapeDtypeStruct((b, s_pad, kh, e), v_bske.dtype),
    ],
    compiler_params=compiler_params,
    interpret=interpret,
    name="flash_attention_dkv_gpu",
  )(
    *query_ranges,
    q_p.reshape(b, t_pad, kh, g, e),
    k_p,
    v_p,
    do_p.reshape(b, t_pad, kh, g, e),
    lse2_bht.reshape(b, kh, g, t_pad),
    delta_bht.reshape(b, kh, g, t_pad),
    *ids,
  )
  return dq_bthe[:, :t], dk_bske[:, :s], dv_bske[:, :s]
