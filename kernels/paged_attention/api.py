"""The public `paged_attention`: input checks, block sizes, and the choice of implementation.

A sliding window (`sliding_window=w`, Mistral / Gemma 3 local layers) limits a sequence of
length L, whose query is at position L - 1, to the positions `[max(0, L - w), L)`: the w
positions up to and including its own (transformers' `kv_idx > q_idx - sliding_window`).

Shapes: n sequences, h query heads, k kv heads, d head dim, p pages in the pool, s tokens per
page, m pages per sequence.
"""

import contextvars
import dataclasses
import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.kernels.common import (
  IMPLS,
  check_block_fields,
  check_sinks,
  resolve_impl,
  traced_setting,
)
from jaxrl.kernels.paged_attention import reference
from jaxrl.kernels.partitioning import KernelMesh, local_page_ids, split_call


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the paged attention kernels and the choices that go with it; a field left as
  None is derived from the shapes.

  Attributes:
    pages_per_compute_block: pages of one sequence attended to per inner step (both kernels).
      The GPU kernel needs `pages_per_compute_block * page_size * head_dim` to be a power of
      two and, where it multiplies with tensor-core dots, `pages_per_compute_block * page_size
      >= 16`.
    num_splits: GPU only: the page axis of every sequence is cut into this many parts, each
      its own program, merged afterwards (split-K / flash-decoding), to fill the GPU when
      `num_seqs * num_kv_heads` is small; with a sliding window, the compute blocks that a
      window can span, counted from the one holding its first position. The TPU kernel
      accepts only None or 1.
    num_warps: GPU only: Triton warps per program, a power of two.
    num_stages: GPU only: Triton software-pipelining stages.
    dot_min_group: GPU only: the smallest GQA group size g = num_q_heads // num_kv_heads that
      the kernel multiplies with tensor-core dots (g rows padded to 16); a smaller g is
      multiplied and summed in float32 on CUDA cores, exactly, with no padded rows. None: 1
      (always dots) for 16-bit pools; for float32 pools 5 (g <= 4 multiplies exactly, which
      costs fewer instructions than splitting for tensor cores), or 16 at
      `precision="highest"` (exact either way; a padded IEEE dot would do 16 rows of work).
    reference_below_tokens: `impl="auto"` only: run the jnp reference instead of the
      kernel when a sequence's capacity, `pages_per_seq * page_size`, is below this many
      tokens (short contexts, where one XLA gather and matmul may beat a kernel launch and the
      split merge). None: always the kernel. No default threshold is set, since none has been
      measured.
  """

  pages_per_compute_block: int | None = None
  num_splits: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  dot_min_group: int | None = None
  reference_below_tokens: int | None = None

  def __post_init__(self):
    check_block_fields(self)


_DEFAULT_BLOCK_SIZES: contextvars.ContextVar[BlockSizes | None] = contextvars.ContextVar(
  "paged_attention_block_sizes", default=None
)


def default_block_sizes(block_sizes: BlockSizes):
  """Traces inside use `block_sizes` where a call passes None (the model's decode step does):
  for comparing tilings inside the model (`bench.py decode_profile --attention-blocks`)
  without threading block sizes through it (`jaxrl.kernels.common.traced_setting`)."""
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"default_block_sizes takes a BlockSizes, got {type(block_sizes)}.")
  return traced_setting(_DEFAULT_BLOCK_SIZES, block_sizes)


def _load_tpu() -> Callable[..., jax.Array]:
  from jaxrl.kernels.paged_attention import pallas_tpu

  return pallas_tpu.paged_attention


def _load_gpu() -> Callable[..., jax.Array]:
  from jaxrl.kernels.paged_attention import pallas_gpu

  return pallas_gpu.paged_attention


# Kernels load lazily, so that a CPU-only install never imports a backend it cannot use.
_LOADERS: dict[str, Callable[[], Callable[..., jax.Array]]] = {
  "reference": lambda: reference.paged_attention,
  "pallas_tpu": _load_tpu,
  "pallas_gpu": _load_gpu,
}


def _check_precision(precision) -> jax.lax.Precision:
  """`precision` as a `jax.lax.Precision`; None is HIGH (split precision for float32)."""
  if precision is None:
    return jax.lax.Precision.HIGH
  if isinstance(precision, jax.lax.Precision):
    return precision
  if isinstance(precision, str):
    try:
      return jax.lax.Precision(precision)
    except ValueError:
      pass
  raise ValueError(
    "precision must be None, a jax.lax.Precision or its name ('default', 'high', 'highest'), "
    f"got {precision!r}."
  )


def _check_inputs(q, k_pages, v_pages, lengths, page_indices) -> None:
  if q.ndim != 3:
    raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim], got shape {q.shape}.")
  if k_pages.ndim != 4:
    raise ValueError(
      "k_pages must be [num_kv_heads, total_pages, page_size, head_dim], got shape "
      f"{k_pages.shape}."
    )
  if v_pages.shape != k_pages.shape:
    raise ValueError(
      f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}."
    )
  if v_pages.dtype != k_pages.dtype:
    raise ValueError(
      f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and {v_pages.dtype}."
    )
  for name, x in (("q", q), ("k_pages", k_pages)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {x.dtype}.")
  n, h, d = q.shape
  k, p, s, d_kv = k_pages.shape
  if d_kv != d:
    raise ValueError(f"q has head_dim {d} but k_pages/v_pages have head_dim {d_kv}.")
  if min(k, p, s, d) < 1:
    raise ValueError(f"k_pages/v_pages must have no empty dimension, got shape {k_pages.shape}.")
  if h % k:
    raise ValueError(
      f"num_q_heads ({h}) must be a multiple of num_kv_heads ({k}): query head i uses kv head "
      "i // (num_q_heads // num_kv_heads)."
    )
  if page_indices.ndim != 2 or page_indices.shape[0] != n or page_indices.shape[1] < 1:
    raise ValueError(
      f"page_indices must be [num_seqs={n}, pages_per_seq >= 1] like q's batch, got shape "
      f"{page_indices.shape}."
    )
  if lengths.shape != (n,):
    raise ValueError(f"lengths must be [num_seqs={n}] like q's batch, got shape {lengths.shape}.")
  for name, x in (("lengths", lengths), ("page_indices", page_indices)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer (int32) array, got {x.dtype}.")


def _check_sliding_window(sliding_window, capacity: int) -> int | None:
  """`sliding_window` as a Python int, or None where it cannot exclude a position: a window
  of at least the page table's capacity covers every (clipped) length, so it runs the kernels
  without window arithmetic, as the same compiled programs as no window."""
  if sliding_window is None:
    return None
  if (
    isinstance(sliding_window, bool)
    or not isinstance(sliding_window, numbers.Integral)
    or sliding_window < 1
  ):
    raise ValueError(
      "sliding_window must be None or a Python int >= 1 (static: it shapes the kernel's "
      f"loops), got {sliding_window!r}."
    )
  return None if sliding_window >= capacity else int(sliding_window)


def _check_logit_softcap(logit_softcap) -> float | None:
  if logit_softcap is None:
    return None
  if (
    isinstance(logit_softcap, bool)
    or not isinstance(logit_softcap, numbers.Real)
    or not 0 < logit_softcap < float("inf")
  ):
    raise ValueError(
      f"logit_softcap must be None or a finite Python float > 0, got {logit_softcap!r}."
    )
  return float(logit_softcap)


@functools.partial(
  jax.jit,
  static_argnames=(
    "impl", "sm_scale", "sliding_window", "logit_softcap", "block_sizes", "precision",
    "interpret", "kernel_mesh",
  ),
)  # fmt: skip
def _run(
  q,
  k_pages,
  v_pages,
  lengths,
  page_indices,
  sinks=None,
  *,
  impl,
  sm_scale,
  sliding_window,
  logit_softcap,
  block_sizes,
  precision,
  interpret,
  kernel_mesh,
):
  _, _, s, _ = k_pages.shape
  m = page_indices.shape[1]
  # Kernels never read past a sequence's m pages: lengths beyond m * s or below 0 are clipped.
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, m * s)
  page_indices = page_indices.astype(jnp.int32)
  fn = _LOADERS[impl]()
  # Passed only when set, so that calls without them trace exactly as they always have.
  extra = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
  extra = {key: value for key, value in extra.items() if value is not None}
  if impl != "reference":  # the kernels'
    extra.update(block_sizes=block_sizes, interpret=interpret)
  # The TPU kernel multiplies in float32 at HIGHEST, at least as accurate as any precision.
  if impl == "pallas_gpu":
    extra["precision"] = precision
  kernel = functools.partial(fn, sm_scale=sm_scale, **extra)
  # On each device's sequences and kv heads (`kernels.partitioning`): the pools stay split
  # over their kv heads, as a tensor-parallel engine holds them, and over the rows' axes with
  # the rows where the engine splits its pages (each row's pages are then on its device).
  rule = "n h d, k p s d, k p s d, n, n m"
  args = (q, k_pages, v_pages, lengths, page_indices)
  if sinks is not None:
    rule, args = rule + ", h", (*args, sinks.astype(jnp.float32))
  local = functools.partial(_on_local_pages, kernel)
  return split_call(
    local, rule + " -> n h d", kernel_mesh, *args, rows=("n",), heads=("h", "k"), pages=("p",)
  )


def _on_local_pages(kernel, q, k_pages, v_pages, lengths, table, *sinks, page_offset):
  """`kernel` over this device's pages: the table's global page ids less `page_offset`
  (`split_call`); the sinks, if any, as its `sinks_h`."""
  table = local_page_ids(table, page_offset, k_pages.shape[1])
  return kernel(q, k_pages, v_pages, lengths, table, **({"sinks_h": sinks[0]} if sinks else {}))


def paged_attention(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  lengths: jax.Array,
  page_indices: jax.Array,
  *,
  sm_scale: float | None = None,
  sliding_window: int | None = None,
  logit_softcap: float | None = None,
  sinks: jax.Array | None = None,
  precision: str | jax.lax.Precision | None = None,
  impl: str = "auto",
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
  mesh: KernelMesh | None = None,
) -> jax.Array:
  """Decode attention of one query per sequence over a paged KV cache (GQA/MQA aware).

  Query head `i` attends with kv head `i // (num_q_heads // num_kv_heads)` to the first
  `lengths[b]` tokens of sequence `b`, stored in order in pages `page_indices[b, 0], ...` of
  the pools (token `t` lives in page `page_indices[b, t // page_size]`, slot
  `t % page_size`). With `sliding_window=w` it attends only to the last w of them, positions
  `[max(0, lengths[b] - w), lengths[b])`: the query sits at position `lengths[b] - 1`, and
  key position `j` is seen when `j > lengths[b] - 1 - w` (transformers' sliding-window rule,
  Mistral and Gemma 3's local layers). With `logit_softcap=c` the scaled logits `s` become
  `c * tanh(s / c)` before the mask (Gemma 2). With `sinks` (gpt-oss) query head i's softmax
  has one more logit, `sinks[i]`, whose value is zero: it takes a share of the probability and
  adds nothing (a padding row still outputs zeros). The softmax runs in float32.

  Precision. The softmax and every sum are float32. Products: the reference and the TPU kernel
  multiply in float32 (`Precision.HIGHEST`) whatever `precision` says. The GPU kernel
  multiplies 16-bit pools (the default on accelerators: bfloat16 K/V, float32 softmax) in
  their dtype with float32 accumulation, after rounding q and the softmax weights to it, when
  it uses tensor-core dots (`BlockSizes.dot_min_group`); without dots it multiplies in float32.
  For float32 pools `precision` is the least accuracy of its products:
  - None or "high" (default): split precision, "3xTF32": each float32 operand is split into a
    TF32 high part and a TF32 residual and three tensor-core passes sum the significant
    partial products, so each product is within 3 * 2**-22 (~12 float32 rounding units) of
    exact: float32 results (rollout log-probs that match the learner's) at tensor-core speed.
  - "highest": exact IEEE float32 (CUDA-core multiply-adds; the opt-out to bit-for-bit float32
    products).
  - "default": one TF32 pass (2**-11 relative per product), the fastest.
  Where the GPU kernel multiplies without dots (small GQA groups of a float32 pool, by
  default g <= 4), its products are exact whatever `precision` says.

  Args:
    q: `[num_seqs, num_q_heads, head_dim]` queries.
    k_pages: `[num_kv_heads, total_pages, page_size, head_dim]` key pool.
    v_pages: value pool, same shape and dtype as `k_pages`.
    lengths: int32 `[num_seqs]` tokens in cache per sequence, counting the current token
      (already written into the pages). 0 marks a padding row, whose output is zeros. Values
      are clipped to `[0, pages_per_seq * page_size]`.
    page_indices: int32 `[num_seqs, pages_per_seq]` page ids of each sequence in order;
      entries past a sequence's last used page are never used but must be valid page ids.
    sm_scale: logit multiplier, default `head_dim ** -0.5`.
    sliding_window: None (every position) or a static Python int w >= 1: each sequence
      attends to its last w positions, its own included (above). The kernels mask positions
      before the window like those past the length (stale slots cannot leak in) and skip the
      compute blocks and pages wholly before it; a window of at least `pages_per_seq *
      page_size` tokens excludes nothing and runs as None.
    logit_softcap: None, or a static Python float c > 0 (above).
    sinks: None, or a float `[num_q_heads]` array of sink logits (above), in the units of the
      scaled (and capped) logits; taken in float32.
    precision: None, a `jax.lax.Precision` or its name ("default", "high", "highest"): the
      least accuracy of the GPU kernel's float32 products (above).
    impl: `"auto"` (`pallas_tpu` on TPU, `pallas_gpu` on GPU, `reference` elsewhere, from the
      platform of q's devices, or of the default backend while tracing), `"reference"`,
      `"pallas_tpu"` or `"pallas_gpu"`.
    block_sizes: kernel tiling, None for defaults derived from the shapes (or those set by
      `default_block_sizes` around the trace).
    interpret: run the Pallas kernel in interpret mode (on CPU). True, or for `pallas_tpu` a
      `pltpu.InterpretParams`; it needs a kernel `impl`, since the reference has no kernel.
    mesh: where the operands live on a mesh (`KernelMesh`: sequences split over its `rows`
      axes, kv heads and the pools over its `heads` axes): the kernel then runs on each
      device's sequences and heads (`jaxrl.kernels.partitioning`). None: one call, which on
      more than one device XLA gathers whole onto each (GPU) or refuses (TPU).

  Returns:
    `[num_seqs, num_q_heads, head_dim]` attention output in q's dtype.

  Raises:
    ValueError: unknown `impl` or `precision`, inconsistent shapes or dtypes, a
      `sliding_window` that is not None or an int >= 1, a `logit_softcap` that is not None or
      a float > 0, `sinks` that are not a float `[num_q_heads]` array, `interpret` without a
      kernel, or
      block sizes the chosen kernel cannot use.
  """
  if impl not in IMPLS:
    raise ValueError(f"Unknown paged_attention impl {impl!r}; expected one of {IMPLS}.")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes)}.")
  block_sizes = block_sizes or _DEFAULT_BLOCK_SIZES.get()
  _check_inputs(q, k_pages, v_pages, lengths, page_indices)
  precision = _check_precision(precision)
  sliding_window = _check_sliding_window(sliding_window, page_indices.shape[1] * k_pages.shape[2])
  logit_softcap = _check_logit_softcap(logit_softcap)
  check_sinks(sinks, q.shape[1])
  auto = impl == "auto"
  impl = resolve_impl("paged_attention", impl, interpret, q)
  threshold = block_sizes and block_sizes.reference_below_tokens
  if auto and not interpret and threshold and page_indices.shape[1] * k_pages.shape[2] < threshold:
    impl = "reference"
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  n, h, d = q.shape
  if n == 0:
    return jnp.zeros((0, h, d), q.dtype)
  return _run(
    q,
    k_pages,
    v_pages,
    lengths,
    page_indices,
    sinks,
    impl=impl,
    sm_scale=float(sm_scale),
    sliding_window=sliding_window,
    logit_softcap=logit_softcap,
    block_sizes=block_sizes,
    precision=precision,
    interpret=interpret,
    kernel_mesh=mesh,
  )
