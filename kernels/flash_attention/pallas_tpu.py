"""Flash attention as Pallas Mosaic TPU kernels, forward and backward.

The grid walks every block pair; BlockSpecs bring each step's blocks into VMEM (pipelined
copies) and float32 scratch carries the online softmax and the gradient sums across steps.
Block skipping comes from per-block ranges computed in jnp (`reference.block_visibility`) and
scalar-prefetched into SMEM: a step outside its range computes nothing, and its index map
clamps the block it asks for into the range, so the pipeline copies nothing new for it (the
block it names is the one already resident). Causal rows thus skip the blocks above the
diagonal, packed rows the blocks of other segments, a sliding window the blocks behind it; the
mask (`reference.visible`) handles the pairs that straddle a boundary. A logit softcap
(`reference.scaled_logits`) caps the scaled logits before the mask; the backward kernels
recompute its tanh with the probabilities.

- forward, grid `(b, h, n, m)`: query block i of head j against key block y of its kv head;
  the last key step writes the output and the log-sum-exp.
- dq, grid `(b, h, n, m)`: the same walk, recomputing the probabilities from the log-sum-exp.
- dk and dv, grid `(b, k, m, g, n)`: key block y against every query block of every query head
  of its group that may see it; the group's sum stays in scratch, written at the last step.

Inputs are transposed to head-major `[b, heads, tokens, e]`, so a block's two minor dims are
(tokens, head_dim). Segment ids and positions go in as `[b, t, 1]` for queries and `[b, 1, s]`
for keys, so that comparing them broadcasts to a `[bq, bk]` mask without a transpose. Token
axes are padded to whole blocks (padding tokens get segment id -1, which nobody sees).

Shapes: b batch, t query tokens, s key tokens, h query heads, k kv heads, g = h // k, e head
dim; n query blocks of bq tokens, m key blocks of bk tokens.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl.kernels.flash_attention import reference
from jaxrl.kernels.flash_attention.api import BlockSizes

# Untuned: 512-token blocks keep a step's q, k, v blocks and its [bq, bk] float32 scores at a
# few MiB of VMEM, and amortise the ~0.35 us per grid step.
_DEFAULT_BLOCK = 512
_LANES = 128


def _tile(requested: tuple[int, ...], dim: int, unit: int, names: tuple[str, ...]):
  """(blocks, padded dim): the whole dim when every block covers it, else blocks that are
  multiples of `unit` (clipped to the dim rounded up to `unit`) and the dim padded to all."""
  if all(block >= dim for block in requested):
    return (dim,) * len(requested), dim
  for name, block in zip(names, requested, strict=True):
    if block % unit:
      raise ValueError(
        f"impl='pallas_tpu' needs BlockSizes.{name} to be a multiple of {unit} (the TPU tiling "
        f"of this axis) or at least the length it tiles ({dim}), got {block}."
      )
  blocks = tuple(min(block, reference.round_up(dim, unit)) for block in requested)
  return blocks, reference.round_up(dim, math.lcm(*blocks))


def resolve_block_sizes(block_sizes: BlockSizes | None, *, t: int, s: int, dtype):
  """(BlockSizes with every block set, t_pad, s_pad); rejects the GPU-only fields."""
  bs = block_sizes or BlockSizes()
  reference.reject_gpu_settings(bs, "pallas_tpu")
  # Query blocks are second-minor: 8 rows of 32 bits, packed two to a row for 16-bit dtypes.
  sublanes = 32 // min(jnp.dtype(dtype).itemsize, 4)
  (bq, bq_bwd), t_pad = _tile(
    (bs.block_q or _DEFAULT_BLOCK, bs.block_q_bwd or _DEFAULT_BLOCK),
    t,
    sublanes,
    ("block_q", "block_q_bwd"),
  )
  # Key blocks are also the lane dim of the keys' segment ids and positions.
  (bk, bk_bwd), s_pad = _tile(
    (bs.block_kv or _DEFAULT_BLOCK, bs.block_kv_bwd or _DEFAULT_BLOCK),
    s,
    _LANES,
    ("block_kv", "block_kv_bwd"),
  )
  resolved = BlockSizes(block_q=bq, block_kv=bk, block_q_bwd=bq_bwd, block_kv_bwd=bk_bwd)
  return resolved, t_pad, s_pad


def _precision(dtype) -> jax.lax.Precision | None:
  # Full float32 matmuls to match the reference; bf16 operands are exact on the MXU anyway.
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _interpret(interpret: Any) -> Any:
  return pltpu.InterpretParams() if interpret is True else interpret


def _dot(a, b, precision, *, trans_a=False, trans_b=False):
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _clamp(x, lo, hi):
  """x clamped into the block range [lo, hi); lo when the range is empty."""
  return jnp.minimum(jnp.maximum(x, lo), jnp.maximum(hi - 1, lo))


def _layout(q_bthe, k_bske, v_bske, meta, t_pad, s_pad):
  """Head-major padded inputs and the metadata in their broadcasting shapes."""
  meta = reference.pad_metadata(meta, t_pad, s_pad)
  heads_first = lambda x, length: jnp.swapaxes(reference.pad_tokens(x, length), 1, 2)
  return (
    heads_first(q_bthe, t_pad),
    heads_first(k_bske, s_pad),
    heads_first(v_bske, s_pad),
    (
      meta.q_segment_ids_bt[:, :, None],
      meta.q_positions_bt[:, :, None],
      meta.kv_segment_ids_bs[:, None, :],
      meta.kv_positions_bs[:, None, :],
    ),
    meta,
  )


def _fwd_kernel(
  lo_ref,  # SMEM int32[b * n]: first key block each query block may see
  hi_ref,  # SMEM int32[b * n]: one past the last
  q_ref,  # [bq, e]
  k_ref,  # [bk, e]
  v_ref,  # [bk, e]
  seg_q_ref,  # int32[bq, 1]
  pos_q_ref,  # int32[bq, 1]
  seg_kv_ref,  # int32[1, bk]
  pos_kv_ref,  # int32[1, bk]
  o_ref,  # [bq, e]
  lse_ref,  # f32[bq, 1]
  max_ref,  # scratch f32[bq, 1]
  denom_ref,  # scratch f32[bq, 1]
  acc_ref,  # scratch f32[bq, e]
  *,
  sm_scale: float,
  causal: bool,
  window: int | None,
  softcap: float | None,
  num_q_blocks: int,
  precision,
):
  row, i, y = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  lo, hi = lo_ref[row * num_q_blocks + i], hi_ref[row * num_q_blocks + i]

  @pl.when(y == 0)
  def _():
    max_ref[...] = jnp.full_like(max_ref, -jnp.inf)
    denom_ref[...] = jnp.zeros_like(denom_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when((y >= lo) & (y < hi))
  def _():
    logits_qk = _dot(q_ref[...], k_ref[...], precision, trans_b=True)
    logits_qk, _ = reference.scaled_logits(logits_qk, sm_scale, softcap)
    vis_qk = reference.visible(
      seg_q_ref[...],
      pos_q_ref[...],
      seg_kv_ref[...],
      pos_kv_ref[...],
      causal=causal,
      window=window,
    )
    logits_qk = jnp.where(vis_qk, logits_qk, -jnp.inf)
    max_q1 = max_ref[...]
    new_max = jnp.maximum(max_q1, jnp.max(logits_qk, axis=1, keepdims=True))
    # A query that has seen no key yet keeps max -inf; a finite stand-in keeps exp() at 0.
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    probs_qk = jnp.exp(logits_qk - safe_max)
    rescale = jnp.exp(max_q1 - safe_max)
    denom_ref[...] = denom_ref[...] * rescale + jnp.sum(probs_qk, axis=1, keepdims=True)
    max_ref[...] = new_max
    pv = _dot(probs_qk.astype(v_ref.dtype), v_ref[...], precision)
    acc_ref[...] = acc_ref[...] * rescale + pv

  @pl.when(y == pl.num_programs(3) - 1)
  def _():
    denom = denom_ref[...]
    seen = denom > 0
    safe_denom = jnp.where(seen, denom, 1.0)
    o_ref[...] = (acc_ref[...] * jnp.where(seen, 1.0 / safe_denom, 0.0)).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, max_ref[...] + jnp.log(safe_denom), jnp.inf)


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
  """Output `[b, t, h, e]` in q's dtype and the float32 log-sum-exp `[b, h, t_pad, 1]` (+inf
  for queries that see no key); arguments as in `jaxrl.kernels.flash_attention.reference`.

  `interpret=True` runs the kernel in the Mosaic TPU interpreter (`pltpu.InterpretParams()`);
  an `InterpretParams` is passed through as is.
  """
  b, t, h, e = q_bthe.shape
  s, kh = k_bske.shape[1:3]
  g = h // kh
  bs, t_pad, s_pad = resolve_block_sizes(block_sizes, t=t, s=s, dtype=q_bthe.dtype)
  bq, bk = bs.block_q, bs.block_kv
  n, m = t_pad // bq, s_pad // bk
  q_bhte, k_bkse, v_bkse, ids, meta_p = _layout(q_bthe, k_bske, v_bske, meta, t_pad, s_pad)
  lo_bn, hi_bn = reference.block_ranges(
    reference.block_visibility(meta_p, bq=bq, bk=bk, causal=causal, window=window)
  )

  def kv_block(row, i, y, lo_ref, hi_ref):
    return _clamp(y, lo_ref[row * n + i], hi_ref[row * n + i])

  def q_map(row, j, i, y, lo_ref, hi_ref):
    return row, j, i, 0

  def kv_map(row, j, i, y, lo_ref, hi_ref):
    return row, jax.lax.div(j, g), kv_block(row, i, y, lo_ref, hi_ref), 0

  def q_ids_map(row, j, i, y, lo_ref, hi_ref):
    return row, i, 0

  def kv_ids_map(row, j, i, y, lo_ref, hi_ref):
    return row, 0, kv_block(row, i, y, lo_ref, hi_ref)

  q_spec = pl.BlockSpec((None, None, bq, e), q_map)
  kv_spec = pl.BlockSpec((None, None, bk, e), kv_map)
  q_ids_spec = pl.BlockSpec((None, bq, 1), q_ids_map)
  kv_ids_spec = pl.BlockSpec((None, 1, bk), kv_ids_map)
  kernel = functools.partial(
    _fwd_kernel,
    sm_scale=sm_scale,
    causal=causal,
    window=window,
    softcap=softcap,
    num_q_blocks=n,
    precision=_precision(q_bthe.dtype),
  )
  o_bhte, lse_bht1 = pl.pallas_call(
    kernel,
    out_shape=[
      jax.ShapeDtypeStruct((b, h, t_pad, e), q_bthe.dtype),
      jax.ShapeDtypeStruct((b, h, t_pad, 1), jnp.float32),
    ],
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, h, n, m),
      in_specs=[q_spec, kv_spec, kv_spec, q_ids_spec, q_ids_spec, kv_ids_spec, kv_ids_spec],
      out_specs=[q_spec, pl.BlockSpec((None, None, bq, 1), q_map)],
      scratch_shapes=[
        pltpu.VMEM((bq, 1), jnp.float32),
        pltpu.VMEM((bq, 1), jnp.float32),
        pltpu.VMEM((bq, e), jnp.float32),
      ],
    ),
    # The output block stays resident across the key steps; everything else is independent.
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    ),
    interpret=_interpret(interpret),
    name="flash_attention_fwd_tpu",
  )(lo_bn.reshape(-1), hi_bn.reshape(-1), q_bhte, k_bkse, v_bkse, *ids)
  # The residual without its unit axis: in HBM a TPU tiles a trailing dimension of 1 to 128
  # lanes, which made each layer's saved log-sum-exp 128x its size under a remat policy that
  # keeps it (`ModelConfig.remat_policy`; 128 MiB a layer at 16k tokens, compiled for v5e).
  return jnp.swapaxes(o_bhte, 1, 2)[:, :t], lse_bht1[..., 0]


def _dq_kernel(
  lo_ref,  # SMEM int32[b * n]
  hi_ref,  # SMEM int32[b * n]
  q_ref,  # [bq, e]
  k_ref,  # [bk, e]
  v_ref,  # [bk, e]
  do_ref,  # [bq, e]
  lse_ref,  # f32[bq, 1]
  delta_ref,  # f32[bq, 1]
  seg_q_ref,  # int32[bq, 1]
  pos_q_ref,  # int32[bq, 1]
  seg_kv_ref,  # int32[1, bk]
  pos_kv_ref,  # int32[1, bk]
  dq_ref,  # [bq, e]
  acc_ref,  # scratch f32[bq, e]
  *,
  sm_scale: float,
  causal: bool,
  window: int | None,
  softcap: float | None,
  num_q_blocks: int,
  precision,
):
  row, i, y = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  lo, hi = lo_ref[row * num_q_blocks + i], hi_ref[row * num_q_blocks + i]

  @pl.when(y == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when((y >= lo) & (y < hi))
  def _():
    k_ke = k_ref[...]
    logits_qk = _dot(q_ref[...], k_ke, precision, trans_b=True)
    logits_qk, tanh_qk = reference.scaled_logits(logits_qk, sm_scale, softcap)
    vis_qk = reference.visible(
      seg_q_ref[...],
      pos_q_ref[...],
      seg_kv_ref[...],
      pos_kv_ref[...],
      causal=causal,
      window=window,
    )
    probs_qk = jnp.where(vis_qk, jnp.exp(logits_qk - lse_ref[...]), 0.0)
    dprobs_qk = _dot(do_ref[...], v_ref[...], precision, trans_b=True)
    dlogits_qk = reference.softcap_grad(probs_qk * (dprobs_qk - delta_ref[...]), tanh_qk)
    dlogits_qk = dlogits_qk * sm_scale
    acc_ref[...] += _dot(dlogits_qk.astype(k_ke.dtype), k_ke, precision)

  @pl.when(y == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


def _dkv_kernel(
  lo_ref,  # SMEM int32[b * m]: first query block that may see each key block
  hi_ref,  # SMEM int32[b * m]: one past the last
  q_ref,  # [bq, e]
  k_ref,  # [bk, e]
  v_ref,  # [bk, e]
  do_ref,  # [bq, e]
  lse_ref,  # f32[bq, 1]
  delta_ref,  # f32[bq, 1]
  seg_q_ref,  # int32[bq, 1]
  pos_q_ref,  # int32[bq, 1]
  seg_kv_ref,  # int32[1, bk]
  pos_kv_ref,  # int32[1, bk]
  dk_ref,  # [bk, e]
  dv_ref,  # [bk, e]
  dk_acc_ref,  # scratch f32[bk, e]
  dv_acc_ref,  # scratch f32[bk, e]
  *,
  sm_scale: float,
  causal: bool,
  window: int | None,
  softcap: float | None,
  num_kv_blocks: int,
  precision,
):
  row, y, head, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  lo, hi = lo_ref[row * num_kv_blocks + y], hi_ref[row * num_kv_blocks + y]

  @pl.when((head == 0) & (i == 0))
  def _():
    dk_acc_ref[...] = jnp.zeros_like(dk_acc_ref)
    dv_acc_ref[...] = jnp.zeros_like(dv_acc_ref)

  @pl.when((i >= lo) & (i < hi))
  def _():
    q_qe, do_qe = q_ref[...], do_ref[...]
    logits_qk = _dot(q_qe, k_ref[...], precision, trans_b=True)
    logits_qk, tanh_qk = reference.scaled_logits(logits_qk, sm_scale, softcap)
    vis_qk = reference.visible(
      seg_q_ref[...],
      pos_q_ref[...],
      seg_kv_ref[...],
      pos_kv_ref[...],
      causal=causal,
      window=window,
    )
    probs_qk = jnp.where(vis_qk, jnp.exp(logits_qk - lse_ref[...]), 0.0)
    dv_acc_ref[...] += _dot(probs_qk.astype(do_qe.dtype), do_qe, precision, trans_a=True)
    dprobs_qk = _dot(do_qe, v_ref[...], precision, trans_b=True)
    dlogits_qk = reference.softcap_grad(probs_qk * (dprobs_qk - delta_ref[...]), tanh_qk)
    dlogits_qk = dlogits_qk * sm_scale
    dk_acc_ref[...] += _dot(dlogits_qk.astype(q_qe.dtype), q_qe, precision, trans_a=True)

  @pl.when((head == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
  def _():
    dk_ref[...] = dk_acc_ref[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


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
  lse_bht1 = lse_bht[..., None]  # the kernels' layout, for this backward pass only
  bs, t_pad, s_pad = resolve_block_sizes(block_sizes, t=t, s=s, dtype=q_bthe.dtype)
  bq, bk = bs.block_q_bwd, bs.block_kv_bwd
  n, m = t_pad // bq, s_pad // bk
  q_bhte, k_bkse, v_bkse, ids, meta_p = _layout(q_bthe, k_bske, v_bske, meta, t_pad, s_pad)
  do_bhte = jnp.swapaxes(reference.pad_tokens(do_bthe, t_pad), 1, 2)
  # delta_i = sum_j p_ij dp_ij = do_i . o_i: the softmax's backward, one number per query.
  delta_bht = jnp.einsum(
    "bthe,bthe->bht",
    do_bthe.astype(jnp.float32),
    o_bthe.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  if dlse_bht is not None:  # the log-sum-exp's own cotangent (attention sinks)
    delta_bht = delta_bht - dlse_bht
  delta_bht1 = jnp.pad(delta_bht, ((0, 0), (0, 0), (0, t_pad - t)))[..., None]
  maybe_bnm = reference.block_visibility(meta_p, bq=bq, bk=bk, causal=causal, window=window)
  lo_bn, hi_bn = reference.block_ranges(maybe_bnm)
  lo_bm, hi_bm = reference.block_ranges(jnp.swapaxes(maybe_bnm, 1, 2))
  precision = _precision(q_bthe.dtype)
  interpret = _interpret(interpret)

  # dq: grid (b, h, n, m), key blocks clamped into each query block's range.
  def kv_block(row, i, y, lo_ref, hi_ref):
    return _clamp(y, lo_ref[row * n + i], hi_ref[row * n + i])

  def q_map(row, j, i, y, lo_ref, hi_ref):
    return row, j, i, 0

  def kv_map(row, j, i, y, lo_ref, hi_ref):
    return row, jax.lax.div(j, g), kv_block(row, i, y, lo_ref, hi_ref), 0

  def q_ids_map(row, j, i, y, lo_ref, hi_ref):
    return row, i, 0

  def kv_ids_map(row, j, i, y, lo_ref, hi_ref):
    return row, 0, kv_block(row, i, y, lo_ref, hi_ref)

  q_spec = pl.BlockSpec((None, None, bq, e), q_map)
  kv_spec = pl.BlockSpec((None, None, bk, e), kv_map)
  q_rows_spec = pl.BlockSpec((None, None, bq, 1), q_map)
  q_ids_spec = pl.BlockSpec((None, bq, 1), q_ids_map)
  kv_ids_spec = pl.BlockSpec((None, 1, bk), kv_ids_map)
  dq_bhte = pl.pallas_call(
    functools.partial(
      _dq_kernel,
      sm_scale=sm_scale,
      causal=causal,
      window=window,
      softcap=softcap,
      num_q_blocks=n,
      precision=precision,
    ),
    out_shape=jax.ShapeDtypeStruct((b, h, t_pad, e), q_bthe.dtype),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, h, n, m),
      in_specs=[
        q_spec,
        kv_spec,
        kv_spec,
        q_spec,
        q_rows_spec,
        q_rows_spec,
        q_ids_spec,
        q_ids_spec,
        kv_ids_spec,
        kv_ids_spec,
      ],
      out_specs=q_spec,
      scratch_shapes=[pltpu.VMEM((bq, e), jnp.float32)],
    ),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    ),
    interpret=interpret,
    name="flash_attention_dq_tpu",
  )(
    lo_bn.reshape(-1),
    hi_bn.reshape(-1),
    q_bhte,
    k_bkse,
    v_bkse,
    do_bhte,
    lse_bht1,
    delta_bht1,
    *ids,
  )

  # dk, dv: grid (b, k, m, g, n), query blocks clamped into each key block's range.
  def q_block(row, y, i, lo_ref, hi_ref):
    return _clamp(i, lo_ref[row * m + y], hi_ref[row * m + y])

  def group_q_map(row, kv, y, head, i, lo_ref, hi_ref):
    return row, kv * g + head, q_block(row, y, i, lo_ref, hi_ref), 0

  def group_kv_map(row, kv, y, head, i, lo_ref, hi_ref):
    return row, kv, y, 0

  def group_q_ids_map(row, kv, y, head, i, lo_ref, hi_ref):
    return row, q_block(row, y, i, lo_ref, hi_ref), 0

  def group_kv_ids_map(row, kv, y, head, i, lo_ref, hi_ref):
    return row, 0, y

  q_spec = pl.BlockSpec((None, None, bq, e), group_q_map)
  kv_spec = pl.BlockSpec((None, None, bk, e), group_kv_map)
  q_rows_spec = pl.BlockSpec((None, None, bq, 1), group_q_map)
  q_ids_spec = pl.BlockSpec((None, bq, 1), group_q_ids_map)
  kv_ids_spec = pl.BlockSpec((None, 1, bk), group_kv_ids_map)
  dk_bkse, dv_bkse = pl.pallas_call(
    functools.partial(
      _dkv_kernel,
      sm_scale=sm_scale,
      causal=causal,
      window=window,
      softcap=softcap,
      num_kv_blocks=m,
      precision=precision,
    ),
    out_shape=[
      jax.ShapeDtypeStruct((b, kh, s_pad, e), k_bske.dtype),
      jax.ShapeDtypeStruct((b, kh, s_pad, e), v_bske.dtype),
    ],
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, kh, m, g, n),
      in_specs=[
        q_spec,
        kv_spec,
        kv_spec,
        q_spec,
        q_rows_spec,
        q_rows_spec,
        q_ids_spec,
        q_ids_spec,
        kv_ids_spec,
        kv_ids_spec,
      ],
      out_specs=[kv_spec, kv_spec],
      scratch_shapes=[pltpu.VMEM((bk, e), jnp.float32), pltpu.VMEM((bk, e), jnp.float32)],
    ),
    # dk and dv of a key block are summed over the group's heads and the query blocks.
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
    ),
    interpret=interpret,
    name="flash_attention_dkv_tpu",
  )(
    lo_bm.reshape(-1),
    hi_bm.reshape(-1),
    q_bhte,
    k_bkse,
    v_bkse,
    do_bhte,
    lse_bht1,
    delta_bht1,
    *ids,
  )
  dq_bthe = jnp.swapaxes(dq_bhte, 1, 2)[:, :t]
  return dq_bthe, jnp.swapaxes(dk_bkse, 1, 2)[:, :s], jnp.swapaxes(dv_bkse, 1, 2)[:, :s]
