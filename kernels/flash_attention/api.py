"""The public `flash_attention`: input checks, block sizes, the gradient, the choice of kernel.

Shapes: b batch, t query tokens, s key tokens, h query heads, k kv heads, e head dim.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxrl.kernels.common import IMPLS, check_block_fields, check_sinks, resolve_impl
from jaxrl.kernels.flash_attention import cudnn, reference
from jaxrl.kernels.partitioning import KernelMesh, split_call

# The `checkpoint_name`s of what the backward pass needs from the forward: the output and the
# log-sum-exp residual.
FLASH_RESIDUAL_NAMES = ("flash_attention_out", "flash_attention_lse")
# The kernels' impls, and cuDNN's fused attention (`cudnn.py`; GPU only, never chosen by "auto").
FLASH_IMPLS = (*IMPLS, "cudnn")
_SAVE_NAMED = jax.checkpoint_policies.save_only_these_names(*FLASH_RESIDUAL_NAMES)


def save_attention_policy(prim, *avals, **params) -> bool:
  """A `jax.checkpoint` policy that keeps what attention's backward pass needs from its
  forward: the Pallas kernels' and the reference's output and log-sum-exp (by
  `FLASH_RESIDUAL_NAMES`), and cuDNN's forward outputs (by primitive, since jax names nothing
  inside its cuDNN custom_vjp: `cudnn.CUDNN_FORWARD_PRIMITIVES`)."""
  if prim.name in cudnn.CUDNN_FORWARD_PRIMITIVES:
    return True
  return _SAVE_NAMED(prim, *avals, **params)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the flash attention implementations; a field left as None is derived.

  Token counts are padded up to whole blocks (the padding is invisible); a block larger than
  its (padded) dimension is clipped to it.

  Attributes:
    block_q: query tokens per block in the forward pass. Reference: any. TPU: a multiple of 8
      (16 for 16-bit inputs) or at least the query length. GPU: a power of two >= 16.
    block_kv: key tokens per block in the forward pass. Reference: any. TPU: a multiple of
      128 or at least the key length. GPU: a power of two >= 16.
    block_q_bwd: query tokens per block in the backward pass, rules as `block_q`.
    block_kv_bwd: key tokens per block in the backward pass, rules as `block_kv`.
    num_warps: GPU only: Triton warps per program, a power of two.
    num_stages: GPU only: Triton software-pipelining stages.
    num_warps_bwd: GPU only: `num_warps` of the backward kernels (default: `num_warps`).
    num_stages_bwd: GPU only: `num_stages` of the backward kernels (default: `num_stages`).
    block_q_dq: GPU only: query tokens per block of the dq kernel (default: `block_q_bwd`),
      so that dq and dk/dv can be tiled apart: the dk/dv kernel keeps `block_q_bwd` x
      `block_kv_bwd`.
    block_kv_dq: GPU only: key tokens per block of the dq kernel (default: `block_kv_bwd`).
    max_segments: `impl="cudnn"` only: segments a row may hold in cuDNN's packed layout
      (default 16, at least 2); a batch with a row of more runs the Pallas GPU kernel. cuDNN
      keeps `max_segments` float32 softmax statistics per query and head for the backward.
  """

  block_q: int | None = None
  block_kv: int | None = None
  block_q_bwd: int | None = None
  block_kv_bwd: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  num_warps_bwd: int | None = None
  num_stages_bwd: int | None = None
  block_q_dq: int | None = None
  block_kv_dq: int | None = None
  max_segments: int | None = None

  def __post_init__(self):
    check_block_fields(self)


def _load_tpu() -> ModuleType:
  from jaxrl.kernels.flash_attention import pallas_tpu

  return pallas_tpu


def _load_gpu() -> ModuleType:
  from jaxrl.kernels.flash_attention import pallas_gpu

  return pallas_gpu


# Kernels load lazily, so that a CPU-only install never imports a backend it cannot use. Each
# module has `forward(q, k, v, meta, *, causal, window, softcap, sm_scale, block_sizes,
# interpret) -> (o, residual)` and `backward(q, k, v, meta, o, residual, do, *, ...) -> (dq, dk,
# dv)`, where `residual` (the log-sum-exp of each query's logits) is laid out as that module
# likes, `window` is the sliding window (`reference.visible`) and `softcap` the logit cap
# (`reference.scaled_logits`), None for none.
_LOADERS: dict[str, Callable[[], ModuleType]] = {
  "reference": lambda: reference,
  "pallas_tpu": _load_tpu,
  "pallas_gpu": _load_gpu,
}


def _check_ids(name: str, x, shape: tuple[int, int], what: str) -> None:
  if x is None:
    return
  if x.shape != shape:
    raise ValueError(f"{name} must be [batch, {what}] = {list(shape)}, got shape {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer (int32) array, got {x.dtype}.")


def _check_inputs(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal):
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, q_len, num_q_heads, head_dim], got shape {q.shape}.")
  if k.ndim != 4:
    raise ValueError(f"k must be [batch, kv_len, num_kv_heads, head_dim], got shape {k.shape}.")
  if v.shape != k.shape:
    raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}.")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q must be a floating dtype, got {q.dtype}.")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(
      f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}; cast them "
      "(the softmax runs in float32 whatever the input dtype)."
    )
  b, t, h, e = q.shape
  b_kv, s, kh, e_kv = k.shape
  if b_kv != b:
    raise ValueError(f"q has batch {b} but k/v have batch {b_kv}.")
  if e_kv != e:
    raise ValueError(f"q has head_dim {e} but k/v have head_dim {e_kv}.")
  if kh < 1 or h % kh:
    raise ValueError(
      f"num_q_heads ({h}) must be a multiple of num_kv_heads ({kh}): query head i uses kv head "
      "i // (num_q_heads // num_kv_heads)."
    )
  _check_ids("q_segment_ids", q_segment_ids, (b, t), "q_len")
  _check_ids("kv_segment_ids", kv_segment_ids, (b, s), "kv_len")
  _check_ids("q_positions", q_positions, (b, t), "q_len")
  _check_ids("kv_positions", kv_positions, (b, s), "kv_len")
  if t != s and (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(
      f"q_len ({t}) != kv_len ({s}): give both q_segment_ids and kv_segment_ids, or neither."
    )
  if causal and t != s and (q_positions is None or kv_positions is None):
    raise ValueError(
      f"causal attention with q_len ({t}) != kv_len ({s}) needs q_positions and kv_positions: "
      "where the queries sit among the keys is not implied by the shapes (a prefill chunk after "
      "cached keys has q_positions = first_position + arange(q_len))."
    )


def _check_window(window, causal: bool) -> None:
  """A static window size, or None. A bool is an int to Python but never a window; the bound
  keeps `q_positions - window` inside int32 for the non-negative positions this package uses."""
  if window is None:
    return
  if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < 2**31:
    raise ValueError(
      f"sliding_window must be None or a Python int in [1, 2**31), got {window!r}: it is "
      "static, the number of positions a query sees, its own included."
    )
  if not causal:
    raise ValueError(
      f"sliding_window={window} needs causal=True: the window holds the positions up to the "
      "query's own."
    )


def _check_softcap(softcap) -> float | None:
  """A static cap as a float, or None. A bool is an int to Python but never a cap; an array
  (traced or not) cannot be one, since the cap is compiled into the kernels."""
  if softcap is None:
    return None
  if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not softcap > 0:
    raise ValueError(
      f"logit_softcap must be None or a Python float > 0, got {softcap!r}: it is static, the "
      "bound c of the logits s -> c * tanh(s / c) (Gemma 2's attention uses 50.0)."
    )
  if not math.isfinite(softcap):
    raise ValueError(f"logit_softcap must be finite, got {softcap!r}; None caps nothing.")
  return float(softcap)


def _metadata(b, t, s, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
  """(q segment ids, kv segment ids, q positions, kv positions), int32, defaults filled in.

  With q_len == kv_len (self-attention) the kv ids and positions default to the queries'.
  """
  if q_segment_ids is None:
    q_segment_ids = jnp.zeros((b, t), jnp.int32)
  if kv_segment_ids is None:
    kv_segment_ids = q_segment_ids if s == t else jnp.zeros((b, s), jnp.int32)
  if q_positions is None:
    q_positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  if kv_positions is None:
    kv_positions = (
      q_positions if s == t else jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    )
  ids = (q_segment_ids, kv_segment_ids, q_positions, kv_positions)
  return reference.Metadata(*(x.astype(jnp.int32) for x in ids))


# Static configuration shared by forward and backward: (impl, causal, window, softcap, sm_scale,
# block_sizes, interpret, kernel_mesh); `window` is the sliding window and `softcap` the logit
# cap (a float), None for none; `kernel_mesh` the operands' `KernelMesh` or None.


def _forward(cfg, q, k, v, meta):
  impl, causal, window, softcap, sm_scale, block_sizes, interpret, kernel_mesh = cfg
  module = _LOADERS[impl]()
  kwargs = {} if impl == "reference" else {"interpret": interpret}
  forward = functools.partial(
    module.forward, causal=causal, window=window, softcap=softcap, sm_scale=sm_scale,
    block_sizes=block_sizes, **kwargs,
  )  # fmt: skip
  if impl == "reference":
    return forward(q, k, v, meta)

  def local(q, k, v, *meta):
    return forward(q, k, v, reference.Metadata(*meta))

  return split_call(
    local, f"{_KERNEL_OPERANDS} -> b t h e, b h u", kernel_mesh, q, k, v, *meta,
    rows=("b",), heads=("h", "k"),
  )  # fmt: skip


# The kernels' operands (q, k, v, the 4 metadata arrays) for `kernels.partitioning`: each
# device attends with its own rows and heads.
_KERNEL_OPERANDS = "b t h e, b s k e, b s k e, b t, b s, b t, b s"


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q_bthe, k_bske, v_bske, meta, cfg):
  return _forward(cfg, q_bthe, k_bske, v_bske, meta)[0]


def _flash_fwd(q_bthe, k_bske, v_bske, meta, cfg):
  o_bthe, residual = _forward(cfg, q_bthe, k_bske, v_bske, meta)
  # Named, so that a `jax.checkpoint` policy can keep them and spare the backward pass a second
  # forward (`jaxrl.model.ModelConfig.remat_policy`); without a policy the names do nothing.
  o_bthe = checkpoint_name(o_bthe, FLASH_RESIDUAL_NAMES[0])
  residual = jax.tree.map(lambda x: checkpoint_name(x, FLASH_RESIDUAL_NAMES[1]), residual)
  return o_bthe, (q_bthe, k_bske, v_bske, meta, o_bthe, residual)


def _backward(cfg, residuals, do_bthe, dlse_bht=None):
  """(dq, dk, dv) from the kernel of `cfg`; `dlse_bht`: a cotangent of the log-sum-exp too."""
  impl, causal, window, softcap, sm_scale, block_sizes, interpret, kernel_mesh = cfg
  q_bthe, k_bske, v_bske, meta, o_bthe, residual = residuals
  module = _LOADERS[impl]()
  kwargs = {} if impl == "reference" else {"interpret": interpret}
  backward = functools.partial(
    module.backward, causal=causal, window=window, softcap=softcap, sm_scale=sm_scale,
    block_sizes=block_sizes, **kwargs,
  )  # fmt: skip
  do_bthe = do_bthe.astype(q_bthe.dtype)
  if impl == "reference":
    dlse = {} if dlse_bht is None else {"dlse_bht": dlse_bht}
    return backward(q_bthe, k_bske, v_bske, meta, o_bthe, residual, do_bthe, **dlse)
  extra = () if dlse_bht is None else (dlse_bht,)

  def local(q, k, v, q_seg, kv_seg, q_pos, kv_pos, o, lse, do, *dlse_bht):
    dlse = {"dlse_bht": dlse_bht[0]} if dlse_bht else {}
    meta = reference.Metadata(q_seg, kv_seg, q_pos, kv_pos)
    return backward(q, k, v, meta, o, lse, do, **dlse)

  rule = f"{_KERNEL_OPERANDS}, b t h e, b h u, b t h e" + ", b h t" * bool(extra)
  return split_call(
    local, f"{rule} -> b t h e, b s k e, b s k e", kernel_mesh,
    q_bthe, k_bske, v_bske, *meta, o_bthe, residual, do_bthe, *extra,
    rows=("b",), heads=("h", "k"),
  )  # fmt: skip


def _flash_bwd(cfg, residuals, do_bthe):
  dq, dk, dv = _backward(cfg, residuals, do_bthe)
  return dq, dk, dv, None  # integer segment ids and positions get no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


# Attention sinks (gpt-oss): a logit per query head that joins every query's softmax with a
# zero value. With the kernel's log-sum-exp l of a query's keys, the sink's share is
# sigmoid(sink - l), so the output is the kernel's times w = sigmoid(l - sink): no kernel
# change in the forward pass. Backward: the kernel's output gets the cotangent do * w, and l
# gets dl = w (1 - w) (do . o), which the kernels subtract from their delta = do . o
# (FlashAttention-2's softmax backward), since d l / d logit = the probability; the sink's
# gradient is -sum dl over the batch and the queries.


def _sink_weights(lse_bht, sinks_h, t: int):
  """f32 `[b, h, t]`: the share of each query's softmax that its keys keep beside its head's
  sink (1 for a query that sees no key: its log-sum-exp is +inf and its output 0). A kernel's
  log-sum-exp may run past the t queries (the GPU kernel's padding)."""
  return jax.nn.sigmoid(lse_bht[..., :t] - sinks_h.astype(jnp.float32)[None, :, None])


def _sink_scaled(o_bthe, w_bht):
  scaled = o_bthe.astype(jnp.float32) * jnp.swapaxes(w_bht, 1, 2)[..., None]
  return scaled.astype(o_bthe.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_sinks(q_bthe, k_bske, v_bske, sinks_h, meta, cfg):
  o_bthe, lse_bht = _forward(cfg, q_bthe, k_bske, v_bske, meta)
  return _sink_scaled(o_bthe, _sink_weights(lse_bht, sinks_h, q_bthe.shape[1]))


def _flash_sinks_fwd(q_bthe, k_bske, v_bske, sinks_h, meta, cfg):
  o_bthe, residuals = _flash_fwd(q_bthe, k_bske, v_bske, meta, cfg)
  lse_bht = residuals[-1]
  w_bht = _sink_weights(lse_bht, sinks_h, q_bthe.shape[1])
  return _sink_scaled(o_bthe, w_bht), (sinks_h, residuals)


def _flash_sinks_bwd(cfg, residuals, dout_bthe):
  sinks_h, flash_residuals = residuals
  q_bthe, *_, o_bthe, lse_bht = flash_residuals
  w_bht = _sink_weights(lse_bht, sinks_h, q_bthe.shape[1])
  dout_bthe = dout_bthe.astype(jnp.float32)
  do_bthe = dout_bthe * jnp.swapaxes(w_bht, 1, 2)[..., None]
  dot_bht = jnp.einsum(
    "bthe,bthe->bht", dout_bthe, o_bthe.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
  )
  dlse_bht = w_bht * (1.0 - w_bht) * dot_bht
  dq, dk, dv = _backward(cfg, flash_residuals, do_bthe, dlse_bht)
  dsinks_h = -jnp.sum(dlse_bht, axis=(0, 2)).astype(sinks_h.dtype)
  return dq, dk, dv, dsinks_h, None


_flash_sinks.defvjp(_flash_sinks_fwd, _flash_sinks_bwd)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _run(q, k, v, ids, sinks=None, *, cfg):
  b, t = q.shape[:2]
  meta = _metadata(b, t, k.shape[1], *ids)  # under jit: the defaults live where q does
  if sinks is not None:
    return _flash_sinks(q, k, v, sinks, meta, cfg)
  return _flash(q, k, v, meta, cfg)


@functools.partial(jax.jit, static_argnames=("cfg", "max_segments"))
def _run_cudnn(q, k, v, ids, *, cfg, max_segments):
  """cuDNN where the batch's layout allows, else the kernel of `cfg` (`cudnn.attention`)."""
  _, causal, _, _, sm_scale, _, _, _ = cfg
  b, t = q.shape[:2]
  meta = _metadata(b, t, k.shape[1], *ids)
  q_seg, kv_seg, q_pos, kv_pos = ids
  return cudnn.attention(
    q, k, v, meta,
    segments=q_seg is not None or kv_seg is not None,
    positions=q_pos is not None or kv_pos is not None,
    causal=causal, sm_scale=sm_scale, max_segments=max_segments,
    fallback=lambda q, k, v: _flash(q, k, v, meta, cfg),
  )  # fmt: skip


def flash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  q_positions: jax.Array | None = None,
  kv_positions: jax.Array | None = None,
  causal: bool = True,
  sliding_window: int | None = None,
  logit_softcap: float | None = None,
  sinks: jax.Array | None = None,
  sm_scale: float | None = None,
  impl: str = "auto",
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
  mesh: KernelMesh | None = None,
) -> jax.Array:
  """Grouped-query softmax attention for training and prefill, in memory linear in length.

  Query `i` of row `b` sees key `j` iff they share a segment id that is not negative and, when
  `causal`, `kv_positions[b, j] <= q_positions[b, i]` (the visibility rule of
  `jaxrl.model.cache.dot_attention`, plus segments), and with a `sliding_window` w also
  `kv_positions[b, j] > q_positions[b, i] - w`: the query sees the w positions up to its own
  (Mistral's and Gemma 3's local attention; transformers' `sliding_window_overlay`). Query head
  `n` uses kv head `n // (num_q_heads // num_kv_heads)`. The logits are `s = sm_scale * q . k`,
  with a `logit_softcap` c capped to `c * tanh(s / c)` (Gemma 2), then masked by the rule (a
  key the query does not see stays out of its softmax). The softmax runs in float32 over
  blocks of keys (online softmax), so no `[q_len, kv_len]` matrix is ever formed; a query that
  sees no key gets zeros (not NaN) and passes no gradient. Differentiable in q, k and v with
  every impl: a `custom_vjp` whose backward pass recomputes the probabilities (and the cap's
  tanh, whose derivative `1 - tanh**2` it passes on) block by block from the saved log-sum-exp
  of the capped logits (FlashAttention-2).

  Packed rows: give each sequence of a row its own segment id (0, 1, 2, ...) and restart its
  positions at 0. Padding: segment id -1 (any negative id), for query and key tokens alike; a
  padding query outputs zeros, a padding key is seen by nobody.

  Args:
    q: `[batch, q_len, num_q_heads, head_dim]` queries.
    k: `[batch, kv_len, num_kv_heads, head_dim]` keys, same dtype as q.
    v: values, same shape and dtype as k.
    q_segment_ids: int `[batch, q_len]`; default all 0 (one segment per row).
    kv_segment_ids: int `[batch, kv_len]`; default q_segment_ids when kv_len == q_len, else
      all 0 (then q_segment_ids must be None too).
    q_positions: int `[batch, q_len]`; default `arange(q_len)`.
    kv_positions: int `[batch, kv_len]`; default q_positions when kv_len == q_len. With
      `causal` and kv_len != q_len both positions must be given (a prefill chunk after cached
      keys).
    causal: apply the position rule; False attends to the whole segment.
    sliding_window: None (no window), or a Python int >= 1 (static: each value compiles its
      own kernels), with `causal`: each query sees only keys less than this many positions
      behind it (1: itself alone). Key blocks wholly outside every query's window are skipped.
    logit_softcap: None (no cap), or a Python float c > 0 (an int is taken as a float; static:
      each value compiles its own kernels): logits `s` become `c * tanh(s / c)`, inside (-c, c)
      (transformers' Gemma 2 `attn_logit_softcapping`, 50.0 there). None traces no tanh: the
      uncapped kernels.
    sinks: None, or float `[num_q_heads]` attention sinks (gpt-oss): query head n's softmax
      has one more logit, `sinks[n]` (in the units of the scaled and capped logits), whose
      value is zero, so it takes a share of the probability and adds nothing; a query that
      sees no key still outputs zeros. Differentiable in `sinks`. The kernels run unchanged
      and the output is scaled by the keys' share, from their log-sum-exp.
    sm_scale: logit multiplier (> 0), default `head_dim ** -0.5`, applied before the cap.
    impl: `"auto"` (`pallas_tpu` on TPU, `pallas_gpu` on GPU, `reference` elsewhere, from the
      platform of q's devices, or of the default backend while tracing), `"reference"` (jnp,
      blockwise), `"pallas_tpu"`, `"pallas_gpu"`, or `"cudnn"`: cuDNN's fused attention
      through jax (bf16/fp16, q_len == kv_len, an NVIDIA GPU; packed rows on Hopper or later
      in cuDNN's packed layout), with the `pallas_gpu` kernel for a batch whose rows are not
      laid out as that layout needs (`jaxrl.kernels.flash_attention.cudnn`). With a
      `sliding_window`, a `logit_softcap` or `sinks` it always runs that `pallas_gpu`
      fallback, not cuDNN (whose own window has not been tested against this rule, and which
      has no cap and no sinks); the inputs must still be what cuDNN takes.
    block_sizes: tiling, None for defaults derived from the shapes.
    interpret: run the Pallas kernel in interpret mode (on CPU). True, or for `pallas_tpu` a
      `pltpu.InterpretParams`; it needs a kernel `impl`, since the reference has no kernel
      (with `"cudnn"`: the fallback kernel's).
    mesh: where the operands live on a mesh (`KernelMesh`: rows split over its `rows` axes,
      kv heads over its `heads` axes): the kernels, forward and backward, then run on each
      device's rows and heads (`jaxrl.kernels.partitioning`). None: one call, which on more
      than one device XLA gathers whole onto each (GPU) or refuses (TPU). cuDNN's attention
      is split by jax's own rules.

  Returns:
    `[batch, q_len, num_q_heads, head_dim]` in q's dtype.

  Raises:
    ValueError: unknown `impl`, inconsistent shapes or dtypes, missing positions for a causal
      q_len != kv_len, `interpret` without a kernel, block sizes the chosen implementation
      cannot use, `sm_scale` <= 0, a `sliding_window` that is not an int >= 1 or comes
      without `causal`, a `logit_softcap` that is not a finite float (or int) > 0, or
      `sinks` that are not a float `[num_q_heads]` array.
  """
  if impl not in FLASH_IMPLS:
    raise ValueError(f"Unknown flash_attention impl {impl!r}; expected one of {FLASH_IMPLS}.")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes)}.")
  if not isinstance(causal, bool):
    raise ValueError(f"causal must be a bool, got {causal!r}.")
  _check_window(sliding_window, causal)
  softcap = _check_softcap(logit_softcap)
  _check_inputs(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal)
  check_sinks(sinks, q.shape[2])
  max_segments = block_sizes.max_segments if block_sizes is not None else None
  if impl == "cudnn":
    max_segments = max_segments or cudnn.DEFAULT_MAX_SEGMENTS
    cudnn.check_inputs(q, k, max_segments=max_segments)
    if block_sizes is not None:  # the fallback kernel's tiling
      block_sizes = dataclasses.replace(block_sizes, max_segments=None)
  else:
    if max_segments is not None:
      raise ValueError(
        f"BlockSizes.max_segments={max_segments} applies to impl='cudnn' only, got impl={impl!r}."
      )
    impl = resolve_impl("flash_attention", impl, interpret, q)
  b, t, h, e = q.shape
  s = k.shape[1]
  if sm_scale is None:
    sm_scale = e**-0.5
  if not float(sm_scale) > 0:
    # The GPU kernel takes the running maximum over unscaled logits, which needs a positive
    # scale; a non-positive one has no use in attention.
    raise ValueError(f"flash_attention needs sm_scale > 0, got {sm_scale}.")
  if min(b, t, h, e) == 0 or s == 0:
    return jnp.zeros(q.shape, q.dtype)  # nothing to attend to: every query sees no key
  ids = (q_segment_ids, kv_segment_ids, q_positions, kv_positions)
  if impl == "cudnn":
    cfg = (
      "pallas_gpu", causal, sliding_window, softcap, float(sm_scale), block_sizes, interpret,
      mesh,
    )  # fmt: skip
    if sliding_window is not None or softcap is not None or sinks is not None:
      return _run(q, k, v, ids, sinks, cfg=cfg)  # cuDNN's fallback for every batch
    return _run_cudnn(q, k, v, ids, cfg=cfg, max_segments=max_segments)
  cfg = (impl, causal, sliding_window, softcap, float(sm_scale), block_sizes, interpret, mesh)
  return _run(q, k, v, ids, sinks, cfg=cfg)
